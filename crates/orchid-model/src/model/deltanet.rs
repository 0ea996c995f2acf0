//! Gated DeltaNet (docs/model.md §5): in_proj_qkv / z / b / a, causal conv + SiLU, the
//! delta-rule recurrence with decay g and rate β on an fp32 state, gated RMSNorm, out_proj.

use crate::backend::{Backend, DeltaNetInputs};
use crate::batch::BatchLayout;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::attention::projections;
use crate::weights::HostDeltaNet;

pub struct GatedDeltaNet<B: Backend> {
    pub in_proj_qkv: B::Linear,
    pub in_proj_z: B::Linear,
    pub in_proj_b: B::Linear,
    pub in_proj_a: B::Linear,
    pub out_proj: B::Linear,
    pub conv1d: B::Vector,
    pub a_log: B::Vector,
    pub dt_bias: B::Vector,
    pub norm: B::Vector,
    /// This layer's index among the GDN layers (its conv and recurrent state).
    pub state_index: usize,
}

impl<B: Backend> GatedDeltaNet<B> {
    pub fn new(b: &B, w: &HostDeltaNet, state_index: usize) -> Result<Self> {
        Ok(GatedDeltaNet {
            in_proj_qkv: b.upload_linear(&w.in_proj_qkv)?,
            in_proj_z: b.upload_linear(&w.in_proj_z)?,
            in_proj_b: b.upload_linear(&w.in_proj_b)?,
            in_proj_a: b.upload_linear(&w.in_proj_a)?,
            out_proj: b.upload_linear(&w.out_proj)?,
            conv1d: b.upload_vector(&w.conv)?,
            a_log: b.upload_vector(&w.a_log)?,
            dt_bias: b.upload_vector(&w.dt_bias)?,
            norm: b.upload_vector(&w.norm)?,
            state_index,
        })
    }

    /// x += GatedDeltaNet(rms_norm(x)) (`norm`: the layer's input norm); x [T, H].
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
        let ws = [&self.in_proj_qkv, &self.in_proj_z, &self.in_proj_b, &self.in_proj_a];
        let [qkv, z, beta_in, a] = projections(b.norm_matmuls(x, norm, eps, &ws)?)?;
        let inp = DeltaNetInputs {
            qkv: &qkv,
            z: &z,
            b: &beta_in,
            a: &a,
            conv: &self.conv1d,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
        };
        let o = b.deltanet(inp, &cfg.deltanet, eps, self.state_index, batch, state)?;
        b.matmul_add(x, &o, &self.out_proj)
    }
}
