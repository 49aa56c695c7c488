//! Random inputs.

use candle::{Device, Tensor};

/// Standard normal f32 values of `shape` on the CPU.
pub fn randn(shape: &[usize]) -> candle::Result<Tensor> {
    Tensor::randn(0f32, 1., shape, &Device::Cpu)
}
