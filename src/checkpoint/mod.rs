//! Checkpoint I/O: config.json, safetensors (single or sharded), the
//! expected tensor layout, and atomic safetensors writing.

pub mod config;
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
        if !dir.is_dir() {
            return Err(CheckpointError::NotADir(dir.display().to_string()));
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

    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        let p = self.dir.join("tokenizer.json");
        p.exists().then_some(p)
    }
}
