//! Threading for 1–2 cores: one fan-out per linear call over ranges of
//! output columns, or none at all for small ops.

use std::ops::Range;

use rayon::prelude::*;

/// Below this many weights an op runs on the calling thread: waking a rayon
/// worker costs a few microseconds, about what streaming 2^18 4-bit weights
/// takes (e.g. the 8 × 2048 head-gate `g_proj` is 2^14).
const MIN_PARALLEL_WEIGHTS: usize = 1 << 18;

/// Ranges per thread: a few, so a thread slowed by another process on the
/// same core hands work to the other one.
const RANGES_PER_THREAD: usize = 4;

/// Run `f` over `0..units` (columns or column tiles) split into contiguous
/// ranges; `weights` is the size of the whole op.
pub fn for_ranges(units: usize, weights: usize, f: impl Fn(Range<usize>) + Sync) {
    let threads = rayon::current_num_threads();
    if threads <= 1 || weights < MIN_PARALLEL_WEIGHTS || units <= 1 {
        f(0..units);
        return;
    }
    let parts = (threads * RANGES_PER_THREAD).min(units);
    (0..parts).into_par_iter().for_each(|p| {
        f(units * p / parts..units * (p + 1) / parts);
    });
}

/// A `[rows, cols]` row-major output that jobs write in disjoint column
/// ranges. Rust slices cannot express "these columns of every row", so jobs
/// get this pointer and write only their own columns.
#[derive(Clone, Copy)]
pub struct ColumnsOut {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
}

// SAFETY: the pointer is only written through `row_mut` with column ranges
// that the callers of `for_ranges` keep disjoint between jobs.
unsafe impl Send for ColumnsOut {}
unsafe impl Sync for ColumnsOut {}

impl ColumnsOut {
    pub fn new(y: &mut [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(y.len(), rows * cols);
        ColumnsOut {
            ptr: y.as_mut_ptr(),
            rows,
            cols,
        }
    }

    /// Columns `c` of row `r`.
    ///
    /// # Safety
    /// No other live reference may cover these elements: concurrent jobs
    /// must use disjoint column ranges.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn row_mut(&self, r: usize, c: Range<usize>) -> &mut [f32] {
        assert!(r < self.rows && c.start <= c.end && c.end <= self.cols);
        // SAFETY: in bounds by the assert; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r * self.cols + c.start), c.len()) }
    }

    /// Raw pointer to element (r, c), for kernels that store through it.
    ///
    /// # Safety
    /// As for [`row_mut`](Self::row_mut): only this job's columns may be written.
    pub unsafe fn ptr_at(&self, r: usize, c: usize) -> *mut f32 {
        assert!(r < self.rows && c <= self.cols);
        // SAFETY: in bounds by the assert.
        unsafe { self.ptr.add(r * self.cols + c) }
    }
}

/// Weight rows (output columns) a job handles together, so that all
/// activation rows reuse them from L2: 8 × 6656 × 2 bytes ≈ 104 KiB.
const COLS_BLOCK: usize = 8;

/// The tiling the row-dot kernels share: jobs over blocks of the `n` output
/// columns; within a job, up to 4 rows take the whole column range in one
/// call (its streams far apart), more rows go by column blocks that stay in
/// cache across chunks of 4 rows. `f(rows, cols)` computes one tile.
pub fn for_tiles(m: usize, n: usize, k: usize, f: impl Fn(Range<usize>, Range<usize>) + Sync) {
    for_ranges(n.div_ceil(COLS_BLOCK), n * k, |blocks| {
        let cols = blocks.start * COLS_BLOCK..(blocks.end * COLS_BLOCK).min(n);
        let step = if m <= 4 {
            cols.len().max(1)
        } else {
            COLS_BLOCK
        };
        for c0 in cols.clone().step_by(step) {
            let cb = c0..(c0 + step).min(cols.end);
            for r0 in (0..m).step_by(4) {
                f(r0..(r0 + 4).min(m), cb.clone());
            }
        }
    });
}
