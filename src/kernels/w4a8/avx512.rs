//! AVX-512 (F/BW/VL + VNNI) version of the W4A8 kernel. The layout and
//! numerics are described, and the portable version written, in the parent
//! module; tests there compare every tier.
//!
//! Every function here is `unsafe`: the caller has checked
//! [`Isa::avx512`](crate::kernels::isa::Isa::avx512) on this CPU, and owns the output
//! columns it passes (disjoint between parallel jobs).

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Acts, PackedW4A8, TILE};
use crate::kernels::avx512_util::{prefetch, round_bf16_ps, walk, walk_columns, PREFETCH_BYTES};
use crate::kernels::gelu::gelu_mul;
use crate::kernels::par::ColumnsOut;
use crate::kernels::w4::Zeros;

/// Tiles `tiles` of `y` for all activation rows (requires `p.simd_ok`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn w4a8_tiles(
    p: &PackedW4A8,
    acts: &Acts,
    tiles: Range<usize>,
    out: &ColumnsOut,
) {
    assert!(p.simd_ok && tiles.end <= p.tiles && p.k.is_multiple_of(p.bk));
    // SAFETY (all calls): as this function's contract.
    if acts.m == 1 {
        macro_rules! go {
            ($r:expr, $s:literal, $ts:expr) => {
                unsafe { w4a8_tile::<1, $s>(p, acts, $ts, 0, out) }
            };
        }
        walk_columns!(walk(), 1, tiles, go);
        return;
    }
    for t in tiles {
        let mask = column_mask(p, t);
        let put = |r0: usize, o: &[__m512]| {
            for (r, o) in o.iter().enumerate() {
                // SAFETY: tile t's columns belong to this job; the mask keeps to n.
                unsafe {
                    _mm512_mask_storeu_ps(out.ptr_at(r0 + r, t * TILE), mask, round_bf16_ps(*o))
                };
            }
        };
        // SAFETY: as this function's contract.
        unsafe { tile_rows(p, acts, t, put) };
    }
}

/// Tile `t` for all activation rows, four at a time: `put(r0, sums of rows r0…)` (f32, before
/// rounding).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_rows(p: &PackedW4A8, acts: &Acts, t: usize, mut put: impl FnMut(usize, &[__m512])) {
    let mut r0 = 0;
    while r0 < acts.m {
        let rows = (acts.m - r0).min(4);
        // SAFETY (all): as this function's contract.
        unsafe {
            match rows {
                1 => put(r0, &w4a8_tile_sums::<1, 1>(p, acts, [t], r0)[0]),
                2 => put(r0, &w4a8_tile_sums::<2, 1>(p, acts, [t], r0)[0]),
                3 => put(r0, &w4a8_tile_sums::<3, 1>(p, acts, [t], r0)[0]),
                _ => put(r0, &w4a8_tile_sums::<4, 1>(p, acts, [t], r0)[0]),
            }
        }
        r0 += rows;
    }
}

/// Tiles `ts` (one per stream), activation rows `r0..r0 + R`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn w4a8_tile<const R: usize, const S: usize>(
    p: &PackedW4A8,
    acts: &Acts,
    ts: [usize; S],
    r0: usize,
    out: &ColumnsOut,
) {
    // SAFETY: as this function's contract.
    let o = unsafe { w4a8_tile_sums::<R, S>(p, acts, ts, r0) };
    for s in 0..S {
        let t = ts[s];
        let mask = column_mask(p, t);
        for (r, o) in o[s].iter().enumerate() {
            // SAFETY: tile t's columns belong to this job; the mask keeps to n.
            unsafe { _mm512_mask_storeu_ps(out.ptr_at(r0 + r, t * TILE), mask, round_bf16_ps(*o)) };
        }
    }
}

/// `GELU(x·gateᵀ) ⊙ (x·upᵀ)` for tiles `tiles` of both (one shape, one block layout) and all
/// activation rows: each output rounded to bf16 as [`w4a8_tiles`] stores it, then the same
/// [`gelu_mul`] a separate pass would run, one 16-column strip at a time; `acts` quantized once
/// for both. Each weight tile stays alone in L1 while it meets every row (as in
/// [`w4a8_tiles`]); only the two strips (`m` × 16 each) wait in L2 for the product.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn w4a8_gelu_tiles(
    gate: &PackedW4A8,
    up: &PackedW4A8,
    acts: &Acts,
    tiles: Range<usize>,
    out: &ColumnsOut,
) {
    assert!(gate.simd_ok && up.simd_ok && tiles.end <= gate.tiles);
    assert_eq!((gate.n, gate.k, gate.g, gate.bk), (up.n, up.k, up.g, up.bk));
    let m = acts.m;
    let (mut g, mut u) = (vec![0f32; m * TILE], vec![0f32; m * TILE]);
    for t in tiles {
        // SAFETY (both): as this function's contract.
        unsafe {
            tile_strip(gate, acts, t, &mut g);
            tile_strip(up, acts, t, &mut u);
        }
        gelu_mul(&mut g, &u);
        let mask = column_mask(gate, t);
        for (r, row) in g.chunks_exact(TILE).enumerate() {
            // SAFETY: tile t's columns belong to this job; the mask keeps to n.
            unsafe {
                _mm512_mask_storeu_ps(out.ptr_at(r, t * TILE), mask, _mm512_loadu_ps(row.as_ptr()))
            };
        }
    }
}

/// Tile `t` of `x·pᵀ` for all activation rows, rounded to bf16, into `strip` (`[m][16]`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_strip(p: &PackedW4A8, acts: &Acts, t: usize, strip: &mut [f32]) {
    assert_eq!(strip.len(), acts.m * TILE);
    let put = |r0: usize, o: &[__m512]| {
        for (r, o) in o.iter().enumerate() {
            let at = (r0 + r) * TILE;
            // SAFETY: row r0 + r < m: 16 values inside the strip.
            unsafe { _mm512_storeu_ps(strip[at..at + TILE].as_mut_ptr(), round_bf16_ps(*o)) };
        }
    };
    // SAFETY: as this function's contract.
    unsafe { tile_rows(p, acts, t, put) };
}

/// Tiles `ts` (one per stream), activation rows `r0..r0 + R`: the f32 sums before rounding.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn w4a8_tile_sums<const R: usize, const S: usize>(
    p: &PackedW4A8,
    acts: &Acts,
    ts: [usize; S],
    r0: usize,
) -> [[__m512; R]; S] {
    let pf = walk().prefetch();
    let low4 = _mm512_set1_epi8(0x0F);
    let per_block = p.bk / 8;
    let wt = ts.map(|t| unsafe { p.nib.as_ptr().add(t * p.octets * 64) });
    let a = unsafe { acts.a.as_ptr().add(r0 * acts.stride) };
    let mut o = [[_mm512_setzero_ps(); R]; S];
    for b in 0..p.k / p.bk {
        // Two accumulators per row and stream (low / high nibbles), and two
        // octets per step when the block allows: independent vpdpbusd chains.
        let mut acc = [[[_mm512_setzero_si512(); 4]; R]; S];
        let step = |acc: &mut [[[__m512i; 4]; R]; S], oc: usize, half: usize| {
            let mut lo = [_mm512_setzero_si512(); S];
            let mut hi = lo;
            for s in 0..S {
                if pf {
                    prefetch(wt[s].wrapping_add(oc * 64 + PREFETCH_BYTES));
                }
                // SAFETY: oc < octets of the tile.
                let v = unsafe { _mm512_loadu_si512(wt[s].add(oc * 64) as *const __m512i) };
                lo[s] = _mm512_and_si512(v, low4);
                hi[s] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
            }
            for r in 0..R {
                // SAFETY: the activation row holds octets·8 bytes.
                let ap = unsafe { a.add(r * acts.stride + oc * 8) } as *const i32;
                let (a_lo, a_hi) = unsafe { (ap.read_unaligned(), ap.add(1).read_unaligned()) };
                let (a_lo, a_hi) = (_mm512_set1_epi32(a_lo), _mm512_set1_epi32(a_hi));
                for s in 0..S {
                    let c = &mut acc[s][r];
                    c[2 * half] = _mm512_dpbusd_epi32(c[2 * half], lo[s], a_lo);
                    c[2 * half + 1] = _mm512_dpbusd_epi32(c[2 * half + 1], hi[s], a_hi);
                }
            }
        };
        let (o0, o1) = (b * per_block, (b + 1) * per_block);
        let mut oc = o0;
        while oc + 1 < o1 {
            step(&mut acc, oc, 0);
            step(&mut acc, oc + 1, 1);
            oc += 2;
        }
        if oc < o1 {
            step(&mut acc, oc, 0);
        }
        for s in 0..S {
            let slot = (ts[s] * p.groups + b * p.bk / p.g) * TILE;
            // SAFETY: slot is a tile's group: 16 scales.
            let scale = unsafe { block_scales(p, slot) };
            for r in 0..R {
                let sum = acts.sums[(r0 + r) * acts.nsegs + b];
                // Zero-point correction z·Σa: exact in i32 (|z·Σa| ≤ 16·127·128).
                let corr = match &p.zeros {
                    Zeros::Uniform(z) => _mm512_set1_epi32(z * sum),
                    Zeros::PerGroup(zs) => {
                        let z = unsafe {
                            _mm512_cvtepi8_epi32(_mm_loadu_si128(
                                zs.as_ptr().add(slot) as *const __m128i
                            ))
                        };
                        _mm512_mullo_epi32(z, _mm512_set1_epi32(sum))
                    }
                };
                let [a0, a1, a2, a3] = acc[s][r];
                let total = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
                let acc_i = _mm512_sub_epi32(total, corr);
                o[s][r] = block_step(acc_i, acts.sa[r0 + r], scale, o[s][r]);
            }
        }
    }
    o
}

/// [`quantize_activation_row`](crate::kernels::w4::quantize_activation_row) into int8 codes
/// `a`, with Σ a over each of `segs` into `sums`; returns the row's scale. The same IEEE
/// steps (max |x|, the two divisions, x·(127 / amax) rounded to nearest even by
/// `vcvtps2dq` under the default rounding mode), so the same codes. With `ROUND` each value
/// is first rounded to bf16 as it is read (the same bits as rounding `x` beforehand).
///
/// # Safety
/// AVX-512 F/BW/VL on this CPU; `x.len()` = `a.len()`, every segment inside it and a
/// multiple of 16 at both ends.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_row<const ROUND: bool>(
    x: &[f32],
    a: &mut [i8],
    segs: impl Iterator<Item = Range<usize>>,
    sums: &mut [i32],
) -> f32 {
    assert!(x.len() == a.len() && x.len().is_multiple_of(16));
    let mut m = _mm512_setzero_ps();
    for i in (0..x.len()).step_by(16) {
        // SAFETY: i + 16 ≤ x.len().
        m = _mm512_max_ps(m, _mm512_abs_ps(unsafe { load::<ROUND>(x, i) }));
    }
    let amax = _mm512_reduce_max_ps(m).max(1e-7);
    let sa = amax / 127.0;
    let inv = _mm512_set1_ps(127.0 / amax);
    for (seg, sum) in segs.zip(sums.iter_mut()) {
        assert!(seg.end <= x.len() && seg.start.is_multiple_of(16) && seg.end.is_multiple_of(16));
        let mut acc = _mm512_setzero_si512();
        for i in seg.step_by(16) {
            // SAFETY: i + 16 ≤ len, by the asserts.
            let q = _mm512_cvtps_epi32(_mm512_mul_ps(unsafe { load::<ROUND>(x, i) }, inv));
            // SAFETY: as above; `a` is as long as `x`.
            unsafe {
                _mm_storeu_si128(
                    a.as_mut_ptr().add(i) as *mut __m128i,
                    _mm512_cvtepi32_epi8(q),
                )
            };
            acc = _mm512_add_epi32(acc, q);
        }
        *sum = _mm512_reduce_add_epi32(acc);
    }
    sa
}

/// [`quantize_row`], rounding `x` to bf16 as it is read when `round` (one dispatch per row).
///
/// # Safety
/// As [`quantize_row`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_row_rounding(
    round: bool,
    x: &[f32],
    a: &mut [i8],
    segs: impl Iterator<Item = Range<usize>>,
    sums: &mut [i32],
) -> f32 {
    // SAFETY: the caller's promise.
    unsafe {
        if round {
            quantize_row::<true>(x, a, segs, sums)
        } else {
            quantize_row::<false>(x, a, segs, sums)
        }
    }
}

/// `x[i..i + 16]`, rounded to bf16 with `ROUND`.
///
/// # Safety
/// AVX-512 F on this CPU; i + 16 ≤ x.len().
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load<const ROUND: bool>(x: &[f32], i: usize) -> __m512 {
    debug_assert!(i + 16 <= x.len());
    // SAFETY: the caller's promise.
    let v = unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) };
    if ROUND {
        round_bf16_ps(v)
    } else {
        v
    }
}

/// The f32 scales of the 16 columns at `slot` (`[tiles][groups][16]`), widened from bf16.
///
/// # Safety
/// AVX-512 F on this CPU; `slot + 16` ≤ `p.scales.len()`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn block_scales(p: &PackedW4A8, slot: usize) -> __m512 {
    assert!(slot + TILE <= p.scales.len());
    // SAFETY: 16 u16 in bounds by the assert.
    let bits = unsafe { _mm256_loadu_si256(p.scales.as_ptr().add(slot) as *const __m256i) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
}

/// The recipe's f32 steps for one block, per column lane: `fma(f32(acc)·sa, s, out)` (every
/// tier's kernel calls this, which is what keeps their bits equal).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn block_step(acc: __m512i, sa: f32, scale: __m512, out: __m512) -> __m512 {
    let t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(sa));
    _mm512_fmadd_ps(t, scale, out)
}

/// The lanes of column tile `t` that are columns of the weight (the last tile may be partial).
pub(super) fn column_mask(p: &PackedW4A8, t: usize) -> __mmask16 {
    let valid = (p.n - t * TILE).min(TILE);
    if valid == TILE {
        !0
    } else {
        (1u16 << valid) - 1
    }
}
