//! vLLM's request extras (`n`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `logit_bias`,
//! `include_stop_str_in_output`, `skip_special_tokens`, `thinking_token_budget`, and for chat
//! `add_generation_prompt` / `continue_final_message`), the fields this server knows but does
//! not implement (refused with a 400 naming them), and the log line for unknown fields (once
//! per field name, as vLLM does).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use serde_json::{Map, Value};

use super::{Fields, Result, kind};
use crate::errors::ApiError;

/// Most choices one request may ask for (`n`).
pub const MAX_N: usize = 16;
/// Most entries of `logit_bias` and of `stop_token_ids`.
pub const MAX_LOGIT_BIAS: usize = 1024;
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// The extras of one request, validated (token ids are checked against the vocabulary by the
/// handler, which knows it).
#[derive(Clone, Debug, PartialEq)]
pub struct Extras {
    pub n: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub include_stop_str: bool,
    pub skip_special_tokens: bool,
    /// Ids that end generation besides the model's end-of-turn ids.
    pub stop_token_ids: Vec<u32>,
    pub logit_bias: HashMap<u32, f32>,
    /// Reasoning tokens allowed before `</think>` is forced (chat only).
    pub thinking_token_budget: Option<usize>,
    /// Return the generated token ids with each choice (`token_ids`, completions only).
    pub return_token_ids: bool,
}

impl Default for Extras {
    fn default() -> Self {
        Extras {
            n: 1,
            min_tokens: 0,
            ignore_eos: false,
            include_stop_str: false,
            skip_special_tokens: true,
            stop_token_ids: Vec::new(),
            logit_bias: HashMap::new(),
            thinking_token_budget: None,
            return_token_ids: false,
        }
    }
}

pub(super) fn extras(f: &Fields, max_tokens: Option<usize>) -> Result<Extras> {
    let mut x = Extras::default();
    match f.int("n")? {
        None => {}
        Some(n) if n < 1 => return Err(ApiError::invalid("n", format!("`n` must be at least 1, got {n}"))),
        Some(n) if n as u64 > MAX_N as u64 => {
            return Err(ApiError::invalid("n", format!("`n` must be at most {MAX_N}, got {n}")));
        }
        Some(n) => x.n = n as usize,
    }
    x.min_tokens = non_negative(f, "min_tokens")?.unwrap_or(0);
    if let Some(m) = max_tokens.filter(|&m| x.min_tokens > m) {
        return Err(ApiError::invalid("min_tokens", format!("`min_tokens` ({}) must not exceed `max_tokens` ({m})", x.min_tokens)));
    }
    x.ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    x.include_stop_str = f.bool("include_stop_str_in_output")?.unwrap_or(false);
    x.skip_special_tokens = f.bool("skip_special_tokens")?.unwrap_or(true);
    x.return_token_ids = f.bool("return_token_ids")?.unwrap_or(false);
    x.thinking_token_budget = non_negative(f, "thinking_token_budget")?;
    x.stop_token_ids = match f.get("stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(ids)) if ids.len() <= MAX_STOP_TOKEN_IDS => ids
            .iter()
            .enumerate()
            .map(|(i, v)| {
                token_id(v).ok_or_else(|| {
                    ApiError::invalid(
                        format!("stop_token_ids[{i}]"),
                        format!("`stop_token_ids[{i}]` must be a token id (a non-negative integer), got {v}"),
                    )
                })
            })
            .collect::<Result<_>>()?,
        Some(Value::Array(ids)) => {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!("`stop_token_ids` may hold at most {MAX_STOP_TOKEN_IDS} ids, got {}", ids.len()),
            ));
        }
        Some(v) => {
            return Err(ApiError::invalid("stop_token_ids", format!("`stop_token_ids` must be an array of token ids, got {}", kind(v))));
        }
    };
    x.logit_bias = match f.get("logit_bias") {
        None => HashMap::new(),
        Some(Value::Object(m)) if m.len() <= MAX_LOGIT_BIAS => m
            .iter()
            .map(|(k, v)| {
                let param = format!("logit_bias.{k}");
                let id = k
                    .parse::<u32>()
                    .map_err(|_| ApiError::invalid(param.clone(), format!("`logit_bias` keys must be token ids, got `{k}`")))?;
                match v.as_f64() {
                    Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                    _ => Err(ApiError::invalid(param, format!("`logit_bias` values must be numbers between -100 and 100, got {v}"))),
                }
            })
            .collect::<Result<_>>()?,
        Some(Value::Object(m)) => {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` may hold at most {MAX_LOGIT_BIAS} entries, got {}", m.len()),
            ));
        }
        Some(v) => {
            return Err(ApiError::invalid("logit_bias", format!("`logit_bias` must be an object of token id -> bias, got {}", kind(v))));
        }
    };
    Ok(x)
}

/// Chat's `add_generation_prompt` (default true) and `continue_final_message` (default false):
/// `(add_generation_prompt, continue_final_message)`; continuing requires the last message to
/// be the assistant's, with text to continue.
pub(super) fn prefill(f: &Fields, messages: &[Value]) -> Result<(bool, bool)> {
    let add = f.bool("add_generation_prompt")?;
    let cont = f.bool("continue_final_message")?.unwrap_or(false);
    if cont && add == Some(true) {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` and `add_generation_prompt` cannot both be true",
        ));
    }
    if cont {
        let last = messages.last();
        if last.and_then(|m| m.get("role")).and_then(Value::as_str) != Some("assistant") {
            return Err(ApiError::invalid(
                "continue_final_message",
                "`continue_final_message` needs the last message to be an assistant message",
            ));
        }
        if last.and_then(|m| m.get("content")).and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(ApiError::invalid(
                "continue_final_message",
                "`continue_final_message` needs the last (assistant) message to have text content to continue",
            ));
        }
    }
    Ok((add.unwrap_or(!cont), cont))
}

fn non_negative(f: &Fields, k: &str) -> Result<Option<usize>> {
    match f.int(k)? {
        None => Ok(None),
        Some(v) if v < 0 => Err(ApiError::invalid(k, format!("`{k}` must be a non-negative integer, got {v}"))),
        Some(v) => Ok(Some(usize::try_from(v).unwrap_or(usize::MAX))),
    }
}

fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

/// Fields other servers accept that this one does not implement: refused with a 400 naming
/// the field when set to anything but their neutral value (null, false, empty, or the value
/// listed).
const NOT_IMPLEMENTED: &[(&str, Option<&str>)] = &[
    ("use_beam_search", None),
    ("length_penalty", Some("1")),
    ("prompt_logprobs", None),
    ("truncate_prompt_tokens", None),
    ("bad_words", None),
    ("allowed_token_ids", None),
    ("audio", None),
    ("prediction", None),
    ("functions", None),
    ("function_call", None),
    ("web_search_options", None),
    ("documents", None),
    ("mm_processor_kwargs", None),
    ("spaces_between_special_tokens", Some("true")),
    ("priority", Some("0")),
];

/// Every top-level field of chat or completions requests that is known (implemented, refused
/// by the checks above, or handled by other parts of the validation).
const KNOWN: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream",
    "stream_options",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "chat_template_kwargs",
    "response_format",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "best_of",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "stop_token_ids",
    "logit_bias",
    "thinking_token_budget",
    "add_generation_prompt",
    "continue_final_message",
    "metadata",
    "store",
    "service_tier",
    "modalities",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "chat_template",
    "add_special_tokens",
    "request_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
];

pub(super) fn refuse_unimplemented(f: &Fields) -> Result<()> {
    for &(k, neutral) in NOT_IMPLEMENTED {
        let Some(v) = f.get(k) else { continue };
        let is_neutral = match v {
            Value::Bool(false) => true,
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            v => neutral.is_some_and(|n| serde_json::from_str::<Value>(n).ok().as_ref() == Some(v) || v.as_f64() == n.parse().ok()),
        };
        if !is_neutral {
            return Err(ApiError::invalid(k, format!("`{k}` is not supported by this server")));
        }
    }
    if let Some(m) = f.get("modalities") {
        let text_only = m.as_array().is_some_and(|a| a.iter().all(|x| x == "text"));
        if !text_only {
            return Err(ApiError::invalid(
                "modalities",
                "`modalities` other than [\"text\"] are not supported: this model writes text only",
            ));
        }
    }
    Ok(())
}

/// Logs each unknown top-level field name once per process (they are ignored, as vLLM and
/// OpenAI's own server ignore them). The set of names remembered is bounded.
pub fn log_unknown_fields(endpoint: &str, body: &Map<String, Value>) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    const MAX_REMEMBERED: usize = 256;
    let unknown: Vec<&String> = body.keys().filter(|k| !KNOWN.contains(&k.as_str())).collect();
    if unknown.is_empty() {
        return;
    }
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    let seen = seen.get_or_insert_with(HashSet::new);
    for k in unknown {
        if seen.len() >= MAX_REMEMBERED || seen.contains(k) {
            continue;
        }
        let shown: String = k.chars().take(64).collect();
        tracing::warn!("{endpoint}: ignoring the unknown request field `{shown}` (logged once per field name)");
        seen.insert(k.clone());
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse(v: Value) -> Result<Extras> {
        let m = v.as_object().unwrap().clone();
        refuse_unimplemented(&Fields(&m))?;
        extras(&Fields(&m), Some(100))
    }

    #[test]
    fn parses_and_refuses() {
        let x = parse(json!({"n": 3, "min_tokens": 5, "ignore_eos": true, "stop_token_ids": [7, 9],
            "logit_bias": {"42": -100, "7": 2.5}, "include_stop_str_in_output": true,
            "skip_special_tokens": false, "thinking_token_budget": 0}))
        .unwrap();
        assert_eq!((x.n, x.min_tokens, x.ignore_eos, x.include_stop_str, x.skip_special_tokens), (3, 5, true, true, false));
        assert_eq!(x.stop_token_ids, vec![7, 9]);
        assert_eq!(x.logit_bias[&42], -100.0);
        assert_eq!(x.thinking_token_budget, Some(0));
        assert_eq!(parse(json!({})).unwrap(), Extras::default());
        for (body, param) in [
            (json!({"n": 0}), "n"),
            (json!({"n": 99}), "n"),
            (json!({"min_tokens": 101}), "min_tokens"),
            (json!({"min_tokens": -1}), "min_tokens"),
            (json!({"stop_token_ids": [-1]}), "stop_token_ids[0]"),
            (json!({"logit_bias": {"x": 1}}), "logit_bias.x"),
            (json!({"logit_bias": {"1": 101}}), "logit_bias.1"),
            (json!({"use_beam_search": true}), "use_beam_search"),
            (json!({"priority": 3}), "priority"),
            (json!({"modalities": ["audio"]}), "modalities"),
        ] {
            let e = parse(body.clone()).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        assert!(parse(json!({"use_beam_search": false, "priority": 0, "length_penalty": 1.0, "modalities": ["text"]})).is_ok());
    }

    #[test]
    fn prefill_rules() {
        let m = |v: Value| v.as_object().unwrap().clone();
        let msgs = vec![json!({"role": "user", "content": "hi"}), json!({"role": "assistant", "content": "Sure"})];
        assert_eq!(prefill(&Fields(&m(json!({}))), &msgs).unwrap(), (true, false));
        assert_eq!(prefill(&Fields(&m(json!({"continue_final_message": true}))), &msgs).unwrap(), (false, true));
        assert!(prefill(&Fields(&m(json!({"continue_final_message": true, "add_generation_prompt": true}))), &msgs).is_err());
        assert!(prefill(&Fields(&m(json!({"continue_final_message": true}))), &msgs[..1]).is_err());
    }
}
