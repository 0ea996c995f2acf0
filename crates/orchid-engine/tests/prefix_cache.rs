//! The prefix cache on the CPU backend with the bundled model: greedy output (tokens and
//! log-probabilities) is bit-identical with the cache on and off, whether a prompt repeats, extends
//! an earlier one, continues a finished generation or shares a prefix with concurrent requests;
//! cached-token counts are what the block alignment gives; a snapshot captured inside a forward
//! pass is bit for bit the one a pass ending there saves, and taking snapshots adds no forward
//! pass; a tiny budget evicts and stays within it; a cancelled request leaves nothing behind.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use orchid_cpu::CpuBackend;
use orchid_cpu::state::SeqState;
use orchid_engine::Tokenizer;
use orchid_engine::engine::{EngineHandle, EngineOptions, spawn};
use orchid_engine::prefix_cache::{BLOCK, max_restore};
use orchid_engine::request::{Event, GenerateRequest};
use orchid_model::{BatchLayout, LogitRows, SeqSpan, StateOptions, StatePool};

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/orchid-tiny")
}

fn start(cache: bool, budget: Option<usize>) -> (EngineHandle, Arc<Tokenizer>) {
    start_with(cache, budget, 128)
}

fn start_with(cache: bool, budget: Option<usize>, prefill_chunk: usize) -> (EngineHandle, Arc<Tokenizer>) {
    let dir = model_dir();
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let opts = EngineOptions {
        max_seqs: 4,
        max_context: 1024,
        prefill_chunk,
        max_queue: 16,
        fast_decode: false,
        prefix_cache: cache,
        prefix_cache_bytes: budget,
        inject_fault: None,
        ..Default::default()
    };
    let e = spawn(opts, tok.clone(), move || Ok(orchid_model::load_model(&dir, CpuBackend::new())?));
    e.wait_ready().unwrap();
    (e, tok)
}

/// Generated tokens, their log-probabilities (as bits), and the cached-token count.
#[derive(Debug, Default, Clone, PartialEq)]
struct Out {
    tokens: Vec<u32>,
    logprobs: Vec<u32>,
    cached: usize,
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Out {
    let mut o = Out::default();
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        match rx.try_recv() {
            Ok(Event::Token { id, logprob, .. }) => {
                o.tokens.push(id);
                o.logprobs.push(logprob.expect("asked for").logprob.to_bits());
            }
            Ok(Event::Finished { usage, .. }) => {
                o.cached = usage.cached_tokens;
                return o;
            }
            Ok(Event::Error(e)) => panic!("generation failed: {e}"),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(std::time::Instant::now() < deadline, "timed out");
                std::thread::sleep(Duration::from_millis(1));
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

fn run(e: &EngineHandle, ids: &[u32], max_tokens: usize) -> Out {
    collect(e.submit(request(ids, max_tokens)).unwrap())
}

/// A prompt of at least `n` tokens (then cut to `n`), different for each `seed`.
fn text_ids(tok: &Tokenizer, seed: usize, n: usize) -> Vec<u32> {
    let words = ["the", "river", "ran", "past", "a", "quiet", "town", "where", "old", "bakers", "sang", "at", "dawn", "and", "children"];
    let mut s = String::new();
    let mut x = seed as u64 * 2654435761 + 1;
    while tok.encode(&s, false).unwrap().len() < n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        s.push_str(words[(x >> 33) as usize % words.len()]);
        s.push(if (x >> 20).is_multiple_of(9) { '.' } else { ' ' });
    }
    let mut ids = tok.encode(&s, false).unwrap();
    ids.truncate(n);
    ids
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().chain(b).copied().collect()
}

#[test]
fn greedy_output_is_bit_identical_with_the_cache_on_and_off() {
    let (on, tok) = start(true, None);
    let (off, _) = start(false, None);
    let base = text_ids(&tok, 1, 300);
    let longer = cat(&base, &text_ids(&tok, 2, 90));
    let other = cat(&base[..200], &text_ids(&tok, 3, 70));
    let cases: Vec<(&str, Vec<u32>, usize)> = vec![
        // First sight: nothing cached; snapshots at the prompt's last block boundary (256).
        ("first", base.clone(), 0),
        // The same prompt again restores 256 (a restore leaves at least two tokens to run).
        ("repeat", base.clone(), 256),
        // A longer prompt restores the first one's 256.
        ("extends", longer.clone(), 256),
        // Shares 200 tokens: the last common block boundary is 192, no snapshot there yet.
        ("shares 200, first", other.clone(), 0),
        // base saved one at 192 when `other` showed the shared part? No: `other` did (its own
        // prefix that earlier prompts had too), so base's relatives now hit at 192.
        ("shares 200, again", cat(&base[..200], &text_ids(&tok, 4, 70)), 192),
    ];
    for (name, ids, want_cached) in &cases {
        let a = run(&on, ids, 12);
        let b = run(&off, ids, 12);
        assert_eq!(a.cached, *want_cached, "{name}: cached tokens");
        assert_eq!(b.cached, 0, "{name}: cache off");
        assert_eq!((a.tokens.clone(), a.logprobs.clone()), (b.tokens, b.logprobs), "{name}: output differs with the cache on");
    }
    let st = on.stats();
    assert_eq!(st.prefix_cache_hits.load(Ordering::Relaxed), 3);
    assert_eq!(st.prefix_cache_misses.load(Ordering::Relaxed), 2);
    assert_eq!(st.prefix_cache_tokens.load(Ordering::Relaxed), 256 + 256 + 192);
    assert!(st.prefix_cache_bytes.load(Ordering::Relaxed) > 0);
    assert_eq!(off.stats().prefix_cache_entries.load(Ordering::Relaxed), 0);
    on.shutdown(false);
    off.shutdown(false);
}

/// The bit patterns of a slot's state: every KV row of every attention layer and the GDN conv and
/// recurrent states.
fn state_bits(s: &SeqState) -> Vec<Vec<u32>> {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let kv = s.kv.iter().flat_map(|c| [bits(&c.k), bits(&c.v), vec![c.len as u32]]);
    kv.chain(s.gdn.iter().flat_map(|g| [bits(&g.conv), bits(&g.recurrent)])).collect()
}

#[test]
fn a_snapshot_captured_inside_a_pass_is_the_one_a_split_pass_saves() {
    let dir = model_dir();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let model = orchid_model::load_model(&dir, CpuBackend::new()).unwrap();
    let mut st = model.new_state(StateOptions::new(5, 1024)).unwrap();
    let ids = text_ids(&tok, 60, 300);
    let other = text_ids(&tok, 61, 100);
    let fwd = |st: &mut orchid_cpu::CpuState, spans: &[(usize, usize, usize)], toks: &[&[u32]]| {
        let batch = BatchLayout { spans: spans.iter().map(|&(slot, start, len)| SeqSpan { slot, start, len }).collect() };
        let flat: Vec<u32> = spans.iter().zip(toks).flat_map(|(s, t)| t[s.1..s.1 + s.2].to_vec()).collect();
        model.forward(&flat, &batch, st, LogitRows::LastOfEachSpan).unwrap().data
    };
    // Slot a: [0, 64), then [64, 300) in one pass (next to another sequence's span), capturing
    // the snapshots at 128 and 256.
    let a = st.alloc().unwrap();
    fwd(&mut st, &[(a, 0, 64)], &[&ids]);
    let e = st.alloc().unwrap();
    st.capture_at(a, 256).unwrap();
    st.capture_at(a, 128).unwrap();
    st.capture_at(a, 128).unwrap();
    let one = fwd(&mut st, &[(e, 0, 100), (a, 64, 236)], &[&other, &ids]);
    let caps = st.take_captures(a).unwrap();
    assert!(st.take_captures(a).unwrap().is_empty(), "taking clears the requests");
    // Slot b: the same prompt split at 128 and 256, saved after each pass that ends there.
    let b = st.alloc().unwrap();
    let mut saved = Vec::new();
    for (lo, hi) in [(0, 64), (64, 128), (128, 256)] {
        fwd(&mut st, &[(b, lo, hi - lo)], &[&ids]);
        saved.push((hi, st.save(b, hi).unwrap()));
    }
    saved.remove(0);
    let split = fwd(&mut st, &[(b, 256, 44)], &[&ids]);
    let v = one.len() / 2;
    assert!(one[v..].iter().zip(&split).all(|(x, y)| x.to_bits() == y.to_bits()), "the last logits differ");
    assert_eq!(state_bits(st.slot(a)), state_bits(st.slot(b)), "the states after the prompt differ");
    assert_eq!(caps.iter().map(|c| c.0).collect::<Vec<_>>(), vec![128, 256]);
    for ((at, cap), (at2, snap)) in caps.into_iter().zip(saved) {
        assert_eq!(at, at2);
        let (c, d) = (st.alloc().unwrap(), st.alloc().unwrap());
        st.restore(c, &cap).unwrap();
        st.restore(d, &snap).unwrap();
        assert_eq!(st.slot(c).kv[0].len, at);
        assert_eq!(state_bits(st.slot(c)), state_bits(st.slot(d)), "the snapshots at {at} differ");
        st.free(c);
        st.free(d);
    }
    // A capture no span had inside fails, and asking for one behind the slot's length too.
    st.capture_at(a, 320).unwrap();
    fwd(&mut st, &[(a, 300, 2)], &[&cat(&ids, &other)]);
    assert!(st.take_captures(a).is_err());
    assert!(st.capture_at(a, 256).is_err());
}

#[test]
fn snapshots_cost_no_forward_pass() {
    // A prefill chunk of 512: each of these prompts runs in one forward pass, the snapshots inside
    // it captured by that pass.
    let (on, tok) = start_with(true, None, 512);
    let (off, _) = start_with(false, None, 512);
    let base = text_ids(&tok, 70, 300);
    let steps = |e: &EngineHandle| e.stats().prefill_steps.load(Ordering::Relaxed);
    // Read once the finished request has left (it saves where its generation ended as it does).
    let entries = |e: &EngineHandle| {
        while e.stats().running.load(Ordering::Relaxed) != 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        e.stats().prefix_cache_entries.load(Ordering::Relaxed)
    };
    // Each also leaves the snapshot where its generation ended (3 tokens fed after the prompt).
    let cases = [
        // The last block boundary, 256.
        ("first", base.clone(), 0, 2),
        // Restores 256 and saves its own last block boundary (384) however short its rest is.
        ("extends", cat(&base, &text_ids(&tok, 71, 90)), 256, 2),
        // Shares 200 tokens with the prompts before: 192 (the shared part's end) and 256.
        ("shares", cat(&base[..200], &text_ids(&tok, 72, 70)), 0, 3),
    ];
    for (name, ids, want_cached, new_entries) in cases {
        let (s0, e0) = (steps(&on), entries(&on));
        let a = run(&on, &ids, 4);
        assert_eq!(steps(&on) - s0, 1, "{name}: prefill passes");
        assert_eq!(entries(&on) - e0, new_entries, "{name}: snapshots taken");
        assert_eq!(a.cached, want_cached, "{name}: cached tokens");
        let b = run(&off, &ids, 4);
        assert_eq!((a.tokens, a.logprobs), (b.tokens, b.logprobs), "{name}: output differs with the cache on");
    }
    on.shutdown(false);
    off.shutdown(false);
    // A prefill chunk that is not a multiple of 64: the span from 200 has no GDN chunk boundary at
    // 256, so it stops there for the snapshot ([0, 100), [100, 200), [200, 256), [256, 300)).
    let (odd, _) = start_with(true, None, 100);
    run(&odd, &base, 1);
    assert_eq!(steps(&odd), 4);
    assert_eq!(run(&odd, &base, 1).cached, 256);
    odd.shutdown(false);
}

#[test]
fn next_turn_reuses_the_finished_generation() {
    // A prompt, then prompt + its greedy answer + a new message: the second request finds the
    // snapshot saved where the generation ended.
    let (on, tok) = start(true, None);
    let (off, _) = start(false, None);
    let prompt = text_ids(&tok, 5, 100);
    let first = run(&on, &prompt, 90);
    assert_eq!(first.tokens.len(), 90, "the tiny model should not stop this early");
    // The state after prompt + 89 fed tokens (189) was snapshotted there (the last token
    // sampled was never fed).
    let next = cat(&cat(&prompt, &first.tokens), &text_ids(&tok, 6, 30));
    let a = run(&on, &next, 8);
    assert_eq!(a.cached, 189);
    // Decode computes the state token by token, a full prefill chunk-wise: the same up to
    // rounding. On this model and prompt the greedy tokens agree.
    let b = run(&off, &next, 8);
    assert_eq!(a.tokens, b.tokens);
    // That turn was restored inside a block, so it took no snapshot of its own prompt; the third
    // turn finds where the second one's generation ended (220 + 7 fed tokens).
    let third = cat(&cat(&next, &a.tokens), &text_ids(&tok, 7, 20));
    let c = run(&on, &third, 4);
    assert_eq!(c.cached, 227);
    assert_eq!(c.tokens, run(&off, &third, 4).tokens);
    on.shutdown(false);
    off.shutdown(false);
}

#[test]
fn concurrent_requests_share_a_prefix() {
    let (on, tok) = start(true, None);
    let (off, _) = start(false, None);
    let system = text_ids(&tok, 7, 256 + 10);
    // The first request saves the prompt's last block boundary (256), inside the shared part.
    let warm = run(&on, &cat(&system, &text_ids(&tok, 8, 20)), 4);
    assert_eq!(warm.cached, 0);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| cat(&system, &text_ids(&tok, 20 + i, 15 + 7 * i))).collect();
    // All four run together (4 slots), each restoring the shared 256 tokens into its own slot.
    let rxs: Vec<_> = prompts.iter().map(|p| on.submit(request(p, 10)).unwrap()).collect();
    let outs: Vec<Out> = rxs.into_iter().map(collect).collect();
    for (p, o) in prompts.iter().zip(&outs) {
        assert_eq!(o.cached, 256);
        let b = run(&off, p, 10);
        assert_eq!((&o.tokens, &o.logprobs), (&b.tokens, &b.logprobs), "a request sharing a prefix saw something else");
    }
    on.shutdown(false);
    off.shutdown(false);
}

#[test]
fn a_tiny_budget_evicts_and_stays_within_it() {
    let (probe, tok) = start(true, None);
    // One snapshot of 128 tokens: its size is the cache's bytes after one request.
    run(&probe, &text_ids(&tok, 30, 130), 1);
    let one = probe.stats().prefix_cache_bytes.load(Ordering::Relaxed);
    assert!(one > 0);
    probe.shutdown(false);

    let budget = one * 2 + one / 2;
    let (on, _) = start(true, Some(budget));
    let (off, _) = start(false, None);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| text_ids(&tok, 40 + i, 130)).collect();
    // One token each: a generation that ends where its prompt does leaves no snapshot of its own.
    for p in &prompts {
        run(&on, p, 1);
        assert!(on.stats().prefix_cache_bytes.load(Ordering::Relaxed) <= budget);
    }
    let st = on.stats();
    assert_eq!(st.prefix_cache_entries.load(Ordering::Relaxed), 2);
    assert_eq!(st.prefix_cache_evictions.load(Ordering::Relaxed), 2);
    // The two most recent prompts hit, the evicted ones prefill again, all as without a cache.
    for (i, p) in prompts.iter().enumerate().rev() {
        let a = run(&on, p, 1);
        assert_eq!(a.cached, if i >= 2 { 128 } else { 0 }, "prompt {i}");
        let b = run(&off, p, 1);
        assert_eq!((a.tokens, a.logprobs), (b.tokens, b.logprobs));
    }
    on.shutdown(false);
    off.shutdown(false);
}

#[test]
fn a_cancelled_request_releases_its_state() {
    let (on, tok) = start(true, None);
    let prompt = text_ids(&tok, 50, 200);
    run(&on, &prompt, 1);
    // Restored from the cache, then cancelled mid-generation.
    let mut rx = on.submit(request(&prompt, 500)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut got = 0;
    while got < 3 {
        match rx.try_recv() {
            Ok(Event::Token { .. }) => got += 1,
            Ok(e) => panic!("unexpected {e:?}"),
            Err(_) => {
                assert!(std::time::Instant::now() < deadline);
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    drop(rx);
    let st = on.stats();
    while st.running.load(Ordering::Relaxed) != 0 || st.state_bytes.load(Ordering::Relaxed) != 0 {
        assert!(std::time::Instant::now() < deadline, "the cancelled request kept its state");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(st.cancelled.load(Ordering::Relaxed), 1);
    // The cache still serves the prompt's last block boundary (192).
    assert_eq!(run(&on, &prompt, 2).cached, max_restore(prompt.len()) / BLOCK * BLOCK);
    on.shutdown(false);
}
