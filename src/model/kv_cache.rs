//! Per-layer-type KV caches (docs/MODEL.md §8).
//!
//! Sliding layers keep exactly `sliding_window` entries in a ring buffer,
//! whatever the context; full layers grow up to the requested context.
//! K is stored after RoPE, so ring slots never need re-rotation.
//!
//! Each KV head has its own plane (`[position][head_dim]`): decode attention reads one KV head's
//! keys and values per job, and a plane is one sequential stream where rows of all heads
//! interleaved made it a strided one the hardware prefetchers follow badly.

use crate::checkpoint::{LayerType, SparkConfig};

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("context is full: {needed} tokens requested but the KV cache was sized for {context} (raise {})", crate::setting::Setting::Context)]
    ContextFull { needed: usize, context: usize },
}

/// K and V planes, one per KV head, each `[slot][hd]`.
struct Planes {
    hd: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Planes {
    fn new(heads: usize, hd: usize, slots: usize) -> Self {
        Planes {
            hd,
            k: (0..heads).map(|_| Vec::with_capacity(slots * hd)).collect(),
            v: (0..heads).map(|_| Vec::with_capacity(slots * hd)).collect(),
        }
    }
    /// Write (or, at the end of the planes, append) the row `k`, `v` (`[heads × hd]`) at `slot`.
    fn put(&mut self, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.hd;
        for (h, (kp, vp)) in self.k.iter_mut().zip(&mut self.v).enumerate() {
            let (kr, vr) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            if kp.len() == slot * hd {
                kp.extend_from_slice(kr);
                vp.extend_from_slice(vr);
            } else {
                kp[slot * hd..(slot + 1) * hd].copy_from_slice(kr);
                vp[slot * hd..(slot + 1) * hd].copy_from_slice(vr);
            }
        }
    }
    fn rows(&self) -> usize {
        self.k.first().map_or(0, |p| p.len() / self.hd.max(1))
    }
    fn bytes(&self) -> usize {
        2 * self.k.iter().map(Vec::len).sum::<usize>() * 4
    }
}

/// The last `window` K/V rows; the entry for position p lives in slot p mod window.
pub struct SlidingKvCache {
    window: usize,
    planes: Planes,
    len: usize,
}

/// Every K/V row from position 0.
pub struct FullKvCache {
    planes: Planes,
}

pub enum LayerKvCache {
    Sliding(SlidingKvCache),
    Full(FullKvCache),
}

impl SlidingKvCache {
    /// A ring of `window` rows of `heads` KV heads of `hd` values.
    pub fn new(window: usize, heads: usize, hd: usize) -> Self {
        // The whole ring up front: a bulk append longer than the window starts mid-ring.
        let ring = || (0..heads).map(|_| vec![0.0; window * hd]).collect();
        SlidingKvCache {
            window,
            planes: Planes {
                hd,
                k: ring(),
                v: ring(),
            },
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
        pos % self.window
    }
    fn push(&mut self, k: &[f32], v: &[f32]) {
        self.planes.put(self.len % self.window, k, v);
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
        let (heads, hd) = (cfg.num_key_value_heads, cfg.head_dim);
        match t {
            LayerType::Sliding => {
                LayerKvCache::Sliding(SlidingKvCache::new(cfg.sliding_window, heads, hd))
            }
            LayerType::Full => LayerKvCache::Full(FullKvCache {
                planes: Planes::new(heads, hd, context.min(1 << 16)),
            }),
        }
    }

    fn planes(&self) -> &Planes {
        match self {
            LayerKvCache::Sliding(c) => &c.planes,
            LayerKvCache::Full(c) => &c.planes,
        }
    }

    /// Positions appended so far.
    pub fn len(&self) -> usize {
        match self {
            LayerKvCache::Sliding(c) => c.len,
            LayerKvCache::Full(c) => c.planes.rows(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn slot(&self, pos: usize) -> usize {
        match self {
            LayerKvCache::Sliding(c) => c.slot(pos),
            LayerKvCache::Full(_) => pos,
        }
    }
    /// K row of KV head `head` at absolute position `pos` (`head_dim` values).
    pub fn key(&self, pos: usize, head: usize) -> &[f32] {
        let (p, s) = (self.planes(), self.slot(pos));
        &p.k[head][s * p.hd..(s + 1) * p.hd]
    }
    /// V row of KV head `head` at absolute position `pos` (`head_dim` values).
    pub fn value(&self, pos: usize, head: usize) -> &[f32] {
        let (p, s) = (self.planes(), self.slot(pos));
        &p.v[head][s * p.hd..(s + 1) * p.hd]
    }
    /// Append rows for consecutive positions (`k`, `v` are `[n, kv_heads × head_dim]`).
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        let d = self.planes().hd * self.planes().k.len();
        assert!(
            k.len() == v.len() && k.len().is_multiple_of(d),
            "K/V rows of {d} values"
        );
        match self {
            LayerKvCache::Sliding(c) => {
                let n = k.len() / d;
                // Rows older than the window would be overwritten anyway.
                let skip = n.saturating_sub(c.window);
                c.len += skip;
                for i in skip..n {
                    c.push(&k[i * d..(i + 1) * d], &v[i * d..(i + 1) * d]);
                }
            }
            LayerKvCache::Full(c) => {
                for i in 0..k.len() / d {
                    let slot = c.planes.rows();
                    c.planes
                        .put(slot, &k[i * d..(i + 1) * d], &v[i * d..(i + 1) * d]);
                }
            }
        }
    }
    /// Bytes of K and V held right now (f32).
    pub fn bytes(&self) -> usize {
        self.planes().bytes()
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
        let mut c = LayerKvCache::Sliding(SlidingKvCache::new(4, 2, 1));
        for p in 0..10 {
            c.append(&row(p), &row(p));
        }
        assert_eq!(c.len(), 10);
        for p in 6..10 {
            // Two KV heads of one value each: head 0 holds p, head 1 −p.
            assert_eq!((c.key(p, 0), c.key(p, 1)), (&row(p)[..1], &row(p)[1..]));
            assert_eq!((c.value(p, 0), c.value(p, 1)), (&row(p)[..1], &row(p)[1..]));
        }
        assert_eq!(
            c.bytes(),
            2 * 4 * 2 * 4,
            "memory is window-sized, not context-sized"
        );
    }

    #[test]
    fn bulk_append_longer_than_window_keeps_the_tail() {
        let mut c = LayerKvCache::Sliding(SlidingKvCache::new(3, 2, 1));
        let rows: Vec<f32> = (0..7).flat_map(row).collect();
        c.append(&rows, &rows);
        assert_eq!(c.len(), 7);
        for p in 4..7 {
            assert_eq!((c.key(p, 0), c.key(p, 1)), (&row(p)[..1], &row(p)[1..]));
        }
    }

    #[test]
    #[should_panic(expected = "not in the sliding cache")]
    fn evicted_positions_are_not_served() {
        let mut c = LayerKvCache::Sliding(SlidingKvCache::new(2, 2, 1));
        for p in 0..5 {
            c.append(&row(p), &row(p));
        }
        let _ = c.key(2, 0);
    }

    /// A full cache serves each KV head's row of every position appended, one row or many at a
    /// time, from that head's own plane.
    #[test]
    fn full_cache_serves_each_heads_rows() {
        let json = crate::checkpoint::config::tests::real_1_7b_json().to_string();
        let cfg = crate::checkpoint::SparkConfig::from_json_str(&json, "config.json").unwrap();
        let (heads, hd) = (cfg.num_key_value_heads, cfg.head_dim);
        let d = heads * hd;
        // Sized for 2 positions, grown to 4: each plane reallocates on its own.
        let mut c = LayerKvCache::new(&cfg, LayerType::Full, 2);
        let rows = |p0: usize, n: usize, sign: f32| -> Vec<f32> {
            (p0 * d..(p0 + n) * d).map(|i| sign * i as f32).collect()
        };
        c.append(&rows(0, 3, 1.0), &rows(0, 3, -1.0));
        c.append(&rows(3, 1, 1.0), &rows(3, 1, -1.0));
        assert_eq!(c.len(), 4);
        for p in 0..4 {
            for h in 0..heads {
                let want: Vec<f32> = (p * d + h * hd..p * d + (h + 1) * hd)
                    .map(|i| i as f32)
                    .collect();
                assert_eq!(c.key(p, h), want.as_slice());
                let neg: Vec<f32> = want.iter().map(|x| -x).collect();
                assert_eq!(c.value(p, h), neg.as_slice());
            }
        }
        assert_eq!(c.bytes(), 2 * 4 * d * 4);
    }

    /// A ring of two heads of three values, filled by a bulk append longer than the window and
    /// then row by row across the wrap, serves each head's rows of the last `window` positions.
    #[test]
    fn sliding_planes_wrap_per_head() {
        let (window, heads, hd) = (5, 2, 3);
        let d = heads * hd;
        let rows = |p0: usize, n: usize| -> Vec<f32> {
            (p0 * d..(p0 + n) * d).map(|i| i as f32).collect()
        };
        let mut c = LayerKvCache::Sliding(SlidingKvCache::new(window, heads, hd));
        c.append(&rows(0, 7), &rows(0, 7));
        for p in 7..12 {
            c.append(&rows(p, 1), &rows(p, 1));
            for q in p + 1 - window..=p {
                for h in 0..heads {
                    let want: Vec<f32> = (q * d + h * hd..q * d + (h + 1) * hd)
                        .map(|i| i as f32)
                        .collect();
                    assert_eq!(
                        (c.key(q, h), c.value(q, h)),
                        (want.as_slice(), want.as_slice())
                    );
                }
            }
        }
        assert_eq!((c.len(), c.bytes()), (12, 2 * window * d * 4));
    }
}
