//! `multihead inspect FILE.safetensors`: what a checkpoint holds, what it
//! is, and whether it fits a config. A GGUF file goes to
//! `inspect_gguf.rs`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use multihead::attention::{MhaConfig, MultiheadAttention};
use multihead::models::checkpoint::{
    is_gguf, wanted_tensors, Checkpoint, MinWeights, ModelFiles, NonFinite, Preflight,
};
use multihead::models::decoder::{DecoderModel, Gemma, HfDecoderConfig, HF_DECODER_TYPES};
use multihead::models::inspect::{recognise, Layout, VitFacts};
use multihead::models::transformer::{Seq2Seq, Seq2SeqConfig};
use multihead::models::vit::{folder, VisionTransformer, VitConfig};

/// Entries of each list the text output shows without `--all`: a header
/// of 100,000 tensors prints a screenful and a count, not 100,000 lines.
pub(super) const LISTED: usize = 200;

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

/// The config a checkpoint was compared with.
struct ConfigCheck {
    path: PathBuf,
    kind: &'static str,
    beside: bool,
    report: Preflight,
}

/// Runs the command.
pub fn run(args: Args) -> Result<()> {
    if is_gguf(&args.file) && !args.file.is_dir() {
        if let Some(config) = &args.config {
            bail!(
                "--config '{}' does not apply to the GGUF file '{}': its config is its metadata",
                config.display(),
                args.file.display()
            )
        }
        return super::inspect_gguf::run(&args.file, args.json, args.all);
    }
    // A folder means its weights as `--weights DIR` finds them.
    let at = ModelFiles::resolve(&args.file)?;
    let ckpt = at.read()?;
    let layout = recognise(ckpt.tensors());
    let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
    let non_finite: Vec<NonFinite> = ckpt
        .non_finite(names.iter().copied())?
        .into_iter()
        .map(|(name, nan, inf)| NonFinite { name, nan, inf })
        .collect();
    let beside = at.beside("config.json");
    // A config.json beside the file that cannot be used (another kind, or
    // sizes the file cannot hold) does not fail the inspection, but is not
    // passed over in silence either.
    let mut beside_note = None;
    let check = match &args.config {
        Some(path) => Some(check_config(&ckpt, &layout, path, false)?),
        None if beside.is_file() => match check_config(&ckpt, &layout, &beside, true) {
            Ok(c) => Some(c),
            Err(e) => {
                let why = format!("{e:#}");
                let why = why.lines().next().unwrap_or_default().to_string();
                beside_note = Some(format!("{} (beside the file) not used: {why}", beside.display()));
                None
            }
        },
        None => None,
    };
    // Buffered: a long listing is one write per buffer, not per line. A
    // closed pipe (`| head`) surfaces as an error `main` ends quietly on.
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if args.json {
        print_json(
            &mut out,
            &ckpt,
            &layout,
            &non_finite,
            check.as_ref(),
            beside_note.as_deref(),
        )?;
    } else {
        let limit = if args.all { usize::MAX } else { LISTED };
        print_text(&mut out, limit, &ckpt, &layout, &non_finite, check.as_ref())?;
        if let Some(note) = &beside_note {
            writeln!(out, "config: {note}")?;
        }
    }
    out.flush()?;
    if let Some(c) = &check {
        if let Some(summary) = c.report.summary() {
            bail!(
                "'{}' does not fit config '{}': {summary}",
                ckpt.label(),
                c.path.display()
            )
        }
    }
    Ok(())
}

/// Compares the checkpoint with the model `config` describes.
fn check_config(ckpt: &Checkpoint, layout: &Layout, path: &Path, beside: bool) -> Result<ConfigCheck> {
    let json =
        multihead::models::files::read_text(path, "config", multihead::models::files::MAX_CONFIG_BYTES)?;
    let value: serde_json::Value =
        serde_json::from_str(&json).with_context(|| format!("config '{}' is not JSON", path.display()))?;
    let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
    let ctx = || format!("config '{}'", path.display());
    // Every config's sizes are checked against what the file can hold
    // before its model is recorded: `depth: 300000` costs nothing.
    let hf_vit = matches!(
        value.get("model_type").and_then(|t| t.as_str()),
        Some("vit" | "deit")
    );
    let decoder = value
        .get("model_type")
        .and_then(|t| t.as_str())
        .is_some_and(|t| HF_DECODER_TYPES.contains(&t));
    // A multimodal Gemma 3's vision tower is left out on purpose: the
    // text model's tensors are compared with the config.
    let text;
    let mut ckpt = ckpt;
    let (kind, wanted) = if decoder {
        // As `generate --model` reads it.
        let cfg = HfDecoderConfig::from_json(&json, &path.display().to_string())?;
        if let HfDecoderConfig::Gemma(_) = cfg {
            text = Gemma::text_checkpoint(ckpt).0;
            ckpt = &text;
        }
        (
            "HF transformers decoder config",
            DecoderModel::wanted_tensors(&cfg, ckpt).with_context(ctx)?,
        )
    } else if hf_vit || value.get("architecture").is_some() {
        // HF transformers and timm hub configs, read as `vit --weights` reads them.
        let label = path.display().to_string();
        let (kind, cfg) = if hf_vit {
            (
                "HF transformers config",
                folder::hf::parse(&json, &label, None)?.0,
            )
        } else {
            ("timm config", folder::timm::parse(&json, &label)?)
        };
        cfg.validate().with_context(ctx)?;
        ckpt.ensure_holds(&cfg.min_weights()?).with_context(ctx)?;
        (
            kind,
            wanted_tensors(&names, |vb| VisionTransformer::new(&cfg, vb)).with_context(ctx)?,
        )
    } else if value.get("img_size").is_some() || value.get("patch_size").is_some() {
        let cfg = VitConfig::from_json(&json).with_context(ctx)?;
        ckpt.ensure_holds(&cfg.min_weights()?).with_context(ctx)?;
        (
            "VitConfig",
            wanted_tensors(&names, |vb| VisionTransformer::new(&cfg, vb)).with_context(ctx)?,
        )
    } else if value.get("transformer").is_some() {
        let cfg = Seq2SeqConfig::from_json(&json).with_context(ctx)?;
        ckpt.ensure_holds(&cfg.min_weights()?).with_context(ctx)?;
        (
            "Seq2SeqConfig",
            wanted_tensors(&names, |vb| Seq2Seq::new(&cfg, vb)).with_context(ctx)?,
        )
    } else if value.get("embed_dim").is_some() {
        let cfg: MhaConfig = serde_json::from_str(&json).with_context(|| format!("{}: MhaConfig", ctx()))?;
        ckpt.ensure_holds(&mha_min_weights(&cfg)?).with_context(ctx)?;
        let prefix = match layout {
            Layout::MultiheadAttention(f) => f.prefix.trim_end_matches('.').to_string(),
            _ => String::new(),
        };
        let wanted = wanted_tensors(&names, |vb| {
            let vb = if prefix.is_empty() { vb } else { vb.pp(&prefix) };
            MultiheadAttention::new(&cfg, vb)
        })
        .with_context(ctx)?;
        ("MhaConfig", wanted)
    } else {
        bail!(
            "config '{}' is neither a VitConfig (img_size, patch_size, ...), a Seq2SeqConfig (transformer, ...) \
             nor an MhaConfig (embed_dim, num_heads, ...)",
            path.display()
        )
    };
    let report = Preflight::check(ckpt, &wanted, false)?;
    Ok(ConfigCheck {
        path: path.to_path_buf(),
        kind,
        beside,
        report,
    })
}

/// The fewest weights an `nn.MultiheadAttention` of `cfg` stores: the
/// query, key, value and output projections.
fn mha_min_weights(cfg: &MhaConfig) -> Result<MinWeights> {
    let e = cfg.embed_dim;
    let mut m = MinWeights::new("MhaConfig");
    m.add(format!("q_proj and out_proj (2 x embed_dim {e}²)"), &[2, e, e])?;
    m.add(
        format!("k_proj (embed_dim {e} x kdim {})", cfg.kdim()),
        &[e, cfg.kdim()],
    )?;
    m.add(
        format!("v_proj (embed_dim {e} x vdim {})", cfg.vdim()),
        &[e, cfg.vdim()],
    )?;
    Ok(m)
}

/// The tensor listing, `(name, dtype, shape, bytes)` a row, the first
/// `limit` rows and a count of the rest.
pub(super) fn print_tensors(
    out: &mut impl Write,
    rows: Vec<(&str, &str, &[usize], usize)>,
    limit: usize,
) -> Result<()> {
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
pub(super) fn more(out: &mut impl Write, indent: &str, total: usize, limit: usize, what: &str) -> Result<()> {
    if total > limit {
        writeln!(out, "{indent}… {} more {what} (--all lists them)", total - limit)?;
    }
    Ok(())
}

pub(super) fn human_bytes(n: usize) -> String {
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

fn dtype_counts(ckpt: &Checkpoint) -> BTreeMap<&str, usize> {
    let mut counts = BTreeMap::new();
    for t in ckpt.tensors() {
        *counts.entry(t.dtype.as_str()).or_insert(0) += 1;
    }
    counts
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

fn print_text(
    out: &mut impl Write,
    limit: usize,
    ckpt: &Checkpoint,
    layout: &Layout,
    non_finite: &[NonFinite],
    check: Option<&ConfigCheck>,
) -> Result<()> {
    let rows = ckpt
        .tensors()
        .iter()
        .map(|t| (t.name.as_str(), t.dtype.as_str(), t.shape.as_slice(), t.bytes));
    print_tensors(out, rows.collect(), limit)?;
    let dtypes: Vec<String> = dtype_counts(ckpt)
        .iter()
        .map(|(d, n)| format!("{n} {d}"))
        .collect();
    writeln!(
        out,
        "total: {} tensors ({}), {} parameters, {} of data, file {}",
        ckpt.tensors().len(),
        dtypes.join(", "),
        ckpt.total_params(),
        human_bytes(ckpt.tensors().iter().map(|t| t.bytes).sum()),
        human_bytes(ckpt.file_size()),
    )?;
    for (k, v) in ckpt.metadata().iter().take(limit) {
        writeln!(out, "metadata: {k} = {v}")?;
    }
    more(out, "metadata: ", ckpt.metadata().len(), limit, "entries")?;
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
            f.prefix, f.embed_dim, f.kdim, f.vdim, f.bias, f.add_bias_kv
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
    if non_finite.is_empty() {
        writeln!(out, "values: all finite")?;
    }
    for n in non_finite.iter().take(limit) {
        writeln!(out, "values: {} has {} NaN and {} Inf", n.name, n.nan, n.inf)?;
    }
    more(out, "values: ", non_finite.len(), limit, "tensors with NaN/Inf")?;
    if let Some(c) = check {
        let whose = match (c.beside, c.kind) {
            (false, _) => "",
            (true, "VitConfig" | "Seq2SeqConfig" | "MhaConfig") => {
                " (beside the file: a multihead model directory)"
            }
            (true, _) => " (beside the file)",
        };
        writeln!(out, "config: {} {}{whose}", c.kind, c.path.display())?;
        print_report(out, &c.report, limit)?;
    }
    Ok(())
}

/// The pre-flight's findings, at most `limit` of each kind.
pub(super) fn print_report(out: &mut impl Write, r: &Preflight, limit: usize) -> Result<()> {
    if r.is_clean() {
        writeln!(out, "  every tensor matches")?;
    }
    for m in r.missing.iter().take(limit) {
        writeln!(out, "  missing     {} {:?}", m.name, m.shape)?;
    }
    more(out, "  ", r.missing.len(), limit, "missing")?;
    for u in r.unexpected.iter().take(limit) {
        writeln!(out, "  unexpected  {u}")?;
    }
    more(out, "  ", r.unexpected.len(), limit, "unexpected")?;
    for m in r.misshaped.iter().take(limit) {
        writeln!(
            out,
            "  mis-shaped  {} expected {:?} found {:?}",
            m.name, m.expected, m.found
        )?;
    }
    more(out, "  ", r.misshaped.len(), limit, "mis-shaped")?;
    for n in r.not_float.iter().take(limit) {
        writeln!(out, "  not float   {} is {}", n.name, n.dtype)?;
    }
    more(out, "  ", r.not_float.len(), limit, "not float")
}

fn print_json(
    out: &mut impl Write,
    ckpt: &Checkpoint,
    layout: &Layout,
    non_finite: &[NonFinite],
    check: Option<&ConfigCheck>,
    config_note: Option<&str>,
) -> Result<()> {
    let metadata: BTreeMap<&str, &str> = ckpt
        .metadata()
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let json = serde_json::json!({
        "file": ckpt.label(),
        "file_size": ckpt.file_size(),
        "num_tensors": ckpt.tensors().len(),
        "total_params": ckpt.total_params(),
        "total_bytes": ckpt.tensors().iter().map(|t| t.bytes).sum::<usize>(),
        "dtypes": dtype_counts(ckpt),
        "metadata": metadata,
        "tensors": ckpt.tensors(),
        "layout": layout,
        "non_finite": non_finite,
        "config": check.map(|c| serde_json::json!({
            "path": c.path.display().to_string(),
            "kind": c.kind,
            "beside": c.beside,
            "clean": c.report.is_clean(),
            "missing": c.report.missing,
            "unexpected": c.report.unexpected,
            "misshaped": c.report.misshaped,
            "not_float": c.report.not_float,
        })),
        "config_note": config_note,
    });
    // Formatted first: serde_json's writer errors hide the io::Error that
    // tells a closed pipe from a real failure.
    writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
    Ok(())
}
