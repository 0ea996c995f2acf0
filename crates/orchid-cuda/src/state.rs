//! Per-sequence decode state on the GPU, in slots the engine allocates:
//! - KV cache of the attention layers in fixed blocks of KV_BLOCK positions, bf16,
//!   [num_blocks][Hkv][KV_BLOCK][D] per layer for K and for V, one block table per slot
//!   (shared by all layers) on the device;
//! - per GDN layer the conv state [2][(K-1)·C] f32 (two buffers, see kernels/deltanet.cu) and
//!   the recurrent state [Hv][dk][dv] f32.
//!
//! Blocks are taken from a free list as sequences grow and returned when no slot or prefix-cache
//! snapshot refers to them any more (a reference count per block).
//!
//! Prefix-cache snapshots (`StatePool::save`) are taken at block boundaries: a snapshot copies
//! the slot's GDN states into a device buffer of its own and shares the slot's full KV blocks
//! (references, no copy); a restore copies the GDN states back and maps the shared blocks into
//! the new slot's table. Every sequence only ever writes positions past its restored length,
//! which lie in blocks of its own, so shared blocks are never written (no copy-on-write needed).

use std::sync::Arc;

use orchid_model::backend::{StateOptions, StatePool};
use orchid_model::config::ModelConfig;
use orchid_model::error::{Error, Result};

use crate::driver::{DevBuf, Gpu, copy_d2d};

pub const KV_BLOCK: usize = 64;

/// Default prefix-cache budget: this share of the free device memory, at most `DEFAULT_CACHE_MAX`.
const DEFAULT_CACHE_SHARE: f64 = 0.15;
const DEFAULT_CACHE_MAX: usize = 8 << 30;

/// A sequence's state after its first `len` tokens (`len` a multiple of KV_BLOCK): its GDN conv
/// and recurrent states (device copies) and references to its first `len / KV_BLOCK` KV blocks.
pub struct CudaSnapshot {
    gdn: DevBuf,
    blocks: Vec<u32>,
    len: usize,
}

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
    /// References to each block (slots and snapshots holding it).
    refs: Vec<u32>,
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
            refs: vec![0; num_blocks],
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

    /// Floats from a slot's conv states to the next slot's (`conv_ptr`).
    pub fn conv_slot_stride(&self) -> usize {
        self.n_gdn * 2 * self.conv_len
    }

    /// Floats from a slot's recurrent states to the next slot's (`rec_ptr`).
    pub fn rec_slot_stride(&self) -> usize {
        self.n_gdn * self.rec_len
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
        for &b in &new {
            self.refs[b as usize] = 1;
        }
        let off = (slot * self.max_blocks_per_seq + have) * 4;
        self.tables.upload(off, bytemuck::cast_slice(&new))?;
        self.slot_mut(slot)?.blocks.extend(new);
        Ok(())
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn block_bytes(&self) -> usize {
        self.n_attn * 2 * self.kv_heads * KV_BLOCK * self.head_dim * 2
    }

    /// Bytes of one slot's conv states and of its recurrent states.
    fn gdn_bytes(&self) -> (usize, usize) {
        (self.n_gdn * 2 * self.conv_len * 4, self.n_gdn * self.rec_len * 4)
    }

    /// Drops one reference to each block; a block nobody holds goes back to the free list.
    fn unref_blocks(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r == 0 {
                self.free_blocks.push(b);
            }
        }
    }

    /// Free KV blocks (tests).
    pub fn free_block_count(&self) -> usize {
        self.free_blocks.len()
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
            self.unref_blocks(&s.blocks);
        }
    }

    fn in_use(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn bytes_in_use(&self) -> usize {
        let block_bytes = self.block_bytes();
        let fixed = self.n_gdn * (2 * self.conv_len + self.rec_len) * 4;
        self.slots.iter().flatten().map(|s| fixed + s.blocks.len() * block_bytes).sum()
    }

    type Snapshot = CudaSnapshot;

    /// The KV blocks that snapshots hold come from the pool: it grows by `budget / block bytes`
    /// blocks, so that what the cache holds never takes room the live sequences were promised.
    /// The GDN copies are allocated as snapshots are taken.
    fn reserve_prefix_cache(&mut self, budget: Option<usize>) -> Result<usize> {
        if self.slots.iter().any(Option::is_some) {
            return Err(Error::Backend("the prefix cache must be reserved before any slot is used".into()));
        }
        let (free, _) = self.gpu.mem_info()?;
        let budget = budget.unwrap_or(((free as f64 * DEFAULT_CACHE_SHARE) as usize).min(DEFAULT_CACHE_MAX));
        if self.n_attn == 0 || budget == 0 {
            return Ok(budget);
        }
        let block_bytes = self.block_bytes();
        // Room for the extra blocks and for the GDN copies, within 90% of what is free.
        let room = ((free as f64 * 0.9) as usize).saturating_sub(budget);
        let extra = (budget / block_bytes).min(room / block_bytes);
        let num_blocks = self.num_blocks + extra;
        let per_layer = num_blocks * self.kv_heads * KV_BLOCK * self.head_dim * 2;
        self.kpool.clear();
        self.vpool.clear();
        for _ in 0..self.n_attn {
            self.kpool.push(DevBuf::alloc(&self.gpu, per_layer)?);
            self.vpool.push(DevBuf::alloc(&self.gpu, per_layer)?);
        }
        self.num_blocks = num_blocks;
        self.free_blocks = (0..num_blocks as u32).rev().collect();
        self.refs = vec![0; num_blocks];
        Ok(budget)
    }

    fn save(&mut self, slot: usize, len: usize) -> Result<CudaSnapshot> {
        if !len.is_multiple_of(KV_BLOCK) {
            return Err(Error::Backend(format!("a snapshot is taken at a multiple of {KV_BLOCK} positions, not {len}")));
        }
        let s = self.slot(slot)?;
        if s.attn_len.iter().any(|&l| l != len) {
            return Err(Error::Backend(format!("snapshot of {len} tokens asked for, the cache holds {:?}", s.attn_len)));
        }
        let blocks = s.blocks[..len / KV_BLOCK].to_vec();
        let (conv_bytes, rec_bytes) = self.gdn_bytes();
        self.gpu.bind()?;
        let gdn = DevBuf::alloc(&self.gpu, conv_bytes + rec_bytes)?;
        copy_d2d(&self.gpu, gdn.ptr, self.conv.ptr + (slot * conv_bytes) as u64, conv_bytes)?;
        copy_d2d(&self.gpu, gdn.ptr + conv_bytes as u64, self.rec.ptr + (slot * rec_bytes) as u64, rec_bytes)?;
        for &b in &blocks {
            self.refs[b as usize] += 1;
        }
        Ok(CudaSnapshot { gdn, blocks, len })
    }

    fn restore(&mut self, slot: usize, snap: &CudaSnapshot) -> Result<()> {
        if !self.slot(slot)?.blocks.is_empty() {
            return Err(Error::Backend(format!("state slot {slot} is not fresh")));
        }
        let (conv_bytes, rec_bytes) = self.gdn_bytes();
        self.gpu.bind()?;
        copy_d2d(&self.gpu, self.conv.ptr + (slot * conv_bytes) as u64, snap.gdn.ptr, conv_bytes)?;
        copy_d2d(&self.gpu, self.rec.ptr + (slot * rec_bytes) as u64, snap.gdn.ptr + conv_bytes as u64, rec_bytes)?;
        if !snap.blocks.is_empty() {
            self.tables.upload(slot * self.max_blocks_per_seq * 4, bytemuck::cast_slice(&snap.blocks))?;
        }
        for &b in &snap.blocks {
            self.refs[b as usize] += 1;
        }
        let s = self.slot_mut(slot)?;
        s.blocks = snap.blocks.clone();
        s.attn_len.iter_mut().for_each(|l| *l = snap.len);
        Ok(())
    }

    fn release(&mut self, snap: CudaSnapshot) {
        self.unref_blocks(&snap.blocks);
    }

    fn snapshot_bytes(&self, snap: &CudaSnapshot) -> usize {
        snap.gdn.bytes + snap.blocks.len() * self.block_bytes()
    }
}
