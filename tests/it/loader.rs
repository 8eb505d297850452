//! Bad checkpoints give errors that name the file, tensor or field — never a panic.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use spark_tool::checkpoint::{Checkpoint, TensorStore};

/// Every tensor of spark-random as (dtype, shape, bytes).
fn random_tensors() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let dir = common::fixture("spark-random");
    let store = TensorStore::open(&dir).unwrap();
    store
        .entries()
        .map(|e| {
            (
                e.name.clone(),
                e.dtype,
                e.shape.clone(),
                store.bytes(e).to_vec(),
            )
        })
        .collect()
}

fn write_single(dir: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    std::fs::copy(
        common::fixture("spark-random/config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(
        views,
        None::<HashMap<String, String>>,
        &dir.join("model.safetensors"),
    )
    .unwrap();
}

fn open_err(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("expected {} to be rejected", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn single_file_copy_of_sharded_fixture_loads() {
    let d = tempfile::tempdir().unwrap();
    write_single(d.path(), &random_tensors());
    Checkpoint::open(d.path()).unwrap();
}

#[test]
fn missing_tensor_is_named_with_its_shape() {
    let d = tempfile::tempdir().unwrap();
    let t: Vec<_> = random_tensors()
        .into_iter()
        .filter(|t| t.0 != "model.layers.3.mlp.up_proj.weight")
        .collect();
    write_single(d.path(), &t);
    let e = open_err(d.path());
    assert!(
        e.contains(
            "missing tensor `model.layers.3.mlp.up_proj.weight` (expected shape [320, 128])"
        ),
        "{e}"
    );
}

#[test]
fn misshaped_and_mistyped_tensors_are_reported_together() {
    let d = tempfile::tempdir().unwrap();
    let mut t = random_tensors();
    for x in t.iter_mut() {
        if x.0 == "model.layers.1.self_attn.g_proj.weight" {
            // 3×128 f16 = 768 bytes; reshape to 6×64.
            x.2 = vec![6, 64];
        }
        if x.0 == "model.norm.weight" {
            x.1 = Dtype::I32;
        }
    }
    write_single(d.path(), &t);
    let e = open_err(d.path());
    assert!(e.contains("2 problems"), "{e}");
    assert!(
        e.contains("`model.layers.1.self_attn.g_proj.weight`")
            && e.contains("shape [6, 64], expected [3, 128]"),
        "{e}"
    );
    assert!(
        e.contains("`model.norm.weight`") && e.contains("dtype I32, expected BF16, F16 or F32"),
        "{e}"
    );
}

#[test]
fn unknown_extra_tensor_is_reported() {
    let d = tempfile::tempdir().unwrap();
    let mut t = random_tensors();
    t.push((
        "model.layers.0.self_attn.q_norm.weight".into(),
        Dtype::F32,
        vec![48],
        vec![0u8; 48 * 4],
    ));
    write_single(d.path(), &t);
    let e = open_err(d.path());
    assert!(
        e.contains("unexpected tensor `model.layers.0.self_attn.q_norm.weight`"),
        "{e}"
    );
}

#[test]
fn truncated_file_is_an_error_naming_the_file() {
    let d = tempfile::tempdir().unwrap();
    common::copy_dir(&common::fixture("spark-random"), d.path());
    let shard = d.path().join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("truncated"),
        "{e}"
    );
    // Cut inside the header too.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(20)
        .unwrap();
    let e = open_err(d.path());
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}

#[test]
fn index_naming_a_missing_shard_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    common::copy_dir(&common::fixture("spark-random"), d.path());
    std::fs::remove_file(d.path().join("model-00001-of-00002.safetensors")).unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("model-00001-of-00002.safetensors"),
        "{e}"
    );
}

#[test]
fn bad_config_value_names_the_field_and_file() {
    let d = tempfile::tempdir().unwrap();
    common::copy_dir(&common::fixture("spark-random"), d.path());
    let p = d.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    cfg["hidden_act"] = "silu".into();
    std::fs::write(&p, cfg.to_string()).unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("config.json") && e.contains("`hidden_act`") && e.contains("silu"),
        "{e}"
    );
}

#[test]
fn folder_without_weights_or_config() {
    let d = tempfile::tempdir().unwrap();
    let e = open_err(d.path());
    assert!(e.contains("config.json"), "{e}");
    std::fs::copy(
        common::fixture("spark-random/config.json"),
        d.path().join("config.json"),
    )
    .unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("neither model.safetensors nor model.safetensors.index.json"),
        "{e}"
    );
    let e = open_err(&d.path().join("nope"));
    assert!(e.contains("nope does not exist"), "{e}");
    let e = open_err(&d.path().join("config.json"));
    assert!(e.contains("config.json is not a directory"), "{e}");
}

#[test]
fn tied_config_with_identical_lm_head_loads_with_warning() {
    let d = tempfile::tempdir().unwrap();
    let mut t = random_tensors();
    // Make the fixture "tied" and give it an lm_head equal to the embedding.
    let emb = t
        .iter()
        .find(|x| x.0 == "model.embedding.weight")
        .unwrap()
        .clone();
    for x in t.iter_mut() {
        if x.0 == "lm_head.weight" {
            *x = ("lm_head.weight".into(), emb.1, emb.2.clone(), emb.3.clone());
        }
    }
    write_single(d.path(), &t);
    let p = d.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    cfg["tie_word_embeddings"] = true.into();
    std::fs::write(&p, cfg.to_string()).unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    assert!(ck.layout.tied);
    assert!(
        ck.layout
            .warnings
            .iter()
            .any(|w| w.contains("equals the embedding")),
        "{:?}",
        ck.layout.warnings
    );
}
