//! A GPTQ linear as QNN's low-power block quantization (LPBQ), the int4 encoding the HTP runs
//! at full accuracy (docs/PHONE_EXPORT.md §8): `w[k, n] = γ_n · k_{b,n} · (q − 8)` with one float
//! γ per output channel and an integer `k ∈ 1…16` per block of B inputs. The codes are the
//! checkpoint's, unchanged; γ and k are read back from its scales, which `quantize --target
//! phone` puts on exactly that lattice. Anything else is refused, naming the tensor: each of the
//! encodings QNN reads silently wrong (k outside 1…16, a zero point other than 8, act-order
//! groups) must never be written.

use crate::formats::gptq::{unpack_qweight, GptqLinearData};
use crate::quant::grid::LPBQ_KMAX;

/// One linear, `[K, N]` oriented as the graph's MatMul weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Lpbq {
    pub k: usize,
    pub n: usize,
    pub block: usize,
    /// `q − 8` ∈ −8…7, `[K, N]`.
    pub codes: Vec<i8>,
    /// `[K/B, N]`, each in 1…16.
    pub kblock: Vec<u8>,
    /// `[N]`: γ times the graph's multiplier (the folded attention scale).
    pub gamma: Vec<f32>,
}

impl Lpbq {
    /// Decode columns `cols` of GPTQ linear `name`, scaled by `mul`.
    pub fn from_gptq(
        name: &str,
        d: &GptqLinearData,
        cols: std::ops::Range<usize>,
        mul: f32,
    ) -> Result<Lpbq, String> {
        let (k, g) = (d.k, d.group_size);
        let groups = k / g;
        let n = cols.len();
        if !d.contiguous() {
            return Err(format!(
                "{name}: act-order groups (g_idx ≠ k/{g}) cannot be LPBQ blocks, which are runs of consecutive inputs"
            ));
        }
        let mut gamma = vec![0f32; n];
        let mut kblock = vec![0u8; groups * n];
        for j in 0..n {
            let zs = &d.zeros[j * groups..(j + 1) * groups];
            if let Some(z) = zs.iter().find(|&&z| z != 8) {
                return Err(format!(
                    "{name}: output channel {j} has zero point {z}; LPBQ is symmetric (zero point 8)"
                ));
            }
            let s = &d.scales[j * groups..(j + 1) * groups];
            let (gm, ks) = decompose(s).ok_or_else(|| {
                format!(
                    "{name}: the scales of output channel {j} ({}) are not γ·k with one γ and integer \
                     k in 1..=16; quantize with `spark-tool quantize --target phone` to put them on that lattice",
                    preview(s)
                )
            })?;
            gamma[j] = gm * mul;
            for (b, kk) in ks.into_iter().enumerate() {
                kblock[b * n + j] = kk;
            }
        }
        let words: Vec<i32> = d
            .qweight
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let all = unpack_qweight(&words, k, d.n_all);
        let codes: Vec<i8> = all
            .chunks_exact(d.n_all)
            .flat_map(|row| row[cols.clone()].iter().map(|&q| q as i8 - 8))
            .collect();
        Ok(Lpbq {
            k,
            n,
            block: g,
            codes,
            kblock,
            gamma,
        })
    }

    /// The `[K, N]` f32 weight the two DequantizeLinear nodes compute.
    pub fn dequantize(&self) -> Vec<f32> {
        let n = self.n;
        let mut w = vec![0f32; self.k * n];
        for (kk, row) in w.chunks_exact_mut(n).enumerate() {
            let b = kk / self.block;
            for (j, v) in row.iter_mut().enumerate() {
                let scale = self.gamma[j] * self.kblock[b * n + j] as f32;
                *v = scale * self.codes[kk * n + j] as f32;
            }
        }
        w
    }

    /// The codes as ONNX INT4: two per byte, the first in the low nibble.
    pub fn int4_bytes(&self) -> Vec<u8> {
        pack_int4(&self.codes)
    }
}

/// Pack signed 4-bit values two per byte, element 2i in the low nibble (ONNX's INT4 layout).
pub fn pack_int4(v: &[i8]) -> Vec<u8> {
    v.chunks(2)
        .map(|p| {
            let lo = (p[0] as u8) & 0xF;
            let hi = p.get(1).map_or(0, |&x| (x as u8) & 0xF);
            lo | (hi << 4)
        })
        .collect()
}

/// One channel's scales as γ and per-block k ∈ 1…16 with `s_b = γ·k_b` exactly, or `None`.
/// The largest scale is γ·k_max for some k_max ≤ 16, so trying γ = max/j for j = 16…1 finds a
/// decomposition whenever one exists (the division is exact when it does).
pub fn decompose(s: &[f32]) -> Option<(f32, Vec<u8>)> {
    let top = s.iter().fold(0f32, |m, &v| m.max(v));
    if !(top.is_finite() && top > 0.0) {
        return None;
    }
    (1..=LPBQ_KMAX).rev().find_map(|j| {
        let gamma = top / j as f32;
        let ks: Option<Vec<u8>> = s
            .iter()
            .map(|&v| {
                let k = (v / gamma).round();
                (k >= 1.0 && k <= LPBQ_KMAX as f32 && gamma * k == v).then_some(k as u8)
            })
            .collect();
        ks.map(|ks| (gamma, ks))
    })
}

fn preview(s: &[f32]) -> String {
    let head: Vec<String> = s.iter().take(4).map(|v| format!("{v:e}")).collect();
    if s.len() > 4 {
        format!("{}, …", head.join(", "))
    } else {
        head.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_on_the_lattice_decompose_exactly_and_others_are_refused() {
        let gamma = crate::quant::grid::lpbq_gamma(0.0123);
        let s: Vec<f32> = [16u8, 3, 9, 1].iter().map(|&k| gamma * k as f32).collect();
        let (g, ks) = decompose(&s).unwrap();
        assert_eq!(ks.iter().map(|&k| g * k as f32).collect::<Vec<_>>(), s);
        assert!(ks.iter().all(|&k| (1..=16).contains(&k)));
        // k = 17 (what the HTP reads silently wrong) has no decomposition within 1..16.
        assert!(decompose(&[gamma * 17.0, gamma]).is_none());
        // Free bf16 scales almost never lie on one γ·k.
        assert!(decompose(&[0.013_061_523, 0.011_230_469, 0.0047]).is_none());
        assert!(decompose(&[0.0, 0.0]).is_none());
    }

    #[test]
    fn int4_packs_low_nibble_first_in_twos_complement() {
        assert_eq!(pack_int4(&[-8, 7, -1, 0, 3]), vec![0x78, 0x0F, 0x03]);
    }
}
