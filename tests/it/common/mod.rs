//! Shared helpers for the integration tests: fixture paths and golden files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use spark_tool::checkpoint::{Checkpoint, TensorStore};
use spark_tool::device::{self, Priority, Target, WeightFormat};
use spark_tool::model::SparkModel;
use spark_tool::quant::Order;
use spark_tool::quantize::{QuantizeOptions, Recipe};

/// The binary under test: this build's, or `SPARK_TOOL_BIN` (docs/RELIABILITY.md runs the
/// data-loss cases against an older build to show they catch what it did).
pub fn bin() -> PathBuf {
    std::env::var_os("SPARK_TOOL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_spark-tool").into())
}

/// The probe's two x86 answers: W4A8 on AMX, W4A16 elsewhere. A test of the defaults runs under
/// both (SPARK_TARGET), so neither machine kind's path goes untested on the other.
pub const PROBE_ANSWERS: [&str; 2] = ["x86-amx", "x86"];

/// The binary with the probe's answer pinned (SPARK_TARGET): no test depends on the CPU it runs
/// on. The pin is `x86` unless `SPARK_TEST_TARGET` names another answer, for running the whole
/// suite under each (docs/TESTING.md); a test of the defaults sets each of [`PROBE_ANSWERS`] itself.
pub fn tool() -> std::process::Command {
    let mut c = std::process::Command::new(bin());
    let pin = std::env::var("SPARK_TEST_TARGET").unwrap_or_else(|_| "x86".into());
    c.env("SPARK_TARGET", pin);
    c
}

/// Every gate of a parity JSON report passed at least `min` inside its limit (headroom: the share of
/// the limit's distance from the ideal left over). Prints the headroom of each gate either way.
pub fn assert_headroom(report: &serde_json::Value, min: f64, what: &str) {
    let gates = report["gates"]
        .as_array()
        .expect("gates in the parity report");
    assert!(!gates.is_empty(), "{what}: no gate was set");
    let line = gates
        .iter()
        .map(|g| {
            format!(
                "{} {:.4} vs {} (headroom {:.0} %)",
                g["name"].as_str().unwrap(),
                g["figure"].as_f64().unwrap_or(f64::NAN),
                g["limit"],
                100.0 * g["headroom"].as_f64().unwrap_or(f64::NEG_INFINITY)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    eprintln!("{what}: {line}");
    for g in gates {
        let h = g["headroom"].as_f64().unwrap_or(f64::NEG_INFINITY);
        assert!(
            h >= min,
            "{what}: {} has {:.0} % headroom, under the {:.0} % a gated test keeps: {line}",
            g["name"],
            100.0 * h,
            100.0 * min
        );
    }
}

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(name: &str) -> PathBuf {
    root().join("fixtures").join(name)
}

pub fn load(name: &str) -> SparkModel {
    let ck = Checkpoint::open(&fixture(name)).expect("fixture opens");
    SparkModel::from_checkpoint(&ck, false).expect("fixture loads")
}

/// Golden outputs of tools/spark_ref.py. `SPARK_GOLDEN_DIR` points the tests at a
/// freshly generated set (CI regenerates them with the Python reference).
pub fn golden_dir() -> PathBuf {
    std::env::var_os("SPARK_GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("tests/golden"))
}

pub struct GoldenPrompt {
    pub name: String,
    pub text: Option<String>,
    pub chat: bool,
    pub system: Option<String>,
    pub thinking: bool,
    pub tokens: Vec<u32>,
    pub greedy: Vec<u32>,
    pub greedy_margins: Vec<f64>,
    /// `[tokens, vocab]`
    pub logits: Vec<f32>,
}

pub struct Golden {
    pub logits_dtype: String,
    pub prompts: Vec<GoldenPrompt>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub fn golden(fixture_name: &str) -> Golden {
    let dir = golden_dir();
    let meta_path = dir.join(format!("{fixture_name}.json"));
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&meta_path)
            .unwrap_or_else(|e| panic!("{}: {e}", meta_path.display())),
    )
    .expect("golden json");
    let store = TensorStore::open_file(&dir.join(format!("{fixture_name}.safetensors")))
        .expect("golden safetensors");
    let prompts = meta["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let e = store.get(&format!("p{i}.logits")).expect("logits tensor");
            GoldenPrompt {
                name: p["name"].as_str().unwrap().to_string(),
                text: p["text"].as_str().map(String::from),
                chat: p["chat"].as_bool().unwrap_or(false),
                system: p["system"].as_str().map(String::from),
                thinking: p["thinking"].as_bool().unwrap_or(true),
                tokens: ids(&p["tokens"]),
                greedy: ids(&p["greedy"]),
                greedy_margins: p["greedy_margins"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect(),
                logits: store.to_f32(e).expect("logits convert"),
            }
        })
        .collect();
    Golden {
        logits_dtype: meta["logits_dtype"].as_str().unwrap().to_string(),
        prompts,
    }
}

/// Copy a folder's files and subfolders (not links).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        } else if t.is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        }
    }
}

/// `quantize` options for tests: GPTQ + scale search on 16 × 128 bundled calibration tokens,
/// the comparison columns on, nothing forced.
pub fn quantize_options(
    model: &Path,
    out: &Path,
    format: WeightFormat,
    group_size: usize,
) -> QuantizeOptions {
    let recipe = Recipe {
        format,
        group_size,
        order: Order::Natural,
        objective: spark_tool::quantize::Objective::FloatOutput,
        samples: 16,
        seq_len: 128,
        ..Recipe::default()
    };
    let path = device::decide(
        &device::CpuFeatures::default(),
        Target::X86,
        Priority::Speed,
    );
    let mut o = QuantizeOptions::new(model, out, recipe, path);
    o.compare = true;
    o.keep_on_interrupt = true;
    o
}

/// `export-phone` options for tests: the CLI's defaults, one part, 2 threads.
pub fn export_options(
    precision: spark_tool::export::Precision,
    context: usize,
) -> spark_tool::export::ExportOptions {
    spark_tool::export::ExportOptions {
        context,
        precision,
        kv: spark_tool::phone::QType::Int16,
        parts: 1,
        calibration: Vec::new(),
        // The CLI defaults: 2048 calibration tokens (4×128 clips the zh/de prompts' outliers).
        calib_samples: 8,
        calib_seq_len: 256,
        range_margin: 2.0,
        calibrator: spark_tool::export::Calibrator::Native,
        force: false,
        force_memory: false,
        progress: false,
        threads: 2,
    }
}

/// Every file below `dir` with its bytes, to prove nothing changed.
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Whether Python with the `gguf` package is there; a failure when the test script requires it.
pub fn have_gguf() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import gguf"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("SPARK_REQUIRE_GGUF").is_none(),
            "SPARK_REQUIRE_GGUF is set but python3 cannot import gguf"
        );
        eprintln!("skipped: python3 with the `gguf` package is not available");
    }
    ok
}

/// Every activation encoding of a quantized phone export (`model.encodings`): scale and offset.
pub fn activation_encodings(dir: &Path) -> std::collections::BTreeMap<String, (f64, i64)> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.encodings")).unwrap())
            .unwrap();
    v["activation_encodings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_string(),
                (
                    e["scale"][0].as_f64().unwrap(),
                    e["offset"][0].as_i64().unwrap(),
                ),
            )
        })
        .collect()
}

/// Exports of `model` whose ranges come from the native calibrator and from ONNX Runtime stepping
/// the float graph: the same tensors, each scale within 1e-5 relative and each offset within one
/// step (summation order differs; measured: ≤ 7e-7 and identical offsets on the fixture).
pub fn assert_calibrators_agree(model: &Path, mut o: spark_tool::export::ExportOptions) {
    use spark_tool::export::{export_phone, Calibrator};
    let dir = tempfile::tempdir().unwrap();
    let mut enc = Vec::new();
    for (name, c) in [
        ("native", Calibrator::Native),
        ("ort", Calibrator::OnnxRuntime),
    ] {
        o.calibrator = c;
        let r = export_phone(model, &dir.path().join(name), &o).expect("export");
        // The report says how, and over how many tokens (windows are cut to the context).
        assert_eq!(r.calibrator, Some(c));
        assert_eq!(
            r.calibration_tokens,
            o.calib_samples * o.calib_seq_len.min(o.context)
        );
        enc.push(activation_encodings(&dir.path().join(name)));
    }
    let (a, b) = (&enc[0], &enc[1]);
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same tensors are encoded"
    );
    assert!(a.len() > 100, "{} encodings", a.len());
    for (k, (sa, oa)) in a {
        let (sb, ob) = b[k];
        assert!(
            (sa - sb).abs() <= 1e-5 * sb.abs() && (oa - ob).abs() <= 1,
            "{k}: native scale {sa:e} offset {oa}, ONNX Runtime scale {sb:e} offset {ob}"
        );
    }
}

/// Of a GGUF's Q4_0 and Q8_0 blocks, how many have a negative `d` (the fp16 each block opens
/// with), and how many there are.
pub fn negative_block_scales(f: &spark_tool::formats::gguf::GgufFile) -> (usize, usize) {
    use spark_tool::formats::gguf::GgmlType;
    let (mut negative, mut blocks) = (0, 0);
    for t in f.tensors() {
        if !matches!(t.ty, GgmlType::Q4_0 | GgmlType::Q8_0) {
            continue;
        }
        for b in f
            .tensor_bytes(&t.name)
            .unwrap()
            .chunks_exact(t.ty.block_bytes())
        {
            negative += (half::f16::from_le_bytes([b[0], b[1]]).to_f32() < 0.0) as usize;
            blocks += 1;
        }
    }
    (negative, blocks)
}

/// The scale rule a GGUF of ours records in `spark_tool.quantization`.
pub fn gguf_scale_rule(f: &spark_tool::formats::gguf::GgufFile) -> serde_json::Value {
    gguf_quantization(f)["scale_rule"].clone()
}

/// The quantize settings a GGUF records (`spark_tool.quantization`).
pub fn gguf_quantization(f: &spark_tool::formats::gguf::GgufFile) -> serde_json::Value {
    serde_json::from_str(f.get_str("spark_tool.quantization").unwrap()).unwrap()
}

/// An I32 tensor's values (GPTQ `qweight`, `qzeros`, `g_idx`).
pub fn i32s(store: &TensorStore, name: &str) -> Vec<i32> {
    let e = store.get(name).unwrap_or_else(|| panic!("missing {name}"));
    store
        .bytes(e)
        .chunks(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}
