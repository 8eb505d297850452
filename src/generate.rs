//! Prompt → tokens: one prefill, then one decode step per new token.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use crate::artifact::ArtifactError;
use crate::checkpoint::write::{write_safetensors_atomic, OwnedTensor, WriteError};
use crate::engine::Engine;
use crate::model::{Logits, ModelError};
use crate::sampling::{Sampler, SamplingParams};
use crate::setting::Setting;

pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub ignore_eos: bool,
    pub stop_ids: Vec<u32>,
    pub sampling: Option<SamplingParams>,
    /// KV-cache context; `None` = prompt + max_new_tokens.
    pub context: Option<usize>,
    /// Keep logits of every prompt position and of every generated token.
    pub capture_logits: bool,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_ms: f64,
    pub decode_ms: Vec<f64>,
    pub sampling_ms: f64,
}

impl GenerateStats {
    pub fn decode_mean_ms(&self) -> f64 {
        if self.decode_ms.is_empty() {
            0.0
        } else {
            self.decode_ms.iter().sum::<f64>() / self.decode_ms.len() as f64
        }
    }
}

pub struct GenerateOutput {
    /// Prompt followed by generated ids.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// `[prompt_len, vocab]` when captured.
    pub prompt_logits: Vec<f32>,
    /// Row i is the distribution generated token i was chosen from (`[generated, vocab]`).
    pub decode_logits: Vec<f32>,
    pub stopped_at_eos: bool,
    pub stats: GenerateStats,
}

#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error("the prompt has {prompt} tokens but {limit}")]
    PromptTooLong { prompt: usize, limit: String },
    #[error("{setting} {context} exceeds the model's max_position_embeddings ({max}) in config.json", setting = Setting::Context)]
    ContextPastModel { context: usize, max: usize },
    #[error(transparent)]
    Resources(#[from] crate::resources::ResourceError),
}

/// Bound a generation before anything is allocated. The positions used (prompt + generated) may
/// not pass the model's `max_position_embeddings` (RoPE was trained up to there; past it the
/// output is garbage without any error) nor an explicit context: a prompt that does not fit is
/// refused, and `max_new_tokens` is clamped so generation stops there, with a warning (it is a
/// maximum, so stopping early is what it promises). The KV cache, activations and captured logits
/// must fit in the available memory. Returns the warnings.
pub fn plan(
    engine: &dyn Engine,
    prompt_len: usize,
    opts: &mut GenerateOptions,
) -> Result<Vec<String>, BudgetError> {
    let cfg = engine.config();
    let max = cfg.max_position_embeddings;
    if let Some(c) = opts.context {
        if c > max {
            return Err(BudgetError::ContextPastModel { context: c, max });
        }
    }
    let (limit, why) = match opts.context {
        Some(c) => (c, format!("{} is {c}", Setting::Context)),
        None => (max, format!("the model's max_position_embeddings is {max}")),
    };
    if prompt_len > limit {
        return Err(BudgetError::PromptTooLong {
            prompt: prompt_len,
            limit: why,
        });
    }
    let mut warnings = Vec::new();
    let room = limit - prompt_len;
    if opts.max_new_tokens > room {
        warnings.push(format!(
            "{} {} clamped to {room}: {why} and the prompt has {prompt_len} tokens",
            Setting::MaxNewTokens,
            opts.max_new_tokens
        ));
        opts.max_new_tokens = room;
    }
    let context = opts.context.unwrap_or(prompt_len + opts.max_new_tokens);
    let mut need = engine.sequence_bytes(context)
        + crate::resources::forward_bytes(cfg, prompt_len, opts.capture_logits);
    if opts.capture_logits {
        need += opts.max_new_tokens as u128 * cfg.vocab_size as u128 * 4;
    }
    crate::resources::check_fits(
        &format!(
            "generating {} tokens after a {prompt_len}-token prompt",
            opts.max_new_tokens
        ),
        need,
        Setting::MaxNewTokens,
    )?;
    Ok(warnings)
}

/// Generate after `prompt`, calling `on_token` with each new id as soon as it is chosen.
pub fn generate(
    model: &dyn Engine,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32),
) -> Result<GenerateOutput, ModelError> {
    let vocab = model.config().vocab_size;
    let context = opts.context.unwrap_or(prompt.len() + opts.max_new_tokens);
    let mut seq = model.start(context)?;
    let mut sampler = Sampler::new(opts.sampling);
    let mut stats = GenerateStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };

    let t = Instant::now();
    let want = if opts.capture_logits {
        Logits::All
    } else {
        Logits::Last
    };
    let prompt_logits = seq.forward(prompt, want)?;
    stats.prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut last = prompt_logits[prompt_logits.len() - vocab..].to_vec();
    // Sampling from NaN logits would print tokens as if nothing were wrong.
    let finite = |l: &[f32], position: usize| match l.iter().all(|v| v.is_finite()) {
        true => Ok(()),
        false => Err(ModelError::NonFinite { position }),
    };
    finite(&last, prompt.len() - 1)?;

    let mut tokens = prompt.to_vec();
    let mut decode_logits = Vec::new();
    let mut stopped_at_eos = false;
    for i in 0..opts.max_new_tokens {
        let t = Instant::now();
        let next = sampler.next(&last);
        stats.sampling_ms += t.elapsed().as_secs_f64() * 1e3;
        if opts.capture_logits {
            decode_logits.extend_from_slice(&last);
        }
        tokens.push(next);
        on_token(next);
        if !opts.ignore_eos && opts.stop_ids.contains(&next) {
            stopped_at_eos = true;
            break;
        }
        if i + 1 == opts.max_new_tokens {
            break;
        }
        let t = Instant::now();
        last = seq.forward(&[next], Logits::Last)?;
        stats.decode_ms.push(t.elapsed().as_secs_f64() * 1e3);
        finite(&last, tokens.len() - 1)?;
    }
    stats.generated_tokens = tokens.len() - prompt.len();
    Ok(GenerateOutput {
        tokens,
        prompt_len: prompt.len(),
        prompt_logits: if opts.capture_logits {
            prompt_logits
        } else {
            Vec::new()
        },
        decode_logits,
        stopped_at_eos,
        stats,
    })
}

/// `producer` metadata of a `--logits-out` file (how a previous one is recognised).
const LOGITS_PRODUCER: &str = "spark-tool";

/// Whether `path` is a safetensors file we wrote (its metadata `producer` names us): a previous
/// `--logits-out` or `--dump-dequantized` output, which may be replaced.
pub fn is_spark_safetensors(path: &Path) -> bool {
    is_logits_file(path)
}

/// Whether `path` is a `--logits-out` file we wrote (safetensors whose metadata names us).
fn is_logits_file(path: &Path) -> bool {
    use std::io::Read;
    let header = || -> Option<serde_json::Value> {
        let mut f = std::fs::File::open(path).ok()?;
        let mut n = [0u8; 8];
        f.read_exact(&mut n).ok()?;
        let n = u64::from_le_bytes(n);
        if n > 1 << 20 {
            return None;
        }
        let mut h = vec![0u8; n as usize];
        f.read_exact(&mut h).ok()?;
        serde_json::from_slice(&h).ok()
    };
    header()
        .and_then(|h| h["__metadata__"]["producer"].as_str().map(String::from))
        .is_some_and(|p| p.starts_with(LOGITS_PRODUCER))
}

/// Refuse a `--logits-out` path that is an input, lies inside one, or would overwrite a file
/// that is not a previous logits file of ours.
pub fn check_logits_path(path: &Path, inputs: &[&Path]) -> Result<(), ArtifactError> {
    crate::artifact::check_output_file(
        path,
        inputs,
        crate::setting::Setting::LogitsOut,
        is_logits_file,
    )
}

/// The `--logits-out` file (read by tools/*.py): `prompt_logits` f32 `[prompt_len, vocab]`,
/// `decode_logits` f32 `[generated, vocab]`, `tokens` i64 (prompt then generated); metadata
/// `prompt_len` and `producer`.
pub fn write_logits(path: &Path, out: &GenerateOutput, vocab: usize) -> Result<(), WriteError> {
    let gen = out.tokens.len() - out.prompt_len;
    let ids: Vec<i64> = out.tokens.iter().map(|&t| t as i64).collect();
    let mut meta = std::collections::BTreeMap::new();
    meta.insert("prompt_len".to_string(), out.prompt_len.to_string());
    meta.insert(
        "producer".to_string(),
        format!("{LOGITS_PRODUCER} {}", env!("CARGO_PKG_VERSION")),
    );
    write_safetensors_atomic(
        path,
        &[
            OwnedTensor::f32(
                "prompt_logits",
                vec![out.prompt_len, vocab],
                &out.prompt_logits,
            ),
            OwnedTensor::f32("decode_logits", vec![gen, vocab], &out.decode_logits),
            OwnedTensor::i64("tokens", &ids),
        ],
        Some(meta),
    )
}
