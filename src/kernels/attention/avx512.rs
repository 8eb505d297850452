//! Decode attention of one query row on AVX-512: the `group` query heads that share a KV head
//! score each key in one pass over it (16-lane partial sums in registers, two per head), and
//! the values are accumulated 64 dimensions × up to 4 heads at a time in registers over blocks
//! of positions, so each value row is read once per block and the outputs are loaded and stored
//! once per block instead of once per position. bf16 rows are widened 16 values at a time by a
//! shift (exact). The portable body in `mod.rs` is the reference: the same math, sums in another
//! order.

use std::arch::x86_64::*;

use super::{prefetch, KvElem, L2};

/// Positions per value block: 16 rows of one KV head (16 KiB of f32 at hd 256, 8 KiB of bf16)
/// stay in L1 across the block's passes over its dimension chunks.
const BLOCK: usize = 16;
/// Positions ahead of the one being read whose key rows are prefetched into L2 (value rows:
/// `BLOCK.max(AHEAD)` ahead, the next block). Measured on Zen 4 at a 1.7B token's 512 context,
/// 1 thread (docs/BENCHMARKS.md "Decode attention in registers, per-head KV planes"): with rows of
/// all KV heads interleaved, into L1 4 ahead the stage took 7.9–8.7 ms, into L2 6–16 ahead
/// 6.0–6.9; from per-head planes 4.5–4.8 ms, and 5.9–6.3 with no prefetch.
const AHEAD: usize = 8;

/// [`super::attend`] for `hd` a multiple of 16.
///
/// # Safety
/// The CPU has AVX-512F (checked by the caller).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend<'a, T, K, V>(
    q: &[f32],
    &super::Window {
        ref key,
        ref value,
        lo,
        hi,
    }: &super::Window<K, V>,
    super::Heads {
        dim: hd,
        scale,
        bf16,
    }: super::Heads,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) where
    T: KvElem,
    K: Fn(usize) -> &'a [T],
    V: Fn(usize) -> &'a [T],
{
    assert!(hd.is_multiple_of(16) && hd > 0 && out.len().is_multiple_of(hd));
    let group = out.len() / hd;
    assert_eq!(q.len(), group * hd);
    let n = hi + 1 - lo;
    scores.clear();
    scores.resize(group * n, 0.0);
    for (j, pos) in (lo..=hi).enumerate() {
        if pos + AHEAD <= hi {
            prefetch::<L2>(key(pos + AHEAD));
        }
        let kr = key(pos);
        assert_eq!(kr.len(), hd);
        let mut h0 = 0;
        while h0 < group {
            let left = group - h0;
            // SAFETY: heads h0.. of q and the key row hold hd values each (asserted).
            unsafe {
                match left {
                    4.. => score::<T, 4>(q, kr, hd, h0, (j, n), scale, scores),
                    3 => score::<T, 3>(q, kr, hd, h0, (j, n), scale, scores),
                    2 => score::<T, 2>(q, kr, hd, h0, (j, n), scale, scores),
                    _ => score::<T, 1>(q, kr, hd, h0, (j, n), scale, scores),
                }
            }
            h0 += left.min(4);
        }
    }
    for sh in scores.chunks_exact_mut(n) {
        super::super::softmax(sh);
        if bf16 {
            super::super::convert::round_bf16_in_place(sh);
        }
    }
    out.fill(0.0);
    let mut rows = [std::ptr::null::<T>(); BLOCK];
    let mut b0 = lo;
    while b0 <= hi {
        let b1 = (b0 + BLOCK - 1).min(hi);
        for (r, pos) in (b0..=b1).enumerate() {
            let vr = value(pos);
            assert_eq!(vr.len(), hd);
            rows[r] = vr.as_ptr();
            if pos + BLOCK.max(AHEAD) <= hi {
                prefetch::<L2>(value(pos + BLOCK.max(AHEAD)));
            }
        }
        let block = Block {
            rows: &rows[..b1 + 1 - b0],
            scores,
            n,
            j0: b0 - lo,
        };
        let mut h0 = 0;
        while h0 < group {
            let left = group - h0;
            // SAFETY: the block's rows point at hd values each; scores holds its positions.
            unsafe {
                match left {
                    4.. => accumulate::<T, 4>(&block, h0, hd, out),
                    3 => accumulate::<T, 3>(&block, h0, hd, out),
                    2 => accumulate::<T, 2>(&block, h0, hd, out),
                    _ => accumulate::<T, 1>(&block, h0, hd, out),
                }
            }
            h0 += left.min(4);
        }
        b0 = b1 + 1;
    }
}

/// `scores[(h0 + h)·n + j] = scale · q[h0 + h] · k` for `G` heads (`(j, n)`: key j of score rows
/// n long): each 16 values of the key are loaded once for the `G` heads; two partial sums per
/// head (even and odd chunks) hide the add latency.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn score<T: KvElem, const G: usize>(
    q: &[f32],
    k: &[T],
    hd: usize,
    h0: usize,
    (j, n): (usize, usize),
    scale: f32,
    scores: &mut [f32],
) {
    assert!(q.len() >= (h0 + G) * hd && k.len() == hd);
    let (qp, kp) = (q.as_ptr(), k.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); 2]; G];
    let mut c = 0;
    while c < hd {
        // Two chunks per step into the two partial sums; a last odd chunk goes to the first.
        let pair = c + 32 <= hd;
        // SAFETY: c + 16 (c + 32 when `pair`) ≤ hd; head h0 + h's row lies inside q (asserted).
        unsafe {
            let k0 = load16(kp.add(c));
            let k1 = if pair {
                load16(kp.add(c + 16))
            } else {
                _mm512_setzero_ps()
            };
            for (h, acc) in acc.iter_mut().enumerate() {
                let qh = qp.add((h0 + h) * hd + c);
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(qh), k0, acc[0]);
                if pair {
                    acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(qh.add(16)), k1, acc[1]);
                }
            }
        }
        c += if pair { 32 } else { 16 };
    }
    for (h, acc) in acc.iter().enumerate() {
        scores[(h0 + h) * n + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) * scale;
    }
}

/// A block of value rows: `rows[r]` is position `j0 + r` of the window, whose score for head h
/// is `scores[h·n + j0 + r]`.
struct Block<'s, T> {
    rows: &'s [*const T],
    scores: &'s [f32],
    n: usize,
    j0: usize,
}

/// `out[h0 + h] += Σ_r scores[(h0 + h)·n + j0 + r] · rows[r]` for `G` heads, 64 dimensions at
/// a time (16 dimensions for the last chunks of an hd that is not a multiple of 64), the `G`
/// heads' partial outputs in registers across the block's rows.
///
/// # Safety
/// Every row of `b` points at `hd` readable values.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn accumulate<T: KvElem, const G: usize>(
    b: &Block<T>,
    h0: usize,
    hd: usize,
    out: &mut [f32],
) {
    assert!(out.len() >= (h0 + G) * hd && b.scores.len() >= (h0 + G) * b.n);
    assert!(b.j0 + b.rows.len() <= b.n && hd.is_multiple_of(16));
    let op = out.as_mut_ptr();
    let mut d = 0;
    while d + 64 <= hd {
        // SAFETY: d + 64 ≤ hd for every row and every head's output.
        unsafe { accumulate_chunk::<T, G, 4>(b, h0, hd, op, d) };
        d += 64;
    }
    while d < hd {
        // SAFETY: d + 16 ≤ hd (hd is a multiple of 16).
        unsafe { accumulate_chunk::<T, G, 1>(b, h0, hd, op, d) };
        d += 16;
    }
}

#[inline(always)]
unsafe fn accumulate_chunk<T: KvElem, const G: usize, const C: usize>(
    b: &Block<T>,
    h0: usize,
    hd: usize,
    op: *mut f32,
    d: usize,
) {
    // SAFETY (all): the caller's bounds: 16·C values from d in each row and output head; the
    // scores index is below (h0 + G)·n (asserted by the caller).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        for (h, acc) in acc.iter_mut().enumerate() {
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(op.add((h0 + h) * hd + d + 16 * i));
            }
        }
        for (r, &row) in b.rows.iter().enumerate() {
            let mut v = [_mm512_setzero_ps(); C];
            for (i, v) in v.iter_mut().enumerate() {
                *v = load16(row.add(d + 16 * i));
            }
            for (h, acc) in acc.iter_mut().enumerate() {
                let s = _mm512_set1_ps(*b.scores.get_unchecked((h0 + h) * b.n + b.j0 + r));
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(s, *v, *a);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            for (i, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(op.add((h0 + h) * hd + d + 16 * i), *a);
            }
        }
    }
}

/// 16 values from `p` as f32: loaded, or bf16 widened by a shift (exact).
///
/// # Safety
/// 16 values are readable at `p`; the CPU has AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16<T: KvElem>(p: *const T) -> __m512 {
    // SAFETY: the caller's bounds.
    unsafe {
        if T::BF16 {
            let bits = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
        } else {
            _mm512_loadu_ps(p as *const f32)
        }
    }
}
