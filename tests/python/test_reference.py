"""The reference harness checks itself (no orchid needed): every layout writer round-trips
(own inverse mapping and transformers' from_pretrained), transformers prefill == step-by-step
decode, logits and routing are informative, mlx-lm == transformers, mlx-lm checkpoints have
the documented format, the numpy MLX quantizer == mx.quantize. Plus the upstream behaviours
orchid has to mirror, pinned so that a change in transformers/mlx-lm shows up here."""

from __future__ import annotations

import json

import numpy as np
import pytest

import reference as R
import ref_selfcheck as S


def _assert_all(results):
    bad = [msg for ok, msg in results if not ok]
    assert not bad, "\n".join(bad)


def _eid(e):
    return f"{e[0]}-{e[1]}-{e[2]}" + (f"-{e[3]}shards" if e[3] > 1 else "")


def test_numpy_quantizer_is_mx_quantize():
    _assert_all([S.check_quantizer()])


@pytest.mark.parametrize("entry", [pytest.param(e, id=_eid(e)) for e in R.HF_MATRIX])
def test_layout_round_trips(ws, entry):
    _assert_all(S.check_hf_entry(ws, R.CASES[entry[0]], *entry[1:], decode=False))


DECODE_FAST = ("q35_a", "next_a")


@pytest.mark.parametrize("cname", [pytest.param(c, marks=() if c in DECODE_FAST else pytest.mark.slow)
                                   for c in R.CASES])
def test_hf_decode_equals_prefill(ws, cname):
    case = R.CASES[cname]
    ref = ws.hf_reference(case, case.layouts[0], "f32", decode=True)
    c = R.compare_logits(ref["decode"], ref["prefill"][R.T_MAX])
    assert c.ok(1e-5), f"{cname}: transformers decode vs prefill: {c}"


@pytest.mark.parametrize("cname", list(R.CASES))
def test_router_has_no_near_ties(ws, cname):
    case = R.CASES[cname]
    _assert_all([S.check_router(ws, case, case.layouts[0], "f32")])


@pytest.mark.parametrize("cname", [c for c in R.CASES if R.CASES[c].family == "qwen3_next"])
def test_next_interleave_matches_spec(ws, cname):
    case = R.CASES[cname]
    assert S.check_next_interleave(ws.model(case, R.NEXT, "f32"), case)


@pytest.mark.parametrize("cname", [pytest.param(c, marks=() if c == "q35_a" else pytest.mark.slow)
                                   for c in R.CASES if R.CASES[c].mlx_compatible])
def test_mlx_lm_equals_transformers(ws, cname):
    _assert_all(S.check_mlx_dense_vs_hf(ws, R.CASES[cname], decode=cname != "q35_a"))


@pytest.mark.parametrize("cname", [pytest.param(c, marks=() if c == "next_a" else pytest.mark.slow)
                                   for c in R.CASES if R.CASES[c].family == "qwen3_next"])
def test_mlx_lm_qwen3_next_equals_transformers(ws, cname):
    _assert_all([S.mlx_vs_hf_next(ws, R.CASES[cname])])


@pytest.mark.parametrize("entry", [pytest.param(e, id=f"{e[0]}-q{e[1]}g{e[2]}") for e in R.MLX_MATRIX])
def test_mlx_lm_quantized_checkpoint(ws, entry):
    _assert_all(S.check_mlx_variant(ws, R.CASES[entry[0]], entry[1], entry[2]))


# ---- upstream behaviours the engine mirrors -------------------------------------------


def test_transformers_qwen35_always_renormalises_topk(ws):
    """Qwen3_5MoeTopKRouter divides by the top-k sum unconditionally: norm_topk_prob in a
    qwen3_5_moe_text config is ignored (mlx-lm's qwen3_5 would honour it)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    case = R.CASES["q35_a"]
    model = ws.model(case, R.HF, "f32")
    d = R.qwen35_text_config(case, "f32")
    d.pop("model_type"), d.pop("dtype")
    m2 = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        **d, norm_topk_prob=False, attn_implementation="eager", experts_implementation="eager")).eval()
    m2.load_state_dict(model.state_dict())
    toks = R.tokens_for(case)[:65]
    assert np.array_equal(R.hf_prefill_logits(m2, toks), R.hf_prefill_logits(model, toks))


def test_mlx_lm_config_quirks(ws):
    """What mlx-lm's save_config writes for Qwen3.5: wrapper kept (model_type qwen3_5_moe,
    text_config), vision_config dropped, `quantization` == `quantization_config`, overrides
    without "mode", and rope_parameters' `rope_type` renamed to `type`."""
    case = R.CASES["q35_a"]
    cfg = json.loads((ws.mlx_checkpoint(case, 4, 64) / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and "vision_config" not in cfg
    assert cfg["quantization"] == cfg["quantization_config"]
    assert cfg["quantization"]["language_model.model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    rp = cfg["text_config"]["rope_parameters"]
    assert rp.get("type") == "default" and "rope_type" not in rp, rp
