//! Checkpoint I/O: config.json, safetensors (single or sharded), the
//! expected tensor layout, and atomic safetensors writing.

pub mod config;
pub mod gptq;
pub mod layout;
pub mod store;
pub mod write;

use std::path::{Path, PathBuf};

pub use config::{ConfigError, LayerType, RopeSpec, SparkConfig};
pub use layout::{CheckedLayout, Proj, ProjInput, QkvLayout, TensorClass};
pub use store::{TensorEntry, TensorStore};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{0} is not a directory (expected a Hugging Face checkpoint folder with config.json and model.safetensors)")]
    NotADir(String),
    #[error("{0} does not exist (expected a Hugging Face checkpoint folder with config.json and model.safetensors)")]
    Missing(String),
    #[error("{0} is a phone export (the output of export-phone), not a Hugging Face checkpoint: give the checkpoint it was exported from (`run` and `parity` execute a phone export)")]
    PhoneExport(String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{dir} has neither model.safetensors nor model.safetensors.index.json")]
    NoWeights { dir: String },
    #[error("{path}: {message}")]
    Safetensors { path: String, message: String },
    #[error("{path}: {message}")]
    Index { path: String, message: String },
    #[error("{path}: tensor `{tensor}` holds a non-finite value ({value}) at element {index}; the checkpoint is corrupt")]
    NonFinite {
        path: String,
        tensor: String,
        index: usize,
        value: String,
    },
    #[error("checkpoint does not match its config ({} problem{}):\n  - {}", problems.len(), if problems.len() == 1 { "" } else { "s" }, problems.join("\n  - "))]
    Tensors { problems: Vec<String> },
}

/// A checkpoint folder whose config is valid and whose tensors match it.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: SparkConfig,
    pub store: TensorStore,
    pub layout: CheckedLayout,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        if !dir.exists() {
            return Err(CheckpointError::Missing(dir.display().to_string()));
        }
        if !dir.is_dir() {
            return Err(CheckpointError::NotADir(dir.display().to_string()));
        }
        if crate::artifact::is_phone_export(dir) {
            return Err(CheckpointError::PhoneExport(dir.display().to_string()));
        }
        let config = SparkConfig::from_file(&dir.join("config.json"))?;
        let store = TensorStore::open(dir)?;
        let layout = layout::check(&config, &store)
            .map_err(|problems| CheckpointError::Tensors { problems })?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            store,
            layout,
        })
    }

    /// The entry for a tensor the layout check has already proven present.
    pub fn entry(&self, name: &str) -> Result<&TensorEntry, CheckpointError> {
        self.store
            .get(name)
            .ok_or_else(|| CheckpointError::Tensors {
                problems: vec![format!("missing tensor `{name}`")],
            })
    }

    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        self.store.to_f32(self.entry(name)?)
    }

    /// The first NaN or infinity in any floating-point weight, named by tensor: read straight off
    /// the map (bit tests, no conversion), about as fast as the disk; a broken weight found later
    /// would only surface as "non-finite activations" or missing ranges, far from its cause.
    pub fn check_finite(&self) -> Result<(), CheckpointError> {
        use rayon::prelude::*;
        use safetensors::Dtype;
        let entries: Vec<_> = self.store.entries().collect();
        // In parallel, and each tensor's pages released once scanned: a streaming caller
        // (export-phone) reads each again when it needs it, so the whole checkpoint never has to
        // be resident at once.
        let first_bad = entries.par_iter().find_map_first(|e| {
            let b = self.store.bytes(e);
            let (width, bad): (usize, fn(&[u8]) -> bool) = match e.dtype {
                Dtype::BF16 => (2, |c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80),
                Dtype::F16 => (2, |c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00),
                Dtype::F32 => (4, |c| {
                    !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()
                }),
                _ => return None,
            };
            let found = b.chunks_exact(width).position(bad);
            self.store.release(e);
            found.map(|index| (*e, index, width))
        });
        if let Some((e, index, width)) = first_bad {
            let b = self.store.bytes(e);
            let c = &b[index * width..(index + 1) * width];
            let v = match e.dtype {
                Dtype::BF16 => half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
                Dtype::F16 => half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
                _ => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            };
            return Err(CheckpointError::NonFinite {
                path: self.store.file_of(e).display().to_string(),
                tensor: e.name.clone(),
                index,
                value: v.to_string(),
            });
        }
        Ok(())
    }

    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        let p = self.dir.join("tokenizer.json");
        p.exists().then_some(p)
    }

    /// Copy the checkpoint's [`SIDE_FILES`] that exist into `dir`.
    pub fn copy_side_files(&self, dir: &Path) -> Result<(), crate::artifact::ArtifactError> {
        for f in SIDE_FILES {
            let src = self.dir.join(f);
            if src.is_file() {
                std::fs::copy(&src, dir.join(f)).map_err(crate::artifact::io_err(&dir.join(f)))?;
            }
        }
        Ok(())
    }
}

/// What a runtime needs besides weights and `config.json`, carried into every artifact as is:
/// the tokenizer, its special tokens and chat template, the generation defaults.
pub const SIDE_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
