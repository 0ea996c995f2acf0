//! Gated GQA attention with partial RoPE over a growing KV cache (docs/model.md §4).
//!
//! Shapes: T tokens, Hq query heads and Hkv KV heads of D dims, R = rotary dims (the first R
//! dims of each head rotate, pairing i with i + R/2).

use orchid_model::batch::BatchLayout;
use orchid_model::config::AttentionDims;
use orchid_model::error::{Error, Result};
use rayon::prelude::*;

use crate::elementwise::{rms_norm_into, sigmoid};
use crate::simd::{axpy, dot};
use crate::state::CpuState;
use crate::tensor::CpuTensor;

/// cos/sin of each rotary pair at `pos`, computed like transformers: f32 inverse
/// frequencies, f32 angle = pos · inv_freq.
pub fn rope_cos_sin(dims: &AttentionDims, pos: usize) -> (Vec<f32>, Vec<f32>) {
    let half = dims.rotary_dim / 2;
    (0..half)
        .map(|i| {
            let inv = (1.0 / dims.rope_theta.powf((2 * i) as f64 / dims.rotary_dim as f64)) as f32;
            let ang = pos as f32 * inv;
            (ang.cos(), ang.sin())
        })
        .unzip()
}

/// Rotates the first R dims of one head in place (half-split pairing).
pub fn apply_rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

pub struct AttnArgs<'a> {
    pub q_gate: &'a CpuTensor,
    pub k: &'a CpuTensor,
    pub v: &'a CpuTensor,
    pub q_norm: &'a [f32],
    pub k_norm: &'a [f32],
}

pub fn attention(
    a: AttnArgs<'_>,
    dims: &AttentionDims,
    eps: f32,
    layer: usize,
    batch: &BatchLayout,
    state: &mut CpuState,
) -> Result<CpuTensor> {
    let (hq, hkv, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    let stride = if dims.output_gate { 2 * d } else { d };
    let group = hq / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    let t_all = a.q_gate.rows;
    let mut out = CpuTensor::zeros(t_all, hq * d);
    let max_context = state.max_context;
    for (span, off) in batch.spans.iter().zip(batch.offsets()) {
        let cache = &mut state.slot(span.slot).kv[layer];
        if cache.len != span.start {
            return Err(Error::Op { op: "attention", msg: format!("span starts at {} but the cache holds {}", span.start, cache.len) });
        }
        if span.start + span.len > max_context {
            return Err(Error::Op { op: "attention", msg: format!("context {} exceeds the maximum {max_context}", span.start + span.len) });
        }
        // Queries (normed, rotated) of the span, and the new K/V appended to the cache.
        let mut q = vec![0f32; span.len * hq * d];
        let mut tmp = vec![0f32; d];
        for t in 0..span.len {
            let row = off + t;
            let (cos, sin) = rope_cos_sin(dims, span.start + t);
            for h in 0..hq {
                let src = &a.q_gate.row(row)[h * stride..h * stride + d];
                let dst = &mut q[(t * hq + h) * d..(t * hq + h + 1) * d];
                rms_norm_into(src, a.q_norm, eps, dst);
                apply_rope(&mut dst[..dims.rotary_dim], &cos, &sin);
            }
            for j in 0..hkv {
                rms_norm_into(&a.k.row(row)[j * d..(j + 1) * d], a.k_norm, eps, &mut tmp);
                apply_rope(&mut tmp[..dims.rotary_dim], &cos, &sin);
                cache.k.extend_from_slice(&tmp);
            }
            cache.v.extend_from_slice(a.v.row(row));
        }
        cache.len += span.len;
        let (kc, vc) = (&cache.k, &cache.v);
        // softmax(q·Kᵀ/√D)·V per (token, head), causal over the cache.
        let span_out = &mut out.data[off * hq * d..(off + span.len) * hq * d];
        span_out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
            let (t, h) = (i / hq, i % hq);
            let kvh = h / group;
            let qh = &q[i * d..(i + 1) * d];
            let n = span.start + t + 1;
            let mut s: Vec<f32> = (0..n).map(|p| dot(qh, &kc[(p * hkv + kvh) * d..(p * hkv + kvh + 1) * d]) * scale).collect();
            let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            s.iter_mut().for_each(|x| {
                *x = (*x - m).exp();
                sum += *x;
            });
            for (p, w) in s.iter().enumerate() {
                axpy(w / sum, &vc[(p * hkv + kvh) * d..(p * hkv + kvh + 1) * d], o);
            }
            if dims.output_gate {
                let gate = &a.q_gate.row(off + t)[h * stride + d..h * stride + 2 * d];
                o.iter_mut().zip(gate).for_each(|(x, g)| *x *= sigmoid(*g));
            }
        });
    }
    Ok(out)
}
