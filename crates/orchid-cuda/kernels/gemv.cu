// Decode matvecs on tensor cores: y[t, r] = Σ_k x[t, k] · W[r, k] for T ≤ 8 tokens.
//
// Shapes: W [rows_pad, kpad] (Q4 or BF16, see common.cuh), x [T, ldx] f32, y [T, ldo] f32.
// A block has 8 warps; a warp computes one 16-row tile over a 1/ksplit share of K, the ksplit
// warps of a tile add their partial sums through shared memory. x is staged once per block as
// bf16 (optionally RMS-normalised on the way: "norm on load"), with per-64 group sums of the
// rounded values for the Q4 bias term. Loads are issued in batches of NB units per warp.

#define FMT_Q4 0
#define FMT_BF16 1
#define NB 4

struct GemvSeg {
    u64 w, sb;
    int rows, tiles, out_col, pad;
};

struct GemvArgs {
    GemvSeg seg[4];
    u64 x, norm_w, out, route_counter, route_ids, route_w, partial;
    int nseg, K, kpad, ldx;
    int T, ldo, accumulate, ksplit;
    float eps;
    int E, topk, renorm;
    int shared_col, kparts, pad1, pad2;
};

// Stages x rows (f32, optionally normalised) into shared memory as bf16 [T][kpad + 8] and writes
// per-group sums of the rounded values into xsum [T][kpad / 64]. Zero beyond K.
//
// Fast path (kpad ≤ 4 · NV · blockDim, 16-byte aligned rows): every thread issues all its 16-byte
// loads of a row (x and the norm weights) at once, so staging costs one round trip to L2 plus one
// block reduction for the norm; a 64-group is 16 consecutive float4 = 16 lanes, summed by shuffles.
template <int NV>
DEVI void stage_x_vec(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                      u32* xs32, float* xsum, float* red) {
    const int nvec = kpad >> 2, groups = kpad / 64, stride32 = (kpad + 8) / 2, nt = blockDim.x;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int t = 0; t < T; ++t) {
        const float* xr = x + (i64)t * ldx;
        float4 v[NV], w[NV];
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            const int c = threadIdx.x + i * nt, k = 4 * c;
            const bool ok = c < nvec && k < K;
            v[i] = ok ? ldcg4(xr + k) : zero;
            w[i] = (ok && norm_w) ? __ldg(reinterpret_cast<const float4*>(norm_w + k)) : zero;
        }
        float inv = 1.f;
        if (norm_w) {
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < NV; ++i) ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
            ss = block_sum(ss, red);
            inv = 1.f / sqrtf(ss / K + eps);
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            const int c = threadIdx.x + i * nt;
            if (c < nvec) {  // warp-uniform: nvec is a multiple of 32
                float4 a = v[i];
                if (norm_w) {
                    a.x = a.x * inv * w[i].x; a.y = a.y * inv * w[i].y;
                    a.z = a.z * inv * w[i].z; a.w = a.w * inv * w[i].w;
                }
                const u32 p0 = pack_bf16(a.x, a.y), p1 = pack_bf16(a.z, a.w);
                *reinterpret_cast<uint2*>(xs32 + t * stride32 + 2 * c) = make_uint2(p0, p1);
                float s = bf16_lo(p0) + bf16_hi(p0) + bf16_lo(p1) + bf16_hi(p1);
                s += __shfl_xor_sync(0xffffffffu, s, 8);
                s += __shfl_xor_sync(0xffffffffu, s, 4);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                if ((threadIdx.x & 15) == 0) xsum[t * groups + (c >> 4)] = s;
            }
        }
    }
    __syncthreads();
}

// General path (any K, stride or alignment): scalar loads.
DEVI void stage_x_scalar(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                         u32* xs32, float* xsum, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int groups = kpad / 64, stride32 = (kpad + 8) / 2;
    for (int t = 0; t < T; ++t) {
        const float* xr = x + (i64)t * ldx;
        float inv = 1.f;
        if (norm_w) {
            float ss = 0.f;
            for (int k = threadIdx.x; k < K; k += blockDim.x) ss += xr[k] * xr[k];
            ss = block_sum(ss, red);
            inv = 1.f / sqrtf(ss / K + eps);
        }
        for (int grp = warp; grp < groups; grp += nw) {
            int k = grp * 64 + 2 * lane;
            float v0 = k < K ? xr[k] : 0.f, v1 = k + 1 < K ? xr[k + 1] : 0.f;
            if (norm_w) {
                v0 = k < K ? v0 * inv * norm_w[k] : 0.f;
                v1 = k + 1 < K ? v1 * inv * norm_w[k + 1] : 0.f;
            }
            u32 p = pack_bf16(v0, v1);
            xs32[t * stride32 + k / 2] = p;
            float s = warp_sum(bf16_lo(p) + bf16_hi(p));
            if (lane == 0) xsum[t * groups + grp] = s;
        }
    }
    __syncthreads();
}

DEVI void stage_x(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                  u32* xs32, float* xsum, float* red) {
    const bool vec = (K & 3) == 0 && (T == 1 || (ldx & 3) == 0) && ((u64)x & 15) == 0 && ((u64)norm_w & 15) == 0;
    if (vec && kpad <= 8 * (int)blockDim.x) stage_x_vec<2>(x, ldx, T, K, kpad, norm_w, eps, xs32, xsum, red);
    else if (vec && kpad <= 16 * (int)blockDim.x) stage_x_vec<4>(x, ldx, T, K, kpad, norm_w, eps, xs32, xsum, red);
    else stage_x_scalar(x, ldx, T, K, kpad, norm_w, eps, xs32, xsum, red);
}

// One Q4 unit (128 k = two groups) of a 16-row tile. A0/A1: the lane's 16 bytes of rows g and g+8;
// S0/S1: their (scale|bias) words of groups 2u, 2u+1. xrow: bf16 pairs of column n=g (null if none);
// xsum_n0/xsum_n1: group-sum rows of columns 2t and 2t+1 (null if absent).
DEVI void unit_q4(uint4 A0, uint4 A1, uint2 S0, uint2 S1, const u32* xrow, const float* xs_n0, const float* xs_n1,
                  int u, float coef, float* tot) {
    const int t4 = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        u32 wa0 = j ? A0.z : A0.x, wa1 = j ? A0.w : A0.y;
        u32 wb0 = j ? A1.z : A1.x, wb1 = j ? A1.w : A1.y;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 wa = s < 2 ? wa0 : wa1, wb = s < 2 ? wb0 : wb1;
            int p0 = 2 * (s & 1);
            int k = u * 128 + j * 64 + s * 16 + 2 * t4;
            u32 b0 = xrow ? xrow[k >> 1] : 0u, b1 = xrow ? xrow[(k + 8) >> 1] : 0u;
            mma_bf16(acc, q4_pair(wa, p0), q4_pair(wb, p0), q4_pair(wa, p0 + 1), q4_pair(wb, p0 + 1), b0, b1);
        }
        int grp = 2 * u + j;
        u32 sv0 = j ? S0.y : S0.x, sv1 = j ? S1.y : S1.x;
        float s0 = bf16_lo(sv0), c0 = bf16_hi(sv0) - 128.f * s0;
        float s1 = bf16_lo(sv1), c1 = bf16_hi(sv1) - 128.f * s1;
        float xa = xs_n0 ? xs_n0[grp] : 0.f, xb = xs_n1 ? xs_n1[grp] : 0.f;
        tot[0] += coef * (s0 * acc[0] + c0 * xa);
        tot[1] += coef * (s0 * acc[1] + c0 * xb);
        tot[2] += coef * (s1 * acc[2] + c1 * xa);
        tot[3] += coef * (s1 * acc[3] + c1 * xb);
    }
}

// One BF16 unit (32 k) of a 16-row tile; the lane holds k = 8t..8t+7 of rows g and g+8.
DEVI void unit_bf16(uint4 A0, uint4 A1, const u32* xrow, int u, float coef, float* tot) {
    const int t4 = threadIdx.x & 3;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        int k = u * 32 + 8 * t4 + 4 * s;
        u32 b0 = xrow ? xrow[k >> 1] : 0u, b1 = xrow ? xrow[(k + 2) >> 1] : 0u;
        u32 a0 = s ? A0.z : A0.x, a2 = s ? A0.w : A0.y, a1 = s ? A1.z : A1.x, a3 = s ? A1.w : A1.y;
        mma_bf16(acc, a0, a1, a2, a3, b0, b1);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) tot[i] += coef * acc[i];
}

// Weight row pointers of a tile (rows row0 = tile*16 + g and row0 + 8) for either format.
struct TileRef {
    const uint4* w0;
    const uint4* w1;
    const uint2* s0;
    const uint2* s1;
};

template <int FMT>
DEVI TileRef tile_ref(u64 w, u64 sb, i64 row0, int kpad) {
    TileRef r;
    const int t4 = threadIdx.x & 3;
    if (FMT == FMT_Q4) {
        i64 rb = (i64)kpad / 2;  // bytes per row
        r.w0 = (const uint4*)(w + row0 * rb) + t4;
        r.w1 = (const uint4*)(w + (row0 + 8) * rb) + t4;
        r.s0 = (const uint2*)(sb + row0 * (kpad / 64) * 4);
        r.s1 = (const uint2*)(sb + (row0 + 8) * (kpad / 64) * 4);
    } else {
        i64 rb = (i64)kpad * 2;
        r.w0 = (const uint4*)(w + row0 * rb) + t4;
        r.w1 = (const uint4*)(w + (row0 + 8) * rb) + t4;
        r.s0 = r.s1 = nullptr;
    }
    return r;
}

// N units of one tile in registers (loads in flight together).
template <int N = NB>
struct Batch {
    uint4 A0[N], A1[N];
    uint2 S0[N], S1[N];
};

template <int FMT, int N = NB>
DEVI void load_batch(Batch<N>& b, const TileRef& tr, int u0, int step, int nunits) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        int u = u0 + i * step;
        if (u < nunits) {
            b.A0[i] = ldg_nc(tr.w0 + u * 4);
            b.A1[i] = ldg_nc(tr.w1 + u * 4);
            if (FMT == FMT_Q4) {
                b.S0[i] = ldg_nc2(tr.s0 + u);
                b.S1[i] = ldg_nc2(tr.s1 + u);
            }
        }
    }
}

template <int FMT, int N = NB>
DEVI void compute_batch(const Batch<N>& b, int u0, int step, int nunits, const u32* xrow, const float* xs_n0, const float* xs_n1,
                        float coef, float* tot) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        int u = u0 + i * step;
        if (u < nunits) {
            if (FMT == FMT_Q4) unit_q4(b.A0[i], b.A1[i], b.S0[i], b.S1[i], xrow, xs_n0, xs_n1, u, coef, tot);
            else unit_bf16(b.A0[i], b.A1[i], xrow, u, coef, tot);
        }
    }
}

// Accumulates units u = first, first + step, ... < nunits of one tile into tot.
template <int FMT, int N = NB>
DEVI void tile_units(TileRef tr, int first, int step, int nunits, const u32* xrow, const float* xs_n0, const float* xs_n1,
                     float coef, float* tot) {
    for (int u0 = first; u0 < nunits; u0 += N * step) {
        Batch<N> b;
        load_batch<FMT, N>(b, tr, u0, step, nunits);
        compute_batch<FMT, N>(b, u0, step, nunits, xrow, xs_n0, xs_n1, coef, tot);
    }
}

// Sums the partial tiles of the ksplit warps of each tile; returns true for the warp that owns
// the epilogue (ks == 0). tot has 4*NT values per lane.
template <int NT>
DEVI bool reduce_ksplit(float* tot, float* red, int ksplit) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (ksplit > 1) {
#pragma unroll
        for (int i = 0; i < 4 * NT; ++i) red[(warp * 32 + lane) * 4 * NT + i] = tot[i];
    }
    __syncthreads();
    if (warp % ksplit != 0) return false;
    for (int k2 = 1; k2 < ksplit; ++k2) {
#pragma unroll
        for (int i = 0; i < 4 * NT; ++i) tot[i] += red[((warp + k2) * 32 + lane) * 4 * NT + i];
    }
    return true;
}

// Router epilogue, run by the last block: softmax over E logits, top-k (ties to the lower id),
// optional renormalisation, sigmoid of the shared-expert gate logit.
DEVI void route_topk(const float* logits, int E, int topk, int renorm, int shared_col, int* ids, float* wts) {
    const int lane = threadIdx.x & 31;
    float pv[16];
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int e = lane + 32 * i;
        pv[i] = e < E ? __ldcg(logits + e) : NEG_INF;
        m = fmaxf(m, pv[i]);
    }
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int e = lane + 32 * i;
        pv[i] = e < E ? expf(pv[i] - m) : -1.f;
        sum += e < E ? pv[i] : 0.f;
    }
    sum = warp_sum(sum);
    float picked = 0.f;
    for (int k = 0; k < topk; ++k) {
        float bv = -1.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            int e = lane + 32 * i;
            if (pv[i] > bv) { bv = pv[i]; bi = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if (lane + 32 * i == bi) pv[i] = -1.f;
        float p = bv / sum;
        picked += p;
        if (lane == 0) { ids[k] = bi; wts[k] = p; }
    }
    __syncwarp();
    if (renorm && lane < topk) wts[lane] = wts[lane] / picked;
    if (lane == 0 && shared_col >= 0) wts[topk] = sigmoidf_(__ldcg(logits + shared_col));
}

template <int FMT>
DEVI void gemv_body(const GemvArgs& a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float sred[32];
    __shared__ int s_last;
    const int T = a.T, kpad = a.kpad, groups = kpad / 64, stride32 = (kpad + 8) / 2;
    u32* xs32 = (u32*)smem;
    float* xsum = (float*)(smem + (size_t)T * stride32 * 4);
    float* red = xsum + T * groups;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int tiles_per_block = 8 / a.ksplit;
    const int tile = blockIdx.x * tiles_per_block + warp / a.ksplit, ks = warp % a.ksplit;
    int si = 0, tbase = 0;
    while (si + 1 < a.nseg && tile >= tbase + a.seg[si].tiles) { tbase += a.seg[si].tiles; ++si; }
    const GemvSeg S = a.seg[si];
    const bool active = tile < tbase + S.tiles;
    const i64 row0 = (i64)(tile - tbase) * 16;
    // With kparts > 1 (router only) block row y covers units [lo, hi) and writes partial sums.
    const int units_all = FMT == FMT_Q4 ? kpad / 128 : kpad / 32;
    const int part = blockIdx.y, kparts = a.kparts > 1 ? a.kparts : 1;
    const int lo = units_all * part / kparts, nunits = units_all * (part + 1) / kparts;
    // The first batch of weights is requested before x is staged, so both are in flight together.
    TileRef tr = tile_ref<FMT>(S.w, S.sb, row0 + g, kpad);
    Batch<> first;
    if (active) load_batch<FMT>(first, tr, lo + ks, a.ksplit, nunits);
    pdl_enter();  // weights only above: x is the previous kernel's output
    stage_x((const float*)a.x, a.ldx, T, a.K, kpad, (const float*)a.norm_w, a.eps, xs32, xsum, sred);
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    if (active) {
        const u32* xrow = g < T ? xs32 + g * stride32 : nullptr;
        const float* xa = 2 * t4 < T ? xsum + 2 * t4 * groups : nullptr;
        const float* xb = 2 * t4 + 1 < T ? xsum + (2 * t4 + 1) * groups : nullptr;
        compute_batch<FMT>(first, lo + ks, a.ksplit, nunits, xrow, xa, xb, 1.f, tot);
        tile_units<FMT>(tr, lo + ks + NB * a.ksplit, a.ksplit, nunits, xrow, xa, xb, 1.f, tot);
    }
    bool owner = reduce_ksplit<1>(tot, red, a.ksplit);
    if (owner && active) {
        float* out = kparts > 1 ? (float*)a.partial + (i64)part * a.ldo : (float*)a.out;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int n = 2 * t4 + (i & 1);
            i64 r = row0 + g + (i >> 1) * 8;
            if (n < T && r < S.rows) {
                float* o = out + (i64)n * a.ldo + S.out_col + r;
                if (a.accumulate) *o += tot[i];
                else *o = tot[i];
            }
        }
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
                for (int c = threadIdx.x; c < n_out; c += blockDim.x) {
                    float v = 0.f;
                    for (int p = 0; p < kparts; ++p) v += __ldcg((const float*)a.partial + (i64)p * a.ldo + c);
                    ((float*)a.out)[c] = v;
                }
                __threadfence();
                __syncthreads();
            }
            if (warp == 0)
                route_topk((const float*)a.out, a.E, a.topk, a.renorm, a.shared_col, (int*)a.route_ids, (float*)a.route_w);
            if (threadIdx.x == 0) *(unsigned*)a.route_counter = 0u;
        }
    }
}

// Two blocks per SM guaranteed (≤ 128 registers): the launch shape is chosen for one wave.
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4(const GemvArgs a) { gemv_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16(const GemvArgs a) { gemv_body<FMT_BF16>(a); }

// ---------------------------------------------------------------------------------------------
// Decode MoE, batch 1. Sources: the top-k routed experts (ids[0..topk)) and, if present, the
// shared expert as source topk.

struct MoeUpArgs {
    u64 gate_w, gate_sb, up_w, up_sb;            // stacked routed experts, expert stride rows_e rows
    u64 sh_gate_w, sh_gate_sb, sh_up_w, sh_up_sb;
    u64 x, norm_w, ids, h;                        // h: [nsrc, hstride] f32
    int K, kpad, I, rows_e;
    int Is, topk, hstride, ksplit;
    float eps;
    int has_shared, pad0, pad1;
};

// h[src, r] = silu(gate_src · xn)[r] · (up_src · xn)[r].  grid = (ceil(max(I, Is)/16 / tiles_per_block), nsrc).
template <int FMT>
DEVI void moe_up_body(const MoeUpArgs& a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float sred[32];
    const int kpad = a.kpad, groups = kpad / 64, stride32 = (kpad + 8) / 2;
    u32* xs32 = (u32*)smem;
    float* xsum = (float*)(smem + (size_t)stride32 * 4);
    float* red = xsum + groups;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int src = blockIdx.y;
    const bool shared = src == a.topk;
    const int rows = shared ? a.Is : a.I;
    const int tile = blockIdx.x * (8 / a.ksplit) + warp / a.ksplit, ks = warp % a.ksplit;
    const bool active = tile * 16 < rows;
    const i64 row0 = (i64)tile * 16;
    const int nunits = FMT == FMT_Q4 ? kpad / 128 : kpad / 32;
    TileRef tg, tu;
    // Two units per matrix and warp in registers (gate and up: four loads in flight), so that
    // nothing spills (120 registers, 2 blocks/SM; launch: ksplit 8 for K = 2048, one batch).
    constexpr int NU = 2;
    Batch<NU> bg, bu;
    auto first_loads = [&]() {
        i64 base = shared ? 0 : (i64)((const int*)a.ids)[src] * a.rows_e;
        tg = shared ? tile_ref<FMT>(a.sh_gate_w, a.sh_gate_sb, row0 + g, kpad) : tile_ref<FMT>(a.gate_w, a.gate_sb, base + row0 + g, kpad);
        tu = shared ? tile_ref<FMT>(a.sh_up_w, a.sh_up_sb, row0 + g, kpad) : tile_ref<FMT>(a.up_w, a.up_sb, base + row0 + g, kpad);
        load_batch<FMT, NU>(bg, tg, ks, a.ksplit, nunits);
        load_batch<FMT, NU>(bu, tu, ks, a.ksplit, nunits);
    };
    // The routed experts' ids are the router's (previous kernel's) output: wait first. (Requesting
    // the shared expert's weights before the wait costs 250 B of register spills.)
    pdl_enter();
    if (active) first_loads();
    stage_x((const float*)a.x, 0, 1, a.K, kpad, (const float*)a.norm_w, a.eps, xs32, xsum, sred);
    float tot[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (active) {
        const u32* xrow = g == 0 ? xs32 : nullptr;
        const float* xa = t4 == 0 ? xsum : nullptr;
        compute_batch<FMT, NU>(bg, ks, a.ksplit, nunits, xrow, xa, nullptr, 1.f, tot);
        compute_batch<FMT, NU>(bu, ks, a.ksplit, nunits, xrow, xa, nullptr, 1.f, tot + 4);
        tile_units<FMT, NU>(tg, ks + NU * a.ksplit, a.ksplit, nunits, xrow, xa, nullptr, 1.f, tot);
        tile_units<FMT, NU>(tu, ks + NU * a.ksplit, a.ksplit, nunits, xrow, xa, nullptr, 1.f, tot + 4);
    }
    bool owner = reduce_ksplit<2>(tot, red, a.ksplit);
    if (owner && active && t4 == 0) {
        float* h = (float*)a.h + (i64)src * a.hstride;
        for (int i = 0; i < 2; ++i) {
            i64 r = row0 + g + 8 * i;
            if (r < rows) {
                float gv = tot[2 * i], uv = tot[4 + 2 * i];
                h[r] = gv / (1.f + expf(-gv)) * uv;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_up_q4(const MoeUpArgs a) { moe_up_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_up_bf16(const MoeUpArgs a) { moe_up_body<FMT_BF16>(a); }

struct MoeDownArgs {
    u64 down_w, down_sb, sh_down_w, sh_down_sb;
    u64 h, route_w, ids, out;                     // out [H] f32, accumulated
    int H, rows_e, kpad_r, kpad_s;
    int I, Is, topk, has_shared;
    int hstride, ksplit, pad0, pad1;
};

// out[r] += Σ_src w_src · (down_src · h_src)[r].  grid = ceil(H/16 / tiles_per_block).
template <int FMT>
DEVI void moe_down_body(const MoeDownArgs& a) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int nsrc = a.topk + a.has_shared;
    const int kmax = a.kpad_r > a.kpad_s ? a.kpad_r : a.kpad_s;
    const int stride32 = (kmax + 8) / 2, groups = kmax / 64;
    u32* xs32 = (u32*)smem;
    float* xsum = (float*)(smem + (size_t)nsrc * stride32 * 4);
    float* red = xsum + nsrc * groups;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int tile = blockIdx.x * (8 / a.ksplit) + warp / a.ksplit, ks = warp % a.ksplit;
    const bool active = tile * 16 < a.H;
    const i64 row0 = (i64)tile * 16;
    // Units of all sources in one flat list, so that every warp has NB loads in flight.
    const int upu = FMT == FMT_Q4 ? 128 : 32;
    const int nu_r = a.kpad_r / upu, nu_s = a.kpad_s / upu;
    const int n_r = a.topk * nu_r, total = n_r + (a.has_shared ? nu_s : 0);
    const int* ids = (const int*)a.ids;
    const float* rw = (const float*)a.route_w;
    auto load = [&](Batch<>& b, int f0) {
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            int f = f0 + i * a.ksplit;
            if (f < total) {
                int src = f < n_r ? f / nu_r : a.topk, u = f < n_r ? f % nu_r : f - n_r;
                TileRef tr = src == a.topk ? tile_ref<FMT>(a.sh_down_w, a.sh_down_sb, row0 + g, a.kpad_s)
                                           : tile_ref<FMT>(a.down_w, a.down_sb, (i64)ids[src] * a.rows_e + row0 + g, a.kpad_r);
                b.A0[i] = ldg_nc(tr.w0 + u * 4);
                b.A1[i] = ldg_nc(tr.w1 + u * 4);
                if (FMT == FMT_Q4) {
                    b.S0[i] = ldg_nc2(tr.s0 + u);
                    b.S1[i] = ldg_nc2(tr.s1 + u);
                }
            }
        }
    };
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    auto compute = [&](const Batch<>& b, int f0) {
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            int f = f0 + i * a.ksplit;
            if (f < total) {
                int src = f < n_r ? f / nu_r : a.topk, u = f < n_r ? f % nu_r : f - n_r;
                const u32* xrow = g == 0 ? xs32 + src * stride32 : nullptr;
                const float* xa = t4 == 0 ? xsum + src * groups : nullptr;
                if (FMT == FMT_Q4) unit_q4(b.A0[i], b.A1[i], b.S0[i], b.S1[i], xrow, xa, nullptr, u, rw[src], tot);
                else unit_bf16(b.A0[i], b.A1[i], xrow, u, rw[src], tot);
            }
        }
    };
    Batch<> first;
    // ids and route_w come from the router, two kernels back: complete before the previous kernel
    // (moe_up) passed its own wait and released this one (see pdl_wait in common.cuh).
    if (active) load(first, ks);
    pdl_enter();
    // Stage the expert activations (bf16) and their group sums while the weights arrive.
    const int cpr = kmax >> 2, total_c = nsrc * cpr;  // float4 chunks (cpr is a multiple of 32)
    if ((a.hstride & 3) == 0 && (a.I & 3) == 0 && (a.Is & 3) == 0 && ((u64)a.h & 15) == 0) {
        constexpr int VPT = 5;  // 9 sources x 512 = 1152 chunks: one round of loads with 256 threads
        for (int q0 = 0; q0 < total_c; q0 += VPT * (int)blockDim.x) {
            float4 v[VPT];
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int q = q0 + threadIdx.x + i * blockDim.x;
                const int src = q / cpr, c = q - src * cpr, k = 4 * c;
                const int K = src < a.topk ? a.I : a.Is;
                v[i] = (q < total_c && k < K) ? ldcg4((const float*)a.h + (i64)src * a.hstride + k) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int q = q0 + threadIdx.x + i * blockDim.x;
                if (q < total_c) {  // warp-uniform: total_c is a multiple of 32
                    const int src = q / cpr, c = q - src * cpr;
                    const u32 p0 = pack_bf16(v[i].x, v[i].y), p1 = pack_bf16(v[i].z, v[i].w);
                    *reinterpret_cast<uint2*>(xs32 + src * stride32 + 2 * c) = make_uint2(p0, p1);
                    float sm = bf16_lo(p0) + bf16_hi(p0) + bf16_lo(p1) + bf16_hi(p1);
                    sm += __shfl_xor_sync(0xffffffffu, sm, 8);
                    sm += __shfl_xor_sync(0xffffffffu, sm, 4);
                    sm += __shfl_xor_sync(0xffffffffu, sm, 2);
                    sm += __shfl_xor_sync(0xffffffffu, sm, 1);
                    if ((threadIdx.x & 15) == 0) xsum[src * groups + (c >> 4)] = sm;
                }
            }
        }
    } else {
        for (int item = warp; item < nsrc * groups; item += 8) {
            int src = item / groups, grp = item % groups;
            int K = src < a.topk ? a.I : a.Is;
            const float* hr = (const float*)a.h + (i64)src * a.hstride;
            int k = grp * 64 + 2 * lane;
            float v0 = k < K ? hr[k] : 0.f, v1 = k + 1 < K ? hr[k + 1] : 0.f;
            u32 p = pack_bf16(v0, v1);
            xs32[src * stride32 + k / 2] = p;
            float sm = warp_sum(bf16_lo(p) + bf16_hi(p));
            if (lane == 0) xsum[src * groups + grp] = sm;
        }
    }
    __syncthreads();
    if (active) {
        compute(first, ks);
        for (int f0 = ks + NB * a.ksplit; f0 < total; f0 += NB * a.ksplit) {
            Batch<> b;
            load(b, f0);
            compute(b, f0);
        }
    }
    bool owner = reduce_ksplit<1>(tot, red, a.ksplit);
    if (owner && active && t4 == 0) {
        float* out = (float*)a.out;
        for (int i = 0; i < 2; ++i) {
            i64 r = row0 + g + 8 * i;
            if (r < a.H) out[r] += tot[2 * i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_down_q4(const MoeDownArgs a) { moe_down_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_down_bf16(const MoeDownArgs a) { moe_down_body<FMT_BF16>(a); }
