//! PIL's `Image.resize` on 8-bit images, to the last bit: the resampler
//! timm's and HF's preprocessing run (torchvision's `Resize` on a PIL
//! image, transformers' `ViTImageProcessorPil`).
//!
//! Port of `libImaging/Resample.c` (Pillow): per axis, a filter stretched
//! by the downscaling factor (the same taps as PyTorch's antialiased
//! `F.interpolate`, see [`crate::vit::resize_weights`]), its weights
//! rounded to 22-bit fixed point, a horizontal pass that rounds to 8 bits,
//! then a vertical pass that rounds again. The two roundings are why a
//! float resize differs from PIL by up to a gray level or two.

use candle::{bail, Result};

use crate::vit::resample::Interpolation;

/// Fixed-point bits of PIL's 8-bit coefficients (`32 - 8 - 2`).
const PRECISION_BITS: u32 = 22;

/// PIL's `bilinear_filter` and `bicubic_filter` (`a = -0.5`), written
/// as Pillow writes them so that every coefficient rounds as it does.
fn filter(mode: Interpolation, x: f64) -> f64 {
    let x = x.abs();
    match mode {
        Interpolation::Bilinear => {
            if x < 1. {
                1. - x
            } else {
                0.
            }
        }
        Interpolation::Bicubic => {
            let a = -0.5;
            if x < 1. {
                ((a + 2.) * x - (a + 3.)) * x * x + 1.
            } else if x < 2. {
                (((x - 5.) * x + 8.) * x - 4.) * a
            } else {
                0.
            }
        }
    }
}

/// Per output pixel: the first input pixel and the fixed-point weights
/// (`precompute_coeffs` and `normalize_coeffs_8bpc`).
fn coeffs(n_in: usize, n_out: usize, mode: Interpolation) -> Vec<(usize, Vec<i64>)> {
    let support_1 = match mode {
        Interpolation::Bilinear => 1.,
        Interpolation::Bicubic => 2.,
    };
    let scale = n_in as f64 / n_out as f64;
    let filterscale = scale.max(1.);
    let support = support_1 * filterscale;
    let ss = 1. / filterscale;
    (0..n_out)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero, as `as i64` does.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64)
                .min(n_in as i64)
                .max(xmin as i64) as usize;
            let w: Vec<f64> = (xmin..xmax)
                .map(|x| filter(mode, (x as f64 - center + 0.5) * ss))
                .collect();
            let total: f64 = w.iter().sum();
            let one = f64::from(1u32 << PRECISION_BITS);
            let k = w
                .iter()
                .map(|&v| {
                    let v = if total != 0. { v / total } else { v };
                    if v < 0. {
                        (-0.5 + v * one) as i64
                    } else {
                        (0.5 + v * one) as i64
                    }
                })
                .collect();
            (xmin, k)
        })
        .collect()
}

/// PIL's `clip8`: the accumulator, which started at one half, shifted
/// down and clamped to `0..=255`.
fn clip8(ss: i64) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resamples one axis of `planes` planes of `rows x cols` pixels.
/// `horizontal`: along the columns; else along the rows.
fn pass(
    data: &[u8],
    (planes, rows, cols): (usize, usize, usize),
    n_out: usize,
    horizontal: bool,
    mode: Interpolation,
) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let (n_in, (out_rows, out_cols)) = if horizontal {
        (cols, (rows, n_out))
    } else {
        (rows, (n_out, cols))
    };
    let k = coeffs(n_in, n_out, mode);
    let mut out = vec![0u8; planes * out_rows * out_cols];
    for p in 0..planes {
        let src = &data[p * rows * cols..(p + 1) * rows * cols];
        let dst = &mut out[p * out_rows * out_cols..(p + 1) * out_rows * out_cols];
        for y in 0..out_rows {
            for x in 0..out_cols {
                // The input line this output reads: a row (horizontal) or
                // a column (vertical), as a start and a stride.
                let ((first, weights), base, stride) = if horizontal {
                    (&k[x], y * cols, 1)
                } else {
                    (&k[y], x, cols)
                };
                let ss = weights.iter().enumerate().fold(half, |acc, (j, &w)| {
                    acc + i64::from(src[base + (first + j) * stride]) * w
                });
                dst[y * out_cols + x] = clip8(ss);
            }
        }
    }
    out
}

/// Resizes `(channels, height, width)` 8-bit pixels to `(out_h, out_w)`
/// as PIL's `Image.resize((out_w, out_h), resample)` does with
/// `Image.BILINEAR` or `Image.BICUBIC` (no `reducing_gap`): horizontal
/// pass first, each pass rounded to 8 bits, an axis whose size does not
/// change left alone.
pub fn resize_u8(
    data: &[u8],
    (channels, height, width): (usize, usize, usize),
    (out_h, out_w): (usize, usize),
    mode: Interpolation,
) -> Result<Vec<u8>> {
    let n = channels.checked_mul(height).and_then(|n| n.checked_mul(width));
    if n != Some(data.len()) {
        bail!(
            "resize_u8: {} pixels are not {channels} x {height} x {width}",
            data.len()
        )
    }
    if height == 0 || width == 0 || out_h == 0 || out_w == 0 {
        bail!("resize_u8: empty image ({height}x{width}) or output ({out_h}x{out_w})")
    }
    if channels
        .checked_mul(height.max(out_h))
        .and_then(|n| n.checked_mul(width.max(out_w)))
        .is_none()
    {
        bail!("resize_u8: {height}x{width} to {out_h}x{out_w} overflows")
    }
    let mut cur = data.to_vec();
    let mut cols = width;
    if out_w != width {
        cur = pass(&cur, (channels, height, width), out_w, true, mode);
        cols = out_w;
    }
    if out_h != height {
        cur = pass(&cur, (channels, height, cols), out_h, false, mode);
    }
    Ok(cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden values from Pillow 13:
    /// `Image.frombytes('L', (8, 1), bytes([0, 30, 60, 90, 120, 150, 200, 255])).resize((3, 1), m)`
    /// and `.resize((11, 1), m)`.
    #[test]
    fn matches_pillow_on_a_ramp() -> Result<()> {
        let row = [0u8, 30, 60, 90, 120, 150, 200, 255];
        let cases: [(Interpolation, usize, &[u8]); 4] = [
            (Interpolation::Bilinear, 3, &[33, 105, 198]),
            (Interpolation::Bicubic, 3, &[27, 104, 206]),
            (
                Interpolation::Bilinear,
                11,
                &[0, 18, 40, 61, 83, 105, 127, 149, 184, 223, 255],
            ),
            (
                Interpolation::Bicubic,
                11,
                &[0, 15, 40, 61, 83, 105, 126, 148, 183, 226, 255],
            ),
        ];
        for (mode, n, want) in cases {
            let got = resize_u8(&row, (1, 1, 8), (1, n), mode)?;
            assert_eq!(got, want, "{mode:?} to {n}");
        }
        Ok(())
    }
}
