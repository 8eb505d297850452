//! Per-layer-type KV caches (docs/MODEL.md §8).
//!
//! Sliding layers keep exactly `sliding_window` entries in a ring buffer,
//! whatever the context; full layers grow up to the requested context.
//! K is stored after RoPE, so ring slots never need re-rotation.

use crate::checkpoint::{LayerType, SparkConfig};

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("context is full: {needed} tokens requested but the KV cache was sized for {context} (raise {})", crate::setting::Setting::Context)]
    ContextFull { needed: usize, context: usize },
}

/// The last `window` K/V rows; the entry for position p lives in slot p mod window.
pub struct SlidingKvCache {
    window: usize,
    kv_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

/// Every K/V row from position 0.
pub struct FullKvCache {
    kv_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

pub enum LayerKvCache {
    Sliding(SlidingKvCache),
    Full(FullKvCache),
}

impl SlidingKvCache {
    pub fn new(window: usize, kv_dim: usize) -> Self {
        SlidingKvCache {
            window,
            kv_dim,
            k: vec![0.0; window * kv_dim],
            v: vec![0.0; window * kv_dim],
            len: 0,
        }
    }
    fn slot(&self, pos: usize) -> usize {
        assert!(
            pos < self.len && pos + self.window >= self.len,
            "position {pos} is not in the sliding cache (holds {}..{})",
            self.len.saturating_sub(self.window),
            self.len
        );
        (pos % self.window) * self.kv_dim
    }
    fn push(&mut self, k: &[f32], v: &[f32]) {
        let s = (self.len % self.window) * self.kv_dim;
        self.k[s..s + self.kv_dim].copy_from_slice(k);
        self.v[s..s + self.kv_dim].copy_from_slice(v);
        self.len += 1;
    }
    /// Number of rows actually held (≤ window).
    pub fn held(&self) -> usize {
        self.len.min(self.window)
    }
}

impl LayerKvCache {
    /// The cache a layer of type `t` needs for up to `context` tokens.
    pub fn new(cfg: &SparkConfig, t: LayerType, context: usize) -> Self {
        let kv_dim = cfg.kv_dim();
        match t {
            LayerType::Sliding => {
                LayerKvCache::Sliding(SlidingKvCache::new(cfg.sliding_window, kv_dim))
            }
            LayerType::Full => LayerKvCache::Full(FullKvCache {
                kv_dim,
                k: Vec::with_capacity(context.min(1 << 16) * kv_dim),
                v: Vec::with_capacity(context.min(1 << 16) * kv_dim),
            }),
        }
    }

    /// Positions appended so far.
    pub fn len(&self) -> usize {
        match self {
            LayerKvCache::Sliding(c) => c.len,
            LayerKvCache::Full(c) => c.k.len() / c.kv_dim.max(1),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// K row (all KV heads) of absolute position `pos`.
    pub fn key(&self, pos: usize) -> &[f32] {
        match self {
            LayerKvCache::Sliding(c) => {
                let s = c.slot(pos);
                &c.k[s..s + c.kv_dim]
            }
            LayerKvCache::Full(c) => &c.k[pos * c.kv_dim..(pos + 1) * c.kv_dim],
        }
    }
    pub fn value(&self, pos: usize) -> &[f32] {
        match self {
            LayerKvCache::Sliding(c) => {
                let s = c.slot(pos);
                &c.v[s..s + c.kv_dim]
            }
            LayerKvCache::Full(c) => &c.v[pos * c.kv_dim..(pos + 1) * c.kv_dim],
        }
    }
    /// Append rows for consecutive positions (`k`, `v` are `[n, kv_dim]`).
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        match self {
            LayerKvCache::Sliding(c) => {
                let d = c.kv_dim;
                let n = k.len() / d;
                // Rows older than the window would be overwritten anyway.
                let skip = n.saturating_sub(c.window);
                c.len += skip;
                for i in skip..n {
                    c.push(&k[i * d..(i + 1) * d], &v[i * d..(i + 1) * d]);
                }
            }
            LayerKvCache::Full(c) => {
                c.k.extend_from_slice(k);
                c.v.extend_from_slice(v);
            }
        }
    }
    /// Bytes of K and V held right now (f32).
    pub fn bytes(&self) -> usize {
        match self {
            LayerKvCache::Sliding(c) => 2 * c.k.len() * 4,
            LayerKvCache::Full(c) => 2 * c.k.len() * 4,
        }
    }
}

/// The whole model's cache: one [`LayerKvCache`] per layer, sized by layer type.
pub struct KvCache {
    layers: Vec<LayerKvCache>,
    context: usize,
    pos: usize,
}

impl KvCache {
    /// `context` bounds the total number of tokens (prompt + generated).
    pub fn new(cfg: &SparkConfig, context: usize) -> Self {
        let layers = cfg
            .layer_types
            .iter()
            .map(|&t| LayerKvCache::new(cfg, t, context))
            .collect();
        KvCache {
            layers,
            context,
            pos: 0,
        }
    }
    /// Next absolute position (= tokens seen).
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn context(&self) -> usize {
        self.context
    }
    pub fn layer(&self, i: usize) -> &LayerKvCache {
        &self.layers[i]
    }
    pub fn layer_mut(&mut self, i: usize) -> &mut LayerKvCache {
        &mut self.layers[i]
    }
    pub(crate) fn reserve(&self, n: usize) -> Result<(), CacheError> {
        if self.pos + n > self.context {
            return Err(CacheError::ContextFull {
                needed: self.pos + n,
                context: self.context,
            });
        }
        Ok(())
    }
    pub(crate) fn advance(&mut self, n: usize) {
        self.pos += n;
    }
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(p: usize) -> Vec<f32> {
        vec![p as f32, -(p as f32)]
    }

    #[test]
    fn sliding_cache_keeps_exactly_the_window() {
        let mut c = LayerKvCache::Sliding(SlidingKvCache::new(4, 2));
        for p in 0..10 {
            c.append(&row(p), &row(p));
        }
        assert_eq!(c.len(), 10);
        for p in 6..10 {
            assert_eq!(c.key(p), row(p).as_slice());
            assert_eq!(c.value(p), row(p).as_slice());
        }
        assert_eq!(
            c.bytes(),
            2 * 4 * 2 * 4,
            "memory is window-sized, not context-sized"
        );
    }

    #[test]
    fn bulk_append_longer_than_window_keeps_the_tail() {
        let mut c = LayerKvCache::Sliding(SlidingKvCache::new(3, 2));
        let rows: Vec<f32> = (0..7).flat_map(row).collect();
        c.append(&rows, &rows);
        assert_eq!(c.len(), 7);
        for p in 4..7 {
            assert_eq!(c.key(p), row(p).as_slice());
        }
    }

    #[test]
    #[should_panic(expected = "not in the sliding cache")]
    fn evicted_positions_are_not_served() {
        let mut c = LayerKvCache::Sliding(SlidingKvCache::new(2, 2));
        for p in 0..5 {
            c.append(&row(p), &row(p));
        }
        let _ = c.key(2);
    }
}
