//! Dropout on the CPU path, forward and fused backward, against the
//! reference path with the same mask applied to its weights
//! ([`Dropout::factors`]), on every instruction set the processor runs.

use candle::{Device, Result, Tensor, Var};

use multihead_kernels::attention::Dropout;
use multihead_kernels::isa::supported;
use multihead_test_support::compare::rel_err;
use multihead_test_support::random::randn;

use super::{repeat_kv, sdpa_dispatch, sdpa_reference, AttnPath};
use crate::mask::{Causal, KeyPaddingMask, Mask};

/// `(dropped weights) · v` on the reference path over variables q, k, v,
/// the weights multiplied by `factors`; the output and the gradients of
/// `sum(out · g)`.
fn reference(
    (q, k, v): (&Var, &Var, &Var),
    mask: &Mask,
    factors: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, [Tensor; 3])> {
    let (_, weights) = sdpa_reference(q, k, v, mask, 0, None, None)?;
    let out = (weights * factors)?.matmul(&repeat_kv(v, q.dim(1)?)?.contiguous()?)?;
    with_grads(out, (q, k, v), g)
}

/// `out` and the gradients of `sum(out · g)` with respect to q, k, v.
fn with_grads(out: Tensor, (q, k, v): (&Var, &Var, &Var), g: &Tensor) -> Result<(Tensor, [Tensor; 3])> {
    let store = (&out * g)?.sum_all()?.backward()?;
    let grad = |x: &Var| store.get(x).cloned().expect("a gradient");
    Ok((out, [grad(q), grad(k), grad(v)]))
}

/// The same through the CPU path with `dropout`, on `isa`.
fn fused(
    (q, k, v): (&Var, &Var, &Var),
    mask: &Mask,
    dropout: Dropout,
    isa: multihead_kernels::isa::Isa,
    g: &Tensor,
) -> Result<(Tensor, [Tensor; 3])> {
    let out = sdpa_dispatch(
        q,
        k,
        v,
        mask,
        0,
        None,
        AttnPath::CpuTiled,
        Some(isa),
        Some(dropout),
    )?;
    with_grads(out, (q, k, v), g)
}

/// The fused forward and backward with dropout equal the reference path
/// with the same mask: the packed tiles (`q_len` ≥ 16), the direct and
/// `gemm` products (decode-sized), lengths across the forward's key
/// blocks and the backward's tiles, both ways the backward splits its
/// work, grouped-query heads, with and without a mask; and the forward alone (no gradients tracked) equals the
/// tracked one.
#[test]
fn dropout_equals_the_reference_with_the_same_mask() -> Result<()> {
    let dev = Device::Cpu;
    for isa in supported() {
        // The backward's two passes, its one pass over (batch, kv-head)
        // units (8 of them), decode-sized, across the tiles and blocks.
        for (b, h, kh, l, s, d) in [
            (2, 4, 2, 37, 45, 16),
            (4, 4, 2, 20, 33, 8),
            (1, 2, 1, 3, 40, 8),
            (1, 2, 2, 140, 530, 32),
            // Decode-sized over 512 keys or more: a unit takes the query
            // heads of a kv-head together.
            (1, 4, 1, 2, 600, 8),
        ] {
            let masks = [
                ("none", Mask::new()),
                ("causal", Mask::causal(Causal::BottomRight)),
                (
                    "key padding",
                    Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&vec![s - 3; b], s, &dev)?),
                ),
            ];
            for (name, mask) in masks {
                let dropout = Dropout::new(0.3, 1234 + l as u64)?;
                let q = Var::from_tensor(&randn(&[b, h, l, d])?)?;
                let k = Var::from_tensor(&randn(&[b, kh, s, d])?)?;
                let v = Var::from_tensor(&randn(&[b, kh, s, d])?)?;
                let g = randn(&[b, h, l, d])?;
                let factors = dropout.factors((b, h, l, s), &dev)?;
                let what = format!("{isa:?} ({b}, {h}, {kh}, {l}, {s}, {d}) {name}");
                let (want, want_grads) = reference((&q, &k, &v), &mask, &factors, &g)?;
                let (got, got_grads) = fused((&q, &k, &v), &mask, dropout, isa, &g)?;
                let err = rel_err(&got, &want)?;
                assert!(err < 1e-5, "{what}: output off by {err:e}");
                for (x, (got, want)) in ["q", "k", "v"].iter().zip(got_grads.iter().zip(&want_grads)) {
                    let err = rel_err(got, want)?;
                    assert!(err < 1e-5, "{what}: d{x} off by {err:e}");
                }
                let untracked = sdpa_dispatch(
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    &mask,
                    0,
                    None,
                    AttnPath::CpuTiled,
                    Some(isa),
                    Some(dropout),
                )?;
                let err = rel_err(&untracked, &got)?;
                assert!(err < 1e-6, "{what}: untracked forward off by {err:e}");
            }
        }
    }
    Ok(())
}

/// Dropout drops: the output differs from the one without dropout, and
/// another seed gives another output.
#[test]
fn dropout_changes_the_output_by_seed() -> Result<()> {
    let (q, k, v) = (
        randn(&[1, 2, 20, 8])?,
        randn(&[1, 2, 24, 8])?,
        randn(&[1, 2, 24, 8])?,
    );
    let run =
        |d: Option<Dropout>| sdpa_dispatch(&q, &k, &v, &Mask::new(), 0, None, AttnPath::CpuTiled, None, d);
    let plain = run(None)?;
    let a = run(Some(Dropout::new(0.5, 1)?))?;
    let b = run(Some(Dropout::new(0.5, 2)?))?;
    assert!(rel_err(&a, &plain)? > 0.1 && rel_err(&a, &b)? > 0.1);
    assert_eq!(rel_err(&a, &run(Some(Dropout::new(0.5, 1)?))?)?, 0.);
    Ok(())
}
