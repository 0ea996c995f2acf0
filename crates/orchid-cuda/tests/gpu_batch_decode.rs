//! Batched decode on random weights: several sequences of different context lengths decoded
//! together, (1) eagerly through `Model::forward` (the decode-rows blocks: one launch per layer
//! for all rows) against the CPU reference (the rule of gpu_model.rs) and against each sequence
//! decoded alone on the per-span path; (2) through the captured batch graph (`BatchGraph`, a
//! capture of the same forward pass plus sampling per row) against the eager batched path: the
//! same greedy tokens, also when sequences leave and the batch moves to a smaller bucket; (3) with
//! mixed sampling parameters per row: runs are reproducible and the greedy rows are unchanged;
//! (4) with token masks on some rows (a grammar's): greedy rows pick the argmax of their masked
//! logits, sampled rows never a masked token, and the unmasked rows are unchanged; (5) with
//! penalties and logit biases on some rows (the engine's host sampler packs each row's list,
//! `Sampler::device_adjust`): greedy rows pick the argmax of the host-adjusted logits
//! (`Sampler::adjusted_logits`), sampled rows are reproducible and obey their biases, and the rows
//! without adjustments are unchanged; (6) with log-probabilities on some rows (top_logprobs 0, 5,
//! 20; with and without adjustments; greedy and sampled graphs): against the host reference
//! (`orchid_engine::sampling::logprobs`) of the raw logits, which a twin graph on an identical
//! state gives (the same inputs without adjustments: its logits are the step's before the
//! adjustments change them in place); every token is the one a run without log-probabilities
//! samples, and two runs give the same bits. Skipped without a GPU.

mod common;

use common::*;
use orchid_cpu::CpuBackend;
use orchid_cuda::{BatchGraph, BatchRow, CudaBackend, SampleParams};
use orchid_engine::sampling::{Sampler, SamplingParams, TokenLogprob, logprobs};
use orchid_model::LateInputs;
use orchid_model::Model;
use orchid_model::backend::{Backend, StateOptions, StatePool};
use orchid_model::batch::{BatchLayout, LogitRows, SeqSpan};
use orchid_model::config::ModelConfig;

const LENS: [usize; 5] = [17, 64, 130, 3, 250];

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b]).then(b.cmp(&a))).unwrap() as u32
}

/// Allocates a slot per prompt and prefills it; returns the slots and each prompt's last token
/// greedy choice.
fn prefill<B: Backend>(m: &Model<B>, st: &mut B::State, prompts: &[Vec<u32>]) -> (Vec<usize>, Vec<u32>) {
    let v = m.config.vocab_size;
    let mut slots = Vec::new();
    let mut next = Vec::new();
    for p in prompts {
        let s = st.alloc().unwrap();
        let l = m.backend.to_host(&m.forward(p, &BatchLayout::single(s, 0, p.len()), st, LogitRows::LastOfEachSpan).unwrap()).unwrap();
        slots.push(s);
        next.push(argmax(&l[..v]));
    }
    (slots, next)
}

fn batch_logits<B: Backend>(m: &Model<B>, st: &mut B::State, slots: &[usize], pos: &[usize], toks: &[u32]) -> Vec<f32> {
    let batch = BatchLayout { spans: slots.iter().zip(pos).map(|(&slot, &start)| SeqSpan { slot, start, len: 1 }).collect() };
    m.backend.to_host(&m.forward(toks, &batch, st, LogitRows::LastOfEachSpan).unwrap()).unwrap()
}

/// Greedy decode of `steps` tokens for every sequence, rows `alive(step)` only, eagerly.
fn eager_greedy(m: &Model<CudaBackend>, prompts: &[Vec<u32>], steps: usize, alive: &dyn Fn(usize) -> usize) -> Vec<Vec<u32>> {
    let v = m.config.vocab_size;
    let mut st = m.new_state(StateOptions::new(prompts.len(), 320)).unwrap();
    let (slots, first) = prefill(m, &mut st, prompts);
    let mut out: Vec<Vec<u32>> = first.iter().map(|&t| vec![t]).collect();
    for k in 0..steps {
        let n = alive(k);
        let pos: Vec<usize> = (0..n).map(|i| prompts[i].len() + k).collect();
        let toks: Vec<u32> = (0..n).map(|i| *out[i].last().unwrap()).collect();
        let l = batch_logits(m, &mut st, &slots[..n], &pos, &toks);
        for i in 0..n {
            out[i].push(argmax(&l[i * v..(i + 1) * v]));
        }
    }
    out
}

/// A row's token mask: `masks(step, row)`, None for none.
type Masks<'a> = &'a dyn Fn(usize, usize) -> Option<Vec<u32>>;

/// The same through batch graphs, with per-row sampling parameters `params` and masks `masks`.
fn graph_decode(
    m: &Model<CudaBackend>,
    prompts: &[Vec<u32>],
    steps: usize,
    alive: &dyn Fn(usize) -> usize,
    params: &[SampleParams],
    masks: Masks,
) -> Vec<Vec<u32>> {
    let mut st = m.new_state(StateOptions::new(prompts.len(), 320)).unwrap();
    let (slots, first) = prefill(m, &mut st, prompts);
    let mut out: Vec<Vec<u32>> = first.iter().map(|&t| vec![t]).collect();
    let greedy = params.iter().all(|p| p.is_greedy());
    let mut graphs: Vec<BatchGraph> = Vec::new();
    for k in 0..steps {
        let n = alive(k);
        let bucket = orchid_cuda::batch_graph::bucket_for(n);
        if !graphs.iter().any(|g| g.bucket == bucket) {
            graphs.push(BatchGraph::new(m, &mut st, bucket, greedy).unwrap());
        }
        let g = graphs.iter_mut().find(|g| g.bucket == bucket).unwrap();
        let rows = step_rows(&slots, &out, prompts, params, n, k);
        for (i, t) in g.step(&mut st, &rows, &mut || (0..n).map(|i| masks(k, i)).collect()).unwrap().into_iter().enumerate() {
            out[i].push(t);
        }
    }
    out
}

/// Step `k` of the first `n` sequences: each one's last token at its position after its prompt.
fn step_rows(slots: &[usize], out: &[Vec<u32>], prompts: &[Vec<u32>], params: &[SampleParams], n: usize, k: usize) -> Vec<BatchRow> {
    (0..n)
        .map(|i| BatchRow { slot: slots[i], token: *out[i].last().unwrap(), pos: prompts[i].len() + k, index: k + 1, params: params[i] })
        .collect()
}

/// One GDN and one attention layer, GQA 4:1, routed 8 of 32 experts.
fn small_config() -> ModelConfig {
    config(2048, 512, 2, (8, 2, 128), (4, 8, 64, 64), (32, 8, 128, 128), 2)
}

/// The sampling tests' setup: the small model on the GPU (MLX 4-bit, the weights of seed 5), its
/// vocabulary v, the ids below `valid` = v − `unused` that a tokenizer would know, and a prompt of
/// each length of LENS (at most 60 tokens) drawn from them.
fn sampling_setup(rng: &mut Rng, unused: usize) -> (Model<CudaBackend>, usize, usize, Vec<Vec<u32>>) {
    let cfg = small_config();
    let gpu = Model::new(cfg.clone(), gpu(), &random_weights(&cfg, Fmt::Mlx, 5)).unwrap();
    let (v, valid) = (cfg.vocab_size, cfg.vocab_size - unused);
    let prompts = LENS.iter().map(|&n| (0..n.min(60)).map(|_| rng.below(valid) as u32).collect()).collect();
    (gpu, v, valid, prompts)
}

fn first_mismatch(a: &[Vec<u32>], b: &[Vec<u32>]) -> Option<(usize, usize)> {
    a.iter().zip(b).enumerate().find_map(|(r, (x, y))| x.iter().zip(y).position(|(p, q)| p != q).map(|k| (r, k)))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batched_decode_matches_reference_and_graph() {
    let g = gpu();
    let cfg = small_config();
    let host = random_weights(&cfg, Fmt::Mlx, 5);
    let cpu = Model::new(cfg.clone(), CpuBackend::new(), &host).unwrap();
    let bfc = Model::new(cfg.clone(), Bf16Cpu(CpuBackend::new()), &host).unwrap();
    let gpu = Model::new(cfg.clone(), g.clone(), &host).unwrap();
    drop(host);
    let v = cfg.vocab_size;
    let mut rng = Rng::new(77);
    let prompts: Vec<Vec<u32>> = LENS.iter().map(|&n| (0..n).map(|_| rng.below(v) as u32).collect()).collect();
    let opts = StateOptions::new(LENS.len() + 1, 320);

    // (1) One batched step against the CPU and against each sequence alone.
    let toks: Vec<u32> = (0..LENS.len()).map(|_| rng.below(v) as u32).collect();
    let pos = LENS.to_vec();
    let cl = {
        let mut st = cpu.new_state(opts).unwrap();
        let (slots, _) = prefill(&cpu, &mut st, &prompts);
        batch_logits(&cpu, &mut st, &slots, &pos, &toks)
    };
    let bl = {
        let mut st = bfc.new_state(opts).unwrap();
        let (slots, _) = prefill(&bfc, &mut st, &prompts);
        batch_logits(&bfc, &mut st, &slots, &pos, &toks)
    };
    let mut gs = gpu.new_state(opts).unwrap();
    let (slots, _) = prefill(&gpu, &mut gs, &prompts);
    let gl = batch_logits(&gpu, &mut gs, &slots, &pos, &toks);
    let mut alone = gpu.new_state(opts).unwrap();
    let (aslots, _) = prefill(&gpu, &mut alone, &prompts);
    let mut al = Vec::new();
    for i in 0..LENS.len() {
        al.extend(batch_logits(&gpu, &mut alone, &aslots[i..i + 1], &pos[i..i + 1], &toks[i..i + 1]));
    }
    let sens = rel_l2(&bl, &cl);
    let tol = (3.0 * sens).max(0.25);
    report(&format!("batched decode of {} sequences (contexts {LENS:?}) vs CPU", LENS.len()), rel_l2(&gl, &cl), tol);
    // Against each sequence alone: the same kernels but the attention's split count.
    report("batched decode vs each sequence alone", rel_l2(&gl, &al), 1e-3);

    // (2) Graph vs eager, greedy, rows leaving (buckets 8, then 4, then 2).
    let alive = |k: usize| {
        if k < 6 {
            5
        } else if k < 12 {
            3
        } else {
            2
        }
    };
    let steps = 16;
    let e = eager_greedy(&gpu, &prompts, steps, &alive);
    let greedy = vec![SampleParams::greedy(v); LENS.len()];
    let gr = graph_decode(&gpu, &prompts, steps, &alive, &greedy, &|_, _| None);
    let same = first_mismatch(&e, &gr);
    println!(
        "PARITY {} batch graph vs eager batched decode, greedy, {steps} steps: {}",
        if same.is_none() { "PASS" } else { "FAIL" },
        same.map_or("identical tokens".into(), |(r, k)| format!("row {r} differs first at token {k}: {:?} vs {:?}", e[r], gr[r]))
    );
    assert!(same.is_none());

    // (3) Mixed sampling: rows 1 and 3 sample, the others stay greedy.
    let mut mixed = greedy.clone();
    for (i, seed) in [(1usize, 11u64), (3, 12)] {
        mixed[i] = SampleParams { temperature: 0.8, top_p: 0.95, top_k: 50, seed, ..SampleParams::greedy(v) };
    }
    let all5 = |_k: usize| 5;
    let e5 = eager_greedy(&gpu, &prompts, 8, &all5);
    let s1 = graph_decode(&gpu, &prompts, 8, &all5, &mixed, &|_, _| None);
    let s2 = graph_decode(&gpu, &prompts, 8, &all5, &mixed, &|_, _| None);
    let ok = s1 == s2 && [0, 2, 4].iter().all(|&r| s1[r] == e5[r]);
    println!(
        "PARITY {} batch graph with mixed sampling: reproducible {}, greedy rows unchanged {}",
        if ok { "PASS" } else { "FAIL" },
        s1 == s2,
        [0, 2, 4].iter().all(|&r| s1[r] == e5[r])
    );
    assert!(ok);
}

/// Whether `mask` allows token `t`.
fn allows(mask: &[u32], t: usize) -> bool {
    mask[t / 32] >> (t % 32) & 1 == 1
}

/// A mask of `v` tokens allowing those `keep` says yes to.
fn mask_of(v: usize, mut keep: impl FnMut(usize) -> bool) -> Vec<u32> {
    let mut w = vec![0u32; v.div_ceil(32)];
    for t in (0..v).filter(|&t| keep(t)) {
        w[t / 32] |= 1 << (t % 32);
    }
    w
}

/// `k` distinct random tokens of `v` as a mask, from `seed`.
fn random_mask(seed: u64, v: usize, k: usize) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    let mut picked = Vec::new();
    while picked.len() < k {
        let t = rng.below(v);
        if !picked.contains(&t) {
            picked.push(t);
        }
    }
    mask_of(v, |t| picked.contains(&t))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_graph_masks() {
    let mut rng = Rng::new(78);
    let (gpu, v, _, prompts) = sampling_setup(&mut rng, 0);
    let n = prompts.len();
    let opts = StateOptions::new(n + 1, 320);

    // (a) Greedy: rows 0, 2 and 3 masked (a random tenth of the vocabulary, never the row's own
    // argmax), against the eager batched forward's logits of the same step.
    let mut eager = gpu.new_state(opts).unwrap();
    let (eslots, first) = prefill(&gpu, &mut eager, &prompts);
    let mut st = gpu.new_state(opts).unwrap();
    let (slots, _) = prefill(&gpu, &mut st, &prompts);
    let mut graph = BatchGraph::new(&gpu, &mut st, orchid_cuda::batch_graph::bucket_for(n), true).unwrap();
    let mut toks = first;
    let (mut exact, mut ties, mut bad) = (0, 0, Vec::new());
    for k in 0..6 {
        let pos: Vec<usize> = prompts.iter().map(|p| p.len() + k).collect();
        let l = batch_logits(&gpu, &mut eager, &eslots, &pos, &toks);
        let masks: Vec<Option<Vec<u32>>> = (0..n)
            .map(|i| {
                let best = argmax(&l[i * v..(i + 1) * v]) as usize;
                [0, 2, 3].contains(&i).then(|| mask_of(v, |t| t != best && rng.below(10) == 0))
            })
            .collect();
        let rows: Vec<BatchRow> = (0..n)
            .map(|i| BatchRow { slot: slots[i], token: toks[i], pos: pos[i], index: k + 1, params: SampleParams::greedy(v) })
            .collect();
        let mut asked = 0;
        let got = graph
            .step(&mut st, &rows, &mut || {
                asked += 1;
                masks.clone()
            })
            .unwrap();
        assert_eq!(asked, 1, "the masks are asked for once a step");
        for i in 0..n {
            let row = &l[i * v..(i + 1) * v];
            let masked: Vec<f32> =
                (0..v).map(|t| if masks[i].as_ref().is_none_or(|m| allows(m, t)) { row[t] } else { f32::NEG_INFINITY }).collect();
            let (want, tok) = (argmax(&masked), got[i]);
            let scale = row.iter().fold(0f32, |a, x| a.max(x.abs()));
            if want == tok {
                exact += 1;
            } else if masked[tok as usize].is_finite() && masked[want as usize] - masked[tok as usize] <= 1e-3 * scale {
                ties += 1;
            } else {
                bad.push((k, i, want, tok));
            }
        }
        toks = got;
    }
    println!(
        "PARITY {} batch graph with token masks, greedy: argmax of the masked logits on {exact} rows, {ties} near-ties, wrong {bad:?}",
        if bad.is_empty() { "PASS" } else { "FAIL" }
    );
    assert!(bad.is_empty());

    // (b) Sampled, 200 steps: rows 0, 2 and 4 allow 5 random tokens (new ones every step), rows 1
    // and 3 have no mask and must decode as in a run where no row has one.
    let mut params = vec![SampleParams::greedy(v); n];
    params[0] = SampleParams { temperature: 1.0, seed: 1, ..SampleParams::greedy(v) };
    params[1] = SampleParams { temperature: 1.0, seed: 2, ..SampleParams::greedy(v) };
    params[2] = SampleParams { temperature: 1.0, top_k: 3, top_p: 0.9, seed: 3, ..SampleParams::greedy(v) };
    params[4] = SampleParams { temperature: 0.7, min_p: 0.1, seed: 4, ..SampleParams::greedy(v) };
    let masked_rows = [0usize, 2, 4];
    let mask = |k: usize, i: usize| masked_rows.contains(&i).then(|| random_mask(1000 + 8 * k as u64 + i as u64, v, 5));
    let steps = 200;
    let all = |_k: usize| n;
    let with = graph_decode(&gpu, &prompts, steps, &all, &params, &mask);
    let without = graph_decode(&gpu, &prompts, steps, &all, &params, &|_, _| None);
    // Token k + 1 of a row was sampled at step k under mask(k, row).
    let outside = |out: &[Vec<u32>], i: usize| (0..steps).filter(|&k| !allows(&mask(k, i).unwrap(), out[i][k + 1] as usize)).count();
    let escaped: Vec<usize> = masked_rows.iter().map(|&i| outside(&with, i)).collect();
    let unmasked_same = [1, 3].iter().all(|&i| with[i] == without[i]);
    // Without the masks the same rows mostly pick other tokens (the masks did something).
    let free_outside: Vec<usize> = masked_rows.iter().map(|&i| outside(&without, i)).collect();
    let ok = escaped.iter().all(|&e| e == 0) && unmasked_same && free_outside.iter().all(|&e| e > steps / 2);
    println!(
        "PARITY {} batch graph with token masks, sampled, {steps} steps: masked tokens drawn {escaped:?}, unmasked rows unchanged {unmasked_same}, tokens outside the masks without them {free_outside:?}",
        if ok { "PASS" } else { "FAIL" }
    );
    assert!(ok);
}

/// The host samplers of (5): row `i`'s penalties and bias (`bias(i)`: token, bias), its prompt
/// seen and its first token observed, as the engine sets them up.
fn samplers(params: &[SamplingParams], bias: &dyn Fn(usize) -> Vec<(u32, f32)>, prompts: &[Vec<u32>], first: &[u32]) -> Vec<Sampler> {
    (0..params.len())
        .map(|i| {
            let mut s = Sampler::new(params[i].clone(), &prompts[i]).with_bias(bias(i).into_iter().collect());
            s.observe(first[i]);
            s
        })
        .collect()
}

/// Batch-graph decode of every row for `steps` steps with each row's logit adjustments packed
/// by its host sampler (which observes every token, as the engine's would).
fn graph_decode_adjusted(
    m: &Model<CudaBackend>,
    prompts: &[Vec<u32>],
    steps: usize,
    params: &[SampleParams],
    make: &dyn Fn(&[u32]) -> Vec<Sampler>,
    valid: usize,
) -> Vec<Vec<u32>> {
    let n = prompts.len();
    let mut st = m.new_state(StateOptions::new(n + 1, 320)).unwrap();
    let (slots, first) = prefill(m, &mut st, prompts);
    let mut hs = make(&first);
    let mut out: Vec<Vec<u32>> = first.iter().map(|&t| vec![t]).collect();
    let greedy = params.iter().all(|p| p.is_greedy());
    let mut g = BatchGraph::new(m, &mut st, orchid_cuda::batch_graph::bucket_for(n), greedy).unwrap();
    for k in 0..steps {
        let rows = step_rows(&slots, &out, prompts, params, n, k);
        let late = LateInputs { masks: vec![None; n], adjust: hs.iter().map(|s| s.device_adjust(valid)).collect() };
        let got = g.step_late(&mut st, &rows, &mut || late.clone()).unwrap();
        for (i, t) in got.into_iter().map(|s| s.token).enumerate() {
            assert!((t as usize) < valid, "row {i} step {k}: token {t} past the valid ones");
            hs[i].observe(t);
            out[i].push(t);
        }
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_graph_penalties() {
    // The tokenizer's vocabulary may be smaller than the model's: ids ≥ valid are never chosen,
    // and biases on them do nothing.
    let mut rng = Rng::new(79);
    let (gpu, v, valid, prompts) = sampling_setup(&mut rng, 40);
    let n = prompts.len();
    let opts = StateOptions::new(n + 1, 320);
    // Row 0: repetition penalty over prompt and output; 1: nothing; 2: presence and frequency;
    // 3: logit biases (one past `valid`); 4: everything at once.
    let hp = [
        SamplingParams { repetition_penalty: 1.5, ..Default::default() },
        SamplingParams::default(),
        SamplingParams { presence_penalty: 0.7, frequency_penalty: 0.9, ..Default::default() },
        SamplingParams::default(),
        SamplingParams { repetition_penalty: 0.7, presence_penalty: -0.4, frequency_penalty: 1.3, ..Default::default() },
    ];
    let bias_tokens: Vec<u32> = (0..6).map(|_| rng.below(valid) as u32).collect();
    let bias = |i: usize| -> Vec<(u32, f32)> {
        match i {
            3 => vec![(bias_tokens[0], 8.0), (bias_tokens[1], -50.0), (bias_tokens[2], 0.0), (valid as u32 + 3, 1e4)],
            4 => vec![(bias_tokens[3], 4.0), (bias_tokens[4], -2.5)],
            _ => Vec::new(),
        }
    };

    // (a) Greedy, 12 steps, against the eager batched forward's logits of the same step adjusted
    // by the host sampler.
    let mut eager = gpu.new_state(opts).unwrap();
    let (eslots, first) = prefill(&gpu, &mut eager, &prompts);
    let mut st = gpu.new_state(opts).unwrap();
    let (slots, _) = prefill(&gpu, &mut st, &prompts);
    let mut graph = BatchGraph::new(&gpu, &mut st, orchid_cuda::batch_graph::bucket_for(n), true).unwrap();
    let mut hs = samplers(&hp, &bias, &prompts, &first);
    let mut toks = first;
    let (mut exact, mut ties, mut bad, mut moved, mut nan) = (0, 0, Vec::new(), 0, 0);
    // The largest logit magnitude seen, to size a bias that dominates in (c).
    let mut scale_max = 0f32;
    for k in 0..12 {
        let pos: Vec<usize> = prompts.iter().map(|p| p.len() + k).collect();
        let l = batch_logits(&gpu, &mut eager, &eslots, &pos, &toks);
        let lists: Vec<_> = hs.iter().map(|s| s.device_adjust(valid)).collect();
        assert!(lists[1].is_empty() && lists.iter().enumerate().all(|(i, l)| i == 1 || !l.is_empty()));
        let rows: Vec<BatchRow> = (0..n)
            .map(|i| BatchRow { slot: slots[i], token: toks[i], pos: pos[i], index: k + 1, params: SampleParams::greedy(valid) })
            .collect();
        let mut asked = 0;
        let got = graph
            .step_late(&mut st, &rows, &mut || {
                asked += 1;
                LateInputs { masks: vec![None; n], adjust: lists.clone() }
            })
            .unwrap()
            .into_iter()
            .map(|s| s.token)
            .collect::<Vec<u32>>();
        assert_eq!(asked, 1, "the late inputs are asked for once a step");
        for i in 0..n {
            let row = &l[i * v..(i + 1) * v];
            let adjusted = hs[i].adjusted_logits(row, valid);
            nan += adjusted.iter().filter(|x| x.is_nan()).count();
            let (want, tok) = (argmax(&adjusted), got[i]);
            moved += (want != argmax(&row[..valid])) as usize;
            let scale = adjusted.iter().fold(0f32, |a, x| a.max(x.abs()));
            scale_max = scale_max.max(row.iter().fold(0f32, |a, x| a.max(x.abs())));
            if (tok as usize) >= valid {
                bad.push((k, i, want, tok));
            } else if want == tok {
                exact += 1;
            } else if adjusted[want as usize] - adjusted[tok as usize] <= 1e-3 * scale {
                ties += 1;
            } else {
                bad.push((k, i, want, tok));
            }
        }
        for (i, &t) in got.iter().enumerate() {
            hs[i].observe(t);
        }
        toks = got;
    }
    let ok = bad.is_empty() && nan == 0 && moved > 0;
    println!(
        "PARITY {} batch graph with penalties and logit bias, greedy: argmax of the host-adjusted logits on {exact} rows, {ties} near-ties, wrong {bad:?}, {moved} choices moved by the adjustments, NaN {nan}",
        if ok { "PASS" } else { "FAIL" }
    );
    assert!(ok);

    // (b) Greedy graph runs with and without the adjustments: the row without any is unchanged.
    let greedy = vec![SampleParams::greedy(valid); n];
    let none = vec![SamplingParams::default(); n];
    let with = graph_decode_adjusted(&gpu, &prompts, 12, &greedy, &|f| samplers(&hp, &bias, &prompts, f), valid);
    let without = graph_decode_adjusted(&gpu, &prompts, 12, &greedy, &|f| samplers(&none, &|_| Vec::new(), &prompts, f), valid);
    let ok = with[1] == without[1] && (0..n).any(|i| with[i] != without[i]);
    println!(
        "PARITY {} batch graph with penalties, greedy: unadjusted row unchanged {}, adjusted rows differ {}",
        if ok { "PASS" } else { "FAIL" },
        with[1] == without[1],
        (0..n).filter(|&i| with[i] != without[i]).count()
    );
    assert!(ok);

    // (c) Seeded sampling, 100 steps: rows 0, 2 and 4 sample with their penalties, row 3 samples
    // with a bias of 2 · max |logit| + 30 on three tokens (it draws nearly only those; a
    // repetition or count penalty it has none of), row 1 samples with none;
    // runs are reproducible and row 1 decodes as in a run where no row has adjustments.
    let steps = 100;
    let mut params = vec![SampleParams::greedy(valid); n];
    for (i, p) in params.iter_mut().enumerate() {
        *p = SampleParams { temperature: 0.9, top_p: 0.95, top_k: if i == 2 { 40 } else { 0 }, seed: 20 + i as u64, ..*p };
    }
    let favoured: Vec<u32> = bias_tokens[..3].to_vec();
    let big = 2.0 * scale_max + 30.0;
    let sbias = |i: usize| if i == 3 { favoured.iter().map(|&t| (t, big)).collect() } else { bias(i) };
    let a = graph_decode_adjusted(&gpu, &prompts, steps, &params, &|f| samplers(&hp, &sbias, &prompts, f), valid);
    let b = graph_decode_adjusted(&gpu, &prompts, steps, &params, &|f| samplers(&hp, &sbias, &prompts, f), valid);
    let free = graph_decode_adjusted(&gpu, &prompts, steps, &params, &|f| samplers(&none, &|_| Vec::new(), &prompts, f), valid);
    let in_favoured = a[3][1..].iter().filter(|t| favoured.contains(t)).count();
    // The frequency penalty spreads row 2's draws over more distinct tokens than without it.
    let distinct = |x: &[u32]| {
        let mut d = x.to_vec();
        d.sort_unstable();
        d.dedup();
        d.len()
    };
    let ok = a == b && a[1] == free[1] && in_favoured * 100 >= 95 * steps && distinct(&a[2]) >= distinct(&free[2]);
    println!(
        "PARITY {} batch graph with penalties and logit bias, sampled, {steps} steps: reproducible {}, unadjusted row unchanged {}, biased draws {in_favoured}/{steps}, distinct tokens with/without frequency penalty {}/{}",
        if ok { "PASS" } else { "FAIL" },
        a == b,
        a[1] == free[1],
        distinct(&a[2]),
        distinct(&free[2])
    );
    assert!(ok);
}

/// One run of (6): every row decoded `steps` steps on a batch graph with its logit adjustments
/// (packed by its host sampler, as in (5)) and its log-probabilities (`params`), while a twin
/// graph on a second, identical state runs the same inputs without adjustments or
/// log-probabilities and keeps each step's raw logits.
struct LogprobRun {
    /// Per row: the prefill's token, then one per step.
    tokens: Vec<Vec<u32>>,
    /// Per step, per row.
    logprobs: Vec<Vec<Option<TokenLogprob>>>,
    /// Per step: the raw logits [rows, vocab].
    raw: Vec<Vec<f32>>,
    /// Whether the rows without adjustments had the same logits, bit for bit, in both graphs
    /// (the twin's forward pass is the graph's).
    twin_same: bool,
}

fn graph_decode_logprobs(
    m: &Model<CudaBackend>,
    prompts: &[Vec<u32>],
    steps: usize,
    params: &[SampleParams],
    make: &dyn Fn(&[u32]) -> Vec<Sampler>,
    valid: usize,
) -> LogprobRun {
    let (n, v) = (prompts.len(), m.config.vocab_size);
    let opts = StateOptions::new(n + 1, 320);
    let (mut st, mut twin_st) = (m.new_state(opts).unwrap(), m.new_state(opts).unwrap());
    let (slots, first) = prefill(m, &mut st, prompts);
    let (twin_slots, _) = prefill(m, &mut twin_st, prompts);
    let mut hs = make(&first);
    let mut run = LogprobRun { tokens: first.iter().map(|&t| vec![t]).collect(), logprobs: Vec::new(), raw: Vec::new(), twin_same: true };
    let bucket = orchid_cuda::batch_graph::bucket_for(n);
    let mut g = BatchGraph::new(m, &mut st, bucket, params.iter().all(|p| p.is_greedy())).unwrap();
    let mut twin = BatchGraph::new(m, &mut twin_st, bucket, true).unwrap();
    for k in 0..steps {
        let rows = step_rows(&slots, &run.tokens, prompts, params, n, k);
        let twin_rows: Vec<BatchRow> =
            rows.iter().zip(&twin_slots).map(|(r, &slot)| BatchRow { slot, params: SampleParams::greedy(valid), ..*r }).collect();
        let late = LateInputs { masks: vec![None; n], adjust: hs.iter().map(|s| s.device_adjust(valid)).collect() };
        let got = g.step_late(&mut st, &rows, &mut || late.clone()).unwrap();
        twin.step(&mut twin_st, &twin_rows, &mut || vec![None; n]).unwrap();
        let (raw, logits) = (twin.logits(n).unwrap(), g.logits(n).unwrap());
        let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
        for i in (0..n).filter(|&i| late.adjust[i].is_empty()) {
            run.twin_same &= bits(&raw[i * v..(i + 1) * v]) == bits(&logits[i * v..(i + 1) * v]);
        }
        run.raw.push(raw);
        run.logprobs.push(got.iter().map(|s| s.logprob.clone()).collect());
        for (i, s) in got.into_iter().enumerate() {
            assert!((s.token as usize) < valid, "row {i} step {k}: token {} past the valid ones", s.token);
            hs[i].observe(s.token);
            run.tokens[i].push(s.token);
        }
    }
    run
}

/// Checks a run's log-probabilities against the host reference of its raw logits: the returned
/// token's id, its log-probability and every top entry's within 1e-4 of the reference, the top
/// ids the reference's except where two ids' raw logits are within 1e-6 (a tie: either order is
/// right); rows that did not ask get none. Returns (rows checked, tied ids swapped, failures).
fn check_logprobs(run: &LogprobRun, params: &[SampleParams], valid: usize, v: usize) -> (usize, usize, Vec<String>) {
    let (mut checked, mut swapped, mut bad) = (0, 0, Vec::new());
    for (k, step) in run.logprobs.iter().enumerate() {
        for (i, got) in step.iter().enumerate() {
            let tok = run.tokens[i][k + 1];
            let (want, got) = match (params[i].logprobs_top(), got) {
                (None, None) => continue,
                (Some(top), Some(got)) => (logprobs(&run.raw[k][i * v..(i + 1) * v], valid, tok, top), got),
                (want, got) => {
                    bad.push(format!("step {k} row {i}: asked {want:?}, got {got:?}"));
                    continue;
                }
            };
            checked += 1;
            let raw = &run.raw[k][i * v..(i + 1) * v];
            let lse = {
                let m = raw[..valid].iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x)) as f64;
                m + raw[..valid].iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
            };
            let close = |id: u32, lp: f32| (lp as f64 - (raw[id as usize] as f64 - lse)).abs() <= 1e-4;
            if got.id != tok || !close(tok, got.logprob) || (got.logprob - want.logprob).abs() > 1e-4 || got.top.len() != want.top.len() {
                bad.push(format!("step {k} row {i} token {tok}: {got:?} vs {want:?}"));
                continue;
            }
            for (j, (g, w)) in got.top.iter().zip(&want.top).enumerate() {
                let tie = (raw[g.0 as usize] - raw[w.0 as usize]).abs() <= 1e-6;
                if (g.0 as usize) >= valid || !close(g.0, g.1) || (g.0 != w.0 && !tie) {
                    bad.push(format!("step {k} row {i} top {j}: {g:?} vs {w:?}"));
                }
                swapped += (g.0 != w.0) as usize;
            }
        }
    }
    (checked, swapped, bad)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_graph_logprobs() {
    let mut rng = Rng::new(83);
    let (gpu, v, valid, prompts) = sampling_setup(&mut rng, 40);
    // Row 0: the sampled token's logprob only; 1: none; 2: top 5 with a repetition penalty and
    // a large bias on two tokens (so the sampled token is often an adjusted one, whose logprob
    // must be of its raw logit); 3: top 20 with presence and frequency penalties; 4: top 20.
    let top = [Some(0), None, Some(5), Some(20), Some(20)];
    let hp = [
        SamplingParams::default(),
        SamplingParams::default(),
        SamplingParams { repetition_penalty: 1.5, ..Default::default() },
        SamplingParams { presence_penalty: 0.7, frequency_penalty: 0.9, ..Default::default() },
        SamplingParams::default(),
    ];
    let favoured: Vec<u32> = (0..2).map(|_| rng.below(valid) as u32).collect();
    let bias = |i: usize| -> Vec<(u32, f32)> { if i == 2 { favoured.iter().map(|&t| (t, 6.0)).collect() } else { Vec::new() } };
    let make = |f: &[u32]| samplers(&hp, &bias, &prompts, f);
    let greedy: Vec<SampleParams> = top.iter().map(|&t| SampleParams::greedy(valid).with_logprobs(t)).collect();
    // The sampled graph: rows 0, 2, 3 and 4 sample (seeded), row 1 is greedy.
    let sampled: Vec<SampleParams> = greedy
        .iter()
        .enumerate()
        .map(|(i, p)| if i == 1 { *p } else { SampleParams { temperature: 0.9, top_p: 0.95, seed: 40 + i as u64, ..*p } })
        .collect();
    let mut ok = true;
    for (what, params, steps) in [("greedy", &greedy, 12), ("sampled", &sampled, 40)] {
        let a = graph_decode_logprobs(&gpu, &prompts, steps, params, &make, valid);
        let b = graph_decode_logprobs(&gpu, &prompts, steps, params, &make, valid);
        let plain: Vec<SampleParams> = params.iter().map(|p| p.with_logprobs(None)).collect();
        let without = graph_decode_logprobs(&gpu, &prompts, steps, &plain, &make, valid);
        let (checked, swapped, bad) = check_logprobs(&a, params, valid, v);
        let seen = |k: usize, t: u32| favoured.contains(&t) || prompts[2].contains(&t) || a.tokens[2][..=k].contains(&t);
        let adjusted_chosen = (0..steps).filter(|&k| seen(k, a.tokens[2][k + 1])).count();
        let same_tokens = a.tokens == without.tokens;
        let reproducible = a.tokens == b.tokens && a.logprobs == b.logprobs;
        let none_without = without.logprobs.iter().flatten().all(Option::is_none);
        let pass = bad.is_empty() && checked == steps * 4 && same_tokens && reproducible && none_without && a.twin_same;
        println!(
            "PARITY {} batch graph with logprobs, {what}, {steps} steps: {checked} row steps against the host reference of the raw logits ({swapped} tied top ids swapped, row 2 sampled an adjusted token {adjusted_chosen} times), wrong {bad:?}; tokens as without logprobs {same_tokens}, reproducible {reproducible}, twin logits identical {}",
            if pass { "PASS" } else { "FAIL" },
            a.twin_same
        );
        ok &= pass;
    }
    assert!(ok);
}
