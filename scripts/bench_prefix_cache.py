#!/usr/bin/env python3
"""Prefix-cache benchmark against `orchid serve` (Python standard library only).

Starts the server twice on MODEL (--prefix-cache on, then off), sends token-id prompts to
/v1/completions and times each request that asks for one token (= prefill + the first token):

  conversation  the next turn of a long conversation: a CONV-token prompt, then the same prompt
                with a 100-token message appended (the second request is the one timed)
  shared        16 requests sharing a PREFIX-token prefix, each with its own 200-token suffix, one
                after the other: request 1 vs requests 2-16
  session       a 20-turn chat session: turn k's prompt is turn k-1's prompt + the 200-token answer
                the server generated for it + a 300-token user message; the sum of the 20 prefill
                times (each timed as a one-token request before the answer is generated)

Prints one JSON object (per mode: the timings; and the ratios the cache gives).

  scripts/bench_prefix_cache.py --orchid target/release/orchid --model DIR [--device cuda]
"""
import argparse
import json
import random
import subprocess
import sys
import time
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t, out


def wait_ready(base, proc, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def first_token(base, ids):
    """Seconds for a one-token completion of `ids`, and its cached-token count."""
    dt, out = post(base + "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
    return dt, out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def scenarios(base, args, rng):
    def toks(n):
        return [rng.randrange(1000, args.vocab) for _ in range(n)]

    res = {}
    # Warm-up (kernel compilation, graph capture) on an unrelated prompt.
    first_token(base, toks(600))
    conv = toks(args.conv)
    t0, _ = first_token(base, conv)
    t1, c1 = first_token(base, conv + toks(100))
    res["conversation"] = {"first_turn_s": round(t0, 4), "next_turn_s": round(t1, 4), "next_turn_cached": c1, "prompt": args.conv + 100}
    prefix = toks(args.prefix)
    times, cached = [], []
    for _ in range(16):
        t, c = first_token(base, prefix + toks(200))
        times.append(round(t, 4))
        cached.append(c)
    res["shared"] = {"times_s": times, "cached": cached, "first_s": times[0], "rest_max_s": max(times[1:]), "rest_mean_s": round(sum(times[1:]) / 15, 4)}
    prompt, total, per, cached = toks(300), 0.0, [], []
    for k in range(20):
        t, c = first_token(base, prompt)
        total += t
        per.append(round(t, 4))
        cached.append(c)
        # The answer the server gives (200 tokens, greedy), then the next user message.
        _, out = post(base + "/v1/completions", {"prompt": prompt, "max_tokens": 200, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True})
        prompt = prompt + out["choices"][0]["token_ids"] + toks(300)
    res["session"] = {"total_prefill_s": round(total, 4), "per_turn_s": per, "cached": cached, "last_prompt": len(prompt)}
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        res["metrics"] = [line for line in r.read().decode().splitlines() if line.startswith("orchid_prefix_cache")]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--orchid", default="target/release/orchid")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--conv", type=int, default=32000)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=150000)
    ap.add_argument("--modes", default="on,off")
    ap.add_argument("--extra", default="", help="more serve flags, space-separated")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    out = {}
    for mode in args.modes.split(","):
        cmd = [args.orchid, "serve", "--model", args.model, "--device", args.device, "--port", str(args.port),
               "--max-context", str(max(args.conv + 400, 16384)), "--prefix-cache", mode] + args.extra.split()
        log = open(f"/tmp/bench-prefix-cache-{mode}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(base, proc)
            out[mode] = scenarios(base, args, random.Random(7))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(json.dumps({mode: out[mode]}), file=sys.stderr, flush=True)
    if "on" in out and "off" in out:
        on, off = out["on"], out["off"]
        out["summary"] = {
            "next_turn_ttft_ms": {"on": round(on["conversation"]["next_turn_s"] * 1e3, 1), "off": round(off["conversation"]["next_turn_s"] * 1e3, 1)},
            "shared_rest_over_first": round(on["shared"]["rest_max_s"] / on["shared"]["first_s"], 4),
            "session_prefill_saved": round(1 - on["session"]["total_prefill_s"] / off["session"]["total_prefill_s"], 4),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
