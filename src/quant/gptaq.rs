//! The float-output objective (GPTAQ's asymmetric calibration): each linear is solved to reproduce
//! what the *float* model's input X would give, W·X, from the input X̃ the already quantized layers
//! below actually deliver. GPTQ alone reproduces W·X̃, so the error the layers below left in X̃ is
//! carried on; here each linear corrects for it where it can.
//!
//! min over Ŵ of ‖W·X − Ŵ·X̃‖² splits exactly into a least-squares target and a GPTQ problem:
//!
//! ‖W·X − Ŵ·X̃‖² = ‖(W* − Ŵ)·X̃‖² + const,   W* = W·X·X̃ᵀ·(X̃·X̃ᵀ)⁻¹ = W + W·C·H̃⁻¹,
//!
//! with C = Σ_t (x_t − x̃_t)·x̃_tᵀ and H̃ = Σ_t x̃_t·x̃_tᵀ (both scaled as [`Hessian::matrix`]). So
//! GPTQ runs unchanged on W* against H̃. H̃ is damped as GPTQ damps it, which keeps W* near W
//! where X̃ carries little energy.
//!
//! With the damping λ the target is a ridge regression towards W, W* = (M + λ·W)·(H̃ + λI)⁻¹ with
//! M = Σ_t y_t·x̃_tᵀ and y_t = W·x_t the float output (W·C = M − W·H̃). For a linear with fewer
//! outputs than inputs (`down_proj`: 2048 × 6656 at the 1.7B shape) M is the cheaper moment: N·K
//! per token instead of C's K², and N·K memory instead of K² ([`OutputMoment`]).

use rayon::prelude::*;

use super::hessian::{at_b_block, BLOCK, CHUNK};
use super::gptq::matmul_nn;
use super::GptqSolver;
use crate::kernels::bf16::{all_bf16, gram_bf16};
use crate::kernels::par::ColumnsOut;
use crate::kernels::w4::round_bf16;

/// A moment summed in f64 over f32 GEMM chunks, so long calibration runs do not lose the small
/// contributions to rounding.
#[derive(Clone)]
struct Sum64 {
    sum: Vec<f64>,
    tokens: usize,
}

impl Sum64 {
    fn new(len: usize) -> Self {
        Sum64 {
            sum: vec![0.0; len],
            tokens: 0,
        }
    }

    fn fold(&mut self, part: &[f32]) {
        self.sum
            .par_iter_mut()
            .zip(part.par_iter())
            .for_each(|(s, p)| *s += *p as f64);
    }

    /// Scaled like [`Hessian::matrix`] (2/n), f32.
    fn matrix_f32(&self) -> Vec<f32> {
        let s = 2.0 / self.tokens.max(1) as f64;
        self.sum.par_iter().map(|v| (v * s) as f32).collect()
    }
}

/// Σ_t (x_t − x̃_t)·x̃_tᵀ over calibration tokens, `[k, k]` row-major.
#[derive(Clone)]
pub struct CrossMoment {
    k: usize,
    sum: Sum64,
}

impl CrossMoment {
    pub fn new(k: usize) -> Self {
        CrossMoment {
            k,
            sum: Sum64::new(k * k),
        }
    }

    /// Add `m` rows of the quantized model's input `xq` and the float model's `xf` (`[m, k]`).
    pub fn add(&mut self, xq: &[f32], xf: &[f32], m: usize) {
        let k = self.k;
        assert_eq!((xq.len(), xf.len()), (m * k, m * k));
        let mut part = vec![0f32; k * k];
        let mut delta = vec![0f32; CHUNK.min(m) * k];
        for (q, f) in xq.chunks(CHUNK * k).zip(xf.chunks(CHUNK * k)) {
            let t = q.len() / k;
            // Inputs that are bf16 values (the bf16 calibration forward) carry no more precision
            // than bf16: the difference is rounded to bf16 too, for the bf16 GEMM.
            let bf16 = all_bf16(q) && all_bf16(f);
            let d = &mut delta[..t * k];
            d.par_iter_mut()
                .zip(f.par_iter().zip(q))
                .for_each(|(d, (f, q))| *d = if bf16 { round_bf16(f - q) } else { f - q });
            let d: &[f32] = d;
            if !(bf16 && gram_bf16(d, Some(q), t, k, &mut part)) {
                let out = ColumnsOut::new(&mut part, k, k);
                (0..k.div_ceil(BLOCK)).into_par_iter().for_each(|bi| {
                    let r0 = bi * BLOCK;
                    let rows = (k - r0).min(BLOCK);
                    // SAFETY: d and q hold t × k values; rows r0.. of part are written by
                    // this job alone.
                    unsafe { at_b_block(&out, (r0, rows), (0, k), d, q, t, k, 1.0) };
                });
            }
            self.sum.fold(&part);
        }
        self.sum.tokens += m;
    }
}

/// Σ_t y_t·x̃_tᵀ over calibration tokens, `[n, k]` row-major: the float model's output `y` (`[m, n]`)
/// against the quantized model's input `x̃` (`[m, k]`), summed in f64 over f32 GEMM chunks.
pub struct OutputMoment {
    n: usize,
    k: usize,
    sum: Sum64,
}

impl OutputMoment {
    pub fn new(n: usize, k: usize) -> Self {
        OutputMoment {
            n,
            k,
            sum: Sum64::new(n * k),
        }
    }

    /// Add `m` rows of the float output `y` (`[m, n]`) and the quantized model's input `xq` (`[m, k]`).
    pub fn add(&mut self, y: &[f32], xq: &[f32], m: usize) {
        let (n, k) = (self.n, self.k);
        assert_eq!((y.len(), xq.len()), (m * n, m * k));
        let mut part = vec![0f32; n * k];
        let mut yt = vec![0f32; n * CHUNK.min(m)];
        for (yc, q) in y.chunks(CHUNK * n).zip(xq.chunks(CHUNK * k)) {
            let t = yc.len() / n;
            let yt = &mut yt[..n * t];
            // yᵀ for a plain row-major GEMM: [n, t] · [t, k]. Not the bf16 Gram with y rounded to
            // bf16: on the fixture that raised held-out KL by 3–5 % against this f32 form
            // (docs/QUANTIZE.md).
            yt.par_chunks_mut(t).enumerate().for_each(|(j, row)| {
                for (i, v) in row.iter_mut().enumerate() {
                    *v = yc[i * n + j];
                }
            });
            matmul_nn(yt, n, t, q, k, &mut part, true);
            self.sum.fold(&part);
        }
        self.sum.tokens += m;
    }
}

/// What the float model contributes to the target.
enum Moment {
    /// C, row-major `[k, k]`: W* = W + W·C·H'⁻¹ for any W.
    Cross(Vec<f32>),
    /// M, row-major `[n, k]`, of one linear: W* = (M + λ·W)·H'⁻¹.
    Outputs(Vec<f32>, usize),
}

/// The float model's side of the target, for every linear that reads the same input. The
/// inverse comes from the GPTQ solver of that input ([`GptqSolver::times_inverse`]): W* is
/// regressed with GPTQ's own damping, H' = H̃ + λI (dead inputs, never active in X̃, on a unit
/// diagonal, as GPTQ zeroes their columns anyway), and H̃ is factored once per input, not once
/// for the target and again for the solve.
pub struct FloatOutputTarget {
    k: usize,
    moment: Moment,
}

impl FloatOutputTarget {
    pub fn new(cross: &CrossMoment) -> Self {
        FloatOutputTarget {
            k: cross.k,
            moment: Moment::Cross(cross.sum.matrix_f32()),
        }
    }

    /// The target of the one linear whose float outputs `outputs` accumulated.
    pub fn from_outputs(outputs: &OutputMoment) -> Self {
        FloatOutputTarget {
            k: outputs.k,
            moment: Moment::Outputs(outputs.sum.matrix_f32(), outputs.n),
        }
    }

    /// W* for each of the weights `ws` (row-major `[outs[j], k]`) that read this input, through
    /// `solver` (built on the same H̃). With the cross moment the correction is W·(C·H'⁻¹) when the
    /// weights have more rows than C (2·K³ + 2·N·K² flops instead of 4·N·K²: q/k/v, gate/up), and
    /// (W·C)·H'⁻¹ otherwise.
    pub fn targets(&self, solver: &GptqSolver, ws: &[Vec<f32>], outs: &[usize]) -> Vec<Vec<f32>> {
        let k = self.k;
        assert_eq!(solver.dim(), k);
        match &self.moment {
            Moment::Cross(c) => {
                let rows: usize = outs.iter().sum();
                let d = (rows > k).then(|| solver.times_inverse(c, k));
                ws.iter()
                    .zip(outs)
                    .map(|(w, &n)| {
                        let mut corr = vec![0f32; n * k];
                        match &d {
                            Some(d) => matmul_nn(w, n, k, d, k, &mut corr, true),
                            None => {
                                let mut wc = vec![0f32; n * k];
                                matmul_nn(w, n, k, c, k, &mut wc, true);
                                corr = solver.times_inverse(&wc, n);
                            }
                        }
                        corr.par_iter_mut().zip(w).for_each(|(c, w)| *c += w);
                        corr
                    })
                    .collect()
            }
            Moment::Outputs(m, rows) => {
                assert!(ws.len() == 1 && outs == [*rows], "an output moment belongs to one linear");
                let lambda = solver.lambda() as f32;
                let r: Vec<f32> = m.par_iter().zip(&ws[0]).map(|(m, w)| m + lambda * w).collect();
                vec![solver.times_inverse(&r, *rows)]
            }
        }
    }

    /// tr(W*·H̃·W*ᵀ) in O(N·K) where the target came from the output moment: W*·H' = M + λ·W, so
    /// it is ⟨M + λ·W, W*⟩ − λ‖W*‖² − Σ_dead ‖W*_i‖² (H̃ scaled as [`Hessian::matrix`]). `None` for
    /// the cross moment, whose W*·H' = W·H' + W·C needs W·H̃.
    pub fn energy(&self, solver: &GptqSolver, w: &[f32], wstar: &[f32]) -> Option<f64> {
        let Moment::Outputs(m, _) = &self.moment else {
            return None;
        };
        assert_eq!((w.len(), wstar.len()), (m.len(), m.len()));
        let k = self.k;
        let lambda = solver.lambda();
        let dead = solver.dead_inputs();
        let e: f64 = m
            .par_chunks(k)
            .zip(w.par_chunks(k).zip(wstar.par_chunks(k)))
            .map(|(m, (w, ws))| {
                let mut e = 0f64;
                for (j, ((&m, &w), &ws)) in m.iter().zip(w).zip(ws).enumerate() {
                    let ws = ws as f64;
                    let diag = lambda + if dead[j] { 1.0 } else { 0.0 };
                    e += (m as f64 + lambda * w as f64) * ws - diag * ws * ws;
                }
                e
            })
            .sum();
        Some(e.max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Hessian;
    use rand::{Rng, SeedableRng};

    /// W* through GPTQ's solver of the same H̃ (natural order and activation order).
    fn target_of(t: &FloatOutputTarget, h: &Hessian, damp: f64, w: &[f32], n: usize) -> Vec<f32> {
        let mut got = Vec::new();
        for order in [crate::quant::Order::Natural, crate::quant::Order::ActStatic] {
            let solver = GptqSolver::with_order("t", h, damp, order).unwrap();
            let ws = t.targets(&solver, &[w.to_vec()], &[n]).remove(0);
            if let Some(first) = got.first() {
                let scale = ws.iter().fold(0f32, |s: f32, v| s.max(v.abs()));
                let worst = ws
                    .iter()
                    .zip(first)
                    .fold(0f32, |s: f32, (a, b): (&f32, &f32)| s.max((a - b).abs()));
                assert!(worst <= 1e-4 * scale, "orders disagree: {worst} of {scale}");
            }
            got.push(ws);
        }
        got.remove(0)
    }

    fn rows(rng: &mut impl Rng, m: usize, k: usize) -> Vec<f32> {
        (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    #[test]
    fn the_same_input_leaves_the_weight_alone() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let (m, k, n) = (300, 24, 5);
        let x = rows(&mut rng, m, k);
        let w = rows(&mut rng, n, k);
        let mut h = Hessian::new(k);
        h.add(&x, m);
        let mut c = CrossMoment::new(k);
        c.add(&x, &x, m);
        let t = FloatOutputTarget::new(&c);
        // C = 0: the correction is exactly zero, whatever the order of the factor.
        assert_eq!(target_of(&t, &h, 0.01, &w, n), w);
    }

    /// Without damping W* is the least-squares solution: the residual W·X − W*·X̃ is orthogonal
    /// to X̃ (normal equations), checked against sums taken here in f64.
    #[test]
    fn the_target_solves_the_normal_equations() {
        normal_equations(|v| v, 1e-3);
    }

    /// bf16-valued inputs (the bf16 calibration forward) take the bf16 Gram, the difference
    /// x − x̃ rounded to bf16 (relative 2⁻⁹): the equations hold to that rounding.
    #[test]
    fn the_target_from_bf16_inputs_solves_the_normal_equations() {
        normal_equations(crate::kernels::w4::round_bf16, 4e-3);
    }

    /// The output moment's ridge form gives the cross moment's target (to f32 GEMM rounding), on
    /// damped and undamped H̃.
    #[test]
    fn the_output_moment_gives_the_cross_moments_target() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // More outputs than inputs: the cross moment takes its W·(C·H'⁻¹) form.
        let (m, k, n) = (CHUNK + 200, 40, 47);
        let xf = rows(&mut rng, m, k);
        let xq: Vec<f32> = xf
            .iter()
            .map(|v| v + 0.2 * rng.random_range(-1.0f32..1.0))
            .collect();
        let w = rows(&mut rng, n, k);
        let y: Vec<f32> = xf
            .chunks(k)
            .flat_map(|x| {
                w.chunks(k)
                    .map(|wr| wr.iter().zip(x).map(|(a, b)| a * b).sum::<f32>())
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut h = Hessian::new(k);
        h.add(&xq, m);
        let mut c = CrossMoment::new(k);
        c.add(&xq, &xf, m);
        let mut o = OutputMoment::new(n, k);
        o.add(&y, &xq, m);
        for damp in [1e-9, 0.01, 0.5] {
            let a = target_of(&FloatOutputTarget::new(&c), &h, damp, &w, n);
            let b = target_of(&FloatOutputTarget::from_outputs(&o), &h, damp, &w, n);
            let scale = a.iter().fold(0f32, |s, v| s.max(v.abs()));
            let worst = a
                .iter()
                .zip(&b)
                .fold(0f32, |s, (a, b)| s.max((a - b).abs()));
            assert!(worst < 1e-4 * scale, "damp {damp}: {worst} of {scale}");
            // The correction is real: the target is not W.
            let moved = a
                .iter()
                .zip(&w)
                .fold(0f32, |s, (a, b)| s.max((a - b).abs()));
            assert!(moved > 1e-2 * scale, "damp {damp}: {moved}");
            // The output moment's target gives its energy tr(W*H̃W*ᵀ) without H̃; the cross
            // moment's does not.
            let to = FloatOutputTarget::from_outputs(&o);
            let solver = GptqSolver::new("t", &h, damp).unwrap();
            let want = crate::quant::quadratic_form(&b, n, k, &h.matrix_f32());
            let got = to.energy(&solver, &w, &b).unwrap();
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "damp {damp}: {got} vs {want}"
            );
            let tc = FloatOutputTarget::new(&c);
            assert_eq!(tc.energy(&solver, &w, &a), None);
        }
    }

    fn normal_equations(value: fn(f32) -> f32, tolerance: f64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        // More tokens than a GEMM chunk and more inputs than a block: every path is taken.
        let (m, k, n) = (CHUNK + 300, BLOCK + 9, 3);
        let xf: Vec<f32> = rows(&mut rng, m, k).into_iter().map(value).collect();
        let xq: Vec<f32> = xf
            .iter()
            .map(|v| value(v + 0.05 * rng.random_range(-1.0f32..1.0)))
            .collect();
        let w = rows(&mut rng, n, k);
        let mut h = Hessian::new(k);
        h.add(&xq, m);
        let mut c = CrossMoment::new(k);
        c.add(&xq, &xf, m);
        let ws = target_of(&FloatOutputTarget::new(&c), &h, 1e-9, &w, n);
        let dot = |a: &[f32], b: &[f32]| -> f64 {
            a.iter().zip(b).map(|(a, b)| *a as f64 * *b as f64).sum()
        };
        // The largest |g_j|, g_j = Σ_t (w·x_t − v·x̃_t) · x̃_tj, over every row of `v`.
        let gradient = |v: &[f32]| -> f64 {
            let mut worst = 0f64;
            for i in 0..n {
                let (wi, vi) = (&w[i * k..(i + 1) * k], &v[i * k..(i + 1) * k]);
                let mut g = vec![0f64; k];
                for tk in 0..m {
                    let (f, q) = (&xf[tk * k..(tk + 1) * k], &xq[tk * k..(tk + 1) * k]);
                    let r = dot(wi, f) - dot(vi, q);
                    g.iter_mut().zip(q).for_each(|(g, q)| *g += r * *q as f64);
                }
                worst = g.iter().fold(worst, |a, v| a.max(v.abs()));
            }
            worst
        };
        let (at_target, at_w) = (gradient(&ws), gradient(&w));
        // f32 GEMM chunks and f32 weights: the normal equations hold to well under 1 % of the
        // gradient W itself leaves.
        assert!(at_target < tolerance * at_w, "{at_target} vs {at_w}");
        // The same target from the float output's moment (`down_proj`'s form).
        let y: Vec<f32> = xf
            .chunks(k)
            .flat_map(|x| w.chunks(k).map(|wr| dot(wr, x) as f32).collect::<Vec<_>>())
            .collect();
        let mut o = OutputMoment::new(n, k);
        o.add(&y, &xq, m);
        let t = FloatOutputTarget::from_outputs(&o);
        let at_target = gradient(&target_of(&t, &h, 1e-9, &w, n));
        assert!(at_target < tolerance * at_w, "{at_target} vs {at_w}");
    }
}
