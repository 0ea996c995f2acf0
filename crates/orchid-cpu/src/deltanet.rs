//! Gated DeltaNet core (docs/model.md §5), fp32 throughout.
//!
//! Shapes: T tokens, C = 2·Hk·dk + Hv·dv conv channels (q | k | v), K conv taps, Hk key heads
//! of dk, Hv value heads of dv; value head j reads key head j / (Hv/Hk). State S_j is [dk, dv].
//!
//! Per token:  S ← αS;  δ = β(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq   (α = e^g)
//! Spans longer than one token use the chunked form (chunk 64, from the span's start): within a
//! chunk the updates are solved as a unit-lower-triangular system, and the state is carried from
//! chunk to chunk. A capture asked for inside the span (`StatePool::capture_at`) copies the state
//! between two chunks and the conv window there: what a pass ending at that position leaves.

use orchid_model::backend::GDN_CHUNK;
use orchid_model::batch::BatchLayout;
use orchid_model::config::DeltaNetDims;
use rayon::prelude::*;

use crate::elementwise::{rms_norm_into, sigmoid, silu, softplus};
use crate::simd::{axpy, dot};
use crate::state::{CpuState, GdnState};
use crate::tensor::CpuTensor;

pub const CHUNK: usize = GDN_CHUNK;

pub struct GdnArgs<'a> {
    pub qkv: &'a CpuTensor,
    pub z: &'a CpuTensor,
    pub b: &'a CpuTensor,
    pub a: &'a CpuTensor,
    pub conv: &'a [f32],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
    pub norm: &'a [f32],
}

/// The conv state after the first `n` of the rows x [T, C]: the last K-1 rows of [conv state ; x[..n]].
fn conv_state_after(conv_state: &[f32], x: &[f32], n: usize, c: usize) -> Vec<f32> {
    let keep = conv_state.len() / c;
    let from_state = keep.saturating_sub(n);
    let mut w = conv_state[(keep - from_state) * c..].to_vec();
    w.extend_from_slice(&x[n.saturating_sub(keep) * c..n * c]);
    w
}

/// Causal depthwise conv over [conv state ; new rows] + SiLU. Updates the conv state to the
/// last K-1 pre-conv rows. x: [T, C] -> [T, C].
pub fn causal_conv_silu(x: &[f32], t: usize, c: usize, k: usize, w: &[f32], conv_state: &mut [f32]) -> Vec<f32> {
    let mut window = Vec::with_capacity((k - 1 + t) * c);
    window.extend_from_slice(conv_state);
    window.extend_from_slice(&x[..t * c]);
    let mut out = vec![0f32; t * c];
    out.par_chunks_mut(c).enumerate().for_each(|(ti, o)| {
        for (ch, oc) in o.iter_mut().enumerate() {
            let mut s = 0f32;
            for tap in 0..k {
                s += w[ch * k + tap] * window[(ti + tap) * c + ch];
            }
            *oc = silu(s);
        }
    });
    conv_state.copy_from_slice(&window[t * c..]);
    out
}

/// x / sqrt(Σx² + 1e-6) (transformers' l2norm).
fn l2_normalize(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Per-head inputs of one span after the conv: q, k [T, dk] (normalised, q scaled), v [T, dv],
/// β and g [T].
struct HeadInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    beta: Vec<f32>,
    g: Vec<f32>,
}

/// One token of the recurrence on one head's state s [dk, dv]; writes o [dv].
fn recurrent_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: f32, g: f32, o: &mut [f32]) {
    let dv = v.len();
    let alpha = g.exp();
    s.iter_mut().for_each(|x| *x *= alpha);
    let mut mem = vec![0f32; dv];
    for (i, ki) in k.iter().enumerate() {
        axpy(*ki, &s[i * dv..(i + 1) * dv], &mut mem);
    }
    let delta: Vec<f32> = v.iter().zip(&mem).map(|(v, m)| (v - m) * beta).collect();
    for (i, ki) in k.iter().enumerate() {
        axpy(*ki, &delta, &mut s[i * dv..(i + 1) * dv]);
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, qi) in q.iter().enumerate() {
        axpy(*qi, &s[i * dv..(i + 1) * dv], o);
    }
}

/// The chunked form over one head's whole span; updates s and writes out [T, dv]. Returns copies
/// of s after the first m tokens for each m of `marks` (multiples of CHUNK below T, ascending).
fn chunked(s: &mut [f32], h: &HeadInputs, dk: usize, dv: usize, out: &mut [f32], marks: &[usize]) -> Vec<Vec<f32>> {
    let t_all = h.beta.len();
    let mut at_marks = Vec::with_capacity(marks.len());
    for c0 in (0..t_all).step_by(CHUNK) {
        if marks.contains(&c0) {
            at_marks.push(s.to_vec());
        }
        let l = CHUNK.min(t_all - c0);
        let q = &h.q[c0 * dk..(c0 + l) * dk];
        let k = &h.k[c0 * dk..(c0 + l) * dk];
        let v = &h.v[c0 * dv..(c0 + l) * dv];
        let beta = &h.beta[c0..c0 + l];
        // γ_i = Σ_{m≤i} g_m
        let gamma: Vec<f32> = h.g[c0..c0 + l]
            .iter()
            .scan(0f32, |acc, &g| {
                *acc += g;
                Some(*acc)
            })
            .collect();
        let kk = |i: usize, j: usize| dot(&k[i * dk..(i + 1) * dk], &k[j * dk..(j + 1) * dk]);
        // A[i][j] = β_i (k_i·k_j) e^{γ_i−γ_j}, j < i
        let mut a = vec![0f32; l * l];
        for i in 0..l {
            for j in 0..i {
                a[i * l + j] = beta[i] * kk(i, j) * (gamma[i] - gamma[j]).exp();
            }
        }
        // (I + A) U = βV and (I + A) W = β e^γ K, by forward substitution.
        let mut u = vec![0f32; l * dv];
        let mut w = vec![0f32; l * dk];
        for i in 0..l {
            for x in 0..dv {
                u[i * dv + x] = beta[i] * v[i * dv + x];
            }
            let eg = beta[i] * gamma[i].exp();
            for x in 0..dk {
                w[i * dk + x] = eg * k[i * dk + x];
            }
            for j in 0..i {
                let aij = a[i * l + j];
                let (uj, ui) = u.split_at_mut(i * dv);
                axpy(-aij, &uj[j * dv..(j + 1) * dv], &mut ui[..dv]);
                let (wj, wi) = w.split_at_mut(i * dk);
                axpy(-aij, &wj[j * dk..(j + 1) * dk], &mut wi[..dk]);
            }
        }
        // Vn = U − W·S
        let mut vn = u;
        for i in 0..l {
            for x in 0..dk {
                axpy(-w[i * dk + x], &s[x * dv..(x + 1) * dv], &mut vn[i * dv..(i + 1) * dv]);
            }
        }
        // O_i = e^{γ_i} q_i·S + Σ_{j≤i} (q_i·k_j) e^{γ_i−γ_j} Vn_j
        for i in 0..l {
            let o = &mut out[(c0 + i) * dv..(c0 + i + 1) * dv];
            o.iter_mut().for_each(|x| *x = 0.0);
            let eg = gamma[i].exp();
            for x in 0..dk {
                axpy(eg * q[i * dk + x], &s[x * dv..(x + 1) * dv], o);
            }
            for j in 0..=i {
                let coef = dot(&q[i * dk..(i + 1) * dk], &k[j * dk..(j + 1) * dk]) * (gamma[i] - gamma[j]).exp();
                axpy(coef, &vn[j * dv..(j + 1) * dv], o);
            }
        }
        // S ← e^{γ_last} S + Σ_j e^{γ_last−γ_j} k_j ⊗ Vn_j
        let last = gamma[l - 1];
        let el = last.exp();
        s.iter_mut().for_each(|x| *x *= el);
        for j in 0..l {
            let dj = (last - gamma[j]).exp();
            for x in 0..dk {
                axpy(dj * k[j * dk + x], &vn[j * dv..(j + 1) * dv], &mut s[x * dv..(x + 1) * dv]);
            }
        }
    }
    at_marks
}

pub fn deltanet(a: GdnArgs<'_>, dims: &DeltaNetDims, eps: f32, layer: usize, batch: &BatchLayout, state: &mut CpuState) -> CpuTensor {
    let (hv, dk, dv) = (dims.num_v_heads, dims.k_head_dim, dims.v_head_dim);
    let (c, kw) = (dims.conv_dim(), dims.conv_kernel);
    let key_dim = dims.key_dim();
    let r = dims.v_per_k();
    let qscale = 1.0 / (dk as f32).sqrt();
    let mut out = CpuTensor::zeros(a.qkv.rows, hv * dv);
    for (span, off) in batch.spans.iter().zip(batch.offsets()) {
        let t = span.len;
        // Captures inside the span, as token offsets at chunk boundaries.
        let marks: Vec<usize> =
            state.capture_points(span.slot, span.start, t).into_iter().map(|at| at - span.start).filter(|m| m % CHUNK == 0).collect();
        let st = &mut state.slot(span.slot).gdn[layer];
        let x = &a.qkv.data[off * c..(off + t) * c];
        let conv_at: Vec<Vec<f32>> = marks.iter().map(|&m| conv_state_after(&st.conv, x, m, c)).collect();
        let mixed = causal_conv_silu(x, t, c, kw, a.conv, &mut st.conv);
        // Gather per value head: q, k of its key head (normalised), v, β, g.
        let heads: Vec<HeadInputs> = (0..hv)
            .into_par_iter()
            .map(|j| {
                let kh = j / r;
                let mut hi = HeadInputs {
                    q: Vec::with_capacity(t * dk),
                    k: Vec::with_capacity(t * dk),
                    v: Vec::with_capacity(t * dv),
                    beta: Vec::with_capacity(t),
                    g: Vec::with_capacity(t),
                };
                for ti in 0..t {
                    let row = &mixed[ti * c..(ti + 1) * c];
                    let mut qv = row[kh * dk..(kh + 1) * dk].to_vec();
                    let mut kv = row[key_dim + kh * dk..key_dim + (kh + 1) * dk].to_vec();
                    l2_normalize(&mut qv);
                    l2_normalize(&mut kv);
                    qv.iter_mut().for_each(|x| *x *= qscale);
                    hi.q.extend(qv);
                    hi.k.extend(kv);
                    hi.v.extend_from_slice(&row[2 * key_dim + j * dv..2 * key_dim + (j + 1) * dv]);
                    hi.beta.push(sigmoid(a.b.row(off + ti)[j]));
                    hi.g.push(-a.a_log[j].exp() * softplus(a.a.row(off + ti)[j] + a.dt_bias[j]));
                }
                hi
            })
            .collect();
        // Recurrence per head (each head owns its slice of the state).
        let mut core = vec![0f32; hv * t * dv]; // [Hv, T, dv]
        let rec_at: Vec<Vec<Vec<f32>>> = st // [Hv][mark][dk·dv]
            .recurrent
            .par_chunks_mut(dk * dv)
            .zip(core.par_chunks_mut(t * dv))
            .zip(heads.par_iter())
            .map(|((s, o), h)| {
                if t == 1 {
                    recurrent_step(s, &h.q, &h.k, &h.v, h.beta[0], h.g[0], o);
                    Vec::new()
                } else {
                    chunked(s, h, dk, dv, o, &marks)
                }
            })
            .collect();
        for (i, (&m, conv)) in marks.iter().zip(conv_at).enumerate() {
            let recurrent = rec_at.iter().flat_map(|head| head[i].iter().copied()).collect();
            state.fill_capture(span.slot, span.start + m, layer, GdnState { conv, recurrent });
        }
        // Gated RMSNorm per (token, head): w · norm(o) · silu(z).
        for ti in 0..t {
            let orow = out.row_mut(off + ti);
            for j in 0..hv {
                let o = &core[(j * t + ti) * dv..(j * t + ti + 1) * dv];
                let dst = &mut orow[j * dv..(j + 1) * dv];
                rms_norm_into(o, a.norm, eps, dst);
                let z = &a.z.row(off + ti)[j * dv..(j + 1) * dv];
                dst.iter_mut().zip(z).for_each(|(x, zz)| *x *= silu(*zz));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_state_after_is_what_a_conv_stopping_there_leaves() {
        let (c, k) = (3, 4);
        let state: Vec<f32> = (0..(k - 1) * c).map(|i| i as f32).collect();
        let x: Vec<f32> = (0..7 * c).map(|i| 100.0 + i as f32).collect();
        let w = vec![0.5; c * k];
        for n in 0..=7 {
            let mut s = state.clone();
            causal_conv_silu(&x[..n * c], n, c, k, &w, &mut s);
            assert_eq!(conv_state_after(&state, &x, n, c), s, "after {n} rows");
        }
    }
}
