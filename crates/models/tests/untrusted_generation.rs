//! Hostile inputs to the decoders, generation and attention, through the
//! library: configs larger than their file, files that are not regular,
//! windows and scales that overflow, non-finite logits, sampling across
//! batches, left padding that is never fed, contexts that run out,
//! empty batches. Each is refused by name or answered correctly.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;
use candle::{DType, Device, Tensor};
use multihead_attention::{
    scaled_dot_product_attention_via, AttnPath, Causal, KvCache, Mask, MhaConfig, MhaOptions,
    MultiheadAttention, NeedWeights,
};
use multihead_models::decoder::{generate_from_prompts, CausalLm, DecoderModel, HfDecoderConfig};
use multihead_models::generation::{Decoding, GenerateConfig, LogitsProcessor, StepContext, Temperature};
use multihead_test_support::{compare::max_abs_diff, fixtures::fixture_dir, scratch_dir};

/// A copy of the decoder fixture `name` in a fresh folder, with its
/// `config.json` edited by `edit`.
fn folder_with(name: &str, tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> Result<PathBuf> {
    let src = fixture_dir("decoders").join(name);
    let dir = scratch_dir!(format!("{name}-{tag}"))?;
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors"))?;
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string())?;
    Ok(dir)
}

fn load_error(dir: &Path) -> String {
    match DecoderModel::from_folder(dir, &Device::Cpu) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Runs the test `name` of this binary again in a child process whose
/// address space is capped at `mib` MiB (`ulimit -v`): an allocation the
/// size a hostile config asks for fails there instead of filling the
/// machine, and the child's exit status says whether the body passed.
fn under_memory_cap(name: &str, mib: u64) -> Result<bool> {
    if std::env::var_os("MULTIHEAD_UNDER_CAP").is_some() {
        return Ok(false);
    }
    let exe = std::env::current_exe()?;
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {} && exec \"$0\" --exact {name} --test-threads 1",
            mib * 1024
        ))
        .arg(exe)
        .env("MULTIHEAD_UNDER_CAP", "1")
        .output()?;
    assert!(
        out.status.success(),
        "{name} under a {mib} MiB cap: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(true)
}

/// Sizes far beyond the 364 KB file are refused from the config's
/// arithmetic before anything is built, within a 1.5 GiB address space.
#[test]
fn decoder_configs_larger_than_their_file_are_refused_before_building() -> Result<()> {
    if under_memory_cap(
        "decoder_configs_larger_than_their_file_are_refused_before_building",
        1536,
    )? {
        return Ok(());
    }
    let set = |pairs: Vec<(&'static str, serde_json::Value)>| {
        move |v: &mut serde_json::Value| {
            for (k, x) in pairs {
                v[k] = x;
            }
        }
    };
    let cases = [
        (
            "llama",
            "hidden",
            set(vec![
                ("hidden_size", 16_777_216.into()),
                ("num_attention_heads", 1.into()),
                ("num_key_value_heads", 1.into()),
            ]),
        ),
        (
            "llama",
            "inner",
            set(vec![("intermediate_size", 16_777_216.into())]),
        ),
        (
            "llama",
            "7b",
            set(vec![
                ("hidden_size", 4096.into()),
                ("intermediate_size", 11008.into()),
                ("num_hidden_layers", 32.into()),
                ("num_attention_heads", 32.into()),
                ("num_key_value_heads", 32.into()),
                ("head_dim", serde_json::Value::Null),
                ("vocab_size", 32000.into()),
            ]),
        ),
        ("gpt2", "embd", set(vec![("n_embd", 4_194_304.into())])),
    ];
    for (name, tag, edit) in cases {
        let dir = folder_with(name, tag, edit)?;
        let err = load_error(&dir);
        assert!(
            err.contains("Config describes a model of at least")
                && err.contains("larger than this file can hold"),
            "{name} {tag}: {err}"
        );
    }
    Ok(())
}

/// A config or weights file that is a device or a FIFO is
/// refused by name, not read until memory runs out or waited on.
#[test]
fn device_files_and_fifos_are_refused_without_reading() -> Result<()> {
    if under_memory_cap("device_files_and_fifos_are_refused_without_reading", 1024)? {
        return Ok(());
    }
    let dir = folder_with("llama", "devzero-config", |_| {})?;
    std::fs::remove_file(dir.join("config.json"))?;
    std::os::unix::fs::symlink("/dev/zero", dir.join("config.json"))?;
    let err = load_error(&dir);
    assert!(
        err.contains("config") && err.contains("not a regular file"),
        "{err}"
    );

    let dir = folder_with("llama", "devzero-weights", |_| {})?;
    std::fs::remove_file(dir.join("model.safetensors"))?;
    std::os::unix::fs::symlink("/dev/zero", dir.join("model.safetensors"))?;
    let err = load_error(&dir);
    assert!(
        err.contains("weights") && err.contains("not a regular file"),
        "{err}"
    );

    let dir = folder_with("llama", "fifo", |_| {})?;
    std::fs::remove_file(dir.join("config.json"))?;
    let made = Command::new("mkfifo").arg(dir.join("config.json")).status()?;
    assert!(made.success(), "mkfifo");
    let err = load_error(&dir);
    assert!(
        err.contains("not a regular file (a device, FIFO or socket)"),
        "{err}"
    );
    Ok(())
}

/// `(1, new, vocab)` logits of the decoder `dir` over `ids`.
fn logits(model: &DecoderModel, ids: &[u32]) -> Result<Tensor> {
    let ids = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
    Ok(model.forward(&ids, &mut model.new_cache(vec![]))?)
}

/// A window at least the sequence long is no window, in the
/// decoder (Mistral's `sliding_window` near `u64::MAX`) and in `sdpa` on
/// every path (`usize::MAX` gave all-zero attention).
#[test]
fn a_window_longer_than_the_sequence_is_no_window() -> Result<()> {
    let ids: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 128).collect();
    let none = DecoderModel::from_folder(
        &folder_with("mistral", "no-window", |v| {
            v["sliding_window"] = serde_json::Value::Null
        })?,
        &Device::Cpu,
    )?;
    let reference = logits(&none, &ids)?;
    let windowed = DecoderModel::from_folder(&fixture_dir("decoders").join("mistral"), &Device::Cpu)?;
    // The fixture's window of 4 changes the logits past position 4.
    assert!(max_abs_diff(&logits(&windowed, &ids)?, &reference)? > 1e-3);
    for (tag, w) in [
        ("max", u64::MAX),
        ("max-1", u64::MAX - 1),
        ("max-1e6", u64::MAX - 1_000_000),
        ("12", 12),
    ] {
        let model = DecoderModel::from_folder(
            &folder_with("mistral", tag, |v| v["sliding_window"] = w.into())?,
            &Device::Cpu,
        )?;
        let d = max_abs_diff(&logits(&model, &ids)?, &reference)?;
        assert!(d < 1e-5, "sliding_window {w}: {d}");
    }

    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (2, 3, 9, 8), &dev)?;
    let k = Tensor::randn(0f32, 1., (2, 3, 11, 8), &dev)?;
    let v = Tensor::randn(0f32, 1., (2, 3, 11, 8), &dev)?;
    for causal in [Causal::TopLeft, Causal::BottomRight] {
        let plain = Mask::causal(causal);
        for path in [AttnPath::Reference, AttnPath::CpuTiled, AttnPath::Auto] {
            let want = scaled_dot_product_attention_via(&q, &k, &v, &plain, None, path)?;
            for w in [11, 1 << 40, usize::MAX - 1, usize::MAX] {
                let got =
                    scaled_dot_product_attention_via(&q, &k, &v, &plain.clone().with_window(w), None, path)?;
                let d = max_abs_diff(&got, &want)?;
                assert!(d < 1e-6, "{causal:?} {path:?} window {w}: {d}");
            }
        }
    }
    Ok(())
}

/// Logits that overflow (MLP weights scaled by 1e30, or a rope factor of
/// 1e-300) are an error naming the step; a temperature whose division
/// overflows is refused at that step.
#[test]
fn non_finite_logits_and_overflowing_temperatures_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let dir = folder_with("llama", "huge-mlp", |_| {})?;
    let path = dir.join("model.safetensors");
    let tensors = candle::safetensors::load(&path, &dev)?
        .into_iter()
        .map(|(name, t)| {
            let t = if name.contains("mlp.") { (t * 1e30)? } else { t };
            Ok((name, t))
        })
        .collect::<candle::Result<std::collections::HashMap<_, _>>>()?;
    candle::safetensors::save(&tensors, &path)?;
    let tiny_rope =
        folder_with(
            "llama",
            "tiny-rope",
            |v| {
                v["rope_parameters"] =
                    serde_json::json!({"rope_type": "linear", "factor": 1e-300, "rope_theta": 50000.0})
            },
        )?;
    let cfg = GenerateConfig {
        max_len: 5,
        eos_id: 1,
        ..GenerateConfig::default()
    };
    for dir in [dir, tiny_rope] {
        let model = match DecoderModel::from_folder(&dir, &dev) {
            Ok(m) => m,
            // Refusing the config outright is as good as refusing its logits.
            Err(e) => {
                assert!(e.to_string().contains("factor"), "{}: {e}", dir.display());
                continue;
            }
        };
        let err = generate_from_prompts(&model, &[vec![5, 6, 7, 8]], 0, &cfg, &[])
            .map(|out| format!("{out:?}"))
            .expect_err("non-finite logits decoded");
        let err = err.to_string();
        assert!(
            err.contains("step 0") && err.contains("logits for row 0"),
            "{err}"
        );
    }
    let t = Temperature::new(1e-45)?;
    let mut scores = vec![-0.01f32, -5., f32::NEG_INFINITY];
    let ctx = StepContext {
        source: 0,
        prefix: &[],
        max_len: 4,
        logit_offset: 0.,
    };
    let err = t.process(&ctx, &mut scores).unwrap_err().to_string();
    assert!(err.contains("overflows f32"), "{err}");
    // A small temperature that does not overflow sharpens: the best stays.
    let mut scores = vec![-0.01f32, -5., f32::NEG_INFINITY];
    Temperature::new(1e-38)?.process(&ctx, &mut scores)?;
    assert!(scores[0].is_finite() && scores[1] == f32::NEG_INFINITY);
    Ok(())
}

/// A source samples the same whether it is decoded alone or in
/// a batch, given its index in the caller's list.
#[test]
fn sampling_follows_the_source_not_its_batch() -> Result<()> {
    let model = DecoderModel::from_folder(&fixture_dir("decoders").join("llama"), &Device::Cpu)?;
    let prompts = vec![vec![5u32, 6, 7, 8], vec![9, 10, 11, 12], vec![13, 14, 15, 16]];
    let cfg = GenerateConfig {
        max_len: 8,
        eos_id: 1,
        ..GenerateConfig::default()
    }
    .with_decoding(Decoding::Sample { seed: 42 })
    .with_num_return(3);
    let all = generate_from_prompts(&model, &prompts, 0, &cfg, &[])?;
    for (i, prompt) in prompts.iter().enumerate() {
        let alone = generate_from_prompts(
            &model,
            std::slice::from_ref(prompt),
            0,
            &cfg.clone().with_first_source(i),
            &[],
        )?;
        let tokens = |g: &[multihead_models::generation::Generated]| -> Vec<Vec<u32>> {
            g.iter().map(|h| h.tokens.clone()).collect()
        };
        assert_eq!(tokens(&alone[0]), tokens(&all[i]), "source {i}");
    }
    Ok(())
}

/// Malformed values are refused by name.
#[test]
fn malformed_values_are_refused() -> Result<()> {
    let config = |edit: &dyn Fn(&mut serde_json::Value)| -> Result<String> {
        let text = std::fs::read_to_string(fixture_dir("decoders").join("llama/config.json"))?;
        let mut v: serde_json::Value = serde_json::from_str(&text)?;
        edit(&mut v);
        Ok(v.to_string())
    };
    let err = |json: String| match HfDecoderConfig::from_json(&json, "config.json") {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e.to_string(),
    };
    let e = err(config(&|v| v["rope_parameters"]["rope_type"] = 5.into())?);
    assert!(
        e.contains("'rope_parameters.rope_type' must be a string, found 5"),
        "{e}"
    );
    let e = err(config(&|v| {
        v["model_type"] = "qwen2".into();
        v["use_sliding_window"] = "true".into();
    })?);
    assert!(e.contains("'use_sliding_window' must be true or false"), "{e}");

    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (1, 2, 4, 8), &dev)?;
    for scale in [1e300, 1e-300] {
        for path in [AttnPath::Reference, AttnPath::CpuTiled] {
            let e = scaled_dot_product_attention_via(&q, &q, &q, &Mask::new(), Some(scale), path)
                .unwrap_err()
                .to_string();
            assert!(e.contains("scale must be finite and > 0 as an f32"), "{e}");
        }
        let e = MultiheadAttention::new(
            &MhaConfig::new(8, 2).with_scale(scale),
            candle_nn::VarBuilder::zeros(DType::F32, &dev),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("scale must be finite and > 0 as an f32"), "{e}");
    }

    // Left padding longer than what is fed would hide every real token.
    let model = DecoderModel::from_folder(&fixture_dir("decoders").join("llama"), &dev)?;
    let mut cache = model.new_cache(vec![100]);
    let e = model
        .forward(&Tensor::new(&[[5u32, 6, 7]], &dev)?, &mut cache)
        .unwrap_err()
        .to_string();
    assert!(e.contains("100 positions of left padding but only 3"), "{e}");
    Ok(())
}

/// A prompt that leaves less room than `max_len` stops at the
/// context with its tokens kept (not an error after the work is done); one
/// longer than the context is refused before decoding, with both numbers.
#[test]
fn the_context_bounds_generation_before_it_starts() -> Result<()> {
    let model = DecoderModel::from_folder(&fixture_dir("decoders").join("gpt2"), &Device::Cpu)?;
    let prompt: Vec<u32> = (0..60).map(|i| (i * 5 + 1) % 128).collect();
    // Whatever the model picks, no step may feed a position past 63.
    let cfg = GenerateConfig {
        max_len: 10,
        eos_id: 0,
        ..GenerateConfig::default()
    };
    let out = generate_from_prompts(&model, std::slice::from_ref(&prompt), 0, &cfg, &[])?;
    let row = &out[0][0];
    // Positions 59..=63 are fed: five tokens at most, the last at 64.
    assert!(row.tokens.len() <= 5, "{row:?}");
    assert!(row.finished || row.tokens.len() == 5, "{row:?}");
    let long: Vec<u32> = vec![3; 65];
    let e = generate_from_prompts(&model, &[long], 0, &cfg, &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("65 tokens does not fit the model's context of 64"),
        "{e}"
    );
    Ok(())
}

/// An empty batch gives empty outputs on every path.
#[test]
fn empty_batches_give_empty_outputs_everywhere() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((0, 2, 4, 8), DType::F32, &dev)?;
    for path in [AttnPath::Reference, AttnPath::CpuTiled, AttnPath::Auto] {
        let out =
            scaled_dot_product_attention_via(&q, &q, &q, &Mask::causal(Causal::BottomRight), None, path)?;
        assert_eq!(out.dims(), [0, 2, 4, 8], "{path:?}");
    }
    let mha = MultiheadAttention::new(
        &MhaConfig::new(8, 2),
        candle_nn::VarBuilder::zeros(DType::F32, &dev),
    )?;
    let x = Tensor::zeros((0, 5, 8), DType::F32, &dev)?;
    assert_eq!(mha.forward(&x)?.dims(), [0, 5, 8]);
    for weights in [NeedWeights::Averaged, NeedWeights::PerHead] {
        let out = mha.forward_attn(&x, &x, &x, &MhaOptions::new().with_weights(weights))?;
        assert_eq!(out.output.dims(), [0, 5, 8], "{weights:?}");
    }
    let mut cache = KvCache::new(16);
    let out = mha.forward_cached(&x, &mut cache, &MhaOptions::new())?;
    assert_eq!(out.output.dims(), [0, 5, 8]);
    let model = DecoderModel::from_folder(&fixture_dir("decoders").join("llama"), &dev)?;
    let cfg = GenerateConfig {
        max_len: 4,
        eos_id: 1,
        ..GenerateConfig::default()
    };
    assert!(generate_from_prompts(&model, &[], 0, &cfg, &[])?.is_empty());
    let ids = Tensor::zeros((0, 3), DType::U32, &dev)?;
    let logits = model.forward(&ids, &mut model.new_cache(vec![]))?;
    assert_eq!(logits.dims(), [0, 3, 128]);
    Ok(())
}
