//! GGML block layouts, both ways (docs/GGUF.md §1). Encoders take one row of already-solved
//! integer codes in input order and its scales, and append the row's blocks; decoders compute
//! the values in f32 exactly as ggml's dequantizers do.

use half::f16;

use super::GgmlType;

fn push_f16(out: &mut Vec<u8>, v: f16) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// 32 nibbles: byte j holds element j (low) and element j + 16 (high).
fn push_nibbles32(out: &mut Vec<u8>, q: &[u8]) {
    for j in 0..16 {
        out.push((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
    }
}

/// Q4_0: per 32 codes 0…15, fp16 `d` then 16 bytes; value (q − 8)·d.
pub fn encode_q4_0(codes: &[u8], d: &[f16], out: &mut Vec<u8>) {
    for (q, &d) in codes.chunks_exact(32).zip(d) {
        push_f16(out, d);
        push_nibbles32(out, q);
    }
}

/// Q4_1: per 32 codes 0…15, fp16 `d`, fp16 `m`, 16 bytes; value q·d + m.
pub fn encode_q4_1(codes: &[u8], d: &[f16], m: &[f16], out: &mut Vec<u8>) {
    for ((q, &d), &m) in codes.chunks_exact(32).zip(d).zip(m) {
        push_f16(out, d);
        push_f16(out, m);
        push_nibbles32(out, q);
    }
}

/// Q5_0: per 32 codes 0…31, fp16 `d`, 4 bytes whose bit j is code j's fifth bit, then code j's
/// low nibble in byte j (low) or j − 16 (high) as Q4_0; value (q − 16)·d.
pub fn encode_q5_0(codes: &[u8], d: &[f16], out: &mut Vec<u8>) {
    for (q, &d) in codes.chunks_exact(32).zip(d) {
        push_f16(out, d);
        let qh = q
            .iter()
            .enumerate()
            .fold(0u32, |h, (j, &c)| h | (((c >> 4) & 1) as u32) << j);
        out.extend_from_slice(&qh.to_le_bytes());
        push_nibbles32(out, q);
    }
}

/// Q8_0: per 32 int8 codes, fp16 `d` then the codes; value q·d.
pub fn encode_q8_0(codes: &[i8], d: &[f16], out: &mut Vec<u8>) {
    for (q, &d) in codes.chunks_exact(32).zip(d) {
        push_f16(out, d);
        out.extend(q.iter().map(|&v| v as u8));
    }
}

/// Q4_K: per 256 codes 0…15, fp16 `d`, fp16 `dmin`, 12 bytes holding eight 6-bit sub-block
/// scales `sc` and mins `m` (one each per 32), 128 bytes of nibbles; value d·sc·q − dmin·m.
pub fn encode_q4_k(codes: &[u8], d: &[f16], dmin: &[f16], sc: &[u8], m: &[u8], out: &mut Vec<u8>) {
    encode_k(codes, (d, dmin), (sc, m), false, out)
}

/// Q5_K: Q4_K's layout with codes 0…31, their fifth bits in 32 bytes between the scales and
/// the nibbles; value d·sc·q − dmin·m.
pub fn encode_q5_k(codes: &[u8], d: &[f16], dmin: &[f16], sc: &[u8], m: &[u8], out: &mut Vec<u8>) {
    encode_k(codes, (d, dmin), (sc, m), true, out)
}

/// Q4_K, or with `fifth_bits` Q5_K.
fn encode_k(
    codes: &[u8],
    (d, dmin): (&[f16], &[f16]),
    (sc, m): (&[u8], &[u8]),
    fifth_bits: bool,
    out: &mut Vec<u8>,
) {
    for (b, q) in codes.chunks_exact(256).enumerate() {
        push_k_scales(
            out,
            (d[b], dmin[b]),
            &sc[b * 8..b * 8 + 8],
            &m[b * 8..b * 8 + 8],
        );
        if fifth_bits {
            // Byte l, bits 2c and 2c + 1: the fifth bits of elements 64c + l and 64c + 32 + l.
            let mut qh = [0u8; 32];
            for (c, chunk) in q.chunks_exact(64).enumerate() {
                for (l, h) in qh.iter_mut().enumerate() {
                    *h |= ((chunk[l] >> 4) & 1) << (2 * c)
                        | ((chunk[l + 32] >> 4) & 1) << (2 * c + 1);
                }
            }
            out.extend_from_slice(&qh);
        }
        push_k_nibbles(out, q);
    }
}

/// A K-quant block's fp16 `d` and `dmin` and its eight 6-bit scales and mins in 12 bytes.
fn push_k_scales(out: &mut Vec<u8>, (d, dmin): (f16, f16), sc: &[u8], m: &[u8]) {
    push_f16(out, d);
    push_f16(out, dmin);
    // Bytes 0–3: sc 0–3 and the top bits of sc 4–7; 4–7: the same for the mins;
    // 8–11: the low nibbles of sc 4–7 and of m 4–7.
    for j in 0..4 {
        out.push((sc[j] & 0x3F) | ((sc[j + 4] >> 4) << 6));
    }
    for j in 0..4 {
        out.push((m[j] & 0x3F) | ((m[j + 4] >> 4) << 6));
    }
    for j in 0..4 {
        out.push((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
    }
}

/// 256 codes' low four bits: per 64 elements, 32 bytes of element l low, element l + 32 high.
fn push_k_nibbles(out: &mut Vec<u8>, q: &[u8]) {
    for c in q.chunks_exact(64) {
        for l in 0..32 {
            out.push((c[l] & 0xF) | ((c[l + 32] & 0xF) << 4));
        }
    }
}

/// Q6_K: per 256 codes 0…63, 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, sixteen
/// int8 scales (one per 16), fp16 `d` last; value d·scale·(q − 32).
pub fn encode_q6_k(codes: &[u8], d: &[f16], scales: &[i8], out: &mut Vec<u8>) {
    for (b, q) in codes.chunks_exact(256).enumerate() {
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for n in 0..2 {
            let h = &q[n * 128..(n + 1) * 128];
            for l in 0..32 {
                let (q1, q2, q3, q4) = (h[l], h[l + 32], h[l + 64], h[l + 96]);
                ql[n * 64 + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                ql[n * 64 + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                qh[n * 32 + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(scales[b * 16..b * 16 + 16].iter().map(|&s| s as u8));
        push_f16(out, d[b]);
    }
}

/// Dense rows from f32: F32 as is, F16 and BF16 rounded to nearest even.
pub fn encode_dense(ty: GgmlType, v: &[f32], out: &mut Vec<u8>) {
    match ty {
        GgmlType::F32 => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        GgmlType::F16 => out.extend(v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes())),
        GgmlType::BF16 => out.extend(
            v.iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()),
        ),
        other => unreachable!("{other:?} is not a dense type"),
    }
}

/// Values of `bytes` (whole blocks of `ty`) into `out` (one value per element).
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
    debug_assert_eq!(bytes.len() / bb * ty.block_len(), out.len());
    let blocks = bytes
        .chunks_exact(bb)
        .zip(out.chunks_exact_mut(ty.block_len()));
    match ty {
        GgmlType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, o) in blocks {
                o[0] = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (b, o) in blocks {
                o[0] = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            for (b, o) in blocks {
                let d = f16_at(b, 0);
                let (m, qs) = if ty == GgmlType::Q4_1 {
                    (f16_at(b, 2), &b[4..20])
                } else {
                    (0.0, &b[2..18])
                };
                for j in 0..16 {
                    let (lo, hi) = ((qs[j] & 0xF) as i32, (qs[j] >> 4) as i32);
                    if ty == GgmlType::Q4_1 {
                        o[j] = lo as f32 * d + m;
                        o[j + 16] = hi as f32 * d + m;
                    } else {
                        o[j] = (lo - 8) as f32 * d;
                        o[j + 16] = (hi - 8) as f32 * d;
                    }
                }
            }
        }
        GgmlType::Q5_0 => {
            for (b, o) in blocks {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for j in 0..16 {
                    let hi = |i: usize| (((qh >> i) & 1) << 4) as i32;
                    let (lo, up) = ((b[6 + j] & 0xF) as i32, (b[6 + j] >> 4) as i32);
                    o[j] = ((lo | hi(j)) - 16) as f32 * d;
                    o[j + 16] = ((up | hi(j + 16)) - 16) as f32 * d;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (b, o) in blocks {
                let d = f16_at(b, 0);
                for (v, &q) in o.iter_mut().zip(&b[2..34]) {
                    *v = (q as i8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            for (b, o) in blocks {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let s = &b[4..16];
                let scale_min = |j: usize| -> (u8, u8) {
                    if j < 4 {
                        (s[j] & 0x3F, s[j + 4] & 0x3F)
                    } else {
                        (
                            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
                            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                        )
                    }
                };
                // Q5_K: the fifth bits (bit j of byte l for element 32j + l) before the nibbles.
                let (qh, qs) = if ty == GgmlType::Q5_K {
                    (Some(&b[16..48]), &b[48..176])
                } else {
                    (None, &b[16..144])
                };
                for c in 0..4 {
                    for half in 0..2 {
                        let j = 2 * c + half;
                        let (sc, m) = scale_min(j);
                        let (d1, m1) = (d * sc as f32, dmin * m as f32);
                        for l in 0..32 {
                            let hi = qh.map_or(0, |h| ((h[l] >> j) & 1) << 4);
                            let q = ((qs[c * 32 + l] >> (4 * half)) & 0xF) | hi;
                            o[c * 64 + half * 32 + l] = d1 * q as f32 - m1;
                        }
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            for (b, o) in blocks {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                for e in 0..256 {
                    let (n, j) = (e / 128, e % 128);
                    let lo = if j < 64 {
                        ql[n * 64 + j] & 0xF
                    } else {
                        ql[n * 64 + j - 64] >> 4
                    };
                    let hi = (qh[n * 32 + j % 32] >> (2 * (j / 32))) & 3;
                    let q = ((lo | (hi << 4)) as i32 - 32) as f32;
                    o[e] = d * (sc[e / 16] as i8) as f32 * q;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    fn decode(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
        assert_eq!(bytes.len(), ty.row_bytes(n).unwrap());
        let mut v = vec![0f32; n];
        dequantize_row(ty, bytes, &mut v);
        v
    }

    #[test]
    fn every_block_type_decodes_to_its_value_formula() {
        let mut s = 3u64;
        let n = 512;
        let mut rnd = |m: u32| lcg(&mut s) % m;
        let codes: Vec<u8> = (0..n).map(|_| rnd(16) as u8).collect();
        let halves = |k: usize, rnd: &mut dyn FnMut(u32) -> u32| -> Vec<f16> {
            (0..k)
                .map(|_| f16::from_f32((rnd(1000) as f32 + 1.0) * 1e-4))
                .collect()
        };

        let d = halves(n / 32, &mut rnd);
        let mut b = Vec::new();
        encode_q4_0(&codes, &d, &mut b);
        let v = decode(GgmlType::Q4_0, &b, n);
        for i in 0..n {
            assert_eq!(v[i], (codes[i] as i32 - 8) as f32 * d[i / 32].to_f32());
        }

        let codes5: Vec<u8> = (0..n).map(|_| rnd(32) as u8).collect();
        let mut b = Vec::new();
        encode_q5_0(&codes5, &d, &mut b);
        let v = decode(GgmlType::Q5_0, &b, n);
        for i in 0..n {
            assert_eq!(v[i], (codes5[i] as i32 - 16) as f32 * d[i / 32].to_f32());
        }

        let m = halves(n / 32, &mut rnd);
        let mut b = Vec::new();
        encode_q4_1(&codes, &d, &m, &mut b);
        let v = decode(GgmlType::Q4_1, &b, n);
        for i in 0..n {
            assert_eq!(
                v[i],
                codes[i] as f32 * d[i / 32].to_f32() + m[i / 32].to_f32()
            );
        }

        let c8: Vec<i8> = (0..n).map(|_| (rnd(256) as i32 - 128) as i8).collect();
        let mut b = Vec::new();
        encode_q8_0(&c8, &d, &mut b);
        let v = decode(GgmlType::Q8_0, &b, n);
        for i in 0..n {
            assert_eq!(v[i], c8[i] as f32 * d[i / 32].to_f32());
        }

        let dk = halves(n / 256, &mut rnd);
        let dmin = halves(n / 256, &mut rnd);
        let sc: Vec<u8> = (0..n / 32).map(|_| rnd(64) as u8).collect();
        let mn: Vec<u8> = (0..n / 32).map(|_| rnd(64) as u8).collect();
        let mut b = Vec::new();
        encode_q4_k(&codes, &dk, &dmin, &sc, &mn, &mut b);
        let v = decode(GgmlType::Q4_K, &b, n);
        for i in 0..n {
            let (t, j) = (i / 256, i / 32);
            let want =
                dk[t].to_f32() * sc[j] as f32 * codes[i] as f32 - dmin[t].to_f32() * mn[j] as f32;
            assert_eq!(v[i], want, "element {i}");
        }

        let c5: Vec<u8> = (0..n).map(|_| rnd(32) as u8).collect();
        let mut b = Vec::new();
        encode_q5_k(&c5, &dk, &dmin, &sc, &mn, &mut b);
        assert_eq!(b.len(), n / 256 * 176);
        let v = decode(GgmlType::Q5_K, &b, n);
        for i in 0..n {
            let (t, j) = (i / 256, i / 32);
            let want =
                dk[t].to_f32() * sc[j] as f32 * c5[i] as f32 - dmin[t].to_f32() * mn[j] as f32;
            assert_eq!(v[i], want, "element {i}");
        }

        let c6: Vec<u8> = (0..n).map(|_| rnd(64) as u8).collect();
        let s6: Vec<i8> = (0..n / 16).map(|_| (rnd(256) as i32 - 128) as i8).collect();
        let mut b = Vec::new();
        encode_q6_k(&c6, &dk, &s6, &mut b);
        let v = decode(GgmlType::Q6_K, &b, n);
        for i in 0..n {
            let want = dk[i / 256].to_f32() * s6[i / 16] as f32 * (c6[i] as i32 - 32) as f32;
            assert_eq!(v[i], want, "element {i}");
        }

        let x: Vec<f32> = (0..n).map(|_| rnd(1 << 20) as f32 * 1e-3 - 300.0).collect();
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            let mut b = Vec::new();
            encode_dense(ty, &x, &mut b);
            let v = decode(ty, &b, n);
            for i in 0..n {
                let want = match ty {
                    GgmlType::F32 => x[i],
                    GgmlType::F16 => f16::from_f32(x[i]).to_f32(),
                    _ => half::bf16::from_f32(x[i]).to_f32(),
                };
                assert_eq!(v[i], want);
            }
        }
    }
}
