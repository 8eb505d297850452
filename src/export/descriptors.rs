//! `phone_manifest.json` (its types live in `crate::phone::manifest`, the contract apps read) and
//! the AIMET-style `.encodings` file, built from the written parts.

use std::collections::{BTreeMap, HashMap};

use super::graph;
use super::onnx::DType;
use super::{ExportOptions, Precision};
use crate::checkpoint::{Checkpoint, LayerType};
use crate::phone::manifest::{self, Encoding, Manifest, QType};

pub(super) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::I16 => "int16",
        DType::U16 => "uint16",
        DType::I4 => "int4",
        DType::I32 => "int32",
        DType::I64 => "int64",
    }
}

pub(super) fn build_manifest(
    ck: &Checkpoint,
    opts: &ExportOptions,
    precision: &str,
    parts: Vec<manifest::Part>,
    embedding_file: &str,
    kv_dtype: &str,
    kv_elem: usize,
) -> Manifest {
    let cfg = &ck.config;
    let mut types = BTreeMap::new();
    for t in [LayerType::Sliding, LayerType::Full] {
        let layers: Vec<usize> = (0..cfg.num_hidden_layers)
            .filter(|&l| cfg.layer_types[l] == t)
            .collect();
        if layers.is_empty() {
            continue;
        }
        let r = cfg.rope_for(t);
        let past = graph::past_len(cfg, t, opts.context);
        types.insert(
            graph::type_name(t).to_string(),
            manifest::LayerTypeInfo {
                layers,
                past_len: past,
                mask: graph::mask_input(t),
                cos: graph::cos_input(t),
                sin: graph::sin_input(t),
                rope_theta: r.theta,
                rotary_dims: r.rotary_dims,
                slot_rule: match t {
                    LayerType::Sliding => format!("ring buffer: the entry of position pos goes to slot pos mod {past}; every written slot is attended"),
                    LayerType::Full => "append: the entry of position pos goes to slot pos; slots < pos are attended".into(),
                },
            },
        );
    }
    let (kvh, hd) = (cfg.num_key_value_heads, cfg.head_dim);
    let caches: Vec<manifest::Cache> = (0..cfg.num_hidden_layers)
        .map(|l| {
            let t = cfg.layer_types[l];
            let past = graph::past_len(cfg, t, opts.context);
            manifest::Cache {
                layer: l,
                layer_type: graph::type_name(t).into(),
                key_in: graph::key_in(l),
                key_out: graph::key_out(l),
                value_in: graph::value_in(l),
                value_out: graph::value_out(l),
                key_shape: vec![kvh, 1, hd, past],
                value_shape: vec![kvh, 1, past, hd],
                dtype: kv_dtype.into(),
            }
        })
        .collect();
    let kv_bytes: u64 = caches
        .iter()
        .map(|c| 2 * c.key_shape.iter().product::<usize>() as u64 * kv_elem as u64)
        .sum();
    let all_full = (cfg.num_hidden_layers * 2 * kvh * hd * (opts.context - 1) * kv_elem) as u64;
    let mask_value = mask_value(opts.precision);
    Manifest {
        format: manifest::FORMAT.into(),
        version: 1,
        spark_tool_version: env!("CARGO_PKG_VERSION").into(),
        runs_in_vllm: false,
        precision: precision.into(),
        context: opts.context,
        sliding_window: cfg.sliding_window,
        hidden_size: cfg.hidden_size,
        vocab_size: cfg.vocab_size,
        layer_types: cfg.layer_types.iter().map(|t| graph::type_name(*t).to_string()).collect(),
        bos_token_id: cfg.bos_token_id,
        eos_token_ids: cfg.eos_token_ids.clone(),
        pad_token_id: cfg.pad_token_id,
        embedding: manifest::Embedding {
            file: embedding_file.into(),
            tensor: "embed_tokens".into(),
            lookup: "host: input_embeds = embed_tokens[token] as float32 [1, 1, hidden]".into(),
        },
        mask_value,
        types,
        caches,
        parts,
        kv_cache_bytes: kv_bytes,
        kv_cache_bytes_if_all_full: all_full,
        how_to_step: vec![
            "pos = number of tokens already processed (0 for the first); pos < context".into(),
            "input_embeds = embed_tokens[token] (float32 [1,1,hidden])".into(),
            format!("per layer type: attention_mask_<type>[j] = 0 for attended past slots (see slot_rule) and for the last entry (the new token), else {mask_value}"),
            "per layer type: position_ids_cos/sin_<type> = cos/sin(pos · θ^(−2i/R)), i < R/2".into(),
            "run the parts in order, feeding hidden_states_out of a part as hidden_states_in of the next, with each layer's past_key/value_<l>_in".into(),
            "copy past_key_<l>_out [KVH,1,hd,1] into column `slot` of past_key_<l>_in and past_value_<l>_out [KVH,1,1,hd] into row `slot` of past_value_<l>_in (raw integers when quantized: inputs and outputs share one encoding)".into(),
        ],
        calibration_outputs: false,
        weights: weight_encodings(ck, opts.precision),
    }
}

fn weight_encodings(ck: &Checkpoint, p: Precision) -> Vec<manifest::WeightEncoding> {
    let e = |which: &str, encoding: &str, bits: u32| manifest::WeightEncoding {
        which: which.into(),
        encoding: encoding.into(),
        bits,
        block_size: None,
        decompressed_bits: None,
    };
    match p {
        Precision::F32 => vec![e("every MatMul weight", "float32", 32)],
        Precision::F16 => vec![e("every MatMul weight", "float16", 16)],
        Precision::W8A16 => vec![e("every MatMul weight", "int8 per channel", 8)],
        Precision::W4A16 => {
            let group = ck.config.gptq.as_ref().map(|g| g.group_size);
            vec![
                manifest::WeightEncoding {
                    block_size: group,
                    decompressed_bits: Some(8),
                    ..e(
                        "the checkpoint's GPTQ linears (q, k, v, out, gate, up, down)",
                        "lpbq",
                        4,
                    )
                },
                e(
                    "g_proj and the head (16-bit in the GPTQ checkpoint)",
                    "int8 per channel",
                    8,
                ),
            ]
        }
    }
}

/// AIMET encoding format 1.0.0 (docs/PHONE_IO.md §7): `offset = −zero_point`.
pub(super) fn aimet_encodings(
    enc: &HashMap<String, Encoding>,
    weights: &BTreeMap<String, Vec<f32>>,
    lpbq: &BTreeMap<String, super::weights::LpbqEncoding>,
) -> serde_json::Value {
    // LPBQ in AIMET's 1.0.0 schema: `scale` the per-channel γ, `per_block_int_scale` the k of
    // each channel's blocks (channel-major), decompressed to 8 bits from 4.
    let lpbq_entries = lpbq.iter().map(|(name, e)| {
        let n = e.gamma.len();
        let blocks = e.kblock.len() / n.max(1);
        let per_block: Vec<u8> = (0..n)
            .flat_map(|j| (0..blocks).map(move |b| (b, j)))
            .map(|(b, j)| e.kblock[b * n + j])
            .collect();
        serde_json::json!({
            "name": name,
            "dtype": "INT",
            "enc_type": "LPBQ",
            "bw": 8,
            "compressed_bw": 4,
            "block_size": e.block,
            "is_sym": true,
            "scale": e.gamma,
            "offset": vec![-128; n],
            "per_block_int_scale": per_block,
        })
    });
    let mut acts: Vec<_> = enc.iter().collect();
    acts.sort_by(|a, b| a.0.cmp(b.0));
    serde_json::json!({
        "version": "1.0.0",
        "activation_encodings": acts.iter().map(|(name, e)| serde_json::json!({
            "name": name,
            "dtype": "INT",
            "bw": match e.dtype { QType::Uint8 => 8, _ => 16 },
            "enc_type": "PER_TENSOR",
            "is_sym": e.zero_point == 0 || (e.dtype == QType::Uint8 && e.zero_point == 128),
            "scale": [e.scale],
            "offset": [-e.zero_point],
        })).collect::<Vec<_>>(),
        "param_encodings": weights.iter().map(|(name, s)| serde_json::json!({
            "name": name,
            "dtype": "INT",
            "bw": 8,
            "enc_type": "PER_CHANNEL",
            "is_sym": true,
            "scale": s,
            "offset": vec![-128; s.len()],
        })).chain(lpbq_entries).collect::<Vec<_>>(),
    })
}

/// The additive mask of a masked slot: deep enough that its softmax weight is nil, and for the
/// quantized graphs shallow enough that the mask's 16-bit grid keeps resolution near 0.
pub(super) fn mask_value(p: Precision) -> f32 {
    match p {
        Precision::F32 | Precision::F16 => -1000.0,
        Precision::W8A16 | Precision::W4A16 => -50.0,
    }
}
