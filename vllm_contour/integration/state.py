"""Worker-process state shared by the KV connector (worker role) and the attention backend.

One ``WorkerState`` per worker process (module global). The connector fills it (evict-now list at the
start of a step, compacted layouts after ``wait_for_save``); the metadata builder reads it to route
compacted decode rows to the ragged op; the attention impl reads it to capture window queries.

Rows are matched to requests by the physical id of the request's first block (``block_table[row, 0]``).
With prefix caching off (the plugin turns it off when eviction is on) every block belongs to one
request, and block 0 of a compacted request is never freed while it runs; finished and preempted
requests are dropped at the start of the next step, before any metadata is built.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from vllm_contour.config import RequestEviction
from vllm_contour.layout import RequestLayout


@dataclass
class EvictItem:
    """Scheduler -> worker: evict this request after the current step's forward."""

    req_id: str
    block_ids: list[int]  # all blocks of the request, logical order
    num_tokens: int  # tokens with KV after this step
    params: RequestEviction


@dataclass
class CaptureItem:
    """Scheduler -> worker: this step's chunk of the request covers part of its observation window
    ``[start, end)`` (absolute positions); copy those queries in every layer."""

    req_id: str
    key_block: int
    start: int
    end: int


@dataclass
class Capture:
    """Window queries of one request, accumulated over prefill chunks: layer -> list of [Hq, w, D]."""

    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    positions: list[torch.Tensor] = field(default_factory=list)

    def layer_queries(self) -> dict[int, torch.Tensor]:
        return {layer: torch.cat(qs, dim=1) for layer, qs in self.queries.items()}

    def all_positions(self) -> torch.Tensor | None:
        return torch.cat(self.positions) if self.positions else None


@dataclass
class Compacted:
    req_id: str
    key_block: int
    layout: RequestLayout
    region_blocks: int  # E


@dataclass
class DecodeRows:
    """Per step: the compacted decode rows of the batch and their per-layer page tables."""

    rows: torch.Tensor  # [R] batch row indices
    token_idx: torch.Tensor  # [R] query token index of each row
    page_table: torch.Tensor  # [L, R, H, P] int32 head-page ids
    seq_lens: torch.Tensor  # [L, R, H] int32
    moment_pages: torch.Tensor | None = None  # [L, R, M] int32 (rows without moments: any valid page)
    has_moments: torch.Tensor | None = None  # [R] bool


@dataclass
class CaptureRows:
    """Per step: token ranges of evict-now rows whose window queries the impl copies."""

    entries: list[tuple[str, int, int, int]]  # (req_id, first token idx, n tokens, first position)


class WorkerState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.evict_now: dict[str, EvictItem] = {}
        self.key_to_capture: dict[int, CaptureItem] = {}
        self.captures: dict[str, Capture] = {}
        self.compacted: dict[str, Compacted] = {}
        self.key_to_req: dict[int, str] = {}
        self.layer_index: dict[str, int] = {}
        self.window: int = 32

    def drop(self, req_id: str) -> None:
        c = self.compacted.pop(req_id, None)
        if c is not None and self.key_to_req.get(c.key_block) == req_id:
            del self.key_to_req[c.key_block]
        self.captures.pop(req_id, None)
        self.evict_now.pop(req_id, None)

    def begin_step(self, items: list[EvictItem], captures: list[CaptureItem], dropped: set[str]) -> None:
        for req_id in dropped:
            self.drop(req_id)
        self.evict_now = {it.req_id: it for it in items}
        self.key_to_capture = {c.key_block: c for c in captures}
        for c in captures:
            if c.req_id not in self.captures:
                self.captures[c.req_id] = Capture()
        for it in items:
            # A request re-evicted after preemption starts from scratch.
            old = self.compacted.pop(it.req_id, None)
            if old is not None:
                self.key_to_req.pop(old.key_block, None)

    def add_compacted(self, c: Compacted) -> None:
        self.compacted[c.req_id] = c
        self.key_to_req[c.key_block] = c.req_id

    def reset(self) -> None:
        self.__init__()


_STATE = WorkerState()


def worker_state() -> WorkerState:
    return _STATE
