//! The activations where gradients flow: the exact and tanh GELUs, SiLU
//! and ReLU as candle ops whose forward is the inference path's vectorised
//! pass (`simd.rs`) and whose backward is one more, `dx = dy · f'(x)`,
//! where candle's own backward of each takes a tensor op per term of the
//! derivative.

use candle::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use crate::elem::{f32_data, with_f32_data};
use crate::rows::simd;
use crate::runtime::isa::Isa;
use crate::runtime::pool::{par_chunks_mut, piece};

/// Elements a task of the passes takes, over the threads past one.
const CHUNK: usize = 1 << 14;

/// An activation with a derivative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// `x · Φ(x)`, PyTorch's `gelu` (`approximate='none'`).
    GeluErf,
    /// PyTorch's `gelu(approximate='tanh')`.
    GeluTanh,
    /// `x · σ(x)`.
    Silu,
    /// `max(x, 0)`, NaN kept; its gradient `dy` where `x > 0`, else 0
    /// (PyTorch's `threshold_backward`).
    Relu,
}

impl Activation {
    /// candle's op: any device and dtype, gradients through candle's
    /// backward of it.
    fn candle(self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::GeluErf => xs.gelu_erf(),
            // candle's `gelu` is the tanh approximation.
            Self::GeluTanh => xs.gelu(),
            Self::Silu => xs.silu(),
            // candle's `relu` turns NaN into 0.
            Self::Relu => xs.lt(0f32)?.where_cond(&xs.zeros_like()?, xs),
        }
    }

    /// The activation of `xs` in place, on `isa`.
    fn apply(self, isa: Isa, xs: &mut [f32]) {
        match self {
            Self::GeluErf => simd::gelu_erf(isa, xs),
            Self::GeluTanh => simd::gelu_tanh(isa, xs),
            Self::Silu => simd::silu(isa, xs),
            Self::Relu => simd::relu(isa, xs),
        }
    }

    /// `dx = dy · f'(x)`, on `isa`.
    fn grad(self, isa: Isa, x: &[f32], dy: &[f32], dx: &mut [f32]) {
        match self {
            Self::GeluErf => simd::gelu_erf_grad(isa, x, dy, dx),
            Self::GeluTanh => simd::gelu_tanh_grad(isa, x, dy, dx),
            Self::Silu => simd::silu_grad(isa, x, dy, dx),
            Self::Relu => simd::relu_grad(isa, x, dy, dx),
        }
    }
}

/// `act(xs)`: where `xs` tracks gradients and is an f32 CPU tensor, the
/// op of this file on `isa`; candle's op otherwise (so an input that
/// tracks none is computed as candle computes it).
pub(crate) fn activate(xs: &Tensor, act: Activation, isa: Isa) -> Result<Tensor> {
    if xs.track_op() && xs.device().is_cpu() && xs.dtype() == DType::F32 {
        xs.contiguous()?.apply_op1(Trained { act, isa })
    } else {
        act.candle(xs)
    }
}

/// The op of one activation on one instruction set.
struct Trained {
    act: Activation,
    isa: Isa,
}

impl CustomOp1 for Trained {
    fn name(&self) -> &'static str {
        match self.act {
            Activation::GeluErf => "gelu-erf-trained",
            Activation::GeluTanh => "gelu-tanh-trained",
            Activation::Silu => "silu-trained",
            Activation::Relu => "relu-trained",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let mut out = f32_data(s, l, "activation")?.to_vec();
        let (act, isa) = (self.act, self.isa);
        let n = out.len();
        par_chunks_mut(&mut out, CHUNK, n, |_, c| act.apply(isa, c));
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dy.to_dtype(DType::F32)?.contiguous()?;
        let dx = with_f32_data([x, &dy], "activation", |[x_data, g]| {
            if g.len() != x_data.len() {
                bail!(
                    "activation: a gradient of {} for {} inputs",
                    g.len(),
                    x_data.len()
                )
            }
            let mut dx = vec![0f32; x_data.len()];
            let (act, isa) = (self.act, self.isa);
            par_chunks_mut(&mut dx, CHUNK, x_data.len(), |i, d| {
                act.grad(isa, piece(x_data, CHUNK, i), piece(g, CHUNK, i), d)
            });
            Ok(dx)
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle::{Result, Var};

    use super::{activate, Activation};
    use crate::runtime::isa::supported;
    use crate::testing::{randn, rel_err};

    /// On every instruction set the processor runs, each activation of a
    /// variable gives candle's value and its autograd's gradient, on sizes
    /// in one pass and in parallel chunks, over inputs of scale 3 (into
    /// the tails, where `Φ` and `σ` saturate).
    #[test]
    fn gradients_equal_candle_autograd_on_every_isa() -> Result<()> {
        for isa in supported() {
            for shape in [vec![3, 37], vec![5, 70, 130]] {
                let x = Var::from_tensor(&(randn(&shape)? * 3.)?)?;
                let r = randn(&shape)?;
                for act in [
                    Activation::GeluErf,
                    Activation::GeluTanh,
                    Activation::Silu,
                    Activation::Relu,
                ] {
                    let what = format!("{isa:?} {act:?} {shape:?}");
                    let (y, expected) = (activate(x.as_tensor(), act, isa)?, act.candle(x.as_tensor())?);
                    assert!(rel_err(&y, &expected)? < 1e-5, "{what}: value");
                    let g = (&y * &r)?.sum_all()?.backward()?;
                    let e = (&expected * &r)?.sum_all()?.backward()?;
                    let (g, e) = (g.get(x.as_tensor()).unwrap(), e.get(x.as_tensor()).unwrap());
                    assert!(rel_err(g, e)? < 1e-5, "{what}: gradient {:e}", rel_err(g, e)?);
                }
            }
        }
        Ok(())
    }

    /// ReLU of a variable as PyTorch's: NaN stays NaN, and the gradient
    /// passes where `x > 0` only (0 at 0 and at NaN, `threshold_backward`).
    #[test]
    fn relu_keeps_nan_and_passes_gradients_where_positive() -> Result<()> {
        use candle::{Device, Tensor};

        let xs = [-1f32, 0., 2., f32::NAN, 3.5];
        let x = Var::from_tensor(&Tensor::new(&xs[..], &Device::Cpu)?)?;
        for isa in supported() {
            let y = activate(x.as_tensor(), Activation::Relu, isa)?;
            let ys = y.to_vec1::<f32>()?;
            assert_eq!(&ys[..3], &[0., 0., 2.], "{isa:?}");
            assert!(ys[3].is_nan() && ys[4] == 3.5, "{isa:?}: {ys:?}");
            let dy = Tensor::new(&[10f32, 20., 30., 40., 50.], &Device::Cpu)?;
            let g = (y * dy)?.sum_all()?.backward()?;
            let dx = g.get(x.as_tensor()).expect("a gradient").to_vec1::<f32>()?;
            assert_eq!(dx, vec![0., 0., 30., 0., 50.], "{isa:?}");
        }
        Ok(())
    }
}
