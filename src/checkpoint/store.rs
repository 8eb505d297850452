//! Memory-mapped safetensors, single file or sharded with `model.safetensors.index.json`.
//!
//! Headers are parsed and validated once at open (the `safetensors` crate
//! checks offsets and that the file is exactly as long as the header says,
//! so a truncated file is an error here, not a panic later); tensor bytes
//! stay in the mmap until a caller converts them.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::CheckpointError;

/// Where one tensor lives: file index and absolute byte range in that file.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    pub file: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

impl TensorEntry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// u16 values held in a read-only file map (see [`TensorStore::u16_view`]).
#[derive(Clone)]
pub struct U16View {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
}

impl std::ops::Deref for U16View {
    type Target = [u16];
    fn deref(&self) -> &[u16] {
        // SAFETY: `u16_view` checked alignment, bounds and endianness; the map
        // is read-only and lives as long as this view's Arc.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.start).cast(), self.len) }
    }
}

pub struct TensorStore {
    files: Vec<(PathBuf, Arc<Mmap>)>,
    tensors: BTreeMap<String, TensorEntry>,
}

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl TensorStore {
    /// Open `dir/model.safetensors`, or the shards listed by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let index = dir.join(INDEX);
        let single = dir.join(SINGLE);
        if index.exists() {
            Self::open_index(dir, &index)
        } else if single.exists() {
            Self::open_files(&[single])
        } else {
            Err(CheckpointError::NoWeights {
                dir: dir.display().to_string(),
            })
        }
    }

    /// Open one safetensors file on its own (no config, no index).
    pub fn open_file(path: &Path) -> Result<Self, CheckpointError> {
        Self::open_files(&[path.to_path_buf()])
    }

    fn open_index(dir: &Path, index: &Path) -> Result<Self, CheckpointError> {
        let bad = |message: String| CheckpointError::Index {
            path: index.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(index).map_err(io_err(index))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("missing object `weight_map`".into()))?;
        let mut shard_names: Vec<String> = Vec::new();
        let mut wanted: HashMap<String, String> = HashMap::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map[\"{tensor}\"] is not a file name")))?;
            if file.contains('/') || file.contains("..") {
                return Err(bad(format!(
                    "weight_map[\"{tensor}\"] = \"{file}\" must be a file name inside the checkpoint folder"
                )));
            }
            if !shard_names.iter().any(|s| s == file) {
                shard_names.push(file.to_string());
            }
            wanted.insert(tensor.clone(), file.to_string());
        }
        shard_names.sort();
        let paths: Vec<PathBuf> = shard_names.iter().map(|s| dir.join(s)).collect();
        for p in &paths {
            if !p.exists() {
                return Err(bad(format!(
                    "lists shard {} which does not exist",
                    p.display()
                )));
            }
        }
        let store = Self::open_files(&paths)?;
        for (tensor, file) in &wanted {
            match store.tensors.get(tensor) {
                None => {
                    return Err(bad(format!(
                        "says tensor `{tensor}` is in {file}, but no shard contains it"
                    )))
                }
                Some(e)
                    if store.files[e.file].0.file_name().and_then(|f| f.to_str()) != Some(file) =>
                {
                    return Err(bad(format!(
                        "says tensor `{tensor}` is in {file}, but it was found in {}",
                        store.files[e.file].0.display()
                    )))
                }
                _ => {}
            }
        }
        Ok(store)
    }

    fn open_files(paths: &[PathBuf]) -> Result<Self, CheckpointError> {
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors = BTreeMap::new();
        for (fi, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(io_err(path))?;
            // SAFETY: the map is read-only; as with every mmap-based loader, another
            // process truncating the file while we run is outside what we can defend.
            let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
            let bad = |message| CheckpointError::Safetensors {
                path: path.display().to_string(),
                message,
            };
            // Our own pass first: the crate reports a bad data_offsets entry at whichever
            // tensor its sorted walk notices the gap, often an innocent neighbour.
            check_offsets(&mmap).map_err(bad)?;
            let parsed = SafeTensors::deserialize(&mmap)
                .map_err(|e| bad(describe_safetensors_error(&e, mmap.len())))?;
            let base = mmap.as_ptr() as usize;
            for (name, view) in parsed.iter() {
                let start = view.data().as_ptr() as usize - base;
                let entry = TensorEntry {
                    name: name.to_string(),
                    file: fi,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    start,
                    end: start + view.data().len(),
                };
                if let Some(prev) = tensors.insert(name.to_string(), entry) {
                    return Err(CheckpointError::Safetensors {
                        path: path.display().to_string(),
                        message: format!(
                            "tensor `{name}` also appears in {}",
                            paths[prev.file].display()
                        ),
                    });
                }
            }
            files.push((path.clone(), Arc::new(mmap)));
        }
        Ok(TensorStore { files, tensors })
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    pub fn entries(&self) -> impl Iterator<Item = &TensorEntry> {
        self.tensors.values()
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    pub fn file_of(&self, e: &TensorEntry) -> &Path {
        &self.files[e.file].0
    }

    pub fn bytes(&self, e: &TensorEntry) -> &[u8] {
        &self.files[e.file].1[e.start..e.end]
    }

    /// Hands this process's resident pages of rows `r0..r1` of `e` back to the kernel: a
    /// streaming reader (export-phone) that is done with them keeps its resident set at what it
    /// holds itself instead of the whole mapped checkpoint. Best effort: the pages stay in the
    /// page cache, a later read faults them back in, and a failure changes nothing.
    pub fn release_rows(&self, e: &TensorEntry, r0: usize, r1: usize) {
        let row: usize = e.shape[1..].iter().product::<usize>() * (e.dtype.bitsize() / 8);
        self.release_bytes(e.file, e.start + r0 * row, e.start + r1 * row);
    }

    /// [`Self::release_rows`] of the whole tensor.
    pub fn release(&self, e: &TensorEntry) {
        self.release_bytes(e.file, e.start, e.end);
    }

    fn release_bytes(&self, file: usize, start: usize, end: usize) {
        let page = page_size();
        // Whole pages inside the range only: a page shared with a neighbour may still be in use.
        let a = start.next_multiple_of(page);
        let b = end / page * page;
        if b > a {
            // SAFETY: the map is a read-only shared file mapping (`Mmap::map`): dropping its
            // pages loses nothing, since every later access reads the same bytes from the file.
            let _ = unsafe {
                self.files[file].1.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    a,
                    b - a,
                )
            };
        }
    }

    /// Bytes `range` of tensor `e` as u16 values read in place from the map
    /// (no copy, so loading a bf16 embedding costs nothing); `None` when the
    /// data is not 2-byte aligned or the host is big-endian.
    pub fn u16_view(&self, e: &TensorEntry, range: std::ops::Range<usize>) -> Option<U16View> {
        let map = &self.files[e.file].1;
        let start = e.start + range.start;
        let len = range.len() / 2;
        let aligned =
            (map.as_ptr() as usize + start).is_multiple_of(2) && range.len().is_multiple_of(2);
        (cfg!(target_endian = "little") && aligned && range.end <= e.end - e.start).then(|| {
            U16View {
                map: Arc::clone(map),
                start,
                len,
            }
        })
    }

    /// Convert a bf16/f16/f32 tensor to f32 (little-endian on disk; no alignment assumed).
    pub fn to_f32(&self, e: &TensorEntry) -> Result<Vec<f32>, CheckpointError> {
        let bytes = self.bytes(e);
        let mut out = vec![0f32; e.numel()];
        match e.dtype {
            Dtype::BF16 => crate::kernels::convert::bf16_bytes_to_f32(bytes, &mut out),
            Dtype::F16 => crate::kernels::convert::f16_bytes_to_f32(bytes, &mut out),
            Dtype::F32 => crate::kernels::convert::f32_bytes_to_f32(bytes, &mut out),
            other => {
                return Err(CheckpointError::Tensors {
                    problems: vec![format!(
                    "`{}` in {}: dtype {other:?} is not a float dtype (expected BF16, F16 or F32)",
                    e.name,
                    self.file_of(e).display()
                )],
                })
            }
        }
        Ok(out)
    }

    /// Like [`to_f32`](Self::to_f32) for rows `[r0, r1)` of a 2-D tensor.
    pub fn rows_to_f32(
        &self,
        e: &TensorEntry,
        r0: usize,
        r1: usize,
    ) -> Result<Vec<f32>, CheckpointError> {
        let cols: usize = e.shape[1..].iter().product();
        let esz = e.dtype.bitsize() / 8;
        let sub = TensorEntry {
            name: e.name.clone(),
            file: e.file,
            dtype: e.dtype,
            shape: vec![r1 - r0, cols],
            start: e.start + r0 * cols * esz,
            end: e.start + r1 * cols * esz,
        };
        self.to_f32(&sub)
    }
}

/// Each tensor's `data_offsets` against its own dtype and shape, then the set against the data
/// section (no overlap, no gap, nothing past the end): errors name the tensor at fault. A header
/// that does not parse is left to the crate's own message.
fn check_offsets(bytes: &[u8]) -> Result<(), String> {
    let Some(n) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    else {
        return Ok(());
    };
    let Some(header) = usize::try_from(n)
        .ok()
        .and_then(|n| bytes.get(8..8usize.checked_add(n)?))
    else {
        return Ok(());
    };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(header)
    else {
        return Ok(());
    };
    let data_len = (bytes.len() - 8 - header.len()) as u128;
    let mut spans = Vec::new();
    for (name, v) in &map {
        if name == "__metadata__" {
            continue;
        }
        let what = |m: String| format!("tensor `{name}`: {m}");
        let offs = v.get("data_offsets").and_then(|o| o.as_array());
        let Some([a, b]) = offs.map(|o| o.as_slice()) else {
            return Err(what("data_offsets must be [start, end]".into()));
        };
        let (Some(a), Some(b)) = (a.as_u64(), b.as_u64()) else {
            return Err(what(format!(
                "data_offsets must be two byte offsets >= 0, found [{a}, {b}]"
            )));
        };
        if a > b {
            return Err(what(format!(
                "data_offsets [{a}, {b}] end before they start"
            )));
        }
        if b as u128 > data_len {
            return Err(what(format!(
                "data_offsets [{a}, {b}] run past the end of the data, which is {data_len} bytes \
                 (expected an end <= {data_len}; truncated file?)"
            )));
        }
        let width = match v.get("dtype").and_then(|d| d.as_str()) {
            Some("BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2") => Some(1u128),
            Some("BF16" | "F16" | "I16" | "U16") => Some(2),
            Some("F32" | "I32" | "U32") => Some(4),
            Some("F64" | "I64" | "U64") => Some(8),
            _ => None,
        };
        let numel = v.get("shape").and_then(|s| s.as_array()).and_then(|s| {
            s.iter()
                .try_fold(1u128, |acc, d| acc.checked_mul(d.as_u64()? as u128))
        });
        if let (Some(w), Some(numel)) = (width, numel) {
            let want = numel.saturating_mul(w);
            if want != (b - a) as u128 {
                return Err(what(format!(
                    "data_offsets [{a}, {b}] span {} bytes but its dtype and shape need {want}",
                    b - a
                )));
            }
        }
        spans.push((a, b, name.as_str()));
    }
    spans.sort();
    let mut prev: Option<(u64, &str)> = None;
    for &(start, end, name) in &spans {
        match prev {
            Some((e, p)) if start < e => {
                return Err(format!(
                    "tensors `{p}` and `{name}` overlap (data_offsets)"
                ))
            }
            Some((e, p)) if start > e => {
                return Err(format!(
                    "tensor `{name}` starts at byte {start} of the data but `{p}` ends at {e}: data_offsets leave a gap"
                ))
            }
            None if start > 0 => {
                return Err(format!(
                    "tensor `{name}` starts at byte {start} of the data; the first tensor must start at 0"
                ))
            }
            _ => {}
        }
        prev = Some((end, name));
    }
    Ok(())
}

fn describe_safetensors_error(e: &safetensors::SafeTensorError, len: usize) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::MetadataIncompleteBuffer => format!(
            "file is {len} bytes, which does not match the sizes its header declares (truncated or corrupt download?)"
        ),
        E::HeaderTooSmall | E::InvalidHeaderLength => format!(
            "file is {len} bytes and too short for the header it declares (truncated or not a safetensors file)"
        ),
        other => format!("not a valid safetensors file: {other}"),
    }
}

fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => 4096,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file holding `[1, 2, 3]` as bf16 bits, its data starting
    /// at an even or odd byte (the header may have any length).
    fn file_with_offset(dir: &Path, odd: bool) -> PathBuf {
        let mut header = r#"{"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]}}"#.to_string();
        if (8 + header.len()) % 2 != usize::from(odd) {
            header.push(' ');
        }
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        for v in [1u16, 2, 3] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        let path = dir.join(if odd {
            "odd.safetensors"
        } else {
            "even.safetensors"
        });
        std::fs::write(&path, bytes).expect("write test file");
        path
    }

    #[test]
    fn u16_views_read_in_place_only_when_aligned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let even = TensorStore::open_file(&file_with_offset(dir.path(), false)).expect("open");
        let e = even.get("w").expect("w");
        let view = even
            .u16_view(e, 0..6)
            .expect("aligned data is viewed in place");
        assert_eq!(&*view, &[1, 2, 3]);
        assert_eq!(&*even.u16_view(e, 2..6).expect("rows 1..3"), &[2, 3]);
        assert!(even.u16_view(e, 0..8).is_none(), "past the tensor");

        let odd = TensorStore::open_file(&file_with_offset(dir.path(), true)).expect("open");
        assert!(odd.u16_view(odd.get("w").expect("w"), 0..6).is_none());
    }
}
