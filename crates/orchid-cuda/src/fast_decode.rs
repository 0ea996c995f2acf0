//! The engine's fast single-sequence decode on CUDA: [`GraphFastDecode`] implements
//! `orchid_model::FastDecode` with one [`DecodeGraph`] per (state slot, greedy/sampled), captured
//! on first use and kept for the life of the engine (a slot's state buffers never move, so a
//! graph stays valid when the slot is freed and handed to the next request).
//!
//! Synchronisation with the generic (op-level) path. A graph's inputs are device integers of its
//! own: the input token, the position and the step counter (the sampler writes the sampled token
//! into the input and advances position and counter). The KV cache and the GDN states are the
//! engine's `CudaState`, shared with the op-level path, and `DecodeGraph::launch` keeps the
//! slot's `attn_len` in step. The decoder mirrors each graph's input token / position / counter
//! on the host and uploads them only when the engine's step does not continue where the graph's
//! last step stopped (first step after a prefill, steps after a batched op-level stretch, a new
//! request in the slot): so consecutive fast steps need no host-to-device copy, and any
//! interleaving with `Model::forward` is correct.
//!
//! Sampling runs on the GPU (`kernels/sampling.cu`): greedy is the same argmax as the host
//! sampler (lowest id among equal maxima); temperature/top-k/top-p/min-p draw from a counter-based
//! generator keyed by (seed, token index), so seeded output is reproducible on this path but is
//! not the host sampler's random stream. A step under a grammar has a token mask, which only the
//! batch graphs read (`masks`): the engine sends such a sequence through `step_batch`, alone as a
//! batch of one if need be, and the batch graph asks for the masks once its forward pass runs.
//! Penalties and logit bias go the same way: a step with a logit adjustment list (at most
//! `logit_adjust::ROW_CAP` entries, `logit_adjust_cap`) runs through `step_batch`, whose sampling
//! graph applies the list to the row's logits before its sampler.

use std::collections::HashMap;

use orchid_model::Model;
use orchid_model::error::{Error, Result};
use orchid_model::fast_decode::{DecodeStep, DeviceSampling, FastDecode, LateInputs};

use crate::CudaBackend;
use crate::batch_graph::{BatchGraph, BatchRow, bucket_for};
use crate::decode_graph::DecodeGraph;
use crate::ops::sampling::SampleParams;
use crate::state::CudaState;

struct Cached {
    graph: DecodeGraph,
    params: SampleParams,
    /// What the graph's device input token holds (None: unknown, upload before the next step).
    token: Option<u32>,
    /// What its device step counter holds.
    counter: Option<usize>,
}

/// Cached decode graphs per (slot, greedy), and batched ones per (bucket, greedy); see the
/// module docs.
#[derive(Default)]
pub struct GraphFastDecode {
    graphs: HashMap<(usize, bool), Cached>,
    batches: HashMap<(usize, bool), BatchGraph>,
}

impl GraphFastDecode {
    pub fn new() -> GraphFastDecode {
        GraphFastDecode::default()
    }
}

/// The batched graph that runs `steps`: (bucket, all greedy).
fn batch_key(steps: &[DecodeStep]) -> (usize, bool) {
    (bucket_for(steps.len()), steps.iter().all(|s| s.sampling.is_greedy()))
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
        masked: 0,
    }
}

impl FastDecode<CudaBackend> for GraphFastDecode {
    fn name(&self) -> &str {
        "cuda graph"
    }

    fn prepare(&mut self, model: &Model<CudaBackend>, state: &mut CudaState, slot: usize, sampling: &DeviceSampling) -> Result<()> {
        let p = sample_params(sampling);
        let key = (slot, p.is_greedy());
        match self.graphs.get_mut(&key) {
            Some(c) => {
                if c.params != p {
                    c.graph.set_params(p)?;
                    c.params = p;
                }
            }
            None => {
                let t = std::time::Instant::now();
                let graph = DecodeGraph::new(model, state, slot, p)?;
                tracing::info!(
                    "decode graph for slot {slot} ({}) captured in {:.0} ms: {} kernels per step, pdl {}",
                    if key.1 { "greedy" } else { "sampled" },
                    t.elapsed().as_secs_f64() * 1e3,
                    graph.kernels_per_step,
                    graph.pdl
                );
                self.graphs.insert(key, Cached { graph, params: p, token: None, counter: None });
            }
        }
        Ok(())
    }

    fn step(&mut self, _model: &Model<CudaBackend>, state: &mut CudaState, step: &DecodeStep) -> Result<u32> {
        let p = sample_params(&step.sampling);
        let key = (step.slot, p.is_greedy());
        let c = self
            .graphs
            .get_mut(&key)
            .ok_or_else(|| Error::Op { op: "decode", msg: format!("no decode graph for slot {} (prepare first)", step.slot) })?;
        if c.params != p {
            return Err(Error::Op { op: "decode", msg: "the sampling parameters changed since prepare".into() });
        }
        if step.adjust > 0 {
            return Err(Error::Op { op: "decode", msg: "a single-sequence step takes no logit adjustments (step_batch does)".into() });
        }
        let r = (|| {
            if c.token != Some(step.token) || c.graph.pos_host != step.pos {
                c.token = None;
                c.graph.set_input(step.token, step.pos)?;
                c.token = Some(step.token);
            }
            // The counter only feeds the seeded generator.
            if !key.1 && c.counter != Some(step.index) {
                c.counter = None;
                c.graph.set_step(step.index)?;
                c.counter = Some(step.index);
            }
            c.graph.step(state)
        })();
        match r {
            Ok(tok) => {
                c.token = Some(tok);
                c.counter = c.counter.map(|n| n + 1);
                Ok(tok)
            }
            Err(e) => {
                c.token = None;
                c.counter = None;
                Err(e)
            }
        }
    }

    /// The batch graphs read a token mask per row (a lone masked sequence runs in the smallest
    /// bucket); the single-sequence graphs take none.
    fn masks(&self) -> bool {
        true
    }

    /// The batch graphs' adjustment table holds `ROW_CAP` entries per row.
    fn logit_adjust_cap(&self) -> usize {
        crate::logit_adjust::ROW_CAP
    }

    fn prepare_batch(&mut self, model: &Model<CudaBackend>, state: &mut CudaState, steps: &[DecodeStep]) -> Result<()> {
        let key = batch_key(steps);
        if let std::collections::hash_map::Entry::Vacant(slot) = self.batches.entry(key) {
            let t = std::time::Instant::now();
            let g = BatchGraph::new(model, state, key.0, key.1)?;
            tracing::info!(
                "batched decode graph for {} rows ({}) captured in {:.0} ms: {} nodes, pdl {}",
                key.0,
                if key.1 { "greedy" } else { "sampled" },
                t.elapsed().as_secs_f64() * 1e3,
                g.nodes,
                g.pdl
            );
            slot.insert(g);
        }
        Ok(())
    }

    fn step_batch(
        &mut self,
        _model: &Model<CudaBackend>,
        state: &mut CudaState,
        steps: &[DecodeStep],
        late: &mut dyn FnMut() -> LateInputs,
    ) -> Result<Vec<u32>> {
        let rows: Vec<BatchRow> = steps
            .iter()
            .map(|s| BatchRow { slot: s.slot, token: s.token, pos: s.pos, index: s.index, params: sample_params(&s.sampling) })
            .collect();
        let key = batch_key(steps);
        let graph = self
            .batches
            .get_mut(&key)
            .ok_or_else(|| Error::Op { op: "decode", msg: "no batched decode graph (prepare_batch first)".into() })?;
        // The single-sequence graphs' device inputs are stale once their slots moved on here.
        for s in steps {
            for greedy in [false, true] {
                if let Some(c) = self.graphs.get_mut(&(s.slot, greedy)) {
                    c.token = None;
                    c.counter = None;
                }
            }
        }
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
