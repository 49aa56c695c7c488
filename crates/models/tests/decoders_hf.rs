//! GPT-2 and Llama-family decoders against HF transformers (fixtures
//! written by `scripts/make_decoder_fixtures.py`: random-init
//! `GPT2LMHeadModel`, `LlamaForCausalLM` with grouped-query heads and
//! rope_theta 50000, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Phi-3, Gemma 2
//! and Gemma 3, saved by `save_pretrained`): the folder loads unchanged,
//! the prompt's logits, every cached decoding step's logits and greedy
//! generation (plain and left-padded batches) equal HF's.

use anyhow::{Context, Result};
use candle::{DType, Device, IndexOp, Tensor};
use multihead_models::checkpoint::{LoadOptions, WeightDtype};
use multihead_models::decoder::{generate_from_prompts, left_pad, CausalLm, DecoderModel};
use multihead_models::generation::{generate_from, Decoding, GenerateConfig};
use multihead_test_support::{
    compare::{assert_close, half_weights_tolerance, max_abs_diff},
    fixtures::{fixture_dir, Fixture},
};

const MODELS: [&str; 11] = [
    "gpt2", "llama", "mistral", "llama3", "qwen2", "qwen3", "smollm3", "olmo2", "phi3", "gemma2", "gemma3",
];

fn load(name: &str) -> Result<(DecoderModel, Fixture)> {
    let dev = Device::Cpu;
    let dir = fixture_dir("decoders");
    let model =
        DecoderModel::from_folder(&dir.join(name), &dev).with_context(|| format!("loading {name}"))?;
    let f = Fixture::load(&dir.join(format!("{name}_expected.safetensors")), &dev)?;
    Ok((model, f))
}

fn ids(f: &Fixture, name: &str) -> Result<Tensor> {
    Ok(f.get(name)?.to_dtype(DType::U32)?)
}

fn rows(t: &Tensor) -> Result<Vec<Vec<u32>>> {
    Ok(t.to_dtype(DType::U32)?.to_vec2()?)
}

/// An end token greedy decoding never picks, so that every row runs to
/// `max_new_tokens` as HF's did (its config has no eos).
fn unused_token(f: &Fixture, vocab: usize) -> Result<u32> {
    let used: Vec<u32> = ids(f, "greedy_ids")?.flatten_all()?.to_vec1()?;
    let padded: Vec<u32> = ids(f, "padded_greedy_ids")?.flatten_all()?.to_vec1()?;
    (0..vocab as u32)
        .rev()
        .find(|t| !used.contains(t) && !padded.contains(t))
        .context("every token is used")
}

/// Prefills `greedy[:, ..7]`, then feeds one token at a time through the
/// cache: the logits that chose `greedy[:, 7 + s]` are `steps[:, s]`
/// within `tol` of their largest.
fn cached_steps_match(
    model: &DecoderModel,
    greedy: &Tensor,
    steps: &Tensor,
    what: &str,
    tol: f64,
) -> Result<()> {
    let mut cache = model.new_cache(vec![]);
    let mut step = model.forward(&greedy.i((.., ..7))?, &mut cache)?.i((.., 6))?;
    for s in 0..steps.dim(1)? {
        assert_close(&format!("{what} step {s}"), &step, &steps.i((.., s))?, tol)?;
        step = model
            .forward(&greedy.i((.., 7 + s..8 + s))?, &mut cache)?
            .i((.., 0))?;
    }
    Ok(())
}

#[test]
fn prompt_logits_equal_hf() -> Result<()> {
    for name in MODELS {
        let (model, f) = load(name)?;
        let input = ids(&f, "input_ids")?;
        let logits = model.forward(&input, &mut model.new_cache(vec![]))?;
        assert_close(&format!("{name} prompt logits"), &logits, f.get("logits")?, 1e-5)?;
        eprintln!(
            "{name}: max |ours - HF| over the prompt logits: {:.2e}",
            max_abs_diff(&logits, f.get("logits")?)?
        );
    }
    Ok(())
}

/// Loaded with the weight matrices in bf16 or f16 (rounded from the f32
/// fixture, packed as such), the prompt's and every cached step's logits
/// equal HF's with the same weights rounded and computed in f32
/// (`scripts/make_half_fixtures.py`; within `half_weights_tolerance`),
/// and differ from our f32 ones: the weights were rounded.
#[test]
fn half_precision_weights_give_hf_logits_over_the_rounded_weights() -> Result<()> {
    let dir = fixture_dir("decoders");
    let half = Fixture::load(&dir.join("half_expected.safetensors"), &Device::Cpu)?;
    for name in MODELS {
        let (f32_model, f) = load(name)?;
        let input = ids(&f, "input_ids")?;
        let f32_logits = f32_model.forward(&input, &mut f32_model.new_cache(vec![]))?;
        for dtype in [WeightDtype::Bf16, WeightDtype::F16] {
            let opts = LoadOptions {
                dtype,
                ..LoadOptions::default()
            };
            let model = DecoderModel::from_folder_with(&dir.join(name), &Device::Cpu, &opts)?;
            let what = format!("{name} {dtype}");
            let expected = half.get(&format!("{name}.{dtype}.logits"))?;
            let logits = model.forward(&input, &mut model.new_cache(vec![]))?;
            let tol = half_weights_tolerance(dtype == WeightDtype::Bf16);
            assert_close(&format!("{what} prompt logits"), &logits, expected, tol)?;
            let moved = max_abs_diff(&logits, &f32_logits)?;
            assert!(
                moved > 1e-3,
                "{what}: the logits equal the f32 model's: not rounded?"
            );
            let steps = half.get(&format!("{name}.{dtype}.steps"))?;
            cached_steps_match(&model, &ids(&f, "greedy_ids")?, steps, &what, tol)?;
            eprintln!(
                "{what}: max |ours - HF| over the prompt logits {:.2e}; rounding moved them {moved:.2e}",
                max_abs_diff(&logits, expected)?
            );
        }
    }
    Ok(())
}

/// With the cache storing keys and values in bf16 or f16 (`--kv-dtype`),
/// the prompt's logits and each cached step's equal HF's with its cache
/// rounding keys and values the same way, computed in f32
/// (`scripts/make_half_fixtures.py`): the prefill attends over the rounded
/// keys it stored, and every step reads the cache in place.
///
/// Where ours and HF's f32 keys differ in their last bit (summation
/// order) across a rounding boundary, they round one half-precision ulp
/// apart. bf16's coarse grid makes that rare: the logits agree to about
/// 5e-6 of the largest, 5e-5 where a key flipped, 2.3e-4 in Gemma 3
/// (its normed keys and larger score scale weigh a flip more; its steps
/// agree to 1e-5 until one does) (tolerance 3e-4, while rounding the
/// cache at all moves them by 3e-3 to 6e-3). f16's grid is 8
/// times finer, so flips are many and move the logits by up to 1.1e-3 of
/// the largest, more than rounding to f16 moves them (3e-4 to 9e-4): the
/// f16 tolerance, 3e-3, bounds ours near HF's, and that the cache rounds
/// at all is checked against the f32 cache's logits.
#[test]
fn a_half_precision_cache_gives_hf_logits_over_the_rounded_keys_and_values() -> Result<()> {
    let dir = fixture_dir("decoders");
    let half = Fixture::load(&dir.join("half_expected.safetensors"), &Device::Cpu)?;
    for name in MODELS {
        let (f32_model, f) = load(name)?;
        let input = ids(&f, "input_ids")?;
        let f32_logits = f32_model.forward(&input, &mut f32_model.new_cache(vec![]))?;
        for (short, dtype) in [("bf16", DType::BF16), ("f16", DType::F16)] {
            let opts = LoadOptions {
                kv_dtype: Some(dtype),
                ..LoadOptions::default()
            };
            let model = DecoderModel::from_folder_with(&dir.join(name), &Device::Cpu, &opts)?;
            let what = format!("{name} kv {short}");
            let expected = half.get(&format!("{name}.kv_{short}.logits"))?;
            let tol = if dtype == DType::BF16 { 3e-4 } else { 3e-3 };
            let logits = model.forward(&input, &mut model.new_cache(vec![]))?;
            assert_close(&format!("{what} prompt logits"), &logits, expected, tol)?;
            let moved = max_abs_diff(&logits, &f32_logits)?;
            assert!(
                moved > 1e-4,
                "{what}: the logits equal the f32 cache's: not rounded?"
            );
            let steps = half.get(&format!("{name}.kv_{short}.steps"))?;
            cached_steps_match(&model, &ids(&f, "greedy_ids")?, steps, &what, tol)?;
        }
    }
    Ok(())
}

/// Loaded in 4 bits (`--dtype q4_0`, and `--dtype q4_k`: Q4_K where 256
/// divides a matrix's input size, Q5_0 elsewhere; ggml's blocks, quantized
/// at load), every model runs, its logits move from f32's by more than
/// 1e-2 and less than the largest logit (25–65 % of it: 4 bits are lossy,
/// and these random-init models' logits are flat), and f32's top token
/// stays the top at a quarter of the positions or more (about half here; a
/// broken product would agree at 1 in 384).
#[test]
fn four_bit_weights_run_every_model() -> Result<()> {
    let dir = fixture_dir("decoders");
    for dtype in [WeightDtype::Q4_0, WeightDtype::Q4_K] {
        let (mut agree, mut positions) = (0, 0);
        for name in MODELS {
            let (f32_model, f) = load(name)?;
            let opts = LoadOptions {
                dtype,
                ..LoadOptions::default()
            };
            let model = DecoderModel::from_folder_with(&dir.join(name), &Device::Cpu, &opts)?;
            let input = ids(&f, "input_ids")?;
            let logits = model.forward(&input, &mut model.new_cache(vec![]))?;
            let f32_logits = f32_model.forward(&input, &mut f32_model.new_cache(vec![]))?;
            let scale = f32_logits.abs()?.max_all()?.to_scalar::<f32>()?;
            let moved = max_abs_diff(&logits, &f32_logits)?;
            eprintln!(
                "{name} {dtype}: max |{dtype} - f32| {:.2e} of the largest logit",
                moved / scale
            );
            assert!(
                moved > 1e-2 && moved < scale,
                "{name} {dtype}: moved {moved} of {scale}"
            );
            let ours: Vec<u32> = logits.argmax(2)?.flatten_all()?.to_vec1()?;
            let theirs: Vec<u32> = f32_logits.argmax(2)?.flatten_all()?.to_vec1()?;
            agree += ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
            positions += ours.len();
        }
        eprintln!("{dtype} top-1 equal to f32's at {agree} of {positions} positions");
        assert!(
            agree * 4 >= positions,
            "{dtype}: top-1 equal at {agree} of {positions}"
        );
    }
    Ok(())
}

/// Loaded as Q8_0 (weights and, at each call, inputs quantized in blocks
/// of 32, llama.cpp's `vec_dot_q8_0_q8_0`), the prompt's logits stay within
/// 7e-2 of HF's f32 logits (relative to the largest; rounding these
/// random-init models' weights to bf16 alone moves them 1-2 %, Q8_0 3.7 to
/// 6.3 %, and the same rounding of HF's weights and inputs 3.5 to 5.2 %,
/// a tied model's embedding table quantized with its head) and pick HF's
/// top token at nearly every position. Layers whose input size is not a
/// multiple of 32 stay f32.
#[test]
fn q8_0_weights_stay_close_to_hf() -> Result<()> {
    let dir = fixture_dir("decoders");
    let (mut agree, mut positions) = (0, 0);
    for name in MODELS {
        let (f32_model, f) = load(name)?;
        let opts = LoadOptions {
            dtype: WeightDtype::Q8_0,
            ..LoadOptions::default()
        };
        let model = DecoderModel::from_folder_with(&dir.join(name), &Device::Cpu, &opts)?;
        let input = ids(&f, "input_ids")?;
        let logits = model.forward(&input, &mut model.new_cache(vec![]))?;
        let want = f.get("logits")?;
        assert_close(&format!("{name} q8_0 prompt logits"), &logits, want, 7e-2)?;
        let f32_logits = f32_model.forward(&input, &mut f32_model.new_cache(vec![]))?;
        assert!(
            max_abs_diff(&logits, &f32_logits)? > 1e-2,
            "{name}: not quantized?"
        );
        let ours: Vec<u32> = logits.argmax(2)?.flatten_all()?.to_vec1()?;
        let theirs: Vec<u32> = want.argmax(2)?.flatten_all()?.to_vec1()?;
        agree += ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
        positions += ours.len();
        eprintln!(
            "{name} q8_0: max |ours - HF| {:.2e}",
            max_abs_diff(&logits, want)?
        );
    }
    eprintln!("q8_0 top-1 equal to HF's at {agree} of {positions} positions");
    assert!(
        agree * 100 >= positions * 90,
        "top-1 equal at {agree} of {positions}"
    );
    Ok(())
}

#[test]
fn cached_steps_equal_hf_at_every_step() -> Result<()> {
    for name in MODELS {
        let (model, f) = load(name)?;
        let greedy = ids(&f, "greedy_ids")?;
        let expected = f.get("step_logits")?;
        let steps = expected.dim(1)?;
        // Chunked prefill (3 without logits, `CausalLm::prefill`, then 4),
        // then one token at a time.
        let mut cache = model.new_cache(vec![]);
        model.prefill(&greedy.i((.., ..3))?, &mut cache)?;
        let mut logits = model.forward(&greedy.i((.., 3..7))?, &mut cache)?.i((.., 3))?;
        for s in 0..steps {
            assert_close(&format!("{name} step {s}"), &logits, &expected.i((.., s))?, 1e-5)?;
            let next = greedy.i((.., 7 + s..8 + s))?;
            logits = model.forward(&next, &mut cache)?.i((.., 0))?;
        }
        assert_eq!(cache.len(), 7 + steps);
    }
    Ok(())
}

#[test]
fn greedy_generation_gives_hf_tokens() -> Result<()> {
    for name in MODELS {
        let (model, f) = load(name)?;
        let eos = unused_token(&f, model.vocab_size())?;
        let max_new = f.case["max_new_tokens"].as_u64().context("max_new_tokens")? as usize;
        let cfg = GenerateConfig {
            max_len: max_new,
            eos_id: eos,
            ..GenerateConfig::default()
        };
        // Equal-length prompts, then the left-padded batch (row 1 shorter).
        for (prompt_ids, out_ids, mask) in [
            ("input_ids", "greedy_ids", None),
            ("padded_ids", "padded_greedy_ids", Some("padded_attention_mask")),
        ] {
            let mut prompts = rows(f.get(prompt_ids)?)?;
            if let Some(mask) = mask {
                let mask = rows(f.get(mask)?)?;
                for (p, m) in prompts.iter_mut().zip(&mask) {
                    *p = p
                        .iter()
                        .zip(m)
                        .filter(|(_, &m)| m == 1)
                        .map(|(&t, _)| t)
                        .collect();
                }
            }
            let prompt_len = f.get(prompt_ids)?.dim(1)?;
            let out = generate_from_prompts(&model, &prompts, 0, &cfg, &[])?;
            let expected = rows(f.get(out_ids)?)?;
            assert_eq!(out.len(), expected.len(), "{name} {out_ids}: rows");
            for (r, (got, want)) in out.iter().zip(&expected).enumerate() {
                assert_eq!(got.len(), 1, "{name} {out_ids} row {r}: sequences");
                assert_eq!(got[0].tokens, want[prompt_len..], "{name} {out_ids} row {r}");
            }
        }
    }
    Ok(())
}

#[test]
fn left_padded_steps_equal_hf() -> Result<()> {
    for name in MODELS {
        let (model, f) = load(name)?;
        let padded = ids(&f, "padded_ids")?;
        let mask = rows(f.get("padded_attention_mask")?)?;
        let pads: Vec<usize> = mask
            .iter()
            .map(|m| m.iter().filter(|&&x| x == 0).count())
            .collect();
        let greedy = ids(&f, "padded_greedy_ids")?;
        let expected = f.get("padded_step_logits")?;
        let mut cache = model.new_cache(pads);
        let mut logits = model.forward(&padded, &mut cache)?.i((.., 6))?;
        for s in 0..expected.dim(1)? {
            assert_close(
                &format!("{name} padded step {s}"),
                &logits,
                &expected.i((.., s))?,
                1e-5,
            )?;
            logits = model
                .forward(&greedy.i((.., 7 + s..8 + s))?, &mut cache)?
                .i((.., 0))?;
        }
    }
    Ok(())
}

/// `generate_from_prompts` prefills each prompt whole and takes the first
/// token from the prefill's last logits; feeding the last token as a step
/// of its own after the rest (`CausalLm::prefill`) gives the same tokens
/// and scores, for greedy decoding, sampling several outputs and beam
/// search (whose rows are repeated before the first step), over prompts
/// of different lengths.
#[test]
fn a_whole_prompt_prefill_equals_feeding_its_last_token() -> Result<()> {
    let prompts = [vec![5, 6, 7, 8, 9], vec![10, 11], vec![12]];
    for name in MODELS {
        let (model, f) = load(name)?;
        let base = GenerateConfig {
            max_len: 6,
            eos_id: unused_token(&f, model.vocab_size())?,
            ..GenerateConfig::default()
        };
        let configs = [
            base.clone(),
            base.clone()
                .with_decoding(Decoding::Sample { seed: 3 })
                .with_num_return(2),
            base.clone()
                .with_decoding(Decoding::Beam { beams: 3 })
                .with_num_return(2),
        ];
        for cfg in &configs {
            let whole = generate_from_prompts(&model, &prompts, 0, cfg, &[])?;
            let (ids, pads) = left_pad(&prompts, 0, &Device::Cpu)?;
            let len = ids.dim(1)?;
            let mut cache = model.new_cache(pads);
            model.prefill(&ids.narrow(1, 0, len - 1)?, &mut cache)?;
            let last: Vec<u32> = ids.narrow(1, len - 1, 1)?.flatten_all()?.to_vec1()?;
            let stepped = generate_from(&model, cache, &last, cfg, &[])?;
            assert_eq!(whole.len(), stepped.len(), "{name} {:?}", cfg.decoding);
            for (w, s) in whole.iter().flatten().zip(stepped.iter().flatten()) {
                assert_eq!(w.tokens, s.tokens, "{name} {:?}", cfg.decoding);
                assert!(
                    (w.score - s.score).abs() <= 1e-4 * s.score.abs().max(1.),
                    "{name} {:?}",
                    cfg.decoding
                );
            }
        }
    }
    Ok(())
}

/// A multimodal Gemma 3 folder (`Gemma3ForConditionalGeneration`: the
/// text model under `language_model.`, a vision tower beside it) runs its
/// text model: the prompt's logits and every cached step's equal HF's
/// `Gemma3ForCausalLM` on the same text weights.
#[test]
fn a_multimodal_gemma3_folder_runs_its_text_model() -> Result<()> {
    let dir = fixture_dir("decoders");
    let model = DecoderModel::from_folder(&dir.join("gemma3_mm"), &Device::Cpu)?;
    let (_, f) = load("gemma3")?;
    let input = ids(&f, "input_ids")?;
    let logits = model.forward(&input, &mut model.new_cache(vec![]))?;
    assert_close("gemma3_mm prompt logits", &logits, f.get("logits")?, 1e-5)?;
    cached_steps_match(
        &model,
        &ids(&f, "greedy_ids")?,
        f.get("step_logits")?,
        "gemma3_mm",
        1e-5,
    )
}

/// Phi-3's LongRoPE on short_factor: the first two prompt tokens alone
/// stay within `original_max_position_embeddings` (2), so HF rotates them
/// with the short factors (the fixture's other logits, past it, use the
/// long ones), in one call and through the cache.
#[test]
fn phi3_within_the_original_context_uses_the_short_factors() -> Result<()> {
    let (model, f) = load("phi3")?;
    let input = ids(&f, "input_ids")?.i((.., ..2))?;
    let want = f.get("short_logits")?;
    let logits = model.forward(&input, &mut model.new_cache(vec![]))?;
    assert_close("phi3 short logits", &logits, want, 1e-5)?;
    let long = f.get("logits")?.i((.., ..2))?;
    assert!(
        max_abs_diff(want, &long)? > 1e-2,
        "the short and long factors give the same logits"
    );
    let mut cache = model.new_cache(vec![]);
    model.prefill(&input.i((.., ..1))?, &mut cache)?;
    let step = model.forward(&input.i((.., 1..2))?, &mut cache)?.i((.., 0))?;
    assert_close("phi3 short cached step", &step, &want.i((.., 1))?, 1e-5)?;
    Ok(())
}

/// A cached call that would take a sequence rotated with the short
/// factors past the original context is refused, naming the field, and
/// leaves the cache as it was: HF recomputes the whole sequence on the
/// long factors at that point, which this crate does not. The same
/// tokens fed as one prompt run on the long factors, as HF's.
#[test]
fn phi3_passing_the_original_context_in_the_cache_is_refused() -> Result<()> {
    let (model, f) = load("phi3")?;
    let input = ids(&f, "input_ids")?;
    let mut cache = model.new_cache(vec![]);
    model.prefill(&input.i((.., ..2))?, &mut cache)?;
    let err = model
        .forward(&input.i((.., 2..3))?, &mut cache)
        .expect_err("a call past the original context on a short cache")
        .to_string();
    assert!(
        err.contains("original_max_position_embeddings (2)") && err.contains("long_factor"),
        "{err}"
    );
    assert_eq!(cache.len(), 2);
    let whole = model.forward(&input.i((.., ..3))?, &mut model.new_cache(vec![]))?;
    assert_close(
        "phi3 three tokens at once",
        &whole.i((.., 2))?,
        &f.get("logits")?.i((.., 2))?,
        1e-5,
    )?;
    Ok(())
}

/// Two models of one folder, one packed as stored and one in Q8_0, loaded
/// at once on two threads: the format travels in each load's pack
/// options, no thread or global holds it, so each equals the same model
/// loaded alone, bit for bit, and the two differ.
#[test]
fn two_formats_load_at_once() -> Result<()> {
    let dir = fixture_dir("decoders");
    let load = |dtype: WeightDtype| -> Result<DecoderModel> {
        let opts = LoadOptions {
            dtype,
            ..LoadOptions::default()
        };
        Ok(DecoderModel::from_folder_with(
            &dir.join("llama"),
            &Device::Cpu,
            &opts,
        )?)
    };
    let (plain, q8) = std::thread::scope(|s| {
        let plain = s.spawn(|| load(WeightDtype::F32));
        let q8 = s.spawn(|| load(WeightDtype::Q8_0));
        (plain.join(), q8.join())
    });
    let joined =
        |r: std::thread::Result<Result<DecoderModel>>| r.map_err(|_| anyhow::anyhow!("a load panicked"))?;
    let (plain, q8) = (joined(plain)?, joined(q8)?);
    let f = Fixture::load(&dir.join("llama_expected.safetensors"), &Device::Cpu)?;
    let input = ids(&f, "input_ids")?;
    let logits = |m: &DecoderModel| m.forward(&input, &mut m.new_cache(vec![]));
    assert_eq!(
        max_abs_diff(&logits(&plain)?, &logits(&load(WeightDtype::F32)?)?)?,
        0.
    );
    assert_eq!(
        max_abs_diff(&logits(&q8)?, &logits(&load(WeightDtype::Q8_0)?)?)?,
        0.
    );
    assert!(
        max_abs_diff(&logits(&plain)?, &logits(&q8)?)? > 0.,
        "Q8_0 equals f32: not quantized?"
    );
    Ok(())
}
