"""scripts/bench_serve.py: the byte floor of a decode step for the Qwen3.6-35B-A3B shape, and a
CPU smoke run of the whole benchmark on the tiny synth model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import test_server_support as S

SCRIPT = S.REPO / "scripts" / "bench_serve.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# What `orchid synth --preset qwen3.6-35b-a3b --format mlx4` writes (the dimensions of
# docs/model.md §2.2), with one layer's 8-bit router override of the quantization block.
QWEN36_MLX4 = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": True,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "full_attention_interval": 4,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    },
    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}},
}


def test_byte_floor_qwen36():
    b = load_script()
    # Batch 1: the weights one step reads are docs/model.md §10's 1,669,571,328 B.
    one = b.byte_floor(QWEN36_MLX4, 1, 0)
    assert one["dense_bytes"] + one["routed_expert_bytes"] == pytest.approx(1_669_571_328, abs=2)
    # The figures quoted for 512-token contexts (GB, tok/s at 4.3 TB/s), within 15 %.
    for batch, gb, tok_s in [(4, 3.8, 4500), (16, 10.5, 6500), (32, 16.9, 8200), (64, 25.5, 10800)]:
        f = b.byte_floor(QWEN36_MLX4, batch, 512 + 128 // 2)
        assert f["total_bytes"] / 1e9 == pytest.approx(gb, rel=0.15), batch
        assert b.floor_tok_s(f, 4.3) == pytest.approx(tok_s, rel=0.15), batch
    # Parts: uniform routing touches 256 (1 - (1 - 8/256)^64) experts per layer at 64 streams;
    # each stream reads and writes 30 layers of f32 GDN state; the KV is 20,480 B per token.
    f = b.byte_floor(QWEN36_MLX4, 64, 576)
    assert f["experts_per_layer"] == pytest.approx(256 * (1 - (1 - 8 / 256) ** 64))
    assert f["gdn_state_bytes"] == 64 * 30 * (32 * 128 * 128 + 3 * 8192) * 4 * 2
    assert f["kv_bytes"] == 64 * 20_480 * 576
    # Unquantized (bf16) weights cost 2 B each.
    bf16 = {k: v for k, v in QWEN36_MLX4.items() if k != "quantization"}
    assert b.byte_floor(bf16, 1, 0)["routed_expert_bytes"] == pytest.approx(40 * 8 * 3 * 512 * 2048 * 2)


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, ORCHID_BIN=str(S.orchid_binary()))
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


@pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))
def test_cpu_smoke(tmp_path):
    p = run_bench("--preset", "tiny-test", "--device", "cpu", "--synth-out", str(tmp_path / "tiny"),
                  "--concurrency", "1,2", "--prompt-tokens", "16", "--output-tokens", "4",
                  "--long-prompt", "256", "--long-level", "2", "--long-stream-tokens", "16", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["meta"]["max_seqs"] == 3 and out["meta"]["prompt_tokens"] == 16
    levels = out["levels"]
    assert [r["concurrency"] for r in levels] == [1, 2]
    for r in levels:
        n = r["concurrency"]
        assert r["streams"] == n and r["generated_tokens"] == 4 * n  # ignore_eos: every stream runs to max_tokens
        assert r["aggregate_tok_s"] > 0 and r["wall_s"] > 0 and r["stream_decode_tok_s_p50"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["ttft_max_s"]
        assert 0 < r["itl_p50_s"] <= r["itl_p99_s"]
        assert r["tokens_per_chunk"] >= 1
        assert r["floor_gb"] > 0 and r["floor_tok_s"] > 0 and 0 < r["fraction_of_floor"] < 1
        assert set(r["floor_parts_gb"]) == {"dense", "routed_expert", "gdn_state", "kv"}
        assert r["server_itl_mean_s"] is not None and r["server_itl_mean_s"] > 0
        # Each stream's one-chunk prompt ran in a prefill step; the rest of its tokens in decode steps.
        assert 1 <= r["prefill_steps"] <= n and r["prefill_step_s"] > 0
        # Every stream's prompt was admitted once; its rate is over the prefill steps' seconds.
        assert r["prompt_tokens"] == 16 * n and r["prefill_tok_s"] == r["prompt_tokens"] / r["prefill_step_s"]
        assert r["decode_steps"] >= 3 and r["decode_step_mean_s"] > 0
        assert 0 < r["engine_busy_fraction"] <= 1
    i = out["interference"]
    assert i["streams"] == 2 and i["long_prompt_tokens"] == 256
    assert 0 < i["long_ttft_s"] <= i["long_total_s"] and i["long_alone_ttft_s"] > 0
    assert i["itl_outside_p50_s"] is not None
    # The table went to stderr.
    assert "agg tok/s" in p.stderr and "interference:" in p.stderr and "where the engine's time went" in p.stderr


@pytest.mark.skipif(S.binary_problem() is not None, reason=str(S.binary_problem()))
def test_missing_model_is_a_clear_error(tmp_path):
    p = run_bench("--model", str(tmp_path / "nothing"), "--device", "cpu", timeout=60)
    assert p.returncode == 1
    assert "holds no config.json" in p.stderr
