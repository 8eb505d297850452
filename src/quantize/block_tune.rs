//! Block tuning after GPTQ (recipe `[lab.block_tune]`, docs/FIDELITY.md "Block tuning after
//! GPTQ"). GPTQ fits each linear to its own output; this fits the whole decoder block to the
//! float model's block output, so that the errors of q/k/v, out, gate, up and down may cancel
//! through attention, the head gate, GELU and the product:
//!
//! - every code may move one step: code = clamp(round(q − 8 + V), −8, 7) with V ∈ [−½, ½],
//!   rounding straight through (AutoRound's parameterisation, started from GPTQ's codes);
//! - every group scale takes a factor in [½, 1½];
//! - the two RMSNorm gains of the block take a factor (they stay bf16 in the checkpoint);
//! - Adam on the block output's mean square error over random batches of calibration windows,
//!   with a linearly decaying step; every `check` steps the stored state (bf16 scales, rounded
//!   codes and norms) is scored on all windows and the best kept; a layer whose error did not
//!   fall keeps GPTQ's solution.
//!
//! The differentiable block is written on `candle` tensors (its autograd) in f32; it is the
//! math of [`crate::model::block`] and is tested against it. The product's forward stays ours.

use candle_core::{DType, Device, Tensor, Var, D};

use crate::checkpoint::{LayerType, Proj, SparkConfig};
use crate::kernels::transpose;
use crate::kernels::w4::round_bf16;
use crate::model::block::Ctx;
use crate::quant::{Grid, QuantizedWeight};

use super::lab::SCORE_CHUNK;
pub use super::lab::{BlockTune, LayerTuneReport};
use super::tune_loop::{self, Objective, Schedule};

/// Everything a layer's tuning changes: its linears' codes and scales and its norm weights.
pub struct TunedLayer {
    pub linears: Vec<(Proj, QuantizedWeight)>,
    /// (input_layernorm, post_attention_layernorm), bf16 values.
    pub norms: super::Norms,
    pub report: LayerTuneReport,
}

/// What a layer's tuning starts from.
pub struct LayerInputs<'a> {
    pub layer: usize,
    pub ctx: Ctx<'a>,
    /// GPTQ's solution of each of [`Proj::QUANTIZED`] (`g_proj` is not tuned: a GPTQ checkpoint
    /// keeps it 16-bit).
    pub linears: Vec<(Proj, &'a QuantizedWeight)>,
    /// `g_proj`'s weight `[heads, hidden]`, which is not tuned.
    pub g_proj: Vec<f32>,
    pub norms: super::Norms,
    /// The quantized model's stream into the layer, `[samples·seq_len, hidden]`.
    pub x: &'a [f32],
    /// The float model's stream out of the layer (the target), same shape.
    pub y: &'a [f32],
    pub samples: usize,
    pub seq_len: usize,
}

type Result<T> = std::result::Result<T, candle_core::Error>;

/// The shape and constants of one layer's differentiable block.
pub(super) struct Block {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary: usize,
    eps: f64,
    seq: usize,
    /// `[seq, rotary/2]`.
    cos: Tensor,
    sin: Tensor,
    /// `[seq, seq]`: 0 where a query sees a key, −∞ elsewhere.
    mask: Tensor,
    /// Round each quantized linear's input per token to int8 as W4A8 kernels do.
    int8: bool,
}

/// The block's weights as the forward takes them.
pub(super) struct Weights {
    /// `[N, K]` in [`Proj::QUANTIZED`]'s order: q, k, v, out, gate, up, down.
    pub(super) lin: Vec<Tensor>,
    pub(super) g: Tensor,
    pub(super) ln_in: Tensor,
    pub(super) ln_post: Tensor,
}

impl Block {
    pub(super) fn new(
        cfg: &SparkConfig,
        kind: LayerType,
        ctx: &Ctx,
        seq: usize,
        int8: bool,
        dev: &Device,
    ) -> Result<Self> {
        let rotary = ctx.rope.rotary_dims();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..seq {
            let (c, s) = ctx.rope.angles(p);
            cos.extend(c);
            sin.extend(s);
        }
        let mask: Vec<f32> = (0..seq * seq)
            .map(|i| {
                let (q, k) = (i / seq, i % seq);
                let visible = k <= q
                    && match kind {
                        LayerType::Full => true,
                        LayerType::Sliding => k + cfg.sliding_window > q,
                    };
                if visible {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        Ok(Block {
            hidden: cfg.hidden_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            rotary,
            eps: cfg.rms_norm_eps as f64,
            seq,
            cos: Tensor::from_vec(cos, (seq, rotary / 2), dev)?,
            sin: Tensor::from_vec(sin, (seq, rotary / 2), dev)?,
            mask: Tensor::from_vec(mask, (seq, seq), dev)?,
            int8,
        })
    }

    pub(super) fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        x.broadcast_div(&(ms + self.eps)?.sqrt()?)?.broadcast_mul(w)
    }

    /// `x` rounded per token (last axis) to int8 against its largest magnitude, as
    /// `kernels::w4::quantize_activation_row` (except exact .5 ties, which candle rounds away
    /// from zero); the gradient passes straight through.
    fn int8_rows(&self, x: &Tensor) -> Result<Tensor> {
        if !self.int8 {
            return Ok(x.clone());
        }
        let step = (x.abs()?.max_keepdim(D::Minus1)?.clamp(1e-7f32, f32::MAX)? / 127.0)?.detach();
        let q = x.broadcast_div(&step)?.round()?.broadcast_mul(&step)?;
        x + (q - x)?.detach()
    }

    /// `x·Wᵀ` for `x` `[b, t, k]`.
    pub(super) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (b, t, k) = x.dims3()?;
        x.reshape((b * t, k))?
            .matmul(&w.t()?)?
            .reshape((b, t, w.dim(0)?))
    }

    /// NeoX rotate-half within the first `rotary` dims of each head of `x` `[b, n, t, hd]`.
    fn rope(&self, x: &Tensor) -> Result<Tensor> {
        let (r, half) = (self.rotary, self.rotary / 2);
        let a = x.narrow(D::Minus1, 0, half)?;
        let b = x.narrow(D::Minus1, half, half)?;
        let ra = (a.broadcast_mul(&self.cos)? - b.broadcast_mul(&self.sin)?)?;
        let rb = (b.broadcast_mul(&self.cos)? + a.broadcast_mul(&self.sin)?)?;
        if r == self.head_dim {
            Tensor::cat(&[ra, rb], D::Minus1)
        } else {
            let rest = x.narrow(D::Minus1, r, self.head_dim - r)?;
            Tensor::cat(&[ra, rb, rest], D::Minus1)
        }
    }

    /// The block on `x` `[b, t, hidden]`: `x += out(attn(norm(x)) ⊙ σ(g)); x += down(gelu(gate) ⊙ up)`.
    pub(super) fn forward(&self, x: &Tensor, w: &Weights) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let rep = nh / nkv;
        let [q, k, v, out, gate, up, down] = &w.lin[..] else {
            unreachable!("the seven linears of Proj::QUANTIZED")
        };
        let h = self.rms(x, &w.ln_in)?;
        let hq = self.int8_rows(&h)?;
        let heads = |p: &Tensor, n: usize| -> Result<Tensor> {
            Self::linear(&hq, p)?
                .reshape((b, t, n, hd))?
                .transpose(1, 2)
        };
        // The `rep` query heads of a KV head are consecutive: one matmul per KV head.
        let qh = self
            .rope(&heads(q, nh)?)?
            .contiguous()?
            .reshape((b, nkv, rep * t, hd))?;
        let kh = self.rope(&heads(k, nkv)?)?.contiguous()?;
        let vh = heads(v, nkv)?.contiguous()?;
        let scores = (qh.matmul(&kh.t()?)? * (1.0 / (hd as f64).sqrt()))?
            .reshape((b, nkv, rep, t, t))?
            .broadcast_add(&self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?)?;
        let max = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let a = p
            .reshape((b, nkv, rep * t, t))?
            .matmul(&vh)?
            .reshape((b, nh, t, hd))?
            .transpose(1, 2)?;
        let g = sigmoid(&Self::linear(&h, &w.g)?)?.unsqueeze(3)?;
        let a = a.broadcast_mul(&g)?.reshape((b, t, nh * hd))?;
        let x = (x + Self::linear(&self.int8_rows(&a)?, out)?)?;
        let h2 = self.int8_rows(&self.rms(&x, &w.ln_post)?)?;
        let m = (Self::linear(&h2, gate)?.gelu_erf()? * Self::linear(&h2, up)?)?;
        x + Self::linear(&self.int8_rows(&m)?, down)?
    }
}

fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// One tuned linear: GPTQ's codes q − 8 and scales `[N, K]`, `[N, K/G]` (PyTorch order), with
/// the offsets V and scale factors being tuned.
pub(super) struct TunedLinear {
    pub(super) n: usize,
    pub(super) k: usize,
    g: usize,
    grid: Grid,
    /// q − 8, `[N·K]`.
    q: Vec<f32>,
    /// `[N·K/G]`.
    s: Vec<f32>,
    s_t: Tensor,
    pub(super) v: Var,
    pub(super) a: Var,
}

impl TunedLinear {
    pub(super) fn new(w: &QuantizedWeight, dev: &Device) -> Result<Self> {
        let (k, n, g) = (w.in_features, w.out_features, w.group_size);
        let z = w.grid.zero() as f32;
        let q = transpose(&w.codes, k, n)
            .into_iter()
            .map(|c| c as f32 - z)
            .collect();
        let groups = k / g;
        let s = transpose(&w.scales, groups, n);
        Ok(TunedLinear {
            n,
            k,
            g,
            grid: w.grid,
            s_t: Tensor::from_slice(&s, (n, groups), dev)?,
            q,
            s,
            v: Var::zeros((n, k), DType::F32, dev)?,
            a: Var::ones((n, groups), DType::F32, dev)?,
        })
    }

    /// The stored codes q − 8 (round half to even, as the grid does) and, per code, whether the
    /// rounding lay inside the grid (where the straight-through gradient passes).
    pub(super) fn codes(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let v = self.v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        let (lo, hi) = (
            -(self.grid.zero() as f32),
            (self.grid.qmax() - self.grid.zero()) as f32,
        );
        Ok(self
            .q
            .iter()
            .zip(&v)
            .map(|(q, v)| {
                let r = (q + v).round_ties_even();
                (
                    r.clamp(lo, hi),
                    if (lo..=hi).contains(&r) { 1.0 } else { 0.0 },
                )
            })
            .unzip())
    }

    /// The scales as stored: GPTQ's times the factor, on the grid's lattice.
    fn stored_scales(&self) -> Result<Vec<f32>> {
        let a = self.a.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        Ok(self
            .s
            .iter()
            .zip(&a)
            .map(|(s, a)| self.grid.stored(s * a, 0.0))
            .collect())
    }

    /// `W = codes · s·a` per group, differentiable in V (straight through) and a.
    pub(super) fn weight(&self, dev: &Device) -> Result<Tensor> {
        let (c, mask) = self.codes()?;
        let c = Tensor::from_vec(c, (self.n, self.k), dev)?;
        let mask = Tensor::from_vec(mask, (self.n, self.k), dev)?;
        let vm = (self.v.as_tensor() * mask)?;
        let codes = (&vm + (c - &vm)?.detach())?;
        let sa = (&self.s_t * self.a.as_tensor())?;
        self.scaled(&codes, &sa)
    }

    /// The weight as the checkpoint will hold it.
    pub(super) fn stored_weight(&self, dev: &Device) -> Result<Tensor> {
        let (c, _) = self.codes()?;
        let c = Tensor::from_vec(c, (self.n, self.k), dev)?;
        let s = Tensor::from_vec(self.stored_scales()?, (self.n, self.k / self.g), dev)?;
        self.scaled(&c, &s)
    }

    fn scaled(&self, codes: &Tensor, s: &Tensor) -> Result<Tensor> {
        let groups = self.k / self.g;
        codes
            .reshape((self.n, groups, self.g))?
            .broadcast_mul(&s.unsqueeze(2)?)?
            .reshape((self.n, self.k))
    }

    /// The stored state back in the checkpoint's orientation, and how many codes moved.
    pub(super) fn export(&self, like: &QuantizedWeight) -> Result<(QuantizedWeight, u64)> {
        let (c, _) = self.codes()?;
        let s = self.stored_scales()?;
        let (n, k) = (self.n, self.k);
        let z = self.grid.zero() as f32;
        let moved = c.iter().zip(&self.q).filter(|(a, b)| a != b).count() as u64;
        let codes: Vec<u8> = c.iter().map(|v| (v + z) as u8).collect();
        Ok((
            QuantizedWeight {
                in_features: k,
                out_features: n,
                group_size: self.g,
                codes: transpose(&codes, n, k),
                scales: transpose(&s, n, k / self.g),
                grid: self.grid,
                tier_scales: like.tier_scales.clone(),
            },
            moved,
        ))
    }
}

/// bf16 rounding of a norm weight times its gain, as the checkpoint stores it.
pub(super) fn bf16_values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_vec1::<f32>()?.into_iter().map(round_bf16).collect())
}

/// One layer's differentiable block with what tuning may move (block and model tuning).
pub(super) struct TunedBlock {
    pub(super) block: Block,
    pub(super) linears: Vec<TunedLinear>,
    g: Tensor,
    norms: (Tensor, Tensor),
    pub(super) gains: (Var, Var),
}

/// A tuned block's stored state: its linears in the checkpoint's orientation, its bf16 norms,
/// and how many of its codes moved of how many.
pub(super) struct Exported {
    pub(super) linears: Vec<(Proj, QuantizedWeight)>,
    pub(super) norms: super::Norms,
    pub(super) moved: u64,
    pub(super) codes: u64,
}

impl TunedBlock {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        cfg: &SparkConfig,
        ctx: &Ctx,
        seq: usize,
        int8: bool,
        linears: &[(Proj, &QuantizedWeight)],
        g_proj: &[f32],
        norms: &super::Norms,
        dev: &Device,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(TunedBlock {
            block: Block::new(cfg, ctx.kind, ctx, seq, int8, dev)?,
            linears: linears
                .iter()
                .map(|(_, w)| TunedLinear::new(w, dev))
                .collect::<Result<_>>()?,
            g: Tensor::from_slice(g_proj, (cfg.num_attention_heads, h), dev)?,
            norms: (
                Tensor::from_slice(&norms.0, h, dev)?,
                Tensor::from_slice(&norms.1, h, dev)?,
            ),
            gains: (
                Var::ones(h, DType::F32, dev)?,
                Var::ones(h, DType::F32, dev)?,
            ),
        })
    }

    /// The block's weights: differentiable, or as the checkpoint will store them.
    pub(super) fn weights(&self, stored: bool, dev: &Device) -> Result<Weights> {
        let lin = self
            .linears
            .iter()
            .map(|l| {
                if stored {
                    l.stored_weight(dev)
                } else {
                    l.weight(dev)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let ln_in = (&self.norms.0 * self.gains.0.as_tensor())?;
        let ln_post = (&self.norms.1 * self.gains.1.as_tensor())?;
        let (ln_in, ln_post) = if stored {
            let h = self.block.hidden;
            (
                Tensor::from_vec(bf16_values(&ln_in)?, h, dev)?,
                Tensor::from_vec(bf16_values(&ln_post)?, h, dev)?,
            )
        } else {
            (ln_in, ln_post)
        };
        Ok(Weights {
            lin,
            g: self.g.clone(),
            ln_in,
            ln_post,
        })
    }

    pub(super) fn vars(&self) -> Vec<&Var> {
        let mut v: Vec<&Var> = self.linears.iter().flat_map(|l| [&l.v, &l.a]).collect();
        v.extend([&self.gains.0, &self.gains.1]);
        v
    }

    /// Code offsets within ±½ (one step either way once rounded), scale factors within [½, 1½].
    pub(super) fn clamp(&self) -> Result<()> {
        for l in &self.linears {
            l.v.set(&l.v.as_tensor().clamp(-0.5f32, 0.5f32)?)?;
            l.a.set(&l.a.as_tensor().clamp(0.5f32, 1.5f32)?)?;
        }
        Ok(())
    }

    /// The stored state; `like`: the linears tuning started from, in order.
    pub(super) fn export(
        &self,
        like: &[(Proj, &QuantizedWeight)],
        dev: &Device,
    ) -> Result<Exported> {
        let mut linears = Vec::new();
        let (mut moved, mut codes) = (0u64, 0u64);
        for ((proj, like), l) in like.iter().zip(&self.linears) {
            let (w, m) = l.export(like)?;
            moved += m;
            codes += (l.n * l.k) as u64;
            linears.push((*proj, w));
        }
        let w = self.weights(true, dev)?;
        Ok(Exported {
            linears,
            norms: (w.ln_in.to_vec1()?, w.ln_post.to_vec1()?),
            moved,
            codes,
        })
    }
}

struct Tuner<'a> {
    dev: Device,
    blk: TunedBlock,
    inp: &'a LayerInputs<'a>,
}

impl Tuner<'_> {
    fn weights(&self, stored: bool) -> Result<Weights> {
        self.blk.weights(stored, &self.dev)
    }

    /// Windows `idx` of `src` as `[len, seq, hidden]`.
    fn windows(&self, src: &[f32], idx: &[usize]) -> Result<Tensor> {
        let b = &self.blk.block;
        let w = b.seq * b.hidden;
        let mut v = Vec::with_capacity(idx.len() * w);
        for &i in idx {
            v.extend_from_slice(&src[i * w..(i + 1) * w]);
        }
        Tensor::from_vec(v, (idx.len(), b.seq, b.hidden), &self.dev)
    }

    /// ‖y − block(x)‖² / ‖y‖² over all windows with the stored state.
    fn error(&self) -> Result<f64> {
        let w = self.weights(true)?;
        let (mut se, mut norm) = (0f64, 0f64);
        let all: Vec<usize> = (0..self.inp.samples).collect();
        for idx in all.chunks(SCORE_CHUNK) {
            let y = self.windows(self.inp.y, idx)?;
            let out = self
                .blk
                .block
                .forward(&self.windows(self.inp.x, idx)?, &w)?;
            se += (out - &y)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            norm += y.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        Ok(se / norm.max(f64::MIN_POSITIVE))
    }
}

impl Objective for Tuner<'_> {
    fn loss(&self, idx: &[usize]) -> Result<Tensor> {
        let out = self
            .blk
            .block
            .forward(&self.windows(self.inp.x, idx)?, &self.weights(false)?)?;
        (out - self.windows(self.inp.y, idx)?)?.sqr()?.mean_all()
    }

    fn score(&self) -> Result<f64> {
        self.error()
    }

    fn vars(&self) -> Vec<&Var> {
        self.blk.vars()
    }

    fn clamp(&self) -> Result<()> {
        self.blk.clamp()
    }
}

/// Tune one layer (see the module doc). Deterministic for a given `opts.seed` and layer.
pub fn tune_layer(
    cfg: &SparkConfig,
    inp: &LayerInputs,
    opts: &BlockTune,
    mut progress: impl FnMut(usize),
) -> Result<TunedLayer> {
    let clock = std::time::Instant::now();
    let _heap = crate::resources::HeapReuse::new();
    let dev = Device::Cpu;
    let tuner = Tuner {
        blk: TunedBlock::new(
            cfg,
            &inp.ctx,
            inp.seq_len,
            opts.int8_inputs,
            &inp.linears,
            &inp.g_proj,
            &inp.norms,
            &dev,
        )?,
        dev,
        inp,
    };
    let mut groups = vec![
        (
            tuner.blk.linears.iter().map(|l| l.v.clone()).collect(),
            opts.lr,
        ),
        (
            tuner.blk.linears.iter().map(|l| l.a.clone()).collect(),
            opts.scale_lr,
        ),
    ];
    if opts.norm_lr > 0.0 {
        let g = vec![tuner.blk.gains.0.clone(), tuner.blk.gains.1.clone()];
        groups.push((g, opts.norm_lr));
    }
    let schedule = Schedule {
        steps: opts.steps,
        batch: opts.batch,
        check: opts.check,
        samples: inp.samples,
        seed: opts.seed ^ ((inp.layer as u64) << 32),
    };
    let fit = tune_loop::fit(&tuner, groups, schedule, &mut progress)?;
    let e = tuner.blk.export(&inp.linears, &tuner.dev)?;
    Ok(TunedLayer {
        linears: e.linears,
        norms: e.norms,
        report: LayerTuneReport {
            layer: inp.layer,
            error_before: fit.before,
            error_after: fit.after,
            codes_moved: e.moved,
            codes: e.codes,
            tuned: fit.tuned,
            seconds: clock.elapsed().as_secs_f64(),
            step_seconds: fit.step_seconds,
        },
    })
}

/// What the tests of block and model tuning share.
#[cfg(test)]
pub(super) mod testing {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::model::kv_cache::LayerKvCache;
    use crate::model::{DecoderLayer, SparkModel};
    use rand::{Rng, SeedableRng};

    pub const SEQ: usize = 96; // past the fixture's 64-token sliding window

    pub fn fixture() -> SparkModel {
        let ck = Checkpoint::open(&crate::bundled_fixture()).unwrap();
        SparkModel::from_checkpoint(&ck, false).unwrap()
    }

    /// `windows` windows of SEQ random tokens, embedded: `[windows·SEQ, hidden]`.
    pub fn stream(model: &SparkModel, windows: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let vocab = model.config().vocab_size as u32;
        let ids: Vec<u32> = (0..windows * SEQ)
            .map(|_| rng.random_range(0..vocab))
            .collect();
        model.embed(&ids).unwrap()
    }

    /// Our model's layer on each window of `x`.
    pub fn layer_forward(layer: &DecoderLayer, ctx: &Ctx, x: &[f32]) -> Vec<f32> {
        let w = SEQ * ctx.cfg.hidden_size;
        let mut y = x.to_vec();
        for win in y.chunks_mut(w) {
            let mut cache = LayerKvCache::new(
                ctx.cfg,
                layer.kind,
                SEQ,
                crate::model::KvPrecision::for_activations(ctx.bf16),
            );
            layer.forward(win, SEQ, 0, &mut cache, ctx);
        }
        y
    }

    /// RTN codes (groups of 32, vLLM's grid) of every quantized linear of `layer`.
    pub fn rtn_linears(model: &SparkModel, layer: &DecoderLayer) -> Vec<(Proj, QuantizedWeight)> {
        use crate::quant::{rtn, Hessian, ScaleRule};
        Proj::QUANTIZED
            .iter()
            .map(|&p| {
                let [n, k] = p.shape(model.config());
                let w = layer.linear(p).dequantize();
                let h = Hessian::new(k);
                (p, rtn(&w, n, k, &h, 32, ScaleRule::MaxOver7_5, Grid::VLLM))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use crate::model::{DenseLinear, SparkModel};
    use rand::{Rng, SeedableRng};

    use crate::quantize::relative_distance as rel_error;

    #[test]
    fn the_differentiable_block_is_the_models_layer() {
        let model = fixture();
        let cfg = model.config();
        let dev = Device::Cpu;
        let x = stream(&model, 2, 1);
        // A sliding and a full layer: their masks and rotary widths differ.
        for li in [0, 3] {
            let (layer, ctx) = model.layer(li);
            let block = Block::new(cfg, layer.kind, &ctx, SEQ, false, &dev).unwrap();
            let t = |p: Proj| {
                let [n, k] = p.shape(cfg);
                Tensor::from_vec(layer.linear(p).dequantize(), (n, k), &dev).unwrap()
            };
            let h = cfg.hidden_size;
            let w = Weights {
                lin: Proj::QUANTIZED.iter().map(|&p| t(p)).collect(),
                g: t(Proj::G),
                ln_in: Tensor::from_slice(layer.input_layernorm.weight(), h, &dev).unwrap(),
                ln_post: Tensor::from_slice(layer.post_attention_layernorm.weight(), h, &dev)
                    .unwrap(),
            };
            let xt = Tensor::from_slice(&x, (2, SEQ, h), &dev).unwrap();
            let ours = block
                .forward(&xt, &w)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let want = layer_forward(layer, &ctx, &x);
            // What the layer adds to the stream, compared: f32 sums in different orders.
            let delta = |y: &[f32]| -> Vec<f32> { y.iter().zip(&x).map(|(a, b)| a - b).collect() };
            let e = rel_error(&delta(&ours), &delta(&want));
            assert!(e < 1e-9, "layer {li}: relative squared difference {e:e}");
        }
    }

    #[test]
    fn int8_inputs_round_as_the_w4a8_kernel_and_pass_the_gradient_through() {
        let model = fixture();
        let (layer, ctx) = model.layer(0);
        let dev = Device::Cpu;
        let block = Block::new(model.config(), layer.kind, &ctx, SEQ, true, &dev).unwrap();
        let (rows, k) = (6, 64);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| rng.random_range(-1.0f32..1.0) * (1 + i / k) as f32)
            .collect();
        let xv = Var::from_slice(&x, (1, rows, k), &dev).unwrap();
        let r = block.int8_rows(xv.as_tensor()).unwrap();
        let got = r.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut a = vec![0i32; k];
        for (row, (xs, gs)) in x.chunks(k).zip(got.chunks(k)).enumerate() {
            let step = crate::kernels::w4::quantize_activation_row(xs, &mut a);
            for (j, (&q, &g)) in a.iter().zip(gs).enumerate() {
                // Equal up to the rounding of the division (x/step against x·127/amax).
                let want = q as f32 * step;
                assert!(
                    (g - want).abs() <= 1e-6 * want.abs().max(step),
                    "row {row} input {j}: {g} vs {want}"
                );
            }
        }
        let c: Vec<f32> = (0..rows * k).map(|i| (i % 5) as f32 - 2.0).collect();
        let ct = Tensor::from_slice(&c, (1, rows, k), &dev).unwrap();
        let grads = (r * ct).unwrap().sum_all().unwrap().backward().unwrap();
        let g = grads
            .get(xv.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(g, c, "straight-through: the gradient is the upstream one");
    }

    /// Layer `li` of the fixture with RTN codes, its float input and target.
    struct Case {
        model: SparkModel,
        rtn: Vec<(Proj, QuantizedWeight)>,
        x: Vec<f32>,
        y: Vec<f32>,
    }

    const LI: usize = 1;
    const WINDOWS: usize = 8;

    fn case() -> Case {
        let model = fixture();
        let (layer, ctx) = model.layer(LI);
        let x = stream(&model, WINDOWS, 2);
        let y = layer_forward(layer, &ctx, &x);
        let rtn = rtn_linears(&model, layer);
        Case { model, rtn, x, y }
    }

    fn tune(c: &Case, opts: &BlockTune) -> TunedLayer {
        let (layer, ctx) = c.model.layer(LI);
        let inputs = LayerInputs {
            layer: LI,
            ctx,
            linears: c.rtn.iter().map(|(p, q)| (*p, q)).collect(),
            g_proj: layer.linear(Proj::G).dequantize(),
            norms: (
                layer.input_layernorm.weight().to_vec(),
                layer.post_attention_layernorm.weight().to_vec(),
            ),
            x: &c.x,
            y: &c.y,
            samples: WINDOWS,
            seq_len: SEQ,
        };
        tune_layer(c.model.config(), &inputs, opts, |_| {}).unwrap()
    }

    #[test]
    fn tuning_lowers_the_block_error_and_our_forward_scores_what_it_reports() {
        let c = case();
        let opts = BlockTune {
            steps: 40,
            batch: 4,
            lr: 5e-2,
            check: 10,
            ..BlockTune::default()
        };
        let t = tune(&c, &opts);
        let r = &t.report;
        assert!(r.tuned && r.error_after < 0.97 * r.error_before, "{r:?}");
        assert!(r.codes_moved > 0, "{r:?}");
        // Codes move by at most one step, scales stay on vLLM's lattice.
        for ((_, before), (_, after)) in c.rtn.iter().zip(&t.linears) {
            for (a, b) in before.codes.iter().zip(&after.codes) {
                assert!((*a as i32 - *b as i32).abs() <= 1);
            }
            for s in &after.scales {
                assert_eq!(Grid::VLLM.stored(*s, 0.0), *s);
            }
        }
        // The written layer, run by our own forward, has the error the tuning reported.
        let mut model = c.model;
        let mut layer = model.take_layers().swap_remove(LI);
        for (p, q) in &t.linears {
            let lin = DenseLinear::new(q.dequantize().into(), q.out_features, q.in_features);
            layer.set_linear(*p, Box::new(lin));
        }
        layer.input_layernorm.set_weight(t.norms.0.clone());
        layer.post_attention_layernorm.set_weight(t.norms.1.clone());
        let ctx = model.ctx_for(layer.kind);
        let e = rel_error(&layer_forward(&layer, &ctx, &c.x), &c.y);
        assert!(
            (e / r.error_after - 1.0).abs() < 1e-3,
            "our forward {e:e}, reported {:e}",
            r.error_after
        );
    }

    #[test]
    fn a_layer_that_does_not_improve_keeps_its_solution() {
        let c = case();
        let still = BlockTune {
            steps: 3,
            batch: 2,
            lr: 0.0,
            scale_lr: 0.0,
            norm_lr: 0.0,
            ..BlockTune::default()
        };
        let t = tune(&c, &still);
        assert!(!t.report.tuned && t.report.codes_moved == 0);
        assert_eq!(t.report.error_after, t.report.error_before);
        for ((_, a), (_, b)) in c.rtn.iter().zip(&t.linears) {
            assert_eq!((&a.codes, &a.scales), (&b.codes, &b.scales));
        }
        let layer = c.model.layer(LI).0;
        assert_eq!(t.norms.0, layer.input_layernorm.weight());
        assert_eq!(t.norms.1, layer.post_attention_layernorm.weight());
    }
}
