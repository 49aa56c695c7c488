//! A safetensors file compared with the model a config describes: the
//! config's kind told from its keys (an HF decoder, an HF or timm ViT, a
//! multihead `VitConfig`, `Seq2SeqConfig` or `MhaConfig`), read as the
//! command that runs such a model reads it, its sizes checked against
//! what the file can hold, then its model's tensors against the file's.

use std::path::Path;

use candle::{bail, Result};
use multihead_attention::{MhaConfig, MultiheadAttention};

use super::Layout;
use crate::decoder::{DecoderModel, Gemma, HfDecoderConfig, HF_DECODER_TYPES};
use crate::formats::files::{read_text, MAX_CONFIG_BYTES};
use crate::formats::preflight::{wanted_within, Preflight};
use crate::formats::safetensors::Checkpoint;
use crate::transformer::{Seq2Seq, Seq2SeqConfig};
use crate::vit::{folder, VisionTransformer, VitConfig};

/// The kind of config at `path` (`VitConfig`, `HF transformers decoder
/// config`, ...) and `ckpt`'s tensors compared with its model's; `layout`
/// places an `MhaConfig`'s module under the prefix the file stores it at.
pub(super) fn compare(ckpt: &Checkpoint, layout: &Layout, path: &Path) -> Result<(&'static str, Preflight)> {
    let json = read_text(path, "config", MAX_CONFIG_BYTES)?;
    let value: serde_json::Value = serde_json::from_str(&json)
        .map_err(|e| candle::Error::Msg(format!("config '{}' is not JSON: {e}", path.display())))?;
    let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
    // Every error after the config's own reading names the config.
    let ctx = |e: candle::Error| candle::Error::Msg(format!("config '{}': {e}", path.display()));
    // Every config's model is recorded within what the file can hold: a
    // tensor past it is refused as it is asked for, so `depth: 300000`
    // costs nothing.
    let model_type = value.get("model_type").and_then(|t| t.as_str());
    let hf_vit = matches!(model_type, Some("vit" | "deit"));
    let decoder = model_type.is_some_and(|t| HF_DECODER_TYPES.contains(&t));
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
            DecoderModel::wanted_tensors(&cfg, ckpt).map_err(ctx)?,
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
        cfg.validate().map_err(ctx)?;
        (
            kind,
            wanted_within(&names, &ckpt.budget(&cfg.budget_owner()), |vb| {
                VisionTransformer::new(&cfg, vb)
            })
            .map_err(ctx)?,
        )
    } else if value.get("img_size").is_some() || value.get("patch_size").is_some() {
        let cfg = VitConfig::from_json(&json).map_err(ctx)?;
        (
            "VitConfig",
            wanted_within(&names, &ckpt.budget(&cfg.budget_owner()), |vb| {
                VisionTransformer::new(&cfg, vb)
            })
            .map_err(ctx)?,
        )
    } else if value.get("transformer").is_some() {
        let cfg = Seq2SeqConfig::from_json(&json).map_err(ctx)?;
        (
            "Seq2SeqConfig",
            wanted_within(&names, &ckpt.budget(&cfg.budget_owner()), |vb| {
                Seq2Seq::new(&cfg, vb)
            })
            .map_err(ctx)?,
        )
    } else if value.get("embed_dim").is_some() {
        let cfg: MhaConfig = serde_json::from_str(&json)
            .map_err(|e| candle::Error::Msg(format!("config '{}': MhaConfig: {e}", path.display())))?;
        let prefix = match layout {
            Layout::MultiheadAttention(f) => f.prefix.trim_end_matches('.').to_string(),
            _ => String::new(),
        };
        let wanted = wanted_within(&names, &ckpt.budget("MhaConfig"), |vb| {
            let vb = if prefix.is_empty() { vb } else { vb.pp(&prefix) };
            MultiheadAttention::new(&cfg, vb)
        })
        .map_err(ctx)?;
        ("MhaConfig", wanted)
    } else {
        bail!(
            "config '{}' is neither a VitConfig (img_size, patch_size, ...), a Seq2SeqConfig (transformer, ...) \
             nor an MhaConfig (embed_dim, num_heads, ...)",
            path.display()
        )
    };
    Ok((kind, Preflight::check(ckpt, &wanted, false)?))
}
