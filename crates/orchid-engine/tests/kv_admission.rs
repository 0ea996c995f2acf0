//! Admission by KV room, on the CPU backend with the bundled model and a KV cache limited to a
//! few hundred positions (`EngineOptions::kv_cache_tokens`): a request starts only when its
//! prompt + max_tokens fit in the room not promised to running requests, else it waits in the
//! queue (and the queue's limit still answers `QueueFull`); every request then finishes, none
//! fails and nothing panics. A cache smaller than one full-length sequence fails at start.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use orchid_cpu::CpuBackend;
use orchid_engine::Tokenizer;
use orchid_engine::engine::{EngineHandle, EngineOptions, spawn};
use orchid_engine::request::{Event, FinishReason, GenerateRequest, SubmitError};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::mpsc::error::TryRecvError;

const MAX_CONTEXT: usize = 256;

fn start(kv_tokens: usize, max_queue: usize, prefix_cache: bool) -> EngineHandle {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/orchid-tiny");
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let opts = EngineOptions {
        max_seqs: 4,
        max_context: MAX_CONTEXT,
        prefill_chunk: 64,
        max_queue,
        fast_decode: false,
        prefix_cache,
        kv_cache_tokens: Some(kv_tokens),
        ..Default::default()
    };
    spawn(opts, tok, move || Ok(orchid_model::load_model(&dir, CpuBackend::new())?))
}

/// A greedy request that runs to `max_tokens` (no stop tokens).
fn request(seed: u32, prompt_len: usize, max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new((0..prompt_len as u32).map(|i| 100 + (i * 7 + seed * 13) % 500).collect());
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0.0;
    r
}

/// What one request's stream showed, as seen by polling all streams in turn.
#[derive(Default)]
struct Seen {
    tokens: usize,
    finished: bool,
    /// Requests (by index) that had finished when this one's first token arrived.
    finished_before_first: Vec<usize>,
}

/// Polls the streams until all end; panics on an error event. Events of one engine step reach
/// their channels in order, so a finished request that a later first token depends on is
/// already finished in `Seen` when that token is read (the channels are drained in index
/// order, and each poll drains every channel).
fn drain(mut rxs: Vec<UnboundedReceiver<Event>>) -> Vec<Seen> {
    let mut seen: Vec<Seen> = rxs.iter().map(|_| Seen::default()).collect();
    let deadline = Instant::now() + Duration::from_secs(300);
    while seen.iter().any(|s| !s.finished) {
        assert!(Instant::now() < deadline, "timed out");
        let mut progress = false;
        for i in 0..rxs.len() {
            if seen[i].finished {
                continue;
            }
            match rxs[i].try_recv() {
                Ok(Event::Token { .. }) => {
                    if seen[i].tokens == 0 {
                        // Whatever finished before this token was sent is in its channel by now.
                        for j in 0..rxs.len() {
                            while !seen[j].finished && j != i {
                                match rxs[j].try_recv() {
                                    Ok(Event::Token { .. }) => seen[j].tokens += 1,
                                    Ok(Event::Finished { reason, usage, .. }) => {
                                        assert_eq!(reason, FinishReason::Length);
                                        assert_eq!(usage.completion_tokens, seen[j].tokens);
                                        seen[j].finished = true;
                                    }
                                    Ok(Event::Error(e)) => panic!("request {j} failed: {e}"),
                                    Err(_) => break,
                                }
                            }
                        }
                        seen[i].finished_before_first = (0..rxs.len()).filter(|&j| seen[j].finished).collect();
                    }
                    seen[i].tokens += 1;
                    progress = true;
                }
                Ok(Event::Finished { reason, usage, .. }) => {
                    assert_eq!(reason, FinishReason::Length);
                    assert_eq!(usage.completion_tokens, seen[i].tokens);
                    seen[i].finished = true;
                    progress = true;
                }
                Ok(Event::Error(e)) => panic!("request {i} failed: {e}"),
                Err(TryRecvError::Empty) => {}
                Err(TryRecvError::Disconnected) => panic!("request {i}: the stream ended without a result"),
            }
        }
        if !progress {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    seen
}

#[test]
fn requests_wait_for_kv_room_then_all_finish() {
    // Room for 300 positions: one request of 20 + 200 at a time.
    let e = start(300, 8, true);
    e.wait_ready().unwrap();
    let rxs: Vec<_> = (0..3).map(|i| e.submit(request(i, 20, 200)).unwrap()).collect();
    let seen = drain(rxs);
    for (i, s) in seen.iter().enumerate() {
        assert_eq!(s.tokens, 200, "request {i}");
        // One at a time, first come first served: each started after all earlier ones ended.
        assert_eq!(s.finished_before_first, (0..i).collect::<Vec<_>>(), "request {i}");
    }
    assert!(e.failure().is_none());
    // A request is counted out when its slot is freed, just after its last event (and, with the
    // prefix cache, the snapshot where its generation ended).
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.stats().in_flight.load(Ordering::SeqCst) != 0 {
        assert!(Instant::now() < deadline, "a finished request stayed in flight");
        std::thread::sleep(Duration::from_millis(1));
    }
    e.shutdown(false);
}

#[test]
fn requests_that_fit_together_run_together() {
    // 2 × (20 + 100) = 240 <= 256: both run at once; a third waits for room.
    let e = start(MAX_CONTEXT, 8, false);
    e.wait_ready().unwrap();
    let rxs: Vec<_> = (0..3).map(|i| e.submit(request(i, 20, 100)).unwrap()).collect();
    let seen = drain(rxs);
    assert!(seen.iter().all(|s| s.tokens == 100));
    assert!(seen[1].finished_before_first.is_empty(), "the second request ran alongside the first");
    assert!(!seen[2].finished_before_first.is_empty(), "the third request waited for room");
    assert!(e.failure().is_none());
    e.shutdown(false);
}

#[test]
fn the_queue_limit_still_applies_while_requests_wait_for_room() {
    // max_seqs 4 + max_queue 1: five requests accepted, the sixth refused; one runs at a time.
    let e = start(MAX_CONTEXT, 1, true);
    e.wait_ready().unwrap();
    let rxs: Vec<_> = (0..5).map(|i| e.submit(request(i, 30, 150)).unwrap()).collect();
    assert!(matches!(e.submit(request(9, 30, 150)), Err(SubmitError::QueueFull)));
    // A request of the full context (prompt + max_tokens beyond it are cut to the context).
    let seen = drain(rxs);
    for (i, s) in seen.iter().enumerate() {
        assert_eq!(s.tokens, 150, "request {i}");
        assert_eq!(s.finished_before_first, (0..i).collect::<Vec<_>>(), "request {i}");
    }
    let long = e.submit(request(7, 200, 10_000)).unwrap();
    let seen = drain(vec![long]);
    assert_eq!(seen[0].tokens, MAX_CONTEXT - 200);
    assert!(e.failure().is_none());
    e.shutdown(false);
}

#[test]
fn a_kv_cache_smaller_than_one_sequence_fails_at_start() {
    let e = start(MAX_CONTEXT - 1, 8, true);
    let err = e.wait_ready().unwrap_err();
    assert!(!err.bad_model);
    assert!(err.message.contains("255 positions") && err.message.contains("256"), "{}", err.message);
    assert!(matches!(e.submit(request(0, 10, 10)), Err(SubmitError::Stopped)));
}
