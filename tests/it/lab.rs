//! The lab's options (`--features lab`; docs/QUANTIZE.md "The lab") end to end on the trained
//! fixture: refit and descent only lower the solved error, tuning lowers its own objective and
//! resumes to the same bytes, and each refuses what it cannot tune.

use crate::common;

use std::path::Path;

use spark_tool::checkpoint::TensorStore;
use spark_tool::device::WeightFormat;
use spark_tool::quantize::phases::Phase;
use spark_tool::quantize::{quantize, Objective, QuantReport, QuantizeError, QuantizeOptions};

fn opts(out: &Path, format: WeightFormat, group_size: usize) -> QuantizeOptions {
    common::quantize_options(&common::fixture("spark-tiny"), out, format, group_size)
}

#[test]
fn scale_refit_rounds_only_ever_lower_a_linears_error() {
    let d = tempfile::tempdir().unwrap();
    let run = |rounds, name: &str| {
        let mut o = opts(&d.path().join(name), WeightFormat::W4A8, 128);
        (o.recipe.lab.refit_rounds, o.compare) = (rounds, false);
        quantize(&o).unwrap()
    };
    let (plain, refit) = (run(0, "plain"), run(2, "refit"));
    assert_eq!(refit.recipe.lab.refit_rounds, 2);
    // The same first solve on the same inputs until a linear changes; from then on later inputs
    // differ, so only the first linear is compared exactly, and the mean overall.
    assert!(refit.linears[0].error <= plain.linears[0].error);
    let better = plain
        .linears
        .iter()
        .zip(&refit.linears)
        .filter(|(p, r)| r.error < p.error)
        .count();
    assert!(
        better * 2 > plain.linears.len() && refit.mean_error < plain.mean_error,
        "refit lowered {better} of {} linears; mean {} vs {}",
        plain.linears.len(),
        refit.mean_error,
        plain.mean_error
    );
}

#[test]
fn descent_passes_lower_the_error_of_the_linears_they_touch() {
    let d = tempfile::tempdir().unwrap();
    let run = |passes, name: &str| {
        let mut o = opts(&d.path().join(name), WeightFormat::W4A8, 128);
        (o.recipe.lab.descent_passes, o.compare) = (passes, false);
        quantize(&o).unwrap()
    };
    let (plain, cd) = (run(0, "plain"), run(4, "descent"));
    assert_eq!(cd.recipe.lab.descent_passes, 4);
    let phase = |r: &QuantReport| {
        r.phases
            .iter()
            .find(|p| p.phase == Phase::Descent)
            .map_or(0.0, |p| p.seconds)
    };
    assert!(phase(&cd) > 0.0 && phase(&plain) == 0.0);
    // The same first solve on the same inputs: descent only ever lowers that linear's error. Later
    // linears see other inputs, so they are compared by count and mean.
    assert!(cd.linears[0].error < plain.linears[0].error);
    let better = plain
        .linears
        .iter()
        .zip(&cd.linears)
        .filter(|(p, r)| r.error < p.error)
        .count();
    assert!(
        better * 4 > plain.linears.len() * 3 && cd.mean_error < 0.98 * plain.mean_error,
        "descent lowered {better} of {} linears; mean {} vs {}",
        plain.linears.len(),
        cd.mean_error,
        plain.mean_error
    );
}

#[test]
fn block_tuning_lowers_block_errors_writes_its_norms_and_resumes_identically() {
    use spark_tool::quantize::lab::BlockTune;
    let d = tempfile::tempdir().unwrap();
    let tuned = |out: &Path| {
        let mut o = opts(out, WeightFormat::W4A8, 128);
        o.compare = false;
        o.recipe.lab.block_tune = Some(BlockTune {
            steps: 30,
            batch: 4,
            lr: 5e-2,
            check: 10,
            ..BlockTune::default()
        });
        o
    };
    let full = d.path().join("full");
    let r = quantize(&tuned(&full)).unwrap();
    assert_eq!(r.block_tune_layers.len(), 8);
    for l in &r.block_tune_layers {
        assert!(l.error_after <= l.error_before, "{l:?}");
    }
    assert!(
        r.block_tune_layers
            .iter()
            .filter(|l| l.tuned && l.error_after < l.error_before)
            .count()
            >= 6,
        "{:?}",
        r.block_tune_layers
    );
    assert!(r.block_tune_layers.iter().any(|l| l.codes_moved > 0));
    let phase = r
        .phases
        .iter()
        .find(|p| p.phase == Phase::BlockTune)
        .unwrap();
    assert!(phase.seconds > 0.0);
    assert!(r.memory_plan.block_tune > 0);

    // The tuned norms are in the checkpoint (bf16); the recipe is recorded.
    let orig = TensorStore::open(&common::fixture("spark-tiny")).unwrap();
    let out = TensorStore::open(&full).unwrap();
    let name = "model.layers.0.input_layernorm.weight";
    let (a, b) = (
        orig.to_f32(orig.get(name).unwrap()).unwrap(),
        out.to_f32(out.get(name).unwrap()).unwrap(),
    );
    assert_eq!(out.get(name).unwrap().dtype, safetensors::Dtype::BF16);
    assert!(a != b, "layer 0's norm was tuned");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(full.join("config.json")).unwrap()).unwrap();
    let recipe = &cfg["quantization_config"]["meta"]["spark_tool"]["recipe"]["lab"]["block_tune"];
    assert_eq!(recipe["steps"], 30, "{cfg}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(full.join("quant_report.json")).unwrap())
            .unwrap();
    assert_eq!(report["block_tune_layers"].as_array().unwrap().len(), 8);

    // Interrupted after 3 layers and resumed: the same bytes and the same per-layer record.
    let resumed = d.path().join("resumed");
    let mut o = tuned(&resumed);
    o.stop_after_layers = Some(3);
    assert!(matches!(quantize(&o), Err(QuantizeError::Interrupted(3))));
    (o.stop_after_layers, o.resume) = (None, true);
    let r2 = quantize(&o).unwrap();
    assert_eq!(r2.resumed_from_layer, Some(3));
    assert_eq!(r2.block_tune_layers.len(), 8);
    for (a, b) in r.block_tune_layers.iter().zip(&r2.block_tune_layers) {
        assert_eq!(
            (a.error_after, a.codes_moved),
            (b.error_after, b.codes_moved)
        );
    }
    let a = std::fs::read(full.join("model.safetensors")).unwrap();
    let b = std::fs::read(resumed.join("model.safetensors")).unwrap();
    assert!(a == b, "resumed block-tuned checkpoint differs");
}

#[test]
fn block_tuning_refuses_what_it_cannot_tune() {
    use spark_tool::quantize::lab::BlockTune;
    let d = tempfile::tempdir().unwrap();
    let mut o = opts(&d.path().join("q"), WeightFormat::W4A8, 128);
    o.recipe.lab.block_tune = Some(BlockTune::default());
    o.recipe.objective = Objective::QuantizedInput;
    let e = quantize(&o).unwrap_err().to_string();
    assert!(
        e.contains("lab.block_tune") && e.contains("float-output"),
        "{e}"
    );
    assert!(!d.path().join("q").exists());
}

#[test]
fn model_tuning_lowers_the_kl_writes_its_state_and_resumes_identically() {
    use spark_tool::quantize::lab::ModelTune;
    let d = tempfile::tempdir().unwrap();
    let tuned = |out: &Path| {
        let mut o = opts(out, WeightFormat::W4A16, 128);
        o.compare = false;
        o.recipe.lab.model_tune = Some(ModelTune {
            steps: 24,
            batch: 4,
            scale_lr: 2e-3,
            check: 8,
            ..ModelTune::default()
        });
        o
    };
    let full = d.path().join("full");
    let r = quantize(&tuned(&full)).unwrap();
    let m = r.model_tune_result.clone().unwrap();
    assert!(m.tuned && m.kl_after < m.kl_before, "{m:?}");
    assert_eq!(m.codes_moved, 0);
    // The streams no longer describe the written model once every layer is tuned.
    assert_eq!(r.stream_error, None);
    assert!(r.memory_plan.model_tune > 0);
    let phase = r.phases.iter().find(|p| p.phase == Phase::ModelTune);
    assert!(phase.unwrap().seconds > 0.0);

    // Against the same run without tuning: same codes, other scales and norms.
    let plain = d.path().join("plain");
    let mut o = tuned(&plain);
    o.recipe.lab.model_tune = None;
    quantize(&o).unwrap();
    let (a, b) = (
        TensorStore::open(&plain).unwrap(),
        TensorStore::open(&full).unwrap(),
    );
    let q = "model.layers.2.mlp.down_proj";
    assert_eq!(
        common::i32s(&a, &format!("{q}.qweight")),
        common::i32s(&b, &format!("{q}.qweight"))
    );
    let s = |st: &TensorStore, n: &str| st.to_f32(st.get(n).unwrap()).unwrap();
    assert!(s(&a, &format!("{q}.scales")) != s(&b, &format!("{q}.scales")));
    let norm = "model.layers.5.post_attention_layernorm.weight";
    assert_eq!(b.get(norm).unwrap().dtype, safetensors::Dtype::BF16);
    assert!(s(&a, norm) != s(&b, norm), "the norms were tuned");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(full.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        cfg["quantization_config"]["meta"]["spark_tool"]["recipe"]["lab"]["model_tune"]["steps"],
        24,
        "{cfg}"
    );

    // Interrupted after 3 layers and resumed: the same bytes.
    let resumed = d.path().join("resumed");
    let mut o = tuned(&resumed);
    o.stop_after_layers = Some(3);
    assert!(matches!(quantize(&o), Err(QuantizeError::Interrupted(3))));
    (o.stop_after_layers, o.resume) = (None, true);
    let r2 = quantize(&o).unwrap();
    assert_eq!(r2.model_tune_result.unwrap().kl_after, m.kl_after);
    let a = std::fs::read(full.join("model.safetensors")).unwrap();
    let b = std::fs::read(resumed.join("model.safetensors")).unwrap();
    assert!(a == b, "resumed model-tuned checkpoint differs");
}

#[test]
fn model_tuning_refuses_what_it_cannot_tune() {
    use spark_tool::quantize::lab::ModelTune;
    let d = tempfile::tempdir().unwrap();
    let mut o = opts(&d.path().join("q"), WeightFormat::W4A8, 128);
    o.recipe.lab.model_tune = Some(ModelTune::default());
    o.recipe.objective = Objective::QuantizedInput;
    let e = quantize(&o).unwrap_err().to_string();
    assert!(
        e.contains("lab.model_tune") && e.contains("float-output"),
        "{e}"
    );
    let mut o = opts(&d.path().join("q"), WeightFormat::W4A8, 128);
    o.recipe.lab.model_tune = Some(ModelTune::default());
    o.recipe.quantize_head = true;
    let e = quantize(&o).unwrap_err().to_string();
    assert!(e.contains("quantize_head"), "{e}");
    assert!(!d.path().join("q").exists());
}
