//! Attention of one query row for the query heads that share one KV head
//! (GQA), over keys/values handed out by position — the model's KV cache
//! (sliding ring or full) plus the current call's new rows.
//!
//! The portable body here is the reference; on AVX-512 ([`avx512`], chosen at run time) the
//! query heads of a KV head score each key in one pass and the values are accumulated in
//! registers over blocks of positions: the same math, sums in another order.

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
/// in `q`, over the positions of `kv`. `scores` is scratch (resized here).
pub fn attend<'a, K, V>(
    q: &[f32],
    kv: &Window<K, V>,
    (hd, scale): (usize, f32),
    scores: &mut Vec<f32>,
    out: &mut [f32],
) where
    K: Fn(usize) -> &'a [f32],
    V: Fn(usize) -> &'a [f32],
{
    #[cfg(target_arch = "x86_64")]
    if super::isa::isa().avx512() && hd.is_multiple_of(16) {
        // SAFETY: the CPU has AVX-512 (detected at run time).
        return unsafe { avx512::attend(q, kv, (hd, scale), scores, out) };
    }
    attend_body(q, kv, (hd, scale), scores, out)
}

/// The portable reference of [`attend`].
fn attend_body<'a, K, V>(
    q: &[f32],
    &Window {
        ref key,
        ref value,
        lo,
        hi,
    }: &Window<K, V>,
    (hd, scale): (usize, f32),
    scores: &mut Vec<f32>,
    out: &mut [f32],
) where
    K: Fn(usize) -> &'a [f32],
    V: Fn(usize) -> &'a [f32],
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
                *a += s * b;
            }
        }
    }
}

/// Query rows per block of [`attend_rows`]: the block's keys and values are gathered once and
/// its scores are one GEMM.
pub const BLOCK_ROWS: usize = 32;

const SERIAL: gemm::Parallelism = gemm::Parallelism::None;

/// Scratch of [`attend_rows`], reused across blocks.
#[derive(Default)]
pub struct RowsScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
}

/// [`attend`] for `rows` consecutive query rows at once, as two GEMMs: row r sits at position
/// `p0 + r` and sees positions `lo(r)..=p0 + r` (`lo` nondecreasing, as causal and sliding
/// windows are). The block's keys and values (positions `lo(0)..=p0 + rows − 1`) are gathered
/// once, S = Q·Kᵀ over all of them, each row's scores outside its window are dropped before
/// its softmax, and O = P·V. `q` and `out` are `[rows][heads][hd]` for the query heads of one
/// KV head. The same math as [`attend`] row by row; the sums run in the GEMM's order (f32
/// throughout), so results differ in the last bits.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows<'a>(
    q: &[f32],
    rows: usize,
    key: impl Fn(usize) -> &'a [f32],
    value: impl Fn(usize) -> &'a [f32],
    lo: impl Fn(usize) -> usize,
    p0: usize,
    hd: usize,
    scale: f32,
    scratch: &mut RowsScratch,
    out: &mut [f32],
) {
    assert!(rows > 0 && q.len() == out.len() && q.len().is_multiple_of(rows * hd));
    let heads = q.len() / (rows * hd);
    let (first, last) = (lo(0), p0 + rows - 1);
    assert!(first <= p0);
    let n = last + 1 - first;
    let m = rows * heads;
    let RowsScratch { k, v, s } = scratch;
    k.clear();
    v.clear();
    for pos in first..=last {
        k.extend_from_slice(key(pos));
        v.extend_from_slice(value(pos));
    }
    s.clear();
    s.resize(m * n, 0.0);
    // S[m, n] = Q[m, hd] · Kᵀ: key j's element d at k[j·hd + d]. One thread: jobs are parallel.
    // SAFETY: s is m × n, row-major.
    unsafe { super::gemm_strided(m, n, hd, s.as_mut_ptr(), n, q, hd, k, 1, hd, SERIAL) };
    for r in 0..rows {
        let (a, b) = (lo(r) - first, p0 + r - first);
        for row in s[r * heads * n..(r + 1) * heads * n].chunks_exact_mut(n) {
            let visible = &mut row[a..=b];
            visible.iter_mut().for_each(|x| *x *= scale);
            super::softmax(visible);
            row[..a].fill(0.0);
            row[b + 1..].fill(0.0);
        }
    }
    // O[m, hd] = P[m, n] · V[n, hd].
    // SAFETY: out is m × hd, row-major.
    unsafe { super::gemm_strided(m, hd, n, out.as_mut_ptr(), hd, s, n, v, hd, 1, SERIAL) };
}

/// Prefetch hints of [`prefetch`] (x86's `_MM_HINT_T0` and `_MM_HINT_T1`).
const L1: i32 = 3;
const L2: i32 = 2;

/// Hint the cache lines of `row` into the cache level `HINT` names ([`L1`], [`L2`]; never faults).
#[inline(always)]
fn prefetch<const HINT: i32>(row: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(16) {
        // SAFETY: a prefetch of a valid address has no architectural effect.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(line.as_ptr() as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row p of `k` and `v` (`[positions][hd]`) at positions `lo..=hi`.
    fn kv_rows<'a>(
        k: &'a [f32],
        v: &'a [f32],
        hd: usize,
        (lo, hi): (usize, usize),
    ) -> Window<impl Fn(usize) -> &'a [f32], impl Fn(usize) -> &'a [f32]> {
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
            let mut s = 7u32;
            let mut rnd = || {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            };
            let q: Vec<f32> = (0..group * hd).map(|_| rnd()).collect();
            let k: Vec<f32> = (0..(n + 5) * hd).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..(n + 5) * hd).map(|_| rnd()).collect();
            let (lo, hi) = (5, n + 4);
            let mut out = vec![0f32; group * hd];
            fn row(m: &[f32], hd: usize, p: usize) -> &[f32] {
                &m[p * hd..(p + 1) * hd]
            }
            let kv = kv_rows(&k, &v, hd, (lo, hi));
            attend(&q, &kv, (hd, 0.3), &mut vec![], &mut out);
            for h in 0..group {
                let qh = &q[h * hd..(h + 1) * hd];
                let logits: Vec<f64> = (lo..=hi)
                    .map(|p| {
                        0.3 * qh
                            .iter()
                            .zip(row(&k, hd, p))
                            .map(|(a, b)| (a * b) as f64)
                            .sum::<f64>()
                    })
                    .collect();
                let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
                let w: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
                let z: f64 = w.iter().sum();
                for d in 0..hd {
                    let want: f64 = (lo..=hi)
                        .map(|p| w[p - lo] / z * row(&v, hd, p)[d] as f64)
                        .sum();
                    assert!(
                        (out[h * hd + d] as f64 - want).abs() < 1e-5,
                        "head {h} dim {d}"
                    );
                }
            }
        }
    }

    /// A block of rows as GEMMs equals row-by-row attention, causal and sliding, over keys that
    /// start before the block (a cache) and a block not starting at position 0.
    #[test]
    fn rows_as_gemms_match_row_by_row() {
        let mut s = 3u32;
        let mut rnd = || {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let (hd, heads) = (16, 3);
        let total = 90;
        let k: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..total * hd).map(|_| rnd()).collect();
        fn row(m: &[f32], hd: usize, p: usize) -> &[f32] {
            &m[p * hd..(p + 1) * hd]
        }
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
            let mut got = vec![f32::NAN; q.len()];
            attend_rows(
                &q,
                rows,
                |p| row(&k, hd, p),
                |p| row(&v, hd, p),
                lo,
                p0,
                hd,
                0.25,
                &mut scratch,
                &mut got,
            );
            for r in 0..rows {
                let mut want = vec![0f32; heads * hd];
                let qr = &q[r * heads * hd..(r + 1) * heads * hd];
                let kv = kv_rows(&k, &v, hd, (lo(r), p0 + r));
                attend(qr, &kv, (hd, 0.25), &mut vec![], &mut want);
                for (g, w) in got[r * heads * hd..(r + 1) * heads * hd].iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-5,
                        "rows {rows} at {p0}, row {r}: {g} vs {w}"
                    );
                }
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
            let mut s = 9u32;
            let mut rnd = || {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            };
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
                let (mut want, mut got) = (vec![0f32; group * hd], vec![f32::NAN; group * hd]);
                let kv = kv_rows(&k, &v, hd, (lo, hi));
                attend_body(&q, &kv, (hd, 0.3), &mut vec![], &mut want);
                // SAFETY: AVX-512 checked above.
                unsafe { avx512::attend(&q, &kv, (hd, 0.3), &mut vec![], &mut got) };
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 2e-6,
                        "hd {hd}, group {group}, {lo}..={hi}, value {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
