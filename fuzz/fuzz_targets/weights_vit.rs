//! Any bytes as a ViT checkpoint: parsing, the pre-flight check and
//! loading must end in `Ok` or `Err`, never a panic or an abort.
#![no_main]

use candle::{DType, Device};
use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::Checkpoint;
use multihead_models::inspect::recognise;
use multihead_models::vit::{VisionTransformer, VitConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(ckpt) = Checkpoint::from_bytes(data.to_vec(), "fuzz.safetensors") else {
        return;
    };
    let _ = recognise(ckpt.tensors());
    let mut cfg = VitConfig {
        img_size: 8,
        patch_size: 4,
        embed_dim: 8,
        depth: 1,
        num_heads: 2,
        ..VitConfig::default()
    };
    cfg.num_classes = 3;
    let _ = ckpt.load(DType::F32, &Device::Cpu, |vb| VisionTransformer::new(&cfg, vb));
});
