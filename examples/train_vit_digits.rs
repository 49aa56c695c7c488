//! Trains the shipped digits ViT from scratch in Rust, as
//! `scripts/train_vit_digits.py` does in PyTorch: the same model
//! (`weights/vit-digits/config.json`), the same 80/20 split, preprocessing
//! and augmentation (shifts of up to 2 pixels), AdamW (weight decay 0.05)
//! under a one-cycle schedule, cross-entropy with label smoothing 0.1,
//! batches of 32.
//!
//! ```text
//! cargo run --release --example train_vit_digits -- --epochs 30 --out target/runs/softmax
//! cargo run --release --example train_vit_digits -- --epochs 30 --hydra-layers 2,3 --out target/runs/hydra
//! cargo run --release -- vit --weights target/runs/hydra/model.safetensors \
//!     --config target/runs/hydra/config.json --eval weights/vit-digits/heldout
//! ```
//!
//! Training images: `weights/vit-digits/train-8x8.safetensors`
//! (`scripts/export_digits_train.py`); held-out: the committed PNGs in
//! `weights/vit-digits/heldout/<class>/`, read from disk as `multihead vit`
//! reads them.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Module, Tensor, D};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use multihead::kernels::optim::AdamW;
use multihead::models::vit::{preprocess, VisionTransformer, VitConfig};

const DATA_DIR: &str = "weights/vit-digits";
const BATCH: usize = 32;
const LABEL_SMOOTHING: f64 = 0.1;
/// Largest random shift of the augmentation, in pixels of the model input.
const SHIFT: usize = 2;

#[derive(Debug, Parser)]
struct Args {
    /// Epochs (PyTorch's shipped model: 120).
    #[arg(long, default_value_t = 30)]
    epochs: usize,
    /// Peak learning rate of the one-cycle schedule.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Blocks that use Hydra attention, e.g. `2,3`.
    #[arg(long, value_delimiter = ',')]
    hydra_layers: Vec<usize>,
    /// Seed of the shuffling and augmentation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory: model.safetensors and config.json.
    #[arg(long, default_value = "target/runs/vit-digits")]
    out: PathBuf,
}

/// splitmix64: shuffling and shifts need no more than this, and the crate
/// does not depend on `rand`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn shuffle(&mut self, xs: &mut [usize]) {
        for i in (1..xs.len()).rev() {
            xs.swap(i, self.below(i + 1));
        }
    }
}

/// Preprocessed images, `(1, S, S)` each, flattened; and their labels.
struct Split {
    images: Vec<f32>,
    labels: Vec<u32>,
}

/// The training split: each 8x8 image (0..16) becomes the 64x64 PNG
/// pixels the PyTorch script draws (`round(v * 255 / 16)`, 8x8 blocks),
/// then goes through the model's own `preprocess`.
fn load_train(cfg: &VitConfig, dir: &Path) -> Result<Split> {
    let path = dir.join("train-8x8.safetensors");
    let t = candle::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("reading {}", path.display()))?;
    let get = |name: &str| {
        t.get(name)
            .with_context(|| format!("{}: no tensor '{name}'", path.display()))
    };
    let images: Vec<Vec<Vec<u8>>> = get("images")?.to_vec3()?;
    let labels: Vec<u8> = get("labels")?.to_vec1()?;
    let mut out = Vec::new();
    for img in &images {
        let px: Vec<u8> = (0..64 * 64)
            .map(|i| (img[i / 64 / 8][i % 64 / 8] as f32 * 255. / 16.).round() as u8)
            .collect();
        let x = preprocess(cfg, &Tensor::from_vec(px, (1, 64, 64), &Device::Cpu)?)?;
        out.extend(x.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(Split {
        images: out,
        labels: labels.into_iter().map(u32::from).collect(),
    })
}

/// The held-out PNGs, `<dir>/heldout/<class>/*.png`.
fn load_heldout(cfg: &VitConfig, dir: &Path) -> Result<Split> {
    let (mut images, mut labels) = (Vec::new(), Vec::new());
    for class in 0..cfg.num_classes {
        let sub = dir.join("heldout").join(class.to_string());
        let mut files: Vec<PathBuf> = std::fs::read_dir(&sub)
            .with_context(|| format!("reading {}", sub.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        files.sort();
        for f in files {
            let img = image::open(&f).with_context(|| format!("decoding {}", f.display()))?;
            let (w, h) = (img.width() as usize, img.height() as usize);
            let px = Tensor::from_vec(img.to_luma8().into_raw(), (1, h, w), &Device::Cpu)?;
            images.extend(preprocess(cfg, &px)?.flatten_all()?.to_vec1::<f32>()?);
            labels.push(class as u32);
        }
    }
    Ok(Split { images, labels })
}

/// A batch with each image shifted by up to [`SHIFT`] pixels, the border
/// filled with the background (pixel 0 after normalisation), as the
/// script's `augment`.
fn augmented_batch(split: &Split, idx: &[usize], s: usize, background: f32, rng: &mut Rng) -> Result<Tensor> {
    let mut data = Vec::with_capacity(idx.len() * s * s);
    for &i in idx {
        let img = &split.images[i * s * s..(i + 1) * s * s];
        let (dx, dy) = (rng.below(2 * SHIFT + 1), rng.below(2 * SHIFT + 1));
        for y in 0..s {
            for x in 0..s {
                // Pixel (y, x) of the crop is (y + dy - SHIFT, x + dx - SHIFT) of the image.
                let (sy, sx) = ((y + dy).wrapping_sub(SHIFT), (x + dx).wrapping_sub(SHIFT));
                data.push(if sy < s && sx < s {
                    img[sy * s + sx]
                } else {
                    background
                });
            }
        }
    }
    Ok(Tensor::from_vec(data, (idx.len(), 1, s, s), &Device::Cpu)?)
}

/// PyTorch's `F.cross_entropy(logits, y, label_smoothing=ε)`:
/// `(1 - ε) * nll + ε * mean_c(-log p_c)`, averaged over the batch.
fn smoothed_cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let nll = logp.gather(&labels.unsqueeze(1)?, 1)?.neg()?.mean_all()?;
    let uniform = logp.neg()?.mean_all()?;
    Ok(((nll * (1. - LABEL_SMOOTHING))? + (uniform * LABEL_SMOOTHING)?)?)
}

/// PyTorch's `OneCycleLR` (cosine, `pct_start=0.1`, `div_factor=25`,
/// `final_div_factor=1e4`, momentum cycled between 0.85 and 0.95): the
/// learning rate and Adam's `beta1` at `step`.
fn one_cycle(step: usize, total: usize, max_lr: f64) -> (f64, f64) {
    let (initial, min) = (max_lr / 25., max_lr / 25. / 1e4);
    let (m_lo, m_hi) = (0.85, 0.95);
    let warm_end = 0.1 * total as f64 - 1.;
    let cos =
        |start: f64, end: f64, pct: f64| end + (start - end) / 2. * ((std::f64::consts::PI * pct).cos() + 1.);
    let step = step as f64;
    if step <= warm_end {
        let pct = step / warm_end;
        (cos(initial, max_lr, pct), cos(m_hi, m_lo, pct))
    } else {
        let pct = (step - warm_end) / (total as f64 - 1. - warm_end);
        (cos(max_lr, min, pct), cos(m_lo, m_hi, pct))
    }
}

/// Held-out accuracy, in eval mode, batches of 128.
fn accuracy(model: &VisionTransformer, split: &Split, s: usize) -> Result<f64> {
    let n = split.labels.len();
    let mut correct = 0;
    for start in (0..n).step_by(128) {
        let len = 128.min(n - start);
        let x = Tensor::from_slice(
            &split.images[start * s * s..(start + len) * s * s],
            (len, 1, s, s),
            &Device::Cpu,
        )?;
        let pred: Vec<u32> = model.forward(&x)?.argmax(D::Minus1)?.to_vec1()?;
        correct += pred
            .iter()
            .zip(&split.labels[start..start + len])
            .filter(|(p, y)| p == y)
            .count();
    }
    Ok(correct as f64 / n as f64)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.epochs == 0 {
        bail!("--epochs must be > 0")
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(DATA_DIR);
    let json = std::fs::read_to_string(dir.join("config.json")).context("reading the digits config")?;
    let mut cfg = VitConfig::from_json(&json)?;
    cfg.hydra_layers = args.hydra_layers.clone();
    cfg.validate()?;
    let s = cfg.img_size;
    let train = load_train(&cfg, &dir)?;
    let heldout = load_heldout(&cfg, &dir)?;
    let background = -cfg.image_mean[0] / cfg.image_std[0];
    println!(
        "{} training and {} held-out images; hydra_layers {:?}; {} epochs",
        train.labels.len(),
        heldout.labels.len(),
        cfg.hydra_layers,
        args.epochs
    );

    let varmap = VarMap::new();
    let model = VisionTransformer::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let mut params = ParamsAdamW {
        lr: args.lr,
        weight_decay: 0.05,
        ..ParamsAdamW::default()
    };
    let mut opt = AdamW::new(varmap.all_vars(), params.clone())?;
    let n = train.labels.len();
    let steps_per_epoch = n.div_ceil(BATCH);
    let total = args.epochs * steps_per_epoch;
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps, {elapsed} (eta {eta}) {msg}")
            .context("progress bar template")?,
    );
    let mut rng = Rng(args.seed);
    let mut order: Vec<usize> = (0..n).collect();
    let t0 = Instant::now();
    let mut step = 0;
    for epoch in 1..=args.epochs {
        rng.shuffle(&mut order);
        let (mut loss_sum, mut correct) = (0f64, 0usize);
        for idx in order.chunks(BATCH) {
            (params.lr, params.beta1) = one_cycle(step, total, args.lr);
            opt.set_params(params.clone());
            let x = augmented_batch(&train, idx, s, background, &mut rng)?;
            let y: Vec<u32> = idx.iter().map(|&i| train.labels[i]).collect();
            let y = Tensor::new(y.as_slice(), &Device::Cpu)?;
            let logits = model.forward(&x)?;
            let loss = smoothed_cross_entropy(&logits, &y)?;
            opt.backward_step(&loss)?;
            loss_sum += loss.to_scalar::<f32>()? as f64 * idx.len() as f64;
            let pred = logits.argmax(D::Minus1)?.eq(&y)?.to_dtype(DType::U32)?;
            correct += pred.sum_all()?.to_scalar::<u32>()? as usize;
            step += 1;
            bar.inc(1);
        }
        let acc = accuracy(&model, &heldout, s)?;
        // Through `suspend`, not `bar.println`: the latter prints nothing
        // when the bar is hidden (output not a terminal, e.g. a log file).
        bar.suspend(|| {
            println!(
                "epoch {epoch}: loss {:.3}, train acc {:.3}, held-out acc {acc:.4}, {:.0}s",
                loss_sum / n as f64,
                correct as f64 / n as f64,
                t0.elapsed().as_secs_f64()
            )
        });
        bar.set_message(format!("held-out {acc:.3}"));
    }
    bar.finish_and_clear();
    let acc = accuracy(&model, &heldout, s)?;
    let right = (acc * heldout.labels.len() as f64).round();
    println!(
        "held-out accuracy (Rust, {} epochs): {acc:.4} ({right}/{}), {:.0}s",
        args.epochs,
        heldout.labels.len(),
        t0.elapsed().as_secs_f64()
    );
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    varmap.save(args.out.join("model.safetensors"))?;
    std::fs::write(
        args.out.join("config.json"),
        serde_json::to_string_pretty(&cfg)? + "\n",
    )?;
    println!("wrote {}", args.out.display());
    Ok(())
}
