//! The HTML pages and the Markdown summary as a person gets them from the binary: parity of the
//! fixture against a quantized copy, the quantize page beside its JSON, and bench with the
//! llama.cpp comparison. tools/render_reports.sh renders the same pages in headless Chromium.

use crate::common;

use std::path::Path;
use std::process::Output;

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// A page that opens with nothing fetched and nothing run: no script, no remote source or link,
/// no remote CSS; and it has charts.
fn assert_self_contained(path: &Path) -> String {
    let page = std::fs::read_to_string(path).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"), "{}", path.display());
    let lower = page.to_lowercase();
    for bad in [
        "<script",
        "src=\"http",
        "href=\"http",
        "src='http",
        "href='http",
        "url(http",
        "@import",
        "<iframe",
        "<link",
    ] {
        assert!(!lower.contains(bad), "{} has {bad}", path.display());
    }
    assert!(page.contains("<svg"), "{} has no chart", path.display());
    page
}

/// The fixture quantized cheaply with the defaults for the probe's `answer` (CALIBRATION tokens;
/// the comparison columns on, so the page has all three methods' bars).
fn quantized(dir: &Path, answer: &str) -> std::path::PathBuf {
    let out = dir.join("q");
    let o = common::tool()
        .env("SPARK_TARGET", answer)
        .arg("quantize")
        .arg(common::fixture("spark-tiny"))
        .args([
            "--quiet",
            "--samples",
            CALIBRATION.0,
            "--seq-len",
            CALIBRATION.1,
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    out
}

/// Calibration samples × tokens: enough that both formats pass the committed policy with
/// HEADROOM to spare.
const CALIBRATION: (&str, &str) = ("16", "64");
const HEADROOM: f64 = 0.2;

fn parity(candidate: &Path, extra: &[&std::ffi::OsStr]) -> Output {
    common::tool()
        .arg("parity")
        .arg(common::fixture("spark-tiny"))
        .arg(candidate)
        .arg("--prompts")
        .arg(common::root().join("tests/golden/prompts/spark-tiny.json"))
        .args(["--max-new-tokens", "8", "--eval-tokens", "256"])
        .args(["--eval-seq-len", "128", "--policy"])
        .arg(common::root().join("tests/parity_policy.json"))
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn quantize_and_parity_pages_of_the_fixture() {
    for answer in common::PROBE_ANSWERS {
        pages_for(answer);
    }
}

fn pages_for(answer: &str) {
    let d = tempfile::tempdir().unwrap();
    let q = quantized(d.path(), answer);

    // quantize: the page is beside the JSON, recorded as ours, and shows the JSON's figures.
    let page = assert_self_contained(&q.join("quant_report.html"));
    let marker = std::fs::read_to_string(q.join(".spark-tool-artifact.json")).unwrap();
    assert!(marker.contains("quant_report.html"), "{marker}");
    let qr: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(q.join("quant_report.json")).unwrap())
            .unwrap();
    let format = if answer == "x86-amx" { "w4a8" } else { "w4a16" };
    assert_eq!(
        qr["recipe"]["format"], format,
        "the probe's answer {answer}"
    );
    let mean = qr["mean_error"].as_f64().unwrap();
    assert!(page.contains(&format!("{mean:.2e}")), "mean error {mean}");
    assert!(page.contains(qr["linears"][0]["name"].as_str().unwrap()));
    // The default float-stream objective: the page gives the mean of the JSON's split-half weights.
    let w: Vec<f64> = qr["linears"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["stream_weight"].as_f64())
        .collect();
    let mean_w = w.iter().sum::<f64>() / w.len() as f64;
    assert!(
        page.contains(&format!("split-half weight α, mean {mean_w:.2}")),
        "stream weights {w:?}"
    );
    // One chart per projection (q, k, v, out, gate, up, down) and the phase chart.
    assert_eq!(page.matches("<svg").count(), 8);

    // parity, within the committed policy.
    let (json, html, md) = (
        d.path().join("p.json"),
        d.path().join("p.html"),
        d.path().join("p.md"),
    );
    let o = parity(
        &q,
        &[
            "--json".as_ref(),
            json.as_os_str(),
            "--html".as_ref(),
            html.as_os_str(),
            "--markdown".as_ref(),
            md.as_os_str(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    common::assert_headroom(
        &report,
        HEADROOM,
        &format!("{format} (probe answer {answer})"),
    );
    let page = assert_self_contained(&html);
    assert!(page.contains("PASS: the candidate is within policy"));
    let positions: usize = report["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let kl = p["kl_per_position"].as_array().unwrap();
            assert_eq!(kl.len() as u64, p["positions"].as_u64().unwrap());
            kl.len()
        })
        .sum();
    assert_eq!(
        positions as u64,
        report["overall"]["positions"].as_u64().unwrap()
    );
    let summary = std::fs::read_to_string(&md).unwrap();
    assert!(summary.len() < 1 << 20);
    assert!(
        summary.lines().nth(1).unwrap().starts_with("✅ **PASS: "),
        "{summary}"
    );

    // A stricter gate against the first run as baseline drifts; the pages say so and show the
    // change. Our own previous page and summary are replaced.
    let o = parity(
        &q,
        &[
            "--min-top1".as_ref(),
            "1".as_ref(),
            "--baseline".as_ref(),
            json.as_os_str(),
            "--html".as_ref(),
            html.as_os_str(),
            "--markdown".as_ref(),
            md.as_os_str(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let page = assert_self_contained(&html);
    assert!(page.contains("DRIFT: 1 check(s) failed"));
    assert!(page.contains("Change against the baseline"));
    let summary = std::fs::read_to_string(&md).unwrap();
    let verdict = summary.lines().nth(1).unwrap();
    assert!(
        verdict.starts_with("❌ **DRIFT: ") && verdict.contains("top-1"),
        "{verdict}"
    );
    assert!(summary.contains("change against the baseline"));
}

#[test]
fn report_outputs_follow_the_rules_of_json_and_fail_before_the_work() {
    let d = tempfile::tempdir().unwrap();
    let fx = common::fixture("spark-tiny");
    let mine = d.path().join("mine.html");
    std::fs::write(&mine, "<html>my notes</html>").unwrap();
    let prev = d.path().join("prev.json");
    std::fs::write(&prev, "{}").unwrap();
    let cases: [(Vec<&std::ffi::OsStr>, &[&str]); 6] = [
        // A file that is not a previous report of ours is never overwritten.
        (
            vec!["--html".as_ref(), mine.as_os_str()],
            &["--html", "mine.html", "not a previous output"],
        ),
        (
            vec!["--markdown".as_ref(), mine.as_os_str()],
            &["--markdown", "not a previous output"],
        ),
        // Two outputs naming one file.
        (
            vec![
                "--json".as_ref(),
                "same.out".as_ref(),
                "--html".as_ref(),
                "./same.out".as_ref(),
            ],
            &["--json", "--html", "both name"],
        ),
        // A baseline that is not a parity report names itself and what was expected.
        (
            vec![
                "--baseline".as_ref(),
                mine.as_os_str(),
                "--markdown".as_ref(),
                "s.md".as_ref(),
            ],
            &["mine.html", "expected a previous `parity --json` report"],
        ),
        // An output is never one of the inputs, the baseline included.
        (
            vec![
                "--json".as_ref(),
                prev.as_os_str(),
                "--baseline".as_ref(),
                prev.as_os_str(),
                "--markdown".as_ref(),
                "s.md".as_ref(),
            ],
            &["--json", "prev.json", "is the input"],
        ),
        // A baseline only changes the page and the summary.
        (
            vec!["--baseline".as_ref(), "prev.json".as_ref()],
            &["--html", "--markdown"],
        ),
    ];
    for (args, want) in cases {
        let o = common::tool()
            .current_dir(d.path())
            .arg("parity")
            .arg(&fx)
            .arg(&fx)
            .args(&args)
            .output()
            .unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {t}");
        for w in want {
            assert!(t.contains(w), "{args:?}: {t}");
        }
        // Refused before the comparison ran: no table was printed.
        assert!(!t.contains("overall:"), "{args:?}: {t}");
    }
    assert_eq!(
        std::fs::read_to_string(&mine).unwrap(),
        "<html>my notes</html>"
    );
    assert_eq!(std::fs::read_to_string(&prev).unwrap(), "{}");
    assert!(!d.path().join("same.out").exists() && !d.path().join("s.md").exists());
}

/// What `tools/bench_vs_llamacpp.py --json` writes (its `res`, two cells, abridged `runs`).
fn llamacpp_results() -> serde_json::Value {
    let spread = |a: f64, m: f64, z: f64| serde_json::json!({"min": a, "median": m, "max": z, "n": 3, "samples": [a, m, z]});
    serde_json::json!({
        "note": "random weights at the real shapes: speed does not depend on the weight values",
        "config": {"prompt_len": 512, "gen": 128, "repeat": 3, "threads": [2], "interleave": "rounds",
                   "order": ["w4a8", "q4_k_m"], "quantize_method": "rtn"},
        "machine": {"cpu": "Example CPU @ 2.0GHz", "cores": 2, "amx": false, "avx512_vnni": true,
                    "avx512_bf16": true, "kernel": "6.1"},
        "started": "20261201-000000", "load_start": [0.1, 0.1, 0.1], "load_end": [0.2, 0.2, 0.2],
        "bandwidth": {"2": {"used_gbs": 21.5, "used_stat": "wall"}},
        "artifacts": {},
        "cells": [
            {"format": "w4a8", "engine": "spark-tool", "label": "W4A8 g128", "threads": 2,
             "prefill_tok_s": spread(150.0, 160.0, 165.0), "decode_tok_s": spread(17.0, 18.5, 19.0),
             "ttft_ms": spread(3000.0, 3100.0, 3300.0), "peak_rss_bytes": 1_300_000_000u64,
             "ceiling_tok_s": 22.0, "pct_of_ceiling": 84.1, "runs": []},
            {"format": "q4_k_m", "engine": "llama.cpp", "label": "Q4_K_M", "threads": 2,
             "prefill_tok_s": spread(120.0, 125.0, 130.0), "decode_tok_s": spread(15.0, 16.0, 16.5),
             "ttft_ms": {"min": null, "median": null, "max": null, "n": 0, "samples": []},
             "peak_rss_bytes": 1_200_000_000u64, "ceiling_tok_s": 19.5, "pct_of_ceiling": 82.1, "runs": []}
        ],
        "ratios": [{"ours": "W4A8 g128", "theirs": "Q4_K_M", "threads": 2, "decode": 1.156, "prefill": 1.28}],
    })
}

#[test]
fn bench_page_with_stages_and_the_llamacpp_comparison() {
    let d = tempfile::tempdir().unwrap();
    let cmp = d.path().join("bench-vs-llamacpp.json");
    std::fs::write(&cmp, serde_json::to_string(&llamacpp_results()).unwrap()).unwrap();
    let html = d.path().join("b.html");
    let bench = |extra: &[&std::ffi::OsStr]| {
        common::tool()
            .arg("bench")
            .arg(common::fixture("spark-tiny"))
            .args(["--prompt-len", "16", "--gen", "4", "--repeat", "2"])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = bench(&[
        "--stages".as_ref(),
        "--json".as_ref(),
        "--html".as_ref(),
        html.as_os_str(),
        "--llamacpp-json".as_ref(),
        cmp.as_os_str(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let printed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let page = assert_self_contained(&html);
    // The page's headline medians are the printed JSON's.
    let median = |k: &str| printed[k]["median"].as_f64().unwrap();
    assert!(
        page.contains(&format!(
            "prefill {:.1} tok/s, decode {:.2} tok/s",
            median("prefill_tok_s"),
            median("decode_tok_s")
        )),
        "{printed}"
    );
    for stage in printed["stages"]["prefill"].as_array().unwrap() {
        let name = stage["stage"].as_str().unwrap();
        assert!(page.contains(&maud_escape(name)), "{name}");
    }
    assert!(page.contains("Against llama.cpp") && page.contains("Example CPU"));
    assert!(page.contains("1.16×"));
    // Prefill, decode, stages, decode and prefill against llama.cpp.
    assert_eq!(page.matches("<svg").count(), 5);

    // A comparison file of another shape is refused by name, before the benchmark.
    std::fs::write(&cmp, r#"{"cells": 3}"#).unwrap();
    let o = bench(&[
        "--html".as_ref(),
        html.as_os_str(),
        "--llamacpp-json".as_ref(),
        cmp.as_os_str(),
    ]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains("bench-vs-llamacpp.json") && t.contains("bench_vs_llamacpp.py --json"),
        "{t}"
    );
    // --html describes a model run, not the kernel table.
    let o = bench(&["--kernels".as_ref(), "--html".as_ref(), html.as_os_str()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// How the page writes `s` (maud escapes &, <, > and ").
fn maud_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
