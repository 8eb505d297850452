//! Threading for 1–2 cores: one fan-out per linear call over ranges of
//! output columns, or none at all for small ops; during a decode step, the
//! fan-outs go to a [team](with_team) whose helpers wait spinning, not asleep.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;

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
    for_each(parts, |p| f(units * p / parts..units * (p + 1) / parts));
}

/// `f(i)` for every `i` in `0..n`, spread over the threads: by this thread's [team](with_team)
/// where it has one, else by rayon.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    match Team::current() {
        Some(team) => team.run(n, &f),
        None => (0..n).into_par_iter().for_each(&f),
    }
}

/// Run `f` (one step of a forward with few rows) on a pool worker, with the other workers
/// joined in a team for its fan-outs: between fan-outs they spin (then yield), where idle
/// rayon workers fall asleep after some 30 µs and take 20–100 µs to wake on the 2-vCPU VMs of
/// docs/BENCHMARKS.md ("Decode fan-outs on a team"), as long as a small linear itself. A decode
/// step has about eight fan-outs per layer. The helpers spin only while `f` runs; rayon work
/// that `f` starts itself runs on its own thread meanwhile.
pub fn with_team<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let threads = rayon::current_num_threads();
    if threads <= 1 || IN_TEAM.with(Cell::get) {
        return rayon::scope(|_| f());
    }
    let team = Team::default();
    rayon::scope(|s| {
        for _ in 1..threads {
            s.spawn(|_| team.help());
        }
        // Closes the team also when `f` panics, so that the helpers return and the scope ends.
        struct Close<'a>(&'a Team);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(std::ptr::null()));
                IN_TEAM.with(|t| t.set(false));
                self.0.closed.store(true, Ordering::Release);
            }
        }
        let _close = Close(&team);
        IN_TEAM.with(|t| t.set(true));
        CURRENT.with(|c| c.set(&team));
        f()
    })
}

thread_local! {
    /// The team whose owner this thread is, while it is not running one of the team's jobs.
    static CURRENT: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// This thread owns a team or helps one. A helper job that such a thread picks up (rayon
    /// runs queued jobs while a thread waits) returns at once: it would spin inside a frame
    /// its own team waits on, and two teams doing that to each other would never end.
    static IN_TEAM: Cell<bool> = const { Cell::new(false) };
}

/// Spins of an idle helper before it yields the core between checks.
const HELPER_SPINS: u32 = 1 << 12;

/// Threads that share one forward's fan-outs. The owner publishes a job (a closure and a part
/// count) under a new epoch; every member claims parts with a compare-and-swap on one word
/// (epoch, parts, next part), so a stale claim of an earlier job cannot succeed, and the owner
/// waits until all parts are done before the closure goes out of scope.
#[derive(Default)]
struct Team {
    /// epoch << 32 | parts << 16 | next part.
    state: AtomicU64,
    /// Parts of the current job finished.
    done: AtomicUsize,
    /// The current job; written only by the owner while no part is outstanding.
    job: UnsafeCell<Option<*const (dyn Fn(usize) + Sync)>>,
    closed: AtomicBool,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `job` is written by the owner only before it publishes an epoch and after all parts of
// the previous one are done, and read by a member only after it claimed a part of the current
// epoch (which the owner waits for); every other field is atomic or locked.
unsafe impl Sync for Team {}

const PART_BITS: u32 = 16;
const PART_MASK: u64 = (1 << PART_BITS) - 1;

impl Team {
    fn current() -> Option<&'static Team> {
        let p = CURRENT.with(|c| c.get());
        // SAFETY: set only by `with_team` for the team's lifetime, which outlives every call
        // made from `f` on this thread; cleared before the team is dropped.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// Run `f` over `0..parts` with the team; returns when every part is done.
    fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        if parts == 0 {
            return;
        }
        assert!(parts as u64 <= PART_MASK, "{parts} parts in one fan-out");
        // SAFETY: the lifetime is erased only for the members' reads, which all happen before
        // `done` reaches `parts`, which this function waits for before it returns.
        let job: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
        // SAFETY: no part is outstanding (the previous `run` waited for all of them).
        unsafe { *self.job.get() = Some(job) };
        self.done.store(0, Ordering::Relaxed);
        let epoch = (self.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xFFFF_FFFF;
        self.state
            .store(epoch << 32 | (parts as u64) << PART_BITS, Ordering::Release);
        // Nested fan-outs inside a part run on rayon, not on this (busy) team.
        CURRENT.with(|c| c.set(std::ptr::null()));
        while self.work_once() {}
        CURRENT.with(|c| c.set(self));
        while self.done.load(Ordering::Acquire) < parts {
            std::hint::spin_loop();
        }
        if let Some(p) = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            resume_unwind(p);
        }
    }

    /// Claim and run one part of the current job; false when none is left.
    fn work_once(&self) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (parts, next) = ((s >> PART_BITS) & PART_MASK, s & PART_MASK);
            if next >= parts {
                return false;
            }
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    // SAFETY: a part of the current epoch is claimed, so its job is published
                    // and stays alive until this part is counted done.
                    let job = unsafe { (*self.job.get()).expect("a published job") };
                    // SAFETY: as above.
                    let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(next as usize) }));
                    if let Err(p) = r {
                        *self.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                    }
                    self.done.fetch_add(1, Ordering::Release);
                    return true;
                }
                Err(now) => s = now,
            }
        }
    }

    /// A helper's loop: take parts until the owner closes the team.
    fn help(&self) {
        if IN_TEAM.with(|t| t.replace(true)) {
            return;
        }
        let mut idle = 0u32;
        while !self.closed.load(Ordering::Acquire) {
            if self.work_once() {
                idle = 0;
            } else if idle < HELPER_SPINS {
                idle += 1;
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        IN_TEAM.with(|t| t.set(false));
    }
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

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    /// Many fan-outs in a row, of changing sizes, each part run exactly once and every job
    /// finished when `for_each` returns: a claim that outlived its job would land in a later
    /// job's counts.
    #[test]
    fn a_team_runs_every_part_of_every_job_once() {
        for threads in [2, 3] {
            pool(threads).install(|| {
                with_team(|| {
                    assert!(Team::current().is_some());
                    for job in 0..2000usize {
                        let parts = 1 + job % 37;
                        let hits: Vec<AtomicUsize> =
                            (0..parts).map(|_| AtomicUsize::new(0)).collect();
                        for_each(parts, |i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(
                            hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                            "job {job}"
                        );
                    }
                });
                assert!(Team::current().is_none());
            });
        }
    }

    #[test]
    fn a_team_shares_parts_between_threads() {
        pool(2).install(|| {
            with_team(|| {
                let ids = Mutex::new(std::collections::HashSet::new());
                // Parts long enough that the helper, spinning, takes some.
                for _ in 0..50 {
                    for_each(8, |_| {
                        ids.lock().unwrap().insert(thread::current().id());
                        let t = std::time::Instant::now();
                        while t.elapsed() < std::time::Duration::from_micros(200) {}
                    });
                }
                assert_eq!(ids.lock().unwrap().len(), 2);
            })
        });
    }

    /// Rayon work started inside a step or inside a part, and ranges, still complete.
    #[test]
    fn nested_work_and_ranges_complete_under_a_team() {
        pool(2).install(|| {
            let total = with_team(|| {
                let mut total = 0u64;
                for _ in 0..100 {
                    total += (0..1000u64).into_par_iter().sum::<u64>();
                    let sums: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
                    for_each(4, |i| {
                        let s = (0..1000u64)
                            .into_par_iter()
                            .map(|v| v * i as u64)
                            .sum::<u64>();
                        sums[i].store(s, Ordering::Relaxed);
                    });
                    total += sums.iter().map(|s| s.load(Ordering::Relaxed)).sum::<u64>();
                    let covered = AtomicUsize::new(0);
                    for_ranges(1000, 1 << 20, |r| {
                        covered.fetch_add(r.len(), Ordering::Relaxed);
                    });
                    assert_eq!(covered.load(Ordering::Relaxed), 1000);
                }
                total
            });
            assert_eq!(total, 100 * (499_500 + 499_500 * 6));
        });
    }

    /// A panicking part reaches the caller after every other part ended, and the team stops.
    #[test]
    fn a_panicking_part_reaches_the_caller() {
        pool(2).install(|| {
            let ran = AtomicUsize::new(0);
            let r = catch_unwind(AssertUnwindSafe(|| {
                with_team(|| {
                    for_each(16, |i| {
                        ran.fetch_add(1, Ordering::Relaxed);
                        assert_ne!(i, 5, "part five");
                    })
                })
            }));
            assert!(r.is_err());
            assert_eq!(ran.load(Ordering::Relaxed), 16);
            // The pool is free again.
            assert_eq!((0..100u32).into_par_iter().sum::<u32>(), 4950);
        });
    }

    /// Two teams on one pool at once (two callers' steps) both finish.
    #[test]
    fn concurrent_teams_finish() {
        let p = pool(2);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    p.install(|| {
                        with_team(|| {
                            for _ in 0..500 {
                                let n = AtomicUsize::new(0);
                                for_each(6, |_| {
                                    n.fetch_add(
                                        (0..64u32).into_par_iter().count(),
                                        Ordering::Relaxed,
                                    );
                                });
                                assert_eq!(n.load(Ordering::Relaxed), 6 * 64);
                            }
                        })
                    })
                });
            }
        });
    }
}
