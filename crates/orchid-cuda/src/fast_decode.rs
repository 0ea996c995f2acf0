//! The engine's fast decode on CUDA: [`GraphFastDecode`] implements `orchid_model::FastDecode`
//! with one [`BatchGraph`] per (bucket, greedy/sampled), captured on first use and kept for the
//! life of the engine. A lone sequence is a batch of one: the same capture of `Model::forward` as
//! every other bucket, so there is one model walk on the GPU, pinned to the sequence's state slot
//! (one graph per slot that has decoded alone; see `BatchGraph::new_pinned`). All the graphs
//! carve their step's temporaries from one arena (one step runs at a time), sized by the largest
//! bucket, which is captured first (`with_max_rows`).
//!
//! Synchronisation with the generic (op-level) path. A graph's inputs are device integers of its
//! own per row (input token, slot, position, step counter); its sampler writes each row's token
//! into the row's input and advances position and counter, and `BatchGraph::step` uploads the
//! inputs only when the engine's step does not continue where the graph's last step stopped. The
//! KV cache and the GDN states are the engine's `CudaState`, shared with the op-level path, and
//! the graph keeps each slot's `attn_len` in step: any interleaving with `Model::forward` is
//! correct.
//!
//! Sampling runs on the GPU (`kernels/sampling.cu`): greedy is the same argmax as the host
//! sampler (lowest id among equal maxima); temperature/top-k/top-p/min-p draw from a counter-based
//! generator keyed by (seed, token index), so seeded output is reproducible on this path but is
//! not the host sampler's random stream. A row under a grammar has a token mask, which the
//! graph asks for once its forward pass runs (`masks`). Penalties and logit bias go the same
//! way: a step with a logit adjustment list (at most `logit_adjust::ROW_CAP` entries,
//! `logit_adjust_cap`) runs through `step_batch`, whose sampling graph applies the list to the
//! row's logits before its sampler. So does a step that asks for log-probabilities (up to
//! `LOGPROB_TOP` top tokens, `logprobs_cap`): its sampling graph computes them from the raw logits
//! (`ops::logprobs`), and the lone-sequence step without them keeps its one graph launch.

use std::collections::HashMap;
use std::sync::Arc;

use orchid_model::backend::{StateOptions, StatePool};
use orchid_model::error::{Error, Result};
use orchid_model::fast_decode::{DecodeStep, DeviceSampling, FastDecode, LateInputs, Sampled};
use orchid_model::{BatchLayout, LogitRows, Model};

use crate::CudaBackend;
use crate::batch_graph::{BatchGraph, BatchRow, bucket_for};
use crate::driver::DevBuf;
use crate::ops::logprobs::LOGPROB_TOP;
use crate::ops::sampling::SampleParams;
use crate::state::CudaState;

/// Tokens of the prompt `warm_up` runs (a prompt's size in the serving benchmark and more).
const WARM_PROMPT: usize = 1024;

/// A prompt of `WARM_PROMPT` tokens through `Model::forward` on a scratch slot (its own small
/// state, in the memory the engine's state leaves): the prompt kernels' first launches and the
/// allocator's first growth happen at start, not in the first request's time to first token.
fn warm_prompt(model: &Model<CudaBackend>) -> Result<()> {
    let n = WARM_PROMPT;
    let opts = StateOptions { memory_utilization: 1.0, ..StateOptions::new(1, n + crate::state::KV_BLOCK) };
    let mut scratch = model.new_state(opts)?;
    let slot = scratch.alloc().ok_or_else(|| Error::Op { op: "warm-up", msg: "no slot in a scratch state".into() })?;
    let vocab = model.config.vocab_size.max(1);
    let ids: Vec<u32> = (0..n).map(|i| (i * 7919 % vocab) as u32).collect();
    model.forward(&ids, &BatchLayout::single(slot, 0, n), &mut scratch, LogitRows::LastOfEachSpan)?;
    drop(scratch);
    // Done before the engine reports ready, so that no request waits for it.
    model.backend.gpu().synchronize()
}

/// What a batch graph is captured for: its bucket, the slot a one-row graph is pinned to, and
/// whether it samples greedily.
type GraphKey = ((usize, Option<usize>), bool);

/// Batch graphs per `GraphKey` and their shared arena; see the module docs.
#[derive(Default)]
pub struct GraphFastDecode {
    batches: HashMap<GraphKey, BatchGraph>,
    arena: Option<Arc<DevBuf>>,
    /// The most rows a step will have (the engine's `max_seqs`; 0: unknown).
    max_rows: usize,
}

impl GraphFastDecode {
    pub fn new() -> GraphFastDecode {
        GraphFastDecode::default()
    }

    /// A decoder for steps of up to `max_rows` sequences: the first graph it needs is preceded
    /// by the largest bucket's, whose arena then serves every other bucket.
    pub fn with_max_rows(max_rows: usize) -> GraphFastDecode {
        GraphFastDecode { max_rows, ..GraphFastDecode::default() }
    }

    fn capture(&mut self, model: &Model<CudaBackend>, state: &mut CudaState, key: GraphKey) -> Result<()> {
        if self.batches.contains_key(&key) {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let g = BatchGraph::new_in(model, state, key.0, key.1, &mut self.arena)?;
        tracing::info!(
            "decode graph for {} rows{} ({}) captured in {:.0} ms: {} nodes, pdl {}, arena {:.1} MiB",
            key.0.0,
            key.0.1.map_or(String::new(), |s| format!(" (slot {s})")),
            if key.1 { "greedy" } else { "sampled" },
            t.elapsed().as_secs_f64() * 1e3,
            g.nodes,
            g.pdl,
            g.arena_bytes() as f64 / 1048576.0
        );
        self.batches.insert(key, g);
        Ok(())
    }
}

/// The batched graph that runs `steps`: (bucket, pinned slot of a lone step), all greedy.
fn batch_key(steps: &[DecodeStep]) -> GraphKey {
    let pinned = match steps {
        [s] => Some(s.slot),
        _ => None,
    };
    ((bucket_for(steps.len()), pinned), steps.iter().all(|s| s.sampling.is_greedy()))
}

/// The graph row of an engine step.
fn batch_row(s: &DecodeStep) -> BatchRow {
    BatchRow { slot: s.slot, token: s.token, pos: s.pos, index: s.index, params: sample_params(&s.sampling).with_logprobs(s.logprobs) }
}

/// The device sampler's parameters for `s` (greedy ones are normalised, so that requests that
/// differ only in unused fields do not re-upload them).
pub fn sample_params(s: &DeviceSampling) -> SampleParams {
    let valid = s.valid.min(i32::MAX as usize) as i32;
    if s.is_greedy() {
        return SampleParams { valid, ..Default::default() };
    }
    SampleParams {
        temperature: s.temperature,
        top_p: s.top_p,
        min_p: s.min_p,
        top_k: s.top_k.min(i32::MAX as usize) as i32,
        seed: s.seed,
        valid,
        ..Default::default()
    }
}

impl FastDecode<CudaBackend> for GraphFastDecode {
    fn name(&self) -> &str {
        "cuda graph"
    }

    /// The arena of the largest bucket's step, measured by capturing that step over a scratch
    /// state of one slot (its graphs are dropped; the arena stays for every later capture).
    fn reserve(&mut self, model: &Model<CudaBackend>, max_rows: usize) -> Result<usize> {
        self.max_rows = self.max_rows.max(max_rows);
        let mut scratch = model.new_state(StateOptions::new(1, crate::state::KV_BLOCK))?;
        BatchGraph::new_in(model, &mut scratch, (bucket_for(self.max_rows), None), true, &mut self.arena)?;
        Ok(self.arena.as_ref().map_or(0, |a| a.bytes))
    }

    /// The greedy graphs of the largest bucket (first: its arena serves every bucket), of every
    /// smaller bucket (a first burst of users then captures nothing; 7–40 ms each) and of one row
    /// in slot 0 (the slot a lone request gets); then `warm_prompt`.
    fn warm_up(&mut self, model: &Model<CudaBackend>, state: &mut CudaState, max_rows: usize) -> Result<()> {
        self.max_rows = self.max_rows.max(max_rows);
        let largest = bucket_for(self.max_rows);
        let mut rows = largest;
        while rows > 1 {
            self.capture(model, state, ((rows, None), true))?;
            rows /= 2;
        }
        self.capture(model, state, ((1, Some(0)), true))?;
        if let Err(e) = warm_prompt(model) {
            tracing::warn!("warm-up prompt failed ({e}); the first request's prompt pays its first launches");
        }
        Ok(())
    }

    fn prepare(&mut self, model: &Model<CudaBackend>, state: &mut CudaState, slot: usize, sampling: &DeviceSampling) -> Result<()> {
        self.prepare_batch(model, state, &[DecodeStep { slot, token: 0, pos: 0, index: 0, sampling: *sampling, adjust: 0, logprobs: None }])
    }

    /// A lone sequence without a grammar: the bucket-1 graph's one-launch step.
    fn step(&mut self, _model: &Model<CudaBackend>, state: &mut CudaState, step: &DecodeStep) -> Result<Sampled> {
        if step.adjust > 0 || step.logprobs.is_some() {
            let msg = "a single-sequence step takes no logit adjustments or log-probabilities (step_batch does)".into();
            return Err(Error::Op { op: "decode", msg });
        }
        let steps = std::slice::from_ref(step);
        let row = batch_row(step);
        let graph = self
            .batches
            .get_mut(&batch_key(steps))
            .ok_or_else(|| Error::Op { op: "decode", msg: "no decode graph for one row (prepare first)".into() })?;
        Ok(Sampled::token(graph.step_unmasked(state, &[row])?[0]))
    }

    /// The batch graphs read a token mask per row.
    fn masks(&self) -> bool {
        true
    }

    /// The batch graphs' adjustment table holds `ROW_CAP` entries per row.
    fn logit_adjust_cap(&self) -> usize {
        crate::logit_adjust::ROW_CAP
    }

    /// The batch graphs' logprob kernels keep `LOGPROB_TOP` top tokens per row.
    fn logprobs_cap(&self) -> Option<usize> {
        Some(LOGPROB_TOP)
    }

    fn prepare_batch(&mut self, model: &Model<CudaBackend>, state: &mut CudaState, steps: &[DecodeStep]) -> Result<()> {
        let key = batch_key(steps);
        let largest = bucket_for(self.max_rows);
        if self.arena.is_none() && largest > key.0.0 {
            self.capture(model, state, ((largest, None), key.1))?;
        }
        self.capture(model, state, key)
    }

    fn step_batch(
        &mut self,
        _model: &Model<CudaBackend>,
        state: &mut CudaState,
        steps: &[DecodeStep],
        late: &mut dyn FnMut() -> LateInputs,
    ) -> Result<Vec<Sampled>> {
        let rows: Vec<BatchRow> = steps.iter().map(batch_row).collect();
        let key = batch_key(steps);
        let graph = self
            .batches
            .get_mut(&key)
            .ok_or_else(|| Error::Op { op: "decode", msg: "no decode graph for this batch (prepare_batch first)".into() })?;
        graph.step_late(state, &rows, late)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_sampler_parameters() {
        let s = DeviceSampling { temperature: 0.7, top_k: 40, top_p: 0.9, min_p: 0.05, seed: 42, valid: 1000 };
        let p = sample_params(&s);
        assert_eq!((p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.valid), (0.7, 40, 0.9, 0.05, 42, 1000));
        assert!(!p.is_greedy());
        // Greedy requests map to one parameter set whatever their other fields (no re-upload).
        let g1 = sample_params(&DeviceSampling { temperature: 0.0, ..s });
        let g2 = sample_params(&DeviceSampling { top_k: 1, seed: 7, ..s });
        assert!(g1.is_greedy() && g1 == g2 && g1 == SampleParams::greedy(1000));
        assert_eq!(sample_params(&DeviceSampling { top_k: usize::MAX, ..s }).top_k, i32::MAX);
    }
}
