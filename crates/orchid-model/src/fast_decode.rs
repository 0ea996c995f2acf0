//! An optional, backend-specific fast path for decode steps: on CUDA, decode steps captured as
//! CUDA graphs with the sampling done on the GPU (`orchid_cuda::GraphFastDecode`: one graph per
//! slot for a lone sequence, and batch graphs that are captures of [`Model::forward`] for several
//! sequences at once). The engine (`orchid-engine`) uses it for its decoding sequences when their
//! sampling needs nothing the device sampler lacks: grammar masks ([`TokenMasks`]), penalties and
//! logit bias ([`LogitAdjust`]) and log-probabilities ([`TokenLogprob`]) are part of a step, up to
//! what the decoder says it serves; prefill goes through [`Model::forward`]. The fast path works on
//! the same `B::State` as the generic path, so the engine may switch between the two at any step
//! boundary.

use crate::backend::Backend;
use crate::error::Result;
use crate::model::Model;

/// The sampling a fast decoder must do on the device: temperature, top-k, top-p, min-p with a
/// seeded generator (penalties and logit biases come as the step's [`LogitAdjust`] lists, see
/// [`FastDecode::logit_adjust_cap`]; log-probabilities as [`DecodeStep::logprobs`]).
/// Semantics are those of the engine's host sampler; greedy picks the lowest id among equal
/// maxima.
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
    /// At least as many entries as the step's logit adjustment list will have (its penalties and
    /// logit bias, see [`LogitAdjust`]); 0: the step has none. A step with adjustments runs
    /// through `step_batch` (`step` takes none), and only when this is at most the decoder's
    /// [`FastDecode::logit_adjust_cap`].
    pub adjust: usize,
    /// None: the step returns no log-probabilities; Some(n): the sampled token's and the n most
    /// likely tokens' (see [`TokenLogprob`]). A step that asks runs through `step_batch`, and only
    /// when n is at most the decoder's [`FastDecode::logprobs_cap`].
    pub logprobs: Option<usize>,
}

/// A sampled token's log-probability and the most likely tokens': the log-softmax of the model's
/// raw logits over the valid ids (before penalties, logit bias and grammar masks), with `top` the
/// requested number of most likely tokens, by logit descending, ties to the lower id.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What a fast decode step gives for one sequence: the sampled token, and its log-probabilities
/// when the step asked for them ([`DecodeStep::logprobs`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

impl Sampled {
    /// A token without log-probabilities.
    pub fn token(token: u32) -> Sampled {
        Sampled { token, logprob: None }
    }
}

/// The token masks of a batched step (a grammar's), one entry per step in order; `None`: the row
/// may pick any token. A mask is `vocab.div_ceil(32)` words for the model's vocabulary: token `i`
/// is allowed when bit `i % 32` of word `i / 32` is set. The sampler treats every other token as
/// a logit of -inf before any of its filters (greedy picks the best allowed token; top-k, top-p
/// and min-p see only allowed ones).
pub type TokenMasks = Vec<Option<Vec<u32>>>;

/// One token's logit adjustment in a row's list: the host sampler's penalties and logit bias in
/// per-token form, applied in its order before any filter (see [`apply`](Self::apply)). A list
/// holds each token once, in increasing id order; a token the list lacks is left alone. The
/// neutral values (bias -0.0, repetition 1, subtract +0.0) leave a logit bit for bit as it is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitAdjust {
    pub token: u32,
    /// Added first (`logit_bias`); -0.0: none.
    pub bias: f32,
    /// Then HF's repetition penalty: a positive logit is divided by it, any other multiplied;
    /// 1: none (a token neither in the prompt nor generated).
    pub repetition: f32,
    /// Then subtracted: presence + frequency · count over the generated tokens; +0.0: none.
    pub subtract: f32,
}

impl LogitAdjust {
    /// An entry that changes nothing.
    pub fn neutral(token: u32) -> LogitAdjust {
        LogitAdjust { token, bias: -0.0, repetition: 1.0, subtract: 0.0 }
    }

    /// The adjusted logit (the reference of the device kernel: each operation rounded once, in
    /// this order).
    pub fn apply(&self, x: f32) -> f32 {
        let x = x + self.bias;
        let x = if x > 0.0 { x / self.repetition } else { x * self.repetition };
        x - self.subtract
    }
}

/// Applies a row's adjustment list to its logits; entries at ids ≥ `valid` (or past the row) are
/// skipped.
pub fn apply_logit_adjust(logits: &mut [f32], valid: usize, list: &[LogitAdjust]) {
    let valid = valid.min(logits.len());
    for a in list {
        if (a.token as usize) < valid {
            logits[a.token as usize] = a.apply(logits[a.token as usize]);
        }
    }
}

/// What a batched step learns late (see [`FastDecode::step_batch`]): its rows' token masks and
/// logit adjustment lists.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LateInputs {
    /// One entry per step in order (see [`TokenMasks`]).
    pub masks: TokenMasks,
    /// One list per step in order (empty: the row has none), or no list at all when no row has
    /// any; only a decoder whose [`FastDecode::logit_adjust_cap`] is non-zero gets any, each at
    /// most that long and no longer than its step's [`DecodeStep::adjust`].
    pub adjust: Vec<Vec<LogitAdjust>>,
}

impl From<TokenMasks> for LateInputs {
    fn from(masks: TokenMasks) -> LateInputs {
        LateInputs { masks, adjust: Vec::new() }
    }
}

/// A backend's fast single-sequence decoder (see the module docs). Implementations keep
/// whatever they cache per slot (captured graphs, device-side input token and position) and
/// must accept any interleaving with [`Model::forward`] on the same state: the engine passes
/// the input token and position of every step, and the implementation re-synchronises its
/// device copies when they differ from what its last step left there.
pub trait FastDecode<B: Backend> {
    /// A short name for logs, e.g. "cuda graph".
    fn name(&self) -> &str;

    /// Sets aside, before the engine sizes its state, the device memory its steps of up to
    /// `max_rows` sequences will need (e.g. the decode graphs' workspace), so that the state is
    /// sized from what is left; returns the bytes set aside. An error is logged and changes
    /// nothing. The default sets nothing aside.
    fn reserve(&mut self, model: &Model<B>, max_rows: usize) -> Result<usize> {
        let _ = (model, max_rows);
        Ok(0)
    }

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
    /// on the device and returns it. Called after `prepare` with the same slot and sampling, for
    /// a step without adjustments and log-probabilities (those run through `step_batch`).
    /// After an error the sequence's state is undefined (the engine ends the request).
    fn step(&mut self, model: &Model<B>, state: &mut B::State, step: &DecodeStep) -> Result<Sampled>;

    /// Whether `step_batch` honours the [`TokenMasks`] it asks for (then the engine runs a
    /// sequence under a grammar through `step_batch`, alone as a batch of one if need be; `step`
    /// takes no mask). The default: no, such sequences take the generic path.
    fn masks(&self) -> bool {
        false
    }

    /// The longest logit adjustment list (penalties, logit bias: [`LogitAdjust`]) `step_batch`
    /// takes for a row; the engine runs a step whose [`DecodeStep::adjust`] is larger, or any
    /// such step when this is 0 (the default), on the generic path. Steps with adjustments run
    /// through `step_batch`, alone as a batch of one if need be.
    fn logit_adjust_cap(&self) -> usize {
        0
    }

    /// The most top tokens (`top_logprobs`) a step's log-probabilities may ask for
    /// ([`DecodeStep::logprobs`]); None (the default): the decoder computes none, and the engine
    /// runs sequences that want them on the generic path. Steps with log-probabilities run
    /// through `step_batch`, alone as a batch of one if need be.
    fn logprobs_cap(&self) -> Option<usize> {
        None
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
    /// after a `prepare_batch` of the same steps): returns the sampled tokens in order, with the
    /// log-probabilities of the steps that asked (of the raw logits, see [`TokenLogprob`]). The
    /// steps' token masks and logit adjustments come late, so that the caller computes them while
    /// the device runs the forward pass: the implementation calls `late` exactly once, after it
    /// has issued the step's forward work and before it samples, and samples under what it
    /// returns (see [`LateInputs`]: each row's logits adjusted by its list, then masked; only a
    /// decoder whose [`masks`](Self::masks) is true gets any `Some` mask). An implementation that
    /// fails before it issues the forward work may return the error without calling `late`. Like
    /// `step`, any interleaving with `Model::forward` and `step` on the same state is allowed;
    /// after an error the sequences' states are undefined.
    fn step_batch(
        &mut self,
        model: &Model<B>,
        state: &mut B::State,
        steps: &[DecodeStep],
        late: &mut dyn FnMut() -> LateInputs,
    ) -> Result<Vec<Sampled>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_adjust_rules() {
        let a = LogitAdjust { token: 1, bias: 0.5, repetition: 2.0, subtract: 0.25 };
        // (1 + 0.5) / 2 - 0.25; (-1 + 0.5) * 2 - 0.25.
        assert_eq!(a.apply(1.0), 0.5);
        assert_eq!(a.apply(-1.0), -1.25);
        // The neutral entry keeps every value bit for bit, signed zeros and infinities included.
        for x in [0.0f32, -0.0, 1.5, -3.25, f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE] {
            assert_eq!(LogitAdjust::neutral(0).apply(x).to_bits(), x.to_bits());
        }
        let mut l = vec![1.0f32, 2.0, 3.0];
        apply_logit_adjust(&mut l, 2, &[LogitAdjust { token: 0, ..a }, LogitAdjust { token: 2, ..a }, LogitAdjust { token: 9, ..a }]);
        assert_eq!(l, [0.5, 2.0, 3.0]);
    }
}
