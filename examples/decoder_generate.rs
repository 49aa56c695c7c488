//! Generating from a decoder-only model folder written by HF transformers'
//! `save_pretrained` (GPT-2 or Llama), with the shared generation API:
//! greedy, then seeded top-k sampling with a repetition penalty, over a
//! batch of prompts of different lengths (left-padded as HF pads them).
//!
//! ```text
//! cargo run --release --example decoder_generate -- tests/fixtures/decoders/llama 5,17,42 9,3
//! ```
//!
//! The fixtures are random-init models, so the tokens mean nothing; a real
//! checkpoint's folder works the same way (token ids from its tokenizer).

use anyhow::{Context, Result};
use candle::Device;
use multihead::models::decoder::{generate_from_prompts, CausalLm, DecoderModel};
use multihead::models::generation::{Decoding, GenerateConfig, RepetitionPenalty, TopK};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, prompts) = args
        .split_first()
        .context("usage: decoder_generate MODEL_DIR IDS [IDS ...] (IDS: comma-separated token ids)")?;
    let prompts = prompts
        .iter()
        .map(|p| {
            p.split(',')
                .map(|t| {
                    t.trim()
                        .parse::<u32>()
                        .with_context(|| format!("bad token id '{t}'"))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let model = DecoderModel::from_folder(dir.as_ref(), &Device::Cpu)?;
    // The fixtures have no end token: the last id stands in for one.
    let eos = model.vocab_size() as u32 - 1;
    let greedy = GenerateConfig {
        max_len: 12,
        eos_id: eos,
        ..GenerateConfig::default()
    };
    let sampled = greedy.clone().with_decoding(Decoding::Sample { seed: 7 });
    // HF's order: the penalty (over each prompt's ids and the generated
    // ones) before the top-k warper.
    let (top_k, penalty) = (
        TopK::new(20)?,
        RepetitionPenalty::new(1.3)?.with_prompts(prompts.clone()),
    );
    for (name, cfg, procs) in [
        ("greedy", &greedy, vec![]),
        (
            "top-k 20, repetition penalty 1.3, seed 7",
            &sampled,
            vec![&penalty as _, &top_k as _],
        ),
    ] {
        println!("{name}:");
        let out = generate_from_prompts(&model, &prompts, 0, cfg, &procs)?;
        for (prompt, gen) in prompts.iter().zip(&out) {
            println!("  {prompt:?} -> {:?}", gen[0].tokens);
        }
    }
    Ok(())
}
