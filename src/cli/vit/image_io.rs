//! Reading images into pixel tensors, and writing the attention map.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle::{Device, Tensor};
use image::{imageops::FilterType, DynamicImage, GrayImage, Rgb, RgbImage};

/// An image to classify: a file, or one of the samples built into the
/// binary.
#[derive(Debug, Clone)]
pub enum Input {
    File(PathBuf),
    BuiltIn(&'static str, &'static [u8]),
}

impl Input {
    /// The shipped digit samples, sorted by name.
    pub fn built_in_samples() -> Vec<Self> {
        crate::cli::model_files::VIT_DIGIT_SAMPLES
            .iter()
            .map(|&(name, bytes)| Self::BuiltIn(name, bytes))
            .collect()
    }

    /// What the output calls it: the file's path, or
    /// `built-in/weights/vit-digits/samples/NAME`.
    pub fn path(&self) -> PathBuf {
        match self {
            Self::File(p) => p.clone(),
            Self::BuiltIn(name, _) => Path::new("built-in/weights/vit-digits/samples").join(name),
        }
    }

    /// The decoded image.
    pub fn open(&self) -> Result<DynamicImage> {
        match self {
            Self::File(p) => open_image(p),
            Self::BuiltIn(name, bytes) => Ok(multihead::models::formats::image_input::decode_image(
                bytes,
                &self.path().display().to_string(),
            )
            .with_context(|| format!("built-in sample {name}"))?),
        }
    }
}

/// Decodes a PNG or JPEG, recognised by its bytes, not its extension,
/// under the size limits of [`multihead::models::formats::image_input`].
pub fn open_image(path: &Path) -> Result<DynamicImage> {
    let bytes = multihead::models::formats::files::read_bytes(
        path,
        "image",
        multihead::models::formats::image_input::MAX_IMAGE_ALLOC,
    )?;
    Ok(multihead::models::formats::image_input::decode_image(
        &bytes,
        &path.display().to_string(),
    )?)
}

/// The image's pixels as a `(channels, H, W)` u8 tensor (luma for one
/// channel, RGB for three), ready to be resized to `target`: a
/// large image is block-averaged in 8 bits first
/// ([`multihead::models::formats::image_input::pixels_u8`]), so no full-size float
/// copy of it is ever made.
pub fn pixels(img: &DynamicImage, channels: usize, target: (usize, usize)) -> Result<Tensor> {
    let px = multihead::models::formats::image_input::pixels_u8(img, channels, target)?;
    Ok(Tensor::from_vec(
        px.data,
        (px.channels, px.height, px.width),
        &Device::Cpu,
    )?)
}

/// Jet-like colours from blue (0) through cyan, yellow, to red (1).
fn colormap(v: f32) -> [f32; 3] {
    const STOPS: [(f32, [f32; 3]); 6] = [
        (0.0, [0., 0., 128.]),
        (0.125, [0., 0., 255.]),
        (0.375, [0., 255., 255.]),
        (0.625, [255., 255., 0.]),
        (0.875, [255., 0., 0.]),
        (1.0, [128., 0., 0.]),
    ];
    let v = v.clamp(0., 1.);
    for pair in STOPS.windows(2) {
        let ((a, ca), (b, cb)) = (pair[0], pair[1]);
        if v <= b {
            let t = (v - a) / (b - a);
            return [0, 1, 2].map(|i| ca[i] + t * (cb[i] - ca[i]));
        }
    }
    STOPS[5].1
}

/// Side of each panel of the attention-map picture, in pixels.
const PANEL: u32 = 256;

/// Writes `[input | input blended with the heat map]`, both resized to a
/// square panel as the model sees them.
///
/// `heat`: `(PANEL, PANEL)` values in `[0, 1]`, row-major.
pub fn write_attention_map(img: &DynamicImage, heat: &[f32], out: &Path) -> Result<()> {
    if heat.len() != (PANEL * PANEL) as usize {
        bail!(
            "attention map has {} values, expected {}",
            heat.len(),
            PANEL * PANEL
        )
    }
    // Nearest keeps small images (8x8 digits) crisp when enlarged.
    let filter = if img.width() < PANEL {
        FilterType::Nearest
    } else {
        FilterType::Triangle
    };
    let input: RgbImage = img.resize_exact(PANEL, PANEL, filter).to_rgb8();
    let gray: GrayImage = DynamicImage::ImageRgb8(input.clone()).to_luma8();
    let mut canvas = RgbImage::new(2 * PANEL + 8, PANEL);
    for p in canvas.pixels_mut() {
        *p = Rgb([255, 255, 255]);
    }
    for (x, y, p) in input.enumerate_pixels() {
        canvas.put_pixel(x, y, *p);
        let g = f32::from(gray.get_pixel(x, y)[0]);
        let c = colormap(heat[(y * PANEL + x) as usize]);
        // Half heat, half the grayscale input, so the digit shows through.
        let blend = c.map(|c| (0.55 * c + 0.45 * g).round().clamp(0., 255.) as u8);
        canvas.put_pixel(PANEL + 8 + x, y, Rgb(blend));
    }
    crate::cli::output::write_png(out, &canvas, "attention map")
}

/// `PANEL x PANEL` heat values in `[0, 1]` from a rollout map `(gh, gw)`.
pub fn heat_panel(rollout: &Tensor) -> Result<Vec<f32>> {
    let map = multihead::models::vit::resize(
        rollout,
        (PANEL as usize, PANEL as usize),
        multihead::models::vit::Interpolation::Bilinear,
        false,
    )?;
    let v: Vec<f32> = map.flatten_all()?.to_vec1()?;
    let (lo, hi) = v
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let span = (hi - lo).max(f32::MIN_POSITIVE);
    Ok(v.into_iter().map(|x| (x - lo) / span).collect())
}
