//! Numeric kernels, kept apart from the model. Every kernel has a plain
//! scalar reference; fast paths are tested against it.

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub mod attention;
// Shared by each format's AVX-512 child module (`bf16::avx512`, …).
// (AVX-512 intrinsics are why the crate needs Rust 1.89.)
#[cfg(target_arch = "x86_64")]
mod avx512_util;
pub mod bf16;
pub mod convert;
pub mod fit;
pub mod gelu;
pub mod isa;
pub mod par;
pub mod peak;
#[cfg(test)]
pub(crate) mod test_util;
pub mod w4;
pub mod w4a16;
pub mod w4a8;

use std::ops::Range;
use std::sync::OnceLock;

use par::{for_ranges, ColumnsOut};

/// How the decode kernels read weights on this CPU (`SPARK_DECODE_WALK`
/// overrides it): "one stream" or "two streams + prefetch".
pub fn decode_walk() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if isa::isa().avx512() {
        return avx512_util::walk().name();
    }
    "one stream"
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` — the shape every linear layer needs
/// (weights stored PyTorch-style, `[out_features, in_features]`).
pub trait F32Matmul: Send + Sync {
    fn name(&self) -> &'static str;
    fn matmul_nt(&self, x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32]);
}

/// The scalar reference: one dot product per output, summed in order.
pub struct ReferenceMatmul;

impl F32Matmul for ReferenceMatmul {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn matmul_nt(&self, x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32]) {
        assert_eq!((x.len(), w.len(), y.len()), (m * k, n * k, m * n));
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            for j in 0..n {
                y[i * n + j] = dot(xr, &w[j * k..(j + 1) * k]);
            }
        }
    }
}

/// The `gemm` crate (runtime-dispatched AVX2/AVX-512/NEON micro-kernels, rayon).
pub struct GemmCrateMatmul;

impl F32Matmul for GemmCrateMatmul {
    fn name(&self) -> &'static str {
        "gemm"
    }
    fn matmul_nt(&self, x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32]) {
        assert_eq!((x.len(), w.len(), y.len()), (m * k, n * k, m * n));
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            y.fill(0.0);
            return;
        }
        let threads = rayon::current_num_threads();
        let par = if threads > 1 && m * n * k >= 1 << 18 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: the asserts above: x is m×k, w is n×k, y is m×n, all row-major.
        unsafe { gemm_nt((m, n, k), x, w, (y.as_mut_ptr(), n), par) }
    }
}

/// The matmul in use: `gemm`, unless `SPARK_KERNELS=reference` asks for the scalar reference.
pub fn matmul() -> &'static dyn F32Matmul {
    static CHOSEN: OnceLock<&'static dyn F32Matmul> = OnceLock::new();
    *CHOSEN.get_or_init(|| match std::env::var("SPARK_KERNELS").as_deref() {
        Ok("reference") => &ReferenceMatmul,
        _ => &GemmCrateMatmul,
    })
}

/// `y[m, n] = x[m, k] · Wᵀ` for weights stored compactly (bf16, 4-bit) and
/// many rows `m`: each job widens a panel of weight rows to f32 with
/// `expand(rows, out[rows.len() × k])` and multiplies it with `gemm`, so the
/// compact weights are never expanded all at once.
pub fn panel_matmul(
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    y: &mut [f32],
    expand: impl Fn(Range<usize>, &mut [f32]) + Sync,
) {
    assert_eq!((x.len(), y.len()), (m * k, m * n));
    if m == 0 || n == 0 {
        return;
    }
    // ~1 MiB of f32 per panel: it stays in L2 while gemm sweeps the rows.
    let p = ((1usize << 18) / k.max(1)).clamp(16, 256) / 16 * 16;
    let out = ColumnsOut::new(y, m, n);
    for_ranges(n.div_ceil(p), m * n * k, |panels| {
        let mut buf = vec![0f32; p * k];
        for pi in panels {
            let cols = pi * p..((pi + 1) * p).min(n);
            let w = &mut buf[..cols.len() * k];
            expand(cols.clone(), w);
            // SAFETY: x is m×k and the panel cols.len()×k; the destination is
            // columns `cols` of the m×n y, owned by this job alone.
            unsafe {
                gemm_nt(
                    (m, cols.len(), k),
                    x,
                    w,
                    (out.ptr_at(0, cols.start), n),
                    gemm::Parallelism::None,
                )
            }
        }
    });
}

/// `dst[i, j] = Σ_kk x[i, kk] · w[j, kk]` with `gemm`: x is `[m, k]` and w
/// `[n, k]` row-major, dst has row stride `dst_rs`.
///
/// # Safety
/// `dst` must be valid for writes of m rows of n values at stride `dst_rs` that nothing else
/// accesses.
unsafe fn gemm_nt(
    (m, n, k): (usize, usize, usize),
    x: &[f32],
    w: &[f32],
    (dst, dst_rs): (*mut f32, usize),
    par: gemm::Parallelism,
) {
    // rhs = wᵀ: element (kk, j) at w[j·k + kk].
    // SAFETY: forwarded from the caller.
    unsafe { gemm_strided((m, n, k), (dst, dst_rs), (x, k), (w, 1, k), par) }
}

/// `dst[m, n] = lhs[m, k] · rhs` with `gemm`: lhs rows `lhs_rs` apart, rhs element (kk, j) at
/// `rhs[kk·rhs_rs + j·rhs_cs]`, dst rows `dst_rs` apart; the one home of every f32 `gemm` call.
/// Each operand comes with its strides, as `(data, row stride[, column stride])`.
///
/// # Safety
/// `dst` must be valid for writes of m rows of n values at stride `dst_rs` that nothing else
/// accesses. (The operands' bounds are asserted.)
pub(crate) unsafe fn gemm_strided(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut f32, usize),
    (lhs, lhs_rs): (&[f32], usize),
    (rhs, rhs_rs, rhs_cs): (&[f32], usize, usize),
    par: gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            // SAFETY: row i of dst, n values, is the caller's promise.
            unsafe { std::slice::from_raw_parts_mut(dst.add(i * dst_rs), n) }.fill(0.0);
        }
        return;
    }
    assert!(lhs.len() >= (m - 1) * lhs_rs + k);
    assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs);
    // SAFETY: operand bounds asserted above; dst is the caller's promise.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
            lhs.as_ptr(),
            1,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// `[rows, cols]` → `[cols, rows]`, 64 output rows per parallel job.
pub fn transpose<T: Copy + Default + Send + Sync>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
    assert_eq!(src.len(), rows * cols);
    let mut out = vec![T::default(); rows * cols];
    if rows == 0 || cols == 0 {
        return out;
    }
    use rayon::prelude::*;
    out.par_chunks_mut(64 * rows)
        .enumerate()
        .for_each(|(b, block)| {
            let c0 = b * 64;
            let nc = block.len() / rows;
            for r in 0..rows {
                for (c, v) in src[r * cols + c0..r * cols + c0 + nc].iter().enumerate() {
                    block[c * rows + r] = *v;
                }
            }
        });
    out
}

#[inline]
pub fn dot<T: convert::KvElem>(a: &[f32], b: &[T]) -> f32 {
    // Eight partial sums: lets the compiler vectorise and halves rounding drift.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].widen();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y.widen();
    }
    s
}

/// `out = w ⊙ x / sqrt(mean(x²) + eps)` per row of `x` (plain weight, not 1 + w). Σx² in f64
/// over 8 fixed lanes (so it vectorises; the order is the code's, the same bits on every tier;
/// a single running f64 sum was 6 % of a 1.7B prefill); a prefill's rows spread over threads.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    use rayon::prelude::*;
    let d = w.len();
    let row = |(xr, or): (&[f32], &mut [f32])| {
        let mut lanes = [0f64; 8];
        for c in xr.chunks(8) {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l += (*v as f64) * (*v as f64);
            }
        }
        let ms = lanes.iter().sum::<f64>() / d as f64;
        let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
        for ((o, xv), wv) in or.iter_mut().zip(xr).zip(w) {
            *o = wv * (xv * inv);
        }
    };
    // Rows per job: enough work to cover a fan-out (decode's one row stays on this thread).
    const ROWS: usize = 16;
    if x.len() >= 2 * ROWS * d {
        x.par_chunks(ROWS * d)
            .zip(out.par_chunks_mut(ROWS * d))
            .for_each(|(xs, os)| xs.chunks_exact(d).zip(os.chunks_exact_mut(d)).for_each(row));
    } else {
        x.chunks_exact(d).zip(out.chunks_exact_mut(d)).for_each(row);
    }
}

pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// e^a for a ≤ 0 without libm, so that it vectorises: a Cody–Waite reduction to |r| ≤ ln2/2 and
/// the Taylor polynomial of e^r to r⁷ (truncation 5.5e-9), then a power of two from the exponent
/// bits; within a few f32 roundings of the exact value (tests below: 5e-7 relative). a below −87
/// gives e^−87 (a normal float: callers treat it as nothing beside their terms); NaN stays NaN.
/// Plain IEEE operations only (no fused multiply-add), so every tier gives the same bits.
#[inline(always)]
pub(crate) fn exp_nonpositive(a: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts: n·LN2_HI is exact for |n| < 2⁹.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2²³ rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    // Not `a.max(−87)`, which would turn a NaN into e^−87.
    let a = if a < -87.0 { -87.0 } else { a };
    let shifted = a * LOG2E + MAGIC;
    let n = shifted - MAGIC;
    let ni = shifted.to_bits() as i32 - MAGIC.to_bits() as i32;
    let r = (a - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    p * f32::from_bits((ni.wrapping_add(127) << 23) as u32)
}

/// In-place softmax with max subtraction: e^(x − max) by [`exp_nonpositive`] and the sum in 16
/// partial sums, so the whole pass vectorises (decode attention's scores: a Spark-1.7B token at
/// 512 context takes ≈ 114 K of these exponentials).
#[inline]
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa::isa().avx512() {
        // SAFETY: the tier is only chosen on a CPU with AVX-512.
        return unsafe { softmax_avx512(x) };
    }
    softmax_body(x)
}

#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    const LANES: usize = 16;
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        m.iter_mut().zip(c).for_each(|(m, v)| *m = m.max(*v));
    }
    let max = m
        .iter()
        .chain(chunks.remainder())
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let mut s = [0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        s.iter_mut().zip(c).for_each(|(s, v)| {
            *v = exp_nonpositive(*v - max);
            *s += *v;
        });
    }
    let mut sum = s.iter().sum::<f32>();
    for v in chunks.into_remainder() {
        *v = exp_nonpositive(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The same code, compiled for 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn softmax_avx512(x: &mut [f32]) {
    softmax_body(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn transpose_moves_every_element_once() {
        for (r, c) in [(1, 1), (3, 130), (130, 3), (64, 64), (65, 129)] {
            let m: Vec<u32> = (0..(r * c) as u32).collect();
            let t = transpose(&m, r, c);
            for i in 0..r {
                for j in 0..c {
                    assert_eq!(t[j * r + i], m[i * c + j]);
                }
            }
        }
    }

    fn rand_vec(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect()
    }

    #[test]
    fn gemm_matches_reference_on_odd_shapes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 257, 33),
            (3, 64, 7),
            (17, 130, 65),
            (64, 256, 300),
        ] {
            let x = rand_vec(&mut rng, m * k);
            let w = rand_vec(&mut rng, n * k);
            let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
            ReferenceMatmul.matmul_nt(&x, m, k, &w, n, &mut a);
            GemmCrateMatmul.matmul_nt(&x, m, k, &w, n, &mut b);
            for (p, q) in a.iter().zip(&b) {
                // |terms| ≤ 1 and k ≤ 257: f32 summation-order differences stay far below 1e-4.
                assert!(
                    (p - q).abs() <= 1e-4 * (1.0 + p.abs()),
                    "{m}x{k}x{n}: {p} vs {q}"
                );
            }
        }
    }

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0f32, 4.0, 0.0, 0.0];
        let w = [1.0f32, 2.0, 1.0, 1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        // mean(x²) = 25/4 → rms 2.5
        assert!((out[0] - 1.2).abs() < 1e-6 && (out[1] - 3.2).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one_and_handles_large_values() {
        let mut x = [1000.0f32, 1001.0, 999.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[1] > x[0] && x[0] > x[2]);
    }

    /// Against an f64 softmax, on lengths around the 16 lanes and spreads up to 60 (terms far
    /// below the largest): 2e-6 relative for each probability above 1e-30, plus the f32 rounding
    /// of its x − max, on every tier.
    #[test]
    fn softmax_matches_f64() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for n in [1, 2, 15, 16, 17, 33, 100, 512, 2049] {
            for spread in [0.1f32, 5.0, 60.0] {
                let x: Vec<f32> = (0..n)
                    .map(|_| rng.random_range(-spread..spread) + 30.0)
                    .collect();
                let max = x.iter().fold(f64::NEG_INFINITY, |a, v| a.max(*v as f64));
                let e: Vec<f64> = x.iter().map(|v| (*v as f64 - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for tier in [true, false] {
                    let mut got = x.clone();
                    if tier {
                        softmax(&mut got);
                    } else {
                        softmax_body(&mut got);
                    }
                    for ((g, e), v) in got.iter().zip(&e).zip(&x) {
                        let want = e / sum;
                        // x − max is rounded in f32: half an ulp of it, relative, on top.
                        let tolerance = 2e-6 + (max - *v as f64) * 6e-8;
                        if want > 1e-30 {
                            let rel = (*g as f64 - want).abs() / want;
                            assert!(rel < tolerance, "n {n} spread {spread}: {g} vs {want}");
                        }
                    }
                }
            }
        }
    }

    /// The exponential on a dense grid of [−87, 0]: 5e-7 relative against f64; NaN stays NaN and
    /// −∞ gives e^−87.
    #[test]
    fn exp_nonpositive_is_within_a_few_roundings() {
        for i in 0..=870_000 {
            let a = -(i as f32) * 1e-4;
            let want = (a as f64).exp();
            let rel = (exp_nonpositive(a) as f64 - want).abs() / want;
            assert!(rel < 5e-7, "{a}: {} vs {want}", exp_nonpositive(a));
        }
        assert!(exp_nonpositive(f32::NAN).is_nan());
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), exp_nonpositive(-87.0));
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }
}
