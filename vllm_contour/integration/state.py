"""Worker-process state shared by the worker side of the connector and the attention backend.

One ``WorkerState`` per worker process (module global). The worker side fills it (the step's round and
capture items at the start of a step, the requests' layouts after a round); the metadata builder reads it
to route compacted decode rows to the ragged op and to find the rows whose queries must be captured; the
attention impl stages those queries during the forward.

Rows are matched to requests by the physical id of the request's first block (``block_table[row, 0]``).
With prefix caching off (the plugin turns it off when eviction is on) every block belongs to one request;
a round packs the kept pages into the lowest logical blocks first, so block 0 of a request is never freed
while it runs; finished and preempted requests are dropped at the start of the next step, before any
metadata is built.
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


@dataclass
class CaptureItem:
    """Scheduler -> worker: this step's tokens of the request cover part of the observation window
    ``[start, end)`` (absolute positions) of its next round; copy those queries in every layer."""

    req_id: str
    key_block: int
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
    key_block: int
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
        self.key_to_req: dict[int, str] = {}  # first block -> request with a layout
        self.rounds_now: dict[str, RoundItem] = {}
        self.capture_keys: dict[int, CaptureItem] = {}
        self.layer_index: dict[str, int] = {}
        # queries staged by the impl during this step's forward: layer -> [n, Hq, D]
        self.staged: dict[int, torch.Tensor] = {}
        self.staged_rows: CaptureRows | None = None
        # requests whose output of this step is wrong (a decode op failed for their row)
        self.forward_errors: dict[str, str] = {}

    def drop(self, req_id: str) -> None:
        rs = self.requests.pop(req_id, None)
        if rs is not None and self.key_to_req.get(rs.key_block) == req_id:
            del self.key_to_req[rs.key_block]
        self.rounds_now.pop(req_id, None)

    def state_for(self, req_id: str, key_block: int) -> RequestState:
        rs = self.requests.get(req_id)
        if rs is None or rs.key_block != key_block:
            if rs is not None:
                self.drop(req_id)
            rs = self.requests[req_id] = RequestState(req_id, key_block)
        return rs

    def set_layout(self, rs: RequestState, layout: RequestLayout | None) -> None:
        rs.layout = layout
        if layout is None:
            if self.key_to_req.get(rs.key_block) == rs.req_id:
                del self.key_to_req[rs.key_block]
        else:
            self.key_to_req[rs.key_block] = rs.req_id

    def query_buffer_bytes(self) -> int:
        return sum(rs.ring.nbytes for rs in self.requests.values() if rs.ring is not None)


_STATE = WorkerState()


def worker_state() -> WorkerState:
    return _STATE
