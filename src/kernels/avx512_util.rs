//! Helpers shared by the AVX-512 (F/BW/VL + VNNI) kernels of the packed
//! formats (`bf16/avx512.rs`, `w4a8/avx512.rs`, `w4a16/avx512.rs`): bf16
//! rounding in registers, software prefetch and its distances, the
//! two-stream column walk and the result padding of the row-dot kernels.
//!
//! Decode is bandwidth-bound, and how to read the weights fastest depends on
//! the CPU ([`Walk`]). Each job's columns can be read as two halves in
//! lockstep (two far-apart streams, each activation load serving two
//! columns) with a software prefetch 2–4 KiB ahead, or as one sequential
//! stream left to the hardware prefetchers. With the f32-FMA bf16 kernel
//! the two-stream walk took the head from ~65 % to ~100 % of a streaming
//! read (first project machine, one thread, 131072 × 2048). On the Zen 4 of
//! docs/BENCHMARKS.md ("The decode walk") the `vdpbf16ps` bf16 kernel reads
//! the head at 55–59 % of the stream two-stream and 84–92 % one-stream.
//! Results do not depend on the walk: each column's sums run in the same
//! order either way. The walk covers bf16 and W4A16 for up to 4 rows, W4A8
//! for one row.
//!
//! The AVX-512 intrinsics are stable since Rust 1.89, the crate's declared rust-version.

use std::arch::x86_64::*;
use std::sync::OnceLock;

/// How the decode kernels read a job's columns: as two lockstep streams with
/// software prefetch (measured best on the Intel machines), or as one
/// sequential stream left to the hardware prefetchers (measured best on AMD
/// Zen 4). The kernels with f32 activations and the W4A16 ones always take
/// two streams: they do the most work per byte, so they have the fewest
/// loads in flight per stream, and the f32 ones share each activation load
/// between the streams. For the rest it is chosen once per process from the
/// CPU vendor; `SPARK_DECODE_WALK=one|two`
/// overrides it, to measure one against the other on any machine (`bench
/// --kernels` prints the walk in use).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Walk {
    OneStream,
    TwoStreamsPrefetch,
}

impl Walk {
    /// Whether the kernels issue software prefetches.
    #[inline]
    pub(crate) fn prefetch(self) -> bool {
        self == Walk::TwoStreamsPrefetch
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Walk::OneStream => "one stream",
            Walk::TwoStreamsPrefetch => "two streams + prefetch",
        }
    }
}

/// The walk in use (see [`Walk`]).
pub(crate) fn walk() -> Walk {
    static CHOSEN: OnceLock<Walk> = OnceLock::new();
    *CHOSEN.get_or_init(|| match std::env::var("SPARK_DECODE_WALK").as_deref() {
        Ok("one") => Walk::OneStream,
        Ok("two") => Walk::TwoStreamsPrefetch,
        _ if is_amd() => Walk::OneStream,
        _ => Walk::TwoStreamsPrefetch,
    })
}

/// CPUID leaf 0's vendor string is "AuthenticAMD".
fn is_amd() -> bool {
    // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
    #[allow(unused_unsafe)]
    let r = unsafe { __cpuid(0) };
    let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    vendor == b"AuthenticAMD"
}

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

/// Run `f!(rows, S, [column; S])` over a job's column (or tile) range as
/// `walk` says: with two streams, the range halved into two lockstep
/// streams (`S = 2`), then the odd column alone (`S = 1`); with one, every
/// column in order (`S = 1`).
macro_rules! walk_columns {
    ($walk:expr, $rows:expr, $cols:expr, $f:ident) => {{
        let cols = $cols;
        if $walk == $crate::kernels::avx512_util::Walk::OneStream {
            for c in cols {
                $f!($rows, 1, [c]);
            }
        } else {
            let half = cols.len() / 2;
            for i in 0..half {
                $f!($rows, 2, [cols.start + i, cols.start + half + i]);
            }
            if cols.len() % 2 == 1 {
                $f!($rows, 1, [cols.end - 1]);
            }
        }
    }};
}
pub(super) use walk_columns;

/// Results of `R` rows widened to 4 (the callers' common type).
#[inline]
pub(super) fn pad<const R: usize, const S: usize>(v: [[f32; R]; S]) -> [[f32; 4]; S] {
    v.map(|r| std::array::from_fn(|i| if i < R { r[i] } else { 0.0 }))
}
