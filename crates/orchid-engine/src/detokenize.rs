//! Incremental detokenizer: feed generated token ids one at a time, get back the text that
//! became final with each one. Never emits half a UTF-8 character, and the concatenation of
//! everything emitted (including [`Detokenizer::finish`]) equals
//! `Tokenizer::decode(all_ids, skip_special)`.
//!
//! Two strategies, chosen from the tokenizer:
//! - Byte-level BPE (Qwen, GPT-2 style; the only kind this model family uses): each token is a
//!   fixed byte string. Bytes are appended to a small pending buffer and the longest complete
//!   UTF-8 prefix is emitted; an incomplete character (at most 3 bytes) waits for the next
//!   token. A byte sequence that can never become valid is replaced by U+FFFD exactly as
//!   `String::from_utf8_lossy` (and therefore HF's decoder) does. O(bytes of the token).
//! - Any other decoder (SentencePiece-style byte fallback, Metaspace ...): the prefix-offset
//!   method of vLLM/TGI. Decode the window `ids[prefix..read]` and `ids[prefix..]`; when the
//!   second is longer and does not end in U+FFFD, emit the difference and slide the window.
//!   The window holds only the last few ids (those not yet final plus one step of context).

use std::sync::Arc;

use crate::tokenizer::Tokenizer;

/// Streams text out of generated token ids. See the module docs.
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    skip_special: bool,
    state: State,
}

enum State {
    /// Byte-level: bytes not yet emitted (an incomplete UTF-8 character).
    Bytes { pending: Vec<u8> },
    /// Generic: the ids of the window; `ids[..read]` has been emitted, `ids[..prefix]` is
    /// context that keeps decoders (leading-space rules) consistent.
    Window { ids: Vec<u32>, prefix: usize, read: usize },
}

/// How many context ids the generic strategy keeps from a prompt.
const CONTEXT_IDS: usize = 5;

impl Detokenizer {
    /// A detokenizer for a fresh output. With `skip_special_tokens`, added tokens flagged
    /// special (`<|im_end|>` ...) produce no text.
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> Self {
        Self::with_context(tokenizer, skip_special_tokens, &[])
    }

    /// Like [`Detokenizer::new`], continuing after `context` (usually the prompt ids): decoders
    /// that treat the first token specially (SentencePiece strips its leading space) then
    /// render the first generated token as it reads in the middle of the text. Byte-level
    /// tokenizers need no context and ignore it.
    pub fn with_context(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool, context: &[u32]) -> Self {
        let state = if tokenizer.is_byte_level() {
            State::Bytes { pending: Vec::new() }
        } else {
            let ids = context[context.len().saturating_sub(CONTEXT_IDS)..].to_vec();
            let read = ids.len();
            State::Window { ids, prefix: 0, read }
        };
        Detokenizer { tokenizer, skip_special: skip_special_tokens, state }
    }

    /// Feeds one id and returns the text it completed (often empty: part of a character,
    /// or a skipped special token). Unknown ids produce nothing, as in `decode`.
    pub fn push(&mut self, id: u32) -> String {
        let mut out = String::new();
        match &mut self.state {
            State::Bytes { pending } => {
                if let Some(bytes) = self.tokenizer.token_bytes(id, self.skip_special) {
                    pending.extend_from_slice(&bytes);
                    drain_utf8(pending, &mut out, false);
                }
            }
            State::Window { ids, prefix, read } => {
                ids.push(id);
                let before = self.tokenizer.decode(&ids[*prefix..*read], self.skip_special);
                let after = self.tokenizer.decode(&ids[*prefix..], self.skip_special);
                if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
                    out = text_after(&after, &before);
                    // Slide: the ids just emitted become the context of the next step.
                    let start = *read;
                    ids.drain(..start);
                    *prefix = 0;
                    *read = ids.len();
                }
            }
        }
        out
    }

    /// Flushes what is still held back (an incomplete character becomes U+FFFD, as `decode`
    /// renders it) and resets the detokenizer for reuse.
    pub fn finish(&mut self) -> String {
        let mut out = String::new();
        match &mut self.state {
            State::Bytes { pending } => drain_utf8(pending, &mut out, true),
            State::Window { ids, prefix, read } => {
                if *read < ids.len() {
                    let before = self.tokenizer.decode(&ids[*prefix..*read], self.skip_special);
                    let after = self.tokenizer.decode(&ids[*prefix..], self.skip_special);
                    out = text_after(&after, &before);
                }
                ids.clear();
                *prefix = 0;
                *read = 0;
            }
        }
        out
    }

    /// Whether some ids are held back (their text is not final yet).
    pub fn has_pending(&self) -> bool {
        match &self.state {
            State::Bytes { pending } => !pending.is_empty(),
            State::Window { ids, read, .. } => *read < ids.len(),
        }
    }
}

/// Moves the longest valid UTF-8 prefix of `pending` into `out`. Invalid sequences become one
/// U+FFFD each (the `from_utf8_lossy` rule); an incomplete final character stays in `pending`
/// unless `flush`, when it too becomes U+FFFD.
fn drain_utf8(pending: &mut Vec<u8>, out: &mut String, flush: bool) {
    let mut start = 0;
    while start < pending.len() {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = pending.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // These bytes were just validated, so the fallback never applies.
                out.push_str(std::str::from_utf8(&pending[start..start + valid]).unwrap_or(""));
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start += valid + n;
                    }
                    None if flush => {
                        out.push('\u{FFFD}');
                        start = pending.len();
                    }
                    None => {
                        start += valid;
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
}

/// The part of `after` that follows `before`. Decoders are prefix-stable in practice; if one
/// is not, the common prefix (at a char boundary) is skipped and the rest is emitted.
fn text_after(after: &str, before: &str) -> String {
    if let Some(rest) = after.strip_prefix(before) {
        return rest.to_string();
    }
    let common: usize = after.char_indices().zip(before.chars()).take_while(|((_, a), b)| a == b).map(|((_, a), _)| a.len_utf8()).sum();
    after[common..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn qwen35() -> Arc<Tokenizer> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5");
        Arc::new(Tokenizer::from_dir(&dir).unwrap())
    }

    /// Streams `ids` and checks: every chunk is whole text, the concatenation equals `decode`,
    /// and returns the chunks.
    fn stream(tok: &Arc<Tokenizer>, ids: &[u32], skip: bool) -> Vec<String> {
        let mut d = Detokenizer::new(tok.clone(), skip);
        let mut chunks: Vec<String> = ids.iter().map(|&id| d.push(id)).collect();
        chunks.push(d.finish());
        assert!(!d.has_pending());
        assert_eq!(chunks.concat(), tok.decode(ids, skip));
        chunks
    }

    const MULTILINGUAL: &str = "Hello, world! Grüße aus München, ça va? 你好，世界。\
        日本語のテキスト。한국어 텍스트. مرحبا بالعالم. नमस्ते दुनिया। \
        Emoji: 👩‍👩‍👧‍👦 🇩🇪 🤖🦀 — fn main() { println!(\"{}\", 1_000); }\n\t  12345.678";

    #[test]
    fn multilingual_stream_matches_decode() {
        let tok = qwen35();
        let ids = tok.encode(MULTILINGUAL, false).unwrap();
        let chunks = stream(&tok, &ids, false);
        assert_eq!(chunks.concat(), MULTILINGUAL);
        assert!(!chunks.concat().contains('\u{FFFD}'));
    }

    #[test]
    fn characters_split_across_tokens_wait_for_completion() {
        let tok = qwen35();
        // Rare CJK and emoji are split into byte tokens by byte-level BPE.
        let text = "𠜎𠜱𝄞🦀";
        let ids = tok.encode(text, false).unwrap();
        assert!(ids.len() > text.chars().count(), "expected byte-split tokens: {ids:?}");
        let chunks = stream(&tok, &ids, false);
        assert!(chunks.iter().any(|c| c.is_empty()), "some tokens must hold back bytes");
        assert_eq!(chunks.concat(), text);
        // Every id-at-a-time prefix decodes to whole characters only.
        let mut d = Detokenizer::new(tok.clone(), false);
        let mut sofar = String::new();
        for &id in &ids {
            sofar.push_str(&d.push(id));
            assert!(text.starts_with(&sofar));
        }
    }

    #[test]
    fn invalid_and_truncated_bytes_become_replacement_chars() {
        let tok = qwen35();
        // 'ä' is the byte-level token of the single byte 0xE4 (a 3-byte lead).
        let lead = tok.token_id("ä").unwrap();
        let a = tok.token_id("a").unwrap();
        let ids = [lead, a, lead];
        let mut d = Detokenizer::new(tok.clone(), false);
        assert_eq!(d.push(lead), "");
        assert!(d.has_pending());
        assert_eq!(d.push(a), "\u{FFFD}a");
        assert_eq!(d.push(lead), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(tok.decode(&ids, false), "\u{FFFD}a\u{FFFD}");
    }

    #[test]
    fn special_tokens_emitted_or_skipped() {
        let tok = qwen35();
        let text = "<think>\nhmm\n</think>\n\nDone.<|im_end|>";
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(ids.last(), Some(&248_046));
        assert_eq!(stream(&tok, &ids, false).concat(), text);
        // Only `special` added tokens are skipped; <think> is not special in this file.
        assert_eq!(stream(&tok, &ids, true).concat(), "<think>\nhmm\n</think>\n\nDone.");
        let mut d = Detokenizer::new(tok.clone(), true);
        assert_eq!(d.push(248_046), "");
        assert_eq!(d.push(u32::MAX), "");
    }

    #[test]
    fn reusable_after_finish() {
        let tok = qwen35();
        let mut d = Detokenizer::new(tok.clone(), false);
        for id in tok.encode("first", false).unwrap() {
            d.push(id);
        }
        d.finish();
        let out: String = tok.encode("second ✓", false).unwrap().into_iter().map(|id| d.push(id)).collect();
        assert_eq!(out + &d.finish(), "second ✓");
    }

    /// A tiny SentencePiece-style tokenizer (Metaspace + byte fallback) for the window path.
    fn sentencepiece_like() -> Arc<Tokenizer> {
        let mut vocab = serde_json::Map::new();
        vocab.insert("<unk>".into(), 0.into());
        for b in 0..256u32 {
            vocab.insert(format!("<0x{b:02X}>"), (b + 1).into());
        }
        for (i, t) in ["▁", "▁hello", "▁world", "h", "e", "l", "o", "w", "r", "d", "!"].iter().enumerate() {
            vocab.insert((*t).into(), (257 + i as u32).into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true}],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": []}
        });
        let dir = std::env::temp_dir().join(format!("orchid-detok-sp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        Arc::new(tok)
    }

    #[test]
    fn window_strategy_for_non_byte_level_decoders() {
        let tok = sentencepiece_like();
        assert!(!tok.is_byte_level());
        let hello = tok.token_id("▁hello").unwrap();
        let world = tok.token_id("▁world").unwrap();
        let bang = tok.token_id("!").unwrap();
        // "é" = C3 A9 as byte-fallback tokens <0xC3> <0xA9>.
        let (c3, a9) = (0xC3 + 1, 0xA9 + 1);
        let ids = [hello, world, c3, a9, bang];
        assert_eq!(tok.decode(&ids, false), "hello worldé!");
        let chunks = stream(&tok, &ids, false);
        assert_eq!(chunks[..5], ["hello", " world", "", "é", "!"]);
        // With the prompt as context, the first generated word keeps its leading space.
        let mut d = Detokenizer::with_context(tok.clone(), false, &[hello]);
        assert_eq!(d.push(world), " world");
        assert_eq!(d.push(c3), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
