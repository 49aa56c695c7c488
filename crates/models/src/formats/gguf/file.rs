//! A GGUF file (llama.cpp's format) read from an untrusted source through
//! candle's reader ([`candle::quantized::gguf_file::Content::read`]):
//! every tensor's size and byte range checked against the file before
//! anything is read, every error naming the file and the key or tensor.
//!
//! The tensors come back as candle tensors in the dtype they are stored
//! in (F32, F16, BF16); Q8_0 blocks are dequantized to f32 in one place,
//! [`dequantize_q8_0`]; the other block formats (Q4_0 … Q6_K) come as
//! their bytes ([`GgufFile::blocks`]) for the layers that keep them, or
//! dequantized as ggml does. Other ggml types are refused by name.
//!
//! What llama.cpp's `gguf_init_from_file` and gguf-py's reader refuse is
//! refused here too, where candle's reader would keep the last of two or
//! read whatever bytes an offset points at: a key or tensor name given
//! twice, an offset that is not a multiple of the alignment, tensors whose
//! bytes overlap, data past the end of the file. Tensors may come in any
//! order with gaps between them, as GGUF's spec allows (llama.cpp also
//! asks each to start where the one before it ends, padded).
//!
//! Tensor names and metadata keys are untrusted text: every message shows
//! them through `str::escape_debug`.

use std::collections::HashMap;
use std::io::Cursor;
use std::ops::Range;
use std::path::Path;

use candle::quantized::gguf_file::{Content, Value};
use candle::quantized::GgmlDType;
use candle::{bail, DType, Device, Result, Tensor};
use multihead_attention::{dequantize_row, BlockFormat};
use safetensors::Dtype;

use super::header::check_header;
use crate::checkpoint::WeightDtype;
use crate::formats::bytes::Bytes;
use crate::formats::finite::{
    par_count_at_least, par_count_at_least_q8_0, par_count_non_finite, par_count_non_finite_q8_0,
};
use crate::formats::safetensors::natural_key;

/// The ggml types whose tensors this reader returns.
pub const GGUF_TENSOR_TYPES: [GgmlDType; 13] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q8_0,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// The block format a ggml type's tensors are kept in as stored
/// ([`GgufFile::blocks`]): every block type this reader returns but Q8_0,
/// which the Q8_0 kernels take from its values.
pub fn block_format(t: GgmlDType) -> Option<BlockFormat> {
    Some(match t {
        GgmlDType::Q4_0 => BlockFormat::Q4_0,
        GgmlDType::Q4_1 => BlockFormat::Q4_1,
        GgmlDType::Q5_0 => BlockFormat::Q5_0,
        GgmlDType::Q5_1 => BlockFormat::Q5_1,
        GgmlDType::Q2K => BlockFormat::Q2_K,
        GgmlDType::Q3K => BlockFormat::Q3_K,
        GgmlDType::Q4K => BlockFormat::Q4_K,
        GgmlDType::Q5K => BlockFormat::Q5_K,
        GgmlDType::Q6K => BlockFormat::Q6_K,
        _ => return None,
    })
}

/// Bytes of one Q8_0 block: an f16 scale and 32 signed bytes.
pub(crate) const Q8_0_BLOCK_BYTES: usize = 34;
/// Weights in one Q8_0 block.
const Q8_0_BLOCK: usize = 32;

/// One tensor as the file's header describes it, after the checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// The file's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// How its elements are stored.
    pub ggml_type: GgmlDType,
    /// Dimensions, outermost first (the reverse of ggml's `ne`): a linear
    /// layer's weight is `(out, in)`, as in PyTorch.
    pub shape: Vec<usize>,
    /// Where its bytes are in the file.
    pub range: Range<usize>,
}

/// A validated GGUF file: its metadata and the tensors' byte ranges, each
/// inside the file and of the size its shape and type give.
pub struct GgufFile {
    pub(super) label: String,
    bytes: Bytes,
    /// Read through metadata.rs's typed getters.
    pub(super) metadata: HashMap<String, Value>,
    /// In natural name order.
    tensors: Vec<GgufTensorInfo>,
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("label", &self.label)
            .field("bytes", &self.bytes.len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Whether `path` names a GGUF file: its extension is `.gguf`, or its
/// first bytes are the magic `GGUF`.
pub fn is_gguf(path: &Path) -> bool {
    if path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// The name llama.cpp gives a ggml type (`Q4_K`, ...).
pub fn ggml_type_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "F32",
        GgmlDType::F16 => "F16",
        GgmlDType::BF16 => "BF16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}

impl GgufFile {
    /// Maps `path` read-only and reads its header.
    pub fn read(path: &Path) -> Result<Self> {
        let label = path.display().to_string();
        // An empty file is refused as truncated.
        Self::parse(Bytes::map(path, "GGUF file")?, &label)
    }

    /// Reads a GGUF file held in memory; `label` names it in errors.
    pub fn from_bytes(bytes: Vec<u8>, label: &str) -> Result<Self> {
        Self::parse(Bytes::Owned(bytes), label)
    }

    fn parse(bytes: Bytes, label: &str) -> Result<Self> {
        let len = bytes.len();
        if len < 8 || &bytes[..4] != b"GGUF" {
            bail!("'{label}' is not a GGUF file: it does not start with the magic 'GGUF' (or is truncated: {len} bytes)")
        }
        // candle's reader bounds every string, array and count by the
        // file's size, but not what they take in memory once read, keeps
        // the last of two entries of a name, divides by the alignment and
        // ignores one stored in 64 bits: all are checked first, and the
        // data's start is the header's, not candle's.
        let header = check_header(&bytes, label)?;
        let content = Content::read(&mut Cursor::new(&bytes[..])).map_err(|e| {
            candle::Error::Msg(format!(
                "GGUF file '{label}' ({len} bytes): {}",
                explain(&e.to_string()).escape_debug()
            ))
        })?;
        let data_start = usize::try_from(header.data_start).unwrap_or(usize::MAX);
        let mut tensors = Vec::with_capacity(content.tensor_infos.len());
        for (name, info) in &content.tensor_infos {
            let shape = info.shape.dims().to_vec();
            let name_shown = name.escape_debug();
            let t = info.ggml_dtype;
            let numel = shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .ok_or_else(|| {
                    candle::Error::Msg(format!(
                        "GGUF file '{label}': tensor '{name_shown}' has dims {shape:?}, whose product overflows"
                    ))
                })?;
            // ggml stores whole blocks along each row (the innermost dim).
            let row = shape.last().copied().unwrap_or(1);
            if !row.is_multiple_of(t.block_size()) {
                bail!(
                    "GGUF file '{label}': tensor '{name_shown}' ({}) has rows of {row} elements, not a multiple of the type's block of {}",
                    ggml_type_name(t),
                    t.block_size()
                )
            }
            // As llama.cpp refuses "a size in bytes > SIZE_MAX": 2^62 f32
            // elements are a count, not a size.
            let Some(size) = (numel / t.block_size()).checked_mul(t.type_size()) else {
                bail!(
                    "GGUF file '{label}': tensor '{name_shown}' ({}, dims {shape:?}) has a size in bytes that overflows",
                    ggml_type_name(t)
                )
            };
            if !info.offset.is_multiple_of(header.alignment) {
                bail!(
                    "GGUF file '{label}': tensor '{name_shown}' has data offset {}, not a multiple of the file's alignment {} (general.alignment, else 32): corrupt or hostile",
                    info.offset,
                    header.alignment
                )
            }
            let start = usize::try_from(info.offset)
                .ok()
                .and_then(|o| o.checked_add(data_start));
            let end = start.and_then(|s| s.checked_add(size));
            let range = match (start, end) {
                (Some(s), Some(e)) if e <= len => s..e,
                _ => bail!(
                    "GGUF file '{label}': tensor '{name_shown}' ({}, shape {shape:?}) needs {size} bytes at offset {} of the data, past the end of the file ({len} bytes): truncated or corrupt",
                    ggml_type_name(t),
                    info.offset
                ),
            };
            tensors.push(GgufTensorInfo {
                name: name.clone(),
                ggml_type: t,
                shape,
                range,
            });
        }
        refuse_overlaps(&tensors, data_start, label)?;
        tensors.sort_by_cached_key(|t| natural_key(&t.name));
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            label: label.to_string(),
            bytes,
            metadata: content.metadata,
            tensors,
            index,
        })
    }

    /// The file it was read from.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Its size in bytes.
    pub fn file_size(&self) -> usize {
        self.bytes.len()
    }

    /// Every tensor, in natural name order (`blk.2` before `blk.10`).
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The type its weight matrices are stored in, as the
    /// [`WeightDtype`] that keeps them so: that of the 2-D tensors holding
    /// the most elements (llama.cpp's converter writes every matrix in its
    /// `--outtype`, norms in F32). A file mostly in Q8_0 whose other
    /// matrices are in other block formats (`llama-quantize`'s Q6_K keeps
    /// most matrices of a model whose widths are not multiples of 256 in
    /// Q8_0) is [`WeightDtype::Ggml`]: each matrix kept in its own format,
    /// none quantized a second time. `None` without a matrix of a type this
    /// reader returns.
    pub fn weight_dtype(&self) -> Option<WeightDtype> {
        let keeping = |t: &GgufTensorInfo| match t.ggml_type {
            GgmlDType::F32 => Some(WeightDtype::F32),
            GgmlDType::F16 => Some(WeightDtype::F16),
            GgmlDType::BF16 => Some(WeightDtype::Bf16),
            GgmlDType::Q8_0 => Some(WeightDtype::Q8_0),
            t if block_format(t).is_some() => Some(WeightDtype::Ggml),
            _ => None,
        };
        let most =
            WeightDtype::of_most_matrix_elements(self.tensors.iter().map(|t| (&t.shape[..], keeping(t))));
        let other_blocks = || {
            self.tensors
                .iter()
                .any(|t| t.shape.len() == 2 && keeping(t) == Some(WeightDtype::Ggml))
        };
        match most {
            Some(WeightDtype::Q8_0) if other_blocks() => Some(WeightDtype::Ggml),
            most => most,
        }
    }

    /// Tensor `name`'s description, if the file has it.
    pub fn info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Tensor `name` on `device`: F32, F16 and BF16 in that dtype, as
    /// stored; Q8_0 dequantized to f32 ([`dequantize_q8_0`]). Other ggml
    /// types are refused, naming the tensor and its type.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let Some(info) = self.info(name) else {
            bail!("GGUF file '{}': no tensor '{}'", self.label, name.escape_debug())
        };
        let bytes = &self.bytes[info.range.clone()];
        let shape = info.shape.as_slice();
        let t = match info.ggml_type {
            GgmlDType::F32 => {
                let v: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                Tensor::from_vec(v, shape, device)?
            }
            GgmlDType::F16 => {
                let v: Vec<half::f16> = bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]))
                    .collect();
                Tensor::from_vec(v, shape, device)?
            }
            GgmlDType::BF16 => {
                let v: Vec<half::bf16> = bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]))
                    .collect();
                Tensor::from_vec(v, shape, device)?
            }
            GgmlDType::Q8_0 => dequantize_q8_0(bytes, shape, device)?,
            t if block_format(t).is_some() => {
                let format = block_format(t).expect("matched");
                let k = shape.last().copied().unwrap_or(1);
                let mut v = vec![0f32; bytes.len() / format.block_bytes() * format.block_elems()];
                for (row, out) in bytes
                    .chunks_exact(format.row_bytes(k).max(1))
                    .zip(v.chunks_exact_mut(k.max(1)))
                {
                    dequantize_row(format, row, out);
                }
                Tensor::from_vec(v, shape, device)?
            }
            other => bail!(
                "GGUF file '{}': tensor '{}' is {}",
                self.label,
                name.escape_debug(),
                unsupported(other)
            ),
        };
        debug_assert_eq!(t.dtype(), stored_dtype(info.ggml_type).unwrap_or(DType::F32));
        // The tensor is a copy now: its pages go back (`Bytes::release`).
        self.bytes.release(info.range.clone());
        Ok(t)
    }

    /// Tensor `name`'s blocks as stored, where its type is one of ggml's
    /// block formats ([`block_format`], or Q8_0) and it is a matrix: its format,
    /// its `(rows, cols)` and its bytes (`rows` rows of `cols / block`
    /// blocks). `None` otherwise.
    pub fn blocks(&self, name: &str) -> Option<(BlockFormat, (usize, usize), &[u8])> {
        let info = self.info(name)?;
        let format = match info.ggml_type {
            GgmlDType::Q8_0 => BlockFormat::Q8_0,
            t => block_format(t)?,
        };
        match info.shape[..] {
            [n, k] => Some((format, (n, k), &self.bytes[info.range.clone()])),
            _ => None,
        }
    }

    /// Lets the pages of tensor `name` go (after a copy of its bytes).
    pub(crate) fn release(&self, name: &str) {
        if let Some(info) = self.info(name) {
            self.bytes.release(info.range.clone());
        }
    }

    /// The named tensors holding NaN or infinity, with the counts
    /// `(name, nan, inf)`, as [`crate::formats::safetensors::Checkpoint::non_finite`] gives them:
    /// F32, F16 and BF16 element by element, Q8_0 as the values its blocks
    /// dequantize to (only its f16 scales can be non-finite: a NaN scale
    /// makes 32 NaN, an infinite one ±Inf, and NaN where `q` is 0). Names
    /// not in the file and tensors of other types are skipped. Reads the
    /// stored bytes in place.
    pub fn non_finite<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<Vec<(String, usize, usize)>> {
        let mut bad = Vec::new();
        for name in names {
            let Some(info) = self.info(name) else { continue };
            let bytes = &self.bytes[info.range.clone()];
            let (nan, inf) = match info.ggml_type {
                GgmlDType::F32 => par_count_non_finite(Dtype::F32, bytes),
                GgmlDType::F16 => par_count_non_finite(Dtype::F16, bytes),
                GgmlDType::BF16 => par_count_non_finite(Dtype::BF16, bytes),
                GgmlDType::Q8_0 => par_count_non_finite_q8_0(bytes),
                t => block_format(t).map_or((0, 0), |f| count_non_finite_blocks(f, bytes)),
            };
            self.bytes.release(info.range.clone());
            if nan + inf > 0 {
                bad.push((name.to_string(), nan, inf));
            }
        }
        Ok(bad)
    }

    /// `(count, largest magnitude)` of tensor `name`'s finite values (as
    /// [`GgufFile::tensor`] reads them) whose magnitude is `limit` or
    /// more, read in place; `None` for a name not in the file.
    pub(crate) fn too_large(&self, name: &str, limit: f64) -> Option<(usize, f64)> {
        let info = self.info(name)?;
        let bytes = &self.bytes[info.range.clone()];
        let found = match info.ggml_type {
            GgmlDType::F32 => par_count_at_least(Dtype::F32, bytes, limit),
            GgmlDType::F16 => par_count_at_least(Dtype::F16, bytes, limit),
            GgmlDType::BF16 => par_count_at_least(Dtype::BF16, bytes, limit),
            GgmlDType::Q8_0 => par_count_at_least_q8_0(bytes, limit),
            _ => (0, 0.),
        };
        self.bytes.release(info.range.clone());
        Some(found)
    }
}

/// `(nan, inf)` among the values of `format`'s blocks in `bytes`, as
/// their f16 scales make them: a NaN scale or min makes the block's
/// values NaN, an infinite one infinite (where its factor is not 0, which
/// counts as NaN here too: `0 · ∞`).
fn count_non_finite_blocks(format: BlockFormat, bytes: &[u8]) -> (usize, usize) {
    let (mut nan, mut inf) = (0, 0);
    for block in bytes.chunks_exact(format.block_bytes()) {
        let scales = format
            .f16_fields()
            .iter()
            .map(|&at| half::f16::from_le_bytes([block[at], block[at + 1]]));
        let mut any_nan = false;
        let mut any_inf = false;
        for s in scales {
            any_nan |= s.is_nan();
            any_inf |= s.is_infinite();
        }
        if any_nan || any_inf {
            let mut out = vec![0f32; format.block_elems()];
            dequantize_row(format, block, &mut out);
            nan += out.iter().filter(|v| v.is_nan()).count();
            inf += out.iter().filter(|v| v.is_infinite()).count();
        }
    }
    (nan, inf)
}

/// Refuses two tensors sharing a byte (empty ones share none), naming
/// both with their ranges counted from the data's start, as the header's
/// offsets are: candle's reader would hand each the other's bytes.
fn refuse_overlaps(tensors: &[GgufTensorInfo], data_start: usize, label: &str) -> Result<()> {
    let mut by_start: Vec<&GgufTensorInfo> = tensors.iter().filter(|t| !t.range.is_empty()).collect();
    by_start.sort_by_key(|t| (t.range.start, t.range.end));
    // The tensor reaching furthest so far: any later start before its end
    // overlaps it.
    let mut furthest: Option<&GgufTensorInfo> = None;
    for t in by_start {
        if let Some(f) = furthest {
            if t.range.start < f.range.end {
                let data = |t: &GgufTensorInfo| (t.range.start - data_start)..(t.range.end - data_start);
                bail!(
                    "GGUF file '{label}': tensors '{}' (data bytes {:?}) and '{}' (data bytes {:?}) overlap: a corrupt or hostile file",
                    f.name.escape_debug(),
                    data(f),
                    t.name.escape_debug(),
                    data(t)
                )
            }
        }
        if furthest.is_none_or(|f| t.range.end > f.range.end) {
            furthest = Some(t);
        }
    }
    Ok(())
}

/// The candle dtype [`GgufFile::tensor`] returns for a ggml type, or
/// `None` for a type it refuses.
pub fn stored_dtype(t: GgmlDType) -> Option<DType> {
    match t {
        GgmlDType::F32 | GgmlDType::Q8_0 => Some(DType::F32),
        t if block_format(t).is_some() => Some(DType::F32),
        GgmlDType::F16 => Some(DType::F16),
        GgmlDType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// Why a tensor of type `t` is refused, after "tensor 'x' is ".
fn unsupported(t: GgmlDType) -> String {
    let names: Vec<&str> = GGUF_TENSOR_TYPES.iter().map(|&t| ggml_type_name(t)).collect();
    format!(
        "{}, a ggml type this loader does not read (it reads {})",
        ggml_type_name(t),
        names.join(", ")
    )
}

/// Q8_0 blocks (ggml's `block_q8_0`: an f16 scale `d`, then 32 signed
/// bytes `q`, each weight `d * q`) as an f32 tensor of `shape`, rows
/// along the last dim. The one place Q8_0 weights become floats.
pub fn dequantize_q8_0(bytes: &[u8], shape: &[usize], device: &Device) -> Result<Tensor> {
    let numel: usize = shape.iter().product();
    if bytes.len() != numel / Q8_0_BLOCK * Q8_0_BLOCK_BYTES || !numel.is_multiple_of(Q8_0_BLOCK) {
        bail!(
            "Q8_0: {} bytes do not hold {numel} weights in blocks of {Q8_0_BLOCK}",
            bytes.len()
        )
    }
    let mut out = Vec::with_capacity(numel);
    for block in bytes.chunks_exact(Q8_0_BLOCK_BYTES) {
        let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
        out.extend(block[2..].iter().map(|&q| d * f32::from(q as i8)));
    }
    Tensor::from_vec(out, shape, device)
}

/// candle's message, with what an unknown type number means.
fn explain(msg: &str) -> String {
    match msg.strip_prefix("unknown dtype for tensor ") {
        Some(n) => format!(
            "a tensor has ggml type {n}, which candle's GGUF reader does not know (an IQ or TQ quantization, say); this loader reads {}",
            GGUF_TENSOR_TYPES
                .iter()
                .map(|&t| ggml_type_name(t))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None if msg.contains("failed to fill whole buffer") || msg.contains("remaining") => {
            format!("the header runs past the end of the file: truncated or corrupt ({msg})")
        }
        None => msg.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::quantized::QTensor;

    /// Our Q8_0 blocks read back as candle's own dequantization does, bit
    /// for bit.
    #[test]
    fn q8_0_equals_candle() -> Result<()> {
        let w = Tensor::randn(0f32, 1., (4, 64), &Device::Cpu)?;
        let q = QTensor::quantize(&w, GgmlDType::Q8_0)?;
        let ours = dequantize_q8_0(&q.data()?, &[4, 64], &Device::Cpu)?;
        let theirs = q.dequantize(&Device::Cpu)?;
        let diff = (ours - theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.);
        Ok(())
    }

    #[test]
    fn q8_0_refuses_a_wrong_length() {
        let err = dequantize_q8_0(&[0u8; 33], &[32], &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(err.contains("33 bytes"), "{err}");
    }

    #[test]
    fn refuses_what_is_not_gguf() {
        let err = GgufFile::from_bytes(b"PK\x03\x04 not gguf".to_vec(), "x.gguf")
            .unwrap_err()
            .to_string();
        assert!(err.contains("'x.gguf'") && err.contains("magic"), "{err}");
    }
}
