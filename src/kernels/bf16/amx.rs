//! AMX-BF16 version of the slice GEMM behind [`bf16_act_panel_matmul`](super::bf16_act_panel_matmul)
//! and [`gram_bf16`](super::gram_bf16), for blocks of 32 activation rows.
//!
//! `tdpbf16ps` computes `C[m][n] += A[m][2p]·B[p][2n] + A[m][2p+1]·B[p][2n+1]` over 16 pairs p
//! per tile: A holds 16 activation rows of 32 bf16 ([`TiledRows`]), B
//! row p holds input pair p of 16 columns — exactly one 64-byte row of the packed slice
//! ([`pack_bf16_slice`](super::avx512::pack_bf16_slice)), so a B tile is 1 KiB of the slice
//! as it lies. Products of two bf16 are exact in f32 and the sums are f32, as in the
//! `vdpbf16ps` kernel; the order of the sums differs, and the tile unit treats subnormal
//! inputs as zero and flushes subnormal sums (values below 1.2e-38, far under anything a
//! linear or a Gram matrix of activations produces).
//!
//! One step: 2 × 16 rows by the slice's 2 × 16 columns (tiles 0–3 accumulate, 4–5 hold
//! activations, 6–7 weights), 32 inputs deep; the loops are at [`bf16_gemm_slices`].

use std::arch::asm;
use std::ops::Range;

use super::avx512::{SliceCols, GEMM_SLICE};
use crate::kernels::amx::{self, Aligned};
use crate::kernels::par::ColumnsOut;

/// Inputs per tile step (16 pairs).
const DEPTH: usize = 32;
/// Activation rows per step: two tiles of 16.
pub(super) const ROWS: usize = 32;

/// Whether the tile kernel takes a reduction of `k` inputs: whole tile steps only.
pub(super) fn takes(k: usize) -> bool {
    k.is_multiple_of(DEPTH)
}

/// `[m, k]` bf16 rows packed tile by tile: per 16 rows and 32 inputs one contiguous 1 KiB tile,
/// so a tile load reads consecutive lines (rows `2k` bytes apart would fall in one L1 set at
/// k = 2048 and evict each other). Zero rows pad m to whole 32-row blocks: every row goes
/// through the tiles, so a row's result does not depend on how many rows share the call.
pub(super) struct TiledRows {
    tiles: Aligned<u16>,
    steps: usize,
    /// The real rows (without the padding).
    rows: usize,
}

impl TiledRows {
    pub(super) fn new(xb: &[u16], m: usize, k: usize) -> Self {
        use rayon::prelude::*;
        assert!(takes(k) && xb.len() >= m * k);
        let steps = k / DEPTH;
        let mut tiles = Aligned::new(m.next_multiple_of(ROWS) * k);
        tiles
            .par_chunks_mut(16 * k)
            .enumerate()
            .for_each(|(rb, t)| {
                for i in 0..16.min(m.saturating_sub(16 * rb)) {
                    let row = &xb[(16 * rb + i) * k..][..k];
                    for (st, src) in row.chunks_exact(DEPTH).enumerate() {
                        t[(st * 16 + i) * DEPTH..][..DEPTH].copy_from_slice(src);
                    }
                }
            });
        TiledRows {
            tiles,
            steps,
            rows: m,
        }
    }

    /// The tiles of aᵀ for a row-major `a` (`[t, k]`) of bf16 values — a Gram's left operand:
    /// rows are a's k columns, the reduction its t tokens padded with zero tokens to whole steps.
    /// `None` when a value is not a bf16 value.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    pub(super) unsafe fn from_columns(a: &[f32], t: usize, k: usize) -> Option<Self> {
        use rayon::prelude::*;
        assert_eq!(a.len(), t * k);
        let t2 = t.next_multiple_of(DEPTH);
        let mut tiles = Aligned::new(k.next_multiple_of(ROWS) * t2);
        let stray = tiles
            .par_chunks_mut(16 * t2)
            .enumerate()
            // SAFETY: AVX-512F is the caller's promise; each block is whole steps.
            .map(|(rb, block)| unsafe { super::avx512::tile_columns(a, t, k, 16 * rb, block) })
            .reduce(|| 0, |x, y| x | y);
        (stray == 0).then_some(TiledRows {
            tiles,
            steps: t2 / DEPTH,
            rows: k,
        })
    }

    /// The real rows.
    pub(super) fn rows(&self) -> usize {
        self.rows
    }

    /// Tile (rows 16·rb…, inputs 32·st…).
    fn tile(&self, rb: usize, st: usize) -> *const u16 {
        self.tiles[(rb * self.steps + st) * 16 * DEPTH..].as_ptr()
    }
}

/// Tile steps of one pass of [`bf16_gemm_slices`] over the rows (2048 inputs): a longer
/// reduction goes in passes, so the group's slices for one pass fit L2 however long k is.
const PASS_STEPS: usize = 64;

/// Slices per call of [`bf16_gemm_slices`] for a reduction of `k`: as many as keep their packed
/// weights for one pass (64·min(k, 2048) bytes each) within 1 MiB of L2, at most 8.
pub(super) fn slices_per_group(k: usize) -> usize {
    ((1 << 20) / (64 * k.clamp(1, PASS_STEPS * DEPTH))).clamp(1, 8)
}

/// `y[r, c0..c0 + cols] = x[r] · slices` for rows `rows` of `a` (starting at a 32-row block),
/// for the packed slices of `job` ([`SliceCols`]); `acc` is the job's scratch the accumulator
/// tiles of partial blocks are stored to.
///
/// A reduction longer than [`PASS_STEPS`] goes in [`passes`] over the whole 32 × 32 blocks, the
/// last partial row block and partial slice in [`one_pass`]. Rows and columns are independent,
/// so which loop computes a block does not change its bits.
///
/// # Safety
/// The CPU has AMX-BF16 and the OS granted this process tile state
/// ([`Isa::Amx`](crate::kernels::isa::Isa::Amx)); the job owns columns `c0..c0 + cols`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn bf16_gemm_slices(
    a: &TiledRows,
    job: SliceCols,
    rows: Range<usize>,
    acc: &mut Aligned<f32>,
) {
    let SliceCols {
        slices,
        c0,
        cols,
        out,
    } = job;
    let per_slice = GEMM_SLICE * a.steps * DEPTH;
    assert!(slices.len().is_multiple_of(per_slice));
    let group = slices.len() / per_slice;
    assert!(cols <= group * GEMM_SLICE);
    assert!(rows.start.is_multiple_of(ROWS) && rows.end <= a.rows);
    // Every tile store and load below stays inside `out`.
    assert!(rows.end <= out.rows() && c0 + cols <= out.cols());
    if rows.is_empty() || cols == 0 {
        return;
    }
    // SAFETY: the caller checked AMX and the grant.
    unsafe { amx::configure() };
    if a.steps > PASS_STEPS {
        let whole_rows = rows.start..rows.start + rows.len() / ROWS * ROWS;
        let whole = cols / GEMM_SLICE;
        let head = &slices[..whole * per_slice];
        // SAFETY: as this function's, tiles configured; the blocks handed on lie inside the
        // job's rows and columns, whole for `passes`.
        unsafe {
            if whole > 0 && !whole_rows.is_empty() {
                passes(a, head, whole_rows.clone(), c0, whole, out);
            }
            if whole > 0 && whole_rows.end < rows.end {
                let job = SliceCols {
                    slices: head,
                    c0,
                    cols: whole * GEMM_SLICE,
                    out,
                };
                one_pass(a, job, whole_rows.end..rows.end, acc);
            }
            if whole * GEMM_SLICE < cols {
                let tail = &slices[whole * per_slice..(whole + 1) * per_slice];
                let job = SliceCols {
                    slices: tail,
                    c0: c0 + whole * GEMM_SLICE,
                    cols: cols - whole * GEMM_SLICE,
                    out,
                };
                one_pass(a, job, rows, acc);
            }
        }
    } else {
        // SAFETY: as above.
        unsafe { one_pass(a, job, rows, acc) };
    }
    // SAFETY: releases the tile state configured above.
    unsafe { amx::release() };
}

/// [`bf16_gemm_slices`] with the whole reduction per block. Loops: 32-row blocks (outer), then
/// the slices, each accumulating over all of k in tiles: the row block's activations stay in L2
/// while every slice of the group passes over them, and the group's weights stay in L2 from one
/// row block to the next. (Reloading the accumulators per k-chunk of 8 or 32 steps, to keep a
/// chunk in L1, measured no faster.) Whole 32 × 32 blocks are stored straight to `out`.
///
/// # Safety
/// As [`bf16_gemm_slices`], with tiles configured and the arguments checked there.
#[target_feature(enable = "avx512f")]
unsafe fn one_pass(a: &TiledRows, job: SliceCols, rows: Range<usize>, acc: &mut Aligned<f32>) {
    let SliceCols {
        slices,
        c0,
        cols,
        out,
    } = job;
    let (steps, k) = (a.steps, a.steps * DEPTH);
    let per_slice = GEMM_SLICE * k;
    let group = slices.len() / per_slice;
    // Per slice four 16 × 16 f32 tiles, rows 64 bytes apart.
    if acc.len() < group * 1024 {
        *acc = Aligned::new(group * 1024);
    }
    for r0 in rows.clone().step_by(ROWS) {
        let rb = r0 / 16;
        // Rows r0..r0 + 32 are computed (padding included); these are kept.
        let kept = (rows.end - r0).min(ROWS);
        for (si, slice) in slices.chunks_exact(per_slice).enumerate() {
            // SAFETY: tiles 0–3 are configured.
            unsafe { amx::zero_accumulators() };
            // SAFETY: tiles configured; row blocks rb, rb + 1 (padded) of `a`, all its steps.
            unsafe { block_steps(a, rb, slice, 0..steps) };
            if kept == ROWS && (si + 1) * GEMM_SLICE <= cols {
                // A whole 32 × 32 block: the tiles go straight to the output.
                // SAFETY: rows r0..r0 + 32 and columns c0 + 32·si… (32 of them) lie inside `out`
                // and belong to this job; tiles 0–3 are configured.
                unsafe {
                    let c = c0 + si * GEMM_SLICE;
                    amx::store_accumulators_at(block_at(out, r0, c), 4 * out.cols());
                }
                continue;
            }
            // SAFETY: `acc` holds this slice's four tiles (4 KiB); tiles 0–3 are configured.
            unsafe { amx::store_accumulators(acc[si * 1024..].as_mut_ptr() as *mut u8) };
        }
        // Tile 2·h + j of a slice holds rows r0 + 16·h…, its columns 16·j….
        for (si, tiles) in acc[..group * 1024].chunks_exact(1024).enumerate() {
            if kept == ROWS && (si + 1) * GEMM_SLICE <= cols {
                continue; // stored above
            }
            for (t, tile) in tiles.chunks_exact(256).enumerate() {
                let (h, j) = (t / 2, t % 2);
                let first = si * GEMM_SLICE + 16 * j;
                let valid = cols.saturating_sub(first).min(16);
                if valid == 0 {
                    continue;
                }
                for (i, row) in tile
                    .chunks_exact(16)
                    .enumerate()
                    .take(kept.saturating_sub(16 * h))
                {
                    // SAFETY: this job owns columns c0 + first… (valid of them) of every row.
                    unsafe { out.row_mut(r0 + 16 * h + i, c0 + first..c0 + first + valid) }
                        .copy_from_slice(&row[..valid]);
                }
            }
        }
    }
}

/// [`bf16_gemm_slices`] for a long reduction whose blocks are all whole (32 rows by the group's
/// 32-column slices): the reduction in passes of [`PASS_STEPS`], each over every row block, the
/// accumulators kept in the output between passes (stored and reloaded exactly, so the sums are
/// those of one pass). One pass's slices stay in L2 for all the rows, where whole slices of a long
/// reduction (416 KiB each at k = 6656) would let only two share L2 and the rows be read again
/// for every two.
///
/// # Safety
/// As [`bf16_gemm_slices`], with tiles configured; rows `rows` and columns `c0…c0 + 32·group` are
/// whole blocks inside `out`.
#[target_feature(enable = "avx512f")]
unsafe fn passes(
    a: &TiledRows,
    slices: &[u16],
    rows: Range<usize>,
    c0: usize,
    group: usize,
    out: &ColumnsOut,
) {
    let (steps, k) = (a.steps, a.steps * DEPTH);
    let per_slice = GEMM_SLICE * k;
    let stride = 4 * out.cols();
    for s0 in (0..steps).step_by(PASS_STEPS) {
        let s1 = (s0 + PASS_STEPS).min(steps);
        for r0 in rows.clone().step_by(ROWS) {
            let rb = r0 / 16;
            for (si, slice) in slices.chunks_exact(per_slice).take(group).enumerate() {
                let c = c0 + si * GEMM_SLICE;
                // SAFETY: the block (rows r0…r0 + 32, columns c…c + 32) lies inside `out` and
                // belongs to this job.
                let p = unsafe { block_at(out, r0, c) };
                // SAFETY: tiles 0–3 are configured; the first pass wrote the block the later
                // ones reload; row blocks rb, rb + 1 and steps s0..s1 lie inside `a`.
                unsafe {
                    if s0 == 0 {
                        amx::zero_accumulators();
                    } else {
                        amx::load_accumulators_at(p.map(|p| p as *const u8), stride);
                    }
                    block_steps(a, rb, slice, s0..s1);
                    amx::store_accumulators_at(p, stride);
                }
            }
        }
    }
}

/// The four tiles' places in `out` of the 32 × 32 block at (r0, c): rows 0–15 / 16–31 by columns
/// 0–15 / 16–31, in accumulator order (tile 2·h + j).
///
/// # Safety
/// The block lies inside `out` and belongs to the caller's job.
#[inline(always)]
unsafe fn block_at(out: &ColumnsOut, r0: usize, c: usize) -> [*mut u8; 4] {
    // SAFETY: the caller's promise.
    unsafe {
        [
            out.ptr_at(r0, c),
            out.ptr_at(r0, c + 16),
            out.ptr_at(r0 + 16, c),
            out.ptr_at(r0 + 16, c + 16),
        ]
        .map(|p| p as *mut u8)
    }
}

/// Tile steps `steps` of one 2 × 2 step block into tiles 0–3: row blocks `rb`, `rb + 1` of `a`
/// (tiles 4–5) by the two 16-column halves of `slice` (tiles 6–7), 32 inputs a step.
///
/// A tile load waits for the products that still read its tile: each of the next step's loads
/// is issued right after the last product reading its tile, so it is in flight while the others
/// run (the same products in the same order as loads at the top of each step; docs/BENCHMARKS.md
/// "AMX-BF16 tile loads after their last products").
///
/// # Safety
/// Tiles configured ([`amx::configure`]); row blocks `rb`, `rb + 1` (padding included) and the
/// steps lie inside `a`; `slice` is one whole packed slice of `a`'s depth.
#[inline(always)]
unsafe fn block_steps(a: &TiledRows, rb: usize, slice: &[u16], steps: Range<usize>) {
    let half = a.steps * DEPTH / 2;
    debug_assert!(slice.len() == GEMM_SLICE * 2 * half && steps.end <= a.steps);
    if steps.is_empty() {
        return;
    }
    // The step's four tiles: row blocks rb, rb + 1; B tiles are slice rows (pairs) 16·st… of
    // each 16-column half, 64 bytes apart, inside the slice.
    let tiles = |st: usize| {
        let b0 = slice[16 * st * 32..].as_ptr();
        [
            a.tile(rb, st),
            a.tile(rb + 1, st),
            b0,
            b0.wrapping_add(half * 32),
        ]
    };
    let [a0, a1, b0, b1] = tiles(steps.start);
    // SAFETY: the caller's promise: tiles configured, every tile below inside `a` and `slice`.
    unsafe {
        asm!(
            "tileloadd tmm4, [{a0} + {s} * 1]",
            "tileloadd tmm6, [{b0} + {s} * 1]",
            "tileloadd tmm7, [{b1} + {s} * 1]",
            "tileloadd tmm5, [{a1} + {s} * 1]",
            a0 = in(reg) a0,
            a1 = in(reg) a1,
            b0 = in(reg) b0,
            b1 = in(reg) b1,
            s = in(reg) 64usize,
            options(nostack, readonly)
        );
        for st in steps.start + 1..steps.end {
            let [a0, a1, b0, b1] = tiles(st);
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{a0} + {s} * 1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tileloadd tmm6, [{b0} + {s} * 1]",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm7, [{b1} + {s} * 1]",
                "tileloadd tmm5, [{a1} + {s} * 1]",
                a0 = in(reg) a0,
                a1 = in(reg) a1,
                b0 = in(reg) b0,
                b1 = in(reg) b1,
                s = in(reg) 64usize,
                options(nostack, readonly)
            );
        }
        asm!(
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            options(nostack, nomem)
        );
    }
}
