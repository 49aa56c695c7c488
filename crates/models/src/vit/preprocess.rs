//! Pixels to model input, as the config says: resize (and crop) with
//! PyTorch's float resampler or PIL's 8-bit one, scale to `[0, 1]`,
//! normalise per channel.

use crate::vit::config::{ImageResize, Resampler, VitConfig};
use crate::vit::pil::resize_u8;
use crate::vit::resample::resize;
use candle::{bail, DType, Result, Tensor};

/// Scales pixels to `[0, 1]`, resizes them to the config's `img_size`
/// (as `image_resize` and `image_resampler` say) and normalises each
/// channel with `image_mean` and `image_std`. See [`preprocess_to`] for
/// another size.
///
/// The PyTorch equivalent of the default (`Squash`, `Torch`), which the
/// shipped model's scripts use:
/// `x = F.interpolate(x[None] / 255, (s, s), mode=..., antialias=True)[0]`,
/// then `(x - mean) / std`.
///
/// # Shapes
/// - `pixels`: `(in_chans, H, W)`, any dtype, values in `[0, 255]`
/// - returns `(in_chans, img_size, img_size)` in f32
pub fn preprocess(cfg: &VitConfig, pixels: &Tensor) -> Result<Tensor> {
    preprocess_to(cfg, pixels, (cfg.img_size, cfg.img_size))
}

/// The size an image of `(h, w)` pixels is resized to before the centre
/// crop to `out`: `out` itself for `Squash`; for the crop modes their
/// size, scaled by `out / img_size` when `out` is not the config's size;
/// for `AsIs` the image's own, an error unless it is `out`.
pub fn resize_size(cfg: &VitConfig, (h, w): (usize, usize), out: (usize, usize)) -> Result<(usize, usize)> {
    let img = cfg.img_size.max(1);
    let scale = |n: usize, o: usize| -> Result<usize> {
        let Some(v) = n.checked_mul(o).map(|v| v / img) else {
            bail!("preprocess: resize size {n} scaled to {o} overflows")
        };
        Ok(v.max(o))
    };
    let size = match cfg.image_resize {
        ImageResize::Squash => out,
        ImageResize::AsIs if (h, w) == out => out,
        ImageResize::AsIs => bail!(
            "preprocess: the image is {h}x{w} and the config resizes nothing (image_resize \
             as_is, HF's do_resize: false): it must be the input size, {}x{}",
            out.0,
            out.1
        ),
        ImageResize::SquashCrop { height, width, .. } => (scale(height, out.0)?, scale(width, out.1)?),
        ImageResize::ShortSideCrop { short_side } if out.0 == out.1 => {
            let s = scale(short_side, out.0)?;
            // torchvision: the long side is `int(size * long / short)`.
            let long = |n: usize, short: usize| (s as f64 * n as f64 / short as f64) as usize;
            if h <= w {
                (s, long(w, h).max(s))
            } else {
                (long(h, w).max(s), s)
            }
        }
        // timm resizes to `floor(size / crop_pct)` per side when the input
        // is not square: no aspect ratio kept.
        ImageResize::ShortSideCrop { short_side } => (scale(short_side, out.0)?, scale(short_side, out.1)?),
    };
    // The long side grows with the aspect ratio: a 1 x 16384 image would
    // be resized to millions of pixels only for the crop to drop them.
    let most = out.0.saturating_mul(out.1).saturating_mul(64);
    if size.0.saturating_mul(size.1) > most {
        bail!(
            "preprocess: a {h}x{w} image would be resized to {}x{} for a {}x{} input: \
             its aspect ratio is too extreme (over 64 times the input's pixels)",
            size.0,
            size.1,
            out.0,
            out.1
        )
    }
    Ok(size)
}

/// The size the CLI may reduce a decoded image to in 8 bits before
/// [`preprocess_to`] (see `image_input::PREREDUCE_ABOVE`, with the `image`
/// feature): the resize size for the float resampler; for PIL's, the image
/// itself up to 4096 x 4096 pixels.
pub fn decode_target(cfg: &VitConfig, (h, w): (usize, usize), out: (usize, usize)) -> Result<(usize, usize)> {
    let size = resize_size(cfg, (h, w), out)?;
    match cfg.image_resampler {
        Resampler::Torch => Ok(size),
        // Up to PIL_EXACT_PIXELS the image is resized as it is; a larger
        // one is box-averaged to at least four times the resize per side,
        // a fraction of a gray level from PIL's own result.
        Resampler::Pil if h.saturating_mul(w) <= PIL_EXACT_PIXELS => Ok((h, w)),
        Resampler::Pil => Ok((size.0.saturating_mul(2), size.1.saturating_mul(2))),
    }
}

/// Images up to this many pixels (4096 x 4096) reach PIL's resampler as
/// they are, so that the input is PIL's to the bit; larger ones are
/// reduced in 8 bits first (see [`decode_target`]) to bound memory.
pub(crate) const PIL_EXACT_PIXELS: usize = 4096 * 4096;

/// The top-left corner of the centre crop of `crop` out of `size`.
fn crop_offset(mode: ImageResize, size: usize, crop: usize) -> usize {
    let d = size - crop;
    match mode {
        // Python's `round(d / 2)`: halves go to the even neighbour.
        ImageResize::ShortSideCrop { .. }
        | ImageResize::SquashCrop {
            round_half_even: true,
            ..
        } if d % 2 == 1 && (d / 2) % 2 == 1 => d / 2 + 1,
        _ => d / 2,
    }
}

/// [`preprocess`] to `(height, width)` instead of the config's `img_size`
/// (the model resamples its position embedding to match).
///
/// # Shapes
/// - `pixels`: `(in_chans, H, W)`, values in `[0, 255]` (rounded to
///   integers first for the PIL resampler)
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
    if height == 0 || width == 0 {
        bail!("preprocess: output size must be > 0, found ({height}, {width})")
    }
    let (rh, rw) = resize_size(cfg, (h, w), (height, width))?;
    let dev = pixels.device();
    let x = match (cfg.image_resize, cfg.image_resampler) {
        // HF's processors without a resize: the pixels as they are (in 8
        // bits for PIL's).
        (ImageResize::AsIs, Resampler::Torch) => (pixels.to_dtype(DType::F32)? / 255.)?,
        (ImageResize::AsIs, Resampler::Pil) => {
            (pixels.to_dtype(DType::F32)?.round()?.clamp(0., 255.)? / 255.)?
        }
        (_, Resampler::Torch) => resize(
            &(pixels.to_dtype(DType::F32)? / 255.)?,
            (rh, rw),
            cfg.image_interpolation,
            true,
        )?,
        (_, Resampler::Pil) => {
            let px: Vec<u8> = match pixels.dtype() {
                DType::U8 => pixels.flatten_all()?.to_vec1()?,
                _ => pixels
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .into_iter()
                    .map(|v| v.round().clamp(0., 255.) as u8)
                    .collect(),
            };
            let out = resize_u8(&px, (c, h, w), (rh, rw), cfg.image_interpolation)?;
            (Tensor::from_vec(out, (c, rh, rw), dev)?.to_dtype(DType::F32)? / 255.)?
        }
    };
    let top = crop_offset(cfg.image_resize, rh, height);
    let left = crop_offset(cfg.image_resize, rw, width);
    let x = x.narrow(1, top, height)?.narrow(2, left, width)?;
    let mean = Tensor::from_slice(&cfg.image_mean, (c, 1, 1), dev)?;
    let std = Tensor::from_slice(&cfg.image_std, (c, 1, 1), dev)?;
    x.broadcast_sub(&mean)?.broadcast_div(&std)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crop_offsets_round_as_their_libraries_do() {
        let timm = ImageResize::ShortSideCrop { short_side: 0 };
        let hf = ImageResize::SquashCrop {
            height: 0,
            width: 0,
            round_half_even: false,
        };
        // round(0.5) = 0, round(1.5) = 2, round(2.5) = 2, round(3.5) = 4.
        for (d, want) in [(0, 0), (1, 0), (2, 1), (3, 2), (5, 2), (7, 4)] {
            assert_eq!(crop_offset(timm, 10 + d, 10), want, "timm d={d}");
            assert_eq!(crop_offset(hf, 10 + d, 10), d / 2, "hf d={d}");
            let squash = ImageResize::SquashCrop {
                height: 0,
                width: 0,
                round_half_even: true,
            };
            assert_eq!(crop_offset(squash, 10 + d, 10), want, "torchvision squash d={d}");
        }
    }

    #[test]
    fn resize_sizes() -> Result<()> {
        let mut cfg = VitConfig {
            img_size: 224,
            patch_size: 16,
            embed_dim: 64,
            depth: 1,
            num_heads: 4,
            image_resize: ImageResize::ShortSideCrop { short_side: 248 },
            ..VitConfig::default()
        };
        // 640x480 (w x h): short side 480 -> 248, long int(248 * 640 / 480) = 330.
        assert_eq!(resize_size(&cfg, (480, 640), (224, 224))?, (248, 330));
        assert_eq!(resize_size(&cfg, (640, 480), (224, 224))?, (330, 248));
        // At twice the size, twice the short side.
        assert_eq!(resize_size(&cfg, (480, 640), (448, 448))?.0, 496);
        cfg.image_resize = ImageResize::SquashCrop {
            height: 256,
            width: 256,
            round_half_even: false,
        };
        assert_eq!(resize_size(&cfg, (480, 640), (224, 224))?, (256, 256));
        // A 1-pixel-high strip would become 248 x 3 million pixels.
        cfg.image_resize = ImageResize::ShortSideCrop { short_side: 248 };
        let err = resize_size(&cfg, (1, 16384), (224, 224)).unwrap_err().to_string();
        assert!(err.contains("aspect ratio is too extreme"), "{err}");
        for (bad, what) in [(223, "below"), (897, "above")] {
            let r = ImageResize::ShortSideCrop { short_side: bad };
            assert!(r.validate(224).is_err(), "{what}");
        }
        Ok(())
    }

    /// HF's `do_resize: false`: the pixels as they are, scaled and
    /// normalised; an image of another size is an error, not resized.
    #[test]
    fn as_is_takes_the_image_at_its_size() -> Result<()> {
        let mut cfg = VitConfig {
            img_size: 4,
            patch_size: 2,
            embed_dim: 8,
            depth: 1,
            num_heads: 2,
            in_chans: 1,
            image_mean: vec![0.5],
            image_std: vec![0.25],
            image_resize: ImageResize::AsIs,
            ..VitConfig::default()
        };
        let px: Vec<f32> = (0..16).map(|i| (i * 17) as f32).collect();
        let want: Vec<f32> = px.iter().map(|&p| (p / 255. - 0.5) / 0.25).collect();
        for resampler in [Resampler::Torch, Resampler::Pil] {
            cfg.image_resampler = resampler;
            let x = preprocess(
                &cfg,
                &Tensor::from_vec(px.clone(), (1, 4, 4), &candle::Device::Cpu)?,
            )?;
            assert_eq!(x.dims(), [1, 4, 4]);
            let got = x.flatten_all()?.to_vec1::<f32>()?;
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-6, "{resampler:?}: {got:?} against {want:?}");
            }
            let other = Tensor::zeros((1, 4, 5), DType::U8, &candle::Device::Cpu)?;
            let err = preprocess(&cfg, &other).unwrap_err().to_string();
            assert!(
                err.contains("4x5") && err.contains("do_resize: false") && err.contains("4x4"),
                "{err}"
            );
        }
        Ok(())
    }
}
