//! Calibration text → fixed-length token windows.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::tokenizer::SparkTokenizer;

#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    #[error("cannot read calibration file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} line {line}: expected a JSON object with a string field \"text\" ({message})")]
    Jsonl {
        path: String,
        line: usize,
        message: String,
    },
    #[error("calibration input is empty ({0})")]
    Empty(String),
    #[error("calibration text has {have} tokens but {samples} samples × {seq_len} tokens = {need} are needed; pass fewer {s}, a shorter {l}, or more text", s = crate::setting::Setting::Samples, l = crate::setting::Setting::SeqLen)]
    TooShort {
        have: usize,
        need: usize,
        samples: usize,
        seq_len: usize,
    },
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}

/// The bundled calibration set (never the held-out parity set).
pub fn bundled() -> PathBuf {
    crate::bundled::path("spark-calib.jsonl")
}

/// Documents of a `.jsonl` (`{"text": …}` per line) or plain-text file.
pub fn read_documents(path: &Path) -> Result<Vec<String>, CalibrationError> {
    let p = path.display().to_string();
    let text = crate::bundled::read_to_string(path).map_err(|source| CalibrationError::Io {
        path: p.clone(),
        source,
    })?;
    if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
        return Ok(vec![text]);
    }
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| CalibrationError::Jsonl {
                path: p.clone(),
                line: i + 1,
                message: e.to_string(),
            })?;
        let t = v
            .get("text")
            .and_then(|t| t.as_str())
            .ok_or_else(|| CalibrationError::Jsonl {
                path: p.clone(),
                line: i + 1,
                message: "no string field \"text\"".into(),
            })?;
        docs.push(t.to_string());
    }
    Ok(docs)
}

/// `samples` windows of `seq_len` tokens, cut in order from the concatenated documents.
pub struct Windows {
    pub samples: usize,
    pub seq_len: usize,
    pub tokens: Vec<u32>,
    /// sha256 over the files' bytes, for provenance and resume checks.
    pub sha256: String,
}

impl Windows {
    pub fn sample(&self, s: usize) -> &[u32] {
        &self.tokens[s * self.seq_len..(s + 1) * self.seq_len]
    }
}

pub fn build(
    files: &[PathBuf],
    tok: &SparkTokenizer,
    samples: usize,
    seq_len: usize,
) -> Result<Windows, CalibrationError> {
    let mut hasher = Sha256::new();
    let mut stream = Vec::new();
    let need = samples * seq_len;
    for f in files {
        let bytes = crate::bundled::read(f).map_err(|source| CalibrationError::Io {
            path: f.display().to_string(),
            source,
        })?;
        hasher.update(&bytes);
        for doc in read_documents(f)? {
            if stream.len() >= need {
                break;
            }
            stream.extend(tok.encode(&doc)?);
        }
    }
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    if stream.is_empty() {
        return Err(CalibrationError::Empty(names.join(", ")));
    }
    if need == 0 || stream.len() < need {
        return Err(CalibrationError::TooShort {
            have: stream.len(),
            need,
            samples,
            seq_len,
        });
    }
    stream.truncate(need);
    Ok(Windows {
        samples,
        seq_len,
        tokens: stream,
        sha256: format!("{:x}", hasher.finalize()),
    })
}
