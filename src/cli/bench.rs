use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use spark_tool::checkpoint::Checkpoint;
use spark_tool::model::SparkModel;
use spark_tool::report::{self, bench::BenchRun, bench::LlamacppComparison};

use super::run::ExecArgs;

#[derive(Args)]
pub struct BenchArgs {
    /// Original or GPTQ checkpoint folder or a Hugging Face hub id ORG/NAME[@REVISION] (GGUF files and phone exports are not
    /// benchmarked here).
    model: PathBuf,
    /// Prompt tokens prefilled per repeat.
    #[arg(long, default_value_t = 512, value_parser = super::at_least_1)]
    prompt_len: usize,
    /// Tokens decoded per repeat.
    #[arg(long, default_value_t = 128, value_parser = super::at_least_1)]
    gen: usize,
    /// Repeats; min, median and max are reported.
    #[arg(long, default_value_t = 3, value_parser = super::at_least_1)]
    repeat: usize,
    /// Print the results as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Also write the results as one self-contained HTML page with charts.
    #[arg(long, conflicts_with = "kernels")]
    html: Option<PathBuf>,
    /// With --html: add the side-by-side with llama.cpp from `tools/bench_vs_llamacpp.py --json`.
    #[arg(long, requires = "html")]
    llamacpp_json: Option<PathBuf>,
    /// Also time each stage of the forward pass (projections, attention, norms,
    /// GELU, head) over one extra prefill + decode run.
    #[arg(long)]
    stages: bool,
    /// Also set decode against this machine's bandwidth ceiling: a streaming read of a 1 GiB
    /// buffer (held for the benchmark: +1 GiB of RSS) before the first repeat and after each,
    /// and the bytes a decode step reads (weights and KV cache); each repeat's decode rate as a
    /// percentage of the ceiling from the reads around it.
    #[arg(long, conflicts_with = "kernels")]
    ceiling: bool,
    /// Instead of the model: time each linear kernel on the artifact's weight
    /// shapes (random weights, decode rows), the streaming-read bandwidth and this CPU's
    /// multiply-add peaks (each kernel reported as a share of its instruction's peak).
    #[arg(long)]
    kernels: bool,
    /// With --kernels: activation rows per call.
    #[arg(long, default_value_t = 1, requires = "kernels", value_parser = super::at_least_1)]
    rows: usize,
    /// With --kernels: only rows whose "linear kernel" label contains this, e.g. `lm_head` or `w4a8`
    /// (the slow scalar W4A8 reference only when this names `scalar`).
    #[arg(long, requires = "kernels")]
    only: Option<String>,
    /// With --kernels: weight bytes cycled per kernel (default 256 MB, more than any cache);
    /// a value that fits in cache (e.g. 1) measures compute speed instead of memory speed.
    #[arg(long, requires = "kernels", value_parser = working_set)]
    working_set_mb: Option<f64>,
    #[command(flatten)]
    exec: ExecArgs,
}

fn working_set(s: &str) -> Result<f64, String> {
    match super::finite(s) {
        Ok(v) if v > 0.0 => Ok(v),
        _ => Err(format!("expected a number of MB > 0, got '{s}'")),
    }
}

fn run_kernels(a: &BenchArgs, ck: &Checkpoint) -> anyhow::Result<()> {
    use spark_tool::bench::{bench_kernel, stream_read_gb_s, KernelKind};
    let c = &ck.config;
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    let shapes = [
        ("q_k_v_proj", c.q_dim() + 2 * c.kv_dim(), h),
        ("gate_proj/up_proj", inter, h),
        ("down_proj", h, inter),
        ("lm_head", c.vocab_size, h),
    ];
    let selected = |name: &str, kind: KernelKind| {
        // The head stays dense.
        let head_kind = matches!(
            kind,
            KernelKind::Bf16 | KernelKind::Bf16F32Act | KernelKind::F32Gemm
        );
        let wanted = a.only.as_ref().is_none_or(|f| {
            // The scalar reference takes seconds per call at prefill rows: a filter for the
            // fast kernels (`w4a8 g128`) must not also select it.
            let scalar_unasked = kind == KernelKind::W4A8Scalar && !f.contains("scalar");
            !scalar_unasked && format!("{name} {}", kind.name()).contains(f.as_str())
        });
        (name != "lm_head" || head_kind) && wanted
    };
    if let Some(f) = &a.only {
        let any = shapes
            .iter()
            .any(|(name, ..)| KernelKind::all().into_iter().any(|k| selected(name, k)));
        if !any {
            let labels: Vec<String> = KernelKind::all()
                .iter()
                .map(|k| k.name().to_string())
                .collect();
            anyhow::bail!(
                "--only {f:?} matches no kernel row; a row's label is the linear ({}) and the kernel ({})",
                shapes.map(|s| s.0).join(", "),
                labels.join(", ")
            );
        }
    }
    let bw = stream_read_gb_s(a.repeat);
    let peaks = spark_tool::kernels::peak::measure(spark_tool::kernels::isa::isa(), a.repeat);
    if !a.json {
        for p in &peaks {
            println!(
                "peak {:<12} {:<19} {:>8.1} G MAC/s 1 thread, {:>8.1} G MAC/s {} threads",
                p.instruction, p.operands, p.one_thread_gmacs, p.all_threads_gmacs, p.threads
            );
        }
    }
    let share_of = |r: &spark_tool::bench::KernelRow, name: &str| -> Option<f64> {
        let p = spark_tool::kernels::peak::of(&peaks, name)?;
        let threads = rayon::current_num_threads();
        let peak = if threads == 1 {
            p.one_thread_gmacs
        } else {
            p.all_threads_gmacs
        };
        Some(100.0 * r.gmacs / peak)
    };
    let share = |r: &spark_tool::bench::KernelRow| share_of(r, r.instruction?);
    // Tile kernels and W4A16 decode: also the share of their measured step with loads (their
    // practical bound from cache).
    let step_share = |r: &spark_tool::bench::KernelRow| share_of(r, r.step?);
    let mut rows = vec![];
    for (name, n, k) in shapes {
        for kind in KernelKind::all() {
            if !selected(name, kind) {
                continue;
            }
            let ws = a.working_set_mb.map(|mb| (mb * 1e6) as usize);
            let r = bench_kernel(kind, n, k, a.rows, a.repeat, ws);
            if !a.json {
                let mut peak = match (r.instruction, share(&r)) {
                    (Some(i), Some(pct)) => {
                        format!("  {:>7.1} G MAC/s {pct:>4.0}% of {i}", r.gmacs)
                    }
                    _ => String::new(),
                };
                if let (Some(step), Some(pct)) = (r.step, step_share(&r)) {
                    peak += &format!(", {pct:.0}% of {step}");
                }
                println!(
                    "{name:<18} {:>7} x {:<6} {:<17} {:>8.1} MB  median {:>9.1} us (min {:>9.1})  {:>6.1} GB/s  {:>4.0}% of stream{peak}",
                    n,
                    k,
                    r.kernel,
                    r.weight_bytes as f64 / 1e6,
                    r.us_per_call.median,
                    r.us_per_call.min,
                    r.gb_s,
                    100.0 * r.gb_s / bw.median
                );
            }
            rows.push((name, r));
        }
    }
    if a.json {
        let v = serde_json::json!({
            "threads": rayon::current_num_threads(),
            "rows": a.rows,
            "stream_read_gb_s": bw,
            "peaks": peaks,
            "decode_walk": spark_tool::kernels::decode_walk(),
            "kernels": rows.iter().map(|(name, r)| {
                let mut v = serde_json::to_value(r).expect("plain struct");
                v["linear"] = (*name).into();
                v["percent_of_peak"] = share(r).into();
                v["percent_of_step"] = step_share(r).into();
                v
            }).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "stream read {:.1} GB/s median (min {:.1}, max {:.1}), {} threads, {} activation rows, decode walk: {}",
            bw.median,
            bw.min,
            bw.max,
            rayon::current_num_threads(),
            a.rows,
            spark_tool::kernels::decode_walk()
        );
    }
    Ok(())
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let dir = super::model(&a.model)?;
    let t = Instant::now();
    let ck = Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    if !a.kernels {
        a.exec.check_w4_numerics(&dir, ck.config.gptq.is_some())?;
    }
    if a.kernels {
        let c = &ck.config;
        let widest = c
            .vocab_size
            .max(c.intermediate_size)
            .max(c.q_dim() + 2 * c.kv_dim());
        // Activation rows in and out of the widest kernel, plus the cycled weights.
        let need = a.rows as u128 * 2 * widest as u128 * 4
            + a.working_set_mb.map_or(256e6, |mb| mb.max(0.0) * 1e6) as u128;
        spark_tool::resources::check_fits(
            &format!("--rows {} of the kernel benchmark", a.rows),
            need,
            spark_tool::setting::Setting::Rows,
        )?;
        return run_kernels(&a, &ck);
    }
    spark_tool::bench::plan(&ck.config, a.prompt_len, a.gen, a.ceiling)?;
    // The page's path and the comparison are checked before the benchmark runs.
    if let Some(path) = &a.html {
        let mut inputs = vec![dir.as_path()];
        inputs.extend(a.llamacpp_json.as_deref());
        report::check_html_path(path, &inputs)?;
    }
    let llamacpp = a
        .llamacpp_json
        .as_deref()
        .map(LlamacppComparison::read)
        .transpose()?;
    let model = SparkModel::load(&ck, a.exec.options(&ck, false))?;
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    let r = spark_tool::bench::run(&model, a.prompt_len, a.gen, a.repeat, a.ceiling)
        .map_err(|e| super::model_error(e, &dir))?;
    let stages = if a.stages {
        Some(spark_tool::bench::stage_profile(
            &model,
            a.prompt_len,
            a.gen,
        )?)
    } else {
        None
    };
    let rss = spark_tool::bench::peak_rss();
    if let Some(path) = &a.html {
        let run = BenchRun {
            artifact: &dir.display().to_string(),
            load_ms,
            peak_rss_bytes: rss,
            report: &r,
            stages: stages.as_ref(),
        };
        report::bench::write_html(path, &run, llamacpp.as_ref())?;
    }
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        v["artifact"] = dir.display().to_string().into();
        v["load_ms"] = load_ms.into();
        v["peak_rss_bytes"] = rss.into();
        if let Some(p) = &stages {
            v["stages"] = serde_json::to_value(p)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{}: prompt {} tokens, {} generated, {} repeats, {} threads (load {:.0} ms, peak RSS {})",
        dir.display(),
        r.prompt_len,
        r.gen,
        r.repeat,
        r.threads,
        load_ms,
        rss.map(|b| format!("{:.2} GB", b as f64 / 1e9))
            .unwrap_or("?".into())
    );
    print_spreads(&[
        ("prefill tok/s", &r.prefill_tok_s),
        ("decode tok/s", &r.decode_tok_s),
        ("time to first token ms", &r.time_to_first_token_ms),
        ("decode ms/token", &r.decode_ms_per_token),
        ("sampling ms (total)", &r.sampling_ms),
    ]);
    if let Some(c) = &r.ceiling {
        let w = &c.weight_bytes;
        println!(
            "  bytes per decode step      {:.1} MB: linears {:.1}, head {:.1}, norms {:.2}, KV cache {:.1} (at the mean decode position)",
            (w.total() + c.kv_bytes) as f64 / 1e6,
            w.linears as f64 / 1e6,
            w.head as f64 / 1e6,
            w.norms as f64 / 1e6,
            c.kv_bytes as f64 / 1e6
        );
        print_spreads(&[
            ("stream read GB/s", &c.stream_read_gb_s),
            ("decode ceiling tok/s", &c.ceiling_tok_s),
            ("decode % of ceiling", &c.percent_of_ceiling),
        ]);
    }
    if let Some(p) = stages {
        println!(
            "  stages (one more run)        prefill {:.1} ms total      decode {:.2} ms/token",
            p.prefill_ms, p.decode_ms_per_token
        );
        for (pre, dec) in p.prefill.iter().zip(&p.decode) {
            println!(
                "    {:<28} {:>9.1} ms {:>5.1}%     {:>8.3} ms {:>5.1}%",
                pre.stage,
                pre.ms,
                100.0 * pre.share,
                dec.ms,
                100.0 * dec.share
            );
        }
    }
    Ok(())
}

fn print_spreads(rows: &[(&str, &spark_tool::bench::Spread)]) {
    for (name, s) in rows {
        println!(
            "  {name:<24} median {:>10.2}   min {:>10.2}   max {:>10.2}",
            s.median, s.min, s.max
        );
    }
}
