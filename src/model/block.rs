//! The blocks of a decoder layer, each owning its weights and its forward, named after the HF
//! modules (`model.layers.{i}.self_attn.*`, `.mlp.*`; docs/MODEL.md §3–4). The quantizer runs
//! the layer's calibration forward ([`DecoderLayer::forward_windows`]), which stops at a tap
//! before each group of linears, so what it calibrates on is exactly what the forward computes.

use half::bf16;
use rayon::prelude::*;

use super::kv_cache::{KvRows, LayerKvCache, Rows};
use super::profile::{Stage, StageTimers};
use super::rope::Rope;
use super::Linear;
use crate::checkpoint::{CheckpointError, LayerType, Proj, SparkConfig};
use crate::kernels::attention::{KvBits, RowsScratch, BLOCK_ROWS};
use crate::kernels::convert::KvElem;
use crate::kernels::par::ColumnsOut;
use crate::kernels::w4a8::PackedW4A8;
use crate::kernels::{self, gelu::gelu_mul, rms_norm, sigmoid};

/// What a block needs besides its weights: the shapes, its layer type and rotary table, and the
/// stage timers of `bench --stages`.
#[derive(Clone, Copy)]
pub struct Ctx<'a> {
    pub cfg: &'a SparkConfig,
    pub kind: LayerType,
    pub rope: &'a Rope,
    pub timers: &'a StageTimers,
    /// Activations are bf16 values (a GPTQ artifact, or `--act-dtype bf16`): attention takes
    /// bf16 operands as a bf16 model does ([`kernels::attention::Heads`]).
    pub bf16: bool,
}

pub struct RmsNorm {
    weight: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    pub fn new(weight: Vec<f32>, eps: f32) -> Self {
        RmsNorm { weight, eps }
    }

    pub fn weight(&self) -> &[f32] {
        &self.weight
    }

    /// Replace the weight (block tuning's gains) by one of the same length.
    pub fn set_weight(&mut self, weight: Vec<f32>) {
        assert_eq!(weight.len(), self.weight.len(), "a norm keeps its width");
        self.weight = weight;
    }

    /// `x / rms(x) · weight` per row.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0f32; x.len()];
        rms_norm(x, &self.weight, self.eps, &mut y);
        y
    }
}

/// `x += delta` (a prefill's rows over the threads).
pub fn residual_add(x: &mut [f32], delta: &[f32]) {
    const CHUNK: usize = 1 << 15;
    if x.len() >= 2 * CHUNK {
        x.par_chunks_mut(CHUNK)
            .zip(delta.par_chunks(CHUNK))
            .for_each(|(x, d)| x.iter_mut().zip(d).for_each(|(a, d)| *a += d));
    } else {
        x.iter_mut().zip(delta).for_each(|(a, d)| *a += d);
    }
}

/// Gated attention: `a = attention(RoPE(h·Wqᵀ), RoPE(h·Wkᵀ), h·Wvᵀ) ⊙ sigmoid(h·Wgᵀ)` per head,
/// then `a·Woᵀ`.
pub struct SelfAttention {
    pub q_proj: Box<dyn Linear>,
    pub k_proj: Box<dyn Linear>,
    pub v_proj: Box<dyn Linear>,
    pub g_proj: Box<dyn Linear>,
    pub out_proj: Box<dyn Linear>,
}

impl SelfAttention {
    pub fn load(
        mut lin: impl FnMut(Proj) -> Result<Box<dyn Linear>, CheckpointError>,
    ) -> Result<Self, CheckpointError> {
        Ok(SelfAttention {
            q_proj: lin(Proj::Q)?,
            k_proj: lin(Proj::K)?,
            v_proj: lin(Proj::V)?,
            g_proj: lin(Proj::G)?,
            out_proj: lin(Proj::Out)?,
        })
    }

    /// `out_proj(attend(h))` for `m` rows at positions `start..`.
    pub fn forward(
        &self,
        h: &[f32],
        m: usize,
        start: usize,
        cache: &mut LayerKvCache,
        ctx: &Ctx,
    ) -> Vec<f32> {
        let a = self.attend(h, m, start, cache, ctx);
        ctx.timers
            .time(Stage::OutProj, || self.out_proj.project(&a, m))
    }

    /// [`Self::forward`] for rows of several sequences ([`Self::attend_segments`]).
    pub fn forward_segments(
        &self,
        h: &[f32],
        m: usize,
        segs: &mut [Segment<'_>],
        ctx: &Ctx,
    ) -> Vec<f32> {
        let a = self.attend_segments(h, m, segs, ctx);
        ctx.timers
            .time(Stage::OutProj, || self.out_proj.project(&a, m))
    }

    /// Everything before `out_proj`: the gated attention output `[m, q_dim]` of the normed rows
    /// `h` at positions `start..`, over `cache` and these rows. Appends their K/V to `cache`.
    pub fn attend(
        &self,
        h: &[f32],
        m: usize,
        start: usize,
        cache: &mut LayerKvCache,
        ctx: &Ctx,
    ) -> Vec<f32> {
        self.attend_segments(
            h,
            m,
            &mut [Segment {
                rows: 0..m,
                start,
                cache,
            }],
            ctx,
        )
    }

    /// [`Self::attend`] for rows of several sequences at once: the projections run over all `m`
    /// rows together (each weight read once), then each segment's rows are rotated at its own
    /// positions and attend over its own cache, to which they are appended.
    pub fn attend_segments(
        &self,
        h: &[f32],
        m: usize,
        segs: &mut [Segment<'_>],
        ctx: &Ctx,
    ) -> Vec<f32> {
        let cfg = ctx.cfg;
        let (hd, q_dim, kv_dim, heads) = (
            cfg.head_dim,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.num_attention_heads,
        );
        // q, k, v, g = h·W{q,k,v,g}ᵀ; three W4A8 linears of a prefill share the quantized rows.
        let [mut q, mut k, v, g] = ctx.timers.time(Stage::QkvgProj, || {
            let qkv = [&self.q_proj, &self.k_proj, &self.v_proj];
            if let ([Some(wq), Some(wk), Some(wv)], true) =
                (qkv.map(|l| l.w4a8_rounding(false)), m > 1)
            {
                let [mut q, mut k, mut v] = qkv.map(|l| vec![0f32; m * l.out_features()]);
                PackedW4A8::matmul_rounding_shared(
                    &[wq, wk, wv],
                    h,
                    m,
                    &mut [&mut q, &mut k, &mut v],
                );
                return [q, k, v, self.g_proj.project(h, m)];
            }
            [&self.q_proj, &self.k_proj, &self.v_proj, &self.g_proj].map(|l| l.project(h, m))
        });
        ctx.timers.time(Stage::Attention, || {
            let mut a = vec![0f32; m * q_dim];
            for seg in segs.iter_mut() {
                let r = seg.rows.clone();
                // q, k = RoPE(q, k) at each row's position (a bf16 model's rotated q and k are
                // bf16, so is the cache it keeps); rows in parallel for a prefill.
                let (rope, bf16, start) = (ctx.rope, ctx.bf16, seg.start);
                let rotate = |(j, (qr, kr)): (usize, (&mut [f32], &mut [f32]))| {
                    let (cos, sin) = rope.angles(start + j);
                    for head in qr.chunks_exact_mut(hd).chain(kr.chunks_exact_mut(hd)) {
                        rope.apply(head, &cos, &sin);
                    }
                    if bf16 {
                        kernels::convert::round_bf16_in_place(qr);
                        kernels::convert::round_bf16_in_place(kr);
                    }
                };
                let (qs, ks) = (
                    &mut q[r.start * q_dim..r.end * q_dim],
                    &mut k[r.start * kv_dim..r.end * kv_dim],
                );
                if r.len() >= BLOCKED_MIN_ROWS {
                    qs.par_chunks_mut(q_dim)
                        .zip(ks.par_chunks_mut(kv_dim))
                        .enumerate()
                        .for_each(rotate);
                } else {
                    qs.chunks_mut(q_dim)
                        .zip(ks.chunks_mut(kv_dim))
                        .enumerate()
                        .for_each(rotate);
                }
                // a = softmax(q·kᵀ/√d over the visible keys)·v
                let (qs, ks, vs) = (
                    &q[r.start * q_dim..r.end * q_dim],
                    &k[r.start * kv_dim..r.end * kv_dim],
                    &v[r.start * kv_dim..r.end * kv_dim],
                );
                attention(
                    ctx,
                    qs,
                    ks,
                    vs,
                    seg.start,
                    seg.cache,
                    &mut a[r.start * q_dim..r.end * q_dim],
                );
            }
            // a_head *= sigmoid(g_head)
            let gate = |(row, g): (&mut [f32], &[f32])| {
                for (head, g) in row.chunks_exact_mut(hd).zip(g) {
                    let s = sigmoid(*g);
                    head.iter_mut().for_each(|x| *x *= s);
                }
            };
            if m >= BLOCKED_MIN_ROWS {
                a.par_chunks_mut(q_dim)
                    .zip(g.par_chunks(heads))
                    .for_each(gate);
            } else {
                a.chunks_mut(q_dim).zip(g.chunks(heads)).for_each(gate);
            }
            a
        })
    }
}

/// Rows `rows` of a multi-sequence step belong to one sequence: they sit at positions `start..`
/// and attend over `cache`.
pub struct Segment<'c> {
    pub rows: std::ops::Range<usize>,
    pub start: usize,
    pub cache: &'c mut LayerKvCache,
}

/// From this many query rows on, attention runs block by block as GEMMs
/// ([`kernels::attention::attend_rows`]).
pub const BLOCKED_MIN_ROWS: usize = 16;

/// Causal attention for `m` new queries at positions `start..start+m`. Keys before `start` come
/// from the cache, the rest from this call's `k`/`v`, which are then appended to the cache (only
/// then: a sliding ring must not drop a key a query of this call still needs); sliding layers
/// see the last `sliding_window` positions including the query's own.
fn attention(
    ctx: &Ctx,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    start: usize,
    cache: &mut LayerKvCache,
    out: &mut [f32],
) {
    let converted: Option<(Vec<bf16>, Vec<bf16>)> = match cache.rows() {
        KvRows::F32(rows) => {
            attention_over(ctx, q, k, v, start, rows, out);
            None
        }
        KvRows::Bf16(rows) => {
            // A bf16 cache holds bf16 values (ctx.bf16): this call's rows are such values too,
            // converted once for the attention and the append.
            debug_assert!(ctx.bf16, "a bf16 KV cache under f32 activations");
            let (k, v) = (kernels::convert::stored(k), kernels::convert::stored(v));
            attention_over(ctx, q, &k, &v, start, rows, out);
            Some((k, v))
        }
    };
    match converted {
        Some((k, v)) => cache.append(&k, &v),
        None => cache.append(k, v),
    }
}

/// [`attention`] over keys and values stored as `T`.
fn attention_over<T: KvElem>(
    ctx: &Ctx,
    q: &[f32],
    k: &[T],
    v: &[T],
    start: usize,
    cache: Rows<'_, T>,
    out: &mut [f32],
) {
    let cfg = ctx.cfg;
    let (hd, q_dim, kv_dim, group) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim(), cfg.gqa_group());
    let heads = kernels::attention::Heads {
        dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        bf16: ctx.bf16,
    };
    let window = cfg.sliding_window;
    let kind = ctx.kind;
    // KV head h's row at `pos`: this call's rows are `[m, kv_dim]`, the cache's per head.
    let key = |pos: usize, h: usize| -> &[T] {
        if pos >= start {
            let o = (pos - start) * kv_dim + h * hd;
            &k[o..o + hd]
        } else {
            cache.key(pos, h)
        }
    };
    let value = |pos: usize, h: usize| -> &[T] {
        if pos >= start {
            let o = (pos - start) * kv_dim + h * hd;
            &v[o..o + hd]
        } else {
            cache.value(pos, h)
        }
    };
    let kv_heads = kv_dim / hd;
    let lo_of = |i: usize| match kind {
        LayerType::Sliding => (start + i + 1).saturating_sub(window),
        LayerType::Full => 0,
    };
    let m = q.len() / q_dim;
    if m >= BLOCKED_MIN_ROWS {
        // Prefill: one job per (block of query rows, KV head), scores and outputs as GEMMs.
        // Largest blocks (latest rows, most keys) first.
        let blocks = m.div_ceil(BLOCK_ROWS);
        let dst = ColumnsOut::new(out, m, q_dim);
        // bf16 operands: every KV head's keys and values as bits once, for all of its blocks.
        let bits: Vec<KvBits> = if heads.bf16 && kernels::attention::bf16_rows_run() {
            (0..kv_heads)
                .into_par_iter()
                .map(|h| {
                    KvBits::gather(|p| key(p, h), |p| value(p, h), lo_of(0)..=start + m - 1, hd)
                })
                .collect()
        } else {
            Vec::new()
        };
        (0..blocks * kv_heads).into_par_iter().rev().for_each_init(
            || (RowsScratch::default(), Vec::new(), Vec::new()),
            |(scratch, qb, ob), job| {
                let (b, kvh) = (job / kv_heads, job % kv_heads);
                let (r0, cols) = (b * BLOCK_ROWS, kvh * group * hd..(kvh + 1) * group * hd);
                let rows = (m - r0).min(BLOCK_ROWS);
                qb.clear();
                for i in r0..r0 + rows {
                    qb.extend_from_slice(&q[i * q_dim + cols.start..i * q_dim + cols.end]);
                }
                ob.resize(qb.len(), 0.0);
                let lo = |r| lo_of(r0 + r);
                let p0 = start + r0;
                let done = bits.get(kvh).is_some_and(|kv| {
                    kernels::attention::attend_rows_bf16(qb, rows, kv, (lo, p0), heads, scratch, ob)
                });
                if !done {
                    kernels::attention::attend_rows(
                        qb,
                        rows,
                        (|pos| key(pos, kvh), |pos| value(pos, kvh)),
                        (lo, p0),
                        heads,
                        scratch,
                        ob,
                    );
                }
                for (r, o) in ob.chunks_exact(group * hd).enumerate() {
                    // SAFETY: this job alone writes rows r0.. of KV head kvh's query columns.
                    unsafe { dst.row_mut(r0 + r, cols.clone()) }.copy_from_slice(o);
                }
            },
        );
        return;
    }
    // Decode and short calls: one job per (query row, KV head): the `group` query heads sharing
    // a KV head stream its keys and values once, and decode (one row) still spreads over the KV
    // heads (`kernels::attention`: the same math on every tier, sums in another order on AVX-512).
    let dst = ColumnsOut::new(out, m, q_dim);
    kernels::par::for_each(m * kv_heads, |c| {
        let (i, kvh) = (c / kv_heads, c % kv_heads);
        // SAFETY: job c alone writes row i's query columns of KV head kvh.
        let out_g = unsafe { dst.row_mut(i, kvh * group * hd..(kvh + 1) * group * hd) };
        let (p, lo) = (start + i, lo_of(i));
        let q0 = i * q_dim + kvh * group * hd;
        let kv = kernels::attention::Window {
            key: |pos| key(pos, kvh),
            value: |pos| value(pos, kvh),
            lo,
            hi: p,
        };
        kernels::attention::attend(&q[q0..q0 + group * hd], &kv, heads, &mut Vec::new(), out_g);
    });
}

/// `down_proj(gelu(gate_proj(h)) ⊙ up_proj(h))`, GELU with erf.
pub struct Mlp {
    pub gate_proj: Box<dyn Linear>,
    pub up_proj: Box<dyn Linear>,
    pub down_proj: Box<dyn Linear>,
}

impl Mlp {
    pub fn load(
        mut lin: impl FnMut(Proj) -> Result<Box<dyn Linear>, CheckpointError>,
    ) -> Result<Self, CheckpointError> {
        Ok(Mlp {
            gate_proj: lin(Proj::Gate)?,
            up_proj: lin(Proj::Up)?,
            down_proj: lin(Proj::Down)?,
        })
    }

    pub fn forward(&self, h: &[f32], m: usize, ctx: &Ctx) -> Vec<f32> {
        let act = self.act(h, m, ctx);
        let d = ctx
            .timers
            .time(Stage::DownProj, || self.down_proj.project(&act, m));
        crate::resources::keep_spare(act);
        d
    }

    /// `gelu(gate_proj(h)) ⊙ up_proj(h)`: the input of `down_proj`.
    pub fn act(&self, h: &[f32], m: usize, ctx: &Ctx) -> Vec<f32> {
        let len = m * self.gate_proj.out_features();
        // Written in full by the fused kernel: the last layer's buffer will do.
        let mut y = match self.fused_w4a8(m) {
            Some(_) => crate::resources::spare(len),
            None => vec![0f32; len],
        };
        self.act_into(h, m, ctx, &mut y);
        y
    }

    /// [`Self::act`] into `y` (`[m, intermediate]`): no buffer of its own for the result, which
    /// the calibration forward of `quantize` gathers from blocks of rows.
    pub fn act_into(&self, h: &[f32], m: usize, ctx: &Ctx, y: &mut [f32]) {
        // Two W4A8 linears of a prefill: one fused pass (same bits), timed as the projections.
        if let Some((gate, up)) = self.fused_w4a8(m) {
            return ctx.timers.time(Stage::GateUpProj, || {
                PackedW4A8::gelu_mul_rounding(gate, up, h, m, y)
            });
        }
        let up = ctx.timers.time(Stage::GateUpProj, || {
            self.gate_proj.forward(h, m, y);
            self.up_proj.project(h, m)
        });
        ctx.timers.time(Stage::GeluMul, || {
            // Spread a prefill's rows over the threads when there are enough of them (decode's
            // one row stays on this thread).
            const CHUNK: usize = 1 << 14;
            if y.len() >= 2 * CHUNK {
                y.par_chunks_mut(CHUNK)
                    .zip(up.par_chunks(CHUNK))
                    .for_each(|(g, u)| gelu_mul(g, u));
            } else {
                gelu_mul(y, &up);
            }
        })
    }

    /// gate and up as W4A8 weights that [`PackedW4A8::gelu_mul_rounding`] takes together, for a
    /// prefill of `m` rows.
    fn fused_w4a8(&self, m: usize) -> Option<(&PackedW4A8, &PackedW4A8)> {
        match [&self.gate_proj, &self.up_proj].map(|l| l.w4a8_rounding(false)) {
            [Some(gate), Some(up)] if m > 1 => Some((gate, up)),
            _ => None,
        }
    }
}

/// One decoder layer: `x += attn(norm(x)); x += mlp(norm(x))`.
pub struct DecoderLayer {
    pub kind: LayerType,
    pub input_layernorm: RmsNorm,
    pub self_attn: SelfAttention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: Mlp,
}

impl DecoderLayer {
    /// `m` rows of the residual stream `x` at positions `start..`, advanced in place.
    pub fn forward(
        &self,
        x: &mut [f32],
        m: usize,
        start: usize,
        cache: &mut LayerKvCache,
        ctx: &Ctx,
    ) {
        self.forward_segments(
            x,
            m,
            &mut [Segment {
                rows: 0..m,
                start,
                cache,
            }],
            ctx,
        );
    }

    /// [`Self::forward`] for rows of several sequences, each segment over its own cache.
    pub fn forward_segments(&self, x: &mut [f32], m: usize, segs: &mut [Segment<'_>], ctx: &Ctx) {
        let tm = ctx.timers;
        let h = tm.time(Stage::Norms, || self.input_layernorm.forward(x));
        let a = self.self_attn.forward_segments(&h, m, segs, ctx);
        tm.time(Stage::Norms, || residual_add(x, &a));
        let h2 = tm.time(Stage::Norms, || self.post_attention_layernorm.forward(x));
        let d = self.mlp.forward(&h2, m, ctx);
        tm.time(Stage::Norms, || residual_add(x, &d));
    }

    /// The calibration forward: every window of `x` (`[samples·seq_len, hidden]`, each window
    /// from position 0 with a cache of its own) through the layer, advanced in place. Before
    /// each group of linears that read one input, `tap` sees that input and may replace those
    /// linears ([`Self::set_linear`]); the rest of the forward runs on what it installed, so a
    /// quantizer observes each input with every earlier linear already in its deployed form.
    pub fn forward_windows<E>(
        &mut self,
        x: &mut [f32],
        shape: &WindowShape,
        ctx: &Ctx,
        mut tap: impl FnMut(&mut DecoderLayer, Tap<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let rows = shape.rows();
        let h = self.qkv_input(x, shape);
        tap(self, Tap::new(Site::Qkv, &h, x))?;
        let a = self.out_input(&h, shape, ctx);
        drop(h);
        tap(self, Tap::new(Site::Out, &a, x))?;
        residual_add(x, &self.self_attn.out_proj.project(&a, rows));
        drop(a);
        let h2 = self.gate_up_input(x, shape);
        tap(self, Tap::new(Site::GateUp, &h2, x))?;
        let act = self.down_input(&h2, shape, ctx);
        drop(h2);
        tap(self, Tap::new(Site::Down, &act, x))?;
        residual_add(x, &self.mlp.down_proj.project(&act, rows));
        Ok(())
    }

    /// `input_layernorm(x)`: what q, k, v and g read.
    pub fn qkv_input(&self, x: &[f32], shape: &WindowShape) -> Vec<f32> {
        shape.linear_input(self.input_layernorm.forward(x))
    }

    /// The gated attention of the normed rows `h`, window by window: what `out_proj` reads.
    pub fn out_input(&self, h: &[f32], shape: &WindowShape, ctx: &Ctx) -> Vec<f32> {
        let (hidden, q_dim) = (ctx.cfg.hidden_size, ctx.cfg.q_dim());
        let (rows, seq_len) = (shape.rows(), shape.seq_len);
        let mut attn = vec![0f32; rows * q_dim];
        for (a, h) in attn
            .chunks_mut(seq_len * q_dim)
            .zip(h.chunks(seq_len * hidden))
        {
            let precision = super::KvPrecision::for_activations(ctx.bf16);
            let mut cache = LayerKvCache::new(ctx.cfg, self.kind, seq_len, precision);
            a.copy_from_slice(&self.self_attn.attend(h, seq_len, 0, &mut cache, ctx));
        }
        shape.linear_input(attn)
    }

    /// `post_attention_layernorm(x)`: what gate and up read.
    pub fn gate_up_input(&self, x: &[f32], shape: &WindowShape) -> Vec<f32> {
        shape.linear_input(self.post_attention_layernorm.forward(x))
    }

    /// `gelu(gate(h2)) ⊙ up(h2)`, [`WindowShape::mlp_rows`] rows at a time: what `down_proj`
    /// reads.
    pub fn down_input(&self, h2: &[f32], shape: &WindowShape, ctx: &Ctx) -> Vec<f32> {
        let (hidden, inter) = (ctx.cfg.hidden_size, ctx.cfg.intermediate_size);
        let mut act = vec![0f32; h2.len() / hidden * inter];
        for (a, h) in act
            .chunks_mut(shape.mlp_rows * inter)
            .zip(h2.chunks(shape.mlp_rows * hidden))
        {
            self.mlp.act_into(h, h.len() / hidden, ctx, a);
        }
        shape.linear_input(act)
    }

    pub fn linear(&self, proj: Proj) -> &dyn Linear {
        let (a, f) = (&self.self_attn, &self.mlp);
        match proj {
            Proj::Q => a.q_proj.as_ref(),
            Proj::K => a.k_proj.as_ref(),
            Proj::V => a.v_proj.as_ref(),
            Proj::G => a.g_proj.as_ref(),
            Proj::Out => a.out_proj.as_ref(),
            Proj::Gate => f.gate_proj.as_ref(),
            Proj::Up => f.up_proj.as_ref(),
            Proj::Down => f.down_proj.as_ref(),
        }
    }

    /// Replace one projection (e.g. by its quantized version) with one of the same shape.
    pub fn set_linear(&mut self, proj: Proj, linear: Box<dyn Linear>) {
        let (a, f) = (&mut self.self_attn, &mut self.mlp);
        let slot = match proj {
            Proj::Q => &mut a.q_proj,
            Proj::K => &mut a.k_proj,
            Proj::V => &mut a.v_proj,
            Proj::G => &mut a.g_proj,
            Proj::Out => &mut a.out_proj,
            Proj::Gate => &mut f.gate_proj,
            Proj::Up => &mut f.up_proj,
            Proj::Down => &mut f.down_proj,
        };
        assert_eq!(
            (slot.in_features(), slot.out_features()),
            (linear.in_features(), linear.out_features()),
            "replacement linear must keep the shape"
        );
        *slot = linear;
    }
}

/// The calibration windows a [`DecoderLayer::forward_windows`] runs over.
#[derive(Debug, Clone, Copy)]
pub struct WindowShape {
    pub samples: usize,
    pub seq_len: usize,
    /// Round every linear's input to bf16 values, as a bf16 checkpoint's linears see it.
    pub bf16_inputs: bool,
    /// Rows of the MLP activation computed at a time (its transient `[rows, intermediate]`).
    pub mlp_rows: usize,
}

impl WindowShape {
    pub fn rows(&self) -> usize {
        self.samples * self.seq_len
    }

    fn linear_input(&self, mut v: Vec<f32>) -> Vec<f32> {
        if self.bf16_inputs {
            kernels::convert::round_bf16_in_place(&mut v);
        }
        v
    }
}

/// Where [`DecoderLayer::forward_windows`] stops: before each group of linears that read one
/// input, in the order the forward reaches them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// q, k, v and g, on `input_layernorm(x)`.
    Qkv,
    /// `out_proj`, on the gated attention.
    Out,
    /// gate and up, on `post_attention_layernorm(x)`.
    GateUp,
    /// `down_proj`, on `gelu(gate) ⊙ up`.
    Down,
}

impl Site {
    /// The linears that read this site's input.
    pub fn projs(self) -> &'static [Proj] {
        match self {
            Site::Qkv => &[Proj::Q, Proj::K, Proj::V, Proj::G],
            Site::Out => &[Proj::Out],
            Site::GateUp => &[Proj::Gate, Proj::Up],
            Site::Down => &[Proj::Down],
        }
    }
}

/// What a tap of [`DecoderLayer::forward_windows`] sees.
pub struct Tap<'a> {
    pub site: Site,
    /// The input the site's linears read, `[rows, K]`.
    pub input: &'a [f32],
    /// The residual stream at the site: what `input` was normed from (q/k/v, gate/up), or what
    /// the site's output is about to be added to (`out_proj`, `down_proj`).
    pub stream: &'a [f32],
}

impl<'a> Tap<'a> {
    fn new(site: Site, input: &'a [f32], stream: &'a [f32]) -> Self {
        Tap {
            site,
            input,
            stream,
        }
    }
}
