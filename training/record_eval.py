"""Measures the shipped 4-bit model and its bf16 original with `orchid eval` on the held-out
text and writes models/orchid-tiny/eval.json (read by tests/python/test_default_model.py).

    python training/record_eval.py --bf16 training/out/hf --shipped models/orchid-tiny
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

WINDOW, WINDOWS, MARGIN = 512, 24, 0.12
REPO = Path(__file__).resolve().parents[1]


def orchid(*args) -> str:
    r = subprocess.run([str(REPO / "target/release/orchid"), *map(str, args)], capture_output=True, text=True, check=True)
    return r.stdout


def ppl(model: Path, ids: list[int]) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(" ".join(map(str, ids)))
        f.flush()
        out = orchid("eval", "--model", model, "--tokens", f.name, "--window", WINDOW, "--chunk", WINDOW)
    return json.loads(out)["ppl"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", type=Path, required=True)
    ap.add_argument("--shipped", type=Path, required=True)
    a = ap.parse_args()
    text = REPO / "tests/data/heldout.txt"
    ids = json.loads(orchid("tokenize", "--model", a.shipped, "--text-file", text))["ids"]
    sub = ids[: WINDOW * WINDOWS]
    rec = {
        "heldout": "tests/data/heldout.txt",
        "margin": MARGIN,
        "full": {"tokens": len(ids), "window": WINDOW, "ppl_bf16": ppl(a.bf16, ids), "ppl_4bit": ppl(a.shipped, ids)},
        "ci_subset": {"tokens": len(sub), "window": WINDOW, "windows": WINDOWS,
                      "ppl_bf16": ppl(a.bf16, sub), "ppl_4bit": ppl(a.shipped, sub)},
        "command": "python training/record_eval.py --bf16 training/out/hf --shipped models/orchid-tiny",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip(),
    }
    (a.shipped / "eval.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
