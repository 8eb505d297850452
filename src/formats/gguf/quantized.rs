//! A solved linear ([`QuantizedWeight`]) written as GGML blocks: no rounding happens here. Each
//! block type holds its grid exactly (docs/GGUF.md §2), so the file dequantizes to the very
//! weights the solve produced; anything else is refused.

use half::f16;

use super::blocks;
use super::{GgmlType, GgufError};
use crate::quant::{Grid, QuantizedWeight};

/// The grid and group size a block type holds with no rounding.
pub fn grid_of(t: GgmlType) -> Option<(Grid, usize)> {
    Some(match t {
        GgmlType::Q4_0 => (Grid::fp16(4), 32),
        GgmlType::Q5_0 => (Grid::fp16(5), 32),
        GgmlType::Q8_0 => (Grid::fp16(8), 32),
        GgmlType::Q4_K => (Grid::tiered(4, 63), 32),
        GgmlType::Q5_K => (Grid::tiered(5, 63), 32),
        GgmlType::Q6_K => (Grid::tiered(6, 127), 16),
        _ => return None,
    })
}

fn exact_f16(v: f32, what: &str) -> Result<f16, GgufError> {
    let h = f16::from_f32(v);
    if h.to_f32() != v {
        return Err(GgufError::Input(format!(
            "{what}: scale {v} is not an fp16 (the solve must choose stored scales)"
        )));
    }
    Ok(h)
}

/// Integer multiple `s / d` of a tier scale, which the tiered lattice guarantees.
fn multiple(s: f32, d: f32, max: u32, what: &str) -> Result<u32, GgufError> {
    let k = (s / d).round();
    if k < 1.0 || k > max as f32 || d * k != s {
        return Err(GgufError::Input(format!(
            "{what}: scale {s} is not an integer multiple 1…{max} of its tier scale {d}"
        )));
    }
    Ok(k as u32)
}

/// Rows `rows` of `q` (output channels; each a GGML row over the K inputs) as `ty` blocks,
/// appended to `out`. `name` is for errors.
pub fn encode_rows(
    q: &QuantizedWeight,
    ty: GgmlType,
    rows: std::ops::Range<usize>,
    name: &str,
    out: &mut Vec<u8>,
) -> Result<(), GgufError> {
    let (k, n, gs) = (q.in_features, q.out_features, q.group_size);
    match grid_of(ty) {
        Some((grid, g)) if grid == q.grid && g == gs => {}
        _ => {
            return Err(GgufError::Input(format!(
                "{name}: solved on {:?} with groups of {gs}, which {} does not hold exactly",
                q.grid,
                ty.name()
            )))
        }
    }
    ty.row_bytes(k)?;
    let mut codes = vec![0u8; k];
    for r in rows {
        for (kk, c) in codes.iter_mut().enumerate() {
            *c = q.codes[kk * n + r];
        }
        let scale = |g: usize| q.scales[g * n + r];
        let groups = k / gs;
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 => {
                let d = (0..groups)
                    .map(|g| exact_f16(scale(g), name))
                    .collect::<Result<Vec<_>, _>>()?;
                if ty == GgmlType::Q4_0 {
                    blocks::encode_q4_0(&codes, &d, out);
                } else {
                    blocks::encode_q5_0(&codes, &d, out);
                }
            }
            GgmlType::Q8_0 => {
                let d = (0..groups)
                    .map(|g| exact_f16(scale(g), name))
                    .collect::<Result<Vec<_>, _>>()?;
                let c: Vec<i8> = codes.iter().map(|&c| (c as i32 - 128) as i8).collect();
                blocks::encode_q8_0(&c, &d, out);
            }
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                let (per, max) = if ty == GgmlType::Q6_K {
                    (256 / 16, 127)
                } else {
                    (256 / 32, 63)
                };
                let tiers = k / 256;
                let mut d = Vec::with_capacity(tiers);
                let mut ks = Vec::with_capacity(groups);
                for t in 0..tiers {
                    let dt = q.tier_scales[t * n + r];
                    d.push(exact_f16(dt, name)?);
                    for g in t * per..(t + 1) * per {
                        ks.push(multiple(scale(g), dt, max, name)?);
                    }
                }
                if ty != GgmlType::Q6_K {
                    // d·sc·q − (zd)·sc = d·sc·(q − z): the zero point z (8, or 16 for Q5_K)
                    // as a min, exactly.
                    let z = q.grid.zero() as f32;
                    let dmin = d
                        .iter()
                        .map(|x| exact_f16(z * x.to_f32(), name))
                        .collect::<Result<Vec<_>, _>>()?;
                    let sc: Vec<u8> = ks.iter().map(|&k| k as u8).collect();
                    if ty == GgmlType::Q4_K {
                        blocks::encode_q4_k(&codes, &d, &dmin, &sc, &sc, out);
                    } else {
                        blocks::encode_q5_k(&codes, &d, &dmin, &sc, &sc, out);
                    }
                } else {
                    let sc: Vec<i8> = ks.iter().map(|&k| k as i8).collect();
                    blocks::encode_q6_k(&codes, &d, &sc, out);
                }
            }
            _ => unreachable!("grid_of accepted it"),
        }
    }
    Ok(())
}
