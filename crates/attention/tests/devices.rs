//! Device-generic checks, run on every device this build has: the CPU
//! always, CUDA with `--features cuda` and Metal with `--features metal`
//! when such a device is present. The PyTorch fixtures replayed on the
//! device, and each device's default path in f32/f16/bf16 against the CPU
//! reference.

#[path = "../../../tests/common/mod.rs"]
mod common;

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::{assert_close, fixture_dir, Fixture};
use multihead_attention::{
    scaled_dot_product_attention_via, AttnPath, Causal, KeyPaddingMask, Mask, MhaConfig, MhaOptions,
    MultiheadAttention, NeedWeights,
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
