//! The graph's weights, read from the checkpoint one matrix at a time when the ONNX writer asks
//! for them: norm folding, the per-channel int8 quantization of w8a16, float16 storage.

use std::collections::{BTreeMap, HashMap};

use rayon::prelude::*;

use crate::kernels::transpose;
use crate::kernels::w4::round_ties_even_small;

use super::graph::{Repr, WeightSpec};
use super::lpbq::Lpbq;
use super::onnx::{self, DType, Graph, TensorInfo};
use super::ExportError;
use crate::checkpoint::write::OwnedTensor;
use crate::checkpoint::{Checkpoint, CheckpointError};

/// Reads deferred weights from the checkpoint, one matrix at a time.
pub(super) struct WeightReader<'a> {
    pub(super) ck: &'a Checkpoint,
    pub(super) norms: HashMap<String, Vec<f32>>,
    /// Per-channel scales of every int8 weight written (for `.encodings`).
    pub(super) scales: BTreeMap<String, Vec<f32>>,
    /// Every LPBQ weight written: its γ and k (for `.encodings`).
    pub(super) lpbq: BTreeMap<String, LpbqEncoding>,
    /// The GPTQ linear last decoded (its three initializers are resolved one after another).
    last: Option<(String, std::ops::Range<usize>, u32, Lpbq)>,
    /// The scales of the int8 weight last written, for its scales initializer.
    last_q8: Option<(Q8Key, Vec<f32>)>,
}

/// What determines an int8 weight's values: tensor, rows, folded norm, multiplier.
type Q8Key = (String, std::ops::Range<usize>, Option<String>, u32);

fn q8_key(s: &WeightSpec) -> Q8Key {
    (
        s.tensor.clone(),
        s.rows.clone(),
        s.fold.clone(),
        s.mul.to_bits(),
    )
}

/// Symmetric int8 per output channel of an `[N, K]` matrix: codes `[N, K]` in −127…127 and the
/// scales (absmax / 127, 1 for an all-zero channel).
fn quantize_q8(m: &[f32], k: usize) -> (Vec<i8>, Vec<f32>) {
    let n = m.len() / k;
    let mut q = vec![0i8; n * k];
    let mut sc = vec![0f32; n];
    q.par_chunks_mut(k)
        .zip(sc.par_iter_mut())
        .zip(m.par_chunks(k))
        .for_each(|((q, s), row)| {
            let a = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            *s = if a > 0.0 { a / 127.0 } else { 1.0 };
            for (q, v) in q.iter_mut().zip(row) {
                // Clamped first, so the rounding trick's |x| ≤ 2²² holds; ±127 are integers, so
                // this is the old round-then-clamp.
                *q = round_ties_even_small((v / *s).clamp(-127.0, 127.0)) as i8;
            }
        });
    (q, sc)
}

/// What AIMET's `.encodings` says of one LPBQ weight.
pub(super) struct LpbqEncoding {
    pub block: usize,
    pub gamma: Vec<f32>,
    /// `[K/B, N]`.
    pub kblock: Vec<u8>,
}

/// A GPTQ linear the export cannot write as LPBQ, named.
fn refused(msg: String) -> CheckpointError {
    CheckpointError::Tensors {
        problems: vec![msg],
    }
}

impl<'a> WeightReader<'a> {
    pub(super) fn new(ck: &'a Checkpoint) -> Self {
        WeightReader {
            ck,
            norms: HashMap::new(),
            scales: BTreeMap::new(),
            lpbq: BTreeMap::new(),
            last: None,
            last_q8: None,
        }
    }

    /// The LPBQ form of GPTQ weight `s`.
    pub(super) fn lpbq_of(&mut self, s: &WeightSpec) -> Result<&Lpbq, CheckpointError> {
        let hit = matches!(&self.last, Some((t, r, m, _))
            if *t == s.tensor && *r == s.rows && *m == s.mul.to_bits());
        if !hit {
            let info = self.ck.config.gptq.as_ref().ok_or_else(|| {
                refused(format!(
                    "`{}` is GPTQ but config.json has no quantization_config",
                    s.tensor
                ))
            })?;
            let d =
                crate::formats::gptq::read_linear(&self.ck.store, info, &s.tensor, s.rows.clone())?;
            let l = Lpbq::from_gptq(&s.tensor, &d, s.rows.clone(), s.mul).map_err(refused)?;
            self.last = Some((s.tensor.clone(), s.rows.clone(), s.mul.to_bits(), l));
        }
        Ok(&self.last.as_ref().expect("just set").3)
    }

    /// `[K, N]` = (rows of `[N_all, K]`)ᵀ with the folded norm and multiplier.
    pub(super) fn matrix(&mut self, s: &WeightSpec) -> Result<Vec<f32>, CheckpointError> {
        if s.gptq_group.is_some() {
            return Ok(self.lpbq_of(s)?.dequantize());
        }
        Ok(transpose(&self.matrix_nk(s)?, s.rows.len(), s.k))
    }

    /// The same weight as `[N, K]`: each output channel's row as the checkpoint stores it.
    pub(super) fn matrix_nk(&mut self, s: &WeightSpec) -> Result<Vec<f32>, CheckpointError> {
        if s.gptq_group.is_some() {
            let d = self.lpbq_of(s)?.dequantize();
            return Ok(transpose(&d, s.k, s.rows.len()));
        }
        let e = self.ck.entry(&s.tensor)?;
        let mut w = self.ck.store.rows_to_f32(e, s.rows.start, s.rows.end)?;
        self.ck.store.release_rows(e, s.rows.start, s.rows.end);
        let fold = match &s.fold {
            Some(f) => {
                if !self.norms.contains_key(f) {
                    let v = self.ck.tensor_f32(f)?;
                    self.norms.insert(f.clone(), v);
                }
                Some(&self.norms[f])
            }
            None => None,
        };
        let mul = s.mul;
        w.par_chunks_mut(s.k).for_each(|row| match fold {
            Some(f) => row.iter_mut().zip(f).for_each(|(v, f)| *v = *v * f * mul),
            None => row.iter_mut().for_each(|v| *v *= mul),
        });
        Ok(w)
    }

    pub(super) fn resolve(
        &mut self,
        info: &TensorInfo,
        s: &WeightSpec,
    ) -> std::io::Result<Vec<u8>> {
        let io = std::io::Error::other;
        match s.repr {
            Repr::Int4 => return Ok(self.lpbq_of(s).map_err(io)?.int4_bytes()),
            Repr::LpbqK => return Ok(self.lpbq_of(s).map_err(io)?.kblock.clone()),
            Repr::LpbqGamma => {
                let l = self.lpbq_of(s).map_err(io)?;
                let bytes = l.gamma.iter().flat_map(|v| v.to_le_bytes()).collect();
                let enc = LpbqEncoding {
                    block: l.block,
                    gamma: l.gamma.clone(),
                    kblock: l.kblock.clone(),
                };
                let weight = info.name.trim_end_matches("_gamma").to_string();
                self.lpbq.insert(weight, enc);
                return Ok(bytes);
            }
            _ => {}
        }
        let n = s.rows.len();
        Ok(match s.repr {
            Repr::F32 => {
                let m = self.matrix(s).map_err(io)?;
                m.iter().flat_map(|v| v.to_le_bytes()).collect()
            }
            Repr::F16 => {
                let m = self.matrix(s).map_err(io)?;
                m.iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect()
            }
            Repr::Q8 => {
                let (q, sc) = quantize_q8(&self.matrix_nk(s).map_err(io)?, s.k);
                // The scales initializer follows; it takes them from here.
                self.last_q8 = Some((q8_key(s), sc));
                transpose(&q, n, s.k).into_iter().map(|v| v as u8).collect()
            }
            Repr::Q8Scale => {
                let sc = match self.last_q8.take() {
                    Some((key, sc)) if key == q8_key(s) => sc,
                    _ => quantize_q8(&self.matrix_nk(s).map_err(io)?, s.k).1,
                };
                let bytes = sc.iter().flat_map(|v| v.to_le_bytes()).collect();
                let weight = info.name.trim_end_matches("_scale").to_string();
                self.scales.insert(weight, sc);
                bytes
            }
            Repr::Int4 | Repr::LpbqK | Repr::LpbqGamma => unreachable!("returned above"),
        })
    }
}

pub(super) fn embedding_tensor(ck: &Checkpoint) -> Result<OwnedTensor, ExportError> {
    let e = ck.entry("model.embedding.weight")?;
    let data = ck.store.bytes(e).to_vec();
    ck.store.release_rows(e, 0, e.shape[0]);
    Ok(OwnedTensor {
        name: "embed_tokens".into(),
        dtype: e.dtype,
        shape: e.shape.clone(),
        data,
    })
}

/// Store every MatMul weight as float16 and `Cast` it to float32 where it is used.
pub(super) fn half_weights(mut g: Graph<WeightSpec>) -> Graph<WeightSpec> {
    let mut casts = Vec::new();
    for init in &mut g.inits {
        if let onnx::Source::Deferred(spec) = &mut init.source {
            spec.repr = Repr::F16;
            init.info.dtype = DType::F16;
            casts.push((init.info.name.clone(), init.info.shape.clone()));
        }
    }
    let mut nodes = Vec::with_capacity(g.nodes.len() + casts.len());
    for (name, shape) in casts {
        let out = format!("{name}_f32");
        g.info.get_mut(&name).expect("initializer info").dtype = DType::F16;
        g.info.insert(
            out.clone(),
            TensorInfo {
                name: out.clone(),
                dtype: DType::F32,
                shape,
            },
        );
        nodes.push(onnx::Node {
            op: "Cast".into(),
            name: format!("{out}/Cast"),
            inputs: vec![name.clone()],
            outputs: vec![out.clone()],
            attrs: vec![("to".into(), onnx::Attr::Int(DType::F32.onnx() as i64))],
        });
        for n in &mut g.nodes {
            for i in &mut n.inputs {
                if *i == name {
                    *i = out.clone();
                }
            }
        }
    }
    nodes.append(&mut g.nodes);
    g.nodes = nodes;
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_codes_and_scales_are_per_output_channel() {
        let m = [0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 3.0, 0.03, -3.0];
        let (q, s) = quantize_q8(&m, 3);
        assert_eq!(s, vec![1.0, 2.0 / 127.0, 3.0 / 127.0]);
        assert_eq!(q, vec![0, 0, 0, 64, -127, 32, 127, 1, -127]);
    }
}
