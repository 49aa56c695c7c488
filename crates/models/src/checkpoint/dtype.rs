//! How a model folder loads: the dtype its weight matrices are kept in,
//! the dtype its caches store keys and values in, and a progress
//! callback.

use candle::{DType, Result};

use super::{Checkpoint, LoadProgress, TensorInfo};

/// How a model folder loads (`DecoderModel::from_folder_with`,
/// `TextGenerator::from_folder_with`).
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// The dtype the weight matrices are kept in.
    pub dtype: WeightDtype,
    /// The dtype the key/value caches store keys and values in (`None`:
    /// f32, as the model computes them): bf16 or f16 halve the cache's
    /// memory, and the CPU attention reads it in place.
    pub kv_dtype: Option<DType>,
    /// Told how many of the weights' bytes were read, as they are.
    pub progress: Option<LoadProgress>,
}

/// The dtype a model's weight matrices (its 2-D tensors: the linear
/// layers' weights and the embedding tables) are kept in once loaded,
/// whatever the file stores: `multihead generate --dtype`. The packed
/// linear layers read bf16 and f16 panels as stored and widen them in
/// registers. Norms, biases
/// and convolution kernels stay in the model's own dtype (f32), as
/// PyTorch's autocast and llama.cpp's converter keep them; activations and
/// accumulation stay f32. A bf16 file loaded as bf16 is read as stored;
/// f32 rounds to bf16 or f16 as PyTorch's `.to(dtype)` does.
// ggml's names (`Q4_K`, as `BlockFormat` and `PackFormat` spell it).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightDtype {
    /// 4 bytes a weight.
    #[default]
    F32,
    /// bfloat16: f32's range, 8 bits of mantissa; 2 bytes.
    Bf16,
    /// IEEE half precision: 11 bits of mantissa, a range to 65504; 2 bytes.
    F16,
    /// llama.cpp's Q8_0: blocks of 32 int8 weights with an f16 scale, 1.06
    /// bytes a weight. The linear layers are quantized as they are packed,
    /// from what the file stores; an embedding table not tied to the
    /// output projection stays as stored.
    Q8_0,
    /// ggml's Q4_0: blocks of 32 4-bit weights with an f16 scale, 0.56
    /// bytes a weight, quantized at load by ggml's reference rule (the
    /// bits gguf-py's `quantize` gives) from what the file stores; the
    /// inputs quantized per block at each call. Lossier than Q8_0 (about
    /// llama.cpp's own Q4_0 files).
    Q4_0,
    /// ggml's Q4_K: super-blocks of 256 4-bit weights with 6-bit scales
    /// and mins per 32, 0.56 bytes a weight, quantized at load by ggml's
    /// reference rule (`llama-quantize`'s bits without an importance
    /// matrix); matrices whose input size 256 does not divide in Q5_0
    /// (0.69 bytes a weight), as `llama-quantize` falls back. Closer to
    /// f32 than Q4_0 at the same size.
    Q4_K,
    /// A GGUF file's matrices in the ggml block formats it stores them in
    /// (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K; a Q4_K_M file's mix of Q4_K
    /// and Q6_K as it is), kept as their bytes and multiplied in integers
    /// as llama.cpp does; its float and Q8_0 matrices as with
    /// [`WeightDtype::Q8_0`]. GGUF files only: a folder's weights are
    /// floats.
    Ggml,
}

impl WeightDtype {
    const ALL: [WeightDtype; 7] = [
        WeightDtype::F32,
        WeightDtype::Bf16,
        WeightDtype::F16,
        WeightDtype::Q8_0,
        WeightDtype::Q4_0,
        WeightDtype::Q4_K,
        WeightDtype::Ggml,
    ];

    /// The name `--dtype` takes: `f32`, `bf16`, `f16`, `q8_0`, `q4_0`,
    /// `q4_k` or `ggml`.
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::F16 => "f16",
            WeightDtype::Q8_0 => "q8_0",
            WeightDtype::Q4_0 => "q4_0",
            WeightDtype::Q4_K => "q4_k",
            WeightDtype::Ggml => "ggml",
        }
    }

    /// candle's dtype the matrices are read in; `None` for Q8_0 and ggml's
    /// blocks, read as stored and quantized as the layers pack them.
    pub fn dtype(self) -> Option<DType> {
        match self {
            WeightDtype::F32 => Some(DType::F32),
            WeightDtype::Bf16 => Some(DType::BF16),
            WeightDtype::F16 => Some(DType::F16),
            WeightDtype::Q8_0 | WeightDtype::Q4_0 | WeightDtype::Q4_K | WeightDtype::Ggml => None,
        }
    }

    /// What HF transformers' `from_pretrained` keeps a folder's weights in
    /// by default (`dtype="auto"`, from transformers 5): the dtype
    /// `config` (the config.json text) names, under `dtype` or the older
    /// `torch_dtype`, where it is float32, bfloat16 or float16; else that
    /// of the checkpoint's weight matrices (its 2-D float tensors holding
    /// the most elements); else f32.
    pub fn auto(config: &str, ckpt: &Checkpoint) -> WeightDtype {
        let named = serde_json::from_str::<serde_json::Value>(config)
            .ok()
            .and_then(
                |c| match c.get("dtype").or_else(|| c.get("torch_dtype"))?.as_str()? {
                    "float32" | "float" => Some(WeightDtype::F32),
                    "bfloat16" => Some(WeightDtype::Bf16),
                    "float16" | "half" => Some(WeightDtype::F16),
                    _ => None,
                },
            );
        let stored = || {
            let keeping = |t: &TensorInfo| match t.dtype.as_str() {
                "F32" => Some(WeightDtype::F32),
                "BF16" => Some(WeightDtype::Bf16),
                "F16" => Some(WeightDtype::F16),
                _ => None,
            };
            Self::of_most_matrix_elements(ckpt.tensors().iter().map(|t| (&t.shape[..], keeping(t))))
        };
        named.or_else(stored).unwrap_or_default()
    }

    /// Of `tensors` (each a shape and the dtype that keeps it as stored,
    /// `None` for none), the dtype keeping the most elements of the
    /// matrices (2-D tensors); `None` without such a matrix. Ties go to the
    /// later of [`WeightDtype::ALL`].
    pub(crate) fn of_most_matrix_elements<'a>(
        tensors: impl IntoIterator<Item = (&'a [usize], Option<WeightDtype>)>,
    ) -> Option<WeightDtype> {
        let mut elements = [0usize; Self::ALL.len()];
        for (shape, dtype) in tensors {
            let i = dtype.and_then(|d| Self::ALL.iter().position(|&a| a == d));
            if let (2, Some(i)) = (shape.len(), i) {
                let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
                elements[i] = elements[i].saturating_add(n.unwrap_or(usize::MAX));
            }
        }
        Self::ALL
            .into_iter()
            .zip(elements)
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)
            .map(|(dtype, _)| dtype)
    }
}

/// Float `dtype`'s largest finite value, and the smallest magnitude a
/// wider value converted to it (rounded to nearest, ties to even, as
/// candle's `to_dtype` rounds) becomes infinity at: halfway from the
/// largest finite value to the next power of two. `None` for integer
/// dtypes.
pub(crate) fn float_range(dtype: DType) -> Option<(f64, f64)> {
    Some(match dtype {
        DType::F16 => (65504., 65520.),
        DType::BF16 => (
            f64::from(f32::from_bits(0x7f7f_0000)),
            f64::from(f32::from_bits(0x7f7f_8000)),
        ),
        DType::F32 => (f64::from(f32::MAX), 2f64.powi(128) - 2f64.powi(103)),
        DType::F64 => (f64::MAX, f64::INFINITY),
        _ => return None,
    })
}

/// candle's dtype for safetensors' dtype name `name` (`F32`, `BF16`, ...),
/// where it is a float one.
pub(crate) fn float_dtype(name: &str) -> Option<DType> {
    match name {
        "F64" => Some(DType::F64),
        "F32" => Some(DType::F32),
        "BF16" => Some(DType::BF16),
        "F16" => Some(DType::F16),
        _ => None,
    }
}

impl WeightDtype {
    /// How the linear layers of a model loaded in this dtype pack:
    /// quantized for Q8_0, Q4_0 and Q4_K (a GGUF file's float and Q8_0
    /// matrices in Q8_0 for `ggml`), as read otherwise.
    pub(crate) fn pack_options(self) -> multihead_attention::PackOptions {
        let format = match self {
            WeightDtype::Q8_0 | WeightDtype::Ggml => multihead_attention::PackFormat::Q8_0,
            WeightDtype::Q4_0 => multihead_attention::PackFormat::Q4_0,
            WeightDtype::Q4_K => multihead_attention::PackFormat::Q4_K,
            _ => multihead_attention::PackFormat::AsStored,
        };
        multihead_attention::PackOptions::new().with_format(format)
    }
}

impl std::str::FromStr for WeightDtype {
    type Err = candle::Error;

    fn from_str(s: &str) -> Result<Self> {
        let names: Vec<&str> = Self::ALL.iter().map(|d| d.name()).collect();
        Self::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| candle::Error::Msg(format!("dtype '{s}' is not one of {}", names.join(", "))))
    }
}

impl std::fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::WeightDtype;
    use crate::checkpoint::Checkpoint;

    /// A checkpoint of zeros holding `(name, safetensors dtype, shape)`.
    fn zeros(tensors: &[(&str, &str, &[usize])]) -> Checkpoint {
        let mut header = serde_json::Map::new();
        let mut at = 0;
        for &(name, dtype, shape) in tensors {
            let end = at + if dtype == "F32" { 4 } else { 2 } * shape.iter().product::<usize>();
            let info = serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, end]});
            header.insert(name.into(), info);
            at = end;
        }
        let header = serde_json::Value::Object(header).to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + at, 0);
        Checkpoint::from_bytes(bytes, "zeros.safetensors").unwrap()
    }

    /// As HF's `dtype="auto"`: the config's dtype (or torch_dtype) first,
    /// then that of most of the weight matrices (vectors left out), then
    /// f32.
    #[test]
    fn auto_is_the_config_s_dtype_else_the_matrices_s() {
        let f32_matrices = zeros(&[("w", "F32", &[4, 4]), ("b", "BF16", &[64])]);
        let bf16_matrices = zeros(&[("w", "BF16", &[8, 4]), ("v", "F32", &[2, 2]), ("n", "F32", &[64])]);
        for (config, ckpt, want) in [
            (r#"{"dtype": "bfloat16"}"#, &f32_matrices, WeightDtype::Bf16),
            (r#"{"torch_dtype": "float16"}"#, &bf16_matrices, WeightDtype::F16),
            (
                r#"{"dtype": "float32", "torch_dtype": "bfloat16"}"#,
                &bf16_matrices,
                WeightDtype::F32,
            ),
            (r#"{"dtype": "auto"}"#, &bf16_matrices, WeightDtype::Bf16),
            ("{}", &bf16_matrices, WeightDtype::Bf16),
            ("not json", &bf16_matrices, WeightDtype::Bf16),
            ("{}", &f32_matrices, WeightDtype::F32),
            ("{}", &zeros(&[("n", "BF16", &[8])]), WeightDtype::F32),
        ] {
            assert_eq!(WeightDtype::auto(config, ckpt), want, "{config}");
        }
    }

    /// Each float dtype's bounds are candle's: its largest finite value
    /// converts to itself, the overflow bound to infinity and the value
    /// just below it (in the wider dtype converted from) to a finite one.
    #[test]
    fn float_ranges_are_where_candle_s_conversion_overflows() -> candle::Result<()> {
        use candle::{DType, Device, Tensor};
        for (dtype, from) in [
            (DType::F16, DType::F32),
            (DType::BF16, DType::F32),
            (DType::F32, DType::F64),
        ] {
            let (max, overflow) = super::float_range(dtype).unwrap();
            let below = match from {
                DType::F32 => f64::from(f32::from_bits((overflow as f32).to_bits() - 1)),
                _ => f64::from_bits(overflow.to_bits() - 1),
            };
            let t = Tensor::new(&[max, overflow, below, -overflow], &Device::Cpu)?.to_dtype(from)?;
            let got = t.to_dtype(dtype)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            assert_eq!(got[0], max, "{dtype:?}");
            assert_eq!((got[1], got[3]), (f64::INFINITY, f64::NEG_INFINITY), "{dtype:?}");
            assert!(got[2].is_finite(), "{dtype:?}");
        }
        assert_eq!(super::float_range(DType::U32), None);
        Ok(())
    }

    #[test]
    fn names_parse_back_and_others_are_refused() {
        for d in WeightDtype::ALL {
            assert_eq!(d.name().parse::<WeightDtype>().unwrap(), d);
            assert_eq!(d.name().to_uppercase().parse::<WeightDtype>().unwrap(), d);
        }
        let err = "fp8".parse::<WeightDtype>().unwrap_err().to_string();
        assert!(
            err.contains("'fp8'") && err.contains("f32, bf16, f16, q8_0, q4_0, q4_k, ggml"),
            "{err}"
        );
    }
}
