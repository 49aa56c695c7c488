//! The tiled CPU kernel equals the reference path: random inputs of many
//! shapes, every mask kind, grouped-query, half precision.

use anyhow::{Context, Result};
use candle::{DType, Device, IndexOp, Tensor};
use multihead_attention::{
    scaled_dot_product_attention_via, AttnMask, AttnPath, Causal, KeyPaddingMask, Mask, MhaConfig,
    MhaOptions, MultiheadAttention, NeedWeights,
};
use multihead_test_support::{compare::assert_close, errors::assert_err, random::randn, weights::plain_copy};

fn both(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: Option<f64>) -> Result<(Tensor, Tensor)> {
    Ok((
        scaled_dot_product_attention_via(q, k, v, mask, scale, AttnPath::CpuTiled)?,
        scaled_dot_product_attention_via(q, k, v, mask, scale, AttnPath::Reference)?,
    ))
}

#[test]
fn tiled_equals_reference_over_shapes() -> Result<()> {
    // (batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim); lengths
    // straddle the 64-row and 512-key tiles.
    let shapes = [
        (1, 1, 1, 1, 1, 8, 8),
        (2, 3, 3, 7, 13, 8, 8),
        (1, 4, 4, 1, 2048, 64, 64),
        (2, 2, 2, 65, 63, 16, 24),
        (1, 2, 2, 129, 1029, 32, 32),
        (1, 8, 2, 33, 600, 64, 64),
        (1, 4, 1, 5, 9, 128, 128),
        (1, 2, 2, 70, 70, 256, 256),
        (3, 2, 2, 3, 517, 40, 8),
    ];
    for (b, h, kh, l, s, d, dv) in shapes {
        let (q, k, v) = (
            randn(&[b, h, l, d])?,
            randn(&[b, kh, s, d])?,
            randn(&[b, kh, s, dv])?,
        );
        let lengths: Vec<usize> = (0..b).map(|i| s - (i * s / 3)).collect();
        let masks = [
            Mask::new(),
            Mask::causal(Causal::TopLeft),
            Mask::causal(Causal::BottomRight),
            Mask::causal(Causal::Offset(3)),
            Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&lengths, s, &Device::Cpu)?),
            Mask::causal(Causal::BottomRight)
                .with_attn(AttnMask::Additive(randn(&[l, s])?))
                .with_key_padding(KeyPaddingMask::from_lengths(&lengths, s, &Device::Cpu)?),
            Mask::new().with_attn(AttnMask::AttendWhereTrue(randn(&[b, 1, l, s])?.ge(-0.5)?)),
            Mask::new().with_attn(AttnMask::IgnoreWhereTrue(randn(&[b * h, l, s])?.ge(1.)?)),
        ];
        for (m, mask) in masks.iter().enumerate() {
            let what = format!("shape {:?} mask {m}", (b, h, kh, l, s, d, dv));
            let (tiled, reference) = both(&q, &k, &v, mask, None)?;
            assert_close(&what, &tiled, &reference, 1e-5)?;
        }
    }
    Ok(())
}

#[test]
fn tiled_handles_scale_strided_inputs_and_empty_rows() -> Result<()> {
    // (B, L, H, D) memory viewed as (B, H, L, D): read through strides.
    let q = randn(&[2, 9, 3, 16])?.transpose(1, 2)?;
    let k = randn(&[2, 11, 3, 16])?.transpose(1, 2)?;
    let v = randn(&[2, 11, 3, 16])?.transpose(1, 2)?;
    let (tiled, reference) = both(&q, &k, &v, &Mask::new(), Some(0.3))?;
    assert_close("strided, scale 0.3", &tiled, &reference, 1e-5)?;
    // Batch 1 has no valid key, and bottom-right hides every key from the
    // first rows of batch 0: zeros in both paths.
    let mask = Mask::causal(Causal::BottomRight).with_key_padding(KeyPaddingMask::from_lengths(
        &[11, 0],
        11,
        &Device::Cpu,
    )?);
    let q = randn(&[2, 3, 14, 16])?;
    let (tiled, reference) = both(&q, &k, &v, &mask, None)?;
    assert_close("empty rows", &tiled, &reference, 1e-5)?;
    assert_eq!(tiled.i(1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.);
    assert_eq!(tiled.i((0, .., 0..3))?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.);
    Ok(())
}

#[test]
fn tiled_half_precision_matches_reference() -> Result<()> {
    let (q, k, v) = (
        randn(&[1, 4, 37, 64])?,
        randn(&[1, 4, 530, 64])?,
        randn(&[1, 4, 530, 64])?,
    );
    for dtype in [DType::F16, DType::BF16] {
        let c = |t: &Tensor| t.to_dtype(dtype);
        let mask = Mask::causal(Causal::BottomRight);
        let (tiled, reference) = both(&c(&q)?, &c(&k)?, &c(&v)?, &mask, None)?;
        assert_eq!(tiled.dtype(), dtype);
        // Both accumulate in f32 and round once at the end.
        let tol = if dtype == DType::F16 { 2e-3 } else { 1e-2 };
        assert_close(&format!("{dtype:?}"), &tiled, &reference, tol)?;
    }
    Ok(())
}

#[test]
fn mha_fast_path_equals_reference_path() -> Result<()> {
    // Plain tensors, not a VarMap's variables: the kernel's forward alone,
    // without the op that ties it to its backward.
    let weights = [
        ("in_proj_weight", randn(&[192, 64])?),
        ("in_proj_bias", randn(&[192])?),
        ("out_proj.weight", randn(&[64, 64])?),
        ("out_proj.bias", randn(&[64])?),
    ];
    let weights = weights
        .into_iter()
        .map(|(n, t)| Ok((n.to_string(), (t * 0.2)?)))
        .collect::<Result<std::collections::HashMap<_, _>>>()?;
    let vb = candle_nn::VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    let mha = MultiheadAttention::new(&MhaConfig::new(64, 8), vb)?;
    let x = randn(&[2, 77, 64])?;
    let mem = randn(&[2, 31, 64])?;
    let padding = Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&[31, 20], 31, &Device::Cpu)?);
    for (q, kv, mask) in [(&x, &x, Mask::causal(Causal::TopLeft)), (&x, &mem, padding)] {
        let run = |path| {
            mha.forward_attn(
                q,
                kv,
                kv,
                &MhaOptions::new().with_mask(mask.clone()).with_path(path),
            )
        };
        let (fast, reference) = (run(AttnPath::CpuTiled)?, run(AttnPath::Reference)?);
        assert_close("mha", &fast.output, &reference.output, 1e-5)?;
    }
    // add_bias_kv and add_zero_attn append keys every query sees; the
    // tiled kernel takes them past the mask instead of a dense bias.
    let cfg = MhaConfig::new(64, 8).with_bias_kv(true).with_zero_attn(true);
    let varmap = candle_nn::VarMap::new();
    MultiheadAttention::new(
        &cfg,
        candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    // Plain copies of the initialised weights: variables would force the
    // reference path.
    let extra = MultiheadAttention::new(&cfg, plain_copy(&varmap)?)?;
    let masks = [
        Mask::causal(Causal::TopLeft),
        Mask::causal(Causal::TopLeft).with_key_padding(KeyPaddingMask::from_lengths(
            &[77, 40],
            77,
            &Device::Cpu,
        )?),
        Mask::new().with_attn(AttnMask::IgnoreWhereTrue(randn(&[77, 77])?.ge(0.5)?)),
    ];
    for (i, mask) in masks.into_iter().enumerate() {
        let run = |path| {
            extra.forward_attn(
                &x,
                &x,
                &x,
                &MhaOptions::new().with_mask(mask.clone()).with_path(path),
            )
        };
        let (fast, reference) = (run(AttnPath::CpuTiled)?, run(AttnPath::Reference)?);
        let what = format!("bias_kv + zero_attn, mask {i}");
        assert_close(&what, &fast.output, &reference.output, 1e-5)?;
    }
    // A path that cannot return weights is refused by name.
    let opts = MhaOptions::new()
        .with_weights(NeedWeights::Averaged)
        .with_path(AttnPath::CpuTiled);
    let err = mha
        .forward_attn(&x, &x, &x, &opts)
        .expect_err("weights need the reference path");
    assert!(err.to_string().contains("CpuTiled"), "{err}");
    Ok(())
}

/// Tracked f32 calls take the tiled kernel and its fused backward under
/// `Auto`, as forced; the gradients are those of the reference path
/// (`fused_backward.rs` checks them over shapes and masks).
#[test]
fn gradients_take_the_fused_backward() -> Result<()> {
    let q = candle::Var::from_tensor(&randn(&[1, 2, 5, 8])?)?;
    let (k, v) = (randn(&[1, 2, 6, 8])?, randn(&[1, 2, 6, 8])?);
    let mask = Mask::causal(Causal::BottomRight);
    let grad = |path| -> Result<Tensor> {
        let out = scaled_dot_product_attention_via(q.as_tensor(), &k, &v, &mask, None, path)?;
        let grads = out.sqr()?.sum_all()?.backward()?;
        Ok(grads.get(q.as_tensor()).context("no gradient reached q")?.clone())
    };
    let (auto, tiled, reference) = (
        grad(AttnPath::Auto)?,
        grad(AttnPath::CpuTiled)?,
        grad(AttnPath::Reference)?,
    );
    let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    assert_eq!(flat(&auto)?, flat(&tiled)?, "Auto took another path");
    assert_close("dq", &tiled, &reference, 1e-5)?;
    Ok(())
}

/// One poked value in a `(b, h, l, d)` tensor.
fn poked(t: &Tensor, at: [usize; 4], x: f32) -> Result<Tensor> {
    let (d0, d1, d2, d3) = t.dims4()?;
    let mut data = t.flatten_all()?.to_vec1::<f32>()?;
    data[((at[0] * d1 + at[1]) * d2 + at[2]) * d3 + at[3]] = x;
    Ok(Tensor::from_vec(data, (d0, d1, d2, d3), &Device::Cpu)?)
}

/// `(row, column)` of every NaN in a `(1, 1, l, dv)` output.
fn nan_positions(out: &Tensor) -> Result<Vec<(usize, usize)>> {
    let rows = out.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.iter()
                .enumerate()
                .filter(|(_, x)| x.is_nan())
                .map(move |(c, _)| (i, c))
        })
        .collect())
}

/// NaN propagates as PyTorch propagates it, the same on every path and at
/// decode and prefill lengths: a NaN query row or a NaN in a key some query
/// sees makes that query's row NaN (its scores are NaN, and so its
/// softmax); a NaN value reaches the one column of every query that sees
/// its key; a key hidden by the mask takes no part at all, NaN or not
/// (PyTorch's math path lets a hidden key's NaN through, its fused CPU
/// kernel does not for causally skipped blocks; ours never does).
#[test]
fn nan_propagates_the_same_on_every_path() -> Result<()> {
    let (q, k, v) = (
        randn(&[1, 1, 20, 8])?,
        randn(&[1, 1, 20, 8])?,
        randn(&[1, 1, 20, 8])?,
    );
    let causal = Mask::causal(Causal::TopLeft);
    let padded = Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&[15], 20, &Device::Cpu)?);
    let all_cols = |rows: std::ops::Range<usize>| -> Vec<(usize, usize)> {
        rows.flat_map(|i| (0..8).map(move |c| (i, c))).collect()
    };
    // (what, q, k, v, mask, expected NaN positions)
    let cases = [
        (
            "NaN query row 2",
            poked(&q, [0, 0, 2, 3], f32::NAN)?,
            k.clone(),
            v.clone(),
            Mask::new(),
            all_cols(2..3),
        ),
        (
            "NaN in key 5, causal",
            q.clone(),
            poked(&k, [0, 0, 5, 1], f32::NAN)?,
            v.clone(),
            causal.clone(),
            all_cols(5..20),
        ),
        (
            "NaN in key 5, no mask",
            q.clone(),
            poked(&k, [0, 0, 5, 1], f32::NAN)?,
            v.clone(),
            Mask::new(),
            all_cols(0..20),
        ),
        (
            "+inf score from key 6",
            q.clone(),
            poked(&k, [0, 0, 6, 0], f32::INFINITY)?,
            v.clone(),
            causal.clone(),
            {
                // q[i, 0] > 0 makes score (i, 6) +inf: NaN row; < 0 makes it
                // -inf: weight 0, a finite row.
                let q0 = q.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?;
                (6..20)
                    .filter(|&i| q0[i][0] > 0.)
                    .flat_map(|i| (0..8).map(move |c| (i, c)))
                    .collect()
            },
        ),
        (
            "NaN value (5, 2), causal",
            q.clone(),
            k.clone(),
            poked(&v, [0, 0, 5, 2], f32::NAN)?,
            causal.clone(),
            (5..20).map(|i| (i, 2)).collect(),
        ),
        (
            "NaN in padded key 17",
            q.clone(),
            poked(&k, [0, 0, 17, 0], f32::NAN)?,
            poked(&v, [0, 0, 17, 1], f32::NAN)?,
            padded,
            vec![],
        ),
    ];
    for (what, q, k, v, mask, expected) in cases {
        for l in [1, 20] {
            // q_len 1: the last query alone, a decode step (bottom-right).
            let (q, mask, expected) = if l == 1 {
                let mask = match mask.causal {
                    Some(_) => Mask::causal(Causal::BottomRight),
                    None => mask.clone(),
                };
                let last: Vec<_> = expected
                    .iter()
                    .filter(|p| p.0 == 19)
                    .map(|&(_, c)| (0, c))
                    .collect();
                (q.narrow(2, 19, 1)?, mask, last)
            } else {
                (q.clone(), mask.clone(), expected.clone())
            };
            for path in [AttnPath::Auto, AttnPath::CpuTiled, AttnPath::Reference] {
                let out = scaled_dot_product_attention_via(&q, &k, &v, &mask, None, path)?;
                assert_eq!(nan_positions(&out)?, expected, "{what}, q_len {l}, {path:?}");
                let finite = out
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .filter(|x| x.is_finite())
                    .count();
                assert_eq!(
                    finite + expected.len(),
                    out.elem_count(),
                    "{what}, q_len {l}, {path:?}: an infinity"
                );
            }
        }
    }
    Ok(())
}

/// A scale that is NaN, infinite, zero or negative is refused on every
/// path (a NaN scale would otherwise give all zeros).
#[test]
fn invalid_scale_is_an_error_everywhere() -> Result<()> {
    let (q, k, v) = (
        randn(&[1, 2, 4, 8])?,
        randn(&[1, 2, 5, 8])?,
        randn(&[1, 2, 5, 8])?,
    );
    for scale in [f64::NAN, f64::INFINITY, 0., -1.] {
        for path in [AttnPath::Auto, AttnPath::CpuTiled, AttnPath::Reference] {
            let res = scaled_dot_product_attention_via(&q, &k, &v, &Mask::new(), Some(scale), path);
            assert_err(res, &["scale", "finite and > 0"]);
        }
        let res = multihead_attention::scaled_dot_product_attention_with_weights(
            &q,
            &k,
            &v,
            &Mask::new(),
            Some(scale),
        );
        assert_err(res, &["scale"]);
    }
    Ok(())
}

/// `Auto` serves any valid input: a query whose last dim is strided (a
/// transposed view) is read through a copy, not refused.
#[test]
fn auto_serves_a_strided_last_dim() -> Result<()> {
    let q = randn(&[1, 2, 16, 9])?.transpose(2, 3)?;
    let k = randn(&[1, 2, 16, 11])?.transpose(2, 3)?;
    let v = randn(&[1, 2, 11, 16])?;
    assert_ne!(q.stride()[3], 1);
    for path in [AttnPath::Auto, AttnPath::CpuTiled] {
        let (fast, reference) = (
            scaled_dot_product_attention_via(&q, &k, &v, &Mask::new(), None, path)?,
            scaled_dot_product_attention_via(&q, &k, &v, &Mask::new(), None, AttnPath::Reference)?,
        );
        assert_close(&format!("{path:?}"), &fast, &reference, 1e-5)?;
    }
    Ok(())
}
