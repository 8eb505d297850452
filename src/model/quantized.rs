//! GPTQ linears with the numerics of the runtime they target (docs/GPTQ_FORMAT.md §8–§9):
//! W4A16 = vLLM `cpu_gemm_wna16`, W4A8 = vLLM `int4_scaled_mm_cpu`.

use std::ops::Range;

use serde::Serialize;

use super::linear::Linear;
use crate::checkpoint::{Checkpoint, CheckpointError, TensorStore};
use crate::formats::gptq::{self, GptqInfo};
use crate::kernels::bf16;
use crate::kernels::w4::{self, Codes, W4Nibbles};
use crate::kernels::w4a16::PackedW4A16;
use crate::kernels::w4a8::PackedW4A8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum W4Numerics {
    W4A16,
    W4A8,
}

/// How quantized checkpoints are executed.
#[derive(Debug, Clone, Copy)]
pub struct QuantExec {
    pub numerics: W4Numerics,
    /// Round every linear's input and output to bf16, as vLLM's bf16 model does.
    pub act_bf16: bool,
}

pub struct GptqLinear {
    n: usize,
    k: usize,
    g: usize,
    weights: GptqWeights,
    exec: QuantExec,
}

/// The weight in the layout its kernel reads (repacked at load, never on disk).
enum GptqWeights {
    /// Nibbles in 16-column VNNI tiles, 0.5 byte/weight + scales.
    W4A8(PackedW4A8),
    /// Nibbles per column, dequantized on the fly, 0.5 byte/weight + scales.
    W4A16(PackedW4A16),
    /// Act-order checkpoints (g_idx ≠ k/G), W4A16 only: the dequantized
    /// bf16((q − z)·s) matrix `[N, K]` as bf16 (exact), 2 bytes/weight.
    W4A16ActOrder(Vec<u16>),
}

impl Linear for GptqLinear {
    fn in_features(&self) -> usize {
        self.k
    }
    fn out_features(&self) -> usize {
        self.n
    }
    /// The runtime's kernel alone; a bf16 model's activation rounding is the loader's `Bf16Act`.
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        match &self.weights {
            // The W4A8 recipe quantizes bf16 activations (and rounds its output to bf16). With
            // `act_bf16` the loader's wrapper has rounded `x` already: no second pass.
            GptqWeights::W4A8(p) if self.exec.act_bf16 => p.matmul(x, m, y),
            GptqWeights::W4A8(p) => p.matmul_rounding(x, m, y),
            GptqWeights::W4A16(p) => p.matmul(x, m, y),
            GptqWeights::W4A16ActOrder(w) => bf16::matmul_nt(x, m, self.k, w, self.n, y),
        }
    }
    /// W4A8 rounds its input while quantizing it and its output as it stores it: no copy, no
    /// extra pass (the same bits as the trait's default).
    fn forward_bf16(&self, x: &[f32], m: usize, y: &mut [f32]) {
        match &self.weights {
            GptqWeights::W4A8(p) => p.matmul_rounding(x, m, y),
            _ => super::linear::forward_rounded(self, x, m, y),
        }
    }
    fn w4a8_rounding(&self, bf16: bool) -> Option<&crate::kernels::w4a8::PackedW4A8> {
        match &self.weights {
            // `forward` without the loader's rounding skips it (the wrapper rounded already).
            GptqWeights::W4A8(p) if bf16 || !self.exec.act_bf16 => Some(p),
            _ => None,
        }
    }
    fn kind(&self) -> String {
        format!("gptq {:?} g{}", self.exec.numerics, self.g)
    }
    fn weight_bytes(&self) -> usize {
        match &self.weights {
            GptqWeights::W4A8(p) => p.bytes(),
            GptqWeights::W4A16(p) => p.bytes(),
            GptqWeights::W4A16ActOrder(w) => std::mem::size_of_val(&w[..]),
        }
    }
    fn dequantize(&self) -> Vec<f32> {
        match &self.weights {
            GptqWeights::W4A8(p) => p.dequantize(),
            GptqWeights::W4A16(p) => p.dequantize(),
            GptqWeights::W4A16ActOrder(w) => w.iter().map(|b| bf16::widen(*b)).collect(),
        }
    }
}

/// Build the GPTQ linear `prefix` (output columns `cols` of it, for a fused q/k/v). With
/// `exec.act_bf16` the caller rounds its inputs and outputs to bf16 (`SparkModel::load` wraps every
/// linear for that); the linear itself runs only its runtime's kernel.
pub fn load_gptq(
    ck: &Checkpoint,
    prefix: &str,
    cols: Range<usize>,
    exec: QuantExec,
) -> Result<Box<dyn Linear>, CheckpointError> {
    let info = ck
        .config
        .gptq
        .as_ref()
        .ok_or_else(|| CheckpointError::Tensors {
            problems: vec![format!(
                "`{prefix}` is GPTQ but config.json has no quantization_config"
            )],
        })?;
    from_store(&ck.store, info, prefix, cols, exec)
}

fn from_store(
    store: &TensorStore,
    info: &GptqInfo,
    prefix: &str,
    cols: Range<usize>,
    exec: QuantExec,
) -> Result<Box<dyn Linear>, CheckpointError> {
    let mut d = gptq::read_linear(store, info, prefix, cols.clone())?;
    let contiguous = d.contiguous();
    if !contiguous && exec.numerics == W4Numerics::W4A8 {
        return Err(CheckpointError::Tensors {
            problems: vec![format!("`{prefix}` uses act-order (g_idx ≠ k/G); vLLM runs such checkpoints only as W4A16 — set {} to w4a16", crate::setting::Setting::W4Numerics)],
        });
    }
    // vLLM converts scales to the bf16 model dtype at load.
    d.scales.iter_mut().for_each(|s| *s = w4::round_bf16(*s));
    let (n, k, g) = (cols.len(), d.k, d.group_size);
    let groups = k / g;
    let (g_idx, zeros_ng, scales) = (&d.g_idx, &d.zeros, &d.scales);
    let nib = W4Nibbles {
        q: Codes::GptqWords {
            bytes: d.qweight,
            n_all: d.n_all,
            col0: cols.start,
        },
        zeros: zeros_ng,
        scales,
        n,
        k,
        g,
    };
    let weights = if !contiguous {
        // Only W4A16 gets here (checked above).
        let q = nib.unpacked();
        let mut w = vec![0u16; n * k];
        for j in 0..n {
            for kk in 0..k {
                let gi = j * groups + g_idx[kk];
                let c = q[j * k + kk] as i32 - zeros_ng[gi];
                w[j * k + kk] = half::bf16::from_f32(c as f32 * scales[gi]).to_bits();
            }
        }
        GptqWeights::W4A16ActOrder(w)
    } else {
        match exec.numerics {
            W4Numerics::W4A8 => GptqWeights::W4A8(PackedW4A8::pack(nib)),
            W4Numerics::W4A16 => GptqWeights::W4A16(PackedW4A16::pack(nib)),
        }
    };
    Ok(Box::new(GptqLinear {
        n,
        k,
        g,
        weights,
        exec,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::gptq::read::tests::{info, store_of, weight};

    fn exec(numerics: W4Numerics) -> QuantExec {
        QuantExec {
            numerics,
            act_bf16: false,
        }
    }

    /// The weight each runtime uses for column slice `cols`, `[n, K]`: (q − 8) · bf16(s), rounded
    /// to bf16 for W4A16 (`cpu_gemm_wna16` dequantizes to the model dtype), kept in f32 for W4A8
    /// (`int4_scaled_mm_cpu` applies the scale in f32).
    fn expected(
        w: &crate::quant::QuantizedWeight,
        cols: Range<usize>,
        g_idx: &[usize],
        numerics: W4Numerics,
    ) -> Vec<f32> {
        let n = w.out_features;
        let mut out = Vec::new();
        for c in cols {
            for (kk, &gi) in g_idx.iter().enumerate() {
                let s = w4::round_bf16(half::f16::from_f32(w.scales[gi * n + c]).to_f32());
                let q = w.codes[kk * n + c] as f32 - 8.0;
                out.push(match numerics {
                    W4Numerics::W4A16 => w4::round_bf16(q * s),
                    W4Numerics::W4A8 => q * s,
                });
            }
        }
        out
    }

    #[test]
    fn fused_column_slices_load_in_both_numerics() {
        let d = tempfile::tempdir().unwrap();
        let w = weight();
        let store = store_of(&w, d.path(), |_| {});
        let contiguous: Vec<usize> = (0..32).map(|k| k / 8).collect();
        for numerics in [W4Numerics::W4A16, W4Numerics::W4A8] {
            for cols in [0..16, 0..8, 8..16] {
                let l =
                    from_store(&store, &info(false), "x", cols.clone(), exec(numerics)).unwrap();
                assert_eq!((l.out_features(), l.in_features()), (cols.len(), 32));
                assert_eq!(
                    l.dequantize(),
                    expected(&w, cols, &contiguous, numerics),
                    "{numerics:?}"
                );
            }
        }
    }

    #[test]
    fn act_order_runs_as_w4a16_only() {
        let d = tempfile::tempdir().unwrap();
        let w = weight();
        let perm: Vec<usize> = (0..32).map(|k| (k * 5) % 32 / 8).collect();
        let store = store_of(&w, d.path(), |t| {
            let x = t.iter_mut().find(|x| x.name == "x.g_idx").unwrap();
            x.data = perm
                .iter()
                .flat_map(|&g| (g as i32).to_le_bytes())
                .collect();
        });
        let l = from_store(&store, &info(false), "x", 4..12, exec(W4Numerics::W4A16)).unwrap();
        assert_eq!(
            l.dequantize(),
            expected(&w, 4..12, &perm, W4Numerics::W4A16)
        );
        let e = from_store(&store, &info(false), "x", 0..16, exec(W4Numerics::W4A8))
            .err()
            .unwrap();
        assert!(e.to_string().contains("act-order"), "{e}");
    }
}
