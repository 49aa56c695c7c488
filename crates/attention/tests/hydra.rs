//! Hydra attention: against the paper's formula in PyTorch (committed
//! fixtures, `scripts/make_hydra_fixtures.py`) and against a direct O(N²)
//! evaluation of the same formula, written out below.

use anyhow::Result;
use candle::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use multihead_attention::{
    hydra_attention, AttnMask, Causal, HydraAttention, HydraConfig, KeyPaddingMask, Mask,
};
use multihead_test_support::{
    compare::assert_close,
    fixtures::{fixture_dir, fixture_files, Fixture},
};

#[test]
fn matches_pytorch_fixtures() -> Result<()> {
    let dev = Device::Cpu;
    let files = fixture_files(&fixture_dir("hydra"))?;
    assert!(files.len() >= 4, "expected the hydra fixtures, found {files:?}");
    for path in files {
        let fx = Fixture::load(&path, &dev)?;
        let e = fx.case["embed_dim"].as_u64().unwrap_or_default() as usize;
        let attn = HydraAttention::new(
            &HydraConfig::new(e),
            VarBuilder::from_tensors(fx.with_prefix("attn"), DType::F32, &dev),
        )?;
        let mut mask = Mask::new();
        if fx.case["causal"].as_bool() == Some(true) {
            mask = mask.with_causal(Causal::TopLeft);
        }
        if let Ok(kp) = fx.get("key_padding") {
            mask = mask.with_key_padding(KeyPaddingMask::PadWhereTrue(kp.clone()));
        }
        let out = attn.forward_masked(fx.get("x")?, &mask)?;
        assert_close(&fx.name, &out, fx.get("out")?, 1e-5)?;
    }
    Ok(())
}

/// `x / ‖x‖` of one row.
fn unit(x: &[f32]) -> Vec<f32> {
    let n = x.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
    x.iter().map(|v| v / n).collect()
}

/// `out[b, i] = φ(q[b, i]) ⊙ Σ_{j allowed} φ(k[b, j]) ⊙ v[b, j]`, one
/// (query, key) pair at a time: O(L·S·D).
fn direct(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: Option<Causal>,
    lengths: Option<&[usize]>,
) -> Result<Tensor> {
    let (b, l, d) = q.dims3()?;
    let s = k.dim(1)?;
    let q: Vec<Vec<Vec<f32>>> = q.to_vec3()?;
    let k: Vec<Vec<Vec<f32>>> = k.to_vec3()?;
    let v: Vec<Vec<Vec<f32>>> = v.to_vec3()?;
    let mut out = vec![0f32; b * l * d];
    for bi in 0..b {
        for i in 0..l {
            let qi = unit(&q[bi][i]);
            for j in 0..s {
                let padded = lengths.is_some_and(|ls| j >= ls[bi]);
                let hidden = causal.is_some_and(|c| !c.allows(i, j, l, s));
                if padded || hidden {
                    continue;
                }
                let kj = unit(&k[bi][j]);
                for f in 0..d {
                    out[(bi * l + i) * d + f] += qi[f] * kj[f] * v[bi][j][f];
                }
            }
        }
    }
    Ok(Tensor::from_vec(out, (b, l, d), &Device::Cpu)?)
}

#[test]
fn equals_the_direct_quadratic_evaluation() -> Result<()> {
    let dev = Device::Cpu;
    let causals = [
        None,
        Some(Causal::TopLeft),
        Some(Causal::BottomRight),
        Some(Causal::Offset(3)),
    ];
    // Lengths around the running sum's block of 64, and q_len != kv_len.
    for (case, &(b, l, s, d)) in [
        (1, 1, 1, 1),
        (2, 5, 9, 3),
        (2, 9, 5, 8),
        (1, 64, 64, 4),
        (2, 70, 130, 6),
    ]
    .iter()
    .enumerate()
    {
        let q = Tensor::randn(0f32, 1., (b, l, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (b, s, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (b, s, d), &dev)?;
        let lengths: Vec<usize> = (0..b).map(|i| s - (i * 7 + case) % s).collect();
        for causal in causals {
            for pad in [false, true] {
                let mut mask = Mask::new();
                if let Some(c) = causal {
                    mask = mask.with_causal(c);
                }
                if pad {
                    mask = mask.with_key_padding(KeyPaddingMask::from_lengths(&lengths, s, &dev)?);
                }
                let got = hydra_attention(&q, &k, &v, &mask)?;
                let want = direct(&q, &k, &v, causal, pad.then_some(&lengths[..]))?;
                let what = format!("b{b} l{l} s{s} d{d} {causal:?} pad={pad}");
                assert_close(&what, &got, &want, 1e-5)?;
            }
        }
    }
    Ok(())
}

#[test]
fn causal_output_ignores_future_tokens_and_padding_ignores_padded_keys() -> Result<()> {
    let dev = Device::Cpu;
    let attn = HydraAttention::new(
        &HydraConfig::new(8),
        VarBuilder::from_varmap(&candle_nn::VarMap::new(), DType::F32, &dev),
    )?;
    let x = Tensor::randn(0f32, 1., (1, 12, 8), &dev)?;
    let changed = Tensor::cat(
        &[&x.narrow(1, 0, 6)?, &Tensor::randn(0f32, 1., (1, 6, 8), &dev)?],
        1,
    )?;
    let causal = Mask::causal(Causal::TopLeft);
    let a = attn.forward_masked(&x, &causal)?.narrow(1, 0, 6)?;
    let b = attn.forward_masked(&changed, &causal)?.narrow(1, 0, 6)?;
    assert_close("causal prefix", &a, &b, 1e-6)?;
    // The last 6 keys padded: the first 6 outputs are those of the first 6
    // tokens alone.
    let pad = Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&[6], 12, &dev)?);
    let padded = attn.forward_masked(&changed, &pad)?.narrow(1, 0, 6)?;
    let alone = attn.forward(&x.narrow(1, 0, 6)?)?;
    assert_close("padded keys", &padded, &alone, 1e-6)?;
    Ok(())
}

#[test]
fn errors_name_the_cause() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 4, 8), DType::F32, &dev)?;
    let pair = Tensor::zeros((4, 4), DType::U8, &dev)?;
    let err = hydra_attention(
        &q,
        &q,
        &q,
        &Mask::new().with_attn(AttnMask::IgnoreWhereTrue(pair)),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(err.contains("attn mask"), "{err}");
    let half = Tensor::new(&[[0f32, 0.5, 0., f32::NEG_INFINITY]], &dev)?;
    let err = hydra_attention(
        &q,
        &q,
        &q,
        &Mask::new().with_key_padding(KeyPaddingMask::Additive(half)),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(err.contains("only 0 and -inf"), "{err}");
    let k = Tensor::zeros((1, 4, 7), DType::F32, &dev)?;
    let err = hydra_attention(&q, &k, &k, &Mask::new())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("(batch, kv_len, dim)"), "{err}");
    // A zero query or key gives zeros, not NaN.
    let out = hydra_attention(&q, &q, &q, &Mask::new())?;
    assert_eq!(out.abs()?.sum_all()?.to_scalar::<f32>()?, 0.);
    Ok(())
}

#[test]
fn half_precision_is_computed_in_f32() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (2, 20, 16), &dev)?;
    let want = hydra_attention(&q, &q, &q, &Mask::causal(Causal::TopLeft))?;
    for dt in [DType::F16, DType::BF16] {
        let h = q.to_dtype(dt)?;
        let got = hydra_attention(&h, &h, &h, &Mask::causal(Causal::TopLeft))?;
        assert_eq!(got.dtype(), dt);
        assert_close(&format!("{dt:?}"), &got, &want, 2e-2)?;
    }
    Ok(())
}
