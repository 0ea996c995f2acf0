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
    seen: HashMap<u64, ()>,
    bytes: usize,
    tick: u64,
    evictions: usize,
}

impl<P: StatePool> PrefixCache<P> {
    pub fn new(budget: usize) -> Self {
        PrefixCache { budget, entries: HashMap::new(), seen: HashMap::new(), bytes: 0, tick: 0, evictions: 0 }
    }

    pub fn counts(&self) -> CacheCounts {
        CacheCounts { entries: self.entries.len(), bytes: self.bytes, evictions: self.evictions }
    }

    /// The longest cached prefix of `tokens` of at most `max_len` tokens: its length and snapshot.
    pub fn lookup(&mut self, tokens: &[u32], keys: &[u64], max_len: usize) -> Option<(usize, &P::Snapshot)> {
        let blocks = (max_len / BLOCK).min(keys.len());
        let k = (1..=blocks).rev().find(|&k| self.entries.get(&keys[k - 1]).is_some_and(|e| e.tokens[..] == tokens[..k * BLOCK]))?;
        self.tick += 1;
        let e = self.entries.get_mut(&keys[k - 1]).expect("found above");
        e.last_used = self.tick;
        Some((k * BLOCK, &e.snap))
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

    /// Adds the snapshot of `tokens` (a whole number of blocks), then evicts down to the budget.
    /// A prefix already cached keeps its entry (refreshed); the new snapshot is released.
    pub fn insert(&mut self, pool: &mut P, tokens: &[u32], snap: P::Snapshot) {
        debug_assert!(!tokens.is_empty() && tokens.len().is_multiple_of(BLOCK));
        let key = *block_keys(tokens).last().expect("at least one block");
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
        if let Some(old) = self.entries.insert(key, Entry { tokens: tokens.to_vec(), snap, bytes, last_used: self.tick }) {
            // A hash collision with a different prefix: the newer one wins.
            self.bytes -= old.bytes;
            pool.release(old.snap);
        }
        self.bytes += bytes;
        self.evict_to(pool, self.budget);
    }

    /// Evicts least recently used entries until at most `budget` bytes remain.
    pub fn evict_to(&mut self, pool: &mut P, budget: usize) {
        while self.bytes > budget {
            let Some((&key, _)) = self.entries.iter().min_by_key(|(_, e)| e.last_used) else { break };
            let e = self.entries.remove(&key).expect("present");
            self.bytes -= e.bytes;
            self.evictions += 1;
            pool.release(e.snap);
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
pub fn save_points(len: usize, restored: usize, seen: usize) -> Vec<usize> {
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

/// The longest prefix a prompt of `len` tokens may restore: a block boundary that leaves at
/// least two prompt tokens to run (the last one gives the first token's logits).
pub fn max_restore(len: usize) -> usize {
    len.saturating_sub(2) / BLOCK * BLOCK
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
        assert_eq!(max_restore(130), 128);
        assert_eq!(max_restore(129), 64);
        assert_eq!(max_restore(65), 0);
    }
}
