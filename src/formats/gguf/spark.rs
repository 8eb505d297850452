//! The Spark2_5 GGUF layout llama.cpp loads (architecture `spark2_5`, docs/GGUF.md §4): metadata
//! keys from the config, the vocabulary from `tokenizer.json`, and the tensor names. The same keys,
//! values and tensor order as `tools/gguf_from_hf.py` (which follows llama.cpp's converter); a test
//! compares the two.

use std::path::Path;

use super::mix::FileType;
use super::{GgufError, Value};
use crate::checkpoint::{LayerType, Proj, SparkConfig};

pub const ARCH: &str = "spark2_5";
/// Our own key: marks a file as written by spark-tool (so only ours are ever replaced).
pub const PRODUCER_KEY: &str = "spark_tool.producer";
/// llama.cpp's block quantization version (`GGML_QNT_VERSION`).
const QUANT_VERSION: u32 = 2;

/// GGUF token types (llama.cpp `llama_token_type`).
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// The GGUF name of every tensor, in writing order, with what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    /// `token_embd.weight` (also the head when tied).
    Embedding,
    /// `output.weight` of an untied model.
    Head,
    /// A final or per-layer RMSNorm weight: `model.norm.weight` or `{layer prefix}{name}`.
    Norm { hf: String },
    /// A layer's linear: the projections it stacks along its rows (q | k | v for attn_qkv).
    Linear {
        layer: usize,
        projs: &'static [Proj],
    },
}

/// Each GGUF linear of a layer and the projections it holds, in the converter's order.
const LINEARS: [(&str, &[Proj]); 6] = [
    ("attn_qkv", &[Proj::Q, Proj::K, Proj::V]),
    ("attn_gate", &[Proj::G]),
    ("attn_output", &[Proj::Out]),
    ("ffn_gate", &[Proj::Gate]),
    ("ffn_up", &[Proj::Up]),
    ("ffn_down", &[Proj::Down]),
];

/// The GGUF name of the layer linear that holds `projs` (as [`Slot::Linear`] or
/// `stored_linears` of a fused layout groups them).
pub fn linear_name(layer: usize, projs: &[Proj]) -> String {
    let (name, _) = LINEARS
        .iter()
        .find(|(_, p)| *p == projs)
        .expect("every layer linear of a fused layout has a GGUF name");
    format!("blk.{layer}.{name}.weight")
}

/// The GGUF name of the linear of layer `layer` that holds projection `proj`.
pub fn linear_name_of(layer: usize, proj: Proj) -> String {
    let (_, projs) = LINEARS
        .iter()
        .find(|(_, p)| p.contains(&proj))
        .expect("every projection is in one GGUF linear");
    linear_name(layer, projs)
}

/// `(gguf name, slot)` in the order the converter writes them.
pub fn tensor_plan(cfg: &SparkConfig, tied: bool) -> Vec<(String, Slot)> {
    let mut out = vec![
        ("token_embd.weight".to_string(), Slot::Embedding),
        (
            "output_norm.weight".into(),
            Slot::Norm {
                hf: "model.norm.weight".into(),
            },
        ),
    ];
    if !tied {
        out.push(("output.weight".into(), Slot::Head));
    }
    for i in 0..cfg.num_hidden_layers {
        let p = crate::checkpoint::layout::layer_prefix(i);
        let norm = |n: &str| Slot::Norm {
            hf: format!("{p}{n}"),
        };
        out.push((
            format!("blk.{i}.attn_norm.weight"),
            norm("input_layernorm.weight"),
        ));
        for (j, &(_, projs)) in LINEARS.iter().enumerate() {
            if j == 3 {
                out.push((
                    format!("blk.{i}.ffn_norm.weight"),
                    norm("post_attention_layernorm.weight"),
                ));
            }
            out.push((linear_name(i, projs), Slot::Linear { layer: i, projs }));
        }
    }
    out
}

/// The full and sliding rope parameters: llama.cpp's loader reads both keys even when every
/// layer is of one type, and a config only keeps the types its layers use.
pub fn rope_pair(cfg: &SparkConfig) -> Result<[crate::checkpoint::RopeSpec; 2], GgufError> {
    let get = |t: LayerType| {
        cfg.rope.get(&t).copied().ok_or_else(|| {
            GgufError::Input(format!(
                "no layer is {}, so the config carries no rope parameters for it; a Spark GGUF needs \
                 both layer types' rope parameters",
                t.config_name()
            ))
        })
    };
    Ok([get(LayerType::Full)?, get(LayerType::Sliding)?])
}

fn u32v(v: usize) -> Value {
    Value::U32(v as u32)
}

/// Every metadata key of the file: model hyper-parameters, tokenizer, and our producer mark.
pub fn metadata(
    cfg: &SparkConfig,
    tok_dir: &Path,
    name: &str,
    ft: FileType,
) -> Result<Vec<(String, Value)>, GgufError> {
    let a = |k: &str| format!("{ARCH}.{k}");
    let [full, sliding] = rope_pair(cfg)?;
    let mut kv = vec![
        (
            "general.architecture".to_string(),
            Value::String(ARCH.into()),
        ),
        ("general.name".into(), Value::String(name.into())),
        (
            "general.quantization_version".into(),
            Value::U32(QUANT_VERSION),
        ),
        ("general.file_type".into(), Value::U32(ft.id())),
        (a("block_count"), u32v(cfg.num_hidden_layers)),
        (a("context_length"), u32v(cfg.max_position_embeddings)),
        (a("embedding_length"), u32v(cfg.hidden_size)),
        (a("feed_forward_length"), u32v(cfg.intermediate_size)),
        (a("attention.head_count"), u32v(cfg.num_attention_heads)),
        (a("attention.head_count_kv"), u32v(cfg.num_key_value_heads)),
        // The plain base is the full-attention theta; sliding layers have their own key.
        (a("rope.freq_base"), Value::F32(full.theta as f32)),
        (a("rope.freq_base_swa"), Value::F32(sliding.theta as f32)),
        (
            a("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps),
        ),
        (a("attention.key_length"), u32v(cfg.head_dim)),
        (a("attention.value_length"), u32v(cfg.head_dim)),
        (a("vocab_size"), u32v(cfg.vocab_size)),
        (a("attention.sliding_window"), u32v(cfg.sliding_window)),
        (
            a("attention.sliding_window_pattern"),
            Value::Array(
                cfg.layer_types
                    .iter()
                    .map(|t| Value::Bool(*t == LayerType::Sliding))
                    .collect(),
            ),
        ),
        (a("rope.dimension_count"), u32v(full.rotary_dims)),
        (a("rope.dimension_count_swa"), u32v(sliding.rotary_dims)),
    ];
    kv.extend(vocabulary(tok_dir, cfg.vocab_size)?);
    kv.push((
        PRODUCER_KEY.into(),
        Value::String(format!("spark-tool {}", env!("CARGO_PKG_VERSION"))),
    ));
    Ok(kv)
}

fn bad(path: &Path, what: impl std::fmt::Display) -> GgufError {
    GgufError::Input(format!("{}: {what}", path.display()))
}

fn read_json(path: &Path) -> Result<serde_json::Value, GgufError> {
    let text = std::fs::read_to_string(path).map_err(|e| bad(path, e))?;
    serde_json::from_str(&text).map_err(|e| bad(path, e))
}

/// The byte-level BPE vocabulary as llama.cpp's `gpt2` tokenizer model reads it: one entry per
/// id up to `vocab_size` (ids without a token become unused `[PADi]`), token types, merges,
/// the special ids and flags of `tokenizer_config.json`, and its chat template.
fn vocabulary(dir: &Path, vocab_size: usize) -> Result<Vec<(String, Value)>, GgufError> {
    let path = dir.join("tokenizer.json");
    let t = read_json(&path)?;
    if t["model"]["type"].as_str() != Some("BPE") {
        return Err(bad(&path, "model.type must be BPE (byte-level)"));
    }
    let vocab = t["model"]["vocab"]
        .as_object()
        .ok_or_else(|| bad(&path, "model.vocab is not an object"))?;
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![UNUSED; vocab_size];
    let mut put = |id: u64, s: &str, ty: i32| -> Result<(), GgufError> {
        let slot = tokens
            .get_mut(id as usize)
            .ok_or_else(|| bad(&path, format!("token id {id} ≥ vocab_size {vocab_size}")))?;
        *slot = Some(s.to_string());
        types[id as usize] = ty;
        Ok(())
    };
    for (s, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(&path, format!("token {s:?} has no id")))?;
        put(id, s, NORMAL)?;
    }
    let added = t["added_tokens"].as_array().cloned().unwrap_or_default();
    for a in &added {
        let (Some(id), Some(s)) = (a["id"].as_u64(), a["content"].as_str()) else {
            return Err(bad(&path, "an added_tokens entry lacks id or content"));
        };
        let looks_special = (s.starts_with("<|") && s.ends_with("|>"))
            || (s.starts_with("<｜") && s.ends_with("｜>"));
        if a["special"].as_bool() == Some(true) || looks_special {
            put(id, s, CONTROL)?;
        } else {
            // The converter pre-normalizes user-defined spaces.
            put(id, &s.replace('\u{2581}', " "), USER_DEFINED)?;
        }
    }
    let tokens: Vec<Value> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, s)| Value::String(s.unwrap_or_else(|| format!("[PAD{i}]"))))
        .collect();
    let merges: Vec<Value> = t["model"]["merges"]
        .as_array()
        .ok_or_else(|| bad(&path, "model.merges is missing"))?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Some(s.clone()),
            // A pair may contain spaces; the converter writes them as U+0120 ('Ġ').
            serde_json::Value::Array(p) => match p.as_slice() {
                [a, b] => {
                    let enc = |s: &str| s.replace(' ', "\u{120}");
                    Some(format!("{} {}", enc(a.as_str()?), enc(b.as_str()?)))
                }
                _ => None,
            },
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| bad(&path, "model.merges has an entry that is not a pair"))?
        .into_iter()
        .map(Value::String)
        .collect();
    if merges.is_empty() {
        return Err(bad(&path, "no BPE merges"));
    }
    let mut kv = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".into(), Value::String(ARCH.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ];
    let cfg_path = dir.join("tokenizer_config.json");
    let tc = if cfg_path.exists() {
        read_json(&cfg_path)?
    } else {
        serde_json::Value::Null
    };
    let id_of = |s: &str| -> Option<u64> {
        added
            .iter()
            .find(|a| a["content"].as_str() == Some(s))
            .and_then(|a| a["id"].as_u64())
            .or_else(|| vocab.get(s).and_then(|v| v.as_u64()))
    };
    // gguf-py's SpecialVocab order and key names.
    let gguf_key = |typ: &str| match typ {
        "unk" => "unknown".to_string(),
        "pad" => "padding".to_string(),
        "sep" => "seperator".to_string(),
        other => other.to_string(),
    };
    for typ in ["bos", "eos", "unk", "sep", "pad", "cls", "mask"] {
        let tok = &tc[format!("{typ}_token")];
        let content = tok.as_str().or_else(|| tok["content"].as_str());
        if let Some(id) = content.and_then(id_of) {
            kv.push((
                format!("tokenizer.ggml.{}_token_id", gguf_key(typ)),
                Value::U32(id as u32),
            ));
        }
    }
    for typ in ["bos", "eos", "unk", "sep", "pad", "cls", "mask"] {
        if let Some(b) = tc[format!("add_{typ}_token")].as_bool() {
            kv.push((format!("tokenizer.ggml.add_{typ}_token"), Value::Bool(b)));
        }
    }
    if let Some(tpl) = tc["chat_template"].as_str() {
        kv.push(("tokenizer.chat_template".into(), Value::String(tpl.into())));
    }
    Ok(kv)
}

/// The model configuration of a Spark GGUF, from the keys [`metadata`] writes (llama.cpp's
/// converter writes the same ones).
pub fn config_of(f: &super::GgufFile) -> Result<SparkConfig, GgufError> {
    use crate::checkpoint::RopeSpec;
    let arch = f.get_str("general.architecture")?;
    if arch != ARCH {
        return Err(GgufError::Input(format!(
            "general.architecture is {arch:?}; spark-tool runs {ARCH:?} files"
        )));
    }
    let u = |k: &str| f.get_u32(&format!("{ARCH}.{k}")).map(|v| v as usize);
    let pattern = f.get_array(&format!("{ARCH}.attention.sliding_window_pattern"))?;
    let layer_types = pattern
        .iter()
        .map(|v| match v {
            Value::Bool(true) => Ok(LayerType::Sliding),
            Value::Bool(false) => Ok(LayerType::Full),
            other => Err(GgufError::Input(format!(
                "{ARCH}.attention.sliding_window_pattern holds {other:?}, expected booleans"
            ))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let layers = u("block_count")?;
    if layer_types.len() != layers {
        return Err(GgufError::Input(format!(
            "{ARCH}.attention.sliding_window_pattern has {} entries for {layers} layers",
            layer_types.len()
        )));
    }
    let rope = [
        (LayerType::Full, "rope.freq_base", "rope.dimension_count"),
        (
            LayerType::Sliding,
            "rope.freq_base_swa",
            "rope.dimension_count_swa",
        ),
    ]
    .into_iter()
    .map(|(t, theta, dims)| {
        Ok((
            t,
            RopeSpec {
                theta: f.get_f32(&format!("{ARCH}.{theta}"))? as f64,
                rotary_dims: u(dims)?,
            },
        ))
    })
    .collect::<Result<_, GgufError>>()?;
    let id = |k: &str| f.get_u32(&format!("tokenizer.ggml.{k}_token_id")).ok();
    let tied = !f.tensors().iter().any(|t| t.name == "output.weight");
    Ok(SparkConfig {
        hidden_size: u("embedding_length")?,
        intermediate_size: u("feed_forward_length")?,
        num_hidden_layers: layers,
        num_attention_heads: u("attention.head_count")?,
        num_key_value_heads: u("attention.head_count_kv")?,
        head_dim: u("attention.key_length")?,
        vocab_size: u("vocab_size")?,
        max_position_embeddings: u("context_length")?,
        sliding_window: u("attention.sliding_window")?,
        layer_types,
        rope,
        rms_norm_eps: f.get_f32(&format!("{ARCH}.attention.layer_norm_rms_epsilon"))?,
        tie_word_embeddings: Some(tied),
        bos_token_id: id("bos"),
        eos_token_ids: id("eos").into_iter().collect(),
        pad_token_id: id("padding"),
        gptq: None,
    })
}

/// How the vocabulary of GGUF `f` differs from the one [`metadata`] would write for the
/// tokenizer in `tok_dir` (`None`: the same tokens, types and merges, so both sides map text to
/// the same ids).
pub fn vocabulary_difference(
    f: &super::GgufFile,
    tok_dir: &Path,
    vocab_size: usize,
) -> Result<Option<String>, GgufError> {
    let ours = vocabulary(tok_dir, vocab_size)?;
    for key in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    ] {
        let want = ours.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        let got = f.kv(key);
        if want != got {
            let what = match (want, got) {
                (Some(Value::Array(a)), Some(Value::Array(b))) => {
                    match a.iter().zip(b).position(|(x, y)| x != y) {
                        Some(i) => format!("entry {i}: {:?} vs {:?}", b[i], a[i]),
                        None => format!("{} entries vs {}", b.len(), a.len()),
                    }
                }
                _ => format!("{got:?} vs {want:?}"),
            };
            return Ok(Some(format!(
                "the GGUF's {key} differs from the reference's {}: {what}",
                tok_dir.join("tokenizer.json").display()
            )));
        }
    }
    Ok(None)
}
