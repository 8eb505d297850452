use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use spark_tool::calibration;
use spark_tool::checkpoint::QkvLayout;
use spark_tool::device::{self, Priority, Target, WeightFormat};
use spark_tool::formats::gguf::mix::FileType;
use spark_tool::quant::Order;
use spark_tool::quantize::block_tune::BlockTune;
use spark_tool::quantize::model_tune::ModelTune;
use spark_tool::quantize::{
    quantize, ForwardPrecision, Method, Objective, QuantReport, QuantizeOptions,
};

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
pub enum MethodArg {
    Rtn,
    Gptq,
    GptqSearch,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ObjectiveArg {
    FloatStream,
    FloatOutput,
    QuantizedInput,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ForwardArg {
    Bf16,
    F32,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum OrderArg {
    /// Inputs in their natural order.
    Natural,
    /// Descending activation energy (diag H) with static groups; the stored layout is unchanged.
    ActStatic,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ScaleSignArg {
    /// A group's scale may be negative, giving its positive weights the grid's long side
    /// (q − 8 reaches −8 but only +7).
    Signed,
    /// Positive scales only.
    Positive,
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

fn damp(s: &str) -> Result<f64, String> {
    match super::finite(s) {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!(
            "expected a number in (0, 1] (fraction of the mean Hessian diagonal), got '{s}'"
        )),
    }
}

#[derive(Args)]
#[command(
    after_help = "Options for experiments and baselines, not shown above (docs/QUANTIZE.md \"Options for experiments\"): \
--method, --order, --scale-sign, --objective, --forward-precision, --damp, --refit-rounds, --descent-passes, \
--block-tune[-steps|-check|-int8], --model-tune[-steps|-lr|-codes-lr|-batch|-int8|-seed], --dump-dequantized."
)]
pub struct QuantizeArgs {
    /// The original checkpoint: a folder or a Hugging Face hub id ORG/NAME[@REVISION] (from the Hugging Face cache, downloaded
    /// first if needed).
    model: PathBuf,
    /// Output folder: new, empty, or (with --force) a previous quantized checkpoint of spark-tool.
    #[arg(long)]
    out: PathBuf,
    /// auto: the probe's pick for --target (W4A8 on AMX, else W4A16; `spark-tool probe`). gguf-*:
    /// one llama.cpp GGUF file, --out FILE.gguf (Q4_0 and Q8_0 blocks, or llama.cpp's Q4_K_M mix;
    /// llama.cpp's spellings such as Q4_K_M are accepted).
    #[arg(long, value_enum, ignore_case = true, default_value = "auto")]
    format: FormatArg,
    /// Weights per scale: 32, 64 or 128 (default: 128 for W4A8, 64 for W4A16).
    #[arg(long, value_parser = super::at_least_1)]
    group_size: Option<usize>,
    /// The quantizer that writes the weights (rtn and gptq are baselines for comparisons).
    #[arg(long, value_enum, default_value = "gptq-search", hide = true)]
    method: MethodArg,
    /// The order GPTQ visits each linear's inputs in (docs/QUANTIZE.md; act-static measured best,
    /// docs/FIDELITY.md); either way the checkpoint has the plain no-act-order layout (g_idx = k / G)
    /// that vLLM's CPU kernels take.
    #[arg(long, value_enum, default_value = "act-static", hide = true)]
    order: OrderArg,
    /// The sign of `gptq-search`'s group scales. Default: signed for GPTQ checkpoints and for
    /// gguf-q4_0 / gguf-q8_0 blocks (lower held-out KL, docs/FIDELITY.md, docs/GGUF.md; Q8_0 within
    /// the spread; vLLM and llama.cpp multiply by the scale whatever its sign), positive for
    /// `--target phone` and the K-quants, whose block multipliers are unsigned.
    #[arg(long, value_enum, hide = true)]
    scale_sign: Option<ScaleSignArg>,
    /// After GPTQ, rounds of refitting each group's scale to the linear's output error (codes fixed)
    /// and re-solving GPTQ's codes for those scales; the lowest output error is kept (docs/QUANTIZE.md).
    #[arg(long, default_value_t = 0, hide = true)]
    refit_rounds: usize,
    /// After GPTQ, passes of coordinate descent on the codes (scales fixed): each code becomes the
    /// grid point that lowers the linear's output error most with the others held, until a pass
    /// changes nothing or the passes run out (docs/QUANTIZE.md "Coordinate descent").
    #[arg(long, default_value_t = 0, hide = true)]
    descent_passes: usize,
    /// After each layer's solve, tune its codes (±1 step), group scales and norms to the float
    /// model's block output (Adam, straight-through rounding; docs/FIDELITY.md "Block tuning").
    /// Lowers held-out KL by 3–6 % on the fixtures at a large cost in time on big models.
    #[arg(long, hide = true)]
    block_tune: bool,
    /// Optimiser steps per layer of --block-tune.
    #[arg(long, default_value_t = BlockTune::default().steps, value_parser = super::at_least_1, requires = "block_tune", hide = true)]
    block_tune_steps: usize,
    /// Every this many steps of --block-tune, score the stored state on all calibration windows
    /// and keep the best one seen; 0 keeps the final state (either way a layer whose error did not
    /// fall keeps GPTQ's solution).
    #[arg(long, default_value_t = BlockTune::default().check, requires = "block_tune", hide = true)]
    block_tune_check: usize,
    /// Tune with every quantized linear's input rounded per token to int8, as W4A8 kernels
    /// (vLLM's `int4_scaled_mm_cpu`) round it.
    #[arg(long, requires = "block_tune", hide = true)]
    block_tune_int8: bool,
    /// After every layer is solved, tune all group scales and norm gains together to the float
    /// model's next-token distribution (KL; docs/FIDELITY.md "Model tuning").
    #[arg(long, hide = true)]
    model_tune: bool,
    /// Optimiser steps of --model-tune.
    #[arg(long, default_value_t = ModelTune::default().steps, value_parser = super::at_least_1, requires = "model_tune", hide = true)]
    model_tune_steps: usize,
    /// Adam's step for the scale factors of --model-tune.
    #[arg(long, default_value_t = ModelTune::default().scale_lr, value_parser = super::non_negative, requires = "model_tune", hide = true)]
    model_tune_lr: f64,
    /// Adam's step for code offsets in --model-tune (0: codes stay GPTQ's).
    #[arg(long, default_value_t = ModelTune::default().codes_lr, value_parser = super::non_negative, requires = "model_tune", hide = true)]
    model_tune_codes_lr: f64,
    /// Calibration windows per step of --model-tune.
    #[arg(long, default_value_t = ModelTune::default().batch, value_parser = super::at_least_1, requires = "model_tune", hide = true)]
    model_tune_batch: usize,
    /// Tune with every quantized linear's input rounded per token to int8, as W4A8 kernels round it.
    #[arg(long, requires = "model_tune", hide = true)]
    model_tune_int8: bool,
    /// Seed of --model-tune's batch order (recorded in the report; on spark-tiny, held-out KL moved
    /// by about ±1 % between seeds, docs/FIDELITY.md).
    #[arg(long, default_value_t = ModelTune::default().seed, requires = "model_tune", hide = true)]
    model_tune_seed: u64,
    /// What each linear is solved to reproduce: float-stream (the default: the float model's
    /// output from the quantized model's input, and for out_proj and down_proj, which add to the
    /// residual stream, as much of the float model's stream after their add as the calibration
    /// shows their input can predict), float-output (the float output for every linear, GPTAQ), or
    /// quantized-input (the output of the quantized input, classic GPTQ). docs/FIDELITY.md and
    /// docs/GGUF.md measure all three.
    #[arg(long, value_enum, hide = true)]
    objective: Option<ObjectiveArg>,
    /// What the calibration forward feeds each linear: bf16 values (as vLLM feeds a GPTQ
    /// checkpoint; products on `vdpbf16ps`, about twice as fast) or f32 (as llama.cpp does).
    /// Default: bf16 for GPTQ checkpoints, f32 for GGUF (docs/QUANTIZE.md).
    #[arg(long, value_enum, hide = true)]
    forward_precision: Option<ForwardArg>,
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
    /// Calibration windows (samples × seq-len tokens are read).
    #[arg(long, default_value_t = 128, value_parser = super::at_least_1)]
    samples: usize,
    /// Tokens per calibration window.
    #[arg(long, default_value_t = 512, value_parser = super::at_least_1)]
    seq_len: usize,
    /// fused = one q_k_v_proj (what vLLM's Spark model loads); split = q_proj/k_proj/v_proj.
    #[arg(long, value_enum, default_value = "fused")]
    qkv_layout: QkvArg,
    /// Untie the head and write it as 4-bit GPTQ too (`lm_head: true`).
    #[arg(long)]
    quantize_head: bool,
    /// Initial GPTQ damping (fraction of mean diag H); raised automatically if Cholesky fails.
    #[arg(long, default_value_t = 0.01, value_parser = damp, hide = true)]
    damp: f64,
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
    /// No progress bars.
    #[arg(short, long)]
    quiet: bool,
    /// Also print every linear's output error (quant_report.json and .html always hold them).
    #[arg(short, long)]
    verbose: bool,
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

pub fn run(a: QuantizeArgs) -> anyhow::Result<()> {
    let model_dir = super::model(&a.model)?;
    let features = device::detect();
    let (explicit, gguf) = match a.format {
        FormatArg::Auto => (None, None),
        FormatArg::W4a8 => (Some(WeightFormat::W4A8), None),
        FormatArg::W4a16 => (Some(WeightFormat::W4A16), None),
        // llama.cpp runs GGUF with its own kernels; the device probe does not apply.
        FormatArg::GgufQ4_0 => (Some(WeightFormat::W4A16), Some(FileType::Q4_0)),
        FormatArg::GgufQ4KM => (Some(WeightFormat::W4A16), Some(FileType::Q4KM)),
        FormatArg::GgufQ8_0 => (Some(WeightFormat::W4A16), Some(FileType::Q8_0)),
    };
    // GGUF asks no probe (llama.cpp picks its kernels per CPU), so SPARK_TARGET does not apply.
    let mut path = match gguf {
        Some(_) => device::decide(&features, a.target.into(), a.priority.into()),
        None => device::decide_here(&features, a.target.into(), a.priority.into())
            .map_err(anyhow::Error::msg)?,
    };
    let gguf_name = a
        .out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if gguf.is_some() && !gguf_name {
        bail!(
            "--out {}: a GGUF file's name ends in .gguf (llama.cpp's tools expect it), e.g. --out {}.gguf",
            a.out.display(),
            a.out.display()
        );
    }
    if gguf.is_none() && gguf_name {
        bail!(
            "--out {} ends in .gguf, but this format writes a GPTQ checkpoint folder; for a GGUF \
             file pass --format gguf-q4_k_m (or gguf-q4_0, gguf-q8_0)",
            a.out.display()
        );
    }
    if gguf.is_some() && a.group_size.is_some() {
        bail!("--group-size does not apply to GGUF: each block type fixes its own (Q4_0/Q8_0/Q4_K 32, Q6_K 16)");
    }
    if gguf.is_some() && a.quantize_head {
        bail!("--quantize-head does not apply to GGUF: the head's type is the file type's (Q6_K, Q8_0 for gguf-q8_0)");
    }
    if gguf.is_some() && matches!(a.qkv_layout, QkvArg::Split) {
        bail!(
            "--qkv-layout does not apply to GGUF: llama.cpp's Spark graph reads one fused attn_qkv"
        );
    }
    if gguf.is_some() && !matches!(a.target, TargetArg::Auto) {
        bail!("--target does not apply to GGUF: llama.cpp runs its block types with its own kernels on any CPU");
    }
    if a.scale_sign.is_some() && !matches!(a.method, MethodArg::GptqSearch) {
        bail!("--scale-sign applies to --method gptq-search (rtn and gptq take max/7.5 scales)");
    }
    if matches!(a.scale_sign, Some(ScaleSignArg::Signed)) {
        if gguf.is_some_and(|ft| !ft.signed_scales()) {
            bail!("--scale-sign signed does not apply to gguf-q4_k_m: Q4_K's and Q6_K's sub-block scales are unsigned (gguf-q4_0 and gguf-q8_0 take signed block scales)");
        }
        if path.lpbq {
            bail!("--scale-sign signed does not apply to --target phone: QNN's LPBQ block multipliers are unsigned");
        }
    }
    let (format, group_size) = path.override_with(explicit, a.group_size);
    let opts = QuantizeOptions {
        model_dir: model_dir.clone(),
        out_dir: a.out.clone(),
        format,
        group_size,
        method: match a.method {
            MethodArg::Rtn => Method::Rtn,
            MethodArg::Gptq => Method::Gptq,
            MethodArg::GptqSearch => Method::GptqSearch,
        },
        order: match a.order {
            OrderArg::Natural => Order::Natural,
            OrderArg::ActStatic => Order::ActStatic,
        },
        signed_scales: !matches!(a.scale_sign, Some(ScaleSignArg::Positive)),
        refit_rounds: a.refit_rounds,
        descent_passes: a.descent_passes,
        objective: match a.objective {
            Some(ObjectiveArg::FloatStream) | None => Objective::FloatStream,
            Some(ObjectiveArg::FloatOutput) => Objective::FloatOutput,
            Some(ObjectiveArg::QuantizedInput) => Objective::QuantizedInput,
        },
        forward_precision: match (a.forward_precision, gguf) {
            (Some(ForwardArg::Bf16), _) | (None, None) => ForwardPrecision::Bf16,
            (Some(ForwardArg::F32), _) | (None, Some(_)) => ForwardPrecision::F32,
        },
        path,
        calibration: if a.calibration.is_empty() {
            vec![calibration::bundled()]
        } else {
            a.calibration.clone()
        },
        samples: a.samples,
        seq_len: a.seq_len,
        qkv_layout: match a.qkv_layout {
            QkvArg::Fused => QkvLayout::Fused,
            QkvArg::Split => QkvLayout::Split,
        },
        quantize_head: a.quantize_head,
        damp: a.damp,
        resume: a.resume,
        force: a.force,
        force_memory: a.force_memory,
        progress: !a.quiet && !a.json,
        compare: !a.no_compare,
        dump_dequantized: a.dump_dequantized.clone(),
        stop_after_layers: None,
        keep_on_interrupt: true,
        gguf,
        block_tune: a.block_tune.then(|| BlockTune {
            steps: a.block_tune_steps,
            check: a.block_tune_check,
            int8_inputs: a.block_tune_int8,
            ..BlockTune::default()
        }),
        page: Some(write_page),
        model_tune: a.model_tune.then(|| ModelTune {
            steps: a.model_tune_steps,
            scale_lr: a.model_tune_lr,
            codes_lr: a.model_tune_codes_lr,
            batch: a.model_tune_batch,
            int8_inputs: a.model_tune_int8,
            seed: a.model_tune_seed,
            ..ModelTune::default()
        }),
    };
    let report = quantize(&opts).with_context(|| format!("quantizing {}", model_dir.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let format = match report.gguf {
        Some(ft) => format!("GGUF {}", ft.llama_name()),
        None => format!(
            "{} g{}",
            serde_json::to_value(report.format)?.as_str().unwrap_or("?"),
            report.group_size
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
    if a.verbose {
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
        serde_json::to_value(report.method)?.as_str().unwrap_or("?"),
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
    if a.stats {
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
    }
    print_next_steps(&model_dir, &a.out, report.gguf.is_some(), report.path.lpbq);
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
