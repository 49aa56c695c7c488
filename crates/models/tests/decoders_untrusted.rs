//! Hostile or broken decoder folders: each gets one clear error naming the
//! file and the field, never a panic or a model that runs wrong.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle::{Device, Tensor};
use multihead_models::checkpoint::{LoadOptions, WeightDtype};
use multihead_models::decoder::{CausalLm, DecoderModel, HfDecoderConfig};
use multihead_test_support::{compare::max_abs_diff, fixtures::fixture_dir, scratch_dir};

fn config_error(json: &str) -> String {
    match HfDecoderConfig::from_json(json, "config.json") {
        Ok(cfg) => panic!("accepted {json}: {cfg:?}"),
        Err(e) => e.to_string(),
    }
}

/// The Llama fixture's config with `edit` applied.
fn llama_with(edit: impl FnOnce(&mut serde_json::Value)) -> Result<String> {
    let text = std::fs::read_to_string(fixture_dir("decoders").join("llama/config.json"))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    edit(&mut v);
    Ok(v.to_string())
}

/// The SmolLM3 fixture's config with `edit` applied.
fn smollm3_with(edit: impl FnOnce(&mut serde_json::Value)) -> Result<String> {
    let text = std::fs::read_to_string(fixture_dir("decoders").join("smollm3/config.json"))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    edit(&mut v);
    Ok(v.to_string())
}

/// SmolLM3's layers without rotary come from `no_rope_layers`, or, where
/// it is absent, from every `no_rope_layer_interval`-th layer (default 4),
/// as `SmolLM3Config` fills them in; its defaults (rope_theta 2e6, tied
/// embeddings) where Llama's differ.
#[test]
fn smollm3_reads_its_layers_without_rotary() -> Result<()> {
    let rotary = |json: &str| -> Result<Vec<bool>> {
        match HfDecoderConfig::from_json(json, "config.json")? {
            HfDecoderConfig::Llama(c) => Ok((0..c.num_hidden_layers).map(|i| c.rotary_at(i)).collect()),
            other => anyhow::bail!("not a Llama config: {other:?}"),
        }
    };
    assert_eq!(rotary(&smollm3_with(|_| {})?)?, [false, true]);
    // A longer list than the layers, and booleans, as Python reads them.
    let json = smollm3_with(|v| v["no_rope_layers"] = serde_json::json!([true, false, 1]))?;
    assert_eq!(rotary(&json)?, [true, false]);
    let without = |keys: &'static [&'static str], layers: u64, interval: Option<u64>| {
        smollm3_with(|v| {
            if let Some(o) = v.as_object_mut() {
                for k in keys {
                    o.remove(*k);
                }
            }
            v["num_hidden_layers"] = layers.into();
            if let Some(i) = interval {
                v["no_rope_layer_interval"] = i.into();
            }
        })
    };
    let json = without(
        &["no_rope_layers", "no_rope_layer_interval", "layer_types"],
        8,
        None,
    )?;
    assert_eq!(rotary(&json)?, [true, true, true, false, true, true, true, false]);
    let json = without(
        &[
            "no_rope_layers",
            "layer_types",
            "rope_parameters",
            "tie_word_embeddings",
        ],
        4,
        Some(2),
    )?;
    assert_eq!(rotary(&json)?, [true, false, true, false]);
    match HfDecoderConfig::from_json(&json, "config.json")? {
        HfDecoderConfig::Llama(c) => {
            assert_eq!(c.theta(), 2e6);
            assert!(c.tie_word_embeddings);
        }
        other => anyhow::bail!("not a Llama config: {other:?}"),
    }
    // A Llama config has rotary on every layer.
    assert_eq!(rotary(&llama_with(|_| {})?)?, [true, true]);
    Ok(())
}

/// The Phi-3 fixture's config with `edit` applied.
fn phi3_with(edit: impl FnOnce(&mut serde_json::Value)) -> Result<String> {
    let text = std::fs::read_to_string(fixture_dir("decoders").join("phi3/config.json"))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    edit(&mut v);
    Ok(v.to_string())
}

/// Phi-3's rotary as `Phi3Config` reads it: `su` and `yarn` are names of
/// `longrope`; the top-level `original_max_position_embeddings` wins over
/// the scaling's own; the attention factor is `sqrt(1 + ln(factor) /
/// ln(original))` with factor `max_position_embeddings / original`, or
/// the scaling's `factor` or `attention_factor`; partial_rotary_factor
/// from the scaling, else the top level.
#[test]
fn phi3_reads_longrope_as_hf() -> Result<()> {
    use multihead_attention::RopeScaling;
    let longrope = |json: &str| -> Result<(Option<usize>, usize, f64)> {
        let HfDecoderConfig::Llama(c) = HfDecoderConfig::from_json(json, "config.json")? else {
            anyhow::bail!("not a Llama config")
        };
        match c.rope_scaling {
            Some(RopeScaling::LongRope {
                original_max_position_embeddings,
                attention_factor,
                ..
            }) => Ok((c.rotary_dims, original_max_position_embeddings, attention_factor)),
            other => anyhow::bail!("not LongRoPE: {other:?}"),
        }
    };
    let (dims, original, factor) = longrope(&phi3_with(|_| {})?)?;
    assert_eq!((dims, original), (Some(12), 2));
    assert!((factor - 2f64.sqrt()).abs() < 1e-12, "{factor}");
    for name in ["su", "yarn"] {
        let json = phi3_with(|v| v["rope_parameters"]["rope_type"] = name.into())?;
        assert_eq!(longrope(&json)?.1, 2, "{name}");
    }
    let json = phi3_with(|v| {
        v["original_max_position_embeddings"] = 4096.into();
        v["max_position_embeddings"] = 131072.into();
        v["rope_parameters"]["original_max_position_embeddings"] = 7.into();
    })?;
    let (_, original, factor) = longrope(&json)?;
    assert_eq!(original, 4096);
    // Phi-3.5-mini's: sqrt(1 + ln(32) / ln(4096)).
    assert!((factor - (1. + 32f64.ln() / 4096f64.ln()).sqrt()).abs() < 1e-12);
    let json = phi3_with(|v| v["rope_parameters"]["factor"] = 4.0.into())?;
    assert!((longrope(&json)?.2 - 3f64.sqrt()).abs() < 1e-12);
    let json = phi3_with(|v| v["rope_parameters"]["attention_factor"] = 1.5.into())?;
    assert_eq!(longrope(&json)?.2, 1.5);
    // Without the scaling's value, the top level's.
    let json = phi3_with(|v| {
        if let Some(p) = v["rope_parameters"].as_object_mut() {
            p.remove("partial_rotary_factor");
        }
    })?;
    assert_eq!(longrope(&json)?.0, Some(12));
    Ok(())
}

#[test]
fn bad_phi3_configs_name_the_file_and_field() -> Result<()> {
    let cases: Vec<(String, &str)> = vec![
        (
            phi3_with(|v| v["rope_parameters"]["rope_type"] = "llama3".into())?,
            "rope_parameters.rope_type 'llama3' is not one Phi-3 runs",
        ),
        (
            phi3_with(|v| v["rope_parameters"]["short_factor"] = serde_json::json!([1.0, 2.0]))?,
            "field 'rope_parameters': RopeScaling: short_factor has 2 entries and long_factor 6",
        ),
        (
            phi3_with(|v| {
                v["rope_parameters"]["short_factor"] = serde_json::json!([1.0, 2.0]);
                v["rope_parameters"]["long_factor"] = serde_json::json!([1.0, 2.0]);
            })?,
            "field 'short_factor' of 'rope_scaling' (or 'rope_parameters') has 2 entries; it needs one per rotated pair of dims, 6",
        ),
        (
            phi3_with(|v| v["rope_parameters"]["long_factor"] = serde_json::json!([1, 2, 3, "4", 5, 6]))?,
            "field 'rope_parameters.long_factor' must be a list of numbers",
        ),
        (
            phi3_with(|v| {
                if let Some(p) = v["rope_parameters"].as_object_mut() {
                    p.remove("short_factor");
                }
            })?,
            "field 'rope_parameters.short_factor' is missing",
        ),
        (
            phi3_with(|v| v["rope_parameters"]["long_factor"][2] = 0.0.into())?,
            "every long_factor must be finite and > 0, found 0",
        ),
        (
            phi3_with(|v| v["rope_parameters"]["partial_rotary_factor"] = 0.7.into())?,
            "field 'rope_parameters.partial_rotary_factor' (0.7) rotates 11 of each head's 16 dims",
        ),
        (
            phi3_with(|v| v["partial_rotary_factor"] = 1.5.into())?,
            "field 'partial_rotary_factor' must be a number in (0, 1]",
        ),
        (
            phi3_with(|v| v["original_max_position_embeddings"] = 0.into())?,
            "field 'original_max_position_embeddings' must be a whole number in 1..=",
        ),
        (
            llama_with(|v| {
                v["rope_parameters"] = serde_json::json!({"rope_type": "longrope", "short_factor": [1.0],
                    "long_factor": [1.0], "original_max_position_embeddings": 8})
            })?,
            "rope_parameters.rope_type 'longrope' is not supported",
        ),
    ];
    for (json, want) in cases {
        let err = config_error(&json);
        assert!(err.starts_with("config.json: "), "{err}");
        assert!(err.contains(want), "expected {want:?} in {err:?}");
    }
    Ok(())
}

#[test]
fn bad_configs_name_the_file_and_field() -> Result<()> {
    let cases: Vec<(String, &str)> = vec![
        ("not json".into(), "config.json: not valid JSON"),
        ("{}".into(), "no field 'model_type'"),
        (r#"{"model_type": 3}"#.into(), "'model_type' must be a string"),
        (
            r#"{"model_type": "bert"}"#.into(),
            "model_type 'bert' is not a decoder this crate runs (gpt2, llama, mistral, qwen2, qwen3, smollm3, olmo2, phi3, gemma2, gemma3_text, gemma3)",
        ),
        (
            r#"{"model_type": "gpt2", "n_embd": 64}"#.into(),
            "missing field `vocab_size`",
        ),
        (
            llama_with(|v| v["hidden_size"] = "64".into())?,
            "invalid type: string \"64\", expected usize",
        ),
        (
            llama_with(|v| v["num_key_value_heads"] = 3.into())?,
            "must be a multiple of num_key_value_heads (3)",
        ),
        (
            llama_with(|v| v["vocab_size"] = 0.into())?,
            "field 'vocab_size' must be in 1..=",
        ),
        (
            llama_with(|v| v["num_hidden_layers"] = (1u64 << 40).into())?,
            "field 'num_hidden_layers' must be in",
        ),
        (
            llama_with(|v| v["head_dim"] = 0.into())?,
            "field 'head_dim' must be in 1..=",
        ),
        (
            llama_with(|v| v["rms_norm_eps"] = (-1.0).into())?,
            "field 'rms_norm_eps' must be in (0, 1)",
        ),
        (
            llama_with(|v| v["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0}))?,
            "rope_parameters.rope_type 'yarn' is not supported",
        ),
        (
            llama_with(|v| {
                v["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "rope_theta": 5e5})
            })?,
            "field 'rope_parameters.original_max_position_embeddings' is missing",
        ),
        (
            llama_with(|v| {
                v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0, "original_max_position_embeddings": 8192})
            })?,
            "high_freq_factor (1) must exceed low_freq_factor (4)",
        ),
        (
            llama_with(|v| {
                v["model_type"] = "qwen2".into();
                v["use_sliding_window"] = true.into();
            })?,
            "use_sliding_window true",
        ),
        (
            llama_with(|v| v["rope_parameters"] = serde_json::json!({"rope_theta": "big"}))?,
            "'rope_parameters.rope_theta' must be a number",
        ),
        (
            llama_with(|v| v["hidden_act"] = "gelu".into())?,
            "hidden_act 'gelu' is not supported",
        ),
        (
            llama_with(|v| v["sliding_window"] = 0.into())?,
            "'sliding_window' must be >= 1",
        ),
        (
            smollm3_with(|v| v["use_sliding_window"] = true.into())?,
            "field 'use_sliding_window' is true",
        ),
        (
            smollm3_with(|v| v["layer_types"][1] = "sliding_attention".into())?,
            "field 'layer_types' holds \"sliding_attention\"",
        ),
        (
            smollm3_with(|v| {
                if let Some(o) = v.as_object_mut() {
                    o.remove("no_rope_layers");
                }
                v["num_hidden_layers"] = (1u64 << 40).into();
            })?,
            "field 'num_hidden_layers' must be in 1..=",
        ),
        (
            smollm3_with(|v| v["no_rope_layers"] = serde_json::json!([1]))?,
            "field 'no_rope_layers' must be a list of 0 or 1 for each of the 2 layers",
        ),
        (
            smollm3_with(|v| v["no_rope_layers"][1] = 2.into())?,
            "field 'no_rope_layers' entry 1 must be 0 or 1",
        ),
        (
            smollm3_with(|v| {
                if let Some(o) = v.as_object_mut() {
                    o.remove("no_rope_layers");
                }
                v["no_rope_layer_interval"] = 0.into();
            })?,
            "field 'no_rope_layer_interval' must be a whole number >= 1",
        ),
    ];
    for (json, want) in cases {
        let err = config_error(&json);
        assert!(err.starts_with("config.json: "), "{err}");
        assert!(err.contains(want), "expected '{want}' in: {err}");
    }
    Ok(())
}

/// A copy of a fixture folder in a scratch folder, with `edit` applied.
/// `tag` keeps the folders of tests running in parallel apart.
fn folder_with(name: &str, tag: &str, edit: impl FnOnce(&Path) -> Result<()>) -> Result<std::path::PathBuf> {
    let src = fixture_dir("decoders").join(name);
    let dir = scratch_dir!(format!("{name}-{tag}"))?;
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(file), dir.join(file))?;
    }
    edit(&dir)?;
    Ok(dir)
}

#[test]
fn qwen2_reads_its_window_switch_and_biases() -> Result<()> {
    // Real Qwen2.5 configs carry a sliding_window that use_sliding_window
    // false switches off.
    let json = llama_with(|v| {
        v["model_type"] = "qwen2".into();
        v["sliding_window"] = 32768.into();
        v["use_sliding_window"] = false.into();
    })?;
    match HfDecoderConfig::from_json(&json, "config.json")? {
        HfDecoderConfig::Llama(cfg) => {
            assert_eq!(cfg.sliding_window, None);
            assert!(cfg.qkv_bias);
        }
        other => panic!("read as {other:?}"),
    }
    Ok(())
}

#[test]
fn a_config_that_disagrees_with_the_weights_is_refused_with_the_tensor() -> Result<()> {
    // One more kv head than the weights hold: k_proj is (32, 64), not (64, 64).
    let dir = folder_with("llama", "kv-heads", |d| {
        let text = std::fs::read_to_string(d.join("config.json"))?;
        std::fs::write(
            d.join("config.json"),
            text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4"),
        )?;
        Ok(())
    })?;
    let err = DecoderModel::from_folder(&dir, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("k_proj.weight") && err.contains("[32, 64]"), "{err}");
    std::fs::remove_dir_all(&dir)?;
    // No weights at all; a pickle in their place gets the export command.
    let dir = folder_with("gpt2", "pickle", |d| {
        std::fs::remove_file(d.join("model.safetensors"))?;
        std::fs::write(d.join("pytorch_model.bin"), b"PK\x03\x04 not really")?;
        Ok(())
    })?;
    let err = DecoderModel::from_folder(&dir, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("pickle") && err.contains("save_file"), "{err}");
    // Each tensor copied, as a tied model's shared table needs.
    assert!(err.contains("v.contiguous().clone()"), "{err}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn a_sharded_folder_loads_as_the_single_file_does() -> Result<()> {
    // The Llama fixture split in two shards with an index, as
    // save_pretrained writes a model past its max_shard_size.
    let dev = Device::Cpu;
    let src = fixture_dir("decoders").join("llama");
    let bytes = std::fs::read(src.join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let dir = folder_with("llama", "sharded", |d| {
        std::fs::remove_file(d.join("model.safetensors"))?;
        let mut weight_map = serde_json::Map::new();
        for (i, part) in names.chunks(names.len().div_ceil(2)).enumerate() {
            let file = format!("model-0000{}-of-00002.safetensors", i + 1);
            let views: Vec<(String, safetensors::tensor::TensorView)> = part
                .iter()
                .map(|n| Ok((n.clone(), st.tensor(n)?)))
                .collect::<Result<_>>()?;
            safetensors::serialize_to_file(views, None, &d.join(&file))?;
            for n in part {
                weight_map.insert(n.clone(), file.clone().into());
            }
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(d.join("model.safetensors.index.json"), index.to_string())?;
        Ok(())
    })?;
    let sharded = DecoderModel::from_folder(&dir, &dev)?;
    let single = DecoderModel::from_folder(&src, &dev)?;
    let ids = Tensor::new(&[[3u32, 1, 4, 1, 5]], &dev)?;
    let a = sharded.forward(&ids, &mut sharded.new_cache(vec![]))?;
    let b = single.forward(&ids, &mut single.new_cache(vec![]))?;
    assert_eq!(max_abs_diff(&a, &b)?, 0.);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn bad_token_ids_and_overlong_contexts_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let gpt2 = DecoderModel::from_folder(&fixture_dir("decoders").join("gpt2"), &dev)?;
    let mut cache = gpt2.new_cache(vec![]);
    let err = gpt2
        .forward(&Tensor::new(&[[5u32, 128]], &dev)?, &mut cache)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("token id 128 is out of the vocabulary (128 tokens)"),
        "{err}"
    );
    // n_positions is 64: the 65th position has no embedding.
    let long = Tensor::zeros((1, 65), candle::DType::U32, &dev)?;
    let err = gpt2
        .forward(&long, &mut gpt2.new_cache(vec![]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("position 64 is past the context of 64"), "{err}");
    Ok(())
}

/// Rewrites `dir/model.safetensors` with `edit` applied to its tensors.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>) -> Result<()>) -> Result<()> {
    let path = dir.join("model.safetensors");
    let mut tensors = candle::safetensors::load(&path, &Device::Cpu)?;
    edit(&mut tensors)?;
    candle::safetensors::save(&tensors, &path)?;
    Ok(())
}

/// The logits of `model` for one fixed prompt.
fn logits(model: &DecoderModel) -> Result<Tensor> {
    let ids = Tensor::new(&[[3u32, 1, 4, 1, 5, 9]], &Device::Cpu)?;
    Ok(model.forward(&ids, &mut model.new_cache(vec![]))?)
}

/// A tied model exported from a `.bin` with its tensors copied (what the
/// pickle error's command does: `save_file` refuses shared memory) holds
/// `lm_head.weight` besides the embedding. HF transformers ties the two
/// where they are equal and keeps the head's own weight where they
/// differ; so does the loader, for Llama and GPT-2 alike.
#[test]
fn a_tied_model_s_file_may_hold_its_head_as_hf_reads_it() -> Result<()> {
    for (name, embedding) in [
        ("mistral", "model.embed_tokens.weight"),
        ("gpt2", "transformer.wte.weight"),
    ] {
        let tied = DecoderModel::from_folder(&fixture_dir("decoders").join(name), &Device::Cpu)?;
        let with_head = |tag: &str, scale: f64| {
            folder_with(name, tag, |d| {
                edit_weights(d, |t| {
                    let head = t.get(embedding).context("the embedding")?.affine(scale, 0.)?;
                    t.insert("lm_head.weight".into(), head);
                    Ok(())
                })
            })
        };
        // The embedding's copy: the same model.
        let dir = with_head("tied-copy", 1.)?;
        let copy = DecoderModel::from_folder(&dir, &Device::Cpu)?;
        assert_eq!(max_abs_diff(&logits(&copy)?, &logits(&tied)?)?, 0., "{name}");
        std::fs::remove_dir_all(&dir)?;
        // Another head: the model untied, as if the config said so.
        let dir = with_head("tied-other", 2.)?;
        let other = logits(&DecoderModel::from_folder(&dir, &Device::Cpu)?)?;
        let text = std::fs::read_to_string(dir.join("config.json"))?;
        std::fs::write(
            dir.join("config.json"),
            text.replace("\"tie_word_embeddings\": true", "\"tie_word_embeddings\": false"),
        )?;
        let untied = logits(&DecoderModel::from_folder(&dir, &Device::Cpu)?)?;
        assert_eq!(max_abs_diff(&other, &untied)?, 0., "{name}");
        assert!(max_abs_diff(&other, &logits(&tied)?)? > 1e-3, "{name}");
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}

/// A weight past f16's largest value (65504) would load as infinity
/// under `--dtype f16`, and the first step would fail far from the cause:
/// the load refuses it, naming the file, the tensor, its largest value and
/// the dtypes that hold it. bf16 and f32 load it; a vector (a norm), which
/// stays f32 whatever the matrices' dtype, is not refused.
#[test]
fn weights_past_f16_s_range_are_refused_when_loading_as_f16() -> Result<()> {
    let dir = folder_with("llama", "past-f16", |d| {
        edit_weights(d, |t| {
            let name = "model.layers.1.mlp.down_proj.weight";
            let w = t.get(name).context(name)?;
            let big = (w.ones_like()? * 1e5)?;
            let mask = Tensor::zeros(w.dims(), candle::DType::U8, &Device::Cpu)?.slice_assign(
                &[0..1, 0..2],
                &Tensor::ones((1, 2), candle::DType::U8, &Device::Cpu)?,
            )?;
            let w = mask.where_cond(&big, w)?;
            t.insert(name.into(), w);
            Ok(())
        })
    })?;
    let load = |dir: &Path, dtype| {
        let opts = LoadOptions {
            dtype,
            ..LoadOptions::default()
        };
        DecoderModel::from_folder_with(dir, &Device::Cpu, &opts)
    };
    let err = load(&dir, WeightDtype::F16).unwrap_err().to_string();
    for want in [
        &dir.join("model.safetensors").display().to_string()[..],
        "model.layers.1.mlp.down_proj.weight: 2 values up to 100000, past f16's largest 65504",
        "bf16 or f32 hold them",
    ] {
        assert!(err.contains(want), "no {want:?} in {err}");
    }
    for dtype in [WeightDtype::Bf16, WeightDtype::F32] {
        load(&dir, dtype)?;
    }
    std::fs::remove_dir_all(&dir)?;
    let dir = folder_with("llama", "norm-past-f16", |d| {
        edit_weights(d, |t| {
            let name = "model.norm.weight";
            let w = (t.get(name).context(name)?.ones_like()? * 1e5)?;
            t.insert(name.into(), w);
            Ok(())
        })
    })?;
    load(&dir, WeightDtype::F16)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
