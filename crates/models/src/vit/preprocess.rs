//! Pixels to model input, as the config says.

use candle::{bail, DType, Result, Tensor};

use crate::vit::config::VitConfig;
use crate::vit::resample::resize;

/// Scales pixels to `[0, 1]`, resizes them to the config's `img_size`
/// (antialiased, torchvision's `Resize(antialias=True)` on tensors) and
/// normalises each channel with `image_mean` and `image_std`. See
/// [`preprocess_to`] for another size.
///
/// The PyTorch equivalent, which the shipped model's scripts use:
/// `x = F.interpolate(x[None] / 255, (s, s), mode=..., antialias=True)[0]`,
/// then `(x - mean) / std`.
///
/// # Shapes
/// - `pixels`: `(in_chans, H, W)`, any dtype, values in `[0, 255]`
/// - returns `(in_chans, img_size, img_size)` in f32
pub fn preprocess(cfg: &VitConfig, pixels: &Tensor) -> Result<Tensor> {
    preprocess_to(cfg, pixels, (cfg.img_size, cfg.img_size))
}

/// [`preprocess`] to `(height, width)` instead of the config's `img_size`
/// (the model resamples its position embedding to match).
///
/// # Shapes
/// - `pixels`: `(in_chans, H, W)`, values in `[0, 255]`
/// - returns `(in_chans, height, width)` in f32
pub fn preprocess_to(cfg: &VitConfig, pixels: &Tensor, (height, width): (usize, usize)) -> Result<Tensor> {
    let (c, h, w) = pixels.dims3()?;
    if c != cfg.in_chans {
        bail!(
            "preprocess: the image has {c} channels, the model expects {}",
            cfg.in_chans
        )
    }
    if h == 0 || w == 0 {
        bail!("preprocess: the image is empty ({h}x{w})")
    }
    let x = (pixels.to_dtype(DType::F32)? / 255.)?;
    let x = resize(&x, (height, width), cfg.image_interpolation, true)?;
    let dev = x.device();
    let mean = Tensor::from_slice(&cfg.image_mean, (c, 1, 1), dev)?;
    let std = Tensor::from_slice(&cfg.image_std, (c, 1, 1), dev)?;
    x.broadcast_sub(&mean)?.broadcast_div(&std)
}
