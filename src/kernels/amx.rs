//! What the AMX kernels share: the tile configuration (palette 1, eight tiles of 16 rows × 64
//! bytes) and loading / releasing it. Tile instructions are inline `asm!` (their intrinsics are
//! unstable in Rust 1.95); the compiler never uses tile registers, so the state lives across
//! asm blocks from [`configure`] to [`release`].

use std::arch::asm;

/// Palette 1; tiles 0–7 all 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn full() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c[48 + t] = 16;
        }
        TileConfig(c)
    }
}

/// Configures tiles 0–7 as 16 rows of 64 bytes.
///
/// # Safety
/// The CPU has AMX and the OS granted this process tile state
/// ([`Isa::Amx`](super::isa::Isa::Amx)).
pub(super) unsafe fn configure() {
    let cfg = TileConfig::full();
    // SAFETY: the config is a valid palette-1 layout; the caller checked AMX and the grant.
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
}

/// Releases the tile state (back to the init state, so context switches stay cheap).
///
/// # Safety
/// As [`configure`].
pub(super) unsafe fn release() {
    // SAFETY: the caller checked AMX; releasing an unconfigured state is allowed.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// A zeroed buffer whose first value lies on a 64-byte boundary, for tile operands: a tile row
/// that straddles two cache lines loads far slower (the 2 × 2 step of [`super::peak`] ran at
/// 32 % of `tdpbf16ps`'s rate from a buffer 16 bytes off, 100 % aligned, on the Xeon of
/// docs/BENCHMARKS.md), and a large `Vec` starts 16 bytes past a page.
pub(super) struct Aligned<T> {
    buf: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Copy + Default> Aligned<T> {
    pub(super) fn new(len: usize) -> Self {
        assert!(size_of::<T>().is_power_of_two() && size_of::<T>() <= 64);
        let extra = 64 / size_of::<T>();
        let buf = vec![T::default(); len + extra];
        let off = buf.as_ptr().align_offset(64);
        assert!(off <= extra, "a Vec is aligned to its element");
        Aligned { buf, off, len }
    }
}

impl<T> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl<T> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// Zeroes the accumulator tiles 0–3.
///
/// # Safety
/// Tiles configured by [`configure`].
#[inline(always)]
pub(super) unsafe fn zero_accumulators() {
    // SAFETY: tiles 0–3 are configured; zeroing them needs nothing else.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        )
    };
}

/// Stores the accumulator tiles 0–3 as four consecutive 1 KiB tiles at `c`.
///
/// # Safety
/// Tiles configured by [`configure`]; `c` is valid for 4 KiB of writes.
#[inline(always)]
pub(super) unsafe fn store_accumulators(c: *mut u8) {
    // SAFETY: the caller's promise: tile t lies at c + 1024·t, rows 64 bytes apart.
    unsafe { store_accumulators_at([0, 1, 2, 3].map(|t| c.add(1024 * t)), 64) };
}

/// Stores accumulator tile t (0–3) at `p[t]`, its 16 rows `stride` bytes apart.
///
/// # Safety
/// Tiles configured by [`configure`]; each `p[t]` is valid for 16 rows of 64 bytes at `stride`.
#[inline(always)]
pub(super) unsafe fn store_accumulators_at(p: [*mut u8; 4], stride: usize) {
    // SAFETY: the caller's promise.
    unsafe {
        asm!(
            "tilestored [{p0} + {s} * 1], tmm0",
            "tilestored [{p1} + {s} * 1], tmm1",
            "tilestored [{p2} + {s} * 1], tmm2",
            "tilestored [{p3} + {s} * 1], tmm3",
            p0 = in(reg) p[0],
            p1 = in(reg) p[1],
            p2 = in(reg) p[2],
            p3 = in(reg) p[3],
            s = in(reg) stride,
            options(nostack)
        )
    };
}

/// Loads accumulator tile t (0–3) from `p[t]`, its 16 rows `stride` bytes apart.
///
/// # Safety
/// As [`store_accumulators_at`], for reads.
#[inline(always)]
pub(super) unsafe fn load_accumulators_at(p: [*const u8; 4], stride: usize) {
    // SAFETY: the caller's promise.
    unsafe {
        asm!(
            "tileloadd tmm0, [{p0} + {s} * 1]",
            "tileloadd tmm1, [{p1} + {s} * 1]",
            "tileloadd tmm2, [{p2} + {s} * 1]",
            "tileloadd tmm3, [{p3} + {s} * 1]",
            p0 = in(reg) p[0],
            p1 = in(reg) p[1],
            p2 = in(reg) p[2],
            p3 = in(reg) p[3],
            s = in(reg) stride,
            options(nostack, readonly)
        )
    };
}
