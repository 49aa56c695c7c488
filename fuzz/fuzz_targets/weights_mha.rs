//! Any bytes as an `nn.MultiheadAttention` checkpoint.
#![no_main]

use candle::{DType, Device};
use libfuzzer_sys::fuzz_target;
use multihead_attention::{MhaConfig, MultiheadAttention};
use multihead_models::checkpoint::Checkpoint;

fuzz_target!(|data: &[u8]| {
    let Ok(ckpt) = Checkpoint::from_bytes(data.to_vec(), "fuzz.safetensors") else {
        return;
    };
    let _ = ckpt.load(DType::F32, &Device::Cpu, |vb| {
        MultiheadAttention::new(&MhaConfig::new(8, 2), vb)
    });
});
