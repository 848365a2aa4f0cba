"""Worker-process state shared by the worker side of the connector and the attention backend.

One ``WorkerState`` per worker process (module global). The worker side fills it (the step's round and
capture items at the start of a step, the requests' layouts after a round); the metadata builder reads it
to route compacted decode rows to the ragged op and to find the rows whose queries must be captured; the
attention impl stages those queries during the forward.

Rows are matched to requests by the block that receives the row's first new token
(``block_table[row, first_position // block_size]``): the scheduler sends that block's id for every
scheduled request each step. A block that receives new KV belongs to one request (prefix caching shares
only full, already computed blocks), so the key is unique in the batch even when requests share a cached
prefix; a request's first block is not (two requests that hit the same cached prefix both start with it).
Finished and preempted requests are dropped at the start of the next step, before any metadata is built;
a request that starts over (re-admitted after preemption) comes with a new epoch and its old state goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_contour.config import RequestEviction
from vllm_contour.layout import RequestLayout


@dataclass
class RoundItem:
    """Scheduler -> worker: run an eviction round for this request after the current step's forward."""

    req_id: str
    block_ids: list[int]  # all blocks of the request, logical order (freed ones are vLLM's null block)
    num_tokens: int  # tokens with KV after this step
    params: RequestEviction
    seq: int  # round number of the request (reports carry it back; stale ones are ignored)
    # private blocks to pack the kept pages into (some of the request's blocks are hashed for prefix caching
    # or shared with another request): the round reads the originals and writes only these; None: in place
    fresh_ids: list[int] | None = None
    # a context round whose result is shared: (entry id, partial block, its snapshot block); the worker
    # copies the partial block into the snapshot after the round and keeps the layout under the entry id
    publish: tuple[int, int | None, int | None] | None = None


@dataclass
class CaptureItem:
    """Scheduler -> worker: this step's tokens of the request cover part of the observation window
    ``[start, end)`` (absolute positions) of its next round; copy those queries in every layer."""

    req_id: str
    start: int
    end: int
    window: int  # queries the request's ring keeps


class QueryRing:
    """The last ``window`` captured queries of one request, every layer: ``[L, Hq, W, D]`` plus their
    positions (``-1`` = empty). Bounded: a request never holds more than ``window`` queries per layer."""

    def __init__(self, window: int):
        self.window = window
        self.queries: torch.Tensor | None = None
        self.positions = torch.full((window,), -1, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return 0 if self.queries is None else self.queries.numel() * self.queries.element_size()

    def write(self, positions: torch.Tensor, q: torch.Tensor) -> None:
        """``positions [n]``, ``q [L, n, Hq, D]``."""
        if positions.numel() == 0:
            return
        if positions.numel() > self.window:
            positions, q = positions[-self.window:], q[:, -self.window:]
        if self.queries is None:
            num_layers, _, hq, d = q.shape
            self.queries = torch.zeros((num_layers, hq, self.window, d), dtype=q.dtype)
        slots = positions % self.window
        self.queries[:, :, slots] = q.permute(0, 2, 1, 3)
        self.positions[slots] = positions

    def layer_queries(self) -> tuple[dict[int, torch.Tensor], torch.Tensor] | tuple[None, None]:
        """``({layer: [Hq, w, D]}, positions [w])`` in position order, or ``(None, None)`` when empty."""
        have = (self.positions >= 0).nonzero().squeeze(1)
        if self.queries is None or have.numel() == 0:
            return None, None
        order = have[torch.argsort(self.positions[have])]
        q = self.queries[:, :, order]
        return {layer: q[layer] for layer in range(q.shape[0])}, self.positions[order].clone()


@dataclass
class RequestState:
    req_id: str
    epoch: int = 0
    layout: RequestLayout | None = None
    ring: QueryRing | None = None


@dataclass
class DecodeRows:
    """Per step: the batch rows of compacted requests and, one ragged row per query token, their per-layer
    page tables (a request's tokens share its table; each token's lengths end at its own position)."""

    rows: torch.Tensor  # [B] batch rows (requests) that are compacted
    token_idx: torch.Tensor  # [R] query token index of each ragged row
    req_ids: list[str]  # [R] request of each ragged row
    page_table: torch.Tensor  # [L, R, H, P] int32 head-page ids
    seq_lens: torch.Tensor  # [L, R, H] int32
    moment_pages: torch.Tensor | None = None  # [L, R, M] int32 (rows without moments: any valid page)
    has_moments: torch.Tensor | None = None  # [R] bool


@dataclass
class CaptureRows:
    """Per step: the query tokens the impl stages (one index tensor for the whole batch) and whose they are."""

    token_idx: torch.Tensor  # [n] query token indices in the batch
    owners: list[tuple[str, int, int, int]]  # (req_id, offset into token_idx, n tokens, first position)


class WorkerState:
    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self.shared: dict[int, RequestLayout] = {}  # shared compressed contexts: entry id -> layout
        self.step_keys: dict[int, str] = {}  # this step: block of a row's first new token -> request
        self.rounds_now: dict[str, RoundItem] = {}
        self.captures: dict[str, CaptureItem] = {}  # this step's capture items, by request
        self.layer_index: dict[str, int] = {}
        # queries staged by the impl during this step's forward: layer -> [n, Hq, D]
        self.staged: dict[int, torch.Tensor] = {}
        self.staged_rows: CaptureRows | None = None
        # requests whose output of this step is wrong (a decode op failed for their row)
        self.forward_errors: dict[str, str] = {}

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.rounds_now.pop(req_id, None)

    def state_for(self, req_id: str, epoch: int | None = None) -> RequestState:
        """The request's state; a new epoch (the request started over) replaces the old state."""
        rs = self.requests.get(req_id)
        if rs is None or (epoch is not None and rs.epoch != epoch):
            rs = self.requests[req_id] = RequestState(req_id, epoch or 0)
        return rs

    def compacted(self) -> list[str]:
        """Requests whose cache is compacted (their decode rows go to the ragged op)."""
        return [r for r, rs in self.requests.items() if rs.layout is not None]

    def query_buffer_bytes(self) -> int:
        return sum(rs.ring.nbytes for rs in self.requests.values() if rs.ring is not None)


_STATE = WorkerState()


def worker_state() -> WorkerState:
    return _STATE
