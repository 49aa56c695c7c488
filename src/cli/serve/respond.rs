//! A request's answer in OpenAI's shapes: one JSON object, or a stream of
//! server-sent events (chunks, then `data: [DONE]`). OpenAI's stop
//! sequences end the text without being part of it: text that may be the
//! start of one is held back until it is known not to be.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use multihead::models::decoder::{BatchEvent, Finish};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::ApiError;
use super::engine::Heard;
use super::Admission;

/// Which API a request came through.
#[derive(Debug, Clone, Copy)]
pub(super) enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Text,
}

impl Endpoint {
    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Self::Chat => "chatcmpl",
            Self::Text => "cmpl",
        }
    }
}

/// What a request's answer is made of, besides its text.
pub(super) struct Reply {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompt_tokens: usize,
    pub include_usage: bool,
    pub stops: Vec<String>,
}

impl Reply {
    /// The whole answer, once the sequence ended.
    pub(super) async fn whole(self, mut events: UnboundedReceiver<Heard>) -> Result<Response, ApiError> {
        let mut cut = StopCut::new(self.stops.clone());
        let mut text = String::new();
        while let Some(heard) = events.recv().await {
            match heard {
                Heard::Refused(why) => return Err(ApiError::invalid(None, why)),
                Heard::Event(BatchEvent::Failed(why)) => return Err(ApiError::server(why)),
                Heard::Event(BatchEvent::Text(piece)) => text.push_str(&cut.push(&piece)),
                Heard::Event(BatchEvent::Done(out)) => {
                    text.push_str(&cut.finish());
                    let reason = reason(out.finish, cut.stopped);
                    let choice = match self.endpoint {
                        Endpoint::Chat => json!({
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": null,
                            "finish_reason": reason,
                        }),
                        Endpoint::Text => json!({
                            "index": 0,
                            "text": text,
                            "logprobs": null,
                            "finish_reason": reason,
                        }),
                    };
                    let mut body = self.head(self.object());
                    body["choices"] = json!([choice]);
                    body["usage"] = self.usage(out.ids.len());
                    return Ok(Json(body).into_response());
                }
            }
        }
        Err(dropped())
    }

    /// The answer as server-sent events. The response starts once the
    /// first event is in, so that a request refused or failed before its
    /// first token gets its status, not a stream.
    pub(super) async fn stream(
        self,
        mut events: UnboundedReceiver<Heard>,
        admission: Admission,
    ) -> Result<Response, ApiError> {
        let first = match events.recv().await {
            None => return Err(dropped()),
            Some(Heard::Refused(why)) => return Err(ApiError::invalid(None, why)),
            Some(Heard::Event(BatchEvent::Failed(why))) => return Err(ApiError::server(why)),
            Some(Heard::Event(e)) => e,
        };
        let state = Streaming {
            cut: StopCut::new(self.stops.clone()),
            reply: self,
            events,
            first: Some(first),
            ended: false,
            _admission: admission,
        };
        let mut opening = Vec::new();
        if let Endpoint::Chat = state.reply.endpoint {
            opening.push(
                state
                    .reply
                    .chunk(json!({"role": "assistant", "content": ""}), None),
            );
        }
        let rest = stream::unfold(state, |mut s| async move {
            if s.ended {
                return None;
            }
            let heard = match s.first.take() {
                Some(e) => Some(Heard::Event(e)),
                None => s.events.recv().await,
            };
            let out = s.on(heard);
            Some((out, s))
        })
        .flat_map(stream::iter);
        let all = stream::iter(opening).chain(rest).map(Ok::<_, Infallible>);
        Ok(Sse::new(all).keep_alive(KeepAlive::default()).into_response())
    }

    fn object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Text => "text_completion",
        }
    }

    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Text => "text_completion",
        }
    }

    fn head(&self, object: &str) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("multihead-", env!("CARGO_PKG_VERSION")),
        })
    }

    fn usage(&self, completion: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }

    /// A chunk: a chat delta (`{"content": ...}`) or a completion's text.
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Event {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
            Endpoint::Text => json!({
                "index": 0,
                "text": delta.get("content").and_then(Value::as_str).unwrap_or_default(),
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        let mut body = self.head(self.chunk_object());
        body["choices"] = json!([choice]);
        Event::default().data(body.to_string())
    }
}

/// A stream's state between events.
struct Streaming {
    reply: Reply,
    cut: StopCut,
    events: UnboundedReceiver<Heard>,
    first: Option<BatchEvent>,
    ended: bool,
    /// The request's place, given back when the stream ends or its client
    /// leaves (the stream is dropped then).
    _admission: Admission,
}

impl Streaming {
    /// The events to send for what the sequence said.
    fn on(&mut self, heard: Option<Heard>) -> Vec<Event> {
        let error = |message: String| {
            let body = ApiError::server(message).body();
            vec![
                Event::default().data(body.to_string()),
                Event::default().data("[DONE]"),
            ]
        };
        match heard {
            None => {
                self.ended = true;
                error(dropped_message().into())
            }
            Some(Heard::Refused(why)) | Some(Heard::Event(BatchEvent::Failed(why))) => {
                self.ended = true;
                error(why)
            }
            Some(Heard::Event(BatchEvent::Text(piece))) => {
                let piece = self.cut.push(&piece);
                if piece.is_empty() {
                    return Vec::new();
                }
                vec![self.reply.chunk(json!({"content": piece}), None)]
            }
            Some(Heard::Event(BatchEvent::Done(out))) => {
                self.ended = true;
                let mut events = Vec::new();
                let rest = self.cut.finish();
                if !rest.is_empty() {
                    events.push(self.reply.chunk(json!({"content": rest}), None));
                }
                let reason = reason(out.finish, self.cut.stopped);
                events.push(self.reply.chunk(json!({}), Some(reason)));
                if self.reply.include_usage {
                    let mut body = self.reply.head(self.reply.chunk_object());
                    body["choices"] = json!([]);
                    body["usage"] = self.reply.usage(out.ids.len());
                    events.push(Event::default().data(body.to_string()));
                }
                events.push(Event::default().data("[DONE]"));
                events
            }
        }
    }
}

/// OpenAI's `finish_reason`.
fn reason(finish: Finish, stopped: bool) -> &'static str {
    match finish {
        _ if stopped => "stop",
        Finish::Eos | Finish::Stop => "stop",
        Finish::Length => "length",
    }
}

fn dropped_message() -> &'static str {
    "the request was dropped by the engine (see the server's log)"
}

fn dropped() -> ApiError {
    ApiError::server(dropped_message())
}

/// OpenAI's stop sequences over streamed text: gives out the text up to
/// the first stop sequence, holding back a tail that may still become one.
pub(super) struct StopCut {
    stops: Vec<String>,
    text: String,
    given: usize,
    /// Whether a stop sequence was found (the text ends before it).
    pub stopped: bool,
}

impl StopCut {
    pub(super) fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            text: String::new(),
            given: 0,
            stopped: false,
        }
    }

    /// Adds `piece`; returns the text that can be given out now.
    pub(super) fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.text.push_str(piece);
        if let Some(at) = self.first_stop() {
            self.stopped = true;
            return self.give(at);
        }
        // The longest tail of the text that starts a stop sequence.
        let held = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .map(move |k| &s[..k])
            })
            .filter(|prefix| self.text.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        self.give(self.text.len() - held)
    }

    /// The rest once the sequence ended.
    pub(super) fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let end = match self.first_stop() {
            Some(at) => {
                self.stopped = true;
                at
            }
            None => self.text.len(),
        };
        self.give(end)
    }

    /// Where the first stop sequence starts, if the text holds one.
    fn first_stop(&self) -> Option<usize> {
        self.stops.iter().filter_map(|s| self.text.find(s.as_str())).min()
    }

    fn give(&mut self, end: usize) -> String {
        let end = end.max(self.given);
        let out = self.text[self.given..end].to_string();
        self.given = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::StopCut;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut cut = StopCut::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out: Vec<String> = pieces.iter().map(|p| cut.push(p)).collect();
        out.push(cut.finish());
        (out, cut.stopped)
    }

    #[test]
    fn text_up_to_the_stop_and_nothing_held_for_ever() {
        let (out, stopped) = run(&["END"], &["a b E", "N", "D tail"]);
        assert_eq!(out, ["a b ", "", "", ""]);
        assert!(stopped);
        // A prefix that does not become a stop is given out later.
        let (out, stopped) = run(&["END"], &["a E", "x", "y EN"]);
        assert_eq!(out, ["a ", "Ex", "y ", "EN"]);
        assert!(!stopped);
        let (out, _) = run(&[], &["héllo", " 日本"]);
        assert_eq!(out.concat(), "héllo 日本");
        // The earliest of several stops wins.
        let (out, _) = run(&["zz", "b"], &["abzz"]);
        assert_eq!(out.concat(), "a");
    }
}
