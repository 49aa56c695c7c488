//! `multihead inspect FILE|DIR`: what a weights file (safetensors or
//! GGUF) holds, what it is, and whether it fits a config, printed from the
//! library's one report ([`InspectReport`]) as text or JSON.
//!
//! Names, keys and strings from the file print escaped, so that no byte
//! of it can drive the terminal: the JSON output with every control
//! character as a `\u` escape ([`terminal_safe`]); the text output of a
//! GGUF file through `str::escape_debug` (strings quoted, as `{:?}`), a
//! safetensors file's with its control characters alone escaped the same
//! way ([`terminal_text`]), so that the JSON its metadata often holds
//! prints as stored.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use candle::quantized::gguf_file::Value;
use multihead::models::checkpoint::WeightDtype;
use multihead::models::formats::inspect::{
    ConfigCheck, ConfigSource, FileLayout, GgufFacts, InspectReport, Layout, MetadataValue, VitFacts,
};
use multihead::models::formats::preflight::Preflight;

/// Entries of each list the text output shows without `--all`: a header
/// of 100,000 tensors prints a screenful and a count, not 100,000 lines.
const LISTED: usize = 200;

/// Longest string metadata value of a GGUF file the text output prints
/// whole (a chat template runs to kilobytes).
const SHOWN_CHARS: usize = 80;

/// Longest array of a GGUF file's metadata the output lists (a
/// tokenizer's tokens run to 150,000).
const SHOWN_ITEMS: usize = 8;

/// Arguments of `multihead inspect`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The checkpoint (safetensors, or a GGUF file; pickles are refused),
    /// or a folder holding it as model.safetensors.
    #[arg(value_name = "FILE|DIR")]
    file: PathBuf,
    /// A model config (VitConfig or MhaConfig JSON) to check the tensors
    /// against: missing, unexpected, mis-shaped. Default: config.json
    /// beside the file, when there is one (the multihead model directory).
    #[arg(long, value_name = "CONFIG.json")]
    config: Option<PathBuf>,
    /// Print one JSON object instead of text (always with every entry).
    #[arg(long)]
    json: bool,
    /// List every tensor, metadata entry and mismatch; without it the
    /// text output shows the first 200 of each and how many more there are.
    #[arg(long)]
    all: bool,
}

/// Runs the command: prints the report, then fails where the tensors do
/// not fit the config they were compared with.
pub fn run(args: Args) -> Result<()> {
    let report = InspectReport::read(&args.file, args.config.as_deref())?;
    // Buffered: a long listing is one write per buffer, not per line. A
    // closed pipe (`| head`) surfaces as an error `main` ends quietly on.
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if args.json {
        print_json(&mut out, &report)?;
    } else {
        let limit = if args.all { usize::MAX } else { LISTED };
        print_text(&mut out, limit, &report)?;
    }
    out.flush()?;
    Ok(report.ensure_fits()?)
}

/// `text` from the file, as the text output shows it: escaped
/// (`str::escape_debug`) where the file is GGUF, its control characters
/// escaped ([`terminal_text`]) where it is safetensors.
fn shown<'a>(r: &InspectReport, text: &'a str) -> Cow<'a, str> {
    match r.layout {
        FileLayout::Gguf(_) => Cow::Owned(text.escape_debug().to_string()),
        FileLayout::Tensors(_) => terminal_text(text),
    }
}

/// Whether `c` can drive a terminal: a control character, or a
/// bidirectional override, which reorders what a terminal shows.
fn drives_terminal(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every character that can drive a terminal written as
/// `char::escape_debug` writes it (`\u{1b}`, `\n`), any other as it is:
/// text it has escaped comes back the same.
fn terminal_text(text: &str) -> Cow<'_, str> {
    if !text.chars().any(drives_terminal) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if drives_terminal(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The report as text, at most `limit` entries of each list.
fn print_text(out: &mut impl Write, limit: usize, r: &InspectReport) -> Result<()> {
    let names: Vec<Cow<str>> = r.tensors.iter().map(|t| shown(r, &t.name)).collect();
    let rows = r
        .tensors
        .iter()
        .zip(&names)
        .map(|(t, name)| (name.as_ref(), t.dtype.as_str(), t.shape.as_slice(), t.bytes));
    print_tensors(out, rows.collect(), limit)?;
    let dtypes: Vec<String> = r.dtype_counts().iter().map(|(d, n)| format!("{n} {d}")).collect();
    writeln!(
        out,
        "total: {} tensors ({}), {} parameters, {} of data, file {}",
        r.tensors.len(),
        dtypes.join(", "),
        r.total_params(),
        human_bytes(r.total_bytes()),
        human_bytes(r.file_size),
    )?;
    for (k, v) in r.metadata.iter().take(limit) {
        let v = match v {
            MetadataValue::Text(s) => shown(r, s),
            MetadataValue::Gguf(v) => Cow::Owned(show(v)),
        };
        writeln!(out, "metadata: {} = {v}", shown(r, k))?;
    }
    more(out, "metadata: ", r.metadata.len(), limit, "entries")?;
    match &r.layout {
        FileLayout::Tensors(layout) => print_layout(out, layout)?,
        FileLayout::Gguf(facts) => print_gguf_facts(out, facts)?,
    }
    if r.non_finite.is_empty() {
        writeln!(out, "values: all finite")?;
    }
    for n in r.non_finite.iter().take(limit) {
        writeln!(
            out,
            "values: {} has {} NaN and {} Inf",
            shown(r, &n.name),
            n.nan,
            n.inf
        )?;
    }
    more(out, "values: ", r.non_finite.len(), limit, "tensors with NaN/Inf")?;
    match &r.config {
        None => {}
        Some(ConfigCheck::Compared { kind, source, report }) => {
            match source {
                ConfigSource::Given(path) => writeln!(out, "config: {kind} {}", path.display())?,
                ConfigSource::Beside(path) => {
                    let whose = match *kind {
                        "VitConfig" | "Seq2SeqConfig" | "MhaConfig" => {
                            " (beside the file: a multihead model directory)"
                        }
                        _ => " (beside the file)",
                    };
                    writeln!(out, "config: {kind} {}{whose}", path.display())?
                }
                ConfigSource::Metadata => writeln!(out, "config: {kind} from the file's metadata")?,
            }
            print_report(out, report, limit)?;
        }
        Some(ConfigCheck::NotUsed { source, why }) => {
            writeln!(out, "config: {}", not_used(source, &terminal_text(why)))?
        }
    }
    Ok(())
}

/// Why a config was passed over, after `config: `.
fn not_used(source: &ConfigSource, why: &str) -> String {
    match source {
        ConfigSource::Given(path) => format!("{} not used: {why}", path.display()),
        ConfigSource::Beside(path) => format!("{} (beside the file) not used: {why}", path.display()),
        ConfigSource::Metadata => format!("the file's metadata not used: {why}"),
    }
}

/// The layout a safetensors file's tensors reveal, and its sizes.
fn print_layout(out: &mut impl Write, layout: &Layout) -> Result<()> {
    writeln!(out, "layout: {}", layout.describe())?;
    match layout {
        Layout::TimmVit(f) | Layout::HfVit(f) => writeln!(out, "  {}", vit_line(f))?,
        Layout::Transformer(f) => writeln!(
            out,
            "  d_model {}, encoder layers {}, decoder layers {}, feed-forward {}, heads ? (not stored in the weights)",
            f.d_model,
            f.num_encoder_layers,
            f.num_decoder_layers,
            f.dim_feedforward.map_or("?".into(), |v| v.to_string())
        )?,
        Layout::MultiheadAttention(f) => writeln!(
            out,
            "  at '{}': embed_dim {}, kdim {}, vdim {}, bias {}, bias_kv {}, heads ? (not stored in the weights)",
            terminal_text(&f.prefix),
            f.embed_dim,
            f.kdim,
            f.vdim,
            f.bias,
            f.add_bias_kv
        )?,
        Layout::Decoder(f) => {
            let opt = |v: Option<usize>| v.map_or("?".to_string(), |v| v.to_string());
            writeln!(
                out,
                "  {}: vocab {}, hidden {}, layers {}, MLP {}, heads {}, kv heads {} (kv width {}){}{}",
                f.family,
                f.vocab_size,
                f.hidden_size,
                f.num_layers,
                opt(f.intermediate_size),
                opt(f.num_heads),
                opt(f.num_kv_heads),
                opt(f.kv_dim),
                f.positions.map_or(String::new(), |p| format!(", {p} positions")),
                if f.tied_embeddings { ", tied embeddings" } else { "" }
            )?
        }
        Layout::Unknown => {}
    }
    Ok(())
}

/// A GGUF file's architecture, its config's sizes and how its weight
/// matrices load.
fn print_gguf_facts(out: &mut impl Write, f: &GgufFacts) -> Result<()> {
    match &f.architecture {
        Some(a) => writeln!(out, "layout: GGUF, architecture {}", a.escape_debug())?,
        None => writeln!(out, "layout: GGUF, architecture ? (no general.architecture)")?,
    }
    let sizes: Vec<String> = f
        .sizes
        .iter()
        .map(|(name, _, v)| format!("{name} {}", v.as_ref().map_or("?".to_string(), show)))
        .collect();
    writeln!(out, "  {}", sizes.join(", "))?;
    match f.weights {
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
    Ok(())
}

/// The tensor listing, `(name, dtype, shape, bytes)` a row, the first
/// `limit` rows and a count of the rest.
fn print_tensors(out: &mut impl Write, rows: Vec<(&str, &str, &[usize], usize)>, limit: usize) -> Result<()> {
    let shown = &rows[..rows.len().min(limit)];
    let w = shown.iter().map(|t| t.0.len()).max().unwrap_or(4).max(4);
    writeln!(out, "{:<w$}  {:<5}  {:<20}  size", "name", "dtype", "shape")?;
    for &(name, dtype, shape, bytes) in shown {
        let shape = format!("{shape:?}");
        writeln!(out, "{name:<w$}  {dtype:<5}  {shape:<20}  {}", human_bytes(bytes))?;
    }
    more(out, "", rows.len(), limit, "tensors")
}

/// `… N more` after the first `limit` of `total` entries, or nothing.
fn more(out: &mut impl Write, indent: &str, total: usize, limit: usize, what: &str) -> Result<()> {
    if total > limit {
        writeln!(out, "{indent}… {} more {what} (--all lists them)", total - limit)?;
    }
    Ok(())
}

fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024. && u + 1 < UNITS.len() {
        v /= 1024.;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn vit_line(f: &VitFacts) -> String {
    let opt = |v: Option<usize>, why: &str| v.map_or_else(|| format!("? ({why})"), |v| v.to_string());
    format!(
        "embed_dim {}, depth {}, heads {}, patch {}, image {}, in_chans {}, classes {}, mlp {}{}{}",
        f.embed_dim,
        f.depth,
        opt(f.num_heads, "not stored in the weights; the config says"),
        f.patch_size,
        opt(f.img_size, "position table is not a square grid"),
        f.in_chans,
        f.num_classes,
        opt(f.mlp_hidden_dim, "no MLP found"),
        if f.class_token { ", class token" } else { "" },
        if f.reg_tokens > 0 {
            format!(", {} register tokens", f.reg_tokens)
        } else {
            String::new()
        },
    )
}

/// The pre-flight's findings, at most `limit` of each kind.
fn print_report(out: &mut impl Write, r: &Preflight, limit: usize) -> Result<()> {
    if r.is_clean() {
        writeln!(out, "  every tensor matches")?;
    }
    // The pre-flight writes its names escaped; [`terminal_text`] leaves
    // escaped text as it is.
    for m in r.missing.iter().take(limit) {
        writeln!(out, "  missing     {} {:?}", terminal_text(&m.name), m.shape)?;
    }
    more(out, "  ", r.missing.len(), limit, "missing")?;
    for u in r.unexpected.iter().take(limit) {
        writeln!(out, "  unexpected  {}", terminal_text(u))?;
    }
    more(out, "  ", r.unexpected.len(), limit, "unexpected")?;
    for m in r.misshaped.iter().take(limit) {
        writeln!(
            out,
            "  mis-shaped  {} expected {:?} found {:?}",
            terminal_text(&m.name),
            m.expected,
            m.found
        )?;
    }
    more(out, "  ", r.misshaped.len(), limit, "mis-shaped")?;
    for n in r.not_float.iter().take(limit) {
        writeln!(out, "  not float   {} is {}", terminal_text(&n.name), n.dtype)?;
    }
    more(out, "  ", r.not_float.len(), limit, "not float")
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

/// The report as one JSON object, every entry of every list.
fn print_json(out: &mut impl Write, r: &InspectReport) -> Result<()> {
    let metadata: BTreeMap<&str, serde_json::Value> = r
        .metadata
        .iter()
        .map(|(k, v)| {
            let v = match v {
                MetadataValue::Text(s) => serde_json::json!(s),
                MetadataValue::Gguf(v) => json_value(v),
            };
            (k.as_str(), v)
        })
        .collect();
    let layout = match &r.layout {
        FileLayout::Tensors(layout) => serde_json::to_value(layout)?,
        FileLayout::Gguf(f) => {
            let sizes: BTreeMap<&str, Option<serde_json::Value>> = f
                .sizes
                .iter()
                .map(|(_, key, v)| (*key, v.as_ref().map(json_value)))
                .collect();
            serde_json::json!({
                "kind": "gguf",
                "architecture": f.architecture,
                "metadata": sizes,
            })
        }
    };
    let (config, config_note) = match &r.config {
        None => (None, None),
        Some(ConfigCheck::Compared { kind, source, report }) => {
            (Some(config_json(kind, source, report)), None)
        }
        Some(ConfigCheck::NotUsed { source, why }) => (
            None,
            Some(match source {
                ConfigSource::Metadata => why.clone(),
                _ => not_used(source, why),
            }),
        ),
    };
    let json = serde_json::json!({
        "file": r.file,
        "file_size": r.file_size,
        "num_tensors": r.tensors.len(),
        "total_params": r.total_params(),
        "total_bytes": r.total_bytes(),
        "dtypes": r.dtype_counts(),
        "metadata": metadata,
        "tensors": r.tensors,
        "layout": layout,
        "non_finite": r.non_finite,
        "config": config,
        "config_note": config_note,
    });
    // Formatted first: serde_json's writer errors hide the io::Error that
    // tells a closed pipe from a real failure.
    let json = serde_json::to_string_pretty(&json)?;
    writeln!(out, "{}", terminal_safe(&json))?;
    Ok(())
}

/// The comparison with a config as the JSON output gives it.
fn config_json(kind: &str, source: &ConfigSource, r: &Preflight) -> serde_json::Value {
    match source {
        ConfigSource::Given(path) | ConfigSource::Beside(path) => serde_json::json!({
            "path": path.display().to_string(),
            "kind": kind,
            "beside": matches!(source, ConfigSource::Beside(_)),
            "clean": r.is_clean(),
            "missing": r.missing,
            "unexpected": r.unexpected,
            "misshaped": r.misshaped,
            "not_float": r.not_float,
        }),
        ConfigSource::Metadata => serde_json::json!({
            "kind": format!("{kind} from the GGUF metadata"),
            "clean": r.is_clean(),
            "missing": r.missing,
            "unexpected": r.unexpected,
            "misshaped": r.misshaped,
        }),
    }
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
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c != '\n' && drives_terminal(c) {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}
