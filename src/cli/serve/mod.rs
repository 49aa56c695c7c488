//! `multihead serve`: OpenAI's HTTP API over one model, as llama-server
//! serves it. `POST /v1/chat/completions` and `/v1/completions` (streamed
//! as server-sent events or not), `GET /v1/models` and `GET /health`.
//!
//! The requests share the model through continuous batching
//! ([`multihead::models::decoder::Batcher`], on the engine thread): at
//! most `--parallel` sequences decode together, one batched forward a
//! step, a new one prefilled in chunks between steps; past them a bounded
//! queue, and past the queue `429` with `Retry-After`. A client that
//! disconnects frees its place before the next step. A bad request, a
//! template or tokenizer error answers that request alone. SIGTERM (or
//! Ctrl-C) stops accepting, lets what is in flight finish, and exits 0.

mod api;
mod engine;
mod respond;

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use multihead::models::decoder::{BatchRequest, CausalLm, GenerationSettings, TemplateArgs, TextGenerator};
use serde_json::json;

use super::generate::{prepare, Format, Prepared};
use api::{ApiError, Prompt, Request};
use engine::Job;
use respond::{Endpoint, Reply};

/// Most bytes a request's body may have.
const MAX_BODY_BYTES: usize = 8 << 20;

/// Most tokens a request may generate where the model's context does not
/// bound it.
const MAX_NEW_TOKENS: usize = 1 << 16;

/// Prompts and templates read at once, off the async threads: tokenizing
/// takes a few hundred bytes of memory a byte of text, so this bounds the
/// peak, and a few threads reusing their memory keep the resident size
/// from creeping up under a flood of long prompts.
const READERS: usize = 2;

/// Bytes of text tokenized at a time when a long text is first counted.
const COUNT_SEGMENT_BYTES: usize = 16 << 10;

/// Arguments of `multihead serve`: `generate`'s model and sampling options
/// (the defaults of every request), and the server's own.
#[derive(Debug, clap::Args)]
// Its own group id: by default clap names a struct's group after the
// struct, and the flattened `generate::Args` is `Args` too.
#[group(id = "serve_args")]
pub struct Args {
    #[command(flatten)]
    pub generate: super::generate::Args,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The port to listen on (0: one the system picks, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most sequences decoded at once, in one batch.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub parallel: usize,
    /// Most requests waiting for a place; past them, 429.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub queue: usize,
    /// Prompt tokens a new request's prefill reads between two decoding
    /// steps of the others.
    #[arg(long, value_name = "N", default_value_t = multihead::models::decoder::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// The model's name in `/v1/models` (default: `--model` as given).
    #[arg(long, value_name = "NAME")]
    pub alias: Option<String>,
}

/// What every handler shares.
struct Shared {
    generator: Arc<TextGenerator>,
    defaults: GenerationSettings,
    /// Whether `--max-new-tokens` set the default length (else a request
    /// without `max_tokens` may fill the context, as in OpenAI's API).
    default_max: Option<usize>,
    template_args: TemplateArgs,
    jobs: mpsc::Sender<Job>,
    /// Requests admitted and not answered yet.
    in_flight: AtomicUsize,
    /// Most requests in flight: `--parallel` + `--queue`.
    limit: usize,
    model_id: String,
    requests: AtomicU64,
    seeds: RandomState,
    readers: tokio::sync::Semaphore,
}

/// A place among the requests in flight, given back when dropped.
struct Admission(Arc<Shared>);

impl Admission {
    fn take(shared: &Arc<Shared>) -> Result<Self, ApiError> {
        let before = shared.in_flight.fetch_add(1, Ordering::SeqCst);
        if before >= shared.limit {
            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::busy(
                format!(
                    "the server is busy: {} requests are running or queued",
                    shared.limit
                ),
                1,
            ));
        }
        Ok(Self(Arc::clone(shared)))
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs the server until SIGTERM or Ctrl-C.
pub fn run(args: Args) -> Result<()> {
    let g = &args.generate;
    if !g.prompts.is_empty() || g.messages.is_some() || g.system.is_some() {
        bail!("serve takes its prompts from requests: no PROMPT, --messages or --system")
    }
    if g.format != Format::Text || g.echo || g.chat || g.constraint.is_some() {
        bail!("--format, --echo, --chat and --constraint are generate's, not serve's")
    }
    if args.parallel == 0 || args.prefill_chunk == 0 {
        bail!("--parallel and --prefill-chunk must be at least 1")
    }
    let Prepared {
        generator,
        settings,
        template_args,
    } = prepare(g)?;
    let generator = Arc::new(generator);
    let (jobs, engine) = engine::start(Arc::clone(&generator), args.parallel, args.prefill_chunk)
        .context("starting the engine thread")?;
    let shared = Arc::new(Shared {
        generator,
        defaults: settings,
        default_max: g.max_new_tokens,
        template_args,
        jobs,
        in_flight: AtomicUsize::new(0),
        limit: args.parallel.saturating_add(args.queue),
        model_id: args
            .alias
            .clone()
            .unwrap_or_else(|| g.model.display().to_string()),
        requests: AtomicU64::new(0),
        seeds: RandomState::new(),
        readers: tokio::sync::Semaphore::new(READERS),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/chat/completions", post(chat))
        .route("/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/health", get(health))
        .fallback(not_found)
        .with_state(shared);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
        eprintln!(
            "listening on http://{} ({} in parallel, {} queued at most)",
            listener.local_addr()?,
            args.parallel,
            args.queue
        );
        axum::serve(listener, app)
            .with_graceful_shutdown(stopped())
            .await
            .context("serving")
    })?;
    // The router, and with it the last sender of jobs, is gone: the
    // engine ends once what it runs is done.
    if engine.join().is_err() {
        bail!("the engine thread panicked")
    }
    eprintln!("serve: stopped");
    Ok(())
}

/// Resolves at the first SIGTERM or Ctrl-C; a second one ends the process
/// at once, cancelling what is in flight.
async fn stopped() {
    wait_signal().await;
    eprintln!("serve: stopping: no new requests; finishing the ones in flight (signal again to cancel them)");
    tokio::spawn(async {
        wait_signal().await;
        eprintln!("serve: cancelled the requests in flight");
        std::process::exit(0);
    });
}

async fn wait_signal() {
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(e) => {
                eprintln!("serve: cannot wait for SIGTERM ({e}); Ctrl-C still stops");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn chat(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    complete(shared, &headers, body, Endpoint::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    complete(shared, &headers, body, Endpoint::Text)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn models(State(shared): State<Arc<Shared>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": shared.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "multihead",
            "meta": {
                "n_ctx_train": shared.generator.context(),
                "n_vocab": CausalLm::vocab_size(shared.generator.model()),
            },
        }],
    }))
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

async fn not_found() -> ApiError {
    ApiError::with_status(StatusCode::NOT_FOUND, "no such endpoint")
}

/// A completion request, from its body to its reply.
async fn complete(
    shared: Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let body = read_body(headers, body).await?;
    let admission = Admission::take(&shared)?;
    let (prompt, request) = match endpoint {
        Endpoint::Chat => Request::chat(&body)?,
        Endpoint::Text => Request::completion(&body)?,
    };
    let prompt_param = match endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Text => "prompt",
    };
    let prompt_ids = prompt_ids(&shared, prompt, prompt_param).await?;
    let n = prompt_ids.len();
    let vocab = CausalLm::vocab_size(shared.generator.model());
    if let Some(&t) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            Some(prompt_param),
            format!("token {t} is outside the model's vocabulary of {vocab}"),
        ));
    }
    let room = match shared.generator.context() {
        Some(context) if n >= context => {
            return Err(ApiError::invalid(
                Some(prompt_param),
                format!("the prompt is {n} tokens long; the model's context holds {context}, leaving no room for a reply"),
            ))
        }
        Some(context) => (context - n).min(MAX_NEW_TOKENS),
        None => MAX_NEW_TOKENS,
    };
    let max_new = match request.max_tokens {
        Some((m, field)) if m > room => {
            return Err(ApiError::invalid(
                Some(field),
                format!(
                "{field} is {m}, but only {room} tokens fit after the prompt's {n} in the model's context"
            ),
            ))
        }
        Some((m, _)) => m,
        None => shared.default_max.unwrap_or(room).min(room),
    };
    let number = shared.requests.fetch_add(1, Ordering::SeqCst);
    let settings = request.settings(&shared.defaults, max_new, shared.seeds.hash_one(number));
    let (job, events) = Job::new(BatchRequest {
        prompt_ids,
        settings,
        ignore_eos: request.ignore_eos,
    });
    if shared.jobs.send(job).is_err() {
        return Err(ApiError::server("the server is stopping"));
    }
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let reply = Reply {
        endpoint,
        id: format!("{}-{number}", endpoint.id_prefix()),
        created,
        model: request.model,
        prompt_tokens: n,
        include_usage: request.include_usage,
        stops: request.stop,
    };
    if request.stream {
        reply.stream(events, admission).await
    } else {
        reply.whole(events).await
    }
}

/// The body, at most [`MAX_BODY_BYTES`]: one that announces more is
/// refused from its `Content-Length` before any of it is read (a client
/// that sent `Expect: 100-continue`, as curl does for a large body, gets
/// the 413 without sending it), one that turns out longer once past the
/// limit.
async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::with_status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is over the limit of {MAX_BODY_BYTES} bytes"),
        )
    };
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| too_large())
}

/// The prompt's ids: the conversation rendered with the chat template (the
/// server's `--template-arg`s under the request's `chat_template_kwargs`),
/// or the text tokenized, off the async threads and at most [`READERS`]
/// at once. A text far past the model's context is refused from a count
/// of its first segments, before the whole of it is tokenized. Every
/// failure is the request's (a template that raises, a text the tokenizer
/// refuses).
async fn prompt_ids(shared: &Arc<Shared>, prompt: Prompt, param: &'static str) -> Result<Vec<u32>, ApiError> {
    // Held until the text is read: ids given as such need no reading.
    let _permit = match prompt {
        Prompt::Ids(_) => None,
        _ => Some(
            shared
                .readers
                .acquire()
                .await
                .map_err(|_| ApiError::server("the server is stopping"))?,
        ),
    };
    let generator = Arc::clone(&shared.generator);
    let context = generator.context();
    let work = match prompt {
        Prompt::Ids(ids) => return check_not_empty(ids, param),
        Prompt::Chat {
            messages,
            args: asked,
        } => {
            let mut args = shared.template_args.clone();
            args.extend(asked);
            tokio::task::spawn_blocking(move || {
                let texts: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
                past_context(&generator, &texts, context)?;
                generator.chat_prompt_ids(&messages, &args)
            })
        }
        Prompt::Text(text) => tokio::task::spawn_blocking(move || {
            past_context(&generator, &[&text], context)?;
            generator.tokenizer().encode(&text)
        }),
    };
    match work.await {
        Ok(Ok(ids)) => check_not_empty(ids, param),
        Ok(Err(e)) => Err(ApiError::invalid(Some(param), e.to_string())),
        Err(_) => Err(ApiError::server("reading the prompt failed unexpectedly")),
    }
}

/// Refuses `texts` when their tokens certainly overflow `context`:
/// counted segment by segment ([`COUNT_SEGMENT_BYTES`], cut after a
/// whitespace), stopping once the count, less two tokens a segment for
/// what its edges may tokenize otherwise than the whole text, is past
/// the context. Short texts are not counted: their tokenization is cheap.
fn past_context(generator: &TextGenerator, texts: &[&str], context: Option<usize>) -> candle::Result<()> {
    let Some(context) = context else {
        return Ok(());
    };
    if texts.iter().map(|t| t.len()).sum::<usize>() <= COUNT_SEGMENT_BYTES {
        return Ok(());
    }
    let mut counted = 0usize;
    for text in texts {
        let mut rest = *text;
        while !rest.is_empty() {
            let mut cut = rest.len().min(COUNT_SEGMENT_BYTES);
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            if let Some(space) = rest[..cut]
                .rfind(char::is_whitespace)
                .filter(|&i| i > 0 && cut < rest.len())
            {
                cut = space;
            }
            let segment = generator.tokenizer().encode_plain(&rest[..cut])?;
            counted += segment.len().saturating_sub(2);
            if counted > context {
                candle::bail!(
                    "the prompt has more than {counted} tokens; the model's context holds {context}"
                )
            }
            rest = &rest[cut..];
        }
    }
    Ok(())
}

fn check_not_empty(ids: Vec<u32>, param: &str) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid(Some(param), "the prompt has no tokens"));
    }
    Ok(ids)
}
