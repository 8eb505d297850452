//! Which SIMD tier the fast kernels run, detected once at run time.
//!
//! Every packed kernel has a portable version in plain Rust over the same
//! packed layout (it is what other architectures run) and, on x86-64, an
//! AVX-512 version. `SPARK_KERNELS=portable` (or `reference`) forces the
//! portable tier, for comparisons and for debugging.

use std::sync::OnceLock;

/// Tiers in increasing order; each includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust; runs everywhere.
    Portable,
    /// AVX-512 F/BW/VL with VNNI (`vpdpbusd`): Ice Lake, Zen 4 and later.
    Avx512Vnni,
    /// The above plus AVX512-BF16 (`vdpbf16ps`): Cooper/Sapphire Rapids, Zen 4.
    Avx512Bf16,
    /// The above plus AMX tiles with int8 and bf16 products (`tdpbssd`, `tdpbf16ps`), granted
    /// to this process by the OS: Sapphire Rapids and later. The many-row kernels use them
    /// (W4A8, and bf16-activation GEMMs: W4A16 and dense bf16 prefill, Gram matrices).
    Amx,
}

impl Isa {
    /// The best tier this CPU can run, ignoring `SPARK_KERNELS`.
    pub fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                if is_x86_feature_detected!("avx512bf16") {
                    return if amx() { Isa::Amx } else { Isa::Avx512Bf16 };
                }
                return Isa::Avx512Vnni;
            }
        }
        Isa::Portable
    }

    /// Every tier this CPU can run (what the tests compare against each other).
    pub fn available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx512Vnni, Isa::Avx512Bf16, Isa::Amx]
            .into_iter()
            .filter(|t| *t <= Isa::best())
            .collect()
    }

    /// The tiers the kernel tests compare against the portable one. A tier the CPU lacks is
    /// skipped, unless `SPARK_REQUIRE_ISA` (`avx512vnni` or `avx512bf16`) names it or a higher
    /// one: then its absence fails the test instead of passing silently (tools/test.sh sets it
    /// from the CPU's flags, so CI on an AVX-512 machine cannot skip the SIMD tests).
    #[cfg(test)]
    pub fn tested() -> Vec<Isa> {
        let required = match std::env::var("SPARK_REQUIRE_ISA").as_deref() {
            Ok("amx") => Isa::Amx,
            Ok("avx512bf16") => Isa::Avx512Bf16,
            Ok("avx512vnni") => Isa::Avx512Vnni,
            Ok("") | Ok("portable") | Err(_) => Isa::Portable,
            Ok(other) => {
                panic!("SPARK_REQUIRE_ISA={other}: expected avx512vnni, avx512bf16 or amx")
            }
        };
        assert!(
            Isa::best() >= required,
            "SPARK_REQUIRE_ISA asks for {required:?} but this CPU's best tier is {:?}",
            Isa::best()
        );
        Isa::available()
    }

    /// Whether the AVX-512 kernels may run.
    pub fn avx512(self) -> bool {
        self >= Isa::Avx512Vnni
    }
}

/// The tier in use: [`Isa::best`], or at most `SPARK_KERNELS` = `portable`
/// (also `reference`), `avx512vnni`, `avx512bf16` or `amx`.
pub fn isa() -> Isa {
    static CHOSEN: OnceLock<Isa> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let cap = match std::env::var("SPARK_KERNELS").as_deref() {
            Ok("portable") | Ok("reference") => Isa::Portable,
            Ok("avx512vnni") => Isa::Avx512Vnni,
            Ok("avx512bf16") => Isa::Avx512Bf16,
            _ => Isa::Amx,
        };
        Isa::best().min(cap)
    })
}

/// AVX512-VBMI (`vpermb`), which the W4A16 G = 64 pair decoder needs besides its tier: every CPU
/// with AMX has it, Cooper Lake (AVX512-BF16) does not. Asked once.
pub fn vbmi() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return *HAS.get_or_init(|| is_x86_feature_detected!("avx512vbmi"));
    #[cfg(not(target_arch = "x86_64"))]
    return *HAS.get_or_init(|| false);
}

/// AMX tiles with int8 and bf16 products, and the OS's grant of tile state to this process (Linux
/// asks each process to request it before its first tile instruction; without it that
/// instruction raises SIGILL). Asked once.
#[cfg(target_arch = "x86_64")]
fn amx() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| crate::device::detect().has_amx())
}
