//! Configs of the real checkpoints (docs/model.md §2) and of small test shapes, as config.json text.

use serde_json::{Value, json};

pub const NAMES: &[&str] =
    &["qwen3.6-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b", "tiny-test", "tiny-next-test"];

fn qwen35(text: Value) -> Value {
    let mut t = json!({
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320, "hidden_act": "silu", "attention_bias": false, "attn_output_gate": true,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "tie_word_embeddings": false, "eos_token_id": 248044,
        "bos_token_id": 248044, "mtp_num_hidden_layers": 1, "mamba_ssm_dtype": "float32", "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": true}
    });
    for (k, v) in text.as_object().unwrap() {
        t[k] = v.clone();
    }
    let tie = t["tie_word_embeddings"].clone();
    json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": tie,
        "text_config": t,
    })
}

fn qwen3_next(over: Value) -> Value {
    let mut t = json!({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "intermediate_size": 5120, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": true, "full_attention_interval": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25, "tie_word_embeddings": false, "eos_token_id": 151645,
        "bos_token_id": 151643, "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16"
    });
    for (k, v) in over.as_object().unwrap() {
        t[k] = v.clone();
    }
    t
}

/// The config.json of a preset.
pub fn config(name: &str) -> Option<Value> {
    Some(match name {
        "qwen3.6-35b-a3b" => qwen35(json!({
            "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512
        })),
        "qwen3.5-122b-a10b" => qwen35(json!({
            "hidden_size": 3072, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 2,
            "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024
        })),
        "qwen3.5-397b-a17b" => qwen35(json!({
            "hidden_size": 4096, "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 2,
            "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "num_experts": 512, "num_experts_per_tok": 10,
            "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024
        })),
        "qwen3-next-80b-a3b" => qwen3_next(json!({})),
        // Small shapes with the real Qwen3.5 vocabulary (tied embeddings keep them small).
        "tiny-test" => qwen35(json!({
            "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "tie_word_embeddings": true,
            "max_position_embeddings": 32768
        })),
        "tiny-next-test" => qwen3_next(json!({
            "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64, "intermediate_size": 256, "tie_word_embeddings": true,
            "max_position_embeddings": 32768
        })),
        _ => return None,
    })
}
