//! Chat templates: a folder's `chat_template.jinja` (transformers 5) or
//! `tokenizer_config.json`'s `chat_template`, rendered with MiniJinja the
//! way HF's `apply_chat_template` renders it with Jinja2: blocks trimmed
//! (`trim_blocks`, `lstrip_blocks`), `break` / `continue`,
//! `raise_exception`, `strftime_now`, `{% generation %}`, a `tojson` that
//! writes what Python's `json.dumps` writes, the Python string methods
//! templates call ([`super::jinja_py`]), and the tokenizer's special tokens
//! (`bos_token`, ...) as variables. A template is untrusted code: MiniJinja
//! cannot reach the file system, fuel bounds the work of one rendering,
//! and the depth of what it prints is bounded.

use std::collections::BTreeMap;
use std::path::Path;

use candle::{bail, Result};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::Value as Json;

use super::jinja_py;
use crate::formats::files::{read_text, MAX_CONFIG_BYTES};
use crate::vit::folder::json::{parse_object, short};

/// Instructions one rendering may run: Llama 3's template takes about 31
/// a message, so a thousand messages take 31,000; a template that loops
/// over huge ranges is stopped. It also bounds how deep a template can nest
/// a value (about 8 instructions a level), hence [`RENDER_STACK`].
const FUEL: u64 = 2_000_000;

/// The stack a rendering runs on (reserved, and touched only as deep as a
/// template goes): MiniJinja prints, compares and drops nested values
/// recursively, about 500 bytes a level, and [`FUEL`] allows some 235,000
/// levels. A server's worker threads have 2 MiB.
const RENDER_STACK: usize = 256 << 20;

/// Most bytes a rendered conversation may have.
const MAX_RENDERED_BYTES: usize = 16 << 20;

/// Variables a template is rendered with beside the conversation, by
/// name ([`ChatTemplate::render_with`]).
pub type TemplateArgs = BTreeMap<String, serde_json::Value>;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Name of the one template in a [`ChatTemplate`]'s environment (the
/// name MiniJinja gives a template from a string, as its messages show).
const TEMPLATE: &str = "<string>";

/// A folder's chat template with the special tokens it may use.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// HF's Jinja environment in MiniJinja, holding the template compiled.
    env: Environment<'static>,
    label: String,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token`, ... as text.
    special: BTreeMap<String, String>,
}

impl ChatTemplate {
    /// The template of `dir`: `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or HF's list of
    /// named templates, of which `default` is taken); `None` when the
    /// folder has none.
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            let label = config_path.display().to_string();
            let text = read_text(&config_path, "tokenizer config", MAX_CONFIG_BYTES)?;
            Some((parse_object(&text, &label)?, label))
        } else {
            None
        };
        let mut special = config
            .as_ref()
            .map(|(map, label)| special_tokens(map, label))
            .transpose()?
            .unwrap_or_default();
        // HF reads `special_tokens_map.json` after `tokenizer_config.json`,
        // its tokens taking precedence; some folders name `bos_token` only
        // there.
        let map_path = dir.join("special_tokens_map.json");
        if map_path.exists() {
            let label = map_path.display().to_string();
            let text = read_text(&map_path, "special tokens map", MAX_CONFIG_BYTES)?;
            special.extend(special_tokens(&parse_object(&text, &label)?, &label)?);
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let source = read_text(&jinja, "chat template", MAX_CONFIG_BYTES)?;
            return Self::new(source, &jinja.display().to_string(), special).map(Some);
        }
        let Some((map, label)) = config else {
            return Ok(None);
        };
        let source = match map.get("chat_template") {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(named)) => {
                let default = named
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"));
                match default.and_then(|t| t.get("template")).and_then(Json::as_str) {
                    Some(s) => s.to_string(),
                    None => bail!("{label}: field 'chat_template' lists templates but none named 'default'"),
                }
            }
            Some(other) => bail!(
                "{label}: field 'chat_template' must be a string or a list of named templates, found {}",
                short(other)
            ),
        };
        Self::new(source, &format!("{label} (chat_template)"), special).map(Some)
    }

    /// A template from its source; `label` names it in errors. It is
    /// compiled once here so that a syntax error comes at load time.
    pub fn new(source: String, label: &str, special: BTreeMap<String, String>) -> Result<Self> {
        let mut env = environment();
        env.add_template_owned(TEMPLATE, jinja_py::generation_tags_as_blocks(&source))
            .map_err(|e| template_error(label, "does not compile", &e))?;
        Ok(Self {
            env,
            label: label.to_string(),
            special,
        })
    }

    /// Where the template came from.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The conversation as the model reads it; with
    /// `add_generation_prompt`, followed by the start of the assistant's
    /// turn. Tokenize the result without adding special tokens (the
    /// template writes them), as `apply_chat_template` does.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &TemplateArgs::new())
    }

    /// [`ChatTemplate::render`] with more variables for the template, as
    /// `apply_chat_template(messages, **kwargs)` passes its keyword
    /// arguments (Qwen3's `enable_thinking=False`); they take precedence
    /// over the special tokens. `messages` and `add_generation_prompt`
    /// are refused as names: they are this call's own.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        args: &TemplateArgs,
    ) -> Result<String> {
        if let Some(name) = ["messages", "add_generation_prompt"]
            .into_iter()
            .find(|n| args.contains_key(*n))
        {
            bail!(
                "{}: '{name}' cannot be a template argument: the conversation sets it",
                self.label
            )
        }
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(RENDER_STACK)
                .spawn_scoped(scope, || self.render_here(messages, add_generation_prompt, args))
                .map_err(|e| {
                    candle::Error::Msg(format!("{}: cannot start a rendering thread: {e}", self.label))
                })?;
            thread
                .join()
                .unwrap_or_else(|_| bail!("{}: the chat template failed: MiniJinja panicked", self.label))
        })
    }

    /// [`ChatTemplate::render`] on this thread.
    fn render_here(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        args: &TemplateArgs,
    ) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE)
            .map_err(|e| template_error(&self.label, "does not compile", &e))?;
        let mut ctx: BTreeMap<String, Value> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages".into(), Value::from(minijinja::value::Serde(messages)));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        for (name, value) in args {
            ctx.insert(name.clone(), Value::from(minijinja::value::Serde(value)));
        }
        let text = template
            .render(context! { ..Value::from(ctx) })
            .map_err(|e| template_error(&self.label, "failed", &e))?;
        if text.len() > MAX_RENDERED_BYTES {
            bail!(
                "{}: the rendered conversation is {} bytes, over the limit of {MAX_RENDERED_BYTES}",
                self.label,
                text.len()
            )
        }
        Ok(text)
    }
}

/// A MiniJinja error of the template `label` as this crate's.
fn template_error(label: &str, what: &str, e: &Error) -> candle::Error {
    // A template's own `raise_exception` message is the user's answer.
    let detail = match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        _ => e.to_string(),
    };
    candle::Error::Msg(format!("{label}: the chat template {what}: {detail}"))
}

/// HF's Jinja environment, in MiniJinja.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build();
    if let Ok(syntax) = syntax {
        env.set_syntax(syntax);
    }
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> std::result::Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_function("strftime_now", |format: String| jinja_py::strftime_utc(&format));
    env.add_filter("tojson", jinja_py::tojson);
    env.add_filter("int", jinja_py::int_filter);
    env.add_filter("float", jinja_py::float_filter);
    env.add_filter("pprint", jinja_py::pprint);
    env.add_test("iterable", |v: &Value| jinja_py::is_iterable(v));
    env.set_formatter(jinja_py::formatter);
    env
}

/// The special tokens `tokenizer_config.json` names (`bos_token`,
/// `eos_token`, ...), each a string or an `AddedToken` object.
fn special_tokens(map: &serde_json::Map<String, Json>, label: &str) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for key in [
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    ] {
        let text = match map.get(key) {
            None | Some(Json::Null) => continue,
            Some(Json::String(s)) => s.clone(),
            Some(Json::Object(o)) => match o.get("content").and_then(Json::as_str) {
                Some(s) => s.to_string(),
                None => bail!("{label}: field '{key}.content' must be a string"),
            },
            Some(other) => bail!(
                "{label}: field '{key}' must be a string or a token object, found {}",
                short(other)
            ),
        };
        out.insert(key.to_string(), text);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_that_loops_for_ever_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}".into(),
            "hostile",
            BTreeMap::new(),
        )
        .unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(
            err.contains("hostile: the chat template failed") && err.contains("fuel"),
            "{err}"
        );
    }
}
