//! Writing safetensors files without ever leaving a half-written file behind.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

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

/// Serialize to `path.tmp` in the same folder, fsync, then rename over `path`.
pub fn write_safetensors_atomic(
    path: &Path,
    tensors: &[OwnedTensor],
    metadata: Option<HashMap<String, String>>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let views = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .map(|v| (t.name.clone(), v))
                .with_context(|| format!("tensor `{}` has inconsistent shape/bytes", t.name))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, metadata).context("serializing safetensors")?;
    let file_name = path
        .file_name()
        .with_context(|| format!("{} is not a file path", path.display()))?;
    let tmp = path.with_file_name(format!(".{}.partial", file_name.to_string_lossy()));
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
}
