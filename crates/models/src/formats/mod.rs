//! Files from strangers, one room per format, each read as untrusted
//! input (every size checked before it is used, every error naming the
//! file):
//!
//! - [`safetensors`]: a weights file validated before use, a checkpoint
//!   saved in shards, a config's sizes compared with what a file can hold;
//! - [`gguf`]: llama.cpp's files, all of it: the header guard, the
//!   reader, the metadata, the decoders built from a file and the
//!   tokenizer and chat template rebuilt from its metadata;
//! - [`preflight`]: what a model asks for compared with what a file holds,
//!   the report both weight formats fill before any weight is read;
//! - [`inspect`]: what a weights file is and holds, one report for either
//!   format (`multihead inspect` prints it);
//! - [`files`]: bounded reads of regular files (configs, tokenizers, the
//!   images' bytes);
//! - `image_input` (feature `image`): PNG and JPEG decoded under size
//!   limits.
//!
//! Both weight formats hold their file mapped (bytes.rs) and scan it for
//! NaN and infinity in place (finite.rs).
//!
//! [`crate::checkpoint`] is not a format and stays apart: it finds a
//! model's files (a folder and its configs, a hub name in the local cache)
//! and says how they load ([`crate::checkpoint::LoadOptions`]), which a
//! caller decides before any file is opened. A reader asking how a file's
//! bytes are checked looks here; one asking how `--model NAME` is found or
//! what `--dtype` does looks there.

pub(crate) mod bytes;
pub mod files;
pub(crate) mod finite;
pub mod gguf;
#[cfg(feature = "image")]
pub mod image_input;
pub mod inspect;
pub mod preflight;
pub mod safetensors;
