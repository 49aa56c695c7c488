//! Any bytes as a seq2seq `config.json` beside the shipped date model, the
//! way `multihead seq2seq` loads it; a config that passes is also run on
//! one short input.
#![no_main]

use candle::{DType, Device, Tensor};
use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::Checkpoint;
use multihead_models::transformer::{CacheMode, Seq2Seq, Seq2SeqConfig};

static WEIGHTS: &[u8] = include_bytes!("../../weights/dates/model.safetensors");

fuzz_target!(|data: &[u8]| {
    let Ok(json) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = Seq2SeqConfig::from_json(json) else {
        return;
    };
    let Ok(ckpt) = Checkpoint::from_bytes(WEIGHTS.to_vec(), "model.safetensors") else {
        return;
    };
    let Ok(model) = ckpt.load_bounded(&cfg.budget_owner(), DType::F32, &Device::Cpu, |vb, pack| {
        Seq2Seq::new_with(&cfg, pack, vb)
    }) else {
        return;
    };
    let len = cfg.max_src_len.min(4);
    let ids: Vec<u32> = (0..len as u32).map(|i| 3 + i % 5).collect();
    if let Ok(src) = Tensor::from_vec(ids, (1, len), &Device::Cpu) {
        let _ = model.greedy(&src, CacheMode::Use);
    }
});
