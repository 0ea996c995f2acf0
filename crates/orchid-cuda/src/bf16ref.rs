//! A reference for parity checks: the CPU backend with every matmul, MoE and attention input
//! rounded to bf16, which is what the CUDA backend feeds its tensor cores. Its distance from the
//! f32 CPU on a given model and prompt ("bf16 sensitivity") calibrates how far the GPU may lie
//! from the f32 CPU: random-weight MoE models amplify rounding through router near-ties.

use half::bf16;
use orchid_cpu::{CpuBackend, CpuState, CpuTensor};
use orchid_model::backend::{AttentionInputs, Backend, DeltaNetInputs, Mlp, MoeWeights, StateOptions};
use orchid_model::batch::BatchLayout;
use orchid_model::config::{AttentionDims, DeltaNetDims, ModelConfig, MoeDims};
use orchid_model::error::Result;
use orchid_model::linear::LinearWeight;
use orchid_model::weights::HostMlp;

fn r(x: &CpuTensor) -> CpuTensor {
    CpuTensor::from_vec(x.rows, x.cols, x.data.iter().map(|&v| bf16::from_f32(v).to_f32()).collect())
}

/// The CPU backend with bf16-rounded matmul, MoE and attention inputs.
pub struct Bf16Cpu(pub CpuBackend);

impl Backend for Bf16Cpu {
    type Tensor = CpuTensor;
    type Linear = LinearWeight;
    type Vector = Vec<f32>;
    type Experts = Vec<HostMlp>;
    type State = CpuState;
    fn describe(&self) -> String {
        "cpu-bf16".into()
    }
    fn upload_linear(&self, w: &LinearWeight) -> Result<LinearWeight> {
        self.0.upload_linear(w)
    }
    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        self.0.upload_vector(v)
    }
    fn upload_experts(&self, e: &[HostMlp]) -> Result<Vec<HostMlp>> {
        self.0.upload_experts(e)
    }
    fn new_state(&self, cfg: &ModelConfig, o: StateOptions) -> Result<CpuState> {
        self.0.new_state(cfg, o)
    }
    fn embed(&self, t: &LinearWeight, ids: &[u32]) -> Result<CpuTensor> {
        self.0.embed(t, ids)
    }
    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32) -> Result<CpuTensor> {
        self.0.rms_norm(x, w, eps)
    }
    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        self.0.add_assign(x, y)
    }
    fn matmul(&self, x: &CpuTensor, w: &LinearWeight) -> Result<CpuTensor> {
        self.0.matmul(&r(x), w)
    }
    fn silu_mul(&self, g: &CpuTensor, u: &CpuTensor) -> Result<CpuTensor> {
        self.0.silu_mul(g, u)
    }
    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        self.0.select_rows(x, rows)
    }
    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        self.0.to_host(x)
    }
    fn attention(
        &self,
        i: AttentionInputs<'_, Self>,
        d: &AttentionDims,
        eps: f32,
        l: usize,
        b: &BatchLayout,
        s: &mut CpuState,
    ) -> Result<CpuTensor> {
        let (k, v) = (r(i.k), r(i.v));
        let ci = AttentionInputs::<CpuBackend> { q_gate: i.q_gate, k: &k, v: &v, q_norm: i.q_norm, k_norm: i.k_norm };
        self.0.attention(ci, d, eps, l, b, s)
    }
    fn deltanet(
        &self,
        i: DeltaNetInputs<'_, Self>,
        d: &DeltaNetDims,
        eps: f32,
        l: usize,
        b: &BatchLayout,
        s: &mut CpuState,
    ) -> Result<CpuTensor> {
        let ci = DeltaNetInputs::<CpuBackend> {
            qkv: i.qkv,
            z: i.z,
            b: i.b,
            a: i.a,
            conv: i.conv,
            a_log: i.a_log,
            dt_bias: i.dt_bias,
            norm: i.norm,
        };
        self.0.deltanet(ci, d, eps, l, b, s)
    }
    fn moe(&self, x: &CpuTensor, w: &MoeWeights<Self>, d: &MoeDims) -> Result<CpuTensor> {
        let cw = MoeWeights::<CpuBackend> {
            router: w.router.clone(),
            experts: w.experts.clone(),
            shared: w.shared.as_ref().map(|m| Mlp {
                gate_proj: m.gate_proj.clone(),
                up_proj: m.up_proj.clone(),
                down_proj: m.down_proj.clone(),
            }),
            shared_gate: w.shared_gate.clone(),
        };
        self.0.moe(&r(x), &cw, d)
    }
}
