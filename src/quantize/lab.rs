//! The recipe's research options (`[lab]` in a recipe file): scale refit, coordinate descent,
//! block and model tuning. docs/FIDELITY.md measures each within the spread of the default
//! recipe or behind it, so their solvers are built only with `--features lab` (tuning pulls in
//! `candle`); these settings and report types are always built, so a default build reads a lab
//! recipe and refuses it by name instead of failing to parse it.

use serde::{Deserialize, Serialize};

use crate::checkpoint::{Proj, SparkConfig};

/// Whether this build has the lab's solvers.
pub const AVAILABLE: bool = cfg!(feature = "lab");

/// Windows per forward when a tuned state is scored on all of them.
pub const SCORE_CHUNK: usize = 8;

/// The research options of a recipe; the default runs none of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Lab {
    /// Rounds of output-error scale refit ↔ fixed-scale GPTQ after the solve (0 = none).
    pub refit_rounds: usize,
    /// Passes of coordinate descent on the codes after the solve (0 = none).
    pub descent_passes: usize,
    /// Tune each layer's codes, scales and norms to the float block's output after its solve.
    pub block_tune: Option<BlockTune>,
    /// After every layer is solved, tune all group scales and norm gains together to the float
    /// model's next-token distribution.
    pub model_tune: Option<ModelTune>,
}

impl Lab {
    /// Whether the recipe asks for none of the lab's options.
    pub fn is_off(&self) -> bool {
        *self == Lab::default()
    }
}

/// The settings of a block tuning run (defaults: the measured recipe of docs/FIDELITY.md).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BlockTune {
    /// Optimiser steps per layer.
    pub steps: usize,
    /// Calibration windows per step.
    pub batch: usize,
    /// Adam's step for the code offsets V.
    pub lr: f64,
    /// Adam's step for the group scale factors.
    pub scale_lr: f64,
    /// Adam's step for the norm gain factors (0: norms not tuned).
    pub norm_lr: f64,
    /// Score the stored state on all windows every this many steps and keep the best (0: never).
    pub check: usize,
    pub seed: u64,
    /// Feed every quantized linear its input rounded per token to int8 (W4A8 numerics,
    /// straight-through), so the tuning sees what `int4_scaled_mm_cpu` multiplies.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub int8_inputs: bool,
}

impl Default for BlockTune {
    fn default() -> Self {
        BlockTune {
            steps: 200,
            batch: 8,
            lr: 2e-2,
            scale_lr: 4e-3,
            norm_lr: 1e-3,
            check: 25,
            seed: 0,
            int8_inputs: false,
        }
    }
}

/// What tuning did to one layer (quant_report.json `block_tune_layers`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerTuneReport {
    pub layer: usize,
    /// The block's output error ‖y − ŷ‖² / ‖y‖² on all calibration windows with GPTQ's weights.
    pub error_before: f64,
    /// The same with the weights written (equal to `error_before` when GPTQ's were kept).
    pub error_after: f64,
    /// Codes that differ from GPTQ's, of all codes of the tuned linears.
    pub codes_moved: u64,
    pub codes: u64,
    /// Whether the tuned state was written (false: it did not lower the error; GPTQ's kept).
    pub tuned: bool,
    pub seconds: f64,
    /// Mean wall time of one optimiser step (forward and backward of a batch, Adam).
    pub step_seconds: f64,
}

/// Private bytes a layer's tuning holds at its peak beyond the quantizer's own (a copy of the
/// quantized stream into the layer; per tuned weight its codes, offsets, Adam moments, gradient,
/// best state and the differentiable weight's intermediates; one batch's activations with what
/// the backward keeps).
pub fn block_tune_bytes(cfg: &SparkConfig, rows: usize, opts: &BlockTune, seq_len: usize) -> u64 {
    let f = 4u128;
    let params: u128 = Proj::QUANTIZED
        .iter()
        .map(|p| p.shape(cfg).iter().product::<usize>() as u128)
        .sum();
    let tokens = (opts.batch.max(SCORE_CHUNK) * seq_len) as u128;
    let (h, q, kv, inter) = (
        cfg.hidden_size as u128,
        cfg.q_dim() as u128,
        cfg.kv_dim() as u128,
        cfg.intermediate_size as u128,
    );
    let per_token = f * (16 * h + 10 * q + 8 * kv + 10 * inter);
    let scores = f * 8 * (cfg.num_attention_heads as u128) * tokens * seq_len as u128;
    let total = rows as u128 * h * f + params * f * 14 + tokens * per_token + scores;
    total.min(u64::MAX as u128) as u64
}

/// The settings of a model tuning run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelTune {
    pub steps: usize,
    /// Calibration windows per step.
    pub batch: usize,
    /// Adam's step for the group scale factors.
    pub scale_lr: f64,
    /// Adam's step for the norm gain factors (0: norms not tuned).
    pub norm_lr: f64,
    /// Adam's step for the code offsets (0: codes fixed).
    pub codes_lr: f64,
    /// Score the stored state on all windows every this many steps and keep the best (0: never).
    pub check: usize,
    pub seed: u64,
    /// Feed every quantized linear its input rounded per token to int8 (W4A8 numerics,
    /// straight-through), so the tuning sees what `int4_scaled_mm_cpu` multiplies.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub int8_inputs: bool,
}

impl Default for ModelTune {
    fn default() -> Self {
        ModelTune {
            steps: 200,
            batch: 4,
            scale_lr: 1e-3,
            norm_lr: 5e-4,
            codes_lr: 0.0,
            check: 50,
            seed: 0,
            int8_inputs: false,
        }
    }
}

/// What model tuning did (quant_report.json `model_tune_result`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelTuneReport {
    /// Mean KL(float ‖ quantized) per token on all calibration windows before tuning.
    pub kl_before: f64,
    /// The same with the state written.
    pub kl_after: f64,
    pub tuned: bool,
    pub codes_moved: u64,
    pub seconds: f64,
    pub step_seconds: f64,
}

/// Private bytes model tuning holds at its peak beyond the quantizer's own: the embedded
/// windows; per weight of every layer its codes, offsets, best and initial states and the
/// differentiable weight's intermediates with their gradients (all layers are in one graph);
/// one batch's activations through every layer with what the backward keeps; the head in f32
/// and a batch's logits with their softmax terms and gradients.
pub fn model_tune_bytes(cfg: &SparkConfig, rows: usize, opts: &ModelTune, seq_len: usize) -> u64 {
    let f = 4u128;
    let layers = cfg.num_hidden_layers as u128;
    let params: u128 = Proj::QUANTIZED
        .iter()
        .map(|p| p.shape(cfg).iter().product::<usize>() as u128)
        .sum::<u128>()
        * layers;
    let tokens = (opts.batch.max(SCORE_CHUNK) * seq_len) as u128;
    let (h, q, kv, inter, vocab) = (
        cfg.hidden_size as u128,
        cfg.q_dim() as u128,
        cfg.kv_dim() as u128,
        cfg.intermediate_size as u128,
        cfg.vocab_size as u128,
    );
    let per_token = f * (16 * h + 10 * q + 8 * kv + 10 * inter) * layers;
    let scores = f * 8 * (cfg.num_attention_heads as u128) * tokens * seq_len as u128 * layers;
    let head = f * (2 * vocab * h + 6 * tokens * vocab);
    let total = rows as u128 * h * f + params * f * 14 + tokens * per_token + scores + head;
    total.min(u64::MAX as u128) as u64
}
