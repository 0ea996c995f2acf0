// Sampling on the GPU: greedy (argmax) and temperature / top-k / top-p / min-p with a seeded
// counter-based generator. The chosen token is written to the next step's input slot; in a
// captured decode step the position and step counters advance on the device.
//
// Shapes: logits [vocab] f32 (one row); ids ≥ `valid` are never chosen. A row may come with a
// token mask (`SampleArgs::mask`, read when `SampleParams::masked` is set): u32 [ceil(vocab/32)],
// token i allowed when bit i % 32 of word i / 32 is set. A masked-out token reads as a logit of
// -inf, before any filter (as the host applies a grammar's mask before its sampler). A batch's
// rows may also come with sparse logit adjustments (penalties, logit bias: `logit_adjust_rows`),
// applied to the logits in place before the row's sampler runs.

// The row's mask, or null when it has none.
DEVI const u32* row_mask(const SampleArgs& a, const SampleParams& p) {
    return a.mask && p.masked ? (const u32*)a.mask : nullptr;
}

// Logit i of the row, -inf when the mask does not allow it.
DEVI float masked_logit(const float* l, const u32* allow, int i) {
    if (allow && !((allow[i >> 5] >> (i & 31)) & 1u)) return NEG_INF;
    return l[i];
}

DEVI void finish_token(const SampleArgs& a, int tok) {
    int* step = (int*)a.step;
    *(int*)a.token_out = tok;
    if (a.pos) *(int*)a.pos += 1;
    if (step) *step += 1;
}

DEVI void argmax_merge(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
}

// Greedy: grid = nblocks (each a slice of the vocabulary), block 256; the last block reduces.
DEVI void sample_argmax_body(const SampleArgs& a) {
    __shared__ float sv[8];
    __shared__ int si[8];
    __shared__ int s_last;
    const SampleParams* p = (const SampleParams*)a.params;
    const int valid = min(a.vocab, p->valid);
    const int per = (valid + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * per, hi = min(valid, lo + per);
    const float* l = (const float*)a.logits;
    const u32* allow = row_mask(a, *p);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) argmax_merge(bv, bi, masked_logit(l, allow, i), i);
    for (int o = 16; o > 0; o >>= 1) argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < 8; ++w) argmax_merge(bv, bi, sv[w], si[w]);
        ((float2*)a.partial)[blockIdx.x] = make_float2(bv, __int_as_float(bi));
        __threadfence();
        unsigned prev = atomicAdd((unsigned*)a.counter, 1u);
        s_last = prev == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    bv = NEG_INF;
    bi = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        float2 v = __ldcg((const float2*)a.partial + b);
        argmax_merge(bv, bi, v.x, __float_as_int(v.y));
    }
    for (int o = 16; o > 0; o >>= 1) argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < 8; ++w) argmax_merge(bv, bi, sv[w], si[w]);
        if (bi == 0x7fffffff) bi = 0;
        finish_token(a, bi);
        *(unsigned*)a.counter = 0u;
    }
}

// General sampling, one block of 1024 threads (see the file comment). Exact selection with radix
// passes over order-preserving float keys; masses in 2^-40 fixed point so sums are deterministic.
DEVI void sample_general_body(const SampleArgs& a) {
    __shared__ float red[32];
    __shared__ unsigned hist[256];
    __shared__ u64 hmass[256];
    __shared__ u32 s_prefix;
    __shared__ u64 s_above;
    __shared__ u64 chunk[SB];
    __shared__ int s_tok;
    const SampleParams P = *(const SampleParams*)a.params;
    const int valid = min(a.vocab, P.valid);
    const float* l = (const float*)a.logits;
    const u32* allow = row_mask(a, P);
    auto lg = [&](int i) -> float { return masked_logit(l, allow, i); };
    const int tid = threadIdx.x;
    // Max (and argmax for greedy).
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = tid; i < valid; i += SB) argmax_merge(bv, bi, lg(i), i);
    for (int o = 16; o > 0; o >>= 1) argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    __shared__ float sv[32];
    __shared__ int si[32];
    if ((tid & 31) == 0) { sv[tid >> 5] = bv; si[tid >> 5] = bi; }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < SB / 32; ++w) argmax_merge(bv, bi, sv[w], si[w]);
        sv[0] = bv; si[0] = bi;
    }
    __syncthreads();
    const float M = sv[0];
    if (P.temperature <= 0.f || P.top_k == 1 || !(M > NEG_INF)) {
        if (tid == 0) finish_token(a, si[0] == 0x7fffffff ? 0 : si[0]);
        return;
    }
    const float invT = 1.f / P.temperature;
    const double FX = 1099511627776.0;  // 2^40
    auto mass_of = [&](float x) -> u64 { return (u64)(exp((double)(x - M) * invT) * FX); };
    // Top-k threshold (k-th largest key), by count.
    u32 tau_k = 0;
    if (P.top_k > 0 && P.top_k < valid) {
        u32 prefix = 0, mask = 0;
        int remaining = P.top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += SB) hist[b] = 0;
            __syncthreads();
            for (int i = tid; i < valid; i += SB) {
                u32 k = float_key(lg(i));
                if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                int cum = 0, chosen = 0;
                for (int b = 255; b >= 0; --b) {
                    if (cum + (int)hist[b] >= remaining) { chosen = b; remaining -= cum; break; }
                    cum += hist[b];
                }
                s_prefix = prefix | ((u32)chosen << shift);
            }
            __syncthreads();
            prefix = s_prefix;
            mask |= 255u << shift;
            __syncthreads();
        }
        tau_k = prefix;
    }
    // Total mass of the top-k set, then the top-p threshold, by mass.
    u32 tau_p = 0;
    if (P.top_p < 1.f) {
        u64 zs = 0;
        for (int i = tid; i < valid; i += SB) {
            u32 k = float_key(lg(i));
            if (k >= tau_k) zs += mass_of(lg(i));
        }
        chunk[tid] = zs;
        __syncthreads();
        for (int o = SB / 2; o > 0; o >>= 1) {
            if (tid < o) chunk[tid] += chunk[tid + o];
            __syncthreads();
        }
        const u64 total = chunk[0];
        u64 target = (u64)((double)total * (double)P.top_p);
        if (target > total) target = total;
        if (target == 0) target = 1;
        __syncthreads();
        u32 prefix = 0, mask = 0;
        u64 above = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += SB) hmass[b] = 0;
            __syncthreads();
            for (int i = tid; i < valid; i += SB) {
                u32 k = float_key(lg(i));
                if (k >= tau_k && (k & mask) == prefix) atomicAdd((unsigned long long*)&hmass[(k >> shift) & 255], (unsigned long long)mass_of(lg(i)));
            }
            __syncthreads();
            if (tid == 0) {
                int chosen = 0;
                u64 ab = above;
                for (int b = 255; b >= 0; --b) {
                    if (hmass[b] > 0) chosen = b;
                    if (ab + hmass[b] >= target) { chosen = b; break; }
                    ab += hmass[b];
                }
                s_prefix = prefix | ((u32)chosen << shift);
                s_above = ab;
            }
            __syncthreads();
            prefix = s_prefix;
            above = s_above;
            mask |= 255u << shift;
            __syncthreads();
        }
        tau_p = prefix;
    }
    const u32 tau = tau_k > tau_p ? tau_k : tau_p;
    const float zmin = P.min_p > 0.f ? logf(P.min_p) : NEG_INF;
    auto kept = [&](int i) -> bool {
        float x = lg(i);
        return float_key(x) >= tau && (double)(x - M) * invT >= (double)zmin;
    };
    // Draw: contiguous chunks per thread, exclusive scan of chunk masses, walk the chunk.
    const int per = (valid + SB - 1) / SB;
    const int lo = tid * per, hi = min(valid, lo + per);
    u64 mine = 0;
    for (int i = lo; i < hi; ++i)
        if (kept(i)) mine += mass_of(lg(i));
    chunk[tid] = mine;
    __syncthreads();
    for (int o = 1; o < SB; o <<= 1) {
        u64 v = tid >= o ? chunk[tid - o] : 0;
        __syncthreads();
        chunk[tid] += v;
        __syncthreads();
    }
    const u64 total = chunk[SB - 1];
    const int step = a.step ? *(const int*)a.step : 0;
    const u64 r = (u64)((double)uniform01(P.seed, (u64)step) * (double)total);
    if (tid == 0) s_tok = si[0];
    __syncthreads();
    const u64 before = chunk[tid] - mine;
    if (total > 0 && r >= before && r < chunk[tid]) {
        u64 acc = before;
        for (int i = lo; i < hi; ++i) {
            if (!kept(i)) continue;
            acc += mass_of(lg(i));
            if (r < acc) { s_tok = i; break; }
        }
    }
    __syncthreads();
    if (tid == 0) finish_token(a, s_tok);
}

extern "C" __global__ void __launch_bounds__(256) sample_argmax(const SampleArgs a) {
    pdl_enter();
    sample_argmax_body(a);
}

extern "C" __global__ void __launch_bounds__(SB) sample_general(const SampleArgs a) {
    pdl_enter();
    sample_general_body(a);
}

// One row of a [rows, vocab] logits matrix per blockIdx.y, each with its own parameters, partials,
// counter, output token, position, step counter and mask (consecutive, one per row; a null
// position or step counter is left alone).
DEVI SampleArgs sample_row(const SampleArgs& a0) {
    const int r = blockIdx.y;
    SampleArgs a = a0;
    a.logits += (u64)r * a0.vocab * 4;
    a.params += (u64)r * sizeof(SampleParams);
    a.partial += (u64)r * a0.nblocks * 8;
    a.counter += (u64)r * 4;
    a.token_out += (u64)r * 4;
    if (a.step) a.step += (u64)r * 4;
    if (a.mask) a.mask += (u64)r * ((a0.vocab + 31) / 32) * 4;
    if (a.pos) a.pos += (u64)r * 4;
    return a;
}

extern "C" __global__ void __launch_bounds__(256) sample_argmax_rows(const SampleArgs a) {
    pdl_enter();
    sample_argmax_body(sample_row(a));
}

extern "C" __global__ void __launch_bounds__(SB) sample_general_rows(const SampleArgs a) {
    pdl_enter();
    sample_general_body(sample_row(a));
}

// Per-row sparse logit adjustments (penalties, logit bias), in place, before the row's sampler:
// grid = rows, block 256. Row r's entries are entries[offsets[r] .. offsets[r + 1]], distinct
// tokens, each applying the host sampler's rules in its order: + bias, then the repetition
// penalty (a positive logit divided by it, any other multiplied), then - subtract (presence and
// frequency). The neutral values (-0, 1, +0) leave a logit bit for bit as it is; the rounded
// intrinsics keep every operation one IEEE operation (no contraction, no fast division), so the
// result is the host's (orchid_model::apply_logit_adjust). Tokens ≥ the row's valid are skipped.
// With `saved`, entry j's logit before its adjustment is kept in saved[j] (for the log-probability
// of the raw logits, `logprob_finish_rows`).
extern "C" __global__ void __launch_bounds__(256) logit_adjust_rows(const AdjustArgs a) {
    pdl_enter();
    const int r = blockIdx.x;
    const int* off = (const int*)a.offsets;
    const int lo = off[r], hi = off[r + 1];
    if (lo >= hi) return;
    const SampleParams* p = (const SampleParams*)a.params + r;
    const int valid = min(a.vocab, p->valid);
    float* l = (float*)a.logits + (u64)r * a.vocab;
    const AdjustEntry* e = (const AdjustEntry*)a.entries;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const AdjustEntry x = e[j];
        if (x.token < 0 || x.token >= valid) continue;
        if (a.saved) ((float*)a.saved)[j] = l[x.token];
        float v = __fadd_rn(l[x.token], x.bias);
        v = v > 0.f ? __fdiv_rn(v, x.repetition) : __fmul_rn(v, x.repetition);
        l[x.token] = __fsub_rn(v, x.subtract);
    }
}
