//! This CPU's arithmetic peaks, measured: each multiply-add instruction the kernels are built
//! on, issued back to back on independent accumulators with operands in registers (no memory
//! traffic), one thread and every thread of the pool; and the steps of the kernels whose
//! instruction mix, not their multiply-adds, bounds them from cache (the tile kernels' 2 × 2
//! step, the W4A16 decode step), with their operands in L1. Kernel speeds are reported as a
//! share of these (`spark-tool bench --kernels`), so the ratios hold on any machine, not on a
//! quoted datasheet figure.

#[cfg(target_arch = "x86_64")]
use std::time::Instant;

use serde::Serialize;

use super::isa::Isa;

/// One instruction's measured throughput.
#[derive(Debug, Clone, Serialize)]
pub struct Peak {
    /// The instruction, e.g. `tdpbssd`.
    pub instruction: &'static str,
    /// What it multiplies, e.g. `u8 x s8 -> i32`.
    pub operands: &'static str,
    /// Multiply-adds one instruction does.
    pub macs_per_instruction: u64,
    /// G multiply-adds per second, one thread (median of the repeats).
    pub one_thread_gmacs: f64,
    /// G multiply-adds per second, every thread of the pool at once (median).
    pub all_threads_gmacs: f64,
    /// Threads of the second figure.
    pub threads: usize,
}

/// The peaks of the instructions `isa` lets the kernels use.
pub fn measure(isa: Isa, repeat: usize) -> Vec<Peak> {
    #[cfg(target_arch = "x86_64")]
    {
        let mut out = vec![];
        if isa.avx512() {
            out.push(peak(
                "vfmadd231ps",
                "f32 x f32 -> f32",
                16,
                repeat,
                x86::fma,
            ));
            out.push(peak("vpdpbusd", "u8 x s8 -> i32", 64, repeat, x86::vnni));
        }
        if isa >= Isa::Avx512Bf16 {
            out.push(peak(
                "vdpbf16ps",
                "bf16 x bf16 -> f32",
                32,
                repeat,
                x86::bf16,
            ));
            let w4 = "u4 x bf16 -> f32";
            out.push(peak(W4A16_STEP_WORDS, w4, 128, repeat, x86::w4a16_words));
            if super::isa::vbmi() {
                out.push(peak(W4A16_STEP_PAIR, w4, 128, repeat, x86::w4a16_pair));
            }
        }
        if isa >= Isa::Amx {
            let (i8, bf16) = ("s8 x s8 -> i32", "bf16 x bf16 -> f32");
            out.push(peak("tdpbssd", i8, 16 * 16 * 64, repeat, x86::tdpbssd));
            out.push(peak(
                TILE_STEP_I8,
                i8,
                16 * 16 * 64,
                repeat,
                x86::tdpbssd_step,
            ));
            out.push(peak(
                "tdpbf16ps",
                bf16,
                16 * 16 * 32,
                repeat,
                x86::tdpbf16ps,
            ));
            out.push(peak(
                TILE_STEP_BF16,
                bf16,
                16 * 16 * 32,
                repeat,
                x86::tdpbf16ps_step,
            ));
        }
        out
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, repeat);
        vec![]
    }
}

/// A tile kernel's best case with eight tile registers: a 2 × 2 step (two A and two B tiles
/// loaded, 1 KiB each from 64-byte-aligned L1 lines, four products into four accumulators).
/// Where it falls short of the instruction's own rate, the tile loads bound every tile kernel;
/// on the Xeon of docs/BENCHMARKS.md it does not.
pub const TILE_STEP_I8: &str = "tdpbssd 2x2 step";
/// As [`TILE_STEP_I8`] for `tdpbf16ps`.
pub const TILE_STEP_BF16: &str = "tdpbf16ps 2x2 step";

/// The W4A16 decode kernel's step with its operands in L1, for 128 weights of one column and
/// one activation row (two columns in flight, as the kernel walks them): the 64 bytes of
/// nibbles, the activations (four 64-byte loads shared by the two columns), the group table
/// (one 32-byte row broadcast), three shifts, four `vpermw` lookups and four `vdpbf16ps`.
/// Groups of 128 and more ([`super::w4a16`]'s word decoder). Where this falls short of
/// `vdpbf16ps`'s own rate, the lookups, not the products, bound the kernel from cache.
pub const W4A16_STEP_WORDS: &str = "w4a16 g128 step";
/// As [`W4A16_STEP_WORDS`] for groups of 64 (the pair decoder, AVX512-VBMI): one `vpermb`
/// more per 128 weights and two tables.
pub const W4A16_STEP_PAIR: &str = "w4a16 g64 step";

/// The step peak that bounds a kernel on `instruction` with groups of `group` (4-bit kernels)
/// at `rows` activation rows, if any: the tile kernels' 2 × 2 step, or the W4A16 decode step.
pub fn step_of(instruction: &str, group: Option<usize>, rows: usize) -> Option<&'static str> {
    match (instruction, group) {
        ("tdpbssd", _) => Some(TILE_STEP_I8),
        ("tdpbf16ps", _) => Some(TILE_STEP_BF16),
        ("vdpbf16ps", Some(64)) if rows == 1 => Some(W4A16_STEP_PAIR),
        ("vdpbf16ps", Some(g)) if rows == 1 && g >= 128 => Some(W4A16_STEP_WORDS),
        _ => None,
    }
}

/// The peak of `name` among `peaks`.
pub fn of<'a>(peaks: &'a [Peak], name: &str) -> Option<&'a Peak> {
    peaks.iter().find(|p| p.instruction == name)
}

/// Instructions per timed call: long enough (tens of ms) that timer and wake-up costs vanish.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const CALLS: u64 = 1 << 21;

#[cfg(target_arch = "x86_64")]
fn peak(
    instruction: &'static str,
    operands: &'static str,
    macs: u64,
    repeat: usize,
    run: unsafe fn(u64),
) -> Peak {
    use rayon::prelude::*;
    // Tile instructions are ~16× the work of a vector one: fewer of them per call.
    let calls = if macs > 1024 { CALLS } else { CALLS * 32 };
    let threads = rayon::current_num_threads();
    let time = |threads: usize| {
        let t = Instant::now();
        // SAFETY: `measure` only lists instructions the tier has.
        (0..threads)
            .into_par_iter()
            .for_each(|_| unsafe { run(calls) });
        (threads as u64 * calls * macs) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let spread = |threads: usize| {
        time(threads); // warm-up: clocks, the pool, tile state
        let mut v: Vec<f64> = (0..repeat.max(1)).map(|_| time(threads)).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Peak {
        instruction,
        operands,
        macs_per_instruction: macs,
        one_thread_gmacs: spread(1),
        all_threads_gmacs: spread(threads),
        threads,
    }
}

/// The loops: `n` instructions on 8 (vectors) or 4 (tiles: the most the 8 tile registers
/// leave for accumulators) independent accumulators, operands never changing.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    macro_rules! vector_loop {
        ($name:ident, $feature:literal, $ty:ty, $zero:expr, $one:expr, |$acc:ident, $b:ident| $step:expr) => {
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $name(n: u64) {
                let mut acc: [$ty; 8] = [$zero; 8];
                let $b: $ty = std::hint::black_box($one);
                for _ in 0..n / 8 {
                    for $acc in acc.iter_mut() {
                        *$acc = $step;
                    }
                }
                std::hint::black_box(acc);
            }
        };
    }

    vector_loop!(
        fma,
        "avx512f",
        __m512,
        _mm512_setzero_ps(),
        _mm512_set1_ps(1e-9),
        |a, b| _mm512_fmadd_ps(*a, b, b)
    );
    vector_loop!(
        vnni,
        "avx512f,avx512vnni",
        __m512i,
        _mm512_setzero_si512(),
        _mm512_set1_epi8(1),
        |a, b| _mm512_dpbusd_epi32(*a, b, b)
    );
    vector_loop!(
        bf16,
        "avx512f,avx512bf16",
        __m512,
        _mm512_setzero_ps(),
        _mm512_setzero_ps(),
        |a, b| {
            // SAFETY (transmute): __m512 and __m512bh are both 512 bits.
            let v = unsafe { std::mem::transmute::<__m512, __m512bh>(b) };
            _mm512_dpbf16_ps(*a, v, v)
        }
    );

    macro_rules! tile_loop {
        ($name:ident, $op:literal) => {
            /// # Safety
            /// The CPU has AMX and the OS granted tile state ([`super::Isa::Amx`]).
            pub(super) unsafe fn $name(n: u64) {
                // SAFETY: the caller checked AMX; the loop only touches tiles 0–7.
                unsafe {
                    crate::kernels::amx::configure();
                    asm!(
                        "tilezero tmm4",
                        "tilezero tmm5",
                        "tilezero tmm6",
                        "tilezero tmm7",
                        "2:",
                        concat!($op, " tmm0, tmm4, tmm6"),
                        concat!($op, " tmm1, tmm4, tmm7"),
                        concat!($op, " tmm2, tmm5, tmm6"),
                        concat!($op, " tmm3, tmm5, tmm7"),
                        "sub {n}, 4",
                        "jg 2b",
                        n = inout(reg) n as i64 => _,
                        options(nostack, nomem)
                    );
                    crate::kernels::amx::release();
                }
            }
        };
    }

    tile_loop!(tdpbssd, "tdpbssd");
    tile_loop!(tdpbf16ps, "tdpbf16ps");

    /// L1 bytes the W4A16 steps load: two columns' nibbles (0, 64), the activations (128…383),
    /// two group tables (384, 416).
    #[repr(C, align(64))]
    struct W4a16Operands([u8; 448]);

    /// One column's lookups and products, `$v` its 64 bytes of nibbles, `$lo`/`$hi` the tables
    /// of its two halves, products into `$a0`…`$a3` with the activations in zmm16–19.
    macro_rules! w4a16_column {
        ($v:literal, $lo:literal, $hi:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => {
            concat!(
                "vpsrlw zmm5, ",
                $v,
                ", 4\n",
                "vpsrlw zmm6, ",
                $v,
                ", 8\n",
                "vpsrlw zmm7, ",
                $v,
                ", 12\n",
                "vpermw zmm4, ",
                $v,
                ", ",
                $lo,
                "\n",
                "vpermw zmm5, zmm5, ",
                $lo,
                "\n",
                "vpermw zmm6, zmm6, ",
                $hi,
                "\n",
                "vpermw zmm7, zmm7, ",
                $hi,
                "\n",
                "vdpbf16ps ",
                $a0,
                ", zmm4, zmm16\n",
                "vdpbf16ps ",
                $a1,
                ", zmm5, zmm17\n",
                "vdpbf16ps ",
                $a2,
                ", zmm6, zmm18\n",
                "vdpbf16ps ",
                $a3,
                ", zmm7, zmm19\n",
            )
        };
    }

    macro_rules! w4a16_step_loop {
        ($name:ident, $features:literal, $prologue:literal, $tables:literal, $t:literal, $u:literal, $v:literal, $w:literal) => {
            /// # Safety
            /// The CPU has the features named (and AVX512-VBMI for the pair step).
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(n: u64) {
                let ops = W4a16Operands([0; 448]);
                let p = ops.0.as_ptr();
                // SAFETY: the caller checked the features; every load reads inside `ops`.
                unsafe {
                    asm!(
                        "vpxord zmm8, zmm8, zmm8",
                        "vmovdqa64 zmm9, zmm8",
                        "vmovdqa64 zmm10, zmm8",
                        "vmovdqa64 zmm11, zmm8",
                        "vmovdqa64 zmm12, zmm8",
                        "vmovdqa64 zmm13, zmm8",
                        "vmovdqa64 zmm14, zmm8",
                        "vmovdqa64 zmm15, zmm8",
                        "vmovdqu64 zmm20, [{p}]",
                        "2:",
                        "vmovdqu64 zmm0, [{p}]",
                        "vmovdqu64 zmm1, [{p} + 64]",
                        $prologue,
                        $tables,
                        "vmovdqu64 zmm16, [{p} + 128]",
                        "vmovdqu64 zmm17, [{p} + 192]",
                        "vmovdqu64 zmm18, [{p} + 256]",
                        "vmovdqu64 zmm19, [{p} + 320]",
                        w4a16_column!("zmm0", $t, $u, "zmm8", "zmm9", "zmm10", "zmm11"),
                        w4a16_column!("zmm1", $v, $w, "zmm12", "zmm13", "zmm14", "zmm15"),
                        "sub {n}, 2",
                        "jg 2b",
                        n = inout(reg) n as i64 => _,
                        p = in(reg) p,
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                        out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                        out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                        out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                        out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                        out("zmm20") _, out("zmm21") _, out("zmm22") _,
                        options(nostack, readonly)
                    );
                }
            }
        };
    }

    // Groups ≥ 128: one table per column, both halves.
    w4a16_step_loop!(
        w4a16_words,
        "avx512f,avx512bw,avx512bf16",
        "",
        "vbroadcasti64x4 zmm2, [{p} + 384]\nvbroadcasti64x4 zmm21, [{p} + 416]",
        "zmm2",
        "zmm2",
        "zmm21",
        "zmm21"
    );
    // Groups of 64: the pair's bytes interleaved by `vpermb`, a table per group.
    w4a16_step_loop!(
        w4a16_pair,
        "avx512f,avx512bw,avx512bf16,avx512vbmi",
        "vpermb zmm0, zmm20, zmm0\nvpermb zmm1, zmm20, zmm1",
        "vbroadcasti64x4 zmm2, [{p} + 384]\nvbroadcasti64x4 zmm3, [{p} + 416]\nvbroadcasti64x4 zmm21, [{p} + 384]\nvbroadcasti64x4 zmm22, [{p} + 416]",
        "zmm2",
        "zmm3",
        "zmm21",
        "zmm22"
    );

    /// 4 KiB in L1 that the 2 × 2 steps load their tiles from.
    #[repr(C, align(64))]
    struct Operands([u8; 4096]);

    macro_rules! step_loop {
        ($name:ident, $op:literal) => {
            /// # Safety
            /// As the tile loops.
            pub(super) unsafe fn $name(n: u64) {
                let ops = Operands([0; 4096]);
                let p = ops.0.as_ptr();
                // SAFETY: the caller checked AMX; every tile load reads 16 rows of 64 bytes
                // inside `ops`.
                unsafe {
                    crate::kernels::amx::configure();
                    asm!(
                        "2:",
                        "tileloadd tmm4, [{a0} + {s} * 1]",
                        "tileloadd tmm6, [{b0} + {s} * 1]",
                        concat!($op, " tmm0, tmm4, tmm6"),
                        "tileloadd tmm7, [{b1} + {s} * 1]",
                        concat!($op, " tmm1, tmm4, tmm7"),
                        "tileloadd tmm5, [{a1} + {s} * 1]",
                        concat!($op, " tmm2, tmm5, tmm6"),
                        concat!($op, " tmm3, tmm5, tmm7"),
                        "sub {n}, 4",
                        "jg 2b",
                        n = inout(reg) n as i64 => _,
                        a0 = in(reg) p,
                        a1 = in(reg) p.add(1024),
                        b0 = in(reg) p.add(2048),
                        b1 = in(reg) p.add(3072),
                        s = in(reg) 64usize,
                        options(nostack, readonly)
                    );
                    crate::kernels::amx::release();
                }
            }
        };
    }

    step_loop!(tdpbssd_step, "tdpbssd");
    step_loop!(tdpbf16ps_step, "tdpbf16ps");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    /// What is measured per tier (timings themselves are not asserted: tests run beside others).
    fn every_tier_instruction_is_measured_and_positive() {
        for isa in Isa::tested() {
            let peaks = measure(isa, 1);
            let names: Vec<_> = peaks.iter().map(|p| p.instruction).collect();
            let mut want: Vec<&str> = match isa {
                Isa::Portable => vec![],
                Isa::Avx512Vnni => vec!["vfmadd231ps", "vpdpbusd"],
                _ => vec!["vfmadd231ps", "vpdpbusd", "vdpbf16ps", W4A16_STEP_WORDS],
            };
            if isa >= Isa::Avx512Bf16 && crate::kernels::isa::vbmi() {
                want.push(W4A16_STEP_PAIR);
            }
            if isa >= Isa::Amx {
                want.extend(["tdpbssd", TILE_STEP_I8, "tdpbf16ps", TILE_STEP_BF16]);
            }
            assert_eq!(names, want, "{isa:?}");
            for p in &peaks {
                assert!(
                    p.one_thread_gmacs.is_finite() && p.one_thread_gmacs > 0.0,
                    "{p:?}"
                );
            }
        }
    }

    #[test]
    fn each_kernel_is_bounded_by_its_own_step() {
        assert_eq!(step_of("tdpbssd", Some(128), 1), Some(TILE_STEP_I8));
        assert_eq!(step_of("tdpbf16ps", None, 512), Some(TILE_STEP_BF16));
        assert_eq!(step_of("vdpbf16ps", Some(64), 1), Some(W4A16_STEP_PAIR));
        assert_eq!(step_of("vdpbf16ps", Some(128), 1), Some(W4A16_STEP_WORDS));
        // Dense bf16 GEMVs, prefill rows and other group sizes have no step of their own.
        assert_eq!(step_of("vdpbf16ps", None, 1), None);
        assert_eq!(step_of("vdpbf16ps", Some(128), 8), None);
        assert_eq!(step_of("vdpbf16ps", Some(32), 1), None);
        assert_eq!(step_of("vpdpbusd", Some(128), 1), None);
    }
}
