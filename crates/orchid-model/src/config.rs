//! `config.json` -> [`ModelConfig`]: every dimension is derived once, here.
//!
//! Accepted forms: the Qwen3.5/3.6-MoE multimodal wrapper (`model_type: qwen3_5_moe`, the
//! language model under `text_config`), the text-only `qwen3_5_moe_text` that transformers
//! saves, and the flat Qwen3-Next `qwen3_next`. Anything this engine cannot run is rejected
//! with an error naming the field.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};

/// Which architecture variant the checkpoint belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen3.5 / Qwen3.6 MoE (router always renormalises its top-k).
    Qwen35Moe,
    /// Qwen3-Next (renormalises only when `norm_topk_prob`).
    Qwen3Next,
}

/// The mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated full attention with a KV cache.
    FullAttention,
    /// Gated DeltaNet (linear attention with a fixed-size recurrent state).
    LinearAttention,
}

/// Full-attention dims. T = tokens, Hq query heads, Hkv KV heads, D head dim.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Number of leading dims of each head that are rotated (half-split pairing).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// `q_proj` emits [query | gate] per head and the output is multiplied by sigmoid(gate).
    pub output_gate: bool,
}

impl AttentionDims {
    /// Rows of `q_proj`: query (and gate) for every head.
    pub fn q_proj_rows(&self) -> usize {
        self.num_heads * self.head_dim * if self.output_gate { 2 } else { 1 }
    }
    pub fn kv_rows(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// Query heads that share one KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// Gated DeltaNet dims. Hk key heads of dk, Hv value heads of dv; value head j uses key head j / (Hv/Hk).
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetDims {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
}

impl DeltaNetDims {
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }
    /// Channels of the causal conv: q | k | v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Value heads per key head.
    pub fn v_per_k(&self) -> usize {
        self.num_v_heads / self.num_k_heads
    }
}

/// Mixture-of-experts dims.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeDims {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    /// 0 when there is no shared expert.
    pub shared_intermediate: usize,
    pub norm_topk_prob: bool,
}

/// The validated language-model configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub layer_types: Vec<LayerKind>,
    pub attention: AttentionDims,
    pub deltanet: DeltaNetDims,
    pub moe: MoeDims,
    /// Layers that use a dense SwiGLU MLP of `dense_intermediate` instead of the MoE (Qwen3-Next knob).
    pub dense_mlp_layers: Vec<bool>,
    pub dense_intermediate: usize,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// Number of MTP layers shipped (not run yet; kept for speculative decoding).
    pub mtp_layers: usize,
}

/// The raw text config, as it appears in `config.json` (every field optional; defaults below
/// follow transformers).
#[derive(Deserialize, Debug, Default)]
struct RawText {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    attn_output_gate: Option<bool>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    linear_conv_kernel_dim: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    num_experts_per_tok: Option<usize>,
    num_experts: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    intermediate_size: Option<usize>,
    layer_types: Option<Vec<String>>,
    full_attention_interval: Option<usize>,
    eos_token_id: Option<Value>,
    bos_token_id: Option<Value>,
    mtp_num_hidden_layers: Option<usize>,
}

fn field(name: &str, msg: impl Into<String>) -> Error {
    Error::Config { field: name.to_string(), msg: msg.into() }
}

fn ids_of(v: &Option<Value>, name: &str) -> Result<Vec<u32>> {
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Number(n)) => Ok(vec![n.as_u64().ok_or_else(|| field(name, "not a token id"))? as u32]),
        Some(Value::Array(a)) => {
            a.iter().map(|x| x.as_u64().map(|n| n as u32).ok_or_else(|| field(name, "not a list of token ids"))).collect()
        }
        Some(_) => Err(field(name, "expected an integer or a list of integers")),
    }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = crate::checkpoint::read_regular_file(&path)?;
        Self::from_json_str(&text).map_err(|e| e.in_file(&path))
    }

    /// Parses and validates a `config.json` document.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let root: Value =
            serde_json::from_str(text).map_err(|e| Error::Config { field: "config.json".into(), msg: format!("invalid JSON: {e}") })?;
        let top_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        let text_value = root.get("text_config").cloned().unwrap_or_else(|| root.clone());
        let raw: RawText = serde_json::from_value(text_value).map_err(|e| field("text_config", format!("unexpected value: {e}")))?;
        let inner_type = raw.model_type.as_deref().unwrap_or("");
        let family = match (top_type, inner_type) {
            ("qwen3_5_moe", _) | ("qwen3_5_moe_text", _) | ("", "qwen3_5_moe_text") => Family::Qwen35Moe,
            ("qwen3_next", _) => Family::Qwen3Next,
            (t, _) => {
                return Err(field("model_type", format!("`{t}` is not supported (expected qwen3_5_moe, qwen3_5_moe_text or qwen3_next)")));
            }
        };
        let mut cfg = Self::from_raw(family, raw)?;
        // eos ids may also live at the top level of the wrapper.
        if cfg.eos_token_ids.is_empty() {
            cfg.eos_token_ids = ids_of(&root.get("eos_token_id").cloned(), "eos_token_id")?;
        }
        Ok(cfg)
    }

    fn from_raw(family: Family, r: RawText) -> Result<Self> {
        let req = |v: Option<usize>, name: &str| v.ok_or_else(|| field(name, "missing"));
        let hidden_size = req(r.hidden_size, "hidden_size")?;
        let num_layers = req(r.num_hidden_layers, "num_hidden_layers")?;
        let vocab_size = req(r.vocab_size, "vocab_size")?;
        if let Some(act) = &r.hidden_act
            && act != "silu"
        {
            return Err(field("hidden_act", format!("`{act}` is not supported (only silu)")));
        }
        if r.attention_bias == Some(true) {
            return Err(field("attention_bias", "attention biases are not supported"));
        }

        let layer_types = match (&r.layer_types, r.full_attention_interval) {
            (Some(list), _) => {
                if list.len() != num_layers {
                    return Err(field("layer_types", format!("has {} entries but num_hidden_layers is {num_layers}", list.len())));
                }
                list.iter()
                    .map(|t| match t.as_str() {
                        "full_attention" => Ok(LayerKind::FullAttention),
                        "linear_attention" => Ok(LayerKind::LinearAttention),
                        other => Err(field("layer_types", format!("unknown layer type `{other}`"))),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            (None, interval) => {
                let interval = interval.unwrap_or(4);
                if interval == 0 {
                    return Err(field("full_attention_interval", "must be positive"));
                }
                (0..num_layers)
                    .map(|i| if (i + 1) % interval == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
                    .collect()
            }
        };

        // Attention.
        let num_heads = r.num_attention_heads.unwrap_or(16);
        let num_kv_heads = r.num_key_value_heads.unwrap_or(2);
        let head_dim = r.head_dim.unwrap_or(256);
        for (name, v) in [("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads), ("head_dim", head_dim)] {
            if v == 0 {
                return Err(field(name, "must be at least 1"));
            }
        }
        if !num_heads.is_multiple_of(num_kv_heads) {
            return Err(field("num_key_value_heads", format!("{num_kv_heads} does not divide num_attention_heads {num_heads}")));
        }
        let (rope_theta, partial) = rope_of(&r)?;
        let rotary_dim = (head_dim as f64 * partial) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(field(
                "partial_rotary_factor",
                format!("gives a rotary dim of {rotary_dim} for head_dim {head_dim}; it must be even and in 2..=head_dim"),
            ));
        }
        let attention =
            AttentionDims { num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, output_gate: r.attn_output_gate.unwrap_or(true) };

        // Gated DeltaNet.
        let deltanet = DeltaNetDims {
            num_k_heads: r.linear_num_key_heads.unwrap_or(16),
            num_v_heads: r.linear_num_value_heads.unwrap_or(32),
            k_head_dim: r.linear_key_head_dim.unwrap_or(128),
            v_head_dim: r.linear_value_head_dim.unwrap_or(128),
            conv_kernel: r.linear_conv_kernel_dim.unwrap_or(4),
        };
        for (name, v) in [
            ("linear_num_key_heads", deltanet.num_k_heads),
            ("linear_num_value_heads", deltanet.num_v_heads),
            ("linear_key_head_dim", deltanet.k_head_dim),
            ("linear_value_head_dim", deltanet.v_head_dim),
            ("linear_conv_kernel_dim", deltanet.conv_kernel),
        ] {
            if v == 0 {
                return Err(field(name, "must be at least 1"));
            }
        }
        if !deltanet.num_v_heads.is_multiple_of(deltanet.num_k_heads) {
            return Err(field(
                "linear_num_value_heads",
                format!("{} is not a multiple of linear_num_key_heads {}", deltanet.num_v_heads, deltanet.num_k_heads),
            ));
        }

        // MoE.
        let num_experts = r.num_experts.unwrap_or(if family == Family::Qwen3Next { 512 } else { 256 });
        let top_k = r.num_experts_per_tok.unwrap_or(if family == Family::Qwen3Next { 10 } else { 8 });
        if num_experts == 0 {
            return Err(field("num_experts", "must be at least 1"));
        }
        if top_k == 0 || top_k > num_experts {
            return Err(field("num_experts_per_tok", format!("{top_k} experts per token with {num_experts} experts")));
        }
        let moe = MoeDims {
            num_experts,
            top_k,
            intermediate: r.moe_intermediate_size.unwrap_or(512),
            shared_intermediate: r.shared_expert_intermediate_size.unwrap_or(512),
            // transformers hard-codes renormalisation for Qwen3.5-MoE; Qwen3-Next reads the flag.
            norm_topk_prob: match family {
                Family::Qwen35Moe => true,
                Family::Qwen3Next => r.norm_topk_prob.unwrap_or(true),
            },
        };
        if moe.intermediate == 0 {
            return Err(field("moe_intermediate_size", "must be positive"));
        }

        // Dense-MLP layers (Qwen3-Next only; Qwen3.5 has MoE everywhere).
        let mut dense_mlp_layers = vec![false; num_layers];
        if family == Family::Qwen3Next {
            let step = r.decoder_sparse_step.unwrap_or(1).max(1);
            let only = r.mlp_only_layers.clone().unwrap_or_default();
            for (i, d) in dense_mlp_layers.iter_mut().enumerate() {
                *d = only.contains(&i) || (i + 1) % step != 0;
            }
        }
        let dense_intermediate = r.intermediate_size.unwrap_or(0);
        if dense_mlp_layers.iter().any(|&d| d) && dense_intermediate == 0 {
            return Err(field("intermediate_size", "dense MLP layers need intermediate_size"));
        }

        let eps = r.rms_norm_eps.unwrap_or(1e-6);
        if !(eps > 0.0 && eps < 1.0) {
            return Err(field("rms_norm_eps", "must be in (0, 1)"));
        }
        let bos = ids_of(&r.bos_token_id, "bos_token_id")?.first().copied();
        let cfg = ModelConfig {
            family,
            hidden_size,
            vocab_size,
            rms_norm_eps: eps as f32,
            layer_types,
            attention,
            deltanet,
            moe,
            dense_mlp_layers,
            dense_intermediate,
            tie_word_embeddings: r.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: r.max_position_embeddings.unwrap_or(262_144),
            eos_token_ids: ids_of(&r.eos_token_id, "eos_token_id")?,
            bos_token_id: bos,
            mtp_layers: r.mtp_num_hidden_layers.unwrap_or(0),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Every size is at least 1, head counts divide, and no weight or state size overflows
    /// (sizes are multiplied into tensor lengths and byte counts everywhere downstream).
    fn validate(&self) -> Result<()> {
        let (a, d, m) = (&self.attention, &self.deltanet, &self.moe);
        let positive = [
            ("hidden_size", self.hidden_size),
            ("vocab_size", self.vocab_size),
            ("num_hidden_layers", self.num_layers()),
            ("num_attention_heads", a.num_heads),
            ("num_key_value_heads", a.num_kv_heads),
            ("head_dim", a.head_dim),
            ("linear_num_key_heads", d.num_k_heads),
            ("linear_num_value_heads", d.num_v_heads),
            ("linear_key_head_dim", d.k_head_dim),
            ("linear_value_head_dim", d.v_head_dim),
            ("linear_conv_kernel_dim", d.conv_kernel),
            ("num_experts", m.num_experts),
            ("num_experts_per_tok", m.top_k),
            ("moe_intermediate_size", m.intermediate),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(field(name, "must be at least 1"));
            }
        }
        if !a.num_heads.is_multiple_of(a.num_kv_heads) {
            return Err(field("num_key_value_heads", format!("{} does not divide num_attention_heads {}", a.num_kv_heads, a.num_heads)));
        }
        if !d.num_v_heads.is_multiple_of(d.num_k_heads) {
            return Err(field(
                "linear_num_value_heads",
                format!("{} is not a multiple of linear_num_key_heads {}", d.num_v_heads, d.num_k_heads),
            ));
        }
        // The largest tensors and per-sequence states, in elements; each must fit with room for
        // 4-byte elements and the products built from them.
        const LIMIT: usize = 1 << 46;
        let h = self.hidden_size;
        let products: [(&str, &[usize]); 9] = [
            ("vocab_size", &[self.vocab_size, h]),
            ("head_dim", &[a.num_heads, a.head_dim, 2, h]),
            ("head_dim", &[a.num_kv_heads, a.head_dim, self.max_position_embeddings]),
            ("linear_key_head_dim", &[d.num_k_heads, d.k_head_dim, 2, h]),
            ("linear_value_head_dim", &[d.num_v_heads, d.v_head_dim, d.k_head_dim]),
            ("linear_value_head_dim", &[d.num_v_heads, d.v_head_dim, 2, h]),
            ("linear_conv_kernel_dim", &[d.num_k_heads * d.k_head_dim + d.num_v_heads * d.v_head_dim, 2, d.conv_kernel]),
            ("moe_intermediate_size", &[m.num_experts, m.intermediate, 3, h]),
            ("shared_expert_intermediate_size", &[m.shared_intermediate.max(self.dense_intermediate), 3, h]),
        ];
        for (name, dims) in products {
            let n = dims.iter().try_fold(1usize, |acc, &x| acc.checked_mul(x).filter(|&n| n <= LIMIT));
            if n.is_none() {
                return Err(field(name, format!("the sizes {dims:?} give a tensor too large to address")));
            }
        }
        if self.num_layers() > 1 << 16 {
            return Err(field("num_hidden_layers", "is implausibly large (more than 65536)"));
        }
        Ok(())
    }

    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Index of layer `layer` among the layers of its own kind (its slot in the KV or GDN state).
    pub fn kind_index(&self, layer: usize) -> usize {
        let kind = self.layer_types[layer];
        self.layer_types[..layer].iter().filter(|&&k| k == kind).count()
    }

    pub fn num_attention_layers(&self) -> usize {
        self.layer_types.iter().filter(|&&k| k == LayerKind::FullAttention).count()
    }

    pub fn num_deltanet_layers(&self) -> usize {
        self.layer_types.len() - self.num_attention_layers()
    }
}

/// (theta, partial rotary factor), from `rope_parameters` (transformers 5) or the older
/// top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling`.
fn rope_of(r: &RawText) -> Result<(f64, f64)> {
    let params = match (&r.rope_parameters, &r.rope_scaling) {
        (Some(Value::Object(p)), _) => Some(p.clone()),
        (_, Some(Value::Object(p))) => Some(p.clone()),
        (Some(Value::Null) | None, Some(Value::Null) | None) => None,
        _ => return Err(field("rope_parameters", "expected an object")),
    };
    let get_f = |k: &str| params.as_ref().and_then(|p| p.get(k)).and_then(Value::as_f64);
    let rope_type = params.as_ref().and_then(|p| p.get("rope_type").or_else(|| p.get("type"))).and_then(Value::as_str).unwrap_or("default");
    // Interleaved MRoPE reduces exactly to 1-D RoPE for text-only input (docs/model.md §4).
    if !matches!(rope_type, "default" | "mrope") {
        return Err(field("rope_parameters.rope_type", format!("`{rope_type}` rope scaling is not supported (only default RoPE)")));
    }
    let theta = get_f("rope_theta").or(r.rope_theta).unwrap_or(10_000.0);
    let partial = get_f("partial_rotary_factor").or(r.partial_rotary_factor).unwrap_or(0.25);
    if theta.is_nan() || theta <= 0.0 {
        return Err(field("rope_theta", "must be positive"));
    }
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(field("partial_rotary_factor", "must be in (0, 1]"));
    }
    Ok((theta, partial))
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN36: &str = r#"{
      "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
      "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
        "vocab_size": 248320, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "full_attention_interval": 4, "rms_norm_eps": 1e-6, "eos_token_id": 248044,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
          "mrope_section": [11, 11, 10], "mrope_interleaved": true}},
      "vision_config": {"depth": 27}}"#;

    #[test]
    fn qwen36_dims() {
        let c = ModelConfig::from_json_str(QWEN36).unwrap();
        assert_eq!(c.family, Family::Qwen35Moe);
        assert_eq!(c.num_layers(), 40);
        assert_eq!(c.num_attention_layers(), 10);
        assert_eq!(c.layer_types[3], LayerKind::FullAttention);
        assert_eq!(c.layer_types[4], LayerKind::LinearAttention);
        assert_eq!(c.attention.rotary_dim, 64);
        assert_eq!(c.attention.q_proj_rows(), 8192);
        assert_eq!(c.deltanet.conv_dim(), 8192);
        assert_eq!(c.kind_index(7), 1);
        assert_eq!(c.kind_index(8), 6);
        assert!(c.moe.norm_topk_prob);
        assert_eq!(c.eos_token_ids, vec![248044]);
    }

    #[test]
    fn rejects_with_field_names() {
        let bad = QWEN36.replace("\"model_type\": \"qwen3_5_moe\"", "\"model_type\": \"llama\"");
        let e = ModelConfig::from_json_str(&bad).unwrap_err().to_string();
        assert!(e.contains("model_type"), "{e}");
        let bad = QWEN36.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
        assert!(ModelConfig::from_json_str(&bad).unwrap_err().to_string().contains("num_key_value_heads"));
        let bad = QWEN36.replace("\"rope_type\": \"default\"", "\"rope_type\": \"yarn\"");
        assert!(ModelConfig::from_json_str(&bad).unwrap_err().to_string().contains("rope_type"));
        let e = ModelConfig::from_json_str("{not json").unwrap_err().to_string();
        assert!(e.contains("invalid JSON"), "{e}");
    }

    #[test]
    fn every_size_is_checked() {
        for (from, to, name) in [
            ("\"hidden_size\": 2048", "\"hidden_size\": 0", "hidden_size"),
            ("\"vocab_size\": 248320", "\"vocab_size\": 0", "vocab_size"),
            ("\"num_hidden_layers\": 40", "\"num_hidden_layers\": 0", "num_hidden_layers"),
            ("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 0", "num_key_value_heads"),
            ("\"linear_num_key_heads\": 16", "\"linear_num_key_heads\": 0", "linear_num_key_heads"),
            ("\"linear_conv_kernel_dim\": 4", "\"linear_conv_kernel_dim\": 0", "linear_conv_kernel_dim"),
            ("\"linear_value_head_dim\": 128", "\"linear_value_head_dim\": 0", "linear_value_head_dim"),
            ("\"num_experts\": 256", "\"num_experts\": 0", "num_experts"),
            ("\"moe_intermediate_size\": 512", "\"moe_intermediate_size\": 0", "moe_intermediate_size"),
            ("\"rms_norm_eps\": 1e-6", "\"rms_norm_eps\": 1e-6, \"max_position_embeddings\": 0", "max_position_embeddings"),
            ("\"hidden_size\": 2048", "\"hidden_size\": 4611686018427387904", "vocab_size"),
            ("\"moe_intermediate_size\": 512", "\"moe_intermediate_size\": 1099511627776", "moe_intermediate_size"),
            ("\"head_dim\": 256", "\"head_dim\": 18446744073709551615", "head_dim"),
            ("\"num_hidden_layers\": 40", "\"num_hidden_layers\": 40, \"layer_types\": null, \"x\": 0", "x_never"),
        ] {
            let bad = QWEN36.replace(from, to);
            assert_ne!(bad, QWEN36, "{from}");
            match ModelConfig::from_json_str(&bad) {
                Ok(_) => assert_eq!(name, "x_never", "{to} was accepted"),
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.contains(&format!("`{name}`")), "{to}: {e}");
                }
            }
        }
    }
}
