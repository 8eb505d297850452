//! GPTQ on one linear layer (docs/GPTQ_FORMAT.md §11–§13), knowing nothing about files.
//!
//! Weights are handled transposed, `wt[k, n]` (row = one input column of
//! W[n, k]), so the column GPTQ processes is contiguous and the produced
//! codes are already in the [K, N] order GPTQ's `qweight` packs.

use std::ops::Range;

use faer::linalg::triangular_inverse::invert_lower_triangular;
use faer::{Mat, Par};
use rayon::prelude::*;

use crate::kernels::transpose;

use super::grid::{Grid, ScaleRule};
use super::hessian::Hessian;
use super::timing::{Clock, SolveTimes, Spent};

#[derive(Debug, Clone, Copy)]
pub struct GptqConfig {
    pub group_size: usize,
    pub block_size: usize,
    /// Initial damping as a fraction of mean(diag H).
    pub damp: f64,
    pub rule: ScaleRule,
    /// The grid the codes are solved on (and the lattice of its scales).
    pub grid: Grid,
}

/// The order GPTQ visits a linear's inputs in. The stored layout is the natural one either
/// way: groups are always the consecutive runs of G inputs (`g_idx = k / G`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// Inputs 0, 1, …, K − 1.
    #[default]
    Natural,
    /// Descending diag(H) ("activation order": the inputs with the most energy are rounded
    /// first, while the most others are left to absorb their error), with **static groups**:
    /// a group's scale is chosen when the first of its members is reached, from the members'
    /// weights as updated by then, and the codes are stored back in the natural order. vLLM
    /// takes the result as an ordinary no-act-order checkpoint.
    ActStatic,
}

#[derive(Debug, thiserror::Error)]
pub enum GptqError {
    #[error("{0}: in_features {1} is not a multiple of the group size {2}")]
    Shape(String, usize, usize),
    #[error("{0}: Hessian contains NaN or Inf (calibration activations overflowed?)")]
    NonFiniteHessian(String),
    #[error("{0}: weights contain NaN or Inf")]
    NonFiniteWeights(String),
    #[error("{0}: Cholesky failed even with damping {1:.3} of mean(diag H)")]
    Cholesky(String, f64),
    #[error("{0}: fixed scales cannot be given on a tiered lattice")]
    GivenTiered(String),
}

/// A quantized linear in GPTQ's natural order.
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    pub in_features: usize,
    pub out_features: usize,
    pub group_size: usize,
    /// `[K, N]`, 0…2^bits − 1.
    pub codes: Vec<u8>,
    /// `[K/G, N]`, stored values (on `grid`'s lattice).
    pub scales: Vec<f32>,
    pub grid: Grid,
    /// `[K/T, N]`: each row's `d` per tier of T inputs when the lattice is tiered
    /// (every scale of the tier is `d·k`); empty otherwise.
    pub tier_scales: Vec<f32>,
}

impl QuantizedWeight {
    /// Dequantized weight in PyTorch order `[N, K]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let (k, n, g) = (self.in_features, self.out_features, self.group_size);
        let mut w = vec![0f32; n * k];
        w.par_chunks_mut(k).enumerate().for_each(|(nn, row)| {
            for (kk, v) in row.iter_mut().enumerate() {
                *v = self
                    .grid
                    .dequant(self.codes[kk * n + nn], self.scales[(kk / g) * n + nn]);
            }
        });
        w
    }
}

impl QuantizedWeight {
    /// Linears that share an input, concatenated along N (q | k | v, or blocks of head rows).
    pub fn concat_outputs(parts: &[&QuantizedWeight]) -> QuantizedWeight {
        let (k, g, grid) = (parts[0].in_features, parts[0].group_size, parts[0].grid);
        let n: usize = parts.iter().map(|p| p.out_features).sum();
        let stack = |of: fn(&QuantizedWeight) -> &[f32], rows: usize| {
            let mut v = vec![0f32; rows * n];
            let mut off = 0;
            for p in parts {
                let pn = p.out_features;
                for r in 0..rows {
                    v[r * n + off..r * n + off + pn].copy_from_slice(&of(p)[r * pn..(r + 1) * pn]);
                }
                off += pn;
            }
            v
        };
        let mut codes = vec![0u8; k * n];
        let mut off = 0;
        for p in parts {
            assert_eq!((p.in_features, p.group_size, p.grid), (k, g, grid));
            let pn = p.out_features;
            for kk in 0..k {
                codes[kk * n + off..kk * n + off + pn]
                    .copy_from_slice(&p.codes[kk * pn..(kk + 1) * pn]);
            }
            off += pn;
        }
        let tiers = grid.tier_of(k).map_or(0, |t| k / t);
        QuantizedWeight {
            in_features: k,
            out_features: n,
            group_size: g,
            codes,
            scales: stack(|p| &p.scales, k / g),
            grid,
            tier_scales: stack(|p| &p.tier_scales, tiers),
        }
    }
}

/// Outcome of [`gptq`], with what the report needs.
#[derive(Debug, Clone)]
pub struct GptqResult {
    pub weight: QuantizedWeight,
    pub damp_used: f64,
    pub dead_columns: usize,
}

/// Round-to-nearest with the same grid and group scales (no error feedback).
pub fn rtn(
    w: &[f32],
    n: usize,
    k: usize,
    h: &Hessian,
    group_size: usize,
    rule: ScaleRule,
    grid: Grid,
) -> QuantizedWeight {
    let wt = transpose(w, n, k);
    let diag = h.diag();
    let groups = k / group_size;
    let mut scales = vec![0f32; groups * n];
    let mut codes = vec![0u8; k * n];
    let mut buf = vec![0f32; group_size];
    let imp: Vec<f32> = diag.iter().map(|&d| d as f32).collect();
    let group = |g: usize, nn: usize, buf: &mut [f32]| {
        for (j, b) in buf.iter_mut().enumerate() {
            *b = wt[(g * group_size + j) * n + nn];
        }
    };
    // A tier's d from its groups' free scales, as the solve chooses it.
    let tier = grid.tier_of(k).unwrap_or(k);
    let per_tier = tier / group_size;
    let mut tier_scales = vec![
        0f32;
        if grid.tier_of(k).is_some() {
            k / tier * n
        } else {
            0
        }
    ];
    for (t, row) in tier_scales.chunks_mut(n).enumerate() {
        for (nn, d) in row.iter_mut().enumerate() {
            let free: Vec<f32> = (t * per_tier..(t + 1) * per_tier)
                .map(|g| {
                    group(g, nn, &mut buf);
                    let imp = &imp[g * group_size..(g + 1) * group_size];
                    grid.untiered().group_scale(&buf, imp, rule.positive(), 0.0)
                })
                .collect();
            *d = grid.tier_scale(&free);
        }
    }
    for g in 0..groups {
        for nn in 0..n {
            group(g, nn, &mut buf);
            let d = tier_scales
                .get((g / per_tier) * n + nn)
                .copied()
                .unwrap_or(0.0);
            let imp = &imp[g * group_size..(g + 1) * group_size];
            let s = grid.group_scale(&buf, imp, rule, d);
            scales[g * n + nn] = s;
            for j in 0..group_size {
                let kk = g * group_size + j;
                codes[kk * n + nn] = grid.code(wt[kk * n + nn], s);
            }
        }
    }
    QuantizedWeight {
        in_features: k,
        out_features: n,
        group_size,
        codes,
        scales,
        grid,
        tier_scales,
    }
}

/// Upper factor U with (H + λI)⁻¹ = UᵀU via one Cholesky and one triangular inverse
/// of the index-reversed matrix (docs/GPTQ_FORMAT.md §12): chol(J H J) = L̃, U = J L̃⁻¹ J.
/// `h(a, b)` gives H for a ≤ b, already damped on the diagonal.
///
/// In f32, as the reference implementations factor (torch float32): twice the
/// SIMD width and half the memory traffic of f64, and a failure only means
/// more damping (which the caller adds and logs). The factor is computed in place in one
/// `k × k` buffer and inverted into a second; no f64 copy of H is made (at K = 10240 each
/// f32 matrix is 419 MB).
fn inverse_upper_factor(h: impl Fn(usize, usize) -> f64 + Sync, k: usize) -> Option<Vec<f32>> {
    use faer::dyn_stack::{MemBuffer, MemStack};
    use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
    // Column-major J H J, lower triangle only: column j, rows i ≥ j, is H[k-1-i, k-1-j].
    let mut flipped = vec![0f32; k * k];
    flipped.par_chunks_mut(k).enumerate().for_each(|(j, col)| {
        for (i, v) in col.iter_mut().enumerate().skip(j) {
            *v = h(k - 1 - i, k - 1 - j) as f32;
        }
    });
    let a = faer::MatMut::from_column_major_slice_mut(&mut flipped, k, k);
    let par = faer::get_global_parallelism();
    let mut mem = MemBuffer::new(cholesky_in_place_scratch::<f32>(k, par, Default::default()));
    cholesky_in_place(
        a,
        Default::default(),
        par,
        MemStack::new(&mut mem),
        Default::default(),
    )
    .ok()?;
    drop(mem);
    // Only the lower factor is read below; clear what the factorization left above it.
    flipped
        .par_chunks_mut(k)
        .enumerate()
        .for_each(|(j, col)| col[..j].fill(0.0));
    let l = faer::MatRef::from_column_major_slice(&flipped, k, k);
    let mut inv = Mat::<f32>::zeros(k, k);
    invert_lower_triangular(inv.as_mut(), l, Par::rayon(0));
    drop(flipped);
    // U[i, j] = inv[k-1-i, k-1-j] (j ≥ i) in blocks of 64 rows of U: each column of `inv` is read
    // as one contiguous run per block, where row by row every element was a column apart.
    const ROWS: usize = 64;
    let mut u = vec![0f32; k * k];
    u.par_chunks_mut(ROWS * k)
        .enumerate()
        .for_each(|(b, rows)| {
            let i0 = b * ROWS;
            let nr = rows.len() / k;
            for j in i0..k {
                let col = inv
                    .col(k - 1 - j)
                    .try_as_col_major()
                    .expect("an owned matrix's columns are contiguous")
                    .as_slice();
                for r in 0..nr.min(j - i0 + 1) {
                    rows[r * k + j] = col[k - 1 - i0 - r];
                }
            }
        });
    u.par_iter().all(|x| x.is_finite()).then_some(u)
}

/// One solve: the weights, where its time went, and its output error as GPTQ's own loss gives it.
pub struct Solution {
    pub q: QuantizedWeight,
    pub times: SolveTimes,
    /// tr(ΔHΔᵀ), Δ = W − Ŵ, H/n undamped: the numerator of [`output_error_parts`], here from the
    /// column errors the solve scaled by U anyway (docs/GPTQ_FORMAT.md §12, "The error GPTQ
    /// reports"), not from another product with H.
    pub error: f64,
}

/// Everything GPTQ needs from one Hessian, computed once and shared by every
/// linear that reads the same input (q/k/v; gate/up) and by every variant.
pub struct GptqSolver {
    name: String,
    k: usize,
    /// Processing position → input, for [`Order::ActStatic`]; `None` is the identity.
    perm: Option<Vec<usize>>,
    /// Upper factor of (P (H + λI) Pᵀ)⁻¹, row-major `[k, k]`, in processing positions.
    u: Vec<f32>,
    /// Per-position importance for the scale search: 1/U[i,i]².
    imp: Vec<f32>,
    /// Per position.
    dead: Vec<bool>,
    pub damp_used: f64,
    /// The damping added to H/n's diagonal: `damp_used` × mean(diag H/n).
    lambda: f64,
}

/// Which group each processing position belongs to, and each group's members.
struct Schedule {
    /// Group (in the stored, natural layout) of each position.
    group: Vec<usize>,
    /// Positions of group g's members, ascending: `members[g·G .. (g+1)·G]`.
    members: Vec<usize>,
    /// Per tier of T inputs (tiered lattices): the position of its first member.
    tier_first: Vec<usize>,
    /// Inputs per tier (K when there are no tiers).
    tier: usize,
    /// Position → input.
    input: Vec<usize>,
    /// Input → position.
    position: Vec<usize>,
}

impl Schedule {
    fn new(perm: Option<&[usize]>, k: usize, gs: usize, tier: Option<usize>) -> Self {
        let input: Vec<usize> = perm.map_or_else(|| (0..k).collect(), <[usize]>::to_vec);
        let group: Vec<usize> = input.iter().map(|&c| c / gs).collect();
        let mut position = vec![0usize; k];
        for (pos, &c) in input.iter().enumerate() {
            position[c] = pos;
        }
        let mut members = vec![0usize; k];
        let mut filled = vec![0usize; k / gs];
        for (pos, &g) in group.iter().enumerate() {
            members[g * gs + filled[g]] = pos;
            filled[g] += 1;
        }
        let tier = tier.unwrap_or(k);
        let mut tier_first = vec![usize::MAX; k / tier];
        for (pos, &c) in input.iter().enumerate() {
            let t = &mut tier_first[c / tier];
            *t = (*t).min(pos);
        }
        Schedule {
            group,
            members,
            tier_first,
            tier,
            input,
            position,
        }
    }

    fn members(&self, g: usize, gs: usize) -> &[usize] {
        &self.members[g * gs..(g + 1) * gs]
    }
}

impl GptqSolver {
    /// Dead inputs, damping (1 % of mean diag by default, +0.01 per Cholesky
    /// failure, logged with `name`) and the inverse upper factor.
    pub fn new(name: &str, h: &Hessian, damp: f64) -> Result<Self, GptqError> {
        Self::with_order(name, h, damp, Order::Natural)
    }

    /// [`GptqSolver::new`] visiting the inputs in `order`.
    pub fn with_order(name: &str, h: &Hessian, damp: f64, order: Order) -> Result<Self, GptqError> {
        if !h.is_finite() {
            return Err(GptqError::NonFiniteHessian(name.into()));
        }
        let k = h.dim();
        let inv_n = 1.0 / h.tokens().max(1) as f64;
        // Inputs never active on the calibration set get H[i,i] = 1 so the factor exists.
        let dead: Vec<bool> = h.diag().iter().map(|&d| d == 0.0).collect();
        let diag = |i: usize| {
            if dead[i] {
                1.0
            } else {
                h.upper(i, i) * inv_n
            }
        };
        let mean_diag = (0..k).map(diag).sum::<f64>() / k as f64;
        let perm = match order {
            Order::Natural => None,
            Order::ActStatic => {
                let mut p: Vec<usize> = (0..k).collect();
                // Descending diag, ties by input index (tools/gptq_ref.py sorts the same way).
                p.sort_by(|&a, &b| diag(b).total_cmp(&diag(a)).then(a.cmp(&b)));
                Some(p)
            }
        };
        let input = |pos: usize| perm.as_ref().map_or(pos, |p| p[pos]);
        let mut damp = damp;
        let (u, lambda) = loop {
            let add = damp * mean_diag;
            let damped = |a: usize, b: usize| {
                let (x, y) = (input(a), input(b));
                if x == y {
                    diag(x) + add
                } else {
                    h.upper(x.min(y), x.max(y)) * inv_n
                }
            };
            if let Some(u) = inverse_upper_factor(damped, k) {
                break (u, add);
            }
            if damp >= 1.0 {
                return Err(GptqError::Cholesky(name.into(), damp));
            }
            let next = (damp + 0.01).min(1.0);
            warn(&format!(
                "{name}: Cholesky failed with damping {damp:.3}; retrying with {next:.3}"
            ));
            damp = next;
        };
        // The scale search weighs input i by 1/U[i,i]², the weight GPTQ's own
        // objective gives column i's rounding error ((w − q)²/d²). Measured on the
        // trained fixture (docs/QUANTIZE.md): better than diag(H) and never worse
        // than max/7.5 on any linear, where diag(H) lost on one.
        let imp: Vec<f32> = (0..k)
            .map(|i| 1.0 / (u[i * k + i] * u[i * k + i]))
            .collect();
        let dead = (0..k).map(|pos| dead[input(pos)]).collect();
        Ok(GptqSolver {
            name: name.into(),
            k,
            perm,
            u,
            imp,
            dead,
            damp_used: damp,
            lambda,
        })
    }

    /// Input features of the linears this solver serves.
    pub fn dim(&self) -> usize {
        self.k
    }

    pub fn order(&self) -> Order {
        if self.perm.is_some() {
            Order::ActStatic
        } else {
            Order::Natural
        }
    }

    pub fn dead_columns(&self) -> usize {
        self.dead.iter().filter(|d| **d).count()
    }

    /// Quantize `w` (`[n, k]`, PyTorch order).
    pub fn quantize(
        &self,
        w: &[f32],
        n: usize,
        cfg: &GptqConfig,
    ) -> Result<QuantizedWeight, GptqError> {
        self.quantize_timed(w, n, cfg).map(|s| s.q)
    }

    /// [`GptqSolver::quantize`], also saying where the time went and what error it left.
    pub fn quantize_timed(
        &self,
        w: &[f32],
        n: usize,
        cfg: &GptqConfig,
    ) -> Result<Solution, GptqError> {
        self.solve(w, n, cfg, None)
    }

    /// GPTQ's codes for given group scales (`[K/G, N]`, stored values): the error feedback of the
    /// solve, with the scales held fixed instead of chosen as each group is reached.
    pub fn quantize_with_scales(
        &self,
        w: &[f32],
        n: usize,
        cfg: &GptqConfig,
        scales: &[f32],
    ) -> Result<Solution, GptqError> {
        if scales.len() != self.k / cfg.group_size.max(1) * n {
            return Err(GptqError::Shape(self.name.clone(), self.k, cfg.group_size));
        }
        self.solve(w, n, cfg, Some(scales))
    }

    fn solve(
        &self,
        w: &[f32],
        n: usize,
        cfg: &GptqConfig,
        given: Option<&[f32]>,
    ) -> Result<Solution, GptqError> {
        let (k, gs, bs) = (self.k, cfg.group_size, cfg.block_size);
        if k % gs != 0 || bs % gs != 0 || w.len() != n * k {
            return Err(GptqError::Shape(self.name.clone(), k, gs));
        }
        if let Some(t) = cfg.grid.tier_of(k) {
            if t % gs != 0 || k % t != 0 {
                return Err(GptqError::Shape(self.name.clone(), k, t));
            }
            if given.is_some() {
                return Err(GptqError::GivenTiered(self.name.clone()));
            }
        }
        if !w.iter().all(|x| x.is_finite()) {
            return Err(GptqError::NonFiniteWeights(self.name.clone()));
        }
        // Each output row is its own problem given U: the rows are solved in column blocks of
        // `wt`, one job per block, in lockstep over the K blocks (one fork-join per 128 inputs,
        // not per input), so both cores stay busy through the column loop as well as the flush.
        let threads = rayon::current_num_threads().max(1);
        let width = n.div_ceil(4 * threads).max(64).min(n);
        let sched = Schedule::new(self.perm.as_deref(), k, gs, cfg.grid.tier_of(k));
        let mut chunks: Vec<RowChunk> = (0..n)
            .step_by(width)
            .map(|r0| {
                let mut c = RowChunk::new(w, k, r0..(r0 + width).min(n), self, &sched, gs, bs);
                if let Some(s) = given {
                    c.fix_scales(s, n);
                }
                c
            })
            .collect();
        let solve = Clock::start();
        let mut ut = Vec::new();
        for i1 in (0..k).step_by(bs) {
            let i2 = (i1 + bs).min(k);
            // U[i1..i2, i2..]ᵀ, shared by every chunk's flush.
            let (rest, b) = (k - i2, i2 - i1);
            ut.clear();
            ut.resize(rest * b, 0f32);
            let u = &self.u;
            ut.par_chunks_mut(b).enumerate().for_each(|(c, row)| {
                for (r, v) in row.iter_mut().enumerate() {
                    *v = u[(i1 + r) * k + i2 + c];
                }
            });
            let ut = &ut;
            let sched = &sched;
            chunks
                .par_iter_mut()
                .for_each(|c| c.block(self, sched, cfg, i1, i2, ut));
        }
        let wall = solve.elapsed();
        // The threads' time per sub-phase, scaled to the solve's wall and CPU time.
        let mut sum = SolveTimes::default();
        for c in &chunks {
            sum += c.times;
        }
        let total = sum.search.seconds + sum.columns.seconds + sum.flush.seconds;
        let share = |x: Spent| {
            let f = if total > 0.0 { x.seconds / total } else { 0.0 };
            Spent {
                seconds: wall.seconds * f,
                cpu_seconds: wall.cpu_seconds * f,
            }
        };
        let times = SolveTimes {
            search: share(sum.search),
            columns: share(sum.columns),
            flush: share(sum.flush),
        };
        let error = self.undamped(&chunks, w, &sched, cfg);
        let mut scales = vec![0f32; k / gs * n];
        let mut codes = vec![0u8; k * n];
        // Back to one [k, n] layout in input order: input kk was solved at `sched.position[kk]`.
        let gather = |dst: &mut [u8], kk: usize| {
            let pos = sched.position[kk];
            for c in &chunks {
                let nc = c.r1 - c.r0;
                dst[c.r0..c.r1].copy_from_slice(&c.codes[pos * nc..(pos + 1) * nc]);
            }
        };
        codes
            .par_chunks_mut(n)
            .enumerate()
            .for_each(|(kk, row)| gather(row, kk));
        let rows_of = |dst: &mut [f32], of: fn(&RowChunk) -> &[f32]| {
            for (g, row) in dst.chunks_mut(n).enumerate() {
                for c in &chunks {
                    let nc = c.r1 - c.r0;
                    row[c.r0..c.r1].copy_from_slice(&of(c)[g * nc..(g + 1) * nc]);
                }
            }
        };
        rows_of(&mut scales, |c| &c.scales);
        let mut tier_scales = vec![0f32; cfg.grid.tier_of(k).map_or(0, |t| k / t * n)];
        rows_of(&mut tier_scales, |c| &c.tier_d);
        let q = QuantizedWeight {
            in_features: k,
            out_features: n,
            group_size: gs,
            codes,
            scales,
            grid: cfg.grid,
            tier_scales,
        };
        Ok(Solution { q, times, error })
    }

    /// tr(ΔHΔᵀ) from the solve's column errors. With H' = H + λI (dead inputs: 1 + λ) and
    /// H'⁻¹ = UᵀU, GPTQ leaves W̃ − Ŵ = E·U, E the column errors divided by U's diagonal, so
    /// tr((W̃ − Ŵ)H'(W̃ − Ŵ)ᵀ) = ‖E‖² exactly; W̃ is W with dead inputs zeroed, which H does not
    /// see. What the damping and the dead inputs' unit diagonal add is taken off again.
    fn undamped(&self, chunks: &[RowChunk], w: &[f32], sched: &Schedule, cfg: &GptqConfig) -> f64 {
        let k = self.k;
        let undamped: f64 = chunks
            .par_iter()
            .map(|c| {
                let nc = c.r1 - c.r0;
                let mut extra = 0f64;
                for pos in 0..k {
                    let (kk, g) = (sched.input[pos], sched.group[pos]);
                    let weight = self.lambda + if self.dead[pos] { 1.0 } else { 0.0 };
                    let mut sq = 0f64;
                    for j in 0..nc {
                        let orig = if self.dead[pos] {
                            0.0
                        } else {
                            w[(c.r0 + j) * k + kk]
                        };
                        let q = cfg
                            .grid
                            .dequant(c.codes[pos * nc + j], c.scales[g * nc + j]);
                        let d = (orig - q) as f64;
                        sq += d * d;
                    }
                    extra += weight * sq;
                }
                c.loss - extra
            })
            .sum();
        // Rounding can take an exact zero a hair below it.
        undamped.max(0.0)
    }
}

/// Output rows `r0..r1` of one GPTQ solve, in the transposed layout (`[k, r1 − r0]`).
struct RowChunk {
    r0: usize,
    r1: usize,
    wt: Vec<f32>,
    codes: Vec<u8>,
    scales: Vec<f32>,
    /// `[K/T, nc]`: the tier scales of a tiered lattice.
    tier_d: Vec<f32>,
    err: Vec<f32>,
    upd: Vec<f32>,
    /// A group's weights: `[G, nc]` as gathered, `[nc, G]` as searched.
    rows: Vec<f32>,
    buf: Vec<f32>,
    imp: Vec<f32>,
    /// Scales given up front ([`GptqSolver::quantize_with_scales`]), not chosen per group.
    fixed: bool,
    /// Wall time of this chunk's job in each sub-phase (one busy thread).
    times: SolveTimes,
    /// Σ of the squared scaled column errors (GPTQ's loss with the damped H).
    loss: f64,
}

impl RowChunk {
    /// The chunk of output rows `r0..r1` of `w` (`[n, k]`).
    fn new(
        w: &[f32],
        k: usize,
        Range { start: r0, end: r1 }: Range<usize>,
        s: &GptqSolver,
        sched: &Schedule,
        gs: usize,
        bs: usize,
    ) -> Self {
        let nc = r1 - r0;
        let mut wt = vec![0f32; k * nc];
        for (pos, row) in wt.chunks_mut(nc).enumerate() {
            if s.dead[pos] {
                // Never active: the weight is irrelevant, zero makes it exact.
                continue;
            }
            let kk = sched.input[pos];
            for (j, v) in row.iter_mut().enumerate() {
                *v = w[(r0 + j) * k + kk];
            }
        }
        RowChunk {
            r0,
            r1,
            wt,
            codes: vec![0u8; k * nc],
            scales: vec![0f32; k / gs * nc],
            tier_d: vec![0f32; k / sched.tier.max(1) * nc],
            err: vec![0f32; bs * nc],
            upd: Vec::new(),
            rows: Vec::new(),
            buf: Vec::new(),
            imp: vec![0f32; gs],
            fixed: false,
            times: SolveTimes::default(),
            loss: 0.0,
        }
    }

    /// This chunk's rows of `scales` (`[K/G, n]`).
    fn fix_scales(&mut self, scales: &[f32], n: usize) {
        let nc = self.r1 - self.r0;
        for (g, row) in self.scales.chunks_mut(nc).enumerate() {
            row.copy_from_slice(&scales[g * n + self.r0..g * n + self.r1]);
        }
        self.fixed = true;
    }

    /// Group `g`'s current weights, row by row, into `buf` (`[nc, G]`: row `nn`'s G weights are
    /// contiguous) and its importances into `imp`, at position `i` of `block` (`i1..i2`). In-block
    /// updates go to `wt` directly; a member in a later block (act order) has not had this
    /// block's columns so far flushed into it yet, so they are applied here.
    fn load_group(
        &mut self,
        s: &GptqSolver,
        sched: &Schedule,
        (g, gs): (usize, usize),
        Range { start: i1, end: i2 }: Range<usize>,
        i: usize,
    ) {
        let (k, nc, u) = (s.k, self.r1 - self.r0, &s.u);
        let members = sched.members(g, gs);
        // The members' rows of `wt` ([G, nc]), then one transpose: rows of `wt` are contiguous,
        // a row's group is not.
        self.rows.clear();
        for (j, &m) in members.iter().enumerate() {
            self.rows.extend_from_slice(&self.wt[m * nc..(m + 1) * nc]);
            if m >= i2 {
                let row = &mut self.rows[j * nc..];
                for p in i1..i {
                    let f = u[p * k + m];
                    let e = &self.err[(p - i1) * nc..(p - i1 + 1) * nc];
                    row.iter_mut().zip(e).for_each(|(v, e)| *v -= f * e);
                }
            }
            self.imp[j] = s.imp[m];
        }
        self.buf.resize(nc * gs, 0.0);
        for (j, row) in self.rows.chunks_exact(nc).enumerate() {
            for (nn, &v) in row.iter().enumerate() {
                self.buf[nn * gs + j] = v;
            }
        }
    }

    /// Positions `i1..i2`: a group's scale where its first member is reached, codes and
    /// in-block error feedback column by column, then the lazy update of every later position
    /// by this block's errors.
    fn block(
        &mut self,
        s: &GptqSolver,
        sched: &Schedule,
        cfg: &GptqConfig,
        i1: usize,
        i2: usize,
        ut: &[f32],
    ) {
        let (k, gs) = (s.k, cfg.group_size);
        let nc = self.r1 - self.r0;
        let u = &s.u;
        let start = std::time::Instant::now();
        let mut searched = 0.0;
        let grid = &cfg.grid;
        for i in i1..i2 {
            let g = sched.group[i];
            let tier = sched.input[i] / sched.tier;
            if grid.tier_of(sched.tier).is_some() && sched.tier_first[tier] == i {
                // A tier's d when its first member is reached: from the free scales its groups
                // would choose on the weights as updated by then.
                let t = std::time::Instant::now();
                let (per, g0) = (sched.tier / gs, tier * sched.tier / gs);
                let mut free = vec![0f32; nc * per];
                for j in 0..per {
                    self.load_group(s, sched, (g0 + j, gs), i1..i2, i);
                    for nn in 0..nc {
                        free[nn * per + j] = grid.untiered().group_scale(
                            &self.buf[nn * gs..(nn + 1) * gs],
                            &self.imp,
                            cfg.rule.positive(),
                            0.0,
                        );
                    }
                }
                for nn in 0..nc {
                    self.tier_d[tier * nc + nn] = grid.tier_scale(&free[nn * per..(nn + 1) * per]);
                }
                searched += t.elapsed().as_secs_f64();
            }
            if sched.members(g, gs)[0] == i && !self.fixed {
                let t = std::time::Instant::now();
                self.load_group(s, sched, (g, gs), i1..i2, i);
                for nn in 0..nc {
                    let d = self.tier_d[tier * nc + nn];
                    self.scales[g * nc + nn] =
                        grid.group_scale(&self.buf[nn * gs..(nn + 1) * gs], &self.imp, cfg.rule, d);
                }
                searched += t.elapsed().as_secs_f64();
            }
            let d = u[i * k + i];
            let (head, tail) = self.wt.split_at_mut((i + 1) * nc);
            let row = &head[i * nc..];
            let err = &mut self.err[(i - i1) * nc..(i - i1 + 1) * nc];
            for nn in 0..nc {
                let sc = self.scales[g * nc + nn];
                let q = grid.code(row[nn], sc);
                self.codes[i * nc + nn] = q;
                err[nn] = (row[nn] - grid.dequant(q, sc)) / d;
            }
            self.loss += err.iter().map(|&e| e as f64 * e as f64).sum::<f64>();
            let err = &self.err[(i - i1) * nc..(i - i1 + 1) * nc];
            for (j, r) in tail[..(i2 - i - 1) * nc].chunks_mut(nc).enumerate() {
                let uij = u[i * k + i + 1 + j];
                r.iter_mut().zip(err).for_each(|(x, e)| *x -= uij * e);
            }
        }
        let in_block = start.elapsed().as_secs_f64();
        let spent = |seconds| Spent {
            seconds,
            cpu_seconds: seconds,
        };
        self.times.search += spent(searched);
        self.times.columns += spent(in_block - searched);
        // Lazy batch flush: wt[i2.., :] -= U[i1..i2, i2..]ᵀ · Err.
        let t = std::time::Instant::now();
        if i2 < k {
            let (rest, b) = (k - i2, i2 - i1);
            self.upd.clear();
            self.upd.resize(rest * nc, 0f32);
            matmul_nn(ut, rest, b, &self.err[..b * nc], nc, &mut self.upd, false);
            self.wt[i2 * nc..]
                .iter_mut()
                .zip(&self.upd)
                .for_each(|(x, d)| *x -= d);
        }
        self.times.flush += spent(t.elapsed().as_secs_f64());
    }
}

/// One-shot GPTQ of a single linear (tests and small tools).
pub fn gptq(
    name: &str,
    w: &[f32],
    n: usize,
    k: usize,
    h: &Hessian,
    cfg: &GptqConfig,
) -> Result<GptqResult, GptqError> {
    if h.dim() != k {
        return Err(GptqError::Shape(name.into(), k, cfg.group_size));
    }
    let solver = GptqSolver::new(name, h, cfg.damp)?;
    let weight = solver.quantize(w, n, cfg)?;
    Ok(GptqResult {
        weight,
        damp_used: solver.damp_used,
        dead_columns: solver.dead_columns(),
    })
}

/// `c[m, n] = a[m, k] · b[k, n]`, row-major; on the rayon pool when `parallel`.
pub(crate) fn matmul_nn(
    a: &[f32],
    m: usize,
    k: usize,
    b: &[f32],
    n: usize,
    c: &mut [f32],
    parallel: bool,
) {
    matmul_strided_a(a, (1, k), (m, k, n), b, c, parallel);
}

/// `c[m, n] = aᵀ · b` for `a` `[k, m]` and `b` `[k, n]`, row-major: `a` read through its strides,
/// with no transposed copy (the `gemm` crate packs its operands the same way whatever their
/// strides, so the result has the bits of [`matmul_nn`] on a transposed copy).
pub(crate) fn matmul_tn(
    a: &[f32],
    m: usize,
    k: usize,
    b: &[f32],
    n: usize,
    c: &mut [f32],
    parallel: bool,
) {
    matmul_strided_a(a, (m, 1), (m, k, n), b, c, parallel);
}

/// `c[m, n] = A · b` with A (`[m, k]`) element (i, l) at `a[l·a_cs + i·a_rs]`.
fn matmul_strided_a(
    a: &[f32],
    (a_cs, a_rs): (usize, usize),
    (m, k, n): (usize, usize, usize),
    b: &[f32],
    c: &mut [f32],
    parallel: bool,
) {
    // bᵀ as an [n, k] "weight" would need a copy; call gemm with strides instead.
    let threads = rayon::current_num_threads();
    let par = if parallel && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    assert_eq!((a.len(), b.len(), c.len()), (m * k, k * n, m * n));
    // SAFETY: c and b are dense row-major buffers of the asserted sizes; a holds m·k values
    // whose strides are one of the two dense layouts (callers above).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

fn warn(msg: &str) {
    eprintln!("warning: {msg}");
}

/// Relative output error ‖(W − Q)X‖² / ‖WX‖² = tr(Δ H Δᵀ) / tr(W H Wᵀ), from the Hessian alone.
pub fn relative_output_error(w: &[f32], q: &[f32], n: usize, k: usize, h: &Hessian) -> f64 {
    relative_output_error_with(w, q, n, k, &h.matrix_f32())
}

/// [`relative_output_error`] with H given as [`Hessian::matrix_f32`], for several linears or
/// variants measured against one Hessian.
pub fn relative_output_error_with(w: &[f32], q: &[f32], n: usize, k: usize, hm: &[f32]) -> f64 {
    let (num, den) = output_error_parts(w, q, n, k, hm);
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

/// (‖(W − Q)X‖², ‖WX‖²) from the Hessian: sums over output rows, so blocks of rows add up.
pub fn output_error_parts(w: &[f32], q: &[f32], n: usize, k: usize, hm: &[f32]) -> (f64, f64) {
    (difference_form(w, q, n, k, hm), quadratic_form(w, n, k, hm))
}

/// tr(ΔHΔᵀ) for Δ = W − Ŵ (`w` `[n, k]`, `hm` from [`Hessian::matrix_f32`]): the numerator of
/// [`output_error_parts`] for weights no GPTQ solve produced (RTN, refitted scales, descent).
pub fn delta_form(w: &[f32], q: &QuantizedWeight, hm: &[f32]) -> f64 {
    difference_form(w, &q.dequantize(), q.out_features, q.in_features, hm)
}

/// tr((W − Q)H(W − Q)ᵀ) for dequantized `q`.
fn difference_form(w: &[f32], q: &[f32], n: usize, k: usize, hm: &[f32]) -> f64 {
    let delta: Vec<f32> = w.par_iter().zip(q).map(|(a, b)| a - b).collect();
    quadratic_form(&delta, n, k, hm)
}

/// `out[n, cols] = d[:, r0..r0+rows] · H[r0..r0+rows, c0..c0+cols]` for `d` `[n, k]` and `h` `[k, k]`
/// (row-major, single-threaded: callers run one block per job).
pub(crate) fn rows_times_block(
    d: &[f32],
    n: usize,
    k: usize,
    h: &[f32],
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    out: &mut [f32],
) {
    assert!(d.len() >= n * k && h.len() >= k * k && out.len() >= n * cols);
    assert!(r0 + rows <= k && c0 + cols <= k);
    // out is [n, cols] (rs cols); lhs = columns r0.. of d ([n, rows], rs k); rhs =
    // H[r0.., c0..] ([rows, cols], rs k).
    // SAFETY: out holds n rows of cols values (asserted).
    unsafe {
        crate::kernels::gemm_strided(
            (n, cols, rows),
            (out.as_mut_ptr(), cols),
            (&d[r0..], k),
            (&h[r0 * k + c0..], k, 1),
            gemm::Parallelism::None,
        )
    }
}

/// Side of the blocks of H in [`quadratic_form`].
const QF_BLOCK: usize = 256;

/// Σ_rows d_r H d_rᵀ for `d` `[n, k]` and a symmetric `h` `[k, k]`: by blocks
/// of H on and above the diagonal (off-diagonal ones counted twice), so half
/// the multiply-adds of D·H; one GEMM job per block.
pub fn quadratic_form(d: &[f32], n: usize, k: usize, h: &[f32]) -> f64 {
    assert_eq!((d.len(), h.len()), (n * k, k * k));
    let nb = k.div_ceil(QF_BLOCK);
    let pairs: Vec<(usize, usize)> = (0..nb).flat_map(|i| (i..nb).map(move |j| (i, j))).collect();
    pairs
        .par_iter()
        .map_init(Vec::new, |p, &(bi, bj)| {
            let (r0, c0) = (bi * QF_BLOCK, bj * QF_BLOCK);
            let (rows, cols) = ((k - r0).min(QF_BLOCK), (k - c0).min(QF_BLOCK));
            p.clear();
            p.resize(n * cols, 0f32);
            rows_times_block(d, n, k, h, (r0, rows), (c0, cols), p);
            let part: f64 = p
                .chunks_exact(cols)
                .enumerate()
                .map(|(r, pr)| {
                    pr.iter()
                        .zip(&d[r * k + c0..r * k + c0 + cols])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                })
                .sum();
            if bi == bj {
                part
            } else {
                2.0 * part
            }
        })
        .sum()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Correlated inputs, as real activations are, so error feedback has something to exploit.
    pub(crate) fn case(n: usize, k: usize, tokens: usize) -> (Vec<f32>, Hessian) {
        let mut s = 3u64;
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut s) * 0.1).collect();
        let base: Vec<f32> = (0..tokens * 4).map(|_| lcg(&mut s)).collect();
        let mix: Vec<f32> = (0..4 * k).map(|_| lcg(&mut s)).collect();
        let mut x = vec![0f32; tokens * k];
        for t in 0..tokens {
            for c in 0..k {
                x[t * k + c] = (0..4)
                    .map(|j| base[t * 4 + j] * mix[j * k + c])
                    .sum::<f32>()
                    + 0.1 * lcg(&mut s);
            }
        }
        let mut h = Hessian::new(k);
        h.add(&x, tokens);
        (w, h)
    }

    #[test]
    fn every_gguf_and_lpbq_grid_solves_onto_its_lattice_and_beats_rounding() {
        let (n, k) = (24, 512);
        let (w, h) = case(n, k, 1024);
        let (fp16, tiered) = (Grid::fp16, Grid::tiered);
        for (grid, gs) in [
            (fp16(4), 32),
            (fp16(8), 32),
            (tiered(4, 63), 32),
            (tiered(6, 127), 16),
            (Grid::LPBQ, 64),
            (Grid::LPBQ, 128),
        ] {
            let tier = grid.tier_of(k).unwrap_or(k);
            let orders = [Order::Natural, Order::ActStatic];
            let rules = [ScaleRule::Search, ScaleRule::SignedSearch];
            for (order, rule) in orders.into_iter().flat_map(|o| rules.map(|r| (o, r))) {
                let solver = GptqSolver::with_order("t", &h, 0.01, order).unwrap();
                let cfg = GptqConfig {
                    group_size: gs,
                    block_size: 128,
                    damp: 0.01,
                    rule,
                    grid,
                };
                let q = solver.quantize(&w, n, &cfg).unwrap();
                assert!(q.codes.iter().all(|&c| (c as i32) <= grid.qmax()));
                for (i, &s) in q.scales.iter().enumerate() {
                    let (g, nn) = (i / n, i % n);
                    let d = q
                        .tier_scales
                        .get((g * gs / tier) * n + nn)
                        .copied()
                        .unwrap_or(0.0);
                    assert_eq!(
                        grid.stored(s, d),
                        s,
                        "{grid:?}: scale {s} is off its lattice"
                    );
                }
                assert_eq!(
                    q.tier_scales.len(),
                    grid.tier_of(k).map_or(0, |t| k / t * n)
                );
                // Only the free lattices take a sign; a tiered one's d and multipliers stay
                // positive whatever the rule asks.
                let negative = q.scales.iter().filter(|&&s| s < 0.0).count();
                match (grid.tier_of(k), rule) {
                    (None, ScaleRule::SignedSearch) => assert!(negative > 0, "{grid:?}"),
                    _ => assert_eq!(negative, 0, "{grid:?} {rule:?}"),
                }
                assert!(q.tier_scales.iter().all(|&d| d > 0.0), "{grid:?} {rule:?}");
                if grid == Grid::LPBQ {
                    assert!(q
                        .tier_scales
                        .iter()
                        .all(|&g| crate::quant::grid::is_lpbq_gamma(g)));
                }
                let r = rtn(&w, n, k, &h, gs, rule, grid);
                let e = |q: &QuantizedWeight| relative_output_error(&w, &q.dequantize(), n, k, &h);
                assert!(
                    e(&q) < e(&r),
                    "{grid:?} {order:?}: gptq {} vs rtn {}",
                    e(&q),
                    e(&r)
                );
            }
        }
    }

    /// U is upper triangular and UᵀU·(H + λI) = I, on sizes around the copy's 64-row blocks.
    #[test]
    fn the_inverse_upper_factor_inverts_the_damped_hessian() {
        let mut seed = 11u64;
        for k in [1usize, 2, 63, 64, 65, 150] {
            let x: Vec<f32> = (0..(k + 8) * k).map(|_| lcg(&mut seed)).collect();
            let mut h = Hessian::new(k);
            h.add(&x, k + 8);
            let hm = |a: usize, b: usize| {
                h.upper(a.min(b), a.max(b)) / h.tokens() as f64 + if a == b { 0.1 } else { 0.0 }
            };
            let u = inverse_upper_factor(hm, k).unwrap();
            for i in 0..k {
                for j in 0..k {
                    if j < i {
                        assert_eq!(u[i * k + j], 0.0, "k {k}: U[{i},{j}] below the diagonal");
                    }
                    // (UᵀU·H)[i, j] = Σ_a U[a, i] Σ_b U[a, b] H[b, j]
                    let v: f64 = (0..k)
                        .map(|a| {
                            let uh: f64 = (a..k).map(|b| u[a * k + b] as f64 * hm(b, j)).sum();
                            u[a * k + i] as f64 * uh
                        })
                        .sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((v - want).abs() < 1e-3, "k {k}: (UᵀU·H)[{i},{j}] = {v}");
                }
            }
        }
    }

    /// aᵀ·b through a's strides has the bits of the same GEMM on a transposed copy.
    #[test]
    fn the_strided_transpose_product_is_the_copied_ones() {
        let mut seed = 5u64;
        for (m, k, n) in [(37, 300, 129), (64, 1000, 96), (1, 7, 3)] {
            let a: Vec<f32> = (0..k * m).map(|_| lcg(&mut seed)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
            let mut at = vec![0f32; m * k];
            for l in 0..k {
                for i in 0..m {
                    at[i * k + l] = a[l * m + i];
                }
            }
            for parallel in [false, true] {
                let (mut want, mut got) = (vec![0f32; m * n], vec![0f32; m * n]);
                matmul_nn(&at, m, k, &b, n, &mut want, parallel);
                matmul_tn(&a, m, k, &b, n, &mut got, parallel);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "({m}, {k}, {n})");
            }
        }
    }

    #[test]
    fn gptq_beats_rtn_and_search_beats_plain() {
        let (n, k) = (32, 256);
        let (w, h) = case(n, k, 512);
        let cfg = GptqConfig {
            group_size: 64,
            block_size: 128,
            damp: 0.01,
            rule: ScaleRule::MaxOver7_5,
            grid: Grid::VLLM,
        };
        let plain = gptq("t", &w, n, k, &h, &cfg).unwrap();
        let search = gptq(
            "t",
            &w,
            n,
            k,
            &h,
            &GptqConfig {
                rule: ScaleRule::Search,
                grid: Grid::VLLM,
                ..cfg
            },
        )
        .unwrap();
        let r = rtn(&w, n, k, &h, 64, ScaleRule::MaxOver7_5, Grid::VLLM);
        let e = |q: &QuantizedWeight| relative_output_error(&w, &q.dequantize(), n, k, &h);
        let (er, ep, es) = (e(&r), e(&plain.weight), e(&search.weight));
        assert!(ep < er, "gptq {ep} vs rtn {er}");
        assert!(es <= ep, "search {es} vs plain {ep}");
    }

    #[test]
    fn blocks_of_output_rows_solve_to_the_same_codes_as_the_whole() {
        // What lets the head be quantized a block of rows at a time.
        let (n, k) = (48, 256);
        let (w, h) = case(n, k, 512);
        let cfg = GptqConfig {
            group_size: 64,
            block_size: 128,
            damp: 0.01,
            rule: ScaleRule::Search,
            grid: Grid::VLLM,
        };
        let solver = GptqSolver::new("t", &h, 0.01).unwrap();
        let whole = solver.quantize(&w, n, &cfg).unwrap();
        let split = 20;
        let a = solver.quantize(&w[..split * k], split, &cfg).unwrap();
        let b = solver.quantize(&w[split * k..], n - split, &cfg).unwrap();
        for kk in 0..k {
            let row = &whole.codes[kk * n..(kk + 1) * n];
            assert_eq!(&row[..split], &a.codes[kk * split..(kk + 1) * split]);
            assert_eq!(
                &row[split..],
                &b.codes[kk * (n - split)..(kk + 1) * (n - split)]
            );
        }
        for g in 0..k / 64 {
            assert_eq!(
                &whole.scales[g * n..g * n + split],
                &a.scales[g * split..(g + 1) * split]
            );
        }
        let hm = h.matrix_f32();
        let parts =
            |q: &QuantizedWeight, w: &[f32], n| output_error_parts(w, &q.dequantize(), n, k, &hm);
        let (pa, pb, pw) = (
            parts(&a, &w[..split * k], split),
            parts(&b, &w[split * k..], n - split),
            parts(&whole, &w, n),
        );
        assert!(
            ((pa.0 + pb.0) - pw.0).abs() <= 1e-9 * pw.0
                && ((pa.1 + pb.1) - pw.1).abs() <= 1e-9 * pw.1
        );
    }

    #[test]
    fn the_solves_own_loss_is_its_output_error() {
        // GPTQ's column errors give tr(ΔHΔᵀ) exactly (up to f32 rounding) for every grid, order,
        // scale rule, dead input and damping, and for given scales; heavier damping makes the
        // damping's share of the loss larger, so a wrong correction would show there.
        let (n, k) = (24, 256);
        let (w, mut h) = case(n, k, 512);
        h.zero_input(7);
        let hm = h.matrix_f32();
        for (grid, gs) in [
            (Grid::VLLM, 32),
            (Grid::tiered(4, 63), 32),
            (Grid::LPBQ, 64),
        ] {
            for order in [Order::Natural, Order::ActStatic] {
                for (rule, damp) in [(ScaleRule::MaxOver7_5, 0.01), (ScaleRule::Search, 0.5)] {
                    let solver = GptqSolver::with_order("t", &h, damp, order).unwrap();
                    let cfg = GptqConfig {
                        group_size: gs,
                        block_size: 64,
                        damp,
                        rule,
                        grid,
                    };
                    let mut solves = vec![solver.quantize_timed(&w, n, &cfg).unwrap()];
                    if grid.tier_of(k).is_none() {
                        let scales: Vec<f32> = solves[0].q.scales.iter().map(|s| s * 1.1).collect();
                        solves.push(solver.quantize_with_scales(&w, n, &cfg, &scales).unwrap());
                    }
                    for s in solves {
                        let want = delta_form(&w, &s.q, &hm);
                        assert!(
                            (s.error - want).abs() <= 1e-4 * want,
                            "{grid:?} {order:?} {rule:?} damp {damp}: {} vs {want}",
                            s.error
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn quadratic_form_by_upper_blocks_matches_the_plain_sum() {
        let mut s = 5u64;
        for (n, k) in [(3, 7), (5, QF_BLOCK + 13), (2, 2 * QF_BLOCK + 1)] {
            let d: Vec<f32> = (0..n * k).map(|_| lcg(&mut s)).collect();
            let a: Vec<f32> = (0..k * k).map(|_| lcg(&mut s)).collect();
            // A symmetric H.
            let h: Vec<f32> = (0..k * k).map(|i| a[i] + a[(i % k) * k + i / k]).collect();
            let want: f64 = (0..n)
                .map(|r| {
                    (0..k)
                        .flat_map(|i| (0..k).map(move |j| (i, j)))
                        .map(|(i, j)| {
                            d[r * k + i] as f64 * h[i * k + j] as f64 * d[r * k + j] as f64
                        })
                        .sum::<f64>()
                })
                .sum();
            let got = quadratic_form(&d, n, k, &h);
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "n {n} k {k}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn dead_columns_are_zeroed_and_exact() {
        let (n, k) = (16, 128);
        let (w, mut h) = case(n, k, 256);
        h.zero_input(5);
        let r = gptq(
            "t",
            &w,
            n,
            k,
            &h,
            &GptqConfig {
                group_size: 32,
                block_size: 128,
                damp: 0.01,
                rule: ScaleRule::Search,
                grid: Grid::VLLM,
            },
        )
        .unwrap();
        assert_eq!(r.dead_columns, 1);
        let dq = r.weight.dequantize();
        assert!((0..n).all(|row| dq[row * k + 5] == 0.0));
    }

    #[test]
    fn singular_hessian_gets_more_damping_not_a_panic() {
        let (n, k) = (8, 64);
        let (w, _) = case(n, k, 8);
        // Rank-1 H with a negative eigen-direction perturbation: Cholesky at 1 % damping fails.
        let mut h = Hessian::new(k);
        let x: Vec<f32> = (0..k)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        h.add(&x, 1);
        h.add_diag(-0.05 * 2.0);
        let r = gptq(
            "t",
            &w,
            n,
            k,
            &h,
            &GptqConfig {
                group_size: 32,
                block_size: 64,
                damp: 0.01,
                rule: ScaleRule::MaxOver7_5,
                grid: Grid::VLLM,
            },
        )
        .unwrap();
        assert!(r.damp_used > 0.01);
    }

    #[test]
    fn nan_inputs_are_errors() {
        let (n, k) = (8, 64);
        let (mut w, h) = case(n, k, 64);
        w[3] = f32::NAN;
        let cfg = GptqConfig {
            group_size: 32,
            block_size: 64,
            damp: 0.01,
            rule: ScaleRule::MaxOver7_5,
            grid: Grid::VLLM,
        };
        assert!(
            matches!(gptq("layer.x", &w, n, k, &h, &cfg), Err(GptqError::NonFiniteWeights(s)) if s == "layer.x")
        );
    }
}
