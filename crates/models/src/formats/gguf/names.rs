//! A model's tensors under two names: HF's (`model.layers.N.…`, what the
//! models ask their `VarBuilder` for) and the one llama.cpp's converter
//! writes (`blk.N.…`). Each model keeps its table beside its constructor
//! (`decoder/llama.rs`, `decoder/gemma.rs`); here is only the mapping over
//! a table, from either side to the other.

/// HF's name of a tensor, and the converter's.
pub(crate) type NamePair = (&'static str, &'static str);

/// A model's name table, as gguf-py's tensor map pairs the names: the
/// tensors outside the layers by their whole names, and one layer's by
/// the names after `model.layers.N.` and `blk.N.`. Where a converter's
/// name appears twice in `layer`, the first pair is the one read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GgufNames {
    /// The tensors outside the layers.
    pub top: Vec<NamePair>,
    /// One layer's tensors.
    pub layer: Vec<NamePair>,
}

impl GgufNames {
    /// The converter's name for HF's tensor `hf`.
    pub fn gguf_name(&self, hf: &str) -> Option<String> {
        if let Some(&(_, g)) = self.top.iter().find(|(h, _)| *h == hf) {
            return Some(g.to_string());
        }
        let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
        layer.parse::<usize>().ok()?;
        let &(_, g) = self.layer.iter().find(|(h, _)| *h == rest)?;
        Some(format!("blk.{layer}.{g}"))
    }

    /// HF's name for the converter's tensor `gguf`.
    pub fn hf_name(&self, gguf: &str) -> Option<String> {
        if let Some(&(h, _)) = self.top.iter().find(|(_, g)| *g == gguf) {
            return Some(h.to_string());
        }
        let (layer, rest) = gguf.strip_prefix("blk.")?.split_once('.')?;
        layer.parse::<usize>().ok()?;
        let &(h, _) = self.layer.iter().find(|(_, g)| *g == rest)?;
        Some(format!("model.layers.{layer}.{h}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        let names = GgufNames {
            top: vec![("model.embed_tokens.weight", "token_embd.weight")],
            layer: vec![
                ("mlp.gate_up_proj.weight", "ffn_up.weight"),
                ("mlp.up_proj.weight", "ffn_up.weight"),
                ("self_attn.k_norm.weight", "attn_k_norm.weight"),
            ],
        };
        for (hf, g) in [
            ("model.embed_tokens.weight", "token_embd.weight"),
            (
                "model.layers.11.self_attn.k_norm.weight",
                "blk.11.attn_k_norm.weight",
            ),
            ("model.layers.0.mlp.gate_up_proj.weight", "blk.0.ffn_up.weight"),
        ] {
            assert_eq!(names.gguf_name(hf).as_deref(), Some(g));
            assert_eq!(names.hf_name(g).as_deref(), Some(hf));
        }
        // The second pair of a converter's name maps one way only.
        assert_eq!(
            names.gguf_name("model.layers.0.mlp.up_proj.weight").as_deref(),
            Some("blk.0.ffn_up.weight")
        );
        for bad in [
            "blk.x.attn_k_norm.weight",
            "blk.0.",
            "rope_freqs.weight",
            "blk.0.attn_qkv.weight",
            "output.weight",
        ] {
            assert_eq!(names.hf_name(bad), None, "{bad}");
        }
        assert_eq!(names.gguf_name("model.layers.0."), None);
        assert_eq!(names.gguf_name("lm_head.weight"), None);
    }
}
