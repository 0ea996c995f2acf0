"""Tokenizer parity: `orchid tokenize` must give exactly the ids of the HF `tokenizers` library.

Both bundled tokenizers are checked (Qwen3.5/3.6: assets/qwen3.5, Qwen3 / Qwen3-Next:
.../qwen3) on a multilingual sample: English, German, French, Chinese, Japanese, Korean, Arabic,
Hindi with combining marks, emoji (incl. ZWJ sequences and flags), code, numbers, whitespace
runs and special tokens written inline, plus a seeded random mix. Decoding the ids with HF gives
the (NFC) text back.

Run: cargo build --release -p orchid && .venv/bin/python -m pytest tests/python/test_tokenizer.py -q
(`ORCHID_BIN` overrides the binary, default target/release/orchid).
"""

import json
import os
import random
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets"
ORCHID = Path(os.environ.get("ORCHID_BIN", REPO / "target" / "release" / "orchid"))

SAMPLES = {
    "english": "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see—don't worry!",
    "german": "Grüße aus München! Übermäßig schöne Äpfel, Öl und Straße. ẞ",
    "french": "Ça va? L'été dernier, à Noël, où êtes-vous allés? Œuvre, naïve, garçon.",
    "chinese": "你好，世界！我们今天学习大型语言模型的推理。𠜎𠜱𠝹",
    "japanese": "日本語のテキスト、カタカナとひらがな。東京タワーは高い。ｶﾞｷﾞ",
    "korean": "안녕하세요, 세계! 한국어 텍스트를 토큰화합니다.",
    "arabic": "مرحبا بالعالم! هذه جملة عربية مع أرقام ١٢٣ و 456.",
    "hindi": "नमस्ते दुनिया। हिन्दी में संयुक्ताक्षर: क्षत्रिय, श्रृंगार, द्वितीय।",
    "emoji": "Emoji 😀👍🏽 👩‍👩‍👧‍👦 🇩🇪🇯🇵 ❤️ 🤖🦀 ✓✗ ★",
    "code": 'fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!("{:?}", x);\n}\n'
            "def f(a, b=None):\n\treturn {'k': [a, b]}  # comment\n",
    "numbers": "0 1 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000 2026-11-29 ١٢٣ ４２",
    "whitespace": "a  b   c    d\n\n\n\te \t \n  f     \r\n\r\ng   ",
    "specials": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\n<think>\nreason\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
                "<|endoftext|> <|im_start <|im_end|x <think",
    "edge": " leading space, trailing space \u00a0nbsp\u200bzwsp\ufeffbom 'S 'LL 'Ve ALL CAPS ...!!! ???",
    "combining": "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319",
}


def fuzz_text(seed: int, n: int = 400) -> str:
    """A seeded mix of pieces from every sample and random code points."""
    rng = random.Random(seed)
    pool = list("".join(SAMPLES.values()))
    pieces = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            start = rng.randrange(len(pool))
            pieces.append("".join(pool[start:start + rng.randint(1, 12)]))
        elif r < 0.8:
            pieces.append(" " * rng.randint(1, 4) + rng.choice(["\n", "\t", "", "\r\n"]))
        else:
            cp = rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FF), rng.randint(0x4E00, 0x9FFF),
                             rng.randint(0x1F300, 0x1FAFF), rng.randint(0x900, 0x97F), rng.randint(0x300, 0x36F)])
            pieces.append(chr(cp))
    return "".join(pieces)


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3"])
def model(request, tmp_path_factory):
    """A model dir with just the tokenizer files, and the HF reference tokenizer."""
    if not ORCHID.exists():
        pytest.skip(f"orchid binary not found at {ORCHID} (build with cargo build --release -p orchid)")
    src = ASSETS / request.param
    d = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        if (src / f).exists():
            shutil.copy(src / f, d / f)
    return d, Tokenizer.from_file(str(d / "tokenizer.json"))


def orchid_ids(model_dir: Path, text: str, tmp_path: Path, special: bool = False) -> list[int]:
    f = tmp_path / "text.txt"
    f.write_bytes(text.encode("utf-8"))
    cmd = [str(ORCHID), "tokenize", "--model", str(model_dir), "--text-file", str(f)]
    if special:
        cmd.append("--special")
    out = subprocess.run(cmd, capture_output=True, check=True)
    return json.loads(out.stdout)["ids"]


@pytest.mark.parametrize("name", list(SAMPLES))
def test_ids_match_hf(model, name, tmp_path):
    model_dir, hf = model
    text = SAMPLES[name]
    ids = orchid_ids(model_dir, text, tmp_path)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    # Decoding gives the text back (the tokenizers normalize to NFC).
    assert hf.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_all_samples_and_fuzz(model, tmp_path):
    model_dir, hf = model
    for i, text in enumerate(["\n".join(SAMPLES.values()), fuzz_text(1), fuzz_text(2)]):
        ids = orchid_ids(model_dir, text, tmp_path, special=(i == 0))
        assert ids == hf.encode(text, add_special_tokens=(i == 0)).ids, f"text #{i}"
        assert hf.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_inline_special_tokens_become_ids(model, tmp_path):
    model_dir, hf = model
    ids = orchid_ids(model_dir, "<|im_start|>user\nx<|im_end|>", tmp_path)
    assert ids[0] == hf.token_to_id("<|im_start|>")
    assert ids[-1] == hf.token_to_id("<|im_end|>")


def test_text_argument_and_errors(model, tmp_path):
    model_dir, hf = model
    out = subprocess.run([str(ORCHID), "tokenize", "--model", str(model_dir), "--text", "héllo wörld"],
                         capture_output=True, check=True)
    assert json.loads(out.stdout)["ids"] == hf.encode("héllo wörld").ids
    bad = subprocess.run([str(ORCHID), "tokenize", "--model", str(tmp_path), "--text", "x"], capture_output=True)
    assert bad.returncode != 0 and b"tokenizer.json" in bad.stderr
