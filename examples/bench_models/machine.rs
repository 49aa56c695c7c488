//! The machine's own limits, to judge the kernels by: the FMA and
//! `vdpbf16ps` peaks, the read rate, and the process's memory counters.

use std::time::Instant;

use anyhow::{Context, Result};

/// `peak`: the FMA peak of every core at once; at `avx512bf16`, the
/// `vdpbf16ps` peak after it.
pub fn peak() -> Result<()> {
    let rates = on_every_core(|| fma_peak(100_000_000));
    let per_core: Vec<String> = rates.iter().map(|r| format!("{r:.1}")).collect();
    println!(
        r#"{{"work": "FMA peak, every core at once", "isa": "{}", "gflops_per_core": [{}], "gflops": {:.1}}}"#,
        multihead::attention::cpu_isa(),
        per_core.join(", "),
        rates.iter().sum::<f64>()
    );
    if multihead::attention::cpu_isa() == "avx512bf16" {
        let rates = on_every_core(|| dpbf16_peak(100_000_000));
        let per_core: Vec<String> = rates.iter().map(|r| format!("{r:.1}")).collect();
        println!(
            r#"{{"work": "vdpbf16ps peak, every core at once", "gflops_per_core": [{}], "gflops": {:.1}}}"#,
            per_core.join(", "),
            rates.iter().sum::<f64>()
        );
    }
    Ok(())
}

/// `stream MIB`: the rate each core reads a buffer of its own, every core
/// at once.
pub fn stream(mib: &str) -> Result<()> {
    let len = mib.parse::<usize>().context("stream takes a size in MiB")? << 18;
    let rates = on_every_core(|| {
        let buf = vec![1f32; len];
        read_rate(&buf, 2);
        read_rate(&buf, (1 << 30) / (len * 4).max(1))
    });
    let per_core: Vec<String> = rates.iter().map(|r| format!("{r:.1}")).collect();
    println!(
        r#"{{"work": "read {mib} MiB per core, every core at once", "gb_per_s_per_core": [{}]}}"#,
        per_core.join(", ")
    );
    Ok(())
}

/// GFLOP/s of independent FMA chains on `x86_64`, of the width the
/// kernels run with (`cpu_isa`: AVX-512F, or AVX2+FMA where the processor
/// or `MULTIHEAD_CPU_ISA` stops there), run for `iters` rounds; 0 on the
/// portable kernels.
pub fn fma_peak(iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        macro_rules! chains {
            ($feature:literal, $ty:ty, $lanes:expr, $chains:expr, $set1:ident, $fma:ident) => {{
                #[target_feature(enable = $feature)]
                unsafe fn run(iters: usize) -> f64 {
                    let (b, c) = std::hint::black_box(($set1(1.000_000_1), $set1(0.999_999)));
                    let mut acc: [$ty; $chains] = std::array::from_fn(|i| $set1(i as f32));
                    let t = Instant::now();
                    for _ in 0..iters {
                        for a in acc.iter_mut() {
                            *a = $fma(*a, b, c);
                        }
                    }
                    let secs = t.elapsed().as_secs_f64();
                    std::hint::black_box(acc);
                    (iters * $chains * $lanes * 2) as f64 / secs / 1e9
                }
                // SAFETY: the caller checked the features.
                unsafe { run(iters) }
            }};
        }
        // `cpu_isa` names only what the processor has. As many chains as
        // the registers hold with room to spare: AVX2's 16 `ymm` take 12
        // (24 spill and read low), enough to cover the FMA's latency on two
        // ports either way.
        match multihead::attention::cpu_isa() {
            "avx512" | "avx512bf16" => {
                return chains!("avx512f", __m512, 16, 24, _mm512_set1_ps, _mm512_fmadd_ps)
            }
            "avx2" => return chains!("avx2,fma", __m256, 8, 12, _mm256_set1_ps, _mm256_fmadd_ps),
            _ => {}
        }
    }
    let _ = iters;
    0.
}

/// The `vdpbf16ps` peak of this core in GFLOP/s (each instruction two
/// bf16 products and their sums into each of 16 f32 lanes: 64 FLOPs), 24
/// independent chains as in [`fma_peak`]; 0 where `cpu_isa` is not
/// `avx512bf16`.
pub fn dpbf16_peak(iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if multihead::attention::cpu_isa() == "avx512bf16" {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f,avx512bf16")]
        fn run(iters: usize) -> f64 {
            let (a, b) = std::hint::black_box((
                _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5), _mm512_set1_ps(0.25)),
                _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(-1e-3)),
            ));
            let mut acc: [__m512; 24] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
            let t = Instant::now();
            for _ in 0..iters {
                for c in acc.iter_mut() {
                    *c = _mm512_dpbf16_ps(*c, a, b);
                }
            }
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(acc);
            (iters * 24 * 64) as f64 / secs / 1e9
        }
        // SAFETY: `cpu_isa` names only what the processor has.
        return unsafe { run(iters) };
    }
    let _ = iters;
    0.
}

/// GB/s of summing `buf` `rounds` times (64 partial sums, so that it
/// vectorises into independent chains).
pub fn read_rate(buf: &[f32], rounds: usize) -> f64 {
    fn sum(buf: &[f32], lanes: &mut [f32; 64]) {
        for chunk in buf.chunks_exact(64) {
            for (l, &x) in lanes.iter_mut().zip(chunk) {
                *l += x;
            }
        }
    }
    // The same loop with 64-byte loads where the processor has them.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn sum_avx512(buf: &[f32], lanes: &mut [f32; 64]) {
        sum(buf, lanes)
    }
    let t = Instant::now();
    let mut lanes = [0f32; 64];
    for _ in 0..rounds {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the processor has AVX-512F.
            unsafe { sum_avx512(buf, &mut lanes) };
            continue;
        }
        sum(buf, &mut lanes);
    }
    std::hint::black_box(lanes);
    (rounds * buf.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// GB/s of every core at once reading a buffer of its own (`bufs`, one
/// a core), each the better of two passes, summed.
pub fn read_rate_every_core(bufs: &[Vec<f32>]) -> f64 {
    std::thread::scope(|s| {
        let handles: Vec<_> = bufs
            .iter()
            .map(|buf| s.spawn(move || read_rate(buf, 1).max(read_rate(buf, 1))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a probe thread panicked"))
            .sum()
    })
}

/// `f` on every core at once, one thread each; its results in order.
pub fn on_every_core<R: Send>(f: impl Fn() -> R + Sync) -> Vec<R> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..cores).map(|_| s.spawn(&f)).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a probe thread panicked"))
            .collect()
    })
}

/// Minor page faults of this process so far (all its threads), from
/// `/proc/self/stat`'s tenth field.
pub fn minor_faults() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // The fields after the command name, which may hold spaces, from the
    // third (the state) on.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, r)| r.split_whitespace().collect());
    fields
        .get(7)
        .and_then(|f| f.parse().ok())
        .context("no minflt in /proc/self/stat")
}
