#!/usr/bin/env python3
"""Serving benchmark for `orchid serve`: N concurrent streaming clients per level, against the
byte floor of one decode step (Python standard library only).

    # on the GPU machine: synthesizes the 35B (MLX 4-bit, /dev/shm/q36) if needed, starts a server
    ORCHID_BIN=dist/orchid python3 scripts/bench_serve.py --device cuda
    # the same plus a 32K-token prompt arriving while 16 streams decode
    ORCHID_BIN=dist/orchid python3 scripts/bench_serve.py --device cuda --long-prompt 32768
    # against a running server (--model DIR: its checkpoint, for the byte floor)
    scripts/bench_serve.py --url http://127.0.0.1:8000 --model /dev/shm/q36
    # CPU smoke run
    scripts/bench_serve.py --preset tiny-test --device cpu --concurrency 1,2 --prompt-tokens 16 --output-tokens 4

The server: `orchid serve` ($ORCHID_BIN, default target/release/orchid) on a free port, with
--max-seqs = the largest level (+1 with --long-prompt) and --max-context = what the requests
need. Without --model it runs `orchid synth --preset PRESET --format mlx4` into --synth-out
(default /dev/shm/q36 for qwen3.6-35b-a3b) unless that folder already holds a checkpoint.

Each level of --concurrency starts N streams together (a barrier): each sends one
/v1/completions request whose prompt is --prompt-tokens random token ids in [1000, 100000)
(distinct per stream and level, from --seed; no special tokens, no prefix-cache hits), with
max_tokens --output-tokens, temperature 0, ignore_eos, stream with usage. Reported per level:

  agg tok/s       all generated tokens / wall time (barrier -> the last stream's end; includes
                  the prefills)
  tok/s/stream    p50 over streams of (tokens - 1) / (last token - first token)
  TTFT            request sent -> first streamed text, p50 / p99 / max over streams
  ITL             gaps between a stream's consecutive text chunks, pooled over streams, p50/p99.
                  orchid sends one chunk per token, except that a token whose text is empty
                  (an incomplete UTF-8 sequence, a skipped special token) is sent with the next
                  one: `tokens_per_chunk` says how often that happened (1.0 = never)
  floor GB        the bytes one decode step of N sequences must move at least (below)
  floor tok/s     N / (floor bytes / --hbm-tbps), the rate memory bandwidth allows
  srv ITL         the server's mean inter-token latency over the level (/metrics)

and, from the server's step counters (/metrics), where the engine's time went: the steps that
ran prompt tokens (with any decoding beside them; their count and seconds in all), the steps
that only decoded (count, mean time), and the share of the wall time the two fill.

The byte floor of one decode step of B sequences at context L (L = prompt + output/2, the
average over the run), from the checkpoint's config.json (both the Qwen3.5/3.6 `text_config`
nesting and flat Qwen3-Next; field names and defaults as crates/orchid-model/src/config.rs):

  dense weights, read once per step: attention q/k/v/o, GDN in_proj_qkv/z/b/a and out_proj,
      conv taps, routers and shared-expert gates, shared experts, Qwen3-Next dense MLPs, the
      lm_head, norms, B embedding rows
  + routed experts: per MoE layer the expected number of distinct experts B tokens touch under
      uniform routing, E * (1 - (1 - k/E)^B), times the bytes of one expert (3 * I * H weights)
  + B * GDN state, read and written: per GDN layer the f32 recurrent state
      (num_v_heads * k_head_dim * v_head_dim * 4 B) and the f32 conv state
      ((conv_kernel - 1) * conv_dim * 4 B), times 2
  + B * KV read: attention layers * 2 * kv_heads * head_dim * L * 2 B (bf16)

Weights cost bits/8 + 4/group bytes each when the config has an MLX `quantization` block (a
bf16 scale and bias per group: 0.5625 B at 4-bit g64; routers at their 8-bit override), else 2
(bf16). For Qwen3.6-35B-A3B in MLX 4-bit at 512 + 128 tokens (L = 576): 1.8 GB at 1 stream (the
1.67 GB of weights of docs/model.md §10 plus the state), 3.8 at 4, 10.6 at 16, 17.3 at 32, 26.0
at 64 (2,370 / 4,480 / 6,480 / 7,970 / 10,570 tok/s at 4.3 TB/s).

--long-prompt N adds an interference run after the levels: --long-level streams decode
(--long-stream-tokens each); once every one has streamed a token, one more request with an
N-token prompt and max_tokens 1 arrives. Reported: its time to first token (and that of the same
length sent alone just before, which also warms the long prefill up), and the running streams'
ITL p50/p99/max over the gaps that overlap its prefill (sent -> answered), next to the same
figures outside it.

Output: a table on stdout; --json FILE writes the figures as JSON (--json alone: JSON on stdout,
the table on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PRESET = "qwen3.6-35b-a3b"
TOKEN_IDS = (1000, 100_000)  # ordinary tokens in both the Qwen3.5 and the Qwen3 vocabularies


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------
# The byte floor of one decode step
# --------------------------------------------------------------------------------------


def _text_config(cfg: dict) -> tuple[dict, bool]:
    """The language model's fields and whether it is Qwen3-Next (flat) rather than Qwen3.5/3.6."""
    next_family = cfg.get("model_type") == "qwen3_next"
    return cfg.get("text_config", cfg), next_family


def _weight_bytes(cfg: dict, t: dict) -> tuple[float, float]:
    """Bytes per weight of the quantized linear layers and of the 8-bit routers."""
    float_bytes = 4 if (t.get("dtype") or t.get("torch_dtype") or cfg.get("torch_dtype")) == "float32" else 2
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if not q or "bits" not in q:
        return float_bytes, float_bytes
    group = q.get("group_size", 64)

    def per_weight(bits: int, g: int) -> float:
        return bits / 8 + 2 * 2 / g  # a bf16 scale and a bf16 bias per group

    router = next((v for k, v in q.items() if isinstance(v, dict) and k.endswith("mlp.gate")), None)
    main = per_weight(q["bits"], group)
    return main, per_weight(router["bits"], router.get("group_size", group)) if router else main


def byte_floor(cfg: dict, batch: int, context: int) -> dict:
    """The bytes one decode step of `batch` sequences at `context` tokens must read and write,
    from a config.json dict (see the module docstring). Returns the parts and the total."""
    t, next_family = _text_config(cfg)
    h, n_layers, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    heads, kv_heads, head_dim = t.get("num_attention_heads", 16), t.get("num_key_value_heads", 2), t.get("head_dim", 256)
    gate = t.get("attn_output_gate", True)
    hk, hv = t.get("linear_num_key_heads", 16), t.get("linear_num_value_heads", 32)
    dk, dv, kernel = t.get("linear_key_head_dim", 128), t.get("linear_value_head_dim", 128), t.get("linear_conv_kernel_dim", 4)
    experts = t.get("num_experts", 512 if next_family else 256)
    top_k = t.get("num_experts_per_tok", 10 if next_family else 8)
    inter, shared = t.get("moe_intermediate_size", 512), t.get("shared_expert_intermediate_size", 512)

    if t.get("layer_types"):
        attention = [k == "full_attention" for k in t["layer_types"]]
    else:
        interval = t.get("full_attention_interval", 4)
        attention = [(i + 1) % interval == 0 for i in range(n_layers)]
    dense_mlp = [False] * n_layers
    if next_family:
        step = max(1, t.get("decoder_sparse_step", 1))
        only = set(t.get("mlp_only_layers") or [])
        dense_mlp = [i in only or (i + 1) % step != 0 for i in range(n_layers)]
    n_attn = sum(attention)
    n_gdn = n_layers - n_attn
    n_moe = n_layers - sum(dense_mlp)

    wb, router_wb = _weight_bytes(cfg, t)
    conv_dim = 2 * hk * dk + hv * dv
    attn_params = h * heads * head_dim * (2 if gate else 1) + 2 * h * kv_heads * head_dim + heads * head_dim * h
    gdn_params = h * (conv_dim + hv * dv + 2 * hv) + hv * dv * h
    dense = (
        n_attn * attn_params * wb
        + n_gdn * gdn_params * wb
        + n_gdn * (conv_dim * kernel * 2 + hv * 4 + hv * 2 + dv * 4)  # conv taps, A_log, dt_bias, gated norm
        + n_moe * (experts * h + h) * router_wb  # router and shared-expert gate
        + n_moe * 3 * shared * h * wb
        + sum(dense_mlp) * 3 * t.get("intermediate_size", 0) * h * wb
        + vocab * h * wb  # lm_head (the embedding table when tied)
        + batch * h * wb  # the embedding rows
        + (2 * n_layers + 1) * h * 2 + n_attn * 2 * head_dim * 2  # RMSNorm weights
    )
    distinct = experts * (1 - (1 - top_k / experts) ** batch)
    routed = n_moe * distinct * 3 * inter * h * wb
    gdn_state = batch * n_gdn * (hv * dk * dv + (kernel - 1) * conv_dim) * 4 * 2
    kv = batch * n_attn * 2 * kv_heads * head_dim * context * 2
    total = dense + routed + gdn_state + kv
    return {"batch": batch, "context": context, "dense_bytes": dense, "routed_expert_bytes": routed,
            "experts_per_layer": distinct, "gdn_state_bytes": gdn_state, "kv_bytes": kv, "total_bytes": total}


def floor_tok_s(floor: dict, tbps: float) -> float:
    return floor["batch"] / (floor["total_bytes"] / (tbps * 1e12))


# --------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------


class Server:
    """`orchid serve` on a free port, its output in a log file; `stop()` always ends it."""

    def __init__(self, binary: Path, model: Path, args):
        self.log_path = Path(tempfile.gettempdir()) / f"orchid-bench-serve-{os.getpid()}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - the server writes to it until stop()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "serve", "--model", str(model), "--port", str(self.port), "--device", args.device,
               "--max-seqs", str(args.max_seqs), "--max-context", str(args.max_context), *args.serve_arg]
        if not any(a.startswith("--shutdown-timeout") for a in args.serve_arg):
            cmd += ["--shutdown-timeout", "1"]  # streams cut short by Ctrl-C do not hold the exit
        print(f"starting: {' '.join(cmd)}\n  log: {self.log_path}", file=sys.stderr)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=dict(os.environ, ORCHID_LOG=os.environ.get("ORCHID_LOG", "info")),
                                     start_new_session=True)

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines[-n:])

    def check_alive(self):
        if self.proc.poll() is not None:
            raise BenchError(f"the server exited with status {self.proc.returncode}; the last lines of its log "
                             f"({self.log_path}):\n{self.tail()}")

    def wait_ready(self, timeout: float):
        deadline = time.time() + timeout
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.URLError):  # refused while starting, 503 while loading
                pass
            if time.time() > deadline:
                raise BenchError(f"the server was not ready after {timeout:.0f} s; its log:\n{self.tail()}")
            time.sleep(0.25)
        # The log's summary (device, weights, context, sequences) follows /health shortly.
        for _ in range(50):
            ready = [line for line in self.tail(200).splitlines() if "ready:" in line]
            if ready:
                print(ready[-1], file=sys.stderr)
                break
            time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def orchid_binary() -> Path:
    return Path(os.environ.get("ORCHID_BIN", REPO / "target" / "release" / "orchid"))


def prepare_model(binary: Path, args) -> Path:
    """--model, or the synth preset's checkpoint (synthesized when its folder has none)."""
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise BenchError(f"{args.model} holds no config.json")
        return args.model
    out = args.synth_out
    if out is None:
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        out = shm / ("q36" if args.preset == DEFAULT_PRESET else f"orchid-{args.preset}-mlx4")
    if (out / "config.json").is_file():
        return out
    if out.exists() and any(out.iterdir()):
        raise BenchError(f"{out} exists without a config.json; remove it or give --model / --synth-out")
    cmd = [str(binary), "synth", "--preset", args.preset, "--format", "mlx4", "--out", str(out)]
    print(f"synthesizing: {' '.join(cmd)}", file=sys.stderr)
    # The bundled tokenizer is found under $ORCHID_HOME (or next to the binary).
    env = dict(os.environ, ORCHID_HOME=os.environ.get("ORCHID_HOME", str(REPO)))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise BenchError(f"orchid synth failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return out


# --------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------


def get_json(url: str, path: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url + path, timeout=timeout) as r:
        return json.loads(r.read())


def metrics(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (OSError, urllib.error.URLError):
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[k] = float(v)
    return out


class Stream:
    """One streamed /v1/completions request; `run()` fills in the timings (perf_counter)."""

    def __init__(self, url: str, body: dict, timeout: float):
        self.host, port = url.removeprefix("http://").rstrip("/").split(":")
        self.port = int(port)
        self.body = json.dumps(body).encode()
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None
        self.sent = self.end = 0.0
        self.first_event = None  # the first SSE event of any kind
        self.chunks: list[float] = []  # arrival of each chunk carrying text
        self.tokens: int | None = None  # completion_tokens from usage
        self.error: str | None = None
        self.done = False  # saw `data: [DONE]`

    def connect(self):
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        self.conn.connect()

    def run(self):
        try:
            if self.conn is None:
                self.connect()
            self.sent = time.perf_counter()
            self.conn.request("POST", "/v1/completions", body=self.body, headers={"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            if resp.status != 200:
                raise BenchError(f"HTTP {resp.status}: {resp.read()[:500].decode(errors='replace')}")
            buf = b""
            while True:
                data = resp.read1(65536)
                if not data:
                    break
                now = time.perf_counter()
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    self._event(event, now)
            self.end = time.perf_counter()
            if not self.done:
                raise BenchError("the stream ended before `data: [DONE]`")
        except Exception as e:  # noqa: BLE001 - reported per stream
            self.error = f"{type(e).__name__}: {e}"
            self.end = time.perf_counter()
        finally:
            if self.conn is not None:
                self.conn.close()

    def _event(self, event: bytes, now: float):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if self.first_event is None:
                self.first_event = now
            if data == b"[DONE]":
                self.done = True
                continue
            c = json.loads(data)
            if "error" in c:
                raise BenchError(str(c["error"]))
            if c.get("usage"):
                self.tokens = c["usage"].get("completion_tokens")
            if any(ch.get("text") for ch in c.get("choices") or []):
                self.chunks.append(now)

    @property
    def n_tokens(self) -> int:
        return self.tokens if self.tokens is not None else len(self.chunks)


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def run_streams(streams: list[Stream], server: Server | None, timeout: float, during=None) -> float:
    """Runs `streams` together, released by one barrier; `during(streams)` runs alongside on
    the calling thread. Returns the barrier's release time."""
    for s in streams:
        s.connect()
    release = [0.0]
    barrier = threading.Barrier(len(streams), action=lambda: release.__setitem__(0, time.perf_counter()))

    def go(s: Stream):
        barrier.wait()
        s.run()

    threads = [threading.Thread(target=go, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    if during is not None:
        during(streams)
    deadline = time.time() + timeout
    for t in threads:
        while t.is_alive():
            t.join(0.5)
            if server is not None:
                server.check_alive()
            if time.time() > deadline:
                raise BenchError(f"the streams did not finish within {timeout:.0f} s")
    if server is not None:
        server.check_alive()
    errors = [s.error for s in streams if s.error]
    if errors:
        raise BenchError(f"{len(errors)} of {len(streams)} streams failed, e.g. {errors[0]}")
    return release[0]


# --------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float | None:
    """The p-th percentile (nearest rank) of `values`; None when empty."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]


def gaps(s: Stream) -> list[tuple[float, float]]:
    return list(zip(s.chunks, s.chunks[1:]))


def stream_figures(streams: list[Stream], start: float) -> dict:
    ttft = [s.chunks[0] - s.sent for s in streams if s.chunks]
    itl = [b - a for s in streams for a, b in gaps(s)]
    per_stream = [(s.n_tokens - 1) / (s.chunks[-1] - s.chunks[0]) for s in streams
                  if len(s.chunks) > 1 and s.chunks[-1] > s.chunks[0]]
    tokens = sum(s.n_tokens for s in streams)
    chunks = sum(len(s.chunks) for s in streams)
    wall = max(s.end for s in streams) - start
    return {
        "streams": len(streams),
        "generated_tokens": tokens,
        "wall_s": wall,
        "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
        "stream_decode_tok_s_p50": pct(per_stream, 50),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "ttft_max_s": max(ttft) if ttft else None,
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "tokens_per_chunk": tokens / chunks if chunks else None,
    }


def metric_delta(before: dict, after: dict) -> dict:
    def d(k):
        return after.get(k, 0.0) - before.get(k, 0.0)

    n = d("orchid_inter_token_latency_seconds_count")
    out = {"server_itl_mean_s": d("orchid_inter_token_latency_seconds_sum") / n if n else None,
           "server_generated_tokens": d("orchid_generation_tokens_total") or None}
    n = d("orchid_time_to_first_token_seconds_count")
    out["server_ttft_mean_s"] = d("orchid_time_to_first_token_seconds_sum") / n if n else None
    # The engine's steps: those that ran prompt tokens (with any decoding beside them) and those
    # that only decoded, with their wall time.
    for kind in ("prefill", "decode"):
        steps = d(f'orchid_engine_steps_total{{kind="{kind}"}}')
        secs = d(f'orchid_engine_step_seconds_total{{kind="{kind}"}}')
        out[f"{kind}_steps"] = int(steps)
        out[f"{kind}_step_s"] = secs
        out[f"{kind}_step_mean_s"] = secs / steps if steps else None
    # Prompt tokens over the seconds of the steps that ran them (their decode rows included).
    out["prompt_tokens"] = int(d("orchid_prompt_tokens_total"))
    out["prefill_tok_s"] = out["prompt_tokens"] / out["prefill_step_s"] if out["prefill_step_s"] > 0 else None
    return out


# --------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------


class Bench:
    def __init__(self, url: str, model_id: str, args, server: Server | None, config: dict | None):
        self.url, self.model_id, self.args, self.server, self.config = url, model_id, args, server, config

    def prompt(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(*TOKEN_IDS) for _ in range(n)]

    def streams(self, n: int, tag: str, prompt_tokens: int, max_tokens: int) -> list[Stream]:
        rng = random.Random(f"{self.args.seed}/{tag}")
        return [Stream(self.url, completion_body(self.model_id, self.prompt(rng, prompt_tokens), max_tokens), self.args.timeout)
                for _ in range(n)]

    def floor(self, batch: int) -> dict | None:
        if self.config is None:
            return None
        f = byte_floor(self.config, batch, self.args.prompt_tokens + self.args.output_tokens // 2)
        return {"floor_gb": f["total_bytes"] / 1e9, "floor_tok_s": floor_tok_s(f, self.args.hbm_tbps),
                "floor_parts_gb": {k.removesuffix("_bytes"): f[k] / 1e9 for k in
                                   ("dense_bytes", "routed_expert_bytes", "gdn_state_bytes", "kv_bytes")}}

    def warm_up(self):
        n = max(self.args.concurrency)
        run_streams(self.streams(n, "warm-up", self.args.prompt_tokens, 4), self.server, self.args.timeout)

    def level(self, n: int) -> dict:
        streams = self.streams(n, f"level-{n}", self.args.prompt_tokens, self.args.output_tokens)
        before = metrics(self.url)
        start = run_streams(streams, self.server, self.args.timeout)
        row = {"concurrency": n, **stream_figures(streams, start), **metric_delta(before, metrics(self.url))}
        row["engine_busy_fraction"] = (row["prefill_step_s"] + row["decode_step_s"]) / row["wall_s"]
        floor = self.floor(n)
        if floor:
            row.update(floor)
            row["fraction_of_floor"] = row["aggregate_tok_s"] / floor["floor_tok_s"]
        return row

    def interference(self) -> dict:
        a = self.args
        streams = self.streams(a.long_level, "interference", a.prompt_tokens, a.long_stream_tokens)
        long = Stream(self.url, completion_body(self.model_id, self.prompt(random.Random(f"{a.seed}/long"), a.long_prompt), 1), a.timeout)

        # The same length alone first: a warm-up for the long prefill, and the baseline.
        alone = Stream(self.url, completion_body(self.model_id, self.prompt(random.Random(f"{a.seed}/long-alone"), a.long_prompt), 1),
                       a.timeout)
        alone.run()
        if alone.error:
            if self.server is not None:
                self.server.check_alive()
            raise BenchError(f"the long request failed: {alone.error}")

        def send_long(streams: list[Stream]):
            deadline = time.time() + a.timeout
            while not all(s.chunks or s.error or s.end for s in streams):
                if time.time() > deadline:
                    raise BenchError("the streams never all started decoding")
                time.sleep(0.002)
            long.run()

        start = run_streams(streams, self.server, a.timeout, during=send_long)
        if long.error:
            raise BenchError(f"the long request failed: {long.error}")
        t0, t1 = long.sent, long.end
        inside = [b - x for s in streams for x, b in gaps(s) if x < t1 and b > t0]
        outside = [b - x for s in streams for x, b in gaps(s) if not (x < t1 and b > t0)]
        alive = sum(1 for s in streams if s.chunks and s.chunks[-1] >= t1)
        return {
            "streams": a.long_level, "stream_tokens": a.long_stream_tokens, "long_prompt_tokens": a.long_prompt,
            "long_ttft_s": (long.first_event or long.end) - long.sent,
            "long_alone_ttft_s": (alone.first_event or alone.end) - alone.sent,
            "long_total_s": long.end - long.sent,
            "streams_decoding_after_long": alive,
            "itl_during_long_p50_s": pct(inside, 50), "itl_during_long_p99_s": pct(inside, 99),
            "itl_during_long_max_s": max(inside) if inside else None, "gaps_during_long": len(inside),
            "itl_outside_p50_s": pct(outside, 50), "itl_outside_p99_s": pct(outside, 99),
            "aggregate_tok_s": stream_figures(streams, start)["aggregate_tok_s"],
        }


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def num(v: float | None, fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


def print_table(meta: dict, rows: list[dict], interference: dict | None, out):
    print(f"model {meta['model']} ({meta['model_dir'] or 'config unknown'}), device {meta['device']}, commit {meta['commit']}, "
          f"{meta['machine']}; prompt {meta['prompt_tokens']} tokens, {meta['output_tokens']} generated per stream", file=out)
    head = (f"{'streams':>7} {'agg tok/s':>10} {'tok/s/stream':>12} {'TTFT ms p50/p99/max':>21} {'ITL ms p50/p99':>15} "
            f"{'tok/chunk':>9} {'srv ITL ms':>10} {'floor GB':>9} {'floor tok/s':>11} {'of floor':>8}")
    print(head, file=out)
    for r in rows:
        frac = r.get("fraction_of_floor")
        ttft = "/".join(ms(r[k]) for k in ("ttft_p50_s", "ttft_p99_s", "ttft_max_s"))
        itl = "/".join(ms(r[k]) for k in ("itl_p50_s", "itl_p99_s"))
        print(f"{r['concurrency']:>7} {num(r['aggregate_tok_s']):>10} {num(r['stream_decode_tok_s_p50'], ',.1f'):>12} "
              f"{ttft:>21} {itl:>15} {num(r['tokens_per_chunk'], '.2f'):>9} {ms(r['server_itl_mean_s']):>10} "
              f"{num(r.get('floor_gb'), '.2f'):>9} {num(r.get('floor_tok_s')):>11} "
              f"{'-' if frac is None else f'{frac:.1%}':>8}", file=out)
    print("where the engine's time went: steps that ran prompt tokens (count, seconds in all, prompt tokens per "
          "second of them) and steps that only decoded (count, mean), their sum against the wall time", file=out)
    print(f"{'streams':>7} {'prefill steps':>13} {'prefill s':>9} {'prompt tok/s':>12} {'decode steps':>12} {'ms/step':>8} "
          f"{'busy':>6}", file=out)
    for r in rows:
        print(f"{r['concurrency']:>7} {r['prefill_steps']:>13} {r['prefill_step_s']:>9.3f} {num(r['prefill_tok_s']):>12} "
              f"{r['decode_steps']:>12} {ms(r['decode_step_mean_s']):>8} {r['engine_busy_fraction']:>6.1%}", file=out)
    if interference:
        i = interference
        print(f"interference: {i['streams']} streams x {i['stream_tokens']} tokens, a {i['long_prompt_tokens']}-token prompt "
              f"arrives: its TTFT {ms(i['long_ttft_s'])} ms (alone {ms(i['long_alone_ttft_s'])} ms);", file=out)
        print(f"  the streams' ITL during its prefill p50 / p99 / max {ms(i['itl_during_long_p50_s'])} / "
              f"{ms(i['itl_during_long_p99_s'])} / {ms(i['itl_during_long_max_s'])} ms ({i['gaps_during_long']} gaps), "
              f"outside it p50 / p99 {ms(i['itl_outside_p50_s'])} / {ms(i['itl_outside_p99_s'])} ms; "
              f"{i['streams_decoding_after_long']} streams still decoding after it", file=out)


def git_commit() -> str:
    """The commit the binary was built from (dist/BUILD beside it, written by gpu-build.sh),
    else the repository's HEAD."""
    build = orchid_binary().parent / "BUILD"
    if build.is_file():
        for line in build.read_text().splitlines():
            if line.startswith("commit "):
                return line.split()[1]
    p = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return p.stdout.strip() or "unknown"


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for the figures.")
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--model", type=Path, help="checkpoint folder to serve (with --url: only read for the byte floor)")
    ap.add_argument("--preset", default=DEFAULT_PRESET, help=f"synth preset when no --model (default {DEFAULT_PRESET})")
    ap.add_argument("--synth-out", type=Path, help="where the preset is synthesized (default /dev/shm/q36 for the default preset)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="serve --device (default auto)")
    ap.add_argument("--concurrency", default="1,4,16,32,64", help="streams per level (default 1,4,16,32,64)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--max-seqs", type=int, help="serve --max-seqs (default: the largest level, +1 with --long-prompt)")
    ap.add_argument("--max-context", type=int, help="serve --max-context (default: what the requests need)")
    ap.add_argument("--long-prompt", type=int, default=0, help="tokens of the interfering prompt (default 0: no interference run)")
    ap.add_argument("--long-level", type=int, default=16, help="streams decoding while the long prompt arrives (default 16)")
    ap.add_argument("--long-stream-tokens", type=int, default=1024, help="tokens each of those streams generates (default 1024)")
    ap.add_argument("--hbm-tbps", type=float, default=4.3, help="memory bandwidth for the floor's tok/s, TB/s (default 4.3, H200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the server to start and for each level (default 900)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up burst")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG", help="one more `orchid serve` argument (repeatable)")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write JSON to FILE (alone: to stdout, the table to stderr)")
    args = ap.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency needs positive integers")
    if args.prompt_tokens < 1 or args.output_tokens < 1:
        ap.error("--prompt-tokens and --output-tokens must be positive")
    if args.max_seqs is None:
        args.max_seqs = max(args.concurrency + ([args.long_level + 1] if args.long_prompt else []))
    if args.max_context is None:
        need = args.prompt_tokens + max(args.output_tokens, args.long_stream_tokens if args.long_prompt else 0)
        args.max_context = max(need, args.long_prompt + 1) + 64
    return args


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM (and SIGINT, even where a non-interactive shell ignores it) ends the run, and the
    # `finally` below ends the server.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    server = None
    model_dir = args.model
    try:
        if args.url:
            url = args.url.rstrip("/")
        else:
            binary = orchid_binary()
            if not binary.is_file():
                raise BenchError(f"orchid binary not found at {binary} (build it, or set ORCHID_BIN)")
            model_dir = prepare_model(binary, args)
            server = Server(binary, model_dir, args)
            server.wait_ready(args.timeout)
            url = server.url
        config = json.loads((model_dir / "config.json").read_text()) if model_dir and (model_dir / "config.json").is_file() else None
        model_id = get_json(url, "/v1/models")["data"][0]["id"]
        bench = Bench(url, model_id, args, server, config)
        if args.warmup:
            bench.warm_up()
        rows = []
        for n in args.concurrency:
            rows.append(bench.level(n))
            r = rows[-1]
            print(f"  {n} streams: {r['aggregate_tok_s']:,.0f} tok/s, ITL p50 {ms(r['itl_p50_s'])} ms", file=sys.stderr)
        interference = bench.interference() if args.long_prompt else None
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
    meta = {"model": model_id, "model_dir": str(model_dir) if model_dir else None, "device": "(--url)" if args.url else args.device,
            "commit": git_commit(), "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "seed": args.seed,
            "hbm_tbps": args.hbm_tbps, "max_seqs": args.max_seqs, "max_context": args.max_context}
    result = {"meta": meta, "levels": rows, "interference": interference}
    table_out = sys.stderr if args.json == "-" else sys.stdout
    print_table(meta, rows, interference, table_out)
    if args.json == "-":
        print(json.dumps(result, indent=1))
    elif args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
