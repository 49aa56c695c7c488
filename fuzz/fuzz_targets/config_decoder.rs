//! Any bytes as a decoder's `config.json` beside the Llama fixture's
//! weights, the way `DecoderModel::from_folder` reads it; a config that
//! passes and matches the weights is also run on a short prompt and one
//! cached step, then sampled from: a generation that returns must have
//! chosen a token at every step it reports (non-finite logits are an
//! error, never an empty output).
#![no_main]

use candle::{Device, Tensor};
use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::Checkpoint;
use multihead_models::decoder::{generate_from_prompts, CausalLm, DecoderModel, HfDecoderConfig};
use multihead_models::generation::{Decoding, GenerateConfig, Temperature};

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
    let cfg = GenerateConfig {
        max_len: 4,
        start_id: 0,
        eos_id: 1,
        pad_id: 0,
        ..GenerateConfig::default()
    }
    .with_decoding(Decoding::Sample { seed: 7 });
    let Ok(t) = Temperature::new(0.7) else {
        return;
    };
    if let Ok(out) = generate_from_prompts(&model, &[vec![1, 2, 3], vec![4]], 0, &cfg, &[&t]) {
        for row in out.iter().flatten() {
            assert!(
                row.finished || !row.tokens.is_empty(),
                "a row ended with no token: {row:?}"
            );
        }
    }
});
