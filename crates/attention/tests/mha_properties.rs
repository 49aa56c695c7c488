//! Properties of `MultiheadAttention` and `scaled_dot_product_attention`
//! that hold for any weights: masking, causality, the equivalence of the
//! weight layouts and of the fused and unfused paths, cached decoding.

use std::collections::HashMap;

use anyhow::Result;
use candle::{DType, Device, IndexOp, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use multihead_attention::{
    scaled_dot_product_attention, scaled_dot_product_attention_with_weights, set_dropout_seed, Causal,
    KeyPaddingMask, Mask, MhaConfig, MhaOptions, MultiheadAttention, SeparateNames, WeightLayout,
};
use multihead_test_support::{
    compare::{assert_close, max_abs_diff},
    random::randn,
    weights::plain_copy,
};

const E: usize = 16;
const H: usize = 4;

/// A randomly initialised module and the tensors behind it.
fn random_mha(cfg: &MhaConfig) -> Result<(MultiheadAttention, VarMap)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mha = MultiheadAttention::new(cfg, vb)?;
    // PyTorch initialises the biases to zero; make them count.
    for var in varmap.all_vars() {
        var.set(&(var.as_tensor() + Tensor::randn(0f32, 0.3, var.shape(), &Device::Cpu)?)?)?;
    }
    Ok((mha, varmap))
}

#[test]
fn padded_keys_never_change_other_outputs() -> Result<()> {
    let (mha, _) = random_mha(&MhaConfig::new(E, H))?;
    let (q, k, v) = (randn(&[2, 5, E])?, randn(&[2, 7, E])?, randn(&[2, 7, E])?);
    let mask = Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&[4, 7], 7, &Device::Cpu)?);
    let opts = MhaOptions::new().with_mask(mask);
    let out = mha.forward_attn(&q, &k, &v, &opts)?.output;
    // Other values in the padded positions of batch 0 change nothing.
    let noise = Tensor::cat(
        &[
            &Tensor::zeros((1, 4, E), DType::F32, &Device::Cpu)?,
            &randn(&[1, 3, E])?,
        ],
        1,
    )?;
    let noise = Tensor::cat(&[&noise, &Tensor::zeros((1, 7, E), DType::F32, &Device::Cpu)?], 0)?;
    let out2 = mha
        .forward_attn(&q, &(&k + &noise)?, &(&v + &noise)?, &opts)?
        .output;
    assert_eq!(max_abs_diff(&out, &out2)?, 0.);
    // And batch 0 equals the same problem with the padding cut off.
    let cut = mha.forward_attn(
        &q.i(0..1)?,
        &k.i((0..1, 0..4))?,
        &v.i((0..1, 0..4))?,
        &MhaOptions::new(),
    )?;
    assert_close("padded vs truncated", &out.i(0..1)?, &cut.output, 1e-6)?;
    Ok(())
}

#[test]
fn causal_output_never_depends_on_later_tokens() -> Result<()> {
    let (mha, _) = random_mha(&MhaConfig::new(E, H))?;
    let x = randn(&[2, 6, E])?;
    let opts = MhaOptions::new().with_mask(Mask::causal(Causal::TopLeft));
    let out = mha.forward_attn(&x, &x, &x, &opts)?.output;
    for t in 0..5 {
        let later = Tensor::cat(&[&x.i((.., ..=t))?, &randn(&[2, 5 - t, E])?], 1)?;
        let out2 = mha.forward_attn(&later, &later, &later, &opts)?.output;
        assert_eq!(
            max_abs_diff(&out.i((.., ..=t))?, &out2.i((.., ..=t))?)?,
            0.,
            "token {t}"
        );
        // The test would notice a leak: the last position does change.
        assert!(max_abs_diff(&out.i((.., 5))?, &out2.i((.., 5))?)? > 1e-4);
    }
    Ok(())
}

#[test]
fn self_attention_paths_agree() -> Result<()> {
    let (mha, _) = random_mha(&MhaConfig::new(E, H))?;
    let x = randn(&[3, 5, E])?;
    let module = mha.forward(&x)?;
    let general = mha.forward_attn(&x, &x, &x, &MhaOptions::new())?.output;
    // Distinct tensors with the same values take the unfused projection.
    let unfused = mha
        .forward_attn(&x, &x.copy()?, &x.copy()?, &MhaOptions::new())?
        .output;
    assert_eq!(max_abs_diff(&module, &general)?, 0.);
    assert_close("fused vs unfused", &general, &unfused, 1e-6)?;
    Ok(())
}

#[test]
fn the_three_weight_layouts_agree() -> Result<()> {
    let (mha, varmap) = random_mha(&MhaConfig::new(E, H))?;
    let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
    let get = |n: &str| data[n].as_tensor().clone();
    let (w, b) = (get("in_proj_weight"), get("in_proj_bias"));
    let (ow, ob) = (get("out_proj.weight"), get("out_proj.bias"));
    let part = |t: &Tensor, i: usize| t.narrow(0, i * E, E);

    let timm: HashMap<String, Tensor> = [
        ("blk.qkv.weight", w.clone()),
        ("blk.qkv.bias", b.clone()),
        ("blk.proj.weight", ow.clone()),
        ("blk.proj.bias", ob.clone()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut hf = HashMap::new();
    for (i, n) in ["query", "key", "value"].iter().enumerate() {
        hf.insert(format!("attention.attention.{n}.weight"), part(&w, i)?);
        hf.insert(format!("attention.attention.{n}.bias"), part(&b, i)?);
    }
    hf.insert("attention.output.dense.weight".into(), ow.clone());
    hf.insert("attention.output.dense.bias".into(), ob.clone());

    let cfg = MhaConfig::new(E, H);
    let dev = Device::Cpu;
    let timm = MultiheadAttention::new_with_layout(
        &cfg,
        &WeightLayout::timm(),
        VarBuilder::from_tensors(timm, DType::F32, &dev).pp("blk"),
    )?;
    let hf = MultiheadAttention::new_with_layout(
        &cfg,
        &WeightLayout::Separate(SeparateNames::hf_vit()),
        VarBuilder::from_tensors(hf, DType::F32, &dev).pp("attention"),
    )?;
    let x = randn(&[2, 5, E])?;
    let reference = mha.forward(&x)?;
    assert_eq!(max_abs_diff(&reference, &timm.forward(&x)?)?, 0.);
    assert_close("HF layout", &hf.forward(&x)?, &reference, 1e-6)?;
    Ok(())
}

#[test]
fn fully_masked_rows_give_zeros_not_nan() -> Result<()> {
    let (q, k, v) = (
        randn(&[2, 2, 3, 8])?,
        randn(&[2, 2, 4, 8])?,
        randn(&[2, 2, 4, 8])?,
    );
    // Batch 1 has no valid key at all.
    let mask = Mask::new().with_key_padding(KeyPaddingMask::from_lengths(&[4, 0], 4, &Device::Cpu)?);
    let (out, w) = scaled_dot_product_attention_with_weights(&q, &k, &v, &mask, None)?;
    assert_eq!(out.i(1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.);
    assert_eq!(w.i(1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.);
    // Batch 0 is untouched: its weights sum to one.
    let sums = w.i(0)?.sum(D::Minus1)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(sums.iter().all(|s| (s - 1.).abs() < 1e-6), "{sums:?}");
    // Bottom-right causal with more queries than keys: the first queries see nothing.
    let (k1, v1) = (k.i((0..1, 0..1, 0..1))?, v.i((0..1, 0..1, 0..1))?);
    let out = scaled_dot_product_attention(
        &randn(&[1, 1, 5, 8])?,
        &k1,
        &v1,
        &Mask::causal(Causal::BottomRight),
        None,
    )?;
    let rows = out.i((0, 0))?.abs()?.sum(D::Minus1)?.to_vec1::<f32>()?;
    assert_eq!(&rows[..4], &[0.; 4]);
    assert!(rows[4] > 0.);
    Ok(())
}

#[test]
fn half_precision_matches_f32_and_stays_finite() -> Result<()> {
    let (q, k, v) = (
        randn(&[2, 4, 6, 16])?,
        randn(&[2, 4, 9, 16])?,
        randn(&[2, 4, 9, 16])?,
    );
    let mask = Mask::causal(Causal::BottomRight);
    let reference = scaled_dot_product_attention(&q, &k, &v, &mask, None)?;
    for dtype in [DType::F16, DType::BF16] {
        let cast = |t: &Tensor| t.to_dtype(dtype);
        let out = scaled_dot_product_attention(&cast(&q)?, &cast(&k)?, &cast(&v)?, &mask, None)?;
        assert_eq!(out.dtype(), dtype);
        let tol = if dtype == DType::F16 { 5e-3 } else { 3e-2 };
        assert_close(&format!("{dtype:?} vs f32"), &out, &reference, tol)?;
        // Logits near ±1e4 overflow f16 products and exps unless the
        // scores are computed and softmaxed in f32.
        let big = (cast(&q)? * 100.)?;
        let out = scaled_dot_product_attention(&big, &(cast(&k)? * 100.)?, &cast(&v)?, &mask, None)?;
        let finite = out
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|x| x.is_finite());
        assert!(finite, "{dtype:?} output has non-finite values");
    }
    Ok(())
}

#[test]
fn grouped_query_attention_equals_repeated_heads() -> Result<()> {
    let (q, k, v) = (
        randn(&[2, 6, 5, 8])?,
        randn(&[2, 2, 7, 8])?,
        randn(&[2, 2, 7, 8])?,
    );
    let mask = Mask::causal(Causal::BottomRight);
    let gqa = scaled_dot_product_attention(&q, &k, &v, &mask, None)?;
    // Head h of q reads kv head h / 3.
    let rep = |t: &Tensor| -> Result<Tensor> {
        let heads: Vec<Tensor> = (0..6)
            .map(|h| t.i((.., h / 3..h / 3 + 1)))
            .collect::<candle::Result<_>>()?;
        Ok(Tensor::cat(&heads, 1)?)
    };
    let mha = scaled_dot_product_attention(&q, &rep(&k)?, &rep(&v)?, &mask, None)?;
    assert_eq!(max_abs_diff(&gqa, &mha)?, 0.);
    Ok(())
}

#[test]
fn cached_decoding_equals_the_full_causal_pass() -> Result<()> {
    let (mha, _) = random_mha(&MhaConfig::new(E, H))?;
    let x = randn(&[2, 6, E])?;
    let full = mha
        .forward_attn(
            &x,
            &x,
            &x,
            &MhaOptions::new().with_mask(Mask::causal(Causal::TopLeft)),
        )?
        .output;
    let (mut k_cache, mut v_cache): (Option<Tensor>, Option<Tensor>) = (None, None);
    for t in 0..6 {
        let xt = x.i((.., t..t + 1))?;
        let (k, v) = mha.project_kv(&xt, &xt)?;
        let k = match k_cache.take() {
            Some(c) => Tensor::cat(&[&c, &k], 2)?,
            None => k,
        };
        let v = match v_cache.take() {
            Some(c) => Tensor::cat(&[&c, &v], 2)?,
            None => v,
        };
        let opts = MhaOptions::new().with_mask(Mask::causal(Causal::BottomRight));
        let step = mha.forward_projected(&xt, &k, &v, &opts)?;
        assert_close(&format!("step {t}"), &step.output, &full.i((.., t..t + 1))?, 1e-6)?;
        (k_cache, v_cache) = (Some(k), Some(v));
    }
    Ok(())
}

#[test]
fn dropout_applies_in_training_only() -> Result<()> {
    let (mha, _) = random_mha(&MhaConfig::new(E, H).with_dropout(0.5))?;
    let x = randn(&[2, 5, E])?;
    let eval = mha.forward(&x)?;
    assert_eq!(max_abs_diff(&eval, &mha.forward_t(&x, false)?)?, 0.);
    assert!(max_abs_diff(&eval, &mha.forward_t(&x, true)?)? > 1e-3);
    // The CPU path's masks come from the seed stream: restarted, the same
    // calls drop the same weights; the next call draws another mask.
    set_dropout_seed(5);
    let first = mha.forward_t(&x, true)?;
    set_dropout_seed(5);
    assert_eq!(max_abs_diff(&first, &mha.forward_t(&x, true)?)?, 0.);
    assert!(max_abs_diff(&first, &mha.forward_t(&x, true)?)? > 1e-3);
    let (no_drop, _) = random_mha(&MhaConfig::new(E, H))?;
    assert_eq!(
        max_abs_diff(&no_drop.forward(&x)?, &no_drop.forward_t(&x, true)?)?,
        0.
    );
    Ok(())
}

#[test]
fn initialisation_follows_pytorch() -> Result<()> {
    let varmap = VarMap::new();
    MultiheadAttention::new(
        &MhaConfig::new(64, 4),
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
    // xavier_uniform_ on (192, 64): U(-b, b) with b = sqrt(6 / 256).
    let w = data["in_proj_weight"]
        .as_tensor()
        .flatten_all()?
        .to_vec1::<f32>()?;
    let bound = (6f32 / 256.).sqrt();
    assert!(w.iter().all(|x| x.abs() <= bound));
    assert!(w.iter().any(|x| x.abs() > 0.9 * bound));
    assert_eq!(
        data["in_proj_bias"]
            .as_tensor()
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?,
        0.
    );
    assert_eq!(
        data["out_proj.bias"]
            .as_tensor()
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?,
        0.
    );
    Ok(())
}

/// A residual passed in the options is added to the output, on the packed
/// output projection (plain tensors) and on candle's (variables), in every
/// input layout and through the cache; one of another shape is an error
/// that names it.
#[test]
fn residual_option_adds_to_the_output_in_every_layout() -> Result<()> {
    use multihead_attention::{KvCache, SeqLayout};
    let (mha_vars, varmap) = random_mha(&MhaConfig::new(64, H))?;
    let mha_plain = MultiheadAttention::new(&MhaConfig::new(64, H), plain_copy(&varmap)?)?;
    for mha in [&mha_plain, &mha_vars] {
        for (shape, layout) in [
            (&[2, 5, 64][..], SeqLayout::BatchFirst),
            (&[5, 2, 64][..], SeqLayout::SeqFirst),
            (&[5, 64][..], SeqLayout::BatchFirst),
        ] {
            let (x, r) = (randn(shape)?, randn(shape)?);
            let opts = MhaOptions::new().with_layout(layout);
            let expected = (mha.forward_attn(&x, &x, &x, &opts)?.output + &r)?;
            let ours = mha
                .forward_attn(&x, &x, &x, &opts.clone().with_residual(r.clone()))?
                .output;
            assert_close(&format!("{layout:?} {shape:?}"), &ours, &expected, 1e-5)?;
        }
        let (x, r) = (randn(&[2, 5, 64])?, randn(&[2, 5, 64])?);
        let expected = (mha
            .forward_cached(&x, &mut KvCache::new(4), &MhaOptions::new())?
            .output
            + &r)?;
        let ours = mha
            .forward_cached(&x, &mut KvCache::new(4), &MhaOptions::new().with_residual(r))?
            .output;
        assert_close("forward_cached", &ours, &expected, 1e-5)?;
        let err = mha
            .forward_attn(&x, &x, &x, &MhaOptions::new().with_residual(randn(&[2, 4, 64])?))
            .unwrap_err()
            .to_string();
        assert!(err.contains("residual"), "{err}");
    }
    Ok(())
}
