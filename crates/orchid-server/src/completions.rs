//! `POST /v1/completions`: a raw prompt (text or token ids), continued until an eos token,
//! a stop string or `max_tokens` (default 16, as OpenAI). No template, no parsing; an output
//! constraint (`response_format`, `structured_outputs`, `guided_*`) applies from the start.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use orchid_engine::request::Event;
use orchid_engine::sampling::TokenLogprob;
use serde_json::{Value, json};

use crate::body::JsonBody;
use crate::chat::{Totals, check_extra_ids, generate_request, stop_reason_value, submit_n};
use crate::errors::ApiError;
use crate::generation::Generation;
use crate::openai::types::{self, Meta};
use crate::openai::validate::{self, Common, Prompt};
use crate::sse::sse_response;
use crate::state::AppState;

pub async fn completions(State(st): State<AppState>, JsonBody(body): JsonBody) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    validate::log_unknown_fields("/v1/completions", &body);
    let req = validate::completion_request(&body, &st.config.sampling_defaults)?;
    st.check_model(req.common.model.as_deref())?;
    let info = st.ready()?;
    let tok = st.tokenizer.clone();
    let prompt = req.prompt.clone();
    let max_context = info.max_context;
    let (st2, structured, echo) = (st.clone(), req.structured.clone(), req.echo);
    let (ids, prompt_text, constraint) = st
        .blocking(move || {
            let constraint = structured.map(|s| st2.compile_grammar(&s.field, &s.spec)).transpose()?;
            match prompt {
                Prompt::Text(t) => {
                    let ids = AppState::encode_prompt(&tok, &t, true, &[], max_context, "prompt")?;
                    Ok((ids, t, constraint))
                }
                // The text of a token-id prompt is only needed to echo it (decoding 10K tokens
                // takes milliseconds, which every request's first token would wait for).
                Prompt::Tokens(ids) => {
                    let text = if echo { tok.decode(&ids, false) } else { String::new() };
                    Ok((ids, text, constraint))
                }
            }
        })
        .await?;
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= info.vocab_size) {
        return Err(ApiError::invalid("prompt", format!("token id {bad} is outside the vocabulary (size {})", info.vocab_size)));
    }
    if ids.len() >= info.max_context {
        return Err(ApiError::context_length("prompt", ids.len(), info.max_context));
    }
    check_extra_ids(&req.common.extras, info.vocab_size)?;
    if req.common.extras.return_token_ids && req.common.stream {
        return Err(ApiError::invalid("return_token_ids", "`return_token_ids` is supported without streaming only"));
    }
    let room = info.max_context - ids.len();
    let c = &req.common;
    let mut g = generate_request(c, ids, c.max_tokens.unwrap_or(16).min(room), st.tokenizer.eos_token_ids().to_vec(), req.logprobs);
    g.constraint = constraint;
    let runs = submit_n(&st, g, c.extras.n, arrived)?;
    let echo = if req.echo { prompt_text } else { String::new() };
    let meta = Meta::new("cmpl-", &st.config.model_id);
    let totals = Arc::new(Mutex::new(Totals::default()));
    let streams: Vec<CompletionStream> = runs
        .into_iter()
        .enumerate()
        .map(|(index, run)| CompletionStream {
            meta: meta.clone(),
            st: st.clone(),
            run,
            index,
            common: c.clone(),
            totals: totals.clone(),
            logprobs: req.logprobs.is_some(),
            include_usage: c.include_usage,
            offset: echo.len(),
            echo: echo.clone(),
            pending_logprobs: Vec::new(),
            queue: VecDeque::new(),
            ended: false,
        })
        .collect();
    if c.stream {
        let include_usage = c.include_usage;
        let merged = futures::stream::select_all(streams.into_iter().map(|s| Box::pin(s.into_stream())));
        let usage = futures::stream::once(async move {
            include_usage.then(|| types::usage_chunk(&meta, "text_completion", lock(&totals).usage_plain()))
        })
        .filter_map(futures::future::ready);
        Ok(sse_response(merged.chain(usage)))
    } else {
        let choices = futures::future::join_all(streams.into_iter().map(CompletionStream::collect)).await;
        let choices = choices.into_iter().collect::<Result<Vec<Value>, ApiError>>()?;
        let mut body = types::completion(&meta, "", None, Value::Null, Some(lock(&totals).usage_plain()));
        body["choices"] = Value::Array(choices);
        Ok(axum::Json(body).into_response())
    }
}

fn lock(t: &Mutex<Totals>) -> std::sync::MutexGuard<'_, Totals> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// One choice of a completion.
struct CompletionStream {
    st: AppState,
    run: Generation,
    index: usize,
    common: Common,
    totals: Arc<Mutex<Totals>>,
    meta: Meta,
    logprobs: bool,
    include_usage: bool,
    /// The prompt text when `echo` (sent first), else empty.
    echo: String,
    /// Length of the text sent so far (for `text_offset`).
    offset: usize,
    pending_logprobs: Vec<TokenLogprob>,
    queue: VecDeque<Value>,
    ended: bool,
}

impl CompletionStream {
    fn logprobs_value(&mut self) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let lps = std::mem::take(&mut self.pending_logprobs);
        types::completion_logprobs(&self.st.tokenizer, &lps, self.offset)
    }

    /// A chunk for `text` carrying the logprobs of the tokens that produced it.
    fn text_chunk(&mut self, text: &str, finish: Option<&str>) -> Value {
        let lp = self.logprobs_value();
        self.offset += text.len();
        let usage = self.include_usage.then_some(Value::Null);
        let mut c = types::completion(&self.meta, text, finish, lp, usage);
        c["choices"][0]["index"] = Value::from(self.index);
        c
    }

    fn into_stream(mut self) -> impl futures::Stream<Item = Value> + Send {
        if !self.echo.is_empty() {
            let echo = std::mem::take(&mut self.echo);
            self.offset = 0;
            let c = self.text_chunk(&echo, None);
            self.queue.push_back(c);
        }
        futures::stream::unfold(self, |mut s| async move { s.next_chunk().await.map(|c| (c, s)) })
    }

    async fn next_chunk(&mut self) -> Option<Value> {
        loop {
            if let Some(c) = self.queue.pop_front() {
                return Some(c);
            }
            if self.ended {
                return None;
            }
            match self.run.next().await {
                Some(Event::Token { text, logprob, .. }) => {
                    self.pending_logprobs.extend(logprob);
                    if !text.is_empty() {
                        let c = self.text_chunk(&text, None);
                        self.queue.push_back(c);
                    }
                }
                Some(Event::Finished { reason, text, usage, stop_reason }) => {
                    self.ended = true;
                    self.run.record(reason.as_str());
                    lock(&self.totals).add(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, 0);
                    let mut c = self.text_chunk(&text, Some(reason.as_str()));
                    c["choices"][0]["stop_reason"] = stop_reason_value(&stop_reason, &self.common);
                    self.queue.push_back(c);
                }
                Some(Event::Error(m)) => {
                    self.ended = true;
                    self.queue.push_back(self.st.engine_error(&m).to_json());
                }
                None => self.ended = true,
            }
        }
    }

    /// This choice's entry of `choices`.
    async fn collect(mut self) -> Result<Value, ApiError> {
        let mut text = std::mem::take(&mut self.echo);
        let (mut lps, mut ids) = (Vec::new(), Vec::new());
        loop {
            match self.run.next().await {
                Some(Event::Token { id, text: t, logprob }) => {
                    text.push_str(&t);
                    lps.extend(logprob);
                    ids.push(id);
                }
                Some(Event::Finished { reason, text: t, usage, stop_reason }) => {
                    text.push_str(&t);
                    self.run.record(reason.as_str());
                    lock(&self.totals).add(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, 0);
                    self.pending_logprobs = lps;
                    let lp = self.logprobs_value();
                    let mut choice = json!({
                        "index": self.index, "text": text, "logprobs": lp, "finish_reason": reason.as_str(),
                        "stop_reason": stop_reason_value(&stop_reason, &self.common),
                    });
                    if self.common.extras.return_token_ids {
                        choice["token_ids"] = json!(ids);
                    }
                    return Ok(choice);
                }
                Some(Event::Error(m)) => return Err(self.st.engine_error(&m)),
                None => return Err(ApiError::internal("the generation ended without a result")),
            }
        }
    }
}
