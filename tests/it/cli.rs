//! The `spark-tool` binary end to end on the bundled fixtures.

use crate::common;
use std::process::Command;

fn ok(cmd: &mut Command) -> (String, String) {
    let out = cmd.output().expect("spawn spark-tool");
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "spark-tool failed: {se}");
    (so, se)
}

#[test]
fn inspect_json_reports_the_fixture() {
    let (so, _) = ok(common::tool()
        .args(["inspect", "--json", "--context", "1000"])
        .arg(common::fixture("spark-random")));
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(v["tensors"], 53);
    assert_eq!(v["parameters"], 1_119_488);
    assert_eq!(v["tied_head"], false);
    assert_eq!(v["q_dim"], 144);
    // 3 sliding layers × 16 entries + 2 full × 1000, 48-dim K and V at 2 bytes.
    assert_eq!(
        v["kv_cache"]["total_bytes_16bit"],
        (3 * 16 + 2 * 1000) * 48 * 2 * 2
    );
    // A float checkpoint runs on f32 caches (a GPTQ one on bf16: tests/quantize.rs).
    assert_eq!(
        v["kv_cache"]["engine_bytes"],
        (3 * 16 + 2 * 1000) * 48 * 2 * 4
    );
}

#[test]
fn run_tokens_writes_logits_file() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("logits.safetensors");
    let (so, _) = ok(common::tool()
        .args([
            "run",
            "--tokens",
            "5,6,7,8",
            "--max-new-tokens",
            "3",
            "--ignore-eos",
            "--logits-out",
        ])
        .arg(&out)
        .arg(common::fixture("spark-random")));
    assert_eq!(
        so.split_whitespace().count(),
        3,
        "without a tokenizer, ids are printed: {so}"
    );
    let store = spark_tool::checkpoint::TensorStore::open_file(&out).unwrap();
    assert_eq!(store.get("prompt_logits").unwrap().shape, vec![4, 1000]);
    assert_eq!(store.get("decode_logits").unwrap().shape, vec![3, 1000]);
    let toks = store.get("tokens").unwrap();
    assert_eq!(toks.shape, vec![7]);
    // decode_logits row 0 is the last prompt row: the distribution token 5 came from.
    let p = store.to_f32(store.get("prompt_logits").unwrap()).unwrap();
    let dl = store.to_f32(store.get("decode_logits").unwrap()).unwrap();
    assert_eq!(&p[3000..4000], &dl[..1000]);
}

#[test]
fn run_prompt_on_default_fixture_streams_text() {
    let (so, se) = ok(common::tool().args([
        "run",
        common::fixture("spark-tiny").to_str().unwrap(),
        "--prompt",
        "def add(a, b):",
        "--max-new-tokens",
        "8",
        "--stats",
    ]));
    assert!(!so.trim().is_empty(), "no text streamed");
    assert!(
        se.contains("prefill") && se.contains("decode / token") && se.contains("first token"),
        "{se}"
    );
}

#[test]
fn seeded_sampling_is_reproducible() {
    let fx = common::fixture("spark-tiny");
    let args = [
        "run",
        fx.to_str().unwrap(),
        "--prompt",
        "The weather",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "7",
    ];
    let (a, _) = ok(common::tool().args(args));
    let (b, _) = ok(common::tool().args(args));
    assert_eq!(a, b);
}

#[test]
fn errors_exit_2_with_a_reason() {
    let out = common::tool()
        .args(["run", "/definitely/not/here", "--tokens", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/definitely/not/here"));
    let out = common::tool()
        .args(["run", "--tokens", "999999"])
        .arg(common::fixture("spark-random"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("outside the vocabulary"));
    let out = common::tool()
        .args(["run", "--prompt", "hi"])
        .arg(common::fixture("spark-random"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("no tokenizer.json"));
}

#[test]
fn flags_that_do_not_apply_are_refused_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let fx = common::fixture("spark-tiny");
    let fx = fx.to_str().unwrap();
    let g = d.path().join("x.gguf");
    let g = g.to_str().unwrap();
    let e = d.path().join("e");
    let e = e.to_str().unwrap();
    let cases: [(&[&str], &[&str]); 12] = [
        (
            &["quantize", fx, "--out", e, "--set", "method=best"],
            &["method", "best", "gptq-search"],
        ),
        (
            &["quantize", fx, "--out", e, "--set", "damp=2"],
            &["damp = 2", "(0, 1]"],
        ),
        (
            &["quantize", fx, "--out", e, "--set", "sample=4"],
            &["the flags", "sample"],
        ),
        (
            &["bench", fx, "--kernels", "--only", "nosuch"],
            &["--only", "matches no kernel", "down_proj"],
        ),
        (
            &[
                "export-phone",
                fx,
                "--out",
                e,
                "--precision",
                "f32",
                "--kv-dtype",
                "uint8",
            ],
            &["--kv-dtype", "w8a16"],
        ),
        (
            &[
                "quantize",
                fx,
                "--out",
                g,
                "--format",
                "gguf-q4_0",
                "--quantize-head",
            ],
            &["--quantize-head", "GGUF"],
        ),
        (
            &[
                "quantize",
                fx,
                "--out",
                g,
                "--format",
                "gguf-q4_0",
                "--target",
                "phone",
            ],
            &["--target", "GGUF"],
        ),
        (
            &[
                "quantize",
                fx,
                "--out",
                g,
                "--format",
                "gguf-q4_0",
                "--qkv-layout",
                "split",
            ],
            &["--qkv-layout", "GGUF"],
        ),
        (
            &[
                "quantize",
                fx,
                "--out",
                e,
                "--target",
                "phone",
                "--set",
                "lab.refit_rounds=1",
            ],
            if cfg!(feature = "lab") {
                &["lab.refit_rounds", "LPBQ"]
            } else {
                &["[lab]", "--features lab"]
            },
        ),
        (
            &["run", "/definitely/not/here", "--tokens", "1"],
            &["/definitely/not/here does not exist"],
        ),
        (
            &["run", fx, "--w4-numerics", "w4a8", "--tokens", "1"],
            &["--w4-numerics", "no 4-bit GPTQ"],
        ),
        (
            &["inspect", fx, "--context", "18446744073709551615"],
            &["--context", "4294967296"],
        ),
    ];
    for (args, want) in cases {
        let out = common::tool().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        for w in want {
            assert!(err.contains(w), "{args:?}: {err}");
        }
    }
    assert!(
        std::fs::read_dir(d.path()).unwrap().next().is_none(),
        "nothing written"
    );
    // No held-out tokens: perplexity is reported as not measured, not as NaN; a model compared
    // with itself is named as such.
    let out = common::tool()
        .args([
            "parity",
            fx,
            fx,
            "--eval-tokens",
            "0",
            "--max-new-tokens",
            "1",
        ])
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{se}");
    assert!(
        so.contains("perplexity: not measured") && !so.contains("NaN"),
        "{so}"
    );
    assert!(
        se.contains("the reference and the candidate are the same"),
        "{se}"
    );
}

#[test]
fn a_non_finite_weight_stops_run_and_bench_naming_the_tensor() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("nan");
    common::copy_dir(&common::fixture("spark-tiny"), &model);
    let st = model.join("model.safetensors");
    let name = "model.layers.1.mlp.gate_proj.weight";
    let start = spark_tool::checkpoint::TensorStore::open_file(&st)
        .unwrap()
        .get(name)
        .unwrap()
        .start;
    let mut bytes = std::fs::read(&st).unwrap();
    bytes[start as usize..start as usize + 2].copy_from_slice(&0x7fc0u16.to_le_bytes()); // bf16 NaN
    std::fs::write(&st, bytes).unwrap();
    for args in [
        &["run", "--prompt", "hello", "--max-new-tokens", "4"][..],
        &["bench", "--prompt-len", "8", "--gen", "2", "--repeat", "1"][..],
    ] {
        let out = common::tool()
            .args(&args[..1])
            .arg(&model)
            .args(&args[1..])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(name) && err.contains("NaN") && err.contains("not finite"),
            "{args:?}: {err}"
        );
        // Nothing was generated from the broken logits.
        assert!(out.stdout.is_empty() || args[0] == "bench", "{args:?}");
    }
}

#[test]
fn bench_reports_throughput_with_spread() {
    let (so, _) = ok(common::tool()
        .args([
            "bench",
            "--prompt-len",
            "40",
            "--gen",
            "5",
            "--repeat",
            "2",
            "--json",
        ])
        .arg(common::fixture("spark-random")));
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(v["prompt_len"], 40);
    assert_eq!(v["repeat"], 2);
    for k in ["prefill_tok_s", "decode_tok_s", "time_to_first_token_ms"] {
        let s = &v[k];
        assert!(
            s["min"].as_f64().unwrap() > 0.0 && s["min"].as_f64() <= s["median"].as_f64(),
            "{k}: {s}"
        );
    }
}

/// `bench --kernels` measures the W4A16 decode kernels against the step of their decoder
/// (groups of 128: the word decoder; of 64: the pair decoder, where VBMI runs it), and each step
/// named is also a measured peak.
#[test]
fn bench_kernels_bound_each_w4a16_decode_kernel_by_its_own_step() {
    let (so, _) = ok(common::tool().args([
        "--threads",
        "1",
        "bench",
        common::fixture("spark-tiny").to_str().unwrap(),
        "--kernels",
        "--json",
        "--repeat",
        "1",
        "--only",
        "w4a16",
        "--working-set-mb",
        "1",
    ]));
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    let peaks: Vec<&str> = v["peaks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["instruction"].as_str().unwrap())
        .collect();
    let rows = v["kernels"].as_array().unwrap();
    assert!(!rows.is_empty());
    for r in rows {
        let kernel = r["kernel"].as_str().unwrap();
        let want = match (kernel, peaks.contains(&"vdpbf16ps")) {
            (_, false) => None,
            ("w4a16 g128", true) => Some("w4a16 g128 step"),
            ("w4a16 g64", true) => Some("w4a16 g64 step").filter(|s| peaks.contains(s)),
            (k, _) => panic!("--only w4a16 gave {k}"),
        };
        assert_eq!(r["step"].as_str(), want, "{r}");
        assert_eq!(r["percent_of_step"].is_f64(), want.is_some(), "{r}");
        if let Some(s) = want {
            assert!(peaks.contains(&s), "{s} not measured: {peaks:?}");
        }
    }
}

/// `bench --ceiling` counts the bytes a decode step reads as the files say: every projection,
/// norm and the (untied) head of the f16/f32 fixture, held as f32, and K/V of every cached row (f32
/// for a float model; sliding layers hold at most their window), from the safetensors headers
/// and config.json rather than the engine; and sets each repeat against the reads around it.
#[test]
fn bench_ceiling_counts_what_a_decode_step_reads() {
    let dir = common::fixture("spark-random");
    let (so, _) = ok(common::tool()
        .args(["bench", "--prompt-len", "20", "--gen", "6", "--repeat", "2"])
        .args(["--ceiling", "--json"])
        .arg(&dir));
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    let c = &v["ceiling"];

    let (mut linears, mut norms, mut head) = (0u64, 0u64, 0u64);
    for f in std::fs::read_dir(&dir).unwrap() {
        let path = f.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        for (name, info) in meta.tensors() {
            // f16 and f32 tensors are both held as f32.
            let dt = info.dtype;
            assert!(
                dt == safetensors::Dtype::F16 || dt == safetensors::Dtype::F32,
                "{name}: {dt:?}"
            );
            let f32_bytes = 4 * info.shape.iter().product::<usize>() as u64;
            if name.ends_with("norm.weight") {
                norms += f32_bytes;
            } else if name.starts_with("lm_head.") {
                head += f32_bytes;
            } else if name.ends_with("_proj.weight") {
                linears += f32_bytes;
            } else {
                assert_eq!(name, "model.embedding.weight", "unexpected tensor");
            }
        }
    }
    let w = &c["weight_bytes"];
    assert_eq!(w["linears"], linears);
    assert_eq!(w["norms"], norms);
    assert_eq!(w["head"], head);

    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let n = |k: &str| cfg[k].as_u64().unwrap();
    let position = 20 + 6 / 2;
    let per_row = 2 * n("num_key_value_heads") * n("head_dim") * 4;
    let rows: u64 = cfg["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| match t.as_str().unwrap() {
            "sliding_attention" => position.min(n("sliding_window")),
            _ => position,
        })
        .sum();
    assert_eq!(c["kv_bytes"], rows * per_row);

    let spread = |k: &str| {
        let s = &c[k];
        let f = |q: &str| s[q].as_f64().unwrap();
        assert!(
            f("min") > 0.0 && f("min") <= f("median") && f("median") <= f("max"),
            "{k}: {s}"
        );
        (f("min"), f("max"))
    };
    let (read_lo, read_hi) = spread("stream_read_gb_s");
    let (ceil_lo, ceil_hi) = spread("ceiling_tok_s");
    spread("percent_of_ceiling");
    // Each ceiling is a mean of two reads over the bytes per step.
    let step = (linears + norms + head + rows * per_row) as f64;
    assert!(ceil_lo >= read_lo * 1e9 / step * (1.0 - 1e-9), "{c}");
    assert!(ceil_hi <= read_hi * 1e9 / step * (1.0 + 1e-9), "{c}");
}

#[test]
fn bench_stages_cover_the_forward_pass() {
    let (so, _) = ok(common::tool().args([
        "bench",
        common::fixture("spark-tiny").to_str().unwrap(),
        "--prompt-len",
        "16",
        "--gen",
        "4",
        "--repeat",
        "1",
        "--stages",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&so).expect("bench --json prints JSON");
    let p = &v["stages"];
    for phase in ["prefill", "decode"] {
        let rows = p[phase].as_array().expect("stage rows");
        assert_eq!(rows.len(), 9, "{phase}");
        let share: f64 = rows.iter().map(|r| r["share"].as_f64().unwrap()).sum();
        // Stages are disjoint parts of the timed calls, which also hand the step to a pool
        // worker and, for decode, take the argmax: on a loaded machine (measured: 0.055 of a
        // decode step at load 8 on 2 cores) the rest can be most of it, so no floor on the share.
        assert!(
            share > 0.0 && share <= 1.0 + 1e-9,
            "{phase}: stages cover {share}"
        );
        for r in rows {
            assert!(r["ms"].as_f64().unwrap() >= 0.0, "{phase}: {r}");
        }
        let proj = rows
            .iter()
            .find(|r| r["stage"] == "gate/up projections")
            .unwrap();
        assert!(proj["ms"].as_f64().unwrap() > 0.0, "{phase}");
    }
}

/// The residual streams live in scratch files of the staging folder, planned and checked against
/// its free disk before any work: a refusal names the figure and the folder and leaves nothing.
#[test]
fn scratch_over_the_free_disk_is_refused_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("q");
    let o = common::tool()
        .arg("quantize")
        .arg(common::fixture("spark-tiny"))
        .args(["--samples", "4", "--seq-len", "64", "--out"])
        .arg(&out)
        .env("SPARK_DISK_AVAILABLE", "100000")
        .output()
        .unwrap();
    let se = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{se}");
    // 4 × 64 tokens × 256 wide × 4 bytes × (x and x_float) × 3 files.
    assert!(
        se.contains("1.6 MB of scratch") && se.contains("100000 B free"),
        "{se}"
    );
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0, "{se}");
}

#[test]
fn force_memory_runs_past_a_memory_plan_that_does_not_fit() {
    // On a "1 MB machine" the plan refuses (tests/malformed.rs); --force-memory runs anyway and
    // the plan is still printed and recorded.
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("q");
    let quantize = || {
        let mut c = common::tool();
        c.arg("quantize").arg(common::fixture("spark-tiny"));
        c.args(["--samples", "2", "--seq-len", "16", "--no-compare"]);
        c
    };
    // The defaults, under each of the probe's answers.
    for answer in common::PROBE_ANSWERS {
        let (_, se) = ok(quantize()
            .env("SPARK_TARGET", answer)
            .env("SPARK_MEM_AVAILABLE", "1000000")
            .args(["--force-memory", "--force", "--out"])
            .arg(&out));
        assert!(
            se.contains("memory plan:") && se.contains("1.0 MB available"),
            "{se}"
        );
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("quant_report.json")).unwrap())
                .unwrap();
        let format = if answer == "x86-amx" { "w4a8" } else { "w4a16" };
        assert_eq!(report["recipe"]["format"], format, "{answer}");
        assert!(report["memory_plan"]["activations"].as_u64().unwrap() > 0);
        assert_eq!(report["scale_rule"], "signed_search", "the default");
        assert_eq!(report["objective"], "float-stream", "the default");
        assert!(report["linears"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["stream_weight"].is_number()));
        assert!(report["stream_error"].as_f64().unwrap() > 0.0);
    }
    // Positive scales on request, recorded as such.
    let pos = d.path().join("pos");
    ok(quantize()
        .args(["--quiet", "--set", "signed_scales=false", "--out"])
        .arg(&pos));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(pos.join("quant_report.json")).unwrap())
            .unwrap();
    assert_eq!(report["scale_rule"], "search");
    let store =
        spark_tool::checkpoint::TensorStore::open_file(&pos.join("model.safetensors")).unwrap();
    let scales: Vec<_> = store
        .entries()
        .filter(|e| e.name.ends_with(".scales"))
        .collect();
    assert!(!scales.is_empty());
    for e in scales {
        let v = store.to_f32(e).unwrap();
        assert!(v.iter().all(|&s| s > 0.0), "{}", e.name);
    }
    // gguf-q4_0 takes either sign on request: the file records the rule, and only the signed
    // one has negative Q4_0 block scales.
    for (sign, rule, any_negative) in [
        ("signed_scales=true", "signed_search", true),
        ("signed_scales=false", "search", false),
    ] {
        let g = d.path().join(format!("{rule}.gguf"));
        ok(quantize()
            .args(["--quiet", "--format", "gguf-q4_0", "--set", sign, "--out"])
            .arg(&g));
        let f = spark_tool::formats::gguf::GgufFile::open(&g).unwrap();
        assert_eq!(common::gguf_scale_rule(&f), rule, "{sign}");
        assert_eq!(common::gguf_quantization(&f)["objective"], "float-stream");
        let (negative, _) = common::negative_block_scales(&f);
        assert_eq!(
            negative > 0,
            any_negative,
            "{sign}: {negative} negative blocks"
        );
    }
    let phone = d.path().join("p");
    ok(common::tool()
        .env("SPARK_MEM_AVAILABLE", "1000000")
        .args([
            "export-phone",
            "--context",
            "32",
            "--samples",
            "1",
            "--seq-len",
            "8",
        ])
        .args(["--quiet", "--force-memory", "--out"])
        .arg(&phone)
        .arg(common::fixture("spark-tiny")));
    assert!(phone.join("phone_manifest.json").exists());
}

#[test]
fn the_recipe_of_an_output_reproduces_it_byte_for_byte() {
    let d = tempfile::tempdir().unwrap();
    let quantize = |args: &[&str], out: &std::path::Path| {
        ok(common::tool()
            .arg("quantize")
            .arg(common::fixture("spark-tiny"))
            .args(["--quiet", "--no-compare"])
            .args(args)
            .arg("--out")
            .arg(out));
    };
    let small = ["--samples", "4", "--seq-len", "64"];
    // A GPTQ checkpoint, with a baseline key set: its recipe.toml reproduces it.
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    quantize(&[&small[..], &["--set", "order=natural"]].concat(), &a);
    let recipe = std::fs::read_to_string(a.join("recipe.toml")).unwrap();
    assert!(
        recipe.contains("order = \"natural\"") && recipe.contains("samples = 4"),
        "{recipe}"
    );
    let file = a.join("recipe.toml");
    quantize(&["--recipe", file.to_str().unwrap()], &b);
    for f in ["model.safetensors", "config.json", "recipe.toml"] {
        assert!(
            std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(),
            "{f} differs"
        );
    }
    // A GGUF carries its recipe in its metadata; the file itself is a recipe source.
    let (g1, g2) = (d.path().join("a.gguf"), d.path().join("b.gguf"));
    quantize(&[&small[..], &["--format", "gguf-q4_0"]].concat(), &g1);
    quantize(&["--recipe", g1.to_str().unwrap()], &g2);
    assert!(
        std::fs::read(&g1).unwrap() == std::fs::read(&g2).unwrap(),
        "GGUF differs"
    );
    // A hand-written partial recipe: its keys, the defaults, and the flags over both.
    let hand = d.path().join("rtn.toml");
    std::fs::write(&hand, "method = \"rtn\"\nsamples = 2\nseq_len = 32\n").unwrap();
    let c = d.path().join("c");
    quantize(&["--recipe", hand.to_str().unwrap(), "--samples", "3"], &c);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c.join("quant_report.json")).unwrap())
            .unwrap();
    let r = &report["recipe"];
    assert_eq!(
        (r["method"].as_str(), r["samples"].as_u64()),
        (Some("rtn"), Some(3))
    );
    assert_eq!(
        r["order"], "act-static",
        "a key the file leaves out takes its default"
    );
    // A recipe that is not one is refused, naming the file and the key.
    std::fs::write(&hand, "samples = \"many\"\n").unwrap();
    let out = common::tool()
        .arg("quantize")
        .arg(common::fixture("spark-tiny"))
        .arg("--recipe")
        .arg(&hand)
        .arg("--out")
        .arg(d.path().join("bad"))
        .output()
        .unwrap();
    let se = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{se}");
    assert!(se.contains("rtn.toml") && se.contains("samples"), "{se}");
    assert!(!d.path().join("bad").exists());
}

#[test]
fn spark_target_stands_in_for_the_probe_and_a_bad_value_is_refused() {
    for (answer, format, group) in [("x86-amx", "w4a8", 128), ("x86", "w4a16", 64)] {
        let (so, _) = ok(common::tool()
            .env("SPARK_TARGET", answer)
            .args(["probe", "--json"]));
        let v: serde_json::Value = serde_json::from_str(&so).unwrap();
        assert_eq!(v["decision"]["format"], format, "{answer}");
        assert_eq!(v["decision"]["group_size"], group, "{answer}");
        assert!(
            v["decision"]["reasons"][0]
                .as_str()
                .unwrap()
                .contains("SPARK_TARGET"),
            "{so}"
        );
    }
    // An explicit --target wins over the variable.
    let (so, _) = ok(common::tool()
        .env("SPARK_TARGET", "x86")
        .args(["probe", "--json", "--target", "x86-amx"]));
    let v: serde_json::Value = serde_json::from_str(&so).unwrap();
    assert_eq!(v["decision"]["format"], "w4a8");
    let fx = common::fixture("spark-tiny");
    let fx = fx.to_str().unwrap();
    for cmd in [&["probe"][..], &["quantize", fx, "--out", "never"][..]] {
        let o = common::tool()
            .env("SPARK_TARGET", "amx")
            .args(cmd)
            .output()
            .unwrap();
        let se = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{cmd:?}: {se}");
        assert!(
            se.contains("SPARK_TARGET") && se.contains("x86-amx"),
            "{se}"
        );
        assert!(!std::path::Path::new("never").exists());
    }
}

/// A closed stdout (`spark-tool inspect | head -1`) ends the process quietly with the shell's
/// SIGPIPE status, as `ls` does, instead of a panic (exit 101).
#[test]
fn a_closed_stdout_ends_the_process_quietly() {
    let fx = common::fixture("spark-tiny");
    let prompts = common::root().join("tests/golden/prompts/spark-tiny.json");
    let parity: Vec<&std::ffi::OsStr> = vec![
        "parity".as_ref(),
        fx.as_os_str(),
        fx.as_os_str(),
        "--prompts".as_ref(),
        prompts.as_os_str(),
        "--eval-tokens".as_ref(),
        "0".as_ref(),
    ];
    for args in [vec!["inspect".as_ref(), fx.as_os_str()], parity] {
        let mut child = common::tool()
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader is gone before the first line is written.
        drop(child.stdout.take());
        let o = child.wait_with_output().unwrap();
        let se = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(141), "{args:?}: {se}");
        assert!(
            !se.contains("panicked") && !se.contains("error"),
            "{args:?}: {se}"
        );
    }
}

/// GGUF types in llama.cpp's spelling, any case; a GGUF's name must end in .gguf, and a GPTQ
/// folder's must not.
#[test]
fn gguf_formats_take_llama_cpp_spellings_and_a_gguf_name() {
    let d = tempfile::tempdir().unwrap();
    let fx = common::fixture("spark-tiny");
    let quantize = |format: &str, out: &std::path::Path| {
        common::tool()
            .arg("quantize")
            .arg(&fx)
            .args(["--format", format, "--samples", "2", "--seq-len", "16"])
            .args(["--quiet", "--no-compare", "--out"])
            .arg(out)
            .output()
            .unwrap()
    };
    let g = d.path().join("m.gguf");
    let o = quantize("Q4_K_M", &g);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f = spark_tool::formats::gguf::GgufFile::open(&g).unwrap();
    assert_eq!(
        f.get_u32("general.file_type").unwrap(),
        spark_tool::formats::gguf::mix::FileType::Q4KM.id()
    );
    for (format, out, needs) in [
        ("q4_0", "model", ".gguf"),
        ("w4a16", "model.GGUF", "--format gguf-q4_k_m"),
    ] {
        let out = d.path().join(out);
        let o = quantize(format, &out);
        let se = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{format}: {se}");
        assert!(se.contains("--out") && se.contains(needs), "{format}: {se}");
        assert!(!out.exists());
    }
}

/// `--version` names the commit, the build and this CPU's kernels; completions and the man page
/// are generated for the whole command tree.
#[test]
fn version_completions_and_man_page() {
    let (so, _) = ok(common::tool().arg("--version"));
    assert!(
        so.starts_with(&format!("spark-tool {}", env!("CARGO_PKG_VERSION"))),
        "{so}"
    );
    assert!(
        so.contains("commit ") && so.contains("release build"),
        "{so}"
    );
    assert!(
        so.contains("kernels: ") && so.contains("weight path: "),
        "{so}"
    );
    for shell in ["bash", "zsh", "fish"] {
        let (so, _) = ok(common::tool().args(["completions", shell]));
        for word in ["spark-tool", "quantize", "export-phone", "max-kl-mean"] {
            assert!(so.contains(word), "{shell}: no {word}");
        }
    }
    let (so, _) = ok(common::tool().arg("man"));
    assert!(
        so.starts_with(".ie") || so.contains(".TH spark-tool"),
        "{}",
        &so[..200.min(so.len())]
    );
    for word in ["quantize", "parity", "export\\-phone"] {
        assert!(so.contains(word), "man page without {word}");
    }
}

/// The README's jobs from a folder outside the repository, on a copy of the fixture: the
/// binary needs nothing of the checkout it was built from (calibration, prompts and held-out text
/// are compiled in), and no artifact records a path of that checkout.
#[test]
fn the_readme_jobs_run_from_a_folder_outside_the_checkout() {
    let d = tempfile::tempdir().unwrap();
    common::copy_dir(
        &common::fixture("spark-tiny"),
        &d.path().join("Spark-X2.5-tiny"),
    );
    let run = |args: &[&str]| {
        let o = common::tool()
            .current_dir(d.path())
            .args(args)
            .output()
            .unwrap();
        let text =
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{args:?}: {text}");
        text
    };
    let m = "Spark-X2.5-tiny";
    let calib = ["--samples", "8", "--seq-len", "128"];
    let q = run(&[&["quantize", m, "--out", "spark-4bit"][..], &calib].concat());
    assert!(
        q.contains("next: spark-tool parity Spark-X2.5-tiny spark-4bit"),
        "{q}"
    );
    run(&["parity", m, "spark-4bit"]);
    run(&[
        &["quantize", m, "--format", "Q4_K_M", "--out", "spark.gguf"][..],
        &calib,
    ]
    .concat());
    run(&["parity", m, "spark.gguf", "--max-new-tokens", "8"]);
    run(&[
        "export-phone",
        m,
        "--out",
        "spark-phone",
        "--context",
        "2048",
        "--samples",
        "2",
    ]);
    run(&["parity", m, "spark-phone", "--max-new-tokens", "8"]);
    run(&[
        "run",
        "spark-4bit",
        "--chat",
        "--prompt",
        "What's the weather in Paris?",
        "--max-new-tokens",
        "8",
    ]);
    let checkout = env!("CARGO_MANIFEST_DIR");
    for f in [
        "spark-4bit/config.json",
        "spark-4bit/quant_report.json",
        "spark-4bit/quant_report.html",
        "spark.gguf",
        "spark-phone/phone_manifest.json",
    ] {
        let bytes = std::fs::read(d.path().join(f)).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains(checkout),
            "{f} records the checkout's path {checkout}"
        );
    }
    let config = std::fs::read_to_string(d.path().join("spark-4bit/config.json")).unwrap();
    assert!(config.contains("bundled:spark-calib.jsonl"), "{config}");
}

#[test]
fn parity_json_dash_prints_the_report_on_stdout_and_the_text_on_stderr() {
    let fx = common::fixture("spark-tiny");
    let out = common::tool()
        .arg("parity")
        .arg(&fx)
        .arg(&fx)
        .args(["--json", "-", "--max-new-tokens", "2"])
        .output()
        .unwrap();
    let se = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{se}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is the JSON report alone");
    assert_eq!(v["overall"]["top1"].as_f64(), Some(1.0));
    assert!(se.contains("overall:") && se.contains("PASS"), "{se}");
}

/// `-q` and `-v` mean the same on every command, before or after its name: parity `-q` prints its
/// verdict alone, run `-v` adds the per-phase timers, quantize `-v` every linear's error.
#[test]
fn quiet_and_verbose_are_global() {
    let fx = common::fixture("spark-tiny");
    let parity = |q: &[&str]| {
        let out = common::tool()
            .args(q)
            .arg("parity")
            .arg(&fx)
            .arg(&fx)
            .args(["--max-new-tokens", "2", "--eval-tokens", "0"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (full, quiet) = (parity(&[]), parity(&["-q"]));
    assert!(full.contains("overall:"), "{full}");
    assert_eq!(quiet.trim().lines().count(), 1, "{quiet}");
    assert!(quiet.starts_with("PASS"), "{quiet}");
    let run = |args: &[&str]| {
        ok(common::tool()
            .arg("run")
            .arg(&fx)
            .args(["--tokens", "1,2,3", "--max-new-tokens", "2"])
            .args(args))
    };
    let (so, se) = run(&["-q"]);
    assert!(so.is_empty() && !se.contains("first token"), "{so}{se}");
    let (_, se) = run(&["-v"]);
    assert!(se.contains("first token"), "{se}");
    let err = common::tool()
        .args(["-q", "run", "-v"])
        .arg(&fx)
        .args(["--tokens", "1"])
        .output()
        .unwrap();
    assert_eq!(err.status.code(), Some(2), "-q with -v is refused");
}
