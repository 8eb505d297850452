//! Attention of one query row for the query heads that share one KV head
//! (GQA), over keys/values handed out by position — the model's KV cache
//! (sliding ring or full) plus the current call's new rows.
//!
//! The portable body here is the reference; on AVX-512 ([`avx512`], chosen at run time) the
//! query heads of a KV head score each key in one pass and the values are accumulated in
//! registers over blocks of positions: the same math, sums in another order.

use super::convert::KvElem;
use super::{dot, softmax};

#[cfg(target_arch = "x86_64")]
mod avx512;

/// What one query row attends over: positions `lo..=hi`, and each position's key and value row
/// of one KV head (`head_dim` values).
pub struct Window<K, V> {
    pub key: K,
    pub value: V,
    pub lo: usize,
    pub hi: usize,
}

/// `out[h] = Σ_pos softmax_pos(q[h]·k_pos · scale) v_pos` for the `out.len() / hd` query heads
/// in `q`, over the positions of `kv` (rows of f32 or bf16). `scores` is scratch (resized here).
pub fn attend<'a, T, K, V>(
    q: &[f32],
    kv: &Window<K, V>,
    heads: Heads,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) where
    T: KvElem,
    K: Fn(usize) -> &'a [T],
    V: Fn(usize) -> &'a [T],
{
    #[cfg(target_arch = "x86_64")]
    if super::isa::isa().avx512() && heads.dim.is_multiple_of(16) {
        // SAFETY: the CPU has AVX-512 (detected at run time).
        return unsafe { avx512::attend(q, kv, heads, scores, out) };
    }
    attend_body(q, kv, heads, scores, out)
}

/// The shape and numerics of one attention call: `dim` values per head, scores scaled by
/// `scale`; with `bf16`, the operands of a bf16 model (HF's bf16 forward, vLLM): the caller
/// hands in q and k rounded to bf16, and the softmax probabilities (f32) are rounded to bf16
/// before they weight the values, so every product is exact and only the f32 sums round.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub dim: usize,
    pub scale: f32,
    pub bf16: bool,
}

/// The portable reference of [`attend`].
fn attend_body<'a, T, K, V>(
    q: &[f32],
    &Window {
        ref key,
        ref value,
        lo,
        hi,
    }: &Window<K, V>,
    Heads {
        dim: hd,
        scale,
        bf16,
    }: Heads,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) where
    T: KvElem,
    K: Fn(usize) -> &'a [T],
    V: Fn(usize) -> &'a [T],
{
    let group = out.len() / hd;
    let n = hi + 1 - lo;
    scores.clear();
    scores.resize(group * n, 0.0);
    const AHEAD: usize = 4;
    for (j, pos) in (lo..=hi).enumerate() {
        if pos + AHEAD <= hi {
            prefetch::<L1>(key(pos + AHEAD));
        }
        let kr = key(pos);
        for h in 0..group {
            scores[h * n + j] = dot(&q[h * hd..(h + 1) * hd], kr) * scale;
        }
    }
    for sh in scores.chunks_exact_mut(n) {
        softmax(sh);
        if bf16 {
            super::convert::round_bf16_in_place(sh);
        }
    }
    out.fill(0.0);
    for (j, pos) in (lo..=hi).enumerate() {
        if pos + AHEAD <= hi {
            prefetch::<L1>(value(pos + AHEAD));
        }
        let vr = value(pos);
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            let s = scores[h * n + j];
            for (a, b) in o.iter_mut().zip(vr) {
                *a += s * b.widen();
            }
        }
    }
}

/// Query rows per block of [`attend_rows`]: the block's keys and values are gathered once and
/// its scores are one GEMM.
pub const BLOCK_ROWS: usize = 32;

const SERIAL: gemm::Parallelism = gemm::Parallelism::None;

/// Scratch of [`attend_rows`] and [`attend_rows_bf16`], reused across blocks.
#[derive(Default)]
pub struct RowsScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    /// Bits of the bf16 operands (queries, then probabilities) for the bf16 kernels.
    #[cfg(target_arch = "x86_64")]
    bits: Vec<u16>,
    /// The bf16 kernels' packed keys and values.
    #[cfg(target_arch = "x86_64")]
    panel: super::bf16::PanelScratch,
}

/// [`attend`] for `rows` consecutive query rows at once, as two GEMMs: with the window `(lo, p0)`,
/// row r sits at position `p0 + r` and sees positions `lo(r)..=p0 + r` (`lo` nondecreasing, as
/// causal and sliding windows are); `key` and `value` give a position's rows. The block's keys and values (positions `lo(0)..=p0 + rows − 1`) are gathered
/// once, S = Q·Kᵀ over all of them, each row's scores outside its window are dropped before
/// its softmax, and O = P·V. `q` and `out` are `[rows][heads][hd]` for the query heads of one
/// KV head. The same math as [`attend`] row by row (f32 `gemm`; with `heads.bf16` the
/// probabilities rounded to bf16 first); the sums run in the GEMM's order, so results differ in
/// the last bits.
pub fn attend_rows<'a, T: KvElem>(
    q: &[f32],
    rows: usize,
    (key, value): (impl Fn(usize) -> &'a [T], impl Fn(usize) -> &'a [T]),
    (lo, p0): (impl Fn(usize) -> usize, usize),
    heads: Heads,
    scratch: &mut RowsScratch,
    out: &mut [f32],
) {
    let hd = heads.dim;
    assert!(rows > 0 && q.len() == out.len() && q.len().is_multiple_of(rows * hd));
    let (first, last) = (lo(0), p0 + rows - 1);
    assert!(first <= p0);
    let n = last + 1 - first;
    let m = q.len() / hd;
    let RowsScratch { k, v, s, .. } = scratch;
    k.clear();
    v.clear();
    for pos in first..=last {
        k.extend(key(pos).iter().map(|x| x.widen()));
        v.extend(value(pos).iter().map(|x| x.widen()));
    }
    s.clear();
    s.resize(m * n, 0.0);
    // S[m, n] = Q[m, hd] · Kᵀ: key j's element d at k[j·hd + d]. One thread: jobs are parallel.
    // SAFETY: s is m × n, row-major.
    unsafe { super::gemm_strided((m, n, hd), (s.as_mut_ptr(), n), (q, hd), (k, 1, hd), SERIAL) };
    probabilities(s, n, rows, |r| lo(r) - first..=p0 + r - first, heads);
    // O[m, hd] = P[m, n] · V[n, hd].
    // SAFETY: out is m × hd, row-major.
    unsafe {
        super::gemm_strided(
            (m, hd, n),
            (out.as_mut_ptr(), hd),
            (s, n),
            (v, hd, 1),
            SERIAL,
        )
    };
}

/// Scores `s` (`[rows][heads][stride]`) made probabilities: row r's `visible(r)` scaled and
/// softmaxed (rounded to bf16 values with `heads.bf16`), zero elsewhere.
fn probabilities(
    s: &mut [f32],
    stride: usize,
    rows: usize,
    visible: impl Fn(usize) -> std::ops::RangeInclusive<usize>,
    heads: Heads,
) {
    let per_row = s.len() / rows;
    for (r, sr) in s.chunks_exact_mut(per_row).enumerate() {
        let (a, b) = visible(r).into_inner();
        for row in sr.chunks_exact_mut(stride) {
            let seen = &mut row[a..=b];
            seen.iter_mut().for_each(|x| *x *= heads.scale);
            super::softmax(seen);
            if heads.bf16 {
                super::convert::round_bf16_in_place(seen);
            }
            row[..a].fill(0.0);
            row[b + 1..].fill(0.0);
        }
    }
}

/// One KV head's keys and values at positions `first..first + n` as bf16 bits, for
/// [`attend_rows_bf16`]: keys `[n][hd]`, values transposed (`[hd][stride]`, stride = n rounded
/// up to 32, zero past n), so a block's operands are copies of contiguous runs. Built once per
/// call and KV head, shared by all its blocks of query rows.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct KvBits {
    first: usize,
    n: usize,
    hd: usize,
    stride: usize,
    k: Vec<u16>,
    vt: Vec<u16>,
}

impl KvBits {
    /// The keys and values of `positions` (bf16 values; rounded to nearest even otherwise).
    pub fn gather<'a, T: KvElem>(
        key: impl Fn(usize) -> &'a [T],
        value: impl Fn(usize) -> &'a [T],
        positions: std::ops::RangeInclusive<usize>,
        hd: usize,
    ) -> Self {
        let (first, last) = positions.into_inner();
        let n = last + 1 - first;
        let stride = n.next_multiple_of(32);
        let mut k = vec![0u16; n * hd];
        let mut vt = vec![0u16; hd * stride];
        for (j, kr) in k.chunks_exact_mut(hd).enumerate() {
            kr.iter_mut()
                .zip(key(first + j))
                .for_each(|(o, x)| *o = x.bf16_bits());
        }
        // Vᵀ 32 positions at a time: each dimension's 32 values are one 64-byte run of `vt`,
        // read from 32 value rows that stay in L1.
        for j0 in (0..n).step_by(32) {
            let rows: Vec<&[T]> = (j0..(j0 + 32).min(n)).map(|j| value(first + j)).collect();
            for (d, run) in vt.chunks_exact_mut(stride).enumerate() {
                for (o, row) in run[j0..].iter_mut().zip(&rows) {
                    *o = row[d].bf16_bits();
                }
            }
        }
        KvBits {
            first,
            n,
            hd,
            stride,
            k,
            vt,
        }
    }
}

/// Whether [`attend_rows_bf16`] runs on this CPU (AVX512-BF16, or AMX tiles).
pub fn bf16_rows_run() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::isa::isa() >= super::isa::Isa::Avx512Bf16;
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`attend_rows`] with bf16 operands (`heads.bf16`) on the bf16 kernels (AMX tiles or
/// `vdpbf16ps`: exact products, f32 sums) over keys and values from `kv`, which must hold the
/// positions `lo(0)..=p0 + rows − 1` of the window `(lo, p0)`. The keys of a block are padded with zero rows to whole
/// 32-key steps. Returns false (nothing done) where the CPU has no bf16 kernels; the caller
/// then runs [`attend_rows`], the same math in f32 `gemm`.
pub fn attend_rows_bf16(
    q: &[f32],
    rows: usize,
    kv: &KvBits,
    (lo, p0): (impl Fn(usize) -> usize, usize),
    heads: Heads,
    scratch: &mut RowsScratch,
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = super::isa::isa();
        let hd = heads.dim;
        assert!(heads.bf16 && hd == kv.hd);
        assert!(rows > 0 && q.len() == out.len() && q.len().is_multiple_of(rows * hd));
        let (first, last) = (lo(0), p0 + rows - 1);
        assert!(kv.first <= first && first <= p0 && last < kv.first + kv.n);
        let (n, off) = (last + 1 - first, first - kv.first);
        let n2 = n.next_multiple_of(32);
        let m = q.len() / hd;
        let RowsScratch { s, bits, panel, .. } = scratch;
        bits.resize(q.len(), 0);
        to_bits(q, bits);
        s.clear();
        s.resize(m * n2, 0.0);
        // S[m, n2] = Q · Kᵀ, key j = position first + j.
        let keys = |cols: std::ops::Range<usize>, o: &mut [u16]| {
            let have = cols.end.min(n).saturating_sub(cols.start);
            let src = &kv.k[(off + cols.start) * hd..][..have * hd];
            o[..have * hd].copy_from_slice(src);
            o[have * hd..].fill(0);
        };
        if !super::bf16::matmul_bits_serial(isa, bits, (m, hd, n2), s, keys, panel) {
            return false;
        }
        // Rounded to bf16 by the conversion to bits (the same rounding, one pass fewer).
        let unrounded = Heads {
            bf16: false,
            ..heads
        };
        probabilities(s, n2, rows, |r| lo(r) - first..=p0 + r - first, unrounded);
        bits.resize(s.len(), 0);
        to_bits(s, bits);
        // O[m, hd] = P · V: Vᵀ's row d is dimension d of the block's keys' values.
        let values = |dims: std::ops::Range<usize>, o: &mut [u16]| {
            for (d, o) in dims.zip(o.chunks_exact_mut(n2)) {
                o[..n].copy_from_slice(&kv.vt[d * kv.stride + off..][..n]);
                o[n..].fill(0);
            }
        };
        let done = super::bf16::matmul_bits_serial(isa, bits, (m, n2, hd), out, values, panel);
        assert!(done, "the first product ran on this tier");
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (q, rows, kv, lo, p0, heads, scratch, out);
        false
    }
}

/// [`bf16_bits`](super::convert::bf16_bits) of every value (a loop the compiler vectorises).
#[cfg(target_arch = "x86_64")]
fn to_bits(x: &[f32], out: &mut [u16]) {
    out.iter_mut()
        .zip(x)
        .for_each(|(o, x)| *o = super::convert::bf16_bits(*x));
}

/// Prefetch hints of [`prefetch`] (x86's `_MM_HINT_T0` and `_MM_HINT_T1`).
const L1: i32 = 3;
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const L2: i32 = 2;

/// Hint the cache lines of `row` into the cache level `HINT` names ([`L1`], [`L2`]; never faults).
#[inline(always)]
fn prefetch<const HINT: i32>(row: &[impl Sized]) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..std::mem::size_of_val(row)).step_by(64) {
        // SAFETY: a prefetch of a valid address has no architectural effect.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>((row.as_ptr() as *const i8).add(off)) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform values in [−0.5, 0.5) from a 32-bit LCG.
    fn lcg(seed: u32) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        }
    }

    /// Attention of the query heads in `q` over positions `lo..=hi` of `k` and `v`
    /// (`[positions][hd]`), from the definition in f64; with `round`, every probability rounded
    /// to bf16 before it weights the values.
    fn definition(
        q: &[f32],
        (k, v): (&[f32], &[f32]),
        hd: usize,
        (lo, hi): (usize, usize),
        scale: f64,
        round: bool,
    ) -> Vec<f64> {
        let mut out = Vec::with_capacity(q.len());
        for qh in q.chunks_exact(hd) {
            let logits: Vec<f64> = (lo..=hi)
                .map(|p| {
                    let kr = &k[p * hd..(p + 1) * hd];
                    scale
                        * qh.iter()
                            .zip(kr)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                })
                .collect();
            let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
            let z: f64 = w.iter().sum();
            let p: Vec<f64> = w
                .iter()
                .map(|w| match round {
                    true => crate::kernels::w4::round_bf16((w / z) as f32) as f64,
                    false => w / z,
                })
                .collect();
            for d in 0..hd {
                out.push((lo..=hi).map(|j| p[j - lo] * v[j * hd + d] as f64).sum());
            }
        }
        out
    }

    /// `rows` query rows of `q` at positions `p0..` (`lo(r)` the first key row r sees) over `k`
    /// and `v` (`[positions][hd]`): through [`attend_rows`], and row by row through [`attend`].
    fn block_and_row_by_row(
        q: &[f32],
        rows: usize,
        (k, v): (&[f32], &[f32]),
        (lo, p0): (impl Fn(usize) -> usize, usize),
        heads: Heads,
        scratch: &mut RowsScratch,
    ) -> (Vec<f32>, Vec<f32>) {
        let hd = heads.dim;
        let mut block = vec![f32::NAN; q.len()];
        attend_rows(
            q,
            rows,
            (|p| &k[p * hd..(p + 1) * hd], |p| &v[p * hd..(p + 1) * hd]),
            (&lo, p0),
            heads,
            scratch,
            &mut block,
        );
        let per_row = q.len() / rows;
        let mut single = vec![0f32; q.len()];
        for (r, (qr, out)) in q
            .chunks_exact(per_row)
            .zip(single.chunks_exact_mut(per_row))
            .enumerate()
        {
            let kv = kv_rows(k, v, hd, (lo(r), p0 + r));
            attend(qr, &kv, heads, &mut vec![], out);
        }
        (block, single)
    }

    fn f32_heads(dim: usize, scale: f32) -> Heads {
        Heads {
            dim,
            scale,
            bf16: false,
        }
    }

    /// Row p of `k` and `v` (`[positions][hd]`) at positions `lo..=hi`.
    fn kv_rows<'a, T>(
        k: &'a [T],
        v: &'a [T],
        hd: usize,
        (lo, hi): (usize, usize),
    ) -> Window<impl Fn(usize) -> &'a [T], impl Fn(usize) -> &'a [T]> {
        Window {
            key: move |p| &k[p * hd..(p + 1) * hd],
            value: move |p| &v[p * hd..(p + 1) * hd],
            lo,
            hi,
        }
    }

    /// Straight from the definition, one head at a time, in f64.
    #[test]
    fn matches_the_definition() {
        // hd 24 takes the portable body everywhere, hd 32 the AVX-512 kernel where there is one.
        for (hd, group, n) in [(24, 3, 37), (32, 5, 37)] {
            let mut rnd = lcg(7);
            let q: Vec<f32> = (0..group * hd).map(|_| rnd()).collect();
            let k: Vec<f32> = (0..(n + 5) * hd).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..(n + 5) * hd).map(|_| rnd()).collect();
            let (lo, hi) = (5, n + 4);
            let mut out = vec![0f32; group * hd];
            let kv = kv_rows(&k, &v, hd, (lo, hi));
            attend(&q, &kv, f32_heads(hd, 0.3), &mut vec![], &mut out);
            let want = definition(&q, (&k, &v), hd, (lo, hi), 0.3, false);
            for (i, (g, w)) in out.iter().zip(&want).enumerate() {
                assert!((*g as f64 - w).abs() < 1e-5, "value {i}: {g} vs {w}");
            }
        }
    }

    /// A block of rows as GEMMs equals row-by-row attention, causal and sliding, over keys that
    /// start before the block (a cache) and a block not starting at position 0.
    #[test]
    fn rows_as_gemms_match_row_by_row() {
        let mut rnd = lcg(3);
        let (hd, heads) = (16, 3);
        let total = 90;
        let k: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
        let mut scratch = RowsScratch::default();
        // (rows, first position, sliding window or none)
        for &(rows, p0, window) in &[
            (1, 0, None),
            (32, 0, None),
            (17, 40, None),
            (32, 50, Some(8)),
        ] {
            let q: Vec<f32> = (0..rows * heads * hd).map(|_| 4.0 * rnd()).collect();
            let lo = |r: usize| window.map_or(0, |w: usize| (p0 + r + 1).saturating_sub(w));
            let heads = f32_heads(hd, 0.25);
            let (got, want) =
                block_and_row_by_row(&q, rows, (&k, &v), (lo, p0), heads, &mut scratch);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5,
                    "rows {rows} at {p0}, value {i}: {g} vs {w}"
                );
            }
        }
    }

    /// The AVX-512 kernel against the portable body: head counts that do and do not fill its
    /// sets of four, dimensions with and without a partial 64-wide chunk, windows that are not
    /// whole value blocks, one position.
    #[test]
    fn avx512_matches_the_portable_body() {
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::tested()
            .last()
            .is_some_and(|t| t.avx512())
        {
            let mut rnd = lcg(9);
            for &(hd, group, lo, hi) in &[
                (256, 4, 0, 299),
                (64, 2, 3, 40),
                (80, 6, 10, 10),
                (16, 1, 0, 16),
                (128, 5, 7, 70),
                (48, 3, 1, 33),
                (128, 8, 2, 50),
            ] {
                let total = hi + 1;
                // Keys scaled up so the softmax is far from uniform.
                let q: Vec<f32> = (0..group * hd).map(|_| 4.0 * rnd()).collect();
                let k: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
                let v: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
                let kv = kv_rows(&k, &v, hd, (lo, hi));
                // A probability rounded to bf16 on one side may round the other way on the
                // other (sums in another order): one bf16 step of p, times |v| ≤ 0.5.
                for (bf16, tol) in [(false, 2e-6), (true, 2e-3)] {
                    let heads = Heads {
                        dim: hd,
                        scale: 0.3,
                        bf16,
                    };
                    let mut want = vec![0f32; group * hd];
                    let mut got = vec![f32::NAN; group * hd];
                    attend_body(&q, &kv, heads, &mut vec![], &mut want);
                    // SAFETY: AVX-512 checked above.
                    unsafe { avx512::attend(&q, &kv, heads, &mut vec![], &mut got) };
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= tol,
                            "bf16 {bf16}, hd {hd}, group {group}, {lo}..={hi}, value {i}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    /// With bf16 operands, straight from the definition in f64: the probabilities are the
    /// softmax of the scaled scores rounded to bf16, and they weight the values exactly.
    #[test]
    fn bf16_operands_round_the_probabilities() {
        let mut gen = lcg(5);
        let mut rnd = || crate::kernels::w4::round_bf16(gen());
        // Three keys: each probability's bf16 step moves the output by ~1e-3, far above the
        // f32 sums' error, so the rounding (and only it) is visible.
        for hd in [32, 24] {
            let (group, n) = (2, 3);
            let q: Vec<f32> = (0..group * hd).map(|_| 4.0 * rnd()).collect();
            let k: Vec<f32> = (0..n * hd).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..n * hd).map(|_| 2.0 * rnd()).collect();
            let heads = Heads {
                dim: hd,
                scale: 0.25,
                bf16: true,
            };
            let kv = kv_rows(&k, &v, hd, (0, n - 1));
            let mut got = vec![0f32; group * hd];
            attend(&q, &kv, heads, &mut vec![], &mut got);
            let want = definition(&q, (&k, &v), hd, (0, n - 1), 0.25, true);
            let unrounded = definition(&q, (&k, &v), hd, (0, n - 1), 0.25, false);
            let mut moved = 0f64;
            for (i, ((g, w), u)) in got.iter().zip(&want).zip(&unrounded).enumerate() {
                assert!(
                    (*g as f64 - w).abs() < 1e-5,
                    "hd {hd} value {i}: {g} vs {w}"
                );
                moved = moved.max((w - u).abs());
            }
            assert!(moved > 2e-4, "the rounding shows: {moved}");
        }
    }

    /// The bf16 block kernel (where the CPU has it) and the f32 block with rounded
    /// probabilities against row-by-row bf16 attention: causal and sliding windows, blocks that
    /// start after the gathered keys begin (a cache) and key counts that are not whole 32-key
    /// steps, head dims on and off the tiles' 32-value steps.
    #[test]
    fn bf16_rows_match_row_by_row() {
        let mut gen = lcg(11);
        let mut rnd = || crate::kernels::w4::round_bf16(gen());
        let total = 120;
        let mut scratch = RowsScratch::default();
        for &(hd, group) in &[(64, 3), (16, 2), (256, 4)] {
            let k: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
            let heads = Heads {
                dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                bf16: true,
            };
            // (rows, first position, sliding window or none, first gathered position)
            for &(rows, p0, window, from) in &[
                (32, 40, Some(3), 30),
                (32, 0, None, 0),
                (17, 40, None, 0),
                (32, 50, Some(8), 10),
                (20, 90, Some(40), 51),
                (1, 7, None, 0),
            ] {
                let q: Vec<f32> = (0..rows * group * hd).map(|_| 4.0 * rnd()).collect();
                let lo = |r: usize| window.map_or(0, |w: usize| (p0 + r + 1).saturating_sub(w));
                let kv = KvBits::gather(
                    |p| &k[p * hd..(p + 1) * hd],
                    |p| &v[p * hd..(p + 1) * hd],
                    from..=p0 + rows - 1,
                    hd,
                );
                let mut tiled = vec![f32::NAN; q.len()];
                let ran =
                    attend_rows_bf16(&q, rows, &kv, (lo, p0), heads, &mut scratch, &mut tiled);
                assert_eq!(ran, bf16_rows_run());
                let (gemm, want) =
                    block_and_row_by_row(&q, rows, (&k, &v), (lo, p0), heads, &mut scratch);
                // Three keys per row: tight (see `bf16_operands_round_the_probabilities`); many: a
                // probability's rounding may flip with the sums' order.
                let tol = if window == Some(3) { 2e-5 } else { 2e-3 };
                for (i, w) in want.iter().enumerate() {
                    let r = i / (group * hd);
                    let (g, t) = (gemm[i], tiled[i]);
                    let at = format!("hd {hd}, rows {rows} at {p0}, row {r}");
                    assert!((g - w).abs() <= tol, "{at}: {g} vs {w}");
                    assert!(!ran || (t - w).abs() <= tol, "{at}: {t} vs {w}");
                }
            }
        }
    }

    /// Keys and values stored as bf16 give the bits of the same values stored as f32, on every
    /// path: decode (the portable body and the AVX-512 kernel, which widens them by a shift), the
    /// f32 block and the bf16 block's gathered bits.
    #[test]
    fn bf16_rows_give_the_bits_of_their_f32_values() {
        let mut gen = lcg(13);
        let mut rnd = || crate::kernels::w4::round_bf16(gen());
        let (hd, group, total) = (64, 3, 77);
        let k: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
        let to16 = crate::kernels::convert::stored::<half::bf16>;
        let (k16, v16) = (to16(&k), to16(&v));
        let q: Vec<f32> = (0..32 * group * hd).map(|_| 4.0 * rnd()).collect();
        for bf16 in [false, true] {
            let heads = Heads {
                dim: hd,
                scale: 0.125,
                bf16,
            };
            // Decode: both bodies, a window that is not whole value blocks.
            let (w32, w16) = (
                kv_rows(&k, &v, hd, (3, 70)),
                kv_rows(&k16, &v16, hd, (3, 70)),
            );
            let qr = &q[..group * hd];
            let mut pair = [vec![0f32; group * hd], vec![1f32; group * hd]];
            attend(qr, &w32, heads, &mut vec![], &mut pair[0]);
            attend(qr, &w16, heads, &mut vec![], &mut pair[1]);
            assert_eq!(pair[0], pair[1], "attend, bf16 {bf16}");
            attend_body(qr, &w32, heads, &mut vec![], &mut pair[0]);
            attend_body(qr, &w16, heads, &mut vec![], &mut pair[1]);
            assert_eq!(pair[0], pair[1], "portable body, bf16 {bf16}");
            // A block of 32 rows at positions 40.., causal over keys from 0.
            let mut scratch = RowsScratch::default();
            let w16 = kv_rows(&k16, &v16, hd, (0, total - 1));
            let (key16, value16) = (&w16.key, &w16.value);
            let w32 = kv_rows(&k, &v, hd, (0, total - 1));
            let (key32, value32) = (&w32.key, &w32.value);
            pair = [vec![0f32; q.len()], vec![1f32; q.len()]];
            let out = &mut pair[0];
            attend_rows(
                &q,
                32,
                (key32, value32),
                (|_| 0, 40),
                heads,
                &mut scratch,
                out,
            );
            let out = &mut pair[1];
            attend_rows(
                &q,
                32,
                (key16, value16),
                (|_| 0, 40),
                heads,
                &mut scratch,
                out,
            );
            assert_eq!(pair[0], pair[1], "attend_rows, bf16 {bf16}");
        }
        let (w32, w16) = (kv_rows(&k, &v, hd, (0, 0)), kv_rows(&k16, &v16, hd, (0, 0)));
        let a = KvBits::gather(&w32.key, &w32.value, 5..=71, hd);
        let b = KvBits::gather(&w16.key, &w16.value, 5..=71, hd);
        assert_eq!((a.k, a.vt), (b.k, b.vt));
    }
}
