//! The Spark2_5 forward pass (docs/MODEL.md §4), f32 activations over
//! any [`Linear`] weights:
//!
//! ```text
//! x = E[token]
//! per layer: h = RMSNorm(x); q,k,v = h·W{q,k,v}ᵀ; g = h·Wgᵀ
//!            q,k = RoPE_type(q,k,pos); a = attention_type(q, cache + k, v)
//!            a_head *= sigmoid(g_head); x += a·Woᵀ
//!            h2 = RMSNorm(x); x += Wdown·(gelu(Wgate·h2) ⊙ Wup·h2)
//! logits = RMSNorm(x)·headᵀ
//! ```

pub mod block;
pub mod kv_cache;
pub mod linear;
pub mod profile;
pub mod quantized;
pub mod rope;

use std::collections::BTreeMap;

use crate::checkpoint::layout::layer_prefix;
use crate::checkpoint::{Checkpoint, CheckpointError, LayerType, SparkConfig};
pub use block::{Ctx, DecoderLayer, Mlp, RmsNorm, Segment, SelfAttention};
pub use kv_cache::{CacheError, KvCache, KvPrecision};
pub use linear::{Bf16Data, DenseLinear, DenseWeight, Linear};
use profile::{Stage, StageTimers};
pub use quantized::{QuantExec, W4Numerics};
use rope::Rope;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(
        "token id {id} at prompt index {index} is outside the vocabulary (vocab_size {vocab})"
    )]
    TokenOutOfRange { id: u32, index: usize, vocab: usize },
    #[error("empty input: at least one token is needed")]
    Empty,
    #[error(
        "{needed} positions needed but the graph was exported for context {context} \
         (export again with {setting} {needed} or more)",
        setting = crate::setting::Setting::Context
    )]
    PastContext { needed: usize, context: usize },
    #[error(
        "the logits after position {position} are not finite (NaN or Inf): the artifact is broken \
         (a non-finite weight, or values that overflow)"
    )]
    NonFinite { position: usize },
    /// A failure of the runtime executing the model (ONNX Runtime for phone graphs).
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync>),
}

pub use crate::checkpoint::layout::Proj;

/// Which rows of logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// `[n_tokens, vocab]`
    All,
    /// `[1, vocab]` for the last token only (skips the head for the rest).
    Last,
}

pub struct SparkModel {
    config: SparkConfig,
    embedding: DenseWeight,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Box<dyn Linear>,
    ropes: BTreeMap<LayerType, Rope>,
    timers: StageTimers,
    /// Activations between linears are bf16 values ([`QuantExec::act_bf16`]).
    act_bf16: bool,
}

fn dense(w: DenseWeight, out: usize, inp: usize) -> Box<dyn Linear> {
    Box::new(DenseLinear::from_weight(w, out, inp))
}

/// Weight bytes one decode step reads ([`SparkModel::decode_bytes`]): the bandwidth ceiling of
/// decode is the machine's streaming read over these plus the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DecodeBytes {
    /// Every layer's projections as their kernels hold them (packed codes, scales, zero points).
    pub linears: u64,
    /// The RMSNorm weights (f32).
    pub norms: u64,
    pub head: u64,
}

impl DecodeBytes {
    pub fn total(&self) -> u64 {
        self.linears + self.norms + self.head
    }
}

/// How to build the model from a checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub progress: bool,
    pub exec: QuantExec,
}

impl LoadOptions {
    /// What the checkpoint targets: the original runs in f32; a GPTQ
    /// checkpoint runs with bf16 activations and the numerics spark-tool
    /// recorded when writing it (W4A16 for checkpoints from elsewhere).
    pub fn for_checkpoint(ck: &Checkpoint, progress: bool) -> Self {
        let numerics = match ck
            .config
            .gptq
            .as_ref()
            .and_then(|g| g.spark_tool_format.as_deref())
        {
            Some("w4a8") => W4Numerics::W4A8,
            _ => W4Numerics::W4A16,
        };
        LoadOptions {
            progress,
            exec: QuantExec {
                numerics,
                act_bf16: ck.config.gptq.is_some(),
            },
        }
    }
}

/// Rounds a linear's input and output to bf16 (a bf16 model's activations): the one place that
/// asks for it, for dense and GPTQ linears alike, through [`Linear::forward_bf16`]. (The W4A8
/// recipe rounds its input and output itself, so its linear does it there without a copy.)
struct Bf16Act(Box<dyn Linear>);

impl Linear for Bf16Act {
    fn in_features(&self) -> usize {
        self.0.in_features()
    }
    fn out_features(&self) -> usize {
        self.0.out_features()
    }
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.0.forward_bf16(x, m, y);
    }
    fn w4a8_rounding(&self, bf16: bool) -> Option<&crate::kernels::w4a8::PackedW4A8> {
        // This forward is the inner linear's `forward_bf16`.
        if bf16 {
            None
        } else {
            self.0.w4a8_rounding(true)
        }
    }
    fn kind(&self) -> String {
        format!("{} (bf16 activations)", self.0.kind())
    }
    fn weight_bytes(&self) -> usize {
        self.0.weight_bytes()
    }
    fn dequantize(&self) -> Vec<f32> {
        self.0.dequantize()
    }
}

impl SparkModel {
    /// Build the model with the checkpoint's default execution (see [`LoadOptions::for_checkpoint`]).
    pub fn from_checkpoint(ck: &Checkpoint, progress: bool) -> Result<Self, CheckpointError> {
        Self::load(ck, LoadOptions::for_checkpoint(ck, progress))
    }

    /// Build the model. The fused `q_k_v_proj` is split here into three
    /// projections over one input (dense rows or GPTQ output columns).
    pub fn load(ck: &Checkpoint, opts: LoadOptions) -> Result<Self, CheckpointError> {
        let progress = opts.progress;
        let cfg = ck.config.clone();
        let h = cfg.hidden_size;
        let wrap = |l: Box<dyn Linear>| -> Box<dyn Linear> {
            if opts.exec.act_bf16 {
                Box::new(Bf16Act(l))
            } else {
                l
            }
        };
        // Output rows `rows` of linear `prefix` (all rows when None), dense or GPTQ.
        let lin = |prefix: String,
                   rows: Option<std::ops::Range<usize>>,
                   n: usize,
                   k: usize|
         -> Result<Box<dyn Linear>, CheckpointError> {
            if ck.layout.gptq.contains(&prefix) {
                let r = rows.unwrap_or(0..n);
                return Ok(wrap(quantized::load_gptq(ck, &prefix, r, opts.exec)?));
            }
            let w = DenseWeight::load(ck, &format!("{prefix}.weight"), rows)?;
            Ok(wrap(dense(w, n, k)))
        };
        let bar =
            crate::artifact::progress_bar(progress, cfg.num_hidden_layers as u64 + 2, "loading");
        bar.set_message("embedding");
        let embedding = DenseWeight::load(ck, "model.embedding.weight", None)?;
        bar.inc(1);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            bar.set_message(format!("layer {i}"));
            let p = layer_prefix(i);
            let norm = |n: &str| -> Result<RmsNorm, CheckpointError> {
                Ok(RmsNorm::new(
                    ck.tensor_f32(&format!("{p}{n}"))?,
                    cfg.rms_norm_eps,
                ))
            };
            let mut lin = |proj: Proj| {
                let (prefix, rows) = proj.stored_at(i, ck.layout.qkv[i], &cfg);
                let [n, k] = proj.shape(&cfg);
                lin(prefix, rows, n, k)
            };
            layers.push(DecoderLayer {
                kind: *kind,
                input_layernorm: norm("input_layernorm.weight")?,
                self_attn: SelfAttention::load(&mut lin)?,
                post_attention_layernorm: norm("post_attention_layernorm.weight")?,
                mlp: Mlp::load(&mut lin)?,
            });
            bar.inc(1);
        }
        let norm = RmsNorm::new(ck.tensor_f32("model.norm.weight")?, cfg.rms_norm_eps);
        let lm_head: Box<dyn Linear> = if ck.layout.tied {
            wrap(dense(embedding.clone(), cfg.vocab_size, h))
        } else {
            lin("lm_head".into(), None, cfg.vocab_size, h)?
        };
        bar.inc(1);
        bar.finish_and_clear();
        Ok(Self::assemble(
            cfg,
            embedding,
            layers,
            norm,
            lm_head,
            opts.exec.act_bf16,
        ))
    }

    /// Build the model from a Spark GGUF file (llama.cpp's, or ours): every tensor dequantized to
    /// f32 exactly as ggml's dequantizers compute it. With `ggml_activations` each linear's input
    /// is first converted to its weight type's `vec_dot_type`, as llama.cpp's CPU backend does
    /// (8-bit blocks for the quantized types); otherwise activations stay f32. Holds 4 bytes per
    /// parameter.
    pub fn from_gguf(
        f: &crate::formats::gguf::GgufFile,
        ggml_activations: bool,
        progress: bool,
    ) -> Result<Self, crate::formats::gguf::GgufError> {
        use crate::formats::gguf::activations::ActQuant;
        use crate::formats::gguf::GgufError;
        let act_of = |name: &str| -> ActQuant {
            match f.tensors().iter().find(|t| t.name == name) {
                Some(t) if ggml_activations => ActQuant::for_weights(t.ty),
                _ => ActQuant::F32,
            }
        };
        let cfg = crate::formats::gguf::spark::config_of(f)?;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let get = |name: &str, n: usize, k: usize| -> Result<Vec<f32>, GgufError> {
            let t = f
                .tensors()
                .iter()
                .find(|t| t.name == name)
                .ok_or_else(|| GgufError::Input(format!("tensor {name} is missing")))?;
            let want: Vec<u64> = if n == 1 {
                vec![k as u64]
            } else {
                vec![k as u64, n as u64]
            };
            if t.dims != want {
                return Err(GgufError::Input(format!(
                    "tensor {name} has dims {:?}, the metadata implies {want:?}",
                    t.dims
                )));
            }
            f.dequantize(name)
        };
        let dense = |w: Vec<f32>, n: usize, k: usize, act: ActQuant| -> Box<dyn Linear> {
            linear::GgmlActivations::wrap(Box::new(DenseLinear::new(w.into(), n, k)), act)
        };
        let bar =
            crate::artifact::progress_bar(progress, cfg.num_hidden_layers as u64 + 2, "loading");
        let embedding = DenseWeight::F32(get("token_embd.weight", cfg.vocab_size, h)?.into());
        bar.inc(1);
        let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let t = |n: &str| format!("blk.{i}.{n}.weight");
            let mut qkv = get(&t("attn_qkv"), q + 2 * kv, h)?;
            let v = qkv.split_off((q + kv) * h);
            let k = qkv.split_off(q * h);
            let mut parts = [Some(qkv), Some(k), Some(v)];
            let mut lin = |p: Proj| -> Result<Box<dyn Linear>, GgufError> {
                let [n, kk] = p.shape(&cfg);
                let name = match p {
                    Proj::Q | Proj::K | Proj::V => t("attn_qkv"),
                    Proj::G => t("attn_gate"),
                    Proj::Out => t("attn_output"),
                    Proj::Gate => t("ffn_gate"),
                    Proj::Up => t("ffn_up"),
                    Proj::Down => t("ffn_down"),
                };
                let w = match p {
                    Proj::Q => parts[0].take(),
                    Proj::K => parts[1].take(),
                    Proj::V => parts[2].take(),
                    Proj::G => Some(get(&t("attn_gate"), n, kk)?),
                    Proj::Out => Some(get(&t("attn_output"), n, kk)?),
                    Proj::Gate => Some(get(&t("ffn_gate"), n, kk)?),
                    Proj::Up => Some(get(&t("ffn_up"), n, kk)?),
                    Proj::Down => Some(get(&t("ffn_down"), n, kk)?),
                };
                Ok(dense(
                    w.expect("each projection is taken once"),
                    n,
                    kk,
                    act_of(&name),
                ))
            };
            let mut attn = Vec::new();
            for p in [Proj::Q, Proj::K, Proj::V, Proj::G, Proj::Out] {
                attn.push(Some(lin(p)?));
            }
            let mut mlp = Vec::new();
            for p in [Proj::Gate, Proj::Up, Proj::Down] {
                mlp.push(Some(lin(p)?));
            }
            let take = |v: &mut Vec<Option<Box<dyn Linear>>>, i: usize| v[i].take().expect("once");
            layers.push(DecoderLayer {
                kind: *kind,
                input_layernorm: RmsNorm::new(get(&t("attn_norm"), 1, h)?, eps),
                self_attn: SelfAttention {
                    q_proj: take(&mut attn, 0),
                    k_proj: take(&mut attn, 1),
                    v_proj: take(&mut attn, 2),
                    g_proj: take(&mut attn, 3),
                    out_proj: take(&mut attn, 4),
                },
                post_attention_layernorm: RmsNorm::new(get(&t("ffn_norm"), 1, h)?, eps),
                mlp: Mlp {
                    gate_proj: take(&mut mlp, 0),
                    up_proj: take(&mut mlp, 1),
                    down_proj: take(&mut mlp, 2),
                },
            });
            bar.inc(1);
        }
        let norm = RmsNorm::new(get("output_norm.weight", 1, h)?, eps);
        let lm_head: Box<dyn Linear> = if cfg.tie_word_embeddings == Some(false) {
            dense(
                get("output.weight", cfg.vocab_size, h)?,
                cfg.vocab_size,
                h,
                act_of("output.weight"),
            )
        } else {
            let l = DenseLinear::from_weight(embedding.clone(), cfg.vocab_size, h);
            linear::GgmlActivations::wrap(Box::new(l), act_of("token_embd.weight"))
        };
        bar.finish_and_clear();
        Ok(Self::assemble(cfg, embedding, layers, norm, lm_head, false))
    }

    fn assemble(
        cfg: SparkConfig,
        embedding: DenseWeight,
        layers: Vec<DecoderLayer>,
        norm: RmsNorm,
        lm_head: Box<dyn Linear>,
        act_bf16: bool,
    ) -> Self {
        let ropes = cfg.rope.iter().map(|(t, s)| (*t, Rope::new(*s))).collect();
        SparkModel {
            config: cfg,
            embedding,
            layers,
            norm,
            lm_head,
            ropes,
            timers: StageTimers::default(),
            act_bf16,
        }
    }

    pub fn config(&self) -> &SparkConfig {
        &self.config
    }

    /// Per-stage timers of the forward pass (off until enabled).
    pub fn stage_timers(&self) -> &StageTimers {
        &self.timers
    }

    pub fn new_cache(&self, context: usize) -> KvCache {
        KvCache::new(&self.config, context, self.kv_precision())
    }

    /// How this model's caches store keys and values.
    pub fn kv_precision(&self) -> KvPrecision {
        KvPrecision::for_activations(self.act_bf16)
    }

    /// Run `tokens` at positions `cache.pos()..` and append their K/V to the
    /// cache. Prefill is one call with the whole prompt; decode is one call
    /// per token. Returns logits as asked by `want`.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        want: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        let m = tokens.len();
        if m == 0 {
            return Err(ModelError::Empty);
        }
        cache.reserve(m)?;
        // A prefill allocates every layer's activations anew: reuse the freed blocks.
        let _heap = (m > 1).then(crate::resources::HeapReuse::new);
        let start = cache.pos();
        let tm = &self.timers;
        // x = E[tokens]
        let mut x = tm.time(Stage::Embed, || self.embed(tokens))?;
        // x = layer(x) for each layer, each with its own cache
        for (li, layer) in self.layers.iter().enumerate() {
            layer.forward(&mut x, m, start, cache.layer_mut(li), &self.ctx(li));
        }
        cache.advance(m);
        // logits = head(RMSNorm(x)) of the rows asked for
        let rows = match want {
            Logits::All => 0,
            Logits::Last => m - 1,
        };
        let hidden = self.config.hidden_size;
        Ok(tm.time(Stage::Head, || self.logits(&x[rows * hidden..])))
    }

    /// One decode step of several sequences at once: `tokens[i]` is appended to `caches[i]` at
    /// its own next position; returns the logits `[n, vocab]`, row i for sequence i. Each
    /// linear runs once over all n rows, so the weights are read once per step for all of them.
    pub fn forward_many(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, ModelError> {
        let m = tokens.len();
        assert_eq!(m, caches.len(), "one token per sequence");
        if m == 0 {
            return Err(ModelError::Empty);
        }
        for c in caches.iter() {
            c.reserve(1)?;
        }
        let starts: Vec<usize> = caches.iter().map(|c| c.pos()).collect();
        let tm = &self.timers;
        let mut x = tm.time(Stage::Embed, || self.embed(tokens))?;
        for (li, layer) in self.layers.iter().enumerate() {
            let mut segs: Vec<block::Segment> = caches
                .iter_mut()
                .zip(&starts)
                .enumerate()
                .map(|(i, (c, &start))| block::Segment {
                    rows: i..i + 1,
                    start,
                    cache: c.layer_mut(li),
                })
                .collect();
            layer.forward_segments(&mut x, m, &mut segs, &self.ctx(li));
        }
        for c in caches.iter_mut() {
            c.advance(1);
        }
        Ok(tm.time(Stage::Head, || self.logits(&x)))
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `li` and what its blocks need to run.
    pub fn layer(&self, li: usize) -> (&DecoderLayer, Ctx<'_>) {
        (&self.layers[li], self.ctx(li))
    }

    /// Hand the layers to a caller that runs them one at a time and drops each when done (the
    /// quantizer: a finished layer's weights are never needed again, so memory does not grow
    /// with depth). The model keeps its embedding, final norm, head and rotary tables.
    pub fn take_layers(&mut self) -> Vec<DecoderLayer> {
        std::mem::take(&mut self.layers)
    }

    fn ctx(&self, li: usize) -> Ctx<'_> {
        self.ctx_for(self.layers[li].kind)
    }

    /// What a block of a `kind` layer needs to run.
    pub fn ctx_for(&self, kind: LayerType) -> Ctx<'_> {
        Ctx {
            cfg: &self.config,
            kind,
            rope: &self.ropes[&kind],
            timers: &self.timers,
            bf16: self.act_bf16,
        }
    }

    pub fn lm_head(&self) -> &dyn Linear {
        self.lm_head.as_ref()
    }

    /// What one decode step reads from memory besides the KV cache.
    pub fn decode_bytes(&self) -> DecodeBytes {
        let norm = |n: &RmsNorm| std::mem::size_of_val(n.weight()) as u64;
        DecodeBytes {
            linears: self
                .layers
                .iter()
                .flat_map(|l| Proj::ALL.iter().map(|&p| l.linear(p).weight_bytes() as u64))
                .sum(),
            norms: norm(&self.norm)
                + self
                    .layers
                    .iter()
                    .map(|l| norm(&l.input_layernorm) + norm(&l.post_attention_layernorm))
                    .sum::<u64>(),
            // A tied head is the embedding table, read whole; an untied embedding is one row.
            head: self.lm_head.weight_bytes() as u64,
        }
    }

    /// K and V a decode step at `position` reads: every cached row of every layer (a sliding
    /// layer holds at most its window), in this model's cache precision.
    pub fn decode_kv_bytes(&self, position: usize) -> u64 {
        crate::resources::kv_cache_bytes(&self.config, position, self.kv_precision().bytes()) as u64
    }

    /// The final RMSNorm's weight.
    pub fn final_norm_weight(&self) -> &[f32] {
        self.norm.weight()
    }

    /// Final RMSNorm of residual rows (the input of the head).
    pub fn final_norm(&self, x: &[f32]) -> Vec<f32> {
        self.norm.forward(x)
    }

    /// Embedding rows of `tokens` (`[m, hidden]`); no scaling (docs/MODEL.md §4).
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let hidden = self.config.hidden_size;
        let mut x = vec![0f32; tokens.len() * hidden];
        for (i, (&t, row)) in tokens.iter().zip(x.chunks_exact_mut(hidden)).enumerate() {
            let t = t as usize;
            if t >= self.config.vocab_size {
                return Err(ModelError::TokenOutOfRange {
                    id: t as u32,
                    index: i,
                    vocab: self.config.vocab_size,
                });
            }
            self.embedding.read_f32(t * hidden..(t + 1) * hidden, row);
        }
        Ok(x)
    }

    /// Final norm and head for residual rows `x` (`[n, hidden]`).
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        let n = x.len() / self.config.hidden_size;
        let y = self.final_norm(x);
        let mut logits = vec![0f32; n * self.config.vocab_size];
        self.lm_head.forward(&y, n, &mut logits);
        logits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    /// 4 query heads sharing 2 KV heads (head_dim 8), a window of 4.
    fn config(layer_types: &[&str]) -> SparkConfig {
        let mut v = crate::checkpoint::config::tests::real_1_7b_json();
        for (key, value) in [
            ("hidden_size", serde_json::json!(32)),
            ("intermediate_size", 48.into()),
            ("num_hidden_layers", layer_types.len().into()),
            ("num_attention_heads", 4.into()),
            ("head_dim", 8.into()),
            ("vocab_size", 40.into()),
            ("max_position_embeddings", 64.into()),
            ("sliding_window", 4.into()),
            ("layer_types", layer_types.into()),
        ] {
            v[key] = value;
        }
        v["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 0.5.into();
        SparkConfig::from_json_str(&v.to_string(), "test/config.json").unwrap()
    }

    fn random(rng: &mut impl Rng, n: usize, k: usize) -> Box<dyn Linear> {
        let s = 1.0 / (k as f32).sqrt();
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-s..s)).collect();
        Box::new(DenseLinear::new(w.into(), n, k))
    }

    /// Random dense weights and norms: the math needs no checkpoint.
    fn model(layer_types: &[&str], seed: u64) -> SparkModel {
        let cfg = config(layer_types);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let h = cfg.hidden_size;
        let emb: Vec<f32> = (0..cfg.vocab_size * h)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let embedding = DenseWeight::F32(Arc::from(emb));
        let norm = |rng: &mut rand_chacha::ChaCha8Rng| {
            RmsNorm::new(
                (0..h).map(|_| rng.random_range(0.5..1.5)).collect(),
                cfg.rms_norm_eps,
            )
        };
        let layers = cfg
            .layer_types
            .iter()
            .map(|&kind| {
                let input_layernorm = norm(&mut rng);
                let post_attention_layernorm = norm(&mut rng);
                let mut lin = |p: Proj| -> Result<Box<dyn Linear>, CheckpointError> {
                    let [n, k] = p.shape(&cfg);
                    Ok(random(&mut rng, n, k))
                };
                DecoderLayer {
                    kind,
                    input_layernorm,
                    self_attn: SelfAttention::load(&mut lin).unwrap(),
                    post_attention_layernorm,
                    mlp: Mlp::load(&mut lin).unwrap(),
                }
            })
            .collect();
        SparkModel {
            norm: norm(&mut rng),
            lm_head: dense(embedding.clone(), cfg.vocab_size, h),
            embedding,
            layers,
            ropes: cfg.rope.iter().map(|(t, s)| (*t, Rope::new(*s))).collect(),
            timers: StageTimers::default(),
            config: cfg,
            act_bf16: false,
        }
    }

    fn logits(m: &SparkModel, tokens: &[u32]) -> Vec<f32> {
        let mut cache = m.new_cache(tokens.len());
        m.forward(tokens, &mut cache, Logits::All).unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn the_mlp_input_written_into_a_buffer_is_the_returned_one() {
        let m = model(&["full_attention"], 3);
        let (layer, ctx) = m.layer(0);
        let (rows, hidden, inter) = (40, m.config.hidden_size, m.config.intermediate_size);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let x: Vec<f32> = (0..rows * hidden)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        for rows in [1, rows] {
            let x = &x[..rows * hidden];
            // NaN where act_into would leave a value unwritten.
            let mut y = vec![f32::NAN; rows * inter];
            layer.mlp.act_into(x, rows, &ctx, &mut y);
            assert_eq!(y, layer.mlp.act(x, rows, &ctx), "{rows} rows");
        }
    }

    #[test]
    fn a_sliding_layer_forgets_what_left_its_window_and_a_full_layer_does_not() {
        let a: Vec<u32> = (3..11).collect();
        let mut b = a.clone();
        b[0] = 30;
        let v = 40;
        let sliding = model(&["sliding_attention"], 1);
        let (la, lb) = (logits(&sliding, &a), logits(&sliding, &b));
        // Position p sees p-3 ..= p: token 0 still reaches positions 1..=3, then never again.
        for p in 1..4 {
            assert!(max_diff(&la[p * v..(p + 1) * v], &lb[p * v..(p + 1) * v]) > 1e-4);
        }
        for p in 4..8 {
            assert_eq!(
                la[p * v..(p + 1) * v],
                lb[p * v..(p + 1) * v],
                "position {p}"
            );
        }
        let full = model(&["full_attention"], 1);
        let (la, lb) = (logits(&full, &a), logits(&full, &b));
        assert!(max_diff(&la[7 * v..], &lb[7 * v..]) > 1e-4);
    }

    #[test]
    fn the_first_token_attends_to_itself_alone_through_its_kv_head_and_gate() {
        let m = model(&["full_attention"], 2);
        let (layer, ctx) = m.layer(0);
        let cfg = m.config();
        let h: Vec<f32> = (0..cfg.hidden_size)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let mut cache = kv_cache::LayerKvCache::new(
            cfg,
            LayerType::Full,
            4,
            KvPrecision::for_activations(ctx.bf16),
        );
        let a = layer.self_attn.attend(&h, 1, 0, &mut cache, &ctx);
        // softmax over one key is 1: each query head returns its KV head's value, gated.
        let v = layer.self_attn.v_proj.project(&h, 1);
        let g = layer.self_attn.g_proj.project(&h, 1);
        let hd = cfg.head_dim;
        for qh in 0..cfg.num_attention_heads {
            let kvh = qh / cfg.gqa_group();
            for d in 0..hd {
                let want = v[kvh * hd + d] * crate::kernels::sigmoid(g[qh]);
                let got = a[qh * hd + d];
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "head {qh}"
                );
            }
        }
        assert_eq!(cache.len(), 1, "this call's K/V were appended");
    }

    #[test]
    fn chunked_calls_and_last_row_logits_match_one_call() {
        let m = model(&["sliding_attention", "full_attention"], 3);
        let tokens: Vec<u32> = (0..12).map(|i| (i * 7 % 40) as u32).collect();
        let one = logits(&m, &tokens);
        let mut cache = m.new_cache(tokens.len());
        let mut chunked = Vec::new();
        for c in [&tokens[..5], &tokens[5..6], &tokens[6..]] {
            chunked.extend(m.forward(c, &mut cache, Logits::All).unwrap());
        }
        // Different row counts may take different matmul kernels: same math, other sum order.
        assert!(
            max_diff(&one, &chunked) < 1e-4,
            "{}",
            max_diff(&one, &chunked)
        );
        let mut cache = m.new_cache(tokens.len());
        let last = m.forward(&tokens, &mut cache, Logits::Last).unwrap();
        assert!(max_diff(&last, &one[11 * 40..]) < 1e-4);
        assert_eq!(cache.pos(), 12);
    }

    #[test]
    fn the_calibration_forward_is_each_windows_forward_on_what_its_taps_installed() {
        use block::{Site, WindowShape};
        // Three windows of 7 tokens (past the sliding window of 4), the MLP 5 rows at a time.
        let types = ["sliding_attention", "full_attention"];
        let (mut m, mut reference) = (model(&types, 5), model(&types, 5));
        let halved = |l: &dyn Linear| {
            let w: Vec<f32> = l.dequantize().iter().map(|v| v * 0.5).collect();
            Box::new(DenseLinear::new(
                w.into(),
                l.out_features(),
                l.in_features(),
            ))
        };
        let shape = WindowShape {
            samples: 3,
            seq_len: 7,
            bf16_inputs: false,
            mlp_rows: 5,
        };
        let tokens: Vec<u32> = (0..21).map(|i| (i * 11 % 40) as u32).collect();
        let mut x = m.embed(&tokens).unwrap();
        for (li, mut layer) in m.take_layers().into_iter().enumerate() {
            let ctx = m.ctx_for(layer.kind);
            let mut seen = Vec::new();
            layer
                .forward_windows(&mut x, &shape, &ctx, |layer, tap| {
                    let k = tap.site.projs()[0].shape(&m.config)[1];
                    assert_eq!(tap.input.len(), 21 * k, "{:?}", tap.site);
                    assert_eq!(tap.stream.len(), 21 * 32);
                    if li == 1 && tap.site == Site::Out {
                        layer.set_linear(Proj::Out, halved(layer.linear(Proj::Out)));
                    }
                    seen.push(tap.site);
                    Ok::<(), ()>(())
                })
                .unwrap();
            assert_eq!(seen, [Site::Qkv, Site::Out, Site::GateUp, Site::Down]);
        }
        let out = &mut reference.layers[1].self_attn.out_proj;
        *out = halved(out.as_ref());
        let got = m.logits(&x);
        for (w, window) in tokens.chunks(7).enumerate() {
            let want = logits(&reference, window);
            let d = max_diff(&got[w * 7 * 40..(w + 1) * 7 * 40], &want);
            // Other row counts may take other matmul kernels: same math, other sum order.
            assert!(d < 1e-4, "window {w}: {d}");
        }
        // The replacement took effect: the unmodified model gives other logits.
        let plain = logits(&model(&types, 5), &tokens[..7]);
        assert!(max_diff(&got[..7 * 40], &plain) > 1e-2);
    }

    #[test]
    fn a_step_of_several_sequences_is_each_sequence_stepped_alone() {
        // Three sequences at different positions (one past the sliding window of 4): one
        // batched step must give each the logits and the cache its own decode step gives.
        let m = model(&["sliding_attention", "full_attention"], 5);
        let prompts: [Vec<u32>; 3] = [vec![1, 2, 3], (0..9).collect(), vec![7]];
        let next = [11u32, 12, 13];
        let prefill = |p: &[u32]| {
            let mut c = m.new_cache(16);
            m.forward(p, &mut c, Logits::Last).unwrap();
            c
        };
        let mut batch: Vec<KvCache> = prompts.iter().map(|p| prefill(p)).collect();
        let mut refs: Vec<&mut KvCache> = batch.iter_mut().collect();
        let many = m.forward_many(&next, &mut refs).unwrap();
        assert_eq!(many.len(), 3 * 40);
        for (i, p) in prompts.iter().enumerate() {
            let mut alone = prefill(p);
            let one = m
                .forward(&next[i..i + 1], &mut alone, Logits::Last)
                .unwrap();
            let row = &many[i * 40..(i + 1) * 40];
            // Three rows may take another matmul kernel than one: same math, other sum order.
            assert!(
                max_diff(&one, row) < 1e-4,
                "sequence {i}: {}",
                max_diff(&one, row)
            );
            assert_eq!(batch[i].pos(), alone.pos());
            // The next step of each still agrees: the batched step appended the right K/V.
            let a = m.forward(&[5], &mut batch[i], Logits::Last).unwrap();
            let b = m.forward(&[5], &mut alone, Logits::Last).unwrap();
            assert!(max_diff(&a, &b) < 1e-4, "after, sequence {i}");
        }
        // A full cache is refused before anything runs.
        let mut full = m.new_cache(1);
        m.forward(&[1], &mut full, Logits::Last).unwrap();
        let mut ok = prefill(&[1]);
        assert!(m.forward_many(&[2, 3], &mut [&mut ok, &mut full]).is_err());
        assert_eq!(ok.pos(), 1);
    }

    #[test]
    fn bad_token_and_empty_input_are_errors() {
        let m = model(&["full_attention"], 4);
        let mut cache = m.new_cache(4);
        assert!(matches!(
            m.forward(&[], &mut cache, Logits::All),
            Err(ModelError::Empty)
        ));
        match m.forward(&[1, 40], &mut cache, Logits::All) {
            Err(ModelError::TokenOutOfRange { id, index, vocab }) => {
                assert_eq!((id, index, vocab), (40, 1, 40))
            }
            other => panic!("{:?}", other.err()),
        }
        assert_eq!(cache.pos(), 0, "a refused call leaves the cache untouched");
    }
}
