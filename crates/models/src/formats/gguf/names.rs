//! The tensor names of each architecture: HF's (`model.layers.N.…`, what
//! the models ask their `VarBuilder` for) beside the ones llama.cpp's
//! converter writes (`blk.N.…`), as gguf-py's tensor map pairs them.

use super::config::Arch;

/// HF's names for one layer's tensors (after `model.layers.N.`) and the
/// converter's (after `blk.N.`), but for the block's norms.
const LAYER_NAMES: [(&str, &str); 16] = [
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.o_proj.bias", "attn_output.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.gate_proj.bias", "ffn_gate.bias"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.up_proj.bias", "ffn_up.bias"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("mlp.down_proj.bias", "ffn_down.bias"),
];

/// The block's norms, by arch, as gguf-py's tensor map gives each: HF's
/// `post_attention_layernorm` is the norm before the MLP in Llama
/// (`ffn_norm`) and the one after attention in OLMo 2 and the Gemmas
/// (`post_attention_norm`), whose norm before the MLP
/// (`pre_feedforward_layernorm`) is `ffn_norm`.
fn norm_names(arch: Arch) -> &'static [(&'static str, &'static str)] {
    match arch {
        Arch::Olmo2 => &[
            ("post_attention_layernorm.weight", "post_attention_norm.weight"),
            ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
        ],
        Arch::Gemma2 | Arch::Gemma3 => &[
            ("input_layernorm.weight", "attn_norm.weight"),
            ("post_attention_layernorm.weight", "post_attention_norm.weight"),
            ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
            ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
        ],
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::SmolLm3 | Arch::Phi3 => &[
            ("input_layernorm.weight", "attn_norm.weight"),
            ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ],
    }
}

/// Phi-3's fused projections, before [`LAYER_NAMES`] in arch `phi3`
/// files: `ffn_up` holds the gate's rows, then the up rows.
const PHI3_LAYER_NAMES: [(&str, &str); 2] = [
    ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
    ("mlp.gate_up_proj.weight", "ffn_up.weight"),
];

/// One layer's names (HF's, the converter's) for arch `arch`.
fn layer_names(arch: Arch) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    let fused: &[_] = match arch {
        Arch::Phi3 => &PHI3_LAYER_NAMES,
        _ => &[],
    };
    fused.iter().chain(&LAYER_NAMES).chain(norm_names(arch))
}

/// The names outside the layers (HF's, the converter's) for arch `arch`:
/// gguf-py's `gemma2` has no `output` (llama.cpp's Gemma 2 always projects
/// with the embeddings).
fn top_names(arch: Arch) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    TOP_NAMES
        .iter()
        .filter(move |(h, _)| arch != Arch::Gemma2 || *h != "lm_head.weight")
}

/// HF's names for the tensors outside the layers, and the converter's.
const TOP_NAMES: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// The converter's name for HF's tensor `hf` of arch `arch`.
pub(super) fn gguf_name(hf: &str, arch: Arch) -> Option<String> {
    if let Some(&(_, g)) = top_names(arch).find(|(h, _)| *h == hf) {
        return Some(g.to_string());
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let &(_, g) = layer_names(arch).find(|(h, _)| *h == rest)?;
    Some(format!("blk.{layer}.{g}"))
}

/// HF's name for the converter's tensor `gguf` of arch `arch`.
pub(super) fn hf_name(gguf: &str, arch: Arch) -> Option<String> {
    if let Some(&(h, _)) = top_names(arch).find(|(_, g)| *g == gguf) {
        return Some(h.to_string());
    }
    let (layer, rest) = gguf.strip_prefix("blk.")?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let &(h, _) = layer_names(arch).find(|(_, g)| *g == rest)?;
    Some(format!("model.layers.{layer}.{h}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for (hf, g) in [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("lm_head.weight", "output.weight"),
            (
                "model.layers.11.self_attn.k_norm.weight",
                "blk.11.attn_k_norm.weight",
            ),
            ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
        ] {
            for arch in [Arch::Llama, Arch::Olmo2, Arch::Gemma3] {
                assert_eq!(gguf_name(hf, arch).as_deref(), Some(g));
                assert_eq!(hf_name(g, arch).as_deref(), Some(hf));
            }
        }
        // The norms' names depend on the arch (gguf-py's map for `olmo2`
        // and the Gemmas against `llama`'s).
        let post = "model.layers.3.post_attention_layernorm.weight";
        assert_eq!(
            gguf_name(post, Arch::Llama).as_deref(),
            Some("blk.3.ffn_norm.weight")
        );
        for arch in [Arch::Olmo2, Arch::Gemma2] {
            assert_eq!(
                gguf_name(post, arch).as_deref(),
                Some("blk.3.post_attention_norm.weight")
            );
            assert_eq!(
                hf_name("blk.3.post_ffw_norm.weight", arch).as_deref(),
                Some("model.layers.3.post_feedforward_layernorm.weight")
            );
        }
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight", Arch::Gemma2).as_deref(),
            Some("model.layers.3.pre_feedforward_layernorm.weight")
        );
        assert_eq!(hf_name("blk.3.ffn_norm.weight", Arch::Olmo2), None);
        assert_eq!(hf_name("blk.3.post_ffw_norm.weight", Arch::Llama), None);
        assert_eq!(hf_name("blk.3.attn_norm.weight", Arch::Olmo2), None);
        // gguf-py's `gemma2` has no output projection; `gemma3`'s has.
        assert_eq!(hf_name("output.weight", Arch::Gemma2), None);
        assert_eq!(
            hf_name("output.weight", Arch::Gemma3).as_deref(),
            Some("lm_head.weight")
        );
        // Phi-3's fused projections; `ffn_up` is the gate and up in one.
        for (hf, g) in [
            (
                "model.layers.1.self_attn.qkv_proj.weight",
                "blk.1.attn_qkv.weight",
            ),
            ("model.layers.0.mlp.gate_up_proj.weight", "blk.0.ffn_up.weight"),
        ] {
            assert_eq!(gguf_name(hf, Arch::Phi3).as_deref(), Some(g));
            assert_eq!(hf_name(g, Arch::Phi3).as_deref(), Some(hf));
        }
        assert_eq!(
            hf_name("blk.0.ffn_up.weight", Arch::Llama).as_deref(),
            Some("model.layers.0.mlp.up_proj.weight")
        );
        assert_eq!(hf_name("blk.0.attn_qkv.weight", Arch::Llama), None);
        for bad in [
            "blk.x.attn_q.weight",
            "blk.0.",
            "rope_freqs.weight",
            "blk.0.attn_qkv.weight",
        ] {
            assert_eq!(hf_name(bad, Arch::Llama), None, "{bad}");
        }
        assert_eq!(gguf_name("model.layers.0.", Arch::Llama), None);
    }
}
