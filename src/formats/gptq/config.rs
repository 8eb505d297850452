//! The `quantization_config` block of a GPTQ checkpoint: what we accept when reading
//! (docs/GPTQ_FORMAT.md §4) and what we write.

use serde::Serialize;
use serde_json::json;

use crate::checkpoint::layout::FUSED_QKV;
use crate::checkpoint::{ConfigError, Proj};

/// What `quantization_config` says about a GPTQ checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct GptqInfo {
    pub group_size: usize,
    pub desc_act: bool,
    /// The head is GPTQ-quantized too.
    pub lm_head: bool,
    /// v1 (`gptq`) stores zero − 1 in qzeros; v2 (`gptq_v2`) the zero itself.
    pub v2: bool,
    /// `w4a8` / `w4a16` when written by spark-tool (quantization_config.meta.spark_tool.format).
    pub spark_tool_format: Option<String>,
}

impl GptqInfo {
    /// Read the block; errors name `origin` (the config file) and the key.
    pub fn from_json(v: &serde_json::Value, origin: &str) -> Result<GptqInfo, ConfigError> {
        let err = |field: &str, message: String| ConfigError::Field {
            path: origin.to_string(),
            field: format!("quantization_config.{field}"),
            message,
        };
        let found = |k: &str| v.get(k).unwrap_or(&serde_json::Value::Null).to_string();
        match v.get("quant_method").and_then(|m| m.as_str()) {
            Some("gptq") => {}
            _ => {
                return Err(err(
                    "quant_method",
                    format!(
                        "only \"gptq\" checkpoints are supported, found {}",
                        found("quant_method")
                    ),
                ))
            }
        }
        // A flag of the wrong type is an error, not silently false.
        let flag = |k: &str| -> Result<bool, _> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(false),
                Some(serde_json::Value::Bool(b)) => Ok(*b),
                Some(other) => Err(err(k, format!("expected true or false, found {other}"))),
            }
        };
        let (desc_act, lm_head) = (flag("desc_act")?, flag("lm_head")?);
        if v.get("sym").is_some_and(|s| !s.is_boolean()) {
            return Err(err(
                "sym",
                format!("expected true or false, found {}", found("sym")),
            ));
        }
        if v.get("bits").and_then(|b| b.as_u64()) != Some(4) {
            return Err(err(
                "bits",
                format!(
                    "expected 4, found {}",
                    v.get("bits").unwrap_or(&serde_json::Value::Null)
                ),
            ));
        }
        if v.get("sym").and_then(|b| b.as_bool()) == Some(false) {
            return Err(err(
                "sym",
                "asymmetric GPTQ is not supported (vLLM rejects it too)".into(),
            ));
        }
        let group_size = match v.get("group_size").and_then(|g| g.as_i64()) {
            Some(g) if [32, 64, 128].contains(&g) => g as usize,
            _ => {
                return Err(err(
                    "group_size",
                    format!("expected 32, 64 or 128, found {}", found("group_size")),
                ))
            }
        };
        let v2 = match v.get("checkpoint_format").and_then(|f| f.as_str()) {
            None | Some("gptq") => false,
            Some("gptq_v2") => true,
            Some(other) => {
                return Err(err(
                    "checkpoint_format",
                    format!("expected \"gptq\" or \"gptq_v2\", found \"{other}\""),
                ))
            }
        };
        // The numerics `run` and `parity` pick by default (docs/GPTQ_FORMAT.md §8).
        let spark_tool_format = match v.pointer("/meta/spark_tool/format") {
            None => None,
            Some(f) => match f.as_str() {
                Some(s @ ("w4a8" | "w4a16")) => Some(s.to_string()),
                _ => {
                    return Err(err(
                        "meta.spark_tool.format",
                        format!("expected \"w4a8\" or \"w4a16\", found {f}"),
                    ))
                }
            },
        };
        Ok(GptqInfo {
            group_size,
            desc_act,
            lm_head,
            v2,
            spark_tool_format,
        })
    }
}

/// The block spark-tool writes into `config.json`; `provenance` goes under `meta.spark_tool`.
pub fn quantization_config(
    group_size: usize,
    head: bool,
    provenance: serde_json::Value,
) -> serde_json::Value {
    // One list per shared input (true-sequential order); the fused name leads q/k/v so that
    // vLLM finds the fused module (docs/GPTQ_FORMAT.md §5).
    let mut modules: Vec<Vec<&str>> = Vec::new();
    let mut last = None;
    for p in Proj::QUANTIZED {
        if last != Some(p.input()) {
            modules.push(if p == Proj::Q {
                vec![FUSED_QKV]
            } else {
                vec![]
            });
            last = Some(p.input());
        }
        modules.last_mut().expect("pushed").push(p.module());
    }
    let mut modules: Vec<serde_json::Value> = modules.into_iter().map(|m| json!(m)).collect();
    if head {
        modules.push(json!(["lm_head"]));
    }
    json!({
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": false,
        "sym": true,
        "static_groups": false,
        "true_sequential": true,
        "damp_percent": 0.01,
        "lm_head": head,
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "modules_in_block_to_quantize": modules,
        "meta": {
            "quantizer": [format!("spark-tool:{}", env!("CARGO_PKG_VERSION"))],
            "spark_tool": provenance,
        }
    })
}

/// The scalar keys of `qc` for `quantize_config.json`, which vLLM and old AutoGPTQ read only
/// when `config.json` has no block.
pub fn legacy_quantize_config(qc: &serde_json::Value) -> serde_json::Value {
    let mut legacy = serde_json::Map::new();
    for k in [
        "bits",
        "group_size",
        "desc_act",
        "sym",
        "static_groups",
        "true_sequential",
        "damp_percent",
        "checkpoint_format",
        "quant_method",
        "lm_head",
    ] {
        legacy.insert(k.into(), qc[k].clone());
    }
    serde_json::Value::Object(legacy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_we_write_is_what_we_accept() {
        for head in [false, true] {
            let qc = quantization_config(64, head, json!({"format": "w4a8"}));
            let info = GptqInfo::from_json(&qc, "config.json").unwrap();
            assert_eq!((info.group_size, info.lm_head, info.v2), (64, head, false));
            assert_eq!(info.spark_tool_format.as_deref(), Some("w4a8"));
            let m = qc["modules_in_block_to_quantize"].as_array().unwrap();
            assert_eq!(m.len(), 4 + head as usize);
            assert_eq!(m[0][0], FUSED_QKV);
            let legacy = legacy_quantize_config(&qc);
            assert_eq!(legacy["group_size"], 64);
            assert!(legacy.get("modules_in_block_to_quantize").is_none());
        }
        let mut bad = quantization_config(128, false, json!({}));
        bad["checkpoint_format"] = json!("marlin");
        let e = GptqInfo::from_json(&bad, "c.json").unwrap_err().to_string();
        assert!(e.contains("checkpoint_format"), "{e}");
    }
}
