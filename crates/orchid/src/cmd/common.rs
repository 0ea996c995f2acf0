//! What several subcommands share: locating the model, choosing the device, loading.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use orchid_cpu::CpuBackend;
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

/// `models/orchid-tiny` next to the executable's repository, or under $ORCHID_HOME.
pub fn default_model_dir() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(home) = std::env::var("ORCHID_HOME") {
        candidates.push(PathBuf::from(home).join("models/orchid-tiny"));
    }
    if let Ok(exe) = std::env::current_exe() {
        // target/release/orchid -> repository root
        for anc in exe.ancestors().skip(1).take(4) {
            candidates.push(anc.join("models/orchid-tiny"));
        }
    }
    candidates.push(PathBuf::from("models/orchid-tiny"));
    candidates.into_iter().find(|p| p.join("config.json").is_file())
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
    let m = load_on(dir, orchid_cuda::CudaBackend::new(0)?)?;
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
        Device::Cuda => match orchid_cuda::probe() {
            Ok(()) => Ok(Device::Cuda),
            Err(why) => bail!("--device cuda: {why}"),
        },
        Device::Auto => Ok(if orchid_cuda::available() { Device::Cuda } else { Device::Cpu }),
    }
}

/// Tokenizer, chat template and a running engine for `dir` on `device`.
pub struct Loaded {
    pub tokenizer: std::sync::Arc<orchid_engine::Tokenizer>,
    pub engine: orchid_engine::engine::EngineHandle,
}

pub fn start_engine(dir: &Path, device: Device, opts: orchid_engine::engine::EngineOptions) -> Result<Loaded> {
    let tokenizer = std::sync::Arc::new(orchid_engine::Tokenizer::from_dir(dir).map_err(bad_model)?);
    let dir2 = dir.to_path_buf();
    let engine = match resolve_device(device)? {
        Device::Cpu | Device::Auto => orchid_engine::engine::spawn(opts, tokenizer.clone(), move || load_cpu(&dir2)),
        // The engine decodes a lone sequence through the CUDA decode graph (GPU sampling) and
        // everything else through the op-level path (EngineOptions::fast_decode, ORCHID_DECODE_GRAPH=0).
        Device::Cuda => orchid_engine::engine::spawn_with(opts, tokenizer.clone(), move || {
            let model = load_cuda(&dir2)?;
            let fast: Box<dyn orchid_model::FastDecode<orchid_cuda::CudaBackend>> = Box::new(orchid_cuda::GraphDecoder::new());
            Ok(orchid_engine::engine::LoadedModel { model, fast_decode: Some(fast) })
        }),
    };
    Ok(Loaded { tokenizer, engine })
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
    /// Turn the model's thinking off (the template's `enable_thinking=false`).
    #[arg(long)]
    pub no_think: bool,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

impl ConversationArgs {
    /// The checkpoint folder and an engine for one sequence at a time on it.
    pub fn start(&self) -> Result<(PathBuf, Loaded)> {
        let dir = model_dir(self.model.as_deref())?;
        let opts = orchid_engine::engine::EngineOptions { max_seqs: 1, max_queue: 1, ..Default::default() };
        let loaded = start_engine(&dir, self.device, opts)?;
        Ok((dir, loaded))
    }

    /// The chat template's extra arguments.
    pub fn template_kwargs(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut kwargs = serde_json::Map::new();
        if self.no_think {
            kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(false));
        }
        kwargs
    }

    /// The system message as the first chat message, if there is one.
    pub fn system_messages(&self) -> Vec<serde_json::Value> {
        self.system.iter().map(|s| serde_json::json!({"role": "system", "content": s})).collect()
    }
}

/// Sampling flags shared by `run` and `chat`; unset flags fall back to the checkpoint's
/// generation_config.json.
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Greedy decoding (same as --temperature 0).
    #[arg(long)]
    pub greedy: bool,
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Stop string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    /// A request for `prompt` with these flags, stopping at the checkpoint's end-of-turn ids.
    pub fn request(&self, dir: &Path, prompt: Vec<u32>, tokenizer: &orchid_engine::Tokenizer) -> orchid_engine::request::GenerateRequest {
        let mut req = orchid_engine::request::GenerateRequest::new(prompt);
        req.sampling = self.params(dir);
        req.max_tokens = self.max_tokens;
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

/// Streams one request's text to `out`; returns (generated tokens, seconds to first token, total seconds).
pub fn stream_to(
    loaded: &Loaded,
    req: orchid_engine::request::GenerateRequest,
    out: &mut dyn std::io::Write,
) -> Result<(usize, f64, f64, String)> {
    use orchid_engine::request::Event;
    let t0 = std::time::Instant::now();
    let mut rx = loaded.engine.submit(req).map_err(|e| anyhow::anyhow!("{e}"))?;
    let (mut n, mut first, mut text) = (0usize, None, String::new());
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { text: t, .. } => {
                n += 1;
                first.get_or_insert(t0.elapsed().as_secs_f64());
                out.write_all(t.as_bytes())?;
                out.flush()?;
                text.push_str(&t);
            }
            Event::Finished { text: t, .. } => {
                out.write_all(t.as_bytes())?;
                text.push_str(&t);
                break;
            }
            Event::Error(e) => bail!("generation failed: {e}"),
        }
    }
    if let Some(why) = loaded.engine.failure() {
        bail!("generation failed: {why}");
    }
    Ok((n, first.unwrap_or(0.0), t0.elapsed().as_secs_f64(), text))
}
