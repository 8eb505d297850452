use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use spark_tool::checkpoint::Checkpoint;
use spark_tool::model::SparkModel;

use super::run::ExecArgs;

#[derive(Args)]
pub struct BenchArgs {
    /// Checkpoint folder (default: the bundled fixture).
    artifact: Option<PathBuf>,
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    gen: usize,
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    exec: ExecArgs,
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let dir = a
        .artifact
        .clone()
        .unwrap_or_else(spark_tool::bundled_fixture);
    let t = Instant::now();
    let ck = Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    let model = SparkModel::load(&ck, a.exec.options(&ck, false))?;
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    let r = spark_tool::bench::run(&model, a.prompt_len, a.gen, a.repeat)?;
    let rss = spark_tool::bench::peak_rss();
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        v["artifact"] = dir.display().to_string().into();
        v["load_ms"] = load_ms.into();
        v["peak_rss_bytes"] = rss.into();
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
    for (name, s) in [
        ("prefill tok/s", &r.prefill_tok_s),
        ("decode tok/s", &r.decode_tok_s),
        ("time to first token ms", &r.time_to_first_token_ms),
        ("decode ms/token", &r.decode_ms_per_token),
        ("sampling ms (total)", &r.sampling_ms),
    ] {
        println!(
            "  {name:<24} median {:>10.2}   min {:>10.2}   max {:>10.2}",
            s.median, s.min, s.max
        );
    }
    Ok(())
}
