//! Constrained decoding: a grammar (JSON schema, regex, choice list, Lark) compiled by
//! llguidance into a per-request matcher. Before each sampled token the matcher gives the set
//! of allowed tokens (a bit mask over the vocabulary, computed from a trie of the tokenizer's
//! token bytes); the engine sets every other logit to -inf and then samples as usual; the
//! sampled token advances the matcher. When the grammar is complete the mask holds only the
//! end-of-turn tokens, so the output always ends where the grammar does.
//!
//! [`Grammars`] is built once per tokenizer (the trie); [`Grammars::compile`] turns a
//! [`GrammarSpec`] into a [`Constraint`] or an error that names what did not compile.
//!
//! A constraint may wait for a token before it starts (`</think>` for a reasoning model: the
//! reasoning is free, the answer follows the grammar).
//!
//! Finishing within the budget. A grammar only says what may come next, not when to stop: a
//! model that never writes the closing quote of a JSON string would run into `max_tokens`
//! with half a JSON value. So in the last [`CLOSING_RESERVE`] tokens of a request's budget (at
//! most its second half) the
//! constraint steers towards the end: when the grammar allows ending, only the end tokens are
//! allowed; otherwise, when it allows a token made only of closing characters (`"`, `}`, `]`,
//! `)`), only those are; otherwise tokens of closing characters and commas. In JSON this ends
//! numbers, closes open strings, arrays and objects within a few tokens (required keys still
//! to come are forced by the grammar); other grammars are unaffected unless they allow such
//! tokens. A grammar of XML-like tags around raw text ([`Constraint::closing_tags_first`],
//! the forced tool calls) tries tokens starting with `<` (a closing tag: the raw text cannot
//! hold `<`) before the closing characters, which raw text would take forever.
//!
//! JSON is generated compactly (`{"a": 1, "b": [2, 3]}`: one space after `:` and `,`, no other
//! whitespace), so a model cannot wander off into endless whitespace inside an object.

use std::borrow::Cow;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::tokenizer::Tokenizer;

/// The last tokens of a request's budget in which the constraint steers towards the end.
pub const CLOSING_RESERVE: usize = 32;
/// The same for tag grammars (a closing tag is several tokens, and the tags after it are forced).
pub const CLOSING_RESERVE_TAGS: usize = 64;

/// What a request's output must follow.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object.
    JsonObject,
    /// JSON matching the schema.
    JsonSchema(Value),
    /// Text matching the regular expression (whole output).
    Regex(String),
    /// Exactly one of the strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax (may embed `%json {..}`).
    Lark(String),
}

/// The compact JSON layout used for every JSON grammar (see the module docs).
fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": true})
}

impl GrammarSpec {
    fn to_llguidance(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(with_options(json!({"type": "object"}))),
            GrammarSpec::JsonSchema(s) => {
                if !s.is_object() && !s.is_boolean() {
                    return Err("a JSON schema must be an object".into());
                }
                TopLevelGrammar::from_json_schema(with_options(s.clone()))
            }
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarSpec::Choice(c) => {
                if c.is_empty() {
                    return Err("the list of choices is empty".into());
                }
                let alts: Vec<String> = c.iter().map(|s| lark_string(s)).collect();
                TopLevelGrammar::from_lark(format!("start: {}\n", alts.join(" | ")))
            }
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// `schema` with the compact-layout options (`x-guidance`), unless it sets its own.
pub fn with_options(schema: Value) -> Value {
    match schema {
        Value::Object(mut o) => {
            o.entry("x-guidance").or_insert_with(json_options);
            Value::Object(o)
        }
        Value::Bool(true) => json!({"x-guidance": json_options()}),
        other => other,
    }
}

/// A string as a Lark literal (JSON string escapes are what llguidance's Lark reads).
pub fn lark_string(s: &str) -> String {
    Value::from(s).to_string()
}

/// The tokenizer as llguidance sees it: every token's bytes (special tokens marked), and
/// the encoder for text it has to tokenize itself.
struct TokenizerBytes {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TokenizerBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| self.tokenizer.encode(s, false).unwrap_or_default())
    }
}

/// Compiles grammars for one tokenizer. Cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
    eos: Vec<u32>,
    /// The end tokens, the tokens made only of closing characters, those with commas too, and
    /// the tokens starting with `<` (see the module docs).
    closers: Arc<[SimpleVob; 4]>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("eos", &self.eos).finish()
    }
}

impl Grammars {
    /// `eos`: the tokens that end the output (the grammar allows them once it is complete).
    pub fn new(tokenizer: Arc<Tokenizer>, eos: &[u32]) -> anyhow::Result<Grammars> {
        anyhow::ensure!(!eos.is_empty(), "constrained decoding needs an end-of-sequence token");
        anyhow::ensure!(tokenizer.is_byte_level(), "constrained decoding needs a byte-level tokenizer");
        let n = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let special = tokenizer.is_special(id);
                match tokenizer.token_bytes(id, false) {
                    Some(b) if !special => b.into_owned(),
                    // Special tokens (and holes in the id space) are never text: llguidance
                    // knows them by a leading marker byte.
                    b => {
                        let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                        w.extend_from_slice(&b.map(|b| b.into_owned()).unwrap_or_else(|| format!("<[{id}]>").into_bytes()));
                        w
                    }
                }
            })
            .collect();
        let info = TokRxInfo::new(n as u32, eos[0]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let (mut closers, mut commas, mut tags) = (trie.alloc_token_set(), trie.alloc_token_set(), trie.alloc_token_set());
        for id in 0..n as u32 {
            let b = trie.token(id);
            if !b.is_empty() && b.iter().all(|c| matches!(c, b'"' | b'}' | b']' | b')')) {
                closers.allow_token(id);
            }
            if !b.is_empty() && b.iter().all(|c| matches!(c, b'"' | b'}' | b']' | b')' | b',')) {
                commas.allow_token(id);
            }
            if b.first() == Some(&b'<') {
                tags.allow_token(id);
            }
        }
        let ends = trie.eos_token_set();
        let env: TokEnv = Arc::new(TokenizerBytes { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars { factory: Arc::new(factory), eos: eos.to_vec(), closers: Arc::new([ends, closers, commas, tags]) })
    }

    /// A fresh matcher for `spec`; `Err` says why the grammar does not compile.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, String> {
        let g = spec.to_llguidance()?;
        let parser = self.factory.create_parser(g).map_err(|e| format!("{e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint { matcher, eos: self.eos.clone(), wait_for: None, mask: None, closers: self.closers.clone(), tags_first: false })
    }
}

/// One request's grammar state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    eos: Vec<u32>,
    /// The constraint starts after this token is generated (None: it is active).
    wait_for: Option<u32>,
    /// The mask for the next token, once computed.
    mask: Option<SimpleVob>,
    closers: Arc<[SimpleVob; 4]>,
    /// Close tags before brackets when steering towards the end (see the module docs).
    tags_first: bool,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("wait_for", &self.wait_for).field("eos", &self.eos).finish()
    }
}

impl Constraint {
    /// Leaves the output free until `token` has been generated (e.g. `</think>`).
    pub fn starting_after(mut self, token: Option<u32>) -> Constraint {
        self.wait_for = token;
        self
    }

    /// Near the end of the budget, steer towards closing tags first (a grammar of tags around
    /// raw text; see the module docs).
    pub fn closing_tags_first(mut self) -> Constraint {
        self.tags_first = true;
        self
    }

    /// Whether the grammar applies to the next token.
    pub fn active(&self) -> bool {
        self.wait_for.is_none()
    }

    /// Computes the next token's mask (when active and not yet computed). Safe to call on
    /// another thread while the model runs.
    pub fn prepare(&mut self) -> Result<(), String> {
        if self.active() && self.mask.is_none() {
            let m = self.matcher.compute_mask_or_eos().map_err(|e| format!("{e}"))?;
            self.mask = Some(m);
        }
        Ok(())
    }

    /// The tokens allowed next: the grammar's mask, narrowed to the end tiers in the last tokens
    /// of the budget (see the module docs; `remaining`: tokens left in the request's budget of
    /// `budget` tokens, this one included). `None` while the constraint waits for its start
    /// token (every token is allowed). Errors when none of the first `valid` tokens (those the
    /// model may produce) is allowed: a broken grammar state.
    pub fn allowed(&mut self, remaining: usize, budget: usize, valid: usize) -> Result<Option<Cow<'_, SimpleVob>>, String> {
        if !self.active() {
            return Ok(None);
        }
        self.prepare()?;
        let mask = self.mask.as_ref().expect("prepared above");
        let reserve = if self.tags_first { CLOSING_RESERVE_TAGS } else { CLOSING_RESERVE };
        let mut allowed = Cow::Borrowed(mask);
        if remaining <= reserve.min(budget / 2) {
            let [ends, closers, commas, tags] = &*self.closers;
            let tiers = if self.tags_first { [ends, tags, closers, commas] } else { [ends, closers, commas, ends] };
            for pick in tiers {
                let mut m = mask.clone();
                m.and(pick);
                if !m.is_zero() {
                    allowed = Cow::Owned(m);
                    break;
                }
            }
        }
        let words = allowed.as_slice();
        let any = (0..valid.div_ceil(32)).any(|w| words.get(w).copied().unwrap_or(0) & low_bits(valid - 32 * w) != 0);
        if !any {
            return Err("the grammar allows no token here".into());
        }
        Ok(Some(allowed))
    }

    /// [`allowed`](Self::allowed) as `vocab.div_ceil(32)` words for a device sampler: bit `i % 32`
    /// of word `i / 32` set when token `i` is allowed; tokens from `valid` on are not.
    pub fn mask_words(&mut self, remaining: usize, budget: usize, valid: usize, vocab: usize) -> Result<Option<Vec<u32>>, String> {
        let Some(m) = self.allowed(remaining, budget, valid)? else { return Ok(None) };
        let src = m.as_slice();
        let n = valid.min(vocab);
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for (w, x) in words.iter_mut().enumerate().take(n.div_ceil(32)) {
            *x = src.get(w).copied().unwrap_or(0) & low_bits(n - 32 * w);
        }
        Ok(Some(words))
    }

    /// Sets the logits of every token the grammar does not allow next to -inf (the mask of
    /// [`allowed`](Self::allowed), with `valid` the length of `logits`). Errors when that leaves
    /// no finite logit.
    pub fn apply(&mut self, logits: &mut [f32], remaining: usize, budget: usize) -> Result<(), String> {
        let Some(mask) = self.allowed(remaining, budget, logits.len())? else { return Ok(()) };
        apply_mask(&mask, logits);
        if logits.iter().all(|x| *x == f32::NEG_INFINITY) {
            return Err("the grammar allows no token here".into());
        }
        Ok(())
    }

    /// Advances past a generated token. `Ok(true)`: the token ends the output (an end token
    /// the grammar allowed).
    pub fn observe(&mut self, token: u32) -> Result<bool, String> {
        match self.wait_for {
            Some(t) if t == token => {
                self.wait_for = None;
                return Ok(false);
            }
            Some(_) => return Ok(false),
            None => {}
        }
        self.mask = None;
        let end = self.eos.contains(&token);
        if end || self.matcher.is_stopped() {
            return Ok(end);
        }
        self.matcher.consume_token(token).map_err(|e| format!("{e}"))?;
        Ok(false)
    }
}

/// The low `n` bits of a word (all of them from 32 on).
fn low_bits(n: usize) -> u32 {
    if n >= 32 { u32::MAX } else { (1u32 << n) - 1 }
}

/// `logits[i] = -inf` for every `i` the mask does not allow (ids past the mask included).
pub fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    let words = mask.as_slice();
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, x) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> Arc<Tokenizer> {
        Arc::new(Tokenizer::from_dir(&crate::tokenizer::tests::assets("qwen3.5")).unwrap())
    }

    fn grammars(tok: &Arc<Tokenizer>) -> Grammars {
        Grammars::new(tok.clone(), &[tok.token_id("<|im_end|>").unwrap()]).unwrap()
    }

    /// Greedy decoding under the constraint from logits that prefer `favourite` tokens
    /// (an adversarial "model"): the text produced, and whether it ended on the end token.
    fn drive(tok: &Tokenizer, mut c: Constraint, favourite: &[u32], steps: usize) -> (String, bool) {
        let n = tok.vocab_size();
        let mut out = Vec::new();
        for step in 0..steps {
            let mut logits: Vec<f32> = (0..n).map(|i| ((i * 7919 + step * 31) % 1000) as f32 / 1000.0).collect();
            for (k, &f) in favourite.iter().enumerate() {
                logits[f as usize] = 10.0 + k as f32;
            }
            c.apply(&mut logits, usize::MAX, usize::MAX).unwrap();
            let t = crate::sampling::argmax(&logits) as u32;
            if c.observe(t).unwrap() {
                return (tok.decode(&out, false), true);
            }
            out.push(t);
        }
        (tok.decode(&out, false), false)
    }

    #[test]
    fn mask_bits_map_to_token_ids() {
        let mut v = SimpleVob::alloc(70);
        v.allow_token(3);
        v.allow_token(33);
        v.allow_token(64);
        let mut l = vec![1.0f32; 70];
        apply_mask(&v, &mut l);
        let kept: Vec<usize> = (0..70).filter(|&i| l[i].is_finite()).collect();
        assert_eq!(kept, vec![3, 33, 64]);
    }

    #[test]
    fn choice_regex_and_schema_hold_against_a_stubborn_model() {
        let tok = qwen();
        let g = grammars(&tok);
        // The "model" wants to write "Hello" and newlines forever.
        let fav: Vec<u32> = ["\n", "Hello", " world"].iter().map(|s| tok.encode(s, false).unwrap()[0]).collect();
        let (text, ended) = drive(&tok, g.compile(&GrammarSpec::Choice(vec!["red".into(), "green".into()])).unwrap(), &fav, 20);
        assert!(ended && (text == "red" || text == "green"), "{text:?}");
        let (text, ended) = drive(&tok, g.compile(&GrammarSpec::Regex("[0-9]{3}-[a-z]{2}".into())).unwrap(), &fav, 20);
        assert!(ended, "{text:?}");
        assert!(text.len() == 6 && text.as_bytes()[3] == b'-', "{text:?}");
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
            "c": {"enum": ["a", "b"]}}, "required": ["n", "c"], "additionalProperties": false});
        let (text, ended) = drive(&tok, g.compile(&GrammarSpec::JsonSchema(schema)).unwrap(), &fav, 60);
        assert!(ended, "{text:?}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!((1..=9).contains(&v["n"].as_i64().unwrap()) && ["a", "b"].contains(&v["c"].as_str().unwrap()), "{text}");
    }

    #[test]
    fn waits_for_the_end_of_reasoning() {
        let tok = qwen();
        let g = grammars(&tok);
        let think_end = tok.markers().think_end.unwrap();
        let mut c = g.compile(&GrammarSpec::Choice(vec!["yes".into()])).unwrap().starting_after(Some(think_end));
        let mut l = vec![0.0f32; tok.vocab_size()];
        c.apply(&mut l, usize::MAX, usize::MAX).unwrap();
        assert!(l.iter().all(|x| x.is_finite()), "free before </think>");
        assert!(!c.observe(think_end).unwrap());
        assert!(c.active());
        c.apply(&mut l, usize::MAX, usize::MAX).unwrap();
        assert!(l.iter().filter(|x| x.is_finite()).count() < 10);
    }

    #[test]
    fn closes_json_within_the_budget() {
        let tok = qwen();
        let g = grammars(&tok);
        // A "model" that would write one long string forever.
        let fav: Vec<u32> = [" word", " more", "1"].iter().map(|s| tok.encode(s, false).unwrap()[0]).collect();
        let schema = json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object",
            "properties": {"s": {"type": "string"}, "n": {"type": "integer"}}, "required": ["s", "n"]}}}, "required": ["a"]});
        let numbers = json!({"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "integer"}}, "required": ["x", "y"]});
        for spec in [GrammarSpec::JsonObject, GrammarSpec::JsonSchema(schema), GrammarSpec::JsonSchema(numbers)] {
            let mut c = g.compile(&spec).unwrap();
            let budget = 60;
            let mut out = Vec::new();
            let mut ended = false;
            for step in 0..budget {
                let mut logits = vec![0.0f32; tok.vocab_size()];
                for (k, &f) in fav.iter().enumerate() {
                    logits[f as usize] = 10.0 + k as f32;
                }
                c.apply(&mut logits, budget - step, budget).unwrap();
                let t = crate::sampling::argmax(&logits) as u32;
                if c.observe(t).unwrap() {
                    ended = true;
                    break;
                }
                out.push(t);
            }
            let text = tok.decode(&out, false);
            assert!(ended, "{text}");
            serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        }
    }

    /// The device mask words allow exactly the tokens `apply` leaves finite, the end tiers
    /// included; tokens past `valid` are never allowed; an inactive constraint has no mask.
    #[test]
    fn mask_words_match_apply() {
        let tok = qwen();
        let g = grammars(&tok);
        let n = tok.vocab_size();
        let vocab = n + 100;
        let think_end = tok.markers().think_end.unwrap();
        let schema = json!({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]});
        let mut c = g.compile(&GrammarSpec::JsonSchema(schema)).unwrap().starting_after(Some(think_end));
        assert_eq!(c.mask_words(10, 100, n, vocab).unwrap(), None);
        c.observe(think_end).unwrap();
        let prefix = tok.encode("{\"s\": \"abc", false).unwrap();
        let check = |c: &mut Constraint, remaining: usize, valid: usize| {
            let words = c.mask_words(remaining, 100, valid, vocab).unwrap().unwrap();
            assert_eq!(words.len(), vocab.div_ceil(32));
            let mut l = vec![0.0f32; valid];
            c.apply(&mut l, remaining, 100).unwrap();
            let bit = |i: usize| words[i / 32] >> (i % 32) & 1 == 1;
            assert!((0..valid).all(|i| bit(i) == l[i].is_finite()));
            assert!((valid..vocab).all(|i| !bit(i)));
            (0..valid).filter(|&i| bit(i)).count()
        };
        let free = check(&mut c, 100, n);
        for &t in &prefix {
            c.observe(t).unwrap();
        }
        let open = check(&mut c, 100, n);
        // Inside a string near the end of the budget: only closing tokens.
        let closing = check(&mut c, 5, n);
        assert!(closing < open && open > 1000 && free < open, "{free} {open} {closing}");
        // Fewer valid tokens than the tokenizer's.
        check(&mut c, 100, n - 5000);
    }

    #[test]
    fn bad_grammars_say_why() {
        let tok = qwen();
        let g = grammars(&tok);
        assert!(g.compile(&GrammarSpec::Regex("(".into())).is_err());
        assert!(g.compile(&GrammarSpec::Lark("start: undefined_rule".into())).is_err());
        assert!(g.compile(&GrammarSpec::JsonSchema(json!({"type": "frobnicate"}))).is_err());
        assert!(g.compile(&GrammarSpec::JsonSchema(json!([1]))).is_err());
        assert!(g.compile(&GrammarSpec::Choice(vec![])).is_err());
    }
}
