//! The symmetric integer grids GPTQ solves on: b-bit codes q ∈ 0…2^b − 1 with the zero point
//! pinned at 2^(b−1), w = s·(q − z) (docs/GPTQ_FORMAT.md §2), and the lattice the per-group
//! scale s lives on, so codes are solved for exactly the values the consumer dequantizes.
//!
//! Scales are always *stored* values. vLLM's lattice is bf16 (it converts scales to the bf16
//! model dtype at load), kept inside fp16's normal range so the fp16 on disk, the bf16 in vLLM
//! and the f32 here are one number. GGUF's Q4_0/Q8_0 store any fp16; Q4_K/Q6_K store one fp16
//! `d` per 256 inputs and a small integer per group, s = d·k (docs/GGUF.md).

use crate::kernels::fit::{code_in, error_and_fit};
use half::{bf16, f16};

/// The 4-bit zero point and largest code (the vLLM grid).
pub const ZERO: i32 = 8;
pub const QMAX: i32 = 15;

/// Smallest / largest scale that is exact in bf16 *and* a normal fp16.
const S_MIN: f32 = 6.103_515_6e-5; // 2^-14
const S_MAX: f32 = 65280.0;
/// Largest fp16.
const F16_MAX: f32 = 65504.0;

/// Where a group's scale may lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Lattice {
    /// bf16 values that are normal fp16s (vLLM, GPTQ checkpoints).
    Bf16,
    /// Any normal fp16 (GGUF Q4_0, Q8_0).
    Fp16,
    /// s = d·k: one fp16 `d` per `tier` inputs of a row, integer k ∈ 1…`kmax` per group
    /// (GGUF Q4_K: 256 and 63; Q6_K: 256 and 127).
    Tiered { tier: usize, kmax: u32 },
    /// QNN's low-power block quantization (phone w4a16): s = γ·k with one γ per output row over
    /// all its inputs and integer k ∈ 1…16 per group. γ has 4 significant bits, so every γ·k
    /// (≤ 8 significant bits) is exact in bf16 and fp16 and the same checkpoint runs in vLLM.
    Lpbq,
}

/// Largest LPBQ block multiplier: the HTP reads k ∈ 1…16 (docs/PHONE_EXPORT.md).
pub const LPBQ_KMAX: u32 = 16;

/// A b-bit zero-point-2^(b−1) grid and its scale lattice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Grid {
    pub bits: u32,
    pub lattice: Lattice,
}

impl Grid {
    /// The GPTQ checkpoint grid vLLM runs: 4 bits, bf16-exact scales.
    pub const VLLM: Grid = Grid {
        bits: 4,
        lattice: Lattice::Bf16,
    };

    /// Free normal-fp16 scales (GGUF Q4_0, Q8_0).
    pub const fn fp16(bits: u32) -> Grid {
        Grid {
            bits,
            lattice: Lattice::Fp16,
        }
    }

    /// Scales d·k per group, one fp16 `d` per 256 inputs (GGUF Q4_K, Q6_K).
    pub const fn tiered(bits: u32, kmax: u32) -> Grid {
        Grid {
            bits,
            lattice: Lattice::Tiered { tier: 256, kmax },
        }
    }

    pub fn zero(&self) -> i32 {
        1 << (self.bits - 1)
    }

    pub fn qmax(&self) -> i32 {
        (1 << self.bits) - 1
    }

    /// The LPBQ grid of phone w4a16 checkpoints.
    pub const LPBQ: Grid = Grid {
        bits: 4,
        lattice: Lattice::Lpbq,
    };

    /// Inputs per tier scale of a row of `k` inputs, for a tiered lattice (LPBQ: the whole row).
    pub fn tier_of(&self, k: usize) -> Option<usize> {
        match self.lattice {
            Lattice::Tiered { tier, .. } => Some(tier),
            Lattice::Lpbq => Some(k),
            _ => None,
        }
    }

    fn kmax(&self) -> u32 {
        match self.lattice {
            Lattice::Tiered { kmax, .. } => kmax,
            Lattice::Lpbq => LPBQ_KMAX,
            _ => 1,
        }
    }

    /// Code for `w` under stored scale `s` (round half to even, clamp to 0…qmax).
    #[inline]
    pub fn code(&self, w: f32, s: f32) -> u8 {
        code_in(w, s, self.zero(), self.qmax())
    }

    #[inline]
    pub fn dequant(&self, q: u8, s: f32) -> f32 {
        s * (q as i32 - self.zero()) as f32
    }

    /// The stored scale nearest `s` (`d`: the row's tier scale, for a tiered lattice).
    pub fn stored(&self, s: f32, d: f32) -> f32 {
        match self.lattice {
            Lattice::Bf16 => stored_scale(s),
            Lattice::Fp16 => fp16_scale(s),
            Lattice::Tiered { .. } | Lattice::Lpbq => {
                let kmax = self.kmax() as f32;
                let k = if s.is_finite() {
                    (s / d).round().clamp(1.0, kmax)
                } else {
                    kmax
                };
                // d has at most 11 significant bits and k at most 7: the product is exact in f32.
                d * k
            }
        }
    }

    /// A tier's `d` from the free (fp16) scales its groups would choose: the largest maps to
    /// `kmax`, so every group is reachable and the largest gets the finest step.
    pub fn tier_scale(&self, free: &[f32]) -> f32 {
        debug_assert!(
            free.iter().all(|&s| s > 0.0),
            "a tier's d is chosen from positive free scales"
        );
        let kmax = self.kmax() as f32;
        let top = free.iter().fold(0f32, |m, &s| m.max(s));
        if self.lattice == Lattice::Lpbq {
            return lpbq_gamma(top / kmax);
        }
        // Q4_K stores dmin = 8·d, which must be an fp16 too.
        fp16_scale(top / kmax).min(F16_MAX / 8.0)
    }

    /// The same grid with free fp16 scales: what a tier's groups would choose unconstrained.
    pub fn untiered(&self) -> Grid {
        match self.lattice {
            Lattice::Tiered { .. } => Grid {
                bits: self.bits,
                lattice: Lattice::Fp16,
            },
            Lattice::Lpbq => Grid::VLLM,
            _ => *self,
        }
    }

    /// The stored scale for one group `w` (one output row × G inputs), with per-input
    /// importance `imp` (diag of the Hessian; ignored by MaxOver7_5) and tier scale `d`.
    pub fn group_scale(&self, w: &[f32], imp: &[f32], rule: ScaleRule, d: f32) -> f32 {
        let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        if amax == 0.0 {
            // All-zero group: any scale reproduces it; GPTQ's find_params uses ±1 → 2/15.
            return self.stored(2.0 / (2 * self.zero() - 1) as f32, d);
        }
        let half = self.zero() as f32 - 0.5;
        let base = self.stored(amax / half, d);
        match rule {
            ScaleRule::MaxOver7_5 => base,
            ScaleRule::SignedSearch if matches!(self.lattice, Lattice::Bf16 | Lattice::Fp16) => {
                let pos = search(self, w, imp, amax, base, d, 1.0).0;
                let neg = search(self, w, imp, amax, -base, d, -1.0).0;
                if neg.0 < pos.0 {
                    neg.1
                } else {
                    pos.1
                }
            }
            ScaleRule::Search | ScaleRule::SignedSearch => {
                search(self, w, imp, amax, base, d, 1.0).0 .1
            }
        }
    }
}

/// Round a scale to the value that will be stored on the bf16 lattice (its magnitude clamped,
/// its sign kept).
pub fn stored_scale(s: f32) -> f32 {
    let sign = if s < 0.0 { -1.0 } else { 1.0 };
    let s = if s.is_finite() {
        s.abs().clamp(S_MIN, S_MAX)
    } else {
        S_MAX
    };
    let r = sign * bf16::from_f32(s).to_f32();
    debug_assert_eq!(
        f16::from_f32(r).to_f32(),
        r,
        "bf16 scale {r} must be exact in fp16"
    );
    r
}

/// An LPBQ γ near `g`: 4 significant bits (mantissa rounded half up at its third fraction bit),
/// within [2⁻¹⁴, S_MAX/16] so every γ·k, k ∈ 1…16, is a normal fp16 exact in bf16.
pub fn lpbq_gamma(g: f32) -> f32 {
    let g = if g.is_finite() {
        g.clamp(S_MIN, S_MAX / LPBQ_KMAX as f32)
    } else {
        S_MAX / LPBQ_KMAX as f32
    };
    let r = f32::from_bits((g.to_bits() + (1 << 19)) & !((1 << 20) - 1));
    r.min(S_MAX / LPBQ_KMAX as f32)
}

/// Whether `g` is an LPBQ γ (see [`lpbq_gamma`]).
pub fn is_lpbq_gamma(g: f32) -> bool {
    g.is_finite() && lpbq_gamma(g) == g
}

/// Round a scale to the nearest normal fp16 (its magnitude clamped, its sign kept).
fn fp16_scale(s: f32) -> f32 {
    let sign = if s < 0.0 { -1.0 } else { 1.0 };
    let s = if s.is_finite() {
        s.abs().clamp(S_MIN, F16_MAX)
    } else {
        F16_MAX
    };
    sign * f16::from_f32(s).to_f32()
}

/// 4-bit code for `w` under stored scale `s` (the vLLM grid).
#[inline]
pub fn code(w: f32, s: f32) -> u8 {
    code_in(w, s, ZERO, QMAX)
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
    /// (docs/GPTQ_FORMAT.md §14). Positive scales only.
    Search,
    /// [`ScaleRule::Search`] over s = −max|w| / c as well, the lower error winning (ties: the
    /// positive). The grid is lopsided, q − 8 ∈ −8…7: a negative scale gives the group's
    /// positive weights the long side. On the free lattices only, whose consumers multiply by
    /// the stored scale whatever its sign: bf16 (vLLM, docs/QUANTIZE.md) and fp16 (GGUF Q4_0,
    /// whose `d` llama.cpp's own quantizer writes negative, and Q8_0, whose `d` is signed too);
    /// the positive search on the tiered ones, whose multipliers are unsigned (LPBQ's k, the
    /// K-quants' sub-block scales).
    SignedSearch,
}

impl ScaleRule {
    /// The rule with positive scales only: for the free scales a tiered lattice's `d` is chosen
    /// from, whose groups then take positive multipliers.
    pub fn positive(self) -> ScaleRule {
        match self {
            ScaleRule::SignedSearch => ScaleRule::Search,
            r => r,
        }
    }
}

/// Number of denominators tried by [`ScaleRule::Search`].
const CANDIDATES: usize = 41;

/// Σ c_i (w_i − s(q_i − z))² with codes computed against `s`.
#[cfg(test)]
fn weighted_error(grid: &Grid, w: &[f32], imp: &[f32], s: f32) -> f64 {
    error_and_fit(w, imp, s, grid.zero(), grid.qmax()).0
}

/// The least-squares scale from [`error_and_fit`]'s terms.
fn refit(num: f64, den: f64, sign: f32) -> Option<f32> {
    (den > 0.0 && num * sign as f64 > 0.0).then(|| (num / den) as f32)
}

/// The stored 4-bit bf16 scale for one group (the vLLM grid; see [`Grid::group_scale`]).
pub fn group_scale(w: &[f32], imp: &[f32], rule: ScaleRule) -> f32 {
    Grid::VLLM.group_scale(w, imp, rule, 0.0)
}

/// The search's candidate denominators c (scale amax / c): around the grid's half-range (z − ½),
/// 6.5…8.5 for 4 bits, the same relative span for wider grids.
fn denominators(grid: &Grid) -> impl Iterator<Item = f32> {
    let half = grid.zero() as f32 - 0.5;
    let width = half / 7.5;
    let (lo, span) = (half - width, 2.0 * width);
    (0..CANDIDATES).map(move |i| lo + span * i as f32 / (CANDIDATES - 1) as f32)
}

/// Each candidate's stored scale is tried, then the stored scale nearest the least-squares refit
/// of its codes; the winner is the least (error, scale). Many candidates land on the same stored
/// scale and many refits on a candidate or on one another, so each stored scale is evaluated
/// once: a repeat has the same error, cannot beat the first try, and has the same refit, which
/// is tried once (the base scale's only when a candidate lands on it, as before). `sign` (±1) is
/// the sign of every scale tried, `base`'s included; refits of the other sign are not tried.
/// Returns the winner's error and scale, and the stored scales evaluated, each once.
fn search(
    grid: &Grid,
    w: &[f32],
    imp: &[f32],
    amax: f32,
    base: f32,
    d: f32,
    sign: f32,
) -> ((f64, f32), Tries) {
    let (e, num, den) = error_and_fit(w, imp, base, grid.zero(), grid.qmax());
    let mut best = (e, base);
    let mut tried = Tries::new();
    tried.push(base, refit(num, den, sign), false);
    let mut previous = f32::NAN;
    for c in denominators(grid) {
        let s = grid.stored(sign * amax / c, d);
        // Candidates fall monotonically, so most repeats are the previous candidate, whose
        // refit has been tried.
        if s == previous {
            continue;
        }
        previous = s;
        let r = match tried.find(s) {
            Some(i) if tried.expanded[i] => continue,
            Some(i) => {
                tried.expanded[i] = true;
                tried.refit[i]
            }
            None => {
                let r = consider(grid, w, imp, s, &mut best);
                tried.push(s, r, true);
                r
            }
        };
        if let Some(r) = r {
            let s = grid.stored(r, d);
            if tried.find(s).is_none() {
                let r = consider(grid, w, imp, s, &mut best);
                tried.push(s, r, false);
            }
        }
    }
    (best, tried)
}

/// The stored scales a search has evaluated, each with its refit and whether that refit has
/// been tried; on the stack, the scales contiguous for the lookups.
struct Tries {
    len: usize,
    scale: [f32; 2 * CANDIDATES + 1],
    refit: [Option<f32>; 2 * CANDIDATES + 1],
    expanded: [bool; 2 * CANDIDATES + 1],
}

impl Tries {
    fn new() -> Self {
        Tries {
            len: 0,
            scale: [0.0; 2 * CANDIDATES + 1],
            refit: [None; 2 * CANDIDATES + 1],
            expanded: [false; 2 * CANDIDATES + 1],
        }
    }

    fn find(&self, s: f32) -> Option<usize> {
        self.scale[..self.len].iter().position(|&x| x == s)
    }

    fn push(&mut self, s: f32, refit: Option<f32>, expanded: bool) {
        let i = self.len;
        (self.scale[i], self.refit[i], self.expanded[i]) = (s, refit, expanded);
        self.len += 1;
    }
}

/// Evaluate the stored scale `s`, keep it in `best` if it wins (ties to the smaller scale);
/// returns its least-squares refit.
fn consider(grid: &Grid, w: &[f32], imp: &[f32], s: f32, best: &mut (f64, f32)) -> Option<f32> {
    let (e, num, den) = error_and_fit(w, imp, s, grid.zero(), grid.qmax());
    if e < best.0 || (e == best.0 && s < best.1) {
        *best = (e, s);
    }
    refit(num, den, s.signum())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search as first written: every candidate and every refit evaluated, repeats too; its
    /// choice and the distinct stored scales it evaluated, in ascending order.
    fn search_every_try(
        grid: &Grid,
        w: &[f32],
        imp: &[f32],
        amax: f32,
        base: f32,
        d: f32,
    ) -> (f32, Vec<f32>) {
        let (zero, qmax) = (grid.zero(), grid.qmax());
        let mut best = (error_and_fit(w, imp, base, zero, qmax).0, base);
        let tried = std::cell::RefCell::new(vec![base]);
        let try_one = |s: f32, best: &mut (f64, f32)| {
            let s = grid.stored(s, d);
            tried.borrow_mut().push(s);
            let (e, num, den) = error_and_fit(w, imp, s, zero, qmax);
            if e < best.0 || (e == best.0 && s < best.1) {
                *best = (e, s);
            }
            refit(num, den, 1.0)
        };
        for c in denominators(grid) {
            if let Some(r) = try_one(amax / c, &mut best) {
                try_one(r, &mut best);
            }
        }
        let mut tried = tried.into_inner();
        tried.sort_by(f32::total_cmp);
        tried.dedup();
        (best.1, tried)
    }

    /// Trying each stored scale once evaluates the same distinct scales and chooses what trying
    /// every candidate and refit did, on every lattice (few distinct scales on the tiered ones,
    /// many on fp16), for groups with and without outliers, uneven importances, no importance
    /// at all (no refit) and a single nonzero weight.
    #[test]
    fn the_search_without_repeats_chooses_what_every_try_chose() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        let grids = [
            Grid::VLLM,
            Grid::fp16(4),
            Grid::fp16(8),
            Grid::tiered(4, 63),
            Grid::tiered(6, 127),
            Grid::LPBQ,
        ];
        let (mut groups, mut changed) = (0, 0);
        for grid in grids {
            for case in 0..600 {
                let g = [32, 64, 128][case % 3];
                let spread = [0.02f32, 1.0, 300.0][case % 5 % 3];
                let mut w: Vec<f32> = (0..g)
                    .map(|_| rng.random_range(-1.0f32..1.0) * spread)
                    .collect();
                if case % 4 == 0 {
                    w[case % g] *= 9.0; // one outlier
                }
                if case % 7 == 1 {
                    w.iter_mut()
                        .enumerate()
                        .for_each(|(i, v)| *v *= (i == case % g) as u8 as f32);
                }
                let imp: Vec<f32> = (0..g)
                    .map(|_| rng.random_range(0.01f32..4.0) * (case % 11 != 3) as u8 as f32)
                    .collect();
                let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
                let d = match grid.tier_of(g) {
                    Some(_) => grid.tier_scale(&[grid.untiered().stored(amax / 7.0, 0.0)]),
                    None => 0.0,
                };
                let base = grid.stored(amax / (grid.zero() as f32 - 0.5), d);
                let (want, want_tried) = search_every_try(&grid, &w, &imp, amax, base, d);
                let ((_, got), tried) = search(&grid, &w, &imp, amax, base, d, 1.0);
                assert_eq!(got.to_bits(), want.to_bits(), "{grid:?} case {case}");
                let mut tried = tried.scale[..tried.len].to_vec();
                assert_eq!(
                    tried.len(),
                    want_tried.len(),
                    "{grid:?} case {case}: a repeat"
                );
                tried.sort_by(f32::total_cmp);
                assert_eq!(tried, want_tried, "{grid:?} case {case}");
                groups += 1;
                changed += (want != base) as usize;
            }
        }
        // The search moves most groups off the base scale: the comparison is not between two
        // copies of the base.
        assert!(changed * 2 > groups, "{changed} of {groups}");
    }

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

    /// Q4_0, Q8_0, Q4_K and Q6_K as grids.
    fn gguf_grids() -> [Grid; 4] {
        [
            Grid {
                bits: 4,
                lattice: Lattice::Fp16,
            },
            Grid {
                bits: 8,
                lattice: Lattice::Fp16,
            },
            Grid {
                bits: 4,
                lattice: Lattice::Tiered {
                    tier: 256,
                    kmax: 63,
                },
            },
            Grid {
                bits: 6,
                lattice: Lattice::Tiered {
                    tier: 256,
                    kmax: 127,
                },
            },
        ]
    }

    #[test]
    fn wider_grids_pin_their_zero_point_and_clamp() {
        let g8 = Grid {
            bits: 8,
            lattice: Lattice::Fp16,
        };
        assert_eq!((g8.zero(), g8.qmax()), (128, 255));
        assert_eq!(g8.code(0.0, 1.0), 128);
        assert_eq!(g8.code(-1e9, 1.0), 0);
        assert_eq!(g8.code(1e9, 1.0), 255);
        assert_eq!(g8.dequant(0, 0.5), -64.0);
        let g6 = Grid {
            bits: 6,
            lattice: Lattice::Fp16,
        };
        assert_eq!(
            (g6.zero(), g6.code(31.5, 1.0), g6.code(-40.0, 1.0)),
            (32, 63, 0)
        );
    }

    #[test]
    fn tiered_scales_are_integer_multiples_of_an_fp16() {
        let g = Grid {
            bits: 4,
            lattice: Lattice::Tiered {
                tier: 256,
                kmax: 63,
            },
        };
        let d = g.tier_scale(&[0.013, 0.2, 0.05]);
        assert_eq!(f16::from_f32(d).to_f32(), d);
        assert_eq!(
            f16::from_f32(8.0 * d).to_f32(),
            8.0 * d,
            "dmin = 8d must be an fp16"
        );
        for s in [1e-9f32, 0.003, 0.05, 0.2, 0.21, 5.0, f32::INFINITY] {
            let r = g.stored(s, d);
            let k = r / d;
            assert_eq!(k, k.round(), "{s} → {r} is not d·k");
            assert!((1.0..=63.0).contains(&k));
        }
        // The largest free scale is representable to within one step.
        assert!((g.stored(0.2, d) - 0.2).abs() <= d / 2.0 + 1e-7);
    }

    #[test]
    fn lpbq_scales_are_gamma_times_1_to_16_and_exact_in_bf16_and_fp16() {
        let g = Grid::LPBQ;
        assert_eq!(g.tier_of(768), Some(768));
        let gamma = g.tier_scale(&[0.013, 0.2, 0.05]);
        assert!(is_lpbq_gamma(gamma));
        // 4 significant bits: γ = m·2^e with m an integer below 16.
        let m = gamma / 2f32.powi(gamma.log2().floor() as i32 - 3);
        assert_eq!(m, m.round(), "{gamma} has more than 4 significant bits");
        assert!(
            (gamma * 16.0 - 0.2).abs() <= 0.2 / 16.0,
            "16γ ≈ the largest scale"
        );
        for s in [1e-9f32, 0.003, 0.05, 0.2, 0.26, 5.0, f32::INFINITY] {
            let r = g.stored(s, gamma);
            let k = r / gamma;
            assert_eq!(k, k.round(), "{s} → {r} is not γ·k");
            assert!((1.0..=16.0).contains(&k));
            assert_eq!(bf16::from_f32(r).to_f32(), r);
            assert_eq!(f16::from_f32(r).to_f32(), r);
        }
        for x in [1e-12f32, 7e-5, 0.0123, 3.3, 1e6, f32::NAN] {
            let y = lpbq_gamma(x);
            assert!(
                is_lpbq_gamma(y) && y >= S_MIN && 16.0 * y <= S_MAX,
                "{x} → {y}"
            );
        }
        assert_eq!(g.untiered(), Grid::VLLM);
    }

    #[test]
    fn search_on_every_lattice_beats_max_over_half_range() {
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for g in gguf_grids() {
            let (mut base, mut searched) = (0.0, 0.0);
            for _ in 0..100 {
                let w: Vec<f32> = (0..32).map(|_| rnd() * rnd().abs() * 4.0).collect();
                let imp: Vec<f32> = (0..32).map(|_| rnd().abs() + 0.01).collect();
                let free = g.untiered().group_scale(&w, &imp, ScaleRule::Search, 0.0);
                let d = g.tier_scale(&[free * 1.7]);
                let b = g.group_scale(&w, &imp, ScaleRule::MaxOver7_5, d);
                let s = g.group_scale(&w, &imp, ScaleRule::Search, d);
                assert_eq!(
                    g.stored(s, d),
                    s,
                    "{g:?}: the search returned an unstored scale"
                );
                let (eb, es) = (
                    weighted_error(&g, &w, &imp, b),
                    weighted_error(&g, &w, &imp, s),
                );
                assert!(es <= eb, "{g:?}: search {es} worse than baseline {eb}");
                base += eb;
                searched += es;
            }
            assert!(searched < base, "{g:?}: search {searched} vs base {base}");
        }
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
            let (eb, es) = (
                weighted_error(&Grid::VLLM, &w, &imp, b),
                weighted_error(&Grid::VLLM, &w, &imp, s),
            );
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

    /// The signed search keeps the positive search's scale unless a negative one has a lower
    /// error; it takes the negative side often, lowers the summed error, and leaves the tiered
    /// lattices to the positive search.
    #[test]
    fn the_signed_search_only_adds_negative_scales_that_win() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        // bf16 (vLLM) and fp16 (GGUF Q4_0, Q8_0): the free lattices, which take a sign.
        let free = [Grid::VLLM, Grid::fp16(4), Grid::fp16(8)];
        let (mut negative, mut sum_pos, mut sum_signed) = ([0; 3], [0.0; 3], [0.0; 3]);
        for case in 0..400 {
            let g = [32, 64, 128][case % 3];
            let w: Vec<f32> = (0..g)
                .map(|_| rng.random_range(-1.0f32..1.0) * rng.random_range(0.0f32..1.0).powi(3))
                .collect();
            let imp: Vec<f32> = (0..g).map(|_| rng.random_range(0.01f32..2.0)).collect();
            for (i, grid) in free.iter().enumerate() {
                let p = grid.group_scale(&w, &imp, ScaleRule::Search, 0.0);
                let s = grid.group_scale(&w, &imp, ScaleRule::SignedSearch, 0.0);
                let (ep, es) = (
                    weighted_error(grid, &w, &imp, p),
                    weighted_error(grid, &w, &imp, s),
                );
                assert!(p > 0.0 && grid.stored(s, 0.0) == s, "{grid:?}: {p} {s}");
                if s < 0.0 {
                    negative[i] += 1;
                    assert!(
                        es < ep,
                        "{grid:?} case {case}: negative {s} ({es}) does not beat {p} ({ep})"
                    );
                } else {
                    assert_eq!(s, p, "{grid:?} case {case}");
                }
                (sum_pos[i], sum_signed[i]) = (sum_pos[i] + ep, sum_signed[i] + es);
            }
            for other in [Grid::tiered(4, 63), Grid::tiered(6, 127), Grid::LPBQ] {
                let d = other.tier_scale(&[other.untiered().group_scale(
                    &w,
                    &imp,
                    ScaleRule::Search,
                    0.0,
                )]);
                assert_eq!(
                    other.group_scale(&w, &imp, ScaleRule::SignedSearch, d),
                    other.group_scale(&w, &imp, ScaleRule::Search, d),
                    "{other:?}"
                );
            }
        }
        for (i, grid) in free.iter().enumerate() {
            // The 8-bit grid's one extra step on one side is worth far less than the 4-bit's.
            let (low, gain) = if grid.bits == 4 {
                (100, 0.95)
            } else {
                (10, 0.997)
            };
            let n = negative[i];
            assert!((low..300).contains(&n), "{grid:?}: {n} of 400 negative");
            assert!(
                sum_signed[i] < gain * sum_pos[i],
                "{grid:?}: {} vs {}",
                sum_signed[i],
                sum_pos[i]
            );
        }
    }
}
