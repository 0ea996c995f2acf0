"""Inside orchid: prefill in chunks of 1 (decode path), 7, 64, 100 and the default all give the
same logits (rel L2 ≤ 1e-5 at every position, same argmax) on a 300-token prompt."""

from __future__ import annotations

import pytest

import reference as R
from harness import CHUNK_TOL, assert_logits_match

CHUNKS = (1, 7, 64, 100)

CHECKPOINTS = [
    pytest.param(("hf", "q35_a", R.HF, "f32"), id="q35_a-hf-f32"),
    pytest.param(("hf", "q35_b", R.HF, "bf16"), id="q35_b-hf-bf16"),
    pytest.param(("hf", "q35_c", R.HF_PER_EXPERT, "f32"), id="q35_c-hf-per-expert-f32"),
    pytest.param(("hf", "next_b", R.NEXT, "f32"), id="next_b-next-f32"),
    pytest.param(("mlx", "q35_a", 4, 64), id="q35_a-mlx-q4g64"),
    pytest.param(("mlx", "q35_d", 8, 64), id="q35_d-mlx-q8g64", marks=pytest.mark.slow),
]


def _ckpt(ws, spec):
    kind, cname, a, b = spec
    case = R.CASES[cname]
    return case, (ws.hf_checkpoint(case, a, b) if kind == "hf" else ws.mlx_checkpoint(case, a, b))


@pytest.mark.parametrize("spec", CHECKPOINTS)
def test_chunk_sizes_agree(orchid, ws, spec):
    case, ckpt = _ckpt(ws, spec)
    toks = R.tokens_for(case)
    base = orchid.eval(ckpt, toks)
    for chunk in CHUNKS:
        res = orchid.eval(ckpt, toks, chunk=chunk)
        assert_logits_match(res.logits, base.logits, f"{spec[1]} chunk={chunk} vs default",
                            tol=CHUNK_TOL)
        assert abs(res.json["nll"] - base.json["nll"]) <= 1e-5 * max(1.0, abs(base.json["nll"]))
