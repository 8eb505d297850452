//! AVX-512 (F/BW/VL + VNNI) versions of the dense bf16 kernels: the row-dot
//! decode kernel, and the AVX512-BF16 panel GEMM behind
//! [`bf16_act_panel_matmul`](super::bf16_act_panel_matmul). The layout and
//! numerics are described, and the portable versions written, in the parent
//! module; tests there compare every tier.
//!
//! Every function here is `unsafe`: the caller has checked
//! [`Isa::avx512`](crate::kernels::isa::Isa::avx512) on this CPU, and owns the output
//! columns it passes (disjoint between parallel jobs).

use std::arch::x86_64::*;
use std::ops::Range;

use super::widen;
use crate::kernels::avx512_util::{pad, prefetch, walk, walk_columns, Walk, PREFETCH_BYTES};
use crate::kernels::par::ColumnsOut;

// ---------------------------------------------------------------- dense bf16

/// The activations of [`bf16_gemv`], `[m, k]`.
pub(super) enum Acts<'a> {
    /// f32, deinterleaved by [`super::deinterleave`]: the FMA kernel; its walk is
    /// [`f32_walk`] (two streams share each activation load, which matters once a
    /// row of activations no longer fits in L1).
    F32(&'a [f32]),
    /// bf16 bits, for a CPU with AVX512-BF16 only: `vdpbf16ps` on the weights
    /// as stored (exact products, f32 sums, as in the FMA kernel), no
    /// widening and half the activation bytes per weight; the walk in use.
    /// The FMA kernel is compute-bound on Zen 4, this one reads at the
    /// streaming rate there (docs/BENCHMARKS.md, "The decode walk").
    Bf16(&'a [u16]),
}

/// Columns `cols`, rows `rows` (at most 4) of `x · wᵀ`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn bf16_gemv(
    w: &[u16],
    k: usize,
    x: Acts,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &ColumnsOut,
) {
    let len = match x {
        Acts::F32(x) => x.len(),
        Acts::Bf16(x) => x.len(),
    };
    assert!(cols.end * k <= w.len() && rows.end * k <= len && rows.len() <= 4);
    let at = rows.start * k;
    macro_rules! go {
        ($r:expr, $s:literal, $cs:expr) => {{
            let cs: [usize; $s] = $cs;
            let ws = cs.map(|c| unsafe { w.as_ptr().add(c * k) });
            // SAFETY: every column c < n has k weights; rows of x hold k values;
            // bf16 activations come only on an AVX512-BF16 CPU.
            let v: [[f32; 4]; $s] = unsafe {
                match (&x, $r) {
                    (Acts::F32(x), 1) => pad(bf16_dot::<1, $s>(ws, k, x.as_ptr().add(at))),
                    (Acts::F32(x), 2) => pad(bf16_dot::<2, $s>(ws, k, x.as_ptr().add(at))),
                    (Acts::F32(x), 3) => pad(bf16_dot::<3, $s>(ws, k, x.as_ptr().add(at))),
                    (Acts::F32(x), _) => pad(bf16_dot::<4, $s>(ws, k, x.as_ptr().add(at))),
                    (Acts::Bf16(x), 1) => pad(bf16_dot_bf16::<1, $s>(ws, k, x.as_ptr().add(at))),
                    (Acts::Bf16(x), 2) => pad(bf16_dot_bf16::<2, $s>(ws, k, x.as_ptr().add(at))),
                    (Acts::Bf16(x), 3) => pad(bf16_dot_bf16::<3, $s>(ws, k, x.as_ptr().add(at))),
                    (Acts::Bf16(x), _) => pad(bf16_dot_bf16::<4, $s>(ws, k, x.as_ptr().add(at))),
                }
            };
            for (c, v) in cs.iter().zip(v) {
                for (r, v) in rows.clone().zip(v) {
                    unsafe { out.row_mut(r, *c..*c + 1)[0] = v };
                }
            }
        }};
    }
    let walk = match x {
        Acts::F32(_) => f32_walk(k),
        Acts::Bf16(_) => walk(),
    };
    walk_columns!(walk, rows.len(), cols, go);
}

/// Weight rows `w[s][..k]` against `R` rows of bf16 `x` (stride k): 64
/// weights per stream and step, in two accumulators per row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")]
unsafe fn bf16_dot_bf16<const R: usize, const S: usize>(
    w: [*const u16; S],
    k: usize,
    x: *const u16,
) -> [[f32; R]; S] {
    let pf = walk().prefetch();
    let mut acc = [[[_mm512_setzero_ps(); 2]; R]; S];
    let chunks = k / 64;
    // SAFETY (loads): ch < k / 64, so 64ch + 63 < k for weights and x rows.
    let bh = |v: __m512i| unsafe { std::mem::transmute::<__m512i, __m512bh>(v) };
    for ch in 0..chunks {
        let mut wv = [[_mm512_setzero_si512(); 2]; S];
        for s in 0..S {
            for h in 0..2 {
                // Both lines of the chunk: with one, the second relied on the hardware
                // prefetcher and the head read 13–16 % slower than the FMA kernel's (Xeon).
                if pf {
                    prefetch(w[s].wrapping_add(64 * ch + 32 * h + PREFETCH_BYTES / 2));
                }
                wv[s][h] =
                    unsafe { _mm512_loadu_si512(w[s].add(64 * ch + 32 * h) as *const __m512i) };
            }
        }
        for r in 0..R {
            for h in 0..2 {
                let xv = unsafe {
                    _mm512_loadu_si512(x.add(r * k + 64 * ch + 32 * h) as *const __m512i)
                };
                for s in 0..S {
                    acc[s][r][h] = _mm512_dpbf16_ps(acc[s][r][h], bh(wv[s][h]), bh(xv));
                }
            }
        }
    }
    let mut res = [[0f32; R]; S];
    for s in 0..S {
        for r in 0..R {
            let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[s][r][0], acc[s][r][1]));
            for kk in chunks * 64..k {
                sum += unsafe { widen(*w[s].add(kk)) * widen(*x.add(r * k + kk)) };
            }
            res[s][r] = sum;
        }
    }
    res
}

/// The FMA kernel's walk: the CPU's ([`walk`]) while a row of f32 activations (4k bytes) fits
/// in L1 with room for the weights streaming past, else two streams + prefetch, which share
/// each activation load. Measured on Zen 4 (docs/BENCHMARKS.md, "W4A16 decode tables"): one
/// stream read the head (k = 2048) at 80–87 % of the stream where two read 44–66 %, but
/// `down_proj` (k = 6656, 26 KB of activations) at 44 % where two read 58–70 %.
fn f32_walk(k: usize) -> Walk {
    const ONE_STREAM_MAX_K: usize = 4096;
    if k <= ONE_STREAM_MAX_K {
        walk()
    } else {
        Walk::TwoStreamsPrefetch
    }
}

/// Weight rows `w[s][..k]` against `R` rows of `x` (stride k).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn bf16_dot<const R: usize, const S: usize>(
    w: [*const u16; S],
    k: usize,
    x: *const f32,
) -> [[f32; R]; S] {
    let hi = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let mut ae = [[_mm512_setzero_ps(); R]; S];
    let mut ao = ae;
    let chunks = k / 32;
    let pf = f32_walk(k).prefetch();
    for ch in 0..chunks {
        let mut we = [_mm512_setzero_ps(); S];
        let mut wo = we;
        for s in 0..S {
            if pf {
                prefetch(w[s].wrapping_add(32 * ch + PREFETCH_BYTES / 2));
            }
            // SAFETY: ch < k / 32.
            let v = unsafe { _mm512_loadu_si512(w[s].add(32 * ch) as *const __m512i) };
            // 32-bit lane i = (w[2i] low half, w[2i+1] high half).
            we[s] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
            wo[s] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        }
        for r in 0..R {
            // SAFETY: rows of x hold k values.
            let xe = unsafe { _mm512_loadu_ps(x.add(r * k + 32 * ch)) };
            let xo = unsafe { _mm512_loadu_ps(x.add(r * k + 32 * ch + 16)) };
            for s in 0..S {
                ae[s][r] = _mm512_fmadd_ps(we[s], xe, ae[s][r]);
                ao[s][r] = _mm512_fmadd_ps(wo[s], xo, ao[s][r]);
            }
        }
    }
    let mut res = [[0f32; R]; S];
    for s in 0..S {
        for r in 0..R {
            let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(ae[s][r], ao[s][r]));
            for kk in chunks * 32..k {
                sum += unsafe { widen(*w[s].add(kk)) * *x.add(r * k + kk) };
            }
            res[s][r] = sum;
        }
    }
    res
}

// ---------------------------------------------------------------- bf16 GEMM

/// Columns per packed slice of [`bf16_gemm_slice`]: two 16-lane tiles.
pub(super) const GEMM_SLICE: usize = 32;

/// Pack `w` (`[cols ≤ 32, k]` bf16 bits; k even) into the slice layout: tile s (columns 16s…),
/// input pair p, lane j → `out[(s·k/2 + p)·32 + 2j + {0,1}]` = `w[16s + j][2p + {0,1}]`; missing
/// columns are zero. A tile is the transposition of its 16 rows of input pairs (u32), done 16 × 16
/// in registers (the value-by-value loop this replaces was 38 % of a short W4A16 prefill).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_bf16_slice(w: &[u16], cols: usize, k: usize, out: &mut [u16]) {
    assert!(k.is_multiple_of(2) && out.len() == GEMM_SLICE * k && w.len() == cols * k);
    assert!(cols <= GEMM_SLICE);
    let half = k / 2;
    let idx = transpose_indices();
    for s in 0..GEMM_SLICE / 16 {
        let valid = cols.saturating_sub(16 * s).min(16);
        let tile = &mut out[s * half * 32..(s + 1) * half * 32];
        if valid == 0 {
            tile.fill(0);
            continue;
        }
        let rows = &w[16 * s * k..(16 * s + valid) * k];
        let mut p0 = 0;
        while p0 + 16 <= half {
            let mut x = [_mm512_setzero_si512(); 16];
            for (j, x) in x.iter_mut().enumerate().take(valid) {
                // SAFETY: pairs p0..p0 + 16 of row j lie inside `rows`.
                *x = unsafe { _mm512_loadu_si512(rows.as_ptr().add(j * k + 2 * p0) as *const _) };
            }
            transpose16(&mut x, &idx);
            for (p, x) in x.iter().enumerate() {
                // SAFETY: pair p0 + p of this tile: 32 values inside `tile`.
                unsafe { _mm512_storeu_si512(tile.as_mut_ptr().add((p0 + p) * 32) as *mut _, *x) };
            }
            p0 += 16;
        }
        for p in p0..half {
            for j in 0..16 {
                let o = p * 32 + 2 * j;
                let (a, b) = if j < valid {
                    (rows[j * k + 2 * p], rows[j * k + 2 * p + 1])
                } else {
                    (0, 0)
                };
                tile[o] = a;
                tile[o + 1] = b;
            }
        }
    }
}

/// Pairs of consecutive rows as the tiles read them: per lane, the bf16 bits of `lo` in the low
/// half and those of `hi` in the high half (both bf16 values: their low 16 bits are dropped).
#[inline(always)]
fn pair_rows(lo: __m512i, hi: __m512i) -> __m512i {
    // SAFETY: AVX-512F is enabled in every caller.
    unsafe {
        _mm512_or_si512(
            _mm512_and_si512(hi, _mm512_set1_epi32(0xFFFF_0000u32 as i32)),
            _mm512_srli_epi32::<16>(lo),
        )
    }
}

/// Up to 16 values of row `r` of `x` (`[t, k]`), columns `c…` by `mask`; zero for `r ≥ t`.
///
/// # Safety
/// AVX-512F; columns `c…` under `mask` lie inside row `r`.
#[inline(always)]
unsafe fn row_lanes(x: &[f32], t: usize, k: usize, r: usize, c: usize, mask: __mmask16) -> __m512i {
    if r < t {
        // SAFETY: the caller's promise; masked lanes are not read.
        unsafe { _mm512_maskz_loadu_epi32(mask, x.as_ptr().add(r * k + c) as *const i32) }
    } else {
        _mm512_setzero_si512()
    }
}

/// The AMX tiles of columns `i0…i0 + 16` of `a` (`[t, k]`, bf16 values) transposed — a Gram's
/// left operand: `block[(st·16 + i)·32 + tt] = a[32·st + tt][i0 + i]` (tokens ≥ t and columns ≥ k
/// zero) for every 32-token step of `block`. Returns the OR of the low 16 bits of every value read
/// (non-zero: a value is not a bf16 value).
///
/// # Safety
/// AVX-512F; `block` holds whole 512-value steps.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_columns(
    a: &[f32],
    t: usize,
    k: usize,
    i0: usize,
    block: &mut [u16],
) -> u32 {
    assert!(a.len() == t * k && block.len().is_multiple_of(512));
    let lanes = k.saturating_sub(i0).min(16);
    if lanes == 0 {
        return 0;
    }
    let mask = ((1u32 << lanes) - 1) as __mmask16;
    let idx = transpose_indices();
    let mut stray = _mm512_setzero_si512();
    for (st, tile) in block.chunks_exact_mut(512).enumerate() {
        let mut x = [_mm512_setzero_si512(); 16];
        for (q, x) in x.iter_mut().enumerate() {
            let r = 32 * st + 2 * q;
            // SAFETY: columns i0… (lanes of them) lie inside each row.
            let (lo, hi) = unsafe {
                (
                    row_lanes(a, t, k, r, i0, mask),
                    row_lanes(a, t, k, r + 1, i0, mask),
                )
            };
            stray = _mm512_or_si512(stray, _mm512_or_si512(lo, hi));
            *x = pair_rows(lo, hi);
        }
        transpose16(&mut x, &idx);
        for (i, x) in x.iter().enumerate() {
            // SAFETY: row i of this tile: 32 values inside `tile`.
            unsafe { _mm512_storeu_si512(tile.as_mut_ptr().add(32 * i) as *mut _, *x) };
        }
    }
    _mm512_reduce_or_epi32(_mm512_and_si512(stray, _mm512_set1_epi32(0xFFFF))) as u32
}

/// [`pack_bf16_slice`]'s layout for `t2` inputs (tokens) made from columns `c0…c0 + cols` of the
/// row-major `b` (`[t, k]`, bf16 values; tokens ≥ t zero) — a Gram's right operand, with no
/// transposition: each 64-byte row of the slice is two token rows' 16 columns interleaved.
///
/// # Safety
/// AVX-512F; `t2 ≥ t` is even and `out` holds `GEMM_SLICE × t2` values.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_slice_of_rows(
    b: &[f32],
    t: usize,
    k: usize,
    (c0, cols): (usize, usize),
    t2: usize,
    out: &mut [u16],
) {
    assert!(b.len() == t * k && t2 >= t && t2.is_multiple_of(2));
    assert!(out.len() == GEMM_SLICE * t2 && cols <= GEMM_SLICE && c0 + cols <= k);
    let half = t2 / 2;
    for (s, tile) in out.chunks_exact_mut(half * 32).enumerate() {
        let valid = cols.saturating_sub(16 * s).min(16);
        if valid == 0 {
            tile.fill(0);
            continue;
        }
        let mask = ((1u32 << valid) - 1) as __mmask16;
        let c = c0 + 16 * s;
        for (p, row) in tile.chunks_exact_mut(32).enumerate() {
            // SAFETY: columns c… (valid of them) lie inside each row; the slice row is 64 bytes.
            unsafe {
                let (lo, hi) = (
                    row_lanes(b, t, k, 2 * p, c, mask),
                    row_lanes(b, t, k, 2 * p + 1, c, mask),
                );
                _mm512_storeu_si512(row.as_mut_ptr() as *mut _, pair_rows(lo, hi));
            }
        }
    }
}

/// For each bit b of a lane index, the `vpermt2d` indices that swap that bit between the register
/// number and the lane number of a pair of registers (i, i + 2^b): the low one keeps its lanes with
/// bit b clear and takes the high one's, and the high one the reverse. All four bits swapped make
/// the transposition.
#[inline(always)]
fn transpose_indices() -> [(__m512i, __m512i); 4] {
    let mut idx = [[[0i32; 16]; 2]; 4];
    for (b, idx) in idx.iter_mut().enumerate() {
        let step = 1 << b;
        for l in 0..16i32 {
            let (lo, hi) = if l & step == 0 {
                (l, l + step)
            } else {
                (16 + l - step, 16 + l)
            };
            idx[0][l as usize] = lo;
            idx[1][l as usize] = hi;
        }
    }
    // SAFETY: [i32; 16] and __m512i are both 512 bits.
    idx.map(|[lo, hi]| unsafe {
        (
            std::mem::transmute::<[i32; 16], __m512i>(lo),
            std::mem::transmute::<[i32; 16], __m512i>(hi),
        )
    })
}

/// `x[p]` lane j ← `x[j]` lane p.
#[inline(always)]
fn transpose16(x: &mut [__m512i; 16], idx: &[(__m512i, __m512i); 4]) {
    for (b, &(lo, hi)) in idx.iter().enumerate() {
        let step = 1 << b;
        for i in 0..16 {
            if i & step == 0 {
                let (a, c) = (x[i], x[i | step]);
                // SAFETY: AVX-512F is enabled in every caller.
                unsafe {
                    x[i] = _mm512_permutex2var_epi32(a, lo, c);
                    x[i | step] = _mm512_permutex2var_epi32(a, hi, c);
                }
            }
        }
    }
}

/// Bytes of activation rows a block of [`bf16_gemm_slices`] keeps in L2 while every slice of its
/// group passes over them (with one slice beside them: 1 MB of L2 per core on Zen 4).
const ROW_BLOCK_BYTES: usize = 384 << 10;

/// Packed slices per group of [`bf16_gemm_slices`] for a reduction of `k`: each row block is read
/// from memory once per group rather than once per slice, and the group stays in L3.
pub(super) fn slices_per_group(k: usize) -> usize {
    ((4 << 20) / (GEMM_SLICE * 2 * k.max(1))).clamp(1, 16)
}

/// The columns one job of the slice GEMMs writes: consecutive packed slices
/// ([`pack_bf16_slice`]), the first for columns `c0…`, `cols` columns in all, into `out`.
#[derive(Clone, Copy)]
pub(super) struct SliceCols<'a> {
    pub slices: &'a [u16],
    pub c0: usize,
    pub cols: usize,
    pub out: &'a ColumnsOut,
}

/// [`bf16_gemm_slice`] over the consecutive packed slices of `job`, blocks of rows outer: a block's activations stay in L2 while each
/// slice of the group passes over them, so the activations stream from memory once per group
/// (at 16K calibration rows they are 64–213 MB, far beyond the caches). Slice `i` covers rows
/// below `row_end(i)` only (the upper triangle of a Gram matrix). Each output is the same sum in
/// the same order as one [`bf16_gemm_slice`] over all rows.
///
/// # Safety
/// As [`bf16_gemm_slice`]: AVX512-BF16 on this CPU, and the job owns columns `c0..c0 + cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn bf16_gemm_slices(
    xb: &[u16],
    k: usize,
    job: SliceCols,
    rows: Range<usize>,
    row_end: &dyn Fn(usize) -> usize,
) {
    let SliceCols {
        slices,
        c0,
        cols,
        out,
    } = job;
    let per_slice = GEMM_SLICE * k;
    let block = (ROW_BLOCK_BYTES / (2 * k.max(1)))
        .next_multiple_of(8)
        .max(8);
    let mut r0 = rows.start;
    while r0 < rows.end {
        let r1 = (r0 + block).min(rows.end);
        for (i, slice) in slices.chunks_exact(per_slice).enumerate() {
            let first = i * GEMM_SLICE;
            let c = cols.saturating_sub(first).min(GEMM_SLICE);
            let end = r1.min(row_end(i));
            if c > 0 && r0 < end {
                // SAFETY: as the caller's.
                unsafe { bf16_gemm_slice(xb, k, slice, r0..end, c0 + first, c, out) };
            }
        }
        r0 = r1;
    }
}

/// `y[rows, c0..c0 + cols] = x[rows] · slice` for bf16 activations `xb`
/// (`[m, k]` bits) and a slice from [`pack_bf16_slice`]: eight rows at a
/// time, each weight vector reused by every row, `vdpbf16ps` (exact
/// products, f32 sums).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn bf16_gemm_slice(
    xb: &[u16],
    k: usize,
    slice: &[u16],
    rows: Range<usize>,
    c0: usize,
    cols: usize,
    out: &ColumnsOut,
) {
    assert!(k.is_multiple_of(2) && slice.len() == GEMM_SLICE * k && rows.end * k <= xb.len());
    assert!(cols <= GEMM_SLICE);
    let mut r = rows.start;
    while r < rows.end {
        let left = rows.end - r;
        // SAFETY (all): bounds asserted above; the caller owns these columns.
        unsafe {
            match left {
                8.. => bf16_gemm_rows::<8>(xb, k, slice, r, c0, cols, out),
                4..=7 => bf16_gemm_rows::<4>(xb, k, slice, r, c0, cols, out),
                2..=3 => bf16_gemm_rows::<2>(xb, k, slice, r, c0, cols, out),
                _ => bf16_gemm_rows::<1>(xb, k, slice, r, c0, cols, out),
            }
        }
        r += match left {
            8.. => 8,
            4..=7 => 4,
            2..=3 => 2,
            _ => 1,
        };
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn bf16_gemm_rows<const R: usize>(
    xb: &[u16],
    k: usize,
    slice: &[u16],
    r0: usize,
    c0: usize,
    cols: usize,
    out: &ColumnsOut,
) {
    let half = k / 2;
    let w = slice.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); R]; 2];
    for p in 0..half {
        // SAFETY: p < k/2 pairs of each tile.
        let (w0, w1) = unsafe {
            (
                _mm512_loadu_si512(w.add(p * 32) as *const __m512i),
                _mm512_loadu_si512(w.add((half + p) * 32) as *const __m512i),
            )
        };
        prefetch(w.wrapping_add(p * 32 + 256));
        prefetch(w.wrapping_add((half + p) * 32 + 256));
        for r in 0..R {
            // SAFETY: row r0 + r < m, pair p < k/2.
            let pair =
                unsafe { (xb.as_ptr().add((r0 + r) * k + 2 * p) as *const i32).read_unaligned() };
            let a = _mm512_set1_epi32(pair);
            // SAFETY: __m512i and __m512bh are both 32 × 16 bits.
            let (a, w0, w1) = unsafe {
                (
                    std::mem::transmute::<__m512i, __m512bh>(a),
                    std::mem::transmute::<__m512i, __m512bh>(w0),
                    std::mem::transmute::<__m512i, __m512bh>(w1),
                )
            };
            acc[0][r] = _mm512_dpbf16_ps(acc[0][r], w0, a);
            acc[1][r] = _mm512_dpbf16_ps(acc[1][r], w1, a);
        }
    }
    for s in 0..2 {
        let valid = cols.saturating_sub(16 * s).min(16);
        if valid == 0 {
            continue;
        }
        let mask: __mmask16 = if valid == 16 { !0 } else { (1u16 << valid) - 1 };
        for r in 0..R {
            // SAFETY: columns c0 + 16s.. (valid of them) of row r0 + r belong to this job.
            unsafe { _mm512_mask_storeu_ps(out.ptr_at(r0 + r, c0 + 16 * s), mask, acc[s][r]) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout of [`pack_bf16_slice`], value by value.
    fn pack_reference(w: &[u16], cols: usize, k: usize) -> Vec<u16> {
        let mut out = vec![0u16; GEMM_SLICE * k];
        for c in 0..cols {
            let (s, j) = (c / 16, c % 16);
            for p in 0..k / 2 {
                let o = (s * (k / 2) + p) * 32 + 2 * j;
                out[o] = w[c * k + 2 * p];
                out[o + 1] = w[c * k + 2 * p + 1];
            }
        }
        out
    }

    #[test]
    fn the_transposed_pack_is_the_layout_value_by_value() {
        if !crate::kernels::isa::Isa::tested().contains(&crate::kernels::isa::Isa::Avx512Vnni) {
            return;
        }
        for (cols, k) in [
            (32, 64),
            (17, 10),
            (16, 2),
            (1, 130),
            (31, 6656),
            (0, 4),
            (20, 34),
            (32, 2048),
        ] {
            let w: Vec<u16> = (0..cols * k)
                .map(|i| ((i * 2654435761usize) >> 7) as u16)
                .collect();
            let mut got = vec![0xAAAA; GEMM_SLICE * k];
            // SAFETY: AVX-512 was checked above.
            unsafe { pack_bf16_slice(&w, cols, k, &mut got) };
            assert_eq!(got, pack_reference(&w, cols, k), "cols {cols} k {k}");
        }
    }
}
