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

use faer::Mat;
use rayon::prelude::*;

use super::hessian::{at_b_block, BLOCK, CHUNK};
use super::Hessian;
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
                    unsafe { at_b_block(&out, (r0, rows), (0, k), (d, q), (t, k), 1.0) };
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
        for (yc, q) in y.chunks(CHUNK * n).zip(xq.chunks(CHUNK * k)) {
            let t = yc.len() / n;
            // yᵀ·x̃: [n, t] · [t, k], yᵀ read through its strides. Not the bf16 Gram with y rounded
            // to bf16: on the fixture that raised held-out KL by 3–5 % against this f32 form
            // (docs/QUANTIZE.md).
            super::gptq::matmul_tn(yc, n, t, q, k, &mut part, true);
            self.sum.fold(&part);
        }
        self.sum.tokens += m;
    }
}

/// The float-stream objective's target for a linear whose output the residual adds to the stream
/// (`out_proj`, `down_proj`): the float stream `xf` advances by the float output `y`, and `y`
/// becomes the output that puts the quantized stream `x` on it, y + (xf − x). Then
/// ‖(xf + y) − (x + Ŵ·x̃)‖² is the output-moment objective of that target, so the linear also
/// undoes what of the stream's error its input can predict. The error xf − x is taken first: where
/// the two streams are within a factor of 2 it is exact, where (xf + y) − x would carry xf's rounding.
///
/// `weight` (α in [0, 1], [`stream_weight`]) scales the correction: y + α·(xf − x); at 0 the
/// target is y itself.
pub fn stream_target(y: &mut [f32], xf: &mut [f32], x: &[f32], weight: f32) {
    assert_eq!((y.len(), xf.len()), (x.len(), x.len()));
    y.par_iter_mut()
        .zip(xf.par_iter_mut())
        .zip(x.par_iter())
        .for_each(|((y, f), q)| {
            let float = *y;
            if weight != 0.0 {
                *y = float + weight * (*f - q);
            }
            *f += float;
        });
}

/// Output channels of the stream error the split-half weight reads: a ratio of sums over
/// channels needs no more.
const WEIGHT_CHANNELS: usize = 256;

/// How much of the stream correction to trust, from the calibration itself: a split half.
///
/// The correction is the least-squares fit ΔW = M_E·(H̃ + λI)⁻¹ of the stream error e = xf − x
/// onto the linear's input x̃ (`input`, `[rows, k]`). Fitted on alternate blocks of rows (the
/// calibration windows, or the two halves of a single window) as folds A and B of N_A and N_B
/// tokens, the folds agree on the signal and disagree on the noise. In H̃'s metric,
/// c = ⟨ΔW_A, M_B⟩ (symmetrised) estimates the signal's energy, and a − c and b − c, with
/// a = ⟨ΔW_A, M_A⟩ and b = ⟨ΔW_B, M_B⟩, each fold's noise, which falls as 1/N. So the fit on all
/// N_A + N_B tokens has noise ν = (N_A·(a − c) + N_B·(b − c)) / (2·(N_A + N_B)), and its
/// James–Stein weight is α = c / (c + ν), clamped to [0, 1] (with equal folds,
/// 2c / (c + (a + b)/2)). Each fold is read through the whole sample's H̃, not its own, so even a
/// noiseless correction gets α ≈ 1/(1 + k/N) below 1: the weight errs towards shrinking. The
/// moments are taken on a strided subset of at most [`WEIGHT_CHANNELS`] of the `n` output
/// channels; `factor` is H̃ + λI's, which the linear's target then uses too.
pub fn stream_weight(
    factor: &DampedFactor,
    input: &[f32],
    (xf, x): (&[f32], &[f32]),
    n: usize,
    seq_len: usize,
) -> f64 {
    let k = factor.k;
    let rows = x.len() / n;
    assert_eq!((xf.len(), input.len()), (rows * n, rows * k));
    let stride = n.div_ceil(WEIGHT_CHANNELS);
    let channels: Vec<usize> = (0..n).step_by(stride).collect();
    let nc = channels.len();
    let block = if rows >= 2 * seq_len {
        seq_len
    } else {
        rows.div_ceil(2).max(1)
    };
    let mut halves = [OutputMoment::new(nc, k), OutputMoment::new(nc, k)];
    let mut e = vec![0f32; block * nc];
    for (bi, r0) in (0..rows).step_by(block).enumerate() {
        let t = block.min(rows - r0);
        e[..t * nc]
            .par_chunks_mut(nc)
            .enumerate()
            .for_each(|(r, out)| {
                let row = (r0 + r) * n;
                for (o, &c) in out.iter_mut().zip(&channels) {
                    *o = xf[row + c] - x[row + c];
                }
            });
        halves[bi % 2].add(&e[..t * nc], &input[r0 * k..(r0 + t) * k], t);
    }
    let [a_half, b_half] = halves;
    let (na, nb) = (a_half.sum.tokens as f64, b_half.sum.tokens as f64);
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    let (m_a, m_b) = (a_half.sum.matrix_f32(), b_half.sum.matrix_f32());
    let (dw_a, dw_b) = (factor.solve_rows(&m_a, nc), factor.solve_rows(&m_b, nc));
    let dot = |p: &[f32], q: &[f32]| -> f64 {
        p.par_iter()
            .zip(q.par_iter())
            .map(|(p, q)| *p as f64 * *q as f64)
            .sum()
    };
    let c = (dot(&dw_a, &m_b) + dot(&dw_b, &m_a)) / 2.0;
    let (a, b) = (dot(&dw_a, &m_a), dot(&dw_b, &m_b));
    let noise = (na * (a - c) + nb * (b - c)) / (2.0 * (na + nb));
    let weight = c / (c + noise);
    if weight.is_finite() {
        weight.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// What the float model contributes to the target.
enum Moment {
    /// C, row-major `[k, k]`: W* = W + W·C·(H̃ + λI)⁻¹ for any W.
    Cross(Vec<f32>),
    /// M, row-major `[n, k]`, of one linear: W* = (M + λ·W)·(H̃ + λI)⁻¹.
    Outputs(Vec<f32>, usize),
}

/// The damped H̃ factored once, for every linear that reads the same input. In f32 like GPTQ's own
/// factor (docs/QUANTIZE.md): W* differs from W by a correction term, and a failed factorisation
/// only means more damping.
pub struct DampedFactor {
    k: usize,
    /// The damping λ the factor holds.
    lambda: f32,
    /// Lower Cholesky factor of H̃ + λ·I, column-major.
    l: Vec<f32>,
}

/// W*, the weight that gives the float model's output from the quantized model's input.
pub struct FloatOutputTarget {
    factor: DampedFactor,
    moment: Moment,
}

impl FloatOutputTarget {
    /// For every linear that reads the input of `h`, from the cross moment.
    pub fn new(h: &Hessian, cross: &CrossMoment, damp: f64) -> Option<Self> {
        assert_eq!(h.dim(), cross.k);
        let factor = DampedFactor::new(h, damp)?;
        Some(FloatOutputTarget {
            factor,
            moment: Moment::Cross(cross.sum.matrix_f32()),
        })
    }

    /// The target of the one linear whose float outputs `outputs` accumulated: for `apply` with
    /// that linear's weight only.
    pub fn from_outputs(h: &Hessian, outputs: &OutputMoment, damp: f64) -> Option<Self> {
        Some(Self::on(DampedFactor::new(h, damp)?, outputs))
    }

    /// As [`Self::from_outputs`], on a factor already made.
    pub fn on(factor: DampedFactor, outputs: &OutputMoment) -> Self {
        assert_eq!(factor.k, outputs.k);
        FloatOutputTarget {
            factor,
            moment: Moment::Outputs(outputs.sum.matrix_f32(), outputs.n),
        }
    }

    /// tr(W*·H̃·W*ᵀ) in O(N·K) where the target came from the output moment: W*·(H̃ + λI) =
    /// M + λ·W, so it is ⟨M + λ·W, W*⟩ − λ‖W*‖² (H̃ scaled as [`Hessian::matrix`]). `None` for
    /// the cross moment, whose W*·(H̃ + λI) = W·(H̃ + λI) + W·C needs W·H̃.
    pub fn energy(&self, w: &[f32], wstar: &[f32]) -> Option<f64> {
        let Moment::Outputs(m, _) = &self.moment else {
            return None;
        };
        assert_eq!((w.len(), wstar.len()), (m.len(), m.len()));
        let lambda = self.factor.lambda as f64;
        let e: f64 = m
            .par_iter()
            .zip(w.par_iter().zip(wstar))
            .map(|(&m, (&w, &ws))| {
                let ws = ws as f64;
                (m as f64 + lambda * w as f64) * ws - lambda * ws * ws
            })
            .sum();
        Some(e.max(0.0))
    }

    /// W* for a row-major `[n, k]` weight: W + W·C·(H̃ + λI)⁻¹, or (M + λ·W)·(H̃ + λI)⁻¹ from the
    /// output moment (which belongs to this one weight).
    pub fn apply(&self, w: &[f32], n: usize) -> Vec<f32> {
        let k = self.factor.k;
        let wm = faer::MatRef::from_row_major_slice(w, n, k);
        // Zᵀ·(H̃ + λI) = R with H̃ symmetric: L·Lᵀ·Z = Rᵀ.
        let (z, add_w): (Mat<f32>, bool) = match &self.moment {
            Moment::Cross(c) => {
                let cm = faer::MatRef::from_row_major_slice(c, k, k);
                // (W·C)ᵀ as Cᵀ·Wᵀ: the same products and sums (the same bits), written in the
                // solves' column-major layout directly instead of copied there by a strided
                // transposition (half of this step's time at the 1.7B's gate/up shape).
                (cm.transpose() * wm.transpose(), true)
            }
            Moment::Outputs(m, rows) => {
                assert_eq!(*rows, n, "an output moment belongs to one linear");
                let lambda = self.factor.lambda;
                let z = Mat::from_fn(k, n, |j, i| m[i * k + j] + lambda * w[i * k + j]);
                (z, false)
            }
        };
        self.factor.solve(z, n, add_w.then_some(w))
    }
}

impl DampedFactor {
    /// Factor H̃ + λ·I, λ = `damp` × mean diag(H̃), raised ×10 while the factorisation fails
    /// (as GPTQ raises its own damping).
    pub fn new(h: &Hessian, damp: f64) -> Option<Self> {
        use faer::dyn_stack::{MemBuffer, MemStack};
        use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
        let k = h.dim();
        let inv_t = 1.0 / h.tokens().max(1) as f64;
        let mean = (0..k).map(|i| h.upper(i, i) * inv_t).sum::<f64>() / k.max(1) as f64;
        let mut lambda = damp * mean.max(f64::MIN_POSITIVE);
        let par = faer::get_global_parallelism();
        for _ in 0..6 {
            // Column j, rows i ≥ j: H̃[j, i] (symmetric) + λ on the diagonal.
            let mut l = vec![0f32; k * k];
            l.par_chunks_mut(k).enumerate().for_each(|(j, col)| {
                for (i, v) in col.iter_mut().enumerate().skip(j) {
                    *v = (h.upper(j, i) * inv_t + if i == j { lambda } else { 0.0 }) as f32;
                }
            });
            let mut mem =
                MemBuffer::new(cholesky_in_place_scratch::<f32>(k, par, Default::default()));
            let ok = cholesky_in_place(
                faer::MatMut::from_column_major_slice_mut(&mut l, k, k),
                Default::default(),
                par,
                MemStack::new(&mut mem),
                Default::default(),
            )
            .is_ok();
            if ok && l.par_iter().all(|v| v.is_finite()) {
                // The solves below read the lower triangle only.
                return Some(DampedFactor {
                    k,
                    lambda: lambda as f32,
                    l,
                });
            }
            lambda *= 10.0;
        }
        None
    }

    /// M·(H̃ + λI)⁻¹ for a row-major `[n, k]` matrix M.
    pub fn solve_rows(&self, m: &[f32], n: usize) -> Vec<f32> {
        let k = self.k;
        assert_eq!(m.len(), n * k);
        self.solve(Mat::from_fn(k, n, |j, i| m[i * k + j]), n, None)
    }

    /// Zᵀ for Z = (H̃ + λI)⁻¹·R (`r`: `[k, n]`, column-major), added to `base` when given.
    fn solve(&self, mut z: Mat<f32>, n: usize, base: Option<&[f32]>) -> Vec<f32> {
        use faer::linalg::triangular_solve::{
            solve_lower_triangular_in_place, solve_upper_triangular_in_place,
        };
        let k = self.k;
        let l = faer::MatRef::from_column_major_slice(&self.l, k, k);
        let par = faer::get_global_parallelism();
        solve_lower_triangular_in_place(l, z.as_mut(), par);
        solve_upper_triangular_in_place(l.transpose(), z.as_mut(), par);
        let mut out = base.map_or_else(|| vec![0f32; n * k], <[f32]>::to_vec);
        out.par_chunks_mut(k).enumerate().for_each(|(i, row)| {
            for (j, v) in row.iter_mut().enumerate() {
                *v += z[(j, i)];
            }
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rows(rng: &mut impl Rng, m: usize, k: usize) -> Vec<f32> {
        (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    /// x·Wᵀ for row-major `x` (`[m, k]`) and `w` (`[n, k]`): `[m, n]`.
    fn outputs(w: &[f32], x: &[f32], k: usize) -> Vec<f32> {
        x.chunks(k)
            .flat_map(|x| {
                w.chunks(k)
                    .map(|wr| wr.iter().zip(x).map(|(a, b)| a * b).sum::<f32>())
                    .collect::<Vec<_>>()
            })
            .collect()
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
        let t = FloatOutputTarget::new(&h, &c, 0.01).unwrap();
        assert_eq!(t.apply(&w, n), w);
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
        let (m, k, n) = (CHUNK + 200, 40, 7);
        let xf = rows(&mut rng, m, k);
        let xq: Vec<f32> = xf
            .iter()
            .map(|v| v + 0.2 * rng.random_range(-1.0f32..1.0))
            .collect();
        let w = rows(&mut rng, n, k);
        let y = outputs(&w, &xf, k);
        let mut h = Hessian::new(k);
        h.add(&xq, m);
        let mut c = CrossMoment::new(k);
        c.add(&xq, &xf, m);
        let mut o = OutputMoment::new(n, k);
        o.add(&y, &xq, m);
        for damp in [1e-9, 0.01, 0.5] {
            let a = FloatOutputTarget::new(&h, &c, damp).unwrap().apply(&w, n);
            let b = FloatOutputTarget::from_outputs(&h, &o, damp)
                .unwrap()
                .apply(&w, n);
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
            let to = FloatOutputTarget::from_outputs(&h, &o, damp).unwrap();
            let want = crate::quant::quadratic_form(&b, n, k, &h.matrix_f32());
            let got = to.energy(&w, &b).unwrap();
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "damp {damp}: {got} vs {want}"
            );
            let tc = FloatOutputTarget::new(&h, &c, damp).unwrap();
            assert_eq!(tc.energy(&w, &a), None);
        }
    }

    /// The float-stream target: the float stream advances by the float output, and the W* of the
    /// target is the least-squares fit of the float stream after the add, (s + W·x) − (s̃ + W*·x̃)
    /// orthogonal to x̃. Where the stream's error is partly predictable from x̃ the fit takes it
    /// up, so the stream ends closer to the float one than with the float output as the target.
    #[test]
    fn the_stream_target_fits_the_float_stream_after_the_add() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (m, k, n) = (CHUNK + 100, 24, 6);
        let xf = rows(&mut rng, m, k);
        let xq: Vec<f32> = xf
            .iter()
            .map(|v| v + 0.1 * rng.random_range(-1.0f32..1.0))
            .collect();
        let w = rows(&mut rng, n, k);
        let a = rows(&mut rng, n, k);
        let matvec = |w: &[f32], x: &[f32]| outputs(w, x, k);
        let y = matvec(&w, &xf);
        // The float stream s, and the quantized s̃ off by 0.1·A·x̃ plus noise.
        let sf: Vec<f32> = rows(&mut rng, m, n).iter().map(|v| 10.0 * v).collect();
        let ax = matvec(&a, &xq);
        let sq: Vec<f32> = sf
            .iter()
            .zip(&ax)
            .map(|(s, e)| s - 0.1 * e + 0.01 * rng.random_range(-1.0f32..1.0))
            .collect();
        let (mut t, mut s_after) = (y.clone(), sf.clone());
        stream_target(&mut t, &mut s_after, &sq, 1.0);
        for i in 0..m * n {
            assert_eq!(s_after[i], sf[i] + y[i]);
            assert_eq!(t[i], y[i] + (sf[i] - sq[i]));
        }
        // The weight scales the correction; at 0 the target is the float output, even where the
        // streams' difference is not finite.
        for weight in [0.5f32, 0.0] {
            let (mut t, mut s_after) = (y.clone(), sf.clone());
            let mut sq = sq.clone();
            sq[0] = f32::NAN;
            stream_target(&mut t, &mut s_after, &sq, weight);
            for i in 1..m * n {
                assert_eq!(s_after[i], sf[i] + y[i]);
                assert_eq!(t[i], y[i] + weight * (sf[i] - sq[i]));
            }
            assert_eq!(t[0].is_nan(), weight != 0.0);
        }
        let mut h = Hessian::new(k);
        h.add(&xq, m);
        let solve = |target: &[f32]| {
            let mut o = OutputMoment::new(n, k);
            o.add(target, &xq, m);
            FloatOutputTarget::from_outputs(&h, &o, 1e-9)
                .unwrap()
                .apply(&w, n)
        };
        let (ws, wo) = (solve(&t), solve(&y));
        // r = (s + y) − (s̃ + V·x̃) for a weight V, and the largest |Σ_t r_ti·x̃_tj|.
        let residual = |v: &[f32]| -> Vec<f64> {
            let vx = matvec(v, &xq);
            (0..m * n)
                .map(|i| s_after[i] as f64 - (sq[i] as f64 + vx[i] as f64))
                .collect()
        };
        let gradient = |r: &[f64]| -> f64 {
            let mut worst = 0f64;
            for i in 0..n {
                for j in 0..k {
                    let g: f64 = (0..m).map(|tk| r[tk * n + i] * xq[tk * k + j] as f64).sum();
                    worst = worst.max(g.abs());
                }
            }
            worst
        };
        let norm = |r: &[f64]| r.iter().map(|v| v * v).sum::<f64>();
        let (rs, ro) = (residual(&ws), residual(&wo));
        assert!(
            gradient(&rs) < 1e-3 * gradient(&ro),
            "{} vs {}",
            gradient(&rs),
            gradient(&ro)
        );
        // The fit takes up 0.1·A: W* − W*_float-output is that term (to the noise's share).
        let worst = ws
            .iter()
            .zip(&wo)
            .zip(&a)
            .fold(0f32, |s, ((s1, o), a)| s.max((s1 - o - 0.1 * a).abs()));
        assert!(worst < 2e-3, "{worst}");
        // What remains is what x̃ cannot predict (the float input's own part and the noise):
        // 0.53 of the float-output target's stream error here.
        assert!(
            norm(&rs) < 0.6 * norm(&ro),
            "{} vs {}",
            norm(&rs),
            norm(&ro)
        );
    }

    /// A quantized stream off the float one `xf` by `signal`·A·x̃ (`ax`) and uniform noise of
    /// amplitude `noise`.
    fn off_stream(xf: &[f32], ax: &[f32], signal: f32, noise: f32, rng: &mut impl Rng) -> Vec<f32> {
        xf.iter()
            .zip(ax)
            .map(|(f, e)| f - signal * e - noise * rng.random_range(-1.0f32..1.0))
            .collect()
    }

    /// The split-half weight trusts a stream error its input predicts and distrusts one it
    /// does not: near 1 for an error linear in x̃, near 0 for noise independent of it, between
    /// for a weak signal in noise; 0 where the streams agree.
    #[test]
    fn the_stream_weight_separates_signal_from_noise() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (windows, seq_len, k) = (16, 64, 32);
        let m = windows * seq_len;
        let xq = rows(&mut rng, m, k);
        let mut h = Hessian::new(k);
        h.add(&xq, m);
        let factor = DampedFactor::new(&h, 0.01).unwrap();
        // 8 output channels, and 600, more than the weight reads (a strided subset of 256).
        for n in [8, 600] {
            let a = rows(&mut rng, n, k);
            let ax = outputs(&a, &xq, k);
            let xf = rows(&mut rng, m, n);
            let mut weight = |signal: f32, noise: f32| {
                let x = off_stream(&xf, &ax, signal, noise, &mut rng);
                stream_weight(&factor, &xq, (&xf, &x), n, seq_len)
            };
            let clean = weight(1.0, 0.0);
            let noise = weight(0.0, 1.0);
            let weak = weight(0.05, 1.0);
            // Not exactly 1: each half's moment is read through the whole H̃, whose sample
            // differs from the half's (0.97 here).
            assert!(clean > 0.9, "{n}: {clean}");
            assert!(noise < 0.1, "{n}: {noise}");
            assert!(weak > noise && weak < clean, "{n}: {weak}");
            assert_eq!(stream_weight(&factor, &xq, (&xf, &xf), n, seq_len), 0.0);
            // One window: the folds are its two halves.
            let x = off_stream(&xf, &ax, 1.0, 0.0, &mut rng);
            let one = stream_weight(&factor, &xq, (&xf, &x), n, m);
            assert!(one > 0.9, "{n}: {one}");
            // Folds of unequal size (an odd number of windows): 3 windows of 341 tokens.
            let r = 3 * 341;
            let odd = stream_weight(&factor, &xq[..r * k], (&xf[..r * n], &x[..r * n]), n, 341);
            assert!(odd > 0.9, "{n}: {odd}");
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
        let t = FloatOutputTarget::new(&h, &c, 1e-9).unwrap();
        let ws = t.apply(&w, n);
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
        let t = FloatOutputTarget::from_outputs(&h, &o, 1e-9).unwrap();
        let at_target = gradient(&t.apply(&w, n));
        assert!(at_target < tolerance * at_w, "{at_target} vs {at_w}");
    }
}
