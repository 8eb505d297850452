//! GPTQ linears with the numerics of the runtime they target (FORMATS.md §7):
//! W4A16 = vLLM `cpu_gemm_wna16`, W4A8 = vLLM `int4_scaled_mm_cpu`.

use std::ops::Range;

use serde::Serialize;

use super::linear::Linear;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::formats::gptq::{unpack_qweight, unpack_qzeros_v1};
use crate::kernels::{self, w4};

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
    /// `q − zero`, `[N, K]`.
    codes: Vec<i8>,
    /// `[N, K/G]`, bf16 values (what vLLM holds after loading).
    scales: Vec<f32>,
    /// W4A16: the bf16-rounded dequantized matrix `[N, K]`.
    w16: Option<Vec<f32>>,
    exec: QuantExec,
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
        match (&self.w16, self.exec.numerics) {
            (Some(w), W4Numerics::W4A16) => {
                kernels::matmul().matmul_nt(x, m, self.k, w, self.n, y);
                if self.exec.act_bf16 {
                    y.iter_mut().for_each(|v| *v = w4::round_bf16(*v));
                }
            }
            _ => w4::w4a8_matmul(
                x,
                m,
                w4::W4Weights {
                    codes: &self.codes,
                    scales: &self.scales,
                    n: self.n,
                    k: self.k,
                    g: self.g,
                },
                y,
            ),
        }
    }
    fn kind(&self) -> String {
        format!("gptq {:?} g{}", self.exec.numerics, self.g)
    }
    fn dequantize(&self) -> Vec<f32> {
        match &self.w16 {
            Some(w) => w.clone(),
            None => {
                let groups = self.k / self.g;
                (0..self.n * self.k)
                    .map(|i| {
                        self.codes[i] as f32
                            * self.scales[(i / self.k) * groups + (i % self.k) / self.g]
                    })
                    .collect()
            }
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
    let codes_kn = unpack_qweight(&i32s(ck, &format!("{prefix}.qweight"))?, k, n_all);
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
    let mut codes = vec![0i8; n * k];
    let mut scales = vec![0f32; n * groups];
    for (j, col) in cols.clone().enumerate() {
        for kk in 0..k {
            let gi = g_idx[kk];
            codes[j * k + kk] =
                (codes_kn[kk * n_all + col] as i32 - zeros[gi * n_all + col] as i32) as i8;
        }
        for gi in 0..groups {
            scales[j * groups + gi] = scales_gn[gi * n_all + col];
        }
    }
    let w16 = (exec.numerics == W4Numerics::W4A16).then(|| {
        if contiguous {
            w4::w4a16_weights(&codes, &scales, n, k, g)
        } else {
            (0..n * k)
                .map(|i| w4::round_bf16(codes[i] as f32 * scales[(i / k) * groups + g_idx[i % k]]))
                .collect()
        }
    });
    Ok(Box::new(GptqLinear {
        n,
        k,
        g,
        codes,
        scales,
        w16,
        exec,
    }))
}
