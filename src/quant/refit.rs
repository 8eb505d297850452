//! Group scales refitted to a linear's output error, for fixed codes.
//!
//! GPTQ chooses each group's scale once, when the group is reached, against a per-column proxy of the
//! objective. With the codes fixed, the scales that minimise the true output error
//! ‖(W − Q)X‖² = Σ_rows (w − B s)ᵀ H (w − B s), where (B s)_k = s_{g(k)} · l_k and l = q − 8, are the
//! solution of one small linear system per output row: (Bᵀ H B) s = Bᵀ H w, of size K/G. Its matrix is
//! A[g, h] = l_gᵀ H_gh l_h and its right side b[g] = l_gᵀ (H w)_g.

use rayon::prelude::*;

use super::gptq::{matmul_nn, rows_times_block, QuantizedWeight};
use super::grid::{stored_scale, ZERO};

/// Output rows per job: the blocks of H are read once per job, so larger jobs reuse them more.
const ROWS: usize = 64;

/// New stored scales (`[K/G, N]`) for `q`'s codes, least squares on the output error against `hm`
/// (`[K, K]`, [`super::Hessian::matrix_f32`]). A row whose system is singular, or whose solution has a
/// scale that is not finite or not of its old scale's sign (the codes were chosen for that sign), keeps
/// its scales.
pub fn refit_scales(w: &[f32], q: &QuantizedWeight, hm: &[f32]) -> Vec<f32> {
    let (k, n, gs) = (q.in_features, q.out_features, q.group_size);
    let groups = k / gs;
    assert_eq!((w.len(), hm.len()), (n * k, k * k));
    let rows: Vec<usize> = (0..n).step_by(ROWS).collect();
    let solved: Vec<Vec<f32>> = rows
        .par_iter()
        .map(|&r0| {
            let r1 = (r0 + ROWS).min(n);
            let nr = r1 - r0;
            // Codes of these rows as levels l = q − 8, [nr, K].
            let mut l = vec![0f32; nr * k];
            for (j, row) in l.chunks_mut(k).enumerate() {
                for (kk, v) in row.iter_mut().enumerate() {
                    *v = (q.codes[kk * n + r0 + j] as i32 - ZERO) as f32;
                }
            }
            let mut hw = vec![0f32; nr * k];
            matmul_nn(&w[r0 * k..r1 * k], nr, k, hm, k, &mut hw, false);
            let mut a = vec![0f64; nr * groups * groups];
            let mut t = vec![0f32; nr * gs];
            for g in 0..groups {
                for h in g..groups {
                    rows_times_block(&l, nr, k, hm, (g * gs, gs), (h * gs, gs), &mut t);
                    for r in 0..nr {
                        let lh = &l[r * k + h * gs..r * k + (h + 1) * gs];
                        let v: f64 = t[r * gs..(r + 1) * gs]
                            .iter()
                            .zip(lh)
                            .map(|(x, y)| *x as f64 * *y as f64)
                            .sum();
                        a[r * groups * groups + g * groups + h] = v;
                        a[r * groups * groups + h * groups + g] = v;
                    }
                }
            }
            let mut out = vec![0f32; nr * groups];
            for r in 0..nr {
                let b: Vec<f64> = (0..groups)
                    .map(|g| {
                        let s = r * k + g * gs..r * k + (g + 1) * gs;
                        l[s.clone()]
                            .iter()
                            .zip(&hw[s])
                            .map(|(x, y)| *x as f64 * *y as f64)
                            .sum()
                    })
                    .collect();
                let old = |g: usize| q.scales[g * n + r0 + r];
                let m = &mut a[r * groups * groups..(r + 1) * groups * groups];
                // A refit keeps each scale's sign: the codes were chosen for it.
                let fitted = solve_spd(m, b, groups).filter(|s| {
                    s.iter().enumerate().all(|(g, v)| {
                        v.is_finite() && *v * old(g) as f64 > 0.0 && v.abs() < f32::MAX as f64
                    })
                });
                for g in 0..groups {
                    out[r * groups + g] = match &fitted {
                        Some(s) => stored_scale(s[g] as f32),
                        None => old(g),
                    };
                }
            }
            out
        })
        .collect();
    let mut scales = vec![0f32; groups * n];
    for (&r0, part) in rows.iter().zip(&solved) {
        for (j, row) in part.chunks(groups).enumerate() {
            for (g, &s) in row.iter().enumerate() {
                scales[g * n + r0 + j] = s;
            }
        }
    }
    scales
}

/// Solve `m x = b` for a symmetric positive definite `m` (`[d, d]`, overwritten) by Cholesky;
/// `None` when it is not positive definite.
fn solve_spd(m: &mut [f64], mut b: Vec<f64>, d: usize) -> Option<Vec<f64>> {
    for j in 0..d {
        let mut s = m[j * d + j];
        for p in 0..j {
            s -= m[j * d + p] * m[j * d + p];
        }
        if s <= 0.0 || !s.is_finite() {
            return None;
        }
        let s = s.sqrt();
        m[j * d + j] = s;
        for i in j + 1..d {
            let mut v = m[i * d + j];
            for p in 0..j {
                v -= m[i * d + p] * m[j * d + p];
            }
            m[i * d + j] = v / s;
        }
    }
    for i in 0..d {
        let mut v = b[i];
        for p in 0..i {
            v -= m[i * d + p] * b[p];
        }
        b[i] = v / m[i * d + i];
    }
    for i in (0..d).rev() {
        let mut v = b[i];
        for p in i + 1..d {
            v -= m[p * d + i] * b[p];
        }
        b[i] = v / m[i * d + i];
    }
    Some(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::gptq::output_error_parts;
    use crate::quant::gptq::tests::{case, lcg};
    use crate::quant::{GptqConfig, GptqSolver, ScaleRule};

    #[test]
    fn spd_solve_matches_the_system() {
        let d = 5;
        let mut s = 9u64;
        let g: Vec<f64> = (0..d * d).map(|_| lcg(&mut s) as f64).collect();
        // m = g gᵀ + I
        let m: Vec<f64> = (0..d * d)
            .map(|ij| {
                let (i, j) = (ij / d, ij % d);
                (0..d).map(|p| g[i * d + p] * g[j * d + p]).sum::<f64>()
                    + if i == j { 1.0 } else { 0.0 }
            })
            .collect();
        let b: Vec<f64> = (0..d).map(|i| i as f64 - 1.5).collect();
        let x = solve_spd(&mut m.clone(), b.clone(), d).unwrap();
        for i in 0..d {
            let r: f64 = (0..d).map(|j| m[i * d + j] * x[j]).sum();
            assert!((r - b[i]).abs() < 1e-9, "{r} vs {}", b[i]);
        }
        assert!(solve_spd(&mut [1.0, 2.0, 2.0, 1.0], vec![1.0, 1.0], 2).is_none());
    }

    #[test]
    fn refitted_scales_lower_the_output_error_of_the_same_codes() {
        let (n, k) = (40, 256);
        let (w, h) = case(n, k, 512);
        for rule in [ScaleRule::Search, ScaleRule::SignedSearch] {
            refit_lowers_the_error(&w, &h, n, k, rule);
        }
    }

    fn refit_lowers_the_error(
        w: &[f32],
        h: &crate::quant::Hessian,
        n: usize,
        k: usize,
        rule: ScaleRule,
    ) {
        let cfg = GptqConfig {
            group_size: 64,
            block_size: 128,
            damp: 0.01,
            rule,
            grid: crate::quant::Grid::VLLM,
        };
        let solver = GptqSolver::new("t", h, 0.01).unwrap();
        let q = solver.quantize(w, n, &cfg).unwrap();
        let hm = h.matrix_f32();
        let err = |q: &QuantizedWeight| {
            let (a, b) = output_error_parts(w, &q.dequantize(), n, k, &hm);
            a / b
        };
        let refit = QuantizedWeight {
            scales: refit_scales(w, &q, &hm),
            ..q.clone()
        };
        let (before, after) = (err(&q), err(&refit));
        assert!(after < 0.99 * before, "{rule:?}: refit {after} vs {before}");
        // Every refitted scale is a stored value of its old scale's sign.
        assert!(refit
            .scales
            .iter()
            .zip(&q.scales)
            .all(|(&v, &old)| stored_scale(v) == v && v * old > 0.0));
        if rule == ScaleRule::SignedSearch {
            assert!(q.scales.iter().any(|&s| s < 0.0));
        }
    }
}
