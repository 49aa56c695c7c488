//! Criterion benchmarks of the models at issue 11's sizes (CPU, f32, random
//! weights initialised as the modules initialise them, held as plain
//! tensors so that the linears are packed as a loaded checkpoint's are):
//!
//! - `vit/vit_base_patch16_224/B1`, `B8`: timm's ViT-B/16, one forward of a
//!   224² batch;
//! - `transformer/forward B8 S64 T64`: `nn.Transformer(d_model=512,
//!   nhead=8)`, 6 + 6 layers, batch-first, a causal target mask;
//! - `transformer/encode + 32 greedy steps B8`: the encoder, then 32
//!   decoder steps over the cache, each step's output fed back;
//! - `mha/B8 N197 D768 H12`: `nn.MultiheadAttention(768, 12)` self-attention.
//!
//! ```text
//! cargo bench --bench models
//! ```
//!
//! `scripts/bench_vs_pytorch.py --models` runs the same works beside timm
//! and PyTorch, and the script without `--models` the MHA row.

use std::time::Duration;

use candle::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use multihead::attention::{Causal, Mask, MhaConfig, MultiheadAttention};
use multihead::models::transformer::{Transformer, TransformerConfig, TransformerMasks};
use multihead::models::vit::{VisionTransformer, VitConfig};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Random weights as `build` initialises them, detached from the
/// `VarMap` (whose variables would track gradients and keep candle's
/// differentiable paths).
fn random_weights(build: impl Fn(VarBuilder) -> candle::Result<()>) -> Res<VarBuilder<'static>> {
    let varmap = VarMap::new();
    build(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let plain = varmap
        .data()
        .lock()
        .map_err(|_| "poisoned VarMap lock")?
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
        .collect();
    Ok(VarBuilder::from_tensors(plain, DType::F32, &Device::Cpu))
}

fn randn(shape: &[usize]) -> candle::Result<Tensor> {
    Tensor::randn(0f32, 1., shape, &Device::Cpu)
}

fn vit(c: &mut Criterion) -> Res<()> {
    let cfg = VitConfig::base_patch16_224();
    let model = VisionTransformer::new(
        &cfg,
        random_weights(|vb| VisionTransformer::new(&cfg, vb).map(drop))?,
    )?;
    let mut group = c.benchmark_group("vit");
    group.sample_size(10).measurement_time(Duration::from_secs(15));
    for batch in [1usize, 8] {
        let x = randn(&[batch, 3, 224, 224])?;
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_with_input(
            BenchmarkId::new("vit_base_patch16_224", format!("B{batch}")),
            &x,
            |b, x| b.iter(|| model.forward(x).expect("ViT forward")),
        );
    }
    group.finish();
    Ok(())
}

fn transformer(c: &mut Criterion) -> Res<()> {
    let mut cfg = TransformerConfig::new(512, 8).with_batch_first(true);
    cfg.dropout = 0.;
    let model = Transformer::new(&cfg, random_weights(|vb| Transformer::new(&cfg, vb).map(drop))?)?;
    let (src, tgt) = (randn(&[8, 64, 512])?, randn(&[8, 64, 512])?);
    let masks = TransformerMasks {
        tgt: Mask::causal(Causal::TopLeft),
        ..Default::default()
    };
    let mut group = c.benchmark_group("transformer");
    group.sample_size(10).measurement_time(Duration::from_secs(10));
    group.bench_function("forward B8 S64 T64", |b| {
        b.iter(|| model.forward(&src, &tgt, &masks).expect("transformer forward"))
    });
    group.bench_function("encode + 32 greedy steps B8", |b| {
        b.iter(|| -> Tensor {
            let memory = model.encoder().forward(&src, &Mask::new()).expect("encoder");
            let mut cache = model.decoder().start(&memory, None).expect("decoder cache");
            let mut x = Tensor::zeros((8, 1, 512), DType::F32, &Device::Cpu).expect("zeros");
            for _ in 0..32 {
                x = model.decoder().step(&x, &mut cache).expect("decoder step");
            }
            x
        })
    });
    group.finish();
    Ok(())
}

fn mha(c: &mut Criterion) -> Res<()> {
    let cfg = MhaConfig::new(768, 12);
    let model = MultiheadAttention::new(
        &cfg,
        random_weights(|vb| MultiheadAttention::new(&cfg, vb).map(drop))?,
    )?;
    let x = randn(&[8, 197, 768])?;
    let mut group = c.benchmark_group("mha");
    group.sample_size(10);
    group.bench_function("B8 N197 D768 H12", |b| {
        b.iter(|| model.forward(&x).expect("MHA forward"))
    });
    group.finish();
    Ok(())
}

fn benches(c: &mut Criterion) {
    // A group whose model cannot be built reports why, and the others run.
    for (name, result) in [("vit", vit(c)), ("transformer", transformer(c)), ("mha", mha(c))] {
        if let Err(e) = result {
            eprintln!("{name} bench skipped: {e}");
        }
    }
}

criterion_group!(models, benches);
criterion_main!(models);
