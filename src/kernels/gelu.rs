//! GELU with erf, `x·Φ(x) = ½·x·erfc(−x/√2)`, evaluated without libm so that it vectorises.
//!
//! For z ≥ 0, erfc(z) = t·exp(−z² + P(t)) with t = 1 / (1 + z/2) and P a degree-10 polynomial
//! fitted by `tools/fit_gelu.py` (its relative error on erfc is 1.2e-8 in f64); exp is
//! [`super::exp_nonpositive`].
//! Measured in f32 against the f64 erf on a grid of step 5e-5 over [−20, 20] and beyond (tests
//! below): within 1e-6·|GELU(x)| + 1e-9·|x| ([`MAX_ERROR`]); 6.8e-7 relative at worst where
//! |GELU(x)| > 1e-3, a few f32 roundings. Every operation is a plain IEEE one (no fused
//! multiply-add, no libm), so every tier gives the same bits. The model's activations are
//! rounded to bf16 (2⁻⁹) or quantized to int8 right after, so this error does not show in any
//! parity figure (docs/BENCHMARKS.md).

use super::exp_nonpositive;
#[cfg(target_arch = "x86_64")]
use super::isa::isa;

/// P in increasing powers of s = (t − 4/7)·7/3 ∈ [−1, 1], from `tools/fit_gelu.py` (DEGREE = 10).
const P: [f32; 11] = [
    -5.748_763e-1,
    5.856_02e-1,
    1.932_390_6e-2,
    -3.190_556e-2,
    -1.767_942_7e-3,
    4.309_441e-3,
    -1.915_006_6e-4,
    -6.808_140_3e-4,
    1.366_756_8e-4,
    7.694_512e-5,
    -2.685_051_2e-5,
];

/// The largest error of [`gelu`] against the exact value, as `|err| ≤ MAX_ERROR.0·|GELU(x)| +
/// MAX_ERROR.1·|x|` (the second term covers large negative x, where GELU(x) underflows towards 0
/// while x does not); checked by the tests on a dense grid.
pub const MAX_ERROR: (f32, f32) = (1e-6, 1e-9);

/// GELU with erf (the reference model's `ACT2FN["gelu"]`), to [`MAX_ERROR`].
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let s = (t - 4.0 / 7.0) * (7.0 / 3.0);
    let mut p = P[10];
    for &c in P[..10].iter().rev() {
        p = p * s + c;
    }
    // z² as x²/2: one rounding, not two.
    let erfc = t * exp_nonpositive(p - 0.5 * (x * x));
    let phi2 = if x >= 0.0 { 2.0 - erfc } else { erfc };
    0.5 * x * phi2
}

fn gelu_mul_portable(g: &mut [f32], u: &[f32]) {
    g.iter_mut().zip(u).for_each(|(a, u)| *a = gelu(*a) * u);
}

/// The same code, compiled for 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn gelu_mul_avx512(g: &mut [f32], u: &[f32]) {
    g.iter_mut().zip(u).for_each(|(a, u)| *a = gelu(*a) * u);
}

/// `g ← GELU(g) ⊙ u` (the input of `down_proj` from the gate and up projections).
pub fn gelu_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len());
    #[cfg(target_arch = "x86_64")]
    if isa().avx512() {
        // SAFETY: the tier is only chosen on a CPU with AVX-512.
        return unsafe { gelu_mul_avx512(g, u) };
    }
    gelu_mul_portable(g, u)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact(x: f32) -> f64 {
        let x = x as f64;
        0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
    }

    fn grid() -> Vec<f32> {
        let mut xs: Vec<f32> = (-400_000..=400_000).map(|i| i as f32 * 5e-5).collect();
        xs.extend([
            -200.0, -90.0, -30.0, -14.0, -13.0, 13.0, 30.0, 1e4, -1e4, 0.0, -0.0,
        ]);
        xs.extend([1e-30, -1e-30, 1e-8, -1e-8, f32::MIN_POSITIVE]);
        xs
    }

    #[test]
    fn gelu_is_within_its_stated_error_of_the_exact_erf_form() {
        let (rel, abs) = MAX_ERROR;
        let mut worst = 0f64;
        for x in grid() {
            let (got, want) = (gelu(x) as f64, exact(x));
            let bound = rel as f64 * want.abs() + abs as f64 * (x as f64).abs();
            assert!(
                (got - want).abs() <= bound.max(f32::MIN_POSITIVE as f64),
                "x {x}: {got} vs {want}"
            );
            if want.abs() > 1e-3 {
                worst = worst.max((got - want).abs() / want.abs());
            }
        }
        // It is the erf form, not the tanh approximation (0.841192 at 1), and close to f32's own
        // rounding where the value is not small.
        assert!((gelu(1.0) - 0.841_344_8).abs() < 1e-6);
        assert!(worst < 1e-6, "worst relative error {worst}");
    }

    #[test]
    fn every_tier_gives_the_same_bits() {
        let xs = grid();
        let u: Vec<f32> = xs
            .iter()
            .enumerate()
            .map(|(i, _)| 1.0 + (i % 7) as f32)
            .collect();
        let mut portable = xs.clone();
        gelu_mul_portable(&mut portable, &u);
        let mut dispatched = xs.clone();
        gelu_mul(&mut dispatched, &u);
        for ((a, b), x) in portable.iter().zip(&dispatched).zip(&xs) {
            assert_eq!(a.to_bits(), b.to_bits(), "x {x}");
        }
        for (&a, (&x, &u)) in portable.iter().zip(xs.iter().zip(&u)) {
            assert_eq!(a.to_bits(), (gelu(x) * u).to_bits());
        }
    }
}
