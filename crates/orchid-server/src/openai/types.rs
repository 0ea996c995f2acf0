//! The JSON objects the server answers with (OpenAI chat.completion(.chunk), text_completion,
//! model list, usage, logprobs). Built with `json!` so the field order matches OpenAI's.

use orchid_engine::Tokenizer;
use orchid_engine::sampling::TokenLogprob;
use serde_json::{Map, Value, json};

use crate::chat_output::ToolDelta;

/// What every object of one response shares.
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    pub fn new(prefix: &str, model: &str) -> Meta {
        Meta { id: super::new_id(prefix), created: super::unix_now(), model: model.to_string() }
    }
}

/// `usage`, with `prompt_tokens_details.cached_tokens`: prompt tokens restored from the prefix cache.
pub fn usage(prompt: usize, cached: usize, completion: usize, reasoning: Option<usize>) -> Value {
    let mut u = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}});
    if let Some(r) = reasoning {
        u["completion_tokens_details"] = json!({"reasoning_tokens": r});
    }
    u
}

/// The text of one token (lossy for a token that is part of a character; see `bytes`).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false)
}

fn token_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    match tok.token_bytes(id, false) {
        Some(b) => b.into_owned(),
        None => token_text(tok, id).into_bytes(),
    }
}

/// Chat `logprobs.content[i]`.
pub fn chat_logprob(tok: &Tokenizer, lp: &TokenLogprob) -> Value {
    let top: Vec<Value> =
        lp.top.iter().map(|&(id, l)| json!({"token": token_text(tok, id), "logprob": l, "bytes": token_bytes(tok, id)})).collect();
    json!({"token": token_text(tok, lp.id), "logprob": lp.logprob, "bytes": token_bytes(tok, lp.id), "top_logprobs": top})
}

/// Chat `logprobs` for a list of tokens (None when logprobs were not asked for).
pub fn chat_logprobs(tok: &Tokenizer, wanted: bool, lps: &[TokenLogprob]) -> Value {
    if !wanted {
        return Value::Null;
    }
    json!({"content": lps.iter().map(|lp| chat_logprob(tok, lp)).collect::<Vec<_>>(), "refusal": null})
}

/// Completions `logprobs` (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`);
/// `offset` is where the first token's text starts in the response text.
pub fn completion_logprobs(tok: &Tokenizer, lps: &[TokenLogprob], mut offset: usize) -> Value {
    let (mut tokens, mut lp, mut top, mut offs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for t in lps {
        let text = token_text(tok, t.id);
        offs.push(offset);
        offset += text.len();
        tokens.push(text);
        lp.push(t.logprob);
        let mut m = Map::new();
        for &(id, l) in &t.top {
            m.insert(token_text(tok, id), json!(l));
        }
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lp, "top_logprobs": top, "text_offset": offs})
}

/// OpenAI tool-call delta entries for a streamed chunk.
pub fn tool_call_delta(d: &ToolDelta) -> Value {
    match d {
        ToolDelta::Start { index, id, name } => {
            json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}})
        }
        ToolDelta::Args { index, delta } => json!({"index": index, "function": {"arguments": delta}}),
    }
}

/// A `chat.completion.chunk` with one choice.
pub fn chat_chunk(meta: &Meta, delta: Value, finish_reason: Option<&str>, logprobs: Value, include_usage: bool) -> Value {
    let mut c = json!({
        "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    });
    if include_usage {
        c["usage"] = Value::Null;
    }
    c
}

/// The chunk that carries only usage (`stream_options.include_usage`).
pub fn usage_chunk(meta: &Meta, object: &str, usage: Value) -> Value {
    json!({"id": meta.id, "object": object, "created": meta.created, "model": meta.model, "choices": [], "usage": usage})
}

/// A `chat.completion`.
pub fn chat_completion(meta: &Meta, message: Value, finish_reason: &str, logprobs: Value, usage: Value) -> Value {
    json!({
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage,
    })
}

/// A `text_completion` (streamed chunks have the same shape).
pub fn completion(meta: &Meta, text: &str, finish_reason: Option<&str>, logprobs: Value, usage: Option<Value>) -> Value {
    let mut c = json!({
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    });
    if let Some(u) = usage {
        c["usage"] = u;
    }
    c
}

/// An entry of `/v1/models`.
pub fn model_object(id: &str, created: u64, max_context: Option<usize>) -> Value {
    let mut m = json!({"id": id, "object": "model", "created": created, "owned_by": "orchid"});
    if let Some(n) = max_context {
        m["max_model_len"] = json!(n);
    }
    m
}
