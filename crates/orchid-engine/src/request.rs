//! What a client asks the engine for, and what it gets back.

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
    /// A grammar the output must follow (structured output, forced tool calls).
    pub constraint: Option<Constraint>,
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
            constraint: None,
        }
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

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// Streamed to the client, in order: `Token`s, then exactly one `Finished` or `Error`.
#[derive(Clone, Debug)]
pub enum Event {
    /// A generated token and the text it completes (possibly empty: half a character, or text
    /// held back because it may start a stop string).
    Token { id: u32, text: String, logprob: Option<TokenLogprob> },
    /// Generation ended; `text` is any text released at the end.
    Finished { reason: FinishReason, text: String, usage: Usage },
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
    #[error("the model is still loading")]
    NotReady,
    #[error("the engine has stopped")]
    Stopped,
}
