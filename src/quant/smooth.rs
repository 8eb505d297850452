//! Input-channel smoothing before GPTQ (SmoothQuant's migration, AWQ's salience): the input of a
//! group of linears is divided per channel by 2^e and their weight columns multiplied by 2^e, with
//! the division folded into whatever produces that input (an RMSNorm weight, the rows of `v_proj`
//! or `up_proj`). In exact arithmetic the model is unchanged; what changes is what the two
//! roundings of the deployed numerics see: W4A8 rounds every token's activations to int8 against
//! its largest channel, so a few loud channels cost every other channel its resolution, and the
//! 4-bit group scales round the weights against each group's largest column.
//!
//! The factors are powers of two so that folding them into bf16 norm weights, bf16 `g_proj`
//! columns and f32 weights before quantization is exact: the only changes are the roundings the
//! smoothing is meant to trade.
//!
//! Each channel's exponent is chosen from one family, `s_j = max|x_j|^α / max|w_j|^(1−α)`
//! (SmoothQuant's), over α on a grid plus "no smoothing", by a closed-form estimate of the output
//! error each choice leaves:
//! - weights: every group's codes rounded on a step of max|w·s|/7.5 (the grid's span) give an
//!   error of step²/12 per weight, weighted by the channel's energy Σ_t (x_tj/s_j)²;
//! - activations (W4A8 only): each token rounded to int8 against max_j |x_tj/s_j| gives Δ_t²/12
//!   per channel, carried into the output by Σ_i (w_ij s_j)².
//!
//! GPTQ later removes much of the weight term; the estimate only has to rank the candidates.

/// Largest |exponent|: 2^±8 keeps every factor far from the edges of bf16 and of the 4-bit grid's
/// fp16 scales.
pub const MAX_EXP: i32 = 8;

/// The migration strengths tried (besides no smoothing).
pub const ALPHAS: [f32; 9] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9];

/// How the smoothed input is rounded when the deployed linear runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActRounding {
    /// 16-bit activations (W4A16): only the weight rounding matters.
    None,
    /// Dynamic per-token symmetric int8, ±127 (vLLM's W4A8 `int4_scaled_mm_cpu`).
    PerTokenInt8,
}

/// One smoothing problem: sample rows of the shared input and the weights that read it.
pub struct SmoothProblem<'a> {
    /// Sample rows of the input, `[rows, k]`.
    pub x: &'a [f32],
    pub rows: usize,
    pub k: usize,
    /// Every consumer's weight, `[n_i, k]` row-major.
    pub weights: &'a [(&'a [f32], usize)],
    pub group_size: usize,
    pub act: ActRounding,
    /// Channels that must share one factor (`class[j]`), e.g. the `out_proj` inputs of all query
    /// heads reading one KV head's `v` row; `None`: every channel is its own class.
    pub classes: Option<&'a [usize]>,
}

/// The chosen exponents and what the estimate said about them.
#[derive(Debug, Clone, PartialEq)]
pub struct Smoothing {
    /// One exponent per class (per channel without classes): the input is divided by 2^e.
    pub exponents: Vec<i8>,
    /// The chosen α (`None`: no smoothing won).
    pub alpha: Option<f32>,
    /// Estimated output error, chosen / unsmoothed.
    pub estimate_ratio: f64,
}

impl SmoothProblem<'_> {
    fn class(&self, j: usize) -> usize {
        self.classes.map_or(j, |c| c[j])
    }

    fn n_classes(&self) -> usize {
        self.classes
            .map_or(self.k, |c| c.iter().max().map_or(0, |m| m + 1))
    }

    /// Per-class max |x| and max |w| (over every consumer).
    fn ranges(&self) -> (Vec<f32>, Vec<f32>) {
        let nc = self.n_classes();
        let (mut ax, mut aw) = (vec![0f32; nc], vec![0f32; nc]);
        for row in self.x.chunks_exact(self.k) {
            for (j, v) in row.iter().enumerate() {
                let c = self.class(j);
                ax[c] = ax[c].max(v.abs());
            }
        }
        for &(w, n) in self.weights {
            for row in w.chunks_exact(self.k).take(n) {
                for (j, v) in row.iter().enumerate() {
                    let c = self.class(j);
                    aw[c] = aw[c].max(v.abs());
                }
            }
        }
        (ax, aw)
    }

    /// Per-class exponents of `s = ax^α / aw^(1−α)`, centred on their median so that a typical
    /// channel keeps its scale; dead channels keep e = 0.
    fn candidate(&self, ax: &[f32], aw: &[f32], alpha: f32) -> Vec<i8> {
        let logs: Vec<Option<f32>> = ax
            .iter()
            .zip(aw)
            .map(|(&x, &w)| {
                (x > 0.0 && w > 0.0).then(|| alpha * x.log2() - (1.0 - alpha) * w.log2())
            })
            .collect();
        let mut live: Vec<f32> = logs.iter().flatten().copied().collect();
        if live.is_empty() {
            return vec![0; logs.len()];
        }
        live.sort_by(f32::total_cmp);
        let mid = live[live.len() / 2];
        logs.iter()
            .map(|l| {
                l.map_or(0, |l| {
                    (l - mid).round().clamp(-MAX_EXP as f32, MAX_EXP as f32) as i8
                })
            })
            .collect()
    }

    /// The estimated output error (summed over the sample rows) of class exponents `e`.
    pub fn estimate(&self, e: &[i8]) -> f64 {
        let k = self.k;
        let f: Vec<f32> = (0..k).map(|j| pow2(e[self.class(j)])).collect();
        // Σ_t (x_tj / s_j)²
        let mut energy = vec![0f64; k];
        let mut act_steps = 0f64;
        for row in self.x.chunks_exact(k) {
            let mut m = 0f32;
            for j in 0..k {
                let v = row[j] / f[j];
                energy[j] += (v * v) as f64;
                m = m.max(v.abs());
            }
            let step = (m / 127.0) as f64;
            act_steps += step * step;
        }
        let g = self.group_size;
        let mut weight_err = 0f64;
        let mut col_sq = vec![0f64; k];
        for &(w, n) in self.weights {
            for row in w.chunks_exact(k).take(n) {
                for (gi, grp) in row.chunks(g).enumerate() {
                    let base = gi * g;
                    let mut m = 0f32;
                    let mut en = 0f64;
                    for (jj, &v) in grp.iter().enumerate() {
                        let j = base + jj;
                        let ws = v * f[j];
                        m = m.max(ws.abs());
                        en += energy[j];
                        col_sq[j] += (ws * ws) as f64;
                    }
                    let step = (m / 7.5) as f64;
                    weight_err += step * step / 12.0 * en;
                }
            }
        }
        let act_err = match self.act {
            ActRounding::None => 0.0,
            ActRounding::PerTokenInt8 => act_steps / 12.0 * col_sq.iter().sum::<f64>(),
        };
        weight_err * weight_gain() + act_err
    }

    /// The candidate with the lowest estimated output error.
    pub fn choose(&self) -> Smoothing {
        let nc = self.n_classes();
        let none = vec![0i8; nc];
        let base = self.estimate(&none);
        let mut best = Smoothing {
            exponents: none,
            alpha: None,
            estimate_ratio: 1.0,
        };
        if !(base > 0.0) {
            return best;
        }
        let (ax, aw) = self.ranges();
        let mut best_err = base;
        if let Some(a) = std::env::var("SPARK_SMOOTH_ALPHA")
            .ok()
            .and_then(|v| v.parse::<f32>().ok())
        {
            let e = self.candidate(&ax, &aw, a);
            let err = self.estimate(&e);
            return Smoothing {
                exponents: e,
                alpha: Some(a),
                estimate_ratio: err / base,
            };
        }
        for &alpha in &ALPHAS {
            let e = self.candidate(&ax, &aw, alpha);
            let err = self.estimate(&e);
            if err < best_err {
                best_err = err;
                best = Smoothing {
                    exponents: e,
                    alpha: Some(alpha),
                    estimate_ratio: err / base,
                };
            }
        }
        best
    }
}

/// 2^e exactly.
pub fn pow2(e: i8) -> f32 {
    f32::from_bits(((127 + e as i32) as u32) << 23)
}

/// `w[i, j] *= 2^e[class(j)]` for a row-major `[n, k]` weight.
pub fn scale_columns(w: &mut [f32], k: usize, e: &[i8], classes: Option<&[usize]>) {
    let f: Vec<f32> = (0..k)
        .map(|j| pow2(e[classes.map_or(j, |c| c[j])]))
        .collect();
    for row in w.chunks_exact_mut(k) {
        row.iter_mut().zip(&f).for_each(|(v, f)| *v *= f);
    }
}

/// `w[i, :] /= 2^e[i]` for a row-major `[n, k]` weight (the producer of a smoothed input).
pub fn divide_rows(w: &mut [f32], k: usize, e: &[i8]) {
    for (row, &e) in w.chunks_exact_mut(k).zip(e) {
        let f = pow2(-e);
        row.iter_mut().for_each(|v| *v *= f);
    }
}

/// `x[t, j] /= 2^e[j]` (an input already computed with the unsmoothed producer).
pub fn divide_columns(x: &mut [f32], e: &[i8]) {
    let f: Vec<f32> = e.iter().map(|&e| pow2(-e)).collect();
    for row in x.chunks_exact_mut(e.len()) {
        row.iter_mut().zip(&f).for_each(|(v, f)| *v *= f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Rows whose channel 3 is 50× louder than the rest, as in trained models' residual streams.
    fn outlier_problem(rows: usize, k: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let mut seed = 7;
        let x: Vec<f32> = (0..rows * k)
            .map(|i| lcg(&mut seed) * if i % k == 3 { 50.0 } else { 1.0 })
            .collect();
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed) * 0.05).collect();
        (x, w)
    }

    #[test]
    fn powers_of_two_are_exact() {
        for e in -MAX_EXP..=MAX_EXP {
            assert_eq!(pow2(e as i8), 2f32.powi(e));
        }
    }

    #[test]
    fn folding_leaves_the_product_unchanged_bit_for_bit() {
        let (rows, k, n) = (4, 16, 3);
        let (mut x, mut w) = outlier_problem(rows, k, n);
        let e: Vec<i8> = (0..k).map(|j| (j as i8 % 5) - 2).collect();
        let before: Vec<f32> = (0..rows * n)
            .map(|t| (0..k).map(|j| x[t / n * k + j] * w[t % n * k + j]).sum())
            .collect();
        divide_columns(&mut x, &e);
        scale_columns(&mut w, k, &e, None);
        let after: Vec<f32> = (0..rows * n)
            .map(|t| (0..k).map(|j| x[t / n * k + j] * w[t % n * k + j]).sum())
            .collect();
        assert_eq!(before, after);
    }

    #[test]
    fn an_outlier_channel_is_smoothed_for_int8_activations() {
        let (rows, k, n) = (256, 64, 32);
        let (x, w) = outlier_problem(rows, k, n);
        let weights = [(&w[..], n)];
        let p = SmoothProblem {
            x: &x,
            rows,
            k,
            weights: &weights,
            group_size: 32,
            act: ActRounding::PerTokenInt8,
            classes: None,
        };
        let s = p.choose();
        assert!(s.alpha.is_some(), "{s:?}");
        // The loud channel is divided by more than any other.
        let max = *s.exponents.iter().max().unwrap();
        assert_eq!(s.exponents[3], max);
        assert!(max > 0);
        assert!(s.estimate_ratio < 0.9, "{s:?}");
    }

    #[test]
    fn tied_channels_share_one_exponent() {
        let (rows, k, n) = (128, 16, 8);
        let (x, w) = outlier_problem(rows, k, n);
        let classes: Vec<usize> = (0..k).map(|j| j % 4).collect();
        let weights = [(&w[..], n)];
        let p = SmoothProblem {
            x: &x,
            rows,
            k,
            weights: &weights,
            group_size: 16,
            act: ActRounding::PerTokenInt8,
            classes: Some(&classes),
        };
        let s = p.choose();
        assert_eq!(s.exponents.len(), 4);
    }

    #[test]
    fn without_outliers_or_activation_rounding_nothing_much_moves() {
        let (rows, k, n) = (128, 64, 16);
        let mut seed = 3;
        let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
        let weights = [(&w[..], n)];
        let p = SmoothProblem {
            x: &x,
            rows,
            k,
            weights: &weights,
            group_size: 32,
            act: ActRounding::None,
            classes: None,
        };
        let s = p.choose();
        assert!(s.estimate_ratio > 0.8, "{s:?}");
    }
}

fn weight_gain() -> f64 {
    std::env::var("SPARK_SMOOTH_GAIN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0)
}
