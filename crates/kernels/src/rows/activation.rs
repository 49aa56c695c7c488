//! Activations as PyTorch computes them, with one-pass CPU forms where
//! candle's composed ones cost a tensor each.

use candle::{bail, Result, Storage, Tensor};
use rayon::prelude::*;

use crate::elem::plain_cpu_f32;
use crate::rows::activation_grad::{activate, Activation};
use crate::rows::simd;
use crate::runtime::isa::{current, Isa};

/// `max(xs, 0)` elementwise as PyTorch's `relu` computes it: NaN stays NaN
/// (candle's `Tensor::relu` turns it into 0). Any device and dtype;
/// gradients flow where `xs >= 0`.
pub fn relu(xs: &Tensor) -> Result<Tensor> {
    xs.lt(0f32)?.where_cond(&xs.zeros_like()?, xs)
}

/// `silu(gate) · up` for `gate_up = [gate | up]` along the last dim (two
/// halves of equal width, as one projection to both gives them): the
/// SwiGLU of Llama's MLP (`act_fn(gate_proj(x)) * up_proj(x)`), one pass
/// over plain f32 CPU tensors (vectorised, no intermediate tensor), candle's
/// `silu` and multiply otherwise (any device; gradients flow). NaN stays
/// NaN.
pub fn silu_and_mul(gate_up: &Tensor) -> Result<Tensor> {
    gated(gate_up, Gate::Silu, current())
}

/// `gelu_tanh(gate) · up` for `gate_up = [gate | up]` along the last dim,
/// the GeGLU of Gemma's MLP (`gelu_pytorch_tanh`), as [`silu_and_mul`]
/// computes its SwiGLU: one pass over plain f32 CPU tensors, candle's
/// (tanh) `gelu` and multiply otherwise.
pub fn gelu_tanh_and_mul(gate_up: &Tensor) -> Result<Tensor> {
    gated(gate_up, Gate::GeluTanh, current())
}

/// The activation on a gated MLP's gate half.
#[derive(Debug, Clone, Copy)]
enum Gate {
    Silu,
    GeluTanh,
}

impl Gate {
    fn name(self) -> &'static str {
        match self {
            Self::Silu => "silu_and_mul",
            Self::GeluTanh => "gelu_tanh_and_mul",
        }
    }
}

/// `act(gate) · up` with the CPU pass's rows on `isa` (at most what the
/// processor runs).
fn gated(gate_up: &Tensor, kind: Gate, isa: Isa) -> Result<Tensor> {
    let name = kind.name();
    let dims = gate_up.dims();
    let Some(&width) = dims.last() else {
        bail!("{name}: expected (..., 2 * features), found a scalar")
    };
    if width % 2 != 0 {
        bail!("{name}: last dim is {width}, expected an even width (gate and up halves)")
    }
    let i = width / 2;
    if !plain_cpu_f32(gate_up) {
        let gate = gate_up.narrow(candle::D::Minus1, 0, i)?;
        let up = gate_up.narrow(candle::D::Minus1, i, i)?;
        // Where gradients flow, the activation's op with a backward of
        // its own (`activation_grad.rs`); candle's op otherwise.
        let act = match kind {
            Gate::Silu => Activation::Silu,
            Gate::GeluTanh => Activation::GeluTanh,
        };
        return activate(&gate, act, isa)? * up;
    }
    let x = gate_up.contiguous()?;
    let rows = x.elem_count() / width.max(1);
    let out = {
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            bail!("{name}: input is not on the CPU")
        };
        gated_rows(
            &cpu.as_slice::<f32>()?[layout.start_offset()..][..rows * width],
            rows,
            i,
            kind,
            isa,
        )
    };
    let mut shape = dims.to_vec();
    if let Some(last) = shape.last_mut() {
        *last = i;
    }
    Tensor::from_vec(out, shape, x.device())
}

/// `act(gate_up[.., :i]) · gate_up[.., i:]` for `rows` rows of `2i`
/// floats, into `rows` rows of `i`; rows split over rayon's pool where
/// there are enough of them.
fn gated_rows(gate_up: &[f32], rows: usize, i: usize, kind: Gate, isa: Isa) -> Vec<f32> {
    let mut out = vec![0f32; rows * i];
    if i == 0 {
        return out;
    }
    let row = |(o, x): (&mut [f32], &[f32])| match kind {
        Gate::Silu => simd::silu_mul(isa, &x[..i], &x[i..], o),
        Gate::GeluTanh => simd::gelu_tanh_mul(isa, &x[..i], &x[i..], o),
    };
    // About 16 K outputs a task, as candle's elementwise ops take.
    let per_task = (16 * 1024 / i).max(1);
    if rows * i >= 64 * 1024 {
        out.par_chunks_mut(per_task * i)
            .zip(gate_up.par_chunks(per_task * 2 * i))
            .for_each(|(o, x)| o.chunks_mut(i).zip(x.chunks(2 * i)).for_each(row));
    } else {
        out.chunks_mut(i).zip(gate_up.chunks(2 * i)).for_each(row);
    }
    out
}

#[cfg(test)]
mod tests {
    use candle::Result;

    use super::{gated, gelu_tanh_and_mul, silu_and_mul, Gate};
    use crate::runtime::isa::supported;
    use crate::testing::{randn, rel_err};

    /// `silu_and_mul` equals candle's `silu` times the other half, on every
    /// ISA, serial and split over the pool, with NaN and infinities where
    /// candle gives them; on variables it takes candle's ops (gradients
    /// flow); an odd width is an error that says so.
    #[test]
    fn silu_and_mul_equals_silu_times_up() -> Result<()> {
        gated_equals_candle(silu_and_mul, Gate::Silu, |g| g.silu())
    }

    /// `gelu_tanh_and_mul` equals candle's (tanh) `gelu` times the other
    /// half, as [`silu_and_mul_equals_silu_times_up`] checks the SwiGLU.
    #[test]
    fn gelu_tanh_and_mul_equals_gelu_times_up() -> Result<()> {
        gated_equals_candle(gelu_tanh_and_mul, Gate::GeluTanh, |g| g.gelu())
    }

    fn gated_equals_candle(
        ours: fn(&candle::Tensor) -> Result<candle::Tensor>,
        kind: Gate,
        act: fn(&candle::Tensor) -> Result<candle::Tensor>,
    ) -> Result<()> {
        use candle::{Device, Tensor, Var, D};

        let reference = |x: &Tensor| -> Result<Tensor> {
            let i = x.dim(D::Minus1)? / 2;
            act(&x.narrow(D::Minus1, 0, i)?)? * x.narrow(D::Minus1, i, i)?
        };
        for isa in supported() {
            let silu_and_mul = |x: &Tensor| gated(x, kind, isa);
            // A few rows (serial) and enough for the pool, widths off the
            // vector lanes; arguments past exp's range both ways.
            for shape in [[1, 3, 2 * 37], [2, 300, 2 * 176]] {
                let x = (randn(&shape)? * 8.)?;
                let y = silu_and_mul(&x)?;
                assert!(rel_err(&y, &reference(&x)?)? < 1e-6, "{isa:?} {shape:?}");
            }
            let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0., -100., 100.];
            // Every (gate, up) pair of them.
            let (gate, up): (Vec<f32>, Vec<f32>) = specials
                .iter()
                .flat_map(|&g| specials.iter().map(move |&u| (g, u)))
                .unzip();
            let x = Tensor::new(&[gate, up].concat()[..], &Device::Cpu)?.unsqueeze(0)?;
            let (ours, theirs) = (
                silu_and_mul(&x)?.to_vec2::<f32>()?,
                reference(&x)?.to_vec2::<f32>()?,
            );
            for (a, b) in ours[0].iter().zip(&theirs[0]) {
                assert!(
                    a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-6 * b.abs(),
                    "{isa:?}: {a} vs {b}"
                );
            }
        }
        let silu_and_mul = ours;
        let var = Var::from_tensor(&randn(&[4, 8])?)?;
        let grads = silu_and_mul(var.as_tensor())?.sum_all()?.backward()?;
        assert!(grads.get(var.as_tensor()).is_some());
        let err = silu_and_mul(&randn(&[2, 7])?).unwrap_err().to_string();
        assert!(err.contains("even"), "{err}");
        Ok(())
    }
}
