//! Choosing the next token: greedy (ties to the lowest id) or seeded sampling
//! with temperature, top-k and top-p. ChaCha8 keeps a seed's stream stable
//! across platforms and crate versions.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 = disabled.
    pub top_k: usize,
    /// 1.0 = disabled.
    pub top_p: f32,
    pub seed: u64,
}

pub enum Sampler {
    Greedy,
    Random {
        params: SamplingParams,
        rng: Box<ChaCha8Rng>,
    },
}

/// Index of the largest logit; the first (lowest id) wins ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: Option<SamplingParams>) -> Self {
        match params {
            Some(p) if p.temperature > 0.0 => Sampler::Random {
                params: p,
                rng: Box::new(ChaCha8Rng::seed_from_u64(p.seed)),
            },
            _ => Sampler::Greedy,
        }
    }

    pub fn next(&mut self, logits: &[f32]) -> u32 {
        match self {
            Sampler::Greedy => argmax(logits),
            Sampler::Random { params, rng } => {
                let mut order: Vec<u32> = (0..logits.len() as u32).collect();
                // Descending logit, ties by id: deterministic for a given seed.
                order.sort_by(|&a, &b| {
                    logits[b as usize]
                        .total_cmp(&logits[a as usize])
                        .then(a.cmp(&b))
                });
                if params.top_k > 0 {
                    order.truncate(params.top_k);
                }
                let max = logits[order[0] as usize];
                let mut probs: Vec<f64> = order
                    .iter()
                    .map(|&i| (((logits[i as usize] - max) / params.temperature) as f64).exp())
                    .collect();
                let total: f64 = probs.iter().sum();
                probs.iter_mut().for_each(|p| *p /= total);
                if params.top_p < 1.0 {
                    let mut cum = 0.0;
                    let mut keep = probs.len();
                    for (i, p) in probs.iter().enumerate() {
                        cum += p;
                        if cum >= params.top_p as f64 {
                            keep = i + 1;
                            break;
                        }
                    }
                    probs.truncate(keep);
                    let t: f64 = probs.iter().sum();
                    probs.iter_mut().for_each(|p| *p /= t);
                }
                let u: f64 = rng.random();
                let mut cum = 0.0;
                for (i, p) in probs.iter().enumerate() {
                    cum += p;
                    if u < cum {
                        return order[i];
                    }
                }
                order[probs.len() - 1]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_ties_go_to_the_lowest_id() {
        assert_eq!(argmax(&[0.0, 2.0, 2.0, 1.0]), 1);
    }

    #[test]
    fn sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 3,
            top_p: 1.0,
            seed: 42,
        };
        let draw = |p| {
            let mut s = Sampler::new(Some(p));
            (0..64).map(|_| s.next(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(p), draw(p));
        let mut top3: Vec<u32> = (0..50).collect();
        top3.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        assert!(draw(p).iter().all(|t| top3[..3].contains(t)));
        assert_ne!(draw(p), draw(SamplingParams { seed: 43, ..p }));
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = [0.1f32, 3.0, 0.2];
        let mut s = Sampler::new(Some(SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.01,
            seed: 1,
        }));
        assert!((0..20).all(|_| s.next(&logits) == 1));
    }
}
