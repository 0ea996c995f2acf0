//! `orchid synth`: random-weight checkpoints of any config, in HF or MLX layout, written in
//! parallel (the full Qwen3.6-35B-A3B shape in MLX 4-bit is ≈19.5 GB).
//!
//! Weights are drawn so activations stay O(1): dense rows ~ U(±√(3/in)); quantized rows get
//! uniform random codes with scales √(12/((2^b)²−1)/in) and biases centring the codes.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use half::bf16;
use orchid_engine::sampling::Rng;
use orchid_model::config::{Family, LayerKind, ModelConfig};
use orchid_model::dtype::DType;
use orchid_model::safetensors::OutTensor;
use orchid_model::writer::{CheckpointWriter, mlx_quantization_block, write_config};
use rayon::prelude::*;
use serde_json::{Value, json};

use super::presets;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Hugging Face layout (fused stacked experts for Qwen3.5/3.6; per-expert for Qwen3-Next).
    Hf,
    /// Hugging Face layout with one tensor per expert and a text-only config.
    HfPerExpert,
    /// MLX affine 4-bit (8-bit router and shared-expert gate), as mlx-lm writes it.
    Mlx4,
    /// MLX affine 8-bit.
    Mlx8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FloatType {
    Bf16,
    F32,
}

#[derive(Args)]
pub struct SynthArgs {
    /// A named config (see --list), or ...
    #[arg(long, conflicts_with = "config", required_unless_present_any = ["config", "list"])]
    preset: Option<String>,
    /// ... a config.json of your own.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Checkpoint layout.
    #[arg(long, value_enum, default_value_t = Format::Hf)]
    format: Format,
    /// Storage type of unquantized float tensors (and of MLX scales/biases).
    #[arg(long, value_enum, default_value_t = FloatType::Bf16)]
    dtype: FloatType,
    /// MLX group size.
    #[arg(long, default_value_t = 64)]
    group_size: usize,
    /// Output folder.
    #[arg(long, required_unless_present = "list")]
    out: Option<PathBuf>,
    /// Copy tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json
    /// from here (default: the family's tokenizer bundled in the repository's assets/, so that the
    /// checkpoint runs as it is).
    #[arg(long)]
    tokenizer_dir: Option<PathBuf>,
    /// Write no tokenizer files (a checkpoint for weight-level tests only).
    #[arg(long, conflicts_with = "tokenizer_dir")]
    no_tokenizer: bool,
    /// Largest shard, in MB.
    #[arg(long, default_value_t = 4000)]
    shard_mb: usize,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// List the presets with their size on disk in each format.
    #[arg(long)]
    list: bool,
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Init {
    Dense {
        fan_in: usize,
    },
    /// HF norm offsets (multiplier 1+w).
    NormOffset,
    /// Plain multipliers around 1 (MLX norms, the GDN gated norm).
    NormOne,
    ALog,
    DtBias,
    Conv,
    Codes,
    Scales {
        fan_in: usize,
        bits: u32,
    },
    Biases {
        fan_in: usize,
        bits: u32,
    },
}

struct Spec {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    init: Init,
}

struct Layout {
    base: &'static str,
    lm_head: &'static str,
    mlx: bool,
    quant: Option<(u32, usize)>,
    fused_experts: bool,
    float: DType,
}

impl Layout {
    fn push(&self, s: &mut Vec<Spec>, name: String, shape: Vec<usize>, init: Init) {
        s.push(Spec { name, dtype: self.float, shape, init });
    }

    /// A weight matrix `[lead.., rows, cols]`: quantized under MLX when `cols` splits into groups.
    fn linear(&self, s: &mut Vec<Spec>, module: &str, lead: &[usize], rows: usize, cols: usize, bits_override: Option<u32>) {
        let shape = |last: usize| [lead, &[rows, last]].concat();
        match self.quant {
            Some((bits, group)) if cols.is_multiple_of(group) => {
                let (bits, group) = match bits_override {
                    Some(b) if cols.is_multiple_of(64) => (b, 64),
                    _ => (bits, group),
                };
                s.push(Spec {
                    name: format!("{module}.weight"),
                    dtype: DType::U32,
                    shape: shape(cols * bits as usize / 32),
                    init: Init::Codes,
                });
                for (suffix, init) in [("scales", Init::Scales { fan_in: cols, bits }), ("biases", Init::Biases { fan_in: cols, bits })] {
                    s.push(Spec { name: format!("{module}.{suffix}"), dtype: self.float, shape: shape(cols / group), init });
                }
            }
            _ => self.push(s, format!("{module}.weight"), shape(cols), Init::Dense { fan_in: cols }),
        }
    }

    fn norm(&self, s: &mut Vec<Spec>, name: String, n: usize) {
        self.push(s, name, vec![n], if self.mlx { Init::NormOne } else { Init::NormOffset });
    }
}

fn specs(cfg: &ModelConfig, l: &Layout) -> Vec<Spec> {
    let mut s = Vec::new();
    let (h, a, d, m) = (cfg.hidden_size, &cfg.attention, &cfg.deltanet, &cfg.moe);
    let b = l.base;
    l.linear(&mut s, &format!("{b}embed_tokens"), &[], cfg.vocab_size, h, None);
    l.norm(&mut s, format!("{b}norm.weight"), h);
    if !cfg.tie_word_embeddings {
        l.linear(&mut s, l.lm_head, &[], cfg.vocab_size, h, None);
    }
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        let p = format!("{b}layers.{i}.");
        l.norm(&mut s, format!("{p}input_layernorm.weight"), h);
        l.norm(&mut s, format!("{p}post_attention_layernorm.weight"), h);
        match kind {
            LayerKind::FullAttention => {
                let sa = format!("{p}self_attn.");
                l.linear(&mut s, &format!("{sa}q_proj"), &[], a.q_proj_rows(), h, None);
                l.linear(&mut s, &format!("{sa}k_proj"), &[], a.kv_rows(), h, None);
                l.linear(&mut s, &format!("{sa}v_proj"), &[], a.kv_rows(), h, None);
                l.linear(&mut s, &format!("{sa}o_proj"), &[], h, a.num_heads * a.head_dim, None);
                l.norm(&mut s, format!("{sa}q_norm.weight"), a.head_dim);
                l.norm(&mut s, format!("{sa}k_norm.weight"), a.head_dim);
            }
            LayerKind::LinearAttention => {
                let la = format!("{p}linear_attn.");
                let (kd, vd, hv) = (d.key_dim(), d.value_dim(), d.num_v_heads);
                if cfg.family == Family::Qwen3Next {
                    l.linear(&mut s, &format!("{la}in_proj_qkvz"), &[], 2 * kd + 2 * vd, h, None);
                    l.linear(&mut s, &format!("{la}in_proj_ba"), &[], 2 * hv, h, None);
                } else {
                    l.linear(&mut s, &format!("{la}in_proj_qkv"), &[], d.conv_dim(), h, None);
                    l.linear(&mut s, &format!("{la}in_proj_z"), &[], vd, h, None);
                    l.linear(&mut s, &format!("{la}in_proj_b"), &[], hv, h, None);
                    l.linear(&mut s, &format!("{la}in_proj_a"), &[], hv, h, None);
                }
                l.linear(&mut s, &format!("{la}out_proj"), &[], h, vd, None);
                let conv = if l.mlx { vec![d.conv_dim(), d.conv_kernel, 1] } else { vec![d.conv_dim(), 1, d.conv_kernel] };
                l.push(&mut s, format!("{la}conv1d.weight"), conv, Init::Conv);
                s.push(Spec { name: format!("{la}A_log"), dtype: DType::F32, shape: vec![hv], init: Init::ALog });
                l.push(&mut s, format!("{la}dt_bias"), vec![hv], Init::DtBias);
                s.push(Spec { name: format!("{la}norm.weight"), dtype: DType::F32, shape: vec![d.v_head_dim], init: Init::NormOne });
            }
        }
        let mp = format!("{p}mlp.");
        if cfg.dense_mlp_layers[i] {
            let n = cfg.dense_intermediate;
            l.linear(&mut s, &format!("{mp}gate_proj"), &[], n, h, None);
            l.linear(&mut s, &format!("{mp}up_proj"), &[], n, h, None);
            l.linear(&mut s, &format!("{mp}down_proj"), &[], h, n, None);
            continue;
        }
        let (e, n) = (m.num_experts, m.intermediate);
        l.linear(&mut s, &format!("{mp}gate"), &[], e, h, Some(8));
        if l.mlx {
            l.linear(&mut s, &format!("{mp}switch_mlp.gate_proj"), &[e], n, h, None);
            l.linear(&mut s, &format!("{mp}switch_mlp.up_proj"), &[e], n, h, None);
            l.linear(&mut s, &format!("{mp}switch_mlp.down_proj"), &[e], h, n, None);
        } else if l.fused_experts {
            l.push(&mut s, format!("{mp}experts.gate_up_proj"), vec![e, 2 * n, h], Init::Dense { fan_in: h });
            l.push(&mut s, format!("{mp}experts.down_proj"), vec![e, h, n], Init::Dense { fan_in: n });
        } else {
            for x in 0..e {
                l.linear(&mut s, &format!("{mp}experts.{x}.gate_proj"), &[], n, h, None);
                l.linear(&mut s, &format!("{mp}experts.{x}.up_proj"), &[], n, h, None);
                l.linear(&mut s, &format!("{mp}experts.{x}.down_proj"), &[], h, n, None);
            }
        }
        if m.shared_intermediate > 0 {
            let n = m.shared_intermediate;
            l.linear(&mut s, &format!("{mp}shared_expert.gate_proj"), &[], n, h, None);
            l.linear(&mut s, &format!("{mp}shared_expert.up_proj"), &[], n, h, None);
            l.linear(&mut s, &format!("{mp}shared_expert.down_proj"), &[], h, n, None);
            l.linear(&mut s, &format!("{mp}shared_expert_gate"), &[], 1, h, Some(8));
        }
    }
    s
}

fn fill(spec: &Spec, seed: u64) -> Vec<u8> {
    let numel: usize = spec.shape.iter().product();
    const CHUNK: usize = 1 << 20;
    let mut out = vec![0u8; numel * spec.dtype.size()];
    let name_hash = spec.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    out.par_chunks_mut(CHUNK * spec.dtype.size()).enumerate().for_each(|(ci, bytes)| {
        let mut rng = Rng::new(seed ^ name_hash ^ (ci as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        if spec.dtype == DType::U32 {
            for w in bytes.chunks_exact_mut(8) {
                w.copy_from_slice(&rng.next_u64().to_le_bytes());
            }
            return;
        }
        let n = bytes.len() / spec.dtype.size();
        let mut u = || rng.next_f64() as f32;
        let vals: Vec<f32> = (0..n)
            .map(|_| match spec.init {
                Init::Dense { fan_in } => (2.0 * u() - 1.0) * (3.0 / fan_in as f32).sqrt(),
                Init::NormOffset => 0.2 * u() - 0.1,
                Init::NormOne => 0.9 + 0.2 * u(),
                Init::ALog => (1.0 + 15.0 * u()).ln(),
                Init::DtBias => 0.5 + u(),
                Init::Conv => u() - 0.5,
                Init::Scales { fan_in, bits } => quant_scale(fan_in, bits) * (0.9 + 0.2 * u()),
                Init::Biases { fan_in, bits } => -quant_scale(fan_in, bits) * ((1u32 << bits) - 1) as f32 / 2.0,
                Init::Codes => unreachable!(),
            })
            .collect();
        match spec.dtype {
            DType::F32 => bytes.copy_from_slice(bytemuck_f32(&vals)),
            _ => {
                for (c, v) in bytes.chunks_exact_mut(2).zip(&vals) {
                    c.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
                }
            }
        }
    });
    out
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern of it is valid as u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }
}

/// Scale giving dequantized weights of variance 1/fan_in for uniform codes.
fn quant_scale(fan_in: usize, bits: u32) -> f32 {
    let levels = (1u64 << bits) as f32;
    (12.0 / (levels * levels - 1.0) / fan_in as f32).sqrt()
}

/// The tensor layout of `format` for a config of `family`.
fn layout(format: Format, family: Family, float: DType, group_size: usize) -> Layout {
    let qwen35 = family == Family::Qwen35Moe;
    let mlx = matches!(format, Format::Mlx4 | Format::Mlx8);
    let bits = if format == Format::Mlx8 { 8 } else { 4 };
    match (format, qwen35) {
        (Format::Hf, true) => Layout { base: "model.language_model.", lm_head: "lm_head", mlx, quant: None, fused_experts: true, float },
        (Format::Hf | Format::HfPerExpert, _) => {
            Layout { base: "model.", lm_head: "lm_head", mlx, quant: None, fused_experts: false, float }
        }
        (_, true) => Layout {
            base: "language_model.model.",
            lm_head: "language_model.lm_head",
            mlx,
            quant: Some((bits, group_size)),
            fused_experts: false,
            float,
        },
        (_, false) => Layout { base: "model.", lm_head: "lm_head", mlx, quant: Some((bits, group_size)), fused_experts: false, float },
    }
}

/// Bytes of the tensors of `specs`.
fn tensor_bytes(specs: &[Spec]) -> usize {
    specs.iter().map(|s| s.shape.iter().product::<usize>() * s.dtype.size()).sum()
}

/// `--list`: every preset with its size on disk in the bf16 HF layout and in MLX 4- and 8-bit.
fn list() -> Result<()> {
    println!("{:<20} {:>10} {:>10} {:>10}", "preset", "hf (bf16)", "mlx4", "mlx8");
    for name in presets::NAMES {
        let cfg = ModelConfig::from_json_str(&presets::config(name).context("preset")?.to_string())?;
        let gb = |f: Format| tensor_bytes(&specs(&cfg, &layout(f, cfg.family, DType::BF16, 64))) as f64 / 1e9;
        println!("{name:<20} {:>8.2} GB {:>7.2} GB {:>7.2} GB", gb(Format::Hf), gb(Format::Mlx4), gb(Format::Mlx8));
    }
    Ok(())
}

pub fn run(a: SynthArgs) -> Result<()> {
    if a.list {
        return list();
    }
    let mut config: Value = match (&a.preset, &a.config) {
        (Some(p), _) => presets::config(p).with_context(|| format!("unknown preset `{p}` (try --list)"))?,
        (None, Some(f)) => serde_json::from_str(&std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?)
            .with_context(|| format!("{}: invalid JSON", f.display()))?,
        _ => bail!("give --preset or --config"),
    };
    let cfg = ModelConfig::from_json_str(&config.to_string())?;
    let out = a.out.clone().context("--out is required")?;
    let float = if a.dtype == FloatType::F32 { DType::F32 } else { DType::BF16 };
    let layout = layout(a.format, cfg.family, float, a.group_size);
    if a.format == Format::HfPerExpert && cfg.family == Family::Qwen35Moe {
        // transformers' text-only form.
        let mut t = config["text_config"].clone();
        t["architectures"] = json!(["Qwen3_5MoeForCausalLM"]);
        t["model_type"] = json!("qwen3_5_moe_text");
        config = t;
    }
    if let Some((bits, group)) = layout.quant {
        let moe_layers: Vec<bool> = cfg.dense_mlp_layers.iter().map(|d| !d).collect();
        let q = mlx_quantization_block(layout.base, cfg.num_layers(), bits, group, &moe_layers);
        config["quantization"] = q.clone();
        config["quantization_config"] = q;
    }
    let specs = specs(&cfg, &layout);
    let t0 = std::time::Instant::now();
    let mut w = CheckpointWriter::new(&out, a.shard_mb << 20)?;
    for s in &specs {
        let data = fill(s, a.seed);
        w.add(OutTensor { name: s.name.clone(), dtype: s.dtype, shape: s.shape.clone(), data })?;
    }
    let bytes = w.finish()?;
    write_config(&out, &config)?;
    copy_tokenizer(&a, &out, &cfg)?;
    eprintln!("wrote {} tensors, {:.2} GB to {} in {:.1}s", specs.len(), bytes as f64 / 1e9, out.display(), t0.elapsed().as_secs_f64());
    Ok(())
}

/// The tokenizer files: from --tokenizer-dir, else the family's bundled tokenizer (when its ids
/// fit the config's vocabulary), plus a generation_config.json when none was copied.
fn copy_tokenizer(a: &SynthArgs, out: &std::path::Path, cfg: &ModelConfig) -> Result<()> {
    let (bundled, tokenizer_vocab, eos) = match cfg.family {
        Family::Qwen35Moe => ("qwen3.5", 248_077, vec![248046, 248044]),
        Family::Qwen3Next => ("qwen3", 151_669, vec![151645, 151643]),
    };
    let dir = match &a.tokenizer_dir {
        Some(d) => Some(d.clone()),
        None if a.no_tokenizer => None,
        None if cfg.vocab_size < tokenizer_vocab => {
            eprintln!("note: vocab_size {} is smaller than the {bundled} tokenizer's; no tokenizer written", cfg.vocab_size);
            None
        }
        None => Some(super::common::bundled_asset(bundled).with_context(|| {
            format!("the bundled {bundled} tokenizer (assets/{bundled}) was not found; give --tokenizer-dir or --no-tokenizer")
        })?),
    };
    let mut have_gen = false;
    if let Some(dir) = dir {
        for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt"] {
            let src = dir.join(f);
            if src.is_file() {
                std::fs::copy(&src, out.join(f)).with_context(|| format!("copying {}", src.display()))?;
                have_gen |= f == "generation_config.json";
            }
        }
    }
    if !have_gen {
        let g = json!({ "eos_token_id": eos, "do_sample": true, "temperature": 1.0, "top_p": 0.95, "top_k": 20 });
        std::fs::write(out.join("generation_config.json"), serde_json::to_string_pretty(&g)? + "\n")?;
    }
    Ok(())
}
