//! Gated full attention (docs/model.md §4): q_proj emits [query | gate] per head; q/k RMSNorm,
//! partial RoPE, causal GQA attention over the KV cache, output × sigmoid(gate), o_proj.

use crate::backend::{AttentionInputs, Backend};
use crate::batch::BatchLayout;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::HostAttention;

pub struct Attention<B: Backend> {
    pub q_proj: B::Linear,
    pub k_proj: B::Linear,
    pub v_proj: B::Linear,
    pub o_proj: B::Linear,
    pub q_norm: B::Vector,
    pub k_norm: B::Vector,
    /// This layer's index among the attention layers (its KV cache).
    pub cache_index: usize,
}

impl<B: Backend> Attention<B> {
    pub fn new(b: &B, w: &HostAttention, cache_index: usize) -> Result<Self> {
        Ok(Attention {
            q_proj: b.upload_linear(&w.q_proj)?,
            k_proj: b.upload_linear(&w.k_proj)?,
            v_proj: b.upload_linear(&w.v_proj)?,
            o_proj: b.upload_linear(&w.o_proj)?,
            q_norm: b.upload_vector(&w.q_norm)?,
            k_norm: b.upload_vector(&w.k_norm)?,
            cache_index,
        })
    }

    /// x += Attention(rms_norm(x)) (`norm`: the layer's input norm); x [T, H].
    pub fn forward(
        &self,
        b: &B,
        x: &mut B::Tensor,
        norm: &B::Vector,
        cfg: &ModelConfig,
        batch: &BatchLayout,
        state: &mut B::State,
    ) -> Result<()> {
        let eps = cfg.rms_norm_eps;
        let [q_gate, k, v] = projections(b.norm_matmuls(x, norm, eps, &[&self.q_proj, &self.k_proj, &self.v_proj])?)?;
        let inp = AttentionInputs { q_gate: &q_gate, k: &k, v: &v, q_norm: &self.q_norm, k_norm: &self.k_norm };
        let o = b.attention(inp, &cfg.attention, eps, self.cache_index, batch, state)?;
        b.matmul_add(x, &o, &self.o_proj)
    }
}

/// The N tensors a `norm_matmuls` of N weights returns.
pub(crate) fn projections<T, const N: usize>(v: Vec<T>) -> Result<[T; N]> {
    let n = v.len();
    v.try_into().map_err(|_| crate::error::Error::Op { op: "norm_matmuls", msg: format!("{n} outputs for {N} weights") })
}
