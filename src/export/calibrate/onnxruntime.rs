//! The reference calibrator: the float graphs, every intermediate tensor an extra output, driven
//! through ONNX Runtime over the calibration windows exactly as an app would (host caches, masks,
//! cos/sin), one part at a time.

use std::collections::BTreeMap;
use std::path::Path;

use super::super::graph::{PartPlan, WeightSpec};
use super::super::onnx::{DType, Graph};
use super::super::weights::WeightReader;
use super::super::{descriptors, qdq, write_part, ExportError, ExportOptions};
use crate::artifact::{self, io_err};
use crate::calibration::Windows;
use crate::checkpoint::Checkpoint;
use crate::phone::manifest;
use crate::phone::PhoneModel;

/// Ranges of every float tensor: write the float graphs with every
/// intermediate tensor as an extra output, drive them over the calibration
/// windows exactly as an app would (host caches, masks, cos/sin), record min/max.
#[allow(clippy::too_many_arguments)]
pub(super) fn ranges(
    ck: &Checkpoint,
    opts: &ExportOptions,
    windows: &Windows,
    stage: &Path,
    plans: &[PartPlan],
    graphs: &[Graph<WeightSpec>],
    metadata: &BTreeMap<String, String>,
    reader: &mut WeightReader,
    total_inits: usize,
) -> Result<qdq::Ranges, ExportError> {
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
    // One part at a time: ONNX Runtime holds one part's f32 weights, not the whole model's. The
    // residual stream each part hands on is kept for every calibration token and fed to the
    // next part (samples · seq_len · hidden floats).
    let mut ranges = qdq::Ranges::default();
    let n_parts = m.parts.len();
    let hidden = ck.config.hidden_size;
    let pb = artifact::progress_bar(
        opts.progress,
        (n_parts * windows.samples * windows.seq_len) as u64,
        "calibrating",
    );
    let mut streams: Vec<Vec<f32>> = Vec::new();
    for pi in 0..n_parts {
        pb.set_message(format!("part {} of {n_parts}", pi + 1));
        let model = PhoneModel::open_parts(&dir, opts.threads, Some(pi..pi + 1))
            .map_err(ExportError::CalibrationGraph)?;
        let mut next = Vec::with_capacity(windows.samples);
        for s in 0..windows.samples {
            let mut seq = model.sequence().map_err(ExportError::CalibrationGraph)?;
            let tokens = windows.sample(s);
            let mut out_stream = Vec::with_capacity(tokens.len() * hidden);
            for (i, &t) in tokens.iter().enumerate() {
                let input = match streams.get(s) {
                    Some(prev) => prev[i * hidden..(i + 1) * hidden].to_vec(),
                    None => model.embed(t).map_err(ExportError::CalibrationRun)?,
                };
                let out = seq
                    .step_parts(input, |name, v| ranges.observe(name, v))
                    .map_err(ExportError::CalibrationRun)?;
                if pi + 1 < n_parts {
                    out_stream.extend_from_slice(&out.hidden);
                }
                pb.inc(1);
            }
            next.push(out_stream);
        }
        streams = next;
    }
    pb.finish_and_clear();
    std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    Ok(ranges)
}
