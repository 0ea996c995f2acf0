//! `orchid eval`: teacher-forced perplexity, logit dumps and comparison with another engine.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use orchid_model::safetensors::{OutTensor, SafetensorsFile};
use orchid_model::{Backend, BatchLayout, LogitRows, Model, StateOptions, StatePool};
use serde_json::json;

use super::common::{Device, load_cpu, load_cuda, model_dir, resolve_device};

#[derive(Args)]
pub struct EvalArgs {
    /// Checkpoint folder (default: the bundled model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Text to evaluate (tokenized with the checkpoint's tokenizer).
    #[arg(long, conflicts_with = "tokens")]
    text: Option<PathBuf>,
    /// Whitespace-separated token ids to evaluate.
    #[arg(long)]
    tokens: Option<PathBuf>,
    /// Prefill chunk size; 1 runs token by token through the decode path.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Evaluate independent windows of this many tokens (each from an empty state).
    #[arg(long)]
    window: Option<usize>,
    /// Use at most this many tokens.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Write the logits of every position (f32 [T, vocab], tensor `logits`).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Compare with another engine's logits (same format as --dump-logits).
    #[arg(long)]
    reference: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

fn read_tokens(path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.split_whitespace()
        .map(|w| w.parse::<u32>().with_context(|| format!("{}: `{w}` is not a token id", path.display())))
        .collect()
}

/// Logits [T, vocab] for `ids`, run in windows and chunks.
pub fn teacher_forced<B: Backend>(m: &Model<B>, ids: &[u32], chunk: usize, window: usize) -> Result<Vec<f32>> {
    let v = m.config.vocab_size;
    let mut out = Vec::with_capacity(ids.len() * v);
    let mut state = m.new_state(StateOptions { max_seqs: 1, max_context: window.max(1) })?;
    for win in ids.chunks(window.max(1)) {
        let slot = state.alloc().context("no state slot")?;
        for (ci, c) in win.chunks(chunk.max(1)).enumerate() {
            let batch = BatchLayout::single(slot, ci * chunk.max(1), c.len());
            let logits = m.forward(c, &batch, &mut state, LogitRows::All)?;
            out.extend(m.backend.to_host(&logits)?);
        }
        state.free(slot);
    }
    Ok(out)
}

/// (mean NLL of tokens 1.. given their prefix, argmax per position).
fn nll_and_argmax(logits: &[f32], ids: &[u32], v: usize, window: usize) -> (f64, usize, Vec<usize>) {
    let mut nll = 0f64;
    let mut n = 0usize;
    let mut arg = Vec::with_capacity(ids.len());
    for (t, row) in logits.chunks(v).enumerate() {
        arg.push(orchid_engine::sampling::argmax(row));
        // The last token of each window has no target inside the window.
        if t + 1 < ids.len() && (t + 1) % window != 0 {
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            nll += lse - row[ids[t + 1] as usize] as f64;
            n += 1;
        }
    }
    (nll / n.max(1) as f64, n, arg)
}

pub fn run(a: EvalArgs) -> Result<()> {
    let dir = model_dir(a.model.as_deref())?;
    let device = resolve_device(a.device)?;
    let mut ids = match (&a.tokens, &a.text) {
        (Some(p), _) => read_tokens(p)?,
        (None, Some(p)) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let tok = orchid_engine::tokenizer::Tokenizer::from_dir(&dir).map_err(super::common::bad_model)?;
            tok.encode(&text, false)?
        }
        (None, None) => bail!("give --text FILE or --tokens FILE"),
    };
    if let Some(n) = a.max_tokens {
        ids.truncate(n);
    }
    if ids.len() < 2 {
        bail!("need at least 2 tokens to evaluate, got {}", ids.len());
    }
    match device {
        Device::Cuda => evaluate(&load_cuda(&dir)?, &a, &ids),
        Device::Cpu | Device::Auto => evaluate(&load_cpu(&dir)?, &a, &ids),
    }
}

fn evaluate<B: Backend>(m: &Model<B>, a: &EvalArgs, ids: &[u32]) -> Result<()> {
    let v = m.config.vocab_size;
    let window = a.window.unwrap_or(ids.len());
    let t0 = std::time::Instant::now();
    let logits = teacher_forced(m, ids, a.chunk, window)?;
    let secs = t0.elapsed().as_secs_f64();
    let (nll, n, arg) = nll_and_argmax(&logits, ids, v, window);
    let mut report = json!({
        "tokens": ids.len(),
        "scored": n,
        "nll": nll,
        "ppl": nll.exp(),
        "device": m.backend.describe(),
        "seconds": secs,
        "tokens_per_second": ids.len() as f64 / secs,
    });
    if let Some(out) = &a.dump_logits {
        let t = OutTensor::f32("logits", vec![ids.len(), v], &logits);
        orchid_model::safetensors::write(out, &[t], &Default::default())?;
    }
    if let Some(r) = &a.reference {
        let f = SafetensorsFile::open(r)?;
        let t = f.tensors.get("logits").with_context(|| format!("{}: no tensor `logits`", r.display()))?;
        if t.shape != [ids.len(), v] {
            bail!("{}: logits have shape {:?}, expected [{}, {v}]", r.display(), t.shape, ids.len());
        }
        let refl = t.to_f32()?;
        let (ref_nll, _, ref_arg) = nll_and_argmax(&refl, ids, v, window);
        let agree = arg.iter().zip(&ref_arg).filter(|(a, b)| a == b).count();
        let (mut max_err, mut sum_err, mut num, mut den) = (0f64, 0f64, 0f64, 0f64);
        for (x, y) in logits.iter().zip(&refl) {
            let d = (*x as f64 - *y as f64).abs();
            max_err = max_err.max(d);
            sum_err += d;
            num += d * d;
            den += (*y as f64) * (*y as f64);
        }
        report["reference"] = json!({
            "top1_agreement": agree as f64 / ids.len() as f64,
            "ppl": ref_nll.exp(),
            "ppl_rel_diff": (nll.exp() - ref_nll.exp()) / ref_nll.exp(),
            "max_abs_logit_err": max_err,
            "mean_abs_logit_err": sum_err / logits.len() as f64,
            "rel_l2": (num / den.max(1e-30)).sqrt(),
        });
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
