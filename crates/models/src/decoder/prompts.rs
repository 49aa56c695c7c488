//! Prompts to continuations: left-padded into one batch, prefilled whole,
//! and searched from the logits of their last tokens.

use std::cell::RefCell;

use candle::{bail, Device, Result, Tensor};

use super::{CausalLm, DecoderCache};
use crate::generation::{
    generate_from, generate_streaming, generate_streaming_in, Chosen, GenerateConfig, Generated,
    LogitsProcessor, StepModel,
};

/// Prompts of different lengths, left-padded with `pad_id` into one
/// batch, as HF's `generate` takes them: `(ids, left_padding)`.
pub fn left_pad(prompts: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<(Tensor, Vec<usize>)> {
    let len = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        bail!("left_pad: every prompt needs at least one token")
    }
    let pads: Vec<usize> = prompts.iter().map(|p| len - p.len()).collect();
    let data: Vec<u32> = prompts
        .iter()
        .zip(&pads)
        .flat_map(|(p, &n)| std::iter::repeat_n(pad_id, n).chain(p.iter().copied()))
        .collect();
    Ok((Tensor::from_vec(data, (prompts.len(), len), device)?, pads))
}

/// Generates a continuation of each prompt: prompts are left-padded into
/// one batch and prefilled whole in one call, and decoding starts from
/// the logits of each prompt's last token, with `processors` applied at
/// every step ([`crate::generation::generate_from`]).
///
/// A model with a bounded context ([`CausalLm::max_positions`]) refuses a
/// prompt that does not fit it, naming both lengths, and stops every row
/// where the context ends: such a row keeps its tokens and is not
/// `finished` (cut for length, as at `max_len`).
pub fn generate_from_prompts<M: CausalLm>(
    model: &M,
    prompts: &[Vec<u32>],
    pad_id: u32,
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
) -> Result<Vec<Vec<Generated>>> {
    match prefill(model, prompts, pad_id, cfg)? {
        Some(p) => generate_from(&p.model, p.cache, &p.last, &p.cfg, processors),
        None => Ok(Vec::new()),
    }
}

/// [`generate_from_prompts`] calling `on_token` with each token as it is
/// chosen ([`crate::generation::generate_streaming`]; greedy decoding and
/// sampling); `on_token` answers whether the row goes on.
pub fn generate_from_prompts_streaming<M: CausalLm>(
    model: &M,
    prompts: &[Vec<u32>],
    pad_id: u32,
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
    on_token: &mut dyn FnMut(Chosen) -> Result<bool>,
) -> Result<Vec<Vec<Generated>>> {
    match prefill(model, prompts, pad_id, cfg)? {
        Some(p) => generate_streaming(&p.model, p.cache, &p.last, &p.cfg, processors, on_token),
        None => Ok(Vec::new()),
    }
}

/// [`generate_from_prompts_streaming`] for one sequence whose cache the
/// caller keeps (a conversation's): `new` (not empty) is prefilled after
/// what `cache` holds, and decoding goes on from its last token. The cache
/// then holds every token fed ([`crate::generation::generate_streaming_in`]).
pub fn continue_streaming<M: CausalLm>(
    model: &M,
    cache: &mut DecoderCache,
    new: &[u32],
    cfg: &GenerateConfig,
    processors: &[&dyn LogitsProcessor],
    on_token: &mut dyn FnMut(Chosen) -> Result<bool>,
) -> Result<Generated> {
    let Some(&last) = new.last() else {
        bail!("continue_streaming: no new token to prefill")
    };
    let cfg = within_context(model, cache.len() + new.len(), cfg)?;
    let ids = Tensor::new(new, model.device())?.unsqueeze(0)?;
    let logits = model.prefill_last(&ids, cache)?;
    let model = Primed {
        model,
        first: RefCell::new(Some(logits)),
    };
    let out = generate_streaming_in(&model, cache, &[last], &cfg, processors, on_token)?;
    match out.into_iter().next().and_then(|g| g.into_iter().next()) {
        Some(g) => Ok(g),
        None => bail!("generate: no output for the conversation"),
    }
}

/// Prompts prefilled, ready for the search to start from their last
/// tokens.
struct Prefilled<'a, M> {
    /// The model, its first step taken by the prefill.
    model: Primed<'a, M>,
    cache: DecoderCache,
    /// Each prompt's last token, the search's first fed.
    last: Vec<u32>,
    /// The caller's, `max_len` cut to the context.
    cfg: GenerateConfig,
}

/// The prompts left-padded and prefilled, whole, in one call
/// ([`CausalLm::prefill_last`]); `None` for no prompt (no output, as on
/// every decoding path).
fn prefill<'a, M: CausalLm>(
    model: &'a M,
    prompts: &[Vec<u32>],
    pad_id: u32,
    cfg: &GenerateConfig,
) -> Result<Option<Prefilled<'a, M>>> {
    if prompts.is_empty() {
        return Ok(None);
    }
    let (ids, pads) = left_pad(prompts, pad_id, model.device())?;
    let len = ids.dim(1)?;
    // Positions count from each row's first real token: the longest prompt
    // reaches furthest.
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let cfg = within_context(model, longest, cfg)?;
    let mut cache = model.new_cache(pads);
    // The prompt and at most `max_len` new tokens (the last never fed):
    // the cache need not round up past them.
    cache.expect_at_most(len.saturating_add(cfg.max_len));
    let logits = model.prefill_last(&ids, &mut cache)?;
    let last: Vec<u32> = ids.narrow(1, len - 1, 1)?.flatten_all()?.to_vec1()?;
    let model = Primed {
        model,
        first: RefCell::new(Some(logits)),
    };
    Ok(Some(Prefilled {
        model,
        cache,
        last,
        cfg,
    }))
}

/// `cfg` with `max_len` cut to what a model with a bounded context
/// ([`CausalLm::max_positions`]) can still generate after `held` tokens;
/// more tokens than the context holds are refused with both numbers. The
/// step feeding position p yields the token at p + 1, so positions up to
/// `context - 1` can be fed.
pub(crate) fn within_context<M: CausalLm>(
    model: &M,
    held: usize,
    cfg: &GenerateConfig,
) -> Result<GenerateConfig> {
    let mut cfg = cfg.clone();
    if let Some(context) = model.max_positions() {
        if held > context {
            bail!(
                "generate: a prompt of {held} tokens does not fit the model's context of {context} positions"
            )
        }
        cfg.max_len = cfg.max_len.min(context - held + 1);
    }
    Ok(cfg)
}

/// A decoder whose first step is already taken: the search feeds each
/// prompt's last token at its first step, and gets the logits the
/// prefill computed for it, since the token is in the cache; every later
/// step runs the model.
struct Primed<'a, M> {
    model: &'a M,
    /// The first step's logits, `(B, V)`, rows selected as the cache's.
    first: RefCell<Option<Tensor>>,
}

impl<M: CausalLm> StepModel for Primed<'_, M> {
    type Cache = DecoderCache;

    fn step(&self, tokens: &Tensor, cache: &mut DecoderCache) -> Result<Tensor> {
        match self.first.borrow_mut().take() {
            Some(logits) => Ok(logits),
            None => StepModel::step(self.model, tokens, cache),
        }
    }

    fn select_rows(&self, cache: &mut DecoderCache, rows: &Tensor) -> Result<()> {
        if let Some(logits) = self.first.borrow_mut().as_mut() {
            *logits = logits.index_select(rows, 0)?;
        }
        cache.select_rows(rows)
    }

    fn vocab_size(&self) -> usize {
        CausalLm::vocab_size(self.model)
    }

    fn device(&self) -> &Device {
        CausalLm::device(self.model)
    }
}
