//! `orchid chat`: an interactive conversation in the terminal (history kept; `/reset` clears).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use orchid_engine::ChatTemplate;
use orchid_engine::engine::EngineOptions;
use serde_json::{Map, Value, json};

use super::common::{Device, SamplingArgs, model_dir, start_engine, stream_to};

#[derive(Args)]
pub struct ChatArgs {
    /// Checkpoint folder (default: the bundled model).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    system: Option<String>,
    /// Turn the model's thinking off.
    #[arg(long)]
    no_think: bool,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    sampling: SamplingArgs,
}

pub fn run(a: ChatArgs) -> Result<()> {
    let dir = model_dir(a.model.as_deref())?;
    let loaded = start_engine(&dir, a.device, EngineOptions { max_seqs: 1, max_queue: 1, ..Default::default() })?;
    let template = ChatTemplate::from_dir(&dir)?;
    loaded.engine.wait_ready().map_err(anyhow::Error::msg)?;
    let mut kwargs = Map::new();
    if a.no_think {
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
    }
    let mut history: Vec<Value> = a.system.iter().map(|s| json!({"role": "system", "content": s})).collect();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!("orchid chat: type a message; /reset clears the history, Ctrl-D quits.");
    loop {
        write!(out, "> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if line == "/reset" {
            history.retain(|m| m["role"] == "system");
            continue;
        }
        history.push(json!({"role": "user", "content": line}));
        let prompt = template.render(&history, None, true, &kwargs)?;
        let req = a.sampling.request(&dir, loaded.tokenizer.encode(&prompt, false)?, &loaded.tokenizer);
        let (_, _, _, text) = stream_to(&loaded, req, &mut out)?;
        writeln!(out)?;
        // Split the reasoning off the answer for the history, as the template expects.
        let (reasoning, content) = match text.split_once("</think>") {
            Some((r, c)) => (r.trim().trim_start_matches("<think>").trim().to_string(), c.trim().to_string()),
            None => (String::new(), text.trim().to_string()),
        };
        history.push(json!({"role": "assistant", "content": content, "reasoning_content": reasoning}));
    }
    loaded.engine.shutdown(false);
    Ok(())
}
