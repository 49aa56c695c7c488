//! Continuous batching: many sequences decoded together, as llama-server's
//! parallel slots and vLLM's scheduler decode them.
//!
//! The sequences being decoded share one [`DecoderCache`], a row each,
//! aligned at their ends by left padding, and every step feeds one token
//! of each through the model in one batched forward: the weights are read
//! once a step for all of them. A new sequence is prefilled alone, in
//! chunks between the steps (so a long prompt does not stall the others),
//! then its cache joins the batch's ([`DecoderCache::join_rows`]); a
//! sequence that ends, or whose listener leaves, gives its row up before
//! the next step. Each sequence keeps its own settings, processors and
//! random stream, so its tokens are the ones it would get alone
//! ([`super::TextGenerator::generate`] with the same settings).

use std::collections::VecDeque;
use std::time::Instant;

use candle::{bail, Result, Tensor};

use super::pipeline::{Plan, StopStrings};
use super::prompts::within_context;
use super::{CausalLm, DecoderCache, Finish, GenerationSettings, TextGenerator, TextOutput, TextStream};
use crate::generation::{apply, draw, greedy_pick, log_probs, SplitMix64, StepContext};

/// Prompt tokens a sequence's prefill reads between two decoding steps of
/// the others, unless [`Batcher::with_prefill_chunk`] says otherwise.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// What to generate: a prompt's ids (special tokens included) and how.
#[derive(Debug, Clone)]
pub struct BatchRequest {
    /// The prompt, tokenized; not empty.
    pub prompt_ids: Vec<u32>,
    /// How its continuation is generated.
    pub settings: GenerationSettings,
    /// Never choose an end token (llama-server's `ignore_eos`): the
    /// continuation runs to `max_new_tokens`.
    pub ignore_eos: bool,
}

/// What a sequence tells its listener, in order: text as it becomes
/// final, then one `Done` or one `Failed`.
#[derive(Debug, Clone)]
pub enum BatchEvent {
    /// Text that became final; the pieces concatenate to `Done`'s text.
    Text(String),
    /// The sequence ended.
    Done(TextOutput),
    /// The sequence failed (its logits were unusable, say); the others go
    /// on.
    Failed(String),
}

/// Where a sequence's events go.
pub trait BatchSink: Send {
    /// Takes an event; `false` when nobody listens any more, which ends
    /// the sequence there.
    fn send(&mut self, event: BatchEvent) -> bool;

    /// Whether nobody listens any more (a client that disconnected),
    /// asked before every step so that a silent sequence, still in its
    /// prefill, is dropped too.
    fn is_closed(&self) -> bool {
        false
    }
}

impl<F: FnMut(BatchEvent) -> bool + Send> BatchSink for F {
    fn send(&mut self, event: BatchEvent) -> bool {
        self(event)
    }
}

/// One sequence: its request, its search state and its listener.
struct Sequence<'g> {
    sink: Box<dyn BatchSink>,
    prompt_ids: Vec<u32>,
    plan: Plan,
    rng: Option<SplitMix64>,
    /// The tokens generated, the end token not included.
    tokens: Vec<u32>,
    stream: TextStream<'g>,
    stops: Option<StopStrings>,
    /// The token the next step feeds: the last one chosen.
    next: u32,
    /// Prompt tokens read so far.
    read: usize,
    /// The sequence's own cache while its prompt is read; `None` once it
    /// joined the batch's.
    cache: Option<DecoderCache>,
    submitted: Instant,
    first_token: Option<Instant>,
}

/// How a sequence's step ended.
enum Outcome {
    /// It goes on.
    Next,
    /// It ended for this reason.
    Ended(Finish),
    /// Its listener left.
    Left,
}

/// Decodes many sequences together (continuous batching): at most
/// `parallel` at once, the rest queued in order.
pub struct Batcher<'g> {
    generator: &'g TextGenerator,
    parallel: usize,
    chunk: usize,
    waiting: VecDeque<Sequence<'g>>,
    prefilling: Option<Sequence<'g>>,
    /// The sequences decoding, in the order of the batch cache's rows.
    active: Vec<Sequence<'g>>,
    cache: DecoderCache,
    steps: usize,
}

impl std::fmt::Debug for Batcher<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("parallel", &self.parallel)
            .field("waiting", &self.waiting.len())
            .field("prefilling", &self.prefilling.is_some())
            .field("active", &self.active.len())
            .field("cached", &self.cache.len())
            .finish()
    }
}

impl<'g> Batcher<'g> {
    /// A batcher over `generator`'s model decoding at most `parallel`
    /// (at least 1) sequences at once.
    pub fn new(generator: &'g TextGenerator, parallel: usize) -> Self {
        Self {
            generator,
            parallel: parallel.max(1),
            chunk: DEFAULT_PREFILL_CHUNK,
            waiting: VecDeque::new(),
            prefilling: None,
            active: Vec::new(),
            cache: generator.model().new_cache(Vec::new()),
            steps: 0,
        }
    }

    /// The same, reading at most `chunk` (at least 1) prompt tokens
    /// between two steps.
    pub fn with_prefill_chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk.max(1);
        self
    }

    /// Queues `request`, its events going to `sink`. A request that cannot
    /// run (no prompt, a prompt past the context, settings the search
    /// refuses) is refused here, before anything is queued.
    pub fn submit(&mut self, request: BatchRequest, sink: Box<dyn BatchSink>) -> Result<()> {
        let BatchRequest {
            prompt_ids,
            settings,
            ignore_eos,
        } = request;
        let Some(&last) = prompt_ids.last() else {
            bail!("the prompt has no tokens: there is nothing to continue")
        };
        let model = self.generator.model();
        let vocab = CausalLm::vocab_size(model);
        if let Some(&t) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
            bail!("the prompt holds token {t}, outside the model's vocabulary of {vocab}")
        }
        let mut plan = self.generator.plan(&prompt_ids, &settings, ignore_eos)?;
        plan.cfg = within_context(model, prompt_ids.len(), &plan.cfg)?;
        plan.cfg.validate(vocab)?;
        for p in plan.processors() {
            p.check(vocab, plan.cfg.max_len)?;
        }
        let rng = settings.sampling.as_ref().map(|s| SplitMix64::for_row(s.seed, 0));
        let stops = (!settings.stop_strings.is_empty()).then(|| StopStrings::new(settings.stop_strings));
        self.waiting.push_back(Sequence {
            sink,
            prompt_ids,
            plan,
            rng,
            tokens: Vec::new(),
            stream: self.generator.tokenizer().stream(),
            stops,
            next: last,
            read: 0,
            cache: None,
            submitted: Instant::now(),
            first_token: None,
        });
        Ok(())
    }

    /// Sequences queued, not started.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences started: being prefilled or decoded.
    pub fn running(&self) -> usize {
        self.active.len() + usize::from(self.prefilling.is_some())
    }

    /// Whether there is nothing to do.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running() == 0
    }

    /// Decoding steps taken so far, each one batched forward.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// One round: sequences whose listener left are dropped; the next
    /// queued sequence starts if a place is free; the sequence being
    /// prefilled reads its next chunk (and joins the batch after its
    /// last); then every decoding sequence gets one token, in one forward.
    /// A failure of one sequence is told to its listener alone; an error
    /// is returned only for a failure of the whole batch (after telling
    /// every sequence in it).
    pub fn step(&mut self) -> Result<()> {
        self.drop_closed()?;
        if self.prefilling.is_none() && self.active.len() < self.parallel {
            self.prefilling = self.waiting.pop_front();
        }
        if let Some(seq) = self.prefilling.take() {
            self.prefill(seq)?;
        }
        if !self.active.is_empty() {
            self.decode()?;
        }
        Ok(())
    }

    /// Drops the sequences nobody listens to any more.
    fn drop_closed(&mut self) -> Result<()> {
        self.waiting.retain(|s| !s.sink.is_closed());
        if self.prefilling.as_ref().is_some_and(|s| s.sink.is_closed()) {
            self.prefilling = None;
        }
        let keep: Vec<bool> = self.active.iter().map(|s| !s.sink.is_closed()).collect();
        self.keep_rows(&keep)
    }

    /// Reads the next chunk of `seq`'s prompt; after the last, chooses its
    /// first token and moves it into the batch.
    fn prefill(&mut self, mut seq: Sequence<'g>) -> Result<()> {
        let model = self.generator.model();
        let end = (seq.read + self.chunk).min(seq.prompt_ids.len());
        let cache = seq.cache.get_or_insert_with(|| model.new_cache(Vec::new()));
        let ids = Tensor::new(&seq.prompt_ids[seq.read..end], model.device())?.unsqueeze(0)?;
        if end < seq.prompt_ids.len() {
            match model.prefill(&ids, cache) {
                Ok(()) => {
                    seq.read = end;
                    self.prefilling = Some(seq);
                }
                Err(e) => fail(seq, &e.to_string()),
            }
            return Ok(());
        }
        let logits = match model.prefill_last(&ids, cache) {
            Ok(logits) => logits,
            Err(e) => {
                fail(seq, &e.to_string());
                return Ok(());
            }
        };
        seq.read = end;
        match choose(&mut seq, &logits, 0) {
            Ok(Outcome::Next) => {
                let cache = seq.cache.take();
                if let Some(cache) = cache {
                    if let Err(e) = self.cache.join_rows(&cache) {
                        fail(seq, &e.to_string());
                        return Ok(());
                    }
                }
                self.active.push(seq);
            }
            Ok(Outcome::Ended(finish)) => self.finish(seq, finish),
            Ok(Outcome::Left) => {}
            Err(e) => fail(seq, &e.to_string()),
        }
        Ok(())
    }

    /// One token for every decoding sequence, in one batched forward.
    fn decode(&mut self) -> Result<()> {
        let model = self.generator.model();
        let fed: Vec<u32> = self.active.iter().map(|s| s.next).collect();
        let n = fed.len();
        let logits = Tensor::from_vec(fed, (n, 1), model.device())
            .and_then(|t| model.forward(&t, &mut self.cache))
            .and_then(|l| l.squeeze(1));
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // What the cache holds is not known any more: every
                // sequence in the batch fails.
                let why = e.to_string();
                for seq in self.active.drain(..) {
                    fail(seq, &why);
                }
                self.cache = model.new_cache(Vec::new());
                return Err(e);
            }
        };
        self.steps += 1;
        let mut keep = vec![true; n];
        let active = std::mem::take(&mut self.active);
        let mut still = Vec::with_capacity(n);
        for (r, mut seq) in active.into_iter().enumerate() {
            let step = seq.tokens.len();
            match logits
                .narrow(0, r, 1)
                .and_then(|row| choose(&mut seq, &row, step))
            {
                Ok(Outcome::Next) => still.push(Some(seq)),
                Ok(Outcome::Ended(finish)) => {
                    keep[r] = false;
                    self.finish(seq, finish);
                    still.push(None);
                }
                Ok(Outcome::Left) => {
                    keep[r] = false;
                    still.push(None);
                }
                Err(e) => {
                    keep[r] = false;
                    fail(seq, &e.to_string());
                    still.push(None);
                }
            }
        }
        // Rows stay in the cache's order until `keep_rows` drops the ended.
        self.active = still.into_iter().flatten().collect();
        self.keep_rows_of(&keep)
    }

    /// Keeps the active sequences and cache rows where `keep` is true.
    fn keep_rows(&mut self, keep: &[bool]) -> Result<()> {
        if keep.iter().all(|&k| k) {
            return Ok(());
        }
        let mut kept = keep.iter();
        self.active.retain(|_| kept.next().copied().unwrap_or(true));
        self.keep_rows_of(keep)
    }

    /// Keeps the cache rows where `keep` is true (the sequences already
    /// kept), and drops the padding every remaining row has in front.
    fn keep_rows_of(&mut self, keep: &[bool]) -> Result<()> {
        if keep.iter().all(|&k| k) {
            return Ok(());
        }
        if self.active.is_empty() {
            self.cache = self.generator.model().new_cache(Vec::new());
            return Ok(());
        }
        let rows: Vec<u32> = (0u32..).zip(keep).filter(|(_, &k)| k).map(|(r, _)| r).collect();
        let rows = Tensor::new(rows.as_slice(), self.generator.model().device())?;
        self.cache.select_rows(&rows)?;
        self.cache.trim_padding()
    }

    /// Tells `seq`'s listener the rest of its text and its output.
    fn finish(&self, seq: Sequence<'g>, finish: Finish) {
        let Sequence {
            mut sink,
            prompt_ids,
            tokens,
            stream,
            submitted,
            first_token,
            ..
        } = seq;
        let text = stream
            .finish()
            .and_then(|rest| Ok((rest, self.generator.tokenizer().decode(&tokens)?)));
        let (rest, text) = match text {
            Ok(t) => t,
            Err(e) => {
                sink.send(BatchEvent::Failed(e.to_string()));
                return;
            }
        };
        if !rest.is_empty() && !sink.send(BatchEvent::Text(rest)) {
            return;
        }
        let end = Instant::now();
        let split = first_token.unwrap_or(end);
        sink.send(BatchEvent::Done(TextOutput {
            prompt_ids,
            ids: tokens,
            text,
            finish,
            prefill_ms: (split - submitted).as_secs_f64() * 1e3,
            decode_ms: (end - split).as_secs_f64() * 1e3,
        }));
    }
}

/// Tells `seq`'s listener why it failed.
fn fail(mut seq: Sequence<'_>, why: &str) {
    seq.sink.send(BatchEvent::Failed(why.to_string()));
}

/// Chooses `seq`'s next token from its row of logits, `(1, vocab)`, at
/// decoding step `step`, and tells its listener the text it completes.
fn choose(seq: &mut Sequence<'_>, logits: &Tensor, step: usize) -> Result<Outcome> {
    let (mut scores, offsets, mut logits) = log_probs(logits, step)?;
    let (Some(mut scores), Some(&offset), Some(logits)) = (scores.pop(), offsets.first(), logits.pop())
    else {
        bail!("step {step}: no logits for the sequence")
    };
    let cfg = &seq.plan.cfg;
    let ctx = StepContext {
        source: 0,
        prefix: &seq.tokens,
        max_len: cfg.max_len,
        logit_offset: offset,
    };
    apply(&seq.plan.processors(), &ctx, &mut scores)?;
    let pick = match seq.rng.as_mut() {
        Some(rng) => draw(&scores, rng),
        None => greedy_pick(&scores, &logits),
    };
    // Every token forbidden: the sequence ends, unfinished.
    let Some(t) = pick.map(|t| t as u32) else {
        return Ok(Outcome::Ended(Finish::Length));
    };
    if cfg.is_eos(t) {
        return Ok(Outcome::Ended(Finish::Eos));
    }
    seq.first_token.get_or_insert_with(Instant::now);
    seq.tokens.push(t);
    seq.next = t;
    let piece = seq.stream.push(t)?;
    if let Some(piece) = &piece {
        if !seq.sink.send(BatchEvent::Text(piece.clone())) {
            return Ok(Outcome::Left);
        }
    }
    if let Some(stops) = seq.stops.as_mut() {
        if stops.found(piece.as_deref().unwrap_or_default(), &seq.stream.pending()?) {
            return Ok(Outcome::Ended(Finish::Stop));
        }
    }
    if seq.tokens.len() >= cfg.max_len {
        return Ok(Outcome::Ended(Finish::Length));
    }
    Ok(Outcome::Next)
}
