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
//! A snapshot at a position inside the span of the next forward pass (`capture_at`) gets its GDN
//! buffer when asked for; the pass's GDN layers write their states at that position into it
//! (`layers::deltanet`), and `take_captures` adds the KV block references after the pass.
//!
//! Sizing ([`plan_memory`]): orchid may use `StateOptions::memory_utilization` (F) of the GPU's
//! total memory in all, weights included, like vLLM's `--gpu-memory-utilization`; the state gets
//! F·total minus what is in use when it is created (weights, CUDA context, other processes). The
//! GDN slots of `max_seqs` sequences must fit, then the KV pool takes up to `max_seqs` full
//! `max_context` sequences of what is left (at least one), and the prefix cache's reserve comes
//! from what the pool left over. Each sequence is promised, when admitted, the blocks of the
//! positions it may reach (`StatePool::promise`); blocks promised and not yet taken are not
//! offered to others, so a running sequence never finds the pool empty.

use std::sync::Arc;

use orchid_model::backend::{StateOptions, StatePool};
use orchid_model::config::ModelConfig;
use orchid_model::error::{Error, Result};

use crate::driver::{DevBuf, Gpu, copy_d2d};

pub const KV_BLOCK: usize = 64;

/// Default prefix-cache budget: this share of the state's memory budget, at most
/// `DEFAULT_CACHE_MAX`, and no more than the KV pool left over.
const DEFAULT_CACHE_SHARE: f64 = 0.15;
const DEFAULT_CACHE_MAX: usize = 8 << 30;

const GIB: f64 = 1073741824.0;

/// What the state's memory is sized from.
#[derive(Clone, Copy, Debug)]
pub struct MemoryInputs {
    /// The device's memory, and what of it is free now (after the weights were loaded).
    pub total: usize,
    pub free: usize,
    /// The share of `total` orchid may use in all, weights included.
    pub utilization: f64,
    pub max_seqs: usize,
    pub max_context: usize,
    /// One sequence's GDN conv + recurrent states, all layers.
    pub gdn_slot_bytes: usize,
    /// One KV block (KV_BLOCK positions) of all attention layers, K and V; 0 without attention layers.
    pub block_bytes: usize,
    /// A KV pool of this many positions instead of what memory allows.
    pub kv_tokens: Option<usize>,
}

/// How the state's memory is divided ([`plan_memory`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The device's memory.
    pub total: usize,
    /// Bytes in use before the state (weights, CUDA context, other processes).
    pub in_use: usize,
    /// Bytes the state may take: utilization·total − in_use.
    pub budget: usize,
    /// The GDN states of all slots.
    pub gdn_bytes: usize,
    /// KV blocks for the live sequences, and the blocks one full-length sequence needs.
    pub kv_blocks: usize,
    pub blocks_per_seq: usize,
    pub block_bytes: usize,
}

impl MemoryPlan {
    pub fn kv_bytes(&self) -> usize {
        self.kv_blocks * self.block_bytes
    }

    /// Positions the KV pool holds (`usize::MAX` without attention layers).
    pub fn kv_tokens(&self) -> usize {
        if self.block_bytes == 0 { usize::MAX } else { self.kv_blocks * KV_BLOCK }
    }

    /// Sequences of the full context the KV pool holds at once.
    pub fn full_seqs(&self) -> usize {
        if self.block_bytes == 0 { usize::MAX } else { self.kv_blocks / self.blocks_per_seq.max(1) }
    }

    /// Budget left after the GDN state and the KV pool.
    pub fn spare(&self) -> usize {
        self.budget.saturating_sub(self.gdn_bytes + self.kv_bytes())
    }

    /// The prefix cache's default budget: 15% of the state budget, at most 8 GiB.
    pub fn default_cache_bytes(&self) -> usize {
        ((self.budget as f64 * DEFAULT_CACHE_SHARE) as usize).min(DEFAULT_CACHE_MAX)
    }

    /// The prefix cache's byte budget and the KV blocks added to the pool for it, for a cache
    /// that asks for `want` bytes (`None`: 15% of the state budget, at most 8 GiB). The cache
    /// holds KV blocks and GDN copies together within its budget: the pool grows by
    /// `budget / block_bytes` blocks and as much again is left free for the GDN copies, all out
    /// of [`spare`](Self::spare); the budget shrinks to fit.
    pub fn cache_reserve(&self, want: Option<usize>) -> (usize, usize) {
        let want = want.unwrap_or(self.default_cache_bytes());
        if self.block_bytes == 0 {
            return (want.min(self.spare()), 0);
        }
        let budget = want.min(self.spare() / 2);
        (budget, budget / self.block_bytes)
    }
}

/// Divides the memory orchid may still use between the GDN states of `max_seqs` slots (which
/// must fit) and the KV pool (up to `max_seqs` full-length sequences, at least one); an error
/// says what did not fit and what to change.
pub fn plan_memory(m: &MemoryInputs) -> std::result::Result<MemoryPlan, String> {
    let f = m.utilization;
    if !(f > 0.0 && f <= 1.0) {
        return Err(format!("the GPU memory utilization must be in (0, 1], not {f}"));
    }
    let gib = |b: usize| b as f64 / GIB;
    let in_use = m.total.saturating_sub(m.free);
    let limit = (m.total as f64 * f) as usize;
    let budget = limit.saturating_sub(in_use);
    let max_seqs = m.max_seqs.max(1);
    let gdn_bytes = max_seqs * m.gdn_slot_bytes;
    if gdn_bytes > budget {
        return Err(format!(
            "GPU memory: the recurrent (GDN) state of {max_seqs} sequences needs {:.2} GiB ({:.1} MiB each), but only {:.2} GiB are available \
             at --gpu-memory-utilization {f} ({:.2} of the GPU's {:.2} GiB, {:.2} GiB already in use by the weights and CUDA); \
             lower --max-seqs or raise --gpu-memory-utilization",
            gib(gdn_bytes),
            m.gdn_slot_bytes as f64 / 1048576.0,
            gib(budget),
            gib(limit),
            gib(m.total),
            gib(in_use),
        ));
    }
    let blocks_per_seq = m.max_context.max(1).div_ceil(KV_BLOCK);
    if m.block_bytes == 0 {
        return Ok(MemoryPlan { total: m.total, in_use, budget, gdn_bytes, kv_blocks: 1, blocks_per_seq, block_bytes: 0 });
    }
    let fit = (budget - gdn_bytes) / m.block_bytes;
    let kv_blocks = match m.kv_tokens {
        Some(t) => t.div_ceil(KV_BLOCK),
        None => (max_seqs * blocks_per_seq).min(fit),
    };
    let short = |what: String| {
        format!(
            "GPU memory: {what}; {:.2} GiB are left for the KV cache after the recurrent state of {max_seqs} sequences ({:.2} GiB) \
             at --gpu-memory-utilization {f} ({:.2} of the GPU's {:.2} GiB, {:.2} GiB already in use by the weights and CUDA); \
             lower --max-context or --max-seqs, or raise --gpu-memory-utilization",
            gib((budget - gdn_bytes) / m.block_bytes * m.block_bytes),
            gib(gdn_bytes),
            gib(limit),
            gib(m.total),
            gib(in_use),
        )
    };
    if kv_blocks > fit {
        return Err(short(format!("a KV cache of {} positions needs {:.2} GiB", kv_blocks * KV_BLOCK, gib(kv_blocks * m.block_bytes))));
    }
    if kv_blocks < blocks_per_seq {
        return Err(short(format!(
            "one sequence of --max-context {} needs {:.2} GiB of KV cache, the cache has room for {} positions",
            m.max_context,
            gib(blocks_per_seq * m.block_bytes),
            kv_blocks * KV_BLOCK
        )));
    }
    Ok(MemoryPlan { total: m.total, in_use, budget, gdn_bytes, kv_blocks, blocks_per_seq, block_bytes: m.block_bytes })
}

/// A sequence's state after its first `len` tokens (`len` a multiple of KV_BLOCK): its GDN conv
/// and recurrent states (device copies) and references to its first `len / KV_BLOCK` KV blocks.
pub struct CudaSnapshot {
    gdn: DevBuf,
    blocks: Vec<u32>,
    len: usize,
}

/// A snapshot asked for inside the span of the next forward pass (`StatePool::capture_at`): its
/// GDN buffer (the layout of `CudaSnapshot::gdn`) and which GDN layers have written it.
struct CudaCapture {
    at: usize,
    gdn: DevBuf,
    written: Vec<bool>,
}

/// Where GDN layer `layer` writes a capture (`CudaState::captures_in`).
#[derive(Clone, Copy, Debug)]
pub struct CaptureDst {
    /// The position, as an offset from the span's start.
    pub offset: usize,
    /// The layer's conv states [2][(K-1)·C] and recurrent state in the capture.
    pub conv: u64,
    pub rec: u64,
}

pub struct SlotState {
    /// Tokens in the KV cache, per attention layer.
    pub attn_len: Vec<usize>,
    pub blocks: Vec<u32>,
    /// Blocks promised to this slot in all (`StatePool::promise`), taken or not.
    pub promised: usize,
    /// Captures asked for (`StatePool::capture_at`), ascending by position.
    captures: Vec<CudaCapture>,
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
    plan: MemoryPlan,
    /// The slots and start positions of the last eager decode-rows batch, on the device
    /// (`decode_rows`: uploaded once per forward call, read by every layer).
    pub rows_meta: Option<(Vec<(usize, usize)>, DevBuf)>,
    /// The prefix cache's budget and the blocks added to the pool for it.
    cache_budget: Option<usize>,
    cache_blocks: usize,
    utilization: f64,
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
        let block_bytes = n_attn * 2 * a.num_kv_heads * KV_BLOCK * a.head_dim * 2;
        let (free, total) = gpu.mem_info()?;
        let plan = plan_memory(&MemoryInputs {
            total,
            free,
            utilization: opts.memory_utilization,
            max_seqs,
            max_context: opts.max_context,
            gdn_slot_bytes: n_gdn.max(1) * (2 * conv_len + rec_len) * 4,
            block_bytes,
            kv_tokens: opts.kv_tokens,
        })
        .map_err(Error::Backend)?;
        let num_blocks = plan.kv_blocks;
        if n_attn > 0 && plan.full_seqs() < max_seqs {
            tracing::info!(
                "KV cache: {num_blocks} blocks of {KV_BLOCK} positions, {} tokens; maximum concurrency for {} tokens per request: {:.2}x \
                 (of --max-seqs {max_seqs}; requests wait until their prompt + max_tokens have room)",
                plan.kv_tokens(),
                opts.max_context,
                num_blocks as f64 / max_blocks_per_seq as f64
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
            plan,
            rows_meta: None,
            cache_budget: None,
            cache_blocks: 0,
            utilization: opts.memory_utilization,
        })
    }

    /// Slots the state has room for (allocated or not).
    pub fn capacity(&self) -> usize {
        self.slots.len()
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

    /// The captures of `slot` strictly inside its span [start, start + len), ascending, with
    /// where GDN layer `layer` writes them.
    pub fn captures_in(&self, slot: usize, layer: usize, start: usize, len: usize) -> Result<Vec<CaptureDst>> {
        let (conv_bytes, _) = self.gdn_bytes();
        let caps = &self.slot(slot)?.captures;
        Ok(caps
            .iter()
            .filter(|c| c.at > start && c.at < start + len)
            .map(|c| CaptureDst {
                offset: c.at - start,
                conv: c.gdn.ptr + (layer * 2 * self.conv_len * 4) as u64,
                rec: c.gdn.ptr + (conv_bytes + layer * self.rec_len * 4) as u64,
            })
            .collect())
    }

    /// Records that GDN layer `layer` wrote the capture of `slot` at `at`.
    pub fn captured(&mut self, slot: usize, layer: usize, at: usize) -> Result<()> {
        if let Some(c) = self.slot_mut(slot)?.captures.iter_mut().find(|c| c.at == at) {
            c.written[layer] = true;
        }
        Ok(())
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
        // Blocks promised to other slots and not taken yet are not ours to take.
        let others = self.outstanding(Some(slot));
        if self.free_blocks.len() < need - have + others {
            return Err(Error::Backend(format!(
                "KV cache is full: {} blocks of {KV_BLOCK} positions are all in use or promised to running sequences",
                self.num_blocks
            )));
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

    /// KV blocks a snapshot of `len` positions refers to, a partial last one included (none
    /// without attention layers).
    fn snapshot_blocks(&self, len: usize) -> usize {
        if self.n_attn == 0 { 0 } else { len.div_ceil(KV_BLOCK) }
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

    /// (Re)allocates the K and V pools of every attention layer for `num_blocks` blocks.
    fn alloc_pools(&mut self, num_blocks: usize) -> Result<()> {
        let per_layer = num_blocks * self.kv_heads * KV_BLOCK * self.head_dim * 2;
        self.kpool.clear();
        self.vpool.clear();
        for _ in 0..self.n_attn {
            self.kpool.push(DevBuf::alloc(&self.gpu, per_layer)?);
            self.vpool.push(DevBuf::alloc(&self.gpu, per_layer)?);
        }
        Ok(())
    }

    /// Blocks promised to live slots (all but `except`) and not taken yet.
    fn outstanding(&self, except: Option<usize>) -> usize {
        self.slots
            .iter()
            .enumerate()
            .filter(|&(i, _)| Some(i) != except)
            .filter_map(|(_, s)| s.as_ref())
            .map(|s| s.promised.saturating_sub(s.blocks.len()))
            .sum()
    }

    /// How the device memory was divided.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
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
        self.slots[i] = Some(SlotState { attn_len: vec![0; self.n_attn], blocks: Vec::new(), promised: 0, captures: Vec::new() });
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

    fn free_tokens(&self) -> usize {
        if self.n_attn == 0 {
            return usize::MAX;
        }
        self.free_blocks.len().saturating_sub(self.outstanding(None)) * KV_BLOCK
    }

    fn promise(&mut self, slot: usize, tokens: usize) {
        if let Some(Some(s)) = self.slots.get_mut(slot) {
            s.promised = tokens.div_ceil(KV_BLOCK);
        }
    }

    fn memory_plan(&self) -> Option<String> {
        let p = &self.plan;
        let gib = |b: usize| b as f64 / GIB;
        let cache = match self.cache_budget {
            Some(b) => format!(", prefix cache {:.2} GiB ({} KV blocks)", gib(b), self.cache_blocks),
            None => String::new(),
        };
        Some(format!(
            "GPU memory at utilization {}: {:.2} GiB of {:.2} GiB in use before the state (weights, CUDA context); \
             GDN state {:.2} GiB ({} slots); KV cache {:.2} GiB ({} blocks of {KV_BLOCK}, {} tokens, {} sequences of {} tokens){cache}; \
             {:.2} GiB of the budget unallocated",
            self.utilization,
            gib(p.in_use),
            gib(p.total),
            gib(p.gdn_bytes),
            self.slots.len(),
            gib(p.kv_bytes()),
            p.kv_blocks,
            p.kv_tokens(),
            p.full_seqs(),
            self.max_context,
            gib(p.spare().saturating_sub(self.cache_budget.map_or(0, |b| 2 * b))),
        ))
    }

    type Snapshot = CudaSnapshot;

    /// The KV blocks that snapshots hold come from the pool: it grows by `budget / block bytes`
    /// blocks, so that what the cache holds never takes room the live sequences were promised.
    /// The GDN copies are allocated as snapshots are taken.
    fn reserve_prefix_cache(&mut self, budget: Option<usize>) -> Result<usize> {
        if self.slots.iter().any(Option::is_some) {
            return Err(Error::Backend("the prefix cache must be reserved before any slot is used".into()));
        }
        let asked = budget.unwrap_or(self.plan.default_cache_bytes());
        let (budget, extra) = self.plan.cache_reserve(Some(asked));
        self.cache_budget = Some(budget);
        if budget < asked {
            tracing::warn!(
                "prefix cache: {:.0} MiB asked for, {:.0} MiB fit in what the GDN state and the KV cache leave of the memory budget \
                 (raise --gpu-memory-utilization, or lower --max-seqs or --max-context)",
                asked as f64 / 1048576.0,
                budget as f64 / 1048576.0
            );
        }
        if self.n_attn == 0 || extra == 0 {
            return Ok(budget);
        }
        let num_blocks = self.plan.kv_blocks + extra;
        if let Err(e) = self.alloc_pools(num_blocks) {
            // Back to the pool without the cache's blocks, so that the state stays usable.
            self.cache_budget = None;
            self.alloc_pools(self.num_blocks)?;
            return Err(e);
        }
        self.num_blocks = num_blocks;
        self.free_blocks = (0..num_blocks as u32).rev().collect();
        self.refs = vec![0; num_blocks];
        self.cache_blocks = extra;
        Ok(budget)
    }

    /// A snapshot whose length is not a multiple of the block size holds its partial last
    /// block too: the engine takes those only of a sequence that has ended, so nothing writes
    /// that block afterwards, and `restore` copies it before a new sequence writes into it.
    fn save(&mut self, slot: usize, len: usize) -> Result<CudaSnapshot> {
        let s = self.slot(slot)?;
        if s.attn_len.iter().any(|&l| l != len) {
            return Err(Error::Backend(format!("snapshot of {len} tokens asked for, the cache holds {:?}", s.attn_len)));
        }
        let blocks = s.blocks[..self.snapshot_blocks(len)].to_vec();
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

    fn capture_at(&mut self, slot: usize, at: usize) -> Result<()> {
        if !at.is_multiple_of(KV_BLOCK) {
            return Err(Error::Backend(format!("a snapshot is taken at a multiple of {KV_BLOCK} positions, not {at}")));
        }
        let s = self.slot(slot)?;
        if s.attn_len.iter().any(|&l| l >= at) {
            return Err(Error::Backend(format!("snapshot at {at} tokens asked for, the cache holds {:?} already", s.attn_len)));
        }
        let Err(i) = s.captures.binary_search_by_key(&at, |c| c.at) else { return Ok(()) };
        let (conv_bytes, rec_bytes) = self.gdn_bytes();
        self.gpu.bind()?;
        let gdn = DevBuf::alloc(&self.gpu, conv_bytes + rec_bytes)?;
        let written = vec![false; self.n_gdn];
        self.slot_mut(slot)?.captures.insert(i, CudaCapture { at, gdn, written });
        Ok(())
    }

    fn take_captures(&mut self, slot: usize) -> Result<Vec<(usize, CudaSnapshot)>> {
        let s = self.slot_mut(slot)?;
        let caps = std::mem::take(&mut s.captures);
        if let Some(c) = caps.iter().find(|c| c.written.contains(&false)) {
            return Err(Error::Backend(format!("the snapshot at {} tokens was not taken (no span had it inside, chunk-aligned)", c.at)));
        }
        if let Some(c) = caps.iter().find(|c| s.attn_len.iter().any(|&l| l < c.at)) {
            return Err(Error::Backend(format!("snapshot at {} tokens asked for, the cache holds {:?}", c.at, s.attn_len)));
        }
        let held = s.blocks.clone();
        let mut out = Vec::with_capacity(caps.len());
        for c in caps {
            let blocks = held[..self.snapshot_blocks(c.at)].to_vec();
            for &b in &blocks {
                self.refs[b as usize] += 1;
            }
            out.push((c.at, CudaSnapshot { gdn: c.gdn, blocks, len: c.at }));
        }
        Ok(out)
    }

    fn restore(&mut self, slot: usize, snap: &CudaSnapshot) -> Result<()> {
        if !self.slot(slot)?.blocks.is_empty() {
            return Err(Error::Backend(format!("state slot {slot} is not fresh")));
        }
        let (conv_bytes, rec_bytes) = self.gdn_bytes();
        self.gpu.bind()?;
        copy_d2d(&self.gpu, self.conv.ptr + (slot * conv_bytes) as u64, snap.gdn.ptr, conv_bytes)?;
        copy_d2d(&self.gpu, self.rec.ptr + (slot * rec_bytes) as u64, snap.gdn.ptr + conv_bytes as u64, rec_bytes)?;
        let mut blocks = snap.blocks.clone();
        // A partial last block is the sequence's to write into: copy it into one of its own.
        if !snap.len.is_multiple_of(KV_BLOCK)
            && let Some(last) = blocks.last_mut()
        {
            if self.free_blocks.len() <= self.outstanding(Some(slot)) {
                return Err(Error::Backend("KV cache is full: no block to copy a cached partial block into".into()));
            }
            let own = self.free_blocks.pop().expect("checked above");
            let bytes = self.kv_heads * KV_BLOCK * self.head_dim * 2;
            let (to, from) = ((own as usize * bytes) as u64, (*last as usize * bytes) as u64);
            let copied =
                self.kpool.iter().chain(&self.vpool).try_for_each(|pool| copy_d2d(&self.gpu, pool.ptr + to, pool.ptr + from, bytes));
            if let Err(e) = copied {
                self.free_blocks.push(own);
                return Err(e);
            }
            *last = own;
        }
        if !blocks.is_empty() {
            self.tables.upload(slot * self.max_blocks_per_seq * 4, bytemuck::cast_slice(&blocks))?;
        }
        for &b in &blocks {
            self.refs[b as usize] += 1;
        }
        let s = self.slot_mut(slot)?;
        s.blocks = blocks;
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

#[cfg(test)]
mod tests {
    use super::*;

    const GB: usize = 1 << 30;
    const MB: usize = 1 << 20;

    /// An H200-like device with 20 GiB in use after loading, 16 sequences of 32K.
    fn inputs() -> MemoryInputs {
        MemoryInputs {
            total: 140 * GB,
            free: 120 * GB,
            utilization: 0.9,
            max_seqs: 16,
            max_context: 32768,
            gdn_slot_bytes: 80 * MB,
            block_bytes: 3 * MB / 2,
            kv_tokens: None,
        }
    }

    #[test]
    fn budget_is_the_share_of_total_minus_what_is_in_use() {
        let p = plan_memory(&inputs()).unwrap();
        assert_eq!(p.in_use, 20 * GB);
        assert_eq!(p.budget, (140.0 * GB as f64 * 0.9) as usize - 20 * GB);
        assert_eq!(p.gdn_bytes, 16 * 80 * MB);
        // Room for every sequence at full length: the pool is sized for exactly that.
        assert_eq!(p.blocks_per_seq, 512);
        assert_eq!(p.kv_blocks, 16 * 512);
        assert_eq!(p.full_seqs(), 16);
        assert_eq!(p.kv_tokens(), 16 * 32768);
        assert_eq!(p.spare(), p.budget - p.gdn_bytes - 16 * 512 * (3 * MB / 2));
        // The default prefix cache: 15% of the budget, at most 8 GiB; twice that must be spare.
        let (cache, extra) = p.cache_reserve(None);
        assert_eq!(cache, 8 * GB);
        assert_eq!(extra, 8 * GB / (3 * MB / 2));
        assert_eq!(p.cache_reserve(Some(100 * MB)), (100 * MB, 100 * MB / (3 * MB / 2)));
    }

    #[test]
    fn a_tight_budget_gives_fewer_full_length_sequences_and_no_cache() {
        // 0.2 of 140 GiB = 28 GiB, 20 in use: 8 GiB, 1.25 for GDN, 6.75 for KV (9 of the 16
        // sequences at full length).
        let p = plan_memory(&MemoryInputs { utilization: 0.2, ..inputs() }).unwrap();
        let fit = (p.budget - p.gdn_bytes) / p.block_bytes;
        assert_eq!(p.kv_blocks, fit);
        assert_eq!(p.full_seqs(), 9);
        assert!(p.spare() < p.block_bytes);
        assert_eq!(p.cache_reserve(None), (p.spare() / 2, 0));
        assert!(p.gdn_bytes + p.kv_bytes() <= p.budget);
    }

    #[test]
    fn what_does_not_fit_fails_with_the_numbers_and_the_flags() {
        // The GDN slots alone: 2000 × 80 MiB = 156 GiB.
        let e = plan_memory(&MemoryInputs { max_seqs: 2000, ..inputs() }).unwrap_err();
        assert!(e.contains("2000 sequences needs 156.25 GiB"), "{e}");
        assert!(e.contains("--max-seqs") && e.contains("--gpu-memory-utilization 0.9"), "{e}");
        // Nothing left at all: more is in use than the share allows.
        let e = plan_memory(&MemoryInputs { utilization: 0.1, ..inputs() }).unwrap_err();
        assert!(e.contains("only 0.00 GiB are available"), "{e}");
        // GDN fits, one full-length sequence does not: 1M positions need 24 GiB.
        let e = plan_memory(&MemoryInputs { utilization: 0.3, max_context: 1 << 20, ..inputs() }).unwrap_err();
        assert!(e.contains("one sequence of --max-context 1048576 needs 24.00 GiB"), "{e}");
        assert!(e.contains("lower --max-context or --max-seqs, or raise --gpu-memory-utilization"), "{e}");
        for f in [0.0, -0.5, 1.5, f64::NAN] {
            assert!(plan_memory(&MemoryInputs { utilization: f, ..inputs() }).is_err(), "{f}");
        }
    }

    #[test]
    fn an_explicit_kv_size_is_rounded_to_blocks_and_checked() {
        let p = plan_memory(&MemoryInputs { kv_tokens: Some(40000), ..inputs() }).unwrap();
        assert_eq!(p.kv_blocks, 40000usize.div_ceil(KV_BLOCK));
        assert_eq!(p.full_seqs(), 1);
        assert!(plan_memory(&MemoryInputs { kv_tokens: Some(1000), ..inputs() }).unwrap_err().contains("one sequence"));
        assert!(plan_memory(&MemoryInputs { kv_tokens: Some(100 << 20), ..inputs() }).unwrap_err().contains("needs"));
    }

    #[test]
    fn without_attention_layers_only_the_gdn_state_counts() {
        let p = plan_memory(&MemoryInputs { block_bytes: 0, ..inputs() }).unwrap();
        assert_eq!(p.kv_bytes(), 0);
        assert_eq!(p.kv_tokens(), usize::MAX);
        assert_eq!(p.cache_reserve(Some(GB)), (GB, 0));
    }
}
