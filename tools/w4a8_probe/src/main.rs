//! `w4a8-probe IN OUT [IN OUT ...]`: run spark-tool's `w4a8_matmul` on each IN and write OUT.
//!
//! IN (little-endian): m, n, k, g as u64; x f32[m·k] (bf16 values); codes i8[n·k] (`q − zero`,
//! row-major [N, K]); scales f32[n·(k/g)] (bf16 values). OUT: y f32[m·n] (bf16 values).

use spark_tool::kernels::w4;

use std::io::{Read, Write};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    assert!(
        !args.is_empty() && args.len() % 2 == 0,
        "usage: w4a8-probe IN OUT [IN OUT ...]"
    );
    for pair in args.chunks(2) {
        let mut raw = Vec::new();
        std::fs::File::open(&pair[0])?.read_to_end(&mut raw)?;
        let u64_at =
            |i: usize| u64::from_le_bytes(raw[8 * i..8 * i + 8].try_into().unwrap()) as usize;
        let (m, n, k, g) = (u64_at(0), u64_at(1), u64_at(2), u64_at(3));
        let mut off = 32;
        let f32s = |off: &mut usize, len: usize| -> Vec<f32> {
            let v = raw[*off..*off + 4 * len]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            *off += 4 * len;
            v
        };
        let x = f32s(&mut off, m * k);
        let codes: Vec<i8> = raw[off..off + n * k].iter().map(|&b| b as i8).collect();
        off += n * k;
        let scales = f32s(&mut off, n * (k / g));
        assert_eq!(
            off,
            raw.len(),
            "{}: size does not match m={m} n={n} k={k} g={g}",
            pair[0]
        );
        let mut y = vec![0f32; m * n];
        w4::w4a8_matmul(
            &x,
            m,
            w4::W4Weights {
                codes: &codes,
                scales: &scales,
                n,
                k,
                g,
            },
            &mut y,
        );
        let mut out = std::fs::File::create(&pair[1])?;
        for v in y {
            out.write_all(&v.to_le_bytes())?;
        }
    }
    Ok(())
}
