// Decode MoE, batch 1, on tensor cores (matvec.cuh holds the staging, the units and the weight
// ring). Sources: the top-k routed experts (ids[0..topk)) and, if present, the shared expert as
// source topk. moe_up_* / moe_route_up_q4: gate and up of every source (silu(gate)·up into h),
// the latter with the router fused in; moe_down_*: all down projections of a 16-row tile,
// weighted and summed in registers, added to the residual.

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

// Several tokens (batched decode): grid.z (moe_up) / grid.y (moe_down) is the token r, whose x
// row is r·K floats in, ids r·topk, h rows r·nsrc·hstride, routing weights r·nsrc (nsrc = topk +
// has_shared) and output row r·H (accumulated). ROUTE (moe_route_up_rows): each token's blocks
// route it as moe_route_up routes its one token, with the token's own K-part sums (r·kparts·(E+1)
// floats in) and barrier (counters 2r, 2r + 1); every block of the grid is resident (the launch
// checks it), so no token's blocks can keep another token's router blocks from running.
template <int FMT, bool ROUTE = false>
DEVI void moe_up_rows_body(const MoeUpArgs& a0) {
    const int r = blockIdx.z, nsrc = a0.topk + a0.has_shared;
    MoeUpArgs a = a0;
    a.x += (u64)r * a0.K * 4;
    a.ids += (u64)r * a0.topk * 4;
    a.h += (u64)r * nsrc * a0.hstride * 4;
    if (ROUTE) {
        a.partial += (u64)r * a0.kparts * (a0.E + 1) * 4;
        a.barrier += (u64)r * 8;
        a.route_w += (u64)r * nsrc * 4;
    }
    moe_up_body<FMT, ROUTE>(a);
}

template <int FMT>
DEVI void moe_down_rows_body(const MoeDownArgs& a0) {
    const int r = blockIdx.y, nsrc = a0.topk + a0.has_shared;
    MoeDownArgs a = a0;
    a.h += (u64)r * nsrc * a0.hstride * 4;
    a.ids += (u64)r * a0.topk * 4;
    a.route_w += (u64)r * nsrc * 4;
    a.out += (u64)r * a0.H * 4;
    moe_down_body<FMT>(a);
}

extern "C" __global__ void __launch_bounds__(256, 3) moe_up_rows_q4(const MoeUpArgs a) { moe_up_rows_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) moe_up_rows_bf16(const MoeUpArgs a) { moe_up_rows_body<FMT_BF16>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) moe_route_up_rows_q4(const MoeUpArgs a) { moe_up_rows_body<FMT_Q4, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) moe_down_rows_q4(const MoeDownArgs a) { moe_down_rows_body<FMT_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) moe_down_rows_bf16(const MoeDownArgs a) { moe_down_rows_body<FMT_BF16>(a); }
