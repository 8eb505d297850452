//! Wall and CPU time of the solver's phases, so a report can say which phase leaves cores idle
//! (CPU seconds ÷ wall seconds ÷ threads).

use std::ops::AddAssign;
use std::time::Instant;

use serde::Serialize;

/// Time spent in one phase: wall seconds and CPU seconds of every thread of the process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Spent {
    pub seconds: f64,
    pub cpu_seconds: f64,
}

impl AddAssign for Spent {
    fn add_assign(&mut self, o: Spent) {
        self.seconds += o.seconds;
        self.cpu_seconds += o.cpu_seconds;
    }
}

impl Spent {
    /// Share of `threads` cores kept busy.
    pub fn utilisation(&self, threads: usize) -> f64 {
        if self.seconds > 0.0 {
            self.cpu_seconds / self.seconds / threads.max(1) as f64
        } else {
            0.0
        }
    }
}

/// CPU seconds used so far by all threads of this process (user + system).
pub fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_PROCESS_CPUTIME_ID exists on every Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc == 0 {
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    } else {
        0.0
    }
}

/// A running stopwatch of wall and CPU time.
#[derive(Clone, Copy)]
pub struct Clock {
    wall: Instant,
    cpu: f64,
}

impl Clock {
    pub fn start() -> Clock {
        Clock {
            wall: Instant::now(),
            cpu: process_cpu_seconds(),
        }
    }

    pub fn elapsed(&self) -> Spent {
        Spent {
            seconds: self.wall.elapsed().as_secs_f64(),
            cpu_seconds: process_cpu_seconds() - self.cpu,
        }
    }

    /// The time since the start or the last lap, restarting the clock.
    pub fn lap(&mut self) -> Spent {
        let now = Clock::start();
        let s = Spent {
            seconds: (now.wall - self.wall).as_secs_f64(),
            cpu_seconds: now.cpu - self.cpu,
        };
        *self = now;
        s
    }
}

/// Run `f`, adding its time to `into`.
pub fn timed<T>(into: &mut Spent, f: impl FnOnce() -> T) -> T {
    let c = Clock::start();
    let out = f();
    *into += c.elapsed();
    out
}

/// Where one GPTQ solve of a linear spent its time.
#[derive(Debug, Clone, Copy, Default)]
pub struct SolveTimes {
    /// Choosing each group's scale.
    pub search: Spent,
    /// The column loop with its in-block error feedback.
    pub columns: Spent,
    /// Lazy batch updates of the columns after each block.
    pub flush: Spent,
}

impl AddAssign for SolveTimes {
    fn add_assign(&mut self, o: SolveTimes) {
        self.search += o.search;
        self.columns += o.columns;
        self.flush += o.flush;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thread_cpu_seconds() -> f64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    }

    #[test]
    fn cpu_time_counts_every_thread() {
        // Fixed work on two threads, each measured with its own thread clock: the process clock
        // must cover both (other tests of this process may add more, never less).
        let work = || {
            let t0 = thread_cpu_seconds();
            let mut x = 0u64;
            for i in 0..30_000_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
            thread_cpu_seconds() - t0
        };
        let c = Clock::start();
        let (a, b) = std::thread::scope(|s| {
            let h = s.spawn(work);
            let b = work();
            (h.join().unwrap(), b)
        });
        let e = c.elapsed();
        assert!(a > 0.0 && b > 0.0);
        assert!(
            e.cpu_seconds >= (a + b) * 0.99,
            "{e:?} vs threads {a} + {b}"
        );
        assert!(e.seconds > 0.0);
    }
}
