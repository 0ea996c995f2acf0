#!/usr/bin/env bash
# The project's test command (README, .ci/run): format and lint checks, Rust unit/integration
# tests, then the Python parity and end-to-end tests against the release binary.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${ORCHID_PYTHON:-.venv/bin/python}"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked --release -- -D warnings
cargo build --release --workspace --locked
cargo test --release --workspace --locked
export ORCHID_BIN="$PWD/target/release/orchid" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
"$PY" -m pytest tests/python -q -x --durations=15 "$@"
