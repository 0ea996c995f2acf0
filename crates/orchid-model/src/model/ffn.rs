//! The feed-forward half of a decoder layer: the sparse MoE (router, top-k SwiGLU experts,
//! shared expert with a sigmoid gate) or, on Qwen3-Next's optional dense layers, one SwiGLU MLP.

use crate::backend::{Backend, Mlp, MoeWeights};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::{HostFfn, HostMlp};

pub enum Ffn<B: Backend> {
    Moe(MoeWeights<B>),
    Dense(Mlp<B>),
}

pub(crate) fn upload_mlp<B: Backend>(b: &B, m: &HostMlp) -> Result<Mlp<B>> {
    Ok(Mlp { gate_proj: b.upload_linear(&m.gate_proj)?, up_proj: b.upload_linear(&m.up_proj)?, down_proj: b.upload_linear(&m.down_proj)? })
}

impl<B: Backend> Mlp<B> {
    /// down(silu(gate(x)) ⊙ up(x)).
    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let g = b.matmul(x, &self.gate_proj)?;
        let u = b.matmul(x, &self.up_proj)?;
        b.matmul(&b.silu_mul(&g, &u)?, &self.down_proj)
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

    /// xn [T, H] -> [T, H].
    pub fn forward(&self, b: &B, xn: &B::Tensor, cfg: &ModelConfig) -> Result<B::Tensor> {
        match self {
            Ffn::Moe(w) => b.moe(xn, w, &cfg.moe),
            Ffn::Dense(m) => m.forward(b, xn),
        }
    }
}
