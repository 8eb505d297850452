//! Reading the GPTQ tensors of one linear (docs/GPTQ_FORMAT.md §1–§2): the decoding of zero
//! points, scales and g_idx that every loader needs (the tensor-set check of the layout is
//! `checkpoint::gptq::check_tensors`).

use rayon::prelude::*;
use std::ops::Range;

use super::{unpack_qzeros_v1, GptqInfo};
use crate::checkpoint::{CheckpointError, TensorEntry, TensorStore};

/// One GPTQ linear as stored, decoded for output columns `cols` (all of a split projection, or
/// its slice of a fused `q_k_v_proj`): codes stay packed in the memory map.
pub struct GptqLinearData<'a> {
    /// `qweight` bytes, i32 words `[K/8, n_all]` (little-endian).
    pub qweight: &'a [u8],
    pub n_all: usize,
    pub k: usize,
    pub group_size: usize,
    /// True zero point (v1 and v2 already resolved) per `[n, groups]` of `cols`.
    pub zeros: Vec<i32>,
    /// Scales as stored, widened to f32, per `[n, groups]` of `cols`.
    pub scales: Vec<f32>,
    /// Group of each input row.
    pub g_idx: Vec<usize>,
}

impl GptqLinearData<'_> {
    /// `g_idx == k / G` (no act-order permutation).
    pub fn contiguous(&self) -> bool {
        let g = self.group_size;
        self.g_idx.iter().enumerate().all(|(kk, &gi)| gi == kk / g)
    }
}

fn entry<'a>(store: &'a TensorStore, name: &str) -> Result<&'a TensorEntry, CheckpointError> {
    store.get(name).ok_or_else(|| CheckpointError::Tensors {
        problems: vec![format!("missing tensor `{name}`")],
    })
}

fn i32s(store: &TensorStore, name: &str) -> Result<Vec<i32>, CheckpointError> {
    let e = entry(store, name)?;
    Ok(store
        .bytes(e)
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Decode linear `prefix` (its `qweight`/`qzeros`/`scales`/`g_idx`) for columns `cols`.
pub fn read_linear<'a>(
    store: &'a TensorStore,
    info: &GptqInfo,
    prefix: &str,
    cols: Range<usize>,
) -> Result<GptqLinearData<'a>, CheckpointError> {
    let qw = entry(store, &format!("{prefix}.qweight"))?;
    let (k, n_all) = (qw.shape[0] * 8, qw.shape[1]);
    let g = info.group_size;
    let groups = k / g;
    let mut zeros_gn = unpack_qzeros_v1(&i32s(store, &format!("{prefix}.qzeros"))?, groups, n_all);
    if info.v2 {
        zeros_gn.iter_mut().for_each(|z| *z -= 1);
    }
    let scales_gn = store.to_f32(entry(store, &format!("{prefix}.scales"))?)?;
    let g_idx: Vec<usize> = match store.get(&format!("{prefix}.g_idx")) {
        Some(_) => i32s(store, &format!("{prefix}.g_idx"))?
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
    if cols.end > n_all {
        return Err(CheckpointError::Tensors {
            problems: vec![format!(
                "`{prefix}` has {n_all} output columns, columns {cols:?} were asked for"
            )],
        });
    }
    // As bf16 (what vLLM and the kernels use): an f32 scale beyond bf16's range is infinite too.
    let round_bf16 = crate::kernels::w4::round_bf16;
    if let Some(i) = scales_gn.iter().position(|s| !round_bf16(*s).is_finite()) {
        return Err(CheckpointError::Tensors {
            problems: vec![format!(
                "`{prefix}.scales` holds a value that is not finite as bf16 ({}) at element {i}; the checkpoint is corrupt",
                scales_gn[i]
            )],
        });
    }
    let n = cols.len();
    let mut zeros = vec![0i32; n * groups];
    let mut scales = vec![0f32; n * groups];
    // [groups, n_all] → [n, groups], by columns in parallel (on the load's critical path).
    zeros
        .par_chunks_mut(groups)
        .zip(scales.par_chunks_mut(groups))
        .zip(cols)
        .for_each(|((z, s), col)| {
            for gi in 0..groups {
                z[gi] = zeros_gn[gi * n_all + col] as i32;
                s[gi] = scales_gn[gi * n_all + col];
            }
        });
    Ok(GptqLinearData {
        qweight: store.bytes(qw),
        n_all,
        k,
        group_size: g,
        zeros,
        scales,
        g_idx,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::checkpoint::gptq::check_tensors;
    use crate::checkpoint::write::{write_safetensors_atomic, OwnedTensor};
    use crate::formats::gptq::tensors_for;
    use crate::quant::QuantizedWeight;

    /// A K = 32, N = 16, G = 8 linear with distinct codes and scales.
    pub(crate) fn weight() -> QuantizedWeight {
        let (k, n, g) = (32, 16, 8);
        QuantizedWeight {
            in_features: k,
            out_features: n,
            group_size: g,
            codes: (0..k * n).map(|i| ((i * 7 + i / 16) % 16) as u8).collect(),
            scales: (0..k / g * n).map(|i| 0.01 * (1 + i % 13) as f32).collect(),
            grid: crate::quant::Grid::VLLM,
            tier_scales: Vec::new(),
        }
    }

    pub(crate) fn info(v2: bool) -> GptqInfo {
        GptqInfo {
            group_size: 8,
            desc_act: false,
            lm_head: false,
            v2,
            spark_tool_format: None,
        }
    }

    /// Write `w` under prefix `x`, then let `edit` change the tensors (v2 zeros, act-order).
    pub(crate) fn store_of(
        w: &QuantizedWeight,
        dir: &std::path::Path,
        edit: impl FnOnce(&mut Vec<OwnedTensor>),
    ) -> TensorStore {
        let mut t = tensors_for("x", w).unwrap();
        edit(&mut t);
        let p = dir.join("x.safetensors");
        write_safetensors_atomic(&p, &t, None).unwrap();
        TensorStore::open_file(&p).unwrap()
    }

    #[test]
    fn decodes_what_tensors_for_wrote_for_any_column_slice() {
        let d = tempfile::tempdir().unwrap();
        let w = weight();
        let store = store_of(&w, d.path(), |_| {});
        for cols in [0..16, 8..16, 3..11] {
            let r = read_linear(&store, &info(false), "x", cols.clone()).unwrap();
            assert!(r.contiguous());
            assert!(r.zeros.iter().all(|&z| z == 8), "v1 stores zero − 1");
            for (j, c) in cols.enumerate() {
                for g in 0..4 {
                    assert_eq!(
                        r.scales[j * 4 + g],
                        half::f16::from_f32(w.scales[g * 16 + c]).to_f32()
                    );
                }
            }
        }
        let e = read_linear(&store, &info(false), "x", 8..17).err().unwrap();
        assert!(e.to_string().contains("16 output columns"), "{e}");
    }

    /// Found by fuzzing (fuzz/fuzz_targets/gptq_tensors.rs): group size 0 with k = 0 passed
    /// `k.is_multiple_of(g)` and divided by zero.
    #[test]
    fn group_size_zero_is_a_problem_not_a_division_by_zero() {
        let d = tempfile::tempdir().unwrap();
        let store = store_of(&weight(), d.path(), |_| {});
        for (n, k) in [(0, 0), (16, 32)] {
            let mut problems = Vec::new();
            check_tensors(&store, "x", n, k, 0, &mut problems);
            assert!(problems[0].contains("group size 0"), "{problems:?}");
        }
    }

    #[test]
    fn v2_zeros_act_order_and_bad_g_idx() {
        let d = tempfile::tempdir().unwrap();
        let w = weight();
        let set = |t: &mut Vec<OwnedTensor>, part: &str, v: Vec<i32>| {
            let x = t
                .iter_mut()
                .find(|x| x.name == format!("x.{part}"))
                .unwrap();
            x.data = v.iter().flat_map(|v| v.to_le_bytes()).collect();
        };
        // v2 stores the zero itself: 0x88888888 means 8.
        let s = store_of(&w, d.path(), |t| {
            set(t, "qzeros", vec![0x8888_8888u32 as i32; 8])
        });
        let r = read_linear(&s, &info(true), "x", 0..16).unwrap();
        assert!(r.zeros.iter().all(|&z| z == 8));
        // Act-order: a permuted g_idx is kept and reported as not contiguous.
        let perm: Vec<i32> = (0..32).map(|k| (k * 5) % 32 / 8).collect();
        let s = store_of(&w, d.path(), |t| set(t, "g_idx", perm.clone()));
        let r = read_linear(&s, &info(false), "x", 0..16).unwrap();
        assert!(!r.contiguous());
        assert_eq!(
            r.g_idx,
            perm.iter().map(|&g| g as usize).collect::<Vec<_>>()
        );
        // A g_idx past the groups is an error naming the tensor.
        let s = store_of(&w, d.path(), |t| set(t, "g_idx", vec![4; 32]));
        let e = read_linear(&s, &info(false), "x", 0..16).err().unwrap();
        assert!(e.to_string().contains("x.g_idx"), "{e}");
    }

    /// A scale that is not finite as bf16 (an fp16 infinity, or an f32 beyond bf16's range) is
    /// an error naming the tensor; the largest fp16 and a large but bf16-finite f32 are not.
    #[test]
    fn scales_must_be_finite_as_bf16() {
        let d = tempfile::tempdir().unwrap();
        let w = weight();
        let as_f32 = |t: &mut Vec<OwnedTensor>, v: f32| {
            let x = t.iter_mut().find(|x| x.name == "x.scales").unwrap();
            let n = x.data.len() / 2;
            *x = OwnedTensor::f32("x.scales", x.shape.clone(), &vec![v; n]);
        };
        for (v, ok) in [
            (65504.0, true),
            (3.0e38, true),
            (3.4e38, false),
            (f32::INFINITY, false),
        ] {
            let s = store_of(&w, d.path(), |t| as_f32(t, v));
            match read_linear(&s, &info(false), "x", 0..16) {
                Ok(_) => assert!(ok, "{v} accepted"),
                Err(e) => {
                    assert!(!ok, "{v}: {e}");
                    assert!(e.to_string().contains("x.scales"), "{e}");
                }
            }
        }
    }
}
