//! Llama-family decoders (llama, and Mistral, which llama.cpp files as
//! llama; qwen2; qwen3; smollm3; olmo2; phi3) and Gemmas (gemma2, gemma3)
//! from a GGUF file as llama.cpp's `convert_hf_to_gguf.py` writes it: the
//! `{arch}.*` metadata read into a [`LlamaConfig`](crate::decoder::LlamaConfig) or a
//! [`GemmaConfig`](crate::decoder::GemmaConfig), and the tensors handed to
//! [`Llama::new`] or [`Gemma::with_unit_norms`] (the converter stores a
//! Gemma's norm weights as the `1 + w` they scale by) under HF's names,
//! with the rotary permutation the converter applies to the q and k of
//! archs `llama` and `smollm3` undone. The metadata's reading is
//! `config.rs` (Gemma's, `gemma.rs`); the tensors' names, the model's
//! table (`LlamaConfig::gguf_names` in `decoder/llama.rs`, Gemma's in
//! `decoder/gemma.rs`) mapped by `names.rs`; the tokenizer, end tokens
//! and chat template the file carries, `text.rs`.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use candle::{bail, DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use multihead_attention::{LentBlocks, PackOptions};

use super::config::{gguf_config, Arch, LONGROPE_TENSORS};
use super::names::GgufNames;
use super::{ggml_type_name, stored_dtype, GgufFile, GGUF_TENSOR_TYPES};
use crate::checkpoint::{float_range, LoadOptions, LoadProgress, WeightDtype};
use crate::decoder::{DecoderModel, Gemma, HfDecoderConfig, Llama};
use crate::formats::preflight::{wanted_within, Budget, Misshaped, NonFinite, Preflight, Wanted};

/// The `general.architecture` values this loader runs.
pub const GGUF_ARCHITECTURES: [&str; 8] = [
    "llama", "qwen2", "qwen3", "smollm3", "olmo2", "phi3", "gemma2", "gemma3",
];

/// How many tensors of an unsupported type an error names.
const NAMED: usize = 20;

/// Undoes `LlamaModel.permute` of llama.cpp's `convert_hf_to_gguf.py`,
/// which reorders the rows of arch `llama`'s q and k (weights and biases)
/// from HF's half-split rotary layout to llama.cpp's interleaved one:
/// `w.reshape(heads, 2, rows // heads // 2, ...).swapaxes(1, 2)`. Here the
/// file's rows `(heads, half, 2)` go back to `(heads, 2, half)`.
fn unpermute_rows(t: &Tensor, heads: usize) -> Result<Tensor> {
    let rows = t.dim(0)?;
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        bail!("cannot undo the rotary permutation: {rows} rows in {heads} heads of even width")
    }
    let mut shape = vec![heads, rows / heads / 2, 2];
    shape.extend_from_slice(&t.dims()[1..]);
    t.reshape(shape)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(t.shape())
}

/// Answers `vb.get` under HF's names with the GGUF file's tensors: q and
/// k un-permuted where the converter permuted them, the weight matrices (2-D) in the dtype
/// the load asks for, norms and biases f32.
struct GgufReader<'a> {
    file: &'a GgufFile,
    /// The model's tensors' names in the file.
    names: GgufNames,
    /// `(heads, kv_heads)` where q and k are permuted
    /// ([`Arch::permutes_qk`]).
    permuted: Option<(usize, usize)>,
    /// The matrices' dtype; `None`: as stored (Q8_0, which the layers
    /// quantize as they pack them).
    weight_dtype: Option<DType>,
    /// Matrices in ggml's block formats lent to the layers as their
    /// bytes ([`WeightDtype::Ggml`]), not dequantized.
    keep_blocks: bool,
    /// Where those blocks are lent, for the layers to take.
    lent: LentBlocks,
    progress: Option<LoadProgress>,
    read: AtomicU64,
    total: u64,
}

impl GgufReader<'_> {
    fn read(&self, name: &str, dev: &Device) -> Result<Tensor> {
        let Some(g) = self.names.gguf_name(name) else {
            bail!(
                "GGUF file '{}': the model asks for '{name}', which GGUF files do not name",
                self.file.label()
            )
        };
        let permuted_heads = self.permuted.and_then(|(heads, kv_heads)| {
            let rest = g
                .split_once('.')
                .and_then(|(_, r)| r.split_once('.'))
                .map(|(_, r)| r);
            match rest {
                Some("attn_q.weight" | "attn_q.bias") => Some(heads),
                Some("attn_k.weight" | "attn_k.bias") => Some(kv_heads),
                _ => None,
            }
        });
        if let Some((format, (n, k), bytes)) = self.file.blocks(&g).filter(|_| self.keep_blocks) {
            let mut data = LentBlocks::buffer(bytes.len());
            match permuted_heads {
                Some(h) => {
                    unpermute_block_rows(bytes, n, format.row_bytes(k), h, &mut data).map_err(|e| {
                        candle::Error::Msg(format!("GGUF file '{}': tensor '{g}': {e}", self.file.label()))
                    })?
                }
                None => data.extend_from_slice(bytes),
            }
            self.file.release(&g);
            self.progress(&g);
            return self.lent.lend(format, data, (n, k), dev);
        }
        let mut t = self.file.tensor(&g, dev)?;
        if let Some(h) = permuted_heads {
            t = unpermute_rows(&t, h).map_err(|e| {
                candle::Error::Msg(format!("GGUF file '{}': tensor '{g}': {e}", self.file.label()))
            })?;
        }
        let t = match (t.rank(), self.weight_dtype) {
            (2, Some(d)) => {
                self.ensure_representable(&t, d, &g)?;
                t.to_dtype(d)?
            }
            (2, None) => t,
            _ => t.to_dtype(DType::F32)?,
        };
        self.progress(&g);
        Ok(t)
    }

    /// Tells the progress callback tensor `g` was read.
    fn progress(&self, g: &str) {
        if let (Some(progress), Some(info)) = (&self.progress, self.file.info(g)) {
            let n = info.range.len() as u64;
            let read = self.read.fetch_add(n, Ordering::Relaxed) + n;
            (progress.0)(read.min(self.total), self.total);
        }
    }
}

/// [`unpermute_rows`] over a matrix of `n` rows of `row_bytes` bytes each
/// (a block format's rows, which move whole), appended to `out` in order.
fn unpermute_block_rows(
    bytes: &[u8],
    n: usize,
    row_bytes: usize,
    heads: usize,
    out: &mut Vec<u8>,
) -> Result<()> {
    if heads == 0 || !n.is_multiple_of(2 * heads) || bytes.len() != n * row_bytes {
        bail!("cannot undo the rotary permutation: {n} rows in {heads} heads of even width")
    }
    let half = n / heads / 2;
    // HF's row (h, s, i), the next one out, is the file's (h, i, s).
    for h in 0..heads {
        for s in 0..2 {
            for i in 0..half {
                let from = h * 2 * half + i * 2 + s;
                out.extend_from_slice(&bytes[from * row_bytes..][..row_bytes]);
            }
        }
    }
    Ok(())
}

impl GgufReader<'_> {
    /// Refuses a matrix `t` (tensor `g`, read) holding finite values too
    /// large for `dtype` (an f32 weight past f16's 65504): converted, they
    /// would be infinity and the first step would fail far from the cause,
    /// as `Checkpoint::load` refuses them in a folder's weights. The file's
    /// bytes are scanned in place ([`GgufFile::too_large`]).
    fn ensure_representable(&self, t: &Tensor, dtype: DType, g: &str) -> Result<()> {
        let (Some((target_max, overflow)), Some((read_max, _))) =
            (float_range(dtype), float_range(t.dtype()))
        else {
            return Ok(());
        };
        if read_max < overflow {
            return Ok(());
        }
        let Some((n, largest)) = self.file.too_large(g, overflow).filter(|&(n, _)| n > 0) else {
            return Ok(());
        };
        bail!(
            "GGUF file '{}': tensor '{}' holds {n} value{} up to {largest}, past {}'s largest {target_max}, which would become infinity (load it in a wider dtype)",
            self.file.label(),
            g.escape_debug(),
            if n == 1 { "" } else { "s" },
            dtype.as_str(),
        )
    }
}

impl SimpleBackend for GgufReader<'_> {
    fn get(&self, s: Shape, name: &str, _h: Init, _dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.read(name, dev)?;
        if t.shape() != &s {
            bail!(
                "GGUF file '{}': tensor '{}' has shape {:?}, expected {:?}",
                self.file.label(),
                self.names.gguf_name(name).unwrap_or_default(),
                t.dims(),
                s.dims()
            )
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, dev: &Device) -> Result<Tensor> {
        self.read(name, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.names
            .gguf_name(name)
            .is_some_and(|g| self.file.info(&g).is_some())
    }
}

/// Refuses tensors of a ggml type [`GgufFile::tensor`] does not read,
/// naming them (the first [`NAMED`]) with their types.
fn check_types(file: &GgufFile) -> Result<()> {
    let bad: Vec<String> = file
        .tensors()
        .iter()
        .filter(|t| stored_dtype(t.ggml_type).is_none())
        .map(|t| format!("{} ({})", t.name.escape_debug(), ggml_type_name(t.ggml_type)))
        .collect();
    if !bad.is_empty() {
        let more = if bad.len() > NAMED {
            format!(" and {} more", bad.len() - NAMED)
        } else {
            String::new()
        };
        let read: Vec<&str> = GGUF_TENSOR_TYPES.iter().map(|&t| ggml_type_name(t)).collect();
        bail!(
            "GGUF file '{}': {} tensor(s) of a ggml type this loader does not read (it reads {}): {}{more}",
            file.label(),
            bad.len(),
            read.join(", "),
            bad[..bad.len().min(NAMED)].join(", ")
        )
    }
    Ok(())
}

/// The model `cfg` describes, built from `vb` (HF's names; a Gemma's
/// norms holding `1 + w`, as the converter writes them).
fn build(cfg: &HfDecoderConfig, pack: &PackOptions, vb: VarBuilder) -> Result<DecoderModel> {
    Ok(match cfg {
        HfDecoderConfig::Llama(c) => DecoderModel::Llama(Llama::new_with(c, pack, vb)?),
        HfDecoderConfig::Gemma(c) => DecoderModel::Gemma(Gemma::with_unit_norms_with(c, pack, vb)?),
        HfDecoderConfig::Gpt2(_) => bail!("GGUF files of GPT-2 are not supported"),
    })
}

/// The names the model `cfg` describes gives its tensors in a GGUF file:
/// its own table.
fn names(cfg: &HfDecoderConfig) -> Result<GgufNames> {
    Ok(match cfg {
        HfDecoderConfig::Llama(c) => c.gguf_names(),
        HfDecoderConfig::Gemma(c) => c.gguf_names(),
        HfDecoderConfig::Gpt2(_) => bail!("GGUF files of GPT-2 are not supported"),
    })
}

/// Compares the tensors the model `cfg` (of arch `arch`) asks for with the
/// file's, by the file's names: every missing, unexpected and mis-shaped
/// one at once (the unexpected, which the file names, escaped:
/// `str::escape_debug`, since the report is printed). The model is
/// recorded within the file's budget ([`Budget`]): metadata describing a
/// model the file cannot hold is an error naming the tensor past it. Also
/// returns the names of those present in the right shape, in the order
/// the model asks for them.
fn compare(file: &GgufFile, cfg: &HfDecoderConfig, arch: Arch) -> Result<(Preflight, Vec<String>)> {
    let table = names(cfg)?;
    let mut report = Preflight::default();
    let mut present = Vec::new();
    // Read into the config, not the layers.
    let config_tensor = |name: &str| arch == Arch::Phi3 && LONGROPE_TENSORS.contains(&name);
    for t in file.tensors() {
        match table.hf_name(&t.name) {
            Some(h) => present.push(h),
            None if config_tensor(&t.name) => {}
            None => report.unexpected.push(t.name.escape_debug().to_string()),
        }
    }
    let names: Vec<&str> = present.iter().map(String::as_str).collect();
    let weights = file.tensors().iter().fold(0usize, |n, t| {
        n.saturating_add(t.shape.iter().fold(1usize, |m, &d| m.saturating_mul(d)))
    });
    let budget = Budget::new(cfg.kind(), file.label(), weights, file.tensors().len());
    let wanted = wanted_within(&names, &budget, |vb| build(cfg, &PackOptions::default(), vb))?;
    let mut needed = HashSet::new();
    let mut matching = Vec::new();
    for w in wanted {
        let Some(g) = table.gguf_name(&w.name) else {
            bail!(
                "GGUF file '{}': the model asks for '{}', which GGUF files do not name",
                file.label(),
                w.name
            )
        };
        match file.info(&g) {
            None => report.missing.push(Wanted {
                name: g.clone(),
                shape: w.shape,
            }),
            Some(info) if info.shape != w.shape => report.misshaped.push(Misshaped {
                name: g.clone(),
                expected: w.shape,
                found: info.shape.clone(),
            }),
            Some(_) => matching.push(g.clone()),
        }
        needed.insert(g);
    }
    report.unexpected.extend(
        file.tensors()
            .iter()
            .filter(|t| table.hf_name(&t.name).is_some() && !needed.contains(&t.name))
            .map(|t| t.name.escape_debug().to_string()),
    );
    Ok((report, matching))
}

/// [`compare`], then, where the shapes all match, every needed tensor
/// holding NaN or infinity ([`GgufFile::non_finite`]), as a safetensors
/// file's pre-flight does: one error naming every problem.
fn preflight(file: &GgufFile, cfg: &HfDecoderConfig, arch: Arch) -> Result<()> {
    let (mut report, matching) = compare(file, cfg, arch)?;
    if report.misshaped.is_empty() {
        report.non_finite = file
            .non_finite(matching.iter().map(String::as_str))?
            .into_iter()
            .map(|(name, nan, inf)| NonFinite { name, nan, inf })
            .collect();
    }
    if let Some(summary) = report.summary() {
        bail!(
            "GGUF file '{}' does not match the model its metadata describes: {summary}",
            file.label()
        )
    }
    Ok(())
}

/// The architecture, the tensors' types, and the config the metadata
/// describes.
fn checked_config(file: &GgufFile) -> Result<(HfDecoderConfig, Arch)> {
    Arch::of(file)?;
    check_types(file)?;
    gguf_config(file)
}

impl DecoderModel {
    /// What [`DecoderModel::from_gguf_file`] checks before it reads a
    /// weight, short of the NaN/Inf scan ([`GgufFile::non_finite`]): an
    /// error for an architecture, a tensor type or metadata it does not
    /// run; else the config the metadata describes
    /// ([`LlamaConfig::from_gguf`](crate::decoder::LlamaConfig::from_gguf),
    /// [`GemmaConfig::from_gguf`](crate::decoder::GemmaConfig::from_gguf)) and the
    /// tensors that config needs compared with the file's (every missing,
    /// unexpected and mis-shaped one, by the file's names; clean where it
    /// loads). `multihead inspect FILE.gguf` prints it.
    pub fn gguf_preflight(file: &GgufFile) -> Result<(HfDecoderConfig, Preflight)> {
        let (cfg, arch) = checked_config(file)?;
        let (report, _) = compare(file, &cfg, arch)?;
        Ok((cfg, report))
    }

    /// Loads a Llama-family decoder (arch `llama`, which Mistral files
    /// use too, `qwen2`, `qwen3`, `smollm3`, `olmo2` or `phi3`) or a Gemma
    /// (`gemma2`, `gemma3`) from a GGUF file as llama.cpp's converter
    /// writes it, F32, F16, BF16 or Q8_0: the config from its metadata
    /// ([`LlamaConfig::from_gguf`](crate::decoder::LlamaConfig::from_gguf),
    /// [`GemmaConfig::from_gguf`](crate::decoder::GemmaConfig::from_gguf)), the
    /// tensors checked against it (every missing, unexpected, mis-shaped
    /// or unreadable one named, then every one holding NaN or infinity,
    /// with the counts), the weight matrices in `opts.dtype` as
    /// [`DecoderModel::from_folder_with`] keeps them (Q8_0 dequantized to
    /// f32 first), norms and biases f32.
    pub fn from_gguf(path: &Path, device: &Device, opts: &LoadOptions) -> Result<Self> {
        Self::from_gguf_file(&GgufFile::read(path)?, device, opts)
    }

    /// [`DecoderModel::from_gguf`] from a file already read.
    pub fn from_gguf_file(file: &GgufFile, device: &Device, opts: &LoadOptions) -> Result<Self> {
        let (cfg, arch) = checked_config(file)?;
        preflight(file, &cfg, arch)?;
        let permuted = match &cfg {
            HfDecoderConfig::Llama(c) if arch.permutes_qk() => Some((c.num_attention_heads, c.kv_heads())),
            _ => None,
        };
        let lent = LentBlocks::new();
        let reader = GgufReader {
            file,
            names: names(&cfg)?,
            permuted,
            weight_dtype: opts.dtype.dtype(),
            keep_blocks: opts.dtype == WeightDtype::Ggml,
            lent: lent.clone(),
            progress: opts.progress.clone(),
            read: AtomicU64::new(0),
            total: file.tensors().iter().map(|t| t.range.len() as u64).sum(),
        };
        let vb = VarBuilder::from_backend(Box::new(reader), DType::F32, device.clone());
        let pack = opts.dtype.pack_options().with_lent(lent.clone());
        let model = build(&cfg, &pack, vb)?;
        // A placeholder that reached anything but a layer that keeps its
        // blocks would compute with zeros.
        lent.all_taken()?;
        Ok(model.with_kv_dtype(opts.kv_dtype))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inverse of the converter's permutation, written out for one
    /// head of width 4 (rows a0 a1 b0 b1 → a0 b0 a1 b1 in the file).
    #[test]
    fn unpermute_inverts_the_converter() -> Result<()> {
        // HF rows for 2 heads of width 4: [h0: 0 1 2 3, h1: 4 5 6 7].
        // The converter's (heads, 2, half) → (heads, half, 2): [0 2 1 3, 4 6 5 7].
        let file = Tensor::new(&[0f32, 2., 1., 3., 4., 6., 5., 7.], &Device::Cpu)?;
        let back = unpermute_rows(&file, 2)?.to_vec1::<f32>()?;
        assert_eq!(back, [0., 1., 2., 3., 4., 5., 6., 7.]);
        let w = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((8, 3))?;
        let permuted = w
            .reshape((2, 2, 2, 3))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((8, 3))?;
        let diff = (unpermute_rows(&permuted, 2)? - w)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.);
        assert!(unpermute_rows(&file, 3).is_err());
        Ok(())
    }
}
