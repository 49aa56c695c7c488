//! What a checkpoint is, from its tensor names and shapes alone: timm or
//! HF ViT, a PyTorch `nn.MultiheadAttention` or `nn.Transformer`, an HF
//! decoder, and the sizes each layout reveals. A Llama-like decoder's
//! family is the one whose constructor asks for the tensors of the file's
//! first layer (`decoder/families.rs`), not a list of names kept here.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::decoder::families::{family_layers, FamilyLayer};
use crate::formats::safetensors::TensorInfo;

/// Sizes of a Vision Transformer read off its tensors.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VitFacts {
    /// `timm` or `hf`: the value of `VitConfig::naming`.
    pub naming: String,
    /// Token width (the patch projection's output channels).
    pub embed_dim: usize,
    /// Number of encoder blocks.
    pub depth: usize,
    /// Heads, when the weights reveal them (timm's qk-norm stores
    /// `head_dim`); otherwise a config must say.
    pub num_heads: Option<usize>,
    /// Side of the patches.
    pub patch_size: usize,
    /// Image channels.
    pub in_chans: usize,
    /// Side of the training image, when the position table is a square
    /// grid.
    pub img_size: Option<usize>,
    /// Classes of the head; 0 when there is none.
    pub num_classes: usize,
    /// MLP hidden width.
    pub mlp_hidden_dim: Option<usize>,
    /// Whether a class token is stored.
    pub class_token: bool,
    /// Register tokens.
    pub reg_tokens: usize,
    /// Whether the qkv projection has a bias.
    pub qkv_bias: bool,
    /// Whether the blocks have LayerScale.
    pub layer_scale: bool,
}

/// Sizes of an `nn.MultiheadAttention` read off its tensors.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MhaFacts {
    /// The module's name prefix (empty at the root).
    pub prefix: String,
    /// Model width.
    pub embed_dim: usize,
    /// Key and value feature sizes.
    pub kdim: usize,
    /// Value feature size.
    pub vdim: usize,
    /// Whether the projections have biases.
    pub bias: bool,
    /// Whether `bias_k`/`bias_v` are stored.
    pub add_bias_kv: bool,
}

/// Sizes of an `nn.Transformer` (or its encoder or decoder) read off its
/// tensors.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TransformerFacts {
    /// Name prefix in front of `encoder.`/`decoder.`.
    pub prefix: String,
    /// Model width.
    pub d_model: usize,
    /// Encoder layers.
    pub num_encoder_layers: usize,
    /// Decoder layers.
    pub num_decoder_layers: usize,
    /// Feed-forward width.
    pub dim_feedforward: Option<usize>,
}

/// What a decoder-only checkpoint's tensors say about the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecoderFacts {
    /// `gpt2`, `llama` (Llama, Mistral, SmolLM3: they store the same
    /// tensors), `qwen2` (biases on q, k, v only), `qwen3` (q/k norms per
    /// head), `olmo2` (norms after each branch, q/k norms over all heads),
    /// `phi3` (fused `qkv_proj` and `gate_up_proj`), `gemma2` (norms before
    /// and after each branch) or `gemma3` (those, and q/k norms per head).
    pub family: String,
    /// The names' prefix (`transformer.`, `model.`, or none).
    pub prefix: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// Layers.
    pub num_layers: usize,
    /// MLP width.
    pub intermediate_size: Option<usize>,
    /// Query heads (when the shapes tell: Qwen3's per-head norms).
    pub num_heads: Option<usize>,
    /// Key/value heads (when the shapes tell).
    pub num_kv_heads: Option<usize>,
    /// Width of the keys and values of all heads (`k_proj`'s outputs).
    pub kv_dim: Option<usize>,
    /// Learned positions (GPT-2).
    pub positions: Option<usize>,
    /// The output projection is the token embedding (no `lm_head.weight`).
    pub tied_embeddings: bool,
}

/// The recognised layout.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Layout {
    /// timm `VisionTransformer`.
    TimmVit(VitFacts),
    /// HF transformers `ViTForImageClassification` / `ViTModel`.
    HfVit(VitFacts),
    /// `torch.nn.Transformer`, `TransformerEncoder` or `TransformerDecoder`.
    Transformer(TransformerFacts),
    /// One `torch.nn.MultiheadAttention` (the first if several).
    MultiheadAttention(MhaFacts),
    /// HF transformers' `GPT2LMHeadModel`, `LlamaForCausalLM`,
    /// `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
    /// `SmolLM3ForCausalLM` or `Olmo2ForCausalLM`.
    Decoder(DecoderFacts),
    /// None of the above.
    Unknown,
}

impl Layout {
    /// A human name.
    pub fn describe(&self) -> &'static str {
        match self {
            Layout::TimmVit(_) => "timm VisionTransformer",
            Layout::HfVit(_) => "HF transformers ViT",
            Layout::Transformer(_) => "torch.nn.Transformer",
            Layout::MultiheadAttention(_) => "torch.nn.MultiheadAttention",
            Layout::Decoder(_) => "HF transformers decoder",
            Layout::Unknown => "unknown",
        }
    }
}

struct Names<'a>(&'a [TensorInfo]);

impl<'a> Names<'a> {
    fn shape(&self, name: &str) -> Option<&'a [usize]> {
        self.0.iter().find(|t| t.name == name).map(|t| t.shape.as_slice())
    }
    fn has(&self, name: &str) -> bool {
        self.shape(name).is_some()
    }
    fn dim(&self, name: &str, i: usize) -> Option<usize> {
        self.shape(name).and_then(|s| s.get(i).copied())
    }
    /// The first name ending in `suffix`, with the part in front.
    fn prefix_of(&self, suffix: &str) -> Option<String> {
        self.0
            .iter()
            .find_map(|t| t.name.strip_suffix(suffix).map(str::to_string))
    }
    /// One more than the largest `N` in `{stem}N.…` (layers are numbered
    /// from 0; a gap shows up as missing tensors against a config).
    fn count_indexed(&self, stem: &str) -> usize {
        let idx: BTreeSet<usize> = self
            .0
            .iter()
            .filter_map(|t| t.name.strip_prefix(stem))
            .filter_map(|rest| rest.split('.').next()?.parse().ok())
            .collect();
        // A hostile name (`blocks.18446744073709551615.x`) must not overflow.
        idx.last().map_or(0, |n| n.saturating_add(1))
    }
}

/// Recognises the layout of `tensors`.
pub fn recognise(tensors: &[TensorInfo]) -> Layout {
    let n = Names(tensors);
    if let Some(f) = timm_vit(&n) {
        return Layout::TimmVit(f);
    }
    if let Some(f) = hf_vit(&n) {
        return Layout::HfVit(f);
    }
    if let Some(f) = transformer(&n) {
        return Layout::Transformer(f);
    }
    if let Some(f) = gpt2(&n).or_else(|| llama(&n)) {
        return Layout::Decoder(f);
    }
    if let Some(f) = mha(&n) {
        return Layout::MultiheadAttention(f);
    }
    Layout::Unknown
}

/// GPT-2: `wte`, `wpe` and `h.N` blocks, under `transformer.` or bare.
fn gpt2(n: &Names) -> Option<DecoderFacts> {
    let prefix = if n.has("transformer.wte.weight") {
        "transformer."
    } else {
        ""
    };
    let [vocab, e] = *n.shape(&format!("{prefix}wte.weight"))? else {
        return None;
    };
    let positions = n.dim(&format!("{prefix}wpe.weight"), 0)?;
    Some(DecoderFacts {
        family: "gpt2".into(),
        prefix: prefix.into(),
        vocab_size: vocab,
        hidden_size: e,
        num_layers: n.count_indexed(&format!("{prefix}h.")),
        intermediate_size: n.dim(&format!("{prefix}h.0.mlp.c_fc.weight"), 1),
        num_heads: None,
        num_kv_heads: None,
        kv_dim: None,
        positions: Some(positions),
        tied_embeddings: !n.has("lm_head.weight"),
    })
}

/// Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Phi-3, Gemma 2 and 3:
/// `model.embed_tokens` and `model.layers.N`. The family is the one whose
/// constructor asks for the tensors closest to those of the file's first
/// layer ([`closest_family`]); the sizes are read off the shapes.
fn llama(n: &Names) -> Option<DecoderFacts> {
    let [vocab, e] = *n.shape("model.embed_tokens.weight")? else {
        return None;
    };
    let family = closest_family(n, "model.layers.0.")?;
    let attn = "model.layers.0.self_attn.";
    let kv_dim = n.dim(&format!("{attn}k_proj.weight"), 0);
    let q_dim = n.dim(&format!("{attn}q_proj.weight"), 0);
    // A q norm over one head is as wide as a head (Qwen3's, Gemma 3's);
    // OLMo 2's spans all heads, and tells no head count.
    let head_dim = n
        .dim(&format!("{attn}q_norm.weight"), 0)
        .filter(|&d| d > 0 && family.per_head_norms);
    Some(DecoderFacts {
        family: family.family.into(),
        prefix: "model.".into(),
        vocab_size: vocab,
        hidden_size: e,
        num_layers: n.count_indexed("model.layers."),
        intermediate_size: n
            .dim("model.layers.0.mlp.gate_proj.weight", 0)
            .or_else(|| n.dim("model.layers.0.mlp.gate_up_proj.weight", 0).map(|d| d / 2)),
        num_heads: head_dim.zip(q_dim).map(|(d, q)| q / d),
        num_kv_heads: head_dim.zip(kv_dim).map(|(d, k)| k / d),
        kv_dim,
        positions: None,
        tied_embeddings: !n.has("lm_head.weight"),
    })
}

/// The family ([`FAMILIES`](crate::decoder::families::FAMILIES)) whose
/// constructor's first layer is closest to the tensors under `layer` (the
/// file's first): the most names in common for the names either has
/// (Jaccard), the first listed on a tie. A file that is one family's
/// model matches it exactly; a partial one still gets the family it is
/// most of.
fn closest_family(n: &Names, layer: &str) -> Option<FamilyLayer> {
    let held: BTreeSet<&str> = n.0.iter().filter_map(|t| t.name.strip_prefix(layer)).collect();
    // The families are this crate's own configs: recording them fails
    // only if a constructor does, which the tests would show.
    let families = family_layers().ok()?;
    let score = |f: &FamilyLayer| -> (usize, usize) {
        let common = f.layer.iter().filter(|w| held.contains(w.name.as_str())).count();
        (common, f.layer.len() + held.len() - common)
    };
    let mut best: Option<(FamilyLayer, (usize, usize))> = None;
    for f in families {
        let (common, either) = score(&f);
        // common / either > best_common / best_either, without dividing.
        let better = best
            .as_ref()
            .is_none_or(|(_, (bc, be))| common * be > bc * either);
        if better {
            best = Some((f, (common, either)));
        }
    }
    best.map(|(f, _)| f)
}

/// The image side for a position table of `len` entries over a square
/// grid of `patch`-pixel patches with `prefix` tokens (or none).
fn img_size(len: usize, prefix: usize, patch: usize) -> Option<usize> {
    // Sizes come from a stranger's header: every product is checked.
    let square = |n: usize| {
        let g = (n as f64).sqrt().round() as usize;
        (g > 0 && g.checked_mul(g) == Some(n)).then_some(g)
    };
    len.checked_sub(prefix)
        .and_then(square)
        .or_else(|| square(len))
        .and_then(|g| g.checked_mul(patch))
}

fn timm_vit(n: &Names) -> Option<VitFacts> {
    let w = n.shape("patch_embed.proj.weight")?;
    let [d, c, p, _] = *w else { return None };
    let class_token = n.has("cls_token");
    let reg_tokens = n.dim("reg_token", 1).unwrap_or(0);
    let prefix = usize::from(class_token).saturating_add(reg_tokens);
    Some(VitFacts {
        naming: "timm".into(),
        embed_dim: d,
        depth: n.count_indexed("blocks."),
        num_heads: n
            .dim("blocks.0.attn.q_norm.weight", 0)
            .filter(|&hd| hd > 0 && d % hd == 0)
            .map(|hd| d / hd),
        patch_size: p,
        in_chans: c,
        img_size: n.dim("pos_embed", 1).and_then(|l| img_size(l, prefix, p)),
        num_classes: n.dim("head.weight", 0).unwrap_or(0),
        mlp_hidden_dim: n.dim("blocks.0.mlp.fc1.weight", 0),
        class_token,
        reg_tokens,
        qkv_bias: n.has("blocks.0.attn.qkv.bias"),
        layer_scale: n.has("blocks.0.ls1.gamma"),
    })
}

fn hf_vit(n: &Names) -> Option<VitFacts> {
    let pre = n.prefix_of("embeddings.patch_embeddings.projection.weight")?;
    let w = n.shape(&format!("{pre}embeddings.patch_embeddings.projection.weight"))?;
    let [d, c, p, _] = *w else { return None };
    let class_token = n.has(&format!("{pre}embeddings.cls_token"));
    let layer = format!("{pre}encoder.layer.");
    Some(VitFacts {
        naming: "hf".into(),
        embed_dim: d,
        depth: n.count_indexed(&layer),
        num_heads: None,
        patch_size: p,
        in_chans: c,
        img_size: n
            .dim(&format!("{pre}embeddings.position_embeddings"), 1)
            .and_then(|l| img_size(l, usize::from(class_token), p)),
        num_classes: n.dim("classifier.weight", 0).unwrap_or(0),
        mlp_hidden_dim: n.dim(&format!("{layer}0.intermediate.dense.weight"), 0),
        class_token,
        reg_tokens: 0,
        qkv_bias: n.has(&format!("{layer}0.attention.attention.query.bias")),
        layer_scale: false,
    })
}

fn transformer(n: &Names) -> Option<TransformerFacts> {
    let enc = n.prefix_of("encoder.layers.0.self_attn.in_proj_weight");
    let dec = n.prefix_of("decoder.layers.0.self_attn.in_proj_weight");
    let prefix = enc.clone().or(dec.clone())?;
    let part = if enc.is_some() { "encoder" } else { "decoder" };
    let first = format!("{prefix}{part}.layers.0.");
    Some(TransformerFacts {
        d_model: n.dim(&format!("{first}self_attn.in_proj_weight"), 1)?,
        num_encoder_layers: enc.map_or(0, |p| n.count_indexed(&format!("{p}encoder.layers."))),
        num_decoder_layers: dec.map_or(0, |p| n.count_indexed(&format!("{p}decoder.layers."))),
        dim_feedforward: n.dim(&format!("{first}linear1.weight"), 0),
        prefix,
    })
}

fn mha(n: &Names) -> Option<MhaFacts> {
    let prefix = n.prefix_of("out_proj.weight")?;
    let p = |s: &str| format!("{prefix}{s}");
    let embed_dim = n.dim(&p("out_proj.weight"), 0)?;
    let (kdim, vdim) = if n.has(&p("in_proj_weight")) {
        (embed_dim, embed_dim)
    } else {
        (n.dim(&p("k_proj_weight"), 1)?, n.dim(&p("v_proj_weight"), 1)?)
    };
    Some(MhaFacts {
        embed_dim,
        kdim,
        vdim,
        bias: n.has(&p("in_proj_bias")),
        add_bias_kv: n.has(&p("bias_k")),
        prefix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, shape: &[usize]) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: "F32".into(),
            shape: shape.to_vec(),
            bytes: shape.iter().fold(4usize, |n, &d| n.saturating_mul(d)),
        }
    }

    #[test]
    fn recognises_each_layout() {
        let timm = [
            t("patch_embed.proj.weight", &[64, 1, 4, 4]),
            t("cls_token", &[1, 1, 64]),
            t("pos_embed", &[1, 17, 64]),
            t("blocks.0.mlp.fc1.weight", &[128, 64]),
            t("blocks.3.norm1.weight", &[64]),
            t("head.weight", &[10, 64]),
        ];
        let Layout::TimmVit(f) = recognise(&timm) else {
            panic!("not timm")
        };
        assert_eq!(
            (f.embed_dim, f.depth, f.patch_size, f.img_size, f.num_classes),
            (64, 4, 4, Some(16), 10)
        );
        let mha = [
            t("in_proj_weight", &[48, 16]),
            t("in_proj_bias", &[48]),
            t("out_proj.weight", &[16, 16]),
        ];
        assert!(matches!(
            recognise(&mha),
            Layout::MultiheadAttention(MhaFacts { embed_dim: 16, .. })
        ));
        let tr = [
            t("encoder.layers.0.self_attn.in_proj_weight", &[96, 32]),
            t("encoder.layers.0.self_attn.out_proj.weight", &[32, 32]),
            t("encoder.layers.0.linear1.weight", &[64, 32]),
            t("encoder.layers.1.linear1.weight", &[64, 32]),
            t("decoder.layers.0.self_attn.in_proj_weight", &[96, 32]),
        ];
        let Layout::Transformer(f) = recognise(&tr) else {
            panic!("not a transformer")
        };
        assert_eq!(
            (f.d_model, f.num_encoder_layers, f.num_decoder_layers),
            (32, 2, 1)
        );
        // OLMo 2's q_norm spans all heads: its width tells no head count.
        let olmo2 = [
            t("model.embed_tokens.weight", &[128, 64]),
            t("model.layers.0.self_attn.q_proj.weight", &[64, 64]),
            t("model.layers.0.self_attn.k_proj.weight", &[32, 64]),
            t("model.layers.0.self_attn.q_norm.weight", &[64]),
            t("model.layers.0.self_attn.k_norm.weight", &[32]),
            t("model.layers.0.post_feedforward_layernorm.weight", &[64]),
            t("model.layers.1.mlp.gate_proj.weight", &[128, 64]),
        ];
        let Layout::Decoder(f) = recognise(&olmo2) else {
            panic!("not a decoder")
        };
        assert_eq!(
            (f.family.as_str(), f.num_layers, f.num_heads, f.kv_dim),
            ("olmo2", 2, None, Some(32))
        );
        // Phi-3 fuses q, k, v and gate, up: the MLP width is half gate_up's.
        let phi3 = [
            t("model.embed_tokens.weight", &[128, 64]),
            t("model.layers.0.self_attn.qkv_proj.weight", &[128, 64]),
            t("model.layers.0.mlp.gate_up_proj.weight", &[256, 64]),
        ];
        let Layout::Decoder(f) = recognise(&phi3) else {
            panic!("not a decoder")
        };
        assert_eq!(
            (f.family.as_str(), f.num_layers, f.intermediate_size),
            ("phi3", 1, Some(128))
        );
        assert_eq!(recognise(&[t("x", &[1])]), Layout::Unknown);
    }

    /// Each family's model, recorded from its constructor, is recognised
    /// as that family with its config's sizes, and so is GPT-2's:
    /// recognition and the constructors cannot drift apart.
    #[test]
    fn every_decoder_s_model_is_recognised_as_itself() -> candle::Result<()> {
        use crate::decoder::families::{family_config, recorded, FAMILIES};
        use crate::decoder::{Gpt2, HfDecoderConfig};
        use crate::formats::preflight::{wanted_tensors, Wanted};

        let infos = |wanted: Vec<Wanted>| -> Vec<TensorInfo> {
            wanted.iter().map(|w| t(&w.name, &w.shape)).collect()
        };
        let sizes = r#""vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8"#;
        for (family, options) in FAMILIES {
            for tied in [true, false] {
                let cfg = family_config(options, &format!(r#"{sizes}, "tie_word_embeddings": {tied}"#))?;
                let Layout::Decoder(f) = recognise(&infos(recorded(&cfg, &[])?)) else {
                    panic!("{options}: not a decoder")
                };
                let kv_dim = (family != "phi3").then_some(16);
                assert_eq!(
                    (
                        f.family.as_str(),
                        f.vocab_size,
                        f.hidden_size,
                        f.num_layers,
                        f.intermediate_size,
                        f.kv_dim,
                        f.tied_embeddings
                    ),
                    (family, 32, 16, 3, Some(24), kv_dim, tied),
                    "{options}"
                );
                // A q norm over one head tells the head counts.
                let heads = matches!(family, "qwen3" | "gemma3").then_some((4, 2));
                assert_eq!(f.num_heads.zip(f.num_kv_heads), heads, "{options}");
            }
        }
        let json = r#"{"model_type": "gpt2", "vocab_size": 32, "n_positions": 20, "n_embd": 16, "n_layer": 3,
            "n_head": 4, "n_inner": 24}"#;
        let HfDecoderConfig::Gpt2(cfg) = HfDecoderConfig::from_json(json, "gpt2")? else {
            panic!("not GPT-2")
        };
        let wanted = wanted_tensors(&[], |vb| Gpt2::new(&cfg, vb.pp("transformer"), None))?;
        let Layout::Decoder(f) = recognise(&infos(wanted)) else {
            panic!("GPT-2: not a decoder")
        };
        assert_eq!(
            (
                f.family.as_str(),
                f.prefix.as_str(),
                f.vocab_size,
                f.hidden_size,
                f.num_layers,
                f.intermediate_size,
                f.positions,
                f.tied_embeddings
            ),
            ("gpt2", "transformer.", 32, 16, 3, Some(24), Some(20), true)
        );
        Ok(())
    }

    /// Sizes from a hostile header: no product or sum may overflow (this
    /// panicked in debug builds).
    #[test]
    fn hostile_sizes_do_not_overflow() {
        let big = usize::MAX;
        let timm = [
            t("patch_embed.proj.weight", &[1, 1, big, 1]),
            t("reg_token", &[1, big, 0]),
            t("cls_token", &[1, 1, 1]),
            t("pos_embed", &[1, big, 0]),
            t(&format!("blocks.{big}.norm1.weight"), &[0]),
        ];
        let Layout::TimmVit(f) = recognise(&timm) else {
            panic!("not timm")
        };
        assert_eq!((f.depth, f.img_size), (big, None));
        assert_eq!(img_size(big, 0, 1), None);
        assert_eq!(img_size(16, 0, big), None);
    }
}
