//! The segment cache: token ids of the message segments of long prompts, so that encoding a
//! conversation again (every chat turn renders and encodes the whole conversation) costs about
//! only the text that is new since the previous turn.
//!
//! A text is cut right before every occurrence of the chat template's message opener
//! (`<|im_start|>`); each piece (a *segment*: one message with its framing, or the generation
//! prompt) is looked up by its exact text, and only the segments not found are encoded.
//!
//! Why the ids are exactly those of encoding the whole text: the `tokenizers` library first
//! splits its input at the added tokens it matches (one leftmost-longest pass over the raw
//! text for the non-normalized ones), then normalizes each piece between them on its own,
//! matches the normalized added tokens inside each piece, runs the pre-tokenizer on each
//! remaining piece, the model on each pre-token, and concatenates the ids. A piece never
//! reaches across a matched added token. So if every occurrence of the opener in the text is
//! matched as the opener token, cutting before each one changes no piece, and the
//! concatenation of the segments' ids is the whole text's ids. [`SegmentCache::for_tokenizer`]
//! enables the cache only where that holds for every text:
//! - the opener is an added token that is matched on the raw text (`normalized: false`), is
//!   never skipped (not `single_word`; not a special token while special tokens are encoded
//!   as text) and takes nothing before it (`lstrip: false`);
//! - no added token can win a match over an occurrence of the opener: none contains it, none
//!   overlaps its start (a proper suffix equal to a proper prefix of the opener, the opener
//!   with itself included), a `single_word` token ending right before the opener sees a word
//!   boundary either way (the opener does not start with a word character), and an `rstrip`
//!   token right before it takes only whitespace that ends where the opener begins (the
//!   opener does not start with whitespace);
//! - the pre-tokenizer only looks inside each piece (no Metaspace, whose prefix goes to the
//!   piece at offset 0 of the text only) and the post-processor adds no ids;
//! - a probe of texts around the opener encodes the same both ways.
//!
//! The cache holds at most [`SEGMENT_CACHE_BYTES`] (segment text plus ids plus a fixed
//! per-entry overhead) and drops the least recently used segments first. Keys are the full
//! segment texts (never hashes), so a hit can only return the ids of that very text.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{Result, anyhow};
use serde_json::Value;

/// The ChatML message opener that the Qwen chat templates write before every message.
pub(super) const MESSAGE_OPENER: &str = "<|im_start|>";

/// The bound of the cache: segment texts, their ids and per-entry bookkeeping.
pub const SEGMENT_CACHE_BYTES: usize = 4 << 20;

/// Texts shorter than this are encoded directly: the lookup would save nothing.
pub const SEGMENT_CACHE_MIN_TEXT: usize = 1024;

/// Bookkeeping bytes charged per entry (map slot, order slot, allocation headers).
const ENTRY_OVERHEAD: usize = 96;

/// Pre-tokenizers that look only inside the piece they are given.
const PIECEWISE_PRE_TOKENIZERS: [&str; 10] = [
    "Sequence",
    "Split",
    "ByteLevel",
    "Digits",
    "Punctuation",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
    "CharDelimiterSplit",
    "UnicodeScripts",
];

/// Texts around the opener checked at load (cut-and-concatenate against the whole text).
const PROBE_PARTS: [&str; 8] = ["", "a", " ", "\n\n", "  \n ", "e\u{301}", "'s", "\u{301}x"];

/// Entries, bytes and the bound of a [`SegmentCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentCacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub budget: usize,
    pub hits: u64,
    pub misses: u64,
}

/// Segment text -> ids, least recently used out first (see the module docs).
pub(super) struct SegmentCache {
    opener: String,
    budget: usize,
    lru: Mutex<Lru>,
}

#[derive(Default)]
struct Lru {
    map: HashMap<Arc<str>, Entry>,
    /// Last use -> key; the first entry is the least recently used.
    order: BTreeMap<u64, Arc<str>>,
    bytes: usize,
    clock: u64,
    hits: u64,
    misses: u64,
}

struct Entry {
    ids: Vec<u32>,
    used: u64,
}

fn entry_bytes(text: &str, ids: &[u32]) -> usize {
    text.len() + 4 * ids.len() + ENTRY_OVERHEAD
}

impl SegmentCache {
    /// The cache for `inner`, or `None` where cutting before the opener could change the ids
    /// (see the module docs for the conditions).
    pub(super) fn for_tokenizer(inner: &tokenizers::Tokenizer, budget: usize) -> Option<Self> {
        let added = inner.get_added_tokens_decoder();
        let opener = added.values().find(|t| t.content == MESSAGE_OPENER)?;
        if opener.normalized || opener.lstrip || opener.single_word || (opener.special && inner.get_encode_special_tokens()) {
            return None;
        }
        let text = opener.content.as_str();
        for t in added.values() {
            let other = t.content.as_str();
            let contains = other != text && other.contains(text);
            if contains || overlaps_start(other, text) {
                return None;
            }
        }
        let word_start = text.chars().next().is_none_or(|c| c.is_alphanumeric() || c == '_');
        if word_start && added.values().any(|t| t.single_word) {
            return None;
        }
        if text.starts_with(char::is_whitespace) && added.values().any(|t| t.rstrip) {
            return None;
        }
        if !pre_tokenizer_is_piecewise(inner) || !post_processor_adds_nothing(inner) {
            return None;
        }
        let cache = SegmentCache { opener: text.to_string(), budget, lru: Mutex::new(Lru::default()) };
        cache.probe(inner).then_some(cache)
    }

    /// Whether the probe texts encode the same cut at the opener and whole.
    fn probe(&self, inner: &tokenizers::Tokenizer) -> bool {
        let o = self.opener.as_str();
        let mut texts = Vec::new();
        for a in PROBE_PARTS {
            for b in PROBE_PARTS {
                texts.push(format!("{a}{o}{b}{o}{a}"));
                texts.push(format!("{b}<|im_end|>{a}{o}user\n{b}"));
            }
        }
        texts.iter().all(|t| {
            let whole = encode_raw(inner, t);
            let cut: Result<Vec<Vec<u32>>> = self.segments(t).map(|s| encode_raw(inner, s)).collect();
            let cut = cut.map(|parts| parts.concat());
            matches!((whole, cut), (Ok(w), Ok(c)) if w == c)
        })
    }

    /// The segments of `text`: cut right before every occurrence of the opener (empty pieces
    /// left out); their concatenation is `text`.
    pub(super) fn segments<'t>(&self, text: &'t str) -> impl Iterator<Item = &'t str> {
        let mut starts: Vec<usize> = text.match_indices(self.opener.as_str()).map(|(i, _)| i).filter(|&i| i > 0).collect();
        starts.push(text.len());
        let mut at = 0;
        starts.into_iter().filter_map(move |end| {
            let s = &text[at..end];
            at = end;
            (!s.is_empty()).then_some(s)
        })
    }

    /// The ids of `text` (no post-processor ids: the cache exists only where there are none),
    /// identical to encoding it whole.
    pub(super) fn encode(&self, inner: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
        let segments: Vec<&str> = self.segments(text).collect();
        let mut found: Vec<Option<Vec<u32>>> = {
            let mut lru = self.lock();
            segments.iter().map(|s| lru.get(s)).collect()
        };
        // Encode the missing segments outside the lock: other requests keep using the cache.
        let mut fresh: Vec<(&str, Vec<u32>)> = Vec::new();
        for (s, slot) in segments.iter().zip(found.iter_mut()) {
            if slot.is_none() {
                let ids = encode_raw(inner, s)?;
                fresh.push((s, ids.clone()));
                *slot = Some(ids);
            }
        }
        if !fresh.is_empty() {
            let mut lru = self.lock();
            for (s, ids) in fresh {
                lru.insert(s, ids, self.budget);
            }
        }
        Ok(found.into_iter().flatten().flatten().collect())
    }

    /// Entries, bytes and counters of the cache.
    pub(super) fn stats(&self) -> SegmentCacheStats {
        let lru = self.lock();
        SegmentCacheStats { entries: lru.map.len(), bytes: lru.bytes, budget: self.budget, hits: lru.hits, misses: lru.misses }
    }

    fn lock(&self) -> MutexGuard<'_, Lru> {
        // The map is consistent after every statement that can panic, so a poisoned lock is
        // still usable.
        self.lru.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Lru {
    fn get(&mut self, text: &str) -> Option<Vec<u32>> {
        self.clock += 1;
        let Some(e) = self.map.get_mut(text) else {
            self.misses += 1;
            return None;
        };
        self.hits += 1;
        let key = self.order.remove(&e.used).unwrap_or_else(|| Arc::from(text));
        e.used = self.clock;
        self.order.insert(self.clock, key);
        Some(e.ids.clone())
    }

    fn insert(&mut self, text: &str, ids: Vec<u32>, budget: usize) {
        let size = entry_bytes(text, &ids);
        // A segment of more than a quarter of the bound would push out too much to be worth it.
        if size > budget / 4 || self.map.contains_key(text) {
            return;
        }
        self.clock += 1;
        let key: Arc<str> = Arc::from(text);
        self.order.insert(self.clock, key.clone());
        self.map.insert(key, Entry { ids, used: self.clock });
        self.bytes += size;
        while self.bytes > budget {
            let Some((_, old)) = self.order.pop_first() else { break };
            if let Some(e) = self.map.remove(&old) {
                self.bytes -= entry_bytes(&old, &e.ids);
            }
        }
    }
}

/// Encodes `text` whole, without the post-processor's ids.
pub(super) fn encode_raw(inner: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = inner.encode_fast(text, false).map_err(|e| anyhow!("tokenizer encode failed: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// Whether a match of `other` that starts before an occurrence of `opener` can end inside it:
/// a proper suffix of `other` (not all of it) is a proper prefix of `opener`.
fn overlaps_start(other: &str, opener: &str) -> bool {
    (1..other.len()).any(|i| other.is_char_boundary(i) && opener.len() > other.len() - i && opener.starts_with(&other[i..]))
}

fn pre_tokenizer_is_piecewise(inner: &tokenizers::Tokenizer) -> bool {
    let Some(p) = inner.get_pre_tokenizer() else { return true };
    let Ok(v) = serde_json::to_value(p) else { return false };
    fn walk(v: &Value) -> bool {
        match v {
            Value::Object(m) => {
                let known = match m.get("type") {
                    Some(Value::String(t)) => PIECEWISE_PRE_TOKENIZERS.contains(&t.as_str()),
                    Some(_) => false,
                    None => true,
                };
                known && m.values().all(walk)
            }
            Value::Array(items) => items.iter().all(walk),
            _ => true,
        }
    }
    walk(&v)
}

fn post_processor_adds_nothing(inner: &tokenizers::Tokenizer) -> bool {
    match inner.get_post_processor() {
        None => true,
        Some(p) => serde_json::to_value(p).is_ok_and(|v| v.get("type").and_then(Value::as_str) == Some("ByteLevel")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_template::ChatTemplate;
    use crate::tokenizer::Tokenizer;
    use crate::tokenizer::tests::assets;
    use serde_json::{Map, json};
    use std::ops::Range;

    /// splitmix64: a small deterministic generator for the randomized cases.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.below(items.len())]
        }
    }

    const WORDS: [&str; 48] = [
        "the", "model", "answer", "question", "because", "network", "value", "returns", "file", "error", "server", "token", "cache",
        "quickly", "under", "between", "it's", "we'll", "they're", "function", "loop", "result", "user", "memory", "context", "graph",
        "layer", "weight", "batch", "request", "stream", "window", "prefix", "reason", "simple", "exactly", "around", "second", "first",
        "table", "string", "number", "output", "input", "thread", "lock", "queue", "index",
    ];

    /// Pieces chosen to stress the cut: special-token texts (whole and broken), combining marks
    /// (also right after `<|im_end|>` and right before an opener), NFC-composing sequences,
    /// whitespace runs, contractions, digits, scripts without spaces, emoji.
    const ODD: [&str; 34] = [
        "<|im_start|>",
        "<|im_end|>",
        "<|im_start|>user\n",
        "<|im_start|>assistant\n",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<|im_start",
        "|>",
        "<",
        "\u{301}",
        "\u{308}\u{301}",
        "e\u{301}",
        "\u{1100}\u{1161}",
        "\u{212B}",
        "\u{200D}",
        " ",
        "   ",
        "\n",
        "\n\n\n",
        "\r\n",
        "\t \t",
        " \n ",
        "'s",
        "'LL",
        "12345",
        "3.14",
        "日本語のテキスト",
        "🙂👍🏽",
        "ǅ",
        "ﬁ",
        "—",
        "",
    ];

    fn sentence(rng: &mut Rng) -> String {
        let n = 4 + rng.below(14);
        let mut s = String::new();
        for i in 0..n {
            let w = rng.pick(&WORDS);
            if i == 0 {
                let mut c = w.chars();
                s.extend(c.next().map(|c| c.to_ascii_uppercase()));
                s.push_str(c.as_str());
            } else {
                s.push(' ');
                s.push_str(w);
            }
            if rng.below(12) == 0 {
                s.push_str(&format!(" {}", rng.below(10_000)));
            }
        }
        s.push_str(rng.pick(&[".", ".", ".", "?", "!", ":", ";"]));
        s
    }

    /// Deterministic English-like prose of about `bytes` bytes, in paragraphs.
    fn prose(rng: &mut Rng, bytes: usize) -> String {
        let mut s = String::new();
        while s.len() < bytes {
            s.push_str(&sentence(rng));
            s.push_str(if rng.below(6) == 0 { "\n\n" } else { " " });
        }
        s.trim_end().to_string()
    }

    /// A message text: prose, odd pieces, or both; sometimes empty.
    fn content(rng: &mut Rng) -> String {
        match rng.below(8) {
            0 => String::new(),
            1 | 2 => (0..1 + rng.below(12)).map(|_| rng.pick(&ODD)).collect(),
            3 => {
                let mut s = String::new();
                for _ in 0..1 + rng.below(6) {
                    s.push_str(rng.pick(&ODD));
                    s.push_str(&{
                        let n = rng.below(200);
                        prose(rng, n)
                    });
                }
                s
            }
            _ => {
                let n = 20 + rng.below(1500);
                prose(rng, n)
            }
        }
    }

    fn conversation(rng: &mut Rng, exchanges: usize) -> Vec<serde_json::Value> {
        let mut msgs = Vec::new();
        if rng.below(2) == 0 {
            msgs.push(json!({"role": "system", "content": content(rng)}));
        }
        for _ in 0..exchanges {
            msgs.push(json!({"role": "user", "content": content(rng)}));
            match rng.below(5) {
                0 => {
                    let call = json!({"type": "function", "function": {"name": "lookup", "arguments": {"q": content(rng)}}});
                    msgs.push(json!({"role": "assistant", "content": content(rng), "tool_calls": [call]}));
                    msgs.push(json!({"role": "tool", "content": content(rng)}));
                    msgs.push(json!({"role": "assistant", "content": content(rng)}));
                }
                1 => msgs.push(json!({"role": "assistant", "content": content(rng), "reasoning_content": content(rng)})),
                _ => msgs.push(json!({"role": "assistant", "content": content(rng)})),
            }
        }
        msgs
    }

    /// The byte ranges of the non-assistant message texts in `text`, found in order (any
    /// ranges are valid input; these are the ones a server would mark plain).
    fn plain_ranges(text: &str, msgs: &[serde_json::Value]) -> Vec<Range<usize>> {
        let mut at = 0;
        let mut out = Vec::new();
        for m in msgs {
            let c = m["content"].as_str().unwrap_or("");
            if m["role"] == "assistant" || c.is_empty() {
                continue;
            }
            if let Some(i) = text[at..].find(c) {
                out.push(at + i..at + i + c.len());
                at += i + c.len();
            }
        }
        out
    }

    fn qwen35() -> (Tokenizer, Tokenizer) {
        let tok = Tokenizer::from_dir(&assets("qwen3.5")).unwrap();
        assert!(tok.segments.is_some(), "the Qwen3.5 tokenizer must have a segment cache");
        let mut reference = Tokenizer::from_dir(&assets("qwen3.5")).unwrap();
        reference.segments = None;
        (tok, reference)
    }

    fn cold(tok: &mut Tokenizer) {
        tok.segments = SegmentCache::for_tokenizer(&tok.inner, SEGMENT_CACHE_BYTES);
    }

    /// Cached and uncached encodings of `text` (whole and with `plain` ranges) agree; the cut
    /// path is also taken directly for texts below the size at which `encode` uses it.
    fn check(tok: &Tokenizer, reference: &Tokenizer, text: &str, plain: &[Range<usize>]) {
        let want = reference.encode(text, false).unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), want, "encode differs for {text:?}");
        assert_eq!(tok.encode(text, true).unwrap(), reference.encode(text, true).unwrap(), "encode(add_special) differs for {text:?}");
        let cache = tok.segments.as_ref().unwrap();
        assert_eq!(cache.encode(&tok.inner, text).unwrap(), want, "cut encode differs for {text:?}");
        let want_plain = reference.encode_with_plain(text, plain).unwrap();
        assert_eq!(tok.encode_with_plain(text, plain).unwrap(), want_plain, "encode_with_plain differs for {text:?} {plain:?}");
    }

    #[test]
    fn rendered_conversations_encode_the_same_cold_and_warm() {
        let (mut tok, reference) = qwen35();
        let template = ChatTemplate::from_dir(&assets("qwen3.5")).unwrap();
        let mut rng = Rng(7);
        let off = json!({"enable_thinking": false}).as_object().unwrap().clone();
        for case in 0..24 {
            let msgs = {
                let n = 1 + rng.below(6);
                conversation(&mut rng, n)
            };
            let kwargs = if case % 3 == 0 { off.clone() } else { Map::new() };
            // Turn by turn, as a chat client sends them: every prefix ending with a user
            // message, with the generation prompt; the cache stays warm from the turns before.
            cold(&mut tok);
            let mut turns = 0;
            for end in 1..=msgs.len() {
                if msgs[end - 1]["role"] != "user" {
                    continue;
                }
                let Ok(text) = template.render(&msgs[..end], None, true, &kwargs) else { continue };
                let plain = plain_ranges(&text, &msgs[..end]);
                check(&tok, &reference, &text, &plain);
                turns += 1;
            }
            // The whole conversation again, then cold.
            let Ok(text) = template.render(&msgs, None, false, &kwargs) else { continue };
            let plain = plain_ranges(&text, &msgs);
            check(&tok, &reference, &text, &plain);
            let warm = tok.segment_cache_stats().unwrap();
            if turns > 1 {
                assert!(warm.hits > 0, "a later turn reuses earlier segments: {warm:?}");
            }
            cold(&mut tok);
            check(&tok, &reference, &text, &plain);
        }
    }

    #[test]
    fn adversarial_texts_encode_the_same() {
        let (mut tok, reference) = qwen35();
        let mut rng = Rng(11);
        for case in 0..400 {
            if case % 50 == 0 {
                cold(&mut tok);
            }
            let mut text = String::new();
            for _ in 0..rng.below(40) {
                match rng.below(3) {
                    0 => text.push_str(&{
                        let n = rng.below(300);
                        prose(&mut rng, n)
                    }),
                    _ => text.push_str(rng.pick(&ODD)),
                }
            }
            // Random plain ranges on char boundaries, sorted and disjoint (some cover openers).
            let bounds: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            let mut cuts: Vec<usize> = (0..rng.below(8)).map(|_| rng.pick(&bounds)).collect();
            cuts.sort();
            cuts.dedup();
            let plain: Vec<Range<usize>> = cuts.chunks_exact(2).map(|c| c[0]..c[1]).collect();
            check(&tok, &reference, &text, &plain);
            // The same text again (warm), and grown by a turn (its prefix segments warm).
            check(&tok, &reference, &text, &plain);
            let grown = format!("{text}<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", content(&mut rng));
            check(&tok, &reference, &grown, &plain);
        }
        for text in [
            "<|im_end|>\u{301}<|im_start|>\u{301}",
            "a\u{301}<|im_start|><|im_start|><|im_start|>",
            "<|im_start|>",
            "x  <|im_start|>  \n\n<|im_start|>\n",
            "<|im_start|>user\n\u{1100}<|im_start|>\u{1161}",
            "",
        ] {
            check(&tok, &reference, text, &[]);
            let all = 0..text.len();
            check(&tok, &reference, text, std::slice::from_ref(&all));
        }
    }

    #[test]
    fn segments_cut_before_each_opener() {
        let (tok, _) = qwen35();
        let cache = tok.segments.as_ref().unwrap();
        let segs: Vec<&str> = cache.segments("<|im_start|>a<|im_end|>\n<|im_start|><|im_start|>b").collect();
        assert_eq!(segs, ["<|im_start|>a<|im_end|>\n", "<|im_start|>", "<|im_start|>b"]);
        let segs: Vec<&str> = cache.segments("x<|im_start|>").collect();
        assert_eq!(segs, ["x", "<|im_start|>"]);
        assert_eq!(cache.segments("").count(), 0);
    }

    #[test]
    fn cache_stays_within_its_bound() {
        let (mut tok, reference) = qwen35();
        let budget = 16 << 10;
        tok.segments = SegmentCache::for_tokenizer(&tok.inner, budget);
        let mut rng = Rng(3);
        let mut texts = Vec::new();
        for i in 0..60 {
            let text: String = (0..4)
                .map(|j| {
                    format!("<|im_start|>user\n{i} {j} {}<|im_end|>\n", {
                        let n = 100 + rng.below(600);
                        prose(&mut rng, n)
                    })
                })
                .collect();
            check(&tok, &reference, &text, &[]);
            let s = tok.segment_cache_stats().unwrap();
            assert!(s.bytes <= budget, "{s:?}");
            assert_eq!(s.budget, budget);
            texts.push(text);
        }
        let full = tok.segment_cache_stats().unwrap();
        assert!(full.entries > 4 && full.bytes > budget / 2, "{full:?}");
        // The latest text is all hits; the first was pushed out long ago.
        tok.encode(texts.last().unwrap(), false).unwrap();
        let s = tok.segment_cache_stats().unwrap();
        assert_eq!((s.hits - full.hits, s.misses - full.misses), (4, 0));
        tok.encode(&texts[0], false).unwrap();
        let t = tok.segment_cache_stats().unwrap();
        assert_eq!(t.misses - s.misses, 4);
        assert!(t.bytes <= budget);
        // A segment over a quarter of the bound is encoded, not kept.
        let big = format!("<|im_start|>user\n{}", prose(&mut rng, budget / 3));
        check(&tok, &reference, &big, &[]);
        let before = tok.segment_cache_stats().unwrap();
        tok.encode(&big, false).unwrap();
        assert_eq!(tok.segment_cache_stats().unwrap().misses, before.misses + 1);
    }

    /// Flags that would make the cut inexact turn the cache off; the first one shows why.
    #[test]
    fn unsafe_configurations_have_no_cache() {
        let (tok, _) = qwen35();
        let base: Value = serde_json::from_str(&tok.inner.to_string(false).unwrap()).unwrap();
        let load = |v: &Value| -> tokenizers::Tokenizer { v.to_string().parse().unwrap() };

        let mut lstrip = base.clone();
        for t in lstrip["added_tokens"].as_array_mut().unwrap() {
            if t["content"] == MESSAGE_OPENER {
                t["lstrip"] = json!(true);
            }
        }
        let inner = load(&lstrip);
        assert!(SegmentCache::for_tokenizer(&inner, SEGMENT_CACHE_BYTES).is_none());
        let whole = encode_raw(&inner, "a  <|im_start|>b").unwrap();
        let cut = [encode_raw(&inner, "a  ").unwrap(), encode_raw(&inner, "<|im_start|>b").unwrap()].concat();
        assert_ne!(whole, cut, "with lstrip the opener takes the spaces before it");

        let mut meta = base.clone();
        meta["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
        assert!(SegmentCache::for_tokenizer(&load(&meta), SEGMENT_CACHE_BYTES).is_none());

        let mut overlap = tok.inner.clone();
        overlap.add_special_tokens([tokenizers::AddedToken::from("x<|im", true)]).unwrap();
        assert!(SegmentCache::for_tokenizer(&overlap, SEGMENT_CACHE_BYTES).is_none());

        let mut encode_special = tok.inner.clone();
        encode_special.set_encode_special_tokens(true);
        assert!(SegmentCache::for_tokenizer(&encode_special, SEGMENT_CACHE_BYTES).is_none());

        assert!(
            overlaps_start("x<|im", MESSAGE_OPENER) && overlaps_start("|>a|>", "|>a|>") && !overlaps_start("<|im_end|>", MESSAGE_OPENER)
        );
        // The Qwen3 tokenizer qualifies too.
        assert!(Tokenizer::from_dir(&assets("qwen3")).unwrap().segments.is_some());
    }

    /// Not a test: the time to encode a long conversation cold and with the previous turn
    /// cached. `cargo test --release -p orchid-engine measure_conversation_encoding -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn measure_conversation_encoding() {
        use std::time::Instant;
        let template = ChatTemplate::from_dir(&assets("qwen3.5")).unwrap();
        let mut rng = Rng(42);
        let mut msgs =
            vec![json!({"role": "system", "content": prose(&mut rng, 600)}), json!({"role": "user", "content": prose(&mut rng, 800)})];
        // Grow the conversation until it is about 30K tokens.
        let probe = Tokenizer::from_dir(&assets("qwen3.5")).unwrap();
        let (prev, text) = loop {
            let prev = template.render(&msgs, None, true, &Map::new()).unwrap();
            let n = rng.below(1500);
            msgs.push(json!({"role": "assistant", "content": prose(&mut rng, 2000 + 3 * n)}));
            msgs.push(json!({"role": "user", "content": prose(&mut rng, 300 + n)}));
            let text = template.render(&msgs, None, true, &Map::new()).unwrap();
            if probe.inner.encode_fast(text.as_str(), false).unwrap().len() >= 30_000 {
                break (prev, text);
            }
        };
        let n_tokens = probe.encode(&text, false).unwrap().len();
        let n_prev = probe.encode(&prev, false).unwrap().len();
        println!("conversation: {} messages, {} bytes, {n_tokens} tokens (previous turn {n_prev} tokens)", msgs.len(), text.len());
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        for round in 0..5 {
            // Cold: a fresh tokenizer (its BPE word cache empty too), no segment cache.
            let mut fresh = Tokenizer::from_dir(&assets("qwen3.5")).unwrap();
            fresh.segments = None;
            let t = Instant::now();
            let want = fresh.encode(&text, false).unwrap();
            let cold_ms = ms(t);
            // Whole text again on that tokenizer (BPE word cache warm), no segment cache.
            fresh.encode(&prev, false).unwrap();
            let t = Instant::now();
            fresh.encode(&text, false).unwrap();
            let whole_warm_ms = ms(t);
            // Segment cache, cold then with the previous turn cached.
            let tok = Tokenizer::from_dir(&assets("qwen3.5")).unwrap();
            let t = Instant::now();
            assert_eq!(tok.encode(&text, false).unwrap(), want);
            let seg_cold_ms = ms(t);
            let tok = Tokenizer::from_dir(&assets("qwen3.5")).unwrap();
            tok.encode(&prev, false).unwrap();
            let t = Instant::now();
            let got = tok.encode(&text, false).unwrap();
            let seg_warm_ms = ms(t);
            assert_eq!(got, want);
            let t = Instant::now();
            tok.encode(&text, false).unwrap();
            let seg_same_ms = ms(t);
            if round == 0 {
                println!("segment cache after two turns: {:?}", tok.segment_cache_stats());
            }
            println!(
                "round {round}: whole cold {cold_ms:.1} ms | whole, BPE word cache warm {whole_warm_ms:.1} ms | \
                 segment cache cold {seg_cold_ms:.1} ms | previous turn cached {seg_warm_ms:.2} ms | same text again {seg_same_ms:.2} ms"
            );
        }
    }
}
