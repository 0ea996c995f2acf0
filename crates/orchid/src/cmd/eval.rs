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
    /// Evaluate independent windows of this many tokens, each from an empty state (the protocol
    /// of models/orchid-tiny/eval.json); 0 = the whole input as one window.
    #[arg(long, default_value_t = 512)]
    window: usize,
    /// Use at most this many tokens.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Write the logits of every position (f32 [T, vocab], tensor `logits`).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Compare with another engine's logits (same format as --dump-logits).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Where to run the model.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

fn read_tokens(path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.split_whitespace().map(|w| w.parse::<u32>().with_context(|| format!("{}: `{w}` is not a token id", path.display()))).collect()
}

/// Runs `ids` teacher-forced in independent windows of `window` tokens (prefill chunks of
/// `chunk`) and hands each window's logits [len, vocab] to `each` with the window's offset.
/// Logs progress every few seconds on long inputs.
pub fn teacher_forced<B: Backend>(
    m: &Model<B>,
    ids: &[u32],
    chunk: usize,
    window: usize,
    mut each: impl FnMut(usize, &[f32]),
) -> Result<()> {
    let (t0, mut last_log) = (std::time::Instant::now(), std::time::Instant::now());
    let mut state = m.new_state(StateOptions::new(1, window))?;
    let mut logits = Vec::new();
    for (wi, win) in ids.chunks(window).enumerate() {
        let slot = state.alloc().context("no state slot")?;
        logits.clear();
        for (ci, c) in win.chunks(chunk).enumerate() {
            let batch = BatchLayout::single(slot, ci * chunk, c.len());
            let l = m.forward(c, &batch, &mut state, LogitRows::All)?;
            logits.extend(m.backend.to_host(&l)?);
        }
        state.free(slot);
        each(wi * window, &logits);
        if last_log.elapsed().as_secs_f64() >= 5.0 {
            let done = (wi * window + win.len()).min(ids.len());
            let secs = t0.elapsed().as_secs_f64();
            tracing::info!("eval: {done} / {} tokens ({:.0} tok/s)", ids.len(), done as f64 / secs);
            last_log = std::time::Instant::now();
        }
    }
    Ok(())
}

/// Running sum of the NLL of every token predicted inside its window, and the argmax per position.
#[derive(Default)]
struct Scores {
    nll: f64,
    scored: usize,
    argmax: Vec<usize>,
}

impl Scores {
    /// Adds one window's logits (`rows` [len, v]) whose first token is `ids[offset]`.
    fn add(&mut self, rows: &[f32], ids: &[u32], offset: usize, v: usize) {
        let len = rows.len() / v;
        for (t, row) in rows.chunks(v).enumerate() {
            self.argmax.push(orchid_engine::sampling::argmax(row));
            // The last token of each window has no target inside the window.
            if t + 1 < len {
                let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
                self.nll += lse - row[ids[offset + t + 1] as usize] as f64;
                self.scored += 1;
            }
        }
    }

    fn mean_nll(&self) -> f64 {
        self.nll / self.scored.max(1) as f64
    }
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
    let window = if a.window == 0 { ids.len() } else { a.window };
    let keep_logits = a.dump_logits.is_some() || a.reference.is_some();
    let mut logits = Vec::with_capacity(if keep_logits { ids.len() * v } else { 0 });
    let mut scores = Scores::default();
    let t0 = std::time::Instant::now();
    teacher_forced(m, ids, a.chunk.max(1), window, |offset, rows| {
        scores.add(rows, ids, offset, v);
        if keep_logits {
            logits.extend_from_slice(rows);
        }
    })?;
    let secs = t0.elapsed().as_secs_f64();
    let nll = scores.mean_nll();
    let mut report = json!({
        "tokens": ids.len(),
        "window": window,
        "scored": scores.scored,
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
        let mut reference = Scores::default();
        for (wi, rows) in refl.chunks(window * v).enumerate() {
            reference.add(rows, ids, wi * window, v);
        }
        let ref_nll = reference.mean_nll();
        let agree = scores.argmax.iter().zip(&reference.argmax).filter(|(a, b)| a == b).count();
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
