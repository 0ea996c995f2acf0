//! Batched decode: one token of each of up to `bucket` sequences per step, as two CUDA graphs:
//! a capture of `Model::forward` over a batch of single-token spans, then one of the sampling of
//! every row on the GPU with the row's own parameters and, for a row under a grammar, its token
//! mask, after the row's penalties and logit bias (a sparse per-token list, `logit_adjust`). The
//! host launches the forward graph, gets the masks and lists meanwhile (the engine computes them
//! on the CPU while the GPU runs the forward pass), uploads them, and launches the sampling graph.
//! A step in which a row asks for log-probabilities launches a second capture of the sampling
//! instead, with the logprob kernels around it (`ops::logprobs`: the raw logits' log-sum-exp and
//! top tokens before the adjustments, the sampled token's log-probability after the sampler), and
//! reads every row's token with the log-probabilities in one download.
//!
//! The graphs read their inputs from device buffers (`DeviceBatch`: token ids, state slots,
//! positions, plus each row's step counter, sampling parameters and mask), so one capture per
//! bucket size serves whatever sequences are running; rows past the running ones are padding
//! (slot −1: their attention and GDN blocks write zeros and touch no state). A graph of one row
//! may instead be pinned to a state slot (`new_pinned`): its kernels get that slot's state
//! addresses as arguments, which saves each attention and GDN kernel a dependent load before its
//! state requests (a lone sequence's step is a chain of ~200 latency-bound kernels). The
//! temporaries of both graphs are carved from one arena (`Arena`), which never reuses memory:
//! the logits the forward graph leaves there are still intact when the sampling graph reads them.
//! Graphs of different buckets may share one arena (`new_in`): only one step runs at a time, and
//! a step's temporaries are dead once its tokens are read. Between replays the host does what
//! the captured walk cannot: it makes sure every row's KV blocks exist and keeps the per-layer
//! cache lengths in step, as the eager decode-rows path would (`decode_rows`).

use std::sync::Arc;

use orchid_model::Model;
use orchid_model::batch::{BatchLayout, LogitRows, SeqSpan};
use orchid_model::error::{Error, Result};
use orchid_model::fast_decode::{LateInputs, Sampled, TokenMasks};

use crate::CudaBackend;
use crate::decode_rows::DeviceBatch;
use crate::driver::{Arena, DevBuf, Graph};
use crate::logit_adjust::AdjustTable;
use crate::ops::{Ctx, logprobs as lp, sampling as sp};
use crate::state::CudaState;

/// One running sequence's decode step (its token mask comes later, see `BatchGraph::step`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchRow {
    pub slot: usize,
    /// Input token, at position `pos` (the slot holds `pos` positions before the step).
    pub token: u32,
    pub pos: usize,
    /// The generator's counter for the sampled token (its index among the generated ones).
    pub index: usize,
    pub params: sp::SampleParams,
}

pub struct BatchGraph {
    ctx: Arc<Ctx>,
    pub bucket: usize,
    pub greedy: bool,
    /// The state slot a one-row graph is pinned to (`new_pinned`); None: any slots.
    pub pinned: Option<usize>,
    /// The forward pass over the rows; it leaves the logits in the arena ...
    forward: Graph,
    /// ... where the sampling of every row reads them.
    sample: Graph,
    /// The same sampling with the rows' log-probabilities around it, for steps in which a row
    /// asks for them (`SampleParams::logprobs`).
    sample_logprobs: Graph,
    /// Both in one graph, the sampler chained to the forward pass, for steps without masks (a
    /// lone sequence's: `step_unmasked`); its temporaries are carved from the same arena, at the
    /// same places (the two kinds of step never run at once). None in a profiled graph.
    whole: Option<Graph>,
    /// i32 [4, bucket]: token ids, slots, positions, step counters. The sampling graph writes each
    /// row's token into its id and advances its position and step counter, so a step that goes
    /// on where the last one stopped needs no upload (`continued`).
    inputs: DevBuf,
    /// What `inputs` holds for the rows after the last step (None: unknown, upload).
    continued: Option<Vec<BatchRow>>,
    /// The forward graph's logits [bucket, vocab] f32, in the arena.
    logits: u64,
    vocab: usize,
    params: DevBuf,
    /// u32 [bucket, words]: the rows' token masks (read for rows whose parameters say `masked`).
    /// `params` and `masks` are read by the sampling graph only.
    masks: DevBuf,
    /// Words per mask row: vocab.div_ceil(32).
    words: usize,
    /// The rows' logit adjustments (read by the sampling graph, before its sampler).
    adjust: AdjustTable,
    /// u32 [bucket, LOGPROB_ROW_WORDS]: what `sample_logprobs` leaves, every row's token and the
    /// log-probabilities of the rows that asked.
    lp_out: DevBuf,
    /// Sampling scratch (kept for the graph's lifetime).
    _partial: DevBuf,
    _counters: DevBuf,
    _lp_partial: DevBuf,
    host_params: Vec<sp::SampleParams>,
    /// Staging of the masked rows' words for their one upload.
    host_masks: Vec<u32>,
    /// Nodes of both graphs.
    pub nodes: usize,
    /// Whether the forward graph's kernels are chained by programmatic dependent launch.
    pub pdl: bool,
    /// The step's temporaries, both graphs' (see `Arena`).
    arena: Option<Arc<DevBuf>>,
    /// Per-launch timing events when captured with `profile` (see `profile_summary`).
    prof: Vec<(&'static str, crate::driver::Event)>,
}

impl BatchGraph {
    /// Captures the decode step of `bucket` rows, sampling greedily or with the general sampler.
    pub fn new(model: &Model<CudaBackend>, state: &mut CudaState, bucket: usize, greedy: bool) -> Result<BatchGraph> {
        Self::build(model, state, (bucket, None), greedy, false, &mut None)
    }

    /// The decode step of the one sequence in state slot `slot` (see the module docs).
    pub fn new_pinned(model: &Model<CudaBackend>, state: &mut CudaState, slot: usize, greedy: bool) -> Result<BatchGraph> {
        Self::build(model, state, (1, Some(slot)), greedy, false, &mut None)
    }

    /// Like `new` (`pinned`: like `new_pinned`, with one row), with the step's temporaries in
    /// `arena` when it is large enough; else in a new arena, which replaces it there (graphs
    /// captured in the old one keep it alive).
    pub fn new_in(
        model: &Model<CudaBackend>,
        state: &mut CudaState,
        (bucket, pinned): (usize, Option<usize>),
        greedy: bool,
        arena: &mut Option<Arc<DevBuf>>,
    ) -> Result<BatchGraph> {
        Self::build(model, state, (bucket, pinned), greedy, false, arena)
    }

    /// Like `new`, with a timing event after every launch of the step (slower; for profiles).
    pub fn new_profiled(model: &Model<CudaBackend>, state: &mut CudaState, bucket: usize, greedy: bool) -> Result<BatchGraph> {
        Self::build(model, state, (bucket, None), greedy, true, &mut None)
    }

    /// Bytes of the arena the graph's temporaries are carved from.
    pub fn arena_bytes(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.bytes)
    }

    /// Time per kernel name over the last replayed step: (name, launches, ms), largest first. The
    /// sampling kernel's time counts from the end of the forward graph's last kernel, so it
    /// includes the host's gap between the two launches (the masks, their upload).
    pub fn profile_summary(&self) -> Result<Vec<(&'static str, usize, f64)>> {
        crate::driver::profile_summary(&self.prof)
    }

    fn build(
        model: &Model<CudaBackend>,
        state: &mut CudaState,
        (bucket, pinned): (usize, Option<usize>),
        greedy: bool,
        profile: bool,
        shared: &mut Option<Arc<DevBuf>>,
    ) -> Result<BatchGraph> {
        let b = &model.backend;
        let ctx = b.ctx.clone();
        let gpu = ctx.gpu.clone();
        gpu.bind()?;
        let cfg = &model.config;
        let v = cfg.vocab_size;
        if bucket == 0 {
            return Err(Error::Op { op: "batch decode", msg: "an empty bucket".into() });
        }
        if let Some(slot) = pinned
            && (bucket != 1 || slot >= state.capacity())
        {
            return Err(Error::Op { op: "batch decode", msg: format!("a graph of {bucket} rows pinned to slot {slot}") });
        }
        let i32s = |n: usize| DevBuf::zeros(&gpu, n * 4);
        let inputs = i32s(4 * bucket)?;
        let host_params = vec![sp::SampleParams::greedy(v); bucket];
        let params = DevBuf::from_slice(&gpu, &host_params)?;
        let words = v.div_ceil(32);
        let masks = DevBuf::zeros(&gpu, bucket * words * 4)?;
        let adjust = AdjustTable::new(&gpu, bucket)?;
        let partial = DevBuf::zeros(&gpu, bucket * sp::ARGMAX_BLOCKS * 8)?;
        let counters = i32s(bucket)?;
        let lp_partial = DevBuf::zeros(&gpu, bucket * lp::LOGPROB_BLOCKS * lp::LOGPROB_PARTIAL_BYTES)?;
        let lp_out = DevBuf::zeros(&gpu, bucket * lp::LOGPROB_ROW_WORDS * 4)?;
        // Padding everywhere until the first step says otherwise.
        inputs.upload(bucket * 4, bytemuck::cast_slice(&vec![-1i32; bucket]))?;
        // Everything the capture needs must exist before it starts.
        if cfg.num_attention_layers() > 0 {
            b.inv_freq(cfg.attention.rope_theta, cfg.attention.rotary_dim)?;
        }
        gpu.synchronize()?;
        let at = |i: usize| inputs.ptr + (i * bucket * 4) as u64;
        b.set_device_batch(Some(DeviceBatch { ids: at(0), slots: at(1), pos: at(2), rows: bucket, pinned }));
        let layout = BatchLayout { spans: (0..bucket).map(|i| SeqSpan { slot: pinned.unwrap_or(i), start: 0, len: 1 }).collect() };
        let ids = vec![0u32; bucket];
        let sample = sp::SampleArgs {
            logits: 0,
            params: params.ptr,
            partial: partial.ptr,
            counter: counters.ptr,
            token_out: at(0),
            pos: at(2),
            step: at(3),
            mask: masks.ptr,
            vocab: v as i32,
            nblocks: sp::ARGMAX_BLOCKS as i32,
        };
        let adjust_args = sp::AdjustArgs {
            logits: 0,
            offsets: adjust.offsets(),
            entries: adjust.entries(),
            params: params.ptr,
            saved: 0,
            vocab: v as i32,
            pad: 0,
        };
        let logprob_args = lp::LogprobArgs {
            logits: 0,
            params: params.ptr,
            partial: lp_partial.ptr,
            tokens: at(0),
            offsets: adjust.offsets(),
            entries: adjust.entries(),
            saved: adjust.saved(),
            out: lp_out.ptr,
            vocab: v as i32,
            pad: 0,
        };
        let shape = StepShape { ids: &ids, layout: &layout, sample, adjust: adjust_args, logprobs: logprob_args, greedy };
        // First captures with ordinary allocations, to measure them; then the real ones with
        // every temporary of both graphs in one arena, the forward pass chained by programmatic
        // dependent launch where every kernel of the walk allows it (falling back to plain
        // launches if the driver refuses).
        let mut prof = Vec::new();
        let mut capture = |arena: Arena, pdl: bool, prof: &mut Vec<_>| {
            Arena::with(arena, || {
                if profile {
                    crate::driver::profile_begin_capture()?;
                }
                let r = shape.capture_pair(model, state, pdl);
                if profile {
                    *prof = crate::driver::profile_end();
                }
                r
            })
        };
        let measured = capture(Arena::Measure(0), false, &mut prof);
        let (graphs, arena, pdl) = match measured {
            (Err(e), _) => (Err(e), None, false),
            (Ok(first), m) => {
                drop(first);
                let arena = match shared.as_ref().filter(|a| a.bytes >= m.bytes()) {
                    Some(a) => a.clone(),
                    None => Arc::new(DevBuf::alloc(&gpu, m.bytes())?),
                };
                *shared = Some(arena.clone());
                let carve = || Arena::Carve { base: arena.ptr, size: arena.bytes, used: 0 };
                let pdl = !profile && ctx.pdl;
                let mut r = capture(carve(), pdl, &mut prof).0;
                if let (Err(e), true) = (&r, pdl) {
                    tracing::warn!("batch decode graph with programmatic dependent launch failed ({e}); capturing without it");
                    r = capture(carve(), false, &mut prof).0;
                }
                let pdl = pdl && r.is_ok();
                (r, Some(arena), pdl)
            }
        };
        let whole = match (&graphs, &arena, profile) {
            (Ok(_), Some(arena), false) => {
                let carve = Arena::Carve { base: arena.ptr, size: arena.bytes, used: 0 };
                let r = Arena::with(carve, || shape.capture_whole(model, state, pdl)).0;
                if let Err(e) = &r {
                    b.set_device_batch(None);
                    return Err(Error::Op { op: "batch decode", msg: format!("capturing the one-graph step: {e}") });
                }
                r.ok()
            }
            _ => None,
        };
        b.set_device_batch(None);
        let (forward, sample, logits) = graphs?;
        // Launches only (its buffers are the graph's own), so outside the arena and the profile.
        let sample_logprobs = Graph::capture(&gpu, || shape.sample(model, logits, true, true))?;
        let nodes = whole.as_ref().map_or(forward.num_nodes() + sample.num_nodes(), Graph::num_nodes);
        tracing::debug!("batch decode graph: {bucket} rows, {nodes} nodes, greedy {greedy}, pdl {pdl}");
        Ok(BatchGraph {
            ctx,
            bucket,
            greedy,
            pinned,
            forward,
            sample,
            sample_logprobs,
            whole,
            inputs,
            continued: None,
            logits,
            vocab: v,
            params,
            masks,
            words,
            adjust,
            lp_out,
            _partial: partial,
            _counters: counters,
            _lp_partial: lp_partial,
            host_params,
            host_masks: Vec::new(),
            nodes,
            pdl,
            prof,
            arena,
        })
    }

    /// `step` of rows none of which has a token mask or logit adjustments: one graph launch
    /// (where captured, and when no row asks for log-probabilities).
    pub fn step_unmasked(&mut self, state: &mut CudaState, rows: &[BatchRow]) -> Result<Vec<u32>> {
        if self.whole.is_none() || rows.iter().any(|r| r.params.logprobs > 0) {
            return self.step(state, rows, &mut || vec![None; rows.len()]);
        }
        self.begin(state, rows)?;
        self.set_params(rows, &vec![None; rows.len()])?;
        self.whole.as_ref().expect("checked above").launch(&self.ctx.gpu)?;
        Ok(self.finish(rows, false)?.into_iter().map(|s| s.token).collect())
    }

    /// Runs one decode step of `rows` (at most `bucket`, distinct slots) and returns the sampled
    /// tokens in row order. The rows' states advance by one position. The step's inputs are
    /// copied before the forward graph's launch; `masks` is called once that graph runs (its
    /// work overlaps the GPU's), and the rows' masks (one entry per row, see `TokenMasks`) and
    /// changed parameters are copied before the sampling graph's.
    pub fn step(&mut self, state: &mut CudaState, rows: &[BatchRow], masks: &mut dyn FnMut() -> TokenMasks) -> Result<Vec<u32>> {
        Ok(self.step_late(state, rows, &mut || masks().into())?.into_iter().map(|s| s.token).collect())
    }

    /// `step` with the rows' logit adjustments and log-probabilities: `late` is called where
    /// `step` calls `masks`, and each row's list (see `LateInputs`; at most
    /// `logit_adjust::ROW_CAP` entries) is copied with the masks and applied to the row's logits
    /// before its mask and sampler. A row whose parameters ask for log-probabilities
    /// (`SampleParams::with_logprobs`, at most `LOGPROB_TOP` top tokens) gets those of its raw
    /// logits (before its list and mask) with its token.
    pub fn step_late(&mut self, state: &mut CudaState, rows: &[BatchRow], late: &mut dyn FnMut() -> LateInputs) -> Result<Vec<Sampled>> {
        let n = rows.len();
        self.begin(state, rows)?;
        let logprobs = rows.iter().any(|r| r.params.logprobs > 0);
        self.forward.launch(&self.ctx.gpu)?;
        let LateInputs { masks, adjust } = late();
        if !adjust.is_empty() && adjust.len() != n {
            return Err(Error::Op { op: "batch decode", msg: format!("{} logit adjustment lists for {n} rows", adjust.len()) });
        }
        if masks.len() != n {
            return Err(Error::Op { op: "batch decode", msg: format!("{} token masks for {n} rows", masks.len()) });
        }
        if let Some(m) = masks.iter().flatten().find(|m| m.len() != self.words) {
            return Err(Error::Op { op: "batch decode", msg: format!("a token mask of {} words, not {}", m.len(), self.words) });
        }
        // The uploads below are queued on the graphs' stream (`DevBuf::upload`:
        // cuMemcpyHtoDAsync on `Gpu::stream`), so they land after the forward graph and before
        // the sampling graph, the only reader of `params` and `masks`; the previous step's
        // sampling graph finished before its tokens came back. (From pageable memory the driver
        // may wait for the forward graph before it stages a copy: the masks are ready by then.)
        self.set_params(rows, &masks)?;
        // The masked rows' masks, in one copy from the first masked row to the last.
        let masked: Vec<usize> = (0..n).filter(|&i| masks[i].is_some()).collect();
        if let (Some(&lo), Some(&hi)) = (masked.first(), masked.last()) {
            let w = self.words;
            self.host_masks.resize((hi + 1 - lo) * w, 0);
            for &i in &masked {
                self.host_masks[(i - lo) * w..(i - lo + 1) * w].copy_from_slice(masks[i].as_deref().expect("a masked row"));
            }
            self.masks.upload(lo * w * 4, bytemuck::cast_slice(&self.host_masks))?;
        }
        self.adjust.upload(&adjust)?;
        let sample = if logprobs { &self.sample_logprobs } else { &self.sample };
        sample.launch(&self.ctx.gpu)?;
        self.finish(rows, logprobs)
    }

    /// Checks the rows, extends their KV blocks, uploads the inputs unless the step continues
    /// the last one, and counts the step's position in the cache lengths.
    fn begin(&mut self, state: &mut CudaState, rows: &[BatchRow]) -> Result<()> {
        let n = rows.len();
        if n == 0 || n > self.bucket {
            return Err(Error::Op { op: "batch decode", msg: format!("{n} rows for a graph of {}", self.bucket) });
        }
        if let Some(slot) = self.pinned.filter(|&s| s != rows[0].slot) {
            return Err(Error::Op { op: "batch decode", msg: format!("slot {} in a graph pinned to slot {slot}", rows[0].slot) });
        }
        if let Some(top) = rows.iter().filter_map(|r| r.params.logprobs_top()).find(|&t| t > lp::LOGPROB_TOP) {
            return Err(Error::Op { op: "batch decode", msg: format!("{top} top log-probabilities, at most {}", lp::LOGPROB_TOP) });
        }
        self.ctx.gpu.bind()?;
        for r in rows {
            state.ensure_capacity(r.slot, r.pos + 1)?;
            let s = state.slot(r.slot)?;
            if s.attn_len.iter().any(|&l| l != r.pos) {
                return Err(Error::Op {
                    op: "batch decode",
                    msg: format!("slot {}: the cache holds {:?} tokens, the step is at position {}", r.slot, s.attn_len, r.pos),
                });
            }
        }
        if self.continued.as_deref() != Some(rows) {
            self.continued = None;
            let bk = self.bucket;
            let mut input = vec![0i32; 4 * bk];
            input[bk..2 * bk].fill(-1);
            for (i, r) in rows.iter().enumerate() {
                input[i] = r.token as i32;
                input[bk + i] = r.slot as i32;
                input[2 * bk + i] = r.pos as i32;
                input[3 * bk + i] = r.index.min(i32::MAX as usize) as i32;
            }
            self.inputs.upload(0, bytemuck::cast_slice(&input))?;
        }
        self.continued = None;
        for r in rows {
            state.slot_mut(r.slot)?.attn_len.iter_mut().for_each(|l| *l += 1);
        }
        Ok(())
    }

    /// Uploads the rows' sampling parameters where they changed (`masked` from `masks`); the
    /// padding rows ask for no log-probabilities.
    fn set_params(&mut self, rows: &[BatchRow], masks: &TokenMasks) -> Result<()> {
        let mut changed = false;
        for (i, r) in rows.iter().enumerate() {
            let p = sp::SampleParams { masked: masks[i].is_some() as i32, ..r.params };
            if self.host_params[i] != p {
                self.host_params[i] = p;
                changed = true;
            }
        }
        for p in &mut self.host_params[rows.len()..] {
            if p.logprobs != 0 {
                p.logprobs = 0;
                changed = true;
            }
        }
        if changed {
            self.params.upload(0, bytemuck::cast_slice(&self.host_params))?;
        }
        Ok(())
    }

    /// Reads the sampled tokens (with the log-probabilities, from `lp_out`, after a step that
    /// computed them) and notes what the device inputs now hold.
    fn finish(&mut self, rows: &[BatchRow], logprobs: bool) -> Result<Vec<Sampled>> {
        let n = rows.len();
        let out: Vec<Sampled> = if logprobs {
            let mut w = vec![0u32; n * lp::LOGPROB_ROW_WORDS];
            self.lp_out.download(0, bytemuck::cast_slice_mut(&mut w))?;
            w.chunks(lp::LOGPROB_ROW_WORDS)
                .map(|row| {
                    let (token, logprob) = lp::parse_row(row);
                    Sampled { token, logprob }
                })
                .collect()
        } else {
            let mut t = vec![0i32; n];
            self.inputs.download(0, bytemuck::cast_slice_mut(&mut t))?;
            t.into_iter().map(|t| Sampled::token(t as u32)).collect()
        };
        self.continued =
            Some(rows.iter().zip(&out).map(|(r, s)| BatchRow { token: s.token, pos: r.pos + 1, index: r.index + 1, ..*r }).collect());
        Ok(out)
    }

    /// The logits of the first `rows` rows of the last step, [rows, vocab] (for tests).
    pub fn logits(&self, rows: usize) -> Result<Vec<f32>> {
        let mut v = vec![0f32; rows.min(self.bucket) * self.vocab];
        crate::driver::download_raw(&self.ctx.gpu, self.logits, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }
}

/// What a capture of the step records: the rows' (placeholder) token ids and single-token layout,
/// the sampling, logit-adjustment and log-probability arguments of row 0 (but for the logits),
/// and the sampler.
struct StepShape<'a> {
    ids: &'a [u32],
    layout: &'a BatchLayout,
    sample: sp::SampleArgs,
    adjust: sp::AdjustArgs,
    logprobs: lp::LogprobArgs,
    greedy: bool,
}

impl StepShape<'_> {
    /// The forward pass over the rows; returns the logits it leaves in the arena.
    fn forward(&self, model: &Model<CudaBackend>, state: &mut CudaState) -> Result<u64> {
        Ok(model.forward(self.ids, self.layout, state, LogitRows::LastOfEachSpan)?.ptr())
    }

    /// The sampling of every row from `logits`, after the rows' logit adjustments if `adjust`;
    /// with `logprobs`, the rows' log-probabilities around it: the first pass over the raw logits
    /// before the adjustments (which then keep the values they replace), the second after the
    /// sampler.
    fn sample(&self, model: &Model<CudaBackend>, logits: u64, adjust: bool, logprobs: bool) -> Result<()> {
        let (ctx, rows) = (&model.backend.ctx, self.layout.spans.len());
        let lp_args = lp::LogprobArgs { logits, ..self.logprobs };
        if logprobs {
            lp::partials(ctx, &lp_args, rows)?;
        }
        if adjust {
            let saved = if logprobs { self.logprobs.saved } else { 0 };
            sp::adjust_rows(ctx, &sp::AdjustArgs { logits, saved, ..self.adjust }, rows)?;
        }
        sp::rows(ctx, &sp::SampleArgs { logits, ..self.sample }, rows, self.greedy)?;
        if logprobs {
            lp::finish(ctx, &lp_args, rows)?;
        }
        Ok(())
    }

    /// The step's two graphs (inside the caller's arena): the forward pass, then the sampling
    /// from the logits the first leaves in the arena; and those logits. The sampling graph is
    /// launched after the host's uploads, so its launch is not chained to the forward pass.
    fn capture_pair(&self, model: &Model<CudaBackend>, state: &mut CudaState, pdl: bool) -> Result<(Graph, Graph, u64)> {
        let gpu = &model.backend.ctx.gpu;
        let mut logits = 0;
        crate::driver::set_pdl(pdl);
        let forward = Graph::capture(gpu, || {
            logits = self.forward(model, state)?;
            Ok(())
        });
        crate::driver::set_pdl(false);
        let forward = forward?;
        let sample = Graph::capture(gpu, || self.sample(model, logits, true, false))?;
        Ok((forward, sample, logits))
    }

    /// The forward pass and the sampling in one capture, without the logit adjustments (see
    /// `BatchGraph::whole`).
    fn capture_whole(&self, model: &Model<CudaBackend>, state: &mut CudaState, pdl: bool) -> Result<Graph> {
        crate::driver::set_pdl(pdl);
        let g = Graph::capture(&model.backend.ctx.gpu, || {
            let logits = self.forward(model, state)?;
            self.sample(model, logits, false, false)
        });
        crate::driver::set_pdl(false);
        g
    }
}

/// The bucket a batch of `n` rows runs in: the next power of two.
pub fn bucket_for(n: usize) -> usize {
    n.max(1).next_power_of_two()
}

#[cfg(test)]
mod tests {
    #[test]
    fn buckets() {
        assert_eq!(super::bucket_for(1), 1);
        assert_eq!(super::bucket_for(2), 2);
        assert_eq!(super::bucket_for(3), 4);
        assert_eq!(super::bucket_for(33), 64);
    }
}
