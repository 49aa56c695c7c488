//! The checkpoint layouts a [`crate::MultiheadAttention`] loads, by their
//! real state_dict names.

/// How the projections of an attention block are stored in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum WeightLayout {
    /// PyTorch `nn.MultiheadAttention`: `in_proj_weight` `(3E, E)` and
    /// `in_proj_bias` `(3E)`, or `q_proj_weight` `(E, E)`, `k_proj_weight`
    /// `(E, kdim)`, `v_proj_weight` `(E, vdim)` when `kdim`/`vdim` differ
    /// from `embed_dim`; `out_proj.weight`, `out_proj.bias`; `bias_k`,
    /// `bias_v` `(1, 1, E)`.
    #[default]
    PyTorch,
    /// One linear module per projection (`<name>.weight`, `<name>.bias`),
    /// e.g. HF transformers' ViT or BART-style `q_proj`/`k_proj`/...
    Separate(SeparateNames),
    /// timm's fused `qkv` `(3E, E)` and output `proj` linears
    /// (`timm.models.vision_transformer.Attention`). Needs
    /// `kdim == vdim == embed_dim`.
    FusedQkv {
        /// Name of the fused input projection (timm: `qkv`).
        qkv: String,
        /// Name of the output projection (timm: `proj`).
        proj: String,
    },
    /// GPT-2's `Conv1D` modules (`transformers.pytorch_utils.Conv1D`):
    /// fused `c_attn.weight` `(E, 3E)` and `c_proj.weight` `(E, E)`, stored
    /// `(in, out)`, transposed from `nn.Linear`'s; biases as usual. Needs
    /// `kdim == vdim == embed_dim`.
    Conv1D {
        /// Name of the fused input projection (GPT-2: `c_attn`).
        c_attn: String,
        /// Name of the output projection (GPT-2: `c_proj`).
        c_proj: String,
    },
}

impl WeightLayout {
    /// timm ViT: `qkv` and `proj`.
    pub fn timm() -> Self {
        Self::FusedQkv {
            qkv: "qkv".into(),
            proj: "proj".into(),
        }
    }

    /// HF transformers GPT-2, relative to `transformer.h.N.attn`: `c_attn`
    /// and `c_proj`.
    pub fn gpt2() -> Self {
        Self::Conv1D {
            c_attn: "c_attn".into(),
            c_proj: "c_proj".into(),
        }
    }

    /// HF transformers Llama / Mistral, relative to
    /// `model.layers.N.self_attn`: `q_proj`, `k_proj`, `v_proj`, `o_proj`.
    pub fn llama() -> Self {
        Self::Separate(SeparateNames {
            out: "o_proj".into(),
            ..SeparateNames::default()
        })
    }

    /// HF transformers ViT, relative to `vit.encoder.layer.N.attention`.
    pub fn hf_vit() -> Self {
        Self::Separate(SeparateNames::hf_vit())
    }
}

/// Names of separate q/k/v/out linear modules. Names may contain dots: they
/// are resolved with `VarBuilder::pp`, relative to the attention block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeparateNames {
    /// Query projection.
    pub q: String,
    /// Key projection.
    pub k: String,
    /// Value projection.
    pub v: String,
    /// Output projection.
    pub out: String,
}

impl SeparateNames {
    /// HF transformers `ViTAttention`: `attention.query`, `attention.key`,
    /// `attention.value`, `output.dense`.
    pub fn hf_vit() -> Self {
        Self {
            q: "attention.query".into(),
            k: "attention.key".into(),
            v: "attention.value".into(),
            out: "output.dense".into(),
        }
    }
}

impl Default for SeparateNames {
    /// `q_proj`, `k_proj`, `v_proj`, `out_proj` (BART, Whisper, Llama).
    fn default() -> Self {
        Self {
            q: "q_proj".into(),
            k: "k_proj".into(),
            v: "v_proj".into(),
            out: "out_proj".into(),
        }
    }
}
