//! orchid-cuda: the CUDA backend. Kernels are CUDA C++ in `kernels/*.cu` (one op family per
//! file), compiled at run time with NVRTC for the GPU found and cached on disk; the CUDA
//! libraries are opened at run time, so this crate builds and its tests pass on machines
//! without CUDA (the GPU tests are `#[ignore]`d: the GPU scripts run them with `--ignored`).
//!
//! Activations are f32 row-major device tensors; matrix products use bf16 tensor-core operands
//! with f32 accumulation (weights stay 4-bit in memory, see `weights`). The op-level [`Backend`]
//! implementation serves prefill and any batch (`layers`: attention, DeltaNet and MoE blocks;
//! `decode_rows`: the blocks of a batch of one-token spans, one launch for all rows) and fuses
//! the patterns the model names (`norm_matmuls`, `matmul_add`, `moe_block`; one token takes the
//! fused decode kernels). [`BatchGraph`] is the decode path: a capture of `Model::forward` over
//! such a batch (one row for a lone sequence) and one of the sampling per row on the GPU (two
//! graphs, so that the rows' grammar masks are computed while the first runs), its inputs in
//! device buffers, the sampled tokens written on the GPU into the next step's inputs.
//! [`GraphFastDecode`] offers it to the engine (`orchid_model::FastDecode`).
//!
//! Kernels and launchers share names: `kernels/X.cu` is launched by `ops/X.rs`; the argument
//! structs and shared constants are defined once in Rust and emitted into the CUDA source
//! ([`abi`]). What the backend is told (tuning, programmatic dependent launch, sync checks,
//! paths) comes in a [`CudaOptions`]; the library reads no environment variables.

pub mod abi;
pub mod batch_graph;
pub mod bf16ref;
pub mod compile;
pub mod decode_rows;
pub mod driver;
pub mod fast_decode;
pub mod layers;
pub mod logit_adjust;
pub mod ops;
pub mod options;
pub mod state;
pub mod weights;

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use orchid_model::backend::{AttentionInputs, Backend, DeltaNetInputs, MoeWeights, StateOptions};
use orchid_model::batch::BatchLayout;
use orchid_model::config::{AttentionDims, DeltaNetDims, ModelConfig, MoeDims};
use orchid_model::error::{Error, Result};
use orchid_model::linear::LinearWeight;
use orchid_model::weights::HostMlp;

pub use batch_graph::{BatchGraph, BatchRow};
pub use driver::{available, probe};
pub use fast_decode::GraphFastDecode;
pub use ops::sampling::SampleParams;
pub use options::{CudaOptions, Tuning};
pub use state::CudaState;
pub use weights::{GpuExperts, GpuLinear, GpuVec};

use decode_rows::DeviceBatch;
use driver::{DevBuf, Gpu};
use ops::Ctx;

/// An activation matrix [rows, cols] f32 on the device.
pub struct CudaTensor {
    pub buf: DevBuf,
    pub rows: usize,
    pub cols: usize,
    /// These rows already normalised and prepared for the GEMMs of the block that reads them
    /// next (`moe_block` leaves them for the next `norm_matmuls`); cleared by every op that
    /// writes the rows.
    next_input: Cell<Option<NextInput>>,
}

/// `gemm_x_norm` of a tensor's rows with the norm weight at `norm` and `eps`.
struct NextInput {
    norm: u64,
    eps: u32,
    xp: ops::gemm::GemmX,
}

impl CudaTensor {
    fn new(buf: DevBuf, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor { buf, rows, cols, next_input: Cell::new(None) }
    }
    /// Takes the rows' prepared input if it was made with this norm weight and eps.
    fn take_next_input(&self, norm: &GpuVec, eps: f32) -> Option<ops::gemm::GemmX> {
        self.next_input.take().filter(|p| p.norm == norm.buf.ptr && p.eps == eps.to_bits()).map(|p| p.xp)
    }
    pub fn ptr(&self) -> u64 {
        self.buf.ptr
    }
    /// Address of row r.
    pub fn row_ptr(&self, r: usize) -> u64 {
        self.buf.ptr + (r * self.cols * 4) as u64
    }
}

/// Cheap to clone: clones share the GPU, the kernels and the RoPE tables.
#[derive(Clone)]
pub struct CudaBackend {
    pub ctx: Arc<Ctx>,
    rope: Arc<Mutex<RopeTables>>,
    /// Set while a batched decode step is captured (`decode_rows`, `batch_graph`).
    device_batch: Arc<Mutex<Option<DeviceBatch>>>,
}

/// RoPE inverse-frequency tables by (theta bits, rotary dims).
type RopeTables = HashMap<(u64, usize), Arc<DevBuf>>;

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or loads cached) kernels.
    pub fn new(ordinal: i32, opts: &CudaOptions) -> Result<CudaBackend> {
        let gpu = Gpu::new(ordinal, opts)?;
        let ctx = Ctx::new(gpu, opts)?;
        Ok(CudaBackend { ctx: Arc::new(ctx), rope: Arc::new(Mutex::new(HashMap::new())), device_batch: Arc::default() })
    }

    /// A backend on the same GPU, stream and kernels with other launch shapes (A/B comparisons in
    /// one process: its tensors and states are interchangeable with this one's).
    pub fn with_tuning(&self, tuning: &Tuning) -> Result<CudaBackend> {
        Ok(CudaBackend { ctx: Arc::new(self.ctx.with_tuning(tuning)?), rope: self.rope.clone(), device_batch: Arc::default() })
    }

    /// The device inputs of the batched decode step being captured, if one is.
    pub fn device_batch(&self) -> Option<DeviceBatch> {
        *self.device_batch.lock().unwrap()
    }

    /// Sets (or clears) the device inputs that `embed` and the decode-rows blocks read instead
    /// of the host ids and layout, for the capture of a batched decode step.
    pub fn set_device_batch(&self, db: Option<DeviceBatch>) {
        *self.device_batch.lock().unwrap() = db;
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.ctx.gpu
    }

    pub fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor::new(DevBuf::alloc(self.gpu(), rows * cols * 4)?, rows, cols))
    }

    /// Uploads a host matrix (tests and tools).
    pub fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaTensor> {
        assert_eq!(data.len(), rows * cols);
        self.gpu().bind()?;
        Ok(CudaTensor::new(DevBuf::from_slice(self.gpu(), data)?, rows, cols))
    }

    /// RoPE inverse frequencies (f32, computed like transformers and the CPU backend), cached.
    pub fn inv_freq(&self, theta: f64, rotary: usize) -> Result<Arc<DevBuf>> {
        let key = (theta.to_bits(), rotary);
        let mut m = self.rope.lock().unwrap();
        if let Some(b) = m.get(&key) {
            return Ok(b.clone());
        }
        let v: Vec<f32> = (0..rotary / 2).map(|i| (1.0 / theta.powf((2 * i) as f64 / rotary as f64)) as f32).collect();
        let b = Arc::new(DevBuf::from_slice(self.gpu(), &v)?);
        m.insert(key, b.clone());
        Ok(b)
    }

    fn ids_buf(&self, ids: &[u32]) -> Result<DevBuf> {
        let v: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        DevBuf::from_slice(self.gpu(), &v)
    }
}

fn shape_err(op: &'static str, msg: String) -> Error {
    Error::Op { op, msg }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Linear = GpuLinear;
    type Vector = GpuVec;
    type Experts = GpuExperts;
    type State = CudaState;

    fn describe(&self) -> String {
        let g = self.gpu();
        format!("cuda: {} (sm_{}{}, {} SMs, {:.0} GiB)", g.name, g.cc.0, g.cc.1, g.sms, g.total_mem as f64 / 1073741824.0)
    }

    fn default_batched_tokens(&self) -> usize {
        orchid_model::backend::default_batched_tokens(Some(self.gpu().total_mem))
    }

    fn upload_linear(&self, w: &LinearWeight) -> Result<GpuLinear> {
        self.gpu().bind()?;
        weights::upload_linear(self.gpu(), w)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<GpuVec> {
        self.gpu().bind()?;
        weights::upload_vec(self.gpu(), v)
    }

    fn upload_experts(&self, experts: &[HostMlp]) -> Result<GpuExperts> {
        self.gpu().bind()?;
        weights::upload_experts(self.gpu(), experts)
    }

    fn new_state(&self, cfg: &ModelConfig, opts: StateOptions) -> Result<CudaState> {
        self.gpu().bind()?;
        if cfg.num_attention_layers() > 0 {
            ops::attention::check_head_dim(cfg.attention.head_dim)?;
        }
        let d = &cfg.deltanet;
        if cfg.num_deltanet_layers() > 0 {
            ops::deltanet::check_dims(d.k_head_dim, d.v_head_dim, d.conv_dim(), d.conv_kernel)?;
        }
        CudaState::new(self.gpu(), cfg, opts)
    }

    fn embed(&self, table: &GpuLinear, ids: &[u32]) -> Result<CudaTensor> {
        self.gpu().bind()?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            return Err(shape_err("embed", format!("token id {bad} >= {} rows", table.rows)));
        }
        let out = self.tensor(ids.len(), table.cols)?;
        if let Some(db) = self.device_batch() {
            if db.rows != ids.len() {
                return Err(shape_err("embed", format!("{} ids in a captured step of {} rows", ids.len(), db.rows)));
            }
            ops::elementwise::embed(&self.ctx, table, db.ids, out.ptr(), ids.len())?;
            return Ok(out);
        }
        let idb = self.ids_buf(ids)?;
        ops::elementwise::embed(&self.ctx, table, idb.ptr, out.ptr(), ids.len())?;
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaTensor, w: &GpuVec, eps: f32) -> Result<CudaTensor> {
        self.gpu().bind()?;
        if x.cols != w.len {
            return Err(shape_err("rms_norm", format!("{} columns, weight of {}", x.cols, w.len)));
        }
        let y = self.tensor(x.rows, x.cols)?;
        ops::elementwise::rms_norm(&self.ctx, x.ptr(), w.buf.ptr, y.ptr(), x.rows, x.cols, eps)?;
        Ok(y)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        self.gpu().bind()?;
        x.next_input.take();
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(shape_err("add", format!("[{}, {}] + [{}, {}]", x.rows, x.cols, y.rows, y.cols)));
        }
        ops::elementwise::add_assign(&self.ctx, x.ptr(), y.ptr(), x.rows * x.cols)
    }

    fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, w: &GpuVec, eps: f32) -> Result<CudaTensor> {
        self.gpu().bind()?;
        x.next_input.take();
        if (x.rows, x.cols) != (y.rows, y.cols) || x.cols != w.len {
            return Err(shape_err("add_rms_norm", format!("[{}, {}] + [{}, {}], weight {}", x.rows, x.cols, y.rows, y.cols, w.len)));
        }
        let out = self.tensor(x.rows, x.cols)?;
        ops::elementwise::add_rms_norm(&self.ctx, x.ptr(), y.ptr(), w.buf.ptr, out.ptr(), x.rows, x.cols, eps)?;
        Ok(out)
    }

    fn matmul(&self, x: &CudaTensor, w: &GpuLinear) -> Result<CudaTensor> {
        self.gpu().bind()?;
        if x.cols != w.cols || w.count != 1 {
            return Err(shape_err("matmul", format!("x [{}, {}] · W [{}, {}]ᵀ", x.rows, x.cols, w.rows, w.cols)));
        }
        let out = self.tensor(x.rows, w.rows)?;
        ops::gemm::matmul(&self.ctx, w, x.ptr(), x.cols, x.rows, out.ptr(), w.rows)?;
        Ok(out)
    }

    fn norm_matmuls(&self, x: &CudaTensor, norm: &GpuVec, eps: f32, ws: &[&GpuLinear]) -> Result<Vec<CudaTensor>> {
        self.gpu().bind()?;
        if let Some(w) = ws.iter().find(|w| w.cols != x.cols || w.count != 1) {
            return Err(shape_err("norm_matmuls", format!("x [{}, {}] · W [{}, {}]ᵀ", x.rows, x.cols, w.rows, w.cols)));
        }
        if x.cols != norm.len {
            return Err(shape_err("norm_matmuls", format!("{} columns, norm weight of {}", x.cols, norm.len)));
        }
        let c = &self.ctx;
        let t = x.rows;
        let prepared = x.take_next_input(norm, eps);
        if ops::gemv::use_gemv(c, t) {
            // The matvec normalises x on load; weights that share format and K go in one launch.
            let outs = ws.iter().map(|w| self.tensor(t, w.rows)).collect::<Result<Vec<_>>>()?;
            let norm = Some((norm.buf.ptr, eps));
            for run in ops::gemv::gemv_groups(ws) {
                for r0 in (0..t).step_by(ops::gemv::MAX_TOKENS) {
                    let n = ops::gemv::MAX_TOKENS.min(t - r0);
                    let segs: Vec<_> = run.clone().map(|i| (ws[i], outs[i].row_ptr(r0))).collect();
                    ops::gemv::gemv_each(c, &segs, x.row_ptr(r0), x.cols, n, norm)?;
                }
            }
            return Ok(outs);
        }
        // x normalised and rounded to bf16 in one pass, once for every GEMM (all of the same K),
        // unless the op that wrote x did so.
        let xp = match prepared {
            Some(xp) => xp,
            None => ops::gemm::gemm_x_norm(c, x.ptr(), x.cols, t, x.cols, norm.buf.ptr, eps, 0)?,
        };
        let outs = ws.iter().map(|w| self.tensor(t, w.rows)).collect::<Result<Vec<_>>>()?;
        // Neighbours of one format and K in one launch where the GEMM allows (the same bits).
        for run in ops::gemv::gemv_groups(ws) {
            let ptrs: Vec<u64> = run.clone().map(|i| outs[i].ptr()).collect();
            if !ops::gemm::gemm_each(c, &ws[run.clone()], &xp, t, &ptrs)? {
                for i in run {
                    ops::gemm::gemm(c, ws[i], None, &xp, 0, t, None, outs[i].ptr(), ws[i].rows)?;
                }
            }
        }
        Ok(outs)
    }

    fn matmul_add(&self, x: &mut CudaTensor, y: &CudaTensor, w: &GpuLinear) -> Result<()> {
        self.gpu().bind()?;
        x.next_input.take();
        if y.cols != w.cols || w.count != 1 || (x.rows, x.cols) != (y.rows, w.rows) {
            return Err(shape_err(
                "matmul_add",
                format!("x [{}, {}] += y [{}, {}] · W [{}, {}]ᵀ", x.rows, x.cols, y.rows, y.cols, w.rows, w.cols),
            ));
        }
        if ops::gemv::use_gemv(&self.ctx, y.rows) {
            // The matvec accumulates into the residual.
            return ops::gemv::gemv_rows(&self.ctx, &[(w, 0)], y.ptr(), y.cols, y.rows, None, x.ptr(), x.cols, true);
        }
        // The GEMM adds onto the residual (in its store, or in its split-K reduction).
        ops::gemm::matmul_add(&self.ctx, w, y.ptr(), y.cols, y.rows, x.ptr(), x.cols)
    }

    fn moe_block(
        &self,
        x: &mut CudaTensor,
        norm: &GpuVec,
        eps: f32,
        w: &MoeWeights<Self>,
        dims: &MoeDims,
        next: Option<&GpuVec>,
    ) -> Result<()> {
        self.gpu().bind()?;
        x.next_input.take();
        if x.rows <= ops::gemv::MAX_TOKENS.min(self.ctx.tuning.moe_rows_max)
            && let Some(md) = layers::moe_rows_experts(w, dims)
        {
            // Normalised on load, the experts' sum added to the residual in place.
            return layers::moe_rows(self, x, Some((norm.buf.ptr, eps)), w, dims, &md, x.ptr());
        }
        // The norm in the experts' input preparation (its f32 rows kept for the few-token GEMVs); the
        // experts' weighted sum is added onto the residual by the combine kernel, which for many
        // rows also prepares them for the next block's GEMMs.
        let xn = self.tensor(x.rows, x.cols)?;
        let xp = ops::gemm::gemm_x_norm(&self.ctx, x.ptr(), x.cols, x.rows, x.cols, norm.buf.ptr, eps, xn.ptr())?;
        let then = next
            .filter(|_| x.rows >= self.ctx.tuning.combine_norm_min && !ops::gemv::use_gemv(&self.ctx, x.rows))
            .map(|n| (n.buf.ptr, eps));
        let prepared = layers::moe_into(self, &xn, Some(xp), w, dims, x.ptr(), true, then)?;
        if let (Some(xp), Some((norm, _))) = (prepared, then) {
            x.next_input.set(Some(NextInput { norm, eps: eps.to_bits(), xp }));
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        self.gpu().bind()?;
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(shape_err("silu_mul", "shape mismatch".into()));
        }
        let out = self.tensor(gate.rows, gate.cols)?;
        ops::elementwise::silu_mul(&self.ctx, gate.ptr(), up.ptr(), out.ptr(), gate.rows * gate.cols)?;
        Ok(out)
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        self.gpu().bind()?;
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(shape_err("select_rows", format!("row {bad} of {}", x.rows)));
        }
        let out = self.tensor(rows.len(), x.cols)?;
        if rows.iter().enumerate().all(|(i, &r)| i == r) {
            driver::copy_d2d(self.gpu(), out.ptr(), x.ptr(), rows.len() * x.cols * 4)?;
            return Ok(out);
        }
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let ib = DevBuf::from_slice(self.gpu(), &idx)?;
        ops::elementwise::gather_rows(&self.ctx, x.ptr(), ib.ptr, out.ptr(), rows.len(), x.cols)?;
        Ok(out)
    }

    fn to_host(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        self.gpu().bind()?;
        let mut v = vec![0f32; x.rows * x.cols];
        x.buf.download(0, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }

    fn attention(
        &self,
        inp: AttentionInputs<'_, Self>,
        dims: &AttentionDims,
        eps: f32,
        layer: usize,
        batch: &BatchLayout,
        state: &mut CudaState,
    ) -> Result<CudaTensor> {
        self.gpu().bind()?;
        if decode_rows::applies(batch) {
            return decode_rows::attention(self, inp, dims, eps, layer, batch, state);
        }
        layers::attention(self, inp, dims, eps, layer, batch, state)
    }

    fn deltanet(
        &self,
        inp: DeltaNetInputs<'_, Self>,
        dims: &DeltaNetDims,
        eps: f32,
        layer: usize,
        batch: &BatchLayout,
        state: &mut CudaState,
    ) -> Result<CudaTensor> {
        self.gpu().bind()?;
        if decode_rows::applies(batch) {
            return decode_rows::deltanet(self, inp, dims, eps, layer, batch, state);
        }
        layers::deltanet(self, inp, dims, eps, layer, batch, state)
    }

    fn moe(&self, x: &CudaTensor, w: &MoeWeights<Self>, dims: &MoeDims) -> Result<CudaTensor> {
        self.gpu().bind()?;
        layers::moe(self, x, w, dims)
    }
}

/// Samples one token from a [1, vocab] logits row on the GPU (eager; for tests and tools).
/// `step` is the generator's counter: the same (seed, step) gives the same token.
pub fn sample(b: &CudaBackend, logits: &CudaTensor, params: SampleParams, step: u32) -> Result<u32> {
    b.gpu().bind()?;
    let g = b.gpu();
    let pbuf = DevBuf::from_slice(g, &[params])?;
    let partial = DevBuf::zeros(g, 8 * ops::sampling::ARGMAX_BLOCKS)?;
    let counter = DevBuf::zeros(g, 4)?;
    let token = DevBuf::zeros(g, 4)?;
    let stepb = DevBuf::from_slice(g, &[step as i32])?;
    let a = ops::sampling::SampleArgs {
        logits: logits.ptr(),
        params: pbuf.ptr,
        partial: partial.ptr,
        counter: counter.ptr,
        token_out: token.ptr,
        pos: 0,
        step: stepb.ptr,
        mask: 0,
        vocab: logits.cols as i32,
        nblocks: ops::sampling::ARGMAX_BLOCKS as i32,
    };
    if params.is_greedy() {
        ops::sampling::argmax(&b.ctx, &a)?
    } else {
        ops::sampling::general(&b.ctx, &a)?
    }
    let mut t = [0i32];
    token.download(0, bytemuck::cast_slice_mut(&mut t))?;
    Ok(t[0] as u32)
}
