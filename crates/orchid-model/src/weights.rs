//! The one name-mapping step: any supported checkpoint layout -> canonical [`HostWeights`].
//!
//! Layouts (docs/model.md §7): HF official (`model.language_model.` prefix, fused stacked
//! `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]), HF per expert
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`), HF text-only (`model.` prefix), Qwen3-Next
//! (interleaved `in_proj_qkvz` / `in_proj_ba`), and MLX (`language_model.` prefix, stacked
//! `switch_mlp`, affine-quantized triplets, norms already holding 1+w, conv as [C, K, 1]).
//! Canonical form: norms are f32 multipliers, the GDN projections are split q|k|v, z, b, a,
//! experts are per-expert row views into the mapped file (no copies).

use crate::checkpoint::Checkpoint;
use crate::config::{LayerKind, ModelConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::linear::{AffineWeight, LinearWeight, WeightData};
use crate::quant::SUPPORTED_BITS;
use crate::safetensors::TensorView;

pub struct HostWeights {
    /// [vocab, hidden]
    pub embed: LinearWeight,
    /// [vocab, hidden] (the embedding table itself when tied)
    pub lm_head: LinearWeight,
    pub tied: bool,
    pub final_norm: Vec<f32>,
    pub layers: Vec<HostLayer>,
}

pub struct HostLayer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: HostMixer,
    pub ffn: HostFfn,
}

pub enum HostMixer {
    Attention(HostAttention),
    DeltaNet(HostDeltaNet),
}

pub struct HostAttention {
    /// [Hq·D·(1+gate), H], per head [query | gate] rows.
    pub q_proj: LinearWeight,
    pub k_proj: LinearWeight,
    pub v_proj: LinearWeight,
    pub o_proj: LinearWeight,
    /// [D] multipliers.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

pub struct HostDeltaNet {
    /// [2·Hk·dk + Hv·dv, H]: q | k | v.
    pub in_proj_qkv: LinearWeight,
    /// [Hv·dv, H]
    pub in_proj_z: LinearWeight,
    /// [Hv, H]
    pub in_proj_b: LinearWeight,
    /// [Hv, H]
    pub in_proj_a: LinearWeight,
    /// [H, Hv·dv]
    pub out_proj: LinearWeight,
    /// [C, K] depthwise taps; tap K-1 multiplies the current token.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// [dv] plain multiplier of the gated RMSNorm.
    pub norm: Vec<f32>,
}

#[allow(clippy::large_enum_variant)] // one per layer, built once at load
pub enum HostFfn {
    Moe(HostMoe),
    Dense(HostMlp),
}

#[derive(Clone)]
pub struct HostMlp {
    pub gate_proj: LinearWeight,
    pub up_proj: LinearWeight,
    pub down_proj: LinearWeight,
}

pub struct HostMoe {
    /// [E, H]
    pub router: LinearWeight,
    /// Per expert: gate [I, H], up [I, H], down [H, I].
    pub experts: Vec<HostMlp>,
    pub shared: Option<HostMlp>,
    /// [1, H]
    pub shared_gate: Option<LinearWeight>,
}

/// Qwen3-Next's fused `in_proj_qkvz` holds, per key head g, rows [q_g | k_g | v_g | z_g]
/// (v_g and z_g cover that key head's Hv/Hk value heads). Row i of the canonical
/// [q_all | k_all | v_all | z_all] matrix is row `order[i]` of the fused one.
pub fn qwen3_next_qkvz_order(d: &crate::config::DeltaNetDims) -> Vec<usize> {
    let (dk, rv) = (d.k_head_dim, d.v_per_k() * d.v_head_dim);
    let g_rows = 2 * dk + 2 * rv;
    let mut order = Vec::with_capacity(d.num_k_heads * g_rows);
    for (off, len) in [(0, dk), (dk, dk), (2 * dk, rv), (2 * dk + rv, rv)] {
        for g in 0..d.num_k_heads {
            order.extend((0..len).map(|i| g * g_rows + off + i));
        }
    }
    order
}

/// The same for `in_proj_ba`: per key head [b_g | a_g] -> canonical [b_all | a_all].
pub fn qwen3_next_ba_order(d: &crate::config::DeltaNetDims) -> Vec<usize> {
    let r = d.v_per_k();
    let mut order = Vec::with_capacity(2 * d.num_v_heads);
    for off in [0, r] {
        for g in 0..d.num_k_heads {
            order.extend((0..r).map(|i| g * 2 * r + off + i));
        }
    }
    order
}

/// How names are spelled in this checkpoint.
struct Naming {
    base: &'static str,
    lm_head: &'static str,
    /// MLX files store RMSNorm multipliers (1+w) already.
    norms_baked: bool,
}

struct Loader<'a> {
    ck: &'a Checkpoint,
    cfg: &'a ModelConfig,
    naming: Naming,
}

pub fn load(cfg: &ModelConfig, ck: &Checkpoint) -> Result<HostWeights> {
    let (base, lm_head) = if ck.contains("language_model.model.embed_tokens.weight") {
        ("language_model.model.", "language_model.lm_head")
    } else if ck.contains("model.language_model.embed_tokens.weight") {
        ("model.language_model.", "lm_head")
    } else if ck.contains("model.embed_tokens.weight") {
        ("model.", "lm_head")
    } else {
        return Err(Error::tensor(
            &ck.dir,
            "model.language_model.embed_tokens.weight",
            "missing: no embedding table under any known prefix (model.language_model., model., language_model.model.)",
        ));
    };
    // mlx-lm's rule: a file whose conv1d weights are already in MLX layout [C, K, 1] was
    // written by MLX, which bakes 1+w into the RMSNorm weights.
    let mlx_conv = ck
        .names()
        .filter(|n| n.ends_with("linear_attn.conv1d.weight"))
        .filter_map(|n| ck.get(n))
        .map(|t| t.shape.len() == 3 && t.shape[2] == 1 && t.shape[1] > 1)
        .collect::<Vec<bool>>();
    let norms_baked = if mlx_conv.is_empty() { base == "language_model.model." } else { mlx_conv.contains(&true) };
    let l = Loader { ck, cfg, naming: Naming { base, lm_head, norms_baked } };
    l.load_all()
}

impl Loader<'_> {
    fn load_all(&self) -> Result<HostWeights> {
        let c = self.cfg;
        let h = c.hidden_size;
        let base = self.naming.base;
        let embed = self.linear(&format!("{base}embed_tokens"), c.vocab_size, h)?;
        let tied = c.tie_word_embeddings && !self.ck.contains(&format!("{}.weight", self.naming.lm_head));
        let lm_head = if tied { embed.clone() } else { self.linear(self.naming.lm_head, c.vocab_size, h)? };
        let final_norm = self.norm(&format!("{base}norm.weight"), h, true)?;
        let layers = (0..c.num_layers()).map(|i| self.layer(i)).collect::<Result<Vec<_>>>()?;
        Ok(HostWeights { embed, lm_head, tied, final_norm, layers })
    }

    fn layer(&self, i: usize) -> Result<HostLayer> {
        let c = self.cfg;
        let p = format!("{}layers.{i}.", self.naming.base);
        let mixer = match c.layer_types[i] {
            LayerKind::FullAttention => HostMixer::Attention(self.attention(&p)?),
            LayerKind::LinearAttention => HostMixer::DeltaNet(self.deltanet(&p)?),
        };
        let ffn = if c.dense_mlp_layers[i] {
            HostFfn::Dense(self.mlp(&format!("{p}mlp."), c.dense_intermediate)?)
        } else {
            HostFfn::Moe(self.moe(&p)?)
        };
        Ok(HostLayer {
            input_norm: self.norm(&format!("{p}input_layernorm.weight"), c.hidden_size, true)?,
            post_norm: self.norm(&format!("{p}post_attention_layernorm.weight"), c.hidden_size, true)?,
            mixer,
            ffn,
        })
    }

    fn attention(&self, p: &str) -> Result<HostAttention> {
        let a = &self.cfg.attention;
        let h = self.cfg.hidden_size;
        Ok(HostAttention {
            q_proj: self.linear(&format!("{p}self_attn.q_proj"), a.q_proj_rows(), h)?,
            k_proj: self.linear(&format!("{p}self_attn.k_proj"), a.kv_rows(), h)?,
            v_proj: self.linear(&format!("{p}self_attn.v_proj"), a.kv_rows(), h)?,
            o_proj: self.linear(&format!("{p}self_attn.o_proj"), h, a.num_heads * a.head_dim)?,
            q_norm: self.norm(&format!("{p}self_attn.q_norm.weight"), a.head_dim, true)?,
            k_norm: self.norm(&format!("{p}self_attn.k_norm.weight"), a.head_dim, true)?,
        })
    }

    fn deltanet(&self, p: &str) -> Result<HostDeltaNet> {
        let d = &self.cfg.deltanet;
        let h = self.cfg.hidden_size;
        let (kd, vd, hv) = (d.key_dim(), d.value_dim(), d.num_v_heads);
        let la = format!("{p}linear_attn.");
        let (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) = if self.has_module(&format!("{la}in_proj_qkvz")) {
            // Qwen3-Next: per key-head groups [q_g | k_g | v_g (r·dv) | z_g (r·dv)] and [b_g (r) | a_g (r)].
            let qkvz = self.linear(&format!("{la}in_proj_qkvz"), 2 * kd + 2 * vd, h)?;
            let ba = self.linear(&format!("{la}in_proj_ba"), 2 * hv, h)?;
            let qkvz = qkvz.permute_rows(&qwen3_next_qkvz_order(d));
            let ba = ba.permute_rows(&qwen3_next_ba_order(d));
            (
                qkvz.rows_range(0..2 * kd + vd),
                qkvz.rows_range(2 * kd + vd..2 * kd + 2 * vd),
                ba.rows_range(0..hv),
                ba.rows_range(hv..2 * hv),
            )
        } else {
            (
                self.linear(&format!("{la}in_proj_qkv"), d.conv_dim(), h)?,
                self.linear(&format!("{la}in_proj_z"), vd, h)?,
                self.linear(&format!("{la}in_proj_b"), hv, h)?,
                self.linear(&format!("{la}in_proj_a"), hv, h)?,
            )
        };
        // conv1d: HF [C, 1, K], MLX [C, K, 1]; both hold C×K taps in the same order.
        let conv_t = self.ck.require(&format!("{la}conv1d.weight"))?;
        conv_t.expect_float()?;
        let (c, k) = (d.conv_dim(), d.conv_kernel);
        if conv_t.shape != [c, 1, k] && conv_t.shape != [c, k, 1] && conv_t.shape != [c, k] {
            return Err(conv_t.err(format!("expected shape [{c}, 1, {k}] (HF) or [{c}, {k}, 1] (MLX), found {:?}", conv_t.shape)));
        }
        Ok(HostDeltaNet {
            in_proj_qkv,
            in_proj_z,
            in_proj_b,
            in_proj_a,
            out_proj: self.linear(&format!("{la}out_proj"), h, vd)?,
            conv: conv_t.to_f32()?,
            a_log: self.vector(&format!("{la}A_log"), hv)?,
            dt_bias: self.vector(&format!("{la}dt_bias"), hv)?,
            norm: self.vector(&format!("{la}norm.weight"), d.v_head_dim)?,
        })
    }

    fn mlp(&self, p: &str, inter: usize) -> Result<HostMlp> {
        let h = self.cfg.hidden_size;
        Ok(HostMlp {
            gate_proj: self.linear(&format!("{p}gate_proj"), inter, h)?,
            up_proj: self.linear(&format!("{p}up_proj"), inter, h)?,
            down_proj: self.linear(&format!("{p}down_proj"), h, inter)?,
        })
    }

    fn moe(&self, p: &str) -> Result<HostMoe> {
        let m = &self.cfg.moe;
        let (h, e, i) = (self.cfg.hidden_size, m.num_experts, m.intermediate);
        let mp = format!("{p}mlp.");
        let experts = if self.ck.contains(&format!("{mp}experts.gate_up_proj")) {
            // HF official: fused and stacked, gate = first I rows of each expert, up = last I.
            let gu = self.stacked_dense(&format!("{mp}experts.gate_up_proj"), e, 2 * i, h)?;
            let down = self.stacked_dense(&format!("{mp}experts.down_proj"), e, h, i)?;
            (0..e)
                .map(|x| HostMlp {
                    gate_proj: gu.rows_range(x * 2 * i..x * 2 * i + i),
                    up_proj: gu.rows_range(x * 2 * i + i..(x + 1) * 2 * i),
                    down_proj: down.rows_range(x * h..(x + 1) * h),
                })
                .collect()
        } else if self.has_module(&format!("{mp}switch_mlp.gate_proj")) {
            // MLX: stacked [E, rows, cols] (dense or quantized), one view per expert.
            let gate = self.stacked(&format!("{mp}switch_mlp.gate_proj"), e, i, h)?;
            let up = self.stacked(&format!("{mp}switch_mlp.up_proj"), e, i, h)?;
            let down = self.stacked(&format!("{mp}switch_mlp.down_proj"), e, h, i)?;
            (0..e)
                .map(|x| HostMlp {
                    gate_proj: gate.rows_range(x * i..(x + 1) * i),
                    up_proj: up.rows_range(x * i..(x + 1) * i),
                    down_proj: down.rows_range(x * h..(x + 1) * h),
                })
                .collect()
        } else {
            (0..e).map(|x| self.mlp(&format!("{mp}experts.{x}."), i)).collect::<Result<Vec<_>>>()?
        };
        let (shared, shared_gate) = if m.shared_intermediate > 0 {
            (
                Some(self.mlp(&format!("{mp}shared_expert."), m.shared_intermediate)?),
                Some(self.linear(&format!("{mp}shared_expert_gate"), 1, h)?),
            )
        } else {
            (None, None)
        };
        Ok(HostMoe { router: self.linear(&format!("{mp}gate"), e, h)?, experts, shared, shared_gate })
    }

    fn has_module(&self, name: &str) -> bool {
        self.ck.contains(&format!("{name}.weight")) || self.ck.contains(name)
    }

    /// `name.weight` as a float tensor of `shape` -> f32.
    fn float(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.ck.require(name)?;
        t.expect_float()?;
        let numel: usize = shape.iter().product();
        if t.numel() != numel || (t.shape.len() == shape.len() && t.shape != shape) {
            return Err(t.err(format!("expected shape {shape:?}, found {:?}", t.shape)));
        }
        t.to_f32()
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        self.float(name, &[n])
    }

    /// An RMSNorm multiplier: 1+w for HF offset norms, as stored for MLX files.
    fn norm(&self, name: &str, n: usize, offset: bool) -> Result<Vec<f32>> {
        let mut w = self.vector(name, n)?;
        if offset && !self.naming.norms_baked {
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(w)
    }

    /// A [rows, cols] matrix called `name` (a module path; `name.weight`, plus
    /// `name.scales`/`name.biases` when MLX-quantized).
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<LinearWeight> {
        self.stacked(name, 1, rows, cols)
    }

    /// E matrices [rows, cols] stacked along dim 0 (E = 1 for a plain linear), returned as one
    /// [E·rows, cols] matrix.
    fn stacked(&self, name: &str, e: usize, rows: usize, cols: usize) -> Result<LinearWeight> {
        let wname = format!("{name}.weight");
        let lead: Vec<usize> = if e == 1 { vec![] } else { vec![e] };
        let shape = |last: usize| [lead.clone(), vec![rows, last]].concat();
        if let Some(scales) = self.ck.get(&format!("{name}.scales")) {
            let w = self.ck.require(&wname)?;
            let biases = self.ck.require(&format!("{name}.biases"))?;
            if w.dtype != DType::U32 {
                return Err(w.err(format!("quantized weight must be U32, found {:?}", w.dtype)));
            }
            scales.expect_float()?;
            let (Some(&sc_cols), Some(&w_cols)) = (scales.shape.last(), w.shape.last()) else {
                return Err(scales.err("scalar shape"));
            };
            if sc_cols == 0 || !cols.is_multiple_of(sc_cols) {
                return Err(scales.err(format!("{sc_cols} groups do not divide {cols} input features")));
            }
            let group = cols / sc_cols;
            let bits = (w_cols * 32 / cols) as u32;
            if !SUPPORTED_BITS.contains(&bits) || w_cols * 32 != cols * bits as usize {
                return Err(w.err(format!("{w_cols} packed words per row of {cols} inputs: unsupported bit width")));
            }
            if !group.is_multiple_of(32 / bits as usize) {
                return Err(scales.err(format!("group size {group} does not pack into words of {bits}-bit values")));
            }
            w.expect_shape(&shape(w_cols))?;
            scales.expect_shape(&shape(sc_cols))?;
            biases.expect_shape(&shape(sc_cols))?;
            if biases.dtype != scales.dtype {
                return Err(biases.err(format!("dtype {:?} differs from scales {:?}", biases.dtype, scales.dtype)));
            }
            return Ok(LinearWeight {
                rows: e * rows,
                cols,
                data: WeightData::Affine(AffineWeight {
                    packed: w.bytes.aligned::<u32>(),
                    scales: scales.bytes.clone(),
                    biases: biases.bytes.clone(),
                    sb_dtype: scales.dtype,
                    bits,
                    group,
                }),
            });
        }
        let w = self
            .ck
            .get(&wname)
            .or_else(|| self.ck.get(name))
            .ok_or_else(|| Error::tensor(&self.ck.dir, &wname, "missing from the checkpoint"))?;
        self.dense_view(w, e, rows, cols, &shape(cols))
    }

    /// A stacked dense tensor with no `.weight` suffix (HF fused experts).
    fn stacked_dense(&self, name: &str, e: usize, rows: usize, cols: usize) -> Result<LinearWeight> {
        let t = self.ck.require(name)?;
        self.dense_view(t, e, rows, cols, &[e, rows, cols])
    }

    fn dense_view(&self, t: &TensorView, e: usize, rows: usize, cols: usize, shape: &[usize]) -> Result<LinearWeight> {
        t.expect_float()?;
        t.expect_shape(shape)?;
        let data = match t.dtype {
            DType::F32 => t.bytes.aligned::<f32>(),
            _ => t.bytes.aligned::<u16>(),
        };
        Ok(LinearWeight::dense(data, t.dtype, e * rows, cols))
    }
}

impl HostWeights {
    /// Bytes of weights (for the startup log and memory accounting).
    pub fn nbytes(&self) -> usize {
        let mlp = |m: &HostMlp| m.gate_proj.nbytes() + m.up_proj.nbytes() + m.down_proj.nbytes();
        let mut n = self.embed.nbytes() + if self.tied { 0 } else { self.lm_head.nbytes() };
        for l in &self.layers {
            n += match &l.mixer {
                HostMixer::Attention(a) => a.q_proj.nbytes() + a.k_proj.nbytes() + a.v_proj.nbytes() + a.o_proj.nbytes(),
                HostMixer::DeltaNet(d) => {
                    d.in_proj_qkv.nbytes() + d.in_proj_z.nbytes() + d.in_proj_b.nbytes() + d.in_proj_a.nbytes() + d.out_proj.nbytes()
                }
            };
            n += match &l.ffn {
                HostFfn::Dense(m) => mlp(m),
                HostFfn::Moe(m) => {
                    m.router.nbytes()
                        + m.experts.iter().map(mlp).sum::<usize>()
                        + m.shared.as_ref().map_or(0, mlp)
                        + m.shared_gate.as_ref().map_or(0, |g| g.nbytes())
                }
            };
        }
        n
    }
}
