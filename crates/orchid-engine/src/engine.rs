//! The generation loop. One thread owns the model and the state pool; clients talk to it
//! through channels. Each step: admit queued requests into free state slots, build one flat
//! batch (one token for every decoding sequence, plus prefill chunks of new ones), run the
//! model, sample, stream events. A client that drops its receiver cancels its request.
//!
//! Determinism: a sequence's prompt is always split at the same chunk boundaries and every
//! op computes each row independently, so a request's output does not depend on what else
//! is running.
//!
//! Fast decode. A backend may come with a [`FastDecode`] (CUDA: `orchid_cuda::GraphDecoder`, a
//! captured decode graph with sampling on the GPU). When exactly one sequence is running, it
//! is past its prompt and the device sampler can honour its request (no repetition/presence/
//! frequency penalty, no logprobs, finite parameters), the step runs through it instead of the
//! batched forward call; anything else (a second request arriving, a prefill, penalties) runs
//! the generic step, and the next single-sequence step goes back to the fast path. Both work
//! on the same state, so switching at a step boundary is free (the fast decoder re-uploads its
//! input token and position when the generic path moved the sequence on). Stop tokens, stop
//! strings, max_tokens, the context limit and streaming stay here, the same for both paths.
//! Greedy output is the same on both paths up to floating-point differences between the two
//! kernel sets (a near-tie of the top two logits can flip); seeded sampling on the device is
//! reproducible but draws from its own generator, keyed by (seed, token index), not from the
//! host sampler's stream, so a seeded sampled request gives different (equally distributed)
//! text with the fast path on and off.
//!
//! Constrained decoding. A request with a [`Constraint`](crate::constraint::Constraint) (a
//! grammar) never takes the fast path: its mask is applied to the host logits before the
//! host sampler runs. The masks for a step are computed on a second thread while the model
//! runs that step's forward call (each constrained sequence's matcher already knows the token
//! it is about to be fed), so on a GPU the mask costs no step time; constrained and free
//! sequences share the batch. (The fast decoder would need a mask buffer its sampler reads,
//! uploaded each step; see docs/server.md.)

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use orchid_model::{Backend, BatchLayout, DecodeStep, DeviceSampling, FastDecode, LogitRows, Model, SeqSpan, StateOptions, StatePool};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::constraint::Constraint;
use crate::detokenize::Detokenizer;
use crate::request::{Event, FinishReason, GenerateRequest, SubmitError, Usage};
use crate::sampling::{Rng, Sampler, SamplingParams, logprobs};
use crate::stop::{StopMatcher, StopOutcome};
use crate::tokenizer::Tokenizer;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Sequences decoded together (state slots).
    pub max_seqs: usize,
    /// Longest prompt + output of one sequence.
    pub max_context: usize,
    /// Prompt tokens run per forward call for one sequence.
    pub prefill_chunk: usize,
    /// Requests allowed to wait for a slot.
    pub max_queue: usize,
    /// Decode a lone sequence through the backend's fast decoder when it has one (CUDA: the
    /// decode graph). Default: on, unless the environment sets `ORCHID_DECODE_GRAPH=0`.
    pub fast_decode: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { max_seqs: 16, max_context: 32768, prefill_chunk: 512, max_queue: 64, fast_decode: fast_decode_default() }
    }
}

/// `ORCHID_DECODE_GRAPH=0` (or `false`/`off`/`no`) turns the fast decode path off by default.
pub fn fast_decode_default() -> bool {
    match std::env::var("ORCHID_DECODE_GRAPH") {
        Ok(v) => !matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "off" | "no"),
        Err(_) => true,
    }
}

/// What an engine loader returns: the model and, optionally, the backend's fast
/// single-sequence decoder (see the module docs).
pub struct LoadedModel<B: Backend> {
    pub model: Model<B>,
    pub fast_decode: Option<Box<dyn FastDecode<B>>>,
}

impl<B: Backend> From<Model<B>> for LoadedModel<B> {
    fn from(model: Model<B>) -> Self {
        LoadedModel { model, fast_decode: None }
    }
}

/// Facts about the loaded model, known once loading finished.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub device: String,
    pub max_context: usize,
    pub vocab_size: usize,
    pub weight_bytes: usize,
    pub num_layers: usize,
}

/// Live counters for /metrics.
#[derive(Default, Debug)]
pub struct EngineStats {
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    pub state_bytes: AtomicUsize,
    pub state_slots: AtomicUsize,
    pub cancelled: AtomicUsize,
    pub prompt_tokens: AtomicUsize,
    pub generated_tokens: AtomicUsize,
    /// Decode steps run by the fast decoder (the rest of the decoding ran the generic step).
    pub fast_decode_steps: AtomicUsize,
}

enum Command {
    Submit(Box<GenerateRequest>, UnboundedSender<Event>),
    /// Stop admitting; finish running requests (drain) or cancel them, then exit.
    Shutdown { drain: bool },
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    info: Arc<OnceLock<Result<ModelInfo, String>>>,
    stats: Arc<EngineStats>,
    opts: EngineOptions,
    stopped: Arc<AtomicBool>,
    thread: Arc<std::sync::Mutex<Option<JoinHandle<()>>>>,
}

impl EngineHandle {
    /// Queues a request; events arrive on the returned receiver (drop it to cancel).
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>, SubmitError> {
        let max = match self.info.get() {
            Some(Ok(i)) => i.max_context,
            Some(Err(_)) => return Err(SubmitError::Stopped),
            None => return Err(SubmitError::NotReady),
        };
        if self.stopped.load(Ordering::Relaxed) {
            return Err(SubmitError::Stopped);
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.prompt.len() >= max {
            return Err(SubmitError::ContextLength { prompt: req.prompt.len(), max });
        }
        // Reserve a queue place; the engine releases it when it admits or drops the request.
        let q = self.stats.queued.fetch_add(1, Ordering::SeqCst);
        if q >= self.opts.max_queue {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull);
        }
        let (etx, erx) = unbounded_channel();
        if self.tx.send(Command::Submit(Box::new(req), etx)).is_err() {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Stopped);
        }
        Ok(erx)
    }

    /// Blocks until the model is loaded (or failed to load).
    pub fn wait_ready(&self) -> Result<ModelInfo, String> {
        loop {
            if let Some(r) = self.info.get() {
                return r.clone();
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    pub fn info(&self) -> Option<ModelInfo> {
        self.info.get().and_then(|r| r.as_ref().ok().cloned())
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// Stops the engine (finishing running requests when `drain`) and waits for its thread.
    pub fn shutdown(&self, drain: bool) {
        self.stopped.store(true, Ordering::Relaxed);
        let _ = self.tx.send(Command::Shutdown { drain });
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

/// Starts the engine thread; `load` runs on it (so device contexts live on that thread).
pub fn spawn<B, F>(opts: EngineOptions, tokenizer: Arc<Tokenizer>, load: F) -> EngineHandle
where
    B: Backend,
    F: FnOnce() -> anyhow::Result<Model<B>> + Send + 'static,
{
    spawn_with(opts, tokenizer, move || load().map(LoadedModel::from))
}

/// Like [`spawn`], for a loader that also provides the backend's fast decoder.
pub fn spawn_with<B, F>(opts: EngineOptions, tokenizer: Arc<Tokenizer>, load: F) -> EngineHandle
where
    B: Backend,
    F: FnOnce() -> anyhow::Result<LoadedModel<B>> + Send + 'static,
{
    let (tx, rx) = channel();
    let info = Arc::new(OnceLock::new());
    let stats = Arc::new(EngineStats::default());
    let (info2, stats2, opts2) = (info.clone(), stats.clone(), opts.clone());
    let thread = std::thread::Builder::new()
        .name("orchid-engine".into())
        .spawn(move || {
            let (model, fast) = match load() {
                Ok(l) => (l.model, l.fast_decode),
                Err(e) => {
                    let _ = info2.set(Err(format!("{e:#}")));
                    return;
                }
            };
            let fast = match fast {
                Some(f) if opts2.fast_decode => {
                    tracing::info!("single-sequence decoding: {}", f.name());
                    Some(f)
                }
                Some(f) => {
                    tracing::info!("single-sequence decoding: {} turned off, generic path", f.name());
                    None
                }
                None => None,
            };
            let max_context = opts2.max_context.min(model.config.max_position_embeddings);
            let state = match model.new_state(StateOptions { max_seqs: opts2.max_seqs, max_context }) {
                Ok(s) => s,
                Err(e) => {
                    let _ = info2.set(Err(e.to_string()));
                    return;
                }
            };
            let _ = info2.set(Ok(ModelInfo {
                device: model.backend.describe(),
                max_context,
                vocab_size: tokenizer.vocab_size().min(model.config.vocab_size),
                weight_bytes: model.weight_bytes,
                num_layers: model.config.num_layers(),
            }));
            let mut e = Engine { model, state, fast, tokenizer, opts: opts2, max_context, stats: stats2, waiting: VecDeque::new(), running: Vec::new() };
            e.run(rx);
        })
        .expect("spawning the engine thread");
    EngineHandle {
        tx,
        info,
        stats,
        opts,
        stopped: Arc::new(AtomicBool::new(false)),
        thread: Arc::new(std::sync::Mutex::new(Some(thread))),
    }
}

struct Seq {
    slot: usize,
    prompt: Vec<u32>,
    /// Prompt tokens already run.
    prefilled: usize,
    generated: Vec<u32>,
    sampler: Sampler,
    detok: Detokenizer,
    stop: StopMatcher,
    req: GenerateRequest,
    tx: UnboundedSender<Event>,
    /// Whether the fast decoder's device sampler can serve this request.
    fast_ok: bool,
    /// Seed of the device sampler (the request's, else a random one).
    device_seed: u64,
    /// The grammar the output follows, if any.
    constraint: Option<Constraint>,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.prefilled == self.prompt.len()
    }
    /// Position of the next token fed to the model.
    fn position(&self) -> usize {
        if self.decoding() { self.prompt.len() + self.generated.len() - 1 } else { self.prefilled }
    }
}

struct Engine<B: Backend> {
    model: Model<B>,
    state: B::State,
    fast: Option<Box<dyn FastDecode<B>>>,
    tokenizer: Arc<Tokenizer>,
    opts: EngineOptions,
    max_context: usize,
    stats: Arc<EngineStats>,
    waiting: VecDeque<(Box<GenerateRequest>, UnboundedSender<Event>)>,
    running: Vec<Seq>,
}

impl<B: Backend> Engine<B> {
    fn run(&mut self, rx: Receiver<Command>) {
        let mut draining = None;
        loop {
            // Block only when there is nothing to do.
            let idle = self.running.is_empty() && self.waiting.is_empty();
            if idle && draining.is_some() {
                break;
            }
            let first = if idle {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => break,
                }
            } else {
                None
            };
            for cmd in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                match cmd {
                    Command::Submit(req, tx) => {
                        if draining.is_some() {
                            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                            let _ = tx.send(Event::Error("the server is shutting down".into()));
                        } else {
                            self.waiting.push_back((req, tx));
                        }
                    }
                    Command::Shutdown { drain } => draining = Some(drain),
                }
            }
            if draining == Some(false) {
                for s in std::mem::take(&mut self.running) {
                    let _ = s.tx.send(Event::Error("the server is shutting down".into()));
                    self.state.free(s.slot);
                }
                for (_, tx) in std::mem::take(&mut self.waiting) {
                    self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                    let _ = tx.send(Event::Error("the server is shutting down".into()));
                }
                break;
            }
            self.admit();
            if !self.running.is_empty() {
                self.step();
            }
            self.publish_stats();
        }
        self.publish_stats();
    }

    fn admit(&mut self) {
        while let Some((req, tx)) = self.waiting.pop_front() {
            if tx.is_closed() {
                self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let Some(slot) = self.state.alloc() else {
                self.waiting.push_front((req, tx));
                return;
            };
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            self.stats.prompt_tokens.fetch_add(req.prompt.len(), Ordering::Relaxed);
            let mut req = *req;
            let constraint = req.constraint.take();
            let fast_ok = device_sampling_ok(&req) && constraint.is_none();
            let device_seed = req.sampling.seed.unwrap_or_else(|| Rng::from_entropy().next_u64());
            self.running.push(Seq {
                slot,
                prompt: req.prompt.clone(),
                prefilled: 0,
                generated: Vec::new(),
                sampler: Sampler::new(req.sampling.clone(), &req.prompt),
                detok: Detokenizer::with_context(self.tokenizer.clone(), req.skip_special_tokens, &req.prompt),
                stop: StopMatcher::new(req.stop.clone()),
                req,
                tx,
                fast_ok,
                device_seed,
                constraint,
            });
        }
    }

    /// One forward call over every decoding sequence plus the next prefill chunks.
    fn step(&mut self) {
        // Clients that went away (even mid-prompt) free their slots now.
        let gone: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].tx.is_closed()).collect();
        self.retire(&gone);
        if self.running.is_empty() || self.fast_step() {
            return;
        }
        let chunk = self.opts.prefill_chunk.max(1);
        let mut ids = Vec::new();
        let mut spans = Vec::new();
        let mut members = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if s.decoding() {
                ids.push(*s.generated.last().expect("a decoding sequence has a sampled token"));
                spans.push(SeqSpan { slot: s.slot, start: s.position(), len: 1 });
                members.push(i);
            }
        }
        let mut budget = chunk;
        for (i, s) in self.running.iter().enumerate() {
            if !s.decoding() {
                let n = chunk.min(s.prompt.len() - s.prefilled);
                if n > budget && budget < chunk {
                    break;
                }
                ids.extend_from_slice(&s.prompt[s.prefilled..s.prefilled + n]);
                spans.push(SeqSpan { slot: s.slot, start: s.prefilled, len: n });
                members.push(i);
                budget = budget.saturating_sub(n);
                if budget == 0 {
                    break;
                }
            }
        }
        let batch = BatchLayout { spans };
        // The grammar masks for this step are computed while the model runs.
        let (model, state, running) = (&self.model, &mut self.state, &mut self.running);
        let mut forward = || model.forward(&ids, &batch, state, LogitRows::LastOfEachSpan).and_then(|l| model.backend.to_host(&l));
        let (logits, masks) = if running.iter().any(|s| s.constraint.is_some()) {
            std::thread::scope(|sc| {
                let masks = sc.spawn(|| prepare_masks(running));
                let logits = forward();
                let masks = masks.join().unwrap_or_else(|_| vec![(usize::MAX, "computing the grammar mask panicked".to_string())]);
                (logits, masks)
            })
        } else {
            (forward(), Vec::new())
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                let msg = format!("inference failed: {e}");
                tracing::error!("{msg}");
                for &i in &members {
                    let _ = self.running[i].tx.send(Event::Error(msg.clone()));
                }
                self.retire(&members);
                return;
            }
        };
        let v = self.model.config.vocab_size;
        let valid = self.tokenizer.vocab_size().min(v);
        let mut done = Vec::new();
        for (row, (&i, span)) in members.iter().zip(&batch.spans).enumerate() {
            let s = &mut self.running[i];
            if !s.decoding() {
                s.prefilled += span.len;
                if !s.decoding() {
                    continue;
                }
            }
            let l = &logits[row * v..(row + 1) * v];
            let tok = match &mut s.constraint {
                Some(c) if c.active() => {
                    let mut masked = l[..valid].to_vec();
                    let failed = masks.iter().find(|(j, _)| *j == i || *j == usize::MAX).map(|(_, e)| e.clone());
                    let budget = s.req.max_tokens.min(self.max_context - s.prompt.len());
                    let remaining = budget.saturating_sub(s.generated.len());
                    match failed.map_or_else(|| c.apply(&mut masked, remaining, budget), Err) {
                        Ok(()) => s.sampler.sample(&masked, valid),
                        Err(e) => {
                            let _ = s.tx.send(Event::Error(format!("constrained decoding failed: {e}")));
                            done.push(i);
                            continue;
                        }
                    }
                }
                _ => s.sampler.sample(l, valid),
            };
            // Log-probabilities are those of the model, before any grammar mask.
            let lp = s.req.logprobs.map(|n| logprobs(l, valid, tok, n));
            if !emit(s, tok, lp, self.max_context) {
                done.push(i);
            }
        }
        self.stats.generated_tokens.fetch_add(members.len() - done.len(), Ordering::Relaxed);
        self.retire(&done);
    }

    /// Decodes the only running sequence through the fast decoder when it can (see the module
    /// docs); false when the generic step has to run instead.
    fn fast_step(&mut self) -> bool {
        let Some(fast) = self.fast.as_mut() else { return false };
        if self.running.len() != 1 || !self.running[0].decoding() || !self.running[0].fast_ok {
            return false;
        }
        let s = &self.running[0];
        let p = &s.req.sampling;
        let valid = self.tokenizer.vocab_size().min(self.model.config.vocab_size);
        let sampling = DeviceSampling { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p, seed: s.device_seed, valid };
        if let Err(e) = fast.prepare(&self.model, &mut self.state, s.slot, &sampling) {
            tracing::warn!("{} is not usable ({e}); decoding on the generic path from now on", fast.name());
            self.fast = None;
            return false;
        }
        let step = DecodeStep {
            slot: s.slot,
            token: *s.generated.last().expect("a decoding sequence has a sampled token"),
            pos: s.position(),
            index: s.generated.len(),
            sampling,
        };
        match fast.step(&self.model, &mut self.state, &step) {
            Ok(tok) => {
                self.stats.fast_decode_steps.fetch_add(1, Ordering::Relaxed);
                // Counted as the generic step counts (a token of a sequence that goes on).
                if emit(&mut self.running[0], tok, None, self.max_context) {
                    self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.retire(&[0]);
                }
            }
            Err(e) => {
                let msg = format!("inference failed: {e}");
                tracing::error!("{msg} ({})", fast.name());
                let _ = self.running[0].tx.send(Event::Error(msg));
                self.retire(&[0]);
            }
        }
        true
    }

    /// Frees the slots of finished or failed sequences.
    fn retire(&mut self, idx: &[usize]) {
        let mut idx = idx.to_vec();
        idx.sort_unstable();
        for &i in idx.iter().rev() {
            let s = self.running.remove(i);
            if s.tx.is_closed() {
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            self.state.free(s.slot);
        }
    }

    fn publish_stats(&self) {
        self.stats.running.store(self.running.len(), Ordering::Relaxed);
        self.stats.state_bytes.store(self.state.bytes_in_use(), Ordering::Relaxed);
        self.stats.state_slots.store(self.state.capacity(), Ordering::Relaxed);
    }
}

/// Whether the fast decoder's device sampler can serve `req` as the host sampler would: no
/// penalties, no logprobs, finite parameters (temperature, top-k, top-p, min-p and the seed are
/// what it implements).
pub fn device_sampling_ok(req: &GenerateRequest) -> bool {
    let p: &SamplingParams = &req.sampling;
    req.logprobs.is_none()
        && p.repetition_penalty == 1.0
        && p.presence_penalty == 0.0
        && p.frequency_penalty == 0.0
        && (p.is_greedy() || (p.temperature.is_finite() && p.top_p.is_finite() && p.min_p.is_finite()))
}

/// Computes the next-token grammar masks of the running sequences that will sample this step
/// (run on a helper thread during the forward call); returns the failures by sequence index.
fn prepare_masks(running: &mut [Seq]) -> Vec<(usize, String)> {
    let mut failed = Vec::new();
    for (i, s) in running.iter_mut().enumerate() {
        if let Some(c) = &mut s.constraint
            && let Err(e) = c.prepare()
        {
            failed.push((i, e));
        }
    }
    failed
}

/// Records a sampled token and streams it; false when the sequence is finished (or its
/// client is gone).
fn emit(s: &mut Seq, tok: u32, lp: Option<crate::sampling::TokenLogprob>, max_context: usize) -> bool {
    s.sampler.observe(tok);
    s.generated.push(tok);
    let usage = Usage { prompt_tokens: s.prompt.len(), completion_tokens: s.generated.len() };
    let finish = |s: &mut Seq, reason: FinishReason, text: String| {
        let _ = s.tx.send(Event::Finished { reason, text, usage });
        false
    };
    let grammar_end = match s.constraint.as_mut().map(|c| c.observe(tok)) {
        None | Some(Ok(false)) => false,
        Some(Ok(true)) => true,
        Some(Err(e)) => {
            let _ = s.tx.send(Event::Error(format!("constrained decoding failed: {e}")));
            return false;
        }
    };
    if grammar_end || s.req.stop_token_ids.contains(&tok) {
        // The end-of-turn token is not text; release what was held back.
        if s.tx.send(Event::Token { id: tok, text: String::new(), logprob: lp }).is_err() {
            return false;
        }
        let rest = s.detok.finish();
        let text = match s.stop.push(&rest) {
            StopOutcome::Continue(t) => t + &s.stop.flush(),
            StopOutcome::Stopped(t) => t,
        };
        return finish(s, FinishReason::Stop, text);
    }
    let piece = s.detok.push(tok);
    match s.stop.push(&piece) {
        StopOutcome::Stopped(t) => {
            if s.tx.send(Event::Token { id: tok, text: t, logprob: lp }).is_err() {
                return false;
            }
            finish(s, FinishReason::Stop, String::new())
        }
        StopOutcome::Continue(t) => {
            if s.tx.send(Event::Token { id: tok, text: t, logprob: lp }).is_err() {
                return false;
            }
            let at_limit = s.generated.len() >= s.req.max_tokens || s.prompt.len() + s.generated.len() >= max_context;
            if !at_limit {
                return true;
            }
            let rest = s.detok.finish();
            match s.stop.push(&rest) {
                StopOutcome::Stopped(t) => finish(s, FinishReason::Stop, t),
                StopOutcome::Continue(t) => {
                    let text = t + &s.stop.flush();
                    finish(s, FinishReason::Length, text)
                }
            }
        }
    }
}
