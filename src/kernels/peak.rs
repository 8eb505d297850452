//! This CPU's arithmetic peaks, measured: each multiply-add instruction the kernels are built
//! on, issued back to back on independent accumulators with operands in registers (no memory
//! traffic), one thread and every thread of the pool. Kernel speeds are reported as a share of
//! these (`spark-tool bench --kernels`), so the ratios hold on any machine, not on a quoted
//! datasheet figure.

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

/// The step peak that bounds a kernel on `instruction`, if any.
pub fn step_of(instruction: &str) -> Option<&'static str> {
    match instruction {
        "tdpbssd" => Some(TILE_STEP_I8),
        "tdpbf16ps" => Some(TILE_STEP_BF16),
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
            let want: &[&str] = match isa {
                Isa::Portable => &[],
                Isa::Avx512Vnni => &["vfmadd231ps", "vpdpbusd"],
                Isa::Avx512Bf16 => &["vfmadd231ps", "vpdpbusd", "vdpbf16ps"],
                Isa::Amx => &[
                    "vfmadd231ps",
                    "vpdpbusd",
                    "vdpbf16ps",
                    "tdpbssd",
                    TILE_STEP_I8,
                    "tdpbf16ps",
                    TILE_STEP_BF16,
                ],
            };
            assert_eq!(names, want, "{isa:?}");
            for p in &peaks {
                assert!(
                    p.one_thread_gmacs.is_finite() && p.one_thread_gmacs > 0.0,
                    "{p:?}"
                );
            }
        }
    }
}
