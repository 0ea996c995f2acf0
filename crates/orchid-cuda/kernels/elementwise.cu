// Row-wise norms, residual adds, SwiGLU, zero fills, embedding lookup and row gathers.
// Shapes: x [T, n] f32 row-major; w [n] f32 multipliers.

// y = x / sqrt(mean(x²) + eps) · w. One block per row.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                    int n, float eps) {
    pdl_enter();
    __shared__ float red[32];
    const float* xr = x + (i64)blockIdx.x * n;
    float* yr = y + (i64)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    float inv = 1.f / sqrtf(ss / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

// x += r; y = rms_norm(x) · w. One block per row.
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ r, const float* __restrict__ w,
                                        float* __restrict__ y, int n, float eps) {
    pdl_enter();
    __shared__ float red[32];
    float* xr = x + (i64)blockIdx.x * n;
    const float* rr = r + (i64)blockIdx.x * n;
    float* yr = y + (i64)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i] + rr[i];
        xr[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, red);
    float inv = 1.f / sqrtf(ss / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

// x[i] += y[i] over n elements.
extern "C" __global__ void add_assign(float* __restrict__ x, const float* __restrict__ y, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) x[i] += y[i];
}

// x[i] = 0 over n 32-bit words (a kernel rather than a memset, so that it takes part in the
// decode graphs' launch chaining).
extern "C" __global__ void zero_words(u32* __restrict__ x, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) x[i] = 0u;
}

// out = silu(g) · u over n elements.
extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out, i64 n) {
    pdl_enter();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float a = g[i];
        out[i] = a / (1.f + expf(-a)) * u[i];
    }
}

// out[i, :] = x[rows[i], :] for i < nrows.  grid.x = nrows.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const int* __restrict__ rows, float* __restrict__ out, int n) {
    pdl_enter();
    const float* src = x + (i64)rows[blockIdx.x] * n;
    float* dst = out + (i64)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// Dequantized value (s·q + b, rounded as the CPU does) of element k of row r of a Q4 weight.
DEVI float q4_element(const u32* __restrict__ w, const u32* __restrict__ sb, int kpad, i64 r, int k) {
    int unit = k >> 7, j = (k >> 6) & 1, kl = k & 63;
    int s = kl >> 4, rem = kl & 15, hi8 = rem >> 3, t = (rem & 7) >> 1, h = rem & 1;
    int word = unit * 16 + t * 4 + 2 * j + (s >> 1);
    int p = 2 * (s & 1) + hi8;
    u32 wv = w[q4_offset(r, unit, kpad) / 4 + (word & 15)];
    int q = (wv >> (4 * (h ? p + 4 : p))) & 15;
    u32 sbv = sb[q4_sb_offset(r, unit, kpad) / 4 + j];
    return __fadd_rn(__fmul_rn(bf16_lo(sbv), (float)q), bf16_hi(sbv));
}

// Embedding rows of a Q4 table: out[i, k] = W[ids[i], k].  grid.x = T.
extern "C" __global__ void embed_q4(const u32* __restrict__ w, const u32* __restrict__ sb, const int* __restrict__ ids,
                                    float* __restrict__ out, int n, int kpad) {
    pdl_enter();
    i64 r = ids[blockIdx.x];
    float* dst = out + (i64)blockIdx.x * n;
    for (int k = threadIdx.x; k < n; k += blockDim.x) dst[k] = q4_element(w, sb, kpad, r, k);
}

// Embedding rows of a bf16 table (row stride kpad).
extern "C" __global__ void embed_bf16(const __nv_bfloat16* __restrict__ w, const int* __restrict__ ids,
                                      float* __restrict__ out, int n, int kpad) {
    pdl_enter();
    i64 r = ids[blockIdx.x];
    float* dst = out + (i64)blockIdx.x * n;
    for (int k = threadIdx.x; k < n; k += blockDim.x) dst[k] = __bfloat162float(w[r * kpad + k]);
}
