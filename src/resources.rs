//! Sizing what user input asks for before allocating it: a request the machine cannot hold is
//! refused with both figures instead of ending in an allocation abort (SIGABRT, no message).

use crate::checkpoint::{LayerType, SparkConfig};
use crate::setting::Setting;

#[derive(Debug, thiserror::Error)]
pub enum ResourceError {
    #[error(
        "{what} needs {need} of memory; this machine has {have} available — lower {setting}",
        need = human(*need), have = human(*have)
    )]
    Memory {
        what: String,
        need: u128,
        have: u128,
        setting: Setting,
    },
}

/// While alive, large freed blocks stay in the heap for reuse. glibc serves blocks above its mmap
/// threshold (at most 32 MB) with fresh pages, zeroed by the kernel on first touch and unmapped
/// again when freed: where every step allocates its outputs anew (tuning's tensor ops, a
/// prefill's per-layer activations) page faults, zeroing and TLB shootdowns took a fifth of
/// block tuning at the 1.7B shape and 13 % of a 512-token prefill (docs/BENCHMARKS.md). The
/// last guard to drop brings the defaults back and trims the heap. Process-wide, counted: guards
/// may nest and live on several threads.
pub struct HeapReuse(());

static HEAP_REUSE: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

impl HeapReuse {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        let mut n = HEAP_REUSE.lock().unwrap_or_else(|e| e.into_inner());
        if *n == 0 {
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: mallopt only changes allocator parameters; these values are valid.
            unsafe {
                libc::mallopt(libc::M_MMAP_MAX, 0);
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
            }
        }
        *n += 1;
        HeapReuse(())
    }
}

impl Drop for HeapReuse {
    fn drop(&mut self) {
        let mut n = HEAP_REUSE.lock().unwrap_or_else(|e| e.into_inner());
        *n -= 1;
        if *n == 0 {
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: glibc's defaults (65536 mappings, 128 KiB), then return free memory.
            unsafe {
                libc::mallopt(libc::M_MMAP_MAX, 65536);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 128 * 1024);
                libc::malloc_trim(0);
            }
        }
    }
}

thread_local! {
    static SPARE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A buffer of `len` values for an output that its kernel writes in full: the one this thread
/// last handed to [`keep_spare`] when it has that length (its old values, not zeros), a new one
/// otherwise. A prefill's MLP asks for the same 13.6 MB (512 rows of the 1.7B) in every layer;
/// zeroing a fresh one (calloc's `memset`, one thread) cost 9 % of the 2-thread gate/up stage.
pub fn spare(len: usize) -> Vec<f32> {
    let v = SPARE.with(|s| std::mem::take(&mut *s.borrow_mut()));
    if v.len() == len {
        v
    } else {
        vec![0.0; len]
    }
}

/// Keep `v` for the next [`spare`] of its length on this thread (replacing the one kept).
pub fn keep_spare(v: Vec<f32>) {
    SPARE.with(|s| *s.borrow_mut() = v);
}

/// Bytes as a short figure ("512 GB", "3.2 MB").
pub fn human(b: u128) -> String {
    let b = b as f64;
    match b {
        _ if b >= 1e11 => format!("{:.0} GB", b / 1e9),
        _ if b >= 1e9 => format!("{:.1} GB", b / 1e9),
        _ if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        _ => format!("{b:.0} B"),
    }
}

/// What the kernel says can be allocated without swapping (`MemAvailable`), or `None` where
/// there is no /proc/meminfo (then nothing is refused).
pub fn available_memory() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The memory a request is checked against: `SPARK_MEM_AVAILABLE` (bytes) when set, so tests can
/// exercise refusals on any machine, else [`available_memory`].
pub fn memory_budget() -> Option<u128> {
    std::env::var("SPARK_MEM_AVAILABLE")
        .ok()
        .and_then(|v| v.parse().ok())
        .or_else(available_memory)
}

/// Free bytes for an unprivileged writer on the filesystem that holds `path` or, where it does
/// not exist yet, its nearest existing ancestor: `SPARK_DISK_AVAILABLE` (bytes) when set, so tests
/// can exercise refusals on any machine, else statvfs's `f_bavail · f_frsize`.
pub fn disk_budget(path: &std::path::Path) -> Option<u128> {
    if let Some(v) = std::env::var("SPARK_DISK_AVAILABLE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Some(v);
    }
    let dir = path.ancestors().find(|p| p.exists())?;
    let dir = if dir.as_os_str().is_empty() {
        std::path::Path::new(".")
    } else {
        dir
    };
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u128 * st.f_frsize as u128)
}

/// Refuse `need` bytes for `what` when they exceed [`memory_budget`].
pub fn check_fits(what: &str, need: u128, setting: Setting) -> Result<(), ResourceError> {
    match memory_budget() {
        Some(have) if need > have => Err(ResourceError::Memory {
            what: what.into(),
            need,
            have,
            setting,
        }),
        _ => Ok(()),
    }
}

/// This process's private (anonymous) resident memory now: `RssAnon` of /proc/self/status.
/// Unlike the whole RSS it leaves out the checkpoint pages mapped from disk, which the kernel
/// can drop and reread at any time.
pub fn private_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The peak of [`private_bytes`] while it runs, sampled every 20 ms by a thread (the kernel
/// keeps a high-water mark only for the whole RSS, `VmHWM`).
pub struct PrivatePeak {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PrivatePeak {
    pub fn start() -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(private_bytes().unwrap_or(0)));
        let (s, p) = (stop.clone(), peak.clone());
        let thread = std::thread::Builder::new()
            .name("private-peak".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    if let Some(b) = private_bytes() {
                        p.fetch_max(b, Ordering::Relaxed);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            })
            .ok();
        PrivatePeak { stop, peak, thread }
    }

    /// The highest private memory seen so far (`None` without /proc).
    pub fn peak(&self) -> Option<u64> {
        use std::sync::atomic::Ordering;
        if let Some(b) = private_bytes() {
            self.peak.fetch_max(b, Ordering::Relaxed);
        }
        Some(self.peak.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }
}

impl Drop for PrivatePeak {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// K and V the engine keeps for `context` positions (sliding layers hold at most a window),
/// `value_bytes` per stored value (4 for f32 caches, 2 for bf16: `KvPrecision::bytes`).
pub fn kv_cache_bytes(cfg: &SparkConfig, context: usize, value_bytes: usize) -> u128 {
    let per_pos = 2 * cfg.kv_dim() as u128 * value_bytes as u128;
    let sliding = cfg.sliding_window.min(context) as u128;
    cfg.layer_types
        .iter()
        .map(|t| match t {
            LayerType::Sliding => sliding * per_pos,
            LayerType::Full => context as u128 * per_pos,
        })
        .sum()
}

/// Peak bytes of one forward over `tokens` positions besides the KV cache (the engine's, or
/// [`kv_cache_bytes`]): the f32 activations a layer holds at once (residual, normed input,
/// q/k/v/gate, attention output, the MLP's gate/up/act) and the logits (`all_logits`: every
/// position, else the last).
pub fn forward_bytes(cfg: &SparkConfig, tokens: usize, all_logits: bool) -> u128 {
    let row = (3 * cfg.hidden_size
        + 3 * cfg.q_dim()
        + 2 * cfg.kv_dim()
        + cfg.num_attention_heads
        + 3 * cfg.intermediate_size) as u128
        * 4;
    let logit_rows = if all_logits { tokens } else { 1 } as u128;
    tokens as u128 * (row + 4) + logit_rows * cfg.vocab_size as u128 * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_buffer_comes_back_only_at_its_length() {
        let mut v = spare(1000);
        assert!(v.len() == 1000 && v.iter().all(|x| *x == 0.0));
        v.fill(7.0);
        let at = v.as_ptr();
        keep_spare(v);
        let w = spare(1000);
        assert_eq!((w.as_ptr(), w[999]), (at, 7.0));
        keep_spare(w);
        let other = spare(999);
        assert!(other.len() == 999 && other.iter().all(|x| *x == 0.0));
        // Taken once: the next ask of that length gets a new buffer.
        assert!(spare(1000).iter().all(|x| *x == 0.0));
    }

    #[test]
    fn private_peak_sees_an_allocation_that_is_gone() {
        let p = PrivatePeak::start();
        let during = {
            // 256 MB touched page by page, held past a few samples, then freed (a block this
            // large is its own mapping, returned to the kernel on free).
            let mut v = vec![0u8; 256 << 20];
            for i in (0..v.len()).step_by(4096) {
                v[i] = 1;
            }
            let during = private_bytes().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(100));
            std::hint::black_box(&v);
            during
        };
        // The sampler saw the freed block (16 MB of slack for other tests of this process).
        let peak = p.peak().unwrap();
        assert!(peak + (16 << 20) >= during, "peak {peak} during {during}");
    }

    #[test]
    fn refuses_with_both_figures_and_the_setting() {
        let e = check_fits("x", u128::MAX, Setting::Context).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("needs") && s.contains("available") && s.contains("context"),
            "{s}"
        );
        assert!(check_fits("x", 1, Setting::Context).is_ok());
        assert_eq!(human(512_000_000_000), "512 GB");
    }
}
