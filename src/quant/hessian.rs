//! H = 2/n · Σ x xᵀ over calibration tokens, one per distinct linear input.
//!
//! Chunks of tokens go through an f32 GEMM (`gemm` crate, multi-threaded);
//! chunk results are summed in f64 so long calibration runs do not lose the
//! small contributions to rounding.

#[derive(Clone)]
pub struct Hessian {
    k: usize,
    sum: Vec<f64>,
    tokens: usize,
}

/// Tokens per f32 GEMM before folding into the f64 sum.
const CHUNK: usize = 256;

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
        let mut part = vec![0f32; k * k];
        for chunk in x.chunks(CHUNK * k) {
            let t = chunk.len() / k;
            let threads = rayon::current_num_threads();
            let par = if threads > 1 && t * k * k > 1 << 20 {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            };
            // SAFETY: lhs = chunkᵀ as a [k, t] view (rs 1, cs k), rhs = chunk [t, k]
            // (rs k, cs 1), dst = part [k, k]; every index stays inside the buffers.
            unsafe {
                gemm::gemm(
                    k,
                    k,
                    t,
                    part.as_mut_ptr(),
                    1,
                    k as isize,
                    false,
                    chunk.as_ptr(),
                    k as isize,
                    1,
                    chunk.as_ptr(),
                    1,
                    k as isize,
                    0.0,
                    2.0,
                    false,
                    false,
                    false,
                    par,
                );
            }
            self.sum
                .iter_mut()
                .zip(&part)
                .for_each(|(s, p)| *s += *p as f64);
        }
        self.tokens += m;
    }

    /// H scaled by 1/n (GPTQ is invariant to the scale of H; this keeps numbers moderate).
    pub fn matrix(&self) -> Vec<f64> {
        let inv = 1.0 / self.tokens.max(1) as f64;
        self.sum.iter().map(|v| v * inv).collect()
    }

    pub fn diag(&self) -> Vec<f64> {
        let inv = 1.0 / self.tokens.max(1) as f64;
        (0..self.k)
            .map(|i| self.sum[i * self.k + i] * inv)
            .collect()
    }

    pub fn is_finite(&self) -> bool {
        self.sum.iter().all(|v| v.is_finite())
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
        let (k, m) = (5, 600);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let mut h = Hessian::new(k);
        h.add(&x[..300 * k], 300);
        h.add(&x[300 * k..], 300);
        let got = h.matrix();
        for a in 0..k {
            for b in 0..k {
                let want: f64 = (0..m)
                    .map(|t| 2.0 * x[t * k + a] as f64 * x[t * k + b] as f64)
                    .sum::<f64>()
                    / m as f64;
                assert!(
                    (got[a * k + b] - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{a},{b}"
                );
            }
        }
    }
}
