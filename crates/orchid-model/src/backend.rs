//! The narrow interface the forward pass is written against. A backend owns its tensors and
//! weights; the model never looks inside them. The CPU backend is the f32 reference of every
//! op; the CUDA backend implements the same ops with fused kernels.
//!
//! Shapes: T tokens in the flat batch, H hidden, Hq/Hkv attention heads of D, Hk/Hv GDN heads
//! of dk/dv, C = conv channels (2·Hk·dk + Hv·dv), E experts.

use crate::batch::BatchLayout;
use crate::config::{AttentionDims, DeltaNetDims, ModelConfig, MoeDims};
use crate::error::Result;
use crate::linear::LinearWeight;
use crate::weights::HostMlp;

/// Per-sequence decode state: KV caches of the attention layers and the conv + recurrent
/// states of the GDN layers, in slots the engine allocates.
pub trait StatePool: Send {
    /// Claims a free slot, reset to an empty sequence; `None` when all are in use.
    fn alloc(&mut self) -> Option<usize>;
    /// Releases a slot (and drops the captures asked for it, [`StatePool::capture_at`]).
    fn free(&mut self, slot: usize);
    /// Slots in use.
    fn in_use(&self) -> usize;
    /// Number of slots.
    fn capacity(&self) -> usize;
    /// Bytes of state currently held by live sequences.
    fn bytes_in_use(&self) -> usize;

    // KV room. A pool of limited KV memory (CUDA's block pool, or a host pool given
    // `StateOptions::kv_tokens`) promises each sequence the positions it may reach when it is
    // admitted, so that a running sequence never finds the pool empty: the engine admits a
    // request only when `free_tokens` covers its prompt + max_tokens, else it waits.

    /// KV positions a new sequence can still be promised: free room not promised to live
    /// sequences (`usize::MAX`: no limit).
    fn free_tokens(&self) -> usize {
        usize::MAX
    }
    /// Promises `slot` room for its first `tokens` positions in all (what it holds already,
    /// restored prefix included, counts towards it); the engine asks only for what
    /// `free_tokens` offered.
    fn promise(&mut self, slot: usize, tokens: usize) {
        let _ = (slot, tokens);
    }
    /// One line on how the device memory was divided (for the start-up log), if the pool has one.
    fn memory_plan(&self) -> Option<String> {
        None
    }

    // The prefix cache (orchid-engine's `prefix_cache`): the state of a sequence after its
    // first `len` tokens, kept so that a later sequence starting with the same tokens skips them.

    /// A saved state: the GDN conv + recurrent states and the KV of the attention layers for the
    /// first `len` positions of a sequence (copies on the CPU; on CUDA the GDN states are copied
    /// on the device and the KV blocks are shared, reference-counted).
    type Snapshot: Send;
    /// Makes room for prefix-cache snapshots before any slot is used and returns the byte budget
    /// the cache may hold (`None`: the backend's default; see docs/prefix-cache.md).
    fn reserve_prefix_cache(&mut self, budget: Option<usize>) -> Result<usize>;
    /// Saves the state of `slot`, which must hold exactly `len` tokens.
    fn save(&mut self, slot: usize, len: usize) -> Result<Self::Snapshot>;
    /// Asks the next forward pass over `slot` for a snapshot at position `at` strictly inside
    /// its span (start < `at` < start + len, `at` − start a multiple of [`GDN_CHUNK`], `at` a
    /// position `save` accepts): the GDN layers copy their states at `at` during the pass (the
    /// chunked recurrence has a state there), so the prefill need not stop at `at` for `save`.
    /// Several positions may be asked for one pass; a position asked for twice counts once.
    fn capture_at(&mut self, slot: usize, at: usize) -> Result<()>;
    /// The snapshots the forward pass since `capture_at` took for `slot`, ascending by position,
    /// each what `save(slot, at)` returns after a pass that ends at `at` (the attention KV of the
    /// positions before `at` is final once they ran); clears the requests. Fails when a GDN layer
    /// did not take one (no span of the pass had `at` strictly inside, chunk-aligned).
    fn take_captures(&mut self, slot: usize) -> Result<Vec<(usize, Self::Snapshot)>>;
    /// Replaces the (fresh) state of `slot` with a snapshot; the slot then holds `len` tokens.
    fn restore(&mut self, slot: usize, snap: &Self::Snapshot) -> Result<()>;
    /// Gives a snapshot's memory back (on CUDA: drops its references to KV blocks).
    fn release(&mut self, snap: Self::Snapshot);
    /// Bytes a snapshot counts against the cache budget.
    fn snapshot_bytes(&self, snap: &Self::Snapshot) -> usize;
}

/// Tokens per chunk of the chunked GDN recurrence of a prefill span on every backend, counted
/// from the span's start: the states between chunks are where a pass can take a snapshot
/// ([`StatePool::capture_at`]).
pub const GDN_CHUNK: usize = 64;

/// Sizes the engine asks a state pool for.
#[derive(Clone, Copy, Debug)]
pub struct StateOptions {
    pub max_seqs: usize,
    /// Longest context one sequence may reach (positions).
    pub max_context: usize,
    /// The share of the device's total memory the process may use in all, weights included
    /// (vLLM's `gpu_memory_utilization`); the state gets what of it is not in use yet. Devices
    /// with their own memory only (CUDA); the host ignores it.
    pub memory_utilization: f64,
    /// KV positions all live sequences may hold together, instead of what memory allows (CUDA)
    /// or no limit (the host, where it only bounds admission: see [`StatePool::free_tokens`]).
    pub kv_tokens: Option<usize>,
}

/// The default [`StateOptions::memory_utilization`].
pub const DEFAULT_MEMORY_UTILIZATION: f64 = 0.9;

/// The prompt tokens one engine step runs when none are asked for, on a device of
/// `total_memory` bytes (`None`: the host): vLLM's rule for its server, 8192 on a GPU of 70 GiB or
/// more, where larger prefill steps run at a higher token rate (the H200 serving benchmark:
/// docs/perf-log.md), else 2048.
pub fn default_batched_tokens(total_memory: Option<usize>) -> usize {
    match total_memory {
        Some(bytes) if bytes >= 70 << 30 => 8192,
        _ => 2048,
    }
}

impl StateOptions {
    /// `max_seqs` sequences of up to `max_context` positions, the default memory share, the KV
    /// pool sized from memory.
    pub fn new(max_seqs: usize, max_context: usize) -> StateOptions {
        StateOptions { max_seqs, max_context, memory_utilization: DEFAULT_MEMORY_UTILIZATION, kv_tokens: None }
    }
}

/// The attention inputs of one layer. q_gate [T, Hq·D·(1+gate)], k/v [T, Hkv·D].
pub struct AttentionInputs<'a, B: Backend> {
    pub q_gate: &'a B::Tensor,
    pub k: &'a B::Tensor,
    pub v: &'a B::Tensor,
    pub q_norm: &'a B::Vector,
    pub k_norm: &'a B::Vector,
}

/// The GDN inputs of one layer. qkv [T, C], z [T, Hv·dv], b/a [T, Hv].
pub struct DeltaNetInputs<'a, B: Backend> {
    pub qkv: &'a B::Tensor,
    pub z: &'a B::Tensor,
    pub b: &'a B::Tensor,
    pub a: &'a B::Tensor,
    /// [C, K] conv taps, [Hv] A_log and dt_bias, [dv] gated-norm weight.
    pub conv: &'a B::Vector,
    pub a_log: &'a B::Vector,
    pub dt_bias: &'a B::Vector,
    pub norm: &'a B::Vector,
}

/// The uploaded weights of one MoE block.
pub struct MoeWeights<B: Backend> {
    pub router: B::Linear,
    pub experts: B::Experts,
    pub shared: Option<Mlp<B>>,
    pub shared_gate: Option<B::Linear>,
}

/// A SwiGLU MLP: down(silu(gate(x)) ⊙ up(x)).
pub struct Mlp<B: Backend> {
    pub gate_proj: B::Linear,
    pub up_proj: B::Linear,
    pub down_proj: B::Linear,
}

pub trait Backend: Send + Sync + Sized + 'static {
    /// A row-major [rows, cols] activation matrix.
    type Tensor: Send;
    /// A weight matrix W [out, in] for y = x·Wᵀ.
    type Linear: Send + Sync;
    /// A small f32 parameter vector.
    type Vector: Send + Sync;
    /// The routed experts of one MoE layer.
    type Experts: Send + Sync;
    type State: StatePool;

    /// One line for logs: device name and memory.
    fn describe(&self) -> String;
    /// Prompt tokens one engine step runs unless told otherwise ([`default_batched_tokens`] of
    /// the device's memory; the host's by default).
    fn default_batched_tokens(&self) -> usize {
        default_batched_tokens(None)
    }

    fn upload_linear(&self, w: &LinearWeight) -> Result<Self::Linear>;
    fn upload_vector(&self, v: &[f32]) -> Result<Self::Vector>;
    fn upload_experts(&self, experts: &[HostMlp]) -> Result<Self::Experts>;
    fn new_state(&self, cfg: &ModelConfig, opts: StateOptions) -> Result<Self::State>;

    /// Rows of the embedding table for `ids` -> [T, H].
    fn embed(&self, table: &Self::Linear, ids: &[u32]) -> Result<Self::Tensor>;
    /// y = x / sqrt(mean(x²) + eps) · w, per row (w holds the full multiplier).
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32) -> Result<Self::Tensor>;
    /// x += y.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// x += y, then returns rms_norm(x). Backends may fuse.
    fn add_rms_norm(&self, x: &mut Self::Tensor, y: &Self::Tensor, w: &Self::Vector, eps: f32) -> Result<Self::Tensor> {
        self.add_assign(x, y)?;
        self.rms_norm(x, w, eps)
    }
    /// x·Wᵀ: [T, in] -> [T, out].
    fn matmul(&self, x: &Self::Tensor, w: &Self::Linear) -> Result<Self::Tensor>;

    // The fusions the forward pass is written with: each names a pattern of the model, with a
    // default composed of the ops above (the CPU backend keeps the defaults, so it stays the plain
    // reference); a backend overrides what it can fuse.

    /// The projections of a block's input: rms_norm(x)·W_iᵀ for each W_i of `ws`.
    fn norm_matmuls(&self, x: &Self::Tensor, norm: &Self::Vector, eps: f32, ws: &[&Self::Linear]) -> Result<Vec<Self::Tensor>> {
        let xn = self.rms_norm(x, norm, eps)?;
        ws.iter().map(|w| self.matmul(&xn, w)).collect()
    }
    /// A block's output projection added to the residual stream: x += y·Wᵀ.
    fn matmul_add(&self, x: &mut Self::Tensor, y: &Self::Tensor, w: &Self::Linear) -> Result<()> {
        let p = self.matmul(y, w)?;
        self.add_assign(x, &p)
    }
    /// The whole feed-forward block of a MoE layer: x += moe(rms_norm(x)). `next`: the norm that
    /// the block after this one applies to x first (its `norm_matmuls`), which a backend may
    /// prepare while it writes x.
    fn moe_block(
        &self,
        x: &mut Self::Tensor,
        norm: &Self::Vector,
        eps: f32,
        w: &MoeWeights<Self>,
        dims: &MoeDims,
        next: Option<&Self::Vector>,
    ) -> Result<()> {
        let _ = next;
        let xn = self.rms_norm(x, norm, eps)?;
        let y = self.moe(&xn, w, dims)?;
        self.add_assign(x, &y)
    }
    /// silu(gate) ⊙ up.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// The rows `rows` of x, in that order.
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
    /// Copies a tensor to the host (row-major f32).
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;

    /// Gated attention core of one layer (docs/model.md §4): splits query|gate per head,
    /// q/k RMSNorm, partial RoPE at each token's position, appends K/V to the cache of
    /// attention layer `layer` in each span's slot, causal GQA softmax attention over the
    /// cache, multiplies by sigmoid(gate). Returns [T, Hq·D].
    fn attention(
        &self,
        inp: AttentionInputs<'_, Self>,
        dims: &AttentionDims,
        eps: f32,
        layer: usize,
        batch: &BatchLayout,
        state: &mut Self::State,
    ) -> Result<Self::Tensor>;

    /// Gated DeltaNet core of one layer (docs/model.md §5): causal depthwise conv with the
    /// slot's conv state + SiLU, L2-normalised q/k, β = sigmoid(b), g = −exp(A_log)·softplus(a +
    /// dt_bias), the delta-rule recurrence on the fp32 state (chunked for spans longer than
    /// one token), and the gated RMSNorm with SiLU(z). Returns [T, Hv·dv].
    fn deltanet(
        &self,
        inp: DeltaNetInputs<'_, Self>,
        dims: &DeltaNetDims,
        eps: f32,
        layer: usize,
        batch: &BatchLayout,
        state: &mut Self::State,
    ) -> Result<Self::Tensor>;

    /// The sparse MoE block (docs/model.md §6): softmax router over all experts, top-k,
    /// optional renormalisation, SwiGLU experts, shared expert with a sigmoid gate. [T, H] -> [T, H].
    fn moe(&self, x: &Self::Tensor, w: &MoeWeights<Self>, dims: &MoeDims) -> Result<Self::Tensor>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_tokens_by_device_memory() {
        assert_eq!(default_batched_tokens(None), 2048);
        assert_eq!(default_batched_tokens(Some(24 << 30)), 2048);
        assert_eq!(default_batched_tokens(Some(80 << 30)), 8192);
        assert_eq!(default_batched_tokens(Some(140 << 30)), 8192);
    }
}
