//! The prefix cache on CUDA (GDN states copied on the device, KV blocks shared by reference),
//! end to end through `orchid_engine::engine` on the bundled model (models/orchid-tiny, read from
//! the repository root or this crate's checkout). Skipped without a GPU.
//!
//! The same greedy requests run on an engine with the cache on and one with it off: a prompt and
//! its repeat, a longer prompt extending it, a prompt sharing part of the first (its snapshot at
//! the shared part's end is captured inside a prefill span) and one restoring that snapshot, four
//! concurrent requests sharing a prefix, the next turn after a finished generation, then a request
//! cancelled mid-generation. Tokens must agree; a restored request's prefill spans start at the
//! restored length, unlike a full prefill's, which may change bf16 rounding on the GPU, so at a
//! first differing token the difference is accepted only if the cache-off run's top-2
//! log-probabilities there are within 0.05 of each other (a near tie). Cached-token counts must be the block-aligned
//! ones; after everything finished, no state is held by sequences. Prints `PARITY PASS|FAIL ...`.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::gpu;
use orchid_engine::Tokenizer;
use orchid_engine::engine::{EngineHandle, EngineOptions, spawn};
use orchid_engine::request::{Event, GenerateRequest};

const NEAR_TIE: f32 = 0.05;

fn model_dir() -> PathBuf {
    let local = PathBuf::from("models/orchid-tiny");
    if local.join("config.json").is_file() { local } else { PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/orchid-tiny") }
}

fn start(g: &orchid_cuda::CudaBackend, cache: bool) -> (EngineHandle, Arc<Tokenizer>) {
    let dir = model_dir();
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let opts = EngineOptions {
        max_seqs: 4,
        max_context: 1024,
        prefill_chunk: 128,
        max_queue: 16,
        fast_decode: false,
        prefix_cache: cache,
        prefix_cache_bytes: Some(256 << 20),
        inject_fault: None,
        ..Default::default()
    };
    let g = g.clone();
    let e = spawn(opts, tok.clone(), move || Ok(orchid_model::load_model(&dir, g)?));
    e.wait_ready().expect("the engine loads");
    (e, tok)
}

#[derive(Debug, Default, Clone)]
struct Out {
    tokens: Vec<u32>,
    /// Per token: the top-2 log-probabilities.
    top2: Vec<(f32, f32)>,
    cached: usize,
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Out {
    let mut o = Out::default();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match rx.try_recv() {
            Ok(Event::Token { id, logprob, .. }) => {
                o.tokens.push(id);
                let lp = logprob.expect("asked for");
                let t: Vec<f32> = lp.top.iter().map(|x| x.1).collect();
                o.top2.push((t.first().copied().unwrap_or(0.0), t.get(1).copied().unwrap_or(f32::NEG_INFINITY)));
            }
            Ok(Event::Finished { usage, .. }) => {
                o.cached = usage.cached_tokens;
                return o;
            }
            Ok(Event::Error(e)) => panic!("generation failed: {e}"),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "timed out");
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

fn request(ids: &[u32], max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(ids.to_vec());
    r.max_tokens = max_tokens;
    r.logprobs = Some(2);
    r.sampling.temperature = 0.0;
    r
}

fn run(e: &EngineHandle, ids: &[u32], n: usize) -> Out {
    collect(e.submit(request(ids, n)).unwrap())
}

fn ids(tok: &Tokenizer, seed: u64, n: usize) -> Vec<u32> {
    let words = ["the", "river", "ran", "past", "a", "quiet", "town", "where", "old", "bakers", "sang", "at", "dawn", "and", "children"];
    let (mut s, mut x) = (String::new(), seed * 2654435761 + 1);
    while tok.encode(&s, false).unwrap().len() < n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        s.push_str(words[(x >> 33) as usize % words.len()]);
        s.push(' ');
    }
    let mut v = tok.encode(&s, false).unwrap();
    v.truncate(n);
    v
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().chain(b).copied().collect()
}

/// Same tokens, or a first difference at a near tie of the cache-off run.
fn agree(name: &str, on: &Out, off: &Out, want_cached: usize, fails: &mut usize) {
    let first = on.tokens.iter().zip(&off.tokens).position(|(a, b)| a != b);
    let (ok, what) = match first {
        None if on.tokens.len() == off.tokens.len() => (true, "same tokens".to_string()),
        None => (false, "different lengths".to_string()),
        Some(i) => {
            let (a, b) = off.top2[i];
            ((a - b).abs() <= NEAR_TIE, format!("first difference at token {i}, top-2 log-prob gap {:.4}", (a - b).abs()))
        }
    };
    let ok = ok && on.cached == want_cached;
    *fails += !ok as usize;
    println!("PARITY {} prefix-cache {name}: {what}; cached {} (want {want_cached})", if ok { "PASS" } else { "FAIL" }, on.cached);
}

/// `prompts` submitted at once (so that they decode as one batch), each for `max_tokens`.
fn together(e: &EngineHandle, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Out> {
    let rxs: Vec<_> = prompts.iter().map(|p| e.submit(request(p, max_tokens)).unwrap()).collect();
    rxs.into_iter().map(collect).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefix_cache_matches_no_cache() {
    let g = gpu();
    let (on, tok) = start(&g, true);
    let (off, _) = start(&g, false);
    let mut fails = 0;
    let base = ids(&tok, 1, 300);
    let longer = cat(&base, &ids(&tok, 2, 90));
    // Sharing 200 tokens: snapshots at 192 (inside the span [128, 256)) and 256; the next one hits 192.
    let shares = cat(&base[..200], &ids(&tok, 3, 70));
    let again = cat(&base[..200], &ids(&tok, 4, 70));
    for (name, p, want) in [
        ("first", &base, 0),
        ("repeat", &base, 256),
        ("extends", &longer, 256),
        ("shares 200, first", &shares, 0),
        ("shares 200, again", &again, 192),
    ] {
        agree(name, &run(&on, p, 16), &run(&off, p, 16), want, &mut fails);
    }
    // Four concurrent requests restoring the same shared KV blocks.
    let system = ids(&tok, 7, 266);
    run(&on, &cat(&system, &ids(&tok, 8, 20)), 2);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| cat(&system, &ids(&tok, 20 + i, 15 + 7 * i as usize))).collect();
    // The cache-off side runs them concurrently too: the same batch of four decodes in both, so
    // the rows' kernels (whose rounding, and with it a router's near-tie, depends on the batch)
    // are the same and only the cache differs.
    let (outs, refs) = (together(&on, &prompts, 24), together(&off, &prompts, 24));
    for (i, (o, r)) in outs.iter().zip(&refs).enumerate() {
        agree(&format!("concurrent {i}"), o, r, 256, &mut fails);
    }
    // The next turn finds the snapshot where the generation ended: prompt + 89 fed tokens = 189,
    // inside a KV block. Two different next turns at once: each restores that block into a copy
    // of its own and writes its new tokens there.
    let prompt = ids(&tok, 5, 100);
    let first = run(&on, &prompt, 90);
    let nexts: Vec<Vec<u32>> = [6, 9].iter().map(|&seed| cat(&cat(&prompt, &first.tokens), &ids(&tok, seed, 30))).collect();
    let (outs, refs) = (together(&on, &nexts, 16), together(&off, &nexts, 16));
    for (i, (o, r)) in outs.iter().zip(&refs).enumerate() {
        agree(&format!("next turn {i}"), o, r, 189, &mut fails);
    }
    // A cancelled request gives its blocks back.
    let mut rx = on.submit(request(&base, 500)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(rx.try_recv(), Ok(Event::Token { .. })) {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_micros(200));
    }
    drop(rx);
    let st = on.stats();
    while st.running.load(Ordering::Relaxed) != 0 || st.state_bytes.load(Ordering::Relaxed) != 0 {
        assert!(Instant::now() < deadline, "the cancelled request kept its state");
        std::thread::sleep(Duration::from_millis(2));
    }
    agree("after cancel", &run(&on, &base, 16), &run(&off, &base, 16), 256, &mut fails);
    let bytes = st.prefix_cache_bytes.load(Ordering::Relaxed);
    let ok = bytes > 0 && bytes <= 256 << 20 && st.prefix_cache_hits.load(Ordering::Relaxed) >= 8;
    fails += !ok as usize;
    println!(
        "PARITY {} prefix-cache accounting: {bytes} bytes held, {} hits",
        if ok { "PASS" } else { "FAIL" },
        st.prefix_cache_hits.load(Ordering::Relaxed)
    );
    on.shutdown(false);
    off.shutdown(false);
    assert_eq!(fails, 0, "prefix-cache parity failures");
}
