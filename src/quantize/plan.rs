//! The private memory a quantize run holds at its peak, planned from the shapes and the
//! calibration size before anything is allocated (docs/SCALE.md compares it with measured
//! peaks). Checkpoint weights in bf16 are read in place from the memory map and are not
//! private; the plan counts what the run itself allocates.

use std::fmt;

use serde::Serialize;

use crate::checkpoint::{Proj, SparkConfig};
use crate::resources::human;

/// Rows of calibration tokens per MLP activation call (their gate and up outputs exist at once).
pub const MLP_ROWS: usize = 4096;

/// Output rows of the head quantized at a time (each row is its own GPTQ problem).
pub const HEAD_ROWS: usize = 8192;

/// Bytes held at the peak, by what holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryPlan {
    /// One layer's activations over every calibration token. The residual streams are not
    /// here: they are mapped from scratch files ([`MemoryPlan::scratch_disk`]).
    pub activations: u64,
    /// One Hessian (f64 sum) with its f32 factor and inverse, at the widest linear input.
    pub hessian: u64,
    /// The layer being solved in f32 (the weights, their transposed working copy, codes and
    /// the dequantized replacements), and weights the loader widened from non-bf16 dtypes.
    pub weights: u64,
    /// Tokenizer, calibration ids, code and thread stacks.
    pub fixed: u64,
    /// Block tuning's working set (`quantize --block-tune`; 0 without).
    pub block_tune: u64,
    /// Model tuning's working set (`quantize --model-tune`; 0 without).
    #[serde(skip_serializing_if = "is_zero")]
    pub model_tune: u64,
    /// Disk in the staging folder for the residual streams, which the kernel pages instead of
    /// private memory: the file a layer advances, its copy for the next layer, and the previous
    /// layer's resume state until the save commits (not part of [`MemoryPlan::total`]).
    pub scratch_disk: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl MemoryPlan {
    /// `rows` calibration tokens; `widened`: bytes of checkpoint weights stored in a dtype the
    /// model widens to f32 (bf16 stays mapped).
    /// `float_output`: an objective that carries the float model's stream and stage inputs beside
    /// the quantized ones and solves for W* against the cross moment or the output moment
    /// (float-output, float-stream).
    pub fn new(
        cfg: &SparkConfig,
        rows: usize,
        widened: u64,
        quantize_head: bool,
        float_output: bool,
    ) -> Self {
        // u128: a request of absurd size must come out as a large figure, not wrap.
        let (hidden, q_dim, inter) = (
            cfg.hidden_size as u128,
            cfg.q_dim() as u128,
            cfg.intermediate_size as u128,
        );
        let (rows_u, f) = (rows as u128, 4u128);
        // The widest step: attention (h, attn, out_proj's output) or the MLP (h2 or the residual
        // update beside act, and gate/up of one chunk while act is filled).
        let attention = rows_u * f * (hidden + q_dim + hidden);
        let mlp = rows_u * f * (hidden + inter) + 3 * (rows.min(MLP_ROWS) as u128) * inter * f;
        let mut activations = attention.max(mlp);
        if float_output {
            // Beside the step's own buffers its float twins: h and attn with out_proj's output,
            // or h2 and act with down_proj's output.
            activations += rows_u * f * (hidden + q_dim + hidden).max(hidden + inter + hidden);
        }
        let streams = rows_u * hidden * f * if float_output { 2 } else { 1 };
        // Σxxᵀ in f64 with either the f32 factor and inverse or the f32 copy the error is
        // measured against beside U (16 bytes per entry). For W*, beside Σxxᵀ and the damped f32
        // factor: the f64 cross moment and its f32 copy for the linears of the narrow inputs, and
        // down_proj's output moment (f64, with an f32 chunk product, then an f32 copy: N·K), and
        // out_proj's under the float-stream objective.
        let k = hidden.max(q_dim).max(inter);
        let narrow = hidden.max(q_dim);
        let hessian = if float_output {
            (16 * k * k)
                .max(12 * inter * inter + 16 * hidden * inter)
                .max(24 * narrow * narrow)
                .max(12 * q_dim * q_dim + 16 * hidden * q_dim)
        } else {
            16 * k * k
        };
        // One chunk of calibration tokens in flight beside them (`hessian::CHUNK`): the Gram's
        // operands as transposed bf16 bits (2 bytes per value; on AMX only the first, tiled),
        // and the cross moment's f32 difference x − x̃ (4), or the output moment's transposed
        // f32 output.
        let chunk = rows.min(crate::quant::hessian::CHUNK) as u128;
        let hessian = hessian
            + chunk
                * if float_output {
                    (10 * narrow).max(4 * hidden).max(4 * k)
                } else {
                    4 * k
                };
        let size = |p: &Proj| p.shape(cfg).iter().product::<usize>() as u128;
        let layer: u128 = Proj::ALL.iter().map(size).sum();
        let groups: [&[Proj]; 4] = [
            &[Proj::Q, Proj::K, Proj::V],
            &[Proj::Out],
            &[Proj::Gate, Proj::Up],
            &[Proj::Down],
        ];
        let group = groups
            .iter()
            .map(|g| g.iter().map(size).sum::<u128>())
            .max()
            .unwrap_or(0);
        let linear = Proj::ALL.iter().map(size).max().unwrap_or(0);
        // The layer's dequantized replacements (f32) and codes, the group's f32 weights, and for
        // one linear its transposed copy, codes, dequantized error copy and difference.
        let mut weights = layer * (f + 1) + group * f + linear * (3 * f + 1);
        if float_output {
            // W·C and its solve beside one linear's W*.
            weights += linear * 2 * f;
        }
        // The previous layer's codes and scales, and its save's copy of them, while that save
        // runs beside this layer (a byte per weight, scales at most 1/8 byte per weight).
        weights += layer * 9 / 4;
        if quantize_head {
            let vocab = cfg.vocab_size as u128;
            let chunk = vocab.min(HEAD_ROWS as u128) * hidden;
            // The final-normed stream, the whole head's codes and scales, one chunk in flight.
            activations = activations.max(2 * rows_u * hidden * f);
            weights = weights.max(vocab * hidden * 2 + chunk * (4 * f + 1));
        }
        let clamp = |b: u128| b.min(u64::MAX as u128 / 8) as u64;
        MemoryPlan {
            activations: clamp(activations),
            hessian: clamp(hessian),
            weights: clamp(weights + widened as u128),
            fixed: 256 << 20,
            block_tune: 0,
            model_tune: 0,
            scratch_disk: clamp(3 * streams),
        }
    }

    pub fn total(&self) -> u64 {
        self.activations
            + self.hessian
            + self.weights
            + self.fixed
            + self.block_tune
            + self.model_tune
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} private at the peak (calibration activations {}, Hessian and factor {}, weights {}, other {}",
            human(self.total() as u128),
            human(self.activations as u128),
            human(self.hessian as u128),
            human(self.weights as u128),
            human(self.fixed as u128)
        )?;
        if self.block_tune > 0 {
            write!(f, ", block tuning {}", human(self.block_tune as u128))?;
        }
        if self.model_tune > 0 {
            write!(f, ", model tuning {}", human(self.model_tune as u128))?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spark_4b() -> SparkConfig {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/spark-tiny/config.json"
        ))
        .unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        // The 4B's shapes (docs/MODEL.md §15).
        v["hidden_size"] = 2560.into();
        v["intermediate_size"] = 10240.into();
        v["num_attention_heads"] = 16.into();
        v["num_key_value_heads"] = 4.into();
        v["head_dim"] = 256.into();
        v["vocab_size"] = 131072.into();
        SparkConfig::from_json_str(&v.to_string(), "4b").unwrap()
    }

    #[test]
    fn grows_with_calibration_tokens_not_with_layers() {
        let cfg = spark_4b();
        // Both at least one Hessian chunk of tokens, so their Hessian terms agree.
        let chunk = crate::quant::hessian::CHUNK;
        let a = MemoryPlan::new(&cfg, chunk.max(4096), 0, false, false);
        let b = MemoryPlan::new(&cfg, 4 * chunk.max(4096), 0, false, false);
        assert!(2 * b.activations > 3 * a.activations, "{a} vs {b}");
        assert_eq!((a.hessian, a.weights), (b.hessian, b.weights));
        // The down_proj Hessian: 16 bytes per entry at K = 10240, and a chunk of its input as
        // bf16 bits and their tiles.
        assert_eq!(a.hessian, 16 * 10240 * 10240 + chunk as u64 * 4 * 10240);
        let mut deep = cfg.clone();
        deep.num_hidden_layers *= 4;
        deep.layer_types = deep.layer_types.repeat(4);
        assert_eq!(MemoryPlan::new(&deep, 16384, 0, false, false), b);
        // The 4B at 16K calibration tokens plans under the 8 GB target of docs/SCALE.md.
        assert!(b.total() < 8_000_000_000, "{b}");
        // The objectives that carry the float stream (float-output, the default, and float-stream) add it, the stage
        // inputs and the cross or output moments, and stay under the same target.
        let fo = MemoryPlan::new(&cfg, 16384, 0, false, true);
        assert!(fo.total() > b.total() && fo.total() < 8_000_000_000, "{fo}");
    }

    #[test]
    fn the_head_is_planned_in_chunks() {
        let cfg = spark_4b();
        let plain = MemoryPlan::new(&cfg, 4096, 0, false, false);
        let head = MemoryPlan::new(&cfg, 4096, 0, true, false);
        assert!(head.weights >= plain.weights);
        // Codes and scales of the whole head plus one chunk, far below 5 f32 copies of it.
        assert!(head.weights < 5 * 131072 * 2560 * 4 / 2, "{head}");
        assert!(head.to_string().contains("private at the peak"));
    }
}
