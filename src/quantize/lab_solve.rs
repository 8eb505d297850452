//! The lab's steps in the quantize pipeline (docs/QUANTIZE.md "The lab"): on one linear after
//! its solve, output-error scale refit alternated with fixed-scale GPTQ and coordinate descent on
//! the codes (recipe `lab.refit_rounds`, `lab.descent_passes`); on a layer, block tuning; on the
//! whole model, model tuning. None beat the default recipe on held-out KL beyond the spread
//! (docs/FIDELITY.md).

use indicatif::ProgressBar;

use super::lab::Lab;
use super::{calibration, install, output, window_shape, LayerResult, Norms, QuantizeOptions};
use crate::checkpoint::Proj;
use crate::model::{DecoderLayer, SparkModel};

use super::phases::{Phase, Phases};
use super::QuantizeError;
use crate::quant::timing::Clock;
use crate::quant::{delta_form, descend, refit_scales, GptqConfig, GptqSolver, QuantizedWeight};

/// One linear as GPTQ left it: its solver, Hessian (`hm`, dense) and float weight `[n, k]`.
pub struct Polish<'a> {
    pub solver: &'a GptqSolver,
    pub hm: &'a [f32],
    pub w: &'a [f32],
    pub n: usize,
    pub cfg: &'a GptqConfig,
}

impl Polish<'_> {
    /// Apply `lab`'s steps to `q`, whose (error, energy) is `parts`; returns the seconds spent.
    pub fn run(
        &self,
        q: &mut QuantizedWeight,
        parts: &mut Option<(f64, f64)>,
        den: f64,
        lab: &Lab,
        phases: &mut Phases,
    ) -> Result<f64, QuantizeError> {
        let mut seconds = 0.0;
        if lab.refit_rounds > 0 {
            let mut clock = Clock::start();
            let best = parts.expect("the chosen method is measured");
            let (refined, err) = self.refine(q.clone(), best, lab.refit_rounds, phases)?;
            *q = refined;
            *parts = Some(err);
            seconds += clock.lap().seconds;
        }
        if lab.descent_passes > 0 {
            let mut clock = Clock::start();
            descend(self.w, q, self.hm, lab.descent_passes);
            let spent = clock.lap();
            phases.add(Phase::Descent, spent);
            seconds += spent.seconds;
            *parts = Some((delta_form(self.w, q, self.hm), den));
            phases.add(Phase::Compare, clock.lap());
        }
        Ok(seconds)
    }

    /// Alternate the output-error scale refit (codes fixed) with GPTQ under those scales (scales
    /// fixed), `rounds` times at most, keeping whichever weights have the lowest output error;
    /// stops early when a round finds nothing better.
    fn refine(
        &self,
        q: QuantizedWeight,
        parts: (f64, f64),
        rounds: usize,
        phases: &mut Phases,
    ) -> Result<(QuantizedWeight, (f64, f64)), QuantizeError> {
        let (w, hm) = (self.w, self.hm);
        let mut best = (q, parts);
        for _ in 0..rounds {
            let mut clock = Clock::start();
            let scales = refit_scales(w, &best.0, hm);
            phases.add(Phase::ScaleSearch, clock.lap());
            let refit = QuantizedWeight {
                scales: scales.clone(),
                ..best.0.clone()
            };
            let refit_parts = (delta_form(w, &refit, hm), parts.1);
            phases.add(Phase::Compare, clock.lap());
            let resolved = self
                .solver
                .quantize_with_scales(w, self.n, self.cfg, &scales)?;
            phases.add_solve(&resolved.times);
            let resolved_parts = (resolved.error, parts.1);
            let resolved = resolved.q;
            let before = best.1 .0;
            for cand in [(refit, refit_parts), (resolved, resolved_parts)] {
                if cand.1 .0 < best.1 .0 {
                    best = cand;
                }
            }
            if best.1 .0 >= before {
                break;
            }
        }
        Ok(best)
    }
}

/// Block-tune layer `li` after its solve ([`block_tune`]): `res` and `layer` get the tuned
/// linears and norms, and `x` (the quantized stream into the layer) is advanced through the
/// tuned layer. `y` is the float model's stream out of the layer.
pub(super) fn tune_layer(
    run: &super::Run<'_>,
    model: &SparkModel,
    layer: &mut DecoderLayer,
    (li, res): (usize, &mut LayerResult),
    x: &mut [f32],
    y: &[f32],
) -> Result<super::block_tune::LayerTuneReport, QuantizeError> {
    let (opts, windows, bar) = (run.opts, &run.windows, &run.bar);
    let bt = opts
        .recipe
        .lab
        .block_tune
        .as_ref()
        .expect("block tuning runs only when the recipe asks for it");
    let cfg = model.config();
    let ctx = model.ctx_for(layer.kind);
    let (samples, seq_len) = (windows.samples, windows.seq_len);
    let inputs = super::block_tune::LayerInputs {
        layer: li,
        ctx,
        linears: Proj::QUANTIZED.iter().map(|&p| (p, res.get(p))).collect(),
        g_proj: layer.linear(Proj::G).dequantize(),
        norms: (
            layer.input_layernorm.weight().to_vec(),
            layer.post_attention_layernorm.weight().to_vec(),
        ),
        x,
        y,
        samples,
        seq_len,
    };
    bar.set_message(format!("layer {li}: block tuning"));
    let t = super::block_tune::tune_layer(cfg, &inputs, bt, |step| {
        bar.set_message(format!(
            "layer {li}: block tuning, step {step}/{}",
            bt.steps
        ))
    })
    .map_err(|e| QuantizeError::BlockTune {
        layer: li,
        message: e.to_string(),
    })?;
    drop(inputs);
    for (p, q) in t.linears {
        install(layer, p, &q, opts.recipe.forward_precision);
        res.insert(p, q);
    }
    layer.input_layernorm.set_weight(t.norms.0.clone());
    layer.post_attention_layernorm.set_weight(t.norms.1.clone());
    res.norms = Some(t.norms);
    let shape = window_shape(opts, windows);
    layer
        .forward_windows(x, &shape, &ctx, |_, _| {
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap_or_else(|never| match never {});
    Ok(t.report)
}

/// Model-tune every staged layer together ([`model_tune`]) and stage the result in their place.
pub(super) fn tune_model(
    model: &SparkModel,
    out: &output::Output,
    aux: &[(Vec<f32>, Norms)],
    teacher: &[f32],
    windows: &calibration::Windows,
    mt: &super::model_tune::ModelTune,
    bar: &ProgressBar,
) -> Result<super::model_tune::ModelTuneReport, QuantizeError> {
    let cfg = model.config();
    let staged: Vec<LayerResult> = (0..aux.len())
        .map(|li| out.load_solved_layer(li))
        .collect::<Result<_, _>>()?;
    let x0 = model.embed(&windows.tokens)?;
    let head = model.lm_head().dequantize();
    let final_norm = model.final_norm_weight().to_vec();
    let inputs = super::model_tune::ModelInputs {
        layers: staged
            .iter()
            .zip(aux)
            .zip(&cfg.layer_types)
            .map(|((r, (g, norms)), &kind)| super::model_tune::ModelLayer {
                ctx: model.ctx_for(kind),
                linears: Proj::QUANTIZED.iter().map(|&p| (p, r.get(p))).collect(),
                g_proj: g.clone(),
                norms: r.norms.clone().unwrap_or_else(|| norms.clone()),
            })
            .collect(),
        x0: &x0,
        teacher,
        final_norm: &final_norm,
        head: &head,
        samples: windows.samples,
        seq_len: windows.seq_len,
    };
    bar.set_message("model tuning");
    let (tuned, report) = super::model_tune::tune_model(cfg, &inputs, mt, |step| {
        bar.set_message(format!("model tuning, step {step}/{}", mt.steps))
    })
    .map_err(|e| QuantizeError::ModelTune(e.to_string()))?;
    drop(inputs);
    let layers: Vec<LayerResult> = tuned
        .into_iter()
        .zip(staged)
        .map(|(t, mut r)| {
            for (p, q) in t.linears {
                r.insert(p, q);
            }
            r.norms = Some(t.norms);
            r
        })
        .collect();
    out.stage_model_tuned(&layers)?;
    Ok(report)
}

/// What model tuning needs of each layer besides its staged result: the untuned `g_proj` and
/// the checkpoint's norms (block tuning's, when it ran, are staged with the layer). Empty when
/// the recipe does not model-tune.
pub(super) fn model_tune_aux(
    opts: &QuantizeOptions,
    layers: &[DecoderLayer],
) -> Vec<(Vec<f32>, Norms)> {
    if opts.recipe.lab.model_tune.is_none() {
        return Vec::new();
    }
    layers
        .iter()
        .map(|l| {
            (
                l.linear(Proj::G).dequantize(),
                (
                    l.input_layernorm.weight().to_vec(),
                    l.post_attention_layernorm.weight().to_vec(),
                ),
            )
        })
        .collect()
}
