//! The Vision Transformer (Dosovitskiy et al., 2021), loading timm and HF
//! transformers checkpoints by their own tensor names.
//!
//! ```
//! use candle::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use multihead_models::vit::{VisionTransformer, VitConfig};
//!
//! # fn main() -> candle::Result<()> {
//! let cfg = VitConfig {
//!     img_size: 32,
//!     patch_size: 8,
//!     embed_dim: 64,
//!     depth: 2,
//!     num_heads: 4,
//!     num_classes: 10,
//!     ..VitConfig::default()
//! };
//! let varmap = VarMap::new();
//! let vit = VisionTransformer::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let images = Tensor::zeros((2, 3, 32, 32), DType::F32, &Device::Cpu)?;
//! assert_eq!(vit.forward(&images)?.dims(), &[2, 10]);
//! // Another image size resamples the position embedding.
//! let out = vit.forward_with_attention(&Tensor::zeros((1, 3, 48, 40), DType::F32, &Device::Cpu)?)?;
//! assert_eq!(out.attentions[0].dims(), &[1, 4, 1 + 6 * 5, 1 + 6 * 5]);
//! # Ok(()) }
//! ```

mod block;
mod config;
mod embed;
pub mod folder;
mod model;
mod pil;
mod preprocess;
mod resample;
mod rollout;

#[allow(deprecated)]
pub use block::VitMlp as Mlp;
pub use block::{Block, LayerScale};
pub use config::{AttentionKind, GlobalPool, ImageResize, Naming, Resampler, VitConfig, MAX_RESIZE_FACTOR};
pub use embed::PatchEmbed;
pub use folder::{ConfigKind, ModelFolder, Weights};
pub use model::{VisionTransformer, VitOutput};
pub use pil::resize_u8;
pub use preprocess::{decode_target, preprocess, preprocess_to, resize_size};
pub use resample::{resample_abs_pos_embed, resize, resize_weights, Interpolation};
pub use rollout::attention_rollout;
