use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use spark_tool::checkpoint::Checkpoint;

#[derive(Args)]
pub struct InspectArgs {
    /// Checkpoint folder (default: the bundled fixture).
    model_dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Context length for the KV-cache figures.
    #[arg(long, default_value_t = 4096, value_parser = super::at_least_1)]
    context: usize,
}

pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let dir = a.model_dir.unwrap_or_else(spark_tool::bundled_fixture);
    let ck = Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    let report = spark_tool::inspect::inspect(&ck, a.context);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}
