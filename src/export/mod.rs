//! `spark-tool export-phone`: the decode step as a static ONNX graph for
//! Qualcomm QNN (HTP), in f32 or calibrated w8a16 QDQ, split into parts at
//! residual boundaries, with `phone_manifest.json`, an AIMET-style
//! `.encodings` file and the embedding table for the host-side lookup.
//!
//! The export is built in a staging folder and swapped in at the end
//! (`crate::artifact`), so an interrupted run never leaves a half-written
//! artifact and a replace only ever removes a previous export.

mod calibrate;

pub use calibrate::Calibrator;
mod descriptors;
pub mod graph;
pub mod lpbq;
pub mod onnx;
pub mod qdq;
mod weights;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::ProgressBar;
use serde::Serialize;

use crate::artifact::{self, io_err, ArtifactError, Staging};
use crate::checkpoint::write::write_safetensors_atomic;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::phone::manifest::{self, Encoding, Io, QType};
use graph::{PartPlan, StepBuilder, WeightSpec};
use onnx::{Graph, TensorInfo};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    F32,
    /// float16 weights (half the bytes), cast to float32 in the graph; float activations.
    F16,
    W8A16,
    /// The GPTQ checkpoint's int4 codes as QNN LPBQ (γ per channel × k per block), 16-bit
    /// activations; g_proj and the head int8 as in w8a16.
    W4A16,
}

impl Precision {
    /// Whether activations are calibrated and quantized (w8a16, w4a16).
    pub fn quantized(self) -> bool {
        matches!(self, Precision::W8A16 | Precision::W4A16)
    }
}

#[derive(Debug, Clone)]
pub struct ExportOptions {
    pub context: usize,
    pub precision: Precision,
    /// KV-side integer type of w8a16 exports.
    pub kv: QType,
    pub parts: usize,
    pub calibration: Vec<PathBuf>,
    pub calib_samples: usize,
    pub calib_seq_len: usize,
    /// Calibrated activation ranges are widened by this factor (≥ 1).
    pub range_margin: f32,
    /// How the activation ranges are measured (native unless checking against ONNX Runtime).
    pub calibrator: Calibrator,
    pub force: bool,
    /// Run even when the memory plan exceeds the available memory.
    pub force_memory: bool,
    pub progress: bool,
    pub threads: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(transparent)]
    Resources(#[from] crate::resources::ResourceError),
    #[error("{0}")]
    Invalid(String),
    #[error("calibration: {0}")]
    Calibration(String),
    #[error("calibration: reading the tokenizer")]
    CalibrationTokenizer(#[source] crate::tokenizer::TokenizerError),
    #[error("calibration text")]
    CalibrationText(#[source] crate::calibration::CalibrationError),
    #[error("calibration: running the float graph")]
    CalibrationGraph(#[source] crate::phone::PhoneError),
    #[error("calibration: running the float graph")]
    CalibrationRun(#[source] crate::model::ModelError),
    #[error(transparent)]
    Write(#[from] crate::checkpoint::write::WriteError),
}

#[derive(Debug, Clone, Serialize)]
pub struct PartSummary {
    pub file: String,
    pub layers: [usize; 2],
    pub head: bool,
    pub nodes: usize,
    pub proto_bytes: u64,
    pub external_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    pub out: String,
    pub precision: Precision,
    pub context: usize,
    pub parts: Vec<PartSummary>,
    pub calibration_tokens: usize,
    pub calibration_seconds: f64,
    /// How the activation ranges were measured (w8a16/w4a16).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibrator: Option<Calibrator>,
    pub seconds: f64,
}

struct Written {
    summary: PartSummary,
    manifest_part: manifest::Part,
}

fn write_part(
    g: &Graph<WeightSpec>,
    plan: &PartPlan,
    dir: &Path,
    reader: &mut weights::WeightReader,
    metadata: &BTreeMap<String, String>,
    encodings: Option<&HashMap<String, Encoding>>,
    progress: &ProgressBar,
) -> Result<Written, ExportError> {
    let file = plan.file();
    let s = onnx::write_model(g, dir, &file, metadata, |info, spec| {
        progress.set_message(info.name.clone());
        reader.resolve(info, spec)
    })
    .map_err(io_err(&dir.join(&file)))?;
    let enc_of = |name: &str| -> Option<Encoding> {
        let e = encodings?;
        e.get(name).copied()
    };
    let ios = |v: &[TensorInfo]| -> Vec<Io> {
        v.iter()
            .map(|t| Io {
                name: t.name.clone(),
                dtype: descriptors::dtype_name(t.dtype).into(),
                shape: t.shape.clone(),
                encoding: enc_of(&t.name),
            })
            .collect()
    };
    Ok(Written {
        summary: PartSummary {
            file: file.clone(),
            layers: [plan.layers.start, plan.layers.end],
            head: plan.head,
            nodes: s.nodes,
            proto_bytes: s.proto_bytes,
            external_bytes: s.external_bytes,
        },
        manifest_part: manifest::Part {
            file,
            graph_name: g.name.clone(),
            layers: [plan.layers.start, plan.layers.end],
            head: plan.head,
            inputs: ios(&g.inputs),
            outputs: ios(&g.outputs),
        },
    })
}

/// The config unchanged (the phone runtime reads its shapes) and the checkpoint's side files.
fn copy_side_files(ck: &Checkpoint, dir: &Path) -> Result<(), ExportError> {
    let cfg = ck.dir.join("config.json");
    std::fs::copy(&cfg, dir.join("config.json")).map_err(io_err(&dir.join("config.json")))?;
    Ok(ck.copy_side_files(dir)?)
}

/// The private memory of an export at its peak, printed and checked before any work: the
/// host KV caches, masks and cos/sin of the full context with ONNX Runtime's copies of them,
/// and for w8a16/w4a16 the residual stream of every calibration token beside what the
/// calibrator holds: one layer's f32 weights and one chunk's activations (native), or the f32
/// weights of the largest part in ONNX Runtime (one part at a time).
fn plan_memory(
    cfg: &crate::checkpoint::SparkConfig,
    opts: &ExportOptions,
) -> Result<(), ExportError> {
    use crate::resources::human;
    let rot = cfg.rope.values().map(|r| r.rotary_dims).max().unwrap_or(0) as u128;
    let host = 3 * crate::resources::kv_cache_bytes(cfg, opts.context, 4)
        + opts.context as u128 * (2 * rot + 4) * 4 * 2;
    let (part, streams) = if opts.precision.quantized() {
        let calibrator = match opts.calibrator {
            Calibrator::Native => calibrate::native_plan_bytes(cfg, opts),
            Calibrator::OnnxRuntime => {
                graph::plan_parts(cfg, opts.parts)
                    .iter()
                    .map(|p| p.params(cfg))
                    .max()
                    .unwrap_or(0) as u128
                    * 4
            }
        };
        let tokens = opts.calib_samples as u128 * opts.calib_seq_len.min(opts.context) as u128;
        (calibrator, 2 * tokens * cfg.hidden_size as u128 * 4)
    } else {
        (0, 0)
    };
    let fixed = 512u128 << 20;
    let need = host + part + streams + fixed;
    let have = crate::resources::memory_budget();
    if opts.progress {
        eprintln!(
            "memory plan: {} private at the peak (KV caches and host inputs {}, calibration {}, \
             calibration stream {}, other {}){}",
            human(need),
            human(host),
            human(part),
            human(streams),
            human(fixed),
            have.map(|h| format!("; {} available", human(h)))
                .unwrap_or_default()
        );
    }
    match have {
        Some(have) if need > have && !opts.force_memory => {
            use crate::setting::Setting;
            // What bounds calibration: the chunked native pass holds the calibration stream,
            // ONNX Runtime the largest part.
            let calibration = match opts.calibrator {
                Calibrator::Native => format!("{} or {}", Setting::Samples, Setting::SeqLen),
                Calibrator::OnnxRuntime => format!("raise {}", Setting::Parts),
            };
            Err(ExportError::Invalid(format!(
                "the memory plan needs {} ({} for the KV caches and host inputs of {} {}, {} for \
                 calibration and {} for its stream), but {} is available — lower {}, {}, or pass {} \
                 to run anyway",
                human(need),
                human(host),
                Setting::Context,
                opts.context,
                human(part),
                human(streams),
                human(have),
                Setting::Context,
                calibration,
                Setting::ForceMemory
            )))
        }
        _ => Ok(()),
    }
}

pub fn export_phone(
    model_dir: &Path,
    out: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport, ExportError> {
    let t0 = Instant::now();
    let ck = Checkpoint::open(model_dir)?;
    let cfg = &ck.config;
    match (ck.layout.gptq.is_empty(), opts.precision) {
        (false, Precision::W4A16) => check_lpbq(&ck)?,
        (false, _) => {
            return Err(ExportError::Invalid(format!(
                "{} is a GPTQ checkpoint, but {} {} needs the original (bf16/f16/f32) checkpoint; a GPTQ \
                 checkpoint exports only as {} w4a16 (its int4 codes as LPBQ)",
                model_dir.display(),
                crate::setting::Setting::Precision,
                serde_json::to_value(opts.precision)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default(),
                crate::setting::Setting::Precision
            )))
        }
        (true, Precision::W4A16) => return export_through_gptq(model_dir, out, opts),
        (true, _) => {}
    }
    if opts.context < 2 || opts.context > cfg.max_position_embeddings {
        return Err(ExportError::Invalid(format!(
            "{} {} must be in 2..={} (max_position_embeddings of {})",
            crate::setting::Setting::Context,
            opts.context,
            cfg.max_position_embeddings,
            model_dir.join("config.json").display()
        )));
    }
    if !(opts.range_margin >= 1.0 && opts.range_margin.is_finite()) {
        return Err(ExportError::Invalid(format!(
            "{} {} must be a finite number >= 1",
            crate::setting::Setting::RangeMargin,
            opts.range_margin
        )));
    }
    if opts.parts == 0 || opts.parts > cfg.num_hidden_layers + 1 {
        return Err(ExportError::Invalid(format!(
            "{} {} must be in 1..={} (layers + head)",
            crate::setting::Setting::Parts,
            opts.parts,
            cfg.num_hidden_layers + 1
        )));
    }
    if opts.precision.quantized() {
        for (s, v) in [
            (crate::setting::Setting::Samples, opts.calib_samples),
            (crate::setting::Setting::SeqLen, opts.calib_seq_len),
        ] {
            if v == 0 {
                return Err(ExportError::Invalid(format!(
                    "{s} must be at least 1, got 0"
                )));
            }
        }
    }
    plan_memory(cfg, opts)?;
    // A NaN weight would only surface as "no calibrated range" for hundreds of tensors.
    ck.check_finite()?;
    let mut inputs: Vec<&Path> = vec![model_dir];
    inputs.extend(opts.calibration.iter().map(PathBuf::as_path));
    let staging = Staging::plan(out, ARTIFACT_KIND, &inputs, opts.force)?;
    staging.reset()?;
    let built = staging.root().join("export");
    std::fs::create_dir_all(&built).map_err(io_err(&built))?;
    let r = export_staged(&ck, model_dir, out, &built, opts, t0)
        .and_then(|rep| Ok(staging.commit(&built).map(|()| rep)?));
    if r.is_err() {
        // Never leave a half-written export behind, not even the staging folder.
        staging.discard();
    }
    r
}

/// w4a16 from the original checkpoint: the phone's GPTQ solve (`quantize --target phone`, its
/// defaults, on the export's calibration text) into a private temporary folder, then the export
/// of that checkpoint. The temporary checkpoint is removed either way.
fn export_through_gptq(
    model_dir: &Path,
    out: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport, ExportError> {
    use crate::calibration;
    use crate::device::{self, Priority, Target};
    use crate::quantize::{QuantizeOptions, Recipe};
    // Refuse a bad output before the (long) solve.
    Staging::plan(out, ARTIFACT_KIND, &[model_dir], opts.force)?;
    let tmp = std::env::temp_dir().join(format!(
        "spark-tool-w4a16-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let path = device::decide(&device::detect(), Target::Phone, Priority::Speed);
    let recipe = Recipe {
        format: path.format,
        group_size: path.group_size,
        lpbq: path.lpbq,
        // The phone's LPBQ blocks take positive multipliers only.
        signed_scales: false,
        calibration: if opts.calibration.is_empty() {
            vec![calibration::bundled()]
        } else {
            opts.calibration.clone()
        },
        ..Recipe::default()
    };
    let mut q = QuantizeOptions::new(model_dir, &tmp, recipe, path);
    q.force_memory = opts.force_memory;
    q.progress = opts.progress;
    // The finished checkpoint is this call's to remove, an interruption included.
    let _tmp = crate::artifact::remove_on_interrupt(&tmp);
    let solve = Instant::now();
    if opts.progress {
        eprintln!(
            "{} is a float checkpoint: solving GPTQ on QNN's LPBQ lattice first ({} × {} calibration \
             tokens; to reuse the solve, `spark-tool quantize --target phone` once and export that)",
            model_dir.display(),
            q.recipe.samples,
            q.recipe.seq_len
        );
    }
    let r = crate::quantize::quantize(&q)
        .inspect(|_| {
            if opts.progress {
                eprintln!("GPTQ solve: {:.1} s", solve.elapsed().as_secs_f64());
            }
        })
        .map_err(|e| {
            ExportError::Invalid(format!(
                "the w4a16 GPTQ solve of {}: {e}",
                model_dir.display()
            ))
        })
        .and_then(|_| export_phone(&tmp, out, opts));
    let _ = std::fs::remove_dir_all(&tmp);
    r
}

/// Every GPTQ linear of `ck` must be writable as LPBQ (symmetric, static groups, scales γ·k with
/// k ∈ 1…16 per channel), checked before anything is written.
fn check_lpbq(ck: &Checkpoint) -> Result<(), ExportError> {
    let info = ck.config.gptq.as_ref().ok_or_else(|| {
        ExportError::Invalid(format!(
            "{}: GPTQ tensors but no quantization_config",
            ck.dir.join("config.json").display()
        ))
    })?;
    for prefix in &ck.layout.gptq {
        let d = crate::formats::gptq::read_linear(&ck.store, info, prefix, 0..n_all(ck, prefix)?)?;
        lpbq::Lpbq::from_gptq(prefix, &d, 0..d.n_all, 1.0).map_err(ExportError::Invalid)?;
    }
    Ok(())
}

fn n_all(ck: &Checkpoint, prefix: &str) -> Result<usize, ExportError> {
    Ok(ck.entry(&format!("{prefix}.qweight"))?.shape[1])
}

/// A GPTQ checkpoint's norm weights by name (its codes are written as they are, so the norms
/// become their own Mul); `None` for a float checkpoint, whose norms fold into the weights.
fn gptq_norms(ck: &Checkpoint) -> Result<Option<HashMap<String, Vec<f32>>>, ExportError> {
    let cfg = &ck.config;
    if ck.layout.gptq.is_empty() {
        return Ok(None);
    }
    let mut m = HashMap::new();
    for l in 0..cfg.num_hidden_layers {
        let p = crate::checkpoint::layout::layer_prefix(l);
        for n in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            let name = format!("{p}{n}");
            m.insert(name.clone(), ck.tensor_f32(&name)?);
        }
    }
    m.insert(
        "model.norm.weight".into(),
        ck.tensor_f32("model.norm.weight")?,
    );
    Ok(Some(m))
}

/// The metadata every part's ONNX model carries.
fn graph_metadata(
    cfg: &crate::checkpoint::SparkConfig,
    opts: &ExportOptions,
    model_dir: &Path,
) -> BTreeMap<String, String> {
    let mut metadata = BTreeMap::new();
    metadata.insert("runs_in_vllm".into(), "false".into());
    metadata.insert("context".into(), opts.context.to_string());
    metadata.insert("sliding_window".into(), cfg.sliding_window.to_string());
    metadata.insert(
        "layer_types".into(),
        cfg.layer_types
            .iter()
            .map(|t| graph::type_name(*t))
            .collect::<Vec<_>>()
            .join(","),
    );
    metadata.insert(
        "spark_tool_version".into(),
        env!("CARGO_PKG_VERSION").into(),
    );
    metadata.insert("source".into(), model_dir.display().to_string());
    metadata.insert(
        "eos_token_ids".into(),
        cfg.eos_token_ids
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(","),
    );
    if let Some(b) = cfg.bos_token_id {
        metadata.insert("bos_token_id".into(), b.to_string());
    }
    metadata
}

/// What the graphs' numerics need beyond the graphs: the checkpoint, calibration settings and
/// where the calibration runs.
struct Calibrated<'a> {
    ck: &'a Checkpoint,
    opts: &'a ExportOptions,
    stage: &'a Path,
    plans: &'a [graph::PartPlan],
    metadata: &'a BTreeMap<String, String>,
    total_inits: usize,
}

/// The graphs in the export's precision, their encodings (quantized precisions) and the
/// calibration's tokens and seconds.
type Numerics = (
    Vec<Graph<WeightSpec>>,
    Option<Vec<HashMap<String, Encoding>>>,
    usize,
    f64,
);

impl Calibrated<'_> {
    /// f32 as built, f16 weights, or calibrated Q/DQ nodes for w8a16 / w4a16.
    fn numerics(
        &self,
        graphs: Vec<Graph<WeightSpec>>,
        reader: &mut weights::WeightReader,
    ) -> Result<Numerics, ExportError> {
        let (ck, opts, plans) = (self.ck, self.opts, self.plans);
        match opts.precision {
            Precision::F32 => Ok((graphs, None, 0, 0.0)),
            Precision::F16 => Ok((
                graphs.into_iter().map(weights::half_weights).collect(),
                None,
                0,
                0.0,
            )),
            Precision::W8A16 | Precision::W4A16 => {
                let tc = Instant::now();
                let ranges = calibrate::calibrate(
                    ck,
                    opts,
                    self.stage,
                    plans,
                    &graphs,
                    self.metadata,
                    reader,
                    self.total_inits,
                )?;
                let tokens = opts.calib_samples * opts.calib_seq_len.min(opts.context);
                let seconds = tc.elapsed().as_secs_f64();
                let mut qs = Vec::new();
                let mut encs = Vec::new();
                for (g, p) in graphs.into_iter().zip(plans) {
                    let enc = qdq::plan_encodings(
                        &g,
                        p.layers.clone(),
                        &ranges,
                        opts.kv,
                        opts.range_margin,
                    )
                    .map_err(|missing| {
                        ExportError::Calibration(format!(
                            "no calibrated range for {} tensor(s): {}",
                            missing.len(),
                            missing
                                .iter()
                                .take(8)
                                .cloned()
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })?;
                    let q = qdq::quantize(g, enc);
                    encs.push(q.encodings);
                    qs.push(q.graph);
                }
                Ok((qs, Some(encs), tokens, seconds))
            }
        }
    }
}

/// What `crate::artifact` records an export folder as.
pub const ARTIFACT_KIND: &str = "phone export";

fn export_staged(
    ck: &Checkpoint,
    model_dir: &Path,
    out: &Path,
    stage: &Path,
    opts: &ExportOptions,
    t0: Instant,
) -> Result<ExportReport, ExportError> {
    let cfg = &ck.config;
    let norms = gptq_norms(ck)?;
    let builder = StepBuilder {
        cfg,
        qkv: &ck.layout.qkv,
        tied: ck.layout.tied,
        context: opts.context,
        gptq: &ck.layout.gptq,
        gptq_group: cfg.gptq.as_ref().map_or(0, |g| g.group_size),
        norms: norms.as_ref(),
    };
    let plans = graph::plan_parts(cfg, opts.parts);
    let graphs: Vec<Graph<WeightSpec>> = plans.iter().map(|p| builder.build(p)).collect();
    let metadata = graph_metadata(cfg, opts, model_dir);
    let mut reader = weights::WeightReader::new(ck);
    write_safetensors_atomic(
        &stage.join("embed_tokens.safetensors"),
        &[weights::embedding_tensor(ck)?],
        None,
    )?;
    copy_side_files(ck, stage)?;
    let total_inits: usize = graphs.iter().map(|g| g.inits.len()).sum();
    let calibrated = Calibrated {
        ck,
        opts,
        stage,
        plans: &plans,
        metadata: &metadata,
        total_inits,
    };
    let (final_graphs, encodings, calibration_tokens, calibration_seconds) =
        calibrated.numerics(graphs, &mut reader)?;

    let pb = artifact::progress_bar(
        opts.progress,
        total_inits as u64 * if encodings.is_some() { 2 } else { 1 },
        "writing",
    );
    let mut summaries = Vec::new();
    let mut parts = Vec::new();
    for (i, (g, p)) in final_graphs.iter().zip(&plans).enumerate() {
        let w = write_part(
            g,
            p,
            stage,
            &mut reader,
            &metadata,
            encodings.as_ref().map(|e| &e[i]),
            &pb,
        )?;
        pb.inc(
            g.inits
                .iter()
                .filter(|x| matches!(x.source, onnx::Source::Deferred(_)))
                .count() as u64,
        );
        summaries.push(w.summary);
        parts.push(w.manifest_part);
    }
    pb.finish_and_clear();
    let (precision, kv_dtype, kv_elem) = match opts.precision {
        Precision::F32 => ("f32", "float32", 4),
        Precision::F16 => ("f16", "float32", 4),
        Precision::W8A16 | Precision::W4A16 => {
            let name = if opts.precision == Precision::W4A16 {
                "w4a16"
            } else {
                "w8a16"
            };
            match opts.kv {
                QType::Uint8 => (name, "uint8", 1),
                _ => (name, "int16", 2),
            }
        }
    };
    let m = descriptors::build_manifest(
        ck,
        opts,
        precision,
        parts,
        "embed_tokens.safetensors",
        kv_dtype,
        kv_elem,
    );
    artifact::write_json(&stage.join(manifest::MANIFEST), &m)?;
    if let Some(encs) = &encodings {
        let mut all = HashMap::new();
        for e in encs {
            all.extend(e.iter().map(|(k, v)| (k.clone(), *v)));
        }
        artifact::write_json(
            &stage.join("model.encodings"),
            &descriptors::aimet_encodings(&all, &reader.scales, &reader.lpbq),
        )?;
    }
    Ok(ExportReport {
        out: out.display().to_string(),
        precision: opts.precision,
        context: opts.context,
        parts: summaries,
        calibration_tokens,
        calibration_seconds,
        calibrator: opts.precision.quantized().then_some(opts.calibrator),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_carries_the_config_and_the_side_files_the_checkpoint_has_and_nothing_else() {
        let ck = Checkpoint::open(&crate::bundled_fixture()).unwrap();
        let d = tempfile::tempdir().unwrap();
        copy_side_files(&ck, d.path()).unwrap();
        let mut got: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        got.sort();
        // The fixture has no special_tokens_map.json or chat_template.jinja; its TRAINING.md and
        // weights are not side files.
        assert_eq!(
            got,
            [
                "config.json",
                "generation_config.json",
                "tokenizer.json",
                "tokenizer_config.json"
            ]
        );
        for f in &got {
            assert_eq!(
                std::fs::read(d.path().join(f)).unwrap(),
                std::fs::read(ck.dir.join(f)).unwrap(),
                "{f} copied as is"
            );
        }
    }
}
