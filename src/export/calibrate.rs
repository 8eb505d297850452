//! Activation ranges for w8a16, measured by driving the float graph over real text.

use std::collections::BTreeMap;
use std::path::Path;

use super::graph::{self, PartPlan, WeightSpec};
use super::onnx::{DType, Graph};
use super::weights::WeightReader;
use super::{descriptors, qdq, write_part, ExportError, ExportOptions};
use crate::artifact::{self, io_err};
use crate::checkpoint::Checkpoint;
use crate::phone::manifest;
use crate::phone::PhoneModel;
use crate::quantize::calibration;
use crate::tokenizer::SparkTokenizer;

/// Ranges of every float tensor: write the float graphs with every
/// intermediate tensor as an extra output, drive them over the calibration
/// windows exactly as an app would (host caches, masks, cos/sin), record min/max.
#[allow(clippy::too_many_arguments)]
pub(super) fn calibrate(
    ck: &Checkpoint,
    opts: &ExportOptions,
    stage: &Path,
    plans: &[PartPlan],
    graphs: &[Graph<WeightSpec>],
    metadata: &BTreeMap<String, String>,
    reader: &mut WeightReader,
    total_inits: usize,
) -> Result<qdq::Ranges, ExportError> {
    let tok_path = ck.tokenizer_path().ok_or_else(|| {
        ExportError::Calibration(format!(
            "{} has no tokenizer.json; w8a16 needs real text to calibrate on",
            ck.dir.display()
        ))
    })?;
    let tok = SparkTokenizer::from_file(&tok_path).map_err(ExportError::CalibrationTokenizer)?;
    let files = if opts.calibration.is_empty() {
        vec![calibration::bundled()]
    } else {
        opts.calibration.clone()
    };
    let seq_len = opts.calib_seq_len.min(opts.context);
    let windows = calibration::build(&files, &tok, opts.calib_samples, seq_len)
        .map_err(ExportError::CalibrationText)?;
    let dir = stage.join("calibration-f32");
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let pb = artifact::progress_bar(opts.progress, total_inits as u64, "float graph");
    let mut parts = Vec::new();
    for (g, p) in graphs.iter().zip(plans) {
        let mut tapped = g.clone();
        let declared: std::collections::HashSet<String> =
            tapped.outputs.iter().map(|o| o.name.clone()).collect();
        for n in &g.nodes {
            let o = &n.outputs[0];
            if g.info[o].dtype == DType::F32 && !declared.contains(o) {
                tapped.output(o);
            }
        }
        let w = write_part(&tapped, p, &dir, reader, metadata, None, &pb)?;
        pb.inc(g.inits.len() as u64);
        parts.push(w.manifest_part);
    }
    pb.finish_and_clear();
    let mut m = descriptors::build_manifest(
        ck,
        opts,
        "f32",
        parts,
        "../embed_tokens.safetensors",
        "float32",
        4,
    );
    m.calibration_outputs = true;
    artifact::write_json(&dir.join(manifest::MANIFEST), &m)?;
    std::fs::copy(ck.dir.join("config.json"), dir.join("config.json")).map_err(io_err(&dir))?;
    let model = PhoneModel::open(&dir, opts.threads).map_err(ExportError::CalibrationGraph)?;
    let mut ranges = qdq::Ranges::default();
    let mask_value = m.mask_value;
    let pb = artifact::progress_bar(
        opts.progress,
        (windows.samples * windows.seq_len) as u64,
        "calibrating",
    );
    for s in 0..windows.samples {
        let mut seq = model.sequence().map_err(ExportError::CalibrationGraph)?;
        for &t in windows.sample(s) {
            seq.step(t, |name, v| ranges.observe(name, v))
                .map_err(ExportError::CalibrationRun)?;
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    // Inputs the host builds: masks span {mask, 0}, cos/sin [-1, 1]; the
    // embedding range comes from the table itself.
    for t in m.types.values() {
        ranges.observe(&t.mask, &[mask_value, 0.0]);
        ranges.observe(&t.cos, &[-1.0, 1.0]);
        ranges.observe(&t.sin, &[-1.0, 1.0]);
    }
    let emb = ck.tensor_f32("model.embedding.weight")?;
    ranges.observe(graph::EMBEDS, &emb);
    if let Some(r) = ranges.0.get(graph::HIDDEN_OUT).copied() {
        ranges.0.insert(graph::HIDDEN_IN.into(), r);
    }
    drop(model);
    std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    Ok(ranges)
}
