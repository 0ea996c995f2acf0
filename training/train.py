#!/usr/bin/env python3
"""Train orchid-tiny: a ~20 M-parameter model with exactly the Qwen3.5-MoE architecture.

PyTorch + transformers `Qwen3_5MoeForCausalLM` (hybrid Gated DeltaNet / gated
full attention 3:1, partial RoPE, q/k norm, routed top-k experts + sigmoid-gated
shared expert, untied lm_head). Trains for a fixed wall-clock budget on the
pre-tokenized corpus of train_tokenizer.py, evaluates the held-out split, and
saves a bf16 HF checkpoint (safetensors shards < 15 MB) with tokenizer files,
generation_config.json, train_log.csv and train_summary.json.

CPU smoke test (runs end to end in about a minute):
    python training/train.py --preset cpu-test --minutes 0.5 --max-steps 20 --batch 8 --seq 256 \
        --out training/out/cpu-test
Full run (H200, one `device` call; see training/README.md):
    python3 training/train.py --preset full --minutes 7 --total-minutes 8.2 --try-compile --out /tmp/run
"""
from __future__ import annotations

import argparse
import csv
import json
import lzma
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent

# Sampling weight of each source relative to its natural share of tokens.
# Small, clean or chat-shaped sources are repeated more; the 1913 dictionary,
# the Python docs and the archaic verse less.
SOURCE_WEIGHTS = {
    "sotu": 0.7, "brown": 1.5, "moby_dick": 1.5, "wiki": 2.0, "c4": 2.0, "technical": 2.0,
    "tinystories": 5.0, "shakespeare": 0.6, "milton": 0.5, "python_docs": 0.4, "gcide": 0.3,
    "chat_define": 1.0, "chat_use": 1.5, "chat_story": 4.0, "chat_continue": 2.0,
}

PRESETS = {
    # The shipped model. Every matrix input dim is a multiple of 64 (MLX group-64).
    "full": dict(
        hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=192,
    ),
    # Same shape family, tiny, for the CPU smoke test.
    "cpu-test": dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    ),
}


def mrope_section(head_dim: int, partial: float = 0.25) -> list[int]:
    """Qwen3.5's [11, 11, 10] (sum 32 = rotary_dim/2 for head_dim 256) scaled to this head_dim.
    Text-only positions are equal on all three axes, so this only keeps the config consistent."""
    half = int(head_dim * partial) // 2
    t = round(half * 11 / 32)
    return [t, t, half - 2 * t]


def make_config(preset: str, vocab: int, eot: int):
    from transformers import Qwen3_5MoeTextConfig
    p = dict(PRESETS[preset])
    n = p["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab,
        max_position_embeddings=262144,
        layer_types=layer_types,
        full_attention_interval=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        attention_bias=False,
        attn_output_gate=True,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope_section(p["head_dim"]), "mrope_interleaved": True},
        partial_rotary_factor=0.25,
        router_aux_loss_coef=0.001,
        output_router_logits=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
        mamba_ssm_dtype="float32",
        eos_token_id=eot,
        bos_token_id=None,
        pad_token_id=None,
        **p,
    )


def load_stream(path: Path) -> np.ndarray:
    with lzma.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype="<u2").astype(np.int32)


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    emb = model.model.embed_tokens.weight.numel()
    head = model.lm_head.weight.numel()
    cfg = model.config
    expert = 0
    for layer in model.model.layers:
        expert += sum(p.numel() for p in layer.mlp.experts.parameters())
    active = total - emb - expert + expert * cfg.num_experts_per_tok // cfg.num_experts
    return {"total": total, "embedding": emb, "lm_head": head, "routed_experts": expert,
            "active_per_token_excl_embedding": active}


def check_dims(model):
    """Every 2-D/3-D weight's input (last) dim must be a multiple of 64 (MLX group-64)."""
    bad = []
    for name, p in model.named_parameters():
        if p.ndim >= 2 and "conv1d" not in name and p.shape[-1] % 64:
            bad.append((name, tuple(p.shape)))
    return bad


class Batcher:
    """Random windows of seq+1 tokens; the source of each row is drawn by weight."""

    def __init__(self, stream: torch.Tensor, spans: dict, weights: dict, seq: int, device, seed: int):
        self.stream, self.seq = stream, seq
        names = [s for s in sorted(spans) if spans[s][1] - spans[s][0] > seq + 1]
        self.names = names
        self.starts = torch.tensor([spans[s][0] for s in names], device=device)
        self.lens = torch.tensor([spans[s][1] - spans[s][0] - seq - 1 for s in names], device=device)
        w = torch.tensor([weights.get(s, 1.0) * (spans[s][1] - spans[s][0]) for s in names], dtype=torch.float)
        self.probs = (w / w.sum()).to(device)
        self.g = torch.Generator(device=device)
        self.g.manual_seed(seed)
        self.ar = torch.arange(seq + 1, device=device)

    def mix(self) -> dict:
        return {s: round(float(p), 4) for s, p in zip(self.names, self.probs.cpu())}

    def __call__(self, batch: int) -> torch.Tensor:
        src = torch.multinomial(self.probs, batch, replacement=True, generator=self.g)
        off = (torch.rand(batch, device=self.probs.device, generator=self.g) * self.lens[src]).long()
        idx = (self.starts[src] + off)[:, None] + self.ar[None, :]
        return self.stream[idx].long()


def lm_loss(model, x: torch.Tensor, aux: bool, amp_dtype, device_type: str):
    inp, tgt = x[:, :-1], x[:, 1:]
    with torch.autocast(device_type=device_type, dtype=amp_dtype, enabled=amp_dtype is not None):
        out = model(input_ids=inp, use_cache=False, output_router_logits=aux)
    loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), tgt.reshape(-1))
    aux_loss = out.aux_loss if aux and out.aux_loss is not None else None
    return loss, aux_loss


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, spans: dict, seq: int, batch: int, amp_dtype, device_type,
             max_tokens: int | None = None) -> dict:
    """Mean next-token loss over non-overlapping windows, overall and per source."""
    model.eval()
    res, tot_l, tot_n = {}, 0.0, 0
    for s in sorted(spans):
        a, b = spans[s]
        n_win = (b - a - 1) // seq
        if max_tokens:
            n_win = min(n_win, max(1, max_tokens // seq // len(spans)))
        if n_win <= 0:
            continue
        starts = a + torch.arange(n_win, device=stream.device) * seq
        sl, sn = 0.0, 0
        for i in range(0, n_win, batch):
            st = starts[i:i + batch]
            x = stream[st[:, None] + torch.arange(seq + 1, device=stream.device)[None]].long()
            loss, _ = lm_loss(model, x, False, amp_dtype, device_type)
            sl += loss.item() * x.shape[0] * seq
            sn += x.shape[0] * seq
        res[s] = round(sl / sn, 4)
        tot_l += sl
        tot_n += sn
    model.train()
    res["_all"] = round(tot_l / max(1, tot_n), 4)
    res["_tokens"] = tot_n
    return res


def grouped_bf16_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts as two grouped GEMMs in the autocast dtype (training only).

    transformers' "grouped_mm" casts the activations to the weights' dtype, i.e. fp32
    under autocast with fp32 master weights; this variant casts the weights to bf16
    instead (the cast is differentiable, so the fp32 masters get the gradients).
    Same math as Qwen3_5MoeExperts.forward: y = sum_k w_k * down_e(silu(gate_e x) * up_e x).
    """
    T, H = hidden_states.shape
    K = top_k_index.shape[1]
    E = self.gate_up_proj.shape[0]
    dt = torch.get_autocast_dtype(hidden_states.device.type) \
        if torch.is_autocast_enabled(hidden_states.device.type) else hidden_states.dtype
    flat = top_k_index.reshape(-1)
    sorted_e, order = torch.sort(flat, stable=True)
    offs = torch.searchsorted(sorted_e, torch.arange(E, device=flat.device), right=True).to(torch.int32)
    tok = order // K
    x = hidden_states[tok].to(dt)
    gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    gu = gmm(x, self.gate_up_proj.to(dt).transpose(-2, -1), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = gmm(F.silu(g) * u, self.down_proj.to(dt).transpose(-2, -1), offs=offs)
    y = y.float() * top_k_weights.reshape(-1)[order, None].float()
    out = torch.zeros(T, H, dtype=torch.float32, device=y.device).index_add_(0, tok, y)
    return out.to(hidden_states.dtype)


def set_impl(model, experts_impl: str | None, attn_impl: str | None):
    if experts_impl:
        import types
        for layer in model.model.layers:
            ex = layer.mlp.experts
            if experts_impl == "grouped_bf16":
                ex.forward = types.MethodType(grouped_bf16_experts_forward, ex)
            elif "forward" in ex.__dict__:
                del ex.forward                     # back to the class's dispatching forward
        if experts_impl != "grouped_bf16":
            model.set_experts_implementation(experts_impl)
    if attn_impl:
        model.set_attn_implementation(attn_impl)


def compile_gdn(enable: bool):
    """torch.compile (or restore) transformers' torch fallback of the chunked gated delta rule."""
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as mm
    if not hasattr(mm, "_orchid_orig_chunk"):
        mm._orchid_orig_chunk = mm.torch_chunk_gated_delta_rule
    if enable and not hasattr(mm, "_orchid_compiled_chunk"):
        mm._orchid_compiled_chunk = torch.compile(mm._orchid_orig_chunk, dynamic=False)
    mm.torch_chunk_gated_delta_rule = mm._orchid_compiled_chunk if enable else mm._orchid_orig_chunk


def bench_impls(model, batcher, batch, amp_dtype, device_type, candidates, steps=3):
    """Time forward+backward for each candidate (experts implementation, or "+gdn_compile"
    for a compiled gated-delta-rule fallback); return the fastest that works."""
    results = {}
    for impl in candidates:
        try:
            if impl.endswith("+gdn_compile"):
                set_impl(model, impl.split("+")[0], None)
                compile_gdn(True)
            else:
                compile_gdn(False)
                set_impl(model, impl, None)
            tc = time.time()
            for i in range(steps + 1):
                if i == 1:
                    if device_type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.time()
                loss, aux = lm_loss(model, batcher(batch), True, amp_dtype, device_type)
                (loss + 0.001 * aux).backward()
            if device_type == "cuda":
                torch.cuda.synchronize()
            results[impl] = (time.time() - t0) / steps
            print(f"  {impl}: {results[impl] * 1000:.0f} ms/step "
                  f"({batch * batcher.seq / results[impl] / 1e3:.0f}k tok/s; first step incl. "
                  f"warm-up/compile {t0 - tc:.1f}s)", flush=True)
        except Exception as e:  # an implementation the installed transformers/torch lacks
            print(f"  {impl}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        model.zero_grad(set_to_none=True)
        if device_type == "cuda":
            torch.cuda.empty_cache()
    if not results:
        raise RuntimeError("no experts implementation works")
    return min(results, key=results.get), {k: round(v * 1000, 1) for k, v in results.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "training" / "data"))
    ap.add_argument("--out", default=str(REPO / "training" / "out" / "run"))
    ap.add_argument("--preset", default="full", choices=sorted(PRESETS))
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=192, help="sequences per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150, help="warm-up steps")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-batch", type=int, default=64)
    ap.add_argument("--experts-impl", default="auto",
                    help="auto (benchmark), eager, batched_mm, grouped_mm")
    ap.add_argument("--attn-impl", default="sdpa")
    ap.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    ap.add_argument("--try-compile", action="store_true",
                    help="also benchmark a torch.compile'd gated-delta-rule fallback, keep it if faster")
    ap.add_argument("--total-minutes", type=float, default=0.0,
                    help="cap on the whole run (start-up + benchmark + training + eval + save)")
    ap.add_argument("--reserve", type=float, default=45.0, help="seconds kept for eval and save")
    ap.add_argument("--amp", default="auto", choices=["auto", "bf16", "none"],
                    help="autocast dtype (auto: bf16 on CUDA, none on CPU)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="held-out loss every N steps (a multiple of --log-every; 0: only at the end)")
    ap.add_argument("--eval-tokens", type=int, default=0, help="cap on tokens per periodic eval (0: all)")
    ap.add_argument("--keep-best", action="store_true",
                    help="save the weights with the lowest periodic held-out loss, not the last ones")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    t_start = time.time()

    from transformers import Qwen3_5MoeForCausalLM, GenerationConfig
    import transformers
    from tokenizers import Tokenizer

    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))
    dt = device.type
    amp_dtype = torch.bfloat16 if (args.amp == "bf16" or (args.amp == "auto" and dt == "cuda")) else None
    torch.manual_seed(args.seed)
    if dt == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    data = Path(args.data)
    tok_dir = data / "tokenizer"
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")

    meta_tr = json.loads((data / "tokens" / "train.json").read_text())
    meta_ev = json.loads((data / "tokens" / "eval.json").read_text())
    train = torch.from_numpy(load_stream(data / "tokens" / "train.u16.xz")).to(device)
    evals = torch.from_numpy(load_stream(data / "tokens" / "eval.u16.xz")).to(device)
    print(f"data: train {len(train):,} tokens, eval {len(evals):,} tokens "
          f"(loaded in {time.time() - t_start:.1f}s)", flush=True)

    config = make_config(args.preset, vocab, eot)
    model = Qwen3_5MoeForCausalLM(config).to(device)
    set_impl(model, None, args.attn_impl)
    pc = count_params(model)
    bad = check_dims(model)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if dt == "cuda" else ""), flush=True)
    print("params: " + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in pc.items()), flush=True)
    if bad:
        print("WARNING: input dims not a multiple of 64:", bad, flush=True)

    batcher = Batcher(train, meta_tr["spans"], SOURCE_WEIGHTS, args.seq, device, args.seed)
    print("mix:", batcher.mix(), flush=True)

    # optimizer: no weight decay on norms, biases, A_log, dt_bias, embeddings
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed_tokens" not in n and "conv1d" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=(dt == "cuda"))

    bench = {}
    impl = args.experts_impl
    if impl == "auto":
        # batched_mm gathers one weight matrix per (token, expert) pair: far too much memory here
        cands = ["grouped_bf16", "grouped_mm", "eager"]
        if args.try_compile:
            cands.append("best+gdn_compile")
        first = [c for c in cands if not c.startswith("best")]
        impl, bench = bench_impls(model, batcher, args.batch, amp_dtype, dt, first,
                                  steps=3 if dt == "cuda" else 1)
        if args.try_compile:
            try:
                best2, b2 = bench_impls(model, batcher, args.batch, amp_dtype, dt, [impl + "+gdn_compile"],
                                        steps=3 if dt == "cuda" else 1)
                bench.update(b2)
                if b2[best2] < bench[impl]:
                    impl = best2
            except RuntimeError as e:
                print(f"  gdn compile not used: {e}", flush=True)
    if impl.endswith("+gdn_compile"):
        set_impl(model, impl.split("+")[0], None)
        compile_gdn(True)
    else:
        compile_gdn(False)
        set_impl(model, impl, None)
    print(f"experts implementation: {impl}, attn_implementation: {model.config._attn_implementation}",
          flush=True)
    fwd_model = torch.compile(model) if args.compile else model

    budget = args.minutes * 60.0
    if args.total_minutes:
        # fit the whole run (start-up and benchmark already spent, eval + save reserve) in the limit
        budget = min(budget, args.total_minutes * 60.0 - (time.time() - t_start) - args.reserve)
        print(f"training budget: {budget:.0f}s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_f = open(out / "train_log.csv", "w", newline="")
    log = csv.writer(log_f)
    log.writerow(["step", "tokens", "elapsed_s", "lr", "loss", "aux_loss", "tok_per_s", "heldout_loss"])
    gdn_compiled = impl.endswith("+gdn_compile")
    best = {"loss": float("inf"), "step": 0, "state": None}
    eval_log = []

    def periodic_eval():
        compile_gdn(False)                 # eval shapes differ from training: run it uncompiled
        ev = evaluate(model, evals, meta_ev["spans"], args.seq, args.eval_batch, amp_dtype, dt,
                      max_tokens=args.eval_tokens or None)
        compile_gdn(gdn_compiled)
        eval_log.append({"step": step, "tokens": tokens, "heldout_loss": ev["_all"]})
        if args.keep_best and ev["_all"] < best["loss"]:
            best.update(loss=ev["_all"], step=step,
                        state={k: v.detach().clone() for k, v in model.state_dict().items()})
        return ev["_all"]

    step, tokens = 0, 0
    acc_loss = torch.zeros((), device=device)
    acc_aux = torch.zeros((), device=device)
    acc_n = 0
    if dt == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    t_last, tok_last = t0, 0
    rows = []
    model.train()
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        progress = min(1.0, elapsed / budget)
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batcher(args.batch)
        loss, aux = lm_loss(fwd_model, x, True, amp_dtype, dt)
        total = loss + config.router_aux_loss_coef * aux
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.shape[0] * args.seq
        acc_loss += loss.detach()
        acc_aux += aux.detach()
        acc_n += 1
        if step % args.log_every == 0 or step == 1:
            l, a = (acc_loss / acc_n).item(), (acc_aux / acc_n).item()
            now = time.time()
            tps = (tokens - tok_last) / max(1e-9, now - t_last)
            hl = ""
            if args.eval_every and step % args.eval_every == 0:
                te = time.time()
                hl = round(periodic_eval(), 4)
                t0 += time.time() - te           # evaluation time does not count as training time
                now = time.time()
            row = [step, tokens, round(now - t0, 1), f"{lr:.3e}", round(l, 4), round(a, 4), round(tps), hl]
            log.writerow(row)
            log_f.flush()
            rows.append(row)
            print(f"step {step:5d}  tok {tokens / 1e6:7.1f}M  t {now - t0:6.1f}s  lr {lr:.2e}  "
                  f"loss {l:.4f}  aux {a:.3f}  {tps / 1e3:.0f}k tok/s"
                  + (f"  held-out {hl:.4f}" if hl != "" else ""), flush=True)
            acc_loss.zero_()
            acc_aux.zero_()
            acc_n = 0
            t_last, tok_last = now, tokens
    if dt == "cuda":
        torch.cuda.synchronize()
    train_time = time.time() - t0
    print(f"trained {step} steps, {tokens:,} tokens in {train_time:.1f}s "
          f"({tokens / max(train_time, 1e-9) / 1e3:.0f}k tok/s)", flush=True)

    # final train loss estimate on fresh batches; held-out loss on the eval split
    # (uncompiled: other batch shapes would only trigger recompiles)
    t_ev = time.time()
    compile_gdn(False)
    final_step = step
    if args.keep_best and best["state"] is not None:
        cur = periodic_eval()
        if best["step"] != step and best["loss"] < cur:
            print(f"keeping the best held-out checkpoint: step {best['step']} ({best['loss']:.4f} < {cur:.4f})",
                  flush=True)
            model.load_state_dict(best["state"])
            step = best["step"]
        compile_gdn(False)
    model.eval()
    with torch.no_grad():
        tl = []
        for _ in range(4 if dt == "cuda" else 1):
            l, _ = lm_loss(model, batcher(args.eval_batch), False, amp_dtype, dt)
            tl.append(l.item())
    final_train = float(np.mean(tl))
    ev = evaluate(model, evals, meta_ev["spans"], args.seq, args.eval_batch, amp_dtype, dt,
                  max_tokens=None if dt == "cuda" else 20000)
    print(f"final train loss {final_train:.4f}; held-out loss {ev['_all']:.4f} "
          f"(ppl {math.exp(ev['_all']):.2f}) over {ev['_tokens']:,} tokens in {time.time() - t_ev:.1f}s",
          flush=True)
    print("held-out per source:", {k: v for k, v in ev.items() if not k.startswith("_")}, flush=True)

    # save: bf16 safetensors shards + tokenizer + generation config + logs
    # bf16 like the real checkpoint, which also keeps A_log and the GDN gated norm in float32
    keep32 = {n: p.detach().float().clone() for n, p in model.named_parameters()
              if n.endswith("linear_attn.A_log") or n.endswith("linear_attn.norm.weight")}
    model.to(torch.bfloat16)
    for n, p in model.named_parameters():
        if n in keep32:
            p.data = keep32[n]
    model.config.output_router_logits = False
    model.config.use_cache = True
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot,
                                               bos_token_id=None, do_sample=False)
    # save_original_format=False keeps the fused expert tensors (experts.gate_up_proj [E, 2I, H],
    # experts.down_proj [E, H, I]) of the official Qwen3.5 checkpoints instead of per-expert names
    model.save_pretrained(out, safe_serialization=True, max_shard_size="15MB", save_original_format=False)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(tok_dir / f, out / f)
    log_f.close()
    summary = {
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "preset": args.preset,
        "steps": final_step,
        "saved_step": step,
        "heldout_curve": eval_log,
        "tokens_seen": tokens,
        "train_seconds": round(train_time, 1),
        "tokens_per_second": round(tokens / max(train_time, 1e-9)),
        "total_seconds": round(time.time() - t_start, 1),
        "final_train_loss": round(final_train, 4),
        "heldout_loss": ev["_all"],
        "heldout_ppl": round(math.exp(ev["_all"]), 3),
        "heldout_loss_per_source": {k: v for k, v in ev.items() if not k.startswith("_")},
        "heldout_tokens": ev["_tokens"],
        "params": pc,
        "experts_implementation": impl,
        "experts_benchmark_ms_per_step": bench,
        "attn_implementation": model.config._attn_implementation,
        "compile": args.compile,
        "hyper": {"seq": args.seq, "batch": args.batch, "lr": args.lr, "min_lr_frac": args.min_lr_frac,
                  "warmup": args.warmup, "wd": args.wd, "betas": [0.9, 0.95], "clip": 1.0,
                  "amp": str(amp_dtype), "seed": args.seed},
        "source_weights": SOURCE_WEIGHTS,
        "mix": batcher.mix(),
        "train_tokens_unique": int(len(train)),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "device": torch.cuda.get_device_name() if dt == "cuda" else "cpu",
        "config": model.config.to_dict(),
        "log": rows,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    files = sorted(os.listdir(out))
    print("saved:", ", ".join(f"{f} ({(out / f).stat().st_size / 1e6:.1f} MB)" for f in files), flush=True)


if __name__ == "__main__":
    main()
