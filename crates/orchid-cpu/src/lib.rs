//! orchid-cpu: the CPU backend. Every op is the plain f32 reference the CUDA kernels are
//! checked against, multi-threaded with rayon; weights are read in place from the mapped
//! checkpoint (dense or MLX affine), never expanded in memory.

pub mod attention;
pub mod deltanet;
pub mod elementwise;
pub mod matmul;
pub mod moe;
pub mod simd;
pub mod state;
pub mod tensor;

use orchid_model::backend::{AttentionInputs, Backend, DeltaNetInputs, MoeWeights, StateOptions};
use orchid_model::batch::BatchLayout;
use orchid_model::config::{AttentionDims, DeltaNetDims, ModelConfig, MoeDims};
use orchid_model::error::{Error, Result};
use orchid_model::linear::LinearWeight;
use orchid_model::weights::HostMlp;

pub use state::CpuState;
pub use tensor::CpuTensor;

#[derive(Clone, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> CpuBackend {
        CpuBackend
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Linear = LinearWeight;
    type Vector = Vec<f32>;
    type Experts = Vec<HostMlp>;
    type State = CpuState;

    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn upload_linear(&self, w: &LinearWeight) -> Result<LinearWeight> {
        Ok(w.clone())
    }

    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }

    fn upload_experts(&self, experts: &[HostMlp]) -> Result<Vec<HostMlp>> {
        Ok(experts.to_vec())
    }

    fn new_state(&self, cfg: &ModelConfig, opts: StateOptions) -> Result<CpuState> {
        if let Some(t) = opts.kv_tokens
            && t < opts.max_context
        {
            return Err(Error::Backend(format!(
                "a KV cache of {t} positions cannot hold one sequence of the maximum context ({} positions): raise the KV cache size or lower the maximum context",
                opts.max_context
            )));
        }
        Ok(CpuState::new(cfg, opts))
    }

    fn embed(&self, table: &LinearWeight, ids: &[u32]) -> Result<CpuTensor> {
        let mut x = CpuTensor::zeros(ids.len(), table.cols);
        for (i, &id) in ids.iter().enumerate() {
            if id as usize >= table.rows {
                return Err(Error::Op { op: "embed", msg: format!("token id {id} >= {} rows", table.rows) });
            }
            matmul::decode_row(table, id as usize, x.row_mut(i));
        }
        Ok(x)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32) -> Result<CpuTensor> {
        Ok(elementwise::rms_norm(x, w, eps))
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(Error::Op { op: "add", msg: format!("[{}, {}] + [{}, {}]", x.rows, x.cols, y.rows, y.cols) });
        }
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn matmul(&self, x: &CpuTensor, w: &LinearWeight) -> Result<CpuTensor> {
        if x.cols != w.cols {
            return Err(Error::Op { op: "matmul", msg: format!("x [{}, {}] · W [{}, {}]ᵀ", x.rows, x.cols, w.rows, w.cols) });
        }
        Ok(matmul::matmul(x, w))
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        Ok(elementwise::silu_mul(gate, up))
    }

    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        let mut out = CpuTensor::zeros(rows.len(), x.cols);
        for (i, &r) in rows.iter().enumerate() {
            out.row_mut(i).copy_from_slice(x.row(r));
        }
        Ok(out)
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn attention(
        &self,
        inp: AttentionInputs<'_, Self>,
        dims: &AttentionDims,
        eps: f32,
        layer: usize,
        batch: &BatchLayout,
        state: &mut CpuState,
    ) -> Result<CpuTensor> {
        let args = attention::AttnArgs { q_gate: inp.q_gate, k: inp.k, v: inp.v, q_norm: inp.q_norm, k_norm: inp.k_norm };
        attention::attention(args, dims, eps, layer, batch, state)
    }

    fn deltanet(
        &self,
        inp: DeltaNetInputs<'_, Self>,
        dims: &DeltaNetDims,
        eps: f32,
        layer: usize,
        batch: &BatchLayout,
        state: &mut CpuState,
    ) -> Result<CpuTensor> {
        let args = deltanet::GdnArgs {
            qkv: inp.qkv,
            z: inp.z,
            b: inp.b,
            a: inp.a,
            conv: inp.conv,
            a_log: inp.a_log,
            dt_bias: inp.dt_bias,
            norm: inp.norm,
        };
        Ok(deltanet::deltanet(args, dims, eps, layer, batch, state))
    }

    fn moe(&self, x: &CpuTensor, w: &MoeWeights<Self>, dims: &MoeDims) -> Result<CpuTensor> {
        let shared = w.shared.as_ref().zip(w.shared_gate.as_ref());
        Ok(moe::moe(x, &w.router, &w.experts, shared, dims))
    }
}
