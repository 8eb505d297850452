//! Activation ranges for w8a16/w4a16: the float step graph's every tensor, min/max over the
//! calibration text. Two calibrators compute them: [`native`] (the default) evaluates the graph's
//! arithmetic over every calibration token at once; [`onnxruntime`] drives the float graph through
//! ONNX Runtime one token per step, as an app would — slow, but the graph itself, so it is the
//! reference the native ranges are tested against (tests/phone.rs).

mod native;
mod onnxruntime;

use std::collections::BTreeMap;
use std::path::Path;

pub(super) use native::plan_bytes as native_plan_bytes;

use super::graph::{self, PartPlan, WeightSpec};
use super::onnx::Graph;
use super::weights::WeightReader;
use super::{qdq, ExportError, ExportOptions};
use crate::calibration::{self, Windows};
use crate::checkpoint::Checkpoint;
use crate::tokenizer::SparkTokenizer;

/// How the activation ranges are measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Calibrator {
    /// The graph's arithmetic evaluated here, batched over all calibration tokens.
    Native,
    /// The float graph run by ONNX Runtime, one decode step per token.
    OnnxRuntime,
}

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
    let windows = windows(ck, opts)?;
    let mask_value = super::descriptors::mask_value(opts.precision);
    let mut ranges = match opts.calibrator {
        Calibrator::Native => {
            native::ranges(ck, opts, &windows, plans, graphs, reader, mask_value)?
        }
        Calibrator::OnnxRuntime => onnxruntime::ranges(
            ck,
            opts,
            &windows,
            stage,
            plans,
            graphs,
            metadata,
            reader,
            total_inits,
        )?,
    };
    // Inputs the host builds: masks span {mask, 0}, cos/sin [-1, 1]; the
    // embedding range comes from the table itself.
    for t in ck.config.layer_types.iter() {
        ranges.observe(&graph::mask_input(*t), &[mask_value, 0.0]);
        ranges.observe(&graph::cos_input(*t), &[-1.0, 1.0]);
        ranges.observe(&graph::sin_input(*t), &[-1.0, 1.0]);
    }
    // The embedding range from the table, a block of rows at a time (the 4B's is 1.3 GB in f32).
    let e = ck.entry("model.embedding.weight")?;
    let vocab = e.shape[0];
    for r0 in (0..vocab).step_by(4096) {
        let r1 = (r0 + 4096).min(vocab);
        let rows = ck.store.rows_to_f32(e, r0, r1)?;
        ck.store.release_rows(e, r0, r1);
        ranges.observe(graph::EMBEDS, &rows);
    }
    if let Some(r) = ranges.0.get(graph::HIDDEN_OUT).copied() {
        ranges.0.insert(graph::HIDDEN_IN.into(), r);
    }
    Ok(ranges)
}

/// The calibration windows: the export's text (the bundled set by default) through the
/// checkpoint's tokenizer, each at most the exported context long.
fn windows(ck: &Checkpoint, opts: &ExportOptions) -> Result<Windows, ExportError> {
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
    calibration::build(&files, &tok, opts.calib_samples, seq_len)
        .map_err(ExportError::CalibrationText)
}
