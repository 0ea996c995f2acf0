"""Self-check of the reference harness (no orchid needed): every layout round-trips (own
inverse mapping and transformers' from_pretrained), transformers prefill == step-by-step
decode, logits are informative, routing has no near-ties, mlx-lm agrees with transformers,
mlx-lm checkpoints have the documented format, and the numpy quantizer equals mx.quantize.

    python tests/python/reference.py selfcheck [--cases q35_a,next_a] [--quick] [--no-mlx]
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from reference import (HF, HF_CG_PER_EXPERT, HF_MATRIX, MLX_MATRIX, NEXT, PROMPT_LENGTHS, T_MAX,
                       Case, Workspace, compare_logits, hf_model_from_state, hf_prefill_logits,
                       logit_quality, read_checkpoint_as_hf, router_margins, tokens_for)
from mlx_reference import (check_mlx_checkpoint, mlx_checkpoint_as_hf, mlx_decode_logits,
                           mlx_load_f32, mlx_prefill_logits)


def _check(report: list, ok: bool, what: str):
    report.append(("PASS" if ok else "FAIL", what))
    print(("  ok   " if ok else "  FAIL ") + what, flush=True)
    return ok


def selfcheck(ws: Workspace, cases: list[Case], quick: bool = False, mlx: bool = True) -> bool:
    """Verify the reference side: layouts round-trip (own inverse and transformers'
    from_pretrained), prefill == decode, logits are informative, mlx-lm == transformers."""
    from transformers import AutoModelForCausalLM

    report: list = []
    for case in cases:
        print(f"[{case.name}] {case.note}", flush=True)
        toks = tokens_for(case)
        for (cname, layout, dtype, shards) in HF_MATRIX:
            if cname != case.name:
                continue
            tag = f"{case.name} {layout} {dtype} shards={shards}"
            ref = ws.hf_reference(case, layout, dtype, decode=not quick or layout in (HF, NEXT))
            pre = ref["prefill"][T_MAX]
            q = logit_quality(pre)
            _check(report, q["last_std"] > 1.0 and q["frac_gap_lt_1e-3"] < 0.02,
                   f"{tag}: logits informative {json.dumps({k: round(v, 4) for k, v in q.items()})}")
            if "decode" in ref:
                c = compare_logits(ref["decode"], pre)
                _check(report, c.ok(1e-5), f"{tag}: HF decode vs HF prefill: {c}")
            worst = max(compare_logits(ref["prefill"][L], pre[:L]).max_rel for L in PROMPT_LENGTHS)
            _check(report, worst <= 1e-5, f"{tag}: HF prefix prefills agree (max rel {worst:.2e})")
            d = ws.hf_checkpoint(case, layout, dtype, shards)
            # 1) our own inverse mapping, strict load, bitwise-identical logits
            m2 = hf_model_from_state(case, read_checkpoint_as_hf(case, layout, d))
            got = hf_prefill_logits(m2, toks[:65])
            _check(report, np.array_equal(got, ref["prefill"][65]),
                   f"{tag}: own inverse mapping round-trips exactly")
            # 2) transformers' own loader on the written directory
            try:
                kw = dict(dtype=torch.float32, attn_implementation="eager",
                          experts_implementation="eager")
                if layout in (HF, HF_CG_PER_EXPERT):
                    from transformers import Qwen3_5MoeForCausalLM
                    m3 = Qwen3_5MoeForCausalLM.from_pretrained(str(d), **kw)
                else:
                    m3 = AutoModelForCausalLM.from_pretrained(str(d), **kw)
                got = hf_prefill_logits(m3.eval(), toks[:65])
                c = compare_logits(got, ref["prefill"][65])
                _check(report, c.max_rel <= 1e-6 and not c.argmax_mismatch,
                       f"{tag}: transformers from_pretrained({type(m3).__name__}) reads it: {c}")
            except Exception as e:  # noqa: BLE001
                _check(report, False, f"{tag}: transformers from_pretrained failed: {e!r}")
        if not quick:
            rm = router_margins(ws.model(case, case.layouts[0], "f32"), toks)
            _check(report, rm["frac_lt_1e-4"] < 1e-3 and rm["n_lt_1e-6"] == 0,
                   f"{case.name}: router top-k margins {rm}")
        if case.family == "qwen3_next":
            _check(report, check_next_interleave(ws.model(case, NEXT, "f32"), case),
                   f"{case.name}: spec §2.2 un-interleave of in_proj_qkvz/in_proj_ba == HF")
        if not mlx:
            continue
        if case.family == "qwen3_next":
            ok, msg = mlx_vs_hf_next(ws, case)
            _check(report, ok, f"{case.name}: mlx-lm qwen3_next on the Qwen3-Next layout vs HF: {msg}")
            continue
        if not case.mlx_compatible:
            continue
        # mlx-lm on the unquantized official f32 layout vs transformers
        ref = ws.hf_reference(case, HF, "f32", decode=False)
        model, _ = mlx_load_f32(ws.hf_checkpoint(case, HF, "f32"))
        worst = 0.0
        for L in PROMPT_LENGTHS:
            c = compare_logits(mlx_prefill_logits(model, toks[:L]), ref["prefill"][L])
            worst = max(worst, c.max_rel)
            if c.argmax_mismatch:
                worst = math.inf
        _check(report, worst <= 1e-5, f"{case.name}: mlx-lm (f32 official layout) vs HF, max rel {worst:.2e}")
        if not quick:
            c = compare_logits(mlx_decode_logits(model, toks[:T_MAX]), ref["prefill"][T_MAX])
            _check(report, c.ok(1e-5), f"{case.name}: mlx-lm decode vs HF prefill: {c}")
        for (cname, bits, gs) in MLX_MATRIX:
            if cname != case.name:
                continue
            d = ws.mlx_checkpoint(case, bits, gs)
            ok, msg = check_mlx_checkpoint(d, case, bits, gs)
            _check(report, ok, f"{case.name} mlx q{bits} g{gs}: checkpoint format: {msg}")
            mref = ws.mlx_reference(d, case)
            # transformers on the dequantized MLX weights == mlx-lm quantized (f32 compute)
            mh = hf_model_from_state(case, mlx_checkpoint_as_hf(case, d))
            worst = 0.0
            for L in (65, T_MAX):
                c = compare_logits(mref[L], hf_prefill_logits(mh, toks[:L]))
                worst = max(worst, c.max_rel if not c.argmax_mismatch else math.inf)
            q = logit_quality(mref[T_MAX])
            # 5e-5: one position of q35_a q4g128 reaches 1.8e-5 (quantized_matmul's s·Σxq + b·Σx
            # vs a dense matmul, amplified through the layers); typical is 1e-6
            _check(report, worst <= 5e-5 and q["last_std"] > 1.0,
                   f"{case.name} mlx q{bits} g{gs}: mlx-lm vs HF on dequantized weights, max rel "
                   f"{worst:.2e}; last std {q['last_std']:.2f}")
    n_fail = sum(1 for s, _ in report if s == "FAIL")
    print(f"\n{len(report) - n_fail} passed, {n_fail} failed; timings "
          f"{ {k: round(v, 1) for k, v in ws.timings.items()} }")
    return n_fail == 0


def check_next_interleave(model, case: Case) -> bool:
    """De-interleave per model-spec §2.2 with numpy and compare with HF's
    fix_query_key_value_ordering on a random input."""
    layer = next(l for l in model.model.layers if hasattr(l, "linear_attn")).linear_attn
    x = torch.randn(1, 3, case.hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
    W = layer.in_proj_qkvz.weight.detach().numpy()
    Wba = layer.in_proj_ba.weight.detach().numpy()
    Hk, Hv, dk, dv = case.lin_k_heads, case.lin_v_heads, case.lin_k_dim, case.lin_v_dim
    r = Hv // Hk
    grp = W.reshape(Hk, 2 * dk + 2 * r * dv, case.hidden)
    Wq = grp[:, :dk].reshape(-1, case.hidden)
    Wk = grp[:, dk:2 * dk].reshape(-1, case.hidden)
    Wv = grp[:, 2 * dk:2 * dk + r * dv].reshape(-1, case.hidden)  # value head j = g*r + i
    Wz = grp[:, 2 * dk + r * dv:].reshape(-1, case.hidden)
    gba = Wba.reshape(Hk, 2 * r, case.hidden)
    Wb = gba[:, :r].reshape(-1, case.hidden)
    Wa = gba[:, r:].reshape(-1, case.hidden)
    xn = x[0].numpy()
    ok = True
    for got, Wm in ((q, Wq), (k, Wk), (v, Wv), (z, Wz), (b, Wb), (a, Wa)):
        ok &= np.allclose(got.reshape(3, -1).numpy(), xn @ Wm.T, atol=1e-5)
    return bool(ok)


def mlx_vs_hf_next(ws: Workspace, case: Case) -> tuple[bool, str]:
    """mlx-lm's qwen3_next model on our Qwen3-Next f32 layout (second implementation reading
    the same interleaved/per-expert files) vs transformers."""
    from mlx_lm.utils import load_model
    import mlx.core as mx

    d = ws.hf_checkpoint(case, NEXT, "f32")
    ref = ws.hf_reference(case, NEXT, "f32", decode=False)
    model, _ = load_model(d)
    model.set_dtype(mx.float32)
    toks = tokens_for(case)
    worst = 0.0
    for L in (64, 65, T_MAX):
        c = compare_logits(mlx_prefill_logits(model, toks[:L]), ref["prefill"][L])
        worst = max(worst, c.max_rel if not c.argmax_mismatch else math.inf)
    return worst <= 1e-5, f"max rel {worst:.2e}"
