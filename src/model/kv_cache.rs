//! Per-layer-type KV caches (docs/MODEL.md §8).
//!
//! Sliding layers keep exactly `sliding_window` entries in a ring buffer,
//! whatever the context; full layers grow up to the requested context.
//! K is stored after RoPE, so ring slots never need re-rotation.
//!
//! Each KV head has its own plane (`[position][head_dim]`): decode attention reads one KV head's
//! keys and values per job, and a plane is one sequential stream where rows of all heads
//! interleaved made it a strided one the hardware prefetchers follow badly.
//!
//! A model with bf16 activations (every GPTQ artifact) rounds its rotated keys and its values
//! to bf16 before they are cached, so its cache stores them as bf16 ([`KvPrecision::Bf16`]):
//! the same values in half the bytes, and half the reads for decode attention.

use half::bf16;

use crate::checkpoint::{LayerType, SparkConfig};
use crate::kernels::convert::KvElem;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("context is full: {needed} tokens requested but the KV cache was sized for {context} (raise {})", crate::setting::Setting::Context)]
    ContextFull { needed: usize, context: usize },
}

/// How a cache stores its keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPrecision {
    F32,
    /// bf16: for models whose keys and values are bf16 values already (exact).
    Bf16,
}

impl KvPrecision {
    /// The cache of a forward whose activations are bf16 values (keys and values rounded to
    /// bf16 before they are cached) or not.
    pub fn for_activations(bf16: bool) -> Self {
        match bf16 {
            true => KvPrecision::Bf16,
            false => KvPrecision::F32,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            KvPrecision::F32 => 4,
            KvPrecision::Bf16 => 2,
        }
    }
}

/// K and V planes, one per KV head, each `[slot][hd]`.
struct Planes<T> {
    hd: usize,
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
}

impl<T: KvElem> Planes<T> {
    fn new(heads: usize, hd: usize, slots: usize) -> Self {
        Planes {
            hd,
            k: (0..heads).map(|_| Vec::with_capacity(slots * hd)).collect(),
            v: (0..heads).map(|_| Vec::with_capacity(slots * hd)).collect(),
        }
    }
    /// A ring of `slots` zero rows.
    fn ring(heads: usize, hd: usize, slots: usize) -> Self {
        let ring = || (0..heads).map(|_| vec![T::default(); slots * hd]).collect();
        Planes {
            hd,
            k: ring(),
            v: ring(),
        }
    }
    /// Write (or, at the end of the planes, append) the row `k`, `v` (`[heads × hd]`) at `slot`.
    fn put<S: KvElem>(&mut self, slot: usize, k: &[S], v: &[S]) {
        let hd = self.hd;
        for (h, (kp, vp)) in self.k.iter_mut().zip(&mut self.v).enumerate() {
            let (kr, vr) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            if kp.len() == slot * hd {
                kp.extend(kr.iter().map(|&x| T::store(x)));
                vp.extend(vr.iter().map(|&x| T::store(x)));
            } else {
                let (ko, vo) = (
                    &mut kp[slot * hd..(slot + 1) * hd],
                    &mut vp[slot * hd..(slot + 1) * hd],
                );
                ko.iter_mut().zip(kr).for_each(|(o, &x)| *o = T::store(x));
                vo.iter_mut().zip(vr).for_each(|(o, &x)| *o = T::store(x));
            }
        }
    }
    fn rows(&self) -> usize {
        self.k.first().map_or(0, |p| p.len() / self.hd.max(1))
    }
    fn bytes(&self) -> usize {
        2 * self.k.iter().map(Vec::len).sum::<usize>() * std::mem::size_of::<T>()
    }
}

/// The planes of one cache, in its precision.
enum Store {
    F32(Planes<f32>),
    Bf16(Planes<bf16>),
}

macro_rules! each_store {
    ($store:expr, $p:ident => $e:expr) => {
        match $store {
            Store::F32($p) => $e,
            Store::Bf16($p) => $e,
        }
    };
}

impl Store {
    /// Planes that grow, with room for `slots` rows.
    fn growing(precision: KvPrecision, heads: usize, hd: usize, slots: usize) -> Self {
        match precision {
            KvPrecision::F32 => Store::F32(Planes::new(heads, hd, slots)),
            KvPrecision::Bf16 => Store::Bf16(Planes::new(heads, hd, slots)),
        }
    }
    /// A ring of `slots` zero rows.
    fn ring(precision: KvPrecision, heads: usize, hd: usize, slots: usize) -> Self {
        match precision {
            KvPrecision::F32 => Store::F32(Planes::ring(heads, hd, slots)),
            KvPrecision::Bf16 => Store::Bf16(Planes::ring(heads, hd, slots)),
        }
    }
    fn put<S: KvElem>(&mut self, slot: usize, k: &[S], v: &[S]) {
        each_store!(self, p => p.put(slot, k, v))
    }
    fn rows(&self) -> usize {
        each_store!(self, p => p.rows())
    }
    fn bytes(&self) -> usize {
        each_store!(self, p => p.bytes())
    }
    fn hd(&self) -> usize {
        each_store!(self, p => p.hd)
    }
    fn heads(&self) -> usize {
        each_store!(self, p => p.k.len())
    }
}

/// The last `window` K/V rows; the entry for position p lives in slot p mod window.
pub struct SlidingKvCache {
    window: usize,
    planes: Store,
    len: usize,
}

/// Every K/V row from position 0.
pub struct FullKvCache {
    planes: Store,
}

pub enum LayerKvCache {
    Sliding(SlidingKvCache),
    Full(FullKvCache),
}

impl SlidingKvCache {
    /// A ring of `window` rows of `heads` KV heads of `hd` values.
    pub fn new(window: usize, heads: usize, hd: usize, precision: KvPrecision) -> Self {
        // The whole ring up front: a bulk append longer than the window starts mid-ring.
        SlidingKvCache {
            window,
            planes: Store::ring(precision, heads, hd, window),
            len: 0,
        }
    }
    fn push<S: KvElem>(&mut self, k: &[S], v: &[S]) {
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
    pub fn new(cfg: &SparkConfig, t: LayerType, context: usize, precision: KvPrecision) -> Self {
        let (heads, hd) = (cfg.num_key_value_heads, cfg.head_dim);
        match t {
            LayerType::Sliding => LayerKvCache::Sliding(SlidingKvCache::new(
                cfg.sliding_window,
                heads,
                hd,
                precision,
            )),
            LayerType::Full => LayerKvCache::Full(FullKvCache {
                planes: Store::growing(precision, heads, hd, context.min(1 << 16)),
            }),
        }
    }

    fn planes(&self) -> &Store {
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

    /// The keys and values held, by position, in the cache's precision.
    pub fn rows(&self) -> KvRows<'_> {
        let ring = match self {
            LayerKvCache::Sliding(c) => Some((c.window, c.len)),
            LayerKvCache::Full(_) => None,
        };
        match self.planes() {
            Store::F32(planes) => KvRows::F32(Rows { planes, ring }),
            Store::Bf16(planes) => KvRows::Bf16(Rows { planes, ring }),
        }
    }

    /// Append rows for consecutive positions (`k`, `v` are `[n, kv_heads × head_dim]`, f32 or
    /// stored), in the cache's precision ([`KvElem::store`]: bf16 rounded to nearest even, exact
    /// for bf16 values).
    pub fn append<S: KvElem>(&mut self, k: &[S], v: &[S]) {
        let d = self.planes().hd() * self.planes().heads();
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
    /// Bytes of K and V held right now.
    pub fn bytes(&self) -> usize {
        self.planes().bytes()
    }
}

/// A layer cache's rows in its precision ([`LayerKvCache::rows`]).
pub enum KvRows<'a> {
    F32(Rows<'a, f32>),
    Bf16(Rows<'a, bf16>),
}

/// Rows of one precision, by absolute position and KV head.
pub struct Rows<'a, T> {
    planes: &'a Planes<T>,
    /// A sliding ring's window and positions appended; `None` for a full cache.
    ring: Option<(usize, usize)>,
}

impl<'a, T> Rows<'a, T> {
    fn slot(&self, pos: usize) -> usize {
        match self.ring {
            Some((window, len)) => {
                assert!(
                    pos < len && pos + window >= len,
                    "position {pos} is not in the sliding cache (holds {}..{len})",
                    len.saturating_sub(window),
                );
                pos % window
            }
            None => pos,
        }
    }
    /// K row of KV head `head` at absolute position `pos` (`head_dim` values).
    pub fn key(&self, pos: usize, head: usize) -> &'a [T] {
        let (p, s) = (self.planes, self.slot(pos));
        &p.k[head][s * p.hd..(s + 1) * p.hd]
    }
    /// V row of KV head `head` at absolute position `pos` (`head_dim` values).
    pub fn value(&self, pos: usize, head: usize) -> &'a [T] {
        let (p, s) = (self.planes, self.slot(pos));
        &p.v[head][s * p.hd..(s + 1) * p.hd]
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
    pub fn new(cfg: &SparkConfig, context: usize, precision: KvPrecision) -> Self {
        let layers = cfg
            .layer_types
            .iter()
            .map(|&t| LayerKvCache::new(cfg, t, context, precision))
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

    /// The rows of an f32 cache.
    fn f32_rows(c: &LayerKvCache) -> Rows<'_, f32> {
        match c.rows() {
            KvRows::F32(r) => r,
            KvRows::Bf16(_) => panic!("an f32 cache"),
        }
    }

    fn sliding(window: usize, heads: usize, hd: usize) -> LayerKvCache {
        LayerKvCache::Sliding(SlidingKvCache::new(window, heads, hd, KvPrecision::F32))
    }

    #[test]
    fn sliding_cache_keeps_exactly_the_window() {
        let mut c = sliding(4, 2, 1);
        for p in 0..10 {
            c.append(&row(p), &row(p));
        }
        assert_eq!(c.len(), 10);
        for p in 6..10 {
            // Two KV heads of one value each: head 0 holds p, head 1 −p.
            assert_eq!(
                (f32_rows(&c).key(p, 0), f32_rows(&c).key(p, 1)),
                (&row(p)[..1], &row(p)[1..])
            );
            assert_eq!(
                (f32_rows(&c).value(p, 0), f32_rows(&c).value(p, 1)),
                (&row(p)[..1], &row(p)[1..])
            );
        }
        assert_eq!(
            c.bytes(),
            2 * 4 * 2 * 4,
            "memory is window-sized, not context-sized"
        );
    }

    #[test]
    fn bulk_append_longer_than_window_keeps_the_tail() {
        let mut c = sliding(3, 2, 1);
        let rows: Vec<f32> = (0..7).flat_map(row).collect();
        c.append(&rows, &rows);
        assert_eq!(c.len(), 7);
        for p in 4..7 {
            assert_eq!(
                (f32_rows(&c).key(p, 0), f32_rows(&c).key(p, 1)),
                (&row(p)[..1], &row(p)[1..])
            );
        }
    }

    #[test]
    #[should_panic(expected = "not in the sliding cache")]
    fn evicted_positions_are_not_served() {
        let mut c = sliding(2, 2, 1);
        for p in 0..5 {
            c.append(&row(p), &row(p));
        }
        let _ = f32_rows(&c).key(2, 0);
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
        let mut c = LayerKvCache::new(&cfg, LayerType::Full, 2, KvPrecision::F32);
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
                assert_eq!(f32_rows(&c).key(p, h), want.as_slice());
                let neg: Vec<f32> = want.iter().map(|x| -x).collect();
                assert_eq!(f32_rows(&c).value(p, h), neg.as_slice());
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
        let mut c = sliding(window, heads, hd);
        c.append(&rows(0, 7), &rows(0, 7));
        for p in 7..12 {
            c.append(&rows(p, 1), &rows(p, 1));
            for q in p + 1 - window..=p {
                for h in 0..heads {
                    let want: Vec<f32> = (q * d + h * hd..q * d + (h + 1) * hd)
                        .map(|i| i as f32)
                        .collect();
                    assert_eq!(
                        (f32_rows(&c).key(q, h), f32_rows(&c).value(q, h)),
                        (want.as_slice(), want.as_slice())
                    );
                }
            }
        }
        assert_eq!((c.len(), c.bytes()), (12, 2 * window * d * 4));
    }

    /// A bf16 cache holds bf16 values exactly, in half the bytes of an f32 one, and rounds
    /// other values to nearest even; both layer types, across a ring's wrap.
    #[test]
    fn a_bf16_cache_holds_bf16_values_in_half_the_bytes() {
        let json = crate::checkpoint::config::tests::real_1_7b_json().to_string();
        let cfg = crate::checkpoint::SparkConfig::from_json_str(&json, "config.json").unwrap();
        let d = cfg.kv_dim();
        let n = cfg.sliding_window + 7;
        // bf16 values (8 significant bits) of both signs and a spread of magnitudes.
        let vals: Vec<f32> = (0..n * d)
            .map(|i| crate::kernels::w4::round_bf16((i as f32 * 0.731).sin() * (1 + i % 97) as f32))
            .collect();
        let neg: Vec<f32> = vals.iter().map(|x| -x).collect();
        for t in [LayerType::Sliding, LayerType::Full] {
            let mut c32 = LayerKvCache::new(&cfg, t, n, KvPrecision::F32);
            let mut c16 = LayerKvCache::new(&cfg, t, n, KvPrecision::Bf16);
            for c in [&mut c32, &mut c16] {
                c.append(&vals[..(n - 3) * d], &neg[..(n - 3) * d]);
                for p in n - 3..n {
                    c.append(&vals[p * d..(p + 1) * d], &neg[p * d..(p + 1) * d]);
                }
            }
            assert_eq!(2 * c16.bytes(), c32.bytes(), "{t:?}");
            let (KvRows::F32(r32), KvRows::Bf16(r16)) = (c32.rows(), c16.rows()) else {
                panic!("the precisions asked for");
            };
            let first = if t == LayerType::Sliding {
                n - cfg.sliding_window
            } else {
                0
            };
            for p in first..n {
                for h in 0..cfg.num_key_value_heads {
                    let widen = |r: &[bf16]| r.iter().map(|x| x.widen()).collect::<Vec<_>>();
                    assert_eq!(
                        widen(r16.key(p, h)),
                        r32.key(p, h),
                        "{t:?} key {p} head {h}"
                    );
                    assert_eq!(widen(r16.value(p, h)), r32.value(p, h), "{t:?} value {p}");
                }
            }
        }
        // Not a bf16 value: rounded to nearest, ties to even.
        let mut c = LayerKvCache::Full(FullKvCache {
            planes: Store::growing(KvPrecision::Bf16, 1, 2, 1),
        });
        let (above_tie, tie) = (f32::from_bits(0x3F80_8001), f32::from_bits(0x3F80_8000));
        c.append(&[above_tie, tie], &[-above_tie, -tie]);
        let KvRows::Bf16(r) = c.rows() else { panic!() };
        let bits = |x: &[bf16]| x.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(r.key(0, 0)), [0x3F81, 0x3F80]);
        assert_eq!(bits(r.value(0, 0)), [0xBF81, 0xBF80]);
    }
}
