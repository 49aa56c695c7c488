//! OpenAI's API as `multihead serve` reads and answers it: the requests of
//! `/v1/chat/completions` and `/v1/completions` read field by field from
//! untrusted JSON (unknown fields ignored, as OpenAI and llama-server
//! ignore them; a field this server cannot honour refused rather than
//! dropped), and OpenAI's error object.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use multihead::models::decoder::{ChatMessage, GenerationSettings, Sampling, TemplateArgs};
use serde_json::{json, Map, Value};

/// Most messages a conversation may hold.
pub(super) const MAX_MESSAGES: usize = 4096;

/// Most stop sequences a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// Longest stop sequence, in bytes.
const MAX_STOP_BYTES: usize = 256;

/// OpenAI's error object, with its HTTP status.
#[derive(Debug)]
pub(super) struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
    retry_after: Option<u64>,
}

/// `text` without the backtrace candle appends to an error's message when
/// `RUST_BACKTRACE` is set: a client gets the message, not the server's
/// stack.
fn without_backtrace(text: String) -> String {
    match text.lines().position(|l| l.trim_start().starts_with("0: ")) {
        Some(at) => text
            .lines()
            .take(at)
            .collect::<Vec<_>>()
            .join("\n")
            .trim_end()
            .to_string(),
        None => text,
    }
}

impl ApiError {
    /// A request the server cannot run as given (400), naming the field.
    pub(super) fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: without_backtrace(message.into()),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    /// A request the server failed to answer (500).
    pub(super) fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: without_backtrace(message.into()),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// Every place and the queue taken (429), to be tried again after
    /// `seconds`.
    pub(super) fn busy(message: impl Into<String>, seconds: u64) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded"),
            retry_after: Some(seconds),
        }
    }

    /// An error with its own status (a body too large, a path not found).
    pub(super) fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// The error object: `{"error": {"message", "type", "param", "code"}}`.
    pub(super) fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

/// What is to be continued.
#[derive(Debug)]
pub(super) enum Prompt {
    /// A conversation, rendered with the model's chat template.
    Chat {
        messages: Vec<ChatMessage>,
        args: TemplateArgs,
    },
    /// A text, tokenized as `generate` tokenizes a prompt.
    Text(String),
    /// Token ids, as given.
    Ids(Vec<u32>),
}

/// A request, read (its prompt apart): how it is answered and the generation
/// fields it sets.
#[derive(Debug)]
pub(super) struct Request {
    /// Echoed, not matched: one model a server.
    pub model: String,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
    /// `max_tokens` (or `max_completion_tokens`), and which field gave it.
    pub max_tokens: Option<(usize, &'static str)>,
    pub min_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub repetition_penalty: Option<f32>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
}

impl Request {
    /// `/v1/chat/completions`' body.
    pub(super) fn chat(body: &[u8]) -> Result<(Prompt, Self), ApiError> {
        let obj = object(body)?;
        let Some(list) = obj.get("messages").and_then(Value::as_array) else {
            return Err(ApiError::invalid(
                Some("messages"),
                "'messages' must be a list of {\"role\": ..., \"content\": ...} objects",
            ));
        };
        if list.is_empty() || list.len() > MAX_MESSAGES {
            return Err(ApiError::invalid(
                Some("messages"),
                format!(
                    "'messages' must hold 1..={MAX_MESSAGES} messages, found {}",
                    list.len()
                ),
            ));
        }
        let messages = list
            .iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut args = TemplateArgs::new();
        match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => {}
            Some(Value::Object(kwargs)) => {
                args.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    Some("chat_template_kwargs"),
                    "'chat_template_kwargs' must be an object",
                ))
            }
        }
        refuse_unsupported(&obj, &["tools", "functions", "tool_choice", "function_call"])?;
        if obj.get("logprobs").and_then(Value::as_bool) == Some(true) {
            return Err(ApiError::invalid(Some("logprobs"), "logprobs are not supported"));
        }
        Ok((Prompt::Chat { messages, args }, Self::common(&obj)?))
    }

    /// `/v1/completions`' body.
    pub(super) fn completion(body: &[u8]) -> Result<(Prompt, Self), ApiError> {
        let obj = object(body)?;
        let one = "'prompt' must be a string, a list of one string, or a list of token ids";
        let prompt = match obj.get("prompt") {
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            Some(Value::Array(items)) => match items.as_slice() {
                [Value::String(s)] => Prompt::Text(s.clone()),
                ids if !ids.is_empty() && ids.iter().all(Value::is_u64) => Prompt::Ids(
                    ids.iter()
                        .map(|v| {
                            v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                                ApiError::invalid(Some("prompt"), "a token id is out of range")
                            })
                        })
                        .collect::<Result<_, _>>()?,
                ),
                _ => return Err(ApiError::invalid(Some("prompt"), format!("{one} (n = 1)"))),
            },
            _ => return Err(ApiError::invalid(Some("prompt"), one)),
        };
        if obj.get("echo").and_then(Value::as_bool) == Some(true) {
            return Err(ApiError::invalid(Some("echo"), "echo is not supported"));
        }
        if let Some(n) = obj.get("logprobs").filter(|v| !v.is_null()) {
            return Err(ApiError::invalid(
                Some("logprobs"),
                format!("logprobs are not supported (given {n})"),
            ));
        }
        refuse_unsupported(&obj, &["suffix"])?;
        match obj.get("best_of") {
            None | Some(Value::Null) => {}
            Some(v) if v.as_u64() == Some(1) => {}
            Some(v) => {
                return Err(ApiError::invalid(
                    Some("best_of"),
                    format!("best_of must be 1, found {v}"),
                ))
            }
        }
        Ok((prompt, Self::common(&obj)?))
    }

    /// The fields both endpoints share.
    fn common(obj: &Map<String, Value>) -> Result<Self, ApiError> {
        let model = match obj.get("model") {
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        };
        match obj.get("n") {
            None | Some(Value::Null) => {}
            Some(v) if v.as_u64() == Some(1) => {}
            Some(v) => return Err(ApiError::invalid(Some("n"), format!("n must be 1, found {v}"))),
        }
        for field in ["presence_penalty", "frequency_penalty"] {
            if let Some(v) = number(obj, field)? {
                if v != 0. {
                    return Err(ApiError::invalid(
                        Some(field),
                        format!("{field} is not supported (only 0); repetition_penalty is"),
                    ));
                }
            }
        }
        if obj
            .get("logit_bias")
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(ApiError::invalid(
                Some("logit_bias"),
                "logit_bias is not supported",
            ));
        }
        match obj.get("response_format").map(|f| f.get("type")) {
            None | Some(None) => {}
            Some(Some(Value::String(t))) if t == "text" => {}
            Some(Some(t)) => {
                return Err(ApiError::invalid(
                    Some("response_format"),
                    format!("response_format {t} is not supported (only \"text\")"),
                ))
            }
        }
        let stream = boolean(obj, "stream")?.unwrap_or(false);
        let include_usage = match obj.get("stream_options") {
            None | Some(Value::Null) => false,
            Some(Value::Object(o)) => boolean(o, "include_usage")?.unwrap_or(false),
            Some(_) => {
                return Err(ApiError::invalid(
                    Some("stream_options"),
                    "'stream_options' must be an object",
                ))
            }
        };
        let max_tokens = match count(obj, "max_completion_tokens")? {
            Some(n) => Some((n, "max_completion_tokens")),
            None => count(obj, "max_tokens")?.map(|n| (n, "max_tokens")),
        };
        if let Some((0, field)) = max_tokens {
            return Err(ApiError::invalid(
                Some(field),
                format!("{field} must be at least 1"),
            ));
        }
        let temperature = number(obj, "temperature")?;
        if let Some(t) = temperature.filter(|t| !(0. ..=2.).contains(t)) {
            return Err(ApiError::invalid(
                Some("temperature"),
                format!("temperature must be in [0, 2], found {t}"),
            ));
        }
        let top_p = number(obj, "top_p")?;
        if let Some(p) = top_p.filter(|p| !(*p > 0. && *p <= 1.)) {
            return Err(ApiError::invalid(
                Some("top_p"),
                format!("top_p must be in (0, 1], found {p}"),
            ));
        }
        let repetition_penalty = number(obj, "repetition_penalty")?;
        if let Some(p) = repetition_penalty.filter(|p| !(*p > 0. && p.is_finite())) {
            return Err(ApiError::invalid(
                Some("repetition_penalty"),
                format!("repetition_penalty must be > 0, found {p}"),
            ));
        }
        let seed = match obj.get("seed") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .or_else(|| v.as_i64().map(|s| s as u64))
                    .ok_or_else(|| {
                        ApiError::invalid(Some("seed"), format!("seed must be an integer, found {v}"))
                    })?,
            ),
        };
        let stop = match obj.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|s| match s {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(ApiError::invalid(
                        Some("stop"),
                        format!("'stop' must hold strings, found {other}"),
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(ApiError::invalid(
                    Some("stop"),
                    format!("'stop' must be a string or a list of strings, found {other}"),
                ))
            }
        };
        if stop.len() > MAX_STOPS || stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid(
                Some("stop"),
                format!("'stop' holds at most {MAX_STOPS} sequences of 1..={MAX_STOP_BYTES} bytes"),
            ));
        }
        Ok(Self {
            model,
            stream,
            include_usage,
            max_tokens,
            min_tokens: count(obj, "min_tokens")?,
            temperature,
            top_p,
            top_k: count(obj, "top_k")?,
            seed,
            repetition_penalty,
            stop,
            ignore_eos: boolean(obj, "ignore_eos")?.unwrap_or(false),
        })
    }

    /// The server's settings under this request's fields; `max_new` is
    /// the number of tokens it may generate, `fresh_seed` the seed of a
    /// sampling request that names none (each its own draws, as OpenAI's
    /// API samples).
    pub(super) fn settings(
        &self,
        defaults: &GenerationSettings,
        max_new: usize,
        fresh_seed: u64,
    ) -> GenerationSettings {
        let mut s = defaults.clone();
        s.max_new_tokens = max_new;
        if let Some(n) = self.min_tokens {
            s.min_new_tokens = n;
        }
        if let Some(p) = self.repetition_penalty {
            s.repetition_penalty = Some(p).filter(|&p| p != 1.);
        }
        // OpenAI's stop sequences end the text without being part of it
        // (the server cuts them off); the folder's own stop strings stay.
        s.stop_strings.extend(self.stop.iter().cloned());
        if self.temperature == Some(0.) {
            s.sampling = None;
        } else if self.temperature.is_some() || self.top_p.is_some() || self.top_k.is_some() {
            let base = s.sampling.clone().unwrap_or_default();
            s.sampling = Some(Sampling {
                seed: 0,
                temperature: self.temperature.unwrap_or(base.temperature),
                // llama-server's top_k = 0: no top-k.
                top_k: self.top_k.map_or(base.top_k, |k| Some(k).filter(|&k| k > 0)),
                top_p: self.top_p.unwrap_or(base.top_p),
            });
        }
        if let Some(sampling) = &mut s.sampling {
            sampling.seed = self.seed.unwrap_or(fresh_seed);
        }
        s
    }
}

/// The body as a JSON object.
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(ApiError::invalid(None, "the body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(
            None,
            format!("the body is not valid JSON: {e}"),
        )),
    }
}

/// Message `i`: a role and a content (a string, or a list of text parts).
fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let param = format!("messages[{i}]");
    let bad = |what: &str| ApiError::invalid(Some(&param), format!("{param}: {what}"));
    let Some(role) = m.get("role").and_then(Value::as_str) else {
        return Err(bad("'role' must be a string"));
    };
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        // An assistant turn that only called tools has no content.
        None | Some(Value::Null) => String::new(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad(&format!(
                            "only text content parts are supported, found {}",
                            kind.unwrap_or("a part without a type")
                        )))
                    }
                }
            }
            text
        }
        Some(other) => return Err(bad(&format!("'content' must be a string, found {other}"))),
    };
    Ok(ChatMessage::new(role, content))
}

/// A field this server does not implement, refused when set to anything
/// but null or an empty list.
fn refuse_unsupported(obj: &Map<String, Value>, fields: &[&str]) -> Result<(), ApiError> {
    for &field in fields {
        match obj.get(field) {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    Some(field),
                    format!("'{field}' is not supported by this server"),
                ))
            }
        }
    }
    Ok(())
}

fn number(obj: &Map<String, Value>, field: &str) -> Result<Option<f32>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x as f32)),
            _ => Err(ApiError::invalid(
                Some(field),
                format!("'{field}' must be a number, found {v}"),
            )),
        },
    }
}

fn count(obj: &Map<String, Value>, field: &str) -> Result<Option<usize>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) => Ok(Some(n)),
            None => Err(ApiError::invalid(
                Some(field),
                format!("'{field}' must be a non-negative integer, found {v}"),
            )),
        },
    }
}

fn boolean(obj: &Map<String, Value>, field: &str) -> Result<Option<bool>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::invalid(
            Some(field),
            format!("'{field}' must be true or false, found {v}"),
        )),
    }
}
