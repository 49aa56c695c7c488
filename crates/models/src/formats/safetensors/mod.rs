//! safetensors files from strangers: one file validated before use
//! (file.rs), a checkpoint saved in shards read through its index
//! (shards.rs), a config's sizes compared with what the file can hold
//! before its model is built (capacity.rs), and the file compared with
//! what the model asks for, then read into it (load.rs).
//!
//! ```
//! use multihead_models::formats::safetensors::Checkpoint;
//!
//! let err = Checkpoint::from_bytes(vec![1, 2, 3], "x.safetensors").unwrap_err();
//! assert!(err.to_string().contains("truncated"));
//! ```

mod capacity;
mod file;
mod load;
mod shards;

pub use capacity::{checked_product, MinWeights};
pub(crate) use file::{export_hint, is_pickle, natural_key, pickle_error};
pub use file::{Checkpoint, LoadProgress, TensorInfo};
pub use shards::read_index;
