//! Float decode-step graph → w8a16 QDQ graph (docs/PHONE_IO.md §1–§3):
//! int8 symmetric per-output-channel weights on every MatMul; uint16
//! asymmetric per-tensor activations from calibrated ranges; the KV side
//! (cache inputs, new entries, the concatenated caches and the rotated key
//! feeding them) symmetric int16 (or uint8) with one encoding per layer and
//! side, so the host copies raw integers from `_out` to `_in`; Sigmoid
//! outputs fixed at scale 1/65536 as the QNN EP requires, Softmax outputs too.

use std::collections::{HashMap, HashSet};

use super::graph::{key_in, key_out, value_in, value_out, Repr, WeightSpec};
use super::onnx::{Attr, DType, Graph, Node, Source, TensorInfo};
use crate::phone::manifest::{Encoding, QType};

/// Calibrated [min, max] per float tensor.
#[derive(Debug, Default, Clone)]
pub struct Ranges(pub HashMap<String, (f32, f32)>);

impl Ranges {
    /// Widens `name`'s range to cover `values` (NaN ignored).
    pub fn observe(&mut self, name: &str, values: &[f32]) {
        use rayon::prelude::*;
        let (lo, hi) = values.par_chunks(1 << 16).map(min_max).reduce(
            || (f32::INFINITY, f32::NEG_INFINITY),
            |a, b| (a.0.min(b.0), a.1.max(b.1)),
        );
        let e = self
            .0
            .entry(name.to_string())
            .or_insert((f32::INFINITY, f32::NEG_INFINITY));
        e.0 = e.0.min(lo);
        e.1 = e.1.max(hi);
    }
}

/// Min and max of `v` (NaN ignored), in 16 lanes the compiler vectorises.
fn min_max(v: &[f32]) -> (f32, f32) {
    let mut lo = [f32::INFINITY; 16];
    let mut hi = [f32::NEG_INFINITY; 16];
    let c = v.chunks_exact(16);
    let rest = c.remainder();
    for c in c {
        for i in 0..16 {
            if c[i] < lo[i] {
                lo[i] = c[i];
            }
            if c[i] > hi[i] {
                hi[i] = c[i];
            }
        }
    }
    for (i, &x) in rest.iter().enumerate() {
        if x < lo[i] {
            lo[i] = x;
        }
        if x > hi[i] {
            hi[i] = x;
        }
    }
    (
        lo.iter().fold(f32::INFINITY, |a, &b| a.min(b)),
        hi.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
    )
}

fn qtype_dtype(q: QType) -> DType {
    match q {
        QType::Uint16 => DType::U16,
        QType::Int16 => DType::I16,
        QType::Uint8 => DType::U8,
    }
}

fn zp_bytes(e: &Encoding) -> Vec<u8> {
    match e.dtype {
        QType::Uint16 => (e.zero_point as u16).to_le_bytes().to_vec(),
        QType::Int16 => (e.zero_point as i16).to_le_bytes().to_vec(),
        QType::Uint8 => vec![e.zero_point as u8],
    }
}

pub struct Quantized {
    pub graph: Graph<WeightSpec>,
    /// Encoding of every quantized activation (by its float tensor name) and graph I/O.
    pub encodings: HashMap<String, Encoding>,
}

/// Encodings for every float activation of `g`, or the names without a range.
/// Calibrated ranges are widened by `margin`: 16-bit codes have resolution to
/// spare, while clipping an activation the calibration text never produced
/// (another language, a rare token) costs far more.
pub fn plan_encodings(
    g: &Graph<WeightSpec>,
    layers: std::ops::Range<usize>,
    ranges: &Ranges,
    kv: QType,
    margin: f32,
) -> Result<HashMap<String, Encoding>, Vec<String>> {
    let mut enc = HashMap::new();
    let mut missing = Vec::new();
    // KV groups: one symmetric encoding per layer and side.
    for l in layers {
        let rk = format!("l{l}_krope_rot");
        for (group, src) in [
            (
                vec![key_in(l), key_out(l), format!("l{l}_kall"), rk.clone()],
                vec![key_out(l), rk],
            ),
            (
                vec![value_in(l), value_out(l), format!("l{l}_vall")],
                vec![value_out(l)],
            ),
        ] {
            let absmax = src
                .iter()
                .filter_map(|s| ranges.0.get(s))
                .fold(0f32, |m, (a, b)| m.max(a.abs()).max(b.abs()));
            if absmax == 0.0 {
                missing.push(src[0].clone());
            }
            let e = Encoding::symmetric(kv, absmax * margin);
            for t in group {
                enc.insert(t, e);
            }
        }
    }
    let producer: HashMap<&str, &Node> = g
        .nodes
        .iter()
        .flat_map(|n| n.outputs.iter().map(move |o| (o.as_str(), n)))
        .collect();
    let floats: Vec<String> = g
        .inputs
        .iter()
        .map(|i| i.name.clone())
        .chain(g.nodes.iter().flat_map(|n| n.outputs.clone()))
        .filter(|t| g.info[t].dtype == DType::F32)
        .collect();
    for t in &floats {
        if enc.contains_key(t) {
            continue;
        }
        let node = producer.get(t.as_str());
        let e = match node.map(|n| n.op.as_str()) {
            // [0, 1] on its exact grid, not a calibrated one widened by the margin: the EP
            // requires it of Sigmoid, and for attention probabilities it halves the HTP's step
            // (measured: +5.7 dB on the probs·V output of a 1.7B-shaped layer, PHONE_EXPORT.md).
            Some("Sigmoid") | Some("Softmax") => Encoding {
                dtype: QType::Uint16,
                scale: 1.0 / 65536.0,
                zero_point: 0,
                min: 0.0,
                max: 65535.0 / 65536.0,
            },
            _ => match ranges.0.get(t) {
                Some(&(lo, hi)) if lo.is_finite() && hi.is_finite() => {
                    // Masks and cos/sin are built by the host: their range is exact.
                    let m = if t.starts_with("attention_mask_") || t.starts_with("position_ids_") {
                        1.0
                    } else {
                        margin
                    };
                    Encoding::asymmetric(QType::Uint16, lo * m, hi * m)
                }
                _ => {
                    missing.push(t.clone());
                    continue;
                }
            },
        };
        enc.insert(t.clone(), e);
    }
    // Pure data movement keeps its input's encoding (no requantization): reshapes, and around
    // each norm's LpNormalization the Concat appending √(H·eps) to x (the constant is then
    // written on x's grid) and the Slice dropping it again.
    for n in &g.nodes {
        if n.op == "Reshape" && !enc_is_kv(&n.outputs[0]) {
            if let Some(e) = enc.get(&n.inputs[0]).copied() {
                enc.insert(n.outputs[0].clone(), e);
            }
        }
        if n.op == "LpNormalization" {
            let aug = producer.get(n.inputs[0].as_str());
            if let Some(c) = aug.filter(|c| c.op == "Concat") {
                if let Some(e) = enc.get(&c.inputs[0]).copied() {
                    enc.insert(c.outputs[0].clone(), e);
                }
            }
        }
        if n.op == "Slice"
            && producer.get(n.inputs[0].as_str()).map(|p| p.op.as_str()) == Some("LpNormalization")
        {
            if let Some(e) = enc.get(&n.inputs[0]).copied() {
                enc.insert(n.outputs[0].clone(), e);
            }
        }
    }
    if missing.is_empty() {
        Ok(enc)
    } else {
        Err(missing)
    }
}

fn enc_is_kv(t: &str) -> bool {
    t.starts_with("past_")
}

/// A float constant as uint16 codes: min(0, ·)…max(0, ·) over 65535 steps (a positive scalar
/// is exactly code 65535).
fn uint16_constant(v: &[f32]) -> (Encoding, Vec<u16>) {
    let lo = v.iter().fold(0f32, |m, &x| m.min(x));
    let hi = v.iter().fold(0f32, |m, &x| m.max(x));
    let scale = if hi > lo { (hi - lo) / 65535.0 } else { 1.0 };
    let zero_point = (-lo / scale).round() as i32;
    let codes = v
        .iter()
        .map(|&x| ((x / scale).round() as i32 + zero_point).clamp(0, 65535) as u16)
        .collect();
    let e = Encoding {
        dtype: QType::Uint16,
        scale,
        zero_point,
        min: lo,
        max: hi,
    };
    (e, codes)
}

/// `v` as uint16 codes of the activation encoding `e` (rounded, clamped to its range).
fn uint16_on_grid(v: &[f32], e: &Encoding) -> Vec<u16> {
    v.iter()
        .map(|&x| ((x / e.scale).round() as i32 + e.zero_point).clamp(0, 65535) as u16)
        .collect()
}

/// The LPBQ pattern QNN's EP fuses into one block-quantized MatMul weight (docs/PHONE_EXPORT.md
/// §8): `DQ1(k uint8 [K/B, N], γ [N], uint8 zero point, axis 1)` gives the block scales, `DQ2(INT4
/// codes [K, N], those scales, INT4 zero point [K/B, N], axis 0, block_size B)` the weight. Both
/// zero points are explicit (an omitted INT4 zero point is read as int8 by the EP) and the
/// result feeds MatMul only (into Gemm it runs wrong). Returns the weight's name.
fn lpbq_weight(q: &mut Graph<WeightSpec>, name: &str, shape: &[usize], spec: WeightSpec) -> String {
    let [k, n] = [shape[0], shape[1]];
    let b = spec.gptq_group.expect("a GPTQ weight");
    let blocks = k / b;
    let codes = q.init(
        &format!("{name}_q4"),
        DType::I4,
        &[k, n],
        Source::Deferred(WeightSpec {
            repr: Repr::Int4,
            ..spec.clone()
        }),
    );
    let kb = q.init(
        &format!("{name}_kblock"),
        DType::U8,
        &[blocks, n],
        Source::Deferred(WeightSpec {
            repr: Repr::LpbqK,
            ..spec.clone()
        }),
    );
    let gamma = q.init(
        &format!("{name}_gamma"),
        DType::F32,
        &[n],
        Source::Deferred(WeightSpec {
            repr: Repr::LpbqGamma,
            ..spec
        }),
    );
    let kzp = q.init(
        &format!("{name}_kblock_zp"),
        DType::U8,
        &[n],
        Source::Bytes(vec![0; n]),
    );
    let bscale = q.node(
        "DequantizeLinear",
        &format!("{name}_block_scale"),
        &[&kb, &gamma, &kzp],
        DType::F32,
        &[blocks, n],
        vec![("axis", Attr::Int(1))],
    );
    let zp = q.init(
        &format!("{name}_q4_zp"),
        DType::I4,
        &[blocks, n],
        Source::Bytes(vec![0; DType::I4.byte_len(blocks * n)]),
    );
    q.node(
        "DequantizeLinear",
        &format!("{name}_dq"),
        &[&codes, &bscale, &zp],
        DType::F32,
        &[k, n],
        vec![("axis", Attr::Int(0)), ("block_size", Attr::Int(b as i64))],
    )
}

/// Rewrite `g` into QDQ form with `enc` (from [`plan_encodings`]).
pub fn quantize(g: Graph<WeightSpec>, enc: HashMap<String, Encoding>) -> Quantized {
    let outputs: HashSet<String> = g.outputs.iter().map(|o| o.name.clone()).collect();
    let inits: HashSet<String> = g.inits.iter().map(|i| i.info.name.clone()).collect();
    let names = QdqNames { outputs: &outputs };
    let mut q = Graph::new(&g.name);
    for i in &g.inputs {
        let e = enc[&i.name];
        if enc_is_kv(&i.name) {
            q.input(&i.name, qtype_dtype(e.dtype), &i.shape);
            names.add_qdq(&mut q, &i.name, &g.info[&i.name].shape, &e, false);
        } else {
            q.input(&i.name, DType::F32, &i.shape);
            names.add_qdq(&mut q, &i.name, &g.info[&i.name].shape, &e, true);
        }
    }
    let on_grid = concat_grids(&g, &enc, &inits);
    // Each quantized initializer's name → the name of its dequantized value.
    let mut weights: HashMap<String, String> = HashMap::new();
    for init in g.inits {
        let name = init.info.name.clone();
        match init.source {
            Source::Deferred(spec) if spec.gptq_group.is_some() => {
                let dq = lpbq_weight(&mut q, &name, &init.info.shape, spec);
                weights.insert(name, dq);
            }
            Source::Deferred(spec) => {
                let dq = int8_weight(&mut q, &name, &init.info.shape, spec);
                weights.insert(name, dq);
            }
            Source::Bytes(b) if init.info.dtype == DType::F32 => {
                let dq = uint16_constant_init(&mut q, &init.info, &b, on_grid.get(&name));
                weights.insert(name, dq);
            }
            src => {
                q.init(&name, init.info.dtype, &init.info.shape, src);
            }
        }
    }
    for n in g.nodes {
        let inputs: Vec<String> = n
            .inputs
            .iter()
            .map(|t| {
                if let Some(w) = weights.get(t) {
                    w.clone()
                } else if inits.contains(t) || g.info[t].dtype != DType::F32 {
                    t.clone()
                } else {
                    names.dq(t)
                }
            })
            .collect();
        let out = n.outputs[0].clone();
        let info = g.info[&out].clone();
        q.push(
            Node {
                name: format!("{}/{}", names.float(&out), n.op),
                op: n.op,
                inputs,
                outputs: vec![names.float(&out)],
                attrs: n.attrs,
            },
            info.dtype,
            &info.shape,
        );
        if info.dtype == DType::F32 {
            names.add_qdq(&mut q, &out, &info.shape, &enc[&out], true);
        }
    }
    for o in &g.outputs {
        let e = enc[&o.name];
        let name = if enc_is_kv(&o.name) {
            names.q(&o.name)
        } else {
            names.dq(&o.name)
        };
        let info = q.info[&name].clone();
        debug_assert!(enc_is_kv(&o.name) == (info.dtype == qtype_dtype(e.dtype)));
        q.outputs.push(TensorInfo {
            name,
            dtype: info.dtype,
            shape: info.shape,
        });
    }
    Quantized {
        graph: q,
        encodings: enc,
    }
}

/// The names of a float tensor's three values in the QDQ graph: float, integer (quantized) and
/// dequantized. A graph output keeps its own name on the value the app reads: the integer one
/// for the KV cache, the dequantized one otherwise.
struct QdqNames<'a> {
    outputs: &'a HashSet<String>,
}

impl QdqNames<'_> {
    fn float(&self, t: &str) -> String {
        if self.outputs.contains(t) {
            format!("{t}_f")
        } else {
            t.to_string()
        }
    }

    fn q(&self, t: &str) -> String {
        if enc_is_kv(t) {
            t.to_string()
        } else {
            format!("{t}_q")
        }
    }

    fn dq(&self, t: &str) -> String {
        if self.outputs.contains(t) && !enc_is_kv(t) {
            t.to_string()
        } else {
            format!("{t}_dq")
        }
    }

    /// Append the QuantizeLinear (when `with_q`) and DequantizeLinear nodes of activation `t`
    /// of `shape` with encoding `e`.
    fn add_qdq(
        &self,
        q: &mut Graph<WeightSpec>,
        t: &str,
        shape: &[usize],
        e: &Encoding,
        with_q: bool,
    ) {
        let sc = q.const_f32(&format!("{t}_scale"), &[e.scale], &[]);
        let zp = q.init(
            &format!("{t}_zp"),
            qtype_dtype(e.dtype),
            &[],
            Source::Bytes(zp_bytes(e)),
        );
        if with_q {
            q.node(
                "QuantizeLinear",
                &self.q(t),
                &[&self.float(t), &sc, &zp],
                qtype_dtype(e.dtype),
                shape,
                Vec::new(),
            );
        }
        q.node(
            "DequantizeLinear",
            &self.dq(t),
            &[&self.q(t), &sc, &zp],
            DType::F32,
            shape,
            Vec::new(),
        );
    }
}

/// The float initializers a Concat joins to a uint16 activation, each with that Concat's
/// encoding: they are written on its grid.
fn concat_grids(
    g: &Graph<WeightSpec>,
    enc: &HashMap<String, Encoding>,
    inits: &HashSet<String>,
) -> HashMap<String, Encoding> {
    g.nodes
        .iter()
        .filter(|n| n.op == "Concat")
        .flat_map(|n| {
            let e = enc
                .get(&n.outputs[0])
                .copied()
                .filter(|e| e.dtype == QType::Uint16);
            n.inputs
                .iter()
                .filter(|t| inits.contains(*t) && g.info[*t].dtype == DType::F32)
                .filter_map(move |t| e.map(|e| (t.clone(), e)))
        })
        .collect()
}

/// A float weight `[k, n]` as int8 symmetric per output channel, dequantized; returns the
/// dequantized value's name.
fn int8_weight(q: &mut Graph<WeightSpec>, name: &str, shape: &[usize], spec: WeightSpec) -> String {
    let [k, n] = [shape[0], shape[1]];
    let wq = q.init(
        &format!("{name}_q"),
        DType::I8,
        &[k, n],
        Source::Deferred(WeightSpec {
            repr: Repr::Q8,
            ..spec.clone()
        }),
    );
    let ws = q.init(
        &format!("{name}_scale"),
        DType::F32,
        &[n],
        Source::Deferred(WeightSpec {
            repr: Repr::Q8Scale,
            ..spec
        }),
    );
    let wz = q.init(
        &format!("{name}_zp"),
        DType::I8,
        &[n],
        Source::Bytes(vec![0; n]),
    );
    q.node(
        "DequantizeLinear",
        &format!("{name}_dq"),
        &[&wq, &ws, &wz],
        DType::F32,
        &[k, n],
        vec![("axis", Attr::Int(1))],
    )
}

/// A float constant (the RMSNorm epsilon: exact uint16 code 65535; a norm weight applied on its
/// own: uint16 over its range) as uint16, dequantized; one a Concat joins to an activation
/// (`grid`) is written on the Concat's grid. Returns the dequantized value's name.
fn uint16_constant_init(
    q: &mut Graph<WeightSpec>,
    info: &TensorInfo,
    bytes: &[u8],
    grid: Option<&Encoding>,
) -> String {
    let name = &info.name;
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let (e, codes) = match grid {
        Some(e) => (*e, uint16_on_grid(&v, e)),
        None => uint16_constant(&v),
    };
    let c = q.init(
        &format!("{name}_q"),
        DType::U16,
        &info.shape,
        Source::Bytes(codes.iter().flat_map(|c| c.to_le_bytes()).collect()),
    );
    let sc = q.const_f32(&format!("{name}_scale"), &[e.scale], &[]);
    let zp = q.init(
        &format!("{name}_zp"),
        DType::U16,
        &[],
        Source::Bytes(zp_bytes(&e)),
    );
    q.node(
        "DequantizeLinear",
        &format!("{name}_dq"),
        &[&c, &sc, &zp],
        DType::F32,
        &info.shape,
        Vec::new(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{QkvLayout, SparkConfig};
    use crate::export::graph::tests::tiny;
    use crate::export::graph::{plan_parts, StepBuilder};

    #[test]
    fn observe_is_the_plain_min_max_with_nan_ignored() {
        // Long enough for several parallel chunks, with a ragged tail and NaNs among the values.
        let v: Vec<f32> = (0..200_003)
            .map(|i| match i % 7919 {
                0 => f32::NAN,
                _ => ((i as f32) * 0.37).sin() * (1.0 + (i % 13) as f32),
            })
            .collect();
        let want = v
            .iter()
            .filter(|x| !x.is_nan())
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        for n in [0, 1, 15, 17, 200_003] {
            let mut r = Ranges::default();
            r.observe("t", &v[..n]);
            let want = if n == v.len() {
                want
            } else {
                v[..n]
                    .iter()
                    .filter(|x| !x.is_nan())
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                        (a.min(x), b.max(x))
                    })
            };
            assert_eq!(r.0["t"], want, "{n} values");
        }
        // A second observation widens, never narrows.
        let mut r = Ranges::default();
        r.observe("t", &[1.0, 2.0]);
        r.observe("t", &[1.5]);
        assert_eq!(r.0["t"], (1.0, 2.0));
    }

    fn graph() -> (SparkConfig, Graph<WeightSpec>) {
        let cfg = tiny();
        let qkv = vec![QkvLayout::Fused; cfg.num_hidden_layers];
        let g = StepBuilder {
            cfg: &cfg,
            qkv: &qkv,
            tied: true,
            context: 128,
            gptq: &std::collections::BTreeSet::new(),
            gptq_group: 0,
            norms: None,
        }
        .build(&plan_parts(&cfg, 1)[0]);
        (cfg, g)
    }

    /// Every float tensor observed in [−1, 2] (and the KV side in [−3, 3]).
    fn ranges(g: &Graph<WeightSpec>) -> Ranges {
        let mut r = Ranges::default();
        for t in g.info.keys() {
            r.observe(t, &[-1.0, 2.0]);
        }
        for l in 0..8 {
            for t in [key_out(l), value_out(l)] {
                r.observe(&t, &[-3.0, 3.0]);
            }
        }
        r
    }

    #[test]
    fn kv_encodings_are_tied_symmetric_int16_and_sigmoid_is_fixed() {
        let (cfg, g) = graph();
        let layers = 0..cfg.num_hidden_layers;
        let enc = plan_encodings(&g, layers.clone(), &ranges(&g), QType::Int16, 2.0).unwrap();
        for l in layers {
            let k = enc[&key_in(l)];
            for t in [key_out(l), format!("l{l}_kall")] {
                assert_eq!(enc[&t], k, "{t} shares the layer's key encoding");
            }
            assert_eq!((k.dtype, k.zero_point), (QType::Int16, 0));
            // absmax 3 widened by the margin 2.
            assert!((k.scale - 6.0 / 32767.0).abs() < 1e-9, "{}", k.scale);
            assert_eq!(enc[&value_in(l)], enc[&value_out(l)]);
        }
        let sigmoid = g.nodes.iter().find(|n| n.op == "Sigmoid").unwrap();
        let s = enc[&sigmoid.outputs[0]];
        assert_eq!(
            (s.dtype, s.scale, s.zero_point),
            (QType::Uint16, 1.0 / 65536.0, 0)
        );
        // Activations: asymmetric uint16 over the widened range.
        let a = enc[&g.nodes.iter().find(|n| n.op == "MatMul").unwrap().outputs[0]];
        assert_eq!(a.dtype, QType::Uint16);
        assert!(
            (a.min + 2.0).abs() < 1e-3 && (a.max - 4.0).abs() < 1e-3,
            "{a:?}"
        );
    }

    #[test]
    fn softmax_is_on_the_exact_unit_grid_and_each_norm_moves_data_without_requantizing() {
        let (cfg, g) = graph();
        let enc =
            plan_encodings(&g, 0..cfg.num_hidden_layers, &ranges(&g), QType::Int16, 2.0).unwrap();
        let softmax: Vec<_> = g.nodes.iter().filter(|n| n.op == "Softmax").collect();
        assert_eq!(softmax.len(), cfg.num_hidden_layers);
        for n in softmax {
            let e = enc[&n.outputs[0]];
            assert_eq!(
                (e.dtype, e.scale, e.zero_point),
                (QType::Uint16, 1.0 / 65536.0, 0)
            );
        }
        let lp: Vec<_> = g
            .nodes
            .iter()
            .filter(|n| n.op == "LpNormalization")
            .collect();
        // Two per layer and the final norm.
        assert_eq!(lp.len(), 2 * cfg.num_hidden_layers + 1);
        for n in lp {
            let concat = g
                .nodes
                .iter()
                .find(|c| c.outputs[0] == n.inputs[0])
                .unwrap();
            assert_eq!(concat.op, "Concat");
            assert_eq!(
                enc[&concat.outputs[0]], enc[&concat.inputs[0]],
                "{}",
                n.name
            );
            let slice = g
                .nodes
                .iter()
                .find(|s| s.inputs[0] == n.outputs[0])
                .unwrap();
            assert_eq!(slice.op, "Slice");
            assert_eq!(enc[&slice.outputs[0]], enc[&n.outputs[0]], "{}", n.name);
        }
        // The appended √(H·eps) is written on x's grid: its code decodes to the constant
        // within half a step.
        let q = quantize(g, enc.clone());
        let concat = q
            .graph
            .nodes
            .iter()
            .find(|n| n.op == "Concat" && n.name.starts_with("l0_ln1"))
            .unwrap();
        let x = enc["input_embeds"];
        let dq = q
            .graph
            .nodes
            .iter()
            .find(|n| n.outputs[0] == concat.inputs[1])
            .unwrap();
        let init = q
            .graph
            .inits
            .iter()
            .find(|i| i.info.name == dq.inputs[0])
            .unwrap();
        let Source::Bytes(b) = &init.source else {
            panic!("constant bytes")
        };
        let code = u16::from_le_bytes([b[0], b[1]]) as i32;
        let c = (cfg.hidden_size as f64 * cfg.rms_norm_eps as f64).sqrt() as f32;
        let back = (code - x.zero_point) as f32 * x.scale;
        assert!((back - c).abs() <= x.scale / 2.0 + 1e-9, "{back} vs {c}");
        let sc = q
            .graph
            .inits
            .iter()
            .find(|i| i.info.name == dq.inputs[1])
            .unwrap();
        let Source::Bytes(sb) = &sc.source else {
            panic!("scale bytes")
        };
        assert_eq!(f32::from_le_bytes([sb[0], sb[1], sb[2], sb[3]]), x.scale);
    }

    #[test]
    fn a_tensor_without_a_range_is_named() {
        let (cfg, g) = graph();
        let mut r = ranges(&g);
        let victim = g.nodes.iter().find(|n| n.op == "Add").unwrap().outputs[0].clone();
        r.0.remove(&victim);
        let missing =
            plan_encodings(&g, 0..cfg.num_hidden_layers, &r, QType::Int16, 2.0).unwrap_err();
        assert_eq!(missing, vec![victim]);
    }

    #[test]
    fn every_matmul_weight_is_int8_per_channel_and_kv_io_is_integer() {
        let (cfg, g) = graph();
        let enc =
            plan_encodings(&g, 0..cfg.num_hidden_layers, &ranges(&g), QType::Int16, 2.0).unwrap();
        let q = quantize(g, enc);
        let producer: HashMap<&str, &Node> = q
            .graph
            .nodes
            .iter()
            .flat_map(|n| n.outputs.iter().map(move |o| (o.as_str(), n)))
            .collect();
        let inits: HashMap<&str, &DType> = q
            .graph
            .inits
            .iter()
            .map(|i| (i.info.name.as_str(), &i.info.dtype))
            .collect();
        let mut weights = 0;
        for n in q.graph.nodes.iter().filter(|n| n.op == "MatMul") {
            let dq = producer[n.inputs[1].as_str()];
            assert_eq!(dq.op, "DequantizeLinear", "{}", n.name);
            if let Some(dt) = inits.get(dq.inputs[0].as_str()) {
                assert_eq!(**dt, DType::I8, "{}: int8 weight", n.name);
                let n_out = *q.graph.info[&n.inputs[1]].shape.last().unwrap();
                assert_eq!(
                    q.graph.info[&dq.inputs[1]].shape,
                    vec![n_out],
                    "{}: one scale per output channel",
                    n.name
                );
                weights += 1;
            }
        }
        assert!(
            weights >= 7 * cfg.num_hidden_layers,
            "{weights} int8 weights"
        );
        for i in q
            .graph
            .inputs
            .iter()
            .filter(|i| i.name.starts_with("past_"))
        {
            assert_eq!(i.dtype, DType::I16, "{}", i.name);
        }
        for o in q
            .graph
            .outputs
            .iter()
            .filter(|o| o.name.starts_with("past_"))
        {
            assert_eq!(q.graph.info[&o.name].dtype, DType::I16, "{}", o.name);
        }
    }
}
