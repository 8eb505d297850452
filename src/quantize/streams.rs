//! The residual streams of every calibration token — the quantized model's `x` and, under the
//! float objectives, the float model's `x_float` — kept in a memory-mapped file of the staging
//! folder instead of private memory: the kernel writes them back and pages them as it needs, and
//! they grow with the calibration without growing the process (docs/QUANTIZE.md "Memory"). The
//! file is the resume state's own (a safetensors file of f32 tensors `x`, `x_float`), so a
//! finished layer's streams become its resume state by a rename.

use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::MmapMut;
use safetensors::Dtype;

use super::QuantizeError;
use crate::artifact::io_err as io;
use crate::checkpoint::write::{write_safetensors_streamed, TensorSpec};

/// A writable mapping of a streams file.
pub struct Streams {
    map: MmapMut,
    path: PathBuf,
    /// Byte ranges of `x` and `x_float` in the file.
    x: Range<usize>,
    x_float: Option<Range<usize>>,
}

impl Streams {
    /// Write `x` (and `x_float`) as a new streams file at `path`, and map it.
    pub fn create(path: &Path, x: &[f32], x_float: Option<&[f32]>) -> Result<Self, QuantizeError> {
        let mut streams = vec![("x", x)];
        streams.extend(x_float.map(|xf| ("x_float", xf)));
        let specs = streams
            .iter()
            .map(|(name, v)| TensorSpec {
                name: name.to_string(),
                dtype: Dtype::F32,
                shape: vec![v.len()],
            })
            .collect();
        write_safetensors_streamed(path, specs, None, |spec, w| {
            let (_, v) = streams
                .iter()
                .find(|(name, _)| *name == spec.name)
                .expect("a spec per stream");
            // In 1 MiB pieces: no second whole copy in bytes.
            for piece in v.chunks(1 << 18) {
                let bytes: Vec<u8> = piece.iter().flat_map(|v| v.to_le_bytes()).collect();
                w.write_all(&bytes).map_err(io(path))?;
            }
            Ok::<(), QuantizeError>(())
        })?;
        Self::open(path)
    }

    /// A writable copy of these streams at `path`, written from the mapping itself (so it holds
    /// what was written through it on any filesystem, flushed or not), a piece at a time through
    /// the page cache rather than a private copy.
    pub fn copy_to(&self, path: &Path) -> Result<Self, QuantizeError> {
        use std::io::Write;
        let mut f = std::fs::File::create(path).map_err(io(path))?;
        for piece in self.map.chunks(1 << 24) {
            f.write_all(piece).map_err(io(path))?;
        }
        drop(f);
        Self::open(path)
    }

    /// Map the streams file at `path` (checking its tensors).
    pub fn open(path: &Path) -> Result<Self, QuantizeError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io(path))?;
        // SAFETY: the file is ours, in the staging folder, and only this mapping writes it
        // while it is mapped.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(io(path))?;
        let bad = |what: String| QuantizeError::Invalid(format!("{}: {what}", path.display()));
        let (header, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| bad(format!("not a streams file: {e}")))?;
        let range = |name: &str| -> Result<Option<Range<usize>>, QuantizeError> {
            let Some(t) = meta.info(name) else {
                return Ok(None);
            };
            let (a, b) = t.data_offsets;
            let start = 8 + header + a;
            if t.dtype != Dtype::F32 || !start.is_multiple_of(4) || b < a {
                return Err(bad(format!("tensor `{name}` is not an aligned f32 stream")));
            }
            Ok(Some(start..8 + header + b))
        };
        let x = range("x")?.ok_or_else(|| bad("no tensor `x`".into()))?;
        let x_float = range("x_float")?;
        if x_float.as_ref().is_some_and(|f| f.len() != x.len()) {
            return Err(bad("`x` and `x_float` differ in length".into()));
        }
        Ok(Streams {
            map,
            path: path.to_path_buf(),
            x,
            x_float,
        })
    }

    /// The file as mapped (a save may since have renamed it).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn has_float(&self) -> bool {
        self.x_float.is_some()
    }

    fn floats(&self, r: &Range<usize>) -> &[f32] {
        let bytes = &self.map[r.clone()];
        // SAFETY: `open` checked that the range is 4-aligned in a page-aligned map and whole
        // f32s long; every bit pattern is an f32 (the file is little-endian, as every target).
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / 4) }
    }

    pub fn x(&self) -> &[f32] {
        self.floats(&self.x)
    }

    pub fn x_float(&self) -> Option<&[f32]> {
        self.x_float.as_ref().map(|r| self.floats(r))
    }

    /// Both streams, writable.
    pub fn split_mut(&mut self) -> (&mut [f32], Option<&mut [f32]>) {
        let (x, xf) = (self.x.clone(), self.x_float.clone());
        // `x` precedes `x_float` or follows it; either way they do not overlap.
        let base = self.map.as_mut_ptr();
        let floats = |r: Range<usize>| {
            // SAFETY: as in `floats`; the two ranges are disjoint tensors of one file, and both
            // borrows are tied to `&mut self`.
            unsafe { std::slice::from_raw_parts_mut(base.add(r.start).cast::<f32>(), r.len() / 4) }
        };
        (floats(x), xf.map(floats))
    }

    /// Write the mapping back to the file and unmap it; returns the file's path.
    pub fn close(self) -> Result<PathBuf, QuantizeError> {
        self.map.flush().map_err(io(&self.path))?;
        Ok(self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_round_trip_through_the_file_and_its_copy() {
        let d = tempfile::tempdir().unwrap();
        let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let xf: Vec<f32> = x.iter().map(|v| -v).collect();
        let mut s = Streams::create(&d.path().join("a"), &x, Some(&xf)).unwrap();
        assert_eq!((s.x(), s.x_float()), (&x[..], Some(&xf[..])));
        let (a, b) = s.split_mut();
        a[3] = 42.0;
        b.unwrap()[999] = -1.0;
        let mut c = s.copy_to(&d.path().join("b")).unwrap();
        let path = s.close().unwrap();
        assert_eq!((c.x()[3], c.x_float().unwrap()[999]), (42.0, -1.0));
        c.split_mut().0[0] = 9.0;
        drop(c);
        // The copy is its own file: the original is unchanged.
        let s = Streams::open(&path).unwrap();
        assert_eq!(s.x()[0], x[0]);
        // A resume state of the quantized stream alone.
        let q = Streams::create(&d.path().join("q"), &x, None).unwrap();
        assert!(!q.has_float() && q.x_float().is_none());
        assert!(Streams::open(&d.path().join("missing")).is_err());
    }
}
