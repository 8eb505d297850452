//! Opening an artifact for `run`, `parity` and `bench`, whatever it is: an original or GPTQ
//! checkpoint, a GGUF file or a phone export. The one module that knows every kind (`engine`
//! only defines what they share).

use crate::engine::Engine as _;
use crate::model::{ModelError, SparkModel};

/// An artifact opened for `run`/`parity`: the engine, where its tokenizer is, and its size.
pub struct Opened {
    pub engine: Box<dyn crate::engine::Engine>,
    pub tokenizer: Option<std::path::PathBuf>,
    /// Bits per weight over everything the artifact ships.
    pub bpw: f64,
    /// The coarsest store among its weights.
    pub class: WeightClass,
    pub warnings: Vec<String>,
}

/// How coarsely an artifact stores its weights: its coarsest weight tensor's store. Parity's
/// built-in policy is chosen by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WeightClass {
    /// 4-bit or coarser (GPTQ 4-bit, GGUF Q4_*, phone w4a16).
    Int4,
    /// 5 to 8 bits (GGUF Q8_0 / Q6_K, phone w8a16).
    Int8,
    /// Floating point throughout (f32, bf16, f16).
    Float,
}

impl WeightClass {
    pub fn name(self) -> &'static str {
        match self {
            WeightClass::Int4 => "4-bit",
            WeightClass::Int8 => "8-bit",
            WeightClass::Float => "float",
        }
    }

    fn of_ggml(t: crate::formats::gguf::GgmlType) -> Self {
        use crate::formats::gguf::GgmlType as G;
        match t {
            // The 5-bit types have no class of their own: gated with the 4-bit ones, whose
            // limits a 5-bit file meets with room to spare (a broken one still fails them).
            G::Q4_0 | G::Q4_1 | G::Q4_K | G::Q5_0 | G::Q5_K => WeightClass::Int4,
            G::Q8_0 | G::Q6_K => WeightClass::Int8,
            G::F32 | G::F16 | G::BF16 => WeightClass::Float,
        }
    }

    /// A phone export's class from its manifest's precision.
    fn of_phone(precision: &str) -> Self {
        match precision {
            "w4a16" => WeightClass::Int4,
            "w8a16" => WeightClass::Int8,
            _ => WeightClass::Float,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("opening {dir}")]
    Checkpoint {
        dir: String,
        #[source]
        source: crate::checkpoint::CheckpointError,
    },
    #[error("opening phone export {dir}")]
    Phone {
        dir: String,
        #[source]
        source: crate::phone::PhoneError,
    },
    #[error("opening GGUF file {path}")]
    Gguf {
        path: String,
        #[source]
        source: crate::formats::gguf::GgufError,
    },
    #[error("{tokenizer} cannot tokenize text for GGUF file {gguf}: {why}")]
    GgufTokenizer {
        tokenizer: String,
        gguf: String,
        why: String,
    },
    #[error("listing {dir}")]
    Io {
        dir: String,
        #[source]
        source: std::io::Error,
    },
}

/// How a GGUF file's activations are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufNumerics {
    /// As llama.cpp's CPU backend: each linear's input converted to its weight type's
    /// `vec_dot_type` (8-bit blocks for the quantized types), so figures predict llama.cpp's.
    Ggml,
    /// f32 activations: the weights' own error alone.
    F32,
}

/// Open an original or GPTQ checkpoint (executed with `options(&checkpoint)`), a GGUF file (with
/// `numerics`) or an exported phone graph (on `threads` ONNX Runtime threads).
pub fn open(
    dir: &std::path::Path,
    options: impl FnOnce(&crate::checkpoint::Checkpoint) -> crate::model::LoadOptions,
    numerics: GgufNumerics,
    threads: usize,
) -> Result<Opened, OpenError> {
    use crate::phone::{self, PhoneModel};
    let name = || dir.display().to_string();
    if dir.is_file() && is_gguf(dir) {
        use crate::formats::gguf::GgufFile;
        let gguf = |source| OpenError::Gguf {
            path: name(),
            source,
        };
        let f = GgufFile::open(dir).map_err(gguf)?;
        let ggml = numerics == GgufNumerics::Ggml;
        let model = SparkModel::from_gguf(&f, ggml, false).map_err(gguf)?;
        let bytes: u64 = f.tensors().iter().map(|t| t.nbytes() as u64).sum();
        let params = crate::inspect::parameters(model.config()) as f64;
        let mut warnings = if ggml {
            Vec::new()
        } else {
            vec![
                "GGUF runs with f32 activations (llama.cpp's CPU kernels quantize activations to 8 \
                 bits for its quantized types; drop --act-dtype f32 to match them)"
                    .into(),
            ]
        };
        // A GGUF carries its vocabulary, not a tokenizer.json: one beside the file serves when it
        // maps text to the file's ids (parity tokenizes with the reference's either way).
        let beside = crate::artifact::folder_of(dir);
        let tokenizer = match Some(beside).filter(|d| d.join("tokenizer.json").is_file()) {
            Some(d) => match gguf_tokenizer(dir, &f, model.config().vocab_size, d) {
                Ok(p) => Some(p),
                Err(e) => {
                    warnings.push(format!("{e}; it is not used"));
                    None
                }
            },
            None => None,
        };
        let class = f
            .tensors()
            .iter()
            .filter(|t| t.dims.len() == 2)
            .map(|t| WeightClass::of_ggml(t.ty))
            .min()
            .unwrap_or(WeightClass::Float);
        return Ok(Opened {
            bpw: bytes as f64 * 8.0 / params,
            class,
            tokenizer,
            engine: Box::new(model),
            warnings,
        });
    }
    if phone::is_phone_export(dir) {
        let m = PhoneModel::open(dir, threads).map_err(|source| OpenError::Phone {
            dir: name(),
            source,
        })?;
        let tok = dir.join("tokenizer.json");
        let io = |source| OpenError::Io {
            dir: name(),
            source,
        };
        let mut bytes = 0u64;
        for e in std::fs::read_dir(dir).map_err(io)? {
            let e = e.map_err(io)?;
            let n = e.file_name().to_string_lossy().to_string();
            if n.ends_with(".onnx") || n.ends_with(".onnx.data") || n == m.manifest.embedding.file {
                bytes += e.metadata().map_err(io)?.len();
            }
        }
        let params = crate::inspect::parameters(m.config()) as f64;
        return Ok(Opened {
            bpw: bytes as f64 * 8.0 / params,
            class: WeightClass::of_phone(&m.manifest.precision),
            tokenizer: tok.is_file().then_some(tok),
            engine: Box::new(m),
            warnings: Vec::new(),
        });
    }
    let checkpoint = |source| OpenError::Checkpoint {
        dir: name(),
        source,
    };
    let ck = crate::checkpoint::Checkpoint::open(dir).map_err(checkpoint)?;
    let r = crate::inspect::inspect(&ck, 1);
    let model = SparkModel::load(&ck, options(&ck)).map_err(checkpoint)?;
    // spark-tool reads 4-bit GPTQ only (the loader refuses other bit widths).
    let class = match ck.config.gptq {
        Some(_) => WeightClass::Int4,
        None => WeightClass::Float,
    };
    Ok(Opened {
        class,
        engine: Box::new(model),
        tokenizer: ck.tokenizer_path(),
        bpw: r.bytes as f64 * 8.0 / r.parameters.max(1) as f64,
        warnings: ck.layout.warnings.clone(),
    })
}

/// `tok`'s tokenizer.json (`tok` a folder holding one, or the file itself) for the GGUF file at
/// `path` (opened as `f`, `vocab_size` ids): only a tokenizer whose vocabulary, types and merges
/// are the file's maps text to the ids the file was made for.
pub fn gguf_tokenizer(
    path: &std::path::Path,
    f: &crate::formats::gguf::GgufFile,
    vocab_size: usize,
    tok: &std::path::Path,
) -> Result<std::path::PathBuf, OpenError> {
    let refuse = |why: String| OpenError::GgufTokenizer {
        tokenizer: tok.display().to_string(),
        gguf: path.display().to_string(),
        why,
    };
    let dir = if tok.is_dir() {
        tok
    } else if tok.file_name() == Some(std::ffi::OsStr::new("tokenizer.json")) && tok.is_file() {
        crate::artifact::folder_of(tok)
    } else {
        return Err(refuse(
            "expected a folder holding tokenizer.json, or a file named tokenizer.json".into(),
        ));
    };
    let file = dir.join("tokenizer.json");
    if !file.is_file() {
        return Err(refuse(format!("{} does not exist", file.display())));
    }
    match crate::formats::gguf::spark::vocabulary_difference(f, dir, vocab_size) {
        Ok(None) => Ok(file),
        Ok(Some(why)) => Err(refuse(why)),
        Err(e) => Err(refuse(e.to_string())),
    }
}

/// Where `e`, a [`ModelError::NonFinite`] of the checkpoint folder `dir`, comes from: its first
/// non-finite weight, named (a scan of every tensor, made only once the logits have shown one).
pub fn non_finite_weight(
    e: &ModelError,
    dir: &std::path::Path,
) -> Option<crate::checkpoint::CheckpointError> {
    match e {
        ModelError::NonFinite { .. } if dir.is_dir() && !crate::phone::is_phone_export(dir) => {
            crate::checkpoint::Checkpoint::open(dir)
                .and_then(|ck| ck.check_finite())
                .err()
        }
        _ => None,
    }
}

/// Whether `path` starts with the GGUF magic.
pub fn is_gguf(path: &std::path::Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}
