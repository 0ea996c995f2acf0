//! The step's prompt-token budget (`EngineOptions::max_batched_tokens`) and the per-request
//! chunk (`prefill_chunk`), on the CPU backend with the bundled model: prompts that arrive
//! together are prefilled together while their spans fit in the budget, a long prompt still
//! advances one chunk per step, and greedy output is the same as with a budget of one chunk.
//! Steps and their time are counted as prefill steps (prompt tokens ran) or decode steps.
//!
//! To make requests arrive together, a first request takes all the KV room (prompt +
//! max_tokens up to the context), so the others wait in the queue until it ends and are then
//! admitted in the same step.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use orchid_cpu::CpuBackend;
use orchid_engine::Tokenizer;
use orchid_engine::engine::{EngineHandle, EngineOptions, spawn};
use orchid_engine::request::{Event, GenerateRequest};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::mpsc::error::TryRecvError;

const MAX_CONTEXT: usize = 128;
const CHUNK: usize = 8;

fn start(prefill_chunk: usize, max_batched_tokens: usize) -> EngineHandle {
    start_with(prefill_chunk, Some(max_batched_tokens))
}

fn start_with(prefill_chunk: usize, max_batched_tokens: Option<usize>) -> EngineHandle {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/orchid-tiny");
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let opts = EngineOptions {
        max_seqs: 4,
        max_context: MAX_CONTEXT,
        prefill_chunk,
        max_batched_tokens,
        max_queue: 8,
        fast_decode: false,
        prefix_cache: false,
        kv_cache_tokens: Some(MAX_CONTEXT),
        ..Default::default()
    };
    spawn(opts, tok, move || Ok(orchid_model::load_model(&dir, CpuBackend::new())?))
}

/// A greedy request with a prompt of `len` tokens that runs to `max_tokens`.
fn request(seed: u32, len: usize, max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new((0..len as u32).map(|i| 100 + (i * 7 + seed * 13) % 500).collect());
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0.0;
    r
}

/// The tokens of one request's stream; panics on an error.
fn collect(mut rx: UnboundedReceiver<Event>) -> Vec<u32> {
    let mut tokens = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        match rx.try_recv() {
            Ok(Event::Token { id, .. }) => tokens.push(id),
            Ok(Event::Finished { .. }) => return tokens,
            Ok(Event::Error(e)) => panic!("generation failed: {e}"),
            Err(TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "timed out");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TryRecvError::Disconnected) => panic!("the stream ended without a result"),
        }
    }
}

/// Runs requests of the given (prompt length, max_tokens) that are admitted together, behind a
/// first request that holds all the KV room. Returns every request's tokens (the first one's
/// first) and how many steps ran prompt tokens after the first request's own prefill.
fn run_together(prefill_chunk: usize, max_batched_tokens: usize, reqs: &[(usize, usize)]) -> (Vec<Vec<u32>>, usize) {
    let e = start(prefill_chunk, max_batched_tokens);
    e.wait_ready().unwrap();
    let gate = e.submit(request(99, CHUNK, MAX_CONTEXT)).unwrap();
    let rxs: Vec<_> = reqs.iter().enumerate().map(|(i, &(len, max))| e.submit(request(i as u32, len, max)).unwrap()).collect();
    let outs: Vec<Vec<u32>> = std::iter::once(gate).chain(rxs).map(collect).collect();
    assert_eq!(outs[0].len(), MAX_CONTEXT - CHUNK, "the first request ran to the context");
    let steps = e.stats().prefill_steps.load(Ordering::SeqCst) - 1;
    assert!(e.failure().is_none());
    e.shutdown(false);
    (outs, steps)
}

#[test]
fn short_prompts_arriving_together_are_prefilled_in_one_step() {
    let reqs = [(CHUNK, 8); 4];
    let (shared, steps) = run_together(CHUNK, 4 * CHUNK, &reqs);
    assert_eq!(steps, 1, "four one-chunk prompts fit in one step's budget");
    let (alone, steps) = run_together(CHUNK, CHUNK, &reqs);
    assert_eq!(steps, 4, "a budget of one chunk runs one prompt per step");
    assert_eq!(shared, alone, "sharing a step changed the greedy output");
}

#[test]
fn a_long_prompt_advances_one_chunk_per_step_beside_short_ones() {
    // A prompt of five chunks first, then three of one chunk: the first step runs a chunk of
    // each (the budget's four chunks), the long one then takes four more steps.
    let reqs = [(5 * CHUNK, 8), (CHUNK, 8), (CHUNK, 8), (CHUNK, 8)];
    let (shared, steps) = run_together(CHUNK, 4 * CHUNK, &reqs);
    assert_eq!(steps, 5);
    // One chunk per step: the long prompt's five, then the three short ones.
    let (alone, steps) = run_together(CHUNK, CHUNK, &reqs);
    assert_eq!(steps, 8);
    assert_eq!(shared, alone, "sharing a step changed the greedy output");
}

#[test]
fn a_lone_long_prompt_takes_one_chunk_per_step() {
    let e = start(CHUNK, 4 * CHUNK);
    e.wait_ready().unwrap();
    let rx = e.submit(request(0, 5 * CHUNK, 4)).unwrap();
    assert_eq!(collect(rx).len(), 4);
    assert_eq!(e.stats().prefill_steps.load(Ordering::SeqCst), 5, "a budget of four chunks ran a prompt of five in five steps");
    e.shutdown(false);
}

#[test]
fn the_budget_is_at_least_one_chunk() {
    let e = start(CHUNK, CHUNK / 2);
    assert_eq!(e.options().prefill_chunk, CHUNK);
    assert_eq!(e.options().max_batched_tokens, Some(CHUNK));
    e.wait_ready().unwrap();
    let rx = e.submit(request(0, 3 * CHUNK, 4)).unwrap();
    assert_eq!(collect(rx).len(), 4);
    assert_eq!(e.stats().prefill_steps.load(Ordering::SeqCst), 3);
    e.shutdown(false);
    let e = start(0, 0);
    assert_eq!((e.options().prefill_chunk, e.options().max_batched_tokens), (1, Some(1)));
    assert_eq!(e.wait_ready().unwrap().max_batched_tokens, 1);
    e.shutdown(false);
}

#[test]
fn no_budget_takes_the_backends() {
    let e = start_with(CHUNK, None);
    assert_eq!(e.wait_ready().unwrap().max_batched_tokens, 2048, "the host's default");
    e.shutdown(false);
    let e = start_with(4096, None);
    assert_eq!(e.wait_ready().unwrap().max_batched_tokens, 4096, "raised to the chunk");
    e.shutdown(false);
}

#[test]
fn step_time_is_counted_by_kind() {
    let e = start(CHUNK, 4 * CHUNK);
    e.wait_ready().unwrap();
    let rx = e.submit(request(0, 2 * CHUNK, 6)).unwrap();
    assert_eq!(collect(rx).len(), 6);
    // Two steps of prompt tokens (the second samples the first token), then five of decoding;
    // each step's time is added once it returns.
    let st = e.stats();
    let load = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(30);
    while (load(&st.decode_steps) < 5 || load(&st.decode_step_micros) == 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!((load(&st.prefill_steps), load(&st.decode_steps)), (2, 5));
    assert!(load(&st.prefill_step_micros) > 0 && load(&st.decode_step_micros) > 0);
    e.shutdown(false);
}
