//! The configuration of a [`crate::transformer::Transformer`], mirroring
//! the constructor of PyTorch's `nn.Transformer`.

use candle::{bail, Result};
use multihead_attention::{MhaConfig, SeqLayout};
use serde::{Deserialize, Serialize};

use crate::formats::safetensors::{checked_product, MinWeights};
use crate::mlp::Activation;

/// Constructor arguments of `torch.nn.Transformer` (and of its layers,
/// which take the same ones). Defaults are PyTorch's.
///
/// `dropout` is kept so that a PyTorch config round-trips, but the modules
/// here run in eval mode only, where dropout is the identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformerConfig {
    /// Model width `E` (`d_model`).
    #[serde(default = "default_d_model")]
    pub d_model: usize,
    /// Attention heads per block; `d_model` must be divisible by it.
    #[serde(default = "default_nhead")]
    pub nhead: usize,
    /// Encoder layers.
    #[serde(default = "default_layers")]
    pub num_encoder_layers: usize,
    /// Decoder layers.
    #[serde(default = "default_layers")]
    pub num_decoder_layers: usize,
    /// Hidden width of each layer's feed-forward block (`linear1`).
    #[serde(default = "default_ff")]
    pub dim_feedforward: usize,
    /// Dropout probability of the PyTorch model (unused here: eval only).
    #[serde(default = "default_dropout")]
    pub dropout: f32,
    /// Feed-forward activation: [`Activation::Relu`] or
    /// [`Activation::Gelu`], the two `nn.Transformer` takes by name.
    #[serde(default)]
    pub activation: Activation,
    /// Epsilon of every LayerNorm.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Whether 3-D inputs are `(batch, seq, feature)`; PyTorch's default is
    /// `(seq, batch, feature)`.
    #[serde(default)]
    pub batch_first: bool,
    /// Pre-norm (`x + f(norm(x))`) instead of post-norm (`norm(x + f(x))`).
    #[serde(default)]
    pub norm_first: bool,
    /// Biases in the linear layers, the attention and the LayerNorms.
    #[serde(default = "default_true")]
    pub bias: bool,
}

fn default_d_model() -> usize {
    512
}
fn default_nhead() -> usize {
    8
}
fn default_layers() -> usize {
    6
}
fn default_ff() -> usize {
    2048
}
fn default_dropout() -> f32 {
    0.1
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}

impl Default for TransformerConfig {
    /// `nn.Transformer()`: the base model of "Attention Is All You Need".
    fn default() -> Self {
        Self::new(default_d_model(), default_nhead())
    }
}

impl TransformerConfig {
    /// PyTorch's defaults with the given width and head count.
    pub fn new(d_model: usize, nhead: usize) -> Self {
        Self {
            d_model,
            nhead,
            num_encoder_layers: default_layers(),
            num_decoder_layers: default_layers(),
            dim_feedforward: default_ff(),
            dropout: default_dropout(),
            activation: Activation::Relu,
            layer_norm_eps: default_eps(),
            batch_first: false,
            norm_first: false,
            bias: true,
        }
    }

    /// Sets the number of encoder and decoder layers.
    pub fn with_layers(mut self, encoder: usize, decoder: usize) -> Self {
        self.num_encoder_layers = encoder;
        self.num_decoder_layers = decoder;
        self
    }

    /// Sets the feed-forward width.
    pub fn with_dim_feedforward(mut self, dim: usize) -> Self {
        self.dim_feedforward = dim;
        self
    }

    /// Sets the activation.
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Sets `batch_first`.
    pub fn with_batch_first(mut self, batch_first: bool) -> Self {
        self.batch_first = batch_first;
        self
    }

    /// Sets `norm_first`.
    pub fn with_norm_first(mut self, norm_first: bool) -> Self {
        self.norm_first = norm_first;
        self
    }

    /// The input layout `batch_first` stands for.
    pub fn layout(&self) -> SeqLayout {
        if self.batch_first {
            SeqLayout::BatchFirst
        } else {
            SeqLayout::SeqFirst
        }
    }

    /// The configuration of every attention block (`self_attn`,
    /// `multihead_attn`).
    pub fn mha(&self) -> MhaConfig {
        MhaConfig::new(self.d_model, self.nhead)
            .with_bias(self.bias)
            .with_dropout(self.dropout)
    }

    /// Adds the fewest weights an `nn.Transformer` of this config stores
    /// (weight matrices only) to `m`, with checked arithmetic.
    #[deprecated(
        note = "a model's sizes are checked as its constructor is recorded: Checkpoint::load_bounded, Checkpoint::budget"
    )]
    pub fn add_min_weights(&self, m: &mut MinWeights) -> Result<()> {
        let (d, ff) = (self.d_model, self.dim_feedforward);
        // Self-attention (4 d x d), feed-forward (2 d x ff); the decoder's
        // cross-attention adds 4 d x d.
        let layer = |attn: usize| {
            checked_product(&[attn, d, d])
                .zip(checked_product(&[2, d, ff]))
                .and_then(|(a, b)| a.checked_add(b))
        };
        let (Some(enc), Some(dec)) = (layer(4), layer(8)) else {
            bail!("TransformerConfig: one layer's weights overflow (d_model {d}, dim_feedforward {ff})")
        };
        m.add(
            format!(
                "encoder (num_encoder_layers {} x {enc} each)",
                self.num_encoder_layers
            ),
            &[self.num_encoder_layers, enc],
        )?;
        m.add(
            format!(
                "decoder (num_decoder_layers {} x {dec} each)",
                self.num_decoder_layers
            ),
            &[self.num_decoder_layers, dec],
        )?;
        Ok(())
    }

    /// The fewest weights a checkpoint of this config stores; see
    /// [`crate::formats::safetensors::Checkpoint::ensure_holds`].
    #[deprecated(
        note = "a model's sizes are checked as its constructor is recorded: Checkpoint::load_bounded, Checkpoint::budget"
    )]
    #[allow(deprecated)]
    pub fn min_weights(&self) -> Result<MinWeights> {
        let mut m = MinWeights::new("TransformerConfig");
        self.add_min_weights(&mut m)?;
        Ok(m)
    }

    /// Checks every value, naming the wrong one.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 || self.nhead == 0 {
            bail!(
                "TransformerConfig: d_model ({}) and nhead ({}) must be > 0",
                self.d_model,
                self.nhead
            )
        }
        if !self.d_model.is_multiple_of(self.nhead) {
            bail!(
                "TransformerConfig: d_model ({}) must be divisible by nhead ({})",
                self.d_model,
                self.nhead
            )
        }
        if self.dim_feedforward == 0 {
            bail!("TransformerConfig: dim_feedforward must be > 0")
        }
        if !matches!(self.activation, Activation::Relu | Activation::Gelu) {
            bail!(
                "TransformerConfig: activation must be relu or gelu (nn.Transformer's), found {:?}",
                self.activation
            )
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!(
                "TransformerConfig: dropout must be in [0, 1), found {}",
                self.dropout
            )
        }
        if !(self.layer_norm_eps > 0. && self.layer_norm_eps.is_finite()) {
            bail!(
                "TransformerConfig: layer_norm_eps must be finite and > 0, found {}",
                self.layer_norm_eps
            )
        }
        Ok(())
    }
}
