//! The generation loop. One thread owns the model and the state pool; clients talk to it
//! through channels. Each step: admit queued requests into free state slots, build one flat
//! batch (one token for every decoding sequence, plus the next prefill chunk of each new one
//! while the step's prompt-token budget lasts), run the model, sample, stream events. A client
//! that drops its receiver cancels its request.
//!
//! Determinism: a sequence's prompt is always split at the same chunk boundaries and every
//! op computes each row independently, so a request's output does not depend on what else
//! is running.
//!
//! Prefix cache (`prefix_cache`, on by default). A request whose prompt starts with a cached
//! prefix gets that prefix's saved state copied into its slot and prefills only the rest.
//! Snapshots are taken at the end of the shared part of a prompt, every few thousand tokens, at
//! the prompt's last block boundary (all multiples of 64 tokens), at the last block boundary a
//! generation reached, and where a finished generation ended (the one kept, for the
//! conversation's next turn). A snapshot point inside a prefill span does not split the span:
//! the forward pass captures the state there (`StatePool::capture_at`, taken afterwards with
//! `take_captures`); one at a span's end is saved after the pass (`StatePool::save`). With the
//! prefill chunk a multiple of 64 (the default 512) spans start at multiples of 64, so the
//! prompts' spans, and with them greedy output on the CPU backend, are bit for bit those of a
//! run without the cache, restored prefixes aside. See docs/prefix-cache.md.
//!
//! Fast decode. A backend may come with a [`FastDecode`] (CUDA: `orchid_cuda::GraphFastDecode`:
//! captured decode graphs with sampling on the GPU). When every decoding sequence can be served
//! by the device sampler (finite parameters, no forced or banned token this step, penalties,
//! logit bias and logprobs only on a decoder that takes them and within its caps), the decoding
//! sequences run through it: one sequence through `step`, several at once through `step_batch`
//! (one graph replay for all of them); prompts being prefilled then run in their own forward call
//! in the same step. Anything else runs the generic step for everyone, and the next step that
//! qualifies goes back to the fast path. All paths work on the same state, so switching at a step boundary is free (the
//! fast decoder re-uploads its inputs when the generic path moved a sequence on). Stop tokens,
//! stop strings, max_tokens, the context limit and streaming stay here, the same for all paths.
//! Greedy output is the same on every path up to floating-point differences between the kernel
//! sets (a near-tie of the top two logits can flip; the batch graph's kernels also depend on the
//! batch size); seeded sampling on the device is reproducible but draws from its own generator,
//! keyed by (seed, token index), not from the host sampler's stream.
//!
//! Constrained decoding. A request with a [`Constraint`](crate::constraint::Constraint) (a
//! grammar) gets, before each token, the set of tokens its grammar allows (narrowed near the end
//! of the budget). On the generic path that mask is applied to the host logits before the host
//! sampler runs; the masks for a step are computed on a second thread while the model runs that
//! step's forward call (each constrained sequence's matcher already knows the token it is about
//! to be fed), so the mask costs no step time. On the fast path, when the decoder takes masks
//! ([`FastDecode::masks`]), a constrained sequence decodes through `step_batch` (alone too, as a
//! batch of one) with its mask as a bit set the device sampler reads: `step_batch` asks for the
//! step's masks once it has launched the forward pass, so they are computed on the CPU while the
//! device runs it, and uploaded before the sampling. A mask that fails there ends its request
//! with the error after the step (the step has advanced its state already), as on the generic
//! path. Constrained and free sequences share the batch on either path, and the sampled token
//! advances the grammar in the one place every path shares (`emit`).
//!
//! Penalties and logit bias. The host sampler keeps each sequence's seen tokens and output counts
//! (`Sampler`). On the fast path, when the decoder takes logit adjustments
//! ([`FastDecode::logit_adjust_cap`]), a penalised or biased sequence decodes through
//! `step_batch` (alone as a batch of one too) and its bias and penalties reach the device as a
//! per-token list (`Sampler::device_adjust`, asked for with the masks once the forward pass runs),
//! which the device sampler applies before its filters exactly as the host sampler would. A
//! sequence whose list may exceed the decoder's cap decodes on the generic path that step.
//!
//! Log-probabilities. On a decoder that computes them ([`FastDecode::logprobs_cap`]), a request
//! with `logprobs` (and a `top_logprobs` within the cap) decodes through `step_batch` (alone as a
//! batch of one too), which returns each asking row's [`TokenLogprob`](orchid_model::TokenLogprob)
//! of the raw logits, emitted where the generic path emits its own (`sampling::logprobs`).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use orchid_model::backend::GDN_CHUNK;
use orchid_model::{
    Backend, BatchLayout, DecodeStep, DeviceSampling, FastDecode, LateInputs, LogitRows, Model, SeqSpan, StateOptions, StatePool,
};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::constraint::Constraint;
use crate::detokenize::Detokenizer;
use crate::prefix_cache::{self, PrefixCache};
use crate::request::{Event, FinishReason, GenerateRequest, StopReason, SubmitError, Usage};
use crate::sampling::{Rng, Sampler, SamplingParams, logprobs};
use crate::stop::{StopMatcher, StopOutcome};
use crate::tokenizer::Tokenizer;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Sequences decoded together (state slots).
    pub max_seqs: usize,
    /// Longest prompt + output of one sequence.
    pub max_context: usize,
    /// Prompt tokens of one request one step runs: a longer prompt takes several steps, so that
    /// decoding goes on between them (vLLM's `long_prefill_token_threshold`). At least 1.
    pub prefill_chunk: usize,
    /// Prompt tokens one step runs over all requests still in their prompt (vLLM's
    /// `max_num_batched_tokens`, less the decode tokens): each step runs one token of every
    /// decoding sequence plus the next span of each prompt, in arrival order, while they fit.
    /// Raised to `prefill_chunk` when smaller. `None`: the backend's
    /// [`Backend::default_batched_tokens`].
    pub max_batched_tokens: Option<usize>,
    /// Requests allowed to wait for a slot.
    pub max_queue: usize,
    /// Decode a lone sequence through the backend's fast decoder when it has one (CUDA: the
    /// decode graph). Default: on.
    pub fast_decode: bool,
    /// Reuse the state of cached prompt prefixes (see the module docs).
    pub prefix_cache: bool,
    /// Byte budget of the prefix cache; `None`: the backend's default (docs/prefix-cache.md).
    pub prefix_cache_bytes: Option<usize>,
    /// The share of the GPU's total memory orchid may use, weights included
    /// (`StateOptions::memory_utilization`).
    pub gpu_memory_utilization: f64,
    /// KV positions all running sequences may hold together, instead of what memory allows
    /// (`StateOptions::kv_tokens`). A request is admitted when its prompt + max_tokens fit in
    /// what is not promised to running ones; until then it waits in the queue.
    pub kv_cache_tokens: Option<usize>,
    /// A testing aid: make the engine thread panic while loading or at its first step, so that
    /// tests can check that no panic leaves a process hanging (`orchid` sets it from `ORCHID_FAULT`).
    pub inject_fault: Option<Fault>,
}

impl EngineOptions {
    /// Prompt tokens one step runs: `max_batched_tokens`, else the backend's `default`, never
    /// fewer than one prefill chunk.
    pub fn step_tokens(&self, default: usize) -> usize {
        self.max_batched_tokens.unwrap_or(default).max(self.prefill_chunk.max(1))
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_seqs: 16,
            max_context: 32768,
            prefill_chunk: 512,
            max_batched_tokens: None,
            max_queue: 64,
            fast_decode: true,
            prefix_cache: true,
            prefix_cache_bytes: None,
            gpu_memory_utilization: orchid_model::backend::DEFAULT_MEMORY_UTILIZATION,
            kv_cache_tokens: None,
            inject_fault: None,
        }
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
    /// Prompt tokens one step runs (`EngineOptions::max_batched_tokens` as the engine uses it).
    pub max_batched_tokens: usize,
}

/// Why the engine has no model: loading failed or panicked.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct LoadFailure {
    pub message: String,
    /// The model folder is at fault (config, checkpoint, tokenizer), not the device.
    pub bad_model: bool,
}

impl LoadFailure {
    /// As an error for the binary: an [`orchid_model::LoadError`] when the folder is at fault.
    pub fn into_anyhow(self) -> anyhow::Error {
        if self.bad_model { anyhow::Error::new(orchid_model::LoadError(self.message)) } else { anyhow::anyhow!(self.message) }
    }
}

/// Whether `e` says the model folder is unusable (see [`LoadFailure::bad_model`]).
pub fn is_bad_model(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<orchid_model::LoadError>().is_some() || c.downcast_ref::<orchid_model::Error>().is_some_and(|e| e.is_load_error())
    })
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Where [`EngineOptions::inject_fault`] makes the engine thread panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Load,
    Step,
}

fn injected_fault(want: Option<Fault>, at: Fault) {
    if want == Some(at) {
        panic!("injected panic ({at:?})");
    }
}

/// Live counters for /metrics.
#[derive(Default, Debug)]
pub struct EngineStats {
    pub queued: AtomicUsize,
    /// Requests accepted and not yet finished (waiting or running); at most max_seqs + max_queue.
    pub in_flight: AtomicUsize,
    pub running: AtomicUsize,
    pub state_bytes: AtomicUsize,
    pub state_slots: AtomicUsize,
    pub cancelled: AtomicUsize,
    pub prompt_tokens: AtomicUsize,
    pub generated_tokens: AtomicUsize,
    /// Decode steps run by the fast decoder (the rest of the decoding ran the generic step).
    pub fast_decode_steps: AtomicUsize,
    /// Steps that ran prompt tokens (of one or more requests, with any decoding beside them),
    /// and their wall time in microseconds.
    pub prefill_steps: AtomicUsize,
    pub prefill_step_micros: AtomicUsize,
    /// Steps that ran only decoding sequences, and their wall time in microseconds.
    pub decode_steps: AtomicUsize,
    pub decode_step_micros: AtomicUsize,
    /// Requests that restored a cached prefix, and those that found none.
    pub prefix_cache_hits: AtomicUsize,
    pub prefix_cache_misses: AtomicUsize,
    /// Prompt tokens restored from the cache instead of prefilled.
    pub prefix_cache_tokens: AtomicUsize,
    /// Snapshots held, their bytes, the byte budget, and evictions so far.
    pub prefix_cache_entries: AtomicUsize,
    pub prefix_cache_bytes: AtomicUsize,
    pub prefix_cache_budget: AtomicUsize,
    pub prefix_cache_evictions: AtomicUsize,
}

/// What an engine step ran.
enum Ran {
    Nothing,
    /// Prompt tokens (with any decoding sequences beside them).
    Prefill,
    /// Only decoding sequences.
    Decode,
}

enum Command {
    Submit(Box<GenerateRequest>, UnboundedSender<Event>),
    /// Stop admitting; finish running requests (drain) or cancel them, then exit.
    Shutdown {
        drain: bool,
    },
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    info: Arc<OnceLock<Result<ModelInfo, LoadFailure>>>,
    /// Set when the engine thread panicked after loading (the engine is gone).
    failed: Arc<OnceLock<String>>,
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
        if self.stopped.load(Ordering::Relaxed) || self.failed.get().is_some() {
            return Err(SubmitError::Stopped);
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.prompt.len() >= max {
            return Err(SubmitError::ContextLength { prompt: req.prompt.len(), max });
        }
        // Every id must index the embedding table: a bad one would fail the whole batch.
        let vocab = self.info.get().and_then(|r| r.as_ref().ok()).map_or(0, |i| i.vocab_size);
        if let Some(&id) = req.prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(SubmitError::InvalidToken { id, vocab });
        }
        // Reserve a place (running or waiting); the engine releases it when the request ends.
        let n = self.stats.in_flight.fetch_add(1, Ordering::SeqCst);
        if n >= self.opts.max_seqs + self.opts.max_queue {
            self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull);
        }
        self.stats.queued.fetch_add(1, Ordering::SeqCst);
        let (etx, erx) = unbounded_channel();
        if self.tx.send(Command::Submit(Box::new(req), etx)).is_err() {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Stopped);
        }
        Ok(erx)
    }

    /// Blocks until the model is loaded (or failed to load).
    pub fn wait_ready(&self) -> Result<ModelInfo, LoadFailure> {
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

    /// Why the engine stopped working after loading (its thread panicked), if it did.
    pub fn failure(&self) -> Option<String> {
        self.failed.get().cloned()
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
    // The options as the engine uses them, which the handle reports.
    let opts = EngineOptions {
        prefill_chunk: opts.prefill_chunk.max(1),
        max_batched_tokens: opts.max_batched_tokens.map(|n| opts.step_tokens(n)),
        ..opts
    };
    let (tx, rx) = channel();
    let info = Arc::new(OnceLock::new());
    let failed = Arc::new(OnceLock::new());
    let stats = Arc::new(EngineStats::default());
    let (info2, failed2, stats2, opts2) = (info.clone(), failed.clone(), stats.clone(), opts.clone());
    let thread = std::thread::Builder::new()
        .name("orchid-engine".into())
        .spawn(move || {
            let loaded = std::panic::catch_unwind(AssertUnwindSafe(|| {
                injected_fault(opts2.inject_fault, Fault::Load);
                load()
            }));
            let (model, fast) = match loaded {
                Ok(Ok(l)) => (l.model, l.fast_decode),
                Ok(Err(e)) => {
                    let _ = info2.set(Err(LoadFailure { message: format!("{e:#}"), bad_model: is_bad_model(&e) }));
                    return;
                }
                Err(p) => {
                    let message = format!("loading the model panicked: {}", panic_message(p.as_ref()));
                    let _ = info2.set(Err(LoadFailure { message, bad_model: false }));
                    return;
                }
            };
            let fast = match fast {
                Some(f) if opts2.fast_decode => {
                    tracing::info!("fast decoding: {}", f.name());
                    Some(f)
                }
                Some(f) => {
                    tracing::info!("fast decoding: {} turned off, generic path", f.name());
                    None
                }
                None => None,
            };
            let max_context = opts2.max_context.min(model.config.max_position_embeddings);
            let max_batched_tokens = opts2.step_tokens(model.backend.default_batched_tokens());
            // The fast decoder's workspace first, so that the state is sized from what is left.
            let mut fast = fast;
            let workspace = match fast.as_mut().map(|f| f.reserve(&model, opts2.max_seqs)) {
                Some(Err(e)) => {
                    tracing::warn!("fast decoding: no workspace set aside ({e})");
                    0
                }
                Some(Ok(bytes)) => bytes,
                None => 0,
            };
            let state_opts = StateOptions {
                max_seqs: opts2.max_seqs,
                max_context,
                memory_utilization: opts2.gpu_memory_utilization,
                kv_tokens: opts2.kv_cache_tokens,
            };
            let mut state = match model.new_state(state_opts) {
                Ok(s) => s,
                Err(e) => {
                    let _ = info2.set(Err(LoadFailure { message: e.to_string(), bad_model: false }));
                    return;
                }
            };
            let cache = if opts2.prefix_cache {
                match state.reserve_prefix_cache(opts2.prefix_cache_bytes) {
                    Ok(budget) => {
                        tracing::info!("prefix cache: on, budget {:.0} MiB", budget as f64 / 1048576.0);
                        stats2.prefix_cache_budget.store(budget, Ordering::Relaxed);
                        Some(PrefixCache::new(budget))
                    }
                    Err(e) => {
                        tracing::warn!("prefix cache: off ({e})");
                        None
                    }
                }
            } else {
                tracing::info!("prefix cache: off");
                None
            };
            if let Some(plan) = state.memory_plan() {
                let gib = |b: usize| b as f64 / 1073741824.0;
                tracing::info!(
                    "memory plan: weights {:.2} GiB; decode workspace {:.2} GiB; {plan}",
                    gib(model.weight_bytes),
                    gib(workspace)
                );
            }
            if let Some(f) = fast.as_mut()
                && let Err(e) = f.warm_up(&model, &mut state, opts2.max_seqs)
            {
                tracing::warn!("{}: warm-up failed ({e}); graphs are captured on first use", f.name());
            }
            let _ = info2.set(Ok(ModelInfo {
                device: model.backend.describe(),
                max_context,
                vocab_size: tokenizer.vocab_size().min(model.config.vocab_size),
                weight_bytes: model.weight_bytes,
                num_layers: model.config.num_layers(),
                max_batched_tokens,
            }));
            let mut e = Engine {
                model,
                state,
                cache,
                fast,
                fast_batches: true,
                tokenizer,
                opts: opts2,
                max_context,
                max_batched_tokens,
                stats: stats2,
                waiting: VecDeque::new(),
                running: Vec::new(),
            };
            if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(|| e.run(rx))) {
                // The engine cannot go on: every request gets an error, the handle says why.
                let msg = format!("the engine thread panicked: {}", panic_message(p.as_ref()));
                tracing::error!("{msg}");
                let _ = failed2.set(msg.clone());
                for s in std::mem::take(&mut e.running) {
                    let _ = s.tx.send(Event::Error(msg.clone()));
                }
                for (_, tx) in std::mem::take(&mut e.waiting) {
                    let _ = tx.send(Event::Error(msg.clone()));
                }
            }
        })
        .expect("spawning the engine thread");
    EngineHandle {
        tx,
        info,
        failed,
        stats,
        opts,
        stopped: Arc::new(AtomicBool::new(false)),
        thread: Arc::new(std::sync::Mutex::new(Some(thread))),
    }
}

struct Seq<S> {
    slot: usize,
    prompt: Vec<u32>,
    /// Prompt tokens already run (restored from the prefix cache or prefilled).
    prefilled: usize,
    /// Prompt tokens restored from the prefix cache.
    cached: usize,
    /// Prompt positions where a snapshot is saved for the prefix cache, ascending.
    save_points: Vec<usize>,
    /// The snapshot at the last block boundary this sequence's generation reached, for the
    /// cache when it finishes: (tokens covered, snapshot).
    pending: Option<(usize, S)>,
    /// The request finished (not failed): its state is whole, and the cache keeps where its
    /// generation ended.
    finished: bool,
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
    /// Inside a budgeted reasoning block (`req.thinking`) whose end token was not seen yet.
    thinking_open: bool,
    /// The request got its last event (finished or failed): a closed channel afterwards is not
    /// a cancellation.
    ended: bool,
    /// The grammar the output follows, if any.
    constraint: Option<Constraint>,
}

impl<S> Seq<S> {
    /// Ends the request with an error (its last event).
    fn fail(&mut self, msg: String) {
        let _ = self.tx.send(Event::Error(msg));
        self.ended = true;
    }
    fn decoding(&self) -> bool {
        self.prefilled == self.prompt.len()
    }
    /// Position of the next token fed to the model.
    fn position(&self) -> usize {
        if self.decoding() { self.prompt.len() + self.generated.len() - 1 } else { self.prefilled }
    }
    /// The token the next step must produce instead of sampling: `</think>` once the thinking
    /// budget is spent.
    fn forced(&self) -> Option<u32> {
        let t = self.req.thinking?;
        (self.thinking_open && self.generated.len() >= t.budget).then_some(t.end_token)
    }
    /// Whether the next token needs the host sampler (a forced token, or end tokens that are
    /// banned until `min_tokens`), so the fast decoder must not pick it.
    fn needs_host(&self) -> bool {
        self.forced().is_some() || self.generated.len() < self.req.min_tokens
    }
    /// The grammar's view of the budget for the next token: (tokens left, this one included;
    /// the whole budget), see [`Constraint::apply`].
    fn grammar_budget(&self, max_context: usize) -> (usize, usize) {
        let budget = self.req.max_tokens.min(max_context - self.prompt.len());
        (budget.saturating_sub(self.generated.len()), budget)
    }
    /// The next token from this sequence's logits row.
    fn next_token(&mut self, logits: &[f32], valid: usize) -> u32 {
        if let Some(t) = self.forced() {
            return t;
        }
        if self.generated.len() < self.req.min_tokens {
            self.sampler.banned.clone_from(&self.req.stop_token_ids);
        } else {
            self.sampler.banned.clear();
        }
        self.sampler.sample(logits, valid)
    }
    /// Tokens of the next prefill span: `chunk` tokens, or up to the end of the prompt. A span
    /// never leaves exactly one prompt token after it (that token would run through the one-token
    /// path, which rounds differently from a longer span). Every op computes a span's rows as a
    /// full prefill would when spans start at multiples of 64 (where a restored full entry ends,
    /// and where spans of a prefill chunk that is a multiple of 64 end), so a restored sequence needs
    /// no chunk alignment with a full prefill: its first token comes after one forward pass.
    /// The pass captures the snapshots at the save points inside the span (`capture_at`), which
    /// must lie a whole number of GDN chunks after its start; the span stops at a save point
    /// that does not (only with a prefill chunk that is not a multiple of 64).
    fn next_span(&self, chunk: usize) -> usize {
        let len = self.prompt.len();
        let mut end = (self.prefilled + chunk).min(len);
        if end + 1 == len {
            end = len;
        }
        if let Some(&p) = self.save_points.iter().find(|&&p| p < end && !(p - self.prefilled).is_multiple_of(GDN_CHUNK)) {
            end = p;
        }
        end - self.prefilled
    }
    /// The save points strictly inside a span of `n` tokens from `prefilled`: the forward pass
    /// captures them.
    fn inner_points(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        self.save_points.iter().copied().filter(move |&p| p < self.prefilled + n)
    }
    /// The first `n` tokens of prompt + generated.
    fn tokens(&self, n: usize) -> Vec<u32> {
        self.prompt.iter().chain(&self.generated).take(n).copied().collect()
    }
}

struct Engine<B: Backend> {
    model: Model<B>,
    state: B::State,
    cache: Option<PrefixCache<B::State>>,
    fast: Option<Box<dyn FastDecode<B>>>,
    /// Whether the fast decoder may be given several sequences (`FastDecode::prepare_batch`).
    fast_batches: bool,
    tokenizer: Arc<Tokenizer>,
    opts: EngineOptions,
    max_context: usize,
    /// Prompt tokens one step runs (the option, or the backend's default).
    max_batched_tokens: usize,
    stats: Arc<EngineStats>,
    waiting: VecDeque<(Box<GenerateRequest>, UnboundedSender<Event>)>,
    running: Vec<Seq<Snapshot<B>>>,
}

type Snapshot<B> = <<B as Backend>::State as StatePool>::Snapshot;

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
                            self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
                            let _ = tx.send(Event::Error("the server is shutting down".into()));
                        } else {
                            self.waiting.push_back((req, tx));
                        }
                    }
                    Command::Shutdown { drain } => draining = Some(drain),
                }
            }
            if draining == Some(false) {
                for mut s in std::mem::take(&mut self.running) {
                    let _ = s.tx.send(Event::Error("the server is shutting down".into()));
                    if let Some((_, snap)) = s.pending.take() {
                        self.state.release(snap);
                    }
                    self.state.free(s.slot);
                    self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
                }
                for (_, tx) in std::mem::take(&mut self.waiting) {
                    self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                    self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
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
                self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let vocab = self.tokenizer.vocab_size().min(self.model.config.vocab_size);
            if let Some(&id) = req.prompt.iter().find(|&&id| id as usize >= vocab) {
                // Checked at submit too; here so that no caller can fail a whole batch.
                self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
                let _ = tx.send(Event::Error(format!("token id {id} is outside the vocabulary (size {vocab})")));
                continue;
            }
            // The KV room the request may reach is promised to it when it starts: until the
            // pool can promise it, it waits (first come, first served).
            let need = (req.prompt.len() + req.max_tokens).min(self.max_context);
            if !self.kv_room(need) {
                if self.running.is_empty() {
                    // Nothing will free room (the pool holds one full-length sequence at least,
                    // so this is not expected).
                    self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                    self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
                    let msg = format!("the request needs {need} positions of KV cache, more than the cache holds");
                    tracing::error!("{msg}");
                    let _ = tx.send(Event::Error(msg));
                    continue;
                }
                self.waiting.push_front((req, tx));
                return;
            }
            let Some(slot) = self.state.alloc() else {
                self.waiting.push_front((req, tx));
                return;
            };
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            self.stats.prompt_tokens.fetch_add(req.prompt.len(), Ordering::Relaxed);
            let mut req = *req;
            let req_thinking = req.thinking.is_some();
            let constraint = req.constraint.take();
            let (cached, save_points) = self.restore_prefix(slot, &req.prompt);
            // After the restore (which takes at most one free block, the copy of a partial last block,
            // and may start the slot afresh).
            self.state.promise(slot, need);
            let fast_ok = device_sampling_ok(&req, self.fast.as_ref().and_then(|f| f.logprobs_cap()));
            let device_seed = req.sampling.seed.unwrap_or_else(|| Rng::from_entropy().next_u64());
            self.running.push(Seq {
                slot,
                prompt: req.prompt.clone(),
                prefilled: cached,
                cached,
                save_points,
                pending: None,
                finished: false,
                generated: Vec::new(),
                sampler: Sampler::new(req.sampling.clone(), &req.prompt).with_bias(req.logit_bias.clone()),
                detok: Detokenizer::with_context(self.tokenizer.clone(), req.skip_special_tokens, &req.prompt),
                stop: StopMatcher::new(req.stop.clone()),
                req,
                tx,
                fast_ok,
                device_seed,
                thinking_open: req_thinking,
                ended: false,
                constraint,
            });
        }
    }

    /// Whether the state pool can promise `need` KV positions to a new sequence. With nothing
    /// running, the prefix cache's blocks are given back first if that is what stands in the way.
    fn kv_room(&mut self, need: usize) -> bool {
        if need <= self.state.free_tokens() {
            return true;
        }
        if self.running.is_empty()
            && let Some(c) = self.cache.as_mut()
        {
            tracing::warn!("prefix cache: cleared to make room in the KV cache for {need} positions");
            c.clear(&mut self.state);
        }
        need <= self.state.free_tokens()
    }

    /// Restores the longest cached prefix of `prompt` into the fresh `slot`; returns the tokens
    /// restored and the prompt positions where snapshots are to be saved.
    fn restore_prefix(&mut self, slot: usize, prompt: &[u32]) -> (usize, Vec<usize>) {
        let Some(cache) = self.cache.as_mut() else { return (0, Vec::new()) };
        let keys = prefix_cache::block_keys(prompt);
        let mut cached = 0;
        if let Some((len, snap)) = cache.lookup(prompt, &keys, prefix_cache::max_restore(prompt.len())) {
            match self.state.restore(slot, snap) {
                Ok(()) => cached = len,
                Err(e) => {
                    // The slot may be half-written: start it afresh.
                    tracing::warn!("prefix cache: restore failed ({e}); prefilling the whole prompt");
                    self.state.free(slot);
                    let again = self.state.alloc();
                    debug_assert_eq!(again, Some(slot));
                }
            }
        }
        let counter = if cached > 0 { &self.stats.prefix_cache_hits } else { &self.stats.prefix_cache_misses };
        counter.fetch_add(1, Ordering::Relaxed);
        self.stats.prefix_cache_tokens.fetch_add(cached, Ordering::Relaxed);
        let seen = cache.seen_blocks(&keys);
        cache.note_seen(&keys);
        let mut points = prefix_cache::save_points(prompt.len(), cached, seen);
        points.retain(|&p| !cache.contains(keys[p / prefix_cache::BLOCK - 1]));
        (cached, points)
    }

    /// After a prefill span of `self.running[i]`: puts the snapshots at the save points it
    /// passed into the cache, those inside the span as the forward pass captured them, the one at
    /// its end saved now.
    fn save_prefixes(&mut self, i: usize) {
        let s = &mut self.running[i];
        let (len, slot) = (s.prefilled, s.slot);
        let passed: Vec<usize> = s.save_points.drain(..s.save_points.partition_point(|&p| p <= len)).collect();
        let Some(cache) = self.cache.as_mut() else { return };
        let mut snaps = Vec::new();
        if passed.first().is_some_and(|&p| p < len) {
            match self.state.take_captures(slot) {
                Ok(c) => snaps = c,
                Err(e) => tracing::warn!("prefix cache: snapshots inside the prefill span failed ({e})"),
            }
        }
        if passed.last() == Some(&len) {
            match self.state.save(slot, len) {
                Ok(snap) => snaps.push((len, snap)),
                Err(e) => tracing::warn!("prefix cache: snapshot at {len} tokens failed ({e})"),
            }
        }
        for (n, snap) in snaps {
            cache.insert(&mut self.state, &self.running[i].tokens(n), snap);
        }
    }

    /// After a decode step of `self.running[i]` (its state now covers `len` tokens): keeps a
    /// snapshot at each block boundary, replacing the previous one, for the cache at the end.
    fn note_decoded(&mut self, i: usize, len: usize) {
        if self.cache.is_none() || !len.is_multiple_of(prefix_cache::BLOCK) {
            return;
        }
        let slot = self.running[i].slot;
        if let Some((_, old)) = self.running[i].pending.take() {
            self.state.release(old);
        }
        match self.state.save(slot, len) {
            Ok(snap) => self.running[i].pending = Some((len, snap)),
            Err(e) => tracing::warn!("prefix cache: snapshot at {len} tokens failed ({e})"),
        }
    }

    /// When a generation finished past its last block boundary: its state where it ended
    /// replaces the snapshot at that boundary, so that a next turn that continues the
    /// conversation prefills only its new tokens. (A request of one token ends where its prompt
    /// does, which the prompt's own snapshot covers.)
    fn save_generation_end(&mut self, s: &mut Seq<Snapshot<B>>) {
        if self.cache.is_none() || !s.finished || !s.decoding() || s.generated.len() < 2 {
            return;
        }
        let len = s.position();
        if len.is_multiple_of(prefix_cache::BLOCK) {
            return;
        }
        match self.state.save(s.slot, len) {
            Ok(snap) => {
                if let Some((_, old)) = s.pending.replace((len, snap)) {
                    self.state.release(old);
                }
            }
            Err(e) => tracing::warn!("prefix cache: snapshot at {len} tokens failed ({e})"),
        }
    }

    /// One engine step, its wall time counted as a prefill step (prompt tokens ran) or a decode
    /// step (only decoding sequences ran).
    fn step(&mut self) {
        let start = Instant::now();
        let micros = match self.run_step() {
            Ran::Nothing => return,
            Ran::Prefill => &self.stats.prefill_step_micros,
            Ran::Decode => &self.stats.decode_step_micros,
        };
        micros.fetch_add(start.elapsed().as_micros() as usize, Ordering::Relaxed);
    }

    /// One forward call over every decoding sequence plus the next prefill chunks.
    fn run_step(&mut self) -> Ran {
        injected_fault(self.opts.inject_fault, Fault::Step);
        // Clients that went away (even mid-prompt) free their slots now.
        let gone: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].tx.is_closed()).collect();
        self.retire(&gone);
        if self.running.is_empty() {
            return Ran::Nothing;
        }
        // The decoding sequences go through the fast decoder when they all can; the forward
        // call below then runs only the prompts being prefilled.
        let decoded = self.fast_step();
        let mut ids = Vec::new();
        let mut spans = Vec::new();
        let mut members = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if s.decoding() && !decoded {
                ids.push(*s.generated.last().expect("a decoding sequence has a sampled token"));
                spans.push(SeqSpan { slot: s.slot, start: s.position(), len: 1 });
                members.push(i);
            }
        }
        // The prompts' next spans, in arrival order, while they fit in the step's budget (the
        // first always runs). A span that does not fit waits for the next step whole: cutting
        // it to the budget would make a prompt's chunk boundaries depend on what else runs.
        let full = self.max_batched_tokens;
        let mut budget = full;
        for (i, s) in self.running.iter().enumerate() {
            if !s.decoding() {
                let n = s.next_span(self.opts.prefill_chunk);
                if n > budget && budget < full {
                    break;
                }
                ids.extend_from_slice(&s.prompt[s.prefilled..s.prefilled + n]);
                spans.push(SeqSpan { slot: s.slot, start: s.prefilled, len: n });
                for p in s.inner_points(n) {
                    if let Err(e) = self.state.capture_at(s.slot, p) {
                        tracing::warn!("prefix cache: snapshot at {p} tokens failed ({e})");
                    }
                }
                members.push(i);
                budget = budget.saturating_sub(n);
                if budget == 0 {
                    break;
                }
            }
        }
        // Counted before the forward call, so before a prompt's first token is sent.
        let ran = match (budget < full, decoded || !spans.is_empty()) {
            (true, _) => Ran::Prefill,
            (false, true) => Ran::Decode,
            (false, false) => Ran::Nothing,
        };
        match ran {
            Ran::Prefill => self.stats.prefill_steps.fetch_add(1, Ordering::Relaxed),
            Ran::Decode => self.stats.decode_steps.fetch_add(1, Ordering::Relaxed),
            Ran::Nothing => 0,
        };
        if spans.is_empty() {
            return ran;
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
                    self.running[i].fail(msg.clone());
                }
                self.retire(&members);
                return ran;
            }
        };
        let v = self.model.config.vocab_size;
        let valid = self.tokenizer.vocab_size().min(v);
        let mut done = Vec::new();
        for (row, (&i, span)) in members.iter().zip(&batch.spans).enumerate() {
            let s = &mut self.running[i];
            if !s.decoding() {
                s.prefilled += span.len;
                self.save_prefixes(i);
                if !self.running[i].decoding() {
                    continue;
                }
            } else {
                self.note_decoded(i, span.start + 1);
            }
            let s = &mut self.running[i];
            let l = &logits[row * v..(row + 1) * v];
            let (remaining, budget) = s.grammar_budget(self.max_context);
            let masked = match &mut s.constraint {
                Some(c) if c.active() => {
                    let mut masked = l[..valid].to_vec();
                    let failed = masks.iter().find(|(j, _)| *j == i || *j == usize::MAX).map(|(_, e)| e.clone());
                    match failed.map_or_else(|| c.apply(&mut masked, remaining, budget), Err) {
                        Ok(()) => Some(masked),
                        Err(e) => {
                            s.fail(format!("constrained decoding failed: {e}"));
                            done.push(i);
                            continue;
                        }
                    }
                }
                _ => None,
            };
            let tok = s.next_token(masked.as_deref().unwrap_or(l), valid);
            // Log-probabilities are those of the model, before any grammar mask.
            let lp = s.req.logprobs.map(|n| logprobs(l, valid, tok, n));
            if !emit(s, tok, lp, self.max_context) {
                done.push(i);
            }
        }
        self.stats.generated_tokens.fetch_add(members.len() - done.len(), Ordering::Relaxed);
        self.retire(&done);
        ran
    }

    /// Decodes every decoding sequence through the fast decoder when all of them can (one
    /// sequence: `FastDecode::step`; several, or any under a grammar, with logit adjustments or
    /// log-probabilities: `step_batch`); false when
    /// the generic step has to decode them (see the module docs).
    fn fast_step(&mut self) -> bool {
        let Some(fast) = self.fast.as_mut() else { return false };
        let rows: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].decoding()).collect();
        if rows.is_empty() || rows.iter().any(|&i| !self.running[i].fast_ok || self.running[i].needs_host()) {
            return false;
        }
        let constrained = rows.iter().any(|&i| self.running[i].constraint.as_ref().is_some_and(|c| c.active()));
        let vocab = self.model.config.vocab_size;
        let valid = self.tokenizer.vocab_size().min(vocab);
        let steps: Vec<DecodeStep> = rows
            .iter()
            .map(|&i| {
                let s = &self.running[i];
                let p = &s.req.sampling;
                DecodeStep {
                    slot: s.slot,
                    token: *s.generated.last().expect("a decoding sequence has a sampled token"),
                    pos: s.position(),
                    index: s.generated.len(),
                    sampling: DeviceSampling {
                        temperature: p.temperature,
                        top_k: p.top_k,
                        top_p: p.top_p,
                        min_p: p.min_p,
                        seed: s.device_seed,
                        valid,
                    },
                    adjust: s.sampler.device_adjust_bound(),
                    logprobs: s.req.logprobs,
                }
            })
            .collect();
        // Several sequences, or one under a grammar, with penalties or a logit bias, or asking for
        // log-probabilities, need the batched step (a lone sequence's `step` takes none of those).
        let adjusted = steps.iter().any(|s| s.adjust > 0);
        let logprobs = steps.iter().any(|s| s.logprobs.is_some());
        let (cap, lp_cap) = (fast.logit_adjust_cap(), fast.logprobs_cap());
        if ((rows.len() > 1 || constrained || adjusted || logprobs) && !self.fast_batches)
            || (constrained && !fast.masks())
            || steps.iter().any(|s| s.adjust > cap || s.logprobs.is_some_and(|n| lp_cap.is_none_or(|c| n > c)))
        {
            return false;
        }
        // The grammar masks of this step, asked for by the decoder once the step's forward pass
        // runs on the device: a mask depends on the token this step feeds in, known only since
        // the previous step's sampling came back, and the device sampler needs it at the end of
        // the step. A mask that fails leaves its row unmasked (the forward pass has advanced every
        // row already); that request ends with the error after the step. Failures: (row, error).
        // The rows' logit adjustments come with them (the counts are known, but building the
        // lists overlaps the forward pass too).
        let mut failed: Vec<(usize, String)> = Vec::new();
        let (running, max_context) = (&mut self.running, self.max_context);
        let mut late = || {
            let adjust = if adjusted { rows.iter().map(|&i| running[i].sampler.device_adjust(valid)).collect() } else { Vec::new() };
            let mut masks = Vec::with_capacity(rows.len());
            for (row, &i) in rows.iter().enumerate() {
                let s = &mut running[i];
                let (remaining, budget) = s.grammar_budget(max_context);
                match s.constraint.as_mut().map(|c| c.mask_words(remaining, budget, valid, vocab)) {
                    None => masks.push(None),
                    Some(Ok(m)) => masks.push(m),
                    Some(Err(e)) => {
                        failed.push((row, e));
                        masks.push(None);
                    }
                }
            }
            LateInputs { masks, adjust }
        };
        let ran = if let ([step], false, false, false) = (steps.as_slice(), constrained, adjusted, logprobs) {
            if let Err(e) = fast.prepare(&self.model, &mut self.state, step.slot, &step.sampling) {
                tracing::warn!("{} is not usable ({e}); decoding on the generic path from now on", fast.name());
                self.fast = None;
                return false;
            }
            fast.step(&self.model, &mut self.state, step).map(|t| vec![t])
        } else {
            if let Err(e) = fast.prepare_batch(&self.model, &mut self.state, &steps) {
                tracing::warn!("{} cannot decode batches ({e}); batches run on the generic path from now on", fast.name());
                self.fast_batches = false;
                return false;
            }
            fast.step_batch(&self.model, &mut self.state, &steps, &mut late)
        };
        match ran {
            Ok(sampled) => {
                self.stats.fast_decode_steps.fetch_add(rows.len(), Ordering::Relaxed);
                let mut done = Vec::new();
                for (row, ((&i, step), out)) in rows.iter().zip(&steps).zip(sampled).enumerate() {
                    self.note_decoded(i, step.pos + 1);
                    let s = &mut self.running[i];
                    if let Some((_, e)) = failed.iter().find(|(r, _)| *r == row) {
                        s.fail(format!("constrained decoding failed: {e}"));
                        done.push(i);
                    } else if emit(s, out.token, out.logprob, self.max_context) {
                        // Counted as the generic step counts (a token of a sequence that goes on).
                        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
                    } else {
                        done.push(i);
                    }
                }
                self.retire(&done);
            }
            Err(e) => {
                let msg = format!("inference failed: {e}");
                tracing::error!("{msg} ({})", fast.name());
                for &i in &rows {
                    self.running[i].fail(msg.clone());
                }
                self.retire(&rows);
            }
        }
        true
    }

    /// Frees the slots of finished or failed sequences.
    fn retire(&mut self, idx: &[usize]) {
        let mut idx = idx.to_vec();
        idx.sort_unstable();
        for &i in idx.iter().rev() {
            let mut s = self.running.remove(i);
            if !s.ended && s.tx.is_closed() {
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            self.save_generation_end(&mut s);
            if let Some((len, snap)) = s.pending.take() {
                match self.cache.as_mut() {
                    Some(c) => c.insert(&mut self.state, &s.tokens(len), snap),
                    None => self.state.release(snap),
                }
            }
            self.state.free(s.slot);
            self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn publish_stats(&self) {
        self.stats.running.store(self.running.len(), Ordering::Relaxed);
        self.stats.state_bytes.store(self.state.bytes_in_use(), Ordering::Relaxed);
        self.stats.state_slots.store(self.state.capacity(), Ordering::Relaxed);
        if let Some(c) = &self.cache {
            let n = c.counts();
            self.stats.prefix_cache_entries.store(n.entries, Ordering::Relaxed);
            self.stats.prefix_cache_bytes.store(n.bytes, Ordering::Relaxed);
            self.stats.prefix_cache_evictions.store(n.evictions, Ordering::Relaxed);
        }
    }
}

/// Whether the fast decoder's device sampler can serve `req` as the host sampler would: finite
/// parameters (temperature, top-k, top-p, min-p and the seed are what it implements; finite
/// penalties and logit biases reach it as per-token lists, see `Sampler::device_adjust`), and
/// logprobs only within the decoder's `logprobs_cap` (None: it computes none). Forced and banned
/// tokens (thinking budget, `min_tokens`), and whether the decoder takes the step's adjustment
/// list, are decided per step: those steps run the generic path.
pub fn device_sampling_ok(req: &GenerateRequest, logprobs_cap: Option<usize>) -> bool {
    let p: &SamplingParams = &req.sampling;
    req.logprobs.is_none_or(|n| logprobs_cap.is_some_and(|c| n <= c))
        && req.logit_bias.values().all(|b| b.is_finite())
        && p.repetition_penalty.is_finite()
        && p.repetition_penalty > 0.0
        && p.presence_penalty.is_finite()
        && p.frequency_penalty.is_finite()
        && (p.is_greedy() || (p.temperature.is_finite() && p.top_p.is_finite() && p.min_p.is_finite()))
}

/// Computes the next-token grammar masks of the running sequences that will sample this step
/// (run on a helper thread during the forward call); returns the failures by sequence index.
fn prepare_masks<S>(running: &mut [Seq<S>]) -> Vec<(usize, String)> {
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
fn emit<S>(s: &mut Seq<S>, tok: u32, lp: Option<crate::sampling::TokenLogprob>, max_context: usize) -> bool {
    s.sampler.observe(tok);
    s.generated.push(tok);
    if s.req.thinking.is_some_and(|t| t.end_token == tok) {
        s.thinking_open = false;
    }
    let usage = Usage { prompt_tokens: s.prompt.len(), completion_tokens: s.generated.len(), cached_tokens: s.cached };
    let finish = |s: &mut Seq<S>, reason: FinishReason, text: String| {
        let stop_reason = match reason {
            FinishReason::Length => None,
            FinishReason::Stop => match s.stop.matched() {
                Some(m) => Some(StopReason::Text(m.to_string())),
                None => Some(StopReason::Token(tok)),
            },
        };
        let _ = s.tx.send(Event::Finished { reason, text, usage, stop_reason });
        s.ended = true;
        s.finished = true;
        false
    };
    // The text before a matched stop string, plus the stop string when the request keeps it.
    let stopped = |s: &Seq<S>, t: String| match s.stop.matched() {
        Some(m) if s.req.include_stop_str => t + m,
        _ => t,
    };
    let grammar_end = match s.constraint.as_mut().map(|c| c.observe(tok)) {
        None | Some(Ok(false)) => false,
        Some(Ok(true)) => true,
        Some(Err(e)) => {
            s.fail(format!("constrained decoding failed: {e}"));
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
            StopOutcome::Stopped(t) => stopped(s, t),
        };
        return finish(s, FinishReason::Stop, text);
    }
    let piece = s.detok.push(tok);
    match s.stop.push(&piece) {
        StopOutcome::Stopped(t) => {
            let t = stopped(s, t);
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
                StopOutcome::Stopped(t) => {
                    let t = stopped(s, t);
                    finish(s, FinishReason::Stop, t)
                }
                StopOutcome::Continue(t) => {
                    let text = t + &s.stop.flush();
                    finish(s, FinishReason::Length, text)
                }
            }
        }
    }
}
