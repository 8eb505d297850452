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

pub mod kv_cache;
pub mod linear;
pub mod profile;
pub mod quantized;
pub mod rope;

use rayon::prelude::*;
use std::collections::BTreeMap;

use crate::checkpoint::layout::layer_prefix;
use crate::checkpoint::{Checkpoint, CheckpointError, LayerType, SparkConfig};
use crate::kernels::{self, gelu_erf, rms_norm, sigmoid};
pub use kv_cache::{CacheError, KvCache};
pub use linear::{DenseLinear, DenseWeight, Linear};
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

struct SelfAttention {
    q_proj: Box<dyn Linear>,
    k_proj: Box<dyn Linear>,
    v_proj: Box<dyn Linear>,
    g_proj: Box<dyn Linear>,
    out_proj: Box<dyn Linear>,
}

struct Mlp {
    gate_proj: Box<dyn Linear>,
    up_proj: Box<dyn Linear>,
    down_proj: Box<dyn Linear>,
}

struct DecoderLayer {
    kind: LayerType,
    input_layernorm: Vec<f32>,
    self_attn: SelfAttention,
    post_attention_layernorm: Vec<f32>,
    mlp: Mlp,
}

pub struct SparkModel {
    config: SparkConfig,
    embedding: DenseWeight,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    lm_head: Box<dyn Linear>,
    ropes: BTreeMap<LayerType, Rope>,
    timers: StageTimers,
}

fn dense(w: DenseWeight, out: usize, inp: usize) -> Box<dyn Linear> {
    Box::new(DenseLinear::from_weight(w, out, inp))
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
/// does, for dense and GPTQ linears alike. (The W4A8 recipe's own rounding of its input and
/// output is part of that kernel; rounding a bf16 value again changes nothing.)
struct Bf16Act(Box<dyn Linear>);

impl Linear for Bf16Act {
    fn in_features(&self) -> usize {
        self.0.in_features()
    }
    fn out_features(&self) -> usize {
        self.0.out_features()
    }
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        let xr: Vec<f32> = x.iter().map(|v| kernels::w4::round_bf16(*v)).collect();
        self.0.forward(&xr, m, y);
        y.iter_mut().for_each(|v| *v = kernels::w4::round_bf16(*v));
    }
    fn kind(&self) -> String {
        format!("{} (bf16 activations)", self.0.kind())
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
            let t = |n: &str| ck.tensor_f32(&format!("{p}{n}"));
            let lins = Proj::ALL
                .iter()
                .map(|&proj| {
                    let (prefix, rows) = proj.stored_at(i, ck.layout.qkv[i], &cfg);
                    let [n, k] = proj.shape(&cfg);
                    lin(prefix, rows, n, k)
                })
                .collect::<Result<Vec<_>, _>>()?;
            // Proj::ALL's order.
            let [q_proj, k_proj, v_proj, g_proj, out_proj, gate_proj, up_proj, down_proj]: [Box<
                dyn Linear,
            >;
                8] = lins.try_into().ok().expect("one linear per projection");
            layers.push(DecoderLayer {
                kind: *kind,
                input_layernorm: t("input_layernorm.weight")?,
                self_attn: SelfAttention {
                    q_proj,
                    k_proj,
                    v_proj,
                    g_proj,
                    out_proj,
                },
                post_attention_layernorm: t("post_attention_layernorm.weight")?,
                mlp: Mlp {
                    gate_proj,
                    up_proj,
                    down_proj,
                },
            });
            bar.inc(1);
        }
        let norm = ck.tensor_f32("model.norm.weight")?;
        let lm_head: Box<dyn Linear> = if ck.layout.tied {
            wrap(dense(embedding.clone(), cfg.vocab_size, h))
        } else {
            lin("lm_head".into(), None, cfg.vocab_size, h)?
        };
        bar.inc(1);
        bar.finish_and_clear();
        let ropes = cfg.rope.iter().map(|(t, s)| (*t, Rope::new(*s))).collect();
        Ok(SparkModel {
            config: cfg,
            embedding,
            layers,
            norm,
            lm_head,
            ropes,
            timers: StageTimers::default(),
        })
    }

    pub fn config(&self) -> &SparkConfig {
        &self.config
    }

    /// Per-stage timers of the forward pass (off until enabled).
    pub fn stage_timers(&self) -> &StageTimers {
        &self.timers
    }

    pub fn new_cache(&self, context: usize) -> KvCache {
        KvCache::new(&self.config, context)
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
        let start = cache.pos();
        let tm = &self.timers;
        let t = tm.start();
        let mut x = self.embed(tokens)?;
        tm.stop(Stage::Embed, t);
        for li in 0..self.layers.len() {
            let t = tm.start();
            let h = self.attn_norm(li, &x);
            tm.stop(Stage::Norms, t);
            let attn = self.gated_attention(li, &h, m, start, cache.layer_mut(li));
            self.attn_out_residual(li, &attn, m, &mut x);
            let t = tm.start();
            let h2 = self.mlp_norm(li, &x);
            tm.stop(Stage::Norms, t);
            let act = self.mlp_act(li, &h2, m);
            self.mlp_down_residual(li, &act, m, &mut x);
        }
        cache.advance(m);
        let hidden = self.config.hidden_size;
        let rows = match want {
            Logits::All => 0,
            Logits::Last => m - 1,
        };
        let t = tm.start();
        let logits = self.logits(&x[rows * hidden..]);
        tm.stop(Stage::Head, t);
        Ok(logits)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn linear(&self, layer: usize, proj: Proj) -> &dyn Linear {
        let l = &self.layers[layer];
        match proj {
            Proj::Q => l.self_attn.q_proj.as_ref(),
            Proj::K => l.self_attn.k_proj.as_ref(),
            Proj::V => l.self_attn.v_proj.as_ref(),
            Proj::G => l.self_attn.g_proj.as_ref(),
            Proj::Out => l.self_attn.out_proj.as_ref(),
            Proj::Gate => l.mlp.gate_proj.as_ref(),
            Proj::Up => l.mlp.up_proj.as_ref(),
            Proj::Down => l.mlp.down_proj.as_ref(),
        }
    }

    pub fn lm_head(&self) -> &dyn Linear {
        self.lm_head.as_ref()
    }

    /// Final RMSNorm of residual rows (the input of the head).
    pub fn final_norm(&self, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0f32; x.len()];
        rms_norm(x, &self.norm, self.config.rms_norm_eps, &mut y);
        y
    }

    /// Replace one projection (e.g. by its quantized version).
    pub fn set_linear(&mut self, layer: usize, proj: Proj, linear: Box<dyn Linear>) {
        let l = &mut self.layers[layer];
        let slot = match proj {
            Proj::Q => &mut l.self_attn.q_proj,
            Proj::K => &mut l.self_attn.k_proj,
            Proj::V => &mut l.self_attn.v_proj,
            Proj::G => &mut l.self_attn.g_proj,
            Proj::Out => &mut l.self_attn.out_proj,
            Proj::Gate => &mut l.mlp.gate_proj,
            Proj::Up => &mut l.mlp.up_proj,
            Proj::Down => &mut l.mlp.down_proj,
        };
        assert_eq!(
            (slot.in_features(), slot.out_features()),
            (linear.in_features(), linear.out_features()),
            "replacement linear must keep the shape"
        );
        *slot = linear;
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

    /// `input_layernorm`: the input of q/k/v and of the gate projection.
    pub fn attn_norm(&self, li: usize, x: &[f32]) -> Vec<f32> {
        let mut h = vec![0f32; x.len()];
        rms_norm(
            x,
            &self.layers[li].input_layernorm,
            self.config.rms_norm_eps,
            &mut h,
        );
        h
    }

    /// q/k/v/g projections, RoPE, attention over `cache` + these `m` tokens at
    /// positions `start..`, per-head sigmoid gate. Appends K/V to `cache`.
    /// Returns the gated attention output `[m, q_dim]` (the input of `out_proj`).
    pub fn gated_attention(
        &self,
        li: usize,
        h: &[f32],
        m: usize,
        start: usize,
        cache: &mut kv_cache::LayerKvCache,
    ) -> Vec<f32> {
        let cfg = &self.config;
        let layer = &self.layers[li];
        let sa = &layer.self_attn;
        let (hd, q_dim, kv_dim, heads) = (
            cfg.head_dim,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.num_attention_heads,
        );
        let mut q = vec![0f32; m * q_dim];
        let mut k = vec![0f32; m * kv_dim];
        let mut v = vec![0f32; m * kv_dim];
        let mut g = vec![0f32; m * heads];
        let t = self.timers.start();
        sa.q_proj.forward(h, m, &mut q);
        sa.k_proj.forward(h, m, &mut k);
        sa.v_proj.forward(h, m, &mut v);
        sa.g_proj.forward(h, m, &mut g);
        self.timers.stop(Stage::QkvgProj, t);
        let t = self.timers.start();

        let rope = &self.ropes[&layer.kind];
        for i in 0..m {
            let (cos, sin) = rope.angles(start + i);
            for head in q[i * q_dim..(i + 1) * q_dim].chunks_exact_mut(hd) {
                rope.apply(head, &cos, &sin);
            }
            for head in k[i * kv_dim..(i + 1) * kv_dim].chunks_exact_mut(hd) {
                rope.apply(head, &cos, &sin);
            }
        }
        let mut attn = vec![0f32; m * q_dim];
        self.attention(layer.kind, &q, &k, &v, start, cache, &mut attn);
        for (i, row) in attn.chunks_exact_mut(q_dim).enumerate() {
            for (hh, head) in row.chunks_exact_mut(hd).enumerate() {
                let s = sigmoid(g[i * heads + hh]);
                head.iter_mut().for_each(|a| *a *= s);
            }
        }
        cache.append(&k, &v);
        self.timers.stop(Stage::Attention, t);
        attn
    }

    /// `x += out_proj(attn)`.
    pub fn attn_out_residual(&self, li: usize, attn: &[f32], m: usize, x: &mut [f32]) {
        let mut delta = vec![0f32; x.len()];
        let t = self.timers.start();
        self.layers[li]
            .self_attn
            .out_proj
            .forward(attn, m, &mut delta);
        self.timers.stop(Stage::OutProj, t);
        let t = self.timers.start();
        x.iter_mut().zip(&delta).for_each(|(a, d)| *a += d);
        self.timers.stop(Stage::Norms, t);
    }

    /// `post_attention_layernorm`: the input of gate/up.
    pub fn mlp_norm(&self, li: usize, x: &[f32]) -> Vec<f32> {
        let mut h = vec![0f32; x.len()];
        rms_norm(
            x,
            &self.layers[li].post_attention_layernorm,
            self.config.rms_norm_eps,
            &mut h,
        );
        h
    }

    /// `gelu_erf(gate(h2)) ⊙ up(h2)`: the input of `down_proj`.
    pub fn mlp_act(&self, li: usize, h2: &[f32], m: usize) -> Vec<f32> {
        let mlp = &self.layers[li].mlp;
        let inter = self.config.intermediate_size;
        let mut gate = vec![0f32; m * inter];
        let mut up = vec![0f32; m * inter];
        let t = self.timers.start();
        mlp.gate_proj.forward(h2, m, &mut gate);
        mlp.up_proj.forward(h2, m, &mut up);
        self.timers.stop(Stage::GateUpProj, t);
        let t = self.timers.start();
        // erf is the costly part of prefill outside the matmuls: spread it
        // when there is enough of it (decode's one row stays on this thread).
        const CHUNK: usize = 1 << 14;
        if gate.len() >= 2 * CHUNK {
            gate.par_chunks_mut(CHUNK)
                .zip(up.par_chunks(CHUNK))
                .for_each(|(g, u)| g.iter_mut().zip(u).for_each(|(a, u)| *a = gelu_erf(*a) * u));
        } else {
            gate.iter_mut()
                .zip(&up)
                .for_each(|(a, u)| *a = gelu_erf(*a) * u);
        }
        self.timers.stop(Stage::GeluMul, t);
        gate
    }

    /// `x += down_proj(act)`.
    pub fn mlp_down_residual(&self, li: usize, act: &[f32], m: usize, x: &mut [f32]) {
        let mut delta = vec![0f32; x.len()];
        let t = self.timers.start();
        self.layers[li].mlp.down_proj.forward(act, m, &mut delta);
        self.timers.stop(Stage::DownProj, t);
        let t = self.timers.start();
        x.iter_mut().zip(&delta).for_each(|(a, d)| *a += d);
        self.timers.stop(Stage::Norms, t);
    }

    /// Final norm and head for residual rows `x` (`[n, hidden]`).
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        let n = x.len() / self.config.hidden_size;
        let y = self.final_norm(x);
        let mut logits = vec![0f32; n * self.config.vocab_size];
        self.lm_head.forward(&y, n, &mut logits);
        logits
    }

    /// Causal attention for `m` new queries at positions `start..start+m`.
    /// Keys before `start` come from the cache, the rest from this call's
    /// `k`/`v`; sliding layers see the last `sliding_window` positions
    /// including the query's own.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        kind: LayerType,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        start: usize,
        cache: &kv_cache::LayerKvCache,
        out: &mut [f32],
    ) {
        let cfg = &self.config;
        let (hd, q_dim, kv_dim, group) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim(), cfg.gqa_group());
        let scale = 1.0 / (hd as f32).sqrt();
        let window = cfg.sliding_window;
        let key = |pos: usize| -> &[f32] {
            if pos >= start {
                &k[(pos - start) * kv_dim..(pos - start + 1) * kv_dim]
            } else {
                cache.key(pos)
            }
        };
        let value = |pos: usize| -> &[f32] {
            if pos >= start {
                &v[(pos - start) * kv_dim..(pos - start + 1) * kv_dim]
            } else {
                cache.value(pos)
            }
        };
        // One job per (query row, KV head): the `group` query heads sharing a
        // KV head stream its keys and values once, and decode (one row) still
        // spreads over the KV heads. Per query head the arithmetic and its
        // order are those of a plain per-head loop.
        let kv_heads = kv_dim / hd;
        out.par_chunks_mut(group * hd)
            .enumerate()
            .for_each(|(c, out_g)| {
                let (i, kvh) = (c / kv_heads, c % kv_heads);
                let p = start + i;
                let lo = match kind {
                    LayerType::Sliding => (p + 1).saturating_sub(window),
                    LayerType::Full => 0,
                };
                let kvo = kvh * hd;
                let q0 = i * q_dim + kvh * group * hd;
                kernels::attention::attend(
                    &q[q0..q0 + group * hd],
                    |pos| &key(pos)[kvo..kvo + hd],
                    |pos| &value(pos)[kvo..kvo + hd],
                    lo,
                    p,
                    hd,
                    scale,
                    &mut Vec::new(),
                    out_g,
                );
            });
    }
}
