//! How sensitive are random-weight models to bf16 activations? A CPU backend that rounds every
//! matmul / MoE / attention input to bf16 (what the CUDA backend feeds its tensor cores) is
//! compared with the f32 CPU reference on the same checkpoint. Runs on the CPU only; it
//! calibrates the tolerance of the whole-model CUDA parity tests (docs/cuda.md).

mod common;

use common::*;
use orchid_cpu::CpuBackend;
use orchid_model::Model;
use orchid_model::backend::{Backend, StateOptions, StatePool};
use orchid_model::batch::{BatchLayout, LogitRows};

fn logits<B: Backend>(m: &Model<B>, ids: &[u32]) -> Vec<f32> {
    let mut st = m.new_state(StateOptions::new(1, ids.len() + 1)).unwrap();
    let s = st.alloc().unwrap();
    m.backend.to_host(&m.forward(ids, &BatchLayout::single(s, 0, ids.len()), &mut st, LogitRows::All).unwrap()).unwrap()
}

/// A calibration run (~1 min on the CPU), not a regression test: `cargo test -p orchid-cuda
/// --test bf16_sensitivity -- --ignored --nocapture` (ORCHID_SENSITIVITY_MODEL=DIR adds a checkpoint).
#[test]
#[ignore]
fn bf16_activations_vs_f32_on_random_models() {
    let cases = [
        ("a", config(1024, 128, 4, (4, 2, 32), (2, 4, 32, 32), (8, 2, 128, 128), 4)),
        ("a-allexperts", config(1024, 128, 4, (4, 2, 32), (2, 4, 32, 32), (8, 8, 128, 128), 4)),
        ("mid-4", config(4096, 1024, 4, (16, 2, 256), (16, 32, 128, 128), (64, 8, 256, 256), 4)),
        ("mid-4-allexperts", config(4096, 1024, 4, (16, 2, 256), (16, 32, 128, 128), (16, 16, 256, 256), 4)),
    ];
    for (name, cfg) in cases {
        for fmt in [Fmt::Hf, Fmt::Mlx] {
            let host = random_weights(&cfg, fmt, 99);
            let f32m = Model::new(cfg.clone(), CpuBackend::new(), &host).unwrap();
            let bfm = Model::new(cfg.clone(), Bf16Cpu(CpuBackend::new()), &host).unwrap();
            let mut rng = Rng::new(1234);
            let ids: Vec<u32> = (0..96).map(|_| rng.below(cfg.vocab_size) as u32).collect();
            let (a, b) = (logits(&f32m, &ids), logits(&bfm, &ids));
            println!("SENSITIVITY {name} {fmt:?}: bf16-input CPU vs f32 CPU logits rel_l2 {:.3e}", rel_l2(&b, &a));
        }
    }
    if let Some(dir) = std::env::var_os("ORCHID_SENSITIVITY_MODEL") {
        let dir = std::path::PathBuf::from(dir);
        let f32m = orchid_model::load_model(&dir, CpuBackend::new()).unwrap();
        let bfm = orchid_model::load_model(&dir, Bf16Cpu(CpuBackend::new())).unwrap();
        let v = f32m.config.vocab_size;
        let ids: Vec<u32> = (0..64).map(|i| (((i as u64 * 7 + 3).wrapping_mul(2654435761) & 0xffff_ffff) % v as u64) as u32).collect();
        let (a, b) = (logits(&f32m, &ids), logits(&bfm, &ids));
        println!("SENSITIVITY {}: bf16-input CPU vs f32 CPU logits rel_l2 {:.3e}", dir.display(), rel_l2(&b, &a));
    }
}
