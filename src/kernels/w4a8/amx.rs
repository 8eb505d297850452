//! AMX version of the W4A8 kernel for many activation rows (prefill): the same integers and
//! the same f32 steps as the AVX-512 kernel (parent module), so the same bits.
//!
//! `tdpbusd` multiplies unsigned bytes (tile A) by signed bytes (tile B). A holds activation
//! rows, `a + 128` as unsigned bytes; B holds a 16-column tile's weights `q − z` as signed
//! bytes, in the layout `tdpbusd` reads: row r of B is inputs 4r…4r + 3 of every column, which
//! is exactly the low (even r) or high (odd r) nibbles of one 64-byte octet of the packed
//! layout. Then Σ (a + 128)(q − z) − 128·Σ (q − z) = Σ a·(q − z), the recipe's integer per
//! block, exact in i32; the per-block epilogue is the AVX-512 kernel's.
//!
//! One step: 2 × 16 activation rows by 2 × 16 columns (tiles 0–3 accumulate, 4–5 hold
//! activations, 6–7 weights), 64 inputs deep. The activations are packed tile by tile once
//! per call; each job expands a column tile pair's weights to bytes once per row chunk and
//! reuses them for every 32-row block of it.
//!
//! Tile instructions are inline `asm!`; configuration and release in [`crate::kernels::amx`].

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::{block_scales, block_step, column_mask};
use super::{Acts, PackedW4A8, TILE};
use crate::kernels::amx::{self, Aligned};
use crate::kernels::avx512_util::round_bf16_ps;
use crate::kernels::par::ColumnsOut;
use crate::kernels::w4::Zeros;

/// Inputs per tile step (64 bytes per tile row).
const DEPTH: usize = 64;
/// Activation rows per step: two tiles of 16.
pub(super) const ROWS: usize = 32;

/// Whether the AMX kernel takes `p`: blocks of whole tile steps.
pub(super) fn takes(p: &PackedW4A8) -> bool {
    p.simd_ok && p.bk.is_multiple_of(DEPTH)
}

/// Activation rows as `tdpbusd`'s unsigned operand, a + 128, packed tile by tile: per 16 rows
/// and 64 inputs one contiguous 1 KiB tile (16 rows of 64 bytes), so a tile load reads
/// consecutive lines. Rows are padded to a multiple of [`ROWS`] (computed, never stored).
pub(super) struct UnsignedRows {
    tiles: Aligned<u8>,
    steps: usize,
}

impl UnsignedRows {
    pub(super) fn new(acts: &Acts, k: usize) -> Self {
        use rayon::prelude::*;
        let steps = k / DEPTH;
        let blocks = acts.m.div_ceil(16);
        let mut tiles = Aligned::new(blocks.next_multiple_of(ROWS / 16) * steps * 16 * DEPTH);
        tiles.fill(128);
        let fill = |(rb, t): (usize, &mut [u8])| {
            for i in 0..16.min(acts.m.saturating_sub(16 * rb)) {
                let row = &acts.a[(16 * rb + i) * acts.stride..][..k];
                for (st, src) in row.chunks_exact(DEPTH).enumerate() {
                    let dst = &mut t[(st * 16 + i) * DEPTH..][..DEPTH];
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = (*s as u8) ^ 0x80;
                    }
                }
            }
        };
        tiles
            .par_chunks_mut(steps * 16 * DEPTH)
            .enumerate()
            .for_each(fill);
        UnsignedRows { tiles, steps }
    }

    /// Tile (rows 16·rb…, inputs 64·st…).
    fn tile(&self, rb: usize, st: usize) -> *const u8 {
        self.tiles[(rb * self.steps + st) * 16 * DEPTH..].as_ptr()
    }
}

/// Activation bytes per row chunk: a chunk's packed rows stay in L2 while every column tile
/// pair of the job passes over them. (Small in tests, so that they cross chunks.)
const CHUNK_BYTES: usize = if cfg!(test) { 1 << 16 } else { 1 << 20 };
/// At most this many rows per chunk: their f32 outputs for a tile pair (128 B a row) stay in L1.
const MAX_CHUNK_ROWS: usize = 128;

/// Tiles `tiles` of `y` for all activation rows; `au` from [`UnsignedRows::new`].
///
/// Loops: row chunks of about [`CHUNK_BYTES`] (outer), column tile pairs (their weights
/// expanded once per chunk), 32-row blocks, then the recipe's blocks along k, whose
/// f32 epilogue needs each block's integer sums: the accumulator tiles are stored and
/// zeroed per block.
///
/// # Safety
/// The CPU has AMX-INT8 and AVX-512 F/BW/VL/VNNI, the OS granted this process tile state
/// ([`Isa::Amx`](crate::kernels::isa::Isa::Amx)), [`takes`]`(p)`, and the job owns `tiles`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn w4a8_tiles(
    p: &PackedW4A8,
    acts: &Acts,
    au: &UnsignedRows,
    tiles: Range<usize>,
    out: &ColumnsOut,
) {
    assert!(takes(p) && tiles.end <= p.tiles && au.steps == p.k / DEPTH);
    assert!(au.tiles.len() >= acts.m.next_multiple_of(ROWS) * p.k);
    let (steps, blocks) = (p.k / DEPTH, p.k / p.bk);
    let per_block = p.bk / DEPTH;
    let chunk_rows = (CHUNK_BYTES / p.k / ROWS).clamp(1, MAX_CHUNK_ROWS / ROWS) * ROWS;
    // Two column tiles' weights as bytes, [tile][step][16 rows][64], and 128·Σ(q − z) per
    // tile, block and column.
    let mut wb = Aligned::<i8>::new(2 * steps * 16 * DEPTH);
    let mut corr = vec![_mm512_setzero_si512(); 2 * blocks];
    let mut cbuf = Aligned::<i32>::new(4 * 16 * TILE);
    let mut o: Vec<[__m512; 2]> = Vec::with_capacity(chunk_rows);
    // SAFETY: the caller checked AMX and the grant.
    unsafe { amx::configure() };
    for c0 in (0..acts.m).step_by(chunk_rows) {
        let c1 = (c0 + chunk_rows).min(acts.m);
        for t in tiles.clone().step_by(2) {
            let pair = [t, t + 1].map(|u| (u < tiles.end).then_some(u));
            for (j, tile) in pair.iter().enumerate() {
                let w = &mut wb[j * steps * 16 * DEPTH..(j + 1) * steps * 16 * DEPTH];
                let c = &mut corr[j * blocks..(j + 1) * blocks];
                match tile {
                    // SAFETY: tile < p.tiles; `w` holds steps·16·64 bytes, `c` one per block.
                    Some(tile) => unsafe { expand(p, *tile, w, c) },
                    None => {
                        w.fill(0);
                        c.fill(_mm512_setzero_si512());
                    }
                }
            }
            // f32 outputs of the chunk's rows for the pair: [row][column tile].
            o.clear();
            o.resize(c1 - c0, [_mm512_setzero_ps(); 2]);
            // Block-major: a block's weight tiles (4 KiB at G = 128) stay in L1 while every
            // row block of the chunk passes.
            for b in 0..blocks {
                for r0 in (c0..c1).step_by(ROWS) {
                    // SAFETY: tiles 0–3 are configured.
                    unsafe { amx::zero_accumulators() };
                    for st in b * per_block..(b + 1) * per_block {
                        // SAFETY: row blocks r0/16 and r0/16 + 1 exist (padded to ROWS);
                        // every tile is 16 rows of 64 bytes.
                        unsafe {
                            let b0 = wb.as_ptr().add(st * 16 * DEPTH);
                            asm!(
                                "tileloadd tmm4, [{a0} + {s} * 1]",
                                "tileloadd tmm6, [{b0} + {s} * 1]",
                                "tdpbusd tmm0, tmm4, tmm6",
                                "tileloadd tmm7, [{b1} + {s} * 1]",
                                "tdpbusd tmm1, tmm4, tmm7",
                                "tileloadd tmm5, [{a1} + {s} * 1]",
                                "tdpbusd tmm2, tmm5, tmm6",
                                "tdpbusd tmm3, tmm5, tmm7",
                                a0 = in(reg) au.tile(r0 / 16, st),
                                a1 = in(reg) au.tile(r0 / 16 + 1, st),
                                b0 = in(reg) b0,
                                b1 = in(reg) b0.add(steps * 16 * DEPTH),
                                s = in(reg) DEPTH,
                                options(nostack, readonly)
                            );
                        }
                    }
                    // SAFETY: `cbuf` holds four 16 × 16 i32 tiles, rows 64 bytes apart.
                    unsafe { amx::store_accumulators(cbuf.as_mut_ptr() as *mut u8) };
                    // The AVX-512 kernel's epilogue, per row and column tile.
                    for (ci, tile) in cbuf.chunks_exact(16 * TILE).enumerate() {
                        let (half, j) = (ci / 2, ci % 2);
                        let Some(col_tile) = pair[j] else { continue };
                        let slot = (col_tile * p.groups + b * p.bk / p.g) * TILE;
                        // SAFETY: slot is a tile's group: 16 scales.
                        let scale = unsafe { block_scales(p, slot) };
                        let corr = corr[j * blocks + b];
                        let r = r0 + 16 * half;
                        if r >= c1 {
                            continue;
                        }
                        for (row, (o, &sa)) in tile
                            .chunks_exact(TILE)
                            .zip(o[r - c0..].iter_mut().zip(&acts.sa[r..c1]))
                        {
                            // SAFETY: 16 i32 per row.
                            let acc = unsafe { _mm512_loadu_si512(row.as_ptr() as *const __m512i) };
                            o[j] = block_step(_mm512_sub_epi32(acc, corr), sa, scale, o[j]);
                        }
                    }
                }
            }
            for (j, tile) in pair.iter().enumerate() {
                let Some(tile) = *tile else { continue };
                let mask = column_mask(p, tile);
                for (r, o) in o.iter().enumerate() {
                    // SAFETY: this job owns the tile's columns; the mask keeps to n.
                    unsafe {
                        _mm512_mask_storeu_ps(
                            out.ptr_at(c0 + r, tile * TILE),
                            mask,
                            round_bf16_ps(o[j]),
                        )
                    };
                }
            }
        }
    }
    // SAFETY: releases the tile state this function configured.
    unsafe { amx::release() };
}

/// Column tile `tile`'s weights as signed bytes `q − z` in `tdpbusd`'s B layout (per tile
/// step 16 rows of 64 bytes: row r = inputs 4r…4r + 3 of the 16 columns), and
/// 128·Σ(q − z) per block and column.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn expand(p: &PackedW4A8, tile: usize, w: &mut [i8], corr: &mut [__m512i]) {
    let low4 = _mm512_set1_epi8(0x0F);
    let ones = _mm512_set1_epi8(1);
    let octets_per_block = p.bk / 8;
    for (b, corr) in corr.iter_mut().enumerate() {
        let slot = (tile * p.groups + b * p.bk / p.g) * TILE;
        // z of each column in every byte of its 32-bit lane.
        let z = match &p.zeros {
            Zeros::Uniform(z) => _mm512_set1_epi8(*z as i8),
            Zeros::PerGroup(zs) => {
                // SAFETY: 16 zero points per slot.
                let z = unsafe {
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(zs.as_ptr().add(slot) as *const __m128i))
                };
                _mm512_mullo_epi32(z, _mm512_set1_epi32(0x0101_0101))
            }
        };
        let mut sum = _mm512_setzero_si512();
        for oc in b * octets_per_block..(b + 1) * octets_per_block {
            // SAFETY: oc < octets of the tile; `w` holds two rows of 64 bytes per octet.
            unsafe {
                let v = _mm512_loadu_si512(
                    p.nib.as_ptr().add((tile * p.octets + oc) * 64) as *const __m512i
                );
                let lo = _mm512_sub_epi8(_mm512_and_si512(v, low4), z);
                let hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16::<4>(v), low4), z);
                _mm512_storeu_si512(w.as_mut_ptr().add(oc * 128) as *mut __m512i, lo);
                _mm512_storeu_si512(w.as_mut_ptr().add(oc * 128 + 64) as *mut __m512i, hi);
                sum = _mm512_dpbusd_epi32(sum, ones, lo);
                sum = _mm512_dpbusd_epi32(sum, ones, hi);
            }
        }
        *corr = _mm512_slli_epi32::<7>(sum);
    }
}
