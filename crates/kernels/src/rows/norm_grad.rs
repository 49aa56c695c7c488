//! LayerNorm's backward: the op a [`LayerNorm`](super::LayerNorm) whose
//! input or weights track gradients runs, its forward the fused rows of
//! the inference path, its backward one pass over the rows.
//!
//! With `x̂ = (x - μ) · rstd` and `y = x̂ · γ + β` over a row of `d`, and
//! `g = dy · γ`:
//! - `dx = rstd · (g - mean(g) - x̂ · mean(g · x̂))`,
//! - `dγ = Σ dy · x̂` and `dβ = Σ dy` over the rows.
//!
//! The backward takes `μ` and `rstd` again from `x` (a row is in cache for
//! its `dx` anyway), each row's sums in f64. Rows go in blocks on rayon's
//! pool, each block summing its own `dγ` and `dβ`, added up in block order
//! afterwards, so the result does not depend on the threads.

use candle::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::norm::{f32_data, FusedLayerNorm};

/// Rows a block of the backward sums its `dγ` and `dβ` over.
const BLOCK_ROWS: usize = 32;

/// `LayerNorm(x)` over the arguments `x`, `γ` and `β` (contiguous f32 CPU
/// tensors), gradients flowing to each that tracks them.
pub(super) struct TrainedLayerNorm(pub(super) FusedLayerNorm);

impl CustomOp3 for TrainedLayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm-trained"
    }

    /// The rows of `x` normalised with the `γ` and `β` the op was built
    /// with, which are the values of the other two arguments.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = self.0.rows(f32_data(s1, l1)?, None)?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = gamma.elem_count();
        let dy = dy.contiguous()?;
        let gamma_data = gamma.to_vec1::<f32>()?;
        let (dx, dg, db) = {
            let (xs, xl) = x.storage_and_layout();
            let (gs, gl) = dy.storage_and_layout();
            let (Storage::Cpu(xs), Storage::Cpu(gs)) = (&*xs, &*gs) else {
                bail!("layer-norm: the backward's tensors are not on the CPU")
            };
            grads(f32_data(xs, xl)?, f32_data(gs, gl)?, &gamma_data, self.0.eps)?
        };
        let dx = x
            .track_op()
            .then(|| Tensor::from_vec(dx, x.shape(), x.device()))
            .transpose()?;
        let dg = gamma
            .track_op()
            .then(|| Tensor::from_vec(dg, d, gamma.device()))
            .transpose()?;
        let db = beta
            .track_op()
            .then(|| Tensor::from_vec(db, d, beta.device()))
            .transpose()?;
        Ok((dx, dg, db))
    }
}

/// `(dx, dγ, dβ)` of LayerNorm over the rows of `x` (of `γ`'s width), given
/// `dy`, the output's gradient.
fn grads(x: &[f32], dy: &[f32], gamma: &[f32], eps: f32) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
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
    let partial: Vec<(Vec<f32>, Vec<f32>)> = dx
        .par_chunks_mut(block)
        .zip(x.par_chunks(block))
        .zip(dy.par_chunks(block))
        .map(|((dx, x), dy)| {
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
        })
        .collect();
    let (mut dg, mut db) = (vec![0f32; d], vec![0f32; d]);
    for (g, b) in &partial {
        dg.iter_mut().zip(g).for_each(|(a, g)| *a += g);
        db.iter_mut().zip(b).for_each(|(a, b)| *a += b);
    }
    Ok((dx, dg, db))
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
