//! What every handler shares: the engine handle, tokenizer, chat template, configuration,
//! metrics and the shutdown flag.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use orchid_engine::constraint::{Constraint, Grammars};
use orchid_engine::engine::{EngineHandle, ModelInfo};
use orchid_engine::request::GenerateRequest;
use orchid_engine::sampling::SamplingParams;
use orchid_engine::{ChatTemplate, Tokenizer};

use crate::errors::ApiError;
use crate::generation::Generation;
use crate::metrics::Metrics;

/// Server settings (the engine's own live in its `EngineOptions`).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The id clients use in `model` and `/v1/models` lists.
    pub model_id: String,
    /// Where the checkpoint was loaded from (for logs).
    pub model_path: String,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// After SIGINT/SIGTERM, how long running requests may finish before they are cancelled.
    pub shutdown_grace: Duration,
    /// Sampling for fields a request leaves unset (normally the checkpoint's
    /// generation_config.json, as vLLM does).
    pub sampling_defaults: SamplingParams,
    /// Time a client has to send a request head (also the idle keep-alive timeout).
    pub header_timeout: Duration,
    /// Time a client has to send a request body once the head has arrived (408 after).
    pub body_timeout: Duration,
    /// Connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>` (or `x-api-key: <key>`).
    pub api_key: Option<String>,
    /// Origins browsers may call the API from (CORS); empty: none; `*`: any.
    pub allowed_origins: Vec<String>,
    /// Prompts tokenized at once (tokenizing is CPU-bound and runs off the async workers).
    pub tokenize_concurrency: usize,
}

impl ServerConfig {
    pub fn new(model_id: impl Into<String>) -> ServerConfig {
        ServerConfig {
            model_id: model_id.into(),
            model_path: String::new(),
            max_body_bytes: 8 << 20,
            shutdown_grace: Duration::from_secs(10),
            sampling_defaults: SamplingParams::default(),
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            max_connections: 512,
            api_key: None,
            allowed_origins: Vec::new(),
            tokenize_concurrency: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// Cheap to clone; one per server.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

pub struct Inner {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    /// None when the checkpoint has no chat template (chat requests are then refused).
    pub template: Option<Arc<ChatTemplate>>,
    pub config: ServerConfig,
    pub metrics: Metrics,
    /// Permits for request preparation (template rendering, tokenizing).
    prepare_permits: Arc<tokio::sync::Semaphore>,
    shutting_down: AtomicBool,
    /// Unix time the server started (`created` of the model object).
    pub started: u64,
    /// The grammar compiler for this tokenizer, built on first use.
    grammars: OnceLock<Result<Grammars, String>>,
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    pub fn new(engine: EngineHandle, tokenizer: Arc<Tokenizer>, template: Option<Arc<ChatTemplate>>, config: ServerConfig) -> AppState {
        AppState(Arc::new(Inner {
            engine,
            tokenizer,
            template,
            metrics: Metrics::default(),
            prepare_permits: Arc::new(tokio::sync::Semaphore::new(config.tokenize_concurrency.max(1))),
            config,
            shutting_down: AtomicBool::new(false),
            started: crate::openai::unix_now(),
            grammars: OnceLock::new(),
        }))
    }

    /// New requests are refused from now on (503).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// 404 unless `model` (when given) is the served one.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.config.model_id => Err(ApiError::unknown_model(m, &self.config.model_id)),
            _ => Ok(()),
        }
    }

    /// Encodes a prompt text of a request limited to `max_context` tokens, refusing a text that
    /// cannot fit on cheap bounds before paying for the whole encoding: first its length in
    /// bytes against the longest token, then (for long texts) a count over pieces that stops
    /// as soon as the limit is passed. `plain`: byte ranges whose special tokens are plain text
    /// (see [`Tokenizer::encode_with_plain`]). Runs on a blocking thread.
    pub fn encode_prompt(
        tok: &Tokenizer,
        text: &str,
        add_special: bool,
        plain: &[std::ops::Range<usize>],
        max_context: usize,
        param: &str,
    ) -> Result<Vec<u32>, ApiError> {
        let fail = |e: anyhow::Error| ApiError::internal(format!("tokenizing the prompt failed: {e:#}"));
        // Normalization can change byte counts a little; a factor of 2 keeps the bound safe.
        let at_least = text.len() / (2 * tok.longest_token_bytes());
        if at_least >= max_context {
            return Err(ApiError::context_length_over(param, at_least, max_context));
        }
        const PIECE: usize = 64 << 10;
        if text.len() > 4 * PIECE {
            let (mut count, mut pieces, mut at) = (0usize, 0usize, 0usize);
            while at < text.len() {
                let mut end = (at + PIECE).min(text.len());
                while !text.is_char_boundary(end) {
                    end += 1;
                }
                // Cut after whitespace where there is some nearby, so pieces split as words do.
                if end < text.len()
                    && let Some(ws) = text[at..end].rfind(char::is_whitespace).filter(|&i| i > PIECE / 2)
                {
                    end = at + ws;
                }
                count += tok.encode(&text[at..end], false).map_err(fail)?.len();
                pieces += 1;
                at = end;
                // A cut can change the count by a token or two; allow for it.
                if count >= max_context + 2 * pieces {
                    return Err(ApiError::context_length_over(param, count - 2 * pieces, max_context));
                }
            }
        }
        let ids = if add_special { tok.encode(text, true) } else { tok.encode_with_plain(text, plain) }.map_err(fail)?;
        if ids.len() >= max_context {
            return Err(ApiError::context_length(param, ids.len(), max_context));
        }
        Ok(ids)
    }

    /// The loaded model's facts, or 503 while loading / shutting down.
    pub fn ready(&self) -> Result<ModelInfo, ApiError> {
        if self.is_shutting_down() {
            return Err(ApiError::unavailable("The server is shutting down."));
        }
        self.engine.info().ok_or_else(|| ApiError::unavailable("The model is still loading."))
    }

    /// Queues a generation; `arrived` is when the HTTP request came in (for latency metrics).
    pub fn submit(&self, req: GenerateRequest, arrived: Instant) -> Result<Generation, ApiError> {
        if self.is_shutting_down() {
            return Err(ApiError::unavailable("The server is shutting down."));
        }
        let prompt_tokens = req.prompt.len();
        let rx = self.engine.submit(req)?;
        Ok(Generation::new(rx, self.clone(), arrived, prompt_tokens))
    }

    /// The error for a generation the engine ended with `Event::Error`.
    pub fn engine_error(&self, message: &str) -> ApiError {
        if self.is_shutting_down() {
            ApiError::unavailable(format!("The server is shutting down: {message}"))
        } else {
            ApiError::internal(message)
        }
    }

    /// Compiles a grammar for a request (call it off the async workers: the first call builds
    /// the token trie). A grammar that does not compile is a 400 naming `field`.
    pub fn compile_grammar(&self, field: &str, spec: &orchid_engine::constraint::GrammarSpec) -> Result<Constraint, ApiError> {
        let g = self.grammars.get_or_init(|| {
            Grammars::new(self.tokenizer.clone(), &crate::chat::chat_stop_ids(&self.tokenizer)).map_err(|e| format!("{e:#}"))
        });
        let g = g.as_ref().map_err(|e| ApiError::invalid(field, format!("constrained decoding is not available: {e}")))?;
        g.compile(spec).map_err(|e| ApiError::invalid(field, format!("`{field}` cannot be compiled: {e}")))
    }

    /// Runs CPU-bound request preparation (template rendering, tokenizing) off the async
    /// workers, at most `tokenize_concurrency` at once; a panic there becomes a 500.
    pub async fn blocking<T: Send + 'static>(&self, f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
        let permit =
            self.prepare_permits.clone().acquire_owned().await.map_err(|_| ApiError::unavailable("The server is shutting down."))?;
        let run = move || {
            let r = f();
            drop(permit);
            r
        };
        match tokio::task::spawn_blocking(run).await {
            Ok(r) => r,
            Err(e) if e.is_panic() => Err(ApiError::from_panic(e.into_panic().as_ref())),
            Err(e) => Err(ApiError::internal(format!("request preparation failed: {e}"))),
        }
    }
}
