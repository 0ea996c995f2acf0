// Gated DeltaNet (model-spec §3.6–3.7): causal conv, L2 norms and gates, the delta rule on an
// fp32 state (chunked for prefill, fused single-token kernel for decode), gated RMSNorm.
//
// Shapes: T tokens, C = 2·Hk·dk + Hv·dv conv channels (q | k | v), KC conv taps, value head j
// reads key head j / (Hv/Hk). State S_j [dk][dv] fp32 row-major. The conv state holds the last
// KC-1 pre-conv rows [KC-1][C] in two buffers; a span starting at position p reads buffer p&1 and
// writes buffer (p+len)&1, so no kernel overwrites what another block may still read.

struct ConvArgs {
    u64 x, w, state_in, state_out, out;
    int T, C, KC, ldx;
};

// out[t, ch] = silu(Σ_tap w[ch, tap] · window[t + tap]) over [state ; x]; writes the new state
// (the last KC-1 window rows, also when T < KC-1). grid = (ceil(C/256), max(T, KC-1)).
extern "C" __global__ void __launch_bounds__(256) gdn_conv(const ConvArgs a) {
    const int ch = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (ch >= a.C) return;
    const int KC = a.KC, C = a.C;
    const float* x = (const float*)a.x;
    const float* st = (const float*)a.state_in;
    auto win = [&](int idx) -> float { return idx < KC - 1 ? st[(i64)idx * C + ch] : x[(i64)(idx - (KC - 1)) * a.ldx + ch]; };
    if (t < a.T) {
        float s = 0.f;
        for (int tap = 0; tap < KC; ++tap) s += ((const float*)a.w)[ch * KC + tap] * win(t + tap);
        ((float*)a.out)[(i64)t * C + ch] = siluf_(s);
    }
    if (t < KC - 1) ((float*)a.state_out)[(i64)t * C + ch] = win(a.T + t);
}

struct GdnPrepArgs {
    u64 x, b, a, a_log, dt_bias, beta, gdec;
    int T, Hk, Hv, dk;
    int ldb, lda, C, pad;
};

// In place on the conv output x [T, C]: L2-normalise q and k per key head, scale q by 1/sqrt(dk);
// beta[t, j] = sigmoid(b), gdec[t, j] = -exp(A_log)·softplus(a + dt_bias). grid = T, block 128.
extern "C" __global__ void __launch_bounds__(128) gdn_prep(const GdnPrepArgs p) {
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* row = (float*)p.x + (i64)t * p.C;
    const int key_dim = p.Hk * p.dk;
    const float qs = 1.f / sqrtf((float)p.dk);
    for (int task = warp; task < 2 * p.Hk; task += 4) {
        float* v = row + (task < p.Hk ? task * p.dk : key_dim + (task - p.Hk) * p.dk);
        float ss = 0.f;
        for (int e = lane; e < p.dk; e += 32) ss += v[e] * v[e];
        ss = warp_sum(ss);
        const float inv = 1.f / sqrtf(ss + 1e-6f);
        for (int e = lane; e < p.dk; e += 32) v[e] = task < p.Hk ? (v[e] * inv) * qs : v[e] * inv;
    }
    for (int j = threadIdx.x; j < p.Hv; j += blockDim.x) {
        float bb = ((const float*)p.b)[(i64)t * p.ldb + j], aa = ((const float*)p.a)[(i64)t * p.lda + j];
        ((float*)p.beta)[(i64)t * p.Hv + j] = 1.f / (1.f + expf(-bb));
        ((float*)p.gdec)[(i64)t * p.Hv + j] = -expf(((const float*)p.a_log)[j]) * softplusf_(aa + ((const float*)p.dt_bias)[j]);
    }
}

struct ChunkArgs {
    u64 x, beta, gdec, state, out;
    int T, Hk, Hv, dk;
    int dv, C, cw, pad;
};

#define CHUNK 64

// The chunked delta rule for one value head and a slice of cw state columns (model-spec §3.7).
// grid = (Hv, dv / cw), block 256. out [T, Hv*dv] (pre-norm); the state is updated in place.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk(const ChunkArgs a) {
    extern __shared__ __align__(16) float sm[];
    const int j = blockIdx.x, col0 = blockIdx.y * a.cw, cw = a.cw;
    const int dk = a.dk, dv = a.dv, kh = j / (a.Hv / a.Hk), key_dim = a.Hk * dk;
    const int KS = dk + 1, VS = cw + 1;
    float* Ks = sm;                       // [64][KS]
    float* Qs = Ks + CHUNK * KS;          // [64][KS]
    float* Ws = Qs + CHUNK * KS;          // [64][KS]
    float* Am = Ws + CHUNK * KS;          // [64][65]
    float* QK = Am + CHUNK * 65;          // [64][65]
    float* Us = QK + CHUNK * 65;          // [64][VS]  U, then Vn
    float* Vs = Us + CHUNK * VS;          // [64][VS]
    float* Ss = Vs + CHUNK * VS;          // [dk][VS]
    float* bet = Ss + dk * VS;            // [64]
    float* gam = bet + CHUNK;             // [64]
    float* fac = gam + CHUNK;             // [64]
    const int tid = threadIdx.x;
    float* S = (float*)a.state + (i64)j * dk * dv;
    for (int i = tid; i < dk * cw; i += 256) Ss[(i / cw) * VS + i % cw] = S[(i / cw) * dv + col0 + i % cw];
    const float* X = (const float*)a.x;
    for (int t0 = 0; t0 < a.T; t0 += CHUNK) {
        const int L = min(CHUNK, a.T - t0);
        __syncthreads();
        for (int i = tid; i < CHUNK * dk; i += 256) {
            int r = i / dk, d = i % dk;
            bool ok = r < L;
            const float* row = X + (i64)(t0 + r) * a.C;
            Qs[r * KS + d] = ok ? row[kh * dk + d] : 0.f;
            Ks[r * KS + d] = ok ? row[key_dim + kh * dk + d] : 0.f;
        }
        for (int i = tid; i < CHUNK * cw; i += 256) {
            int r = i / cw, c = i % cw;
            Vs[r * VS + c] = r < L ? X[(i64)(t0 + r) * a.C + 2 * key_dim + j * dv + col0 + c] : 0.f;
        }
        if (tid < CHUNK) {
            bet[tid] = tid < L ? ((const float*)a.beta)[(i64)(t0 + tid) * a.Hv + j] : 0.f;
            gam[tid] = tid < L ? ((const float*)a.gdec)[(i64)(t0 + tid) * a.Hv + j] : 0.f;
        }
        __syncthreads();
        if (tid == 0) {
            float acc = 0.f;
            for (int i = 0; i < CHUNK; ++i) { acc += gam[i]; gam[i] = acc; }
        }
        __syncthreads();
        // A[i][m] = β_i (k_i·k_m) e^{γ_i−γ_m} (m < i);  QK[i][m] = (q_i·k_m) e^{γ_i−γ_m} (m ≤ i).
        // 4x4 output tiles per thread (16 x 16 tiles); tiles above the diagonal are zero.
        {
            const int i0 = (tid >> 4) * 4, m0 = (tid & 15) * 4;
            float kk[4][4], qk[4][4];
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) kk[r][c] = qk[r][c] = 0.f;
            if (m0 <= i0 + 3) {
                for (int d = 0; d < dk; ++d) {
                    float ki[4], qi[4], km[4];
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        ki[r] = Ks[(i0 + r) * KS + d];
                        qi[r] = Qs[(i0 + r) * KS + d];
                        km[r] = Ks[(m0 + r) * KS + d];
                    }
#pragma unroll
                    for (int r = 0; r < 4; ++r)
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            kk[r][c] += ki[r] * km[c];
                            qk[r][c] += qi[r] * km[c];
                        }
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    int i = i0 + r, m = m0 + c;
                    float dec = m <= i ? expf(gam[i] - gam[m]) : 0.f;
                    Am[i * 65 + m] = m < i ? bet[i] * kk[r][c] * dec : 0.f;
                    QK[i * 65 + m] = m <= i ? qk[r][c] * dec : 0.f;
                }
        }
        __syncthreads();
        // Forward substitution: (I + A) U = βV, (I + A) W = β e^γ K, row by row.
        const int ncol = cw + dk;
        for (int i = 0; i < L; ++i) {
            for (int c = tid; c < ncol; c += 256) {
                const float* ar = Am + i * 65;
                if (c < cw) {
                    float u = bet[i] * Vs[i * VS + c];
                    for (int m = 0; m < i; ++m) u -= ar[m] * Us[m * VS + c];
                    Us[i * VS + c] = u;
                } else {
                    int d = c - cw;
                    float w = bet[i] * expf(gam[i]) * Ks[i * KS + d];
                    for (int m = 0; m < i; ++m) w -= ar[m] * Ws[m * KS + d];
                    Ws[i * KS + d] = w;
                }
            }
            __syncthreads();
        }
        // Rows ≥ L of U and W are zero (β = 0 there), so Vn is zero there too.
        for (int i = L + tid; i < CHUNK; i += 256) {
            for (int c = 0; c < cw; ++c) Us[i * VS + c] = 0.f;
            for (int d = 0; d < dk; ++d) Ws[i * KS + d] = 0.f;
        }
        __syncthreads();
        // Output tiles of 2 rows x 4 columns (cw = 32) or 1 x 4 (cw = 16).
        const int cg = cw / 4, rpt = (CHUNK * cg) / 256;  // column groups, rows per thread
        const int r0 = (tid / cg) * rpt, cc = (tid % cg) * 4;
        // Vn = U − W·S, kept in registers, then written over U.
        float vn[2][4];
        {
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) vn[r][c] = 0.f;
            for (int d = 0; d < dk; ++d) {
                float sv[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) sv[c] = Ss[d * VS + cc + c];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (r < rpt) {
                        float w = Ws[(r0 + r) * KS + d];
#pragma unroll
                        for (int c = 0; c < 4; ++c) vn[r][c] += w * sv[c];
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    if (r < rpt) vn[r][c] = Us[(r0 + r) * VS + cc + c] - vn[r][c];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (r < rpt) Us[(r0 + r) * VS + cc + c] = vn[r][c];
        __syncthreads();
        // O_i = e^{γ_i} q_i·S + Σ_{m≤i} QK[i][m] Vn_m  (QK is zero above the diagonal).
        {
            float qs[2][4], qv[2][4];
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) qs[r][c] = qv[r][c] = 0.f;
            for (int d = 0; d < dk; ++d) {
                float sv[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) sv[c] = Ss[d * VS + cc + c];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (r < rpt) {
                        float q = Qs[(r0 + r) * KS + d];
#pragma unroll
                        for (int c = 0; c < 4; ++c) qs[r][c] += q * sv[c];
                    }
                }
            }
            for (int m = 0; m < CHUNK; ++m) {
                float v[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) v[c] = Us[m * VS + cc + c];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (r < rpt) {
                        float w = QK[(r0 + r) * 65 + m];
#pragma unroll
                        for (int c = 0; c < 4; ++c) qv[r][c] += w * v[c];
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                int i = r0 + r;
                if (r < rpt && i < L) {
                    float eg = expf(gam[i]);
                    float* orow = (float*)a.out + (i64)(t0 + i) * a.Hv * dv + j * dv + col0;
#pragma unroll
                    for (int c = 0; c < 4; ++c) orow[cc + c] = eg * qs[r][c] + qv[r][c];
                }
            }
        }
        __syncthreads();
        // S ← e^{γ_last} S + Σ_m e^{γ_last−γ_m} k_m ⊗ Vn_m, 4x4 tiles of [dk][cw].
        const float gl = gam[L - 1], el = expf(gl);
        if (tid < CHUNK) fac[tid] = tid < L ? expf(gl - gam[tid]) : 0.f;
        __syncthreads();
        {
            const int d0 = (tid / cg) * 4;
            if (d0 < dk) {
                float acc[4][4];
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[r][c] = el * Ss[(d0 + r) * VS + cc + c];
                for (int m = 0; m < L; ++m) {
                    float kv[4], v[4];
#pragma unroll
                    for (int r = 0; r < 4; ++r) kv[r] = fac[m] * Ks[m * KS + d0 + r];
#pragma unroll
                    for (int c = 0; c < 4; ++c) v[c] = Us[m * VS + cc + c];
#pragma unroll
                    for (int r = 0; r < 4; ++r)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[r][c] += kv[r] * v[c];
                }
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c) Ss[(d0 + r) * VS + cc + c] = acc[r][c];  // own tile only
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < dk * cw; i += 256) S[(i / cw) * dv + col0 + i % cw] = Ss[(i / cw) * VS + i % cw];
}

struct GNormArgs {
    u64 core, z, w, out;
    int T, Hv, dv, ldz;
    float eps;
    int pad0;
};

// out[t, j·dv + c] = w[c] · core / rms(core over the head) · silu(z). One warp per (t, head).
extern "C" __global__ void __launch_bounds__(128) gdn_gated_norm(const GNormArgs a) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 task = (i64)blockIdx.x * 4 + warp;
    if (task >= (i64)a.T * a.Hv) return;
    const int t = task / a.Hv, j = task % a.Hv;
    const float* o = (const float*)a.core + (i64)t * a.Hv * a.dv + j * a.dv;
    const float* z = (const float*)a.z + (i64)t * a.ldz + j * a.dv;
    float ss = 0.f;
    for (int c = lane; c < a.dv; c += 32) ss += o[c] * o[c];
    ss = warp_sum(ss);
    const float inv = 1.f / sqrtf(ss / a.dv + a.eps);
    float* y = (float*)a.out + (i64)t * a.Hv * a.dv + j * a.dv;
    for (int c = lane; c < a.dv; c += 32) y[c] = o[c] * inv * ((const float*)a.w)[c] * siluf_(z[c]);
}

struct GdnDecodeArgs {
    u64 qkv, z, b, a, conv_w, conv_state, a_log, dt_bias, norm_w, state, out, pos_ptr;
    int Hk, Hv, dk, dv;
    int KC, C, pos, pad;
    float eps, pad1;
};

#define GDN_MAXR 32
#define GDN_THREADS 512

// One decode token, one value head per block (512 threads): conv + SiLU of the head's q/k/v
// channels, L2 norms, gates, the delta rule on the state held in registers (each thread one
// column and every RG-th row), output and gated RMSNorm.
extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_decode(const GdnDecodeArgs a) {
    __shared__ float vals[3 * 256];
    __shared__ float red[32];
    __shared__ float part[GDN_THREADS];
    const int j = blockIdx.x, tid = threadIdx.x;
    const int dk = a.dk, dv = a.dv, C = a.C, KC = a.KC, rvk = a.Hv / a.Hk, kh = j / rvk, key_dim = a.Hk * dk;
    const int pos = a.pos_ptr ? *(const int*)a.pos_ptr : a.pos;
    const float* st_in = (const float*)a.conv_state + (i64)(pos & 1) * (KC - 1) * C;
    float* st_out = (float*)a.conv_state + (i64)((pos + 1) & 1) * (KC - 1) * C;
    const float* x = (const float*)a.qkv;
    // The state (the kernel's main traffic) is requested first, so that its loads overlap the
    // conv and norm phase. Thread (column c, row group rg) holds rows rg, rg + RG, ...
    const int RG = GDN_THREADS / dv;
    const int c = tid % dv, rg = tid / dv;
    const bool act = rg < RG;
    float* S = (float*)a.state + (i64)j * dk * dv;
    float s[GDN_MAXR];
#pragma unroll
    for (int m = 0; m < GDN_MAXR; ++m) {
        int i = rg + m * RG;
        s[m] = (act && i < dk) ? S[(i64)i * dv + c] : 0.f;
    }
    // The state and the position were last written by the previous decode step (a previous graph
    // launch); everything below reads this step's projections.
    pdl_enter();
    // Conv of q (dk), k (dk), v (dv) channels of this head -> vals.
    const int nch = 2 * dk + dv;
    for (int i = tid; i < nch; i += GDN_THREADS) {
        int ch = i < dk ? kh * dk + i : i < 2 * dk ? key_dim + kh * dk + (i - dk) : 2 * key_dim + j * dv + (i - 2 * dk);
        const float* w = (const float*)a.conv_w + (i64)ch * KC;
        float s = 0.f;
        for (int tap = 0; tap < KC - 1; ++tap) s += w[tap] * st_in[(i64)tap * C + ch];
        float xv = x[ch];
        s += w[KC - 1] * xv;
        vals[i] = siluf_(s);
        bool owner = i < 2 * dk ? (j % rvk == 0) : true;
        if (owner) {
            for (int r = 0; r + 1 < KC - 1; ++r) st_out[(i64)r * C + ch] = st_in[(i64)(r + 1) * C + ch];
            if (KC > 1) st_out[(i64)(KC - 2) * C + ch] = xv;
        }
    }
    __syncthreads();
    float* q = vals;
    float* k = vals + dk;
    float* v = vals + 2 * dk;
    float sq = 0.f, sk = 0.f;
    for (int i = tid; i < dk; i += GDN_THREADS) { sq += q[i] * q[i]; sk += k[i] * k[i]; }
    sq = block_sum(sq, red);
    sk = block_sum(sk, red);
    const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f), qs = 1.f / sqrtf((float)dk);
    __syncthreads();
    for (int i = tid; i < dk; i += GDN_THREADS) { q[i] = (q[i] * iq) * qs; k[i] = k[i] * ik; }
    const float beta = 1.f / (1.f + expf(-((const float*)a.b)[j]));
    const float g = -expf(((const float*)a.a_log)[j]) * softplusf_(((const float*)a.a)[j] + ((const float*)a.dt_bias)[j]);
    const float alpha = expf(g);
    __syncthreads();
    float mem = 0.f;
#pragma unroll
    for (int m = 0; m < GDN_MAXR; ++m) {
        int i = rg + m * RG;
        if (act && i < dk) {
            s[m] *= alpha;
            mem += k[i] * s[m];
        }
    }
    part[tid] = act ? mem : 0.f;
    __syncthreads();
    float r = 0.f;
    if (act) for (int q2 = 0; q2 < RG; ++q2) r += part[q2 * dv + c];
    const float delta = act ? (v[c] - r) * beta : 0.f;
    float o = 0.f;
#pragma unroll
    for (int m = 0; m < GDN_MAXR; ++m) {
        int i = rg + m * RG;
        if (act && i < dk) {
            s[m] += k[i] * delta;
            S[(i64)i * dv + c] = s[m];
            o += q[i] * s[m];
        }
    }
    __syncthreads();
    part[tid] = act ? o : 0.f;
    __syncthreads();
    float oc = 0.f;
    if (act && rg == 0) for (int q2 = 0; q2 < RG; ++q2) oc += part[q2 * dv + c];
    float ss = block_sum(act && rg == 0 ? oc * oc : 0.f, red);
    const float inv = 1.f / sqrtf(ss / dv + a.eps);
    if (act && rg == 0) {
        float zz = ((const float*)a.z)[j * dv + c];
        ((float*)a.out)[j * dv + c] = oc * inv * ((const float*)a.norm_w)[c] * siluf_(zz);
    }
}
