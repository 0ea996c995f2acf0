//! Sampling launchers (greedy argmax over many blocks; the general sampler in one block), with an
//! optional token mask per row (a grammar's: a masked-out token counts as a logit of -inf), and
//! the per-row sparse logit adjustments (penalties, logit bias) applied before them.

use orchid_model::error::Result;

use super::Ctx;

crate::kernel_abi! {
    pub fn sampling_abi;
    const {
        /// Threads of the general sampler's one block.
        SAMPLE_THREADS => "SB": usize = 1024;
    }
    #[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct SampleParams {
        temperature: f32,
        top_p: f32,
        min_p: f32,
        top_k: i32,
        seed: u64,
        valid: i32,
        /// Non-zero: the row's token mask (`SampleArgs::mask`) applies.
        masked: i32,
        /// 0: the row wants no log-probabilities; n + 1: the sampled token's and the n most likely
        /// tokens' (the batch graph's logprob kernels, `ops::logprobs`; the sampler ignores it).
        logprobs: i32,
        pad: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct SampleArgs {
        /// partial: float2 per block; counter: u32 (last-block)
        logits: u64,
        params: u64,
        partial: u64,
        counter: u64,
        /// token_out: int (next input); pos/step: int*
        token_out: u64,
        pos: u64,
        step: u64,
        /// u32 [vocab.div_ceil(32)] per row, bit i % 32 of word i / 32 set when token i is
        /// allowed; read when the row's `SampleParams::masked` says so (0: no masks).
        mask: u64,
        vocab: i32,
        nblocks: i32,
    }
    /// One token's adjustment (`orchid_model::LogitAdjust`; token ≥ the row's `valid`: skipped).
    #[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
    struct AdjustEntry {
        token: i32,
        bias: f32,
        repetition: f32,
        subtract: f32,
    }
    #[derive(Clone, Copy, Default)]
    struct AdjustArgs {
        /// f32 [rows, vocab], adjusted in place.
        logits: u64,
        /// i32 [rows + 1]: row r's entries are entries[offsets[r] .. offsets[r + 1]].
        offsets: u64,
        /// AdjustEntry [..], each row's tokens distinct.
        entries: u64,
        /// SampleParams [rows] (for `valid`).
        params: u64,
        /// f32 per entry: the logit before the entry's adjustment is written there (0: not kept).
        saved: u64,
        vocab: i32,
        pad: i32,
    }
}

/// Blocks of the greedy argmax (the partial buffer holds this many float2).
pub const ARGMAX_BLOCKS: usize = 128;

impl SampleParams {
    pub fn greedy(valid: usize) -> SampleParams {
        SampleParams { valid: valid as i32, ..Default::default() }
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
    /// These parameters with the row's log-probabilities: None, or the sampled token's and the
    /// `n` most likely tokens' (at most `ops::logprobs::LOGPROB_TOP`, checked by the batch graph).
    pub fn with_logprobs(self, n: Option<usize>) -> SampleParams {
        SampleParams { logprobs: n.map_or(0, |n| n.min(i32::MAX as usize - 1) as i32 + 1), ..self }
    }
    /// The top tokens the row asks for, if it asks.
    pub fn logprobs_top(&self) -> Option<usize> {
        (self.logprobs > 0).then(|| self.logprobs as usize - 1)
    }
}

pub fn argmax(c: &Ctx, a: &SampleArgs) -> Result<()> {
    c.k("sample_argmax").launch(&c.gpu, (ARGMAX_BLOCKS as u32, 1, 1), 256, 0, a)
}

pub fn general(c: &Ctx, a: &SampleArgs) -> Result<()> {
    c.k("sample_general").launch(&c.gpu, (1, 1, 1), SAMPLE_THREADS as u32, 0, a)
}

/// `argmax` / `general` of each row of [rows, vocab] logits (`SampleArgs` of row 0; the
/// parameters, partials, counters, tokens, positions, step counters and masks of the rows follow
/// each other).
pub fn rows(c: &Ctx, a: &SampleArgs, rows: usize, greedy: bool) -> Result<()> {
    if greedy {
        c.k("sample_argmax_rows").launch(&c.gpu, (ARGMAX_BLOCKS as u32, rows as u32, 1), 256, 0, a)
    } else {
        c.k("sample_general_rows").launch(&c.gpu, (1, rows as u32, 1), SAMPLE_THREADS as u32, 0, a)
    }
}

/// Applies each row's adjustment list to its logits in place (one block per row of `rows`; a
/// row with an empty list returns at once). The CPU reference is `orchid_model::apply_logit_adjust`.
pub fn adjust_rows(c: &Ctx, a: &AdjustArgs, rows: usize) -> Result<()> {
    c.k("logit_adjust_rows").launch(&c.gpu, (rows as u32, 1, 1), 256, 0, a)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(std::mem::size_of::<super::SampleParams>(), 40);
        assert_eq!(std::mem::size_of::<super::SampleArgs>(), 72);
        assert_eq!(std::mem::size_of::<super::AdjustEntry>(), 16);
        assert_eq!(std::mem::size_of::<super::AdjustArgs>(), 48);
        let p = super::SampleParams::greedy(9);
        assert_eq!((p.logprobs_top(), p.with_logprobs(Some(0)).logprobs_top(), p.with_logprobs(Some(20)).logprobs), (None, Some(0), 21));
        assert_eq!(p.with_logprobs(Some(3)).with_logprobs(None), p);
    }
}
