//! `config.json` of a Spark2_5 checkpoint, parsed into a validated [`SparkConfig`].
//!
//! Raw JSON goes through [`RawConfig`] (every key optional, unknown keys
//! ignored because HF configs grow) and is then checked field by field, so a
//! bad value is reported by its key with what was expected.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::gptq::GptqInfo;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("{path}: field `{field}`: {message}")]
    Field {
        path: String,
        field: String,
        message: String,
    },
}

/// The two attention flavours of Spark2_5 (docs/MODEL.md §7–§8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    #[serde(rename = "sliding_attention")]
    Sliding,
    #[serde(rename = "full_attention")]
    Full,
}

impl LayerType {
    pub fn config_name(self) -> &'static str {
        match self {
            LayerType::Sliding => "sliding_attention",
            LayerType::Full => "full_attention",
        }
    }
}

/// Rotary parameters of one layer type.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RopeSpec {
    pub theta: f64,
    /// Rotated width R = head_dim × partial_rotary_factor; also the frequency denominator.
    pub rotary_dims: usize,
}

#[derive(Debug, Deserialize)]
struct RawRope {
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    rope_type: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    rope_parameters: Option<BTreeMap<String, RawRope>>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    headwise_attn_output_gate: Option<bool>,
    gate_attn_act_mode: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
    pad_token_id: Option<u32>,
    quantization_config: Option<serde_json::Value>,
}

/// The key whose value has the wrong type (serde's own error gives only a line and column):
/// each key is tried on its own.
fn culprit_key(value: &serde_json::Value, origin: &str) -> Option<ConfigError> {
    let serde_json::Value::Object(map) = value else {
        return Some(ConfigError::Field {
            path: origin.to_string(),
            field: "(top level)".into(),
            message: "expected a JSON object".into(),
        });
    };
    map.iter().find_map(|(k, v)| {
        let one = serde_json::Value::Object([(k.clone(), v.clone())].into_iter().collect());
        serde_json::from_value::<RawConfig>(one)
            .err()
            .map(|e| ConfigError::Field {
                path: origin.to_string(),
                field: k.clone(),
                message: format!("{e} (found {v})"),
            })
    })
}

/// A validated Spark2_5 configuration. Every derived size is a method so
/// nothing downstream recomputes it differently.
#[derive(Debug, Clone, Serialize)]
pub struct SparkConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub sliding_window: usize,
    pub layer_types: Vec<LayerType>,
    pub rope: BTreeMap<LayerType, RopeSpec>,
    pub rms_norm_eps: f32,
    /// `None` when config.json omits the key; the loader then decides from
    /// whether `lm_head.weight` exists.
    pub tie_word_embeddings: Option<bool>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// Present for GPTQ checkpoints.
    pub gptq: Option<GptqInfo>,
}

impl SparkConfig {
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    /// Query heads per KV head.
    pub fn gqa_group(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
    pub fn rope_for(&self, t: LayerType) -> RopeSpec {
        // Validation guarantees every used layer type has an entry.
        self.rope[&t]
    }
    pub fn count_layers(&self, t: LayerType) -> usize {
        self.layer_types.iter().filter(|&&x| x == t).count()
    }

    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: p.clone(),
            source,
        })?;
        Self::from_json_str(&text, &p)
    }

    /// Parse and validate; `origin` names the file in error messages. The checks run in a
    /// fixed order, so a config with several faults always reports the same one.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let raw = RawConfig::parse(text, origin)?;
        let f = Fields { origin };
        raw.check_model_type(f)?;
        let d = raw.dims(f)?;
        let layer_types = raw.layer_types(d.num_hidden_layers, f)?;
        let sliding_window = raw.sliding_window(&layer_types, f)?;
        let rope = raw.rope(&layer_types, d.head_dim, f)?;
        raw.check_supported(f)?;
        let rms_norm_eps = raw.rms_norm_eps(f)?;
        let eos_token_ids = raw.eos_token_ids(f)?;
        raw.check_token_ids(&eos_token_ids, d.vocab_size, f)?;
        Ok(SparkConfig {
            hidden_size: d.hidden_size,
            intermediate_size: d.intermediate_size,
            num_hidden_layers: d.num_hidden_layers,
            num_attention_heads: d.num_attention_heads,
            num_key_value_heads: d.num_key_value_heads,
            head_dim: d.head_dim,
            vocab_size: d.vocab_size,
            max_position_embeddings: match raw.max_position_embeddings {
                Some(0) => return Err(f.err("max_position_embeddings", "must be > 0".into())),
                v => v.unwrap_or(usize::MAX),
            },
            sliding_window,
            layer_types,
            rope,
            rms_norm_eps: rms_norm_eps as f32,
            tie_word_embeddings: raw.tie_word_embeddings,
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
            pad_token_id: raw.pad_token_id,
            gptq: raw
                .quantization_config
                .as_ref()
                .map(|q| GptqInfo::from_json(q, origin))
                .transpose()?,
        })
    }
}

/// Makes the errors of one config file, each naming its key.
#[derive(Clone, Copy)]
struct Fields<'a> {
    origin: &'a str,
}

impl Fields<'_> {
    fn err(self, field: &str, message: String) -> ConfigError {
        ConfigError::Field {
            path: self.origin.to_string(),
            field: field.to_string(),
            message,
        }
    }

    /// A required size: present and not 0.
    fn need(self, v: Option<usize>, field: &str) -> Result<usize, ConfigError> {
        match v {
            None => Err(self.err(field, "missing (required for Spark2_5)".into())),
            Some(0) => Err(self.err(field, "must be > 0".into())),
            Some(x) => Ok(x),
        }
    }
}

/// The required sizes, checked for consistency and for fitting in memory.
struct Dims {
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    vocab_size: usize,
}

impl RawConfig {
    fn parse(text: &str, origin: &str) -> Result<RawConfig, ConfigError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|source| ConfigError::Json {
                path: origin.to_string(),
                source,
            })?;
        serde_json::from_value(value.clone()).map_err(|source| {
            culprit_key(&value, origin).unwrap_or(ConfigError::Json {
                path: origin.to_string(),
                source,
            })
        })
    }

    fn check_model_type(&self, f: Fields) -> Result<(), ConfigError> {
        match self.model_type.as_deref() {
            Some("spark2_5") => Ok(()),
            Some(other) => Err(f.err(
                "model_type",
                format!("expected \"spark2_5\", found \"{other}\""),
            )),
            None => Err(f.err("model_type", "missing; expected \"spark2_5\"".into())),
        }
    }

    fn dims(&self, f: Fields) -> Result<Dims, ConfigError> {
        let hidden_size = f.need(self.hidden_size, "hidden_size")?;
        let intermediate_size = f.need(self.intermediate_size, "intermediate_size")?;
        let num_hidden_layers = f.need(self.num_hidden_layers, "num_hidden_layers")?;
        let num_attention_heads = f.need(self.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads = f.need(self.num_key_value_heads, "num_key_value_heads")?;
        // Never derived from hidden/heads: the 4B would get 160 instead of 256.
        let head_dim = f.need(self.head_dim, "head_dim")?;
        let vocab_size = f.need(self.vocab_size, "vocab_size")?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads ({num_key_value_heads})"
                ),
            ));
        }

        // Every weight's element count (and its f32 size) must fit in usize: a config with
        // huge dimensions is an error here, not an overflow in the layout check or the loader.
        let q_dim = num_attention_heads.checked_mul(head_dim);
        let kv_dim = num_key_value_heads.checked_mul(head_dim);
        let qkv_rows = q_dim
            .zip(kv_dim)
            .and_then(|(q, kv)| kv.checked_mul(2)?.checked_add(q));
        for (field, rows) in [
            ("num_attention_heads", q_dim),
            ("num_key_value_heads", qkv_rows),
            ("intermediate_size", Some(intermediate_size)),
            ("vocab_size", Some(vocab_size)),
        ] {
            if rows
                .and_then(|r| r.checked_mul(hidden_size)?.checked_mul(4))
                .is_none()
            {
                return Err(f.err(
                    field,
                    format!(
                        "too large: the weights it sizes (with hidden_size {hidden_size}, head_dim {head_dim}) overflow the address space"
                    ),
                ));
            }
        }
        Ok(Dims {
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
        })
    }

    fn layer_types(
        &self,
        num_hidden_layers: usize,
        f: Fields,
    ) -> Result<Vec<LayerType>, ConfigError> {
        let names = self
            .layer_types
            .as_ref()
            .ok_or_else(|| f.err("layer_types", "missing".into()))?;
        if names.len() != num_hidden_layers {
            return Err(f.err(
                "layer_types",
                format!(
                    "has {} entries, expected num_hidden_layers = {num_hidden_layers}",
                    names.len()
                ),
            ));
        }
        let mut layer_types = Vec::with_capacity(names.len());
        for (i, n) in names.iter().enumerate() {
            layer_types.push(match n.as_str() {
                "sliding_attention" => LayerType::Sliding,
                "full_attention" => LayerType::Full,
                other => {
                    return Err(f.err(
                        &format!("layer_types[{i}]"),
                        format!(
                        "expected \"sliding_attention\" or \"full_attention\", found \"{other}\""
                    ),
                    ))
                }
            });
        }
        Ok(layer_types)
    }

    fn sliding_window(&self, layer_types: &[LayerType], f: Fields) -> Result<usize, ConfigError> {
        match self.sliding_window {
            Some(w) if w > 0 => Ok(w),
            _ if layer_types.contains(&LayerType::Sliding) => Err(f.err(
                "sliding_window",
                "missing or 0 but layer_types has sliding_attention layers".into(),
            )),
            _ => Ok(0),
        }
    }

    /// The rotary parameters of each layer type `layer_types` uses.
    fn rope(
        &self,
        layer_types: &[LayerType],
        head_dim: usize,
        f: Fields,
    ) -> Result<BTreeMap<LayerType, RopeSpec>, ConfigError> {
        let raw_rope = self
            .rope_parameters
            .as_ref()
            .ok_or_else(|| f.err("rope_parameters", "missing".into()))?;
        let mut rope = BTreeMap::new();
        for t in [LayerType::Sliding, LayerType::Full] {
            if !layer_types.contains(&t) {
                continue;
            }
            let field = format!("rope_parameters.{}", t.config_name());
            let r = raw_rope.get(t.config_name()).ok_or_else(|| {
                f.err(
                    &field,
                    "missing; every layer type used in layer_types needs its rope parameters"
                        .into(),
                )
            })?;
            if let Some(kind) = r.rope_type.as_deref() {
                if kind != "default" {
                    return Err(f.err(
                        &format!("{field}.rope_type"),
                        format!("only \"default\" (no scaling) is supported, found \"{kind}\""),
                    ));
                }
            }
            let theta = r
                .rope_theta
                .filter(|t| *t > 0.0)
                .ok_or_else(|| f.err(&format!("{field}.rope_theta"), "missing or <= 0".into()))?;
            let factor = r.partial_rotary_factor.unwrap_or(1.0);
            let dims_f = head_dim as f64 * factor;
            let rotary_dims = dims_f.round() as usize;
            if !(factor > 0.0 && factor <= 1.0)
                || (dims_f - rotary_dims as f64).abs() > 1e-9
                || !rotary_dims.is_multiple_of(2)
            {
                return Err(f.err(
                    &format!("{field}.partial_rotary_factor"),
                    format!(
                        "head_dim {head_dim} × {factor} = {dims_f} rotated dims; expected an even whole number in (0, head_dim]"
                    ),
                ));
            }
            rope.insert(t, RopeSpec { theta, rotary_dims });
        }
        Ok(rope)
    }

    /// The architecture switches Spark2_5 fixes: GELU, a sigmoid gate per head, no biases.
    fn check_supported(&self, f: Fields) -> Result<(), ConfigError> {
        match self.hidden_act.as_deref() {
            Some("gelu") => {}
            other => {
                return Err(f.err(
                    "hidden_act",
                    format!(
                        "expected \"gelu\" (exact erf GEGLU), found {}",
                        other.map_or("nothing".into(), |s| format!("\"{s}\""))
                    ),
                ))
            }
        }
        if self.headwise_attn_output_gate == Some(false) {
            return Err(f.err(
                "headwise_attn_output_gate",
                "false is not supported: Spark2_5 checkpoints gate each attention head".into(),
            ));
        }
        match self.gate_attn_act_mode.as_deref() {
            Some("sigmoid") | None => {}
            Some(other) => {
                return Err(f.err(
                    "gate_attn_act_mode",
                    format!("expected \"sigmoid\", found \"{other}\""),
                ))
            }
        }
        for (field, v) in [
            ("attention_bias", self.attention_bias),
            ("mlp_bias", self.mlp_bias),
        ] {
            if v == Some(true) {
                return Err(f.err(
                    field,
                    "true is not supported: Spark2_5 has no biases".into(),
                ));
            }
        }
        Ok(())
    }

    fn rms_norm_eps(&self, f: Fields) -> Result<f64, ConfigError> {
        let rms_norm_eps = self.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps > 0.0 && rms_norm_eps < 1.0) {
            return Err(f.err(
                "rms_norm_eps",
                format!("expected a small positive value, found {rms_norm_eps}"),
            ));
        }
        Ok(rms_norm_eps)
    }

    /// `eos_token_id`: absent, one id or a list of them.
    fn eos_token_ids(&self, f: Fields) -> Result<Vec<u32>, ConfigError> {
        Ok(match &self.eos_token_id {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Number(n)) => {
                vec![n
                    .as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| {
                        f.err(
                            "eos_token_id",
                            "expected a non-negative 32-bit integer".into(),
                        )
                    })?]
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    f.err(
                        "eos_token_id",
                        "expected non-negative 32-bit integers".into(),
                    )
                })?,
            Some(_) => return Err(f.err("eos_token_id", "expected an integer or a list".into())),
        })
    }

    /// Every special token id must be inside the vocabulary.
    fn check_token_ids(
        &self,
        eos_token_ids: &[u32],
        vocab_size: usize,
        f: Fields,
    ) -> Result<(), ConfigError> {
        for (field, id) in [
            ("bos_token_id", self.bos_token_id),
            ("pad_token_id", self.pad_token_id),
        ]
        .into_iter()
        .chain(eos_token_ids.iter().map(|&e| ("eos_token_id", Some(e))))
        {
            if let Some(id) = id {
                if id as usize >= vocab_size {
                    return Err(f.err(
                        field,
                        format!("{id} is outside the vocabulary (vocab_size {vocab_size})"),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The real 1.7B config (docs/MODEL.md §1), reduced to the keys we read.
    pub(crate) fn real_1_7b_json() -> serde_json::Value {
        let layer_types: Vec<&str> = (0..28)
            .map(|i| {
                if (i + 1) % 4 == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        serde_json::json!({
            "architectures": ["Spark2_5ForCausalLM"], "model_type": "spark2_5",
            "hidden_size": 2048, "intermediate_size": 6656, "num_hidden_layers": 28,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "vocab_size": 131072, "max_position_embeddings": 1048576, "sliding_window": 512,
            "layer_types": layer_types,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 5000000},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000}},
            "rms_norm_eps": 1e-6, "hidden_act": "gelu", "headwise_attn_output_gate": true,
            "gate_attn_act_mode": "sigmoid", "attention_bias": false, "mlp_bias": false,
            "tie_word_embeddings": true, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2
        })
    }

    fn parse(v: &serde_json::Value) -> Result<SparkConfig, ConfigError> {
        SparkConfig::from_json_str(&v.to_string(), "config.json")
    }

    fn expect_field_err(v: serde_json::Value, field: &str) -> String {
        match parse(&v) {
            Err(ConfigError::Field {
                field: f, message, ..
            }) => {
                assert_eq!(f, field, "wrong field blamed: {message}");
                message
            }
            other => panic!("expected an error on {field}, got {other:?}"),
        }
    }

    #[test]
    fn real_config_derives_spec_sizes() {
        let c = parse(&real_1_7b_json()).unwrap();
        assert_eq!((c.q_dim(), c.kv_dim(), c.gqa_group()), (2048, 512, 4));
        assert_eq!(c.count_layers(LayerType::Full), 7);
        assert_eq!(c.count_layers(LayerType::Sliding), 21);
        assert_eq!(c.rope_for(LayerType::Full).rotary_dims, 64);
        assert_eq!(c.rope_for(LayerType::Sliding).rotary_dims, 256);
        assert_eq!(c.layer_types[3], LayerType::Full);
        assert_eq!(c.eos_token_ids, vec![1]);
    }

    #[test]
    fn q_dim_is_not_assumed_to_be_hidden() {
        // 4B shape: q_dim 4096 != hidden 2560.
        let mut v = real_1_7b_json();
        v["hidden_size"] = 2560.into();
        v["num_attention_heads"] = 16.into();
        v["num_key_value_heads"] = 4.into();
        let c = parse(&v).unwrap();
        assert_eq!(c.q_dim(), 4096);
        assert_eq!(c.head_dim, 256);
    }

    #[test]
    fn bad_values_name_their_field() {
        let mut v = real_1_7b_json();
        v["model_type"] = "qwen3".into();
        assert!(expect_field_err(v, "model_type").contains("qwen3"));

        let mut v = real_1_7b_json();
        v["layer_types"].as_array_mut().unwrap().pop();
        assert!(expect_field_err(v, "layer_types").contains("27 entries"));

        let mut v = real_1_7b_json();
        v["layer_types"][5] = "chunked_attention".into();
        expect_field_err(v, "layer_types[5]");

        let mut v = real_1_7b_json();
        v["num_key_value_heads"] = 3.into();
        expect_field_err(v, "num_key_value_heads");

        let mut v = real_1_7b_json();
        v["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("full_attention");
        expect_field_err(v, "rope_parameters.full_attention");

        let mut v = real_1_7b_json();
        v["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 0.3.into();
        expect_field_err(v, "rope_parameters.full_attention.partial_rotary_factor");

        let mut v = real_1_7b_json();
        v["hidden_act"] = "gelu_pytorch_tanh".into();
        expect_field_err(v, "hidden_act");

        let mut v = real_1_7b_json();
        v["gate_attn_act_mode"] = "silu".into();
        expect_field_err(v, "gate_attn_act_mode");

        let mut v = real_1_7b_json();
        v.as_object_mut().unwrap().remove("head_dim");
        expect_field_err(v, "head_dim");

        let mut v = real_1_7b_json();
        v["eos_token_id"] = 200000.into();
        expect_field_err(v, "eos_token_id");
    }

    #[test]
    fn unused_layer_type_needs_no_rope() {
        let mut v = real_1_7b_json();
        v["num_hidden_layers"] = 2.into();
        v["layer_types"] = serde_json::json!(["full_attention", "full_attention"]);
        v["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("sliding_attention");
        let c = parse(&v).unwrap();
        assert_eq!(c.count_layers(LayerType::Sliding), 0);
    }

    /// Found by fuzzing (fuzz/fuzz_targets/config_json.rs): heads × head_dim overflowed in
    /// `q_dim()` once the layout check ran.
    #[test]
    fn sizes_that_overflow_are_errors() {
        let mut v = real_1_7b_json();
        v["num_attention_heads"] = (1u64 << 62).into();
        assert!(expect_field_err(v, "num_attention_heads").contains("too large"));
        let mut v = real_1_7b_json();
        v["vocab_size"] = (usize::MAX / 2).into();
        expect_field_err(v, "vocab_size");
        let mut v = real_1_7b_json();
        v["head_dim"] = (1u64 << 61).into();
        expect_field_err(v, "num_attention_heads");
    }

    #[test]
    fn eos_ids_past_u32_are_errors_not_truncated() {
        let mut v = real_1_7b_json();
        v["eos_token_id"] = ((1u64 << 32) + 1).into();
        expect_field_err(v, "eos_token_id");
        let mut v = real_1_7b_json();
        v["eos_token_id"] = serde_json::json!([1, (1u64 << 32) + 1]);
        expect_field_err(v, "eos_token_id");
    }

    #[test]
    fn invalid_json_is_an_error_not_a_panic() {
        assert!(matches!(
            SparkConfig::from_json_str("{not json", "x/config.json"),
            Err(ConfigError::Json { .. })
        ));
    }
}
