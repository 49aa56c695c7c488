//! Training through attention: every parameter of every attention module
//! and of the ViT (softmax and Hydra blocks) gets a non-zero gradient, and
//! dropout acts only in training.

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead::attention::{
    HydraAttention, HydraConfig, Mask, MhaConfig, MhaOptions, MultiheadAttention, SeparateNames, WeightLayout,
};
use multihead::models::vit::{VisionTransformer, VitConfig};

/// Backpropagates `loss` and checks that every variable of `varmap` has a
/// gradient with a non-zero entry, naming the first that has none.
fn assert_all_grads(what: &str, varmap: &VarMap, loss: &Tensor) -> Result<()> {
    let grads = loss.backward()?;
    let vars: Vec<(String, Var)> = {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned VarMap lock"))?;
        data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    if vars.is_empty() {
        bail!("{what}: no variables")
    }
    for (name, var) in vars {
        let g = grads
            .get(var.as_tensor())
            .with_context(|| format!("{what}: no gradient for '{name}'"))?;
        let max = g.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        if !(max > 0. && max.is_finite()) {
            bail!("{what}: gradient of '{name}' has max |g| = {max}")
        }
    }
    Ok(())
}

/// A loss that weighs every output element differently, so no symmetry
/// (such as a softmax's invariance to a shift) hides a gradient.
fn weighted_sum(out: &Tensor) -> Result<Tensor> {
    let w = Tensor::randn(0f32, 1., out.shape(), out.device())?;
    Ok((out * w)?.sum_all()?)
}

#[test]
fn every_attention_parameter_gets_a_gradient() -> Result<()> {
    let dev = Device::Cpu;
    let cases = [
        (
            "pytorch layout, bias_kv, zero_attn",
            MhaConfig::new(16, 4).with_bias_kv(true).with_zero_attn(true),
            WeightLayout::PyTorch,
        ),
        (
            "timm layout, qk_norm",
            MhaConfig::new(16, 4).with_qk_norm(true),
            WeightLayout::timm(),
        ),
        (
            "separate, kdim/vdim",
            MhaConfig::new(16, 2).with_kv_dims(6, 10),
            WeightLayout::Separate(SeparateNames::default()),
        ),
        (
            "pytorch layout, kdim/vdim",
            MhaConfig::new(16, 2).with_kv_dims(6, 10),
            WeightLayout::PyTorch,
        ),
    ];
    for (what, cfg, layout) in cases {
        let varmap = VarMap::new();
        let mha = MultiheadAttention::new_with_layout(
            &cfg,
            &layout,
            VarBuilder::from_varmap(&varmap, DType::F32, &dev),
        )?;
        let q = Tensor::randn(0f32, 1., (2, 5, 16), &dev)?;
        let k = Tensor::randn(0f32, 1., (2, 7, cfg.kdim()), &dev)?;
        let v = Tensor::randn(0f32, 1., (2, 7, cfg.vdim()), &dev)?;
        let out = if cfg.qkv_same_embed_dim() {
            mha.forward_attn(&q, &q, &q, &MhaOptions::new().with_train(true))?
        } else {
            mha.forward_attn(&q, &k, &v, &MhaOptions::new().with_train(true))?
        };
        assert_all_grads(what, &varmap, &weighted_sum(&out.output)?)?;
    }

    let varmap = VarMap::new();
    let hydra = HydraAttention::new(
        &HydraConfig::new(16),
        VarBuilder::from_varmap(&varmap, DType::F32, &dev),
    )?;
    let x = Tensor::randn(0f32, 1., (2, 9, 16), &dev)?;
    let out = hydra.forward_masked(&x, &Mask::causal(multihead::attention::Causal::TopLeft))?;
    assert_all_grads("hydra", &varmap, &weighted_sum(&out)?)?;
    Ok(())
}

#[test]
fn gradient_reaches_the_input_through_the_fast_path_dispatcher() -> Result<()> {
    // Long enough for the tiled kernel; a Var input makes Auto pick the
    // differentiable path.
    let dev = Device::Cpu;
    let mha = MultiheadAttention::new(
        &MhaConfig::new(32, 4),
        VarBuilder::from_varmap(&VarMap::new(), DType::F32, &dev),
    )?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., (1, 300, 32), &dev)?)?;
    let loss = weighted_sum(&mha.forward_t(x.as_tensor(), true)?)?;
    let grads = loss.backward()?;
    let g = grads.get(x.as_tensor()).context("no gradient for the input")?;
    assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.);
    Ok(())
}

#[test]
fn dropout_only_in_training() -> Result<()> {
    let dev = Device::Cpu;
    let mha = MultiheadAttention::new(
        &MhaConfig::new(16, 4).with_dropout(0.5),
        VarBuilder::from_varmap(&VarMap::new(), DType::F32, &dev),
    )?;
    let x = Tensor::randn(0f32, 1., (2, 6, 16), &dev)?;
    let eval_a: Vec<f32> = mha.forward_t(&x, false)?.flatten_all()?.to_vec1()?;
    let eval_b: Vec<f32> = mha.forward_t(&x, false)?.flatten_all()?.to_vec1()?;
    assert_eq!(eval_a, eval_b, "eval must be deterministic");
    let train: Vec<f32> = mha.forward_t(&x, true)?.flatten_all()?.to_vec1()?;
    assert_ne!(eval_a, train, "dropout 0.5 must change the training output");
    Ok(())
}

#[test]
fn every_vit_parameter_gets_a_gradient_with_softmax_and_hydra_blocks() -> Result<()> {
    let dev = Device::Cpu;
    let mut cfg = VitConfig::new(8, 4, 16, 3, 2);
    cfg.in_chans = 1;
    cfg.num_classes = 3;
    cfg.image_mean = vec![0.5];
    cfg.image_std = vec![0.5];
    cfg.init_values = Some(0.1);
    cfg.hydra_layers = vec![1, 2];
    let varmap = VarMap::new();
    let vit = VisionTransformer::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let images = Tensor::randn(0f32, 1., (4, 1, 8, 8), &dev)?;
    let labels = Tensor::new(&[0u32, 1, 2, 1], &dev)?;
    let logits = candle::Module::forward(&vit, &images)?;
    let loss = candle_nn::loss::cross_entropy(&logits, &labels)?;
    assert_all_grads("vit", &varmap, &loss)?;
    Ok(())
}
