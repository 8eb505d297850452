//! W4A16 from packed nibbles (vLLM `cpu_gemm_wna16`, docs/GPTQ_FORMAT.md §9):
//! every weight is dequantized on the fly to w = bf16((q − z)·s) — the
//! product is exact in f32 (≤ 5 × 8 significant bits), so w is exactly the
//! value [`super::w4::w4a16_weights`] gives — and multiplied with f32
//! multiply-adds. Outputs equal the scalar reference up to summation order
//! (bound in the tests: (k + 2)·ε_f32·Σ|x·w|).
//!
//! Layout (built at load, never on disk): per output column, per 64 inputs
//! 32 bytes; byte i holds q[64c + i] in its low nibble and q[64c + 32 + i]
//! in its high one. Widened to lanes, the nibbles index a 16-entry table of
//! the group's dequantized values: 16 f32 lanes (`vpermps` reads the low 4
//! bits of an index), or 32 bf16 lanes (`vpermw` reads 5 bits; the table is
//! stored twice) when the activations are bf16 values and the CPU has
//! AVX512-BF16 — then `vdpbf16ps` multiplies pairs exactly and accumulates
//! in f32 (denormal inputs read as zero: an absolute error below 2⁻¹²⁶·|w|
//! per product).

use std::ops::Range;

// The AVX-512 kernels index several register arrays ([stream][row]) by one counter.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod avx512;

use super::bf16::{widen, GEMM_MIN_ROWS};
use super::isa::{isa, Isa};
use super::par::{for_tiles, ColumnsOut};
use rayon::prelude::*;

use super::w4::{prefault_for_writing, prefetch_run, round_bf16, spread8, Codes, W4Nibbles, Zeros};

/// bf16((q − 8)·s) for q = 0…15 and every bf16 bit pattern of s, row s at `16·s..16·s + 16`
/// (2 MiB, built once): with GPTQ's zero point 8 a group's bf16 table is one 32-byte load,
/// where computing it takes a multiply and a `vcvtne2ps2bf16` per group, and that conversion
/// shares its issue resources with the nibble lookups and `vdpbf16ps` on the Xeons with AMX
/// (docs/BENCHMARKS.md "W4A16 group tables by lookup"). A scale exponent's rows are 4 KiB.
fn symmetric_rows() -> &'static [u16] {
    static ROWS: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    ROWS.get_or_init(|| {
        (0..=u16::MAX)
            .into_par_iter()
            .flat_map_iter(|s| {
                let s = widen(s);
                (0..16).map(move |q| half::bf16::from_f32((q - 8) as f32 * s).to_bits())
            })
            .collect()
    })
}

/// A `[n, k]` 4-bit weight packed for W4A16.
pub struct PackedW4A16 {
    n: usize,
    k: usize,
    g: usize,
    groups: usize,
    /// `ceil(k / 64)`
    chunks: usize,
    /// `[n][chunks][32]`
    nib: Vec<u8>,
    /// One pad slot, then bf16 bits `[n][groups]` ([`scale`](Self::scale)): the SIMD tables
    /// read each scale as the high half of 32 bits with the slot before it.
    scales: Vec<u16>,
    /// `[n][groups]`
    zeros: Zeros,
    /// [`symmetric_rows`] when the zero point is 8 throughout (GPTQ's symmetric checkpoints)
    /// and the bf16 kernels will run.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    rows: Option<&'static [u16]>,
    /// Whether the SIMD kernels apply: whole 64-input chunks, groups of
    /// 2^half_shift 32-input halves.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    simd_ok: bool,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    half_shift: u32,
}

impl PackedW4A16 {
    pub fn pack(w: W4Nibbles) -> Self {
        w.check();
        let (n, k, g) = (w.n, w.k, w.g);
        let chunks = k.div_ceil(64);
        let zeros = Zeros::new(w.zeros, (0..w.zeros.len()).map(Some));
        let rows =
            (matches!(zeros, Zeros::Uniform(8)) && isa() >= Isa::Avx512Bf16).then(symmetric_rows);
        let mut nib = vec![0u8; n * chunks * 32];
        // 128 columns per job, so each stored GPTQ row is read as one 512-byte run.
        const COLS: usize = 128;
        nib.par_chunks_mut(COLS * chunks * 32)
            .enumerate()
            .for_each_init(Vec::new, |q, (b, out)| {
                prefault_for_writing(out);
                let cols = b * COLS..((b + 1) * COLS).min(n);
                if let (Codes::GptqWords { bytes, n_all, col0 }, true) = (w.q, k % 64 == 0) {
                    // Bytes 8i..8i+8 of a 64-input chunk: GPTQ words i (inputs
                    // 8i..) and i + 4 (inputs 32 + 8i..), one nibble each.
                    let c0 = col0 + cols.start;
                    let run = |r: usize| (r * n_all + c0) * 4..(r * n_all + c0 + cols.len()) * 4;
                    for c in 0..chunks {
                        if c + 1 < chunks {
                            for r in 8 * (c + 1)..8 * (c + 2) {
                                prefetch_run(bytes, run(r).start, 4 * cols.len());
                            }
                        }
                        for i in 0..4 {
                            let lo = &bytes[run(8 * c + i)];
                            let hi = &bytes[run(8 * c + i + 4)];
                            for (j, (lo, hi)) in
                                lo.chunks_exact(4).zip(hi.chunks_exact(4)).enumerate()
                            {
                                let lo = u32::from_le_bytes(lo.try_into().expect("4 bytes"));
                                let hi = u32::from_le_bytes(hi.try_into().expect("4 bytes"));
                                let v = spread8(lo) | (spread8(hi) << 4);
                                let o = (j * chunks + c) * 32 + 8 * i;
                                out[o..o + 8].copy_from_slice(&v.to_le_bytes());
                            }
                        }
                    }
                    return;
                }
                q.resize(cols.len() * k, 0);
                w.q.rows_into(k, cols.clone(), q);
                for j in 0..cols.len() {
                    for kk in 0..k {
                        let byte = (j * chunks + kk / 64) * 32 + kk % 32;
                        out[byte] |= q[j * k + kk] << (4 * ((kk % 64) / 32));
                    }
                }
            });
        PackedW4A16 {
            n,
            k,
            g,
            groups: w.groups(),
            chunks,
            nib,
            scales: [0]
                .into_iter()
                .chain(w.scales.iter().map(|s| half::bf16::from_f32(*s).to_bits()))
                .collect(),
            zeros,
            rows,
            simd_ok: g % 32 == 0 && (g / 32).is_power_of_two() && k % 64 == 0,
            half_shift: (g / 32).max(1).trailing_zeros(),
        }
    }

    /// A copy whose bf16 kernels build their group tables from [`symmetric_rows`] or not
    /// (tests; only a zero point of 8 throughout may take the rows).
    #[cfg(all(test, target_arch = "x86_64"))]
    fn clone_with_rows(&self, on: bool) -> Self {
        assert!(!on || matches!(self.zeros, Zeros::Uniform(8)));
        PackedW4A16 {
            nib: self.nib.clone(),
            scales: self.scales.clone(),
            zeros: self.zeros.clone(),
            rows: on.then(symmetric_rows),
            ..*self
        }
    }

    /// Bytes held (weights, scales, zero points).
    pub fn bytes(&self) -> usize {
        self.nib.len() + 2 * self.scales.len() + self.zeros.bytes()
    }

    /// The bf16 bits of scale `sl` (group `sl % groups` of column `sl / groups`).
    fn scale(&self, sl: usize) -> u16 {
        self.scales[sl + 1]
    }

    /// The 16 dequantized values of nibbles 0…15 in group `gi` of column `col`.
    fn lut(&self, col: usize, gi: usize) -> [f32; 16] {
        let sl = col * self.groups + gi;
        let (z, s) = (self.zeros.get(sl), widen(self.scale(sl)));
        std::array::from_fn(|q| round_bf16((q as i32 - z) as f32 * s))
    }

    #[inline]
    fn q(&self, col: usize, kk: usize) -> usize {
        let byte = self.nib[(col * self.chunks + kk / 64) * 32 + kk % 32];
        ((byte >> (4 * ((kk % 64) / 32))) & 15) as usize
    }

    /// Weight rows `cols` as f32, `[cols.len(), k]` (the effective weights).
    pub fn expand(&self, cols: Range<usize>, out: &mut [f32]) {
        self.expand_with(isa(), cols, out);
    }

    fn expand_with(&self, isa: Isa, cols: Range<usize>, out: &mut [f32]) {
        assert_eq!(out.len(), cols.len() * self.k);
        match isa {
            #[cfg(target_arch = "x86_64")]
            isa if isa.avx512() && self.simd_ok => {
                // SAFETY: the tier was detected on this CPU; sizes asserted above.
                unsafe { avx512::w4a16_expand(self, cols, out) }
            }
            _ => {
                for (col, o) in cols.zip(out.chunks_exact_mut(self.k)) {
                    for gi in 0..self.groups {
                        let lut = self.lut(col, gi);
                        for kk in gi * self.g..(gi + 1) * self.g {
                            o[kk] = lut[self.q(col, kk)];
                        }
                    }
                }
            }
        }
    }

    /// Weight rows `cols` as bf16 bits `[cols.len(), k]` (the `vdpbf16ps` GEMM's input).
    #[cfg(target_arch = "x86_64")]
    fn expand_bits_with(&self, isa: Isa, cols: Range<usize>, out: &mut [u16]) {
        assert_eq!(out.len(), cols.len() * self.k);
        if isa >= Isa::Avx512Bf16 && self.simd_ok {
            // SAFETY: the tier was detected on this CPU; sizes asserted above.
            return unsafe { avx512::w4a16_expand_bits(self, cols, out) };
        }
        // Shapes the SIMD layout does not cover: the f32 expansion, whose values are bf16 values.
        let mut f = vec![0f32; out.len()];
        self.expand_with(isa, cols, &mut f);
        for (o, v) in out.iter_mut().zip(f) {
            *o = (v.to_bits() >> 16) as u16;
        }
    }

    /// The effective weight `[n, k]`: bf16((q − z)·s).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.n * self.k];
        self.expand_with(Isa::Portable, 0..self.n, &mut w);
        w
    }

    /// `y[m, n] = x[m, k] · Wᵀ` in f32 (no output rounding).
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_with(isa(), x, m, y);
    }

    /// [`matmul`](Self::matmul) on an explicit tier (tests run every available one).
    pub fn matmul_with(&self, isa: Isa, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_vbmi(isa, super::isa::vbmi(), x, m, y)
    }

    /// [`matmul_with`](Self::matmul_with), told whether AVX512-VBMI may be used (tests run
    /// the G = 64 decode both ways on a CPU that has it).
    fn matmul_vbmi(&self, isa: Isa, vbmi: bool, x: &[f32], m: usize, y: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        assert_eq!((x.len(), y.len()), (m * k, m * n));
        if m == 0 || n == 0 {
            return;
        }
        if m >= GEMM_MIN_ROWS {
            #[cfg(target_arch = "x86_64")]
            if super::bf16::bf16_act_panel_matmul(isa, x, m, k, n, y, |cols, out| {
                self.expand_bits_with(isa, cols, out)
            }) {
                return;
            }
            let expand = |cols, out: &mut [f32]| self.expand_with(isa, cols, out);
            super::panel_matmul(x, m, k, n, y, expand);
            return;
        }
        // bf16 activations as bf16 bits, for `vdpbf16ps` (exact products).
        #[cfg(target_arch = "x86_64")]
        let xb = if isa >= Isa::Avx512Bf16 && self.simd_ok {
            super::bf16::bf16_bits(x)
        } else {
            None
        };
        #[cfg(target_arch = "x86_64")]
        let decode = avx512::Decode::of(self, vbmi);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = vbmi;
        let out = ColumnsOut::new(y, m, n);
        for_tiles(m, n, k, |rows, cb| match isa {
            #[cfg(target_arch = "x86_64")]
            isa if isa.avx512() && self.simd_ok => {
                // SAFETY: the tier was detected on this CPU (VBMI too when `vbmi`: the
                // caller's detection); this job owns `cb`.
                unsafe { avx512::w4a16_gemv(self, x, xb.as_deref(), decode, rows, cb, &out) }
            }
            _ => self.gemv_portable(x, rows, cb, &out),
        });
    }

    fn gemv_portable(&self, x: &[f32], rows: Range<usize>, cols: Range<usize>, out: &ColumnsOut) {
        let k = self.k;
        for col in cols {
            let mut acc = [[0f32; 16]; 4];
            for gi in 0..self.groups {
                let lut = self.lut(col, gi);
                for kk in gi * self.g..(gi + 1) * self.g {
                    let w = lut[self.q(col, kk)];
                    for (r, acc) in rows.clone().zip(acc.iter_mut()) {
                        acc[kk % 16] += w * x[r * k + kk];
                    }
                }
            }
            for (r, acc) in rows.clone().zip(acc) {
                // SAFETY: this job owns column `col`.
                unsafe { out.row_mut(r, col..col + 1)[0] = acc.iter().sum() };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{activations, assert_close_sum_order, Case};
    use crate::kernels::w4::w4a16_weights;
    use crate::kernels::{F32Matmul, ReferenceMatmul};
    use rand::SeedableRng;

    #[test]
    fn packing_gptq_words_in_place_matches_packing_unpacked_codes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        // k = 96 is not whole 64-input chunks: the byte path takes over.
        for &(n, k, g, n_all, col0) in &[
            (40, 256, 64, 72, 16),
            (17, 128, 128, 40, 5),
            (3, 96, 32, 8, 2),
            // several jobs of 128 columns, the last one partial
            (300, 192, 64, 330, 9),
            (150, 96, 32, 150, 0),
        ] {
            let case = Case::random(&mut rng, n, k, g, true);
            let bytes = case.gptq_bytes(&mut rng, n_all, col0);
            let from_words = PackedW4A16::pack(W4Nibbles {
                q: Codes::GptqWords {
                    bytes: &bytes,
                    n_all,
                    col0,
                },
                ..case.nibbles()
            });
            let from_codes = PackedW4A16::pack(case.nibbles());
            assert_eq!(from_words.nib, from_codes.nib, "n {n} k {k} col0 {col0}");
            assert_eq!(from_words.dequantize(), from_codes.dequantize());
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_bf16_bits_expansion_is_the_dequantized_weight() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        for &(n, k, g) in &[(5, 128, 64), (3, 256, 128), (7, 192, 32), (2, 96, 32)] {
            for sym in [true, false] {
                let case = Case::random(&mut rng, n, k, g, sym);
                let p = PackedW4A16::pack(case.nibbles());
                let want: Vec<u16> = p
                    .dequantize()
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_bits())
                    .collect();
                for isa in Isa::tested() {
                    let mut got = vec![0u16; n * k];
                    p.expand_bits_with(isa, 0..n, &mut got);
                    assert_eq!(got, want, "{isa:?} n {n} k {k} g {g}");
                }
            }
        }
    }

    #[test]
    fn every_tier_matches_the_reference_up_to_summation_order() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for &(n, k, g) in &[
            (1, 32, 32),
            (17, 96, 32),
            (33, 384, 128),
            (16, 640, 64),
            (7, 512, 256),
            (40, 2048, 128),
            (9, 136, 136),
            (5, 48, 16),
            (3, 24, 8),
            (6, 192, 32),
            (5, 192, 64),
            (4, 192, 96),
            (11, 6656, 128),
            (150, 128, 64),
        ] {
            for sym in [true, false] {
                let case = Case::random(&mut rng, n, k, g, sym);
                let w = w4a16_weights(&case.nibbles().codes(), &case.scales, n, k, g);
                let packed = PackedW4A16::pack(case.nibbles());
                assert_eq!(
                    packed.dequantize(),
                    w,
                    "dequantized weights ({n}, {k}, g{g})"
                );
                // The GPTQ group sizes must reach the SIMD kernels.
                if [32, 64, 128].contains(&g) && k % 64 == 0 {
                    assert!(packed.simd_ok, "({n}, {k}, g{g})");
                }
                let wa: Vec<f32> = w.iter().map(|v| v.abs()).collect();
                for m in [1, 2, 3, 4, 5, 16, 19, 41] {
                    // bf16 activations (the vdpbf16ps path) and plain f32 ones.
                    let mut x = activations(&mut rng, m, k);
                    if m % 2 == 0 {
                        x.iter_mut().for_each(|v| *v *= 1.0 + f32::EPSILON);
                    }
                    let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
                    let (mut want, mut abs) = (vec![0f32; m * n], vec![0f32; m * n]);
                    ReferenceMatmul.matmul_nt(&x, m, k, &w, n, &mut want);
                    ReferenceMatmul.matmul_nt(&xa, m, k, &wa, n, &mut abs);
                    for isa in Isa::tested() {
                        let mut got = vec![f32::NAN; m * n];
                        packed.matmul_with(isa, &x, m, &mut got);
                        assert_close_sum_order(&got, &want, &abs, k);
                        // Without VBMI, G = 64 decodes chunk by chunk.
                        got.fill(f32::NAN);
                        packed.matmul_vbmi(isa, false, &x, m, &mut got);
                        assert_close_sum_order(&got, &want, &abs, k);
                        let mut e = vec![0f32; n * k];
                        packed.expand_with(isa, 0..n, &mut e);
                        assert_eq!(e, w, "{isa:?} expand");
                    }
                }
            }
        }
    }
}
