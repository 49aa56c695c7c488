//! Separable image resizing with PyTorch's `F.interpolate` semantics
//! (`align_corners=False`), used to resample position embeddings and to
//! resize input images.
//!
//! A separable resize is `out = Wy · img · Wxᵀ`, where each weight matrix
//! holds, per output pixel, the filter taps over input pixels. Building the
//! matrices on the host and resizing by two matmuls keeps the result
//! identical on every device and exact against PyTorch up to float
//! rounding. Ports `upsample_bilinear2d`/`upsample_bicubic2d` and their
//! `_aa` variants (`aten/src/ATen/native/UpSample.h`,
//! `aten/src/ATen/native/cpu/UpSampleKernel.cpp`).

use candle::{bail, DType, Result, Tensor};
use serde::{Deserialize, Serialize};

/// The interpolation filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Interpolation {
    /// Triangle filter (`mode='bilinear'`).
    Bilinear,
    /// Cubic convolution (`mode='bicubic'`): Keys' `a = -0.75` without
    /// antialiasing, `a = -0.5` (as PIL) with it, as PyTorch does.
    Bicubic,
}

/// Keys' cubic convolution kernel with parameter `a`.
fn cubic(x: f64, a: f64) -> f64 {
    let x = x.abs();
    if x <= 1. {
        ((a + 2.) * x - (a + 3.)) * x * x + 1.
    } else if x < 2. {
        ((a * x - 5. * a) * x + 8. * a) * x - 4. * a
    } else {
        0.
    }
}

fn triangle(x: f64) -> f64 {
    (1. - x.abs()).max(0.)
}

/// The `(n_out, n_in)` matrix that resizes one axis; empty when either
/// size is 0 (there is nothing to take from or to fill).
pub fn resize_weights(n_in: usize, n_out: usize, mode: Interpolation, antialias: bool) -> Vec<f32> {
    // With no input pixel the border clamps below would index -1.
    if n_in == 0 || n_out == 0 {
        return Vec::new();
    }
    let mut w = vec![0f64; n_out * n_in];
    let scale = n_in as f64 / n_out as f64;
    let last = n_in as i64 - 1;
    for i in 0..n_out {
        let row = &mut w[i * n_in..(i + 1) * n_in];
        if antialias {
            // The filter is stretched by the downscaling factor so that each
            // output averages every input it covers; taps outside the image
            // are dropped and the rest renormalised.
            let taps = match mode {
                Interpolation::Bilinear => 2.,
                Interpolation::Bicubic => 4.,
            };
            let (support, inv) = if scale >= 1. {
                (taps / 2. * scale, 1. / scale)
            } else {
                (taps / 2., 1.)
            };
            let center = scale * (i as f64 + 0.5);
            // `as i64` truncates toward zero, as the C++ `static_cast` does.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(n_in as i64);
            let mut total = 0.;
            for j in xmin..xmax {
                let x = (j as f64 - center + 0.5) * inv;
                let v = match mode {
                    Interpolation::Bilinear => triangle(x),
                    Interpolation::Bicubic => cubic(x, -0.5),
                };
                row[j as usize] = v;
                total += v;
            }
            if total != 0. {
                row.iter_mut().for_each(|v| *v /= total);
            }
        } else {
            let src = (i as f64 + 0.5) * scale - 0.5;
            match mode {
                Interpolation::Bilinear => {
                    // PyTorch clamps the source index at 0 for linear modes only.
                    let src = src.max(0.);
                    let i0 = (src.floor() as i64).min(last);
                    let t = src - src.floor();
                    let i1 = (i0 + 1).min(last);
                    row[i0 as usize] += 1. - t;
                    row[i1 as usize] += t;
                }
                Interpolation::Bicubic => {
                    let i0 = src.floor() as i64;
                    let t = src - src.floor();
                    let taps = [
                        cubic(t + 1., -0.75),
                        cubic(t, -0.75),
                        cubic(1. - t, -0.75),
                        cubic(2. - t, -0.75),
                    ];
                    for (k, v) in taps.into_iter().enumerate() {
                        // Out-of-range taps read the border pixel.
                        let j = (i0 - 1 + k as i64).clamp(0, last);
                        row[j as usize] += v;
                    }
                }
            }
        }
    }
    w.into_iter().map(|v| v as f32).collect()
}

/// Resizes the last two dims of `xs` to `(height, width)`, in f32, and
/// returns the result in the input dtype.
///
/// # Shapes
/// - `xs`: `(..., H, W)`
/// - returns `(..., height, width)`
pub fn resize(
    xs: &Tensor,
    (height, width): (usize, usize),
    mode: Interpolation,
    antialias: bool,
) -> Result<Tensor> {
    let rank = xs.rank();
    if rank < 2 {
        bail!(
            "resize: expected at least 2 dims (..., H, W), found shape {:?}",
            xs.dims()
        )
    }
    if height == 0 || width == 0 {
        bail!("resize: output size must be > 0, found ({height}, {width})")
    }
    let dims = xs.dims();
    let (h, w) = (dims[rank - 2], dims[rank - 1]);
    if (h, w) == (height, width) {
        return Ok(xs.clone());
    }
    if h == 0 || w == 0 {
        bail!("resize: the input is empty (shape {dims:?}): there is nothing to resize")
    }
    // The weight matrices are `(height, h)` and `(width, w)` on the host.
    if height.checked_mul(h).zip(width.checked_mul(w)).is_none() {
        bail!("resize: {h}x{w} to {height}x{width} overflows")
    }
    let dtype = xs.dtype();
    let dev = xs.device();
    let wy = Tensor::from_vec(resize_weights(h, height, mode, antialias), (height, h), dev)?;
    let wx = Tensor::from_vec(resize_weights(w, width, mode, antialias), (width, w), dev)?;
    let lead: usize = dims[..rank - 2].iter().product();
    // (N, H, W) -> (N, H, width) -> (N, height, width)
    let x = xs.to_dtype(DType::F32)?.reshape((lead, h, w))?;
    let x = x.broadcast_matmul(&wx.t()?)?;
    let x = wy.broadcast_left(lead)?.matmul(&x)?;
    let mut out_dims = dims[..rank - 2].to_vec();
    out_dims.extend([height, width]);
    x.reshape(out_dims)?.to_dtype(dtype)
}

/// Resamples an absolute position embedding to another patch grid, as
/// timm's `resample_abs_pos_embed` (`timm/layers/pos_embed.py`) with its
/// defaults: bicubic, antialiased, prefix tokens kept as they are.
///
/// # Shapes
/// - `pos_embed`: `(1, num_prefix_tokens + old_h * old_w, D)`
/// - returns `(1, num_prefix_tokens + new_h * new_w, D)`
pub fn resample_abs_pos_embed(
    pos_embed: &Tensor,
    new_size: (usize, usize),
    old_size: (usize, usize),
    num_prefix_tokens: usize,
) -> Result<Tensor> {
    let (_, len, dim) = pos_embed.dims3()?;
    if len != num_prefix_tokens + old_size.0 * old_size.1 {
        bail!(
            "resample_abs_pos_embed: {len} positions do not match {num_prefix_tokens} prefix tokens \
             and a {}x{} grid",
            old_size.0,
            old_size.1
        )
    }
    if new_size == old_size {
        return Ok(pos_embed.clone());
    }
    let prefix = pos_embed.narrow(1, 0, num_prefix_tokens)?;
    // (1, h*w, D) -> (D, h, w)
    let grid = pos_embed
        .narrow(1, num_prefix_tokens, len - num_prefix_tokens)?
        .reshape((old_size.0, old_size.1, dim))?
        .permute((2, 0, 1))?;
    let grid = resize(&grid, new_size, Interpolation::Bicubic, true)?;
    // (D, nh, nw) -> (1, nh*nw, D)
    let grid = grid
        .permute((1, 2, 0))?
        .reshape((1, new_size.0 * new_size.1, dim))?;
    Tensor::cat(&[&prefix, &grid], 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    fn rows_sum_to_one(w: &[f32], n_in: usize) -> bool {
        w.chunks(n_in).all(|r| (r.iter().sum::<f32>() - 1.).abs() < 1e-6)
    }

    /// Empty inputs are an error, not an index out of bounds.
    #[test]
    fn empty_inputs_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        for shape in [(1, 0, 4), (1, 4, 0), (1, 0, 0)] {
            let x = Tensor::zeros(shape, DType::F32, &dev)?;
            for mode in [Interpolation::Bilinear, Interpolation::Bicubic] {
                for aa in [false, true] {
                    let err = resize(&x, (3, 3), mode, aa).unwrap_err().to_string();
                    assert!(err.contains("empty"), "{shape:?} {mode:?} {aa}: {err}");
                }
            }
        }
        for mode in [Interpolation::Bilinear, Interpolation::Bicubic] {
            for aa in [false, true] {
                assert!(resize_weights(0, 3, mode, aa).is_empty());
                assert!(resize_weights(3, 0, mode, aa).is_empty());
            }
        }
        Ok(())
    }

    #[test]
    fn weights_are_partitions_of_unity() {
        for (i, o) in [(4, 6), (7, 3), (14, 20), (64, 32), (2, 7)] {
            for mode in [Interpolation::Bilinear, Interpolation::Bicubic] {
                for aa in [false, true] {
                    assert!(
                        rows_sum_to_one(&resize_weights(i, o, mode, aa), i),
                        "{i}->{o} {mode:?} {aa}"
                    );
                }
            }
        }
    }

    /// Golden values from PyTorch 2.x:
    /// `F.interpolate(torch.arange(4.)[None, None, None], size=(1, 6), mode=..., align_corners=False, antialias=...)`.
    #[test]
    fn matches_pytorch_on_a_ramp() -> Result<()> {
        let x = Tensor::arange(0f32, 4., &Device::Cpu)?.reshape((1, 4))?;
        let cases: [(Interpolation, bool, [f32; 6]); 3] = [
            (
                Interpolation::Bilinear,
                false,
                [0., 0.5, 1.1666667, 1.8333334, 2.5, 3.],
            ),
            (
                Interpolation::Bicubic,
                false,
                [-0.08680558, 0.40625, 1.2129627, 1.7870371, 2.59375, 3.0868058],
            ),
            (
                Interpolation::Bicubic,
                true,
                [
                    -0.06578932,
                    0.41176474,
                    1.1666667,
                    1.8333333,
                    2.5882354,
                    3.0657897,
                ],
            ),
        ];
        for (mode, aa, want) in cases {
            let got: Vec<f32> = resize(&x, (1, 6), mode, aa)?.flatten_all()?.to_vec1()?;
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-5, "{mode:?} aa={aa}: {got:?} vs {want:?}");
            }
        }
        Ok(())
    }
}
