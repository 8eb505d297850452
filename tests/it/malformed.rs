//! The malformed-input corpus: generated cases over every subcommand and input kind (checkpoint
//! files, index, config, tokenizer, GPTQ tensors, calibration files, policies, phone manifests,
//! CLI values, output paths, resource limits), each run through the real binary and checked for:
//! no panic, no signal, no hang, the promised exit code, a message that names the culprit (file,
//! tensor, key or flag) and says what was expected, and a working folder byte-identical
//! afterwards (nothing left behind, nothing of the user's touched).
//!
//! Faults are separate tests: SIGKILL at several points of quantize and export, a full disk, a
//! mount point as `--out`, read-only locations. Mounting needs root; without it those tests print
//! that they were skipped, and `SPARK_REQUIRE_MOUNT=1` turns a skip into a failure.
//!
//! Every input is a copy: a regression cannot damage the repository's fixtures.

use crate::common;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// A case running longer than this is a hang.
const HANG: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------- files

/// Every file below `dir` (relative path → sha256), to prove a run changed nothing.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(dir).unwrap().to_path_buf();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                out.insert(rel.join(""), "dir".into());
                stack.push(p);
            } else {
                let bytes = std::fs::read(&p).unwrap_or_default();
                out.insert(rel, format!("{:x}", Sha256::digest(&bytes)));
            }
        }
    }
    out
}

/// `to` gets `from`'s files as hard links (cheap; a mutation writes a new file in their place).
fn link_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::hard_link(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Replace a (possibly hard-linked) file by a new one, never writing through the link.
fn replace(path: &Path, bytes: &[u8]) {
    let _ = std::fs::remove_file(path);
    std::fs::write(path, bytes).unwrap();
}

/// A safetensors file as (header object, data section).
fn read_st(path: &Path) -> (serde_json::Map<String, Value>, Vec<u8>) {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    (h.as_object().unwrap().clone(), b[8 + n..].to_vec())
}

fn st_bytes(header: &Value, data: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

/// Tensors of a safetensors header, in file order, with their bytes.
struct Tensors(Vec<(String, Value, Vec<u8>)>, Option<Value>);

impl Tensors {
    fn read(path: &Path) -> Self {
        let (h, data) = read_st(path);
        let meta = h.get("__metadata__").cloned();
        let mut v: Vec<(String, Value, Vec<u8>)> = h
            .into_iter()
            .filter(|(k, _)| k != "__metadata__")
            .map(|(k, v)| {
                let o = v["data_offsets"].as_array().unwrap();
                let (a, b) = (
                    o[0].as_u64().unwrap() as usize,
                    o[1].as_u64().unwrap() as usize,
                );
                (k, v, data[a..b].to_vec())
            })
            .collect();
        v.sort_by_key(|t| t.1["data_offsets"][0].as_u64().unwrap());
        Tensors(v, meta)
    }

    fn names(&self) -> Vec<String> {
        self.0.iter().map(|t| t.0.clone()).collect()
    }

    /// A consistent file (offsets laid out afresh).
    fn bytes(&self) -> Vec<u8> {
        let mut h = serde_json::Map::new();
        if let Some(m) = &self.1 {
            h.insert("__metadata__".into(), m.clone());
        }
        let mut data = Vec::new();
        for (name, info, bytes) in &self.0 {
            let mut info = info.clone();
            info["data_offsets"] = json!([data.len(), data.len() + bytes.len()]);
            h.insert(name.clone(), info);
            data.extend_from_slice(bytes);
        }
        st_bytes(&Value::Object(h), &data)
    }

    fn get(&mut self, name: &str) -> &mut (String, Value, Vec<u8>) {
        self.0.iter_mut().find(|t| t.0 == name).unwrap()
    }
}

// ---------------------------------------------------------------- shared inputs

struct Shared {
    _dir: tempfile::TempDir,
    /// Pristine copies (hard-link sources; checked unchanged at the end).
    tiny: PathBuf,
    random: PathBuf,
    /// A quantized checkpoint and a phone export of the tiny fixture, built once.
    gptq: PathBuf,
    phone: PathBuf,
    /// Small prompt set for parity cases.
    prompts: PathBuf,
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let tiny = dir.path().join("tiny");
        let random = dir.path().join("random");
        common::copy_dir(&common::fixture("spark-tiny"), &tiny);
        common::copy_dir(&common::fixture("spark-random"), &random);
        let gptq = dir.path().join("gptq");
        let o = common::tool()
            .args(["quantize"])
            .arg(&tiny)
            .arg("--out")
            .arg(&gptq)
            .args(["--format", "w4a16", "--samples", "2", "--seq-len", "32"])
            .args(["--no-compare", "--quiet", "--set", "method=rtn"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let phone = dir.path().join("phone");
        let o = common::tool()
            .args(["export-phone"])
            .arg(&tiny)
            .arg("--out")
            .arg(&phone)
            .args(["--context", "64", "--precision", "f32", "--quiet"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let prompts = dir.path().join("prompts.json");
        std::fs::write(
            &prompts,
            r#"{"prompts": [{"name": "one", "text": "The weather in Paris"}]}"#,
        )
        .unwrap();
        Shared {
            tiny,
            random,
            gptq,
            phone,
            prompts,
            _dir: dir,
        }
    })
}

// ---------------------------------------------------------------- cases

#[derive(Debug, Clone, Copy, PartialEq)]
enum Want {
    /// Exit 2 ("could not run") naming every culprit.
    Refused,
    /// Exit 1 (parity drift) naming every culprit.
    Drift,
    /// Exit 0 with a warning naming every culprit.
    Warned,
}

struct Case {
    name: String,
    /// The case's own folder: inputs and outputs live here; snapshotted before and after.
    dir: tempfile::TempDir,
    args: Vec<OsString>,
    env: Vec<(&'static str, String)>,
    want: Want,
    culprits: Vec<String>,
}

impl Case {
    fn new(name: impl Into<String>) -> Case {
        Case {
            name: name.into(),
            dir: tempfile::tempdir().unwrap(),
            args: Vec::new(),
            env: Vec::new(),
            want: Want::Refused,
            culprits: Vec::new(),
        }
    }
    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }
    /// A linked copy of a shared input folder at `rel`.
    fn input(&self, from: &Path, rel: &str) -> PathBuf {
        let p = self.path(rel);
        link_dir(from, &p);
        p
    }
    fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, a: I) -> Case {
        self.args.extend(a.into_iter().map(Into::into));
        self
    }
    /// Set `flag` to `value`, replacing a quick default of the same flag.
    fn set(mut self, flag: &str, value: &str) -> Case {
        if let Some(i) = self.args.iter().position(|a| a == flag) {
            self.args.drain(i..i + 2);
        }
        self.args.push(flag.into());
        self.args.push(value.into());
        self
    }
    /// `--flag=value`, replacing a quick default of the same flag.
    fn set_eq(mut self, flag: &str, value: &str) -> Case {
        if let Some(i) = self.args.iter().position(|a| a == flag) {
            self.args.drain(i..i + 2);
        }
        self.args.push(format!("{flag}={value}").into());
        self
    }
    fn names<I: IntoIterator<Item = S>, S: Into<String>>(mut self, c: I) -> Case {
        self.culprits.extend(c.into_iter().map(Into::into));
        self
    }
    fn want(mut self, w: Want) -> Case {
        self.want = w;
        self
    }
    fn env(mut self, k: &'static str, v: &str) -> Case {
        self.env.push((k, v.into()));
        self
    }
}

fn os(p: &Path) -> OsString {
    p.as_os_str().to_owned()
}

/// Arguments that make each command cheap once its input is accepted.
fn quick(cmd: &str) -> Vec<&'static str> {
    match cmd {
        "run" => vec!["--tokens", "1,2,3", "--max-new-tokens", "1", "--quiet"],
        "quantize" => vec![
            "--samples",
            "2",
            "--seq-len",
            "16",
            "--no-compare",
            "--quiet",
        ],
        "export-phone" => vec![
            "--context",
            "32",
            "--samples",
            "1",
            "--seq-len",
            "8",
            "--quiet",
        ],
        "bench" => vec!["--prompt-len", "4", "--gen", "2", "--repeat", "1"],
        "parity" => vec!["--max-new-tokens", "2", "--eval-tokens", "0"],
        _ => vec![],
    }
}

/// A command on a model folder, with its quick arguments (outputs inside the case folder).
fn on_model(c: Case, cmd: &str, model: &Path) -> Case {
    let out = c.path("out");
    let mut c = c.args([OsString::from(cmd), os(model)]);
    if cmd == "quantize" || cmd == "export-phone" {
        c = c.args([OsString::from("--out"), os(&out)]);
    }
    if cmd == "parity" {
        let tiny = c.input(&shared().tiny, "reference");
        c.args = vec![
            "parity".into(),
            os(&tiny),
            os(model),
            "--prompts".into(),
            os(&shared().prompts),
        ];
    }
    c.args(quick(cmd))
}

// ---- CLI values

fn cli_values() -> Vec<Case> {
    // (command, flag, bad values); the message must name the flag and what it expects.
    let table: &[(&str, &str, &[&str])] = &[
        ("run", "--max-new-tokens", &["-1", "many", "1.5"]),
        ("run", "--temperature", &["-1", "NaN", "hot", "inf"]),
        ("run", "--top-k", &["-1", "x"]),
        ("run", "--top-p", &["0", "1.5", "NaN", "-0.2"]),
        ("run", "--context", &["0", "-5", "big"]),
        ("run", "--seed", &["-1", "s"]),
        ("run", "--tokens", &["-1", "a,b", "1,,x"]),
        ("bench", "--prompt-len", &["0", "-1", "x"]),
        ("bench", "--gen", &["0", "-3"]),
        ("bench", "--repeat", &["0", "-1"]),
        ("quantize", "--samples", &["0", "-1", "x"]),
        ("quantize", "--seq-len", &["0", "-1"]),
        ("quantize", "--group-size", &["-1", "0"]),
        ("export-phone", "--context", &["0", "-1", "x"]),
        ("export-phone", "--parts", &["0", "-1"]),
        ("export-phone", "--samples", &["0", "-2"]),
        ("export-phone", "--seq-len", &["0"]),
        ("export-phone", "--range-margin", &["0.5", "NaN", "-1"]),
        ("parity", "--max-new-tokens", &["-1"]),
        ("parity", "--eval-tokens", &["-1"]),
        ("parity", "--eval-seq-len", &["0"]),
        ("parity", "--min-top1", &["-0.1", "1.5", "x"]),
        ("parity", "--min-greedy-match", &["2"]),
        ("parity", "--max-kl-mean", &["-1", "NaN"]),
        ("parity", "--min-snr-db", &["NaN"]),
        ("parity", "--max-ppl-ratio", &["-1"]),
        ("inspect", "--context", &["0", "-1"]),
        ("inspect", "--threads", &["0", "-1"]),
    ];
    let mut out = Vec::new();
    for (cmd, flag, bads) in table {
        for bad in *bads {
            let c = Case::new(format!("cli {cmd} {flag} {bad}"));
            let model = c.input(&shared().tiny, "model");
            let c = on_model(c, cmd, &model);
            let c = c.set_eq(flag, bad).names([*flag, "expected"]);
            out.push(c);
            // The same value as a separate argument (the "unexpected argument '-1'" case).
            if bad.starts_with('-') {
                let c = Case::new(format!("cli {cmd} {flag} {bad} (separate)"));
                let model = c.input(&shared().tiny, "model");
                let c = on_model(c, cmd, &model);
                out.push(c.set(flag, bad).names([*flag, "expected"]));
            }
        }
    }
    // Well-formed numbers the library refuses: named by their flag too.
    for (cmd, flag, v, word) in [
        ("quantize", "--group-size", "48", "group_size = 48"),
        ("export-phone", "--parts", "100", "must be in"),
        ("export-phone", "--context", "1", "must be in"),
    ] {
        let c = Case::new(format!("cli {cmd} {flag} {v} (library)"));
        let model = c.input(&shared().tiny, "model");
        let c = on_model(c, cmd, &model);
        // A recipe key is named as the recipe spells it (the flag sets that key).
        let named = if flag == "--group-size" { word } else { flag };
        out.push(c.set(flag, v).names([named, word]));
    }
    out
}

// ---- config.json

fn config_cases() -> Vec<Case> {
    let keys = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "sliding_window",
        "max_position_embeddings",
    ];
    let bad: [Value; 5] = [json!(-4), json!("four"), json!(1.5), json!(true), json!(0)];
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(shared().tiny.join("config.json")).unwrap())
            .unwrap();
    let mut out = Vec::new();
    let mut push = |name: String, cfg: Option<Value>, raw: Option<&str>, culprits: Vec<String>| {
        for cmd in ["inspect", "run"] {
            let c = Case::new(format!("config {name} ({cmd})"));
            let model = c.input(&shared().tiny, "model");
            let p = model.join("config.json");
            match (&cfg, raw) {
                (Some(v), _) => replace(&p, serde_json::to_string_pretty(v).unwrap().as_bytes()),
                (None, Some(r)) => replace(&p, r.as_bytes()),
                (None, None) => std::fs::remove_file(&p).unwrap(),
            }
            let c = on_model(c, cmd, &model);
            out.push(c.names(culprits.clone()));
        }
    };
    for k in keys {
        for v in &bad {
            let mut cfg = base.clone();
            cfg[k] = v.clone();
            push(
                format!("{k} = {v}"),
                Some(cfg),
                None,
                vec!["config.json".into(), k.into()],
            );
        }
    }
    let mut edits: Vec<(&str, &str, Value)> = vec![
        ("model_type", "model_type", json!("llama")),
        ("layer_types", "layer_types", json!(["sliding_attention"])),
        (
            "layer_types",
            "layer_types",
            json!([
                "sliding", "sliding", "sliding", "full", "sliding", "sliding", "sliding", "full"
            ]),
        ),
        ("rms_norm_eps", "rms_norm_eps", json!("small")),
        ("rope_parameters", "rope_parameters", json!("none")),
        ("eos_token_id", "eos_token_id", json!("end")),
        ("num_key_value_heads", "num_key_value_heads", json!(3)),
    ];
    for (label, key, v) in edits.drain(..) {
        let mut cfg = base.clone();
        cfg[key] = v.clone();
        push(
            format!("{label} = {v}"),
            Some(cfg),
            None,
            vec!["config.json".into(), key.into()],
        );
    }
    push(
        "not JSON".into(),
        None,
        Some("{\"model_type\": \"spark2_5\","),
        vec!["config.json".into(), "JSON".into()],
    );
    push(
        "an array".into(),
        None,
        Some("[1, 2]"),
        vec!["config.json".into(), "object".into()],
    );
    push("missing".into(), None, None, vec!["config.json".into()]);
    out
}

// ---- safetensors checkpoint files

fn checkpoint_cases() -> Vec<Case> {
    let mut out = Vec::new();
    let tiny_st = shared().tiny.join("model.safetensors");
    let original = std::fs::read(&tiny_st).unwrap();
    let t = Tensors::read(&tiny_st);
    let names = t.names();
    let targets = [
        names[0].clone(),
        names[names.len() / 2].clone(),
        names[names.len() - 1].clone(),
    ];
    let header_len = u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;

    // Whole-file damage: named by the file.
    let whole: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("7 bytes", original[..7].to_vec()),
        ("half a header", original[..8 + header_len / 2].to_vec()),
        ("one byte short", original[..original.len() - 1].to_vec()),
        ("half the data", original[..original.len() / 2].to_vec()),
        ("huge header length", {
            let mut b = original.clone();
            b[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
            b
        }),
        (
            "header not JSON",
            st_bytes(&json!("x"), &[])
                .iter()
                .map(|&b| if b == b'"' { b'#' } else { b })
                .collect(),
        ),
        ("header an array", st_bytes(&json!([1, 2]), &[])),
    ];
    for (label, bytes) in whole {
        for cmd in ["inspect", "run", "quantize", "export-phone", "bench"] {
            let c = Case::new(format!("safetensors {label} ({cmd})"));
            let model = c.input(&shared().tiny, "model");
            replace(&model.join("model.safetensors"), &bytes);
            out.push(on_model(c, cmd, &model).names(["model.safetensors"]));
        }
    }

    // Per-tensor damage: named by the tensor (never a neighbour).
    for name in &targets {
        type Edit = Box<dyn Fn(&mut serde_json::Map<String, Value>, &str)>;
        let edits: Vec<(&str, Edit)> = vec![
            (
                "offsets past the end",
                Box::new(|h, n| {
                    let o = h[n]["data_offsets"].clone();
                    h[n]["data_offsets"] = json!([o[0], o[1].as_u64().unwrap() + 10_000_000]);
                }),
            ),
            (
                "offsets reversed",
                Box::new(|h, n| {
                    let o = h[n]["data_offsets"].clone();
                    h[n]["data_offsets"] = json!([o[1], o[0]]);
                }),
            ),
            (
                "shape doubled",
                Box::new(|h, n| {
                    let s = h[n]["shape"].as_array().unwrap().clone();
                    let mut s: Vec<u64> = s.iter().map(|d| d.as_u64().unwrap()).collect();
                    s[0] *= 2;
                    h[n]["shape"] = json!(s);
                }),
            ),
            (
                "dtype U8",
                Box::new(|h, n| {
                    h[n]["dtype"] = json!("U8");
                }),
            ),
            (
                "offsets not numbers",
                Box::new(|h, n| {
                    h[n]["data_offsets"] = json!(["a", "b"]);
                }),
            ),
        ];
        for (label, edit) in edits {
            let (mut h, data) = read_st(&tiny_st);
            edit(&mut h, name);
            let bytes = st_bytes(&Value::Object(h), &data);
            for cmd in ["inspect", "run"] {
                let c = Case::new(format!("tensor {name}: {label} ({cmd})"));
                let model = c.input(&shared().tiny, "model");
                replace(&model.join("model.safetensors"), &bytes);
                out.push(on_model(c, cmd, &model).names([name.as_str(), "model.safetensors"]));
            }
        }
        // Consistent files that do not match the config.
        let mut dropped = Tensors::read(&tiny_st);
        dropped.0.retain(|t| &t.0 != name);
        let mut reshaped = Tensors::read(&tiny_st);
        {
            let e = reshaped.get(name);
            let s: Vec<u64> = e.1["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            let mut s2 = s.clone();
            s2[0] -= 1;
            let row = e.2.len() / s[0] as usize;
            e.2.truncate(e.2.len() - row);
            e.1["shape"] = json!(s2);
        }
        for (label, t, cmds) in [
            (
                "missing",
                dropped,
                &["inspect", "run", "quantize", "export-phone"][..],
            ),
            ("one row short", reshaped, &["inspect", "quantize"][..]),
        ] {
            let bytes = t.bytes();
            for cmd in cmds {
                let c = Case::new(format!("tensor {name}: {label} ({cmd})"));
                let model = c.input(&shared().tiny, "model");
                replace(&model.join("model.safetensors"), &bytes);
                out.push(on_model(c, cmd, &model).names([name.as_str()]));
            }
        }
    }

    // A NaN weight: named by the tensor, not by its consequences downstream.
    let nan_target = names
        .iter()
        .find(|n| n.contains("layers.3.mlp.up_proj"))
        .unwrap()
        .clone();
    let mut t = Tensors::read(&tiny_st);
    {
        let e = t.get(&nan_target);
        let k = e.2.len() / 2;
        e.2[k..k + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
    }
    let bytes = t.bytes();
    for cmd in ["quantize", "export-phone"] {
        let c = Case::new(format!("NaN in {nan_target} ({cmd})"));
        let model = c.input(&shared().tiny, "model");
        replace(&model.join("model.safetensors"), &bytes);
        let c = on_model(c, cmd, &model);
        let c = if cmd == "export-phone" {
            c.args(["--precision", "w8a16"])
        } else {
            c
        };
        out.push(c.names([nan_target.as_str(), "non-finite"]));
    }

    // Shards and their index (spark-random).
    let index_path = shared().random.join("model.safetensors.index.json");
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let (some_tensor, some_shard) = {
        let (k, v) = index["weight_map"]
            .as_object()
            .unwrap()
            .iter()
            .next()
            .unwrap();
        (k.clone(), v.as_str().unwrap().to_string())
    };
    let other_shard = if some_shard.contains("00001") {
        "model-00002-of-00002.safetensors"
    } else {
        "model-00001-of-00002.safetensors"
    };
    let mut idx_cases: Vec<(String, String, Vec<String>)> = Vec::new();
    let mut with = |label: &str, v: Value, culprits: &[&str]| {
        idx_cases.push((
            label.into(),
            serde_json::to_string(&v).unwrap(),
            culprits.iter().map(|s| s.to_string()).collect(),
        ));
    };
    let mut v = index.clone();
    v.as_object_mut().unwrap().remove("weight_map");
    with(
        "no weight_map",
        v,
        &["model.safetensors.index.json", "weight_map"],
    );
    let mut v = index.clone();
    v["weight_map"] = json!([1]);
    with(
        "weight_map an array",
        v,
        &["model.safetensors.index.json", "weight_map"],
    );
    let mut v = index.clone();
    v["weight_map"][&some_tensor] = json!(7);
    with(
        "entry not a string",
        v,
        &["model.safetensors.index.json", &some_tensor],
    );
    let mut v = index.clone();
    v["weight_map"][&some_tensor] = json!("../model-00001-of-00002.safetensors");
    with(
        "entry escapes the folder",
        v,
        &["model.safetensors.index.json", &some_tensor],
    );
    let mut v = index.clone();
    v["weight_map"][&some_tensor] = json!("model-00009-of-00009.safetensors");
    with(
        "missing shard",
        v,
        &[
            "model.safetensors.index.json",
            "model-00009-of-00009.safetensors",
        ],
    );
    let mut v = index.clone();
    v["weight_map"][&some_tensor] = json!(other_shard);
    with(
        "tensor in the other shard",
        v,
        &["model.safetensors.index.json", &some_tensor],
    );
    let mut v = index.clone();
    v["weight_map"]["model.layers.99.ghost.weight"] = json!(some_shard);
    with(
        "tensor in no shard",
        v,
        &[
            "model.safetensors.index.json",
            "model.layers.99.ghost.weight",
        ],
    );
    idx_cases.push((
        "not JSON".into(),
        "{\"weight_map\": ".into(),
        vec!["model.safetensors.index.json".into(), "JSON".into()],
    ));
    for (label, text, culprits) in idx_cases {
        for cmd in ["inspect", "run"] {
            let c = Case::new(format!("index {label} ({cmd})"));
            let model = c.input(&shared().random, "model");
            replace(&model.join("model.safetensors.index.json"), text.as_bytes());
            out.push(on_model(c, cmd, &model).names(culprits.clone()));
        }
    }
    // A tensor in both shards.
    {
        let c = Case::new("shards: a tensor in both (inspect)");
        let model = c.input(&shared().random, "model");
        let a = model.join(&some_shard);
        let b = model.join(other_shard);
        let ta = Tensors::read(&a);
        let mut tb = Tensors::read(&b);
        let dup = ta.0.iter().find(|t| t.0 == some_tensor).unwrap().clone();
        tb.0.push(dup);
        replace(&b, &tb.bytes());
        out.push(on_model(c, "inspect", &model).names([some_tensor.as_str()]));
    }
    out
}

// ---- tokenizer.json

fn tokenizer_cases() -> Vec<Case> {
    let text = std::fs::read_to_string(shared().tiny.join("tokenizer.json")).unwrap();
    let variants: Vec<(&str, String)> = vec![
        ("empty", String::new()),
        ("truncated", text[..text.len() / 2].to_string()),
        ("not a tokenizer", "{\"model\": 5}".into()),
        ("an array", "[]".into()),
    ];
    let mut out = Vec::new();
    for (label, t) in variants {
        for cmd in ["run-prompt", "quantize"] {
            let c = Case::new(format!("tokenizer {label} ({cmd})"));
            let model = c.input(&shared().tiny, "model");
            replace(&model.join("tokenizer.json"), t.as_bytes());
            let c = if cmd == "run-prompt" {
                c.args([OsString::from("run"), os(&model)]).args([
                    "--prompt",
                    "hello",
                    "--max-new-tokens",
                    "1",
                    "--quiet",
                ])
            } else {
                on_model(c, cmd, &model)
            };
            out.push(c.names(["tokenizer.json"]));
        }
    }
    // No tokenizer at all: --prompt cannot work, --tokens is the way.
    let c = Case::new("tokenizer missing (run --prompt)");
    let model = c.input(&shared().tiny, "model");
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    out.push(
        c.args([OsString::from("run"), os(&model)])
            .args(["--prompt", "hello", "--quiet"])
            .names(["tokenizer.json", "--tokens"]),
    );
    // A candidate whose vocabulary entries are permuted: `run` would print other text, so parity
    // fails even though every logit matches.
    let mut v: Value = serde_json::from_str(&text).unwrap();
    let vocab = v["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = ("the".to_string(), "and".to_string());
    let (ia, ib) = (vocab[&a].clone(), vocab[&b].clone());
    vocab.insert(a, ib);
    vocab.insert(b, ia);
    let c = Case::new("tokenizer permuted vocabulary (parity)");
    let model = c.input(&shared().tiny, "candidate");
    replace(
        &model.join("tokenizer.json"),
        serde_json::to_string(&v).unwrap().as_bytes(),
    );
    out.push(
        on_model(c, "parity", &model)
            .want(Want::Drift)
            .names(["tokenizer mismatch", "token id"]),
    );
    out
}

// ---- GPTQ tensors and quantization_config

fn gptq_cases() -> Vec<Case> {
    let st = shared().gptq.join("model.safetensors");
    let t = Tensors::read(&st);
    let qweight = t
        .names()
        .into_iter()
        .find(|n| n.contains("layers.1.") && n.ends_with("down_proj.qweight"))
        .unwrap();
    let base = qweight.trim_end_matches(".qweight").to_string();
    let mut out = Vec::new();
    let mut tensor_edits: Vec<(String, Tensors, String)> = Vec::new();
    for part in ["qweight", "scales", "qzeros", "g_idx"] {
        let name = format!("{base}.{part}");
        // g_idx is optional in GPTQ (identity order when absent): its absence is no error.
        if part != "g_idx" {
            let mut t = Tensors::read(&st);
            t.0.retain(|x| x.0 != name);
            tensor_edits.push((format!("{part} missing"), t, name.clone()));
        }
        let mut t = Tensors::read(&st);
        {
            let e = t.get(&name);
            let s: Vec<u64> = e.1["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            let row = e.2.len() / s[0] as usize;
            e.2.extend(vec![0u8; row]);
            let mut s2 = s.clone();
            s2[0] += 1;
            e.1["shape"] = json!(s2);
        }
        tensor_edits.push((format!("{part} one row long"), t, name));
    }
    let g_idx = format!("{base}.g_idx");
    let mut t = Tensors::read(&st);
    {
        let e = t.get(&g_idx);
        for c in e.2.chunks_exact_mut(4) {
            c.copy_from_slice(&9999i32.to_le_bytes());
        }
    }
    tensor_edits.push(("g_idx out of range".into(), t, g_idx));
    // An infinite fp16 scale: the W4A16 tables read scales in pairs, so one corrupt scale would
    // reach its neighbour's outputs too; refused at load, naming the tensor.
    let scales = format!("{base}.scales");
    let mut t = Tensors::read(&st);
    {
        let e = t.get(&scales);
        assert_eq!(e.1["dtype"], "F16", "GPTQ scales are fp16");
        let k = e.2.len() / 4 * 2;
        e.2[k..k + 2].copy_from_slice(&0x7c00u16.to_le_bytes());
    }
    tensor_edits.push(("an infinite scale".into(), t, scales));
    for (label, t, name) in tensor_edits {
        let c = Case::new(format!("gptq {label} (run)"));
        let model = c.input(&shared().gptq, "model");
        replace(&model.join("model.safetensors"), &t.bytes());
        out.push(on_model(c, "run", &model).names([name]));
    }
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(shared().gptq.join("config.json")).unwrap())
            .unwrap();
    for (key, v) in [
        ("bits", json!(3)),
        ("bits", json!("four")),
        ("group_size", json!(-1)),
        ("group_size", json!("x")),
        ("group_size", json!(48)),
        ("desc_act", json!("yes")),
        ("quant_method", json!("awq")),
        // The fixture's checkpoint keeps its head dense: a config claiming a GPTQ head is wrong.
        ("lm_head", json!(true)),
    ] {
        let c = Case::new(format!("gptq quantization_config.{key} = {v} (run)"));
        let model = c.input(&shared().gptq, "model");
        let mut cfg = cfg.clone();
        cfg["quantization_config"][key] = v;
        replace(
            &model.join("config.json"),
            serde_json::to_string_pretty(&cfg).unwrap().as_bytes(),
        );
        out.push(on_model(c, "run", &model).names([key]));
    }
    // A numerics record that names neither W4A8 nor W4A16.
    {
        let c = Case::new("gptq meta.spark_tool.format = \"w9a9\" (run)".to_string());
        let model = c.input(&shared().gptq, "model");
        let mut cfg = cfg.clone();
        cfg["quantization_config"]["meta"]["spark_tool"]["format"] = json!("w9a9");
        replace(
            &model.join("config.json"),
            serde_json::to_string_pretty(&cfg).unwrap().as_bytes(),
        );
        out.push(on_model(c, "run", &model).names(["meta.spark_tool.format", "w9a9"]));
    }
    // GPTQ tensors with no quantization_config to read them: the missing key is named.
    {
        let c = Case::new("gptq without quantization_config (run)".to_string());
        let model = c.input(&shared().gptq, "model");
        let mut cfg = cfg.clone();
        cfg.as_object_mut().unwrap().remove("quantization_config");
        replace(
            &model.join("config.json"),
            serde_json::to_string_pretty(&cfg).unwrap().as_bytes(),
        );
        out.push(on_model(c, "run", &model).names(["quantization_config", "qweight"]));
    }
    // A GPTQ checkpoint is no input for quantize or export-phone.
    for cmd in ["quantize", "export-phone"] {
        let c = Case::new(format!("gptq checkpoint as input ({cmd})"));
        let model = c.input(&shared().gptq, "model");
        out.push(on_model(c, cmd, &model).names(["GPTQ"]));
    }
    out
}

// ---- calibration files

fn calibration_cases() -> Vec<Case> {
    let files: Vec<(&str, &str, Vec<u8>, Vec<&str>)> = vec![
        ("empty jsonl", "c.jsonl", vec![], vec!["c.jsonl", "empty"]),
        ("empty text", "c.txt", vec![], vec!["c.txt", "empty"]),
        (
            "bad JSON line 3",
            "c.jsonl",
            b"{\"text\": \"a\"}\n{\"text\": \"b\"}\n{not json\n".to_vec(),
            vec!["c.jsonl", "line 3"],
        ),
        (
            "no text field",
            "c.jsonl",
            b"{\"body\": \"a\"}\n".to_vec(),
            vec!["c.jsonl", "line 1", "text"],
        ),
        (
            "text a number",
            "c.jsonl",
            b"{\"text\": 5}\n".to_vec(),
            vec!["c.jsonl", "line 1", "text"],
        ),
        (
            "not UTF-8",
            "c.txt",
            vec![0xff, 0xfe, 0x00, 0x80],
            vec!["c.txt"],
        ),
        (
            "too short for the windows",
            "c.txt",
            b"a few words only".to_vec(),
            vec!["--samples", "--seq-len", "tokens"],
        ),
    ];
    let mut out = Vec::new();
    for (label, fname, bytes, culprits) in files {
        for cmd in ["quantize", "export-phone"] {
            let c = Case::new(format!("calibration {label} ({cmd})"));
            let model = c.input(&shared().tiny, "model");
            let f = c.path(fname);
            std::fs::write(&f, &bytes).unwrap();
            let culprits: Vec<String> = culprits
                .iter()
                .map(|s| match (*s, cmd) {
                    ("--samples", "export-phone") => "--samples".to_string(),
                    ("--seq-len", "export-phone") => "--seq-len".to_string(),
                    (s, _) => s.to_string(),
                })
                .collect();
            let c = on_model(c, cmd, &model).args([OsString::from("--calibration"), os(&f)]);
            let c = if cmd == "export-phone" {
                c.args(["--precision", "w8a16"])
            } else {
                c
            };
            out.push(c.names(culprits));
        }
    }
    for (label, make_dir) in [("nonexistent", false), ("a folder", true)] {
        let c = Case::new(format!("calibration {label} (quantize)"));
        let model = c.input(&shared().tiny, "model");
        let f = c.path("calib.jsonl");
        if make_dir {
            std::fs::create_dir_all(&f).unwrap();
        }
        out.push(
            on_model(c, "quantize", &model)
                .args([OsString::from("--calibration"), os(&f)])
                .names(["calib.jsonl"]),
        );
    }
    out
}

// ---- parity inputs: policy, prompts

fn parity_cases() -> Vec<Case> {
    let policies: Vec<(&str, &str, Vec<&str>)> = vec![
        (
            "negative threshold",
            r#"{"max_kl_mean": -0.5}"#,
            vec!["max_kl_mean", ">= 0"],
        ),
        (
            "string threshold",
            r#"{"min_top1": "high"}"#,
            vec!["min_top1", "number"],
        ),
        (
            "top-1 above 1",
            r#"{"min_top1": 1.5}"#,
            vec!["min_top1", "0..=1"],
        ),
        (
            "unknown key",
            r#"{"min_top_1": 0.9}"#,
            vec!["min_top_1", "expected one of"],
        ),
        ("an array", r#"[0.9]"#, vec!["object"]),
        ("not JSON", r#"{"min_top1": "#, vec!["EOF"]),
        ("empty", "", vec!["EOF"]),
        (
            "negative ratio",
            r#"{"max_ppl_ratio": -1}"#,
            vec!["max_ppl_ratio"],
        ),
    ];
    let mut out = Vec::new();
    for (label, text, culprits) in policies {
        let c = Case::new(format!("policy {label} (parity)"));
        let model = c.input(&shared().tiny, "candidate");
        let p = c.path("policy.json");
        std::fs::write(&p, text).unwrap();
        let c = on_model(c, "parity", &model).args([OsString::from("--policy"), os(&p)]);
        out.push(c.names(["policy.json"]).names(culprits));
    }
    let prompt_files: Vec<(&str, &str, Vec<&str>)> = vec![
        ("not JSON", "{", vec!["p.json"]),
        (
            "text and tokens",
            r#"{"prompts": [{"name": "x", "text": "a", "tokens": [1]}]}"#,
            vec!["p.json", "exactly one"],
        ),
        (
            "neither text nor tokens",
            r#"{"prompts": [{"name": "x"}]}"#,
            vec!["p.json", "exactly one"],
        ),
        (
            "no prompts key",
            r#"{"items": []}"#,
            vec!["p.json", "prompts"],
        ),
    ];
    for (label, text, culprits) in prompt_files {
        let c = Case::new(format!("prompts {label} (parity)"));
        let model = c.input(&shared().tiny, "candidate");
        let p = c.path("p.json");
        std::fs::write(&p, text).unwrap();
        let mut c = on_model(c, "parity", &model);
        // Replace the default prompt set.
        let i = c.args.iter().position(|a| a == "--prompts").unwrap();
        c.args[i + 1] = os(&p);
        out.push(c.names(culprits));
    }
    let c = Case::new("eval text nonexistent (parity)");
    let model = c.input(&shared().tiny, "candidate");
    let p = c.path("heldout.jsonl");
    let mut c = on_model(c, "parity", &model);
    c.args.retain(|a| a != "--eval-tokens" && a != "0");
    out.push(
        c.args([
            OsString::from("--eval-text"),
            os(&p),
            "--eval-tokens".into(),
            "64".into(),
        ])
        .names(["heldout.jsonl"]),
    );
    // Files the report pages read: a previous parity report, the llama.cpp comparison.
    for (label, text) in [
        ("not JSON", "{"),
        ("a policy", r#"{"min_top1": 0.9}"#),
        (
            "overall not an object",
            r#"{"passed": true, "overall": 1, "prompts": []}"#,
        ),
    ] {
        let c = Case::new(format!("baseline {label} (parity)"));
        let model = c.input(&shared().tiny, "candidate");
        let (p, page) = (c.path("prev.json"), c.path("r.html"));
        std::fs::write(&p, text).unwrap();
        let c = on_model(c, "parity", &model).args([
            OsString::from("--html"),
            os(&page),
            "--baseline".into(),
            os(&p),
        ]);
        out.push(c.names(["prev.json", "parity --json"]));
    }
    for (label, text) in [
        ("not JSON", "["),
        ("a bench --json", r#"{"prompt_len": 4, "decode_tok_s": {}}"#),
        (
            "cells not a list",
            r#"{"config": {"prompt_len": 1, "gen": 1, "repeat": 1}, "cells": {}}"#,
        ),
    ] {
        let c = Case::new(format!("llamacpp json {label} (bench)"));
        let model = c.input(&shared().tiny, "model");
        let (p, page) = (c.path("bvl.json"), c.path("b.html"));
        std::fs::write(&p, text).unwrap();
        let c = on_model(c, "bench", &model).args([
            OsString::from("--html"),
            os(&page),
            "--llamacpp-json".into(),
            os(&p),
        ]);
        out.push(c.names(["bvl.json", "bench_vs_llamacpp.py"]));
    }
    out
}

// ---- phone manifests

fn phone_cases() -> Vec<Case> {
    let mp = shared().phone.join("phone_manifest.json");
    let m: Value = serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
    let mut out = Vec::new();
    let keys: Vec<String> = m.as_object().unwrap().keys().cloned().collect();
    for k in &keys {
        for (label, edit) in [("missing", None), ("a string", Some(json!("x")))] {
            let mut v = m.clone();
            match &edit {
                None => {
                    v.as_object_mut().unwrap().remove(k);
                }
                Some(x) => v[k] = x.clone(),
            }
            // Only what the manifest reader itself rejects is malformed (an optional key's
            // absence, a string where a string belongs, are not).
            let probe = tempfile::tempdir().unwrap();
            std::fs::write(
                probe.path().join("phone_manifest.json"),
                serde_json::to_string(&v).unwrap(),
            )
            .unwrap();
            if spark_tool::phone::manifest::Manifest::read(probe.path()).is_ok() {
                continue;
            }
            let c = Case::new(format!("manifest {k} {label} (run)"));
            let model = c.input(&shared().phone, "phone");
            replace(
                &model.join("phone_manifest.json"),
                serde_json::to_string_pretty(&v).unwrap().as_bytes(),
            );
            out.push(on_model(c, "run", &model).names(["phone_manifest.json", k.as_str()]));
        }
    }
    let c = Case::new("manifest not JSON (run)");
    let model = c.input(&shared().phone, "phone");
    replace(&model.join("phone_manifest.json"), b"{\"format\":");
    out.push(on_model(c, "run", &model).names(["phone_manifest.json"]));
    // The embedding table the manifest points at is gone.
    let emb = m["embedding"]["file"].as_str().unwrap().to_string();
    let c = Case::new("manifest embedding file missing (run)");
    let model = c.input(&shared().phone, "phone");
    std::fs::remove_file(model.join(&emb)).unwrap();
    out.push(on_model(c, "run", &model).names([emb]));
    // A phone export where a Hugging Face checkpoint is needed: said so, not "no safetensors".
    for cmd in ["inspect", "quantize", "export-phone"] {
        let c = Case::new(format!("phone export as a checkpoint ({cmd})"));
        let model = c.input(&shared().phone, "phone");
        out.push(on_model(c, cmd, &model).names(["is a phone export", "checkpoint"]));
    }
    out
}

// ---- output paths

fn output_cases() -> Vec<Case> {
    let mut out = Vec::new();
    for cmd in ["quantize", "export-phone"] {
        // --out is a file of the user's.
        let c = Case::new(format!("--out is a file ({cmd})"));
        let model = c.input(&shared().tiny, "model");
        let f = c.path("notes.txt");
        std::fs::write(&f, "mine").unwrap();
        let mut c = on_model(c, cmd, &model);
        let i = c.args.iter().position(|a| a == "--out").unwrap();
        c.args[i + 1] = os(&f);
        out.push(c.names(["notes.txt", "not a folder"]));
        // --out is a folder of the user's (with --force).
        let c = Case::new(format!("--out is a foreign folder ({cmd})"));
        let model = c.input(&shared().tiny, "model");
        let d = c.path("photos");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("a.jpg"), "x").unwrap();
        let mut c = on_model(c, cmd, &model).args(["--force"]);
        let i = c.args.iter().position(|a| a == "--out").unwrap();
        c.args[i + 1] = os(&d);
        out.push(c.names(["photos", "not a spark-tool artifact"]));
        // --out is the model, or holds it.
        for (label, rel) in [("the model", "model"), ("its parent", ".")] {
            let c = Case::new(format!("--out is {label} ({cmd})"));
            let model = c.input(&shared().tiny, "model");
            let target = c.path(rel);
            let mut c = on_model(c, cmd, &model).args(["--force"]);
            let i = c.args.iter().position(|a| a == "--out").unwrap();
            c.args[i + 1] = os(&target);
            out.push(c.names(["--out", "input"]));
        }
        // --out below a file.
        let c = Case::new(format!("--out below a file ({cmd})"));
        let model = c.input(&shared().tiny, "model");
        let f = c.path("file");
        std::fs::write(&f, "x").unwrap();
        let mut c = on_model(c, cmd, &model);
        let i = c.args.iter().position(|a| a == "--out").unwrap();
        c.args[i + 1] = os(&f.join("sub"));
        out.push(c.names(["file"]));
    }
    // --dump-dequantized: refused before any compute, wherever it cannot be written.
    for (label, rel, pre, culprits) in [
        (
            "in a missing folder",
            "nowhere/d.safetensors",
            None,
            vec!["--dump-dequantized", "does not exist"],
        ),
        (
            "over a user's file",
            "d.safetensors",
            Some("mine"),
            vec!["--dump-dequantized", "not a previous output"],
        ),
        (
            "inside the model",
            "model/d.safetensors",
            None,
            vec!["--dump-dequantized", "input"],
        ),
        (
            "a folder",
            "dir",
            None,
            vec!["--dump-dequantized", "folder"],
        ),
    ] {
        out.push(output_file_case(
            ("quantize", "--dump-dequantized", "model"),
            label,
            rel,
            pre,
            culprits,
        ));
    }
    // --logits-out and parity --json.
    for (label, rel, pre, culprits) in [
        (
            "in a missing folder",
            "nowhere/l.safetensors",
            None,
            vec!["--logits-out", "does not exist"],
        ),
        (
            "over a user's file",
            "l.safetensors",
            Some("mine"),
            vec!["--logits-out", "not a previous output"],
        ),
        (
            "onto the weights",
            "model/model.safetensors",
            None,
            vec!["--logits-out", "input"],
        ),
        ("a folder", "dir", None, vec!["--logits-out", "folder"]),
    ] {
        out.push(output_file_case(
            ("run", "--logits-out", "model"),
            label,
            rel,
            pre,
            culprits,
        ));
    }
    for (label, rel, pre, culprits) in [
        (
            "in a missing folder",
            "nowhere/r.json",
            None,
            vec!["--json", "does not exist"],
        ),
        (
            "over a user's file",
            "r.json",
            Some("{\"mine\": 1}"),
            vec!["--json", "not a previous output"],
        ),
        (
            "inside the candidate",
            "candidate/r.json",
            None,
            vec!["--json", "input"],
        ),
    ] {
        out.push(output_file_case(
            ("parity", "--json", "candidate"),
            label,
            rel,
            pre,
            culprits,
        ));
    }
    // The report pages and summary follow --json's rules.
    for (cmd, flag, input) in [
        ("parity", "--html", "candidate"),
        ("parity", "--markdown", "candidate"),
        ("bench", "--html", "model"),
    ] {
        for (label, rel, pre, culprit) in [
            (
                "in a missing folder",
                "nowhere/r.out",
                None,
                "does not exist",
            ),
            (
                "over a user's file",
                "r.out",
                Some("<html>mine</html>"),
                "not a previous output",
            ),
            ("inside the input", "INPUT/r.out", None, "input"),
            ("a folder", "dir", None, "folder"),
        ] {
            let rel = rel.replace("INPUT", input);
            out.push(output_file_case(
                (cmd, flag, input),
                label,
                &rel,
                pre,
                vec![flag, culprit],
            ));
        }
    }
    out
}

/// The single-file output flag `flag` of `cmd` pointed at `rel` inside the case folder, that file
/// pre-filled with `pre` (`rel` = "dir" is made a folder); the model is copied in as `input`.
fn output_file_case(
    (cmd, flag, input): (&str, &str, &str),
    label: &str,
    rel: &str,
    pre: Option<&str>,
    culprits: Vec<&str>,
) -> Case {
    let c = Case::new(format!("{flag} {label} ({cmd})"));
    let model = c.input(&shared().tiny, input);
    let p = c.path(rel);
    if let Some(text) = pre {
        std::fs::write(&p, text).unwrap();
    }
    if rel == "dir" {
        std::fs::create_dir_all(&p).unwrap();
    }
    on_model(c, cmd, &model)
        .args([OsString::from(flag), os(&p)])
        .names(culprits)
}

// ---- resource limits and positions

fn resource_cases() -> Vec<Case> {
    let mut out = Vec::new();
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(shared().tiny.join("config.json")).unwrap())
            .unwrap();
    let with_positions = |c: &Case, mpe: u64| -> PathBuf {
        let model = c.input(&shared().tiny, "model");
        let mut cfg = base.clone();
        cfg["max_position_embeddings"] = json!(mpe);
        replace(
            &model.join("config.json"),
            serde_json::to_string_pretty(&cfg).unwrap().as_bytes(),
        );
        model
    };
    // Sizes no machine holds, on a config that allows the positions: refused with the figures.
    let c = Case::new("bench --prompt-len 1e9 (memory)");
    let m = with_positions(&c, 1 << 40);
    out.push(
        c.args([OsString::from("bench"), os(&m)])
            .args(["--prompt-len", "1000000000", "--gen", "1", "--repeat", "1"])
            .names(["--prompt-len", "needs", "available"]),
    );
    let c = Case::new("export-phone --context 1e9 (memory)");
    let m = with_positions(&c, 1 << 40);
    let o = c.path("out");
    out.push(
        c.args([
            OsString::from("export-phone"),
            os(&m),
            "--out".into(),
            os(&o),
        ])
        .args(["--context", "1000000000", "--precision", "f32", "--quiet"])
        .names(["--context", "needs", "available"]),
    );
    let c = Case::new("run --context 1e11 (memory)");
    let m = with_positions(&c, 1 << 40);
    out.push(
        c.args([OsString::from("run"), os(&m)])
            .args([
                "--tokens",
                "1,2",
                "--context",
                "100000000000",
                "--max-new-tokens",
                "100000000000",
                "--quiet",
            ])
            .names(["--max-new-tokens", "needs", "available"]),
    );
    let c = Case::new("quantize --samples 1e8 --seq-len 1e5 (memory)");
    let m = c.input(&shared().tiny, "model");
    out.push(
        on_model(c, "quantize", &m)
            .set("--samples", "100000000")
            .set("--seq-len", "100000")
            .names(["--samples", "needs", "available"]),
    );
    // The memory plans of quantize and export-phone on a small machine: both figures, what to
    // lower and the way to run anyway.
    let c = Case::new("quantize on a machine with 1 MB (memory plan)");
    let m = c.input(&shared().tiny, "model");
    out.push(
        on_model(c, "quantize", &m)
            .env("SPARK_MEM_AVAILABLE", "1000000")
            .names([
                "memory plan needs",
                "1.0 MB is available",
                "--samples",
                "--force-memory",
            ]),
    );
    let c = Case::new("export-phone on a machine with 1 MB (memory plan)");
    let m = c.input(&shared().tiny, "model");
    out.push(
        on_model(c, "export-phone", &m)
            .env("SPARK_MEM_AVAILABLE", "1000000")
            .names([
                "memory plan needs",
                "1.0 MB is available",
                "--samples",
                "--force-memory",
            ]),
    );
    // A small machine (the figure overridden): an ordinary request is refused with both figures.
    let c = Case::new("run on a machine with 1 MB (memory)");
    let m = c.input(&shared().tiny, "model");
    out.push(
        on_model(c, "run", &m)
            .env("SPARK_MEM_AVAILABLE", "1000")
            .names(["needs", "1000 B available", "--max-new-tokens"]),
    );
    // Positions past max_position_embeddings.
    let ids: String = (1..=70)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let c = Case::new("run prompt past max_position_embeddings");
    let m = with_positions(&c, 64);
    out.push(
        c.args([
            OsString::from("run"),
            os(&m),
            "--tokens".into(),
            ids.clone().into(),
        ])
        .args(["--quiet"])
        .names(["70 tokens", "max_position_embeddings is 64"]),
    );
    let c = Case::new("run --context past max_position_embeddings");
    let m = with_positions(&c, 64);
    out.push(
        c.args([OsString::from("run"), os(&m)])
            .args(["--tokens", "1,2", "--context", "100", "--quiet"])
            .names(["--context 100", "max_position_embeddings (64)"]),
    );
    let c = Case::new("bench past max_position_embeddings");
    let m = with_positions(&c, 64);
    out.push(
        c.args([OsString::from("bench"), os(&m)])
            .args(["--prompt-len", "60", "--gen", "10", "--repeat", "1"])
            .names(["--prompt-len", "--gen", "max_position_embeddings (64)"]),
    );
    let c = Case::new("export-phone --context past max_position_embeddings");
    let m = with_positions(&c, 64);
    let o = c.path("out");
    out.push(
        c.args([
            OsString::from("export-phone"),
            os(&m),
            "--out".into(),
            os(&o),
        ])
        .args(["--context", "128", "--precision", "f32", "--quiet"])
        .names(["--context 128", "max_position_embeddings"]),
    );
    // --max-new-tokens 10^12 is a maximum: generation stops at the model's last position.
    let c = Case::new("run --max-new-tokens 1e12 stops at max_position_embeddings");
    let m = with_positions(&c, 64);
    out.push(
        c.args([OsString::from("run"), os(&m)])
            .args([
                "--tokens",
                "1,2",
                "--max-new-tokens",
                "1000000000000",
                "--ignore-eos",
                "--quiet",
            ])
            .want(Want::Warned)
            .names([
                "--max-new-tokens 1000000000000 clamped to 62",
                "max_position_embeddings is 64",
            ]),
    );
    out
}

// ---------------------------------------------------------------- runner

struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    seconds: f64,
}

/// Run the binary with `args` in `cwd`, killing it (a hang) after `limit`.
fn run_bin(args: &[OsString], cwd: &Path, env: &[(&str, String)], limit: Duration) -> Outcome {
    let t = Instant::now();
    let mut cmd = common::tool();
    cmd.args(args)
        .current_dir(cwd)
        .env("RAYON_NUM_THREADS", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    // Drain the pipes on threads so a chatty child cannot block on a full pipe.
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let ho = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut so, &mut s).ok();
        s
    });
    let he = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut se, &mut s).ok();
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Outcome {
        code: status.and_then(|s| s.code()),
        stdout: ho.join().unwrap(),
        stderr: he.join().unwrap(),
        seconds: t.elapsed().as_secs_f64(),
    }
}

/// What is wrong with one case's outcome (empty: it behaved).
fn judge(c: &Case, o: &Outcome, before: &BTreeMap<PathBuf, String>) -> Vec<String> {
    let mut bad = Vec::new();
    let all = format!("{}{}", o.stdout, o.stderr);
    if all.contains("panicked at") {
        bad.push("panic".into());
    }
    let want = match c.want {
        Want::Refused => 2,
        Want::Drift => 1,
        Want::Warned => 0,
    };
    match o.code {
        None if o.seconds >= HANG.as_secs_f64() => bad.push("hang (killed)".into()),
        None => bad.push("killed by a signal".into()),
        Some(0) if c.want != Want::Warned => bad.push("wrongly accepted (exit 0)".into()),
        Some(x) if x != want => bad.push(format!("exit {x}, expected {want}")),
        _ => {}
    }
    let text = match c.want {
        Want::Refused => &o.stderr,
        _ => &all,
    };
    for culprit in &c.culprits {
        if !text.contains(culprit.as_str()) {
            bad.push(format!("message does not name `{culprit}`"));
        }
    }
    if c.want == Want::Refused
        && ![
            "expected",
            "must",
            "missing",
            "not ",
            "need",
            "no ",
            "exceeds",
            "exactly",
            "pass",
            "unknown",
            "empty",
            "EOF",
            "cannot",
            "does not",
            "non-finite",
            "before",
            "overlap",
            "gap",
            "but",
            "already",
            "input",
            "also appears",
            "folder",
            "accepts",
            "only",
        ]
        .iter()
        .any(|w| o.stderr.contains(w))
    {
        bad.push("message does not say what was expected".into());
    }
    let after = snapshot(c.dir.path());
    if &after != before {
        let added: Vec<_> = after.keys().filter(|k| !before.contains_key(*k)).collect();
        let changed: Vec<_> = before
            .iter()
            .filter(|(k, v)| after.get(*k) != Some(v))
            .map(|(k, _)| k)
            .collect();
        bad.push(format!(
            "files changed: left behind {added:?}, touched or removed {changed:?}"
        ));
    }
    bad
}

/// One input kind's case generator.
type Generator = fn() -> Vec<Case>;

#[test]
fn malformed_input_corpus() {
    let t0 = Instant::now();
    let sh = shared();
    let pristine = [&sh.tiny, &sh.random, &sh.gptq, &sh.phone].map(|d| (d.clone(), snapshot(d)));
    let setup = t0.elapsed().as_secs_f64();

    let generators: [(&str, Generator); 10] = [
        ("cli values", cli_values),
        ("config", config_cases),
        ("checkpoint files", checkpoint_cases),
        ("tokenizer", tokenizer_cases),
        ("gptq", gptq_cases),
        ("calibration", calibration_cases),
        ("parity inputs", parity_cases),
        ("phone manifest", phone_cases),
        ("output paths", output_cases),
        ("resources", resource_cases),
    ];
    let mut failures = Vec::new();
    let mut counts = Vec::new();
    let mut total = 0;
    let mut slowest = (0.0, String::new());
    // SPARK_CASES=<text>[|<text>...]: only the cases whose name contains one of them.
    let only = std::env::var("SPARK_CASES").ok();
    for (kind, gen) in generators {
        let cases: Vec<Case> = gen()
            .into_iter()
            .filter(|c| {
                only.as_ref()
                    .is_none_or(|o| o.split('|').any(|p| c.name.contains(p)))
            })
            .collect();
        counts.push(format!("{kind} {}", cases.len()));
        total += cases.len();
        for c in cases {
            let before = snapshot(c.dir.path());
            let o = run_bin(&c.args, c.dir.path(), &c.env, HANG);
            if o.seconds > slowest.0 {
                slowest = (o.seconds, c.name.clone());
            }
            let bad = judge(&c, &o, &before);
            if !bad.is_empty() {
                failures.push(format!(
                    "{}: {}\n    args: {:?}\n    stderr: {}",
                    c.name,
                    bad.join("; "),
                    c.args,
                    o.stderr.trim().replace('\n', "\n            ")
                ));
            }
        }
    }
    for (d, snap) in &pristine {
        assert_eq!(&snapshot(d), snap, "a shared input {} changed", d.display());
    }
    eprintln!(
        "malformed-input corpus: {total} cases ({}), {} failed, {:.1} s (setup {setup:.1} s, slowest {:.2} s: {})",
        counts.join(", "),
        failures.len(),
        t0.elapsed().as_secs_f64(),
        slowest.0,
        slowest.1
    );
    assert!(
        only.is_some() || total >= 150,
        "the corpus has only {total} cases"
    );
    assert!(
        failures.is_empty(),
        "{} of {total} cases misbehaved:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
