//! Writing safetensors files deterministically and without ever leaving a
//! half-written file behind.
//!
//! Our own small serializer rather than `safetensors::serialize`: that one
//! takes the metadata as a `HashMap`, so the header (and the file bytes)
//! change from run to run; reproducible artifacts need a fixed order. The
//! layout follows the format: 8-byte little-endian header length, a JSON
//! header padded with spaces to a multiple of 8, then the tensor bytes.
//! Tensors are laid out by element size, largest first, so every tensor
//! stays aligned to its element size.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use safetensors::Dtype;

use crate::artifact::ArtifactError;

/// One tensor to write: name, dtype, shape and little-endian bytes.
pub struct OwnedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl OwnedTensor {
    pub fn f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Self {
        OwnedTensor {
            name: name.into(),
            dtype: Dtype::F32,
            shape,
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
    pub fn i64(name: &str, values: &[i64]) -> Self {
        OwnedTensor {
            name: name.into(),
            dtype: Dtype::I64,
            shape: vec![values.len()],
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("tensor `{name}`: {bytes} bytes do not match dtype {dtype:?} × shape {shape:?}")]
    Inconsistent {
        name: String,
        bytes: usize,
        dtype: Dtype,
        shape: Vec<usize>,
    },
    #[error("tensor `{0}` appears twice")]
    Duplicate(String),
    #[error("{path} is not a file path")]
    NotAFile { path: String },
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// Bytes per element; every dtype spark-tool writes is at least a byte wide.
fn elem_bytes(d: Dtype) -> usize {
    d.bitsize().div_ceil(8)
}

fn dtype_name(d: Dtype) -> String {
    // safetensors' Debug names are the on-disk names (BF16, F32, I64, U8, ...).
    format!("{d:?}")
}

/// Name, dtype and shape of a tensor whose bytes are produced only when it is written.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * elem_bytes(self.dtype)
    }
}

impl OwnedTensor {
    pub fn spec(&self) -> TensorSpec {
        TensorSpec {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
        }
    }
}

/// Serialize to a temporary sibling, fsync, then rename over `path`.
pub fn write_safetensors_atomic(
    path: &Path,
    tensors: &[OwnedTensor],
    metadata: Option<BTreeMap<String, String>>,
) -> Result<(), WriteError> {
    for t in tensors {
        if t.data.len() != t.spec().bytes() {
            return Err(WriteError::Inconsistent {
                name: t.name.clone(),
                bytes: t.data.len(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            });
        }
    }
    let specs: Vec<TensorSpec> = tensors.iter().map(OwnedTensor::spec).collect();
    let by_name: std::collections::HashMap<&str, &OwnedTensor> =
        tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    write_safetensors_streamed(path, specs, metadata, |spec, w| {
        w.write_all(&by_name[spec.name.as_str()].data)
            .map_err(|source| WriteError::Io {
                path: path.display().to_string(),
                source,
            })
    })
}

/// [`write_safetensors_atomic`] with each tensor's bytes produced only when its turn comes,
/// so a file larger than memory is written holding one tensor at a time. `produce` writes the
/// bytes of the spec it is given into the writer; the calls come in file order (largest
/// element size first, then by name), which is fixed by the specs alone.
pub fn write_safetensors_streamed<E: From<WriteError>>(
    path: &Path,
    specs: Vec<TensorSpec>,
    metadata: Option<BTreeMap<String, String>>,
    mut produce: impl FnMut(&TensorSpec, &mut dyn Write) -> Result<(), E>,
) -> Result<(), E> {
    let mut order = specs;
    order.sort_by(|a, b| {
        elem_bytes(b.dtype)
            .cmp(&elem_bytes(a.dtype))
            .then(a.name.cmp(&b.name))
    });
    let mut header = serde_json::Map::new();
    if let Some(m) = metadata {
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(m).expect("string map"),
        );
    }
    let mut offset = 0usize;
    for t in &order {
        let entry = serde_json::json!({
            "dtype": dtype_name(t.dtype),
            "shape": t.shape,
            "data_offsets": [offset, offset + t.bytes()],
        });
        if header.insert(t.name.clone(), entry).is_some() {
            return Err(WriteError::Duplicate(t.name.clone()).into());
        }
        offset += t.bytes();
    }
    let mut head = serde_json::to_vec(&header).expect("json");
    head.resize(head.len().div_ceil(8) * 8, b' ');

    if path.file_name().is_none() {
        return Err(WriteError::NotAFile {
            path: path.display().to_string(),
        }
        .into());
    }
    // The producer's own error is kept aside; the writer only sees that it stopped.
    let mut failed = None;
    let written = crate::artifact::write_file(path, |w| {
        w.write_all(&(head.len() as u64).to_le_bytes())?;
        w.write_all(&head)?;
        for t in &order {
            let mut counted = Counted { inner: w, bytes: 0 };
            match produce(t, &mut counted) {
                Ok(()) if counted.bytes == t.bytes() => {}
                Ok(()) => {
                    failed = Some(E::from(WriteError::Inconsistent {
                        name: t.name.clone(),
                        bytes: counted.bytes,
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                    }));
                    return Err(std::io::Error::other("inconsistent tensor"));
                }
                Err(e) => {
                    failed = Some(e);
                    return Err(std::io::Error::other("tensor producer failed"));
                }
            }
        }
        Ok(())
    });
    if let Some(e) = failed {
        return Err(e);
    }
    written.map_err(|e| {
        match e {
            ArtifactError::Io { path, source } => WriteError::Io { path, source },
            ArtifactError::Refused(_) => WriteError::NotAFile {
                path: path.display().to_string(),
            },
        }
        .into()
    })
}

/// A writer that counts what passes through, to check each tensor's size.
struct Counted<'a, W: Write> {
    inner: &'a mut W,
    bytes: usize,
}

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::TensorStore;

    #[test]
    fn round_trips_through_the_safetensors_parser_and_is_deterministic() {
        let d = tempfile::tempdir().unwrap();
        let tensors = vec![
            OwnedTensor {
                name: "b.u8".into(),
                dtype: Dtype::U8,
                shape: vec![3],
                data: vec![1, 2, 3],
            },
            OwnedTensor::f32("a.f32", vec![2, 2], &[1.0, 2.0, 3.0, 4.0]),
            OwnedTensor::i64("c.i64", &[-5, 7]),
        ];
        let meta: BTreeMap<String, String> = [("z", "1"), ("a", "2"), ("m", "3")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (p1, p2) = (
            d.path().join("x.safetensors"),
            d.path().join("y.safetensors"),
        );
        write_safetensors_atomic(&p1, &tensors, Some(meta.clone())).unwrap();
        write_safetensors_atomic(&p2, &tensors, Some(meta)).unwrap();
        assert_eq!(std::fs::read(&p1).unwrap(), std::fs::read(&p2).unwrap());
        let s = TensorStore::open_file(&p1).unwrap();
        assert_eq!(
            s.to_f32(s.get("a.f32").unwrap()).unwrap(),
            vec![1.0, 2.0, 3.0, 4.0]
        );
        assert_eq!(s.bytes(s.get("b.u8").unwrap()), &[1, 2, 3]);
        let e = s.get("c.i64").unwrap();
        assert_eq!(e.start % 8, 0, "largest element size first keeps alignment");
        assert!(!d.path().join(".x.safetensors.partial").exists());
    }

    #[test]
    fn inconsistent_tensor_is_refused_and_nothing_is_written() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.safetensors");
        let bad = OwnedTensor {
            name: "t".into(),
            dtype: Dtype::F32,
            shape: vec![3],
            data: vec![0; 8],
        };
        assert!(matches!(
            write_safetensors_atomic(&p, &[bad], None),
            Err(WriteError::Inconsistent { .. })
        ));
        assert!(!p.exists());
    }
}
