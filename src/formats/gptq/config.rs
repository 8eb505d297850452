//! The `quantization_config` block spark-tool writes into a GPTQ checkpoint (docs/GPTQ_FORMAT.md §4);
//! what a reader accepts is `checkpoint::gptq::GptqInfo`.

use serde_json::json;

use crate::checkpoint::layout::FUSED_QKV;
use crate::checkpoint::Proj;

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
    use crate::checkpoint::gptq::GptqInfo;

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
