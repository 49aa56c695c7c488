//! `multihead inspect FILE.gguf` on the GGUF fixtures (`tests/fixtures/gguf`,
//! written by `scripts/make_gguf_fixtures.py`): the totals, tensor types
//! and config against what gguf-py and HF recorded when the files were
//! written (file sizes, tensor types, HF's config); a NaN is named by
//! tensor; tensors that do not fit the metadata's config fail the command
//! naming them; an architecture the loader does not run is a note, not a
//! failure.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use multihead_test_support::{
    cli::{arg, assert_one_line_error, has_raw_controls, success},
    fixtures::{fixture_dir, Fixture},
    gguf::gguf,
    multihead,
};
use serde_json::{json, Value};

/// What the fixture script recorded per model: HF's config and each
/// file's size and tensor types (the archs smollm3, olmo2, gemma2 and
/// gemma3 in a file of their own).
fn recorded() -> Result<Value> {
    let mut models = serde_json::Map::new();
    for file in ["expected.safetensors", "expected-archs.safetensors"] {
        let path = fixture_dir("gguf").join(file);
        let case = Fixture::load(&path, &candle::Device::Cpu)?.case;
        models.extend(case["models"].as_object().context("models")?.clone());
    }
    Ok(Value::Object(models))
}

/// `{arch}.context_length` as candle's own GGUF reader reads it.
fn context_length(path: &Path, arch: &str) -> Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let content = candle::quantized::gguf_file::Content::read(&mut f)?;
    let key = format!("{arch}.context_length");
    let value = content.metadata.get(&key).with_context(|| format!("no {key}"))?;
    Ok(u64::from(value.to_u32()?))
}

/// Every fixture's JSON: the file size and tensor types gguf-py recorded,
/// the tensors' bytes adding up to the total, the config keys equal to
/// HF's config, every value finite and every tensor matching the config.
#[test]
fn json_describes_every_fixture_as_it_was_written() -> Result<()> {
    let models = recorded()?;
    for (name, model) in models.as_object().context("models")? {
        let hf = &model["config"];
        for (ty, file) in model["files"].as_object().context("files")? {
            let what = format!("{name}-{ty}");
            let out = multihead!(&["inspect", "--json", arg(&gguf(name, ty))?])?;
            let v: Value = serde_json::from_str(&success(&out)?)?;
            assert_eq!(v["file_size"], file["bytes"], "{what}");
            assert_eq!(v["dtypes"], file["tensor_types"], "{what}");
            let types = file["tensor_types"].as_object().context("types")?;
            let count: u64 = types.values().filter_map(Value::as_u64).sum();
            assert_eq!(v["num_tensors"], count, "{what}");
            let tensors = v["tensors"].as_array().context("tensors")?;
            assert_eq!(tensors.len() as u64, count, "{what}");
            let bytes: u64 = tensors.iter().filter_map(|t| t["bytes"].as_u64()).sum();
            assert_eq!(v["total_bytes"], bytes, "{what}");
            assert_eq!(v["layout"]["architecture"], name.as_str(), "{what}");
            let meta = &v["layout"]["metadata"];
            for (key, hf_key) in [
                ("block_count", "num_hidden_layers"),
                ("attention.head_count", "num_attention_heads"),
                ("attention.head_count_kv", "num_key_value_heads"),
                ("embedding_length", "hidden_size"),
                ("vocab_size", "vocab_size"),
                ("feed_forward_length", "intermediate_size"),
            ] {
                assert_eq!(meta[key], hf[hf_key], "{what}: {key}");
            }
            // Gemma 3 gives each kind of layer its base; Gemma 2's
            // converter writes none (llama.cpp's 10000 is HF's).
            let rope = &hf["rope_parameters"];
            let (base, swa_base) = match name.as_str() {
                "gemma2" => (None, None),
                "gemma3" => (
                    rope["full_attention"]["rope_theta"].as_f64(),
                    rope["sliding_attention"]["rope_theta"].as_f64(),
                ),
                _ => (rope["rope_theta"].as_f64(), None),
            };
            assert_eq!(meta["rope.freq_base"].as_f64(), base, "{what}");
            let swa_key = format!("{name}.rope.freq_base_swa");
            assert_eq!(v["metadata"][&swa_key].as_f64(), swa_base, "{what}");
            let kind = match name.as_str() {
                "gemma2" | "gemma3" => "GemmaConfig from the GGUF metadata",
                _ => "LlamaConfig from the GGUF metadata",
            };
            assert_eq!(v["config"]["kind"], kind, "{what}");
            assert_eq!(
                meta["context_length"].as_u64(),
                Some(context_length(&gguf(name, ty), name)?),
                "{what}"
            );
            assert_eq!(v["non_finite"], json!([]), "{what}");
            assert_eq!(v["config"]["clean"], true, "{what}");
        }
    }
    Ok(())
}

/// The text output of the Q8_0 llama: a line per tensor, the totals with
/// the tensor types, the config line, the scan and the config check.
#[test]
fn text_lists_tensors_totals_and_config() -> Result<()> {
    let models = recorded()?;
    let (llama, hf) = (&models["llama"], &models["llama"]["config"]);
    let path = gguf("llama", "q8_0");
    let text = success(&multihead!(&["inspect", arg(&path)?])?)?;
    let lines: Vec<&str> = text.lines().collect();
    let types = llama["files"]["q8_0"]["tensor_types"]
        .as_object()
        .context("types")?;
    let count: u64 = types.values().filter_map(Value::as_u64).sum();
    // A header, a line per tensor (name, type, ...), then the totals.
    let n = count as usize;
    assert!(lines.len() > n + 1 && lines[0].starts_with("name "), "{text}");
    for line in &lines[1..=n] {
        let ty = line.split_whitespace().nth(1).unwrap_or_default();
        assert!(types.contains_key(ty), "{line}");
    }
    assert!(
        lines.contains(&"blk.0.attn_k.weight       Q8_0   [16, 32]              544 B"),
        "{text}"
    );
    let total = format!(
        "total: {count} tensors ({} F32, {} Q8_0)",
        types["F32"], types["Q8_0"]
    );
    assert!(lines[n + 1].starts_with(&total), "{total}\n{text}");
    assert!(lines.contains(&"layout: GGUF, architecture llama"), "{text}");
    let config = format!(
        "  layers {}, heads {}, kv heads {}, hidden {}, vocab {}, MLP {}, rope theta {}, context {}",
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
        hf["hidden_size"],
        hf["vocab_size"],
        hf["intermediate_size"],
        hf["rope_parameters"]["rope_theta"].as_f64().context("theta")?,
        context_length(&path, "llama")?
    );
    assert!(lines.contains(&config.as_str()), "{config}\n{text}");
    for line in [
        "metadata: general.architecture = \"llama\"",
        "weights: `multihead generate` keeps the matrices as q8_0 (the Q8_0 kernels)",
        "values: all finite",
        "config: LlamaConfig from the file's metadata",
        "  every tensor matches",
    ] {
        assert!(lines.contains(&line), "{line}\n{text}");
    }
    Ok(())
}

/// A copy of fixture `{name}-{ty}.gguf` with `edit` applied to its bytes.
fn edited(name: &str, ty: &str, tag: &str, edit: impl FnOnce(&mut Vec<u8>) -> Result<()>) -> Result<PathBuf> {
    let mut bytes = std::fs::read(gguf(name, ty))?;
    edit(&mut bytes)?;
    let path = std::env::temp_dir().join(format!(
        "multihead-inspect-gguf-{}-{tag}.gguf",
        std::process::id()
    ));
    std::fs::write(&path, bytes)?;
    Ok(path)
}

fn find(bytes: &[u8], what: &[u8]) -> Result<usize> {
    bytes
        .windows(what.len())
        .position(|w| w == what)
        .with_context(|| format!("no {:?}", String::from_utf8_lossy(what)))
}

/// A NaN patched into a tensor is named with its count (the inspection
/// succeeds, as for safetensors); a tensor renamed in the header is named
/// missing under its old name and unexpected under its new one, and the
/// command fails; a `--config` is refused for a GGUF file.
#[test]
fn problems_are_named() -> Result<()> {
    // One element of blk.0.attn_q.weight, found by the reader's range.
    let path = gguf("llama", "f32");
    let file = multihead::models::checkpoint::GgufFile::read(&path)?;
    let range = file
        .info("blk.0.attn_q.weight")
        .context("no blk.0.attn_q.weight")?
        .range
        .clone();
    let nan = edited("llama", "f32", "nan", |b| {
        b[range.start + 8..][..4].copy_from_slice(&f32::NAN.to_le_bytes());
        Ok(())
    })?;
    let out = multihead!(&["inspect", arg(&nan)?])?;
    let text = success(&out)?;
    assert!(
        text.lines()
            .any(|l| l == "values: blk.0.attn_q.weight has 1 NaN and 0 Inf"),
        "{text}"
    );
    let v: Value = serde_json::from_str(&success(&multihead!(&["inspect", "--json", arg(&nan)?])?)?)?;
    assert_eq!(
        v["non_finite"],
        json!([{"name": "blk.0.attn_q.weight", "nan": 1, "inf": 0}])
    );
    std::fs::remove_file(&nan)?;

    let renamed = edited("llama", "f32", "renamed", |b| {
        let at = find(b, b"blk.1.ffn_up.weight")?;
        b[at + 11] = b'q';
        Ok(())
    })?;
    let out = multihead!(&["inspect", arg(&renamed)?])?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_one_line_error(
        &out,
        &[
            arg(&renamed)?,
            "1 missing: blk.1.ffn_up.weight [64, 32]",
            "1 unexpected: blk.1.ffn_uq.weight",
        ],
    );
    assert!(
        text.contains("  missing     blk.1.ffn_up.weight [64, 32]"),
        "{text}"
    );
    assert!(text.contains("  unexpected  blk.1.ffn_uq.weight"), "{text}");
    std::fs::remove_file(&renamed)?;

    let out = multihead!(&["inspect", arg(&path)?, "--config", "config.json"])?;
    assert_one_line_error(&out, &["--config", "GGUF", "its metadata"]);
    Ok(())
}

/// An architecture this loader does not run: the listing and the metadata
/// still print, the config keys it cannot find show `?`, and a note says
/// why the metadata gives no config; the command succeeds.
#[test]
fn another_architecture_is_a_note() -> Result<()> {
    let other = edited("llama", "f32", "gemma", |b| {
        // The value follows the key, its type (u32) and its length (u64).
        let at = find(b, b"general.architecture")? + "general.architecture".len() + 12;
        anyhow::ensure!(&b[at..at + 5] == b"llama", "unexpected layout");
        b[at..at + 5].copy_from_slice(b"gemma");
        Ok(())
    })?;
    let text = success(&multihead!(&["inspect", arg(&other)?])?)?;
    std::fs::remove_file(&other)?;
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.contains(&"layout: GGUF, architecture gemma"), "{text}");
    assert!(
        lines.contains(
            &"  layers ?, heads ?, kv heads ?, hidden ?, vocab 384, MLP ?, rope theta ?, context ?"
        ),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("config: the file's metadata not used:")
                && l.contains("'gemma' is not supported")),
        "{text}"
    );
    Ok(())
}

/// Names, keys and strings from the file cannot drive the terminal: a
/// tensor name holding an ANSI escape, a key holding a C1 CSI (U+009B)
/// and a string value holding both print escaped (`\u{1b}`, `\u{9b}`) in
/// the listing, the metadata, the config check and the one-line error;
/// the JSON writes them as `\u` escapes and parses back to the file's
/// very names.
#[test]
fn control_characters_from_the_file_print_escaped() -> Result<()> {
    // Same lengths, so the layout stands: "ffn_u" (5 bytes) becomes
    // ESC [ 3 1 m, "iz" of general.size_label the 2 bytes of U+009B, and
    // general.name's "Llama" ESC [ J plus U+009B.
    let hostile = edited("llama", "f32", "escapes", |b| {
        let at = find(b, b"blk.1.ffn_up.weight")? + 6;
        b[at..at + 5].copy_from_slice(b"\x1b[31m");
        let at = find(b, b"general.size_label")? + 9;
        b[at..at + 2].copy_from_slice("\u{9b}".as_bytes());
        let at = find(b, b"Llama")?;
        b[at..at + 5].copy_from_slice("\x1b[J\u{9b}".as_bytes());
        Ok(())
    })?;
    let name = "blk.1.\u{1b}[31mp.weight";
    let key = "general.s\u{9b}e_label";

    let out = multihead!(&["inspect", arg(&hostile)?])?;
    assert!(
        !has_raw_controls(&out.stdout),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        !has_raw_controls(&out.stderr),
        "{:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for line in [
        r"blk.1.\u{1b}[31mp.weight  F32    [64, 32]",
        r"metadata: general.s\u{9b}e_label = ",
        r#"metadata: general.name = "\u{1b}[J\u{9b}""#,
        r"  unexpected  blk.1.\u{1b}[31mp.weight",
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
    assert_one_line_error(&out, &[r"1 unexpected: blk.1.\u{1b}[31mp.weight"]);

    let out = multihead!(&["inspect", "--json", arg(&hostile)?])?;
    std::fs::remove_file(&hostile)?;
    assert!(
        !has_raw_controls(&out.stdout),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let json = String::from_utf8(out.stdout.clone())?;
    assert!(json.contains(r"\u001b[31m") && json.contains(r"\u009b"), "{json}");
    let v: Value = serde_json::from_str(&json)?;
    let names: Vec<&str> = v["tensors"]
        .as_array()
        .context("tensors")?
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(names.contains(&name), "{names:?}");
    assert!(v["metadata"].get(key).is_some(), "{}", v["metadata"]);
    assert_eq!(v["metadata"]["general.name"], "\u{1b}[J\u{9b}");
    assert_eq!(v["config"]["unexpected"], json!([r"blk.1.\u{1b}[31mp.weight"]));
    Ok(())
}

/// A file llama.cpp refuses is refused here too, with one line naming the
/// file and the tensors: two tensor infos pointing at the same bytes (q's
/// 4 KiB from where k's 2 KiB start).
#[test]
fn overlapping_tensors_are_refused() -> Result<()> {
    // blk.0.attn_q.weight's offset (the u64 after its dims and type) set
    // to blk.0.attn_k.weight's.
    let overlapping = edited("llama", "f32", "overlap", |b| {
        let offset = |b: &[u8], name: &str| -> Result<usize> {
            // Name, u32 dim count, 2 u64 dims, u32 type, then the offset.
            Ok(find(b, name.as_bytes())? + name.len() + 4 + 16 + 4)
        };
        let k_at = offset(b, "blk.0.attn_k.weight")?;
        let k_offset: [u8; 8] = b[k_at..k_at + 8].try_into()?;
        let q_at = offset(b, "blk.0.attn_q.weight")?;
        b[q_at..q_at + 8].copy_from_slice(&k_offset);
        Ok(())
    })?;
    let out = multihead!(&["inspect", arg(&overlapping)?])?;
    std::fs::remove_file(&overlapping)?;
    assert_one_line_error(
        &out,
        &[
            arg(&overlapping)?,
            "'blk.0.attn_q.weight'",
            "'blk.0.attn_k.weight'",
            "overlap",
        ],
    );
    Ok(())
}

/// A `llama-quantize` file: its block formats by name, and the line saying
/// `generate` keeps each matrix in the format it is stored in.
#[test]
fn a_k_quant_file_lists_its_formats_and_how_it_loads() -> Result<()> {
    let text = success(&multihead!(&["inspect", arg(&gguf("llama256", "q4_k_m"))?])?)?;
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("total: 12 tensors (3 F32, 6 Q4_K, 3 Q6_K)")),
        "{text}"
    );
    assert!(
        lines.contains(&"weights: `multihead generate` keeps the matrices as ggml (each in the block format it is stored in)"),
        "{text}"
    );
    Ok(())
}
