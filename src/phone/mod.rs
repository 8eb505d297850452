//! Drive an exported phone graph on CPU with ONNX Runtime, exactly as an app
//! would: the host looks up the embedding row, builds the per-type masks and
//! rotary cos/sin, owns the KV caches (a ring of W−1 slots for sliding
//! layers, slot = position for full layers) and copies each step's new K/V
//! integers into them. ONNX Runtime is loaded at run time from the pip
//! `onnxruntime` package (or `ORT_DYLIB_PATH`); nothing is linked at build time.

pub mod manifest;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use ort::session::SessionInputValue;
use ort::session::{builder::GraphOptimizationLevel, Session};
use ort::value::{DynValue, Tensor, TensorRef};

use crate::checkpoint::{SparkConfig, TensorStore};
use crate::engine::{Engine, Sequence};
use crate::model::rope::Rope;
use crate::model::{Logits, ModelError};
pub use manifest::{Encoding, Manifest, QType, MANIFEST};

#[derive(Debug, thiserror::Error)]
pub enum PhoneError {
    #[error("{0}")]
    Manifest(String),
    #[error(
        "ONNX Runtime is needed to execute phone graphs and was not found ({0}). Install it with \
         `pip install onnxruntime==1.32.0` (spark-tool then finds it through python3), or set \
         ORT_DYLIB_PATH=/path/to/libonnxruntime.so.1.x"
    )]
    NoRuntime(String),
    #[error("ONNX Runtime: {0}")]
    Ort(#[source] ort::Error),
    #[error("{}: ONNX Runtime: {source}", path.display())]
    Part {
        path: PathBuf,
        #[source]
        source: ort::Error,
    },
    #[error("{0}")]
    Broken(&'static str),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Config(#[from] crate::checkpoint::ConfigError),
}

fn ort_err(e: impl Into<ort::Error>) -> PhoneError {
    PhoneError::Ort(e.into())
}

/// The shared library: `ORT_DYLIB_PATH`, else the pip package python3 imports.
fn find_runtime() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("ORT_DYLIB_PATH={} is not a file", p.display()))
        };
    }
    let py = "import onnxruntime, os, glob; d = os.path.join(os.path.dirname(onnxruntime.__file__), 'capi'); \
              print(sorted(glob.glob(os.path.join(d, 'libonnxruntime.so*')) + glob.glob(os.path.join(d, 'libonnxruntime*.dylib')) + glob.glob(os.path.join(d, 'onnxruntime.dll')))[0])";
    let out = std::process::Command::new("python3")
        .args(["-c", py])
        .output()
        .map_err(|e| format!("could not run python3: {e}"))?;
    if !out.status.success() {
        return Err("python3 cannot import onnxruntime".into());
    }
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!("{} does not exist", p.display()))
    }
}

static ENV: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();

/// A phone-runtime failure as a model error, its cause kept.
fn backend(e: PhoneError) -> ModelError {
    ModelError::Backend(Box::new(e))
}

pub fn environment() -> Result<&'static ort::environment::Environment, PhoneError> {
    ENV.get_or_init(|| {
        let lib = find_runtime()?;
        ort::init_from(&lib)
            .map_err(|e| format!("loading {}: {e}", lib.display()))?
            .with_name("spark-tool")
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| PhoneError::NoRuntime(e.clone()))
}

/// Host-side storage of one cache tensor (raw integers when quantized).
enum Buf {
    F32(Vec<f32>),
    I16(Vec<i16>),
    U8(Vec<u8>),
}

impl Buf {
    fn new(dtype: &str, n: usize, zero: i32) -> Result<Self, PhoneError> {
        Ok(match dtype {
            "float32" => Buf::F32(vec![0.0; n]),
            "int16" => Buf::I16(vec![zero as i16; n]),
            "uint8" => Buf::U8(vec![zero as u8; n]),
            d => {
                return Err(PhoneError::Manifest(format!(
                    "cache dtype `{d}` is not supported"
                )))
            }
        })
    }
    /// A view of the cache for one run: no copy of the (up to context-long) buffer.
    fn value(&self, shape: &[usize]) -> Result<SessionInputValue<'_>, PhoneError> {
        let s = shape.to_vec();
        Ok(match self {
            Buf::F32(v) => TensorRef::from_array_view((s, v.as_slice()))
                .map_err(ort_err)?
                .into(),
            Buf::I16(v) => TensorRef::from_array_view((s, v.as_slice()))
                .map_err(ort_err)?
                .into(),
            Buf::U8(v) => TensorRef::from_array_view((s, v.as_slice()))
                .map_err(ort_err)?
                .into(),
        })
    }
    /// Copy `src` (the graph's new entry, `n` values) to positions `at(i)`.
    fn write(&mut self, src: &DynValue, at: impl Fn(usize) -> usize) -> Result<(), PhoneError> {
        match self {
            Buf::F32(v) => {
                let (_, d) = src.try_extract_tensor::<f32>().map_err(ort_err)?;
                d.iter().enumerate().for_each(|(i, x)| v[at(i)] = *x);
            }
            Buf::I16(v) => {
                let (_, d) = src.try_extract_tensor::<i16>().map_err(ort_err)?;
                d.iter().enumerate().for_each(|(i, x)| v[at(i)] = *x);
            }
            Buf::U8(v) => {
                let (_, d) = src.try_extract_tensor::<u8>().map_err(ort_err)?;
                d.iter().enumerate().for_each(|(i, x)| v[at(i)] = *x);
            }
        }
        Ok(())
    }
}

pub struct PhoneModel {
    pub dir: PathBuf,
    pub manifest: Manifest,
    config: SparkConfig,
    embedding: TensorStore,
    ropes: HashMap<String, Rope>,
    /// The parts this model runs (all but in calibration, which runs one part at a time).
    parts: std::ops::Range<usize>,
    sessions: Vec<Mutex<Session>>,
}

/// What one step of a range of parts produced: the residual stream it hands on, and the logits
/// when the range ends with the head.
pub struct PartsOut {
    pub hidden: Vec<f32>,
    pub logits: Option<Vec<f32>>,
}

/// True when `dir` holds an exported phone graph.
pub use crate::artifact::is_phone_export;

impl PhoneModel {
    pub fn open(dir: &Path, threads: usize) -> Result<Self, PhoneError> {
        Self::open_parts(dir, threads, None)
    }

    /// Only the parts `parts` (all when `None`): ONNX Runtime then holds only their weights.
    /// Their sequences are driven with [`PhoneSequence::step_parts`].
    pub fn open_parts(
        dir: &Path,
        threads: usize,
        parts: Option<std::ops::Range<usize>>,
    ) -> Result<Self, PhoneError> {
        let manifest = Manifest::read(dir).map_err(PhoneError::Manifest)?;
        let parts = parts.unwrap_or(0..manifest.parts.len());
        if parts.start >= parts.end || parts.end > manifest.parts.len() {
            return Err(PhoneError::Manifest(format!(
                "parts {parts:?} asked of an export with {} parts",
                manifest.parts.len()
            )));
        }
        let config = SparkConfig::from_file(&dir.join("config.json"))?;
        let embedding = TensorStore::open_file(&dir.join(&manifest.embedding.file))?;
        if embedding.get(&manifest.embedding.tensor).is_none() {
            return Err(PhoneError::Manifest(format!(
                "{}: no tensor `{}`",
                manifest.embedding.file, manifest.embedding.tensor
            )));
        }
        let env = environment()?;
        let mut sessions = Vec::new();
        for part in &manifest.parts[parts.clone()] {
            let path = dir.join(&part.file);
            // Level 1 only: higher levels fuse DQ→MatMul into MatMulNBits,
            // which quantizes activations and changes the numerics.
            let s = Session::builder(env)
                .map_err(ort_err)?
                .with_optimization_level(GraphOptimizationLevel::Level1)
                .map_err(ort_err)?
                .with_intra_threads(threads.max(1))
                .map_err(ort_err)?
                .commit_from_file(&path)
                .map_err(|e| PhoneError::Part {
                    path: path.clone(),
                    source: e,
                })?;
            sessions.push(Mutex::new(s));
        }
        let ropes = manifest
            .types
            .iter()
            .map(|(t, i)| {
                (
                    t.clone(),
                    Rope::new(crate::checkpoint::RopeSpec {
                        theta: i.rope_theta,
                        rotary_dims: i.rotary_dims,
                    }),
                )
            })
            .collect();
        Ok(PhoneModel {
            dir: dir.to_path_buf(),
            manifest,
            config,
            embedding,
            ropes,
            parts,
            sessions,
        })
    }

    /// The embedding row of `token`: what part 0 reads.
    pub fn embed(&self, token: u32) -> Result<Vec<f32>, ModelError> {
        let h = self.manifest.hidden_size;
        if token as usize >= self.manifest.vocab_size {
            return Err(ModelError::TokenOutOfRange {
                id: token,
                index: 0,
                vocab: self.manifest.vocab_size,
            });
        }
        let e = self
            .embedding
            .get(&self.manifest.embedding.tensor)
            .ok_or(PhoneError::Broken("the embedding table lost its tensor"))
            .map_err(backend)?;
        self.embedding
            .rows_to_f32(e, token as usize, token as usize + 1)
            .map(|r| r[..h].to_vec())
            .map_err(|e| backend(e.into()))
    }

    pub fn sequence(&self) -> Result<PhoneSequence<'_>, PhoneError> {
        // Unwritten slots hold the encoding's zero (they are masked anyway).
        let zero = |name: &str| {
            self.manifest
                .parts
                .iter()
                .flat_map(|p| &p.inputs)
                .find(|i| i.name == name)
                .and_then(|i| i.encoding)
                .map_or(0, |e| e.zero_point)
        };
        // Caches of the parts this model runs; the others stay empty.
        let inputs: std::collections::HashSet<&str> = self.manifest.parts[self.parts.clone()]
            .iter()
            .flat_map(|p| &p.inputs)
            .map(|i| i.name.as_str())
            .collect();
        let mut caches = Vec::new();
        for c in &self.manifest.caches {
            let size = |shape: &[usize], name: &str| {
                if inputs.contains(name) {
                    shape.iter().product()
                } else {
                    0
                }
            };
            caches.push((
                Buf::new(&c.dtype, size(&c.key_shape, &c.key_in), zero(&c.key_in))?,
                Buf::new(
                    &c.dtype,
                    size(&c.value_shape, &c.value_in),
                    zero(&c.value_in),
                )?,
            ));
        }
        Ok(PhoneSequence {
            model: self,
            pos: 0,
            caches,
        })
    }
}

pub struct PhoneSequence<'a> {
    model: &'a PhoneModel,
    pos: usize,
    caches: Vec<(Buf, Buf)>,
}

impl PhoneSequence<'_> {
    /// One decode step; `observe` sees every float output (calibration taps included).
    pub fn step(
        &mut self,
        token: u32,
        observe: impl FnMut(&str, &[f32]),
    ) -> Result<Vec<f32>, ModelError> {
        let hidden = self.model.embed(token)?;
        let out = self.step_parts(hidden, observe)?;
        out.logits
            .ok_or_else(|| backend(PhoneError::Broken("the last part produced no `logits`")))
    }

    /// One step of the parts this model runs, from the residual stream entering the first of
    /// them (the token's embedding for part 0).
    pub fn step_parts(
        &mut self,
        mut hidden: Vec<f32>,
        mut observe: impl FnMut(&str, &[f32]),
    ) -> Result<PartsOut, ModelError> {
        let m = self.model;
        let man = &m.manifest;
        let pos = self.pos;
        if pos >= man.context {
            return Err(ModelError::PastContext {
                needed: pos + 1,
                context: man.context,
            });
        }
        let run = backend;
        // Per layer type: mask (0 = attend), cos, sin.
        // mask, cos, sin
        type Host = (Vec<f32>, Vec<f32>, Vec<f32>);
        let mut per_type: HashMap<&str, Host> = HashMap::new();
        for (t, info) in &man.types {
            let valid = pos.min(info.past_len);
            let mask: Vec<f32> = (0..=info.past_len)
                .map(|j| {
                    if j < valid || j == info.past_len {
                        0.0
                    } else {
                        man.mask_value
                    }
                })
                .collect();
            let (cos, sin) = m.ropes[t].angles(pos);
            per_type.insert(t.as_str(), (mask, cos, sin));
        }
        let mut logits = None;
        for (si, part) in man.parts[m.parts.clone()].iter().enumerate() {
            let mut feeds: Vec<(String, SessionInputValue)> = Vec::new();
            for io in &part.inputs {
                let shape = io.shape.clone();
                let f = |v: Vec<f32>| -> Result<SessionInputValue, ModelError> {
                    Ok(Tensor::from_array((shape.clone(), v))
                        .map_err(|e| run(ort_err(e)))?
                        .into_dyn()
                        .into())
                };
                let value = if let Some(ci) = man.caches.iter().position(|c| c.key_in == io.name) {
                    self.caches[ci].0.value(&io.shape).map_err(run)?
                } else if let Some(ci) = man.caches.iter().position(|c| c.value_in == io.name) {
                    self.caches[ci].1.value(&io.shape).map_err(run)?
                } else if let Some((t, _)) = man.types.iter().find(|(_, i)| i.mask == io.name) {
                    f(per_type[t.as_str()].0.clone())?
                } else if let Some((t, _)) = man.types.iter().find(|(_, i)| i.cos == io.name) {
                    f(per_type[t.as_str()].1.clone())?
                } else if let Some((t, _)) = man.types.iter().find(|(_, i)| i.sin == io.name) {
                    f(per_type[t.as_str()].2.clone())?
                } else {
                    // The residual stream (`input_embeds` or `hidden_states_in`).
                    f(hidden.clone())?
                };
                feeds.push((io.name.clone(), value));
            }
            let mut session = m.sessions[si]
                .lock()
                .map_err(|_| run(PhoneError::Broken("an earlier run of this part panicked")))?;
            let outs = session.run(feeds).map_err(|e| {
                run(PhoneError::Part {
                    path: m.dir.join(&part.file),
                    source: e,
                })
            })?;
            for io in &part.outputs {
                let v = &outs[io.name.as_str()];
                if io.dtype == "float32" {
                    let (_, d) = v.try_extract_tensor::<f32>().map_err(|e| run(ort_err(e)))?;
                    observe(&io.name, d);
                    if io.name == manifest::LOGITS {
                        logits = Some(d.to_vec());
                    } else if io.name.starts_with("hidden_states") {
                        hidden = d.to_vec();
                    }
                }
                if let Some(ci) = man.caches.iter().position(|c| c.key_out == io.name) {
                    let c = &man.caches[ci];
                    let (heads, hd, past) = (c.key_shape[0], c.key_shape[2], c.key_shape[3]);
                    if let Some(slot) = slot_of(man.context, &c.layer_type, pos, past) {
                        // new key [H,1,hd,1] → cache [H,1,hd,past] column `slot`
                        self.caches[ci]
                            .0
                            .write(v, |i| {
                                let (h, d) = (i / hd, i % hd);
                                debug_assert!(h < heads);
                                (h * hd + d) * past + slot
                            })
                            .map_err(run)?;
                    }
                } else if let Some(ci) = man.caches.iter().position(|c| c.value_out == io.name) {
                    let c = &man.caches[ci];
                    let (hd, past) = (c.value_shape[3], c.value_shape[2]);
                    if let Some(slot) = slot_of(man.context, &c.layer_type, pos, past) {
                        self.caches[ci]
                            .1
                            .write(v, |i| {
                                let (h, d) = (i / hd, i % hd);
                                (h * past + slot) * hd + d
                            })
                            .map_err(run)?;
                    }
                }
            }
        }
        self.pos += 1;
        Ok(PartsOut { hidden, logits })
    }
}

/// Slot a new entry at `pos` goes to, or None when nothing will read it.
fn slot_of(context: usize, layer_type: &str, pos: usize, past: usize) -> Option<usize> {
    if past == 0 {
        return None;
    }
    match layer_type {
        "sliding" => Some(pos % past),
        _ => (pos < past).then_some(pos),
    }
    .filter(|_| pos + 1 < context)
}

impl Engine for PhoneModel {
    fn config(&self) -> &SparkConfig {
        &self.config
    }
    fn start(&self, context: usize) -> Result<Box<dyn Sequence + '_>, ModelError> {
        if context > self.manifest.context {
            return Err(ModelError::PastContext {
                needed: context,
                context: self.manifest.context,
            });
        }
        Ok(Box::new(self.sequence().map_err(backend)?))
    }
    fn describe(&self) -> String {
        format!(
            "phone graph ({}, context {})",
            self.manifest.precision, self.manifest.context
        )
    }
    /// The host caches are sized by the exported context whatever the sequence needs.
    fn sequence_bytes(&self, _context: usize) -> u128 {
        self.manifest.kv_cache_bytes as u128
    }
}

impl Sequence for PhoneSequence<'_> {
    fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::Empty);
        }
        let mut out = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            let l = self.step(t, |_, _| {})?;
            if want == Logits::All || i + 1 == tokens.len() {
                out.extend_from_slice(&l);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_entries_go_to_the_ring_slot_or_the_growing_tail_and_the_last_step_stores_nothing() {
        // Sliding layers: a ring of `past` slots, position p in slot p mod past.
        let ring: Vec<_> = (0..7).map(|p| slot_of(100, "sliding", p, 3)).collect();
        assert_eq!(ring, [0, 1, 2, 0, 1, 2, 0].map(Some));
        // Full layers: position p in slot p while it fits.
        assert_eq!(slot_of(100, "full", 5, 8), Some(5));
        assert_eq!(slot_of(100, "full", 8, 8), None);
        // The step at the last position of the context has no next step to read its entry.
        assert_eq!(slot_of(10, "full", 9, 16), None);
        assert_eq!(slot_of(10, "sliding", 9, 4), None);
        assert_eq!(slot_of(10, "full", 8, 16), Some(8));
        // A layer type without a cache input.
        assert_eq!(slot_of(10, "sliding", 0, 0), None);
    }

    #[test]
    fn cache_buffers_start_at_the_encodings_zero_and_refuse_unknown_types() {
        match Buf::new("int16", 4, -7).unwrap() {
            Buf::I16(v) => assert_eq!(v, [-7; 4]),
            _ => panic!("int16 buffer expected"),
        }
        match Buf::new("uint8", 2, 128).unwrap() {
            Buf::U8(v) => assert_eq!(v, [128; 2]),
            _ => panic!("uint8 buffer expected"),
        }
        let e = Buf::new("bfloat16", 4, 0).err().unwrap().to_string();
        assert!(e.contains("bfloat16"), "{e}");
    }
}
