// Gated GQA attention (docs/model.md §4) over a paged KV cache.
//
// Shapes: T query tokens of one sequence at positions start..start+T-1; Hq query heads and Hkv
// KV heads of D dims, G = Hq/Hkv; R rotary dims (pairs i, i+R/2). KV pool: bf16
// [nblk][Hkv][BS][D] for K and for V; `table` maps position/BS to a pool block.
// Query rows are (token, head-in-group) pairs, row = tq*G + hg, so the G heads that share a KV
// head are processed together and every K/V tile is loaded once for all of them.

// RoPE factors of a lane at `pos`: for e = lane + 32 i < R (i < 8, D ≤ 256), the cosine and sine
// of pos · inv_freq[e mod R/2]. They depend on the position only, so decode computes them before
// waiting for the previous kernel, once for all the rows of a head group.
struct Rope {
    float c[8], s[8];
};
DEVI Rope rope_lane(int pos, int R, const float* inv_freq) {
    const int lane = threadIdx.x & 31, half = R / 2;
    Rope r;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int e = lane + 32 * i;
        r.c[i] = 1.f;
        r.s[i] = 0.f;
        if (e < R) sincosf((float)pos * inv_freq[e < half ? e : e - half], &r.s[i], &r.c[i]);
    }
    return r;
}

// One head row of D values: RMSNorm with multiplier weights nw, partial RoPE (pairs i, i + R/2
// of the first R dims, factors from rope_lane), rounded to bf16 into dst. One warp; y: D floats
// of scratch.
DEVI void prep_row(const float* src, const float* nw, int D, int R, const Rope& rp, float eps, float* y, __nv_bfloat16* dst) {
    const int lane = threadIdx.x & 31, half = R / 2;
    float v[8], w[8];  // D ≤ 256: the row and the norm weights in one round of loads
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < D ? src[e] : 0.f;
        w[i] = e < D ? nw[e] : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += v[i] * v[i];
    ss = warp_sum(ss);
    const float inv = 1.f / sqrtf(ss / D + eps);
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (lane + 32 * i < D) y[lane + 32 * i] = v[i] * inv * w[i];
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int e = lane + 32 * i;
        if (e < D) {
            float o = y[e];
            if (e < R) {
                const int j = e < half ? e : e - half;
                o = e < half ? y[e] * rp.c[i] - y[e + half] * rp.s[i] : y[e] * rp.c[i] + y[j] * rp.s[i];
            }
            dst[e] = __float2bfloat16_rn(o);
        }
    }
    __syncwarp();
}

// Appends token t's key (normalised, rotated) and value of KV head kh to the cache. One warp.
// The value's loads are issued with the key's, before any store.
DEVI void prep_kv(const PrepArgs& a, int t, int kh, int pos, const Rope& rp, float* y) {
    const int D = a.D, lane = threadIdx.x & 31;
    const int blk = ((const int*)a.table)[pos / a.BS];
    const i64 off = (((i64)blk * a.Hkv + kh) * a.BS + pos % a.BS) * D;
    const float* vs = (const float*)a.v + (i64)t * a.ldk + kh * D;
    float vv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) vv[i] = lane + 32 * i < D ? vs[lane + 32 * i] : 0.f;
    prep_row((const float*)a.k + (i64)t * a.ldk + kh * D, (const float*)a.k_norm, D, a.R, rp, a.eps, y,
             (__nv_bfloat16*)a.kpool + off);
    __nv_bfloat16* vd = (__nv_bfloat16*)a.vpool + off;
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (lane + 32 * i < D) vd[lane + 32 * i] = __float2bfloat16_rn(vv[i]);
}

// A batched launch (spans != 0) runs one sequence's span per grid z (AttnSpan, built by
// layers.rs): its rows of the projections from row0 on, its query rows, block table, length and
// start.
DEVI PrepArgs prep_span(PrepArgs a) {
    if (a.spans) {
        const AttnSpan s = ((const AttnSpan*)a.spans)[blockIdx.z];
        a.qg += (u64)s.row0 * a.ldq * 4;
        a.k += (u64)s.row0 * a.ldk * 4;
        a.v += (u64)s.row0 * a.ldk * 4;
        a.q_out = s.q;
        a.table = s.table;
        a.T = s.T;
        a.start = s.start;
    }
    return a;
}

// q/k RMSNorm (multiplier weights), partial RoPE at the token's position, q -> bf16 [T][Hq][D],
// K/V -> the cache. One warp per (token, head); heads Hq.. Hq+Hkv-1 are the KV heads.
extern "C" __global__ void __launch_bounds__(128) attn_prep(const PrepArgs a0) {
    __shared__ float buf[4][256];
    pdl_enter();
    const PrepArgs a = prep_span(a0);
    const int warp = threadIdx.x >> 5;
    const int t = blockIdx.x, h = blockIdx.y * 4 + warp;
    if (h >= a.Hq + a.Hkv || t >= a.T) return;
    const int pos = (a.pos_ptr ? *(const int*)a.pos_ptr : a.start) + t;
    const Rope rp = rope_lane(pos, a.R, (const float*)a.inv_freq);
    if (h < a.Hq) {
        prep_row((const float*)a.qg + (i64)t * a.ldq + h * a.qstride, (const float*)a.q_norm, a.D, a.R, rp, a.eps, buf[warp],
                 (__nv_bfloat16*)a.q_out + ((i64)t * a.Hq + h) * a.D);
    } else {
        prep_kv(a, t, h - a.Hq, pos, rp, buf[warp]);
    }
}

// One warp's online-softmax update over a KV tile of TK keys in shared memory (row stride D+8).
// Qs: the warp's 16 query rows (row stride D+8). key0: position of the tile's first key.
// m is kept in log2 units (score · scale_log2). MASKED: keys ≥ nkeys or after a row's position
// are dropped; callers pass false for tiles that hold neither (most tiles of a long prefill).
// The output is rescaled only when some row's maximum moved (warp-uniform test): with a long
// context the maximum settles after the first tiles, and the D/2 multiplies per lane and tile
// are a fifth of the tile's instructions at D = 256.
template <int D, int TK, bool MASKED = true>
DEVI void attn_tile(const __nv_bfloat16* Qs, const __nv_bfloat16* Ks, const __nv_bfloat16* Vs, float (&o)[D / 8][4], float* m,
                    float* l, int key0, int nkeys, int pos0, int pos1, float scale_log2) {
    constexpr int ST = D + 8;
    const int lane = threadIdx.x & 31, t4 = lane & 3;
    float s[TK / 8][4];
#pragma unroll
    for (int i = 0; i < TK / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a0, a1, a2, a3;
        ldsm_x4(a0, a1, a2, a3, Qs + (lane & 15) * ST + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < TK / 16; ++np) {
            u32 b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, Ks + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * ST + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_bf16(s[2 * np], a0, a1, a2, a3, b0, b1);
            mma_bf16(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
        }
    }
    // Row maxima of the raw scores (scale_log2 > 0 keeps the order, so max · scale is the max of
    // the scaled scores).
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int nt = 0; nt < TK / 8; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float v = s[nt][c];
            if (MASKED) {
                int key = key0 + nt * 8 + 2 * t4 + (c & 1);
                int pr = (c >> 1) ? pos1 : pos0;
                if (key >= nkeys || key > pr) v = NEG_INF;
                s[nt][c] = v;
            }
            mx[c >> 1] = fmaxf(mx[c >> 1], v);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    float base[2], corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mn = fmaxf(m[r], mx[r] * scale_log2);
        base[r] = mn == NEG_INF ? 0.f : mn;
        corr[r] = exp2f(m[r] - base[r]);
        m[r] = mn;
        l[r] *= corr[r];
    }
#pragma unroll
    for (int nt = 0; nt < TK / 8; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float p = exp2f(fmaf(s[nt][c], scale_log2, -base[c >> 1]));
            s[nt][c] = p;
            l[c >> 1] += p;
        }
    }
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            o[dt][0] *= corr[0]; o[dt][1] *= corr[0];
            o[dt][2] *= corr[1]; o[dt][3] *= corr[1];
        }
    }
#pragma unroll
    for (int ks = 0; ks < TK / 16; ++ks) {
        u32 a0 = pack_bf16(s[2 * ks][0], s[2 * ks][1]), a1 = pack_bf16(s[2 * ks][2], s[2 * ks][3]);
        u32 a2 = pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]), a3 = pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(b0, b1, b2, b3, Vs + (ks * 16 + (lane & 15)) * ST + dp * 16 + (lane >> 4) * 8);
            mma_bf16(o[2 * dp], a0, a1, a2, a3, b0, b1);
            mma_bf16(o[2 * dp + 1], a0, a1, a2, a3, b2, b3);
        }
    }
}

// Copies keys [key0, key0+TK) of one KV head into shared memory (zeros beyond nkeys).
// nthr threads starting at thread `tid` take part.
template <int D, int TK>
DEVI void load_kv_tile(__nv_bfloat16* Ks, __nv_bfloat16* Vs, const AttnArgs& a, int kvh, int key0, int nkeys, int tid, int nthr) {
    constexpr int ST = D + 8, CH = D / 8;
    const int blk = ((const int*)a.table)[key0 / a.BS];
    const i64 base = (((i64)blk * a.Hkv + kvh) * a.BS + key0 % a.BS) * D;
    const __nv_bfloat16* kg = (const __nv_bfloat16*)a.kpool + base;
    const __nv_bfloat16* vg = (const __nv_bfloat16*)a.vpool + base;
    for (int c = tid; c < TK * CH; c += nthr) {
        int r = c / CH, ch = c % CH;
        bool ok = key0 + r < nkeys;
        cp_async16(Ks + r * ST + ch * 8, kg + (ok ? r * D + ch * 8 : 0), ok);
        cp_async16(Vs + r * ST + ch * 8, vg + (ok ? r * D + ch * 8 : 0), ok);
    }
}

// Prefill: a block handles 64 query rows (4 warps x 16) of one KV head against all earlier keys,
// with K/V tiles shared by the 4 warps and double-buffered. grid = (ceil(T*G/64), Hkv).
//
// SPLIT (split-KV, for few query tiles over a long context): grid.z = a.nsplit, and block z
// takes its own share z of the key tiles its rows need (tiles [z·n/nsplit, (z+1)·n/nsplit) of
// its n), writing the unnormalised output and the softmax state (m in log2 units, l) of each
// row to the partials, [Hkv][nsplit][T·G] rows; attn_prefill_combine merges them. A share with
// no tile writes m = -inf, l = 0 only (the combine reads no output of it).
template <int D, int TK, bool SPLIT = false>
DEVI void attn_prefill_body(const AttnArgs& a) {
    constexpr int ST = D + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Qs = (__nv_bfloat16*)smem;
    __nv_bfloat16* KV = Qs + 64 * ST;  // [2 stages][K, V][TK][ST]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int kvh = blockIdx.y, G = a.G, D_ = D;
    const int row_base = blockIdx.x * 64;
    const int nrows = a.T * G;
    int t_begin = 0, t_end = 0;  // SPLIT: this block's share of its key tiles
    if constexpr (SPLIT) {
        pdl_enter();
        const int z = blockIdx.z;
        const int n = (a.start + (min(nrows, row_base + 64) - 1) / G + TK) / TK;
        t_begin = (int)((i64)n * z / a.nsplit);
        t_end = (int)((i64)n * (z + 1) / a.nsplit);
        if (t_begin >= t_end) {
            const i64 pbase = ((i64)kvh * a.nsplit + z) * nrows;
            for (int r = threadIdx.x; r < 64; r += 128) {
                if (row_base + r < nrows) {
                    ((float*)a.part_ml)[(pbase + row_base + r) * 2] = NEG_INF;
                    ((float*)a.part_ml)[(pbase + row_base + r) * 2 + 1] = 0.f;
                }
            }
            return;
        }
    }
    // Q rows -> shared memory.
    for (int c = threadIdx.x; c < 64 * (D / 8); c += 128) {
        int r = c / (D / 8), ch = c % (D / 8);
        int R = row_base + r;
        bool ok = R < nrows;
        int tq = ok ? R / G : 0, hg = ok ? R % G : 0;
        const __nv_bfloat16* src = (const __nv_bfloat16*)a.q + ((i64)tq * a.Hq + kvh * G + hg) * D_ + ch * 8;
        cp_async16(Qs + r * ST + ch * 8, src, ok);
    }
    const int last_row = min(nrows, row_base + 64) - 1;
    const int nkeys = a.start + last_row / G + 1;
    const int ntiles = (nkeys + TK - 1) / TK;
    if constexpr (!SPLIT) t_end = ntiles;
    load_kv_tile<D, TK>(KV, KV + TK * ST, a, kvh, t_begin * TK, nkeys, threadIdx.x, 128);
    cp_async_commit();

    const int R0 = row_base + warp * 16 + g, R1 = R0 + 8;
    const int pos0 = R0 < nrows ? a.start + R0 / G : -1;
    const int pos1 = R1 < nrows ? a.start + R1 / G : -1;
    const int warp_last = min(nrows, row_base + warp * 16 + 16) - 1;
    const int warp_maxpos = warp_last >= row_base + warp * 16 ? a.start + warp_last / G : -1;
    const int warp_minpos = a.start + (row_base + warp * 16) / G;  // of its first row (when it has rows)
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

    for (int ti = t_begin; ti < t_end; ++ti) {
        const int st = (ti - t_begin) & 1;
        if (ti + 1 < t_end) {
            __nv_bfloat16* nb = KV + (st ^ 1) * 2 * TK * ST;
            load_kv_tile<D, TK>(nb, nb + TK * ST, a, kvh, (ti + 1) * TK, nkeys, threadIdx.x, 128);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const __nv_bfloat16* Ks = KV + st * 2 * TK * ST;
        if (ti * TK <= warp_maxpos) {
            // Unmasked when every key of the tile exists and precedes the warp's first row
            // (rows past the end never get stored, so their scores may be anything finite).
            if ((ti + 1) * TK <= nkeys && (ti + 1) * TK - 1 <= warp_minpos)
                attn_tile<D, TK, false>(Qs + warp * 16 * ST, Ks, Ks + TK * ST, o, m, l, ti * TK, nkeys, pos0, pos1, a.scale_log2);
            else
                attn_tile<D, TK, true>(Qs + warp * 16 * ST, Ks, Ks + TK * ST, o, m, l, ti * TK, nkeys, pos0, pos1, a.scale_log2);
        }
        __syncthreads();
    }
    // Normalise, gate and store.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if constexpr (SPLIT) {
        // The partials of this share: output as accumulated, (m, l) per row.
        const i64 pbase = ((i64)kvh * a.nsplit + blockIdx.z) * nrows;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int R = r ? R1 : R0;
            if (R >= nrows) continue;
            float* prow = (float*)a.part_o + (pbase + R) * D;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) *(float2*)(prow + dt * 8 + 2 * t4) = make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
            if (t4 == 0) {
                ((float*)a.part_ml)[(pbase + R) * 2] = m[r];
                ((float*)a.part_ml)[(pbase + R) * 2 + 1] = l[r];
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int R = r ? R1 : R0;
        if (R >= nrows) continue;
        int tq = R / G, head = kvh * G + R % G;
        float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        float* orow = (float*)a.out + (i64)tq * a.Hq * D + head * D;
        const float* grow = a.gate ? (const float*)a.gate + (i64)tq * a.ldg + head * 2 * D + D : nullptr;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            int d = dt * 8 + 2 * t4;
            float v0 = o[dt][2 * r] * inv, v1 = o[dt][2 * r + 1] * inv;
            if (grow) { v0 *= sigmoidf_(grow[d]); v1 *= sigmoidf_(grow[d + 1]); }
            *(float2*)(orow + d) = make_float2(v0, v1);
        }
    }
}

// Decode (one query token): grid = (Hkv, nsplit, ceil(G/16)). The block's split of the keys is
// shared by its 4 warps tile by tile (each warp its own tiles, double-buffered); the warps'
// partial softmax states are merged in shared memory and written as one partial per block.
//
// The block also does attn_prep's work for itself (`p`, one token): it normalises and rotates its
// G query heads straight from the projection into shared memory, and the block whose split holds
// the newest key appends that key and value to the cache before anyone reads it (every other
// tile holds keys of earlier steps only, so a warp requests its first such tile before waiting
// for the previous kernel).
template <int D, int TK>
DEVI void attn_decode_body(const AttnArgs& a, const PrepArgs& p, const int z, const int nz) {
    constexpr int ST = D + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Qs = (__nv_bfloat16*)smem;                 // [16][ST]
    __nv_bfloat16* KVw = Qs + 16 * ST;                         // per warp 2 x [K, V][TK][ST]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int kvh = blockIdx.x, split = blockIdx.y, G = a.G;
    // The position comes from the previous step (the sampler) or the host: readable before the wait.
    const int pos = a.pos_ptr ? *(const int*)a.pos_ptr : a.start;
    const int nkeys = pos + 1;
    const int ntiles = (nkeys + TK - 1) / TK;
    // Tiles per split: all splits busy on long contexts; on short ones at least min_tiles each,
    // so that the combine merges fewer partials (the rest are empty, skipped by the combine).
    const int per = max((ntiles + a.nsplit - 1) / a.nsplit, max(a.min_tiles, 1));
    const int t_begin = split * per, t_end = min(ntiles, t_begin + per);
    const i64 pidx_ = ((i64)kvh * nz + z) * a.nsplit + split;
    if (t_begin >= t_end) {  // empty split: only the softmax state, which the combine skips
        pdl_enter();
        if (threadIdx.x < 16) {
            ((float*)a.part_ml)[(pidx_ * 16 + threadIdx.x) * 2] = NEG_INF;
            ((float*)a.part_ml)[(pidx_ * 16 + threadIdx.x) * 2 + 1] = 0.f;
        }
        return;
    }
    __nv_bfloat16* Kw = KVw + warp * 4 * TK * ST;  // buffer b: K at Kw + 2b·TK·ST, V after it
    const int ti0 = t_begin + warp, last = ntiles - 1;
    const bool early = ti0 < t_end && ti0 != last;  // a complete tile of earlier keys
    if (early) load_kv_tile<D, TK>(Kw, Kw + TK * ST, a, kvh, ti0 * TK, nkeys, lane, 32);
    cp_async_commit();
    const Rope rp = rope_lane(pos, p.R, (const float*)p.inv_freq);  // weights and the position only
    pdl_enter();
    {
        float* y = (float*)(Kw + 2 * TK * ST);  // scratch in buffer 1, before any tile uses it
        for (int r = warp; r < 16; r += 4) {
            const int hg = z * 16 + r;
            if (hg < G) {
                const int h = kvh * G + hg;
                prep_row((const float*)p.qg + h * p.qstride, (const float*)p.q_norm, D, p.R, rp, p.eps, y, Qs + r * ST);
            } else {
                for (int e = lane; e < D; e += 32) Qs[r * ST + e] = __float2bfloat16_rn(0.f);
            }
        }
        if (warp == 0 && last / per == split) {
            prep_kv(p, 0, kvh, pos, rp, y);
            __threadfence();
        }
        __syncthreads();
    }
    if (!early && ti0 < t_end) load_kv_tile<D, TK>(Kw, Kw + TK * ST, a, kvh, ti0 * TK, nkeys, lane, 32);
    cp_async_commit();
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    // Tile ti sits in buffer b while tile ti + 4 loads into the other one.
    int b = 0;
    for (int ti = ti0; ti < t_end; ti += 4) {
        __nv_bfloat16* nb = Kw + 2 * (b ^ 1) * TK * ST;
        if (ti + 4 < t_end) load_kv_tile<D, TK>(nb, nb + TK * ST, a, kvh, (ti + 4) * TK, nkeys, lane, 32);
        cp_async_commit();
        cp_async_wait<1>();  // all but the newest group: tile ti is in
        __syncwarp();
        const __nv_bfloat16* cb = Kw + 2 * b * TK * ST;
        attn_tile<D, TK>(Qs, cb, cb + TK * ST, o, m, l, ti * TK, nkeys, pos, pos, a.scale_log2);
        __syncwarp();
        b ^= 1;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    // Merge the 4 warps: per row the max m; each warp stores its rescaled o in its own slice
    // of shared memory (the K/V buffers, no longer read), then all threads add the 4 slices in
    // warp order.
    __syncthreads();
    float* Ms = (float*)(Qs + 16 * ST);           // [4][16] m, [4][16] l, then O [4][16][D]
    float* Ls = Ms + 64;
    float* Os = Ls + 64;
    if (t4 == 0) {
        Ms[warp * 16 + g] = m[0]; Ms[warp * 16 + g + 8] = m[1];
        Ls[warp * 16 + g] = l[0]; Ls[warp * 16 + g + 8] = l[1];
    }
    __syncthreads();
    float sc[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int row = g + 8 * r;
        float M = fmaxf(fmaxf(Ms[row], Ms[16 + row]), fmaxf(Ms[32 + row], Ms[48 + row]));
        sc[r] = m[r] == NEG_INF ? 0.f : exp2f(m[r] - M);
    }
    {
        float* Ow = Os + warp * 16 * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            int d = dt * 8 + 2 * t4;
            *(float2*)(Ow + g * D + d) = make_float2(o[dt][0] * sc[0], o[dt][1] * sc[0]);
            *(float2*)(Ow + (g + 8) * D + d) = make_float2(o[dt][2] * sc[1], o[dt][3] * sc[1]);
        }
    }
    __syncthreads();
    const i64 pidx = ((i64)kvh * nz + z) * a.nsplit + split;  // partial index
    float* po = (float*)a.part_o + pidx * 16 * D;
    const int rows_here = min(16, G - z * 16);
    for (int i = threadIdx.x; i < rows_here * D; i += 128) po[i] = ((Os[i] + Os[16 * D + i]) + Os[32 * D + i]) + Os[48 * D + i];
    if (threadIdx.x < 16) {
        int row = threadIdx.x;
        float M = fmaxf(fmaxf(Ms[row], Ms[16 + row]), fmaxf(Ms[32 + row], Ms[48 + row]));
        float L = 0.f;
        for (int w = 0; w < 4; ++w) L += Ms[w * 16 + row] == NEG_INF ? 0.f : Ls[w * 16 + row] * exp2f(Ms[w * 16 + row] - M);
        ((float*)a.part_ml)[(pidx * 16 + row) * 2] = M;
        ((float*)a.part_ml)[(pidx * 16 + row) * 2 + 1] = L;
    }
}

// Merges the partial softmax states of n ≤ 256 splits of one query row, in split order: split s
// has its maximum m (log2 units) and sum l at ml(s) and ml(s) + 1, element d of its unnormalised
// output at po(s, d) (not read where m = -inf). Normalises and hands each element d to
// store(d, v), which gates and stores it. One block.
template <class MlAt, class OAt, class Store>
DEVI void merge_splits(const MlAt& ml, const OAt& po, const Store& store, const int n, const int D) {
    __shared__ float wts[256];
    __shared__ float red[32];
    const int s = threadIdx.x;
    float m = s < n ? *ml(s) : NEG_INF;
    float l = s < n ? *(ml(s) + 1) : 0.f;
    const float M = block_max(m, red);
    const float w = m == NEG_INF ? 0.f : exp2f(m - M);
    const float L = block_sum(w * l, red);
    if (s < 256) wts[s] = w;
    __syncthreads();
    const float inv = L > 0.f ? 1.f / L : 0.f;
    // Batches of CB splits: all their loads in flight together (empty splits, weight 0, are not
    // read: their partials were not written).
    constexpr int CB = 16;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.f;
        for (int sp0 = 0; sp0 < n; sp0 += CB) {
            float v[CB];
#pragma unroll
            for (int i = 0; i < CB; ++i) {
                const int sp = sp0 + i;
                v[i] = (sp < n && wts[sp] != 0.f) ? __ldcg(po(sp, d)) : 0.f;
            }
#pragma unroll
            for (int i = 0; i < CB; ++i)
                if (sp0 + i < n) acc += wts[sp0 + i] * v[i];
        }
        store(d, acc * inv);
    }
}

// Merges the decode partials of all splits, normalises, applies the output gate.
// grid = Hq, block = 256. out [Hq*D] f32 (one token); gate: q_gate row (head h at h*2D + D).
DEVI void attn_combine_body(const AttnArgs& a, const int D) {
    const int h = blockIdx.x, G = a.G, kvh = h / G, hg = h % G, z = hg / 16, row = hg % 16;
    const int nz = (G + 15) / 16;
    const float* ml = (const float*)a.part_ml;
    const i64 base = ((i64)kvh * nz + z) * a.nsplit;
    merge_splits([&](int s) { return ml + ((base + s) * 16 + row) * 2; },
                 [&](int sp, int d) { return (const float*)a.part_o + ((base + sp) * 16 + row) * D + d; },
                 [&](int d, float v) {
                     if (a.gate) v *= sigmoidf_(((const float*)a.gate)[h * 2 * D + D + d]);
                     ((float*)a.out)[h * D + d] = v;
                 },
                 a.nsplit, D);
}

extern "C" __global__ void __launch_bounds__(256) attn_combine(const AttnArgs a, int D) {
    pdl_enter();
    attn_combine_body(a, D);
}

// Merges the split-KV prefill partials (attn_prefill_body<SPLIT>): grid = (T*G, Hkv), block =
// 256; row R = tq*G + hg of KV head blockIdx.y, output and gate as in the prefill kernel.
extern "C" __global__ void __launch_bounds__(256) attn_prefill_combine(const AttnArgs a, int D) {
    pdl_enter();
    const int R = blockIdx.x, kvh = blockIdx.y, G = a.G, nrows = a.T * G;
    const int tq = R / G, head = kvh * G + R % G;
    const float* ml = (const float*)a.part_ml;
    const i64 base = (i64)kvh * a.nsplit;  // partial (kvh, s) of row R: (base + s) * nrows + R
    const float* gate = a.gate ? (const float*)a.gate + (i64)tq * a.ldg + head * 2 * D + D : nullptr;
    float* out = (float*)a.out + ((i64)tq * a.Hq + head) * D;
    merge_splits([&](int s) { return ml + ((base + s) * nrows + R) * 2; },
                 [&](int sp, int d) { return (const float*)a.part_o + ((base + sp) * nrows + R) * D + d; },
                 [&](int d, float v) { out[d] = gate ? v * sigmoidf_(gate[d]) : v; }, a.nsplit, D);
}

// Decode of one token of each of several sequences. Row r is the sequence in state slot
// rows_slot[r] (its block table ld_table entries after `table` per slot) at position pos_ptr[r];
// its q|gate, k, v rows are r·ldq / r·ldk floats in, its output row r·Hq·D, its partials after
// those of the rows before it. Padding rows (negative slot) write zeros. A null rows_slot means
// slot 0 for every row (a graph pinned to one sequence passes that sequence's block table).
struct DecodeRow {
    int r, slot;
    DEVI DecodeRow(const AttnArgs& a, int row) : r(row), slot(a.rows_slot ? ((const int*)a.rows_slot)[row] : 0) {}
    DEVI i64 parts(const AttnArgs& a) const { return (i64)r * a.Hkv * ((a.G + 15) / 16) * a.nsplit * 16; }
    DEVI AttnArgs attn(const AttnArgs& a0, int D) const {
        AttnArgs a = a0;
        a.table += (u64)slot * a0.ld_table * 4;
        a.pos_ptr += (u64)r * 4;
        if (a.gate) a.gate += (u64)r * a0.ldg * 4;
        a.out += (u64)r * a0.Hq * D * 4;
        a.part_o += (u64)(parts(a0) * D * 4);
        a.part_ml += (u64)(parts(a0) * 2 * 4);
        return a;
    }
    DEVI PrepArgs prep(const PrepArgs& p0, const AttnArgs& a) const {
        PrepArgs p = p0;
        p.table = a.table;
        p.pos_ptr = a.pos_ptr;
        p.qg += (u64)r * p0.ldq * 4;
        p.k += (u64)r * p0.ldk * 4;
        p.v += (u64)r * p0.ldk * 4;
        return p;
    }
};

extern "C" __global__ void __launch_bounds__(256) attn_combine_rows(const AttnArgs a0, int D) {
    pdl_enter();
    const DecodeRow row(a0, blockIdx.y);
    if (row.slot < 0) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) ((float*)a0.out)[((i64)row.r * a0.Hq + blockIdx.x) * D + d] = 0.f;
        return;
    }
    attn_combine_body(row.attn(a0, D), D);
}

// A batched prefill launch (spans != 0, no split-KV) runs one sequence's span per grid z
// (AttnSpan, built by layers.rs): its query, gate and output rows, block table, length and start.
DEVI AttnArgs prefill_span(AttnArgs a) {
    if (a.spans) {
        const AttnSpan s = ((const AttnSpan*)a.spans)[blockIdx.z];
        a.q = s.q;
        a.gate = s.gate;
        a.out = s.out;
        a.table = s.table;
        a.T = s.T;
        a.start = s.start;
    }
    return a;
}

#define ATTN_KERNELS(D, TKP, TKD)                                                                         \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_d##D(const AttnArgs a0) {             \
        const AttnArgs a = prefill_span(a0);                                                             \
        if ((int)blockIdx.x * 64 >= a.T * a.G) return; /* a shorter span of a batched launch */          \
        attn_prefill_body<D, TKP>(a);                                                                    \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_split_d##D(const AttnArgs a) {        \
        attn_prefill_body<D, TKP, true>(a);                                                              \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_d##D(const AttnArgs a, const PrepArgs p) { \
        attn_decode_body<D, TKD>(a, p, blockIdx.z, gridDim.z);                                           \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_rows_d##D(const AttnArgs a0, const PrepArgs p0) { \
        const int nz = (a0.G + 15) / 16;                                                                  \
        const DecodeRow row(a0, blockIdx.z / nz);                                                         \
        if (row.slot < 0) return;                                                                         \
        const AttnArgs a = row.attn(a0, D);                                                               \
        attn_decode_body<D, TKD>(a, row.prep(p0, a), blockIdx.z % nz, nz);                                \
    }

ATTN_KERNELS(32, 64, 32)
ATTN_KERNELS(64, 64, 32)
ATTN_KERNELS(128, 64, 16)
ATTN_KERNELS(256, 32, 16)
