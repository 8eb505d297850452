use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{ArgGroup, Args};

use spark_tool::load;
use spark_tool::parity::{self, ParityInputs, ParityReport, Policy};
use spark_tool::report::{self, parity::Baseline};
use spark_tool::setting::Setting;
use spark_tool::tokenizer::SparkTokenizer;

use super::run::ExecArgs;

/// Set when the JSON report goes to stdout (`--json -`): the text report then goes to stderr.
static TEXT_ON_STDERR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `println!`, or `eprintln!` while stdout carries the JSON report.
macro_rules! say {
    ($($t:tt)*) => {
        if TEXT_ON_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
            eprintln!($($t)*)
        } else {
            println!($($t)*)
        }
    };
}

/// Whether `--json` names stdout.
fn is_stdout(p: &Path) -> bool {
    p.as_os_str() == "-"
}

#[derive(Args)]
#[command(group(ArgGroup::new("report").multiple(true)))]
pub struct ParityArgs {
    /// The reference artifact (usually the original checkpoint): a path or a Hugging Face hub id ORG/NAME[@REVISION].
    reference: PathBuf,
    /// The artifact under test: a path or a Hugging Face hub id ORG/NAME[@REVISION].
    candidate: PathBuf,
    /// Prompt set (default: the bundled held-out set calibration/parity_prompts.json).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Greedy tokens generated per prompt (the candidate is then scored on the reference's tokens).
    #[arg(long, default_value_t = 32, value_parser = super::count)]
    max_new_tokens: usize,
    /// Held-out text for perplexity (default calibration/heldout.jsonl; never used for calibration).
    #[arg(long)]
    eval_text: Option<PathBuf>,
    /// Tokens of held-out text for perplexity, in windows of --eval-seq-len (0: no perplexity;
    /// a --max-ppl-ratio then reports drift).
    #[arg(long, default_value_t = 2048, value_parser = super::count)]
    eval_tokens: usize,
    /// Tokens per perplexity window.
    #[arg(long, default_value_t = 512, value_parser = super::at_least_1)]
    eval_seq_len: usize,
    /// A JSON file of thresholds ({"max_kl_mean": 0.05, ...}), or `none` to report without gating.
    /// Default: the built-in policy for the candidate's weight class (4-bit, 8-bit or float;
    /// docs/REPORTS.md). The threshold flags below override either.
    #[arg(long, value_name = "FILE|none")]
    policy: Option<PathBuf>,
    /// Least share of prompts whose greedy continuation is identical.
    #[arg(long, value_parser = super::fraction)]
    min_greedy_match: Option<f64>,
    /// Least share of positions where both pick the same top token.
    #[arg(long, value_parser = super::fraction)]
    min_top1: Option<f64>,
    /// Least mean overlap of the two top-5 sets.
    #[arg(long, value_parser = super::fraction)]
    min_top5: Option<f64>,
    /// Most mean KL(reference ‖ candidate) per position, in nats.
    #[arg(long, value_parser = super::non_negative)]
    max_kl_mean: Option<f64>,
    /// Most 99th-percentile KL per position, in nats.
    #[arg(long, value_parser = super::non_negative)]
    max_kl_p99: Option<f64>,
    /// Least signal-to-noise ratio of the candidate's logits, in dB.
    #[arg(long, value_parser = super::finite)]
    min_snr_db: Option<f64>,
    /// Most held-out perplexity of the candidate over the reference's.
    #[arg(long, value_parser = super::non_negative)]
    max_ppl_ratio: Option<f64>,
    /// Write the full report as JSON to this file; `-` prints it on stdout (the text then goes to stderr).
    #[arg(long, value_name = "FILE|-")]
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
/// Where the thresholds come from, before the candidate is opened.
enum PolicyChoice {
    File(PathBuf, Policy),
    None,
    BuiltIn,
}

impl ParityArgs {
    fn policy_choice(&self) -> anyhow::Result<PolicyChoice> {
        Ok(match &self.policy {
            Some(p) if p.as_os_str() == "none" => PolicyChoice::None,
            Some(p) => PolicyChoice::File(p.clone(), Policy::from_file(p)?),
            None => PolicyChoice::BuiltIn,
        })
    }

    /// The policy for a candidate of `class`, with the threshold flags over it, and its source.
    fn policy(
        &self,
        choice: PolicyChoice,
        class: load::WeightClass,
    ) -> anyhow::Result<(Policy, String)> {
        let (mut policy, mut source) = match choice {
            PolicyChoice::File(p, policy) => (policy, p.display().to_string()),
            PolicyChoice::None => (Policy::default(), "none (--policy none)".to_string()),
            PolicyChoice::BuiltIn => (
                parity::builtin_policy(class),
                format!("built-in, {} weights", class.name()),
            ),
        };
        let mut flagged = false;
        macro_rules! over {
            ($($f:ident),*) => { $( if self.$f.is_some() { policy.$f = self.$f; flagged = true; } )* };
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
        if flagged {
            source.push_str(", with threshold flags");
        }
        policy
            .validate()
            .map_err(|e| anyhow::anyhow!("{e} (from --policy or its flag)"))?;
        Ok((policy, source))
    }
}

pub fn run(mut a: ParityArgs, out: super::Verbosity) -> anyhow::Result<i32> {
    let (reference_name, candidate_name) = (
        a.reference.display().to_string(),
        a.candidate.display().to_string(),
    );
    a.reference = super::model(&a.reference)?;
    a.candidate = super::model(&a.candidate)?;
    let choice = a.policy_choice()?;
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
    a.check_outputs(&choice)?;
    if a.json.as_deref().is_some_and(is_stdout) {
        TEXT_ON_STDERR.store(true, std::sync::atomic::Ordering::Relaxed);
    }
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
    let builtin = matches!(choice, PolicyChoice::BuiltIn);
    let (mut policy, policy_source) = a.policy(choice, candidate.class)?;
    if builtin && eval_windows.is_empty() && a.max_ppl_ratio.is_none() {
        // No held-out text was asked for (or none can be tokenized): the built-in policy gates the
        // rest; a perplexity limit the user set still reports the missing figure as drift.
        policy.max_ppl_ratio = None;
    }
    let inputs = ParityInputs {
        reference: reference.engine.as_ref(),
        candidate: candidate.engine.as_ref(),
        reference_name,
        candidate_name,
        reference_bpw: reference.bpw,
        candidate_bpw: candidate.bpw,
        tokenizer: tokenizer.as_ref(),
        prompts: &prompts,
        max_new_tokens: a.max_new_tokens,
        eval_windows,
        policy,
        policy_source,
        tokenizer_difference: tokenizer_difference(&reference, &candidate, &a.candidate)?,
    };
    if !out.quiet {
        print_prompt_header();
    }
    let report = parity::run(inputs, |p| {
        if !out.quiet {
            print_prompt_row(p)
        }
    })?;
    if !out.quiet {
        print_summary(&report);
    }
    a.write_reports(&report, baseline.as_ref())?;
    Ok(print_verdict(&report))
}

impl ParityArgs {
    /// Refuse an output path that would overwrite an input (or another output) or cannot be
    /// written, before any work.
    fn check_outputs(&self, choice: &PolicyChoice) -> anyhow::Result<()> {
        let mut inputs = vec![self.reference.as_path(), self.candidate.as_path()];
        inputs.extend(self.prompts.as_deref());
        inputs.extend(self.eval_text.as_deref());
        if let PolicyChoice::File(p, _) = &choice {
            inputs.push(p);
        }
        inputs.extend(self.baseline.as_deref());
        if let Some(path) = self.json.as_deref().filter(|p| !is_stdout(p)) {
            ParityReport::check_path(path, &inputs)?;
        }
        if let Some(path) = &self.html {
            report::check_html_path(path, &inputs)?;
        }
        if let Some(path) = &self.markdown {
            report::check_markdown_path(path, &inputs)?;
        }
        let outputs: Vec<(Setting, &Path)> = [
            (Setting::Json, &self.json),
            (Setting::Html, &self.html),
            (Setting::Markdown, &self.markdown),
        ]
        .into_iter()
        .filter_map(|(s, p)| p.as_deref().filter(|p| !is_stdout(p)).map(|p| (s, p)))
        .collect();
        report::check_distinct(&outputs)?;
        Ok(())
    }

    /// Write the reports asked for.
    fn write_reports(
        &self,
        report: &ParityReport,
        baseline: Option<&Baseline>,
    ) -> anyhow::Result<()> {
        match &self.json {
            Some(p) if is_stdout(p) => println!("{}", serde_json::to_string_pretty(report)?),
            Some(path) => {
                report.write(path)?;
                say!("wrote {}", path.display());
            }
            None => {}
        }
        if let Some(path) = &self.html {
            report::parity::write_html(path, report, baseline)?;
            say!("wrote {}", path.display());
        }
        if let Some(path) = &self.markdown {
            report::parity::write_markdown(path, report, baseline)?;
            say!("wrote {}", path.display());
        }
        Ok(())
    }
}

/// How the candidate's vocabulary differs from the reference's tokenizer
/// ([`parity::tokenizer_difference`]).
fn tokenizer_difference(
    reference: &super::Opened,
    candidate: &super::Opened,
    candidate_path: &Path,
) -> anyhow::Result<Option<String>> {
    let difference = match (&reference.tokenizer, load::is_gguf(candidate_path)) {
        // A GGUF carries its vocabulary: compared with what the reference's tokenizer gives.
        (Some(t), true) => {
            let f = spark_tool::formats::gguf::GgufFile::open(candidate_path)?;
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
    };
    Ok(difference)
}

fn print_prompt_header() {
    say!(
        "{:<24} {:>6} {:>7} {:>6} {:>6} {:>9} {:>9} {:>8} {:>7}",
        "prompt",
        "tokens",
        "greedy",
        "top1",
        "top5",
        "KL mean",
        "KL max",
        "max|Δ|",
        "SNR dB"
    );
}

fn print_prompt_row(p: &parity::PromptReport) {
    say!(
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
}

fn print_summary(report: &ParityReport) {
    let o = &report.overall;
    say!(
        "overall: greedy identical {}/{} (mean {:.1} tokens to divergence), top-1 {:.4}, top-5 {:.4}, KL mean {:.3e} p99 {:.3e} max {:.3e}, max|Δlogit| {:.3}, SNR {:.1} dB over {} positions",
        o.greedy_identical, o.prompts, o.mean_tokens_to_divergence, o.top1, o.top5, o.kl_mean, o.kl_p99, o.kl_max, o.max_abs_dlogit, o.snr_db, o.positions
    );
    if o.eval_tokens == 0 {
        say!(
            "perplexity: not measured (no held-out tokens); bits/weight {:.3} vs {:.3}",
            report.reference_bpw,
            report.candidate_bpw
        );
    } else {
        say!(
            "perplexity on {} held-out tokens: reference {:.4}, candidate {:.4}, ratio {:.4}; bits/weight {:.3} vs {:.3}",
            o.eval_tokens, o.ppl_reference, o.ppl_candidate, o.ppl_ratio, report.reference_bpw, report.candidate_bpw
        );
    }
    if !report.gates.is_empty() {
        let gates: Vec<String> = report
            .gates
            .iter()
            .map(|g| {
                let op = if g.at_least { "≥" } else { "≤" };
                let room = 100.0 * g.headroom;
                format!(
                    "{} {:.4} {op} {} ({room:.0} % headroom)",
                    g.name, g.figure, g.limit
                )
            })
            .collect();
        say!("gates: {}", gates.join("; "));
    }
}

/// Print the verdict; the exit code is 1 on drift.
fn print_verdict(report: &ParityReport) -> i32 {
    match report.verdict() {
        parity::Verdict::Pass => {
            say!("PASS (policy: {})", report.policy_source);
            0
        }
        parity::Verdict::NotGated => {
            say!(
                "NOT GATED: no threshold was checked (policy: {})",
                report.policy_source
            );
            0
        }
        parity::Verdict::Drift => {
            say!(
                "DRIFT: {} (policy: {})",
                report.failures.join("; "),
                report.policy_source
            );
            1
        }
    }
}
