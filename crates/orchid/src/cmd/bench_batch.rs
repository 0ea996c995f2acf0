//! `orchid bench --batch`: the batched decode step on its own (no server): for each batch size
//! B, B sequences are prefilled with distinct synthetic prompts of `--batch-context` tokens, then
//! the batch graph (`orchid_cuda::BatchGraph`, greedy) runs `--decode` steps; reported: the step
//! time and the aggregate decode tok/s (median of `--runs`), and with `--profile` the per-kernel
//! times of the first prefill call (the shape of a served prefill step) and of one step.

use std::time::Instant;

use anyhow::{Context, Result};
use orchid_cuda::{BatchGraph, BatchRow, CudaBackend, SampleParams};
use orchid_model::{Backend, BatchLayout, LogitRows, Model, SeqSpan, StateOptions, StatePool};
use serde_json::json;

use super::bench::prompt_token;

/// Sequences per prefill call: 16 × 512 tokens is one served prefill step at the default budget
/// of a large GPU (8,192 tokens).
const PREFILL_GROUP: usize = 16;

pub fn batch_decode(
    m: &Model<CudaBackend>,
    sizes: &[usize],
    context: usize,
    steps: usize,
    runs: usize,
    profile: bool,
) -> Result<serde_json::Value> {
    let v = m.config.vocab_size;
    let gpu = m.backend.gpu().clone();
    let mut out = Vec::new();
    for &n in sizes {
        let mut state = m.new_state(StateOptions::new(n, context + steps * (runs + 2) + 8))?;
        let slots: Vec<usize> = (0..n).map(|_| state.alloc().context("state slot")).collect::<Result<_>>()?;
        // Prefill, PREFILL_GROUP sequences per forward call; with `profile`, the first call's
        // kernels (at 512-token contexts: a served prefill step of the default budget).
        let mut first = Vec::new();
        let mut prefill_profile = None;
        for (gi, group) in slots.chunks(PREFILL_GROUP).enumerate() {
            let mut ids = Vec::new();
            let mut spans = Vec::new();
            for &s in group {
                ids.extend((0..context).map(|i| prompt_token(i + 7919 * s, v)));
                spans.push(SeqSpan { slot: s, start: 0, len: context });
            }
            let profiled = profile && gi == 0;
            if profiled {
                gpu.synchronize()?;
                orchid_cuda::driver::profile_begin(&gpu)?;
            }
            let t0 = Instant::now();
            let l = m.backend.to_host(&m.forward(&ids, &BatchLayout { spans }, &mut state, LogitRows::LastOfEachSpan)?)?;
            if profiled {
                let wall = t0.elapsed().as_secs_f64() * 1e3;
                let ev = orchid_cuda::driver::profile_end();
                let rows = orchid_cuda::driver::profile_summary(&ev)?;
                let title = format!("prefill of {} sequences x {context} tokens (eager)", group.len());
                prefill_profile = Some(super::bench::profile_table(&title, &rows, wall));
            }
            first.extend(l.chunks(v).map(|r| (0..v).max_by(|&a, &b| r[a].total_cmp(&r[b]).then(b.cmp(&a))).unwrap_or(0) as u32));
        }
        let bucket = orchid_cuda::batch_graph::bucket_for(n);
        let mut g =
            if profile { BatchGraph::new_profiled(m, &mut state, bucket, true)? } else { BatchGraph::new(m, &mut state, bucket, true)? };
        let mut rows: Vec<BatchRow> = slots
            .iter()
            .zip(&first)
            .map(|(&slot, &token)| BatchRow { slot, token, pos: context, index: 1, params: SampleParams::greedy(v) })
            .collect();
        let mut run = |k: usize, rows: &mut Vec<BatchRow>| -> Result<f64> {
            gpu.synchronize()?;
            let t = Instant::now();
            for _ in 0..k {
                let toks = g.step(&mut state, rows, &mut || vec![None; n])?;
                for (r, t) in rows.iter_mut().zip(toks) {
                    r.token = t;
                    r.pos += 1;
                    r.index += 1;
                }
            }
            Ok(t.elapsed().as_secs_f64() / k as f64)
        };
        run(2, &mut rows)?;
        let mut times: Vec<f64> = (0..runs.max(1)).map(|_| run(steps, &mut rows)).collect::<Result<_>>()?;
        times.sort_by(f64::total_cmp);
        let step_s = times[times.len() / 2];
        let tok_s = n as f64 / step_s;
        eprintln!("batch {n:>3} (bucket {bucket}, {} graph nodes, pdl {}): step {:.2} ms, {tok_s:.0} tok/s", g.nodes, g.pdl, step_s * 1e3);
        let mut r = json!({"batch": n, "bucket": bucket, "graph_nodes": g.nodes, "pdl": g.pdl, "context": context, "step_ms": step_s * 1e3, "tok_s": tok_s});
        if profile {
            let p = g.profile_summary()?;
            let total: f64 = p.iter().map(|x| x.2).sum();
            eprintln!("  kernels of one step: {total:.3} ms");
            for x in p.iter().take(24) {
                eprintln!("  {:<24} {:>5} launches {:>9.3} ms {:>5.1}%", x.0, x.1, x.2, 100.0 * x.2 / total);
            }
            r["profile"] = json!(p.iter().map(|x| json!({"kernel": x.0, "launches": x.1, "ms": x.2})).collect::<Vec<_>>());
            r["prefill_profile"] = prefill_profile.unwrap_or_default();
        }
        out.push(r);
    }
    Ok(json!(out))
}
