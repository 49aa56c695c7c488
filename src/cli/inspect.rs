//! `multihead inspect FILE.safetensors`: what a checkpoint holds, what it
//! is, and whether it fits a config.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use multihead::attention::{MhaConfig, MultiheadAttention};
use multihead::models::checkpoint::{wanted_tensors, Checkpoint, NonFinite, Preflight};
use multihead::models::inspect::{recognise, Layout, VitFacts};
use multihead::models::vit::{VisionTransformer, VitConfig};

/// Arguments of `multihead inspect`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The checkpoint (safetensors; pickles are refused).
    file: PathBuf,
    /// A model config (VitConfig or MhaConfig JSON) to check the tensors
    /// against: missing, unexpected, mis-shaped. Default: config.json
    /// beside the file, when there is one (the multihead model directory).
    #[arg(long, value_name = "CONFIG.json")]
    config: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
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
    let ckpt = Checkpoint::read(&args.file)?;
    let layout = recognise(ckpt.tensors());
    let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
    let non_finite: Vec<NonFinite> = ckpt
        .non_finite(names.iter().copied())?
        .into_iter()
        .map(|(name, nan, inf)| NonFinite { name, nan, inf })
        .collect();
    let beside = args.file.with_file_name("config.json");
    let check = match &args.config {
        Some(path) => Some(check_config(&ckpt, &layout, path, false)?),
        None if beside.is_file() => check_config(&ckpt, &layout, &beside, true).ok(),
        None => None,
    };
    if args.json {
        print_json(&ckpt, &layout, &non_finite, check.as_ref())?;
    } else {
        print_text(&ckpt, &layout, &non_finite, check.as_ref());
    }
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
        std::fs::read_to_string(path).with_context(|| format!("reading config '{}'", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&json).with_context(|| format!("config '{}' is not JSON", path.display()))?;
    let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
    let (kind, wanted) = if value.get("img_size").is_some() || value.get("patch_size").is_some() {
        let cfg = VitConfig::from_json(&json).with_context(|| format!("config '{}'", path.display()))?;
        (
            "VitConfig",
            wanted_tensors(&names, |vb| VisionTransformer::new(&cfg, vb))?,
        )
    } else if value.get("embed_dim").is_some() {
        let cfg: MhaConfig =
            serde_json::from_str(&json).with_context(|| format!("config '{}': MhaConfig", path.display()))?;
        let prefix = match layout {
            Layout::MultiheadAttention(f) => f.prefix.trim_end_matches('.').to_string(),
            _ => String::new(),
        };
        let wanted = wanted_tensors(&names, |vb| {
            let vb = if prefix.is_empty() { vb } else { vb.pp(&prefix) };
            MultiheadAttention::new(&cfg, vb)
        })
        .with_context(|| format!("config '{}'", path.display()))?;
        ("MhaConfig", wanted)
    } else {
        bail!(
            "config '{}' is neither a VitConfig (img_size, patch_size, ...) nor an MhaConfig (embed_dim, num_heads, ...)",
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

fn print_text(ckpt: &Checkpoint, layout: &Layout, non_finite: &[NonFinite], check: Option<&ConfigCheck>) {
    let w = ckpt
        .tensors()
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    println!("{:<w$}  {:<5}  {:<20}  size", "name", "dtype", "shape");
    for t in ckpt.tensors() {
        let shape = format!("{:?}", t.shape);
        println!(
            "{:<w$}  {:<5}  {:<20}  {}",
            t.name,
            t.dtype,
            shape,
            human_bytes(t.bytes)
        );
    }
    let dtypes: Vec<String> = dtype_counts(ckpt)
        .iter()
        .map(|(d, n)| format!("{n} {d}"))
        .collect();
    println!(
        "total: {} tensors ({}), {} parameters, {} of data, file {}",
        ckpt.tensors().len(),
        dtypes.join(", "),
        ckpt.total_params(),
        human_bytes(ckpt.tensors().iter().map(|t| t.bytes).sum()),
        human_bytes(ckpt.file_size()),
    );
    for (k, v) in ckpt.metadata() {
        println!("metadata: {k} = {v}");
    }
    println!("layout: {}", layout.describe());
    match layout {
        Layout::TimmVit(f) | Layout::HfVit(f) => println!("  {}", vit_line(f)),
        Layout::Transformer(f) => println!(
            "  d_model {}, encoder layers {}, decoder layers {}, feed-forward {}, heads ? (not stored in the weights)",
            f.d_model,
            f.num_encoder_layers,
            f.num_decoder_layers,
            f.dim_feedforward.map_or("?".into(), |v| v.to_string())
        ),
        Layout::MultiheadAttention(f) => println!(
            "  at '{}': embed_dim {}, kdim {}, vdim {}, bias {}, bias_kv {}, heads ? (not stored in the weights)",
            f.prefix, f.embed_dim, f.kdim, f.vdim, f.bias, f.add_bias_kv
        ),
        Layout::Unknown => {}
    }
    if non_finite.is_empty() {
        println!("values: all finite");
    }
    for n in non_finite {
        println!("values: {} has {} NaN and {} Inf", n.name, n.nan, n.inf);
    }
    if let Some(c) = check {
        let whose = if c.beside {
            " (beside the file: a multihead model directory)"
        } else {
            ""
        };
        println!("config: {} {}{whose}", c.kind, c.path.display());
        let r = &c.report;
        if r.is_clean() {
            println!("  every tensor matches");
        }
        for m in &r.missing {
            println!("  missing     {} {:?}", m.name, m.shape);
        }
        for u in &r.unexpected {
            println!("  unexpected  {u}");
        }
        for m in &r.misshaped {
            println!(
                "  mis-shaped  {} expected {:?} found {:?}",
                m.name, m.expected, m.found
            );
        }
        for n in &r.not_float {
            println!("  not float   {} is {}", n.name, n.dtype);
        }
    }
}

fn print_json(
    ckpt: &Checkpoint,
    layout: &Layout,
    non_finite: &[NonFinite],
    check: Option<&ConfigCheck>,
) -> Result<()> {
    let metadata: BTreeMap<&str, &str> = ckpt
        .metadata()
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let out = serde_json::json!({
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
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
