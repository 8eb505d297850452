//! Model tuning after GPTQ (recipe `[lab.model_tune]`, docs/FIDELITY.md "Model tuning"): block
//! tuning fits each decoder block to the float block's output; this fits the group scales and
//! norm gains of *all* blocks at once to the float model's next-token distribution, the measure
//! the fidelity targets are stated in (EfficientQAT's end-to-end step-size training):
//!
//! - every group scale takes a factor in [½, 1½], codes fixed unless `codes_lr` > 0 (then
//!   every code may move one step, as in block tuning);
//! - every block's two RMSNorm gains take a factor;
//! - Adam on KL(float ‖ quantized) of the next-token distributions over random batches of
//!   calibration windows, linearly decaying step; every `check` steps the stored state is scored
//!   on all windows and the best kept; if nothing beat the starting state it is kept.
//!
//! The teacher is the float model's final residual stream, which the float objectives
//! already carry through the layers, so each step costs one student forward and backward.

use candle_core::{Device, Tensor, Var, D};

use super::block_tune::{Block, TunedBlock, TunedLayer, Weights};
use super::lab::SCORE_CHUNK;
pub use super::lab::{ModelTune, ModelTuneReport};
use super::tune_loop::{self, Objective, Schedule};
use super::Norms;
use crate::checkpoint::{Proj, SparkConfig};
use crate::model::block::Ctx;
use crate::quant::QuantizedWeight;

/// One layer as model tuning starts from it.
pub struct ModelLayer<'a> {
    pub ctx: Ctx<'a>,
    /// Each of [`Proj::QUANTIZED`].
    pub linears: Vec<(Proj, &'a QuantizedWeight)>,
    /// `g_proj`'s weight `[heads, hidden]` (not tuned).
    pub g_proj: Vec<f32>,
    pub norms: Norms,
}

pub struct ModelInputs<'a> {
    pub layers: Vec<ModelLayer<'a>>,
    /// The embedded calibration windows, `[samples·seq_len, hidden]`.
    pub x0: &'a [f32],
    /// The float model's residual stream after its last layer, same shape.
    pub teacher: &'a [f32],
    /// The final norm's weight and the head `[vocab, hidden]` (both kept as they are).
    pub final_norm: &'a [f32],
    pub head: &'a [f32],
    pub samples: usize,
    pub seq_len: usize,
}

type Result<T> = std::result::Result<T, candle_core::Error>;

struct Tuner<'a> {
    dev: Device,
    hidden: usize,
    layers: Vec<TunedBlock>,
    final_norm: Tensor,
    head: Tensor,
    inp: &'a ModelInputs<'a>,
}

impl Tuner<'_> {
    fn windows(&self, src: &[f32], idx: &[usize]) -> Result<Tensor> {
        let w = self.inp.seq_len * self.hidden;
        let mut v = Vec::with_capacity(idx.len() * w);
        for &i in idx {
            v.extend_from_slice(&src[i * w..(i + 1) * w]);
        }
        Tensor::from_vec(v, (idx.len(), self.inp.seq_len, self.hidden), &self.dev)
    }

    fn log_probs(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.layers[0].block.rms(x, &self.final_norm)?;
        candle_nn::ops::log_softmax(&Block::linear(&h, &self.head)?, D::Minus1)
    }

    /// Summed KL(teacher ‖ student) over the tokens of windows `idx`, and the token count.
    fn kl(&self, idx: &[usize], weights: &[Weights]) -> Result<(Tensor, usize)> {
        let lt = self
            .log_probs(&self.windows(self.inp.teacher, idx)?)?
            .detach();
        let mut x = self.windows(self.inp.x0, idx)?;
        for (l, w) in self.layers.iter().zip(weights) {
            x = l.block.forward(&x, w)?;
        }
        let ls = self.log_probs(&x)?;
        let kl = (lt.exp()? * (&lt - ls)?)?.sum_all()?;
        Ok((kl, idx.len() * self.inp.seq_len))
    }

    fn weights(&self, stored: bool) -> Result<Vec<Weights>> {
        self.layers
            .iter()
            .map(|l| l.weights(stored, &self.dev))
            .collect()
    }

    /// Mean KL per token over all windows with the stored state.
    fn score(&self) -> Result<f64> {
        let w = self.weights(true)?;
        let all: Vec<usize> = (0..self.inp.samples).collect();
        let (mut sum, mut n) = (0f64, 0usize);
        for idx in all.chunks(SCORE_CHUNK) {
            let (kl, t) = self.kl(idx, &w)?;
            sum += kl.to_scalar::<f32>()? as f64;
            n += t;
        }
        Ok(sum / n.max(1) as f64)
    }
}

impl Objective for Tuner<'_> {
    fn loss(&self, idx: &[usize]) -> Result<Tensor> {
        let (kl, n) = self.kl(idx, &self.weights(false)?)?;
        kl / n as f64
    }

    fn score(&self) -> Result<f64> {
        Tuner::score(self)
    }

    fn vars(&self) -> Vec<&Var> {
        self.layers.iter().flat_map(|l| l.vars()).collect()
    }

    fn clamp(&self) -> Result<()> {
        self.layers.iter().try_for_each(|l| l.clamp())
    }
}

/// Tune all layers together (see the module doc); returns each layer's written state in order.
pub fn tune_model(
    cfg: &SparkConfig,
    inp: &ModelInputs,
    opts: &ModelTune,
    mut progress: impl FnMut(usize),
) -> Result<(Vec<TunedLayer>, ModelTuneReport)> {
    let clock = std::time::Instant::now();
    let _heap = crate::resources::HeapReuse::new();
    let dev = Device::Cpu;
    let h = cfg.hidden_size;
    let layers = inp
        .layers
        .iter()
        .map(|l| {
            TunedBlock::new(
                cfg,
                &l.ctx,
                inp.seq_len,
                opts.int8_inputs,
                &l.linears,
                &l.g_proj,
                &l.norms,
                &dev,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let tuner = Tuner {
        final_norm: Tensor::from_slice(inp.final_norm, h, &dev)?,
        head: Tensor::from_slice(inp.head, (cfg.vocab_size, h), &dev)?,
        dev,
        hidden: h,
        layers,
        inp,
    };
    let all_lin = || tuner.layers.iter().flat_map(|l| l.linears.iter());
    let mut groups = vec![(all_lin().map(|l| l.a.clone()).collect(), opts.scale_lr)];
    if opts.codes_lr > 0.0 {
        groups.push((all_lin().map(|l| l.v.clone()).collect(), opts.codes_lr));
    }
    if opts.norm_lr > 0.0 {
        let g = tuner
            .layers
            .iter()
            .flat_map(|l| [l.gains.0.clone(), l.gains.1.clone()])
            .collect();
        groups.push((g, opts.norm_lr));
    }
    let schedule = Schedule {
        steps: opts.steps,
        batch: opts.batch,
        check: opts.check,
        samples: inp.samples,
        seed: opts.seed,
    };
    let fit = tune_loop::fit(&tuner, groups, schedule, &mut progress)?;
    let mut out = Vec::new();
    let mut moved_all = 0u64;
    for (l, li) in tuner.layers.iter().zip(&inp.layers) {
        let e = l.export(&li.linears, &tuner.dev)?;
        moved_all += e.moved;
        out.push(TunedLayer {
            linears: e.linears,
            norms: e.norms,
            report: super::block_tune::LayerTuneReport {
                layer: 0,
                error_before: 0.0,
                error_after: 0.0,
                codes_moved: e.moved,
                codes: e.codes,
                tuned: fit.tuned,
                seconds: 0.0,
                step_seconds: 0.0,
            },
        });
    }
    Ok((
        out,
        ModelTuneReport {
            kl_before: fit.before,
            kl_after: fit.after,
            tuned: fit.tuned,
            codes_moved: moved_all,
            seconds: clock.elapsed().as_secs_f64(),
            step_seconds: fit.step_seconds,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::super::block_tune::testing::*;
    use super::*;
    use crate::model::DenseLinear;
    use crate::quant::Grid;

    const WINDOWS: usize = 4;

    /// Mean KL(float ‖ quantized) per token of two logit matrices `[rows, vocab]`, in f64.
    fn kl_mean(float: &[f32], quant: &[f32], vocab: usize) -> f64 {
        let log_softmax = |row: &[f32]| -> Vec<f64> {
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let z = row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            row.iter().map(|&v| v as f64 - m - z).collect()
        };
        let rows = float.len() / vocab;
        let mut sum = 0.0;
        for (f, q) in float.chunks(vocab).zip(quant.chunks(vocab)) {
            let (lf, lq) = (log_softmax(f), log_softmax(q));
            sum += lf
                .iter()
                .zip(&lq)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>();
        }
        sum / rows as f64
    }

    #[test]
    fn tuning_lowers_the_models_kl_and_our_forward_scores_what_it_reports() {
        let mut model = fixture();
        let cfg = model.config().clone();
        let x0 = stream(&model, WINDOWS, 3);
        let mut teacher = x0.clone();
        for li in 0..model.num_layers() {
            let (layer, ctx) = model.layer(li);
            teacher = layer_forward(layer, &ctx, &teacher);
        }
        let rtn: Vec<Vec<(Proj, QuantizedWeight)>> = (0..model.num_layers())
            .map(|li| rtn_linears(&model, model.layer(li).0))
            .collect();
        let head = model.lm_head().dequantize();
        let final_norm = model.final_norm_weight().to_vec();
        let inputs = ModelInputs {
            layers: rtn
                .iter()
                .enumerate()
                .map(|(li, lin)| {
                    let (layer, ctx) = model.layer(li);
                    ModelLayer {
                        ctx,
                        linears: lin.iter().map(|(p, q)| (*p, q)).collect(),
                        g_proj: layer.linear(Proj::G).dequantize(),
                        norms: (
                            layer.input_layernorm.weight().to_vec(),
                            layer.post_attention_layernorm.weight().to_vec(),
                        ),
                    }
                })
                .collect(),
            x0: &x0,
            teacher: &teacher,
            final_norm: &final_norm,
            head: &head,
            samples: WINDOWS,
            seq_len: SEQ,
        };
        let opts = ModelTune {
            steps: 30,
            batch: 2,
            scale_lr: 5e-3,
            check: 10,
            ..ModelTune::default()
        };
        let (tuned, r) = tune_model(&cfg, &inputs, &opts, |_| {}).unwrap();
        drop(inputs);
        assert!(r.tuned && r.kl_after < 0.97 * r.kl_before, "{r:?}");
        assert_eq!(r.codes_moved, 0, "codes stay GPTQ's without a codes step");
        for (t, lin) in tuned.iter().zip(&rtn) {
            for ((_, before), (_, after)) in lin.iter().zip(&t.linears) {
                assert_eq!(before.codes, after.codes);
                for s in &after.scales {
                    assert_eq!(Grid::VLLM.stored(*s, 0.0), *s);
                }
            }
        }
        // The written state, run by our own forward, has the KL the tuning reported.
        let vocab = cfg.vocab_size;
        let want = model.logits(&teacher);
        let mut layers = model.take_layers();
        let mut x = x0.clone();
        for (layer, t) in layers.iter_mut().zip(&tuned) {
            for (p, q) in &t.linears {
                let lin = DenseLinear::new(q.dequantize().into(), q.out_features, q.in_features);
                layer.set_linear(*p, Box::new(lin));
            }
            layer.input_layernorm.set_weight(t.norms.0.clone());
            layer.post_attention_layernorm.set_weight(t.norms.1.clone());
            x = layer_forward(layer, &model.ctx_for(layer.kind), &x);
        }
        let kl = kl_mean(&want, &model.logits(&x), vocab);
        assert!(
            (kl / r.kl_after - 1.0).abs() < 1e-3,
            "our forward {kl:e}, reported {:e}",
            r.kl_after
        );
    }
}
