//! Checkpoints from strangers: a safetensors file validated before use,
//! compared with what a model needs before it is built, and described by
//! [`crate::inspect`].
//!
//! ```
//! use multihead_models::checkpoint::Checkpoint;
//!
//! let err = Checkpoint::from_bytes(vec![1, 2, 3], "x.safetensors").unwrap_err();
//! assert!(err.to_string().contains("truncated"));
//! ```

// `Checkpoint`'s methods sit with the concern each serves: opening one
// file and reading its tensors (file.rs), reading a sharded checkpoint
// through its index (`read_sharded`, shards.rs), refusing a config too
// large for the file (`ensure_holds`, beside `MinWeights` in capacity.rs),
// and building a model after the pre-flight (`load`, preflight.rs).
// A GGUF file (llama.cpp's format) has a reader of its own, gguf.rs
// (its metadata's typed getters in gguf/metadata.rs), after its header was
// walked for what candle's reader would not refuse (gguf_header.rs). Both hold their file's bytes mapped (bytes.rs) and
// scan them for NaN and infinity in place (finite.rs).
mod bytes;
mod capacity;
mod dtype;
pub(crate) mod file;
mod finite;
mod folder;
mod gguf;
mod gguf_header;
mod hub_cache;
#[cfg(feature = "hub-download")]
mod hub_download;
mod preflight;
mod shards;

pub use capacity::{checked_product, MinWeights};
pub(crate) use dtype::float_range;
pub use dtype::{LoadOptions, WeightDtype};
pub use file::{Checkpoint, LoadProgress, TensorInfo};
pub use folder::{ModelFiles, Weights};
pub use gguf::{
    block_format, dequantize_q8_0, ggml_type_name, is_gguf, stored_dtype, GgufFile, GgufTensorInfo,
    GGUF_TENSOR_TYPES,
};
pub use hub_cache::{hub_cache_dir, resolve_model};
pub use preflight::{wanted_tensors, Misshaped, NonFinite, NotFloat, Preflight, Wanted};
pub use shards::read_index;
