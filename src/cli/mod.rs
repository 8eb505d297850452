pub mod bench;
pub mod export;
pub mod inspect;
pub mod parity;
pub mod quantize;
pub mod run;

use std::path::Path;

/// How much a command prints, for every command (`-q`, `-v` before or after its name).
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct Verbosity {
    /// Less output: no progress bars; run prints no streamed text, parity only its verdict,
    /// export-phone no summary.
    #[arg(short, long, global = true)]
    pub quiet: bool,
    /// More output: quantize's error of every linear, run's per-phase timers.
    #[arg(short, long, global = true)]
    pub verbose: bool,
}

use spark_tool::load::{self, Opened};
use spark_tool::setting::Setting;

/// A count that must be at least 1 (clap's message names the flag and this text).
pub fn at_least_1(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("expected a whole number >= 1, got '{s}'")),
    }
}

/// A count that may be 0.
pub fn count(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .map_err(|_| format!("expected a whole number >= 0, got '{s}'"))
}

/// A finite number (no NaN, no infinity).
pub fn finite(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("expected a finite number, got '{s}'")),
    }
}

/// A finite number >= 0.
pub fn non_negative(s: &str) -> Result<f64, String> {
    match finite(s) {
        Ok(v) if v >= 0.0 => Ok(v),
        _ => Err(format!("expected a finite number >= 0, got '{s}'")),
    }
}

/// A fraction in [0, 1].
pub fn fraction(s: &str) -> Result<f64, String> {
    match finite(s) {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("expected a number in 0..=1, got '{s}'")),
    }
}

/// How the command line spells the library's settings in messages (installed by `main`).
pub fn flag(s: Setting) -> &'static str {
    match s {
        Setting::Context => "--context",
        Setting::GroupSize => "--group-size",
        Setting::Samples => "--samples",
        Setting::SeqLen => "--seq-len",
        Setting::RangeMargin => "--range-margin",
        Setting::Parts => "--parts",
        Setting::Force => "--force",
        Setting::ForceMemory => "--force-memory",
        Setting::Resume => "--resume",
        Setting::W4Numerics => "--w4-numerics",
        Setting::Format => "--format",
        Setting::Priority => "--priority",
        Setting::Out => "--out",
        Setting::LogitsOut => "--logits-out",
        Setting::Json => "--json",
        Setting::Tokens => "--tokens",
        Setting::Prompt => "--prompt",
        Setting::MaxNewTokens => "--max-new-tokens",
        Setting::PromptLen => "--prompt-len",
        Setting::Gen => "--gen",
        Setting::Rows => "--rows",
        Setting::DumpDequantized => "--dump-dequantized",
        Setting::Precision => "--precision",
        Setting::Html => "--html",
        Setting::Markdown => "--markdown",
    }
}

/// A model argument as the path to open: a hub id (`ORG/NAME[@REVISION]`) that is not a local
/// path becomes its snapshot folder in the Hugging Face cache, downloaded first where needed.
pub fn model(arg: &Path) -> anyhow::Result<std::path::PathBuf> {
    use std::io::IsTerminal;
    Ok(spark_tool::hub::resolve(
        arg,
        std::io::stderr().is_terminal(),
    )?)
}

/// Open a checkpoint (original or GPTQ, executed as `exec` says) or an exported phone graph.
pub fn load(dir: &Path, exec: &run::ExecArgs, progress: bool) -> anyhow::Result<Opened> {
    let gguf = if dir.is_file() && load::is_gguf(dir) {
        exec.gguf_numerics()?
    } else {
        load::GgufNumerics::Ggml
    };
    let opened = load::open(
        dir,
        |ck| exec.options(ck, progress),
        gguf,
        rayon::current_num_threads(),
    )?;
    let gptq = !spark_tool::phone::is_phone_export(dir) && opened.engine.config().gptq.is_some();
    exec.check_w4_numerics(dir, gptq)?;
    Ok(opened)
}

/// A model error for the user, with the weight that made the logits non-finite named where the
/// artifact is a checkpoint folder.
pub fn model_error(e: spark_tool::model::ModelError, dir: &std::path::Path) -> anyhow::Error {
    match spark_tool::load::non_finite_weight(&e, dir) {
        Some(w) => anyhow::Error::new(e).context(w.to_string()),
        None => e.into(),
    }
}
