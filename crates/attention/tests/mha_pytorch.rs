//! `MultiheadAttention` and `scaled_dot_product_attention` against PyTorch,
//! on the fixtures written by `scripts/make_mha_fixtures.py`.

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use multihead_attention::{
    scaled_dot_product_attention, AttnMask, Causal, KeyPaddingMask, Mask, MhaConfig, MhaOptions,
    MultiheadAttention, NeedWeights, SeqLayout,
};
use multihead_test_support::{
    compare::assert_close,
    fixtures::{fixture_dir, fixture_files, Fixture},
};

/// The bar: PyTorch within 1e-5 relative error in f32.
const RTOL: f64 = 1e-5;

fn causal_of(v: &serde_json::Value) -> Result<Option<Causal>> {
    Ok(match v {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) if s == "top_left" => Some(Causal::TopLeft),
        serde_json::Value::String(s) if s == "bottom_right" => Some(Causal::BottomRight),
        v => match v.get("offset").and_then(|o| o.as_u64()) {
            Some(o) => Some(Causal::Offset(o as usize)),
            None => bail!("unknown causal {v}"),
        },
    })
}

fn attn_mask_of(kind: Option<&str>, t: Option<&Tensor>) -> Result<Option<AttnMask>> {
    Ok(match (kind, t) {
        (None, _) => None,
        (Some(k), Some(t)) => Some(match k {
            "ignore_where_true" => AttnMask::IgnoreWhereTrue(t.clone()),
            "attend_where_true" => AttnMask::AttendWhereTrue(t.clone()),
            "additive" => AttnMask::Additive(t.clone()),
            k => bail!("unknown attn_mask kind {k}"),
        }),
        (Some(_), None) => bail!("attn_mask kind given without a tensor"),
    })
}

fn mask_of(fx: &Fixture) -> Result<Mask> {
    let mut mask = Mask::new();
    mask.causal = causal_of(&fx.case["causal"])?;
    mask.attn = attn_mask_of(fx.str("attn_mask"), fx.tensors.get("attn_mask"))?;
    mask.key_padding = match fx.str("key_padding") {
        None => None,
        Some("pad_where_true") => Some(KeyPaddingMask::PadWhereTrue(fx.get("key_padding_mask")?.clone())),
        Some("additive") => Some(KeyPaddingMask::Additive(fx.get("key_padding_mask")?.clone())),
        Some(k) => bail!("unknown key_padding kind {k}"),
    };
    Ok(mask)
}

fn run_mha(fx: &Fixture, dev: &Device) -> Result<()> {
    let cfg: MhaConfig = serde_json::from_value(fx.case["config"].clone())?;
    let vb = VarBuilder::from_tensors(fx.with_prefix("mha"), DType::F32, dev);
    let mha = MultiheadAttention::new(&cfg, vb)?;
    let query = fx.get("query")?;
    let (key, value) = if fx.case["self_attn"].as_bool() == Some(true) {
        (query, query)
    } else {
        (fx.get("key")?, fx.get("value")?)
    };
    let need_weights = match fx.str("need_weights") {
        Some("averaged") => NeedWeights::Averaged,
        Some("per_head") => NeedWeights::PerHead,
        _ => NeedWeights::No,
    };
    let layout = match fx.str("layout") {
        Some("seq_first") => SeqLayout::SeqFirst,
        _ => SeqLayout::BatchFirst,
    };
    let opts = MhaOptions::new()
        .with_mask(mask_of(fx)?)
        .with_weights(need_weights)
        .with_layout(layout);
    let out = mha.forward_attn(query, key, value, &opts)?;
    assert_close("output", &out.output, fx.get("output")?, RTOL)?;
    match (&out.weights, fx.tensors.get("weights")) {
        (Some(w), Some(expected)) => assert_close("weights", w, expected, RTOL)?,
        (None, None) => {}
        (w, e) => bail!("weights returned: {}, expected: {}", w.is_some(), e.is_some()),
    }
    Ok(())
}

fn run_sdpa(fx: &Fixture) -> Result<()> {
    let mut mask = Mask::new();
    mask.causal = causal_of(&fx.case["causal"])?;
    mask.attn = attn_mask_of(fx.str("attn_mask"), fx.tensors.get("attn_mask"))?;
    let scale = fx.case["scale"].as_f64();
    let out = scaled_dot_product_attention(fx.get("q")?, fx.get("k")?, fx.get("v")?, &mask, scale)?;
    assert_close("output", &out, fx.get("output")?, RTOL)
}

#[test]
fn matches_pytorch_on_every_fixture() -> Result<()> {
    let dev = Device::Cpu;
    let files = fixture_files(&fixture_dir("mha"))?;
    assert!(
        files.len() >= 25,
        "expected at least 25 fixtures, found {}",
        files.len()
    );
    let mut failures = vec![];
    for path in &files {
        let fx = Fixture::load(path, &dev)?;
        let res = match fx.str("kind") {
            Some("mha") => run_mha(&fx, &dev),
            Some("sdpa") => run_sdpa(&fx),
            k => Err(anyhow::anyhow!("unknown kind {k:?}")),
        };
        if let Err(e) = res.with_context(|| fx.name.clone()) {
            failures.push(format!("{e:#}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from PyTorch:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
    Ok(())
}
