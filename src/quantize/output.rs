//! Where `quantize` writes: a staging folder (`crate::artifact`) holding
//! per-layer results (so `--resume` can continue after an interruption) and
//! the finished checkpoint, which is swapped onto `--out` only at the very
//! end. Nothing under `--out` is ever half-written, and a replace only ever
//! removes a previous quantized checkpoint.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::Dtype;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::{LayerResult, LinearReport, QuantReport, QuantizeError, QuantizeOptions};
use crate::artifact::{self, io_err, Staging};
use crate::checkpoint::layout::{layer_prefix, stored_linears};
use crate::checkpoint::write::{write_safetensors_atomic, OwnedTensor};
use crate::checkpoint::{Checkpoint, Proj, QkvLayout, TensorStore};
use crate::formats::gptq::{self, concat_outputs, tensors_for};
use crate::quant::QuantizedWeight;

pub struct Output {
    staging: Staging,
    partial: PathBuf,
    qkv_layout: QkvLayout,
}

/// What `crate::artifact` records a quantized checkpoint folder as.
pub const ARTIFACT_KIND: &str = "gptq checkpoint";

pub struct ResumeState {
    pub results: Vec<LayerResult>,
    pub reports: Vec<LinearReport>,
    pub x: Vec<f32>,
}

/// Identifies a run: same model bytes, calibration and settings ⇒ same fingerprint. The weights
/// are keyed by content, not size: a checkpoint rewritten in place at the same size must not
/// resume onto layers quantized from the old weights. Hashing reads every weight file once
/// (sha256 at 0.4–1.0 GB/s per core measured on the 2-core CI machine: 8–20 s for an 8 GB
/// checkpoint, against hours of GPTQ; the shards are hashed in parallel).
pub fn settings_fingerprint(
    opts: &QuantizeOptions,
    ck: &Checkpoint,
    calib_sha: &str,
) -> Result<String, QuantizeError> {
    use rayon::prelude::*;
    let mut h = Sha256::new();
    let cfg_path = ck.dir.join("config.json");
    h.update(std::fs::read(&cfg_path).map_err(io_err(&cfg_path))?);
    let mut files: Vec<&Path> = ck.store.files().collect();
    files.sort();
    let digests = files
        .par_iter()
        .map(|p| -> Result<String, QuantizeError> {
            let mut f = std::fs::File::open(p).map_err(io_err(p))?;
            let mut d = Sha256::new();
            std::io::copy(&mut f, &mut d).map_err(io_err(p))?;
            Ok(format!("{:x}", d.finalize()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    for (p, d) in files.iter().zip(digests) {
        h.update(format!("{:?} {d}\n", p.file_name()));
    }
    h.update(format!(
        "{calib_sha} {:?} g{} s{} l{} {:?} head{} damp{}",
        opts.format,
        opts.group_size,
        opts.samples,
        opts.seq_len,
        opts.qkv_layout,
        opts.quantize_head,
        opts.damp
    ));
    Ok(format!("{:x}", h.finalize()))
}

fn u8_tensor(name: &str, shape: Vec<usize>, v: &[u8]) -> OwnedTensor {
    OwnedTensor {
        name: name.into(),
        dtype: Dtype::U8,
        shape,
        data: v.to_vec(),
    }
}

fn read_q(store: &TensorStore, prefix: &str) -> Option<QuantizedWeight> {
    let c = store.get(&format!("{prefix}.codes"))?;
    let s = store.get(&format!("{prefix}.scales"))?;
    let (k, n) = (c.shape[0], c.shape[1]);
    let groups = s.shape[0];
    Some(QuantizedWeight {
        in_features: k,
        out_features: n,
        group_size: k / groups,
        codes: store.bytes(c).to_vec(),
        scales: store.to_f32(s).ok()?,
    })
}

/// Every quantized linear's dequantized weight `[N, K]` f32 under its checkpoint name.
pub fn dump_dequantized(
    path: &Path,
    results: &[LayerResult],
    head: Option<&QuantizedWeight>,
    layout: QkvLayout,
) -> Result<(), QuantizeError> {
    let mut t = Vec::new();
    let mut push = |name: String, q: &QuantizedWeight| {
        t.push(OwnedTensor::f32(
            &format!("{name}.weight"),
            vec![q.out_features, q.in_features],
            &q.dequantize(),
        ));
    };
    for (li, r) in results.iter().enumerate() {
        for (name, q) in stored(li, r, layout) {
            push(name, &q);
        }
    }
    if let Some(q) = head {
        push("lm_head".into(), q);
    }
    // The producer marks the file as ours, so a later run may replace it.
    let meta = BTreeMap::from([(
        "producer".to_string(),
        format!("spark-tool {}", env!("CARGO_PKG_VERSION")),
    )]);
    write_safetensors_atomic(path, &t, Some(meta)).map_err(QuantizeError::from)
}

/// Each stored linear of layer `li` (tensor prefix) with its weight: q, k and v are concatenated
/// along N into one `q_k_v_proj` when fused.
fn stored(
    li: usize,
    r: &LayerResult,
    layout: QkvLayout,
) -> Vec<(String, Cow<'_, QuantizedWeight>)> {
    stored_linears(li, layout, &Proj::QUANTIZED)
        .into_iter()
        .map(|(name, projs)| {
            let parts: Vec<&QuantizedWeight> = projs.iter().map(|&p| r.get(p)).collect();
            let q = match parts.as_slice() {
                [one] => Cow::Borrowed(*one),
                many => Cow::Owned(concat_outputs(many)),
            };
            (name, q)
        })
        .collect()
}

impl Output {
    pub fn prepare(opts: &QuantizeOptions, ck: &Checkpoint) -> Result<Self, QuantizeError> {
        let mut inputs: Vec<&Path> = vec![&ck.dir];
        inputs.extend(opts.calibration.iter().map(PathBuf::as_path));
        let staging = Staging::plan(&opts.out_dir, ARTIFACT_KIND, &inputs, opts.force)?;
        // Every output path is checked before hours of compute, not when it is written.
        if let Some(dump) = &opts.dump_dequantized {
            artifact::check_output_file(
                dump,
                &inputs,
                crate::setting::Setting::DumpDequantized,
                crate::generate::is_spark_safetensors,
            )?;
            if dump.starts_with(&opts.out_dir) {
                return Err(QuantizeError::Invalid(format!(
                    "{} {} lies inside {} {}, which is replaced as a whole; write it elsewhere",
                    crate::setting::Setting::DumpDequantized,
                    dump.display(),
                    crate::setting::Setting::Out,
                    opts.out_dir.display()
                )));
            }
        }
        Ok(Output {
            partial: staging.root().to_path_buf(),
            staging,
            qkv_layout: opts.qkv_layout,
        })
    }

    /// The staging folder (resume state and the checkpoint being built).
    pub fn staging_root(&self) -> &Path {
        self.staging.root()
    }

    /// Remove the staging folder after a failure that a rerun would repeat.
    pub fn discard(&self) {
        self.staging.discard();
    }

    pub fn reset_state(&self) -> Result<(), QuantizeError> {
        self.staging.reset()?;
        std::fs::create_dir_all(self.partial.join("layers")).map_err(io_err(&self.partial))?;
        Ok(())
    }

    /// Completed layers of an interrupted run with identical settings.
    pub fn load_state(
        &self,
        settings: &str,
        layers: usize,
    ) -> Result<Option<ResumeState>, QuantizeError> {
        let state_path = self.partial.join("state.json");
        let text = match std::fs::read_to_string(&state_path) {
            Ok(t) if self.staging.exists() => Some(t),
            _ => None,
        };
        let Some(text) = text else {
            eprintln!(
                "note: nothing to resume at {}; starting from layer 0",
                self.partial.display()
            );
            return Ok(None);
        };
        let st: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| QuantizeError::Json {
                path: state_path.clone(),
                source,
            })?;
        if st["settings"].as_str() != Some(settings) {
            return Err(QuantizeError::Invalid(format!(
                "{} was made with a different model, calibration or settings; run without {} to start over",
                self.partial.display(),
                crate::setting::Setting::Resume
            )));
        }
        let done = st["completed_layers"].as_u64().unwrap_or(0) as usize;
        let reports: Vec<LinearReport> =
            serde_json::from_value(st["reports"].clone()).map_err(|source| {
                QuantizeError::Json {
                    path: state_path.clone(),
                    source,
                }
            })?;
        let mut results = Vec::new();
        for li in 0..done.min(layers) {
            let p = self
                .partial
                .join(format!("layers/layer_{li:03}.safetensors"));
            let store = TensorStore::open_file(&p)?;
            let mut r = LayerResult::default();
            for proj in Proj::QUANTIZED {
                let part = proj.key();
                let q = read_q(&store, part).ok_or_else(|| {
                    QuantizeError::Invalid(format!("{}: missing {part}", p.display()))
                })?;
                r.insert(proj, q);
            }
            results.push(r);
        }
        let x_path = self.x_path(results.len());
        let xs = TensorStore::open_file(&x_path)?;
        let x = xs.to_f32(xs.get("x").ok_or_else(|| {
            QuantizeError::Invalid(format!("{}: no tensor `x`", x_path.display()))
        })?)?;
        eprintln!("resuming after layer {} of {layers}", results.len());
        Ok(Some(ResumeState {
            results,
            reports,
            x,
        }))
    }

    pub fn save_layer(
        &self,
        li: usize,
        r: &LayerResult,
        reports: &[LinearReport],
        x: &[f32],
        settings: &str,
    ) -> Result<(), QuantizeError> {
        let mut t = Vec::new();
        for proj in Proj::QUANTIZED {
            let (part, q) = (proj.key(), r.get(proj));
            t.push(u8_tensor(
                &format!("{part}.codes"),
                vec![q.in_features, q.out_features],
                &q.codes,
            ));
            t.push(OwnedTensor::f32(
                &format!("{part}.scales"),
                vec![q.scales.len() / q.out_features, q.out_features],
                &q.scales,
            ));
        }
        write_safetensors_atomic(
            &self
                .partial
                .join(format!("layers/layer_{li:03}.safetensors")),
            &t,
            None,
        )?;
        // The residual stream after layer `li`, under its own name: state.json, written last, is
        // the one commit point, so a kill between the files never pairs a count with another
        // layer's stream.
        write_safetensors_atomic(
            &self.x_path(li + 1),
            &[OwnedTensor::f32("x", vec![x.len()], x)],
            None,
        )?;
        let state_path = self.partial.join("state.json");
        let mut all: Vec<LinearReport> = std::fs::read_to_string(&state_path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .filter(|v| v["settings"].as_str() == Some(settings))
            .and_then(|v| serde_json::from_value(v["reports"].clone()).ok())
            .unwrap_or_default();
        all.extend_from_slice(reports);
        let st = json!({"settings": settings, "completed_layers": li + 1, "reports": all});
        artifact::write_json(&state_path, &st)?;
        let older = self.x_path(li);
        if older.exists() {
            std::fs::remove_file(&older).map_err(io_err(&older))?;
        }
        Ok(())
    }

    /// The residual stream after `layers` finished layers.
    fn x_path(&self, layers: usize) -> PathBuf {
        self.partial
            .join(format!("x_after_{layers:03}.safetensors"))
    }

    fn staged(&self) -> PathBuf {
        self.partial.join("staged")
    }

    /// Write the finished checkpoint into the staging folder. Returns (bytes of tensors, original parameter count).
    pub fn write(
        &self,
        ck: &Checkpoint,
        results: &[LayerResult],
        head: Option<&QuantizedWeight>,
        report: &mut QuantReport,
    ) -> Result<(u64, u64), QuantizeError> {
        let dir = self.staged();
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let mut tensors = Vec::new();
        let bf16_copy = |name: &str| -> Result<OwnedTensor, QuantizeError> {
            let e = ck.entry(name)?;
            let data = if e.dtype == Dtype::BF16 {
                ck.store.bytes(e).to_vec()
            } else {
                ck.store
                    .to_f32(e)?
                    .iter()
                    .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
                    .collect()
            };
            Ok(OwnedTensor {
                name: name.into(),
                dtype: Dtype::BF16,
                shape: e.shape.clone(),
                data,
            })
        };
        tensors.push(bf16_copy("model.embedding.weight")?);
        tensors.push(bf16_copy("model.norm.weight")?);
        for (li, r) in results.iter().enumerate() {
            let p = layer_prefix(li);
            let g_proj = format!("{}.weight", Proj::G.module());
            for n in [
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                g_proj.as_str(),
            ] {
                tensors.push(bf16_copy(&format!("{p}{n}"))?);
            }
            for (name, q) in stored(li, r, self.qkv_layout) {
                tensors.extend(tensors_for(&name, &q)?);
            }
        }
        match head {
            Some(q) => tensors.extend(tensors_for("lm_head", q)?),
            None if !ck.layout.tied => tensors.push(bf16_copy("lm_head.weight")?),
            None => {}
        }
        let bytes: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
        let mut params: u64 = ck
            .layout
            .expected
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum();
        if head.is_some() && ck.layout.tied {
            // Untying stores the head as its own (4-bit) tensor next to the bf16 embedding.
            params += (ck.config.vocab_size * ck.config.hidden_size) as u64;
        }

        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        meta.insert(
            "producer".to_string(),
            format!("spark-tool {}", env!("CARGO_PKG_VERSION")),
        );
        write_safetensors_atomic(&dir.join("model.safetensors"), &tensors, Some(meta))?;
        drop(tensors);

        let qc = self.quantization_config(report, head.is_some());
        let cfg_path = ck.dir.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?)
                .map_err(|source| QuantizeError::Json {
                path: cfg_path.clone(),
                source,
            })?;
        cfg["quantization_config"] = qc.clone();
        cfg["dtype"] = json!("bfloat16");
        if cfg.get("torch_dtype").is_some() {
            cfg["torch_dtype"] = json!("bfloat16");
        }
        cfg["tie_word_embeddings"] = json!(ck.layout.tied && head.is_none());
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&cfg).expect("json") + "\n",
        )
        .map_err(io_err(&dir))?;
        std::fs::write(
            dir.join("quantize_config.json"),
            serde_json::to_string_pretty(&gptq::legacy_quantize_config(&qc)).expect("json") + "\n",
        )
        .map_err(io_err(&dir))?;
        ck.copy_side_files(&dir)?;
        Ok((bytes, params))
    }

    /// docs/GPTQ_FORMAT.md §4, with the q/k/v aliases vLLM needs for the fused QKV (§5).
    fn quantization_config(&self, r: &QuantReport, head: bool) -> serde_json::Value {
        gptq::quantization_config(
            r.group_size,
            head,
            json!({
                "format": r.format,
                "method": r.method,
                "scale_rule": r.scale_rule,
                "qkv_layout": r.qkv_layout,
                "device_path": r.path,
                "calibration_sha256": r.calibration_sha256,
                "calibration_files": r.calibration_files,
                "samples": r.samples,
                "seq_len": r.seq_len,
            }),
        )
    }

    /// Write the report, move the finished checkpoint onto `--out`, drop the staging folder.
    pub fn finish(&self, report: &QuantReport) -> Result<(), QuantizeError> {
        let dir = self.staged();
        artifact::write_json(&dir.join("quant_report.json"), report)?;
        Ok(self.staging.commit(&dir)?)
    }
}
