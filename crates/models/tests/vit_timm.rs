//! `VisionTransformer` against timm, on the fixtures written by
//! `scripts/make_vit_fixtures.py`: logits within 1e-4 relative error and
//! the attention weights of every stored layer.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Module};
use candle_nn::VarBuilder;
use multihead_models::vit::{VisionTransformer, VitConfig};
use multihead_test_support::{
    compare::{assert_close, max_abs_diff},
    fixtures::{fixture_dir, fixture_files, Fixture},
};

/// The bar for logits.
const RTOL: f64 = 1e-4;

/// The CPU, and every GPU this build has.
fn devices() -> Result<Vec<Device>> {
    #[allow(unused_mut)]
    let mut devs = vec![Device::Cpu];
    #[cfg(feature = "cuda")]
    devs.push(Device::new_cuda(0)?);
    #[cfg(feature = "metal")]
    devs.push(Device::new_metal(0)?);
    Ok(devs)
}

fn check(path: &Path, dev: &Device) -> Result<()> {
    let fx = Fixture::load(path, dev)?;
    let cfg: VitConfig = serde_json::from_value(fx.case["config"].clone()).context("config")?;
    let vb = VarBuilder::from_tensors(fx.with_prefix("model"), DType::F32, dev);
    let vit = VisionTransformer::new(&cfg, vb).with_context(|| format!("{}: loading", fx.name))?;
    let x = fx.get("input")?;
    let out = vit.forward_with_attention(x)?;
    let want = fx.get("logits")?;
    let scale = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    println!(
        "{}: logits max error / max|timm| = {:.2e}",
        fx.name,
        max_abs_diff(&out.logits, want)? / scale
    );
    assert_close(&format!("{}: logits", fx.name), &out.logits, want, RTOL)?;
    // The plain forward takes the no-weights path; it must agree too.
    assert_close(
        &format!("{}: forward", fx.name),
        &vit.forward(x)?,
        fx.get("logits")?,
        RTOL,
    )?;
    let layers = fx.case["attn_layers"].as_array().context("attn_layers")?;
    if layers.is_empty() {
        bail!("{}: no attention layers stored", fx.name)
    }
    for l in layers {
        let l = l.as_u64().context("layer index")? as usize;
        let got = out.attentions.get(l).context("missing layer")?;
        assert_close(
            &format!("{}: attn.{l}", fx.name),
            got,
            fx.get(&format!("attn.{l}"))?,
            RTOL,
        )?;
    }
    Ok(())
}

#[test]
fn vit_matches_timm() -> Result<()> {
    let files = fixture_files(&fixture_dir("vit"))?;
    assert!(files.len() >= 9, "fixtures missing: {files:?}");
    let mut failures = Vec::new();
    for dev in devices()? {
        for f in &files {
            if let Err(e) = check(f, &dev) {
                failures.push(format!("{dev:?}: {e:#}"));
            }
        }
    }
    if !failures.is_empty() {
        bail!(
            "{} of {} fixtures failed:\n{}",
            failures.len(),
            files.len(),
            failures.join("\n")
        )
    }
    Ok(())
}

/// f16 and bf16 weights stay close to timm's f32 logits: with the whole
/// model in that dtype (its linears packed in it, half-precision inputs
/// widened, the attention softmax in f32), and with only the weight
/// matrices rounded to it and f32 activations (the numbers `multihead vit
/// --dtype` computes on the CPU; `tests/vit_digits.rs` runs that path).
#[test]
fn half_precision_is_close() -> Result<()> {
    for name in ["timm_token", "timm_layerscale_avg", "hf_resized"] {
        let fx = Fixture::load(
            &fixture_dir("vit").join(format!("{name}.safetensors")),
            &Device::Cpu,
        )?;
        let cfg: VitConfig = serde_json::from_value(fx.case["config"].clone())?;
        for dtype in [DType::F16, DType::BF16] {
            let vb = VarBuilder::from_tensors(fx.with_prefix("model"), dtype, &Device::Cpu);
            let vit = VisionTransformer::new(&cfg, vb)?;
            let logits = vit.forward(&fx.get("input")?.to_dtype(dtype)?)?;
            assert_eq!(logits.dtype(), dtype);
            assert_close(
                &format!("{name}: {dtype:?} logits"),
                &logits,
                fx.get("logits")?,
                2e-2,
            )?;
            let matrices = fx
                .with_prefix("model")
                .into_iter()
                .map(|(k, t)| Ok((k, if t.rank() == 2 { t.to_dtype(dtype)? } else { t })))
                .collect::<Result<_>>()?;
            let vit =
                VisionTransformer::new(&cfg, VarBuilder::from_tensors(matrices, DType::F32, &Device::Cpu))?;
            let logits = vit.forward(fx.get("input")?)?;
            assert_eq!(logits.dtype(), DType::F32);
            assert_close(
                &format!("{name}: {dtype:?} matrices"),
                &logits,
                fx.get("logits")?,
                2e-2,
            )?;
        }
    }
    Ok(())
}

/// A checkpoint that does not match the config names the tensor.
#[test]
fn wrong_checkpoint_names_the_tensor() -> Result<()> {
    let path = fixture_dir("vit").join("timm_token.safetensors");
    let fx = Fixture::load(&path, &Device::Cpu)?;
    let mut cfg: VitConfig = serde_json::from_value(fx.case["config"].clone())?;
    cfg.embed_dim = 48;
    let vb = VarBuilder::from_tensors(fx.with_prefix("model"), DType::F32, &Device::Cpu);
    let err = VisionTransformer::new(&cfg, vb)
        .err()
        .context("loaded a mismatched checkpoint")?;
    let msg = format!("{err:#}");
    assert!(msg.contains("patch_embed.proj.weight"), "{msg}");
    Ok(())
}

/// The full timm architectures (random init), written by
/// `scripts/make_vit_fixtures.py --full` to `target/vit-full-fixtures/`:
/// `cargo test --release --test vit_timm -- --ignored`.
#[test]
#[ignore = "needs scripts/make_vit_fixtures.py --full (not committed: too large)"]
fn full_architectures_match_timm() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/vit-full-fixtures");
    let files = fixture_files(&dir)?;
    if files.is_empty() {
        bail!(
            "no fixtures in {}: run scripts/make_vit_fixtures.py --full",
            dir.display()
        )
    }
    for f in &files {
        check(f, &Device::Cpu)?;
        println!("{}: ok", f.display());
    }
    Ok(())
}
