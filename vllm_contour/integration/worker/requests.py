"""What a worker keeps per request, for as long as the request runs: its compacted layout (mirrored into
the kernel-ready ``PageTables``), where its round's window queries are (in blocks of vLLM's pool), and the
layouts of shared compressed contexts that requests adopt. Owned by the worker side (``side.py``); a request that leaves (finished, preempted,
recomputed) or starts over (a new epoch) loses its state at the start of the next step. The blocks of the
windows it forgets (read by their round, replaced, or their request gone) are listed (``stale_pages``) for
the worker side to zero where raw query bytes could read as NaN (fp8 caches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_contour.layout import RequestLayout
from vllm_contour.page_tables import PageTables


class QueryWindow:
    """A round's observation window ``[start, round_at)``: its queries are written, as the tokens are
    computed, into blocks of vLLM's pool the scheduler took for them (``pages``: block ids; every layer's
    rows in its own head-pages of those blocks, ``ops.write_page_elems``), and read back by the round. A
    window computed whole in one step has no pages: the step's queries are kept (``held``, per layer) for
    the round that runs after it. ``captured`` says which positions were written."""

    def __init__(self, start: int, round_at: int, pages: list[int]):
        self.start, self.round_at, self.pages = start, round_at, list(pages)
        self.captured = [False] * (round_at - start)
        self.held: dict[int, torch.Tensor] = {}  # layer -> [round_at - start, Hq, D] (no pages)

    def mark(self, pos0: int, n: int) -> None:
        for p in range(max(pos0, self.start), min(pos0 + n, self.round_at)):
            self.captured[p - self.start] = True

    def positions(self) -> list[int]:
        return [self.start + i for i, c in enumerate(self.captured) if c]


@dataclass
class RequestState:
    req_id: str
    epoch: int = 0
    layout: RequestLayout | None = None
    window: QueryWindow | None = None


class WorkerRequests:
    """The requests this worker knows, the shared compressed contexts' layouts, and the compacted ones'
    kernel-ready tables (made when the caches are registered, on their device)."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self.shared: dict[int, RequestLayout] = {}  # shared compressed contexts: entry id -> layout
        self.tables: PageTables | None = None
        self.stale_pages: list[int] = []  # blocks of forgotten windows (their queries' raw bytes), not yet zeroed

    def forget_window(self, rs: RequestState | None) -> None:
        """The request's window is done with (its round read it, it is replaced, or the request is gone)."""
        if rs is not None and rs.window is not None:
            self.stale_pages.extend(rs.window.pages)
            rs.window = None

    def drop(self, req_id: str) -> RequestState | None:
        rs = self.requests.pop(req_id, None)
        self.forget_window(rs)
        if self.tables is not None:
            self.tables.drop(req_id)
        return rs

    def state_for(self, req_id: str, epoch: int | None = None) -> RequestState:
        """The request's state; a new epoch (the request started over) replaces the old state."""
        rs = self.requests.get(req_id)
        if rs is None or (epoch is not None and rs.epoch != epoch):
            self.forget_window(rs)
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
