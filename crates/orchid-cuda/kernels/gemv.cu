// Decode matvecs on tensor cores: y[t, r] = Σ_k x[t, k] · W[r, k] for T ≤ 8 tokens (matvec.cuh
// holds the staging, the units and the weight ring).
//
// Shapes: W [rows_pad, kpad] (Q4 or BF16, see common.cuh), x [T, ldx] f32, y [T, ldo] f32.
// A block has 8 warps; a warp computes one 16-row tile over a 1/ksplit share of K, the ksplit
// warps of a tile add their partial sums through shared memory. x is staged once per block as
// bf16 (optionally RMS-normalised on the way: "norm on load"), with per-64 group sums of the
// rounded values for the Q4 bias term. Up to 4 segments (weights sharing x and K) per launch;
// the router's top-k epilogue runs in the last block (atomic counter).

// Writes (or adds) a finished 16-row tile into `base` (the segment's column 0, row stride ld):
// lane (g, t4) holds rows g, g + 8 of tokens 2t4, 2t4 + 1.
DEVI void store_tile(const GemvArgs& a, const GemvSeg& S, i64 row0, float* base, i64 ld, const float* tot) {
    const int g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int n = 2 * t4 + (i & 1);
        i64 r = row0 + g + (i >> 1) * 8;
        if (n < a.T && r < S.rows) {
            float* o = base + (i64)n * ld + r;
            if (a.accumulate) *o += tot[i];
            else *o = tot[i];
        }
    }
}

// The segment holding `tile`; tbase = its first tile.
DEVI int seg_of(const GemvArgs& a, int tile, int& tbase) {
    int si = 0;
    tbase = 0;
    while (si + 1 < a.nseg && tile >= tbase + a.seg[si].tiles) { tbase += a.seg[si].tiles; ++si; }
    return si;
}

// Matvecs too large for one wave (the lm_head; one segment): a grid of resident blocks in which
// every warp takes whole tiles (ksplit 1, no cross-warp reduction), tile = blockIdx.x * 8 + warp,
// then + gridDim.x * 8, ..., and streams their units through its ring without a break between
// tiles, so x is staged once per block and the ring never drains. No router epilogue, no K parts.
template <int FMT>
DEVI void gemv_stream_body(const GemvArgs& a) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int T = a.T, kpad = a.kpad, groups = kpad / 64;
    const int ring_bytes = UnitRing<FMT>::BLOCK_BYTES;
    const XLayout L{(u32*)(smem + ring_bytes), x_words(kpad, FMT == FMT_Q4), FMT == FMT_Q4};
    float* xsum = (float*)(smem + ring_bytes + (size_t)T * L.tstride * 4);
    float* red = xsum + T * groups;  // the staging's block sums (gemv_smem's last 4 KB)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const GemvSeg& S = a.seg[0];
    const int units = FMT == FMT_Q4 ? kpad / 128 : kpad / 32;
    const int first = blockIdx.x * 8 + warp, step = gridDim.x * 8;
    const int n = units_from(first, step, S.tiles) * units;
    // ref and use walk the unit list in order (ring_start / ring_run call them with i = 0, 1, ...),
    // so each keeps a cursor (tile, unit) instead of dividing i by units.
    int r_tile = first, r_u = 0, c_tile = first, c_u = 0;
    auto ref = [&](int) {
        const URef r{tile_ref<FMT>(S.w, S.sb, (i64)r_tile * 16 + g, kpad), r_u};
        if (++r_u == units) { r_u = 0; r_tile += step; }
        return r;
    };
    const UnitRing<FMT> ring = warp_ring<FMT>(smem);
    ring_start(ring, n, ref);
    pdl_enter();
    stage_x((const float*)a.x, a.ldx, T, a.K, kpad, (const float*)a.norm_w, a.eps, L, xsum, red);
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    const XLane xl = x_lane<FMT>(L, xsum, T, groups);
    ring_run(ring, n, ref, [&](int, uint4 A0, uint4 A1, uint2 S0, uint2 S1) {
        unit_any<FMT>(A0, A1, S0, S1, xl, c_u, 1.f, tot);
        if (++c_u == units) {
            store_tile(a, S, (i64)c_tile * 16, (float*)S.out, S.ldo, tot);
            tot[0] = tot[1] = tot[2] = tot[3] = 0.f;
            c_u = 0;
            c_tile += step;
        }
    });
}

template <int FMT>
DEVI void gemv_body(const GemvArgs& a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int s_last;
    const int T = a.T, kpad = a.kpad, groups = kpad / 64;
    // Shared memory: the warps' unit rings, then x (bf16), its group sums, the ksplit partials (also
    // the staging's block sums before them).
    const int ring_bytes = UnitRing<FMT>::BLOCK_BYTES;
    const XLayout L{(u32*)(smem + ring_bytes), x_words(kpad, FMT == FMT_Q4), FMT == FMT_Q4};
    float* xsum = (float*)(smem + ring_bytes + (size_t)T * L.tstride * 4);
    float* red = xsum + T * groups;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int tiles_per_block = 8 / a.ksplit;
    const int tile = blockIdx.x * tiles_per_block + warp / a.ksplit, ks = warp % a.ksplit;
    int tbase;
    const GemvSeg S = a.seg[seg_of(a, tile, tbase)];
    const bool active = tile < tbase + S.tiles;
    const i64 row0 = (i64)(tile - tbase) * 16;
    // With kparts > 1 (router only) block row y covers units [lo, hi) and writes partial sums.
    const int units_all = FMT == FMT_Q4 ? kpad / 128 : kpad / 32;
    const int part = blockIdx.y, kparts = a.kparts > 1 ? a.kparts : 1;
    const int lo = units_all * part / kparts, nunits = units_all * (part + 1) / kparts;
    // The weights are requested before x is staged (and before the previous kernel is waited for:
    // they depend on no kernel of the step), so both are in flight together.
    const TileRef tr = tile_ref<FMT>(S.w, S.sb, row0 + g, kpad);
    const UnitRing<FMT> ring = warp_ring<FMT>(smem);
    const int n = active ? units_from(lo + ks, a.ksplit, nunits) : 0;
    auto ref = [&](int i) { return URef{tr, lo + ks + i * a.ksplit}; };
    ring_start(ring, n, ref);
    pdl_enter();  // weights only above: x is the previous kernel's output
    stage_x((const float*)a.x, a.ldx, T, a.K, kpad, (const float*)a.norm_w, a.eps, L, xsum, red);
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    const XLane xl = x_lane<FMT>(L, xsum, T, groups);
    ring_run(ring, n, ref, [&](int i, uint4 A0, uint4 A1, uint2 S0, uint2 S1) {
        unit_any<FMT>(A0, A1, S0, S1, xl, lo + ks + i * a.ksplit, 1.f, tot);
    });
    bool owner = reduce_ksplit<1>(tot, red, a.ksplit);
    if (owner && active) {
        // K parts write partial sums [part][T][ldo] at the segment's column; the last block adds them.
        if (kparts > 1) store_tile(a, S, row0, (float*)a.partial + ((i64)part * a.T) * a.ldo + S.out_col, a.ldo, tot);
        else store_tile(a, S, row0, (float*)S.out, S.ldo, tot);
    }
    if (a.route_counter) {
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned total = gridDim.x * gridDim.y;
            unsigned prev = atomicAdd((unsigned*)a.route_counter, 1u);
            s_last = prev == total - 1;
        }
        __syncthreads();
        if (s_last) {
            __threadfence();
            if (kparts > 1) {  // sum the K parts in a fixed order
                const int n_out = a.shared_col >= 0 ? a.shared_col + 1 : a.E;
                for (int i = threadIdx.x; i < a.T * n_out; i += blockDim.x) {
                    const i64 o = (i64)(i / n_out) * a.ldo + i % n_out;
                    float v = 0.f;
                    for (int p = 0; p < kparts; ++p) v += __ldcg((const float*)a.partial + (i64)p * a.T * a.ldo + o);
                    ((float*)a.out)[o] = v;
                }
                __threadfence();
                __syncthreads();
            }
            // A warp per token: its top-k ids and weights (row strides topk and topk + shared).
            const int ns = a.shared_col >= 0;
            if (warp < a.T)
                route_topk((const float*)a.out + (i64)warp * a.ldo, a.E, a.topk, a.renorm, a.shared_col, (int*)a.route_ids + warp * a.topk,
                           (float*)a.route_w + warp * (a.topk + ns));
            if (threadIdx.x == 0) *(unsigned*)a.route_counter = 0u;
        }
    }
}

// Three blocks per SM by registers (≤ 80: no weights are held in registers); shared memory (the
// rings) decides between two and three. The launch shape is chosen for one wave where possible.
extern "C" __global__ void __launch_bounds__(256, 3) gemv_q4(const GemvArgs a) { gemv_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_q4_stream(const GemvArgs a) { gemv_stream_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16(const GemvArgs a) { gemv_body<FMT_BF16>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16_stream(const GemvArgs a) { gemv_stream_body<FMT_BF16>(a); }
