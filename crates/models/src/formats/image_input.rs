//! Decoding images from strangers: PNG or JPEG recognised by their bytes,
//! with limits on the size a header may claim, so a small file that
//! declares enormous dimensions (a decompression bomb) is refused before
//! any pixel buffer is allocated.

use candle::Result;
use image::{DynamicImage, GenericImageView, ImageFormat, ImageReader, Limits};

/// Largest width or height accepted, in pixels.
pub const MAX_IMAGE_SIDE: u32 = 16_384;

/// Most bytes the decoder may allocate for one image (512 MiB: a
/// 16384 x 8192 RGBA image).
pub const MAX_IMAGE_ALLOC: u64 = 512 * 1024 * 1024;

/// The limits [`decode_image`] decodes under.
pub fn image_limits() -> Limits {
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_IMAGE_ALLOC);
    limits
}

/// Decodes a PNG or JPEG from `bytes`; `label` names it in errors.
///
/// Refuses other formats, images wider or taller than
/// [`MAX_IMAGE_SIDE`], decodes that would allocate more than
/// [`MAX_IMAGE_ALLOC`], and images with no pixels.
pub fn decode_image(bytes: &[u8], label: &str) -> Result<DynamicImage> {
    let err = |msg: String| candle::Error::Msg(msg);
    if bytes.is_empty() {
        return Err(err(format!("image '{label}' is an empty file")));
    }
    let format = match image::guess_format(bytes) {
        Ok(f @ (ImageFormat::Png | ImageFormat::Jpeg)) => f,
        _ => return Err(err(format!("'{label}' is not a PNG or JPEG image"))),
    };
    let mut reader = ImageReader::with_format(std::io::Cursor::new(bytes), format);
    reader.limits(image_limits());
    let img = reader.decode().map_err(|e| match e {
        image::ImageError::Limits(l) => err(format!(
            "image '{label}' is refused: its header claims a size beyond the limit of \
             {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} pixels / {} MiB ({l})",
            MAX_IMAGE_ALLOC >> 20
        )),
        e => err(format!("decoding image '{label}': {e}")),
    })?;
    if img.width() == 0 || img.height() == 0 {
        return Err(err(format!(
            "image '{label}' is empty ({}x{} pixels)",
            img.width(),
            img.height()
        )));
    }
    Ok(img)
}

/// A side more than this many times the model input's is box-averaged in
/// 8 bits before any float copy (see [`pixels_u8`]).
pub const PREREDUCE_ABOVE: usize = 2;

/// Pixels in 8 bits, `(channels, height, width)` row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pixels {
    /// The values, channel after channel.
    pub data: Vec<u8>,
    /// 1 (luma) or 3 (RGB).
    pub channels: usize,
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
}

/// The image as 1 (luma) or 3 (RGB) channels of 8-bit pixels, ready to be
/// resized to `target` `(height, width)`.
///
/// An image up to [`PREREDUCE_ABOVE`] times the target on each side is
/// returned as it is (`to_luma8` / `to_rgb8`), so the float resize that
/// follows is PyTorch's to the last bit. A larger one is first averaged
/// over blocks of `ky x kx` pixels, integer factors chosen per axis so that
/// each side stays at least twice the target's, reading the decoded image
/// in place: a 16384 x 16384 grayscale PNG costs its decoded 256 MiB and a
/// few times the target's size, never a full-size float copy. The
/// antialiased resize after it differs from a direct one by under 2 gray
/// levels (of 255) on the unit tests' pictures (measured: 1.6 for a smooth
/// blob, 0.5 for a pixel checkerboard).
pub fn pixels_u8(img: &DynamicImage, channels: usize, target: (usize, usize)) -> Result<Pixels> {
    if channels != 1 && channels != 3 {
        candle::bail!("images can be read as 1 or 3 channels, the model has {channels}")
    }
    let (w, h) = (img.width() as usize, img.height() as usize);
    if w == 0 || h == 0 || target.0 == 0 || target.1 == 0 {
        candle::bail!("pixels_u8: empty image ({w}x{h}) or target {target:?}")
    }
    let factor = |n: usize, t: usize| (n / t.saturating_mul(PREREDUCE_ABOVE)).max(1);
    let (ky, kx) = (factor(h, target.0), factor(w, target.1));
    if (ky, kx) == (1, 1) {
        let data = match channels {
            1 => img.to_luma8().into_raw(),
            // (H, W, 3) -> (3, H, W)
            _ => {
                let rgb = img.to_rgb8().into_raw();
                (0..3)
                    .flat_map(|c| rgb.iter().skip(c).step_by(3).copied())
                    .collect()
            }
        };
        return Ok(Pixels {
            data,
            channels,
            height: h,
            width: w,
        });
    }
    // Blocks at the right and bottom edges may be partial: each output
    // averages the pixels its block covers.
    let (oh, ow) = (h.div_ceil(ky), w.div_ceil(kx));
    let mut sums = vec![0u64; channels * oh * ow];
    let plane = oh * ow;
    let mut add_row = |y: usize, row: &mut dyn FnMut(usize) -> [u8; 3]| {
        let oy = y / ky;
        for x in 0..w {
            let px = row(x);
            let o = oy * ow + x / kx;
            if channels == 1 {
                sums[o] += u64::from(luma(px));
            } else {
                for (c, v) in px.into_iter().enumerate() {
                    sums[c * plane + o] += u64::from(v);
                }
            }
        }
    };
    // Fast paths read the decoded buffer of the common 8-bit layouts; the
    // rest go pixel by pixel through `image`'s conversion to RGBA8.
    match img {
        DynamicImage::ImageLuma8(buf) => {
            for (y, row) in buf.as_raw().chunks_exact(w).enumerate() {
                add_row(y, &mut |x| [row[x]; 3]);
            }
        }
        DynamicImage::ImageRgb8(buf) => {
            for (y, row) in buf.as_raw().chunks_exact(3 * w).enumerate() {
                add_row(y, &mut |x| [row[3 * x], row[3 * x + 1], row[3 * x + 2]]);
            }
        }
        DynamicImage::ImageRgba8(buf) => {
            for (y, row) in buf.as_raw().chunks_exact(4 * w).enumerate() {
                add_row(y, &mut |x| [row[4 * x], row[4 * x + 1], row[4 * x + 2]]);
            }
        }
        other => {
            for y in 0..h {
                add_row(y, &mut |x| {
                    // x < w and y < h, which came from `u32` sides.
                    let p = other.get_pixel(x as u32, y as u32).0;
                    [p[0], p[1], p[2]]
                });
            }
        }
    }
    let count = |o: usize| {
        let (oy, ox) = (o / ow, o % ow);
        let rows = ky.min(h - oy * ky);
        let cols = kx.min(w - ox * kx);
        (rows * cols) as u64
    };
    let data = sums
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let n = count(i % plane);
            // Rounded to the nearest level.
            ((s + n / 2) / n) as u8
        })
        .collect();
    Ok(Pixels {
        data,
        channels,
        height: oh,
        width: ow,
    })
}

/// Rec. 709 luma of an 8-bit RGB pixel, as `image`'s `to_luma8`.
fn luma([r, g, b]: [u8; 3]) -> u8 {
    let l = 0.2126 * f32::from(r) + 0.7152 * f32::from(g) + 0.0722 * f32::from(b);
    l.round().clamp(0., 255.) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vit::{resize, Interpolation};
    use candle::{DType, Device, Tensor};
    use image::{GrayImage, Luma, Rgb, RgbImage};

    /// The pre-reduced path against a direct antialiased resize of the
    /// full image, in gray levels (0..255).
    fn reduced_vs_direct(img: &GrayImage, target: usize, mode: Interpolation) -> Result<f32> {
        let dev = Device::Cpu;
        let (w, h) = (img.width() as usize, img.height() as usize);
        let full = Tensor::from_vec(img.as_raw().clone(), (1, h, w), &dev)?.to_dtype(DType::F32)?;
        let direct = resize(&full, (target, target), mode, true)?;
        let p = pixels_u8(&DynamicImage::ImageLuma8(img.clone()), 1, (target, target))?;
        assert!(p.width < w, "not reduced");
        let small = Tensor::from_vec(p.data, (1, p.height, p.width), &dev)?.to_dtype(DType::F32)?;
        let reduced = resize(&small, (target, target), mode, true)?;
        (direct - reduced)?.abs()?.max_all()?.to_scalar::<f32>()
    }

    #[test]
    fn pre_reduction_stays_close_to_a_direct_resize() -> Result<()> {
        // A smooth picture (a digit-like blob) and a hard one (a fine
        // checkerboard of 0 and 255, where averaging is all there is).
        let blob = GrayImage::from_fn(256, 256, |x, y| {
            let (dx, dy) = (x as f32 - 128., y as f32 - 100.);
            Luma([(255. * (-(dx * dx + dy * dy) / 3000.).exp()) as u8])
        });
        let checker = GrayImage::from_fn(256, 256, |x, y| Luma([if (x + y) % 2 == 0 { 0 } else { 255 }]));
        for mode in [Interpolation::Bilinear, Interpolation::Bicubic] {
            for (name, img, tol) in [("blob", &blob, 2.), ("checker", &checker, 1.)] {
                let d = reduced_vs_direct(img, 16, mode)?;
                assert!(d <= tol, "{name} {mode:?}: {d} gray levels apart");
            }
        }
        Ok(())
    }

    #[test]
    fn small_images_are_passed_through() -> Result<()> {
        let img = DynamicImage::ImageLuma8(GrayImage::from_fn(8, 8, |x, y| Luma([(x + 8 * y) as u8])));
        let p = pixels_u8(&img, 1, (16, 16))?;
        assert_eq!((p.height, p.width), (8, 8));
        assert_eq!(p.data, img.to_luma8().into_raw());
        let rgb = DynamicImage::ImageRgb8(RgbImage::from_fn(2, 1, |x, _| Rgb([x as u8, 10, 20])));
        assert_eq!(pixels_u8(&rgb, 3, (2, 2))?.data, [0, 1, 10, 10, 20, 20]);
        Ok(())
    }

    /// Blocks average what they cover, partial edge blocks included:
    /// arithmetic written out.
    #[test]
    fn large_images_are_block_averaged() -> Result<()> {
        // 9 x 5 pixels, target 2 x 2: factors 5 / 4 = 1 rows, 9 / 4 = 2
        // columns; value = column index * 10.
        let img = DynamicImage::ImageLuma8(GrayImage::from_fn(9, 5, |x, _| Luma([(10 * x) as u8])));
        let p = pixels_u8(&img, 1, (2, 2))?;
        assert_eq!((p.height, p.width), (5, 5));
        // Columns (0,1) -> 5, (2,3) -> 25, (4,5) -> 45, (6,7) -> 65, (8) -> 80.
        assert_eq!(&p.data[..5], [5, 25, 45, 65, 80]);
        let rgb = DynamicImage::ImageRgb8(RgbImage::from_fn(8, 8, |x, y| {
            Rgb([(x + y) as u8, 100, if x < 4 { 0 } else { 200 }])
        }));
        let p = pixels_u8(&rgb, 3, (1, 1))?;
        assert_eq!((p.height, p.width), (2, 2));
        // Red: the mean of x + y over each 4 x 4 block is 1.5 + 1.5 = 3,
        // plus 4 per block to the right or below.
        assert_eq!(&p.data[..4], [3, 7, 7, 11]);
        assert_eq!(&p.data[4..8], [100; 4]);
        assert_eq!(&p.data[8..], [0, 200, 0, 200]);
        Ok(())
    }
}
