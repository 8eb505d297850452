//! The page of `bench --html`: prefill and decode throughput with their spread, where the forward
//! pass spends its time (`--stages`), and, from `tools/bench_vs_llamacpp.py --json`
//! (`--llamacpp-json`), the side-by-side with llama.cpp against the memory-bandwidth ceiling.

use std::collections::BTreeMap;
use std::path::Path;

use maud::html;
use serde::Deserialize;

use super::page::{self, Cell};
use super::plots::{self, Axis, Bar, BarChart, Bars};
use super::ReportError;
use crate::bench::{BenchReport, Spread, StageProfile};

/// One `spark-tool bench` run, as its `--json` prints it.
pub struct BenchRun<'a> {
    pub artifact: &'a str,
    pub load_ms: f64,
    pub peak_rss_bytes: Option<u64>,
    pub report: &'a BenchReport,
    pub stages: Option<&'a StageProfile>,
}

/// The results of `tools/bench_vs_llamacpp.py --json`: the fields the page shows. Medians are
/// optional because the script writes null for a cell without samples.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamacppComparison {
    pub config: ComparisonConfig,
    #[serde(default)]
    pub machine: Option<Machine>,
    #[serde(default)]
    pub bandwidth: BTreeMap<String, Bandwidth>,
    pub cells: Vec<ComparisonCell>,
    #[serde(default)]
    pub ratios: Vec<Ratio>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ComparisonConfig {
    pub prompt_len: usize,
    pub gen: usize,
    pub repeat: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: Option<usize>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Bandwidth {
    pub used_gbs: f64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ScriptSpread {
    pub min: Option<f64>,
    pub median: Option<f64>,
    pub max: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ComparisonCell {
    pub engine: String,
    pub label: String,
    pub threads: usize,
    pub prefill_tok_s: ScriptSpread,
    pub decode_tok_s: ScriptSpread,
    pub ceiling_tok_s: f64,
    pub pct_of_ceiling: Option<f64>,
    pub peak_rss_bytes: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Ratio {
    pub ours: String,
    pub theirs: String,
    pub threads: usize,
    pub decode: f64,
    pub prefill: f64,
}

impl LlamacppComparison {
    /// Read the script's results; the error names the file and what was expected.
    pub fn read(path: &Path) -> Result<Self, ReportError> {
        super::read_json(
            path,
            "the results of `tools/bench_vs_llamacpp.py --json` ({\"config\", \"cells\": \
             [{\"engine\", \"label\", \"threads\", \"decode_tok_s\", \"ceiling_tok_s\", …}]})",
        )
    }
}

impl ComparisonCell {
    pub fn name(&self) -> String {
        format!("{} {} ×{}", self.engine, self.label, self.threads)
    }
}

fn bar(s: &Spread) -> Bar {
    Bar {
        value: s.median,
        range: Some((s.min, s.max)),
    }
}

fn script_bar(s: &ScriptSpread) -> Option<Bar> {
    s.median.map(|m| Bar {
        value: m,
        range: s.min.zip(s.max),
    })
}

/// The throughput bars: prefill and decode tok/s, median with min–max.
pub(crate) fn throughput_bars(r: &BenchReport) -> [(&'static str, Bar); 2] {
    [
        ("prefill tok/s", bar(&r.prefill_tok_s)),
        ("decode tok/s", bar(&r.decode_tok_s)),
    ]
}

/// Decode tok/s per cell of the comparison and the bandwidth ceiling of each: the bars of the
/// side-by-side chart.
pub(crate) fn comparison_bars(c: &LlamacppComparison) -> (Vec<String>, Vec<Bars>) {
    let names = c.cells.iter().map(ComparisonCell::name).collect();
    let decode = Bars {
        label: "decode tok/s (median, min–max)".into(),
        values: c
            .cells
            .iter()
            .map(|c| script_bar(&c.decode_tok_s))
            .collect(),
    };
    let ceiling = Bars {
        label: "bandwidth ceiling tok/s".into(),
        values: c
            .cells
            .iter()
            .map(|c| Some(Bar::from(c.ceiling_tok_s)))
            .collect(),
    };
    (names, vec![decode, ceiling])
}

fn spread_cell(s: &ScriptSpread) -> String {
    match (s.median, s.min, s.max) {
        (Some(m), Some(a), Some(z)) => format!("{m:.2} ({a:.2}–{z:.2})"),
        (Some(m), _, _) => format!("{m:.2}"),
        _ => "–".into(),
    }
}

fn comparison_section(c: &LlamacppComparison) -> Result<maud::Markup, ReportError> {
    let (names, series) = comparison_bars(c);
    let decode = plots::bar_chart(&BarChart {
        title: "Decode: spark-tool and llama.cpp against the bandwidth ceiling",
        value_desc: "tokens per second",
        axis: Axis::Linear(None),
        categories: &names,
        series: &series,
        horizontal: true,
        width: 1100,
    })?;
    let prefill = plots::bar_chart(&BarChart {
        title: "Prefill",
        value_desc: "tokens per second",
        axis: Axis::Linear(None),
        categories: &names,
        series: &[Bars {
            label: "prefill tok/s".into(),
            values: c
                .cells
                .iter()
                .map(|c| script_bar(&c.prefill_tok_s))
                .collect(),
        }],
        horizontal: true,
        width: 1100,
    })?;
    Ok(html! {
        h2 { "Against llama.cpp" }
        p {
            "From tools/bench_vs_llamacpp.py: pp" (c.config.prompt_len) " tg" (c.config.gen) ", "
            (c.config.repeat) " repeat(s) per cell"
            @if let Some(m) = &c.machine {
                ", " (m.cpu) @if let Some(n) = m.cores { ", " (n) " cores" }
            }
            ". Memory bandwidth: "
            (c.bandwidth.iter().map(|(t, b)| format!("{:.1} GB/s with {t} thread(s)", b.used_gbs)).collect::<Vec<_>>().join("; "))
            ". The ceiling is that bandwidth over the weight bytes read per decoded token."
        }
        (page::figure(&decode, ""))
        (page::figure(&prefill, ""))
        (page::table(&["engine / format", "threads", "prefill tok/s", "decode tok/s", "ceiling tok/s", "% of ceiling", "peak RSS"],
            c.cells.iter().map(|x| vec![
                Cell::from(format!("{} {}", x.engine, x.label)),
                Cell::Num(x.threads.to_string()),
                Cell::Num(spread_cell(&x.prefill_tok_s)),
                Cell::Num(spread_cell(&x.decode_tok_s)),
                Cell::Num(format!("{:.1}", x.ceiling_tok_s)),
                Cell::Num(x.pct_of_ceiling.map_or("–".into(), |p| format!("{p:.0} %"))),
                Cell::Num(x.peak_rss_bytes.map_or("–".into(), page::bytes)),
            ])))
        @if !c.ratios.is_empty() {
            (page::table(&["ours / llama.cpp (medians)", "threads", "decode", "prefill"],
                c.ratios.iter().map(|r| vec![
                    Cell::from(format!("{} / {}", r.ours, r.theirs)),
                    Cell::Num(r.threads.to_string()),
                    Cell::Num(format!("{:.2}×", r.decode)),
                    Cell::Num(format!("{:.2}×", r.prefill)),
                ])))
        }
    })
}

/// The page of one bench run, with the comparison when given.
pub fn html(run: &BenchRun, llamacpp: Option<&LlamacppComparison>) -> Result<String, ReportError> {
    let r = run.report;
    // Prefill and decode are different work at 10–100× different rates: one chart each.
    let throughput = throughput_bars(r)
        .into_iter()
        .map(|(name, bar)| {
            plots::bar_chart(&BarChart {
                title: name,
                value_desc: "tokens per second (median, min–max over the repeats)",
                axis: Axis::Linear(None),
                categories: &[name.split(' ').next().unwrap_or(name).to_string()],
                series: &[Bars {
                    label: name.into(),
                    values: vec![Some(bar)],
                }],
                horizontal: true,
                width: 540,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let stages = match run.stages {
        Some(p) => {
            let names: Vec<String> = p.prefill.iter().map(|s| s.stage.to_string()).collect();
            let share = |v: &[crate::bench::StageTime]| {
                v.iter()
                    .map(|s| Some(Bar::from(100.0 * s.share)))
                    .collect::<Vec<_>>()
            };
            Some(plots::bar_chart(&BarChart {
                title: "Share of the forward pass per stage",
                value_desc: "% of forward time",
                axis: Axis::Linear(None),
                categories: &names,
                series: &[
                    Bars {
                        label: "prefill".into(),
                        values: share(&p.prefill),
                    },
                    Bars {
                        label: "decode".into(),
                        values: share(&p.decode),
                    },
                ],
                horizontal: true,
                width: 1100,
            })?)
        }
        None => None,
    };
    let comparison = llamacpp.map(comparison_section).transpose()?;
    let spreads: [(&str, &Spread); 5] = [
        ("prefill tok/s", &r.prefill_tok_s),
        ("decode tok/s", &r.decode_tok_s),
        ("time to first token ms", &r.time_to_first_token_ms),
        ("decode ms/token", &r.decode_ms_per_token),
        ("sampling ms (total)", &r.sampling_ms),
    ];
    let body = html! {
        p {
            strong { (format!("prefill {:.1} tok/s, decode {:.2} tok/s", r.prefill_tok_s.median, r.decode_tok_s.median)) }
            " (medians of " (r.repeat) " repeats): prompt of " (r.prompt_len) " tokens, " (r.gen) " generated, "
            (r.threads) " threads; load " (format!("{:.0}", run.load_ms)) " ms, peak RSS "
            (run.peak_rss_bytes.map_or("–".into(), page::bytes)) "."
        }
        h2 { "Throughput" }
        div.grid { @for t in &throughput { (page::figure(t, "")) } }
        (spread_table(&spreads, 2))
        @if let Some(c) = &r.ceiling {
            h2 { "Decode against this machine's bandwidth ceiling" }
            p {
                "A decode step reads " (page::bytes(c.weight_bytes.total() + c.kv_bytes)) ": linears "
                (page::bytes(c.weight_bytes.linears)) ", head " (page::bytes(c.weight_bytes.head))
                ", norms " (page::bytes(c.weight_bytes.norms)) ", K and V " (page::bytes(c.kv_bytes))
                " (at the mean decode position). A streaming read before the first repeat and after each; "
                "each repeat's decode against the mean of the two reads around it."
            }
            (spread_table(&[
                ("streaming read GB/s", &c.stream_read_gb_s),
                ("decode ceiling tok/s", &c.ceiling_tok_s),
                ("decode % of ceiling", &c.percent_of_ceiling),
            ], 1))
        }
        @if let (Some(p), Some(chart)) = (run.stages, &stages) {
            h2 { "Where the time goes" }
            (page::figure(chart, &format!(
                "One more prefill ({:.1} ms) and decode ({:.2} ms/token) with the stage timers on.",
                p.prefill_ms, p.decode_ms_per_token)))
            (page::table(&["stage", "prefill ms", "prefill %", "decode ms/token", "decode %"],
                p.prefill.iter().zip(&p.decode).map(|(a, b)| vec![
                    Cell::from(a.stage),
                    Cell::Num(format!("{:.2}", a.ms)),
                    Cell::Num(format!("{:.1}", 100.0 * a.share)),
                    Cell::Num(format!("{:.3}", b.ms)),
                    Cell::Num(format!("{:.1}", 100.0 * b.share)),
                ])))
        }
        @if let Some(c) = &comparison { (c) }
    };
    Ok(page::render("spark-tool bench", run.artifact, body))
}

/// One row per figure: its median, min and max with `digits` decimals.
fn spread_table(rows: &[(&str, &Spread)], digits: usize) -> maud::Markup {
    page::table(
        &["figure", "median", "min", "max"],
        rows.iter().map(|(n, s)| {
            vec![
                Cell::from(*n),
                Cell::Num(page::fixed(s.median, digits)),
                Cell::Num(page::fixed(s.min, digits)),
                Cell::Num(page::fixed(s.max, digits)),
            ]
        }),
    )
}

/// Write the page atomically (the path was checked with [`super::check_html_path`]).
pub fn write_html(
    path: &Path,
    run: &BenchRun,
    llamacpp: Option<&LlamacppComparison>,
) -> Result<(), ReportError> {
    super::write_text(path, &html(run, llamacpp)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> BenchReport {
        BenchReport {
            prompt_len: 64,
            gen: 8,
            repeat: 3,
            threads: 2,
            prefill_tok_s: Spread::of(&[900.0, 1000.0, 1100.0]),
            decode_tok_s: Spread::of(&[40.0, 50.0, 45.0]),
            time_to_first_token_ms: Spread::of(&[60.0, 70.0, 65.0]),
            decode_ms_per_token: Spread::of(&[20.0, 25.0, 22.0]),
            sampling_ms: Spread::of(&[0.1, 0.2, 0.3]),
            ceiling: None,
        }
    }

    /// The shape `tools/bench_vs_llamacpp.py` writes (its `res`), two cells.
    fn comparison() -> serde_json::Value {
        let spread = |a: f64, m: f64, z: f64| serde_json::json!({"min": a, "median": m, "max": z, "n": 3, "samples": [a, m, z]});
        serde_json::json!({
            "note": "random weights",
            "config": {"prompt_len": 512, "gen": 128, "repeat": 3, "threads": [2], "interleave": "rounds"},
            "machine": {"cpu": "Test CPU", "cores": 2, "amx": false},
            "bandwidth": {"2": {"used_gbs": 20.0, "used_stat": "wall"}},
            "artifacts": {},
            "cells": [
                {"format": "w4a8", "engine": "spark-tool", "label": "W4A8 g128", "threads": 2,
                 "prefill_tok_s": spread(90.0, 100.0, 110.0), "decode_tok_s": spread(18.0, 20.0, 21.0),
                 "ttft_ms": spread(1.0, 2.0, 3.0), "peak_rss_bytes": 1_500_000_000u64,
                 "ceiling_tok_s": 25.0, "pct_of_ceiling": 80.0, "runs": []},
                {"format": "q4_k_m", "engine": "llama.cpp", "label": "Q4_K_M", "threads": 2,
                 "prefill_tok_s": spread(80.0, 85.0, 90.0),
                 "decode_tok_s": {"min": null, "median": null, "max": null, "n": 0, "samples": []},
                 "ttft_ms": {"min": null, "median": null, "max": null, "n": 0, "samples": []},
                 "peak_rss_bytes": 1_400_000_000u64, "ceiling_tok_s": 22.0, "pct_of_ceiling": 70.0, "runs": []}
            ],
            "ratios": [{"ours": "W4A8 g128", "theirs": "Q4_K_M", "threads": 2, "decode": 1.1, "prefill": 1.2}],
        })
    }

    #[test]
    fn throughput_bars_are_the_reports_spreads() {
        let r = report();
        let [(_, pre), (_, dec)] = throughput_bars(&r);
        assert_eq!(pre.value, r.prefill_tok_s.median);
        assert_eq!(pre.range, Some((900.0, 1100.0)));
        assert_eq!((dec.value, dec.range), (45.0, Some((40.0, 50.0))));
    }

    #[test]
    fn comparison_bars_are_the_scripts_cells() {
        let c: LlamacppComparison = serde_json::from_value(comparison()).unwrap();
        let (names, series) = comparison_bars(&c);
        assert_eq!(names, ["spark-tool W4A8 g128 ×2", "llama.cpp Q4_K_M ×2"]);
        assert_eq!(
            series[0].values,
            [
                Some(Bar {
                    value: 20.0,
                    range: Some((18.0, 21.0))
                }),
                // No samples: no bar rather than a zero.
                None
            ]
        );
        assert_eq!(
            series[1].values,
            [Some(Bar::from(25.0)), Some(Bar::from(22.0))]
        );
        let run = BenchRun {
            artifact: "a",
            load_ms: 10.0,
            peak_rss_bytes: None,
            report: &report(),
            stages: None,
        };
        let page = html(&run, Some(&c)).unwrap();
        // Prefill and decode throughput, decode and prefill comparisons.
        assert_eq!(page.matches("<svg").count(), 4);
        assert!(page.contains("Test CPU") && page.contains("1.10×"));
    }

    #[test]
    fn the_ceiling_section_shows_the_bytes_and_the_spreads_when_measured() {
        let mut r = report();
        let page = |r: &BenchReport| {
            let run = BenchRun {
                artifact: "a",
                load_ms: 10.0,
                peak_rss_bytes: None,
                report: r,
                stages: None,
            };
            html(&run, None).unwrap()
        };
        assert!(!page(&r).contains("bandwidth ceiling"));
        r.ceiling = Some(crate::bench::Ceiling {
            weight_bytes: crate::model::DecodeBytes {
                linears: 700_000_000,
                norms: 500_000,
                head: 500_000_000,
            },
            kv_bytes: 30_000_000,
            stream_read_gb_s: Spread::of(&[22.0, 24.0, 26.0]),
            ceiling_tok_s: Spread::of(&[17.0, 18.0, 19.0]),
            percent_of_ceiling: Spread::of(&[61.0, 63.5, 66.0]),
        });
        let p = page(&r);
        assert!(
            p.contains("bandwidth ceiling") && p.contains("1.23 GB"),
            "{p}"
        );
        for v in ["24.0", "18.0", "63.5", "61.0", "66.0"] {
            assert!(p.contains(&format!(">{v}<")), "{v} missing");
        }
    }

    #[test]
    fn a_file_that_is_not_the_scripts_results_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("bench.json");
        let mut v = comparison();
        v["cells"][0]
            .as_object_mut()
            .unwrap()
            .remove("ceiling_tok_s");
        for text in [
            "{}".to_string(),
            "[]".to_string(),
            serde_json::to_string(&v).unwrap(),
        ] {
            std::fs::write(&p, &text).unwrap();
            let e = LlamacppComparison::read(&p).unwrap_err().to_string();
            assert!(
                e.contains("bench.json") && e.contains("bench_vs_llamacpp.py"),
                "{e}"
            );
        }
        std::fs::write(&p, serde_json::to_string(&comparison()).unwrap()).unwrap();
        assert_eq!(LlamacppComparison::read(&p).unwrap().cells.len(), 2);
    }
}
