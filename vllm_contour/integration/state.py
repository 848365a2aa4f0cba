"""Worker-process state shared by the worker side of the connector and the attention backend.

One ``WorkerState`` per worker process (module global). The worker side fills it (the step's round and
capture items at the start of a step, the requests' layouts after a round, mirrored into the kernel-ready
``PageTables``); the metadata builder matches the step's batch rows to them (``PageTables.step``) and
leaves the result in ``step``; the attention impl reads it to run the compacted rows and stage the
captured queries.

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

from vllm_contour.budget import PageBudget
from vllm_contour.config import RequestEviction
from vllm_contour.layout import RequestLayout
from vllm_contour.page_tables import CaptureWindows, PageTables, StepRows


@dataclass(frozen=True)
class ScoresRef:
    """A kvzip round's context scores by the context's key (``reconstruction.context_key``): ``store`` — the
    owner's own reconstruction made them, the workers keep a copy under the key; else the owner takes a copy
    of those kept from an earlier request with the same context (no reconstruction ran for it)."""

    key: str
    epoch: int  # the owner's
    store: bool


@dataclass
class RoundItem:
    """Scheduler -> worker: run an eviction round for this request after the current step's forward."""

    req_id: str
    block_ids: list[int]  # all blocks of the request, logical order (freed ones are vLLM's null block)
    num_tokens: int  # tokens with KV after this step
    params: RequestEviction
    budget: PageBudget  # the request's page budget, computed once by the scheduler side
    seq: int  # round number of the request (reports carry it back; stale ones are ignored)
    # private blocks to pack the kept pages into (some of the request's blocks are hashed for prefix caching
    # or shared with another request): the round reads the originals and writes only these; None: in place
    fresh_ids: list[int] | None = None
    # a context round whose result is shared: (entry id, partial block, its snapshot block); the worker
    # copies the partial block into the snapshot after the round and keeps the layout under the entry id
    publish: tuple[int, int | None, int | None] | None = None
    scores: ScoresRef | None = None  # a kvzip round's context scores, kept or taken by the context's key


@dataclass
class CaptureItem:
    """Scheduler -> worker: this step's tokens of the request cover part of the observation window
    ``[start, end)`` (absolute positions) of its next round; copy those queries in every layer."""

    req_id: str
    start: int
    end: int
    window: int  # queries the request's ring keeps


@dataclass
class ReconItem:
    """Scheduler -> worker: this step computes repeat tokens of a hidden request reconstructing its owner's
    context (``integration/reconstruction.py``): fold their KVzip attention over the context keys ``span``
    into the owner's scores (``[L, H, context_len]``)."""

    req_id: str  # the hidden request (its captured queries)
    owner: str
    epoch: int  # the owner's: scores of an earlier epoch are dropped
    span: tuple[int, int]
    repeat_start: int
    context_len: int
    block_ids: list[int]  # the hidden request's blocks up to its last token of the step


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


@dataclass
class StepAttention:
    """What the builder found for this step (read by every layer's impl): the compacted rows and the
    captures, matched to the batch."""

    rows: StepRows | None
    capture: CaptureWindows | None


class WorkerState:
    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self.shared: dict[int, RequestLayout] = {}  # shared compressed contexts: entry id -> layout
        self.tables: PageTables | None = None  # made when the caches are registered
        self.step_reqs: list[str] = []  # this step's compacted requests (PageTables.set_keys)
        self.step: StepAttention | None = None  # set by the eviction group's builder
        self.rounds_now: dict[str, RoundItem] = {}
        self.captures: dict[str, CaptureItem] = {}  # this step's capture items, by request
        self.recon_now: dict[str, ReconItem] = {}  # this step's hidden reconstruction requests, by request
        # owner -> (epoch, [L, H, C] KVzip scores of its context), while it runs (its later rounds read them)
        self.reconstruction: dict[str, tuple[int, torch.Tensor]] = {}
        # context key -> [L, H, C] KVzip scores kept for later requests with the same context (the scheduler
        # bounds them and names those to drop)
        self.scored: dict[str, torch.Tensor] = {}
        self.scores_dropped_now: list[str] = []  # this step's keys to drop (after its rounds)
        self.layer_index: dict[str, int] = {}
        # queries staged by the impl during this step's forward: layer -> [total, Hq, D]
        self.staged: dict[int, torch.Tensor] = {}
        # requests whose output of this step is wrong (a decode op failed for their row)
        self.forward_errors: dict[str, str] = {}
        # eviction on for this process's model: the attention impls record it when the model is built (under
        # vLLM's config), the backend reads it when vLLM later asks for the layers' KV cache specs (no config)
        self.evicting = False

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.rounds_now.pop(req_id, None)
        self.reconstruction.pop(req_id, None)
        if self.tables is not None:
            self.tables.drop(req_id)

    def state_for(self, req_id: str, epoch: int | None = None) -> RequestState:
        """The request's state; a new epoch (the request started over) replaces the old state."""
        rs = self.requests.get(req_id)
        if rs is None or (epoch is not None and rs.epoch != epoch):
            if rs is not None and self.tables is not None:
                self.tables.drop(req_id)
            rs = self.requests[req_id] = RequestState(req_id, epoch or 0)
        return rs

    def set_layout(self, req_id: str, layout: RequestLayout) -> None:
        """A request's cache is compacted as ``layout`` (after its round, or adopting a shared context)."""
        self.state_for(req_id).layout = layout
        if self.tables is not None:
            self.tables.put(req_id, layout)

    def compacted(self) -> list[str]:
        """Requests whose cache is compacted (their rows go to the compacted-attention op)."""
        return [r for r, rs in self.requests.items() if rs.layout is not None]

    def query_buffer_bytes(self) -> int:
        rings = sum(rs.ring.nbytes for rs in self.requests.values() if rs.ring is not None)
        held = sum(s.numel() * s.element_size() for _, s in self.reconstruction.values())
        return rings + held + sum(s.numel() * s.element_size() for s in self.scored.values())


_STATE = WorkerState()


def worker_state() -> WorkerState:
    return _STATE
