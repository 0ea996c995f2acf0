"""Running the orchid binary from tests, and the logit assertions shared by the test modules."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from reference import compare_logits

TOL = float(os.environ.get("ORCHID_PARITY_TOL", "1e-4"))  # rel L2 per position vs a reference
CHUNK_TOL = float(os.environ.get("ORCHID_CHUNK_TOL", "1e-5"))  # orchid vs itself across chunkings
TIMEOUT = float(os.environ.get("ORCHID_TEST_TIMEOUT", "300"))


@dataclass
class EvalResult:
    json: dict
    logits: np.ndarray | None
    stdout: str
    stderr: str
    seconds: float


class Orchid:
    """Thin wrapper over the binary. ORCHID_DEVICE (cpu|cuda|auto), if set, is passed as
    --device to every eval."""

    def __init__(self, binary: Path, scratch: Path):
        self.binary = Path(binary)
        self.scratch = Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._n = itertools.count()
        self.device = os.environ.get("ORCHID_DEVICE")

    def run(self, *args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.setdefault("RUST_BACKTRACE", "0")
        return subprocess.run([str(self.binary), *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env=env)

    def tokens_file(self, tokens) -> Path:
        if isinstance(tokens, (str, Path)):
            return Path(tokens)
        p = self.scratch / f"tokens-{next(self._n)}.txt"
        p.write_text(" ".join(str(int(t)) for t in tokens) + "\n")
        return p

    def eval_args(self, model_dir, tokens, chunk=None, dump: Path | None = None) -> list:
        args = ["eval", "--model", model_dir, "--tokens", self.tokens_file(tokens)]
        if chunk is not None:
            args += ["--chunk", chunk]
        if dump is not None:
            args += ["--dump-logits", dump]
        if self.device:
            args += ["--device", self.device]
        return args

    def eval(self, model_dir, tokens, chunk=None, dump: bool = True) -> EvalResult:
        out = self.scratch / f"logits-{next(self._n)}.safetensors" if dump else None
        args = self.eval_args(model_dir, tokens, chunk, out)
        t0 = time.perf_counter()
        p = self.run(*args)
        dt = time.perf_counter() - t0
        if p.returncode != 0:
            raise AssertionError(
                f"orchid {' '.join(map(str, args))} exited {p.returncode}\n"
                f"stderr (tail):\n{p.stderr[-3000:]}\nstdout (tail):\n{p.stdout[-1000:]}")
        logits = None
        if out is not None:
            with safe_open(str(out), "np") as f:
                keys = list(f.keys())
                assert "logits" in keys, f"dump has tensors {keys}, expected 'logits'"
                logits = f.get_tensor("logits")
            out.unlink()
            assert logits.dtype == np.float32, f"dumped logits are {logits.dtype}, expected f32"
        return EvalResult(parse_json(p.stdout), logits, p.stdout, p.stderr, dt)

    def quantize(self, src, out, bits: int, group_size: int) -> subprocess.CompletedProcess:
        p = self.run("quantize", "--in", src, "--out", out, "--bits", bits, "--group-size", group_size)
        if p.returncode != 0:
            raise AssertionError(f"orchid quantize exited {p.returncode}\n{p.stderr[-3000:]}")
        return p


def parse_json(stdout: str) -> dict:
    """The eval summary: the last stdout line that is a JSON object (log lines may precede it),
    or the whole stdout if it is one (pretty-printed) object."""
    try:
        obj = json.loads(stdout)
        if isinstance(obj, dict):
            return obj
    except json.JSONDecodeError:
        pass
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise AssertionError(f"no JSON object on orchid eval's stdout:\n{stdout[-2000:]}")


def assert_logits_match(got: np.ndarray, ref: np.ndarray, what: str, tol: float = TOL):
    """rel L2 ≤ tol at EVERY position, same argmax at every position (genuine ties in the
    reference excepted), no NaN/inf, same shape."""
    assert got is not None, f"{what}: no logits dumped"
    c = compare_logits(got, ref)
    assert c.shape_ok, f"{what}: {c.detail}"
    assert not c.nan, f"{what}: NaN/inf in orchid's logits (first bad row " \
        f"{int(np.argmax(~np.isfinite(got).all(-1)))})"
    if c.max_rel > tol:
        from reference import rel_l2_rows
        rel = rel_l2_rows(got, ref)
        bad = np.nonzero(rel > tol)[0]
        raise AssertionError(
            f"{what}: rel L2 error {c.max_rel:.3e} > {tol:g} at {len(bad)}/{len(rel)} positions; "
            f"first bad position {bad[0]} ({rel[bad[0]]:.3e}), worst {c.worst_pos}; "
            f"rel error at positions 0..7: {np.array2string(rel[:8], precision=2)}")
    assert not c.argmax_mismatch, f"{what}: argmax differs at positions {c.argmax_mismatch[:20]}"


def reference_nll(logits: np.ndarray, tokens) -> float:
    """Mean next-token NLL over the T-1 predicted tokens."""
    x = logits[:-1].astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m).sum(-1)))
    tgt = x[np.arange(len(x)), np.asarray(tokens[1:])]
    return float((lse - tgt).mean())


def check_eval_json(res: EvalResult, ref_logits: np.ndarray, tokens, what: str):
    """JSON has tokens/nll/ppl; nll is the mean NLL of the reference logits; ppl = exp(nll)."""
    j = res.json
    for k in ("tokens", "nll", "ppl"):
        assert k in j, f"{what}: eval JSON lacks {k!r}: {j}"
    T = len(tokens)
    assert j["tokens"] in (T, T - 1), f"{what}: tokens={j['tokens']} for a {T}-token file"
    want = reference_nll(ref_logits, tokens)
    assert abs(j["nll"] - want) <= 1e-4 * max(1.0, abs(want)), \
        f"{what}: nll {j['nll']} != mean NLL of the reference logits {want} (T-1 predictions)"
    assert abs(j["ppl"] - np.exp(j["nll"])) <= 1e-4 * j["ppl"], f"{what}: ppl {j['ppl']} != exp(nll)"
