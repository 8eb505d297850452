pub mod bench;
pub mod export;
pub mod inspect;
pub mod parity;
pub mod quantize;
pub mod run;

use std::path::Path;

use spark_tool::engine::{self, Opened};
use spark_tool::setting::Setting;

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
        Setting::Resume => "--resume",
        Setting::W4Numerics => "--w4-numerics",
        Setting::Format => "--format",
        Setting::Priority => "--priority",
        Setting::Out => "--out",
        Setting::LogitsOut => "--logits-out",
        Setting::Json => "--json",
        Setting::Tokens => "--tokens",
        Setting::Prompt => "--prompt",
    }
}

/// Open a checkpoint (original or GPTQ, executed as `exec` says) or an exported phone graph.
pub fn load(dir: &Path, exec: &run::ExecArgs, progress: bool) -> anyhow::Result<Opened> {
    Ok(engine::open(
        dir,
        |ck| exec.options(ck, progress),
        rayon::current_num_threads(),
    )?)
}
