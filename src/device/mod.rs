//! The per-device weight path: what this CPU can do, and which artifact
//! runs best on it. `decide` is a pure function of the features so every
//! branch is unit-tested with synthetic feature sets.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    X86_64,
    Aarch64,
    Other,
}

/// CPU features that decide the weight path.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuFeatures {
    pub arch: Option<Arch>,
    pub avx2: bool,
    pub avx512f: bool,
    pub avx512_vnni: bool,
    pub avx512_bf16: bool,
    pub amx_tile: bool,
    pub amx_int8: bool,
    pub amx_bf16: bool,
    /// The OS granted this process AMX tile data (Linux `arch_prctl(ARCH_REQ_XCOMP_PERM)`).
    pub amx_permitted: bool,
    pub neon: bool,
    pub dotprod: bool,
    pub i8mm: bool,
}

impl CpuFeatures {
    pub fn has_amx(&self) -> bool {
        self.amx_tile && self.amx_int8 && self.amx_bf16 && self.amx_permitted
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    Auto,
    X86Amx,
    X86,
    Arm,
    Phone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    Speed,
    Fidelity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    W4A8,
    W4A16,
}

impl WeightFormat {
    /// The group size when only the format is chosen: 128 for W4A8 (the fast kernel's case), 64 for
    /// W4A16 (where fidelity is the reason to pick it).
    pub fn default_group_size(self) -> usize {
        match self {
            WeightFormat::W4A8 => 128,
            WeightFormat::W4A16 => 64,
        }
    }
}

/// The decision, with the facts behind it.
#[derive(Debug, Clone, Serialize)]
pub struct WeightPath {
    pub target: &'static str,
    pub format: WeightFormat,
    pub group_size: usize,
    pub runs_in_vllm: bool,
    /// The consumer's kernel, when there is one.
    pub kernel: Option<&'static str>,
    /// False when the path has not been verified on a real consumer.
    pub verified: bool,
    /// Scales on QNN's LPBQ lattice (γ per output channel × k ∈ 1…16 per group), so
    /// `export-phone --precision w4a16` writes the same codes the checkpoint holds.
    #[serde(default)]
    pub lpbq: bool,
    pub reasons: Vec<String>,
}

impl WeightPath {
    /// Apply a user's explicit choices over the probe's: a format (recorded among the reasons)
    /// and a group size. Returns the format and group size to quantize with.
    pub fn override_with(
        &mut self,
        format: Option<WeightFormat>,
        group_size: Option<usize>,
    ) -> (WeightFormat, usize) {
        let chosen = format.unwrap_or(self.format);
        if let Some(f) = format {
            self.reasons.push(format!(
                "{} {} given explicitly",
                crate::setting::Setting::Format,
                serde_json::to_value(f)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default()
            ));
        }
        let default = match format {
            None => self.group_size,
            Some(f) => f.default_group_size(),
        };
        (chosen, group_size.unwrap_or(default))
    }
}

/// Detect the features of the CPU this process runs on, requesting AMX tile
/// permission from Linux on the way (a process must ask before its first
/// tile instruction; docs/GPTQ_FORMAT.md §7).
pub fn detect() -> CpuFeatures {
    #[cfg(target_arch = "x86_64")]
    {
        x86::detect()
    }
    #[cfg(target_arch = "aarch64")]
    {
        CpuFeatures {
            arch: Some(Arch::Aarch64),
            neon: std::arch::is_aarch64_feature_detected!("neon"),
            dotprod: std::arch::is_aarch64_feature_detected!("dotprod"),
            i8mm: std::arch::is_aarch64_feature_detected!("i8mm"),
            ..Default::default()
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        CpuFeatures {
            arch: Some(Arch::Other),
            ..Default::default()
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Arch, CpuFeatures};
    use std::arch::x86_64::__cpuid_count;

    pub fn detect() -> CpuFeatures {
        // The `amx-*` names are unstable in is_x86_feature_detected!, so read CPUID leaf 7 directly.
        let leaf7 = __cpuid_count(7, 0);
        let amx_bf16 = leaf7.edx & (1 << 22) != 0;
        let amx_tile = leaf7.edx & (1 << 24) != 0;
        let amx_int8 = leaf7.edx & (1 << 25) != 0;
        CpuFeatures {
            arch: Some(Arch::X86_64),
            avx2: is_x86_feature_detected!("avx2"),
            avx512f: is_x86_feature_detected!("avx512f"),
            avx512_vnni: is_x86_feature_detected!("avx512vnni"),
            avx512_bf16: is_x86_feature_detected!("avx512bf16"),
            amx_tile,
            amx_int8,
            amx_bf16,
            amx_permitted: amx_tile && request_amx_permission(),
            ..Default::default()
        }
    }

    #[cfg(target_os = "linux")]
    fn request_amx_permission() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain syscall with integer arguments; it only changes this process's permissions.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn request_amx_permission() -> bool {
        false
    }
}

/// The variable that stands in for this CPU's answer wherever `--target auto` asks the probe, so a
/// run (a test, a CI job, a build box quantizing for another server) does not depend on the machine
/// it runs on. Values: the non-auto `--target` names.
pub const TARGET_ENV: &str = "SPARK_TARGET";

/// `target`, with `Auto` replaced by `SPARK_TARGET` when that is set. An unknown value is an error
/// naming the variable and the values it takes.
fn resolve_auto(target: Target) -> Result<Target, String> {
    if target != Target::Auto {
        return Ok(target);
    }
    match std::env::var(TARGET_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(Target::Auto),
        Ok(v) => match v.as_str() {
            "" | "auto" => Ok(Target::Auto),
            "x86-amx" => Ok(Target::X86Amx),
            "x86" => Ok(Target::X86),
            "arm" => Ok(Target::Arm),
            "phone" => Ok(Target::Phone),
            _ => Err(format!(
                "{TARGET_ENV}={v:?}: expected one of x86-amx, x86, arm, phone (or auto for this CPU)"
            )),
        },
        Err(e) => Err(format!("{TARGET_ENV}: {e}")),
    }
}

/// `decide` for `target` with `Auto` resolved through `SPARK_TARGET` first; the reasons say when
/// the variable stood in for this CPU.
pub fn decide_here(
    f: &CpuFeatures,
    target: Target,
    priority: Priority,
) -> Result<WeightPath, String> {
    let resolved = resolve_auto(target)?;
    let mut path = decide(f, resolved, priority);
    if resolved != target {
        path.reasons.insert(
            0,
            format!(
                "{TARGET_ENV} is set: decided for {} instead of this CPU",
                path.target
            ),
        );
    }
    Ok(path)
}

/// Choose the artifact for `target` (Auto = this CPU) and `priority`.
pub fn decide(f: &CpuFeatures, target: Target, priority: Priority) -> WeightPath {
    let resolved = match target {
        Target::Auto => match f.arch {
            Some(Arch::X86_64) if f.has_amx() => Target::X86Amx,
            Some(Arch::X86_64) => Target::X86,
            Some(Arch::Aarch64) => Target::Arm,
            _ => Target::X86,
        },
        t => t,
    };
    let mut reasons = Vec::new();
    if target == Target::Auto {
        reasons.push(format!("detected {}", describe(f)));
    }
    match resolved {
        Target::Phone => WeightPath {
            target: "phone",
            format: WeightFormat::W4A16,
            group_size: 64,
            runs_in_vllm: true,
            kernel: Some("QNN HTP LPBQ MatMul (export-phone --precision w4a16)"),
            verified: false,
            lpbq: true,
            reasons: vec![
                "phones run the export-phone graph: W4A16 GPTQ with LPBQ scales (γ per channel × k ∈ 1…16 \
                 per group of 64), which the QNN HTP executes as block-quantized int4; the checkpoint is \
                 ordinary GPTQ v1 and runs in vLLM too. Checked on the HTP simulator, not on a phone"
                    .into(),
            ],
        },
        Target::X86Amx if priority == Priority::Speed => {
            reasons.push("AMX int8 tiles: vLLM CPU runs GPTQ sym through int4_scaled_mm_cpu (W4A8, per-token int8 activations)".into());
            WeightPath { target: "x86-amx", format: WeightFormat::W4A8, group_size: 128, runs_in_vllm: true, kernel: Some("vLLM int4_scaled_mm_cpu"), verified: true, lpbq: false, reasons }
        }
        Target::X86Amx | Target::X86 => {
            let amx = resolved == Target::X86Amx;
            if priority == Priority::Fidelity {
                reasons.push(format!(
                    "{} fidelity: keep bf16 activations (W4A16) and finer groups (g64)",
                    crate::setting::Setting::Priority
                ));
            } else {
                reasons.push("no AMX: vLLM CPU falls back to cpu_gemm_wna16 (W4A16, bf16 activations)".into());
            }
            // cpu_gemm_wna16 is compiled for AVX-512 only (docs/GPTQ_FORMAT.md §7).
            let avx512 = amx || f.avx512f || target != Target::Auto;
            if !avx512 {
                reasons.push("this CPU has no AVX-512: vLLM has no GPTQ CPU kernel for AVX2-only x86 (vLLM issue #55613); the checkpoint runs in spark-tool and GPTQ-capable runtimes, not in vLLM CPU".into());
            }
            WeightPath {
                target: if amx { "x86-amx" } else { "x86" },
                format: WeightFormat::W4A16,
                group_size: 64,
                runs_in_vllm: avx512,
                kernel: avx512.then_some(if amx { "vLLM cpu_gemm_wna16 (amx)" } else { "vLLM cpu_gemm_wna16 (vec)" }),
                verified: avx512,
                lpbq: false,
                reasons,
            }
        }
        Target::Arm | Target::Auto => {
            reasons.push("aarch64: vLLM compiles neither cpu_gemm_wna16 nor int4_scaled_mm_cpu for ARM, so GPTQ fails there (docs/GPTQ_FORMAT.md §7); W4A16 g64 is the format for spark-tool and other GPTQ runtimes on ARM".into());
            WeightPath { target: "arm", format: WeightFormat::W4A16, group_size: 64, runs_in_vllm: false, kernel: None, verified: false, lpbq: false, reasons }
        }
    }
}

pub fn describe(f: &CpuFeatures) -> String {
    let mut v = vec![format!("{:?}", f.arch.unwrap_or(Arch::Other))];
    for (name, on) in [
        ("avx2", f.avx2),
        ("avx512f", f.avx512f),
        ("avx512_vnni", f.avx512_vnni),
        ("avx512_bf16", f.avx512_bf16),
        ("amx_tile", f.amx_tile),
        ("amx_int8", f.amx_int8),
        ("amx_bf16", f.amx_bf16),
        ("amx_permitted", f.amx_permitted),
        ("neon", f.neon),
        ("dotprod", f.dotprod),
        ("i8mm", f.i8mm),
    ] {
        if on {
            v.push(name.to_string());
        }
    }
    v.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spr() -> CpuFeatures {
        CpuFeatures {
            arch: Some(Arch::X86_64),
            avx2: true,
            avx512f: true,
            avx512_vnni: true,
            avx512_bf16: true,
            amx_tile: true,
            amx_int8: true,
            amx_bf16: true,
            amx_permitted: true,
            ..Default::default()
        }
    }

    #[test]
    fn amx_speed_is_w4a8_g128() {
        let p = decide(&spr(), Target::Auto, Priority::Speed);
        assert_eq!(
            (p.format, p.group_size, p.runs_in_vllm, p.target),
            (WeightFormat::W4A8, 128, true, "x86-amx")
        );
    }

    #[test]
    fn explicit_format_and_group_size_override_the_probe() {
        let probe = || decide(&spr(), Target::Auto, Priority::Speed);
        let mut p = probe();
        assert_eq!(p.override_with(None, None), (WeightFormat::W4A8, 128));
        assert_eq!(
            p.reasons,
            probe().reasons,
            "nothing explicit, nothing recorded"
        );
        let mut p = probe();
        assert_eq!(
            p.override_with(Some(WeightFormat::W4A16), None),
            (WeightFormat::W4A16, 64)
        );
        assert!(p
            .reasons
            .last()
            .unwrap()
            .contains(&format!("{} w4a16", crate::setting::Setting::Format)));
        let mut p = probe();
        assert_eq!(
            p.override_with(Some(WeightFormat::W4A8), Some(64)),
            (WeightFormat::W4A8, 64)
        );
        assert_eq!(
            probe().override_with(None, Some(32)),
            (WeightFormat::W4A8, 32)
        );
    }

    #[test]
    fn amx_without_os_permission_is_not_amx() {
        let f = CpuFeatures {
            amx_permitted: false,
            ..spr()
        };
        let p = decide(&f, Target::Auto, Priority::Speed);
        assert_eq!(
            (p.format, p.group_size, p.target),
            (WeightFormat::W4A16, 64, "x86")
        );
    }

    #[test]
    fn fidelity_on_amx_is_w4a16_g64() {
        let p = decide(&spr(), Target::Auto, Priority::Fidelity);
        assert_eq!(
            (p.format, p.group_size, p.runs_in_vllm),
            (WeightFormat::W4A16, 64, true)
        );
    }

    #[test]
    fn avx2_only_x86_is_truthful_about_vllm() {
        let f = CpuFeatures {
            arch: Some(Arch::X86_64),
            avx2: true,
            ..Default::default()
        };
        let p = decide(&f, Target::Auto, Priority::Speed);
        assert_eq!(p.format, WeightFormat::W4A16);
        assert!(!p.runs_in_vllm && !p.verified);
        assert!(p.reasons.iter().any(|r| r.contains("no GPTQ CPU kernel")));
    }

    #[test]
    fn arm_is_w4a16_unverified_with_reason() {
        let f = CpuFeatures {
            arch: Some(Arch::Aarch64),
            neon: true,
            dotprod: true,
            ..Default::default()
        };
        let p = decide(&f, Target::Auto, Priority::Speed);
        assert_eq!(
            (p.format, p.group_size, p.runs_in_vllm, p.verified),
            (WeightFormat::W4A16, 64, false, false)
        );
        assert!(p.reasons.iter().any(|r| r.contains("aarch64")));
    }

    #[test]
    fn phone_is_w4a16_on_the_lpbq_lattice() {
        let p = decide(&spr(), Target::Phone, Priority::Speed);
        assert_eq!(
            (p.format, p.group_size, p.lpbq),
            (WeightFormat::W4A16, 64, true)
        );
    }

    #[test]
    fn explicit_target_overrides_detection() {
        let f = CpuFeatures {
            arch: Some(Arch::Aarch64),
            ..Default::default()
        };
        assert_eq!(
            decide(&f, Target::X86Amx, Priority::Speed).format,
            WeightFormat::W4A8
        );
    }
}
