//! Helpers shared by the AVX-512 (F/BW/VL + VNNI) kernels of the packed
//! formats (`bf16/avx512.rs`, `w4a8/avx512.rs`, `w4a16/avx512.rs`): bf16
//! rounding in registers, software prefetch and its distances, the
//! two-stream column walk and the result padding of the row-dot kernels.
//!
//! Decode is bandwidth-bound. Measured on the project machine (one thread,
//! 131072 × 2048 bf16): a kernel that reads its columns as one sequential
//! stream reaches ~65 % of a plain streaming read; splitting each job's
//! columns into two halves read in lockstep (two far-apart streams for the
//! hardware prefetchers) plus a software prefetch 2–4 KiB ahead reaches
//! ~100 %. So the decode paths read two streams: bf16 and W4A16 for up to
//! 4 rows, W4A8 for one row.
//!
//! The AVX-512 intrinsics are stable since Rust 1.89, the crate's declared rust-version.

use std::arch::x86_64::*;

/// Per-lane `half::bf16::from_f32(v).to_f32()`: round to nearest even on
/// the bit pattern, NaN made quiet (not `vcvtneps2bf16`, which flushes
/// denormals).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn round_bf16_ps(v: __m512) -> __m512 {
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
pub(super) fn prefetch<T>(p: *const T) {
    _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
}

/// How far ahead of each stream's current load the kernels prefetch.
pub(super) const PREFETCH_BYTES: usize = 2048;
/// W4A16 does more work per byte, so it asks earlier (measured: 4–8 KiB
/// beat 0.5–2 KiB on the 2048-input shapes).
pub(super) const PREFETCH_BYTES_W4A16: usize = 4096;

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
pub(super) use two_streams;

/// Results of `R` rows widened to 4 (the callers' common type).
#[inline]
pub(super) fn pad<const R: usize, const S: usize>(v: [[f32; R]; S]) -> [[f32; 4]; S] {
    v.map(|r| std::array::from_fn(|i| if i < R { r[i] } else { 0.0 }))
}
