//! What several subcommands share: locating the model, choosing the device, loading.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use orchid_cpu::CpuBackend;
use orchid_engine::sampling_limits as limits;
use orchid_model::Model;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA when a usable GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// The model folder: the argument, else the small model that ships with orchid.
pub fn model_dir(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = arg {
        if !p.is_dir() {
            bail!("model folder {} does not exist", p.display());
        }
        return Ok(p.to_path_buf());
    }
    default_model_dir().context("no --model given and the bundled model was not found")
}

/// `models/orchid-tiny` in the executable's repository (or a copy of it beside the
/// executable), under $ORCHID_HOME, or in the current folder.
pub fn default_model_dir() -> Option<PathBuf> {
    find_in_repository("models/orchid-tiny", "config.json")
}

/// A folder of the repository's `assets/` (the bundled tokenizers), found like the bundled model.
pub fn bundled_asset(name: &str) -> Option<PathBuf> {
    find_in_repository(&format!("assets/{name}"), "tokenizer.json")
}

/// `rel` under $ORCHID_HOME, under an ancestor of the executable (target/release/orchid or
/// dist/orchid -> the repository root), or under the current folder: the first that holds `file`.
fn find_in_repository(rel: &str, file: &str) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(home) = std::env::var("ORCHID_HOME") {
        candidates.push(PathBuf::from(home).join(rel));
    }
    if let Ok(exe) = std::env::current_exe() {
        for anc in exe.ancestors().skip(1).take(4) {
            candidates.push(anc.join(rel));
        }
    }
    candidates.push(PathBuf::from(rel));
    candidates.into_iter().find(|p| p.join(file).is_file())
}

/// Marks an error about the model folder (tokenizer, chat template) as such: exit code 3.
pub fn bad_model(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::new(orchid_model::LoadError(format!("{e:#}")))
}

/// Loads `dir` onto `backend`, logging what was loaded and how long it took.
fn load_on<B: orchid_model::Backend>(dir: &Path, backend: B) -> Result<Model<B>> {
    let t = std::time::Instant::now();
    let m = orchid_model::load_model(dir, backend)?;
    tracing::info!(
        "loaded {} ({} layers, {:.1} MB of weights) on {} in {:.2}s",
        dir.display(),
        m.config.num_layers(),
        m.weight_bytes as f64 / 1e6,
        m.backend.describe(),
        t.elapsed().as_secs_f64()
    );
    Ok(m)
}

/// Loads `dir` onto the first GPU (weights stay 4-bit in device memory).
pub fn load_cuda(dir: &Path) -> Result<Model<orchid_cuda::CudaBackend>> {
    let m = load_on(dir, orchid_cuda::CudaBackend::new(0, super::env_options::cuda_options())?)?;
    m.backend.gpu().synchronize()?;
    Ok(m)
}

pub fn load_cpu(dir: &Path) -> Result<Model<CpuBackend>> {
    load_on(dir, CpuBackend::new())
}

/// Resolves `auto` (CUDA when a usable GPU, driver and NVRTC are present, else the CPU) and
/// turns a missing GPU into a clear error for `cuda`.
pub fn resolve_device(d: Device) -> Result<Device> {
    match d {
        Device::Cpu => Ok(Device::Cpu),
        Device::Cuda => match orchid_cuda::probe(super::env_options::cuda_options()) {
            Ok(()) => Ok(Device::Cuda),
            Err(why) => bail!("--device cuda: {why}"),
        },
        Device::Auto => Ok(if orchid_cuda::available(super::env_options::cuda_options()) { Device::Cuda } else { Device::Cpu }),
    }
}

/// Tokenizer, chat template and a running engine for `dir` on `device`.
pub struct Loaded {
    pub tokenizer: std::sync::Arc<orchid_engine::Tokenizer>,
    pub engine: orchid_engine::engine::EngineHandle,
}

pub fn start_engine(dir: &Path, device: Device, opts: orchid_engine::engine::EngineOptions) -> Result<Loaded> {
    let opts = orchid_engine::engine::EngineOptions {
        fast_decode: opts.fast_decode && super::env_options::decode_graph(),
        inject_fault: super::env_options::fault(),
        ..opts
    };
    let tokenizer = std::sync::Arc::new(orchid_engine::Tokenizer::from_dir(dir).map_err(bad_model)?);
    let dir2 = dir.to_path_buf();
    let max_seqs = opts.max_seqs;
    let engine = match resolve_device(device)? {
        Device::Cpu | Device::Auto => orchid_engine::engine::spawn(opts, tokenizer.clone(), move || load_cpu(&dir2)),
        // The engine decodes through the CUDA decode graphs (GPU sampling) where the requests
        // allow, and everything else through the op-level path (EngineOptions::fast_decode;
        // ORCHID_DECODE_GRAPH=0 turns it off, see env_options).
        Device::Cuda => orchid_engine::engine::spawn_with(opts, tokenizer.clone(), move || {
            let model = load_cuda(&dir2)?;
            let fast: Box<dyn orchid_model::FastDecode<orchid_cuda::CudaBackend>> =
                Box::new(orchid_cuda::GraphFastDecode::with_max_rows(max_seqs));
            Ok(orchid_engine::engine::LoadedModel { model, fast_decode: Some(fast) })
        }),
    };
    Ok(Loaded { tokenizer, engine })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// The prefix-cache flags of `serve`, `run` and `chat` (docs/prefix-cache.md).
#[derive(clap::Args, Clone, Debug)]
pub struct PrefixCacheArgs {
    /// Reuse the saved state of prompt prefixes seen before (earlier turns, shared system prompts).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub prefix_cache: OnOff,
    /// Memory the prefix cache may hold, in MiB (default: 2048 on the CPU; on CUDA 15% of the
    /// GPU memory budget left after the weights, at most 8192, within what the KV cache leaves).
    #[arg(long)]
    pub prefix_cache_mb: Option<usize>,
}

impl PrefixCacheArgs {
    pub fn apply(&self, opts: &mut orchid_engine::engine::EngineOptions) {
        opts.prefix_cache = self.prefix_cache == OnOff::On;
        opts.prefix_cache_bytes = self.prefix_cache_mb.map(|mb| mb << 20);
    }
}

/// The options `run` and `chat` share: the checkpoint, the system message, thinking on/off, the
/// device and the sampling flags.
#[derive(clap::Args)]
pub struct ConversationArgs {
    /// Checkpoint folder (default: the bundled model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Turn the model's thinking on (the template's `enable_thinking=true`).
    #[arg(long, conflicts_with = "no_think")]
    pub think: bool,
    /// Turn the model's thinking off (the template's `enable_thinking=false`). Without either
    /// flag the checkpoint's chat template decides (the bundled model: off).
    #[arg(long)]
    pub no_think: bool,
    /// Do not print the model's reasoning (by default it goes to stderr, dimmed on a terminal,
    /// apart from the answer on stdout).
    #[arg(long)]
    pub hide_reasoning: bool,
    /// Where to run the model.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub cache: PrefixCacheArgs,
}

impl ConversationArgs {
    /// The checkpoint folder and an engine for one sequence at a time on it.
    pub fn start(&self) -> Result<(PathBuf, Loaded)> {
        let dir = model_dir(self.model.as_deref())?;
        let mut opts = orchid_engine::engine::EngineOptions { max_seqs: 1, max_queue: 1, ..Default::default() };
        self.cache.apply(&mut opts);
        let loaded = start_engine(&dir, self.device, opts)?;
        Ok((dir, loaded))
    }

    /// The chat template's extra arguments.
    pub fn template_kwargs(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut kwargs = serde_json::Map::new();
        if self.think || self.no_think {
            kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(self.think));
        }
        kwargs
    }

    /// The system message as the first chat message, if there is one.
    pub fn system_messages(&self) -> Vec<serde_json::Value> {
        self.system.iter().map(|s| serde_json::json!({"role": "system", "content": s})).collect()
    }
}

/// Sampling flags shared by `run` and `chat`; unset flags fall back to the checkpoint's
/// generation_config.json. The ranges are the HTTP API's (orchid_engine::sampling_limits).
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature, 0 to 2; 0 = greedy.
    #[arg(long, value_parser = limited(limits::TEMPERATURE))]
    pub temperature: Option<f32>,
    /// Sample from the k most likely tokens only (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches p, in (0, 1].
    #[arg(long, value_parser = limited(limits::TOP_P))]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than min_p times the most likely one, 0 to 1.
    #[arg(long, value_parser = limited(limits::MIN_P))]
    pub min_p: Option<f32>,
    /// Divide the logits of tokens already seen (prompt and output) by this, in (0, 10]; 1 = off.
    #[arg(long, value_parser = limited(limits::REPETITION_PENALTY))]
    pub repetition_penalty: Option<f32>,
    /// Subtract this from the logits of tokens already generated, -2 to 2.
    #[arg(long, value_parser = limited(limits::PRESENCE_PENALTY))]
    pub presence_penalty: Option<f32>,
    /// Subtract this times the count of each token already generated, -2 to 2.
    #[arg(long, value_parser = limited(limits::FREQUENCY_PENALTY))]
    pub frequency_penalty: Option<f32>,
    /// Seed of the sampler, for reproducible sampled output.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Greedy decoding (same as --temperature 0).
    #[arg(long)]
    pub greedy: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tokens: u64,
    /// Stop when the output contains this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
}

/// A clap value parser for a sampling flag: a number inside `limit`, with the API's message.
fn limited(limit: limits::Limit) -> impl Fn(&str) -> Result<f32, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let x: f64 = s.trim().parse().map_err(|_| format!("`{}` must be a number, got `{s}`", limit.name))?;
        limit.check(x)
    }
}

impl SamplingArgs {
    /// A request for `prompt` with these flags, stopping at the checkpoint's end-of-turn ids.
    pub fn request(&self, dir: &Path, prompt: Vec<u32>, tokenizer: &orchid_engine::Tokenizer) -> orchid_engine::request::GenerateRequest {
        let mut req = orchid_engine::request::GenerateRequest::new(prompt);
        req.sampling = self.params(dir);
        req.max_tokens = self.max_tokens as usize;
        req.stop = self.stop.clone();
        req.stop_token_ids = tokenizer.eos_token_ids().to_vec();
        req
    }

    pub fn params(&self, dir: &Path) -> orchid_engine::sampling::SamplingParams {
        let mut p = orchid_engine::defaults::sampling_defaults(dir);
        if let Some(x) = self.temperature {
            p.temperature = x;
        }
        if self.greedy {
            p.temperature = 0.0;
        }
        if let Some(x) = self.top_k {
            p.top_k = x;
        }
        if let Some(x) = self.top_p {
            p.top_p = x;
        }
        if let Some(x) = self.min_p {
            p.min_p = x;
        }
        if let Some(x) = self.repetition_penalty {
            p.repetition_penalty = x;
        }
        if let Some(x) = self.presence_penalty {
            p.presence_penalty = x;
        }
        if let Some(x) = self.frequency_penalty {
            p.frequency_penalty = x;
        }
        p.seed = self.seed;
        p
    }
}

/// What one streamed turn produced.
pub struct Streamed {
    pub tokens: usize,
    /// Seconds to the first token, and in all.
    pub first_token_secs: f64,
    pub secs: f64,
    pub reasoning: String,
    pub content: String,
}

/// How a turn's text is shown: the answer on `out`; the reasoning (when the prompt opened it or
/// the model opens it) on stderr, dimmed when stderr is a terminal, or not at all.
pub struct Display {
    /// Parse `<think>…</think>` out of the text (false for raw completions).
    pub parse_reasoning: bool,
    /// The prompt already opened `<think>`.
    pub in_reasoning: bool,
    pub show_reasoning: bool,
}

/// Streams one request's text; returns what was generated.
pub fn stream_to(
    loaded: &Loaded,
    req: orchid_engine::request::GenerateRequest,
    display: &Display,
    out: &mut dyn std::io::Write,
) -> Result<Streamed> {
    use orchid_engine::request::Event;
    use orchid_server::reasoning_parser::{Piece, ReasoningParser};
    use std::io::{IsTerminal, Write};
    let mut parser = if display.parse_reasoning { ReasoningParser::new(display.in_reasoning) } else { ReasoningParser::disabled() };
    let dim = std::io::stderr().is_terminal();
    let mut r = Streamed { tokens: 0, first_token_secs: 0.0, secs: 0.0, reasoning: String::new(), content: String::new() };
    let mut emit = |pieces: Vec<Piece>, r: &mut Streamed| -> Result<()> {
        for p in pieces {
            match p {
                Piece::Content(t) => {
                    out.write_all(t.as_bytes())?;
                    out.flush()?;
                    r.content.push_str(&t);
                }
                Piece::Reasoning(t) => {
                    if display.show_reasoning {
                        let mut err = std::io::stderr().lock();
                        if dim {
                            write!(err, "\x1b[2m{t}\x1b[0m")?;
                        } else {
                            err.write_all(t.as_bytes())?;
                        }
                        err.flush()?;
                    }
                    r.reasoning.push_str(&t);
                }
            }
        }
        Ok(())
    };
    let t0 = std::time::Instant::now();
    let mut first = None;
    let mut rx = loaded.engine.submit(req).map_err(|e| anyhow::anyhow!("{e}"))?;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { text: t, .. } => {
                r.tokens += 1;
                first.get_or_insert(t0.elapsed().as_secs_f64());
                emit(parser.push(&t), &mut r)?;
            }
            Event::Finished { text: t, .. } => {
                let mut pieces = parser.push(&t);
                pieces.extend(parser.finish());
                emit(pieces, &mut r)?;
                break;
            }
            Event::Error(e) => bail!("generation failed: {e}"),
        }
    }
    if display.show_reasoning && !r.reasoning.is_empty() && !r.reasoning.ends_with('\n') {
        eprintln!();
    }
    if let Some(why) = loaded.engine.failure() {
        bail!("generation failed: {why}");
    }
    r.first_token_secs = first.unwrap_or(0.0);
    r.secs = t0.elapsed().as_secs_f64();
    Ok(r)
}

impl ConversationArgs {
    /// How to show a turn whose rendered prompt is `prompt`.
    pub fn display(&self, prompt: &str, raw: bool) -> Display {
        Display {
            parse_reasoning: !raw,
            in_reasoning: !raw && orchid_server::chat_output::prompt_opens_reasoning(prompt),
            show_reasoning: !self.hide_reasoning,
        }
    }
}
