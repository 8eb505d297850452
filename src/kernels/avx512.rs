//! AVX-512 (F/BW/VL + VNNI) versions of the packed kernels. Layouts and
//! numerics are described, and the portable versions written, next to each
//! format (`bf16.rs`, `w4a8.rs`, `w4a16.rs`); tests there compare every tier.
//!
//! Every function here is `unsafe`: the caller has checked
//! [`Isa::avx512`](super::isa::Isa::avx512) on this CPU, and owns the output
//! columns it passes (disjoint between parallel jobs).
//!
//! Decode is bandwidth-bound. Measured on the project machine (one thread,
//! 131072 × 2048 bf16): a kernel that reads its columns as one sequential
//! stream reaches ~65 % of a plain streaming read; splitting each job's
//! columns into two halves read in lockstep (two far-apart streams for the
//! hardware prefetchers) plus a software prefetch 2–4 KiB ahead reaches
//! ~100 %. So the decode paths read two streams: bf16 and W4A16 for up to
//! 4 rows, W4A8 for one row.
//!
//! The AVX-512 intrinsics are stable since Rust 1.89, above the crate's
//! declared rust-version (1.85): building this module needs 1.89.

use std::arch::x86_64::*;
use std::ops::Range;

use super::bf16::widen;
use super::par::ColumnsOut;
use super::w4::Zeros;
use super::w4a16::PackedW4A16;
use super::w4a8::{Acts, PackedW4A8, TILE};

/// Per-lane `half::bf16::from_f32(v).to_f32()`: round to nearest even on
/// the bit pattern, NaN made quiet (not `vcvtneps2bf16`, which flushes
/// denormals).
#[inline]
#[target_feature(enable = "avx512f")]
fn round_bf16_ps(v: __m512) -> __m512 {
    let bits = _mm512_castps_si512(v);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let sum = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
    let top = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let rounded = _mm512_and_si512(sum, top);
    let quiet = _mm512_and_si512(_mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000)), top);
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, quiet))
}

/// Software prefetch of the line at `p` into L1 (a hint: never faults,
/// whatever the address, hence `wrapping_add` at the call sites).
#[inline]
#[target_feature(enable = "avx512f")]
fn prefetch<T>(p: *const T) {
    _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
}

/// How far ahead of each stream's current load the kernels prefetch.
const PREFETCH_BYTES: usize = 2048;
/// W4A16 does more work per byte, so it asks earlier (measured: 4–8 KiB
/// beat 0.5–2 KiB on the 2048-input shapes).
const PREFETCH_BYTES_W4A16: usize = 4096;

/// Run `f!(rows, S, [column; S])` over a job's column (or tile) range: the
/// range halved into two lockstep streams (`S = 2`), then the odd column
/// alone (`S = 1`).
macro_rules! two_streams {
    ($rows:expr, $cols:expr, $f:ident) => {{
        let cols = $cols;
        let half = cols.len() / 2;
        for i in 0..half {
            $f!($rows, 2, [cols.start + i, cols.start + half + i]);
        }
        if cols.len() % 2 == 1 {
            $f!($rows, 1, [cols.end - 1]);
        }
    }};
}

// ---------------------------------------------------------------- dense bf16

/// Columns `cols`, rows `rows` (at most 4) of `x · wᵀ`; `xp` is `x`
/// deinterleaved by [`super::bf16::deinterleave`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn bf16_gemv(
    w: &[u16],
    k: usize,
    xp: &[f32],
    rows: Range<usize>,
    cols: Range<usize>,
    out: &ColumnsOut,
) {
    assert!(cols.end * k <= w.len() && rows.end * k <= xp.len() && rows.len() <= 4);
    let x = unsafe { xp.as_ptr().add(rows.start * k) };
    macro_rules! go {
        ($r:expr, $s:literal, $cs:expr) => {{
            let cs: [usize; $s] = $cs;
            let ws = cs.map(|c| unsafe { w.as_ptr().add(c * k) });
            // SAFETY: every column c < n has k weights; rows of x hold k values.
            let v: [[f32; 4]; $s] = unsafe {
                match $r {
                    1 => pad(bf16_dot::<1, $s>(ws, k, x)),
                    2 => pad(bf16_dot::<2, $s>(ws, k, x)),
                    3 => pad(bf16_dot::<3, $s>(ws, k, x)),
                    _ => pad(bf16_dot::<4, $s>(ws, k, x)),
                }
            };
            for (c, v) in cs.iter().zip(v) {
                for (r, v) in rows.clone().zip(v) {
                    unsafe { out.row_mut(r, *c..*c + 1)[0] = v };
                }
            }
        }};
    }
    two_streams!(rows.len(), cols, go);
}

/// Results of `R` rows widened to 4 (the callers' common type).
#[inline]
fn pad<const R: usize, const S: usize>(v: [[f32; R]; S]) -> [[f32; 4]; S] {
    v.map(|r| std::array::from_fn(|i| if i < R { r[i] } else { 0.0 }))
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
    for ch in 0..chunks {
        let mut we = [_mm512_setzero_ps(); S];
        let mut wo = we;
        for s in 0..S {
            prefetch(w[s].wrapping_add(32 * ch + PREFETCH_BYTES / 2));
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

// ---------------------------------------------------------------- W4A8

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
        two_streams!(1, tiles, go);
        return;
    }
    for t in tiles {
        let mut r0 = 0;
        while r0 < acts.m {
            let rows = (acts.m - r0).min(4);
            unsafe {
                match rows {
                    1 => w4a8_tile::<1, 1>(p, acts, [t], r0, out),
                    2 => w4a8_tile::<2, 1>(p, acts, [t], r0, out),
                    3 => w4a8_tile::<3, 1>(p, acts, [t], r0, out),
                    _ => w4a8_tile::<4, 1>(p, acts, [t], r0, out),
                }
            }
            r0 += rows;
        }
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
                prefetch(wt[s].wrapping_add(oc * 64 + PREFETCH_BYTES));
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
            let scale = unsafe {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(p.scales.as_ptr().add(slot) as *const __m256i),
                )))
            };
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
                let tv = _mm512_mul_ps(_mm512_cvtepi32_ps(acc_i), _mm512_set1_ps(acts.sa[r0 + r]));
                o[s][r] = _mm512_fmadd_ps(tv, scale, o[s][r]);
            }
        }
    }
    for s in 0..S {
        let t = ts[s];
        let valid = (p.n - t * TILE).min(TILE);
        let mask: __mmask16 = if valid == TILE {
            !0
        } else {
            (1u16 << valid) - 1
        };
        for (r, o) in o[s].iter().enumerate() {
            // SAFETY: tile t's columns belong to this job; the mask keeps to n.
            unsafe { _mm512_mask_storeu_ps(out.ptr_at(r0 + r, t * TILE), mask, round_bf16_ps(*o)) };
        }
    }
}

// ---------------------------------------------------------------- W4A16

/// `bf16((q − z)·s)` for q = 0…15 in group `gi` of column `col`, as f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn w4a16_lut(p: &PackedW4A16, col: usize, gi: usize) -> __m512 {
    let sl = col * p.groups + gi;
    let c = lut_codes(p.zeros.get(sl));
    round_bf16_ps(_mm512_mul_ps(c, _mm512_set1_ps(widen(p.scales[sl]))))
}

/// `q − z` for q = 0…15, as f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn lut_codes(z: i32) -> __m512 {
    let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _mm512_cvtepi32_ps(_mm512_sub_epi32(iota, _mm512_set1_epi32(z)))
}

/// The table of [`w4a16_lut`] as 16 bf16 values stored twice (32 u16 lanes
/// for `vpermw`), in four instructions; `cz` = [`lut_codes`] of a
/// uniform zero point. `vcvtneps2bf16` rounds to nearest even like
/// [`round_bf16_ps`] except that it flushes f32 denormals, and none occur
/// here: the product of a bf16 scale and a code below 16 is exact, and a
/// nonzero one is at least 2^-24 (the smallest fp16 scale).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn lut_bf16_ne(p: &PackedW4A16, cz: Option<__m512>, col: usize, gi: usize) -> __m512i {
    let sl = col * p.groups + gi;
    let c = cz.unwrap_or_else(|| lut_codes(p.zeros.get(sl)));
    let v = _mm512_mul_ps(c, _mm512_set1_ps(widen(p.scales[sl])));
    // SAFETY: __m256bh and __m256i are both 256 bits.
    let h = unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v)) };
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(h), h)
}

/// The table for half-chunk `h` (inputs 32h…32h + 31), rebuilt only when
/// the group changes (once per group for G ≥ 64, per half for G = 32).
/// Groups are `2^shift` halves (`simd_ok`), so no division per chunk.
struct LutCache<T> {
    group: usize,
    lut: T,
}

impl<T: Copy> LutCache<T> {
    #[inline(always)]
    fn get(&mut self, shift: u32, h: usize, build: impl FnOnce(usize) -> T) -> T {
        let gi = h >> shift;
        if gi != self.group {
            self.group = gi;
            self.lut = build(gi);
        }
        self.lut
    }
}

/// Columns `cols`, rows `rows` (at most 4) of `x · Wᵀ` (requires `p.simd_ok`);
/// `xb` holds `x` as bf16 bits when all of it is bf16 and the CPU has AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn w4a16_gemv(
    p: &PackedW4A16,
    x: &[f32],
    xb: Option<&[u16]>,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &ColumnsOut,
) {
    assert!(p.simd_ok && cols.end <= p.n && rows.end * p.k <= x.len() && rows.len() <= 4);
    assert!(xb.is_none_or(|b| b.len() == x.len()));
    let xr = unsafe { x.as_ptr().add(rows.start * p.k) };
    let xbr = xb.map(|b| unsafe { b.as_ptr().add(rows.start * p.k) });
    macro_rules! go {
        ($r:expr, $s:literal, $cs:expr) => {{
            let cs: [usize; $s] = $cs;
            // SAFETY: every column c < n; rows of x hold k values; the bf16
            // path is only taken with xb present, i.e. on an AVX512-BF16 CPU.
            let v: [[f32; 4]; $s] = unsafe {
                match (xbr, $r) {
                    (Some(b), 1) => pad(w4a16_dot_bf16::<1, $s>(p, b, cs)),
                    (Some(b), 2) => pad(w4a16_dot_bf16::<2, $s>(p, b, cs)),
                    (Some(b), 3) => pad(w4a16_dot_bf16::<3, $s>(p, b, cs)),
                    (Some(b), _) => pad(w4a16_dot_bf16::<4, $s>(p, b, cs)),
                    (None, 1) => pad(w4a16_dot::<1, $s>(p, xr, cs)),
                    (None, 2) => pad(w4a16_dot::<2, $s>(p, xr, cs)),
                    (None, 3) => pad(w4a16_dot::<3, $s>(p, xr, cs)),
                    (None, _) => pad(w4a16_dot::<4, $s>(p, xr, cs)),
                }
            };
            for (c, v) in cs.iter().zip(v) {
                for (r, v) in rows.clone().zip(v) {
                    unsafe { out.row_mut(r, *c..*c + 1)[0] = v };
                }
            }
        }};
    }
    two_streams!(rows.len(), cols, go);
}

/// The 64 weights of chunk `ch` of column `col` as f32: inputs 64ch + 0…15,
/// 16…31 (table `lo`), 32…47, 48…63 (table `hi`).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn w4a16_chunk(
    p: &PackedW4A16,
    col: usize,
    ch: usize,
    lo: __m512,
    hi: __m512,
) -> [__m512; 4] {
    let at = unsafe { p.nib.as_ptr().add((col * p.chunks + ch) * 32) };
    // SAFETY: col < n and ch < chunks, checked by the callers.
    let (b0, b1) = unsafe {
        (
            _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i)),
            _mm512_cvtepu8_epi32(_mm_loadu_si128(at.add(16) as *const __m128i)),
        )
    };
    [
        _mm512_permutexvar_ps(b0, lo),
        _mm512_permutexvar_ps(b1, lo),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b0), hi),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b1), hi),
    ]
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn w4a16_dot<const R: usize, const S: usize>(
    p: &PackedW4A16,
    x: *const f32,
    cols: [usize; S],
) -> [[f32; R]; S] {
    let k = p.k;
    let nib = p.nib.as_ptr();
    let mut acc = [[[_mm512_setzero_ps(); 2]; R]; S];
    let mut luts = [(); S].map(|_| LutCache {
        group: usize::MAX,
        lut: _mm512_setzero_ps(),
    });
    for ch in 0..p.chunks {
        let mut w = [[_mm512_setzero_ps(); 4]; S];
        for s in 0..S {
            let at = (cols[s] * p.chunks + ch) * 32;
            if at.is_multiple_of(64) {
                prefetch(nib.wrapping_add(at + PREFETCH_BYTES_W4A16));
            }
            let lo = luts[s].get(p.half_shift, 2 * ch, |gi| w4a16_lut(p, cols[s], gi));
            let hi = luts[s].get(p.half_shift, 2 * ch + 1, |gi| w4a16_lut(p, cols[s], gi));
            // SAFETY: column < n, ch < chunks.
            w[s] = unsafe { w4a16_chunk(p, cols[s], ch, lo, hi) };
        }
        for r in 0..R {
            for q in 0..4 {
                // SAFETY: rows of x hold k = 64·chunks values (simd_ok).
                let xv = unsafe { _mm512_loadu_ps(x.add(r * k + 64 * ch + 16 * q)) };
                for s in 0..S {
                    acc[s][r][q % 2] = _mm512_fmadd_ps(w[s][q], xv, acc[s][r][q % 2]);
                }
            }
        }
    }
    let mut res = [[0f32; R]; S];
    for s in 0..S {
        for r in 0..R {
            res[s][r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[s][r][0], acc[s][r][1]));
        }
    }
    res
}

/// [`w4a16_dot`] with bf16 activations `xb`: 32 weights per `vpermw`,
/// 32 products per `vdpbf16ps`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")]
unsafe fn w4a16_dot_bf16<const R: usize, const S: usize>(
    p: &PackedW4A16,
    xb: *const u16,
    cols: [usize; S],
) -> [[f32; R]; S] {
    let k = p.k;
    let nib = p.nib.as_ptr();
    let mut acc = [[[_mm512_setzero_ps(); 2]; R]; S];
    let mut luts = [(); S].map(|_| LutCache {
        group: usize::MAX,
        lut: _mm512_setzero_si512(),
    });
    let cz = match p.zeros {
        Zeros::Uniform(z) => Some(lut_codes(z)),
        Zeros::PerGroup(_) => None,
    };
    for ch in 0..p.chunks {
        let mut w = [[_mm512_setzero_si512(); 2]; S];
        for s in 0..S {
            let at = (cols[s] * p.chunks + ch) * 32;
            if at.is_multiple_of(64) {
                prefetch(nib.wrapping_add(at + PREFETCH_BYTES_W4A16));
            }
            let lo = luts[s].get(p.half_shift, 2 * ch, |gi| lut_bf16_ne(p, cz, cols[s], gi));
            let hi = luts[s].get(p.half_shift, 2 * ch + 1, |gi| {
                lut_bf16_ne(p, cz, cols[s], gi)
            });
            // SAFETY: column < n, ch < chunks.
            let v =
                unsafe { _mm512_cvtepu8_epi16(_mm256_loadu_si256(nib.add(at) as *const __m256i)) };
            // u16 lane i = q[64ch + i] | q[64ch + 32 + i] << 4; vpermw reads 5 bits
            // and the table is stored twice, so the high nibble's low bit is harmless.
            w[s] = [
                _mm512_permutexvar_epi16(v, lo),
                _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(v), hi),
            ];
        }
        for r in 0..R {
            for h in 0..2 {
                // SAFETY: rows of xb hold k = 64·chunks values (simd_ok).
                let xv = unsafe {
                    _mm512_loadu_si512(xb.add(r * k + 64 * ch + 32 * h) as *const __m512i)
                };
                for s in 0..S {
                    // SAFETY: __m512i and __m512bh are both 32 × 16 bits.
                    let (wv, xv) = unsafe {
                        (
                            std::mem::transmute::<__m512i, __m512bh>(w[s][h]),
                            std::mem::transmute::<__m512i, __m512bh>(xv),
                        )
                    };
                    acc[s][r][h] = _mm512_dpbf16_ps(acc[s][r][h], wv, xv);
                }
            }
        }
    }
    let mut res = [[0f32; R]; S];
    for s in 0..S {
        for r in 0..R {
            res[s][r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[s][r][0], acc[s][r][1]));
        }
    }
    res
}

/// Weight rows `cols` as f32 `[cols.len(), k]` (requires `p.simd_ok`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn w4a16_expand(p: &PackedW4A16, cols: Range<usize>, out: &mut [f32]) {
    assert!(p.simd_ok && cols.end <= p.n && out.len() == cols.len() * p.k);
    for (col, o) in cols.zip(out.chunks_exact_mut(p.k)) {
        let mut lut = LutCache {
            group: usize::MAX,
            lut: _mm512_setzero_ps(),
        };
        for ch in 0..p.chunks {
            let lo = lut.get(p.half_shift, 2 * ch, |gi| w4a16_lut(p, col, gi));
            let hi = lut.get(p.half_shift, 2 * ch + 1, |gi| w4a16_lut(p, col, gi));
            let w = unsafe { w4a16_chunk(p, col, ch, lo, hi) };
            for (q, w) in w.into_iter().enumerate() {
                // SAFETY: 64·ch + 64 ≤ k = o.len().
                unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(64 * ch + 16 * q), w) };
            }
        }
    }
}

// ---------------------------------------------------------------- bf16 GEMM

/// Columns per packed slice of [`bf16_gemm_slice`]: two 16-lane tiles.
pub(super) const GEMM_SLICE: usize = 32;

/// Pack `w` (`[cols ≤ 32, k]` f32 holding bf16 values, k even) into the
/// slice layout: tile s (columns 16s…), input pair p, lane j →
/// `out[(s·k/2 + p)·32 + 2j + {0,1}]` = bits of `w[16s + j][2p + {0,1}]`;
/// missing columns are zero.
pub(super) fn pack_bf16_slice(w: &[f32], cols: usize, k: usize, out: &mut [u16]) {
    debug_assert!(k.is_multiple_of(2) && out.len() == GEMM_SLICE * k && w.len() == cols * k);
    out.fill(0);
    for c in 0..cols {
        let (s, j) = (c / 16, c % 16);
        let row = &w[c * k..(c + 1) * k];
        for p in 0..k / 2 {
            let o = (s * (k / 2) + p) * 32 + 2 * j;
            out[o] = (row[2 * p].to_bits() >> 16) as u16;
            out[o + 1] = (row[2 * p + 1].to_bits() >> 16) as u16;
        }
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
    use crate::kernels::w4::{Codes, W4Nibbles};

    /// The `vcvtneps2bf16` table equals the scalar one for extreme scales
    /// (fp16's smallest subnormal up to its largest) and asymmetric zeros.
    #[test]
    fn bf16_tables_round_like_the_scalar_reference() {
        if !crate::kernels::isa::Isa::tested().contains(&crate::kernels::isa::Isa::Avx512Bf16) {
            return;
        }
        let mut scales: Vec<f32> = [2f32.powi(-24), 3.0 * 2f32.powi(-24), 6.1e-5, 65504.0]
            .map(|s| half::bf16::from_f32(s).to_f32())
            .to_vec();
        let mut seed = 3u32;
        while scales.len() < 256 {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let h = half::f16::from_bits((seed >> 16) as u16 & 0x7BFF); // finite, positive
            scales.push(half::bf16::from_f32(h.to_f32()).to_f32());
        }
        let n = scales.len();
        for zero in [8, 1, 16] {
            let zeros = vec![zero; n];
            let q = vec![0u8; n * 64];
            let p = PackedW4A16::pack(W4Nibbles {
                q: Codes::Unpacked(&q),
                zeros: &zeros,
                scales: &scales,
                n,
                k: 64,
                g: 64,
            });
            for cz in [Some(unsafe { lut_codes(zero) }), None] {
                for col in 0..n {
                    let got: [u16; 32] =
                        unsafe { std::mem::transmute(lut_bf16_ne(&p, cz, col, 0)) };
                    let want = p.lut(col, 0);
                    for (i, w) in want.iter().enumerate() {
                        let w = half::bf16::from_f32(*w).to_bits();
                        assert_eq!((got[i], got[16 + i]), (w, w), "scale {} q {i}", scales[col]);
                    }
                }
            }
        }
    }
}
