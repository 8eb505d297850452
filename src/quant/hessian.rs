//! H = 2/n · Σ x xᵀ over calibration tokens, one per distinct linear input.
//!
//! Chunks of tokens go through a GEMM with f32 sums — `vdpbf16ps` when the
//! inputs are bf16 values (the default bf16 calibration forward) and the CPU
//! has AVX512-BF16, the `gemm` crate's f32 kernel otherwise; chunk results are
//! summed in f64 so long calibration runs do not lose the small contributions
//! to rounding.

use rayon::prelude::*;

use crate::kernels::par::ColumnsOut;

/// The sum is kept for j ≥ i only; [`Hessian::matrix`] mirrors it.
#[derive(Clone)]
pub struct Hessian {
    k: usize,
    sum: Vec<f64>,
    tokens: usize,
}

/// Tokens per f32 GEMM before folding into the f64 sum: long enough that the fold (a pass over
/// the K × K sum) costs little beside the GEMM (at 1024 it was 12 % of the Hessian phase at the
/// 1.7B shape), short enough that the f32 sums stay far from losing small contributions.
pub(crate) const CHUNK: usize = 4096;

/// Side of the square blocks of H computed as separate GEMMs.
pub(crate) const BLOCK: usize = 512;

/// One block of `beta · aᵀ·b` for `t` rows of `a` and `b` (both `[t, k]`, row-major): rows `r0..r0 +
/// rows` (columns of `a`) and columns `c0..c0 + cols` (columns of `b`) of the `[k, k]` result,
/// written into `out` at the same place.
///
/// # Safety
/// `a` and `b` hold at least `t × k` values, the block lies inside `out` (`[k, k]`), and no other
/// job writes it at the same time.
pub(crate) unsafe fn at_b_block(
    out: &ColumnsOut,
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    (a, b): (&[f32], &[f32]),
    (t, k): (usize, usize),
    beta: f32,
) {
    // lhs = columns r0.. of a, transposed ([rows, t]: rs 1, cs k); rhs = columns c0.. of b
    // ([t, cols]: rs k, cs 1); dst = the block at (r0, c0) (row stride k).
    unsafe {
        gemm::gemm(
            rows,
            cols,
            t,
            out.ptr_at(r0, c0),
            1,
            k as isize,
            false,
            a.as_ptr().add(r0),
            k as isize,
            1,
            b.as_ptr().add(c0),
            1,
            k as isize,
            0.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

impl Hessian {
    pub fn new(k: usize) -> Self {
        Hessian {
            k,
            sum: vec![0.0; k * k],
            tokens: 0,
        }
    }

    /// A Hessian given directly (`[k, k]`, row-major), e.g. by a reference implementation.
    pub fn from_matrix(k: usize, matrix: Vec<f64>) -> Self {
        assert_eq!(matrix.len(), k * k);
        Hessian {
            k,
            sum: matrix,
            tokens: 1,
        }
    }

    pub fn dim(&self) -> usize {
        self.k
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Add `m` rows of inputs `x` (`[m, k]`, row-major).
    pub fn add(&mut self, x: &[f32], m: usize) {
        let k = self.k;
        assert_eq!(x.len(), m * k);
        // H is symmetric: compute only blocks on or above the diagonal
        // (about half the FLOPs, as BLAS syrk does), one job per block.
        let nb = k.div_ceil(BLOCK);
        let pairs: Vec<(usize, usize)> =
            (0..nb).flat_map(|i| (i..nb).map(move |j| (i, j))).collect();
        let mut part = vec![0f32; k * k];
        for chunk in x.chunks(CHUNK * k) {
            let t = chunk.len() / k;
            // xᵀx on bf16 inputs; otherwise f32 GEMM blocks, which fold the 2 in as their beta.
            let scale = if crate::kernels::bf16::gram_bf16(chunk, None, t, k, &mut part) {
                2.0
            } else {
                let out = ColumnsOut::new(&mut part, k, k);
                pairs.par_iter().for_each(|&(bi, bj)| {
                    let (r0, c0) = (bi * BLOCK, bj * BLOCK);
                    let (rows, cols) = ((k - r0).min(BLOCK), (k - c0).min(BLOCK));
                    // SAFETY: chunk holds t × k values; the block at (r0, c0) of part is
                    // written by this job alone.
                    unsafe {
                        at_b_block(&out, (r0, rows), (c0, cols), (chunk, chunk), (t, k), 2.0)
                    };
                });
                1.0
            };
            self.fold(&part, scale);
        }
        self.tokens += m;
    }

    /// Fold the upper triangle (j ≥ i) of a chunk's `scale · part` into the f64 sum.
    fn fold(&mut self, part: &[f32], scale: f64) {
        let k = self.k;
        self.sum
            .par_chunks_mut(k)
            .zip(part.par_chunks(k))
            .enumerate()
            .for_each(|(i, (s, p))| {
                s[i..]
                    .iter_mut()
                    .zip(&p[i..])
                    .for_each(|(s, p)| *s += scale * *p as f64);
            });
    }

    /// H scaled by 1/n (GPTQ is invariant to the scale of H; this keeps numbers moderate).
    pub fn matrix(&self) -> Vec<f64> {
        self.full(|v| v)
    }

    /// [`Hessian::matrix`] rounded to f32, without the f64 copy (half the memory at large K).
    pub fn matrix_f32(&self) -> Vec<f32> {
        self.full(|v| v as f32)
    }

    /// The full symmetric H/n, each entry converted by `cast`.
    fn full<T: Copy + Default + Send>(&self, cast: impl Fn(f64) -> T + Sync) -> Vec<T> {
        let (k, inv) = (self.k, 1.0 / self.tokens.max(1) as f64);
        let mut h = vec![T::default(); k * k];
        h.par_chunks_mut(k).enumerate().for_each(|(i, row)| {
            for (j, v) in row.iter_mut().enumerate() {
                let (a, b) = if j >= i { (i, j) } else { (j, i) };
                *v = cast(self.sum[a * k + b] * inv);
            }
        });
        h
    }

    /// Σ x_a x_b so far (unscaled) for `a ≤ b`.
    pub fn upper(&self, a: usize, b: usize) -> f64 {
        debug_assert!(a <= b);
        self.sum[a * self.k + b]
    }

    pub fn diag(&self) -> Vec<f64> {
        let inv = 1.0 / self.tokens.max(1) as f64;
        (0..self.k)
            .map(|i| self.sum[i * self.k + i] * inv)
            .collect()
    }

    pub fn is_finite(&self) -> bool {
        self.sum.par_iter().all(|v| v.is_finite())
    }

    #[cfg(test)]
    pub(crate) fn zero_input(&mut self, i: usize) {
        let k = self.k;
        for j in 0..k {
            self.sum[i * k + j] = 0.0;
            self.sum[j * k + i] = 0.0;
        }
    }

    #[cfg(test)]
    pub(crate) fn add_diag(&mut self, v: f64) {
        let n = self.tokens.max(1) as f64;
        for i in 0..self.k {
            self.sum[i * self.k + i] += v * n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_outer_products() {
        for (k, m) in [(5, 600), (BLOCK + 37, 2 * CHUNK + 10), (2 * BLOCK + 3, 64)] {
            check_against_naive(k, m);
        }
    }

    /// Inputs that are bf16 values take the `vdpbf16ps` Gram on a CPU that has it (odd chunk
    /// lengths included); the sums are the same up to order.
    #[test]
    fn bf16_inputs_match_naive_outer_products() {
        for (k, m) in [(5, 601), (BLOCK + 37, 2 * CHUNK + 11), (70, 64)] {
            check(k, m, |v| crate::kernels::w4::round_bf16(v / 7.0));
        }
    }

    fn check_against_naive(k: usize, m: usize) {
        check(k, m, |v| v);
    }

    fn check(k: usize, m: usize, value: impl Fn(f32) -> f32) {
        let x: Vec<f32> = (0..m * k)
            .map(|i| value(((i * 37 % 101) as f32 - 50.0) / 25.0))
            .collect();
        let mut h = Hessian::new(k);
        h.add(&x[..m / 2 * k], m / 2);
        h.add(&x[m / 2 * k..], m - m / 2);
        let got = h.matrix();
        for a in 0..k {
            for b in 0..k {
                let want: f64 = (0..m)
                    .map(|t| 2.0 * x[t * k + a] as f64 * x[t * k + b] as f64)
                    .sum::<f64>()
                    / m as f64;
                assert!(
                    (got[a * k + b] - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{a},{b}: {} vs {want}",
                    got[a * k + b]
                );
            }
        }
    }
}
