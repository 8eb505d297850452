//! The optimisation loop block and model tuning share: Adam on groups of variables over random
//! batches of calibration windows with a linearly decaying step; every `check` steps the stored
//! state is scored on all windows and the best kept; if nothing beat the starting state, the
//! starting state is kept. What differs between the two tunings is the [`Objective`].

use candle_core::{Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::seq::SliceRandom;
use rand::SeedableRng;

type Result<T> = std::result::Result<T, candle_core::Error>;

/// What a tuning fits.
pub(super) trait Objective {
    /// The differentiable loss of the current variables on calibration windows `idx`.
    fn loss(&self, idx: &[usize]) -> Result<Tensor>;
    /// The error of the stored state (as the checkpoint will hold it) on all windows.
    fn score(&self) -> Result<f64>;
    /// Every variable the tuning moves.
    fn vars(&self) -> Vec<&Var>;
    /// Bring the variables back into their ranges after a step.
    fn clamp(&self) -> Result<()>;
}

/// How long and on what a tuning runs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Schedule {
    pub steps: usize,
    /// Windows per step.
    pub batch: usize,
    /// Score the stored state every this many steps (0: never).
    pub check: usize,
    /// Calibration windows there are.
    pub samples: usize,
    pub seed: u64,
}

/// How a tuning ended; the objective's variables hold the state to write.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fit {
    pub before: f64,
    pub after: f64,
    /// Whether the tuned state is kept (false: the starting state was restored).
    pub tuned: bool,
    /// Mean wall time of one step.
    pub step_seconds: f64,
}

fn snapshot(obj: &impl Objective) -> Result<Vec<Tensor>> {
    obj.vars().iter().map(|v| v.as_tensor().copy()).collect()
}

fn restore(obj: &impl Objective, s: &[Tensor]) -> Result<()> {
    for (v, t) in obj.vars().into_iter().zip(s) {
        v.set(t)?;
    }
    Ok(())
}

/// Run Adam with one optimiser per `(variables, learning rate)` group (see the module doc).
pub(super) fn fit(
    obj: &impl Objective,
    groups: Vec<(Vec<Var>, f64)>,
    s: Schedule,
    mut progress: impl FnMut(usize),
) -> Result<Fit> {
    let initial = snapshot(obj)?;
    let before = obj.score()?;
    let mut opts = groups
        .into_iter()
        .map(|(vars, lr)| {
            let params = ParamsAdamW {
                lr,
                weight_decay: 0.0,
                ..ParamsAdamW::default()
            };
            Ok((AdamW::new(vars, params)?, lr))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(s.seed);
    let mut order: Vec<usize> = (0..s.samples).collect();
    let mut best = (before, initial.clone());
    let mut stepping = std::time::Duration::ZERO;
    for it in 0..s.steps {
        if s.check > 0 && it > 0 && it % s.check == 0 {
            let e = obj.score()?;
            if e < best.0 {
                best = (e, snapshot(obj)?);
            }
        }
        let clock = std::time::Instant::now();
        order.shuffle(&mut rng);
        let grads = obj.loss(&order[..s.batch.min(s.samples)])?.backward()?;
        let decay = 1.0 - it as f64 / s.steps as f64;
        for (opt, lr) in opts.iter_mut() {
            opt.set_learning_rate(*lr * decay);
            opt.step(&grads)?;
        }
        obj.clamp()?;
        stepping += clock.elapsed();
        progress(it + 1);
    }
    let mut after = obj.score()?;
    if best.0 < after {
        restore(obj, &best.1)?;
        after = best.0;
    }
    let tuned = after < before;
    if !tuned {
        restore(obj, &initial)?;
        after = before;
    }
    Ok(Fit {
        before,
        after,
        tuned,
        step_seconds: stepping.as_secs_f64() / s.steps.max(1) as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Fit x to a target: a least-squares objective whose stored state rounds to a lattice.
    struct Quadratic {
        x: Var,
        target: Tensor,
        step: f32,
    }

    impl Objective for Quadratic {
        fn loss(&self, _idx: &[usize]) -> Result<Tensor> {
            (self.x.as_tensor() - &self.target)?.sqr()?.mean_all()
        }
        fn score(&self) -> Result<f64> {
            let stored = ((self.x.as_tensor() / self.step as f64)?.round()? * self.step as f64)?;
            Ok((stored - &self.target)?
                .sqr()?
                .mean_all()?
                .to_scalar::<f32>()? as f64)
        }
        fn vars(&self) -> Vec<&Var> {
            vec![&self.x]
        }
        fn clamp(&self) -> Result<()> {
            self.x.set(&self.x.as_tensor().clamp(-1f32, 1f32)?)
        }
    }

    fn case(target: &[f32], step: f32) -> Quadratic {
        let dev = Device::Cpu;
        Quadratic {
            x: Var::zeros(target.len(), DType::F32, &dev).unwrap(),
            target: Tensor::from_slice(target, target.len(), &dev).unwrap(),
            step,
        }
    }

    fn schedule(steps: usize) -> Schedule {
        Schedule {
            steps,
            batch: 1,
            check: 10,
            samples: 1,
            seed: 0,
        }
    }

    #[test]
    fn fitting_moves_the_variables_to_a_lower_stored_error_within_their_range() {
        let q = case(&[0.5, -0.25, 3.0], 0.125);
        let mut seen = 0;
        let f = fit(&q, vec![(vec![q.x.clone()], 0.05)], schedule(200), |i| {
            seen = i
        })
        .unwrap();
        assert_eq!(seen, 200);
        assert!(f.tuned);
        assert!((f.before - (0.25 + 0.0625 + 9.0) / 3.0).abs() < 1e-6);
        assert!(f.after < 0.5 * f.before, "{f:?}");
        assert!((q.score().unwrap() - f.after).abs() < 1e-9);
        let x = q.x.as_tensor().to_vec1::<f32>().unwrap();
        assert!(x[2] <= 1.0, "clamped: {x:?}");
    }

    #[test]
    fn a_start_nothing_beats_is_restored_bit_for_bit() {
        // The loss pulls x to 0.4, but the stored state rounds to whole numbers and stays at 0:
        // no scored state beats the start, so the start comes back although x moved.
        let q = case(&[0.4], 1.0);
        let f = fit(&q, vec![(vec![q.x.clone()], 0.05)], schedule(200), |_| {}).unwrap();
        assert!(!f.tuned);
        assert_eq!(f.after, f.before);
        assert_eq!(q.x.as_tensor().to_vec1::<f32>().unwrap(), vec![0.0]);
        // Without the restore the loop ends near the loss's optimum.
        let q = case(&[0.4], 0.125);
        let f = fit(&q, vec![(vec![q.x.clone()], 0.05)], schedule(200), |_| {}).unwrap();
        assert!(f.tuned);
        assert!((q.x.as_tensor().to_vec1::<f32>().unwrap()[0] - 0.4).abs() < 0.05);
    }
}
