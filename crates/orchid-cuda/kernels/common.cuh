// orchid CUDA kernels: shared helpers. Prepended to every kernels/*.cu file before NVRTC.
//
// Conventions (all kernels):
//   activations are row-major f32 [rows, cols]; tensor-core operands are bf16 with f32 accumulation.
//   Weights ("W [rows, K]") come in two GPU formats, both padded to rows % 128 == 0, K % 128 == 0:
//     Q4   : MLX affine 4-bit, group 64, repacked for mma fragments (see q4_layout below);
//            scale/bias per (row, group) as one u32 = bf16 scale | bf16 bias << 16.
//     BF16 : dense bf16 row-major.
//   mma.m16n8k16 fragment names: g = lane / 4, t = lane % 4.
//     A (16x16 row):  r0 = (row g,   k 2t..2t+1)   r1 = (row g+8, k 2t..)   r2 = (row g, k 2t+8..)   r3 = (row g+8, k 2t+8..)
//     B (16x8 col):   r0 = (k 2t..2t+1, n g)       r1 = (k 2t+8.., n g)
//     C (16x8 f32):   c0,c1 = (row g, n 2t..2t+1)  c2,c3 = (row g+8, n 2t..2t+1)
//   Weights are always the A operand (rows = output features), tokens the B operand (n = token).
//
// q4_layout: a row is cut into units of 128 k (two groups, 16 words = 64 bytes). Within a unit,
// lane-quad member t owns 16 bytes: words [G0W0, G0W1, G1W0, G1W1], where GjW0/GjW1 hold the 16
// k-values of group j that an A fragment of lane t needs over the group's 4 mma k-steps
// (k_local = 16s + 2t + {0,1} and 16s + 8 + 2t + {0,1}, s = 0..3). Word w of a group holds steps
// 2w, 2w+1; pair slot p = 2*(s-2w) + (hi8 ? 1 : 0) keeps its first element in nibble p and its second
// in nibble p+4, so ((word >> 4p) & 0x000F000F) | 0x43004300 is the bf16x2 (128+q0, 128+q1).
// The +128 is folded out with the group's x-sum: s*(acc - 128*sum x) + b*sum x.
//
// Q4 memory order: tile-major. The 16 rows of a 16-row tile store their unit u together, 1 KB
// (row r of the tile at r * 64), then unit u + 1, ...; scale/bias words likewise, 128 bytes per
// (tile, unit) (row r at r * 8, its two groups). A warp's unit is one contiguous kilobyte, so the
// decode matvecs stream whole DRAM lines instead of 64-byte pieces of 16 rows (q4_offset).
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
#define NEG_INF __int_as_float(0xff800000)

#define DEVI __device__ __forceinline__

DEVI float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
DEVI float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum; `red` must hold 32 floats; all threads get the result.
DEVI float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : 0.f;
    return warp_sum(r);
}
// Block-wide sums of N values at once, each the same tree as block_sum above (so the same
// bits), one barrier pair for all: `red` holds N · 32 floats.
template <int N>
DEVI void block_sum_n(float (&v)[N], float* red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] = warp_sum(v[n]);
    __syncthreads();
    if (lane == 0)
#pragma unroll
        for (int n = 0; n < N; ++n) red[n * 32 + w] = v[n];
    __syncthreads();
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] = warp_sum(lane < nw ? red[n * 32 + lane] : 0.f);
}

DEVI float block_max(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : NEG_INF;
    return warp_max(r);
}

#define Q4_UNIT 1024    // bytes of a (16-row tile, 128-k unit) of Q4 weights
#define Q4_SB_UNIT 128  // bytes of its scale/bias words
// Byte offset of (row r, unit u) of a Q4 matrix with kpad columns (its 64 bytes), and of its
// two scale/bias words.
DEVI i64 q4_offset(i64 r, int u, int kpad) { return ((r >> 4) * (kpad >> 7) + u) * Q4_UNIT + (r & 15) * 64; }
DEVI i64 q4_sb_offset(i64 r, int u, int kpad) { return ((r >> 4) * (kpad >> 7) + u) * Q4_SB_UNIT + (r & 15) * 8; }

DEVI float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
DEVI float bf16_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
DEVI float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
DEVI u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}
DEVI float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }
DEVI float siluf_(float x) { return x / (1.f + __expf(-x)); }
DEVI float softplusf_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Sum of a 64-group's bf16-rounded values held by 16 consecutive lanes, 4 each (bf16 pairs p0, p1):
// each lane's 4-value sum, then a 16-lane shuffle tree; every lane of the 16 gets the total. The
// one summation order of the decode x staging and gemm_xprep.
DEVI float group64_sum(u32 p0, u32 p1) {
    float s = bf16_lo(p0) + bf16_hi(p0) + bf16_lo(p1) + bf16_hi(p1);
    s += __shfl_xor_sync(0xffffffffu, s, 8);
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    return s;
}

// A row's GEMM input as gemm_xprep_norm prepares it, once the row's 1 / rms is known: y = x · inv
// · w (the order rms_norm forms it), rounded to bf16 into xb [kpad] (zero past K) with each
// 64-group's sum of the rounded values into xs [kpad / 64]; with yr (not null) the f32 y too. The
// block's warps take the runs of 128 columns in turn, lane L the float4 at 4L of each (a run's
// values and sums depend on that run alone). Needs K % 4 == 0.
DEVI void norm_prep_row(const float* xr, const float* nw, float inv, __nv_bfloat16* xb, float* xs, float* yr, int K, int kpad) {
    const int lane = threadIdx.x & 31, runs = kpad >> 7;
    for (int run = threadIdx.x >> 5; run < runs; run += blockDim.x >> 5) {
        const int k = run * 128 + 4 * lane;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (k < K) {
            const float4 xv = *(const float4*)(xr + k), wv = *(const float4*)(nw + k);
            v = make_float4(xv.x * inv * wv.x, xv.y * inv * wv.y, xv.z * inv * wv.z, xv.w * inv * wv.w);
            if (yr) *(float4*)(yr + k) = v;
        }
        uint2 o;
        o.x = pack_bf16(v.x, v.y);
        o.y = pack_bf16(v.z, v.w);
        *(uint2*)(xb + k) = o;
        const float s = group64_sum(o.x, o.y);
        if ((lane & 15) == 0) xs[k >> 6] = s;
    }
}

// bf16x2 (128 + q) for pair slot p of a repacked Q4 word: ((w >> 4p) & mask) | 0x43004300 as one
// lop3 (the compiler emits two when both constants are immediates: lop3 takes one).
DEVI u32 q4_pair(u32 w, int p) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(w >> (4 * p)), "r"(0x000F000Fu), "n"(0x43004300));
    return d;
}

DEVI void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// TF32 halves of x for 3xTF32 products: hi = x rounded to TF32 (half an ulp added, the low 13
// bits cleared: finite x), lo = x − hi (exact; the MMA reads its top 19 bits, error ≤ 2^-21·|x|).
DEVI void tf32_split(float x, u32& hi, u32& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

DEVI void mma_tf32(float* c, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// An m16n8k8 tile summed to about f32 precision from TF32 halves (3xTF32): hi·hi, hi·lo and lo·hi
// (lo·lo, below f32's rounding, is left out) in three accumulators, so that the MMAs of one k-step
// do not wait on each other; value(e) adds them, the small ones first.
struct Tf32x3 {
    float hh[4], hl[4], lh[4];
    DEVI void zero() {
#pragma unroll
        for (int e = 0; e < 4; ++e) hh[e] = hl[e] = lh[e] = 0.f;
    }
    DEVI void mma(const u32* ah, const u32* al, const u32* bh, const u32* bl) {
        mma_tf32(lh, al, bh);
        mma_tf32(hl, ah, bl);
        mma_tf32(hh, ah, bh);
    }
    DEVI float value(int e) const { return hh[e] + (hl[e] + lh[e]); }
};

DEVI u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Loads at a 32-bit shared address (smem_u32): with the address written as one base plus
// constants, the constants become the instructions' immediate offsets (no address arithmetic per
// load).
DEVI void ldsm_x4_at(u32& r0, u32& r1, u32& r2, u32& r3, u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
DEVI void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) { ldsm_x4_at(r0, r1, r2, r3, smem_u32(p)); }
// Two 8x8 b16 matrices (addresses from lanes 0-15): the B fragment of one n8 tile.
DEVI void ldsm_x2_at(u32& r0, u32& r1, u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}
DEVI u32 lds32_at(u32 a) {
    u32 v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a));
    return v;
}
DEVI uint2 lds64_at(u32 a) {
    uint2 v;
    asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}
DEVI uint4 lds128_at(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
DEVI void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_u32(p)));
}

// 16-byte async copy global -> shared; zero-fills when !pred.
DEVI void cp_async16(void* smem, const void* gmem, bool pred) {
    int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(n));
}
// 8-byte async copy global -> shared (through L1); zero-fills when !pred (src-size 0: nothing read).
DEVI void cp_async8(void* smem, const void* gmem, bool pred) {
    int n = pred ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(n));
}
// 4-byte async copy global -> shared (through L1); zero-fills when !pred.
DEVI void cp_async4(void* smem, const void* gmem, bool pred) {
    int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(n));
}
DEVI void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEVI void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

DEVI uint4 ldg_nc(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
DEVI uint2 ldg_nc2(const uint2* p) {
    uint2 r;
    asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// Programmatic dependent launch (Hopper and newer). Inside the decode graph every kernel after
// the first is launched with the PDL attribute, so it may start while its predecessor still runs.
// Before pdl_wait() a kernel may only read data that no kernel of the step writes (weights,
// kernel parameters, state of earlier steps) and must write nothing; pdl_wait() returns once the
// predecessor grid has completed and its writes are visible (the predecessor itself waited for
// its own, so the whole chain before it is complete too). pdl_launch() lets the successor's
// blocks start their prologue (weight requests) as soon as every block of this grid has issued
// it. Both are no-ops for a normal launch.
DEVI void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
DEVI void pdl_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Waits, then releases the successor (so at most two grids are resident: this one and the
// successor, whose blocks request their weights while this one runs; releasing before the wait
// would let three weight streams compete). moe_down relies on this order: it reads the router's
// ids (two kernels back) before its own wait.
DEVI void pdl_enter() {
    pdl_wait();
    pdl_launch();
}

// Thread-block clusters (Hopper and newer; the host launches a cluster only there).
// cluster_arrive / cluster_wait: the two halves of the cluster barrier (every thread of every
// block of the cluster; the shared-memory writes before the arrive are visible to the cluster's
// blocks after the wait; also a block barrier); cluster_sync: both. cluster_rank /
// cluster_blocks: the block's rank in its cluster and the cluster's number of blocks (volatile
// reads: the compiler keeps no copy of blockIdx / gridDim alive across a main loop for them).
// dsmem_ld4: the float4 at shared address `at` (smem_u32, 16-byte aligned) of cluster block
// `rank`.
DEVI void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
DEVI void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
DEVI void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}
DEVI u32 cluster_rank() {
    u32 r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
    return r;
}
DEVI u32 cluster_blocks() {
    u32 r = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
#endif
    return r;
}
DEVI float4 dsmem_ld4(u32 at, u32 rank) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(at), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
#endif
    return v;
}

// 16-byte load through L2 only (activations another kernel just wrote).
DEVI float4 ldcg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

// Order-preserving key of a float (larger float -> larger key).
DEVI u32 float_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Softmax numerators of a warp's E ≤ 512 logits, held as pv[i] = logit l + 32 i of lane l (-inf
// beyond E): pv[i] = exp(logit − max) within E, −1 beyond (below every candidate of
// warp_take_max); returns their sum.
DEVI float warp_softmax16(float (&pv)[16], int E) {
    const int lane = threadIdx.x & 31;
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = fmaxf(m, pv[i]);
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int e = lane + 32 * i;
        pv[i] = e < E ? expf(pv[i] - m) : -1.f;
        sum += e < E ? pv[i] : 0.f;
    }
    return warp_sum(sum);
}

// One round of a warp's top-k over pv[16] (value i of lane l belongs to id l + 32 i; taken or
// absent entries hold a value below every candidate, e.g. -1 for probabilities): returns the
// largest value and its id (ties to the lower id), and marks it taken (-1). The lane's best is a
// scan in id order; the warp's best value and then its lowest id are one redux.sync each.
DEVI float warp_take_max(float (&pv)[16], int& id) {
    const int lane = threadIdx.x & 31;
    float bv = pv[0];
    int bi = 0;
#pragma unroll
    for (int i = 1; i < 16; ++i)
        if (pv[i] > bv) { bv = pv[i]; bi = i; }
    const u32 key = float_key(bv);
    const u32 wkey = __reduce_max_sync(0xffffffffu, key);
    const u32 wid = __reduce_min_sync(0xffffffffu, key == wkey ? (u32)(lane + 32 * bi) : 0xffffffffu);
#pragma unroll
    for (int i = 0; i < 16; ++i)
        if ((u32)(lane + 32 * i) == wid) pv[i] = -1.f;
    id = (int)wid;
    return __shfl_sync(0xffffffffu, bv, wid & 31);
}

// Counter-based random numbers (SplitMix64 finaliser): uniform in [0, 1).
DEVI float uniform01(u64 seed, u64 counter) {
    u64 z = seed + 0x9E3779B97F4A7C15ull * (counter + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}
