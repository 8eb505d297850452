//! The symmetric 4-bit grid with its zero point pinned at 8: code q ∈ 0…15,
//! w = s·(q − 8) (docs/GPTQ_FORMAT.md §2), and the choice of the
//! per-group scale s.
//!
//! Scales are always *stored* values: rounded to bf16 (vLLM converts scales
//! to the bf16 model dtype at load) and kept inside fp16's normal range, so
//! the fp16 on disk, the bf16 in vLLM and the f32 here are the same number.
//! Codes are computed against that stored scale.

use crate::kernels::w4::round_ties_even_small;
use half::{bf16, f16};

pub const ZERO: i32 = 8;
pub const QMAX: i32 = 15;

/// Smallest / largest scale that is exact in bf16 *and* a normal fp16.
const S_MIN: f32 = 6.103_515_6e-5; // 2^-14
const S_MAX: f32 = 65280.0;

/// Round a positive scale to the value that will be stored.
pub fn stored_scale(s: f32) -> f32 {
    let s = if s.is_finite() {
        s.clamp(S_MIN, S_MAX)
    } else {
        S_MAX
    };
    let r = bf16::from_f32(s).to_f32();
    debug_assert_eq!(
        f16::from_f32(r).to_f32(),
        r,
        "bf16 scale {r} must be exact in fp16"
    );
    r
}

/// Code for `w` under stored scale `s` (round half to even, clamp to 0…15).
#[inline]
pub fn code(w: f32, s: f32) -> u8 {
    // Clamp before rounding: the fast ties-to-even round is exact only for
    // |x| ≤ 2^22, and every value outside −8.5…7.5 clamps to the same code.
    let x = (w / s).clamp(-(ZERO as f32) - 1.0, (QMAX - ZERO) as f32 + 1.0);
    (round_ties_even_small(x) as i32 + ZERO).clamp(0, QMAX) as u8
}

#[inline]
pub fn dequant(q: u8, s: f32) -> f32 {
    s * (q as i32 - ZERO) as f32
}

/// How a group's scale is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRule {
    /// s = max|w| / 7.5, what GPTQ/AutoGPTQ/GPTQModel/compressed-tensors use.
    MaxOver7_5,
    /// Importance-weighted search over s = max|w| / c, c ∈ [6.5, 8.5], each
    /// candidate followed by a weighted least-squares refit of s for its codes
    /// (docs/GPTQ_FORMAT.md §14). Positive scales only (see QUANTIZE.md).
    Search,
}

/// Number of denominators tried by [`ScaleRule::Search`].
const CANDIDATES: usize = 41;

/// Σ c_i (w_i − s(q_i − 8))² with codes computed against `s`.
#[cfg(test)]
fn weighted_error(w: &[f32], imp: &[f32], s: f32) -> f64 {
    error_and_fit(w, imp, s).0
}

/// For the codes `s` produces: the weighted error Σ c_i (w_i − s·l_i)² and
/// the least-squares terms Σ c_i w_i l_i, Σ c_i l_i² (l = q − 8), in one pass.
/// Eight partial sums per term let the compiler vectorise the loop.
#[inline(always)]
fn error_and_fit(w: &[f32], imp: &[f32], s: f32) -> (f64, f64, f64) {
    // No closures here: they would not inherit `search_avx512`'s features.
    const L: usize = 8;
    let (mut e, mut num, mut den) = ([0f64; L], [0f64; L], [0f64; L]);
    let (cw, ci) = (w.chunks_exact(L), imp.chunks_exact(L));
    let (rw, ri) = (cw.remainder(), ci.remainder());
    for (xs, cs) in cw.zip(ci) {
        for lane in 0..L {
            let t = fit_terms(xs[lane], cs[lane], s);
            e[lane] += t.0;
            num[lane] += t.1;
            den[lane] += t.2;
        }
    }
    for (lane, (&x, &c)) in rw.iter().zip(ri).enumerate() {
        let t = fit_terms(x, c, s);
        e[lane] += t.0;
        num[lane] += t.1;
        den[lane] += t.2;
    }
    (sum8(e), sum8(num), sum8(den))
}

#[inline(always)]
fn fit_terms(x: f32, c: f32, s: f32) -> (f64, f64, f64) {
    let q = code(x, s);
    let d = (x - dequant(q, s)) as f64;
    let l = (q as i32 - ZERO) as f64;
    let c = c as f64;
    (c * d * d, c * x as f64 * l, c * l * l)
}

#[inline(always)]
fn sum8(v: [f64; 8]) -> f64 {
    ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
}

/// The least-squares scale from [`error_and_fit`]'s terms.
fn refit(num: f64, den: f64) -> Option<f32> {
    (den > 0.0 && num > 0.0).then(|| (num / den) as f32)
}

/// The stored scale for one group `w` (one output row × G inputs), with
/// per-input importance `imp` (diag of the Hessian; ignored by MaxOver7_5).
pub fn group_scale(w: &[f32], imp: &[f32], rule: ScaleRule) -> f32 {
    let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    if amax == 0.0 {
        // All-zero group: any scale reproduces it; GPTQ's find_params uses ±1 → 2/15.
        return stored_scale(2.0 / 15.0);
    }
    let base = stored_scale(amax / 7.5);
    match rule {
        ScaleRule::MaxOver7_5 => base,
        ScaleRule::Search => search(w, imp, amax, base),
    }
}

fn search(w: &[f32], imp: &[f32], amax: f32, base: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::isa::isa().avx512() {
        // SAFETY: the CPU has AVX-512 (checked at run time).
        return unsafe { search_avx512(w, imp, amax, base) };
    }
    search_with(w, imp, amax, base)
}

/// The same code compiled for AVX-512, where the loops vectorise 16 wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn search_avx512(w: &[f32], imp: &[f32], amax: f32, base: f32) -> f32 {
    search_with(w, imp, amax, base)
}

#[inline(always)]
fn search_with(w: &[f32], imp: &[f32], amax: f32, base: f32) -> f32 {
    let mut best = (error_and_fit(w, imp, base).0, base);
    for i in 0..CANDIDATES {
        let c = 6.5 + 2.0 * i as f32 / (CANDIDATES - 1) as f32;
        if let Some(r) = consider(w, imp, amax / c, &mut best) {
            consider(w, imp, r, &mut best);
        }
    }
    best.1
}

/// Evaluate stored scale `stored_scale(s)`, keep it in `best` if it wins
/// (ties to the smaller scale); returns its least-squares refit.
#[inline(always)]
fn consider(w: &[f32], imp: &[f32], s: f32, best: &mut (f64, f32)) -> Option<f32> {
    let s = stored_scale(s);
    let (e, num, den) = error_and_fit(w, imp, s);
    if e < best.0 || (e == best.0 && s < best.1) {
        *best = (e, s);
    }
    refit(num, den)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_scales_survive_fp16_and_bf16() {
        for s in [1e-7f32, 3.3e-4, 0.012_345, 0.9, 7.77, 1e9] {
            let r = stored_scale(s);
            assert_eq!(bf16::from_f32(r).to_f32(), r);
            assert_eq!(f16::from_f32(r).to_f32(), r);
            assert!(r >= S_MIN);
        }
    }

    #[test]
    fn codes_clamp_and_round_half_even() {
        assert_eq!(code(0.0, 1.0), 8);
        assert_eq!(code(0.5, 1.0), 8); // ties to even: 0
        assert_eq!(code(1.5, 1.0), 10); // 2
        assert_eq!(code(100.0, 1.0), 15);
        assert_eq!(code(-100.0, 1.0), 0);
        assert_eq!(dequant(0, 0.5), -4.0);
    }

    #[test]
    fn search_never_loses_to_the_baseline_on_its_own_objective() {
        let mut seed = 1u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let (mut sum_base, mut sum_search) = (0.0, 0.0);
        for _ in 0..200 {
            let w: Vec<f32> = (0..64).map(|_| rnd() * rnd().abs() * 4.0).collect();
            let imp: Vec<f32> = (0..64).map(|_| rnd().abs() + 0.01).collect();
            let b = group_scale(&w, &imp, ScaleRule::MaxOver7_5);
            let s = group_scale(&w, &imp, ScaleRule::Search);
            let (eb, es) = (weighted_error(&w, &imp, b), weighted_error(&w, &imp, s));
            assert!(es <= eb, "search {es} worse than baseline {eb}");
            sum_base += eb;
            sum_search += es;
        }
        // The search must actually help on heavy-tailed groups (docs/GPTQ_FORMAT.md §14 measured ~15-20 %).
        assert!(
            sum_search < 0.9 * sum_base,
            "search {sum_search} vs base {sum_base}"
        );
    }
}
