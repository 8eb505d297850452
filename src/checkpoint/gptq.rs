//! What the layout check needs to know of a GPTQ checkpoint (docs/GPTQ_FORMAT.md §1, §4): the
//! `quantization_config` block as read and the tensor set of one linear. It lives here, not in
//! `formats::gptq` (which re-exports it), so that `checkpoint` depends on no format.

use safetensors::Dtype;
use serde::Serialize;

use super::{ConfigError, TensorStore};

/// The tensors of one GPTQ linear, as `<prefix>.<part>`.
pub const GPTQ_PARTS: [&str; 4] = ["qweight", "qzeros", "scales", "g_idx"];

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

/// The GPTQ tensor set of one linear W `[n, k]` (docs/GPTQ_FORMAT.md §1).
pub fn check_tensors(
    store: &TensorStore,
    prefix: &str,
    n: usize,
    k: usize,
    g: usize,
    problems: &mut Vec<String>,
) {
    let mut want = |part: &str, dtypes: &[Dtype], shape: Vec<usize>, required: bool| {
        let name = format!("{prefix}.{part}");
        match store.get(&name) {
            None if required => problems.push(format!(
                "missing tensor `{name}` (GPTQ, expected shape {shape:?})"
            )),
            None => {}
            Some(e) => {
                if e.shape != shape {
                    problems.push(format!(
                        "tensor `{name}` in {} has shape {:?}, expected {shape:?}",
                        store.file_of(e).display(),
                        e.shape
                    ));
                }
                if !dtypes.contains(&e.dtype) {
                    problems.push(format!(
                        "tensor `{name}` in {} has dtype {:?}, expected {dtypes:?}",
                        store.file_of(e).display(),
                        e.dtype
                    ));
                }
            }
        }
    };
    if g == 0 || !k.is_multiple_of(8) || !n.is_multiple_of(8) || !k.is_multiple_of(g) {
        problems.push(format!(
            "`{prefix}`: shape [{n}, {k}] cannot hold GPTQ with group size {g}"
        ));
        return;
    }
    want("qweight", &[Dtype::I32], vec![k / 8, n], true);
    want("qzeros", &[Dtype::I32], vec![k / g, n / 8], true);
    want(
        "scales",
        &[Dtype::F16, Dtype::BF16, Dtype::F32],
        vec![k / g, n],
        true,
    );
    want("g_idx", &[Dtype::I32], vec![k], false);
}
