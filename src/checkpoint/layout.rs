//! The tensors a Spark2_5 checkpoint must contain (docs/MODEL.md §3), and
//! the check of a real checkpoint against them.

use safetensors::Dtype;
use serde::Serialize;

use super::config::SparkConfig;
use super::store::TensorStore;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorClass {
    Embedding,
    AttentionQkv,
    AttentionGate,
    AttentionOut,
    Mlp,
    Norm,
    LmHead,
}

impl TensorClass {
    pub fn label(self) -> &'static str {
        match self {
            TensorClass::Embedding => "embedding",
            TensorClass::AttentionQkv => "attention q/k/v",
            TensorClass::AttentionGate => "attention gate (g_proj)",
            TensorClass::AttentionOut => "attention out_proj",
            TensorClass::Mlp => "mlp gate/up/down",
            TensorClass::Norm => "norms",
            TensorClass::LmHead => "lm_head (untied)",
        }
    }
}

/// How a layer stores its q/k/v projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QkvLayout {
    /// One `q_k_v_proj` with rows [q | k | v], as the published checkpoints.
    Fused,
    /// Separate `q_proj`, `k_proj`, `v_proj`.
    Split,
}

#[derive(Debug, Clone)]
pub struct ExpectedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub class: TensorClass,
}

pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}.")
}

/// Every tensor the checkpoint must hold, in file-independent order.
pub fn expected_tensors(cfg: &SparkConfig, tied: bool, qkv: &[QkvLayout]) -> Vec<ExpectedTensor> {
    let (h, i_dim) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
    let mut out = Vec::new();
    let mut push =
        |name: String, shape: Vec<usize>, class| out.push(ExpectedTensor { name, shape, class });
    push(
        "model.embedding.weight".into(),
        vec![cfg.vocab_size, h],
        TensorClass::Embedding,
    );
    for (l, layout) in qkv.iter().enumerate().take(cfg.num_hidden_layers) {
        let p = layer_prefix(l);
        push(
            format!("{p}input_layernorm.weight"),
            vec![h],
            TensorClass::Norm,
        );
        match layout {
            QkvLayout::Fused => push(
                format!("{p}self_attn.q_k_v_proj.weight"),
                vec![q + 2 * kv, h],
                TensorClass::AttentionQkv,
            ),
            QkvLayout::Split => {
                push(
                    format!("{p}self_attn.q_proj.weight"),
                    vec![q, h],
                    TensorClass::AttentionQkv,
                );
                push(
                    format!("{p}self_attn.k_proj.weight"),
                    vec![kv, h],
                    TensorClass::AttentionQkv,
                );
                push(
                    format!("{p}self_attn.v_proj.weight"),
                    vec![kv, h],
                    TensorClass::AttentionQkv,
                );
            }
        }
        push(
            format!("{p}self_attn.g_proj.weight"),
            vec![cfg.num_attention_heads, h],
            TensorClass::AttentionGate,
        );
        push(
            format!("{p}self_attn.out_proj.weight"),
            vec![h, q],
            TensorClass::AttentionOut,
        );
        push(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            TensorClass::Norm,
        );
        push(
            format!("{p}mlp.gate_proj.weight"),
            vec![i_dim, h],
            TensorClass::Mlp,
        );
        push(
            format!("{p}mlp.up_proj.weight"),
            vec![i_dim, h],
            TensorClass::Mlp,
        );
        push(
            format!("{p}mlp.down_proj.weight"),
            vec![h, i_dim],
            TensorClass::Mlp,
        );
    }
    push("model.norm.weight".into(), vec![h], TensorClass::Norm);
    if !tied {
        push(
            "lm_head.weight".into(),
            vec![cfg.vocab_size, h],
            TensorClass::LmHead,
        );
    }
    out
}

/// Result of checking a store against the config.
#[derive(Debug, Clone)]
pub struct CheckedLayout {
    pub tied: bool,
    /// Linears stored as GPTQ (`prefix.qweight/qzeros/scales[/g_idx]`), by prefix.
    pub gptq: std::collections::BTreeSet<String>,
    pub qkv: Vec<QkvLayout>,
    pub expected: Vec<ExpectedTensor>,
    pub warnings: Vec<String>,
}

/// The GPTQ tensor set of one linear W `[n, k]` (docs/GPTQ_FORMAT.md §1).
fn check_gptq(
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
    if !k.is_multiple_of(8) || !n.is_multiple_of(8) || !k.is_multiple_of(g) {
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

/// Buffers some exporters leave in; they carry no information we use.
fn is_ignorable(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

pub fn check(cfg: &SparkConfig, store: &TensorStore) -> Result<CheckedLayout, Vec<String>> {
    let mut warnings = Vec::new();
    let has_head = store.get("lm_head.weight").is_some();
    let tied = match cfg.tie_word_embeddings {
        Some(t) => t,
        None => {
            warnings.push(format!(
                "config.json has no `tie_word_embeddings`; {} because the checkpoint {} `lm_head.weight`",
                if has_head { "using the untied lm_head.weight" } else { "tying the head to the embedding" },
                if has_head { "contains" } else { "has no" }
            ));
            !has_head
        }
    };
    let qkv: Vec<QkvLayout> = (0..cfg.num_hidden_layers)
        .map(|l| {
            let p = layer_prefix(l);
            // `.weight` for dense checkpoints, `.qweight` for GPTQ ones.
            let has = |m: &str| {
                ["weight", "qweight"]
                    .iter()
                    .any(|t| store.get(&format!("{p}self_attn.{m}.{t}")).is_some())
            };
            if !has("q_k_v_proj") && has("q_proj") {
                QkvLayout::Split
            } else {
                QkvLayout::Fused
            }
        })
        .collect();
    let expected = expected_tensors(cfg, tied, &qkv);
    let mut problems = Vec::new();
    let mut gptq = std::collections::BTreeSet::new();
    for t in &expected {
        let quantizable = matches!(
            t.class,
            TensorClass::AttentionQkv
                | TensorClass::AttentionOut
                | TensorClass::Mlp
                | TensorClass::LmHead
        );
        if let (Some(info), Some(prefix), None) = (
            &cfg.gptq,
            t.name.strip_suffix(".weight"),
            store.get(&t.name),
        ) {
            if quantizable && store.get(&format!("{prefix}.qweight")).is_some() {
                check_gptq(
                    store,
                    prefix,
                    t.shape[0],
                    t.shape[1],
                    info.group_size,
                    &mut problems,
                );
                gptq.insert(prefix.to_string());
                continue;
            }
        }
        match store.get(&t.name) {
            None => problems.push(format!(
                "missing tensor `{}` (expected shape {:?})",
                t.name, t.shape
            )),
            Some(e) => {
                if e.shape != t.shape {
                    problems.push(format!(
                        "tensor `{}` in {} has shape {:?}, expected {:?}",
                        t.name,
                        store.file_of(e).display(),
                        e.shape,
                        t.shape
                    ));
                }
                if !matches!(e.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                    problems.push(format!(
                        "tensor `{}` in {} has dtype {:?}, expected BF16, F16 or F32",
                        t.name,
                        store.file_of(e).display(),
                        e.dtype
                    ));
                }
            }
        }
    }
    for e in store.entries() {
        if expected.iter().any(|t| t.name == e.name) {
            continue;
        }
        if let Some((prefix, part)) = e.name.rsplit_once('.') {
            if gptq.contains(prefix) && ["qweight", "qzeros", "scales", "g_idx"].contains(&part) {
                continue;
            }
        }
        if e.name == "lm_head.weight" && tied {
            let emb = store.get("model.embedding.weight");
            let same = emb.is_some_and(|m| m.dtype == e.dtype && store.bytes(m) == store.bytes(e));
            warnings.push(if same {
                "`lm_head.weight` is present but config says tie_word_embeddings=true; it equals the embedding and is ignored".into()
            } else {
                "`lm_head.weight` is present but config says tie_word_embeddings=true and it DIFFERS from the embedding; it is ignored, as HF and vLLM do — check the config".into()
            });
        } else if is_ignorable(&e.name) {
            warnings.push(format!("ignoring buffer `{}`", e.name));
        } else {
            problems.push(format!(
                "unexpected tensor `{}` in {} (shape {:?}, {:?}) is not part of Spark2_5",
                e.name,
                store.file_of(e).display(),
                e.shape,
                e.dtype
            ));
        }
    }
    if problems.is_empty() {
        Ok(CheckedLayout {
            tied,
            gptq,
            qkv,
            expected,
            warnings,
        })
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: serde_json::Value) -> SparkConfig {
        SparkConfig::from_json_str(&json.to_string(), "config.json").unwrap()
    }

    fn real(hidden: usize, inter: usize, layers: usize, heads: usize, kv: usize) -> SparkConfig {
        let types: Vec<&str> = (0..layers)
            .map(|i| {
                if (i + 1) % 4 == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        cfg(serde_json::json!({
            "model_type": "spark2_5", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 256, "vocab_size": 131072, "sliding_window": 512, "layer_types": types,
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 5000000},
                                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000}},
            "hidden_act": "gelu", "tie_word_embeddings": true
        }))
    }

    fn count(c: &SparkConfig) -> (usize, usize) {
        let t = expected_tensors(c, true, &vec![QkvLayout::Fused; c.num_hidden_layers]);
        (
            t.len(),
            t.iter().map(|t| t.shape.iter().product::<usize>()).sum(),
        )
    }

    #[test]
    fn spec_parameter_counts() {
        // docs/MODEL.md §3 and §15.
        assert_eq!(count(&real(2048, 6656, 28, 8, 2)), (226, 1_707_657_216));
        assert_eq!(count(&real(2560, 10240, 36, 16, 4)).1, 4_112_079_360);
    }

    #[test]
    fn split_layout_has_same_parameters() {
        let c = real(2048, 6656, 28, 8, 2);
        let split = expected_tensors(&c, true, &[QkvLayout::Split; 28]);
        let n: usize = split
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        assert_eq!((split.len(), n), (226 + 2 * 28, 1_707_657_216));
    }
}
