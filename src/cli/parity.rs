use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{ArgGroup, Args};

use spark_tool::engine;
use spark_tool::parity::{self, ParityInputs, ParityReport, Policy};
use spark_tool::report::{self, parity::Baseline};
use spark_tool::setting::Setting;
use spark_tool::tokenizer::SparkTokenizer;

use super::run::ExecArgs;

#[derive(Args)]
#[command(group(ArgGroup::new("report").multiple(true)))]
pub struct ParityArgs {
    /// The reference artifact (usually the original checkpoint).
    reference: PathBuf,
    /// The artifact under test.
    candidate: PathBuf,
    /// Prompt set (default: the bundled held-out set calibration/parity_prompts.json).
    #[arg(long)]
    prompts: Option<PathBuf>,
    #[arg(long, default_value_t = 32, value_parser = super::count)]
    max_new_tokens: usize,
    /// Held-out text for perplexity (default calibration/heldout.jsonl; never used for calibration).
    #[arg(long)]
    eval_text: Option<PathBuf>,
    /// Tokens of held-out text for perplexity, in windows of --eval-seq-len (0: no perplexity;
    /// a --max-ppl-ratio then reports drift).
    #[arg(long, default_value_t = 2048, value_parser = super::count)]
    eval_tokens: usize,
    #[arg(long, default_value_t = 512, value_parser = super::at_least_1)]
    eval_seq_len: usize,
    /// A JSON file of thresholds ({"max_kl_mean": 0.05, ...}); flags below override it.
    #[arg(long)]
    policy: Option<PathBuf>,
    #[arg(long, value_parser = super::fraction)]
    min_greedy_match: Option<f64>,
    #[arg(long, value_parser = super::fraction)]
    min_top1: Option<f64>,
    #[arg(long, value_parser = super::fraction)]
    min_top5: Option<f64>,
    #[arg(long, value_parser = super::non_negative)]
    max_kl_mean: Option<f64>,
    #[arg(long, value_parser = super::non_negative)]
    max_kl_p99: Option<f64>,
    #[arg(long, value_parser = super::finite)]
    min_snr_db: Option<f64>,
    #[arg(long, value_parser = super::non_negative)]
    max_ppl_ratio: Option<f64>,
    /// Write the full report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the report as one self-contained HTML page (charts inline, nothing fetched).
    #[arg(long, group = "report")]
    html: Option<PathBuf>,
    /// Write a Markdown summary (verdict line and tables) for a CI step summary.
    #[arg(long, group = "report")]
    markdown: Option<PathBuf>,
    /// A previous `parity --json` output: --html and --markdown show the change against it.
    #[arg(long, requires = "report")]
    baseline: Option<PathBuf>,
    /// Execution of the candidate when it is quantized.
    #[command(flatten)]
    exec: ExecArgs,
}

/// Exit code: 0 within policy, 1 drift, 2 could not run (returned as an error).
pub fn run(a: ParityArgs) -> anyhow::Result<i32> {
    let mut policy = match &a.policy {
        Some(p) => Policy::from_file(p)?,
        None => Policy::default(),
    };
    macro_rules! over {
        ($($f:ident),*) => { $( if a.$f.is_some() { policy.$f = a.$f; } )* };
    }
    over!(
        min_greedy_match,
        min_top1,
        min_top5,
        max_kl_mean,
        max_kl_p99,
        min_snr_db,
        max_ppl_ratio
    );

    policy
        .validate()
        .map_err(|e| anyhow::anyhow!("{e} (from --policy or its flag)"))?;
    if let (Ok(r), Ok(c)) = (a.reference.canonicalize(), a.candidate.canonicalize()) {
        if r == c {
            eprintln!(
                "note: the reference and the candidate are the same {}: every figure compares it \
                 with itself",
                r.display()
            );
        }
    }
    // Every output is checked before the comparison runs, and the baseline read.
    let mut inputs = vec![a.reference.as_path(), a.candidate.as_path()];
    inputs.extend(a.prompts.as_deref());
    inputs.extend(a.eval_text.as_deref());
    inputs.extend(a.policy.as_deref());
    inputs.extend(a.baseline.as_deref());
    if let Some(path) = &a.json {
        ParityReport::check_path(path, &inputs)?;
    }
    if let Some(path) = &a.html {
        report::check_html_path(path, &inputs)?;
    }
    if let Some(path) = &a.markdown {
        report::check_markdown_path(path, &inputs)?;
    }
    let outputs: Vec<(Setting, &Path)> = [
        (Setting::Json, &a.json),
        (Setting::Html, &a.html),
        (Setting::Markdown, &a.markdown),
    ]
    .into_iter()
    .filter_map(|(s, p)| p.as_deref().map(|p| (s, p)))
    .collect();
    report::check_distinct(&outputs)?;
    let baseline = a
        .baseline
        .as_deref()
        .map(Baseline::read)
        .transpose()
        .context("reading --baseline")?;
    let progress = false;
    let reference = super::load(&a.reference, &super::run::ExecArgs::original(), progress)?;
    let candidate = super::load(&a.candidate, &a.exec, progress)?;
    let tokenizer = match &reference.tokenizer {
        Some(p) => Some(SparkTokenizer::from_file(p)?),
        None => None,
    };
    let prompts = parity::read_prompts(&a.prompts.clone().unwrap_or_else(parity::bundled_prompts))
        .context("reading --prompts")?;
    let eval_windows = match &tokenizer {
        Some(tok) => parity::eval_windows(
            &a.eval_text
                .clone()
                .unwrap_or_else(parity::bundled_eval_text),
            tok,
            a.eval_tokens,
            a.eval_seq_len,
        )
        .context("reading --eval-text")?,
        None => Vec::new(),
    };
    let inputs = ParityInputs {
        reference: reference.engine.as_ref(),
        candidate: candidate.engine.as_ref(),
        reference_name: a.reference.display().to_string(),
        candidate_name: a.candidate.display().to_string(),
        reference_bpw: reference.bpw,
        candidate_bpw: candidate.bpw,
        tokenizer: tokenizer.as_ref(),
        prompts: &prompts,
        max_new_tokens: a.max_new_tokens,
        eval_windows,
        policy,
        tokenizer_difference: match (&reference.tokenizer, engine::is_gguf(&a.candidate)) {
            // A GGUF carries its vocabulary: compared with what the reference's tokenizer gives.
            (Some(t), true) => {
                let f = spark_tool::formats::gguf::GgufFile::open(&a.candidate)?;
                let dir = t.parent().unwrap_or(std::path::Path::new("."));
                spark_tool::formats::gguf::spark::vocabulary_difference(
                    &f,
                    dir,
                    candidate.engine.config().vocab_size,
                )?
            }
            _ => parity::tokenizer_difference(
                reference.tokenizer.as_deref(),
                candidate.tokenizer.as_deref(),
            )?,
        },
    };
    println!(
        "{:<24} {:>6} {:>7} {:>6} {:>6} {:>9} {:>9} {:>8} {:>7}",
        "prompt", "tokens", "greedy", "top1", "top5", "KL mean", "KL max", "max|Δ|", "SNR dB"
    );
    let report = parity::run(inputs, |p| {
        println!(
            "{:<24} {:>6} {:>7} {:>6.3} {:>6.3} {:>9.2e} {:>9.2e} {:>8.3} {:>7.1}",
            p.name,
            p.prompt_tokens,
            match p.first_divergence {
                None => "same".to_string(),
                Some(i) => format!("@{i}"),
            },
            p.top1,
            p.top5,
            p.kl_mean,
            p.kl_max,
            p.max_abs_dlogit,
            p.snr_db
        );
    })?;
    let o = &report.overall;
    println!(
        "overall: greedy identical {}/{} (mean {:.1} tokens to divergence), top-1 {:.4}, top-5 {:.4}, KL mean {:.3e} p99 {:.3e} max {:.3e}, max|Δlogit| {:.3}, SNR {:.1} dB over {} positions",
        o.greedy_identical, o.prompts, o.mean_tokens_to_divergence, o.top1, o.top5, o.kl_mean, o.kl_p99, o.kl_max, o.max_abs_dlogit, o.snr_db, o.positions
    );
    if o.eval_tokens == 0 {
        println!(
            "perplexity: not measured (no held-out tokens); bits/weight {:.3} vs {:.3}",
            report.reference_bpw, report.candidate_bpw
        );
    } else {
        println!(
            "perplexity on {} held-out tokens: reference {:.4}, candidate {:.4}, ratio {:.4}; bits/weight {:.3} vs {:.3}",
            o.eval_tokens, o.ppl_reference, o.ppl_candidate, o.ppl_ratio, report.reference_bpw, report.candidate_bpw
        );
    }
    if let Some(path) = &a.json {
        report.write(path)?;
    }
    if let Some(path) = &a.html {
        report::parity::write_html(path, &report, baseline.as_ref())?;
    }
    if let Some(path) = &a.markdown {
        report::parity::write_markdown(path, &report, baseline.as_ref())?;
    }
    if report.passed {
        println!("PASS");
        Ok(0)
    } else {
        println!("DRIFT: {}", report.failures.join("; "));
        Ok(1)
    }
}
