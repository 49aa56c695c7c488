//! Times attention on a CUDA GPU in bf16 and prints one Markdown table: our
//! default path (`scaled_dot_product_attention`, which dispatches to
//! candle-flash-attn when built with `flash-attn`), candle-flash-attn called
//! directly, and the reference path (matmul, softmax, matmul).
//!
//! ```text
//! cargo run --release --features cuda,flash-attn --example bench_gpu
//! ```
//!
//! `scripts/gpu-check.sh` builds it and runs it on a GPU machine.

use std::time::Instant;

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor};
use multihead::attention::{scaled_dot_product_attention_via, AttnPath, Causal, Mask};

/// Median milliseconds of `f` over 20 runs after 3 warm-ups, each run
/// waited for on the device.
fn median_ms(dev: &Device, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let mut times = vec![];
    for _ in 0..20 {
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// candle-flash-attn on `(batch, seq, heads, head_dim)` inputs, as a user
/// of that crate calls it.
#[cfg(feature = "flash-attn")]
fn direct_flash(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    Ok(candle_flash_attn::flash_attn(q, k, v, scale, causal)?)
}

#[cfg(not(feature = "flash-attn"))]
fn direct_flash(_: &Tensor, _: &Tensor, _: &Tensor, _: f32, _: bool) -> Result<Tensor> {
    anyhow::bail!("built without `flash-attn`")
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0).context("bench_gpu needs a CUDA device and a `--features cuda` build")?;
    let ours_path = if cfg!(feature = "flash-attn") {
        "flash-attn"
    } else {
        "reference (no flash-attn)"
    };
    println!("bf16 on CUDA device 0, medians of 20 runs in ms; ours dispatches to: {ours_path}\n");
    println!("| work | ours | candle-flash-attn direct | reference | reference / ours |");
    println!("|---|---|---|---|---|");
    // (label, batch, heads, kv_heads, q_len, kv_len, head_dim, causal)
    let cases = [
        ("B8 N197 H12 hd64", 8, 12, 12, 197, 197, 64, false),
        ("B1 N1024 H8 hd64", 1, 8, 8, 1024, 1024, 64, false),
        ("B1 N4096 H8 hd64", 1, 8, 8, 4096, 4096, 64, false),
        ("causal B1 N4096 H8 hd64", 1, 8, 8, 4096, 4096, 64, true),
        ("B4 N2048 H32 hd128 GQA kv8", 4, 32, 8, 2048, 2048, 128, false),
        ("decode B8 H8 hd64 1 x 2048 keys", 8, 8, 8, 1, 2048, 64, true),
    ];
    for (label, b, h, kh, l, s, d, causal) in cases {
        let put = |t: Tensor| t.to_device(&dev)?.to_dtype(DType::BF16);
        let q = put(Tensor::randn(0f32, 1., (b, h, l, d), &Device::Cpu)?)?;
        let k = put(Tensor::randn(0f32, 1., (b, kh, s, d), &Device::Cpu)?)?;
        let v = put(Tensor::randn(0f32, 1., (b, kh, s, d), &Device::Cpu)?)?;
        let mask = if causal {
            Mask::causal(Causal::BottomRight)
        } else {
            Mask::new()
        };
        let time = |path| {
            median_ms(&dev, || {
                Ok(scaled_dot_product_attention_via(&q, &k, &v, &mask, None, path)?)
            })
        };
        let (ours, reference) = (time(AttnPath::Auto)?, time(AttnPath::Reference)?);
        let t = |x: &Tensor| x.transpose(1, 2)?.contiguous();
        let (qt, kt, vt) = (t(&q)?, t(&k)?, t(&v)?);
        let scale = 1. / (d as f32).sqrt();
        let direct = match median_ms(&dev, || direct_flash(&qt, &kt, &vt, scale, causal)) {
            Ok(ms) => format!("{ms:.3}"),
            Err(_) if !cfg!(feature = "flash-attn") => "not built".into(),
            Err(e) => return Err(e),
        };
        println!(
            "| {label} | {ours:.3} | {direct} | {reference:.3} | **{:.2}×** |",
            reference / ours
        );
    }
    Ok(())
}
