//! `multihead generate`: continue text with a decoder folder as HF
//! transformers saves it (GPT-2, Llama, Mistral, Qwen2, Qwen3), or a
//! Llama-family GGUF file, streaming each continuation as it is generated.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::{DType, Device};
use indicatif::{ProgressBar, ProgressStyle};
use multihead::models::checkpoint::{resolve_model, LoadOptions, LoadProgress, ModelFiles, WeightDtype};
use multihead::models::decoder::{
    ChatMessage, Finish, GenerationSettings, Sampling, TemplateArgs, TextGenerator,
};
use multihead::models::formats::files::{read_text, MAX_CONFIG_BYTES};
use multihead::models::formats::gguf::{is_gguf, GgufFile};
use serde_json::Value;

use super::input::{preview, read_lines};
use super::seq2seq::parse_device;

/// Writes a streamed `piece` to `out` and flushes it. The library hands
/// the callback's error back as a candle error, whose wrapping keeps only
/// its text: the write's own error is kept in `error`, so that `main`
/// still sees a closed pipe as one.
pub(super) fn write_piece(
    out: &mut impl Write,
    piece: &str,
    error: &mut Option<std::io::Error>,
) -> candle::Result<()> {
    if let Err(e) = write!(out, "{piece}").and_then(|()| out.flush()) {
        let text = e.to_string();
        *error = Some(e);
        return Err(candle::Error::Msg(format!("writing to standard output: {text}")));
    }
    Ok(())
}

/// Most threads `--threads` may ask for.
const MAX_THREADS: usize = 1024;

/// Most messages a `--messages` file may hold.
const MAX_MESSAGES: usize = 100_000;

/// `--messages FILE.json`: a list of `{"role": ..., "content": ...}`
/// objects, each wrong entry named by its index.
pub(super) fn read_messages(path: &Path) -> Result<Vec<ChatMessage>> {
    let label = path.display().to_string();
    let text = read_text(path, "messages", MAX_CONFIG_BYTES)?;
    let value: Value = serde_json::from_str(&text).with_context(|| format!("{label}: not valid JSON"))?;
    let Some(list) = value.as_array() else {
        bail!("{label}: must be a list of {{\"role\": ..., \"content\": ...}} objects")
    };
    if list.is_empty() || list.len() > MAX_MESSAGES {
        bail!(
            "{label}: must hold 1..={MAX_MESSAGES} messages, found {}",
            list.len()
        )
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |key: &str| match m.get(key) {
                Some(Value::String(s)) => Ok(s.clone()),
                other => bail!(
                    "{label}: messages[{i}].{key} must be a string, found {}",
                    other.map_or("nothing".to_string(), Value::to_string)
                ),
            };
            Ok(ChatMessage::new(field("role")?, field("content")?))
        })
        .collect()
}

/// `--template-arg KEY=VALUE`s, VALUE read as JSON where it is one.
fn template_args(given: &[String]) -> Result<TemplateArgs> {
    given
        .iter()
        .map(|arg| {
            let Some((key, value)) = arg.split_once('=').filter(|(k, _)| !k.is_empty()) else {
                bail!("--template-arg must be KEY=VALUE, found {arg:?}")
            };
            let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
            Ok((key.to_string(), value))
        })
        .collect()
}

/// Most tokens `--max-new-tokens` may ask for.
const MAX_NEW_TOKENS: usize = 1 << 16;

/// Arguments of `multihead generate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Prompts, one continuation each; without any, one prompt per line of
    /// standard input.
    pub prompts: Vec<String>,
    /// The model folder: config.json, model.safetensors (or shards),
    /// tokenizer.json, and generation_config.json if it has one; or a
    /// GGUF file (llama, Mistral, Qwen2, Qwen3; F32, F16, BF16 or Q8_0);
    /// or a hub name, `ORG/NAME[@REVISION]`, found in the local Hugging
    /// Face cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)
    /// without the network, as transformers finds it offline; a multihead
    /// built with `--features hub-download` downloads one missing there
    /// into the cache first (unless HF_HUB_OFFLINE=1).
    #[arg(long, value_name = "DIR|FILE.gguf|ORG/NAME")]
    pub model: PathBuf,
    /// With a GGUF model: the tokenizer.json to use instead of the one the
    /// file carries (needed where that one is not rebuilt: WordPiece, an
    /// unknown pre-tokenizer).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Most tokens generated per prompt (default: the folder's
    /// generation_config.json, else 20).
    #[arg(long, value_name = "N")]
    pub max_new_tokens: Option<usize>,
    /// Fewest tokens before an end token may end a continuation.
    #[arg(long, value_name = "N")]
    pub min_new_tokens: Option<usize>,
    /// Greedy decoding, whatever the folder's generation config says.
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p"])]
    pub greedy: bool,
    /// Sample at this temperature (sampling also follows the folder's
    /// do_sample); 0 is greedy decoding, as in llama.cpp and OpenAI's API.
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// Sample among the K most likely tokens.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities reach P.
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Stop once the text holds this string (kept in the output); may be
    /// given several times. Adds to the folder's `stop_strings`.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// A regular expression the whole continuation must match (the `regex`
    /// crate's syntax): only tokens after which it still can are chosen,
    /// the end token once it does, e.g. `[0-9]{4}-[0-9]{2}-[0-9]{2}` or
    /// `(yes|no)`.
    #[arg(long, value_name = "REGEX")]
    pub constraint: Option<String>,
    /// Seed of the samples: the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `text`: each continuation streamed, one line each; `json`: one array
    /// with an object per prompt; `jsonl`: one object a line, each written
    /// as its continuation ends.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// With `--format text`: print each prompt before its continuation.
    #[arg(long)]
    pub echo: bool,
    /// Each prompt is a user's message, rendered with the folder's chat
    /// template; the output is the assistant's reply.
    #[arg(long)]
    pub chat: bool,
    /// With `--chat` (or `multihead chat`): a system message before each
    /// prompt.
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// A conversation to reply to in place of prompts: a JSON file holding
    /// a list of `{"role": ..., "content": ...}` objects (as OpenAI's API
    /// and HF's `apply_chat_template` take them), rendered with the
    /// model's chat template; the output is the assistant's reply.
    #[arg(long, value_name = "FILE.json", conflicts_with_all = ["prompts", "chat", "system"])]
    pub messages: Option<PathBuf>,
    /// With `--chat` or `--messages`: a variable for the chat template, as
    /// `apply_chat_template`'s keyword arguments: `KEY=VALUE`, VALUE read as
    /// JSON where it is one (`false`, `3`, `"x"`), else as text; e.g.
    /// `enable_thinking=false` (Qwen3). May be given several times.
    #[arg(long, value_name = "KEY=VALUE")]
    pub template_arg: Vec<String>,
    /// Threads the model runs on (default: one a core).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// The dtype the weight matrices are kept in: f32, or bf16 and f16
    /// (half the memory and the bytes read a token; a bf16 folder is kept
    /// as stored), or q8_0, q4_0 or q4_k (llama.cpp's 8- and 4-bit blocks,
    /// quantized at load as llama-quantize does), or ggml (a GGUF file's 2- to 6-bit blocks, Q4_0
    /// … Q6_K, kept as stored). Activations stay f32. Default: for a folder, the dtype HF
    /// transformers loads it in (its config's, else its weights'); for a
    /// GGUF file, the type it stores its matrices in.
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<WeightDtype>,
    /// The dtype the key/value cache stores keys and values in: f32 (as
    /// computed), or bf16 and f16 (half the cache's memory; the CPU
    /// attention reads it in place).
    #[arg(long, value_enum, value_name = "DTYPE", default_value_t = KvDtype::F32)]
    pub kv_dtype: KvDtype,
    /// cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Continuations as they are generated, a newline after each.
    Text,
    /// One JSON array, an object per prompt.
    Json,
    /// One JSON object a line, written as each continuation ends.
    Jsonl,
}

/// The model `args` names (a GGUF file where `gguf`), its weight matrices
/// in `--dtype`, else in the dtype its folder loads in by default
/// ([`ModelFiles::auto_dtype`]) or its file stores them in
/// ([`GgufFile::weight_dtype`]); and that dtype.
fn load(
    model: &Path,
    args: &Args,
    gguf: bool,
    device: &Device,
    progress: LoadProgress,
) -> candle::Result<(TextGenerator, WeightDtype)> {
    let opts = |dtype| LoadOptions {
        dtype,
        kv_dtype: args.kv_dtype.dtype(),
        progress: Some(progress.clone()),
    };
    if gguf {
        let file = GgufFile::read(model)?;
        let dtype = args.dtype.or(file.weight_dtype()).unwrap_or_default();
        let generator =
            TextGenerator::from_gguf_file(&file, args.tokenizer.as_deref(), device, &opts(dtype))?;
        return Ok((generator, dtype));
    }
    let dtype = match args.dtype {
        Some(dtype) => dtype,
        None => ModelFiles::resolve(model)?.auto_dtype()?,
    };
    Ok((
        TextGenerator::from_folder_with(model, device, &opts(dtype))?,
        dtype,
    ))
}

/// What `generate` and `chat` share, ready: the model loaded (with a
/// progress bar on a terminal) on `--threads`, the generation settings
/// (the folder's, under the flags) and `--template-arg`s.
pub(super) struct Prepared {
    pub generator: TextGenerator,
    pub settings: GenerationSettings,
    pub template_args: TemplateArgs,
}

/// Loads what `args` names and reads its flags ([`Prepared`]).
pub(super) fn prepare(args: &Args) -> Result<Prepared> {
    if let Some(n) = args.threads {
        if !(1..=MAX_THREADS).contains(&n) {
            bail!("--threads must be in 1..={MAX_THREADS}, found {n}")
        }
        // Before any thread pool exists: candle's (which the kernels run
        // on) and rayon's read it when they start.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let template_args = template_args(&args.template_arg)?;
    if let Some(n) = args.max_new_tokens.filter(|n| !(1..=MAX_NEW_TOKENS).contains(n)) {
        bail!("--max-new-tokens must be in 1..={MAX_NEW_TOKENS}, found {n}")
    }
    let device = parse_device(&args.device)?;
    let start = Instant::now();
    // A bar over the weights' bytes; indicatif draws on stderr only when it
    // is a terminal.
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("loading {bar:30} {binary_bytes}/{binary_total_bytes} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let shown = bar.clone();
    let progress = LoadProgress(std::sync::Arc::new(move |done, total| {
        shown.set_length(total);
        shown.set_position(done);
    }));
    let model = resolve_model(&args.model)?;
    let gguf = is_gguf(&model);
    if args.tokenizer.is_some() && !gguf {
        bail!("--tokenizer is for a GGUF model; a folder's tokenizer is its tokenizer.json")
    }
    let (generator, dtype) = load(&model, args, gguf, &device, progress)
        .with_context(|| format!("loading '{}'", model.display()))?;
    bar.finish_and_clear();
    eprintln!(
        "loaded {} ({dtype}) in {:.0} ms",
        model.display(),
        start.elapsed().as_secs_f64() * 1e3
    );
    let mut settings = generator.settings();
    if let Some(n) = args.max_new_tokens {
        settings.max_new_tokens = n;
    }
    if let Some(n) = args.min_new_tokens {
        settings.min_new_tokens = n;
    }
    settings.stop_strings.extend(args.stop.iter().cloned());
    settings.constraint = args.constraint.clone();
    if args.greedy || args.temperature == Some(0.) {
        settings.sampling = None;
    } else if args.temperature.is_some() || args.top_k.is_some() || args.top_p.is_some() {
        let base = settings.sampling.clone().unwrap_or_default();
        settings.sampling = Some(Sampling {
            seed: args.seed,
            temperature: args.temperature.unwrap_or(base.temperature),
            top_k: args.top_k.or(base.top_k),
            top_p: args.top_p.unwrap_or(base.top_p),
        });
    }
    if let Some(s) = &mut settings.sampling {
        s.seed = args.seed;
    }
    Ok(Prepared {
        generator,
        settings,
        template_args,
    })
}

/// Runs the command: timings go to standard error, text to standard
/// output.
pub fn run(args: Args) -> Result<()> {
    if args.system.is_some() && !args.chat {
        bail!("--system is for a conversation: give --chat")
    }
    if !args.template_arg.is_empty() && !args.chat && args.messages.is_none() {
        bail!("--template-arg is for a conversation: give --chat or --messages")
    }
    let conversation = args.messages.as_deref().map(read_messages).transpose()?;
    let prompts: Vec<String> = if conversation.is_some() {
        // The conversation is the one input, in place of a prompt (the loop
        // below runs once; JSON gives its messages, not a prompt).
        vec![String::new()]
    } else if args.prompts.is_empty() {
        let mut prompts = Vec::new();
        for (i, (text, why)) in read_lines(std::io::stdin().lock())
            .context("reading standard input")?
            .into_iter()
            .enumerate()
        {
            if let Some(why) = why {
                bail!("line {} ({text:?}): {why}", i + 1)
            }
            prompts.push(text);
        }
        prompts
    } else {
        args.prompts.clone()
    };
    if prompts.is_empty() {
        bail!("no prompt: pass prompts as arguments or one per line on standard input")
    }
    let Prepared {
        generator,
        settings,
        template_args,
    } = prepare(&args)?;
    let mut out = std::io::stdout().lock();
    let mut json = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        if args.format == Format::Text && args.echo {
            write!(out, "{prompt}")?;
            out.flush()?;
        }
        let mut write_error: Option<std::io::Error> = None;
        let mut on_text = |piece: &str| -> candle::Result<()> {
            if args.format == Format::Text {
                // Shown as it comes; a closed pipe ends the command.
                write_piece(&mut out, piece, &mut write_error)?;
            }
            Ok(())
        };
        let result = if let Some(messages) = &conversation {
            generator.generate_chat_with(messages, &template_args, &settings, &mut on_text)
        } else if args.chat {
            let mut messages: Vec<ChatMessage> = args
                .system
                .iter()
                .map(|s| ChatMessage::new("system", s.as_str()))
                .collect();
            messages.push(ChatMessage::new("user", prompt.as_str()));
            generator.generate_chat_with(&messages, &template_args, &settings, &mut on_text)
        } else {
            generator.generate(prompt, &settings, &mut on_text)
        };
        if let Some(e) = write_error {
            return Err(e).context("writing to standard output");
        }
        let result = result.with_context(|| match &args.messages {
            Some(path) => format!("the conversation in {}", path.display()),
            None => format!("prompt {} ({:?})", i + 1, preview(prompt)),
        })?;
        let new = result.ids.len();
        let per_s = if result.decode_ms > 0. {
            new.saturating_sub(1) as f64 / (result.decode_ms / 1e3)
        } else {
            0.
        };
        if args.format == Format::Text {
            // The continuation's line ends before the timings are
            // printed: on a terminal both streams share one screen, and
            // the timings would otherwise carry on the text's line.
            writeln!(out)?;
            out.flush()?;
        }
        eprintln!(
            "prompt {}: {} prompt tokens, prefill {:.1} ms, {new} new tokens, {per_s:.1} tokens/s",
            i + 1,
            result.prompt_ids.len(),
            result.prefill_ms
        );
        if args.format != Format::Text {
            let mut object = serde_json::json!({
                "prompt": prompt,
                "text": result.text,
                "tokens": result.ids,
                "prompt_tokens": result.prompt_ids.len(),
                "new_tokens": new,
                "prefill_ms": result.prefill_ms,
                "decode_tokens_per_s": per_s,
                "finish": match result.finish {
                    Finish::Eos => "eos",
                    Finish::Length => "length",
                    Finish::Stop => "stop",
                },
            });
            if let Some(messages) = &conversation {
                object["prompt"] = Value::Null;
                object["messages"] = serde_json::to_value(messages)?;
            }
            if args.format == Format::Jsonl {
                // Written as text: a write error inside serde_json's would
                // hide the closed pipe from `main`.
                writeln!(out, "{}", serde_json::to_string(&object)?)?;
                out.flush()?;
            } else {
                json.push(object);
            }
        }
    }
    if args.format == Format::Json {
        // Written as text: a write error inside serde_json's would hide
        // the closed pipe from `main`.
        writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
    }
    out.flush()?;
    Ok(())
}

/// `--kv-dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvDtype {
    F32,
    Bf16,
    F16,
}

impl KvDtype {
    /// The cache's storage dtype; `None` for f32, the dtype computed in.
    fn dtype(self) -> Option<DType> {
        match self {
            KvDtype::F32 => None,
            KvDtype::Bf16 => Some(DType::BF16),
            KvDtype::F16 => Some(DType::F16),
        }
    }
}
