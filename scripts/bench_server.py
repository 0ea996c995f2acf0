#!/usr/bin/env python3
"""Serving benchmark for `orchid serve`: time to first token and tokens/s under 1, 4 and 16
concurrent streaming clients (plain HTTP + SSE, greedy decoding).

    # against a running server
    scripts/bench_server.py --url http://127.0.0.1:8000
    # start one (default: a random `orchid synth --preset tiny-test` checkpoint)
    scripts/bench_server.py [--model DIR] [--device cpu|cuda] [--concurrency 1,4,16]

Each client sends `--requests-per-client` chat requests one after another (thinking off, a
distinct prompt of about `--prompt-tokens` tokens, up to `--max-tokens` generated; the counts
reported are the real ones from `usage`). Reported per concurrency level: TTFT p50/p90 (request
sent -> first streamed token, as the client sees it), decode tokens/s per request (after the
first token), aggregate generated tokens/s over the wall time, and the server's inter-token
latency (mean of its /metrics histogram over the run).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    binary = Path(os.environ.get("ORCHID_BIN", REPO / "target" / "release" / "orchid"))
    model = args.model
    if model is None:
        model = Path(tempfile.mkdtemp(prefix="orchid-bench-")) / "tiny-test"
        assets = next(p for p in (REPO / "shared", REPO.parent / "shared") if p.is_dir()) / "assets" / "qwen3.5"
        subprocess.run([str(binary), "synth", "--preset", args.preset, "--format", "hf", "--out", str(model),
                        "--tokenizer-dir", str(assets)], check=True, capture_output=True)
    log = open(Path(tempfile.gettempdir()) / f"orchid-bench-{os.getpid()}.log", "w")
    cmd = [str(binary), "serve", "--model", str(model), "--port", "0", "--max-seqs", str(max(args.concurrency)),
           "--max-context", str(args.prompt_tokens + args.max_tokens + 64)]
    if args.device:
        cmd += ["--device", args.device]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, ORCHID_LOG="info"))
    deadline = time.time() + 600
    while True:
        text = Path(log.name).read_text(errors="replace")
        m = re.search(r"listening on (http://[0-9.]+:\d+)", text)
        if m:
            url = m.group(1)
            break
        if proc.poll() is not None or time.time() > deadline:
            sys.exit(f"server did not start:\n{text}")
        time.sleep(0.1)
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except Exception:  # noqa: BLE001 - 503 while loading
            pass
        if proc.poll() is not None or time.time() > deadline:
            sys.exit(f"server never became ready:\n{Path(log.name).read_text(errors='replace')}")
        time.sleep(0.2)
    ready = [line for line in Path(log.name).read_text(errors="replace").splitlines() if "ready:" in line]
    print(re.sub(r"\x1b\[[0-9;]*m", "", ready[-1]) if ready else "", file=sys.stderr)
    return proc, url


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request over plain HTTP (no client library needed on the GPU box)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                       "chat_template_kwargs": {"enable_thinking": False}})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=3600)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first, usage, buf = None, None, b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                continue
            c = json.loads(data)
            if "error" in c:
                raise RuntimeError(c["error"])
            if c.get("usage"):
                usage = c["usage"]
            d = c["choices"][0]["delta"] if c["choices"] else {}
            if first is None and (d.get("content") or d.get("reasoning_content")):
                first = time.perf_counter()
    conn.close()
    t1 = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    first = first or t1
    return {"ttft": first - t0, "total": t1 - t0, "tokens": n, "decode_tps": (n - 1) / (t1 - first) if n > 1 and t1 > first else 0.0}


def run_level(url: str, model: str, concurrency: int, args) -> dict:
    before = metrics(url)
    results: list[dict] = []
    lock = threading.Lock()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jumping frogs".split()

    def worker(w: int):
        for r in range(args.requests_per_client):
            # Distinct prompts (no caching effects), about --prompt-tokens tokens each.
            prompt = f"[{w}.{r}] " + " ".join(words[(w + r + i) % len(words)] for i in range(args.prompt_tokens - 8))
            res = one_request(url, model, prompt, args.max_tokens)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = metrics(url)
    ttfts = sorted(r["ttft"] for r in results)
    d = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "generated_tokens": sum(r["tokens"] for r in results),
        "wall_s": wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "decode_tok_s_per_request": statistics.mean(r["decode_tps"] for r in results),
        "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
        "server_ttft_mean_s": d("orchid_time_to_first_token_seconds_sum") / max(1, d("orchid_time_to_first_token_seconds_count")),
        "server_itl_mean_s": d("orchid_inter_token_latency_seconds_sum") / max(1, d("orchid_inter_token_latency_seconds_count")),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--model", type=Path, help="checkpoint for the started server (default: a synth preset)")
    ap.add_argument("--preset", default="tiny-test", help="synth preset when no --model (default tiny-test)")
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        one_request(url, model, "warm up", 4)
        rows = [run_level(url, model, c, args) for c in args.concurrency]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"model": model, "commit": commit, "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client}
    if args.json:
        print(json.dumps({"meta": meta, "results": rows}, indent=2))
        return
    print(f"model {model}, commit {commit}, {meta['machine']}, prompt ~{args.prompt_tokens} tok, {args.max_tokens} generated, "
          f"{args.requests_per_client} req/client")
    print(f"{'clients':>7} {'reqs':>5} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s/req':>10} {'agg tok/s':>10} {'srv ITL':>9}")
    for r in rows:
        print(f"{r['concurrency']:>7} {r['requests']:>5} {r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p90_s'] * 1e3:>7.0f}ms "
              f"{r['decode_tok_s_per_request']:>10.1f} {r['aggregate_tok_s']:>10.1f} {r['server_itl_mean_s'] * 1e3:>7.1f}ms")


if __name__ == "__main__":
    main()
