//! Layer stacks and the encoder–decoder.
//!
//! Port of `TransformerEncoder`, `TransformerDecoder` and `Transformer` in
//! `torch/nn/modules/transformer.py` (eval mode).

use candle::{bail, Result, Tensor};
use candle_nn::{Module, VarBuilder};
use multihead_attention::LayerNorm;
use multihead_attention::{Mask, PackOptions};

use super::config::TransformerConfig;
use super::layer::{norm, TransformerDecoderLayer, TransformerEncoderLayer};

/// Whether a stack ends in a LayerNorm (`encoder.norm`, `decoder.norm`).
/// `nn.Transformer` always has one; a bare `nn.TransformerEncoder` or
/// `nn.TransformerDecoder` has one only when given `norm=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FinalNorm {
    /// A LayerNorm named `norm` after the last layer.
    #[default]
    LayerNorm,
    /// None.
    None,
}

fn final_norm(cfg: &TransformerConfig, final_norm: FinalNorm, vb: VarBuilder) -> Result<Option<LayerNorm>> {
    match final_norm {
        FinalNorm::LayerNorm => Ok(Some(norm(cfg, vb.pp("norm"))?)),
        FinalNorm::None => Ok(None),
    }
}

/// `num_encoder_layers` encoder layers and a final norm:
/// `torch.nn.TransformerEncoder`. Names: `layers.N.*`, `norm.*`.
///
/// PyTorch's eval fast path turns padded inputs into nested tensors and
/// returns zeros at padded positions; this is the reference path, which
/// computes them like any other position (nothing downstream reads them
/// when the same padding mask is applied to the memory).
#[derive(Debug, Clone)]
pub struct TransformerEncoder {
    layers: Vec<TransformerEncoderLayer>,
    norm: Option<LayerNorm>,
}

impl TransformerEncoder {
    /// `nn.Transformer`'s encoder: `num_encoder_layers` layers and a final
    /// LayerNorm.
    pub fn new(cfg: &TransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with_norm(cfg, FinalNorm::LayerNorm, vb)
    }

    /// An encoder with or without the final LayerNorm.
    pub fn new_with_norm(cfg: &TransformerConfig, norm: FinalNorm, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, norm, &PackOptions::default(), vb)
    }

    /// [`TransformerEncoder::new_with_norm`], its linears packed as `pack`
    /// asks.
    pub(crate) fn build(
        cfg: &TransformerConfig,
        norm: FinalNorm,
        pack: &PackOptions,
        vb: VarBuilder,
    ) -> Result<Self> {
        cfg.validate()?;
        let layers = (0..cfg.num_encoder_layers)
            .map(|i| TransformerEncoderLayer::build(cfg, pack, vb.pp("layers").pp(i)))
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            norm: final_norm(cfg, norm, vb)?,
        })
    }

    /// The layers.
    pub fn layers(&self) -> &[TransformerEncoderLayer] {
        &self.layers
    }

    /// Encodes `src`; `mask` is PyTorch's `mask`, `src_key_padding_mask`
    /// and `is_causal` in one, applied in every layer.
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len, d_model)` when `batch_first`, else
    ///   `(src_len, batch, d_model)`; or unbatched `(src_len, d_model)`
    /// - returns the same shape (the "memory")
    pub fn forward(&self, src: &Tensor, mask: &Mask) -> Result<Tensor> {
        let mut x = src.clone();
        for layer in &self.layers {
            x = layer.forward(&x, mask)?;
        }
        match &self.norm {
            Some(n) => n.forward(&x),
            None => Ok(x),
        }
    }
}

/// `num_decoder_layers` decoder layers and a final norm:
/// `torch.nn.TransformerDecoder`. Names: `layers.N.*`, `norm.*`.
///
/// Incremental decoding with a cache: [`TransformerDecoder::start`] and
/// [`TransformerDecoder::step`] (in `cache.rs`).
#[derive(Debug, Clone)]
pub struct TransformerDecoder {
    pub(crate) layers: Vec<TransformerDecoderLayer>,
    pub(crate) norm: Option<LayerNorm>,
    pub(crate) cfg: TransformerConfig,
}

impl TransformerDecoder {
    /// `nn.Transformer`'s decoder: `num_decoder_layers` layers and a final
    /// LayerNorm.
    pub fn new(cfg: &TransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with_norm(cfg, FinalNorm::LayerNorm, vb)
    }

    /// A decoder with or without the final LayerNorm.
    pub fn new_with_norm(cfg: &TransformerConfig, norm: FinalNorm, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, norm, &PackOptions::default(), vb)
    }

    /// [`TransformerDecoder::new_with_norm`], its linears packed as `pack`
    /// asks.
    pub(crate) fn build(
        cfg: &TransformerConfig,
        norm: FinalNorm,
        pack: &PackOptions,
        vb: VarBuilder,
    ) -> Result<Self> {
        cfg.validate()?;
        let layers = (0..cfg.num_decoder_layers)
            .map(|i| TransformerDecoderLayer::build(cfg, pack, vb.pp("layers").pp(i)))
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            norm: final_norm(cfg, norm, vb)?,
            cfg: cfg.clone(),
        })
    }

    /// The layers.
    pub fn layers(&self) -> &[TransformerDecoderLayer] {
        &self.layers
    }

    /// Decodes the whole target at once (training-style, "teacher
    /// forcing"); for autoregressive generation `tgt_mask` should be
    /// causal ([`multihead_attention::Causal::TopLeft`]).
    ///
    /// # Shapes
    /// - `tgt`: `(batch, tgt_len, d_model)` when `batch_first`, else
    ///   `(tgt_len, batch, d_model)`; or unbatched `(tgt_len, d_model)`
    /// - `memory`: `(batch, src_len, d_model)` in the same layout
    /// - returns the shape of `tgt`
    pub fn forward(
        &self,
        tgt: &Tensor,
        memory: &Tensor,
        tgt_mask: &Mask,
        memory_mask: &Mask,
    ) -> Result<Tensor> {
        let mut x = tgt.clone();
        for layer in &self.layers {
            x = layer.forward(&x, memory, tgt_mask, memory_mask)?;
        }
        self.apply_norm(x)
    }

    pub(crate) fn apply_norm(&self, x: Tensor) -> Result<Tensor> {
        match &self.norm {
            Some(n) => n.forward(&x),
            None => Ok(x),
        }
    }
}

/// The masks of one [`Transformer::forward`] call. Each [`Mask`] joins what
/// PyTorch passes as three arguments:
///
/// | field    | PyTorch arguments |
/// |----------|-------------------|
/// | `src`    | `src_mask`, `src_key_padding_mask`, `src_is_causal` |
/// | `tgt`    | `tgt_mask`, `tgt_key_padding_mask`, `tgt_is_causal` |
/// | `memory` | `memory_mask`, `memory_key_padding_mask`, `memory_is_causal` |
///
/// Shapes are those of the batch-first problem whatever the layout:
/// key padding `(batch, len)`, attention masks `(q_len, kv_len)` or
/// `(batch * nhead, q_len, kv_len)`.
#[derive(Debug, Clone, Default)]
pub struct TransformerMasks {
    /// Encoder self-attention.
    pub src: Mask,
    /// Decoder self-attention; causal for autoregressive models.
    pub tgt: Mask,
    /// Decoder cross-attention over the memory.
    pub memory: Mask,
}

/// The encoder–decoder, `torch.nn.Transformer`: `encoder.*`, `decoder.*`.
/// Embeddings, positions and the output projection are the caller's (see
/// [`crate::transformer::Seq2Seq`] for a complete model).
#[derive(Debug, Clone)]
pub struct Transformer {
    encoder: TransformerEncoder,
    decoder: TransformerDecoder,
    cfg: TransformerConfig,
}

impl Transformer {
    /// Loads `encoder.*` and `decoder.*` (or initialises them from a
    /// `VarMap`).
    pub fn new(cfg: &TransformerConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with(cfg, &PackOptions::default(), vb)
    }

    /// [`Transformer::new`], every linear layer packed as `pack` asks (the
    /// format, the instruction set).
    pub fn new_with(cfg: &TransformerConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            encoder: TransformerEncoder::build(cfg, FinalNorm::LayerNorm, pack, vb.pp("encoder"))?,
            decoder: TransformerDecoder::build(cfg, FinalNorm::LayerNorm, pack, vb.pp("decoder"))?,
            cfg: cfg.clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.cfg
    }

    /// The encoder.
    pub fn encoder(&self) -> &TransformerEncoder {
        &self.encoder
    }

    /// The decoder.
    pub fn decoder(&self) -> &TransformerDecoder {
        &self.decoder
    }

    /// `decoder(tgt, encoder(src))`, PyTorch's `Transformer.forward`.
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len, d_model)` when `batch_first`, else
    ///   `(src_len, batch, d_model)`; or unbatched `(src_len, d_model)`
    /// - `tgt`: `(batch, tgt_len, d_model)` in the same layout
    /// - returns the shape of `tgt`
    pub fn forward(&self, src: &Tensor, tgt: &Tensor, masks: &TransformerMasks) -> Result<Tensor> {
        if src.rank() != tgt.rank() {
            bail!(
                "Transformer: src and tgt must have the same rank, found {:?} and {:?}",
                src.dims(),
                tgt.dims()
            )
        }
        let e = self.cfg.d_model;
        if src.dims().last() != Some(&e) || tgt.dims().last() != Some(&e) {
            bail!(
                "Transformer: src {:?} and tgt {:?} must both end in d_model = {e}",
                src.dims(),
                tgt.dims()
            )
        }
        if src.rank() == 3 {
            let batch_dim = usize::from(!self.cfg.batch_first);
            if src.dim(batch_dim)? != tgt.dim(batch_dim)? {
                bail!(
                    "Transformer: batch sizes of src {:?} and tgt {:?} differ",
                    src.dims(),
                    tgt.dims()
                )
            }
        }
        let memory = self.encoder.forward(src, &masks.src)?;
        self.decoder.forward(tgt, &memory, &masks.tgt, &masks.memory)
    }
}
