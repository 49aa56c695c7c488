//! Bad input ends in an error that names the problem, never a panic.

use std::collections::HashMap;

use anyhow::Result;
use candle::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead_attention::{
    scaled_dot_product_attention, AttnMask, KeyPaddingMask, Mask, MhaConfig, MhaOptions, MultiheadAttention,
    WeightLayout,
};
use multihead_test_support::{errors::assert_err, random::randn};

const E: usize = 16;

fn mha(cfg: &MhaConfig) -> Result<MultiheadAttention> {
    let vb = VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu);
    Ok(MultiheadAttention::new(cfg, vb)?)
}

#[test]
fn config_values_are_checked_by_name() {
    let vb = || VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu);
    assert_err(
        MultiheadAttention::new(&MhaConfig::new(10, 3), vb()),
        &["embed_dim (10)", "num_heads (3)"],
    );
    assert_err(
        MultiheadAttention::new(&MhaConfig::new(16, 0), vb()),
        &["num_heads"],
    );
    assert_err(
        MultiheadAttention::new(&MhaConfig::new(16, 4).with_dropout(1.5), vb()),
        &["dropout", "1.5"],
    );
    assert_err(
        MultiheadAttention::new(&MhaConfig::new(16, 4).with_scale(-1.), vb()),
        &["scale"],
    );
    let cross = MhaConfig::new(16, 4).with_kv_dims(8, 8);
    assert_err(
        MultiheadAttention::new_with_layout(&cross, &WeightLayout::timm(), vb()),
        &["fused qkv", "kdim 8"],
    );
    let unknown: Result<MhaConfig, _> =
        serde_json::from_str(r#"{"embed_dim": 8, "num_heads": 2, "headz": 1}"#);
    assert!(unknown.is_err_and(|e| e.to_string().contains("headz")));
}

#[test]
fn wrong_ranks_and_sizes_are_named() -> Result<()> {
    let m = mha(&MhaConfig::new(E, 4))?;
    let o = MhaOptions::new();
    let (q, k) = (randn(&[2, 5, E])?, randn(&[2, 7, E])?);
    assert_err(
        m.forward_attn(&randn(&[2, 5, E, 1])?, &k, &k, &o),
        &["ranks 4, 3, 3"],
    );
    assert_err(m.forward_attn(&q, &randn(&[7, E])?, &k, &o), &["ranks 3, 2, 3"]);
    assert_err(
        m.forward_attn(&randn(&[2, 5, 12])?, &k, &k, &o),
        &["query has 12 features", "embed_dim 16"],
    );
    assert_err(
        m.forward_attn(&q, &randn(&[2, 7, 8])?, &k, &o),
        &["key has 8 features", "kdim 16"],
    );
    assert_err(
        m.forward_attn(&q, &k, &randn(&[2, 7, 9])?, &o),
        &["value has 9 features", "vdim 16"],
    );
    assert_err(
        m.forward_attn(&q, &randn(&[3, 7, E])?, &randn(&[3, 7, E])?, &o),
        &["batch sizes differ", "query 2, key 3"],
    );
    assert_err(
        m.forward_attn(&q, &k, &randn(&[2, 6, E])?, &o),
        &["key has 7 positions but value has 6"],
    );
    Ok(())
}

#[test]
fn masks_of_the_wrong_shape_or_dtype_are_named() -> Result<()> {
    let m = mha(&MhaConfig::new(E, 4))?;
    let (q, k) = (randn(&[2, 5, E])?, randn(&[2, 7, E])?);
    let dev = Device::Cpu;
    let with = |mask: Mask| MhaOptions::new().with_mask(mask);
    let kp = KeyPaddingMask::PadWhereTrue(Tensor::zeros((2, 6), DType::U8, &dev)?);
    assert_err(
        m.forward_attn(&q, &k, &k, &with(Mask::new().with_key_padding(kp))),
        &["key_padding_mask", "(2, 7)", "[2, 6]"],
    );
    let am = AttnMask::IgnoreWhereTrue(Tensor::zeros((5, 8), DType::U8, &dev)?);
    assert_err(
        m.forward_attn(&q, &k, &k, &with(Mask::new().with_attn(am))),
        &["attn_mask", "[5, 8]", "(5, 7)"],
    );
    let am = AttnMask::Additive(Tensor::zeros((3, 5, 7), DType::F32, &dev)?);
    assert_err(
        m.forward_attn(&q, &k, &k, &with(Mask::new().with_attn(am))),
        &["attn_mask", "[3, 5, 7]", "(8, 5, 7)"],
    );
    let am = AttnMask::Additive(Tensor::zeros((2, 3, 5, 7), DType::F32, &dev)?);
    assert_err(
        m.forward_attn(&q, &k, &k, &with(Mask::new().with_attn(am))),
        &["broadcastable to (2, 4, 5, 7)"],
    );
    // A float tensor given as a boolean mask is refused, not reinterpreted.
    let am = AttnMask::IgnoreWhereTrue(Tensor::zeros((5, 7), DType::F32, &dev)?);
    assert_err(
        m.forward_attn(&q, &k, &k, &with(Mask::new().with_attn(am))),
        &["IgnoreWhereTrue", "integer", "F32", "Additive"],
    );
    let kp = KeyPaddingMask::Additive(Tensor::zeros((2, 7), DType::U8, &dev)?);
    assert_err(
        m.forward_attn(&q, &k, &k, &with(Mask::new().with_key_padding(kp))),
        &["Additive", "float", "U8"],
    );
    assert_err(
        KeyPaddingMask::from_lengths(&[3, 9], 7, &dev),
        &["length 9 exceeds kv_len 7"],
    );
    Ok(())
}

#[test]
fn sdpa_shapes_are_checked() -> Result<()> {
    let m = Mask::new();
    let t = randn(&[2, 4, 5, 8])?;
    assert_err(
        scaled_dot_product_attention(&randn(&[4, 5, 8])?, &t, &t, &m, None),
        &["q must be 4-D", "[4, 5, 8]"],
    );
    assert_err(
        scaled_dot_product_attention(&t, &randn(&[2, 4, 5, 6])?, &t, &m, None),
        &["head_dim of k (6) differs from q (8)"],
    );
    assert_err(
        scaled_dot_product_attention(&t, &randn(&[2, 3, 5, 8])?, &randn(&[2, 3, 5, 8])?, &m, None),
        &["multiple of k/v heads (3)"],
    );
    assert_err(
        scaled_dot_product_attention(&t, &t, &randn(&[2, 4, 6, 8])?, &m, None),
        &["k has 5 keys but v has 6"],
    );
    assert_err(
        scaled_dot_product_attention(&t, &randn(&[1, 4, 5, 8])?, &randn(&[1, 4, 5, 8])?, &m, None),
        &["batch sizes differ"],
    );
    let half = t.to_dtype(DType::F16)?;
    assert_err(
        scaled_dot_product_attention(&t, &half, &t, &m, None),
        &["dtypes differ"],
    );
    Ok(())
}

#[test]
fn weight_files_with_missing_or_misshaped_tensors_are_named() -> Result<()> {
    let dev = Device::Cpu;
    let cfg = MhaConfig::new(E, 4);
    let good: HashMap<String, Tensor> = [
        ("in_proj_weight", randn(&[3 * E, E])?),
        ("in_proj_bias", randn(&[3 * E])?),
        ("out_proj.weight", randn(&[E, E])?),
        ("out_proj.bias", randn(&[E])?),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let load = |ts: HashMap<String, Tensor>, cfg: &MhaConfig| {
        MultiheadAttention::new(cfg, VarBuilder::from_tensors(ts, DType::F32, &dev))
    };
    assert!(load(good.clone(), &cfg).is_ok());
    let mut missing = good.clone();
    missing.remove("out_proj.weight");
    assert_err(load(missing, &cfg), &["out_proj.weight"]);
    let mut misshaped = good.clone();
    misshaped.insert("in_proj_weight".into(), randn(&[3 * E, E + 1])?);
    assert_err(load(misshaped, &cfg), &["in_proj_weight", "[48, 16]", "[48, 17]"]);
    // A checkpoint exported with add_bias_kv=False has no bias_k.
    assert_err(load(good.clone(), &cfg.clone().with_bias_kv(true)), &["bias_k"]);
    // kdim != embed_dim needs PyTorch's separate q/k/v weights.
    assert_err(load(good, &cfg.with_kv_dims(8, 8)), &["q_proj_weight"]);
    Ok(())
}

/// A module's sliding window and ALiBi are configured in its `MhaConfig`
/// only: a call's mask that sets either is refused on every entry point,
/// naming the config field, so that the two cannot disagree.
#[test]
fn window_and_alibi_come_from_the_config_only() -> Result<()> {
    use multihead_attention::{Alibi, Causal, KvCache};
    let m = mha(&MhaConfig::new(E, 4).with_sliding_window(3))?;
    let x = randn(&[1, 5, E])?;
    let masks = [
        (
            Mask::causal(Causal::TopLeft).with_window(2),
            "MhaConfig::sliding_window",
        ),
        (
            Mask::causal(Causal::TopLeft).with_alibi(Alibi::new(4)),
            "PositionEncoding::Alibi",
        ),
    ];
    for (mask, names) in masks {
        let opts = MhaOptions::new().with_mask(mask.clone());
        assert_err(m.forward_attn(&x, &x, &x, &opts), &[names]);
        let (k, v) = m.project_kv(&x, &x)?;
        assert_err(m.forward_projected(&x, &k, &v, &opts), &[names]);
        let cached = MhaOptions::new().with_mask(Mask { causal: None, ..mask });
        assert_err(m.forward_cached(&x, &mut KvCache::default(), &cached), &[names]);
    }
    // A call without a window or ALiBi of its own runs with the config's.
    m.forward_attn(
        &x,
        &x,
        &x,
        &MhaOptions::new().with_mask(Mask::causal(Causal::TopLeft)),
    )?;
    Ok(())
}
