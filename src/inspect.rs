//! `inspect`: what a checkpoint holds and what it will cost to run.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::checkpoint::{Checkpoint, LayerType, TensorClass};
use crate::model::{KvPrecision, LoadOptions};
use crate::tokenizer::SparkTokenizer;

#[derive(Debug, Serialize)]
pub struct ClassStat {
    pub class: TensorClass,
    pub label: &'static str,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct RopeReport {
    pub layer_type: &'static str,
    pub layers: usize,
    pub theta: f64,
    pub rotary_dims: usize,
}

#[derive(Debug, Serialize)]
pub struct KvReport {
    pub context: usize,
    /// K+V bytes per token per layer at 16 bits per value.
    pub bytes_per_token_per_layer_16bit: u64,
    /// Entries each sliding layer holds at this context: min(window, context).
    pub sliding_entries: usize,
    pub sliding_bytes_16bit: u64,
    pub full_bytes_16bit: u64,
    pub total_bytes_16bit: u64,
    /// What spark-tool's CPU engine allocates with f32 caches (a float checkpoint).
    pub total_bytes_f32: u64,
    /// What spark-tool's engine allocates for this checkpoint by default: bf16 caches for a GPTQ
    /// checkpoint (bf16 activations), f32 for a float one (docs/MODEL.md §8).
    pub engine_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct InspectReport {
    pub dir: String,
    pub files: Vec<(String, u64)>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub layer_types: String,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub q_dim: usize,
    pub kv_dim: usize,
    pub vocab_size: usize,
    pub sliding_window: usize,
    pub tied_head: bool,
    pub qkv_layout: String,
    pub rope: Vec<RopeReport>,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
    pub dtypes: BTreeMap<String, usize>,
    pub classes: Vec<ClassStat>,
    pub kv_cache: KvReport,
    pub tokenizer: Option<String>,
    pub warnings: Vec<String>,
}

/// Compact `layer_types`: runs like `[S S S F]×7`.
fn pattern(types: &[LayerType]) -> String {
    let ch: Vec<char> = types
        .iter()
        .map(|t| if *t == LayerType::Sliding { 'S' } else { 'F' })
        .collect();
    for period in 1..=ch.len() {
        if ch.len().is_multiple_of(period) && ch.chunks(period).all(|c| c == &ch[..period]) {
            let unit: Vec<String> = ch[..period].iter().map(|c| c.to_string()).collect();
            return format!("[{}]×{}", unit.join(" "), ch.len() / period);
        }
    }
    unreachable!("period = len always matches")
}

pub fn inspect(ck: &Checkpoint, context: usize) -> InspectReport {
    let cfg = &ck.config;
    let mut classes: BTreeMap<TensorClass, ClassStat> = BTreeMap::new();
    for t in &ck.layout.expected {
        let bytes: u64 = match t
            .name
            .strip_suffix(".weight")
            .filter(|p| ck.layout.gptq.contains(*p))
        {
            Some(prefix) => crate::formats::gptq::GPTQ_PARTS
                .iter()
                .filter_map(|part| ck.store.get(&format!("{prefix}.{part}")))
                .map(|e| (e.end - e.start) as u64)
                .sum(),
            None => {
                let e = ck.store.get(&t.name).expect("layout check proved presence");
                (e.end - e.start) as u64
            }
        };
        let c = classes.entry(t.class).or_insert(ClassStat {
            class: t.class,
            label: t.class.label(),
            tensors: 0,
            parameters: 0,
            bytes: 0,
        });
        c.tensors += 1;
        c.parameters += t.shape.iter().product::<usize>() as u64;
        c.bytes += bytes;
    }
    let mut dtypes = BTreeMap::new();
    for e in ck.store.entries() {
        *dtypes.entry(format!("{:?}", e.dtype)).or_insert(0) += 1;
    }
    let files = ck
        .store
        .files()
        .map(|p| {
            let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
            (p.display().to_string(), len)
        })
        .collect();

    let per_tok = 2 * cfg.kv_dim() as u64 * 2;
    let (n_s, n_f) = (
        cfg.count_layers(LayerType::Sliding),
        cfg.count_layers(LayerType::Full),
    );
    let sliding_entries = cfg.sliding_window.min(context);
    let sliding = n_s as u64 * sliding_entries as u64 * per_tok;
    let full = n_f as u64 * context as u64 * per_tok;

    let mut warnings = ck.layout.warnings.clone();
    let tokenizer = match ck.tokenizer_path() {
        None => {
            warnings.push(format!(
                "no tokenizer.json: `run` will need {} instead of {}",
                crate::setting::Setting::Tokens,
                crate::setting::Setting::Prompt
            ));
            None
        }
        Some(p) => match SparkTokenizer::from_file(&p) {
            Ok(t) => {
                if t.vocab_size() > cfg.vocab_size {
                    warnings.push(format!(
                        "tokenizer has {} tokens but vocab_size is {}: some ids have no embedding row",
                        t.vocab_size(),
                        cfg.vocab_size
                    ));
                }
                Some(format!("{} ({} tokens)", p.display(), t.vocab_size()))
            }
            Err(e) => {
                warnings.push(format!("tokenizer does not load: {e}"));
                None
            }
        },
    };
    if context > cfg.max_position_embeddings {
        warnings.push(format!(
            "context {context} exceeds max_position_embeddings {}",
            cfg.max_position_embeddings
        ));
    }
    let fused = ck
        .layout
        .qkv
        .iter()
        .filter(|l| **l == crate::checkpoint::QkvLayout::Fused)
        .count();
    let qkv_layout = match fused {
        n if n == ck.layout.qkv.len() => "fused q_k_v_proj (split at load)".to_string(),
        0 => "split q_proj/k_proj/v_proj".to_string(),
        n => format!("{n} layers fused, {} split", ck.layout.qkv.len() - n),
    };

    InspectReport {
        dir: ck.dir.display().to_string(),
        files,
        hidden_size: cfg.hidden_size,
        intermediate_size: cfg.intermediate_size,
        num_layers: cfg.num_hidden_layers,
        layer_types: pattern(&cfg.layer_types),
        num_attention_heads: cfg.num_attention_heads,
        num_key_value_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        q_dim: cfg.q_dim(),
        kv_dim: cfg.kv_dim(),
        vocab_size: cfg.vocab_size,
        sliding_window: cfg.sliding_window,
        tied_head: ck.layout.tied,
        qkv_layout,
        rope: cfg
            .rope
            .iter()
            .map(|(t, s)| RopeReport {
                layer_type: t.config_name(),
                layers: cfg.count_layers(*t),
                theta: s.theta,
                rotary_dims: s.rotary_dims,
            })
            .collect(),
        tensors: ck.store.len(),
        parameters: classes.values().map(|c| c.parameters).sum(),
        bytes: classes.values().map(|c| c.bytes).sum(),
        dtypes,
        classes: classes.into_values().collect(),
        kv_cache: KvReport {
            context,
            bytes_per_token_per_layer_16bit: per_tok,
            sliding_entries,
            sliding_bytes_16bit: sliding,
            full_bytes_16bit: full,
            total_bytes_16bit: sliding + full,
            total_bytes_f32: 2 * (sliding + full),
            engine_bytes: {
                let exec = LoadOptions::for_checkpoint(ck, false).exec;
                let precision = KvPrecision::for_activations(exec.act_bf16);
                crate::resources::kv_cache_bytes(&ck.config, context, precision.bytes()) as u64
            },
        },
        tokenizer,
        warnings,
    }
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{bytes} B")
    }
}

fn commas(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl std::fmt::Display for InspectReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "Spark2_5 checkpoint {}", self.dir)?;
        for (p, b) in &self.files {
            writeln!(f, "  file {p} ({})", human(*b))?;
        }
        writeln!(
            f,
            "  hidden {}  intermediate {}  vocab {}  head_dim {}",
            self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        )?;
        writeln!(
            f,
            "  layers {} = {}  (S = sliding, window {}; F = full)",
            self.num_layers, self.layer_types, self.sliding_window
        )?;
        writeln!(
            f,
            "  heads {} q / {} kv  (q_dim {}, kv_dim {}), {}, head {}",
            self.num_attention_heads,
            self.num_key_value_heads,
            self.q_dim,
            self.kv_dim,
            self.qkv_layout,
            if self.tied_head {
                "tied to embedding"
            } else {
                "untied lm_head"
            }
        )?;
        for r in &self.rope {
            writeln!(
                f,
                "  rope {:<17} {:>2} layers  theta {:<10} rotated dims {}",
                r.layer_type, r.layers, r.theta, r.rotary_dims
            )?;
        }
        let dt: Vec<String> = self
            .dtypes
            .iter()
            .map(|(k, v)| format!("{k}×{v}"))
            .collect();
        writeln!(
            f,
            "  tensors {}  parameters {}  ({}; dtypes {})",
            self.tensors,
            commas(self.parameters),
            human(self.bytes),
            dt.join(", ")
        )?;
        writeln!(
            f,
            "  {:<26} {:>7} {:>16} {:>11}",
            "class", "tensors", "parameters", "bytes"
        )?;
        for c in &self.classes {
            writeln!(
                f,
                "  {:<26} {:>7} {:>16} {:>11}",
                c.label,
                c.tensors,
                commas(c.parameters),
                human(c.bytes)
            )?;
        }
        let k = &self.kv_cache;
        writeln!(
            f,
            "  KV cache at context {} (16-bit): sliding {} ({} entries/layer), full {}, total {} ({} per token per layer; spark-tool's engine: {})",
            k.context,
            human(k.sliding_bytes_16bit),
            k.sliding_entries,
            human(k.full_bytes_16bit),
            human(k.total_bytes_16bit),
            human(k.bytes_per_token_per_layer_16bit),
            human(k.engine_bytes)
        )?;
        match &self.tokenizer {
            Some(t) => writeln!(f, "  tokenizer {t}")?,
            None => writeln!(f, "  tokenizer: none")?,
        }
        for w in &self.warnings {
            writeln!(f, "  warning: {w}")?;
        }
        Ok(())
    }
}

/// Parameters of the model `cfg` describes, counting a tied head once.
pub fn parameters(cfg: &crate::checkpoint::SparkConfig) -> u64 {
    let (h, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let (q, kv, heads) = (
        cfg.q_dim() as u64,
        cfg.kv_dim() as u64,
        cfg.num_attention_heads as u64,
    );
    let layer = (q + 2 * kv + heads) * h + q * h + 3 * h * i + 2 * h;
    let head = if cfg.tie_word_embeddings == Some(false) {
        cfg.vocab_size as u64 * h
    } else {
        0
    };
    cfg.vocab_size as u64 * h + cfg.num_hidden_layers as u64 * layer + h + head
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_pattern_is_compact() {
        use LayerType::*;
        assert_eq!(
            pattern(&[Sliding, Sliding, Sliding, Full].repeat(7)),
            "[S S S F]×7"
        );
        assert_eq!(pattern(&[Sliding, Full, Full]), "[S F F]×1");
        assert_eq!(commas(1707657216), "1,707,657,216");
    }
}

/// What `inspect` reports for a GGUF file.
#[derive(Debug, serde::Serialize)]
pub struct GgufReport {
    pub file: String,
    pub architecture: String,
    pub layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub tied_head: bool,
    /// llama.cpp's `general.file_type`.
    pub file_type: Option<u32>,
    /// Written by spark-tool (and how), when it was.
    pub producer: Option<String>,
    pub quantization: Option<serde_json::Value>,
    /// Tensors per GGML type.
    pub tensor_types: BTreeMap<String, usize>,
    pub parameters: u64,
    pub tensor_bytes: u64,
    pub bits_per_weight: f64,
}

/// Inspect a Spark GGUF file: its config (from the metadata), tensor types and size.
pub fn inspect_gguf(path: &std::path::Path) -> Result<GgufReport, crate::formats::gguf::GgufError> {
    use crate::formats::gguf::{spark, GgufFile, Value};
    let f = GgufFile::open(path)?;
    let cfg = spark::config_of(&f)?;
    let mut tensor_types = BTreeMap::new();
    for t in f.tensors() {
        *tensor_types.entry(t.ty.name().to_string()).or_insert(0) += 1;
    }
    let parameters: u64 = f.tensors().iter().map(|t| t.elements()).sum();
    let tensor_bytes: u64 = f.tensors().iter().map(|t| t.nbytes() as u64).sum();
    let text = |k: &str| match f.kv(k) {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    };
    Ok(GgufReport {
        file: path.display().to_string(),
        architecture: f.get_str("general.architecture")?.to_string(),
        layers: cfg.num_hidden_layers,
        hidden_size: cfg.hidden_size,
        vocab_size: cfg.vocab_size,
        tied_head: cfg.tie_word_embeddings != Some(false),
        file_type: f.get_u32("general.file_type").ok(),
        producer: text(spark::PRODUCER_KEY),
        quantization: text("spark_tool.quantization").and_then(|s| serde_json::from_str(&s).ok()),
        tensor_types,
        parameters,
        tensor_bytes,
        bits_per_weight: tensor_bytes as f64 * 8.0 / parameters.max(1) as f64,
    })
}

impl std::fmt::Display for GgufReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "GGUF {} ({})", self.file, self.architecture)?;
        writeln!(
            f,
            "  {} layers, hidden {}, vocab {}, head {}",
            self.layers,
            self.hidden_size,
            self.vocab_size,
            if self.tied_head {
                "tied to the embedding"
            } else {
                "untied"
            }
        )?;
        let types: Vec<String> = self
            .tensor_types
            .iter()
            .map(|(t, n)| format!("{n} {t}"))
            .collect();
        writeln!(f, "  tensors: {}", types.join(", "))?;
        writeln!(
            f,
            "  {} parameters, {} of tensor data, {:.3} bits per weight",
            self.parameters,
            crate::resources::human(self.tensor_bytes as u128),
            self.bits_per_weight
        )?;
        match &self.producer {
            Some(p) => writeln!(f, "  written by {p}")?,
            None => writeln!(f, "  not written by spark-tool")?,
        }
        if let Some(q) = &self.quantization {
            writeln!(f, "  quantization: {q}")?;
        }
        Ok(())
    }
}
