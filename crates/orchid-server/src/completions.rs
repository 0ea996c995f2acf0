//! `POST /v1/completions`: a raw prompt (text or token ids), continued until an eos token,
//! a stop string or `max_tokens` (default 16, as OpenAI). No template, no parsing; an output
//! constraint (`response_format`, `structured_outputs`, `guided_*`) applies from the start.

use std::collections::VecDeque;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use orchid_engine::request::{Event, GenerateRequest};
use orchid_engine::sampling::TokenLogprob;
use serde_json::Value;

use crate::body::JsonBody;
use crate::errors::ApiError;
use crate::generation::Generation;
use crate::openai::types::{self, Meta};
use crate::openai::validate::{self, Prompt};
use crate::sse::sse_response;
use crate::state::AppState;

pub async fn completions(State(st): State<AppState>, JsonBody(body): JsonBody) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let req = validate::completion_request(&body, &st.config.sampling_defaults)?;
    st.check_model(req.common.model.as_deref())?;
    let info = st.ready()?;
    let tok = st.tokenizer.clone();
    let prompt = req.prompt.clone();
    let (st2, structured) = (st.clone(), req.structured.clone());
    let (ids, prompt_text, constraint) = AppState::blocking(move || {
        let constraint = structured.map(|s| st2.compile_grammar(&s.field, &s.spec)).transpose()?;
        match prompt {
            Prompt::Text(t) => {
                let ids = tok
                    .encode(&t, true)
                    .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e:#}")))?;
                Ok((ids, t, constraint))
            }
            Prompt::Tokens(ids) => {
                let text = tok.decode(&ids, false);
                Ok((ids, text, constraint))
            }
        }
    })
    .await?;
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= info.vocab_size) {
        return Err(ApiError::invalid(
            "prompt",
            format!("token id {bad} is outside the vocabulary (size {})", info.vocab_size),
        ));
    }
    if ids.len() >= info.max_context {
        return Err(ApiError::context_length("prompt", ids.len(), info.max_context));
    }
    let room = info.max_context - ids.len();
    let c = &req.common;
    let run = st.submit(
        GenerateRequest {
            prompt: ids,
            sampling: c.sampling.clone(),
            max_tokens: c.max_tokens.unwrap_or(16).min(room),
            stop: c.stop.clone(),
            stop_token_ids: st.tokenizer.eos_token_ids().to_vec(),
            logprobs: req.logprobs,
            skip_special_tokens: true,
            constraint,
        },
        arrived,
    )?;
    let echo = if req.echo { prompt_text } else { String::new() };
    let s = CompletionStream {
        meta: Meta::new("cmpl-", &st.config.model_id),
        st,
        run,
        logprobs: req.logprobs.is_some(),
        include_usage: c.include_usage,
        offset: echo.len(),
        echo,
        pending_logprobs: Vec::new(),
        queue: VecDeque::new(),
        ended: false,
    };
    if c.stream { Ok(s.into_sse()) } else { s.collect().await }
}

struct CompletionStream {
    st: AppState,
    run: Generation,
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
        types::completion(&self.meta, text, finish, lp, usage)
    }

    fn into_sse(mut self) -> Response {
        if !self.echo.is_empty() {
            let echo = std::mem::take(&mut self.echo);
            self.offset = 0;
            let c = self.text_chunk(&echo, None);
            self.queue.push_back(c);
        }
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
            match self.run.next().await {
                Some(Event::Token { text, logprob, .. }) => {
                    self.pending_logprobs.extend(logprob);
                    if !text.is_empty() {
                        let c = self.text_chunk(&text, None);
                        self.queue.push_back(c);
                    }
                }
                Some(Event::Finished { reason, text, usage }) => {
                    self.ended = true;
                    self.run.record(reason.as_str());
                    let c = self.text_chunk(&text, Some(reason.as_str()));
                    self.queue.push_back(c);
                    if self.include_usage {
                        let u = types::usage(usage.prompt_tokens, usage.completion_tokens, None);
                        self.queue.push_back(types::usage_chunk(&self.meta, "text_completion", u));
                    }
                }
                Some(Event::Error(m)) => {
                    self.ended = true;
                    self.queue.push_back(self.st.engine_error(&m).to_json());
                }
                None => self.ended = true,
            }
        }
    }

    async fn collect(mut self) -> Result<Response, ApiError> {
        let mut text = std::mem::take(&mut self.echo);
        let mut lps = Vec::new();
        loop {
            match self.run.next().await {
                Some(Event::Token { text: t, logprob, .. }) => {
                    text.push_str(&t);
                    lps.extend(logprob);
                }
                Some(Event::Finished { reason, text: t, usage }) => {
                    text.push_str(&t);
                    self.run.record(reason.as_str());
                    self.pending_logprobs = lps;
                    let lp = self.logprobs_value();
                    let u = types::usage(usage.prompt_tokens, usage.completion_tokens, None);
                    let body = types::completion(&self.meta, &text, Some(reason.as_str()), lp, Some(u));
                    return Ok(axum::Json(body).into_response());
                }
                Some(Event::Error(m)) => return Err(self.st.engine_error(&m)),
                None => return Err(ApiError::internal("the generation ended without a result")),
            }
        }
    }
}
