//! `orchid`: the command-line entry point. Each subcommand lives in `cmd/<name>.rs`.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "orchid", version, about = "Fast inference for the Qwen3.5/3.6 hybrid MoE family")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// One chat turn (or, with --raw, a plain completion), streamed to stdout.
    Run(cmd::run::RunArgs),
    /// An interactive conversation in the terminal.
    Chat(cmd::chat::ChatArgs),
    /// OpenAI-compatible HTTP server (chat, completions, models, health, metrics).
    Serve(cmd::serve::ServeArgs),
    /// Teacher-forced perplexity (JSON), logit dumps and comparison with another engine.
    Eval(cmd::eval::EvalArgs),
    /// Prefill and decode speed on the GPU (docs/status.md protocol); table or --json.
    Bench(cmd::bench::BenchArgs),
    /// Write a random-weight checkpoint of any config (HF or MLX layout).
    Synth(cmd::synth::SynthArgs),
    /// Convert an HF checkpoint to MLX affine 4-bit (or 8-bit), readable by mlx-lm.
    Quantize(cmd::quantize::QuantizeArgs),
    /// Encode text with a checkpoint's tokenizer and print the ids as JSON (a testing aid).
    #[command(hide = true)]
    Tokenize(cmd::tokenize::TokenizeArgs),
    /// Render a chat request (JSON) with the checkpoint's chat template (a testing aid).
    #[command(hide = true)]
    RenderChat(cmd::tokenize::RenderChatArgs),
}

/// Standard error that ignores write errors: with stderr a closed pipe, logging must neither
/// panic nor block anything else.
struct Stderr;

impl std::io::Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ORCHID_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(|| Stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Eval(a) => cmd::eval::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Quantize(a) => cmd::quantize::run(a),
        Command::Tokenize(a) => cmd::tokenize::run_tokenize(a),
        Command::RenderChat(a) => cmd::tokenize::run_render_chat(a),
    };
    if let Err(e) = result {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "error: {e:#}");
        // 3: the model folder is unusable (config, checkpoint, tokenizer, chat template);
        // 1: anything else (the device, running the model, the command's own work).
        let bad_model = orchid_engine::engine::is_bad_model(&e);
        std::process::exit(if bad_model { 3 } else { 1 });
    }
}
