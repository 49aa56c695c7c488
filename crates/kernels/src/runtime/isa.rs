//! The one place that detects the instruction set the CPU code runs with.
//!
//! [`current`], the default every entry point takes: the best the
//! processor has, unless `MULTIHEAD_CPU_ISA` (`avx512bf16`, `avx512`,
//! `avx2` or `portable`, read once) asks for less. A caller that wants
//! another passes it (`PackOptions::isa`, `TileOptions::isa`): every
//! kernel that dispatches takes the [`Isa`] it runs with as an argument,
//! so two calls on two instruction sets can run at once. Asking for more
//! than the processor has gets what it has ([`runnable`]); the tests run
//! each of [`supported`].
//!
//! AMX is not among them: its tiles multiply bf16 and int8, not f32, and
//! an f32-exact product from bf16 parts costs more than AVX-512's FMAs.

use std::sync::OnceLock;

/// Instruction sets, weakest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, compiled for the baseline target.
    Portable,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-512F (with AVX2 and FMA).
    Avx512,
    /// AVX-512F with AVX512-BF16: bf16 weights multiply bf16-rounded
    /// inputs with `vdpbf16ps` (PyTorch's CPU bf16 autocast numerics);
    /// everything else runs as with [`Isa::Avx512`].
    Avx512Bf16,
}

impl Isa {
    const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    /// The name `MULTIHEAD_CPU_ISA` takes for it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    fn parse(name: &str) -> Option<Isa> {
        let name = name.trim().to_ascii_lowercase();
        Isa::ALL.into_iter().find(|isa| isa.name() == name)
    }
}

/// What the processor runs.
fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // F16C (half-precision conversions) came with or before AVX2
            // on every processor that has it; the f16 weights' kernels
            // use it.
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return match (
                    is_x86_feature_detected!("avx512f"),
                    is_x86_feature_detected!("avx512bf16"),
                ) {
                    (true, true) => Isa::Avx512Bf16,
                    (true, false) => Isa::Avx512,
                    (false, _) => Isa::Avx2,
                };
            }
        }
        Isa::Portable
    })
}

/// Whether the AVX-512 kernels may take AVX512-VNNI's int8 dot products
/// (`vpdpbusd`, with AVX512BW) when running with `isa`: the processor has
/// both and `isa` is [`Isa::Avx512`] or above (AVX2 or the portable code
/// leaves them off with the rest of AVX-512).
pub(crate) fn has_vnni(isa: Isa) -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    let detected = *VNNI.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    });
    detected && isa >= Isa::Avx512
}

/// [`has_vnni`] with AVX512-VL besides: `vpdpbusd` on 256-bit vectors.
pub(crate) fn has_vnni_vl(isa: Isa) -> bool {
    static VL: OnceLock<bool> = OnceLock::new();
    let detected = *VL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512vl")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    });
    detected && has_vnni(isa)
}

/// The L2 cache of one core in bytes, where the processor reports it
/// (CPUID leaf `0x8000_0006`, which Intel and AMD both fill), read once.
pub(crate) fn l2_bytes() -> Option<usize> {
    static L2: OnceLock<Option<usize>> = OnceLock::new();
    *L2.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        #[allow(unused_unsafe)]
        // SAFETY: every x86-64 processor has CPUID; the extended leaf is
        // read only where the processor lists it.
        unsafe {
            use std::arch::x86_64::__cpuid;
            if __cpuid(0x8000_0000).eax >= 0x8000_0006 {
                let kib = __cpuid(0x8000_0006).ecx >> 16;
                if kib > 0 {
                    return Some(kib as usize * 1024);
                }
            }
        }
        None
    })
}

/// `MULTIHEAD_CPU_ISA`, read once; an unknown name is ignored with a
/// warning on stderr.
fn from_env() -> Option<Isa> {
    static ENV: OnceLock<Option<Isa>> = OnceLock::new();
    *ENV.get_or_init(|| {
        let name = std::env::var("MULTIHEAD_CPU_ISA").ok()?;
        let isa = Isa::parse(&name);
        if isa.is_none() {
            eprintln!(
                "multihead: MULTIHEAD_CPU_ISA={name:?} is not avx512bf16, avx512, avx2 or portable; ignored"
            );
        }
        isa
    })
}

/// The instruction set the kernels run with where the caller names none:
/// the best the processor has, capped by `MULTIHEAD_CPU_ISA`.
pub fn current() -> Isa {
    from_env().map_or(detected(), |cap| cap.min(detected()))
}

/// `isa` where the processor runs it, else the best it runs: what a
/// caller's explicit choice runs with. `MULTIHEAD_CPU_ISA` caps only the
/// default ([`current`]), so that a test can run every one of
/// [`supported`] under it.
pub fn runnable(isa: Isa) -> Isa {
    isa.min(detected())
}

/// Every instruction set this processor runs, weakest first.
pub fn supported() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|&i| i <= detected()).collect()
}

#[cfg(test)]
mod tests {
    use super::{current, detected, from_env, runnable, supported, Isa};

    #[test]
    fn every_name_parses_back_and_a_choice_runs_where_the_processor_can() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
            assert_eq!(Isa::parse(&format!(" {} ", isa.name().to_uppercase())), Some(isa));
            assert_eq!(runnable(isa), isa.min(detected()));
        }
        assert_eq!(Isa::parse("avx"), None);
        for isa in supported() {
            assert_eq!(runnable(isa), isa);
        }
        assert_eq!(current(), detected().min(from_env().unwrap_or(detected())));
    }
}
