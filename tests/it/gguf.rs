//! `quantize --format gguf-*` on the trained fixture: the file holds llama.cpp's tensor types,
//! dequantizes bit-exactly to the weights the solve produced (our reader here; the pip `gguf`
//! package's dequantizer through tools/gguf_check.py), carries the same metadata as the
//! converter-equivalent tools/gguf_from_hf.py, and is written like every artifact of ours.
//! With `SPARK_REQUIRE_GGUF=1` (tools/test.sh) a missing `gguf` package is a failure, not a skip.

use crate::common;

use std::path::Path;
use std::process::Command;

use spark_tool::checkpoint::write::{write_safetensors_atomic, OwnedTensor};
use spark_tool::checkpoint::TensorStore;
use spark_tool::device::WeightFormat;
use spark_tool::formats::gguf::mix::FileType;
use spark_tool::formats::gguf::{GgmlType, GgufFile, Value};
use spark_tool::load::GgufNumerics;
use spark_tool::quant::grid::ScaleRule;
use spark_tool::quantize::{quantize, ForwardPrecision, QuantizeOptions};

fn options(out: &Path, ft: FileType) -> QuantizeOptions {
    let mut o =
        common::quantize_options(&common::fixture("spark-tiny"), out, WeightFormat::W4A16, 32);
    (o.recipe.samples, o.recipe.seq_len, o.compare, o.recipe.gguf) = (8, 128, false, Some(ft));
    o.recipe.forward_precision = ForwardPrecision::F32;
    o
}

fn python(args: &[&str]) {
    let out = Command::new("python3").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "python3 {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprint!("{}", String::from_utf8_lossy(&out.stdout));
}

/// Quantize to `ft`, then check types, exact decode and the file's bookkeeping.
fn round_trip(ft: FileType, want: &[(&str, GgmlType)]) {
    let d = tempfile::tempdir().unwrap();
    let (path, dump) = (
        d.path().join("m.gguf"),
        d.path().join("m.dequant.safetensors"),
    );
    let mut o = options(&path, ft);
    o.dump_dequantized = Some(dump.clone());
    let report = quantize(&o).unwrap();
    assert_eq!(report.recipe.gguf, Some(ft));
    let f = GgufFile::open(&path).unwrap();
    for (name, ty) in want {
        let t = f.tensors().iter().find(|t| t.name == *name).unwrap();
        assert_eq!(t.ty, *ty, "{name}");
    }
    // Q4_0 and Q8_0 blocks open with a signed fp16 `d`: by default the solve gives some of them
    // the negative sign (the grid's long side to the block's positive weights); the K-quants
    // keep positive scales.
    let signed = matches!(ft, FileType::Q4_0 | FileType::Q8_0);
    assert_eq!(
        report.scale_rule,
        if signed {
            ScaleRule::SignedSearch
        } else {
            ScaleRule::Search
        }
    );
    assert_eq!(
        common::gguf_scale_rule(&f),
        serde_json::to_value(report.scale_rule).unwrap(),
        "the file records the rule"
    );
    let (negative, blocks) = common::negative_block_scales(&f);
    if signed {
        // About half of Q4_0's blocks; fewer of Q8_0's, whose one extra step matters less.
        assert!(
            negative > blocks / 50 && negative < blocks,
            "{negative} of {blocks} block scales negative"
        );
        eprintln!("{ft:?}: {negative} of {blocks} block scales negative");
    }
    assert_eq!(f.tensors().len(), 2 + 8 * 8, "tied: no output.weight");
    // Every solved tensor decodes to exactly what the solve computed with.
    let checked = assert_decodes_to(&f, &dump);
    assert_eq!(checked, 1 + 8 * 6, "the head and six linears per layer");
    assert!(matches!(
        f.kv("general.file_type"),
        Some(Value::U32(v)) if *v == ft.id()
    ));
    assert!(f.kv("spark_tool.quantization").is_some());
    let r = spark_tool::inspect::inspect_gguf(&path).unwrap();
    assert_eq!((r.layers, r.hidden_size, r.tied_head), (8, 256, true));
    assert!(r.producer.is_some() && r.quantization.is_some());
    assert_eq!(r.tensor_types.values().sum::<usize>(), f.tensors().len());
    if common::have_gguf() {
        let (p, dp) = (path.to_str().unwrap(), dump.to_str().unwrap());
        python(&["tools/gguf_check.py", p, dp]);
        // The metadata equals the converter-equivalent script's, but for the file type.
        let reference = d.path().join("ref.gguf");
        python(&[
            "tools/gguf_from_hf.py",
            common::fixture("spark-tiny").to_str().unwrap(),
            reference.to_str().unwrap(),
            "--outtype",
            "f32",
        ]);
        python(&[
            "tools/gguf_check.py",
            p,
            "--same-metadata",
            reference.to_str().unwrap(),
        ]);
    }
}

/// Every tensor of `f` the solve dumped to `dump` decodes to exactly those values (the rest are
/// F32 norms); returns how many were compared.
fn assert_decodes_to(f: &GgufFile, dump: &Path) -> usize {
    let store = TensorStore::open_file(dump).unwrap();
    let mut checked = 0;
    for t in f.tensors() {
        let Some(e) = store.get(&t.name) else {
            assert!(t.name.ends_with("norm.weight"), "{} was not dumped", t.name);
            assert_eq!(t.ty, GgmlType::F32);
            continue;
        };
        let want = store.to_f32(e).unwrap();
        let got = f.dequantize(&t.name).unwrap();
        assert_eq!(got.len(), want.len(), "{}", t.name);
        let diff = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(diff, 0, "{}: {diff} values differ from the solve", t.name);
        checked += 1;
    }
    checked
}

/// The fixture's GGUF at `path` gives each named tensor its type, and every solved tensor decodes
/// bit for bit to the solve's `dump`, in our reader and (when installed) in llama.cpp's `gguf`.
fn assert_types_and_solved_weights(path: &Path, dump: &Path, want: &[(&str, GgmlType)]) {
    let f = GgufFile::open(path).unwrap();
    for (name, ty) in want {
        let t = f.tensors().iter().find(|t| t.name == *name).unwrap();
        assert_eq!(t.ty, *ty, "{name}");
    }
    assert_eq!(assert_decodes_to(&f, dump), 1 + 8 * 6);
    if common::have_gguf() {
        python(&[
            "tools/gguf_check.py",
            path.to_str().unwrap(),
            dump.to_str().unwrap(),
        ]);
    }
}

/// A copy of spark-tiny at `dst` whose MLP is `width` wide (the first `width` rows of gate and
/// up, the first `width` columns of down).
fn narrowed_fixture(dst: &Path, width: usize) {
    common::copy_dir(&common::fixture("spark-tiny"), dst);
    let file = dst.join("model.safetensors");
    let store = TensorStore::open_file(&file).unwrap();
    let mut tensors = Vec::new();
    for e in store.entries() {
        let (bytes, size) = (store.bytes(e), e.dtype.bitsize() / 8);
        let (shape, data) =
            if e.name.ends_with("gate_proj.weight") || e.name.ends_with("up_proj.weight") {
                let k = e.shape[1];
                (vec![width, k], bytes[..width * k * size].to_vec())
            } else if e.name.ends_with("down_proj.weight") {
                let (n, k) = (e.shape[0], e.shape[1]);
                let rows = (0..n).flat_map(|r| &bytes[r * k * size..(r * k + width) * size]);
                (vec![n, width], rows.copied().collect())
            } else {
                (e.shape.clone(), bytes.to_vec())
            };
        tensors.push(OwnedTensor {
            name: e.name.clone(),
            dtype: e.dtype,
            shape,
            data,
        });
    }
    drop(store);
    write_safetensors_atomic(&file, &tensors, None).unwrap();
    let cfg_path = dst.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["intermediate_size"] = serde_json::json!(width);
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
}

#[test]
fn rows_that_are_not_whole_k_blocks_take_llama_cpps_fallback_types() {
    // 704 = 2.75 × 256: down_proj's rows fit no K-quant block, so Q4_K_M gives it Q5_0 (Q8_0 in
    // the layers where llama.cpp gives ffn_down Q6_K), as llama-quantize does; the rest keep
    // their K-quants.
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("narrow");
    narrowed_fixture(&model, 704);
    let (path, dump) = (
        d.path().join("m.gguf"),
        d.path().join("m.dequant.safetensors"),
    );
    let mut o = common::quantize_options(&model, &path, WeightFormat::W4A16, 32);
    (o.recipe.samples, o.recipe.seq_len, o.compare) = (8, 128, false);
    (o.recipe.gguf, o.recipe.forward_precision) = (Some(FileType::Q4KM), ForwardPrecision::F32);
    o.dump_dequantized = Some(dump.clone());
    quantize(&o).unwrap();
    assert_types_and_solved_weights(
        &path,
        &dump,
        &[
            ("blk.0.ffn_down.weight", GgmlType::Q8_0),
            ("blk.1.ffn_down.weight", GgmlType::Q5_0),
            ("blk.1.ffn_up.weight", GgmlType::Q4_K),
            ("blk.0.attn_qkv.weight", GgmlType::Q6_K),
            ("token_embd.weight", GgmlType::Q6_K),
        ],
    );
    // Our engine runs it, and parity's built-in 4-bit policy passes it against its float model.
    let out = common::tool()
        .arg("parity")
        .arg(&model)
        .arg(&path)
        .args(["--max-new-tokens", "8"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn q4_k_m_has_llama_cpp_types_and_decodes_to_the_solved_weights() {
    round_trip(
        FileType::Q4KM,
        &[
            ("token_embd.weight", GgmlType::Q6_K),
            ("blk.0.attn_qkv.weight", GgmlType::Q6_K),
            ("blk.1.attn_qkv.weight", GgmlType::Q4_K),
            ("blk.3.ffn_down.weight", GgmlType::Q6_K),
            ("blk.4.ffn_down.weight", GgmlType::Q4_K),
            ("blk.2.attn_gate.weight", GgmlType::Q4_K),
            ("blk.2.ffn_up.weight", GgmlType::Q4_K),
            ("output_norm.weight", GgmlType::F32),
        ],
    );
}

/// Q5_K_M: Q4_K_M's rule on Q5_K, its blocks decoded bit for bit by our reader and gguf-py.
#[test]
fn q5_k_m_has_llama_cpp_types_and_decodes_to_the_solved_weights() {
    round_trip(
        FileType::Q5KM,
        &[
            ("token_embd.weight", GgmlType::Q6_K),
            ("blk.0.attn_qkv.weight", GgmlType::Q6_K),
            ("blk.1.attn_qkv.weight", GgmlType::Q5_K),
            ("blk.3.ffn_down.weight", GgmlType::Q6_K),
            ("blk.4.ffn_down.weight", GgmlType::Q5_K),
            ("blk.2.attn_gate.weight", GgmlType::Q5_K),
            ("blk.2.ffn_up.weight", GgmlType::Q5_K),
            ("output_norm.weight", GgmlType::F32),
        ],
    );
}

#[test]
fn q4_0_and_q8_0_decode_to_the_solved_weights() {
    round_trip(
        FileType::Q4_0,
        &[
            ("token_embd.weight", GgmlType::Q6_K),
            ("blk.0.attn_qkv.weight", GgmlType::Q4_0),
            ("blk.7.ffn_down.weight", GgmlType::Q4_0),
        ],
    );
    round_trip(
        FileType::Q8_0,
        &[
            ("token_embd.weight", GgmlType::Q8_0),
            ("blk.0.attn_gate.weight", GgmlType::Q8_0),
        ],
    );
}

#[test]
fn a_file_that_is_not_ours_is_never_replaced() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("m.gguf");
    std::fs::write(&path, b"a user's file").unwrap();
    let mut o = options(&path, FileType::Q8_0);
    o.force = true;
    let e = quantize(&o).unwrap_err().to_string();
    assert!(e.contains("not a previous output"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"a user's file");
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        1,
        "nothing left behind"
    );
}

#[test]
fn our_previous_file_is_replaced_only_with_force() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("m.gguf");
    let mut o = options(&path, FileType::Q8_0);
    (o.recipe.samples, o.recipe.seq_len) = (2, 32);
    quantize(&o).unwrap();
    let first = std::fs::read(&path).unwrap();
    let e = quantize(&o).unwrap_err().to_string();
    assert!(e.contains("force"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), first);
    o.force = true;
    o.recipe.gguf = Some(FileType::Q4_0);
    quantize(&o).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert!(matches!(f.kv("general.file_type"), Some(Value::U32(2))));
    let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "the staging folder is gone");
}

/// Logits of `path` (any artifact `load::open` takes) for a few tokens, a GGUF run as
/// llama.cpp's CPU backend runs it.
fn logits(path: &Path) -> Vec<f32> {
    logits_with(path, GgufNumerics::Ggml)
}

fn logits_with(path: &Path, numerics: GgufNumerics) -> Vec<f32> {
    let opened = spark_tool::load::open(
        path,
        |ck| spark_tool::model::LoadOptions::for_checkpoint(ck, false),
        numerics,
        1,
    )
    .unwrap();
    let mut seq = opened.engine.start(64).unwrap();
    seq.forward(
        &[11, 230, 7, 1999, 42, 3000, 5],
        spark_tool::model::Logits::All,
    )
    .unwrap()
}

#[test]
fn run_and_parity_read_gguf_files() {
    let d = tempfile::tempdir().unwrap();
    let fixture = common::fixture("spark-tiny");
    let reference = logits(&fixture);
    // Ours: the engine reads the file's own config and runs the dequantized weights.
    let path = d.path().join("m.gguf");
    let mut o = options(&path, FileType::Q8_0);
    (o.recipe.samples, o.recipe.seq_len) = (4, 64);
    quantize(&o).unwrap();
    let q = logits(&path);
    assert_eq!(q.len(), reference.len());
    let worst = q
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst > 0.0 && worst < 0.5, "Q8_0 logits off by {worst}");
    // With f32 activations only the weights differ from the reference; llama.cpp's 8-bit
    // activation blocks move the logits further, by a small amount.
    let w_only = logits_with(&path, GgufNumerics::F32);
    let moved = q
        .iter()
        .zip(&w_only)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 0.0 && moved < 0.5,
        "q8_0 activations moved the logits by {moved}"
    );
    if common::have_gguf() {
        // The converter-equivalent F32 file holds the checkpoint's weights exactly: only the
        // kernels differ (the bf16 checkpoint runs the bf16 kernel, the file the f32 GEMM), so
        // the logits agree to f32 summation-order noise.
        let f32_file = d.path().join("f32.gguf");
        python(&[
            "tools/gguf_from_hf.py",
            fixture.to_str().unwrap(),
            f32_file.to_str().unwrap(),
            "--outtype",
            "f32",
        ]);
        let exact = logits(&f32_file);
        // An F32 tensor's vec_dot type is F32: both numerics run the same arithmetic.
        assert_eq!(exact, logits_with(&f32_file, GgufNumerics::F32));
        let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
        let off = exact
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            off <= 1e-4 * scale,
            "F32 GGUF logits off by {off} (max |logit| {scale})"
        );
    }
}

#[test]
fn run_encodes_a_gguf_prompt_only_with_a_tokenizer_of_the_files_vocabulary() {
    let d = tempfile::tempdir().unwrap();
    let fixture = common::fixture("spark-tiny");
    let path = d.path().join("m.gguf");
    let mut o = options(&path, FileType::Q4_0);
    (o.recipe.samples, o.recipe.seq_len) = (4, 64);
    quantize(&o).unwrap();
    let run = |extra: &[&str], logits: &str| {
        let out = common::tool()
            .arg("run")
            .arg(&path)
            .args(extra)
            .args(["--max-new-tokens", "3", "--quiet", "--logits-out"])
            .arg(d.path().join(logits))
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let text = "Hello, world";
    // A GGUF carries no tokenizer.json: the message says how to give it one.
    let (ok, err) = run(&["--prompt", text], "none.safetensors");
    assert!(!ok && err.contains("--tokenizer MODEL_DIR"), "{err}");
    // The model's own tokenizer encodes the prompt as it encodes it for the checkpoint.
    let ids = spark_tool::tokenizer::SparkTokenizer::from_file(&fixture.join("tokenizer.json"))
        .unwrap()
        .encode(text)
        .unwrap();
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let (ok, err) = run(&["--tokens", &ids.join(",")], "ids.safetensors");
    assert!(ok, "{err}");
    let fx = fixture.to_str().unwrap();
    let (ok, err) = run(&["--tokenizer", fx, "--prompt", text], "text.safetensors");
    assert!(ok, "{err}");
    let read = |f: &str| std::fs::read(d.path().join(f)).unwrap();
    assert_eq!(read("text.safetensors"), read("ids.safetensors"));
    // Another vocabulary would give other ids: refused, naming what differs.
    let docs = common::fixture("spark-docs");
    let (ok, err) = run(
        &["--tokenizer", docs.to_str().unwrap(), "--prompt", text],
        "docs.safetensors",
    );
    assert!(
        !ok && err.contains("tokenizer.ggml.tokens differs"),
        "{err}"
    );
    assert!(!d.path().join("docs.safetensors").exists());
    // A tokenizer.json beside the file serves without the flag; a wrong one is named and unused.
    std::fs::copy(docs.join("tokenizer.json"), d.path().join("tokenizer.json")).unwrap();
    let (ok, err) = run(&["--prompt", text], "beside-docs.safetensors");
    assert!(!ok && err.contains("it is not used"), "{err}");
    std::fs::copy(
        fixture.join("tokenizer.json"),
        d.path().join("tokenizer.json"),
    )
    .unwrap();
    let (ok, err) = run(&["--prompt", text], "beside.safetensors");
    assert!(ok, "{err}");
    assert_eq!(read("beside.safetensors"), read("ids.safetensors"));
}

#[test]
fn a_model_without_one_layer_type_is_refused_before_the_solve() {
    // llama.cpp reads both layer types' rope keys; a config keeps only the types its layers use.
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("all-sliding");
    common::copy_dir(&common::fixture("spark-tiny"), &model);
    let cfg_path = model.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["layer_types"] = serde_json::json!(vec!["sliding_attention"; 8]);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let out = d.path().join("m.gguf");
    let mut o = options(&out, FileType::Q4_0);
    o.model_dir = model;
    let e = quantize(&o).unwrap_err().to_string();
    assert!(
        e.contains("rope parameters") && e.contains("full_attention"),
        "{e}"
    );
    assert!(!out.exists());
    assert!(
        !d.path().join(".m.gguf.partial").exists(),
        "nothing left behind"
    );
}

#[test]
fn tensor_type_overrides_are_written_recorded_and_reproduced() {
    // llama-quantize's --tensor-type: the first pattern found in a tensor's name gives its type.
    let d = tempfile::tempdir().unwrap();
    let (path, dump) = (
        d.path().join("m.gguf"),
        d.path().join("m.dequant.safetensors"),
    );
    let quantize = |args: &[&str], out: &Path| {
        let o = common::tool()
            .arg("quantize")
            .arg(common::fixture("spark-tiny"))
            .args([
                "--quiet",
                "--no-compare",
                "--samples",
                "4",
                "--seq-len",
                "64",
            ])
            .args(args)
            .arg("--out")
            .arg(out)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, se) = quantize(
        &[
            "--format",
            "Q4_K_M",
            "--tensor-type",
            r"blk\.1\.ffn_down=q8_0",
            "--tensor-type",
            "ffn_down=Q5_0",
            "--tensor-type",
            "token_embd=q8_0",
            "--dump-dequantized",
            dump.to_str().unwrap(),
        ],
        &path,
    );
    assert_eq!(code, Some(0), "{se}");
    assert_types_and_solved_weights(
        &path,
        &dump,
        &[
            ("blk.1.ffn_down.weight", GgmlType::Q8_0),
            ("blk.0.ffn_down.weight", GgmlType::Q5_0),
            ("blk.3.ffn_down.weight", GgmlType::Q5_0),
            ("blk.0.attn_qkv.weight", GgmlType::Q6_K),
            ("blk.1.ffn_up.weight", GgmlType::Q4_K),
            ("token_embd.weight", GgmlType::Q8_0),
        ],
    );
    // The overrides are in the file's recipe, which reproduces it.
    let again = d.path().join("again.gguf");
    let (code, se) = quantize(&["--recipe", path.to_str().unwrap()], &again);
    assert_eq!(code, Some(0), "{se}");
    assert!(std::fs::read(&path).unwrap() == std::fs::read(&again).unwrap());
    // A type spark-tool does not solve, and a GPTQ output, are refused by name.
    let (code, se) = quantize(
        &["--format", "q4_0", "--tensor-type", "ffn_up=q3_k"],
        &d.path().join("x.gguf"),
    );
    assert_eq!(code, Some(2));
    assert!(se.contains("q3_k") && se.contains("Q5_0"), "{se}");
    let (code, se) = quantize(&["--tensor-type", "ffn_up=q8_0"], &d.path().join("gptq"));
    assert_eq!(code, Some(2));
    assert!(se.contains("GGUF files only"), "{se}");
}
