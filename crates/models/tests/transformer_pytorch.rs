//! The transformer encoder–decoder against PyTorch's `nn.Transformer`, on
//! the fixtures written by `scripts/make_transformer_fixtures.py`.

use anyhow::{bail, Context, Result};
use candle::{DType, Device};
use candle_nn::VarBuilder;
use multihead_attention::{AttnMask, Causal, KeyPaddingMask, Mask};
use multihead_models::transformer::{Transformer, TransformerConfig, TransformerMasks};
use multihead_test_support::{
    compare::assert_close,
    fixtures::{fixture_dir, fixture_files, Fixture},
};

/// The bar: PyTorch within 1e-5 relative error in f32.
const RTOL: f64 = 1e-5;

/// The mask of one part ("src", "tgt", "memory") as the case describes it.
fn mask_of(fx: &Fixture, part: &str) -> Result<Mask> {
    let desc = &fx.case["masks"][part];
    let mut mask = Mask::new();
    match desc["causal"].as_str() {
        None => {
            mask.attn = match desc["attn"].as_str() {
                None => None,
                Some("ignore_where_true") => Some(AttnMask::IgnoreWhereTrue(
                    fx.get(&format!("{part}_mask"))?.clone(),
                )),
                Some("additive") => Some(AttnMask::Additive(fx.get(&format!("{part}_mask"))?.clone())),
                Some(k) => bail!("unknown attn kind {k}"),
            }
        }
        // PyTorch got the explicit causal mask and the `is_causal` hint; we
        // state the rule instead of passing the tensor.
        Some("top_left") => mask.causal = Some(Causal::TopLeft),
        Some(k) => bail!("unknown causal {k}"),
    }
    mask.key_padding = match desc["key_padding"].as_str() {
        None => None,
        Some("pad_where_true") => Some(KeyPaddingMask::PadWhereTrue(
            fx.get(&format!("{part}_key_padding_mask"))?.clone(),
        )),
        Some("additive") => Some(KeyPaddingMask::Additive(
            fx.get(&format!("{part}_key_padding_mask"))?.clone(),
        )),
        Some(k) => bail!("unknown key_padding kind {k}"),
    };
    Ok(mask)
}

fn run_case(fx: &Fixture, dev: &Device) -> Result<()> {
    let cfg: TransformerConfig = serde_json::from_value(fx.case["config"].clone())?;
    let vb = VarBuilder::from_tensors(fx.tensors.clone(), DType::F32, dev);
    let model = Transformer::new(&cfg, vb.pp("model"))?;
    let masks = TransformerMasks {
        src: mask_of(fx, "src")?,
        tgt: mask_of(fx, "tgt")?,
        memory: mask_of(fx, "memory")?,
    };
    let (src, tgt) = (fx.get("src")?, fx.get("tgt")?);
    let memory = model.encoder().forward(src, &masks.src)?;
    assert_close("memory", &memory, fx.get("memory")?, RTOL)?;
    let out = model.forward(src, tgt, &masks)?;
    assert_close("output", &out, fx.get("output")?, RTOL)?;
    Ok(())
}

#[test]
fn transformer_matches_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    let files = fixture_files(&fixture_dir("transformer"))?;
    if files.len() < 9 {
        bail!(
            "expected the 9 fixtures of make_transformer_fixtures.py, found {}",
            files.len()
        )
    }
    for path in files {
        let fx = Fixture::load(&path, &dev)?;
        run_case(&fx, &dev).with_context(|| format!("fixture {}", fx.name))?;
    }
    Ok(())
}

#[test]
fn wrong_checkpoint_names_the_tensor() -> Result<()> {
    let dev = Device::Cpu;
    let fx = Fixture::load(
        &fixture_dir("transformer").join("post_norm_padded.safetensors"),
        &dev,
    )?;
    // Twice the width: every tensor has the wrong shape.
    let cfg = TransformerConfig::new(32, 4).with_batch_first(true);
    let vb = VarBuilder::from_tensors(fx.tensors.clone(), DType::F32, &dev);
    let err = Transformer::new(&cfg, vb.pp("model"))
        .err()
        .context("loading a 16-wide checkpoint as 32-wide must fail")?;
    let msg = err.to_string();
    assert!(msg.contains("encoder.layers.0.self_attn.in_proj"), "{msg}");
    // A config that cannot be: named in the message.
    let bad = TransformerConfig::new(30, 4);
    let vb = VarBuilder::from_tensors(fx.tensors.clone(), DType::F32, &dev);
    let msg = Transformer::new(&bad, vb)
        .err()
        .context("30 % 4 != 0")?
        .to_string();
    assert!(msg.contains("divisible"), "{msg}");
    Ok(())
}
