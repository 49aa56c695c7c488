//! Any bytes as an input image to `multihead vit`: decoding under the
//! limits, the 8-bit reduction and the float resize to a target size taken
//! from the first two bytes (including sizes the image is smaller than).
#![no_main]

use candle::{Device, Tensor};
use libfuzzer_sys::fuzz_target;
use multihead_models::image_input::{decode_image, pixels_u8};
use multihead_models::vit::{preprocess_to, VitConfig};

fuzz_target!(|data: &[u8]| {
    let [a, b, rest @ ..] = data else { return };
    let Ok(img) = decode_image(rest, "fuzz.png") else {
        return;
    };
    let channels = if a & 1 == 0 { 1 } else { 3 };
    let side = 1 + usize::from(*b) % 64;
    let Ok(px) = pixels_u8(&img, channels, (side, side)) else {
        return;
    };
    let Ok(x) = Tensor::from_vec(px.data, (px.channels, px.height, px.width), &Device::Cpu) else {
        return;
    };
    let mut cfg = VitConfig {
        img_size: side,
        patch_size: 1,
        embed_dim: 8,
        depth: 1,
        num_heads: 1,
        ..VitConfig::default()
    };
    cfg.in_chans = channels;
    cfg.image_mean = vec![0.5; channels];
    cfg.image_std = vec![0.5; channels];
    let _ = preprocess_to(&cfg, &x, (side, side));
});
