"""Support for the `orchid serve` tests (no tests here): checkpoints, a running server, HTTP.

Two checkpoints, both made from `orchid synth --preset tiny-test` (Qwen3.5 tokenizer and
chat template copied in):

* **random**: the random weights as written. Its output is gibberish but deterministic under
  greedy decoding, which is all the streaming/concurrency/sampling tests need.
* **scripted**: the same checkpoint edited into a *bigram* model that writes fixed texts. Every
  mixer and expert output projection is zeroed, so the residual stream is the token embedding;
  embeddings and an untied `lm_head` are set so that the greedy successor of each token is the
  next token of a script. The prompt's last token picks the script, and the chat template
  makes that token differ by mode (thinking on: `\\n`, thinking off: `\\n\\n`, tool_choice
  required: `=`). A script's text is split into tokens that never repeat (so each token has
  one successor, and the chain ends in `<|im_end|>`). This lets the end-to-end tests see real reasoning, tool calls and a tool
  round trip come out of the real binary, without relying on a trained model.

Environment: ORCHID_BIN (default target/release/orchid), ORCHID_SERVER_TIMEOUT (seconds to
wait for startup, default 180).
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STARTUP_TIMEOUT = float(os.environ.get("ORCHID_SERVER_TIMEOUT", "180"))


def shared_assets() -> Path | None:
    d = REPO / "assets" / "qwen3.5"
    return d if (d / "tokenizer.json").is_file() else None


def orchid_binary() -> Path:
    return Path(os.environ.get("ORCHID_BIN", REPO / "target" / "release" / "orchid"))


def binary_problem() -> str | None:
    """Why the server tests cannot run (None when they can)."""
    b = orchid_binary()
    if not (b.is_file() and os.access(b, os.X_OK)):
        return f"orchid binary not found at {b} (cargo build --release)"
    p = subprocess.run([str(b), "serve", "--help"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        return f"{b} has no `serve` command"
    if shared_assets() is None:
        return "assets/qwen3.5 (tokenizer, chat template) not found"
    return None


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------

_WORK = Path(tempfile.mkdtemp(prefix="orchid-server-tests-"))
atexit.register(shutil.rmtree, _WORK, True)
_CACHE: dict = {}


def random_checkpoint() -> Path:
    if "random" not in _CACHE:
        out = _WORK / "tiny-random"
        p = subprocess.run([str(orchid_binary()), "synth", "--preset", "tiny-test", "--format", "hf", "--out", str(out),
                            "--tokenizer-dir", str(shared_assets()), "--seed", "7"], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"orchid synth failed:\n{p.stderr[-3000:]}"
        _CACHE["random"] = out
    return _CACHE["random"]


# The scripts of the scripted model: (prompt suffix whose last token selects it, text).
THINKING_PROMPT = "<|im_start|>assistant\n<think>\n"
NO_THINKING_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
REQUIRED_PROMPT = NO_THINKING_PROMPT + "<tool_call>\n<function="

# Greedy bigram chains cannot repeat a token (it would loop), and Qwen's tokenizer never merges
# a newline with a tag, so the scripted call is written without the newlines between tags (the
# parser skips whitespace there, so this parses exactly like the canonical layout; the canonical
# layout itself is covered by the parser's unit tests).
SCRIPT_THINKING = "The user wants the time in Oslo, so I will call a tool</think>Let me check the clock for you!"
SCRIPT_ANSWER = "It is 10:42 in Oslo right now."
SCRIPT_REQUIRED = "get_time><parameter=timezone>Europe/Oslo</parameter></function></tool_call>"
SCRIPTS = [(THINKING_PROMPT, SCRIPT_THINKING), (NO_THINKING_PROMPT, SCRIPT_ANSWER), (REQUIRED_PROMPT, SCRIPT_REQUIRED)]


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level map, unicode char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _vocab_bytes(tokenizer_json: Path) -> dict[bytes, int]:
    j = json.loads(tokenizer_json.read_text())
    dec = _byte_decoder()
    out = {}
    for tok, i in j["model"]["vocab"].items():
        try:
            out[bytes(dec[c] for c in tok)] = i
        except KeyError:
            pass
    for a in j["added_tokens"]:
        if a["content"] in ("<tool_call>", "</tool_call>", "</think>"):
            out[a["content"].encode()] = a["id"]
    return out


def _segment(text: bytes, vocab: dict[bytes, int], used: set[int], budget: int = 200_000) -> list[int]:
    """Token ids spelling `text` with no id from `used` and none twice (depth-first, longest
    pieces first)."""
    maxlen = max(map(len, vocab))
    steps = [0]

    def go(i: int, taken: list[int]) -> list[int] | None:
        if i == len(text):
            return taken
        steps[0] += 1
        if steps[0] > budget:
            return None
        for n in range(min(maxlen, len(text) - i), 0, -1):
            tid = vocab.get(text[i:i + n])
            if tid is None or tid in used:
                continue
            used.add(tid)
            r = go(i + n, taken + [tid])
            if r is not None:
                return r
            used.discard(tid)
        return None

    r = go(0, [])
    assert r is not None, f"cannot spell {text!r} without repeating a token"
    return r


def _chains(assets: Path) -> tuple[list[list[int]], list[int]]:
    """Per script: [start token, script tokens..., <|im_end|>]; and all ids that need an input
    direction."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(assets / "tokenizer.json"))
    vocab = _vocab_bytes(assets / "tokenizer.json")
    starts = [tok.encode(p, add_special_tokens=False).ids[-1] for p, _ in SCRIPTS]
    assert len(set(starts)) == len(starts), f"scripts share a start token: {starts}"
    used = set(starts)
    im_end = tok.token_to_id("<|im_end|>")
    chains = []
    for start, (_, text) in zip(starts, SCRIPTS):
        ids = _segment(text.encode(), vocab, used)
        assert tok.decode(ids, skip_special_tokens=False) == text
        chains.append([start, *ids, im_end])
    return chains, sorted({t for c in chains for t in c[:-1]})


def scripted_checkpoint() -> Path:
    if "scripted" in _CACHE:
        return _CACHE["scripted"]
    import torch
    from safetensors.torch import load_file, save_file

    src = random_checkpoint()
    out = _WORK / "tiny-scripted"
    shutil.copytree(src, out)
    chains, inputs = _chains(shared_assets())
    files = sorted(out.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    emb_name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    vocab, hidden = tensors[emb_name].shape
    dtype = tensors[emb_name].dtype
    # Silence every block: the residual stream stays the embedding.
    for k in tensors:
        if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")):
            tensors[k] = torch.zeros_like(tensors[k])
        elif k.endswith("norm.weight") and "layers" not in k:
            tensors[k] = torch.zeros_like(tensors[k])  # final norm: multiplier 1 + 0
    g = torch.Generator().manual_seed(0)
    dirs = torch.randn(len(inputs), hidden, generator=g)
    dirs = dirs / dirs.norm(dim=1, keepdim=True)
    row = {t: i for i, t in enumerate(inputs)}
    emb = torch.zeros(vocab, hidden)
    head = torch.zeros(vocab, hidden)
    for t in inputs:
        emb[t] = dirs[row[t]]
    for c in chains:
        for a, b in zip(c, c[1:]):
            head[b] += 8.0 * dirs[row[a]]
    emb, head = emb.to(dtype), head.to(dtype)
    # Check the greedy successor of every step (same math as the model: RMSNorm, then lm_head).
    for c in chains:
        for a, b in zip(c, c[1:]):
            x = emb[a].float()
            x = x / torch.sqrt((x * x).mean() + 1e-6)
            logits = head.float() @ x
            assert int(logits.argmax()) == b, (a, b, int(logits.argmax()))
    tensors[emb_name] = emb.contiguous()
    tensors["lm_head.weight"] = head.contiguous()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    if "text_config" in cfg:
        cfg["text_config"]["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _CACHE["scripted"] = out
    return out


# --------------------------------------------------------------------------------------
# A running server
# --------------------------------------------------------------------------------------


class Server:
    """`orchid serve` on a free port, logging to a file."""

    def __init__(self, model_dir: Path, *args: str, name: str = "server"):
        self.log_path = _WORK / f"{name}-{time.time_ns()}.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, ORCHID_LOG=os.environ.get("ORCHID_SERVER_LOG", "info"), RUST_BACKTRACE="1")
        cmd = [str(orchid_binary()), "serve", "--model", str(model_dir), "--port", "0", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + STARTUP_TIMEOUT
        m = None
        while m is None:
            self._check_alive()
            assert time.time() < deadline, f"no 'listening on' line in time:\n{self.log()}"
            m = re.search(r"listening on http://([0-9.]+):(\d+)", self.log())
            time.sleep(0.05)
        self.host, self.port = m.group(1), int(m.group(2))
        self.base = f"http://{self.host}:{self.port}"

    def _check_alive(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"orchid serve exited with {self.proc.returncode}:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self):
        deadline = time.time() + STARTUP_TIMEOUT
        while True:
            self._check_alive()
            status, _, _ = self.request("GET", "/health")
            if status == 200:
                return self
            assert time.time() < deadline, f"/health never became 200:\n{self.log()}"
            time.sleep(0.1)

    def request(self, method: str, path: str, body=None, headers=None, timeout: float = 300):
        """(status, headers dict, body bytes); `body` may be bytes, str or a JSON value."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            h = {"Content-Type": "application/json"} if body is not None else {}
            h.update(headers or {})
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body=None):
        status, headers, data = self.request(method, path, body)
        return status, headers, json.loads(data)

    def metrics(self) -> dict[str, float]:
        status, _, data = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server did not exit within {timeout}s of {sig}:\n{self.log()}")
        self._log.close()
        return self.proc.returncode


_SERVERS: dict[str, Server] = {}


def shared_server(kind: str) -> Server:
    """One server per checkpoint kind for the whole session (stopped at exit)."""
    if kind not in _SERVERS:
        model = random_checkpoint() if kind == "random" else scripted_checkpoint()
        _SERVERS[kind] = Server(model, "--max-context", "4096", "--max-seqs", "16", "--max-queue", "64", "--model-id", f"tiny-{kind}", name=kind).wait_ready()
    s = _SERVERS[kind]
    s._check_alive()
    return s


@atexit.register
def _stop_all():
    for s in _SERVERS.values():
        try:
            s.stop(timeout=30)
        except Exception:  # noqa: BLE001 - best effort at exit
            s.proc.kill()


def sse_events(data: bytes) -> list:
    """The `data:` payloads of an SSE body (JSON decoded, `[DONE]` kept as the string)."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
