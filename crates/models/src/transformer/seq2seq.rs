//! A complete sequence-to-sequence model around [`Transformer`]: token
//! embeddings, sinusoidal positions and an output projection.
//!
//! Port of `DateTranslator` in `scripts/train_dates.py`, the model the
//! `multihead seq2seq` command ships.

use candle::{bail, DType, Device, Module, Result, Tensor};
use candle_nn::{embedding, linear, Embedding, VarBuilder};
use multihead_attention::{Causal, KeyPaddingMask, Mask, PackOptions, PackedLinear};
use serde::{Deserialize, Serialize};

use super::cache::Seq2SeqCache;
use super::config::TransformerConfig;
use super::model::Transformer;
use crate::formats::safetensors::{checked_product, MinWeights};

/// Architecture and special tokens of a [`Seq2Seq`] model; the
/// `config.json` that `scripts/train_dates.py` writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Seq2SeqConfig {
    /// The encoder–decoder; must be `batch_first`.
    pub transformer: TransformerConfig,
    /// Source tokens (`src_embed` rows).
    pub src_vocab_size: usize,
    /// Target tokens (`tgt_embed` rows, `generator` outputs).
    pub tgt_vocab_size: usize,
    /// Rows of the positional table `pos_encoding.pe`.
    pub max_positions: usize,
    /// Longest source the model was trained for.
    pub max_src_len: usize,
    /// Most target tokens generated, the end token included.
    pub max_tgt_len: usize,
    /// Padding, in both vocabularies.
    pub pad_id: u32,
    /// Start of the target.
    pub bos_id: u32,
    /// End of the target.
    pub eos_id: u32,
    /// Whether embeddings are multiplied by `sqrt(d_model)` before the
    /// positions are added ("Attention Is All You Need", section 3.4).
    #[serde(default = "default_true")]
    pub scale_embeddings: bool,
}

fn default_true() -> bool {
    true
}

impl Seq2SeqConfig {
    /// Parses and validates `config.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let cfg: Self =
            serde_json::from_str(json).map_err(|e| candle::Error::Msg(format!("config.json: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The fewest weights a checkpoint of this config stores (the
    /// positional table is optional and not counted), with checked
    /// arithmetic; see [`crate::formats::safetensors::Checkpoint::ensure_holds`].
    #[deprecated(
        note = "a model's sizes are checked as its constructor is recorded: Checkpoint::load_bounded, Checkpoint::budget"
    )]
    #[allow(deprecated)]
    pub fn min_weights(&self) -> Result<MinWeights> {
        let d = self.transformer.d_model;
        let mut m = MinWeights::new("Seq2SeqConfig");
        m.add(
            format!("src_embed (src_vocab_size {} x d_model {d})", self.src_vocab_size),
            &[self.src_vocab_size, d],
        )?;
        m.add(
            format!(
                "tgt_embed and generator (2 x tgt_vocab_size {} x d_model {d})",
                self.tgt_vocab_size
            ),
            &[2, self.tgt_vocab_size, d],
        )?;
        self.transformer.add_min_weights(&mut m)?;
        Ok(m)
    }

    /// The config as a recording within a file's budget names it
    /// ([`crate::formats::safetensors::Checkpoint::load_bounded`]): with
    /// the sizes that decide how many weights its model asks for.
    pub fn budget_owner(&self) -> String {
        let t = &self.transformer;
        format!(
            "Seq2SeqConfig (num_encoder_layers {}, num_decoder_layers {}, d_model {}, dim_feedforward {}, \
             src_vocab_size {}, tgt_vocab_size {}, max_positions {})",
            t.num_encoder_layers,
            t.num_decoder_layers,
            t.d_model,
            t.dim_feedforward,
            self.src_vocab_size,
            self.tgt_vocab_size,
            self.max_positions
        )
    }

    /// Checks every value, naming the wrong one.
    pub fn validate(&self) -> Result<()> {
        self.transformer.validate()?;
        if !self.transformer.batch_first {
            bail!("Seq2SeqConfig: transformer.batch_first must be true (the model is batch-first)")
        }
        if self.src_vocab_size == 0 || self.tgt_vocab_size == 0 {
            bail!("Seq2SeqConfig: src_vocab_size and tgt_vocab_size must be > 0")
        }
        for (name, id) in [
            ("pad_id", self.pad_id),
            ("bos_id", self.bos_id),
            ("eos_id", self.eos_id),
        ] {
            if id as usize >= self.tgt_vocab_size {
                bail!(
                    "Seq2SeqConfig: {name} ({id}) must be < tgt_vocab_size ({})",
                    self.tgt_vocab_size
                )
            }
        }
        if self.pad_id as usize >= self.src_vocab_size {
            bail!(
                "Seq2SeqConfig: pad_id ({}) must be < src_vocab_size ({})",
                self.pad_id,
                self.src_vocab_size
            )
        }
        if checked_product(&[self.max_positions, self.transformer.d_model]).is_none() {
            bail!(
                "Seq2SeqConfig: max_positions ({}) x d_model ({}) overflows",
                self.max_positions,
                self.transformer.d_model
            )
        }
        if self.max_src_len == 0 || self.max_src_len > self.max_positions {
            bail!(
                "Seq2SeqConfig: max_src_len ({}) must be in 1..=max_positions ({})",
                self.max_src_len,
                self.max_positions
            )
        }
        if self.max_tgt_len == 0 || self.max_tgt_len > self.max_positions {
            bail!(
                "Seq2SeqConfig: max_tgt_len ({}) must be in 1..=max_positions ({})",
                self.max_tgt_len,
                self.max_positions
            )
        }
        Ok(())
    }
}

/// Most rows of a positional table [`Seq2Seq::new`] computes when the
/// weights do not store `pos_encoding.pe` (a stored table is bounded by
/// the file instead).
pub const MAX_COMPUTED_POSITIONS: usize = 1 << 16;

/// The sinusoidal table of "Attention Is All You Need" computed as
/// `scripts/train_dates.py` does (in f32): `(max_len, d_model)`.
pub fn sinusoidal_positions(max_len: usize, d_model: usize, device: &Device) -> Result<Tensor> {
    let Some(n) = checked_product(&[max_len, d_model]) else {
        bail!("sinusoidal_positions: {max_len} positions x {d_model} features overflows")
    };
    let mut pe = vec![0f32; n];
    for pos in 0..max_len {
        for i in (0..d_model).step_by(2) {
            // PyTorch multiplies the f32 `arange` by the scalar rounded to f32.
            let rate = (-(10000f64).ln() / d_model as f64) as f32;
            let div = (i as f32 * rate).exp();
            let angle = pos as f32 * div;
            pe[pos * d_model + i] = angle.sin();
            if i + 1 < d_model {
                pe[pos * d_model + i + 1] = angle.cos();
            }
        }
    }
    Tensor::from_vec(pe, (max_len, d_model), device)
}

/// An encoded source: the memory and which of its positions are padding.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// `(batch, src_len, d_model)`.
    pub memory: Tensor,
    /// `(batch, src_len)`, non-zero at padding.
    pub padding: KeyPaddingMask,
}

/// Token embeddings + positions -> [`Transformer`] -> `generator` logits.
///
/// State-dict names: `src_embed.weight`, `tgt_embed.weight`,
/// `pos_encoding.pe` (optional: computed when absent), `transformer.*`
/// (`nn.Transformer`), `generator.weight`, `generator.bias`.
#[derive(Debug, Clone)]
pub struct Seq2Seq {
    src_embed: Embedding,
    tgt_embed: Embedding,
    pe: Tensor,
    transformer: Transformer,
    generator: PackedLinear,
    cfg: Seq2SeqConfig,
}

impl Seq2Seq {
    /// Loads the model (or initialises it from a `VarMap`).
    pub fn new(cfg: &Seq2SeqConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_with(cfg, &PackOptions::default(), vb)
    }

    /// [`Seq2Seq::new`], every linear layer packed as `pack` asks (the
    /// format, the instruction set).
    pub fn new_with(cfg: &Seq2SeqConfig, pack: &PackOptions, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let d = cfg.transformer.d_model;
        // The embeddings first: a recording within the file's budget
        // (`Checkpoint::load_bounded`) refuses a `d_model` the file cannot
        // hold there, before a position table of that width is computed.
        let src_embed = embedding(cfg.src_vocab_size, d, vb.pp("src_embed"))?;
        let tgt_embed = embedding(cfg.tgt_vocab_size, d, vb.pp("tgt_embed"))?;
        let pe = if vb.contains_tensor("pos_encoding.pe") {
            vb.get((cfg.max_positions, d), "pos_encoding.pe")?
        } else if cfg.max_positions > MAX_COMPUTED_POSITIONS {
            bail!(
                "Seq2Seq: max_positions ({}) is over {MAX_COMPUTED_POSITIONS} and the weights store no \
                 pos_encoding.pe, so the table would be computed that large",
                cfg.max_positions
            )
        } else {
            sinusoidal_positions(cfg.max_positions, d, vb.device())?.to_dtype(vb.dtype())?
        };
        Ok(Self {
            src_embed,
            tgt_embed,
            pe,
            transformer: Transformer::new_with(&cfg.transformer, pack, vb.pp("transformer"))?,
            generator: PackedLinear::from_linear_with(
                linear(d, cfg.tgt_vocab_size, vb.pp("generator"))?,
                pack,
            )?,
            cfg: cfg.clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Seq2SeqConfig {
        &self.cfg
    }

    /// Where the weights live.
    pub fn device(&self) -> &Device {
        self.pe.device()
    }

    /// The encoder–decoder.
    pub fn transformer(&self) -> &Transformer {
        &self.transformer
    }

    /// `(batch, len)` ids at positions `offset..offset + len` ->
    /// `(batch, len, d_model)`.
    fn embed(&self, table: &Embedding, ids: &Tensor, offset: usize) -> Result<Tensor> {
        let (_, len) = ids.dims2()?;
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.cfg.max_positions)
        {
            bail!(
                "Seq2Seq: {len} positions from {offset} exceed the model's {} positions",
                self.cfg.max_positions
            )
        }
        let x = table.forward(ids)?;
        let x = if self.cfg.scale_embeddings {
            (x * (self.cfg.transformer.d_model as f64).sqrt())?
        } else {
            x
        };
        x.broadcast_add(&self.pe.narrow(0, offset, len)?)
    }

    /// Encodes right-padded source ids (`pad_id` marks padding).
    ///
    /// # Shapes
    /// - `src`: `(batch, src_len)`, `u32`
    /// - memory: `(batch, src_len, d_model)`
    pub fn encode(&self, src: &Tensor) -> Result<Encoded> {
        let src = src.to_dtype(DType::U32)?;
        let padding = KeyPaddingMask::PadWhereTrue(src.eq(self.cfg.pad_id)?);
        let mask = Mask::new().with_key_padding(padding.clone());
        let x = self.embed(&self.src_embed, &src, 0)?;
        let memory = self.transformer.encoder().forward(&x, &mask)?;
        Ok(Encoded { memory, padding })
    }

    /// Logits for every target position at once, causal (the training
    /// pass, and the uncached decoding reference).
    ///
    /// # Shapes
    /// - `tgt`: `(batch, tgt_len)`, `u32`, starting with `bos_id`
    /// - returns `(batch, tgt_len, tgt_vocab_size)`
    pub fn decode_full(&self, tgt: &Tensor, enc: &Encoded) -> Result<Tensor> {
        let x = self.embed(&self.tgt_embed, &tgt.to_dtype(DType::U32)?, 0)?;
        let tgt_mask = Mask::causal(Causal::TopLeft);
        let memory_mask = Mask::new().with_key_padding(enc.padding.clone());
        let out = self
            .transformer
            .decoder()
            .forward(&x, &enc.memory, &tgt_mask, &memory_mask)?;
        self.generator.forward(&out)
    }

    /// Starts cached decoding over an encoded source.
    pub fn start(&self, enc: &Encoded) -> Result<Seq2SeqCache> {
        self.transformer
            .decoder()
            .start(&enc.memory, Some(enc.padding.clone()))
    }

    /// Feeds the next target ids through the cache and returns their
    /// logits.
    ///
    /// # Shapes
    /// - `tgt`: `(batch, new_len)`, `u32`
    /// - returns `(batch, new_len, tgt_vocab_size)`
    pub fn step(&self, tgt: &Tensor, cache: &mut Seq2SeqCache) -> Result<Tensor> {
        let x = self.embed(&self.tgt_embed, &tgt.to_dtype(DType::U32)?, cache.len())?;
        let out = self.transformer.decoder().step(&x, cache)?;
        self.generator.forward(&out)
    }

    /// [`Seq2Seq::step`] that also returns the cross-attention weights,
    /// averaged over heads and layers: `(batch, new_len, src_len)`.
    pub fn step_with_attention(&self, tgt: &Tensor, cache: &mut Seq2SeqCache) -> Result<(Tensor, Tensor)> {
        let x = self.embed(&self.tgt_embed, &tgt.to_dtype(DType::U32)?, cache.len())?;
        let step = self.transformer.decoder().step_with_weights(&x, cache)?;
        let n = step.cross_attention.len();
        if n == 0 {
            bail!("Seq2Seq: a decoder without layers has no cross-attention")
        }
        let attn = (Tensor::stack(&step.cross_attention, 0)?
            .to_dtype(DType::F32)?
            .sum(0)?
            / n as f64)?;
        Ok((self.generator.forward(&step.output)?, attn))
    }
}
