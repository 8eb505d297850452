//! Dense bf16 weights kept as bf16 (half the bytes of f32): `y = x · Wᵀ`
//! with every weight widened to f32 in registers (exact: bf16 is the top
//! half of an f32) and f32 multiply-adds. Results equal f32 math on the
//! bf16 values up to summation order.
//!
//! Decode (few rows) streams the weights once through a row-dot kernel —
//! on an AVX512-BF16 CPU with bf16 activations (GPTQ artifacts), one that
//! multiplies the stored bf16 pairs with `vdpbf16ps` (exact products, f32
//! sums) instead of widening; prefill (many rows) widens panels of weight rows to f32 and runs `gemm`
//! on them, see [`super::panel_matmul`] — or, when the activations are bf16
//! values and the CPU has AVX512-BF16, multiplies the panels with
//! `vdpbf16ps` (`bf16_act_panel_matmul`, also used by W4A16). The AVX-512
//! kernels are in the child module `avx512`.

// The AVX-512 kernels index several register arrays ([stream][row]) by one counter.
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod avx512;

use super::isa::{isa, Isa};
use super::par::{for_tiles, ColumnsOut};

/// From this many activation rows on, panels + `gemm` beat streaming.
pub const GEMM_MIN_ROWS: usize = 16;

/// Exact bf16 → f32.
#[inline]
pub fn widen(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Little-endian bf16 bytes (as safetensors stores them) → bits.
pub fn bits_from_le_bytes(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// The scalar reference: widen, multiply-add in order.
pub fn matmul_nt_reference(x: &[f32], m: usize, k: usize, w: &[u16], n: usize, y: &mut [f32]) {
    assert_eq!((x.len(), w.len(), y.len()), (m * k, n * k, m * n));
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f32;
            for kk in 0..k {
                s += x[i * k + kk] * widen(w[j * k + kk]);
            }
            y[i * n + j] = s;
        }
    }
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` with the tier in use.
pub fn matmul_nt(x: &[f32], m: usize, k: usize, w: &[u16], n: usize, y: &mut [f32]) {
    matmul_nt_with(isa(), x, m, k, w, n, y);
}

/// [`matmul_nt`] with an explicit tier (tests run every available one).
pub fn matmul_nt_with(isa: Isa, x: &[f32], m: usize, k: usize, w: &[u16], n: usize, y: &mut [f32]) {
    assert_eq!((x.len(), w.len(), y.len()), (m * k, n * k, m * n));
    if m == 0 || n == 0 {
        return;
    }
    if m >= GEMM_MIN_ROWS {
        #[cfg(target_arch = "x86_64")]
        if bf16_act_panel_matmul(isa, x, m, k, n, y, |cols, out| {
            out.copy_from_slice(&w[cols.start * k..cols.end * k])
        }) {
            return;
        }
        let expand = |cols: std::ops::Range<usize>, out: &mut [f32]| {
            for (j, o) in cols.zip(out.chunks_exact_mut(k)) {
                for (d, s) in o.iter_mut().zip(&w[j * k..(j + 1) * k]) {
                    *d = widen(*s);
                }
            }
        };
        super::panel_matmul(x, m, k, n, y, expand);
        return;
    }
    let out = ColumnsOut::new(y, m, n);
    // bf16 activations as bf16 bits, for `vdpbf16ps`; otherwise deinterleaved f32.
    #[cfg(target_arch = "x86_64")]
    let xb = if isa >= Isa::Avx512Bf16 {
        bf16_bits(x)
    } else {
        None
    };
    #[cfg(not(target_arch = "x86_64"))]
    let xb: Option<Vec<u16>> = None;
    let xp = if xb.is_none() {
        deinterleave(x, m, k)
    } else {
        Vec::new()
    };
    for_tiles(m, n, k, |rows, cb| match isa {
        #[cfg(target_arch = "x86_64")]
        isa if isa.avx512() => {
            let acts = match &xb {
                Some(b) => avx512::Acts::Bf16(b),
                None => avx512::Acts::F32(&xp),
            };
            // SAFETY: the tier was detected on this CPU (AVX512-BF16 when `xb` is
            // present); bounds asserted above.
            unsafe { avx512::bf16_gemv(w, k, acts, rows, cb, &out) }
        }
        _ => gemv_portable(w, k, &xp, rows, cb, &out),
    });
}

/// [`panel_matmul`](super::panel_matmul) when every activation is a bf16 value and the CPU has
/// AVX512-BF16: weight panels (bf16 values after `expand`) are packed in
/// 32-column slices and multiplied with `vdpbf16ps` (exact products, f32 sums; twice the f32 FMA
/// rate on Zen 4, half of it on the Xeon of docs/BENCHMARKS.md) or, where the CPU has them, AMX
/// tiles (16× `vdpbf16ps` there). Returns false (nothing done) otherwise.
#[cfg(target_arch = "x86_64")]
pub(super) fn bf16_act_panel_matmul(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    y: &mut [f32],
    expand_bits: impl Fn(std::ops::Range<usize>, &mut [u16]) + Sync,
) -> bool {
    use avx512::GEMM_SLICE;
    if isa < Isa::Avx512Bf16 || !k.is_multiple_of(2) {
        return false;
    }
    let Some(xb) = bf16_bits(x) else {
        return false;
    };
    assert_eq!((x.len(), y.len()), (m * k, m * n));
    let out = ColumnsOut::new(y, m, n);
    let tiled = tiled_rows(isa, &xb, m, k);
    super::par::for_ranges(n.div_ceil(GEMM_SLICE), m * n * k, |slices| {
        let mut buffers = PanelScratch::default();
        // SAFETY: the tier was checked above; this job owns the columns of `slices`.
        unsafe {
            panel_slices(
                tiled.as_ref(),
                &xb,
                (k, n),
                slices,
                &expand_bits,
                &out,
                &mut buffers,
            )
        }
    });
    true
}

/// The buffers [`matmul_bits_serial`] packs weights into, kept by a caller that makes many calls.
#[cfg(target_arch = "x86_64")]
pub(crate) struct PanelScratch {
    wb: Vec<u16>,
    packed: super::amx::Aligned<u16>,
    acc: super::amx::Aligned<f32>,
}

#[cfg(target_arch = "x86_64")]
impl Default for PanelScratch {
    fn default() -> Self {
        PanelScratch {
            wb: Vec::new(),
            packed: super::amx::Aligned::new(0),
            acc: super::amx::Aligned::new(0),
        }
    }
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` on this thread alone, for `xb` (`x` as bits) and the rows of
/// `w` that `expand_bits(cols, out)` writes as bits: the kernels of [`bf16_act_panel_matmul`]
/// (AMX tiles where the CPU has them, `vdpbf16ps` otherwise; exact products, f32 sums) for a
/// caller that is already one job of a parallel loop (attention's blocks of query rows).
/// Returns false (nothing done) where the CPU lacks AVX512-BF16 or `k` is odd.
#[cfg(target_arch = "x86_64")]
pub(crate) fn matmul_bits_serial(
    isa: Isa,
    xb: &[u16],
    (m, k, n): (usize, usize, usize),
    y: &mut [f32],
    expand_bits: impl Fn(std::ops::Range<usize>, &mut [u16]),
    buffers: &mut PanelScratch,
) -> bool {
    if isa < Isa::Avx512Bf16 || !k.is_multiple_of(2) {
        return false;
    }
    assert_eq!((xb.len(), y.len()), (m * k, m * n));
    if m == 0 || n == 0 {
        return true;
    }
    let out = ColumnsOut::new(y, m, n);
    let tiled = tiled_rows(isa, xb, m, k);
    let slices = 0..n.div_ceil(avx512::GEMM_SLICE);
    // SAFETY: the tier was checked above; this call writes every column.
    unsafe {
        panel_slices(
            tiled.as_ref(),
            xb,
            (k, n),
            slices,
            &expand_bits,
            &out,
            buffers,
        )
    };
    true
}

/// One job of [`bf16_act_panel_matmul`]: the 32-column slices `slices` of `w` (of `n` columns)
/// expanded, packed a group at a time and multiplied by all rows, each row block reused over
/// the group's slices.
///
/// # Safety
/// The CPU has AVX512-BF16 (and AMX where `tiled` exists); the job owns the slices' columns.
#[cfg(target_arch = "x86_64")]
unsafe fn panel_slices(
    tiled: Option<&amx::TiledRows>,
    xb: &[u16],
    (k, n): (usize, usize),
    slices: std::ops::Range<usize>,
    expand_bits: &impl Fn(std::ops::Range<usize>, &mut [u16]),
    out: &ColumnsOut,
    buffers: &mut PanelScratch,
) {
    use avx512::GEMM_SLICE;
    let m = xb.len() / k;
    let group = if tiled.is_some() {
        amx::slices_per_group(k)
    } else {
        avx512::slices_per_group(k)
    };
    let PanelScratch {
        wb,
        packed,
        acc: scratch,
    } = buffers;
    if wb.len() < GEMM_SLICE * k {
        wb.resize(GEMM_SLICE * k, 0);
    }
    if packed.len() < group * GEMM_SLICE * k {
        *packed = super::amx::Aligned::new(group * GEMM_SLICE * k);
    }
    for g0 in slices.clone().step_by(group) {
        let g1 = (g0 + group).min(slices.end);
        for si in g0..g1 {
            let cols = si * GEMM_SLICE..((si + 1) * GEMM_SLICE).min(n);
            let c = cols.len();
            expand_bits(cols, &mut wb[..c * k]);
            let dst = &mut packed[(si - g0) * GEMM_SLICE * k..][..GEMM_SLICE * k];
            // SAFETY: the caller guarantees the tier.
            unsafe { avx512::pack_bf16_slice(&wb[..c * k], c, k, dst) };
        }
        let cols = g0 * GEMM_SLICE..(g1 * GEMM_SLICE).min(n);
        let slices = &packed[..(g1 - g0) * GEMM_SLICE * k];
        let job = avx512::SliceCols {
            slices,
            c0: cols.start,
            cols: cols.len(),
            out,
        };
        // SAFETY: the caller guarantees the tier and owns columns `cols`.
        unsafe { gemm_slices(tiled, xb, k, job, 0..m, scratch) };
    }
}

/// The GEMM of `job`'s consecutive packed slices on the best tier: AMX tiles for every row when `tiled` holds them (built by
/// [`tiled_rows`] where the CPU has tiles), `vdpbf16ps` rows otherwise.
///
/// # Safety
/// `isa` ≥ [`Isa::Avx512Bf16`] was detected on this CPU; the job owns columns `c0..c0 + cols`.
#[cfg(target_arch = "x86_64")]
unsafe fn gemm_slices(
    tiled: Option<&amx::TiledRows>,
    xb: &[u16],
    k: usize,
    job: avx512::SliceCols,
    rows: std::ops::Range<usize>,
    scratch: &mut super::amx::Aligned<f32>,
) {
    let mut rest = rows.start;
    if let Some(a) = tiled {
        if rows.start.is_multiple_of(amx::ROWS) && rows.end <= a.rows() {
            rest = rows.end;
            // SAFETY: `tiled` exists only under the AMX tier; the caller owns the columns.
            unsafe { amx::bf16_gemm_slices(a, job, rows.clone(), scratch) };
        }
    }
    if rest < rows.end {
        // SAFETY: as above, AVX512-BF16 checked by the caller.
        unsafe { avx512::bf16_gemm_slices(xb, k, job, rest..rows.end, &|_| usize::MAX) };
    }
}

/// `xb` (`[m, k]` bits) packed for the AMX kernel, where `isa` has tiles and the shape gives
/// them whole steps.
#[cfg(target_arch = "x86_64")]
fn tiled_rows(isa: Isa, xb: &[u16], m: usize, k: usize) -> Option<amx::TiledRows> {
    (isa >= Isa::Amx && amx::takes(k)).then(|| amx::TiledRows::new(xb, m, k))
}

/// `out[i, j] = Σ_t a[t, i]·b[t, j]` over the `t` rows of `a` and `b` (`[t, k]`, row-major) with
/// `vdpbf16ps` (or AMX tiles) when every value is a bf16 value and the CPU has AVX512-BF16: exact
/// products, f32 sums (the numerics of an f32 GEMM on bf16 inputs, up to summation order; the
/// tiles also flush subnormals). The Gram matrices of calibration inputs (Hessians, cross
/// moments) are these.
/// `b = None` computes aᵀa on and above the diagonal only, by 32-column slices (an entry
/// (i, j) with i > j may or may not be written). Returns false with `out` untouched where the
/// CPU lacks AVX512-BF16 or a value is not a bf16 value: the caller runs its f32 GEMM then.
pub fn gram_bf16(a: &[f32], b: Option<&[f32]>, t: usize, k: usize, out: &mut [f32]) -> bool {
    gram_bf16_with(isa(), a, b, t, k, out)
}

/// [`gram_bf16`] with an explicit tier (tests).
pub fn gram_bf16_with(
    isa: Isa,
    a: &[f32],
    b: Option<&[f32]>,
    t: usize,
    k: usize,
    out: &mut [f32],
) -> bool {
    assert_eq!((a.len(), out.len()), (t * k, k * k));
    assert!(b.is_none_or(|b| b.len() == t * k));
    #[cfg(target_arch = "x86_64")]
    {
        use rayon::prelude::*;
        if isa < Isa::Avx512Bf16 || t == 0 || k == 0 {
            return false;
        }
        // t2 = t rounded up to whole tile steps with zero tokens (they add nothing): the slice
        // kernels reduce over pairs, the tiles over 32.
        let t2 = t.next_multiple_of(32);
        if isa >= Isa::Amx {
            return gram_amx(a, b, t, k, t2, out);
        }
        // Both operands transposed to [k, t2] bits.
        let Some(at) = transposed_bits(a, t, k, t2) else {
            return false;
        };
        let bt = match b {
            Some(b) => match transposed_bits(b, t, k, t2) {
                Some(bt) => Some(bt),
                None => return false,
            },
            None => None,
        };
        let cols_of = bt.as_deref().unwrap_or(&at);
        let dst = ColumnsOut::new(out, k, k);
        let slices = k.div_ceil(avx512::GEMM_SLICE);
        // The row-blocked kernel reuses each block of rows over a group of slices, small enough
        // that the triangle's unequal groups still balance over the threads.
        let balance = slices.div_ceil(4 * rayon::current_num_threads());
        let group = avx512::slices_per_group(t2).min(balance).max(1);
        let per_slice = avx512::GEMM_SLICE * t2;
        // Largest jobs first: the upper triangle's slices grow with their column.
        (0..slices.div_ceil(group))
            .into_par_iter()
            .rev()
            .for_each_init(
                || super::amx::Aligned::new(group * per_slice),
                |packed, gi| {
                    let c0 = gi * group * avx512::GEMM_SLICE;
                    let c = (k - c0).min(group * avx512::GEMM_SLICE);
                    for (i, dst) in packed.chunks_exact_mut(per_slice).enumerate() {
                        let s0 = c0 + i * avx512::GEMM_SLICE;
                        let sc = (c0 + c).saturating_sub(s0).min(avx512::GEMM_SLICE);
                        if sc > 0 {
                            // SAFETY: the tier was checked above.
                            unsafe {
                                avx512::pack_bf16_slice(
                                    &cols_of[s0 * t2..(s0 + sc) * t2],
                                    sc,
                                    t2,
                                    dst,
                                )
                            };
                        }
                    }
                    let packed = &packed[..c.div_ceil(avx512::GEMM_SLICE) * per_slice];
                    // Slice i of the group ends its rows at the diagonal when only the upper
                    // triangle is asked for.
                    let row_end = |i: usize| {
                        if b.is_none() {
                            (c0 + (i + 1) * avx512::GEMM_SLICE).min(k)
                        } else {
                            k
                        }
                    };
                    let job = avx512::SliceCols {
                        slices: packed,
                        c0,
                        cols: c,
                        out: &dst,
                    };
                    // SAFETY: as above; this job alone writes columns c0..c0 + c.
                    unsafe { avx512::bf16_gemm_slices(&at, t2, job, 0..k, &row_end) };
                },
            );
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, b);
        false
    }
}

/// [`gram_bf16`] on AMX tiles: the left operand tiled straight from `a`'s columns, the right
/// one packed slice by slice from `b`'s rows (no transposed copies).
#[cfg(target_arch = "x86_64")]
fn gram_amx(a: &[f32], b: Option<&[f32]>, t: usize, k: usize, t2: usize, out: &mut [f32]) -> bool {
    use rayon::prelude::*;
    if b.is_some_and(|b| !all_bf16(b)) {
        return false;
    }
    // SAFETY: the AMX tier implies AVX-512F.
    let Some(tiled) = (unsafe { amx::TiledRows::from_columns(a, t, k) }) else {
        return false;
    };
    let cols_of = b.unwrap_or(a);
    let dst = ColumnsOut::new(out, k, k);
    let slice = avx512::GEMM_SLICE;
    let slices = k.div_ceil(slice);
    // Each block of 32 rows (`a`'s tiles) is reused over a group of slices held in L2, small
    // enough that the triangle's unequal groups still balance over the threads.
    let balance = slices.div_ceil(4 * rayon::current_num_threads());
    let group = amx::slices_per_group(t2).min(balance).max(1);
    let per_slice = slice * t2;
    // Largest jobs first: the upper triangle's slices grow with their column.
    (0..slices.div_ceil(group))
        .into_par_iter()
        .rev()
        .for_each_init(
            || {
                let packed = super::amx::Aligned::new(group * per_slice);
                (packed, super::amx::Aligned::new(0))
            },
            |(packed, scratch), gi| {
                let c0 = gi * group * slice;
                let c = (k - c0).min(group * slice);
                let used = c.div_ceil(slice);
                for (i, p) in packed.chunks_exact_mut(per_slice).take(used).enumerate() {
                    let s0 = c0 + i * slice;
                    let sc = (c0 + c - s0).min(slice);
                    // SAFETY: the AMX tier implies AVX-512F; columns s0… lie inside the rows.
                    unsafe { avx512::pack_slice_of_rows(cols_of, t, k, (s0, sc), t2, p) };
                }
                let rows = if b.is_none() { 0..c0 + c } else { 0..k };
                let job = avx512::SliceCols {
                    slices: &packed[..used * per_slice],
                    c0,
                    cols: c,
                    out: &dst,
                };
                // SAFETY: the tier was checked by the caller; this job alone writes columns c0..c0 + c.
                unsafe { amx::bf16_gemm_slices(&tiled, job, rows, scratch) };
            },
        );
    true
}

/// `x` (`[t, w]`) as bf16 bits transposed to `[w, t2]`, tokens `t..t2` zero, in one parallel pass;
/// `None` when a value is not a bf16 value (its low 16 bits not zero).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn transposed_bits(x: &[f32], t: usize, w: usize, t2: usize) -> Option<Vec<u16>> {
    use rayon::prelude::*;
    assert!(x.len() == t * w && t2 >= t);
    // 64 columns of x per job, 64 tokens at a time through a small tile: rows of x are read 256
    // contiguous bytes at a time, and each output row gets 128 contiguous bytes. (Output rows lie
    // 2·t2 bytes apart, usually a power of two: writing one token to all 64 of them at once maps
    // the stores onto one L1 set; that form took twice as long in a 1.7B-shaped quantize.)
    const COLS: usize = 64;
    const ROWS: usize = 64;
    let mut out = vec![0u16; w * t2];
    out.par_chunks_mut(COLS * t2)
        .enumerate()
        .try_for_each(|(b, block)| {
            let c0 = b * COLS;
            let nc = block.len() / t2;
            let mut tile = [[0u16; ROWS]; COLS];
            let mut low = 0u32;
            for r0 in (0..t).step_by(ROWS) {
                let r1 = (r0 + ROWS).min(t);
                for (i, r) in (r0..r1).enumerate() {
                    for (c, v) in x[r * w + c0..r * w + c0 + nc].iter().enumerate() {
                        let v = v.to_bits();
                        low |= v & 0xFFFF;
                        tile[c][i] = (v >> 16) as u16;
                    }
                }
                if low != 0 {
                    return Err(());
                }
                for (dst, row) in block.chunks_exact_mut(t2).zip(&tile) {
                    dst[r0..r1].copy_from_slice(&row[..r1 - r0]);
                }
            }
            Ok(())
        })
        .ok()?;
    Some(out)
}

/// Whether every value of `x` is a bf16 value (its low 16 bits zero).
pub fn all_bf16(x: &[f32]) -> bool {
    use rayon::prelude::*;
    // An OR over each piece (vectorised) rather than a value-by-value test that may stop early.
    x.par_chunks(1 << 16)
        .all(|c| c.iter().fold(0u32, |o, v| o | (v.to_bits() & 0xFFFF)) == 0)
}

/// `x` as bf16 bits when every value is a bf16 value (the low 16 bits
/// zero), for the `vdpbf16ps` kernels; `None` otherwise.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn bf16_bits(x: &[f32]) -> Option<Vec<u16>> {
    use rayon::prelude::*;
    // Threaded only where the pass is long enough to pay for the fan-out (prefill's rows, the
    // calibration forward's 16K), not for decode's one row.
    const PAR_MIN: usize = 1 << 16;
    let convert = |(o, x): (&mut [u16], &[f32])| {
        let mut low = 0u32;
        for (o, v) in o.iter_mut().zip(x) {
            let v = v.to_bits();
            low |= v & 0xFFFF;
            *o = (v >> 16) as u16;
        }
        (low == 0).then_some(())
    };
    let mut out = vec![0u16; x.len()];
    if x.len() < PAR_MIN {
        convert((&mut out, x))?;
    } else {
        out.par_chunks_mut(PAR_MIN)
            .zip(x.par_chunks(PAR_MIN))
            .try_for_each(convert)?;
    }
    Some(out)
}

/// Each row's full 32-element chunks reordered as 16 even then 16 odd
/// elements (the order a 32-bit lane split of 32 bf16 yields); the tail
/// (`k % 32`) stays in place.
fn deinterleave(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let mut xp = x.to_vec();
    for r in 0..m {
        for c in 0..k / 32 {
            let base = r * k + 32 * c;
            for i in 0..16 {
                xp[base + i] = x[base + 2 * i];
                xp[base + 16 + i] = x[base + 2 * i + 1];
            }
        }
    }
    xp
}

fn gemv_portable(
    w: &[u16],
    k: usize,
    xp: &[f32],
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    out: &ColumnsOut,
) {
    let k32 = k / 32 * 32;
    for r in rows {
        let xr = &xp[r * k..(r + 1) * k];
        // SAFETY: this job owns columns `cols` (disjoint ranges per job).
        let yr = unsafe { out.row_mut(r, cols.clone()) };
        for (j, o) in cols.clone().zip(yr.iter_mut()) {
            let wr = &w[j * k..(j + 1) * k];
            let mut acc = [0f32; 16];
            for (wc, xc) in wr[..k32].chunks_exact(32).zip(xr[..k32].chunks_exact(32)) {
                for i in 0..16 {
                    acc[i] += widen(wc[2 * i]) * xc[i] + widen(wc[2 * i + 1]) * xc[16 + i];
                }
            }
            let mut s: f32 = acc.iter().sum();
            for (wv, xv) in wr[k32..].iter().zip(&xr[k32..]) {
                s += widen(*wv) * xv;
            }
            *o = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::assert_close_sum_order;
    use rand::{Rng, SeedableRng};

    /// Rows and columns are independent: an output's bits do not depend on how many rows or
    /// columns share the call, so the tile kernel's passes over a long reduction (whole 32 × 32
    /// blocks) give the bits of its one-pass loop (the last partial row block and slice).
    #[test]
    fn a_long_reduction_in_passes_gives_the_bits_of_one_pass() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        let k = 6656;
        let x: Vec<f32> = (0..96 * k)
            .map(|_| half::bf16::from_f32(rng.random::<f32>() * 2.0 - 1.0).to_f32())
            .collect();
        let w: Vec<u16> = (0..64 * k)
            .map(|_| half::bf16::from_f32(rng.random::<f32>() * 2.0 - 1.0).to_bits())
            .collect();
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for isa in Isa::tested() {
            // Row 64: in a whole block of 96 rows, in the partial block of 65.
            let (mut all, mut partial) = (vec![0f32; 96 * 64], vec![0f32; 65 * 64]);
            matmul_nt_with(isa, &x, 96, k, &w, 64, &mut all);
            matmul_nt_with(isa, &x[..65 * k], 65, k, &w, 64, &mut partial);
            assert_eq!(bits(&all[..65 * 64]), bits(&partial), "{isa:?} rows");
            // Column 32: in a whole slice of 64 columns, in the partial slice of 33 (the slice
            // kernels; the portable panels' f32 GEMM blocks by the column count).
            if isa < Isa::Avx512Bf16 {
                continue;
            }
            let mut narrow = vec![0f32; 96 * 33];
            matmul_nt_with(isa, &x, 96, k, &w[..33 * k], 33, &mut narrow);
            let wide: Vec<f32> = all.chunks(64).flat_map(|r| r[..33].to_vec()).collect();
            assert_eq!(bits(&wide), bits(&narrow), "{isa:?} columns");
        }
    }

    #[test]
    fn every_tier_matches_the_reference_on_odd_shapes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 32, 1),
            (1, 2048, 33),
            (2, 96, 17),
            (3, 130, 9),
            (4, 384, 31),
            (5, 64, 8),
            (16, 160, 40),
            (19, 2080, 7),
            (40, 96, 70),
            (23, 2, 33),
            // Whole and partial 32-row tile blocks, k in whole and partial tile steps.
            (33, 32, 16),
            (64, 2048, 40),
            (96, 320, 65),
            (70, 6656, 17),
            // Whole blocks over a reduction of three tile passes, the last one partial.
            (64, 4160, 64),
            // Several row blocks of the row-blocked slice kernel, jobs of two slices.
            (200, 1024, 300),
        ] {
            // bf16 activations: the vdpbf16ps GEMV (decode rows) and GEMM paths.
            for act_bf16 in [false, true] {
                let x: Vec<f32> = (0..m * k)
                    .map(|_| rng.random::<f32>() * 2.0 - 1.0)
                    .map(|v| {
                        if act_bf16 {
                            half::bf16::from_f32(v).to_f32()
                        } else {
                            v
                        }
                    })
                    .collect();
                let w: Vec<u16> = (0..n * k)
                    .map(|_| half::bf16::from_f32(rng.random::<f32>() * 2.0 - 1.0).to_bits())
                    .collect();
                let mut want = vec![0f32; m * n];
                matmul_nt_reference(&x, m, k, &w, n, &mut want);
                let mut abs = vec![0f32; m * n];
                let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
                let wa: Vec<u16> = w.iter().map(|b| b & 0x7FFF).collect();
                matmul_nt_reference(&xa, m, k, &wa, n, &mut abs);
                for isa in Isa::tested() {
                    let mut got = vec![f32::NAN; m * n];
                    matmul_nt_with(isa, &x, m, k, &w, n, &mut got);
                    assert_close_sum_order(&got, &want, &abs, k);
                }
                // The vdpbf16ps panel GEMM, and the AMX tiles where the CPU has them.
                #[cfg(target_arch = "x86_64")]
                for isa in Isa::tested().into_iter().filter(|t| *t >= Isa::Avx512Bf16) {
                    if !act_bf16 || m < GEMM_MIN_ROWS {
                        break;
                    }
                    let mut got = vec![f32::NAN; m * n];
                    let expand = |cols: std::ops::Range<usize>, out: &mut [u16]| {
                        out.copy_from_slice(&w[cols.start * k..cols.end * k])
                    };
                    assert!(super::bf16_act_panel_matmul(
                        isa, &x, m, k, n, &mut got, expand
                    ));
                    assert_close_sum_order(&got, &want, &abs, k);
                }
            }
        }
    }

    /// Bits transposed with zero padding; one value that is not bf16 anywhere (first, inside a
    /// later tile, last) refuses the whole matrix.
    #[test]
    fn transposed_bits_pad_with_zeros_and_refuse_a_stray_value() {
        use crate::kernels::test_util::activations;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(t, w) in &[(1, 1), (65, 3), (130, 70), (64, 128), (96, 200)] {
            let x: Vec<f32> = activations(&mut rng, t, w)
                .into_iter()
                .map(crate::kernels::w4::round_bf16)
                .collect();
            let t2 = t.next_multiple_of(32);
            let got = transposed_bits(&x, t, w, t2).unwrap();
            for c in 0..w {
                for r in 0..t2 {
                    let want = if r < t {
                        (x[r * w + c].to_bits() >> 16) as u16
                    } else {
                        0
                    };
                    assert_eq!(got[c * t2 + r], want, "t {t} w {w} at ({c}, {r})");
                }
            }
            for at in [0, (t * w) / 2 + w - 1, t * w - 1] {
                let mut y = x.clone();
                y[at] = f32::from_bits(y[at].to_bits() | 1);
                assert!(
                    transposed_bits(&y, t, w, t2).is_none(),
                    "t {t} w {w} at {at}"
                );
            }
        }
    }

    #[test]
    fn the_bf16_gram_is_the_sum_of_outer_products() {
        use crate::kernels::test_util::activations;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        // The last: several row blocks and groups of two slices, the triangle ending inside them.
        for &(t, k) in &[
            (1, 1),
            (7, 33),
            (64, 32),
            (131, 70),
            (300, 97),
            (40, 130),
            (4100, 330),
            // Whole blocks over a reduction of more than one tile pass (t2 = 4128).
            (4100, 320),
        ] {
            let a = activations(&mut rng, t, k);
            let b = activations(&mut rng, t, k);
            let f32_only = vec![0.1f32 + f32::EPSILON; t * k];
            // Reference sums in f64, checked with the f32 sum-order tolerance.
            let reference = |b: &[f32]| {
                let (mut want, mut abs) = (vec![0f32; k * k], vec![0f32; k * k]);
                for i in 0..k {
                    for j in 0..k {
                        let (mut s, mut sa) = (0f64, 0f64);
                        for r in 0..t {
                            let p = a[r * k + i] as f64 * b[r * k + j] as f64;
                            s += p;
                            sa += p.abs();
                        }
                        want[i * k + j] = s as f32;
                        abs[i * k + j] = sa as f32;
                    }
                }
                (want, abs)
            };
            for isa in Isa::tested() {
                let mut got = vec![f32::NAN; k * k];
                let done = gram_bf16_with(isa, &a, Some(&b), t, k, &mut got);
                assert_eq!(done, cfg!(target_arch = "x86_64") && isa >= Isa::Avx512Bf16);
                if !done {
                    assert!(got.iter().all(|v| v.is_nan()), "untouched when not done");
                    continue;
                }
                let (want, abs) = reference(&b);
                assert_close_sum_order(&got, &want, &abs, t);
                // aᵀa: every entry on and above the diagonal.
                let mut got = vec![f32::NAN; k * k];
                assert!(gram_bf16_with(isa, &a, None, t, k, &mut got));
                let (want, abs) = reference(&a);
                for i in 0..k {
                    for j in i..k {
                        let e = i * k + j;
                        assert_close_sum_order(&got[e..=e], &want[e..=e], &abs[e..=e], t);
                    }
                }
                // A value that is not bf16 anywhere in either operand: nothing done.
                let mut got = vec![f32::NAN; k * k];
                assert!(!gram_bf16_with(isa, &a, Some(&f32_only), t, k, &mut got));
                assert!(!gram_bf16_with(isa, &f32_only, None, t, k, &mut got));
                // One such value alone, first or last, in either operand.
                for at in [0, t * k - 1] {
                    let mut one = a.clone();
                    one[at] = f32::from_bits(one[at].to_bits() | 1);
                    assert!(
                        !gram_bf16_with(isa, &one, None, t, k, &mut got),
                        "{t}×{k} at {at}"
                    );
                    assert!(!gram_bf16_with(isa, &a, Some(&one), t, k, &mut got));
                    assert!(!gram_bf16_with(isa, &one, Some(&b), t, k, &mut got));
                }
                assert!(got.iter().all(|v| v.is_nan()));
            }
        }
    }
}
