//! AMX version of the W4A8 kernel for many activation rows (prefill): the same integers and
//! the same f32 steps as the AVX-512 kernel (parent module), so the same bits.
//!
//! `tdpbssd` multiplies signed bytes by signed bytes: tile A holds activation rows as they
//! are, tile B a 16-column tile's weights `q − z`, in the layout `tdpbssd` reads: row r of B
//! is inputs 4r…4r + 3 of every column, which is exactly the low (even r) or high (odd r)
//! nibbles of one 64-byte octet of the packed layout. Σ a·(q − z) per block is the recipe's
//! integer, exact in i32; the per-block epilogue is the AVX-512 kernel's.
//!
//! One step: 2 × 16 activation rows by 2 × 16 columns (tiles 0–3 accumulate, 4–5 hold
//! activations, 6–7 weights), 64 inputs deep. The two column tiles are adjacent tiles of one
//! weight, or the same tile of `gate_proj` and `up_proj` (then only GELU(gate) ⊙ up is
//! stored). The activations are quantized into tiles once per call; per row chunk each job
//! expands a block of its pair's weights to bytes in an L1 buffer just before the block's
//! first 32-row block, and reuses it for the chunk's other row blocks.
//!
//! The loop issues the next unit's tile products before the previous unit's f32 epilogue,
//! from two accumulator buffers, so that an out-of-order core may overlap them (measured on
//! the Xeon of docs/BENCHMARKS.md: they still do not; the order costs nothing).
//!
//! Tile instructions are inline `asm!`; configuration and release in [`crate::kernels::amx`].

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::{self, block_scales, block_step, column_mask};
use super::{PackedW4A8, TILE};
use crate::kernels::amx::{self, Aligned};
use crate::kernels::avx512_util::round_bf16_ps;
use crate::kernels::gelu::gelu_mul;
use crate::kernels::par::ColumnsOut;
use crate::kernels::w4::Zeros;

/// Inputs per tile step (64 bytes per tile row).
const DEPTH: usize = 64;
/// Activation rows per step: two tiles of 16.
pub(super) const ROWS: usize = 32;
/// One accumulator set: four 16 × 16 i32 tiles.
const ACC: usize = 4 * 16 * TILE;

/// Whether the AMX kernel takes `p`: blocks of whole tile steps.
pub(super) fn takes(p: &PackedW4A8) -> bool {
    p.simd_ok && p.bk.is_multiple_of(DEPTH)
}

/// Activation rows quantized (steps 1–2 of the recipe) straight into `tdpbssd`'s A operand,
/// tile by tile: per 16 rows and 64 inputs one contiguous 1 KiB tile (16 rows of 64 bytes), so
/// a tile load reads consecutive lines. Rows are padded with zeros to a multiple of [`ROWS`]
/// (computed, never stored).
pub(super) struct TiledRows {
    tiles: Aligned<i8>,
    steps: usize,
    m: usize,
    /// Per-row activation scale.
    sa: Vec<f32>,
}

impl TiledRows {
    /// `round`: of `x` rounded to bf16 (as it is read).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL on this CPU; `k` a multiple of [`DEPTH`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn quantize(x: &[f32], m: usize, k: usize, round: bool) -> Self {
        use rayon::prelude::*;
        assert!(k.is_multiple_of(DEPTH) && x.len() == m * k);
        let steps = k / DEPTH;
        let blocks = m.div_ceil(16);
        let mut tiles = Aligned::new(blocks.next_multiple_of(ROWS / 16) * steps * 16 * DEPTH);
        let mut sa = vec![0f32; m];
        let fill = |row: &mut Vec<i8>, ((rb, t), sa): ((usize, &mut [i8]), &mut [f32])| {
            row.resize(k, 0);
            for (i, sa) in sa.iter_mut().enumerate() {
                let r = 16 * rb + i;
                // SAFETY: the caller checked AVX-512; k is whole 16-value vectors. (The
                // activation sum it also returns is for the zero-point correction, which
                // the tiles do not need.)
                let segs = std::iter::once(0..k);
                *sa = unsafe {
                    avx512::quantize_row_rounding(round, &x[r * k..][..k], row, segs, &mut [0])
                };
                for (st, src) in row.chunks_exact(DEPTH).enumerate() {
                    t[(st * 16 + i) * DEPTH..][..DEPTH].copy_from_slice(src);
                }
            }
        };
        tiles
            .par_chunks_mut(steps * 16 * DEPTH)
            .enumerate()
            .zip(sa.par_chunks_mut(16))
            .for_each_init(Vec::new, fill);
        TiledRows {
            tiles,
            steps,
            m,
            sa,
        }
    }

    /// Tile (rows 16·rb…, inputs 64·st…).
    fn tile(&self, rb: usize, st: usize) -> *const i8 {
        self.tiles[(rb * self.steps + st) * 16 * DEPTH..].as_ptr()
    }
}

/// Activation bytes per row chunk: a chunk's packed rows stay in L2 while every column tile
/// pair of the job passes over them. (Small in tests, so that they cross chunks.)
const CHUNK_BYTES: usize = if cfg!(test) { 1 << 16 } else { 1 << 20 };
/// At most this many rows per chunk: their f32 outputs for a tile pair (128 B a row) stay in L1.
const MAX_CHUNK_ROWS: usize = 128;

/// The two column tiles each step multiplies, and how the pair's outputs are stored.
#[derive(Clone, Copy)]
pub(super) enum Pairs<'a> {
    /// Pair q: tiles 2q and 2q + 1 of one weight, each stored as its 16 output columns.
    Adjacent(&'a PackedW4A8),
    /// Pair q: tile q of `gate_proj` and of `up_proj` (same shape and groups), stored as
    /// GELU(gate) ⊙ up in columns 16q… (the input of `down_proj`).
    GeluMul(&'a PackedW4A8, &'a PackedW4A8),
}

impl<'a> Pairs<'a> {
    /// How many pairs there are.
    pub(super) fn count(&self) -> usize {
        match self {
            Pairs::Adjacent(p) => p.tiles.div_ceil(2),
            Pairs::GeluMul(g, _) => g.tiles,
        }
    }

    /// The weight that gives the shape (both have it).
    fn shape(&self) -> &'a PackedW4A8 {
        match self {
            Pairs::Adjacent(p) | Pairs::GeluMul(p, _) => p,
        }
    }

    /// Pair `q`'s two (weight, column tile); `None` past the last tile.
    fn get(&self, q: usize) -> [Option<(&'a PackedW4A8, usize)>; 2] {
        match *self {
            Pairs::Adjacent(p) => [2 * q, 2 * q + 1].map(|t| (t < p.tiles).then_some((p, t))),
            Pairs::GeluMul(g, u) => [Some((g, q)), Some((u, q))],
        }
    }
}

/// Pairs `range` of `y` for all activation rows; `ar` from [`TiledRows::quantize`].
///
/// Loops: row chunks of about [`CHUNK_BYTES`] (outer), column tile pairs, then the (block,
/// 32-row block) units of the chunk, block-major (a block's weights expanded at its first unit):
/// the recipe's f32 epilogue needs each block's integer sums, so per unit the accumulator
/// tiles are stored, and the unit's epilogue runs after the next unit's tile products are
/// issued.
///
/// # Safety
/// The CPU has AMX-INT8 and AVX-512 F/BW/VL/VNNI, the OS granted this process tile state
/// ([`Isa::Amx`](crate::kernels::isa::Isa::Amx)), [`takes`] both weights of `pairs`, and the
/// job owns the output columns of `range`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn w4a8_tiles(
    pairs: Pairs<'_>,
    ar: &TiledRows,
    range: Range<usize>,
    out: &ColumnsOut,
) {
    let p = pairs.shape();
    if let Pairs::GeluMul(g, u) = pairs {
        assert!((g.n, g.k, g.g, g.bk) == (u.n, u.k, u.g, u.bk) && takes(u));
    }
    assert!(takes(p) && range.end <= pairs.count() && ar.steps == p.k / DEPTH);
    assert!(ar.tiles.len() >= ar.m.next_multiple_of(ROWS) * p.k);
    let blocks = p.k / p.bk;
    let per_block = p.bk / DEPTH;
    let chunk_rows = (CHUNK_BYTES / p.k / ROWS).clamp(1, MAX_CHUNK_ROWS / ROWS) * ROWS;
    // One block of two column tiles' weights as bytes, [block parity][tile][step][16 rows][64]:
    // expanded just before the block's first unit, into L1, while the tiles may still read the
    // previous block's.
    let wlen = per_block * 16 * DEPTH;
    let mut wb = Aligned::<i8>::new(2 * 2 * wlen);
    // Two accumulator sets: one being filled by the tiles, one read by the epilogue.
    let mut cbuf = Aligned::<i32>::new(2 * ACC);
    let mut o: Vec<[__m512; 2]> = Vec::with_capacity(chunk_rows);
    // GELU ⊙ up: the chunk's gate and up outputs of a pair, [row][16].
    let mut gu = match pairs {
        Pairs::GeluMul(..) => (vec![0f32; chunk_rows * TILE], vec![0f32; chunk_rows * TILE]),
        Pairs::Adjacent(_) => (Vec::new(), Vec::new()),
    };
    // SAFETY: the caller checked AMX and the grant.
    unsafe { amx::configure() };
    for c0 in (0..ar.m).step_by(chunk_rows) {
        let c1 = (c0 + chunk_rows).min(ar.m);
        let row_blocks = (c1 - c0).div_ceil(ROWS);
        for q in range.clone() {
            let pair = pairs.get(q);
            // f32 outputs of the chunk's rows for the pair: [row][column tile].
            o.clear();
            o.resize(c1 - c0, [_mm512_setzero_ps(); 2]);
            // Unit u = (block u / row_blocks, rows c0 + 32·(u % row_blocks)…): a block's
            // weight tiles (4 KiB at G = 128) stay in L1 while every row block passes.
            let units = blocks * row_blocks;
            let unit = |u: usize| (u / row_blocks, c0 + (u % row_blocks) * ROWS);
            for u in 0..=units {
                if u < units {
                    let (b, r0) = unit(u);
                    let wp = b % 2 * 2 * wlen;
                    if u % row_blocks == 0 {
                        for (j, tile) in pair.iter().enumerate() {
                            let w = &mut wb[wp + j * wlen..][..wlen];
                            match *tile {
                                // SAFETY: tile < pw.tiles, b a block; `w` holds the block's steps.
                                Some((pw, tile)) => unsafe { expand(pw, tile, b, w) },
                                None => w.fill(0),
                            }
                        }
                    }
                    // SAFETY: tiles 0–3 are configured; their previous unit was stored.
                    unsafe { amx::zero_accumulators() };
                    for (i, st) in (b * per_block..(b + 1) * per_block).enumerate() {
                        // SAFETY: row blocks r0/16 and r0/16 + 1 exist (padded to ROWS);
                        // every tile is 16 rows of 64 bytes.
                        unsafe {
                            let b0 = wb.as_ptr().add(wp + i * 16 * DEPTH);
                            asm!(
                                "tileloadd tmm4, [{a0} + {s} * 1]",
                                "tileloadd tmm6, [{b0} + {s} * 1]",
                                "tdpbssd tmm0, tmm4, tmm6",
                                "tileloadd tmm7, [{b1} + {s} * 1]",
                                "tdpbssd tmm1, tmm4, tmm7",
                                "tileloadd tmm5, [{a1} + {s} * 1]",
                                "tdpbssd tmm2, tmm5, tmm6",
                                "tdpbssd tmm3, tmm5, tmm7",
                                a0 = in(reg) ar.tile(r0 / 16, st),
                                a1 = in(reg) ar.tile(r0 / 16 + 1, st),
                                b0 = in(reg) b0,
                                b1 = in(reg) b0.add(wlen),
                                s = in(reg) DEPTH,
                                options(nostack, readonly)
                            );
                        }
                    }
                }
                if u > 0 {
                    // The previous unit's epilogue, while the tiles compute this one.
                    let (b, r0) = unit(u - 1);
                    let acc = &cbuf[(u - 1) % 2 * ACC..][..ACC];
                    for (ci, tile) in acc.chunks_exact(16 * TILE).enumerate() {
                        let (half, j) = (ci / 2, ci % 2);
                        let Some((pw, col_tile)) = pair[j] else {
                            continue;
                        };
                        let r = r0 + 16 * half;
                        if r >= c1 {
                            continue;
                        }
                        let slot = (col_tile * p.groups + b * p.bk / p.g) * TILE;
                        // SAFETY: slot is a tile's group: 16 scales.
                        let scale = unsafe { block_scales(pw, slot) };
                        for (row, (o, &sa)) in tile
                            .chunks_exact(TILE)
                            .zip(o[r - c0..].iter_mut().zip(&ar.sa[r..c1]))
                        {
                            // SAFETY: 16 i32 per row.
                            let acc = unsafe { _mm512_loadu_si512(row.as_ptr() as *const __m512i) };
                            o[j] = block_step(acc, sa, scale, o[j]);
                        }
                    }
                }
                if u < units {
                    // SAFETY: each set holds four 16 × 16 i32 tiles, rows 64 bytes apart.
                    unsafe { amx::store_accumulators(cbuf[u % 2 * ACC..].as_mut_ptr() as *mut u8) };
                }
            }
            // SAFETY: as for this function; the job owns pair q's columns.
            unsafe { store_pair(pairs, q, &o, c0, out, &mut gu) };
        }
    }
    // SAFETY: releases the tile state this function configured.
    unsafe { amx::release() };
}

/// Store pair `q`'s f32 outputs `o` of the chunk's rows `c0…`: each column tile rounded to
/// bf16, or GELU(gate) ⊙ up for [`Pairs::GeluMul`] (`gu` is its scratch). Once per pair and
/// chunk, outside the tile loop.
///
/// # Safety
/// As for [`w4a8_tiles`]: AVX-512 F/BW/VL, and the job owns pair `q`'s output columns.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn store_pair(
    pairs: Pairs<'_>,
    q: usize,
    o: &[[__m512; 2]],
    c0: usize,
    out: &ColumnsOut,
    gu: &mut (Vec<f32>, Vec<f32>),
) {
    let pair = pairs.get(q);
    match pairs {
        Pairs::Adjacent(_) => {
            for (j, tile) in pair.iter().enumerate() {
                let Some((pw, tile)) = *tile else { continue };
                let mask = column_mask(pw, tile);
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
        Pairs::GeluMul(g, _) => {
            // Both outputs rounded to bf16 as the kernel stores them, then the same
            // `gelu_mul` a separate pass would run.
            let (gs, us) = (&mut gu.0[..o.len() * TILE], &mut gu.1[..o.len() * TILE]);
            for ((o, gr), ur) in o
                .iter()
                .zip(gs.chunks_exact_mut(TILE))
                .zip(us.chunks_exact_mut(TILE))
            {
                // SAFETY: 16 values each.
                unsafe {
                    _mm512_storeu_ps(gr.as_mut_ptr(), round_bf16_ps(o[0]));
                    _mm512_storeu_ps(ur.as_mut_ptr(), round_bf16_ps(o[1]));
                }
            }
            gelu_mul(gs, us);
            let mask = column_mask(g, q);
            for (r, gr) in gs.chunks_exact(TILE).enumerate() {
                // SAFETY: this job owns the tile's columns; the mask keeps to n.
                unsafe {
                    _mm512_mask_storeu_ps(
                        out.ptr_at(c0 + r, q * TILE),
                        mask,
                        _mm512_loadu_ps(gr.as_ptr()),
                    )
                };
            }
        }
    }
}

/// Block `b` of column tile `tile`'s weights as signed bytes `q − z` in `tdpbssd`'s B layout
/// (per tile step 16 rows of 64 bytes: row r = inputs 4r…4r + 3 of the 16 columns).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn expand(p: &PackedW4A8, tile: usize, b: usize, w: &mut [i8]) {
    let low4 = _mm512_set1_epi8(0x0F);
    let octets = p.bk / 8;
    assert!(w.len() == octets * 128);
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
    for i in 0..octets {
        // SAFETY: octet b·octets + i of the tile exists; `w` holds two rows of 64 bytes per
        // octet (the assert).
        unsafe {
            let v = _mm512_loadu_si512(
                p.nib.as_ptr().add((tile * p.octets + b * octets + i) * 64) as *const __m512i
            );
            let lo = _mm512_sub_epi8(_mm512_and_si512(v, low4), z);
            let hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16::<4>(v), low4), z);
            _mm512_storeu_si512(w.as_mut_ptr().add(i * 128) as *mut __m512i, lo);
            _mm512_storeu_si512(w.as_mut_ptr().add(i * 128 + 64) as *mut __m512i, hi);
        }
    }
}
