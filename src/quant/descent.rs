//! Coordinate descent on a quantized linear's codes, its scales fixed.
//!
//! GPTQ visits each input once and never revisits a code after later inputs have moved: the codes it
//! ends with are not a local minimum of the output error Σ_rows (w − ŵ)ᵀ H (w − ŵ). A pass of
//! coordinate descent (QuantEase-style) does revisit them: for input k of row r, with the gradient
//! g = H (w − ŵ), the best value of ŵ_k with every other weight fixed is the grid point nearest to
//! ŵ_k + g_k / H_kk (the objective is a parabola in ŵ_k), and taking it lowers the error by
//! 2δ g_k − δ² H_kk. A change is kept only when that gain is positive, so every pass lowers the error
//! or leaves the codes as they are; the stored layout and scales do not change.
//!
//! The gradient is kept exact at block boundaries, the way GPTQ keeps its updates lazy: inside a block
//! of inputs each code sees the block's earlier changes through H's block, and after the block one GEMM
//! applies them to every input. A pass costs one N·K² GEMM, as a GPTQ solve's updates do.

use rayon::prelude::*;

use super::gptq::{matmul_nn, QuantizedWeight};

/// Inputs per block: one GEMM per block flushes its changes into the gradient.
const BLOCK: usize = 128;

/// Output rows per job (each row is its own problem).
const ROWS: usize = 256;

/// Up to `passes` passes of coordinate descent on `q`'s codes against `w` (`[N, K]`) and H (`hm`,
/// `[K, K]`, [`super::Hessian::matrix_f32`]); stops after a pass that changes nothing. Returns the
/// number of codes changed (a code changed twice counts twice).
pub fn descend(w: &[f32], q: &mut QuantizedWeight, hm: &[f32], passes: usize) -> usize {
    let (k, n, gs) = (q.in_features, q.out_features, q.group_size);
    assert_eq!((w.len(), hm.len(), q.codes.len()), (n * k, k * k, k * n));
    if passes == 0 || n == 0 || k == 0 {
        return 0;
    }
    let width = n
        .div_ceil(2 * rayon::current_num_threads().max(1))
        .clamp(1, ROWS);
    let chunks: Vec<usize> = (0..n).step_by(width).collect();
    let q_ro = &*q;
    let solved: Vec<(usize, Vec<u8>, usize)> = chunks
        .par_iter()
        .map(|&r0| {
            let r1 = (r0 + width).min(n);
            let (codes, changed) = descend_rows(w, q_ro, hm, r0, r1, passes, gs);
            (r0, codes, changed)
        })
        .collect();
    let mut total = 0;
    for (r0, codes, changed) in solved {
        let nc = codes.len() / k;
        for (kk, row) in codes.chunks_exact(nc).enumerate() {
            q.codes[kk * n + r0..kk * n + r0 + nc].copy_from_slice(row);
        }
        total += changed;
    }
    total
}

/// Rows `r0..r1`: their codes (`[K, r1 − r0]`) after the passes, and how many changed.
fn descend_rows(
    w: &[f32],
    q: &QuantizedWeight,
    hm: &[f32],
    r0: usize,
    r1: usize,
    passes: usize,
    gs: usize,
) -> (Vec<u8>, usize) {
    let (k, n, grid) = (q.in_features, q.out_features, q.grid);
    let nc = r1 - r0;
    let scale = |kk: usize, j: usize| q.scales[(kk / gs) * n + r0 + j];
    let mut codes = vec![0u8; k * nc];
    // The error E = W − Ŵ, transposed ([K, nc]), then the gradient G = H·E.
    let mut e = vec![0f32; k * nc];
    for kk in 0..k {
        for j in 0..nc {
            let c = q.codes[kk * n + r0 + j];
            codes[kk * nc + j] = c;
            e[kk * nc + j] = w[(r0 + j) * k + kk] - grid.dequant(c, scale(kk, j));
        }
    }
    let mut g = vec![0f32; k * nc];
    matmul_nn(hm, k, k, &e, nc, &mut g, false);
    drop(e);
    let mut delta = vec![0f32; BLOCK * nc];
    let mut local = vec![0f32; nc];
    let mut hcols = vec![0f32; k * BLOCK];
    let mut upd = vec![0f32; k * nc];
    let mut changed = 0;
    for _ in 0..passes {
        let before = changed;
        for i1 in (0..k).step_by(BLOCK) {
            let i2 = (i1 + BLOCK).min(k);
            let b = i2 - i1;
            delta[..b * nc].fill(0.0);
            // Which inputs of the block changed a code: the others add nothing to a gradient.
            let mut moved = [false; BLOCK];
            for kk in i1..i2 {
                let hkk = hm[kk * k + kk];
                if hkk <= 0.0 {
                    // A dead input: its weight does not reach the output.
                    continue;
                }
                // This input's gradient, with the block's earlier changes applied.
                local.copy_from_slice(&g[kk * nc..(kk + 1) * nc]);
                for p in (i1..kk).filter(|p| moved[p - i1]) {
                    let hpk = hm[p * k + kk];
                    let d = &delta[(p - i1) * nc..(p - i1 + 1) * nc];
                    local.iter_mut().zip(d).for_each(|(l, d)| *l -= hpk * d);
                }
                for (j, &gk) in local.iter().enumerate() {
                    let s = scale(kk, j);
                    let c = codes[kk * nc + j];
                    let cur = grid.dequant(c, s);
                    let next = grid.code(cur + gk / hkk, s);
                    if next == c {
                        continue;
                    }
                    let d = grid.dequant(next, s) - cur;
                    if 2.0 * d * gk - d * d * hkk > 0.0 {
                        codes[kk * nc + j] = next;
                        delta[(kk - i1) * nc + j] = d;
                        changed += 1;
                        moved[kk - i1] = true;
                    }
                }
            }
            if !moved.contains(&true) {
                continue;
            }
            // G −= H[:, i1..i2] · Δ: every input sees this block's changes.
            let hc = &mut hcols[..k * b];
            for (row, hrow) in hc.chunks_exact_mut(b).zip(hm.chunks_exact(k)) {
                row.copy_from_slice(&hrow[i1..i2]);
            }
            matmul_nn(hc, k, b, &delta[..b * nc], nc, &mut upd, false);
            g.iter_mut().zip(&upd).for_each(|(x, u)| *x -= u);
        }
        if changed == before {
            break;
        }
    }
    (codes, changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::gptq::tests::case;
    use crate::quant::{output_error_parts, rtn, GptqConfig, GptqSolver, Grid, ScaleRule};

    fn error(w: &[f32], q: &QuantizedWeight, hm: &[f32]) -> f64 {
        let (n, k) = (q.out_features, q.in_features);
        output_error_parts(w, &q.dequantize(), n, k, hm).0
    }

    #[test]
    fn descent_ends_in_a_local_minimum_lower_than_gptq_with_the_same_scales() {
        // K above one block and not a multiple of it: the partial last block is flushed too.
        let (n, k, gs) = (24, 192, 64);
        let (w, h) = case(n, k, 3 * k);
        let hm = h.matrix_f32();
        let cfg = GptqConfig {
            group_size: gs,
            block_size: 128,
            damp: 0.01,
            rule: ScaleRule::Search,
            grid: Grid::VLLM,
        };
        let solver = GptqSolver::new("t", &h, 0.01).unwrap();
        let gptq = solver.quantize(&w, n, &cfg).unwrap();
        let mut q = gptq.clone();
        let changed = descend(&w, &mut q, &hm, 50);
        assert!(changed > 0, "GPTQ's codes are not a local minimum");
        assert_eq!(q.scales, gptq.scales, "scales are fixed");
        let (before, after) = (error(&w, &gptq, &hm), error(&w, &q, &hm));
        assert!(after < 0.99 * before, "{after} vs GPTQ {before}");
        // Converged: no single code one step up or down lowers the error.
        for kk in 0..k {
            for r in 0..n {
                let c = q.codes[kk * n + r];
                for next in [c.wrapping_sub(1), c + 1] {
                    if next > 15 {
                        continue;
                    }
                    let mut p = q.clone();
                    p.codes[kk * n + r] = next;
                    let e = error(&w, &p, &hm);
                    assert!(
                        e >= after * (1.0 - 1e-5),
                        "code ({kk}, {r}) → {next}: {e} < {after}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_pass_only_lowers_the_error_from_rounding() {
        let (n, k, gs) = (16, 128, 32);
        let (w, h) = case(n, k, 2 * k);
        let hm = h.matrix_f32();
        let mut q = rtn(&w, n, k, &h, gs, ScaleRule::MaxOver7_5, Grid::VLLM);
        let mut last = error(&w, &q, &hm);
        for _ in 0..4 {
            descend(&w, &mut q, &hm, 1);
            let e = error(&w, &q, &hm);
            assert!(e <= last * (1.0 + 1e-6), "{e} after {last}");
            last = e;
        }
        let rounded = error(
            &w,
            &rtn(&w, n, k, &h, gs, ScaleRule::MaxOver7_5, Grid::VLLM),
            &hm,
        );
        assert!(last < 0.8 * rounded, "{last} vs RTN {rounded}");
        assert!(q.codes.iter().all(|&c| c <= 15));
    }
}
