//! The thread that runs the model: it owns the [`Batcher`], takes the
//! requests the HTTP handlers send it, and steps the batch while any
//! sequence is queued or running. Each request's events go back on its
//! own channel; a handler that is gone (its client disconnected) closes
//! the channel, and the batcher drops the sequence before its next step.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use multihead::models::decoder::{BatchEvent, BatchRequest, BatchSink, Batcher, TextGenerator};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// What a request hears from the engine.
#[derive(Debug)]
pub(super) enum Heard {
    /// The batcher's event.
    Event(BatchEvent),
    /// The batcher refused the request before queueing it.
    Refused(String),
}

/// A request on its way to the engine, with where its events go.
pub(super) struct Job {
    request: BatchRequest,
    events: UnboundedSender<Heard>,
}

impl Job {
    /// A job and the receiver of its events.
    pub(super) fn new(request: BatchRequest) -> (Self, UnboundedReceiver<Heard>) {
        let (events, rx) = unbounded_channel();
        (Self { request, events }, rx)
    }
}

/// A request's channel as the batcher's sink.
struct ChannelSink(UnboundedSender<Heard>);

impl BatchSink for ChannelSink {
    fn send(&mut self, event: BatchEvent) -> bool {
        self.0.send(Heard::Event(event)).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// Starts the engine on its own thread: at most `parallel` sequences at
/// once, prompts read `chunk` tokens between steps. It ends when every
/// sender of jobs is gone and nothing is left to do.
pub(super) fn start(
    generator: Arc<TextGenerator>,
    parallel: usize,
    chunk: usize,
) -> std::io::Result<(mpsc::Sender<Job>, JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel::<Job>();
    let handle = std::thread::Builder::new()
        .name("multihead-engine".into())
        .spawn(move || run(&generator, parallel, chunk, &rx))?;
    Ok((tx, handle))
}

fn run(generator: &TextGenerator, parallel: usize, chunk: usize, jobs: &mpsc::Receiver<Job>) {
    let fresh = || Batcher::new(generator, parallel).with_prefill_chunk(chunk);
    let mut batcher = fresh();
    loop {
        if batcher.is_idle() {
            // Nothing to step: wait for a job, or end once nobody can send one.
            match jobs.recv() {
                Ok(job) => submit(&mut batcher, job),
                Err(_) => return,
            }
        }
        while let Ok(job) = jobs.try_recv() {
            submit(&mut batcher, job);
        }
        match catch_unwind(AssertUnwindSafe(|| batcher.step())) {
            Ok(Ok(())) => {}
            // Every sequence of the batch was told; the next ones start
            // on an empty batch.
            Ok(Err(e)) => eprintln!("serve: a decoding step failed: {e}"),
            Err(_) => {
                // A bug, not a request's doing: the sequences in flight
                // are dropped (their handlers see their channels close and
                // answer 500), and the server goes on with a new batch.
                eprintln!("serve: a decoding step panicked; the requests in flight were dropped");
                batcher = fresh();
            }
        }
    }
}

fn submit(batcher: &mut Batcher<'_>, job: Job) {
    let Job { request, events } = job;
    if events.is_closed() {
        return;
    }
    let sink = Box::new(ChannelSink(events.clone()));
    if let Err(e) = batcher.submit(request, sink) {
        // Nobody may be listening any more; nothing else to do then.
        let _ = events.send(Heard::Refused(e.to_string()));
    }
}
