//! AVX-512 (F/BW/VL + VNNI, and AVX512-BF16 for bf16 activations) versions
//! of the W4A16 kernels. The layout and numerics are described, and the
//! portable versions written, in the parent module; tests there compare
//! every tier, and the ones here check the group tables and the decoder choice.
//!
//! Every function here is `unsafe`: the caller has checked
//! [`Isa::avx512`](crate::kernels::isa::Isa::avx512) on this CPU, and owns the output
//! columns it passes (disjoint between parallel jobs).

use std::arch::x86_64::*;
use std::ops::Range;

use super::PackedW4A16;
use crate::kernels::avx512_util::{
    pad, prefetch, round_bf16_ps, walk_columns, Walk, PREFETCH_BYTES_W4A16,
};
use crate::kernels::par::ColumnsOut;
use crate::kernels::w4::Zeros;

/// `bf16((q − z)·s)` for q = 0…15 in group `gi` of column `col`, as f32.
///
/// # Safety
/// col < n and gi < groups.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn w4a16_lut(p: &PackedW4A16, col: usize, gi: usize) -> __m512 {
    // SAFETY: as this function's contract.
    round_bf16_ps(unsafe { scaled_codes(p, None, col, gi) })
}

/// `q − z` for q = 0…15, as f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn lut_codes(z: i32) -> __m512 {
    let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _mm512_cvtepi32_ps(_mm512_sub_epi32(iota, _mm512_set1_epi32(z)))
}

/// [`lut_codes`] of the zero point when it is the same for every group (GPTQ's symmetric
/// checkpoints): built once per call instead of per table.
#[inline]
#[target_feature(enable = "avx512f")]
fn uniform_codes(p: &PackedW4A16) -> Option<__m512> {
    match p.zeros {
        Zeros::Uniform(z) => Some(lut_codes(z)),
        Zeros::PerGroup(_) => None,
    }
}

/// s·(q − z) for q = 0…15 in group `gi` of column `col`, exact in f32 (≤ 8 × 5 significant
/// bits): one `vmulps` of the codes with the scale widened in a vector register — the 32 bits
/// ending at the scale's slot broadcast from memory (the slot before it, or the pad slot in
/// front, in the low half) and that low half masked off. A load, a `vpandd` and a `vmulps`:
/// no shuffle and no `vdpbf16ps`, which on the Xeons with AMX shares its issue resources with
/// the nibble lookups (docs/BENCHMARKS.md "W4A16 group tables without `vdpbf16ps`"), and no
/// move from a general register.
///
/// # Safety
/// col < n and gi < groups.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn scaled_codes(p: &PackedW4A16, cz: Option<__m512>, col: usize, gi: usize) -> __m512 {
    let sl = col * p.groups + gi;
    let c = cz.unwrap_or_else(|| lut_codes(p.zeros.get(sl)));
    let bits: __m512i;
    // SAFETY: slots sl and sl + 1 of `scales` exist (the pad slot in front, sl < n·groups).
    // The broadcast is asm so that the mask below stays a vector operation: seen through, the
    // compiler may fold it into the scalar and broadcast from a general register (shuffle port).
    unsafe {
        std::arch::asm!(
            "vpbroadcastd {v}, dword ptr [{p}]",
            v = out(zmm_reg) bits,
            p = in(reg) p.scales.as_ptr().add(sl),
            options(pure, readonly, nostack, preserves_flags)
        )
    };
    let s = _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
    _mm512_mul_ps(c, _mm512_castsi512_ps(s))
}

/// 32 × 16 bits as bf16 pairs.
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: __m512i and __m512bh are both 32 × 16 bits.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// f32 lanes `lo` to bf16 lanes 0…15 and `hi` to lanes 16…31, rounded to nearest even.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn to_bf16_pair(hi: __m512, lo: __m512) -> __m512i {
    // SAFETY: __m512bh and __m512i are both 512 bits.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
}

/// The table of [`w4a16_lut`] as 16 bf16 values stored twice (32 u16 lanes for `vpermw`): with
/// zero point 8 throughout, the precomputed row of the scale's bits (`p.rows`, the scalar
/// reference's values); otherwise computed, `cz` = [`uniform_codes`]. `vcvtne2ps2bf16` rounds to nearest even like [`round_bf16_ps`]
/// except that it flushes f32 denormals: the product of a bf16 scale and a code |q − z| ≤ 16 is
/// exact, and a nonzero one is at least 2^-24 for fp16 scales (GPTQ's), so none occur there; a
/// bf16 or f32 scale tensor with scales below 2^-126 would have such entries read as zero
/// (a difference below 2^-122 per weight).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn lut_bf16_ne(p: &PackedW4A16, cz: Option<__m512>, col: usize, gi: usize) -> __m512i {
    if let Some(rows) = p.rows {
        // The row of this scale's bits, broadcast to both halves: a load, no arithmetic.
        let s = p.scale(col * p.groups + gi) as usize;
        // SAFETY: `rows` holds 16 entries for every u16 value.
        return unsafe {
            _mm512_broadcast_i64x4(_mm256_loadu_si256(
                rows.as_ptr().add(16 * s) as *const __m256i
            ))
        };
    }
    // SAFETY: as the caller's.
    let t = unsafe { scaled_codes(p, cz, col, gi) };
    to_bf16_pair(t, t)
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
/// `xb` holds `x` as bf16 bits when all of it is bf16 and the CPU has AVX512-BF16, decoded by
/// `decode` (`Decode::Interleaved` only on a CPU with AVX512-VBMI).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn w4a16_gemv(
    p: &PackedW4A16,
    x: &[f32],
    xb: Option<&[u16]>,
    decode: Decode,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &ColumnsOut,
) {
    assert!(p.simd_ok && cols.end <= p.n && rows.end * p.k <= x.len() && rows.len() <= 4);
    assert!(xb.is_none_or(|b| b.len() == x.len()));
    let xr = unsafe { x.as_ptr().add(rows.start * p.k) };
    let xb = xb.map(|b| &b[rows.start * p.k..rows.end * p.k]);
    let words = xb
        .filter(|_| decode == Decode::Words)
        .map(|b| to_word_order(b, p.k));
    let xbr = words.as_deref().or(xb).map(<[u16]>::as_ptr);
    macro_rules! go {
        ($r:expr, $s:literal, $cs:expr) => {{
            let cs: [usize; $s] = $cs;
            // SAFETY: every column c < n; rows of x hold k values; the bf16
            // path is only taken with xb present, i.e. on an AVX512-BF16 CPU.
            let v: [[f32; 4]; $s] = unsafe {
                match (xbr, $r) {
                    (Some(b), 1) => pad(w4a16_dot_bf16::<1, $s>(p, b, cs, decode)),
                    (Some(b), 2) => pad(w4a16_dot_bf16::<2, $s>(p, b, cs, decode)),
                    (Some(b), 3) => pad(w4a16_dot_bf16::<3, $s>(p, b, cs, decode)),
                    (Some(b), _) => pad(w4a16_dot_bf16::<4, $s>(p, b, cs, decode)),
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
    // Two streams whatever the CPU: this kernel does the most work per byte, and
    // the second stream doubles the loads in flight (measured on the Zen 4 that
    // prefers one stream for the lighter kernels, docs/BENCHMARKS.md).
    walk_columns!(Walk::TwoStreamsPrefetch, rows.len(), cols, go);
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
            // SAFETY: column < n, the chunk's groups < groups.
            let lo = luts[s].get(p.half_shift, 2 * ch, |gi| unsafe {
                w4a16_lut(p, cols[s], gi)
            });
            let hi = luts[s].get(p.half_shift, 2 * ch + 1, |gi| unsafe {
                w4a16_lut(p, cols[s], gi)
            });
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

/// How [`w4a16_dot_bf16`] turns a column's nibbles into bf16 weights.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Decode {
    /// Chunk by chunk: 32 bytes widened to 16-bit lanes, two `vpermw` (any `simd_ok` shape).
    Chunks,
    /// Chunk pairs of one group (G ≥ 128, an even chunk count): the pair's 64 bytes as 32
    /// 16-bit words whose four nibbles index the table by `vpermw` after a shift, no widening
    /// (4 cross-lane shuffles per 128 weights where widening takes 6; the shuffles bound this
    /// kernel on Zen 4). Activations in [`word_order`].
    Words,
    /// Chunk pairs of two groups (G = 64, an even chunk count, AVX512-VBMI): one `vpermb`
    /// interleaves the two chunks' bytes so that word j is byte j of the first chunk and byte j
    /// of the second; its low two nibbles then index the first group's table, its high two the
    /// second's. Activations in their natural order.
    Interleaved,
}

impl Decode {
    pub(super) fn of(p: &PackedW4A16, vbmi: bool) -> Decode {
        match p.half_shift {
            _ if !p.simd_ok || !p.chunks.is_multiple_of(2) => Decode::Chunks,
            1 if vbmi => Decode::Interleaved,
            1 => Decode::Chunks,
            s if s >= 2 => Decode::Words,
            _ => Decode::Chunks,
        }
    }
}

/// Which input of a chunk pair's 128 the [`Decode::Words`] decoder puts at position `o`
/// (0…127): position 32·s + j is nibble s of 16-bit word j of the pair's 64 bytes. Word j < 16
/// is bytes 2j, 2j+1 of the first chunk, q[2j] | q[32 + 2j] << 4 | q[2j + 1] << 8 |
/// q[33 + 2j] << 12 (the chunk layout of the parent module); words 16…31 the same of the second
/// chunk.
pub(super) fn word_order(o: usize) -> usize {
    let (s, j) = (o / 32, o % 32);
    64 * (j / 16) + 2 * (j % 16) + [0, 32, 1, 33][s]
}

/// `rows` rows of `k` bf16 activations put in [`word_order`] pair by pair.
fn to_word_order(xb: &[u16], k: usize) -> Vec<u16> {
    // Rows are whole pairs, so the 128-value pieces never straddle two rows.
    assert!(k.is_multiple_of(128) && xb.len().is_multiple_of(k));
    let order: [usize; 128] = std::array::from_fn(word_order);
    let mut out = vec![0u16; xb.len()];
    for (dst, src) in out.chunks_exact_mut(128).zip(xb.chunks_exact(128)) {
        for (d, &o) in dst.iter_mut().zip(&order) {
            *d = src[o];
        }
    }
    out
}

/// A chunk-pair kernel ([`Decode::Words`], [`Decode::Interleaved`]): per pair and column the
/// decode block gives four registers of 32 bf16 weights, matching activations 128·pair + 32·q
/// …; four accumulators, one per register. A macro, not a generic, because the two need
/// different target features and the accumulators must stay in registers (a helper taking
/// them by reference spilled them: 1.3–1.8× slower).
macro_rules! pair_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal,
     |$p:ident, $cz:ident, $col:ident, $pair:ident, $v:ident| $decode:block) => {
        $(#[$doc])*
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const S: usize>(
            p: &PackedW4A16,
            xb: *const u16,
            cols: [usize; S],
        ) -> [[f32; R]; S] {
            debug_assert!(p.chunks.is_multiple_of(2));
            let (k, nib) = (p.k, p.nib.as_ptr());
            let cz = uniform_codes(p);
            let mut acc = [[[_mm512_setzero_ps(); 4]; R]; S];
            for pair in 0..p.chunks / 2 {
                let mut w = [[_mm512_setzero_si512(); 4]; S];
                for s in 0..S {
                    let at = (cols[s] * p.chunks + 2 * pair) * 32;
                    prefetch(nib.wrapping_add(at + PREFETCH_BYTES_W4A16));
                    // SAFETY: column < n, 2·pair + 1 < chunks: 64 bytes of this column.
                    let $v = unsafe { _mm512_loadu_si512(nib.add(at) as *const __m512i) };
                    let ($p, $cz, $col, $pair) = (p, cz, cols[s], pair);
                    w[s] = $decode;
                }
                for r in 0..R {
                    for q in 0..4 {
                        // SAFETY: rows of xb hold k = 64·chunks values (simd_ok).
                        let xv = unsafe {
                            _mm512_loadu_si512(xb.add(r * k + 128 * pair + 32 * q) as *const __m512i)
                        };
                        for s in 0..S {
                            let a = &mut acc[s][r][q];
                            *a = _mm512_dpbf16_ps(*a, bh(w[s][q]), bh(xv));
                        }
                    }
                }
            }
            let mut res = [[0f32; R]; S];
            for s in 0..S {
                for r in 0..R {
                    let [a0, a1, a2, a3] = acc[s][r];
                    res[s][r] = _mm512_reduce_add_ps(_mm512_add_ps(
                        _mm512_add_ps(a0, a1),
                        _mm512_add_ps(a2, a3),
                    ));
                }
            }
            res
        }
    };
}

pair_kernel!(
    /// [`Decode::Words`]: one table per pair, stored twice, so the stray bit 4 of each shifted
    /// word (the next nibble's low bit) is harmless; `xb` in [`word_order`].
    w4a16_dot_bf16_words,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16",
    |p, cz, col, pair, v| {
        // SAFETY: column < n, the pair's group < groups.
        let lut = unsafe { lut_bf16_ne(p, cz, col, (2 * pair) >> (p.half_shift - 1)) };
        nibble_lookups(v, lut, lut)
    }
);

/// The four registers of a chunk pair: nibble s (0…3) of each 16-bit word of `v` looked up in
/// `lo` (s = 0, 1) or `hi` (s = 2, 3). `vpermw` reads an index's low 5 bits, so each table is
/// stored twice and the next nibble's low bit (bit 4 after the shift) is harmless.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn nibble_lookups(v: __m512i, lo: __m512i, hi: __m512i) -> [__m512i; 4] {
    [
        _mm512_permutexvar_epi16(v, lo),
        _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(v), lo),
        _mm512_permutexvar_epi16(_mm512_srli_epi16::<8>(v), hi),
        _mm512_permutexvar_epi16(_mm512_srli_epi16::<12>(v), hi),
    ]
}

/// Byte j of the first 32 to byte 2j, byte 32 + j to byte 2j + 1 ([`Decode::Interleaved`]).
#[inline]
#[target_feature(enable = "avx512f")]
fn interleave_index() -> __m512i {
    let idx: [u8; 64] = std::array::from_fn(|b| (b / 2 + 32 * (b % 2)) as u8);
    // SAFETY: 64 bytes.
    unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) }
}

pair_kernel!(
    /// [`Decode::Interleaved`] (G = 64): word j = byte j of chunk 2·pair (inputs j, 32 + j of
    /// it in its nibbles) | byte j of chunk 2·pair + 1 << 8, so registers 0, 1 hold the
    /// first group's inputs 0…31, 32…63 and registers 2, 3 the second's: the natural order.
    /// Each group's table is stored twice, so the stray bit 4 is harmless.
    w4a16_dot_bf16_interleaved,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx512vbmi",
    |p, cz, col, pair, v| {
        let v = _mm512_permutexvar_epi8(interleave_index(), v);
        // SAFETY: column < n, 2·pair + 1 < chunks = groups.
        let (a, b) = unsafe {
            (
                lut_bf16_ne(p, cz, col, 2 * pair),
                lut_bf16_ne(p, cz, col, 2 * pair + 1),
            )
        };
        nibble_lookups(v, a, b)
    }
);

/// [`w4a16_dot`] with bf16 activations `xb` (in [`word_order`] for [`Decode::Words`]):
/// 32 weights per `vpermw`, 32 products per `vdpbf16ps`. `Decode::Interleaved` requires
/// AVX512-VBMI.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")]
unsafe fn w4a16_dot_bf16<const R: usize, const S: usize>(
    p: &PackedW4A16,
    xb: *const u16,
    cols: [usize; S],
    decode: Decode,
) -> [[f32; R]; S] {
    match decode {
        // SAFETY: as this function's contract.
        Decode::Words => return unsafe { w4a16_dot_bf16_words::<R, S>(p, xb, cols) },
        Decode::Interleaved => return unsafe { w4a16_dot_bf16_interleaved::<R, S>(p, xb, cols) },
        Decode::Chunks => {}
    }
    let k = p.k;
    let nib = p.nib.as_ptr();
    let mut acc = [[[_mm512_setzero_ps(); 2]; R]; S];
    let mut luts = [(); S].map(|_| LutCache {
        group: usize::MAX,
        lut: _mm512_setzero_si512(),
    });
    let cz = uniform_codes(p);
    for ch in 0..p.chunks {
        let mut w = [[_mm512_setzero_si512(); 2]; S];
        for s in 0..S {
            let at = (cols[s] * p.chunks + ch) * 32;
            if at.is_multiple_of(64) {
                prefetch(nib.wrapping_add(at + PREFETCH_BYTES_W4A16));
            }
            // SAFETY: column < n, the chunk's groups < groups.
            let lo = luts[s].get(p.half_shift, 2 * ch, |gi| unsafe {
                lut_bf16_ne(p, cz, cols[s], gi)
            });
            let hi = luts[s].get(p.half_shift, 2 * ch + 1, |gi| unsafe {
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
                    acc[s][r][h] = _mm512_dpbf16_ps(acc[s][r][h], bh(w[s][h]), bh(xv));
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
            // SAFETY: col < n, the chunk's groups < groups.
            let lo = lut.get(p.half_shift, 2 * ch, |gi| unsafe { w4a16_lut(p, col, gi) });
            let hi = lut.get(p.half_shift, 2 * ch + 1, |gi| unsafe {
                w4a16_lut(p, col, gi)
            });
            let w = unsafe { w4a16_chunk(p, col, ch, lo, hi) };
            for (q, w) in w.into_iter().enumerate() {
                // SAFETY: 64·ch + 64 ≤ k = o.len().
                unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(64 * ch + 16 * q), w) };
            }
        }
    }
}

/// Weight rows `cols` as bf16 bits `[cols.len(), k]` (requires `p.simd_ok`): the tables of
/// [`w4a16_dot_bf16`], one `vpermw` per 32 weights, no f32 on the way.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn w4a16_expand_bits(p: &PackedW4A16, cols: Range<usize>, out: &mut [u16]) {
    assert!(p.simd_ok && cols.end <= p.n && out.len() == cols.len() * p.k);
    let cz = uniform_codes(p);
    for (col, o) in cols.zip(out.chunks_exact_mut(p.k)) {
        let mut luts = LutCache {
            group: usize::MAX,
            lut: _mm512_setzero_si512(),
        };
        for ch in 0..p.chunks {
            // SAFETY: col < n, the chunk's groups < groups.
            let lo = luts.get(p.half_shift, 2 * ch, |gi| unsafe {
                lut_bf16_ne(p, cz, col, gi)
            });
            let hi = luts.get(p.half_shift, 2 * ch + 1, |gi| unsafe {
                lut_bf16_ne(p, cz, col, gi)
            });
            // SAFETY: col < n, ch < chunks; 64·ch + 64 ≤ k = o.len(). Byte layout as in
            // `w4a16_dot_bf16`: lane i holds inputs 64ch + i and 64ch + 32 + i.
            unsafe {
                let at = p.nib.as_ptr().add((col * p.chunks + ch) * 32);
                let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(at as *const __m256i));
                let dst = o.as_mut_ptr().add(64 * ch);
                _mm512_storeu_si512(dst as *mut _, _mm512_permutexvar_epi16(v, lo));
                _mm512_storeu_si512(
                    dst.add(32) as *mut _,
                    _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(v), hi),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::w4::{Codes, W4Nibbles};

    /// The GPTQ shapes reach the pair decoders (the tier tests cover each decoder's results).
    #[test]
    fn group_sizes_pick_their_decoder() {
        let pack = |k: usize, g: usize| {
            let (q, z, s) = (vec![0u8; 2 * k], vec![8; 2 * k / g], vec![1.0; 2 * k / g]);
            let nib = W4Nibbles {
                q: Codes::Unpacked(&q),
                zeros: &z,
                scales: &s,
                n: 2,
                k,
                g,
            };
            PackedW4A16::pack(nib)
        };
        for (k, g, vbmi, want) in [
            (2048, 128, true, Decode::Words),
            (6656, 128, false, Decode::Words),
            (2048, 64, true, Decode::Interleaved),
            (2048, 64, false, Decode::Chunks),
            (192, 64, true, Decode::Chunks),
            (2048, 32, true, Decode::Chunks),
            (2048, 256, true, Decode::Words),
        ] {
            assert_eq!(
                Decode::of(&pack(k, g), vbmi),
                want,
                "k {k} g {g} vbmi {vbmi}"
            );
        }
    }

    /// The `vmulps` + `vcvtne2ps2bf16` tables, and for zero point 8 the rows of
    /// `symmetric_rows` too, equal the scalar one bit for bit for fp16-range scales (fp16's
    /// smallest subnormal up to its largest, either sign) and asymmetric zeros, per-group and
    /// uniform codes, every column (so every scale meets a different low half in its 32-bit
    /// load, the first one the pad slot).
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
            let h = half::f16::from_bits((seed >> 16) as u16 & 0xFBFF); // finite, either sign
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
            assert_eq!(p.rows.is_some(), zero == 8);
            let ways = if zero == 8 {
                vec![true, false]
            } else {
                vec![false]
            };
            for (rows, cz) in ways
                .into_iter()
                .flat_map(|r| [(r, Some(unsafe { lut_codes(zero) })), (r, None)])
            {
                let p = p.clone_with_rows(rows);
                for col in 0..n {
                    let got: [u16; 32] =
                        unsafe { std::mem::transmute(lut_bf16_ne(&p, cz, col, 0)) };
                    let want = p.lut(col, 0);
                    for (i, w) in want.iter().enumerate() {
                        // Bit for bit, the sign of a zero entry (−0 for a negative scale) too.
                        let w = half::bf16::from_f32(*w).to_bits();
                        assert_eq!(
                            [got[i], got[16 + i]],
                            [w, w],
                            "scale {} q {i} rows {rows}",
                            scales[col]
                        );
                    }
                }
            }
        }
    }
}
