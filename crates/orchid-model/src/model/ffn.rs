//! The feed-forward half of a decoder layer: the sparse MoE (router, top-k SwiGLU experts,
//! shared expert with a sigmoid gate) or, on Qwen3-Next's optional dense layers, one SwiGLU MLP.

use crate::backend::{Backend, Mlp, MoeWeights};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::attention::projections;
use crate::weights::{HostFfn, HostMlp};

pub enum Ffn<B: Backend> {
    Moe(MoeWeights<B>),
    Dense(Mlp<B>),
}

pub(crate) fn upload_mlp<B: Backend>(b: &B, m: &HostMlp) -> Result<Mlp<B>> {
    Ok(Mlp { gate_proj: b.upload_linear(&m.gate_proj)?, up_proj: b.upload_linear(&m.up_proj)?, down_proj: b.upload_linear(&m.down_proj)? })
}

impl<B: Backend> Mlp<B> {
    /// x += down(silu(gate(xn)) ⊙ up(xn)), xn = rms_norm(x).
    pub fn forward(&self, b: &B, x: &mut B::Tensor, norm: &B::Vector, eps: f32) -> Result<()> {
        let [g, u] = projections(b.norm_matmuls(x, norm, eps, &[&self.gate_proj, &self.up_proj])?)?;
        b.matmul_add(x, &b.silu_mul(&g, &u)?, &self.down_proj)
    }
}

impl<B: Backend> Ffn<B> {
    pub fn new(b: &B, w: &HostFfn) -> Result<Self> {
        Ok(match w {
            HostFfn::Dense(m) => Ffn::Dense(upload_mlp(b, m)?),
            HostFfn::Moe(m) => Ffn::Moe(MoeWeights {
                router: b.upload_linear(&m.router)?,
                experts: b.upload_experts(&m.experts)?,
                shared: m.shared.as_ref().map(|s| upload_mlp(b, s)).transpose()?,
                shared_gate: m.shared_gate.as_ref().map(|g| b.upload_linear(g)).transpose()?,
            }),
        })
    }

    /// x += FFN(rms_norm(x)) (`norm`: the layer's post-attention norm; `next`: the norm the next
    /// block starts with, see `Backend::moe_block`); x [T, H].
    pub fn forward(&self, b: &B, x: &mut B::Tensor, norm: &B::Vector, next: Option<&B::Vector>, cfg: &ModelConfig) -> Result<()> {
        match self {
            Ffn::Moe(w) => b.moe_block(x, norm, cfg.rms_norm_eps, w, &cfg.moe, next),
            Ffn::Dense(m) => m.forward(b, x, norm, cfg.rms_norm_eps),
        }
    }
}
