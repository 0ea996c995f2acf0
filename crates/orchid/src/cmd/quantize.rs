//! `orchid quantize`: an HF checkpoint -> an MLX affine checkpoint in the layout mlx-lm writes
//! (`language_model.` prefix for Qwen3.5/3.6, stacked `switch_mlp` experts, norms holding 1+w,
//! conv as [C, K, 1], 8-bit router and shared-expert gate, the `quantization` config block).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use half::bf16;
use orchid_model::checkpoint::Checkpoint;
use orchid_model::config::{Family, ModelConfig};
use orchid_model::dtype::{self, DType};
use orchid_model::linear::LinearWeight;
use orchid_model::quant::{SUPPORTED_BITS, quantize_row};
use orchid_model::safetensors::OutTensor;
use orchid_model::weights::{self, HostFfn, HostMixer, HostMlp, qwen3_next_ba_order, qwen3_next_qkvz_order};
use orchid_model::writer::{CheckpointWriter, mlx_quantization_block, write_config};
use rayon::prelude::*;
use serde_json::{Value, json};

use super::synth::FloatType;

#[derive(Args)]
pub struct QuantizeArgs {
    /// HF checkpoint folder.
    #[arg(long = "in")]
    input: PathBuf,
    /// Output folder (MLX layout).
    #[arg(long)]
    out: PathBuf,
    /// Bits per weight (4 or 8).
    #[arg(long, default_value_t = 4)]
    bits: u32,
    /// MLX group size (elements per scale and bias).
    #[arg(long, default_value_t = 64)]
    group_size: usize,
    /// Storage type of scales, biases and unquantized tensors.
    #[arg(long, value_enum, default_value_t = FloatType::Bf16)]
    dtype: FloatType,
    /// Largest shard, in MB.
    #[arg(long, default_value_t = 4000)]
    shard_mb: usize,
}

struct Writer {
    w: CheckpointWriter,
    float: DType,
    bits: u32,
    group: usize,
}

impl Writer {
    fn floats(&mut self, name: String, shape: Vec<usize>, v: &[f32], dtype: DType) -> Result<()> {
        self.w.add(OutTensor { name, dtype, shape, data: dtype::from_f32(dtype, v) })?;
        Ok(())
    }

    /// Stacked matrices [lead.., rows, cols] under module path `name`: quantized when the
    /// group divides the columns (mlx-lm's rule), otherwise stored as floats.
    fn linear(&mut self, name: &str, lead: &[usize], parts: &[&LinearWeight], bits: Option<u32>) -> Result<()> {
        let (rows, cols) = (parts[0].rows, parts[0].cols);
        let shape = |last: usize| [lead, &[rows, last]].concat();
        let (bits, group) = match bits {
            Some(b) if cols % 64 == 0 => (b, 64),
            _ => (self.bits, self.group),
        };
        let all_rows: Vec<(&LinearWeight, usize)> = parts.iter().flat_map(|p| (0..p.rows).map(move |r| (*p, r))).collect();
        if cols % group != 0 {
            let mut v = vec![0f32; all_rows.len() * cols];
            v.par_chunks_mut(cols).zip(&all_rows).for_each(|(o, (p, r))| p.row_f32(*r, o));
            return self.floats(format!("{name}.weight"), shape(cols), &v, self.float);
        }
        let words = cols * bits as usize / 32;
        let groups = cols / group;
        let rows_q: Vec<(Vec<u32>, Vec<f32>, Vec<f32>)> = all_rows
            .par_iter()
            .map(|(p, r)| {
                let mut row = vec![0f32; cols];
                p.row_f32(*r, &mut row);
                if self.float == DType::BF16 {
                    // As `mlx_lm.convert --dtype bfloat16`: cast the weights, then quantize.
                    row.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
                }
                let (q, mut s, mut b) = quantize_row(&row, bits, group);
                if self.float == DType::BF16 {
                    s.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
                    b.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
                }
                (q, s, b)
            })
            .collect();
        let packed: Vec<u8> = rows_q.iter().flat_map(|(q, _, _)| q.iter().flat_map(|w| w.to_le_bytes())).collect();
        let scales: Vec<f32> = rows_q.iter().flat_map(|(_, s, _)| s.iter().copied()).collect();
        let biases: Vec<f32> = rows_q.iter().flat_map(|(_, _, b)| b.iter().copied()).collect();
        self.w.add(OutTensor { name: format!("{name}.weight"), dtype: DType::U32, shape: shape(words), data: packed })?;
        self.floats(format!("{name}.scales"), shape(groups), &scales, self.float)?;
        self.floats(format!("{name}.biases"), shape(groups), &biases, self.float)
    }

    fn mlp(&mut self, p: &str, m: &HostMlp) -> Result<()> {
        self.linear(&format!("{p}gate_proj"), &[], &[&m.gate_proj], None)?;
        self.linear(&format!("{p}up_proj"), &[], &[&m.up_proj], None)?;
        self.linear(&format!("{p}down_proj"), &[], &[&m.down_proj], None)
    }
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    if !SUPPORTED_BITS.contains(&a.bits) {
        bail!("--bits must be one of {SUPPORTED_BITS:?}");
    }
    if ![32, 64, 128].contains(&a.group_size) {
        bail!("--group-size must be 32, 64 or 128");
    }
    let t0 = std::time::Instant::now();
    let cfg = ModelConfig::load(&a.input)?;
    let ck = Checkpoint::open(&a.input)?;
    let host = weights::load(&cfg, &ck)?;
    let raw: Value = serde_json::from_str(&std::fs::read_to_string(a.input.join("config.json"))?)?;
    let float = if a.dtype == FloatType::F32 { DType::F32 } else { DType::BF16 };
    let (base, lm_head) = match cfg.family {
        Family::Qwen35Moe => ("language_model.model.", "language_model.lm_head"),
        Family::Qwen3Next => ("model.", "lm_head"),
    };
    let mut w = Writer { w: CheckpointWriter::new(&a.out, a.shard_mb << 20)?, float, bits: a.bits, group: a.group_size };
    w.linear(&format!("{base}embed_tokens"), &[], &[&host.embed], None)?;
    w.floats(format!("{base}norm.weight"), vec![cfg.hidden_size], &host.final_norm, float)?;
    if !cfg.tie_word_embeddings {
        w.linear(lm_head, &[], &[&host.lm_head], None)?;
    }
    for (i, l) in host.layers.iter().enumerate() {
        let p = format!("{base}layers.{i}.");
        w.floats(format!("{p}input_layernorm.weight"), vec![cfg.hidden_size], &l.input_norm, float)?;
        w.floats(format!("{p}post_attention_layernorm.weight"), vec![cfg.hidden_size], &l.post_norm, float)?;
        match &l.mixer {
            HostMixer::Attention(at) => {
                let sa = format!("{p}self_attn.");
                for (n, m) in [("q_proj", &at.q_proj), ("k_proj", &at.k_proj), ("v_proj", &at.v_proj), ("o_proj", &at.o_proj)] {
                    w.linear(&format!("{sa}{n}"), &[], &[m], None)?;
                }
                w.floats(format!("{sa}q_norm.weight"), vec![at.q_norm.len()], &at.q_norm, float)?;
                w.floats(format!("{sa}k_norm.weight"), vec![at.k_norm.len()], &at.k_norm, float)?;
            }
            HostMixer::DeltaNet(g) => {
                let la = format!("{p}linear_attn.");
                let d = &cfg.deltanet;
                if cfg.family == Family::Qwen3Next {
                    // Back to the fused, per-key-head interleaved order mlx-lm expects.
                    let qkvz = LinearWeight::concat_rows(&[&g.in_proj_qkv, &g.in_proj_z]);
                    let ba = LinearWeight::concat_rows(&[&g.in_proj_b, &g.in_proj_a]);
                    w.linear(&format!("{la}in_proj_qkvz"), &[], &[&qkvz.permute_rows(&inverse(&qwen3_next_qkvz_order(d)))], None)?;
                    w.linear(&format!("{la}in_proj_ba"), &[], &[&ba.permute_rows(&inverse(&qwen3_next_ba_order(d)))], None)?;
                } else {
                    for (n, m) in [
                        ("in_proj_qkv", &g.in_proj_qkv),
                        ("in_proj_z", &g.in_proj_z),
                        ("in_proj_b", &g.in_proj_b),
                        ("in_proj_a", &g.in_proj_a),
                    ] {
                        w.linear(&format!("{la}{n}"), &[], &[m], None)?;
                    }
                }
                w.linear(&format!("{la}out_proj"), &[], &[&g.out_proj], None)?;
                w.floats(format!("{la}conv1d.weight"), vec![d.conv_dim(), d.conv_kernel, 1], &g.conv, float)?;
                w.floats(format!("{la}A_log"), vec![g.a_log.len()], &g.a_log, DType::F32)?;
                w.floats(format!("{la}dt_bias"), vec![g.dt_bias.len()], &g.dt_bias, float)?;
                w.floats(format!("{la}norm.weight"), vec![g.norm.len()], &g.norm, float)?;
            }
        }
        let mp = format!("{p}mlp.");
        match &l.ffn {
            HostFfn::Dense(m) => w.mlp(&mp, m)?,
            HostFfn::Moe(m) => {
                w.linear(&format!("{mp}gate"), &[], &[&m.router], Some(8))?;
                let e = m.experts.len();
                let pick = |f: fn(&HostMlp) -> &LinearWeight| m.experts.iter().map(f).collect::<Vec<_>>();
                w.linear(&format!("{mp}switch_mlp.gate_proj"), &[e], &pick(|x| &x.gate_proj), None)?;
                w.linear(&format!("{mp}switch_mlp.up_proj"), &[e], &pick(|x| &x.up_proj), None)?;
                w.linear(&format!("{mp}switch_mlp.down_proj"), &[e], &pick(|x| &x.down_proj), None)?;
                if let (Some(s), Some(g)) = (&m.shared, &m.shared_gate) {
                    w.mlp(&format!("{mp}shared_expert."), s)?;
                    w.linear(&format!("{mp}shared_expert_gate"), &[], &[g], Some(8))?;
                }
            }
        }
    }
    let bytes = w.w.finish()?;
    write_config(&a.out, &mlx_config(raw, &cfg, base, a.bits, a.group_size))?;
    copy_side_files(&a.input, &a.out)?;
    eprintln!("wrote {:.1} MB to {} in {:.1}s", bytes as f64 / 1e6, a.out.display(), t0.elapsed().as_secs_f64());
    Ok(())
}

fn inverse(order: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; order.len()];
    for (i, &o) in order.iter().enumerate() {
        inv[o] = i;
    }
    inv
}

/// The input config in the form mlx-lm reads (the multimodal wrapper for Qwen3.5/3.6), plus
/// the quantization block.
fn mlx_config(raw: Value, cfg: &ModelConfig, base: &str, bits: u32, group: usize) -> Value {
    let mut c = if cfg.family == Family::Qwen35Moe && raw.get("text_config").is_none() {
        let mut text = raw;
        text["model_type"] = json!("qwen3_5_moe_text");
        let tie = text.get("tie_word_embeddings").cloned().unwrap_or(json!(false));
        json!({ "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                "tie_word_embeddings": tie, "text_config": text })
    } else {
        raw
    };
    let moe: Vec<bool> = cfg.dense_mlp_layers.iter().map(|d| !d).collect();
    let q = mlx_quantization_block(base, cfg.num_layers(), bits, group, &moe);
    c["quantization"] = q.clone();
    c["quantization_config"] = q;
    c
}

fn copy_side_files(from: &Path, to: &Path) -> Result<()> {
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
    ] {
        let src = from.join(f);
        if src.is_file() {
            std::fs::copy(&src, to.join(f)).with_context(|| format!("copying {}", src.display()))?;
        }
    }
    Ok(())
}
