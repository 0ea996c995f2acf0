//! Per-sequence state on the host: a growing KV cache per attention layer, and a conv window
//! plus an fp32 recurrent state per GDN layer, in slots the engine allocates.
//!
//! Prefix-cache snapshots copy a slot's state (`save`), or, for a position inside the span of the
//! next forward pass (`capture_at`), are filled by the GDN layers during the pass with their
//! states at that position (`deltanet::deltanet`) and completed with the KV rows before it
//! afterwards (`take_captures`).

use orchid_model::backend::{StateOptions, StatePool};
use orchid_model::config::ModelConfig;
use orchid_model::error::{Error, Result};

/// Default prefix-cache budget on the host.
pub const DEFAULT_CACHE_BYTES: usize = 2 << 30;

/// K and V of one attention layer: [len, Hkv·D] each, post-norm post-RoPE K.
#[derive(Clone, Default)]
pub struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub len: usize,
}

#[derive(Clone)]
pub struct GdnState {
    /// The last K-1 pre-conv inputs, oldest first: [(K-1), C].
    pub conv: Vec<f32>,
    /// S per value head: [Hv, dk, dv].
    pub recurrent: Vec<f32>,
}

#[derive(Clone)]
pub struct SeqState {
    pub kv: Vec<KvCache>,
    pub gdn: Vec<GdnState>,
}

/// A snapshot asked for inside the span of the next forward pass (`StatePool::capture_at`): the
/// GDN states at `at`, one per GDN layer, as the pass's layers fill them.
struct CpuCapture {
    at: usize,
    gdn: Vec<Option<GdnState>>,
}

pub struct CpuState {
    slots: Vec<Option<SeqState>>,
    /// Per slot: the captures asked for, ascending by position.
    captures: Vec<Vec<CpuCapture>>,
    /// Positions promised to each slot (`StatePool::promise`).
    promised: Vec<usize>,
    /// KV positions the live sequences may be promised together (`StateOptions::kv_tokens`).
    kv_limit: Option<usize>,
    pub max_context: usize,
    n_attn: usize,
    n_gdn: usize,
    conv_len: usize,
    rec_len: usize,
    kv_width: usize,
}

impl CpuState {
    pub fn new(cfg: &ModelConfig, opts: StateOptions) -> CpuState {
        let d = &cfg.deltanet;
        CpuState {
            slots: (0..opts.max_seqs).map(|_| None).collect(),
            captures: (0..opts.max_seqs).map(|_| Vec::new()).collect(),
            promised: vec![0; opts.max_seqs],
            kv_limit: opts.kv_tokens,
            max_context: opts.max_context,
            n_attn: cfg.num_attention_layers(),
            n_gdn: cfg.num_deltanet_layers(),
            conv_len: (d.conv_kernel - 1) * d.conv_dim(),
            rec_len: d.num_v_heads * d.k_head_dim * d.v_head_dim,
            kv_width: cfg.attention.kv_rows(),
        }
    }

    /// The live state in `slot` (panics on a slot the engine did not allocate: an internal bug).
    pub fn slot(&mut self, slot: usize) -> &mut SeqState {
        self.slots[slot].as_mut().expect("state slot is not allocated")
    }

    /// The live state in `slot`, or an error naming a slot the engine did not allocate.
    fn live(&self, slot: usize) -> Result<&SeqState> {
        self.slots.get(slot).and_then(Option::as_ref).ok_or_else(|| Error::Backend(format!("state slot {slot} is not allocated")))
    }

    /// The positions strictly inside the span [start, start + len) of `slot` where a capture was
    /// asked for, ascending.
    pub fn capture_points(&self, slot: usize, start: usize, len: usize) -> Vec<usize> {
        self.captures[slot].iter().map(|c| c.at).filter(|&at| at > start && at < start + len).collect()
    }

    /// Stores GDN layer `layer`'s state at `at` in the capture of `slot` at `at`.
    pub fn fill_capture(&mut self, slot: usize, at: usize, layer: usize, st: GdnState) {
        if let Some(c) = self.captures[slot].iter_mut().find(|c| c.at == at) {
            c.gdn[layer] = Some(st);
        }
    }
}

/// A copy of a sequence's state after its first `len` tokens.
pub struct CpuSnapshot {
    state: SeqState,
    len: usize,
}

impl StatePool for CpuState {
    type Snapshot = CpuSnapshot;

    fn reserve_prefix_cache(&mut self, budget: Option<usize>) -> Result<usize> {
        Ok(budget.unwrap_or(DEFAULT_CACHE_BYTES))
    }

    fn save(&mut self, slot: usize, len: usize) -> Result<CpuSnapshot> {
        let s = self.live(slot)?;
        if let Some(c) = s.kv.iter().find(|c| c.len != len) {
            return Err(Error::Backend(format!("snapshot of {len} tokens asked for, the cache holds {}", c.len)));
        }
        Ok(CpuSnapshot { state: s.clone(), len })
    }

    fn capture_at(&mut self, slot: usize, at: usize) -> Result<()> {
        let s = self.live(slot)?;
        if let Some(c) = s.kv.iter().find(|c| c.len >= at) {
            return Err(Error::Backend(format!("snapshot at {at} tokens asked for, the cache holds {} already", c.len)));
        }
        let caps = &mut self.captures[slot];
        if let Err(i) = caps.binary_search_by_key(&at, |c| c.at) {
            caps.insert(i, CpuCapture { at, gdn: vec![None; self.n_gdn] });
        }
        Ok(())
    }

    fn take_captures(&mut self, slot: usize) -> Result<Vec<(usize, CpuSnapshot)>> {
        let caps = self.captures.get_mut(slot).map(std::mem::take).unwrap_or_default();
        let s = self.live(slot)?;
        let w = self.kv_width;
        caps.into_iter()
            .map(|c| {
                let at = c.at;
                let gdn: Option<Vec<GdnState>> = c.gdn.into_iter().collect();
                let gdn =
                    gdn.ok_or_else(|| Error::Backend(format!("the snapshot at {at} tokens was not taken (no span had it inside)")))?;
                if let Some(kv) = s.kv.iter().find(|kv| kv.len < at) {
                    return Err(Error::Backend(format!("snapshot at {at} tokens asked for, the cache holds {}", kv.len)));
                }
                let kv = s.kv.iter().map(|kv| KvCache { k: kv.k[..at * w].to_vec(), v: kv.v[..at * w].to_vec(), len: at }).collect();
                Ok((at, CpuSnapshot { state: SeqState { kv, gdn }, len: at }))
            })
            .collect()
    }

    fn restore(&mut self, slot: usize, snap: &CpuSnapshot) -> Result<()> {
        let s = self
            .slots
            .get_mut(slot)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::Backend(format!("state slot {slot} is not allocated")))?;
        s.clone_from(&snap.state);
        debug_assert!(s.kv.iter().all(|c| c.len == snap.len));
        Ok(())
    }

    fn release(&mut self, snap: CpuSnapshot) {
        drop(snap);
    }

    fn snapshot_bytes(&self, snap: &CpuSnapshot) -> usize {
        self.n_gdn * (self.conv_len + self.rec_len) * 4 + snap.len * self.kv_width * 2 * 4 * self.n_attn
    }

    fn alloc(&mut self) -> Option<usize> {
        let i = self.slots.iter().position(Option::is_none)?;
        self.promised[i] = 0;
        self.captures[i].clear();
        self.slots[i] = Some(SeqState {
            kv: (0..self.n_attn).map(|_| KvCache::default()).collect(),
            gdn: (0..self.n_gdn).map(|_| GdnState { conv: vec![0.0; self.conv_len], recurrent: vec![0.0; self.rec_len] }).collect(),
        });
        Some(i)
    }

    fn free(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
            self.promised[slot] = 0;
            self.captures[slot].clear();
        }
    }

    /// The host has no block pool: only a `kv_tokens` limit bounds what is promised (positions
    /// held or promised per live slot, whichever is more). It bounds admission only; the caches
    /// grow as they need.
    fn free_tokens(&self) -> usize {
        let Some(limit) = self.kv_limit else { return usize::MAX };
        let held: usize =
            self.slots.iter().zip(&self.promised).filter_map(|(s, &p)| s.as_ref().map(|s| p.max(s.kv.first().map_or(0, |c| c.len)))).sum();
        limit.saturating_sub(held)
    }

    fn promise(&mut self, slot: usize, tokens: usize) {
        if let Some(p) = self.promised.get_mut(slot) {
            *p = tokens;
        }
    }

    fn memory_plan(&self) -> Option<String> {
        self.kv_limit.map(|t| format!("KV cache limited to {t} positions over all sequences"))
    }

    fn in_use(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn bytes_in_use(&self) -> usize {
        let fixed = self.n_gdn * (self.conv_len + self.rec_len) * 4;
        self.slots.iter().flatten().map(|s| fixed + s.kv.iter().map(|c| c.len * self.kv_width * 2 * 4).sum::<usize>()).sum()
    }
}
