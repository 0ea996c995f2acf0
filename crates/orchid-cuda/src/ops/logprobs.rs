//! Log-probability launchers (`kernels/logprobs.cu`): for the rows of a batch step that ask
//! (`SampleParams::logprobs`), the log-sum-exp of the raw logits and their most likely tokens, in
//! two passes around the sampler (see `BatchGraph`): `partials` over vocabulary slices before the
//! logit adjustments change the logits in place, `finish` after the sampler, which merges the
//! slices and adds the sampled token's log-probability from its raw logit. The host reference is
//! `orchid_engine::sampling::logprobs`.

use orchid_model::TokenLogprob;
use orchid_model::error::Result;

use super::Ctx;

crate::kernel_abi! {
    pub fn logprobs_abi;
    const {
        /// The most top tokens a row may ask for (OpenAI's largest `top_logprobs`).
        LOGPROB_TOP => "LP_TOP": usize = 20;
        /// Blocks per row of the first pass, each over a slice of the vocabulary.
        LOGPROB_BLOCKS => "LP_BLOCKS": usize = 64;
        /// Bytes of one block's partial result (max, count, sum, then the slice's top list).
        LOGPROB_PARTIAL_BYTES => "LP_PARTIAL_BYTES": usize = 16 + 8 * LOGPROB_TOP;
        /// u32 words of a row's result: token, count of top tokens (-1: the row asked for none),
        /// log-probability of the token, log-sum-exp, then the top ids and their log-probabilities.
        LOGPROB_ROW_WORDS => "LP_ROW_WORDS": usize = 4 + 2 * LOGPROB_TOP;
    }
    #[derive(Clone, Copy, Default)]
    struct LogprobArgs {
        /// f32 [rows, vocab]: the step's logits (raw in the first pass; in the second, adjusted
        /// where the row's adjustment list says, whose raw values are in `saved`).
        logits: u64,
        /// SampleParams [rows] (`valid`, `logprobs`).
        params: u64,
        /// LOGPROB_BLOCKS partials of LOGPROB_PARTIAL_BYTES per row.
        partial: u64,
        /// i32 [rows]: the sampled tokens (read by the second pass).
        tokens: u64,
        /// The logit adjustment table (`AdjustArgs`): i32 offsets [rows + 1], the entries, and
        /// f32 per entry the logit before its adjustment.
        offsets: u64,
        entries: u64,
        saved: u64,
        /// u32 [rows, LOGPROB_ROW_WORDS]: every row's token, and the log-probabilities of those
        /// that asked.
        out: u64,
        vocab: i32,
        pad: i32,
    }
}

/// The first pass: per (row that asks, slice of the vocabulary) the slice's max, sum of
/// exp(logit − max) and most likely tokens; rows that do not ask return at once.
pub fn partials(c: &Ctx, a: &LogprobArgs, rows: usize) -> Result<()> {
    c.k("logprob_partials_rows").launch(&c.gpu, (LOGPROB_BLOCKS as u32, rows as u32, 1), 256, 0, a)
}

/// The second pass, after the sampler: one block per row writes the row's token and, for a row
/// that asks, its log-probability and the top list (merged from the slices' lists).
pub fn finish(c: &Ctx, a: &LogprobArgs, rows: usize) -> Result<()> {
    c.k("logprob_finish_rows").launch(&c.gpu, (rows as u32, 1, 1), 256, 0, a)
}

/// Reads one row's result (`LOGPROB_ROW_WORDS` words): the sampled token and, when the row asked,
/// its log-probabilities.
pub fn parse_row(w: &[u32]) -> (u32, Option<TokenLogprob>) {
    let token = w[0];
    let count = w[1] as i32;
    if count < 0 {
        return (token, None);
    }
    let n = (count as usize).min(LOGPROB_TOP);
    let top = (0..n).map(|j| (w[4 + j], f32::from_bits(w[4 + LOGPROB_TOP + j]))).collect();
    (token, Some(TokenLogprob { id: token, logprob: f32::from_bits(w[2]), top }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' rank of (logit, id) (`lp_rank`: the order-preserving key above the id's
    /// complement) and its inverse (`lp_rank_id`, `lp_rank_value`).
    fn rank(x: f32, id: u32) -> u64 {
        let u = x.to_bits();
        let key = if u & 0x8000_0000 != 0 { !u } else { u | 0x8000_0000 };
        ((key as u64) << 32) | (u32::MAX - id) as u64
    }
    fn rank_value(r: u64) -> f32 {
        let k = (r >> 32) as u32;
        f32::from_bits(if k & 0x8000_0000 != 0 { k & 0x7fff_ffff } else { !k })
    }

    /// The k largest ranks of `ranks`, best first, by the kernels' rounds of "the largest rank
    /// below the last one picked".
    fn top_by_rounds(ranks: &[u64], k: usize) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::new();
        for _ in 0..k {
            let limit = out.last().copied().unwrap_or(u64::MAX);
            match ranks.iter().copied().filter(|&r| r < limit).max() {
                Some(r) => out.push(r),
                None => break,
            }
        }
        out
    }

    /// The two passes' top lists (per vocabulary slice, then merged) give the host reference's
    /// ids and logits (logit descending, ties to the lower id), signed zeros and repeats included.
    #[test]
    fn sliced_top_lists_match_the_host_order() {
        let mut rng = orchid_engine::sampling::Rng::new(0x2545_F491_4F6C_DD1D);
        let mut next = move |n: u64| rng.next_u64() % n;
        for case in 0..100 {
            let valid = 1 + next(3000) as usize;
            let logits: Vec<f32> = (0..valid)
                .map(|_| match next(4) {
                    0 => 0.0,
                    1 => -0.0,
                    _ => (next(200) as f32 - 100.0) / 8.0,
                })
                .collect();
            let k = next(LOGPROB_TOP as u64 + 1) as usize;
            let per = valid.div_ceil(LOGPROB_BLOCKS);
            let mut candidates = Vec::new();
            for b in 0..LOGPROB_BLOCKS {
                let (lo, hi) = ((b * per).min(valid), ((b + 1) * per).min(valid));
                let slice: Vec<u64> = (lo..hi).map(|i| rank(logits[i], i as u32)).collect();
                candidates.extend(top_by_rounds(&slice, k));
            }
            let got: Vec<(u32, f32)> = top_by_rounds(&candidates, k).into_iter().map(|r| (u32::MAX - r as u32, rank_value(r))).collect();
            let want = orchid_engine::sampling::logprobs(&logits, valid, 0, k);
            let want: Vec<(u32, f32)> = want.top.iter().map(|&(id, _)| (id, logits[id as usize])).collect();
            let bits = |v: &[(u32, f32)]| v.iter().map(|&(i, x)| (i, x.to_bits())).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "case {case}");
        }
    }

    #[test]
    fn sizes_and_rows() {
        assert_eq!(std::mem::size_of::<LogprobArgs>(), 72);
        assert!(logprobs_abi().contains("#define LP_PARTIAL_BYTES 176\n"));
        let mut w = vec![0u32; LOGPROB_ROW_WORDS];
        w[0] = 7;
        w[1] = -1i32 as u32;
        assert_eq!(parse_row(&w), (7, None));
        w[1] = 2;
        w[2] = (-0.5f32).to_bits();
        w[4..6].copy_from_slice(&[7, 3]);
        w[4 + LOGPROB_TOP..6 + LOGPROB_TOP].copy_from_slice(&[(-0.5f32).to_bits(), (-1.25f32).to_bits()]);
        let lp = TokenLogprob { id: 7, logprob: -0.5, top: vec![(7, -0.5), (3, -1.25)] };
        assert_eq!(parse_row(&w), (7, Some(lp)));
    }
}
