//! `POST /v1/messages`: the Anthropic Messages API over the chat pipeline, so that the
//! Anthropic SDK and tools built on it can use this server.
//!
//! The request is translated into a chat request: `system` (a string or text blocks) -> a
//! system message; `messages` with `text`, `tool_use`, `tool_result` and `thinking` blocks ->
//! chat messages, tool calls and tool results; `tools` (`input_schema`) -> chat tools;
//! `tool_choice` (`auto`, `any`, `tool`, `none`); `max_tokens` (required), `stop_sequences`,
//! `temperature`, `top_p`, `top_k`; `thinking: {"type": "enabled", "budget_tokens": N}` sets
//! a thinking budget, `{"type": "disabled"}` turns thinking off (absent: the model's default).
//!
//! The answer is a `message` with `thinking`, `text` and `tool_use` blocks and a
//! `stop_reason` (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`). Streaming sends
//! `message_start`, `content_block_start`, `content_block_delta` (`thinking_delta`,
//! `text_delta`, `input_json_delta`), `content_block_stop`, `message_delta`, `message_stop`.
//! Errors use Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
//! `POST /v1/messages/count_tokens` answers `{"input_tokens": N}` for the same request.

use std::collections::VecDeque;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use orchid_engine::request::{FinishReason, StopReason};
use serde_json::{Map, Value, json};

use crate::blocks::{Block, Blocks, Change, Kind};
use crate::body::JsonBody;
use crate::chat::{ChatRun, Step, start_chat};
use crate::errors::ApiError;
use crate::openai::{new_id, validate};
use crate::sse::sse_events_response;
use crate::state::AppState;

pub async fn messages(State(st): State<AppState>, body: Result<JsonBody, ApiError>) -> Response {
    match run(st, body).await {
        Ok(r) => r,
        Err(e) => anthropic_error(&e),
    }
}

/// An [`ApiError`] in Anthropic's error shape (same status code).
pub fn anthropic_error(e: &ApiError) -> Response {
    let kind = match e.status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    };
    let message = match &e.param {
        Some(p) => format!("{}: {}", p, e.message),
        None => e.message.clone(),
    };
    let mut resp = (e.status, axum::Json(json!({"type": "error", "error": {"type": kind, "message": message}}))).into_response();
    if let Some(s) = e.retry_after {
        resp.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
    }
    resp
}

async fn run(st: AppState, body: Result<JsonBody, ApiError>) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let JsonBody(body) = body?;
    let chat = to_chat(&body)?;
    let req = validate::chat_request(&chat, &st.config.sampling_defaults).map_err(rename_params)?;
    let stream = req.common.stream;
    let (mut runs, req) = start_chat(&st, req, arrived).await?;
    let run = runs.pop().ok_or_else(|| ApiError::internal("no generation was started"))?;
    let m = Message { run, blocks: Blocks::default(), id: new_id("msg_"), model: st.config.model_id.clone(), stops: req.common.stop };
    if stream { Ok(m.into_sse()) } else { m.collect().await }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt the same request to
/// `/v1/messages` would run (`max_tokens` is not needed here).
pub async fn count_tokens(State(st): State<AppState>, body: Result<JsonBody, ApiError>) -> Response {
    let count = async {
        let JsonBody(mut body) = body?;
        body.entry("max_tokens").or_insert(json!(1));
        body.remove("stream");
        let chat = to_chat(&body)?;
        let req = validate::chat_request(&chat, &st.config.sampling_defaults).map_err(rename_params)?;
        st.check_model(req.common.model.as_deref())?;
        st.ready()?;
        let template = st.template.clone().ok_or_else(|| ApiError::bad_request("This model has no chat template."))?;
        let tok = st.tokenizer.clone();
        let st2 = st.clone();
        st.blocking(move || crate::chat::plan(&st2, &template, &tok, &req, usize::MAX).map(|p| p.prompt.len())).await
    };
    match count.await {
        Ok(n) => axum::Json(json!({"input_tokens": n})).into_response(),
        Err(e) => anthropic_error(&e),
    }
}

fn rename_params(mut e: ApiError) -> ApiError {
    if e.param.as_deref() == Some("stop") || e.param.as_deref().is_some_and(|p| p.starts_with("stop[")) {
        e.param = Some("stop_sequences".into());
    }
    e
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

/// The Messages request as a chat-completions request body.
fn to_chat(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut chat = Map::new();
    for k in ["model", "temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = body.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    match body.get("max_tokens") {
        None | Some(Value::Null) => return Err(bad("max_tokens", "`max_tokens` is required")),
        Some(v) => {
            chat.insert("max_tokens".into(), v.clone());
        }
    }
    if let Some(v) = body.get("stop_sequences").filter(|v| !v.is_null()) {
        chat.insert("stop".into(), v.clone());
    }
    match body.get("thinking") {
        None | Some(Value::Null) => {}
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled") => match t.get("budget_tokens") {
                Some(b @ Value::Number(_)) => {
                    chat.insert("thinking_token_budget".into(), b.clone());
                }
                _ => return Err(bad("thinking.budget_tokens", "`thinking.budget_tokens` must be an integer")),
            },
            Some("adaptive") => {}
            Some("disabled") => {
                chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": false}));
            }
            _ => {
                return Err(bad(
                    "thinking",
                    "`thinking` must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}",
                ));
            }
        },
    }
    let mut messages = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => messages.push(json!({"role": "system", "content": texts("system", blocks)?})),
        Some(_) => return Err(bad("system", "`system` must be a string or a list of text blocks")),
    }
    match body.get("messages") {
        Some(Value::Array(ms)) if !ms.is_empty() => {
            for (i, m) in ms.iter().enumerate() {
                message(i, m, &mut messages)?;
            }
        }
        Some(Value::Array(_)) => return Err(bad("messages", "`messages` must not be empty")),
        None | Some(Value::Null) => return Err(bad("messages", "`messages` is required")),
        Some(_) => return Err(bad("messages", "`messages` must be an array")),
    }
    chat.insert("messages".into(), Value::Array(messages));
    let mut has_tools = false;
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        let Value::Array(tools) = tools else { return Err(bad("tools", "`tools` must be an array")) };
        let tools = tools
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = t
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(&format!("tools[{i}].name"), format!("`tools[{i}].name` must be a string")))?;
                let mut f = json!({"name": name, "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
                if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                    f["description"] = d.clone();
                }
                Ok(json!({"type": "function", "function": f}))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        has_tools = !tools.is_empty();
        chat.insert("tools".into(), Value::Array(tools));
    }
    match body.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(tc) => {
            let choice = match (tc.get("type").and_then(Value::as_str), tc.get("name").and_then(Value::as_str)) {
                (Some("auto"), _) => json!("auto"),
                (Some("any"), _) => json!("required"),
                (Some("none"), _) => json!("none"),
                (Some("tool"), Some(name)) => json!({"type": "function", "function": {"name": name}}),
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "`tool_choice` must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": string}",
                    ));
                }
            };
            if has_tools || choice == json!("none") || choice == json!("auto") {
                chat.insert("tool_choice".into(), choice);
            }
        }
    }
    Ok(chat)
}

/// The text of a list of text blocks.
fn texts(param: &str, blocks: &[Value]) -> Result<String, ApiError> {
    let mut s = String::new();
    for (j, b) in blocks.iter().enumerate() {
        match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(t)) => s.push_str(t),
            (t, _) => {
                return Err(bad(
                    &format!("{param}[{j}]"),
                    format!("`{param}[{j}]` must be a text block (got type `{}`): this model takes text only", t.unwrap_or("(none)")),
                ));
            }
        }
    }
    Ok(s)
}

/// One Anthropic message appended as chat messages (tool results become tool messages).
fn message(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let p = |f: &str| format!("messages[{i}]{f}");
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => return Err(bad(&p(".role"), format!("`messages[{i}].role` must be user or assistant"))),
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => return Err(bad(&p(".content"), format!("`messages[{i}].content` must be a string or a list of content blocks"))),
    };
    let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let bp = |f: &str| p(&format!(".content[{j}]{f}"));
        let s = |k: &str| {
            b.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| bad(&bp(&format!(".{k}")), format!("`{}` must be a string", bp(&format!(".{k}")))))
        };
        match (b.get("type").and_then(Value::as_str), role) {
            (Some("text"), _) => text.push_str(s("text")?),
            (Some("thinking"), "assistant") => thinking.push_str(s("thinking")?),
            (Some("redacted_thinking"), "assistant") => {}
            (Some("tool_use"), "assistant") => {
                let input = b.get("input").cloned().unwrap_or(json!({}));
                if !input.is_object() {
                    return Err(bad(&bp(".input"), "a tool_use block's `input` must be an object"));
                }
                calls.push(json!({"id": s("id")?, "type": "function", "function": {"name": s("name")?, "arguments": input}}));
            }
            (Some("tool_result"), "user") => {
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(c)) => c.clone(),
                    Some(Value::Array(parts)) => texts(&bp(".content"), parts)?,
                    Some(_) => return Err(bad(&bp(".content"), "a tool_result's `content` must be a string or text blocks")),
                };
                out.push(json!({"role": "tool", "tool_call_id": s("tool_use_id")?, "content": content}));
            }
            (t, _) => {
                return Err(bad(
                    &bp(".type"),
                    format!("content block type `{}` is not supported in a {role} message", t.unwrap_or("(none)")),
                ));
            }
        }
    }
    if role == "assistant" {
        let mut msg = json!({"role": "assistant", "content": text});
        if !thinking.is_empty() {
            msg["reasoning_content"] = Value::from(thinking);
        }
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        out.push(msg);
    } else if !text.is_empty() || out.last().is_none_or(|m| m["role"] != "tool") {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// One message being generated.
struct Message {
    run: ChatRun,
    blocks: Blocks,
    id: String,
    model: String,
    stops: Vec<String>,
}

/// A content block (`done`: complete; else as `content_block_start` announces it).
fn content_block(b: &Block, done: bool) -> Value {
    match b.kind {
        Kind::Reasoning => json!({"type": "thinking", "thinking": if done { b.text.as_str() } else { "" }, "signature": ""}),
        Kind::Text => json!({"type": "text", "text": if done { b.text.as_str() } else { "" }}),
        Kind::Call => {
            let (id, name) = b.call.clone().unwrap_or_default();
            let input =
                if done { serde_json::from_str::<Value>(&b.text).ok().filter(Value::is_object).unwrap_or(json!({})) } else { json!({}) };
            json!({"type": "tool_use", "id": id, "name": name, "input": input})
        }
    }
}

impl Message {
    /// Anthropic's `stop_reason` and `stop_sequence`.
    fn stop(&mut self, reason: FinishReason, stop_reason: &Option<StopReason>) -> (&'static str, Value) {
        self.run.finish_reason(reason);
        match (reason, stop_reason) {
            (FinishReason::Length, _) => ("max_tokens", Value::Null),
            (_, _) if self.blocks.has_calls() => ("tool_use", Value::Null),
            (_, Some(StopReason::Text(s))) if self.stops.contains(s) => ("stop_sequence", Value::from(s.as_str())),
            _ => ("end_turn", Value::Null),
        }
    }

    fn shell(&self) -> Value {
        json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": null, "stop_sequence": null})
    }

    async fn collect(mut self) -> Result<Response, ApiError> {
        loop {
            match self.run.step().await {
                Step::Delta(d) => {
                    self.blocks.push(d);
                }
                Step::Finished { last, reason, stop_reason, prompt, completion, .. } => {
                    self.blocks.push(last);
                    self.blocks.finish();
                    let (sr, seq) = self.stop(reason, &stop_reason);
                    let mut m = self.shell();
                    m["content"] = Value::Array(self.blocks.blocks.iter().map(|b| content_block(b, true)).collect());
                    m["stop_reason"] = Value::from(sr);
                    m["stop_sequence"] = seq;
                    m["usage"] = json!({"input_tokens": prompt, "output_tokens": completion});
                    return Ok(axum::Json(m).into_response());
                }
                Step::Failed(e) => return Err(e),
            }
        }
    }

    fn change_events(&self, changes: Vec<Change>) -> Vec<Bytes> {
        changes
            .into_iter()
            .map(|c| match c {
                Change::Open(i) => {
                    event("content_block_start", json!({"index": i, "content_block": content_block(&self.blocks.blocks[i], false)}))
                }
                Change::Delta(i, d) => {
                    let delta = match self.blocks.blocks[i].kind {
                        Kind::Reasoning => json!({"type": "thinking_delta", "thinking": d}),
                        Kind::Text => json!({"type": "text_delta", "text": d}),
                        Kind::Call => json!({"type": "input_json_delta", "partial_json": d}),
                    };
                    event("content_block_delta", json!({"index": i, "delta": delta}))
                }
                Change::Close(i) => event("content_block_stop", json!({"index": i})),
            })
            .collect()
    }

    fn into_sse(self) -> Response {
        let mut start = self.shell();
        start["usage"] = json!({"input_tokens": self.run.run.prompt_tokens, "output_tokens": 0});
        let first = VecDeque::from(vec![event("message_start", json!({"message": start})), event("ping", json!({}))]);
        sse_events_response(futures::stream::unfold((self, first, false), |(mut s, mut queue, mut ended)| async move {
            loop {
                if let Some(b) = queue.pop_front() {
                    return Some((b, (s, queue, ended)));
                }
                if ended {
                    return None;
                }
                match s.run.step().await {
                    Step::Delta(d) => {
                        let ch = s.blocks.push(d);
                        queue.extend(s.change_events(ch));
                    }
                    Step::Finished { last, reason, stop_reason, completion, .. } => {
                        ended = true;
                        let mut ch = s.blocks.push(last);
                        ch.extend(s.blocks.finish());
                        queue.extend(s.change_events(ch));
                        let (sr, seq) = s.stop(reason, &stop_reason);
                        queue.push_back(event(
                            "message_delta",
                            json!({"delta": {"stop_reason": sr, "stop_sequence": seq}, "usage": {"output_tokens": completion}}),
                        ));
                        queue.push_back(event("message_stop", json!({})));
                    }
                    Step::Failed(e) => {
                        ended = true;
                        let kind = if e.status.is_server_error() { "api_error" } else { "invalid_request_error" };
                        queue.push_back(event("error", json!({"error": {"type": kind, "message": e.message}})));
                    }
                }
            }
        }))
    }
}

/// One SSE event: `event: NAME` and its data, which carries `"type": NAME`.
fn event(kind: &str, mut data: Value) -> Bytes {
    data["type"] = Value::from(kind);
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Result<Map<String, Value>, ApiError> {
        to_chat(v.as_object().unwrap())
    }

    #[test]
    fn translates_messages_and_tools() {
        let c = chat(json!({"model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "be brief"}],
            "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 64},
            "messages": [
                {"role": "user", "content": "time in Oslo?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "call it"},
                    {"type": "tool_use", "id": "t1", "name": "now", "input": {"tz": "Europe/Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "10:42"}]}],
            "tools": [{"name": "now", "description": "clock", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "now"}}))
        .unwrap();
        let m = &c["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], json!({"tz": "Europe/Oslo"}));
        assert_eq!(m[2]["reasoning_content"], "call it");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "t1", "content": "10:42"}));
        assert_eq!(m.as_array().unwrap().len(), 4);
        assert_eq!(c["tools"][0]["function"]["parameters"], json!({"type": "object"}));
        assert_eq!(c["tool_choice"]["function"]["name"], "now");
        assert_eq!((c["stop"].clone(), c["thinking_token_budget"].clone()), (json!(["END"]), json!(64)));
        for (body, param) in [
            (json!({"messages": [{"role": "user", "content": "x"}]}), "max_tokens"),
            (json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}), "messages[0].role"),
            (json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}), "messages[0].content[0].type"),
            (json!({"max_tokens": 5, "messages": []}), "messages"),
        ] {
            assert_eq!(chat(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn error_shape() {
        let r = anthropic_error(&ApiError::invalid("max_tokens", "`max_tokens` is required"));
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    }
}
