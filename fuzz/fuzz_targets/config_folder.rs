//! Any bytes as one file of a model folder, the others being the committed
//! fixtures' (tests/fixtures/folders): the first byte picks which file
//! (HF `config.json`, `preprocessor_config.json`, timm `config.json`, or
//! `model.safetensors.index.json`). Parsing, the size bound, the
//! pre-flight check, loading and preprocessing a small image with the
//! resulting config must end in `Ok` or `Err`, never a panic, an overflow
//! or an allocation the file asked for.
#![no_main]

use candle::{DType, Device, Tensor};
use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::{read_index, Checkpoint};
use multihead_models::vit::{preprocess, VisionTransformer, VitConfig};

static HF_CONFIG: &str = include_str!("../../tests/fixtures/folders/hf_deit/config.json");
static HF_PRE: &str = include_str!("../../tests/fixtures/folders/hf_deit/preprocessor_config.json");
static HF_WEIGHTS: &[u8] = include_bytes!("../../tests/fixtures/folders/hf_deit/model.safetensors");
static TIMM_WEIGHTS: &[u8] = include_bytes!("../../tests/fixtures/folders/timm_vit/model.safetensors");

fn load(cfg: &VitConfig, weights: &[u8]) {
    // A small odd-sized image through the config's resize and crop.
    if let Ok(px) = Tensor::arange(0u8, 105, &Device::Cpu).and_then(|t| t.reshape((3, 7, 5))) {
        if cfg.in_chans == 3 {
            let _ = preprocess(cfg, &px);
        }
    }
    let Ok(ckpt) = Checkpoint::from_bytes(weights.to_vec(), "model.safetensors") else {
        return;
    };
    let _ = ckpt.load_bounded(&cfg.budget_owner(), DType::F32, &Device::Cpu, |vb, pack| {
        VisionTransformer::new_with(cfg, pack, vb)
    });
}

fuzz_target!(|data: &[u8]| {
    let [which, rest @ ..] = data else { return };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    match which % 4 {
        0 => {
            if let Ok(cfg) = VitConfig::from_hf_config(text, Some(HF_PRE)) {
                load(&cfg, HF_WEIGHTS);
            }
        }
        1 => {
            if let Ok(cfg) = VitConfig::from_hf_config(HF_CONFIG, Some(text)) {
                load(&cfg, HF_WEIGHTS);
            }
        }
        2 => {
            if let Ok(cfg) = VitConfig::from_timm_config(text) {
                load(&cfg, TIMM_WEIGHTS);
            }
        }
        _ => {
            let _ = read_index(text, "model.safetensors.index.json");
        }
    }
});
