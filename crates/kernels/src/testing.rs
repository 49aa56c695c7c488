//! Helpers of the crate's unit tests.

use candle::{Device, Result, Tensor};

pub(crate) fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(0f32, 1., shape, &Device::Cpu)
}

/// Largest difference over the expected tensor's largest magnitude.
pub(crate) fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1e-30);
    Ok(diff / scale)
}
