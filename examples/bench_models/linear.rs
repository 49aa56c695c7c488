//! The linear layers on their own: packed against candle's matmul, f32
//! against bf16 panels, one core's share of its peak, one call against a
//! copy per thread, and a decode step's linears.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Module, Tensor};
use multihead::attention::PackedLinear;
use multihead::kernels::{with_threads, PackFormat, PackOptions};

use crate::machine::fma_peak;
use crate::{alternating_ms, dtype_name, median, median_ms, quantile, share_fields, timed};

/// `LAYERS` (default 1) linear layers of `(M, K) x (K, N)`, each with
/// random weights of its own, three ways: packed, candle's `Linear` and
/// candle's matmul with the weight stored `(k, n)`; and the input.
struct LinearLayers {
    x: Tensor,
    packed: Vec<PackedLinear>,
    linear: Vec<candle_nn::Linear>,
    wt: Vec<Tensor>,
    /// Of one pass over the layers.
    gflop: f64,
    /// The work's name in the output.
    work: String,
}

impl LinearLayers {
    /// The three ways' names, in order.
    const PATHS: [&str; 3] = [
        "PackedLinear",
        "candle_nn::Linear",
        "candle matmul, (k, n) weight",
    ];

    fn new(m: &str, k: &str, n: &str, rest: &[&str]) -> Result<Self> {
        let (m, k, n): (usize, usize, usize) = (m.parse()?, k.parse()?, n.parse()?);
        let layers: usize = rest.first().map_or(Ok(1), |l| l.parse()).context("LAYERS")?;
        let mut layer_set = LinearLayers {
            x: Tensor::randn(0f32, 1., (m, k), &Device::Cpu)?,
            packed: Vec::new(),
            linear: Vec::new(),
            wt: Vec::new(),
            gflop: 2. * (m * k * n * layers) as f64 / 1e9,
            work: match layers {
                1 => format!("linear {m}x{k} -> {n}"),
                _ => format!("linear {m}x{k} -> {n}, {layers} layers"),
            },
        };
        for _ in 0..layers {
            let w = Tensor::randn(0f32, 1., (n, k), &Device::Cpu)?;
            layer_set.packed.push(PackedLinear::new(w.clone(), None)?);
            layer_set.linear.push(candle_nn::Linear::new(w.clone(), None));
            layer_set.wt.push(w.t()?.contiguous()?);
        }
        Ok(layer_set)
    }
}

/// `linear M K N [LAYERS]`: the packed layers, candle's `Linear` and
/// candle's matmul in turn; each one's rate and speed against the matmul.
pub fn linear(m: &str, k: &str, n: &str, rest: &[&str]) -> Result<()> {
    // One packed linear against candle's matmul on the same shapes;
    // with LAYERS, that many of them, each with its own weights,
    // run one after another, as a model's are, so that the
    // weights come from memory rather than cache.
    let LinearLayers {
        x,
        packed,
        linear,
        wt,
        gflop,
        work,
    } = LinearLayers::new(m, k, n, rest)?;
    // The three paths in turn, each round; the ratio is the median
    // of the rounds' ratios to the (k, n) matmul.
    let times = alternating_ms(&mut [
        &mut || packed.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)),
        &mut || linear.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)),
        &mut || wt.iter().try_for_each(|wt| Ok(x.matmul(wt).map(drop)?)),
    ])?;
    for (path, path_times) in LinearLayers::PATHS.iter().zip(&times) {
        let ms = median(path_times);
        let ratios: Vec<f64> = path_times.iter().zip(&times[2]).map(|(t, m)| m / t).collect();
        println!(
            r#"{{"work": "{work}", "path": "{path}", "median_ms": {ms:.3}, "gflops": {:.1}, "speed_vs_matmul": {:.3}}}"#,
            gflop / (ms * 1e-3),
            median(&ratios)
        );
    }
    Ok(())
}

/// `linear-bf16 M K N [LAYERS]`: the packed layers with f32 and with bf16
/// weights in turn; the rates and the bf16 speed-up.
pub fn linear_bf16(m: &str, k: &str, n: &str, rest: &[&str]) -> Result<()> {
    // The `linear` mode's packed layers with their weights in f32
    // and in bf16, in turn: what the bf16 panels (on AVX512-BF16,
    // `vdpbf16ps` over inputs rounded to bf16) gain over f32.
    let LinearLayers {
        x,
        packed,
        gflop,
        work,
        ..
    } = LinearLayers::new(m, k, n, rest)?;
    let bf16 = packed
        .iter()
        .map(|l| Ok(PackedLinear::new(l.weight()?.to_dtype(DType::BF16)?, None)?))
        .collect::<Result<Vec<_>>>()?;
    let times = alternating_ms(&mut [
        &mut || packed.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)),
        &mut || bf16.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)),
    ])?;
    let ratios: Vec<f64> = times[0].iter().zip(&times[1]).map(|(f, b)| f / b).collect();
    let (f32_ms, bf16_ms) = (median(&times[0]), median(&times[1]));
    println!(
        r#"{{"work": "{work}", "isa": "{}", "f32_gflops": {:.1}, "bf16_gflops": {:.1}, "bf16_speedup": {:.3}}}"#,
        multihead::attention::cpu_isa(),
        gflop / (f32_ms * 1e-3),
        gflop / (bf16_ms * 1e-3),
        median(&ratios)
    );
    Ok(())
}

/// `share M K N [LAYERS]`: one core's share of its FMA peak, the packed
/// layers' and candle's matmul's, the peak measured beside each round.
pub fn share(m: &str, k: &str, n: &str, rest: &[&str]) -> Result<()> {
    // One core's share of its FMA peak: rounds of the peak, the
    // packed layers, candle's matmul and the peak again, so that
    // each rate is divided by the peak of the same moment.
    if candle::utils::get_num_threads() != 1 {
        bail!("share measures one core: run it with RAYON_NUM_THREADS=1");
    }
    if fma_peak(1) == 0. {
        bail!(
            "share needs the AVX-512F or AVX2 kernels for its peak loop, not {}",
            multihead::attention::cpu_isa()
        );
    }
    let LinearLayers {
        x,
        packed,
        wt,
        gflop,
        work,
        ..
    } = LinearLayers::new(m, k, n, rest)?;
    let mut shares = [Vec::new(), Vec::new()];
    let mut peaks = Vec::new();
    let start = Instant::now();
    while peaks.len() < 10 || (start.elapsed().as_secs_f64() < 6. && peaks.len() < 200) {
        let peak = fma_peak(1_000_000);
        let times = [
            timed(|| packed.iter().try_for_each(|l| Ok(l.forward(&x).map(drop)?)))?,
            timed(|| wt.iter().try_for_each(|wt| Ok(x.matmul(wt).map(drop)?)))?,
        ];
        let peak = (peak + fma_peak(1_000_000)) / 2.;
        for (shares, secs) in shares.iter_mut().zip(times) {
            shares.push(gflop / secs / peak);
        }
        peaks.push(peak);
    }
    for (path, shares) in [LinearLayers::PATHS[0], LinearLayers::PATHS[2]]
        .iter()
        .zip(&mut shares)
    {
        shares.sort_by(f64::total_cmp);
        println!(
            r#"{{"work": "{work}, one core", "path": "{path}", "rounds": {}, "peak_gflops": {:.1}, {}}}"#,
            shares.len(),
            median(&peaks),
            share_fields("share_of_peak", shares)
        );
    }
    Ok(())
}

/// `split M K N [LAYERS]`: one call over the pool's threads against a copy
/// of the layers per thread, all at once, and one copy alone.
pub fn split(m: &str, k: &str, n: &str, rest: &[&str]) -> Result<()> {
    // One call on every core against a copy of the layers per core,
    // each copy's calls on its own thread alone, all at once, and one
    // copy alone, round after round.
    let cores = multihead::kernels::threads();
    if cores < 2 {
        bail!("split compares one call over the pool's threads with a copy per thread: it needs two or more");
    }
    let copies = (0..cores)
        .map(|_| LinearLayers::new(m, k, n, rest))
        .collect::<Result<Vec<_>>>()?;
    // GFLOP/s of one pass over a copy's packed layers.
    let rate = |c: &LinearLayers| -> Result<f64> {
        Ok(c.gflop / timed(|| c.packed.iter().try_for_each(|l| Ok(l.forward(&c.x).map(drop)?)))?)
    };
    let (mut alone, mut at_once, mut call) = (vec![], vec![], vec![]);
    let (mut at_once_over_alone, mut call_over_sum) = (vec![], vec![]);
    let start = Instant::now();
    while alone.len() < 10 || (start.elapsed().as_secs_f64() < 6. && alone.len() < 200) {
        let one = with_threads(1, || rate(&copies[0]))?;
        let each = std::thread::scope(|s| {
            let runs: Vec<_> = copies
                .iter()
                .map(|c| s.spawn(move || with_threads(1, || rate(c))))
                .collect();
            runs.into_iter()
                .map(|r| r.join().expect("a copy's thread panicked"))
                .collect::<Result<Vec<f64>>>()
        })?;
        let split = rate(&copies[0])?;
        let sum: f64 = each.iter().sum();
        at_once_over_alone.push(sum / cores as f64 / one);
        call_over_sum.push(split / sum);
        alone.push(one);
        at_once.push(sum);
        call.push(split);
    }
    // "median, [lower quartile, upper quartile]".
    let q = |xs: &mut Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        format!(
            "{:.3}, [{:.3}, {:.3}]",
            quantile(xs, 0.5),
            quantile(xs, 0.25),
            quantile(xs, 0.75)
        )
    };
    println!(
        r#"{{"work": "{}, {cores} threads", "rounds": {}, "one_copy_alone_gflops": {:.1}, "copies_at_once_gflops": {:.1}, "one_call_gflops": {:.1}, "copy_at_once_over_alone": [{}], "call_over_copies": [{}]}}"#,
        copies[0].work,
        alone.len(),
        median(&alone),
        median(&at_once),
        median(&call),
        q(&mut at_once_over_alone),
        q(&mut call_over_sum)
    );
    Ok(())
}

/// `decode-layers DTYPE`: a decode step's linears of the 0.39 B
/// Llama-shaped decoder alone, one row through each: the rate its weights
/// stream at.
pub fn decode_layers(dtype: &str) -> Result<()> {
    // A decode step's linears alone: the 0.39 B Llama-shaped
    // decoder's (24 layers of 896 wide, GQA 14/2, 4864
    // intermediate, a 32000-token head), one row through each in
    // turn, weights in `dtype`, each from memory: the rate the
    // weights stream at, to set beside the whole step's.
    let (dtype, format) = match dtype {
        "f32" => (DType::F32, PackFormat::AsStored),
        "bf16" => (DType::BF16, PackFormat::AsStored),
        "f16" => (DType::F16, PackFormat::AsStored),
        "q8_0" => (DType::F32, PackFormat::Q8_0),
        "q4_0" => (DType::F32, PackFormat::Q4_0),
        "q4_k" => (DType::F32, PackFormat::Q4_K),
        other => bail!("decode-layers takes f32, bf16, f16, q8_0, q4_0 or q4_k, not {other}"),
    };
    let dev = Device::Cpu;
    let mut shapes = Vec::new();
    for _ in 0..24 {
        shapes.extend([(896 + 2 * 128, 896), (896, 896), (2 * 4864, 896), (896, 4864)]);
    }
    shapes.push((32000, 896));
    let layers = shapes
        .iter()
        .map(|&(n, k)| {
            let w = (Tensor::randn(0f32, 1., (n, k), &dev)? * 0.02)?.to_dtype(dtype)?;
            Ok(PackedLinear::with_options(
                w,
                None,
                &PackOptions::new().with_format(format),
            )?)
        })
        .collect::<Result<Vec<_>>>()?;
    let inputs = [896, 4864]
        .map(|k| Tensor::randn(0f32, 1., (1, k), &dev))
        .into_iter()
        .collect::<candle::Result<Vec<_>>>()?;
    let ms = median_ms(|| {
        for (layer, &(_, k)) in layers.iter().zip(&shapes) {
            layer.forward(&inputs[usize::from(k != 896)])?;
        }
        Ok(())
    })?;
    let bytes: f64 = shapes
        .iter()
        .map(|&(n, k)| {
            (n * k) as f64
                * match format {
                    PackFormat::Q8_0 => 34. / 32.,
                    PackFormat::Q4_0 => 18. / 32.,
                    // Q5_0 where 256 does not divide the input size.
                    PackFormat::Q4_K if k % 256 == 0 => 144. / 256.,
                    PackFormat::Q4_K => 22. / 32.,
                    PackFormat::AsStored => dtype.size_in_bytes() as f64,
                }
        })
        .sum();
    println!(
        r#"{{"work": "decode-layers {}", "median_ms": {ms:.2}, "gb_per_s": {:.1}, "tokens_per_s": {:.1}}}"#,
        dtype_name(format, dtype),
        bytes / (ms * 1e-3) / 1e9,
        1e3 / ms
    );
    Ok(())
}
