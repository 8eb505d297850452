//! `export-phone` end to end on the trained fixture: the float graph driven
//! through ONNX Runtime reproduces the engine over a long decode; the
//! calibrated w8a16 graph passes the parity gate; bad requests fail cleanly.
//! Needs the pip `onnxruntime` (tools/requirements.txt); a missing runtime is
//! a test failure, not a skip.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use spark_tool::calibration;
use spark_tool::engine::Engine;
use spark_tool::export::{export_phone, ExportOptions, Precision};
use spark_tool::model::Logits;
use spark_tool::phone::{Manifest, PhoneModel};
use spark_tool::setting::Setting;
use spark_tool::tokenizer::SparkTokenizer;

fn options(precision: Precision, context: usize) -> ExportOptions {
    common::export_options(precision, context)
}

fn exported(precision: Precision, parts: usize) -> PathBuf {
    static F32: OnceLock<PathBuf> = OnceLock::new();
    static F16: OnceLock<PathBuf> = OnceLock::new();
    static W8: OnceLock<PathBuf> = OnceLock::new();
    let cell = match precision {
        Precision::F32 => &F32,
        Precision::F16 => &F16,
        Precision::W8A16 => &W8,
        Precision::W4A16 => unreachable!("tests/phone_w4a16.rs exports GPTQ checkpoints"),
    };
    cell.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep().join("export");
        let mut o = options(precision, 2048);
        o.parts = parts;
        export_phone(&common::fixture("spark-tiny"), &dir, &o).expect("export succeeds");
        dir
    })
    .clone()
}

fn snr_db(r: &[f32], c: &[f32]) -> f64 {
    let (mut s, mut n) = (0f64, 0f64);
    for (a, b) in r.iter().zip(c) {
        s += (*a as f64).powi(2);
        n += (*a as f64 - *b as f64).powi(2);
    }
    10.0 * (s / n.max(1e-300)).log10()
}

/// A reference logit gap below this is a tie for top-k checks: ONNX Runtime's
/// MLAS picks its f32 kernels by CPU and version, so the graph's logits move
/// by ~1e-5 (the 120 dB bound below) against the engine's; 1e-3 leaves 100×.
const TIE: f32 = 1e-3;

/// Indices of the k largest, largest first (ties to the lower index).
fn ranked(x: &[f32], k: usize) -> Vec<usize> {
    let mut i: Vec<usize> = (0..x.len()).collect();
    i.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    i.truncate(k);
    i
}

/// Top-1 and the top-5 set agree wherever the reference has no near-tie at that rank.
fn assert_top_k_agree(r: &[f32], c: &[f32], what: &str) {
    let (tr, tc) = (ranked(r, 6), ranked(c, 6));
    if r[tr[0]] - r[tr[1]] > TIE {
        assert_eq!(tr[0], tc[0], "{what}: top-1 differs");
    }
    if r[tr[4]] - r[tr[5]] > TIE {
        let (mut a, mut b) = (tr[..5].to_vec(), tc[..5].to_vec());
        a.sort();
        b.sort();
        assert_eq!(a, b, "{what}: top-5 set differs");
    }
}

#[test]
fn float_graph_matches_the_engine_over_a_1100_token_decode() {
    let dir = exported(Precision::F32, 2);
    let phone = PhoneModel::open(&dir, 2).expect("ONNX Runtime loads the export");
    assert_eq!(
        phone.manifest.parts.len(),
        2,
        "split at a residual boundary"
    );
    let model = common::load("spark-tiny");
    let tok =
        SparkTokenizer::from_file(&common::fixture("spark-tiny").join("tokenizer.json")).unwrap();
    let w = calibration::build(&[spark_tool::parity::bundled_eval_text()], &tok, 1, 1100).unwrap();
    let seq = w.sample(0);
    let vocab = model.config().vocab_size;
    let want = model
        .start(seq.len())
        .unwrap()
        .forward(seq, Logits::All)
        .unwrap();
    // Token by token through the graph: >16 laps of the 63-slot sliding ring.
    let got = phone
        .start(seq.len())
        .unwrap()
        .forward(seq, Logits::All)
        .unwrap();
    assert_eq!(got.len(), want.len());
    let snr = snr_db(&want, &got);
    assert!(snr >= 120.0, "logits SNR {snr:.1} dB < 120 dB");
    for (i, (r, c)) in want
        .chunks_exact(vocab)
        .zip(got.chunks_exact(vocab))
        .enumerate()
    {
        assert_top_k_agree(r, c, &format!("step {i}"));
    }
}

#[test]
fn w8a16_graph_passes_the_parity_gate_and_ties_cache_encodings() {
    let dir = exported(Precision::W8A16, 1);
    let m = Manifest::read(&dir).unwrap();
    assert_eq!(m.precision, "w8a16");
    assert!(!m.runs_in_vllm);
    let io: Vec<_> = m
        .parts
        .iter()
        .flat_map(|p| p.inputs.iter().chain(&p.outputs))
        .collect();
    for c in &m.caches {
        let enc = |n: &str| {
            io.iter()
                .find(|i| i.name == n)
                .and_then(|i| i.encoding)
                .unwrap()
        };
        assert_eq!(
            enc(&c.key_in),
            enc(&c.key_out),
            "layer {} key encodings differ",
            c.layer
        );
        assert_eq!(
            enc(&c.value_in),
            enc(&c.value_out),
            "layer {} value encodings differ",
            c.layer
        );
        assert_eq!(enc(&c.key_in).zero_point, 0, "int16 KV is symmetric");
        let t = &m.types[&c.layer_type];
        assert_eq!(c.key_shape[3], t.past_len);
        assert_eq!(c.value_shape[2], t.past_len);
    }
    assert_eq!(m.types["sliding"].past_len, 63, "sliding_window − 1");
    assert_eq!(m.types["full"].past_len, 2047, "context − 1");
    assert!(dir.join("model.encodings").is_file());

    let out = common::tool()
        .arg("parity")
        .arg(common::fixture("spark-tiny"))
        .arg(&dir)
        .arg("--prompts")
        .arg(common::root().join("tests/golden/prompts/spark-tiny.json"))
        .args(["--max-new-tokens", "16", "--eval-tokens", "0", "--policy"])
        .arg(common::root().join("tests/phone_parity_policy.json"))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("PASS"), "{text}");
}

fn export_err(model: &Path, o: &ExportOptions) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x");
    let e = export_phone(model, &out, o)
        .expect_err("must fail")
        .to_string();
    assert!(!out.exists(), "nothing written on failure");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(
        leftovers.is_empty(),
        "no staging folder left behind: {leftovers:?}"
    );
    e
}

#[test]
fn bad_requests_fail_with_a_clear_error_and_write_nothing() {
    let tiny = common::fixture("spark-tiny");
    let e = export_err(&tiny, &options(Precision::F32, 1));
    assert!(e.contains(&format!("{} 1", Setting::Context)), "{e}");
    let mut o = options(Precision::F32, 256);
    o.parts = 99;
    assert!(export_err(&tiny, &o).contains(&format!("{} 99", Setting::Parts)));
    // spark-random has no tokenizer: w8a16 cannot calibrate on text.
    let e = export_err(
        &common::fixture("spark-random"),
        &options(Precision::W8A16, 256),
    );
    assert!(e.contains("tokenizer.json"), "{e}");
    // A folder that is not a previous export is not replaced, with or without --force.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keep.txt"), "user data").unwrap();
    for force in [false, true] {
        let mut o = options(Precision::F32, 256);
        o.force = force;
        let e = export_phone(&tiny, dir.path(), &o).unwrap_err().to_string();
        assert!(e.contains(&Setting::Force.to_string()), "{e}");
        assert!(dir.path().join("keep.txt").is_file());
    }
}

#[test]
fn untied_split_qkv_checkpoint_exports_and_runs() {
    // spark-random: untied head, split q/k/v, q_dim ≠ hidden, partial rotary.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    export_phone(
        &common::fixture("spark-random"),
        &out,
        &options(Precision::F32, 64),
    )
    .unwrap();
    let phone = PhoneModel::open(&out, 2).unwrap();
    let model = common::load("spark-random");
    let seq: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
    let want = model.start(64).unwrap().forward(&seq, Logits::All).unwrap();
    let got = phone.start(64).unwrap().forward(&seq, Logits::All).unwrap();
    let snr = snr_db(&want, &got);
    assert!(snr >= 110.0, "SNR {snr:.1} dB");
    let e = phone
        .start(65)
        .err()
        .expect("context is enforced")
        .to_string();
    assert!(e.contains(&format!("{} 65", Setting::Context)), "{e}");
}

#[test]
fn f16_export_halves_the_weights_and_stays_close() {
    let dir = exported(Precision::F16, 1);
    let f32_dir = exported(Precision::F32, 2);
    let size = |d: &Path| -> u64 {
        std::fs::read_dir(d)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".onnx.data"))
            .map(|e| e.metadata().unwrap().len())
            .sum()
    };
    let (h, f) = (size(&dir), size(&f32_dir));
    assert!(
        h * 2 <= f + 4096 && h * 2 + 4096 >= f,
        "f16 {h} B vs f32 {f} B"
    );
    let phone = PhoneModel::open(&dir, 2).unwrap();
    let model = common::load("spark-tiny");
    let seq: Vec<u32> = (0..100).map(|i| (i * 53 % 4000) as u32).collect();
    let want = model
        .start(100)
        .unwrap()
        .forward(&seq, Logits::All)
        .unwrap();
    let got = phone
        .start(100)
        .unwrap()
        .forward(&seq, Logits::All)
        .unwrap();
    let snr = snr_db(&want, &got);
    assert!((50.0..110.0).contains(&snr), "f16 weights: SNR {snr:.1} dB");
}

#[test]
fn calibrating_part_by_part_gives_the_ranges_of_the_whole_graph() {
    // Three parts are calibrated one ONNX Runtime session at a time, each fed the residual
    // stream the previous part produced; every activation the one-part export also has must
    // get exactly the same encoding (min/max over the same tokens).
    let whole = exported(Precision::W8A16, 1);
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(Precision::W8A16, 2048);
    o.parts = 3;
    export_phone(&common::fixture("spark-tiny"), &dir.path().join("e"), &o).unwrap();
    let (a, b) = (
        common::activation_encodings(&whole),
        common::activation_encodings(&dir.path().join("e")),
    );
    // A part's first norm appends to `hidden_states_in`, whose encoding spans every boundary's
    // stream, so its Concat (which moves data on its input's grid) differs with it.
    let man: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("e/phone_manifest.json")).unwrap(),
    )
    .unwrap();
    let boundary: Vec<String> = man["parts"].as_array().unwrap()[1..]
        .iter()
        .map(|p| format!("l{}_ln1_aug", p["layers"][0]))
        .collect();
    assert_eq!(boundary.len(), 2);
    let common: Vec<&String> = a
        .keys()
        .filter(|k| b.contains_key(*k) && !boundary.contains(k))
        .collect();
    // All but the tensors renamed at the two part boundaries and the two Concats reading them.
    assert!(
        common.len() + 6 >= a.len() && common.len() > 100,
        "{} of {}",
        common.len(),
        a.len()
    );
    for k in common {
        assert_eq!(a[k], b[k], "{k}");
    }
}

#[test]
fn native_calibration_gives_the_ranges_of_onnxruntime_stepping_the_float_graph() {
    // Two parts (the hand-over tensors), windows longer than the sliding window (its ring wraps),
    // and a context the windows fill (the full layers' caches end full, with no unwritten slot).
    let mut o = options(Precision::W8A16, 96);
    o.parts = 2;
    o.calib_samples = 3;
    o.calib_seq_len = 200;
    common::assert_calibrators_agree(&common::fixture("spark-tiny"), o);
}
