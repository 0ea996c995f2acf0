"""mlx-lm side of the reference harness: MLX checkpoints written by mlx-lm itself, mlx-lm
logits in f32, and a numpy model of MLX's affine (de)quantizer (docs/model.md §7.6) that is
checked bit for bit against mx.quantize / mx.dequantize.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from reference import Case


def mlx_convert(src_dir: Path, dst_dir: Path, bits: int | None, group_size: int | None,
                dtype: str | None = None) -> Path:
    """mlx_lm.convert without the tokenizer: load_model -> cast (cast_predicate keeps A_log
    f32) -> quantize_model (mlx-lm's own quant_predicate: 8-bit g64 router and
    shared_expert_gate) -> save_model + save_config. `dtype` None = the config's dtype, like
    convert. bits None = unquantized MLX checkpoint."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    model, config = load_model(src_dir, lazy=True)
    if dtype is None:
        dtype = config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    if dtype in ("float16", "bfloat16", "float32"):
        mdt = getattr(mx, dtype)
        cast_predicate = getattr(model, "cast_predicate", lambda _: True)

        def set_dtype(k, v):
            if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
                return v.astype(mdt)
            return v

        model.update(tree_map_with_path(set_dtype, model.parameters()))
    if bits is not None:
        model, config = quantize_model(model, config, group_size, bits, mode="affine")
    save_model(dst_dir, model, donate_model=True)
    save_config(config, config_path=dst_dir / "config.json")
    return dst_dir


def mlx_load_f32(ckpt_dir: Path):
    """Load with mlx-lm, then set_dtype(float32). Checks that every floating parameter after
    the cast equals the file's value exactly (bf16 scales/biases stay bf16-valued; only
    compute goes to f32) and that packed weights are untouched."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(Path(ckpt_dir))
    before = {k: v for k, v in tree_flatten(model.parameters())}
    model.set_dtype(mx.float32)
    after = dict(tree_flatten(model.parameters()))
    for k, v in before.items():
        w = after[k]
        if mx.issubdtype(v.dtype, mx.floating):
            assert w.dtype == mx.float32, (k, w.dtype)
            assert bool(mx.array_equal(w, v.astype(mx.float32))), f"set_dtype changed {k}"
        else:
            assert w.dtype == v.dtype and bool(mx.array_equal(w, v)), f"set_dtype changed {k}"
    return model, config


def mlx_prefill_logits(model, tokens: list[int]) -> np.ndarray:
    import mlx.core as mx

    out = model(mx.array([tokens]))
    out = out.astype(mx.float32)
    mx.eval(out)
    return np.array(out[0])


def mlx_decode_logits(model, tokens: list[int]) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = []
    for t in tokens:
        out = model(mx.array([[t]]), cache=cache).astype(mx.float32)
        mx.eval(out)
        rows.append(np.array(out[0, -1]))
    return np.stack(rows)


def np_unpack(packed: np.ndarray, bits: int, in_features: int) -> np.ndarray:
    """uint32 words, lowest bits first (docs/model.md §7.6) -> unsigned ints [..., in_features]."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    q = (packed[..., :, None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    assert q.shape[-1] == in_features
    return q


def np_dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                  group_size: int) -> np.ndarray:
    """w = scale · q + bias per group of `group_size` consecutive input elements (f32)."""
    in_features = scales.shape[-1] * group_size
    q = np_unpack(packed, bits, in_features).astype(np.float32)
    q = q.reshape(*q.shape[:-1], scales.shape[-1], group_size)
    w = q * scales[..., None].astype(np.float32) + biases[..., None].astype(np.float32)
    return w.reshape(*w.shape[:-2], in_features)


def np_affine_quantize(w: np.ndarray, bits: int, group_size: int, out_dtype) -> tuple:
    """MLX's affine quantizer as described in docs/model.md §7.6 (computed in f32 from w's
    values, scale/bias then rounded to out_dtype; q computed with the *unrounded* scale).
    Returns (packed uint32, scales, biases) with scales/biases as float32 arrays holding
    out_dtype-rounded values."""
    n_bins = (1 << bits) - 1
    w = w.astype(np.float32).reshape(*w.shape[:-1], -1, group_size)
    wmin = w.min(-1)
    wmax = w.max(-1)
    scale = np.maximum((wmax - wmin) / np.float32(n_bins), np.float32(1e-7))
    side = np.abs(wmin) > np.abs(wmax)
    scale = np.where(side, scale, -scale).astype(np.float32)
    edge = np.where(side, wmin, wmax).astype(np.float32)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    scale = np.where(nz, edge / np.where(nz, q0, 1), scale).astype(np.float32)
    bias = np.where(nz, edge, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((w - bias[..., None]) / scale[..., None]), 0, n_bins).astype(np.uint32)
    q = q.reshape(*q.shape[:-2], -1)
    per = 32 // bits
    q = q.reshape(*q.shape[:-1], -1, per)
    packed = np.zeros(q.shape[:-1], dtype=np.uint32)
    for i in range(per):
        packed |= q[..., i] << np.uint32(bits * i)

    def rnd(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to(out_dtype).to(torch.float32).numpy()

    return packed, rnd(scale), rnd(bias)


def mlx_read_raw(ckpt_dir: Path) -> dict:
    import mlx.core as mx

    out = {}
    for f in sorted(Path(ckpt_dir).glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def mlx_checkpoint_as_hf(case: Case, ckpt_dir: Path, use_numpy: bool = True) -> dict:
    """Dequantize an MLX checkpoint (numpy dequantizer of docs/model.md §7.6, cross-checked
    against mx.dequantize) and map it back to HF names: norms −1, conv [C,K,1]->[C,1,K],
    switch_mlp -> fused experts. For a transformers run on exactly the MLX weights."""
    import mlx.core as mx

    raw = mlx_read_raw(ckpt_dir)
    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    qcfg = cfg.get("quantization", {})
    dense: dict[str, np.ndarray] = {}
    for k, v in raw.items():
        if k.endswith(".scales") or k.endswith(".biases"):
            continue
        mod = k[: -len(".weight")] if k.endswith(".weight") else None
        if mod is not None and f"{mod}.scales" in raw:
            s, b = raw[f"{mod}.scales"], raw[f"{mod}.biases"]
            over = qcfg.get(mod, {}) if isinstance(qcfg.get(mod), dict) else {}
            gs = over.get("group_size", qcfg["group_size"])
            bits = over.get("bits", qcfg["bits"])
            # bits from shapes must agree with the config (docs/model.md §7.5)
            in_f = s.shape[-1] * gs
            assert v.shape[-1] * 32 // in_f == bits, (mod, v.shape, s.shape, gs, bits)
            ref = mx.dequantize(v, s.astype(mx.float32), b.astype(mx.float32), group_size=gs,
                                bits=bits)
            ref = np.array(ref.astype(mx.float32))
            if use_numpy:
                w = np_dequantize(np.array(v), np.array(s.astype(mx.float32)),
                                  np.array(b.astype(mx.float32)), bits, gs)
                if not np.array_equal(w, ref):
                    err = np.abs(w - ref).max()
                    assert err <= 1e-6 * max(1.0, np.abs(ref).max()), f"{mod}: numpy dequant err {err}"
            dense[k] = ref
        else:
            dense[k] = np.array(v.astype(mx.float32))
    state: dict[str, torch.Tensor] = {}
    norm_sfx = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                "k_norm.weight")
    for k, v in dense.items():
        if k.startswith("language_model.model."):
            name = "model." + k[len("language_model.model."):]
        elif k == "language_model.lm_head.weight":
            name = "lm_head.weight"
        else:
            raise AssertionError(f"unexpected MLX tensor {k}")
        t = torch.from_numpy(np.ascontiguousarray(v)).float()
        if name.endswith(norm_sfx) or name == "model.norm.weight":
            t = t - 1.0
        if name.endswith("conv1d.weight"):
            assert t.shape[-1] == 1, (name, t.shape)
            t = t.permute(0, 2, 1).contiguous()
        state[name] = t
    for L in range(case.layers):
        p = f"model.layers.{L}.mlp"
        if f"{p}.switch_mlp.gate_proj.weight" in state:
            gp = state.pop(f"{p}.switch_mlp.gate_proj.weight")
            up = state.pop(f"{p}.switch_mlp.up_proj.weight")
            state[f"{p}.experts.gate_up_proj"] = torch.cat([gp, up], dim=1)
            state[f"{p}.experts.down_proj"] = state.pop(f"{p}.switch_mlp.down_proj.weight")
    return state


def check_mlx_checkpoint(d: Path, case: Case, bits: int, gs: int) -> tuple[bool, str]:
    """The mlx-lm-written checkpoint has the documented shape: quantization block with per
    layer 8-bit g64 gate overrides, bf16 scales, f32 A_log, conv [C,K,1], norms with +1."""
    import mlx.core as mx

    cfg = json.loads((d / "config.json").read_text())
    raw = mlx_read_raw(d)
    q = cfg.get("quantization")
    problems = []
    if not q or q.get("bits") != bits or q.get("group_size") != gs or q.get("mode") != "affine":
        problems.append(f"quantization block {q and {k: v for k, v in q.items() if not isinstance(v, dict)}}")
    if cfg.get("quantization_config") != q:
        problems.append("quantization_config != quantization")
    if "vision_config" in cfg or "text_config" not in cfg:
        problems.append("wrapper/vision_config")
    for L in range(case.layers):
        for mod in ("mlp.gate", "mlp.shared_expert_gate"):
            path = f"language_model.model.layers.{L}.{mod}"
            if q.get(path) != {"group_size": 64, "bits": 8}:
                problems.append(f"{path} override {q.get(path)}")
            if raw[f"{path}.weight"].dtype != mx.uint32:
                problems.append(f"{path} not quantized")
    for k, v in raw.items():
        if k.endswith("A_log") and v.dtype != mx.float32:
            problems.append(f"{k} {v.dtype}")
        if k.endswith((".scales", ".biases")) and v.dtype != mx.bfloat16:
            problems.append(f"{k} {v.dtype}")
        if k.endswith("conv1d.weight") and v.shape[-1] != 1:
            problems.append(f"{k} shape {v.shape}")
        if k.startswith(("mtp.", "model.visual", "vision_tower")):
            problems.append(f"extra {k}")
    # dense-kept modules are exactly those whose in_features are not a multiple of gs
    for k, v in raw.items():
        if k.endswith(".weight") and v.ndim >= 2 and "conv1d" not in k and v.dtype != mx.uint32:
            if v.shape[-1] % gs == 0:
                problems.append(f"{k} left unquantized")
    return not problems, "ok" if not problems else "; ".join(problems[:6])
