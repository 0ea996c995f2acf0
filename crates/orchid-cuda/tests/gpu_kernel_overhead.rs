//! Where the ~10 µs per decode kernel goes (docs/perf-log.md, "kernel-overhead diagnostic").
//! Chains of 263 kernels captured in one CUDA graph (the decode step's length), replayed 200
//! times after a warm-up and timed with events around each replay (median):
//!   1. empty kernels, 1 block and 2 × SMs blocks of 256 threads, with and without programmatic
//!      dependent launch (PDL);
//!   2. the real `gemv_q4` (kernels/gemv.cu, unchanged) on a 2048 → 4096 4-bit weight, a distinct
//!      weight for every node (263 × 4.5 MB, far beyond the 50 MB L2), and a replica of its T = 1
//!      path with switches: weight loads skipped (register values instead), x staging skipped
//!      (norm, block reduction, bf16 staging), both skipped;
//!   3. the same at 1/4 (1024 rows) and 4× (16384 rows) of the weight;
//!   4. one persistent kernel doing the same 263 matvecs with an atomic-counter grid barrier
//!      between them (each block requests its first weight batch before the barrier, as PDL
//!      does), the barrier alone, and the matvecs without the barrier (wrong results: the
//!      streaming limit).
//!
//! Checks first: the replica gives the real kernel's output bit for bit; the persistent kernel
//! gives the graph chain's 263-step result bit for bit (so the barrier orders the steps).
//!
//! `#[ignore]`d: run on the GPU machine with `scripts/gpu-overhead.sh`. The NVRTC compile check
//! of the diagnostic kernels runs everywhere NVRTC is found (else prints "skipped").

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use orchid_cuda::driver::{self, DevBuf, Event, Gpu, Graph, Kernel};
use orchid_cuda::ops::{self, GemvArgs, GemvSeg};

const GEMV_SRC: &str = include_str!("../kernels/gemv.cu");

/// Diagnostic kernels, compiled after gemv.cu (whose helpers they reuse) in one module.
const DIAG_SRC: &str = r#"
// ---- kernel-overhead diagnostic (tests/gpu_kernel_overhead.rs) ----
// The register-batch matvec helpers of run 5's gemv.cu (perf-log run 5), which the replica
// kernels below replay; gemv.cu itself now streams weights through shared-memory rings.
#define NB 4

// Row-layout staging into xs32 [T][(kpad + 8) / 2].
DEVI void stage_x(const float* __restrict__ x, int ldx, int T, int K, int kpad, const float* __restrict__ norm_w, float eps,
                  u32* xs32, float* xsum, float* red) {
    stage_x(x, ldx, T, K, kpad, norm_w, eps, XLayout{xs32, (kpad + 8) / 2, false}, xsum, red);
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

// N units of one tile in registers (loads in flight together): the design before the rings.
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
            b.A0[i] = ldg_nc(tr.w0 + u * W_USTEP<FMT>);
            b.A1[i] = ldg_nc(tr.w1 + u * W_USTEP<FMT>);
            if (FMT == FMT_Q4) {
                b.S0[i] = ldg_nc2(tr.s0 + u * (Q4_SB_UNIT / 8));
                b.S1[i] = ldg_nc2(tr.s1 + u * (Q4_SB_UNIT / 8));
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

#define DG_FULL 0
#define DG_NOW 1   // no weight loads: register values stand in for the weights
#define DG_NOX 2   // no x staging: no norm, block reduction or bf16 staging of x
#define DG_NONE 3  // neither

extern "C" __global__ void diag_empty(int dummy) { pdl_enter(); }

DEVI u32 mix32(u64 i, u32 seed) {
    u64 z = i * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (u32)(z ^ (z >> 31));
}

// Random weight words (any bits are valid 4-bit codes) or, with sb != 0, (scale | bias) words:
// scale in ±0.02, bias in ±0.1 as bf16.
extern "C" __global__ void diag_fill(u32* p, u64 n, u32 seed, int sb) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u32 r = mix32(i, seed);
        if (sb) {
            float s = ((r & 0xffff) / 65536.f - 0.5f) * 0.04f, b = ((r >> 16) / 65536.f - 0.5f) * 0.2f;
            p[i] = pack_bf16(s, b);
        } else {
            p[i] = r;
        }
    }
}

struct DiagMv {
    u64 w, sb, x, norm_w, out;
    int rows, K, kpad, ksplit;
    float eps;
    int pad0, pad1, pad2;
};

// Register values standing in for a weight batch (scale ~0.01, bias ~0.1).
template <int N>
DEVI void fake_batch(Batch<N>& b, u32 seed) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const u32 v = 0x9E3779B9u * (threadIdx.x + 1 + i) + seed;
        b.A0[i] = make_uint4(v, v ^ 0x11111111u, v ^ 0x22222222u, v ^ 0x33333333u);
        b.A1[i] = make_uint4(v ^ 0x44444444u, v ^ 0x55555555u, v ^ 0x66666666u, v ^ 0x77777777u);
        b.S0[i] = make_uint2(0x3dcc3c23u ^ (v & 0x00030003u), 0x3dcc3c23u);
        b.S1[i] = make_uint2(0x3dcc3c23u, 0x3dcc3c23u ^ (v & 0x00030003u));
    }
}

// One block's share of a T = 1 matvec, as gemv_body does it (one segment, no router epilogue):
// first weight batch requested, then `sync` (PDL wait or grid barrier), x staged with the norm
// fused, the units computed, the ksplit partials added through shared memory, rows stored.
template <int MODE, int N, typename Sync>
DEVI void mv_block(u64 w, u64 sb, const float* x, const float* norm_w, float* out, int rows, int K, int kpad, int ksplit,
                   float eps, int wb, Sync sync, u32* xs32, float* xsum, float* red, float* sred) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int tiles = (rows + 15) / 16, nunits = kpad / 128;
    const int tile = wb * (8 / ksplit) + warp / ksplit, ks = warp % ksplit;
    const bool active = tile < tiles;
    const i64 row0 = (i64)tile * 16;
    TileRef tr = tile_ref<FMT_Q4>(w, sb, row0 + g, kpad);
    Batch<N> first;
    if (MODE == DG_NOW || MODE == DG_NONE) {
        fake_batch<N>(first, (u32)wb);
    } else if (active) {
        load_batch<FMT_Q4, N>(first, tr, ks, ksplit, nunits);
    }
    sync();
    if (MODE == DG_FULL || MODE == DG_NOW) stage_x(x, 0, 1, K, kpad, norm_w, eps, xs32, xsum, sred);
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    if (active) {
        const u32* xrow = g == 0 ? xs32 : nullptr;
        const float* xa = t4 == 0 ? xsum : nullptr;
        compute_batch<FMT_Q4, N>(first, ks, ksplit, nunits, xrow, xa, nullptr, 1.f, tot);
        if (MODE == DG_FULL || MODE == DG_NOX) {
            tile_units<FMT_Q4, N>(tr, ks + N * ksplit, ksplit, nunits, xrow, xa, nullptr, 1.f, tot);
        } else {
            for (int u0 = ks + N * ksplit; u0 < nunits; u0 += N * ksplit) {
                Batch<N> b;
                fake_batch<N>(b, (u32)u0);
                compute_batch<FMT_Q4, N>(b, u0, ksplit, nunits, xrow, xa, nullptr, 1.f, tot);
            }
        }
    }
    const bool owner = reduce_ksplit<1>(tot, red, ksplit);
    if (owner && active && t4 == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const i64 r = row0 + g + 8 * i;
            if (r < rows) out[r] = tot[2 * i];
        }
    }
}

#define DIAG_SMEM(kpad)                                                   \
    extern __shared__ __align__(16) unsigned char smem[];                 \
    __shared__ float sred[32];                                            \
    u32* xs32 = (u32*)smem;                                               \
    float* xsum = (float*)(smem + (size_t)(((kpad) + 8) / 2) * 4);        \
    float* red = xsum + (kpad) / 64;

template <int MODE>
DEVI void diag_mv(const DiagMv& a) {
    DIAG_SMEM(a.kpad)
    mv_block<MODE, NB>(a.w, a.sb, (const float*)a.x, (const float*)a.norm_w, (float*)a.out, a.rows, a.K, a.kpad, a.ksplit, a.eps,
                   blockIdx.x, [] { pdl_enter(); }, xs32, xsum, red, sred);
}

extern "C" __global__ void __launch_bounds__(256, 2) diag_mv_full(const DiagMv a) { diag_mv<DG_FULL>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) diag_mv_now(const DiagMv a) { diag_mv<DG_NOW>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) diag_mv_nox(const DiagMv a) { diag_mv<DG_NOX>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) diag_mv_none(const DiagMv a) { diag_mv<DG_NONE>(a); }

// Grid barrier number `target / gridDim.x` on a counter zeroed before the launch. A wait that
// spins ~2^22 times sets *err and every later wait returns at once (no hang if the grid were
// ever not co-resident).
DEVI void grid_barrier(unsigned* ctr, unsigned target, volatile int* err) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(ctr, 1u);
        if (!*err) {
            unsigned v;
            for (int spins = 0;; ++spins) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(ctr) : "memory");
                if (v >= target) break;
                if (spins > (1 << 22)) { *err = 1; break; }
            }
        }
        __threadfence();
    }
    __syncthreads();
}

struct DiagPers {
    u64 w0, sb0, wstride, sbstride;
    u64 buf0, buf1, norm_w, ctr, err;
    int rows, K, kpad, ksplit;
    int n, nwork, mode, pad0;  // mode 0: matvecs + barrier, 1: barrier only, 2: matvecs, no barrier
    float eps;
    int pad1, pad2, pad3;
};

// n matvecs, matvec j reading buf[j & 1] and writing buf[(j + 1) & 1], as the graph chain does.
// N: units per weight batch (gemv's NB = 4; 2 when a warp has only 2 units: same loads).
template <int N>
DEVI void persist_body(const DiagPers& a) {
    DIAG_SMEM(a.kpad)
    for (int j = 0; j < a.n; ++j) {
        auto sync = [&a, j] {
            if (a.mode == 2) __syncthreads();  // no grid barrier, block order only
            else if (j > 0) grid_barrier((unsigned*)a.ctr, (unsigned)j * gridDim.x, (volatile int*)a.err);
        };
        if (a.mode == 1) { sync(); continue; }
        const float* x = (const float*)(j & 1 ? a.buf1 : a.buf0);
        float* out = (float*)(j & 1 ? a.buf0 : a.buf1);
        if ((int)blockIdx.x < a.nwork)
            mv_block<DG_FULL, N>(a.w0 + (u64)j * a.wstride, a.sb0 + (u64)j * a.sbstride, x, (const float*)a.norm_w, out, a.rows, a.K,
                              a.kpad, a.ksplit, a.eps, blockIdx.x, sync, xs32, xsum, red, sred);
        else
            sync();
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) diag_persist(const DiagPers a) { persist_body<NB>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) diag_persist_n2(const DiagPers a) { persist_body<2>(a); }
"#;

const NAMES: &[&str] = &["gemv_q4", "diag_empty", "diag_fill", "diag_mv_full", "diag_mv_now", "diag_mv_nox", "diag_mv_none", "diag_persist", "diag_persist_n2"];

/// Kernels in one step of the 35B decode graph.
const CHAIN: usize = 263;
const K: usize = 2048;
const WARMUP: usize = 20;
const REPS: usize = 200;
const EPS: f32 = 1e-6;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DiagMv {
    w: u64,
    sb: u64,
    x: u64,
    norm_w: u64,
    out: u64,
    rows: i32,
    k: i32,
    kpad: i32,
    ksplit: i32,
    eps: f32,
    pad: [i32; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DiagPers {
    w0: u64,
    sb0: u64,
    wstride: u64,
    sbstride: u64,
    buf0: u64,
    buf1: u64,
    norm_w: u64,
    ctr: u64,
    err: u64,
    rows: i32,
    k: i32,
    kpad: i32,
    ksplit: i32,
    n: i32,
    nwork: i32,
    mode: i32,
    pad0: i32,
    eps: f32,
    pad: [i32; 3],
}

pub fn diag_source() -> String {
    format!("{GEMV_SRC}\n#line 1 \"gpu_kernel_overhead_diag\"\n{DIAG_SRC}")
}

type R<T> = std::result::Result<T, String>;

fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

/// One weight set: CHAIN distinct [rows, K] Q4 matrices back to back.
struct Weights {
    rows: usize,
    w: DevBuf,
    sb: DevBuf,
    wstride: usize,
    sbstride: usize,
}

impl Weights {
    fn new(gpu: &Arc<Gpu>, fill: Kernel, rows: usize, seed: u32) -> R<Weights> {
        let wstride = rows * K / 2;
        let sbstride = rows * (K / 64) * 4;
        let w = DevBuf::alloc(gpu, wstride * CHAIN).map_err(e)?;
        let sb = DevBuf::alloc(gpu, sbstride * CHAIN).map_err(e)?;
        for (buf, is_sb, s) in [(&w, 0i32, seed), (&sb, 1, seed ^ 0x5555)] {
            let (p, n) = (buf.ptr, (buf.bytes / 4) as u64);
            fill.launch_raw(gpu, (4 * gpu.sms as u32, 1, 1), 256, 0, &mut [&p as *const _ as *mut c_void, &n as *const _ as *mut c_void, &s as *const _ as *mut c_void, &is_sb as *const _ as *mut c_void])
                .map_err(e)?;
        }
        Ok(Weights { rows, w, sb, wstride, sbstride })
    }
    fn bytes_per_matrix(&self) -> usize {
        self.wstride + self.sbstride
    }
    fn tiles(&self) -> usize {
        self.rows.div_ceil(16)
    }
    /// The real launch shape (ops::gemv): warps per tile and blocks.
    fn shape(&self, sms: usize) -> (usize, usize) {
        let ks = ops::gemv_launch_ksplit(K / 128, self.tiles(), |_| 2 * sms).unwrap_or_else(|| ops::gemv_ksplit(K / 128));
        (ks, self.tiles().div_ceil(8 / ks))
    }
}

struct Bench {
    gpu: Arc<Gpu>,
    k: std::collections::HashMap<&'static str, Kernel>,
    buf0: DevBuf,
    buf1: DevBuf,
    norm_w: DevBuf,
    x0: Vec<f32>,
    x1: Vec<f32>,
    ctr: DevBuf,
    err: DevBuf,
    smem: u32,
    /// Dynamic shared memory that caps the low-register variants at 2 blocks per SM, as the
    /// register file caps gemv_q4 (so that PDL cannot overlap more than it does for the real one).
    smem_cap: u32,
    pers_blocks: usize,
}

#[derive(Clone)]
struct Row {
    name: String,
    blocks: usize,
    bytes: usize,
    us: f64,
    p10: f64,
    p90: f64,
}

impl Bench {
    fn kern(&self, n: &str) -> Kernel {
        self.k[n]
    }

    fn reset_bufs(&self) -> R<()> {
        self.buf0.upload(0, bytemuck::cast_slice(&self.x0)).map_err(e)?;
        self.buf1.upload(0, bytemuck::cast_slice(&self.x1)).map_err(e)?;
        self.gpu.synchronize().map_err(e)
    }

    fn bufs(&self, j: usize) -> (u64, u64) {
        if j & 1 == 0 { (self.buf0.ptr, self.buf1.ptr) } else { (self.buf1.ptr, self.buf0.ptr) }
    }

    fn gemv_args(&self, w: &Weights, j: usize, ks: usize) -> GemvArgs {
        let (x, out) = self.bufs(j);
        let mut a = GemvArgs::default();
        a.seg[0] = GemvSeg { w: w.w.ptr + (j * w.wstride) as u64, sb: w.sb.ptr + (j * w.sbstride) as u64, rows: w.rows as i32, tiles: w.tiles() as i32, out_col: 0, pad: 0 };
        a.nseg = 1;
        a.x = x;
        a.norm_w = self.norm_w.ptr;
        a.out = out;
        a.k = K as i32;
        a.kpad = K as i32;
        a.t = 1;
        a.ksplit = ks as i32;
        a.eps = EPS;
        a.shared_col = -1;
        a
    }

    fn diag_args(&self, w: &Weights, j: usize, ks: usize) -> DiagMv {
        let (x, out) = self.bufs(j);
        DiagMv {
            w: w.w.ptr + (j * w.wstride) as u64,
            sb: w.sb.ptr + (j * w.sbstride) as u64,
            x,
            norm_w: self.norm_w.ptr,
            out,
            rows: w.rows as i32,
            k: K as i32,
            kpad: K as i32,
            ksplit: ks as i32,
            eps: EPS,
            pad: [0; 3],
        }
    }

    fn pers_args(&self, w: &Weights, mode: i32) -> DiagPers {
        let (ks, blocks) = w.shape(self.gpu.sms as usize);
        DiagPers {
            w0: w.w.ptr,
            sb0: w.sb.ptr,
            wstride: w.wstride as u64,
            sbstride: w.sbstride as u64,
            buf0: self.buf0.ptr,
            buf1: self.buf1.ptr,
            norm_w: self.norm_w.ptr,
            ctr: self.ctr.ptr,
            err: self.err.ptr,
            rows: w.rows as i32,
            k: K as i32,
            kpad: K as i32,
            ksplit: ks as i32,
            n: CHAIN as i32,
            nwork: blocks as i32,
            mode,
            pad0: 0,
            eps: EPS,
            pad: [0; 3],
        }
    }

    /// Enqueues matvec `j` of `w` with kernel `kname` (the real gemv_q4 or a diag variant).
    fn launch_mv(&self, kname: &str, w: &Weights, j: usize, smem: u32) -> R<()> {
        let (ks, blocks) = w.shape(self.gpu.sms as usize);
        let k = self.kern(kname);
        let grid = (blocks as u32, 1, 1);
        if kname == "gemv_q4" {
            // Since run 5 gemv_q4 streams its weights through a shared-memory ring (kernels/gemv.cu).
            // (its own shared-memory layout: ops::gemv_smem, not the replicas' `smem`).
            let a = self.gemv_args(w, j, ks);
            let real = ops::gemv_smem(orchid_cuda::weights::WFormat::Q4, K, 1) as u32;
            k.launch(&self.gpu, grid, 256, real.max(smem), &a).map_err(e)
        } else {
            k.launch(&self.gpu, grid, 256, smem, &self.diag_args(w, j, ks)).map_err(e)
        }
    }

    fn launch_pers(&self, kname: &str, a: &DiagPers) -> R<()> {
        self.ctr.memset0().map_err(e)?;
        self.kern(kname).launch(&self.gpu, (self.pers_blocks as u32, 1, 1), 256, self.smem, a).map_err(e)
    }

    /// A graph of `f`'s launches; f(j) enqueues node j, PDL on for every node after the first.
    fn capture(&self, nodes: usize, pdl: bool, f: &dyn Fn(usize) -> R<()>) -> R<Graph> {
        let mut res = Ok(());
        let g = Graph::capture(&self.gpu, || {
            for j in 0..nodes {
                driver::set_pdl(pdl && j > 0);
                if let Err(x) = f(j) {
                    res = Err(x);
                    break;
                }
            }
            driver::set_pdl(false);
            Ok(())
        });
        driver::set_pdl(false);
        res?;
        g.map_err(e)
    }

    /// Median (p10, p90) µs per replay over REPS replays after WARMUP, an event between replays.
    fn time(&self, g: &Graph) -> R<(f64, f64, f64)> {
        for _ in 0..WARMUP {
            g.launch(&self.gpu).map_err(e)?;
        }
        let evs: Vec<Event> = (0..=REPS).map(|_| Event::new()).collect::<Result<_, _>>().map_err(e)?;
        evs[0].record(&self.gpu).map_err(e)?;
        for ev in &evs[1..] {
            g.launch(&self.gpu).map_err(e)?;
            ev.record(&self.gpu).map_err(e)?;
        }
        self.gpu.synchronize().map_err(e)?;
        let mut t: Vec<f64> = evs.windows(2).map(|w| w[0].elapsed_ms(&w[1]).map(|ms| ms as f64 * 1e3)).collect::<Result<_, _>>().map_err(e)?;
        t.sort_by(f64::total_cmp);
        Ok((t[t.len() / 2], t[t.len() / 10], t[t.len() * 9 / 10]))
    }

    fn row(&self, name: String, blocks: usize, bytes: usize, per: usize, g: &Graph) -> R<Row> {
        let (m, lo, hi) = self.time(g)?;
        let r = Row { name, blocks, bytes, us: m / per as f64, p10: lo / per as f64, p90: hi / per as f64 };
        println!(
            "ROW {:<40} blocks {:>4}  replay {:>8.1} us  per kernel {:>6.2} us (p10 {:.2}, p90 {:.2})  {:>6.0} GB/s",
            r.name,
            r.blocks,
            m,
            r.us,
            r.p10,
            r.p90,
            r.bytes as f64 * per as f64 / (m * 1e-6) / 1e9
        );
        Ok(r)
    }

    fn read(&self, b: &DevBuf) -> R<Vec<f32>> {
        let mut v = vec![0f32; b.bytes / 4];
        b.download(0, bytemuck::cast_slice_mut(&mut v)).map_err(e)?;
        Ok(v)
    }

    fn err_flag(&self) -> R<i32> {
        let mut v = [0i32; 4];
        self.err.download(0, bytemuck::cast_slice_mut(&mut v)).map_err(e)?;
        Ok(v[0])
    }
}

fn rng_vec(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn run() -> R<Vec<Row>> {
    let gpu = Gpu::new(0).map_err(e)?;
    let target = orchid_cuda::compile::target_for(gpu.cc);
    let t0 = std::time::Instant::now();
    let cubin = orchid_cuda::compile::compile("gemv_diag", &diag_source(), &target).map_err(e)?;
    let k: std::collections::HashMap<_, _> = driver::load_module(&gpu, &cubin, NAMES).map_err(e)?.into_iter().map(|k| (k.name, k)).collect();
    println!("{} ({} SMs, cc {}.{}), {target}, kernels compiled and loaded in {:.1}s", gpu.name, gpu.sms, gpu.cc.0, gpu.cc.1, t0.elapsed().as_secs_f64());
    let sms = gpu.sms as usize;
    let smem = (K + 8) * 2 + (K / 64) * 4 + 8 * 32 * 4 * 4; // as ops::gemv for T = 1
    let occ = |n: &str, smem: usize| -> R<i32> {
        let mut v = 0i32;
        // SAFETY: live function handle, valid out-pointer.
        let r = unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut v, k[n].f, 256, smem) };
        if r != sys::CUresult::CUDA_SUCCESS { Err(format!("occupancy query {n}: {r:?}")) } else { Ok(v) }
    };
    let per_sm = occ("diag_persist_n2", smem)?.min(occ("diag_persist", smem)?);
    if per_sm < 1 {
        return Err("persistent kernel: 0 blocks/SM".into());
    }
    let mut smem_cap = smem;
    while (occ("diag_mv_now", smem_cap)? > 2 || occ("diag_mv_none", smem_cap)? > 2) && smem_cap + 1024 <= gpu.max_smem_optin as usize {
        smem_cap += 1024;
    }
    let mut regs = Vec::new();
    for n in ["gemv_q4", "diag_mv_full", "diag_mv_now", "diag_mv_nox", "diag_mv_none", "diag_persist", "diag_persist_n2"] {
        let mut v = 0;
        // SAFETY: as above.
        unsafe { sys::cuFuncGetAttribute(&mut v, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS, k[n].f) };
        regs.push(format!("{n} {v} regs {}/SM", occ(n, smem)?));
    }
    println!("smem {smem} B: {}; with {smem_cap} B: now {}/SM, none {}/SM", regs.join(", "), occ("diag_mv_now", smem_cap)?, occ("diag_mv_none", smem_cap)?);
    let b = Bench {
        buf0: DevBuf::alloc(&gpu, 16384 * 4).map_err(e)?,
        buf1: DevBuf::alloc(&gpu, 16384 * 4).map_err(e)?,
        norm_w: DevBuf::from_slice(&gpu, &rng_vec(3, K, 0.8, 1.2)).map_err(e)?,
        x0: rng_vec(1, 16384, -1.0, 1.0),
        x1: rng_vec(2, 16384, -1.0, 1.0),
        ctr: DevBuf::zeros(&gpu, 64).map_err(e)?,
        err: DevBuf::zeros(&gpu, 64).map_err(e)?,
        smem: smem as u32,
        smem_cap: smem_cap as u32,
        pers_blocks: per_sm.min(2) as usize * sms,
        k,
        gpu: gpu.clone(),
    };
    let sm = b.smem;
    let fill = b.kern("diag_fill");
    let sizes = [(1024usize, "1/4"), (4096, "1x"), (16384, "4x")];
    let ws: Vec<Weights> = sizes.iter().enumerate().map(|(i, &(rows, _))| Weights::new(&gpu, fill, rows, 17 + i as u32)).collect::<R<_>>()?;
    gpu.synchronize().map_err(e)?;
    for (w, (_, lab)) in ws.iter().zip(&sizes) {
        let (ks, blocks) = w.shape(sms);
        if blocks > b.pers_blocks {
            return Err(format!("{blocks} blocks of work > {} resident blocks", b.pers_blocks));
        }
        println!(
            "weights {lab}: {} x {K}, {:.2} MB per matrix, {:.2} GB for the chain, ksplit {ks}, {blocks} blocks, {} units per warp",
            w.rows,
            w.bytes_per_matrix() as f64 / 1e6,
            (w.bytes_per_matrix() * CHAIN) as f64 / 1e9,
            K / 128 / ks
        );
    }

    // Checks. (a) the replica computes what gemv_q4 computes, bit for bit.
    let w1 = &ws[1];
    {
        b.reset_bufs()?;
        b.launch_mv("gemv_q4", w1, 0, sm)?;
        gpu.synchronize().map_err(e)?;
        let real = b.read(&b.buf1)?;
        b.reset_bufs()?;
        b.launch_mv("diag_mv_full", w1, 0, sm)?;
        gpu.synchronize().map_err(e)?;
        let rep = b.read(&b.buf1)?;
        let same = real[..w1.rows].iter().zip(&rep[..w1.rows]).all(|(a, c)| a.to_bits() == c.to_bits());
        let finite = real[..w1.rows].iter().all(|v| v.is_finite());
        let changed = real[..w1.rows].iter().zip(&b.x1).filter(|(a, c)| a.to_bits() != c.to_bits()).count();
        let rms = (real[..w1.rows].iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / w1.rows as f64).sqrt();
        println!("check replica vs gemv_q4 (one matvec): bit-identical {same}, finite {finite}, rows written {changed}/{}, rms {rms:.3}", w1.rows);
        if !same || !finite || changed < w1.rows - 2 {
            println!("CHECK FAILED: replica (timings still taken)");
        }
    }
    // (b) the persistent kernels (barrier) reproduce the 263-step graph chain bit for bit, every size.
    let mut chain_graphs = Vec::new();
    for w in &ws {
        let g = b.capture(CHAIN, true, &|j| b.launch_mv("gemv_q4", w, j, sm))?;
        b.reset_bufs()?;
        g.launch(&gpu).map_err(e)?;
        gpu.synchronize().map_err(e)?;
        let (c0, c1) = (b.read(&b.buf0)?, b.read(&b.buf1)?);
        for pk in ["diag_persist_n2", "diag_persist"] {
            let pa = b.pers_args(w, 0);
            let pg = b.capture(1, false, &|_| b.launch_pers(pk, &pa))?;
            b.reset_bufs()?;
            pg.launch(&gpu).map_err(e)?;
            gpu.synchronize().map_err(e)?;
            let (p0, p1) = (b.read(&b.buf0)?, b.read(&b.buf1)?);
            let same = c0.iter().chain(&c1).zip(p0.iter().chain(&p1)).all(|(a, c)| a.to_bits() == c.to_bits());
            let finite = c1[..w.rows].iter().all(|v| v.is_finite());
            let errf = b.err_flag()?;
            println!("check {pk} vs graph chain, {} rows, 263 steps: bit-identical {same}, finite {finite}, barrier timeouts {errf}", w.rows);
            if !same || !finite || errf != 0 {
                println!("CHECK FAILED: {pk} (its timings are not a valid barrier)");
            }
        }
        chain_graphs.push(g);
    }

    // Clocks up before the first (short) timed rows: ~1 s of the 4x chain.
    let t1 = std::time::Instant::now();
    while t1.elapsed().as_secs_f64() < 1.0 {
        for _ in 0..50 {
            chain_graphs[2].launch(&gpu).map_err(e)?;
        }
        gpu.synchronize().map_err(e)?;
    }
    let mut rows = Vec::new();
    // 1. Empty kernels.
    for (blocks, lab) in [(1usize, "1 block"), (2 * sms, "2xSMs blocks")] {
        for pdl in [false, true] {
            let z = 0i32;
            let kk = b.kern("diag_empty");
            let g = b.capture(CHAIN, pdl, &|_| kk.launch_raw(&gpu, (blocks as u32, 1, 1), 256, 0, &mut [&z as *const _ as *mut c_void]).map_err(e))?;
            rows.push(b.row(format!("empty, {lab}, {}", if pdl { "PDL" } else { "no PDL" }), blocks, 0, CHAIN, &g)?);
        }
    }
    // 2./3. Matvec chains (PDL unless said).
    for (i, (w, (_, lab))) in ws.iter().zip(&sizes).enumerate() {
        let (_, blocks) = w.shape(sms);
        let by = w.bytes_per_matrix();
        rows.push(b.row(format!("gemv_q4 {lab}"), blocks, by, CHAIN, &chain_graphs[i])?);
        if i == 1 {
            let g = b.capture(CHAIN, false, &|j| b.launch_mv("gemv_q4", w, j, sm))?;
            rows.push(b.row(format!("gemv_q4 {lab}, no PDL"), blocks, by, CHAIN, &g)?);
        }
        let variants = [
            ("diag_mv_full", "replica", by, sm),
            ("diag_mv_nox", "no x staging", by, sm),
            ("diag_mv_now", "no weight loads, 2/SM", 0, b.smem_cap),
            ("diag_mv_none", "neither, 2/SM", 0, b.smem_cap),
            ("diag_mv_now", "no weight loads, natural occupancy", 0, sm),
            ("diag_mv_none", "neither, natural occupancy", 0, sm),
        ];
        for (kn, what, bytes, smem) in variants {
            let g = b.capture(CHAIN, true, &|j| b.launch_mv(kn, w, j, smem))?;
            rows.push(b.row(format!("{what} {lab}"), blocks, bytes, CHAIN, &g)?);
        }
    }
    // 4. Persistent kernel (2 units per weight batch: the same loads as gemv at 1/4 and 1x).
    let pa = b.pers_args(&ws[1], 1);
    let g = b.capture(1, false, &|_| b.launch_pers("diag_persist_n2", &pa))?;
    rows.push(b.row("persistent: 263 grid barriers only".into(), b.pers_blocks, 0, CHAIN, &g)?);
    for (i, (w, (_, lab))) in ws.iter().zip(&sizes).enumerate() {
        let mut vs = vec![("diag_persist_n2", 0, "barrier"), ("diag_persist_n2", 2, "NO barrier (wrong results)")];
        if i == 2 {
            vs.push(("diag_persist", 0, "barrier, 4-unit batches (spills)"));
        }
        for (pk, mode, what) in vs {
            let pa = b.pers_args(w, mode);
            let g = b.capture(1, false, &|_| b.launch_pers(pk, &pa))?;
            rows.push(b.row(format!("persistent {lab}, {what}"), b.pers_blocks, w.bytes_per_matrix(), CHAIN, &g)?);
        }
    }
    if b.err_flag()? != 0 {
        println!("CHECK FAILED: a grid barrier timed out: the persistent rows are not valid");
    }
    // Noise: the first matvec row again.
    rows.push(b.row("gemv_q4 1x (again)".into(), ws[1].shape(sms).1, ws[1].bytes_per_matrix(), CHAIN, &chain_graphs[1])?);
    Ok(rows)
}

#[test]
#[ignore = "diagnostic for the GPU machine: scripts/gpu-overhead.sh"]
fn kernel_overhead() {
    if let Err(why) = orchid_cuda::probe() {
        println!("skipped: no GPU ({why})");
        return;
    }
    let rows = run().unwrap_or_else(|x| panic!("{x}"));
    println!("\n| chain of {CHAIN} (graph, median of {REPS} replays) | blocks | MB/kernel | µs per kernel | p10–p90 |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!("| {} | {} | {:.2} | **{:.2}** | {:.2}–{:.2} |", r.name, r.blocks, r.bytes as f64 / 1e6, r.us, r.p10, r.p90);
    }
}

/// The diagnostic kernels compile with NVRTC for sm_90a (runs wherever NVRTC is found).
#[test]
fn diag_kernels_compile() {
    // SAFETY: probing only opens the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } || orchid_cuda::compile::include_dirs().is_empty() {
        println!("skipped: libnvrtc or the CUDA headers not found");
        return;
    }
    let dir = std::env::temp_dir().join(format!("orchid-diag-test-{}", std::process::id()));
    // SAFETY: only this test of the file reads the variable; it redirects the cache.
    unsafe { std::env::set_var("ORCHID_KERNEL_CACHE", &dir) };
    if let Ok(p) = std::env::var("ORCHID_DIAG_DUMP") {
        std::fs::write(p, format!("{}\n{}", orchid_cuda::compile::COMMON, diag_source())).unwrap();
    }
    let cubin = orchid_cuda::compile::compile("gemv_diag", &diag_source(), "sm_90a").unwrap_or_else(|x| panic!("{x}"));
    assert_eq!(&cubin[..4], b"\x7fELF");
    println!("gemv_diag: {} bytes", cubin.len());
    let _ = std::fs::remove_dir_all(&dir);
}
