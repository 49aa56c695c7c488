//! A model's weights as a whole, whatever their format: where they are
//! (a folder and its config files, [`ModelFiles`]; a model named as on
//! the Hugging Face hub, [`resolve_model`]) and how they load
//! ([`LoadOptions`], [`WeightDtype`]). Reading each file format is
//! [`crate::formats`]' work.
//!
//! ```
//! use multihead_models::checkpoint::{LoadOptions, ModelFiles, WeightDtype};
//!
//! // A folder resolves to its weights and the configs beside them.
//! let files = ModelFiles::resolve("../../tests/fixtures/decoders/llama".as_ref())?;
//! assert!(files.beside("config.json").is_file());
//! let opts = LoadOptions {
//!     dtype: "bf16".parse()?,
//!     ..LoadOptions::default()
//! };
//! assert_eq!(opts.dtype, WeightDtype::Bf16);
//! # Ok::<(), candle::Error>(())
//! ```

mod dtype;
mod folder;
mod hub_cache;
#[cfg(feature = "hub-download")]
mod hub_download;

pub(crate) use dtype::{float_dtype, float_range};
pub use dtype::{LoadOptions, WeightDtype};
pub use folder::{ModelFiles, Weights};
pub use hub_cache::{hub_cache_dir, resolve_model};

// The file formats' items, reachable here too: each group names the
// module that defines it.

/// A safetensors file and its checks: [`crate::formats::safetensors`].
pub use crate::formats::safetensors::{
    checked_product, read_index, Checkpoint, LoadProgress, MinWeights, TensorInfo,
};

/// A GGUF file: [`crate::formats::gguf`].
pub use crate::formats::gguf::{
    block_format, dequantize_q8_0, ggml_type_name, is_gguf, stored_dtype, GgufFile, GgufTensorInfo,
    GGUF_TENSOR_TYPES,
};

/// A file compared with what a model needs: [`crate::formats::preflight`].
pub use crate::formats::preflight::{wanted_tensors, Misshaped, NonFinite, NotFloat, Preflight, Wanted};
