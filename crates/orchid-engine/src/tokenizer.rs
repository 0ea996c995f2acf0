//! The tokenizer of a checkpoint: `tokenizer.json` (Hugging Face `tokenizers` format) plus the
//! special ids that the engine needs, read from the configs next to it.
//!
//! Files read from the model directory:
//! - `tokenizer.json` (required): the BPE model, added tokens, normalizer, pre-tokenizer, decoder.
//! - `generation_config.json`, `config.json` (or its `text_config`), `tokenizer_config.json`
//!   (all optional): the end-of-sequence ids. The stop set is the union, in this order, of
//!   generation_config `eos_token_id` (int or list), config `eos_token_id` (top level, then
//!   `text_config`) and tokenizer_config `eos_token` (a string or `{"content": ..}`). When none
//!   of them names one, the ChatML defaults `<|im_end|>` and `<|endoftext|>` are used where the
//!   vocabulary has them (the Qwen3.5 assets ship only `tokenizer.json`; a real Qwen3.5
//!   checkpoint stops on 248046 and 248044, which is what the fallback gives).
//!
//! Semantics follow the HF libraries exactly: special tokens written in the text
//! (`<|im_start|>`) always encode to their ids; `add_special_tokens` only runs the
//! post-processor (Qwen adds nothing); `decode(.., skip_special)` drops only added tokens
//! flagged `special` (in the Qwen3.5 file `<think>` and `<tool_call>` are not special, so they
//! are kept, as in HF); unknown ids are dropped. Truncation and padding stored in
//! `tokenizer.json` are switched off: an inference engine must never cut a prompt silently.
//!
//! Long texts are encoded through the [segment cache](segment_cache): cut before each message
//! opener, with the ids of segments seen before (a conversation's earlier turns) reused, which
//! gives exactly the ids of encoding the text whole.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use tokenizers::DecoderWrapper;

mod segment_cache;
pub use segment_cache::{SEGMENT_CACHE_BYTES, SEGMENT_CACHE_MIN_TEXT, SegmentCacheStats};

/// Ids of the markers that the reasoning and tool-call parsers look for (`None` when the
/// vocabulary lacks the token).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MarkerIds {
    /// `<think>`
    pub think_start: Option<u32>,
    /// `</think>`
    pub think_end: Option<u32>,
    /// `<tool_call>`
    pub tool_call_start: Option<u32>,
    /// `</tool_call>`
    pub tool_call_end: Option<u32>,
}

/// A checkpoint's tokenizer: encode, decode and the ids the engine treats specially.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    eos_token_ids: Vec<u32>,
    markers: MarkerIds,
    /// Added tokens: id -> is it `special` (skipped by `decode(.., true)`).
    added: HashMap<u32, bool>,
    /// Whether the decoder is plain byte-level (GPT-2 byte <-> unicode map), so that each
    /// token maps to a fixed byte string and decoding is byte concatenation.
    byte_level: bool,
    /// The texts of the added tokens flagged `special` (`<|im_start|>` ...).
    special_texts: Vec<String>,
    /// The same tokenizer with special tokens encoded as plain text (made on first use).
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// Bytes of the longest token (computed on first use).
    longest: std::sync::OnceLock<usize>,
    /// Ids of the message segments of recent long texts (`None` where the tokenizer's
    /// configuration would make cut encoding inexact).
    segments: Option<segment_cache::SegmentCache>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_token_ids", &self.eos_token_ids)
            .field("markers", &self.markers)
            .field("byte_level", &self.byte_level)
            .field("segment_cache", &self.segments.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from `dir` and the eos ids from the optional configs there.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            bail!("{}: tokenizer file not found", path.display());
        }
        let mut inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| anyhow!("{}: cannot load tokenizer: {e}", path.display()))?;
        inner.with_truncation(None).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        inner.with_padding(None);

        let decoder = inner.get_added_tokens_decoder();
        let added = decoder.iter().map(|(&id, tok)| (id, tok.special)).collect();
        let mut special_texts: Vec<String> =
            decoder.values().filter(|t| t.special && !t.content.is_empty()).map(|t| t.content.clone()).collect();
        special_texts.sort();
        let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let markers = MarkerIds {
            think_start: inner.token_to_id("<think>"),
            think_end: inner.token_to_id("</think>"),
            tool_call_start: inner.token_to_id("<tool_call>"),
            tool_call_end: inner.token_to_id("</tool_call>"),
        };
        let segments = segment_cache::SegmentCache::for_tokenizer(&inner, SEGMENT_CACHE_BYTES);
        let mut tok = Tokenizer {
            inner,
            eos_token_ids: Vec::new(),
            markers,
            added,
            byte_level,
            special_texts,
            plain: std::sync::OnceLock::new(),
            longest: std::sync::OnceLock::new(),
            segments,
        };
        tok.eos_token_ids = tok.collect_eos_ids(dir)?;
        Ok(tok)
    }

    /// Encodes `text`. Special tokens written in the text become their ids (as HF does);
    /// `add_special_tokens` runs the post-processor (BOS/EOS templates, none for Qwen).
    /// Texts of [`SEGMENT_CACHE_MIN_TEXT`] bytes or more go through the segment cache where the
    /// tokenizer has one (same ids, see [`segment_cache`]).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        if text.len() >= SEGMENT_CACHE_MIN_TEXT
            && let Some(cache) = &self.segments
        {
            // The cache exists only where the post-processor adds no ids.
            return cache.encode(&self.inner, text);
        }
        let enc = self.inner.encode_fast(text, add_special_tokens).map_err(|e| anyhow!("tokenizer encode failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes `text` (no post-processor) with the special tokens written inside the byte
    /// ranges `plain` encoded as ordinary text, as transformers does with
    /// `split_special_tokens=True`: a user who types `<|im_start|>` gets those characters, not a
    /// role marker. Outside `plain`, and where no special token is written, it is [`encode`].
    /// The texts between the plain special tokens are encoded by [`encode`] (through the segment
    /// cache when long): a segment cut falls only on an opener that is not inside such a cut,
    /// which the whole-text encoding matches as a token too.
    ///
    /// [`encode`]: Tokenizer::encode
    pub fn encode_with_plain(&self, text: &str, plain: &[std::ops::Range<usize>]) -> Result<Vec<u32>> {
        let mut cuts: Vec<std::ops::Range<usize>> = Vec::new();
        for r in plain {
            let span = &text[r.clone()];
            for sp in &self.special_texts {
                cuts.extend(span.match_indices(sp.as_str()).map(|(i, m)| r.start + i..r.start + i + m.len()));
            }
        }
        if cuts.is_empty() {
            return self.encode(text, false);
        }
        cuts.sort_by_key(|r| (r.start, std::cmp::Reverse(r.end)));
        let plain_tok = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let mut ids = Vec::new();
        let mut at = 0;
        for c in cuts {
            if c.start < at {
                continue; // overlaps a cut already taken
            }
            ids.extend(self.encode(&text[at..c.start], false)?);
            let enc = plain_tok.encode_fast(&text[c.clone()], false).map_err(|e| anyhow!("tokenizer encode failed: {e}"))?;
            ids.extend_from_slice(enc.get_ids());
            at = c.end;
        }
        ids.extend(self.encode(&text[at..], false)?);
        Ok(ids)
    }

    /// Whether `text` contains the text of a special token.
    pub fn contains_special_text(&self, text: &str) -> bool {
        self.special_texts.iter().any(|s| text.contains(s.as_str()))
    }

    /// Bytes of the longest token in the vocabulary (added tokens included): a text of `n` bytes
    /// has at least `n / longest_token_bytes()` tokens (before normalization).
    pub fn longest_token_bytes(&self) -> usize {
        *self.longest.get_or_init(|| {
            let vocab = self.inner.get_vocab(true);
            vocab.iter().map(|(t, &id)| self.token_bytes(id, false).map_or(t.len(), |b| b.len())).max().unwrap_or(1).max(1)
        })
    }

    /// Decodes `ids` to text (invalid UTF-8 becomes U+FFFD, unknown ids are dropped, like HF).
    /// With `skip_special`, added tokens flagged `special` are left out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        if self.byte_level {
            let mut bytes = Vec::with_capacity(ids.len() * 4);
            for &id in ids {
                if let Some(b) = self.token_bytes(id, skip_special) {
                    bytes.extend_from_slice(&b);
                }
            }
            return String::from_utf8_lossy(&bytes).into_owned();
        }
        // Other decoders (not used by this model family) go through the library; it only
        // fails on a malformed decoder configuration, which `from_dir` would have rejected.
        self.inner.decode(ids, skip_special).unwrap_or_default()
    }

    /// The id of a token string (added tokens first, then the BPE vocabulary).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer knows: BPE vocabulary plus added tokens. This is not the
    /// (padded) number of embedding rows of the model.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The ids that end generation (see the module docs for where they come from).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    /// Ids of `<think>`, `</think>`, `<tool_call>`, `</tool_call>`.
    pub fn markers(&self) -> MarkerIds {
        self.markers
    }

    /// Whether `id` is an added token flagged `special`.
    pub fn is_special(&self, id: u32) -> bool {
        self.added.get(&id).copied().unwrap_or(false)
    }

    /// Whether decoding is plain byte concatenation (see [`Tokenizer::token_bytes`]).
    pub fn is_byte_level(&self) -> bool {
        self.byte_level
    }

    /// The raw bytes token `id` decodes to, for byte-level tokenizers; `None` for unknown ids,
    /// for special tokens when `skip_special`, and for tokenizers that are not byte-level.
    /// Mirrors the HF byte-level decoder: every char of the token string is mapped back
    /// through the GPT-2 byte table, and a token with a char outside that table (an added
    /// token such as `"<a b>"`) contributes its UTF-8 text unchanged.
    pub fn token_bytes(&self, id: u32, skip_special: bool) -> Option<Cow<'static, [u8]>> {
        if !self.byte_level || (skip_special && self.is_special(id)) {
            return None;
        }
        // Added vocabulary first, then the BPE model: the lookup HF's decode does.
        let token = self.inner.id_to_token(id)?;
        let mut out = Vec::with_capacity(token.len());
        for c in token.chars() {
            match unicode_to_byte(c) {
                Some(b) => out.push(b),
                None => return Some(Cow::Owned(token.into_bytes())),
            }
        }
        Some(Cow::Owned(out))
    }

    /// Entries, bytes and hit counts of the segment cache (`None` when the tokenizer has none).
    pub fn segment_cache_stats(&self) -> Option<SegmentCacheStats> {
        self.segments.as_ref().map(|c| c.stats())
    }

    /// The wrapped `tokenizers` object, for uses this API does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn collect_eos_ids(&self, dir: &Path) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = Vec::new();
        let push = |ids: &mut Vec<u32>, id: u32| {
            if !ids.contains(&id) {
                ids.push(id);
            }
        };
        let gen_path = dir.join("generation_config.json");
        if let Some(cfg) = read_json_opt(&gen_path)? {
            for id in parse_id_list(&gen_path, "eos_token_id", cfg.get("eos_token_id"))? {
                push(&mut ids, id);
            }
        }
        let cfg_path = dir.join("config.json");
        if let Some(cfg) = read_json_opt(&cfg_path)? {
            for id in parse_id_list(&cfg_path, "eos_token_id", cfg.get("eos_token_id"))? {
                push(&mut ids, id);
            }
            let text = cfg.get("text_config").and_then(|t| t.get("eos_token_id"));
            for id in parse_id_list(&cfg_path, "text_config.eos_token_id", text)? {
                push(&mut ids, id);
            }
        }
        let tc_path = dir.join("tokenizer_config.json");
        if let Some(cfg) = read_json_opt(&tc_path)?
            && let Some(token) = token_string(&tc_path, "eos_token", cfg.get("eos_token"))?
        {
            let id = self
                .token_id(&token)
                .ok_or_else(|| anyhow!("{}: eos_token {token:?} is not in the tokenizer.json vocabulary", tc_path.display()))?;
            push(&mut ids, id);
        }
        if ids.is_empty() {
            for name in ["<|im_end|>", "<|endoftext|>"] {
                if let Some(id) = self.token_id(name) {
                    push(&mut ids, id);
                }
            }
        }
        Ok(ids)
    }
}

/// Reads a JSON file if it exists; a file that exists but does not parse is an error naming it.
pub(crate) fn read_json_opt(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let v = serde_json::from_str(&text).with_context(|| format!("{}: malformed JSON", path.display()))?;
    Ok(Some(v))
}

/// A special-token entry of `tokenizer_config.json`: a string, `{"content": ..}` (a
/// serialized `AddedToken`), or null/absent.
pub(crate) fn token_string(path: &Path, field: &str, v: Option<&Value>) -> Result<Option<String>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(m)) => match m.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => bail!("{}: `{field}` is an object without a string `content`", path.display()),
        },
        Some(other) => bail!("{}: `{field}` must be a string, got {other}", path.display()),
    }
}

/// An id field that may be an int, a list of ints, null or absent.
fn parse_id_list(path: &Path, field: &str, v: Option<&Value>) -> Result<Vec<u32>> {
    let one = |v: &Value| -> Result<u32> {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| anyhow!("{}: `{field}` must be a non-negative integer or a list of them, got {v}", path.display()))
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// The inverse of the GPT-2 byte -> unicode table used by byte-level BPE: printable Latin-1
/// bytes (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) stand for themselves; the other 68 bytes, in order,
/// are U+0100 onwards.
pub(crate) fn unicode_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if is_printable_byte(cp) {
        return Some(cp as u8);
    }
    // The n-th (0-based) non-printable byte: 0..=32, then 127..=160, then 173.
    match cp.checked_sub(256)? {
        n @ 0..=32 => Some(n as u8),
        n @ 33..=66 => Some((127 + n - 33) as u8),
        67 => Some(173),
        _ => None,
    }
}

fn is_printable_byte(b: u32) -> bool {
    (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::PathBuf;

    pub(crate) fn assets(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets").join(name)
    }

    #[test]
    fn byte_table_roundtrip() {
        // 'Ġ' (U+0120) is the space byte, 'Ċ' (U+010A) the newline byte.
        assert_eq!(unicode_to_byte('Ġ'), Some(b' '));
        assert_eq!(unicode_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(unicode_to_byte('a'), Some(b'a'));
        assert_eq!(unicode_to_byte(' '), None);
        assert_eq!(unicode_to_byte('\u{0144}'), None); // past the 68 remapped bytes
        let mut all: Vec<u8> = (0..=0x143u32).filter_map(char::from_u32).filter_map(unicode_to_byte).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn qwen35_special_ids_and_eos() {
        let tok = Tokenizer::from_dir(&assets("qwen3.5")).unwrap();
        assert!(tok.is_byte_level());
        assert_eq!(tok.vocab_size(), 248_077);
        assert_eq!(tok.token_id("<|endoftext|>"), Some(248_044));
        assert_eq!(tok.token_id("<|im_start|>"), Some(248_045));
        assert_eq!(tok.token_id("<|im_end|>"), Some(248_046));
        let m = tok.markers();
        assert_eq!(m.tool_call_start, Some(248_058));
        assert_eq!(m.tool_call_end, Some(248_059));
        assert_eq!(m.think_start, Some(248_068));
        assert_eq!(m.think_end, Some(248_069));
        assert_eq!(tok.eos_token_ids(), &[248_046, 248_044]);
        assert!(tok.is_eos(248_044) && !tok.is_eos(248_045));
        assert!(tok.is_special(248_046) && !tok.is_special(248_068));

        let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        assert_eq!(ids.first(), Some(&248_045));
        assert_eq!(ids.last(), Some(&248_046));
        assert_eq!(tok.decode(&ids, false), "<|im_start|>user\nhi<|im_end|>");
        assert_eq!(tok.decode(&ids, true), "user\nhi");
        // Not-special added tokens survive skip_special, as in HF.
        let ids = tok.encode("<think>x</think>", false).unwrap();
        assert_eq!(ids, vec![248_068, tok.token_id("x").unwrap(), 248_069]);
        assert_eq!(tok.decode(&ids, true), "<think>x</think>");
        // Unknown ids are dropped.
        assert_eq!(tok.decode(&[u32::MAX, tok.token_id("x").unwrap()], false), "x");
    }

    #[test]
    fn qwen3_eos_from_tokenizer_config() {
        let tok = Tokenizer::from_dir(&assets("qwen3")).unwrap();
        assert_eq!(tok.token_id("<|im_end|>"), Some(151_645));
        assert_eq!(tok.eos_token_ids(), &[151_645]);
        assert_eq!(tok.markers().think_start, Some(151_667));
    }

    fn tmp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("orchid-tok-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn eos_union_from_configs() {
        let d = tmp_dir("eos");
        std::fs::copy(assets("qwen3.5/tokenizer.json"), d.join("tokenizer.json")).unwrap();
        std::fs::write(d.join("generation_config.json"), r#"{"eos_token_id": [248046, 248044]}"#).unwrap();
        std::fs::write(d.join("config.json"), r#"{"text_config": {"eos_token_id": 248063}}"#).unwrap();
        std::fs::write(d.join("tokenizer_config.json"), r#"{"eos_token": {"content": "<|im_end|>"}}"#).unwrap();
        let tok = Tokenizer::from_dir(&d).unwrap();
        assert_eq!(tok.eos_token_ids(), &[248_046, 248_044, 248_063]);

        std::fs::write(d.join("config.json"), r#"{"eos_token_id": "x"}"#).unwrap();
        let err = format!("{:#}", Tokenizer::from_dir(&d).unwrap_err());
        assert!(err.contains("config.json") && err.contains("eos_token_id"), "{err}");
        std::fs::write(d.join("config.json"), "{not json").unwrap();
        let err = format!("{:#}", Tokenizer::from_dir(&d).unwrap_err());
        assert!(err.contains("config.json") && err.contains("malformed"), "{err}");
        std::fs::remove_file(d.join("config.json")).unwrap();
        std::fs::write(d.join("tokenizer_config.json"), r#"{"eos_token": "<nope>"}"#).unwrap();
        let err = format!("{:#}", Tokenizer::from_dir(&d).unwrap_err());
        assert!(err.contains("tokenizer_config.json") && err.contains("<nope>"), "{err}");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn missing_or_bad_tokenizer_json() {
        let d = tmp_dir("missing");
        let err = format!("{:#}", Tokenizer::from_dir(&d).unwrap_err());
        assert!(err.contains("tokenizer.json") && err.contains("not found"), "{err}");
        std::fs::write(d.join("tokenizer.json"), "{}").unwrap();
        let err = format!("{:#}", Tokenizer::from_dir(&d).unwrap_err());
        assert!(err.contains("tokenizer.json"), "{err}");
        std::fs::remove_dir_all(&d).ok();
    }
}
