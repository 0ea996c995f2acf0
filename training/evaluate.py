#!/usr/bin/env python3
"""Check a trained orchid-tiny HF checkpoint on the CPU with transformers.

1. loads it with Qwen3_5MoeForCausalLM.from_pretrained (bf16 weights, f32 compute),
2. greedy-generates for plain prompts and for chat prompts rendered with the
   checkpoint's chat_template.jinja (enable_thinking=False),
3. computes held-out perplexity on tests/data/heldout.txt in chunks of --seq tokens
   (each chunk scored independently, no context carried over) and writes
   MODEL/heldout_ppl.json (and MODEL/samples.json with the generations).

Usage: python training/evaluate.py training/out/hf [--seq 512]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent

PLAIN = ["Once upon a time", "The President said that", "Call me Ishmael.",
         "The ocean is", "In 1860, the United States"]
CHAT = ["What does the word 'ocean' mean?", "Tell me a short story about a dog.",
        "Use the word \"happy\" in a sentence.", "What does the word \"river\" mean?"]


def render(messages, template: str) -> str:
    import jinja2
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)

    def raise_exception(msg):
        raise ValueError(msg)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            enable_thinking=False, tools=None)


def words_ok(text: str, words: set) -> float:
    ws = re.findall(r"[A-Za-z]+", text)
    if not ws:
        return 0.0
    return sum(1 for w in ws if w.lower() in words) / len(ws)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=80)
    ap.add_argument("--heldout", default=str(REPO / "tests" / "data" / "heldout.txt"))
    args = ap.parse_args()
    from transformers import Qwen3_5MoeForCausalLM
    from tokenizers import Tokenizer

    d = Path(args.model)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    template = (d / "chat_template.jinja").read_text()
    gen = json.loads((d / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    words = set((REPO / "tests" / "data" / "words.txt").read_text().split())

    # held-out perplexity
    text = Path(args.heldout).read_text(encoding="utf-8")
    ids = tok.encode(text, add_special_tokens=False).ids
    t0 = time.time()
    nll, n = 0.0, 0
    with torch.no_grad():
        chunks = [ids[i:i + args.seq] for i in range(0, len(ids), args.seq)]
        chunks = [c for c in chunks if len(c) > 1]
        for i in range(0, len(chunks), 8):
            batch = chunks[i:i + 8]
            L = max(len(c) for c in batch)
            x = torch.full((len(batch), L), eos[-1], dtype=torch.long)
            mask = torch.zeros((len(batch), L), dtype=torch.bool)
            for j, c in enumerate(batch):
                x[j, :len(c)] = torch.tensor(c)
                mask[j, :len(c)] = True
            logits = model(input_ids=x, use_cache=False).logits.float()
            lp = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                 reduction="none").view(len(batch), L - 1)
            m = mask[:, 1:]
            nll += lp[m].sum().item()
            n += int(m.sum())
    res = {"file": str(Path(args.heldout).relative_to(REPO)) if args.heldout.startswith(str(REPO)) else args.heldout,
           "bytes": len(text.encode()), "tokens": len(ids), "scored_tokens": n, "chunk": args.seq,
           "nll_per_token": round(nll / n, 4), "ppl": round(math.exp(nll / n), 3),
           "bits_per_byte": round(nll / math.log(2) / len(text.encode()), 4),
           "dtype": "bf16 weights, f32 compute (transformers, CPU)", "seconds": round(time.time() - t0, 1)}
    print(json.dumps(res, indent=1))
    (d / "heldout_ppl.json").write_text(json.dumps(res, indent=1) + "\n")

    # greedy generations
    samples = []
    prompts = [("plain", p, p) for p in PLAIN] + \
              [("chat", q, render([{"role": "user", "content": q}], template)) for q in CHAT]
    for kind, p, rendered in prompts:
        x = torch.tensor([tok.encode(rendered, add_special_tokens=False).ids])
        with torch.no_grad():
            y = model.generate(x, max_new_tokens=args.max_new, do_sample=False, eos_token_id=eos,
                               pad_token_id=eos[-1])
        out = tok.decode(y[0, x.shape[1]:].tolist(), skip_special_tokens=True)
        samples.append({"kind": kind, "prompt": p, "output": out,
                        "real_word_fraction": round(words_ok(out, words), 3)})
        print(f"--- [{kind}] {p!r}\n{out}\n(real words: {samples[-1]['real_word_fraction']:.0%})", flush=True)
    (d / "samples.json").write_text(json.dumps(samples, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
