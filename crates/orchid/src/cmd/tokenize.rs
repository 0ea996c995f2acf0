//! Hidden testing aids used by the Python parity tests (`tests/python`):
//! - `orchid tokenize --model DIR (--text-file F | --text S) [--special]` prints
//!   `{"ids": [...]}`. Special tokens written in the text always become their ids (as in HF);
//!   `--special` sets `add_special_tokens` (the post-processor; a no-op for Qwen).
//! - `orchid render-chat --model DIR --request FILE.json` prints the prompt the chat template
//!   renders for `{"messages": [..], "tools": [..]?, "add_generation_prompt": bool?, ...kwargs}`,
//!   byte for byte, with no newline added.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use orchid_engine::{ChatTemplate, Tokenizer};

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Model folder holding tokenizer.json.
    #[arg(long)]
    model: PathBuf,
    /// Read the text to encode from this file (UTF-8, used as is).
    #[arg(long, conflicts_with = "text")]
    text_file: Option<PathBuf>,
    /// The text to encode.
    #[arg(long)]
    text: Option<String>,
    /// Run the tokenizer's post-processor (`add_special_tokens=True`).
    #[arg(long)]
    special: bool,
}

#[derive(Args, Debug)]
pub struct RenderChatArgs {
    /// Model folder holding chat_template.jinja or tokenizer_config.json.
    #[arg(long)]
    model: PathBuf,
    /// JSON request file: {"messages": [...], "tools": [...]?, "add_generation_prompt": bool?, ...}.
    #[arg(long)]
    request: PathBuf,
}

pub fn run_tokenize(args: TokenizeArgs) -> Result<()> {
    let text = match (&args.text, &args.text_file) {
        (Some(t), None) => t.clone(),
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("{}: cannot read text (must be UTF-8)", f.display()))?,
        _ => bail!("give exactly one of --text or --text-file"),
    };
    let tok = Tokenizer::from_dir(&args.model)?;
    let ids = tok.encode(&text, args.special)?;
    println!("{}", serde_json::json!({ "ids": ids }));
    Ok(())
}

pub fn run_render_chat(args: RenderChatArgs) -> Result<()> {
    let raw = std::fs::read_to_string(&args.request).with_context(|| format!("{}: cannot read", args.request.display()))?;
    let request: serde_json::Value = serde_json::from_str(&raw).with_context(|| format!("{}: malformed JSON", args.request.display()))?;
    let template = ChatTemplate::from_dir(&args.model)?;
    let prompt = template.render_request(&request)?;
    let mut out = std::io::stdout().lock();
    out.write_all(prompt.as_bytes())?;
    out.flush()?;
    Ok(())
}
