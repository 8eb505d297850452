//! The native calibrator: the float step graph's arithmetic (export/graph.rs), tensor by tensor
//! under the graph's own names, evaluated for every calibration token at once — each MatMul one
//! GEMM over all tokens, attention per window — instead of one ONNX Runtime step per token.
//!
//! The values are the ones the token-by-token decode produces: token `i` of a window at position
//! `p` attends to the entries an app's caches hold at that step (the last `min(p, past)` tokens and
//! itself), and a cache slot not yet written holds zeros, so its score is exactly 0 and its masked
//! score the mask value. Weights and constants are read from the part graphs themselves (the same
//! `WeightSpec`s the writer resolves, norm constants from their initializers), so folds, the
//! attention scale and GPTQ dequantization are the graph's. Summation order differs from ONNX
//! Runtime's, so ranges agree to float rounding, not bit for bit (tests/phone.rs).

use std::collections::HashMap;

use rayon::prelude::*;

use super::super::graph::{self, PartPlan, WeightSpec};
use super::super::onnx::{Graph, Source};
use super::super::qdq::Ranges;
use super::super::weights::WeightReader;
use super::super::{ExportError, ExportOptions};
use crate::artifact;
use crate::calibration::Windows;
use crate::checkpoint::{Checkpoint, SparkConfig};
use crate::kernels;
use crate::model::rope::Rope;

/// Calibration tokens evaluated together (whole windows; at least one).
const CHUNK_TOKENS: usize = 2048;
/// Vocabulary rows of the head materialised in f32 at a time.
const HEAD_BLOCK: usize = 8192;

/// Private bytes the native calibration holds at its peak beyond the residual streams: one
/// layer's f32 weights (plus one matrix's transient copy: GPTQ weights are dequantized `[K, N]`),
/// one chunk's activations, one block of the head and its logits.
pub(in super::super) fn plan_bytes(cfg: &SparkConfig, opts: &ExportOptions) -> u128 {
    let (h, qd, kvd, inter, nh) = (
        cfg.hidden_size as u128,
        cfg.q_dim() as u128,
        cfg.kv_dim() as u128,
        cfg.intermediate_size as u128,
        cfg.num_attention_heads as u128,
    );
    let layer = (qd + 2 * kvd + nh) * h + qd * h + 3 * h * inter;
    let largest = h * inter.max(qd).max(cfg.vocab_size.min(HEAD_BLOCK) as u128);
    let seq = opts.calib_seq_len.min(opts.context).max(1);
    let chunk = (seq * (CHUNK_TOKENS / seq).max(1)) as u128;
    let acts = 6 * h + 4 * qd + 3 * kvd + 3 * inter + nh;
    let head = 2 * HEAD_BLOCK as u128 * h + chunk * HEAD_BLOCK as u128;
    4 * (layer + largest + chunk * acts.max(HEAD_BLOCK as u128) + head)
}

/// Ranges of every float tensor of `graphs` that the token-by-token decode over `windows` would
/// produce (graph inputs the host builds — masks, cos/sin, the embedding — excepted).
pub(super) fn ranges(
    ck: &Checkpoint,
    opts: &ExportOptions,
    windows: &Windows,
    plans: &[PartPlan],
    graphs: &[Graph<WeightSpec>],
    reader: &mut WeightReader,
    mask_value: f32,
) -> Result<Ranges, ExportError> {
    let cfg = &ck.config;
    let h = cfg.hidden_size;
    let seq = windows.seq_len;
    let tokens = windows.samples * seq;
    let per_chunk = (CHUNK_TOKENS / seq).max(1) * seq;
    let mut taps = Ranges::default();

    // The residual stream of every calibration token, starting from its embedding row.
    let e = ck.entry("model.embedding.weight")?;
    let mut x = vec![0f32; tokens * h];
    for (row, &t) in x.chunks_exact_mut(h).zip(&windows.tokens) {
        let r = ck.store.rows_to_f32(e, t as usize, t as usize + 1)?;
        row.copy_from_slice(&r[..h]);
    }
    ck.store.release_rows(e, 0, e.shape[0]);
    let ropes: HashMap<_, _> = cfg
        .layer_types
        .iter()
        .map(|&t| {
            let rope = Rope::new(cfg.rope_for(t));
            let angles: Vec<_> = (0..seq).map(|p| rope.angles(p)).collect();
            (t, (rope.rotary_dims(), angles))
        })
        .collect();
    let units = cfg.num_hidden_layers as u64 + 1;
    let pb = artifact::progress_bar(opts.progress, units, "calibrating");
    for (g, plan) in graphs.iter().zip(plans) {
        let part = PartGraph::new(g);
        for l in plan.layers.clone() {
            pb.set_message(format!("layer {l}"));
            let t = cfg.layer_types[l];
            let layer = Layer {
                cfg,
                part: &part,
                p: format!("l{l}"),
                l,
                past: graph::past_len(cfg, t, opts.context),
                rope: &ropes[&t],
                seq,
                mask_value,
                w: LayerWeights::read(&part, reader, &format!("l{l}"))?,
            };
            for chunk in x.chunks_mut(per_chunk * h) {
                layer.forward(chunk, &mut taps)?;
            }
            pb.inc(1);
        }
        if plan.head {
            pb.set_message("head");
            head(cfg, &part, reader, &x, &mut taps)?;
        } else {
            taps.observe(graph::HIDDEN_OUT, &x);
        }
    }
    pb.inc(1);
    pb.finish_and_clear();
    Ok(taps)
}

/// A layer type's rotated width and (cos, sin) at each position of a window, as the host
/// computes them for each step.
type RopeTable = (usize, Vec<(Vec<f32>, Vec<f32>)>);

/// A part graph's initializers by name: the weights' specs and the constants' values.
struct PartGraph<'g> {
    inits: HashMap<&'g str, &'g Source<WeightSpec>>,
}

impl<'g> PartGraph<'g> {
    fn new(g: &'g Graph<WeightSpec>) -> Self {
        PartGraph {
            inits: g
                .inits
                .iter()
                .map(|i| (i.info.name.as_str(), &i.source))
                .collect(),
        }
    }

    fn missing(name: &str) -> ExportError {
        ExportError::Calibration(format!(
            "the float graph has no initializer `{name}` the native calibrator mirrors \
             (export/graph.rs and export/calibrate/native.rs disagree)"
        ))
    }

    fn spec(&self, name: &str) -> Result<&'g WeightSpec, ExportError> {
        match self.inits.get(name) {
            Some(Source::Deferred(s)) => Ok(s),
            _ => Err(Self::missing(name)),
        }
    }

    /// An f32 constant, or None when the graph has no initializer of that name.
    fn constant(&self, name: &str) -> Option<Vec<f32>> {
        match self.inits.get(name) {
            Some(Source::Bytes(b)) => Some(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            _ => None,
        }
    }
}

/// A MatMul weight of the graph (`[K, N]` there) as `[N, K]` rows, what the GEMM takes.
struct Mat {
    nk: Vec<f32>,
    n: usize,
    k: usize,
}

impl Mat {
    fn read(reader: &mut WeightReader, spec: &WeightSpec) -> Result<Mat, ExportError> {
        Ok(Mat {
            nk: reader.matrix_nk(spec)?,
            n: spec.rows.len(),
            k: spec.k,
        })
    }

    /// `x[t, K] · W` → `[t, N]`.
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let t = x.len() / self.k;
        let mut y = vec![0f32; t * self.n];
        kernels::matmul().matmul_nt(x, t, self.k, &self.nk, self.n, &mut y);
        y
    }
}

struct LayerWeights {
    q: Mat,
    k: Mat,
    v: Mat,
    g: Mat,
    o: Mat,
    gate: Mat,
    up: Mat,
    down: Mat,
}

impl LayerWeights {
    fn read(part: &PartGraph, reader: &mut WeightReader, p: &str) -> Result<Self, ExportError> {
        let mut m = |w: &str| Mat::read(reader, part.spec(&format!("{p}_{w}"))?);
        Ok(LayerWeights {
            q: m("wq")?,
            k: m("wk")?,
            v: m("wv")?,
            g: m("wg")?,
            o: m("wo")?,
            gate: m("wgate")?,
            up: m("wup")?,
            down: m("wdown")?,
        })
    }
}

/// Running min/max, NaN ignored (as [`Ranges::observe`]).
#[derive(Clone, Copy)]
struct MinMax(f32, f32);

impl MinMax {
    const EMPTY: MinMax = MinMax(f32::INFINITY, f32::NEG_INFINITY);
    #[inline]
    fn add(&mut self, v: f32) {
        if v < self.0 {
            self.0 = v;
        }
        if v > self.1 {
            self.1 = v;
        }
    }
    fn merge(self, o: MinMax) -> MinMax {
        MinMax(self.0.min(o.0), self.1.max(o.1))
    }
}

fn observe(taps: &mut Ranges, name: &str, m: MinMax) {
    taps.observe(name, &[m.0, m.1]);
}

fn merge_all<const N: usize>(a: [MinMax; N], b: [MinMax; N]) -> [MinMax; N] {
    std::array::from_fn(|i| a[i].merge(b[i]))
}

/// `f` over pairs of rows of two equally long buffers, in parallel.
fn zip_map(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; a.len()];
    out.par_chunks_mut(1 << 14)
        .zip(a.par_chunks(1 << 14).zip(b.par_chunks(1 << 14)))
        .for_each(|(o, (x, y))| {
            for ((o, x), y) in o.iter_mut().zip(x).zip(y) {
                *o = f(*x, *y);
            }
        });
    out
}

fn map(a: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; a.len()];
    out.par_chunks_mut(1 << 14)
        .zip(a.par_chunks(1 << 14))
        .for_each(|(o, x)| {
            for (o, x) in o.iter_mut().zip(x) {
                *o = f(*x);
            }
        });
    out
}

/// `x / sqrt(Σx² + H·eps)` per row (the graph's `LpNormalization` of `[x, √(H·eps)]`, sliced),
/// then the norm weight's `Mul` where the graph has one. Taps `{p}_aug`, `_lp`, `_out`, `_scaled`.
fn norm(
    part: &PartGraph,
    p: &str,
    x: &[f32],
    h: usize,
    taps: &mut Ranges,
) -> Result<Vec<f32>, ExportError> {
    let eps = format!("{p}_eps_col");
    let c = part
        .constant(&eps)
        .and_then(|v| v.first().copied())
        .ok_or_else(|| PartGraph::missing(&eps))?;
    let mut out = vec![0f32; x.len()];
    let (lp_c, unit) = out
        .par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .map(|(o, r)| {
            let ss = r.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() + (c as f64).powi(2);
            let norm = ss.sqrt() as f32;
            let mut m = MinMax::EMPTY;
            for (o, v) in o.iter_mut().zip(r) {
                *o = v / norm;
                m.add(*o);
            }
            let mut mc = MinMax::EMPTY;
            mc.add(c / norm);
            (mc, m)
        })
        .reduce(
            || (MinMax::EMPTY, MinMax::EMPTY),
            |a, b| (a.0.merge(b.0), a.1.merge(b.1)),
        );
    taps.observe(&format!("{p}_aug"), x);
    taps.observe(&format!("{p}_aug"), &[c]);
    observe(taps, &format!("{p}_lp"), unit.merge(lp_c));
    observe(taps, &format!("{p}_out"), unit);
    Ok(match part.constant(&format!("{p}_w")) {
        None => out,
        Some(w) => {
            let mut scaled = out;
            scaled.par_chunks_mut(h).for_each(|r| {
                for (v, w) in r.iter_mut().zip(&w) {
                    *v *= w;
                }
            });
            taps.observe(&format!("{p}_scaled"), &scaled);
            scaled
        }
    })
}

struct Layer<'a> {
    cfg: &'a SparkConfig,
    part: &'a PartGraph<'a>,
    p: String,
    l: usize,
    past: usize,
    rope: &'a RopeTable,
    seq: usize,
    mask_value: f32,
    w: LayerWeights,
}

impl Layer<'_> {
    fn name(&self, t: &str) -> String {
        format!("{}_{t}", self.p)
    }

    /// One layer over whole windows (`x`: `[t, H]`, updated in place).
    fn forward(&self, x: &mut [f32], taps: &mut Ranges) -> Result<(), ExportError> {
        let cfg = self.cfg;
        let (h, nh, kvh) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        let n1 = norm(self.part, &self.name("ln1"), x, h, taps)?;
        let q = self.w.q.apply(&n1);
        let k = self.w.k.apply(&n1);
        let v = self.w.v.apply(&n1);
        let gl = self.w.g.apply(&n1);
        drop(n1);
        for (name, t) in [("q", &q), ("k", &k), ("v", &v), ("g", &gl)] {
            taps.observe(&self.name(name), t);
        }
        self.alias(taps, "q", "q4");
        self.alias(taps, "k", "k4");
        self.alias(taps, "v", &graph::value_out(self.l));
        let qr = self.rope(&self.name("qrope"), &q, nh, taps);
        let kr = self.rope(&self.name("krope"), &k, kvh, taps);
        drop((q, k));
        self.alias(taps, "qrope_rot", "qa");
        self.alias(taps, "krope_rot", &graph::key_out(self.l));
        let attn = self.attention(&qr, &kr, &v, taps);
        drop((qr, kr, v));
        self.alias(taps, "attn", "attn4");
        let gate = map(&gl, kernels::sigmoid);
        taps.observe(&self.name("gate"), &gate);
        self.alias(taps, "gate", "gate4");
        let hd = cfg.head_dim;
        let mut gated = attn;
        gated
            .par_chunks_mut(hd)
            .zip(gate.par_iter())
            .for_each(|(a, g)| a.iter_mut().for_each(|v| *v *= g));
        taps.observe(&self.name("gated"), &gated);
        self.alias(taps, "gated", "gated2");
        let o = self.w.o.apply(&gated);
        taps.observe(&self.name("o"), &o);
        let x1 = zip_map(x, &o, |a, b| a + b);
        taps.observe(&self.name("resid1"), &x1);

        let n2 = norm(self.part, &self.name("ln2"), &x1, h, taps)?;
        let mg = self.w.gate.apply(&n2);
        let mu = self.w.up.apply(&n2);
        drop(n2);
        taps.observe(&self.name("mlp_gate"), &mg);
        taps.observe(&self.name("mlp_up"), &mu);
        let ge = map(&mg, kernels::gelu::gelu);
        drop(mg);
        taps.observe(&self.name("mlp_gelu"), &ge);
        let act = zip_map(&ge, &mu, |a, b| a * b);
        drop((ge, mu));
        taps.observe(&self.name("mlp_act"), &act);
        let d = self.w.down.apply(&act);
        taps.observe(&self.name("mlp_down"), &d);
        let x2 = zip_map(&x1, &d, |a, b| a + b);
        taps.observe(&self.name("resid2"), &x2);
        x.copy_from_slice(&x2);
        Ok(())
    }

    /// A reshape's output: its input's values.
    fn alias(&self, taps: &mut Ranges, from: &str, to: &str) {
        let r = taps.0[&self.name(from)];
        let to = if to.starts_with("past_") {
            to.to_string()
        } else {
            self.name(to)
        };
        taps.observe(&to, &[r.0, r.1]);
    }

    /// NeoX rotate-half of the first R dims of each head, the graph's op by op
    /// (`x1·cos − x2·sin`, `x2·cos + x1·sin`, the tail passed through).
    fn rope(&self, p: &str, x: &[f32], heads: usize, taps: &mut Ranges) -> Vec<f32> {
        let hd = self.cfg.head_dim;
        let (r, angles) = self.rope;
        let half = r / 2;
        let width = heads * hd;
        let mut out = vec![0f32; x.len()];
        let names = ["x1", "x2", "x1c", "x2s", "x2c", "x1s", "r1", "r2", "pass"];
        let m = out
            .par_chunks_mut(width)
            .zip(x.par_chunks(width))
            .enumerate()
            .map(|(i, (o, xr))| {
                let (cos, sin) = &angles[i % self.seq];
                let mut m = [MinMax::EMPTY; 9];
                for (oh, xh) in o.chunks_exact_mut(hd).zip(xr.chunks_exact(hd)) {
                    for j in 0..half {
                        let (x1, x2) = (xh[j], xh[half + j]);
                        let (a, b, c, d) = (x1 * cos[j], x2 * sin[j], x2 * cos[j], x1 * sin[j]);
                        let (r1, r2) = (a - b, c + d);
                        oh[j] = r1;
                        oh[half + j] = r2;
                        for (mm, v) in m.iter_mut().zip([x1, x2, a, b, c, d, r1, r2]) {
                            mm.add(v);
                        }
                    }
                    for j in *r..hd {
                        oh[j] = xh[j];
                        m[8].add(xh[j]);
                    }
                }
                m
            })
            .reduce(|| [MinMax::EMPTY; 9], merge_all);
        // `pass` exists only when part of each head is not rotated.
        let used = if *r < hd { 9 } else { 8 };
        for (n, mm) in names.iter().zip(m).take(used) {
            observe(taps, &format!("{p}_{n}"), mm);
        }
        let mut rot = m[6].merge(m[7]);
        if *r < hd {
            rot = rot.merge(m[8]);
        }
        observe(taps, &format!("{p}_rot"), rot);
        out
    }

    /// Softmax attention of each token over what its step's caches hold; taps `scores`,
    /// `masked` (with the zero score and the mask value of unwritten slots) and `attn`.
    fn attention(&self, q: &[f32], k: &[f32], v: &[f32], taps: &mut Ranges) -> Vec<f32> {
        let cfg = self.cfg;
        let (nh, hd, grp) = (cfg.num_attention_heads, cfg.head_dim, cfg.gqa_group());
        let kvd = cfg.kv_dim();
        let (past, seq, mask) = (self.past, self.seq, self.mask_value);
        let mut out = vec![0f32; q.len()];
        let m = out
            .par_chunks_mut(nh * hd)
            .enumerate()
            .map(|(i, o)| {
                let pos = i % seq;
                let first = i - pos.min(past);
                let empty = past - pos.min(past);
                let mut m = [MinMax::EMPTY; 3];
                if empty > 0 {
                    m[0].add(0.0);
                    m[1].add(mask + 0.0);
                }
                let mut s = vec![0f32; i + 1 - first];
                for hh in 0..nh {
                    let qh = &q[i * nh * hd + hh * hd..][..hd];
                    let kv = (hh / grp) * hd;
                    let mut max = if empty > 0 { mask } else { f32::NEG_INFINITY };
                    for (j, sj) in (first..=i).zip(s.iter_mut()) {
                        *sj = kernels::dot(qh, &k[j * kvd + kv..][..hd]);
                        m[0].add(*sj);
                        m[1].add(*sj);
                        max = max.max(*sj);
                    }
                    let mut sum = empty as f32 * (mask - max).exp();
                    for sj in s.iter_mut() {
                        *sj = (*sj - max).exp();
                        sum += *sj;
                    }
                    let oh = &mut o[hh * hd..][..hd];
                    for (j, sj) in (first..=i).zip(&s) {
                        let p = sj / sum;
                        for (a, b) in oh.iter_mut().zip(&v[j * kvd + kv..][..hd]) {
                            *a += p * b;
                        }
                    }
                    oh.iter().for_each(|a| m[2].add(*a));
                }
                m
            })
            .reduce(|| [MinMax::EMPTY; 3], merge_all);
        for (n, mm) in ["scores", "masked", "attn"].iter().zip(m) {
            observe(taps, &self.name(n), mm);
        }
        out
    }
}

/// The final norm and the logits, a block of vocabulary rows at a time.
fn head(
    cfg: &SparkConfig,
    part: &PartGraph,
    reader: &mut WeightReader,
    x: &[f32],
    taps: &mut Ranges,
) -> Result<(), ExportError> {
    let h = cfg.hidden_size;
    let n = norm(part, "final_norm", x, h, taps)?;
    let spec = part.spec("lm_head_w")?;
    let rows = spec.rows.clone();
    for r0 in rows.clone().step_by(HEAD_BLOCK) {
        let block = WeightSpec {
            rows: r0..(r0 + HEAD_BLOCK).min(rows.end),
            ..spec.clone()
        };
        let w = Mat::read(reader, &block)?;
        for c in n.chunks(CHUNK_TOKENS * h) {
            taps.observe(graph::LOGITS, &w.apply(c));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::graph::tests::tiny;

    #[test]
    fn the_plan_grows_with_the_window_not_with_the_calibration_set() {
        let cfg = tiny();
        let mut o = ExportOptions {
            context: 4096,
            precision: crate::export::Precision::W8A16,
            kv: crate::phone::QType::Int16,
            parts: 1,
            calibration: Vec::new(),
            calib_samples: 8,
            calib_seq_len: 256,
            range_margin: 2.0,
            calibrator: super::super::Calibrator::Native,
            force: false,
            force_memory: false,
            progress: false,
            threads: 1,
        };
        let base = plan_bytes(&cfg, &o);
        // More windows are evaluated chunk after chunk: the calibrator's own memory stays.
        o.calib_samples = 800;
        assert_eq!(plan_bytes(&cfg, &o), base);
        // A window longer than a chunk is one chunk: it grows with the window.
        o.calib_seq_len = 8192;
        o.context = 8192;
        assert!(plan_bytes(&cfg, &o) > 2 * base);
    }
}
