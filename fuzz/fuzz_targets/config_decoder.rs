//! Any bytes as a decoder's `config.json` beside the Llama fixture's
//! weights, the way `DecoderModel::from_folder` reads it; a config that
//! passes and matches the weights is also run on a short prompt and one
//! cached step.
#![no_main]

use candle::{Device, Tensor};
use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::Checkpoint;
use multihead_models::decoder::{CausalLm, DecoderModel, HfDecoderConfig};

static WEIGHTS: &[u8] = include_bytes!("../../tests/fixtures/decoders/llama/model.safetensors");

fuzz_target!(|data: &[u8]| {
    let Ok(json) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = HfDecoderConfig::from_json(json, "config.json") else {
        return;
    };
    let Ok(ckpt) = Checkpoint::from_bytes(WEIGHTS.to_vec(), "model.safetensors") else {
        return;
    };
    let dev = Device::Cpu;
    let Ok(model) = DecoderModel::from_checkpoint(&cfg, &ckpt, &dev) else {
        return;
    };
    let mut cache = model.new_cache(vec![1]);
    if let Ok(ids) = Tensor::new(&[[1u32, 2, 3]], &dev) {
        let _ = model.forward(&ids, &mut cache);
    }
    if let Ok(ids) = Tensor::new(&[[4u32]], &dev) {
        let _ = model.forward(&ids, &mut cache);
    }
});
