//! Optimizers that update a variable where it lies: [`Sgd`] and [`AdamW`],
//! candle-nn's `SGD` and `AdamW` (the same [`Optimizer`] trait, the same
//! configuration, the same values bit for bit) with each step one pass
//! over a variable's weights, its gradient and its moments, in parallel,
//! as `torch.optim`'s `SGD` (`param.add_(grad, alpha=-lr)`) and `AdamW`
//! update theirs.
//!
//! candle-nn's step writes each result into a new tensor: an SGD step
//! takes three passes and two fresh buffers the size of every variable (an
//! AdamW step about a dozen), whose pages the allocator clears anew each
//! step. Here an f32 variable on the CPU is updated in its storage
//! (candle's in-place op), each element by the same f32 operations, in
//! the same order, as candle-nn's tensor expression; any other variable
//! is left to a candle-nn optimizer of the same configuration.

use std::sync::Mutex;

use candle::backprop::GradStore;
use candle::{bail, CpuStorage, DType, InplaceOp2, Layout, Result, Tensor, Var};

use crate::elem::{f32_data, f32_data_mut};
use crate::runtime::pool::{par_chunks_mut, piece, SyncPtr};
use candle_nn::{Optimizer, ParamsAdamW};

/// Elements a parallel task of a step updates.
const CHUNK: usize = 1 << 15;

/// Whether `t` is an f32 tensor on the CPU: updated in place.
fn in_place(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// `w ← w − lr · g`, as candle-nn's `var.sub(&(grad * lr))`: the product
/// plus zero (candle's affine), then the difference.
struct SgdStep {
    lr: f32,
}

impl InplaceOp2 for SgdStep {
    fn name(&self) -> &'static str {
        "sgd-step"
    }

    fn cpu_fwd(&self, w: &mut CpuStorage, lw: &Layout, g: &CpuStorage, lg: &Layout) -> Result<()> {
        let (w, g) = (f32_data_mut(w, lw, "Sgd")?, f32_data(g, lg, "Sgd")?);
        if w.len() != g.len() {
            bail!(
                "Sgd: a gradient of {} values for a variable of {}",
                g.len(),
                w.len()
            )
        }
        let lr = self.lr;
        let n = w.len();
        par_chunks_mut(w, CHUNK, n, |i, w| {
            for (w, &g) in w.iter_mut().zip(piece(g, CHUNK, i)) {
                *w -= g * lr + 0.;
            }
        });
        Ok(())
    }
}

/// Plain stochastic gradient descent, `w ← w − lr · ∇w`: candle-nn's
/// [`candle_nn::SGD`] (its configuration the learning rate), each f32 CPU
/// variable updated in one pass over it and its gradient.
#[derive(Debug)]
pub struct Sgd {
    /// The f32 CPU variables, updated in place.
    vars: Vec<Var>,
    /// The others', candle-nn's own.
    others: candle_nn::SGD,
    learning_rate: f64,
}

impl Optimizer for Sgd {
    type Config = f64;

    /// The float variables of `vars`, others left out (as candle-nn's).
    fn new(vars: Vec<Var>, learning_rate: f64) -> Result<Self> {
        let (vars, others) = vars.into_iter().partition(|v| in_place(v));
        Ok(Sgd {
            vars,
            others: candle_nn::SGD::new(others, learning_rate)?,
            learning_rate,
        })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let op = SgdStep {
            lr: self.learning_rate as f32,
        };
        for var in &self.vars {
            if let Some(g) = grads.get(var) {
                var.inplace_op2(&g.contiguous()?, &op)?;
            }
        }
        self.others.step(grads)
    }

    fn learning_rate(&self) -> f64 {
        self.learning_rate
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.learning_rate = lr;
        self.others.set_learning_rate(lr);
    }
}

impl Sgd {
    /// Its variables.
    pub fn into_inner(self) -> Vec<Var> {
        let mut vars = self.vars;
        vars.extend(self.others.into_inner());
        vars
    }

    /// Adds `var` to those it updates.
    pub fn push(&mut self, var: &Var) {
        match in_place(var) {
            true => self.vars.push(var.clone()),
            false => self.others.push(var),
        }
    }
}

/// One AdamW step's constants, each rounded to f32 as candle's affine ops
/// round theirs.
#[derive(Clone, Copy)]
struct AdamConsts {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    scale_m: f32,
    scale_v: f32,
    decay: f32,
    eps: f32,
    lr: f32,
}

impl AdamConsts {
    /// Element `theta` with gradient `g` and moments `m`, `v`, as
    /// candle-nn's `AdamW::step` computes them, op by op.
    #[inline(always)]
    fn update(self, theta: &mut f32, g: f32, m: &mut f32, v: &mut f32) {
        let next_m = (*m * self.beta1 + 0.) + (g * self.one_minus_beta1 + 0.);
        let next_v = (*v * self.beta2 + 0.) + ((g * g) * self.one_minus_beta2 + 0.);
        let m_hat = next_m * self.scale_m + 0.;
        let v_hat = next_v * self.scale_v + 0.;
        let decayed = *theta * self.decay + 0.;
        let adjusted = m_hat / (v_hat.sqrt() * 1. + self.eps);
        *theta = decayed - (adjusted * self.lr + 0.);
        *m = next_m;
        *v = next_v;
    }
}

/// An AdamW step of one variable, its moments held by the optimizer.
struct AdamStep<'a> {
    consts: AdamConsts,
    moments: Mutex<(&'a mut [f32], &'a mut [f32])>,
}

impl InplaceOp2 for AdamStep<'_> {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(&self, w: &mut CpuStorage, lw: &Layout, g: &CpuStorage, lg: &Layout) -> Result<()> {
        let (w, g) = (f32_data_mut(w, lw, "AdamW")?, f32_data(g, lg, "AdamW")?);
        let Ok(mut moments) = self.moments.lock() else {
            bail!("AdamW: a thread panicked while it held the moments")
        };
        let (m, v) = &mut *moments;
        if w.len() != g.len() || m.len() != w.len() || v.len() != w.len() {
            bail!(
                "AdamW: a gradient of {} values for a variable of {}",
                g.len(),
                w.len()
            )
        }
        let c = self.consts;
        let (n, m, v) = (w.len(), SyncPtr(m.as_mut_ptr()), SyncPtr(v.as_mut_ptr()));
        par_chunks_mut(w, CHUNK, n, |i, w| {
            // SAFETY: piece `i` of the moments, as `w`'s: disjoint from the
            // other items' and in bounds (each as long as `w`), borrowed
            // (the lock held) until every item is done.
            let [m, v] = [m, v].map(|at| unsafe { at.slice_mut(i * CHUNK, w.len()) });
            for (((w, &g), m), v) in w.iter_mut().zip(piece(g, CHUNK, i)).zip(m).zip(v) {
                c.update(w, g, m, v);
            }
        });
        Ok(())
    }
}

/// AdamW (Loshchilov and Hutter's decoupled weight decay): candle-nn's
/// [`candle_nn::AdamW`] with its [`ParamsAdamW`], each f32 CPU variable
/// updated in one pass over it, its gradient and its two moments.
#[derive(Debug)]
pub struct AdamW {
    /// The f32 CPU variables and their two moments, updated in place.
    vars: Vec<(Var, Vec<f32>, Vec<f32>)>,
    /// The others', candle-nn's own (which counts the same steps).
    others: candle_nn::AdamW,
    step_t: usize,
    params: ParamsAdamW,
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    /// The float variables of `vars`, others left out (as candle-nn's),
    /// with zero moments.
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        let (vars, others): (Vec<Var>, _) = vars.into_iter().partition(|v| in_place(v));
        let vars = vars
            .into_iter()
            .map(|v| {
                let n = v.elem_count();
                (v, vec![0.; n], vec![0.; n])
            })
            .collect();
        Ok(AdamW {
            vars,
            others: candle_nn::AdamW::new(others, params.clone())?,
            step_t: 0,
            params,
        })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_t += 1;
        let p = &self.params;
        let (lr, beta1, beta2) = (p.lr, p.beta1, p.beta2);
        let consts = AdamConsts {
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            scale_m: (1f64 / (1f64 - beta1.powi(self.step_t as i32))) as f32,
            scale_v: (1f64 / (1f64 - beta2.powi(self.step_t as i32))) as f32,
            decay: (1f64 - lr * p.weight_decay) as f32,
            eps: p.eps as f32,
            lr: lr as f32,
        };
        for (theta, m, v) in &mut self.vars {
            if let Some(g) = grads.get(theta) {
                let op = AdamStep {
                    consts,
                    moments: Mutex::new((m, v)),
                };
                theta.inplace_op2(&g.contiguous()?, &op)?;
            }
        }
        self.others.step(grads)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
        self.others.set_learning_rate(lr);
    }
}

impl AdamW {
    /// The default parameters but the learning rate.
    pub fn new_lr(vars: Vec<Var>, learning_rate: f64) -> Result<Self> {
        let params = ParamsAdamW {
            lr: learning_rate,
            ..ParamsAdamW::default()
        };
        Self::new(vars, params)
    }

    /// Its parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Replaces its parameters (the moments and the step count stay).
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.others.set_params(params.clone());
        self.params = params;
    }
}

#[cfg(test)]
mod tests {
    use candle::{DType, Device, Tensor, Var};
    use candle_nn::{Optimizer, ParamsAdamW};

    use super::{AdamW, Sgd};
    use crate::testing::randn;

    /// Variables of several shapes (one past a task's chunk, one with no
    /// gradient, one in f64 and one bf16, which candle-nn's optimizer
    /// steps), a loss over all of them.
    fn vars() -> candle::Result<Vec<Var>> {
        let vs = vec![
            Var::from_tensor(&randn(&[7, 5])?)?,
            Var::from_tensor(&randn(&[super::CHUNK + 3])?)?,
            Var::from_tensor(&randn(&[4])?)?,
            Var::from_tensor(&randn(&[3, 2])?.to_dtype(DType::F64)?)?,
            Var::from_tensor(&randn(&[6])?.to_dtype(DType::BF16)?)?,
        ];
        Ok(vs)
    }

    /// A step's loss: every variable but the third (which gets no
    /// gradient), squared and weighed.
    fn loss(vs: &[Var]) -> candle::Result<candle::backprop::GradStore> {
        let mut total = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        for (i, v) in vs.iter().enumerate().filter(|(i, _)| *i != 2) {
            let t = v.as_tensor().to_dtype(DType::F32)?;
            total = (total + ((&t * &t)? * (i as f64 + 0.5))?.sum_all()? + t.sin()?.sum_all()?)?;
        }
        total.backward()
    }

    /// The variables' values, bit for bit.
    fn bits(vs: &[Var]) -> candle::Result<Vec<Vec<u64>>> {
        vs.iter()
            .map(|v| {
                let t = v.as_tensor().flatten_all()?;
                Ok(match t.dtype() {
                    DType::F64 => t.to_vec1::<f64>()?.iter().map(|x| x.to_bits()).collect(),
                    DType::BF16 => t
                        .to_vec1::<half::bf16>()?
                        .iter()
                        .map(|x| u64::from(x.to_bits()))
                        .collect(),
                    _ => t
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|x| u64::from(x.to_bits()))
                        .collect(),
                })
            })
            .collect()
    }

    /// Two copies of the same variables, one stepped by `ours`, one by
    /// `theirs`, equal bit for bit after each of `steps` steps.
    fn steps_agree<A: Optimizer, B: Optimizer>(
        ours: impl Fn(Vec<Var>) -> candle::Result<A>,
        theirs: impl Fn(Vec<Var>) -> candle::Result<B>,
        steps: usize,
    ) -> candle::Result<()> {
        let a = vars()?;
        // Copies: `Var::from_tensor` of a variable shares its storage.
        let b: Vec<Var> = a
            .iter()
            .map(|v| Var::from_tensor(&v.as_tensor().copy()?))
            .collect::<candle::Result<_>>()?;
        let before = bits(&a)?;
        let (mut oa, mut ob) = (ours(a.clone())?, theirs(b.clone())?);
        for step in 0..steps {
            oa.step(&loss(&a)?)?;
            ob.step(&loss(&b)?)?;
            assert_eq!(bits(&a)?, bits(&b)?, "step {step}");
        }
        // The variable without a gradient never moved; the others did.
        let after = bits(&a)?;
        assert_eq!(after[2], before[2]);
        assert!((0..a.len()).filter(|&i| i != 2).all(|i| after[i] != before[i]));
        Ok(())
    }

    /// [`Sgd`] steps as candle-nn's `SGD`, bit for bit (fails where the
    /// update rounds otherwise, as a fused multiply-add does).
    #[test]
    fn sgd_steps_as_candle_nn_s() -> candle::Result<()> {
        steps_agree(|v| Sgd::new(v, 0.05), |v| candle_nn::SGD::new(v, 0.05), 4)
    }

    /// [`AdamW`] steps as candle-nn's `AdamW`, bit for bit, with its
    /// defaults and with other parameters, a learning rate changed between
    /// steps.
    #[test]
    fn adamw_steps_as_candle_nn_s() -> candle::Result<()> {
        let params = ParamsAdamW {
            lr: 0.02,
            beta1: 0.8,
            beta2: 0.95,
            eps: 1e-6,
            weight_decay: 0.1,
        };
        steps_agree(
            |v| AdamW::new_lr(v, 0.01),
            |v| candle_nn::AdamW::new_lr(v, 0.01),
            5,
        )?;
        steps_agree(
            |v| {
                let mut o = AdamW::new(v, params.clone())?;
                o.set_learning_rate(0.03);
                Ok(o)
            },
            |v| {
                let mut o = candle_nn::AdamW::new(v, params.clone())?;
                o.set_learning_rate(0.03);
                Ok(o)
            },
            5,
        )
    }
}
