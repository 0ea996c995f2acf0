// Log-probabilities of a batch step's rows (those whose SampleParams::logprobs > 0 ask for the
// sampled token's and the logprobs − 1 most likely tokens'): the log-softmax of the RAW logits
// over [0, valid), before penalties, logit bias and grammar masks, as the host computes it
// (orchid_engine::sampling::logprobs). Two passes around the sampler:
//
// logprob_partials_rows (before logit_adjust_rows changes the logits in place): grid (LP_BLOCKS,
// rows), each block a slice of the row's vocabulary; it writes the slice's max, its sum of
// exp(logit − max) (f32 terms summed in f64) and its most likely tokens.
// logprob_finish_rows (after the sampler): one block per row merges the slices (the sum in
// block order, in f64), merges their top lists, and takes the sampled token's raw logit: from the
// logits, or, when the row's adjustment list touched that token, from the value the adjustment
// kernel saved before it changed it. Every reduction has a fixed order: the same bits on every
// replay.
//
// The top list's order: logit descending, ties to the lower id. A (logit, id) pair's rank packs
// the order-preserving key of the logit above the complement of the id, so the order is that of
// the ranks, each id's rank is unique and none is 0; the k best are found by k rounds of "the
// largest rank below the last one picked", each thread keeping its own best candidate (only the
// thread whose candidate was picked looks again).

struct LpPartial {
    float max;
    int count;
    double sum;
    float val[LP_TOP];
    int id[LP_TOP];
};
static_assert(sizeof(LpPartial) == LP_PARTIAL_BYTES, "LpPartial does not match LOGPROB_PARTIAL_BYTES");

DEVI u64 lp_rank(float x, int id) { return ((u64)float_key(x) << 32) | (u64)(0xffffffffu - (u32)id); }
DEVI int lp_rank_id(u64 r) { return (int)(0xffffffffu - (u32)r); }
// The logit of a rank (float_key inverted).
DEVI float lp_rank_value(u64 r) {
    const u32 k = (u32)(r >> 32);
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The largest of the block's values, in every thread (red: 32 u64 of shared memory).
DEVI u64 block_max_u64(u64 v, u64* red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const u64 x = __shfl_xor_sync(0xffffffffu, v, o);
        v = x > v ? x : v;
    }
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    u64 r = 0;
    for (int i = 0; i < nw; ++i) r = red[i] > r ? red[i] : r;
    return r;
}

// The block's sum of v, in a fixed order, in every thread (red: 32 doubles of shared memory).
DEVI double block_sum_f64(double v, double* red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    double r = 0.0;
    for (int i = 0; i < nw; ++i) r += red[i];
    return r;
}

// Picks the k best ranks of the block, best first: `below(limit)` is the thread's best rank under
// `limit` (0: none); `put(n, rank)` runs in thread 0 for the n-th pick. Returns how many there were.
template <typename Below, typename Put>
DEVI int block_top(int k, Below below, Put put, u64* red) {
    u64 cand = below(~0ull);
    int n = 0;
    for (; n < k; ++n) {
        const u64 w = block_max_u64(cand, red);
        if (w == 0) break;
        if (threadIdx.x == 0) put(n, w);
        if (cand == w) cand = below(w);
    }
    return n;
}

extern "C" __global__ void __launch_bounds__(256) logprob_partials_rows(const LogprobArgs a) {
    pdl_enter();
    __shared__ float redf[32];
    __shared__ double redd[32];
    __shared__ u64 redu[32];
    const int r = blockIdx.y;
    const SampleParams p = ((const SampleParams*)a.params)[r];
    if (p.logprobs <= 0) return;
    const int k = min(p.logprobs - 1, LP_TOP);
    const int valid = min(a.vocab, p.valid);
    const int per = (valid + LP_BLOCKS - 1) / LP_BLOCKS;
    const int lo = min(valid, (int)blockIdx.x * per), hi = min(valid, lo + per);
    const float* l = (const float*)a.logits + (u64)r * a.vocab;
    LpPartial* out = (LpPartial*)a.partial + (u64)r * LP_BLOCKS + blockIdx.x;
    float m = NEG_INF;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) m = fmaxf(m, l[i]);
    m = block_max(m, redf);
    double s = 0.0;
    if (m > NEG_INF)
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) s += (double)expf(l[i] - m);
    s = block_sum_f64(s, redd);
    auto below = [&](u64 limit) {
        u64 b = 0;
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const u64 q = lp_rank(l[i], i);
            if (q < limit && q > b) b = q;
        }
        return b;
    };
    auto put = [&](int n, u64 w) {
        out->id[n] = lp_rank_id(w);
        out->val[n] = lp_rank_value(w);
    };
    const int n = block_top(k, below, put, redu);
    if (threadIdx.x == 0) {
        out->max = m;
        out->sum = s;
        out->count = n;
    }
}

// The sampled token's raw logit: the saved pre-adjustment value when the row's adjustment list
// (increasing tokens) holds the token, else the logit as it is.
DEVI float lp_raw_logit(const LogprobArgs& a, int r, int tok) {
    const int* off = (const int*)a.offsets;
    const AdjustEntry* e = (const AdjustEntry*)a.entries;
    int lo = off[r], hi = off[r + 1];
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (e[mid].token < tok) lo = mid + 1;
        else hi = mid;
    }
    if (lo < off[r + 1] && e[lo].token == tok) return ((const float*)a.saved)[lo];
    return ((const float*)a.logits)[(u64)r * a.vocab + tok];
}

extern "C" __global__ void __launch_bounds__(256) logprob_finish_rows(const LogprobArgs a) {
    pdl_enter();
    __shared__ u64 redu[32];
    __shared__ double s_lse;
    const int r = blockIdx.x;
    const SampleParams p = ((const SampleParams*)a.params)[r];
    u32* out = (u32*)a.out + (u64)r * LP_ROW_WORDS;
    const int tok = ((const int*)a.tokens)[r];
    if (p.logprobs <= 0) {
        if (threadIdx.x == 0) {
            out[0] = (u32)tok;
            out[1] = 0xffffffffu;
        }
        return;
    }
    const int k = min(p.logprobs - 1, LP_TOP);
    const LpPartial* part = (const LpPartial*)a.partial + (u64)r * LP_BLOCKS;
    if (threadIdx.x == 0) {
        float m = NEG_INF;
        for (int b = 0; b < LP_BLOCKS; ++b) m = fmaxf(m, part[b].max);
        double sum = 0.0;
        for (int b = 0; b < LP_BLOCKS; ++b)
            if (part[b].sum > 0.0) sum += part[b].sum * exp((double)part[b].max - (double)m);
        s_lse = (double)m + log(sum);
    }
    __syncthreads();
    const double lse = s_lse;
    auto below = [&](u64 limit) {
        u64 b = 0;
        for (int c = threadIdx.x; c < LP_BLOCKS * LP_TOP; c += blockDim.x) {
            const LpPartial& q = part[c / LP_TOP];
            const int j = c % LP_TOP;
            if (j >= q.count) continue;
            const u64 x = lp_rank(q.val[j], q.id[j]);
            if (x < limit && x > b) b = x;
        }
        return b;
    };
    auto put = [&](int n, u64 w) {
        out[4 + n] = (u32)lp_rank_id(w);
        out[4 + LP_TOP + n] = __float_as_uint((float)((double)lp_rank_value(w) - lse));
    };
    const int n = block_top(k, below, put, redu);
    if (threadIdx.x == 0) {
        out[0] = (u32)tok;
        out[1] = (u32)n;
        out[2] = __float_as_uint((float)((double)lp_raw_logit(a, r, tok) - lse));
        out[3] = __float_as_uint((float)lse);
    }
}
