//! `multihead chat`: a conversation with a model, as `llama-cli` holds
//! one. Each line read is a user's message; the reply streams to standard
//! output, one line each, and the history's cache is kept between turns
//! ([`multihead::models::decoder::Conversation`]). On a terminal a `> `
//! prompt is shown; from a pipe the turns are read one a line, so it is
//! scripted and tested without a terminal. `/reset`, `/system TEXT` and
//! `/quit` steer it; Ctrl-C stops a reply, not the program. It takes
//! `generate`'s model and sampling options.

use std::io::{BufRead, IsTerminal, Read, Write};
use std::sync::atomic::{AtomicU8, Ordering};

use anyhow::{Context, Result};
use multihead::models::decoder::{ChatMessage, Conversation};

use super::generate::{prepare, read_messages, write_piece, Args, Format, Prepared};

/// Longest line read as one message.
const MAX_LINE_BYTES: u64 = 1 << 20;

/// What Ctrl-C does: while a reply streams it stops the reply; while a
/// line is read it ends the program (status 130, as a shell reports
/// SIGINT).
static STATE: AtomicU8 = AtomicU8::new(READING);
const READING: u8 = 0;
const REPLYING: u8 = 1;
const STOPPED: u8 = 2;

/// Runs the command. Prompts given as arguments are the first user turns;
/// then standard input, a line a turn.
pub fn run(args: Args) -> Result<()> {
    // generate's flags that shape its output, not a conversation.
    if args.format != Format::Text || args.echo || args.chat {
        anyhow::bail!("--format, --echo and --chat are generate's: chat replies in text, a line a turn")
    }
    let Prepared {
        generator,
        settings,
        template_args,
    } = prepare(&args)?;
    // The messages every conversation starts from (and /reset returns to).
    let mut start: Vec<ChatMessage> = match &args.messages {
        Some(path) => read_messages(path)?,
        None => args
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s.as_str()))
            .collect(),
    };
    ctrlc::set_handler(|| {
        if STATE
            .compare_exchange(REPLYING, STOPPED, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            std::process::exit(130);
        }
    })
    .context("setting the Ctrl-C handler")?;
    let mut conversation = generator.conversation().with_template_args(template_args);
    start_over(&mut conversation, &start);
    let terminal = std::io::stdin().is_terminal();
    if terminal {
        eprintln!("/reset starts over, /system TEXT sets the system message, /quit (or Ctrl-D) ends");
    }
    let mut given = args.prompts.iter().cloned();
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut out = std::io::stdout().lock();
    loop {
        let line = match given.next() {
            Some(line) => line,
            None => {
                if terminal {
                    eprint!("> ");
                }
                match read_line(&mut input)? {
                    Some(line) => line,
                    None => break,
                }
            }
        };
        let line = line.trim();
        match line {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                start_over(&mut conversation, &start);
                continue;
            }
            _ => {}
        }
        if let Some(system) = line.strip_prefix("/system ") {
            start = vec![ChatMessage::new("system", system)];
            start_over(&mut conversation, &start);
            continue;
        }
        conversation.push(ChatMessage::new("user", line));
        let mut write_error = None;
        STATE.store(REPLYING, Ordering::SeqCst);
        let reply = conversation.reply(&settings, &mut |piece| {
            if STATE.load(Ordering::SeqCst) == STOPPED {
                return Err(candle::Error::Msg("stopped by Ctrl-C".into()));
            }
            write_piece(&mut out, piece, &mut write_error)
        });
        if let Some(e) = write_error {
            return Err(e).context("writing to standard output");
        }
        if STATE.swap(READING, Ordering::SeqCst) == STOPPED && reply.is_err() {
            // The stopped reply and its question leave the conversation.
            conversation.pop();
            writeln!(out)?;
            out.flush()?;
            eprintln!("[stopped]");
            continue;
        }
        match reply {
            Ok(reply) => {
                writeln!(out)?;
                out.flush()?;
                if terminal {
                    eprintln!(
                        "[{} new tokens, {} tokens held]",
                        reply.ids.len(),
                        conversation.cached_tokens()
                    );
                }
            }
            // On a terminal the turn is dropped and the conversation goes
            // on (a full context is said, with what to do); from a pipe
            // the error ends the command.
            Err(e) if terminal => {
                conversation.pop();
                let text = e.to_string();
                eprintln!("error: {}", text.lines().next().unwrap_or_default());
                if text.contains("context holds") {
                    eprintln!("the conversation no longer fits the model's context: /reset starts over");
                }
            }
            Err(e) => return Err(e).context("replying"),
        }
    }
    Ok(())
}

/// Forgets the conversation but its `start`.
fn start_over(conversation: &mut Conversation, start: &[ChatMessage]) {
    conversation.reset();
    start.iter().cloned().for_each(|m| conversation.push(m));
}

/// One line of `input` without its line end, `None` at the end of input;
/// a line past [`MAX_LINE_BYTES`] or not UTF-8 is an error.
fn read_line(input: &mut impl BufRead) -> Result<Option<String>> {
    let mut line = Vec::new();
    input
        .by_ref()
        .take(MAX_LINE_BYTES + 1)
        .read_until(b'\n', &mut line)
        .context("reading standard input")?;
    if line.is_empty() {
        return Ok(None);
    }
    if line.len() as u64 > MAX_LINE_BYTES {
        anyhow::bail!("a line of standard input is longer than {MAX_LINE_BYTES} bytes")
    }
    while line.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
        line.pop();
    }
    Ok(Some(
        String::from_utf8(line).context("a line of standard input is not UTF-8")?,
    ))
}
