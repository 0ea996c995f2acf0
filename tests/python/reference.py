"""Reference side of orchid's parity tests: random checkpoints in every supported layout,
transformers (f32, CPU) logits, and mlx-lm checkpoints + logits.

Used as a library by the pytest modules next to it, and runnable on its own:

    python tests/python/reference.py list
    python tests/python/reference.py selfcheck [--cases q35_a,next_a] [--quick]
    python tests/python/reference.py write CASE LAYOUT DTYPE OUT_DIR [--shards N]
    python tests/python/reference.py mlx CASE BITS GROUP OUT_DIR

`write` also drops `tokens.txt` (the 300-token test sequence) and `reference.safetensors`
(tensor `logits`, f32 [300, vocab], transformers prefill) into OUT_DIR, so a single
checkpoint can be debugged by hand against `orchid eval --dump-logits`.

Everything is deterministic: a case's weights and tokens depend only on its seed.

Conventions
-----------
* "HF names" are the parameter names of `Qwen3_5MoeForCausalLM` / `Qwen3NextForCausalLM`
  (`model.layers.L...`, fused `mlp.experts.gate_up_proj` [E, 2I, H]). Every layout writer maps
  from these names explicitly and has an exact inverse (`read_checkpoint_as_hf`).
* A reference is always transformers in float32 over exactly the values stored in the
  checkpoint (bf16 tensors are rounded first, then the model runs in f32).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

# one thread: the test machine is small and shared; torch spinning on 2 threads under load is
# 10x slower than one thread
torch.set_num_threads(int(os.environ.get("ORCHID_REF_THREADS", "1")))

PROMPT_LENGTHS = (5, 63, 64, 65, 150, 300)  # around the GDN chunk (64)
T_MAX = max(PROMPT_LENGTHS)
GDN_CHUNK = 64

# Layout names (the `orchid synth --format` names where they exist).
HF = "hf"  # official Qwen3.5 layout: wrapper config, model.language_model.*, fused experts
HF_PER_EXPERT = "hf-per-expert"  # save_pretrained(Qwen3_5MoeForCausalLM): text config, model.*, per-expert
HF_CG_PER_EXPERT = "hf-cg-per-expert"  # save_pretrained(Qwen3_5MoeForConditionalGeneration)
NEXT = "next"  # official Qwen3-Next layout: flat config, interleaved in_proj_qkvz / in_proj_ba
QWEN35_LAYOUTS = (HF, HF_PER_EXPERT, HF_CG_PER_EXPERT)
DTYPES = ("f32", "bf16")


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # "qwen3_5_moe" | "qwen3_next"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    partial_rotary: float
    rope_theta: float
    seed: int
    # "explicit": write `layer_types` (3:1 from the interval) and `full_attention_interval`;
    # "interval": write only `full_attention_interval`; a tuple: explicit custom layer_types.
    schedule: object = "explicit"
    interval: int = 4
    norm_topk_prob: bool | None = None  # Qwen3-Next only (Qwen3.5 always renormalises)
    note: str = ""

    @property
    def layer_types(self) -> list[str]:
        if isinstance(self.schedule, tuple):
            return list(self.schedule)
        return [
            "full_attention" if (i + 1) % self.interval == 0 else "linear_attention"
            for i in range(self.layers)
        ]

    @property
    def mlx_compatible(self) -> bool:
        """mlx-lm builds its schedule from `full_attention_interval` only (it ignores
        `layer_types`), so only interval-shaped schedules can be run there."""
        return self.family == "qwen3_5_moe" and not isinstance(self.schedule, tuple)

    @property
    def layouts(self) -> tuple[str, ...]:
        return (NEXT,) if self.family == "qwen3_next" else QWEN35_LAYOUTS

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)


def _mrope_section(rotary_dim: int) -> list[int]:
    """Text-only irrelevant, but shaped like the official [11, 11, 10] (sums to rotary/2)."""
    half = rotary_dim // 2
    a = math.ceil(half * 11 / 32)
    b = math.ceil((half - a) / 2)
    return [a, b, half - a - b]


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case("q35_a", "qwen3_5_moe", vocab=1024, hidden=128, layers=4, heads=4, kv_heads=2,
             head_dim=32, lin_k_heads=2, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32, experts=8,
             top_k=2, moe_inter=128, shared_inter=128, partial_rotary=0.25, rope_theta=1e7,
             seed=11, note="4/2 heads, GDN 2/4, 8 experts top-2, 3:1 explicit layer_types"),
        Case("q35_b", "qwen3_5_moe", vocab=2048, hidden=256, layers=6, heads=6, kv_heads=1,
             head_dim=64, lin_k_heads=3, lin_v_heads=6, lin_k_dim=32, lin_v_dim=48, experts=16,
             top_k=4, moe_inter=128, shared_inter=256, partial_rotary=0.5, rope_theta=1e4,
             seed=22, note="6/1 heads, dk 32 != dv 48 (GDN value dim 288: out_proj stays dense "
             "in MLX g64/g128), 16 experts top-4, shared 256 != moe 128"),
        Case("q35_c", "qwen3_5_moe", vocab=512, hidden=128, layers=5, heads=8, kv_heads=8,
             head_dim=32, lin_k_heads=4, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32, experts=12,
             top_k=3, moe_inter=64, shared_inter=128, partial_rotary=0.25, rope_theta=1e7,
             seed=33, schedule=("linear_attention", "full_attention", "linear_attention",
                                "linear_attention", "full_attention"),
             note="MHA 8/8, GDN 4/4, 12 experts top-3, custom layer_types (not mlx-lm-able)"),
        Case("q35_d", "qwen3_5_moe", vocab=768, hidden=128, layers=6, heads=4, kv_heads=2,
             head_dim=64, lin_k_heads=2, lin_v_heads=4, lin_k_dim=64, lin_v_dim=32, experts=8,
             top_k=2, moe_inter=128, shared_inter=64, partial_rotary=0.5, rope_theta=1e7,
             seed=44, schedule="interval", interval=3,
             note="no layer_types: schedule from full_attention_interval=3 (full at 2, 5)"),
        Case("next_a", "qwen3_next", vocab=1024, hidden=128, layers=4, heads=4, kv_heads=2,
             head_dim=64, lin_k_heads=2, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32, experts=8,
             top_k=2, moe_inter=64, shared_inter=64, partial_rotary=0.25, rope_theta=1e7,
             seed=55, schedule="interval", norm_topk_prob=True,
             note="Qwen3-Next, norm_topk_prob=true, interval-only schedule"),
        Case("next_b", "qwen3_next", vocab=512, hidden=256, layers=4, heads=8, kv_heads=2,
             head_dim=32, lin_k_heads=4, lin_v_heads=8, lin_k_dim=32, lin_v_dim=48, experts=12,
             top_k=3, moe_inter=128, shared_inter=128, partial_rotary=0.5, rope_theta=1e4,
             seed=66, norm_topk_prob=False,
             note="Qwen3-Next, norm_topk_prob=false, explicit layer_types, dk != dv"),
    ]
}

# Which (case, layout, dtype, shards) checkpoints the HF parity suite covers. The first
# entry of each case is the "primary" one (fast suite); the rest are marked slow in the
# tests unless listed in FAST_EXTRA.
HF_MATRIX: list[tuple[str, str, str, int]] = [
    ("q35_a", HF, "f32", 1),
    ("q35_a", HF, "bf16", 1),
    ("q35_a", HF_PER_EXPERT, "f32", 1),
    ("q35_a", HF_CG_PER_EXPERT, "bf16", 1),
    ("q35_a", HF, "f32", 3),  # sharded
    ("q35_b", HF, "f32", 1),
    ("q35_b", HF_PER_EXPERT, "bf16", 2),  # sharded, per-expert
    ("q35_c", HF, "f32", 1),
    ("q35_c", HF_PER_EXPERT, "f32", 1),
    ("q35_d", HF, "f32", 1),
    ("q35_d", HF, "bf16", 1),
    ("next_a", NEXT, "f32", 1),
    ("next_a", NEXT, "bf16", 1),
    ("next_b", NEXT, "f32", 1),
    ("next_b", NEXT, "bf16", 2),
]

# mlx-lm conversions: (case, bits, group_size). Source: the official layout in bf16
# (what mlx_lm.convert sees for a real checkpoint), so scales/biases are bf16.
MLX_MATRIX: list[tuple[str, int, int]] = [
    ("q35_a", 4, 32),
    ("q35_a", 4, 64),
    ("q35_a", 4, 128),
    ("q35_a", 8, 64),
    ("q35_b", 4, 64),
    ("q35_b", 4, 128),
    ("q35_b", 8, 32),
    ("q35_d", 4, 64),
    ("q35_d", 8, 64),
]


def tokens_for(case: Case, n: int = T_MAX) -> list[int]:
    g = np.random.default_rng(1000 + case.seed)
    return [int(t) for t in g.integers(0, case.vocab, size=n)]


# --------------------------------------------------------------------------------------
# Configs (written exactly like the official files)
# --------------------------------------------------------------------------------------


def _dtype_name(dtype: str) -> str:
    return {"f32": "float32", "bf16": "bfloat16"}[dtype]


def qwen35_text_config(case: Case, dtype: str) -> dict:
    assert case.family == "qwen3_5_moe"
    rot = case.rotary_dim
    cfg = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": case.vocab,
        "hidden_size": case.hidden,
        "num_hidden_layers": case.layers,
        "num_attention_heads": case.heads,
        "num_key_value_heads": case.kv_heads,
        "head_dim": case.head_dim,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": case.lin_k_dim,
        "linear_value_head_dim": case.lin_v_dim,
        "linear_num_key_heads": case.lin_k_heads,
        "linear_num_value_heads": case.lin_v_heads,
        "num_experts": case.experts,
        "num_experts_per_tok": case.top_k,
        "moe_intermediate_size": case.moe_inter,
        "shared_expert_intermediate_size": case.shared_inter,
        "full_attention_interval": case.interval,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": case.rope_theta,
            "partial_rotary_factor": case.partial_rotary,
            "mrope_section": _mrope_section(rot),
            "mrope_interleaved": True,
        },
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": _dtype_name(dtype),
        "bos_token_id": None,
        "eos_token_id": case.vocab - 1,
        "pad_token_id": None,
    }
    if case.schedule != "interval":
        cfg["layer_types"] = case.layer_types
    return cfg


def qwen35_wrapper_config(case: Case, dtype: str) -> dict:
    """The multimodal wrapper of the official Qwen3.5/3.6 config.json (tiny vision tower)."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": qwen35_text_config(case, dtype),
        "vision_config": {
            "model_type": "qwen3_5_moe_vision",
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": case.hidden,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [],
            "hidden_act": "gelu_pytorch_tanh",
            "initializer_range": 0.02,
        },
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
    }


def qwen35_text_only_config(case: Case, dtype: str) -> dict:
    """What save_pretrained(Qwen3_5MoeForCausalLM) writes: a flat text config."""
    cfg = {"architectures": ["Qwen3_5MoeForCausalLM"], **qwen35_text_config(case, dtype)}
    # save_pretrained always writes the derived list
    cfg["layer_types"] = case.layer_types
    cfg.pop("full_attention_interval", None)
    return cfg


def next_config(case: Case, dtype: str) -> dict:
    """Flat Qwen3-Next config in the official (legacy top-level rope) form."""
    assert case.family == "qwen3_next"
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": case.vocab,
        "hidden_size": case.hidden,
        "intermediate_size": 3 * case.hidden,  # dense MLP size, unused (every layer is MoE)
        "num_hidden_layers": case.layers,
        "num_attention_heads": case.heads,
        "num_key_value_heads": case.kv_heads,
        "head_dim": case.head_dim,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": case.lin_k_dim,
        "linear_value_head_dim": case.lin_v_dim,
        "linear_num_key_heads": case.lin_k_heads,
        "linear_num_value_heads": case.lin_v_heads,
        "num_experts": case.experts,
        "num_experts_per_tok": case.top_k,
        "moe_intermediate_size": case.moe_inter,
        "shared_expert_intermediate_size": case.shared_inter,
        "norm_topk_prob": bool(case.norm_topk_prob),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "full_attention_interval": case.interval,
        "rope_theta": case.rope_theta,
        "partial_rotary_factor": case.partial_rotary,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": _dtype_name(dtype),
        "bos_token_id": 0,
        "eos_token_id": case.vocab - 1,
    }
    if case.schedule != "interval":
        cfg["layer_types"] = case.layer_types
    return cfg


def config_json(case: Case, layout: str, dtype: str) -> dict:
    if layout == HF or layout == HF_CG_PER_EXPERT:
        return qwen35_wrapper_config(case, dtype)
    if layout == HF_PER_EXPERT:
        return qwen35_text_only_config(case, dtype)
    if layout == NEXT:
        return next_config(case, dtype)
    raise ValueError(f"unknown layout {layout}")


def hf_config(case: Case):
    """transformers config object for the case (always f32, eager attention/experts)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    impl = dict(attn_implementation="eager", experts_implementation="eager")
    if case.family == "qwen3_5_moe":
        d = qwen35_text_config(case, "f32")
        d.pop("model_type")
        d.pop("dtype")
        return Qwen3_5MoeTextConfig(**d, **impl)
    d = next_config(case, "f32")
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    return Qwen3NextConfig(**d, **impl)


# --------------------------------------------------------------------------------------
# Random weights that make the comparison meaningful
# --------------------------------------------------------------------------------------

LM_HEAD_GAIN = 2.5  # logits std ~ 2.5 at every position
ROUTER_GAIN = 2.5  # router logits std ~ 2.5: top-k is rarely a near-tie
OFFSET_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                "k_norm.weight")


def _randomize(name: str, p: torch.Tensor, g: torch.Generator, case: Case) -> torch.Tensor:
    def normal(std, shape=None):
        return torch.randn(shape or p.shape, generator=g, dtype=torch.float32) * std

    H = case.hidden
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(LM_HEAD_GAIN / math.sqrt(H))
    if name.endswith(OFFSET_NORMS) or name == "model.norm.weight":
        return normal(0.1)  # HF stores the offset: multiplier 1 + w
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + normal(0.1)  # plain multiplier
    if name.endswith("A_log"):
        # A in [0.005, 2]: per-step decay from ~0.997 (state survives several 64-chunks) to ~0.25
        u = torch.rand(p.shape, generator=g)
        return math.log(0.005) + u * (math.log(2.0) - math.log(0.005))
    if name.endswith("dt_bias"):
        return normal(0.5)
    if name.endswith("conv1d.weight"):
        return normal(0.5)
    if name.endswith("in_proj_a.weight"):
        return normal(0.5 / math.sqrt(H))
    if name.endswith("mlp.gate.weight"):
        return normal(ROUTER_GAIN / math.sqrt(H))
    if name.endswith("experts.gate_up_proj"):
        return normal(1.0 / math.sqrt(p.shape[-1]))
    if name.endswith("experts.down_proj"):
        return normal(1.0 / math.sqrt(p.shape[-1]))
    if p.ndim == 2:  # every other nn.Linear [out, in]
        return normal(1.0 / math.sqrt(p.shape[1]))
    raise ValueError(f"no init rule for {name} {tuple(p.shape)}")


def build_model(case: Case):
    """An f32 transformers model with the case's random weights (not yet dtype-rounded)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    cls = Qwen3_5MoeForCausalLM if case.family == "qwen3_5_moe" else Qwen3NextForCausalLM
    torch.manual_seed(case.seed)  # the module constructors draw too; keep them reproducible
    model = cls(hf_config(case)).float().eval()
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(_randomize(name, p, g, case))
    return model


# --------------------------------------------------------------------------------------
# Storage dtypes per layout, and rounding the reference model to them
# --------------------------------------------------------------------------------------


def storage_dtype(layout: str, dtype: str, hf_name: str) -> torch.dtype:
    """dtype a tensor is stored with in a checkpoint of this layout.

    * official Qwen3.5 (and the wrapper save_pretrained form): A_log and the GDN gated-norm
      weight stay f32 in a bf16 checkpoint (docs/model.md §7.2);
    * save_pretrained of a bf16 text model: everything bf16;
    * Qwen3-Next: A_log is bf16 even in an f32 checkpoint of this suite (official file: bf16).
    """
    if layout == NEXT and hf_name.endswith("A_log"):
        return torch.bfloat16
    if dtype == "f32":
        return torch.float32
    if layout in (HF, HF_CG_PER_EXPERT) and (
        hf_name.endswith("A_log") or hf_name.endswith("linear_attn.norm.weight")
    ):
        return torch.float32
    return torch.bfloat16


def round_model_(model, layout: str, dtype: str):
    """Round every parameter to its storage dtype (values stay f32 tensors)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            sd = storage_dtype(layout, dtype, name)
            if sd != torch.float32:
                p.copy_(p.to(sd).to(torch.float32))
    return model


def params_digest(model) -> str:
    h = hashlib.sha1()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------
# Layout writers and their exact inverses
# --------------------------------------------------------------------------------------


def _wrap_prefix(hf_name: str) -> str:
    assert hf_name.startswith("model."), hf_name
    return "model.language_model." + hf_name[len("model."):]


def _unwrap_prefix(name: str) -> str:
    assert name.startswith("model.language_model."), name
    return "model." + name[len("model.language_model."):]


def _split_experts(name: str, t: torch.Tensor, inter: int) -> dict[str, torch.Tensor]:
    """fused stacked experts -> per-expert nn.Linear weights."""
    out = {}
    base = name.rsplit(".", 1)[0]  # ...mlp.experts
    if name.endswith("experts.gate_up_proj"):
        assert t.shape[1] == 2 * inter
        for e in range(t.shape[0]):
            out[f"{base}.{e}.gate_proj.weight"] = t[e, :inter, :]
            out[f"{base}.{e}.up_proj.weight"] = t[e, inter:, :]
    elif name.endswith("experts.down_proj"):
        for e in range(t.shape[0]):
            out[f"{base}.{e}.down_proj.weight"] = t[e]
    else:
        raise ValueError(name)
    return out


def _fake_extras(case: Case, state: dict[str, torch.Tensor], g: torch.Generator) -> dict:
    """mtp.* and model.visual.* tensors as in the official checkpoint (an engine skips them).
    The MTP layer is a copy of the last full-attention layer with per-expert experts."""
    H = case.hidden
    extras = {
        "mtp.fc.weight": torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H),
        "mtp.pre_fc_norm_embedding.weight": torch.randn(H, generator=g) * 0.1,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(H, generator=g) * 0.1,
        "mtp.norm.weight": torch.randn(H, generator=g) * 0.1,
        "model.visual.patch_embed.proj.weight": torch.randn(32, 3, 2, 16, 16, generator=g) * 0.02,
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=g) * 0.02,
        "model.visual.blocks.0.attn.qkv.bias": torch.zeros(96),
        "model.visual.merger.linear_fc2.weight": torch.randn(H, 128, generator=g) * 0.02,
        "model.visual.merger.linear_fc2.bias": torch.zeros(H),
    }
    full = max(i for i, t in enumerate(case.layer_types) if t == "full_attention")
    pre = f"model.layers.{full}."
    for name, t in state.items():
        if not name.startswith(pre):
            continue
        mtp = "mtp.layers.0." + name[len(pre):]
        if "experts." in name:
            extras.update(_split_experts(mtp, t, case.moe_inter))
        else:
            extras[mtp] = t.clone()
    return extras


def checkpoint_tensors(case: Case, layout: str, dtype: str, state: dict[str, torch.Tensor],
                       extras: bool = True) -> dict[str, torch.Tensor]:
    """HF-named f32 state dict -> {checkpoint name: tensor in its storage dtype}."""
    out: dict[str, torch.Tensor] = {}
    per_expert = layout in (HF_PER_EXPERT, HF_CG_PER_EXPERT, NEXT)
    wrapped = layout in (HF, HF_CG_PER_EXPERT)
    for name, t in state.items():
        sd = storage_dtype(layout, dtype, name)
        if per_expert and ".mlp.experts." in name:
            items = _split_experts(name, t, case.moe_inter)
        else:
            items = {name: t}
        for n, v in items.items():
            if wrapped and n.startswith("model."):
                n = _wrap_prefix(n)
            out[n] = v.to(sd, copy=True).contiguous()
    if extras and layout == HF:
        g = torch.Generator().manual_seed(case.seed + 7)
        dt = torch.float32 if dtype == "f32" else torch.bfloat16
        for n, v in _fake_extras(case, state, g).items():
            out[n] = v.to(dt, copy=True).contiguous()
    return out


def read_checkpoint_as_hf(case: Case, layout: str, ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Exact inverse of `checkpoint_tensors`: read the files (sharded or not), map names back
    to HF module names, stack per-expert weights, upcast to f32. Skips mtp.* / model.visual.*."""
    raw = read_safetensors_dir(ckpt_dir)
    per_expert = layout in (HF_PER_EXPERT, HF_CG_PER_EXPERT, NEXT)
    wrapped = layout in (HF, HF_CG_PER_EXPERT)
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in raw.items():
        if name.startswith("mtp.") or name.startswith("model.visual."):
            continue
        if wrapped and name.startswith("model."):
            name = _unwrap_prefix(name)
        t = t.to(torch.float32)
        if per_expert and ".mlp.experts." in name:
            base, rest = name.split(".mlp.experts.", 1)
            e, proj = rest.split(".", 1)
            experts.setdefault(base, {}).setdefault(int(e), {})[proj] = t
            continue
        state[name] = t
    for base, per in experts.items():
        n = len(per)
        assert sorted(per) == list(range(n)), f"{base}: experts {sorted(per)}"
        state[f"{base}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj.weight"], per[e]["up_proj.weight"]], 0) for e in range(n)])
        state[f"{base}.mlp.experts.down_proj"] = torch.stack(
            [per[e]["down_proj.weight"] for e in range(n)])
    return state


def read_safetensors_dir(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(str(ckpt_dir / f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def write_safetensors(ckpt_dir: Path, tensors: dict[str, torch.Tensor], shards: int = 1):
    """One file, or `shards` files + model.safetensors.index.json (HF naming)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    meta = {"format": "pt"}
    if shards <= 1:
        save_file({k: tensors[k] for k in names}, str(ckpt_dir / "model.safetensors"), metadata=meta)
        return
    sizes = [tensors[k].numel() * tensors[k].element_size() for k in names]
    total = sum(sizes)
    cum = np.cumsum(sizes)
    cuts = [0]
    for i in range(1, shards):  # contiguous runs of about equal bytes, none empty
        c = int(np.searchsorted(cum, total * i / shards)) + 1
        cuts.append(min(max(c, cuts[-1] + 1), len(names) - (shards - i)))
    cuts.append(len(names))
    groups = [names[cuts[i]:cuts[i + 1]] for i in range(shards)]
    weight_map = {}
    for i, grp in enumerate(groups):
        assert grp, "empty shard"
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in grp}, str(ckpt_dir / fname), metadata=meta)
        weight_map.update({k: fname for k in grp})
    (ckpt_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2))


def write_checkpoint(case: Case, layout: str, dtype: str, out_dir: Path, shards: int = 1,
                     model=None, extras: bool = True) -> Path:
    """Write config.json + safetensors for (case, layout, dtype). `model` (already rounded
    with round_model_) may be passed to avoid rebuilding it."""
    out_dir = Path(out_dir)
    if model is None:
        model = round_model_(build_model(case), layout, dtype)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = checkpoint_tensors(case, layout, dtype, state, extras=extras)
    write_safetensors(out_dir, tensors, shards)
    (out_dir / "config.json").write_text(json.dumps(config_json(case, layout, dtype), indent=2))
    return out_dir


# --------------------------------------------------------------------------------------
# transformers references
# --------------------------------------------------------------------------------------


def _cache_kw(model) -> str:
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def hf_prefill_logits(model, tokens: list[int]) -> np.ndarray:
    ids = torch.tensor([tokens], dtype=torch.long)
    out = model(input_ids=ids, use_cache=False)
    return out.logits[0].float().numpy()


@torch.no_grad()
def hf_decode_logits(model, tokens: list[int]) -> np.ndarray:
    """Token by token through the cache (GDN recurrent step, KV cache)."""
    kw = _cache_kw(model)
    cache = None
    rows = []
    for t in tokens:
        ids = torch.tensor([[t]], dtype=torch.long)
        args = {"input_ids": ids, "use_cache": True}
        if cache is not None:
            args[kw] = cache
        out = model(**args)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        assert cache is not None, "transformers returned no cache"
        rows.append(out.logits[0, -1].float().numpy())
    return np.stack(rows)


def hf_model_from_state(case: Case, state: dict[str, torch.Tensor]):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    cls = Qwen3_5MoeForCausalLM if case.family == "qwen3_5_moe" else Qwen3NextForCausalLM
    model = cls(hf_config(case)).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise AssertionError(f"state mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    return model


# --------------------------------------------------------------------------------------
# Comparison metrics
# --------------------------------------------------------------------------------------


def rel_l2_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """‖a_t − b_t‖ / ‖b_t‖ per position (NaN anywhere gives NaN/inf there)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)


@dataclass
class Comparison:
    max_rel: float
    worst_pos: int
    argmax_mismatch: list[int]
    nan: bool
    shape_ok: bool
    detail: str = ""

    def ok(self, tol: float) -> bool:
        return self.shape_ok and not self.nan and self.max_rel <= tol and not self.argmax_mismatch

    def __str__(self) -> str:
        return (f"max rel L2 {self.max_rel:.3e} at pos {self.worst_pos}, argmax mismatches at "
                f"{self.argmax_mismatch[:10]}{'...' if len(self.argmax_mismatch) > 10 else ''}, "
                f"nan={self.nan}{', ' + self.detail if self.detail else ''}")


def compare_logits(got: np.ndarray, ref: np.ndarray, tie_eps: float = 1e-5) -> Comparison:
    """Per-position comparison. An argmax difference is forgiven only where the reference's
    own top-2 gap is below tie_eps·max|ref_t| (a genuine tie)."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    if got.shape != ref.shape:
        return Comparison(math.inf, -1, [], False, False, f"shape {got.shape} != {ref.shape}")
    nan = bool(np.isnan(got).any() or np.isinf(got).any())
    rel = rel_l2_rows(got, ref)
    rel = np.where(np.isfinite(rel), rel, np.inf)
    worst = int(np.argmax(rel))
    am_g = got.argmax(-1)
    am_r = ref.argmax(-1)
    mism = []
    for t in np.nonzero(am_g != am_r)[0]:
        gap = ref[t, am_r[t]] - ref[t, am_g[t]]
        if gap > tie_eps * np.abs(ref[t]).max():
            mism.append(int(t))
    return Comparison(float(rel[worst]), worst, mism, nan, True)


def logit_quality(logits: np.ndarray) -> dict:
    """Is this reference informative? std of the last row, top-2 gaps."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    return {
        "last_std": float(logits[-1].std()),
        "min_std": float(logits.std(-1).min()),
        "median_top2_gap": float(np.median(gaps)),
        "frac_gap_lt_1e-3": float((gaps < 1e-3).mean()),
        "min_top2_gap": float(gaps.min()),
    }


@torch.no_grad()
def router_margins(model, tokens: list[int]) -> dict:
    """Router-logit gap between the k-th and (k+1)-th expert at every (token, layer). Expert
    choice flips only if an implementation's error (~1e-6 here) exceeds that gap, so the test
    is robust when gaps below 1e-4 are rare and none is below 1e-5."""
    k = model.config.num_experts_per_tok
    out = model(input_ids=torch.tensor([tokens]), output_router_logits=True, use_cache=False)
    margins, used = [], []
    for rl in out.router_logits:
        s = torch.sort(rl.float(), -1, descending=True).values
        margins.append((s[:, k - 1] - s[:, k]).numpy())
        used.append(len(torch.unique(torch.topk(rl, k, -1).indices)))
    m = np.concatenate(margins)
    return {"min_margin": float(m.min()), "frac_lt_1e-4": float((m < 1e-4).mean()),
            "n_lt_1e-5": int((m < 1e-5).sum()), "experts_used_min": int(min(used)),
            "experts": model.config.num_experts}


# --------------------------------------------------------------------------------------
# Workspace: generate-once cache of checkpoints and references
# --------------------------------------------------------------------------------------


class Workspace:
    """Creates checkpoints/references on demand under `root` and memoises them (in memory
    and on disk, so a persistent root can be reused across sessions)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._models: dict[tuple, object] = {}
        self._refs: dict[str, object] = {}
        self._digests: dict[tuple, str] = {}
        self._mlx_models: dict[str, object] = {}
        self.timings: dict[str, float] = {}

    def _timed(self, key, fn):
        t0 = time.perf_counter()
        r = fn()
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0
        return r

    def model(self, case: Case, layout: str, dtype: str):
        """HF model rounded to (layout, dtype) storage; shared by layouts with equal values."""
        key = (case.name, layout, dtype)
        if key not in self._models:
            self._models[key] = self._timed(
                "build_model", lambda: round_model_(build_model(case), layout, dtype))
        return self._models[key]

    def tokens_file(self, case: Case, n: int = T_MAX) -> Path:
        p = self.root / "tokens" / f"{case.name}_{n}.txt"
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(" ".join(map(str, tokens_for(case)[:n])) + "\n")
        return p

    def hf_checkpoint(self, case: Case, layout: str, dtype: str, shards: int = 1) -> Path:
        d = self.root / "hf" / f"{case.name}-{layout}-{dtype}-s{shards}"
        if not (d / "config.json").exists():
            tmp = d.with_name(d.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self._timed("write_checkpoint", lambda: write_checkpoint(
                case, layout, dtype, tmp, shards, model=self.model(case, layout, dtype)))
            tmp.rename(d)
        return d

    def hf_reference(self, case: Case, layout: str, dtype: str, decode: bool = True) -> dict:
        """{"prefill": {L: [L, V]}, "decode": [T_MAX, V] (if decode), "digest": ..}
        for transformers f32 on the values stored in (layout, dtype). Memoised by a digest of
        the parameter values, so layouts storing the same values share one reference."""
        model = self.model(case, layout, dtype)
        mkey = (case.name, layout, dtype)
        if mkey not in self._digests:
            self._digests[mkey] = params_digest(model)
        digest = self._digests[mkey]
        key = f"{case.name}-{digest}"
        f = self.root / "refs" / f"{key}.npz"
        ref = self._refs.get(key)
        if ref is None and f.exists():
            z = np.load(f)
            ref = {"prefill": {L: z[f"prefill_{L}"] for L in PROMPT_LENGTHS}, "digest": digest}
            if "decode" in z:
                ref["decode"] = z["decode"]
        dirty = False
        if ref is None:
            toks = tokens_for(case)
            ref = {"digest": digest, "prefill": {
                L: self._timed("hf_prefill", lambda L=L: hf_prefill_logits(model, toks[:L]))
                for L in PROMPT_LENGTHS}}
            dirty = True
        if decode and "decode" not in ref:
            ref["decode"] = self._timed("hf_decode", lambda: hf_decode_logits(model, tokens_for(case)))
            dirty = True
        self._refs[key] = ref
        if dirty:
            f.parent.mkdir(parents=True, exist_ok=True)
            arrays = {f"prefill_{L}": v for L, v in ref["prefill"].items()}
            if "decode" in ref:
                arrays["decode"] = ref["decode"]
            np.savez(f, **arrays)
        return ref

    def mlx_checkpoint(self, case: Case, bits: int | None, group_size: int | None,
                       src_dtype: str = "bf16") -> Path:
        tag = f"q{bits}g{group_size}" if bits else "dense"
        d = self.root / "mlx" / f"{case.name}-{tag}-{src_dtype}"
        if not (d / "config.json").exists():
            tmp = d.with_name(d.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            from mlx_reference import mlx_convert

            src = self.hf_checkpoint(case, HF, src_dtype)
            self._timed("mlx_convert", lambda: mlx_convert(src, tmp, bits, group_size))
            tmp.rename(d)
        return d

    def mlx_logits(self, ckpt_dir: Path, case: Case, L: int) -> np.ndarray:
        """mlx-lm (set_dtype f32) logits over the first L tokens of the case, memoised in
        memory and on disk; the loaded model is kept for the session."""
        key = f"mlxref-{Path(ckpt_dir).name}-L{L}"
        if key in self._refs:
            return self._refs[key]
        f = self.root / "refs" / f"{key}.npy"
        if f.exists():
            ref = np.load(f)
        else:
            from mlx_reference import mlx_load_f32, mlx_prefill_logits

            d = str(ckpt_dir)
            if d not in self._mlx_models:
                self._mlx_models[d] = mlx_load_f32(ckpt_dir)[0]
            ref = self._timed("mlx_prefill", lambda: mlx_prefill_logits(
                self._mlx_models[d], tokens_for(case)[:L]))
            f.parent.mkdir(parents=True, exist_ok=True)
            np.save(f, ref)
        self._refs[key] = ref
        return ref


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    s = sub.add_parser("selfcheck")
    s.add_argument("--cases", default=",".join(CASES))
    s.add_argument("--quick", action="store_true")
    s.add_argument("--no-mlx", action="store_true")
    s.add_argument("--root", default=None)
    w = sub.add_parser("write")
    w.add_argument("case")
    w.add_argument("layout", choices=[HF, HF_PER_EXPERT, HF_CG_PER_EXPERT, NEXT])
    w.add_argument("dtype", choices=DTYPES)
    w.add_argument("out")
    w.add_argument("--shards", type=int, default=1)
    m = sub.add_parser("mlx")
    m.add_argument("case")
    m.add_argument("bits", type=int)
    m.add_argument("group_size", type=int)
    m.add_argument("out")
    a = ap.parse_args(argv)

    if a.cmd == "list":
        for c in CASES.values():
            print(f"{c.name:8s} {c.family:12s} layouts={','.join(c.layouts)} mlx={c.mlx_compatible}  {c.note}")
        return 0
    if a.cmd == "selfcheck":
        import tempfile

        from ref_selfcheck import selfcheck

        root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="orchid-ref-"))
        print(f"workspace: {root}")
        ok = selfcheck(Workspace(root), [CASES[n] for n in a.cases.split(",")], quick=a.quick,
                       mlx=not a.no_mlx)
        return 0 if ok else 1
    case = CASES[a.case]
    out = Path(a.out)
    if a.cmd == "write":
        model = round_model_(build_model(case), a.layout, a.dtype)
        write_checkpoint(case, a.layout, a.dtype, out, a.shards, model=model)
        toks = tokens_for(case)
        (out / "tokens.txt").write_text(" ".join(map(str, toks)) + "\n")
        save_file({"logits": torch.from_numpy(hf_prefill_logits(model, toks))},
                  str(out / "reference.safetensors"))
        print(f"wrote {out} (tokens.txt, reference.safetensors)")
        return 0
    if a.cmd == "mlx":
        import tempfile

        from mlx_reference import mlx_convert, mlx_load_f32, mlx_prefill_logits

        src = Path(tempfile.mkdtemp(prefix="orchid-src-"))
        write_checkpoint(case, HF, "bf16", src)
        mlx_convert(src, out, a.bits, a.group_size)
        model, _ = mlx_load_f32(out)
        toks = tokens_for(case)
        (out / "tokens.txt").write_text(" ".join(map(str, toks)) + "\n")
        save_file({"logits": torch.from_numpy(mlx_prefill_logits(model, toks))},
                  str(out / "reference.safetensors"))
        shutil.rmtree(src)
        print(f"wrote {out} (tokens.txt, reference.safetensors from mlx-lm)")
        return 0
    return 2


if __name__ == "__main__":
    sys.modules.setdefault("reference", sys.modules["__main__"])
    sys.exit(_main())
