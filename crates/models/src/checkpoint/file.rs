//! A safetensors file read from an untrusted source: its header checked
//! before any tensor is touched, every error naming the file.

use std::path::Path;

use candle::{DType, Device, Result, Tensor};
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use serde::Serialize;

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
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the dtype is one a float weight may be stored in (and is
    /// converted from on loading).
    pub fn is_float(&self) -> bool {
        matches!(self.dtype.as_str(), "F32" | "F16" | "BF16" | "F64")
    }
}

/// The one-line export a user can run on a pickle, for the error message.
fn export_hint(path: &str) -> String {
    format!(
        "export it once with: python -c \"import torch; from safetensors.torch import save_file; \
         sd = torch.load('{path}', map_location='cpu', weights_only=True); \
         save_file({{k: v.contiguous() for k, v in sd.items()}}, '{path}.safetensors')\""
    )
}

fn pickle_error(label: &str) -> candle::Error {
    candle::Error::Msg(format!(
        "'{label}' is a PyTorch pickle, not safetensors: loading a pickle can run arbitrary code, \
         so multihead does not read them; {}",
        export_hint(label)
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

/// A validated safetensors file held in memory.
///
/// Reading checks the whole header (length, JSON, dtypes, offsets
/// covering the data exactly, shapes matching byte sizes) through
/// `SafeTensors::deserialize`; its errors are rephrased for the user and
/// carry the file's name.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    label: String,
    bytes: Vec<u8>,
    tensors: Vec<TensorInfo>,
    metadata: Vec<(String, String)>,
}

impl Checkpoint {
    /// Reads `path`; refuses PyTorch pickles (`.bin`, `.pt`, `.pth`,
    /// `.ckpt`) with the command that converts them.
    pub fn read(path: &Path) -> Result<Self> {
        let label = path.display().to_string();
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        if matches!(ext.as_deref(), Some("bin" | "pt" | "pth" | "ckpt" | "pkl")) {
            return Err(pickle_error(&label));
        }
        let bytes =
            std::fs::read(path).map_err(|e| candle::Error::Msg(format!("reading weights '{label}': {e}")))?;
        Self::from_bytes(bytes, &label)
    }

    /// Parses `bytes`; `label` names the file in errors.
    pub fn from_bytes(bytes: Vec<u8>, label: &str) -> Result<Self> {
        let (tensors, metadata) = match SafeTensors::read_metadata(&bytes) {
            Ok((_, meta)) => {
                // `deserialize` also checks every tensor's byte range.
                let st = SafeTensors::deserialize(&bytes).map_err(|e| bad_file(label, &e, bytes.len()))?;
                let mut tensors: Vec<TensorInfo> = st
                    .tensors()
                    .into_iter()
                    .map(|(name, view)| TensorInfo {
                        name,
                        dtype: dtype_name(view.dtype()),
                        shape: view.shape().to_vec(),
                        bytes: view.data().len(),
                    })
                    .collect();
                tensors.sort_by(|a, b| natural_cmp(&a.name, &b.name));
                let mut metadata: Vec<(String, String)> =
                    meta.metadata().clone().unwrap_or_default().into_iter().collect();
                metadata.sort();
                (tensors, metadata)
            }
            Err(_) if looks_like_pickle(&bytes) => return Err(pickle_error(label)),
            Err(e) => return Err(bad_file(label, &e, bytes.len())),
        };
        Ok(Self {
            label: label.to_string(),
            bytes,
            tensors,
            metadata,
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
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Size of the file in bytes.
    pub fn file_size(&self) -> usize {
        self.bytes.len()
    }

    /// Total number of elements over all tensors.
    pub fn total_params(&self) -> usize {
        self.tensors.iter().map(TensorInfo::numel).sum()
    }

    /// Tensor `name` on `device` in its stored dtype.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let st =
            SafeTensors::deserialize(&self.bytes).map_err(|e| bad_file(&self.label, &e, self.bytes.len()))?;
        let view = st
            .tensor(name)
            .map_err(|e| candle::Error::Msg(format!("weights '{}': {e}", self.label)))?;
        candle::safetensors::Load::load(&view, device)
    }

    /// The named float tensors holding NaN or infinity, with the counts:
    /// `(name, nan, inf)`. Integer tensors are skipped.
    pub fn non_finite<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<Vec<(String, usize, usize)>> {
        let mut bad = Vec::new();
        for name in names {
            let Some(info) = self.info(name) else { continue };
            if !info.is_float() || info.numel() == 0 {
                continue;
            }
            let v: Vec<f32> = self
                .tensor(name, &Device::Cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            let nan = v.iter().filter(|x| x.is_nan()).count();
            let inf = v.iter().filter(|x| x.is_infinite()).count();
            if nan + inf > 0 {
                bad.push((name.to_string(), nan, inf));
            }
        }
        Ok(bad)
    }

    /// The raw file, for a `VarBuilder`.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
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

/// Orders `a.2.b` before `a.10.b`: digit runs compare as numbers.
pub(crate) fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn parts(s: &str) -> Vec<(u8, u64, &str)> {
        s.split('.')
            .map(|p| match p.parse::<u64>() {
                Ok(n) => (0, n, ""),
                Err(_) => (1, 0, p),
            })
            .collect()
    }
    parts(a).cmp(&parts(b))
}
