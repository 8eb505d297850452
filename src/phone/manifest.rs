//! `phone_manifest.json`: everything an app needs to drive the exported
//! decode step (names, shapes, dtypes and encodings of every I/O, the cache
//! rule per layer type). `spark-tool run`/`parity` drive the graph from it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::checkpoint::LayerType;

pub const MANIFEST: &str = "phone_manifest.json";

// The graph's I/O names (docs/PHONE_IO.md §4): the exporter writes them, apps read them.

pub fn type_name(t: LayerType) -> &'static str {
    match t {
        LayerType::Sliding => "sliding",
        LayerType::Full => "full",
    }
}

pub fn mask_input(t: LayerType) -> String {
    format!("attention_mask_{}", type_name(t))
}
pub fn cos_input(t: LayerType) -> String {
    format!("position_ids_cos_{}", type_name(t))
}
pub fn sin_input(t: LayerType) -> String {
    format!("position_ids_sin_{}", type_name(t))
}
pub fn key_in(l: usize) -> String {
    format!("past_key_{l}_in")
}
pub fn value_in(l: usize) -> String {
    format!("past_value_{l}_in")
}
pub fn key_out(l: usize) -> String {
    format!("past_key_{l}_out")
}
pub fn value_out(l: usize) -> String {
    format!("past_value_{l}_out")
}
pub const EMBEDS: &str = "input_embeds";
pub const LOGITS: &str = "logits";
pub const HIDDEN_OUT: &str = "hidden_states_out";
/// The residual stream entering every part but the first.
pub const HIDDEN_IN: &str = "hidden_states_in";

pub const FORMAT: &str = "spark-tool phone decode step";

/// `real = (q − zero_point) · scale` (ONNX convention; AIMET's `offset` is `−zero_point`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Encoding {
    pub dtype: QType,
    pub scale: f32,
    pub zero_point: i32,
    /// Calibrated range the encoding covers.
    pub min: f32,
    pub max: f32,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum QType {
    Uint16,
    Int16,
    Uint8,
}

impl QType {
    pub fn range(self) -> (i32, i32) {
        match self {
            QType::Uint16 => (0, 65535),
            QType::Int16 => (-32768, 32767),
            QType::Uint8 => (0, 255),
        }
    }
}

impl Encoding {
    /// Asymmetric over [min, max] ∪ {0}.
    pub fn asymmetric(dtype: QType, min: f32, max: f32) -> Self {
        let (lo, hi) = dtype.range();
        let (min, max) = (min.min(0.0), max.max(0.0));
        let scale = ((max - min) / (hi - lo) as f32).max(1e-12);
        let zero_point = ((lo as f32) - min / scale)
            .round()
            .clamp(lo as f32, hi as f32) as i32;
        Encoding {
            dtype,
            scale,
            zero_point,
            min,
            max,
        }
    }

    /// Symmetric around 0: int16 zp 0, uint8 zp 128 (AI Hub's 8-bit KV).
    pub fn symmetric(dtype: QType, absmax: f32) -> Self {
        let absmax = absmax.max(1e-12);
        let (scale, zero_point) = match dtype {
            QType::Int16 => (absmax / 32767.0, 0),
            QType::Uint8 => (absmax / 127.0, 128),
            QType::Uint16 => (absmax / 32767.0, 32768),
        };
        Encoding {
            dtype,
            scale,
            zero_point,
            min: -absmax,
            max: absmax,
        }
    }

    pub fn quantize(&self, x: f32) -> i32 {
        let (lo, hi) = self.dtype.range();
        ((x / self.scale).round_ties_even() as i64 + self.zero_point as i64)
            .clamp(lo as i64, hi as i64) as i32
    }

    pub fn dequantize(&self, q: i32) -> f32 {
        (q - self.zero_point) as f32 * self.scale
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Io {
    pub name: String,
    /// `float32`, `int16`, `uint8`, …
    pub dtype: String,
    pub shape: Vec<usize>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub encoding: Option<Encoding>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Part {
    pub file: String,
    pub graph_name: String,
    /// Decoder layers `[start, end)` in this part.
    pub layers: [usize; 2],
    pub head: bool,
    pub inputs: Vec<Io>,
    pub outputs: Vec<Io>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerTypeInfo {
    pub layers: Vec<usize>,
    /// Past entries each layer of this type keeps (W−1 sliding, C−1 full).
    pub past_len: usize,
    pub mask: String,
    pub cos: String,
    pub sin: String,
    pub rope_theta: f64,
    pub rotary_dims: usize,
    /// How the host picks the cache slot for position `pos`.
    pub slot_rule: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cache {
    pub layer: usize,
    pub layer_type: String,
    pub key_in: String,
    pub key_out: String,
    pub value_in: String,
    pub value_out: String,
    /// `[kv_heads, 1, head_dim, past]` (keys stored transposed).
    pub key_shape: Vec<usize>,
    /// `[kv_heads, 1, past, head_dim]`.
    pub value_shape: Vec<usize>,
    pub dtype: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Embedding {
    pub file: String,
    pub tensor: String,
    pub lookup: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub spark_tool_version: String,
    pub runs_in_vllm: bool,
    pub precision: String,
    pub context: usize,
    pub sliding_window: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub layer_types: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub embedding: Embedding,
    /// Additive mask value for slots that must not be attended.
    pub mask_value: f32,
    pub types: BTreeMap<String, LayerTypeInfo>,
    pub caches: Vec<Cache>,
    pub parts: Vec<Part>,
    /// KV bytes the host holds at this context, and what an all-full-attention model would hold.
    pub kv_cache_bytes: u64,
    pub kv_cache_bytes_if_all_full: u64,
    pub how_to_step: Vec<String>,
    /// Weights only used during export (calibration graphs).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub calibration_outputs: bool,
}

impl Manifest {
    pub fn read(dir: &Path) -> Result<Self, String> {
        let p = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| {
            let key = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| culprit_key(&v));
            match key {
                Some(k) => format!("{}: key `{k}`: {e}", p.display()),
                None => format!("{}: {e}", p.display()),
            }
        })?;
        if m.format != FORMAT || m.version != 1 {
            return Err(format!(
                "{}: format `{}` v{} is not `{FORMAT}` v1",
                p.display(),
                m.format,
                m.version
            ));
        }
        Ok(m)
    }
}

/// The key whose value does not parse (serde's error gives a line and column only): the one
/// whose removal leaves nothing wrong but, at most, its own absence.
/// Nested objects are searched the same way, so the key is given as a path (`config.pad_token_id`).
fn culprit_key(v: &serde_json::Value) -> Option<String> {
    let mut path: Vec<String> = Vec::new();
    loop {
        let here = path.iter().try_fold(v, |x, k| x.get(k))?;
        let Some(map) = here.as_object() else { break };
        let found = map.keys().find(|k| {
            let mut probe = v.clone();
            let mut at = &mut probe;
            for p in &path {
                at = &mut at[p.as_str()];
            }
            if let Some(o) = at.as_object_mut() {
                o.remove(*k);
            }
            // Without the culprit the rest parses (an optional key) or only it is missing.
            match serde_json::from_value::<Manifest>(probe) {
                Ok(_) => true,
                Err(e) => e.to_string().starts_with(&format!("missing field `{k}`")),
            }
        });
        match found {
            Some(k) => path.push(k.clone()),
            None => break,
        }
    }
    (!path.is_empty()).then(|| path.join("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_round_trip_within_half_a_step() {
        let e = Encoding::asymmetric(QType::Uint16, -3.0, 5.0);
        for x in [-3.0f32, -1.234, 0.0, 2.5, 5.0] {
            let y = e.dequantize(e.quantize(x));
            assert!((x - y).abs() <= e.scale * 0.5 + 1e-6, "{x} → {y}");
        }
        assert_eq!(e.dequantize(e.quantize(0.0)), 0.0, "zero is exact");
        let s = Encoding::symmetric(QType::Int16, 2.0);
        assert_eq!(s.zero_point, 0);
        assert_eq!(s.quantize(2.0), 32767);
        assert_eq!(s.quantize(-9.0), -32768, "saturates");
        let u = Encoding::symmetric(QType::Uint8, 1.27);
        assert_eq!((u.quantize(0.0), u.quantize(1.27)), (128, 255));
    }
}
