//! The recipe: every choice that decides the bytes of a quantize output, in one serialisable
//! struct, validated once. The CLI builds it from its flags (or a recipe file and `--set`
//! assignments), `export-phone`'s own solve and the tests build it in code; every output records
//! it (`recipe.toml` beside a GPTQ checkpoint, `spark_tool.recipe` in a GGUF, `recipe` in the
//! report), the resume fingerprint is the hash of its canonical form, and `quantize --recipe` of
//! an output's recipe reproduces that output byte for byte.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::lab::{self, Lab};
use super::{ForwardPrecision, Method, Objective};
use crate::checkpoint::{Proj, QkvLayout, SparkConfig};
use crate::device::WeightFormat;
use crate::formats::gguf::mix::{FileType, Tensor as GgufTensor};
use crate::formats::gguf::GgmlType;
use crate::quant::{Grid, Order, ScaleRule};

/// The file name of the recipe beside a quantized checkpoint.
pub const FILE_NAME: &str = "recipe.toml";
/// The GGUF metadata key that holds the recipe (TOML text).
pub const GGUF_KEY: &str = "spark_tool.recipe";

/// Every choice that decides the bytes of a quantize output. A recipe file may give any subset
/// of the keys; the rest take these defaults (the CLI lets the device probe pick `format`,
/// `group_size` and `lpbq` when the file does not).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Recipe {
    /// The GPTQ checkpoint's activation numerics: w4a8 (int8 activations, AMX) or w4a16.
    pub format: WeightFormat,
    /// Weights per group scale of a GPTQ checkpoint: 32, 64 or 128 (GGUF block types fix their own).
    pub group_size: usize,
    /// Write one GGUF file of this type instead of a GPTQ checkpoint.
    pub gguf: Option<FileType>,
    /// Scales on QNN's LPBQ lattice (γ per output channel × k ∈ 1…16 per group), so the phone
    /// export writes the checkpoint's own codes.
    pub lpbq: bool,
    /// The quantizer: gptq-search (the default), or the baselines gptq and rtn.
    pub method: Method,
    /// The order GPTQ visits each linear's inputs in (the stored layout is the natural one).
    pub order: Order,
    /// Let the scale search take negative group scales where the lattice allows them.
    pub signed_scales: bool,
    /// What each layer's linears are solved to reproduce.
    pub objective: Objective,
    /// What the calibration forward feeds the linears (bf16 as vLLM does, f32 as llama.cpp).
    pub forward_precision: ForwardPrecision,
    /// Calibration text files (`bundled:NAME` for the sets compiled into the binary).
    pub calibration: Vec<PathBuf>,
    /// Calibration windows.
    pub samples: usize,
    /// Tokens per calibration window.
    pub seq_len: usize,
    pub qkv_layout: QkvLayout,
    /// Untie the head and solve it to 4 bits too (always for GGUF, whose type rule covers it).
    pub quantize_head: bool,
    /// Initial GPTQ damping (fraction of the mean Hessian diagonal; raised if Cholesky fails).
    pub damp: f64,
    /// GGUF only: `REGEX=TYPE` overrides of the file type's rule, as llama-quantize's
    /// `--tensor-type` takes them: the first pattern found in a tensor's GGUF name gives its type.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tensor_types: Vec<String>,
    /// Research options (docs/QUANTIZE.md "The lab"); a default build refuses them.
    #[serde(skip_serializing_if = "Lab::is_off")]
    pub lab: Lab,
}

impl Default for Recipe {
    fn default() -> Self {
        Recipe {
            format: WeightFormat::W4A16,
            group_size: 128,
            gguf: None,
            lpbq: false,
            method: Method::GptqSearch,
            order: Order::ActStatic,
            signed_scales: true,
            objective: Objective::FloatStream,
            forward_precision: ForwardPrecision::Bf16,
            calibration: vec![crate::calibration::bundled()],
            samples: 128,
            seq_len: 512,
            qkv_layout: QkvLayout::Fused,
            quantize_head: false,
            damp: 0.01,
            tensor_types: Vec::new(),
            lab: Lab::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin}: not a recipe: {message}")]
    Parse { origin: String, message: String },
    #[error("--set {assignment}: {message}")]
    Set { assignment: String, message: String },
    #[error("recipe: {0}")]
    Invalid(String),
}

impl Recipe {
    /// A recipe from its TOML text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, RecipeError> {
        from_table(parse(text, origin)?, origin)
    }

    /// The recipe as the TOML file written beside an output.
    pub fn to_toml(&self) -> String {
        let body = toml::to_string(self).expect("every recipe field has a TOML form");
        format!(
            "# spark-tool {} quantize recipe: `spark-tool quantize MODEL --recipe THIS_FILE --out DIR`\n\
             # reproduces the output it was written with (docs/QUANTIZE.md \"Recipes\").\n{body}",
            env!("CARGO_PKG_VERSION")
        )
    }

    /// The hash a resumable run is keyed by, with the calibration's content hash beside it
    /// (so the calibration's file names are left out: a moved file still resumes). Model tuning
    /// runs after every layer is staged and restages its own result, so its settings are left
    /// out too: changing only them resumes.
    pub fn fingerprint(&self) -> String {
        let mut canonical = self.clone();
        canonical.calibration.clear();
        canonical.lab.model_tune = None;
        let json = serde_json::to_string(&canonical).expect("a recipe serialises");
        format!("{:x}", Sha256::digest(json.as_bytes()))
    }

    /// Refuse what no run can succeed with, before anything is read.
    pub fn validate(&self) -> Result<(), RecipeError> {
        let bad = |m: String| Err(RecipeError::Invalid(m));
        // The damping is raised ×10 per failed Cholesky: from 0, NaN or a negative value it never
        // becomes usable, only retried.
        if !(self.damp.is_finite() && self.damp > 0.0 && self.damp <= 1.0) {
            return bad(format!(
                "damp = {} must be a number in (0, 1] (a fraction of the mean Hessian diagonal)",
                self.damp
            ));
        }
        for (key, v) in [("samples", self.samples), ("seq_len", self.seq_len)] {
            if v == 0 {
                return bad(format!("{key} must be at least 1, got 0"));
            }
        }
        if self.gguf.is_none() && ![32, 64, 128].contains(&self.group_size) {
            return bad(format!(
                "group_size = {}: vLLM's GPTQ loader accepts 32, 64 or 128",
                self.group_size
            ));
        }
        if self.calibration.is_empty() {
            return bad("calibration names no file".into());
        }
        if self.gguf.is_some() && self.lpbq {
            return bad("lpbq (the phone's scale lattice) does not apply to GGUF".into());
        }
        if !self.tensor_types.is_empty() && self.gguf.is_none() {
            return bad("tensor_types (--tensor-type) applies to GGUF files only".into());
        }
        for t in &self.tensor_types {
            parse_tensor_type(t).map_err(RecipeError::Invalid)?;
        }
        self.validate_lab()
    }

    fn validate_lab(&self) -> Result<(), RecipeError> {
        let bad = |m: String| Err(RecipeError::Invalid(m));
        let lab = &self.lab;
        if lab.is_off() {
            return Ok(());
        }
        if !lab::AVAILABLE {
            return bad(
                "[lab] options need a build with the lab's solvers: cargo install --features lab"
                    .into(),
            );
        }
        if lab.refit_rounds > 0 && (self.lpbq || self.gguf.is_some()) {
            return bad(
                "lab.refit_rounds works on the free bf16 scale lattice of GPTQ checkpoints only, \
                 not on the phone's LPBQ lattice or GGUF block scales"
                    .into(),
            );
        }
        for (key, on) in [
            ("lab.block_tune", lab.block_tune.is_some()),
            ("lab.model_tune", lab.model_tune.is_some()),
        ] {
            let why = if !on {
                None
            } else if self.gguf.is_some() {
                Some("GGUF block scales")
            } else if self.lpbq {
                Some("the phone's LPBQ lattice (γ·k per channel)")
            } else if self.method == Method::Rtn {
                Some("RTN, which has no objective (the target is the float model's stream)")
            } else if !self.effective_objective().carries_float_stream() {
                Some("the quantized-input objective (the target is the float model's stream)")
            } else {
                None
            };
            if let Some(why) = why {
                return bad(format!(
                    "{key} tunes GPTQ checkpoints on the bf16 scale lattice with the float-stream or float-output objective, not {why}"
                ));
            }
        }
        if lab.model_tune.is_some() && self.quantize_head {
            return bad(
                "lab.model_tune fits the layers to the float model's head; it cannot be combined with quantize_head"
                    .into(),
            );
        }
        let sizes = [
            lab.block_tune.map(|b| ("lab.block_tune", b.steps, b.batch)),
            lab.model_tune.map(|m| ("lab.model_tune", m.steps, m.batch)),
        ];
        for (key, steps, batch) in sizes.into_iter().flatten() {
            if batch == 0 || steps == 0 {
                return bad(format!("{key}: steps and batch must be at least 1"));
            }
        }
        Ok(())
    }

    /// How method `v` chooses a group's scale under this recipe.
    pub fn scale_rule(&self, v: Method) -> ScaleRule {
        match v {
            Method::GptqSearch if self.signs_scales() => ScaleRule::SignedSearch,
            Method::GptqSearch => ScaleRule::Search,
            Method::Rtn | Method::Gptq => ScaleRule::MaxOver7_5,
        }
    }

    /// Whether scales may be negative: on request, in GPTQ checkpoints on vLLM's lattice and
    /// in GGUF types with a signed block scale (the tiered lattices stay positive in any case).
    pub fn signs_scales(&self) -> bool {
        self.signed_scales && !self.lpbq && self.gguf.is_none_or(FileType::signed_scales)
    }

    /// Whether the head is solved: on request, and always for GGUF (where the tied embedding
    /// is quantized, as llama.cpp does).
    pub fn solves_head(&self) -> bool {
        self.quantize_head || self.gguf.is_some()
    }

    /// The objective in effect: RTN rounds W itself and reads no calibration, so it has none
    /// but the plain one.
    pub fn effective_objective(&self) -> Objective {
        match self.method {
            Method::Rtn => Objective::QuantizedInput,
            Method::Gptq | Method::GptqSearch => self.objective,
        }
    }

    /// The projections of a layer that are quantized: GGUF quantizes the head gate `g_proj`
    /// too, as llama.cpp does; a GPTQ checkpoint keeps it 16-bit.
    pub fn projs(&self) -> &'static [Proj] {
        if self.gguf.is_some() {
            &Proj::ALL
        } else {
            &Proj::QUANTIZED
        }
    }

    /// The GGUF type `t` is written as (`None` for a GPTQ checkpoint): the first
    /// `tensor_types` pattern found in its GGUF name, else the file type's rule; then
    /// llama.cpp's fallback where its rows are not whole blocks of that type.
    pub fn gguf_type(&self, t: SolvedTensor, cfg: &SparkConfig) -> Option<GgmlType> {
        let ft = self.gguf?;
        let name = t.gguf_name();
        let chosen = self.tensor_types.iter().find_map(|o| {
            let (pattern, ty) = parse_tensor_type(o).ok()?;
            pattern.is_match(&name).then_some(ty)
        });
        let ty = chosen.unwrap_or_else(|| ft.rule(t.rule_tensor(), cfg.num_hidden_layers));
        Some(ty.fitting(t.row_len(cfg)))
    }

    /// The grid and group size `t` is solved on.
    pub fn grid_of(&self, t: SolvedTensor, cfg: &SparkConfig) -> (Grid, usize) {
        match self.gguf_type(t, cfg) {
            Some(ty) => crate::formats::gguf::quantized::grid_of(ty)
                .expect("the rule and the validated overrides give solvable types"),
            None => (self.gptq_grid(), self.group_size),
        }
    }

    /// The grid of a GPTQ checkpoint's linears: vLLM's, or QNN's LPBQ lattice for the phone
    /// (still exact in vLLM).
    pub fn gptq_grid(&self) -> Grid {
        if self.lpbq {
            Grid::LPBQ
        } else {
            Grid::VLLM
        }
    }
}

/// A tensor the solve writes: the head (named as the file names it: `token_embd.weight` when
/// tied) or a projection of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SolvedTensor {
    Head { tied: bool },
    Linear { layer: usize, proj: Proj },
}

impl SolvedTensor {
    /// Its name in a GGUF file (q, k and v share `attn_qkv`).
    pub fn gguf_name(self) -> String {
        match self {
            SolvedTensor::Head { tied: true } => "token_embd.weight".into(),
            SolvedTensor::Head { tied: false } => "output.weight".into(),
            SolvedTensor::Linear { layer, proj } => {
                crate::formats::gguf::spark::linear_name_of(layer, proj)
            }
        }
    }

    /// What the GGUF file type's rule calls it.
    pub fn rule_tensor(self) -> GgufTensor {
        match self {
            SolvedTensor::Head { .. } => GgufTensor::Head,
            SolvedTensor::Linear {
                layer,
                proj: Proj::Q | Proj::K | Proj::V,
            } => GgufTensor::AttnQkv { layer },
            SolvedTensor::Linear {
                layer,
                proj: Proj::Down,
            } => GgufTensor::FfnDown { layer },
            SolvedTensor::Linear { .. } => GgufTensor::Other,
        }
    }

    /// Its row length (inputs).
    pub fn row_len(self, cfg: &SparkConfig) -> usize {
        match self {
            SolvedTensor::Head { .. } => cfg.hidden_size,
            SolvedTensor::Linear { proj, .. } => proj.shape(cfg)[1],
        }
    }
}

/// One `REGEX=TYPE` override: the pattern and one of [`GgmlType::SOLVABLE`].
pub fn parse_tensor_type(s: &str) -> Result<(regex::Regex, GgmlType), String> {
    let (pattern, ty) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("tensor type {s:?}: expected REGEX=TYPE, e.g. ffn_down=q6_k"))?;
    let ty = GgmlType::solvable_named(ty.trim()).ok_or_else(|| {
        let names: Vec<&str> = GgmlType::SOLVABLE.iter().map(|t| t.name()).collect();
        format!(
            "tensor type {s:?}: {ty} is not a type spark-tool solves; one of {}",
            names.join(", ")
        )
    })?;
    let pattern = regex::Regex::new(pattern.trim())
        .map_err(|e| format!("tensor type {s:?}: the pattern is not a regular expression: {e}"))?;
    Ok((pattern, ty))
}

/// A recipe's keys as a TOML table: from a recipe file, a quantized checkpoint folder of ours
/// (its `recipe.toml`) or a GGUF file of ours (its `spark_tool.recipe`).
pub fn load(path: &Path) -> Result<toml::Table, RecipeError> {
    let origin = path.display().to_string();
    if path.is_dir() {
        return load(&path.join(FILE_NAME));
    }
    if crate::load::is_gguf(path) {
        let f = crate::formats::gguf::GgufFile::open(path).map_err(|e| RecipeError::Parse {
            origin: origin.clone(),
            message: e.to_string(),
        })?;
        let text = f.get_str(GGUF_KEY).map_err(|_| RecipeError::Parse {
            origin: origin.clone(),
            message: format!("the file has no {GGUF_KEY} (not written by spark-tool quantize)"),
        })?;
        return parse(text, &origin);
    }
    let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, &origin)
}

fn parse(text: &str, origin: &str) -> Result<toml::Table, RecipeError> {
    text.parse::<toml::Table>().map_err(|e| RecipeError::Parse {
        origin: origin.to_string(),
        message: e.message().to_string(),
    })
}

/// Apply one `KEY=VALUE` assignment (a dotted key reaches into a table: `lab.block_tune.steps=50`).
/// VALUE is read as TOML, or as a string when it is not TOML (`method=rtn`).
pub fn set(table: &mut toml::Table, assignment: &str) -> Result<(), RecipeError> {
    let err = |message: String| RecipeError::Set {
        assignment: assignment.to_string(),
        message,
    };
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| err("expected KEY=VALUE, e.g. method=rtn".into()))?;
    let (key, value) = (key.trim(), value.trim());
    let value = match format!("v = {value}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").expect("parsed the key it was given"),
        Err(_) => toml::Value::String(value.to_string()),
    };
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts
        .pop()
        .filter(|k| !k.is_empty())
        .ok_or_else(|| err("empty key".into()))?;
    let mut t = table;
    for p in parts {
        t = t
            .entry(p)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| err(format!("{p} is not a table")))?;
    }
    t.insert(last.to_string(), value);
    Ok(())
}

/// The recipe a table of keys gives (missing keys take the defaults); `origin` names it in errors.
pub fn from_table(table: toml::Table, origin: &str) -> Result<Recipe, RecipeError> {
    // The error's Display names the key ("for key `samples`"); its message alone does not.
    Recipe::deserialize(toml::Value::Table(table)).map_err(|e| RecipeError::Parse {
        origin: origin.to_string(),
        message: e.to_string().trim_end().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_round_trips_through_its_file() {
        let r = Recipe::default();
        assert_eq!(Recipe::from_toml(&r.to_toml(), "t").unwrap(), r);
        let gguf = Recipe {
            gguf: Some(FileType::Q4KM),
            forward_precision: ForwardPrecision::F32,
            ..Recipe::default()
        };
        let text = gguf.to_toml();
        assert!(text.contains("gguf = \"q4_k_m\""), "{text}");
        assert_eq!(Recipe::from_toml(&text, "t").unwrap(), gguf);
    }

    #[test]
    fn a_partial_file_takes_the_defaults_and_unknown_keys_are_named() {
        let r = Recipe::from_toml("method = \"rtn\"\nsamples = 4\n", "r.toml").unwrap();
        assert_eq!((r.method, r.samples), (Method::Rtn, 4));
        assert_eq!(r.seq_len, Recipe::default().seq_len);
        let e = Recipe::from_toml("sample = 4\n", "r.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("r.toml") && e.contains("sample"), "{e}");
        let e = Recipe::from_toml("method = \"best\"\n", "r.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("best") && e.contains("gptq-search"), "{e}");
    }

    #[test]
    fn set_reads_toml_values_bare_strings_and_dotted_keys() {
        let mut t = toml::Table::new();
        set(&mut t, "method=rtn").unwrap();
        set(&mut t, "samples = 8").unwrap();
        set(&mut t, "calibration=[\"a.txt\", \"b.txt\"]").unwrap();
        set(&mut t, "lab.refit_rounds=1").unwrap();
        let r = from_table(t.clone(), "t").unwrap();
        assert_eq!(
            (r.method, r.samples, r.lab.refit_rounds),
            (Method::Rtn, 8, 1)
        );
        assert_eq!(
            r.calibration,
            [PathBuf::from("a.txt"), PathBuf::from("b.txt")]
        );
        let e = set(&mut t, "samples").unwrap_err().to_string();
        assert!(
            e.contains("--set samples") && e.contains("KEY=VALUE"),
            "{e}"
        );
        let e = set(&mut t, "samples.x=1").unwrap_err().to_string();
        assert!(e.contains("samples is not a table"), "{e}");
    }

    #[test]
    fn validation_names_the_key() {
        for (r, key) in [
            (
                Recipe {
                    damp: 0.0,
                    ..Recipe::default()
                },
                "damp",
            ),
            (
                Recipe {
                    samples: 0,
                    ..Recipe::default()
                },
                "samples",
            ),
            (
                Recipe {
                    group_size: 48,
                    ..Recipe::default()
                },
                "group_size",
            ),
            (
                Recipe {
                    lab: Lab {
                        refit_rounds: 1,
                        ..Lab::default()
                    },
                    lpbq: true,
                    ..Recipe::default()
                },
                if lab::AVAILABLE {
                    "lab.refit_rounds"
                } else {
                    "--features lab"
                },
            ),
        ] {
            let e = r.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
        Recipe::default().validate().unwrap();
    }

    #[test]
    fn the_fingerprint_follows_every_key_but_calibration_names_and_model_tuning() {
        let base = Recipe::default();
        let other = Recipe {
            damp: 0.02,
            ..Recipe::default()
        };
        assert_ne!(base.fingerprint(), other.fingerprint());
        let tuned = Recipe {
            lab: Lab {
                model_tune: Some(lab::ModelTune::default()),
                ..Lab::default()
            },
            ..Recipe::default()
        };
        assert_eq!(base.fingerprint(), tuned.fingerprint());
        let moved = Recipe {
            calibration: vec![PathBuf::from("elsewhere/calib.jsonl")],
            ..Recipe::default()
        };
        assert_eq!(base.fingerprint(), moved.fingerprint());
    }

    #[test]
    fn tensor_type_overrides_take_the_first_match_then_llama_cpps_fallback() {
        let cfg = crate::checkpoint::SparkConfig::from_json_str(
            &std::fs::read_to_string(crate::bundled_fixture().join("config.json")).unwrap(),
            "config.json",
        )
        .unwrap();
        let r = Recipe {
            gguf: Some(FileType::Q4KM),
            tensor_types: vec![
                "blk\\.1\\.ffn_down=q8_0".into(),
                "ffn_down=Q5_0".into(),
                "attn_output=q6_k".into(),
            ],
            ..Recipe::default()
        };
        r.validate().unwrap();
        let ty = |t| r.gguf_type(t, &cfg).unwrap();
        let down = |layer| SolvedTensor::Linear {
            layer,
            proj: Proj::Down,
        };
        assert_eq!(ty(down(1)), GgmlType::Q8_0, "the first match wins");
        assert_eq!(ty(down(2)), GgmlType::Q5_0);
        let out = SolvedTensor::Linear {
            layer: 2,
            proj: Proj::Out,
        };
        assert_eq!(ty(out), GgmlType::Q6_K);
        let up = SolvedTensor::Linear {
            layer: 2,
            proj: Proj::Up,
        };
        assert_eq!(ty(up), GgmlType::Q4_K, "no pattern: the file type's rule");
        assert_eq!(ty(SolvedTensor::Head { tied: true }), GgmlType::Q6_K);
        // An override to a K-quant on rows that are not whole 256-blocks falls back as the rule's would.
        let mut narrow = cfg.clone();
        narrow.intermediate_size = 704;
        let r = Recipe {
            tensor_types: vec!["ffn_down=q4_k".into()],
            ..r
        };
        assert_eq!(r.gguf_type(down(2), &narrow), Some(GgmlType::Q5_0));
        for (bad, says) in [
            ("ffn_down=q3_k", "Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K"),
            ("ffn_down", "REGEX=TYPE"),
            ("ffn_(down=q8_0", "regular expression"),
        ] {
            let r = Recipe {
                tensor_types: vec![bad.into()],
                ..r.clone()
            };
            let e = r.validate().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let gptq = Recipe {
            tensor_types: vec!["ffn_down=q8_0".into()],
            ..Recipe::default()
        };
        assert!(gptq
            .validate()
            .unwrap_err()
            .to_string()
            .contains("GGUF files only"));
    }
}
