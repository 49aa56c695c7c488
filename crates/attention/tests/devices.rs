//! Device-generic checks, run on every device this build has: the CPU
//! always, CUDA with `--features cuda` and Metal with `--features metal`
//! when such a device is present. The PyTorch fixtures replayed on the
//! device, each device's default path in f32/f16/bf16 against the CPU
//! reference, and a bf16 decoder's attention stepping through a bf16
//! cache against the f32 full pass.

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use multihead_attention::{
    scaled_dot_product_attention_via, AttnPath, Causal, KeyPaddingMask, Mask, MhaConfig, MhaOptions,
    MultiheadAttention, NeedWeights,
};
use multihead_test_support::{
    compare::assert_close,
    fixtures::{fixture_dir, Fixture},
};

fn devices() -> Vec<Device> {
    #[allow(unused_mut)]
    let mut devices = vec![Device::Cpu];
    #[cfg(feature = "cuda")]
    match Device::new_cuda(0) {
        Ok(d) => devices.push(d),
        // scripts/gpu-check.sh sets this on the GPU machine, where a
        // missing device is a failure, not a skip.
        Err(e) if std::env::var_os("MULTIHEAD_REQUIRE_CUDA").is_some() => panic!("no CUDA device: {e}"),
        Err(e) => eprintln!("no CUDA device: {e}"),
    }
    #[cfg(feature = "metal")]
    match Device::new_metal(0) {
        Ok(d) => devices.push(d),
        Err(e) => eprintln!("no Metal device: {e}"),
    }
    devices
}

#[test]
fn pytorch_fixtures_on_every_device() -> Result<()> {
    for dev in devices() {
        for case in [
            "self_basic",
            "cross_kdim_vdim",
            "causal_and_key_padding",
            "self_no_weights",
        ] {
            let fx = Fixture::load(&fixture_dir("mha").join(format!("{case}.safetensors")), &dev)?;
            let cfg: MhaConfig = serde_json::from_value(fx.case["config"].clone())?;
            let mha = MultiheadAttention::new(
                &cfg,
                VarBuilder::from_tensors(fx.with_prefix("mha"), DType::F32, &dev),
            )?;
            let q = fx.get("query")?;
            let (k, v) = match fx.tensors.get("key") {
                Some(k) => (k, fx.get("value")?),
                None => (q, q),
            };
            let mut mask = Mask::new();
            if case == "causal_and_key_padding" {
                mask = mask
                    .with_causal(Causal::TopLeft)
                    .with_key_padding(KeyPaddingMask::PadWhereTrue(fx.get("key_padding_mask")?.clone()));
            }
            let weights = if fx.tensors.contains_key("weights") {
                NeedWeights::Averaged
            } else {
                NeedWeights::No
            };
            let out = mha.forward_attn(q, k, v, &MhaOptions::new().with_mask(mask).with_weights(weights))?;
            assert_close(
                &format!("{case} on {dev:?}"),
                &out.output,
                fx.get("output")?,
                1e-5,
            )?;
            // The averaged weights asked for, against PyTorch's.
            if weights == NeedWeights::Averaged {
                let got = out.weights.context("weights were asked for")?;
                assert_close(
                    &format!("{case} weights on {dev:?}"),
                    &got,
                    fx.get("weights")?,
                    1e-5,
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn default_path_on_every_device_and_dtype() -> Result<()> {
    let cpu = Device::Cpu;
    let (q, k, v) = (
        Tensor::randn(0f32, 1., (2, 4, 33, 64), &cpu)?,
        Tensor::randn(0f32, 1., (2, 4, 33, 64), &cpu)?,
        Tensor::randn(0f32, 1., (2, 4, 33, 64), &cpu)?,
    );
    let mask = Mask::causal(Causal::TopLeft);
    let reference = scaled_dot_product_attention_via(&q, &k, &v, &mask, None, AttnPath::Reference)?;
    for dev in devices() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 5e-3), (DType::BF16, 3e-2)] {
            let put = |t: &Tensor| t.to_device(&dev)?.to_dtype(dtype);
            let out = scaled_dot_product_attention_via(
                &put(&q)?,
                &put(&k)?,
                &put(&v)?,
                &mask,
                None,
                AttnPath::Auto,
            )?;
            assert_close(
                &format!("{dtype:?} on {dev:?}"),
                &out.to_device(&cpu)?,
                &reference,
                tol,
            )?;
        }
    }
    Ok(())
}

/// A Llama-shaped self-attention (grouped-query heads, rotary positions)
/// in bf16 on each device, its cache in bf16 too: a prefill and then one
/// token at a time (on CUDA with `flash-attn`, the flash-attn kernel)
/// stay within bf16's reach of the f32 module's full causal pass on the
/// CPU.
#[test]
fn bf16_decoder_steps_on_every_device() -> Result<()> {
    use candle::IndexOp;
    use multihead_attention::{KvCache, PositionEncoding, RotaryConfig, WeightLayout};

    let cpu = Device::Cpu;
    let (e, heads, kv_heads) = (256, 4, 2);
    let cfg = MhaConfig::new(e, heads)
        .with_bias(false)
        .with_kv_heads(kv_heads)
        .with_position(PositionEncoding::Rotary(RotaryConfig::new(10_000.)));
    let (kv_dim, head_dim) = (kv_heads * e / heads, e / heads);
    let mut weights = std::collections::HashMap::new();
    for (name, rows) in [
        ("q_proj", e),
        ("k_proj", kv_dim),
        ("v_proj", kv_dim),
        ("o_proj", e),
    ] {
        let w = (Tensor::randn(0f32, 1., (rows, e), &cpu)? / (e as f64).sqrt())?;
        weights.insert(format!("{name}.weight"), w);
    }
    let build = |dtype: DType, dev: &Device| -> Result<MultiheadAttention> {
        let vb = VarBuilder::from_tensors(weights.clone(), dtype, dev);
        Ok(MultiheadAttention::new_with_layout(
            &cfg,
            &WeightLayout::llama(),
            vb,
        )?)
    };
    let x = Tensor::randn(0f32, 1., (2, 9, e), &cpu)?;
    let causal = MhaOptions::new().with_mask(Mask::causal(Causal::TopLeft));
    let reference = build(DType::F32, &cpu)?.forward_attn(&x, &x, &x, &causal)?.output;
    assert_eq!(head_dim, 64);
    for dev in devices() {
        let mha = build(DType::BF16, &dev)?;
        let mut cache = KvCache::new(4);
        let xd = x.to_device(&dev)?.to_dtype(DType::BF16)?;
        let mut t0 = 0;
        for n in [5, 1, 1, 1, 1] {
            let out = mha.forward_cached(&xd.i((.., t0..t0 + n))?, &mut cache, &MhaOptions::new())?;
            let out = out.output.to_device(&cpu)?.to_dtype(DType::F32)?;
            let want = reference.i((.., t0..t0 + n))?;
            assert_close(
                &format!("bf16 on {dev:?}, positions {t0}..{}", t0 + n),
                &out,
                &want,
                3e-2,
            )?;
            t0 += n;
        }
        assert_eq!(cache.keys()?.map(|k| k.dtype()), Some(DType::BF16), "{dev:?}");
    }
    Ok(())
}
