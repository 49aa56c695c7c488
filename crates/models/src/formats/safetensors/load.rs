//! A safetensors file compared with what a model asks for
//! ([`Preflight::check`]), then read into the model: each tensor converted
//! to the dtype the load asks for, its pages handed back once read.

use std::collections::HashSet;

use candle::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use multihead_attention::{PackFormat, PackOptions};

use super::file::{natural_key, Checkpoint};
use crate::checkpoint::{float_dtype, float_range, WeightDtype};
use crate::formats::preflight::{
    wanted_tensors, wanted_within, Misshaped, NonFinite, NotFloat, Preflight, Wanted, SUMMARY_ITEMS,
};

impl Preflight {
    /// Compares `ckpt` with `wanted`; scans the needed float tensors for
    /// NaN and infinity only when `scan_values` (it reads every weight).
    /// Names are escaped as the report writes them down (a model's names
    /// can hold a prefix read from the file).
    pub fn check(ckpt: &Checkpoint, wanted: &[Wanted], scan_values: bool) -> Result<Self> {
        let escaped = |name: &str| name.escape_debug().to_string();
        let mut report = Self::default();
        let needed: HashSet<&str> = wanted.iter().map(|w| w.name.as_str()).collect();
        for w in wanted {
            match ckpt.info(&w.name) {
                None => report.missing.push(Wanted {
                    name: escaped(&w.name),
                    shape: w.shape.clone(),
                }),
                Some(info) => {
                    if info.shape != w.shape {
                        report.misshaped.push(Misshaped {
                            name: escaped(&w.name),
                            expected: w.shape.clone(),
                            found: info.shape.clone(),
                        });
                    }
                    if !info.is_float() {
                        report.not_float.push(NotFloat {
                            name: escaped(&w.name),
                            dtype: info.dtype.clone(),
                        });
                    }
                }
            }
        }
        report.unexpected = ckpt
            .tensors()
            .iter()
            .filter(|t| !needed.contains(t.name.as_str()))
            .map(|t| escaped(&t.name))
            .collect();
        report.missing.sort_by_cached_key(|w| natural_key(&w.name));
        if scan_values && report.misshaped.is_empty() && report.not_float.is_empty() {
            report.non_finite = ckpt
                .non_finite(wanted.iter().map(|w| w.name.as_str()))?
                .into_iter()
                .map(|(name, nan, inf)| NonFinite {
                    name: escaped(&name),
                    nan,
                    inf,
                })
                .collect();
        }
        Ok(report)
    }
}

impl Checkpoint {
    /// Builds a model from this checkpoint after a pre-flight check: the
    /// tensors `build` asks for are compared with the file first, and
    /// every missing, unexpected, mis-shaped, integer-typed or non-finite
    /// tensor is reported in one error. Weights stored as f32, f16 or
    /// bf16 are converted to `dtype`, the weight matrices to the
    /// checkpoint's [`Checkpoint::with_weight_dtype`] where set; a
    /// quantized one (Q8_0, Q4_0) is how the layers pack, which only a
    /// `build` given the [`PackOptions`] can honour: that takes
    /// [`Checkpoint::load_with`], and is refused here.
    ///
    /// `build` runs twice: once against a recorder, once for real.
    pub fn load<T>(
        &self,
        dtype: DType,
        device: &Device,
        build: impl Fn(VarBuilder) -> Result<T>,
    ) -> Result<T> {
        if let Some(w) = self
            .weight_dtype()
            .filter(|w| w.pack_options().format() != PackFormat::AsStored)
        {
            candle::bail!(
                "weights '{}': weight dtype {w} quantizes the linear layers as they pack; load them with Checkpoint::load_with, whose build takes the PackOptions",
                self.label()
            )
        }
        self.load_with(dtype, device, |vb, _| build(vb))
    }

    /// [`Checkpoint::load`], `build` given the [`PackOptions`] every
    /// linear layer of the model packs with (the format the checkpoint's
    /// weight dtype asks for, for the default instruction set): a model's
    /// `new_with` (`Llama::new_with`) passes them down.
    pub fn load_with<T>(
        &self,
        dtype: DType,
        device: &Device,
        build: impl Fn(VarBuilder, &PackOptions) -> Result<T>,
    ) -> Result<T> {
        let names: Vec<&str> = self.tensors().iter().map(|t| t.name.as_str()).collect();
        let wanted = wanted_tensors(&names, |vb| build(vb, &PackOptions::default()))?;
        self.load_wanted(&wanted, dtype, device, build)
    }

    /// [`Checkpoint::load_with`] of the model the config `owner` describes
    /// (`LlamaConfig`), its recording held to this file's
    /// [`Checkpoint::budget`]: a config whose sizes the file cannot hold
    /// is refused at the first tensor past it, naming the config, that
    /// tensor and the file, before anything of the config's size is built.
    pub fn load_bounded<T>(
        &self,
        owner: &str,
        dtype: DType,
        device: &Device,
        build: impl Fn(VarBuilder, &PackOptions) -> Result<T>,
    ) -> Result<T> {
        let names: Vec<&str> = self.tensors().iter().map(|t| t.name.as_str()).collect();
        let wanted = wanted_within(&names, &self.budget(owner), |vb| {
            build(vb, &PackOptions::default())
        })?;
        self.load_wanted(&wanted, dtype, device, build)
    }

    /// The load after the recording: `wanted` compared with the file, then
    /// `build` run over its tensors with the [`PackOptions`] of the
    /// checkpoint's weight dtype.
    fn load_wanted<T>(
        &self,
        wanted: &[Wanted],
        dtype: DType,
        device: &Device,
        build: impl Fn(VarBuilder, &PackOptions) -> Result<T>,
    ) -> Result<T> {
        let report = Preflight::check(self, wanted, true)?;
        if let Some(summary) = report.summary() {
            candle::bail!("weights '{}' do not match the model: {summary}", self.label())
        }
        self.ensure_representable(wanted, dtype)?;
        let reader = Reader {
            ckpt: self,
            read: std::sync::atomic::AtomicU64::new(0),
            total: self.tensors().iter().map(|t| t.bytes as u64).sum(),
        };
        let vb = VarBuilder::from_backend(Box::new(reader), dtype, device.clone());
        let pack = self
            .weight_dtype()
            .map_or_else(PackOptions::default, WeightDtype::pack_options);
        build(vb, &pack)
    }

    /// Refuses the `wanted` tensors holding finite values too large for
    /// the dtype [`Checkpoint::load`] converts them to (f32 weights kept in
    /// f16, whose largest value is 65504): converted, they would be
    /// infinity, and the model's first step would fail far from the
    /// cause. Every such tensor is named, with its largest value and the
    /// dtypes that hold it.
    fn ensure_representable(&self, wanted: &[Wanted], dtype: DType) -> Result<()> {
        let mut bad = Vec::new();
        for w in wanted {
            let Some(stored) = self.info(&w.name).and_then(|t| float_dtype(&t.dtype)) else {
                continue;
            };
            let target = load_dtype(self, &w.name, dtype);
            let (Some((stored_max, _)), Some((target_max, overflow))) =
                (float_range(stored), float_range(target))
            else {
                continue;
            };
            // Only a wider dtype holds values that overflow the target.
            if stored_max < overflow {
                continue;
            }
            if let Some((n, largest)) = self.too_large(&w.name, overflow).filter(|&(n, _)| n > 0) {
                let holders: Vec<&str> = [DType::BF16, DType::F32]
                    .into_iter()
                    .filter(|&d| d != target && float_range(d).is_some_and(|(_, o)| largest < o))
                    .map(|d| d.as_str())
                    .collect();
                let hold = match holders.as_slice() {
                    [] => String::new(),
                    [one] => format!(" ({one} holds them)"),
                    many => format!(" ({} hold them)", many.join(" or ")),
                };
                bad.push(format!(
                    "{}: {n} value{} up to {}, past {}'s largest {}{hold}",
                    w.name,
                    if n == 1 { "" } else { "s" },
                    magnitude(largest),
                    target.as_str(),
                    magnitude(target_max),
                ));
            }
        }
        if bad.is_empty() {
            return Ok(());
        }
        let more = bad.len().saturating_sub(SUMMARY_ITEMS);
        bad.truncate(SUMMARY_ITEMS);
        if more > 0 {
            bad.push(format!("and {more} more"));
        }
        candle::bail!(
            "weights '{}' hold values too large for the dtype they load in, which would become infinity: {}",
            self.label(),
            bad.join("; ")
        )
    }
}

/// `x` for a message: as a plain number while that stays short.
fn magnitude(x: f64) -> String {
    if x < 1e9 {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// The dtype [`Checkpoint::load`] gives tensor `name` of `ckpt` when the
/// model asks for `dtype`: a weight matrix in the checkpoint's
/// [`Checkpoint::with_weight_dtype`] where set, as stored (a float dtype the
/// layers pack) where they quantize it; any other tensor in `dtype`.
fn load_dtype(ckpt: &Checkpoint, name: &str, dtype: DType) -> DType {
    match (ckpt.weight_dtype(), ckpt.info(name)) {
        (Some(w), Some(t)) if t.shape.len() == 2 => w.dtype().unwrap_or(match t.dtype.as_str() {
            "BF16" => DType::BF16,
            "F16" => DType::F16,
            _ => DType::F32,
        }),
        _ => dtype,
    }
}

/// Answers `vb.get` with the checkpoint's tensor, converted, and hands the
/// pages it was read from back (see `Checkpoint::release_named`): a model built
/// from a mapped file never holds the file beside itself.
struct Reader<'a> {
    ckpt: &'a Checkpoint,
    /// Bytes read so far, and in all, for the progress callback.
    read: std::sync::atomic::AtomicU64,
    total: u64,
}

impl Reader<'_> {
    fn read(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let dtype = load_dtype(self.ckpt, name, dtype);
        let widened = match (dtype, dev) {
            (DType::F32, Device::Cpu) => self.ckpt.bf16_as_f32(name)?,
            _ => None,
        };
        let t = match widened {
            Some(t) => t,
            None => self.ckpt.tensor(name, dev)?.to_dtype(dtype)?,
        };
        if let Some(n) = self.ckpt.release_named(name) {
            if let Some(progress) = self.ckpt.progress() {
                let n = n as u64;
                let read = self.read.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
                (progress.0)(read.min(self.total), self.total);
            }
        }
        Ok(t)
    }
}

impl SimpleBackend for Reader<'_> {
    fn get(&self, s: Shape, name: &str, _h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.read(name, dtype, dev)?;
        if t.shape() != &s {
            candle::bail!(
                "weights '{}': tensor '{name}' has shape {:?}, expected {:?}",
                self.ckpt.label(),
                t.dims(),
                s.dims()
            )
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.read(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.ckpt.info(name).is_some()
    }
}
