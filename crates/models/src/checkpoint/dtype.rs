//! How a model folder loads: the dtype its weight matrices are kept in,
//! the dtype its caches store keys and values in, and a progress
//! callback.

use candle::{DType, Result};

use super::LoadProgress;

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
}

impl WeightDtype {
    pub(crate) const ALL: [WeightDtype; 4] = [
        WeightDtype::F32,
        WeightDtype::Bf16,
        WeightDtype::F16,
        WeightDtype::Q8_0,
    ];

    /// The name `--dtype` takes: `f32`, `bf16` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::F16 => "f16",
            WeightDtype::Q8_0 => "q8_0",
        }
    }

    /// candle's dtype the matrices are read in; `None` for Q8_0, read as
    /// stored and quantized as the layers pack them.
    pub fn dtype(self) -> Option<DType> {
        match self {
            WeightDtype::F32 => Some(DType::F32),
            WeightDtype::Bf16 => Some(DType::BF16),
            WeightDtype::F16 => Some(DType::F16),
            WeightDtype::Q8_0 => None,
        }
    }
}

impl WeightDtype {
    /// `build` with the linear layers it packs in this format
    /// (`multihead_attention::packing_as`): quantized for Q8_0, as read
    /// otherwise.
    pub(crate) fn packing<R>(self, build: impl FnOnce() -> R) -> R {
        let format = match self {
            WeightDtype::Q8_0 => multihead_attention::PackFormat::Q8_0,
            _ => multihead_attention::PackFormat::AsStored,
        };
        multihead_attention::packing_as(format, build)
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

    #[test]
    fn names_parse_back_and_others_are_refused() {
        for d in WeightDtype::ALL {
            assert_eq!(d.name().parse::<WeightDtype>().unwrap(), d);
            assert_eq!(d.name().to_uppercase().parse::<WeightDtype>().unwrap(), d);
        }
        let err = "fp8".parse::<WeightDtype>().unwrap_err().to_string();
        assert!(
            err.contains("'fp8'") && err.contains("f32, bf16, f16, q8_0"),
            "{err}"
        );
    }
}
