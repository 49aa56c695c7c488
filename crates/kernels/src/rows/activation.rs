//! Activations as PyTorch computes them, with one-pass CPU forms where
//! candle's composed ones cost a tensor each.

use candle::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Storage, Tensor};

use crate::elem::{f32_data, grad_for, plain_cpu_f32, with_f32_data};
use crate::rows::activation_grad::{activate, Activation};
use crate::rows::simd;
use crate::runtime::isa::{current, Isa};
use crate::runtime::pool::{par_chunks_mut, piece, SyncPtr};

/// `max(xs, 0)` elementwise as PyTorch's `relu` computes it: NaN stays NaN
/// (candle's `Tensor::relu` turns it into 0). Any device and dtype;
/// gradients flow where `xs > 0` (one op each way on f32 CPU tensors that
/// train; where `xs >= 0` through candle's select elsewhere).
pub fn relu(xs: &Tensor) -> Result<Tensor> {
    activate(xs, Activation::Relu, current())
}

/// `silu(gate) · up` for `gate_up = [gate | up]` along the last dim (two
/// halves of equal width, as one projection to both gives them): the
/// SwiGLU of Llama's MLP (`act_fn(gate_proj(x)) * up_proj(x)`), one pass
/// over plain f32 CPU tensors (vectorised, no intermediate tensor); where
/// gradients flow on f32 CPU tensors, one op whose backward gives
/// `[d_gate | d_up]` in one pass; candle's `silu` and multiply otherwise
/// (any device; gradients flow). NaN stays NaN.
pub fn silu_and_mul(gate_up: &Tensor) -> Result<Tensor> {
    gated(gate_up, Gate::Silu, current())
}

/// `gelu_tanh(gate) · up` for `gate_up = [gate | up]` along the last dim,
/// the GeGLU of Gemma's MLP (`gelu_pytorch_tanh`), as [`silu_and_mul`]
/// computes its SwiGLU: one pass over plain f32 CPU tensors, one op each
/// way where they train, candle's (tanh) `gelu` and multiply otherwise.
pub fn gelu_tanh_and_mul(gate_up: &Tensor) -> Result<Tensor> {
    gated(gate_up, Gate::GeluTanh, current())
}

/// `silu(gate) · up` of two tensors of one shape (a gated MLP whose gate
/// and up projections are kept apart: variables that train): on f32 CPU
/// tensors one pass, and where gradients flow one op whose backward gives
/// both gradients in one pass; candle's `silu` and multiply otherwise.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated_pair(gate, up, Gate::Silu, current())
}

/// `gelu_tanh(gate) · up` of two tensors of one shape, as [`silu_mul`]
/// computes the SwiGLU.
pub fn gelu_tanh_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated_pair(gate, up, Gate::GeluTanh, current())
}

/// The activation on a gated MLP's gate half.
#[derive(Debug, Clone, Copy)]
enum Gate {
    Silu,
    GeluTanh,
}

impl Gate {
    /// The activation alone.
    fn activation(self) -> Activation {
        match self {
            Self::Silu => Activation::Silu,
            Self::GeluTanh => Activation::GeluTanh,
        }
    }

    /// `out = act(gate) · up` over slices of one length.
    fn forward(self, isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
        match self {
            Self::Silu => simd::silu_mul(isa, gate, up, out),
            Self::GeluTanh => simd::gelu_tanh_mul(isa, gate, up, out),
        }
    }

    /// The gradients of `act(gate) · up` given the output's, `dout`:
    /// `d_up = act(gate) · dout` and `d_gate = act'(gate) · dout · up`.
    fn backward(self, isa: Isa, [gate, up, dout]: [&[f32]; 3], d_gate: &mut [f32], d_up: &mut [f32]) {
        self.forward(isa, gate, dout, d_up);
        match self {
            Self::Silu => simd::silu_grad(isa, gate, dout, d_gate),
            Self::GeluTanh => simd::gelu_tanh_grad(isa, gate, dout, d_gate),
        }
        for (g, &u) in d_gate.iter_mut().zip(up) {
            *g *= u;
        }
    }

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
    if f32_cpu(gate_up) && gate_up.track_op() {
        // One op over both halves, its gradient `[d_gate | d_up]`.
        return gate_up.contiguous()?.apply_op1(TrainedGate { kind, isa });
    }
    if !plain_cpu_f32(gate_up) {
        let gate = gate_up.narrow(candle::D::Minus1, 0, i)?;
        let up = gate_up.narrow(candle::D::Minus1, i, i)?;
        // Where gradients flow, the activation's op with a backward of
        // its own (`activation_grad.rs`); candle's op otherwise.
        return activate(&gate, kind.activation(), isa)? * up;
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
/// floats, into `rows` rows of `i`; rows split over the threads where
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
    par_chunks_mut(&mut out, per_task * i, rows * i, |t, o| {
        o.chunks_mut(i)
            .zip(piece(gate_up, per_task * 2 * i, t).chunks(2 * i))
            .for_each(row)
    });
    out
}

/// Whether `t` is an f32 CPU tensor.
fn f32_cpu(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == candle::DType::F32
}

/// `act(gate) · up` of two tensors of one shape ([`silu_mul`]).
fn gated_pair(gate: &Tensor, up: &Tensor, kind: Gate, isa: Isa) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!(
            "{}: gate {:?} and up {:?} differ in shape",
            kind.name(),
            gate.dims(),
            up.dims()
        )
    }
    if !(f32_cpu(gate) && f32_cpu(up)) {
        return activate(gate, kind.activation(), isa)? * up;
    }
    let op = TrainedGate { kind, isa };
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    match gate.track_op() || up.track_op() {
        true => gate.apply_op2(&up, op),
        false => gate.apply_op2_no_bwd(&up, &op),
    }
}

/// Floats a task of the gated ops takes, about what candle's elementwise
/// ops take.
const PER_TASK: usize = 16 * 1024;

/// `act(gate) · up` as an op with a backward: over two arguments of one
/// shape (`CustomOp2`), or over one whose rows are `[gate | up]`
/// (`CustomOp1`), its gradient then `[d_gate | d_up]` in one tensor.
struct TrainedGate {
    kind: Gate,
    isa: Isa,
}

impl TrainedGate {
    /// The output of `gate`, `up` (`n` floats each, or `None` and the
    /// rows `[gate | up]` of `x` of width `2i`).
    fn forward(&self, x: &[f32], up: Option<&[f32]>, i: usize) -> Vec<f32> {
        let n = if up.is_some() { x.len() } else { x.len() / 2 };
        let mut out = vec![0f32; n];
        match up {
            Some(up) => par_chunks_mut(&mut out, PER_TASK, n, |t, o| {
                let (g, u) = (piece(x, PER_TASK, t), piece(up, PER_TASK, t));
                self.kind.forward(self.isa, g, u, o)
            }),
            None => {
                let rows = (PER_TASK / i.max(1)).max(1);
                par_chunks_mut(&mut out, rows * i, n, |t, o| {
                    for (o, x) in o.chunks_mut(i).zip(piece(x, rows * 2 * i, t).chunks(2 * i)) {
                        self.kind.forward(self.isa, &x[..i], &x[i..], o);
                    }
                });
            }
        }
        out
    }
}

impl CustomOp1 for TrainedGate {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_data(s, l, self.kind.name())?;
        let mut dims = l.dims().to_vec();
        let i = dims.last().copied().unwrap_or(0) / 2;
        if let Some(last) = dims.last_mut() {
            *last = i;
        }
        Ok((CpuStorage::F32(self.forward(x, None, i)), Shape::from(dims)))
    }

    fn bwd(&self, gate_up: &Tensor, _: &Tensor, dout: &Tensor) -> Result<Option<Tensor>> {
        let i = gate_up.dim(candle::D::Minus1)? / 2;
        let dout = dout.contiguous()?;
        let mut grad = vec![0f32; gate_up.elem_count()];
        with_f32_data([gate_up, &dout], self.kind.name(), |[x, d]| {
            let rows = (PER_TASK / i.max(1)).max(1);
            par_chunks_mut(&mut grad, rows * 2 * i, x.len(), |t, g| {
                let (x, d) = (piece(x, rows * 2 * i, t), piece(d, rows * i, t));
                for ((g, x), d) in g.chunks_mut(2 * i).zip(x.chunks(2 * i)).zip(d.chunks(i)) {
                    let (dg, du) = g.split_at_mut(i);
                    self.kind.backward(self.isa, [&x[..i], &x[i..], d], dg, du);
                }
            });
            Ok(())
        })?;
        Ok(Some(Tensor::from_vec(grad, gate_up.shape(), gate_up.device())?))
    }
}

impl CustomOp2 for TrainedGate {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (f32_data(s1, l1, "gate")?, f32_data(s2, l2, "up")?);
        Ok((CpuStorage::F32(self.forward(g, Some(u), 0)), l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dout = dout.contiguous()?;
        let n = gate.elem_count();
        let (mut dg, mut du) = (vec![0f32; n], vec![0f32; n]);
        with_f32_data([gate, up, &dout], self.kind.name(), |[g, u, d]| {
            let du_at = SyncPtr(du.as_mut_ptr());
            par_chunks_mut(&mut dg, PER_TASK, n, |t, dg| {
                // SAFETY: piece `t` of `du`, as `dg`'s: disjoint from the
                // other items' and in bounds (`du` is as long as `dg`),
                // borrowed until every item is done.
                let du = unsafe { du_at.slice_mut(t * PER_TASK, dg.len()) };
                let [g, u, d] = [g, u, d].map(|xs| piece(xs, PER_TASK, t));
                self.kind.backward(self.isa, [g, u, d], dg, du)
            });
            Ok(())
        })?;
        Ok((grad_for(gate, dg)?, grad_for(up, du)?))
    }
}

#[cfg(test)]
mod tests {
    use candle::Result;

    use super::{gated, gated_pair, gelu_tanh_and_mul, silu_and_mul, Gate};
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

    /// Where gradients flow, the gated ops over two tensors
    /// (`silu_mul`, `gelu_tanh_mul`) and over one `[gate | up]`
    /// (`silu_and_mul`, `gelu_tanh_and_mul`) give candle's ops' outputs
    /// and gradients, on every ISA, in one of the pool's tasks and in
    /// several; an input that tracks nothing gets no gradient.
    #[test]
    fn gated_ops_train_as_candle_ops() -> Result<()> {
        use candle::{Tensor, Var, D};

        let grads_of = |y: &Tensor, w: &Tensor, xs: &[&Tensor]| -> Result<Vec<Option<Tensor>>> {
            let g = (y * w)?.sum_all()?.backward()?;
            Ok(xs.iter().map(|x| g.get(x).cloned()).collect())
        };
        type Act = fn(&Tensor) -> Result<Tensor>;
        let acts: [(Gate, Act); 2] = [(Gate::Silu, |g| g.silu()), (Gate::GeluTanh, |g| g.gelu())];
        for isa in supported() {
            for (kind, act) in acts {
                for shape in [[3, 7], [40, 1000]] {
                    let what = format!("{isa:?} {kind:?} {shape:?}");
                    let (g, u) = (
                        Var::from_tensor(&(randn(&shape)? * 3.)?)?,
                        Var::from_tensor(&randn(&shape)?)?,
                    );
                    let w = randn(&shape)?;
                    let (g, u) = (g.as_tensor(), u.as_tensor());
                    let ours = gated_pair(g, u, kind, isa)?;
                    let theirs = (act(g)? * u)?;
                    assert!(rel_err(&ours, &theirs)? < 1e-5, "{what}: pair output");
                    let (a, b) = (grads_of(&ours, &w, &[g, u])?, grads_of(&theirs, &w, &[g, u])?);
                    for ((a, b), name) in a.iter().zip(&b).zip(["gate", "up"]) {
                        let (Some(a), Some(b)) = (a, b) else {
                            candle::bail!("{what}: no gradient for {name}")
                        };
                        assert!(rel_err(a, b)? < 1e-5, "{what}: pair d{name}");
                    }
                    // Only the gate trains: the up half gets none.
                    let plain_up = u.detach();
                    let y = gated_pair(g, &plain_up, kind, isa)?;
                    assert!(grads_of(&y, &w, &[&plain_up])?[0].is_none(), "{what}");

                    let gu = Var::from_tensor(&Tensor::cat(&[g, u], D::Minus1)?)?;
                    let gu = gu.as_tensor();
                    let i = shape[1];
                    let ours = gated(gu, kind, isa)?;
                    let theirs = (act(&gu.narrow(D::Minus1, 0, i)?)? * gu.narrow(D::Minus1, i, i)?)?;
                    assert!(rel_err(&ours, &theirs)? < 1e-5, "{what}: joined output");
                    let (Some(a), Some(b)) = (
                        grads_of(&ours, &w, &[gu])?.remove(0),
                        grads_of(&theirs, &w, &[gu])?.remove(0),
                    ) else {
                        candle::bail!("{what}: no gradient for [gate | up]")
                    };
                    assert!(rel_err(&a, &b)? < 1e-5, "{what}: joined d[gate | up]");
                }
            }
        }
        Ok(())
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
