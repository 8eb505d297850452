//! `phone_manifest.json`: everything an app needs to drive the exported
//! decode step (names, shapes, dtypes and encodings of every I/O, the cache
//! rule per layer type). `spark-tool run`/`parity` drive the graph from it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::checkpoint::LayerType;

pub use crate::artifact::PHONE_MANIFEST as MANIFEST;

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
        // `as i64` saturates (±inf, huge x / tiny scale); the add must saturate too, or
        // f32::MAX would wrap around to the bottom of the range.
        ((x / self.scale).round_ties_even() as i64)
            .saturating_add(self.zero_point as i64)
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
    /// How the MatMul weights are stored (absent in manifests before w4a16).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub weights: Vec<WeightEncoding>,
}

/// One class of MatMul weights and its encoding.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WeightEncoding {
    /// Which weights: e.g. `q, k, v, out, gate, up, down of every layer`.
    pub which: String,
    /// `float32`, `float16`, `int8 per channel`, or `lpbq`.
    pub encoding: String,
    pub bits: u32,
    /// LPBQ: inputs per block, and the 8-bit decompressed scale (`γ · k`, k ∈ 1…16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decompressed_bits: Option<u32>,
}

impl Manifest {
    pub fn read(dir: &Path) -> Result<Self, String> {
        let p = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        Self::from_json_str(&text, &p.display().to_string())
    }

    /// Parse and [`check`](Self::check); `origin` names the file in error messages.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self, String> {
        let m: Manifest = serde_json::from_str(text).map_err(|e| {
            let key = serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| culprit_key(&v));
            match key {
                Some(k) => format!("{origin}: key `{k}`: {e}"),
                None => format!("{origin}: {e}"),
            }
        })?;
        if m.format != FORMAT || m.version != 1 {
            return Err(format!(
                "{origin}: format `{}` v{} is not `{FORMAT}` v1",
                m.format, m.version
            ));
        }
        m.check().map_err(|e| format!("{origin}: {e}"))?;
        Ok(m)
    }

    /// What the host (`PhoneModel`) relies on: one cache per layer of a listed type with the shapes that type implies, rotary widths that fit the
    /// head, positions below the context, tensor sizes that fit in memory arithmetic, and
    /// encodings whose zero point lies in their integer range.
    pub fn check(&self) -> Result<(), String> {
        let numel = |what: &str, shape: &[usize]| {
            shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| format!("{what}: shape {shape:?} is too large"))
        };
        if self.context == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return Err("context, hidden_size and vocab_size must be > 0".into());
        }
        if !self.mask_value.is_finite() {
            return Err(format!("mask_value {} is not finite", self.mask_value));
        }
        let layers = self.layer_types.len();
        for (t, info) in &self.types {
            if info.past_len >= self.context {
                return Err(format!(
                    "types.{t}.past_len {} must be below the context {}",
                    info.past_len, self.context
                ));
            }
            if !(info.rope_theta.is_finite() && info.rope_theta > 0.0) {
                return Err(format!("types.{t}.rope_theta must be > 0"));
            }
            if info.rotary_dims == 0 || !info.rotary_dims.is_multiple_of(2) {
                return Err(format!(
                    "types.{t}.rotary_dims {} must be even and > 0",
                    info.rotary_dims
                ));
            }
            for &l in &info.layers {
                if self.layer_types.get(l) != Some(t) {
                    return Err(format!(
                        "types.{t}.layers lists layer {l}, which is not a `{t}` layer"
                    ));
                }
            }
        }
        if self.caches.len() != layers {
            return Err(format!("{} caches for {layers} layers", self.caches.len()));
        }
        for (l, (c, t)) in self.caches.iter().zip(&self.layer_types).enumerate() {
            let what = format!("caches[{l}]");
            let info = self
                .types
                .get(t)
                .ok_or_else(|| format!("layer_types[{l}] `{t}` has no entry in types"))?;
            if c.layer != l || &c.layer_type != t {
                return Err(format!(
                    "{what} is for layer {} `{}`, expected layer {l} `{t}`",
                    c.layer, c.layer_type
                ));
            }
            numel(&what, &c.key_shape)?;
            numel(&what, &c.value_shape)?;
            let (kvh, hd) = match c.key_shape[..] {
                [kvh, 1, hd, past] if past == info.past_len => (kvh, hd),
                _ => {
                    return Err(format!(
                        "{what}.key_shape {:?} is not [kv_heads, 1, head_dim, {}]",
                        c.key_shape, info.past_len
                    ))
                }
            };
            if c.value_shape != [kvh, 1, info.past_len, hd] {
                return Err(format!(
                    "{what}.value_shape {:?} is not [{kvh}, 1, {}, {hd}]",
                    c.value_shape, info.past_len
                ));
            }
            if info.rotary_dims > hd {
                return Err(format!(
                    "types.{t}.rotary_dims {} is wider than head_dim {hd}",
                    info.rotary_dims
                ));
            }
        }
        for (pi, part) in self.parts.iter().enumerate() {
            let what = format!("parts[{pi}]");
            let [a, b] = part.layers;
            if a > b || b > layers {
                return Err(format!(
                    "{what}.layers [{a}, {b}) is not a range of the {layers} layers"
                ));
            }
            for io in part.inputs.iter().chain(&part.outputs) {
                numel(&format!("{what} `{}`", io.name), &io.shape)?;
                if let Some(e) = io.encoding {
                    let (lo, hi) = e.dtype.range();
                    if !(e.scale.is_finite() && e.scale > 0.0 && (lo..=hi).contains(&e.zero_point))
                    {
                        return Err(format!(
                            "{what} `{}`: encoding scale {} / zero point {} is not a positive scale with a zero point in {lo}..={hi}",
                            io.name, e.scale, e.zero_point
                        ));
                    }
                }
            }
        }
        Ok(())
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

    /// A one-layer (full attention) manifest as the exporter writes it, context 8.
    fn one_layer() -> serde_json::Value {
        let enc = serde_json::json!({"dtype": "int16", "scale": 0.001, "zero_point": 0, "min": -1.0, "max": 1.0});
        serde_json::json!({
            "format": FORMAT, "version": 1, "spark_tool_version": "0", "runs_in_vllm": false,
            "precision": "w8a16", "context": 8, "sliding_window": 4, "hidden_size": 8, "vocab_size": 16,
            "layer_types": ["full"], "bos_token_id": 0, "eos_token_ids": [1], "pad_token_id": null,
            "embedding": {"file": "embed_tokens.safetensors", "tensor": "embed_tokens", "lookup": "host"},
            "mask_value": -50.0,
            "types": {"full": {"layers": [0], "past_len": 7, "mask": "m", "cos": "c", "sin": "s",
                               "rope_theta": 10000.0, "rotary_dims": 4, "slot_rule": "append"}},
            "caches": [{"layer": 0, "layer_type": "full", "key_in": "ki", "key_out": "ko",
                        "value_in": "vi", "value_out": "vo", "key_shape": [1, 1, 4, 7],
                        "value_shape": [1, 1, 7, 4], "dtype": "int16"}],
            "parts": [{"file": "decode.onnx", "graph_name": "g", "layers": [0, 1], "head": true,
                       "inputs": [{"name": "ki", "dtype": "int16", "shape": [1, 1, 4, 7], "encoding": enc}],
                       "outputs": []}],
            "kv_cache_bytes": 0, "kv_cache_bytes_if_all_full": 0, "how_to_step": []
        })
    }

    fn check(v: &serde_json::Value) -> Result<Manifest, String> {
        Manifest::from_json_str(&v.to_string(), "m.json")
    }

    /// What `PhoneModel` indexes, allocates or subtracts is checked at read: each of these
    /// would otherwise panic (overflow, missing map key) or size a buffer from garbage.
    #[test]
    fn inconsistent_manifests_are_errors() {
        check(&one_layer()).expect("the exporter's shape is accepted");
        type Edit = fn(&mut serde_json::Value);
        let bad: [(&str, Edit); 8] = [
            ("zero point", |v| {
                v["parts"][0]["inputs"][0]["encoding"]["zero_point"] = i32::MIN.into()
            }),
            ("positive scale", |v| {
                v["parts"][0]["inputs"][0]["encoding"]["scale"] = 0.0.into()
            }),
            ("too large", |v| {
                v["parts"][0]["inputs"][0]["shape"] = serde_json::json!([u64::MAX, 2])
            }),
            ("even", |v| v["types"]["full"]["rotary_dims"] = 3.into()),
            ("wider than head_dim", |v| {
                v["types"]["full"]["rotary_dims"] = 6.into()
            }),
            ("below the context", |v| {
                v["types"]["full"]["past_len"] = 8.into()
            }),
            ("is not a `full` layer", |v| {
                v["layer_types"][0] = "sliding".into()
            }),
            ("key_shape", |v| {
                v["caches"][0]["key_shape"] = serde_json::json!([1, 1, 4])
            }),
        ];
        for (want, edit) in bad {
            let mut v = one_layer();
            edit(&mut v);
            let e = check(&v).expect_err(want);
            assert!(e.contains(want), "{want}: {e}");
        }
    }

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

    /// Found by fuzzing (fuzz/fuzz_targets/phone_manifest.rs): `x / scale` saturated to
    /// i64::MAX and adding the zero point overflowed (release: wrapped to the range's bottom).
    #[test]
    fn huge_and_infinite_values_saturate_the_right_way() {
        for e in [
            Encoding::asymmetric(QType::Uint16, -1e-3, 1e-3),
            Encoding::symmetric(QType::Int16, 1e-30),
            Encoding::symmetric(QType::Uint8, 1.0),
        ] {
            let (lo, hi) = e.dtype.range();
            assert_eq!(e.quantize(f32::MAX), hi);
            assert_eq!(e.quantize(f32::INFINITY), hi);
            assert_eq!(e.quantize(f32::MIN), lo);
            assert_eq!(e.quantize(f32::NEG_INFINITY), lo);
        }
    }
}
