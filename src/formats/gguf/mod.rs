//! llama.cpp's GGUF v3 file format, both ways (docs/GGUF.md §1): the container (header, typed
//! metadata, tensor infos, aligned data) streamed out tensor by tensor and read back from a
//! memory map; the block layouts in [`blocks`]; a solved linear as blocks in [`quantized`]; the
//! per-tensor type rule of llama.cpp's file types in [`mix`]; the Spark names and keys in [`spark`].
//!
//! Written here rather than taken from a crate: `ggus` 0.5 (the maintained Rust GGUF crate)
//! unwraps I/O errors while writing tensor infos, and its block crate `ggml-quants` 0.1 leaves
//! the K-quants unimplemented.

pub mod activations;
pub mod blocks;
pub mod mix;
pub mod quantized;
pub mod spark;

use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Input(String),
    /// A malformed file, with where in it.
    #[error("{path}: not a valid GGUF file: {what}")]
    Malformed { path: PathBuf, what: String },
}

/// The GGML tensor types spark-tool reads and writes (ids as in ggml).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
    BF16,
}

impl GgmlType {
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    pub fn from_id(id: u32) -> Option<Self> {
        [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::BF16,
        ]
        .into_iter()
        .find(|t| t.id() == id)
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 => 32,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::BF16 => "BF16",
        }
    }

    /// Bytes of one row of `k` elements; an error when `k` is not whole blocks.
    pub fn row_bytes(self, k: usize) -> Result<usize, GgufError> {
        if !k.is_multiple_of(self.block_len()) {
            return Err(GgufError::Input(format!(
                "a row of {k} elements is not whole {} blocks of {}",
                self.name(),
                self.block_len()
            )));
        }
        Ok(k / self.block_len() * self.block_bytes())
    }
}

/// A metadata value. Arrays hold one type.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

const ARRAY: u32 = 9;
const STRING: u32 = 8;

impl Value {
    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => STRING,
            Value::Array(_) => ARRAY,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The payload (without the type id).
    fn encode(&self, key: &str, out: &mut Vec<u8>) -> Result<(), GgufError> {
        match self {
            Value::U8(v) => out.push(*v),
            Value::I8(v) => out.push(*v as u8),
            Value::U16(v) => out.extend(v.to_le_bytes()),
            Value::I16(v) => out.extend(v.to_le_bytes()),
            Value::U32(v) => out.extend(v.to_le_bytes()),
            Value::I32(v) => out.extend(v.to_le_bytes()),
            Value::U64(v) => out.extend(v.to_le_bytes()),
            Value::I64(v) => out.extend(v.to_le_bytes()),
            Value::F32(v) => out.extend(v.to_le_bytes()),
            Value::F64(v) => out.extend(v.to_le_bytes()),
            Value::Bool(v) => out.push(*v as u8),
            Value::String(s) => put_str(out, s),
            Value::Array(items) => {
                let ty = items.first().map_or(Value::U8(0).type_id(), Value::type_id);
                if items.iter().any(|v| v.type_id() != ty) || ty == ARRAY {
                    return Err(GgufError::Input(format!(
                        "metadata {key}: an array must hold values of one scalar or string type"
                    )));
                }
                out.extend(ty.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for v in items {
                    v.encode(key, out)?;
                }
            }
        }
        Ok(())
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// One tensor's name, shape and type. `dims[0]` is the row length (ggml order: the innermost
/// dimension first), so a PyTorch `[N, K]` weight is `[K, N]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.checked_elements().unwrap_or(u64::MAX)
    }

    fn checked_elements(&self) -> Option<u64> {
        self.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }

    /// Bytes of data; checked (shape, blocks, no overflow) on write and on read.
    pub fn nbytes(&self) -> usize {
        self.checked_nbytes().unwrap_or(0)
    }

    fn checked_nbytes(&self) -> Option<usize> {
        let row = *self.dims.first()? as usize;
        let rows = self.checked_elements()? / (row.max(1) as u64);
        self.ty
            .row_bytes(row)
            .ok()?
            .checked_mul(usize::try_from(rows).ok()?)
    }

    /// Why llama.cpp would refuse this tensor, if it would.
    fn problem(&self) -> Option<String> {
        if self.name.len() >= 64 {
            return Some("a tensor name must be shorter than 64 bytes".into());
        }
        if !(1..=4).contains(&self.dims.len()) {
            return Some(format!(
                "{} dimensions; 1 to 4 are allowed",
                self.dims.len()
            ));
        }
        if self.dims.contains(&0) || self.checked_nbytes().is_none() {
            return Some(format!(
                "shape {:?} is empty, overflows, or its rows are not whole {} blocks",
                self.dims,
                self.ty.name()
            ));
        }
        None
    }
}

/// The first name that appears twice.
fn repeated<'a>(names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut seen = std::collections::HashSet::new();
    names.into_iter().find(|n| !seen.insert(*n))
}

fn pad(n: usize, align: usize) -> usize {
    (align - n % align) % align
}

/// Streams a GGUF file: the header, metadata and tensor infos up front (offsets follow from the
/// declared sizes), then each tensor's data in the declared order, in one or more parts.
pub struct GgufWriter<W: Write> {
    w: W,
    tensors: Vec<TensorInfo>,
    align: usize,
    /// Index of the tensor being written and the bytes of it written so far.
    at: usize,
    written: usize,
}

impl<W: Write> GgufWriter<W> {
    pub fn new(
        mut w: W,
        kv: &[(String, Value)],
        tensors: &[TensorInfo],
        alignment: usize,
    ) -> Result<Self, GgufError> {
        let align = match kv.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, Value::U32(a))) => *a as usize,
            Some((_, v)) => {
                return Err(GgufError::Input(format!(
                    "metadata general.alignment is {v:?}; it must be a u32"
                )))
            }
            None => alignment,
        };
        if !align.is_power_of_two() {
            return Err(GgufError::Input(format!(
                "alignment {align} must be a power of two"
            )));
        }
        if let Some(k) = repeated(kv.iter().map(|(k, _)| k.as_str())) {
            return Err(GgufError::Input(format!("metadata key {k} appears twice")));
        }
        if let Some(n) = repeated(tensors.iter().map(|t| t.name.as_str())) {
            return Err(GgufError::Input(format!("tensor {n} appears twice")));
        }
        if let Some((t, why)) = tensors.iter().find_map(|t| t.problem().map(|p| (t, p))) {
            return Err(GgufError::Input(format!("tensor {}: {why}", t.name)));
        }
        let mut head = Vec::new();
        head.extend(b"GGUF");
        head.extend(3u32.to_le_bytes());
        head.extend((tensors.len() as u64).to_le_bytes());
        head.extend((kv.len() as u64).to_le_bytes());
        for (k, v) in kv {
            put_str(&mut head, k);
            head.extend(v.type_id().to_le_bytes());
            v.encode(k, &mut head)?;
        }
        let mut offset = 0usize;
        for t in tensors {
            put_str(&mut head, &t.name);
            head.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend(d.to_le_bytes());
            }
            head.extend(t.ty.id().to_le_bytes());
            head.extend((offset as u64).to_le_bytes());
            offset += t.nbytes();
            offset += pad(offset, align);
        }
        head.resize(head.len() + pad(head.len(), align), 0);
        w.write_all(&head).map_err(io("the GGUF header"))?;
        Ok(GgufWriter {
            w,
            tensors: tensors.to_vec(),
            align,
            at: 0,
            written: 0,
        })
    }

    /// A whole tensor's data.
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<(), GgufError> {
        self.write_tensor_part(name, bytes)?;
        if self.written != 0 {
            let t = &self.tensors[self.at];
            return Err(GgufError::Input(format!(
                "tensor {name}: {} of its {} bytes written",
                self.written,
                t.nbytes()
            )));
        }
        Ok(())
    }

    /// The next bytes of tensor `name`; it is complete when its declared size is reached.
    pub fn write_tensor_part(&mut self, name: &str, bytes: &[u8]) -> Result<(), GgufError> {
        let Some(t) = self.tensors.get(self.at) else {
            return Err(GgufError::Input(format!(
                "tensor {name}: every declared tensor is already written"
            )));
        };
        if t.name != name {
            return Err(GgufError::Input(format!(
                "tensor {name} written where {} was declared",
                t.name
            )));
        }
        let size = t.nbytes();
        if self.written + bytes.len() > size {
            return Err(GgufError::Input(format!(
                "tensor {name}: {} bytes written, {size} declared",
                self.written + bytes.len()
            )));
        }
        self.w.write_all(bytes).map_err(io(name))?;
        self.written += bytes.len();
        if self.written == size {
            let zeros = vec![0u8; pad(size, self.align)];
            self.w.write_all(&zeros).map_err(io(name))?;
            self.at += 1;
            self.written = 0;
        }
        Ok(())
    }

    /// Checks that every declared tensor was written; returns the writer.
    pub fn finish(mut self) -> Result<W, GgufError> {
        if let Some(t) = self.tensors.get(self.at) {
            return Err(GgufError::Input(format!(
                "tensor {} (and any after it) was declared but not written",
                t.name
            )));
        }
        self.w.flush().map_err(io("the GGUF data"))?;
        Ok(self.w)
    }
}

fn io(what: &str) -> impl FnOnce(std::io::Error) -> GgufError + '_ {
    move |source| GgufError::Io {
        path: PathBuf::from(what),
        source,
    }
}

/// A GGUF file read from a memory map.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    kv: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    /// Absolute byte offset of each tensor's data.
    offsets: Vec<usize>,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn bad(&self, what: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            what: format!("{} (at byte {})", what.into(), self.at),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(self.bad(format!("truncated: {n} more bytes needed")));
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn str(&mut self) -> Result<String, GgufError> {
        let n = self.u64()? as usize;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.bad("a string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, GgufError> {
        let b = |c: &mut Self, n| c.take(n);
        Ok(match ty {
            0 => Value::U8(b(self, 1)?[0]),
            1 => Value::I8(b(self, 1)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(b(self, 2)?.try_into().expect("2"))),
            3 => Value::I16(i16::from_le_bytes(b(self, 2)?.try_into().expect("2"))),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_bits(self.u32()?)),
            7 => Value::Bool(b(self, 1)?[0] != 0),
            STRING => Value::String(self.str()?),
            ARRAY if depth == 0 => {
                let ty = self.u32()?;
                let n = self.u64()? as usize;
                // Every element takes at least one byte: a count beyond the file is malformed.
                if n > self.b.len() - self.at {
                    return Err(self.bad(format!("an array claims {n} elements")));
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ty, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => return Err(self.bad(format!("unknown metadata value type {other}"))),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the map is read-only; a file changed underneath is the user's to avoid, as
        // with every memory-mapped model file.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut c = Cursor {
            b: &map,
            at: 0,
            path,
        };
        if c.take(4)? != b"GGUF" {
            return Err(c.bad("the magic is not GGUF"));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.bad(format!("version {version}; 2 and 3 are supported")));
        }
        let (n_tensors, n_kv) = (c.u64()? as usize, c.u64()? as usize);
        if n_tensors > map.len() || n_kv > map.len() {
            return Err(c.bad("tensor or metadata count larger than the file"));
        }
        // Counts come from the file: capacities are capped, the loops fail on truncation.
        let mut kv = Vec::with_capacity(n_kv.min(1024));
        for _ in 0..n_kv {
            let k = c.str()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0).map_err(|e| match e {
                GgufError::Malformed { path, what } => GgufError::Malformed {
                    path,
                    what: format!("metadata {k}: {what}"),
                },
                e => e,
            })?;
            kv.push((k, v));
        }
        if let Some(k) = repeated(kv.iter().map(|(k, _)| k.as_str())) {
            return Err(c.bad(format!("metadata key {k} appears twice")));
        }
        let align = match kv.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, Value::U32(a))) if a.is_power_of_two() => *a as usize,
            Some((_, v)) => {
                return Err(c.bad(format!(
                    "general.alignment is {v:?}; it must be a u32 power of two"
                )))
            }
            None => 32,
        };
        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16));
        let mut rel = Vec::with_capacity(n_tensors.min(1 << 16));
        for _ in 0..n_tensors {
            let name = c.str()?;
            let nd = c.u32()? as usize;
            if nd == 0 || nd > 4 {
                return Err(c.bad(format!("tensor {name} has {nd} dimensions")));
            }
            let dims = (0..nd).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
            let id = c.u32()?;
            let ty = GgmlType::from_id(id).ok_or_else(|| {
                c.bad(format!(
                    "tensor {name} has GGML type {id}, which spark-tool does not read"
                ))
            })?;
            let off = c.u64()? as usize;
            if !off.is_multiple_of(align) {
                return Err(c.bad(format!(
                    "tensor {name}: offset {off} is not aligned to {align}"
                )));
            }
            let t = TensorInfo { name, dims, ty };
            if let Some(why) = t.problem() {
                return Err(c.bad(format!("tensor {}: {why}", t.name)));
            }
            tensors.push(t);
            rel.push(off);
        }
        if let Some(n) = repeated(tensors.iter().map(|t| t.name.as_str())) {
            return Err(c.bad(format!("tensor {n} appears twice")));
        }
        let data = c.at + pad(c.at, align);
        let mut offsets = Vec::with_capacity(n_tensors);
        let mut spans: Vec<(usize, usize, &str)> = Vec::new();
        for (t, &off) in tensors.iter().zip(&rel) {
            let start = data.checked_add(off);
            let end = start.and_then(|s| s.checked_add(t.nbytes()));
            match (start, end) {
                (Some(s), Some(e)) if e <= map.len() => {
                    offsets.push(s);
                    spans.push((s, e, &t.name));
                }
                _ => {
                    return Err(c.bad(format!(
                        "tensor {}: data lies beyond the end of the file",
                        t.name
                    )))
                }
            }
        }
        spans.sort();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(c.bad(format!("tensors {} and {} overlap", w[0].2, w[1].2)));
            }
        }
        drop(spans);
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            kv,
            tensors,
            offsets,
        })
    }

    pub fn kv(&self, key: &str) -> Option<&Value> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn metadata(&self) -> &[(String, Value)] {
        &self.kv
    }

    fn missing(&self, what: &str) -> GgufError {
        GgufError::Input(format!("{}: {what}", self.path.display()))
    }

    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        match self.kv(key) {
            Some(Value::U32(v)) => Ok(*v),
            Some(v) => Err(self.missing(&format!("metadata {key} is {v:?}, expected a u32"))),
            None => Err(self.missing(&format!("metadata {key} is missing"))),
        }
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match self.kv(key) {
            Some(Value::F32(v)) => Ok(*v),
            Some(v) => Err(self.missing(&format!("metadata {key} is {v:?}, expected an f32"))),
            None => Err(self.missing(&format!("metadata {key} is missing"))),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.kv(key) {
            Some(Value::String(v)) => Ok(v),
            Some(_) => Err(self.missing(&format!("metadata {key} is not a string"))),
            None => Err(self.missing(&format!("metadata {key} is missing"))),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        match self.kv(key) {
            Some(Value::Array(v)) => Ok(v),
            Some(_) => Err(self.missing(&format!("metadata {key} is not an array"))),
            None => Err(self.missing(&format!("metadata {key} is missing"))),
        }
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    fn index(&self, name: &str) -> Result<usize, GgufError> {
        self.tensors
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| self.missing(&format!("no tensor {name}")))
    }

    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], GgufError> {
        let i = self.index(name)?;
        let s = self.offsets[i];
        Ok(&self.map[s..s + self.tensors[i].nbytes()])
    }

    /// The tensor's values, row after row (rows of `dims[0]`).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let i = self.index(name)?;
        let t = &self.tensors[i];
        let mut out = vec![0f32; t.elements() as usize];
        blocks::dequantize_row(t.ty, self.tensor_bytes(name)?, &mut out);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Sample = (Vec<(String, Value)>, Vec<TensorInfo>, Vec<Vec<u8>>);

    fn sample() -> Sample {
        let kv = vec![
            (
                "general.architecture".to_string(),
                Value::String("spark2_5".into()),
            ),
            ("a.u8".into(), Value::U8(7)),
            ("a.i8".into(), Value::I8(-3)),
            ("a.u16".into(), Value::U16(65535)),
            ("a.i16".into(), Value::I16(-2)),
            ("a.u32".into(), Value::U32(1 << 31)),
            ("a.i32".into(), Value::I32(-5)),
            ("a.u64".into(), Value::U64(1 << 40)),
            ("a.i64".into(), Value::I64(-(1 << 40))),
            ("a.f32".into(), Value::F32(1.5)),
            ("a.f64".into(), Value::F64(-2.25)),
            ("a.bool".into(), Value::Bool(true)),
            (
                "a.strings".into(),
                Value::Array(vec![Value::String("x y".into()), Value::String("ü".into())]),
            ),
            (
                "a.flags".into(),
                Value::Array(vec![Value::Bool(false), Value::Bool(true)]),
            ),
        ];
        let tensors = vec![
            TensorInfo {
                name: "n".into(),
                dims: vec![3],
                ty: GgmlType::F32,
            },
            TensorInfo {
                name: "q".into(),
                dims: vec![64, 2],
                ty: GgmlType::Q8_0,
            },
            TensorInfo {
                name: "k".into(),
                dims: vec![256, 1],
                ty: GgmlType::Q4_K,
            },
        ];
        let data = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (0..t.nbytes()).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        (kv, tensors, data)
    }

    #[test]
    fn a_written_file_reads_back_exactly() {
        let (kv, tensors, data) = sample();
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.gguf");
        let f = std::fs::File::create(&path).unwrap();
        let mut w = GgufWriter::new(f, &kv, &tensors, 32).unwrap();
        w.write_tensor("n", &data[0]).unwrap();
        // A tensor may come in parts.
        w.write_tensor_part("q", &data[1][..10]).unwrap();
        w.write_tensor_part("q", &data[1][10..]).unwrap();
        w.write_tensor("k", &data[2]).unwrap();
        w.finish().unwrap();
        let r = GgufFile::open(&path).unwrap();
        assert_eq!(r.metadata(), &kv[..]);
        assert_eq!(r.tensors(), &tensors[..]);
        for (t, bytes) in tensors.iter().zip(&data) {
            assert_eq!(r.tensor_bytes(&t.name).unwrap(), &bytes[..]);
        }
        assert_eq!(r.get_u32("a.u32").unwrap(), 1 << 31);
        assert!(r
            .get_u32("a.f32")
            .unwrap_err()
            .to_string()
            .contains("a.f32"));
    }

    #[test]
    fn writing_out_of_order_or_size_is_an_error() {
        let (kv, tensors, data) = sample();
        let mut w = GgufWriter::new(Vec::new(), &kv, &tensors, 32).unwrap();
        assert!(w.write_tensor("q", &data[1]).is_err(), "n comes first");
        assert!(w.write_tensor("n", &data[0][..4]).is_err(), "short");
        let mut w = GgufWriter::new(Vec::new(), &kv, &tensors, 32).unwrap();
        w.write_tensor("n", &data[0]).unwrap();
        assert!(w.write_tensor_part("q", &[0u8; 200]).is_err(), "too long");
        let w = GgufWriter::new(Vec::new(), &kv, &tensors, 32).unwrap();
        assert!(w.finish().is_err(), "nothing written");
        let bad = vec![TensorInfo {
            name: "x".into(),
            dims: vec![100],
            ty: GgmlType::Q4_K,
        }];
        assert!(
            GgufWriter::new(Vec::new(), &[], &bad, 32).is_err(),
            "not whole blocks"
        );
        let mixed = vec![(
            "m".to_string(),
            Value::Array(vec![Value::U8(1), Value::I32(2)]),
        )];
        assert!(GgufWriter::new(Vec::new(), &mixed, &[], 32).is_err());
        let twice = vec![tensors[0].clone(), tensors[0].clone()];
        assert!(
            GgufWriter::new(Vec::new(), &kv, &twice, 32).is_err(),
            "a repeated tensor"
        );
        let keys = vec![kv[1].clone(), kv[1].clone()];
        assert!(
            GgufWriter::new(Vec::new(), &keys, &tensors, 32).is_err(),
            "a repeated key"
        );
        assert!(
            GgufWriter::new(Vec::new(), &kv, &tensors, 24).is_err(),
            "alignment 24"
        );
        let a64 = vec![("general.alignment".to_string(), Value::U64(64))];
        assert!(
            GgufWriter::new(Vec::new(), &a64, &tensors, 32).is_err(),
            "u64 alignment"
        );
        let huge = vec![TensorInfo {
            name: "h".into(),
            dims: vec![1 << 62, 8],
            ty: GgmlType::F32,
        }];
        assert!(
            GgufWriter::new(Vec::new(), &[], &huge, 32).is_err(),
            "overflowing shape"
        );
        let long = vec![TensorInfo {
            name: "x".repeat(64),
            dims: vec![4],
            ty: GgmlType::F32,
        }];
        assert!(
            GgufWriter::new(Vec::new(), &[], &long, 32).is_err(),
            "a 64-byte name"
        );
    }

    #[test]
    fn damaged_files_are_errors_that_name_the_file() {
        let (kv, tensors, data) = sample();
        let mut w = GgufWriter::new(Vec::new(), &kv, &tensors, 32).unwrap();
        for (t, b) in tensors.iter().zip(&data) {
            w.write_tensor(&t.name, b).unwrap();
        }
        let good = w.finish().unwrap();
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("bad.gguf");
        let cases: Vec<(Vec<u8>, &str)> = vec![
            // The last tensor (144 bytes) is followed by 16 bytes of padding.
            (good[..good.len() - 17].to_vec(), "beyond the end"),
            (good[..40].to_vec(), "truncated"),
            ([b"GGML", &good[4..]].concat(), "magic"),
            (
                [&good[..4], &9u32.to_le_bytes(), &good[8..]].concat(),
                "version",
            ),
            (Vec::new(), "truncated"),
        ];
        for (bytes, want) in cases {
            std::fs::write(&path, &bytes).unwrap();
            let e = GgufFile::open(&path).err().expect("an error").to_string();
            assert!(e.contains("bad.gguf") && e.contains(want), "{e}");
        }
    }
}
