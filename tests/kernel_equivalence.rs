//! The tiled CPU kernel equals the reference path: random inputs of many
//! shapes, every mask kind, grouped-query, half precision.

mod common;

use anyhow::Result;
use candle::{DType, Device, IndexOp, Tensor};
use common::assert_close;
use multihead::attention::{
    scaled_dot_product_attention_via, AttnMask, AttnPath, Causal, KeyPaddingMask, Mask, MhaConfig,
    MhaOptions, MultiheadAttention, NeedWeights,
};

fn randn(shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1., shape, &Device::Cpu)?)
}

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
    // Plain tensors, not a VarMap's variables: variables track gradients,
    // which sends every call to the reference path.
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

#[test]
fn gradients_take_the_reference_path() -> Result<()> {
    let q = candle::Var::from_tensor(&randn(&[1, 2, 5, 8])?)?;
    let (k, v) = (randn(&[1, 2, 6, 8])?, randn(&[1, 2, 6, 8])?);
    let mask = Mask::causal(Causal::BottomRight);
    let out = scaled_dot_product_attention_via(q.as_tensor(), &k, &v, &mask, None, AttnPath::Auto)?;
    let grads = out.sqr()?.sum_all()?.backward()?;
    assert!(grads.get(q.as_tensor()).is_some(), "no gradient reached q");
    let err = scaled_dot_product_attention_via(q.as_tensor(), &k, &v, &mask, None, AttnPath::CpuTiled)
        .expect_err("the tiled kernel is forward-only");
    assert!(err.to_string().contains("gradients"), "{err}");
    Ok(())
}
