"""TEST ONLY: the fault switch (``VLLM_CONTOUR_FAULTS``) that makes chosen eviction rounds, attention ops,
page tables or the start-up layout probe fail, so the tests can check that a failure stays with its request.
Off unless the variable is set."""

from __future__ import annotations

import hashlib
import re

FAULTS_ENV = "VLLM_CONTOUR_FAULTS"


class FaultSwitch:
    """TEST ONLY. ``VLLM_CONTOUR_FAULTS="plan=0.2,apply=0.1,seed=0"`` makes that share of rounds fail while
    planning (nothing written) or raise in the middle of compaction (after the first layer moved). Off by
    default; chosen per (request, round) by a hash, so a run is reproducible. ``only=PREFIX`` limits those
    random failures to requests whose id starts with PREFIX. ``at=KIND:ID:N`` (repeatable; ID may end with
    ``*``, a prefix) names one failure of one request, which then gets no random ones: KIND ``plan`` or
    ``apply`` fails its round N; ``forward`` reports its attention op failed, ``metadata`` its compacted rows'
    page table unbuildable, in the N-th step it runs compacted. ``layout=scramble`` makes the start-up layout
    probe see vLLM's cache write through a scrambled page (an unknown layout)."""

    def __init__(self, spec: str | None):
        self.rates: dict[str, float] = {}
        self.seed = "0"
        self.only = ""
        self.at: list[tuple[str, str, int]] = []
        self._steps: dict[tuple[str, str], int] = {}
        self.scramble_layout = False
        for part in (spec or "").split(","):
            if not part.strip():
                continue
            key, _, value = part.partition("=")
            key = key.strip()
            if key == "seed":
                self.seed = value.strip()
            elif key in ("plan", "apply"):
                self.rates[key] = float(value)
            elif key == "only":
                self.only = value.strip()
            elif key == "at" and value.count(":") == 2 and \
                    value.split(":")[0].strip() in ("plan", "apply", "forward", "metadata"):
                kind, rid, n = (x.strip() for x in value.split(":"))
                self.at.append((kind, rid, int(n)))
            elif key == "layout" and value.strip() == "scramble":
                self.scramble_layout = True
            else:
                raise ValueError(f"{FAULTS_ENV}: unknown key {key!r} (plan, apply, seed, only, "
                                 "at=plan|apply|forward|metadata:ID:N, layout=scramble)")

    @property
    def on(self) -> bool:
        return bool(self.rates) or self.scramble_layout or bool(self.at)

    def _named(self, stable: str) -> list[tuple[str, int]]:
        return [(k, n) for k, rid, n in self.at if rid == stable or (rid.endswith("*") and stable.startswith(rid[:-1]))]

    def hit(self, kind: str, req_id: str, seq: int) -> bool:
        stable = re.sub(r"-[0-9a-f]{8}$", "", req_id)  # vLLM appends a random suffix to the caller's id
        named = self._named(stable) if self.at else []
        if named:
            return (kind, seq) in named
        rate = self.rates.get(kind, 0.0)
        if rate <= 0 or not stable.startswith(self.only):
            return False
        h = hashlib.sha256(f"{self.seed}/{kind}/{stable}/{seq}".encode()).digest()
        return int.from_bytes(h[:8], "little") / 2 ** 64 < rate

    def step_errors(self, req_ids, st) -> dict[str, str]:
        """``forward`` / ``metadata`` failures of this step (what the attention backend reports when a compacted
        row's ragged op or page table fails), for the named requests among ``req_ids`` that run compacted."""
        out: dict[str, str] = {}
        for req_id in req_ids if self.at else ():
            rs = st.requests.get(req_id)
            if rs is None or rs.layout is None:
                continue
            stable = re.sub(r"-[0-9a-f]{8}$", "", req_id)
            for kind, n in self._named(stable):
                if kind in ("forward", "metadata"):
                    c = self._steps[(kind, stable)] = self._steps.get((kind, stable), 0) + 1
                    if c == n:
                        out[req_id] = ("ragged decode" if kind == "forward" else "metadata") + ": fault switch"
        return out
