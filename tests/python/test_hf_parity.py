"""orchid vs transformers (f32, CPU) on random checkpoints in every HF layout.

For each (case, layout, dtype, shards) of reference.HF_MATRIX: orchid's logits with the
default prefill chunk, with `--chunk 32` (prompts longer than the chunk) and with `--chunk 1`
(decode path) must match transformers' at EVERY position: rel L2 ≤ 1e-4, same argmax, no NaN.
bf16 checkpoints are compared with transformers run in f32 on the bf16-rounded weights.

Fast suite: every prompt length on the first (primary) entry of each case, lengths 65 and
300 on the others; the rest is marked slow (--runslow).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import reference as R
from harness import assert_logits_match, check_eval_json

PRIMARY = {}
for _e in R.HF_MATRIX:
    PRIMARY.setdefault(_e[0], _e)


def _eid(e) -> str:
    case, layout, dtype, shards = e
    return f"{case}-{layout}-{dtype}" + (f"-{shards}shards" if shards > 1 else "")


def _params():
    out = []
    for e in R.HF_MATRIX:
        primary = PRIMARY[e[0]] == e
        for L in R.PROMPT_LENGTHS:
            fast = primary or L in (65, R.T_MAX)
            out.append(pytest.param(e, L, None, id=f"{_eid(e)}-L{L}-default",
                                    marks=() if fast else pytest.mark.slow))
        for L in (65, R.T_MAX):
            fast = primary or L == R.T_MAX
            out.append(pytest.param(e, L, 32, id=f"{_eid(e)}-L{L}-chunk32",
                                    marks=() if fast else pytest.mark.slow))
        out.append(pytest.param(e, R.T_MAX, 1, id=f"{_eid(e)}-L{R.T_MAX}-chunk1"))
    return out


@pytest.mark.parametrize("entry,L,chunk", _params())
def test_logits_match_transformers(orchid, ws, entry, L, chunk):
    cname, layout, dtype, shards = entry
    case = R.CASES[cname]
    ckpt = ws.hf_checkpoint(case, layout, dtype, shards)
    ref = ws.hf_reference(case, layout, dtype, decode=False)["prefill"][L]
    toks = R.tokens_for(case)[:L]
    res = orchid.eval(ckpt, toks, chunk=chunk)
    what = f"{_eid(entry)} L={L} chunk={chunk or 'default'}"
    assert_logits_match(res.logits, ref, what)
    if chunk is None:
        check_eval_json(res, ref, toks, what)


@pytest.mark.slow
@pytest.mark.parametrize("cname", ["q35_a", "next_a"])
def test_decode_path_matches_transformers_decode(orchid, ws, cname):
    """--chunk 1 against transformers' own step-by-step decode with the cache."""
    case = R.CASES[cname]
    layout = case.layouts[0]
    ckpt = ws.hf_checkpoint(case, layout, "f32")
    ref = ws.hf_reference(case, layout, "f32", decode=True)["decode"]
    res = orchid.eval(ckpt, R.tokens_for(case), chunk=1)
    assert_logits_match(res.logits, ref, f"{cname} chunk=1 vs HF decode")


def test_qwen35_ignores_norm_topk_prob(orchid, ws, tmp_path):
    """transformers' Qwen3.5-MoE router always renormalises the top-k weights; a stray
    `norm_topk_prob: false` in a qwen3_5_moe_text config changes nothing there (mlx-lm would
    honour it). orchid follows transformers for HF checkpoints."""
    case = R.CASES["q35_a"]
    src = ws.hf_checkpoint(case, R.HF, "f32")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"]["norm_topk_prob"] = False
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    ref = ws.hf_reference(case, R.HF, "f32", decode=False)["prefill"][65]
    res = orchid.eval(dst, R.tokens_for(case)[:65])
    assert_logits_match(res.logits, ref, "q35_a with text_config.norm_topk_prob=false")


def test_reference_is_informative(ws):
    """Guards the harness itself: the logits the suite compares against are far from uniform."""
    for cname, e in PRIMARY.items():
        case = R.CASES[cname]
        q = R.logit_quality(ws.hf_reference(case, e[1], e[2], decode=False)["prefill"][R.T_MAX])
        assert q["last_std"] > 1.0 and q["frac_gap_lt_1e-3"] < 0.02, (cname, q)
        assert np.isfinite(q["min_std"])
