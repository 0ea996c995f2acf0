//! What a client asks the engine for, and what it gets back.

use std::collections::HashMap;

use crate::constraint::Constraint;
use crate::sampling::{SamplingParams, TokenLogprob};

/// One generation request, already tokenized.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Upper bound on generated tokens (the engine also stops at the context limit).
    pub max_tokens: usize,
    /// Stop strings: generation ends before them; they are never emitted.
    pub stop: Vec<String>,
    /// Token ids that end generation (normally the checkpoint's end-of-turn ids).
    pub stop_token_ids: Vec<u32>,
    /// `Some(n)`: report the chosen token's log-probability and the n most likely tokens.
    pub logprobs: Option<usize>,
    /// Leave special tokens (e.g. `<think>`) out of the text.
    pub skip_special_tokens: bool,
    /// The stop token ids cannot be sampled before this many tokens were generated.
    pub min_tokens: usize,
    /// A matched stop string is part of the text (it still ends generation).
    pub include_stop_str: bool,
    /// Added to the logits of these token ids before sampling (OpenAI `logit_bias`).
    pub logit_bias: HashMap<u32, f32>,
    /// Bounded reasoning: see [`ThinkingBudget`].
    pub thinking: Option<ThinkingBudget>,
    /// A grammar the output must follow (structured output, forced tool calls).
    pub constraint: Option<Constraint>,
}

/// A reasoning budget: the prompt leaves the model inside `<think>`; once `budget` tokens were
/// generated without `end_token` (`</think>`), `end_token` is forced as the next token (not
/// sampled), so the model goes on with its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThinkingBudget {
    pub budget: usize,
    pub end_token: u32,
}

impl GenerateRequest {
    pub fn new(prompt: Vec<u32>) -> GenerateRequest {
        GenerateRequest {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            logprobs: None,
            skip_special_tokens: false,
            min_tokens: 0,
            include_stop_str: false,
            logit_bias: HashMap::new(),
            thinking: None,
            constraint: None,
        }
    }
}

impl Default for GenerateRequest {
    fn default() -> Self {
        GenerateRequest::new(Vec::new())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// max_tokens or the context limit.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What ended a generation with [`FinishReason::Stop`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// One of the request's `stop_token_ids`.
    Token(u32),
    /// One of the request's stop strings.
    Text(String),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens restored from the prefix cache (not prefilled).
    pub cached_tokens: usize,
}

/// Streamed to the client, in order: `Token`s, then exactly one `Finished` or `Error`.
#[derive(Clone, Debug)]
pub enum Event {
    /// A generated token and the text it completes (possibly empty: half a character, or text
    /// held back because it may start a stop string).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// Generation ended; `text` is any text released at the end; `stop_reason` is what
    /// stopped it (None at the length limit).
    Finished {
        reason: FinishReason,
        text: String,
        usage: Usage,
        stop_reason: Option<StopReason>,
    },
    Error(String),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full")]
    QueueFull,
    #[error("the prompt has {prompt} tokens but the context holds {max}")]
    ContextLength { prompt: usize, max: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    InvalidToken { id: u32, vocab: usize },
    #[error("the model is still loading")]
    NotReady,
    #[error("the engine has stopped")]
    Stopped,
}
