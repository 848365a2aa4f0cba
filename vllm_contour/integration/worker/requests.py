"""What a worker keeps per request, for as long as the request runs: its compacted layout (mirrored into
the kernel-ready ``PageTables``), its captured window queries, and the layouts of shared compressed contexts
that requests adopt. Owned by the worker side (``side.py``); a request that leaves (finished, preempted,
recomputed) or starts over (a new epoch) loses its state at the start of the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_contour.layout import RequestLayout
from vllm_contour.page_tables import PageTables


class QueryRing:
    """The last ``window`` captured queries of one request, every layer: ``[L, Hq, W, D]`` plus their
    positions (``-1`` = empty). Bounded: a request never holds more than ``window`` queries per layer."""

    def __init__(self, window: int):
        self.window = window
        self.queries: torch.Tensor | None = None  # on the queries' device, made at the first write
        self.positions: torch.Tensor | None = None

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
            self.queries = torch.zeros((num_layers, hq, self.window, d), dtype=q.dtype, device=q.device)
            self.positions = torch.full((self.window,), -1, dtype=torch.int64, device=q.device)
        positions = positions.to(q.device)
        slots = positions % self.window
        self.queries[:, :, slots] = q.permute(0, 2, 1, 3)
        self.positions[slots] = positions

    def layer_queries(self) -> tuple[dict[int, torch.Tensor], torch.Tensor] | tuple[None, None]:
        """``({layer: [Hq, w, D]}, positions [w])`` in position order, or ``(None, None)`` when empty."""
        if self.queries is None:
            return None, None
        have = (self.positions >= 0).nonzero().squeeze(1)
        if have.numel() == 0:
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


class WorkerRequests:
    """The requests this worker knows, the shared compressed contexts' layouts, and the compacted ones'
    kernel-ready tables (made when the caches are registered, on their device)."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self.shared: dict[int, RequestLayout] = {}  # shared compressed contexts: entry id -> layout
        self.tables: PageTables | None = None

    def drop(self, req_id: str) -> RequestState | None:
        rs = self.requests.pop(req_id, None)
        if self.tables is not None:
            self.tables.drop(req_id)
        return rs

    def state_for(self, req_id: str, epoch: int | None = None) -> RequestState:
        """The request's state; a new epoch (the request started over) replaces the old state."""
        rs = self.requests.get(req_id)
        if rs is None or (epoch is not None and rs.epoch != epoch):
            if rs is not None and self.tables is not None:
                self.tables.drop(req_id)
            rs = self.requests[req_id] = RequestState(req_id, epoch or 0)
        return rs

    def set_layout(self, req_id: str, layout: RequestLayout, next_pos: int | None = None,
                   last_block: int | None = None) -> None:
        """A request's cache is compacted as ``layout`` (after its round, or adopting a shared context);
        ``next_pos`` / ``last_block``: where its next step is expected to start (``PageTables.expect``)."""
        self.state_for(req_id).layout = layout
        if self.tables is not None:
            self.tables.put(req_id, layout)
            if next_pos is not None and last_block is not None:
                self.tables.expect(req_id, next_pos, last_block)

    def layout_of(self, req_id: str) -> RequestLayout | None:
        rs = self.requests.get(req_id)
        return None if rs is None else rs.layout

    def compacted(self) -> list[str]:
        """Requests whose cache is compacted (their rows go to the compacted-attention op)."""
        return [r for r, rs in self.requests.items() if rs.layout is not None]

    def reads(self, layout) -> bool:
        """Whether a shared compressed context or a request on this worker still holds ``layout``."""
        return any(x is layout for x in self.shared.values()) or \
            any(rs.layout is layout for rs in self.requests.values())

    def ring_bytes(self) -> int:
        return sum(rs.ring.nbytes for rs in self.requests.values() if rs.ring is not None)
