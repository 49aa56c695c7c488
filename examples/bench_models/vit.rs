//! ViT-B/16's parts on their own: a block's residual adds fused or
//! apart, and the share of a forward its linears take.

use anyhow::{Context, Result};
use candle::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use multihead::attention::{MhaConfig, MhaOptions, MultiheadAttention, PackedLinear};

use crate::{alternating_ms, median, vit_b16};

/// `residual B`.
pub fn residual(batch: &str) -> Result<()> {
    // A ViT-B/16 block's two residual halves (norms left out), the
    // adds fused into the output projections and as candle adds,
    // in turn.
    let batch: usize = batch.parse().context("residual takes a batch size")?;
    let (dev, e) = (Device::Cpu, 768);
    let r = |s: &[usize]| -> Result<Tensor> { Ok((Tensor::randn(0f32, 1., s, &dev)? * 0.02)?) };
    let mha_weights = [
        ("in_proj_weight", r(&[3 * e, e])?),
        ("in_proj_bias", r(&[3 * e])?),
        ("out_proj.weight", r(&[e, e])?),
        ("out_proj.bias", r(&[e])?),
    ]
    .into_iter()
    .map(|(name, t)| (name.to_string(), t))
    .collect();
    let mha = MultiheadAttention::new(
        &MhaConfig::new(e, 12),
        VarBuilder::from_tensors(mha_weights, DType::F32, &dev),
    )?;
    let fc1 = PackedLinear::new(r(&[4 * e, e])?, Some(r(&[4 * e])?))?;
    let fc2 = PackedLinear::new(r(&[e, 4 * e])?, Some(r(&[e])?))?;
    let x = Tensor::randn(0f32, 1., (batch, 197, e), &dev)?;
    let times = alternating_ms(&mut [
        &mut || {
            let opts = MhaOptions::new().with_residual(x.clone());
            let x = mha.forward_attn(&x, &x, &x, &opts)?.output;
            Ok(fc2.forward_add(&fc1.forward_gelu(&x)?, &x).map(drop)?)
        },
        &mut || {
            let x = (&x + mha.forward(&x)?)?;
            Ok((&x + fc2.forward(&fc1.forward_gelu(&x)?)?).map(drop)?)
        },
    ])?;
    let ratios: Vec<f64> = times[1]
        .iter()
        .zip(&times[0])
        .map(|(sep, fused)| sep / fused)
        .collect();
    println!(
        r#"{{"work": "ViT-B/16 block halves B{batch}", "fused_ms": {:.2}, "separate_adds_ms": {:.2}, "rounds": {}, "speed_fused": {:.3}}}"#,
        median(&times[0]),
        median(&times[1]),
        ratios.len(),
        median(&ratios)
    );
    Ok(())
}

/// `vit-linears B`.
pub fn vit_linears(batch: &str) -> Result<()> {
    // The share of a ViT-B/16 forward that its 48 linears take on
    // their own: the forward (random weights) and the same linears
    // (qkv, proj, fc1 with its GELU, fc2 of 12 blocks, each with
    // weights of its own, so that they come from memory as the
    // forward's do) over fixed inputs of its rows, in turn.
    let batch: usize = batch.parse().context("vit-linears takes a batch size")?;
    let vit = vit_b16(None)?;
    let dev = Device::Cpu;
    let (e, rows) = (768, batch * 197);
    let linear = |n: usize, k: usize| -> Result<PackedLinear> {
        let w = (Tensor::randn(0f32, 1., (n, k), &dev)? * 0.02)?;
        Ok(PackedLinear::new(w, Some(Tensor::zeros(n, DType::F32, &dev)?))?)
    };
    let blocks = (0..12)
        .map(|_| {
            Ok([
                linear(3 * e, e)?,
                linear(e, e)?,
                linear(4 * e, e)?,
                linear(e, 4 * e)?,
            ])
        })
        .collect::<Result<Vec<_>>>()?;
    let (x, hidden) = (
        Tensor::randn(0f32, 1., (rows, e), &dev)?,
        Tensor::randn(0f32, 1., (rows, 4 * e), &dev)?,
    );
    let img = Tensor::randn(0f32, 1., (batch, 3, 224, 224), &dev)?;
    let times = alternating_ms(&mut [&mut || Ok(vit.forward(&img).map(drop)?), &mut || {
        for [qkv, proj, fc1, fc2] in &blocks {
            qkv.forward(&x)?;
            proj.forward(&x)?;
            fc1.forward_gelu(&x)?;
            fc2.forward(&hidden)?;
        }
        Ok(())
    }])?;
    let gflop = 12. * 2. * (rows * e * (3 * e + e + 4 * e + 4 * e)) as f64 / 1e9;
    let (forward, linears) = (median(&times[0]), median(&times[1]));
    println!(
        r#"{{"work": "ViT-B/16 B{batch}: forward and its linears alone", "forward_ms": {forward:.2}, "linears_ms": {linears:.2}, "linears_gflops": {:.1}, "linears_share": {:.3}}}"#,
        gflop / (linears * 1e-3),
        linears / forward
    );
    Ok(())
}
