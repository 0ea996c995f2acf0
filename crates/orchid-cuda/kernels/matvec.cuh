// The machinery the decode matvecs (gemv.cu) and the decode MoE kernels (moe_decode.cu) share:
// x staged once per block in bf16 (optionally RMS-normalised on the way, "norm on load"), with
// the 64-group sums of the rounded values for the Q4 bias term; one 128-k (Q4) or 32-k (bf16)
// unit of a 16-row weight tile on tensor cores (weights: the mma A operand, tokens: B); the
// warp-private ring of RING unit slots in shared memory through which the weights stream
// (UnitRing); the K-split reduction; the router's softmax / top-k epilogue.
//
// The ring: at the start every warp requests its first RING units with cp.async (no registers
// held while they are in flight, so a one-wave matvec has all of its bytes requested before x is
// even staged), then consumes them in order and refills each slot with the unit RING ahead. Each
// lane copies exactly the words it will read itself, so its own cp.async.wait_group is the only
// synchronisation needed.

// Where staged x lives in shared memory, as bf16 pairs (words). Row layout (BF16 weights):
// token t's word q at t * (kpad + 8) / 2 + q. Fragment layout (Q4 weights): the 16 words lane
// quad member t4 feeds to the 8 mma of unit u (B fragments b0, b1 of j = 0, 1 and s = 0..3) are
// consecutive, words (u * 4 + t4) * XF_STRIDE + j * 8 + s * 2 + {0, 1}, so a lane reads a unit's x
// with four 16-byte loads instead of sixteen 4-byte ones (stride 20: the four t4 of a warp hit
// disjoint banks).
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

// Tokens whose rows stage_x_vec<NV, NORM> loads together: NV float4 registers per token, plus
// NV for the norm weights; gemv_q4 has 80 registers, and larger groups make it spill.
template <int NV, bool NORM>
__host__ __device__ constexpr int stage_group() { return NV <= 2 || !NORM ? 2 : 1; }

// Stages x rows (f32, optionally normalised) into shared memory as bf16 (layout L) and writes
// per-group sums of the rounded values into xsum [T][kpad / 64]. Zero beyond K.
//
// Fast path (kpad ≤ 4 · NV · blockDim, 16-byte aligned rows; NORM: norm_w given): the tokens go
// in groups of TG (stage_x: stage_group(), or 1 for a lone row); every thread issues all its
// 16-byte loads of a group's rows (and the norm weights) at once, so a group costs one round trip
// to L2 plus one block reduction for the norms of its rows; a 64-group is 16 consecutive float4
// = 16 lanes, summed by shuffles.
// `red` holds 32 floats for T = 1, else TG · 32.
template <int NV, bool NORM, int TG>
DEVI void stage_x_vec(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                      const XLayout& L, float* xsum, float* red) {
    const int nvec = kpad >> 2, groups = kpad / 64, nt = blockDim.x;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int t0 = 0; t0 < T; t0 += TG) {
        float4 v[TG][NV], w[NV];
#pragma unroll
        for (int tt = 0; tt < TG; ++tt)
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int c = threadIdx.x + i * nt, k = 4 * c;
                v[tt][i] = (t0 + tt < T && c < nvec && k < K) ? ldcg4(x + (i64)(t0 + tt) * ldx + k) : zero;
            }
        float inv[TG];
        if constexpr (NORM) {
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int c = threadIdx.x + i * nt, k = 4 * c;
                w[i] = (c < nvec && k < K) ? __ldg(reinterpret_cast<const float4*>(norm_w + k)) : zero;
            }
            float ss[TG];
#pragma unroll
            for (int tt = 0; tt < TG; ++tt) {
                ss[tt] = 0.f;
#pragma unroll
                for (int i = 0; i < NV; ++i)
                    ss[tt] += v[tt][i].x * v[tt][i].x + v[tt][i].y * v[tt][i].y + v[tt][i].z * v[tt][i].z + v[tt][i].w * v[tt][i].w;
            }
            if (TG == 1 || T - t0 == 1) {  // one token: 32 floats of red
                float s1[1] = {ss[0]};
                block_sum_n<1>(s1, red);
                ss[0] = s1[0];
            } else {
                block_sum_n<TG>(ss, red);
            }
#pragma unroll
            for (int tt = 0; tt < TG; ++tt) inv[tt] = 1.f / sqrtf(ss[tt] / K + eps);
        }
#pragma unroll
        for (int tt = 0; tt < TG; ++tt) {
            const int t = t0 + tt;
            if (t >= T) break;
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int c = threadIdx.x + i * nt;
                if (c < nvec) {  // warp-uniform: nvec is a multiple of 32
                    float4 a = v[tt][i];
                    if constexpr (NORM) {
                        a.x = a.x * inv[tt] * w[i].x; a.y = a.y * inv[tt] * w[i].y;
                        a.z = a.z * inv[tt] * w[i].z; a.w = a.w * inv[tt] * w[i].w;
                    }
                    const u32 p0 = pack_bf16(a.x, a.y), p1 = pack_bf16(a.z, a.w);
                    L.base[L.word(t, 2 * c)] = p0;
                    L.base[L.word(t, 2 * c + 1)] = p1;
                    const float s = group64_sum(p0, p1);
                    if ((threadIdx.x & 15) == 0) xsum[t * groups + (c >> 4)] = s;
                }
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

// stage_x_vec<NV>: a lone row (batch-1 decode, the MoE kernels) without the group bookkeeping,
// several in groups; with or without the norm.
template <int NV>
DEVI void stage_x_nv(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                     const XLayout& L, float* xsum, float* red) {
    if (T == 1) {
        if (norm_w) stage_x_vec<NV, true, 1>(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
        else stage_x_vec<NV, false, 1>(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
    } else if (norm_w) {
        stage_x_vec<NV, true, stage_group<NV, true>()>(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
    } else {
        stage_x_vec<NV, false, stage_group<NV, false>()>(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
    }
}

// Stages T rows of x (the paths above); `red`: 32 floats for T = 1, else 64 (stage_x_vec's groups).
DEVI void stage_x(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                  const XLayout& L, float* xsum, float* red) {
    const bool vec = (K & 3) == 0 && (T == 1 || (ldx & 3) == 0) && ((u64)x & 15) == 0 && ((u64)norm_w & 15) == 0;
    if (vec && kpad <= 8 * (int)blockDim.x) stage_x_nv<2>(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
    else if (vec && kpad <= 16 * (int)blockDim.x) stage_x_nv<4>(x, ldx, T, K, kpad, norm_w, eps, L, xsum, red);
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
