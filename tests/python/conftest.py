"""Shared fixtures of orchid's Python tests.

* `orchid`: the binary (env ORCHID_BIN, default <repo>/target/release/orchid). Every test that
  uses it is skipped, with the reason, when the binary is missing or has no `eval` command.
* `ws`: the session's reference workspace (random checkpoints + transformers/mlx-lm logits,
  generated on first use). Set ORCHID_TEST_CACHE=DIR to keep it across sessions (the cache
  is keyed by a hash of the harness sources, so edits invalidate it).
* `repo_root`, `scratch` (session tmp dir).
* `--runslow` runs the tests marked `slow` (the full layout x dtype x length matrix).

Environment knobs: ORCHID_DEVICE (passed as --device), ORCHID_PARITY_TOL (default 1e-4),
ORCHID_CHUNK_TOL (1e-5), ORCHID_TEST_TIMEOUT (seconds per orchid call, 300),
ORCHID_REF_THREADS (torch threads for the references, 1).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import reference as R  # noqa: E402
from harness import Orchid  # noqa: E402

REPO = HERE.parents[1]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (full parity matrix)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: part of the full matrix; run with --runslow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("orchid-scratch")


def _orchid_binary() -> Path:
    return Path(os.environ.get("ORCHID_BIN", REPO / "target" / "release" / "orchid"))


@pytest.fixture(scope="session")
def orchid(scratch) -> Orchid:
    b = _orchid_binary()
    if not b.is_file() or not os.access(b, os.X_OK):
        pytest.skip(f"orchid binary not found at {b} (build it with `cargo build --release` "
                    f"or point ORCHID_BIN at it)")
    try:
        p = subprocess.run([str(b), "eval", "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"orchid binary at {b} does not run: {e}")
    if p.returncode != 0 or "--dump-logits" not in p.stdout:
        pytest.skip(f"orchid binary at {b} has no usable `eval` command (rc {p.returncode})")
    return Orchid(b, scratch / "orchid")


@pytest.fixture(scope="session")
def ws(tmp_path_factory) -> R.Workspace:
    cache = os.environ.get("ORCHID_TEST_CACHE")
    if not cache:
        return R.Workspace(tmp_path_factory.mktemp("orchid-ref"))
    h = hashlib.sha1()
    for f in ("reference.py", "mlx_reference.py"):
        h.update((HERE / f).read_bytes())
    return R.Workspace(Path(cache) / h.hexdigest()[:12])
