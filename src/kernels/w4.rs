//! 4-bit weight kernels with the numerics of vLLM's CPU paths (docs/GPTQ_FORMAT.md §8–§9).
//!
//! Weights arrive as signed codes `c = q − zero` (−8…7 for symmetric GPTQ),
//! row-major `[N, K]`, and per-(row, group) scales `[N, K/G]` in f32 (the
//! bf16-exact value vLLM holds).

use std::ops::Range;

use half::bf16;
use rayon::prelude::*;

pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// W4A16 (`cpu_gemm_wna16`): w = bf16(float(c) · s), the dense f32 matrix the
/// fp32-accumulating GEMM multiplies by.
pub fn w4a16_weights(codes: &[i8], scales: &[f32], n: usize, k: usize, g: usize) -> Vec<f32> {
    let mut w = vec![0f32; n * k];
    let groups = k / g;
    w.par_chunks_mut(k).enumerate().for_each(|(row, out)| {
        for (kk, o) in out.iter_mut().enumerate() {
            *o = round_bf16(codes[row * k + kk] as f32 * scales[row * groups + kk / g]);
        }
    });
    w
}

/// `x.round_ties_even()` for |x| ≤ 2^22: adding and removing 1.5·2^23 leaves
/// the hardware's round-to-nearest-even. Unlike `round_ties_even`, which is
/// a libm call on baseline x86-64, this vectorises.
#[inline]
pub fn round_ties_even_small(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// Per-token dynamic symmetric int8 quantization of one activation row
/// (`int4_scaled_mm_cpu` steps 1–2): returns (a, sa) with x ≈ sa·a.
pub fn quantize_activation_row(x: &[f32], a: &mut [i32]) -> f32 {
    // 16 independent maxima, so the loop vectorises (a single running max is one dependent
    // `maxss` per value); max is exact, so the order does not change the result.
    let mut lanes = [0f32; 16];
    for c in x.chunks(16) {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    let amax = lanes.iter().fold(0f32, |m, v| m.max(*v)).max(1e-7);
    // Both are true IEEE divisions; 1/amax·127 flips values at exact .5 ties.
    let sa = amax / 127.0;
    let inv = 127.0 / amax;
    for (q, v) in a.iter_mut().zip(x) {
        *q = round_ties_even_small(v * inv) as i32;
    }
    sa
}

/// Where the 4-bit codes (0…15) of a `[n, k]` weight come from.
#[derive(Clone, Copy)]
pub enum Codes<'a> {
    /// One code per byte, row-major `[n, k]`.
    Unpacked(&'a [u8]),
    /// GPTQ `qweight` bytes as stored: little-endian int32 `[k/8, n_all]`,
    /// nibble i of word (r, c) is input 8r + i of column c. This weight is
    /// columns `col0..col0 + n` (one of q/k/v in a fused `q_k_v_proj`).
    /// Read in place from the mmap, so loading never unpacks the whole tensor.
    GptqWords {
        bytes: &'a [u8],
        n_all: usize,
        col0: usize,
    },
}

impl Codes<'_> {
    /// Codes of weight rows `rows` into `out` (`[rows.len(), k]`).
    pub fn rows_into(&self, k: usize, rows: Range<usize>, out: &mut [u8]) {
        debug_assert_eq!(out.len(), rows.len() * k);
        match *self {
            Codes::Unpacked(q) => out.copy_from_slice(&q[rows.start * k..rows.end * k]),
            Codes::GptqWords { bytes, n_all, col0 } => {
                // Walk the stored rows in order: each reads one contiguous run
                // of this block's words, so the block costs one pass over its
                // bytes whatever the stride between columns.
                let (c0, nc) = (col0 + rows.start, rows.len());
                for r in 0..k / 8 {
                    let run = &bytes[(r * n_all + c0) * 4..(r * n_all + c0 + nc) * 4];
                    for (j, w) in run.chunks_exact(4).enumerate() {
                        let word = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                        let dst = &mut out[j * k + 8 * r..j * k + 8 * r + 8];
                        for (i, d) in dst.iter_mut().enumerate() {
                            *d = ((word >> (4 * i)) & 15) as u8;
                        }
                    }
                }
            }
        }
    }
}

/// How many stored `qweight` rows ahead the repacks prefetch (each row of a job is one short run
/// of a long row, so the hardware prefetchers do not follow).
pub(crate) const ROWS_AHEAD: usize = 4;

/// Map the whole pages of `buf`, a fresh buffer about to be filled, with one `madvise`
/// (`MADV_POPULATE_WRITE`, Linux 5.14+) instead of one page fault per 4 KiB as the writes reach
/// them: ≈ 8 % of a 1.7B model's load (docs/BENCHMARKS.md "Time to first token"). The contents do not
/// change (missing pages read as zero either way); where the kernel refuses, the writes fault as before.
pub(crate) fn prefault_for_writing(buf: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (buf.as_ptr() as usize).div_ceil(PAGE) * PAGE;
        let end = (buf.as_ptr() as usize + buf.len()) / PAGE * PAGE;
        if end > start {
            // SAFETY: the range lies inside `buf`, which this caller owns mutably; the advice only
            // maps pages, it changes no byte. The result is ignored on purpose (advice only).
            unsafe {
                libc::madvise(
                    start as *mut libc::c_void,
                    end - start,
                    libc::MADV_POPULATE_WRITE,
                )
            };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

/// Ask for the cache lines of `bytes[at..at + len]` (ignored past the end).
#[inline]
pub(crate) fn prefetch_run(bytes: &[u8], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (at..(at + len).min(bytes.len())).step_by(64) {
        // SAFETY: a prefetch of an address inside the slice; it never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                bytes.as_ptr().add(off) as *const i8,
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, at, len);
}

/// The 4 nibbles of `x` (bits 0..16) one per byte, in bits 0..4 of each.
#[inline]
pub(crate) fn spread4(x: u32) -> u32 {
    let x = x & 0xFFFF;
    let x = (x | (x << 8)) & 0x00FF_00FF;
    (x | (x << 4)) & 0x0F0F_0F0F
}

/// The 8 nibbles of `x` one per byte, in bits 0..4 of each.
#[inline]
pub(crate) fn spread8(x: u32) -> u64 {
    let x = x as u64;
    let x = (x | (x << 16)) & 0x0000_FFFF_0000_FFFF;
    let x = (x | (x << 8)) & 0x00FF_00FF_00FF_00FF;
    (x | (x << 4)) & 0x0F0F_0F0F_0F0F_0F0F
}

/// 4-bit weights as GPTQ stores them, `[n, k]`: codes `q` (0…15) with a
/// zero point and a scale per (row, group) — signed code c = q − zero.
/// What the packed kernels ([`super::w4a8`], [`super::w4a16`]) are built from.
#[derive(Clone, Copy)]
pub struct W4Nibbles<'a> {
    pub q: Codes<'a>,
    /// `[n, k/g]`
    pub zeros: &'a [i32],
    /// `[n, k/g]`, bf16 values (what vLLM holds after loading).
    pub scales: &'a [f32],
    pub n: usize,
    pub k: usize,
    pub g: usize,
}

impl W4Nibbles<'_> {
    pub fn groups(&self) -> usize {
        self.k / self.g
    }

    /// Panics on inconsistent sizes (a caller bug, not bad input: the loader
    /// validates checkpoints before building these).
    pub(crate) fn check(&self) {
        let (n, k, g) = (self.n, self.k, self.g);
        assert!(
            g > 0 && k % g == 0,
            "k {k} is not a multiple of the group {g}"
        );
        match self.q {
            Codes::Unpacked(q) => {
                assert_eq!(q.len(), n * k, "nibbles");
                assert!(q.iter().all(|&q| q < 16), "nibbles above 15");
            }
            Codes::GptqWords { bytes, n_all, col0 } => {
                assert!(k % 8 == 0 && col0 + n <= n_all, "qweight columns");
                assert_eq!(bytes.len(), k / 8 * n_all * 4, "qweight bytes");
            }
        }
        assert_eq!(self.zeros.len(), n * (k / g), "zeros");
        assert_eq!(self.scales.len(), n * (k / g), "scales");
        assert!(
            self.scales
                .iter()
                .all(|s| s.is_finite() && round_bf16(*s).to_bits() == s.to_bits()),
            "scales must be finite bf16 values"
        );
    }

    /// All codes, `[n, k]`.
    pub fn unpacked(&self) -> Vec<u8> {
        let mut q = vec![0u8; self.n * self.k];
        self.q.rows_into(self.k, 0..self.n, &mut q);
        q
    }

    /// The signed codes `q − zero` (the form [`w4a8_matmul`] takes).
    pub fn codes(&self) -> Vec<i8> {
        let groups = self.groups();
        let q = self.unpacked();
        (0..self.n * self.k)
            .map(|i| {
                let (row, kk) = (i / self.k, i % self.k);
                (q[i] as i32 - self.zeros[row * groups + kk / self.g]) as i8
            })
            .collect()
    }
}

/// Zero points of a packed layout: one value for the whole matrix (GPTQ
/// symmetric: 8) or one per (row, group) in the layout's order.
#[derive(Clone, Debug)]
pub(crate) enum Zeros {
    Uniform(i32),
    PerGroup(Vec<i8>),
}

impl Zeros {
    /// `order` lists the source index (into `zeros`) for each stored slot;
    /// `None` marks padding.
    pub(crate) fn new(zeros: &[i32], order: impl Iterator<Item = Option<usize>>) -> Self {
        match zeros.first() {
            Some(&z0) if zeros.iter().all(|&z| z == z0) => Zeros::Uniform(z0),
            None => Zeros::Uniform(0),
            Some(_) => Zeros::PerGroup(
                order
                    .map(|i| {
                        i.map_or(0, |i| {
                            i8::try_from(zeros[i]).expect("zero point outside i8 range")
                        })
                    })
                    .collect(),
            ),
        }
    }

    #[inline]
    pub(crate) fn get(&self, slot: usize) -> i32 {
        match self {
            Zeros::Uniform(z) => *z,
            Zeros::PerGroup(v) => v[slot] as i32,
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            Zeros::Uniform(_) => 0,
            Zeros::PerGroup(v) => v.len(),
        }
    }
}

/// Signed 4-bit codes `[n, k]` with scales `[n, k/g]`.
#[derive(Clone, Copy)]
pub struct W4Weights<'a> {
    pub codes: &'a [i8],
    pub scales: &'a [f32],
    pub n: usize,
    pub k: usize,
    pub g: usize,
}

/// W4A8 (`int4_scaled_mm_cpu`), bit-exact: x is `[m, k]` (already bf16 values),
/// y `[m, n]` receives bf16-rounded outputs. Blocks of `bk = min(G, 128)` are
/// summed exactly in i32, then `out = fma(float(acc)·sa, s, out)`.
pub fn w4a8_matmul(x: &[f32], m: usize, w: W4Weights, y: &mut [f32]) {
    let W4Weights {
        codes,
        scales,
        n,
        k,
        g,
    } = w;
    let groups = k / g;
    let bk = g.min(128);
    let mut a = vec![0i32; k];
    for row in 0..m {
        let sa = quantize_activation_row(&x[row * k..(row + 1) * k], &mut a);
        let a = &a;
        y[row * n..(row + 1) * n]
            .par_chunks_mut(64)
            .enumerate()
            .for_each(|(chunk, out)| {
                for (j, o) in out.iter_mut().enumerate() {
                    let col = chunk * 64 + j;
                    let c = &codes[col * k..(col + 1) * k];
                    let s = &scales[col * groups..(col + 1) * groups];
                    let mut acc_f = 0f32;
                    for b0 in (0..k).step_by(bk) {
                        // A last, shorter block only when G does not divide into 128-blocks.
                        let b1 = (b0 + bk).min(k);
                        let acc: i32 = a[b0..b1]
                            .iter()
                            .zip(&c[b0..b1])
                            .map(|(&p, &q)| p * q as i32)
                            .sum();
                        let t = acc as f32 * sa;
                        acc_f = t.mul_add(s[b0 / g], acc_f);
                    }
                    *o = round_bf16(acc_f);
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/GPTQ_FORMAT.md §8 written out literally, one output at a time.
    fn reference(
        x: &[f32],
        k: usize,
        codes: &[i8],
        scales: &[f32],
        n: usize,
        g: usize,
    ) -> Vec<f32> {
        let amax = x.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-7);
        let sa = amax / 127.0;
        let inv = 127.0 / amax;
        let a: Vec<i32> = x
            .iter()
            .map(|v| (v * inv).round_ties_even() as i32)
            .collect();
        let bk = g.min(128);
        (0..n)
            .map(|col| {
                let mut out = 0f32;
                let mut b0 = 0;
                while b0 < k {
                    let mut acc = 0i32;
                    for kk in b0..b0 + bk {
                        acc += a[kk] * codes[col * k + kk] as i32;
                    }
                    let t = acc as f32 * sa;
                    out = t.mul_add(scales[col * (k / g) + b0 / g], out);
                    b0 += bk;
                }
                bf16::from_f32(out).to_f32()
            })
            .collect()
    }

    #[test]
    fn w4a8_is_bit_exact_to_the_recipe() {
        let (k, n) = (256, 96);
        let mut s = 9u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        for g in [32, 64, 128] {
            let codes: Vec<i8> = (0..n * k).map(|_| (next() % 16) as i8 - 8).collect();
            let scales: Vec<f32> = (0..n * (k / g))
                .map(|_| round_bf16((next() % 1000) as f32 * 1e-5 + 1e-4))
                .collect();
            let mut x: Vec<f32> = (0..k)
                .map(|_| round_bf16((next() % 2001) as f32 / 1000.0 - 1.0))
                .collect();
            x[5] = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 2.0; // an exact .5 tie after scaling
            let mut y = vec![0f32; n];
            w4a8_matmul(
                &x,
                1,
                W4Weights {
                    codes: &codes,
                    scales: &scales,
                    n,
                    k,
                    g,
                },
                &mut y,
            );
            let want = reference(&x, k, &codes, &scales, n, g);
            assert!(
                y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "g{g}"
            );
        }
    }

    #[test]
    fn small_round_matches_round_ties_even() {
        for i in -300_000..=300_000 {
            let x = i as f32 * 0.000_5; // includes every .5 tie in ±150
            assert_eq!(round_ties_even_small(x), x.round_ties_even(), "{x}");
        }
        for x in [
            127.0f32, -127.0, 126.5, -126.5, 0.5, -0.5, 1.5, 2.5, 0.0, -0.0,
        ] {
            assert_eq!(round_ties_even_small(x), x.round_ties_even(), "{x}");
        }
    }

    #[test]
    fn activation_quantization_is_symmetric_int8() {
        let x = [0.5f32, -1.0, 0.25, 0.0];
        let mut a = [0i32; 4];
        let sa = quantize_activation_row(&x, &mut a);
        assert_eq!(a, [64, -127, 32, 0]); // 63.5 rounds to even 64
        assert!((sa - 1.0 / 127.0).abs() < 1e-9);
    }

    #[test]
    fn w4a16_rounds_weights_to_bf16() {
        let w = w4a16_weights(&[7, -8], &[1.007_812_5], 1, 2, 2);
        assert_eq!(w, vec![round_bf16(7.0 * 1.007_812_5), -8.0 * 1.007_812_5]);
        assert_ne!(w[0], 7.0 * 1.007_812_5, "7·s needs more than bf16's 8 bits");
    }
}
