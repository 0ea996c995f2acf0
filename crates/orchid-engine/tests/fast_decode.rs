//! The engine's fast-decode hook (`FastDecode`), on the CPU with a recording mock that decodes
//! through the op-level forward pass and samples greedily: the engine must hand it exactly the
//! steps of a lone decoding sequence (input token = last generated token, position and index
//! consistent), run everything else (prefill, several sequences, penalties, logprobs) on the
//! generic path, fall back when `prepare` fails or the option is off, and produce the same
//! greedy text either way. A decoder that takes token masks gets the steps of sequences under a
//! grammar through `step_batch`, and their masks when it asks for them, after it has issued the
//! step's forward pass. A decoder that takes logit adjustments gets penalised and biased
//! sequences through `step_batch` too, with their lists (applied by the mock with the reference,
//! `apply_logit_adjust`), and the greedy tokens are the generic path's. A decoder that computes
//! log-probabilities gets requests that want them through `step_batch` too (the mock computes them
//! with the host reference from the raw logits), and they are the generic path's. The real fast decoder
//! (the CUDA graph) is tested on the GPU by crates/orchid-cuda/tests/gpu_engine.rs and
//! gpu_batch_decode.rs.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use orchid_cpu::CpuBackend;
use orchid_engine::Tokenizer;
use orchid_engine::constraint::{GrammarSpec, Grammars};
use orchid_engine::engine::{EngineHandle, EngineOptions, LoadedModel, spawn_with};
use orchid_engine::request::{Event, FinishReason, GenerateRequest};
use orchid_engine::sampling::{Sampler, SamplingParams, TokenLogprob, argmax, logprobs};
use orchid_model::{
    Backend, BatchLayout, DecodeStep, DeviceSampling, Error, FastDecode, LateInputs, LogitRows, Model, Result, Sampled, SeqSpan,
    apply_logit_adjust,
};

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/orchid-tiny")
}

#[derive(Default)]
struct Log {
    prepared: Vec<(usize, DeviceSampling)>,
    /// The steps run.
    steps: Vec<DecodeStep>,
    /// Sizes of the batched steps ...
    batches: Vec<usize>,
    /// ... and how many of their rows had a mask ...
    masked: Vec<usize>,
    /// ... or a non-empty logit adjustment list ...
    adjusted: Vec<usize>,
    /// ... or asked for log-probabilities.
    with_logprobs: Vec<usize>,
    /// What each batched step did, in order.
    calls: Vec<Call>,
}

/// The parts of a batched step, as the mock runs them.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Call {
    /// The forward pass over the rows (on a device: launched, still running).
    Forward,
    /// The engine's masks, asked for and received.
    Masks,
    Sampled,
}

struct Mock {
    log: Arc<Mutex<Log>>,
    fail_prepare: bool,
    /// Whether it takes batches (`prepare_batch` succeeds).
    batch: bool,
    /// Whether it takes token masks (`FastDecode::masks`).
    masks: bool,
    /// `FastDecode::logit_adjust_cap`.
    adjust_cap: usize,
    /// `FastDecode::logprobs_cap`.
    logprobs_cap: Option<usize>,
}

/// A stand-in for a device sampler: greedy, or a generator keyed by (seed, index); a token the
/// step's mask (see `TokenMasks`) does not allow reads as -inf.
fn mock_sample(l: &[f32], step: &DecodeStep, mask: Option<&[u32]>) -> u32 {
    let d = &step.sampling;
    if let Some(m) = mask {
        assert_eq!(m.len(), l.len().div_ceil(32), "a mask for the model's vocabulary");
    }
    let allows = |i: usize| mask.is_none_or(|m| m[i / 32] >> (i % 32) & 1 == 1);
    let l: Vec<f32> = l.iter().enumerate().map(|(i, &x)| if allows(i) { x } else { f32::NEG_INFINITY }).collect();
    let l = l.as_slice();
    if d.is_greedy() {
        return argmax(&l[..d.valid.min(l.len())]) as u32;
    }
    let p = SamplingParams {
        temperature: d.temperature,
        top_k: d.top_k,
        top_p: d.top_p,
        min_p: d.min_p,
        seed: Some(d.seed ^ step.index as u64),
        ..Default::default()
    };
    Sampler::new(p, &[]).sample(l, d.valid)
}

impl FastDecode<CpuBackend> for Mock {
    fn name(&self) -> &str {
        "mock"
    }

    fn prepare(
        &mut self,
        _m: &Model<CpuBackend>,
        _s: &mut <CpuBackend as Backend>::State,
        slot: usize,
        sampling: &DeviceSampling,
    ) -> Result<()> {
        if self.fail_prepare {
            return Err(Error::Backend("the mock refuses".into()));
        }
        self.log.lock().unwrap().prepared.push((slot, *sampling));
        Ok(())
    }

    fn step(&mut self, m: &Model<CpuBackend>, s: &mut <CpuBackend as Backend>::State, step: &DecodeStep) -> Result<Sampled> {
        assert_eq!(step.adjust, 0, "a step with logit adjustments outside step_batch");
        assert_eq!(step.logprobs, None, "a step with log-probabilities outside step_batch");
        self.log.lock().unwrap().steps.push(*step);
        let l = m.forward(&[step.token], &BatchLayout::single(step.slot, step.pos, 1), s, LogitRows::LastOfEachSpan)?;
        let l = m.backend.to_host(&l)?;
        Ok(Sampled::token(mock_sample(&l, step, None)))
    }

    fn prepare_batch(&mut self, _m: &Model<CpuBackend>, _s: &mut <CpuBackend as Backend>::State, steps: &[DecodeStep]) -> Result<()> {
        if !self.batch {
            return Err(Error::Backend("the mock decodes one at a time".into()));
        }
        assert!(!steps.is_empty(), "an empty batch");
        Ok(())
    }

    fn masks(&self) -> bool {
        self.masks
    }

    fn logit_adjust_cap(&self) -> usize {
        self.adjust_cap
    }

    fn logprobs_cap(&self) -> Option<usize> {
        self.logprobs_cap
    }

    /// As a device decoder would: the forward pass first, then the masks and adjustments, then the
    /// sampling (of the adjusted, then masked, logits), and the log-probabilities of the raw logits.
    fn step_batch(
        &mut self,
        m: &Model<CpuBackend>,
        s: &mut <CpuBackend as Backend>::State,
        steps: &[DecodeStep],
        late: &mut dyn FnMut() -> LateInputs,
    ) -> Result<Vec<Sampled>> {
        assert!(self.batch, "step_batch without a successful prepare_batch");
        let ids: Vec<u32> = steps.iter().map(|s| s.token).collect();
        let batch = BatchLayout { spans: steps.iter().map(|s| SeqSpan { slot: s.slot, start: s.pos, len: 1 }).collect() };
        let mut l = m.backend.to_host(&m.forward(&ids, &batch, s, LogitRows::LastOfEachSpan)?)?;
        self.log.lock().unwrap().calls.push(Call::Forward);
        let LateInputs { masks, adjust } = late();
        assert_eq!(masks.len(), steps.len(), "one mask entry per step");
        assert!(adjust.is_empty() || adjust.len() == steps.len(), "one adjustment list per step, or none");
        let lists = |i: usize| adjust.get(i).map_or(&[][..], Vec::as_slice);
        assert!(
            steps.len() > 1 || masks[0].is_some() || steps[0].adjust > 0 || steps[0].logprobs.is_some(),
            "a batch of one without a mask, adjustments or log-probabilities"
        );
        assert!(self.masks || masks.iter().all(Option::is_none), "a mask for a decoder that takes none");
        for (i, st) in steps.iter().enumerate() {
            assert!(lists(i).len() <= st.adjust.min(self.adjust_cap), "a list longer than its bound or the cap");
            assert!(st.logprobs.is_none_or(|n| self.logprobs_cap.is_some_and(|c| n <= c)), "log-probabilities over the cap");
        }
        let mut log = self.log.lock().unwrap();
        log.calls.push(Call::Masks);
        log.steps.extend_from_slice(steps);
        log.batches.push(steps.len());
        log.masked.push(masks.iter().flatten().count());
        log.adjusted.push((0..steps.len()).filter(|&i| !lists(i).is_empty()).count());
        log.with_logprobs.push(steps.iter().filter(|s| s.logprobs.is_some()).count());
        let v = l.len() / steps.len();
        let raw = l.clone();
        for (i, st) in steps.iter().enumerate() {
            apply_logit_adjust(&mut l[i * v..(i + 1) * v], st.sampling.valid, lists(i));
        }
        let sampled = steps
            .iter()
            .zip(&masks)
            .enumerate()
            .map(|(i, (st, mask))| {
                let token = mock_sample(&l[i * v..(i + 1) * v], st, mask.as_deref());
                let logprob = st.logprobs.map(|n| logprobs(&raw[i * v..(i + 1) * v], st.sampling.valid, token, n));
                Sampled { token, logprob }
            })
            .collect();
        log.calls.push(Call::Sampled);
        Ok(sampled)
    }
}

fn start(fast: Option<bool>, fail_prepare: bool, enabled: bool) -> (EngineHandle, Arc<Mutex<Log>>, Arc<Tokenizer>) {
    start_with(fast, fail_prepare, enabled, false, false)
}

fn start_with(
    fast: Option<bool>,
    fail_prepare: bool,
    enabled: bool,
    batch: bool,
    masks: bool,
) -> (EngineHandle, Arc<Mutex<Log>>, Arc<Tokenizer>) {
    start_full(fast, fail_prepare, enabled, batch, masks, 0, None)
}

fn start_full(
    fast: Option<bool>,
    fail_prepare: bool,
    enabled: bool,
    batch: bool,
    masks: bool,
    adjust_cap: usize,
    logprobs_cap: Option<usize>,
) -> (EngineHandle, Arc<Mutex<Log>>, Arc<Tokenizer>) {
    let dir = model_dir();
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let log = Arc::new(Mutex::new(Log::default()));
    let log2 = log.clone();
    let opts = EngineOptions {
        max_seqs: 4,
        max_context: 256,
        prefill_chunk: 16,
        max_queue: 8,
        fast_decode: enabled,
        prefix_cache: false,
        prefix_cache_bytes: None,
        inject_fault: None,
        ..Default::default()
    };
    let e = spawn_with(opts, tok.clone(), move || {
        let model = orchid_model::load_model(&dir, CpuBackend::new())?;
        let fast_decode: Option<Box<dyn FastDecode<CpuBackend>>> = fast
            .map(|_| Box::new(Mock { log: log2, fail_prepare, batch, masks, adjust_cap, logprobs_cap }) as Box<dyn FastDecode<CpuBackend>>);
        Ok(LoadedModel { model, fast_decode })
    });
    e.wait_ready().unwrap();
    (e, log, tok)
}

#[derive(Debug, Default, Clone, PartialEq)]
struct Out {
    tokens: Vec<u32>,
    text: String,
    finish: Option<FinishReason>,
    /// Per token, as the engine streamed it.
    logprobs: Vec<Option<TokenLogprob>>,
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Out {
    let mut o = Out::default();
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        match rx.try_recv() {
            Ok(Event::Token { id, text, logprob }) => {
                o.tokens.push(id);
                o.text.push_str(&text);
                o.logprobs.push(logprob);
            }
            Ok(Event::Finished { reason, text, .. }) => {
                o.text.push_str(&text);
                o.finish = Some(reason);
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

fn req(tok: &Tokenizer, text: &str, max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(tok.encode(text, false).unwrap());
    r.max_tokens = max_tokens;
    r
}

const PROMPTS: [&str; 3] = ["Once upon a time, in a small village by the sea,", "The capital of France is", "A cat sat"];

/// Each logged step continues one of `outs` (prompt lengths `lens`): its token is the output's
/// token `index - 1` at position prompt + index - 1. Returns how many steps each output got.
fn check_steps(steps: &[DecodeStep], outs: &[(&Out, usize)]) -> Vec<usize> {
    let mut per = vec![0; outs.len()];
    for s in steps {
        let who = outs.iter().position(|(o, len)| {
            s.index >= 1 && s.index < o.tokens.len() + 1 && o.tokens.get(s.index - 1) == Some(&s.token) && s.pos == len + s.index - 1
        });
        let who = who.unwrap_or_else(|| panic!("step {s:?} continues none of the outputs"));
        per[who] += 1;
    }
    per
}

#[test]
fn lone_sequence_goes_through_the_fast_decoder() {
    let (plain, _, tok) = start(None, false, true);
    let (fast, log, _) = start(Some(true), false, true);
    for (i, p) in PROMPTS.iter().enumerate() {
        let r = req(&tok, p, 24 + 8 * i);
        let a = collect(plain.submit(r.clone()).unwrap());
        let before = log.lock().unwrap().steps.len();
        let b = collect(fast.submit(r.clone()).unwrap());
        assert_eq!(a, b, "prompt {p:?}: the fast hook changed the greedy output");
        let l = log.lock().unwrap();
        let steps = &l.steps[before..];
        // Every token but the first (sampled from the prefill logits) came from the hook, in order.
        assert_eq!(steps.len(), b.tokens.len() - 1, "prompt {p:?}");
        for (k, s) in steps.iter().enumerate() {
            assert_eq!((s.index, s.token, s.pos), (k + 1, b.tokens[k], r.prompt.len() + k), "prompt {p:?} step {k}");
            assert!(s.sampling.is_greedy());
            assert_eq!(s.sampling.valid, tok.vocab_size());
        }
        assert_eq!(fast.stats().fast_decode_steps.load(std::sync::atomic::Ordering::SeqCst), l.steps.len());
    }
    // Two requests at once: batched on the generic path while both run, the survivor on the hook.
    let r1 = req(&tok, PROMPTS[0], 40);
    let r2 = req(&tok, PROMPTS[2], 8);
    let solo1 = collect(plain.submit(r1.clone()).unwrap());
    let solo2 = collect(plain.submit(r2.clone()).unwrap());
    let before = log.lock().unwrap().steps.len();
    let (x1, x2) = (fast.submit(r1.clone()).unwrap(), fast.submit(r2.clone()).unwrap());
    let (o1, o2) = (collect(x1), collect(x2));
    assert_eq!(o1, solo1);
    assert_eq!(o2, solo2);
    let l = log.lock().unwrap();
    let per = check_steps(&l.steps[before..], &[(&o1, r1.prompt.len()), (&o2, r2.prompt.len())]);
    assert!(per[0] > 0, "the longer request never went back to the fast path: {per:?}");
    assert!(per[0] < o1.tokens.len() - 1 || per[1] < o2.tokens.len() - 1, "no step ran batched: {per:?}");
    drop(l);
    plain.shutdown(false);
    fast.shutdown(false);
}

#[test]
fn unsupported_sampling_and_switches_use_the_generic_path() {
    let (fast, log, tok) = start(Some(true), false, true);
    let mut r = req(&tok, PROMPTS[1], 12);
    r.logprobs = Some(2);
    collect(fast.submit(r).unwrap());
    for p in [
        SamplingParams { repetition_penalty: 1.2, ..Default::default() },
        SamplingParams { presence_penalty: 0.5, ..Default::default() },
        SamplingParams { frequency_penalty: 0.5, ..Default::default() },
        SamplingParams { temperature: f32::NAN, ..Default::default() },
    ] {
        let mut r = req(&tok, PROMPTS[1], 12);
        r.sampling = p;
        collect(fast.submit(r).unwrap());
    }
    assert!(log.lock().unwrap().steps.is_empty(), "an unsupported request went through the fast path");
    assert!(log.lock().unwrap().prepared.is_empty());
    // max_tokens 1: the token comes from the prefill, no decode step at all.
    collect(fast.submit(req(&tok, PROMPTS[1], 1)).unwrap());
    assert!(log.lock().unwrap().prepared.is_empty());
    // Sampled requests are offered to the device sampler with their parameters and seed (an
    // unseeded request gets one seed for all its steps).
    let sampled = SamplingParams { temperature: 0.7, top_k: 5, top_p: 0.9, min_p: 0.05, seed: Some(9), ..Default::default() };
    for seed in [Some(9), None] {
        let mut r = req(&tok, PROMPTS[1], 6);
        r.sampling = SamplingParams { seed, ..sampled.clone() };
        let o = collect(fast.submit(r).unwrap());
        let mut l = log.lock().unwrap();
        assert_eq!(l.steps.len(), o.tokens.len() - 1);
        let s0 = l.steps[0].sampling;
        assert_eq!((s0.temperature, s0.top_k, s0.top_p, s0.min_p, s0.valid), (0.7, 5, 0.9, 0.05, tok.vocab_size()));
        if let Some(seed) = seed {
            assert_eq!(s0.seed, seed);
        }
        assert!(l.steps.iter().all(|s| s.sampling == s0) && l.prepared.iter().all(|p| p.1 == s0));
        l.steps.clear();
        l.prepared.clear();
    }
    fast.shutdown(false);

    // prepare failing: the engine falls back for good, same output.
    let (plain, _, _) = start(None, false, true);
    let (broken, log, _) = start(Some(true), true, true);
    let (off, log_off, _) = start(Some(true), false, false);
    let r = req(&tok, PROMPTS[0], 16);
    let a = collect(plain.submit(r.clone()).unwrap());
    assert_eq!(collect(broken.submit(r.clone()).unwrap()), a);
    assert_eq!(collect(broken.submit(r.clone()).unwrap()), a);
    assert_eq!(collect(off.submit(r.clone()).unwrap()), a);
    assert!(
        log.lock().unwrap().steps.is_empty() && log_off.lock().unwrap().steps.is_empty() && log_off.lock().unwrap().prepared.is_empty()
    );
    for e in [plain, broken, off] {
        e.shutdown(false);
    }
}

/// Forced and banned tokens (a thinking budget, `min_tokens`) and a logit bias are decided on
/// the host: those steps run the generic path, the rest of a lone sequence the fast decoder,
/// and the output is what the generic path alone produces.
#[test]
fn forced_banned_and_biased_tokens_stay_on_the_host() {
    use orchid_engine::request::{StopReason, ThinkingBudget};

    let (plain, _, tok) = start(None, false, true);
    let (fast, log, _) = start(Some(true), false, true);
    let base = req(&tok, PROMPTS[0], 12);
    let free = collect(plain.submit(base.clone()).unwrap());
    // Thinking budget: after 3 tokens the 4th is forced to `end`, whatever the model says.
    let end = free.tokens[6];
    let mut r = base.clone();
    r.thinking = Some(ThinkingBudget { budget: 3, end_token: end });
    let a = collect(plain.submit(r.clone()).unwrap());
    let before = log.lock().unwrap().steps.len();
    let b = collect(fast.submit(r.clone()).unwrap());
    assert_eq!(a, b);
    assert_eq!(&a.tokens[..3], &free.tokens[..3]);
    assert_eq!(a.tokens[3], end);
    let fast_steps: Vec<usize> = log.lock().unwrap().steps[before..].iter().map(|s| s.index).collect();
    assert!(!fast_steps.contains(&3), "the forced token came from the fast decoder: {fast_steps:?}");
    assert!(fast_steps.len() >= 6, "the fast decoder took over after the forced token: {fast_steps:?}");
    // min_tokens: the stop token cannot come before 5 tokens; a stop token id ends it after.
    let mut r = base.clone();
    r.stop_token_ids = vec![free.tokens[1]];
    let stopped = collect(plain.submit(r.clone()).unwrap());
    assert_eq!(stopped.tokens.len(), 2);
    r.min_tokens = 5;
    let a = collect(plain.submit(r.clone()).unwrap());
    let b = collect(fast.submit(r.clone()).unwrap());
    assert_eq!(a, b);
    assert!(a.tokens.len() >= 5 && !a.tokens[..5].contains(&free.tokens[1]), "{a:?}");
    // logit_bias: +100 on one token makes every greedy token that one; stop reason reported.
    let x = free.tokens[2];
    let mut r = base.clone();
    r.logit_bias = [(x, 100.0)].into_iter().collect();
    r.max_tokens = 4;
    let a = collect(plain.submit(r.clone()).unwrap());
    let b = collect(fast.submit(r.clone()).unwrap());
    assert_eq!((a.tokens.clone(), &a), (vec![x; 4], &b));
    r.stop_token_ids = vec![x];
    let mut rx = plain.submit(r).unwrap();
    let reason = loop {
        match rx.blocking_recv() {
            Some(Event::Finished { stop_reason, .. }) => break stop_reason,
            Some(Event::Token { .. }) => {}
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(reason, Some(StopReason::Token(x)));
}

/// A decoder that takes batches gets every decoding sequence at once (one step per engine step,
/// distinct slots, each row continuing its own output), also while another prompt is being
/// prefilled; the greedy text is the generic path's.
#[test]
fn several_sequences_decode_as_one_batch() {
    let (plain, _, tok) = start(None, false, true);
    let (fast, log, _) = start_with(Some(true), false, true, true, false);
    let reqs: Vec<GenerateRequest> = PROMPTS.iter().enumerate().map(|(i, p)| req(&tok, p, 12 + 6 * i)).collect();
    let solo: Vec<Out> = reqs.iter().map(|r| collect(plain.submit(r.clone()).unwrap())).collect();
    let rx: Vec<_> = reqs.iter().map(|r| fast.submit(r.clone()).unwrap()).collect();
    let outs: Vec<Out> = rx.into_iter().map(collect).collect();
    assert_eq!(outs, solo);
    let l = log.lock().unwrap();
    assert!(l.batches.contains(&3), "no step decoded all three: {:?}", l.batches);
    let pairs: Vec<(&Out, usize)> = outs.iter().zip(&reqs).map(|(o, r)| (o, r.prompt.len())).collect();
    let per = check_steps(&l.steps, &pairs);
    // Every token after the first came from the decoder (singly or batched).
    for (o, n) in outs.iter().zip(&per) {
        assert_eq!(*n, o.tokens.len() - 1, "{per:?}");
    }
    drop(l);
    // A prompt arriving while two sequences decode: they keep decoding as a batch during its prefill.
    let long = req(&tok, &PROMPTS[0].repeat(6), 4);
    let before = log.lock().unwrap().batches.len();
    let (a, b) = (fast.submit(reqs[0].clone()).unwrap(), fast.submit(reqs[2].clone()).unwrap());
    std::thread::sleep(Duration::from_millis(50));
    let c = fast.submit(long.clone()).unwrap();
    assert_eq!((collect(a), collect(b)), (solo[0].clone(), solo[2].clone()));
    assert_eq!(collect(c), collect(plain.submit(long).unwrap()));
    assert!(log.lock().unwrap().batches.len() > before);
    plain.shutdown(false);
    fast.shutdown(false);
}

/// A request under a grammar decodes on the fast batch path with its mask: alone (a batch of
/// one) and next to a free request, producing the generic path's greedy tokens, the end-of-budget
/// steering included; a sampled one only ever draws allowed tokens (a disallowed one fails the
/// request). The masks come through `step_batch`'s callback, once per step, which the mock calls
/// between the forward pass and the sampling. A decoder that takes no masks leaves it to the
/// generic path.
#[test]
fn constrained_requests_decode_on_the_batch_path() {
    let (plain, _, tok) = start(None, false, true);
    let (fast, log, _) = start_with(Some(true), false, true, true, true);
    let (nomask, log_nomask, _) = start_with(Some(true), false, true, true, false);
    let eos = tok.token_id("<|im_end|>").unwrap();
    let g = Grammars::new(tok.clone(), &[eos]).unwrap();
    let schema = serde_json::json!({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]});
    let constrained = |prompt: &str, spec: &GrammarSpec, max_tokens: usize| {
        let mut r = req(&tok, prompt, max_tokens);
        r.constraint = Some(g.compile(spec).unwrap());
        r
    };
    let specs = [
        GrammarSpec::JsonSchema(schema),
        GrammarSpec::Regex("[a-z]+( [a-z]+){3,6}\\.".into()),
        GrammarSpec::Choice(vec!["yes, certainly".into(), "no, never".into()]),
    ];
    let steps_now = |log: &Arc<Mutex<Log>>| log.lock().unwrap().steps.len();
    let counter = |e: &EngineHandle| e.stats().fast_decode_steps.load(std::sync::atomic::Ordering::SeqCst);
    for spec in &specs {
        // Alone: every token after the first (sampled from the prefill logits) is a masked batch of one.
        let r = constrained(PROMPTS[1], spec, 40);
        let a = collect(plain.submit(r.clone()).unwrap());
        let (before, batches) = (steps_now(&log), log.lock().unwrap().batches.len());
        let b = collect(fast.submit(r.clone()).unwrap());
        assert_eq!(a, b, "{spec:?}: the masked fast path changed the greedy output");
        if !matches!(spec, GrammarSpec::Regex(_)) {
            assert_eq!(a.finish, Some(FinishReason::Stop), "{spec:?}: {a:?}");
        }
        let l = log.lock().unwrap();
        assert_eq!(l.steps.len() - before, b.tokens.len() - 1, "{spec:?}");
        assert!(l.batches[batches..].iter().zip(&l.masked[batches..]).all(|(&n, &m)| n == 1 && m == 1), "{spec:?}");
        assert_eq!(counter(&fast), l.steps.len());
        drop(l);
        // Next to a free request: one batch, the masked row and the free one.
        let free = req(&tok, PROMPTS[0], 30);
        let solo = collect(plain.submit(free.clone()).unwrap());
        let batches = log.lock().unwrap().batches.len();
        let (x, y) = (fast.submit(r.clone()).unwrap(), fast.submit(free.clone()).unwrap());
        assert_eq!((collect(x), collect(y)), (a.clone(), solo));
        let l = log.lock().unwrap();
        assert!(l.batches[batches..].iter().zip(&l.masked[batches..]).any(|(&n, &m)| n == 2 && m == 1), "{spec:?}: {:?}", l.batches);
        drop(l);
        // A decoder without masks: the constrained request stays on the generic path.
        let before = steps_now(&log_nomask);
        assert_eq!(collect(nomask.submit(r.clone()).unwrap()), a);
        assert_eq!(steps_now(&log_nomask), before, "{spec:?}: a constrained step went to a decoder without masks");
        // Sampled: whatever it draws, the grammar allows (else the request would fail).
        let mut s = r.clone();
        s.sampling = SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(3), ..Default::default() };
        let before = steps_now(&log);
        let o = collect(fast.submit(s).unwrap());
        assert!(steps_now(&log) > before, "{spec:?}");
        if let (GrammarSpec::JsonSchema(_), Some(FinishReason::Stop)) = (spec, o.finish) {
            serde_json::from_str::<serde_json::Value>(&o.text).unwrap_or_else(|e| panic!("{e}: {}", o.text));
        }
    }
    // A tight budget: the end-of-budget steering picks the same tokens on both paths.
    let r = constrained(PROMPTS[2], &specs[0], 12);
    let a = collect(plain.submit(r.clone()).unwrap());
    assert_eq!(collect(fast.submit(r).unwrap()), a);
    // Every batched step got its masks once, after its forward pass and before its sampling.
    let l = log.lock().unwrap();
    assert!(!l.batches.is_empty());
    assert_eq!(l.calls, [Call::Forward, Call::Masks, Call::Sampled].repeat(l.batches.len()));
    drop(l);
    for e in [plain, fast, nomask] {
        e.shutdown(false);
    }
}

/// Penalised and biased requests, on a decoder that takes logit adjustments, decode on the batch
/// path (alone as a batch of one, and next to a free request) with their lists, giving the
/// generic path's greedy tokens; a list over the decoder's cap, or a decoder without adjustments,
/// leaves the request on the generic path; a request without any stays on the lone-sequence step.
#[test]
fn penalised_requests_decode_on_the_batch_path() {
    let (plain, _, tok) = start(None, false, true);
    let (fast, log, _) = start_full(Some(true), false, true, true, true, 4096, None);
    let (small, log_small, _) = start_full(Some(true), false, true, true, true, 8, None);
    let base = req(&tok, PROMPTS[0], 24);
    let free = collect(plain.submit(base.clone()).unwrap());
    let bias: std::collections::HashMap<u32, f32> =
        [(free.tokens[3], -100.0), (free.tokens[5], 3.5), (free.tokens[0], 0.0)].into_iter().collect();
    // (A negative presence penalty rewards repeats: the greedy output has few to penalise.)
    let cases = [
        (SamplingParams { repetition_penalty: 2.0, ..Default::default() }, Default::default()),
        (SamplingParams { repetition_penalty: 0.5, ..Default::default() }, Default::default()),
        (SamplingParams { presence_penalty: -2.0, ..Default::default() }, Default::default()),
        (SamplingParams { frequency_penalty: -1.5, ..Default::default() }, Default::default()),
        (SamplingParams::default(), bias),
        (SamplingParams { repetition_penalty: 1.2, presence_penalty: -0.3, frequency_penalty: 0.4, ..Default::default() }, {
            [(free.tokens[2], 2.0)].into_iter().collect()
        }),
    ];
    let mut changed = 0;
    for (p, bias) in &cases {
        let mut r = base.clone();
        r.sampling = p.clone();
        r.logit_bias = bias.clone();
        let a = collect(plain.submit(r.clone()).unwrap());
        changed += (a.tokens != free.tokens) as usize;
        // Alone: every token after the first is a batch of one with its list.
        let (before, batches) = {
            let l = log.lock().unwrap();
            (l.steps.len(), l.batches.len())
        };
        let b = collect(fast.submit(r.clone()).unwrap());
        assert_eq!(a, b, "{p:?} {bias:?}: the adjusted batch path changed the greedy output");
        let l = log.lock().unwrap();
        assert_eq!(l.steps.len() - before, b.tokens.len() - 1, "{p:?}");
        assert!(l.steps[before..].iter().all(|s| s.adjust > 0));
        assert!(l.batches[batches..].iter().zip(&l.adjusted[batches..]).all(|(&n, &k)| n == 1 && k == 1), "{p:?}");
        drop(l);
        // Next to a free request: batches of two, one adjusted row.
        let other = req(&tok, PROMPTS[1], 20);
        let solo = collect(plain.submit(other.clone()).unwrap());
        let batches = log.lock().unwrap().batches.len();
        let (x, y) = (fast.submit(r.clone()).unwrap(), fast.submit(other.clone()).unwrap());
        assert_eq!((collect(x), collect(y)), (a.clone(), solo), "{p:?}");
        let l = log.lock().unwrap();
        assert!(l.batches[batches..].iter().zip(&l.adjusted[batches..]).any(|(&n, &k)| n == 2 && k == 1), "{p:?}: {:?}", l.batches);
        drop(l);
        // A cap of 8 entries: a repetition penalty over the prompt exceeds it (generic path).
        let before = log_small.lock().unwrap().steps.len();
        assert_eq!(collect(small.submit(r.clone()).unwrap()), a);
        if p.repetition_penalty != 1.0 {
            assert_eq!(log_small.lock().unwrap().steps.len(), before, "{p:?}: a list over the cap went to the decoder");
        }
    }
    assert!(changed >= 4, "the penalties changed too few outputs ({changed}) to show anything");
    // A sampled penalised request goes through the batch path too.
    let mut r = base.clone();
    r.sampling = SamplingParams { temperature: 0.9, top_p: 0.95, frequency_penalty: 0.5, seed: Some(4), ..Default::default() };
    let before = log.lock().unwrap().steps.len();
    let o = collect(fast.submit(r).unwrap());
    assert_eq!(log.lock().unwrap().steps.len() - before, o.tokens.len() - 1);
    // Neutral penalties: no list, the lone-sequence step.
    let mut r = base.clone();
    r.sampling = SamplingParams { repetition_penalty: 1.0, presence_penalty: 0.0, ..Default::default() };
    let batches = log.lock().unwrap().batches.len();
    assert_eq!(collect(fast.submit(r).unwrap()), free);
    assert_eq!(log.lock().unwrap().batches.len(), batches);
    for e in [plain, fast, small] {
        e.shutdown(false);
    }
}

/// The log-probabilities of two runs of the same tokens agree: same ids, values within `tol`.
fn assert_logprobs_close(a: &Out, b: &Out, tol: f32, what: &str) {
    assert_eq!(a.tokens, b.tokens, "{what}");
    assert_eq!(a.logprobs.len(), b.logprobs.len(), "{what}");
    for (k, (x, y)) in a.logprobs.iter().zip(&b.logprobs).enumerate() {
        let (x, y) = (x.as_ref().expect("a token without logprobs"), y.as_ref().expect("a token without logprobs"));
        assert_eq!((x.id, x.top.len()), (y.id, y.top.len()), "{what}: token {k}");
        assert!((x.logprob - y.logprob).abs() <= tol, "{what}: token {k}: {x:?} vs {y:?}");
        for (p, q) in x.top.iter().zip(&y.top) {
            assert!(p.0 == q.0 && (p.1 - q.1).abs() <= tol, "{what}: token {k}: {x:?} vs {y:?}");
        }
    }
}

/// Requests with logprobs, on a decoder that computes them, decode on the batch path (alone as a
/// batch of one, next to a free request, with penalties, sampled) and stream the generic path's
/// log-probabilities (of the raw logits: a penalised request's are those of the model); a
/// `top_logprobs` over the decoder's cap, or a decoder that computes none, leaves the request on
/// the generic path.
#[test]
fn logprobs_requests_decode_on_the_batch_path() {
    let (plain, _, tok) = start(None, false, true);
    let (fast, log, _) = start_full(Some(true), false, true, true, true, 4096, Some(20));
    let (small, log_small, _) = start_full(Some(true), false, true, true, true, 4096, Some(3));
    let (none, log_none, _) = start_full(Some(true), false, true, true, true, 4096, None);
    let with = |n: usize, p: SamplingParams| {
        let mut r = req(&tok, PROMPTS[0], 16);
        r.logprobs = Some(n);
        r.sampling = p;
        r
    };
    let cases = [
        with(0, SamplingParams::default()),
        with(5, SamplingParams::default()),
        with(20, SamplingParams::default()),
        with(4, SamplingParams { repetition_penalty: 1.5, presence_penalty: 0.5, ..Default::default() }),
    ];
    for r in &cases {
        let what = format!("logprobs {:?}, {:?}", r.logprobs, r.sampling);
        let a = collect(plain.submit(r.clone()).unwrap());
        assert!(a.logprobs.iter().all(|l| l.as_ref().is_some_and(|l| l.top.len() == r.logprobs.unwrap())), "{what}");
        // Alone: every token after the first is a batch of one asking for log-probabilities.
        let (before, batches) = {
            let l = log.lock().unwrap();
            (l.steps.len(), l.batches.len())
        };
        let b = collect(fast.submit(r.clone()).unwrap());
        assert_logprobs_close(&a, &b, 1e-5, &what);
        assert_eq!((&a.text, a.finish), (&b.text, b.finish), "{what}");
        let l = log.lock().unwrap();
        assert_eq!(l.steps.len() - before, b.tokens.len() - 1, "{what}");
        assert!(l.batches[batches..].iter().zip(&l.with_logprobs[batches..]).all(|(&n, &k)| n == 1 && k == 1), "{what}");
        drop(l);
        // Next to a free request: batches of two, one row asking.
        let other = req(&tok, PROMPTS[1], 12);
        let solo = collect(plain.submit(other.clone()).unwrap());
        let batches = log.lock().unwrap().batches.len();
        let (x, y) = (fast.submit(r.clone()).unwrap(), fast.submit(other.clone()).unwrap());
        let (x, y) = (collect(x), collect(y));
        assert_logprobs_close(&a, &x, 1e-5, &what);
        assert_eq!(y, solo, "{what}");
        let l = log.lock().unwrap();
        assert!(l.batches[batches..].iter().zip(&l.with_logprobs[batches..]).any(|(&n, &k)| n == 2 && k == 1), "{what}: {:?}", l.batches);
        drop(l);
        // A cap of 3 top tokens, or none: the generic path (same output).
        let (before_small, before_none) = (log_small.lock().unwrap().steps.len(), log_none.lock().unwrap().steps.len());
        assert_logprobs_close(&a, &collect(small.submit(r.clone()).unwrap()), 1e-5, &what);
        assert_logprobs_close(&a, &collect(none.submit(r.clone()).unwrap()), 0.0, &what);
        assert_eq!(log_none.lock().unwrap().steps.len(), before_none, "{what}: a decoder without logprobs got the request");
        if r.logprobs.unwrap() > 3 {
            assert_eq!(log_small.lock().unwrap().steps.len(), before_small, "{what}: top_logprobs over the cap went to the decoder");
        }
    }
    // Sampled: on the batch path, each token's log-probability is of the token drawn.
    let r = with(2, SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(5), ..Default::default() });
    let before = log.lock().unwrap().steps.len();
    let o = collect(fast.submit(r).unwrap());
    assert_eq!(log.lock().unwrap().steps.len() - before, o.tokens.len() - 1);
    for (t, l) in o.tokens.iter().zip(&o.logprobs) {
        let l = l.as_ref().expect("a token without logprobs");
        assert!(l.id == *t && l.logprob <= 0.0 && l.top.len() == 2 && l.top[0].1 >= l.top[1].1 && l.top[0].1 >= l.logprob, "{l:?}");
    }
    for e in [plain, fast, small, none] {
        e.shutdown(false);
    }
}
