//! `export-phone --precision w4a16` on the trained fixture: the GPTQ checkpoint's own codes go
//! into the graph as QNN's LPBQ pattern, bit for bit, with none of the encodings the HTP reads
//! silently wrong; the graph stays within 1.25× the KL of the checkpoint run on CPU; a checkpoint
//! off the LPBQ lattice is refused. Needs the pip `onnxruntime` (tools/requirements.txt).

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use prost::Message;
use spark_tool::checkpoint::TensorStore;
use spark_tool::device::{self, Priority, Target, WeightFormat};
use spark_tool::export::onnx::pb;
use spark_tool::export::{export_phone, ExportOptions, Precision};
use spark_tool::formats::gptq::unpack_qweight;
use spark_tool::quantize::quantize;

fn options() -> ExportOptions {
    common::export_options(Precision::W4A16, 2048)
}

/// The fixture quantized on the phone's path (`--target phone`: LPBQ scales, g64).
fn lpbq_checkpoint() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep().join("gptq");
        let mut o = common::quantize_options(
            &common::fixture("spark-tiny"),
            &dir,
            WeightFormat::W4A16,
            64,
        );
        o.path = device::decide(
            &device::CpuFeatures::default(),
            Target::Phone,
            Priority::Speed,
        );
        assert!(o.path.lpbq);
        o.recipe.lpbq = true;
        o.compare = false;
        quantize(&o).expect("quantize --target phone");
        dir
    })
    .clone()
}

fn exported() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep().join("phone");
        export_phone(&lpbq_checkpoint(), &dir, &options()).expect("w4a16 export");
        dir
    })
    .clone()
}

/// Every initializer of `model.onnx` (external data read in), by name.
fn initializers(dir: &Path) -> (pb::GraphProto, HashMap<String, pb::TensorProto>, Vec<u8>) {
    let m = pb::ModelProto::decode(&std::fs::read(dir.join("model.onnx")).unwrap()[..]).unwrap();
    let data = std::fs::read(dir.join("model.onnx.data")).unwrap();
    let g = m.graph.unwrap();
    let inits = g
        .initializer
        .iter()
        .map(|t| (t.name.clone().unwrap(), t.clone()))
        .collect();
    (g, inits, data)
}

fn bytes<'a>(t: &'a pb::TensorProto, data: &'a [u8]) -> &'a [u8] {
    if let Some(r) = &t.raw_data {
        return r;
    }
    let get = |k: &str| -> usize {
        t.external_data
            .iter()
            .find(|e| e.key.as_deref() == Some(k))
            .unwrap()
            .value
            .as_ref()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (o, l) = (get("offset"), get("length"));
    &data[o..o + l]
}

fn int_attr(n: &pb::NodeProto, name: &str) -> Option<i64> {
    n.attribute
        .iter()
        .find(|a| a.name.as_deref() == Some(name))
        .and_then(|a| a.i)
}

#[test]
fn the_graph_holds_the_checkpoints_codes_as_lpbq_and_nothing_qnn_misreads() {
    let dir = exported();
    let m = spark_tool::phone::Manifest::read(&dir).unwrap();
    assert_eq!(m.precision, "w4a16");
    assert_eq!(
        (
            m.weights[0].encoding.as_str(),
            m.weights[0].bits,
            m.weights[0].block_size
        ),
        ("lpbq", 4, Some(64))
    );
    let (g, inits, data) = initializers(&dir);
    let int4 = pb::tensor_proto::DataType::Int4 as i32;
    let uint4 = pb::tensor_proto::DataType::Uint4 as i32;
    assert!(
        g.node.iter().all(|n| n.op_type.as_deref() != Some("Gemm")),
        "a blocked weight into Gemm runs wrong on the HTP: MatMul only"
    );
    assert!(
        inits.values().all(|t| t.data_type != Some(uint4)),
        "UINT4 with zero point 8 runs wrong: INT4 with zero point 0 only"
    );
    let producer: HashMap<&str, &pb::NodeProto> = g
        .node
        .iter()
        .flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n)))
        .collect();
    let store = TensorStore::open(&lpbq_checkpoint()).unwrap();
    let scale = 1.0 / (common::load("spark-tiny").config().head_dim as f32).sqrt();
    let mut seen = 0;
    for n in g.node.iter().filter(|n| {
        n.op_type.as_deref() == Some("DequantizeLinear")
            && inits.get(&n.input[0]).and_then(|t| t.data_type) == Some(int4)
    }) {
        let name = n.input[0].trim_end_matches("_q4");
        // The INT4 zero point is given (omitted, the EP reads the codes as int8) and zero.
        assert_eq!(n.input.len(), 3, "{name}: DQ2 needs its zero-point input");
        let zp = &inits[&n.input[2]];
        assert_eq!(zp.data_type, Some(int4), "{name}");
        assert!(bytes(zp, &data).iter().all(|&b| b == 0), "{name}");
        assert_eq!(int_attr(n, "axis"), Some(0), "{name}");
        assert_eq!(int_attr(n, "block_size"), Some(64), "{name}");
        // Its scale comes from DQ1(k uint8, γ, uint8 zero point 0, axis 1) with k in 1..16.
        let dq1 = producer[n.input[1].as_str()];
        assert_eq!(dq1.op_type.as_deref(), Some("DequantizeLinear"));
        assert_eq!(int_attr(dq1, "axis"), Some(1), "{name}");
        let kb = &inits[&dq1.input[0]];
        assert_eq!(kb.data_type, Some(pb::tensor_proto::DataType::Uint8 as i32));
        let ks = bytes(kb, &data);
        assert!(
            ks.iter().all(|&k| (1..=16).contains(&k)),
            "{name}: k outside 1..16 runs wrong"
        );
        assert!(bytes(&inits[&dq1.input[2]], &data).iter().all(|&b| b == 0));
        // Consumed by MatMul only.
        let out = &n.output[0];
        for c in g.node.iter().filter(|c| c.input.contains(out)) {
            assert_eq!(
                c.op_type.as_deref(),
                Some("MatMul"),
                "{name} feeds {:?}",
                c.op_type
            );
        }
        // The codes and scales are the checkpoint's: q − 8 and γ·k = s (× 1/√d for q).
        let (l, proj) = name[1..].split_once('_').unwrap();
        let prefix = match proj {
            "wq" | "wk" | "wv" => format!("model.layers.{l}.self_attn.q_k_v_proj"),
            "wo" => format!("model.layers.{l}.self_attn.out_proj"),
            "wgate" => format!("model.layers.{l}.mlp.gate_proj"),
            "wup" => format!("model.layers.{l}.mlp.up_proj"),
            "wdown" => format!("model.layers.{l}.mlp.down_proj"),
            other => panic!("unexpected LPBQ weight {other}"),
        };
        let dims: Vec<usize> = inits[&n.input[0]]
            .dims
            .iter()
            .map(|&d| d as usize)
            .collect();
        let (k, nn) = (dims[0], dims[1]);
        let qw = store.get(&format!("{prefix}.qweight")).unwrap();
        let n_all = qw.shape[1];
        let words: Vec<i32> = store
            .bytes(qw)
            .chunks(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let codes = unpack_qweight(&words, k, n_all);
        let q4 = bytes(&inits[&n.input[0]], &data);
        let nib = |i: usize| -> i8 { (((q4[i / 2] >> (4 * (i % 2))) & 0xF) as i8) << 4 >> 4 };
        let off = column_offset(proj, nn, n_all);
        for kk in 0..k {
            for j in 0..nn {
                assert_eq!(
                    nib(kk * nn + j) as i32,
                    codes[kk * n_all + off + j] as i32 - 8,
                    "{name}: code [{kk}, {j}] differs from the checkpoint's"
                );
            }
        }
        let sc = store
            .to_f32(store.get(&format!("{prefix}.scales")).unwrap())
            .unwrap();
        let gamma_t = &inits[&dq1.input[1]];
        let gamma: Vec<f32> = bytes(gamma_t, &data)
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let m = if proj == "wq" { scale } else { 1.0 };
        for (b, row) in ks.chunks(nn).enumerate() {
            for (j, &kv) in row.iter().enumerate() {
                let want = sc[b * n_all + off + j] * m;
                let got = gamma[j] * kv as f32;
                assert!(
                    (got - want).abs() <= want.abs() * 2e-7,
                    "{name}: block scale [{b}, {j}] {got} vs the checkpoint's {want}"
                );
            }
        }
        seen += 1;
    }
    let layers = common::load("spark-tiny").config().num_hidden_layers;
    assert_eq!(
        seen,
        7 * layers,
        "q, k, v, o, gate, up, down of every layer are LPBQ"
    );
}

/// Where projection `proj` (n columns) starts in its stored tensor of `n_all` columns: q, k, v
/// are consecutive column ranges of the fused `q_k_v_proj`.
fn column_offset(proj: &str, n: usize, n_all: usize) -> usize {
    match proj {
        "wq" => 0,
        // k and v have the same width: q takes the rest.
        "wk" => n_all - 2 * n,
        "wv" => n_all - n,
        _ => 0,
    }
}

#[test]
fn the_w4a16_graph_is_within_1_25x_the_kl_of_its_checkpoint_on_cpu() {
    let dir = exported();
    let parity = |cand: &Path, extra: &[&str]| -> f64 {
        let d = tempfile::tempdir().unwrap();
        let json = d.path().join("parity.json");
        let out = common::tool()
            .arg("parity")
            .arg(common::fixture("spark-tiny"))
            .arg(cand)
            .args(extra)
            .arg("--prompts")
            .arg(common::root().join("tests/golden/prompts/spark-tiny.json"))
            .args(["--max-new-tokens", "16", "--eval-tokens", "0", "--json"])
            .arg(&json)
            .output()
            .unwrap();
        assert!(
            out.status.code().is_some_and(|c| c <= 1),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        v["overall"]["kl_mean"].as_f64().unwrap()
    };
    let graph = parity(&dir, &[]);
    let cpu = parity(&lpbq_checkpoint(), &["--w4-numerics", "w4a16"]);
    assert!(
        graph > 0.0 && graph <= 1.25 * cpu,
        "w4a16 graph KL {graph} vs the checkpoint on CPU {cpu}"
    );
}

#[test]
fn checkpoints_qnn_would_misread_are_refused_and_nothing_is_written() {
    let err = |model: &Path| -> String {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("x");
        let e = export_phone(model, &out, &options())
            .unwrap_err()
            .to_string();
        assert!(!out.exists(), "nothing written");
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            0,
            "no staging left"
        );
        e
    };
    // Free bf16 scales (vLLM's lattice) are not γ·k: refused, naming the tensor.
    let d = tempfile::tempdir().unwrap();
    let free = d.path().join("free");
    let mut o = common::quantize_options(
        &common::fixture("spark-tiny"),
        &free,
        WeightFormat::W4A16,
        64,
    );
    o.compare = false;
    (o.recipe.samples, o.recipe.seq_len) = (4, 64);
    quantize(&o).unwrap();
    let e = err(&free);
    assert!(
        e.contains("model.layers.") && e.contains("--target phone"),
        "{e}"
    );
    // The solve's output folder is checked before the solve: a folder of the user's is refused.
    let user = tempfile::tempdir().unwrap();
    std::fs::write(user.path().join("keep.txt"), "user data").unwrap();
    let e = export_phone(&common::fixture("spark-tiny"), user.path(), &options())
        .unwrap_err()
        .to_string();
    assert!(e.contains("force") || e.contains("not"), "{e}");
    assert!(user.path().join("keep.txt").is_file());
}

#[test]
fn native_calibration_of_the_lpbq_graph_matches_onnxruntime() {
    // GPTQ weights dequantized from LPBQ, norms as their own Mul: the graph's constants.
    let mut o = options();
    o.parts = 2;
    o.calib_samples = 2;
    o.calib_seq_len = 128;
    o.context = 256;
    common::assert_calibrators_agree(&lpbq_checkpoint(), o);
}
