//! `POST /v1/responses`: the OpenAI Responses API, stateless, over the chat pipeline.
//!
//! The request is translated into a chat request (`instructions` -> a system message, `input`
//! items -> messages, `tools` -> chat tools, `max_output_tokens`, `reasoning.effort`,
//! `text.format` -> `response_format`) and validated and run exactly as
//! `/v1/chat/completions` runs it. The output is a list of items: `reasoning`, `message`
//! (`output_text`) and `function_call`, in the order the model wrote them.
//!
//! Stateless: nothing is stored. `store` defaults to false here; `store: true`,
//! `previous_response_id`, `conversation` and `background: true` are refused with a 400.
//!
//! Streaming sends the Responses events: `response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`,
//! `response.reasoning_text.delta`, `response.function_call_arguments.delta`, their `.done`
//! events, `response.output_item.done`, then `response.completed` (or `response.incomplete`
//! at the token limit; `error` and `response.failed` if generation fails).

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use orchid_engine::request::FinishReason;
use serde_json::{Map, Value, json};

use crate::blocks::{Block, Blocks, Change, Kind};
use crate::body::JsonBody;
use crate::chat::{ChatRun, Step, start_chat};
use crate::errors::ApiError;
use crate::openai::{new_id, unix_now, validate};
use crate::sse::sse_events_response;
use crate::state::AppState;

pub async fn responses(State(st): State<AppState>, JsonBody(body): JsonBody) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let chat = to_chat(&body)?;
    let req = validate::chat_request(&chat, &st.config.sampling_defaults).map_err(rename_params)?;
    let stream = req.common.stream;
    let (mut runs, _req) = start_chat(&st, req, arrived).await?;
    let run = runs.pop().ok_or_else(|| ApiError::internal("no generation was started"))?;
    let r = Run { run, blocks: Blocks::default(), echo: echo(&body, &st.config.model_id), seq: 0 };
    if stream { Ok(r.into_sse()) } else { r.collect().await }
}

/// The request fields echoed in the response object.
fn echo(body: &Map<String, Value>, model: &str) -> Value {
    let get = |k: &str| body.get(k).cloned().unwrap_or(Value::Null);
    json!({
        "id": new_id("resp_"), "object": "response", "created_at": unix_now(), "model": model,
        "instructions": get("instructions"), "max_output_tokens": get("max_output_tokens"),
        "temperature": get("temperature"), "top_p": get("top_p"), "tools": body.get("tools").cloned().unwrap_or(json!([])),
        "tool_choice": body.get("tool_choice").cloned().unwrap_or(json!("auto")), "parallel_tool_calls": true,
        "previous_response_id": null, "reasoning": get("reasoning"), "store": false,
        "text": body.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}})), "truncation": "disabled",
        "user": get("user"), "metadata": body.get("metadata").cloned().unwrap_or(json!({})),
    })
}

/// Chat-request parameter names back to the Responses names they came from.
fn rename_params(mut e: ApiError) -> ApiError {
    if let Some(p) = &e.param {
        let renamed = if let Some(rest) = p.strip_prefix("messages") {
            Some(format!("input{rest}"))
        } else if p == "max_completion_tokens" {
            Some("max_output_tokens".into())
        } else if p == "response_format" {
            Some("text.format".into())
        } else if p == "reasoning_effort" {
            Some("reasoning.effort".into())
        } else {
            None
        };
        if let Some(r) = renamed {
            e.message = e.message.replace(p.as_str(), &r);
            e.param = Some(r);
        }
    }
    e
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

/// The Responses request as a chat-completions request body.
fn to_chat(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let on = |k: &str| body.get(k).is_some_and(|v| !v.is_null() && v != &Value::Bool(false));
    if on("store") {
        return Err(bad(
            "store",
            "`store: true` is not supported: this server is stateless (responses are not stored); send `store: false`",
        ));
    }
    for k in ["previous_response_id", "conversation"] {
        if on(k) {
            return Err(bad(k, format!("`{k}` is not supported: this server is stateless; send the whole conversation in `input`")));
        }
    }
    if on("background") {
        return Err(bad("background", "`background: true` is not supported"));
    }
    let mut chat = Map::new();
    for k in ["model", "temperature", "top_p", "stream", "user", "parallel_tool_calls", "top_logprobs"] {
        if let Some(v) = body.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    // vLLM-style extras pass through unchanged.
    for k in [
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "min_tokens",
        "thinking_token_budget",
        "chat_template_kwargs",
    ] {
        if let Some(v) = body.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(v) = body.get("max_output_tokens") {
        chat.insert("max_completion_tokens".into(), v.clone());
    }
    match body.get("reasoning") {
        None | Some(Value::Null) => {}
        Some(Value::Object(r)) => {
            if let Some(e) = r.get("effort").filter(|e| !e.is_null()) {
                chat.insert("reasoning_effort".into(), e.clone());
            }
        }
        Some(_) => return Err(bad("reasoning", "`reasoning` must be an object")),
    }
    match body.get("text").and_then(|t| t.get("format")) {
        None | Some(Value::Null) => {}
        Some(f) => {
            chat.insert("response_format".into(), f.clone());
        }
    }
    let mut messages = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(bad("instructions", "`instructions` must be a string")),
    }
    match body.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                input_item(i, item, &mut messages)?;
            }
        }
        Some(Value::Array(_)) => return Err(bad("input", "`input` must not be empty")),
        None | Some(Value::Null) => return Err(bad("input", "`input` is required")),
        Some(_) => return Err(bad("input", "`input` must be a string or an array of input items")),
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        let Value::Array(tools) = tools else { return Err(bad("tools", "`tools` must be an array")) };
        let tools = tools.iter().enumerate().map(|(i, t)| tool(i, t)).collect::<Result<Vec<_>, _>>()?;
        chat.insert("tools".into(), Value::Array(tools));
    }
    match body.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            chat.insert("tool_choice".into(), Value::from(s.as_str()));
        }
        Some(Value::Object(o)) => match (o.get("type").and_then(Value::as_str), o.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => {
                chat.insert("tool_choice".into(), json!({"type": "function", "function": {"name": name}}));
            }
            _ => {
                return Err(bad("tool_choice", "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"name\": string}"));
            }
        },
        Some(_) => return Err(bad("tool_choice", "`tool_choice` must be a string or an object")),
    }
    Ok(chat)
}

/// A Responses tool (`{"type": "function", "name", "description", "parameters"}`) as a chat tool.
fn tool(i: usize, t: &Value) -> Result<Value, ApiError> {
    match t.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => return Err(bad(&format!("tools[{i}].type"), format!("tool type `{other}` is not supported (only `function`)"))),
        None => return Err(bad(&format!("tools[{i}].type"), format!("`tools[{i}].type` is required"))),
    }
    let mut f = Map::new();
    for k in ["name", "description", "parameters", "strict"] {
        if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
            f.insert(k.into(), v.clone());
        }
    }
    Ok(json!({"type": "function", "function": f}))
}

/// One `input` item appended as chat messages.
fn input_item(i: usize, item: &Value, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let p = |f: &str| format!("input[{i}]{f}");
    let Value::Object(o) = item else { return Err(bad(&p(""), format!("`input[{i}]` must be an object"))) };
    let kind = o.get("type").and_then(Value::as_str).unwrap_or("message");
    let str_field =
        |k: &str| o.get(k).and_then(Value::as_str).ok_or_else(|| bad(&p(&format!(".{k}")), format!("`input[{i}].{k}` must be a string")));
    match kind {
        "message" => {
            let role = str_field("role")?;
            if !matches!(role, "user" | "system" | "developer" | "assistant") {
                return Err(bad(&p(".role"), format!("`input[{i}].role` must be user, system, developer or assistant; got `{role}`")));
            }
            let content = match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut s = String::new();
                    for (j, part) in parts.iter().enumerate() {
                        match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                            (Some("input_text" | "output_text" | "text"), Some(t)) => s.push_str(t),
                            (Some(t @ ("input_text" | "output_text" | "text")), None) => {
                                return Err(bad(&p(&format!(".content[{j}].text")), format!("a `{t}` part needs a `text` string")));
                            }
                            (Some("refusal"), _) => {}
                            (t, _) => {
                                return Err(bad(
                                    &p(&format!(".content[{j}].type")),
                                    format!("content part type `{}` is not supported: this model takes text only", t.unwrap_or("(none)")),
                                ));
                            }
                        }
                    }
                    s
                }
                _ => return Err(bad(&p(".content"), format!("`input[{i}].content` must be a string or a list of text parts"))),
            };
            messages.push(json!({"role": role, "content": content}));
        }
        "function_call" => {
            let call = json!({"id": str_field("call_id")?, "type": "function",
                "function": {"name": str_field("name")?, "arguments": o.get("arguments").cloned().unwrap_or(json!("{}"))}});
            // Consecutive calls belong to one assistant turn.
            match messages.last_mut() {
                Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => {
                    if let Some(Value::Array(c)) = m.get_mut("tool_calls") {
                        c.push(call);
                    }
                }
                Some(m) if m["role"] == "assistant" => m["tool_calls"] = json!([call]),
                _ => messages.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let output = match o.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(v @ Value::Array(_)) => {
                    v.as_array().into_iter().flatten().filter_map(|x| x.get("text").and_then(Value::as_str)).collect::<String>()
                }
                _ => return Err(bad(&p(".output"), format!("`input[{i}].output` must be a string"))),
            };
            messages.push(json!({"role": "tool", "tool_call_id": str_field("call_id")?, "content": output}));
        }
        "reasoning" => {
            // Earlier reasoning goes with the assistant turn that follows it.
            let text: String = ["content", "summary"]
                .iter()
                .filter_map(|k| o.get(*k).and_then(Value::as_array))
                .flatten()
                .filter_map(|x| x.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n");
            messages.push(json!({"role": "assistant", "content": "", "reasoning_content": text}));
        }
        other => {
            return Err(bad(
                &p(".type"),
                format!("input item type `{other}` is not supported (message, function_call, function_call_output, reasoning)"),
            ));
        }
    }
    Ok(())
}

/// One response being generated.
struct Run {
    run: ChatRun,
    blocks: Blocks,
    /// The response object's fixed fields.
    echo: Value,
    /// `sequence_number` of the next event.
    seq: u64,
}

fn item_id(b: &Block, i: usize, resp_id: &str) -> String {
    let prefix = match b.kind {
        Kind::Reasoning => "rs",
        Kind::Text => "msg",
        Kind::Call => "fc",
    };
    format!("{prefix}_{}_{i}", resp_id.trim_start_matches("resp_"))
}

/// An output item (`done`: complete, else as first announced).
fn item(b: &Block, i: usize, resp_id: &str, done: bool) -> Value {
    let id = item_id(b, i, resp_id);
    let status = if done { "completed" } else { "in_progress" };
    match b.kind {
        Kind::Reasoning => {
            let content = if done { json!([{"type": "reasoning_text", "text": b.text}]) } else { json!([]) };
            json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
        }
        Kind::Text => {
            let content = if done { json!([text_part(&b.text)]) } else { json!([]) };
            json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
        }
        Kind::Call => {
            let (call_id, name) = b.call.clone().unwrap_or_default();
            let args = if done { b.text.as_str() } else { "" };
            json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": args, "status": status})
        }
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

impl Run {
    fn id(&self) -> String {
        self.echo["id"].as_str().unwrap_or_default().to_string()
    }

    /// The response object (`status`: in_progress, completed, incomplete, failed).
    fn response(&self, status: &str, usage: Option<Value>, done: bool) -> Value {
        let mut r = self.echo.clone();
        let id = self.id();
        r["status"] = Value::from(status);
        r["output"] = if done {
            Value::Array(self.blocks.blocks.iter().enumerate().map(|(i, b)| item(b, i, &id, true)).collect())
        } else {
            json!([])
        };
        r["incomplete_details"] = if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null };
        r["error"] = Value::Null;
        r["usage"] = usage.unwrap_or(Value::Null);
        r
    }

    fn usage(&self, prompt: usize, completion: usize) -> Value {
        json!({
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": self.run.out.reasoning_tokens()},
            "total_tokens": prompt + completion,
        })
    }

    fn status(&mut self, reason: FinishReason) -> &'static str {
        self.run.finish_reason(reason);
        match reason {
            FinishReason::Length => "incomplete",
            FinishReason::Stop => "completed",
        }
    }

    async fn collect(mut self) -> Result<Response, ApiError> {
        loop {
            match self.run.step().await {
                Step::Delta(d) => {
                    self.blocks.push(d);
                }
                Step::Finished { last, reason, prompt, completion, .. } => {
                    self.blocks.push(last);
                    self.blocks.finish();
                    let status = self.status(reason);
                    let usage = self.usage(prompt, completion);
                    let mut r = self.response(status, Some(usage), true);
                    let text: String = self.blocks.blocks.iter().filter(|b| b.kind == Kind::Text).map(|b| b.text.as_str()).collect();
                    r["output_text"] = Value::from(text);
                    return Ok(axum::Json(r).into_response());
                }
                Step::Failed(e) => return Err(e),
            }
        }
    }

    /// One SSE event.
    fn event(&mut self, kind: &str, mut data: Value) -> Bytes {
        data["type"] = Value::from(kind);
        data["sequence_number"] = Value::from(self.seq);
        self.seq += 1;
        Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
    }

    /// The events of a list of block changes.
    fn change_events(&mut self, changes: Vec<Change>) -> Vec<Bytes> {
        let id = self.id();
        let mut out = Vec::new();
        for c in changes {
            match c {
                Change::Open(i) => {
                    let b = self.blocks.blocks[i].clone();
                    out.push(self.event("response.output_item.added", json!({"output_index": i, "item": item(&b, i, &id, false)})));
                    if b.kind == Kind::Text {
                        let ev = json!({"item_id": item_id(&b, i, &id), "output_index": i, "content_index": 0, "part": text_part("")});
                        out.push(self.event("response.content_part.added", ev));
                    }
                }
                Change::Delta(i, delta) => {
                    let b = &self.blocks.blocks[i];
                    let (kind, extra) = match b.kind {
                        Kind::Reasoning => ("response.reasoning_text.delta", json!({"content_index": 0})),
                        Kind::Text => ("response.output_text.delta", json!({"content_index": 0, "logprobs": []})),
                        Kind::Call => ("response.function_call_arguments.delta", json!({})),
                    };
                    let mut ev = json!({"item_id": item_id(b, i, &id), "output_index": i, "delta": delta});
                    if let (Some(ev), Value::Object(x)) = (ev.as_object_mut(), extra) {
                        ev.extend(x);
                    }
                    out.push(self.event(kind, ev));
                }
                Change::Close(i) => {
                    let b = self.blocks.blocks[i].clone();
                    let iid = item_id(&b, i, &id);
                    match b.kind {
                        Kind::Reasoning => {
                            let ev = json!({"item_id": iid, "output_index": i, "content_index": 0, "text": b.text});
                            out.push(self.event("response.reasoning_text.done", ev));
                        }
                        Kind::Text => {
                            let ev = json!({"item_id": iid, "output_index": i, "content_index": 0, "text": b.text, "logprobs": []});
                            out.push(self.event("response.output_text.done", ev));
                            let ev = json!({"item_id": iid, "output_index": i, "content_index": 0, "part": text_part(&b.text)});
                            out.push(self.event("response.content_part.done", ev));
                        }
                        Kind::Call => {
                            let ev = json!({"item_id": iid, "output_index": i, "name": b.call.as_ref().map(|c| c.1.clone()), "arguments": b.text});
                            out.push(self.event("response.function_call_arguments.done", ev));
                        }
                    }
                    out.push(self.event("response.output_item.done", json!({"output_index": i, "item": item(&b, i, &id, true)})));
                }
            }
        }
        out
    }

    fn into_sse(mut self) -> Response {
        let created = self.response("in_progress", None, false);
        let first = vec![
            self.event("response.created", json!({"response": created.clone()})),
            self.event("response.in_progress", json!({"response": created})),
        ];
        let state = (self, std::collections::VecDeque::from(first), false);
        sse_events_response(futures::stream::unfold(state, |(mut s, mut queue, mut ended)| async move {
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
                    Step::Finished { last, reason, prompt, completion, .. } => {
                        ended = true;
                        let mut ch = s.blocks.push(last);
                        ch.extend(s.blocks.finish());
                        queue.extend(s.change_events(ch));
                        let status = s.status(reason);
                        let usage = s.usage(prompt, completion);
                        let r = s.response(status, Some(usage), true);
                        let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                        queue.push_back(s.event(kind, json!({"response": r})));
                    }
                    Step::Failed(e) => {
                        ended = true;
                        let ev = json!({"code": e.code, "message": e.message, "param": e.param});
                        queue.push_back(s.event("error", ev));
                        let mut r = s.response("failed", None, true);
                        r["error"] = json!({"code": e.code.unwrap_or("server_error"), "message": e.message});
                        queue.push_back(s.event("response.failed", json!({"response": r})));
                    }
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Result<Map<String, Value>, ApiError> {
        to_chat(v.as_object().unwrap())
    }

    #[test]
    fn translates_input_items() {
        let c = chat(json!({"model": "m", "instructions": "be brief", "max_output_tokens": 9, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "time?"}]},
            {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "10:42"}],
            "tools": [{"type": "function", "name": "now", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "now"}, "reasoning": {"effort": "none"}}))
        .unwrap();
        assert_eq!(c["messages"][0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(c["messages"][1], json!({"role": "user", "content": "time?"}));
        assert_eq!(c["messages"][2]["tool_calls"][0]["function"]["name"], "now");
        assert_eq!(c["messages"][3], json!({"role": "tool", "tool_call_id": "c1", "content": "10:42"}));
        assert_eq!(c["tools"][0]["function"]["name"], "now");
        assert_eq!(c["tool_choice"]["function"]["name"], "now");
        assert_eq!((c["max_completion_tokens"].clone(), c["reasoning_effort"].clone()), (json!(9), json!("none")));
        for (body, param) in [
            (json!({"input": "x", "store": true}), "store"),
            (json!({"input": "x", "previous_response_id": "resp_1"}), "previous_response_id"),
            (json!({}), "input"),
            (json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}), "input[0].content[0].type"),
            (json!({"input": [{"type": "web_search_call"}]}), "input[0].type"),
            (json!({"input": "x", "tools": [{"type": "web_search"}]}), "tools[0].type"),
        ] {
            assert_eq!(chat(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
        assert!(chat(json!({"input": "x", "store": false})).is_ok());
    }
}
