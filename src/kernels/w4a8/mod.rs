//! W4A8 from packed nibbles, bit-exact to vLLM's `int4_scaled_mm_cpu`
//! (docs/GPTQ_FORMAT.md §8, the scalar [`super::w4::w4a8_matmul`]).
//!
//! Layout (built at load, never on disk): output columns in tiles of 16; per
//! tile, per 8 input rows ("octet") 64 bytes where byte `4·lane + j` holds
//! q[lane][8o + j] in its low nibble and q[lane][8o + 4 + j] in its high one.
//! A 32-bit lane of a 512-bit load is then four weights of one column, the
//! shape `vpdpbusd` multiplies (unsigned weight bytes × signed activation
//! bytes, four products summed into one i32 lane per column).
//!
//! The integers are those of the recipe: per block of `bk = min(G, 128)`
//! inputs, Σ a·(q − z) = Σ a·q − z·Σ a, exact in i32 (|Σ| ≤ 127·16·128 <
//! 2²⁴, so `float(acc)` is exact too); the f32 steps `t = float(acc)·sa`,
//! `out = fma(t, s, out)` run per column in block order, then bf16 rounding.
//! Each SIMD lane does exactly those IEEE operations, so every tier gives
//! the same bits.

use std::ops::Range;

// The AVX-512 kernels index several register arrays ([stream][row]) by one counter.
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod avx512;

use super::isa::{isa, Isa};
use super::par::{for_ranges, ColumnsOut};
use rayon::prelude::*;

use super::w4::{
    prefault_for_writing, prefetch_run, round_bf16, spread4, Codes, W4Nibbles, Zeros, ROWS_AHEAD,
};

const TILE: usize = 16;

/// A `[n, k]` 4-bit weight packed for W4A8.
pub struct PackedW4A8 {
    n: usize,
    k: usize,
    g: usize,
    /// Inner block of the recipe, `min(g, 128)`.
    bk: usize,
    groups: usize,
    tiles: usize,
    /// `ceil(k / 8)`
    octets: usize,
    /// `[tiles][octets][64]`
    nib: Vec<u8>,
    /// bf16 bits `[tiles][groups][16]`
    scales: Vec<u16>,
    /// `[tiles][groups][16]`
    zeros: Zeros,
    /// Pieces of blocks with one zero point each: block b covers
    /// `segs[block_segs[b]..block_segs[b + 1]]`. One per block unless a
    /// block straddles groups (G > 128 and not a multiple of 128).
    segs: Vec<Seg>,
    block_segs: Vec<usize>,
    /// Whether the SIMD kernels apply: whole blocks of whole octets, one segment each.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    simd_ok: bool,
}

#[derive(Clone, Copy, Debug)]
struct Seg {
    k0: usize,
    k1: usize,
    group: usize,
}

/// Activation rows quantized once per call, shared by all jobs.
struct Acts {
    /// `[m][octets·8]`, zero padded.
    a: Vec<i8>,
    stride: usize,
    sa: Vec<f32>,
    /// Σ a over each segment, `[m][segs]` (= per block on the SIMD path).
    sums: Vec<i32>,
    nsegs: usize,
    m: usize,
}

/// One row's slots in [`Acts`]: index, ((int8 codes, scale), segment sums).
type ActRow<'a> = (usize, ((&'a mut [i8], &'a mut f32), &'a mut [i32]));

impl PackedW4A8 {
    pub fn pack(w: W4Nibbles) -> Self {
        w.check();
        let (n, k, g) = (w.n, w.k, w.g);
        let groups = w.groups();
        let bk = g.min(128);
        let tiles = n.div_ceil(TILE);
        let octets = k.div_ceil(8);
        let mut nib = vec![0u8; tiles * octets * 64];
        // One job per JOB_TILES tiles: with GPTQ words, each stored row is read as one run of
        // 4·JOB_TILES·16 bytes (one tile's run is a single cache line, and the rows are far apart).
        const JOB_TILES: usize = 8;
        nib.par_chunks_mut(JOB_TILES * octets * 64)
            .enumerate()
            .for_each_init(Vec::new, |q, (job, out)| {
                prefault_for_writing(out);
                let t0 = job * JOB_TILES;
                let cols = t0 * TILE..((t0 + JOB_TILES) * TILE).min(n);
                if let Codes::GptqWords { bytes, n_all, col0 } = w.q {
                    // A lane's 4 bytes hold the same 8 inputs as one GPTQ
                    // word, nibbles reordered (inputs j and j + 4 in byte j).
                    let c0 = col0 + cols.start;
                    for r in 0..octets {
                        let at = (r * n_all + c0) * 4;
                        let run = &bytes[at..at + cols.len() * 4];
                        // Stored rows are far apart: the hardware does not see the next run coming.
                        if r + ROWS_AHEAD < octets {
                            prefetch_run(bytes, ((r + ROWS_AHEAD) * n_all + c0) * 4, run.len());
                        }
                        for (t, src) in run.chunks(TILE * 4).enumerate() {
                            let dst = &mut out[(t * octets + r) * 64..][..src.len()];
                            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                                let word = u32::from_le_bytes(s.try_into().expect("4 bytes"));
                                let v = spread4(word) | (spread4(word >> 16) << 4);
                                d.copy_from_slice(&v.to_le_bytes());
                            }
                        }
                    }
                    return;
                }
                for (t, out) in out.chunks_mut(octets * 64).enumerate() {
                    let cols = (t0 + t) * TILE..((t0 + t + 1) * TILE).min(n);
                    q.resize(cols.len() * k, 0);
                    w.q.rows_into(k, cols.clone(), q);
                    for lane in 0..cols.len() {
                        for kk in 0..k {
                            let byte = (kk / 8) * 64 + lane * 4 + kk % 4;
                            out[byte] |= q[lane * k + kk] << (4 * ((kk % 8) / 4));
                        }
                    }
                }
            });
        // Slot (t, gi, lane) of the per-group arrays ↔ column 16t + lane, group gi (None: padding).
        let source = move |t: usize, gi: usize, lane: usize| {
            let col = t * TILE + lane;
            (col < n).then_some(col * groups + gi)
        };
        let slots = || {
            (0..tiles).flat_map(move |t| {
                (0..groups).flat_map(move |gi| (0..TILE).map(move |lane| source(t, gi, lane)))
            })
        };
        // Per tile in parallel: ≈ 11 M slots for a 1.7B model, on the load's critical path.
        let mut scales = vec![0u16; tiles * groups * TILE];
        scales
            .par_chunks_mut(groups * TILE)
            .enumerate()
            .for_each(|(t, st)| {
                for (j, s) in st.iter_mut().enumerate() {
                    *s = source(t, j / TILE, j % TILE)
                        .map_or(0, |i| half::bf16::from_f32(w.scales[i]).to_bits());
                }
            });
        let zeros = Zeros::new(w.zeros, slots());
        let mut segs = vec![];
        let mut block_segs = vec![0];
        for b0 in (0..k).step_by(bk) {
            let b1 = (b0 + bk).min(k);
            let mut s0 = b0;
            while s0 < b1 {
                let s1 = ((s0 / g + 1) * g).min(b1);
                segs.push(Seg {
                    k0: s0,
                    k1: s1,
                    group: s0 / g,
                });
                s0 = s1;
            }
            block_segs.push(segs.len());
        }
        let simd_ok = bk % 8 == 0 && k % bk == 0 && segs.len() == block_segs.len() - 1;
        PackedW4A8 {
            n,
            k,
            g,
            bk,
            groups,
            tiles,
            octets,
            nib,
            scales,
            zeros,
            segs,
            block_segs,
            simd_ok,
        }
    }

    /// Bytes held (weights, scales, zero points).
    pub fn bytes(&self) -> usize {
        self.nib.len() + 2 * self.scales.len() + self.zeros.bytes()
    }

    #[inline]
    fn q(&self, col: usize, kk: usize) -> u8 {
        let (t, lane) = (col / TILE, col % TILE);
        let byte = self.nib[(t * self.octets + kk / 8) * 64 + lane * 4 + kk % 4];
        (byte >> (4 * ((kk % 8) / 4))) & 15
    }

    #[inline]
    fn slot(&self, col: usize, gi: usize) -> usize {
        ((col / TILE) * self.groups + gi) * TILE + col % TILE
    }

    /// The effective weight `[n, k]`: c·s in f32 (exact), as the recipe uses it.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.n * self.k];
        for col in 0..self.n {
            for kk in 0..self.k {
                let sl = self.slot(col, kk / self.g);
                let c = self.q(col, kk) as i32 - self.zeros.get(sl);
                w[col * self.k + kk] = c as f32 * super::bf16::widen(self.scales[sl]);
            }
        }
        w
    }

    /// `y[m, n]` (bf16 values) from activation rows `x[m, k]` (bf16 values).
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_with(isa(), x, m, y);
    }

    /// [`matmul`](Self::matmul) of `x` rounded to bf16 first, the rounding done while the rows
    /// are quantized (no rounded copy of `x`; the same bits as rounding `x` beforehand).
    pub fn matmul_rounding(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_impl(isa(), x, m, y, true);
    }

    /// `y = GELU(gate(x)) ⊙ up(x)` for `x` rounded to bf16 (the input of `down_proj`): the bits
    /// of [`matmul_rounding`](Self::matmul_rounding) by each weight, then
    /// [`gelu_mul`](crate::kernels::gelu::gelu_mul), in one pass where a SIMD kernel applies:
    /// the rows are quantized once, a column tile of `gate` meets the same tile of `up` (on AMX
    /// from 32 rows, as a pair of tiles; on AVX-512 from 2 rows, as two 16-column strips over
    /// all rows), and only the product is stored (no separate outputs, no second pass).
    pub fn gelu_mul_rounding(gate: &Self, up: &Self, x: &[f32], m: usize, y: &mut [f32]) {
        Self::gelu_mul_with(isa(), gate, up, x, m, y);
    }

    /// [`gelu_mul_rounding`](Self::gelu_mul_rounding) on an explicit tier.
    pub fn gelu_mul_with(isa: Isa, gate: &Self, up: &Self, x: &[f32], m: usize, y: &mut [f32]) {
        assert_eq!((gate.n, gate.k), (up.n, up.k), "gate and up have one shape");
        assert_eq!((x.len(), y.len()), (m * gate.k, m * gate.n));
        #[cfg(target_arch = "x86_64")]
        if isa >= Isa::Amx
            && m >= amx::ROWS
            && amx::takes(gate)
            && amx::takes(up)
            && (gate.g, gate.bk) == (up.g, up.bk)
        {
            // SAFETY: as in `matmul_impl`.
            let ar = unsafe { amx::TiledRows::quantize(x, m, gate.k, true) };
            let out = ColumnsOut::new(y, m, gate.n);
            let pairs = amx::Pairs::GeluMul(gate, up);
            for_ranges(pairs.count(), 2 * gate.n * gate.k, |range| {
                // SAFETY: the tier was detected on this CPU; jobs own disjoint tiles.
                unsafe { amx::w4a8_tiles(pairs, &ar, range, &out) }
            });
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if isa.avx512() && gate.simd_ok && up.simd_ok && (gate.g, gate.bk) == (up.g, up.bk) && m > 1
        {
            let acts = gate.quantize_acts(isa, x, m, true);
            let out = ColumnsOut::new(y, m, gate.n);
            for_ranges(gate.tiles, 2 * gate.n * gate.k, |tiles| {
                // SAFETY: the tier was detected on this CPU; jobs own disjoint tiles.
                unsafe { avx512::w4a8_gelu_tiles(gate, up, &acts, tiles, &out) }
            });
            return;
        }
        let mut u = vec![0f32; y.len()];
        gate.matmul_impl(isa, x, m, y, true);
        up.matmul_impl(isa, x, m, &mut u, true);
        crate::kernels::gelu::gelu_mul(y, &u);
    }

    /// `ys[i] = x · ws[i]ᵀ` for `x` rounded to bf16, weights that share their input (q, k and v
    /// of a layer): the bits of [`matmul_rounding`](Self::matmul_rounding) by each weight. On AMX
    /// from 32 rows the rows are quantized once for all of them and one fan-out spreads every
    /// weight's column tiles over the threads; one call per weight otherwise.
    pub fn matmul_rounding_shared(ws: &[&Self], x: &[f32], m: usize, ys: &mut [&mut [f32]]) {
        Self::matmul_shared_with(isa(), ws, x, m, ys);
    }

    /// [`matmul_rounding_shared`](Self::matmul_rounding_shared) on an explicit tier.
    pub fn matmul_shared_with(isa: Isa, ws: &[&Self], x: &[f32], m: usize, ys: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), ys.len(), "one output per weight");
        #[cfg(target_arch = "x86_64")]
        if Self::amx_shared(isa, ws, x, m, ys, true) {
            return;
        }
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            w.matmul_impl(isa, x, m, y, true);
        }
    }

    /// `ys[i] = x · ws[i]ᵀ` on AMX tiles, the rows quantized once (`round`: `x` rounded to bf16
    /// as it is) and every weight's column tile pairs in one fan-out. Returns false (nothing
    /// done) where the tier, the row count or a weight's shape does not take tiles.
    #[cfg(target_arch = "x86_64")]
    fn amx_shared(
        isa: Isa,
        ws: &[&Self],
        x: &[f32],
        m: usize,
        ys: &mut [&mut [f32]],
        round: bool,
    ) -> bool {
        let Some(k) = ws.first().map(|w| w.k) else {
            return false;
        };
        if isa < Isa::Amx || m < amx::ROWS || !ws.iter().all(|w| amx::takes(w) && w.k == k) {
            return false;
        }
        assert_eq!(x.len(), m * k);
        // SAFETY: the tier (AMX, AVX-512) was detected on this CPU; takes() means k is whole
        // tile steps.
        let ar = unsafe { amx::TiledRows::quantize(x, m, k, round) };
        let outs: Vec<ColumnsOut> = ws
            .iter()
            .zip(ys.iter_mut())
            .map(|(w, y)| {
                assert_eq!(y.len(), m * w.n);
                ColumnsOut::new(y, m, w.n)
            })
            .collect();
        // Jobs of whole tile pairs (the kernel steps over two column tiles at a time); weight
        // i's pairs are units `ends[i - 1]..ends[i]` of one range.
        let ends: Vec<usize> = ws
            .iter()
            .scan(0, |end, w| {
                *end += amx::Pairs::Adjacent(w).count();
                Some(*end)
            })
            .collect();
        let total = ends.last().copied().unwrap_or(0);
        let work = ws.iter().map(|w| w.n * w.k).sum();
        for_ranges(total, work, |range| {
            for (i, w) in ws.iter().enumerate() {
                let base = if i == 0 { 0 } else { ends[i - 1] };
                let (a, b) = (range.start.max(base), range.end.min(ends[i]));
                if a < b {
                    // SAFETY: the tier was detected on this CPU; takes() holds for every weight;
                    // jobs own disjoint pairs of each weight.
                    unsafe {
                        amx::w4a8_tiles(amx::Pairs::Adjacent(w), &ar, a - base..b - base, &outs[i])
                    }
                }
            }
        });
        true
    }

    /// [`matmul`](Self::matmul) on an explicit tier (tests run every available one).
    pub fn matmul_with(&self, isa: Isa, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_impl(isa, x, m, y, false);
    }

    /// `round`: round `x` to bf16 as it is quantized ([`matmul_rounding`](Self::matmul_rounding)).
    fn matmul_impl(&self, isa: Isa, x: &[f32], m: usize, y: &mut [f32], round: bool) {
        assert_eq!((x.len(), y.len()), (m * self.k, m * self.n));
        if m == 0 || self.n == 0 {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if Self::amx_shared(isa, &[self], x, m, &mut [&mut *y], round) {
            return;
        }
        let acts = self.quantize_acts(isa, x, m, round);
        let out = ColumnsOut::new(y, m, self.n);
        for_ranges(self.tiles, self.n * self.k, |tiles| match isa {
            #[cfg(target_arch = "x86_64")]
            isa if isa.avx512() && self.simd_ok => {
                // SAFETY: the tier was detected on this CPU; jobs own disjoint tiles.
                unsafe { avx512::w4a8_tiles(self, &acts, tiles, &out) }
            }
            _ => self.tiles_portable(&acts, tiles, &out),
        });
    }

    /// Per-token dynamic symmetric int8 (steps 1–2 of the recipe) and the
    /// activation sums the zero-point correction needs; `round`: of `x` rounded to bf16.
    fn quantize_acts(&self, isa: Isa, x: &[f32], m: usize, round: bool) -> Acts {
        let k = self.k;
        let stride = self.octets * 8;
        let nsegs = self.segs.len();
        let mut a = vec![0i8; m * stride];
        let mut sa = vec![0f32; m];
        let mut sums = vec![0i32; m * nsegs];
        // Segments of whole 16-value vectors: the AVX-512 row quantizer applies.
        #[cfg(target_arch = "x86_64")]
        let simd = isa.avx512()
            && self
                .segs
                .iter()
                .all(|s| s.k0.is_multiple_of(16) && s.k1.is_multiple_of(16));
        #[cfg(not(target_arch = "x86_64"))]
        let _ = isa;
        let quantize = |row: &mut Vec<i32>, (r, ((ar, sar), sr)): ActRow| {
            #[cfg(target_arch = "x86_64")]
            if simd {
                let segs = self.segs.iter().map(|s| s.k0..s.k1);
                let x = &x[r * k..(r + 1) * k];
                // SAFETY: the tier was detected on this CPU; segments are whole vectors.
                *sar = unsafe { avx512::quantize_row_rounding(round, x, &mut ar[..k], segs, sr) };
                return;
            }
            row.resize(k, 0);
            let xr = &x[r * k..(r + 1) * k];
            *sar = if round {
                let xr: Vec<f32> = xr.iter().map(|v| round_bf16(*v)).collect();
                super::w4::quantize_activation_row(&xr, row)
            } else {
                super::w4::quantize_activation_row(xr, row)
            };
            for (d, v) in ar[..k].iter_mut().zip(row.iter()) {
                *d = *v as i8; // |v| ≤ 127
            }
            for (s, sum) in self.segs.iter().zip(sr.iter_mut()) {
                *sum = row[s.k0..s.k1].iter().sum();
            }
        };
        // Prefill rows in parallel; a decode row is too small to split.
        if m >= 8 {
            a.par_chunks_mut(stride)
                .zip(sa.par_iter_mut())
                .zip(sums.par_chunks_mut(nsegs.max(1)))
                .enumerate()
                .for_each_init(Vec::new, quantize);
        } else {
            let mut row = Vec::new();
            a.chunks_mut(stride)
                .zip(sa.iter_mut())
                .zip(sums.chunks_mut(nsegs.max(1)))
                .enumerate()
                .for_each(|item| quantize(&mut row, item));
        }
        Acts {
            a,
            stride,
            sa,
            sums,
            nsegs: self.segs.len(),
            m,
        }
    }

    fn tiles_portable(&self, acts: &Acts, tiles: Range<usize>, out: &ColumnsOut) {
        for t in tiles {
            let cols = t * TILE..((t + 1) * TILE).min(self.n);
            for r in 0..acts.m {
                let a = &acts.a[r * acts.stride..(r + 1) * acts.stride];
                let mut o = [0f32; TILE];
                for (b, b0) in (0..self.k).step_by(self.bk).enumerate() {
                    let b1 = (b0 + self.bk).min(self.k);
                    let mut acc = [0i32; TILE];
                    for (kk, &av) in a.iter().enumerate().take(b1).skip(b0) {
                        let base = (t * self.octets + kk / 8) * 64 + kk % 4;
                        let shift = 4 * ((kk % 8) / 4);
                        for (lane, acc) in acc.iter_mut().enumerate() {
                            *acc += av as i32 * ((self.nib[base + 4 * lane] >> shift) & 15) as i32;
                        }
                    }
                    for si in self.block_segs[b]..self.block_segs[b + 1] {
                        let sum = acts.sums[r * acts.nsegs + si];
                        let zbase = (t * self.groups + self.segs[si].group) * TILE;
                        for (lane, acc) in acc.iter_mut().enumerate() {
                            *acc -= self.zeros.get(zbase + lane) * sum;
                        }
                    }
                    let sbase = (t * self.groups + b0 / self.g) * TILE;
                    for lane in 0..TILE {
                        let tv = acc[lane] as f32 * acts.sa[r];
                        o[lane] =
                            tv.mul_add(super::bf16::widen(self.scales[sbase + lane]), o[lane]);
                    }
                }
                // SAFETY: this job owns tile t's columns.
                let yr = unsafe { out.row_mut(r, cols.clone()) };
                for (d, v) in yr.iter_mut().zip(o) {
                    *d = round_bf16(v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{activations, Case};
    use crate::kernels::w4::{w4a8_matmul, Codes, W4Weights};
    use rand::SeedableRng;

    #[test]
    fn packing_gptq_words_in_place_matches_packing_unpacked_codes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for &(n, k, g, n_all, col0) in &[
            (40, 256, 128, 72, 16),
            (16, 64, 32, 16, 0),
            (5, 128, 64, 24, 3),
            // several jobs of 8 tiles, the last tile partial
            (300, 128, 64, 320, 7),
        ] {
            let case = Case::random(&mut rng, n, k, g, true);
            let bytes = case.gptq_bytes(&mut rng, n_all, col0);
            let from_words = PackedW4A8::pack(W4Nibbles {
                q: Codes::GptqWords {
                    bytes: &bytes,
                    n_all,
                    col0,
                },
                ..case.nibbles()
            });
            let from_codes = PackedW4A8::pack(case.nibbles());
            assert_eq!(from_words.nib, from_codes.nib, "n {n} k {k} col0 {col0}");
            assert_eq!(from_words.dequantize(), from_codes.dequantize());
        }
    }

    #[test]
    fn every_tier_is_bit_exact_to_the_recipe() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let shapes = [
            // (n, k, g): odd n, k a multiple of g but not of 512, G > 128, G = K
            (1, 32, 32),
            (17, 96, 32),
            (33, 384, 128),
            (16, 640, 64),
            (7, 512, 256),
            (40, 2048, 128),
            (9, 136, 136),
            (150, 64, 64),
            (5, 384, 192),
            (3, 24, 8),
        ];
        for (si, &(n, k, g)) in shapes.iter().enumerate() {
            for sym in [true, false] {
                let case = Case::random(&mut rng, n, k, g, sym);
                let codes = case.nibbles().codes();
                let packed = PackedW4A8::pack(case.nibbles());
                // The GPTQ group sizes must reach the SIMD kernels.
                assert_eq!(packed.simd_ok, g <= 128 || g % 128 == 0, "({n}, {k}, g{g})");
                // ... and, from 32 rows on, the AMX one (blocks of whole 64-input tile steps).
                #[cfg(target_arch = "x86_64")]
                assert_eq!(
                    amx::takes(&packed),
                    packed.simd_ok && g % 64 == 0,
                    "({n}, {k}, g{g})"
                );
                // 32 and more rows: the AMX kernel's two row tiles, full and partial.
                for m in [1, 2, 3, 4, 5, 16, 19, 32, 45, 70] {
                    let x = activations(&mut rng, m, k);
                    let mut want = vec![0f32; m * n];
                    w4a8_matmul(
                        &x,
                        m,
                        W4Weights {
                            codes: &codes,
                            scales: &case.scales,
                            n,
                            k,
                            g,
                        },
                        &mut want,
                    );
                    for isa in Isa::tested() {
                        let mut got = vec![f32::NAN; m * n];
                        packed.matmul_with(isa, &x, m, &mut got);
                        let bad = differing_bits(&got, &want);
                        assert_eq!(
                            bad, 0,
                            "{isa:?} shape {si} ({n}, {k}, g{g}) sym {sym} m {m}"
                        );
                    }
                }
            }
        }
    }

    /// How many values of `got` differ from `want` in any bit.
    fn differing_bits(got: &[f32], want: &[f32]) -> usize {
        got.iter()
            .zip(want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count()
    }

    /// `matmul_rounding` (rounding while quantizing, as `Bf16Act` layers call it) gives the
    /// bits of rounding `x` to bf16 first, on every tier and both row paths of AMX.
    #[test]
    fn rounding_while_quantizing_is_rounding_first() {
        use rand::Rng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        for (n, k, g) in [(40, 256, 128), (33, 384, 64), (9, 136, 136)] {
            let case = Case::random(&mut rng, n, k, g, true);
            let packed = PackedW4A8::pack(case.nibbles());
            for m in [1, 5, 40] {
                // Full f32 values, a sixteenth of them exact ties between two bf16 values.
                let x: Vec<f32> = (0..m * k)
                    .map(|i| {
                        let v: f32 = rng.random_range(-2.0f32..2.0);
                        if i % 16 == 0 {
                            f32::from_bits(v.to_bits() & 0xFFFF_0000 | 0x8000)
                        } else {
                            v
                        }
                    })
                    .collect();
                let xr: Vec<f32> = x.iter().map(|v| round_bf16(*v)).collect();
                assert!(x.iter().zip(&xr).filter(|(a, b)| a != b).count() > m * k / 2);
                for isa in Isa::tested() {
                    let mut want = vec![f32::NAN; m * n];
                    packed.matmul_with(isa, &xr, m, &mut want);
                    let mut got = vec![f32::NAN; m * n];
                    packed.matmul_impl(isa, &x, m, &mut got, true);
                    let bad = differing_bits(&got, &want);
                    assert_eq!(bad, 0, "{isa:?} ({n}, {k}, g{g}) m {m}");
                }
            }
        }
    }

    /// The fused GELU ⊙ up gives the bits of the two rounding matmuls and `gelu_mul`, on every
    /// tier, with partial column tiles, partial row blocks and both row chunks.
    #[test]
    fn gelu_mul_in_one_pass_is_the_two_matmuls_and_gelu_mul() {
        use rand::Rng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
        for (n, k, g) in [(40, 256, 128), (33, 384, 64), (70, 2048, 128)] {
            let [gate, up] =
                [0, 1].map(|_| PackedW4A8::pack(Case::random(&mut rng, n, k, g, true).nibbles()));
            for m in [5, 32, 45, 70] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                for isa in Isa::tested() {
                    let (mut want, mut u) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                    gate.matmul_impl(isa, &x, m, &mut want, true);
                    up.matmul_impl(isa, &x, m, &mut u, true);
                    crate::kernels::gelu::gelu_mul(&mut want, &u);
                    let mut got = vec![f32::NAN; m * n];
                    PackedW4A8::gelu_mul_with(isa, &gate, &up, &x, m, &mut got);
                    let bad = differing_bits(&got, &want);
                    assert_eq!(bad, 0, "{isa:?} ({n}, {k}, g{g}) m {m}");
                }
            }
        }
    }

    #[test]
    fn weights_sharing_their_input_give_each_ones_bits() {
        use rand::Rng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(29);
        // q, k, v-like widths: whole and partial tile pairs, one tile; groups of 128 and 64.
        for (ns, k, g) in [([96, 32, 48], 256, 128), ([40, 16, 70], 384, 64)] {
            let ws = ns.map(|n| PackedW4A8::pack(Case::random(&mut rng, n, k, g, true).nibbles()));
            for m in [5, 32, 45, 70] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                for isa in Isa::tested() {
                    let mut got = ns.map(|n| vec![f32::NAN; m * n]);
                    let [a, b, c] = &mut got;
                    PackedW4A8::matmul_shared_with(
                        isa,
                        &[&ws[0], &ws[1], &ws[2]],
                        &x,
                        m,
                        &mut [a, b, c],
                    );
                    for ((w, got), n) in ws.iter().zip(&got).zip(ns) {
                        let mut want = vec![f32::NAN; m * n];
                        w.matmul_impl(isa, &x, m, &mut want, true);
                        let bad = differing_bits(got, &want);
                        assert_eq!(bad, 0, "{isa:?} n {n}, k {k}, g{g}, m {m}");
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_simd_row_quantizer_gives_the_recipes_codes_scale_and_sums() {
        use rand::Rng;
        if !Isa::tested().iter().any(|t| t.avx512()) {
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for trial in 0..64 {
            let k = 64 * (1 + trial % 5);
            let mut x: Vec<f32> = (0..k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            if trial % 2 == 0 {
                // amax 127: every x·(127/amax) is x itself, and halves are exact ties.
                x.iter_mut().for_each(|v| *v = (*v * 40.0).round() + 0.5);
                x[k / 3] = -127.0;
            }
            let mut want = vec![0i32; k];
            let want_sa = crate::kernels::w4::quantize_activation_row(&x, &mut want);
            let segs = (0..k).step_by(64).map(|s| s..s + 64);
            let mut got = vec![0i8; k];
            let mut sums = vec![0i32; k / 64];
            // SAFETY: tested tier; segments of whole vectors.
            let sa = unsafe { avx512::quantize_row::<false>(&x, &mut got, segs, &mut sums) };
            assert_eq!(sa.to_bits(), want_sa.to_bits(), "trial {trial}");
            let want8: Vec<i8> = want.iter().map(|v| *v as i8).collect();
            assert_eq!(got, want8, "trial {trial}");
            let want_sums: Vec<i32> = want.chunks(64).map(|c| c.iter().sum()).collect();
            assert_eq!(sums, want_sums, "trial {trial}");
        }
    }

    #[test]
    fn dequantize_is_codes_times_scales() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let case = Case::random(&mut rng, 19, 64, 32, false);
        let codes = case.nibbles().codes();
        let w = PackedW4A8::pack(case.nibbles()).dequantize();
        for (i, v) in w.iter().enumerate() {
            assert_eq!(
                *v,
                codes[i] as f32 * case.scales[(i / 64) * 2 + (i % 64) / 32]
            );
        }
    }
}
