use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use serde::Deserialize;
use spark_tool::checkpoint::QkvLayout;
use spark_tool::device::{self, Priority, Target, WeightFormat};
use spark_tool::formats::gguf::mix::FileType;
use spark_tool::quantize::recipe::{self, Recipe};
use spark_tool::quantize::{quantize, ForwardPrecision, QuantReport, QuantizeOptions};

#[derive(Clone, Copy, ValueEnum)]
pub enum FormatArg {
    Auto,
    W4a8,
    W4a16,
    // llama.cpp's own spellings (Q4_K_M, q4_0, ...) are aliases; the flag ignores case.
    #[value(name = "gguf-q4_0", alias = "q4_0")]
    GgufQ4_0,
    #[value(name = "gguf-q4_k_m", alias = "q4_k_m")]
    GgufQ4KM,
    #[value(name = "gguf-q5_k_m", alias = "q5_k_m")]
    GgufQ5KM,
    #[value(name = "gguf-q8_0", alias = "q8_0")]
    GgufQ8_0,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum PriorityArg {
    Speed,
    Fidelity,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum TargetArg {
    Auto,
    X86Amx,
    X86,
    Arm,
    Phone,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum QkvArg {
    Fused,
    Split,
}

impl From<PriorityArg> for Priority {
    fn from(p: PriorityArg) -> Self {
        match p {
            PriorityArg::Speed => Priority::Speed,
            PriorityArg::Fidelity => Priority::Fidelity,
        }
    }
}

impl From<TargetArg> for Target {
    fn from(t: TargetArg) -> Self {
        match t {
            TargetArg::Auto => Target::Auto,
            TargetArg::X86Amx => Target::X86Amx,
            TargetArg::X86 => Target::X86,
            TargetArg::Arm => Target::Arm,
            TargetArg::Phone => Target::Phone,
        }
    }
}

#[derive(Args)]
pub struct ProbeArgs {
    /// What to optimise: speed (W4A8 on AMX) or fidelity (W4A16 g64).
    #[arg(long, value_enum, default_value = "speed")]
    priority: PriorityArg,
    /// Decide for another device instead of this CPU (auto = this CPU, or SPARK_TARGET when set).
    #[arg(long, value_enum, default_value = "auto")]
    target: TargetArg,
    /// Print the CPU's features and the decision as JSON.
    #[arg(long)]
    json: bool,
}

pub fn probe(a: ProbeArgs) -> anyhow::Result<()> {
    let f = device::detect();
    let path =
        device::decide_here(&f, a.target.into(), a.priority.into()).map_err(anyhow::Error::msg)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"cpu": f, "decision": path}))?
        );
    } else {
        println!("cpu: {}", device::describe(&f));
        println!(
            "weight path: {} g{} for {} (runs in vLLM: {}{})",
            serde_json::to_value(path.format)?.as_str().unwrap_or("?"),
            path.group_size,
            path.target,
            path.runs_in_vllm,
            path.kernel
                .map(|k| format!(", kernel {k}"))
                .unwrap_or_default()
        );
        if !path.verified {
            println!("  unverified on a real consumer");
        }
        for r in &path.reasons {
            println!("  - {r}");
        }
    }
    Ok(())
}

#[derive(Args)]
#[command(
    after_help = "Every other choice of the solve (the baselines rtn and gptq, the column order, the objective, \
the scale sign, the forward precision, the damping, and with a `--features lab` build the lab's refit, descent and \
tuning) is a key of the recipe: see docs/QUANTIZE.md \"Recipes\". Each output records its recipe (recipe.toml beside \
a checkpoint, spark_tool.recipe in a GGUF); `--recipe` of that output reproduces it byte for byte."
)]
pub struct QuantizeArgs {
    /// The original checkpoint: a folder or a Hugging Face hub id ORG/NAME[@REVISION] (from the Hugging Face cache, downloaded
    /// first if needed).
    model: PathBuf,
    /// Output folder: new, empty, or (with --force) a previous quantized checkpoint of spark-tool.
    #[arg(long)]
    out: PathBuf,
    /// auto: the probe's pick for --target (W4A8 on AMX, else W4A16; `spark-tool probe`). gguf-*:
    /// one llama.cpp GGUF file, --out FILE.gguf (Q4_0 and Q8_0 blocks, or llama.cpp's Q4_K_M or Q5_K_M mix;
    /// llama.cpp's spellings such as Q4_K_M are accepted). Default: auto, or the recipe's.
    #[arg(long, value_enum, ignore_case = true)]
    format: Option<FormatArg>,
    /// Weights per scale: 32, 64 or 128 (default: 128 for W4A8, 64 for W4A16).
    #[arg(long, value_parser = super::at_least_1)]
    group_size: Option<usize>,
    /// What the probe optimises when it picks the format: speed (W4A8 on AMX) or fidelity (W4A16 g64).
    #[arg(long, value_enum, default_value = "speed")]
    priority: PriorityArg,
    /// The device the checkpoint is for; auto = this CPU, or SPARK_TARGET when that is set.
    #[arg(long, value_enum, default_value = "auto")]
    target: TargetArg,
    /// Calibration text: .jsonl with {"text": ...} per line, or plain text (default: the bundled
    /// set, calibration/spark-calib.jsonl in the source tree, compiled into the binary).
    #[arg(long, num_args = 1..)]
    calibration: Vec<PathBuf>,
    /// Calibration windows, each --seq-len tokens (default 128).
    #[arg(long, value_parser = super::at_least_1)]
    samples: Option<usize>,
    /// Tokens per calibration window (default 512).
    #[arg(long, value_parser = super::at_least_1)]
    seq_len: Option<usize>,
    /// fused = one q_k_v_proj (what vLLM's Spark model loads; the default); split = q_proj/k_proj/v_proj.
    #[arg(long, value_enum)]
    qkv_layout: Option<QkvArg>,
    /// Untie the head and write it as 4-bit GPTQ too (`lm_head: true`).
    #[arg(long)]
    quantize_head: bool,
    /// GGUF: give the tensors whose name matches REGEX this type, as llama-quantize's flag does
    /// (e.g. ffn_down=q6_k; Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; repeatable, the first match wins).
    #[arg(long, value_name = "REGEX=TYPE")]
    tensor_type: Vec<String>,
    /// Start from this recipe: a .toml file, a checkpoint folder or GGUF file written by quantize
    /// (its recorded recipe); the flags above and --set override its keys.
    #[arg(long, value_name = "FILE")]
    recipe: Option<PathBuf>,
    /// Set one recipe key, e.g. --set method=rtn --set order=natural (repeatable; docs/QUANTIZE.md "Recipes").
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Continue an interrupted run from its last completed layer.
    #[arg(long)]
    resume: bool,
    /// Replace a previous quantized checkpoint at --out, once the new one is complete (docs/OUTPUTS.md).
    #[arg(long)]
    force: bool,
    /// Run even when the memory plan (printed at the start) exceeds the available memory.
    #[arg(long)]
    force_memory: bool,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Also print where the time went: wall and CPU time per phase (also in quant_report.json).
    #[arg(long)]
    stats: bool,
    /// Skip the RTN and plain-GPTQ comparison columns of the report (a fifth to a third of the time on Spark-1.7B shapes).
    #[arg(long)]
    no_compare: bool,
    /// Also write every quantized linear's dequantized f32 weight to this .safetensors file
    /// (what tools/gptq_decode.py checks the checkpoint against).
    #[arg(long, hide = true)]
    dump_dequantized: Option<PathBuf>,
}

/// The recipe key and TOML value of a format choice (a GGUF type sets `gguf`, a GPTQ format
/// `format` and clears `gguf`).
fn format_keys(f: FormatArg) -> Option<(WeightFormat, Option<FileType>)> {
    match f {
        FormatArg::Auto => None,
        FormatArg::W4a8 => Some((WeightFormat::W4A8, None)),
        FormatArg::W4a16 => Some((WeightFormat::W4A16, None)),
        FormatArg::GgufQ4_0 => Some((WeightFormat::W4A16, Some(FileType::Q4_0))),
        FormatArg::GgufQ4KM => Some((WeightFormat::W4A16, Some(FileType::Q4KM))),
        FormatArg::GgufQ5KM => Some((WeightFormat::W4A16, Some(FileType::Q5KM))),
        FormatArg::GgufQ8_0 => Some((WeightFormat::W4A16, Some(FileType::Q8_0))),
    }
}

/// A serde value as a TOML value (every recipe field has one).
fn toml_value<T: serde::Serialize>(v: T) -> toml::Value {
    toml::Value::try_from(v).expect("a recipe value has a TOML form")
}

/// Refuse flags that do not apply to a GGUF output, naming what llama.cpp decides instead.
fn check_gguf_flags(a: &QuantizeArgs) -> anyhow::Result<()> {
    if a.group_size.is_some() {
        bail!("--group-size does not apply to GGUF: each block type fixes its own (Q4_0/Q8_0/Q4_K 32, Q6_K 16)");
    }
    if a.quantize_head {
        bail!("--quantize-head does not apply to GGUF: the head's type is the file type's (Q6_K, Q8_0 for gguf-q8_0)");
    }
    if matches!(a.qkv_layout, Some(QkvArg::Split)) {
        bail!(
            "--qkv-layout does not apply to GGUF: llama.cpp's Spark graph reads one fused attn_qkv"
        );
    }
    if !matches!(a.target, TargetArg::Auto) {
        bail!("--target does not apply to GGUF: llama.cpp runs its block types with its own kernels on any CPU");
    }
    Ok(())
}

/// The recipe of this run and the device decision behind its format: the recipe file's keys
/// (if any), then the flags given, then `--set`; the probe picks what none of them fixes.
fn build_recipe(a: &QuantizeArgs) -> anyhow::Result<(Recipe, device::WeightPath)> {
    let mut t = match &a.recipe {
        Some(p) => recipe::load(p)?,
        None => toml::Table::new(),
    };
    if let Some((format, gguf)) = a.format.and_then(format_keys) {
        t.insert("format".into(), toml_value(format));
        match gguf {
            Some(ft) => t.insert("gguf".into(), toml_value(ft)),
            None => t.remove("gguf"),
        };
    }
    let flags = [
        ("group_size", a.group_size.map(toml_value)),
        ("samples", a.samples.map(toml_value)),
        ("seq_len", a.seq_len.map(toml_value)),
        ("quantize_head", a.quantize_head.then(|| toml_value(true))),
        (
            "calibration",
            (!a.calibration.is_empty()).then(|| toml_value(&a.calibration)),
        ),
        (
            "qkv_layout",
            a.qkv_layout.map(|q| {
                toml_value(match q {
                    QkvArg::Fused => QkvLayout::Fused,
                    QkvArg::Split => QkvLayout::Split,
                })
            }),
        ),
    ];
    for (key, v) in flags {
        if let Some(v) = v {
            t.insert(key.into(), v);
        }
    }
    if !a.tensor_type.is_empty() {
        // The flags' patterns come first: the first match wins over a recipe file's.
        let mut all: Vec<toml::Value> = a.tensor_type.iter().map(toml_value).collect();
        if let Some(toml::Value::Array(file)) = t.remove("tensor_types") {
            all.extend(file);
        }
        t.insert("tensor_types".into(), toml::Value::Array(all));
    }
    for s in &a.set {
        recipe::set(&mut t, s)?;
    }
    let gguf = t.contains_key("gguf");
    if gguf {
        check_gguf_flags(a)?;
    }
    check_out_name(&a.out, gguf)?;
    let features = device::detect();
    // GGUF asks no probe (llama.cpp picks its kernels per CPU), so SPARK_TARGET does not apply.
    let mut path = if gguf {
        device::decide(&features, a.target.into(), a.priority.into())
    } else {
        device::decide_here(&features, a.target.into(), a.priority.into())
            .map_err(anyhow::Error::msg)?
    };
    // An explicit --target decides the lattice (and the format, unless given) over a recipe file.
    let target_given = !matches!(a.target, TargetArg::Auto);
    if target_given && a.format.is_none() && !gguf {
        t.remove("format");
    }
    if target_given || !t.contains_key("lpbq") {
        t.insert("lpbq".into(), toml::Value::Boolean(path.lpbq && !gguf));
    }
    let explicit = t
        .get("format")
        .map(|f| WeightFormat::deserialize(f.clone()))
        .transpose()
        .map_err(|e| anyhow::anyhow!("recipe key format: {e}"))?;
    let given_group = t
        .get("group_size")
        .and_then(toml::Value::as_integer)
        .map(|g| g as usize);
    let (format, group_size) = path.override_with(explicit, given_group);
    t.insert("format".into(), toml_value(format));
    t.insert("group_size".into(), toml_value(group_size));
    if !t.contains_key("forward_precision") {
        // llama.cpp feeds its linears f32; vLLM feeds a GPTQ checkpoint's bf16.
        let fp = if gguf {
            ForwardPrecision::F32
        } else {
            ForwardPrecision::Bf16
        };
        t.insert("forward_precision".into(), toml_value(fp));
    }
    let origin = a
        .recipe
        .as_ref()
        .map_or("the flags".to_string(), |p| p.display().to_string());
    let r = recipe::from_table(t, &origin)?;
    r.validate()?;
    Ok((r, path))
}

/// Whether `out` names a GGUF file.
fn gguf_name(out: &std::path::Path) -> bool {
    out.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A GGUF goes to FILE.gguf, a GPTQ checkpoint to a folder that is not named like one.
fn check_out_name(out: &std::path::Path, gguf: bool) -> anyhow::Result<()> {
    if gguf && !gguf_name(out) {
        bail!(
            "--out {}: a GGUF file's name ends in .gguf (llama.cpp's tools expect it), e.g. --out {}.gguf",
            out.display(),
            out.display()
        );
    }
    if !gguf && gguf_name(out) {
        bail!(
            "--out {} ends in .gguf, but this format writes a GPTQ checkpoint folder; for a GGUF \
             file pass --format gguf-q4_k_m (or gguf-q4_0, gguf-q5_k_m, gguf-q8_0)",
            out.display()
        );
    }
    Ok(())
}

pub fn run(a: QuantizeArgs, out: super::Verbosity) -> anyhow::Result<()> {
    let model_dir = super::model(&a.model)?;
    let (recipe, path) = build_recipe(&a)?;
    let mut opts = QuantizeOptions::new(&model_dir, &a.out, recipe, path);
    opts.resume = a.resume;
    opts.force = a.force;
    opts.force_memory = a.force_memory;
    opts.progress = !out.quiet && !a.json;
    opts.compare = !a.no_compare;
    opts.dump_dequantized = a.dump_dequantized.clone();
    opts.keep_on_interrupt = true;
    opts.page = Some(write_page);
    let report = quantize(&opts).with_context(|| format!("quantizing {}", model_dir.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_summary(&report, out.verbose)?;
    if a.stats {
        print_phases(&report)?;
    }
    print_next_steps(
        &model_dir,
        &a.out,
        report.recipe.gguf.is_some(),
        report.path.lpbq,
    );
    Ok(())
}

/// The run in a few lines: format, calibration, errors, size, time and memory (`verbose`: every
/// linear's error too).
fn print_summary(report: &QuantReport, verbose: bool) -> anyhow::Result<()> {
    let format = match report.recipe.gguf {
        Some(ft) => format!("GGUF {}", ft.llama_name()),
        None => format!(
            "{} g{}",
            serde_json::to_value(report.recipe.format)?
                .as_str()
                .unwrap_or("?"),
            report.recipe.group_size
        ),
    };
    println!(
        "{} → {}: {format} ({} samples × {} tokens, calibration sha256 {}…)",
        report.model,
        report.out,
        report.samples,
        report.seq_len,
        &report.calibration_sha256[..12]
    );
    let e = |v: Option<f64>| v.map(|v| format!("{v:.3e}")).unwrap_or_else(|| "-".into());
    if verbose {
        println!(
            "{:<42} {:>11} {:>11} {:>11} {:>7} {:>7}",
            "linear", "rtn", "gptq", "gptq+srch", "damp", "s"
        );
        for l in &report.linears {
            println!(
                "{:<42} {:>11} {:>11} {:>11} {:>7.3} {:>7.2}",
                l.name,
                e(l.rtn_error),
                e(l.gptq_error),
                e(l.gptq_search_error),
                l.damp,
                l.seconds
            );
        }
    }
    println!(
        "mean relative output error: rtn {}, gptq {}, gptq+search {}; written ({}) {:.3e}",
        e(report.mean_rtn_error),
        e(report.mean_gptq_error),
        e(report.mean_gptq_search_error),
        serde_json::to_value(report.recipe.method)?
            .as_str()
            .unwrap_or("?"),
        report.mean_error
    );
    if let Some(a) = report.mean_act_error {
        let worst = report
            .linears
            .iter()
            .filter_map(|l| Some((l.act_error?, l)))
            .max_by(|x, y| x.0.total_cmp(&y.0));
        if let Some((w, l)) = worst {
            println!(
                "W4A8 int8 activation rounding adds {a:.3e} on average (largest {w:.3e}, {}: {:.0} % of its weights' error)",
                l.name,
                100.0 * w / l.error.max(f64::MIN_POSITIVE)
            );
        }
    }
    if let Some(s) = report.stream_error {
        println!(
            "residual stream after the last layer: {s:.3e} of the float model's (relative squared distance, calibration tokens)"
        );
    }
    if let Some((mean, lo, hi, n)) = report.stream_weights() {
        println!(
            "stream correction weight (split half) over {n} out_proj/down_proj: mean {mean:.2}, {lo:.2}–{hi:.2}"
        );
    }
    if !report.block_tune_layers.is_empty() {
        println!(
            "{:<8} {:>13} {:>13} {:>8} {:>12} {:>8}",
            "layer", "block error", "tuned", "change", "codes moved", "s"
        );
        for l in &report.block_tune_layers {
            println!(
                "{:<8} {:>13.4e} {:>13.4e} {:>+7.2}% {:>12} {:>8.1}",
                l.layer,
                l.error_before,
                l.error_after,
                100.0 * (l.error_after / l.error_before.max(f64::MIN_POSITIVE) - 1.0),
                l.codes_moved,
                l.seconds
            );
        }
    }
    if let Some(m) = &report.model_tune_result {
        println!(
            "model tuning: calibration KL {:.4e} -> {:.4e} ({:+.2} %), {} codes moved, {:.0} s ({:.2} s per step)",
            m.kl_before,
            m.kl_after,
            100.0 * (m.kl_after / m.kl_before.max(f64::MIN_POSITIVE) - 1.0),
            m.codes_moved,
            m.seconds,
            m.step_seconds
        );
    }
    let gb = |b: Option<u64>| {
        b.map(|b| format!("{:.2} GB", b as f64 / 1e9))
            .unwrap_or("?".into())
    };
    println!(
        "{:.3} bits per weight over all tensors ({:.2} MB), wall {:.1} s, CPU {:.0} % of {} threads, peak RSS {} (private {})",
        report.bits_per_weight,
        report.output_bytes as f64 / 1e6,
        report.wall_seconds,
        report.cpu_utilisation * 100.0,
        report.threads,
        gb(report.peak_rss_bytes),
        gb(report.peak_private_bytes),
    );
    Ok(())
}

/// Where the time went, per phase (`--stats`).
fn print_phases(report: &QuantReport) -> anyhow::Result<()> {
    println!(
        "{:<14} {:>10} {:>7} {:>10}",
        "phase", "wall s", "% wall", "CPU use"
    );
    for p in &report.phases {
        println!(
            "{:<14} {:>10.2} {:>6.1}% {:>9.0}%",
            serde_json::to_value(p.phase)?.as_str().unwrap_or("?"),
            p.seconds,
            100.0 * p.seconds / report.wall_seconds.max(1e-9),
            100.0 * p.utilisation
        );
    }
    let timed: f64 = report.phases.iter().map(|p| p.seconds).sum();
    println!(
        "{:<14} {:>10.2} {:>6.1}%",
        "(other)",
        report.wall_seconds - timed,
        100.0 * (report.wall_seconds - timed) / report.wall_seconds.max(1e-9)
    );
    Ok(())
}

/// quant_report.html beside quant_report.json, inside the checkpoint before it is committed.
fn write_page(
    dir: &std::path::Path,
    r: &QuantReport,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    Ok(spark_tool::report::quantize::write_html(dir, r)?)
}

/// What was written and what to run next: check it, then hand it to its consumer.
fn print_next_steps(model: &std::path::Path, out: &std::path::Path, gguf: bool, phone: bool) {
    let (m, o) = (model.display(), out.display());
    if gguf {
        println!("wrote {o}");
        println!("next: spark-tool parity {m} {o}     # check it against the original");
        println!("      llama-server -m {o}           # serve it with llama.cpp");
    } else {
        println!(
            "wrote {o}/ (model.safetensors, config.json, quant_report.json; the report page: {})",
            out.join("quant_report.html").display()
        );
        println!("next: spark-tool parity {m} {o}     # check it against the original");
        if phone {
            println!("      spark-tool export-phone {o} --precision w4a16 --out {o}-phone   # the phone graph");
        } else {
            println!("      vllm serve {o} --dtype bfloat16   # serve it with vLLM (README.md)");
        }
    }
}
