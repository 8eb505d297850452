//! Every GGML block type we write, checked against llama.cpp's own Python package: a GGUF holding
//! one tensor per type (random codes and scales, several rows) must dequantize, through
//! `gguf.GGUFReader` and `gguf.quants.dequantize` (tools/gguf_check.py), to exactly the bits our
//! decoder gives, and our decoder must give each type's value formula. With `SPARK_REQUIRE_GGUF=1`
//! (tools/test.sh) a missing `gguf` package is a failure, not a skip.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use spark_tool::checkpoint::write::{write_safetensors_atomic, OwnedTensor};
use spark_tool::formats::gguf::{blocks, GgmlType, GgufFile, GgufWriter, TensorInfo, Value};

fn gguf_check(args: &[&Path]) -> Output {
    let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/gguf_check.py");
    Command::new("python3")
        .arg(tool)
        .args(args)
        .output()
        .expect("python3 runs")
}

/// Any finite fp16, subnormals and negatives included, so the check covers every exponent.
fn any_f16(rng: &mut ChaCha8Rng) -> f16 {
    loop {
        let h = f16::from_bits(rng.random());
        if h.is_finite() {
            return h;
        }
    }
}

fn halves(rng: &mut ChaCha8Rng, n: usize) -> Vec<f16> {
    (0..n).map(|_| any_f16(rng)).collect()
}

fn bytes_of(rng: &mut ChaCha8Rng, n: usize, below: u8) -> Vec<u8> {
    (0..n).map(|_| rng.random_range(0..below)).collect()
}

fn signed(rng: &mut ChaCha8Rng, n: usize) -> Vec<i8> {
    (0..n).map(|_| rng.random()).collect()
}

/// One tensor: its info, its rows' block bytes, and each element's value by the type's formula
/// (in f32, in ggml's order of operations).
struct Case {
    info: TensorInfo,
    rows: Vec<Vec<u8>>,
    formula: Vec<f32>,
}

fn case(rng: &mut ChaCha8Rng, name: &str, ty: GgmlType, k: usize, n_rows: usize) -> Case {
    let mut rows = Vec::new();
    let mut formula = Vec::new();
    for _ in 0..n_rows {
        let mut out = Vec::new();
        match ty {
            GgmlType::Q4_0 => {
                let (q, d) = (bytes_of(rng, k, 16), halves(rng, k / 32));
                blocks::encode_q4_0(&q, &d, &mut out);
                formula.extend((0..k).map(|e| (q[e] as i32 - 8) as f32 * d[e / 32].to_f32()));
            }
            GgmlType::Q4_1 => {
                let (q, d, m) = (
                    bytes_of(rng, k, 16),
                    halves(rng, k / 32),
                    halves(rng, k / 32),
                );
                blocks::encode_q4_1(&q, &d, &m, &mut out);
                formula
                    .extend((0..k).map(|e| q[e] as f32 * d[e / 32].to_f32() + m[e / 32].to_f32()));
            }
            GgmlType::Q5_0 => {
                let (q, d) = (bytes_of(rng, k, 32), halves(rng, k / 32));
                blocks::encode_q5_0(&q, &d, &mut out);
                formula.extend((0..k).map(|e| (q[e] as i32 - 16) as f32 * d[e / 32].to_f32()));
            }
            GgmlType::Q8_0 => {
                let (q, d) = (signed(rng, k), halves(rng, k / 32));
                blocks::encode_q8_0(&q, &d, &mut out);
                formula.extend((0..k).map(|e| q[e] as f32 * d[e / 32].to_f32()));
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let q = bytes_of(rng, k, if ty == GgmlType::Q4_K { 16 } else { 32 });
                let (d, dmin) = (halves(rng, k / 256), halves(rng, k / 256));
                let (sc, m) = (bytes_of(rng, k / 32, 64), bytes_of(rng, k / 32, 64));
                if ty == GgmlType::Q4_K {
                    blocks::encode_q4_k(&q, &d, &dmin, &sc, &m, &mut out);
                } else {
                    blocks::encode_q5_k(&q, &d, &dmin, &sc, &m, &mut out);
                }
                formula.extend((0..k).map(|e| {
                    let (s, j) = (e / 256, e / 32);
                    let d1 = d[s].to_f32() * sc[j] as f32;
                    let m1 = dmin[s].to_f32() * m[j] as f32;
                    d1 * q[e] as f32 - m1
                }));
            }
            GgmlType::Q6_K => {
                let (q, d, sc) = (
                    bytes_of(rng, k, 64),
                    halves(rng, k / 256),
                    signed(rng, k / 16),
                );
                blocks::encode_q6_k(&q, &d, &sc, &mut out);
                formula.extend(
                    (0..k).map(|e| {
                        d[e / 256].to_f32() * sc[e / 16] as f32 * (q[e] as i32 - 32) as f32
                    }),
                );
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                let x: Vec<f32> = (0..k).map(|_| rng.random_range(-4.0f32..4.0)).collect();
                blocks::encode_dense(ty, &x, &mut out);
                formula.extend(x.iter().map(|&v| match ty {
                    GgmlType::F32 => v,
                    GgmlType::F16 => f16::from_f32(v).to_f32(),
                    _ => half::bf16::from_f32(v).to_f32(),
                }));
            }
        }
        assert_eq!(out.len(), ty.row_bytes(k).unwrap(), "{name}: one row");
        rows.push(out);
    }
    let info = TensorInfo {
        name: name.into(),
        dims: vec![k as u64, n_rows as u64],
        ty,
    };
    Case {
        info,
        rows,
        formula,
    }
}

fn cases() -> Vec<Case> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x6767_7566);
    let mut v = vec![
        case(&mut rng, "blk.0.attn_qkv.weight", GgmlType::Q4_K, 512, 3),
        case(&mut rng, "blk.0.ffn_down.weight", GgmlType::Q6_K, 256, 4),
        case(&mut rng, "blk.0.ffn_up.weight", GgmlType::Q4_0, 512, 3),
        case(&mut rng, "blk.0.ffn_gate.weight", GgmlType::Q4_1, 256, 2),
        case(&mut rng, "blk.0.attn_output.weight", GgmlType::Q5_0, 704, 3),
        case(&mut rng, "blk.1.attn_qkv.weight", GgmlType::Q5_K, 768, 3),
        case(&mut rng, "token_embd.weight", GgmlType::Q8_0, 512, 5),
        case(&mut rng, "dense.f32", GgmlType::F32, 256, 2),
        case(&mut rng, "dense.f16", GgmlType::F16, 96, 3),
        case(&mut rng, "dense.bf16", GgmlType::BF16, 64, 3),
    ];
    // A 1-D norm of odd length, so the next tensor needs alignment padding.
    let mut norm = case(&mut rng, "output_norm.weight", GgmlType::F32, 7, 1);
    norm.info.dims.truncate(1);
    v.insert(1, norm);
    v
}

/// Writes the GGUF (one row at a time for the multi-row tensors), `corrupt` flipping one bit of
/// the first element of `dense.f32`.
fn write_gguf(path: &Path, cases: &[Case], alignment_key: Option<u32>, corrupt: bool) {
    let mut kv = vec![
        (
            "general.architecture".to_string(),
            Value::String("spark2_5".into()),
        ),
        ("general.name".into(), Value::String("gguf_blocks".into())),
    ];
    if let Some(a) = alignment_key {
        kv.push(("general.alignment".into(), Value::U32(a)));
    }
    let infos: Vec<TensorInfo> = cases.iter().map(|c| c.info.clone()).collect();
    let file = std::fs::File::create(path).unwrap();
    let mut w = GgufWriter::new(std::io::BufWriter::new(file), &kv, &infos, 32).unwrap();
    for c in cases {
        for (r, row) in c.rows.iter().enumerate() {
            let mut row = row.clone();
            if corrupt && c.info.name == "dense.f32" && r == 0 {
                row[0] ^= 1;
            }
            w.write_tensor_part(&c.info.name, &row).unwrap();
        }
    }
    w.finish().unwrap();
}

/// The GGUF, and our decoder's values (checked against each type's formula) as safetensors.
fn build(dir: &Path, alignment_key: Option<u32>) -> (PathBuf, PathBuf, Vec<Case>) {
    let cases = cases();
    let gguf = dir.join("blocks.gguf");
    write_gguf(&gguf, &cases, alignment_key, false);
    let f = GgufFile::open(&gguf).unwrap();
    let mut expected = Vec::new();
    for c in &cases {
        let got = f.dequantize(&c.info.name).unwrap();
        let mismatched = got
            .iter()
            .zip(&c.formula)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(got.len(), c.formula.len(), "{}", c.info.name);
        assert_eq!(
            mismatched, 0,
            "{}: our decoder vs the value formula",
            c.info.name
        );
        let shape: Vec<usize> = c.info.dims.iter().rev().map(|&d| d as usize).collect();
        expected.push(OwnedTensor::f32(&c.info.name, shape, &got));
    }
    let st = dir.join("expected.safetensors");
    write_safetensors_atomic(&st, &expected, None).unwrap();
    (gguf, st, cases)
}

/// Everything the check printed; which stream a line goes to is the tool's business.
fn said(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

fn assert_success(out: &Output) {
    assert!(out.status.success(), "gguf_check failed:\n{}", said(out));
    eprint!("{}", said(out));
}

#[test]
fn every_block_type_dequantizes_bit_exactly_in_llama_cpps_python_reader() {
    for alignment_key in [None, Some(64)] {
        let d = tempfile::tempdir().unwrap();
        let (gguf, st, _) = build(d.path(), alignment_key);
        if !common::have_gguf() {
            return;
        }
        assert_success(&gguf_check(&[&gguf, &st]));
    }
}

#[test]
fn the_check_fails_on_a_changed_bit_and_on_a_missing_tensor() {
    let d = tempfile::tempdir().unwrap();
    let (gguf, st, cases) = build(d.path(), None);
    if !common::have_gguf() {
        return;
    }
    let bad = d.path().join("corrupt.gguf");
    write_gguf(&bad, &cases, None, true);
    let out = gguf_check(&[&bad, &st]);
    let said_bad = said(&out);
    assert_eq!(out.status.code(), Some(1), "{said_bad}");
    assert!(said_bad.contains("dense.f32 (F32): 1 of 512"), "{said_bad}");

    let extra = d.path().join("extra.safetensors");
    let missing = OwnedTensor::f32("not.in.the.gguf", vec![2], &[1.0, 2.0]);
    write_safetensors_atomic(&extra, &[missing], None).unwrap();
    let out = gguf_check(&[&gguf, &extra]);
    let said_missing = said(&out);
    assert_eq!(out.status.code(), Some(1), "{said_missing}");
    assert!(said_missing.contains("not.in.the.gguf"), "{said_missing}");
}
