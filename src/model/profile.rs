//! Optional per-stage wall-clock timers for the forward pass (`spark-tool
//! bench --stages`). Off by default; when off each stage pays one relaxed
//! atomic load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The stages of a forward call, in execution order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Embed,
    Norms,
    QkvgProj,
    Attention,
    OutProj,
    GateUpProj,
    GeluMul,
    DownProj,
    Head,
}

impl Stage {
    pub const ALL: [Stage; 9] = [
        Stage::Embed,
        Stage::Norms,
        Stage::QkvgProj,
        Stage::Attention,
        Stage::OutProj,
        Stage::GateUpProj,
        Stage::GeluMul,
        Stage::DownProj,
        Stage::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Embed => "embedding lookup",
            Stage::Norms => "RMSNorms + residual adds",
            Stage::QkvgProj => "q/k/v/g projections",
            Stage::Attention => "RoPE, attention, head gate",
            Stage::OutProj => "out_proj",
            Stage::GateUpProj => "gate/up projections",
            Stage::GeluMul => "GELU · up",
            Stage::DownProj => "down_proj",
            Stage::Head => "final norm + head",
        }
    }
}

#[derive(Default)]
pub struct StageTimers {
    on: AtomicBool,
    nanos: [AtomicU64; 9],
}

impl StageTimers {
    pub fn set_enabled(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// A start time when timing is on.
    #[inline]
    pub fn start(&self) -> Option<Instant> {
        self.on.load(Ordering::Relaxed).then(Instant::now)
    }

    #[inline]
    pub fn stop(&self, stage: Stage, t: Option<Instant>) {
        if let Some(t) = t {
            // Discriminants follow the order of `Stage::ALL`.
            self.nanos[stage as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// Run `f`, its wall time added to `stage` when timing is on.
    #[inline]
    pub fn time<T>(&self, stage: Stage, f: impl FnOnce() -> T) -> T {
        let t = self.start();
        let out = f();
        self.stop(stage, t);
        out
    }

    /// Milliseconds per stage since the last call, then reset.
    pub fn take(&self) -> Vec<(Stage, f64)> {
        Stage::ALL
            .iter()
            .zip(&self.nanos)
            .map(|(s, n)| (*s, n.swap(0, Ordering::Relaxed) as f64 / 1e6))
            .collect()
    }
}
