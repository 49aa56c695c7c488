//! The encoder–decoder `multihead seq2seq` runs, loaded with its
//! vocabulary, and its batched translation.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor};
use multihead_models::checkpoint::ModelFiles;
use multihead_models::dates::{self, DateOrder, DateReading, StatedYear};
use multihead_models::generation::{
    Decoding, Generated, LogitsProcessor, Temperature, TokenConstraint, TopK, TopP,
};
use multihead_models::transformer::{CacheMode, CharVocab, Seq2Seq, Seq2SeqConfig};

use super::{Constraint, GenerationArgs};
use crate::cli::model_files::{self, Text};

/// Sources translated per forward pass.
const BATCH: usize = 64;

/// The model, its vocabulary and the device it runs on.
pub(super) struct Translator {
    pub(super) model: Seq2Seq,
    pub(super) vocab: CharVocab,
    pub(super) device: Device,
}

impl Translator {
    /// The model of `--weights` (file or folder), or the built-in one.
    pub(super) fn load(weights: Option<&Path>, device: Device, dtype: DType) -> Result<Self> {
        let (config, vocab, ckpt) = match weights {
            None => model_files::dates()?,
            Some(path) => {
                let at = ModelFiles::resolve(path)?;
                let config = Text::read(&at.beside("config.json"), "config")?;
                let vocab = Text::read(&at.beside("vocab.json"), "vocab")?;
                (config, vocab, at.read()?)
            }
        };
        let cfg = Seq2SeqConfig::from_json(&config.text).with_context(|| config.label.clone())?;
        let vocab_map = CharVocab::from_json(&vocab.text).with_context(|| vocab.label.clone())?;
        if vocab_map.src.len() != cfg.src_vocab_size || vocab_map.tgt.len() != cfg.tgt_vocab_size {
            bail!(
                "vocab {} has {} source and {} target entries but config {} says {} and {}",
                vocab.label,
                vocab_map.src.len(),
                vocab_map.tgt.len(),
                config.label,
                cfg.src_vocab_size,
                cfg.tgt_vocab_size
            )
        }
        // The checked path `vit` uses: header validated, the config's
        // sizes bounded by what the file holds as the model is recorded,
        // then every missing, unexpected, mis-shaped and NaN/Inf tensor
        // reported at once.
        let model = ckpt
            .load_bounded(&cfg.budget_owner(), dtype, &device, |vb, pack| {
                Seq2Seq::new_with(&cfg, pack, vb)
            })
            .with_context(|| format!("with config {}", config.label))?;
        Ok(Self {
            model,
            vocab: vocab_map,
            device,
        })
    }

    /// Source ids of one input, or why it cannot be translated.
    pub(super) fn encode(&self, text: &str, order: DateOrder) -> Result<Vec<u32>> {
        let n = text.chars().count();
        let ids = dates::encode_source(&self.vocab, text, order)?;
        // The reading's prefix token, when the model has one, counts too.
        let max = self.model.config().max_src_len - (ids.len() - n);
        if n == 0 {
            bail!("empty input")
        }
        if n > max {
            bail!("input is {n} characters long; the model reads at most {max}")
        }
        Ok(ids)
    }

    /// Generates per `g`: for each source its output lines (N with
    /// --num-return, each with its log-probability), or why it could not
    /// be read as a date.
    pub(super) fn generate(
        &self,
        sources: &[Vec<u32>],
        years: &[StatedYear],
        beam: usize,
        g: &GenerationArgs,
    ) -> Result<Vec<std::result::Result<Vec<String>, String>>> {
        let decoding = if g.sample {
            Decoding::Sample { seed: g.seed }
        } else if beam > 1 || g.num_return > 1 {
            Decoding::Beam {
                beams: beam.max(g.num_return),
            }
        } else {
            Decoding::Greedy
        };
        let cfg = self
            .model
            .generation_config()
            .with_decoding(decoding)
            .with_num_return(g.num_return);
        let constraint = match g.constraint {
            Constraint::Date => Some(
                TokenConstraint::from_pattern(dates::ISO_DATE_PATTERN, &self.vocab.tgt_tokens(), cfg.eos_id)
                    .context("the date constraint does not fit this model's vocabulary")?,
            ),
            Constraint::None => None,
        };
        let temperature = g.temperature.map(Temperature::new).transpose()?;
        let top_k = g.top_k.map(TopK::new).transpose()?;
        let top_p = g.top_p.map(TopP::new).transpose()?;
        let mut processors: Vec<&dyn LogitsProcessor> = Vec::new();
        // The constraint first: the warpers then renormalise over the
        // tokens it leaves.
        processors.extend(constraint.as_ref().map(|c| c as &dyn LogitsProcessor));
        processors.extend(temperature.as_ref().map(|p| p as &dyn LogitsProcessor));
        processors.extend(top_k.as_ref().map(|p| p as &dyn LogitsProcessor));
        processors.extend(top_p.as_ref().map(|p| p as &dyn LogitsProcessor));
        let mut outputs = Vec::with_capacity(sources.len());
        for (i, (chunk, years)) in sources.chunks(BATCH).zip(years.chunks(BATCH)).enumerate() {
            let src = padded(chunk, self.model.config().pad_id, &self.device)?;
            // Samples are keyed to the source's place in the whole list.
            let cfg = cfg.clone().with_first_source(i * BATCH);
            for (hyps, &year) in self.model.generate(&src, &cfg, &processors)?.iter().zip(years) {
                outputs.push(self.outputs(hyps, year, g));
            }
        }
        Ok(outputs)
    }

    /// One input's output lines, or why it is unreadable as a date (with
    /// `--constraint date`, a date whose year is not the one the input
    /// states does not count).
    pub(super) fn outputs(
        &self,
        hyps: &[Generated],
        year: StatedYear,
        g: &GenerationArgs,
    ) -> std::result::Result<Vec<String>, String> {
        let mut kept: Vec<(String, f32)> = hyps
            .iter()
            .map(|h| (self.vocab.decode(&h.tokens), h.score))
            .collect();
        if g.constraint == Constraint::Date {
            // A sample is a draw, not a claim of the best reading: only its
            // validity counts.
            let min_prob = if g.sample { 0. } else { g.min_prob };
            let keep_year: Vec<Generated> = hyps
                .iter()
                .filter(|h| year.kept_by(&self.vocab.decode(&h.tokens)))
                .cloned()
                .collect();
            match dates::read_date(&keep_year, &self.vocab, min_prob) {
                DateReading::Date { .. } => {
                    // Every real date among the outputs, best first.
                    kept = keep_year
                        .iter()
                        .filter(|h| h.finished)
                        .map(|h| (self.vocab.decode(&h.tokens), h.score))
                        .filter(|(t, _)| dates::is_calendar_date(t))
                        .collect();
                }
                DateReading::Unreadable { best: None }
                    if keep_year.len() < hyps.len()
                        && matches!(dates::read_date(hyps, &self.vocab, 0.), DateReading::Date { .. }) =>
                {
                    return Err(format!(
                        "cannot read a date: the model's readings do not keep the year the input states ({year})"
                    ));
                }
                DateReading::Unreadable { best } => {
                    return Err(match best {
                        Some((text, p)) => format!(
                            "cannot read a date: the best real date, {text}, has probability {p:.3} (below --min-prob {})",
                            g.min_prob
                        ),
                        None => "cannot read a date: no output is a real date".to_string(),
                    });
                }
            }
        }
        Ok(if g.num_return == 1 {
            vec![kept.first().map_or(String::new(), |(t, _)| t.clone())]
        } else {
            kept.iter()
                .map(|(text, score)| format!("{text}\t{score:.4}"))
                .collect()
        })
    }

    pub(super) fn translate(&self, sources: &[Vec<u32>], beam: usize) -> Result<Vec<String>> {
        let mut out = Vec::with_capacity(sources.len());
        for chunk in sources.chunks(BATCH) {
            let src = padded(chunk, self.model.config().pad_id, &self.device)?;
            let ids = if beam == 1 {
                self.model.greedy(&src, CacheMode::Use)?
            } else {
                self.model
                    .beam_search(&src, beam)?
                    .into_iter()
                    .map(|h| h.tokens)
                    .collect()
            };
            out.extend(ids.iter().map(|ids| self.vocab.decode(ids)));
        }
        Ok(out)
    }
}

/// Right-pads rows of ids to a `(rows, max_len)` tensor.
fn padded(rows: &[Vec<u32>], pad: u32, device: &Device) -> Result<Tensor> {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let data: Vec<u32> = rows
        .iter()
        .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(pad, n - r.len())))
        .collect();
    Ok(Tensor::from_vec(data, (rows.len(), n), device)?)
}
