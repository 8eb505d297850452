//! `spark-tool export-phone`: the decode step as a static ONNX graph for
//! Qualcomm QNN (HTP), in f32 or calibrated w8a16 QDQ, split into parts at
//! residual boundaries, with `phone_manifest.json`, an AIMET-style
//! `.encodings` file and the embedding table for the host-side lookup.
//!
//! The export is built in a staging folder and swapped in at the end
//! (`crate::artifact`), so an interrupted run never leaves a half-written
//! artifact and a replace only ever removes a previous export.

pub mod graph;
pub mod onnx;
pub mod qdq;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::ProgressBar;
use serde::Serialize;

use crate::artifact::{self, ArtifactError, Staging};
use crate::checkpoint::write::{write_safetensors_atomic, OwnedTensor};
use crate::checkpoint::{Checkpoint, CheckpointError, LayerType};
use crate::phone::manifest::{self, Encoding, Io, Manifest, QType};
use crate::phone::PhoneModel;
use crate::quantize::calibration;
use crate::tokenizer::SparkTokenizer;
use graph::{PartPlan, Repr, StepBuilder, WeightSpec};
use onnx::{DType, Graph, TensorInfo};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    F32,
    /// float16 weights (half the bytes), cast to float32 in the graph; float activations.
    F16,
    W8A16,
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
    pub force: bool,
    pub progress: bool,
    pub threads: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error("{0}")]
    Invalid(String),
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("calibration: {0}")]
    Calibration(String),
}

fn io(p: &Path) -> impl Fn(std::io::Error) -> ExportError + '_ {
    move |source| ExportError::Io {
        path: p.display().to_string(),
        source,
    }
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
    pub seconds: f64,
}

/// Reads deferred weights from the checkpoint, one matrix at a time.
struct WeightReader<'a> {
    ck: &'a Checkpoint,
    norms: HashMap<String, Vec<f32>>,
    /// Per-channel scales of every int8 weight written (for `.encodings`).
    scales: BTreeMap<String, Vec<f32>>,
}

impl WeightReader<'_> {
    /// `[K, N]` = (rows of `[N_all, K]`)ᵀ with the folded norm and multiplier.
    fn matrix(&mut self, s: &WeightSpec) -> Result<Vec<f32>, CheckpointError> {
        let e = self.ck.entry(&s.tensor)?;
        let w = self.ck.store.rows_to_f32(e, s.rows.start, s.rows.end)?;
        let fold = match &s.fold {
            Some(f) => {
                if !self.norms.contains_key(f) {
                    let v = self.ck.tensor_f32(f)?;
                    self.norms.insert(f.clone(), v);
                }
                Some(&self.norms[f])
            }
            None => None,
        };
        let (n, k) = (s.rows.len(), s.k);
        let mut out = vec![0f32; k * n];
        for j in 0..n {
            for kk in 0..k {
                let f = fold.map_or(1.0, |f| f[kk]);
                out[kk * n + j] = w[j * k + kk] * f * s.mul;
            }
        }
        Ok(out)
    }

    fn resolve(&mut self, info: &TensorInfo, s: &WeightSpec) -> std::io::Result<Vec<u8>> {
        let m = self.matrix(s).map_err(std::io::Error::other)?;
        let n = s.rows.len();
        let scales = || -> Vec<f32> {
            let mut absmax = vec![0f32; n];
            for row in m.chunks_exact(n) {
                for (a, v) in absmax.iter_mut().zip(row) {
                    *a = a.max(v.abs());
                }
            }
            absmax
                .iter()
                .map(|a| if *a > 0.0 { a / 127.0 } else { 1.0 })
                .collect()
        };
        Ok(match s.repr {
            Repr::F32 => m.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Repr::F16 => m
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            Repr::Q8 => {
                let sc = scales();
                m.chunks_exact(n)
                    .flat_map(|row| {
                        row.iter()
                            .zip(&sc)
                            .map(|(v, s)| {
                                (v / s).round_ties_even().clamp(-127.0, 127.0) as i8 as u8
                            })
                            .collect::<Vec<u8>>()
                    })
                    .collect()
            }
            Repr::Q8Scale => {
                let sc = scales();
                let bytes = sc.iter().flat_map(|v| v.to_le_bytes()).collect();
                let weight = info.name.trim_end_matches("_scale").to_string();
                self.scales.insert(weight, sc);
                bytes
            }
        })
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::I16 => "int16",
        DType::U16 => "uint16",
        DType::I32 => "int32",
        DType::I64 => "int64",
    }
}

struct Written {
    summary: PartSummary,
    manifest_part: manifest::Part,
}

#[allow(clippy::too_many_arguments)]
fn write_part(
    g: &Graph<WeightSpec>,
    plan: &PartPlan,
    dir: &Path,
    reader: &mut WeightReader,
    metadata: &BTreeMap<String, String>,
    encodings: Option<&HashMap<String, Encoding>>,
    progress: &ProgressBar,
) -> Result<Written, ExportError> {
    let file = plan.file();
    let s = onnx::write_model(g, dir, &file, metadata, |info, spec| {
        progress.set_message(info.name.clone());
        reader.resolve(info, spec)
    })
    .map_err(io(&dir.join(&file)))?;
    let enc_of = |name: &str| -> Option<Encoding> {
        let e = encodings?;
        e.get(name).copied()
    };
    let ios = |v: &[TensorInfo]| -> Vec<Io> {
        v.iter()
            .map(|t| Io {
                name: t.name.clone(),
                dtype: dtype_name(t.dtype).into(),
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

fn build_manifest(
    ck: &Checkpoint,
    opts: &ExportOptions,
    precision: &str,
    parts: Vec<manifest::Part>,
    embedding_file: &str,
    kv_dtype: &str,
    kv_elem: usize,
) -> Manifest {
    let cfg = &ck.config;
    let mut types = BTreeMap::new();
    for t in [LayerType::Sliding, LayerType::Full] {
        let layers: Vec<usize> = (0..cfg.num_hidden_layers)
            .filter(|&l| cfg.layer_types[l] == t)
            .collect();
        if layers.is_empty() {
            continue;
        }
        let r = cfg.rope_for(t);
        let past = graph::past_len(cfg, t, opts.context);
        types.insert(
            graph::type_name(t).to_string(),
            manifest::LayerTypeInfo {
                layers,
                past_len: past,
                mask: graph::mask_input(t),
                cos: graph::cos_input(t),
                sin: graph::sin_input(t),
                rope_theta: r.theta,
                rotary_dims: r.rotary_dims,
                slot_rule: match t {
                    LayerType::Sliding => format!("ring buffer: the entry of position pos goes to slot pos mod {past}; every written slot is attended"),
                    LayerType::Full => "append: the entry of position pos goes to slot pos; slots < pos are attended".into(),
                },
            },
        );
    }
    let (kvh, hd) = (cfg.num_key_value_heads, cfg.head_dim);
    let caches: Vec<manifest::Cache> = (0..cfg.num_hidden_layers)
        .map(|l| {
            let t = cfg.layer_types[l];
            let past = graph::past_len(cfg, t, opts.context);
            manifest::Cache {
                layer: l,
                layer_type: graph::type_name(t).into(),
                key_in: graph::key_in(l),
                key_out: graph::key_out(l),
                value_in: graph::value_in(l),
                value_out: graph::value_out(l),
                key_shape: vec![kvh, 1, hd, past],
                value_shape: vec![kvh, 1, past, hd],
                dtype: kv_dtype.into(),
            }
        })
        .collect();
    let kv_bytes: u64 = caches
        .iter()
        .map(|c| 2 * c.key_shape.iter().product::<usize>() as u64 * kv_elem as u64)
        .sum();
    let all_full = (cfg.num_hidden_layers * 2 * kvh * hd * (opts.context - 1) * kv_elem) as u64;
    let mask_value = match opts.precision {
        Precision::F32 | Precision::F16 => -1000.0,
        Precision::W8A16 => -50.0,
    };
    Manifest {
        format: manifest::FORMAT.into(),
        version: 1,
        spark_tool_version: env!("CARGO_PKG_VERSION").into(),
        runs_in_vllm: false,
        precision: precision.into(),
        context: opts.context,
        sliding_window: cfg.sliding_window,
        hidden_size: cfg.hidden_size,
        vocab_size: cfg.vocab_size,
        layer_types: cfg.layer_types.iter().map(|t| graph::type_name(*t).to_string()).collect(),
        bos_token_id: cfg.bos_token_id,
        eos_token_ids: cfg.eos_token_ids.clone(),
        pad_token_id: cfg.pad_token_id,
        embedding: manifest::Embedding {
            file: embedding_file.into(),
            tensor: "embed_tokens".into(),
            lookup: "host: input_embeds = embed_tokens[token] as float32 [1, 1, hidden]".into(),
        },
        mask_value,
        types,
        caches,
        parts,
        kv_cache_bytes: kv_bytes,
        kv_cache_bytes_if_all_full: all_full,
        how_to_step: vec![
            "pos = number of tokens already processed (0 for the first); pos < context".into(),
            "input_embeds = embed_tokens[token] (float32 [1,1,hidden])".into(),
            format!("per layer type: attention_mask_<type>[j] = 0 for attended past slots (see slot_rule) and for the last entry (the new token), else {mask_value}"),
            "per layer type: position_ids_cos/sin_<type> = cos/sin(pos · θ^(−2i/R)), i < R/2".into(),
            "run the parts in order, feeding hidden_states_out of a part as hidden_states_in of the next, with each layer's past_key/value_<l>_in".into(),
            "copy past_key_<l>_out [KVH,1,hd,1] into column `slot` of past_key_<l>_in and past_value_<l>_out [KVH,1,1,hd] into row `slot` of past_value_<l>_in (raw integers when quantized: inputs and outputs share one encoding)".into(),
        ],
        calibration_outputs: false,
    }
}

fn embedding_tensor(ck: &Checkpoint) -> Result<OwnedTensor, ExportError> {
    let e = ck.entry("model.embedding.weight")?;
    Ok(OwnedTensor {
        name: "embed_tokens".into(),
        dtype: e.dtype,
        shape: e.shape.clone(),
        data: ck.store.bytes(e).to_vec(),
    })
}

fn copy_side_files(ck: &Checkpoint, dir: &Path) -> Result<(), ExportError> {
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        let src = ck.dir.join(f);
        if src.is_file() {
            std::fs::copy(&src, dir.join(f)).map_err(io(&dir.join(f)))?;
        }
    }
    Ok(())
}

/// AIMET encoding format 1.0.0 (docs/PHONE_IO.md §7): `offset = −zero_point`.
fn aimet_encodings(
    enc: &HashMap<String, Encoding>,
    weights: &BTreeMap<String, Vec<f32>>,
) -> serde_json::Value {
    let mut acts: Vec<_> = enc.iter().collect();
    acts.sort_by(|a, b| a.0.cmp(b.0));
    serde_json::json!({
        "version": "1.0.0",
        "activation_encodings": acts.iter().map(|(name, e)| serde_json::json!({
            "name": name,
            "dtype": "INT",
            "bw": match e.dtype { QType::Uint8 => 8, _ => 16 },
            "enc_type": "PER_TENSOR",
            "is_sym": e.zero_point == 0 || (e.dtype == QType::Uint8 && e.zero_point == 128),
            "scale": [e.scale],
            "offset": [-e.zero_point],
        })).collect::<Vec<_>>(),
        "param_encodings": weights.iter().map(|(name, s)| serde_json::json!({
            "name": name,
            "dtype": "INT",
            "bw": 8,
            "enc_type": "PER_CHANNEL",
            "is_sym": true,
            "scale": s,
            "offset": vec![-128; s.len()],
        })).collect::<Vec<_>>(),
    })
}

pub fn export_phone(
    model_dir: &Path,
    out: &Path,
    opts: &ExportOptions,
) -> Result<ExportReport, ExportError> {
    let t0 = Instant::now();
    let ck = Checkpoint::open(model_dir)?;
    let cfg = &ck.config;
    if !ck.layout.gptq.is_empty() {
        return Err(ExportError::Invalid(format!(
            "{} is a GPTQ checkpoint; export-phone quantizes the original (bf16/f16/f32) checkpoint itself",
            model_dir.display()
        )));
    }
    if opts.context < 2 || opts.context > cfg.max_position_embeddings {
        return Err(ExportError::Invalid(format!(
            "--context {} must be in 2..={} (max_position_embeddings of {})",
            opts.context,
            cfg.max_position_embeddings,
            model_dir.join("config.json").display()
        )));
    }
    if !(opts.range_margin >= 1.0 && opts.range_margin.is_finite()) {
        return Err(ExportError::Invalid(format!(
            "--range-margin {} must be a finite number >= 1",
            opts.range_margin
        )));
    }
    if opts.parts == 0 || opts.parts > cfg.num_hidden_layers + 1 {
        return Err(ExportError::Invalid(format!(
            "--parts {} must be in 1..={} (layers + head)",
            opts.parts,
            cfg.num_hidden_layers + 1
        )));
    }
    let mut inputs: Vec<&Path> = vec![model_dir];
    inputs.extend(opts.calibration.iter().map(PathBuf::as_path));
    let staging = Staging::plan(out, ARTIFACT_KIND, &inputs, opts.force)?;
    staging.reset()?;
    let built = staging.root().join("export");
    std::fs::create_dir_all(&built).map_err(io(&built))?;
    let r = export_staged(&ck, model_dir, out, &built, opts, t0)
        .and_then(|rep| Ok(staging.commit(&built).map(|()| rep)?));
    if r.is_err() {
        // Never leave a half-written export behind, not even the staging folder.
        staging.discard();
    }
    r
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
    let builder = StepBuilder {
        cfg,
        qkv: &ck.layout.qkv,
        tied: ck.layout.tied,
        context: opts.context,
    };
    let plans = graph::plan_parts(cfg, opts.parts);
    let graphs: Vec<Graph<WeightSpec>> = plans.iter().map(|p| builder.build(p)).collect();
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
    let mut reader = WeightReader {
        ck,
        norms: HashMap::new(),
        scales: BTreeMap::new(),
    };
    write_safetensors_atomic(
        &stage.join("embed_tokens.safetensors"),
        &[embedding_tensor(ck)?],
        None,
    )
    .map_err(|e| ExportError::Invalid(e.to_string()))?;
    copy_side_files(ck, stage)?;
    let total_inits: usize = graphs.iter().map(|g| g.inits.len()).sum();
    let mut calibration_tokens = 0;
    let mut calibration_seconds = 0.0;

    #[allow(clippy::type_complexity)]
    let (final_graphs, encodings): (
        Vec<Graph<WeightSpec>>,
        Option<Vec<HashMap<String, Encoding>>>,
    ) = match opts.precision {
        Precision::F32 => (graphs, None),
        Precision::F16 => (graphs.into_iter().map(half_weights).collect(), None),
        Precision::W8A16 => {
            let tc = Instant::now();
            let ranges = calibrate(
                ck,
                opts,
                stage,
                &plans,
                &graphs,
                &metadata,
                &mut reader,
                total_inits,
            )?;
            calibration_tokens = opts.calib_samples * opts.calib_seq_len;
            calibration_seconds = tc.elapsed().as_secs_f64();
            let mut qs = Vec::new();
            let mut encs = Vec::new();
            for (g, p) in graphs.into_iter().zip(&plans) {
                let enc =
                    qdq::plan_encodings(&g, p.layers.clone(), &ranges, opts.kv, opts.range_margin)
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
            (qs, Some(encs))
        }
    };

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
        Precision::W8A16 => match opts.kv {
            QType::Uint8 => ("w8a16", "uint8", 1),
            _ => ("w8a16", "int16", 2),
        },
    };
    let m = build_manifest(
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
            &aimet_encodings(&all, &reader.scales),
        )?;
    }
    Ok(ExportReport {
        out: out.display().to_string(),
        precision: opts.precision,
        context: opts.context,
        parts: summaries,
        calibration_tokens,
        calibration_seconds,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Store every MatMul weight as float16 and `Cast` it to float32 where it is used.
fn half_weights(mut g: Graph<WeightSpec>) -> Graph<WeightSpec> {
    let mut casts = Vec::new();
    for init in &mut g.inits {
        if let onnx::Source::Deferred(spec) = &mut init.source {
            spec.repr = Repr::F16;
            init.info.dtype = DType::F16;
            casts.push((init.info.name.clone(), init.info.shape.clone()));
        }
    }
    let mut nodes = Vec::with_capacity(g.nodes.len() + casts.len());
    for (name, shape) in casts {
        let out = format!("{name}_f32");
        g.info.get_mut(&name).expect("initializer info").dtype = DType::F16;
        g.info.insert(
            out.clone(),
            TensorInfo {
                name: out.clone(),
                dtype: DType::F32,
                shape,
            },
        );
        nodes.push(onnx::Node {
            op: "Cast".into(),
            name: format!("{out}/Cast"),
            inputs: vec![name.clone()],
            outputs: vec![out.clone()],
            attrs: vec![("to".into(), onnx::Attr::Int(DType::F32.onnx() as i64))],
        });
        for n in &mut g.nodes {
            for i in &mut n.inputs {
                if *i == name {
                    *i = out.clone();
                }
            }
        }
    }
    nodes.append(&mut g.nodes);
    g.nodes = nodes;
    g
}

/// Ranges of every float tensor: write the float graphs with every
/// intermediate tensor as an extra output, drive them over the calibration
/// windows exactly as an app would (host caches, masks, cos/sin), record min/max.
#[allow(clippy::too_many_arguments)]
fn calibrate(
    ck: &Checkpoint,
    opts: &ExportOptions,
    stage: &Path,
    plans: &[PartPlan],
    graphs: &[Graph<WeightSpec>],
    metadata: &BTreeMap<String, String>,
    reader: &mut WeightReader,
    total_inits: usize,
) -> Result<qdq::Ranges, ExportError> {
    let tok_path = ck.tokenizer_path().ok_or_else(|| {
        ExportError::Calibration(format!(
            "{} has no tokenizer.json; w8a16 needs real text to calibrate on",
            ck.dir.display()
        ))
    })?;
    let tok = SparkTokenizer::from_file(&tok_path)
        .map_err(|e| ExportError::Calibration(e.to_string()))?;
    let files = if opts.calibration.is_empty() {
        vec![calibration::bundled()]
    } else {
        opts.calibration.clone()
    };
    let seq_len = opts.calib_seq_len.min(opts.context);
    let windows = calibration::build(&files, &tok, opts.calib_samples, seq_len)
        .map_err(|e| ExportError::Calibration(e.to_string()))?;
    let dir = stage.join("calibration-f32");
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let pb = artifact::progress_bar(opts.progress, total_inits as u64, "float graph");
    let mut parts = Vec::new();
    for (g, p) in graphs.iter().zip(plans) {
        let mut tapped = g.clone();
        let declared: std::collections::HashSet<String> =
            tapped.outputs.iter().map(|o| o.name.clone()).collect();
        for n in &g.nodes {
            let o = &n.outputs[0];
            if g.info[o].dtype == DType::F32 && !declared.contains(o) {
                tapped.output(o);
            }
        }
        let w = write_part(&tapped, p, &dir, reader, metadata, None, &pb)?;
        pb.inc(g.inits.len() as u64);
        parts.push(w.manifest_part);
    }
    pb.finish_and_clear();
    let mut m = build_manifest(
        ck,
        opts,
        "f32",
        parts,
        "../embed_tokens.safetensors",
        "float32",
        4,
    );
    m.calibration_outputs = true;
    artifact::write_json(&dir.join(manifest::MANIFEST), &m)?;
    std::fs::copy(ck.dir.join("config.json"), dir.join("config.json")).map_err(io(&dir))?;
    let model = PhoneModel::open(&dir, opts.threads)
        .map_err(|e| ExportError::Calibration(e.to_string()))?;
    let mut ranges = qdq::Ranges::default();
    let mask_value = m.mask_value;
    let pb = artifact::progress_bar(
        opts.progress,
        (windows.samples * windows.seq_len) as u64,
        "calibrating",
    );
    for s in 0..windows.samples {
        let mut seq = model
            .sequence()
            .map_err(|e| ExportError::Calibration(e.to_string()))?;
        for &t in windows.sample(s) {
            seq.step(t, |name, v| ranges.observe(name, v))
                .map_err(|e| ExportError::Calibration(e.to_string()))?;
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    // Inputs the host builds: masks span {mask, 0}, cos/sin [-1, 1]; the
    // embedding range comes from the table itself.
    for t in m.types.values() {
        ranges.observe(&t.mask, &[mask_value, 0.0]);
        ranges.observe(&t.cos, &[-1.0, 1.0]);
        ranges.observe(&t.sin, &[-1.0, 1.0]);
    }
    let emb = ck.tensor_f32("model.embedding.weight")?;
    ranges.observe(graph::EMBEDS, &emb);
    if let Some(r) = ranges.0.get(graph::HIDDEN_OUT).copied() {
        ranges.0.insert(graph::HIDDEN_IN.into(), r);
    }
    drop(model);
    std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    Ok(ranges)
}
