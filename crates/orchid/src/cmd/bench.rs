//! `orchid bench`: prefill and decode speed on the GPU, following the protocol of docs/status.md: batch 1,
//! greedy, synthetic prompt token i = (i·2654435761 mod 2³²) mod vocab, the ten lengths
//! 256…131072, prefill tok/s = prompt tokens / time until the first sampled token is on the
//! host (the first token sampled on the host from the prefill's logits, as the engine does),
//! decode tok/s = 64 further tokens / their time (the decode graph of one row, one host read per
//! token), a warm-up run per length, median of `--runs` with the spread, peak GPU memory, the
//! bytes and FLOPs per token and the fraction of the measured ceilings. `--check-cpu N` also
//! compares N teacher-forced positions with the CPU backend.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use orchid_cuda::batch_graph::{BatchGraph, BatchRow};
use orchid_cuda::{CudaBackend, SampleParams};
use orchid_model::config::ModelConfig;
use orchid_model::{Backend, BatchLayout, LogitRows, Model, StateOptions, StatePool};
use serde_json::json;

use super::common::{Device, load_cuda, model_dir, resolve_device};

pub const LENGTHS: [usize; 10] = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072];
/// Measured ceilings of the H200 (docs/status.md).
const HBM_BYTES_PER_S: f64 = 4.3e12;
const BF16_FLOPS: f64 = 790e12;

#[derive(Args)]
pub struct BenchArgs {
    /// Checkpoint folder.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where to run (the benchmark needs CUDA).
    #[arg(long, value_enum, default_value_t = Device::Cuda)]
    device: Device,
    /// Prompt lengths (comma-separated); default the ten of the protocol.
    #[arg(long, value_delimiter = ',')]
    lengths: Vec<usize>,
    /// Tokens decoded after each prompt.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Timed runs per length (after one warm-up run).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Timed runs for prompts of 65,536 tokens and more (default: --runs), to fit a time limit.
    #[arg(long)]
    long_runs: Option<usize>,
    /// Prefill chunk (tokens per forward call).
    #[arg(long, default_value_t = 4096)]
    chunk: usize,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Teacher-forced comparison with the CPU backend over this many positions (0 = off).
    #[arg(long, default_value_t = 0)]
    check_cpu: usize,
    /// With --check-cpu: compare a model made of only the first N layers of the checkpoint instead.
    #[arg(long, default_value_t = 0)]
    check_layers: usize,
    /// Skip the speed runs (with --check-cpu: only the comparison).
    #[arg(long)]
    no_speed: bool,
    /// Per-kernel times of one prefill (eager, --profile-length tokens) and one graph decode step.
    #[arg(long)]
    profile: bool,
    /// Prompt length of the --profile run.
    #[arg(long, default_value_t = 4096)]
    profile_length: usize,
    /// Context before the --profile run: this many tokens are prefilled first, untimed, so the
    /// profile shows one pass of --profile-length tokens over that context (a chat turn's shape).
    #[arg(long, default_value_t = 0)]
    profile_context: usize,
    /// Batched decode: batch sizes (comma-separated) to time the batch graph at, each sequence
    /// at --batch-context tokens (see cmd/bench_batch.rs); --decode steps per run.
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Context of every sequence of a --batch run.
    #[arg(long, default_value_t = 512)]
    batch_context: usize,
    /// Stop starting new lengths after this many seconds (the rest are reported as not run).
    #[arg(long)]
    time_budget: Option<f64>,
    /// Decode on a one-row graph that reads its state slot from device memory, instead of the
    /// graph pinned to the slot that the engine runs a lone sequence on (an A/B of the two).
    #[arg(long)]
    unpinned: bool,
}

/// Token i of the synthetic prompt.
pub fn prompt_token(i: usize, vocab: usize) -> u32 {
    (((i as u64).wrapping_mul(2654435761) & 0xffff_ffff) % vocab as u64) as u32
}

/// Bytes a batch-1 decode step reads at context `n` and FLOPs per token, from the config.
pub struct Work {
    pub weight_bytes_step: f64,
    pub state_bytes_step: f64,
    pub kv_bytes_per_pos: f64,
    pub matmul_flops: f64,
    pub attn_flops_per_pos: f64,
}

impl Work {
    pub fn of(m: &Model<CudaBackend>) -> Work {
        let c = &m.config;
        let lin = |w: &orchid_cuda::GpuLinear| w.bytes_per_row() * w.rows as f64;
        let params = |w: &orchid_cuda::GpuLinear| (w.rows * w.cols) as f64;
        let (mut bytes, mut flops) = (lin(&m.lm_head) + m.embed_tokens.bytes_per_row(), 2.0 * params(&m.lm_head));
        for l in &m.layers {
            let mats: Vec<&orchid_cuda::GpuLinear> = match &l.mixer {
                orchid_model::model::Mixer::Attention(a) => vec![&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj],
                orchid_model::model::Mixer::DeltaNet(d) => vec![&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_b, &d.in_proj_a, &d.out_proj],
            };
            let mut ffn: Vec<(&orchid_cuda::GpuLinear, f64)> = Vec::new();
            match &l.ffn {
                orchid_model::model::Ffn::Moe(w) => {
                    ffn.push((&w.router, 1.0));
                    let k = c.moe.top_k as f64;
                    for e in [&w.experts.gate, &w.experts.up, &w.experts.down] {
                        ffn.push((e, k));
                    }
                    if let (Some(s), Some(g)) = (&w.shared, &w.shared_gate) {
                        for e in [&s.gate_proj, &s.up_proj, &s.down_proj, g] {
                            ffn.push((e, 1.0));
                        }
                    }
                }
                orchid_model::model::Ffn::Dense(d) => {
                    for e in [&d.gate_proj, &d.up_proj, &d.down_proj] {
                        ffn.push((e, 1.0));
                    }
                }
            }
            for w in mats {
                bytes += lin(w);
                flops += 2.0 * params(w);
            }
            for (w, times) in ffn {
                bytes += lin(w) * times;
                flops += 2.0 * params(w) * times;
            }
        }
        let d = &c.deltanet;
        let a = &c.attention;
        let n_gdn = c.num_deltanet_layers() as f64;
        let state = n_gdn
            * (2.0 * (d.num_v_heads * d.k_head_dim * d.v_head_dim) as f64 * 4.0 + 2.0 * ((d.conv_kernel - 1) * d.conv_dim()) as f64 * 4.0);
        let n_attn = c.num_attention_layers() as f64;
        Work {
            weight_bytes_step: bytes,
            state_bytes_step: state,
            kv_bytes_per_pos: n_attn * 2.0 * (a.num_kv_heads * a.head_dim) as f64 * 2.0,
            matmul_flops: flops,
            attn_flops_per_pos: n_attn * 4.0 * (a.num_heads * a.head_dim) as f64,
        }
    }
    /// Decode bytes per token at context n.
    pub fn decode_bytes(&self, n: usize) -> f64 {
        self.weight_bytes_step + self.state_bytes_step + self.kv_bytes_per_pos * n as f64
    }
    /// Prefill FLOPs per token of an n-token prompt (attention averaged over positions).
    pub fn prefill_flops(&self, n: usize) -> f64 {
        self.matmul_flops + self.attn_flops_per_pos * n as f64 / 2.0
    }
}

fn median_spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

struct RunResult {
    prefill_s: f64,
    decode_s: f64,
    first: u32,
    tokens: Vec<u32>,
}

/// The greedy token of the first row of `logits` (the host sampler's: lowest id among equal maxima).
fn argmax_first(m: &Model<CudaBackend>, logits: &orchid_cuda::CudaTensor) -> Result<u32> {
    let l = m.backend.to_host(logits)?;
    let v = m.config.vocab_size;
    Ok((0..v).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap_or(0) as u32)
}

/// `n` greedy tokens from the one-row decode graph after `token` at `pos` of `slot`.
fn decode_tokens(
    m: &Model<CudaBackend>,
    graph: &mut BatchGraph,
    state: &mut orchid_cuda::CudaState,
    (slot, token, pos): (usize, u32, usize),
    n: usize,
) -> Result<Vec<u32>> {
    let mut row = BatchRow { slot, token, pos, index: 1, params: SampleParams::greedy(m.config.vocab_size) };
    let mut tokens = Vec::with_capacity(n);
    for _ in 0..n {
        let t = graph.step_unmasked(state, std::slice::from_ref(&row))?[0];
        tokens.push(t);
        row = BatchRow { token: t, pos: row.pos + 1, index: row.index + 1, ..row };
    }
    Ok(tokens)
}

fn run_once(
    m: &Model<CudaBackend>,
    state: &mut orchid_cuda::CudaState,
    graph: &mut BatchGraph,
    prompt: &[u32],
    chunk: usize,
    decode: usize,
) -> Result<RunResult> {
    let slot = state.alloc().context("no free state slot")?;
    m.backend.gpu().synchronize()?;
    let t0 = Instant::now();
    let mut logits = None;
    let mut pos = 0;
    for ch in prompt.chunks(chunk.max(1)) {
        logits = Some(m.forward(ch, &BatchLayout::single(slot, pos, ch.len()), state, LogitRows::LastOfEachSpan)?);
        pos += ch.len();
    }
    let first = argmax_first(m, &logits.context("an empty prompt")?)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let tokens = decode_tokens(m, graph, state, (slot, first, prompt.len()), decode)?;
    let decode_s = t1.elapsed().as_secs_f64();
    state.free(slot);
    Ok(RunResult { prefill_s, decode_s, first, tokens })
}

pub fn run(a: BenchArgs) -> Result<()> {
    let dir = model_dir(a.model.as_deref())?;
    if resolve_device(a.device)? != Device::Cuda {
        bail!("orchid bench measures the CUDA backend: --device cuda (no usable GPU found)");
    }
    let lengths = if a.lengths.is_empty() { LENGTHS.to_vec() } else { a.lengths.clone() };
    let t_load = Instant::now();
    let m = load_cuda(&dir)?;
    let load_s = t_load.elapsed().as_secs_f64();
    let gpu = m.backend.gpu().clone();
    let cfg: ModelConfig = m.config.clone();
    let v = cfg.vocab_size;
    let work = Work::of(&m);
    let mut report = json!({
        "model": dir.display().to_string(),
        "device": m.backend.describe(),
        "weights_gb": gpu.current_bytes() as f64 / 1e9,
        "load_seconds": load_s,
        "decode_tokens": a.decode,
        "runs": a.runs,
        "chunk": a.chunk,
        "commit": option_env!("ORCHID_GIT_COMMIT").unwrap_or("unknown"),
        "weight_bytes_per_decode_step": work.weight_bytes_step,
        "matmul_flops_per_token": work.matmul_flops,
    });
    if a.check_cpu > 0 {
        if a.check_layers > 0 {
            report["check_cpu_truncated"] = check_cpu(&m, &dir, a.check_cpu, a.check_layers)?;
        } else {
            report["check_cpu"] = check_cpu(&m, &dir, a.check_cpu, 0)?;
        }
    }
    if !a.batch.is_empty() {
        report["batch_decode"] = super::bench_batch::batch_decode(&m, &a.batch, a.batch_context, a.decode, a.runs, a.profile)?;
    }
    if !a.no_speed {
        let max_len = *lengths.iter().max().unwrap_or(&256).max(&(a.profile_context + a.profile_length));
        let mut state = m.new_state(StateOptions::new(1, max_len + a.decode + 64))?;
        let mut graph =
            if a.unpinned { BatchGraph::new(&m, &mut state, 1, true)? } else { BatchGraph::new_pinned(&m, &mut state, 0, true)? };
        tracing::info!("decode graph: {} nodes per step", graph.nodes);
        report["decode_graph_nodes"] = json!(graph.nodes);
        report["decode_graph_pdl"] = json!(graph.pdl);
        tracing::info!("decode graph: programmatic dependent launch {}", if graph.pdl { "on" } else { "off" });
        if a.profile {
            report["profile"] = profile(&m, &mut state, a.profile_context, a.profile_length, a.chunk)?;
        }
        let mut rows = Vec::new();
        let t_start = Instant::now();
        for &len in &lengths {
            if a.time_budget.is_some_and(|b| t_start.elapsed().as_secs_f64() > b) {
                rows.push(json!({"length": len, "error": "not run (time budget)"}));
                continue;
            }
            let prompt: Vec<u32> = (0..len).map(|i| prompt_token(i, v)).collect();
            gpu.reset_peak();
            let r = (|| -> Result<serde_json::Value> {
                let warm = run_once(&m, &mut state, &mut graph, &prompt, a.chunk, a.decode)?;
                let (mut pf, mut dc) = (Vec::new(), Vec::new());
                let runs = if len >= 65536 { a.long_runs.unwrap_or(a.runs) } else { a.runs };
                for _ in 0..runs.max(1) {
                    let r = run_once(&m, &mut state, &mut graph, &prompt, a.chunk, a.decode)?;
                    if r.first != warm.first || r.tokens != warm.tokens {
                        tracing::warn!("length {len}: greedy tokens differ between runs");
                    }
                    pf.push(len as f64 / r.prefill_s);
                    dc.push(a.decode as f64 / r.decode_s);
                }
                let (pm, plo, phi) = median_spread(&mut pf);
                let (dm, dlo, dhi) = median_spread(&mut dc);
                let ctx = len + a.decode / 2;
                let dbytes = work.decode_bytes(ctx);
                let pflops = work.prefill_flops(len);
                let (free, total) = gpu.mem_info()?;
                Ok(json!({
                    "length": len,
                    "runs": runs,
                    "prefill_tok_s": pm, "prefill_min": plo, "prefill_max": phi,
                    "decode_tok_s": dm, "decode_min": dlo, "decode_max": dhi,
                    "decode_bytes_per_token": dbytes,
                    "decode_roofline_tok_s": HBM_BYTES_PER_S / dbytes,
                    "decode_fraction_of_roofline": dm * dbytes / HBM_BYTES_PER_S,
                    "prefill_flops_per_token": pflops,
                    "prefill_fraction_of_peak": pm * pflops / BF16_FLOPS,
                    "peak_alloc_gb": gpu.peak_bytes() as f64 / 1e9,
                    "device_used_gb": (total - free) as f64 / 1e9,
                    "first_token": warm.first,
                }))
            })();
            match r {
                Ok(row) => {
                    if !a.json {
                        eprintln!(
                            "{:>7}  prefill {:>8.0} tok/s  decode {:>6.1} tok/s  ({:.0}% of the decode roofline)",
                            len,
                            row["prefill_tok_s"].as_f64().unwrap(),
                            row["decode_tok_s"].as_f64().unwrap(),
                            100.0 * row["decode_fraction_of_roofline"].as_f64().unwrap()
                        );
                    }
                    rows.push(row);
                }
                Err(e) => {
                    tracing::error!("length {len}: {e:#}");
                    rows.push(json!({"length": len, "error": format!("{e:#}")}));
                }
            }
        }
        report["results"] = json!(rows);
    }
    let text = serde_json::to_string_pretty(&report)?;
    if let Some(p) = &a.out {
        std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
    }
    if a.json {
        println!("{text}");
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Prints per-kernel times (`driver::profile_summary` rows) under `title` with their sum and the
/// wall time, and returns them as JSON.
pub(super) fn profile_table(title: &str, rows: &[(&'static str, usize, f64)], wall: f64) -> serde_json::Value {
    let total: f64 = rows.iter().map(|r| r.2).sum();
    eprintln!("{title}: {total:.3} ms of kernels, {wall:.3} ms wall");
    for r in rows.iter().take(24) {
        eprintln!(
            "  {:<22} {:>6} launches {:>10.3} ms {:>6.1}%  ({:.1} us each)",
            r.0,
            r.1,
            r.2,
            100.0 * r.2 / total,
            1e3 * r.2 / r.1 as f64
        );
    }
    json!(rows.iter().map(|r| json!({"kernel": r.0, "launches": r.1, "ms": r.2})).collect::<Vec<_>>())
}

/// Per-kernel GPU time of a prefill of `len` tokens after `context` untimed ones (eager launches,
/// so CPU-side gaps show up in the kernel that follows them) and of one captured decode step
/// after them.
fn profile(
    m: &Model<CudaBackend>,
    state: &mut orchid_cuda::CudaState,
    context: usize,
    len: usize,
    chunk: usize,
) -> Result<serde_json::Value> {
    use orchid_cuda::driver;
    let gpu = m.backend.gpu().clone();
    let v = m.config.vocab_size;
    let prompt: Vec<u32> = (0..context + len).map(|i| prompt_token(i, v)).collect();
    let slot = state.alloc().context("slot")?;
    let mut pos = 0;
    for ch in prompt[..context].chunks(chunk.max(1)) {
        m.forward(ch, &BatchLayout::single(slot, pos, ch.len()), state, LogitRows::LastOfEachSpan)?;
        pos += ch.len();
    }
    gpu.synchronize()?;
    let t0 = Instant::now();
    driver::profile_begin(&gpu)?;
    let mut logits = None;
    for ch in prompt[context..].chunks(chunk.max(1)) {
        logits = Some(m.forward(ch, &BatchLayout::single(slot, pos, ch.len()), state, LogitRows::LastOfEachSpan)?);
        pos += ch.len();
    }
    gpu.synchronize()?;
    let wall = t0.elapsed().as_secs_f64() * 1e3;
    let ev = driver::profile_end();
    let pre = driver::profile_summary(&ev)?;
    drop(ev);
    let first = argmax_first(m, &logits.context("an empty profile prompt")?)?;
    let mut pg = BatchGraph::new_profiled(m, state, 1, true)?;
    let toks = decode_tokens(m, &mut pg, state, (slot, first, context + len), 3)?;
    let t1 = Instant::now();
    decode_tokens(m, &mut pg, state, (slot, toks[2], context + len + 3), 1)?;
    let step_ms = t1.elapsed().as_secs_f64() * 1e3;
    let dec = pg.profile_summary()?;
    drop(pg);
    state.free(slot);
    Ok(json!({
        "prefill_tokens": len,
        "prefill_context": context,
        "prefill_wall_ms": wall,
        "prefill": profile_table(&format!("prefill {len} tokens after {context} (eager)"), &pre, wall),
        "decode_step_wall_ms": step_ms,
        "decode": profile_table(&format!("decode step at {} (graph with timing events)", context + len), &dec, step_ms),
    }))
}

fn print_table(r: &serde_json::Value) {
    println!("{}", r["device"].as_str().unwrap_or(""));
    println!(
        "model {} ({:.2} GB on the GPU, loaded in {:.1}s)",
        r["model"].as_str().unwrap_or(""),
        r["weights_gb"].as_f64().unwrap_or(0.0),
        r["load_seconds"].as_f64().unwrap_or(0.0)
    );
    for k in ["check_cpu", "check_cpu_truncated"] {
        if let Some(c) = r.get(k) {
            println!("{k}: {c}");
        }
    }
    let Some(rows) = r["results"].as_array() else { return };
    println!(
        "| prompt | prefill tok/s (min–max) | % bf16 peak | decode tok/s (min–max) | bytes/token | % of HBM roofline | peak alloc GB |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for row in rows {
        if let Some(e) = row.get("error") {
            println!("| {} | error: {e} | | | | | |", row["length"]);
            continue;
        }
        let f = |k: &str| row[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {} | {:.0} ({:.0}–{:.0}) | {:.1}% | {:.1} ({:.1}–{:.1}) | {:.2} GB | {:.1}% | {:.1} |",
            row["length"],
            f("prefill_tok_s"),
            f("prefill_min"),
            f("prefill_max"),
            100.0 * f("prefill_fraction_of_peak"),
            f("decode_tok_s"),
            f("decode_min"),
            f("decode_max"),
            f("decode_bytes_per_token") / 1e9,
            100.0 * f("decode_fraction_of_roofline"),
            f("peak_alloc_gb"),
        );
    }
}

/// Teacher-forced logits of n synthetic positions on CUDA, on the f32 CPU and on the CPU with
/// bf16-rounded matmul inputs (the "bf16 sensitivity" of this model and prompt, see
/// orchid_cuda::bf16ref): relative L2, RMS error, and top-1 agreement wherever the CPU's top-2
/// margin exceeds 10× the RMS error. Pass: rel ≤ max(3·sensitivity, 1e-2) and full agreement
/// above the margin. `layers` > 0 keeps only the first layers of the checkpoint (a model that
/// random weights leave far less chaotic than all 40 layers).
fn check_cpu(m: &Model<CudaBackend>, dir: &std::path::Path, n: usize, layers: usize) -> Result<serde_json::Value> {
    use orchid_cuda::bf16ref::Bf16Cpu;
    use orchid_model::checkpoint::Checkpoint;
    let mut cfg = ModelConfig::load(dir)?;
    let ck = Checkpoint::open(dir)?;
    let mut host = orchid_model::weights::load(&cfg, &ck)?;
    if layers > 0 && layers < cfg.num_layers() {
        host.layers.truncate(layers);
        cfg.layer_types.truncate(layers);
        cfg.dense_mlp_layers.truncate(layers);
    }
    let v = cfg.vocab_size;
    let ids: Vec<u32> = (0..n).map(|i| prompt_token(i * 7 + 3, v)).collect();
    fn all<B: Backend>(m: &Model<B>, ids: &[u32]) -> Result<Vec<f32>> {
        let mut st = m.new_state(StateOptions::new(1, ids.len() + 8))?;
        let s = st.alloc().context("slot")?;
        Ok(m.backend.to_host(&m.forward(ids, &BatchLayout::single(s, 0, ids.len()), &mut st, LogitRows::All)?)?)
    }
    let gl = if layers > 0 && layers < m.config.num_layers() {
        let small = Model::new(cfg.clone(), m.backend.clone(), &host)?;
        all(&small, &ids)?
    } else {
        all(m, &ids)?
    };
    let t = Instant::now();
    let cl = all(&Model::new(cfg.clone(), orchid_cpu::CpuBackend::new(), &host)?, &ids)?;
    let bl = all(&Model::new(cfg.clone(), Bf16Cpu(orchid_cpu::CpuBackend::new()), &host)?, &ids)?;
    let cpu_s = t.elapsed().as_secs_f64();
    let rel = |a: &[f32], b: &[f32]| {
        let (mut num, mut den) = (0f64, 0f64);
        for (x, y) in a.iter().zip(b) {
            num += ((x - y) as f64).powi(2);
            den += (*y as f64).powi(2);
        }
        (num / den.max(1e-30)).sqrt()
    };
    let rms = (gl.iter().zip(&cl).map(|(g, c)| ((g - c) as f64).powi(2)).sum::<f64>() / cl.len() as f64).sqrt();
    let (mut checked, mut agree, mut all_agree, mut bf_agree) = (0, 0, 0, 0);
    for ((g, c), b) in gl.chunks(v).zip(cl.chunks(v)).zip(bl.chunks(v)) {
        let mut top = [(f32::NEG_INFINITY, 0usize); 2];
        for (i, &x) in c.iter().enumerate() {
            if x > top[0].0 {
                top[1] = top[0];
                top[0] = (x, i);
            } else if x > top[1].0 {
                top[1] = (x, i);
            }
        }
        let arg = |r: &[f32]| (0..v).max_by(|&a, &b| r[a].total_cmp(&r[b]).then(b.cmp(&a))).unwrap();
        let ga = arg(g);
        all_agree += (ga == top[0].1) as usize;
        bf_agree += (arg(b) == top[0].1) as usize;
        if ((top[0].0 - top[1].0) as f64) > 10.0 * rms {
            checked += 1;
            agree += (ga == top[0].1) as usize;
        }
    }
    let (gpu_rel, sens) = (rel(&gl, &cl), rel(&bl, &cl));
    let tol = (3.0 * sens).max(1e-2);
    Ok(json!({
        "positions": n,
        "layers": cfg.num_layers(),
        "rel_l2": gpu_rel,
        "bf16_sensitivity": sens,
        "tolerance": tol,
        "rms_logit_err": rms,
        "margin_tolerance": 10.0 * rms,
        "positions_above_tolerance": checked,
        "top1_agree_above_tolerance": agree,
        "top1_agree_all": all_agree,
        "bf16_cpu_top1_agree_all": bf_agree,
        "pass": agree == checked && gpu_rel <= tol,
        "cpu_seconds": cpu_s,
    }))
}
