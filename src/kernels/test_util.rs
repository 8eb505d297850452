//! Fixtures and checks the kernel tests share: random GPTQ-like 4-bit
//! weights, bf16 activations, and the summation-order bound of the f32
//! kernels.

use rand::Rng;

use super::w4::{round_bf16, Codes, W4Nibbles};

/// Random GPTQ-like weights: nibbles, zeros (8, or random per group), bf16 scales of either sign
/// (`quantize` writes negative ones, docs/QUANTIZE.md).
pub(crate) struct Case {
    pub q: Vec<u8>,
    pub zeros: Vec<i32>,
    pub scales: Vec<f32>,
    pub n: usize,
    pub k: usize,
    pub g: usize,
}

impl Case {
    pub fn random(rng: &mut impl Rng, n: usize, k: usize, g: usize, sym: bool) -> Case {
        let groups = k / g;
        Case {
            q: (0..n * k).map(|_| rng.random_range(0..16u8)).collect(),
            zeros: (0..n * groups)
                .map(|_| if sym { 8 } else { rng.random_range(1..=16) })
                .collect(),
            scales: (0..n * groups)
                .map(|_| {
                    let s = round_bf16(rng.random_range(1e-4f32..2e-2));
                    if rng.random_bool(0.5) {
                        -s
                    } else {
                        s
                    }
                })
                .collect(),
            n,
            k,
            g,
        }
    }
    /// This case's codes as columns `col0..col0 + n` of a GPTQ
    /// `qweight` `[k/8, n_all]` (bytes), other columns random.
    pub fn gptq_bytes(&self, rng: &mut impl Rng, n_all: usize, col0: usize) -> Vec<u8> {
        let (n, k) = (self.n, self.k);
        let mut kn: Vec<u8> = (0..k * n_all).map(|_| rng.random_range(0..16u8)).collect();
        for j in 0..n {
            for kk in 0..k {
                kn[kk * n_all + col0 + j] = self.q[j * k + kk];
            }
        }
        crate::formats::gptq::pack_qweight(&kn, k, n_all)
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }
    pub fn nibbles(&self) -> W4Nibbles<'_> {
        W4Nibbles {
            q: Codes::Unpacked(&self.q),
            zeros: &self.zeros,
            scales: &self.scales,
            n: self.n,
            k: self.k,
            g: self.g,
        }
    }
}

/// bf16 activations in ±2 with an exact .5 tie after scaling in every row.
pub(crate) fn activations(rng: &mut impl Rng, m: usize, k: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..m * k)
        .map(|_| round_bf16(rng.random_range(-2.0f32..2.0)))
        .collect();
    if k > 1 {
        for r in 0..m {
            let row = &mut x[r * k..(r + 1) * k];
            let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            row[k / 2] = amax / 2.0;
        }
    }
    x
}

/// Any summation order of K products: |error| ≤ γ_K·Σ|x·w| with
/// γ_K ≈ K·2⁻²⁴ per side, so two orders differ by at most twice that.
pub(crate) fn assert_close_sum_order(got: &[f32], want: &[f32], abs: &[f32], k: usize) {
    let gamma = (k as f32 + 2.0) * f32::EPSILON;
    for (i, ((g, w), a)) in got.iter().zip(want).zip(abs).enumerate() {
        assert!(
            (g - w).abs() <= gamma * a + f32::MIN_POSITIVE,
            "element {i}: {g} vs {w} (Σ|x·w| {a}, k {k})"
        );
    }
}
