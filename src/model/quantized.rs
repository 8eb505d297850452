//! GPTQ linears with the numerics of the runtime they target (docs/GPTQ_FORMAT.md §8–§9):
//! W4A16 = vLLM `cpu_gemm_wna16`, W4A8 = vLLM `int4_scaled_mm_cpu`.

use std::ops::Range;

use serde::Serialize;

use super::linear::Linear;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::formats::gptq::unpack_qzeros_v1;
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
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        let rounded;
        let x = if self.exec.act_bf16 || self.exec.numerics == W4Numerics::W4A8 {
            rounded = x.iter().map(|v| w4::round_bf16(*v)).collect::<Vec<f32>>();
            &rounded[..]
        } else {
            x
        };
        match &self.weights {
            // The recipe rounds its output to bf16 itself.
            GptqWeights::W4A8(p) => p.matmul(x, m, y),
            GptqWeights::W4A16(p) => p.matmul(x, m, y),
            GptqWeights::W4A16ActOrder(w) => bf16::matmul_nt(x, m, self.k, w, self.n, y),
        }
        if self.exec.act_bf16 && !matches!(self.weights, GptqWeights::W4A8(_)) {
            y.iter_mut().for_each(|v| *v = w4::round_bf16(*v));
        }
    }
    fn kind(&self) -> String {
        format!("gptq {:?} g{}", self.exec.numerics, self.g)
    }
    fn dequantize(&self) -> Vec<f32> {
        match &self.weights {
            GptqWeights::W4A8(p) => p.dequantize(),
            GptqWeights::W4A16(p) => p.dequantize(),
            GptqWeights::W4A16ActOrder(w) => w.iter().map(|b| bf16::widen(*b)).collect(),
        }
    }
}

fn i32s(ck: &Checkpoint, name: &str) -> Result<Vec<i32>, CheckpointError> {
    let e = ck.entry(name)?;
    Ok(ck
        .store
        .bytes(e)
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Build the GPTQ linear `prefix` (output columns `cols` of it, for a fused q/k/v).
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
    let qw = ck.entry(&format!("{prefix}.qweight"))?;
    let (k, n_all) = (qw.shape[0] * 8, qw.shape[1]);
    let g = info.group_size;
    let groups = k / g;
    let mut zeros = unpack_qzeros_v1(&i32s(ck, &format!("{prefix}.qzeros"))?, groups, n_all);
    if info.v2 {
        zeros.iter_mut().for_each(|z| *z -= 1);
    }
    // vLLM converts scales to the bf16 model dtype at load.
    let scales_gn: Vec<f32> = ck
        .tensor_f32(&format!("{prefix}.scales"))?
        .iter()
        .map(|s| w4::round_bf16(*s))
        .collect();
    let g_idx: Vec<usize> = match ck.store.get(&format!("{prefix}.g_idx")) {
        Some(_) => i32s(ck, &format!("{prefix}.g_idx"))?
            .iter()
            .map(|&v| v as usize)
            .collect(),
        None => (0..k).map(|kk| kk / g).collect(),
    };
    if g_idx.iter().any(|&gi| gi >= groups) {
        return Err(CheckpointError::Tensors {
            problems: vec![format!("`{prefix}.g_idx` points past the {groups} groups")],
        });
    }
    let contiguous = g_idx.iter().enumerate().all(|(kk, &gi)| gi == kk / g);
    if !contiguous && exec.numerics == W4Numerics::W4A8 {
        return Err(CheckpointError::Tensors {
            problems: vec![format!("`{prefix}` uses act-order (g_idx ≠ k/G); vLLM runs such checkpoints only as W4A16 — use --w4-numerics w4a16")],
        });
    }
    let n = cols.len();
    let mut zeros_ng = vec![0i32; n * groups];
    let mut scales = vec![0f32; n * groups];
    for (j, col) in cols.clone().enumerate() {
        for gi in 0..groups {
            zeros_ng[j * groups + gi] = zeros[gi * n_all + col] as i32;
            scales[j * groups + gi] = scales_gn[gi * n_all + col];
        }
    }
    let nib = W4Nibbles {
        q: Codes::GptqWords {
            bytes: ck.store.bytes(qw),
            n_all,
            col0: cols.start,
        },
        zeros: &zeros_ng,
        scales: &scales,
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
