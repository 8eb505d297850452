//! The scale search's inner sum (quant::grid, docs/GPTQ_FORMAT.md §14): for the codes a candidate
//! scale gives one group, the weighted error and the terms of its least-squares refit.
//!
//! The portable loop is the reference: f32 codes and residuals, f64 products summed in eight lanes
//! (lane = index mod 8) and added pairwise at the end. The AVX-512 kernel computes the codes 16 at
//! a time and adds each half of 8 into the same lanes in the same order, with the same IEEE
//! operations (no fused multiply-add), so both give the same bits (tests below); the search's
//! choices, and so the checkpoints, do not depend on the tier.

#[cfg(target_arch = "x86_64")]
use super::isa::isa;
use super::w4::round_ties_even_small;

/// Code in `0..=qmax` for `w` under scale `s` on the grid with zero point `zero`.
#[inline(always)]
pub fn code_in(w: f32, s: f32, zero: i32, qmax: i32) -> u8 {
    // Clamp before rounding: the fast ties-to-even round is exact only for
    // |x| ≤ 2^22, and every value outside the grid clamps to the same code.
    let x = (w / s).clamp(-(zero as f32) - 1.0, (qmax - zero) as f32 + 1.0);
    (round_ties_even_small(x) as i32 + zero).clamp(0, qmax) as u8
}

/// For the codes `s` gives `w` (finite weights, `s` positive and finite): Σ c·(w − s·l)²,
/// Σ c·w·l and Σ c·l², with l = q − zero and c = `imp`, over `w.len()` values.
pub fn error_and_fit(w: &[f32], imp: &[f32], s: f32, zero: i32, qmax: i32) -> (f64, f64, f64) {
    assert_eq!(w.len(), imp.len());
    #[cfg(target_arch = "x86_64")]
    if isa().avx512() {
        // SAFETY: the CPU has AVX-512 (checked at run time); the lengths are equal (asserted).
        return unsafe { error_and_fit_avx512(w, imp, s, zero, qmax) };
    }
    error_and_fit_portable(w, imp, s, zero, qmax)
}

/// The reference.
pub fn error_and_fit_portable(
    w: &[f32],
    imp: &[f32],
    s: f32,
    zero: i32,
    qmax: i32,
) -> (f64, f64, f64) {
    let mut lanes = Lanes::default();
    lanes.add(w, imp, s, zero, qmax);
    lanes.total()
}

/// Eight partial sums per term.
#[derive(Default)]
struct Lanes {
    e: [f64; 8],
    num: [f64; 8],
    den: [f64; 8],
}

impl Lanes {
    /// Chunks of 8 into lanes 0…7, then the remainder into lanes 0….
    #[inline(always)]
    fn add(&mut self, w: &[f32], imp: &[f32], s: f32, zero: i32, qmax: i32) {
        let (cw, ci) = (w.chunks_exact(8), imp.chunks_exact(8));
        let (rw, ri) = (cw.remainder(), ci.remainder());
        for (xs, cs) in cw.zip(ci) {
            for lane in 0..8 {
                self.term(lane, xs[lane], cs[lane], s, zero, qmax);
            }
        }
        for (lane, (&x, &c)) in rw.iter().zip(ri).enumerate() {
            self.term(lane, x, c, s, zero, qmax);
        }
    }

    #[inline(always)]
    fn term(&mut self, lane: usize, x: f32, c: f32, s: f32, zero: i32, qmax: i32) {
        let l = code_in(x, s, zero, qmax) as i32 - zero;
        let d = (x - s * l as f32) as f64;
        let (l, c) = (l as f64, c as f64);
        self.e[lane] += c * d * d;
        self.num[lane] += c * x as f64 * l;
        self.den[lane] += c * l * l;
    }

    fn total(&self) -> (f64, f64, f64) {
        let sum8 = |v: &[f64; 8]| ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
        (sum8(&self.e), sum8(&self.num), sum8(&self.den))
    }
}

/// 16 codes per step; each half of 8 goes into the lanes as the reference's chunk of 8 would.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn error_and_fit_avx512(
    w: &[f32],
    imp: &[f32],
    s: f32,
    zero: i32,
    qmax: i32,
) -> (f64, f64, f64) {
    use std::arch::x86_64::*;
    const MAGIC: f32 = 12_582_912.0;
    let n = w.len();
    let sv = _mm512_set1_ps(s);
    let lo = _mm512_set1_ps(-(zero as f32) - 1.0);
    let hi = _mm512_set1_ps((qmax - zero) as f32 + 1.0);
    let magic = _mm512_set1_ps(MAGIC);
    let (z, top) = (_mm512_set1_ps(zero as f32), _mm512_set1_ps(qmax as f32));
    let (mut e, mut num, mut den) = (
        _mm512_setzero_pd(),
        _mm512_setzero_pd(),
        _mm512_setzero_pd(),
    );
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 ≤ n = w.len() = imp.len().
        let (x, c) = unsafe {
            (
                _mm512_loadu_ps(w.as_ptr().add(i)),
                _mm512_loadu_ps(imp.as_ptr().add(i)),
            )
        };
        // code_in: clamp (NaN-free: finite weights, positive finite scale), round, clamp the code.
        let t = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(x, sv)));
        let r = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
        let q = _mm512_min_ps(top, _mm512_max_ps(_mm512_setzero_ps(), _mm512_add_ps(r, z)));
        let l = _mm512_sub_ps(q, z);
        let d = _mm512_sub_ps(x, _mm512_mul_ps(sv, l));
        let halves = |v: __m512| {
            (
                _mm512_cvtps_pd(_mm512_castps512_ps256(v)),
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(v),
                ))),
            )
        };
        let (xs, cs, ds, ls) = (halves(x), halves(c), halves(d), halves(l));
        for (x, c, d, l) in [(xs.0, cs.0, ds.0, ls.0), (xs.1, cs.1, ds.1, ls.1)] {
            e = _mm512_add_pd(e, _mm512_mul_pd(_mm512_mul_pd(c, d), d));
            num = _mm512_add_pd(num, _mm512_mul_pd(_mm512_mul_pd(c, x), l));
            den = _mm512_add_pd(den, _mm512_mul_pd(_mm512_mul_pd(c, l), l));
        }
        i += 16;
    }
    let mut lanes = Lanes::default();
    // SAFETY: each array holds eight f64.
    unsafe {
        _mm512_storeu_pd(lanes.e.as_mut_ptr(), e);
        _mm512_storeu_pd(lanes.num.as_mut_ptr(), num);
        _mm512_storeu_pd(lanes.den.as_mut_ptr(), den);
    }
    lanes.add(&w[i..], &imp[i..], s, zero, qmax);
    lanes.total()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::isa::Isa;

    #[test]
    fn every_tier_gives_the_references_bits() {
        let mut seed = 11u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for tier in Isa::tested() {
            for (zero, qmax) in [(8, 15), (32, 63), (128, 255)] {
                for n in [0, 1, 7, 8, 9, 15, 16, 17, 31, 64, 100, 128, 256, 257] {
                    let mut w: Vec<f32> = (0..n).map(|_| rnd() * 0.05).collect();
                    let imp: Vec<f32> = (0..n).map(|_| (rnd() + 1.5) * 3.0).collect();
                    if n > 3 {
                        // A zero and a value far outside any candidate's grid (clamped).
                        w[1] = 0.0;
                        w[3] = 4.0;
                    }
                    let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
                    for s in [amax / 7.5, amax / 6.5, amax / 8.5, 1e-7, 3.0, 0.013_7] {
                        let s = s.max(1e-9);
                        let want = error_and_fit_portable(&w, &imp, s, zero, qmax);
                        let got = match tier {
                            #[cfg(target_arch = "x86_64")]
                            t if t.avx512() => unsafe {
                                error_and_fit_avx512(&w, &imp, s, zero, qmax)
                            },
                            _ => error_and_fit_portable(&w, &imp, s, zero, qmax),
                        };
                        assert_eq!(
                            (got.0.to_bits(), got.1.to_bits(), got.2.to_bits()),
                            (want.0.to_bits(), want.1.to_bits(), want.2.to_bits()),
                            "{tier:?} n {n} s {s} grid {zero}/{qmax}: {got:?} vs {want:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_sums_are_the_definitions() {
        let w = [0.3f32, -0.7, 0.05, 1.0, -1.0, 0.0, 0.21, -0.33, 0.9];
        let imp = [1.0f32, 2.0, 0.5, 1.5, 1.0, 3.0, 0.25, 1.0, 2.0];
        let s = 0.125f32;
        let (mut e, mut num, mut den) = (0f64, 0f64, 0f64);
        for (&x, &c) in w.iter().zip(&imp) {
            let l = ((x / s).round().clamp(-8.0, 7.0)) as f64;
            let d = x as f64 - s as f64 * l;
            e += c as f64 * d * d;
            num += c as f64 * x as f64 * l;
            den += c as f64 * l * l;
        }
        let got = error_and_fit(&w, &imp, s, 8, 15);
        for (g, want) in [(got.0, e), (got.1, num), (got.2, den)] {
            assert!(
                (g - want).abs() <= 1e-12 * want.abs().max(1.0),
                "{g} vs {want}"
            );
        }
    }
}
