//! `bench`: prefill and decode throughput of one artifact, repeated, with
//! min/median/max. It measures; comparisons against a peer belong to the
//! scripts that run both in one invocation.

use std::time::Instant;

use serde::Serialize;

use crate::generate::{generate, GenerateOptions};
use crate::model::{ModelError, SparkModel};

#[derive(Debug, Clone, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Self {
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let median = if v.is_empty() {
            f64::NAN
        } else if v.len() % 2 == 1 {
            v[v.len() / 2]
        } else {
            (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
        };
        Spread {
            min: *v.first().unwrap_or(&f64::NAN),
            median,
            max: *v.last().unwrap_or(&f64::NAN),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub prompt_len: usize,
    pub gen: usize,
    pub repeat: usize,
    pub threads: usize,
    pub prefill_tok_s: Spread,
    pub decode_tok_s: Spread,
    /// Prefill plus choosing the first token.
    pub time_to_first_token_ms: Spread,
    pub decode_ms_per_token: Spread,
    pub sampling_ms: Spread,
}

/// Peak resident set size of this process (Linux `VmHWM`), if the OS reports it.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Deterministic pseudo-random prompt ids below `vocab` (any ids cost the same).
pub fn prompt_ids(len: usize, vocab: usize) -> Vec<u32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

pub fn run(
    model: &SparkModel,
    prompt_len: usize,
    gen: usize,
    repeat: usize,
) -> Result<BenchReport, ModelError> {
    let prompt = prompt_ids(prompt_len.max(1), model.config().vocab_size);
    let opts = GenerateOptions {
        max_new_tokens: gen.max(1),
        ignore_eos: true,
        stop_ids: vec![],
        sampling: None,
        context: None,
        capture_logits: false,
    };
    let (mut pre, mut dec, mut ttft, mut per_tok, mut samp) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let mut first = None;
        let out = generate(model, &prompt, &opts, |_| {
            first.get_or_insert_with(|| t.elapsed().as_secs_f64() * 1e3);
        })?;
        let s = &out.stats;
        pre.push(s.prompt_tokens as f64 / (s.prefill_ms / 1e3));
        if !s.decode_ms.is_empty() {
            dec.push(1e3 / s.decode_mean_ms());
            per_tok.push(s.decode_mean_ms());
        }
        ttft.push(first.unwrap_or(f64::NAN));
        samp.push(s.sampling_ms);
    }
    Ok(BenchReport {
        prompt_len: prompt.len(),
        gen: opts.max_new_tokens,
        repeat: repeat.max(1),
        threads: rayon::current_num_threads(),
        prefill_tok_s: Spread::of(&pre),
        decode_tok_s: Spread::of(&dec),
        time_to_first_token_ms: Spread::of(&ttft),
        decode_ms_per_token: Spread::of(&per_tok),
        sampling_ms: Spread::of(&samp),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_takes_the_middle() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        assert_eq!(Spread::of(&[1.0, 4.0]).median, 2.5);
    }
}
