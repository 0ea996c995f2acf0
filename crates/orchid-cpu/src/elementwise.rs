//! Row-wise normalisation and elementwise activations (f32).

use rayon::prelude::*;

use crate::tensor::CpuTensor;

/// x / sqrt(mean(x²) + eps) · w, in place on one vector.
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

pub fn rms_norm(x: &CpuTensor, w: &[f32], eps: f32) -> CpuTensor {
    assert_eq!(x.cols, w.len(), "rms_norm: {} columns, weight of {}", x.cols, w.len());
    let mut out = CpuTensor::zeros(x.rows, x.cols);
    out.data.par_chunks_mut(x.cols).zip(x.data.par_chunks(x.cols)).for_each(|(o, r)| rms_norm_into(r, w, eps, o));
    out
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// log(1 + e^x), as torch computes it (linear above 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

pub fn silu_mul(g: &CpuTensor, u: &CpuTensor) -> CpuTensor {
    assert_eq!((g.rows, g.cols), (u.rows, u.cols), "silu_mul: shape mismatch");
    let data = g.data.iter().zip(&u.data).map(|(a, b)| silu(*a) * b).collect();
    CpuTensor::from_vec(g.rows, g.cols, data)
}
