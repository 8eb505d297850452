pub mod bench;
pub mod export;
pub mod inspect;
pub mod parity;
pub mod quantize;
pub mod run;

use std::path::Path;

use spark_tool::engine::{self, Opened};

/// Open a checkpoint (original or GPTQ, executed as `exec` says) or an exported phone graph.
pub fn load(dir: &Path, exec: &run::ExecArgs, progress: bool) -> anyhow::Result<Opened> {
    Ok(engine::open(
        dir,
        |ck| exec.options(ck, progress),
        rayon::current_num_threads(),
    )?)
}
