pub mod bench;
pub mod export;
pub mod inspect;
pub mod parity;
pub mod quantize;
pub mod run;

use std::path::{Path, PathBuf};

use anyhow::Context;
use spark_tool::checkpoint::Checkpoint;
use spark_tool::engine::Engine;
use spark_tool::model::SparkModel;
use spark_tool::phone::{self, PhoneModel};

/// An artifact `run`/`parity` can execute.
pub struct Loaded {
    pub engine: Box<dyn Engine>,
    pub tokenizer: Option<PathBuf>,
    /// Bits per weight over everything the artifact ships.
    pub bpw: f64,
    pub warnings: Vec<String>,
}

fn threads() -> usize {
    rayon::current_num_threads()
}

/// Open a checkpoint (original or GPTQ) or an exported phone graph.
pub fn load(dir: &Path, exec: &run::ExecArgs, progress: bool) -> anyhow::Result<Loaded> {
    if phone::is_phone_export(dir) {
        let m = PhoneModel::open(dir, threads())
            .with_context(|| format!("opening phone export {}", dir.display()))?;
        let tok = dir.join("tokenizer.json");
        let bytes: u64 = std::fs::read_dir(dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .filter_map(|e| e.ok())
            .filter(|e| {
                let n = e.file_name().to_string_lossy().to_string();
                n.ends_with(".onnx") || n.ends_with(".onnx.data") || n == m.manifest.embedding.file
            })
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum();
        let params = spark_tool::inspect::parameters(m.config()) as f64;
        return Ok(Loaded {
            bpw: bytes as f64 * 8.0 / params,
            tokenizer: tok.is_file().then_some(tok),
            engine: Box::new(m),
            warnings: Vec::new(),
        });
    }
    let ck = Checkpoint::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    let r = spark_tool::inspect::inspect(&ck, 1);
    let model = SparkModel::load(&ck, exec.options(&ck, progress))?;
    Ok(Loaded {
        engine: Box::new(model),
        tokenizer: ck.tokenizer_path(),
        bpw: r.bytes as f64 * 8.0 / r.parameters.max(1) as f64,
        warnings: ck.layout.warnings.clone(),
    })
}
