//! Text in, text out: a decoder folder's model, tokenizer and generation
//! config in one type (HF's `pipeline("text-generation")`), streaming
//! each prompt's continuation as it is generated.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle::{bail, Device, Result};

use super::prompts::continue_streaming;
use super::{
    generate_from_prompts_streaming, CausalLm, ChatMessage, ChatTemplate, DecoderCache, DecoderModel,
    HfGenerationConfig, TemplateArgs, TextTokenizer,
};
use crate::checkpoint::{LoadOptions, LoadProgress, ModelFiles};
use crate::generation::{
    Chosen, Decoding, GenerateConfig, LogitsProcessor, MinLength, RepetitionPenalty, Temperature,
    TokenConstraint, TopK, TopP,
};

/// How a continuation is generated; [`TextGenerator::settings`] starts
/// from the folder's `generation_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationSettings {
    /// Most tokens generated after the prompt, the end token included.
    pub max_new_tokens: usize,
    /// Fewest tokens before an end token may be chosen.
    pub min_new_tokens: usize,
    /// Greedy decoding when `None`.
    pub sampling: Option<Sampling>,
    /// HF's `repetition_penalty`, over the prompt's and the generated
    /// tokens' logits.
    pub repetition_penalty: Option<f32>,
    /// Generation stops once the text holds one of these (HF's
    /// `stop_strings`); the text keeps it.
    pub stop_strings: Vec<String>,
    /// A regular expression the whole continuation must match (the
    /// `regex` crate's syntax, over the text's bytes): every step allows
    /// only the tokens after which it still can, within the tokens left,
    /// and the end token once it does
    /// ([`crate::generation::TokenConstraint::from_regex_bytes`]).
    pub constraint: Option<String>,
}

/// Sampling: the seed of the draws and the warpers, in HF's order.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Fixes every draw.
    pub seed: u64,
    /// Divides the scores (1: unchanged).
    pub temperature: f32,
    /// Keeps the `k` best tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Keeps the fewest best tokens whose probabilities reach `p` (1: all).
    pub top_p: f32,
}

impl Default for Sampling {
    /// Plain sampling from the model's distribution: temperature 1, every
    /// token kept, seed 0.
    fn default() -> Self {
        Self {
            seed: 0,
            temperature: 1.,
            top_k: None,
            top_p: 1.,
        }
    }
}

/// Why a continuation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model chose an end token.
    Eos,
    /// `max_new_tokens`, or the model's context, ran out.
    Length,
    /// The text came to hold a stop string.
    Stop,
}

/// One prompt's continuation.
#[derive(Debug, Clone, PartialEq)]
pub struct TextOutput {
    /// The prompt's ids, special tokens included.
    pub prompt_ids: Vec<u32>,
    /// The generated ids, the end token not included.
    pub ids: Vec<u32>,
    /// `ids` decoded without special tokens (HF's
    /// `decode(ids, skip_special_tokens=True)`).
    pub text: String,
    /// Why it stopped.
    pub finish: Finish,
    /// Time to read the prompt and choose the first token, in milliseconds.
    pub prefill_ms: f64,
    /// Time for the rest, in milliseconds.
    pub decode_ms: f64,
}

/// A decoder folder ready to continue text. The model is shared read-only
/// by every call, so one `TextGenerator` serves many threads at once.
#[derive(Debug, Clone)]
pub struct TextGenerator {
    model: DecoderModel,
    tokenizer: TextTokenizer,
    generation: HfGenerationConfig,
    chat: Option<ChatTemplate>,
    /// Why the folder's chat template cannot be used, told when a
    /// conversation asks for it (as HF's `apply_chat_template` tells):
    /// the folder still continues plain prompts.
    chat_error: Option<String>,
    /// The last regex constraint lifted to the vocabulary, for the next
    /// call with the same regex: lifting walks every token from every
    /// state, the same work for every prompt.
    last_constraint: Arc<Mutex<Option<Arc<TokenConstraint>>>>,
}

/// Tokens generated when neither the folder nor the caller says how many
/// (HF's `max_length` of 20 counts the prompt too; this counts only new
/// tokens).
pub const DEFAULT_MAX_NEW_TOKENS: usize = 20;

impl TextGenerator {
    /// Loads `dir`: `config.json` and the weights ([`DecoderModel::from_folder`]),
    /// `tokenizer.json` (and `tokenizer_config.json`), the chat template
    /// ([`ChatTemplate::from_folder`]) and `generation_config.json` if it
    /// has them. A tokenizer larger than
    /// the model's embedding is refused (its ids past the embedding would
    /// fail mid-prompt); a smaller one is fine, as in HF.
    pub fn from_folder(dir: &Path, device: &Device) -> Result<Self> {
        Self::from_folder_with_progress(dir, device, None)
    }

    /// [`TextGenerator::from_folder`], telling `progress` how many of the
    /// weights' bytes were read (the small files are read first, so a bad
    /// tokenizer or config is refused before the weights are touched).
    pub fn from_folder_with_progress(
        dir: &Path,
        device: &Device,
        progress: Option<LoadProgress>,
    ) -> Result<Self> {
        let opts = LoadOptions {
            progress,
            ..LoadOptions::default()
        };
        Self::from_folder_with(dir, device, &opts)
    }

    /// [`TextGenerator::from_folder`] with the model's weight matrices in
    /// `opts.dtype`, telling `opts.progress` how far the weights got
    /// ([`DecoderModel::from_folder_with`]).
    pub fn from_folder_with(dir: &Path, device: &Device, opts: &LoadOptions) -> Result<Self> {
        // The folder, also where a weights file inside one is named.
        let folder = ModelFiles::resolve(dir)?.dir().to_path_buf();
        let tokenizer = TextTokenizer::from_folder(&folder)?;
        let generation = HfGenerationConfig::from_folder(&folder)?;
        let chat = ChatTemplate::from_folder(&folder);
        let model = DecoderModel::from_folder_with(dir, device, opts)?;
        Ok(Self::new(model, tokenizer, generation, &folder.display().to_string())?.with_chat_result(chat))
    }

    /// The three parts, checked against each other; `label` names the
    /// folder in errors.
    pub fn new(
        model: DecoderModel,
        tokenizer: TextTokenizer,
        generation: HfGenerationConfig,
        label: &str,
    ) -> Result<Self> {
        let vocab = model.vocab_size();
        if tokenizer.vocab_size() > vocab {
            bail!(
                "{}: the tokenizer has {} tokens but the model's embedding only {vocab}",
                tokenizer.label(),
                tokenizer.vocab_size()
            )
        }
        generation.check_ids(vocab, &format!("{label}/generation_config.json"))?;
        Ok(Self {
            model,
            tokenizer,
            generation,
            chat: None,
            chat_error: None,
            last_constraint: Arc::default(),
        })
    }

    /// The same, rendering conversations with `chat`.
    pub fn with_chat_template(mut self, chat: Option<ChatTemplate>) -> Self {
        self.chat = chat;
        self.chat_error = None;
        self
    }

    /// The same with the template a folder's files gave, or why they gave
    /// none that can be used: told when a conversation asks for it, as
    /// HF's `apply_chat_template` tells it (a template MiniJinja cannot
    /// compile, a list of named templates without `default`).
    pub(crate) fn with_chat_result(mut self, chat: Result<Option<ChatTemplate>>) -> Self {
        match chat {
            Ok(chat) => self.with_chat_template(chat),
            Err(e) => {
                self.chat = None;
                self.chat_error = Some(e.to_string());
                self
            }
        }
    }

    /// The chat template, if the folder has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// The model.
    pub fn model(&self) -> &DecoderModel {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The folder's generation config.
    pub fn generation(&self) -> &HfGenerationConfig {
        &self.generation
    }

    /// Most tokens a prompt may have: the model's positions (GPT-2's
    /// `n_positions`, a rotary model's `max_position_embeddings`).
    pub fn context(&self) -> Option<usize> {
        self.model.max_positions().or(match &self.model {
            DecoderModel::Llama(m) => m.config().max_position_embeddings,
            DecoderModel::Gemma(m) => m.config().max_position_embeddings,
            DecoderModel::Gpt2(_) => None,
        })
    }

    /// `regex` lifted to the model's vocabulary with `eos_id` as the end
    /// token: the one kept from the last call when its regex is the same.
    fn constraint(&self, regex: &str, eos_id: u32) -> Result<Arc<TokenConstraint>> {
        let kept = |c: &Arc<TokenConstraint>| c.pattern() == regex;
        if let Some(c) = self
            .last_constraint
            .lock()
            .ok()
            .and_then(|k| k.clone())
            .filter(kept)
        {
            return Ok(c);
        }
        let tokens = self.tokenizer.token_bytes(self.model.vocab_size());
        let c = Arc::new(TokenConstraint::from_regex_bytes(regex, &tokens, eos_id)?);
        if let Ok(mut k) = self.last_constraint.lock() {
            *k = Some(Arc::clone(&c));
        }
        Ok(c)
    }

    /// The folder's defaults: its `max_new_tokens` (else
    /// [`DEFAULT_MAX_NEW_TOKENS`]), `min_new_tokens`, and sampling with its
    /// temperature, top-k (HF's 50 unless given) and top-p when
    /// `do_sample` is set.
    pub fn settings(&self) -> GenerationSettings {
        let g = &self.generation;
        GenerationSettings {
            max_new_tokens: g.max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS),
            min_new_tokens: g.min_new_tokens.unwrap_or(0),
            // Sampling at temperature 0 is greedy decoding.
            sampling: (g.do_sample && g.temperature != Some(0.)).then(|| Sampling {
                seed: 0,
                temperature: g.temperature.unwrap_or(1.),
                top_k: Some(g.top_k.unwrap_or(50)).filter(|&k| k > 0),
                // HF's top-p keeps at least the best token: at 0, only it.
                top_p: g.top_p.unwrap_or(1.).max(f32::MIN_POSITIVE),
            }),
            repetition_penalty: g.repetition_penalty.filter(|&p| p != 1.),
            stop_strings: g.stop_strings.clone(),
            constraint: None,
        }
    }

    /// Continues `prompt`, calling `on_text` with each piece of text as it
    /// becomes final (the pieces concatenate to the output's `text`).
    pub fn generate(
        &self,
        prompt: &str,
        settings: &GenerationSettings,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TextOutput> {
        let prompt_ids = self.tokenizer.encode(prompt)?;
        if prompt_ids.is_empty() {
            bail!("the prompt {prompt:?} has no tokens: there is nothing to continue")
        }
        self.generate_ids(prompt_ids, None, settings, on_text)
    }

    /// The assistant's reply to `messages`: the conversation rendered with
    /// the folder's chat template and the generation prompt, tokenized
    /// without added special tokens (HF's `apply_chat_template(messages,
    /// add_generation_prompt=True)`), then continued as
    /// [`TextGenerator::generate`] continues a prompt.
    pub fn generate_chat(
        &self,
        messages: &[ChatMessage],
        settings: &GenerationSettings,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TextOutput> {
        self.generate_chat_with(messages, &TemplateArgs::new(), settings, on_text)
    }

    /// [`TextGenerator::generate_chat`] with variables for the template
    /// (`apply_chat_template(messages, enable_thinking=False)`;
    /// [`ChatTemplate::render_with`]).
    pub fn generate_chat_with(
        &self,
        messages: &[ChatMessage],
        args: &TemplateArgs,
        settings: &GenerationSettings,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TextOutput> {
        let prompt_ids = self.chat_prompt_ids(messages, args)?;
        self.generate_ids(prompt_ids, None, settings, on_text)
    }

    /// The ids of `messages` rendered with the chat template and the
    /// generation prompt, tokenized without added special tokens.
    pub fn chat_prompt_ids(&self, messages: &[ChatMessage], args: &TemplateArgs) -> Result<Vec<u32>> {
        if let Some(why) = &self.chat_error {
            bail!("{why}")
        }
        let Some(chat) = &self.chat else {
            bail!(
                "{}: the folder has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)",
                self.tokenizer.label()
            )
        };
        let prompt_ids = self
            .tokenizer
            .encode_plain(&chat.render_with(messages, true, args)?)?;
        if prompt_ids.is_empty() {
            bail!("{}: the conversation renders to no tokens", chat.label())
        }
        Ok(prompt_ids)
    }

    /// How a continuation of `prompt_ids` is searched under `settings`:
    /// the search's config and its processors. With `ignore_eos` no end
    /// token is ever chosen (llama-server's `ignore_eos`, which biases
    /// them to `-inf`).
    pub(crate) fn plan(
        &self,
        prompt_ids: &[u32],
        settings: &GenerationSettings,
        ignore_eos: bool,
    ) -> Result<Plan> {
        if let Some(context) = self.context() {
            if prompt_ids.len() > context {
                bail!(
                    "the prompt is {} tokens long but the model's context holds {context}",
                    prompt_ids.len()
                )
            }
        }
        if settings.stop_strings.iter().any(String::is_empty) {
            bail!("a stop string must not be empty")
        }
        let eos = &self.generation.eos_token_ids;
        let pad = self.generation.pad_token_id.or(eos.first().copied()).unwrap_or(0);
        let mut cfg = GenerateConfig {
            max_len: settings.max_new_tokens,
            start_id: pad,
            eos_id: eos.first().copied().unwrap_or(0),
            pad_id: pad,
            ..GenerateConfig::default()
        }
        .with_extra_eos(eos.iter().skip(1).copied());
        cfg.ignore_eos = eos.is_empty();
        if let Some(s) = &settings.sampling {
            cfg = cfg.with_decoding(Decoding::Sample { seed: s.seed });
        }
        // Forbidding an end token until `usize::MAX` tokens is forbidding it.
        let min_new = if ignore_eos {
            usize::MAX
        } else {
            settings.min_new_tokens
        };
        let min_len: Vec<MinLength> = eos
            .iter()
            .filter(|_| min_new > 0)
            .map(|&eos_id| MinLength {
                min_len: min_new,
                eos_id,
            })
            .collect();
        // HF's `input_ids` of a decoder-only model hold the prompt too.
        let penalty = settings
            .repetition_penalty
            .map(|p| {
                Ok::<_, candle::Error>(RepetitionPenalty::new(p)?.with_prompts(vec![prompt_ids.to_vec()]))
            })
            .transpose()?;
        let (temperature, top_k, top_p) = match &settings.sampling {
            Some(s) => (
                Some(Temperature::new(s.temperature)?),
                s.top_k.map(TopK::new).transpose()?,
                Some(TopP::new(s.top_p)?),
            ),
            None => (None, None, None),
        };
        let constraint = match &settings.constraint {
            Some(regex) => {
                let Some(&eos_id) = eos.first() else {
                    bail!("a constraint needs an end token, and the folder's configs name none")
                };
                let c = self.constraint(regex, eos_id)?;
                c.check_max_len(settings.max_new_tokens)?;
                Some(c)
            }
            None => None,
        };
        Ok(Plan {
            cfg,
            constraint,
            penalty,
            min_len,
            temperature,
            top_k,
            top_p,
        })
    }

    /// Continues `prompt_ids` (not empty); with `kept`, on a cache that
    /// already holds the first `n` of them (`(cache, n)`, `n` below their
    /// count), prefilling only the rest.
    pub(crate) fn generate_ids(
        &self,
        prompt_ids: Vec<u32>,
        kept: Option<(&mut DecoderCache, usize)>,
        settings: &GenerationSettings,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TextOutput> {
        let plan = self.plan(&prompt_ids, settings, false)?;
        let (cfg, processors) = (&plan.cfg, plan.processors());
        let pad = cfg.pad_id;
        let start = Instant::now();
        let mut first_token = None;
        let mut stream = self.tokenizer.stream();
        let mut stops = StopStrings::new(settings.stop_strings.clone());
        let mut stopped = false;
        let mut on_token = |chosen: Chosen| {
            first_token.get_or_insert_with(Instant::now);
            let piece = stream.push(chosen.token)?;
            if let Some(piece) = &piece {
                on_text(piece)?;
            }
            if settings.stop_strings.is_empty() {
                return Ok(true);
            }
            stopped = stops.found(piece.as_deref().unwrap_or_default(), &stream.pending()?);
            Ok(!stopped)
        };
        let generated = match kept {
            Some((cache, n)) => continue_streaming(
                &self.model,
                cache,
                &prompt_ids[n..],
                cfg,
                &processors,
                &mut on_token,
            )?,
            None => {
                let out = generate_from_prompts_streaming(
                    &self.model,
                    std::slice::from_ref(&prompt_ids),
                    pad,
                    cfg,
                    &processors,
                    &mut on_token,
                )?;
                let Some(generated) = out.into_iter().next().and_then(|g| g.into_iter().next()) else {
                    bail!("generate: no output for the prompt")
                };
                generated
            }
        };
        let rest = stream.finish()?;
        if !rest.is_empty() {
            on_text(&rest)?;
        }
        let end = Instant::now();
        let split = first_token.unwrap_or(end);
        Ok(TextOutput {
            text: self.tokenizer.decode(&generated.tokens)?,
            prompt_ids,
            ids: generated.tokens,
            finish: if generated.finished {
                Finish::Eos
            } else if stopped {
                Finish::Stop
            } else {
                Finish::Length
            },
            prefill_ms: (split - start).as_secs_f64() * 1e3,
            decode_ms: (end - split).as_secs_f64() * 1e3,
        })
    }
}

/// How one continuation is searched: the search's config and the
/// processors that reshape each step's scores
/// ([`TextGenerator::plan`]).
pub(crate) struct Plan {
    pub(crate) cfg: GenerateConfig,
    constraint: Option<Arc<TokenConstraint>>,
    penalty: Option<RepetitionPenalty>,
    min_len: Vec<MinLength>,
    temperature: Option<Temperature>,
    top_k: Option<TopK>,
    top_p: Option<TopP>,
}

impl Plan {
    /// The processors in the order they apply: the constraint first, so
    /// that the warpers choose among the tokens it allows; then HF's
    /// order: processors (penalty, minimum length), then warpers.
    pub(crate) fn processors(&self) -> Vec<&dyn LogitsProcessor> {
        let mut processors: Vec<&dyn LogitsProcessor> = Vec::new();
        processors.extend(self.constraint.as_deref().map(|p| p as &dyn LogitsProcessor));
        processors.extend(self.penalty.iter().map(|p| p as &dyn LogitsProcessor));
        processors.extend(self.min_len.iter().map(|p| p as &dyn LogitsProcessor));
        processors.extend(self.temperature.iter().map(|p| p as &dyn LogitsProcessor));
        processors.extend(self.top_k.iter().map(|p| p as &dyn LogitsProcessor));
        processors.extend(self.top_p.iter().map(|p| p as &dyn LogitsProcessor));
        processors
    }
}

/// HF's stop-string rule, at constant work a token: generation stops once
/// the text holds a stop string. Earlier text held none, so a new one ends
/// in what this token added: only a tail as long as the longest stop
/// string, and the text not final yet, is searched.
pub(crate) struct StopStrings {
    stops: Vec<String>,
    /// The end of the text given out, at most the longest stop string.
    tail: String,
    longest: usize,
}

impl StopStrings {
    pub(crate) fn new(stops: Vec<String>) -> Self {
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            tail: String::new(),
            longest,
        }
    }

    /// Whether the text holds a stop string, now that `piece` was given
    /// out and `pending` is decoded but not final.
    pub(crate) fn found(&mut self, piece: &str, pending: &str) -> bool {
        self.tail.push_str(piece);
        let text = format!("{}{pending}", self.tail);
        let hit = self.stops.iter().any(|s| text.contains(s.as_str()));
        let mut cut = self.tail.len().saturating_sub(self.longest);
        while !self.tail.is_char_boundary(cut) {
            cut -= 1;
        }
        self.tail.drain(..cut);
        hit
    }
}
