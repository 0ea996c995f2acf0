//! `orchid run "prompt"`: one chat turn (or a raw completion), streamed to stdout.

use anyhow::Result;
use clap::Args;
use orchid_engine::ChatTemplate;
use serde_json::json;

use super::common::{ConversationArgs, stream_to};

#[derive(Args)]
pub struct RunArgs {
    /// The prompt.
    prompt: String,
    /// Feed the prompt as is, without the chat template.
    #[arg(long)]
    raw: bool,
    #[command(flatten)]
    conv: ConversationArgs,
}

pub fn run(a: RunArgs) -> Result<()> {
    let (dir, loaded) = a.conv.start()?;
    let text = if a.raw {
        a.prompt.clone()
    } else {
        let mut messages = a.conv.system_messages();
        messages.push(json!({"role": "user", "content": a.prompt}));
        ChatTemplate::from_dir(&dir).map_err(super::common::bad_model)?.render(&messages, None, true, &a.conv.template_kwargs())?
    };
    let info = loaded.engine.wait_ready().map_err(|f| f.into_anyhow())?;
    let req = a.conv.sampling.request(&dir, loaded.tokenizer.encode(&text, false)?, &loaded.tokenizer);
    let prompt_len = req.prompt.len();
    let display = a.conv.display(&text, a.raw);
    let r = stream_to(&loaded, req, &display, &mut std::io::stdout().lock())?;
    let (n, ttft, secs) = (r.tokens, r.first_token_secs, r.secs);
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
