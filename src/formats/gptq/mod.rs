//! GPTQ v1 checkpoints (docs/GPTQ_FORMAT.md), in both directions; nothing about Hessians.
//! `config` writes `quantization_config`, `read` decodes a linear's tensors, this file packs and
//! writes them. What the layout check needs to accept a GPTQ checkpoint (the `quantization_config`
//! as read, the tensor set of one linear) lives in `checkpoint::gptq`, below this module, and is
//! re-exported here so the format's surface stays in one place.
//!
//! Per quantized linear with W `[N, K]` and group size G:
//! `qweight` i32 `[K/8, N]` (codes packed along K, k = 8r + j in bits 4j..4j+3),
//! `qzeros` i32 `[K/G, N/8]` (v1: stored zero − 1 = 7 → `0x77777777`),
//! `scales` f16 `[K/G, N]`, `g_idx` i32 `[K]` = k / G.

mod config;
pub(crate) mod read;

pub use crate::checkpoint::gptq::{check_tensors, GptqInfo, GPTQ_PARTS};
pub use config::{legacy_quantize_config, quantization_config};
pub use read::{read_linear, GptqLinearData};

use half::f16;
use safetensors::Dtype;

use crate::checkpoint::write::{OwnedTensor, TensorSpec};
use crate::quant::QuantizedWeight;

/// Every qzeros word of a symmetric (zero 8) v1 checkpoint.
pub const QZEROS_V1_SYM: i32 = 0x7777_7777;

#[derive(Debug, thiserror::Error)]
pub enum GptqFormatError {
    #[error("{name}: {message}")]
    Bad { name: String, message: String },
}

/// Pack `[K, N]` codes into `qweight` `[K/8, N]`.
pub fn pack_qweight(codes: &[u8], k: usize, n: usize) -> Vec<i32> {
    assert!(k.is_multiple_of(8) && codes.len() == k * n);
    let mut out = vec![0i32; k / 8 * n];
    for r in 0..k / 8 {
        for col in 0..n {
            let mut word = 0u32;
            for j in 0..8 {
                word |= (codes[(8 * r + j) * n + col] as u32 & 0xF) << (4 * j);
            }
            out[r * n + col] = word as i32;
        }
    }
    out
}

/// Inverse of [`pack_qweight`].
pub fn unpack_qweight(qweight: &[i32], k: usize, n: usize) -> Vec<u8> {
    let mut codes = vec![0u8; k * n];
    for r in 0..k / 8 {
        for col in 0..n {
            let word = qweight[r * n + col] as u32;
            for j in 0..8 {
                codes[(8 * r + j) * n + col] = ((word >> (4 * j)) & 0xF) as u8;
            }
        }
    }
    codes
}

/// Zero points (true value, not v1-stored) from `qzeros` `[groups, N/8]`.
pub fn unpack_qzeros_v1(qzeros: &[i32], groups: usize, n: usize) -> Vec<u8> {
    let mut z = vec![0u8; groups * n];
    for g in 0..groups {
        for c in 0..n / 8 {
            let word = qzeros[g * (n / 8) + c] as u32;
            for j in 0..8 {
                z[g * n + 8 * c + j] = (((word >> (4 * j)) & 0xF) + 1) as u8;
            }
        }
    }
    z
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Name, dtype and shape of the four GPTQ tensors of one linear with W `[n, k]` under `prefix`
/// (e.g. `model.layers.0.mlp.up_proj`), in [`GPTQ_PARTS`] order.
pub fn linear_specs(
    prefix: &str,
    k: usize,
    n: usize,
    g: usize,
) -> Result<Vec<TensorSpec>, GptqFormatError> {
    if !k.is_multiple_of(8) || !n.is_multiple_of(8) || g == 0 || !k.is_multiple_of(g) {
        return Err(GptqFormatError::Bad {
            name: prefix.into(),
            message: format!("shape [{n}, {k}] with group {g}: GPTQ needs K and N multiples of 8 and K a multiple of G"),
        });
    }
    let groups = k / g;
    let spec = |part: &str, dtype, shape| TensorSpec {
        name: format!("{prefix}.{part}"),
        dtype,
        shape,
    };
    Ok(vec![
        spec("qweight", Dtype::I32, vec![k / 8, n]),
        spec("qzeros", Dtype::I32, vec![groups, n / 8]),
        spec("scales", Dtype::F16, vec![groups, n]),
        spec("g_idx", Dtype::I32, vec![k]),
    ])
}

/// The bytes of one GPTQ tensor (`part` of [`GPTQ_PARTS`]) of `q`; its shape is
/// [`linear_specs`]'s.
pub fn part_bytes(part: &str, q: &QuantizedWeight) -> Vec<u8> {
    let (k, n, g) = (q.in_features, q.out_features, q.group_size);
    match part {
        "qweight" => i32_bytes(&pack_qweight(&q.codes, k, n)),
        "qzeros" => i32_bytes(&vec![QZEROS_V1_SYM; k / g * n / 8]),
        "scales" => q
            .scales
            .iter()
            .flat_map(|s| {
                let h = f16::from_f32(*s);
                debug_assert_eq!(h.to_f32(), *s, "scales must be fp16-exact");
                h.to_bits().to_le_bytes()
            })
            .collect(),
        "g_idx" => i32_bytes(&(0..k).map(|kk| (kk / g) as i32).collect::<Vec<_>>()),
        other => unreachable!("not a GPTQ part: {other}"),
    }
}

/// The four GPTQ tensors of one linear under `prefix` (e.g. `model.layers.0.mlp.up_proj`).
pub fn tensors_for(prefix: &str, q: &QuantizedWeight) -> Result<Vec<OwnedTensor>, GptqFormatError> {
    let specs = linear_specs(prefix, q.in_features, q.out_features, q.group_size)?;
    Ok(specs
        .into_iter()
        .zip(GPTQ_PARTS)
        .map(|(s, part)| OwnedTensor {
            data: part_bytes(part, q),
            name: s.name,
            dtype: s.dtype,
            shape: s.shape,
        })
        .collect())
}

/// Concatenate linears that share an input along N (q | k | v → `q_k_v_proj`).
pub fn concat_outputs(parts: &[&QuantizedWeight]) -> QuantizedWeight {
    QuantizedWeight::concat_outputs(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/GPTQ_FORMAT.md §3: K = 16, N = 8, G = 8, q[k][n] = (k + 3n) mod 16, s[g][n] = 0.01·(n+1)·(g+1).
    #[test]
    fn worked_example_of_the_gptq_format_doc() {
        let (k, n) = (16, 8);
        let codes: Vec<u8> = (0..k)
            .flat_map(|kk| (0..n).map(move |nn| ((kk + 3 * nn) % 16) as u8))
            .collect();
        let qw = pack_qweight(&codes, k, n);
        assert_eq!(qw[0], 0x7654_3210);
        assert_eq!(qw[1], 0xA987_6543u32 as i32);
        assert_eq!(qw[1], -1_450_744_509);
        assert_eq!(qw[2], 0xDCBA_9876u32 as i32);
        assert_eq!(qw[3], 0x0FED_CBA9);
        assert_eq!(qw[7], 0xCBA9_8765u32 as i32);
        assert_eq!(qw[8], -19_088_744); // 0xFEDCBA98
        assert_eq!(qw[9], 0x210F_EDCB);
        assert_eq!(qw[15], 0x4321_0FED);
        assert_eq!(unpack_qweight(&qw, k, n), codes);

        let scales: Vec<f32> = (0..2)
            .flat_map(|g| {
                (0..n)
                    .map(move |nn| f16::from_f32(0.01 * (nn + 1) as f32 * (g + 1) as f32).to_f32())
            })
            .collect();
        let q = QuantizedWeight {
            in_features: k,
            out_features: n,
            group_size: 8,
            codes,
            scales: scales.clone(),
            grid: crate::quant::Grid::VLLM,
            tier_scales: Vec::new(),
        };
        let t = tensors_for("x", &q).unwrap();
        let qz: Vec<i32> = t[1]
            .data
            .chunks(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(qz, vec![2_004_318_071, 2_004_318_071]);
        assert_eq!(unpack_qzeros_v1(&qz, 2, n), vec![8; 16]);
        let g_idx: Vec<i32> = t[3]
            .data
            .chunks(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(g_idx, [vec![0; 8], vec![1; 8]].concat());
        // w[n=2, k=9] = (15 − 8) · s[1][2] = 7 · 0.06
        let w = q.dequantize();
        assert_eq!(w[2 * k + 9], 7.0 * scales[8 + 2]);
    }

    #[test]
    fn concat_keeps_each_part_in_place() {
        let mk = |n: usize, base: u8| QuantizedWeight {
            in_features: 8,
            out_features: n,
            group_size: 8,
            codes: (0..8 * n).map(|i| (i as u8 + base) % 16).collect(),
            scales: (0..n).map(|i| (i + base as usize) as f32).collect(),
            grid: crate::quant::Grid::VLLM,
            tier_scales: Vec::new(),
        };
        let (a, b) = (mk(8, 1), mk(16, 5));
        let c = concat_outputs(&[&a, &b]);
        let (da, db, dc) = (a.dequantize(), b.dequantize(), c.dequantize());
        assert_eq!(&dc[..8 * 8], &da[..]);
        assert_eq!(&dc[8 * 8..], &db[..]);
    }
}
