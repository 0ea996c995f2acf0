//! orchid-server: the OpenAI-compatible HTTP surface over an [`EngineHandle`].
//!
//! - [`routes`]: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//!   `GET /health`, `GET /metrics`, and the error fallbacks.
//! - [`chat`], [`completions`]: the two generation endpoints (streaming and not).
//! - [`openai`]: request validation and the response objects.
//! - [`reasoning_parser`], [`tool_parser`], [`tool_schema`], [`chat_output`]: turning the
//!   model's text into `reasoning_content`, `content` and `tool_calls`, incrementally.
//! - [`responses`] (`POST /v1/responses`, the OpenAI Responses API) and [`anthropic`]
//!   (`POST /v1/messages`, the Anthropic Messages API): other wire formats over the chat
//!   pipeline; [`tokenize`] (`/tokenize`, `/detokenize`).
//! - [`access_log`] (request ids, one log line per request), [`vllm_metrics`] (vLLM's metric
//!   names beside orchid's own).
//! - [`structured`]: `response_format` / `structured_outputs` / `guided_*` and the forced
//!   tool-call grammar (constrained decoding with llguidance).
//! - [`sse`], [`metrics`], [`errors`] (the one place errors become responses), [`server`]
//!   (listening and clean shutdown).
//!
//! The server never sees the backend: it takes an [`EngineHandle`] that owns the model on its
//! own thread.
//!
//! ```ignore
//! let engine = orchid_engine::engine::spawn::<B, _>(opts, tokenizer.clone(), move || load());
//! let st = AppState::new(engine, tokenizer, Some(Arc::new(template)), ServerConfig::new("my-model"));
//! orchid_server::serve(tokio::net::TcpListener::bind("127.0.0.1:8000").await?, st).await?;
//! ```
//!
//! [`EngineHandle`]: orchid_engine::engine::EngineHandle

pub mod access_log;
pub mod anthropic;
pub mod blocks;
pub mod body;
pub mod chat;
pub mod chat_output;
pub mod completions;
pub mod errors;
pub mod generation;
pub mod metrics;
pub mod openai;
pub mod reasoning_parser;
pub mod responses;
pub mod routes;
pub mod server;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tokenize;
pub mod tool_parser;
pub mod tool_schema;
pub mod vllm_metrics;

pub use errors::ApiError;
pub use routes::router;
pub use server::{serve, serve_with_shutdown};
pub use state::{AppState, ServerConfig};
