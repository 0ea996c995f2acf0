//! Shared helpers of the GPU tests: the backend (or a skip), random inputs, random weights in
//! the HF (dense bf16) and MLX (affine 4-bit, 8-bit router) formats, error metrics.
#![allow(dead_code)]

use std::sync::OnceLock;

use half::bf16;
#[allow(unused_imports)]
pub use orchid_cuda::bf16ref::Bf16Cpu;
use orchid_model::config::{LayerKind, ModelConfig};
use orchid_model::dtype::{self, DType};
use orchid_model::linear::{AffineWeight, LinearWeight, WeightData};
use orchid_model::storage::Bytes;
use orchid_model::weights::{HostAttention, HostDeltaNet, HostFfn, HostLayer, HostMixer, HostMlp, HostMoe, HostWeights};

/// The options the GPU tests run with: the defaults, kernels cached in the temp folder.
pub fn options() -> orchid_cuda::CudaOptions {
    orchid_cuda::CudaOptions { kernel_cache: Some(std::env::temp_dir().join("orchid-kernels")), ..Default::default() }
}

/// The shared CUDA backend with `options()`. The GPU tests are `#[ignore]`d (`cargo test` on a
/// machine without a GPU reports them as ignored); run with `--ignored` where there is no GPU,
/// they fail with the reason.
pub fn gpu() -> orchid_cuda::CudaBackend {
    gpu_with(options())
}

/// Like `gpu`, with other options (the first call of a test executable decides).
pub fn gpu_with(opts: orchid_cuda::CudaOptions) -> orchid_cuda::CudaBackend {
    static B: OnceLock<orchid_cuda::CudaBackend> = OnceLock::new();
    B.get_or_init(|| {
        if let Err(why) = orchid_cuda::probe(&opts) {
            panic!("no usable GPU: {why}");
        }
        orchid_cuda::CudaBackend::new(0, &opts).expect("CUDA backend")
    })
    .clone()
}

/// Deterministic uniform numbers in [-1, 1).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E3779B97F4A7C15).wrapping_add(0x632BE59BD9B4E019))
    }
    pub fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next() * 0.5 + 0.5) * n as f32) as usize % n.max(1)
    }
}

pub fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// ‖a − b‖ / ‖b‖ in f64; NaN anywhere gives infinity.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        if !x.is_finite() || !y.is_finite() {
            return f64::INFINITY;
        }
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Prints a parity line (collected by scripts/gpu-test.sh), and asserts.
pub fn report(name: &str, err: f64, tol: f64) {
    let ok = err <= tol;
    println!("PARITY {} {name}: rel_err {err:.3e} (tol {tol:.0e})", if ok { "PASS" } else { "FAIL" });
    assert!(ok, "{name}: relative error {err:.3e} > {tol:.0e}");
}

pub fn dense_bf16(rows: usize, cols: usize, v: &[f32]) -> LinearWeight {
    LinearWeight::dense(Bytes::from_vec(dtype::from_f32(DType::BF16, v)), DType::BF16, rows, cols)
}

/// An MLX affine weight of `bits` with group 64, scales/biases in bf16.
pub fn affine(rows: usize, cols: usize, v: &[f32], bits: u32) -> LinearWeight {
    let (mut packed, mut sc, mut bi) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rows {
        let (p, s, b) = orchid_model::quant::quantize_row(&v[r * cols..(r + 1) * cols], bits, 64);
        packed.extend(p.iter().flat_map(|w| w.to_le_bytes()));
        sc.extend(s);
        bi.extend(b);
    }
    LinearWeight {
        rows,
        cols,
        data: WeightData::Affine(AffineWeight {
            packed: Bytes::from_vec(packed).aligned::<u32>(),
            scales: Bytes::from_vec(dtype::from_f32(DType::BF16, &sc)),
            biases: Bytes::from_vec(dtype::from_f32(DType::BF16, &bi)),
            sb_dtype: DType::BF16,
            bits,
            group: 64,
        }),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fmt {
    /// Dense bf16 everywhere (HF checkpoints).
    Hf,
    /// Affine 4-bit g64 where the columns allow, 8-bit router and shared gate (mlx-lm).
    Mlx,
}

pub fn linear(rng: &mut Rng, rows: usize, cols: usize, fmt: Fmt, bits: u32) -> LinearWeight {
    let v = rng.vec(rows * cols, (3.0 / cols as f32).sqrt());
    match fmt {
        Fmt::Mlx if cols.is_multiple_of(64) => affine(rows, cols, &v, bits),
        _ => dense_bf16(rows, cols, &v),
    }
}

fn norm_w(rng: &mut Rng, n: usize) -> Vec<f32> {
    rng.vec(n, 0.1).iter().map(|x| 1.0 + x).collect()
}

/// Random weights for `cfg` in `fmt`.
pub fn random_weights(cfg: &ModelConfig, fmt: Fmt, seed: u64) -> HostWeights {
    let mut rng = Rng::new(seed);
    let h = cfg.hidden_size;
    let (a, d, m) = (&cfg.attention, &cfg.deltanet, &cfg.moe);
    let embed = {
        let v = rng.vec(cfg.vocab_size * h, 1.0);
        if fmt == Fmt::Mlx && h.is_multiple_of(64) { affine(cfg.vocab_size, h, &v, 4) } else { dense_bf16(cfg.vocab_size, h, &v) }
    };
    let lm_head = linear(&mut rng, cfg.vocab_size, h, fmt, 4);
    let layers = cfg
        .layer_types
        .iter()
        .enumerate()
        .map(|(li, kind)| {
            let mixer = match kind {
                LayerKind::FullAttention => HostMixer::Attention(HostAttention {
                    q_proj: linear(&mut rng, a.q_proj_rows(), h, fmt, 4),
                    k_proj: linear(&mut rng, a.kv_rows(), h, fmt, 4),
                    v_proj: linear(&mut rng, a.kv_rows(), h, fmt, 4),
                    o_proj: linear(&mut rng, h, a.num_heads * a.head_dim, fmt, 4),
                    q_norm: norm_w(&mut rng, a.head_dim),
                    k_norm: norm_w(&mut rng, a.head_dim),
                }),
                LayerKind::LinearAttention => HostMixer::DeltaNet(HostDeltaNet {
                    in_proj_qkv: linear(&mut rng, d.conv_dim(), h, fmt, 4),
                    in_proj_z: linear(&mut rng, d.value_dim(), h, fmt, 4),
                    in_proj_b: linear(&mut rng, d.num_v_heads, h, fmt, 4),
                    in_proj_a: linear(&mut rng, d.num_v_heads, h, fmt, 4),
                    out_proj: linear(&mut rng, h, d.value_dim(), fmt, 4),
                    conv: rng.vec(d.conv_dim() * d.conv_kernel, 0.5),
                    a_log: (0..d.num_v_heads).map(|_| (1.0 + 7.5 * (rng.next() + 1.0)).ln()).collect(),
                    dt_bias: rng.vec(d.num_v_heads, 0.5),
                    norm: norm_w(&mut rng, d.v_head_dim),
                }),
            };
            let ffn = if cfg.dense_mlp_layers[li] {
                HostFfn::Dense(mlp(&mut rng, cfg.dense_intermediate, h, fmt, 4))
            } else {
                HostFfn::Moe(HostMoe {
                    router: linear(&mut rng, m.num_experts, h, fmt, 8),
                    experts: (0..m.num_experts).map(|_| mlp(&mut rng, m.intermediate, h, fmt, 4)).collect(),
                    shared: (m.shared_intermediate > 0).then(|| mlp(&mut rng, m.shared_intermediate, h, fmt, 4)),
                    shared_gate: (m.shared_intermediate > 0).then(|| linear(&mut rng, 1, h, fmt, 8)),
                })
            };
            HostLayer { input_norm: norm_w(&mut rng, h), post_norm: norm_w(&mut rng, h), mixer, ffn }
        })
        .collect();
    HostWeights { embed, lm_head, tied: false, final_norm: norm_w(&mut rng, h), layers }
}

/// A random SwiGLU MLP H → I → H (gate, up, down drawn in that order).
pub fn mlp(rng: &mut Rng, i: usize, h: usize, fmt: Fmt, bits: u32) -> HostMlp {
    HostMlp { gate_proj: linear(rng, i, h, fmt, bits), up_proj: linear(rng, i, h, fmt, bits), down_proj: linear(rng, h, i, fmt, bits) }
}

/// A Qwen3.5-MoE config.json for the given dims.
#[allow(clippy::too_many_arguments)]
pub fn config(
    vocab: usize,
    hidden: usize,
    layers: usize,
    heads: (usize, usize, usize),
    gdn: (usize, usize, usize, usize),
    experts: (usize, usize, usize, usize),
    interval: usize,
) -> ModelConfig {
    let j = format!(
        r#"{{"model_type": "qwen3_5_moe_text", "vocab_size": {vocab}, "hidden_size": {hidden}, "num_hidden_layers": {layers},
        "num_attention_heads": {}, "num_key_value_heads": {}, "head_dim": {},
        "linear_num_key_heads": {}, "linear_num_value_heads": {}, "linear_key_head_dim": {}, "linear_value_head_dim": {},
        "linear_conv_kernel_dim": 4, "num_experts": {}, "num_experts_per_tok": {}, "moe_intermediate_size": {},
        "shared_expert_intermediate_size": {}, "full_attention_interval": {interval}, "rms_norm_eps": 1e-6,
        "rope_parameters": {{"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}}}"#,
        heads.0, heads.1, heads.2, gdn.0, gdn.1, gdn.2, gdn.3, experts.0, experts.1, experts.2, experts.3
    );
    ModelConfig::from_json_str(&j).unwrap()
}
