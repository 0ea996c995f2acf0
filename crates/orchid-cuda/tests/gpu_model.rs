//! Whole-model parity, CUDA against the CPU reference, on random weights: several small configs
//! (odd head counts, dk ≠ dv, shared ≠ routed width, no shared expert, MHA) and a mid-size one,
//! in the HF (dense bf16) and MLX (affine 4-bit, 8-bit router) formats; prefill in chunks, then
//! decode through the op-level path and through the captured CUDA graph (teacher-forced, and
//! bitwise equal to each other), plus a two-sequence batch.
//!
//! Tolerance. The GPU rounds matmul inputs to bf16 (as HF does), keeps K/V in bf16 and
//! dequantises 8-bit routers to bf16. Random-weight MoE models amplify such rounding: a router
//! near-tie flips an expert, and the flip propagates. The test therefore measures, on the same
//! model and tokens, how far a CPU run with only its matmul/MoE/attention inputs rounded to bf16
//! ("bf16 sensitivity", s) lies from the f32 CPU, and requires the GPU's relative L2 error
//! ≤ max(3·s, floor), plus top-1 agreement at every position whose CPU top-2 margin exceeds 10×
//! the RMS logit error. "Smooth" configs (top-k = all experts: no discrete routing) have
//! s ≈ 1e-2 and floor 1e-2, and so check every kernel's precision tightly. Routed configs check
//! the routed data path end to end; there s is a single sample of a heavy-tailed quantity (one
//! flipped near-tie moves the logits by 0.05–0.4 relative; seen: s = 0.04 while a GPU build whose
//! every kernel matched the previous one to the last digits of the per-kernel tests landed at
//! 0.19), so their floor is 0.25: far below what a broken index, race or layout gives (≥ 1).

mod common;

use common::*;
use orchid_cpu::CpuBackend;
use orchid_cuda::batch_graph::{BatchGraph, BatchRow};
use orchid_cuda::{CudaBackend, SampleParams};
use orchid_model::Model;
use orchid_model::backend::{Backend, StateOptions, StatePool};
use orchid_model::batch::{BatchLayout, LogitRows, SeqSpan};
use orchid_model::config::ModelConfig;

fn margin_agreement(gpu: &[f32], cpu: &[f32], vocab: usize, rms: f64) -> (usize, usize) {
    let (mut checked, mut agree) = (0, 0);
    for (g, c) in gpu.chunks(vocab).zip(cpu.chunks(vocab)) {
        let mut idx: Vec<usize> = (0..vocab).collect();
        idx.sort_by(|&a, &b| c[b].total_cmp(&c[a]));
        if ((c[idx[0]] - c[idx[1]]) as f64) > 10.0 * rms {
            checked += 1;
            let ga = (0..vocab).max_by(|&a, &b| g[a].total_cmp(&g[b]).then(b.cmp(&a))).unwrap();
            agree += (ga == idx[0]) as usize;
        }
    }
    (checked, agree)
}

/// Tolerance floor (see the module comment): tight without discrete routing, 0.25 with it.
fn floor(cfg: &ModelConfig) -> f64 {
    if cfg.moe.num_experts > 0 && cfg.moe.top_k < cfg.moe.num_experts { 0.25 } else { 1e-2 }
}

/// GPU vs CPU logits, with the tolerance derived from the bf16 sensitivity `sens`.
fn check(name: &str, gpu: &[f32], cpu: &[f32], sens: f64, floor: f64, vocab: usize) {
    let rel = rel_l2(gpu, cpu);
    let rms = (gpu.iter().zip(cpu).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / cpu.len() as f64).sqrt();
    let tol = (3.0 * sens).max(floor);
    let (checked, agree) = margin_agreement(gpu, cpu, vocab, rms);
    let ok = rel <= tol && agree == checked;
    println!(
        "PARITY {} model {name}: rel_l2 {rel:.3e} (tol {tol:.2e} = max(3 x bf16 sensitivity {sens:.2e}, {floor:.0e})), top-1 {agree}/{checked} with margin > 10·rms ({:.2e})",
        if ok { "PASS" } else { "FAIL" },
        10.0 * rms
    );
    assert!(ok, "{name}");
}

fn forward_all<B: Backend>(m: &Model<B>, ids: &[u32], slot: usize, start: usize, st: &mut B::State) -> Vec<f32> {
    m.backend.to_host(&m.forward(ids, &BatchLayout::single(slot, start, ids.len()), st, LogitRows::All).unwrap()).unwrap()
}

fn run_case(g: &CudaBackend, name: &str, cfg: &ModelConfig, fmt: Fmt, prompt: usize, chunk: usize, decode: usize) {
    let host = random_weights(cfg, fmt, 99);
    let cpu = Model::new(cfg.clone(), CpuBackend::new(), &host).unwrap();
    let bfc = Model::new(cfg.clone(), Bf16Cpu(CpuBackend::new()), &host).unwrap();
    let gpu = Model::new(cfg.clone(), g.clone(), &host).unwrap();
    drop(host);
    let v = cfg.vocab_size;
    let mut rng = Rng::new(1234);
    let ids: Vec<u32> = (0..prompt + decode).map(|_| rng.below(v) as u32).collect();
    let opts = StateOptions::new(3, prompt + decode + 8);
    let (mut cs, mut bs, mut gs) = (cpu.new_state(opts).unwrap(), bfc.new_state(opts).unwrap(), gpu.new_state(opts).unwrap());
    let (c0, b0, g0, g1) = (cs.alloc().unwrap(), bs.alloc().unwrap(), gs.alloc().unwrap(), gs.alloc().unwrap());
    let (mut cl, mut bl, mut gl) = (Vec::new(), Vec::new(), Vec::new());
    let mut pos = 0;
    for ch in ids[..prompt].chunks(chunk) {
        cl.extend(forward_all(&cpu, ch, c0, pos, &mut cs));
        bl.extend(forward_all(&bfc, ch, b0, pos, &mut bs));
        gl.extend(forward_all(&gpu, ch, g0, pos, &mut gs));
        gpu.forward(ch, &BatchLayout::single(g1, pos, ch.len()), &mut gs, LogitRows::LastOfEachSpan).unwrap();
        pos += ch.len();
    }
    let sens = rel_l2(&bl, &cl);
    let fl = floor(cfg);
    check(&format!("{name} {fmt:?} prefill {prompt} (chunks of {chunk})"), &gl, &cl, sens, fl, v);
    // Decode, teacher-forced: op-level on slot g0 (slots read from a device array), CUDA graph
    // pinned to slot g1 (its state addresses as kernel arguments), as the engine runs a lone
    // sequence.
    let mut graph = BatchGraph::new_pinned(&gpu, &mut gs, g1, true).unwrap();
    let (mut cd, mut bd, mut gd, mut gg) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, &tok) in ids[prompt..].iter().enumerate() {
        let p = prompt + i;
        cd.extend(forward_all(&cpu, &[tok], c0, p, &mut cs));
        bd.extend(forward_all(&bfc, &[tok], b0, p, &mut bs));
        gd.extend(forward_all(&gpu, &[tok], g0, p, &mut gs));
        let row = BatchRow { slot: g1, token: tok, pos: p, index: i + 1, params: SampleParams::greedy(v) };
        graph.step_unmasked(&mut gs, &[row]).unwrap();
        gg.extend(graph.logits(1).unwrap());
    }
    let sens_d = rel_l2(&bd, &cd);
    check(&format!("{name} {fmt:?} decode x{decode} (op-level)"), &gd, &cd, sens_d, fl, v);
    check(&format!("{name} {fmt:?} decode x{decode} (CUDA graph)"), &gg, &cd, sens_d, fl, v);
    // One model walk: the op-level step of one token runs the kernels the graph captured, so the
    // two give the same bits.
    report(&format!("model {name} {fmt:?} graph vs op-level decode (bitwise)"), rel_l2(&gg, &gd), 0.0);
    // A batch of two sequences in one forward call (a decode span of each).
    let c1 = cs.alloc().unwrap();
    let g2 = gs.alloc().unwrap();
    let n = 20.min(prompt);
    let cf = forward_all(&cpu, &ids[..n], c1, 0, &mut cs);
    let gf = forward_all(&gpu, &ids[..n], g2, 0, &mut gs);
    check(&format!("{name} {fmt:?} second sequence"), &gf, &cf, sens, fl, v);
    let p = prompt + decode;
    let tok = [ids[0], ids[n]];
    let cb = BatchLayout { spans: vec![SeqSpan { slot: c0, start: p, len: 1 }, SeqSpan { slot: c1, start: n, len: 1 }] };
    let gb = BatchLayout { spans: vec![SeqSpan { slot: g0, start: p, len: 1 }, SeqSpan { slot: g2, start: n, len: 1 }] };
    let cbl = cpu.backend.to_host(&cpu.forward(&tok, &cb, &mut cs, LogitRows::LastOfEachSpan).unwrap()).unwrap();
    let gbl = gpu.backend.to_host(&gpu.forward(&tok, &gb, &mut gs, LogitRows::LastOfEachSpan).unwrap()).unwrap();
    check(&format!("{name} {fmt:?} two-sequence batch"), &gbl, &cbl, sens.max(sens_d), fl, v);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn small_models() {
    let g = gpu();
    // (name, vocab, hidden, layers, (Hq, Hkv, D), (Hk, Hv, dk, dv), (E, k, I, Is), interval)
    let cases = [
        ("a-smooth", config(1024, 128, 4, (4, 2, 32), (2, 4, 32, 32), (8, 8, 128, 128), 4)),
        ("a", config(1024, 128, 4, (4, 2, 32), (2, 4, 32, 32), (8, 2, 128, 128), 4)),
        ("b", config(2048, 256, 6, (6, 1, 64), (3, 6, 32, 48), (16, 4, 128, 256), 3)),
        ("c", config(512, 128, 4, (8, 8, 32), (4, 4, 32, 32), (12, 3, 64, 0), 2)),
        ("d-smooth", config(768, 128, 3, (4, 2, 128), (2, 4, 64, 32), (4, 4, 128, 64), 3)),
    ];
    for (name, cfg) in &cases {
        for fmt in [Fmt::Hf, Fmt::Mlx] {
            run_case(&g, name, cfg, fmt, 130, 64, 12);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mid_size_model() {
    let g = gpu();
    // The 35B's per-layer shapes (heads, GDN, expert widths) at half width and a fifth of the depth.
    let smooth = config(32000, 1024, 8, (16, 2, 256), (16, 32, 128, 128), (16, 16, 256, 256), 4);
    let routed = config(32000, 1024, 8, (16, 2, 256), (16, 32, 128, 128), (64, 8, 256, 256), 4);
    run_case(&g, "mid-smooth", &smooth, Fmt::Mlx, 300, 128, 16);
    run_case(&g, "mid", &routed, Fmt::Mlx, 300, 128, 16);
    run_case(&g, "mid-smooth", &smooth, Fmt::Hf, 200, 128, 8);
}
