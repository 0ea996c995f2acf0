//! `orchid run "prompt"`: one chat turn (or a raw completion), streamed to stdout.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use orchid_engine::ChatTemplate;
use orchid_engine::engine::EngineOptions;
use serde_json::{Map, Value, json};

use super::common::{Device, SamplingArgs, model_dir, start_engine, stream_to};

#[derive(Args)]
pub struct RunArgs {
    /// The prompt.
    prompt: String,
    /// Checkpoint folder (default: the bundled model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Feed the prompt as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// A system message.
    #[arg(long)]
    system: Option<String>,
    /// Turn the model's thinking off (the template's `enable_thinking=false`).
    #[arg(long)]
    no_think: bool,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    sampling: SamplingArgs,
}

pub fn run(a: RunArgs) -> Result<()> {
    let dir = model_dir(a.model.as_deref())?;
    let loaded = start_engine(&dir, a.device, EngineOptions { max_seqs: 1, max_queue: 1, ..Default::default() })?;
    let text = if a.raw {
        a.prompt.clone()
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.push(json!({"role": "user", "content": a.prompt}));
        let mut kwargs = Map::new();
        if a.no_think {
            kwargs.insert("enable_thinking".into(), Value::Bool(false));
        }
        ChatTemplate::from_dir(&dir)?.render(&messages, None, true, &kwargs)?
    };
    let info = loaded.engine.wait_ready().map_err(anyhow::Error::msg)?;
    let req = a.sampling.request(&dir, loaded.tokenizer.encode(&text, false)?, &loaded.tokenizer);
    let prompt_len = req.prompt.len();
    let (n, ttft, secs, _) = stream_to(&loaded, req, &mut std::io::stdout().lock())?;
    println!();
    tracing::info!(
        "{prompt_len} prompt tokens, {n} generated; first token after {:.3}s, {:.1} tok/s decode on {}",
        ttft,
        (n.saturating_sub(1)) as f64 / (secs - ttft).max(1e-9),
        info.device
    );
    loaded.engine.shutdown(false);
    Ok(())
}
