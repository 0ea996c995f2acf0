"""Broken checkpoints: orchid must exit non-zero with an error, not crash (no signal, no panic,
exit code not 101), and stderr must name the file and the tensor or config field at fault."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import reference as R

CASE = R.CASES["q35_a"]
SHARD = "model.safetensors"
P = "model.language_model.layers"  # official layout prefix


# ---- safetensors header surgery -------------------------------------------------------


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path: Path, header: dict, data: bytes):
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def edit_config(d: Path, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def _tc(cfg):  # text config of the wrapper
    return cfg["text_config"]


# ---- the corruptions ------------------------------------------------------------------


@dataclass
class Bad:
    """`apply(d)` breaks checkpoint dir d and returns (file or files of which one must be
    named, names of which at least one must appear: tensor names, suffixes or config fields).
    The checkpoint folder (`ckpt`) counts as naming the file where no single file is at fault
    (a missing tensor)."""
    id: str
    apply: object
    base: str = "hf"  # "hf" (official f32 layout, single file), "sharded", "mlx"


def truncated(d):
    f = d / SHARD
    header, data = read_header(f)
    hlen = f.stat().st_size - len(data)
    keep = len(data) * 6 // 10
    f.write_bytes(f.read_bytes()[: hlen + keep])
    cut = [k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > keep]
    return SHARD, cut


def wrong_dtype(d):
    f = d / SHARD
    header, data = read_header(f)
    name = f"{P}.1.linear_attn.in_proj_qkv.weight"
    assert header[name]["dtype"] == "F32"
    header[name]["dtype"] = "I32"  # same byte size: only the dtype is wrong
    write_header(f, header, data)
    return SHARD, [name]


def missing_tensor(d):
    t = load_file(str(d / SHARD))
    name = f"{P}.1.linear_attn.dt_bias"
    del t[name]
    save_file(t, str(d / SHARD), metadata={"format": "pt"})
    return [SHARD, str(d)], [name, "layers.1.linear_attn.dt_bias"]


def wrong_shape(d):
    """Shape [64, 128] for k_proj [2*32=64, 128] -> [32, 256]: same bytes, wrong shape."""
    f = d / SHARD
    header, data = read_header(f)
    name = f"{P}.3.self_attn.k_proj.weight"
    assert header[name]["shape"] == [64, 128], header[name]
    header[name]["shape"] = [32, 256]
    write_header(f, header, data)
    return SHARD, [name, "layers.3.self_attn.k_proj"]


def wrong_expert_shape(d):
    """Fused experts with one expert too few: [E-1, 2I, H] (data re-saved consistently)."""
    t = load_file(str(d / SHARD))
    name = f"{P}.2.mlp.experts.gate_up_proj"
    t[name] = t[name][:-1].contiguous()
    save_file(t, str(d / SHARD), metadata={"format": "pt"})
    return SHARD, [name, "layers.2.mlp.experts"]


def shape_bytes_mismatch(d):
    """Header shape disagrees with the tensor's byte range."""
    f = d / SHARD
    header, data = read_header(f)
    name = f"{P}.0.mlp.shared_expert_gate.weight"
    header[name]["shape"] = [2, CASE.hidden]
    write_header(f, header, data)
    return SHARD, [name, "layers.0.mlp.shared_expert_gate"]


def garbage_config(d):
    (d / "config.json").write_text('{"model_type": "qwen3_5_moe", "text_config": {oops')
    return "config.json", ["config.json"]


def garbage_header_json(d):
    f = d / SHARD
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    f.write_bytes(raw[:8] + b"{\"x\": [" + b"\x00\xff" * ((n - 7) // 2) + b"!" * ((n - 7) % 2) + raw[8 + n:])
    return SHARD, [SHARD]


def garbage_header_length(d):
    f = d / SHARD
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    return SHARD, [SHARD]


def unknown_model_type(d):
    def fn(cfg):
        cfg["model_type"] = "llama"
        cfg["architectures"] = ["LlamaForCausalLM"]
        _tc(cfg)["model_type"] = "llama"
    edit_config(d, fn)
    return "config.json", ["model_type", "llama"]


def kv_heads_not_dividing(d):
    edit_config(d, lambda c: _tc(c).update(num_key_value_heads=3))
    return "config.json", ["num_key_value_heads", "num_attention_heads"]


def gdn_heads_not_dividing(d):
    edit_config(d, lambda c: _tc(c).update(linear_num_value_heads=3))
    return "config.json", ["linear_num_value_heads", "linear_num_key_heads"]


def layer_types_length(d):
    edit_config(d, lambda c: _tc(c).update(layer_types=_tc(c)["layer_types"][:-1]))
    return "config.json", ["layer_types", "num_hidden_layers"]


def top_k_above_experts(d):
    edit_config(d, lambda c: _tc(c).update(num_experts_per_tok=CASE.experts + 1))
    return "config.json", ["num_experts_per_tok", "num_experts"]


def unknown_layer_type(d):
    edit_config(d, lambda c: _tc(c)["layer_types"].__setitem__(1, "sliding_attention"))
    return "config.json", ["layer_types", "sliding_attention"]


def missing_field(d):
    """transformers fills a missing field with its class default (linear_key_head_dim=128), so
    an engine may too; then the tensors no longer fit. Either error is clear."""
    edit_config(d, lambda c: _tc(c).pop("linear_key_head_dim"))
    return ["config.json", SHARD], ["linear_key_head_dim", "linear_attn.in_proj_qkv"]


def hidden_size_vs_tensors(d):
    """Config says hidden 256, tensors are 128 wide: the first mismatching tensor is named."""
    edit_config(d, lambda c: _tc(c).update(hidden_size=2 * CASE.hidden))
    return SHARD, ["embed_tokens", "hidden_size", "layers.0."]


def missing_shard_file(d):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(idx["weight_map"].values()))[1]
    (d / victim).unlink()
    return victim, [victim]


def mlx_missing_scales(d):
    t = _mlx_load(d)
    name = "language_model.model.layers.0.linear_attn.in_proj_z.scales"
    del t[name]
    _mlx_save(d, t)
    return SHARD, ["layers.0.linear_attn.in_proj_z"]


def mlx_scales_shape(d):
    """scales/biases with 3 groups for 128 inputs: no group size fits. (Shapes that are merely
    a different valid (bits, group size) are not errors: mlx-lm infers both from the shapes of
    every module without a per-module override, and an engine may too; for the same reason a
    wrong top-level `bits`, or an override contradicting the shapes, is not tested here.)"""
    import mlx.core as mx

    t = _mlx_load(d)
    mod = "language_model.model.layers.3.self_attn.o_proj"
    for k in ("scales", "biases"):
        v = t[f"{mod}.{k}"]
        t[f"{mod}.{k}"] = mx.concatenate([v, v[:, :1]], axis=1)
    _mlx_save(d, t)
    return SHARD, [mod]


def hidden_size_zero(d):
    edit_config(d, lambda c: _tc(c).update(hidden_size=0))
    return "config.json", ["hidden_size"]


def head_dim_overflow(d):
    edit_config(d, lambda c: _tc(c).update(head_dim=2**62))
    return "config.json", ["head_dim"]


def nan_weight(d):
    f = d / SHARD
    header, data = read_header(f)
    name = f"{P}.2.mlp.shared_expert.up_proj.weight"
    assert header[name]["dtype"] == "F32"
    start = header[name]["data_offsets"][0] + 4 * 5
    data = data[:start] + struct.pack("<f", float("nan")) + data[start + 4:]
    write_header(f, header, data)
    return SHARD, [name]


def inf_weight(d):
    f = d / SHARD
    header, data = read_header(f)
    name = f"{P}.0.input_layernorm.weight"
    start = header[name]["data_offsets"][0]
    data = data[:start] + struct.pack("<f", float("-inf")) + data[start + 4:]
    write_header(f, header, data)
    return SHARD, [name]


def index_outside_folder(d):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    k = sorted(idx["weight_map"])[0]
    idx["weight_map"][k] = "/etc/passwd"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return "model.safetensors.index.json", ["/etc/passwd", "outside", "inside the model folder"]


def index_dotdot(d):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    k = sorted(idx["weight_map"])[0]
    idx["weight_map"][k] = "../ckpt/" + idx["weight_map"][k]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return "model.safetensors.index.json", ["inside the model folder"]


def named_pipe_weights(d):
    (d / SHARD).unlink()
    os.mkfifo(d / SHARD)
    return SHARD, ["not a regular file"]


def missing_config(d):
    (d / "config.json").unlink()
    return "config.json", ["config.json"]


def _mlx_load(d):
    import mlx.core as mx
    return dict(mx.load(str(d / SHARD)))


def _mlx_save(d, t):
    import mlx.core as mx
    mx.save_safetensors(str(d / SHARD), t, metadata={"format": "mlx"})


BAD = [
    Bad("truncated-file", truncated),
    Bad("wrong-dtype", wrong_dtype),
    Bad("missing-tensor", missing_tensor),
    Bad("wrong-shape", wrong_shape),
    Bad("wrong-expert-count", wrong_expert_shape),
    Bad("shape-vs-byte-size", shape_bytes_mismatch),
    Bad("garbage-config-json", garbage_config),
    Bad("garbage-safetensors-header", garbage_header_json),
    Bad("huge-header-length", garbage_header_length),
    Bad("unknown-model-type", unknown_model_type),
    Bad("kv-heads-not-dividing", kv_heads_not_dividing),
    Bad("gdn-heads-not-dividing", gdn_heads_not_dividing),
    Bad("layer-types-length", layer_types_length),
    Bad("unknown-layer-type", unknown_layer_type),
    Bad("top-k-above-experts", top_k_above_experts),
    Bad("missing-config-field", missing_field),
    Bad("hidden-size-vs-tensors", hidden_size_vs_tensors),
    Bad("missing-shard-file", missing_shard_file, base="sharded"),
    Bad("mlx-missing-scales", mlx_missing_scales, base="mlx"),
    Bad("mlx-scales-shape", mlx_scales_shape, base="mlx"),
    Bad("hidden-size-zero", hidden_size_zero),
    Bad("head-dim-overflow", head_dim_overflow),
    Bad("nan-weight", nan_weight),
    Bad("inf-weight", inf_weight),
    Bad("index-outside-folder", index_outside_folder, base="sharded"),
    Bad("index-dotdot", index_dotdot, base="sharded"),
    Bad("named-pipe-weights", named_pipe_weights),
    Bad("missing-config", missing_config),
]


@pytest.mark.parametrize("bad", [pytest.param(b, id=b.id) for b in BAD])
def test_bad_checkpoint_is_a_clear_error(orchid, ws, tmp_path, bad):
    if bad.base == "hf":
        src = ws.hf_checkpoint(CASE, R.HF, "f32")
    elif bad.base == "sharded":
        src = ws.hf_checkpoint(CASE, R.HF, "f32", 3)
    else:
        src = ws.mlx_checkpoint(CASE, 4, 64)
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    files, names = bad.apply(d)
    files = [files] if isinstance(files, str) else files
    p = orchid.run(*orchid.eval_args(d, R.tokens_for(CASE)[:8]), timeout=60)
    err = p.stderr
    ctx = f"{bad.id}: exit {p.returncode}\nstderr:\n{err[-2000:]}"
    assert p.returncode != 0, f"orchid accepted a broken checkpoint ({ctx})"
    assert p.returncode > 0, f"killed by signal {-p.returncode} ({ctx})"
    assert p.returncode != 101 and "panicked" not in err, f"orchid panicked ({ctx})"
    assert any(f in err for f in files), f"stderr names none of the files {files} ({ctx})"
    assert any(n in err for n in names), f"stderr names none of {names[:6]} ({ctx})"
    assert p.returncode == 3, f"a broken model folder must exit with code 3 ({ctx})"
    assert "root:" not in err, f"file contents in the error ({ctx})"


# ---- `run` and `serve` on a broken copy of the bundled model: exit code 3, never a hang ----

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "orchid-tiny"
TINY = "language_model.model.layers"


def _tiny_tensor(d: Path, name: str, value: float):
    f = d / SHARD
    header, data = read_header(f)
    t = header[name]
    start = t["data_offsets"][0]
    if t["dtype"] == "BF16":
        patch = struct.pack("<f", value)[2:]
    elif t["dtype"] == "F32":
        patch = struct.pack("<f", value)
    else:
        raise AssertionError(t)
    write_header(f, header, data[:start] + patch + data[start + len(patch):])


def _tiny_truncated(d):
    f = d / SHARD
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 6 // 10])
    return [SHARD]


def _tiny_nan(d):
    name = f"{TINY}.1.input_layernorm.weight"
    _tiny_tensor(d, name, float("nan"))
    return [SHARD, name]


def _tiny_hidden_zero(d):
    cfg = json.loads((d / "config.json").read_text())
    (cfg.get("text_config") or cfg)["hidden_size"] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    return ["config.json", "hidden_size"]


def _tiny_config_vs_weights(d):
    cfg = json.loads((d / "config.json").read_text())
    tc = cfg.get("text_config") or cfg
    tc["num_experts"] = tc["num_experts"] * 2
    (d / "config.json").write_text(json.dumps(cfg))
    return [SHARD, "experts"]


def _tiny_no_config(d):
    (d / "config.json").unlink()
    return ["config.json"]


def _tiny_no_tokenizer(d):
    (d / "tokenizer.json").unlink()
    return ["tokenizer.json"]


def _tiny_template_syntax(d):
    (d / "chat_template.jinja").write_text("{% if messages %}{{ unclosed")
    return ["template"]


def _tiny_index_outside(d):
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "/etc/passwd"}}))
    return ["model.safetensors.index.json", "/etc/passwd"]


TINY_BAD = {
    "truncated": _tiny_truncated,
    "nan-weight": _tiny_nan,
    "hidden-size-zero": _tiny_hidden_zero,
    "config-vs-weights": _tiny_config_vs_weights,
    "missing-config": _tiny_no_config,
    "missing-tokenizer": _tiny_no_tokenizer,
    "template-syntax": _tiny_template_syntax,
    "index-outside-folder": _tiny_index_outside,
}


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("case", list(TINY_BAD))
def test_run_and_serve_exit_3_naming_the_fault(orchid, tmp_path, case, command):
    d = tmp_path / "model"
    shutil.copytree(BUNDLED, d)
    names = TINY_BAD[case](d)
    args = ["run", "--device", "cpu", "--max-tokens", "2", "--model", str(d), "hi"] if command == "run" else \
        ["serve", "--device", "cpu", "--port", "0", "--model", str(d)]
    try:
        p = subprocess.run([str(orchid.binary), *args], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{command} hung on a broken model folder ({case})")
    ctx = f"{command} {case}: exit {p.returncode}\nstderr:\n{p.stderr[-2000:]}"
    assert p.returncode == 3, ctx
    assert "panicked" not in p.stderr, ctx
    assert any(n in p.stderr for n in names), ctx
    assert "root:" not in p.stderr, ctx
