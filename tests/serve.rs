//! `multihead serve` as its clients see it, over HTTP on a loopback port
//! the server picks (`--port 0`, read from its log): OpenAI's shapes,
//! greedy text equal to `generate`'s (itself HF's: `text_generation.rs`),
//! streamed and not, concurrent clients each equal to their own single
//! run, the limits as 400s naming the field, 429 past the queue, a
//! disconnect that frees its place, a template error that answers one
//! request alone, and SIGTERM finishing what is in flight, then exit 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle::Device;
use multihead::models::decoder::{ChatMessage, GenerationSettings, TextGenerator, TextOutput};
use multihead_test_support::{
    scratch_dir,
    text::{fixtures, folder_with, FOLDERS},
};
use serde_json::{json, Value};

const PROMPTS: [&str; 4] = [
    "Hello world",
    "héllo, 日本語?",
    "The quick brown fox jumps over the lazy dog",
    "a",
];

/// A running server, killed when dropped.
struct Server {
    child: Child,
    base: String,
    agent: ureq::Agent,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Result<Self> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_multihead"))
            // Errors must reach clients without the backtrace candle adds.
            .env("RUST_BACKTRACE", "1")
            .args(["serve", "--model"])
            .arg(model)
            .args(["--port", "0", "--threads", "1"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().context("stderr")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                if let Some(rest) = line.strip_prefix("listening on http://") {
                    let addr = rest.split_whitespace().next().unwrap_or_default().to_string();
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                bail!("the server did not say where it listens")
            }
        };
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        Ok(Self {
            child,
            base: format!("http://{addr}"),
            agent,
        })
    }

    /// POSTs `body` to `path`: the status, the `Retry-After` header and
    /// the body as JSON.
    fn post(&self, path: &str, body: &Value) -> Result<(u16, Option<String>, Value)> {
        let mut resp = self.agent.post(format!("{}{path}", self.base)).send_json(body)?;
        let retry = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string()?;
        let value = serde_json::from_str(&text).with_context(|| format!("not JSON: {text:?}"))?;
        Ok((status, retry, value))
    }

    fn get(&self, path: &str) -> Result<(u16, Value)> {
        let mut resp = self.agent.get(format!("{}{path}", self.base)).call()?;
        Ok((resp.status().as_u16(), resp.body_mut().read_json()?))
    }

    /// POSTs a streaming request: the status and every `data:` payload.
    fn stream(&self, path: &str, body: &Value) -> Result<(u16, Vec<String>)> {
        let resp = self.agent.post(format!("{}{path}", self.base)).send_json(body)?;
        let status = resp.status().as_u16();
        let mut data = Vec::new();
        let reader = BufReader::new(resp.into_body().into_reader());
        for line in reader.lines() {
            if let Some(d) = line?.strip_prefix("data: ") {
                data.push(d.to_string());
            }
        }
        Ok((status, data))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The chunks of a stream, `[DONE]` last and the rest JSON.
fn chunks(data: &[String]) -> Result<Vec<Value>> {
    let Some((last, rest)) = data.split_last() else {
        bail!("an empty stream")
    };
    assert_eq!(last, "[DONE]");
    rest.iter().map(|d| Ok(serde_json::from_str(d)?)).collect()
}

/// A stream's text: its deltas (chat) or texts (completions), joined.
fn streamed_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|c| c["delta"]["content"].as_str().or(c["text"].as_str()))
        .collect()
}

fn greedy(g: &TextGenerator, n: usize) -> GenerationSettings {
    GenerationSettings {
        max_new_tokens: n,
        sampling: None,
        ..g.settings()
    }
}

fn finish_reason(out: &TextOutput) -> &'static str {
    match out.finish {
        multihead::models::decoder::Finish::Length => "length",
        _ => "stop",
    }
}

#[test]
fn greedy_text_equals_generate_streamed_and_not_on_every_fixture() -> Result<()> {
    for name in FOLDERS {
        let folder = fixtures().join(name);
        let g = TextGenerator::from_folder(&folder, &Device::Cpu)?;
        let settings = greedy(&g, 16);
        let server = Server::start(&folder, &[])?;
        for prompt in PROMPTS {
            let want = g.generate(prompt, &settings, &mut |_| Ok(()))?;
            let body =
                json!({"model": "any", "prompt": prompt, "max_tokens": 16, "temperature": 0, "unknown": [1]});
            let (status, _, got) = server.post("/v1/completions", &body)?;
            assert_eq!(status, 200, "{name} {prompt:?}: {got}");
            assert_eq!(got["object"], "text_completion");
            assert_eq!(got["model"], "any", "the request's model is echoed");
            assert_eq!(got["choices"][0]["text"], want.text.as_str(), "{name} {prompt:?}");
            assert_eq!(got["choices"][0]["finish_reason"], finish_reason(&want));
            assert_eq!(got["usage"]["prompt_tokens"], want.prompt_ids.len());
            assert_eq!(got["usage"]["completion_tokens"], want.ids.len());
            assert_eq!(
                got["usage"]["total_tokens"],
                want.prompt_ids.len() + want.ids.len()
            );

            let mut body = body.clone();
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
            let (status, data) = server.stream("/v1/completions", &body)?;
            assert_eq!(status, 200);
            let chunks = chunks(&data)?;
            assert_eq!(streamed_text(&chunks), want.text, "{name} {prompt:?}: streamed");
            let usage = chunks.last().context("usage chunk")?;
            assert_eq!(usage["choices"], json!([]));
            assert_eq!(usage["usage"]["completion_tokens"], want.ids.len());
            let last = &chunks[chunks.len() - 2]["choices"][0];
            assert_eq!(last["finish_reason"], finish_reason(&want));
        }
        if g.chat_template().is_none() {
            continue;
        }
        let messages = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hello world"),
        ];
        let want = g.generate_chat(&messages, &settings, &mut |_| Ok(()))?;
        let body = json!({
            "messages": [
                {"role": "system", "content": "Be brief."},
                // Text parts, as OpenAI's clients may send them.
                {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]},
            ],
            "max_completion_tokens": 16,
            "temperature": 0,
        });
        let (status, _, got) = server.post("/v1/chat/completions", &body)?;
        assert_eq!(status, 200, "{name}: {got}");
        assert_eq!(got["object"], "chat.completion");
        assert_eq!(got["choices"][0]["message"]["role"], "assistant");
        assert_eq!(
            got["choices"][0]["message"]["content"],
            want.text.as_str(),
            "{name} chat"
        );
        let mut body = body.clone();
        body["stream"] = json!(true);
        let (_, data) = server.stream("/v1/chat/completions", &body)?;
        let chunks = chunks(&data)?;
        assert_eq!(chunks[0]["object"], "chat.completion.chunk");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(streamed_text(&chunks), want.text, "{name} chat streamed");
    }
    Ok(())
}

#[test]
fn eight_concurrent_clients_each_equal_their_single_run() -> Result<()> {
    let folder = fixtures().join("llama3");
    let g = TextGenerator::from_folder(&folder, &Device::Cpu)?;
    let settings = greedy(&g, 24);
    let prompts: Vec<String> = (0..8).map(|i| format!("{} {i}", PROMPTS[i % 4])).collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|p| Ok(g.generate(p, &settings, &mut |_| Ok(()))?.text))
        .collect::<Result<_>>()?;
    // Four decode together, the rest wait for a place.
    let server = Server::start(&folder, &["--parallel", "4", "--prefill-chunk", "3"])?;
    let got: Vec<Result<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let server = &server;
                s.spawn(move || -> Result<String> {
                    let body = json!({"prompt": p, "max_tokens": 24, "temperature": 0, "stream": i % 2 == 0});
                    if i % 2 == 0 {
                        let (_, data) = server.stream("/v1/completions", &body)?;
                        Ok(streamed_text(&chunks(&data)?))
                    } else {
                        let (_, _, v) = server.post("/v1/completions", &body)?;
                        Ok(v["choices"][0]["text"].as_str().context("text")?.to_string())
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    });
    for ((p, want), got) in prompts.iter().zip(&want).zip(got) {
        assert_eq!(&got?, want, "{p:?}");
    }
    Ok(())
}

#[test]
fn stop_sequences_end_the_text_before_them() -> Result<()> {
    let folder = fixtures().join("llama3");
    let g = TextGenerator::from_folder(&folder, &Device::Cpu)?;
    let full = g.generate(PROMPTS[0], &greedy(&g, 24), &mut |_| Ok(()))?.text;
    // A stop sequence from the middle of the greedy text.
    let chars: Vec<char> = full.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let want = &full[..full.find(&stop).context("stop in text")?];
    let server = Server::start(&folder, &[])?;
    let body = json!({"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stop": [stop]});
    let (_, _, got) = server.post("/v1/completions", &body)?;
    assert_eq!(got["choices"][0]["text"], want);
    assert_eq!(got["choices"][0]["finish_reason"], "stop");
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (_, data) = server.stream("/v1/completions", &body)?;
    assert_eq!(streamed_text(&chunks(&data)?), want);
    Ok(())
}

#[test]
fn bad_requests_are_400s_naming_the_field_and_the_server_goes_on() -> Result<()> {
    let folder = fixtures().join("llama3");
    let server = Server::start(&folder, &[])?;
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let with = |key: &str, value: Value| {
        let mut b = ok.clone();
        b[key] = value;
        b
    };
    let cases = [
        (json!({"messages": []}), Some("messages")),
        (json!({"messages": "hi"}), Some("messages")),
        (json!({"messages": [{"content": "hi"}]}), Some("messages[0]")),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            Some("messages[0]"),
        ),
        (with("n", json!(2)), Some("n")),
        (with("max_tokens", json!(0)), Some("max_tokens")),
        (with("max_tokens", json!(1_000_000)), Some("max_tokens")),
        (with("max_tokens", json!(-3)), Some("max_tokens")),
        (with("temperature", json!(5)), Some("temperature")),
        (with("top_p", json!(0)), Some("top_p")),
        (with("stream", json!("yes")), Some("stream")),
        (with("stop", json!(["a", "b", "c", "d", "e"])), Some("stop")),
        (with("stop", json!([""])), Some("stop")),
        (with("presence_penalty", json!(1)), Some("presence_penalty")),
        (with("tools", json!([{"type": "function"}])), Some("tools")),
        (
            with("response_format", json!({"type": "json_object"})),
            Some("response_format"),
        ),
        (json!([1, 2]), None),
    ];
    for (body, param) in cases {
        let (status, _, err) = server.post("/v1/chat/completions", &body)?;
        assert_eq!(status, 400, "{body}: {err}");
        assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
        assert_eq!(err["error"]["param"].as_str(), param, "{body}: {err}");
        assert!(err["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    // A prompt past the context (256 positions) names it.
    let long = "word ".repeat(400);
    let (status, _, err) = server.post("/v1/completions", &json!({"prompt": long}))?;
    assert_eq!(
        (status, err["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{err}"
    );
    // One far past it is refused from a count of its first segments.
    let (status, _, err) = server.post("/v1/completions", &json!({"prompt": "word ".repeat(200_000)}))?;
    assert_eq!(
        (status, err["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{err}"
    );
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("more than"),
        "{err}"
    );
    let huge_message = json!({"messages": [{"role": "user", "content": "word ".repeat(200_000)}]});
    let (status, _, err) = server.post("/v1/chat/completions", &huge_message)?;
    assert_eq!(
        (status, err["error"]["param"].as_str()),
        (400, Some("messages")),
        "{err}"
    );
    let (status, _, err) = server.post("/v1/completions", &json!({"prompt": [5, 9_999_999]}))?;
    assert_eq!(
        (status, err["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{err}"
    );
    // Not JSON at all; a body past the limit; no such endpoint.
    let resp = server
        .agent
        .post(format!("{}/v1/completions", server.base))
        .header("content-type", "application/json")
        .send("{not json")?;
    assert_eq!(resp.status().as_u16(), 400);
    // A body announced past the limit is refused from its length alone,
    // before any of it is read (a client still sending it sees the
    // connection reset under it: here none is sent).
    let mut raw = TcpStream::connect(server.base.trim_start_matches("http://"))?;
    write!(
        raw,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        9 << 20
    )?;
    raw.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut answer = String::new();
    let _ = raw.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let err: Value = serde_json::from_str(body).with_context(|| format!("{answer:?}"))?;
    assert!(err["error"]["message"].is_string(), "{err}");
    let mut resp = server.agent.get(format!("{}/v1/nothing", server.base)).call()?;
    assert_eq!(resp.status().as_u16(), 404);
    assert!(resp.body_mut().read_json::<Value>()?["error"].is_object());
    // Still serving, and the model and health answer.
    let (status, _, v) = server.post("/v1/chat/completions", &ok)?;
    assert_eq!(status, 200, "{v}");
    let (status, models) = server.get("/v1/models")?;
    assert_eq!(status, 200);
    assert_eq!(models["object"], "list");
    assert!(models["data"][0]["id"].is_string());
    assert_eq!(server.get("/health")?, (200, json!({"status": "ok"})));
    Ok(())
}

#[test]
fn a_template_error_answers_that_request_alone() -> Result<()> {
    let folder = folder_with(scratch_dir!("llama3-serve-raising-template")?, "llama3", |dir| {
        let template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user\\'s') }}{% endif %}\
                        {% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:";
        std::fs::write(dir.join("chat_template.jinja"), template)?;
        Ok(())
    })?;
    let server = Server::start(&folder, &[])?;
    let bad = json!({"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2});
    let (status, _, err) = server.post("/v1/chat/completions", &bad)?;
    assert_eq!(status, 400, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("first message"),
        "{err}"
    );
    let good = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    assert_eq!(server.post("/v1/chat/completions", &good)?.0, 200);
    // A folder without a template says so, without the server's stack.
    let server = Server::start(&fixtures().join("llama2-sp"), &[])?;
    let (status, _, err) = server.post("/v1/chat/completions", &good)?;
    let message = err["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(status, 400, "{err}");
    assert!(message.contains("no chat template"), "{err}");
    assert!(
        !message.contains("0: "),
        "a backtrace reached the client: {message}"
    );
    Ok(())
}

/// The llama3 fixture with a context long enough for requests that run
/// until a test is done with them (rotary positions extrapolate).
fn long_context() -> Result<std::path::PathBuf> {
    folder_with(scratch_dir!("llama3-serve-long-context")?, "llama3", |dir| {
        let path = dir.join("config.json");
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        config["max_position_embeddings"] = json!(1_000_000);
        std::fs::write(&path, config.to_string())?;
        Ok(())
    })
}

/// A request that streams until its client leaves: the connection, after
/// its first chunk.
fn endless(server: &Server) -> Result<impl Read> {
    let body = json!({"prompt": "Hello", "max_tokens": 60_000, "ignore_eos": true, "stream": true});
    let resp = server
        .agent
        .post(format!("{}/v1/completions", server.base))
        .send_json(&body)?;
    assert_eq!(resp.status().as_u16(), 200);
    let mut reader = BufReader::new(resp.into_body().into_reader());
    let mut line = String::new();
    reader.read_line(&mut line)?;
    assert!(line.starts_with("data: "), "{line:?}");
    Ok(reader)
}

/// Tries `request` until it is not refused as busy, for up to 10 s.
fn until_admitted(server: &Server, body: &Value) -> Result<Value> {
    let start = Instant::now();
    loop {
        let (status, _, v) = server.post("/v1/completions", body)?;
        if status != 429 {
            assert_eq!(status, 200, "{v}");
            return Ok(v);
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("still busy after 10 s")
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn past_the_queue_429_and_a_disconnect_frees_its_place() -> Result<()> {
    // One place, no queue: a second request is turned away at once.
    let server = Server::start(&long_context()?, &["--parallel", "1", "--queue", "0"])?;
    let short = json!({"prompt": "Hi", "max_tokens": 3, "temperature": 0});
    let first = endless(&server)?;
    let (status, retry, v) = server.post("/v1/completions", &short)?;
    assert_eq!(status, 429, "{v}");
    assert_eq!(retry.as_deref(), Some("1"));
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    // The first client leaves: its place is free again.
    drop(first);
    until_admitted(&server, &short)?;
    // A client of a non-streaming request that hangs up frees its place too.
    let mut raw = TcpStream::connect(server.base.trim_start_matches("http://"))?;
    let body = json!({"prompt": "Hello", "max_tokens": 60_000, "ignore_eos": true}).to_string();
    write!(
        raw,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    std::thread::sleep(Duration::from_millis(300));
    drop(raw);
    until_admitted(&server, &short)?;
    Ok(())
}

#[test]
fn sigterm_finishes_what_is_in_flight_then_exits_0() -> Result<()> {
    let folder = fixtures().join("llama3");
    let mut server = Server::start(&folder, &[])?;
    let body = json!({"prompt": PROMPTS[2], "max_tokens": 200, "ignore_eos": true, "stream": true});
    let resp = server
        .agent
        .post(format!("{}/v1/completions", server.base))
        .send_json(&body)?;
    let mut reader = BufReader::new(resp.into_body().into_reader());
    let mut first = String::new();
    reader.read_line(&mut first)?;
    let status = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()?;
    assert!(status.success());
    // The stream in flight still ends properly.
    let mut rest = String::new();
    reader.read_to_string(&mut rest)?;
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    let chunks: Vec<Value> = format!("{first}{rest}")
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(
        chunks.last().context("chunks")?["choices"][0]["finish_reason"],
        "length"
    );
    let start = Instant::now();
    let code = loop {
        if let Some(status) = server.child.try_wait()? {
            break status;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "still running");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code.code(), Some(0));
    assert!(TcpStream::connect(server.base.trim_start_matches("http://")).is_err());
    Ok(())
}

/// A small deterministic stream of choices (no `rand` dependency).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn mixed_traffic_of_bad_bodies_and_hang_ups_leaves_every_good_request_answered() -> Result<()> {
    let folder = fixtures().join("llama3");
    let g = TextGenerator::from_folder(&folder, &Device::Cpu)?;
    let want = g.generate(PROMPTS[0], &greedy(&g, 8), &mut |_| Ok(()))?.text;
    let server = Server::start(&folder, &["--parallel", "4", "--queue", "200"])?;
    let addr = server.base.trim_start_matches("http://").to_string();
    let good = json!({"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0});
    let answered = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| -> Result<()> {
        let mut clients = Vec::new();
        for t in 0..6u64 {
            let (server, addr, good, want, answered) = (&server, &addr, &good, &want, &answered);
            clients.push(s.spawn(move || -> Result<()> {
                let mut rng = Lcg(t + 1);
                for _ in 0..25 {
                    match rng.below(5) {
                        0 | 1 => {
                            let (status, _, v) = server.post("/v1/completions", good)?;
                            assert_eq!(status, 200, "{v}");
                            assert_eq!(v["choices"][0]["text"], want.as_str());
                            answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        2 => {
                            // Malformed or oversized: refused, never fatal.
                            let bodies = [
                                json!({"prompt": "x", "max_tokens": "many"}),
                                json!({"messages": vec![json!({"role": "user", "content": "x"}); 5000]}),
                                json!({"prompt": "word ".repeat(600)}),
                            ];
                            let body = &bodies[rng.below(3) as usize];
                            let (status, _, _) = server.post("/v1/completions", body)?;
                            assert_eq!(status, 400, "{body}");
                        }
                        _ => {
                            // A client that hangs up mid-request or mid-stream.
                            let mut raw = TcpStream::connect(addr)?;
                            let body = json!({"prompt": "Hello", "max_tokens": 200, "ignore_eos": true,
                                              "stream": rng.below(2) == 0})
                            .to_string();
                            write!(
                                raw,
                                "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{}",
                                body.len(),
                                &body[..body.len() - rng.below(2) as usize * 5]
                            )?;
                            let mut some = [0u8; 64];
                            let _ = raw.set_read_timeout(Some(Duration::from_millis(50)));
                            let _ = raw.read(&mut some);
                        }
                    }
                }
                Ok(())
            }));
        }
        clients
            .into_iter()
            .try_for_each(|c| c.join().expect("client thread"))
    })?;
    assert!(answered.load(std::sync::atomic::Ordering::SeqCst) > 0);
    // Still serving, and nothing left running: every place is free again.
    let (status, _, v) = server.post("/v1/completions", &good)?;
    assert_eq!(
        (status, v["choices"][0]["text"].as_str()),
        (200, Some(want.as_str()))
    );
    Ok(())
}

#[test]
fn seeded_sampling_equals_generate_with_the_same_settings() -> Result<()> {
    let folder = fixtures().join("llama3");
    let g = TextGenerator::from_folder(&folder, &Device::Cpu)?;
    // The server's defaults are the folder's; the request's fields override.
    let base = g.settings().sampling.unwrap_or_default();
    let settings = GenerationSettings {
        max_new_tokens: 24,
        sampling: Some(multihead::models::decoder::Sampling {
            seed: 7,
            temperature: 0.8,
            top_k: base.top_k,
            top_p: 0.9,
        }),
        ..g.settings()
    };
    let want = g.generate(PROMPTS[2], &settings, &mut |_| Ok(()))?;
    let server = Server::start(&folder, &[])?;
    let body = json!({"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": 7});
    let (status, _, got) = server.post("/v1/completions", &body)?;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["choices"][0]["text"], want.text.as_str());
    // Another seed draws another text (the fixture's distribution is wide).
    let (_, _, other) = server.post(
        "/v1/completions",
        &json!({"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": 8}),
    )?;
    assert_ne!(other["choices"][0]["text"], want.text.as_str());
    Ok(())
}
