use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use spark_tool::checkpoint::Checkpoint;
use spark_tool::generate::{generate, GenerateOptions};
use spark_tool::model::{LoadOptions, W4Numerics};
use spark_tool::sampling::SamplingParams;
use spark_tool::tokenizer::{render_chat, SparkTokenizer, StreamDecoder};

#[derive(Clone, Copy, ValueEnum)]
pub enum NumericsArg {
    Auto,
    W4a8,
    W4a16,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ActDtypeArg {
    Auto,
    Bf16,
    F32,
}

/// How a quantized checkpoint is executed.
#[derive(Args, Clone, Copy)]
pub struct ExecArgs {
    /// 4-bit numerics: auto = what the checkpoint records (spark-tool writes w4a8/w4a16; others W4A16).
    #[arg(long, value_enum, default_value = "auto")]
    w4_numerics: NumericsArg,
    /// Activation dtype between linears: auto = bf16 for GPTQ (vLLM) artifacts, f32 for the
    /// original, llama.cpp's 8-bit blocks for a GGUF's quantized tensors.
    #[arg(long, value_enum, default_value = "auto")]
    act_dtype: ActDtypeArg,
}

impl ExecArgs {
    /// Whatever the checkpoint records (the reference side of `parity`).
    pub fn original() -> Self {
        ExecArgs {
            w4_numerics: NumericsArg::Auto,
            act_dtype: ActDtypeArg::Auto,
        }
    }

    /// A GGUF runs as llama.cpp's CPU backend does unless f32 activations are asked for.
    pub fn gguf_numerics(&self) -> anyhow::Result<spark_tool::load::GgufNumerics> {
        use spark_tool::load::GgufNumerics;
        if !matches!(self.w4_numerics, NumericsArg::Auto) {
            bail!("--w4-numerics applies to GPTQ checkpoints, not to a GGUF file");
        }
        Ok(match self.act_dtype {
            ActDtypeArg::Auto => GgufNumerics::Ggml,
            ActDtypeArg::F32 => GgufNumerics::F32,
            ActDtypeArg::Bf16 => bail!(
                "--act-dtype bf16 does not apply to a GGUF file (auto: llama.cpp's activation numerics; f32)"
            ),
        })
    }

    /// --w4-numerics applies to GPTQ checkpoints only: refused for `dir` unless `gptq`.
    pub fn check_w4_numerics(&self, dir: &std::path::Path, gptq: bool) -> anyhow::Result<()> {
        if !matches!(self.w4_numerics, NumericsArg::Auto) && !gptq {
            bail!(
                "--w4-numerics applies to GPTQ checkpoints; {} has no 4-bit GPTQ weights",
                dir.display()
            );
        }
        Ok(())
    }

    pub fn options(&self, ck: &Checkpoint, progress: bool) -> LoadOptions {
        let mut o = LoadOptions::for_checkpoint(ck, progress);
        match self.w4_numerics {
            NumericsArg::Auto => {}
            NumericsArg::W4a8 => o.exec.numerics = W4Numerics::W4A8,
            NumericsArg::W4a16 => o.exec.numerics = W4Numerics::W4A16,
        }
        match self.act_dtype {
            ActDtypeArg::Auto => {}
            ActDtypeArg::Bf16 => o.exec.act_bf16 = true,
            ActDtypeArg::F32 => o.exec.act_bf16 = false,
        }
        o
    }
}

fn seed(s: &str) -> Result<u64, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("expected a whole number in 0..=18446744073709551615, got '{s}'"))
}

fn token_id(s: &str) -> Result<u32, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("expected comma-separated token ids (whole numbers >= 0), got '{s}'"))
}

fn temperature(s: &str) -> Result<f32, String> {
    super::non_negative(s).map(|v| v as f32)
}

fn top_p(s: &str) -> Result<f32, String> {
    match super::finite(s) {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v as f32),
        _ => Err(format!("expected a number in (0, 1], got '{s}'")),
    }
}

#[derive(Args)]
pub struct RunArgs {
    /// Checkpoint folder (original or GPTQ), GGUF file, phone export, or a Hugging Face hub id ORG/NAME[@REVISION].
    model: PathBuf,
    /// Prompt text, tokenized with the checkpoint's tokenizer.json.
    #[arg(long, conflicts_with = "tokens")]
    prompt: Option<String>,
    /// With a GGUF file and --prompt: the model folder whose tokenizer.json encodes the prompt
    /// (checked against the file's vocabulary; default: a tokenizer.json beside the file).
    #[arg(long, requires = "prompt")]
    tokenizer: Option<PathBuf>,
    /// Prompt as comma-separated token ids, e.g. `0,4084,53`.
    #[arg(long, value_delimiter = ',', value_parser = token_id)]
    tokens: Option<Vec<u32>>,
    /// Wrap the prompt in the chat frame (system line, user turn, assistant prompt).
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// With --chat: a system message appended after the built-in one.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: open the answer with `</think>` (thinking off) instead of `<think>`.
    #[arg(long, requires = "chat")]
    no_think: bool,
    /// At most this many tokens; generation also stops at the model's max_position_embeddings.
    #[arg(long, default_value_t = 64, value_parser = super::count)]
    max_new_tokens: usize,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Sampling temperature; 0 (default) = greedy, ties to the lowest id.
    #[arg(long, default_value_t = 0.0, value_parser = temperature)]
    temperature: f32,
    /// Keep only the k most likely tokens when sampling (0 = off).
    #[arg(long, default_value_t = 0, value_parser = super::count)]
    top_k: usize,
    /// Nucleus sampling threshold (1.0 = off).
    #[arg(long, default_value_t = 1.0, value_parser = top_p)]
    top_p: f32,
    /// Seed of the sampler (with --temperature > 0): the same seed gives the same text.
    #[arg(long, default_value_t = 0, value_parser = seed)]
    seed: u64,
    /// KV-cache context (default: prompt length + max-new-tokens).
    #[arg(long, value_parser = super::at_least_1)]
    context: Option<usize>,
    /// Write prompt_logits, decode_logits (f32) and tokens (i64) to this .safetensors file.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Print per-phase timers to stderr (as `-v`).
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    exec: ExecArgs,
}

pub fn run(a: RunArgs, say: super::Verbosity) -> anyhow::Result<()> {
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature must be >= 0, got {}", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    let dir = super::model(&a.model)?;
    if let Some(path) = &a.logits_out {
        spark_tool::generate::check_logits_path(path, &[&dir])?;
    }
    let t_load = Instant::now();
    let loaded = super::load(&dir, &a.exec, !say.quiet)?;
    for w in &loaded.warnings {
        eprintln!("warning: {w}");
    }
    let gguf = spark_tool::load::is_gguf(&dir);
    let tokenizer_path = a.tokenizer_path(&dir, gguf, &loaded)?;
    let tokenizer = match &tokenizer_path {
        Some(p) => Some(SparkTokenizer::from_file(p)?),
        None => None,
    };
    let prompt = a.prompt_tokens(tokenizer.as_ref(), &dir, gguf)?;
    if prompt.is_empty() {
        bail!("the prompt tokenized to zero tokens");
    }
    let model = loaded.engine;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;

    let cfg = model.config();
    let mut opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        ignore_eos: a.ignore_eos,
        stop_ids: cfg.eos_token_ids.clone(),
        sampling: (a.temperature > 0.0).then_some(SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        }),
        context: a.context,
        capture_logits: a.logits_out.is_some(),
    };
    for w in spark_tool::generate::plan(model.as_ref(), prompt.len(), &mut opts)? {
        eprintln!("warning: {w}");
    }
    let mut stdout = std::io::stdout().lock();
    let mut stream = StreamDecoder::default();
    let mut stream_err = None;
    let mut first_token = None;
    let out = generate(model.as_ref(), &prompt, &opts, |id| {
        first_token.get_or_insert_with(Instant::now);
        if say.quiet {
            return;
        }
        let piece = match &tokenizer {
            Some(t) => stream
                .push(t, id)
                .map_err(|e| stream_err = Some(e))
                .unwrap_or_default(),
            None => format!("{id} "),
        };
        let _ = stdout.write_all(piece.as_bytes());
        let _ = stdout.flush();
    })
    .map_err(|e| super::model_error(e, &dir))?;
    if let Some(e) = stream_err {
        return Err(e.into());
    }
    if !say.quiet {
        let _ = writeln!(stdout);
    }

    if let Some(path) = &a.logits_out {
        spark_tool::generate::write_logits(path, &out, cfg.vocab_size)?;
    }
    if a.stats || say.verbose {
        // What a user waits for: open + repack + tokenize + prefill + sample.
        let first_token_ms = first_token.map(|t| (t - t_load).as_secs_f64() * 1e3);
        print_stats(&out, load_ms, first_token_ms);
    }
    Ok(())
}

impl RunArgs {
    /// The tokenizer.json to read: the artifact's own, or for a GGUF file the one `--tokenizer`
    /// names (checked against the file's vocabulary).
    fn tokenizer_path(
        &self,
        dir: &std::path::Path,
        gguf: bool,
        loaded: &super::Opened,
    ) -> anyhow::Result<Option<PathBuf>> {
        Ok(match &self.tokenizer {
            Some(t) if gguf => {
                let f = spark_tool::formats::gguf::GgufFile::open(dir)?;
                let vocab = loaded.engine.config().vocab_size;
                Some(spark_tool::load::gguf_tokenizer(dir, &f, vocab, t)?)
            }
            Some(_) => bail!(
                "--tokenizer is for GGUF files; {} is tokenized with its own tokenizer.json",
                dir.display()
            ),
            None => loaded.tokenizer.clone(),
        })
    }

    /// The prompt's token ids: `--prompt` tokenized (in the chat frame with `--chat`), or
    /// `--tokens`.
    fn prompt_tokens(
        &self,
        tokenizer: Option<&SparkTokenizer>,
        dir: &std::path::Path,
        gguf: bool,
    ) -> anyhow::Result<Vec<u32>> {
        Ok(match (&self.prompt, &self.tokens) {
            (Some(text), _) => {
                let tok = tokenizer.with_context(|| match gguf {
                    true => format!(
                        "{} is a GGUF file, which carries no tokenizer.json: pass --tokenizer \
                         MODEL_DIR (the folder of the model's tokenizer.json), put the tokenizer.json \
                         beside the file, or pass --tokens instead of --prompt",
                        dir.display()
                    ),
                    false => format!(
                        "{} has no tokenizer.json; pass --tokens instead of --prompt",
                        dir.display()
                    ),
                })?;
                let text = if self.chat {
                    render_chat(text, self.system.as_deref(), !self.no_think)
                } else {
                    text.clone()
                };
                tok.encode(&text)?
            }
            (None, Some(ids)) => ids.clone(),
            (None, None) => bail!("nothing to run: pass --prompt TEXT or --tokens 1,2,3"),
        })
    }
}

/// `--stats`: per-phase timers on stderr.
fn print_stats(
    out: &spark_tool::generate::GenerateOutput,
    load_ms: f64,
    first_token_ms: Option<f64>,
) {
    let s = &out.stats;
    let dec = &s.decode_ms;
    let (mn, mx) = dec
        .iter()
        .fold((f64::INFINITY, 0f64), |(a, b), &x| (a.min(x), b.max(x)));
    eprintln!("load            {load_ms:9.1} ms");
    eprintln!(
        "prefill         {:9.1} ms  ({} tokens, {:.1} tok/s)",
        s.prefill_ms,
        s.prompt_tokens,
        s.prompt_tokens as f64 / (s.prefill_ms / 1e3)
    );
    if !dec.is_empty() {
        eprintln!(
            "decode / token  {:9.2} ms  (min {mn:.2}, max {mx:.2}; {} steps, {:.1} tok/s)",
            s.decode_mean_ms(),
            dec.len(),
            1e3 / s.decode_mean_ms()
        );
    }
    eprintln!("sampling        {:9.2} ms total", s.sampling_ms);
    if let Some(ms) = first_token_ms {
        eprintln!("first token     {ms:9.1} ms  after the start of loading");
    }
    eprintln!(
        "generated {} tokens{}; threads {}",
        s.generated_tokens,
        if out.stopped_at_eos {
            " (stopped at EOS)"
        } else {
            ""
        },
        rayon::current_num_threads()
    );
}
