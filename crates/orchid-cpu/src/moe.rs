//! Sparse MoE (docs/model.md §6): softmax over all experts, top-k, optional renormalisation,
//! SwiGLU experts on the tokens routed to them, shared expert scaled by sigmoid(gate·x).

use orchid_model::config::MoeDims;
use orchid_model::linear::LinearWeight;
use orchid_model::weights::HostMlp;
use rayon::prelude::*;

use crate::CpuBackend;
use crate::elementwise::{sigmoid, silu_mul};
use crate::matmul::matmul;
use crate::simd::axpy;
use crate::tensor::CpuTensor;
use orchid_model::backend::Mlp;

/// down(silu(gate·x) ⊙ up·x)
pub fn mlp(x: &CpuTensor, gate: &LinearWeight, up: &LinearWeight, down: &LinearWeight) -> CpuTensor {
    matmul(&silu_mul(&matmul(x, gate), &matmul(x, up)), down)
}

/// Top-k experts of one token from router logits: (expert, weight) pairs.
pub fn route(logits: &[f32], top_k: usize, renormalize: bool) -> Vec<(usize, f32)> {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|x| (x - m).exp()).collect();
    let sum: f32 = e.iter().sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    // Highest probability first; ties go to the lower index.
    idx.sort_by(|&a, &b| e[b].partial_cmp(&e[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    let mut picked: Vec<(usize, f32)> = idx[..top_k].iter().map(|&i| (i, e[i] / sum)).collect();
    if renormalize {
        let s: f32 = picked.iter().map(|p| p.1).sum();
        picked.iter_mut().for_each(|p| p.1 /= s);
    }
    picked
}

pub fn moe(
    x: &CpuTensor,
    router: &LinearWeight,
    experts: &[HostMlp],
    shared: Option<(&Mlp<CpuBackend>, &LinearWeight)>,
    dims: &MoeDims,
) -> CpuTensor {
    let (t, h) = (x.rows, x.cols);
    let logits = matmul(x, router);
    let routes: Vec<Vec<(usize, f32)>> = (0..t).map(|i| route(logits.row(i), dims.top_k, dims.norm_topk_prob)).collect();
    // Tokens (and weights) per expert.
    let mut per_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts.len()];
    for (ti, r) in routes.iter().enumerate() {
        for &(e, w) in r {
            per_expert[e].push((ti, w));
        }
    }
    let results: Vec<(usize, CpuTensor)> = per_expert
        .par_iter()
        .enumerate()
        .filter(|(_, toks)| !toks.is_empty())
        .map(|(e, toks)| {
            let mut xs = CpuTensor::zeros(toks.len(), h);
            for (i, &(ti, _)) in toks.iter().enumerate() {
                xs.row_mut(i).copy_from_slice(x.row(ti));
            }
            let m = &experts[e];
            (e, mlp(&xs, &m.gate_proj, &m.up_proj, &m.down_proj))
        })
        .collect();
    let mut out = CpuTensor::zeros(t, h);
    for (e, y) in &results {
        for (i, &(ti, w)) in per_expert[*e].iter().enumerate() {
            axpy(w, y.row(i), out.row_mut(ti));
        }
    }
    if let Some((m, gate)) = shared {
        let ys = mlp(x, &m.gate_proj, &m.up_proj, &m.down_proj);
        let g = matmul(x, gate);
        for ti in 0..t {
            axpy(sigmoid(g.row(ti)[0]), ys.row(ti), out.row_mut(ti));
        }
    }
    out
}
