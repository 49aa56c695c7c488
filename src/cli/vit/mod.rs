//! `multihead vit`: classify images with a Vision Transformer, evaluate it
//! on a class-per-subfolder directory, and draw where it attends.

mod eval;
mod image_io;
mod polarity;

use std::io::Write;
use std::path::{Path, PathBuf};

use image_io::Input;
use polarity::Invert;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor};
use multihead::models::vit::{
    attention_rollout, decode_target, preprocess_to, ModelFolder, VisionTransformer, VitConfig,
};

use multihead::models::checkpoint::WeightDtype;
use multihead::models::formats::safetensors::Checkpoint;

use super::model_files::{self, Text};

/// Most patches `--image-size` may ask for beyond the config's own grid: a
/// 64 x 64 grid. Time grows with the square of the patches, and an
/// attention map keeps every layer's `(patches + 1)²` weights.
const MAX_PATCHES: usize = 64 * 64;

/// Where to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// The CPU.
    Cpu,
    /// The first CUDA GPU (build with `--features cuda`).
    Cuda,
    /// The first Metal GPU (build with `--features metal`).
    Metal,
}

/// Floating-point type of weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeArg {
    F32,
    F16,
    Bf16,
}

/// How predictions are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Per image, the top-k classes with probabilities.
    Text,
    /// One JSON array: per image its path and top-k `{class, label, prob}`.
    Json,
}

/// Arguments of `multihead vit`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Images to classify (PNG or JPEG, any size; resized as the config
    /// says). Default: the samples built into the binary
    /// (weights/vit-digits/samples/).
    images: Vec<PathBuf>,
    /// A model folder as HF transformers (`save_pretrained`), timm
    /// (`save_for_hf`) or multihead write them, or a weights file in one (a
    /// .safetensors file or model.safetensors.index.json). The config.json
    /// beside it says which. Default: the digits model built into the
    /// binary (weights/vit-digits).
    #[arg(long, value_name = "FOLDER|FILE")]
    weights: Option<PathBuf>,
    /// Model config (a VitConfig, HF or timm config.json). Default:
    /// config.json beside the weights.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// How many classes to print per image.
    #[arg(long, default_value_t = 3)]
    top_k: usize,
    /// Device to run on.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// Dtype of the weights. On the CPU, bf16 and f16 are the weight
    /// matrices' (half the memory; activations and sums stay f32); on cuda
    /// or metal, the whole model's.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// Side the images are resized to (default: the config's img_size);
    /// another size resamples the position embedding. A multiple of the
    /// patch size, at most 64 x 64 patches (or the config's grid, if larger).
    #[arg(long, value_name = "PIXELS")]
    image_size: Option<usize>,
    /// Evaluate on DIR/<class>/*.png|jpg: accuracy and confusion matrix.
    #[arg(long, value_name = "DIR", conflicts_with = "images")]
    eval: Option<PathBuf>,
    /// Write the input beside a heat map of where the class token attends
    /// (attention rollout over all layers). With several images, one file
    /// per image: OUT-<image name>.png.
    #[arg(long, value_name = "OUT.png")]
    attention_map: Option<PathBuf>,
    /// Invert grayscale images (dark ink on light to light on dark, as
    /// the digits model was trained). auto: when the image's border is
    /// mostly light, for one-channel models only.
    #[arg(long, value_enum, default_value_t = Invert::Auto)]
    invert: Invert,
    /// Output format of the predictions.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

/// Where the model comes from.
enum Source {
    /// `--weights`: a folder of any of the recognised formats.
    Folder(ModelFolder),
    /// The digits model built into the binary, with its config's label.
    BuiltIn { label: String, ckpt: Checkpoint },
}

/// A loaded model and how to feed it.
pub(crate) struct Classifier {
    pub vit: VisionTransformer,
    pub cfg: VitConfig,
    pub device: Device,
    pub dtype: DType,
    pub size: usize,
    pub invert: Invert,
}

impl Classifier {
    fn load(args: &Args) -> Result<Self> {
        // --weights: a model folder (HF, timm or ours) or a file in one,
        // its config recognised by ModelFolder; without it, the digits
        // model built into the binary, with --config's VitConfig if given.
        let (cfg, source) = match &args.weights {
            Some(w) => {
                let folder = ModelFolder::open_with_config(w, args.config.as_deref())?;
                (folder.config().clone(), Source::Folder(folder))
            }
            None => {
                let (built_in, ckpt) = model_files::vit_digits()?;
                let config = match &args.config {
                    Some(c) => Text::read(c, "config")?,
                    None => built_in,
                };
                let cfg =
                    VitConfig::from_json(&config.text).with_context(|| format!("config {}", config.label))?;
                (
                    cfg,
                    Source::BuiltIn {
                        label: config.label,
                        ckpt,
                    },
                )
            }
        };
        if args.invert == Invert::Always && cfg.in_chans != 1 {
            bail!(
                "--invert always is for one-channel models; this one takes {} channels",
                cfg.in_chans
            )
        }
        let size = match args.image_size {
            Some(size) => checked_image_size(size, &cfg)?,
            None => cfg.img_size,
        };
        let device = match args.device {
            DeviceArg::Cpu => Device::Cpu,
            DeviceArg::Cuda => Device::new_cuda(0).context("--device cuda")?,
            DeviceArg::Metal => Device::new_metal(0).context("--device metal")?,
        };
        // The model's dtype, and the weight matrices' where they differ:
        // on the CPU, half-precision weights are packed as such and the
        // activations stay f32.
        let (dtype, matrices) = match (args.dtype, device.is_cpu()) {
            (DtypeArg::F32, _) => (DType::F32, None),
            (DtypeArg::F16, true) => (DType::F32, Some(WeightDtype::F16)),
            (DtypeArg::Bf16, true) => (DType::F32, Some(WeightDtype::Bf16)),
            (DtypeArg::F16, false) => (DType::F16, None),
            (DtypeArg::Bf16, false) => (DType::BF16, None),
        };
        // Sizes the weights cannot hold are refused before anything is
        // built; then every tensor is checked against the config.
        let vit = match &source {
            Source::Folder(folder) => {
                let ckpt = folder.checkpoint()?.with_weight_dtype(matrices);
                folder.load_checkpoint(&ckpt, dtype, &device)?
            }
            Source::BuiltIn { label, ckpt } => ckpt
                .clone()
                .with_weight_dtype(matrices)
                .load_bounded(&cfg.budget_owner(), dtype, &device, |vb, pack| {
                    VisionTransformer::new_with(&cfg, pack, vb)
                })
                .with_context(|| format!("with config {label}"))?,
        };
        Ok(Self {
            vit,
            cfg,
            device,
            dtype,
            size,
            invert: args.invert,
        })
    }

    /// The model input for one image: `(in_chans, size, size)` on the
    /// device, in the model's dtype.
    pub fn input(&self, img: &image::DynamicImage) -> Result<Tensor> {
        let (w, h) = (img.width() as usize, img.height() as usize);
        let target = decode_target(&self.cfg, (h, w), (self.size, self.size))?;
        let px = image_io::pixels(img, self.cfg.in_chans, target)?;
        let px = polarity::apply(px, self.invert)?;
        let x = preprocess_to(&self.cfg, &px, (self.size, self.size))?;
        Ok(x.to_device(&self.device)?.to_dtype(self.dtype)?)
    }

    /// Class probabilities `(batch, num_classes)` in f32 on the CPU.
    pub fn probabilities(&self, inputs: &[Tensor]) -> Result<Tensor> {
        let x = Tensor::stack(inputs, 0)?;
        Ok(self.vit.probabilities(&x)?.to_device(&Device::Cpu)?)
    }
}

/// `--image-size`, checked: a positive multiple of the patch size, with at
/// most [`MAX_PATCHES`] patches (or the config's own grid, if larger).
fn checked_image_size(size: usize, cfg: &VitConfig) -> Result<usize> {
    let p = cfg.patch_size;
    if size < p {
        bail!("--image-size must be at least the patch size {p}, found {size}")
    }
    if !size.is_multiple_of(p) {
        bail!("--image-size {size} is not a multiple of the patch size {p}")
    }
    let grid = size / p;
    let most = MAX_PATCHES.max(cfg.grid_size().saturating_mul(cfg.grid_size()));
    if grid.checked_mul(grid).is_none_or(|n| n > most) {
        let side = (most as f64).sqrt() as usize;
        bail!(
            "--image-size {size} is {grid}x{grid} patches of {p} pixels; at most {most} patches \
             ({side}x{side}, --image-size {}) are allowed",
            side * p
        )
    }
    Ok(size)
}

/// The PNG and JPEG files directly in `dir`.
pub(crate) fn image_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading directory '{}'", dir.display()))? {
        let path = entry?.path();
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        if path.is_file() && matches!(ext.as_deref(), Some("png" | "jpg" | "jpeg")) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Indices and values of the `k` largest entries, largest first.
pub(crate) fn top_k(probs: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<(usize, f32)> = probs.iter().copied().enumerate().collect();
    idx.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    idx.truncate(k);
    idx
}

/// Runs the command.
pub fn run(args: Args) -> Result<()> {
    if args.top_k == 0 {
        bail!("--top-k must be at least 1")
    }
    let clf = Classifier::load(&args)?;
    if let Some(dir) = &args.eval {
        return eval::run(&clf, dir);
    }
    let paths: Vec<Input> = if args.images.is_empty() {
        Input::built_in_samples()
    } else {
        args.images.iter().cloned().map(Input::File).collect()
    };
    let k = args.top_k.min(clf.cfg.num_classes.max(1));
    let width = (0..clf.cfg.num_classes)
        .map(|i| clf.cfg.label(i).len())
        .max()
        .unwrap_or(1);
    let mut json = Vec::new();
    let mut out = std::io::stdout().lock();
    for input in &paths {
        let img = input.open()?;
        let path = input.path();
        let path = path.as_path();
        let x = clf.input(&img)?;
        let probs: Vec<f32> = clf
            .probabilities(std::slice::from_ref(&x))?
            .squeeze(0)?
            .to_vec1()?;
        let best = top_k(&probs, k);
        match args.format {
            Format::Text => {
                writeln!(out, "{}", path.display())?;
                for (c, p) in &best {
                    writeln!(out, "  {:<width$}  {:6.2}%", clf.cfg.label(*c), 100. * p)?;
                }
            }
            Format::Json => json.push(serde_json::json!({
                "path": path.display().to_string(),
                "top_k": best.iter().map(|(c, p)| serde_json::json!({
                    "class": c, "label": clf.cfg.label(*c), "prob": p,
                })).collect::<Vec<_>>(),
            })),
        }
        if let Some(map) = &args.attention_map {
            let map = if paths.len() == 1 {
                map.clone()
            } else {
                per_image_path(map, path)
            };
            write_attention_map(&clf, &img, &x, &map)?;
            if args.format == Format::Text {
                writeln!(out, "  attention map: {}", map.display())?;
            }
        }
    }
    if args.format == Format::Json {
        writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
    }
    out.flush()?;
    Ok(())
}

/// `OUT-<image stem>.png` for `OUT.png`.
fn per_image_path(out: &Path, image: &Path) -> PathBuf {
    let stem = out.file_stem().map(|s| s.to_string_lossy()).unwrap_or_default();
    let img = image.file_stem().map(|s| s.to_string_lossy()).unwrap_or_default();
    out.with_file_name(format!("{stem}-{img}.png"))
}

fn write_attention_map(clf: &Classifier, img: &image::DynamicImage, x: &Tensor, out: &Path) -> Result<()> {
    let res = clf.vit.forward_with_attention(&x.unsqueeze(0)?)?;
    let rollout = attention_rollout(&res.attentions, clf.cfg.num_prefix_tokens(), res.grid)
        .context("attention map")?
        .squeeze(0)?
        .to_device(&Device::Cpu)?;
    let heat = image_io::heat_panel(&rollout)?;
    image_io::write_attention_map(img, &heat, out)
}
