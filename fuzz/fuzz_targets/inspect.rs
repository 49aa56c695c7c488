//! Any bytes as the file `multihead inspect` reads: header validation,
//! layout recognition (products and indices from the header), totals and
//! the NaN/Inf scan of every tensor.
#![no_main]

use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::Checkpoint;
use multihead_models::inspect::recognise;

fuzz_target!(|data: &[u8]| {
    let Ok(ckpt) = Checkpoint::from_bytes(data.to_vec(), "fuzz.safetensors") else {
        return;
    };
    let _ = recognise(ckpt.tensors());
    let _ = ckpt.total_params();
    let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
    let _ = ckpt.non_finite(names.iter().copied());
    for t in ckpt.tensors().iter().take(8) {
        let _ = ckpt.tensor(&t.name, &candle::Device::Cpu);
    }
});
