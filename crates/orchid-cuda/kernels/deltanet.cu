// Gated DeltaNet (docs/model.md §5): causal conv, L2 norms and gates, the delta rule on an
// fp32 state (chunked for prefill, fused single-token kernel for decode), gated RMSNorm.
//
// Shapes: T tokens, C = 2·Hk·dk + Hv·dv conv channels (q | k | v), KC conv taps, value head j
// reads key head j / (Hv/Hk). State S_j [dk][dv] fp32 row-major. The conv state holds the last
// KC-1 pre-conv rows [KC-1][C] in two buffers; a span starting at position p reads buffer p&1 and
// writes buffer (p+len)&1, so no kernel overwrites what another block may still read.

// A batched launch (spans != 0) runs one sequence's span per grid z (GdnSpan, built by
// layers.rs): its rows of the step's tensors, its conv buffers, recurrent state and scratch.
DEVI ConvArgs conv_span(ConvArgs a) {
    if (a.spans) {
        const GdnSpan s = ((const GdnSpan*)a.spans)[blockIdx.z];
        a.x += (u64)s.row0 * a.ldx * 4;
        a.out += (u64)s.row0 * a.C * 4;
        a.state_in = s.conv_in;
        a.state_out = s.conv_out;
        a.T = s.T;
    }
    return a;
}

DEVI ChunkArgs chunk_span(ChunkArgs a) {
    if (a.spans) {
        const GdnSpan s = ((const GdnSpan*)a.spans)[blockIdx.z];
        a.x += (u64)s.row0 * a.C * 4;
        a.beta += (u64)s.row0 * a.Hv * 4;
        a.gdec += (u64)s.row0 * a.Hv * 4;
        a.out += (u64)s.row0 * a.Hv * a.dv * 4;
        a.state = s.state;
        a.scratch = s.scratch;
        a.T = s.T;
        a.nchunks = s.nchunks;
        a.chunk0 = 0;
        a.chunk1 = s.nchunks;
    }
    return a;
}

// out[t, ch] = silu(Σ_tap w[ch, tap] · window[t + tap]) over [state ; x]; writes the new state
// (the last KC-1 window rows, also when T < KC-1). A thread takes one channel over CONV_TT
// consecutive tokens, so each input value and weight is read once per thread (not KC times from
// KC blocks) and all its loads are in flight together. grid = (ceil(C/256),
// ceil(max(T, KC-1) / CONV_TT), spans) (ops/deltanet.rs CONV_TOKENS). state_out may be
// state_in: a thread reads its channel's old window before it writes the new one.
extern "C" __global__ void __launch_bounds__(256) gdn_conv(const ConvArgs a0) {
    const ConvArgs a = conv_span(a0);
    const int ch = blockIdx.x * 256 + threadIdx.x, t0 = blockIdx.y * CONV_TT;
    if (ch >= a.C || t0 >= max(a.T, a.KC - 1)) return;
    const int KC = a.KC, C = a.C;
    const float* x = (const float*)a.x;
    const float* st = (const float*)a.state_in;
    const float* w = (const float*)a.w + (i64)ch * KC;
    auto win = [&](int idx) -> float { return idx < KC - 1 ? st[(i64)idx * C + ch] : x[(i64)(idx - (KC - 1)) * a.ldx + ch]; };
    if (KC == 4) {  // Qwen3.5/3.6, Qwen3-Next: window rows t0 .. t0 + CONV_TT + 2 in registers
        const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
        float v[CONV_TT + 3];
#pragma unroll
        for (int i = 0; i < CONV_TT + 3; ++i) v[i] = t0 + i < a.T + 3 ? win(t0 + i) : 0.f;
#pragma unroll
        for (int i = 0; i < CONV_TT; ++i) {
            if (t0 + i < a.T) {
                float s = 0.f;  // the tap order of the general loop (and of gdn_decode)
                s += w0 * v[i];
                s += w1 * v[i + 1];
                s += w2 * v[i + 2];
                s += w3 * v[i + 3];
                ((float*)a.out)[(i64)(t0 + i) * C + ch] = siluf_(s);
            }
        }
    } else {
        for (int t = t0; t < min(a.T, t0 + CONV_TT); ++t) {
            float s = 0.f;
            for (int tap = 0; tap < KC; ++tap) s += w[tap] * win(t + tap);
            ((float*)a.out)[(i64)t * C + ch] = siluf_(s);
        }
    }
    for (int t = t0; t < min(KC - 1, t0 + CONV_TT); ++t) ((float*)a.state_out)[(i64)t * C + ch] = win(a.T + t);
}

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


// The chunked delta rule (docs/model.md §5.4) in two kernels: gdn_chunk_prep does everything that
// does not depend on the state, for all chunks of all heads at once; gdn_chunk_scan walks the
// chunks in order. Scratch (f32) per value head j and chunk c, at (j·nchunks + c)·E floats,
// E = 64·(dk + dv + 64 + 1):  W [64][dk] | U [64][dv] | QK [64][64] | γ [64].
// Rows ≥ L of a last partial chunk: W = U = QK = 0 (β = q = 0 there), γ stays flat.

// acc[c] += w_e · s[e].c for e = 0..3 in this order (four steps of an inner product).
DEVI void gdn_chunk_fma4(float* acc, const float4 w, const float4* s) {
    const float we[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        acc[0] += we[e] * s[e].x;
        acc[1] += we[e] * s[e].y;
        acc[2] += we[e] * s[e].z;
        acc[3] += we[e] * s[e].w;
    }
}

// Per (value head j, chunk): γ = cumsum of g over the chunk; A[i][m] = β_i (k_i·k_m) e^{γ_i−γ_m}
// (m < i), QK[i][m] = (q_i·k_m) e^{γ_i−γ_m} (m ≤ i); forward substitution (I + A) U = βV,
// (I + A) W = β e^γ K, in place over V and K. grid = (nchunks, Hv), block 256, 2 blocks per SM;
// dk a multiple of 8. K·Kᵀ and Q·Kᵀ run on tensor cores (3xTF32: about f32 precision); the
// substitution keeps the order of terms of the row-by-row form.
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep(const ChunkArgs a0) {
    const ChunkArgs a = chunk_span(a0);
    if ((int)blockIdx.x >= a.nchunks) return;  // a shorter span of a batched launch
    extern __shared__ __align__(16) float sm[];
    const int ch = blockIdx.x, j = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int dk = a.dk, dv = a.dv, kh = j / (a.Hv / a.Hk), key_dim = a.Hk * dk;
    const int t0 = ch * CHUNK, L = min(CHUNK, a.T - t0);
    const int KS = dk + 4, XS = max(dk, dv) + 4, AS = CHUNK + 4;  // 16-byte rows
    float* Ks = sm;                  // [64][KS]  K, then W
    float* Xs = Ks + CHUNK * KS;     // [64][XS]  Q, then V, then U
    float* At = Xs + CHUNK * XS;     // [64][AS]  Aᵀ: At[m][i] = A[i][m], m < i (the rest is never read)
    float* bet = At + CHUNK * AS;    // [64]
    float* gam = bet + CHUNK;        // [64]
    float* Wg = (float*)a.scratch + ((i64)j * a.nchunks + ch) * ((i64)CHUNK * (dk + dv + CHUNK + 1));
    float* Ug = Wg + CHUNK * dk;
    float* QKg = Ug + CHUNK * dv;
    float* Gg = QKg + CHUNK * CHUNK;
    const float* X = (const float*)a.x;
    // The chunk's q and k rows (zero past L) in 16-byte pieces, four of each in flight per thread.
    const int kq = dk / 4;
    for (int i0 = 0; i0 < CHUNK * kq; i0 += 4 * 256) {
        float4 vq[4], vk[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * 256 + tid, r = i / kq, d = 4 * (i % kq);
            const bool ok = i < CHUNK * kq && r < L;
            const float* row = X + (i64)(t0 + (ok ? r : 0)) * a.C + kh * dk + d;
            vq[u] = ok ? *(const float4*)row : make_float4(0.f, 0.f, 0.f, 0.f);
            vk[u] = ok ? *(const float4*)(row + key_dim) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * 256 + tid, r = i / kq, d = 4 * (i % kq);
            if (i < CHUNK * kq) {
                *(float4*)(Xs + r * XS + d) = vq[u];
                *(float4*)(Ks + r * KS + d) = vk[u];
            }
        }
    }
    if (tid < CHUNK) {
        bet[tid] = tid < L ? ((const float*)a.beta)[(i64)(t0 + tid) * a.Hv + j] : 0.f;
        gam[tid] = tid < L ? ((const float*)a.gdec)[(i64)(t0 + tid) * a.Hv + j] : 0.f;
    }
    __syncthreads();
    if (tid == 0) {  // in order (unrolled: the 64 loads are issued together)
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) { acc += gam[i]; gam[i] = acc; }
    }
    __syncthreads();
    // K·Kᵀ (warps 0-3) and Q·Kᵀ (warps 4-7) on tensor cores (Tf32x3), over the 20 m16n8 tiles that
    // touch the diagonal or lie below it (row block mi, column block nj ≤ 2·mi + 1), five per warp.
    // Then A[i][m] = β_i (k_i·k_m) e^{γ_i−γ_m} (m < i) into Aᵀ in shared memory, QK[i][m] =
    // (q_i·k_m) e^{γ_i−γ_m} (m ≤ i, else 0) to the scratch.
    {
        const int g = lane >> 2, tg = lane & 3;
        const bool isq = warp >= 4;
        const float* As = isq ? Xs : Ks;
        const int AST = isq ? XS : KS;
        for (int t = warp & 3; t < 20; t += 4) {
            const int mi = t >= 12 ? 3 : t >= 6 ? 2 : t >= 2 ? 1 : 0, nj = t - mi * (mi + 1);
            const int i = 16 * mi + g, m = 8 * nj + 2 * tg;  // this lane's rows i, i + 8, columns m, m + 1
            Tf32x3 acc;
            acc.zero();
#pragma unroll 4
            for (int k0 = 0; k0 < dk; k0 += 8) {
                const float* pa = As + i * AST + k0 + tg;
                const float* pb = Ks + (8 * nj + g) * KS + k0 + tg;
                u32 ah[4], al[4], bh[2], bl[2];
                tf32_split(pa[0], ah[0], al[0]);
                tf32_split(pa[8 * AST], ah[1], al[1]);
                tf32_split(pa[4], ah[2], al[2]);
                tf32_split(pa[8 * AST + 4], ah[3], al[3]);
                tf32_split(pb[0], bh[0], bl[0]);
                tf32_split(pb[4], bh[1], bl[1]);
                acc.mma(ah, al, bh, bl);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int ii = i + 8 * h;
                float o[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int mm = m + e;
                    const float dec = mm <= ii ? expf(gam[ii] - gam[mm]) : 0.f;
                    const float v = acc.value(2 * h + e);
                    if (isq) o[e] = mm <= ii ? v * dec : 0.f;
                    else At[mm * AS + ii] = mm < ii ? bet[ii] * v * dec : 0.f;
                }
                if (isq) *(float2*)(QKg + ii * CHUNK + m) = make_float2(o[0], o[1]);
            }
        }
    }
    // QK above the row block's last tile column is zero.
    for (int idx = tid; idx < CHUNK * CHUNK / 4; idx += 256) {
        const int i = idx / (CHUNK / 4), g = idx % (CHUNK / 4);
        if (g >= 4 * (i / 16 + 1)) *(float4*)(QKg + i * CHUNK + 4 * g) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncthreads();
    // V over Q (rows ≥ L zero, and they stay zero: the substitution only writes rows < L).
    const int vq4 = dv / 4;
    for (int i0 = 0; i0 < CHUNK * vq4; i0 += 4 * 256) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * 256 + tid, r = i / vq4, c = 4 * (i % vq4);
            const bool ok = i < CHUNK * vq4 && r < L;
            v[u] = ok ? *(const float4*)(X + (i64)(t0 + r) * a.C + 2 * key_dim + j * dv + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * 256 + tid, r = i / vq4, c = 4 * (i % vq4);
            if (i < CHUNK * vq4) *(float4*)(Xs + r * XS + c) = v[u];
        }
    }
    __syncthreads();
    // Forward substitution, U over V and W over K: u_i = β_i v_i − Σ_{m<i} A[i][m] u_m (W: β_i e^{γ_i}
    // k_i − ...). A thread owns one of the dv + dk columns (no barrier between rows; all 256 threads
    // busy for the 35B's 256 columns) and walks it in blocks of 8 rows: the block first takes the
    // terms of all earlier rows (two broadcast loads of A and one of the column per 8 FMAs), then
    // the terms within the block; every element subtracts m = 0, 1, ..., i−1 in order. Rows ≥ L
    // are not written (they stay zero).
    for (int c = tid; c < dv + dk; c += 256) {
        const bool isw = c >= dv;
        float* col = isw ? Ks + (c - dv) : Xs + c;
        const int cs = isw ? KS : XS;
        for (int i0 = 0; i0 < L; i0 += 8) {
            float acc[8];
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const int i = i0 + r;
                acc[r] = (isw ? bet[i] * expf(gam[i]) : bet[i]) * col[i * cs];
            }
#pragma unroll 2
            for (int m = 0; m < i0; ++m) {
                const float4 a0 = *(const float4*)(At + m * AS + i0), a1 = *(const float4*)(At + m * AS + i0 + 4);
                const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                const float u = col[m * cs];
#pragma unroll
                for (int r = 0; r < 8; ++r) acc[r] -= av[r] * u;
            }
#pragma unroll
            for (int r = 1; r < 8; ++r)
#pragma unroll
                for (int r2 = 0; r2 < r; ++r2) acc[r] -= At[(i0 + r2) * AS + i0 + r] * acc[r2];
#pragma unroll
            for (int r = 0; r < 8; ++r)
                if (i0 + r < L) col[(i0 + r) * cs] = acc[r];
        }
    }
    __syncthreads();
    for (int i = tid; i < CHUNK * kq; i += 256) {
        const int r = i / kq, d = 4 * (i % kq);
        *(float4*)(Wg + r * dk + d) = *(const float4*)(Ks + r * KS + d);
    }
    for (int i = tid; i < CHUNK * vq4; i += 256) {
        const int r = i / vq4, c = 4 * (i % vq4);
        *(float4*)(Ug + r * dv + c) = *(const float4*)(Xs + r * XS + c);
    }
    if (tid < CHUNK) Gg[tid] = gam[tid];
}

// The sequential part for one value head and a slice of cw state columns (state [dk][cw] in
// shared memory), chunk by chunk, in three phases (inputs in brackets):
//   A: Vn = U − W·S and q·S, sharing the loads of S     (W, U slice, Q)
//   B: O_i = e^{γ_i} q_i·S + Σ_{m≤i} QK[i][m] Vn_m        (QK, γ)
//   C: S ← e^{γ_last} S + Σ_m e^{γ_last−γ_m} k_m ⊗ Vn_m   (K)
// Each phase's inputs are one cp.async group, issued into its single buffer as soon as the
// previous chunk's phase has read it, so each lands during the two phases before its use.
// grid = (Hv, dv / cw), block 256. out [T, Hv*dv] (pre-norm); the state is updated in place.
// A launch walks chunks [chunk0, chunk1) of the nchunks gdn_chunk_prep prepared: everything a
// chunk reads and writes is indexed by its number, and S goes through memory in f32 between two
// launches, so launches over [0, c) and [c, n) compute bit for bit what one over [0, n) does
// (layers.rs splits the scan where a snapshot is captured).
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_scan(const ChunkArgs a0) {
    const ChunkArgs a = chunk_span(a0);
    extern __shared__ __align__(16) float sm[];
    const int j = blockIdx.x, col0 = blockIdx.y * a.cw, cw = a.cw, tid = threadIdx.x;
    const int dk = a.dk, dv = a.dv, kh = j / (a.Hv / a.Hk), key_dim = a.Hk * dk, n = a.nchunks;
    const int c_begin = a.chunk0, c_end = a.chunk1;  // the chunks this launch walks
    const int KS = dk + 4, VS = cw + 4, QS = CHUNK + 4;  // row strides (16-byte rows)
    float* Ss = sm;                  // [dk][VS]
    float* Vn = Ss + dk * VS;        // [64][VS]
    float* Ub = Vn + CHUNK * VS;     // [64][VS]
    float* Wb = Ub + CHUNK * VS;     // [64][KS]
    float* Qb = Wb + CHUNK * KS;     // [64][KS]
    float* Kb = Qb + CHUNK * KS;     // [64][KS]
    float* QKb = Kb + CHUNK * KS;    // [64][QS]
    float* gam = QKb + CHUNK * QS;   // [64]
    float* fac = gam + CHUNK;        // [64]
    const i64 E = (i64)CHUNK * (dk + dv + CHUNK + 1);
    const float* G0 = (const float*)a.scratch + (i64)j * n * E;
    const float* X = (const float*)a.x;
    float* S = (float*)a.state + (i64)j * dk * dv;
    const int kq = dk / 4, cq = cw / 4;  // 16-byte pieces per row
    // Rows of chunk c of x from column col (q or k of key head kh), zero past T.
    auto load_x = [&](float* buf, int col, int c) {
        const int t0 = c * CHUNK, L = min(CHUNK, a.T - t0);
        for (int i = tid; i < CHUNK * kq; i += 256) {
            const int r = i / kq, q = i % kq;
            const bool ok = r < L;
            cp_async16(buf + r * KS + 4 * q, X + (i64)(ok ? t0 + r : 0) * a.C + col + 4 * q, ok);
        }
    };
    auto load_a = [&](int c) {
        const float* G = G0 + c * E;
        for (int i = tid; i < CHUNK * kq; i += 256) {
            const int r = i / kq, q = i % kq;
            cp_async16(Wb + r * KS + 4 * q, G + r * dk + 4 * q, true);
        }
        for (int i = tid; i < CHUNK * cq; i += 256) {
            const int r = i / cq, q = i % cq;
            cp_async16(Ub + r * VS + 4 * q, G + CHUNK * dk + r * dv + col0 + 4 * q, true);
        }
        load_x(Qb, kh * dk, c);
    };
    auto load_b = [&](int c) {
        const float* G = G0 + c * E + CHUNK * (dk + dv);
        for (int i = tid; i < CHUNK * (CHUNK / 4); i += 256) {
            const int r = i / (CHUNK / 4), q = i % (CHUNK / 4);
            cp_async16(QKb + r * QS + 4 * q, G + r * CHUNK + 4 * q, true);
        }
        if (tid < CHUNK / 4) cp_async16(gam + 4 * tid, G + CHUNK * CHUNK + 4 * tid, true);
    };
    for (int i = tid; i < dk * cw; i += 256) Ss[(i / cw) * VS + i % cw] = S[(i64)(i / cw) * dv + col0 + i % cw];
    if (c_begin < c_end) load_a(c_begin);
    cp_async_commit();
    if (c_begin < c_end) load_b(c_begin);
    cp_async_commit();
    // Phases A and B: output tiles of 2 rows x 4 columns (cw = 32) or 1 x 4 (cw = 16).
    const int cg = cw / 4, rpt = cw / 16;  // column groups, rows per thread
    const int r0 = (tid / cg) * rpt, cc = (tid % cg) * 4;
    // QK is zero above the diagonal: the rows of this warp need QK columns m < mend only.
    const int mend = min(CHUNK, ((((tid | 31) / cg) * rpt + rpt - 1) & ~3) + 4);
    for (int c = c_begin; c < c_end; ++c) {
        const int t0 = c * CHUNK, L = min(CHUNK, a.T - t0);
        cp_async_wait<1>();  // W, U, Q of chunk c (pending: QK, γ of chunk c)
        __syncthreads();     // and phase C of chunk c−1 is done: S complete, K buffer free
        load_x(Kb, key_dim + kh * dk, c);
        cp_async_commit();
        // A: Vn = U − W·S and qs = Q·S (kept in registers for phase B).
        float qs[2][4];
        {
            float acc[2][4];
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[r][q] = qs[r][q] = 0.f;
#pragma unroll 2
            for (int d = 0; d < dk; d += 4) {
                float4 s[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) s[e] = *(const float4*)(Ss + (d + e) * VS + cc);
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    if (r < rpt) {
                        gdn_chunk_fma4(acc[r], *(const float4*)(Wb + (r0 + r) * KS + d), s);
                        gdn_chunk_fma4(qs[r], *(const float4*)(Qb + (r0 + r) * KS + d), s);
                    }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (r < rpt) {
                    const float4 u = *(const float4*)(Ub + (r0 + r) * VS + cc);
                    *(float4*)(Vn + (r0 + r) * VS + cc) = make_float4(u.x - acc[r][0], u.y - acc[r][1], u.z - acc[r][2], u.w - acc[r][3]);
                }
        }
        cp_async_wait<1>();  // QK, γ of chunk c (pending: K of chunk c)
        __syncthreads();     // Vn complete; W, U, Q buffers free
        if (c + 1 < c_end) load_a(c + 1);
        cp_async_commit();
        // B: O_i = e^{γ_i} q_i·S + Σ_{m≤i} QK[i][m] Vn_m; the decay factors of phase C.
        float el;
        {
            float qv[2][4];
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int q = 0; q < 4; ++q) qv[r][q] = 0.f;
            for (int m = 0; m < mend; m += 4) {
                float4 v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) v[e] = *(const float4*)(Vn + (m + e) * VS + cc);
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    if (r < rpt) gdn_chunk_fma4(qv[r], *(const float4*)(QKb + (r0 + r) * QS + m), v);
            }
            const float gl = gam[L - 1];
            el = expf(gl);
            if (tid < CHUNK) fac[tid] = tid < L ? expf(gl - gam[tid]) : 0.f;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = r0 + r;
                if (r < rpt && i < L) {
                    const float eg = expf(gam[i]);
                    float* orow = (float*)a.out + (i64)(t0 + i) * a.Hv * dv + j * dv + col0 + cc;
                    *(float4*)orow = make_float4(eg * qs[r][0] + qv[r][0], eg * qs[r][1] + qv[r][1], eg * qs[r][2] + qv[r][2], eg * qs[r][3] + qv[r][3]);
                }
            }
        }
        cp_async_wait<1>();  // K of chunk c (pending: W, U, Q of chunk c+1)
        __syncthreads();     // fac written; QK, γ buffers free
        if (c + 1 < c_end) load_b(c + 1);
        cp_async_commit();
        // C: S ← e^{γ_last} S + Σ_{m<L} e^{γ_last−γ_m} k_m ⊗ Vn_m, 4x8 tiles of [dk][cw] (for the
        // 35B: 128 tiles, threads 0..127; 13 loads per 32 FMAs).
        for (int t = tid; t < (dk / 4) * (cw / 8); t += 256) {
            const int d0 = (t / (cw / 8)) * 4, c0 = (t % (cw / 8)) * 8;
            float acc[4][8];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float4 s0 = *(const float4*)(Ss + (d0 + r) * VS + c0), s1 = *(const float4*)(Ss + (d0 + r) * VS + c0 + 4);
                const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[r][q] = el * sv[q];
            }
#pragma unroll 2
            for (int m = 0; m < L; ++m) {
                const float f = fac[m];
                const float4 k = *(const float4*)(Kb + m * KS + d0);
                const float4 v0 = *(const float4*)(Vn + m * VS + c0), v1 = *(const float4*)(Vn + m * VS + c0 + 4);
                const float kv[4] = {f * k.x, f * k.y, f * k.z, f * k.w};
                const float vv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[r][q] += kv[r] * vv[q];
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {  // own tile
                *(float4*)(Ss + (d0 + r) * VS + c0) = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
                *(float4*)(Ss + (d0 + r) * VS + c0 + 4) = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int i = tid; i < dk * cw; i += 256) S[(i64)(i / cw) * dv + col0 + i % cw] = Ss[(i / cw) * VS + i % cw];
}

// gdn_chunk_scan on tensor cores, for dk a power of two ≥ 16 and CW = 32 or 64 state columns per
// block: the same three phases and the same cp.async pipeline, each product as m16n8k8 TF32 MMAs
// in three parts (Tf32x3: about f32 precision); the state stays f32 in shared memory, Vn and the
// outputs are summed in f32. A block has 8 warps per 32 columns. Warps of phases A and B: rows
// 16·(w % 4).. of the chunk, state columns 16·(w / 4)..; phase C: state rows 16·(w % 8).. (+128,
// ...), columns 32·(w / 8).. +32. Every output and state element is the same sequence of MMAs
// whatever CW, so both widths give the same bits; the wide one reads each chunk's W, Q, K and QK
// once per 64 columns (ops/deltanet.rs scan_wide picks it where the narrow grid would take more
// than one wave). Row strides (floats) keep every fragment load free of bank conflicts: W and Q
// dk + 4 (rows g, columns t), K dk + 8 (read transposed), S, Vn and U CW + 8, QK 68. Grid (Hv,
// dv/CW), block 8·CW.
template <int CW>
DEVI void chunk_scan_tc(const ChunkArgs a0) {
    constexpr int NTH = 8 * CW;
    const ChunkArgs a = chunk_span(a0);
    extern __shared__ __align__(16) float scan_sm[];  // not `sm`: in a template that name clashes with the kernels' (nvcc warning 1556)
    const int j = blockIdx.x, col0 = blockIdx.y * CW, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tg = lane & 3;  // fragment row group and thread in group
    const int dk = a.dk, dv = a.dv, kh = j / (a.Hv / a.Hk), key_dim = a.Hk * dk, n = a.nchunks;
    const int c_begin = a.chunk0, c_end = a.chunk1;
    const int WS = dk + 4, KS = dk + 8, VS = CW + 8, QS = CHUNK + 4;
    float* Ss = scan_sm;           // [dk][VS]
    float* Vn = Ss + dk * VS;      // [64][VS]
    float* Ub = Vn + CHUNK * VS;   // [64][VS]
    float* Wb = Ub + CHUNK * VS;   // [64][WS]
    float* Qb = Wb + CHUNK * WS;   // [64][WS]
    float* Kb = Qb + CHUNK * WS;   // [64][KS]
    float* QKb = Kb + CHUNK * KS;  // [64][QS]
    float* gam = QKb + CHUNK * QS; // [64]
    float* fac = gam + CHUNK;      // [64]
    const i64 E = (i64)CHUNK * (dk + dv + CHUNK + 1);
    const float* G0 = (const float*)a.scratch + (i64)j * n * E;
    const float* X = (const float*)a.x;
    float* S = (float*)a.state + (i64)j * dk * dv;
    // Rows of dk floats in 16-byte pieces: a thread copies piece kp of rows kr, kr + kstep, ...
    // (dk a power of two: NTH threads cover whole rows).
    const int kq = dk / 4, kp = tid % kq, kr = tid / kq, kstep = NTH / kq;
    auto load_x = [&](float* buf, int stride, int col, int c) {
        const int t0 = c * CHUNK, L = min(CHUNK, a.T - t0);
        for (int r = kr; r < CHUNK; r += kstep) {
            const bool ok = r < L;
            cp_async16(buf + r * stride + 4 * kp, X + (i64)(ok ? t0 + r : 0) * a.C + col + 4 * kp, ok);
        }
    };
    auto load_a = [&](int c) {
        const float* G = G0 + c * E;
        for (int r = kr; r < CHUNK; r += kstep) cp_async16(Wb + r * WS + 4 * kp, G + r * dk + 4 * kp, true);
        constexpr int UQ = CW / 4;  // 16-byte pieces of a U row
        for (int r = tid / UQ; r < CHUNK; r += NTH / UQ) cp_async16(Ub + r * VS + 4 * (tid % UQ), G + CHUNK * dk + r * dv + col0 + 4 * (tid % UQ), true);
        load_x(Qb, WS, kh * dk, c);
    };
    auto load_b = [&](int c) {
        const float* G = G0 + c * E + CHUNK * (dk + dv);
        for (int r = tid / 16; r < CHUNK; r += NTH / 16) cp_async16(QKb + r * QS + 4 * (tid % 16), G + r * CHUNK + 4 * (tid % 16), true);
        if (tid < CHUNK / 4) cp_async16(gam + 4 * tid, G + CHUNK * CHUNK + 4 * tid, true);
    };
    for (int i = tid; i < dk * CW; i += NTH) Ss[(i / CW) * VS + i % CW] = S[(i64)(i / CW) * dv + col0 + i % CW];
    if (c_begin < c_end) load_a(c_begin);
    cp_async_commit();
    if (c_begin < c_end) load_b(c_begin);
    cp_async_commit();
    const int mt = warp & 3, ra = 16 * mt + g, cb = 16 * (warp >> 2);  // phases A, B: rows ra, ra + 8
    for (int c = c_begin; c < c_end; ++c) {
        const int t0 = c * CHUNK, L = min(CHUNK, a.T - t0);
        cp_async_wait<1>();  // W, U, Q of chunk c (pending: QK, γ of chunk c)
        __syncthreads();     // and phase C of chunk c−1 is done: S complete, K buffer free
        load_x(Kb, KS, key_dim + kh * dk, c);
        cp_async_commit();
        // A: Vn = U − W·S and qs = Q·S (kept in registers for phase B).
        Tf32x3 vw[2], qs[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) vw[nt].zero(), qs[nt].zero();
#pragma unroll 2
        for (int k0 = 0; k0 < dk; k0 += 8) {
            u32 wh[4], wl[4], qh[4], ql[4];
            const float* w = Wb + ra * WS + k0 + tg;
            const float* q = Qb + ra * WS + k0 + tg;
            tf32_split(w[0], wh[0], wl[0]);
            tf32_split(w[8 * WS], wh[1], wl[1]);
            tf32_split(w[4], wh[2], wl[2]);
            tf32_split(w[8 * WS + 4], wh[3], wl[3]);
            tf32_split(q[0], qh[0], ql[0]);
            tf32_split(q[8 * WS], qh[1], ql[1]);
            tf32_split(q[4], qh[2], ql[2]);
            tf32_split(q[8 * WS + 4], qh[3], ql[3]);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const float* s = Ss + (k0 + tg) * VS + cb + 8 * nt + g;
                u32 bh[2], bl[2];
                tf32_split(s[0], bh[0], bl[0]);
                tf32_split(s[4 * VS], bh[1], bl[1]);
                vw[nt].mma(wh, wl, bh, bl);
                qs[nt].mma(qh, ql, bh, bl);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int o = (ra + 8 * h) * VS + cb + 8 * nt + 2 * tg;
                const float2 u = *(const float2*)(Ub + o);
                *(float2*)(Vn + o) = make_float2(u.x - vw[nt].value(2 * h), u.y - vw[nt].value(2 * h + 1));
            }
        cp_async_wait<1>();  // QK, γ of chunk c (pending: K of chunk c)
        __syncthreads();     // Vn complete; W, U, Q buffers free
        if (c + 1 < c_end) load_a(c + 1);
        cp_async_commit();
        // B: O_i = e^{γ_i} q_i·S + Σ_{m≤i} QK[i][m] Vn_m (QK is zero above the diagonal: the
        // rows of m-tile mt need m < 16·(mt + 1)); the decay factors of phase C.
        float el;
        {
            Tf32x3 qv[2];
            qv[0].zero(), qv[1].zero();
            for (int k0 = 0; k0 < 16 * (mt + 1); k0 += 8) {
                u32 ah[4], al[4];
                const float* p = QKb + ra * QS + k0 + tg;
                tf32_split(p[0], ah[0], al[0]);
                tf32_split(p[8 * QS], ah[1], al[1]);
                tf32_split(p[4], ah[2], al[2]);
                tf32_split(p[8 * QS + 4], ah[3], al[3]);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const float* v = Vn + (k0 + tg) * VS + cb + 8 * nt + g;
                    u32 bh[2], bl[2];
                    tf32_split(v[0], bh[0], bl[0]);
                    tf32_split(v[4 * VS], bh[1], bl[1]);
                    qv[nt].mma(ah, al, bh, bl);
                }
            }
            const float gl = gam[L - 1];
            el = expf(gl);
            if (tid < CHUNK) fac[tid] = tid < L ? expf(gl - gam[tid]) : 0.f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = ra + 8 * h;
                if (i < L) {
                    const float eg = expf(gam[i]);
                    float* orow = (float*)a.out + (i64)(t0 + i) * a.Hv * dv + j * dv + col0 + cb + 2 * tg;
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
                        *(float2*)(orow + 8 * nt) =
                            make_float2(eg * qs[nt].value(2 * h) + qv[nt].value(2 * h), eg * qs[nt].value(2 * h + 1) + qv[nt].value(2 * h + 1));
                }
            }
        }
        cp_async_wait<1>();  // K of chunk c (pending: W, U, Q of chunk c+1)
        __syncthreads();     // fac written; QK, γ buffers free
        if (c + 1 < c_end) load_b(c + 1);
        cp_async_commit();
        // C: S ← e^{γ_last} S + Σ_{m<L} (e^{γ_last−γ_m} k_m) ⊗ Vn_m; rows m ≥ L add zeros (fac = 0).
        const int mend = (L + 7) & ~7, cc = 32 * (warp >> 3);  // this warp's 32 columns
        for (int d0 = 16 * (warp & 7); d0 < dk; d0 += 128) {
            Tf32x3 acc[4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                acc[nt].zero();
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float2 s = *(const float2*)(Ss + (d0 + g + 8 * h) * VS + cc + 8 * nt + 2 * tg);
                    acc[nt].hh[2 * h] = el * s.x;
                    acc[nt].hh[2 * h + 1] = el * s.y;
                }
            }
#pragma unroll 2
            for (int k0 = 0; k0 < mend; k0 += 8) {
                const float f0 = fac[k0 + tg], f1 = fac[k0 + tg + 4];
                const float* k = Kb + (k0 + tg) * KS + d0 + g;
                u32 ah[4], al[4];
                tf32_split(f0 * k[0], ah[0], al[0]);
                tf32_split(f0 * k[8], ah[1], al[1]);
                tf32_split(f1 * k[4 * KS], ah[2], al[2]);
                tf32_split(f1 * k[4 * KS + 8], ah[3], al[3]);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const float* v = Vn + (k0 + tg) * VS + cc + 8 * nt + g;
                    u32 bh[2], bl[2];
                    tf32_split(v[0], bh[0], bl[0]);
                    tf32_split(v[4 * VS], bh[1], bl[1]);
                    acc[nt].mma(ah, al, bh, bl);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *(float2*)(Ss + (d0 + g + 8 * h) * VS + cc + 8 * nt + 2 * tg) = make_float2(acc[nt].value(2 * h), acc[nt].value(2 * h + 1));
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int i = tid; i < dk * CW; i += NTH) S[(i64)(i / CW) * dv + col0 + i % CW] = Ss[(i / CW) * VS + i % CW];
}
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_scan_tc(const ChunkArgs a0) { chunk_scan_tc<32>(a0); }
extern "C" __global__ void __launch_bounds__(512) gdn_chunk_scan_tc_wide(const ChunkArgs a0) { chunk_scan_tc<64>(a0); }

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

// Decode: GDN_NS blocks per value head, each owning dv/GDN_NS state columns (all dk rows). On
// sm_90+ the GDN_NS blocks of a head form one thread-block cluster (compile-time
// __cluster_dims__, so plain, PDL and graph-captured launches all get it) and exchange the
// partial sums of squares of the gated RMSNorm through distributed shared memory. Before sm_90
// there are no clusters: the kernel writes the pre-norm output and the launcher runs
// gdn_gated_norm on it in place.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GDN_CLUSTER 1
#define GDN_CLUSTER_DIMS __cluster_dims__(GDN_NS, 1, 1)
#else
#define GDN_CLUSTER 0
#define GDN_CLUSTER_DIMS
#endif

// 4-byte asynchronous copy global -> shared (no register, no stall until cp_async_wait).
DEVI void gdn_cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}

// Waits for this thread's cp.async copies; a compiler barrier too, so loads issued before it in
// the source are not sunk below it.
DEVI void gdn_cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

#if GDN_CLUSTER
// (cluster_rank, cluster_arrive and cluster_wait: common.cuh.)
DEVI void gdn_cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
// Stores v into the copy of the shared variable `local` that cluster block `rank` holds.
DEVI void gdn_st_cluster(const void* local, u32 rank, float v) {
    u32 addr;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(addr) : "r"(smem_u32(local)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
#endif

struct GdnDecodeSmem {
    float* cwin;   // [2·KC−1][nch]: old conv window taps 0..KC−2, then conv weights 0..KC−1
    float* sst;    // [GDN_MAXR][GDN_THREADS]: the state rows of each thread (general dims only)
    float* vals;   // [nch] conv + SiLU: q [dk] | k [dk] | own v [CW]
    float* part;   // [GDN_THREADS] kᵀS partials
    float* part2;  // [GDN_THREADS] qᵀS partials
    float* ssq;    // [GDN_NS][2] partial sums of squares, [cluster rank][warp]
};

// One decode token. grid = Hv·GDN_NS: block b is value head j = b / GDN_NS, columns
// [sp·CW, sp·CW + CW) with sp = b % GDN_NS, CW = dv / GDN_NS; block GDN_THREADS.
//
// Thread (c = tid % CW, rg = tid / CW) holds state column c, rows rg, rg + RG, ... (RG = 256/CW):
// in registers when the dims are constants (the Qwen shape; the addresses are then immediates),
// else in its own slots of shared memory (sv below): with run-time dims and the rows in
// registers ptxas needs ~110 registers for the whole kernel instead of ~80.
//
// Every block recomputes what is per head and cheap: the conv + SiLU of the head's q and k
// channels (2·dk), their L2 norms and the gates; the v channels are convolved only for the
// block's own CW columns.
//
// Conv state (race-free by construction):
//  * every read of the conv state goes to buffer pos&1, every write to buffer (pos+1)&1: disjoint
//    memory, so no write of this launch can reach a value that a block of it reads, whatever the
//    order in which blocks run;
//  * each element of buffer (pos+1)&1 is written by exactly one block: a v channel by the block
//    that owns the column; q/k channel i (local index in [0, 2·dk)) of key head kh by block
//    sp = i / ceil(2·dk / GDN_NS) of value head kh·(Hv/Hk), the first value head of kh. All C
//    channels and all KC−1 rows are rewritten, so the buffer is complete for the next step;
//  * across launches: buffer (pos+1)&1 was last read, and buffer pos&1 last written, by the
//    previous step's launch of this layer (or by prefill), which has completed: stream order; in
//    the decode graph the step's first kernel is a plain launch and a PDL kernel passes pdl_wait
//    only once its predecessor has completed. This kernel writes nothing before pdl_enter().
//
// Before pdl_enter() only data that no kernel of this step writes is requested: the state rows,
// the position, the conv weights and the old conv window (cp.async into shared
// memory), a_log, dt_bias and the norm weights. After it: q/k/v, z, b and a of this step.
//
// KCT, DKT, DVT > 0: KC, dk, dv as constants (equal to a.KC, a.dk, a.dv); 0: read at run time.
template <int KCT, int DKT, int DVT>
DEVI void gdn_decode_body(const GdnDecodeArgs& a, const GdnDecodeSmem& sm) {
    __builtin_assume(threadIdx.x < GDN_THREADS);  // the launch's block (see gdn_stream_body)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int j = blockIdx.x / GDN_NS, sp = blockIdx.x % GDN_NS;
    const int dk = DKT > 0 ? DKT : a.dk, dv = DVT > 0 ? DVT : a.dv, C = a.C, KC = KCT > 0 ? KCT : a.KC;
    const int rvk = a.Hv / a.Hk, kh = j / rvk, key_dim = a.Hk * dk;
    const int CW = dv / GDN_NS, col0 = sp * CW, nch = 2 * dk + CW;
    const int RG = GDN_THREADS / CW;
    const int c = tid % CW, rg = tid / CW;
    const bool act = rg < RG;
    float* cwin = sm.cwin;
    // The state (the kernel's main traffic) is requested first.
    constexpr bool SREG = DKT > 0 && DVT > 0;  // state rows in registers (else shared memory)
    float* S = (float*)a.state + (i64)j * dk * dv + col0 + c;
    float s[GDN_MAXR];
    float* sst = sm.sst + tid;
    auto sv = [&](int m) -> float& {
        if constexpr (SREG)
            return s[m];
        else
            return sst[m * GDN_THREADS];
    };
#pragma unroll
    for (int m = 0; m < GDN_MAXR; ++m) {
        const int i = rg + m * RG;
        if constexpr (SREG)
            s[m] = (act && i < dk) ? S[i * dv] : 0.f;
        else if (act && i < dk)
            gdn_cp_async4(&sst[m * GDN_THREADS], S + i * dv);  // read back by this thread only
    }
    // Local conv channel i -> global channel: q of key head kh, k of kh, v of the own columns.
    auto chan = [&](int i) -> int {
        return i < dk ? kh * dk + i : i < 2 * dk ? key_dim + kh * dk + (i - dk) : 2 * key_dim + j * dv + col0 + (i - 2 * dk);
    };
    const float* cw_g = (const float*)a.conv_w;
    for (int i = tid; i < nch; i += GDN_THREADS) {
        const float* w = cw_g + (i64)chan(i) * KC;
#pragma unroll(KCT > 0 ? KCT : 1)
        for (int tap = 0; tap < KC; ++tap) gdn_cp_async4(&cwin[(KC - 1 + tap) * nch + i], w + tap);
    }
    // The state and the position were last written by the previous decode step.
    const int pos = a.pos_ptr ? *(const int*)a.pos_ptr : a.pos;
    const float* st_in = (const float*)a.conv_state + (i64)(pos & 1) * (KC - 1) * C;
    float* st_out = (float*)a.conv_state + (i64)((pos + 1) & 1) * (KC - 1) * C;
    for (int i = tid; i < nch; i += GDN_THREADS) {
        const int ch = chan(i);
#pragma unroll(KCT > 0 ? KCT : 1)
        for (int tap = 0; tap < KC - 1; ++tap) gdn_cp_async4(&cwin[tap * nch + i], st_in + (i64)tap * C + ch);
    }
    const float alog = ((const float*)a.a_log)[j], dtb = ((const float*)a.dt_bias)[j];
    const float nw = tid < CW ? ((const float*)a.norm_w)[col0 + tid] : 0.f;
    pdl_enter();
    // This step's projections, all requested at once.
    const float* x = (const float*)a.qkv;
    float xr[GDN_NCPT];
#pragma unroll
    for (int n = 0; n < GDN_NCPT; ++n) {
        const int i = tid + n * GDN_THREADS;
        xr[n] = i < nch ? __ldcg(x + chan(i)) : 0.f;
    }
    const float bj = __ldcg((const float*)a.b + j), aj = __ldcg((const float*)a.a + j);
    const float zz = tid < CW ? __ldcg((const float*)a.z + (i64)j * dv + col0 + tid) : 0.f;
    gdn_cp_async_wait_all();  // own copies only: a thread reads just the channels it copied
#pragma unroll
    for (int n = 0; n < GDN_NCPT; ++n) {
        const int i = tid + n * GDN_THREADS;
        if (i < nch) {
            const float* wi = cwin + i;  // old window tap t: wi[t·nch]; weight t: wi[(KC−1+t)·nch]
            float acc = 0.f;
#pragma unroll(KCT > 0 ? KCT : 1)
            for (int tap = 0; tap < KC - 1; ++tap) acc += wi[(KC - 1 + tap) * nch] * wi[tap * nch];
            acc += wi[(2 * KC - 2) * nch] * xr[n];
            sm.vals[i] = siluf_(acc);
        }
    }
    __syncthreads();
    const float* q = sm.vals;
    const float* k = sm.vals + dk;
    const float* v = sm.vals + 2 * dk;
    // L2 norms of q and k: every warp computes both (the same way in every warp and block), so
    // no block reduction is needed; the normalised values are formed where they are used.
    float sq = 0.f, sk = 0.f;
#pragma unroll 4
    for (int e = lane; e < dk; e += 32) {
        sq += q[e] * q[e];
        sk += k[e] * k[e];
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f), qs = 1.f / sqrtf((float)dk);
    const float beta = 1.f / (1.f + expf(-bj));
    const float g = -expf(alog) * softplusf_(aj + dtb);
    const float alpha = expf(g);
    // S ← α·S; kᵀS of the own columns.
    float mem = 0.f;
#pragma unroll
    for (int m = 0; m < GDN_MAXR; ++m) {
        const int i = rg + m * RG;
        if (act && i < dk) {
            sv(m) *= alpha;
            mem += (k[i] * ik) * sv(m);
        }
    }
    sm.part[tid] = act ? mem : 0.f;
    __syncthreads();
    float r = 0.f;
    if (act) {
#pragma unroll 8
        for (int q2 = 0; q2 < RG; ++q2) r += sm.part[q2 * CW + c];
    }
    const float delta = act ? (v[c] - r) * beta : 0.f;
    // S ← S + k ⊗ δ, o = qᵀS (S is stored at the end).
    float o = 0.f;
#pragma unroll
    for (int m = 0; m < GDN_MAXR; ++m) {
        const int i = rg + m * RG;
        if (act && i < dk) {
            sv(m) += (k[i] * ik) * delta;
            o += ((q[i] * iq) * qs) * sv(m);
        }
    }
    sm.part2[tid] = act ? o : 0.f;
    __syncthreads();
    // Threads tid < CW (row group 0) own the output columns.
    float oc = 0.f;
    if (tid < CW) {
#pragma unroll 8
        for (int q2 = 0; q2 < RG; ++q2) oc += sm.part2[q2 * CW + tid];
    }
    float* out = (float*)a.out + (i64)j * dv + col0;
#if GDN_CLUSTER
    // Gated RMSNorm over the head's dv columns: each output warp's sum of squares goes to slot
    // [own rank][warp] of every block of the cluster; after the barrier every block adds the
    // same slots in the same order (ranks 0..GDN_NS−1), so all blocks of the head use the same
    // sum. No global store is issued before the barrier: its release (a MEMBAR) then waits for
    // the remote stores only.
    const int OW = (CW + 31) / 32;  // output warps (CW <= 64)
    const float ssw = warp_sum(oc * oc);
    cluster_wait();  // paired with the arrive at kernel entry: every block has started
    if (lane == 0 && warp < OW) {
        const u32 rank = cluster_rank();
#pragma unroll
        for (u32 t = 0; t < GDN_NS; ++t) gdn_st_cluster(&sm.ssq[rank * 2 + warp], t, ssw);
    }
    cluster_sync();  // no block touches another's shared memory after this point
    if (tid < CW) {
        float ss = 0.f;
        for (int t = 0; t < GDN_NS; ++t)
            for (int w = 0; w < OW; ++w) ss += sm.ssq[t * 2 + w];
        const float inv = 1.f / sqrtf(ss / dv + a.eps);
        out[tid] = oc * inv * nw * siluf_(zz);
    }
#else
    if (tid < CW) out[tid] = oc;  // pre-norm; the launcher runs gdn_gated_norm in place
    (void)nw;
    (void)zz;
    (void)lane;
    (void)warp;
#endif
    // The new state, then the conv state (owners only, see above).
#pragma unroll
    for (int m = 0; m < GDN_MAXR; ++m) {
        const int i = rg + m * RG;
        if (act && i < dk) S[i * dv] = sv(m);
    }
    const int qk_per = (2 * dk + GDN_NS - 1) / GDN_NS;
#pragma unroll
    for (int n = 0; n < GDN_NCPT; ++n) {
        const int i = tid + n * GDN_THREADS;
        const bool owner = i < 2 * dk ? (j % rvk == 0 && i / qk_per == sp) : i < nch;
        if (owner) {
            const int ch = chan(i);
            const float* wi = cwin + i;
#pragma unroll(KCT > 0 ? KCT : 1)
            for (int r2 = 0; r2 + 1 < KC - 1; ++r2) st_out[(i64)r2 * C + ch] = wi[(r2 + 1) * nch];
            if (KC > 1) st_out[(i64)(KC - 2) * C + ch] = xr[n];
        }
    }
}

DEVI void gdn_decode_run(const GdnDecodeArgs& a) {
    // Dynamic (ops/deltanet.rs decode_smem): (2·KC−1)·nch floats, then GDN_MAXR·GDN_THREADS.
    extern __shared__ float gdn_cwin[];
    __shared__ float vals[GDN_NCPT * GDN_THREADS];
    __shared__ float part[GDN_THREADS], part2[GDN_THREADS];
    __shared__ float ssq[GDN_NS * 2];
#if GDN_CLUSTER
    gdn_cluster_arrive_relaxed();  // paired with the first wait, before any remote store
#endif
    const int nch = 2 * a.dk + a.dv / GDN_NS;
    const GdnDecodeSmem sm{gdn_cwin, gdn_cwin + (2 * a.KC - 1) * nch, vals, part, part2, ssq};
    if (a.KC == 4 && a.dk == 128 && a.dv == 128)  // Qwen3.5/3.6, Qwen3-Next
        gdn_decode_body<4, 128, 128>(a, sm);
    else
        gdn_decode_body<0, 0, 0>(a, sm);
}

extern "C" __global__ void GDN_CLUSTER_DIMS __launch_bounds__(GDN_THREADS) gdn_decode(const GdnDecodeArgs a) {
    gdn_decode_run(a);
}

// One token of each of several sequences (grid.y = rows): row r is the sequence in state slot
// rows_slot[r] at position pos_ptr[r]; its inputs and output are rows of their tensors (strides
// ld_*), its states sit slot·conv_stride / slot·rec_stride floats after conv_state / state. A row
// whose slot is negative (padding of a batch bucket) writes zeros to its output. A null rows_slot
// means slot 0 for every row: a graph pinned to one sequence passes its states' addresses, so no
// load of the slot stands before the state requests.
extern "C" __global__ void GDN_CLUSTER_DIMS __launch_bounds__(GDN_THREADS) gdn_decode_rows(const GdnDecodeArgs a0) {
    const int r = blockIdx.y;
    const int slot = a0.rows_slot ? ((const int*)a0.rows_slot)[r] : 0;
    if (slot < 0) {  // the same for every block of a cluster: all of them leave here
        pdl_enter();
        const int j = blockIdx.x / GDN_NS, sp = blockIdx.x % GDN_NS, cw = a0.dv / GDN_NS;
        for (int i = threadIdx.x; i < cw; i += GDN_THREADS) ((float*)a0.out)[(i64)r * a0.ld_out + (i64)j * a0.dv + sp * cw + i] = 0.f;
        return;
    }
    GdnDecodeArgs a = a0;
    a.qkv += (u64)r * a0.ld_qkv * 4;
    a.z += (u64)r * a0.ld_z * 4;
    a.b += (u64)r * a0.ld_ba * 4;
    a.a += (u64)r * a0.ld_ba * 4;
    a.out += (u64)r * a0.ld_out * 4;
    a.conv_state += (u64)slot * a0.conv_stride * 4;
    a.state += (u64)slot * a0.rec_stride * 4;
    a.pos_ptr += (u64)r * 4;
    gdn_decode_run(a);
}

// Batched decode, streamed (ops/deltanet.rs RowsKernel::Stream). In gdn_decode_rows every
// (head, column slice, row) is a short-lived block: it requests its 16 KB of state, then runs a
// serial chain (the position, the conv window, the conv, the norms, two block reductions, the
// cluster exchange of the gated RMSNorm) and only then stores, so most of an SM's time has little
// in flight (~1.7 TB/s at 64 rows). Here a block owns value head j = blockIdx.x for the rows
// y, y + G, ... (y = blockIdx.y, G = gridDim.y, one wave: ops/deltanet.rs stream_grid) and walks
// them as units u = (row n, slice sp) = (u / GDN_NS, u % GDN_NS), a slice being the CW = dv/GDN_NS
// columns one gdn_decode_rows block owns. The state slice of unit u + GDN_NBUF − 1 (and, with the
// first slice of a row, the row's conv window and inputs) is requested (cp.async, one group per
// unit, into a ring of GDN_NBUF buffers; L2 evict-first: read once) while unit u computes, so
// (GDN_NBUF − 1) slices per block are in flight all the time; the new state is stored straight
// from registers with streaming stores. One block holds the whole head: the conv, the norms and
// the gates are computed once per (head, row) instead of once per slice, the new conv window is
// stored right after the conv, and the gated RMSNorm's sum of squares is a block reduction (no
// cluster, no cluster barrier, whose release would wait for the previous unit's state stores).
//
// The same per-element arithmetic as gdn_decode_rows on sm_90+ (bit-identical results): unit
// (n, sp) maps its threads to (column, row group) exactly as block sp of that kernel, with the
// same partial sums in the same order, and the norm adds each slice's output-warp sums of squares
// in slice order, as the cluster does. The conv state obeys the same two-buffer rule (each row
// is its own slot); rows_slot, the positions, the states and the conv weights are requested
// before pdl_enter(), this step's q/k/v, z, b and a after it; nothing is written before it.
//
// Dynamic shared memory (stream_smem in ops/deltanet.rs), f32:
//   st   [GDN_NBUF][dk·CW]  state slices, row-major [dk][CW] (16-byte aligned: first)
//   rowb [2][RB]            per row (n & 1): old conv window [KC−1][nch] | x [nch] | z [dv] | b, a
//   wts  [KC][nch]          conv weights of the head's channels (q, k of key head kh; v of head j)
//   vals [nch]              conv + SiLU of the current row
//   ocs  [dv]               pre-norm outputs of the current row
//   qn   [dk], kn [dk]      its normalised q (with the 1/√dk scale) and k
// with nch = 2·dk + dv and RB = KC·nch + dv + 2.

static_assert(GDN_NBUF >= 2 && GDN_NBUF <= 6, "the stream ring waits with cp.async.wait_group 0..4");
// A row's buffer rowb[n & 1] is refilled by the request of unit (n + 2)·GDN_NS, which must come
// after the row's last read of it (its output, in unit n·GDN_NS + GDN_NS − 1).
static_assert(GDN_NBUF <= GDN_NS + 1, "the stream ring may look at most one row ahead");

// 16-byte asynchronous copy global -> shared through L2 only, with an L2 cache policy.
DEVI void gdn_cp_async16_pol(void* smem, const void* gmem, u64 pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "l"(pol) : "memory");
}

DEVI u64 gdn_policy_evict_first() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}

// Waits until this thread's copies of units 0..u have landed. Groups: the prologue's one (units
// 0..GDN_NBUF−2), then one per iteration (iteration i: unit i + GDN_NBUF − 1); at iteration u,
// before its own commit, all but the newest min(u, GDN_NBUF − 2) groups must be complete.
DEVI void gdn_stream_wait(int u) {
    const int n = min(u, GDN_NBUF - 2);
    if (n >= 4)
        cp_async_wait<4>();
    else if (n == 3)
        cp_async_wait<3>();
    else if (n == 2)
        cp_async_wait<2>();
    else if (n == 1)
        cp_async_wait<1>();
    else
        cp_async_wait<0>();
}

struct GdnStreamSmem {
    float* part;   // [GDN_THREADS] kᵀS partials
    float* part2;  // [GDN_THREADS] qᵀS partials
    float* ssq;    // [GDN_NS][2] sums of squares of the row's output warps, [slice][warp]
    int* rslot;    // [GDN_SROWS] the block's rows: state slot (negative: padding)
    int* rpos;     // [GDN_SROWS] and position
};

template <int KCT, int DKT, int DVT>
DEVI void gdn_stream_body(const GdnDecodeArgs& a, const GdnStreamSmem& sm) {
    extern __shared__ __align__(16) float gdn_rs_sm[];
    // Blocks of GDN_THREADS threads: with the shape's constants the compiler then knows every
    // thread's row group and state rows exist (act, i < dk), and drops those per-row tests and
    // their branches (the hot loop 1,745 -> 1,019 SASS instructions).
    __builtin_assume(threadIdx.x < GDN_THREADS);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int j = blockIdx.x, y = blockIdx.y, G = gridDim.y;
    const int dk = DKT > 0 ? DKT : a.dk, dv = DVT > 0 ? DVT : a.dv, C = a.C, KC = KCT > 0 ? KCT : a.KC;
    const int rvk = a.Hv / a.Hk, kh = j / rvk, key_dim = a.Hk * dk;
    const int CW = dv / GDN_NS, nch = 2 * dk + dv, RG = GDN_THREADS / CW;
    const int c = tid % CW, rg = tid / CW;
    const bool act = rg < RG;
    const int nr = y < a.rows ? (a.rows - y + G - 1) / G : 0;  // rows y, y + G, ...: at most GDN_SROWS
    const int U = nr * GDN_NS;
    const int SB = dk * CW, RB = KC * nch + dv + 2;
    float* st = gdn_rs_sm;
    float* rowb = st + GDN_NBUF * SB;
    float* wts = rowb + 2 * RB;
    float* vals = wts + KC * nch;
    float* ocs = vals + nch;
    float* qn = ocs + dv;  // the row's q·(1/‖q‖)/√dk and k/‖k‖
    float* kn = qn + dk;
    constexpr bool SREG = DKT > 0 && DVT > 0;  // the slice's state rows in registers (else in place)
    for (int t = tid; t < nr; t += GDN_THREADS) {
        const int r = y + t * G, slot = a.rows_slot ? ((const int*)a.rows_slot)[r] : 0;
        sm.rslot[t] = slot;
        sm.rpos[t] = slot >= 0 ? ((const int*)a.pos_ptr)[r] : 0;
    }
    // Local conv channel i -> global channel: q of key head kh, k of kh, v of head j.
    auto chan = [&](int i) -> int {
        return i < dk ? kh * dk + i : i < 2 * dk ? key_dim + kh * dk + (i - dk) : 2 * key_dim + j * dv + (i - 2 * dk);
    };
    const float* cw_g = (const float*)a.conv_w;
    for (int i = tid; i < nch; i += GDN_THREADS) {
        const float* w = cw_g + (i64)chan(i) * KC;
#pragma unroll(KCT > 0 ? KCT : 1)
        for (int tap = 0; tap < KC; ++tap) gdn_cp_async4(&wts[tap * nch + i], w + tap);
    }
    __syncthreads();  // rslot, rpos
    const u64 pol = gdn_policy_evict_first();
    const float* S0 = (const float*)a.state + (i64)j * dk * dv;
    // Unit k's state slice; with a row's first slice also its old conv window (both written by
    // an earlier step: allowed before pdl_enter).
    auto request_state = [&](int k) {
        if (k >= U) return;
        const int n = k / GDN_NS, sp = k % GDN_NS, slot = sm.rslot[n];
        if (slot < 0) return;
        const float* S = S0 + (i64)slot * a.rec_stride + sp * CW;
        float* dst = st + (k % GDN_NBUF) * SB;
        const int cq = CW / 4;  // 16-byte pieces per state row of the slice
        if constexpr (SREG) {
            // Piece q = tid + p·GDN_THREADS is row i0 + p·PR, the thread's column e0 in every p:
            // one base address a unit, the pieces at constant offsets.
            constexpr int CQ = DVT / GDN_NS / 4, PR = GDN_THREADS / CQ;
            static_assert(GDN_THREADS % CQ == 0 && DKT % PR == 0, "whole state rows per pass of the block");
            const int i0 = tid / CQ, e0 = 4 * (tid % CQ);
            const float* src = S + i0 * DVT + e0;
            float* d = dst + i0 * (DVT / GDN_NS) + e0;
#pragma unroll
            for (int p = 0; p < DKT / PR; ++p) gdn_cp_async16_pol(d + p * PR * (DVT / GDN_NS), src + p * PR * DVT, pol);
        } else {
            for (int q = tid; q < dk * cq; q += GDN_THREADS) {
                const int i = q / cq, e = 4 * (q % cq);
                gdn_cp_async16_pol(dst + i * CW + e, S + (i64)i * dv + e, pol);
            }
        }
        if (sp == 0) {
            const float* cs = (const float*)a.conv_state + (i64)slot * a.conv_stride + (i64)(sm.rpos[n] & 1) * (KC - 1) * C;
            float* win = rowb + (n & 1) * RB;
            for (int i = tid; i < nch; i += GDN_THREADS) {
                const int ch = chan(i);
#pragma unroll(KCT > 0 ? KCT : 1)
                for (int tap = 0; tap < KC - 1; ++tap) gdn_cp_async4(&win[tap * nch + i], cs + (i64)tap * C + ch);
            }
        }
    };
    // Row n's inputs of this step: x (q/k/v channels), z, b, a (after pdl_enter).
    auto request_inputs = [&](int n) {
        if (sm.rslot[n] < 0) return;
        const i64 r = y + n * G;
        float* rb = rowb + (n & 1) * RB;
        const float* x = (const float*)a.qkv + r * a.ld_qkv;
        for (int i = tid; i < nch; i += GDN_THREADS) gdn_cp_async4(&rb[(KC - 1) * nch + i], x + chan(i));
        const float* z = (const float*)a.z + r * a.ld_z + (i64)j * dv;
        for (int i = tid; i < dv; i += GDN_THREADS) gdn_cp_async4(&rb[KC * nch + i], z + i);
        if (tid == 0) {
            gdn_cp_async4(&rb[KC * nch + dv], (const float*)a.b + r * a.ld_ba + j);
            gdn_cp_async4(&rb[KC * nch + dv + 1], (const float*)a.a + r * a.ld_ba + j);
        }
    };
    // Prologue: units 0..GDN_NBUF−2 in one group (with the conv weights).
    for (int k = 0; k < GDN_NBUF - 1; ++k) request_state(k);
    const float alog = ((const float*)a.a_log)[j], dtb = ((const float*)a.dt_bias)[j];
    const float nw = tid < dv ? ((const float*)a.norm_w)[tid] : 0.f;
    pdl_enter();
    for (int n = 0; n * GDN_NS <= GDN_NBUF - 2 && n < nr; ++n) request_inputs(n);
    cp_async_commit();
    const float qs = 1.f / sqrtf((float)dk);
    const int OW = (CW + 31) / 32;  // output warps of a slice (CW <= 64)
    float iq = 0.f, ik = 0.f, beta = 0.f, alpha = 0.f;
    for (int u = 0; u < U; ++u) {
        const int n = u / GDN_NS, sp = u % GDN_NS, slot = sm.rslot[n];
        gdn_stream_wait(u);
        __syncthreads();  // unit u's copies (all threads') have landed; unit u − 1 is done with its buffers
        {
            const int k = u + GDN_NBUF - 1;  // into the buffer unit u − 1 used
            request_state(k);
            if (k < U && k % GDN_NS == 0) request_inputs(k / GDN_NS);
            cp_async_commit();  // one group per iteration, empty or not
        }
        float* out = (float*)a.out + (i64)(y + n * G) * a.ld_out + (i64)j * dv;
        if (slot < 0) {  // padding (the same for the whole block): zeros, no state
            if (sp == 0)
                for (int i = tid; i < dv; i += GDN_THREADS) out[i] = 0.f;
            continue;
        }
        const float* rb = rowb + (n & 1) * RB;
        if (sp == 0) {
            // Conv + SiLU of the row's channels, and the new conv window (buffer (pos+1)&1; the q/k
            // channels by the first value head of the key head only).
            float* cso = (float*)a.conv_state + (i64)slot * a.conv_stride + (i64)((sm.rpos[n] + 1) & 1) * (KC - 1) * C;
            for (int i = tid; i < nch; i += GDN_THREADS) {
                const float* wi = rb + i;    // old window tap t: wi[t·nch]; x: wi[(KC−1)·nch]
                const float* wt = wts + i;   // weight t: wt[t·nch]
                float acc = 0.f;
#pragma unroll(KCT > 0 ? KCT : 1)
                for (int tap = 0; tap < KC - 1; ++tap) acc += wt[tap * nch] * wi[tap * nch];
                acc += wt[(KC - 1) * nch] * wi[(KC - 1) * nch];
                vals[i] = siluf_(acc);
                if (i >= 2 * dk || j % rvk == 0) {
                    const int ch = chan(i);
#pragma unroll(KCT > 0 ? KCT : 1)
                    for (int r2 = 0; r2 + 1 < KC - 1; ++r2) cso[(i64)r2 * C + ch] = wi[(r2 + 1) * nch];
                    if (KC > 1) cso[(i64)(KC - 2) * C + ch] = wi[(KC - 1) * nch];
                }
            }
            __syncthreads();
            // L2 norms of q and k (every warp, as in gdn_decode_body), the gates.
            const float* q = vals;
            const float* k = vals + dk;
            float sq = 0.f, sk = 0.f;
#pragma unroll 4
            for (int e = lane; e < dk; e += 32) {
                sq += q[e] * q[e];
                sk += k[e] * k[e];
            }
            sq = warp_sum(sq);
            sk = warp_sum(sk);
            iq = 1.f / sqrtf(sq + 1e-6f);
            ik = 1.f / sqrtf(sk + 1e-6f);
            const float bj = rb[KC * nch + dv], aj = rb[KC * nch + dv + 1];
            beta = 1.f / (1.f + expf(-bj));
            const float g = -expf(alog) * softplusf_(aj + dtb);
            alpha = expf(g);
            // The normalised q and k once a row (the products gdn_decode_rows forms per use).
            for (int i = tid; i < dk; i += GDN_THREADS) {
                qn[i] = (q[i] * iq) * qs;
                kn[i] = k[i] * ik;
            }
            __syncthreads();
        }
        const float* v = vals + 2 * dk + sp * CW;
        float* buf = st + (u % GDN_NBUF) * SB + c;
        float s[GDN_MAXR];
        auto sv = [&](int m) -> float& {
            if constexpr (SREG)
                return s[m];
            else
                return buf[(rg + m * RG) * CW];
        };
        if constexpr (SREG) {
#pragma unroll
            for (int m = 0; m < GDN_MAXR; ++m) {
                const int i = rg + m * RG;
                s[m] = (act && i < dk) ? buf[i * CW] : 0.f;
            }
        }
        // S ← α·S; kᵀS of the slice's columns.
        float mem = 0.f;
#pragma unroll
        for (int m = 0; m < GDN_MAXR; ++m) {
            const int i = rg + m * RG;
            if (act && i < dk) {
                sv(m) *= alpha;
                mem += kn[i] * sv(m);
            }
        }
        sm.part[tid] = act ? mem : 0.f;
        __syncthreads();
        float r = 0.f;
        if (act) {
#pragma unroll 8
            for (int q2 = 0; q2 < RG; ++q2) r += sm.part[q2 * CW + c];
        }
        const float delta = act ? (v[c] - r) * beta : 0.f;
        // S ← S + k ⊗ δ, o = qᵀS; the new state slice.
        float o = 0.f;
#pragma unroll
        for (int m = 0; m < GDN_MAXR; ++m) {
            const int i = rg + m * RG;
            if (act && i < dk) {
                sv(m) += kn[i] * delta;
                o += qn[i] * sv(m);
            }
        }
        sm.part2[tid] = act ? o : 0.f;
        // Row i = rg + m·RG at a constant offset from the thread's first (with the Qwen shape).
        float* Sd = (float*)a.state + (i64)slot * a.rec_stride + (i64)j * dk * dv + (i64)rg * dv + sp * CW + c;
#pragma unroll
        for (int m = 0; m < GDN_MAXR; ++m) {
            const int i = rg + m * RG;
            if (act && i < dk) __stcs(Sd + m * RG * dv, sv(m));
        }
        __syncthreads();
        // Threads tid < CW (row group 0) own the slice's output columns.
        float oc = 0.f;
        if (tid < CW) {
#pragma unroll 8
            for (int q2 = 0; q2 < RG; ++q2) oc += sm.part2[q2 * CW + tid];
            ocs[sp * CW + tid] = oc;
        }
        const float ssw = warp_sum(oc * oc);
        if (lane == 0 && warp < OW) sm.ssq[sp * 2 + warp] = ssw;
        if (sp == GDN_NS - 1) {
            // Gated RMSNorm over the head's dv columns: the slices' sums in slice order.
            __syncthreads();
            if (tid < dv) {
                float ss = 0.f;
                for (int t = 0; t < GDN_NS; ++t)
                    for (int w = 0; w < OW; ++w) ss += sm.ssq[t * 2 + w];
                const float inv = 1.f / sqrtf(ss / dv + a.eps);
                out[tid] = ocs[tid] * inv * nw * siluf_(rb[KC * nch + tid]);
            }
        }
    }
    cp_async_wait<0>();  // the groups after the last unit are empty; nothing is left in flight
}

// At most 80 registers (ptxas -v: 80, no spills; with the 128 that two blocks per SM would allow,
// ptxas spills). Shared memory allows two blocks per SM for the Qwen shape anyway.
extern "C" __global__ void __launch_bounds__(GDN_THREADS, 3) gdn_decode_rows_stream(const GdnDecodeArgs a) {
    __shared__ float part[GDN_THREADS], part2[GDN_THREADS];
    __shared__ float ssq[GDN_NS * 2];
    __shared__ int rslot[GDN_SROWS], rpos[GDN_SROWS];
    const GdnStreamSmem sm{part, part2, ssq, rslot, rpos};
    if (a.KC == 4 && a.dk == 128 && a.dv == 128)  // Qwen3.5/3.6, Qwen3-Next
        gdn_stream_body<4, 128, 128>(a, sm);
    else
        gdn_stream_body<0, 0, 0>(a, sm);
}
