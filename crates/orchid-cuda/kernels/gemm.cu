// Prefill GEMMs on tensor cores: out[n, r] = Σ_k x[n, k] · W[r, k] for many tokens n.
//
// Shapes: W [E·rows_e, kpad] (Q4 or BF16; E = 1 for a plain weight); out [*, ldo] f32. The
// activations come prepared once per call by gemm_xprep: xb bf16 [*, kpad] (x rounded, zero beyond
// K) and xs f32 [*, kpad/64] (the sum of each 64-group of the rounded values, which folds the Q4
// +128 offset out). A block computes a BM x BN tile (BM = 128 weight rows, BN = 32, 64 or 128
// tokens; Q4 also 8, for sparse MoE groups) in k-steps of 128 with 8 warps laid out 2 (rows) x 4
// (tokens), except Q4: BN 8 and 32 as 8 (rows) x 1, each warp 16 rows x all the tile's tokens,
// so that each 4-bit fragment is dequantised once per block, not by 4 token warps (instruction
// issue bounds these kernels); BN 64 as 4 x 2, each fragment dequantised by 2 warps, each warp
// reading half the tile's tokens (8 x 1 there left the shared-memory pipe, which every warp's copy
// of the B tile went through, the limit). A Q4 warp multiplies only the n8 tiles that hold tokens
// of the tile (MoE tiles are mostly sparse).
// Every output is the same sequence of mma and scale steps whatever the layout. On Hopper the
// Q4 64-token kernels have warpgroup-MMA twins (the _wg kernels: 8 x 1 warps, the token rows
// read by the tensor cores from swizzled shared memory; "warpgroup MMA" below).
//
// Main loop: an S-stage cp.async pipeline (S per kernel: GemmCfg). A stage holds one k-step: the
// weight tile (4-bit words + scale/bias words, or bf16 rows), the bf16 rows of the block's tokens
// and their two group sums. The prologue issues k-steps 0..S-2; step kt waits for its group, syncs,
// issues k-step kt+S-1 into the stage step kt-1 used, then computes, so S-1 k-steps are in flight.
// Tokens beyond the tile's count and weight rows beyond M are zero-filled (no memory read). The
// 4-bit tile is dequantised in registers, never in memory. The epilogue reuses the stage memory
// (after the last group is drained) for the C tile [BN][128 tile rows], then stores its rows.
//
// Grouped mode (MoE): `tiles` lists {expert, first list position, count}; the block's tokens are
// list positions p = first + i, reading prepared row x_rows[p] (or p) and writing out row p.
// Expert alt_expert (when > 0) reads the weights alt_w / alt_sb (PAIR: and alt_w2 / alt_sb2) of
// the experts' shape as its own: the shared expert, listed after the routed ones.
// PAIR mode: rows [0, 64) of the block come from W (gate) and rows [64, 128) from W2 (up) at the
// same row indices; the block writes silu(gate) · up for 64 output rows (C tile rows r and 64 + r).
// Otherwise, with m1 > 0, W2 continues W: output row m ≥ m1 is W2's row m − m1 (the router and the
// shared-expert gate in one GEMM).
// With xs_out, a PAIR writes its outputs prepared for the next GEMM, as gemm_xprep would: out is
// bf16 rows [*, ldo] and xs_out their 64-group sums [*, ldo / 64] (a block's 64 rows are one
// group; the launcher asks for M % 128 == 0 and ldo == M, so no padding columns exist).
//
// Split-K (dense GEMMs whose weight rows alone leave SMs idle, ops::gemm_kparts): grid.z = K
// parts; block z sums its share of the k-steps from zero. In the _kc kernels (Hopper: each tile's
// K parts one cluster, ops::gemm::splitk_in_cluster) the parts' C tiles stay in shared memory and every
// block finishes a share of the tile's tokens, summing the parts through distributed shared
// memory; otherwise block z writes its f32 partial sums (PAIR: gate and up apart) to part z of a
// scratch matrix and gemm_splitk_reduce sums them. Either way the parts are added in the order 0,
// 1, ... (no atomics: bit-identical runs, and the same bits both ways), then the outputs written
// or added onto out. The Q4 group-sum term is per 64-group, so it splits with the k-steps.
// gemm_each (_kc kernels, not PAIR, a.nseg > 0): up to GEMM_SEGS weights of one format and K in
// one launch, grid.x over all their row blocks; a block row takes its weight, output [T, ldo]
// and row count from a.seg (gemm_seg), and computes what that weight's own launch would.

#define BM 128
#define BK 128
#define BS_STRIDE (BK + 8)      // bf16 elements per B row in shared memory
#define AB_STRIDE (BK + 8)      // bf16 elements per A row (BF16 format)

// Per-kernel sizes. Keep STAGES in step with gemm_stages in ops/gemm.rs.
// BN 32/64 (Q4) and BN 64 (BF16) stay within 113 KB so that two blocks share an SM.
// WG (the Q4 64-token _wg kernels): the token rows unpadded and swizzled at the stage's start,
// each stage 1024-byte aligned (the swizzle's period), plus 1 KB to align the first.
template <int FMT, int BN, bool WG = false>
struct GemmCfg {
    static constexpr int A_BYTES = FMT == FMT_Q4 ? BM * 64 + BM * 8 : BM * AB_STRIDE * 2;
    static constexpr int B_BYTES = WG ? BN * BK * 2 : BN * BS_STRIDE * 2;
    // Offsets in a stage: weights, token rows, group sums.
    static constexpr int A_OFF = WG ? B_BYTES : 0;
    static constexpr int B_OFF = WG ? 0 : A_BYTES;
    static constexpr int X_OFF = A_BYTES + B_BYTES;
    static constexpr int STAGE = WG ? (A_BYTES + B_BYTES + BN * 2 * 4 + 1023) / 1024 * 1024 : A_BYTES + B_BYTES + BN * 2 * 4;
    static constexpr int STAGES = FMT == FMT_Q4 ? (BN <= 32 ? 6 : BN == 64 ? 4 : 5) : (BN == 32 ? 4 : BN == 64 ? 2 : 3);
    // Warps along the tokens: the 8 warps are (8 / WN) (rows) x WN (tokens). Q4 BN 32: 8 x 1,
    // each warp 16 rows x all the block's tokens, so each 4-bit A fragment is dequantised once
    // per block; Q4 BN 64: 4 x 2 (each fragment twice, half the B-tile reads per warp; WG: 8 x
    // 1, the tensor cores read the B tile); the others 2 x 4.
    static constexpr int WN = WG ? 1 : FMT == FMT_Q4 ? (BN <= 32 ? 1 : BN == 64 ? 2 : 4) : 4;
    // Q4: a warp reads its k-step's A words, scale words and group sums once (16-byte reads)
    // where the registers allow (BN 32), else per 64-group.
    static constexpr bool Q4_ONCE = BN <= 32;
    static constexpr int EPI = BN * (BM + 4) * 4;  // epilogue C tile
    static constexpr int MAIN = STAGES * STAGE + (WG ? 1024 : 0);
    static constexpr int SMEM = MAIN > EPI ? MAIN : EPI;
};
static_assert(GemmCfg<FMT_Q4, 8>::SMEM == 68736, "ops::gemm_smem");
static_assert(GemmCfg<FMT_Q4, 32>::SMEM == 109056, "ops::gemm_smem");
static_assert(GemmCfg<FMT_Q4, 64>::SMEM == 108544, "ops::gemm_smem");
static_assert(GemmCfg<FMT_Q4, 128>::SMEM == 225280, "ops::gemm_smem");
static_assert(GemmCfg<FMT_BF16, 32>::SMEM == 175104, "ops::gemm_smem");
static_assert(GemmCfg<FMT_BF16, 64>::SMEM == 105472, "ops::gemm_smem");
static_assert(GemmCfg<FMT_BF16, 128>::SMEM == 211968, "ops::gemm_smem");
static_assert(GemmCfg<FMT_Q4, 64, true>::SMEM == 107520, "ops::gemm_smem");

// x f32 [rows, ldx] -> xb bf16 [rows, kpad] (zero for k >= K) and xs f32 [rows, kpad/64], the sum
// of each 64-group's rounded values (4-element sums, then a 16-lane shuffle tree: the order of the
// decode matvecs' stage_x_vec). A warp takes XP_RUNS runs of 128 columns (two groups) of a row,
// lane L the float4 at 4L of each, all loads in flight together: reads and writes are contiguous
// per warp (a thread per 32-column segment read 16 of every 128 bytes and wrote half sectors).
// grid.x = ceil(rows * kpad / 128 / XP_RUNS / 8) (ops::gemm_x). Needs K % 4 == 0, ldx % 4 == 0.
extern "C" __global__ void __launch_bounds__(256) gemm_xprep(const float* __restrict__ x, __nv_bfloat16* __restrict__ xb,
                                                             float* __restrict__ xs, int rows, int ldx, int K, int kpad) {
    pdl_enter();
    const int runs = kpad >> 7, lane = threadIdx.x & 31;
    const i64 total = (i64)rows * runs;
    const i64 run0 = (((i64)blockIdx.x * 256 + threadIdx.x) >> 5) * XP_RUNS;
    float4 v[XP_RUNS];
    i64 row[XP_RUNS];
    int k[XP_RUNS];
#pragma unroll
    for (int i = 0; i < XP_RUNS; ++i) {
        const i64 r = run0 + i;
        row[i] = r < total ? r / runs : 0;
        k[i] = (int)(r - row[i] * runs) * 128 + 4 * lane;
        v[i] = (r < total && k[i] < K) ? *(const float4*)(x + row[i] * ldx + k[i]) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < XP_RUNS; ++i) {
        if (run0 + i >= total) break;  // warp-uniform
        uint2 o;
        o.x = pack_bf16(v[i].x, v[i].y);
        o.y = pack_bf16(v[i].z, v[i].w);
        *(uint2*)(xb + row[i] * kpad + k[i]) = o;
        const float s = group64_sum(o.x, o.y);
        if ((lane & 15) == 0) xs[row[i] * (kpad >> 6) + (k[i] >> 6)] = s;
    }
}

// gemm_xprep of y = rms_norm(x) · w (a block's input projections: the norm and the preparation
// in one pass): one block of 256 threads per row. The sum of squares is rms_norm's (thread i:
// columns i, i + 256, ...; block_sum) and y = x · inv · w as rms_norm forms it, so the rounded
// values and group sums are those of rms_norm followed by gemm_xprep (norm_prep_row). With y (not
// null), the normalised f32 rows are written there too ([rows, K], rms_norm's output). Needs
// K % 4 == 0, ldx % 4 == 0.
extern "C" __global__ void __launch_bounds__(256) gemm_xprep_norm(const float* __restrict__ x, const float* __restrict__ nw,
                                                                  __nv_bfloat16* __restrict__ xb, float* __restrict__ xs,
                                                                  float* __restrict__ y, int ldx, int K, int kpad, float eps) {
    pdl_enter();
    __shared__ float red[32];
    const float* xr = x + (i64)blockIdx.x * ldx;
    float ss = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float inv = 1.f / sqrtf(ss / K + eps);
    const i64 r = blockIdx.x;
    norm_prep_row(xr, nw, inv, xb + r * kpad, xs + r * (kpad >> 6), y ? y + r * K : nullptr, K, kpad);
}

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

DEVI u32 word4(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// q4_kstep's two 64-groups on the fetched words (ONCE: all of the k-step's, else fetch(j) at the
// start of group j) and the B rows at shared address b_at (ldmatrix's lane addresses, group 0).
template <int MT, int NT, int NL, bool ONCE, typename Fetch>
DEVI void q4_groups(float (&tot)[MT][NT][4], uint4 (&A0)[MT], uint4 (&A1)[MT], uint2 (&SB0)[MT], uint2 (&SB1)[MT], float4 (&X)[NL], u32 b_at,
                    Fetch&& fetch) {
#pragma unroll(ONCE ? 2 : 1)
    for (int j = 0; j < 2; ++j) {
        if constexpr (!ONCE) fetch(j);
        const int jf = ONCE ? j : 0;  // group j's place in the fetched registers
        const u32 bj = b_at + j * 128;
        float acc[MT][NL][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int n = 0; n < NL; ++n)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[i][n][c] = 0.f;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 b[NL][2];
            if constexpr (NL == 1) {
                ldsm_x2_at(b[0][0], b[0][1], bj + s * 32);
            } else {
#pragma unroll
                for (int np = 0; np < NL / 2; ++np)
                    ldsm_x4_at(b[2 * np][0], b[2 * np][1], b[2 * np + 1][0], b[2 * np + 1][1], bj + s * 32 + np * 32 * BS_STRIDE);
            }
            const int p0 = 2 * (s & 1), wi = 2 * jf + (s >> 1);  // pair slots, fetched word
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 wa = word4(A0[mt], wi), wb = word4(A1[mt], wi);
                u32 a0 = q4_pair(wa, p0), a2 = q4_pair(wa, p0 + 1), a1 = q4_pair(wb, p0), a3 = q4_pair(wb, p0 + 1);
#pragma unroll
                for (int n = 0; n < NL; ++n) mma_bf16(acc[mt][n], a0, a1, a2, a3, b[n][0], b[n][1]);
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 sv0 = jf ? SB0[mt].y : SB0[mt].x, sv1 = jf ? SB1[mt].y : SB1[mt].x;
            float s0 = bf16_lo(sv0), c0 = bf16_hi(sv0) - 128.f * s0;
            float s1 = bf16_lo(sv1), c1 = bf16_hi(sv1) - 128.f * s1;
            // Spelled out (__fmaf_rn): left to the compiler, the contraction varied between
            // kernel variants (so did the bits).
#pragma unroll
            for (int n = 0; n < NL; ++n) {
                float xa = jf ? X[n].y : X[n].x, xb = jf ? X[n].w : X[n].z;
                tot[mt][n][0] = __fmaf_rn(s0, acc[mt][n][0], __fmaf_rn(c0, xa, tot[mt][n][0]));
                tot[mt][n][1] = __fmaf_rn(s0, acc[mt][n][1], __fmaf_rn(c0, xb, tot[mt][n][1]));
                tot[mt][n][2] = __fmaf_rn(s1, acc[mt][n][2], __fmaf_rn(c1, xa, tot[mt][n][2]));
                tot[mt][n][3] = __fmaf_rn(s1, acc[mt][n][3], __fmaf_rn(c1, xb, tot[mt][n][3]));
            }
        }
    }
}

// One Q4 k-step of a warp: tot[mt][n] += the 16 x 8 products of tile rows row0 + 16 mt (+ 0..15)
// and tokens nbase + 8 n (+ 0..7), for the first NL of its NT n8 tiles (the others are left
// alone). Per 64-group j: acc = Σ over the group's four k16 slices (mma, in k order) of
// (128 + q) · x, then tot = fma(s, acc, fma(c, x-sum, tot)) with c = bias - 128 s (two fmas per
// output and group, the decode matvecs' order: unit_q4f in matvec.cuh).
// ONCE: the warp's A words (m16 tile mt: 16-byte chunk t4 of rows r and r + 8, whose words 2j,
// 2j + 1 are group j), scale/bias words (word j: group j) and group sums (n8 tile n: tokens tk,
// tk + 1) are read once per k-step into A {w0..w3}, SB {group 0, 1}, X {tk g0, tk g1, tk+1 g0,
// tk+1 g1} (16-byte reads, no bank conflicts); else (more tiles per warp: registers) group j's at
// the start of group j into A {w2j, w2j+1}, SB {j}, X {tk gj, -, tk+1 gj}.
// The stage comes as shared addresses (As: weight words then scale/bias words, Bh: token rows,
// Xs: group sums); every load is one per-thread base plus a constant (the instruction's offset).
template <int MT, int NT, int NL, bool ONCE>
DEVI void q4_kstep(float (&tot)[MT][NT][4], u32 As, u32 Bh, u32 Xs, int row0, int nbase, int lane) {
    static_assert(NL >= 1 && NL <= NT && (NL == 1 || NL % 2 == 0), "n8 tiles: 1 or pairs");
    const int g = lane >> 2, t4 = lane & 3;
    // Bases: A words of row row0 + g (m16 tile mt: + 1024 mt, row + 8: + 512, group j: + 8 j);
    // its scale/bias words (+ 128 mt, + 64, + 4 j); group sums of token nbase + 2 t4 (n8 tile n:
    // + 64 n, token + 1: + 8, group j: + 4 j); B rows as ldmatrix addresses them (k16 slice at k0:
    // + 2 k0; NL > 1, n8 tile pair np: + 32 BS_STRIDE np).
    const u32 a_at = As + (row0 + g) * 64 + t4 * 16;
    const u32 s_at = As + BM * 64 + (row0 + g) * 8;
    const u32 x_at = Xs + (nbase + 2 * t4) * 8;
    const u32 b_at = Bh + ((nbase + (NL == 1 ? 0 : (lane >> 4) * 8) + (lane & 7)) * BS_STRIDE + ((lane >> 3) & 1) * 8) * 2;
    uint4 A0[MT], A1[MT];
    uint2 SB0[MT], SB1[MT];
    float4 X[NL];
    auto fetch = [&](int j) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if constexpr (ONCE) {
                A0[mt] = lds128_at(a_at + mt * 1024);
                A1[mt] = lds128_at(a_at + mt * 1024 + 512);
                SB0[mt] = lds64_at(s_at + mt * 128);
                SB1[mt] = lds64_at(s_at + mt * 128 + 64);
            } else {
                const uint2 w0 = lds64_at(a_at + j * 8 + mt * 1024);
                const uint2 w1 = lds64_at(a_at + j * 8 + mt * 1024 + 512);
                A0[mt].x = w0.x; A0[mt].y = w0.y;
                A1[mt].x = w1.x; A1[mt].y = w1.y;
                SB0[mt].x = lds32_at(s_at + j * 4 + mt * 128);
                SB1[mt].x = lds32_at(s_at + j * 4 + mt * 128 + 64);
            }
        }
#pragma unroll
        for (int n = 0; n < NL; ++n) {
            if constexpr (ONCE) {
                const uint4 v = lds128_at(x_at + n * 64);
                X[n] = make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
            } else {
                X[n].x = __uint_as_float(lds32_at(x_at + j * 4 + n * 64));
                X[n].z = __uint_as_float(lds32_at(x_at + j * 4 + n * 64 + 8));
            }
        }
    };
    if constexpr (ONCE) fetch(0);
    q4_groups<MT, NT, NL, ONCE>(tot, A0, A1, SB0, SB1, X, b_at, fetch);
}

// ---- warpgroup MMA: the Q4 64-token tile on Hopper (the _wg kernels, sm_90a) ----
// The 8 warps are two warpgroups of 64 tile rows; warp w holds rows 16w .. 16w + 15 and every
// token, its 4-bit fragments dequantised in registers exactly as q4_kstep does (the register A
// operand of wgmma has mma.m16n8k16's layout per warp, the accumulator its C layout per n8
// tile). The token rows come from shared memory through a matrix descriptor: per k-step two
// 64-column halves, each [BN tokens][128 bytes] with the 128-byte swizzle (16-byte chunk c of
// token row r stored at chunk c ^ (r & 7)), 1024-byte aligned. One wgmma multiplies 64 rows by
// up to 64 tokens over k16, so the B fragments never pass through registers and a warp issues
// one instruction where mma.sync took eight. Per 64-group: four wgmma (the first starts the
// group's sum from zero), the scale step's c·Σx fma while they run, wait, then its s·acc fma:
// q4_kstep's scale step, the same operations in the same order.
DEVI void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEVI void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
DEVI void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
DEVI void wg_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// The cp.async writes of a stage (generic proxy) made visible to wgmma's reads (async proxy).
DEVI void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the accumulator registers where wgmma left them (no copy while the MMA runs).
template <int R>
DEVI void wg_pin(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Descriptor of a K-major bf16 operand with the 128-byte swizzle: low word the start address in
// 16-byte units (lo: wg_desc_lo of the shared address, plus offsets / 16) and the leading offset
// 1 (unused); high word 8-row groups 1024 bytes apart and swizzle mode 1.
DEVI u32 wg_desc_lo(u32 addr) { return ((addr & 0x3FFFF) >> 4) | (1u << 16); }
DEVI u64 wg_desc(u32 lo) { return ((u64)((1024 >> 4) | (1u << 30)) << 32) | lo; }
template <bool ACC>
DEVI void wgmma_n16(float (&d)[8], const u32 (&a)[4], u64 desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (ACC)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    else
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 0, 1, 1, 0;\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#else
    __trap();
#endif
}
template <bool ACC>
DEVI void wgmma_n32(float (&d)[16], const u32 (&a)[4], u64 desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (ACC)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    else
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 0, 1, 1, 0;\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#else
    __trap();
#endif
}
template <bool ACC>
DEVI void wgmma_n64(float (&d)[32], const u32 (&a)[4], u64 desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (ACC)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    else
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 0, 1, 1, 0;\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#else
    __trap();
#endif
}
// d = a · b (ACC false: the first k16 slice of a group) or d += a · b, 64 rows by NL tokens.
template <int NL, bool ACC>
DEVI void wgmma_q4(float (&d)[NL / 2], const u32 (&a)[4], u64 desc) {
    if constexpr (NL == 16) wgmma_n16<ACC>(d, a, desc);
    else if constexpr (NL == 32) wgmma_n32<ACC>(d, a, desc);
    else wgmma_n64<ACC>(d, a, desc);
}

// One Q4 k-step of a warp of the _wg kernels: tot[0][n] += the products of tile rows row0 + g,
// row0 + g + 8 and tokens 8n + 2 t4 (+ 1), for the first NL tokens of the tile (NL 16, 32 or 64:
// the wgmma width; the other n8 tiles are left alone). As: weight words then scale/bias words
// (q4_kstep's layout), Bs: the swizzled token rows, Xs: group sums [group][BN tokens] f32.
template <int BN, int NL>
DEVI void q4_kstep_wg(float (&tot)[1][BN / 8][4], u32 As, u32 Bs, u32 Xs, int row0, int lane) {
    constexpr int NT = NL / 8;
    const int g = lane >> 2, t4 = lane & 3;
    const u32 a_at = As + (row0 + g) * 64 + t4 * 16, s_at = As + BM * 64 + (row0 + g) * 8, x_at = Xs + 8 * t4;
    const uint4 A0 = lds128_at(a_at), A1 = lds128_at(a_at + 512);
    const uint2 SB0 = lds64_at(s_at), SB1 = lds64_at(s_at + 64);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        // The group's sums of the token rows, read before they are needed.
        uint2 xv[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) xv[n] = lds64_at(x_at + j * BN * 4 + n * 32);
        float acc[NL / 2];
        u32 a[4][4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int p0 = 2 * (s & 1), wi = 2 * j + (s >> 1);
            const u32 wa = word4(A0, wi), wb = word4(A1, wi);
            a[s][0] = q4_pair(wa, p0), a[s][1] = q4_pair(wb, p0), a[s][2] = q4_pair(wa, p0 + 1), a[s][3] = q4_pair(wb, p0 + 1);
        }
        wg_fence();
        const u32 b = wg_desc_lo(Bs) + j * BN * 128 / 16;  // the group's 64 columns: k16 slice s at + 32 s bytes
        wgmma_q4<NL, false>(acc, a[0], wg_desc(b));
#pragma unroll
        for (int s = 1; s < 4; ++s) wgmma_q4<NL, true>(acc, a[s], wg_desc(b + s * 2));
        wg_commit();
        // The scale step's first fma does not need the sums: it runs while the tensor cores do.
        const u32 sv0 = j ? SB0.y : SB0.x, sv1 = j ? SB1.y : SB1.x;
        const float s0 = bf16_lo(sv0), c0 = bf16_hi(sv0) - 128.f * s0;
        const float s1 = bf16_lo(sv1), c1 = bf16_hi(sv1) - 128.f * s1;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float xa = __uint_as_float(xv[n].x), xb = __uint_as_float(xv[n].y);
            tot[0][n][0] = __fmaf_rn(c0, xa, tot[0][n][0]);
            tot[0][n][1] = __fmaf_rn(c0, xb, tot[0][n][1]);
            tot[0][n][2] = __fmaf_rn(c1, xa, tot[0][n][2]);
            tot[0][n][3] = __fmaf_rn(c1, xb, tot[0][n][3]);
        }
        wg_wait_all();
        wg_pin(acc);
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) tot[0][n][c] = __fmaf_rn(c < 2 ? s0 : s1, acc[4 * n + c], tot[0][n][c]);
    }
}

// The _wgr kernels (Tuning::gemm_wg_round): each 4-bit weight dequantised in registers to bf16,
// w = s·q + b rounded once (as MLX's quantized matmul dequantises before its bf16 products), and
// the tensor cores accumulate the whole K into tot: no per-group scale step, no group sums. Each
// wgmma group waits only for the group before it (two in flight: a group's dequantising overlaps
// the last one's MMA); the main loop waits for all once per barrier. Same operand layouts as
// q4_kstep_wg; the outputs differ from the exact form by the weights' bf16 rounding.
DEVI u32 q4_dq(u32 qm, u32 s2, u32 b2) {
    u32 q, w;
    // (128 + q) · 1 − 128 = q exactly, then s · q + b with one rounding.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(q) : "r"(qm), "r"(0x3F803F80u), "r"(0xC300C300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(w) : "r"(q), "r"(s2), "r"(b2));
    return w;
}
template <int BN, int NL>
DEVI void q4_kstep_wgr(float (&tot)[1][BN / 8][4], u32 As, u32 Bs, int row0, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
    const u32 a_at = As + (row0 + g) * 64 + t4 * 16, s_at = As + BM * 64 + (row0 + g) * 8;
    const uint4 A0 = lds128_at(a_at), A1 = lds128_at(a_at + 512);
    const uint2 SB0 = lds64_at(s_at), SB1 = lds64_at(s_at + 64);
    float(&acc)[NL / 2] = *reinterpret_cast<float(*)[NL / 2]>(&tot[0][0][0]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        // Scale (low half) and bias (high half) of rows g and g + 8, each in both halves.
        const u32 sv0 = j ? SB0.y : SB0.x, sv1 = j ? SB1.y : SB1.x;
        const u32 s0 = __byte_perm(sv0, 0, 0x1010), b0 = __byte_perm(sv0, 0, 0x3232);
        const u32 s1 = __byte_perm(sv1, 0, 0x1010), b1 = __byte_perm(sv1, 0, 0x3232);
        u32 a[4][4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int p0 = 2 * (s & 1), wi = 2 * j + (s >> 1);
            const u32 wa = word4(A0, wi), wb = word4(A1, wi);
            a[s][0] = q4_dq(q4_pair(wa, p0), s0, b0), a[s][1] = q4_dq(q4_pair(wb, p0), s1, b1);
            a[s][2] = q4_dq(q4_pair(wa, p0 + 1), s0, b0), a[s][3] = q4_dq(q4_pair(wb, p0 + 1), s1, b1);
        }
        wg_fence();
        const u32 b = wg_desc_lo(Bs) + j * BN * 128 / 16;
#pragma unroll
        for (int s = 0; s < 4; ++s) wgmma_q4<NL, true>(acc, a[s], wg_desc(b + s * 2));
        wg_commit();
        wg_wait_one();  // the group before is done: its weight registers are free again
    }
}

// silu(g) · u, as every GEMM epilogue and split-K reduction forms it.
DEVI float silu_times(float g, float u) { return g / (1.f + expf(-g)) * u; }
DEVI float4 silu_times(float4 g, float4 u) {
    return make_float4(silu_times(g.x, u.x), silu_times(g.y, u.y), silu_times(g.z, u.z), silu_times(g.w, u.w));
}

// Split-K in clusters (the _kc kernels): the tile's K parts are the cluster's blocks (rank
// blockIdx.z), each with its partial C tile [tokens][BM + 4] f32 at shared address cs. Block z
// finishes the tile's tokens [z · n / Z, (z + 1) · n / Z) of its n, each C value the sum of the Z
// parts' in the order 0, 1, ... (the bits of gemm_splitk_reduce), as the one-pass epilogue does
// (PAIR: silu(gate) · up, prepared for the next GEMM with xs_out; else stored or, with acc, added).
// A thread takes 4 consecutive rows of a token (16-byte reads of every part's tile, all in flight
// together): PAIR 16 threads per token (gate rows 4q .. 4q + 3 and their up rows), else 32.
// gemm_each (the _kc kernels, a.nseg > 0): the weight of block row bx, the last segment whose
// first block is at or before bx (constant parameter offsets, no indexed copy).
DEVI GemmSeg gemm_seg(const GemmArgs& a, int bx) {
    GemmSeg s = a.seg[0];
#pragma unroll
    for (int i = 1; i < GEMM_SEGS; ++i)
        if (i < a.nseg && bx >= a.seg[i].rb0) s = a.seg[i];
    return s;
}

template <int BN, bool PAIR>
DEVI void splitk_cluster_finish(const GemmArgs& a, u32 cs) {
    constexpr int CST = BM + 4, OUTW = PAIR ? BM / 2 : BM, TPT = OUTW / 4;  // threads per token
    u32 bx, by;  // volatile reads: no copy of blockIdx stays alive across the main loop
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(bx));
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(by));
    // The output: out rows [T, ldo] of M rows, or (gemm_each) the block's weight's own.
    u64 out = a.out;
    int ldo = a.ldo, M = a.M, bxs = bx;
    if (!PAIR && a.nseg > 0) {
        const GemmSeg sg = gemm_seg(a, bx);
        out = sg.out, ldo = sg.ldo, M = sg.rows, bxs = bx - sg.rb0;
    }
    const int start = by * BN, n = min(BN, a.T - start), m0 = bxs * OUTW, mrem = min(OUTW, M - m0);
    const int Z = cluster_blocks(), z0 = cluster_rank(), tb = z0 * n / Z, te = (z0 + 1) * n / Z;
    const int q = threadIdx.x % TPT, r4 = 4 * q;
    // Σ over the parts of the 4 values at tile position (tk, r), in part order.
    auto sum4 = [&](int tk, int r) {
        const u32 at = cs + 4 * (tk * CST + r);
        float4 p[SPLITK_CLUSTER_MAX];
#pragma unroll
        for (int z = 0; z < SPLITK_CLUSTER_MAX; ++z)
            if (z < Z) p[z] = dsmem_ld4(at, z);
        float4 v = p[0];
#pragma unroll
        for (int z = 1; z < SPLITK_CLUSTER_MAX; ++z)
            if (z < Z) { v.x += p[z].x; v.y += p[z].y; v.z += p[z].z; v.w += p[z].w; }
        return v;
    };
    // Every thread runs every pass (group64_sum shuffles the warp).
    for (int tk0 = tb; tk0 < te; tk0 += 256 / TPT) {
        const int tk = tk0 + (int)threadIdx.x / TPT;
        const bool live = tk < te;
        float4 v = live ? sum4(tk, r4) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (PAIR && live) v = silu_times(v, sum4(tk, BM / 2 + r4));
        const i64 row = start + tk;
        if (PAIR && a.xs_out) {
            // Prepared rows, as the one-pass epilogue writes them (rows beyond mrem: zero).
            const float w[4] = {v.x, v.y, v.z, v.w};
            float x[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) x[i] = r4 + i < mrem ? w[i] : 0.f;
            const u32 p0 = pack_bf16(x[0], x[1]), p1 = pack_bf16(x[2], x[3]);
            const float gs = group64_sum(p0, p1);
            if (live) {
                *(uint2*)((__nv_bfloat16*)a.out + row * a.ldo + m0 + r4) = make_uint2(p0, p1);
                if (q == 0) ((float*)a.xs_out)[row * (a.ldo / 64) + m0 / 64] = gs;
            }
            continue;
        }
        if (!live) continue;
        float* o = (float*)out + row * ldo + m0 + r4;
        const float w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (r4 + i < mrem) o[i] = a.acc ? o[i] + w[i] : w[i];
    }
}

// ---- direct weight loads (the _ld kernels) ----
// A warp's 16 weight rows of the block: its lane's 16-byte chunk of the first k-step's unit (rows
// g and g + 8 at byte offsets oa0, oa1) and the unit's scale/bias words (os0, os1).
struct Q4Rows {
    const unsigned char* pa;
    const unsigned char* ps;
    int oa0, oa1, os0, os1;
};

// The main loop of an _ld block: the warp's words of each k-step are loaded from global memory
// into a ring of three register buffers, two k-steps ahead of their use; stage() puts the block's
// token rows and group sums in flight (k-step kt's at bsm + kt · BN · BS_STRIDE · 2 and xsm + kt ·
// BN · 8), after the first two weight requests (STAGE_FIRST: before them, where registers are
// short); then each k-step is multiplied as q4_kstep does (q4_groups, the first NL n8 tiles), so
// the same bits; one barrier (the token rows have landed), none in the loop.
template <int BN, int NL, bool STAGE_FIRST, typename Stage>
DEVI void q4_ld_loop(float (&tot)[1][BN / 8][4], Q4Rows w, u32 bsm, u32 xsm, int nk, int lane, Stage stage) {
    constexpr int NT = BN / 8, BB = BN * BS_STRIDE * 2;
    uint4 ra[3][2];
    uint2 rs[3][2];
    auto fetch = [&](int b, int kt) {
        if (kt < nk) {
            ra[b][0] = ldg_nc((const uint4*)(w.pa + w.oa0));
            ra[b][1] = ldg_nc((const uint4*)(w.pa + w.oa1));
            rs[b][0] = ldg_nc2((const uint2*)(w.ps + w.os0));
            rs[b][1] = ldg_nc2((const uint2*)(w.ps + w.os1));
            w.pa += Q4_UNIT;
            w.ps += Q4_SB_UNIT;
        }
    };
    // q4_kstep's lane addresses: B rows as ldmatrix takes them, sums of tokens 2 t4, 2 t4 + 1.
    const int t4 = lane & 3;
    const u32 b_at = bsm + (((NL == 1 ? 0 : (lane >> 4) * 8) + (lane & 7)) * BS_STRIDE + ((lane >> 3) & 1) * 8) * 2;
    const u32 x_at = xsm + 2 * t4 * 8;
    auto step = [&](int b, int kt) {
        uint4 A0[1] = {ra[b][0]}, A1[1] = {ra[b][1]};
        uint2 SB0[1] = {rs[b][0]}, SB1[1] = {rs[b][1]};
        float4 X[NL];
#pragma unroll
        for (int n = 0; n < NL; ++n) {
            const uint4 v = lds128_at(x_at + kt * BN * 8 + n * 64);
            X[n] = make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
        }
        q4_groups<1, NT, NL, true>(tot, A0, A1, SB0, SB1, X, b_at + kt * BB, [](int) {});
    };
    if constexpr (STAGE_FIRST) stage();
    fetch(0, 0);
    fetch(1, 1);
    if constexpr (!STAGE_FIRST) stage();
    cp_async_wait<0>();
    __syncthreads();  // everyone's token rows and sums have landed
#pragma unroll 1
    for (int kt = 0; kt < nk; kt += 3) {
        fetch(2, kt + 2);
        step(0, kt);
        if (kt + 1 >= nk) break;
        fetch(0, kt + 3);
        step(1, kt + 1);
        if (kt + 2 >= nk) break;
        fetch(1, kt + 4);
        step(2, kt + 2);
    }
}

template <int N>
struct IntC {
    static constexpr int value = N;
};

template <int FMT, int BN, bool PAIR, bool CLUSTER, bool WG = false, bool LD = false, bool WR = false>
DEVI void gemm_body(const GemmArgs& a) {
    // x, the tile table and the output belong to earlier kernels of the stream. A GEMM without a
    // tile table, or whose table was written two or more kernels back (tiles_early), requests its
    // first weights before the wait (the prologue's, or q4_ld_loop's stage); the others wait first,
    // and so does the _ld pair, which stages its token rows before its first weights (its 64
    // registers hold no weights during the staging).
    constexpr bool LD_STAGE_FIRST = LD && PAIR;
    const bool early = !LD_STAGE_FIRST && (!a.tiles || a.tiles_early);
    if (!early) pdl_enter();
    using Cfg = GemmCfg<FMT, BN, WG>;
    constexpr int WN = Cfg::WN;                 // warps along the tokens
    constexpr int WM = 8 / WN;                  // warps along the rows
    constexpr int MT = BM / 16 / WM;            // m16 tiles per warp
    constexpr int NT = BN / 8 / WN;             // n8 tiles per warp
    constexpr int A_BYTES = Cfg::A_BYTES;
    constexpr int B_BYTES = Cfg::B_BYTES;
    constexpr int STAGE = Cfg::STAGE;
    constexpr int S = Cfg::STAGES;
    constexpr int BR = BN >= 16 ? BN / 16 : 1;  // B rows per thread per stage (16 threads per row;
                                                // BN 8: threads 0..127 only)
    constexpr int OUTW = PAIR ? BM / 2 : BM;    // output rows per block
    extern __shared__ __align__(16) unsigned char smem[];
    // The stages (WG: from the first 1024-byte boundary).
    unsigned char* const stages = WG ? smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u) : smem;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    const int row0 = wm * (MT * 16);  // first tile row of this warp's MT m16 tiles (PAIR: < 64 gate, else up)
    const int nbase = wn * (NT * 8);  // first token of this warp's NT n8 tiles

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
    // Grouped: expert alt_expert (> 0) is another weight of the same shape, alt_w (PAIR: and
    // alt_w2), e.g. the shared expert listed after the routed ones.
    const bool alt = a.tiles && a.alt_expert > 0 && expert == a.alt_expert;
    u64 W = alt ? a.alt_w : a.w, W2 = alt ? a.alt_w2 : a.w2;
    u64 SB = alt ? a.alt_sb : a.sb, SB2 = alt ? a.alt_sb2 : a.sb2;
    int m0 = blockIdx.x * OUTW;                                  // first output row (within the expert)
    int mrem = min(OUTW, a.M - m0);                              // output rows of this block that exist
    if constexpr (CLUSTER && !PAIR) {
        if (a.nseg > 0) {  // gemm_each: the block row's weight (its outputs: splitk_cluster_finish)
            const GemmSeg sg = gemm_seg(a, blockIdx.x);
            W = sg.w, SB = sg.sb, m0 = (blockIdx.x - sg.rb0) * OUTW, mrem = min(OUTW, sg.rows - m0);
        }
    }
    const i64 wrow0 = (i64)(alt ? 0 : expert) * a.rows_e + m0;  // first weight row
    // K part z of grid.z (split-K): k-steps [kt0, kt0 + nk) = [z · N / Z, (z + 1) · N / Z) of
    // the N = kpad / 128 (parts of ⌊N / Z⌋ or ⌈N / Z⌉ k-steps); one part: all of them.
    const int nkall = a.kpad / BK;
    const int kt0 = (int)((i64)blockIdx.z * nkall / gridDim.z);
    const int nk = (int)((i64)(blockIdx.z + 1) * nkall / gridDim.z) - kt0;

    // This thread's copy sources at k-step 0; a k-step advances them by a fixed stride. A copy of
    // a row that does not exist (weight row beyond M, token beyond count) reads nothing (zero-fill)
    // and keeps a valid address (row 0 of its tensor). Q4 weights: 16-byte chunk (tid & 3) of tile
    // rows tid >> 2 and tid >> 2 + 64 (PAIR: row tid >> 2 of W and of W2), scale/bias words of
    // tile row tid < 128; BF16 weights: chunk (tid & 15) of tile rows tid >> 4 + 16 i. Tokens:
    // chunk (tid & 15) of tokens tid >> 4 + 16 i; group sums of token tid < BN.
    constexpr int QA = FMT == FMT_Q4 ? 2 : BM * 16 / 256;  // weight chunks per thread
    constexpr int A_STEP = FMT == FMT_Q4 ? Q4_UNIT : 256;  // source advance per k-step (bytes)
    auto a_row = [&](int i) {                               // tile row of weight chunk i
        return FMT == FMT_Q4 ? (int)(threadIdx.x >> 2) + (BM / 2) * i : (int)(threadIdx.x >> 4) + 16 * i;
    };
    auto a_ok = [&](int i) { return (PAIR ? (a_row(i) & (BM / 2 - 1)) : a_row(i)) < mrem; };
    auto s_ok = [&]() { return (PAIR ? ((int)threadIdx.x & (BM / 2 - 1)) : (int)threadIdx.x) < mrem; };
    auto b_ok = [&](int i) { return (int)(threadIdx.x >> 4) + 16 * i < count; };
    auto x_ok = [&]() { return (int)threadIdx.x < count; };  // (only asked for tid < BN)
    // Weight row `row` of the block's matrix: W's, or (a.m1 > 0, not PAIR) W2's row row − m1 from
    // row m1 on (two weights read as one, rows concatenated).
    auto second = [&](i64 row) { return !PAIR && a.m1 > 0 && row >= a.m1; };
    const unsigned char* srcA[QA];
#pragma unroll
    for (int i = 0; i < QA; ++i) {
        const int r = a_row(i), rr = PAIR ? (r & (BM / 2 - 1)) : r;
        const int ch = FMT == FMT_Q4 ? (threadIdx.x & 3) : (threadIdx.x & 15);
        const bool w2 = PAIR ? r >= BM / 2 : second(wrow0 + rr);
        const i64 row = wrow0 + rr - (!PAIR && w2 ? a.m1 : 0);
        const i64 off = FMT == FMT_Q4 ? q4_offset(row, 0, a.kpad) : row * a.kpad * 2;
        srcA[i] = (const unsigned char*)(w2 ? W2 : W) + (a_ok(i) ? off + ch * 16 : 0);
    }
    const unsigned char* srcS = (const unsigned char*)SB;
    if (FMT == FMT_Q4 && threadIdx.x < BM) {
        const int q = threadIdx.x;
        const bool w2 = PAIR ? q >= BM / 2 : second(wrow0 + q);
        srcS = (const unsigned char*)(w2 ? SB2 : SB);
        if (s_ok()) srcS += q4_sb_offset(wrow0 + (PAIR ? (q & (BM / 2 - 1)) : q - (w2 ? a.m1 : 0)), 0, a.kpad);
    }
    const unsigned char* srcB[BR];
#pragma unroll
    for (int i = 0; i < BR; ++i) {
        const int tk = (threadIdx.x >> 4) + 16 * i;
        const i64 row = b_ok(i) ? (x_rows ? x_rows[start + tk] : start + tk) : 0;
        srcB[i] = (const unsigned char*)a.x + row * a.kpad * 2 + (threadIdx.x & 15) * 16;
    }
    // Group sums: thread tid < BN copies token tid's two (WG: tid < 2 BN, token tid / 2's group
    // tid % 2, stored [group][token]).
    const int xtk = (int)threadIdx.x >> 1;
    const unsigned char* srcX = (const unsigned char*)a.xs;
    if constexpr (WG) {
        if (xtk < BN && xtk < count) srcX += (i64)(x_rows ? x_rows[start + xtk] : start + xtk) * (a.kpad / 16) + (threadIdx.x & 1) * 4;
    } else if ((int)threadIdx.x < BN && x_ok()) {
        srcX += (i64)(x_rows ? x_rows[start + threadIdx.x] : start + threadIdx.x) * (a.kpad / 16);
    }
    // Sources at the part's first k-step (k-step kt below is kt0 + kt).
    if (kt0 > 0) {
#pragma unroll
        for (int i = 0; i < QA; ++i) srcA[i] += (i64)kt0 * A_STEP;
        srcS += (i64)kt0 * Q4_SB_UNIT;
#pragma unroll
        for (int i = 0; i < BR; ++i) srcB[i] += (i64)kt0 * 256;
        srcX += (i64)kt0 * 8;
    }

    // ---- one k-step into stage st: weights (load_w), token rows and group sums (load_x) ----
    auto load_w = [&](int kt, int st) {
        unsigned char* As = stages + st * STAGE + Cfg::A_OFF;
#pragma unroll
        for (int i = 0; i < QA; ++i) {
            const int off = FMT == FMT_Q4 ? a_row(i) * 64 + (threadIdx.x & 3) * 16 : a_row(i) * AB_STRIDE * 2 + (threadIdx.x & 15) * 16;
            cp_async16(As + off, srcA[i] + kt * A_STEP, a_ok(i));
        }
        if (FMT == FMT_Q4 && threadIdx.x < BM) cp_async8(As + BM * 64 + threadIdx.x * 8, srcS + kt * Q4_SB_UNIT, s_ok());
    };
    auto load_x = [&](int kt, int st) {
        if constexpr (WG) {
            // Token row tr's 16-byte chunk ch: in half ch / 8, at chunk (ch % 8) ^ (tr % 8).
            unsigned char* Bs = stages + st * STAGE + Cfg::B_OFF;
            const int ch = threadIdx.x & 15;
#pragma unroll
            for (int i = 0; i < BR; ++i) {
                const int tr = (threadIdx.x >> 4) + 16 * i;
                cp_async16(Bs + (ch >> 3) * (BN * 128) + tr * 128 + (((ch & 7) ^ (tr & 7)) << 4), srcB[i] + kt * 256, b_ok(i));
            }
            unsigned char* Xs = stages + st * STAGE + Cfg::X_OFF;
            if (!WR && xtk < BN) cp_async4(Xs + (threadIdx.x & 1) * (BN * 4) + xtk * 4, srcX + kt * 8, xtk < count);
        } else {
            unsigned char* Bs = stages + st * STAGE + Cfg::A_OFF + A_BYTES;
#pragma unroll
            for (int i = 0; i < BR; ++i)
                if (BN >= 16 || (int)(threadIdx.x >> 4) < BN)
                    cp_async16(Bs + ((threadIdx.x >> 4) + 16 * i) * BS_STRIDE * 2 + (threadIdx.x & 15) * 16, srcB[i] + kt * 256, b_ok(i));
            if ((int)threadIdx.x < BN) cp_async8(Bs + B_BYTES + threadIdx.x * 8, srcX + kt * 8, x_ok());
        }
    };
    auto load_stage = [&](int kt, int st) {
        load_w(kt, st);
        load_x(kt, st);
    };
    // The first n stages, one commit group each (empty past nk). Early (see the top): the
    // weights of all n first, then the wait, then the tokens (the first group holds all n
    // stages' weights).
    auto prologue = [&](int n) {
        if (early) {
            for (int s = 0; s < n; ++s)
                if (s < nk) load_w(s, s);
            pdl_enter();
        }
        for (int s = 0; s < n; ++s) {
            if (s < nk) {
                if (!early) load_w(s, s);
                load_x(s, s);
            }
            cp_async_commit();
        }
    };

    float tot[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) tot[i][j][c] = 0.f;

    if constexpr (LD) {
        // Direct weight loads (the _ld kernels: Q4, grouped 8-token tiles in one pass or dense
        // 32-token tiles in K parts). The block's token rows and group sums for all its k-steps
        // go to shared memory at once, each k-step laid out as a stage's ([kt]: token rows
        // [BN][BS_STRIDE] bf16; after all of them, [kt]: group sums [BN][2] f32); then each warp
        // streams its own 16 weight rows from global memory (q4_ld_loop). Not for two weights
        // read as one (m1 > 0): the host never asks.
        static_assert(FMT == FMT_Q4 && (BN == 8 || BN == 32) && MT == 1 && !WG, "_ld: Q4 8- or 32-token tiles");
        constexpr int BB = BN * BS_STRIDE * 2;  // bytes of a k-step's token rows
        const u32 bsm = smem_u32(smem), xsm = bsm + nk * BB;
        auto stage = [&]() {
            if (early) pdl_enter();
            // Thread: 16-byte chunk tid % 16 of token rows (tid / 16) % BN and (its + 16) % BN
            // (BN 32: both in turn; BN 8: one) of every k-step it reaches; group sums: thread
            // i < nk · BN those of k-step i / BN, token i % BN.
            const int ch = threadIdx.x & 15, tka = (threadIdx.x >> 4) % BN, tkb = (tka + 16) % BN;
            auto src = [&](int tk) {
                const i64 row = tk < count ? (x_rows ? x_rows[start + tk] : start + tk) : 0;
                return (const unsigned char*)a.x + row * a.kpad * 2 + (i64)kt0 * 256 + ch * 16;
            };
            const unsigned char* sa = src(tka);
            const unsigned char* sb = src(tkb);
            for (int i = threadIdx.x; i < nk * BN * 16; i += 256) {
                const int tk = (i >> 4) % BN, kt = (i >> 4) / BN;
                const bool first = tk == tka;
                cp_async16(smem + kt * BB + tk * BS_STRIDE * 2 + ch * 16, (first ? sa : sb) + kt * 256, tk < count);
            }
            for (int i = threadIdx.x; i < nk * BN; i += 256) {
                const int t = i % BN;
                const bool okx = t < count;
                const i64 xr = okx ? (x_rows ? x_rows[start + t] : start + t) : 0;
                cp_async8(smem + nk * BB + i * 8, (const unsigned char*)a.xs + xr * (a.kpad / 16) + (i64)(kt0 + i / BN) * 8, okx);
            }
            cp_async_commit();
        };
        // This warp's 16 rows: one unit of W (PAIR: warps 0-3 W's rows, 4-7 W2's at the same
        // indices), rows g and g + 8 of it for this lane, read in k-step order through running
        // pointers. A row beyond mrem reads row 0 of the unit instead: its outputs are never
        // written.
        const int rr = PAIR ? (row0 & (BM / 2 - 1)) : row0;
        const bool hi = PAIR && row0 >= BM / 2;
        const int r0 = rr + g < mrem ? g : 0, r1 = rr + g + 8 < mrem ? g + 8 : 0;
        const Q4Rows w{(const unsigned char*)(hi ? W2 : W) + q4_offset(wrow0 + rr, kt0, a.kpad) + t4 * 16,
                       (const unsigned char*)(hi ? SB2 : SB) + q4_sb_offset(wrow0 + rr, kt0, a.kpad), r0 * 64, r1 * 64, r0 * 8, r1 * 8};
        // The tile's tokens in the fewest n8 tiles that hold them (block-uniform).
        if constexpr (BN == 8) q4_ld_loop<BN, 1, LD_STAGE_FIRST>(tot, w, bsm, xsm, nk, lane, stage);
        else if (count > 16) q4_ld_loop<BN, BN / 8, LD_STAGE_FIRST>(tot, w, bsm, xsm, nk, lane, stage);
        else if (count > 8) q4_ld_loop<BN, 2, LD_STAGE_FIRST>(tot, w, bsm, xsm, nk, lane, stage);
        else q4_ld_loop<BN, 1, LD_STAGE_FIRST>(tot, w, bsm, xsm, nk, lane, stage);
    } else if constexpr (WG) {
        // Two k-steps per barrier (the k-step barrier bounded these kernels: each warpgroup
        // waits for its wgmma): k-steps kt and kt + 1 are computed while kt + 2 and kt + 3 load
        // into the stages kt − 2 and kt − 1 used (k-step k in stage k mod 4).
        static_assert(S == 4, "the _wg main loop pairs four stages");
        // NL (WR only): the wgmma width of every k-step (the narrowest that holds the tile's
        // tokens), chosen once for the block, so that the rounded form's accumulators stay in one
        // wgmma shape across k-steps (mixing shapes on them made ptxas serialise every wgmma); 0:
        // chosen per k-step.
        auto main_loop = [&](auto nl) {
            constexpr int NL = decltype(nl)::value;
            auto compute = [&](int stage) {
                const u32 base = smem_u32(stages + stage * STAGE);
                const u32 as = base + Cfg::A_OFF, bs = base + Cfg::B_OFF, xs = base + Cfg::X_OFF;
                if constexpr (NL > 0) {
                    q4_kstep_wgr<BN, NL>(tot, as, bs, row0, lane);
                } else {
                    // The tile's tokens in the narrowest wgmma width that holds them (block-uniform).
                    if (count > 32) q4_kstep_wg<BN, 64>(tot, as, bs, xs, row0, lane);
                    else if (count > 16) q4_kstep_wg<BN, 32>(tot, as, bs, xs, row0, lane);
                    else q4_kstep_wg<BN, 16>(tot, as, bs, xs, row0, lane);
                }
            };
            prologue(2);
#pragma unroll 1
            for (int kt = 0; kt < nk; kt += 2) {
                cp_async_wait<0>();   // k-steps kt and kt + 1 have landed
                fence_proxy_async();  // this thread's copies, for the tensor cores' reads
                // Everyone's copies are visible, and everyone is done with k-steps kt − 2 and kt − 1.
                __syncthreads();
#pragma unroll
                for (int s = 2; s < 4; ++s) {
                    if (kt + s < nk) load_stage(kt + s, (kt + s) & 3);
                    cp_async_commit();
                }
                compute(kt & 3);
                if (kt + 1 < nk) compute((kt + 1) & 3);
                if constexpr (NL > 0) {  // the stages of kt and kt + 1 are refilled after the next barrier
                    wg_wait_all();
                    wg_pin(*reinterpret_cast<float(*)[NL / 2]>(&tot[0][0][0]));
                }
            }
        };
        if constexpr (WR) {
            if (count > 32) main_loop(IntC<64>{});
            else if (count > 16) main_loop(IntC<32>{});
            else main_loop(IntC<16>{});
        } else {
            main_loop(IntC<0>{});
        }
    } else {
        // Prologue: k-steps 0..S-2, one commit group each (empty groups past nk keep the count fixed).
        prologue(S - 1);

        int st = 0, ld = S - 1;  // stage computed now, stage loaded now
#pragma unroll 1
        for (int kt = 0; kt < nk; ++kt) {
            // Groups committed so far: S - 1 + kt; at most S - 2 pending means k-step kt has landed.
            cp_async_wait<S - 2>();
            // Everyone's copies of k-step kt are visible, and everyone is done computing k-step
            // kt - 1, whose stage (ld) is refilled next.
            __syncthreads();
            if (kt + S - 1 < nk) load_stage(kt + S - 1, ld);
            cp_async_commit();

            unsigned char* As = stages + st * STAGE + Cfg::A_OFF;
            unsigned char* Bs = stages + st * STAGE + Cfg::B_OFF;
            const __nv_bfloat16* Bh = (const __nv_bfloat16*)Bs;

            if constexpr (FMT == FMT_Q4) {
                const u32 as = smem_u32(As), bs = as + A_BYTES, xs = bs + B_BYTES;
                if constexpr (NT == 1) {
                    if (count - nbase > 0) q4_kstep<MT, 1, 1, Cfg::Q4_ONCE>(tot, as, bs, xs, row0, nbase, lane);
                } else if constexpr (WN == 1 || WN == 2) {
                    // Only the n8 tiles that hold tokens of the tile (1, 2, 4 or all of the warp's):
                    // the others would multiply zero-filled rows. cw: the tile's tokens from this
                    // warp's first on (warp-uniform).
                    const int cw = count - nbase;
                    if (cw > 16 && NT > 4 && cw <= 32) q4_kstep<MT, NT, (NT > 4 ? 4 : NT), Cfg::Q4_ONCE>(tot, as, bs, xs, row0, nbase, lane);
                    else if (cw > 16) q4_kstep<MT, NT, NT, Cfg::Q4_ONCE>(tot, as, bs, xs, row0, nbase, lane);
                    else if (cw > 8) q4_kstep<MT, NT, 2, Cfg::Q4_ONCE>(tot, as, bs, xs, row0, nbase, lane);
                    else if (cw > 0) q4_kstep<MT, NT, 1, Cfg::Q4_ONCE>(tot, as, bs, xs, row0, nbase, lane);
                } else {
                    q4_kstep<MT, NT, NT, Cfg::Q4_ONCE>(tot, as, bs, xs, row0, nbase, lane);
                }
            } else {
                const __nv_bfloat16* Ah = (const __nv_bfloat16*)As;
#pragma unroll
                for (int s = 0; s < BK / 16; ++s) {
                    int k0 = s * 16;
                    u32 b[NT][2];
                    load_b<NT>(b, Bh, nbase, k0, lane);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const int r = row0 + mt * 16;
                        u32 a0, a1, a2, a3;
                        ldsm_x4(a0, a1, a2, a3, Ah + (r + (lane & 15)) * AB_STRIDE + k0 + (lane >> 4) * 8);
#pragma unroll
                        for (int n = 0; n < NT; ++n) mma_bf16(tot[mt][n], a0, a1, a2, a3, b[n][0], b[n][1]);
                    }
                }
            }
            st = st + 1 == S ? 0 : st + 1;
            ld = ld + 1 == S ? 0 : ld + 1;
        }
    }
    // Drain every group (the trailing ones are empty) before the stages become the C tile.
    cp_async_wait<0>();
    __syncthreads();

    // ---- epilogue through shared memory: C tile [BN tokens][BM tile rows] f32 ----
    float* Cs = (float*)smem;  // BN * (BM + 4) floats (Cfg::EPI)
    constexpr int CST = BM + 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                int tk = nbase + n * 8 + 2 * t4 + (c & 1);
                int r = row0 + mt * 16 + g + (c >> 1) * 8;
                Cs[tk * CST + r] = tot[mt][n][c];
            }
        }
    }
    if constexpr (CLUSTER) {
        cluster_sync();  // every part's C tile is in its block's shared memory
        splitk_cluster_finish<BN, PAIR>(a, smem_u32(Cs));
        cluster_sync();  // the parts' tiles stay until every block has read them
        return;
    }
    __syncthreads();
    if (PAIR && a.xs_out && gridDim.z == 1) {
        // Prepared rows: 16 lanes per token, lane q the tile rows 4q .. 4q + 3, rounded and summed
        // in gemm_xprep's order; every thread runs every pass (group64_sum shuffles the warp).
        const int q = threadIdx.x & 15, nst = min(count, BN);
        for (int tk0 = 0; tk0 < nst; tk0 += 16) {
            const int tk = tk0 + (threadIdx.x >> 4);
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = 4 * q + j;
                const float gv = Cs[tk * CST + r], uv = Cs[tk * CST + BM / 2 + r];
                v[j] = (tk < nst && r < mrem) ? gv / (1.f + expf(-gv)) * uv : 0.f;
            }
            const u32 p0 = pack_bf16(v[0], v[1]), p1 = pack_bf16(v[2], v[3]);
            const float gs = group64_sum(p0, p1);
            if (tk < nst) {
                const i64 row = start + tk;
                *(uint2*)((__nv_bfloat16*)a.out + row * a.ldo + m0 + 4 * q) = make_uint2(p0, p1);
                if (q == 0) ((float*)a.xs_out)[row * (a.ldo / 64) + m0 / 64] = gs;
            }
        }
        return;
    }
    // Thread: output row m0 + r for tokens tk0, tk0 + TSTEP, ... of the tile (PAIR: silu of gate
    // tile row r times up tile row 64 + r). Split-K: the part's sums go to its partial matrix
    // [T][ldo] (part z at z · T · ldo), PAIR's gate and up sums apart (up at column ldo / 2 + m),
    // for gemm_splitk_reduce.
    constexpr int TSTEP = 256 / OUTW;
    const int r = threadIdx.x % OUTW, nst = min(count, BN);
    const bool split = gridDim.z > 1;
    if (r < mrem) {
        float* o = (float*)a.out + (i64)blockIdx.z * a.T * a.ldo + (i64)start * a.ldo + m0 + r;
        for (int tk = threadIdx.x / OUTW; tk < nst; tk += TSTEP) {
            float v = Cs[tk * CST + r];
            if (PAIR) {
                float u = Cs[tk * CST + BM / 2 + r];
                if (split) o[(i64)tk * a.ldo + a.ldo / 2] = u;
                else v = v / (1.f + expf(-v)) * u;
            }
            // a.acc (one pass, not PAIR): the residual plus the product, as add_assign adds.
            o[(i64)tk * a.ldo] = a.acc ? o[(i64)tk * a.ldo] + v : v;
        }
    }
}

// MINB: blocks per SM the registers are bounded for (2 where shared memory allows two). The _kc
// kernels: dense split-K GEMMs launched as clusters of their K parts (a kernel of its own, so
// that the others keep their registers: the cluster epilogue in the same kernel spilled in the
// main loop of the 64-token Q4 ones).
#define GEMM_KERNEL(name, FMT, BN, PAIR, MINB) \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(const GemmArgs a) { gemm_body<FMT, BN, PAIR, false>(a); }
#define GEMM_KERNEL_KC(name, FMT, BN, PAIR, MINB) \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(const GemmArgs a) { gemm_body<FMT, BN, PAIR, true>(a); }
// The Q4 64-token tile on warpgroup MMA (sm_90a; the host picks them only there).
#define GEMM_KERNEL_WG(name, BN, PAIR, CLUSTER) \
    extern "C" __global__ void __launch_bounds__(256, 2) name(const GemmArgs a) { gemm_body<FMT_Q4, BN, PAIR, CLUSTER, true>(a); }
GEMM_KERNEL(gemm_q4_n8, FMT_Q4, 8, false, 3)
GEMM_KERNEL(gemm_q4_pair_n8, FMT_Q4, 8, true, 3)
GEMM_KERNEL(gemm_q4_n32, FMT_Q4, 32, false, 2)
GEMM_KERNEL(gemm_q4_pair_n32, FMT_Q4, 32, true, 2)
GEMM_KERNEL(gemm_bf16_n32, FMT_BF16, 32, false, 1)
GEMM_KERNEL(gemm_bf16_pair_n32, FMT_BF16, 32, true, 1)
GEMM_KERNEL(gemm_q4_n64, FMT_Q4, 64, false, 2)
GEMM_KERNEL(gemm_q4_n128, FMT_Q4, 128, false, 1)
GEMM_KERNEL(gemm_q4_pair_n64, FMT_Q4, 64, true, 2)
GEMM_KERNEL(gemm_q4_pair_n128, FMT_Q4, 128, true, 1)
GEMM_KERNEL(gemm_bf16_n64, FMT_BF16, 64, false, 2)
GEMM_KERNEL(gemm_bf16_n128, FMT_BF16, 128, false, 1)
GEMM_KERNEL(gemm_bf16_pair_n64, FMT_BF16, 64, true, 2)
GEMM_KERNEL(gemm_bf16_pair_n128, FMT_BF16, 128, true, 1)
GEMM_KERNEL_KC(gemm_q4_n32_kc, FMT_Q4, 32, false, 2)
GEMM_KERNEL_KC(gemm_q4_pair_n32_kc, FMT_Q4, 32, true, 2)
GEMM_KERNEL_KC(gemm_q4_n64_kc, FMT_Q4, 64, false, 2)
GEMM_KERNEL_KC(gemm_q4_pair_n64_kc, FMT_Q4, 64, true, 2)
GEMM_KERNEL_KC(gemm_bf16_n64_kc, FMT_BF16, 64, false, 2)
GEMM_KERNEL_KC(gemm_bf16_pair_n64_kc, FMT_BF16, 64, true, 2)
GEMM_KERNEL_KC(gemm_bf16_n128_kc, FMT_BF16, 128, false, 1)
GEMM_KERNEL_KC(gemm_bf16_pair_n128_kc, FMT_BF16, 128, true, 1)
// Q4 tiles with each warp's weights loaded straight into registers (ops::gemm::gemm_ld): grouped
// 8-token tiles (64 registers, four blocks per SM) and dense 32-token tiles in K parts summed in
// clusters (two blocks per SM).
#define GEMM_KERNEL_LD(name, BN, PAIR, CLUSTER, MINB) \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(const GemmArgs a) { gemm_body<FMT_Q4, BN, PAIR, CLUSTER, false, true>(a); }
GEMM_KERNEL_LD(gemm_q4_n8_ld, 8, false, false, 4)
GEMM_KERNEL_LD(gemm_q4_pair_n8_ld, 8, true, false, 4)
GEMM_KERNEL_LD(gemm_q4_n32_kc_ld, 32, false, true, 2)
GEMM_KERNEL_WG(gemm_q4_n64_wg, 64, false, false)
GEMM_KERNEL_WG(gemm_q4_pair_n64_wg, 64, true, false)
GEMM_KERNEL_WG(gemm_q4_n64_kc_wg, 64, false, true)
GEMM_KERNEL_WG(gemm_q4_pair_n64_kc_wg, 64, true, true)
// The same with the weights rounded to bf16 (q4_kstep_wgr).
#define GEMM_KERNEL_WGR(name, BN, PAIR, CLUSTER) \
    extern "C" __global__ void __launch_bounds__(256, 2) name(const GemmArgs a) { gemm_body<FMT_Q4, BN, PAIR, CLUSTER, true, false, true>(a); }
GEMM_KERNEL_WGR(gemm_q4_n64_wgr, 64, false, false)
GEMM_KERNEL_WGR(gemm_q4_pair_n64_wgr, 64, true, false)
GEMM_KERNEL_WGR(gemm_q4_n64_kc_wgr, 64, false, true)
GEMM_KERNEL_WGR(gemm_q4_pair_n64_kc_wgr, 64, true, true)

// Split-K reduction: out[n, m] = Σ_z part[z][n][m] for m < M, summed in the order z = 0, 1, ...,
// kparts − 1 (so every run gives the same bits), then out[n, m] + that sum where acc (a residual
// add, as add_assign would do it). part: f32 [kparts][T][ldp]; PAIR: silu(Σ gate) · Σ up, the up
// partials at column ldp / 2 + m. gemm_splitk_reduce4: a thread per 4 consecutive outputs of a
// row (M and ldo multiples of 4, out 16-byte aligned; ldp always is a multiple of 4);
// gemm_splitk_reduce: a thread per output. grid (ceil(M / V / 256), T) (ops::gemm). With xs
// (PAIR, gemm_splitk_reduce4, M % 128 == 0: whole warps), the outputs prepared for the next GEMM
// as the one-pass PAIR writes them.
// Σ_z p[z · ps] over z = 0 .. kparts − 1 in that order (loads in flight together, adds in order).
DEVI void sum_parts(const float* p, i64 ps, int kparts, float& s) {
    s = __ldcg(p);
#pragma unroll 4
    for (int z = 1; z < kparts; ++z) s += __ldcg(p + z * ps);
}
DEVI void sum_parts(const float* p, i64 ps, int kparts, float4& s) {
    s = ldcg4(p);
#pragma unroll 4
    for (int z = 1; z < kparts; ++z) {
        const float4 v = ldcg4(p + z * ps);
        s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    }
}
DEVI float plus(float a, float b) { return a + b; }
DEVI float4 plus(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }

// F: float (a thread per output) or float4 (per 4 consecutive outputs of a row).
template <typename F>
DEVI void splitk_reduce(const SplitkArgs& a) {
    pdl_enter();
    constexpr int V = sizeof(F) / 4;
    const int n = blockIdx.y, m = (blockIdx.x * 256 + threadIdx.x) * V;
    if (m >= a.M) return;
    const i64 ps = (i64)a.T * a.ldp;  // floats per part
    const float* p = (const float*)a.part + (i64)n * a.ldp + m;
    F v;
    sum_parts(p, ps, a.kparts, v);
    if (a.pair) {
        F u;
        sum_parts(p + a.ldp / 2, ps, a.kparts, u);
        v = silu_times(v, u);
    }
    if constexpr (V == 4) {
        if (a.xs) {  // PAIR prepared for the next GEMM (gemm_xprep's rounding and group sums)
            const u32 p0 = pack_bf16(v.x, v.y), p1 = pack_bf16(v.z, v.w);
            const float gs = group64_sum(p0, p1);
            *(uint2*)((__nv_bfloat16*)a.out + (i64)n * a.ldo + m) = make_uint2(p0, p1);
            if ((threadIdx.x & 15) == 0) ((float*)a.xs)[(i64)n * (a.ldo / 64) + m / 64] = gs;
            return;
        }
    }
    F* o = (F*)((float*)a.out + (i64)n * a.ldo + m);
    *o = a.acc ? plus(*o, v) : v;
}
extern "C" __global__ void __launch_bounds__(256) gemm_splitk_reduce(const SplitkArgs a) { splitk_reduce<float>(a); }
extern "C" __global__ void __launch_bounds__(256) gemm_splitk_reduce4(const SplitkArgs a) { splitk_reduce<float4>(a); }
