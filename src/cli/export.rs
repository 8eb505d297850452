use std::path::PathBuf;

use clap::{Args, ValueEnum};

use spark_tool::export::{export_phone, Calibrator, ExportOptions, Precision};
use spark_tool::phone::QType;

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    F32,
    F16,
    W8a16,
    W4a16,
}

#[derive(Clone, Copy, ValueEnum)]
enum CalibratorArg {
    Native,
    Onnxruntime,
}

#[derive(Clone, Copy, ValueEnum)]
enum KvArg {
    /// Symmetric int16 (no u16×u16 attention matmul on HTP; docs/PHONE_IO.md §2).
    Int16,
    /// Symmetric uint8 (zero point 128), AI Hub's choice: half the cache memory.
    Uint8,
}

fn range_margin(s: &str) -> Result<f32, String> {
    match super::finite(s) {
        Ok(v) if v >= 1.0 => Ok(v as f32),
        _ => Err(format!("expected a finite number >= 1, got '{s}'")),
    }
}

#[derive(Args)]
pub struct ExportArgs {
    /// The original checkpoint (bf16/f16/f32 safetensors; a folder or a Hugging Face hub id ORG/NAME[@REVISION]), or for
    /// w4a16 a GPTQ checkpoint from `spark-tool quantize --target phone`.
    model: PathBuf,
    /// Output folder (parts, manifest, encodings, embedding table).
    #[arg(long)]
    out: PathBuf,
    /// Positions the full-attention caches hold (sliding layers always keep sliding_window − 1).
    #[arg(long, default_value_t = 4096, value_parser = super::at_least_1)]
    context: usize,
    /// w8a16: int8 weights per channel, calibrated 16-bit activations. w4a16: a `quantize --target
    /// phone` checkpoint's int4 codes as QNN LPBQ (from a float checkpoint, that solve runs first).
    /// f16: float16 weights cast to float32 in the graph. f32: the float graph.
    #[arg(long, value_enum, default_value = "w8a16")]
    precision: PrecisionArg,
    /// KV-cache integer type of w8a16/w4a16 exports [default: int16].
    #[arg(long, value_enum)]
    kv_dtype: Option<KvArg>,
    /// Split into N parts at residual boundaries (balanced by parameters; the head counts as a unit).
    #[arg(long, default_value_t = 1, value_parser = super::at_least_1)]
    parts: usize,
    /// Calibration text for w8a16 activation ranges (default: calibration/spark-calib.jsonl).
    #[arg(long)]
    calibration: Vec<PathBuf>,
    /// Calibration sequences, each decoded token by token through the float graph.
    #[arg(long = "samples", alias = "calib-samples", value_name = "SAMPLES", default_value_t = 8, value_parser = super::at_least_1)]
    calib_samples: usize,
    /// Tokens per calibration sequence.
    #[arg(long = "seq-len", alias = "calib-seq-len", value_name = "SEQ_LEN", default_value_t = 256, value_parser = super::at_least_1)]
    calib_seq_len: usize,
    /// Widen calibrated activation/KV ranges by this factor: 16-bit codes have resolution to
    /// spare, clipping unseen outliers costs more (measured in docs/PHONE_EXPORT.md).
    #[arg(long, default_value_t = 2.0, value_parser = range_margin)]
    range_margin: f32,
    /// How activation ranges are measured: `native` evaluates the float graph's arithmetic over
    /// all calibration tokens at once; `onnxruntime` steps the float graph token by token through
    /// ONNX Runtime (the reference: same ranges to float rounding, much slower).
    #[arg(long, value_enum, default_value = "native")]
    calibrator: CalibratorArg,
    /// Replace OUT if it is a previous export of spark-tool (never anything else; docs/OUTPUTS.md).
    #[arg(long)]
    force: bool,
    /// Run even when the memory plan (printed at the start) exceeds the available memory.
    #[arg(long)]
    force_memory: bool,
    /// Print the export report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(mut a: ExportArgs, out: super::Verbosity) -> anyhow::Result<i32> {
    a.model = super::model(&a.model)?;
    if a.kv_dtype.is_some() && matches!(a.precision, PrecisionArg::F32 | PrecisionArg::F16) {
        anyhow::bail!(
            "--kv-dtype applies to w8a16 and w4a16 exports; an f32 or f16 graph keeps its KV caches in \
             its own float type"
        );
    }
    let opts = ExportOptions {
        context: a.context,
        precision: match a.precision {
            PrecisionArg::F32 => Precision::F32,
            PrecisionArg::F16 => Precision::F16,
            PrecisionArg::W8a16 => Precision::W8A16,
            PrecisionArg::W4a16 => Precision::W4A16,
        },
        kv: match a.kv_dtype {
            None | Some(KvArg::Int16) => QType::Int16,
            Some(KvArg::Uint8) => QType::Uint8,
        },
        parts: a.parts,
        calibration: a.calibration,
        calib_samples: a.calib_samples,
        calib_seq_len: a.calib_seq_len,
        range_margin: a.range_margin,
        calibrator: match a.calibrator {
            CalibratorArg::Native => Calibrator::Native,
            CalibratorArg::Onnxruntime => Calibrator::OnnxRuntime,
        },
        force: a.force,
        force_memory: a.force_memory,
        progress: !out.quiet && !a.json,
        threads: rayon::current_num_threads(),
    };
    let r = export_phone(&a.model, &a.out, &opts).map_err(|e| {
        // Refusals of the output name their own paths; a problem of the input names its folder.
        match e {
            spark_tool::export::ExportError::Artifact(_) => anyhow::Error::new(e),
            e => anyhow::Error::new(e).context(format!("exporting {}", a.model.display())),
        }
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else if !out.quiet {
        for p in &r.parts {
            println!(
                "{:<16} layers {:>2}..{:<2} head {:<5} {:>6} nodes  {:>9} B proto  {:>13} B weights",
                p.file, p.layers[0], p.layers[1], p.head, p.nodes, p.proto_bytes, p.external_bytes
            );
        }
        if r.calibration_tokens > 0 {
            println!(
                "calibrated on {} tokens in {:.1} s ({})",
                r.calibration_tokens,
                r.calibration_seconds,
                match r.calibrator {
                    Some(Calibrator::OnnxRuntime) => "ONNX Runtime stepping the float graph",
                    _ => "native",
                }
            );
        }
        let bytes: u64 = r
            .parts
            .iter()
            .map(|p| p.proto_bytes + p.external_bytes)
            .sum();
        println!(
            "wrote {} ({:.1} MB of graphs) in {:.1} s",
            r.out,
            bytes as f64 / 1e6,
            r.seconds
        );
        // A w4a16 export may come from a GPTQ checkpoint: the original is then another folder.
        let original = match a.precision {
            PrecisionArg::W4a16 => "ORIGINAL".to_string(),
            _ => a.model.display().to_string(),
        };
        println!("next: spark-tool parity {original} {}     # check the graph against the original on CPU", r.out);
        println!("      python3 tools/qnn_check.py {} --run   # compile for the HTP and run it there (README.md)", r.out);
    }
    Ok(0)
}
