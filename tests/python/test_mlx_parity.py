"""orchid vs mlx-lm on MLX affine checkpoints.

1. Checkpoints written by mlx-lm itself (load -> bf16 cast -> quantize_model with mlx-lm's
   own predicate, 8-bit g64 router/shared_expert_gate -> save_model/save_config) at 4 bits
   (g32/g64/g128) and 8 bits: orchid's logits == mlx-lm's (model.set_dtype(float32): bf16
   scales/biases, f32 compute), rel L2 ≤ 1e-4 at every position, same argmax.
2. `orchid quantize` output loads in mlx-lm and mlx-lm's logits on it equal orchid's; its
   tensors equal mlx-lm's own quantization of the same source bit for bit (a handful of
   differing round-half ties is reported, not failed).
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest

import reference as R
from harness import assert_logits_match

PRIMARY = R.MLX_MATRIX[0]


def _mid(e) -> str:
    return f"{e[0]}-q{e[1]}g{e[2]}"


def _params():
    out = []
    for e in R.MLX_MATRIX:
        for L in R.PROMPT_LENGTHS:
            fast = e == PRIMARY or L in (65, R.T_MAX)
            out.append(pytest.param(e, L, None, id=f"{_mid(e)}-L{L}",
                                    marks=() if fast else pytest.mark.slow))
        out.append(pytest.param(e, R.T_MAX, 1, id=f"{_mid(e)}-L{R.T_MAX}-chunk1",
                                marks=() if e == PRIMARY else pytest.mark.slow))
    return out


@pytest.mark.parametrize("entry,L,chunk", _params())
def test_mlx_lm_checkpoint(orchid, ws, entry, L, chunk):
    cname, bits, gs = entry
    case = R.CASES[cname]
    ckpt = ws.mlx_checkpoint(case, bits, gs)
    ref = ws.mlx_logits(ckpt, case, L)
    res = orchid.eval(ckpt, R.tokens_for(case)[:L], chunk=chunk)
    assert_logits_match(res.logits, ref, f"{_mid(entry)} L={L} chunk={chunk or 'default'}")


def test_mlx_lm_unquantized_checkpoint(orchid, ws):
    """mlx_lm.convert without -q: MLX names (switch_mlp, conv [C,K,1], norms stored as 1+w in
    bf16) but plain bf16 weights."""
    case = R.CASES["q35_a"]
    ckpt = ws.mlx_checkpoint(case, None, None)
    ref = ws.mlx_logits(ckpt, case, R.T_MAX)
    res = orchid.eval(ckpt, R.tokens_for(case))
    assert_logits_match(res.logits, ref, "q35_a mlx-lm bf16 (unquantized)")


# --------------------------------------------------------------------------------------
# orchid quantize
# --------------------------------------------------------------------------------------

# (case, source layout, source dtype, bits, group size)
QUANTIZE = [
    pytest.param(("q35_a", R.HF, "bf16", 4, 64), id="q35_a-hf-bf16-q4g64"),
    pytest.param(("q35_a", R.HF, "bf16", 8, 64), id="q35_a-hf-bf16-q8g64"),
    pytest.param(("q35_a", R.HF, "f32", 4, 64), id="q35_a-hf-f32-q4g64"),
    pytest.param(("q35_b", R.HF, "bf16", 4, 128), id="q35_b-hf-bf16-q4g128-dense-out_proj"),
    pytest.param(("q35_d", R.HF, "bf16", 4, 32), id="q35_d-hf-bf16-q4g32", marks=pytest.mark.slow),
]


@pytest.fixture(scope="session")
def orchid_quantize(orchid):
    p = orchid.run("quantize", "--help", timeout=60)
    if p.returncode != 0:
        pytest.skip("orchid binary has no `quantize` command yet")
    return orchid


_quantized: dict = {}


def _orchid_quantized(orchid, ws, spec):
    """orchid quantize output dir for spec (memoised per session)."""
    if spec not in _quantized:
        cname, layout, dtype, bits, gs = spec
        src = ws.hf_checkpoint(R.CASES[cname], layout, dtype)
        out = ws.root / "orchid-quantized" / f"{cname}-{layout}-{dtype}-q{bits}g{gs}"
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        orchid.quantize(src, out, bits, gs)
        _quantized[spec] = out
    return _quantized[spec]


def _scales_dtype(raw: dict):
    import mlx.core as mx

    dts = {v.dtype for k, v in raw.items() if k.endswith(".scales")}
    assert len(dts) == 1, f"mixed scale dtypes {dts}"
    d = dts.pop()
    return {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}[d]


@pytest.mark.parametrize("spec", QUANTIZE)
def test_orchid_quantize_loads_in_mlx_lm(orchid_quantize, ws, spec):
    from mlx_reference import mlx_load_f32, mlx_prefill_logits

    case = R.CASES[spec[0]]
    out = _orchid_quantized(orchid_quantize, ws, spec)
    model, _ = mlx_load_f32(out)  # strict load: every tensor mlx-lm expects, nothing more
    toks = R.tokens_for(case)
    for L in (65, R.T_MAX):
        ref = mlx_prefill_logits(model, toks[:L])
        res = orchid_quantize.eval(out, toks[:L])
        assert_logits_match(res.logits, ref, f"orchid-quantized {spec} L={L} vs mlx-lm on it")


@pytest.mark.parametrize("spec", QUANTIZE)
def test_orchid_quantize_equals_mlx_lm_quantization(orchid_quantize, ws, spec, tmp_path):
    """Same tensor names, shapes, dtypes, config quantization block; packed weights, scales and
    biases bit-identical to mlx-lm's quantization of the same source (converted with the
    dtype orchid chose for its scales). Fails if more than 1e-4 of the elements differ."""
    import mlx.core as mx

    from mlx_reference import mlx_convert, mlx_read_raw, np_unpack

    cname, layout, dtype, bits, gs = spec
    case = R.CASES[cname]
    out = _orchid_quantized(orchid_quantize, ws, spec)
    got = mlx_read_raw(out)
    conv_dtype = _scales_dtype(got)
    ref_dir = mlx_convert(ws.hf_checkpoint(case, layout, dtype), tmp_path / "mlx", bits, gs,
                          dtype=conv_dtype)
    want = mlx_read_raw(ref_dir)

    assert sorted(got) == sorted(want), (
        f"tensor names differ: only orchid {sorted(set(got) - set(want))[:8]}, "
        f"only mlx-lm {sorted(set(want) - set(got))[:8]}")
    cfg_got = json.loads((out / "config.json").read_text())
    cfg_want = json.loads((ref_dir / "config.json").read_text())
    q_got, q_want = cfg_got.get("quantization"), cfg_want["quantization"]
    assert q_got is not None, "orchid's config.json has no `quantization` block"
    assert {k: v for k, v in q_got.items() if k != "mode"} == \
        {k: v for k, v in q_want.items() if k != "mode"}, "quantization blocks differ"
    assert q_got.get("mode", "affine") == "affine"
    if cfg_got.get("quantization_config") != q_got:
        warnings.warn("orchid's config.json lacks mlx-lm's duplicate `quantization_config` block")
    assert "text_config" in cfg_got and cfg_got.get("model_type") == cfg_want["model_type"]

    report, total, bad_total = [], 0, 0
    for k in sorted(want):
        a, b = got[k], want[k]
        assert a.shape == b.shape and a.dtype == b.dtype, f"{k}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if a.dtype == mx.uint32:  # compare quantized values, not words
            mod = k[: -len(".weight")]
            in_f = want[f"{mod}.scales"].shape[-1] * (
                q_want.get(mod, {}).get("group_size", q_want["group_size"]))
            b_ = q_want.get(mod, {}).get("bits", q_want["bits"])
            x, y = np_unpack(np.array(a), b_, in_f), np_unpack(np.array(b), b_, in_f)
        else:
            x, y = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        n_bad = int((x != y).sum())
        total += x.size
        bad_total += n_bad
        if n_bad:
            report.append(f"{k}: {n_bad}/{x.size}")
    if report:
        warnings.warn(f"orchid quantize {spec}: {bad_total} of {total} elements differ from "
                      f"mlx-lm: {'; '.join(report[:10])}")
    assert bad_total <= 1e-4 * total, (
        f"{bad_total}/{total} elements differ from mlx-lm's quantization (mlx_lm.convert "
        f"--dtype {conv_dtype}: the weights are cast to {conv_dtype} first, then quantized): "
        f"{'; '.join(report[:6])}. {_diagnose(ws, spec, got, conv_dtype)}")


def _diagnose(ws, spec, got, conv_dtype) -> str:
    """Which quantization did orchid do? Test one tensor (embed_tokens) against 'quantize the
    source precision, round scales/biases to the output dtype afterwards'."""
    import mlx.core as mx
    import torch

    from mlx_reference import np_affine_quantize, np_unpack

    cname, layout, dtype, bits, gs = spec
    src = R.read_checkpoint_as_hf(R.CASES[cname], layout, ws.hf_checkpoint(R.CASES[cname], layout, dtype))
    w = src["model.embed_tokens.weight"].numpy()
    p, s, b = np_affine_quantize(w, bits, gs, getattr(torch, conv_dtype))
    k = "language_model.model.embed_tokens"
    same = (np.array_equal(np_unpack(p, bits, w.shape[1]), np_unpack(np.array(got[f"{k}.weight"]), bits, w.shape[1]))
            and np.array_equal(s, np.array(got[f"{k}.scales"].astype(mx.float32)))
            and np.array_equal(b, np.array(got[f"{k}.biases"].astype(mx.float32))))
    return (f"orchid's embed_tokens {'EQUALS' if same else 'does not equal'} the {dtype} source "
            f"quantized at full precision with scales/biases rounded to {conv_dtype} afterwards.")


@pytest.mark.slow
def test_orchid_quantize_is_layout_independent(orchid_quantize, ws):
    """Quantizing the per-expert layout gives the same files as quantizing the fused official
    layout of the same f32 weights."""
    import mlx.core as mx

    from mlx_reference import mlx_read_raw

    a = _orchid_quantized(orchid_quantize, ws, ("q35_a", R.HF, "f32", 4, 64))
    b = _orchid_quantized(orchid_quantize, ws, ("q35_a", R.HF_PER_EXPERT, "f32", 4, 64))
    ra, rb = mlx_read_raw(a), mlx_read_raw(b)
    assert sorted(ra) == sorted(rb)
    for k in ra:
        assert bool(mx.array_equal(ra[k], rb[k])), k
