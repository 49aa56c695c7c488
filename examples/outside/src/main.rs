//! Uses the multihead crates from outside their workspace: a causal
//! self-attention on random input, then the shipped digits ViT loaded
//! through the checked path (`Checkpoint`) and run on a sample image.
//!
//! `cargo run --release --manifest-path examples/outside/Cargo.toml [IMAGE]`

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead_attention::{Causal, Mask, MhaConfig, MhaOptions, MultiheadAttention};
use multihead_models::checkpoint::Checkpoint;
use multihead_models::image_input::{decode_image, pixels_u8};
use multihead_models::vit::{preprocess, VisionTransformer, VitConfig};

fn main() -> Result<()> {
    let dev = Device::Cpu;

    // Attention with freshly initialised weights, as in a model being trained.
    let varmap = VarMap::new();
    let mha = MultiheadAttention::new(
        &MhaConfig::new(32, 4),
        VarBuilder::from_varmap(&varmap, DType::F32, &dev),
    )?;
    let x = Tensor::randn(0f32, 1., (2, 5, 32), &dev)?; // (batch, seq, embed)
    let opts = MhaOptions::new().with_mask(Mask::causal(Causal::TopLeft));
    let y = mha.forward_attn(&x, &x, &x, &opts)?.output;
    println!("causal self-attention: {:?} -> {:?}", x.dims(), y.dims());

    // A ViT checkpoint: config, checked weights, model.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../weights/vit-digits");
    let config = dir.join("config.json");
    let cfg = VitConfig::from_json(
        &std::fs::read_to_string(&config).with_context(|| format!("reading {}", config.display()))?,
    )?;
    let ckpt = Checkpoint::read(&dir.join("model.safetensors"))?;
    let vit = ckpt.load(DType::F32, &dev, |vb| VisionTransformer::new(&cfg, vb))?;

    let image = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.join("samples/digit7_0413.png"));
    let bytes = std::fs::read(&image).with_context(|| format!("reading {}", image.display()))?;
    let img = decode_image(&bytes, &image.display().to_string())?;
    let px = pixels_u8(&img, cfg.in_chans, (cfg.img_size, cfg.img_size))?;
    let px = Tensor::from_vec(px.data, (px.channels, px.height, px.width), &dev)?;
    let probs: Vec<f32> = vit
        .probabilities(&preprocess(&cfg, &px)?.unsqueeze(0)?)?
        .squeeze(0)?
        .to_vec1()?;
    let (best, p) = probs
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .context("no classes")?;
    println!("{}: {} ({:.1} %)", image.display(), cfg.label(best), 100. * p);
    Ok(())
}
