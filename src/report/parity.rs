//! The parity report as a page (`parity --html`) and as a CI step summary (`parity --markdown`):
//! the verdict and policy first, then the overall and per-prompt figures, where along each
//! prompt the candidate drifts, and the change against a previous run (`--baseline`).

use std::fmt::Write as _;
use std::path::Path;

use maud::{html, Markup};
use serde::Deserialize;

use super::page::{self, Cell};
use super::plots::{self, Axis, Bar, BarChart, Bars, Line, LineChart, Marker};
use super::ReportError;
use crate::parity::{self, Overall, ParityReport, Policy, Verdict};

/// KL below this is drawn on the axis floor: a KL of 0 (identical logits) has no logarithm, and
/// f32 logits put the noise of an identical artifact around 1e-10.
pub const KL_FLOOR: f64 = 1e-8;
/// Prompts with fewer teacher-forced positions have no "along the prompt" to show (their figures
/// are in the table).
pub const MIN_TRACE_POSITIONS: usize = 16;
/// At most this many per-position charts: past it the page stops being glanceable.
pub const MAX_TRACES: usize = 40;
/// GitHub caps a step summary at 1 MiB; rows past this are left out with a note.
pub const MAX_MARKDOWN_PROMPTS: usize = 500;
const MAX_NAME_CHARS: usize = 80;

/// A previous `parity --json` report, as `--baseline` reads it: the fields the comparison needs.
/// Floats are optional because JSON has no NaN or infinity (serde writes them as null).
#[derive(Debug, Clone, Deserialize)]
pub struct Baseline {
    #[serde(default)]
    pub candidate: String,
    pub passed: bool,
    pub overall: BaselineOverall,
    pub prompts: Vec<BaselinePrompt>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct BaselineOverall {
    pub greedy_identical: usize,
    pub prompts: usize,
    pub top1: Option<f64>,
    pub top5: Option<f64>,
    pub kl_mean: Option<f64>,
    pub kl_p99: Option<f64>,
    pub kl_max: Option<f64>,
    pub max_abs_dlogit: Option<f64>,
    pub snr_db: Option<f64>,
    pub ppl_ratio: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct BaselinePrompt {
    pub name: String,
    pub kl_mean: Option<f64>,
    pub top1: Option<f64>,
}

impl Baseline {
    /// Read a previous `parity --json` output; the error names the file and what was expected.
    pub fn read(path: &Path) -> Result<Self, ReportError> {
        super::read_json(
            path,
            "a previous `parity --json` report ({\"passed\", \"overall\": {\"top1\", \"kl_mean\", …}, \
             \"prompts\": [{\"name\", \"kl_mean\", …}]})",
        )
    }
}

/// One figure compared across runs.
struct Metric {
    name: &'static str,
    higher_is_better: bool,
    now: fn(&Overall) -> f64,
    before: fn(&BaselineOverall) -> Option<f64>,
}

fn greedy_fraction(identical: usize, prompts: usize) -> f64 {
    identical as f64 / prompts.max(1) as f64
}

const METRICS: [Metric; 9] = [
    Metric {
        name: "greedy identical (fraction of prompts)",
        higher_is_better: true,
        now: |o| greedy_fraction(o.greedy_identical, o.prompts),
        before: |o| Some(greedy_fraction(o.greedy_identical, o.prompts)),
    },
    Metric {
        name: "top-1 agreement",
        higher_is_better: true,
        now: |o| o.top1,
        before: |o| o.top1,
    },
    Metric {
        name: "top-5 overlap",
        higher_is_better: true,
        now: |o| o.top5,
        before: |o| o.top5,
    },
    Metric {
        name: "KL mean",
        higher_is_better: false,
        now: |o| o.kl_mean,
        before: |o| o.kl_mean,
    },
    Metric {
        name: "KL p99",
        higher_is_better: false,
        now: |o| o.kl_p99,
        before: |o| o.kl_p99,
    },
    Metric {
        name: "KL max",
        higher_is_better: false,
        now: |o| o.kl_max,
        before: |o| o.kl_max,
    },
    Metric {
        name: "max |Δlogit|",
        higher_is_better: false,
        now: |o| o.max_abs_dlogit,
        before: |o| o.max_abs_dlogit,
    },
    Metric {
        name: "logits SNR dB",
        higher_is_better: true,
        now: |o| o.snr_db,
        before: |o| o.snr_db,
    },
    Metric {
        name: "perplexity ratio",
        higher_is_better: false,
        now: |o| o.ppl_ratio,
        before: |o| o.ppl_ratio,
    },
];

/// One figure of this run against the baseline's.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub metric: &'static str,
    pub before: Option<f64>,
    pub now: f64,
    /// `now − before`, when both are finite.
    pub delta: Option<f64>,
    /// Whether the change is an improvement (`None`: unchanged or not comparable).
    pub better: Option<bool>,
}

pub fn changes(r: &ParityReport, b: &Baseline) -> Vec<Change> {
    METRICS
        .iter()
        .map(|m| {
            let (now, before) = ((m.now)(&r.overall), (m.before)(&b.overall));
            // A baseline figure read back from JSON may differ from the same figure in its last
            // bit (serde_json parses without `float_roundtrip`): that is no change.
            let delta = before
                .filter(|b| b.is_finite() && now.is_finite())
                .map(|b| now - b)
                .map(|d| {
                    if d.abs() <= 1e-12 * now.abs().max(1.0) {
                        0.0
                    } else {
                        d
                    }
                });
            Change {
                metric: m.name,
                before,
                now,
                delta,
                better: delta
                    .filter(|d| *d != 0.0)
                    .map(|d| (d > 0.0) == m.higher_is_better),
            }
        })
        .collect()
}

/// One threshold of the policy with what was measured.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRow {
    pub key: &'static str,
    pub threshold: f64,
    pub measured: f64,
    pub ok: bool,
}

/// The thresholds set, each judged by `parity::check` alone so the page agrees with the verdict.
pub fn policy_rows(r: &ParityReport) -> Vec<PolicyRow> {
    let (p, o) = (&r.policy, &r.overall);
    let none = Policy::default;
    let rows = [
        (
            "min_greedy_match",
            p.min_greedy_match,
            greedy_fraction(o.greedy_identical, o.prompts),
            Policy {
                min_greedy_match: p.min_greedy_match,
                ..none()
            },
        ),
        (
            "min_top1",
            p.min_top1,
            o.top1,
            Policy {
                min_top1: p.min_top1,
                ..none()
            },
        ),
        (
            "min_top5",
            p.min_top5,
            o.top5,
            Policy {
                min_top5: p.min_top5,
                ..none()
            },
        ),
        (
            "max_kl_mean",
            p.max_kl_mean,
            o.kl_mean,
            Policy {
                max_kl_mean: p.max_kl_mean,
                ..none()
            },
        ),
        (
            "max_kl_p99",
            p.max_kl_p99,
            o.kl_p99,
            Policy {
                max_kl_p99: p.max_kl_p99,
                ..none()
            },
        ),
        (
            "min_snr_db",
            p.min_snr_db,
            o.snr_db,
            Policy {
                min_snr_db: p.min_snr_db,
                ..none()
            },
        ),
        (
            "max_ppl_ratio",
            p.max_ppl_ratio,
            o.ppl_ratio,
            Policy {
                max_ppl_ratio: p.max_ppl_ratio,
                ..none()
            },
        ),
    ];
    rows.into_iter()
        .filter_map(|(key, threshold, measured, alone)| {
            threshold.map(|threshold| PolicyRow {
                key,
                threshold,
                measured,
                ok: parity::check(&alone, o).is_empty(),
            })
        })
        .collect()
}

/// The per-position KL of one prompt, as plotted.
#[derive(Debug, Clone, PartialEq)]
pub struct KlTrace<'a> {
    pub prompt: &'a str,
    /// The position that predicts the first generated token.
    pub generation_starts: usize,
    /// The position that predicts the first generated token that differs (greedy divergence).
    pub divergence: Option<usize>,
    pub kl: &'a [f64],
}

/// The prompts whose KL is plotted position by position (at least [`MIN_TRACE_POSITIONS`],
/// at most [`MAX_TRACES`] of them, in report order).
pub fn kl_traces(r: &ParityReport) -> Vec<KlTrace<'_>> {
    r.prompts
        .iter()
        .filter(|p| p.kl_per_position.len() >= MIN_TRACE_POSITIONS)
        .take(MAX_TRACES)
        .map(|p| {
            let start = p.prompt_tokens.saturating_sub(1);
            KlTrace {
                prompt: &p.name,
                generation_starts: start,
                divergence: p.first_divergence.map(|i| start + i),
                kl: &p.kl_per_position,
            }
        })
        .collect()
}

/// How KL is spread over all teacher-forced positions of all prompts: counts per decade.
#[derive(Debug, Clone, PartialEq)]
pub struct KlHistogram {
    /// Positions with KL below [`KL_FLOOR`] (including exactly 0).
    pub below_floor: usize,
    /// `counts[i]`: positions with KL in [10^(e0+i), 10^(e0+i+1)), e0 = log10(KL_FLOOR).
    pub counts: Vec<usize>,
}

pub fn kl_histogram(r: &ParityReport) -> KlHistogram {
    let e0 = KL_FLOOR.log10().round() as i32;
    let mut h = KlHistogram {
        below_floor: 0,
        counts: Vec::new(),
    };
    for &kl in r.prompts.iter().flat_map(|p| &p.kl_per_position) {
        // NaN cannot occur (KL is clamped at 0 with f64::max), and would count as identical.
        if kl.is_nan() || kl < KL_FLOOR {
            h.below_floor += 1;
            continue;
        }
        let i = (kl.log10().floor() as i32 - e0).max(0) as usize;
        if h.counts.len() <= i {
            h.counts.resize(i + 1, 0);
        }
        h.counts[i] += 1;
    }
    h
}

/// The one-line verdict both the page and the summary lead with.
pub fn verdict_line(r: &ParityReport) -> String {
    let o = &r.overall;
    let figures = format!(
        "greedy identical {}/{}, top-1 {:.4}, KL mean {}",
        o.greedy_identical,
        o.prompts,
        o.top1,
        page::sci(o.kl_mean)
    );
    match r.verdict() {
        Verdict::Pass => format!(
            "PASS: {} tracks {} within policy ({figures})",
            r.candidate, r.reference
        ),
        Verdict::NotGated => format!(
            "NOT GATED: {} against {}, no threshold checked ({figures})",
            r.candidate, r.reference
        ),
        Verdict::Drift => format!(
            "DRIFT: {} against {}: {}",
            r.candidate,
            r.reference,
            r.failures.join("; ")
        ),
    }
}

fn greedy_cell(p: &parity::PromptReport) -> String {
    match p.first_divergence {
        None => "identical".into(),
        Some(i) => format!("diverges at token {i}"),
    }
}

fn overall_rows(r: &ParityReport) -> Vec<(&'static str, String)> {
    let o = &r.overall;
    vec![
        (
            "greedy identical",
            format!(
                "{}/{} prompts (mean {:.1} tokens to divergence)",
                o.greedy_identical, o.prompts, o.mean_tokens_to_divergence
            ),
        ),
        ("top-1 agreement", page::fixed(o.top1, 4)),
        ("top-5 overlap", page::fixed(o.top5, 4)),
        (
            "KL mean / p99 / max",
            format!(
                "{} / {} / {}",
                page::sci(o.kl_mean),
                page::sci(o.kl_p99),
                page::sci(o.kl_max)
            ),
        ),
        ("max |Δlogit|", page::fixed(o.max_abs_dlogit, 3)),
        ("logits SNR", format!("{} dB", page::fixed(o.snr_db, 1))),
        ("teacher-forced positions", o.positions.to_string()),
        (
            "perplexity (reference → candidate)",
            format!(
                "{} → {} (ratio {}) on {} held-out tokens",
                page::fixed(o.ppl_reference, 4),
                page::fixed(o.ppl_candidate, 4),
                page::fixed(o.ppl_ratio, 4),
                o.eval_tokens
            ),
        ),
        (
            "bits per weight (reference → candidate)",
            format!(
                "{} → {}",
                page::fixed(r.reference_bpw, 3),
                page::fixed(r.candidate_bpw, 3)
            ),
        ),
        (
            "non-finite logits (reference / candidate positions)",
            format!("{} / {}", o.non_finite_reference, o.non_finite_candidate),
        ),
    ]
}

fn agreement_chart(r: &ParityReport) -> Result<plots::Svg, ReportError> {
    let mut categories: Vec<String> = r.prompts.iter().map(|p| p.name.clone()).collect();
    categories.push("all positions".into());
    let top1 = r.prompts.iter().map(|p| p.top1).chain([r.overall.top1]);
    let top5 = r.prompts.iter().map(|p| p.top5).chain([r.overall.top5]);
    plots::bar_chart(&BarChart {
        title: "Top-1 agreement and top-5 overlap per prompt",
        value_desc: "fraction of positions",
        axis: Axis::Linear(Some((0.0, 1.0))),
        categories: &categories,
        series: &[
            Bars {
                label: "top-1".into(),
                values: top1.map(|v| Some(Bar::from(v))).collect(),
            },
            Bars {
                label: "top-5".into(),
                values: top5.map(|v| Some(Bar::from(v))).collect(),
            },
        ],
        horizontal: true,
        width: 1100,
    })
}

fn histogram_chart(h: &KlHistogram) -> Result<plots::Svg, ReportError> {
    let e0 = KL_FLOOR.log10().round() as i32;
    let mut categories = vec![format!("<1e{e0}")];
    categories.extend((0..h.counts.len()).map(|i| format!("1e{}", e0 + i as i32)));
    let values = std::iter::once(h.below_floor)
        .chain(h.counts.iter().copied())
        .map(|c| Some(Bar::from(c as f64)))
        .collect();
    plots::bar_chart(&BarChart {
        title: "KL(reference ‖ candidate) over all positions",
        value_desc: "positions",
        axis: Axis::Linear(None),
        categories: &categories,
        series: &[Bars {
            label: "positions".into(),
            values,
        }],
        horizontal: false,
        width: 1100,
    })
}

fn trace_chart(t: &KlTrace) -> Result<plots::Svg, ReportError> {
    let line = Line {
        label: "KL".into(),
        points: t
            .kl
            .iter()
            .enumerate()
            .map(|(i, v)| (i as f64, *v))
            .collect(),
    };
    let mut markers = vec![Marker {
        label: "generation starts".into(),
        x: t.generation_starts as f64,
    }];
    if let Some(d) = t.divergence {
        markers.push(Marker {
            label: "greedy diverges".into(),
            x: d as f64,
        });
    }
    plots::line_chart(&LineChart {
        title: t.prompt,
        x_desc: "position",
        y_desc: "KL (log)",
        y: Axis::Log { floor: KL_FLOOR },
        lines: &[line],
        markers: &markers,
        size: (540, 240),
    })
}

fn baseline_section(r: &ParityReport, b: &Baseline) -> Result<Markup, ReportError> {
    let rows = changes(r, b).into_iter().map(|c| {
        vec![
            Cell::from(c.metric),
            Cell::Num(c.before.map_or("–".into(), fmt_metric)),
            Cell::Num(fmt_metric(c.now)),
            Cell::Num(c.delta.map_or("–".into(), |d| format!("{d:+.3e}"))),
            match c.better {
                Some(true) => Cell::Html(html! { span.ok { "better" } }),
                Some(false) => Cell::Html(html! { span.bad { "worse" } }),
                None => Cell::from("same"),
            },
        ]
    });
    let categories: Vec<String> = r.prompts.iter().map(|p| p.name.clone()).collect();
    let before = r
        .prompts
        .iter()
        .map(|p| {
            b.prompts
                .iter()
                .find(|q| q.name == p.name)
                .and_then(|q| q.kl_mean)
                .map(Bar::from)
        })
        .collect();
    let now = r
        .prompts
        .iter()
        .map(|p| Some(Bar::from(p.kl_mean)))
        .collect();
    let chart = plots::bar_chart(&BarChart {
        title: "KL mean per prompt: baseline and this run",
        value_desc: "KL mean (log)",
        axis: Axis::Log { floor: KL_FLOOR },
        categories: &categories,
        series: &[
            Bars {
                label: "baseline".into(),
                values: before,
            },
            Bars {
                label: "this run".into(),
                values: now,
            },
        ],
        horizontal: true,
        width: 1100,
    })?;
    Ok(html! {
        h2 { "Change against the baseline" }
        p.note {
            "Baseline: " (b.candidate) " (" (if b.passed { "passed" } else { "drifted" }) "). "
            "Prompts missing from the baseline have no baseline bar."
        }
        (page::table(&["metric", "baseline", "this run", "change", ""], rows))
        (page::figure(&chart, ""))
    })
}

fn fmt_metric(v: f64) -> String {
    if v.is_finite() && v.abs() >= 0.01 {
        format!("{v:.4}")
    } else {
        page::sci(v)
    }
}

/// The page of `parity --html`.
pub fn html(r: &ParityReport, baseline: Option<&Baseline>) -> Result<String, ReportError> {
    let policy = policy_rows(r);
    let traces = kl_traces(r);
    let trace_svgs = traces
        .iter()
        .map(trace_chart)
        .collect::<Result<Vec<_>, _>>()?;
    let agreement = agreement_chart(r)?;
    let histogram = histogram_chart(&kl_histogram(r))?;
    let base = baseline.map(|b| baseline_section(r, b)).transpose()?;
    let (class, headline) = match r.verdict() {
        Verdict::Pass => ("pass", "PASS: the candidate is within policy".to_string()),
        Verdict::NotGated => (
            "ungated",
            "NOT GATED: no threshold was checked (--policy none)".to_string(),
        ),
        Verdict::Drift => (
            "fail",
            format!("DRIFT: {} check(s) failed", r.failures.len()),
        ),
    };
    let prompt_rows = r.prompts.iter().map(|p| {
        vec![
            Cell::from(p.name.as_str()),
            Cell::Num(p.prompt_tokens.to_string()),
            Cell::from(greedy_cell(p)),
            Cell::Num(page::fixed(p.top1, 3)),
            Cell::Num(page::fixed(p.top5, 3)),
            Cell::Num(page::sci(p.kl_mean)),
            Cell::Num(page::sci(p.kl_max)),
            Cell::Num(page::fixed(p.max_abs_dlogit, 3)),
            Cell::Num(page::fixed(p.snr_db, 1)),
        ]
    });
    let left_out = r
        .prompts
        .iter()
        .filter(|p| p.kl_per_position.len() >= MIN_TRACE_POSITIONS)
        .count()
        - traces.len();
    let body = html! {
        (page::verdict(class, &headline, &r.failures))
        p {
            "Candidate " code { (r.candidate) } " (" (page::fixed(r.candidate_bpw, 3)) " bits/weight) against reference "
            code { (r.reference) } " (" (page::fixed(r.reference_bpw, 3)) "); " (r.overall.prompts) " prompts, up to "
            (r.max_new_tokens) " greedy tokens each, then teacher forcing on the reference's continuation."
        }
        h2 { "Policy" }
        p { "Source: " (r.policy_source) "." }
        @if policy.is_empty() {
            p.note { "No thresholds set: the verdict only reflects broken artifacts (tokenizer mismatch, non-finite logits)." }
        } @else {
            (page::table(&["threshold", "limit", "measured", ""], policy.iter().map(|p| vec![
                Cell::Text(p.key.into()),
                Cell::Num(fmt_metric(p.threshold)),
                Cell::Num(fmt_metric(p.measured)),
                Cell::Ok(p.ok),
            ])))
        }
        h2 { "Overall" }
        (page::table(&["figure", "value"], overall_rows(r).into_iter().map(|(k, v)| vec![Cell::from(k), Cell::Num(v)])))
        h2 { "Per prompt" }
        (page::table(&["prompt", "tokens", "greedy", "top-1", "top-5", "KL mean", "KL max", "max |Δlogit|", "SNR dB"], prompt_rows))
        @if let Some(b) = &base { (b) }
        h2 { "Agreement" }
        (page::figure(&agreement, "Fraction of teacher-forced positions where the candidate's most likely token is the reference's (top-1), and the share of the reference's five most likely tokens among the candidate's five (top-5)."))
        h2 { "KL distribution" }
        (page::figure(&histogram, &format!("Teacher-forced positions of all prompts by decade of KL(reference ‖ candidate); below {} counts as identical.", page::sci(KL_FLOOR))))
        h2 { "KL along each prompt" }
        p.note {
            "Position p predicts token p + 1; \"generation starts\" is the position that predicts the first generated token, \"greedy diverges\" the one that predicts the first token the candidate's greedy continuation got differently. KL is on a log scale, floored at " (page::sci(KL_FLOOR)) "."
            @if left_out > 0 { " " (left_out) " more prompts are not plotted." }
        }
        div.grid { @for s in &trace_svgs { (page::figure(s, "")) } }
    };
    Ok(page::render(
        "spark-tool parity",
        &format!("{} against {}", r.candidate, r.reference),
        body,
    ))
}

/// Text for a Markdown table cell: no column breaks, no line breaks, no markup, bounded length.
fn md_cell(s: &str) -> String {
    let mut out: String = s
        .chars()
        .take(MAX_NAME_CHARS)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if s.chars().count() > MAX_NAME_CHARS {
        out.push('…');
    }
    out.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('|', "\\|")
}

/// The summary of `parity --markdown`: one verdict line and tables, under 1 MiB.
pub fn markdown(r: &ParityReport, baseline: Option<&Baseline>) -> String {
    let mut s = String::new();
    let mark = match r.verdict() {
        Verdict::Pass => "✅",
        Verdict::NotGated => "⚠️",
        Verdict::Drift => "❌",
    };
    let _ = writeln!(s, "{}", super::MARKDOWN_MARK);
    let _ = writeln!(s, "{mark} **{}**\n", md_cell_long(&verdict_line(r)));
    let policy = policy_rows(r);
    if !policy.is_empty() {
        s.push_str("| threshold | limit | measured | |\n|---|---:|---:|---|\n");
        for p in &policy {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} |",
                p.key,
                fmt_metric(p.threshold),
                fmt_metric(p.measured),
                if p.ok { "ok" } else { "**fails**" }
            );
        }
        s.push('\n');
    }
    s.push_str("| figure | value |\n|---|---|\n");
    for (k, v) in overall_rows(r) {
        let _ = writeln!(s, "| {k} | {} |", md_cell(&v));
    }
    if let Some(b) = baseline {
        s.push_str("\n| change against the baseline | baseline | this run | change |\n|---|---:|---:|---|\n");
        for c in changes(r, b) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} |",
                c.metric,
                c.before.map_or("–".into(), fmt_metric),
                fmt_metric(c.now),
                match (c.delta, c.better) {
                    (Some(d), Some(true)) => format!("{d:+.3e} better"),
                    (Some(d), Some(false)) => format!("{d:+.3e} **worse**"),
                    _ => "same".into(),
                }
            );
        }
    }
    let _ = writeln!(
        s,
        "\n<details><summary>Per prompt ({})</summary>\n\n| prompt | tokens | greedy | top-1 | top-5 | KL mean | KL max | SNR dB |\n|---|---:|---|---:|---:|---:|---:|---:|",
        r.prompts.len()
    );
    for p in r.prompts.iter().take(MAX_MARKDOWN_PROMPTS) {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            md_cell(&p.name),
            p.prompt_tokens,
            greedy_cell(p),
            page::fixed(p.top1, 3),
            page::fixed(p.top5, 3),
            page::sci(p.kl_mean),
            page::sci(p.kl_max),
            page::fixed(p.snr_db, 1)
        );
    }
    if r.prompts.len() > MAX_MARKDOWN_PROMPTS {
        let _ = writeln!(
            s,
            "\n{} more prompts are in the JSON and HTML reports.",
            r.prompts.len() - MAX_MARKDOWN_PROMPTS
        );
    }
    s.push_str("\n</details>\n");
    s
}

/// The verdict line escaped like a cell, without the length bound (failures name their figures).
fn md_cell_long(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('*', "\\*")
}

/// Write the page atomically (the path was checked with [`super::check_html_path`]).
pub fn write_html(
    path: &Path,
    r: &ParityReport,
    baseline: Option<&Baseline>,
) -> Result<(), ReportError> {
    super::write_text(path, &html(r, baseline)?)
}

/// Write the summary atomically (the path was checked with [`super::check_markdown_path`]).
pub fn write_markdown(
    path: &Path,
    r: &ParityReport,
    baseline: Option<&Baseline>,
) -> Result<(), ReportError> {
    super::write_text(path, &markdown(r, baseline))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::parity::PromptReport;

    fn prompt(name: &str, prompt_tokens: usize, kl: Vec<f64>, div: Option<usize>) -> PromptReport {
        let n = kl.len().max(1) as f64;
        PromptReport {
            name: name.into(),
            prompt_tokens,
            greedy_identical: div.is_none(),
            first_divergence: div,
            positions: kl.len(),
            top1: 0.9,
            top5: 0.95,
            kl_mean: kl.iter().sum::<f64>() / n,
            kl_max: kl.iter().fold(0.0, |m, v| m.max(*v)),
            max_abs_dlogit: 1.0,
            snr_db: 20.0,
            kl_per_position: kl,
        }
    }

    /// A report of two plotted prompts and one too short to plot.
    pub(crate) fn sample(passed: bool) -> ParityReport {
        let long: Vec<f64> = (0..40).map(|i| 1e-6 * (1.0 + i as f64)).collect();
        let mut drift: Vec<f64> = (0..30).map(|i| 1e-4 * (i % 5) as f64).collect();
        drift[3] = 0.0;
        let prompts = vec![
            prompt("long | one", 20, long, None),
            prompt("drifts <b>", 10, drift, Some(7)),
            prompt("short", 4, vec![1e-3; 5], None),
        ];
        let overall = Overall {
            greedy_identical: 2,
            prompts: 3,
            mean_tokens_to_divergence: 20.0,
            positions: 75,
            top1: 0.9,
            top5: 0.95,
            kl_mean: 4e-5,
            kl_p99: 4e-4,
            kl_max: 1e-3,
            max_abs_dlogit: 1.0,
            snr_db: f64::INFINITY,
            eval_tokens: 512,
            ppl_reference: 2.0,
            ppl_candidate: 2.02,
            ppl_ratio: 1.01,
            non_finite_reference: 0,
            non_finite_candidate: 0,
        };
        let policy = Policy {
            min_top1: Some(if passed { 0.8 } else { 0.95 }),
            max_kl_mean: Some(0.05),
            ..Default::default()
        };
        let failures = parity::check(&policy, &overall);
        ParityReport {
            reference: "ref".into(),
            candidate: "cand".into(),
            reference_bpw: 16.0,
            candidate_bpw: 4.5,
            max_new_tokens: 16,
            prompts,
            passed: failures.is_empty(),
            failures,
            gates: parity::gates(&policy, &overall),
            policy_source: "sample".into(),
            policy,
            overall,
        }
    }

    #[test]
    fn the_plotted_kl_is_the_reports_kl_position_by_position() {
        let r = sample(true);
        let t = kl_traces(&r);
        // "short" has 5 positions, below MIN_TRACE_POSITIONS.
        assert_eq!(
            t.iter().map(|t| t.prompt).collect::<Vec<_>>(),
            ["long | one", "drifts <b>"]
        );
        assert_eq!(t[0].kl, r.prompts[0].kl_per_position.as_slice());
        assert_eq!(t[1].kl, r.prompts[1].kl_per_position.as_slice());
        // Position 9 predicts the first generated token; token 7 of the continuation is at 16.
        assert_eq!((t[1].generation_starts, t[1].divergence), (9, Some(16)));
        assert_eq!(t[0].divergence, None);
    }

    #[test]
    fn the_histogram_counts_every_position_once() {
        let r = sample(true);
        let h = kl_histogram(&r);
        let total: usize = r.prompts.iter().map(|p| p.kl_per_position.len()).sum();
        assert_eq!(h.below_floor + h.counts.iter().sum::<usize>(), total);
        // The zeros of "drifts" (i % 5 == 0, and position 3) are below the floor.
        assert_eq!(h.below_floor, 7);
        // 1e-3 (five of "short") is in decade 1e-3: index 5 above 1e-8.
        assert_eq!(h.counts[5], 5);
    }

    #[test]
    fn policy_rows_agree_with_the_verdict() {
        for passed in [true, false] {
            let r = sample(passed);
            assert_eq!(r.passed, passed);
            let rows = policy_rows(&r);
            assert_eq!(rows.len(), 2);
            assert_eq!(rows.iter().all(|p| p.ok), r.passed);
            assert_eq!(rows[0].measured, r.overall.top1);
        }
    }

    #[test]
    fn markdown_leads_with_the_verdict_and_escapes_names() {
        for passed in [true, false] {
            let r = sample(passed);
            let md = markdown(&r, None);
            let mut lines = md.lines();
            assert_eq!(lines.next(), Some(crate::report::MARKDOWN_MARK));
            let verdict = lines.next().unwrap();
            let want = if passed {
                "✅ **PASS: cand"
            } else {
                "❌ **DRIFT: cand"
            };
            assert!(verdict.starts_with(want), "{verdict}");
            if !passed {
                assert!(verdict.contains(&md_cell_long(&r.failures[0])), "{verdict}");
            }
            assert!(md.contains("long \\| one") && md.contains("drifts &lt;b&gt;"));
        }
    }

    #[test]
    fn markdown_stays_under_a_step_summarys_limit() {
        let mut r = sample(true);
        let p = r.prompts[0].clone();
        r.prompts = (0..20_000)
            .map(|i| PromptReport {
                name: format!("{i}{}", "x".repeat(400)),
                ..p.clone()
            })
            .collect();
        let md = markdown(&r, None);
        assert!(md.len() < 1 << 20, "{} bytes", md.len());
        assert!(md.contains(&format!("{} more prompts", 20_000 - MAX_MARKDOWN_PROMPTS)));
    }

    #[test]
    fn changes_are_this_run_minus_the_baseline() {
        let r = sample(true);
        let b: Baseline = serde_json::from_value(serde_json::json!({
            "candidate": "old",
            "passed": true,
            "overall": {"greedy_identical": 3, "prompts": 3, "top1": 0.8, "top5": 0.95,
                        "kl_mean": 1e-4, "kl_p99": null, "snr_db": null},
            "prompts": [{"name": "long | one", "kl_mean": 1e-5}],
        }))
        .unwrap();
        let c = changes(&r, &b);
        let by = |m: &str| c.iter().find(|c| c.metric == m).unwrap().clone();
        let top1 = by("top-1 agreement");
        assert!((top1.delta.unwrap() - (r.overall.top1 - 0.8)).abs() < 1e-12);
        assert_eq!(top1.better, Some(true));
        assert_eq!(by("KL mean").better, Some(true));
        assert_eq!(by("top-5 overlap").better, None);
        assert_eq!(
            by("greedy identical (fraction of prompts)").better,
            Some(false)
        );
        // The last bit of a figure read back from JSON is no change.
        let mut same = b.clone();
        same.overall.top1 = Some(r.overall.top1 * (1.0 + f64::EPSILON));
        let top1 = changes(&r, &same)[1].clone();
        assert_eq!((top1.delta, top1.better), (Some(0.0), None));
        // Null (an infinite SNR) and absent figures compare as nothing.
        assert_eq!(by("logits SNR dB").delta, None);
        assert_eq!(by("KL max").before, None);
    }

    #[test]
    fn a_malformed_baseline_names_the_file_and_what_was_expected() {
        let d = tempfile::tempdir().unwrap();
        for text in ["not json", "{\"prompts\": []}", "[1, 2]"] {
            let p = d.path().join("prev.json");
            std::fs::write(&p, text).unwrap();
            let e = Baseline::read(&p).unwrap_err().to_string();
            assert!(
                e.contains("prev.json") && e.contains("parity --json"),
                "{e}"
            );
        }
        let e = Baseline::read(&d.path().join("absent.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("absent.json"), "{e}");
    }

    #[test]
    fn the_page_shows_verdict_tables_and_one_chart_per_plotted_prompt() {
        let r = sample(false);
        let page = html(&r, None).unwrap();
        assert!(page.contains("DRIFT: 1 check(s) failed"));
        // As escaped into the page ("top-1 0.9000 &lt; 0.95").
        assert!(page.contains(&html! { (r.failures[0]) }.into_string()));
        // Agreement, histogram, and the two traces.
        assert_eq!(page.matches("<svg").count(), 4);
        assert!(page.contains("drifts &lt;b&gt;") && !page.contains("drifts <b>"));
        let b: Baseline =
            serde_json::from_str(&serde_json::to_string(&sample(true)).unwrap()).unwrap();
        let with = html(&r, Some(&b)).unwrap();
        assert_eq!(with.matches("<svg").count(), 5);
        assert!(with.contains("Change against the baseline"));
    }
}
