//! `quantize`: a Spark2_5 checkpoint → a GPTQ v1 W4A8/W4A16 checkpoint.
//!
//! Layer-sequential with quantized-input propagation and the true-sequential
//! order inside each layer, in one forward per layer (the layer's own
//! [`DecoderLayer::forward_windows`], solving at its taps):
//! ```text
//! x ─ norm ─ h ─[H_qkv]→ GPTQ q,k,v ─ gated attention ─ a ─[H_o]→ GPTQ out_proj ─ x += out(a)
//!   ─ norm ─ h2 ─[H_gu]→ GPTQ gate,up ─ act ─[H_down]→ GPTQ down ─ x += down(act) → next layer
//! ```
//! Every later stage runs with the weights already quantized, so each
//! Hessian sees the inputs the deployed model will produce. One Hessian and
//! one Cholesky per distinct input, shared by the projections that read it.

#[cfg(feature = "lab")]
pub mod block_tune;
pub mod lab;
#[cfg(feature = "lab")]
mod lab_solve;
#[cfg(feature = "lab")]
pub mod model_tune;
pub mod output;
pub mod phases;
pub mod plan;
pub mod recipe;
mod streams;
#[cfg(feature = "lab")]
mod tune_loop;

pub use recipe::{Recipe, SolvedTensor};

use crate::calibration;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use rayon::prelude::*;
use serde::Serialize;

use crate::checkpoint::layout::layer_prefix;
use crate::checkpoint::Checkpoint;
use crate::checkpoint::SparkConfig;
use crate::device::{WeightFormat, WeightPath};
use crate::formats::gguf::mix::FileType;
use crate::model::block::{residual_add, Ctx, Site, Tap, WindowShape};
use crate::model::{Bf16Data, DecoderLayer, DenseLinear, DenseWeight, Linear, Proj, SparkModel};
use crate::quant::gptaq::{
    self, stream_target, CrossMoment, DampedFactor, FloatOutputTarget, OutputMoment,
};
use crate::quant::timing::Clock;
use crate::quant::{
    delta_form, quadratic_form, rtn, GptqConfig, GptqSolver, Grid, Hessian, QuantizedWeight,
    ScaleRule,
};
use crate::tokenizer::SparkTokenizer;
use phases::{Phase, PhaseReport, Phases};

/// What each linear's solve reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Objective {
    /// W·X̃ from the input X̃ the quantized layers below deliver (classic GPTQ).
    QuantizedInput,
    /// W·X, the float model's output, from X̃ (GPTAQ; [`crate::quant::gptaq`]).
    FloatOutput,
    /// As `FloatOutput`, except that `out_proj` and `down_proj`, whose outputs the residual adds
    /// to the stream, reproduce the float model's stream after their add: their target output
    /// is y + α·(s − s̃), the float output plus the part of what the quantized stream s̃ lacks of
    /// the float stream s that the calibration shows to be predictable, α from a split half
    /// ([`crate::quant::gptaq::stream_weight`], [`crate::quant::gptaq::stream_target`]). The
    /// default, measured best on both testbeds at every calibration size (docs/FIDELITY.md).
    FloatStream,
}

impl Objective {
    /// Whether the float model's stream is carried beside the quantized one (the objectives
    /// that reproduce the float model).
    pub fn carries_float_stream(self) -> bool {
        matches!(self, Objective::FloatOutput | Objective::FloatStream)
    }
}

/// What the calibration forward feeds each linear (and so what its Hessian is made of).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardPrecision {
    /// Every linear's input rounded to bf16 and the already quantized linears' weights too, as
    /// vLLM feeds a GPTQ checkpoint's linears (and as GPTQ's references compute from a bf16
    /// model); products exact, sums f32 — `vdpbf16ps`, twice the f32 GEMM's rate. The default
    /// for GPTQ checkpoints.
    Bf16,
    /// f32 inputs and f32 weights: what llama.cpp feeds (the default for GGUF).
    F32,
}

/// Which quantizer writes the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Round to nearest with max/7.5 scales (baseline).
    Rtn = 0,
    /// GPTQ with max/7.5 scales.
    Gptq = 1,
    /// GPTQ with the importance-weighted scale search (the default).
    GptqSearch = 2,
}

/// One quantize run: the recipe (what decides the output's bytes) and how to run it.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    pub model_dir: PathBuf,
    pub out_dir: PathBuf,
    pub recipe: Recipe,
    /// The probe's decision behind the format, with its reasons (the report records it).
    pub path: WeightPath,
    pub resume: bool,
    pub force: bool,
    /// Run even when the memory plan exceeds the available memory.
    pub force_memory: bool,
    pub progress: bool,
    /// Also measure RTN and plain GPTQ on every linear (the report's comparison columns).
    pub compare: bool,
    /// Also write the dequantized f32 weight of every quantized linear, exactly
    /// as the quantizer used it, to this safetensors file (for decoder checks).
    pub dump_dequantized: Option<PathBuf>,
    /// Stop with [`QuantizeError::Interrupted`] after this many layers (tests of `--resume`).
    pub stop_after_layers: Option<usize>,
    /// On Ctrl-C or SIGTERM, keep the finished layers for `--resume` and say so (false where
    /// the caller offers no resume, as `export-phone`'s own solve: its staging is then removed).
    pub keep_on_interrupt: bool,
    /// Writes a page about the run into the finished checkpoint folder before it is committed
    /// (the CLI passes the HTML report's writer; the pipeline does not depend on `report`).
    pub page: Option<PageWriter>,
}

/// See [`QuantizeOptions::page`].
pub type PageWriter =
    fn(&Path, &QuantReport) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;

impl QuantizeOptions {
    /// A run of `recipe` from `model_dir` to `out_dir` with the defaults of a library caller:
    /// no progress, no comparison columns, nothing kept on interrupt, no page.
    pub fn new(model_dir: &Path, out_dir: &Path, recipe: Recipe, path: WeightPath) -> Self {
        QuantizeOptions {
            model_dir: model_dir.to_path_buf(),
            out_dir: out_dir.to_path_buf(),
            recipe,
            path,
            resume: false,
            force: false,
            force_memory: false,
            progress: false,
            compare: false,
            dump_dequantized: None,
            stop_after_layers: None,
            keep_on_interrupt: false,
            page: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct LinearReport {
    pub name: String,
    pub out_features: usize,
    pub in_features: usize,
    /// ‖(W − Q)X‖² / ‖WX‖² on the calibration inputs of this linear.
    /// Error of the weights written.
    pub error: f64,
    /// Each method's error, when measured (all three with `compare`).
    pub rtn_error: Option<f64>,
    pub gptq_error: Option<f64>,
    pub gptq_search_error: Option<f64>,
    pub damp: f64,
    pub dead_columns: usize,
    pub seconds: f64,
    /// W4A8 only: the relative output error the per-token int8 rounding of this linear's input
    /// adds with the weights written (same denominator as `error`; a sample of the calibration
    /// rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_error: Option<f64>,
    /// float-stream: the weight α of this linear's stream correction ([`gptaq::stream_weight`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_weight: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct QuantReport {
    pub spark_tool: String,
    /// Everything that decided the output's bytes (also `recipe.toml` beside a checkpoint).
    pub recipe: Recipe,
    pub model: String,
    pub out: String,
    pub scale_rule: ScaleRule,
    /// What each layer's linears were solved to reproduce (the recipe's, or none for RTN).
    pub objective: Objective,
    pub path: WeightPath,
    pub calibration_files: Vec<String>,
    pub calibration_sha256: String,
    pub samples: usize,
    pub seq_len: usize,
    pub linears: Vec<LinearReport>,
    pub mean_error: f64,
    pub mean_rtn_error: Option<f64>,
    pub mean_gptq_error: Option<f64>,
    pub mean_gptq_search_error: Option<f64>,
    /// W4A8: the mean of every linear's `act_error` (what the int8 activation rounding adds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_act_error: Option<f64>,
    /// How far the quantized model's residual stream s̃ is from the float model's s after the last
    /// layer, ‖s̃ − s‖² / ‖s‖² over the calibration tokens: what the objectives that carry the float
    /// stream work against. None without the float stream, and after model tuning (which changes
    /// every layer once the stream has passed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_error: Option<f64>,
    pub bits_per_weight: f64,
    pub output_bytes: u64,
    pub wall_seconds: f64,
    /// CPU seconds of all threads (user + system) over the run.
    pub cpu_seconds: f64,
    /// Worker threads (rayon) the run had.
    pub threads: usize,
    /// `cpu_seconds` ÷ `wall_seconds` ÷ `threads`.
    pub cpu_utilisation: f64,
    /// Wall and CPU time per phase (docs/SCALE.md).
    pub phases: Vec<PhaseReport>,
    /// Peak of the whole resident set (includes checkpoint pages mapped from disk).
    pub peak_rss_bytes: Option<u64>,
    /// Peak private (anonymous) memory, sampled every 20 ms.
    pub peak_private_bytes: Option<u64>,
    /// What the run planned to hold at its peak, before it started.
    pub memory_plan: plan::MemoryPlan,
    pub resumed_from_layer: Option<usize>,
    /// What the lab's block tuning did to each layer, when it ran.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub block_tune_layers: Vec<lab::LayerTuneReport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_tune_result: Option<lab::ModelTuneReport>,
}

impl QuantReport {
    /// float-stream: the mean, least and largest stream-correction weight α over the linears that
    /// have one, and how many do.
    pub fn stream_weights(&self) -> Option<(f64, f64, f64, usize)> {
        let w: Vec<f64> = self
            .linears
            .iter()
            .filter_map(|l| l.stream_weight)
            .collect();
        let n = w.len();
        (n > 0).then(|| {
            let (lo, hi) = w
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
                    (lo.min(v), hi.max(v))
                });
            (w.iter().sum::<f64>() / n as f64, lo, hi, n)
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Calibration(#[from] calibration::CalibrationError),
    #[error(transparent)]
    Gptq(#[from] crate::quant::GptqError),
    #[error(transparent)]
    Format(#[from] crate::formats::gptq::GptqFormatError),
    #[error(transparent)]
    Gguf(#[from] crate::formats::gguf::GgufError),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Artifact(#[from] crate::artifact::ArtifactError),
    #[error(transparent)]
    Resources(#[from] crate::resources::ResourceError),
    #[error("writing the report page: {0}")]
    Page(Box<dyn std::error::Error + Send + Sync>),
    #[error("{0}")]
    Invalid(String),
    #[error(
        "stopped after {0} layers as requested; continue with {resume}",
        resume = crate::setting::Setting::Resume
    )]
    Interrupted(usize),
    #[error(transparent)]
    Write(#[from] crate::checkpoint::write::WriteError),
    #[error("{}: {source}", path.display())]
    Json {
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "the {layers} completed layer(s) are kept in {dir} ({size}): rerun with {resume} to continue \
         from them, or delete that folder to free the space",
        size = crate::resources::human(*bytes as u128),
        resume = crate::setting::Setting::Resume
    )]
    KeptForResume {
        dir: PathBuf,
        layers: usize,
        bytes: u64,
        #[source]
        source: Box<QuantizeError>,
    },
    #[error(
        "the memory plan needs {plan}, but {have} is available — lower {samples} or {seq_len} \
         (the calibration activations), or pass {force} to run anyway",
        have = crate::resources::human(*have as u128),
        samples = crate::setting::Setting::Samples,
        seq_len = crate::setting::Setting::SeqLen,
        force = crate::setting::Setting::ForceMemory
    )]
    Memory { plan: plan::MemoryPlan, have: u64 },
    #[error("layer {layer}: non-finite activations entering {what} (NaN/Inf); the checkpoint or an earlier quantized layer is broken")]
    NonFiniteActivations { layer: usize, what: &'static str },
    #[error(transparent)]
    Recipe(#[from] recipe::RecipeError),
    #[error("layer {layer}: block tuning failed: {message}")]
    BlockTune { layer: usize, message: String },
    #[error("model tuning failed: {0}")]
    ModelTune(String),
}

/// The quantized linears of one layer, as written: one per [`Proj::QUANTIZED`]; with block
/// tuning also its two norm weights.
#[derive(Default)]
pub struct LayerResult {
    linears: BTreeMap<Proj, QuantizedWeight>,
    /// (input_layernorm, post_attention_layernorm) as tuned (bf16 values).
    pub norms: Option<Norms>,
    /// What block tuning did to the layer.
    pub tune: Option<lab::LayerTuneReport>,
}

/// A layer's two norm weights: (input_layernorm, post_attention_layernorm).
pub type Norms = (Vec<f32>, Vec<f32>);

impl LayerResult {
    pub fn get(&self, p: Proj) -> &QuantizedWeight {
        &self.linears[&p]
    }

    pub fn take(&mut self, p: Proj) -> QuantizedWeight {
        self.linears
            .remove(&p)
            .expect("every quantized projection is in a layer's result")
    }

    pub fn insert(&mut self, p: Proj, q: QuantizedWeight) {
        self.linears.insert(p, q);
    }

    pub fn iter(&self) -> impl Iterator<Item = (Proj, &QuantizedWeight)> {
        self.linears.iter().map(|(p, q)| (*p, q))
    }
}

fn check_finite(x: &[f32], layer: usize, what: &'static str) -> Result<(), QuantizeError> {
    if x.iter().all(|v| v.is_finite()) {
        Ok(())
    } else {
        Err(QuantizeError::NonFiniteActivations { layer, what })
    }
}

/// One linear (or a block of its output rows) solved with `opts.recipe.method`, and with `compare` by
/// every method: the written weights, each measured method's output error as
/// (‖ΔX‖², ‖WX‖²), and the seconds of the written method.
struct Solved {
    q: QuantizedWeight,
    parts: [Option<(f64, f64)>; 3],
    seconds: f64,
}

/// One shared input's Hessian, factored once for every linear that reads it.
struct Factored<'a> {
    solver: &'a GptqSolver,
    /// H as a dense f32 matrix, for the errors measured against it.
    hm: &'a [f32],
    h: &'a Hessian,
}

/// Solve one linear `w` (`[n, k]`; `energy`: tr(WHWᵀ) when a float target gave it) on `grid`
/// with the recipe's method, and with `opts.compare` the other methods for the report.
fn solve_linear(
    f: &Factored<'_>,
    (w, energy): (&[f32], Option<f64>),
    n: usize,
    (grid, group_size): (Grid, usize),
    opts: &QuantizeOptions,
    phases: &mut Phases,
) -> Result<Solved, QuantizeError> {
    let (solver, hm, h) = (f.solver, f.hm, f.h);
    let (k, method) = (h.dim(), opts.recipe.method);
    let cfg = |rule| GptqConfig {
        group_size,
        block_size: 128,
        damp: opts.recipe.damp,
        rule,
        grid,
    };
    let variants: Vec<Method> = if opts.compare {
        vec![Method::Rtn, Method::Gptq, Method::GptqSearch]
    } else {
        vec![method]
    };
    let mut parts = [None; 3];
    let mut chosen = None;
    let mut seconds = 0.0;
    // tr(WHWᵀ) once (or as the float-output target gave it): every variant's error is relative
    // to it.
    let mut clock = Clock::start();
    let den = energy.unwrap_or_else(|| quadratic_form(w, n, k, hm));
    phases.add(Phase::Compare, clock.lap());
    for &v in &variants {
        let (q, times, num) = match v {
            Method::Rtn => (
                rtn(w, n, k, h, group_size, ScaleRule::MaxOver7_5, grid),
                Default::default(),
                None,
            ),
            Method::Gptq | Method::GptqSearch => {
                let s = solver.quantize_timed(w, n, &cfg(opts.recipe.scale_rule(v)))?;
                (s.q, s.times, Some(s.error))
            }
        };
        let solved = clock.lap();
        let num = num.unwrap_or_else(|| delta_form(w, &q, hm));
        phases.add(Phase::Compare, clock.lap());
        parts[v as usize] = Some((num, den));
        if v == method {
            seconds = solved.seconds;
            if v == Method::Rtn {
                phases.add(Phase::ScaleSearch, solved);
            } else {
                phases.add_solve(&times);
            }
            chosen = Some(q);
        } else {
            phases.add(Phase::Compare, solved);
        }
    }
    #[allow(unused_mut)]
    let mut q = chosen.expect("the chosen method is always among the variants");
    #[cfg(feature = "lab")]
    if method != Method::Rtn {
        let polish = lab_solve::Polish {
            solver,
            hm,
            w,
            n,
            cfg: &cfg(opts.recipe.scale_rule(method)),
        };
        seconds += polish.run(
            &mut q,
            &mut parts[method as usize],
            den,
            &opts.recipe.lab,
            phases,
        )?;
    }
    Ok(Solved { q, parts, seconds })
}

/// The report row of a linear from its solved blocks' error parts.
fn linear_report(
    name: &str,
    n: usize,
    solver: &GptqSolver,
    parts: &[[Option<(f64, f64)>; 3]],
    seconds: f64,
    method: Method,
) -> LinearReport {
    let error = |v: Method| -> Option<f64> {
        let (mut num, mut den) = (0.0, 0.0);
        for p in parts {
            let (a, b) = p[v as usize]?;
            num += a;
            den += b;
        }
        Some(if den > 0.0 { num / den } else { 0.0 })
    };
    LinearReport {
        name: name.to_string(),
        out_features: n,
        in_features: solver.dim(),
        error: error(method).expect("measured"),
        rtn_error: error(Method::Rtn),
        gptq_error: error(Method::Gptq),
        gptq_search_error: error(Method::GptqSearch),
        damp: solver.damp_used,
        dead_columns: solver.dead_columns(),
        seconds,
        act_error: None,
        stream_weight: None,
    }
}

/// Quantize every linear that reads `h` with `opts.recipe.method`; with `opts.compare`,
/// RTN, plain GPTQ and GPTQ + scale search are all measured for the report.
fn quantize_group(
    names: &[String],
    (weights, energies): (&[Vec<f32>], &[Option<f64>]),
    outs: &[usize],
    grids: &[(Grid, usize)],
    h: &Hessian,
    opts: &QuantizeOptions,
    phases: &mut Phases,
) -> Result<(Vec<QuantizedWeight>, Vec<LinearReport>), QuantizeError> {
    let mut clock = Clock::start();
    let solver = GptqSolver::with_order(&names.join("+"), h, opts.recipe.damp, opts.recipe.order)?;
    let factor = clock.lap();
    phases.add(Phase::Factor, factor);
    let setup = factor.seconds / names.len() as f64;
    // One f32 copy of H serves every error measured against it.
    let hm = phases.time(Phase::Compare, || h.matrix_f32());
    let (mut kept, mut reports) = (Vec::new(), Vec::new());
    for ((((name, w), &n), &grid), &energy) in
        names.iter().zip(weights).zip(outs).zip(grids).zip(energies)
    {
        let f = Factored {
            solver: &solver,
            hm: &hm,
            h,
        };
        let s = solve_linear(&f, (w, energy), n, grid, opts, phases)?;
        reports.push(linear_report(
            name,
            n,
            &solver,
            &[s.parts],
            setup + s.seconds,
            opts.recipe.method,
        ));
        kept.push(s.q);
    }
    Ok((kept, reports))
}

/// Rows W4A8's activation rounding is measured on (strided over the calibration rows).
const ACT_ERROR_ROWS: usize = 1024;

/// A strided sample of at most [`ACT_ERROR_ROWS`] rows of `x` (`[rows, k]`, windows of
/// `seq_len` rows) and its row count. The stride is coprime to `seq_len`, so every position in
/// the window is sampled equally often: a stride that divides it would return the same few
/// positions of every window, position 0's (the first token's, often the loudest) among them.
fn act_rounding_sample(x: &[f32], rows: usize, seq_len: usize, k: usize) -> (Vec<f32>, usize) {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut step = (rows / ACT_ERROR_ROWS).max(1);
    while step > 1 && gcd(step, seq_len.max(1)) != 1 {
        step -= 1;
    }
    let xs: Vec<f32> = x
        .chunks_exact(k)
        .step_by(step)
        .take(ACT_ERROR_ROWS)
        .flatten()
        .copied()
        .collect();
    let m = xs.len() / k;
    (xs, m)
}

/// What W4A8's dynamic per-token int8 rounding of the input adds to a linear's output error, with
/// the weights written: ‖(Q(X) − X)·Ŵᵀ‖² / ‖X·Ŵᵀ‖² on the sample `x` (`[m, K]`), `written` the
/// installed dequantized weights. Up to Ŵ for W in the denominator (the weights' own relative
/// error, ≈ 10⁻³) the denominator of [`LinearReport::error`], so the two add up to first order
/// (docs/FIDELITY.md); a ratio on the same rows, so loud rows weigh in both.
fn act_rounding_error(x: &[f32], m: usize, written: &dyn Linear) -> f64 {
    let k = written.in_features();
    // [X; A] with Q(X) = sa·A per row: the int8 codes A are bf16 values like X (bf16 forward),
    // so one pass of the bf16 GEMM gives both products (Q(X) − X itself is not, and would take
    // the f32 GEMM: 80 % of this estimate's time at the 1.7B shape).
    let mut both = Vec::with_capacity(2 * x.len());
    both.extend_from_slice(x);
    both.resize(2 * x.len(), 0.0);
    let (x, codes) = both.split_at_mut(x.len());
    let mut a = vec![0i32; k];
    let sa: Vec<f32> = x
        .chunks_exact(k)
        .zip(codes.chunks_exact_mut(k))
        .map(|(row, c)| {
            let sa = crate::kernels::w4::quantize_activation_row(row, &mut a);
            for (c, &q) in c.iter_mut().zip(&a) {
                *c = q as f32;
            }
            sa
        })
        .collect();
    let y = written.project(&both, 2 * m);
    let n = y.len() / (2 * m);
    let (y, ya) = y.split_at(y.len() / 2);
    let (mut num, mut den) = (0f64, 0f64);
    for ((y, ya), &sa) in y.chunks_exact(n).zip(ya.chunks_exact(n)).zip(&sa) {
        for (&v, &va) in y.iter().zip(ya) {
            // In f64: the difference is ≈ 1 % of either product.
            let d = sa as f64 * va as f64 - v as f64;
            num += d * d;
            den += (v as f64) * (v as f64);
        }
    }
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

fn install(layer: &mut DecoderLayer, proj: Proj, q: &QuantizedWeight, fp: ForwardPrecision) {
    let (w, n, k) = (q.dequantize(), q.out_features, q.in_features);
    let lin = match fp {
        ForwardPrecision::F32 => DenseLinear::new(w.into(), n, k),
        ForwardPrecision::Bf16 => {
            let bits: Vec<u16> = w
                .par_iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            DenseLinear::from_weight(DenseWeight::Bf16(Bf16Data::Owned(bits.into())), n, k)
        }
    };
    layer.set_linear(proj, Box::new(lin));
}

/// A linear's input as the calibration forward feeds it: rounded to bf16 values with
/// [`ForwardPrecision::Bf16`].
fn linear_input(mut v: Vec<f32>, fp: ForwardPrecision) -> Vec<f32> {
    if fp == ForwardPrecision::Bf16 {
        crate::kernels::convert::round_bf16_in_place(&mut v);
    }
    v
}

/// One layer's solve: what its steps share and what they have produced so far.
struct LayerSolve<'a> {
    cfg: &'a SparkConfig,
    li: usize,
    rows: usize,
    /// Rows per calibration window: `rows` is whole windows of it.
    seq_len: usize,
    opts: &'a QuantizeOptions,
    result: LayerResult,
    reports: Vec<LinearReport>,
    phases: &'a mut Phases,
}

impl LayerSolve<'_> {
    /// One true-sequential step: the projections `projs` of `layer`, which all read `input`
    /// (`[rows, K]`), are quantized against its Hessian and installed, so that later stages
    /// see the deployed numerics. With `float` (the float model's input of the same stage, or the
    /// one projection's float output, or under float-stream its stream target) each is solved for
    /// the W* that reproduces it.
    fn step(
        &mut self,
        layer: &mut DecoderLayer,
        projs: &[Proj],
        input: &[f32],
        float: Option<Float>,
    ) -> Result<(), QuantizeError> {
        let cfg = self.cfg;
        let mut h = Hessian::new(projs[0].shape(cfg)[1]);
        self.phases.time(Phase::Hessian, || h.add(input, self.rows));
        let names: Vec<String> = projs
            .iter()
            .map(|p| format!("{}{}", layer_prefix(self.li), p.module()))
            .collect();
        let outs: Vec<usize> = projs.iter().map(|p| p.shape(cfg)[0]).collect();
        let grids: Vec<(Grid, usize)> = projs
            .iter()
            .map(|&proj| {
                let t = SolvedTensor::Linear {
                    layer: self.li,
                    proj,
                };
                self.opts.recipe.grid_of(t, cfg)
            })
            .collect();
        let mut weights: Vec<Vec<f32>> = self.phases.time(Phase::Install, || {
            projs
                .iter()
                .map(|&p| layer.linear(p).dequantize())
                .collect()
        });
        // Each linear's tr(WHWᵀ) where the target gives it for free.
        let mut energies = vec![None; projs.len()];
        let mut stream_weight = None;
        if let Some(float) = float {
            // Solve for W* (the float output from this input) instead of W.
            let (damp, seq_len) = (self.opts.recipe.damp, self.seq_len);
            let target = self.phases.time(Phase::Hessian, || match float {
                Float::Inputs(xf) => {
                    let mut c = CrossMoment::new(h.dim());
                    c.add(input, xf, self.rows);
                    FloatOutputTarget::new(&h, &c, self.opts.recipe.damp)
                }
                Float::Outputs(y) => {
                    assert_eq!(outs.len(), 1, "an output moment belongs to one linear");
                    let mut m = OutputMoment::new(outs[0], h.dim());
                    m.add(y, input, self.rows);
                    FloatOutputTarget::from_outputs(&h, &m, damp)
                }
                Float::Stream { y, xf, x } => {
                    assert_eq!(outs.len(), 1, "an output moment belongs to one linear");
                    let factor = DampedFactor::new(&h, damp)?;
                    let w = gptaq::stream_weight(&factor, input, (xf, x), outs[0], seq_len);
                    stream_target(y, xf, x, w as f32);
                    stream_weight = Some(w);
                    let mut m = OutputMoment::new(outs[0], h.dim());
                    m.add(y, input, self.rows);
                    Some(FloatOutputTarget::on(factor, &m))
                }
            });
            let target = target.ok_or_else(|| {
                QuantizeError::Invalid(format!(
                    "layer {}: the Hessian of {} stays singular with its damping raised 10⁵-fold; raise the recipe's damp (--set damp=0.1)",
                    self.li,
                    names.join("+"),
                ))
            })?;
            for ((w, &n), e) in weights.iter_mut().zip(&outs).zip(&mut energies) {
                let star = self.phases.time(Phase::Factor, || target.apply(w, n));
                *e = self.phases.time(Phase::Compare, || target.energy(w, &star));
                *w = star;
            }
        }
        let (qs, mut reports) = quantize_group(
            &names,
            (&weights, &energies),
            &outs,
            &grids,
            &h,
            self.opts,
            self.phases,
        )?;
        if let Some(r) = reports.first_mut() {
            r.stream_weight = stream_weight;
        }
        drop(h);
        let clock = Clock::start();
        for (&p, q) in projs.iter().zip(qs) {
            install(layer, p, &q, self.opts.recipe.forward_precision);
            self.result.insert(p, q);
        }
        self.phases.add(Phase::Install, clock.elapsed());
        if self.opts.recipe.format == WeightFormat::W4A8 && self.opts.recipe.gguf.is_none() {
            let k = projs[0].shape(cfg)[1];
            let (xs, m) = self.phases.time(Phase::Compare, || {
                act_rounding_sample(input, self.rows, self.seq_len, k)
            });
            for (r, &p) in reports.iter_mut().zip(projs) {
                r.act_error = Some(self.phases.time(Phase::Compare, || {
                    act_rounding_error(&xs, m, layer.linear(p))
                }));
            }
        }
        self.reports.extend(reports);
        Ok(())
    }
}

/// What the float model's stream gives a step of the float objectives.
enum Float<'a> {
    /// The float model's input of the stage (`[rows, K]`): the cross moment, for any linears.
    Inputs(&'a [f32]),
    /// The target output of the stage's one linear (`[rows, N]`): the output moment, cheaper when
    /// N < K (`down_proj`; docs/QUANTIZE.md "Objective").
    Outputs(&'a [f32]),
    /// float-stream, for a linear the residual adds to the stream: its float output `y`
    /// (`[rows, N]`), which becomes the target in place, the float stream `xf`, which the step
    /// advances by it, and the quantized stream `x` before the add.
    Stream {
        y: &'a mut [f32],
        xf: &'a mut [f32],
        x: &'a [f32],
    },
}

/// The float model's stream beside the quantized one (the float objectives). Each of its stages
/// is computed at the tap before the linears it passes are solved, while they are still float.
struct FloatTrack<'a> {
    xf: &'a mut [f32],
    /// float-stream: `out_proj` and `down_proj` are solved for the float stream after their add.
    stream: bool,
    /// The float input of the next site: the attention after q/k/v, the MLP activation after
    /// gate/up.
    next_input: Option<Vec<f32>>,
}

impl FloatTrack<'_> {
    /// Solve the tap's linears for the float model's output, and advance the float stream.
    fn step(
        &mut self,
        solve: &mut LayerSolve<'_>,
        layer: &mut DecoderLayer,
        projs: &[Proj],
        tap: &Tap<'_>,
        (shape, ctx): (&WindowShape, &Ctx<'_>),
    ) -> Result<(), QuantizeError> {
        let xf = &mut *self.xf;
        match tap.site {
            Site::Qkv | Site::GateUp => {
                let h_f = solve.phases.time(Phase::Forward, || {
                    let (h_f, next) = if tap.site == Site::Qkv {
                        let h_f = layer.qkv_input(xf, shape);
                        let a_f = layer.out_input(&h_f, shape, ctx);
                        (h_f, a_f)
                    } else {
                        let h_f = layer.gate_up_input(xf, shape);
                        let a_f = layer.down_input(&h_f, shape, ctx);
                        (h_f, a_f)
                    };
                    self.next_input = Some(next);
                    h_f
                });
                solve.step(layer, projs, tap.input, Some(Float::Inputs(&h_f)))
            }
            Site::Out | Site::Down => {
                let a_f = self
                    .next_input
                    .take()
                    .expect("the site before gave a float input");
                let mut y = solve.phases.time(Phase::Forward, || {
                    layer.linear(projs[0]).project(&a_f, shape.rows())
                });
                if self.stream {
                    // The target is the float stream after the add, which the step advances;
                    // the float input is not needed.
                    drop(a_f);
                    let float = Float::Stream {
                        y: &mut y,
                        xf,
                        x: tap.stream,
                    };
                    return solve.step(layer, projs, tap.input, Some(float));
                }
                if tap.site == Site::Out {
                    solve.step(layer, projs, tap.input, Some(Float::Inputs(&a_f)))?;
                } else {
                    // down_proj has fewer outputs than inputs: its target comes from the float
                    // output.
                    drop(a_f);
                    solve.step(layer, projs, tap.input, Some(Float::Outputs(&y)))?;
                }
                solve.phases.time(Phase::Forward, || residual_add(xf, &y));
                Ok(())
            }
        }
    }
}

/// Run one layer's calibration forward, quantizing its linears in true-sequential order at the
/// forward's taps: for each group of linears, observe the input, solve, install, advance.
/// `progress.x` (`[samples·seq_len, hidden]`) is advanced in place, and `progress.xf` beside it.
fn quantize_layer(
    run: &Run<'_>,
    model: &SparkModel,
    layer: &mut DecoderLayer,
    li: usize,
    progress: &mut Progress,
    phases: &mut Phases,
) -> Result<(LayerResult, Vec<LinearReport>), QuantizeError> {
    let (opts, bar) = (run.opts, &run.bar);
    let ctx = model.ctx_for(layer.kind);
    let shape = window_shape(opts, &run.windows);
    let mut solve = LayerSolve {
        cfg: model.config(),
        li,
        rows: shape.rows(),
        seq_len: shape.seq_len,
        opts,
        result: LayerResult::default(),
        reports: Vec::new(),
        phases,
    };
    let stream = opts.recipe.effective_objective() == Objective::FloatStream;
    let (x, xf) = progress.streams.split_mut();
    let mut float = xf.map(|xf| FloatTrack {
        xf,
        stream,
        next_input: None,
    });
    // The forward's own stages count as Forward; each tap accounts for its own time.
    let mut clock = Clock::start();
    layer.forward_windows(x, &shape, &ctx, |layer, tap| {
        solve.phases.add(Phase::Forward, clock.lap());
        let (step, what, entering) = match tap.site {
            Site::Qkv => ("q/k/v", "input_layernorm", tap.stream),
            Site::Out => ("out_proj", "out_proj", tap.input),
            Site::GateUp => ("gate/up", "gate_proj/up_proj", tap.input),
            Site::Down => ("down_proj", "down_proj", tap.input),
        };
        bar.set_message(format!("layer {li}: {step}"));
        check_finite(entering, li, what)?;
        // GGUF also quantizes the head gate g_proj; GPTQ checkpoints keep it as it is.
        let all = tap.site.projs();
        let projs = match (tap.site, opts.recipe.gguf) {
            (Site::Qkv, None) => &all[..3],
            _ => all,
        };
        match float.as_mut() {
            Some(f) => f.step(&mut solve, layer, projs, &tap, (&shape, &ctx))?,
            None => solve.step(layer, projs, tap.input, None)?,
        }
        clock.lap();
        Ok::<(), QuantizeError>(())
    })?;
    solve.phases.add(Phase::Forward, clock.lap());
    Ok((solve.result, solve.reports))
}

/// The calibration windows as the layer forward runs them.
fn window_shape(opts: &QuantizeOptions, windows: &calibration::Windows) -> WindowShape {
    WindowShape {
        samples: windows.samples,
        seq_len: windows.seq_len,
        bf16_inputs: opts.recipe.forward_precision == ForwardPrecision::Bf16,
        mlp_rows: plan::MLP_ROWS,
    }
}

/// ‖a − b‖² / ‖b‖², summed in f64.
pub(crate) fn relative_distance(a: &[f32], b: &[f32]) -> f64 {
    let (d, n) = a
        .par_iter()
        .zip(b)
        .map(|(&a, &b)| {
            let (a, b) = (a as f64, b as f64);
            ((a - b) * (a - b), b * b)
        })
        .reduce(|| (0.0, 0.0), |x, y| (x.0 + y.0, x.1 + y.1));
    d / n.max(f64::MIN_POSITIVE)
}

/// Quantize the (untied) head on the final-normed residual stream, [`plan::HEAD_ROWS`] output
/// rows at a time: each row is its own GPTQ problem against the one Hessian, so the blocks give
/// the codes of the whole, without an f32 copy of the whole head (1.3 GB for the 4B).
fn quantize_head(
    model: &SparkModel,
    ck: &Checkpoint,
    x: &[f32],
    rows: usize,
    opts: &QuantizeOptions,
    phases: &mut Phases,
    block_rows: usize,
) -> Result<(QuantizedWeight, LinearReport), QuantizeError> {
    let cfg = model.config();
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let y = phases.time(Phase::Forward, || {
        linear_input(model.final_norm(x), opts.recipe.forward_precision)
    });
    let mut h = Hessian::new(hidden);
    phases.time(Phase::Hessian, || h.add(&y, rows));
    drop(y);
    let mut clock = Clock::start();
    let solver = GptqSolver::with_order("lm_head", &h, opts.recipe.damp, opts.recipe.order)?;
    let factor = clock.lap();
    phases.add(Phase::Factor, factor);
    let hm = phases.time(Phase::Compare, || h.matrix_f32());
    let tensor = if ck.layout.tied {
        "model.embedding.weight"
    } else {
        "lm_head.weight"
    };
    let (mut blocks, mut parts, mut seconds) = (Vec::new(), Vec::new(), factor.seconds);
    for r0 in (0..vocab).step_by(block_rows) {
        let r1 = (r0 + block_rows).min(vocab);
        let w = phases.time(Phase::Install, || -> Result<Vec<f32>, QuantizeError> {
            let w = crate::model::DenseWeight::load(ck, tensor, Some(r0..r1))?;
            Ok(DenseLinear::from_weight(w, r1 - r0, hidden).dequantize())
        })?;
        let tied = ck.layout.tied;
        let grid = opts.recipe.grid_of(SolvedTensor::Head { tied }, cfg);
        let f = Factored {
            solver: &solver,
            hm: &hm,
            h: &h,
        };
        let s = solve_linear(&f, (&w, None), r1 - r0, grid, opts, phases)?;
        parts.push(s.parts);
        seconds += s.seconds;
        blocks.push(s.q);
    }
    let q = match blocks.as_slice() {
        [one] => one.clone(),
        many => crate::formats::gptq::concat_outputs(&many.iter().collect::<Vec<_>>()),
    };
    let report = linear_report(
        "lm_head",
        vocab,
        &solver,
        &parts,
        seconds,
        opts.recipe.method,
    );
    Ok((q, report))
}

/// Every solved tensor's rows must be whole blocks of its GGML type: refused before the solve.
fn check_gguf_shapes(
    opts: &QuantizeOptions,
    cfg: &SparkConfig,
    (ft, tied): (FileType, bool),
) -> Result<(), QuantizeError> {
    // The metadata needs both layer types' rope parameters: refused now, not after the solve.
    crate::formats::gguf::spark::rope_pair(cfg)?;
    let mut solved = vec![SolvedTensor::Head { tied }];
    for layer in 0..cfg.num_hidden_layers {
        for &proj in opts.recipe.projs() {
            solved.push(SolvedTensor::Linear { layer, proj });
        }
    }
    for t in solved {
        let k = t.row_len(cfg);
        let (grid, gs) = opts.recipe.grid_of(t, cfg);
        let block = grid.tier_of(k).unwrap_or(gs);
        if k % block != 0 {
            let ty = opts.recipe.gguf_type(t, cfg).expect("a GGUF recipe");
            return Err(QuantizeError::Invalid(format!(
                "{}: {k} inputs are not a multiple of {block}, the block of its {} type; \
                 this model cannot be written as {}",
                t.gguf_name(),
                ty.name(),
                ft.llama_name()
            )));
        }
    }
    Ok(())
}

/// The whole command. Progress goes to stderr; the report is returned.
pub fn quantize(opts: &QuantizeOptions) -> Result<QuantReport, QuantizeError> {
    let t0 = Clock::start();
    let private = crate::resources::PrivatePeak::start();
    opts.recipe.validate()?;
    let ck = Checkpoint::open(&opts.model_dir)?;
    if ck.config.gptq.is_some() {
        return Err(QuantizeError::Invalid(format!(
            "{} is already a GPTQ checkpoint; quantize the original bf16 checkpoint",
            opts.model_dir.display()
        )));
    }
    let cfg = ck.config.clone();
    if let Some(ft) = opts.recipe.gguf {
        check_gguf_shapes(opts, &cfg, (ft, ck.layout.tied))?;
    }
    for (what, dim) in [
        ("hidden_size", cfg.hidden_size),
        ("q_dim", cfg.q_dim()),
        ("intermediate_size", cfg.intermediate_size),
    ] {
        if opts.recipe.gguf.is_none() && (dim % opts.recipe.group_size != 0 || dim % 32 != 0) {
            return Err(QuantizeError::Invalid(format!(
                "{what} = {dim} is not a multiple of the group size {} and of 32 (vLLM CPU needs K % 32 == 0)",
                opts.recipe.group_size
            )));
        }
    }
    ck.check_finite()?;
    let out = output::Output::prepare(opts, &ck)?;
    // `None` until this run owns the staging folder (a previous run's state is never removed
    // because of an error before that, e.g. a bad calibration file on a --resume).
    let mut done = None;
    let r = run(opts, &ck, &out, t0, &private, &mut done);
    match (r, done) {
        (Ok(report), _) => Ok(report),
        (Err(e), None) => Err(e),
        // Stopped on request: the state is there to resume, and the message says so.
        (Err(e @ QuantizeError::Interrupted(_)), _) => Err(e),
        // An I/O failure (disk full, a failed rename) after completed layers: their state is
        // worth keeping (hours on a real model), so say where it is and what it costs.
        (Err(e), Some(done)) if done > 0 && e.is_io() => Err(QuantizeError::KeptForResume {
            bytes: dir_bytes(out.staging_root()),
            dir: out.staging_root().to_path_buf(),
            layers: done,
            source: Box::new(e),
        }),
        // Anything else would fail again the same way: leave nothing behind.
        (Err(e), Some(_)) => {
            out.discard();
            Err(e)
        }
    }
}

/// Bytes of the files below `dir`.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

impl QuantizeError {
    /// A failure of the disk rather than of the input (retrying may succeed).
    fn is_io(&self) -> bool {
        matches!(
            self,
            QuantizeError::Artifact(crate::artifact::ArtifactError::Io { .. })
                | QuantizeError::Write(_)
        )
    }
}

/// A layer's state being written beside the next layer's solve.
struct LayerSave<'scope> {
    layer: usize,
    handle: std::thread::ScopedJoinHandle<'scope, Result<(), QuantizeError>>,
}

/// Wait for the save in flight, if any (the wait counts as [`Phase::Save`]); once it has
/// succeeded its layer counts as done.
fn finish_save(
    saving: &mut Option<LayerSave<'_>>,
    phases: &mut Phases,
    done: &mut Option<usize>,
    out: &output::Output,
    keep: bool,
) -> Result<(), QuantizeError> {
    let Some(save) = saving.take() else {
        return Ok(());
    };
    phases
        .time(Phase::Save, || save.handle.join())
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
    *done = Some(save.layer + 1);
    if keep {
        out.keep_for_resume();
    }
    Ok(())
}

/// Plan the run's memory before anything large is read; refuse a plan over the available
/// memory unless forced, and scratch files over the free disk of the staging folder.
fn plan_memory(
    opts: &QuantizeOptions,
    ck: &Checkpoint,
    out: &output::Output,
) -> Result<plan::MemoryPlan, QuantizeError> {
    let r = &opts.recipe;
    let widened: u64 = ck
        .store
        .entries()
        .filter(|e| e.dtype != safetensors::Dtype::BF16)
        .map(|e| e.numel() as u64 * 4)
        .sum();
    let rows = r.samples.saturating_mul(r.seq_len);
    let float_output = r.effective_objective().carries_float_stream();
    let mut memory_plan =
        plan::MemoryPlan::new(&ck.config, rows, widened, r.solves_head(), float_output);
    if let Some(bt) = &r.lab.block_tune {
        memory_plan.block_tune = lab::block_tune_bytes(&ck.config, rows, bt, r.seq_len);
    }
    if let Some(mt) = &r.lab.model_tune {
        memory_plan.model_tune = lab::model_tune_bytes(&ck.config, rows, mt, r.seq_len);
    }
    let have = crate::resources::memory_budget().map(|b| b.min(u64::MAX as u128) as u64);
    if opts.progress {
        let avail = have
            .map(|h| format!("; {} available", crate::resources::human(h as u128)))
            .unwrap_or_default();
        eprintln!(
            "memory plan: {memory_plan}{avail}; {} of scratch on disk for the residual streams",
            crate::resources::human(memory_plan.scratch_disk as u128)
        );
    }
    if let Some(have) = have.filter(|&h| memory_plan.total() > h && !opts.force_memory) {
        return Err(QuantizeError::Memory {
            plan: memory_plan,
            have,
        });
    }
    let scratch = out.scratch_dir();
    if let Some(free) = crate::resources::disk_budget(scratch) {
        if memory_plan.scratch_disk as u128 > free {
            return Err(QuantizeError::Invalid(format!(
                "the residual streams of {rows} calibration tokens need {} of scratch in {}, which \
                 has {} free: free disk there, or lower {} or {}",
                crate::resources::human(memory_plan.scratch_disk as u128),
                scratch.display(),
                crate::resources::human(free),
                crate::setting::Setting::Samples,
                crate::setting::Setting::SeqLen
            )));
        }
    }
    Ok(memory_plan)
}

/// The calibration windows, tokenized with the checkpoint's own tokenizer.
fn calibrate(
    opts: &QuantizeOptions,
    ck: &Checkpoint,
) -> Result<calibration::Windows, QuantizeError> {
    let tok_path = ck.tokenizer_path().ok_or_else(|| {
        QuantizeError::Invalid(format!(
            "{} has no tokenizer.json, which calibration text needs",
            opts.model_dir.display()
        ))
    })?;
    let tok = SparkTokenizer::from_file(&tok_path)?;
    let r = &opts.recipe;
    Ok(calibration::build(
        &r.calibration,
        &tok,
        r.samples,
        r.seq_len,
    )?)
}

/// Where the layer loop stands: the streams into the next layer and what the finished layers
/// reported.
struct Progress {
    /// The quantized model's residual stream, and the float model's beside it (the objectives
    /// that carry it), mapped from the file the current layer advances.
    streams: streams::Streams,
    /// The first layer still to solve.
    first: usize,
    reports: Vec<LinearReport>,
    tuned: Vec<lab::LayerTuneReport>,
    resumed_from_layer: Option<usize>,
}

/// A resumed run's progress (its finished layers never run again), or a fresh start from the
/// embedding.
fn start(
    run: &Run<'_>,
    model: &SparkModel,
    done: &mut Option<usize>,
) -> Result<Progress, QuantizeError> {
    let (opts, out) = (run.opts, run.out);
    let float_output = opts.recipe.effective_objective().carries_float_stream();
    let state = if opts.resume {
        out.load_state(&run.settings, model.num_layers())?
    } else {
        None
    };
    let progress = match state {
        Some(st) => {
            // Checked before the run owns the staging folder: a damaged streams file is an
            // error that keeps the finished layers.
            let work = out.work_streams_path(st.completed);
            let streams = streams::Streams::open(&st.streams)?.copy_to(&work)?;
            *done = Some(st.completed);
            if opts.keep_on_interrupt {
                out.keep_for_resume();
            }
            Progress {
                streams,
                first: st.completed,
                reports: st.reports,
                tuned: st.block_tune,
                resumed_from_layer: Some(st.completed),
            }
        }
        None => {
            out.reset_state()?;
            *done = Some(0);
            let x = model.embed(&run.windows.tokens)?;
            let work = out.work_streams_path(0);
            Progress {
                streams: streams::Streams::create(&work, &x, float_output.then_some(&x[..]))?,
                first: 0,
                reports: Vec::new(),
                tuned: Vec::new(),
                resumed_from_layer: None,
            }
        }
    };
    if float_output != progress.streams.has_float() {
        return Err(QuantizeError::Invalid(format!(
            "{}: the saved state does not match objective {:?}; run without {} to start over",
            opts.out_dir.display(),
            opts.recipe.effective_objective(),
            crate::setting::Setting::Resume
        )));
    }
    Ok(progress)
}

/// What every step of a run reads.
struct Run<'a> {
    opts: &'a QuantizeOptions,
    out: &'a output::Output,
    windows: calibration::Windows,
    /// The resume fingerprint of this run.
    settings: String,
    bar: ProgressBar,
}

/// Everything after the output is planned; `done` counts the layers whose state is saved.
fn run(
    opts: &QuantizeOptions,
    ck: &Checkpoint,
    out: &output::Output,
    t0: Clock,
    private: &crate::resources::PrivatePeak,
    done: &mut Option<usize>,
) -> Result<QuantReport, QuantizeError> {
    let mut phases = Phases::default();
    let memory_plan = plan_memory(opts, ck, out)?;
    let windows = calibrate(opts, ck)?;
    let mut model = SparkModel::from_checkpoint(ck, opts.progress)?;
    let layers = model.num_layers();
    let rows = windows.samples * windows.seq_len;
    let settings = output::settings_fingerprint(opts, ck, &windows.sha256)?;
    let bar = crate::artifact::progress_bar(opts.progress, layers as u64, "quantize layers");
    let run = Run {
        opts,
        out,
        windows,
        settings,
        bar,
    };
    let mut progress = start(&run, &model, done)?;
    run.bar.set_position(progress.first as u64);
    phases.add(Phase::Load, t0.elapsed());
    // Each layer is dropped once solved and its result once staged: memory holds one layer's
    // f32 weights and codes, not all of them.
    let all_layers = model.take_layers();
    #[cfg(feature = "lab")]
    let aux = lab_solve::model_tune_aux(opts, &all_layers);
    layer_loop(&run, &model, all_layers, &mut progress, &mut phases, done)?;
    let xf = progress.streams.x_float();
    let stream_error = match (&opts.recipe.lab.model_tune, xf) {
        (None, Some(xf)) => Some(relative_distance(progress.streams.x(), xf)),
        _ => None,
    };
    let model_tune_result = match (&opts.recipe.lab.model_tune, xf) {
        #[cfg(feature = "lab")]
        (Some(mt), Some(teacher)) => Some(phases.time(Phase::ModelTune, || {
            lab_solve::tune_model(&model, out, &aux, teacher, &run.windows, mt, &run.bar)
        })?),
        _ => None,
    };
    let head = if opts.recipe.solves_head() {
        run.bar.set_message("lm_head");
        let (q, r) = quantize_head(
            &model,
            ck,
            progress.streams.x(),
            rows,
            opts,
            &mut phases,
            plan::HEAD_ROWS,
        )?;
        progress.reports.push(r);
        Some(q)
    } else {
        None
    };
    run.bar.finish_and_clear();
    let mut report = QuantReport::new(opts, &run.windows, progress.reports, memory_plan);
    report.stream_error = stream_error;
    report.resumed_from_layer = progress.resumed_from_layer;
    report.block_tune_layers = progress.tuned;
    report.model_tune_result = model_tune_result;
    let write = Clock::start();
    if let Some(path) = &opts.dump_dequantized {
        out.dump_dequantized(path, &ck.config, layers, head.as_ref())?;
    }
    let (bytes, params) = match (opts.recipe.gguf, &head) {
        (Some(ft), Some(head)) => out.write_gguf(ck, ft, head, &report)?,
        _ => out.write(
            ck,
            layers,
            opts.recipe.group_size,
            head.as_ref(),
            &mut report,
        )?,
    };
    phases.add(Phase::Write, write.elapsed());
    report.output_bytes = bytes;
    report.bits_per_weight = bytes as f64 * 8.0 / params as f64;
    let total = t0.elapsed();
    report.wall_seconds = total.seconds;
    report.cpu_seconds = total.cpu_seconds;
    report.threads = rayon::current_num_threads();
    report.cpu_utilisation = total.utilisation(report.threads);
    report.phases = phases.report(report.threads);
    report.peak_rss_bytes = crate::bench::peak_rss();
    report.peak_private_bytes = private.peak();
    out.finish(&report, opts.page)?;
    Ok(report)
}

/// For each layer: observe its inputs and solve it (`quantize_layer`), then stage its result
/// for `--resume` while the next layer is solved. One save is in flight at a time, with its
/// own copy of the streams (planned in `plan::MemoryPlan`); `done` advances only once a save
/// has finished.
fn layer_loop(
    run: &Run<'_>,
    model: &SparkModel,
    all_layers: Vec<DecoderLayer>,
    progress: &mut Progress,
    phases: &mut Phases,
    done: &mut Option<usize>,
) -> Result<(), QuantizeError> {
    let (opts, out, keep) = (run.opts, run.out, run.opts.keep_on_interrupt);
    let layers = all_layers.len();
    // Every layer allocates its stages' activations (up to `rows` × 6656 f32) anew, in the same
    // pattern: freed blocks stay in the heap for the next layer instead of fresh pages.
    let heap = crate::resources::HeapReuse::new();
    let solved = std::thread::scope(|scope| -> Result<(), QuantizeError> {
        let mut saving: Option<LayerSave<'_>> = None;
        let solved = (|| -> Result<(), QuantizeError> {
            for (li, mut layer) in all_layers.into_iter().enumerate().skip(progress.first) {
                #[cfg(feature = "lab")]
                let x_in = opts
                    .recipe
                    .lab
                    .block_tune
                    .is_some()
                    .then(|| progress.streams.x().to_vec());
                #[cfg_attr(not(feature = "lab"), allow(unused_mut))]
                let (mut res, rep) = quantize_layer(run, model, &mut layer, li, progress, phases)?;
                #[cfg(feature = "lab")]
                if let (Some(mut x_in), Some(y)) = (x_in, progress.streams.x_float()) {
                    let r = phases.time(Phase::BlockTune, || {
                        lab_solve::tune_layer(run, model, &mut layer, (li, &mut res), &mut x_in, y)
                    })?;
                    progress.streams.split_mut().0.copy_from_slice(&x_in);
                    res.tune = Some(r);
                }
                drop(layer);
                finish_save(&mut saving, phases, done, out, keep)?;
                // The next layer advances a copy; this layer's file becomes its resume state.
                // After the last layer (or a requested stop) the head reads the finished
                // mapping itself, and the save syncs the file under it.
                let last = li + 1 == layers || opts.stop_after_layers == Some(li + 1);
                let file = progress.streams.path().to_path_buf();
                let finished = if last {
                    None
                } else {
                    let next = phases.time(Phase::Save, || {
                        progress.streams.copy_to(&out.work_streams_path(li + 1))
                    })?;
                    Some(std::mem::replace(&mut progress.streams, next))
                };
                progress.tuned.extend(res.tune.clone());
                let (settings, saved_rep) = (&run.settings, rep.clone());
                saving = Some(LayerSave {
                    layer: li,
                    handle: scope.spawn(move || {
                        if let Some(s) = finished {
                            s.close()?;
                        }
                        out.save_layer(li, &res, &saved_rep, &file, settings)
                    }),
                });
                progress.reports.extend(rep);
                run.bar.inc(1);
                if opts.stop_after_layers == Some(li + 1) && li + 1 < layers {
                    finish_save(&mut saving, phases, done, out, keep)?;
                    run.bar.finish_and_clear();
                    return Err(QuantizeError::Interrupted(li + 1));
                }
            }
            finish_save(&mut saving, phases, done, out, keep)
        })();
        match solved {
            // A save in flight still counts towards what is kept; if it failed, its failure came
            // first and is the one reported (as it was when saves ran in line).
            Err(e) => Err(finish_save(&mut saving, phases, done, out, keep)
                .err()
                .unwrap_or(e)),
            ok => ok,
        }
    });
    // The last layer's blocks go back to the system before the head and the write.
    drop(heap);
    solved
}

impl QuantReport {
    /// The report of a run before its output is written (sizes, times and memory are filled in
    /// after).
    fn new(
        opts: &QuantizeOptions,
        windows: &calibration::Windows,
        linears: Vec<LinearReport>,
        memory_plan: plan::MemoryPlan,
    ) -> Self {
        let n = linears.len().max(1) as f64;
        let mean = |f: &dyn Fn(&LinearReport) -> f64| linears.iter().map(f).sum::<f64>() / n;
        let mean_opt = |f: &dyn Fn(&LinearReport) -> Option<f64>| -> Option<f64> {
            let v: Option<Vec<f64>> = linears.iter().map(f).collect();
            v.map(|v| v.iter().sum::<f64>() / v.len().max(1) as f64)
        };
        let r = &opts.recipe;
        QuantReport {
            spark_tool: env!("CARGO_PKG_VERSION").into(),
            model: opts.model_dir.display().to_string(),
            out: opts.out_dir.display().to_string(),
            scale_rule: r.scale_rule(r.method),
            objective: r.effective_objective(),
            path: opts.path.clone(),
            calibration_files: r
                .calibration
                .iter()
                .map(|p| crate::bundled::record_name(p))
                .collect(),
            calibration_sha256: windows.sha256.clone(),
            samples: windows.samples,
            seq_len: windows.seq_len,
            mean_error: mean(&|l| l.error),
            mean_rtn_error: mean_opt(&|l| l.rtn_error),
            mean_gptq_error: mean_opt(&|l| l.gptq_error),
            mean_gptq_search_error: mean_opt(&|l| l.gptq_search_error),
            mean_act_error: mean_opt(&|l| l.act_error),
            stream_error: None,
            linears,
            bits_per_weight: 0.0,
            output_bytes: 0,
            wall_seconds: 0.0,
            cpu_seconds: 0.0,
            threads: 0,
            cpu_utilisation: 0.0,
            phases: Vec::new(),
            peak_rss_bytes: None,
            peak_private_bytes: None,
            memory_plan,
            resumed_from_layer: None,
            block_tune_layers: Vec::new(),
            model_tune_result: None,
            recipe: r.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CpuFeatures, Priority, Target};
    use rand::{Rng, SeedableRng};

    fn options(method: Method, compare: bool) -> QuantizeOptions {
        let recipe = Recipe {
            group_size: 32,
            method,
            order: crate::quant::Order::Natural,
            signed_scales: false,
            objective: Objective::QuantizedInput,
            calibration: Vec::new(),
            samples: 1,
            seq_len: 1,
            ..Recipe::default()
        };
        let path = crate::device::decide(&CpuFeatures::default(), Target::X86, Priority::Speed);
        let mut o = QuantizeOptions::new(&PathBuf::new(), &PathBuf::new(), recipe, path);
        o.compare = compare;
        o.keep_on_interrupt = true;
        o
    }

    /// Inputs with strongly correlated columns (where GPTQ's error feedback pays) and two
    /// weights that read them.
    fn case() -> (Hessian, Vec<Vec<f32>>) {
        let (k, rows) = (64, 256);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let mut x = vec![0f32; rows * k];
        for r in 0..rows {
            let common: f32 = rng.random_range(-1.0..1.0);
            for c in 0..k {
                x[r * k + c] = common + 0.3 * rng.random_range(-1.0f32..1.0);
            }
        }
        let mut h = Hessian::new(k);
        h.add(&x, rows);
        let w = |n: usize, rng: &mut rand_chacha::ChaCha8Rng| -> Vec<f32> {
            (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect()
        };
        let ws = vec![w(48, &mut rng), w(16, &mut rng)];
        (h, ws)
    }

    #[test]
    fn linears_sharing_an_input_get_one_solve_and_a_report_each() {
        let (h, ws) = case();
        let names = ["a".to_string(), "b".to_string()];
        let (qs, reports) = quantize_group(
            &names,
            (&ws, &[None, None]),
            &[48, 16],
            &[(Grid::VLLM, 32); 2],
            &h,
            &options(Method::GptqSearch, true),
            &mut Phases::default(),
        )
        .unwrap();
        assert_eq!(qs.len(), 2);
        assert_eq!((qs[0].out_features, qs[1].out_features), (48, 16));
        for (r, name) in reports.iter().zip(&names) {
            assert_eq!(&r.name, name);
            let (rtn, gptq, search) = (
                r.rtn_error.unwrap(),
                r.gptq_error.unwrap(),
                r.gptq_search_error.unwrap(),
            );
            // The written weights are the chosen method's; GPTQ beats rounding on correlated inputs.
            assert_eq!(r.error, search);
            assert!(gptq < rtn, "{name}: gptq {gptq} vs rtn {rtn}");
            assert!(r.error > 0.0 && r.error < 0.1, "{name}: {}", r.error);
        }
    }

    #[test]
    fn without_compare_only_the_chosen_method_is_measured() {
        let (h, ws) = case();
        let (_, reports) = quantize_group(
            &["a".into()],
            (&ws[..1], &[None]),
            &[48],
            &[(Grid::VLLM, 32)],
            &h,
            &options(Method::Rtn, false),
            &mut Phases::default(),
        )
        .unwrap();
        let r = &reports[0];
        assert_eq!(r.rtn_error, Some(r.error));
        assert_eq!((r.gptq_error, r.gptq_search_error), (None, None));
    }

    #[test]
    fn the_head_in_blocks_of_rows_is_the_head_in_one() {
        let ck = Checkpoint::open(&crate::bundled_fixture()).unwrap();
        let model = SparkModel::from_checkpoint(&ck, false).unwrap();
        let tokens: Vec<u32> = (0..96).map(|i| (i * 37 % 4000) as u32 + 1).collect();
        let x = model.embed(&tokens).unwrap();
        let mut o = options(Method::GptqSearch, true);
        o.recipe.group_size = 64;
        let run = |block| {
            quantize_head(
                &model,
                &ck,
                &x,
                tokens.len(),
                &o,
                &mut Phases::default(),
                block,
            )
            .unwrap()
        };
        let vocab = ck.config.vocab_size;
        let (whole, rw) = run(vocab);
        let (blocks, rb) = run(1000);
        assert_eq!((blocks.out_features, blocks.in_features), (vocab, 256));
        assert_eq!(whole.codes, blocks.codes);
        assert_eq!(whole.scales, blocks.scales);
        // Errors summed over blocks of rows: the same up to the order of the f64 sums.
        for (a, b) in [
            (rw.error, rb.error),
            (rw.rtn_error.unwrap(), rb.rtn_error.unwrap()),
            (rw.gptq_error.unwrap(), rb.gptq_error.unwrap()),
        ] {
            assert!((a - b).abs() <= 1e-9 * a, "{a} vs {b}");
        }
    }

    #[test]
    fn non_finite_activations_name_the_layer_and_the_linear_they_feed() {
        assert!(check_finite(&[0.0, 1.0], 3, "down_proj").is_ok());
        let e = check_finite(&[0.0, f32::NAN], 3, "down_proj")
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer 3") && e.contains("down_proj"), "{e}");
        assert!(check_finite(&[f32::INFINITY], 0, "out_proj").is_err());
    }

    #[test]
    fn the_activation_sample_visits_every_window_position_equally() {
        // Row r holds r: the sample says which rows it took.
        for (samples, seq_len) in [(32, 512), (128, 512), (3, 100), (1, 64)] {
            let rows = samples * seq_len;
            let x: Vec<f32> = (0..rows).map(|r| r as f32).collect();
            let (xs, m) = act_rounding_sample(&x, rows, seq_len, 1);
            assert_eq!(m, rows.min(ACT_ERROR_ROWS), "{samples} × {seq_len}");
            let mut per_pos = vec![0usize; seq_len];
            for &r in &xs {
                per_pos[r as usize % seq_len] += 1;
            }
            let (lo, hi) = (per_pos.iter().min().unwrap(), per_pos.iter().max().unwrap());
            assert!(
                hi - lo <= 1,
                "{samples} × {seq_len}: positions {lo}..{hi} times"
            );
        }
    }

    #[test]
    fn activation_rounding_error_is_zero_on_the_int8_grid_and_grows_with_the_crest() {
        let (m, k, n) = (4, 64, 8);
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let lin = DenseLinear::new(w.clone().into(), n, k);
        // Rows whose largest magnitude is 127 and whose values are integers: int8 holds them exactly.
        let on_grid: Vec<f32> = (0..m * k)
            .map(|i| {
                if i % k == 0 {
                    127.0
                } else {
                    ((i * 37) % 255) as f32 - 127.0
                }
            })
            .collect();
        assert_eq!(act_rounding_error(&on_grid, m, &lin), 0.0);
        // The same random rows, once flat and once with one loud channel: the loud channel
        // coarsens every other channel's step, so the error grows (roughly with crest²).
        let flat: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut loud = flat.clone();
        loud.chunks_exact_mut(k).for_each(|r| r[3] = 40.0);
        let (ef, el) = (
            act_rounding_error(&flat, m, &lin),
            act_rounding_error(&loud, m, &lin),
        );
        assert!(ef > 0.0 && ef < 1e-4, "{ef}");
        assert!(el > 10.0 * ef, "{el} vs {ef}");
        // Against a direct evaluation of the definition.
        let direct = {
            let (mut num, mut den) = (0f64, 0f64);
            for row in flat.chunks_exact(k) {
                let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                let q: Vec<f32> = row
                    .iter()
                    .map(|v| (amax / 127.0) * (v * (127.0 / amax)).round_ties_even())
                    .collect();
                for wr in w.chunks_exact(k) {
                    let y: f64 = row.iter().zip(wr).map(|(a, b)| (a * b) as f64).sum();
                    let yq: f64 = q.iter().zip(wr).map(|(a, b)| (a * b) as f64).sum();
                    num += (yq - y).powi(2);
                    den += y * y;
                }
            }
            num / den
        };
        // f32 sums of the kernel against f64 here: well inside 1 %.
        assert!((ef / direct - 1.0).abs() < 1e-2, "{ef} vs {direct}");
    }
}
