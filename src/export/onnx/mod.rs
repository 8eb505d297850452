//! ONNX protobuf (prost types generated from the official `onnx.proto` by
//! `tools/onnx-proto-gen`) and a small graph IR that writes it with the
//! weights streamed to an external-data file, so the `.onnx` itself stays
//! far below protobuf's 2 GiB cap.

#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod pb {
    include!("onnx.rs");
}

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Seek, Write};
use std::path::Path;

use prost::Message;
use serde::Serialize;

/// Element types the exporter uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    I8,
    U8,
    I16,
    U16,
    I32,
    I64,
    /// Signed 4-bit, two per byte (low nibble first).
    I4,
}

impl DType {
    /// Bytes of `numel` packed elements.
    pub fn byte_len(self, numel: usize) -> usize {
        match self {
            DType::F32 | DType::I32 => 4 * numel,
            DType::I8 | DType::U8 => numel,
            DType::I16 | DType::U16 | DType::F16 => 2 * numel,
            DType::I64 => 8 * numel,
            DType::I4 => numel.div_ceil(2),
        }
    }

    pub fn onnx(self) -> i32 {
        use pb::tensor_proto::DataType as D;
        (match self {
            DType::F32 => D::Float,
            DType::F16 => D::Float16,
            DType::I8 => D::Int8,
            DType::U8 => D::Uint8,
            DType::I16 => D::Int16,
            DType::U16 => D::Uint16,
            DType::I32 => D::Int32,
            DType::I64 => D::Int64,
            DType::I4 => D::Int4,
        }) as i32
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

#[derive(Debug, Clone)]
pub enum Attr {
    Int(i64),
    Str(String),
}

#[derive(Debug, Clone)]
pub struct Node {
    pub op: String,
    pub name: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub attrs: Vec<(String, Attr)>,
}

/// Where an initializer's bytes come from: inline, or computed at write
/// time (so a 1.7B export never holds more than one matrix in memory).
#[derive(Clone)]
pub enum Source<W> {
    Bytes(Vec<u8>),
    Deferred(W),
}

#[derive(Clone)]
pub struct Initializer<W> {
    pub info: TensorInfo,
    pub source: Source<W>,
}

/// A graph under construction. `W` describes deferred weights.
#[derive(Clone)]
pub struct Graph<W> {
    pub name: String,
    pub inputs: Vec<TensorInfo>,
    pub outputs: Vec<TensorInfo>,
    pub nodes: Vec<Node>,
    pub inits: Vec<Initializer<W>>,
    /// Type and shape of every tensor (inputs, node outputs, initializers).
    pub info: HashMap<String, TensorInfo>,
}

impl<W> Graph<W> {
    pub fn new(name: &str) -> Self {
        Graph {
            name: name.into(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            nodes: Vec::new(),
            inits: Vec::new(),
            info: HashMap::new(),
        }
    }

    pub fn input(&mut self, name: &str, dtype: DType, shape: &[usize]) -> String {
        let t = TensorInfo {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        };
        self.info.insert(name.into(), t.clone());
        self.inputs.push(t);
        name.into()
    }

    /// Declare an existing tensor a graph output.
    pub fn output(&mut self, name: &str) {
        let t = self.info[name].clone();
        self.outputs.push(t);
    }

    pub fn init(&mut self, name: &str, dtype: DType, shape: &[usize], source: Source<W>) -> String {
        let info = TensorInfo {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        };
        self.info.insert(name.into(), info.clone());
        self.inits.push(Initializer { info, source });
        name.into()
    }

    pub fn const_i64(&mut self, name: &str, values: &[i64]) -> String {
        if self.info.contains_key(name) {
            return name.into();
        }
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.init(name, DType::I64, &[values.len()], Source::Bytes(bytes))
    }

    pub fn const_f32(&mut self, name: &str, values: &[f32], shape: &[usize]) -> String {
        if self.info.contains_key(name) {
            return name.into();
        }
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.init(name, DType::F32, shape, Source::Bytes(bytes))
    }

    /// Add a node with one output `out` of the given type and shape.
    pub fn node(
        &mut self,
        op: &str,
        out: &str,
        inputs: &[&str],
        dtype: DType,
        shape: &[usize],
        attrs: Vec<(&str, Attr)>,
    ) -> String {
        debug_assert!(
            !self.info.contains_key(out),
            "tensor `{out}` produced twice"
        );
        self.nodes.push(Node {
            op: op.into(),
            name: format!("{out}/{op}"),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            outputs: vec![out.into()],
            attrs: attrs.into_iter().map(|(k, v)| (k.into(), v)).collect(),
        });
        self.info.insert(
            out.into(),
            TensorInfo {
                name: out.into(),
                dtype,
                shape: shape.to_vec(),
            },
        );
        out.into()
    }

    /// Add a prepared node whose single output has the given type and shape.
    pub fn push(&mut self, node: Node, dtype: DType, shape: &[usize]) {
        let out = node.outputs[0].clone();
        debug_assert!(
            !self.info.contains_key(&out),
            "tensor `{out}` produced twice"
        );
        self.info.insert(
            out.clone(),
            TensorInfo {
                name: out,
                dtype,
                shape: shape.to_vec(),
            },
        );
        self.nodes.push(node);
    }

    /// Rename tensor `from` to `to` everywhere (inputs, outputs, nodes).
    pub fn rename(&mut self, from: &str, to: &str) {
        for n in &mut self.nodes {
            for t in n.inputs.iter_mut().chain(n.outputs.iter_mut()) {
                if t == from {
                    *t = to.to_string();
                }
            }
        }
        for t in self.inputs.iter_mut().chain(self.outputs.iter_mut()) {
            if t.name == from {
                t.name = to.to_string();
            }
        }
        if let Some(mut i) = self.info.remove(from) {
            i.name = to.to_string();
            self.info.insert(to.to_string(), i);
        }
    }

    /// Float op whose output shape is given.
    pub fn f(&mut self, op: &str, out: &str, inputs: &[&str], shape: &[usize]) -> String {
        self.node(op, out, inputs, DType::F32, shape, Vec::new())
    }

    pub fn shape(&self, t: &str) -> &[usize] {
        &self.info[t].shape
    }
}

fn value_info(t: &TensorInfo) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::{dimension::Value, Dimension};
    use pb::type_proto::{Tensor, Value as TV};
    pb::ValueInfoProto {
        name: Some(t.name.clone()),
        r#type: Some(pb::TypeProto {
            value: Some(TV::TensorType(Tensor {
                elem_type: Some(t.dtype.onnx()),
                shape: Some(pb::TensorShapeProto {
                    dim: t
                        .shape
                        .iter()
                        .map(|&d| Dimension {
                            value: Some(Value::DimValue(d as i64)),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn attribute(name: &str, a: &Attr) -> pb::AttributeProto {
    use pb::attribute_proto::AttributeType as T;
    let mut p = pb::AttributeProto {
        name: Some(name.into()),
        ..Default::default()
    };
    match a {
        Attr::Int(i) => {
            p.r#type = Some(T::Int as i32);
            p.i = Some(*i);
        }
        Attr::Str(s) => {
            p.r#type = Some(T::String as i32);
            p.s = Some(s.as_bytes().to_vec());
        }
    }
    p
}

/// Initializers at least this large go to the external-data file.
const EXTERNAL_MIN_BYTES: usize = 1024;
/// Alignment of external tensors (lets a runtime mmap them directly).
const EXTERNAL_ALIGN: u64 = 64;

/// What was written.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WriteSummary {
    pub proto_bytes: u64,
    pub external_bytes: u64,
    pub initializers: usize,
    pub nodes: usize,
}

/// Write `graph` as `dir/file` (+ `dir/file.data`) with opset 21 / IR 10.
/// `resolve` turns a deferred weight into its little-endian bytes; it is
/// called once per initializer, in order, so memory stays at one matrix.
pub fn write_model<W>(
    graph: &Graph<W>,
    dir: &Path,
    file: &str,
    metadata: &BTreeMap<String, String>,
    mut resolve: impl FnMut(&TensorInfo, &W) -> std::io::Result<Vec<u8>>,
) -> std::io::Result<WriteSummary> {
    let data_name = format!("{file}.data");
    let mut data = BufWriter::new(File::create(dir.join(&data_name))?);
    let mut offset = 0u64;
    let mut initializers = Vec::with_capacity(graph.inits.len());
    for init in &graph.inits {
        let owned;
        let bytes: &[u8] = match &init.source {
            Source::Bytes(b) => b,
            Source::Deferred(w) => {
                owned = resolve(&init.info, w)?;
                &owned
            }
        };
        let numel: usize = init.info.shape.iter().product();
        if bytes.len() != init.info.dtype.byte_len(numel) {
            return Err(std::io::Error::other(format!(
                "initializer `{}`: {} bytes for shape {:?}",
                init.info.name,
                bytes.len(),
                init.info.shape
            )));
        }
        let mut t = pb::TensorProto {
            name: Some(init.info.name.clone()),
            data_type: Some(init.info.dtype.onnx()),
            dims: init.info.shape.iter().map(|&d| d as i64).collect(),
            ..Default::default()
        };
        if bytes.len() >= EXTERNAL_MIN_BYTES {
            let pad = (EXTERNAL_ALIGN - offset % EXTERNAL_ALIGN) % EXTERNAL_ALIGN;
            data.write_all(&vec![0u8; pad as usize])?;
            offset += pad;
            data.write_all(bytes)?;
            let entry = |k: &str, v: String| pb::StringStringEntryProto {
                key: Some(k.into()),
                value: Some(v),
            };
            t.data_location = Some(pb::tensor_proto::DataLocation::External as i32);
            t.external_data = vec![
                entry("location", data_name.clone()),
                entry("offset", offset.to_string()),
                entry("length", bytes.len().to_string()),
            ];
            offset += bytes.len() as u64;
        } else {
            t.raw_data = Some(bytes.to_vec());
        }
        initializers.push(t);
    }
    data.flush()?;
    data.get_mut().sync_all()?;
    let external_bytes = data.stream_position()?;
    drop(data);

    let nodes = graph
        .nodes
        .iter()
        .map(|n| pb::NodeProto {
            input: n.inputs.clone(),
            output: n.outputs.clone(),
            name: Some(n.name.clone()),
            op_type: Some(n.op.clone()),
            domain: Some(String::new()),
            attribute: n.attrs.iter().map(|(k, v)| attribute(k, v)).collect(),
            ..Default::default()
        })
        .collect::<Vec<_>>();
    let model = pb::ModelProto {
        ir_version: Some(10),
        opset_import: vec![pb::OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(21),
        }],
        producer_name: Some("spark-tool".into()),
        producer_version: Some(env!("CARGO_PKG_VERSION").into()),
        graph: Some(pb::GraphProto {
            node: nodes,
            name: Some(graph.name.clone()),
            initializer: initializers,
            input: graph.inputs.iter().map(value_info).collect(),
            output: graph.outputs.iter().map(value_info).collect(),
            ..Default::default()
        }),
        metadata_props: metadata
            .iter()
            .map(|(k, v)| pb::StringStringEntryProto {
                key: Some(k.clone()),
                value: Some(v.clone()),
            })
            .collect(),
        ..Default::default()
    };
    let buf = model.encode_to_vec();
    let mut f = File::create(dir.join(file))?;
    f.write_all(&buf)?;
    f.sync_all()?;
    Ok(WriteSummary {
        proto_bytes: buf.len() as u64,
        external_bytes,
        initializers: graph.inits.len(),
        nodes: graph.nodes.len(),
    })
}
