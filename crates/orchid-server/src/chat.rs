//! `POST /v1/chat/completions`.
//!
//! The conversation is rendered by the checkpoint's chat template (tools included unless
//! `tool_choice` is `none`), tokenized, and generated until an end-of-turn token. The output
//! goes through [`ChatOutput`] (reasoning, then tool calls) in both modes.
//!
//! `tool_choice`:
//! - `auto`: tools in the prompt, calls parsed.
//! - `none`: tools left out of the prompt, nothing parsed.
//! - `required`: thinking is turned off for the turn and the output is constrained to one or
//!   more well-formed calls of the request's tools (one with `parallel_tool_calls: false`),
//!   each parameter value following its schema (see [`crate::structured::tool_call_grammar`]).
//! - a named function: as `required`, with that function only, called once.
//!
//! `response_format` / `structured_outputs` / `guided_*` constrain the answer to a grammar;
//! when the prompt opens `<think>`, the reasoning is free and the constraint starts after
//! `</think>`.

use std::collections::VecDeque;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use orchid_engine::constraint::{Constraint, GrammarSpec};
use orchid_engine::request::{Event, FinishReason, GenerateRequest};
use orchid_engine::sampling::TokenLogprob;
use orchid_engine::{ChatTemplate, Tokenizer};
use serde_json::{Map, Value, json};

use crate::body::JsonBody;
use crate::chat_output::{ChatDelta, ChatOutput, ToolDelta, prompt_opens_reasoning};
use crate::errors::ApiError;
use crate::generation::Generation;
use crate::openai::types::{self, Meta};
use crate::openai::validate::{self, ChatRequest, ToolChoice};
use crate::reasoning_parser::ReasoningParser;
use crate::sse::sse_response;
use crate::state::AppState;
use crate::structured::tool_call_grammar;
use crate::tool_schema::ToolSchemas;

/// A rendered, tokenized chat request.
struct Plan {
    prompt: Vec<u32>,
    /// Parse reasoning starting inside `<think>` (the prompt opened it); None: no reasoning.
    reasoning: Option<bool>,
    /// Tool schemas and the forced prompt suffix, when calls are parsed.
    tools: Option<(ToolSchemas, String)>,
    /// The grammar the output follows (forced tool calls or structured output).
    constraint: Option<Constraint>,
}

fn plan(st: &AppState, template: &ChatTemplate, tok: &Tokenizer, req: &ChatRequest) -> Result<Plan, ApiError> {
    let mut kwargs = req.template_kwargs.clone();
    // A forced call is started in the prompt (which steers the model), the grammar finishes it.
    let prefix = match &req.tool_choice {
        ToolChoice::Required => "<tool_call>\n<function=".to_string(),
        ToolChoice::Function(name) => format!("<tool_call>\n<function={name}>\n"),
        ToolChoice::None | ToolChoice::Auto => String::new(),
    };
    let forced = !prefix.is_empty();
    if forced {
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
    }
    let tools = if req.tool_choice == ToolChoice::None {
        None
    } else {
        req.tools.as_deref()
    };
    let mut text = template.render(&req.messages, tools, true, &kwargs)?;
    text.push_str(&prefix);
    let reasoning = if forced {
        None
    } else {
        Some(prompt_opens_reasoning(&text))
    };
    let prompt = tok
        .encode(&text, false)
        .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e:#}")))?;
    let constraint = match (&req.tool_choice, &req.structured, tools) {
        (ToolChoice::Required | ToolChoice::Function(_), _, Some(t)) => {
            let only = match &req.tool_choice {
                ToolChoice::Function(name) => Some(name.as_str()),
                _ => None,
            };
            let parallel = req.parallel_tool_calls && only.is_none();
            let grammar = tool_call_grammar(t, only, parallel, &prefix);
            Some(st.compile_grammar("tools", &GrammarSpec::Lark(grammar))?.closing_tags_first())
        }
        (_, Some(s), _) => {
            let after = if reasoning == Some(true) { tok.markers().think_end } else { None };
            Some(st.compile_grammar(&s.field, &s.spec)?.starting_after(after))
        }
        _ => None,
    };
    let tools = tools.map(|t| (ToolSchemas::from_tools(t), prefix));
    Ok(Plan { prompt, reasoning, tools, constraint })
}

/// The end-of-turn ids: the checkpoint's eos ids plus `<|im_end|>`.
pub(crate) fn chat_stop_ids(tok: &Tokenizer) -> Vec<u32> {
    let mut ids = tok.eos_token_ids().to_vec();
    if let Some(id) = tok.token_id("<|im_end|>").filter(|id| !ids.contains(id)) {
        ids.push(id);
    }
    ids
}

pub async fn chat_completions(State(st): State<AppState>, JsonBody(body): JsonBody) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let req = validate::chat_request(&body, &st.config.sampling_defaults)?;
    st.check_model(req.common.model.as_deref())?;
    let info = st.ready()?;
    let template = st
        .template
        .clone()
        .ok_or_else(|| ApiError::bad_request("This model has no chat template; use /v1/completions."))?;
    let tok = st.tokenizer.clone();
    let st2 = st.clone();
    let (plan, req) = AppState::blocking(move || plan(&st2, &template, &tok, &req).map(|p| (p, req))).await?;
    if plan.prompt.len() >= info.max_context {
        return Err(ApiError::context_length("messages", plan.prompt.len(), info.max_context));
    }
    let room = info.max_context - plan.prompt.len();
    let c = &req.common;
    let run = st.submit(
        GenerateRequest {
            prompt: plan.prompt,
            sampling: c.sampling.clone(),
            max_tokens: c.max_tokens.unwrap_or(room).min(room),
            stop: c.stop.clone(),
            stop_token_ids: chat_stop_ids(&st.tokenizer),
            logprobs: req.logprobs,
            skip_special_tokens: true,
            constraint: plan.constraint,
        },
        arrived,
    )?;
    let reasoning = match plan.reasoning {
        Some(opened) => ReasoningParser::new(opened),
        None => ReasoningParser::disabled(),
    };
    let out = ChatOutput::new(reasoning, plan.tools);
    let meta = Meta::new("chatcmpl-", &st.config.model_id);
    let s = ChatStream {
        st: st.clone(),
        run,
        out,
        meta,
        logprobs: req.logprobs.is_some(),
        include_usage: c.include_usage,
        queue: VecDeque::new(),
        pending_logprobs: Vec::new(),
        ended: false,
    };
    if c.stream { Ok(s.into_sse()) } else { s.collect().await }
}

/// Turns engine events into chat deltas, then into chunks (streaming) or one message.
struct ChatStream {
    st: AppState,
    run: Generation,
    out: ChatOutput,
    meta: Meta,
    logprobs: bool,
    include_usage: bool,
    /// Chunks ready to send.
    queue: VecDeque<Value>,
    /// Logprobs of tokens whose text has not been sent yet.
    pending_logprobs: Vec<TokenLogprob>,
    ended: bool,
}

/// One step of a generation as the client sees it.
enum Step {
    Delta(ChatDelta),
    /// The generation finished: the text released at the end, then why.
    Finished {
        last: ChatDelta,
        reason: FinishReason,
        prompt: usize,
        completion: usize,
    },
    Failed(ApiError),
}

impl ChatStream {
    async fn step(&mut self) -> Step {
        match self.run.next().await {
            Some(Event::Token { text, logprob, .. }) => Step::Delta(self.out.token(&text, logprob)),
            Some(Event::Finished { reason, text, usage }) => {
                let last = self.out.finish(&text);
                Step::Finished {
                    last,
                    reason,
                    prompt: usage.prompt_tokens,
                    completion: usage.completion_tokens,
                }
            }
            Some(Event::Error(m)) => Step::Failed(self.st.engine_error(&m)),
            None => Step::Failed(ApiError::internal("the generation ended without a result")),
        }
    }

    /// `stop`/`length`, or `tool_calls` when the model stopped after calling tools.
    fn finish_reason(&mut self, reason: FinishReason) -> &'static str {
        let r = match reason {
            FinishReason::Stop if self.out.tool_calls() > 0 => "tool_calls",
            r => r.as_str(),
        };
        self.run.record(r);
        r
    }

    fn usage(&self, prompt: usize, completion: usize) -> Value {
        types::usage(prompt, completion, Some(self.out.reasoning_tokens()))
    }

    // ---- streaming ----

    fn into_sse(mut self) -> Response {
        let first = json!({"role": "assistant", "content": ""});
        let c = types::chat_chunk(&self.meta, first, None, Value::Null, self.include_usage);
        self.queue.push_back(c);
        sse_response(futures::stream::unfold(self, |mut s| async move {
            s.next_chunk().await.map(|c| (c, s))
        }))
    }

    async fn next_chunk(&mut self) -> Option<Value> {
        loop {
            if let Some(c) = self.queue.pop_front() {
                return Some(c);
            }
            if self.ended {
                return None;
            }
            match self.step().await {
                Step::Delta(d) => self.queue_delta(d),
                Step::Finished {
                    last,
                    reason,
                    prompt,
                    completion,
                } => {
                    self.ended = true;
                    self.queue_delta(last);
                    let reason = self.finish_reason(reason);
                    let lp = types::chat_logprobs(&self.st.tokenizer, self.logprobs, &std::mem::take(&mut self.pending_logprobs));
                    self.queue
                        .push_back(types::chat_chunk(&self.meta, json!({}), Some(reason), lp, self.include_usage));
                    if self.include_usage {
                        let u = self.usage(prompt, completion);
                        self.queue.push_back(types::usage_chunk(&self.meta, "chat.completion.chunk", u));
                    }
                }
                Step::Failed(e) => {
                    self.ended = true;
                    self.queue.push_back(e.to_json());
                }
            }
        }
    }

    /// Queues the chunks of one delta: text first, then each tool-call update on its own
    /// (a call's id and name, then its argument pieces merged).
    fn queue_delta(&mut self, d: ChatDelta) {
        self.pending_logprobs.extend(d.logprobs.iter().cloned());
        if !d.has_output() {
            return;
        }
        let mut text = Map::new();
        if !d.reasoning.is_empty() {
            text.insert("reasoning_content".into(), Value::from(d.reasoning));
        }
        if !d.content.is_empty() {
            text.insert("content".into(), Value::from(d.content));
        }
        let mut deltas: Vec<Value> = Vec::new();
        if !text.is_empty() {
            deltas.push(Value::Object(text));
        }
        let mut calls: Vec<ToolDelta> = Vec::new();
        for t in d.tool_calls {
            match (calls.last_mut(), t) {
                (Some(ToolDelta::Args { index: i, delta: prev }), ToolDelta::Args { index, delta }) if *i == index => prev.push_str(&delta),
                (_, t) => calls.push(t),
            }
        }
        deltas.extend(calls.iter().map(|t| json!({"tool_calls": [types::tool_call_delta(t)]})));
        for (k, delta) in deltas.into_iter().enumerate() {
            let lp = if k == 0 {
                std::mem::take(&mut self.pending_logprobs)
            } else {
                Vec::new()
            };
            let lp = types::chat_logprobs(&self.st.tokenizer, self.logprobs && !lp.is_empty(), &lp);
            let c = types::chat_chunk(&self.meta, delta, None, lp, self.include_usage);
            self.queue.push_back(c);
        }
    }

    // ---- non-streaming ----

    async fn collect(mut self) -> Result<Response, ApiError> {
        let mut all = ChatDelta::default();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        let (reason, prompt, completion) = loop {
            match self.step().await {
                Step::Delta(d) => absorb(&mut all, &mut calls, d),
                Step::Finished {
                    last,
                    reason,
                    prompt,
                    completion,
                } => {
                    absorb(&mut all, &mut calls, last);
                    break (reason, prompt, completion);
                }
                Step::Failed(e) => return Err(e),
            }
        };
        let reason = self.finish_reason(reason);
        let mut message = json!({"role": "assistant", "content": null});
        if !all.content.is_empty() || calls.is_empty() {
            message["content"] = Value::from(all.content);
        }
        if !all.reasoning.is_empty() {
            message["reasoning_content"] = Value::from(all.reasoning);
        }
        if !calls.is_empty() {
            let calls: Vec<Value> = calls
                .into_iter()
                .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                .collect();
            message["tool_calls"] = Value::Array(calls);
        }
        let lp = types::chat_logprobs(&self.st.tokenizer, self.logprobs, &all.logprobs);
        let usage = self.usage(prompt, completion);
        Ok(axum::Json(types::chat_completion(&self.meta, message, reason, lp, usage)).into_response())
    }
}

fn absorb(all: &mut ChatDelta, calls: &mut Vec<(String, String, String)>, d: ChatDelta) {
    all.reasoning.push_str(&d.reasoning);
    all.content.push_str(&d.content);
    all.logprobs.extend(d.logprobs);
    for t in d.tool_calls {
        match t {
            ToolDelta::Start { id, name, .. } => calls.push((id, name, String::new())),
            ToolDelta::Args { index, delta } => {
                if let Some(c) = calls.get_mut(index) {
                    c.2.push_str(&delta)
                }
            }
        }
    }
}
