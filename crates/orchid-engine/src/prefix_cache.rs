//! The prefix cache: saved sequence states (`StatePool::Snapshot`) keyed by the token prefix
//! they cover, so that a request whose prompt starts with a cached prefix restores that state
//! and prefills only the rest.
//!
//! A GDN layer's state is a running summary, so a prefix can only be reused where a snapshot
//! was taken. Snapshots are taken at block boundaries (multiples of [`BLOCK`] tokens) and keyed
//! by a hash chain over the blocks: the key of the first k blocks is hash(key of k−1 blocks,
//! tokens of block k). An entry also keeps its tokens, so a hash collision is never a hit.
//! Entries are evicted least recently used first when their bytes pass the budget; a restore
//! copies (CPU) or references (CUDA KV blocks) what it needs, so evicting an entry never takes
//! anything from a running sequence.
//!
//! A finished generation is also saved where it ended, mid-block (a *partial* entry, keyed by
//! hash(key of its full blocks, the rest of its tokens)), so that the next turn of a
//! conversation prefills only its new message. Such an entry is found through the key of its
//! full blocks ([`PrefixCache::lookup`]).
//!
//! The cache also remembers which block keys it has seen in earlier prompts (without their
//! states): a new prompt that shares a prefix with an earlier one saves a snapshot where the
//! shared part ends, so the next request with that prefix (a shared system prompt) hits it.
//!
//! Taking a snapshot costs no extra forward pass: one inside a prefill span is captured by the
//! pass, one at its end saved after it (the engine's `save_prefixes`). See docs/prefix-cache.md.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use orchid_model::StatePool;

/// Tokens per block: snapshots are taken at multiples of it. 64 is the CUDA KV block and the
/// chunk of the GDN prefill on both backends (`orchid_model::backend::GDN_CHUNK`), so a span
/// that starts at a block boundary has a GDN state at each block boundary inside it, which the
/// forward pass can capture.
pub const BLOCK: usize = 64;

/// Besides prompt ends and shared-prefix ends, a long prompt is snapshotted every this many tokens.
pub const INTERVAL: usize = 4096;

/// At most this many remembered block keys (the set is cleared when it grows past it).
const MAX_SEEN: usize = 1 << 20;

/// Key of each full block prefix of `tokens`: element k-1 covers tokens[..k·BLOCK].
pub fn block_keys(tokens: &[u32]) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(BLOCK)
        .map(|b| {
            let mut h = DefaultHasher::new();
            prev.hash(&mut h);
            b.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

struct Entry<S> {
    tokens: Vec<u32>,
    /// For a partial entry: the key of its full blocks (0: none).
    parent: Option<u64>,
    snap: S,
    bytes: usize,
    last_used: u64,
}

/// Counters the engine publishes.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheCounts {
    pub entries: usize,
    pub bytes: usize,
    pub evictions: usize,
}

pub struct PrefixCache<P: StatePool> {
    budget: usize,
    entries: HashMap<u64, Entry<P::Snapshot>>,
    /// The partial entries' keys, by the key of their full blocks.
    partials: HashMap<u64, Vec<u64>>,
    seen: HashMap<u64, ()>,
    bytes: usize,
    tick: u64,
    evictions: usize,
}

impl<P: StatePool> PrefixCache<P> {
    pub fn new(budget: usize) -> Self {
        PrefixCache { budget, entries: HashMap::new(), partials: HashMap::new(), seen: HashMap::new(), bytes: 0, tick: 0, evictions: 0 }
    }

    pub fn counts(&self) -> CacheCounts {
        CacheCounts { entries: self.entries.len(), bytes: self.bytes, evictions: self.evictions }
    }

    /// The longest cached prefix of `tokens` of at most `max_len` tokens (`keys`: its block
    /// keys): its length and snapshot. A partial entry extending the first k blocks is longer
    /// than the full entry of those k blocks, so the partial entries of the longest matching
    /// full prefix and of every longer block prefix are looked at too.
    pub fn lookup(&mut self, tokens: &[u32], keys: &[u64], max_len: usize) -> Option<(usize, &P::Snapshot)> {
        let max_len = max_len.min(tokens.len());
        let blocks = (max_len / BLOCK).min(keys.len());
        let full = (1..=blocks).rev().find(|&k| self.entries.get(&keys[k - 1]).is_some_and(|e| e.tokens[..] == tokens[..k * BLOCK]));
        let partial = (full.unwrap_or(0)..=blocks).rev().find_map(|k| {
            let parent = if k == 0 { 0 } else { keys[k - 1] };
            let fits = |key: &u64| self.entries[key].tokens.len() <= max_len && tokens.starts_with(&self.entries[key].tokens);
            self.partials.get(&parent)?.iter().copied().filter(fits).max_by_key(|key| self.entries[key].tokens.len())
        });
        let key = partial.or(full.map(|k| keys[k - 1]))?;
        self.tick += 1;
        let e = self.entries.get_mut(&key).expect("found above");
        e.last_used = self.tick;
        Some((e.tokens.len(), &e.snap))
    }

    /// Whether the prefix of `k` blocks with key `key` is cached.
    pub fn contains(&self, key: u64) -> bool {
        self.entries.contains_key(&key)
    }

    /// Blocks at the start of a prompt (given its keys) that some earlier prompt had too.
    pub fn seen_blocks(&self, keys: &[u64]) -> usize {
        keys.iter().take_while(|k| self.seen.contains_key(k)).count()
    }

    /// Remembers a prompt's block keys.
    pub fn note_seen(&mut self, keys: &[u64]) {
        if self.seen.len() + keys.len() > MAX_SEEN {
            self.seen.clear();
        }
        self.seen.extend(keys.iter().map(|&k| (k, ())));
    }

    /// Adds the snapshot of `tokens` (a whole number of blocks, or a partial entry), then
    /// evicts down to the budget. A prefix already cached keeps its entry (refreshed); the new
    /// snapshot is released.
    pub fn insert(&mut self, pool: &mut P, tokens: &[u32], snap: P::Snapshot) {
        debug_assert!(!tokens.is_empty());
        let full = tokens.len() / BLOCK * BLOCK;
        let block_key = block_keys(&tokens[..full]).last().copied();
        let (key, parent) = if full == tokens.len() {
            (block_key.expect("at least one block"), None)
        } else {
            let parent = block_key.unwrap_or(0);
            let mut h = DefaultHasher::new();
            (parent, &tokens[full..]).hash(&mut h);
            (h.finish(), Some(parent))
        };
        self.tick += 1;
        if let Some(e) = self.entries.get_mut(&key).filter(|e| e.tokens[..] == *tokens) {
            e.last_used = self.tick;
            pool.release(snap);
            return;
        }
        let bytes = pool.snapshot_bytes(&snap);
        if bytes > self.budget {
            pool.release(snap);
            return;
        }
        // A hash collision with a different prefix: the newer one wins.
        self.remove(pool, key);
        self.entries.insert(key, Entry { tokens: tokens.to_vec(), parent, snap, bytes, last_used: self.tick });
        if let Some(p) = parent {
            self.partials.entry(p).or_default().push(key);
        }
        self.bytes += bytes;
        self.evict_to(pool, self.budget);
    }

    /// Drops the entry of `key`, if any, and releases its snapshot.
    fn remove(&mut self, pool: &mut P, key: u64) {
        let Some(e) = self.entries.remove(&key) else { return };
        if let Some(p) = e.parent
            && let Some(list) = self.partials.get_mut(&p)
        {
            list.retain(|&k| k != key);
            if list.is_empty() {
                self.partials.remove(&p);
            }
        }
        self.bytes -= e.bytes;
        pool.release(e.snap);
    }

    /// Evicts least recently used entries until at most `budget` bytes remain.
    pub fn evict_to(&mut self, pool: &mut P, budget: usize) {
        while self.bytes > budget {
            let Some((&key, _)) = self.entries.iter().min_by_key(|(_, e)| e.last_used) else { break };
            self.remove(pool, key);
            self.evictions += 1;
        }
    }

    /// Releases everything.
    pub fn clear(&mut self, pool: &mut P) {
        self.evict_to(pool, 0);
        self.seen.clear();
    }
}

/// The snapshot points of a prompt of `len` tokens whose first `restored` tokens came from the
/// cache, given how many of its leading blocks earlier prompts shared (`seen`): the end of the
/// shared part, every [`INTERVAL`] tokens, and the last block boundary of the prompt. A point
/// never leaves exactly one prompt token after it: where a prefill has to stop at a point (a
/// prefill chunk that is not a multiple of 64, see the engine's `next_span`), that token would run
/// through the one-token path, which rounds differently from a longer span.
///
/// A prompt restored from a partial entry (the next turn of a conversation, restored where the
/// last generation ended) takes none: its spans start inside a block, so a block boundary is
/// never a chunk boundary of its prefill and would cost a second forward pass. The snapshot its
/// own generation leaves where it ends serves the turn after it.
///
/// Every other prompt saves its last block boundary, however short the part it prefills: a
/// thinking model's next turn drops the reasoning, so it continues from there, not from where
/// the generation ended (on the bundled model's chat test, 75 % of the later turns' prompt
/// tokens come from the cache this way, 59 % without). The snapshot costs that request's first
/// token a few milliseconds on the GPU (the next turn of a 32K conversation on an H200: 46 ms,
/// 39 ms without).
pub fn save_points(len: usize, restored: usize, seen: usize) -> Vec<usize> {
    if !restored.is_multiple_of(BLOCK) {
        return Vec::new();
    }
    let ok = |p: usize| p > restored && p.is_multiple_of(BLOCK) && (p == len || p + 2 <= len);
    let last = |p: usize| if p + 1 == len { p.saturating_sub(BLOCK) } else { p };
    let mut pts: Vec<usize> = (1..).map(|k| k * INTERVAL).take_while(|&p| p <= len).collect();
    pts.push(last((seen * BLOCK).min(len / BLOCK * BLOCK)));
    pts.push(last(len / BLOCK * BLOCK));
    pts.retain(|&p| ok(p));
    pts.sort_unstable();
    pts.dedup();
    pts
}

/// The longest prefix a prompt of `len` tokens may restore: one that leaves at least two
/// prompt tokens to run (the last one gives the first token's logits; a single one would run
/// through the one-token path, which rounds differently). Full entries end at block boundaries,
/// so for them this rounds down to one.
pub fn max_restore(len: usize) -> usize {
    len.saturating_sub(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_points() {
        let a: Vec<u32> = (0..200).collect();
        let mut b = a.clone();
        b[100] = 7;
        let (ka, kb) = (block_keys(&a), block_keys(&b));
        assert_eq!(ka.len(), 3);
        assert_eq!(ka[0], kb[0]);
        assert_ne!(ka[1], kb[1]);
        assert_ne!(ka[2], kb[2]);
        assert_eq!(save_points(200, 0, 0), vec![192]);
        assert_eq!(save_points(193, 0, 0), vec![128]);
        assert_eq!(save_points(192, 0, 1), vec![64, 192]);
        assert_eq!(save_points(192, 128, 1), vec![192]);
        assert_eq!(save_points(2000, 128, 1), vec![1984]);
        // A restored prompt with a short rest saves its last block boundary too.
        assert_eq!(save_points(300, 192, 3), vec![256]);
        assert_eq!(save_points(260, 192, 0), vec![256]);
        assert_eq!(save_points(258, 256, 4), Vec::<usize>::new());
        // Every INTERVAL tokens, the shared part's end and the last block boundary.
        assert_eq!(save_points(9000, 0, 10), vec![640, 4096, 8192, 8960]);
        // A point one token before the end moves back a block.
        assert_eq!(save_points(8193, 0, 0), vec![4096, 8128]);
        assert_eq!(save_points(10, 0, 0), Vec::<usize>::new());
        assert_eq!(save_points(6000, 4090, 0), Vec::<usize>::new());
        assert_eq!(save_points(6000, 4032, 0), vec![4096, 5952]);
        assert_eq!(max_restore(130), 128);
        assert_eq!(max_restore(65), 63);
    }

    /// A pool whose snapshots are their byte counts.
    struct Pool;

    impl StatePool for Pool {
        type Snapshot = usize;
        fn alloc(&mut self) -> Option<usize> {
            None
        }
        fn free(&mut self, _: usize) {}
        fn in_use(&self) -> usize {
            0
        }
        fn capacity(&self) -> usize {
            0
        }
        fn bytes_in_use(&self) -> usize {
            0
        }
        fn reserve_prefix_cache(&mut self, budget: Option<usize>) -> orchid_model::error::Result<usize> {
            Ok(budget.unwrap_or(0))
        }
        fn save(&mut self, _: usize, len: usize) -> orchid_model::error::Result<usize> {
            Ok(len)
        }
        fn restore(&mut self, _: usize, _: &usize) -> orchid_model::error::Result<()> {
            Ok(())
        }
        fn capture_at(&mut self, _: usize, _: usize) -> orchid_model::error::Result<()> {
            Ok(())
        }
        fn take_captures(&mut self, _: usize) -> orchid_model::error::Result<Vec<(usize, usize)>> {
            Ok(Vec::new())
        }
        fn release(&mut self, _: usize) {}
        fn snapshot_bytes(&self, snap: &usize) -> usize {
            *snap
        }
    }

    #[test]
    fn partial_entries_extend_full_ones() {
        let mut c = PrefixCache::<Pool>::new(10_000);
        let t: Vec<u32> = (0..400).collect();
        let find = |c: &mut PrefixCache<Pool>, p: &[u32], max: usize| c.lookup(p, &block_keys(p), max).map(|(n, _)| n);
        c.insert(&mut Pool, &t[..128], 128);
        c.insert(&mut Pool, &t[..150], 150);
        c.insert(&mut Pool, &t[..300], 300);
        c.insert(&mut Pool, &t[..40], 40);
        assert_eq!(find(&mut c, &t, 398), Some(300));
        assert_eq!(find(&mut c, &t, 299), Some(150));
        assert_eq!(find(&mut c, &t, 149), Some(128));
        assert_eq!(find(&mut c, &t, 127), Some(40));
        assert_eq!(find(&mut c, &t[..41], 39), None);
        // A prompt that leaves the partial entry's tokens before its end gets the full one.
        let mut other = t.clone();
        other[140] = 9999;
        assert_eq!(find(&mut c, &other, 398), Some(128));
        // Eviction unlinks partial entries: least recently used first (300, then 150).
        c.evict_to(&mut Pool, 200);
        assert_eq!(c.counts().entries, 2);
        assert_eq!(find(&mut c, &t, 398), Some(128));
        assert_eq!(find(&mut c, &t, 100), Some(40));
        assert!(c.partials.values().flatten().all(|k| c.entries.contains_key(k)));
    }
}
