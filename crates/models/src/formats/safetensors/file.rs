//! A safetensors file read from an untrusted source: its header checked
//! before any tensor is touched, every error naming the file.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use candle::{Device, Result, Tensor};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use serde::Serialize;

use crate::checkpoint::WeightDtype;
use crate::formats::bytes::Bytes;
use crate::formats::finite::{par_count_at_least, par_count_non_finite};

/// One tensor as the header describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TensorInfo {
    /// The checkpoint's name, e.g. `blocks.0.attn.qkv.weight`.
    pub name: String,
    /// safetensors' dtype name (`F32`, `F16`, `BF16`, `I64`, ...).
    pub dtype: String,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Size of the data in bytes.
    pub bytes: usize,
}

impl TensorInfo {
    /// Number of elements (`usize::MAX` if the shape overflows, which a
    /// validated header never has).
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// Whether the dtype is one a float weight may be stored in (and is
    /// converted from on loading).
    pub fn is_float(&self) -> bool {
        matches!(self.dtype.as_str(), "F32" | "F16" | "BF16" | "F64")
    }
}

/// The one-line export a user can run on the pickle `src`, writing the
/// safetensors file `dst`, for the error message. It takes the state dict
/// a training script may have wrapped (`state_dict`, `model`), and copies
/// every tensor: `save_file` refuses tensors that share memory, as a tied
/// embedding and output projection do, and copies share none (a tied
/// model's file then holds the projection too, which the decoders load as
/// HF transformers does: `decoder::config::ties_in`).
pub(crate) fn export_hint(src: &str, dst: &str) -> String {
    format!(
        "export it once with: python -c \"import torch; from safetensors.torch import save_file; \
         sd = torch.load('{src}', map_location='cpu', weights_only=True); \
         sd = sd.get('state_dict', sd.get('model', sd)); \
         save_file({{k: v.contiguous().clone() for k, v in sd.items()}}, '{dst}')\""
    )
}

/// Whether `path` names a PyTorch pickle by its extension (`.bin`, `.pt`,
/// `.pth`, `.ckpt`, `.pkl`).
pub(crate) fn is_pickle(path: &Path) -> bool {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    matches!(ext.as_deref(), Some("bin" | "pt" | "pth" | "ckpt" | "pkl"))
}

pub(crate) fn pickle_error(label: &str) -> candle::Error {
    candle::Error::Msg(format!(
        "'{label}' is a PyTorch pickle, not safetensors: loading a pickle can run arbitrary code, \
         so multihead does not read them; {}",
        export_hint(label, &format!("{label}.safetensors"))
    ))
}

/// Whether the bytes start like `torch.save` output: a zip archive (the
/// default since PyTorch 1.6) or a bare pickle (protocol 2 to 5).
fn looks_like_pickle(bytes: &[u8]) -> bool {
    bytes.starts_with(b"PK\x03\x04") || (bytes.len() >= 2 && bytes[0] == 0x80 && (2..=5).contains(&bytes[1]))
}

/// What a safetensors error means for someone holding the file.
fn explain(e: &SafeTensorError, len: usize) -> String {
    match e {
        SafeTensorError::HeaderTooSmall => {
            format!("file is truncated: {len} bytes, too short for the 8-byte header length")
        }
        SafeTensorError::InvalidHeaderLength => {
            format!("header length runs past the end of the file ({len} bytes): truncated or not safetensors")
        }
        SafeTensorError::HeaderTooLarge => "header length is over safetensors' 100 MB limit".into(),
        SafeTensorError::InvalidHeader(_) => "header is not UTF-8 text".into(),
        SafeTensorError::InvalidHeaderDeserialization(err) => {
            format!("header is not a valid safetensors JSON header: {err}")
        }
        SafeTensorError::InvalidOffset(name) => format!(
            "tensor '{name}' has data_offsets that overlap another tensor, leave a gap, or run past the data"
        ),
        SafeTensorError::MetadataIncompleteBuffer => {
            "data offsets do not end where the file ends: truncated file, or offsets past the data".into()
        }
        SafeTensorError::TensorInvalidInfo => {
            "a tensor's byte range does not match its shape and dtype".into()
        }
        SafeTensorError::ValidationOverflow => "a tensor's shape overflows when multiplied out".into(),
        other => other.to_string(),
    }
}

/// A tensor's dtype, the index of its file, and its bytes' range there.
type Stored = (Dtype, usize, Range<usize>);

/// Told `(bytes read, bytes in all)` after each tensor a model is built
/// from: a progress bar while a large folder loads.
#[derive(Clone)]
pub struct LoadProgress(pub Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for LoadProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadProgress(..)")
    }
}

/// A validated safetensors file: mapped read-only when read from disk
/// (no copy of the file is made; the pages a tensor was read from are
/// handed back once it is converted), or held in memory.
///
/// Reading checks the whole header (length, JSON, dtypes, offsets
/// covering the data exactly, shapes matching byte sizes) through
/// `SafeTensors::deserialize`; its errors are rephrased for the user and
/// carry the file's name.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    label: String,
    /// The files: one, or a sharded checkpoint's shards.
    files: Vec<Arc<Bytes>>,
    tensors: Vec<TensorInfo>,
    /// Per entry of `tensors`: where its data lies, so that a tensor is
    /// read without parsing the header again.
    data: Vec<Stored>,
    /// Name -> index into `tensors`: lookups stay O(1) for headers with
    /// hundreds of thousands of entries.
    index: HashMap<String, usize>,
    metadata: Vec<(String, String)>,
    progress: Option<LoadProgress>,
    /// The dtype [`Checkpoint::load`] gives the weight matrices, where
    /// set; else the model's.
    matrices: Option<WeightDtype>,
}

impl Checkpoint {
    /// The same, telling `progress` how far [`Checkpoint::load`] got.
    pub fn with_progress(mut self, progress: Option<LoadProgress>) -> Self {
        self.progress = progress;
        self
    }

    /// The same, giving the model's weight matrices (its 2-D tensors)
    /// `dtype` in [`Checkpoint::load`], whatever the model asks for; `None`:
    /// the model's dtype for every tensor.
    pub fn with_weight_dtype(mut self, dtype: Option<WeightDtype>) -> Self {
        self.matrices = dtype;
        self
    }

    /// The dtype the weight matrices load in, if set.
    pub(crate) fn weight_dtype(&self) -> Option<WeightDtype> {
        self.matrices
    }

    /// The progress callback, if one was set.
    pub(crate) fn progress(&self) -> Option<&LoadProgress> {
        self.progress.as_ref()
    }

    /// Reads `path`; refuses PyTorch pickles (`.bin`, `.pt`, `.pth`,
    /// `.ckpt`) with the command that converts them.
    pub fn read(path: &Path) -> Result<Self> {
        let label = path.display().to_string();
        if is_pickle(path) {
            return Err(pickle_error(&label));
        }
        // An empty file is refused as truncated.
        Self::parse(Bytes::map(path, "weights")?, &label)
    }

    /// Parses `bytes`; `label` names the file in errors.
    ///
    /// Linear in the number of tensors (after the sort by name): the
    /// header is parsed once and every later lookup goes through an index.
    pub fn from_bytes(bytes: Vec<u8>, label: &str) -> Result<Self> {
        Self::parse(Bytes::Owned(bytes), label)
    }

    fn parse(bytes: Bytes, label: &str) -> Result<Self> {
        // `deserialize` checks the header and every tensor's byte range.
        let st = match SafeTensors::deserialize(&bytes) {
            Ok(st) => st,
            Err(_) if looks_like_pickle(&bytes) => return Err(pickle_error(label)),
            Err(e) => return Err(bad_file(label, &e, bytes.len())),
        };
        let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| bad_file(label, &e, bytes.len()))?;
        let base = bytes.as_ptr() as usize;
        let mut entries: Vec<(TensorInfo, Stored)> = st
            .iter()
            .map(|(name, view)| {
                // The view borrows `bytes`: its offset is where it starts.
                let start = view.data().as_ptr() as usize - base;
                let info = TensorInfo {
                    name: name.to_string(),
                    dtype: dtype_name(view.dtype()),
                    shape: view.shape().to_vec(),
                    bytes: view.data().len(),
                };
                (info, (view.dtype(), 0, start..start + view.data().len()))
            })
            .collect();
        drop(st);
        // One key per name, not one per comparison.
        entries.sort_by_cached_key(|(info, _)| natural_key(&info.name));
        let (tensors, data): (Vec<TensorInfo>, Vec<_>) = entries.into_iter().unzip();
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let mut metadata: Vec<(String, String)> =
            meta.metadata().clone().unwrap_or_default().into_iter().collect();
        metadata.sort();
        Ok(Self {
            label: label.to_string(),
            files: vec![Arc::new(bytes)],
            tensors,
            data,
            index,
            metadata,
            progress: None,
            matrices: None,
        })
    }

    /// The file's name as given.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Every tensor, in natural name order (`blocks.2` before `blocks.10`).
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The header's `__metadata__`, sorted by key.
    pub fn metadata(&self) -> &[(String, String)] {
        &self.metadata
    }

    /// The tensor named `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Size of the file in bytes (of all the shards, for a sharded one).
    pub fn file_size(&self) -> usize {
        self.files.iter().map(|f| f.len()).sum()
    }

    /// Total number of elements over all tensors (saturating; a
    /// validated file holds at most a few elements per byte).
    pub fn total_params(&self) -> usize {
        self.tensors
            .iter()
            .fold(0usize, |n, t| n.saturating_add(t.numel()))
    }

    /// Tensor `name` on `device` in its stored dtype; a boolean tensor
    /// (`BOOL`, what `safetensors.torch.save_file` writes for `torch.bool`,
    /// one byte each) becomes `u8`, non-zero = true: candle has no bool
    /// dtype, and the attention masks take `u8` for booleans.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let (info, (dtype, _, _), bytes) = self
            .index
            .get(name)
            .map(|&i| (&self.tensors[i], &self.data[i], self.slice(i)))
            .ok_or_else(|| candle::Error::Msg(format!("weights '{}': no tensor '{name}'", self.label)))?;
        // An empty tensor may have other dims whose product overflows
        // (`[0, 2^40, 2^40]` is valid safetensors): candle's strides would.
        if info
            .shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .is_none()
        {
            candle::bail!(
                "weights '{}': tensor '{name}' has shape {:?}, whose strides overflow",
                self.label,
                info.shape
            )
        }
        let dtype = match dtype {
            Dtype::BOOL => &Dtype::U8,
            d => d,
        };
        let view = TensorView::new(*dtype, info.shape.clone(), bytes)
            .map_err(|e| candle::Error::Msg(format!("weights '{}': tensor '{name}': {e}", self.label)))?;
        candle::safetensors::Load::load(&view, device)
    }

    /// Tensor `name` as f32 on the CPU when it is stored as bf16, widened
    /// straight from the stored bytes (bf16 is f32's top half: exact), with
    /// no bf16 copy first; `None` for other dtypes.
    pub(crate) fn bf16_as_f32(&self, name: &str) -> Result<Option<Tensor>> {
        let Some(&i) = self.index.get(name) else {
            return Ok(None);
        };
        if self.data[i].0 != Dtype::BF16 {
            return Ok(None);
        }
        let values: Vec<f32> = self
            .slice(i)
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect();
        Tensor::from_vec(values, self.tensors[i].shape.as_slice(), &Device::Cpu).map(Some)
    }

    /// The named float tensors holding NaN or infinity, with the counts:
    /// `(name, nan, inf)`. Integer tensors and names not in the file are
    /// skipped. Reads the stored bytes in place: no copy, no allocation
    /// per tensor.
    pub fn non_finite<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<Vec<(String, usize, usize)>> {
        let mut bad = Vec::new();
        for name in names {
            let Some(&i) = self.index.get(name) else { continue };
            let (nan, inf) = par_count_non_finite(self.data[i].0, self.slice(i));
            self.release(i);
            if nan + inf > 0 {
                bad.push((name.to_string(), nan, inf));
            }
        }
        Ok(bad)
    }

    /// Whether tensors `a` and `b` are both in the file with the same
    /// dtype, shape and stored bytes. Read in place; their pages are handed
    /// back after.
    pub(crate) fn same_values(&self, a: &str, b: &str) -> bool {
        let (Some(&i), Some(&j)) = (self.index.get(a), self.index.get(b)) else {
            return false;
        };
        let same = self.data[i].0 == self.data[j].0
            && self.tensors[i].shape == self.tensors[j].shape
            && self.slice(i) == self.slice(j);
        self.release(i);
        self.release(j);
        same
    }

    /// `(count, largest magnitude)` of tensor `name`'s finite values whose
    /// magnitude is `limit` or more, read in place; `None` for a name not
    /// in the file.
    pub(crate) fn too_large(&self, name: &str, limit: f64) -> Option<(usize, f64)> {
        let &i = self.index.get(name)?;
        let found = par_count_at_least(self.data[i].0, self.slice(i), limit);
        self.release(i);
        Some(found)
    }

    /// The stored bytes of tensor `i`.
    fn slice(&self, i: usize) -> &[u8] {
        let (_, file, range) = &self.data[i];
        &self.files[*file][range.clone()]
    }

    /// Hands the pages of tensor `i` back to the system once they were
    /// read, where its file is mapped (they stay in the page cache, and are
    /// read again if needed): loading then holds the model and one
    /// tensor's pages, not the model and the file.
    fn release(&self, i: usize) {
        let (_, file, range) = &self.data[i];
        self.files[*file].release(range.clone());
    }

    /// Hands tensor `name`'s pages back (see [`Checkpoint::release`]) and
    /// returns its size in bytes.
    pub(crate) fn release_named(&self, name: &str) -> Option<usize> {
        let &i = self.index.get(name)?;
        self.release(i);
        Some(self.tensors[i].bytes)
    }

    /// Shards merged into one checkpoint labelled `label`, their files kept
    /// as they are (mapped, not copied): every tensor of every shard, in
    /// natural name order. The caller has checked that no name repeats.
    /// The same file without the tensors whose names start with one of
    /// `prefixes`: the parts of a checkpoint a model leaves out on
    /// purpose (a multimodal Gemma 3's vision tower beside its text), so
    /// that the pre-flight does not count them as unexpected.
    pub(crate) fn without_prefixes(mut self, prefixes: &[&str]) -> Self {
        let keep: Vec<bool> = self
            .tensors
            .iter()
            .map(|t| !prefixes.iter().any(|p| t.name.starts_with(p)))
            .collect();
        let mut keep_iter = keep.iter();
        self.tensors.retain(|_| *keep_iter.next().unwrap_or(&true));
        let mut keep_iter = keep.iter();
        self.data.retain(|_| *keep_iter.next().unwrap_or(&true));
        self.index = self
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        self
    }

    pub(crate) fn merged(shards: Vec<Checkpoint>, label: &str) -> Self {
        let mut files = Vec::new();
        let mut entries = Vec::new();
        for shard in shards {
            let base = files.len();
            files.extend(shard.files);
            for (info, (dtype, file, range)) in shard.tensors.into_iter().zip(shard.data) {
                entries.push((info, (dtype, base + file, range)));
            }
        }
        entries.sort_by_cached_key(|(info, _)| natural_key(&info.name));
        let (tensors, data): (Vec<TensorInfo>, Vec<_>) = entries.into_iter().unzip();
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Self {
            label: label.to_string(),
            files,
            tensors,
            data,
            index,
            metadata: Vec::new(),
            progress: None,
            matrices: None,
        }
    }
}

fn bad_file(label: &str, e: &SafeTensorError, len: usize) -> candle::Error {
    candle::Error::Msg(format!(
        "weights '{label}' are not a valid safetensors file: {}",
        explain(e, len)
    ))
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

/// One dot-separated part of a name, for [`natural_key`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum NamePart {
    /// Digits, compared as a number (before any text).
    Number(u64),
    /// Anything else, compared as text.
    Text(String),
}

/// The key that orders `a.2.b` before `a.10.b`: digit runs compare as
/// numbers.
pub(crate) fn natural_key(s: &str) -> Vec<NamePart> {
    s.split('.')
        .map(|p| match p.parse::<u64>() {
            Ok(n) => NamePart::Number(n),
            Err(_) => NamePart::Text(p.to_string()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Valid safetensors, zero elements, but dims whose product overflows:
    /// an error, not an overflow in candle's strides.
    #[test]
    fn empty_tensor_with_huge_dims() -> Result<()> {
        let header = br#"{"e":{"dtype":"F32","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        let ckpt = Checkpoint::from_bytes(bytes, "e.safetensors")?;
        assert_eq!(ckpt.total_params(), 0);
        let err = ckpt.tensor("e", &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("strides overflow"), "{err}");
        Ok(())
    }

    /// Widening bf16 from the stored bytes gives candle's `to_dtype`, bit
    /// for bit (normal, subnormal, signed zero, infinity).
    #[test]
    fn bf16_widened_in_place_equals_candle() -> Result<()> {
        let values = [1.5f32, -2.25, 1e-40, -0.0, f32::INFINITY, 3.0e38, 0.1];
        let t = Tensor::new(&values, &Device::Cpu)?.to_dtype(candle::DType::BF16)?;
        let path = std::env::temp_dir().join(format!("multihead-bf16-{}.safetensors", std::process::id()));
        candle::safetensors::save(&std::collections::HashMap::from([("w", t.clone())]), &path)?;
        let ckpt = Checkpoint::read(&path)?;
        std::fs::remove_file(&path)?;
        let ours: Vec<u32> = ckpt
            .bf16_as_f32("w")?
            .expect("stored as bf16")
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let candle: Vec<u32> = t
            .to_dtype(candle::DType::F32)?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(ours, candle);
        Ok(())
    }

    #[test]
    fn natural_order() {
        let mut names = vec!["blocks.10.x", "blocks.2.x", "blocks.2", "a"];
        names.sort_by_cached_key(|n| natural_key(n));
        assert_eq!(names, ["a", "blocks.2", "blocks.2.x", "blocks.10.x"]);
    }
}
