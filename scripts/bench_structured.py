#!/usr/bin/env python3
"""Per-token cost of constrained decoding in `orchid serve`: the same greedy chat requests
free, with a JSON schema (`response_format`), and as a forced tool call, one at a time.

    scripts/bench_structured.py                      # the bundled model (8k vocabulary)
    scripts/bench_structured.py --synth              # a random tiny-test checkpoint with the
                                                     # Qwen3.5 tokenizer (248k vocabulary)
    scripts/bench_structured.py --model DIR [--device cuda]
    scripts/bench_structured.py --url http://127.0.0.1:8000

For each mode: decode ms/token (first streamed token -> last, over the tokens in between,
median over the requests) and the difference to the free requests. The constrained modes
generate different text, so only per-token times are compared. Thinking off; greedy.
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
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days", "unit"]}}}]
MODES = {
    "free": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
    "tool_required": {"tools": TOOLS, "tool_choice": "required"},
}


def start_server(args) -> tuple[subprocess.Popen, str]:
    binary = Path(os.environ.get("ORCHID_BIN", REPO / "target" / "release" / "orchid"))
    model = args.model or REPO / "models" / "orchid-tiny"
    if args.synth:
        model = Path(tempfile.mkdtemp(prefix="orchid-bench-")) / "tiny-test"
        subprocess.run([str(binary), "synth", "--preset", "tiny-test", "--format", "hf", "--out", str(model),
                        "--tokenizer-dir", str(REPO / "assets" / "qwen3.5")], check=True, capture_output=True)
    log = open(Path(tempfile.gettempdir()) / f"orchid-bench-structured-{os.getpid()}.log", "w")
    cmd = [str(binary), "serve", "--model", str(model), "--port", "0", "--max-context", "4096"]
    if args.device:
        cmd += ["--device", args.device]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, ORCHID_LOG="warn,orchid_server=info"))
    deadline = time.time() + 600
    while True:
        m = re.search(r"listening on (http://[0-9.]+:\d+)", Path(log.name).read_text(errors="replace"))
        if m:
            url = m.group(1)
            break
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"server did not start; log: {log.name}")
        time.sleep(0.1)
    while True:
        if get(url, "/health")[0] == 200:
            return proc, url
        time.sleep(0.2)


def get(url: str, path: str):
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read()


def one(url: str, body: dict) -> tuple[int, float]:
    """(completion tokens, seconds from the first streamed token to the last)."""
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    first = last = None
    tokens = 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ev = json.loads(line[5:])
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if ev.get("choices"):
            now = time.perf_counter()
            first = first or now
            last = now
    return tokens, (last - first) if first else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--synth", action="store_true")
    ap.add_argument("--device")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        prompts = ["Describe a person.", "Who lives in Paris?", "Tell me about a friend.", "Write a profile.",
                   "What is the weather like?", "Name someone famous."]
        # Warm-up: the first constrained request builds the token trie.
        for mode in MODES.values():
            one(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "stream": True,
                      "chat_template_kwargs": {"enable_thinking": False}, **mode})
        results = {}
        for name, mode in MODES.items():
            per_tok, total = [], 0
            for i in range(args.requests):
                body = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": args.max_tokens,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                        "chat_template_kwargs": {"enable_thinking": False}, **mode}
                n, secs = one(url, body)
                total += n
                if n > 2:
                    per_tok.append(secs / (n - 1) * 1e3)
            results[name] = (statistics.median(per_tok), total)
        base = results["free"][0]
        print(f"machine: {platform.machine()} {os.cpu_count()} cpus; {args.requests} requests/mode, max_tokens {args.max_tokens}")
        for name, (ms, total) in results.items():
            print(f"{name:14s} {ms:7.3f} ms/token  ({total} tokens)  {ms - base:+7.3f} ms/token vs free")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
