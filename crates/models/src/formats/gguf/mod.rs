//! GGUF files (llama.cpp's format), every part of them in one folder: the
//! header walked for what candle's reader would not refuse (header.rs),
//! the file read and checked tensor by tensor (file.rs), its metadata's
//! typed getters (metadata.rs); the decoders built from it (load.rs, the
//! configs in config.rs and gemma.rs, the mapping over a model's table of
//! tensor names in names.rs: each model keeps its table beside it, in
//! `decoder/llama.rs` and `decoder/gemma.rs`); and the text side it
//! carries: the tokenizer
//! rebuilt from `tokenizer.ggml.*` (text.rs, SentencePiece's in spm.rs),
//! the end tokens and the chat template.

mod config;
mod file;
mod gemma;
mod header;
mod load;
mod metadata;
mod names;
mod spm;
mod text;

pub(crate) use file::Q8_0_BLOCK_BYTES;
pub use file::{
    block_format, dequantize_q8_0, ggml_type_name, is_gguf, stored_dtype, GgufFile, GgufTensorInfo,
    GGUF_TENSOR_TYPES,
};
pub use load::GGUF_ARCHITECTURES;
pub(crate) use names::{GgufNames, NamePair};
pub(crate) use spm::{byte_of, SpmVocab};
pub use text::GGUF_PRE_TOKENIZERS;
