#!/usr/bin/env python3
"""Train the orchid-tiny byte-level BPE tokenizer and tokenize the corpus.

Same pipeline as the Qwen3.5 tokenizer (docs/model.md §8.1): NFC normaliser, the
Qwen3.5 split regex (isolated), GPT-2 byte-level alphabet, no BOS. Only the
vocabulary is small: --vocab ids in total, the last len(ADDED) of them being
the Qwen special tokens (so, as in Qwen, regular BPE ids come first).

Inputs : DATA/train.jsonl, DATA/eval.jsonl (prepare_data.py)
Outputs: DATA/tokenizer/{tokenizer.json, tokenizer_config.json, chat_template.jinja}
         DATA/tokens/{train,eval}.u16.xz   uint16 token stream (little endian), every
                                           document followed by <|endoftext|>
         DATA/tokens/{train,eval}.json     per-source spans [start, end) in the stream
                                           and token counts
Usage: python training/train_tokenizer.py [--data training/data] [--vocab 8192]
"""
from __future__ import annotations

import argparse
import json
import lzma
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
    processors, trainers

REPO = Path(__file__).resolve().parent.parent
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (content, special) in id order; the flags follow the Qwen3.5 tokenizer.json
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
         ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
         ("<tool_response>", False), ("</tool_response>", False)]
CHAT_TEMPLATE = REPO / "assets/qwen3.5/chat_template.jinja"


def load_docs(path: Path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def build(vocab: int, train_jsonl: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(ADDED), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])

    def texts():
        for d in load_docs(train_jsonl):
            t = d["text"]
            for s, _ in ADDED:          # chat markup is not part of the BPE statistics
                t = t.replace(s, "\n")
            yield t
    tok.train_from_iterator(texts(), trainer=trainer)
    assert tok.get_vocab_size() == vocab - len(ADDED), tok.get_vocab_size()
    tok.add_tokens([AddedToken(s, special=sp, normalized=False, single_word=False, lstrip=False,
                               rstrip=False) for s, sp in ADDED])
    assert tok.get_vocab_size() == vocab
    return tok


def tokenizer_config(vocab: int) -> dict:
    first = vocab - len(ADDED)
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(first + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": sp} for i, (s, sp) in enumerate(ADDED)},
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
        "tokenizer_class": "TokenizersBackend",
    }


def encode_split(tok: Tokenizer, jsonl: Path, out_prefix: Path):
    eot = tok.token_to_id("<|endoftext|>")
    by_src: dict[str, list[np.ndarray]] = {}
    batch, srcs = [], []

    def flush():
        for s, enc in zip(srcs, tok.encode_batch(batch, add_special_tokens=False)):
            by_src.setdefault(s, []).append(np.asarray(enc.ids + [eot], dtype=np.uint16))
        batch.clear()
        srcs.clear()
    for d in load_docs(jsonl):
        batch.append(d["text"])
        srcs.append(d["src"])
        if len(batch) >= 2048:
            flush()
    flush()
    # one contiguous block per source, sources in sorted order
    parts, spans, pos = [], {}, 0
    chars = {}
    for s in sorted(by_src):
        arr = np.concatenate(by_src[s])
        spans[s] = [pos, pos + len(arr)]
        parts.append(arr)
        pos += len(arr)
    stream = np.concatenate(parts)
    with lzma.open(str(out_prefix) + ".u16.xz", "wb", preset=6) as f:
        f.write(stream.astype("<u2").tobytes())
    for d in load_docs(jsonl):
        chars[d["src"]] = chars.get(d["src"], 0) + len(d["text"])
    meta = {"tokens": int(pos), "spans": spans,
            "tokens_per_source": {s: b - a for s, (a, b) in spans.items()},
            "chars_per_token": {s: round(chars[s] / (b - a), 3) for s, (a, b) in spans.items()}}
    Path(str(out_prefix) + ".json").write_text(json.dumps(meta, indent=1))
    return meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "training" / "data"))
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    data = Path(args.data)
    tdir = data / "tokenizer"
    tdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok = build(args.vocab, data / "train.jsonl")
    tok.save(str(tdir / "tokenizer.json"))
    (tdir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.vocab), indent=2) + "\n")
    shutil.copy(CHAT_TEMPLATE, tdir / "chat_template.jinja")
    print(f"tokenizer trained in {time.time() - t0:.0f}s: {tok.get_vocab_size()} ids", flush=True)

    # round-trip checks (decode(encode(x)) == NFC(x))
    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    import unicodedata
    samples = ["Hello, world! It's 2026 — naïve café, 東京, emoji 🙂, tabs\tand\n\nnewlines  ",
               "<|im_start|>user\nWhat does the word \"ocean\" mean?<|im_end|>\n<|im_start|>assistant\n"
               "<think>\n\n</think>\n\n", "e\u0301 combining"]
    for d in load_docs(data / "eval.jsonl"):
        samples.append(d["text"])
    bad = 0
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False).ids
        if tok.decode(ids, skip_special_tokens=False) != unicodedata.normalize("NFC", s):
            bad += 1
    print(f"round trip: {len(samples) - bad}/{len(samples)} exact", flush=True)
    if bad:
        sys.exit("tokenizer does not round-trip")
    enc = tok.encode(samples[1], add_special_tokens=False)
    print("chat prompt tokens:", enc.tokens)

    tokdir = data / "tokens"
    tokdir.mkdir(exist_ok=True)
    for split in ("train", "eval"):
        meta = encode_split(tok, data / f"{split}.jsonl", tokdir / split)
        print(f"{split}: {meta['tokens']:,} tokens; " + ", ".join(
            f"{s} {n / 1e6:.2f}M ({meta['chars_per_token'][s]} c/t)" for s, n in meta["tokens_per_source"].items()),
            flush=True)


if __name__ == "__main__":
    main()
