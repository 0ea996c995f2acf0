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

    /// xn [T, H] -> [T, H].
    pub fn forward(&self, b: &B, xn: &B::Tensor, cfg: &ModelConfig, batch: &BatchLayout, state: &mut B::State) -> Result<B::Tensor> {
        let q_gate = b.matmul(xn, &self.q_proj)?;
        let k = b.matmul(xn, &self.k_proj)?;
        let v = b.matmul(xn, &self.v_proj)?;
        let inp = AttentionInputs { q_gate: &q_gate, k: &k, v: &v, q_norm: &self.q_norm, k_norm: &self.k_norm };
        let o = b.attention(inp, &cfg.attention, cfg.rms_norm_eps, self.cache_index, batch, state)?;
        b.matmul(&o, &self.o_proj)
    }
}
