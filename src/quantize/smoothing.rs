//! Smoothing a float layer before its GPTQ solve (`--smooth`, docs/QUANTIZE.md): the four inputs
//! of a decoder layer, each folded into what produces it, so the written checkpoint keeps the
//! architecture and the GPTQ v1 layout:
//!
//! | input | read by | the division folds into |
//! |---|---|---|
//! | `h = norm(x)` | q, k, v (and the bf16 `g_proj`, whose columns take the factor too) | `input_layernorm.weight` |
//! | gated attention `a` | `out_proj` | the rows of `v_proj` (one factor per KV channel, shared by its query heads) |
//! | `h2 = norm(x)` | gate, up | `post_attention_layernorm.weight` |
//! | `gelu(gate)·up` | `down_proj` | the rows of `up_proj` |
//!
//! Exponents are chosen on the float layer (its inputs from the already quantized layers below),
//! before any of its linears is solved: the `out_proj` and `down_proj` factors move rows of
//! `v_proj` and `up_proj`, which are solved first.

use crate::checkpoint::layout::ProjInput;
use crate::checkpoint::write::OwnedTensor;
use crate::checkpoint::{SparkConfig, TensorStore};
use crate::model::block::Ctx;
use crate::model::kv_cache::LayerKvCache;
use crate::model::{DecoderLayer, DenseLinear, Proj};
use crate::quant::smooth::{
    divide_columns, divide_rows, pow2, scale_columns, ActRounding, SmoothProblem, Smoothing,
    MAX_EXP,
};

/// Rows the exponents are chosen from (a strided subset of the calibration rows; attention
/// statistics from whole leading samples).
pub const SAMPLE_ROWS: usize = 4096;

/// The staged tensor holding one input's exponents (resume files).
pub fn key(p: ProjInput) -> &'static str {
    match p {
        ProjInput::AttnNorm => "smooth.attn_norm",
        ProjInput::Attention => "smooth.attention",
        ProjInput::MlpNorm => "smooth.mlp_norm",
        ProjInput::MlpAct => "smooth.mlp_act",
    }
}

const INPUTS: [ProjInput; 4] = [
    ProjInput::AttnNorm,
    ProjInput::Attention,
    ProjInput::MlpNorm,
    ProjInput::MlpAct,
];

/// The GPTQ-quantized linears reading input `p` (their weights decide its factors).
fn readers(p: ProjInput) -> Vec<Proj> {
    Proj::QUANTIZED
        .into_iter()
        .filter(|q| q.input() == p)
        .collect()
}

/// What a written tensor takes from its layer's smoothing.
#[derive(Debug, Clone, Copy)]
pub enum Fold {
    /// The norm producing this input: divided.
    Norm(ProjInput),
    /// `g_proj` (16-bit, reads the smoothed `h`): its columns multiplied.
    GProj,
}

/// One layer's exponents (the input is divided by 2^e), per point.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerSmoothing {
    pub points: Vec<(ProjInput, Smoothing)>,
}

impl LayerSmoothing {
    pub fn get(&self, p: ProjInput) -> Option<&Smoothing> {
        self.points.iter().find(|(q, _)| *q == p).map(|(_, s)| s)
    }

    /// A norm weight of the written checkpoint: `input_layernorm` divided by the q/k/v exponents,
    /// `post_attention_layernorm` by the gate/up ones (exact: powers of two).
    pub fn fold_norm(&self, p: ProjInput, w: &mut [f32]) {
        if let Some(s) = self.get(p) {
            w.iter_mut()
                .zip(&s.exponents)
                .for_each(|(v, &e)| *v *= pow2(-e));
        }
    }

    /// `g_proj` of the written checkpoint: it reads the smoothed `h`, so its columns take the
    /// factor back.
    pub fn fold_g_proj(&self, w: &mut [f32], k: usize) {
        if let Some(s) = self.get(ProjInput::AttnNorm) {
            scale_columns(w, k, &s.exponents, None);
        }
    }
}

/// Strided rows of `x` (`[rows, k]`), at most [`SAMPLE_ROWS`].
fn sample(x: &[f32], rows: usize, k: usize) -> (Vec<f32>, usize) {
    let step = rows.div_ceil(SAMPLE_ROWS).max(1);
    let picked: Vec<f32> = x
        .chunks_exact(k)
        .step_by(step)
        .flat_map(|r| r.iter().copied())
        .collect();
    let n = picked.len() / k;
    (picked, n)
}

/// A layer's float weights, to be modified and installed back.
fn take(layer: &DecoderLayer, p: Proj) -> Vec<f32> {
    layer.linear(p).dequantize()
}

fn put(layer: &mut DecoderLayer, p: Proj, w: Vec<f32>, cfg: &SparkConfig) {
    let [n, k] = p.shape(cfg);
    layer.set_linear(p, Box::new(DenseLinear::new(w.into(), n, k)));
}

fn choose(
    x: &[f32],
    rows: usize,
    k: usize,
    weights: &[&Vec<f32>],
    cfg: &SparkConfig,
    readers: &[Proj],
    group_size: usize,
    act: ActRounding,
    classes: Option<&[usize]>,
) -> Smoothing {
    let (xs, n) = sample(x, rows, k);
    let ws: Vec<(&[f32], usize)> = weights
        .iter()
        .zip(readers)
        .map(|(w, p)| (w.as_slice(), p.shape(cfg)[0]))
        .collect();
    SmoothProblem {
        x: &xs,
        rows: n,
        k,
        weights: &ws,
        group_size,
        act,
        classes,
    }
    .choose()
}

fn only_down() -> bool {
    std::env::var("SPARK_SMOOTH_ONLY_DOWN").is_ok()
}

/// Smooth the attention half of `layer`: the q/k/v input (`h`, divided in place) and the
/// `out_proj` input (from the float attention of the leading samples).
#[allow(clippy::too_many_arguments)]
pub fn smooth_attention(
    layer: &mut DecoderLayer,
    h: &mut [f32],
    samples: usize,
    seq_len: usize,
    ctx: &Ctx,
    group_size: usize,
    act: ActRounding,
    out: &mut LayerSmoothing,
) {
    let cfg = ctx.cfg;
    let (hidden, q_dim, hd) = (cfg.hidden_size, cfg.q_dim(), cfg.head_dim);
    let rows = samples * seq_len;

    let readers = &readers(ProjInput::AttnNorm)[..];
    let mut ws: Vec<Vec<f32>> = readers.iter().map(|&p| take(layer, p)).collect();
    let s = choose(
        h,
        rows,
        hidden,
        &ws.iter().collect::<Vec<_>>(),
        cfg,
        readers,
        group_size,
        act,
        None,
    );
    if s.alpha.is_some() && !only_down() {
        for (w, &p) in ws.iter_mut().zip(readers) {
            scale_columns(w, hidden, &s.exponents, None);
            put(layer, p, std::mem::take(w), cfg);
        }
        let mut g = take(layer, Proj::G);
        scale_columns(&mut g, hidden, &s.exponents, None);
        put(layer, Proj::G, g, cfg);
        fold_into_norm(layer, ProjInput::AttnNorm, &s);
        divide_columns(h, &s.exponents);
    }
    let s = if only_down() {
        Smoothing {
            exponents: vec![0; s.exponents.len()],
            alpha: None,
            estimate_ratio: 1.0,
        }
    } else {
        s
    };
    out.points.push((ProjInput::AttnNorm, s));
    drop(ws);

    // The out_proj input: gated attention of whole leading samples (causal, so rows are not
    // independent).
    let n_samples = samples.min(SAMPLE_ROWS.div_ceil(seq_len)).max(1);
    let mut a = Vec::with_capacity(n_samples * seq_len * q_dim);
    for sidx in 0..n_samples {
        let mut cache = LayerKvCache::new(cfg, layer.kind, seq_len);
        a.extend(layer.self_attn.attend(
            &h[sidx * seq_len * hidden..(sidx + 1) * seq_len * hidden],
            seq_len,
            0,
            &mut cache,
            ctx,
        ));
    }
    // Output channel h·hd + d of query head h reads KV head h / group's channel d.
    let classes: Vec<usize> = (0..q_dim)
        .map(|j| (j / hd) / cfg.gqa_group() * hd + j % hd)
        .collect();
    let wo = take(layer, Proj::Out);
    let s = choose(
        &a,
        n_samples * seq_len,
        q_dim,
        &[&wo],
        cfg,
        &[Proj::Out],
        group_size,
        act,
        Some(&classes),
    );
    if s.alpha.is_some() && !only_down() {
        let mut wo = wo;
        scale_columns(&mut wo, q_dim, &s.exponents, Some(&classes));
        put(layer, Proj::Out, wo, cfg);
        let mut wv = take(layer, Proj::V);
        divide_rows(&mut wv, hidden, &s.exponents);
        put(layer, Proj::V, wv, cfg);
    }
    out.points.push((ProjInput::Attention, s));
}

/// Smooth the MLP half of `layer`: the gate/up input (`h2`, divided in place) and the
/// `down_proj` input (from the float MLP on sampled rows).
pub fn smooth_mlp(
    layer: &mut DecoderLayer,
    h2: &mut [f32],
    rows: usize,
    ctx: &Ctx,
    group_size: usize,
    act: ActRounding,
    out: &mut LayerSmoothing,
) {
    let cfg = ctx.cfg;
    let (hidden, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let readers = &readers(ProjInput::MlpNorm)[..];
    let mut ws: Vec<Vec<f32>> = readers.iter().map(|&p| take(layer, p)).collect();
    let s = choose(
        h2,
        rows,
        hidden,
        &ws.iter().collect::<Vec<_>>(),
        cfg,
        readers,
        group_size,
        act,
        None,
    );
    if s.alpha.is_some() && !only_down() {
        for (w, &p) in ws.iter_mut().zip(readers) {
            scale_columns(w, hidden, &s.exponents, None);
            put(layer, p, std::mem::take(w), cfg);
        }
        fold_into_norm(layer, ProjInput::MlpNorm, &s);
        divide_columns(h2, &s.exponents);
    }
    let s = if only_down() {
        Smoothing {
            exponents: vec![0; s.exponents.len()],
            alpha: None,
            estimate_ratio: 1.0,
        }
    } else {
        s
    };
    out.points.push((ProjInput::MlpNorm, s));
    drop(ws);

    let (hs, n) = sample(h2, rows, hidden);
    let act_rows = layer.mlp.act(&hs, n, ctx);
    let wd = take(layer, Proj::Down);
    let s = choose(
        &act_rows,
        n,
        inter,
        &[&wd],
        cfg,
        &[Proj::Down],
        group_size,
        act,
        None,
    );
    if s.alpha.is_some() {
        let mut wd = wd;
        scale_columns(&mut wd, inter, &s.exponents, None);
        put(layer, Proj::Down, wd, cfg);
        let mut wu = take(layer, Proj::Up);
        divide_rows(&mut wu, hidden, &s.exponents);
        put(layer, Proj::Up, wu, cfg);
    }
    out.points.push((ProjInput::MlpAct, s));
}

/// Divide the norm that produces input `p` by its exponents.
fn fold_into_norm(layer: &mut DecoderLayer, p: ProjInput, s: &Smoothing) {
    let norm = match p {
        ProjInput::AttnNorm => &mut layer.input_layernorm,
        ProjInput::MlpNorm => &mut layer.post_attention_layernorm,
        ProjInput::Attention | ProjInput::MlpAct => {
            unreachable!("only the norms' outputs fold into a norm")
        }
    };
    norm.weight_mut()
        .iter_mut()
        .zip(&s.exponents)
        .for_each(|(v, &e)| *v *= pow2(-e));
}

/// The report of the linear named `name` (its module path ends in the projection's module).
pub fn report_for(s: &LayerSmoothing, name: &str) -> Option<super::SmoothReport> {
    let (_, sm) = s
        .points
        .iter()
        .find(|(p, _)| readers(*p).iter().any(|r| name.ends_with(r.module())))?;
    Some(super::SmoothReport {
        alpha: sm.alpha,
        estimate_ratio: sm.estimate_ratio,
        max_exponent: sm.exponents.iter().map(|e| e.abs()).max().unwrap_or(0),
    })
}

/// The staged tensors of a layer's smoothing (`--resume` and the final write read them back):
/// per input its exponents and `[α or NaN, estimate ratio]`.
pub fn tensors(s: &LayerSmoothing) -> Vec<OwnedTensor> {
    let mut t = Vec::new();
    for (p, sm) in &s.points {
        let e: Vec<f32> = sm.exponents.iter().map(|&e| e as f32).collect();
        t.push(OwnedTensor::f32(key(*p), vec![e.len()], &e));
        let meta = [sm.alpha.unwrap_or(f32::NAN), sm.estimate_ratio as f32];
        t.push(OwnedTensor::f32(
            &format!("{}.meta", key(*p)),
            vec![2],
            &meta,
        ));
    }
    t
}

/// [`tensors`] read back; empty when the layer was not smoothed.
pub fn read(store: &TensorStore) -> Result<LayerSmoothing, String> {
    let mut out = LayerSmoothing::default();
    for p in INPUTS {
        let Some(e) = store.get(key(p)) else {
            continue;
        };
        let e = store
            .to_f32(e)
            .map_err(|err| format!("{}: {err}", key(p)))?;
        let meta_key = format!("{}.meta", key(p));
        let meta = store
            .get(&meta_key)
            .and_then(|m| store.to_f32(m).ok())
            .filter(|m| m.len() == 2)
            .ok_or_else(|| format!("missing {meta_key}"))?;
        let mut exponents = Vec::with_capacity(e.len());
        for v in e {
            if !(v.fract() == 0.0 && v.abs() <= MAX_EXP as f32) {
                return Err(format!(
                    "{}: exponent {v} is not an integer in ±{MAX_EXP}",
                    key(p)
                ));
            }
            exponents.push(v as i8);
        }
        out.points.push((
            p,
            Smoothing {
                exponents,
                alpha: (!meta[0].is_nan()).then_some(meta[0]),
                estimate_ratio: meta[1] as f64,
            },
        ));
    }
    Ok(out)
}
