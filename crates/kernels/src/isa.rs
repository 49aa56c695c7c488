//! The one place that picks the instruction set the CPU code runs with.
//!
//! The best the processor has, unless `MULTIHEAD_CPU_ISA` (`avx512`,
//! `avx2` or `portable`, read once) or [`force`] (tests) asks for less;
//! asking for more than the processor has gets what it has.
//!
//! AMX is not among them: the Xeons that have it (AMX-BF16, AMX-INT8)
//! multiply no f32. On the README's Xeon (a KVM guest, whose kernel grants
//! `XTILEDATA`), a C loop of `tdpbf16ps` on 16 × 16 tiles from registers ran
//! at 0.91–1.12 TFLOP/s of bf16 a core (one to four accumulators; 1.02 with
//! the four operand tiles loaded from L1 each step; one of 2026-12-02's
//! runs, a program not in the repo), against 150–160 GFLOP/s of f32 FMA. A
//! product as exact as f32's needs each operand split into three bf16
//! parts and six of their products: at most about 190 GFLOP/s of f32
//! work before splitting the inputs and loading tiles, 1.2× the FMA peak;
//! three products (about 370) leave a relative error near 2⁻¹⁶, a hundred
//! times f32's, which results checked against PyTorch's to 1e-5 cannot
//! take.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// Instruction sets, weakest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Isa {
    /// Plain Rust, compiled for the baseline target.
    Portable,
    /// AVX2 and FMA.
    Avx2,
    /// AVX-512F (with AVX2 and FMA).
    Avx512,
}

impl Isa {
    const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// The name `MULTIHEAD_CPU_ISA` takes for it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
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
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return if is_x86_feature_detected!("avx512f") {
                    Isa::Avx512
                } else {
                    Isa::Avx2
                };
            }
        }
        Isa::Portable
    })
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
            eprintln!("multihead: MULTIHEAD_CPU_ISA={name:?} is not avx512, avx2 or portable; ignored");
        }
        isa
    })
}

/// 0: not forced; else 1 + the index in `Isa::ALL`.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// The instruction set to run with now.
pub(crate) fn current() -> Isa {
    let forced = match FORCED.load(Ordering::Relaxed) {
        0 => from_env(),
        i => Isa::ALL.get(usize::from(i) - 1).copied(),
    };
    forced.map_or(detected(), |f| f.min(detected()))
}

/// Held by tests that [`force`] an instruction set, so that two of them
/// do not interleave.
#[cfg(test)]
pub(crate) static FORCE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Forces an instruction set (`None`: back to the default) for the whole
/// process; tests use it (holding [`FORCE_LOCK`]) to run every variant the
/// processor supports.
#[cfg(test)]
pub(crate) fn force(isa: Option<Isa>) {
    let i = isa.map_or(0, |isa| {
        Isa::ALL.iter().position(|&x| x == isa).map_or(0, |i| i as u8 + 1)
    });
    FORCED.store(i, Ordering::Relaxed);
}

/// Every instruction set this processor runs, weakest first.
#[cfg(test)]
pub(crate) fn supported() -> Vec<Isa> {
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
            assert_eq!(crate::cpu_isa(), isa.name());
        }
        force(None);
        assert_eq!(crate::cpu_isa(), super::current().name());
    }
}
