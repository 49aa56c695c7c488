//! The one place that picks the instruction set the CPU code runs with.
//!
//! The best the processor has, unless `MULTIHEAD_CPU_ISA` (`avx512bf16`,
//! `avx512`, `avx2` or `portable`, read once) or [`force`] (tests,
//! benchmarks) asks for less; asking for more than the processor has gets
//! what it has.
//!
//! AMX is not among them: its tiles multiply bf16 and int8, not f32, and
//! an f32-exact product from bf16 parts costs more than AVX-512's FMAs.

use std::sync::atomic::{AtomicU8, Ordering};
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
/// (`vpdpbusd`, with AVX512BW): the processor has both and the
/// instruction set is not capped below [`Isa::Avx512`] (forcing AVX2 or
/// the portable code turns them off with the rest of AVX-512).
pub(crate) fn has_vnni() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    let detected = *VNNI.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    });
    detected && current() >= Isa::Avx512
}

/// [`has_vnni`] with AVX512-VL besides: `vpdpbusd` on 256-bit vectors.
pub(crate) fn has_vnni_vl() -> bool {
    static VL: OnceLock<bool> = OnceLock::new();
    let detected = *VL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512vl")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    });
    detected && has_vnni()
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

/// 0: not forced; else 1 + the index in `Isa::ALL`.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// The instruction set to run with now.
pub fn current() -> Isa {
    let forced = match FORCED.load(Ordering::Relaxed) {
        0 => from_env(),
        i => Isa::ALL.get(usize::from(i) - 1).copied(),
    };
    forced.map_or(detected(), |f| f.min(detected()))
}

/// Held by the crate's tests that [`force`] an instruction set, so that two
/// of them do not interleave.
#[cfg(test)]
pub(crate) static FORCE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Caps the instruction set at `isa` (`None`: back to `MULTIHEAD_CPU_ISA`
/// or the best the processor has) for the whole process, from the next
/// kernel call on; more than the processor has gets what it has. Tests use
/// it to run every variant the processor supports; tests that force
/// different sets must not run at once.
pub fn force(isa: Option<Isa>) {
    let i = isa.map_or(0, |isa| {
        Isa::ALL.iter().position(|&x| x == isa).map_or(0, |i| i as u8 + 1)
    });
    FORCED.store(i, Ordering::Relaxed);
}

/// Every instruction set this processor runs, weakest first.
pub fn supported() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|&i| i <= detected()).collect()
}

#[cfg(test)]
mod tests {
    use super::{force, supported, Isa, FORCE_LOCK};

    #[test]
    fn every_name_parses_back_and_cpu_isa_names_the_forced_set() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
            assert_eq!(Isa::parse(&format!(" {} ", isa.name().to_uppercase())), Some(isa));
        }
        assert_eq!(Isa::parse("avx"), None);
        let _lock = FORCE_LOCK.lock();
        for isa in supported() {
            force(Some(isa));
            assert_eq!(super::current().name(), isa.name());
        }
        force(None);
        assert_eq!(
            super::current(),
            super::detected().min(super::from_env().unwrap_or(super::detected()))
        );
    }
}
