//! Run-to-run determinism: the same prompt prefilled and then decoded (CUDA graph, greedy, free
//! running, as `orchid bench` does) twice must give bit-identical logits and tokens. The MoE
//! configs put the prefill on both grouped-GEMM tile widths: 32-token tiles (fewer than 32 tokens
//! per expert on average, the 256/512-token prompts of the 35B) and 64-token tiles.
//! Skipped without a GPU.

mod common;

use common::*;
use orchid_cuda::batch_graph::{BatchGraph, BatchRow};
use orchid_cuda::{CudaBackend, SampleParams};
use orchid_model::Model;
use orchid_model::backend::{Backend, StateOptions, StatePool};
use orchid_model::batch::{BatchLayout, LogitRows};

struct Run {
    prefill: Vec<f32>,
    decode: Vec<f32>,
    tokens: Vec<u32>,
}

fn run(m: &Model<CudaBackend>, ids: &[u32], chunk: usize, decode: usize) -> Run {
    let v = m.config.vocab_size;
    let mut st = m.new_state(StateOptions::new(1, ids.len() + decode + 8)).unwrap();
    let slot = st.alloc().unwrap();
    let mut prefill = Vec::new();
    let mut pos = 0;
    let mut last = None;
    for ch in ids.chunks(chunk) {
        let l = m.forward(ch, &BatchLayout::single(slot, pos, ch.len()), &mut st, LogitRows::All).unwrap();
        prefill.extend(m.backend.to_host(&l).unwrap());
        pos += ch.len();
        last = Some(l);
    }
    assert!(last.is_some());
    // The first token as the engine takes it (host argmax of the prompt's last logits), then the
    // one-row decode graph.
    let l = &prefill[prefill.len() - v..];
    let first = (0..v).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap() as u32;
    let mut graph = BatchGraph::new(m, &mut st, 1, true).unwrap();
    let mut row = BatchRow { slot, token: first, pos: ids.len(), index: 1, params: SampleParams::greedy(v) };
    let mut tokens = vec![first];
    let mut dec = Vec::new();
    for _ in 0..decode {
        let t = graph.step_unmasked(&mut st, std::slice::from_ref(&row)).unwrap()[0];
        tokens.push(t);
        dec.extend(graph.logits(1).unwrap());
        row = BatchRow { token: t, pos: row.pos + 1, index: row.index + 1, ..row };
    }
    Run { prefill, decode: dec, tokens }
}

fn first_diff(a: &[f32], b: &[f32], width: usize) -> Option<(usize, usize, f32, f32)> {
    a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits()).map(|i| (i / width, i % width, a[i], b[i]))
}

fn case(g: &CudaBackend, name: &str, cfg: &orchid_model::config::ModelConfig, prompt: usize, chunk: usize, decode: usize) -> bool {
    let host = random_weights(cfg, Fmt::Mlx, 7);
    let m = Model::new(cfg.clone(), g.clone(), &host).unwrap();
    drop(host);
    let v = cfg.vocab_size;
    let mut rng = Rng::new(99);
    let ids: Vec<u32> = (0..prompt).map(|_| rng.below(v) as u32).collect();
    let a = run(&m, &ids, chunk, decode);
    let mut ok = true;
    for rep in 1..3 {
        let b = run(&m, &ids, chunk, decode);
        let pre = first_diff(&a.prefill, &b.prefill, v);
        let dec = first_diff(&a.decode, &b.decode, v);
        let same_tokens = a.tokens == b.tokens;
        let pass = pre.is_none() && dec.is_none() && same_tokens;
        ok &= pass;
        println!(
            "PARITY {} determinism {name}: prompt {prompt} (chunks of {chunk}, {} tokens/expert on average), run {rep} vs 0: prefill {}, decode x{decode} {}, tokens {}",
            if pass { "PASS" } else { "FAIL" },
            chunk.min(prompt) * cfg.moe.top_k / cfg.moe.num_experts.max(1),
            pre.map_or("bit-identical".to_string(), |(r, c, x, y)| format!("differs first at row {r} col {c} ({x} vs {y})")),
            dec.map_or("bit-identical".to_string(), |(r, c, x, y)| format!("differs first at step {r} col {c} ({x} vs {y})")),
            if same_tokens { "identical".to_string() } else { format!("{:?} vs {:?}", a.tokens, b.tokens) }
        );
    }
    ok
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn same_logits_every_run() {
    let g = gpu();
    // (vocab, hidden, layers, (Hq, Hkv, D), (Hk, Hv, dk, dv), (E, k, I, Is), interval): one GDN and
    // one attention layer, 35B-like routing (8 of 128 experts).
    let cfg = config(2048, 512, 2, (8, 2, 128), (4, 8, 64, 64), (128, 8, 128, 128), 2);
    let mut ok = true;
    ok &= case(&g, "moe 32-token tiles", &cfg, 256, 256, 24);
    ok &= case(&g, "moe 64-token tiles", &cfg, 1024, 1024, 24);
    ok &= case(&g, "moe 32-token tiles, two chunks", &cfg, 512, 256, 8);
    assert!(ok, "logits differ between identical runs");
}
