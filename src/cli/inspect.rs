use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use spark_tool::checkpoint::Checkpoint;

#[derive(Args)]
pub struct InspectArgs {
    /// Checkpoint folder or GGUF file, or a Hugging Face hub id ORG/NAME[@REVISION].
    model: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Context length for the KV-cache figures (at most 2^32 tokens).
    #[arg(long, default_value_t = 4096, value_parser = context)]
    context: usize,
}

/// Up to 2^32 positions: the byte counts (layers × positions × bytes per position) stay exact in
/// u64 for any real Spark shape.
fn context(s: &str) -> Result<usize, String> {
    match super::at_least_1(s) {
        Ok(n) if n <= 1 << 32 => Ok(n),
        _ => Err(format!(
            "expected a whole number of positions in 1..=4294967296, got '{s}'"
        )),
    }
}

pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let dir = super::model(&a.model)?;
    if spark_tool::load::is_gguf(&dir) {
        let report = spark_tool::inspect::inspect_gguf(&dir)
            .with_context(|| format!("inspecting {}", dir.display()))?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{report}");
        }
        return Ok(());
    }
    let ck = Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    let report = spark_tool::inspect::inspect(&ck, a.context);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}
