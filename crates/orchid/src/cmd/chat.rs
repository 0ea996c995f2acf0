//! `orchid chat`: an interactive conversation in the terminal (history kept; `/reset` clears).

use std::io::{BufRead, Write};

use anyhow::Result;
use clap::Args;
use orchid_engine::ChatTemplate;
use serde_json::{Value, json};

use super::common::{ConversationArgs, stream_to};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    conv: ConversationArgs,
}

pub fn run(a: ChatArgs) -> Result<()> {
    let (dir, loaded) = a.conv.start()?;
    let template = ChatTemplate::from_dir(&dir).map_err(super::common::bad_model)?;
    loaded.engine.wait_ready().map_err(|f| f.into_anyhow())?;
    let kwargs = a.conv.template_kwargs();
    let mut history: Vec<Value> = a.conv.system_messages();
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
        let req = a.conv.sampling.request(&dir, loaded.tokenizer.encode(&prompt, false)?, &loaded.tokenizer);
        let r = stream_to(&loaded, req, &a.conv.display(&prompt, false), &mut out)?;
        writeln!(out)?;
        // The reasoning goes into the history apart from the answer, as the template expects.
        history.push(json!({"role": "assistant", "content": r.content.trim(), "reasoning_content": r.reasoning.trim()}));
    }
    loaded.engine.shutdown(false);
    Ok(())
}
