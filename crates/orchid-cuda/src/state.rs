//! Per-sequence decode state on the GPU, in slots the engine allocates:
//! - KV cache of the attention layers in fixed blocks of KV_BLOCK positions, bf16,
//!   [num_blocks][Hkv][KV_BLOCK][D] per layer for K and for V, one block table per slot
//!   (shared by all layers) on the device;
//! - per GDN layer the conv state [2][(K-1)·C] f32 (two buffers, see kernels/deltanet.cu) and
//!   the recurrent state [Hv][dk][dv] f32.
//!
//! Blocks are taken from a free list as sequences grow and returned when a slot is freed.

use std::sync::Arc;

use orchid_model::backend::{StateOptions, StatePool};
use orchid_model::config::ModelConfig;
use orchid_model::error::{Error, Result};

use crate::driver::{DevBuf, Gpu};

pub const KV_BLOCK: usize = 64;

pub struct SlotState {
    /// Tokens in the KV cache, per attention layer.
    pub attn_len: Vec<usize>,
    pub blocks: Vec<u32>,
}

pub struct CudaState {
    gpu: Arc<Gpu>,
    pub n_attn: usize,
    pub n_gdn: usize,
    pub conv_len: usize,
    pub rec_len: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_context: usize,
    pub max_blocks_per_seq: usize,
    pub num_blocks: usize,
    conv: DevBuf,
    rec: DevBuf,
    kpool: Vec<DevBuf>,
    vpool: Vec<DevBuf>,
    tables: DevBuf,
    free_blocks: Vec<u32>,
    slots: Vec<Option<SlotState>>,
}

impl CudaState {
    pub fn new(gpu: &Arc<Gpu>, cfg: &ModelConfig, opts: StateOptions) -> Result<CudaState> {
        let d = &cfg.deltanet;
        let a = &cfg.attention;
        let n_attn = cfg.num_attention_layers();
        let n_gdn = cfg.num_deltanet_layers();
        let max_seqs = opts.max_seqs.max(1);
        let conv_len = (d.conv_kernel - 1).max(1) * d.conv_dim();
        let rec_len = d.num_v_heads * d.k_head_dim * d.v_head_dim;
        let max_blocks_per_seq = opts.max_context.max(1).div_ceil(KV_BLOCK);
        let block_bytes = (n_attn * 2 * a.num_kv_heads * KV_BLOCK * a.head_dim * 2).max(1);
        let gdn_bytes = max_seqs * n_gdn.max(1) * (2 * conv_len + rec_len) * 4;
        let (free, _) = gpu.mem_info()?;
        let budget = (free as f64 * 0.9) as usize;
        if gdn_bytes > budget {
            return Err(Error::Backend(format!(
                "cuda: {max_seqs} sequences need {:.1} GiB of recurrent state, {:.1} GiB free",
                gdn_bytes as f64 / 1073741824.0,
                free as f64 / 1073741824.0
            )));
        }
        let want = max_seqs * max_blocks_per_seq;
        let fit = (budget - gdn_bytes) / block_bytes;
        let num_blocks = if n_attn == 0 { 1 } else { want.min(fit).max(1) };
        if num_blocks < want {
            tracing::warn!(
                "KV cache: room for {num_blocks} blocks of {KV_BLOCK} positions ({} full-length sequences), {want} asked for",
                num_blocks / max_blocks_per_seq
            );
        }
        let per_layer = num_blocks * a.num_kv_heads * KV_BLOCK * a.head_dim * 2;
        let mut kpool = Vec::with_capacity(n_attn);
        let mut vpool = Vec::with_capacity(n_attn);
        for _ in 0..n_attn {
            kpool.push(DevBuf::alloc(gpu, per_layer)?);
            vpool.push(DevBuf::alloc(gpu, per_layer)?);
        }
        let conv = DevBuf::zeros(gpu, max_seqs * n_gdn.max(1) * 2 * conv_len * 4)?;
        let rec = DevBuf::zeros(gpu, max_seqs * n_gdn.max(1) * rec_len * 4)?;
        let tables = DevBuf::zeros(gpu, max_seqs * max_blocks_per_seq * 4)?;
        Ok(CudaState {
            gpu: gpu.clone(),
            n_attn,
            n_gdn,
            conv_len,
            rec_len,
            kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            max_context: opts.max_context,
            max_blocks_per_seq,
            num_blocks,
            conv,
            rec,
            kpool,
            vpool,
            tables,
            free_blocks: (0..num_blocks as u32).rev().collect(),
            slots: (0..max_seqs).map(|_| None).collect(),
        })
    }

    pub fn slot(&self, slot: usize) -> Result<&SlotState> {
        self.slots.get(slot).and_then(|s| s.as_ref()).ok_or_else(|| Error::Backend(format!("state slot {slot} is not allocated")))
    }

    pub fn slot_mut(&mut self, slot: usize) -> Result<&mut SlotState> {
        self.slots.get_mut(slot).and_then(|s| s.as_mut()).ok_or_else(|| Error::Backend(format!("state slot {slot} is not allocated")))
    }

    /// Base of [2][(K-1)·C] f32 conv state of GDN layer `layer` in `slot`.
    pub fn conv_ptr(&self, slot: usize, layer: usize) -> u64 {
        self.conv.ptr + (((slot * self.n_gdn + layer) * 2 * self.conv_len) * 4) as u64
    }

    pub fn rec_ptr(&self, slot: usize, layer: usize) -> u64 {
        self.rec.ptr + (((slot * self.n_gdn + layer) * self.rec_len) * 4) as u64
    }

    pub fn table_ptr(&self, slot: usize) -> u64 {
        self.tables.ptr + ((slot * self.max_blocks_per_seq) * 4) as u64
    }

    pub fn kpool_ptr(&self, layer: usize) -> u64 {
        self.kpool[layer].ptr
    }

    pub fn vpool_ptr(&self, layer: usize) -> u64 {
        self.vpool[layer].ptr
    }

    /// Makes room in `slot` for positions < `n` (allocating blocks and updating its table).
    pub fn ensure_capacity(&mut self, slot: usize, n: usize) -> Result<()> {
        if n > self.max_context {
            return Err(Error::Op { op: "attention", msg: format!("context {n} exceeds the maximum {}", self.max_context) });
        }
        let need = n.div_ceil(KV_BLOCK);
        let have = self.slot(slot)?.blocks.len();
        if need <= have {
            return Ok(());
        }
        if self.free_blocks.len() < need - have {
            return Err(Error::Backend(format!("KV cache is full: {} blocks of {KV_BLOCK} positions are all in use", self.num_blocks)));
        }
        let new: Vec<u32> = (0..need - have).map(|_| self.free_blocks.pop().unwrap()).collect();
        let off = (slot * self.max_blocks_per_seq + have) * 4;
        self.tables.upload(off, bytemuck::cast_slice(&new))?;
        self.slot_mut(slot)?.blocks.extend(new);
        Ok(())
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl StatePool for CudaState {
    fn alloc(&mut self) -> Option<usize> {
        let i = self.slots.iter().position(Option::is_none)?;
        let conv_bytes = self.n_gdn * 2 * self.conv_len * 4;
        let rec_bytes = self.n_gdn * self.rec_len * 4;
        // SAFETY: the ranges lie inside the slot's part of the buffers.
        let ok = unsafe {
            use cudarc::driver::sys;
            sys::cuCtxSetCurrent(self.gpu.ctx);
            sys::cuMemsetD8Async(self.conv.ptr + (i * conv_bytes) as u64, 0, conv_bytes, self.gpu.stream) == sys::CUresult::CUDA_SUCCESS
                && sys::cuMemsetD8Async(self.rec.ptr + (i * rec_bytes) as u64, 0, rec_bytes, self.gpu.stream) == sys::CUresult::CUDA_SUCCESS
        };
        if !ok {
            return None;
        }
        self.slots[i] = Some(SlotState { attn_len: vec![0; self.n_attn], blocks: Vec::new() });
        Some(i)
    }

    fn free(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot).and_then(Option::take) {
            self.free_blocks.extend(s.blocks.into_iter().rev());
        }
    }

    fn in_use(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn bytes_in_use(&self) -> usize {
        let block_bytes = self.n_attn * 2 * self.kv_heads * KV_BLOCK * self.head_dim * 2;
        let fixed = self.n_gdn * (2 * self.conv_len + self.rec_len) * 4;
        self.slots.iter().flatten().map(|s| fixed + s.blocks.len() * block_bytes).sum()
    }
}
