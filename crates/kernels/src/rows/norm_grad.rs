//! LayerNorm's and RMSNorm's backward, one pass over the rows: what the op
//! a [`LayerNorm`](super::LayerNorm) or [`RmsNorm`](super::RmsNorm) whose
//! input or weights track gradients runs (`norm.rs`) takes its gradients
//! with, and that RMSNorm op's forward.
//!
//! With `x̂ = (x - μ) · rstd` and `y = x̂ · γ + β` over a row of `d`, and
//! `g = dy · γ`:
//! - `dx = rstd · (g - mean(g) - x̂ · mean(g · x̂))`,
//! - `dγ = Σ dy · x̂` and `dβ = Σ dy` over the rows.
//!
//! RMSNorm's is LayerNorm's without the mean and the bias: with `x̂ = x ·
//! rstd`, `rstd = 1 / sqrt(mean(x²) + eps)`, `y = x̂ · w` and `g = dy · w`,
//! `dx = rstd · (g - x̂ · mean(g · x̂))` and `dw = Σ dy · x̂`.
//!
//! The backward takes `μ` and `rstd` again from `x` (a row is in cache for
//! its `dx` anyway), each row's sums in f64. Rows go in blocks over the
//! threads, each block summing its own `dγ` and `dβ`, added up in block order
//! afterwards, so the result does not depend on the threads.

use candle::{bail, Result};

use crate::runtime::pool::{par_chunks_mut, par_chunks_mut_map, piece};

/// Rows a block of the backward sums its `dγ` and `dβ` over.
const BLOCK_ROWS: usize = 32;

/// `(dx, dγ, dβ)` of LayerNorm over the rows of `x` (of `γ`'s width), given
/// `dy`, the output's gradient.
pub(super) fn grads(
    x: &[f32],
    dy: &[f32],
    gamma: &[f32],
    eps: f32,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let d = gamma.len();
    if d == 0 || !x.len().is_multiple_of(d) || dy.len() != x.len() {
        bail!(
            "layer-norm backward: {} inputs and {} gradients for rows of {d}",
            x.len(),
            dy.len()
        )
    }
    let mut dx = vec![0f32; x.len()];
    let block = BLOCK_ROWS * d;
    let partial: Vec<(Vec<f32>, Vec<f32>)> = par_chunks_mut_map(&mut dx, block, x.len(), |b, dx| {
        let (x, dy) = (piece(x, block, b), piece(dy, block, b));
        let (mut dg, mut db, mut xhat) = (vec![0f32; d], vec![0f32; d], vec![0f32; d]);
        for ((dx, x), dy) in dx
            .chunks_exact_mut(d)
            .zip(x.chunks_exact(d))
            .zip(dy.chunks_exact(d))
        {
            let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
            let var = x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1. / (var + f64::from(eps)).sqrt();
            let (mut sum_g, mut sum_gx) = (0f64, 0f64);
            for i in 0..d {
                let xh = ((f64::from(x[i]) - mean) * rstd) as f32;
                let g = dy[i] * gamma[i];
                xhat[i] = xh;
                sum_g += f64::from(g);
                sum_gx += f64::from(g * xh);
                dg[i] += dy[i] * xh;
                db[i] += dy[i];
            }
            let (mean_g, mean_gx) = ((sum_g / d as f64) as f32, (sum_gx / d as f64) as f32);
            let rstd = rstd as f32;
            for i in 0..d {
                dx[i] = rstd * (dy[i] * gamma[i] - mean_g - xhat[i] * mean_gx);
            }
        }
        (dg, db)
    });
    let (mut dg, mut db) = (vec![0f32; d], vec![0f32; d]);
    for (g, b) in &partial {
        dg.iter_mut().zip(g).for_each(|(a, g)| *a += g);
        db.iter_mut().zip(b).for_each(|(a, b)| *a += b);
    }
    Ok((dx, dg, db))
}

/// `1 / sqrt(mean(x²) + eps)` of a row, summed in f64.
fn rms_rstd(x: &[f32], eps: f32) -> f64 {
    let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
    1. / (ms + f64::from(eps)).sqrt()
}

/// RMSNorm of the rows of `x` (of `w`'s width): `x · rstd · w`.
pub(super) fn rms_rows(x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>> {
    let d = w.len();
    if d == 0 || !x.len().is_multiple_of(d) {
        bail!("rms-norm: {} inputs for rows of {d}", x.len())
    }
    let mut y = vec![0f32; x.len()];
    par_chunks_mut(&mut y, BLOCK_ROWS * d, x.len(), |b, y| {
        let x = piece(x, BLOCK_ROWS * d, b);
        for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let rstd = rms_rstd(x, eps) as f32;
            for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                *y = x * rstd * w;
            }
        }
    });
    Ok(y)
}

/// `(dx, dw)` of RMSNorm over the rows of `x` (of `w`'s width), given
/// `dy`, the output's gradient.
pub(super) fn rms_grads(x: &[f32], dy: &[f32], w: &[f32], eps: f32) -> Result<(Vec<f32>, Vec<f32>)> {
    let d = w.len();
    if d == 0 || !x.len().is_multiple_of(d) || dy.len() != x.len() {
        bail!(
            "rms-norm backward: {} inputs and {} gradients for rows of {d}",
            x.len(),
            dy.len()
        )
    }
    let mut dx = vec![0f32; x.len()];
    let block = BLOCK_ROWS * d;
    let partial: Vec<Vec<f32>> = par_chunks_mut_map(&mut dx, block, x.len(), |b, dx| {
        let (x, dy) = (piece(x, block, b), piece(dy, block, b));
        let mut dw = vec![0f32; d];
        for ((dx, x), dy) in dx
            .chunks_exact_mut(d)
            .zip(x.chunks_exact(d))
            .zip(dy.chunks_exact(d))
        {
            let rstd = rms_rstd(x, eps) as f32;
            let mut sum_gx = 0f64;
            for i in 0..d {
                let xh = x[i] * rstd;
                sum_gx += f64::from(dy[i] * w[i] * xh);
                dw[i] += dy[i] * xh;
            }
            let mean_gx = (sum_gx / d as f64) as f32;
            for i in 0..d {
                dx[i] = rstd * (dy[i] * w[i] - x[i] * rstd * mean_gx);
            }
        }
        dw
    });
    let mut dw = vec![0f32; d];
    for p in &partial {
        dw.iter_mut().zip(p).for_each(|(a, g)| *a += g);
    }
    Ok((dx, dw))
}

#[cfg(test)]
mod tests {
    use candle::{DType, Device, Module, Result, Tensor, Var};
    use candle_nn::{VarBuilder, VarMap};

    use super::super::LayerNorm;
    use crate::testing::{randn, rel_err};

    /// A LayerNorm over variables (and over a variable input) gives
    /// candle-nn's op-by-op `layer_norm_slow`'s output and its autograd's
    /// `dx`, `dγ` and `dβ`, on widths off the lanes, batched and not, in
    /// blocks of rows and not, with and without a bias (none trained then).
    #[test]
    fn gradients_equal_candle_autograd() -> Result<()> {
        for (shape, bias) in [
            (vec![3, 5, 37], true),
            (vec![700, 64], false),
            (vec![2, 1, 512], true),
            (vec![70, 768], true),
        ] {
            let d = *shape.last().unwrap();
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
            let norm = match bias {
                true => LayerNorm::new(d, 1e-5, vb)?,
                false => LayerNorm::new_no_bias(d, 1e-5, vb)?,
            };
            // Weights away from their initial 1 and 0.
            for var in varmap.all_vars() {
                var.set(&randn(&[d])?.affine(0.5, 1.)?)?;
            }
            let x = Var::from_tensor(&randn(&shape)?.affine(3., 2.)?)?;
            let var = |name: &str| {
                varmap
                    .data()
                    .lock()
                    .unwrap()
                    .get(name)
                    .map(|v| v.as_tensor().clone())
            };
            let w = &var("weight").unwrap();
            // Without a bias, the constant zeros the norm adds.
            let b = &var("bias").unwrap_or(Tensor::zeros(d, DType::F32, &Device::Cpu)?);
            let xt = x.as_tensor();
            let y = norm.forward(xt)?;
            let expected = candle_nn::ops::layer_norm_slow(xt, w, b, 1e-5)?;
            assert!(rel_err(&y, &expected)? < 1e-5, "{shape:?}: forward");
            let r = randn(&shape)?;
            let got = (&y * &r)?.sum_all()?.backward()?;
            let want = (&expected * &r)?.sum_all()?.backward()?;
            let mut ts = vec![("dx", xt), ("dγ", w)];
            if bias {
                ts.push(("dβ", b));
            }
            for (name, t) in ts {
                let (Some(g), Some(e)) = (got.get(t), want.get(t)) else {
                    panic!("{shape:?}: no {name}")
                };
                assert!(rel_err(g, e)? < 1e-5, "{shape:?}: {name} {:e}", rel_err(g, e)?);
            }
            // A plain input: gradients for the weights only.
            let plain = xt.detach();
            let got = (norm.forward(&plain)? * &r)?.sum_all()?.backward()?;
            assert!(got.get(&plain).is_none() && got.get(w).is_some(), "{shape:?}");
            // The residual's add trains too.
            let res = Var::from_tensor(&randn(&shape)?)?;
            let got = (norm.forward_add(xt, res.as_tensor())? * &r)?
                .sum_all()?
                .backward()?;
            let want = (candle_nn::ops::layer_norm_slow(&(xt + res.as_tensor())?, w, b, 1e-5)? * &r)?
                .sum_all()?
                .backward()?;
            for t in [xt, res.as_tensor(), w] {
                assert!(
                    rel_err(got.get(t).unwrap(), want.get(t).unwrap())? < 1e-5,
                    "{shape:?}: add"
                );
            }
        }
        Ok(())
    }
}
