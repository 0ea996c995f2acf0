// Prefill GEMMs on tensor cores: out[n, r] = Σ_k x[n, k] · W[r, k] for many tokens n.
//
// Shapes: W [E·rows_e, kpad] (Q4 or BF16; E = 1 for a plain weight), x [*, ldx] f32,
// out [*, ldo] f32. A block computes a BM x BN tile (BM = 128 weight rows, BN = 64 or 128
// tokens) in k-steps of 128 with 8 warps laid out 2 (rows) x 4 (tokens). Weights are copied to
// shared memory with cp.async (the 4-bit tile is dequantised in registers, never in memory);
// x is read as f32, rounded to bf16 and stored with its per-group sums. Two stages.
//
// Grouped mode (MoE): `tiles` lists {expert, first list position, count}; the block's tokens are
// list positions p = first + i, reading x row x_rows[p] (or p) and writing out row p.
// PAIR mode: rows [0, 64) of the block come from W (gate) and rows [64, 128) from W2 (up) at the
// same row indices; the block writes silu(gate) · up for 64 output rows.

#define FMT_Q4 0
#define FMT_BF16 1
#define BM 128
#define BK 128
#define BS_STRIDE (BK + 8)      // bf16 elements per B row in shared memory
#define AB_STRIDE (BK + 8)      // bf16 elements per A row (BF16 format)

struct GemmArgs {
    u64 w, sb, w2, sb2, x, x_rows, out, tiles, num_tiles;
    int M, rows_e, K, kpad;
    int ldx, ldo, T, pad;
};

template <int FMT>
struct AStage {
    static constexpr int BYTES = FMT == FMT_Q4 ? BM * 64 + BM * 8 : BM * AB_STRIDE * 2;
};

// B fragments of NT n8 tiles (tokens nbase.., k0..k0+15) from the bf16 tile [token][BS_STRIDE].
template <int NT>
DEVI void load_b(u32 (&b)[NT][2], const __nv_bfloat16* Bh, int nbase, int k0, int lane) {
    if (NT == 1) {
        u32 d0, d1;
        ldsm_x4(b[0][0], b[0][1], d0, d1, Bh + (nbase + (lane & 7)) * BS_STRIDE + k0 + ((lane >> 3) & 1) * 8);
    } else {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            const __nv_bfloat16* p = Bh + (nbase + np * 16 + (lane >> 4) * 8 + (lane & 7)) * BS_STRIDE + k0 + ((lane >> 3) & 1) * 8;
            ldsm_x4(b[2 * np][0], b[2 * np][1], b[2 * np + 1][0], b[2 * np + 1][1], p);
        }
    }
}

template <int FMT, int BN, bool PAIR>
DEVI void gemm_body(const GemmArgs& a) {
    constexpr int NT = BN / 32;                 // n8 tiles per warp
    constexpr int A_BYTES = AStage<FMT>::BYTES;
    constexpr int B_BYTES = BN * BS_STRIDE * 2;
    constexpr int STAGE = A_BYTES + B_BYTES + BN * 2 * 4;
    extern __shared__ __align__(16) unsigned char smem[];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;

    // Token tile.
    int expert = 0, start, count;
    if (a.tiles) {
        if ((int)blockIdx.y >= *(const int*)a.num_tiles) return;
        int4 tl = ((const int4*)a.tiles)[blockIdx.y];
        expert = tl.x; start = tl.y; count = tl.z;
    } else {
        start = blockIdx.y * BN;
        count = min(BN, a.T - start);
    }
    const int* x_rows = (const int*)a.x_rows;
    const int out_rows_per_block = PAIR ? BM / 2 : BM;
    const int m0 = blockIdx.x * out_rows_per_block;  // first output row (within the expert)
    const i64 wrow0 = (i64)expert * a.rows_e + m0;  // first weight row
    const int nk = a.kpad / BK;

    // ---- loaders ----
    auto load_a = [&](int kt, int st) {
        unsigned char* As = smem + st * STAGE;
        if (FMT == FMT_Q4) {
            const i64 rb = a.kpad / 2;
            for (int c = threadIdx.x; c < BM * 4; c += 256) {
                int r = c >> 2, ch = c & 3;
                u64 base = (PAIR && r >= BM / 2) ? a.w2 : a.w;
                i64 wr = PAIR ? wrow0 + (r & (BM / 2 - 1)) : wrow0 + r;
                cp_async16(As + r * 64 + ch * 16, (const void*)(base + wr * rb + kt * 64 + ch * 16), true);
            }
            unsigned char* Ss = As + BM * 64;
            for (int r = threadIdx.x; r < BM; r += 256) {
                u64 base = (PAIR && r >= BM / 2) ? a.sb2 : a.sb;
                i64 wr = PAIR ? wrow0 + (r & (BM / 2 - 1)) : wrow0 + r;
                const void* src = (const void*)(base + wr * (a.kpad / 16) + kt * 8);
                asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(Ss + r * 8)), "l"(src));
            }
        } else {
            const i64 rb = (i64)a.kpad * 2;
            for (int c = threadIdx.x; c < BM * 16; c += 256) {
                int r = c >> 4, ch = c & 15;
                u64 base = (PAIR && r >= BM / 2) ? a.w2 : a.w;
                i64 wr = PAIR ? wrow0 + (r & (BM / 2 - 1)) : wrow0 + r;
                cp_async16(As + r * AB_STRIDE * 2 + ch * 16, (const void*)(base + wr * rb + kt * 256 + ch * 16), true);
            }
        }
    };
    // x: each thread owns (token, 32-k segment) pairs: BN*4 pairs over 256 threads.
    constexpr int XP = (BN * 4 + 255) / 256;
    float4 xr[XP][8];
    auto load_x = [&](int kt) {
#pragma unroll
        for (int q = 0; q < XP; ++q) {
            int pi = threadIdx.x + q * 256;
            if (pi >= BN * 4) break;
            int tk = pi >> 2, seg = pi & 3;
            int k = kt * BK + seg * 32;
            bool ok = tk < count;
            i64 row = 0;
            if (ok) row = x_rows ? x_rows[start + tk] : start + tk;
            const float4* src = (const float4*)((const float*)a.x + row * a.ldx + k);
#pragma unroll
            for (int v = 0; v < 8; ++v)
                xr[q][v] = (ok && k + 4 * v < a.K) ? src[v] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto store_x = [&](int st) {
        unsigned char* Bs = smem + st * STAGE + A_BYTES;
        float* Xs = (float*)(Bs + B_BYTES);
#pragma unroll
        for (int q = 0; q < XP; ++q) {
            int pi = threadIdx.x + q * 256;
            if (pi >= BN * 4) break;  // warp-uniform: BN * 4 is a multiple of 32
            int tk = pi >> 2, seg = pi & 3;
            float s = 0.f;
            uint4* dst = (uint4*)(Bs + (tk * BS_STRIDE + seg * 32) * 2);
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                float4 p = xr[q][2 * v], r = xr[q][2 * v + 1];
                uint4 o;
                o.x = pack_bf16(p.x, p.y); o.y = pack_bf16(p.z, p.w);
                o.z = pack_bf16(r.x, r.y); o.w = pack_bf16(r.z, r.w);
                s += bf16_lo(o.x) + bf16_hi(o.x) + bf16_lo(o.y) + bf16_hi(o.y) + bf16_lo(o.z) + bf16_hi(o.z) +
                     bf16_lo(o.w) + bf16_hi(o.w);
                dst[v] = o;
            }
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            if ((seg & 1) == 0) Xs[tk * 2 + (seg >> 1)] = s;
        }
    };

    float tot[4][NT][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) tot[i][j][c] = 0.f;

    load_a(0, 0);
    cp_async_commit();
    load_x(0);
    store_x(0);

    for (int kt = 0; kt < nk; ++kt) {
        const int st = kt & 1;
        if (kt + 1 < nk) {
            load_a(kt + 1, st ^ 1);
            load_x(kt + 1);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        unsigned char* As = smem + st * STAGE;
        unsigned char* Bs = As + A_BYTES;
        const float* Xs = (const float*)(Bs + B_BYTES);
        const __nv_bfloat16* Bh = (const __nv_bfloat16*)Bs;
        const int nbase = wn * (BN / 4);

        if (FMT == FMT_Q4) {
            uint4 A0[4], A1[4];
            uint2 S0[4], S1[4];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                int r = wm * 64 + mt * 16 + g;
                if (PAIR) r = (mt >> 1) * (BM / 2) + wm * 32 + (mt & 1) * 16 + g;
                A0[mt] = *(const uint4*)(As + r * 64 + t4 * 16);
                A1[mt] = *(const uint4*)(As + (r + 8) * 64 + t4 * 16);
                S0[mt] = *(const uint2*)(As + BM * 64 + r * 8);
                S1[mt] = *(const uint2*)(As + BM * 64 + (r + 8) * 8);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float acc[4][NT][4];
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int n = 0; n < NT; ++n)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[i][n][c] = 0.f;
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    u32 b[NT][2];
                    int k0 = j * 64 + s * 16;
                    load_b<NT>(b, Bh, nbase, k0, lane);
                    const int p0 = 2 * (s & 1);
#pragma unroll
                    for (int mt = 0; mt < 4; ++mt) {
                        u32 wa = s < 2 ? (j ? A0[mt].z : A0[mt].x) : (j ? A0[mt].w : A0[mt].y);
                        u32 wb = s < 2 ? (j ? A1[mt].z : A1[mt].x) : (j ? A1[mt].w : A1[mt].y);
                        u32 a0 = q4_pair(wa, p0), a2 = q4_pair(wa, p0 + 1), a1 = q4_pair(wb, p0), a3 = q4_pair(wb, p0 + 1);
#pragma unroll
                        for (int n = 0; n < NT; ++n) mma_bf16(acc[mt][n], a0, a1, a2, a3, b[n][0], b[n][1]);
                    }
                }
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    u32 sv0 = j ? S0[mt].y : S0[mt].x, sv1 = j ? S1[mt].y : S1[mt].x;
                    float s0 = bf16_lo(sv0), c0 = bf16_hi(sv0) - 128.f * s0;
                    float s1 = bf16_lo(sv1), c1 = bf16_hi(sv1) - 128.f * s1;
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        int tk = nbase + n * 8 + 2 * t4;
                        float xa = Xs[tk * 2 + j], xb = Xs[(tk + 1) * 2 + j];
                        tot[mt][n][0] += s0 * acc[mt][n][0] + c0 * xa;
                        tot[mt][n][1] += s0 * acc[mt][n][1] + c0 * xb;
                        tot[mt][n][2] += s1 * acc[mt][n][2] + c1 * xa;
                        tot[mt][n][3] += s1 * acc[mt][n][3] + c1 * xb;
                    }
                }
            }
        } else {
            const __nv_bfloat16* Ah = (const __nv_bfloat16*)As;
#pragma unroll
            for (int s = 0; s < BK / 16; ++s) {
                int k0 = s * 16;
                u32 b[NT][2];
                load_b<NT>(b, Bh, nbase, k0, lane);
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    int r = wm * 64 + mt * 16;
                    if (PAIR) r = (mt >> 1) * (BM / 2) + wm * 32 + (mt & 1) * 16;
                    u32 a0, a1, a2, a3;
                    ldsm_x4(a0, a1, a2, a3, Ah + (r + (lane & 15)) * AB_STRIDE + k0 + (lane >> 4) * 8);
#pragma unroll
                    for (int n = 0; n < NT; ++n) mma_bf16(tot[mt][n], a0, a1, a2, a3, b[n][0], b[n][1]);
                }
            }
        }
        __syncthreads();
        if (kt + 1 < nk) store_x(st ^ 1);
    }
    cp_async_wait<0>();
    __syncthreads();

    // ---- epilogue through shared memory: C tile [BN tokens][OUTW rows] f32 ----
    constexpr int OUTW = PAIR ? BM / 2 : BM;
    float* Cs = (float*)smem;  // BN * (OUTW + 4) floats
    constexpr int CST = OUTW + 4;
#pragma unroll
    for (int mt = 0; mt < (PAIR ? 2 : 4); ++mt) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                int tk = wn * (BN / 4) + n * 8 + 2 * t4 + (c & 1);
                int r = (PAIR ? wm * 32 : wm * 64) + mt * 16 + g + (c >> 1) * 8;
                float v = tot[mt][n][c];
                if (PAIR) {
                    float u = tot[mt + 2][n][c];
                    v = v / (1.f + expf(-v)) * u;
                }
                Cs[tk * CST + r] = v;
            }
        }
    }
    __syncthreads();
    const int mrem = min(OUTW, a.M - m0);
    for (int i = threadIdx.x; i < BN * OUTW; i += 256) {
        int tk = i / OUTW, r = i % OUTW;
        if (tk < count && r < mrem) {
            i64 orow = start + tk;
            ((float*)a.out)[orow * a.ldo + m0 + r] = Cs[tk * CST + r];
        }
    }
}

template <int FMT, int BN, bool PAIR>
constexpr int gemm_smem() {
    return 2 * (AStage<FMT>::BYTES + BN * BS_STRIDE * 2 + BN * 2 * 4);
}

#define GEMM_KERNEL(name, FMT, BN, PAIR) \
    extern "C" __global__ void __launch_bounds__(256) name(const GemmArgs a) { gemm_body<FMT, BN, PAIR>(a); }

GEMM_KERNEL(gemm_q4_n32, FMT_Q4, 32, false)
GEMM_KERNEL(gemm_q4_pair_n32, FMT_Q4, 32, true)
GEMM_KERNEL(gemm_bf16_n32, FMT_BF16, 32, false)
GEMM_KERNEL(gemm_bf16_pair_n32, FMT_BF16, 32, true)
GEMM_KERNEL(gemm_q4_n64, FMT_Q4, 64, false)
GEMM_KERNEL(gemm_q4_n128, FMT_Q4, 128, false)
GEMM_KERNEL(gemm_q4_pair_n64, FMT_Q4, 64, true)
GEMM_KERNEL(gemm_q4_pair_n128, FMT_Q4, 128, true)
GEMM_KERNEL(gemm_bf16_n64, FMT_BF16, 64, false)
GEMM_KERNEL(gemm_bf16_n128, FMT_BF16, 128, false)
GEMM_KERNEL(gemm_bf16_pair_n64, FMT_BF16, 64, true)
GEMM_KERNEL(gemm_bf16_pair_n128, FMT_BF16, 128, true)
