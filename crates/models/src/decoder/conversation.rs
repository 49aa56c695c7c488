//! A conversation held with a model, turn after turn, as `llama-cli` holds
//! one: each reply renders the whole history with the chat template (HF's
//! `apply_chat_template` over the messages so far, so the reply is HF's
//! greedy reply to that conversation) and prefills only the tokens its
//! cache does not hold yet: the history's keys and values stay between
//! turns.

use candle::Result;

use super::{ChatMessage, DecoderCache, GenerationSettings, TemplateArgs, TextGenerator, TextOutput};
use crate::decoder::CausalLm;

/// A conversation and the cache of what the model has read of it
/// ([`TextGenerator::conversation`]).
#[derive(Debug)]
pub struct Conversation<'g> {
    generator: &'g TextGenerator,
    messages: Vec<ChatMessage>,
    args: TemplateArgs,
    cache: DecoderCache,
    /// The ids `cache` holds, in order.
    held: Vec<u32>,
}

impl TextGenerator {
    /// An empty conversation with this model.
    pub fn conversation(&self) -> Conversation<'_> {
        Conversation {
            generator: self,
            messages: Vec::new(),
            args: TemplateArgs::new(),
            cache: self.model().new_cache(Vec::new()),
            held: Vec::new(),
        }
    }
}

impl Conversation<'_> {
    /// The same, rendering its template with `args`
    /// ([`super::ChatTemplate::render_with`]).
    pub fn with_template_args(mut self, args: TemplateArgs) -> Self {
        self.args = args;
        self
    }

    /// The messages so far, replies included.
    pub fn messages(&self) -> &[ChatMessage] {
        &self.messages
    }

    /// Adds a message (the user's, a system prompt) without replying.
    pub fn push(&mut self, message: ChatMessage) {
        self.messages.push(message);
    }

    /// Takes the last message back (a turn whose reply failed); the cache
    /// keeps what it holds, which the next reply reads as far as it
    /// agrees.
    pub fn pop(&mut self) -> Option<ChatMessage> {
        self.messages.pop()
    }

    /// Forgets every message and the cache.
    pub fn reset(&mut self) {
        self.messages.clear();
        self.cache.truncate(0);
        self.held.clear();
    }

    /// Tokens the cache holds.
    pub fn cached_tokens(&self) -> usize {
        self.held.len()
    }

    /// The assistant's reply to the conversation so far, streamed through
    /// `on_text` as [`TextGenerator::generate_chat`] streams it, and added
    /// to the conversation. The rendered history's tokens that the cache
    /// holds (its longest common start with them) are not read again;
    /// where the template renders earlier turns otherwise than they were
    /// read, the cache is cut back to where the two agree. A conversation
    /// past the model's context is refused with both numbers; its
    /// messages are left as they were.
    pub fn reply(
        &mut self,
        settings: &GenerationSettings,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TextOutput> {
        let prompt_ids = self.generator.chat_prompt_ids(&self.messages, &self.args)?;
        let common = self
            .held
            .iter()
            .zip(&prompt_ids)
            .take_while(|(a, b)| a == b)
            .count();
        // At least the last token is read again: its logits start the reply.
        let keep = common.min(prompt_ids.len() - 1);
        self.cache.truncate(keep);
        self.held.truncate(keep);
        let out = self.generator.generate_ids(
            prompt_ids.clone(),
            Some((&mut self.cache, keep)),
            settings,
            on_text,
        );
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                // What the failed turn read is not known: read it again.
                self.cache.truncate(keep);
                return Err(e);
            }
        };
        // The cache holds the prompt and every reply token fed back (all
        // but the last chosen, and never the end token).
        self.held = prompt_ids;
        self.held.extend_from_slice(&out.ids);
        self.held.truncate(self.cache.len());
        self.messages
            .push(ChatMessage::new("assistant", out.text.clone()));
        Ok(out)
    }
}
