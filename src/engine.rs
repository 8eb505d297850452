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
}

pub trait Sequence {
    /// Run `tokens` at the next positions; logits for all of them or the last.
    fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, ModelError>;
}

struct ModelSequence<'a> {
    model: &'a SparkModel,
    cache: KvCache,
}

impl Sequence for ModelSequence<'_> {
    fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, ModelError> {
        // Run the whole step on a pool worker: the per-linear fan-outs then
        // start from a worker that takes part, instead of a caller that waits.
        let (model, cache) = (self.model, &mut self.cache);
        rayon::scope(|_| model.forward(tokens, cache, want))
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
}
