//! The graph's weights, read from the checkpoint one matrix at a time when the ONNX writer asks
//! for them: norm folding, the per-channel int8 quantization of w8a16, float16 storage.

use std::collections::{BTreeMap, HashMap};

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
        let e = self.ck.entry(&s.tensor)?;
        let w = self.ck.store.rows_to_f32(e, s.rows.start, s.rows.end)?;
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
        let (n, k) = (s.rows.len(), s.k);
        let mut out = vec![0f32; k * n];
        for j in 0..n {
            for kk in 0..k {
                let f = fold.map_or(1.0, |f| f[kk]);
                out[kk * n + j] = w[j * k + kk] * f * s.mul;
            }
        }
        Ok(out)
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
        let m = self.matrix(s).map_err(io)?;
        let n = s.rows.len();
        let scales = || -> Vec<f32> {
            let mut absmax = vec![0f32; n];
            for row in m.chunks_exact(n) {
                for (a, v) in absmax.iter_mut().zip(row) {
                    *a = a.max(v.abs());
                }
            }
            absmax
                .iter()
                .map(|a| if *a > 0.0 { a / 127.0 } else { 1.0 })
                .collect()
        };
        Ok(match s.repr {
            Repr::F32 => m.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Repr::F16 => m
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            Repr::Q8 => {
                let sc = scales();
                m.chunks_exact(n)
                    .flat_map(|row| {
                        row.iter()
                            .zip(&sc)
                            .map(|(v, s)| {
                                (v / s).round_ties_even().clamp(-127.0, 127.0) as i8 as u8
                            })
                            .collect::<Vec<u8>>()
                    })
                    .collect()
            }
            Repr::Q8Scale => {
                let sc = scales();
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
    Ok(OwnedTensor {
        name: "embed_tokens".into(),
        dtype: e.dtype,
        shape: e.shape.clone(),
        data: ck.store.bytes(e).to_vec(),
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
