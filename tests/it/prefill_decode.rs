//! The KV caches must make token-by-token decoding give the same logits as
//! one prefill over the whole prompt, well past twice the sliding window
//! (so every sliding ring buffer wraps several times).

use crate::common;

use spark_tool::model::{Logits, SparkModel};

/// Relative to the row's largest |logit|: f32 summation-order differences
/// between a batched and a one-row matmul are ~1e-6 here.
const REL_TOL: f32 = 1e-4;

fn prompt(model: &SparkModel, len: usize) -> Vec<u32> {
    // Any ids exercise the caches equally.
    spark_tool::bench::prompt_ids(len, model.config().vocab_size)
}

fn assert_rows_close(a: &[f32], b: &[f32], vocab: usize, tol: f32, what: &str) {
    for (pos, (ra, rb)) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)).enumerate() {
        let scale = rb.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = ra
            .iter()
            .zip(rb)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            worst <= tol * scale,
            "{what}: position {pos}: max |Δ| {worst} vs scale {scale}"
        );
    }
}

fn check(name: &str) {
    check_model(name, common::load(name), REL_TOL);
}

fn check_model(name: &str, model: SparkModel, tol: f32) {
    let cfg = model.config().clone();
    let len = 2 * cfg.sliding_window + 23;
    let ids = prompt(&model, len);
    let vocab = cfg.vocab_size;

    let mut cache = model.new_cache(len);
    let prefill = model.forward(&ids, &mut cache, Logits::All).unwrap();

    let mut cache = model.new_cache(len);
    let mut decode = Vec::with_capacity(prefill.len());
    for &t in &ids {
        decode.extend(model.forward(&[t], &mut cache, Logits::Last).unwrap());
    }
    assert_rows_close(
        &decode,
        &prefill,
        vocab,
        tol,
        &format!("{name} decode vs prefill"),
    );

    // Chunked prefill: chunks that straddle the window boundary mix cached and fresh keys.
    let mut cache = model.new_cache(len);
    let mut chunked = Vec::with_capacity(prefill.len());
    for chunk in ids.chunks(cfg.sliding_window / 2 + 3) {
        chunked.extend(model.forward(chunk, &mut cache, Logits::All).unwrap());
    }
    assert_rows_close(
        &chunked,
        &prefill,
        vocab,
        tol,
        &format!("{name} chunked vs prefill"),
    );

    // Beyond the context the cache was sized for, the call fails instead of growing.
    assert!(model.forward(&ids[..1], &mut cache, Logits::Last).is_err());
}

#[test]
fn trained_fixture_prefill_equals_decode() {
    check("spark-tiny");
}

#[test]
fn random_fixture_prefill_equals_decode() {
    check("spark-random");
}

/// With bf16 activations (a GPTQ artifact's numerics) prefill takes attention's bf16 block
/// kernels over a gathered copy of the cache and decode its f32 registers: every product is
/// exact in both, but a sum in another order can flip one bf16 rounding of an activation or a
/// probability, and the logits themselves are bf16 (a step of 1/128–1/256 of the largest): the
/// worst seen is 1.3e-2 (two such steps), so the bound is a few steps; a position mixed up
/// between cache and block is off by far more.
#[test]
fn bf16_activations_prefill_equals_decode() {
    use spark_tool::checkpoint::Checkpoint;
    use spark_tool::model::{LoadOptions, QuantExec, W4Numerics};
    for name in ["spark-tiny", "spark-random"] {
        let ck = Checkpoint::open(&common::fixture(name)).expect("fixture opens");
        let exec = QuantExec {
            numerics: W4Numerics::W4A16,
            act_bf16: true,
        };
        let opts = LoadOptions {
            progress: false,
            exec,
        };
        let model = SparkModel::load(&ck, opts).expect("fixture loads");
        check_model(name, model, 5e-2);
    }
}

#[test]
fn sliding_window_is_exactly_the_last_w_tokens() {
    // With only sliding layers, information travels at most W-1 positions per
    // layer, so the last position of an L-layer stack sees back exactly
    // L·(W-1) tokens. Changing the token just inside that horizon must change
    // the last logits; changing the one just outside must not (bit-exact).
    // An off-by-one in the window moves the horizon and fails one of the two.
    let dir = tempfile::tempdir().unwrap();
    common::copy_dir(&common::fixture("spark-random"), dir.path());
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    cfg["layer_types"] = serde_json::json!(vec!["sliding_attention"; layers]);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let ck = spark_tool::checkpoint::Checkpoint::open(dir.path()).unwrap();
    let model = SparkModel::from_checkpoint(&ck, false).unwrap();
    let w = model.config().sliding_window;
    let horizon = layers * (w - 1);
    let ids = prompt(&model, horizon + 10);
    let last = ids.len() - 1;
    let run = |ids: &[u32]| {
        let mut c = model.new_cache(ids.len());
        model.forward(ids, &mut c, Logits::Last).unwrap()
    };
    let base = run(&ids);
    let bump = |i: usize| {
        let mut v = ids.clone();
        v[i] = (v[i] + 1) % model.config().vocab_size as u32;
        v
    };
    assert_ne!(
        run(&bump(last - horizon)),
        base,
        "token at the horizon must be visible"
    );
    assert_eq!(
        run(&bump(last - horizon - 1)),
        base,
        "token past the horizon must be invisible"
    );
}
