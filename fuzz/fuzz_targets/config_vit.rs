//! Any bytes as a ViT `config.json` beside the shipped weights: parsing,
//! the size bound, the pre-flight check and loading must end in `Ok` or
//! `Err` (a `depth: 300000` or an overflowing `embed_dim` included), never
//! a panic, an overflow or an allocation the config asked for.
#![no_main]

use candle::{DType, Device};
use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::Checkpoint;
use multihead_models::vit::{VisionTransformer, VitConfig};

static WEIGHTS: &[u8] = include_bytes!("../../weights/vit-digits/model.safetensors");

fuzz_target!(|data: &[u8]| {
    let Ok(json) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = VitConfig::from_json(json) else {
        return;
    };
    let Ok(ckpt) = Checkpoint::from_bytes(WEIGHTS.to_vec(), "model.safetensors") else {
        return;
    };
    let _ = ckpt.load_bounded(&cfg.budget_owner(), DType::F32, &Device::Cpu, |vb, pack| {
        VisionTransformer::new_with(&cfg, pack, vb)
    });
});
