//! Where `quantize` writes: a staging folder (`crate::artifact`) holding
//! per-layer results (so `--resume` can continue after an interruption) and
//! the finished checkpoint, which is swapped onto `--out` only at the very
//! end. Nothing under `--out` is ever half-written, and a replace only ever
//! removes a previous quantized checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::Dtype;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::lab::LayerTuneReport;
use super::{LayerResult, LinearReport, Norms, QuantReport, QuantizeError, QuantizeOptions};
use crate::artifact::{self, io_err, Staging};
use crate::checkpoint::layout::{layer_prefix, stored_linears};
use crate::checkpoint::write::{
    write_safetensors_atomic, write_safetensors_streamed, OwnedTensor, TensorSpec,
};
use crate::checkpoint::{Checkpoint, Proj, QkvLayout, SparkConfig, TensorStore};
use crate::formats::gguf::mix::FileType;
use crate::formats::gguf::{
    self as ggufmt, spark, spark::Slot, GgmlType, GgufFile, GgufWriter, TensorInfo,
};
use crate::formats::gptq::{self, concat_outputs, GPTQ_PARTS};
use crate::quant::Grid;
use crate::quant::QuantizedWeight;

pub struct Output {
    staging: Staging,
    partial: PathBuf,
    qkv_layout: QkvLayout,
    /// The projections each layer quantizes, and what decides their grids.
    projs: &'static [Proj],
    /// What decides each tensor's grid (and a GGUF tensor's type).
    recipe: super::Recipe,
    /// The model's shapes (a GGUF tensor's type depends on its row length).
    config: SparkConfig,
    tied: bool,
    /// Set once model tuning has staged every layer's tuned state beside the solved one: the
    /// solved files stay as they are, so a resume tunes from them again.
    model_tuned: std::sync::atomic::AtomicBool,
}

/// A layer's norm weights, under their module names (block tuning stages them with the layer).
const NORMS: [&str; 2] = ["input_layernorm.weight", "post_attention_layernorm.weight"];

/// What `crate::artifact` records a quantized checkpoint folder as.
pub const ARTIFACT_KIND: &str = "gptq checkpoint";
/// What a GGUF output is called in messages.
pub const GGUF_KIND: &str = "GGUF file";

/// Whether `path` is a GGUF file spark-tool wrote (it carries our producer key).
pub fn is_our_gguf(path: &Path) -> bool {
    GgufFile::open(path).is_ok_and(|f| f.kv(spark::PRODUCER_KEY).is_some())
}

/// The GGUF name of the head.
fn gguf_head_name(tied: bool) -> &'static str {
    if tied {
        "token_embd.weight"
    } else {
        "output.weight"
    }
}

/// Where an interrupted run stopped: its finished layers stay in the staging folder, read
/// back only when the checkpoint is written.
pub struct ResumeState {
    pub completed: usize,
    pub reports: Vec<LinearReport>,
    /// The streams file after the completed layers ([`super::streams::Streams`]).
    pub streams: PathBuf,
    /// What block tuning did to the finished layers.
    pub block_tune: Vec<LayerTuneReport>,
}

/// Identifies a run: same model bytes, calibration bytes and recipe ⇒ same fingerprint. The weights
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
    h.update(format!("{calib_sha} {}", opts.recipe.fingerprint()));
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

fn read_q(store: &TensorStore, prefix: &str, grid: Grid) -> Option<QuantizedWeight> {
    let c = store.get(&format!("{prefix}.codes"))?;
    let s = store.get(&format!("{prefix}.scales"))?;
    let (k, n) = (c.shape[0], c.shape[1]);
    let groups = s.shape[0];
    let tier_scales = match grid.tier_of(k) {
        Some(_) => store
            .to_f32(store.get(&format!("{prefix}.tier_scales"))?)
            .ok()?,
        None => Vec::new(),
    };
    Some(QuantizedWeight {
        in_features: k,
        out_features: n,
        group_size: k / groups,
        codes: store.bytes(c).to_vec(),
        scales: store.to_f32(s).ok()?,
        grid,
        tier_scales,
    })
}

/// Each stored linear of one finished layer with its weight, owned: q, k and v concatenated
/// along N into one `q_k_v_proj` when fused.
fn stored_owned(
    li: usize,
    mut r: LayerResult,
    layout: QkvLayout,
    projs: &[Proj],
) -> Vec<(String, QuantizedWeight)> {
    stored_linears(li, layout, projs)
        .into_iter()
        .map(|(name, projs)| {
            let q = match projs.as_slice() {
                [one] => r.take(*one),
                many => {
                    let parts: Vec<&QuantizedWeight> = many.iter().map(|&p| r.get(p)).collect();
                    concat_outputs(&parts)
                }
            };
            (name, q)
        })
        .collect()
}

/// The stored linears of the layer last asked for: the checkpoint is written in name order,
/// which visits each layer's tensors together, so one layer is in memory at a time.
struct LayerCache<'a> {
    out: &'a Output,
    layer: Option<usize>,
    linears: Vec<(String, QuantizedWeight)>,
    norms: Option<Norms>,
}

impl<'a> LayerCache<'a> {
    fn new(out: &'a Output) -> Self {
        LayerCache {
            out,
            layer: None,
            linears: Vec::new(),
            norms: None,
        }
    }

    fn load(&mut self, li: usize) -> Result<(), QuantizeError> {
        if self.layer != Some(li) {
            self.linears.clear();
            let mut r = self.out.load_layer(li)?;
            self.norms = r.norms.take();
            self.linears = stored_owned(li, r, self.out.qkv_layout, self.out.projs);
            self.layer = Some(li);
        }
        Ok(())
    }

    /// Layer `li`'s tuned norms, when it has them.
    fn norms(&mut self, li: usize) -> Result<Option<&Norms>, QuantizeError> {
        self.load(li)?;
        Ok(self.norms.as_ref())
    }

    fn get(&mut self, li: usize, prefix: &str) -> Result<&QuantizedWeight, QuantizeError> {
        self.load(li)?;
        Ok(self
            .linears
            .iter()
            .find(|(n, _)| n == prefix)
            .map(|(_, q)| q)
            .expect("every stored linear of a layer is in its result"))
    }
}

/// Where one tensor of the written checkpoint comes from.
enum Source {
    /// Copied from the input checkpoint as bf16.
    Copy(String),
    /// A norm weight of layer `layer` as block tuning left it (`which`: index in [`NORMS`]).
    TunedNorm { layer: usize, which: usize },
    /// A GPTQ part of a stored linear of layer `li` (`None`: the head).
    Gptq {
        layer: Option<usize>,
        prefix: String,
        part: &'static str,
    },
}

/// A checkpoint tensor as bf16 bytes: bf16 as stored, anything else rounded from f32.
fn bf16_copy(ck: &Checkpoint, name: &str) -> Result<Vec<u8>, QuantizeError> {
    let e = ck.entry(name)?;
    Ok(if e.dtype == Dtype::BF16 {
        ck.store.bytes(e).to_vec()
    } else {
        ck.store
            .to_f32(e)?
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect()
    })
}

impl Output {
    pub fn prepare(opts: &QuantizeOptions, ck: &Checkpoint) -> Result<Self, QuantizeError> {
        let mut inputs: Vec<&Path> = vec![&ck.dir];
        inputs.extend(opts.recipe.calibration.iter().map(PathBuf::as_path));
        let staging = if opts.recipe.gguf.is_some() {
            Staging::plan_file(&opts.out_dir, GGUF_KIND, &inputs, opts.force, is_our_gguf)?
        } else {
            Staging::plan(&opts.out_dir, ARTIFACT_KIND, &inputs, opts.force)?
        };
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
            projs: opts.recipe.projs(),
            // GGUF has one attn_qkv tensor per layer.
            qkv_layout: if opts.recipe.gguf.is_some() {
                QkvLayout::Fused
            } else {
                opts.recipe.qkv_layout
            },
            recipe: opts.recipe.clone(),
            config: ck.config.clone(),
            tied: ck.layout.tied,
            model_tuned: false.into(),
        })
    }

    /// The staging folder (resume state and the checkpoint being built).
    pub fn staging_root(&self) -> &Path {
        self.staging.root()
    }

    /// From the first saved layer on (or on a resumed run), an interruption keeps the staging
    /// folder for `--resume` and says so, instead of removing it.
    pub fn keep_for_resume(&self) {
        self.staging.keep_on_interrupt(format!(
            "the finished layers are kept in {}: run the same command with {} to continue from \
             them, or remove that folder to free the space",
            self.partial.display(),
            crate::setting::Setting::Resume
        ));
    }

    /// Remove the staging folder after a failure that a rerun would repeat.
    pub fn discard(&self) {
        self.staging.discard();
    }

    /// Start from layer 0, saying so when an interrupted run's finished layers are discarded.
    pub fn reset_state(&self) -> Result<(), QuantizeError> {
        let state = self.partial.join("state.json");
        let kept = std::fs::read_to_string(&state)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["completed_layers"].as_u64())
            .filter(|&n| n > 0 && self.staging.exists());
        if let Some(n) = kept {
            eprintln!(
                "note: starting over: the {n} finished layer(s) an interrupted run kept in {} are \
                 discarded ({} continues from them, with the same settings)",
                self.partial.display(),
                crate::setting::Setting::Resume
            );
        }
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
        let block_tune: Vec<LayerTuneReport> = match st.get("block_tune") {
            Some(v) => serde_json::from_value(v.clone()).map_err(|source| QuantizeError::Json {
                path: state_path.clone(),
                source,
            })?,
            None => Vec::new(),
        };
        let completed = done.min(layers);
        // Every finished layer must still be readable; its weights are read when written out.
        for li in 0..completed {
            self.load_layer(li)?;
        }
        let streams = self.x_path(completed);
        if !streams.is_file() {
            return Err(QuantizeError::Invalid(format!(
                "{}: the streams after layer {completed} are missing; run without {} to start over",
                streams.display(),
                crate::setting::Setting::Resume
            )));
        }
        eprintln!("resuming after layer {completed} of {layers}");
        Ok(Some(ResumeState {
            completed,
            reports,
            streams,
            block_tune,
        }))
    }

    fn layer_path(&self, li: usize) -> PathBuf {
        self.partial
            .join(format!("layers/layer_{li:03}.safetensors"))
    }

    fn tuned_layer_path(&self, li: usize) -> PathBuf {
        self.partial
            .join(format!("layers/layer_{li:03}.model-tuned.safetensors"))
    }

    /// A finished layer's quantized linears as solved, read back from the staging folder.
    pub(super) fn load_solved_layer(&self, li: usize) -> Result<LayerResult, QuantizeError> {
        self.load_layer_from(&self.layer_path(li), li)
    }

    /// A finished layer as it will be written: model tuning's state once it has run.
    fn load_layer(&self, li: usize) -> Result<LayerResult, QuantizeError> {
        if self.model_tuned.load(std::sync::atomic::Ordering::Acquire) {
            self.load_layer_from(&self.tuned_layer_path(li), li)
        } else {
            self.load_solved_layer(li)
        }
    }

    /// Stage model tuning's state of every layer (in order) and use it from now on.
    #[cfg(feature = "lab")]
    pub(super) fn stage_model_tuned(&self, layers: &[LayerResult]) -> Result<(), QuantizeError> {
        for (li, r) in layers.iter().enumerate() {
            write_safetensors_atomic(&self.tuned_layer_path(li), &self.layer_tensors(r), None)?;
        }
        self.model_tuned
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    fn load_layer_from(&self, p: &Path, li: usize) -> Result<LayerResult, QuantizeError> {
        let p = p.to_path_buf();
        let store = TensorStore::open_file(&p)?;
        let mut r = LayerResult::default();
        for &proj in self.projs {
            let part = proj.key();
            let grid = self
                .recipe
                .grid_of(
                    super::SolvedTensor::Linear { layer: li, proj },
                    &self.config,
                )
                .0;
            let q = read_q(&store, part, grid).ok_or_else(|| {
                QuantizeError::Invalid(format!("{}: missing {part}", p.display()))
            })?;
            r.insert(proj, q);
        }
        if let (Some(a), Some(b)) = (store.get(NORMS[0]), store.get(NORMS[1])) {
            r.norms = Some((store.to_f32(a)?, store.to_f32(b)?));
        }
        Ok(r)
    }

    /// Every quantized linear's dequantized weight `[N, K]` f32 under its checkpoint name,
    /// written one linear at a time.
    pub fn dump_dequantized(
        &self,
        path: &Path,
        cfg: &SparkConfig,
        layers: usize,
        head: Option<&QuantizedWeight>,
    ) -> Result<(), QuantizeError> {
        let mut specs = Vec::new();
        let mut sources = HashMap::new();
        for li in 0..layers {
            for (name, projs) in stored_linears(li, self.qkv_layout, self.projs) {
                let n = projs.iter().map(|p| p.shape(cfg)[0]).sum();
                let k = projs[0].shape(cfg)[1];
                let t = match self.recipe.gguf {
                    Some(_) => spark::linear_name(li, &projs),
                    None => format!("{name}.weight"),
                };
                specs.push(TensorSpec {
                    name: t.clone(),
                    dtype: Dtype::F32,
                    shape: vec![n, k],
                });
                sources.insert(t, (Some(li), name));
            }
        }
        if head.is_some() {
            let t: String = match self.recipe.gguf {
                Some(_) => gguf_head_name(self.tied).into(),
                None => "lm_head.weight".into(),
            };
            specs.push(TensorSpec {
                name: t.clone(),
                dtype: Dtype::F32,
                shape: vec![cfg.vocab_size, cfg.hidden_size],
            });
            sources.insert(t, (None, "lm_head".into()));
        }
        // The producer marks the file as ours, so a later run may replace it.
        let meta = BTreeMap::from([(
            "producer".to_string(),
            format!("spark-tool {}", env!("CARGO_PKG_VERSION")),
        )]);
        let mut cache = LayerCache::new(self);
        write_safetensors_streamed(path, specs, Some(meta), |spec, w| {
            let q = match &sources[&spec.name] {
                (Some(li), prefix) => cache.get(*li, prefix)?,
                (None, _) => head.expect("a head spec only with a head"),
            };
            let bytes: Vec<u8> = q
                .dequantize()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            Ok(w.write_all(&bytes).map_err(io_err(path))?)
        })
    }

    /// Stage layer `li`'s result and commit it with `streams`, the closed streams file after
    /// it, which becomes the resume state by a rename.
    pub fn save_layer(
        &self,
        li: usize,
        r: &LayerResult,
        reports: &[LinearReport],
        streams: &Path,
        settings: &str,
    ) -> Result<(), QuantizeError> {
        write_safetensors_atomic(&self.layer_path(li), &self.layer_tensors(r), None)?;
        // The residual streams after layer `li`, under their own name: state.json, written last,
        // is the one commit point, so a kill between the files never pairs a count with another
        // layer's streams.
        let file = std::fs::File::open(streams).map_err(io_err(streams))?;
        file.sync_all().map_err(io_err(streams))?;
        let path = self.x_path(li + 1);
        std::fs::rename(streams, &path).map_err(io_err(&path))?;
        self.commit_layer(li, r, reports, settings)
    }

    /// The staging folder of the run's state and scratch files.
    pub fn scratch_dir(&self) -> &Path {
        &self.partial
    }

    /// Where layer `li` advances the streams before they are committed.
    pub fn work_streams_path(&self, li: usize) -> PathBuf {
        self.partial.join(format!("x_in_layer_{li:03}.safetensors"))
    }

    /// A layer's linears (and tuned norms) as staged.
    fn layer_tensors(&self, r: &LayerResult) -> Vec<OwnedTensor> {
        let mut t = Vec::new();
        for &proj in self.projs {
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
            if !q.tier_scales.is_empty() {
                t.push(OwnedTensor::f32(
                    &format!("{part}.tier_scales"),
                    vec![q.tier_scales.len() / q.out_features, q.out_features],
                    &q.tier_scales,
                ));
            }
        }
        if let Some((a, b)) = &r.norms {
            t.push(OwnedTensor::f32(NORMS[0], vec![a.len()], a));
            t.push(OwnedTensor::f32(NORMS[1], vec![b.len()], b));
        }
        t
    }

    fn commit_layer(
        &self,
        li: usize,
        r: &LayerResult,
        reports: &[LinearReport],
        settings: &str,
    ) -> Result<(), QuantizeError> {
        let state_path = self.partial.join("state.json");
        let prev = std::fs::read_to_string(&state_path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .filter(|v| v["settings"].as_str() == Some(settings));
        let mut all: Vec<LinearReport> = prev
            .as_ref()
            .and_then(|v| serde_json::from_value(v["reports"].clone()).ok())
            .unwrap_or_default();
        all.extend_from_slice(reports);
        let mut tuned: Vec<LayerTuneReport> = prev
            .as_ref()
            .and_then(|v| serde_json::from_value(v["block_tune"].clone()).ok())
            .unwrap_or_default();
        tuned.extend(r.tune.clone());
        let st = json!({"settings": settings, "completed_layers": li + 1, "reports": all,
                        "block_tune": tuned});
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

    /// Write the finished checkpoint into the staging folder, one tensor at a time: the
    /// `layers` finished layers are read back from their staged results. Returns (bytes of
    /// tensors, original parameter count).
    pub fn write(
        &self,
        ck: &Checkpoint,
        layers: usize,
        group_size: usize,
        head: Option<&QuantizedWeight>,
        report: &mut QuantReport,
    ) -> Result<(u64, u64), QuantizeError> {
        let dir = self.staged();
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let cfg = &ck.config;
        let mut specs = Vec::new();
        let mut sources = HashMap::new();
        let mut copy = |name: String| -> Result<(), QuantizeError> {
            let e = ck.entry(&name)?;
            specs.push(TensorSpec {
                name: name.clone(),
                dtype: Dtype::BF16,
                shape: e.shape.clone(),
            });
            sources.insert(name.clone(), Source::Copy(name));
            Ok(())
        };
        let mut tuned_norms = Vec::new();
        copy("model.embedding.weight".into())?;
        copy("model.norm.weight".into())?;
        for li in 0..layers {
            let p = layer_prefix(li);
            for n in [NORMS[0], NORMS[1], &format!("{}.weight", Proj::G.module())] {
                copy(format!("{p}{n}"))?;
            }
            if report.recipe.lab.block_tune.is_some() || report.recipe.lab.model_tune.is_some() {
                for (which, n) in NORMS.iter().enumerate() {
                    tuned_norms.push((format!("{p}{n}"), Source::TunedNorm { layer: li, which }));
                }
            }
        }
        if head.is_none() && !ck.layout.tied {
            copy("lm_head.weight".into())?;
        }
        sources.extend(tuned_norms);
        let mut linear = |layer: Option<usize>, prefix: String, k: usize, n: usize| {
            for (s, part) in gptq::linear_specs(&prefix, k, n, group_size)?
                .into_iter()
                .zip(GPTQ_PARTS)
            {
                let source = Source::Gptq {
                    layer,
                    prefix: prefix.clone(),
                    part,
                };
                sources.insert(s.name.clone(), source);
                specs.push(s);
            }
            Ok::<(), QuantizeError>(())
        };
        for li in 0..layers {
            for (name, projs) in stored_linears(li, self.qkv_layout, &Proj::QUANTIZED) {
                let n = projs.iter().map(|p| p.shape(cfg)[0]).sum();
                linear(Some(li), name, projs[0].shape(cfg)[1], n)?;
            }
        }
        if head.is_some() {
            linear(None, "lm_head".into(), cfg.hidden_size, cfg.vocab_size)?;
        }
        let bytes: u64 = specs.iter().map(|t| t.bytes() as u64).sum();
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
        let path = dir.join("model.safetensors");
        let mut cache = LayerCache::new(self);
        write_safetensors_streamed(&path, specs, Some(meta), |spec, w| {
            let bytes = match &sources[&spec.name] {
                Source::Copy(name) => bf16_copy(ck, name)?,
                Source::TunedNorm { layer, which } => {
                    let (a, b) = cache.norms(*layer)?.ok_or_else(|| {
                        QuantizeError::Invalid(format!(
                            "{}: layer {layer} was block-tuned but its norms are not staged",
                            self.partial.display()
                        ))
                    })?;
                    [a, b][*which]
                        .iter()
                        .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
                        .collect()
                }
                Source::Gptq {
                    layer,
                    prefix,
                    part,
                } => {
                    let q = match layer {
                        Some(li) => cache.get(*li, prefix)?,
                        None => head.expect("a head spec only with a head"),
                    };
                    gptq::part_bytes(part, q)
                }
            };
            Ok::<(), QuantizeError>(w.write_all(&bytes).map_err(io_err(&path))?)
        })?;
        drop(cache);

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
        std::fs::write(dir.join(super::recipe::FILE_NAME), report.recipe.to_toml())
            .map_err(io_err(&dir))?;
        ck.copy_side_files(&dir)?;
        Ok((bytes, params))
    }

    fn staged_gguf(&self) -> PathBuf {
        self.partial.join("model.gguf")
    }

    /// Write the finished GGUF file into the staging folder, one tensor at a time (a layer's
    /// linears are read back from its staged result; the head in row blocks). Returns (bytes of
    /// tensor data, parameter count).
    pub fn write_gguf(
        &self,
        ck: &Checkpoint,
        ft: FileType,
        head: &QuantizedWeight,
        report: &QuantReport,
    ) -> Result<(u64, u64), QuantizeError> {
        let cfg = &ck.config;
        let path = self.staged_gguf();
        let tok_dir = ck
            .tokenizer_path()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_else(|| ck.dir.clone());
        let name = ck
            .dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "spark".into());
        let mut kv = spark::metadata(cfg, &tok_dir, &name, ft)?;
        kv.push((
            "spark_tool.quantization".into(),
            ggufmt::Value::String(provenance(report).to_string()),
        ));
        kv.push((
            super::recipe::GGUF_KEY.into(),
            ggufmt::Value::String(report.recipe.to_toml()),
        ));
        let plan = spark::tensor_plan(cfg, self.tied);
        let solved_type = |t| {
            self.recipe
                .gguf_type(t, cfg)
                .expect("a GGUF file is written from a GGUF recipe")
        };
        let type_of = |slot: &Slot| -> GgmlType {
            match slot {
                Slot::Norm { .. } => GgmlType::F32,
                Slot::Embedding if !self.tied => GgmlType::BF16,
                Slot::Embedding | Slot::Head => {
                    solved_type(super::SolvedTensor::Head { tied: self.tied })
                }
                Slot::Linear { layer, projs } => solved_type(super::SolvedTensor::Linear {
                    layer: *layer,
                    proj: projs[0],
                }),
            }
        };
        let hf_of = |slot: &Slot| -> Option<(usize, String)> {
            let Slot::Linear { layer, projs } = slot else {
                return None;
            };
            let (stored, _) = stored_linears(*layer, QkvLayout::Fused, projs).remove(0);
            Some((*layer, stored))
        };
        let dims = |slot: &Slot| -> Vec<u64> {
            let (n, k) = match slot {
                Slot::Norm { hf } => return vec![ck.entry(hf).map_or(0, |e| e.numel()) as u64],
                Slot::Embedding | Slot::Head => (cfg.vocab_size, cfg.hidden_size),
                Slot::Linear { projs, .. } => {
                    let n = projs.iter().map(|p| p.shape(cfg)[0]).sum();
                    (n, projs[0].shape(cfg)[1])
                }
            };
            vec![k as u64, n as u64]
        };
        let infos: Vec<TensorInfo> = plan
            .iter()
            .map(|(name, slot)| TensorInfo {
                name: name.clone(),
                dims: dims(slot),
                ty: type_of(slot),
            })
            .collect::<Vec<_>>();
        for t in &infos {
            t.ty.row_bytes(t.dims[0] as usize).map_err(|_| {
                QuantizeError::Invalid(format!(
                    "{}: rows of {} inputs are not whole {} blocks of {}; {} cannot hold this model",
                    t.name,
                    t.dims[0],
                    t.ty.name(),
                    t.ty.block_len(),
                    ft.llama_name()
                ))
            })?;
        }
        let bytes: u64 = infos.iter().map(|t| t.nbytes() as u64).sum();
        let params: u64 = infos.iter().map(|t| t.dims.iter().product::<u64>()).sum();
        let mut cache = LayerCache::new(self);
        artifact::write_file(&path, |file| {
            let fail = |e: QuantizeError| std::io::Error::other(e.to_string());
            let mut w = GgufWriter::new(file, &kv, &infos, 32).map_err(std::io::Error::other)?;
            let mut buf = Vec::new();
            for ((name, slot), info) in plan.iter().zip(&infos) {
                buf.clear();
                match slot {
                    Slot::Norm { hf } => {
                        let v = ck.tensor_f32(hf).map_err(|e| fail(e.into()))?;
                        buf.extend(v.iter().flat_map(|x| x.to_le_bytes()));
                        w.write_tensor(name, &buf).map_err(std::io::Error::other)?;
                    }
                    Slot::Embedding if !self.tied => {
                        let v = bf16_copy(ck, "model.embedding.weight").map_err(fail)?;
                        w.write_tensor(name, &v).map_err(std::io::Error::other)?;
                    }
                    Slot::Embedding | Slot::Head => {
                        // The head is the largest tensor: encoded and written in row blocks.
                        for r0 in (0..head.out_features).step_by(4096) {
                            buf.clear();
                            let r1 = (r0 + 4096).min(head.out_features);
                            ggufmt::quantized::encode_rows(head, info.ty, r0..r1, name, &mut buf)
                                .map_err(std::io::Error::other)?;
                            w.write_tensor_part(name, &buf)
                                .map_err(std::io::Error::other)?;
                        }
                    }
                    Slot::Linear { .. } => {
                        let (li, stored) = hf_of(slot).expect("a linear slot");
                        let q = cache.get(li, &stored).map_err(fail)?;
                        ggufmt::quantized::encode_rows(
                            q,
                            info.ty,
                            0..q.out_features,
                            name,
                            &mut buf,
                        )
                        .map_err(std::io::Error::other)?;
                        w.write_tensor(name, &buf).map_err(std::io::Error::other)?;
                    }
                }
            }
            w.finish().map(drop).map_err(std::io::Error::other)
        })?;
        Ok((bytes, params))
    }

    /// docs/GPTQ_FORMAT.md §4, with the q/k/v aliases vLLM needs for the fused QKV (§5).
    fn quantization_config(&self, r: &QuantReport, head: bool) -> serde_json::Value {
        let mut p = provenance(r);
        p["format"] = json!(r.recipe.format);
        gptq::quantization_config(r.recipe.group_size, head, p)
    }

    /// Write the report (and `page`'s), move the finished checkpoint onto `--out`, drop the
    /// staging folder.
    pub fn finish(
        &self,
        report: &QuantReport,
        page: Option<super::PageWriter>,
    ) -> Result<(), QuantizeError> {
        if self.recipe.gguf.is_some() {
            // The report's essentials are in the file's metadata; the whole report is printed.
            return Ok(self.staging.commit_file(&self.staged_gguf())?);
        }
        let dir = self.staged();
        artifact::write_json(&dir.join("quant_report.json"), report)?;
        if let Some(write) = page {
            write(&dir, report).map_err(QuantizeError::Page)?;
        }
        Ok(self.staging.commit(&dir)?)
    }
}

/// What an output records of how it was made (`quantization_config.meta.spark_tool` of a GPTQ
/// checkpoint, `spark_tool.quantization` of a GGUF): the recipe, and what the run made of it.
fn provenance(r: &QuantReport) -> serde_json::Value {
    json!({
        "recipe": r.recipe,
        "scale_rule": r.scale_rule,
        "objective": r.objective,
        "calibration_files": r.calibration_files,
        "calibration_sha256": r.calibration_sha256,
        "samples": r.samples,
        "seq_len": r.seq_len,
        "mean_output_error": r.mean_error,
    })
}
