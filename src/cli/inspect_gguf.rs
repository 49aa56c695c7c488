//! `multihead inspect FILE.gguf`: what a GGUF file holds, the config its
//! metadata describes, and whether its tensors fit that config, in the
//! form `inspect` gives a safetensors file.
//!
//! Names, keys and strings come from the file, untrusted: the text output
//! shows them through `str::escape_debug` (strings quoted, as `{:?}`), and
//! the JSON output writes every control character as a `\u` escape
//! ([`terminal_safe`]), so no byte of the file can drive the terminal.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Result};
use candle::quantized::gguf_file::Value;
use multihead::models::checkpoint::{ggml_type_name, GgufFile, NonFinite, Preflight, WeightDtype};
use multihead::models::decoder::{DecoderModel, HfDecoderConfig};

use super::inspect::{human_bytes, more, print_report, print_tensors};

/// Longest string metadata value the text output prints whole (a chat
/// template runs to kilobytes).
const SHOWN_CHARS: usize = 80;

/// Longest array the output lists (a tokenizer's tokens run to 150,000).
const SHOWN_ITEMS: usize = 8;

/// The metadata keys that make a decoder's config, after `{arch}.`, with
/// the names the text output gives them.
const CONFIG_KEYS: [(&str, &str); 8] = [
    ("layers", "block_count"),
    ("heads", "attention.head_count"),
    ("kv heads", "attention.head_count_kv"),
    ("hidden", "embedding_length"),
    ("vocab", "vocab_size"),
    ("MLP", "feed_forward_length"),
    ("rope theta", "rope.freq_base"),
    ("context", "context_length"),
];

/// The config the metadata describes (its type's name: `LlamaConfig`,
/// `GemmaConfig`), and the file's tensors compared with it; or why the
/// metadata gives none this loader runs.
enum ConfigCheck {
    Checked(&'static str, Preflight),
    Unusable(String),
}

/// One row of the tensor list, as the safetensors listing has it.
struct Row<'a> {
    /// Escaped for the text output.
    shown: String,
    name: &'a str,
    dtype: &'static str,
    shape: &'a [usize],
    bytes: usize,
}

/// Runs `inspect` on the GGUF file `path`: the listing, the metadata, the
/// config and the NaN/Inf scan of every tensor; fails where the tensors do
/// not fit the config the metadata describes.
pub fn run(path: &Path, json: bool, all: bool) -> Result<()> {
    let file = GgufFile::read(path)?;
    let non_finite: Vec<NonFinite> = file
        .non_finite(file.tensors().iter().map(|t| t.name.as_str()))?
        .into_iter()
        .map(|(name, nan, inf)| NonFinite { name, nan, inf })
        .collect();
    let check = match DecoderModel::gguf_preflight(&file) {
        Ok((cfg, report)) => ConfigCheck::Checked(config_kind(&cfg), report),
        Err(e) => ConfigCheck::Unusable(e.to_string().lines().next().unwrap_or_default().to_string()),
    };
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if json {
        print_json(&mut out, &file, &non_finite, &check)?;
    } else {
        let limit = if all { usize::MAX } else { super::inspect::LISTED };
        print_text(&mut out, limit, &file, &non_finite, &check)?;
    }
    out.flush()?;
    if let ConfigCheck::Checked(_, report) = &check {
        if let Some(summary) = report.summary() {
            bail!(
                "'{}' does not fit the config its metadata describes: {summary}",
                file.label()
            )
        }
    }
    Ok(())
}

/// The name of the config type `cfg` holds.
fn config_kind(cfg: &HfDecoderConfig) -> &'static str {
    match cfg {
        HfDecoderConfig::Gpt2(_) => "Gpt2Config",
        HfDecoderConfig::Llama(_) => "LlamaConfig",
        HfDecoderConfig::Gemma(_) => "GemmaConfig",
    }
}

fn rows(file: &GgufFile) -> Vec<Row<'_>> {
    file.tensors()
        .iter()
        .map(|t| Row {
            shown: t.name.escape_debug().to_string(),
            name: &t.name,
            dtype: ggml_type_name(t.ggml_type),
            shape: &t.shape,
            bytes: t.range.len(),
        })
        .collect()
}

fn dtype_counts(file: &GgufFile) -> BTreeMap<&'static str, usize> {
    let mut counts = BTreeMap::new();
    for t in file.tensors() {
        *counts.entry(ggml_type_name(t.ggml_type)).or_insert(0) += 1;
    }
    counts
}

/// Elements over all tensors (saturating: the reader checked each
/// tensor's product, not their sum).
fn total_params(file: &GgufFile) -> usize {
    file.tensors()
        .iter()
        .fold(0usize, |n, t| n.saturating_add(t.shape.iter().product()))
}

fn architecture(file: &GgufFile) -> Option<&str> {
    match file.get("general.architecture") {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

/// Each of [`CONFIG_KEYS`] (its label and key) with its value, `show`n
/// from the metadata; the vocabulary `count`ed from `token_embd.weight`'s
/// rows where no key gives it (llama.cpp's converter often writes none).
fn config_values<T>(
    file: &GgufFile,
    show: impl Fn(&Value) -> T,
    count: impl Fn(usize) -> T,
) -> Vec<(&'static str, &'static str, Option<T>)> {
    let arch = architecture(file);
    CONFIG_KEYS
        .iter()
        .map(|&(label, key)| {
            let stored = arch.and_then(|a| file.get(&format!("{a}.{key}")));
            let value = match (key, stored) {
                (_, Some(v)) => Some(show(v)),
                ("vocab_size", None) => file
                    .info("token_embd.weight")
                    .and_then(|t| t.shape.first())
                    .map(|&n| count(n)),
                (_, None) => None,
            };
            (label, key, value)
        })
        .collect()
}

/// A metadata value in a line: numbers and booleans as written, strings
/// quoted (the first [`SHOWN_CHARS`] characters), arrays listed up to
/// [`SHOWN_ITEMS`] items, counted past that.
fn show(v: &Value) -> String {
    match v {
        Value::U8(n) => n.to_string(),
        Value::I8(n) => n.to_string(),
        Value::U16(n) => n.to_string(),
        Value::I16(n) => n.to_string(),
        Value::U32(n) => n.to_string(),
        Value::I32(n) => n.to_string(),
        Value::U64(n) => n.to_string(),
        Value::I64(n) => n.to_string(),
        Value::F32(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::String(s) if s.chars().count() > SHOWN_CHARS => format!(
            "{:?}… ({} characters)",
            s.chars().take(SHOWN_CHARS).collect::<String>(),
            s.chars().count()
        ),
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) if items.len() > SHOWN_ITEMS => format!("[{} values]", items.len()),
        Value::Array(items) => format!("[{}]", items.iter().map(show).collect::<Vec<_>>().join(", ")),
    }
}

/// A metadata value in the JSON output: scalars as JSON values, strings
/// whole, arrays of more than [`SHOWN_ITEMS`] items as `{"len": N}`.
fn json_value(v: &Value) -> serde_json::Value {
    use serde_json::json;
    match v {
        Value::U8(n) => json!(n),
        Value::I8(n) => json!(n),
        Value::U16(n) => json!(n),
        Value::I16(n) => json!(n),
        Value::U32(n) => json!(n),
        Value::I32(n) => json!(n),
        Value::U64(n) => json!(n),
        Value::I64(n) => json!(n),
        // The decimal it was written from (`1e-6`, not `9.99999997e-7`).
        Value::F32(x) => x.to_string().parse::<f64>().map_or(json!(null), |x| json!(x)),
        Value::F64(x) => json!(x),
        Value::Bool(b) => json!(b),
        Value::String(s) => json!(s),
        Value::Array(items) if items.len() > SHOWN_ITEMS => json!({ "len": items.len() }),
        Value::Array(items) => serde_json::Value::Array(items.iter().map(json_value).collect()),
    }
}

fn print_text(
    out: &mut impl Write,
    limit: usize,
    file: &GgufFile,
    non_finite: &[NonFinite],
    check: &ConfigCheck,
) -> Result<()> {
    let rows = rows(file);
    print_tensors(
        out,
        rows.iter()
            .map(|t| (t.shown.as_str(), t.dtype, t.shape, t.bytes))
            .collect(),
        limit,
    )?;
    let dtypes: Vec<String> = dtype_counts(file)
        .iter()
        .map(|(d, n)| format!("{n} {d}"))
        .collect();
    writeln!(
        out,
        "total: {} tensors ({}), {} parameters, {} of data, file {}",
        rows.len(),
        dtypes.join(", "),
        total_params(file),
        human_bytes(rows.iter().map(|t| t.bytes).sum()),
        human_bytes(file.file_size()),
    )?;
    let keys = file.keys();
    for k in keys.iter().take(limit) {
        if let Some(v) = file.get(k) {
            writeln!(out, "metadata: {} = {}", k.escape_debug(), show(v))?;
        }
    }
    more(out, "metadata: ", keys.len(), limit, "entries")?;
    match architecture(file) {
        Some(a) => writeln!(out, "layout: GGUF, architecture {}", a.escape_debug())?,
        None => writeln!(out, "layout: GGUF, architecture ? (no general.architecture)")?,
    }
    let config: Vec<String> = config_values(file, show, |n| n.to_string())
        .into_iter()
        .map(|(label, _, v)| format!("{label} {}", v.as_deref().unwrap_or("?")))
        .collect();
    writeln!(out, "  {}", config.join(", "))?;
    match file.weight_dtype() {
        Some(d) => writeln!(
            out,
            "weights: `multihead generate` keeps the matrices as {d}{}",
            match d {
                WeightDtype::Ggml => " (each in the block format it is stored in)",
                WeightDtype::Q8_0 => " (the Q8_0 kernels)",
                _ => "",
            }
        )?,
        None => writeln!(out, "weights: no matrix of a type this loader reads")?,
    }
    if non_finite.is_empty() {
        writeln!(out, "values: all finite")?;
    }
    for n in non_finite.iter().take(limit) {
        writeln!(
            out,
            "values: {} has {} NaN and {} Inf",
            n.name.escape_debug(),
            n.nan,
            n.inf
        )?;
    }
    more(out, "values: ", non_finite.len(), limit, "tensors with NaN/Inf")?;
    match check {
        ConfigCheck::Unusable(why) => writeln!(out, "config: the file's metadata not used: {why}")?,
        ConfigCheck::Checked(kind, r) => {
            writeln!(out, "config: {kind} from the file's metadata")?;
            print_report(out, r, limit)?;
        }
    }
    Ok(())
}

fn print_json(
    out: &mut impl Write,
    file: &GgufFile,
    non_finite: &[NonFinite],
    check: &ConfigCheck,
) -> Result<()> {
    let rows = rows(file);
    let metadata: BTreeMap<&str, serde_json::Value> = file
        .keys()
        .into_iter()
        .filter_map(|k| file.get(k).map(|v| (k, json_value(v))))
        .collect();
    let facts: BTreeMap<&str, Option<serde_json::Value>> =
        config_values(file, json_value, |n| serde_json::json!(n))
            .into_iter()
            .map(|(_, key, v)| (key, v))
            .collect();
    let (config, config_note) = match check {
        ConfigCheck::Checked(kind, r) => (
            Some(serde_json::json!({
                "kind": format!("{kind} from the GGUF metadata"),
                "clean": r.is_clean(),
                "missing": r.missing,
                "unexpected": r.unexpected,
                "misshaped": r.misshaped,
            })),
            None,
        ),
        ConfigCheck::Unusable(why) => (None, Some(why.as_str())),
    };
    let json = serde_json::json!({
        "file": file.label(),
        "file_size": file.file_size(),
        "num_tensors": rows.len(),
        "total_params": total_params(file),
        "total_bytes": rows.iter().map(|t| t.bytes).sum::<usize>(),
        "dtypes": dtype_counts(file),
        "metadata": metadata,
        "tensors": rows
            .iter()
            .map(|t| serde_json::json!({
                "name": t.name,
                "dtype": t.dtype,
                "shape": t.shape,
                "bytes": t.bytes,
            }))
            .collect::<Vec<_>>(),
        "layout": {
            "kind": "gguf",
            "architecture": architecture(file),
            "metadata": facts,
        },
        "non_finite": non_finite,
        "config": config,
        "config_note": config_note,
    });
    writeln!(out, "{}", terminal_safe(&serde_json::to_string_pretty(&json)?))?;
    Ok(())
}

/// JSON text with every control character (and each bidirectional
/// override, which reorders what a terminal shows) written as a `\u`
/// escape. serde_json escapes only U+0000 to U+001F: a C1 control such as
/// U+009B, a terminal's one-byte CSI, would reach it raw. Outside its
/// strings JSON is ASCII, so only strings change, and they parse back to
/// the same text; every character escaped is in the BMP, one `\uXXXX`.
fn terminal_safe(json: &str) -> String {
    // A raw newline is the pretty layout's; inside strings serde_json
    // has written each as `\n` already.
    let escaped = |c: char| {
        (c.is_control() && c != '\n')
            || matches!(c, '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if escaped(c) {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}
