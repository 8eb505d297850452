//! What `run`, `parity` and `generate` need from an executable artifact:
//! the original or GPTQ checkpoint on our engine, or an exported phone graph
//! on ONNX Runtime.

use crate::checkpoint::SparkConfig;
use crate::model::{KvCache, Logits, ModelError, SparkModel};

pub trait Engine: Sync {
    fn config(&self) -> &SparkConfig;
    /// A fresh sequence able to hold `context` positions.
    fn start(&self, context: usize) -> Result<Box<dyn Sequence + '_>, ModelError>;
    fn describe(&self) -> String;

    /// Bytes one sequence of `context` positions holds (its KV cache), for memory plans.
    fn sequence_bytes(&self, context: usize) -> u128;

    /// One decode step of several sequences of this engine: `tokens[i]` goes to `seqs[i]`;
    /// the logits `[n, vocab]`, row i for sequence i. Engines that can batch read their
    /// weights once for all rows; the default steps each sequence alone.
    fn step_many(
        &self,
        seqs: &mut [Box<dyn Sequence + '_>],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        step_each(seqs, tokens)
    }
}

/// [`Engine::step_many`] one sequence at a time.
fn step_each(seqs: &mut [Box<dyn Sequence + '_>], tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
    let mut out = Vec::new();
    for (s, &t) in seqs.iter_mut().zip(tokens) {
        out.extend(s.forward(&[t], Logits::Last)?);
    }
    Ok(out)
}

pub trait Sequence {
    /// Run `tokens` at the next positions; logits for all of them or the last.
    fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, ModelError>;
    /// The engine's KV cache, for [`Engine::step_many`] of our own model.
    fn kv_cache(&mut self) -> Option<&mut KvCache> {
        None
    }
}

struct ModelSequence<'a> {
    model: &'a SparkModel,
    cache: KvCache,
}

impl Sequence for ModelSequence<'_> {
    fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, ModelError> {
        let (model, cache) = (self.model, &mut self.cache);
        on_pool(tokens.len(), || model.forward(tokens, cache, want))
    }
    fn kv_cache(&mut self) -> Option<&mut KvCache> {
        Some(&mut self.cache)
    }
}

impl Engine for SparkModel {
    fn config(&self) -> &SparkConfig {
        SparkModel::config(self)
    }
    fn start(&self, context: usize) -> Result<Box<dyn Sequence + '_>, ModelError> {
        Ok(Box::new(ModelSequence {
            model: self,
            cache: self.new_cache(context),
        }))
    }
    fn describe(&self) -> String {
        "spark-tool engine".into()
    }
    fn sequence_bytes(&self, context: usize) -> u128 {
        crate::resources::kv_cache_bytes(self.config(), context, self.kv_precision().bytes())
    }
    fn step_many(
        &self,
        seqs: &mut [Box<dyn Sequence + '_>],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        assert_eq!(seqs.len(), tokens.len(), "one token per sequence");
        if !seqs.iter_mut().all(|s| s.kv_cache().is_some()) {
            // Not all ours to batch: one at a time.
            return step_each(seqs, tokens);
        }
        let mut caches: Vec<&mut KvCache> = seqs.iter_mut().filter_map(|s| s.kv_cache()).collect();
        on_pool(tokens.len(), || self.forward_many(tokens, &mut caches))
    }
}

/// Run a step of `rows` rows on a pool worker: the per-linear fan-outs then start from a worker
/// that takes part, instead of a caller that waits. Decode-sized steps (fewer rows than
/// attention's blocked path takes, where every fan-out is small) also keep the other workers
/// spinning between fan-outs ([`par::with_team`](crate::kernels::par::with_team)).
fn on_pool<R: Send>(rows: usize, f: impl FnOnce() -> R + Send) -> R {
    if rows < crate::model::block::BLOCKED_MIN_ROWS {
        crate::kernels::par::with_team(f)
    } else {
        rayon::scope(|_| f())
    }
}
