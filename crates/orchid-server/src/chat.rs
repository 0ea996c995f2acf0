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
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use orchid_engine::constraint::{Constraint, GrammarSpec};
use orchid_engine::request::{Event, FinishReason, GenerateRequest, StopReason, ThinkingBudget};
use orchid_engine::sampling::TokenLogprob;
use orchid_engine::{ChatTemplate, Tokenizer};
use serde_json::{Map, Value, json};

use crate::body::JsonBody;
use crate::chat_output::{ChatDelta, ChatOutput, ToolDelta, prompt_opens_reasoning};
use crate::errors::ApiError;
use crate::generation::Generation;
use crate::openai::types::{self, Meta};
use crate::openai::validate::{self, ChatRequest, Common, Extras, ToolChoice};
use crate::reasoning_parser::ReasoningParser;
use crate::sse::sse_response;
use crate::state::AppState;
use crate::structured::tool_call_grammar;
use crate::tool_schema::ToolSchemas;

/// A rendered, tokenized chat request.
pub(crate) struct Plan {
    pub prompt: Vec<u32>,
    /// Parse reasoning starting inside `<think>` (the prompt opened it); None: no reasoning.
    pub reasoning: Option<bool>,
    /// Tool schemas and the forced prompt suffix, when calls are parsed.
    pub tools: Option<(ToolSchemas, String)>,
    /// The grammar the output follows (forced tool calls or structured output).
    pub constraint: Option<Constraint>,
}

/// Roles whose text comes from the client (its special tokens are encoded as plain text).
const PLAIN_ROLES: [&str; 3] = ["user", "system", "tool"];

/// Renders the conversation and finds where the texts of user, system and tool messages that
/// spell special tokens ended up in it, so that those tokens can be encoded as plain text.
/// The template is rendered a second time with a placeholder for each such text; the
/// placeholders' positions are exact when putting the texts back (as given, or trimmed as
/// templates often do) reproduces the real rendering. When it does not (a template that
/// transforms the text), no range is returned.
fn render_with_plain_spans(
    template: &ChatTemplate,
    tok: &Tokenizer,
    messages: &[Value],
    tools: Option<&[Value]>,
    add_generation_prompt: bool,
    kwargs: &Map<String, Value>,
) -> Result<(String, Vec<std::ops::Range<usize>>), ApiError> {
    let text = template.render(messages, tools, add_generation_prompt, kwargs)?;
    let marked: Vec<(usize, &str)> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.get("role").and_then(Value::as_str).is_some_and(|r| PLAIN_ROLES.contains(&r)))
        .filter_map(|(i, m)| m.get("content").and_then(Value::as_str).map(|c| (i, c)))
        .filter(|(_, c)| tok.contains_special_text(c))
        .collect();
    if marked.is_empty() {
        return Ok((text, Vec::new()));
    }
    let placeholder = |n: usize| format!("\u{E000}orchid-text-{n}\u{E001}");
    let mut with_placeholders = messages.to_vec();
    for (n, &(i, _)) in marked.iter().enumerate() {
        with_placeholders[i]["content"] = Value::from(placeholder(n));
    }
    let Ok(shape) = template.render(&with_placeholders, tools, add_generation_prompt, kwargs) else {
        return Ok((text, Vec::new()));
    };
    for trim in [false, true] {
        let (mut rebuilt, mut spans, mut at) = (String::with_capacity(text.len()), Vec::new(), 0);
        let mut complete = true;
        for (n, &(_, content)) in marked.iter().enumerate() {
            let p = placeholder(n);
            let Some(i) = shape[at..].find(&p).map(|i| at + i) else {
                complete = false;
                break;
            };
            rebuilt.push_str(&shape[at..i]);
            let c = if trim { content.trim() } else { content };
            spans.push(rebuilt.len()..rebuilt.len() + c.len());
            rebuilt.push_str(c);
            at = i + p.len();
        }
        rebuilt.push_str(&shape[at..]);
        if complete && rebuilt == text {
            return Ok((text, spans));
        }
    }
    tracing::debug!("the chat template transforms message texts; special tokens in them stay special");
    Ok((text, Vec::new()))
}

pub(crate) fn plan(
    st: &AppState,
    template: &ChatTemplate,
    tok: &Tokenizer,
    req: &ChatRequest,
    max_context: usize,
) -> Result<Plan, ApiError> {
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
    let tools = if req.tool_choice == ToolChoice::None { None } else { req.tools.as_deref() };
    let add_prompt = req.add_generation_prompt && !req.continue_final_message;
    let (mut text, plain) = render_with_plain_spans(template, tok, &req.messages, tools, add_prompt, &kwargs)?;
    if req.continue_final_message {
        // Assistant prefill: the prompt ends where the final message's text ends.
        let last = req.messages.last().and_then(|m| m.get("content")).and_then(Value::as_str).unwrap_or("");
        match text.rfind(last).filter(|_| !last.is_empty()) {
            Some(i) => text.truncate(i + last.len()),
            None => {
                return Err(ApiError::invalid(
                    "continue_final_message",
                    "the chat template did not render the final assistant message's text, so it cannot be continued",
                ));
            }
        }
    }
    text.push_str(&prefix);
    let reasoning = if forced { None } else { Some(prompt_opens_reasoning(&text)) };
    let prompt = AppState::encode_prompt(tok, &text, false, &plain, max_context, "messages")?;
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

/// 400 unless every token id a request names (`stop_token_ids`, `logit_bias`) is in the
/// vocabulary.
pub(crate) fn check_extra_ids(x: &Extras, vocab: usize) -> Result<(), ApiError> {
    if let Some((i, id)) = x.stop_token_ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
        return Err(ApiError::invalid(format!("stop_token_ids[{i}]"), format!("token id {id} is outside the vocabulary (size {vocab})")));
    }
    if let Some(id) = x.logit_bias.keys().find(|id| **id as usize >= vocab) {
        return Err(ApiError::invalid(format!("logit_bias.{id}"), format!("token id {id} is outside the vocabulary (size {vocab})")));
    }
    Ok(())
}

/// The engine request for a common request's settings: `end_ids` are the model's own
/// end-of-turn ids (left out with `ignore_eos`); the request's `stop_token_ids` always stop.
pub(crate) fn generate_request(
    c: &Common,
    prompt: Vec<u32>,
    max_tokens: usize,
    end_ids: Vec<u32>,
    logprobs: Option<usize>,
) -> GenerateRequest {
    let x = &c.extras;
    let mut stop_ids = if x.ignore_eos { Vec::new() } else { end_ids };
    stop_ids.extend(x.stop_token_ids.iter().filter(|id| !stop_ids.contains(id)).copied().collect::<Vec<_>>());
    GenerateRequest {
        prompt,
        sampling: c.sampling.clone(),
        max_tokens,
        stop: c.stop.clone(),
        stop_token_ids: stop_ids,
        logprobs,
        skip_special_tokens: x.skip_special_tokens,
        min_tokens: x.min_tokens.min(max_tokens),
        include_stop_str: x.include_stop_str,
        logit_bias: x.logit_bias.clone(),
        thinking: None,
        constraint: None,
    }
}

/// Submits `n` copies of `req` (a seeded request gets seeds seed, seed+1, ... so the choices
/// differ); dropping the result cancels them all.
pub(crate) fn submit_n(st: &AppState, req: GenerateRequest, n: usize, arrived: Instant) -> Result<Vec<Generation>, ApiError> {
    (0..n)
        .map(|i| {
            let mut r = req.clone();
            r.sampling.seed = r.sampling.seed.map(|s| s.wrapping_add(i as u64));
            st.submit(r, arrived)
        })
        .collect()
}

/// `stop_reason` of a choice (vLLM): the stop string or the request's stop token id that ended
/// it; null for the model's own end of turn and for the length limit.
pub(crate) fn stop_reason_value(reason: &Option<StopReason>, c: &Common) -> Value {
    match reason {
        Some(StopReason::Text(s)) => Value::from(s.as_str()),
        Some(StopReason::Token(id)) if c.extras.stop_token_ids.contains(id) => Value::from(*id),
        _ => Value::Null,
    }
}

/// A validated chat request, planned and submitted: one [`ChatRun`] per choice.
pub(crate) async fn start_chat(st: &AppState, req: ChatRequest, arrived: Instant) -> Result<(Vec<ChatRun>, ChatRequest), ApiError> {
    st.check_model(req.common.model.as_deref())?;
    let info = st.ready()?;
    check_extra_ids(&req.common.extras, info.vocab_size)?;
    if req.common.extras.return_token_ids {
        return Err(ApiError::invalid("return_token_ids", "`return_token_ids` is supported on /v1/completions without streaming only"));
    }
    let template = st.template.clone().ok_or_else(|| ApiError::bad_request("This model has no chat template; use /v1/completions."))?;
    let tok = st.tokenizer.clone();
    let max_context = info.max_context;
    let st2 = st.clone();
    let (plan, req) = st.blocking(move || plan(&st2, &template, &tok, &req, max_context).map(|p| (p, req))).await?;
    if plan.prompt.len() >= info.max_context {
        return Err(ApiError::context_length("messages", plan.prompt.len(), info.max_context));
    }
    let room = info.max_context - plan.prompt.len();
    let c = &req.common;
    let mut g = generate_request(c, plan.prompt, c.max_tokens.unwrap_or(room).min(room), chat_stop_ids(&st.tokenizer), req.logprobs);
    if plan.reasoning == Some(true)
        && let (Some(budget), Some(end_token)) = (c.extras.thinking_token_budget, st.tokenizer.token_id("</think>"))
    {
        g.thinking = Some(ThinkingBudget { budget, end_token });
    }
    g.constraint = plan.constraint;
    let runs = submit_n(st, g, c.extras.n, arrived).map_err(|mut e| {
        if e.param.as_deref() == Some("prompt") {
            e.param = Some("messages".into());
        }
        e
    })?;
    let runs = runs
        .into_iter()
        .map(|run| {
            let reasoning = match plan.reasoning {
                Some(opened) => ReasoningParser::new(opened),
                None => ReasoningParser::disabled(),
            };
            let tools = plan.tools.as_ref().map(|(s, f)| (s.clone(), f.clone()));
            ChatRun { st: st.clone(), run, out: ChatOutput::new(reasoning, tools) }
        })
        .collect();
    Ok((runs, req))
}

pub async fn chat_completions(State(st): State<AppState>, JsonBody(body): JsonBody) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    validate::log_unknown_fields("/v1/chat/completions", &body);
    let req = validate::chat_request(&body, &st.config.sampling_defaults)?;
    let (runs, req) = start_chat(&st, req, arrived).await?;
    let meta = Meta::new("chatcmpl-", &st.config.model_id);
    let c = &req.common;
    let totals = Arc::new(Mutex::new(Totals::default()));
    let streams: Vec<ChatStream> = runs
        .into_iter()
        .enumerate()
        .map(|(index, run)| ChatStream {
            run,
            index,
            meta: meta.clone(),
            logprobs: req.logprobs.is_some(),
            include_usage: c.include_usage,
            common: c.clone(),
            totals: totals.clone(),
            queue: VecDeque::new(),
            pending_logprobs: Vec::new(),
            ended: false,
        })
        .collect();
    if c.stream { Ok(into_sse(streams, meta, c.include_usage, totals)) } else { collect(streams, &meta, &totals).await }
}

/// Usage summed over the choices of one response (the prompt counted once).
#[derive(Default)]
pub(crate) struct Totals {
    pub prompt: usize,
    pub cached: usize,
    pub completion: usize,
    pub reasoning: usize,
}

impl Totals {
    pub fn add(&mut self, prompt: usize, cached: usize, completion: usize, reasoning: usize) {
        self.prompt = prompt;
        self.cached = cached;
        self.completion += completion;
        self.reasoning += reasoning;
    }

    pub fn usage(&self) -> Value {
        types::usage(self.prompt, self.cached, self.completion, Some(self.reasoning))
    }

    /// Without the reasoning detail (completions).
    pub fn usage_plain(&self) -> Value {
        types::usage(self.prompt, self.cached, self.completion, None)
    }
}

/// One choice of a chat request as it runs: the engine's events turned into [`ChatDelta`]s.
/// The OpenAI chat endpoint, the Responses API and the Anthropic Messages API all read it.
pub(crate) struct ChatRun {
    st: AppState,
    pub run: Generation,
    pub out: ChatOutput,
}

/// One step of a generation as the client sees it.
pub(crate) enum Step {
    Delta(ChatDelta),
    /// The generation finished: the text released at the end, then why.
    Finished {
        last: ChatDelta,
        reason: FinishReason,
        stop_reason: Option<StopReason>,
        prompt: usize,
        /// Prompt tokens restored from the prefix cache.
        cached: usize,
        completion: usize,
    },
    Failed(ApiError),
}

impl ChatRun {
    pub async fn step(&mut self) -> Step {
        match self.run.next().await {
            Some(Event::Token { text, logprob, .. }) => Step::Delta(self.out.token(&text, logprob)),
            Some(Event::Finished { reason, text, usage, stop_reason }) => {
                let last = self.out.finish(&text);
                Step::Finished {
                    last,
                    reason,
                    stop_reason,
                    prompt: usage.prompt_tokens,
                    cached: usage.cached_tokens,
                    completion: usage.completion_tokens,
                }
            }
            Some(Event::Error(m)) => Step::Failed(self.st.engine_error(&m)),
            None => Step::Failed(ApiError::internal("the generation ended without a result")),
        }
    }

    /// `stop`/`length`, or `tool_calls` when the model stopped after calling tools.
    pub fn finish_reason(&mut self, reason: FinishReason) -> &'static str {
        let r = match reason {
            FinishReason::Stop if self.out.tool_calls() > 0 => "tool_calls",
            r => r.as_str(),
        };
        self.run.record(r);
        r
    }
}

/// One choice of a chat completion: deltas into chunks (streaming) or one message.
struct ChatStream {
    run: ChatRun,
    index: usize,
    meta: Meta,
    logprobs: bool,
    include_usage: bool,
    common: Common,
    totals: Arc<Mutex<Totals>>,
    /// Chunks ready to send.
    queue: VecDeque<Value>,
    /// Logprobs of tokens whose text has not been sent yet.
    pending_logprobs: Vec<TokenLogprob>,
    ended: bool,
}

/// A chunk of choice `index` (`extra`: more fields of the choice, e.g. `stop_reason`).
fn chunk(s: &ChatStream, delta: Value, finish: Option<&str>, logprobs: Value, extra: Option<(&str, Value)>) -> Value {
    let mut c = types::chat_chunk(&s.meta, delta, finish, logprobs, s.include_usage);
    c["choices"][0]["index"] = Value::from(s.index);
    if let Some((k, v)) = extra {
        c["choices"][0][k] = v;
    }
    c
}

/// The streamed response: the choices' chunks as they come (each with its `index`), then the
/// usage chunk when asked for.
fn into_sse(streams: Vec<ChatStream>, meta: Meta, include_usage: bool, totals: Arc<Mutex<Totals>>) -> Response {
    let merged = futures::stream::select_all(streams.into_iter().map(|mut s| {
        let first = json!({"role": "assistant", "content": ""});
        let c = chunk(&s, first, None, Value::Null, None);
        s.queue.push_back(c);
        Box::pin(futures::stream::unfold(s, |mut s| async move { s.next_chunk().await.map(|c| (c, s)) }))
    }));
    let usage =
        futures::stream::once(
            async move { include_usage.then(|| types::usage_chunk(&meta, "chat.completion.chunk", lock(&totals).usage())) },
        )
        .filter_map(futures::future::ready);
    sse_response(merged.chain(usage))
}

fn lock(t: &Mutex<Totals>) -> std::sync::MutexGuard<'_, Totals> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// The non-streamed response: every choice collected, usage summed.
async fn collect(streams: Vec<ChatStream>, meta: &Meta, totals: &Mutex<Totals>) -> Result<Response, ApiError> {
    let choices = futures::future::join_all(streams.into_iter().map(ChatStream::collect)).await;
    let choices = choices.into_iter().collect::<Result<Vec<Value>, ApiError>>()?;
    let mut body = types::chat_completion(meta, Value::Null, "stop", Value::Null, lock(totals).usage());
    body["choices"] = Value::Array(choices);
    Ok(axum::Json(body).into_response())
}

impl ChatStream {
    // ---- streaming ----

    async fn next_chunk(&mut self) -> Option<Value> {
        loop {
            if let Some(c) = self.queue.pop_front() {
                return Some(c);
            }
            if self.ended {
                return None;
            }
            match self.run.step().await {
                Step::Delta(d) => self.queue_delta(d),
                Step::Finished { last, reason, stop_reason, prompt, cached, completion } => {
                    self.ended = true;
                    self.queue_delta(last);
                    let reason = self.run.finish_reason(reason);
                    lock(&self.totals).add(prompt, cached, completion, self.run.out.reasoning_tokens());
                    let lp = types::chat_logprobs(&self.run.st.tokenizer, self.logprobs, &std::mem::take(&mut self.pending_logprobs));
                    let sr = stop_reason_value(&stop_reason, &self.common);
                    let c = chunk(self, json!({}), Some(reason), lp, Some(("stop_reason", sr)));
                    self.queue.push_back(c);
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
            // `reasoning` is vLLM's current name, `reasoning_content` the older one: both.
            text.insert("reasoning".into(), Value::from(d.reasoning.clone()));
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
            let lp = if k == 0 { std::mem::take(&mut self.pending_logprobs) } else { Vec::new() };
            let lp = types::chat_logprobs(&self.run.st.tokenizer, self.logprobs && !lp.is_empty(), &lp);
            let c = chunk(self, delta, None, lp, None);
            self.queue.push_back(c);
        }
    }

    // ---- non-streaming ----

    /// This choice's entry of `choices`.
    async fn collect(mut self) -> Result<Value, ApiError> {
        let mut all = ChatDelta::default();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        let (reason, stop_reason, prompt, cached, completion) = loop {
            match self.run.step().await {
                Step::Delta(d) => absorb(&mut all, &mut calls, d),
                Step::Finished { last, reason, stop_reason, prompt, cached, completion } => {
                    absorb(&mut all, &mut calls, last);
                    break (reason, stop_reason, prompt, cached, completion);
                }
                Step::Failed(e) => return Err(e),
            }
        };
        let reason = self.run.finish_reason(reason);
        lock(&self.totals).add(prompt, cached, completion, self.run.out.reasoning_tokens());
        let message = message_json(all.content, all.reasoning, calls);
        let lp = types::chat_logprobs(&self.run.st.tokenizer, self.logprobs, &all.logprobs);
        Ok(json!({
            "index": self.index, "message": message, "logprobs": lp, "finish_reason": reason,
            "stop_reason": stop_reason_value(&stop_reason, &self.common),
        }))
    }
}

/// The assistant message of a non-streamed choice.
fn message_json(content: String, reasoning: String, calls: Vec<(String, String, String)>) -> Value {
    let mut message = json!({"role": "assistant", "content": null});
    if !content.is_empty() || calls.is_empty() {
        message["content"] = Value::from(content);
    }
    if !reasoning.is_empty() {
        message["reasoning"] = Value::from(reasoning.clone());
        message["reasoning_content"] = Value::from(reasoning);
    }
    if !calls.is_empty() {
        let calls: Vec<Value> = calls
            .into_iter()
            .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    message
}

pub(crate) fn absorb(all: &mut ChatDelta, calls: &mut Vec<(String, String, String)>, d: ChatDelta) {
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
