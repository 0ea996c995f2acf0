// MoE routing on the GPU for prefill (docs/model.md §6): per-token softmax top-k, per-expert
// counts, offsets and the tile table of the grouped GEMMs, token lists, and the weighted combine.
//
// Shapes: T tokens, E experts (≤ 512), k experts per token. An assignment (t, slot) gets a list
// position p in [0, T·k), grouped by expert: assign_tok[p] = t, slot_pos[t·k + slot] = p.

// One warp: softmax over E logits, the top k (ties to the lower id), optional renormalisation.
DEVI void warp_topk(const float* logits, int E, int topk, int renorm, int* ids, float* wts) {
    const int lane = threadIdx.x & 31;
    float pv[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int e = lane + 32 * i;
        pv[i] = e < E ? logits[e] : NEG_INF;
    }
    const float sum = warp_softmax16(pv, E);
    float picked = 0.f, mine = 0.f;
    int mine_id = 0;
    for (int k = 0; k < topk; ++k) {
        int bi;
        const float bv = warp_take_max(pv, bi);
        float p = bv / sum;
        picked += p;
        if (lane == k) { mine = p; mine_id = bi; }
    }
    if (lane < topk) {
        ids[lane] = mine_id;
        wts[lane] = renorm ? mine / picked : mine;
    }
}

// grid = ceil(T/4), block 128: one warp per token. The experts' counts only where `counts` is set:
// counts[e] over all tokens, and with chunk_counts, chunk_counts[c · E + e] over the tokens of
// chunk c (tokens [c · chunk_tokens, (c + 1) · chunk_tokens): moe_scatter's chunks).
extern "C" __global__ void __launch_bounds__(128) moe_topk(const TopkArgs a) {
    pdl_enter();
    const int t = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= a.T) return;
    int* ids = (int*)a.ids + (i64)t * a.topk;
    float* w = (float*)a.wts + (i64)t * a.topk;
    warp_topk((const float*)a.logits + (i64)t * a.ldl, a.E, a.topk, a.renorm, ids, w);
    __syncwarp();
    if (a.counts && lane < a.topk) {
        atomicAdd((int*)a.counts + ids[lane], 1);
        if (a.chunk_counts) atomicAdd((int*)a.chunk_counts + (i64)(t / a.chunk_tokens) * a.E + ids[lane], 1);
    }
}

// Top-k of each token for the per-token expert kernels (moe_decode.cu *_rows): a warp per
// token; routing weights with a row stride of topk + shared, the shared expert's gate
// sigmoid(logit at column E) after the token's top-k weights when `shared`. No counts.
extern "C" __global__ void __launch_bounds__(128) moe_topk_rows(const TopkArgs a) {
    pdl_enter();
    const int t = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= a.T) return;
    const float* l = (const float*)a.logits + (i64)t * a.ldl;
    float* w = (float*)a.wts + (i64)t * (a.topk + a.shared);
    warp_topk(l, a.E, a.topk, a.renorm, (int*)a.ids + (i64)t * a.topk, w);
    if (lane == 0 && a.shared) w[a.topk] = sigmoidf_(l[a.E]);
}

// Thread e of a block of 1024 (e < E: expert e with c tokens): the exclusive scans of the counts
// and of the bn-token tiles over the experts, the expert's tiles {expert, first position, count,
// 0} written to the grouped-GEMM tile table (and their number by thread 1023). Returns e's first
// list position. sc, st: 1024 ints of shared memory each.
DEVI int scan_tiles(int c, int E, int bn, int* sc, int* st, int4* tiles, int* num_tiles) {
    const int e = threadIdx.x;
    const int nt = (c + bn - 1) / bn;
    sc[e] = c;
    st[e] = nt;
    __syncthreads();
    for (int o = 1; o < 1024; o <<= 1) {
        int vc = e >= o ? sc[e - o] : 0, vt = e >= o ? st[e - o] : 0;
        __syncthreads();
        sc[e] += vc;
        st[e] += vt;
        __syncthreads();
    }
    const int off = sc[e] - c, toff = st[e] - nt;
    if (e < E)
        for (int i = 0; i < nt; ++i) tiles[toff + i] = make_int4(e, off + i * bn, min(bn, c - i * bn), 0);
    if (e == 1023) *num_tiles = st[1023];
    return off;
}

// One block of 1024 threads: offsets = exclusive scan of counts, cursor = offsets, and the
// grouped-GEMM tile table {expert, first position, count, 0}.
extern "C" __global__ void __launch_bounds__(1024) moe_scan(const ScanArgs a) {
    pdl_enter();
    __shared__ int sc[1024], st[1024];
    const int e = threadIdx.x;
    const int c = e < a.E ? ((const int*)a.counts)[e] : 0;
    const int off = scan_tiles(c, a.E, a.bn, sc, st, (int4*)a.tiles, (int*)a.num_tiles);
    if (e < a.E) {
        ((int*)a.offsets)[e] = off;
        ((int*)a.cursor)[e] = off;
    }
}

// Warp w places the assignments i0 + 32 r + lane (r < rounds, i < n) in ascending order: lanes
// with the same expert e ranked by lane, at cur[e] onwards (cur: this warp's own next position of
// each expert, advanced by the group's first lane), writing each one's token and list position.
DEVI void place_assignments(const int* ids, int i0, int rounds, int n, int topk, int* cur, int* assign_tok, int* slot_pos) {
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < rounds; ++r) {
        const int i = i0 + 32 * r + lane;
        const int e = i < n ? ids[i] : -1 - lane;  // lanes past the end match nobody
        const unsigned same = __match_any_sync(0xffffffffu, e), before = same & ((1u << lane) - 1u);
        const int p = i < n ? cur[e] + __popc(before) : 0;
        __syncwarp();
        if (i < n) {
            assign_tok[p] = i / topk;
            slot_pos[i] = p;
            if (before == 0) cur[e] += __popc(same);  // the group's first lane
        }
        __syncwarp();
    }
}

// The lists of at most 1024 assignments (T · topk, batched decode; ids from moe_topk) in one
// block of 1024 threads, with the results of moe_scan + moe_scatter (bit for bit): the experts'
// counts (shared atomics: integers, any order), the scans and the tile table (scan_tiles), then
// warp 0 places the assignments in ascending order, 32 at a time, so each expert's list holds
// its tokens in ascending (token, slot) order. With a.shared, the shared expert is listed as
// expert E with all T tokens in order: list positions T·topk + t (after every routed one), its
// tiles after the routed experts'.
extern "C" __global__ void __launch_bounds__(1024) moe_lists(const ListsArgs a) {
    pdl_enter();
    __shared__ int s_ids[1024], sc[1024], st[1024], s_cnt[1024];
    const int n = a.T * a.topk;
    s_cnt[threadIdx.x] = 0;
    if ((int)threadIdx.x < n) s_ids[threadIdx.x] = ((const int*)a.ids)[threadIdx.x];
    __syncthreads();
    if ((int)threadIdx.x < n) atomicAdd(&s_cnt[s_ids[threadIdx.x]], 1);
    __syncthreads();
    const int c = (int)threadIdx.x < a.E ? s_cnt[threadIdx.x] : (int)threadIdx.x == a.E && a.shared ? a.T : 0;
    const int off = scan_tiles(c, a.E + (a.shared ? 1 : 0), a.bn, sc, st, (int4*)a.tiles, (int*)a.num_tiles);
    if (a.shared && (int)threadIdx.x < a.T) ((int*)a.assign_tok)[n + threadIdx.x] = threadIdx.x;
    __syncthreads();
    s_cnt[threadIdx.x] = off;  // now each expert's next list position
    __syncthreads();
    if (threadIdx.x >= 32) return;
    place_assignments(s_ids, 0, (n + 31) / 32, n, a.topk, s_cnt, (int*)a.assign_tok, (int*)a.slot_pos);
}

// Stable scatter over chunks: block c places the assignments of tokens [c · chunk_tokens,
// (c + 1) · chunk_tokens) (SCATTER_CHUNK_TOKENS; their per-expert counts chunk_counts[c · E + e]
// come from moe_topk), each warp w a run of chunk_tokens / 8 of those tokens. Expert e's entries
// of warp w start at its offset (cursor, moe_scan) + its counts in the earlier chunks + its
// counts in the block's earlier warps (shared atomics: integers, any order); each warp then
// places its run in order (place_assignments). So every expert's list holds its tokens in
// ascending (token, slot) order on every run: the grouped GEMMs see the same tiles each time.
// grid = the chunks, 256 threads; E ≤ MOE_E_MAX.
extern "C" __global__ void __launch_bounds__(256) moe_scatter(const ScatterArgs a) {
    pdl_enter();
    __shared__ int cur[8][MOE_E_MAX];
    const int c = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = a.T * a.topk, per = a.chunk_tokens / 8 * a.topk;  // a warp's assignments
    const int i0 = c * a.chunk_tokens * a.topk + warp * per;
    const int* ids = (const int*)a.ids;
    for (int i = threadIdx.x; i < 8 * a.E; i += 256) cur[i / a.E][i % a.E] = 0;
    __syncthreads();
    for (int i = i0 + lane; i < min(i0 + per, n); i += 32) atomicAdd(&cur[warp][ids[i]], 1);
    __syncthreads();
    const int* cc = (const int*)a.chunk_counts;
    for (int e = threadIdx.x; e < a.E; e += 256) {
        int base = ((const int*)a.cursor)[e];
        for (int p = 0; p < c; ++p) base += cc[(i64)p * a.E + e];
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const int v = cur[w][e];
            cur[w][e] = base;
            base += v;
        }
    }
    __syncthreads();
    place_assignments(ids, i0, (per + 31) / 32, min(i0 + per, n), a.topk, cur[warp], (int*)a.assign_tok, (int*)a.slot_pos);
}

// out[t, :] = Σ_slot w[t, slot] · y[slot_pos[t, slot], :] + sigmoid(sg[t]) · shared[t, :]; with
// acc, out[t, :] plus that sum (the residual add of the MoE block, as add_assign would do it).
// grid (T, ceil(H / 256)), 256 threads: a thread per output, its k + 1 rows' loads in flight
// together. With a.norm (grid (T, 1): a block of 256 or 1024 threads per token), the new row is
// also prepared for the next block's GEMMs as gemm_xprep_norm with that norm prepares it (the
// same bits): the first 256 threads sum the squares in that kernel's order (thread i: columns i,
// i + 256, ...; other warps add zeros to block_sum), then norm_prep_row into xb, xs (rows of
// a.kpad columns).
extern "C" __global__ void __launch_bounds__(1024) moe_combine(const CombineArgs a) {
    pdl_enter();
    __shared__ float red[32];
    const int t = blockIdx.x;
    const float* w = (const float*)a.wts + (i64)t * a.topk;
    const int* sp = (const int*)a.slot_pos + (i64)t * a.topk;
    float gs = a.shared ? 1.f / (1.f + expf(-((const float*)a.shared_gate)[(i64)t * a.ld_sg])) : 0.f;
    float* row = (float*)a.out + (i64)t * a.H;
    for (int h = blockIdx.y * blockDim.x + threadIdx.x; h < a.H; h += gridDim.y * blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < a.topk; ++s) acc += w[s] * ((const float*)a.y)[(i64)sp[s] * a.H + h];
        if (a.shared) acc += gs * ((const float*)a.shared)[(i64)t * a.H + h];
        row[h] = a.acc ? row[h] + acc : acc;
    }
    if (!a.norm) return;
    __syncthreads();  // the row's stores visible to the block
    float ss = 0.f;
    if (threadIdx.x < 256)
        for (int i = threadIdx.x; i < a.H; i += 256) ss += row[i] * row[i];
    ss = block_sum(ss, red);
    const float inv = 1.f / sqrtf(ss / a.H + a.eps);
    norm_prep_row(row, (const float*)a.norm, inv, (__nv_bfloat16*)a.xb + (i64)t * a.kpad, (float*)a.xs + (i64)t * (a.kpad >> 6), nullptr,
                  a.H, a.kpad);
}
