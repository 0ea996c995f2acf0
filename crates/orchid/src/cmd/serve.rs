//! `orchid serve`: the OpenAI-compatible HTTP server (see `docs/server.md`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use orchid_engine::ChatTemplate;
use orchid_engine::engine::EngineOptions;
use orchid_server::{AppState, ServerConfig};

use super::common::{Device, PrefixCacheArgs, model_dir, start_engine};

/// Every flag can also be set from the environment (`ORCHID_` + the flag's name in capitals,
/// shown by `--help`); a flag on the command line wins.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Checkpoint folder (default: the bundled model).
    #[arg(long, env = "ORCHID_MODEL")]
    model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, env = "ORCHID_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the log says which).
    #[arg(long, env = "ORCHID_PORT", default_value_t = 8000)]
    port: u16,
    /// The model id clients send and /v1/models lists (default: the checkpoint folder's name).
    #[arg(long, visible_alias = "served-model-name", env = "ORCHID_MODEL_ID")]
    model_id: Option<String>,
    /// Longest prompt + output of one request, in tokens (capped by the model's own limit).
    #[arg(long, visible_alias = "max-model-len", env = "ORCHID_MAX_CONTEXT", default_value_t = 32768)]
    max_context: usize,
    /// Sequences generated concurrently.
    #[arg(long, visible_alias = "max-num-seqs", env = "ORCHID_MAX_SEQS", default_value_t = 16)]
    max_seqs: usize,
    /// Requests that may wait for a free sequence beyond the --max-seqs running ones (0: none
    /// wait); beyond that, 503 with Retry-After.
    #[arg(long, env = "ORCHID_MAX_QUEUE", default_value_t = 64)]
    max_queue: usize,
    /// Prompt tokens of one request an engine step runs: a longer prompt spreads over several
    /// steps, and decoding goes on between them.
    #[arg(long, env = "ORCHID_PREFILL_CHUNK", default_value_t = 512)]
    prefill_chunk: usize,
    /// Prompt tokens an engine step runs over all requests still in their prompt (at least
    /// --prefill-chunk); the decode tokens come on top. Default: 8192 on a GPU of 70 GiB or
    /// more (as vLLM), else 2048.
    #[arg(long, env = "ORCHID_MAX_NUM_BATCHED_TOKENS")]
    max_num_batched_tokens: Option<usize>,
    /// The share of the GPU's total memory orchid may use in all, weights included, in (0, 1]
    /// (CUDA only). The GDN state of --max-seqs sequences must fit in what the weights leave of
    /// it; the KV cache gets the rest, up to --max-seqs full-length sequences.
    #[arg(long, env = "ORCHID_GPU_MEMORY_UTILIZATION", default_value_t = orchid_model::backend::DEFAULT_MEMORY_UTILIZATION, value_parser = utilization)]
    gpu_memory_utilization: f64,
    /// KV cache positions all running requests may hold together, instead of what
    /// --gpu-memory-utilization gives (at least --max-context; on the CPU, default no limit). A
    /// request starts when its prompt + max_tokens fit in the room not promised to running ones.
    #[arg(long, env = "ORCHID_KV_CACHE_TOKENS")]
    kv_cache_tokens: Option<usize>,
    /// Where to run the model.
    #[arg(long, value_enum, env = "ORCHID_DEVICE", default_value_t = Device::Auto)]
    device: Device,
    /// Largest request body, in bytes (413 above).
    #[arg(long, env = "ORCHID_MAX_BODY_BYTES", default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// After SIGINT/SIGTERM, seconds running requests may take to finish before they are
    /// cancelled; the server exits at most one second later, whatever clients do.
    #[arg(long, env = "ORCHID_SHUTDOWN_TIMEOUT", default_value_t = 10.0)]
    shutdown_timeout: f64,
    /// Seconds a client has to send a request's head (also how long an idle keep-alive
    /// connection stays open).
    #[arg(long, env = "ORCHID_HEADER_TIMEOUT", default_value_t = 30.0)]
    header_timeout: f64,
    /// Seconds a client has to send a request's body once the head has arrived (408 after).
    #[arg(long, env = "ORCHID_BODY_TIMEOUT", default_value_t = 60.0)]
    body_timeout: f64,
    /// Connections open at once; more clients wait until one closes (keep it below the
    /// process's file descriptor limit).
    #[arg(long, env = "ORCHID_MAX_CONNECTIONS", default_value_t = 512)]
    max_connections: usize,
    /// Require this key on /v1/* (`Authorization: Bearer KEY`); /health and /metrics stay open.
    /// Default: none.
    #[arg(long, env = "ORCHID_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Origins browsers may call the API from (CORS), comma-separated or repeated; `*` allows
    /// any. Default: none.
    #[arg(long, env = "ORCHID_ALLOWED_ORIGINS", value_delimiter = ',')]
    allowed_origins: Vec<String>,
    #[command(flatten)]
    cache: PrefixCacheArgs,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let dir = model_dir(a.model.as_deref())?;
    let dir = dir.canonicalize().unwrap_or(dir);
    let model_id = match a.model_id.clone() {
        Some(id) => id,
        None => dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "orchid".into()),
    };
    let template = match ChatTemplate::from_dir(&dir) {
        Ok(t) => Some(Arc::new(t)),
        // A template that is there but does not parse is a broken model folder.
        Err(e @ orchid_engine::ChatTemplateError::Syntax(_)) => return Err(super::common::bad_model(e)),
        Err(e) => {
            tracing::warn!("no usable chat template ({e}); /v1/chat/completions will refuse requests");
            None
        }
    };
    let mut opts = EngineOptions {
        max_seqs: a.max_seqs.max(1),
        max_context: a.max_context.max(2),
        prefill_chunk: a.prefill_chunk,
        max_batched_tokens: a.max_num_batched_tokens,
        max_queue: a.max_queue,
        gpu_memory_utilization: a.gpu_memory_utilization,
        kv_cache_tokens: a.kv_cache_tokens,
        ..Default::default()
    };
    a.cache.apply(&mut opts);
    let loaded = start_engine(&dir, a.device, opts)?;
    let mut cfg = ServerConfig::new(model_id);
    cfg.model_path = dir.display().to_string();
    cfg.max_body_bytes = a.max_body_bytes;
    cfg.shutdown_grace = Duration::from_secs_f64(a.shutdown_timeout.max(0.0));
    cfg.sampling_defaults = orchid_engine::defaults::sampling_defaults(&dir);
    cfg.header_timeout = Duration::from_secs_f64(a.header_timeout.max(0.001));
    cfg.body_timeout = Duration::from_secs_f64(a.body_timeout.max(0.001));
    cfg.max_connections = a.max_connections.max(1);
    cfg.api_key = a.api_key.clone().filter(|k| !k.is_empty());
    cfg.allowed_origins = a.allowed_origins.iter().map(|o| o.trim().to_string()).filter(|o| !o.is_empty()).collect();
    let st = AppState::new(loaded.engine, loaded.tokenizer, template, cfg);

    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("orchid-http").build()?;
    let result = rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        orchid_server::serve(listener, st).await
    });
    // Connections still open and preparation threads still running do not hold the exit.
    rt.shutdown_timeout(Duration::from_millis(500));
    result
}

/// `--gpu-memory-utilization`: a number in (0, 1].
fn utilization(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("must be a number in (0, 1], got `{s}`")),
    }
}
