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
                           mlx_load_f32, mlx_prefill_logits, np_affine_quantize)


def check_hf_entry(ws: Workspace, case: Case, layout: str, dtype: str, shards: int,
                   decode: bool = True) -> list[tuple[bool, str]]:
    """One written HF-layout checkpoint: informative logits, prefill == decode, prefix
    prefills agree, own inverse mapping round-trips exactly, transformers' from_pretrained
    reads the directory and gives the same logits."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForCausalLM

    out = []
    tag = f"{case.name} {layout} {dtype} shards={shards}"
    toks = tokens_for(case)
    ref = ws.hf_reference(case, layout, dtype, decode=decode)
    pre = ref["prefill"][T_MAX]
    q = logit_quality(pre)
    out.append((q["last_std"] > 1.0 and q["frac_gap_lt_1e-3"] < 0.02,
                f"{tag}: logits informative {json.dumps({k: round(v, 4) for k, v in q.items()})}"))
    if "decode" in ref:
        c = compare_logits(ref["decode"], pre)
        out.append((c.ok(1e-5), f"{tag}: HF decode vs HF prefill: {c}"))
    worst = max(compare_logits(ref["prefill"][L], pre[:L]).max_rel for L in PROMPT_LENGTHS)
    out.append((worst <= 1e-5, f"{tag}: HF prefix prefills agree (max rel {worst:.2e})"))
    d = ws.hf_checkpoint(case, layout, dtype, shards)
    # 1) own inverse mapping, strict load: bitwise-identical logits
    m2 = hf_model_from_state(case, read_checkpoint_as_hf(case, layout, d))
    got = hf_prefill_logits(m2, toks[:65])
    out.append((np.array_equal(got, ref["prefill"][65]), f"{tag}: own inverse mapping round-trips exactly"))
    # 2) transformers' own loader on the written directory (it ignores mtp.* / model.visual.*)
    try:
        kw = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
        cls = Qwen3_5MoeForCausalLM if layout in (HF, HF_CG_PER_EXPERT) else AutoModelForCausalLM
        m3 = cls.from_pretrained(str(d), **kw).eval()
        c = compare_logits(hf_prefill_logits(m3, toks[:65]), ref["prefill"][65])
        out.append((c.max_rel <= 1e-6 and not c.argmax_mismatch,
                    f"{tag}: transformers from_pretrained({type(m3).__name__}) reads it: {c}"))
    except Exception as e:  # noqa: BLE001
        out.append((False, f"{tag}: transformers from_pretrained failed: {e!r}"))
    return out


def check_router(ws: Workspace, case: Case, layout: str, dtype: str) -> tuple[bool, str]:
    rm = router_margins(ws.model(case, layout, dtype), tokens_for(case))
    return (rm["frac_lt_1e-4"] < 5e-3 and rm["n_lt_1e-5"] == 0,
            f"{case.name} {layout} {dtype}: router top-k logit margins {rm}")


def check_mlx_dense_vs_hf(ws: Workspace, case: Case, decode: bool = True) -> list[tuple[bool, str]]:
    """mlx-lm (f32) on the unquantized official f32 layout vs transformers; mlx-lm's own decode."""
    out = []
    toks = tokens_for(case)
    ref = ws.hf_reference(case, HF, "f32", decode=False)
    model, _ = mlx_load_f32(ws.hf_checkpoint(case, HF, "f32"))
    worst = 0.0
    for L in PROMPT_LENGTHS:
        c = compare_logits(mlx_prefill_logits(model, toks[:L]), ref["prefill"][L])
        worst = max(worst, c.max_rel if not c.argmax_mismatch else math.inf)
    out.append((worst <= 1e-5, f"{case.name}: mlx-lm (f32 official layout) vs HF, max rel {worst:.2e}"))
    if decode:
        c = compare_logits(mlx_decode_logits(model, toks[:T_MAX]), ref["prefill"][T_MAX])
        out.append((c.ok(1e-5), f"{case.name}: mlx-lm decode vs HF prefill: {c}"))
    return out


def check_mlx_variant(ws: Workspace, case: Case, bits: int, gs: int) -> list[tuple[bool, str]]:
    """An mlx-lm-written quantized checkpoint: documented format; transformers on its
    dequantized weights (numpy dequantizer, cross-checked with mx.dequantize) equals mlx-lm's
    quantized f32 logits; routing on the quantized router is not near-tied."""
    out = []
    tag = f"{case.name} mlx q{bits} g{gs}"
    toks = tokens_for(case)
    d = ws.mlx_checkpoint(case, bits, gs)
    ok, msg = check_mlx_checkpoint(d, case, bits, gs)
    out.append((ok, f"{tag}: checkpoint format: {msg}"))
    mref = {L: ws.mlx_logits(d, case, L) for L in (65, T_MAX)}
    mh = hf_model_from_state(case, mlx_checkpoint_as_hf(case, d))
    worst = 0.0
    for L in (65, T_MAX):
        c = compare_logits(mref[L], hf_prefill_logits(mh, toks[:L]))
        worst = max(worst, c.max_rel if not c.argmax_mismatch else math.inf)
    q = logit_quality(mref[T_MAX])
    # 5e-5: one position of q35_a q4g128 reaches 1.8e-5 (quantized_matmul's s·Σxq + b·Σx vs a
    # dense matmul, amplified through the layers); typical is 1e-6
    out.append((worst <= 5e-5 and q["last_std"] > 1.0,
                f"{tag}: mlx-lm vs HF on dequantized weights, max rel {worst:.2e}; "
                f"last std {q['last_std']:.2f}"))
    rm = router_margins(mh, toks)
    out.append((rm["frac_lt_1e-4"] < 5e-3 and rm["n_lt_1e-5"] == 0, f"{tag}: router margins {rm}"))
    return out


def check_quantizer() -> tuple[bool, str]:
    """np_affine_quantize (docs/model.md §7.6) == mx.quantize bit for bit, f32 and bf16 input,
    including an all-zero, a constant and a symmetric group."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    bad = []
    for src in ("f32", "bf16"):
        for bits, gs in ((4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)):
            w = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
            w[0, :gs] = 0.0
            w[1, :gs] = 0.01
            w[2, :gs] = np.linspace(-1, 1, gs)
            if src == "bf16":
                w = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
                wm, odt = mx.array(w).astype(mx.bfloat16), torch.bfloat16
            else:
                wm, odt = mx.array(w), torch.float32
            pm, sm, bm = mx.quantize(wm, group_size=gs, bits=bits)
            pn, sn, bn = np_affine_quantize(w, bits, gs, odt)
            n = (int((np.array(pm) != pn).sum()) + int((np.array(sm.astype(mx.float32)) != sn).sum())
                 + int((np.array(bm.astype(mx.float32)) != bn).sum()))
            if n:
                bad.append(f"{src} q{bits} g{gs}: {n} differing elements")
    return not bad, "numpy affine quantizer == mx.quantize bit for bit" if not bad else "; ".join(bad)


def selfcheck(ws: Workspace, cases: list[Case], quick: bool = False, mlx: bool = True) -> bool:
    report: list[tuple[bool, str]] = []

    def emit(items):
        for ok, msg in items:
            report.append((ok, msg))
            print(("  ok   " if ok else "  FAIL ") + msg, flush=True)

    if mlx:
        emit([check_quantizer()])
    for case in cases:
        print(f"[{case.name}] {case.note}", flush=True)
        for (cname, layout, dtype, shards) in HF_MATRIX:
            if cname == case.name:
                emit(check_hf_entry(ws, case, layout, dtype, shards,
                                    decode=not quick or layout in (HF, NEXT)))
        if not quick:
            emit([check_router(ws, case, case.layouts[0], "f32")])
        if case.family == "qwen3_next":
            emit([(check_next_interleave(ws.model(case, NEXT, "f32"), case),
                   f"{case.name}: spec §2.2 un-interleave of in_proj_qkvz/in_proj_ba == HF")])
            if mlx:
                emit([mlx_vs_hf_next(ws, case)])
            continue
        if not mlx or not case.mlx_compatible:
            continue
        emit(check_mlx_dense_vs_hf(ws, case, decode=not quick))
        for (cname, bits, gs) in MLX_MATRIX:
            if cname == case.name:
                emit(check_mlx_variant(ws, case, bits, gs))
    n_fail = sum(1 for ok, _ in report if not ok)
    print(f"\n{len(report) - n_fail} passed, {n_fail} failed; timings "
          f"{ {k: round(v, 1) for k, v in ws.timings.items()} }")
    return n_fail == 0


def check_next_interleave(model, case: Case) -> bool:
    """De-interleave per docs/model.md §7.4 with numpy and compare with HF's
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
    import mlx.core as mx
    from mlx_lm.utils import load_model

    d = ws.hf_checkpoint(case, NEXT, "f32")
    ref = ws.hf_reference(case, NEXT, "f32", decode=False)
    model, _ = load_model(d)
    model.set_dtype(mx.float32)
    toks = tokens_for(case)
    worst = 0.0
    for L in (64, 65, T_MAX):
        c = compare_logits(mlx_prefill_logits(model, toks[:L]), ref["prefill"][L])
        worst = max(worst, c.max_rel if not c.argmax_mismatch else math.inf)
    return (worst <= 1e-5,
            f"{case.name}: mlx-lm qwen3_next on the Qwen3-Next layout vs HF: max rel {worst:.2e}")
