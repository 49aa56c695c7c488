//! How far a result is from the expected one, measured against the
//! expected tensor's scale: elementwise relative error is meaningless for
//! the near-zero entries that cancellation produces.

use anyhow::{bail, Result};
use candle::{DType, Tensor};

/// Asserts that `a` equals `b` within relative error `rtol`, measured
/// against the expected tensor's scale: `|a_i - b_i| <= rtol * max_j |b_j|`
/// for every element. Names the worst element.
pub fn assert_close(what: &str, a: &Tensor, b: &Tensor, rtol: f64) -> Result<()> {
    if a.dims() != b.dims() {
        bail!(
            "{what}: shape {:?} differs from expected {:?}",
            a.dims(),
            b.dims()
        )
    }
    let a: Vec<f32> = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let b: Vec<f32> = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let scale = b.iter().fold(0f64, |m, &y| m.max((y as f64).abs()));
    let tol = rtol * scale.max(f64::MIN_POSITIVE);
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
        let err = (x as f64 - y as f64).abs();
        // NaN compares false with everything, so it is checked first.
        let bad = err.is_nan() || err > tol;
        if bad && worst.is_none_or(|(_, w)| err.is_nan() || err > w) {
            worst = Some((i, err));
        }
    }
    if let Some((i, err)) = worst {
        bail!(
            "{what}: element {i} is {} but expected {}: error {err:.3e} > {rtol:e} x max|expected| {scale:.3e}",
            a[i],
            b[i]
        )
    }
    Ok(())
}

/// The largest absolute difference between two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> candle::Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar()
}

/// The largest difference over the expected tensor's largest magnitude
/// (f32 tensors of the same shape).
pub fn rel_err(a: &Tensor, b: &Tensor) -> candle::Result<f32> {
    let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1e-30);
    Ok(diff / scale)
}

/// The tolerance, relative to the largest logit, of a model with half-
/// precision weights against the oracle's f32 compute over the same
/// rounded weights: 1e-5, but 2e-2 (the bf16 target against f32) for `bf16`
/// weights where the CPU kernels run `avx512bf16`, whose `vdpbf16ps`
/// layers round their inputs to bf16 as PyTorch's CPU autocast does
/// (`crates/kernels`' tests hold those layers to 1e-5 of the sums over the
/// rounded inputs).
pub fn half_weights_tolerance(bf16: bool) -> f64 {
    match (bf16, multihead_attention::cpu_isa()) {
        (true, "avx512bf16") => 2e-2,
        _ => 1e-5,
    }
}
