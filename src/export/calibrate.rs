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
    // One part at a time: ONNX Runtime holds one part's f32 weights, not the whole model's. The
    // residual stream each part hands on is kept for every calibration token and fed to the
    // next part (samples · seq_len · hidden floats).
    let mut ranges = qdq::Ranges::default();
    let mask_value = m.mask_value;
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
    // Inputs the host builds: masks span {mask, 0}, cos/sin [-1, 1]; the
    // embedding range comes from the table itself.
    for t in m.types.values() {
        ranges.observe(&t.mask, &[mask_value, 0.0]);
        ranges.observe(&t.cos, &[-1.0, 1.0]);
        ranges.observe(&t.sin, &[-1.0, 1.0]);
    }
    // The embedding range from the table, a block of rows at a time (the 4B's is 1.3 GB in f32).
    let e = ck.entry("model.embedding.weight")?;
    let vocab = e.shape[0];
    for r0 in (0..vocab).step_by(4096) {
        let rows = ck.store.rows_to_f32(e, r0, (r0 + 4096).min(vocab))?;
        ranges.observe(graph::EMBEDS, &rows);
    }
    if let Some(r) = ranges.0.get(graph::HIDDEN_OUT).copied() {
        ranges.0.insert(graph::HIDDEN_IN.into(), r);
    }
    std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    Ok(ranges)
}
