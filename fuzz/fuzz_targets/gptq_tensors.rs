//! GPTQ: `GptqInfo::from_json` on a `quantization_config` block, `check_tensors` on the tensor
//! set of linear `x` in a real safetensors file, and `read_linear` once the check passed.
//! Input: the bytes of `x.safetensors`, optionally with `=====FILE qc.json` (the block;
//! default: gptq, 4 bits, group 32) and `=====FILE args` (`n k g c0 c1` in decimal; default:
//! the shape `x.qweight` implies, the block's group size and every column).
#![no_main]

use libfuzzer_sys::fuzz_target;
use spark_tool::checkpoint::TensorStore;
use spark_tool::formats::gptq::{check_tensors, read_linear, GptqInfo};
use spark_tool_fuzz::{split_files, write_files};

const DEFAULT_QC: &str = r#"{"quant_method":"gptq","bits":4,"group_size":32,"sym":true}"#;

fuzz_target!(|data: &[u8]| {
    let files = split_files(data, "x.safetensors");
    let get = |name: &str| files.iter().rev().find(|(n, _)| *n == name).map(|f| f.1);
    let qc: serde_json::Value = match get("qc.json") {
        Some(b) => match serde_json::from_slice(b) {
            Ok(v) => v,
            Err(_) => return,
        },
        None => serde_json::from_str(DEFAULT_QC).expect("default block"),
    };
    let info = GptqInfo::from_json(&qc, "config.json");
    let dir = tempfile::tempdir().expect("tempdir");
    write_files(dir.path(), &files);
    let Ok(store) = TensorStore::open_file(&dir.path().join("x.safetensors")) else {
        return;
    };
    let args: Vec<usize> = get("args")
        .and_then(|b| std::str::from_utf8(b).ok())
        .map(|s| {
            s.split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let implied = store
        .get("x.qweight")
        .and_then(|e| Some((e.shape.get(1).copied()?, e.shape.first()?.checked_mul(8)?)));
    let (n, k) = match (args.first(), args.get(1), implied) {
        (Some(&n), Some(&k), _) => (n, k),
        (_, _, Some(nk)) => nk,
        _ => (8, 32),
    };
    let g = args
        .get(2)
        .copied()
        .or(info.as_ref().ok().map(|i| i.group_size))
        .unwrap_or(32);
    let cols = match (args.get(3), args.get(4)) {
        (Some(&a), Some(&b)) if a <= b => a..b,
        _ => 0..n,
    };
    let mut problems = Vec::new();
    check_tensors(&store, "x", n, k, g, &mut problems);
    let Ok(info) = info else { return };
    if problems.is_empty() && info.group_size == g {
        if let Ok(d) = read_linear(&store, &info, "x", cols.clone()) {
            assert_eq!(d.k, k);
            assert_eq!(d.n_all, n);
            assert_eq!(d.zeros.len(), cols.len() * (k / g));
            assert_eq!(d.scales.len(), d.zeros.len());
            assert_eq!(d.g_idx.len(), k);
            let _ = d.contiguous();
        }
    }
});
