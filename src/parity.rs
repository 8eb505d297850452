//! `parity`: how closely a candidate artifact tracks a reference, on the
//! same prompts, and whether that is within a policy.
//!
//! Per prompt: the reference's greedy continuation, with the candidate forced
//! along the same tokens (where would its own greedy choice first differ?):
//! at every position, KL(ref‖cand) of the next-token distributions, top-1
//! agreement, top-5 overlap, max |Δlogit| and the logits' signal-to-noise
//! ratio. Plus perplexity of both on held-out text. Prompts are decoded in
//! lockstep groups: one batched step of each model feeds every unfinished one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::engine::Engine;
use crate::generate::GenerateOptions;
use crate::model::{Logits, ModelError};
use crate::tokenizer::{render_chat, SparkTokenizer};

/// One prompt of a prompt set (`{"prompts": [...]}`; same schema as the golden prompt sets).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Prompt {
    pub name: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub tokens: Option<Vec<u32>>,
    #[serde(default)]
    pub chat: bool,
    #[serde(default)]
    pub system: Option<String>,
    #[serde(default = "yes")]
    pub thinking: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
struct PromptFile {
    prompts: Vec<Prompt>,
}

#[derive(Debug, thiserror::Error)]
pub enum ParityError {
    #[error("{path}: {message}")]
    Input { path: String, message: String },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("{0}")]
    Mismatch(String),
    #[error(transparent)]
    Budget(#[from] crate::generate::BudgetError),
}

pub fn bundled_prompts() -> PathBuf {
    crate::bundled::path("parity_prompts.json")
}

pub fn bundled_eval_text() -> PathBuf {
    crate::bundled::path("heldout.jsonl")
}

/// Held-out windows for perplexity: `tokens` tokens of `text` in windows of `seq_len` (at most
/// `tokens`, at least 2); none when `tokens` is 0.
pub fn eval_windows(
    text: &Path,
    tok: &SparkTokenizer,
    tokens: usize,
    seq_len: usize,
) -> Result<Vec<Vec<u32>>, crate::calibration::CalibrationError> {
    if tokens == 0 {
        return Ok(Vec::new());
    }
    let seq = seq_len.min(tokens).max(2);
    let w = crate::calibration::build(&[text.to_path_buf()], tok, tokens / seq, seq)?;
    Ok((0..w.samples).map(|s| w.sample(s).to_vec()).collect())
}

pub fn read_prompts(path: &Path) -> Result<Vec<Prompt>, ParityError> {
    let bad = |message: String| ParityError::Input {
        path: path.display().to_string(),
        message,
    };
    let text = crate::bundled::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let f: PromptFile = serde_json::from_str(&text).map_err(|e| {
        bad(format!(
            "expected {{\"prompts\": [{{\"name\", \"text\" | \"tokens\", \"chat\"?}}]}}: {e}"
        ))
    })?;
    if f.prompts.is_empty() {
        return Err(bad("no prompts".into()));
    }
    for p in &f.prompts {
        if p.text.is_none() == p.tokens.is_none() {
            return Err(bad(format!(
                "prompt `{}` needs exactly one of \"text\" or \"tokens\"",
                p.name
            )));
        }
    }
    Ok(f.prompts)
}

/// Thresholds; `None` = not checked.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Fraction of prompts whose greedy continuation must be identical.
    pub min_greedy_match: Option<f64>,
    pub min_top1: Option<f64>,
    pub min_top5: Option<f64>,
    pub max_kl_mean: Option<f64>,
    pub max_kl_p99: Option<f64>,
    pub min_snr_db: Option<f64>,
    pub max_ppl_ratio: Option<f64>,
}

/// The policy `parity` applies when none is given: a gate against a broken artifact for each weight
/// class, set well outside what sound artifacts measure (docs/REPORTS.md "Built-in policies") and
/// far inside what a broken one does (a scrambled 4-bit fixture: top-1 0.002, KL mean 6.9).
pub fn builtin_policy(class: crate::load::WeightClass) -> Policy {
    use crate::load::WeightClass as C;
    let (top1, kl_mean, kl_p99, ppl) = match class {
        C::Int4 => (0.85, 0.1, 1.5, 1.15),
        C::Int8 => (0.95, 0.02, 0.2, 1.03),
        C::Float => (0.98, 0.005, 0.05, 1.01),
    };
    Policy {
        min_top1: Some(top1),
        max_kl_mean: Some(kl_mean),
        max_kl_p99: Some(kl_p99),
        max_ppl_ratio: Some(ppl),
        ..Policy::default()
    }
}

/// Each threshold key, with the range a meaningful value lies in.
const THRESHOLDS: [(&str, f64, f64); 7] = [
    ("min_greedy_match", 0.0, 1.0),
    ("min_top1", 0.0, 1.0),
    ("min_top5", 0.0, 1.0),
    ("max_kl_mean", 0.0, f64::INFINITY),
    ("max_kl_p99", 0.0, f64::INFINITY),
    // SNR in dB may be negative.
    ("min_snr_db", f64::NEG_INFINITY, f64::INFINITY),
    ("max_ppl_ratio", 0.0, f64::INFINITY),
];

impl Policy {
    pub fn from_file(path: &Path) -> Result<Self, ParityError> {
        let bad = |message: String| ParityError::Input {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        // Key by key, so a wrong type names its key (serde alone gives a line and column).
        let serde_json::Value::Object(map) = &v else {
            return Err(bad(format!(
                "expected a JSON object of thresholds ({}), found {v}",
                THRESHOLDS.map(|t| t.0).join(", ")
            )));
        };
        for (k, x) in map {
            if !THRESHOLDS.iter().any(|t| t.0 == k) {
                return Err(bad(format!(
                    "unknown key `{k}`; expected one of {}",
                    THRESHOLDS.map(|t| t.0).join(", ")
                )));
            }
            if !(x.is_number() || x.is_null()) {
                return Err(bad(format!("`{k}` must be a number, found {x}")));
            }
        }
        let p: Policy = serde_json::from_value(v).map_err(|e| bad(e.to_string()))?;
        p.validate().map_err(bad)?;
        Ok(p)
    }

    /// Every threshold set lies in its meaningful range (a negative KL bound or a top-1 above 1
    /// could never pass, a NaN never fail); the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        let values = [
            self.min_greedy_match,
            self.min_top1,
            self.min_top5,
            self.max_kl_mean,
            self.max_kl_p99,
            self.min_snr_db,
            self.max_ppl_ratio,
        ];
        for ((key, lo, hi), v) in THRESHOLDS.iter().zip(values) {
            if let Some(v) = v {
                if !(v.is_finite() && v >= *lo && v <= *hi) {
                    let range = match (lo.is_finite(), hi.is_finite()) {
                        (true, true) => format!("in {lo}..={hi}"),
                        (true, false) => format!(">= {lo}"),
                        _ => "a finite number".into(),
                    };
                    return Err(format!("threshold `{key}` = {v} must be {range}"));
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptReport {
    pub name: String,
    pub prompt_tokens: usize,
    pub greedy_identical: bool,
    /// Index of the first generated token that differs (None when identical).
    pub first_divergence: Option<usize>,
    pub positions: usize,
    pub top1: f64,
    pub top5: f64,
    pub kl_mean: f64,
    pub kl_max: f64,
    pub max_abs_dlogit: f64,
    pub snr_db: f64,
    /// KL(ref‖cand) at each teacher-forced position (position p predicts token p + 1), the
    /// series `--html` plots.
    pub kl_per_position: Vec<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Overall {
    pub greedy_identical: usize,
    pub prompts: usize,
    pub mean_tokens_to_divergence: f64,
    pub positions: usize,
    pub top1: f64,
    pub top5: f64,
    pub kl_mean: f64,
    pub kl_p99: f64,
    pub kl_max: f64,
    pub max_abs_dlogit: f64,
    pub snr_db: f64,
    pub eval_tokens: usize,
    pub ppl_reference: f64,
    pub ppl_candidate: f64,
    pub ppl_ratio: f64,
    /// Teacher-forced positions whose logits hold a NaN or an infinity, per side. Any makes the
    /// comparison meaningless (KL and SNR of NaN compare as "no failure"), so any fails parity.
    pub non_finite_reference: usize,
    pub non_finite_candidate: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ParityReport {
    pub reference: String,
    pub candidate: String,
    pub reference_bpw: f64,
    pub candidate_bpw: f64,
    pub max_new_tokens: usize,
    pub prompts: Vec<PromptReport>,
    pub overall: Overall,
    pub policy: Policy,
    pub passed: bool,
    /// Why the policy failed (empty when it passed).
    pub failures: Vec<String>,
    /// Each threshold the policy sets, with its figure and how far inside it that is.
    pub gates: Vec<Gate>,
    /// Where the thresholds came from: a file, the built-in policy for the candidate's weight
    /// class, or none.
    pub policy_source: String,
}

/// A parity run's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drift,
    /// Nothing failed, but no threshold was checked either: not a pass.
    NotGated,
}

impl ParityReport {
    pub fn verdict(&self) -> Verdict {
        match (self.passed, self.gates.is_empty()) {
            (false, _) => Verdict::Drift,
            (true, true) => Verdict::NotGated,
            (true, false) => Verdict::Pass,
        }
    }

    /// Refuse a `--json` path that is an input, lies inside one, or would overwrite a file that
    /// is not a previous parity report.
    pub fn check_path(path: &Path, inputs: &[&Path]) -> Result<(), crate::artifact::ArtifactError> {
        crate::artifact::check_output_file(path, inputs, crate::setting::Setting::Json, |p| {
            std::fs::read(p)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .is_some_and(|v| {
                    ["overall", "policy", "passed"]
                        .iter()
                        .all(|k| v.get(k).is_some())
                })
        })
    }

    /// Write the report as JSON, atomically.
    pub fn write(&self, path: &Path) -> Result<(), crate::artifact::ArtifactError> {
        crate::artifact::write_json(path, self)
    }
}

/// Per-position comparison statistics.
#[derive(Default)]
struct Acc {
    kls: Vec<f64>,
    top1: usize,
    top5: usize,
    max_abs: f64,
    sig: f64,
    noise: f64,
}

/// `(x − max, ln Σ exp(x − max))` in f64: the log-softmax is the first minus the second.
fn shifted_lse(x: &[f32]) -> (f64, f64) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
    let lse = x.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln();
    (max, lse)
}

/// The `k` largest entries' indices, by value (total order) then lower index first: one pass that
/// keeps a sorted list of `k`, where sorting all 131,072 logits twice per position was a tenth of
/// a 1.7B parity run.
fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut top: Vec<usize> = Vec::with_capacity(k + 1);
    for (i, v) in x.iter().enumerate() {
        // Scanning in index order, an equal value never displaces an earlier index.
        if top.len() == k && v.total_cmp(&x[top[k - 1]]).is_le() {
            continue;
        }
        let at = top.partition_point(|&j| x[j].total_cmp(v).is_ge());
        top.insert(at, i);
        top.truncate(k);
    }
    top
}

/// What one position contributes: the reference row `r` against the candidate row `c`.
struct RowStats {
    kl: f64,
    top1: bool,
    top5: usize,
    max_abs: f64,
    sig: f64,
    noise: f64,
    finite: (bool, bool),
}

impl RowStats {
    fn of(r: &[f32], c: &[f32]) -> Self {
        let ((mr, lr), (mc, lc)) = (shifted_lse(r), shifted_lse(c));
        // KL(p‖q) = Σ p·(log p − log q), with log p = r − mr − lr and p = exp(log p).
        let kl: f64 = r
            .iter()
            .zip(c)
            .map(|(a, b)| {
                let la = *a as f64 - mr - lr;
                let lb = *b as f64 - mc - lc;
                la.exp() * (la - lb)
            })
            .sum();
        let (tr, tc) = (top_k(r, 5), top_k(c, 5));
        let (mut max_abs, mut sig, mut noise) = (0f64, 0f64, 0f64);
        for (a, b) in r.iter().zip(c) {
            let d = (*a as f64 - *b as f64).abs();
            max_abs = max_abs.max(d);
            sig += (*a as f64).powi(2);
            noise += d * d;
        }
        RowStats {
            kl: kl.max(0.0),
            top1: tr[0] == tc[0],
            top5: tr.iter().filter(|t| tc.contains(t)).count(),
            max_abs,
            sig,
            noise,
            finite: (
                r.iter().all(|v| v.is_finite()),
                c.iter().all(|v| v.is_finite()),
            ),
        }
    }

    /// Rows `i` of `[n, vocab]` reference and candidate logits, in parallel, in row order.
    fn of_rows(r: &[f32], c: &[f32], vocab: usize, n: usize) -> Vec<Self> {
        use rayon::prelude::*;
        r.par_chunks_exact(vocab)
            .zip(c.par_chunks_exact(vocab))
            .take(n)
            .map(|(a, b)| RowStats::of(a, b))
            .collect()
    }
}

impl Acc {
    fn add(&mut self, s: &RowStats) {
        self.kls.push(s.kl);
        self.top1 += s.top1 as usize;
        self.top5 += s.top5;
        self.max_abs = self.max_abs.max(s.max_abs);
        self.sig += s.sig;
        self.noise += s.noise;
    }
    fn n(&self) -> usize {
        self.kls.len()
    }
    fn snr_db(&self) -> f64 {
        if self.noise == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (self.sig / self.noise).log10()
        }
    }
}

fn encode(tok: Option<&SparkTokenizer>, p: &Prompt) -> Result<Vec<u32>, ParityError> {
    if let Some(t) = &p.tokens {
        return Ok(t.clone());
    }
    let tok = tok.ok_or_else(|| {
        ParityError::Mismatch(format!(
            "prompt `{}` is text but the reference has no tokenizer.json",
            p.name
        ))
    })?;
    let text = p.text.as_deref().unwrap_or_default();
    let text = if p.chat {
        render_chat(text, p.system.as_deref(), p.thinking)
    } else {
        text.to_string()
    };
    Ok(tok.encode(&text)?)
}

fn perplexity(model: &dyn Engine, windows: &[Vec<u32>]) -> Result<f64, ParityError> {
    let (mut nll, mut n) = (0f64, 0usize);
    let vocab = model.config().vocab_size;
    for w in windows {
        use rayon::prelude::*;
        let logits = model.start(w.len())?.forward(w, Logits::All)?;
        let rows = w.len() - 1;
        let terms: Vec<f64> = logits
            .par_chunks_exact(vocab)
            .zip(&w[1..])
            .take(rows)
            .map(|(row, &t)| {
                let (max, lse) = shifted_lse(row);
                row[t as usize] as f64 - max - lse
            })
            .collect();
        nll -= terms.iter().sum::<f64>();
        n += rows;
    }
    Ok((nll / n.max(1) as f64).exp())
}

/// Prompts whose continuations are decoded in lockstep, one batched step for all of them.
const LOCKSTEP_PROMPTS: usize = 16;

/// A prompt of the group being decoded: its continuation so far, the rows each side last
/// produced, both sequences while it still runs.
struct Live<'r, 'c> {
    prompt_tokens: usize,
    max_new: usize,
    cont: Vec<u32>,
    last_r: Vec<f32>,
    last_c: Vec<f32>,
    seqs: Option<(
        Box<dyn crate::engine::Sequence + 'r>,
        Box<dyn crate::engine::Sequence + 'c>,
    )>,
    acc: Acc,
    first_divergence: Option<usize>,
}

pub struct ParityInputs<'a> {
    pub reference: &'a dyn Engine,
    pub candidate: &'a dyn Engine,
    pub reference_name: String,
    pub candidate_name: String,
    pub reference_bpw: f64,
    pub candidate_bpw: f64,
    pub tokenizer: Option<&'a SparkTokenizer>,
    pub prompts: &'a [Prompt],
    pub max_new_tokens: usize,
    /// Held-out token windows for perplexity.
    pub eval_windows: Vec<Vec<u32>>,
    pub policy: Policy,
    /// Where `policy` came from, for the report.
    pub policy_source: String,
    /// How the candidate's tokenizer differs from the reference's ([`tokenizer_difference`]);
    /// any difference fails parity: the same ids would print different text.
    pub tokenizer_difference: Option<String>,
}

/// The parts of a tokenizer.json that decide ids ↔ text.
const TOKENIZER_PARTS: [&str; 6] = [
    "model",
    "added_tokens",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
];

fn read_tokenizer_json(path: &Path) -> Result<serde_json::Value, ParityError> {
    let bad = |message: String| ParityError::Input {
        path: path.display().to_string(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))
}

/// id → token of a tokenizer.json (its model's vocab, then its added tokens).
fn id_table(t: &serde_json::Value) -> BTreeMap<u64, String> {
    let mut m = BTreeMap::new();
    if let Some(v) = t["model"]["vocab"].as_object() {
        for (tok, id) in v {
            if let Some(id) = id.as_u64() {
                m.insert(id, tok.clone());
            }
        }
    }
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(id), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) {
            m.insert(id, c.to_string());
        }
    }
    m
}

/// How `candidate`'s tokenizer differs from `reference`'s (`None`: they map ids and text alike).
/// Compared as parsed JSON, so formatting and key order do not matter; a differing id is named.
/// A candidate without a tokenizer while the reference has one differs too: `run --prompt`
/// could not read text with it.
pub fn tokenizer_difference(
    reference: Option<&Path>,
    candidate: Option<&Path>,
) -> Result<Option<String>, ParityError> {
    let (r, c) = match (reference, candidate) {
        (None, _) => return Ok(None),
        (Some(_), None) => {
            return Ok(Some(
                "the candidate has no tokenizer.json but the reference has one".into(),
            ))
        }
        (Some(r), Some(c)) => (read_tokenizer_json(r)?, read_tokenizer_json(c)?),
    };
    let (tr, tc) = (id_table(&r), id_table(&c));
    if let Some(id) = tr
        .keys()
        .chain(tc.keys())
        .find(|id| tr.get(id) != tc.get(id))
    {
        let show = |t: &BTreeMap<u64, String>| {
            t.get(id)
                .map(|s| format!("{s:?}"))
                .unwrap_or_else(|| "absent".into())
        };
        return Ok(Some(format!(
            "token id {id} is {} in the reference's tokenizer.json but {} in the candidate's",
            show(&tr),
            show(&tc)
        )));
    }
    for part in TOKENIZER_PARTS {
        if r.get(part) != c.get(part) {
            return Ok(Some(format!(
                "the candidate's tokenizer.json differs from the reference's in `{part}`"
            )));
        }
    }
    Ok(None)
}

pub fn run(
    inp: ParityInputs,
    mut on_prompt: impl FnMut(&PromptReport),
) -> Result<ParityReport, ParityError> {
    let (r, c) = (inp.reference, inp.candidate);
    if r.config().vocab_size != c.config().vocab_size {
        return Err(ParityError::Mismatch(format!(
            "vocabularies differ: reference {} vs candidate {}",
            r.config().vocab_size,
            c.config().vocab_size
        )));
    }
    let mut cmp = Comparison::new(r, c);
    let mut reports = Vec::new();
    let mut divergence_sum = 0usize;
    // Prompts run in groups whose continuations are decoded in lockstep: each step feeds every
    // unfinished prompt of the group at once (`Engine::step_many`), so a model reads its weights
    // once per step for all of them instead of once per prompt.
    let mut pi0 = 0;
    while pi0 < inp.prompts.len() {
        let group = &inp.prompts[pi0..(pi0 + LOCKSTEP_PROMPTS).min(inp.prompts.len())];
        let mut live = cmp.prefill(&inp, pi0, group)?;
        cmp.decode(pi0, &mut live)?;
        for (p, l) in group.iter().zip(live) {
            divergence_sum += l.first_divergence.unwrap_or(l.cont.len());
            let rep = l.report(p);
            on_prompt(&rep);
            reports.push(rep);
        }
        pi0 += group.len();
    }
    let ppl = if inp.eval_windows.is_empty() {
        (f64::NAN, f64::NAN)
    } else {
        (
            perplexity(r, &inp.eval_windows)?,
            perplexity(c, &inp.eval_windows)?,
        )
    };
    let overall = cmp.overall(&reports, divergence_sum, &inp.eval_windows, ppl);
    let gates = gates(&inp.policy, &overall);
    let mut failures = cmp.failures(&inp, &overall);
    failures.extend(failed(&gates));
    Ok(ParityReport {
        reference: inp.reference_name,
        candidate: inp.candidate_name,
        reference_bpw: inp.reference_bpw,
        candidate_bpw: inp.candidate_bpw,
        max_new_tokens: inp.max_new_tokens,
        prompts: reports,
        passed: failures.is_empty(),
        failures,
        gates,
        policy_source: inp.policy_source,
        policy: inp.policy,
        overall,
    })
}

/// The two engines compared and what the comparison of their rows has accumulated over all
/// prompts so far.
struct Comparison<'a> {
    r: &'a dyn Engine,
    c: &'a dyn Engine,
    vocab: usize,
    stop_ids: Vec<u32>,
    all: Acc,
    bad_ref: usize,
    bad_cand: usize,
    /// (prompt index, position) of the first non-finite row, in prompt order.
    first_bad: Option<(usize, usize)>,
}

impl<'a> Comparison<'a> {
    fn new(r: &'a dyn Engine, c: &'a dyn Engine) -> Self {
        Comparison {
            r,
            c,
            vocab: r.config().vocab_size,
            stop_ids: r.config().eos_token_ids.clone(),
            all: Acc::default(),
            bad_ref: 0,
            bad_cand: 0,
            first_bad: None,
        }
    }

    /// Count row `s` (prompt `pi`, position `pos`) into the prompt's `acc` and the overall one.
    fn record(&mut self, pi: usize, pos: usize, s: &RowStats, acc: &mut Acc) {
        let (fa, fb) = s.finite;
        self.bad_ref += usize::from(!fa);
        self.bad_cand += usize::from(!fb);
        if !(fa && fb) && self.first_bad.is_none_or(|f| (pi, pos) < f) {
            self.first_bad = Some((pi, pos));
        }
        acc.add(s);
        self.all.add(s);
    }

    /// Prefill each prompt of `group` (the first is prompt `pi0`) on both engines and compare
    /// the prompt's rows.
    fn prefill(
        &mut self,
        inp: &ParityInputs,
        pi0: usize,
        group: &[Prompt],
    ) -> Result<Vec<Live<'a, 'a>>, ParityError> {
        let (r, c, vocab) = (self.r, self.c, self.vocab);
        let mut live = Vec::new();
        let mut kv_bytes = 0u128;
        for (gi, p) in group.iter().enumerate() {
            let ids = encode(inp.tokenizer, p)?;
            let mut opts = GenerateOptions {
                max_new_tokens: inp.max_new_tokens,
                ignore_eos: false,
                stop_ids: self.stop_ids.clone(),
                sampling: None,
                context: None,
                capture_logits: true,
            };
            // Both sides get the same bound and hold the same rows of logits; a clamp is applied
            // alike, so its warning is not needed.
            for engine in [r, c] {
                crate::generate::plan(engine, ids.len(), &mut opts)?;
            }
            let context = ids.len() + opts.max_new_tokens;
            kv_bytes += r.sequence_bytes(context) + c.sequence_bytes(context);
            crate::resources::check_fits(
                &format!("the KV caches of {} prompts decoded together", gi + 1),
                kv_bytes,
                crate::setting::Setting::MaxNewTokens,
            )
            .map_err(crate::generate::BudgetError::from)?;
            // The prompt's rows from one prefill of each; the last predicts the first new token,
            // which exists unless nothing is generated (the last token predicts nothing we have).
            let (mut rs, mut cs) = (r.start(context)?, c.start(context)?);
            let lr = rs.forward(&ids, Logits::All)?;
            let lc = cs.forward(&ids, Logits::All)?;
            let rows = if opts.max_new_tokens > 0 {
                ids.len()
            } else {
                (ids.len() - 1).max(1)
            };
            let mut acc = Acc::default();
            for (pos, st) in RowStats::of_rows(&lr, &lc, vocab, rows).iter().enumerate() {
                self.record(pi0 + gi, pos, st, &mut acc);
            }
            live.push(Live {
                prompt_tokens: ids.len(),
                max_new: opts.max_new_tokens,
                cont: Vec::new(),
                last_r: lr[lr.len() - vocab..].to_vec(),
                last_c: lc[lc.len() - vocab..].to_vec(),
                // Nothing to generate: the prompt's rows were all there is.
                seqs: (opts.max_new_tokens > 0).then_some((rs, cs)),
                acc,
                first_divergence: None,
            });
        }
        Ok(live)
    }

    /// Decode the continuations of `live` (prompts `pi0..`) in lockstep and compare each row.
    ///
    /// The reference decodes greedily; the candidate is forced along the same tokens through
    /// the same path (its decode steps), so each of its rows is exactly what its own greedy
    /// decode would see after the shared prefix: its greedy choices need no second
    /// generation, and an identical artifact matches bit for bit.
    fn decode(&mut self, pi0: usize, live: &mut [Live<'a, 'a>]) -> Result<(), ParityError> {
        let vocab = self.vocab;
        loop {
            let mut feed = Vec::new();
            for (i, l) in live.iter_mut().enumerate() {
                if l.seqs.is_none() {
                    continue;
                }
                let next = crate::sampling::argmax(&l.last_r);
                // Greedy diverges at the first continuation token the candidate would not choose.
                if l.first_divergence.is_none() && crate::sampling::argmax(&l.last_c) != next {
                    l.first_divergence = Some(l.cont.len());
                }
                l.cont.push(next);
                if self.stop_ids.contains(&next) || l.cont.len() >= l.max_new {
                    l.seqs = None;
                } else {
                    feed.push(i);
                }
            }
            if feed.is_empty() {
                return Ok(());
            }
            let tokens: Vec<u32> = feed
                .iter()
                .map(|&i| *live[i].cont.last().unwrap())
                .collect();
            let (mut rb, mut cb): (Vec<_>, Vec<_>) = feed
                .iter()
                .map(|&i| live[i].seqs.take().expect("fed sequences are live"))
                .unzip();
            let rows_r = self.r.step_many(&mut rb, &tokens)?;
            let rows_c = self.c.step_many(&mut cb, &tokens)?;
            let stats = RowStats::of_rows(&rows_r, &rows_c, vocab, feed.len());
            for (j, ((&i, seqs), st)) in feed
                .iter()
                .zip(rb.into_iter().zip(cb))
                .zip(&stats)
                .enumerate()
            {
                let l = &mut live[i];
                l.seqs = Some(seqs);
                let pos = l.prompt_tokens + l.cont.len() - 1;
                self.record(pi0 + i, pos, st, &mut l.acc);
                l.last_r
                    .copy_from_slice(&rows_r[j * vocab..(j + 1) * vocab]);
                l.last_c
                    .copy_from_slice(&rows_c[j * vocab..(j + 1) * vocab]);
            }
        }
    }

    /// The figures over every position of every prompt; `ppl` is (reference, candidate).
    fn overall(
        &self,
        reports: &[PromptReport],
        divergence_sum: usize,
        eval_windows: &[Vec<u32>],
        (ppl_reference, ppl_candidate): (f64, f64),
    ) -> Overall {
        let all = &self.all;
        let n = all.n().max(1) as f64;
        let mut kls = all.kls.clone();
        kls.sort_by(|a, b| a.total_cmp(b));
        let p99 = kls
            .get(((kls.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0);
        Overall {
            greedy_identical: reports.iter().filter(|p| p.greedy_identical).count(),
            prompts: reports.len(),
            mean_tokens_to_divergence: divergence_sum as f64 / reports.len().max(1) as f64,
            positions: all.n(),
            top1: all.top1 as f64 / n,
            top5: all.top5 as f64 / (5.0 * n),
            kl_mean: all.kls.iter().sum::<f64>() / n,
            kl_p99: p99,
            kl_max: kls.last().copied().unwrap_or(0.0),
            max_abs_dlogit: all.max_abs,
            snr_db: all.snr_db(),
            eval_tokens: eval_windows.iter().map(|w| w.len()).sum(),
            ppl_reference,
            ppl_candidate,
            ppl_ratio: ppl_candidate / ppl_reference,
            non_finite_reference: self.bad_ref,
            non_finite_candidate: self.bad_cand,
        }
    }

    /// What fails parity whatever the policy: a tokenizer mismatch, non-finite logits or
    /// perplexity (the policy's gates follow).
    fn failures(&self, inp: &ParityInputs, overall: &Overall) -> Vec<String> {
        let (bad_ref, bad_cand) = (self.bad_ref, self.bad_cand);
        let mut failures = Vec::new();
        if let Some(d) = &inp.tokenizer_difference {
            failures.push(format!("tokenizer mismatch: {d}"));
        }
        if let Some((pi, pos)) = self.first_bad {
            let prompt = &inp.prompts[pi].name;
            failures.push(format!(
                "non-finite logits (NaN/Inf) at {bad_cand} candidate and {bad_ref} reference positions, \
                 first in prompt `{prompt}` at position {pos}: the artifact is broken"
            ));
        }
        let (ppl_reference, ppl_candidate) = (overall.ppl_reference, overall.ppl_candidate);
        let ppl_finite = ppl_candidate.is_finite() && ppl_reference.is_finite();
        if !inp.eval_windows.is_empty() && !ppl_finite {
            failures.push(format!(
                "perplexity is not finite (reference {ppl_reference}, candidate {ppl_candidate})"
            ));
        }
        failures
    }
}

impl Live<'_, '_> {
    /// The figures of one finished prompt.
    fn report(self, p: &Prompt) -> PromptReport {
        let acc = self.acc;
        let n = acc.n().max(1) as f64;
        PromptReport {
            name: p.name.clone(),
            prompt_tokens: self.prompt_tokens,
            greedy_identical: self.first_divergence.is_none(),
            first_divergence: self.first_divergence,
            positions: acc.n(),
            top1: acc.top1 as f64 / n,
            top5: acc.top5 as f64 / (5.0 * n),
            kl_mean: acc.kls.iter().sum::<f64>() / n,
            kl_max: acc.kls.iter().fold(0f64, |m, v| m.max(*v)),
            max_abs_dlogit: acc.max_abs,
            snr_db: acc.snr_db(),
            kl_per_position: acc.kls.clone(),
        }
    }
}

/// One threshold of a policy against its figure.
#[derive(Debug, Clone, Serialize)]
pub struct Gate {
    pub name: &'static str,
    pub figure: f64,
    pub limit: f64,
    /// `figure >= limit` passes (else `figure <= limit`).
    pub at_least: bool,
    /// How far inside its limit the figure is, as a fraction of the limit's distance from the
    /// figure's ideal (1 for fractions and the perplexity ratio, 0 for KL; the limit itself for
    /// SNR in dB, which has none): 0 on the limit, 1 at the ideal, negative outside.
    pub headroom: f64,
    pub passed: bool,
}

/// Every threshold the policy sets, with its figure and headroom.
pub fn gates(p: &Policy, o: &Overall) -> Vec<Gate> {
    let greedy = o.greedy_identical as f64 / o.prompts.max(1) as f64;
    // (name, figure, limit, at_least, ideal; None = measured against the limit's own size)
    type Row = (&'static str, f64, Option<f64>, bool, Option<f64>);
    let all: [Row; 7] = [
        ("greedy match", greedy, p.min_greedy_match, true, Some(1.0)),
        ("top-1", o.top1, p.min_top1, true, Some(1.0)),
        ("top-5 overlap", o.top5, p.min_top5, true, Some(1.0)),
        ("logits SNR dB", o.snr_db, p.min_snr_db, true, None),
        ("KL mean", o.kl_mean, p.max_kl_mean, false, Some(0.0)),
        ("KL p99", o.kl_p99, p.max_kl_p99, false, Some(0.0)),
        (
            "perplexity ratio",
            o.ppl_ratio,
            p.max_ppl_ratio,
            false,
            Some(1.0),
        ),
    ];
    all.into_iter()
        .filter_map(|(name, figure, limit, at_least, ideal)| {
            let limit = limit?;
            let passed = if at_least {
                figure >= limit
            } else {
                figure <= limit
            };
            let scale = ideal.map_or(limit.abs(), |i| (i - limit).abs());
            let inside = if at_least {
                figure - limit
            } else {
                limit - figure
            };
            let headroom = match (figure.is_nan(), scale > 0.0) {
                (true, _) => f64::NEG_INFINITY,
                (false, true) => inside / scale,
                // A limit at the ideal: on it is all the room there is.
                (false, false) if inside >= 0.0 => 0.0,
                (false, false) => f64::NEG_INFINITY,
            };
            Some(Gate {
                name,
                figure,
                limit,
                at_least,
                headroom,
                passed,
            })
        })
        .collect()
}

pub fn check(p: &Policy, o: &Overall) -> Vec<String> {
    failed(&gates(p, o))
}

/// Why the failed ones among `gates` failed.
fn failed(gates: &[Gate]) -> Vec<String> {
    gates
        .iter()
        .filter(|g| !g.passed)
        .map(|g| {
            let op = if g.at_least { "<" } else { ">" };
            format!("{} {:.4} {op} {}", g.name, g.figure, g.limit)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{gates, Overall, Policy};

    /// Headroom is the share of the limit's distance from the ideal that the figure has left:
    /// 0 on the limit, 1 at the ideal, negative (and failed) outside; NaN fails.
    #[test]
    fn gates_measure_headroom_from_the_ideal() {
        let o = Overall {
            greedy_identical: 3,
            prompts: 4,
            top1: 0.96,
            top5: 0.5,
            kl_mean: 0.008,
            kl_p99: f64::NAN,
            snr_db: 24.0,
            ppl_ratio: 0.99,
            ..Default::default()
        };
        let p = Policy {
            min_greedy_match: Some(0.5),
            min_top1: Some(0.92),
            min_top5: Some(0.6),
            max_kl_mean: Some(0.01),
            max_kl_p99: Some(0.1),
            min_snr_db: Some(20.0),
            max_ppl_ratio: Some(1.05),
        };
        let g = gates(&p, &o);
        let h = |name: &str| g.iter().find(|g| g.name == name).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(h("greedy match").headroom, 0.5));
        assert!(close(h("top-1").headroom, 0.5));
        assert!(close(h("KL mean").headroom, 0.2));
        assert!(close(h("logits SNR dB").headroom, 0.2));
        // Better than the reference: more than all the room.
        assert!(h("perplexity ratio").headroom > 1.0 && h("perplexity ratio").passed);
        assert!(!h("top-5 overlap").passed && h("top-5 overlap").headroom < 0.0);
        assert!(!h("KL p99").passed && h("KL p99").headroom == f64::NEG_INFINITY);
        assert_eq!(super::check(&p, &o).len(), 2);
        // Unset thresholds are not gates.
        assert!(gates(&Policy::default(), &o).is_empty());
    }

    /// The one-pass top-k against sorting every index (value descending, lower index first).
    #[test]
    fn top_k_is_the_head_of_the_full_sort() {
        let sorted = |x: &[f32], k: usize| {
            let mut idx: Vec<usize> = (0..x.len()).collect();
            idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
            idx.truncate(k);
            idx
        };
        let mut seed = 11u64;
        for case in 0..200 {
            let n = 1 + case % 40;
            let x: Vec<f32> = (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    // Few distinct values: many ties; now and then ±inf, −0 and NaN.
                    match (seed >> 33) % 23 {
                        0 => f32::INFINITY,
                        1 => f32::NEG_INFINITY,
                        2 => -0.0,
                        3 => f32::NAN,
                        v => (v % 7) as f32 - 3.0,
                    }
                })
                .collect();
            for k in [1, 5, n + 2] {
                assert_eq!(super::top_k(&x, k), sorted(&x, k), "{x:?} k={k}");
            }
        }
    }

    #[test]
    fn tokenizers_compare_by_content_and_name_the_differing_id() {
        let d = tempfile::tempdir().unwrap();
        let write = |name: &str, v: &serde_json::Value, pretty: bool| {
            let p = d.path().join(name);
            let text = if pretty {
                serde_json::to_string_pretty(v).unwrap()
            } else {
                serde_json::to_string(v).unwrap()
            };
            std::fs::write(&p, text).unwrap();
            p
        };
        let base = serde_json::json!({
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
            "added_tokens": [{"id": 2, "content": "<eos>"}],
            "decoder": null,
        });
        let r = write("r.json", &base, false);
        // Formatting is not content.
        let same = write("same.json", &base, true);
        assert!(tokenizer_difference(Some(&r), Some(&same))
            .unwrap()
            .is_none());
        let mut swapped = base.clone();
        swapped["model"]["vocab"] = serde_json::json!({"a": 1, "b": 0});
        let c = write("c.json", &swapped, false);
        let why = tokenizer_difference(Some(&r), Some(&c)).unwrap().unwrap();
        assert!(why.contains("token id 0"), "{why}");
        let mut added = base.clone();
        added["added_tokens"][0]["content"] = "<end>".into();
        let c = write("a.json", &added, false);
        let why = tokenizer_difference(Some(&r), Some(&c)).unwrap().unwrap();
        assert!(why.contains("token id 2") && why.contains("<end>"), "{why}");
        let mut merges = base.clone();
        merges["model"]["merges"] = serde_json::json!(["a b"]);
        let c = write("m.json", &merges, false);
        let why = tokenizer_difference(Some(&r), Some(&c)).unwrap().unwrap();
        assert!(why.contains("`model`"), "{why}");
        assert!(tokenizer_difference(Some(&r), None).unwrap().is_some());
        assert!(tokenizer_difference(None, Some(&r)).unwrap().is_none());
    }

    #[test]
    fn policies_are_checked_key_by_key() {
        let d = tempfile::tempdir().unwrap();
        for (text, want) in [
            (r#"{"max_kl_mean": -1}"#, "max_kl_mean"),
            (r#"{"min_top1": "x"}"#, "min_top1"),
            (r#"{"min_top5": 2}"#, "min_top5"),
            (r#"{"nope": 1}"#, "nope"),
        ] {
            let p = d.path().join("p.json");
            std::fs::write(&p, text).unwrap();
            let e = Policy::from_file(&p).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("p.json"), "{text}: {e}");
        }
        let p = d.path().join("ok.json");
        std::fs::write(
            &p,
            r#"{"min_snr_db": -3, "max_kl_mean": 0.05, "min_top1": null}"#,
        )
        .unwrap();
        let ok = Policy::from_file(&p).unwrap();
        assert_eq!(ok.min_snr_db, Some(-3.0));
    }

    use super::*;

    #[test]
    fn identical_logits_are_perfect() {
        let mut a = Acc::default();
        let r = [1.0f32, 2.0, -1.0, 0.5, 3.0, 0.0];
        a.add(&RowStats::of(&r, &r));
        assert_eq!((a.top1, a.top5), (1, 5));
        assert!(a.kls[0].abs() < 1e-12 && a.snr_db().is_infinite());
    }

    #[test]
    fn kl_matches_a_hand_computation() {
        let mut a = Acc::default();
        a.add(&RowStats::of(&[0.0, 0.0], &[0.0, (3f32).ln()]));
        // p = (.5,.5), q = (.25,.75): KL = .5 ln 2 + .5 ln(2/3)
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((a.kls[0] - want).abs() < 1e-6);
    }

    #[test]
    fn policy_failures_name_the_metric() {
        let o = Overall {
            greedy_identical: 5,
            prompts: 10,
            mean_tokens_to_divergence: 3.0,
            positions: 100,
            top1: 0.9,
            top5: 0.95,
            kl_mean: 0.02,
            kl_p99: 0.3,
            kl_max: 1.0,
            max_abs_dlogit: 2.0,
            snr_db: 20.0,
            eval_tokens: 10,
            ppl_reference: 2.0,
            ppl_candidate: 2.2,
            ppl_ratio: 1.1,
            non_finite_reference: 0,
            non_finite_candidate: 0,
        };
        let p = Policy {
            min_greedy_match: Some(0.6),
            max_kl_mean: Some(0.05),
            max_ppl_ratio: Some(1.05),
            ..Default::default()
        };
        let f = check(&p, &o);
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(f[0].starts_with("greedy match") && f[1].starts_with("perplexity ratio"));
    }
}
