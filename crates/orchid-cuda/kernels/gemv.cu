// Decode matvecs on tensor cores: y[t, r] = Σ_k x[t, k] · W[r, k] for T ≤ 8 tokens.
//
// Shapes: W [rows_pad, kpad] (Q4 or BF16, see common.cuh), x [T, ldx] f32, y [T, ldo] f32.
// A block has 8 warps; a warp computes one 16-row tile over a 1/ksplit share of K, the ksplit
// warps of a tile add their partial sums through shared memory. x is staged once per block as
// bf16 (optionally RMS-normalised on the way: "norm on load"), with per-64 group sums of the
// rounded values for the Q4 bias term.
//
// Weights stream through a warp-private ring of RING unit slots in shared memory (UnitRing): at the
// start every warp requests its first RING units with cp.async (no registers held while they are in
// flight, so a one-wave matvec has all of its bytes requested before x is even staged), then
// consumes them in order and refills each slot with the unit RING ahead. Each lane copies exactly the
// words it will read itself, so its own cp.async.wait_group is the only synchronisation needed.

#define FMT_Q4 0
#define FMT_BF16 1

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

// Where staged x lives in shared memory, as bf16 pairs (words). Row layout (BF16 weights):
// token t's word q at t * (kpad + 8) / 2 + q. Fragment layout (Q4 weights): the 16 words lane
// quad member t4 feeds to the 8 mma of unit u (B fragments b0, b1 of j = 0, 1 and s = 0..3) are
// consecutive, words (u * 4 + t4) * XF_STRIDE + j * 8 + s * 2 + {0, 1}, so a lane reads a unit's x
// with four 16-byte loads instead of sixteen 4-byte ones (stride 20: the four t4 of a warp hit
// disjoint banks).
#define XF_STRIDE 20
struct XLayout {
    u32* base;
    int tstride;  // words per token
    bool frag;
    DEVI int word(int t, int q) const {
        if (!frag) return t * tstride + q;
        const int u = q >> 6, r = q & 63, r3 = r & 7;
        return t * tstride + (u * 4 + (r3 & 3)) * XF_STRIDE + (r >> 5) * 8 + ((r >> 3) & 3) * 2 + (r3 >> 2);
    }
};
// Words per staged token for kpad (multiple of 128).
DEVI int x_words(int kpad, bool frag) { return frag ? kpad / 128 * 4 * XF_STRIDE : (kpad + 8) / 2; }

// Stages x rows (f32, optionally normalised) into shared memory as bf16 (layout L) and writes
// per-group sums of the rounded values into xsum [T][kpad / 64]. Zero beyond K.
//
// Fast path (kpad ≤ 4 · NV · blockDim, 16-byte aligned rows): every thread issues all its 16-byte
// loads of a row (x and the norm weights) at once, so staging costs one round trip to L2 plus one
// block reduction for the norm; a 64-group is 16 consecutive float4 = 16 lanes, summed by shuffles.
template <int NV>
DEVI void stage_x_vec(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                      const XLayout& L, float* xsum, float* red) {
    const int nvec = kpad >> 2, groups = kpad / 64, nt = blockDim.x;
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
                L.base[L.word(t, 2 * c)] = p0;
                L.base[L.word(t, 2 * c + 1)] = p1;
                const float s = group64_sum(p0, p1);
                if ((threadIdx.x & 15) == 0) xsum[t * groups + (c >> 4)] = s;
            }
        }
    }
    __syncthreads();
}

// General path (any K, stride or alignment): scalar loads.
DEVI void stage_x_scalar(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                         const XLayout& L, float* xsum, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int groups = kpad / 64;
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
            L.base[L.word(t, k / 2)] = p;
            float s = warp_sum(bf16_lo(p) + bf16_hi(p));
            if (lane == 0) xsum[t * groups + grp] = s;
        }
    }
    __syncthreads();
}

DEVI void stage_x(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                  const XLayout& L, float* xsum, float* red) {
    const bool vec = (K & 3) == 0 && (T == 1 || (ldx & 3) == 0) && ((u64)x & 15) == 0 && ((u64)norm_w & 15) == 0;
    if (vec && kpad <= 8 * (int)blockDim.x) stage_x_vec<2>(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
    else if (vec && kpad <= 16 * (int)blockDim.x) stage_x_vec<4>(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
    else stage_x_scalar(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
}

// One Q4 unit of a 16-row tile from the fragment layout. xf: the lane's 16 words of unit u (of
// token min(g, T - 1): columns n ≥ T are never stored, so they may hold any token); sa / sb: the
// group sums (2u, 2u + 1) of the tokens of the lane's C columns 2t4 and 2t4 + 1.
DEVI void unit_q4f(uint4 A0, uint4 A1, uint2 S0, uint2 S1, const u32* xf, float2 sa, float2 sb, float coef, float* tot) {
    const uint4 X0 = *reinterpret_cast<const uint4*>(xf), X1 = *reinterpret_cast<const uint4*>(xf + 4);
    const uint4 X2 = *reinterpret_cast<const uint4*>(xf + 8), X3 = *reinterpret_cast<const uint4*>(xf + 12);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const u32 wa0 = j ? A0.z : A0.x, wa1 = j ? A0.w : A0.y;
        const u32 wb0 = j ? A1.z : A1.x, wb1 = j ? A1.w : A1.y;
        const uint4 Xa = j ? X2 : X0, Xb = j ? X3 : X1;  // words j*8 + 0..3 and j*8 + 4..7
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const u32 wa = s < 2 ? wa0 : wa1, wb = s < 2 ? wb0 : wb1;
            const int p0 = 2 * (s & 1);
            const uint4 Xs = s < 2 ? Xa : Xb;
            const u32 b0 = (s & 1) ? Xs.z : Xs.x, b1 = (s & 1) ? Xs.w : Xs.y;
            mma_bf16(acc, q4_pair(wa, p0), q4_pair(wb, p0), q4_pair(wa, p0 + 1), q4_pair(wb, p0 + 1), b0, b1);
        }
        // tot += coef · (s · acc + c · xsum), c = bias − 128 s (the +128 of q4_pair): two fmas per
        // output (coef = 1 folds away in the matvecs).
        const u32 sv0 = j ? S0.y : S0.x, sv1 = j ? S1.y : S1.x;
        const float s0 = bf16_lo(sv0), c0 = bf16_hi(sv0) - 128.f * s0;
        const float s1 = bf16_lo(sv1), c1 = bf16_hi(sv1) - 128.f * s1;
        const float xa = j ? sa.y : sa.x, xb = j ? sb.y : sb.x;
        const float k0 = coef * s0, k1 = coef * s1, d0 = coef * c0, d1 = coef * c1;
        tot[0] = fmaf(k0, acc[0], fmaf(d0, xa, tot[0]));
        tot[1] = fmaf(k0, acc[1], fmaf(d0, xb, tot[1]));
        tot[2] = fmaf(k1, acc[2], fmaf(d1, xa, tot[2]));
        tot[3] = fmaf(k1, acc[3], fmaf(d1, xb, tot[3]));
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

// A lane's view of staged x: Q4: the fragment words of unit 0 of its B token (token min(g, T-1));
// BF16: its B token's row (null for g ≥ T). sa / sb: group sums of the tokens of its C columns.
struct XLane {
    const u32* x;
    const float* sa;
    const float* sb;
};

template <int FMT>
DEVI XLane x_lane(const XLayout& L, const float* xsum, int T, int groups) {
    const int g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
    const int ta = min(2 * t4, T - 1), tb = min(2 * t4 + 1, T - 1);
    XLane xl;
    if (FMT == FMT_Q4) xl.x = L.base + min(g, T - 1) * L.tstride + t4 * XF_STRIDE;
    else xl.x = g < T ? L.base + g * L.tstride : nullptr;
    xl.sa = xsum + ta * groups;
    xl.sb = xsum + tb * groups;
    return xl;
}

// Unit u of a tile (either format), scaled by coef, into tot.
template <int FMT>
DEVI void unit_any(uint4 A0, uint4 A1, uint2 S0, uint2 S1, const XLane& xl, int u, float coef, float* tot) {
    if (FMT == FMT_Q4)
        unit_q4f(A0, A1, S0, S1, xl.x + u * 4 * XF_STRIDE, *reinterpret_cast<const float2*>(xl.sa + 2 * u),
                 *reinterpret_cast<const float2*>(xl.sb + 2 * u), coef, tot);
    else
        unit_bf16(A0, A1, xl.x, u, coef, tot);
}

// Weight row pointers of a tile (rows row0 = tile*16 + g and row0 + 8) for either format.
struct TileRef {
    const uint4* w0;
    const uint4* w1;
    const uint2* s0;
    const uint2* s1;
};

// Unit u of the tile is at w0 + u * W_USTEP<FMT> (and s0 + u * Q4_SB_UNIT / 8): Q4 units of a
// 16-row tile are contiguous (q4_offset in common.cuh), bf16 rows are row-major.
template <int FMT>
constexpr int W_USTEP = FMT == FMT_Q4 ? Q4_UNIT / 16 : 4;  // in uint4
template <int FMT>
DEVI TileRef tile_ref(u64 w, u64 sb, i64 row0, int kpad) {
    TileRef r;
    const int t4 = threadIdx.x & 3;
    if (FMT == FMT_Q4) {  // row0 = 16 · tile + g (g < 8): rows g and g + 8 of the tile
        r.w0 = (const uint4*)(w + q4_offset(row0, 0, kpad)) + t4;
        r.w1 = r.w0 + 8 * 64 / 16;
        r.s0 = (const uint2*)(sb + q4_sb_offset(row0, 0, kpad));
        r.s1 = r.s0 + 8;
    } else {
        i64 rb = (i64)kpad * 2;
        r.w0 = (const uint4*)(w + row0 * rb) + t4;
        r.w1 = (const uint4*)(w + (row0 + 8) * rb) + t4;
        r.s0 = r.s1 = nullptr;
    }
    return r;
}

// The ring's 8-byte copy (scale/bias words, through L1: a lane quad shares them): no predicate,
// and a "memory" clobber: the ring only requests units that exist (`issue` is called for i < n).
DEVI void cp_async8_ring(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}

#define RING 4  // unit slots per warp (ops::RING_SLOTS): 8 warps x 4 x 1.5 KB = 48 KB per block (Q4)

// A unit to fetch: the tile's row pointers and the unit index along K.
struct URef {
    TileRef tr;
    int u;
};

// Warp-private ring of RING unit slots. Slot layout (Q4): A0 of the 32 lanes, A1 of the 32 lanes,
// then (S0, S1) of the 32 lanes, 16 bytes per lane each: lane-contiguous, no bank conflicts.
template <int FMT>
struct UnitRing {
    static constexpr int SLOT = FMT == FMT_Q4 ? 32 * 48 : 32 * 32;
    static constexpr int BLOCK_BYTES = 8 * RING * SLOT;  // the 8 warps' rings
    unsigned char* base;  // this warp's RING slots

    DEVI void issue(int slot, const URef& r) const {
        unsigned char* s = base + slot * SLOT + (threadIdx.x & 31) * 16;
        cp_async16(s, r.tr.w0 + r.u * W_USTEP<FMT>, true);
        cp_async16(s + 512, r.tr.w1 + r.u * W_USTEP<FMT>, true);
        if (FMT == FMT_Q4) {
            cp_async8_ring(s + 1024, r.tr.s0 + r.u * (Q4_SB_UNIT / 8));
            cp_async8_ring(s + 1032, r.tr.s1 + r.u * (Q4_SB_UNIT / 8));
        }
    }
    DEVI void get(int slot, uint4& A0, uint4& A1, uint2& S0, uint2& S1) const {
        const unsigned char* s = base + slot * SLOT + (threadIdx.x & 31) * 16;
        A0 = *reinterpret_cast<const uint4*>(s);
        A1 = *reinterpret_cast<const uint4*>(s + 512);
        if (FMT == FMT_Q4) {
            const uint4 sv = *reinterpret_cast<const uint4*>(s + 1024);
            S0 = make_uint2(sv.x, sv.y);
            S1 = make_uint2(sv.z, sv.w);
        }
    }
};

// The warp's ring in a block's shared memory (rings first, 8 warps).
template <int FMT>
DEVI UnitRing<FMT> warp_ring(unsigned char* smem) { return UnitRing<FMT>{smem + (threadIdx.x >> 5) * RING * UnitRing<FMT>::SLOT}; }

// Requests units 0 .. min(n, RING) - 1. Commits exactly RING groups (empty ones included), so
// that before unit i is consumed RING + i groups are committed and waiting for all but the newest
// RING - 1 completes unit i. Every thread of the block must call ring_start and ring_run (n may
// be 0); ref(i) is called for i = 0, 1, ... in order (callers may keep cursors).
template <int FMT, class Ref>
DEVI void ring_start(const UnitRing<FMT>& ring, int n, Ref& ref) {
#pragma unroll
    for (int s = 0; s < RING; ++s) {
        if (s < n) ring.issue(s, ref(s));
        cp_async_commit();
    }
}

// Consumes units 0 .. n - 1 in order (use(i, A0, A1, S0, S1)), refilling each slot with unit
// i + RING. Unrolled by RING so that slots are compile-time offsets.
template <int FMT, class Ref, class Use>
DEVI void ring_run(const UnitRing<FMT>& ring, int n, Ref& ref, Use&& use) {
    for (int i0 = 0; i0 < n; i0 += RING) {
#pragma unroll
        for (int k = 0; k < RING; ++k) {
            const int i = i0 + k;
            if (i < n) {
                cp_async_wait<RING - 1>();
                uint4 A0, A1;
                uint2 S0 = make_uint2(0u, 0u), S1 = make_uint2(0u, 0u);
                ring.get(k, A0, A1, S0, S1);
                use(i, A0, A1, S0, S1);
                // The slot's words are consumed; this "memory" clobber keeps the compiler from
                // moving its reads below the refill.
                asm volatile("" ::: "memory");
                if (i + RING < n) ring.issue(k, ref(i + RING));
            }
            cp_async_commit();
        }
    }
}

// Units a warp handles when it takes u = first, first + step, ... < nunits.
DEVI int units_from(int first, int step, int nunits) { return first < nunits ? (nunits - first + step - 1) / step : 0; }

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
// GLOBAL: logits written by other blocks (read through L2); else logits in shared memory.
template <bool GLOBAL = true>
DEVI void route_topk(const float* logits, int E, int topk, int renorm, int shared_col, int* ids, float* wts) {
    const int lane = threadIdx.x & 31;
    float pv[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int e = lane + 32 * i;
        pv[i] = e < E ? (GLOBAL ? __ldcg(logits + e) : logits[e]) : NEG_INF;
    }
    const float sum = warp_softmax16(pv, E);
    float picked = 0.f;
    for (int k = 0; k < topk; ++k) {
        int bi;
        const float bv = warp_take_max(pv, bi);
        float p = bv / sum;
        picked += p;
        if (lane == 0) { ids[k] = bi; wts[k] = p; }
    }
    __syncwarp();
    if (renorm && lane < topk) wts[lane] = wts[lane] / picked;
    if (lane == 0 && shared_col >= 0) wts[topk] = sigmoidf_(GLOBAL ? __ldcg(logits + shared_col) : logits[shared_col]);
}

// Writes (or adds) a finished 16-row tile: lane (g, t4) holds rows g, g + 8 of tokens 2t4, 2t4 + 1.
DEVI void store_tile(const GemvArgs& a, const GemvSeg& S, i64 row0, float* out, const float* tot) {
    const int g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int n = 2 * t4 + (i & 1);
        i64 r = row0 + g + (i >> 1) * 8;
        if (n < a.T && r < S.rows) {
            float* o = out + (i64)n * a.ldo + S.out_col + r;
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
    __shared__ float sred[32];
    const int T = a.T, kpad = a.kpad, groups = kpad / 64;
    const int ring_bytes = UnitRing<FMT>::BLOCK_BYTES;
    const XLayout L{(u32*)(smem + ring_bytes), x_words(kpad, FMT == FMT_Q4), FMT == FMT_Q4};
    float* xsum = (float*)(smem + ring_bytes + (size_t)T * L.tstride * 4);
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
    stage_x((const float*)a.x, a.ldx, T, a.K, kpad, (const float*)a.norm_w, a.eps, L, xsum, sred);
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    const XLane xl = x_lane<FMT>(L, xsum, T, groups);
    ring_run(ring, n, ref, [&](int, uint4 A0, uint4 A1, uint2 S0, uint2 S1) {
        unit_any<FMT>(A0, A1, S0, S1, xl, c_u, 1.f, tot);
        if (++c_u == units) {
            store_tile(a, S, (i64)c_tile * 16, (float*)a.out, tot);
            tot[0] = tot[1] = tot[2] = tot[3] = 0.f;
            c_u = 0;
            c_tile += step;
        }
    });
}

template <int FMT>
DEVI void gemv_body(const GemvArgs& a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float sred[32];
    __shared__ int s_last;
    const int T = a.T, kpad = a.kpad, groups = kpad / 64;
    // Shared memory: the warps' unit rings, then x (bf16), its group sums, the ksplit partials.
    const int ring_bytes = UnitRing<FMT>::BLOCK_BYTES;
    const XLayout L{(u32*)(smem + ring_bytes), x_words(kpad, FMT == FMT_Q4), FMT == FMT_Q4};
    float* xsum = (float*)(smem + ring_bytes + (size_t)T * L.tstride * 4);
    float* red = xsum + T * groups;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
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
    stage_x((const float*)a.x, a.ldx, T, a.K, kpad, (const float*)a.norm_w, a.eps, L, xsum, sred);
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    const XLane xl = x_lane<FMT>(L, xsum, T, groups);
    ring_run(ring, n, ref, [&](int i, uint4 A0, uint4 A1, uint2 S0, uint2 S1) {
        unit_any<FMT>(A0, A1, S0, S1, xl, lo + ks + i * a.ksplit, 1.f, tot);
    });
    bool owner = reduce_ksplit<1>(tot, red, a.ksplit);
    if (owner && active) store_tile(a, S, row0, kparts > 1 ? (float*)a.partial + (i64)part * a.ldo : (float*)a.out, tot);
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

// Three blocks per SM by registers (≤ 80: no weights are held in registers); shared memory (the
// rings) decides between two and three. The launch shape is chosen for one wave where possible.
extern "C" __global__ void __launch_bounds__(256, 3) gemv_q4(const GemvArgs a) { gemv_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_q4_stream(const GemvArgs a) { gemv_stream_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16(const GemvArgs a) { gemv_body<FMT_BF16>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16_stream(const GemvArgs a) { gemv_stream_body<FMT_BF16>(a); }

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
    // Fused router (moe_route_up_*): bf16 router rows [E] and shared-gate row (col E), K parts,
    // partial sums [kparts][E + 1], barrier counters {arrived, departed}, routing weights out.
    u64 router_w, sgate_w, partial, barrier, route_w;
    int E, renorm, kparts, router_blocks;
};

// One bf16 unit (32 k) of a 16-row tile against token 0 of fragment-ordered x (the router inside
// moe_route_up, whose x is staged for the Q4 experts): four scalar reads, once per warp.
DEVI void unit_bf16_frag(uint4 A0, uint4 A1, const XLayout& L, int u, float* tot) {
    const int t4 = threadIdx.x & 3;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int q = (u * 32 + 8 * t4 + 4 * s) >> 1;
        const u32 b0 = L.base[L.word(0, q)], b1 = L.base[L.word(0, q + 1)];
        const u32 a0 = s ? A0.z : A0.x, a2 = s ? A0.w : A0.y, a1 = s ? A1.z : A1.x, a3 = s ? A1.w : A1.y;
        mma_bf16(acc, a0, a1, a2, a3, b0, b1);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) tot[i] += acc[i];
}

// The router inside moe_route_up (decode, one token). Blocks b < router_blocks each compute one
// (16-row router tile, K part) like the router matvec (8 warps, one bf16 unit each, weights
// requested before the wait) and write its partial sums; a grid barrier (every block of the grid
// is resident: the launch guarantees it) lets every block sum the parts in the same fixed order
// as the router matvec's last block, so all blocks (and the host-visible copy written by block
// 0 for moe_down) hold identical routing, then take the top-k. Ends with the successor released:
// moe_down reads the routing before its own wait.
DEVI void route_phase(const MoeUpArgs& a, const XLayout& L, float* xsum, float* red, float* sred, int* s_ids) {
    __shared__ float s_logits[513];
    __shared__ float s_w[33];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    // Router tiles: E / 16 of the router (E % 16 == 0, checked at launch), then one for the
    // shared-expert gate row if there is one.
    const int b = blockIdx.y * gridDim.x + blockIdx.x, rtiles = a.E / 16 + a.has_shared;
    const int units = a.kpad / 32, kp = a.kparts;
    const bool router = b < a.router_blocks;
    const int tile = b % rtiles, part = b / rtiles;
    const int lo = units * part / kp, hi = units * (part + 1) / kp, u = lo + warp;
    const bool sg = a.has_shared && tile == rtiles - 1;
    uint4 A0 = make_uint4(0u, 0u, 0u, 0u), A1 = A0;
    if (router && u < hi) {
        const i64 row = sg ? g : (i64)tile * 16 + g;
        const TileRef tr = tile_ref<FMT_BF16>(sg ? a.sgate_w : a.router_w, 0, row, a.kpad);
        A0 = ldg_nc(tr.w0 + u * 4);
        A1 = ldg_nc(tr.w1 + u * 4);
    }
    pdl_wait();
    stage_x((const float*)a.x, 0, 1, a.K, a.kpad, (const float*)a.norm_w, a.eps, L, xsum, sred);
    volatile unsigned* bar = (volatile unsigned*)a.barrier;
    if (router) {
        float tot[4] = {0.f, 0.f, 0.f, 0.f};
        if (u < hi) unit_bf16_frag(A0, A1, L, u, tot);
        for (int v = u + 8; v < hi; v += 8) {  // more than 8 units per part (K > 2048)
            const i64 row = sg ? g : (i64)tile * 16 + g;
            const TileRef tr = tile_ref<FMT_BF16>(sg ? a.sgate_w : a.router_w, 0, row, a.kpad);
            unit_bf16_frag(ldg_nc(tr.w0 + v * 4), ldg_nc(tr.w1 + v * 4), L, v, tot);
        }
        if (reduce_ksplit<1>(tot, red, 8) && t4 == 0) {  // warp 0: rows g, g + 8 of column 0
            float* out = (float*)a.partial + (i64)part * (a.E + 1);
            if (sg) {
                if (g == 0) out[a.E] = tot[0];
            } else {
                out[tile * 16 + g] = tot[0];
                out[tile * 16 + g + 8] = tot[2];
            }
            __threadfence();  // each writer's partials visible before the block arrives
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd((unsigned*)&bar[0], 1u);
        }
    }
    if (threadIdx.x == 0) {
        // Bounded spin: a broken invariant gives wrong routing (caught by the tests), not a hang.
        for (long long it = 0; bar[0] < (unsigned)a.router_blocks && it < (1ll << 26); ++it) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
    // Sum the K parts in a fixed order. E + 1 columns (the shared-expert gate last) for 256
    // threads: a thread's two columns are loaded together, so this is one round trip to L2.
    const int n_out = a.E + 1;
    for (int c = threadIdx.x; c < n_out; c += 2 * blockDim.x) {
        const int c2 = c + blockDim.x;
        float v = 0.f, v2 = 0.f;
        for (int p = 0; p < kp; ++p) {
            const float* part = (const float*)a.partial + (i64)p * n_out;
            v += __ldcg(part + c);
            if (c2 < n_out) v2 += __ldcg(part + c2);
        }
        s_logits[c] = v;
        if (c2 < n_out) s_logits[c2] = v2;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the last block out resets the barrier for the next MoE layer
        const unsigned gone = atomicAdd((unsigned*)&bar[1], 1u);
        if (gone == gridDim.x * gridDim.y - 1) {
            bar[0] = 0u;
            bar[1] = 0u;
        }
    }
    if (warp == 0) route_topk<false>(s_logits, a.E, a.topk, a.renorm, a.has_shared ? a.E : -1, s_ids, s_w);
    __syncthreads();
    if (b == 0 && threadIdx.x <= a.topk) {  // moe_down's copy
        if (threadIdx.x < a.topk) ((int*)a.ids)[threadIdx.x] = s_ids[threadIdx.x];
        if (threadIdx.x < a.topk || a.has_shared) ((float*)a.route_w)[threadIdx.x] = s_w[threadIdx.x];
        __threadfence();
    }
    __syncthreads();
    pdl_launch();
}

// h[src, r] = silu(gate_src · xn)[r] · (up_src · xn)[r].  grid = (ceil(max(I, Is)/16 / tiles_per_block), nsrc).
template <int FMT, bool ROUTE = false>
DEVI void moe_up_body(const MoeUpArgs& a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float sred[32];
    __shared__ int s_ids[32];
    const int kpad = a.kpad, groups = kpad / 64;
    const int ring_bytes = UnitRing<FMT>::BLOCK_BYTES;
    const XLayout L{(u32*)(smem + ring_bytes), x_words(kpad, FMT == FMT_Q4), FMT == FMT_Q4};
    float* xsum = (float*)(smem + ring_bytes + (size_t)L.tstride * 4);
    float* red = xsum + groups;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int src = blockIdx.y;
    const bool shared = src == a.topk;
    const int rows = shared ? a.Is : a.I;
    const int tile = blockIdx.x * (8 / a.ksplit) + warp / a.ksplit, ks = warp % a.ksplit;
    const bool active = tile * 16 < rows;
    const i64 row0 = (i64)tile * 16;
    const int nunits = FMT == FMT_Q4 ? kpad / 128 : kpad / 32;
    // The warp's units alternate gate and up: unit i is matrix i & 1, K unit ks + (i >> 1) * ksplit.
    const UnitRing<FMT> ring = warp_ring<FMT>(smem);
    const int n = active ? 2 * units_from(ks, a.ksplit, nunits) : 0;
    TileRef tg, tu;
    auto refs = [&]() {
        const i64 base = shared ? 0 : (i64)(ROUTE ? s_ids[src] : ((const int*)a.ids)[src]) * a.rows_e;
        tg = shared ? tile_ref<FMT>(a.sh_gate_w, a.sh_gate_sb, row0 + g, kpad) : tile_ref<FMT>(a.gate_w, a.gate_sb, base + row0 + g, kpad);
        tu = shared ? tile_ref<FMT>(a.sh_up_w, a.sh_up_sb, row0 + g, kpad) : tile_ref<FMT>(a.up_w, a.up_sb, base + row0 + g, kpad);
    };
    auto ref = [&](int i) { return URef{(i & 1) ? tu : tg, ks + (i >> 1) * a.ksplit}; };
    // The routed experts' ids are the router's (previous kernel's, or with ROUTE this kernel's
    // first phase) output. The shared expert depends on nothing of this step: its weights are
    // requested before the wait.
    if (ROUTE) {
        if (shared) {
            refs();
            ring_start(ring, n, ref);
        }
        route_phase(a, L, xsum, red, sred, s_ids);  // waits for the previous kernel, releases the next
        if (!shared) {
            if (active) refs();
            ring_start(ring, n, ref);
        }
    } else if (shared) {
        refs();
        ring_start(ring, n, ref);
        pdl_enter();
    } else {
        pdl_enter();
        if (active) refs();
        ring_start(ring, n, ref);
    }
    if (!ROUTE) stage_x((const float*)a.x, 0, 1, a.K, kpad, (const float*)a.norm_w, a.eps, L, xsum, sred);
    float tot[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const XLane xl = x_lane<FMT>(L, xsum, 1, groups);
    ring_run(ring, n, ref, [&](int i, uint4 A0, uint4 A1, uint2 S0, uint2 S1) {
        const int u = ks + (i >> 1) * a.ksplit;
        // Two call sites with constant offsets keep tot in registers.
        if (i & 1) unit_any<FMT>(A0, A1, S0, S1, xl, u, 1.f, tot + 4);
        else unit_any<FMT>(A0, A1, S0, S1, xl, u, 1.f, tot);
    });
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

extern "C" __global__ void __launch_bounds__(256, 3) moe_up_q4(const MoeUpArgs a) { moe_up_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) moe_up_bf16(const MoeUpArgs a) { moe_up_body<FMT_BF16>(a); }
// Router + moe_up in one kernel (decode graph, Q4 experts, bf16 router): see route_phase.
extern "C" __global__ void __launch_bounds__(256, 3) moe_route_up_q4(const MoeUpArgs a) { moe_up_body<FMT_Q4, true>(a); }

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
    const int groups = kmax / 64;
    const int ring_bytes = UnitRing<FMT>::BLOCK_BYTES;
    const XLayout L{(u32*)(smem + ring_bytes), x_words(kmax, FMT == FMT_Q4), FMT == FMT_Q4};  // one "token" per source
    float* xsum = (float*)(smem + ring_bytes + (size_t)nsrc * L.tstride * 4);
    float* red = xsum + nsrc * groups;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int tile = blockIdx.x * (8 / a.ksplit) + warp / a.ksplit, ks = warp % a.ksplit;
    const bool active = tile * 16 < a.H;
    const i64 row0 = (i64)tile * 16;
    // Units of all sources in one flat list f = ks, ks + ksplit, ... (source-major).
    const int upu = FMT == FMT_Q4 ? 128 : 32;
    const int nu_r = a.kpad_r / upu, nu_s = a.kpad_s / upu;
    const int n_r = a.topk * nu_r, total = n_r + (a.has_shared ? nu_s : 0);
    const int* ids = (const int*)a.ids;
    const float* rw = (const float*)a.route_w;
    const UnitRing<FMT> ring = warp_ring<FMT>(smem);
    const int n = active ? units_from(ks, a.ksplit, total) : 0;
    // The unit list f = ks + i * ksplit as (source, unit) cursors: ref and use are called with
    // i = 0, 1, ... in order (see ring_run), so each advances its cursor by ksplit units.
    struct Cursor {
        int src, u;
    };
    auto advance = [&](Cursor& c) {
        c.u += a.ksplit;
        while (c.src < a.topk && c.u >= nu_r) { c.u -= nu_r; ++c.src; }
    };
    const Cursor start{ks < n_r ? ks / nu_r : a.topk, ks < n_r ? ks % nu_r : ks - n_r};
    Cursor rc = start, cc = start;
    auto ref = [&](int) {
        const TileRef tr = rc.src == a.topk ? tile_ref<FMT>(a.sh_down_w, a.sh_down_sb, row0 + g, a.kpad_s)
                                            : tile_ref<FMT>(a.down_w, a.down_sb, (i64)ids[rc.src] * a.rows_e + row0 + g, a.kpad_r);
        const URef r{tr, rc.u};
        advance(rc);
        return r;
    };
    // ids and route_w come from the router, two kernels back: complete before the previous kernel
    // (moe_up) passed its own wait and released this one (see pdl_wait in common.cuh).
    ring_start(ring, n, ref);
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
                    L.base[L.word(src, 2 * c)] = p0;
                    L.base[L.word(src, 2 * c + 1)] = p1;
                    const float sm = group64_sum(p0, p1);
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
            L.base[L.word(src, k / 2)] = p;
            float sm = warp_sum(bf16_lo(p) + bf16_hi(p));
            if (lane == 0) xsum[src * groups + grp] = sm;
        }
    }
    __syncthreads();
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    ring_run(ring, n, ref, [&](int, uint4 A0, uint4 A1, uint2 S0, uint2 S1) {
        // Source src is a one-token x of its own: column 0 carries it, the others are not stored.
        const XLane xl = x_lane<FMT>(XLayout{L.base + cc.src * L.tstride, L.tstride, L.frag}, xsum + cc.src * groups, 1, groups);
        unit_any<FMT>(A0, A1, S0, S1, xl, cc.u, rw[cc.src], tot);
        advance(cc);
    });
    bool owner = reduce_ksplit<1>(tot, red, a.ksplit);
    if (owner && active && t4 == 0) {
        float* out = (float*)a.out;
        for (int i = 0; i < 2; ++i) {
            i64 r = row0 + g + 8 * i;
            if (r < a.H) out[r] += tot[2 * i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 3) moe_down_q4(const MoeDownArgs a) { moe_down_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) moe_down_bf16(const MoeDownArgs a) { moe_down_body<FMT_BF16>(a); }
