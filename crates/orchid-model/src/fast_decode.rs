//! An optional, backend-specific fast path for decode steps: on CUDA, decode steps captured as
//! CUDA graphs with the sampling done on the GPU (`orchid_cuda::GraphFastDecode`: one graph per
//! slot for a lone sequence, and batch graphs that are captures of [`Model::forward`] for several
//! sequences at once). The engine (`orchid-engine`) uses it for its decoding sequences when their
//! sampling needs nothing the device sampler lacks; prefill, penalties and log-probabilities go
//! through [`Model::forward`] as before. The fast path works on the same `B::State` as the
//! generic path, so the engine may switch between the two at any step boundary.

use crate::backend::Backend;
use crate::error::Result;
use crate::model::Model;

/// The sampling a fast decoder must do on the device: temperature, top-k, top-p, min-p with a
/// seeded generator (the engine keeps repetition/presence/frequency penalties and
/// log-probabilities on its generic path). Semantics are those of the engine's host sampler;
/// greedy picks the lowest id among equal maxima.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSampling {
    /// ≤ 0: greedy.
    pub temperature: f32,
    /// 0: off; 1: greedy.
    pub top_k: usize,
    /// ≥ 1: off.
    pub top_p: f32,
    /// ≤ 0: off; keeps tokens with p ≥ min_p · p_max.
    pub min_p: f32,
    /// Seed of the device generator. It is counter based: the draw for generated token `i`
    /// depends only on (seed, i), not on the host sampler's random stream.
    pub seed: u64,
    /// Ids ≥ `valid` are never chosen (the tokenizer's vocabulary may be smaller than the
    /// model's padded one).
    pub valid: usize,
}

impl DeviceSampling {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// One decode step of one sequence.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeStep {
    /// The sequence's state slot.
    pub slot: usize,
    /// The input token (the last generated one) ...
    pub token: u32,
    /// ... at this position; the slot's state holds exactly `pos` positions before the step.
    pub pos: usize,
    /// Index of the token this step samples among the sequence's generated tokens (0 is the
    /// first token after the prompt); the counter of the seeded device generator.
    pub index: usize,
    pub sampling: DeviceSampling,
}

/// The token masks of a batched step (a grammar's), one entry per step in order; `None`: the row
/// may pick any token. A mask is `vocab.div_ceil(32)` words for the model's vocabulary: token `i`
/// is allowed when bit `i % 32` of word `i / 32` is set. The sampler treats every other token as
/// a logit of -inf before any of its filters (greedy picks the best allowed token; top-k, top-p
/// and min-p see only allowed ones).
pub type TokenMasks = Vec<Option<Vec<u32>>>;

/// A backend's fast single-sequence decoder (see the module docs). Implementations keep
/// whatever they cache per slot (captured graphs, device-side input token and position) and
/// must accept any interleaving with [`Model::forward`] on the same state: the engine passes
/// the input token and position of every step, and the implementation re-synchronises its
/// device copies when they differ from what its last step left there.
pub trait FastDecode<B: Backend> {
    /// A short name for logs, e.g. "cuda graph".
    fn name(&self) -> &str;

    /// Gets ready before the first request (e.g. captures the graphs for one sequence and for the
    /// largest batch the engine will form, `max_rows`), without changing any sequence's state.
    /// An error is logged and changes nothing: `prepare` and `prepare_batch` decide later.
    fn warm_up(&mut self, model: &Model<B>, state: &mut B::State, max_rows: usize) -> Result<()> {
        let _ = (model, state, max_rows);
        Ok(())
    }

    /// Gets ready to decode `slot` with `sampling` (e.g. captures a graph for the slot and
    /// caches it, or updates the cached graph's sampling parameters) without changing the
    /// sequence's state. An error means the fast path cannot be used: the engine logs it and
    /// goes on with the generic path.
    fn prepare(&mut self, model: &Model<B>, state: &mut B::State, slot: usize, sampling: &DeviceSampling) -> Result<()>;

    /// Runs `step.token` at `step.pos` through the model (advancing the slot's state by one
    /// position, exactly as `Model::forward` of that one token would), samples the next token
    /// on the device and returns it. Called after `prepare` with the same slot and sampling.
    /// After an error the sequence's state is undefined (the engine ends the request).
    fn step(&mut self, model: &Model<B>, state: &mut B::State, step: &DecodeStep) -> Result<u32>;

    /// Whether `step_batch` honours the [`TokenMasks`] it asks for (then the engine runs a
    /// sequence under a grammar through `step_batch`, alone as a batch of one if need be; `step`
    /// takes no mask). The default: no, such sequences take the generic path.
    fn masks(&self) -> bool {
        false
    }

    /// Gets ready to decode the sequences of `steps` together with `step_batch` (e.g. captures
    /// a graph for a batch of that size) without changing their states. `steps` holds one step
    /// or more (one: a sequence under a grammar, for a decoder that takes masks). An error means
    /// batched fast decoding cannot be used (the default: the decoder does one sequence at a
    /// time); the engine logs it once and runs batches through the generic path.
    fn prepare_batch(&mut self, model: &Model<B>, state: &mut B::State, steps: &[DecodeStep]) -> Result<()> {
        let _ = (model, state, steps);
        Err(crate::error::Error::Op { op: "decode", msg: format!("{} decodes one sequence at a time", self.name()) })
    }

    /// One decode step of several sequences at once (distinct slots; each step as in `step`,
    /// after a `prepare_batch` of the same steps): returns the sampled tokens in order. The
    /// steps' token masks come late, so that the caller computes them while the device runs the
    /// forward pass: the implementation calls `masks` exactly once, after it has issued the
    /// step's forward work and before it samples, and samples under what it returns (one entry
    /// per step; only a decoder whose [`masks`](Self::masks) is true gets any `Some`). An
    /// implementation that fails before it issues the forward work may return the error without
    /// calling `masks`. Like `step`, any interleaving with `Model::forward` and `step` on the
    /// same state is allowed; after an error the sequences' states are undefined.
    fn step_batch(
        &mut self,
        model: &Model<B>,
        state: &mut B::State,
        steps: &[DecodeStep],
        masks: &mut dyn FnMut() -> TokenMasks,
    ) -> Result<Vec<u32>>;
}
