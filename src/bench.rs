//! `bench`: prefill and decode throughput of one artifact, repeated, with
//! min/median/max. It measures; comparisons against a peer belong to the
//! scripts that run both in one invocation.

use std::time::Instant;

use serde::Serialize;

use crate::generate::{generate, GenerateOptions};
use crate::kernels::w4::{self, Codes, W4Nibbles, W4Weights};
use crate::kernels::w4a16::PackedW4A16;
use crate::kernels::w4a8::PackedW4A8;
use crate::kernels::{self, bf16, F32Matmul};
use crate::model::{ModelError, SparkModel};

#[derive(Debug, Clone, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Self {
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let median = if v.is_empty() {
            f64::NAN
        } else if v.len() % 2 == 1 {
            v[v.len() / 2]
        } else {
            (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
        };
        Spread {
            min: *v.first().unwrap_or(&f64::NAN),
            median,
            max: *v.last().unwrap_or(&f64::NAN),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub prompt_len: usize,
    pub gen: usize,
    pub repeat: usize,
    pub threads: usize,
    pub prefill_tok_s: Spread,
    pub decode_tok_s: Spread,
    /// Prefill plus choosing the first token.
    pub time_to_first_token_ms: Spread,
    pub decode_ms_per_token: Spread,
    pub sampling_ms: Spread,
    /// Decode against this machine's bandwidth ceiling (`--ceiling`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceiling: Option<Ceiling>,
}

/// Decode against the bandwidth ceiling, measured around every repeat: a streaming read before
/// the first repeat and after each, so each repeat is set against the reads on either side of
/// it (seconds apart, where a shared machine's bandwidth drifts by tens of percent over minutes).
#[derive(Debug, Clone, Serialize)]
pub struct Ceiling {
    /// Weights one decode step reads.
    pub weight_bytes: crate::model::DecodeBytes,
    /// K and V a decode step reads at the mean decode position.
    pub kv_bytes: u64,
    /// The streaming reads, GB/s ([`StreamProbe`], the pool's threads).
    pub stream_read_gb_s: Spread,
    /// Per repeat: the mean of the reads around it ÷ (weights + KV) per token.
    pub ceiling_tok_s: Spread,
    /// Per repeat: its decode rate ÷ its ceiling, in percent.
    pub percent_of_ceiling: Spread,
}

/// Bytes of the buffer the streaming read sums: past the last-level cache of every machine
/// measured (32 MiB on the AMD EPYC, several hundred MB reported on the Xeons with AMX).
pub const STREAM_BYTES: usize = 1 << 30;

/// A streaming read of [`STREAM_BYTES`] split across the pool's threads, its buffer kept so
/// it can be measured again between other work.
pub struct StreamProbe {
    buf: Vec<u64>,
}

impl Default for StreamProbe {
    fn default() -> Self {
        StreamProbe {
            buf: noise(STREAM_BYTES / 8, 7).collect(),
        }
    }
}

impl StreamProbe {
    /// GB/s of `repeat` reads after one that warms the pool.
    pub fn read_gb_s(&self, repeat: usize) -> Spread {
        use rayon::prelude::*;
        let threads = rayon::current_num_threads();
        let mut gbs = vec![];
        for _ in 0..repeat.max(1) + 1 {
            let t = Instant::now();
            let s: u64 = self
                .buf
                .par_chunks(self.buf.len().div_ceil(threads))
                .map(sum_words)
                .reduce(|| 0, u64::wrapping_add);
            std::hint::black_box(s);
            gbs.push(
                std::mem::size_of_val(&self.buf[..]) as f64 / (t.elapsed().as_secs_f64() * 1e9),
            );
        }
        gbs.remove(0);
        Spread::of(&gbs)
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), if the OS reports it.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Deterministic pseudo-random prompt ids below `vocab` (any ids cost the same).
pub fn prompt_ids(len: usize, vocab: usize) -> Vec<u32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Refuse a benchmark the model or the machine cannot hold, before anything is allocated:
/// `prompt_len + gen` positions within max_position_embeddings, and the cache, activations and
/// prompt within the available memory.
pub fn plan(
    cfg: &crate::checkpoint::SparkConfig,
    prompt_len: usize,
    gen: usize,
    ceiling: bool,
) -> Result<(), crate::generate::BudgetError> {
    use crate::setting::Setting;
    let positions = prompt_len.max(1).saturating_add(gen.max(1));
    if positions > cfg.max_position_embeddings {
        return Err(crate::generate::BudgetError::PromptTooLong {
            prompt: prompt_len,
            limit: format!(
                "{} + {} = {positions} positions pass the model's max_position_embeddings ({})",
                Setting::PromptLen,
                Setting::Gen,
                cfg.max_position_embeddings
            ),
        });
    }
    // Before the load, so the cache is planned f32 (a GPTQ artifact's bf16 cache takes half).
    let need = crate::resources::kv_cache_bytes(cfg, positions, 4)
        + crate::resources::forward_bytes(cfg, prompt_len.max(1), false)
        + if ceiling { STREAM_BYTES as u128 } else { 0 };
    crate::resources::check_fits(
        &format!(
            "a {prompt_len}-token prefill{}",
            if ceiling {
                " and the 1 GiB buffer of --ceiling"
            } else {
                ""
            }
        ),
        need,
        Setting::PromptLen,
    )?;
    Ok(())
}

/// `repeat` runs of a `prompt_len`-token prefill and `gen` decode steps; with `ceiling`, a
/// streaming read before the first and after each (three passes each), the decode of every run
/// set against the mean of the reads around it.
pub fn run(
    model: &SparkModel,
    prompt_len: usize,
    gen: usize,
    repeat: usize,
    ceiling: bool,
) -> Result<BenchReport, ModelError> {
    let probe = ceiling.then(StreamProbe::default);
    let mut reads = vec![];
    let mut read = || {
        if let Some(p) = &probe {
            reads.push(p.read_gb_s(3).median);
        }
    };
    read();
    let prompt = prompt_ids(prompt_len.max(1), model.config().vocab_size);
    let opts = GenerateOptions {
        max_new_tokens: gen.max(1),
        ignore_eos: true,
        stop_ids: vec![],
        sampling: None,
        context: None,
        capture_logits: false,
    };
    let (mut pre, mut dec, mut ttft, mut per_tok, mut samp) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let mut first = None;
        let out = generate(model, &prompt, &opts, |_| {
            first.get_or_insert_with(|| t.elapsed().as_secs_f64() * 1e3);
        })?;
        let s = &out.stats;
        pre.push(s.prompt_tokens as f64 / (s.prefill_ms / 1e3));
        if !s.decode_ms.is_empty() {
            dec.push(1e3 / s.decode_mean_ms());
            per_tok.push(s.decode_mean_ms());
        }
        ttft.push(first.unwrap_or(f64::NAN));
        samp.push(s.sampling_ms);
        read();
    }
    let ceiling = probe.map(|_| {
        let weight_bytes = model.decode_bytes();
        let kv_bytes = model.decode_kv_bytes(prompt.len() + opts.max_new_tokens / 2);
        let per_token = (weight_bytes.total() + kv_bytes) as f64;
        let ceil: Vec<f64> = reads
            .windows(2)
            .map(|w| (w[0] + w[1]) / 2.0 * 1e9 / per_token)
            .collect();
        let pct: Vec<f64> = dec.iter().zip(&ceil).map(|(d, c)| 100.0 * d / c).collect();
        Ceiling {
            weight_bytes,
            kv_bytes,
            stream_read_gb_s: Spread::of(&reads),
            ceiling_tok_s: Spread::of(&ceil),
            percent_of_ceiling: Spread::of(&pct),
        }
    });
    Ok(BenchReport {
        prompt_len: prompt.len(),
        gen: opts.max_new_tokens,
        repeat: repeat.max(1),
        threads: rayon::current_num_threads(),
        prefill_tok_s: Spread::of(&pre),
        decode_tok_s: Spread::of(&dec),
        time_to_first_token_ms: Spread::of(&ttft),
        decode_ms_per_token: Spread::of(&per_tok),
        sampling_ms: Spread::of(&samp),
        ceiling,
    })
}

/// Wall time per forward stage (`--stages`).
#[derive(Debug, Clone, Serialize)]
pub struct StageTime {
    pub stage: &'static str,
    /// Prefill: ms for the whole prompt; decode: ms per token.
    pub ms: f64,
    pub share: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StageProfile {
    pub prefill: Vec<StageTime>,
    pub decode: Vec<StageTime>,
    /// Forward wall time the stages are shares of (prefill total, decode per token).
    pub prefill_ms: f64,
    pub decode_ms_per_token: f64,
}

/// One prefill of `prompt_len` and `gen` greedy decode steps with the
/// model's stage timers on.
pub fn stage_profile(
    model: &SparkModel,
    prompt_len: usize,
    gen: usize,
) -> Result<StageProfile, ModelError> {
    use crate::engine::Engine;
    use crate::model::Logits;
    let prompt = prompt_ids(prompt_len.max(1), model.config().vocab_size);
    let gen = gen.max(1);
    let timers = model.stage_timers();
    let collect = |total: f64, per: f64| {
        timers
            .take()
            .into_iter()
            .map(|(s, ms)| StageTime {
                stage: s.name(),
                ms: ms / per,
                share: ms / total,
            })
            .collect::<Vec<_>>()
    };
    timers.take();
    timers.set_enabled(true);
    let run = || -> Result<(Vec<StageTime>, f64, f64), ModelError> {
        let mut seq = model.start(prompt.len() + gen)?;
        let t = Instant::now();
        let mut last = seq.forward(&prompt, Logits::Last)?;
        let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
        let prefill = collect(prefill_ms, 1.0);
        let t = Instant::now();
        for _ in 0..gen {
            last = seq.forward(&[crate::sampling::argmax(&last)], Logits::Last)?;
        }
        Ok((prefill, prefill_ms, t.elapsed().as_secs_f64() * 1e3))
    };
    let timed = run();
    timers.set_enabled(false);
    let (prefill, prefill_ms, decode_ms) = timed?;
    Ok(StageProfile {
        prefill,
        decode: collect(decode_ms, gen as f64),
        prefill_ms,
        decode_ms_per_token: decode_ms / gen as f64,
    })
}

/// One kernel on one weight shape: time per call and the weight bytes it streams.
#[derive(Debug, Clone, Serialize)]
pub struct KernelRow {
    pub kernel: String,
    /// Output features (weight rows).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Activation rows per call (1 = decode).
    pub m: usize,
    pub weight_bytes: usize,
    pub us_per_call: Spread,
    /// Weight bytes ÷ median time.
    pub gb_s: f64,
    /// m·n·k multiply-adds ÷ median time, in G per second.
    pub gmacs: f64,
    /// The multiply-add instruction the kernel runs on this CPU at these rows (its measured
    /// peak, [`kernels::peak`], is the ceiling when the weights are in cache).
    pub instruction: Option<&'static str>,
    /// The measured instruction-mix step that bounds the kernel from cache, when there is one
    /// ([`kernels::peak::step_of`]): the tile kernels' 2 × 2 step, the W4A16 decode step.
    pub step: Option<&'static str>,
}

/// The kernels `bench --kernels` compares: today's paths and the ones they replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelKind {
    /// f32 weights through the `gemm` crate (dense linears before bf16 storage; W4A16 before packing).
    F32Gemm,
    /// bf16 weights, bf16 activations (GPTQ artifacts' dense tensors: head, `g_proj`).
    Bf16,
    /// bf16 weights, f32 activations (the original checkpoint's linears and head).
    Bf16F32Act,
    /// Packed nibbles, dequantized on the fly, g128.
    W4A16,
    /// The same at g64: what `probe` picks on x86 without AMX (two tables per 128 inputs).
    W4A16G64,
    /// Packed nibbles, int8 activations, bit-exact recipe, g128.
    W4A8,
    /// The scalar W4A8 recipe over one i8 code per weight (what W4A8 ran before packing).
    W4A8Scalar,
}

impl KernelKind {
    pub fn all() -> [KernelKind; 7] {
        use KernelKind::*;
        [F32Gemm, Bf16F32Act, Bf16, W4A16, W4A16G64, W4A8, W4A8Scalar]
    }
    pub fn name(self) -> &'static str {
        match self {
            KernelKind::F32Gemm => "f32 gemm",
            KernelKind::Bf16 => "bf16",
            KernelKind::Bf16F32Act => "bf16 f32-act",
            KernelKind::W4A16 => "w4a16 g128",
            KernelKind::W4A16G64 => "w4a16 g64",
            KernelKind::W4A8 => "w4a8 g128",
            KernelKind::W4A8Scalar => "w4a8 g128 scalar",
        }
    }

    /// The multiply-add instruction the dispatch picks for this kind with `m` activation rows
    /// of depth `k` under `isa` (as in `bf16::matmul_nt`, `PackedW4A16::matmul` and
    /// `PackedW4A8::matmul`; `None` for the scalar kernel).
    pub fn instruction(self, isa: kernels::isa::Isa, m: usize, k: usize) -> Option<&'static str> {
        use kernels::isa::Isa;
        let amx = isa >= Isa::Amx;
        let bf16_tiles = amx && m >= bf16::GEMM_MIN_ROWS && k.is_multiple_of(32);
        Some(match self {
            _ if !isa.avx512() => return None,
            KernelKind::F32Gemm | KernelKind::Bf16F32Act => "vfmadd231ps",
            KernelKind::Bf16 | KernelKind::W4A16 | KernelKind::W4A16G64 if bf16_tiles => {
                "tdpbf16ps"
            }
            KernelKind::Bf16 | KernelKind::W4A16 | KernelKind::W4A16G64
                if isa >= Isa::Avx512Bf16 =>
            {
                "vdpbf16ps"
            }
            KernelKind::Bf16 | KernelKind::W4A16 | KernelKind::W4A16G64 => "vfmadd231ps",
            KernelKind::W4A8 if amx && m >= 32 => "tdpbssd",
            KernelKind::W4A8 => "vpdpbusd",
            KernelKind::W4A8Scalar => return None,
        })
    }

    /// The 4-bit kinds' group size.
    pub fn group(self) -> Option<usize> {
        match self {
            KernelKind::W4A16 | KernelKind::W4A8 | KernelKind::W4A8Scalar => Some(128),
            KernelKind::W4A16G64 => Some(64),
            _ => None,
        }
    }

    /// The step peak ([`kernels::peak::step_of`]) that bounds this kind's kernel at `m` rows of
    /// depth `k` under `isa`; the G = 64 pair step only where the pair decoder runs (VBMI).
    pub fn step(self, isa: kernels::isa::Isa, m: usize, k: usize) -> Option<&'static str> {
        let s = kernels::peak::step_of(self.instruction(isa, m, k)?, self.group(), m)?;
        (s != kernels::peak::W4A16_STEP_PAIR || kernels::isa::vbmi()).then_some(s)
    }
}

/// Cheap deterministic bytes (weights for timing only).
fn noise(len: usize, seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    })
}

/// Weights of one kind ready to multiply.
enum BenchWeight {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    W4A16(PackedW4A16),
    W4A8(PackedW4A8),
    W4A8Scalar(Vec<i8>, Vec<f32>),
}

fn bench_weight(kind: KernelKind, n: usize, k: usize, seed: u64) -> (BenchWeight, usize) {
    let g = if kind == KernelKind::W4A16G64 {
        64
    } else {
        128
    }
    .min(k);
    let groups = k / g;
    let q = || -> Vec<u8> { noise(n * k, seed).map(|v| (v >> 40) as u8 & 15).collect() };
    let scales: Vec<f32> = noise(n * groups, seed + 1)
        .map(|v| w4::round_bf16(1e-3 + (v >> 44) as f32 * 1e-9))
        .collect();
    let zeros = vec![8i32; n * groups];
    let small = |v: u64| ((v >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
    match kind {
        KernelKind::F32Gemm => (
            BenchWeight::F32(noise(n * k, seed).map(small).collect()),
            4 * n * k,
        ),
        KernelKind::Bf16 | KernelKind::Bf16F32Act => (
            BenchWeight::Bf16(
                noise(n * k, seed)
                    .map(|v| half::bf16::from_f32(small(v)).to_bits())
                    .collect(),
            ),
            2 * n * k,
        ),
        KernelKind::W4A16 | KernelKind::W4A16G64 | KernelKind::W4A8 => {
            let q = q();
            let nib = W4Nibbles {
                q: Codes::Unpacked(&q),
                zeros: &zeros,
                scales: &scales,
                n,
                k,
                g,
            };
            if kind != KernelKind::W4A8 {
                let p = PackedW4A16::pack(nib);
                let b = p.bytes();
                (BenchWeight::W4A16(p), b)
            } else {
                let p = PackedW4A8::pack(nib);
                let b = p.bytes();
                (BenchWeight::W4A8(p), b)
            }
        }
        KernelKind::W4A8Scalar => {
            let codes: Vec<i8> = q().iter().map(|&v| v as i8 - 8).collect();
            let b = codes.len() + 4 * scales.len();
            (BenchWeight::W4A8Scalar(codes, scales), b)
        }
    }
}

impl BenchWeight {
    fn matmul(&self, x: &[f32], m: usize, n: usize, k: usize, y: &mut [f32]) {
        match self {
            BenchWeight::F32(w) => kernels::GemmCrateMatmul.matmul_nt(x, m, k, w, n, y),
            BenchWeight::Bf16(w) => bf16::matmul_nt(x, m, k, w, n, y),
            BenchWeight::W4A16(p) => p.matmul(x, m, y),
            BenchWeight::W4A8(p) => p.matmul(x, m, y),
            BenchWeight::W4A8Scalar(codes, scales) => w4::w4a8_matmul(
                x,
                m,
                W4Weights {
                    codes,
                    scales,
                    n,
                    k,
                    g: 128.min(k),
                },
                y,
            ),
        }
    }
}

/// Time `kind` on `[n, k]` weights with `m` activation rows. Enough distinct
/// weight copies are cycled that their total (≥ 256 MB) never fits in cache:
/// decode reads every weight from DRAM. A `working_set` (bytes) small enough
/// to fit in cache measures the kernel's compute bound instead.
pub fn bench_kernel(
    kind: KernelKind,
    n: usize,
    k: usize,
    m: usize,
    repeat: usize,
    working_set: Option<usize>,
) -> KernelRow {
    let (first, bytes) = bench_weight(kind, n, k, 1);
    let copies = working_set
        .unwrap_or(256_000_000)
        .div_ceil(bytes.max(1))
        .clamp(1, 64);
    let mut ws = vec![first];
    for c in 1..copies {
        ws.push(bench_weight(kind, n, k, 1 + c as u64).0);
    }
    let x: Vec<f32> = noise(m * k, 99)
        .map(|v| (v >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .map(|v| {
            if kind == KernelKind::Bf16F32Act {
                v
            } else {
                w4::round_bf16(v)
            }
        })
        .collect();
    let mut y = vec![0f32; m * n];
    for w in &ws {
        w.matmul(&x, m, n, k, &mut y); // warm up (page faults, thread pool)
    }
    let mut us = vec![];
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        for w in &ws {
            w.matmul(&x, m, n, k, &mut y);
        }
        us.push(t.elapsed().as_secs_f64() * 1e6 / ws.len() as f64);
    }
    let us_per_call = Spread::of(&us);
    KernelRow {
        kernel: kind.name().into(),
        n,
        k,
        m,
        weight_bytes: bytes,
        gb_s: bytes as f64 / (us_per_call.median * 1e3),
        gmacs: (m * n * k) as f64 / (us_per_call.median * 1e3),
        instruction: kind.instruction(kernels::isa::isa(), m, k),
        step: kind.step(kernels::isa::isa(), m, k),
        us_per_call,
    }
}

/// The [`StreamProbe`] read once: the bandwidth ceiling decode kernels are measured against.
pub fn stream_read_gb_s(repeat: usize) -> Spread {
    StreamProbe::default().read_gb_s(repeat)
}

/// The wrapping sum of `c`, read as fast as this CPU reads: with 64-byte loads on the AVX-512
/// tiers (the decode kernels' load width; the portable loop's 16-byte loads read 12.0–12.8
/// GB/s at 1 thread where the 64-byte loop reads 15.1 on the Xeon of docs/BENCHMARKS.md).
fn sum_words(c: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if kernels::isa::isa().avx512() {
        // SAFETY: the AVX-512 tiers have AVX-512F.
        return unsafe { sum_words_avx512(c) };
    }
    // Eight independent sums: the loop is bound by memory, not by an add chain.
    let mut acc = [0u64; 8];
    for v in c.chunks_exact(8) {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(v[i]);
        }
    }
    let tail = c.chunks_exact(8).remainder().iter();
    acc.iter().chain(tail).fold(0u64, |a, v| a.wrapping_add(*v))
}

/// [`sum_words`] with four 64-byte loads per step into independent sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_words_avx512(c: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 4];
    let blocks = c.chunks_exact(32);
    let tail = blocks.remainder();
    for b in blocks {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: b holds 32 words, so 8i..8i + 8 is inside it.
            let v = unsafe { _mm512_loadu_si512(b.as_ptr().add(8 * i) as *const __m512i) };
            *a = _mm512_add_epi64(*a, v);
        }
    }
    let sum = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    tail.iter()
        .fold(_mm512_reduce_add_epi64(sum) as u64, |a, v| {
            a.wrapping_add(*v)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_sum_is_the_wrapping_sum() {
        let v: Vec<u64> = noise(1000, 3).collect();
        for n in [0, 1, 31, 32, 33, 999, 1000] {
            let want = v[..n].iter().fold(0u64, |a, x| a.wrapping_add(*x));
            assert_eq!(sum_words(&v[..n]), want, "{n} words");
        }
    }

    #[test]
    fn spread_takes_the_middle() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        assert_eq!(Spread::of(&[1.0, 4.0]).median, 2.5);
    }
}
