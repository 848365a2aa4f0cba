"""One engine step's eviction data, carried the way vLLM's backends carry theirs: the metadata builder of
the evicting KV cache group makes a ``ContourStep`` from the step's batch and returns it inside the
attention metadata it builds (``StepField``); each layer's impl reads it from the metadata it is given.

Which rows are compacted requests', and which tokens fall in an observation window, also needs the
scheduler's message for the step (its row keys and captures). vLLM's KV connector hands that message to
the worker before the forward: before the metadata is built on the V1 model runner, after it on Model
Runner V2. So a step is resolved (``resolve``) once, by the builder when the message is already there,
else by the first layer that reads it. vLLM's kernel, which still runs over the whole batch, gets a short
context for the compacted rows (their output is the plugin's): from the resolved rows, or from the page
tables' prediction (``PageTables.predict``) when the builder runs before the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm_contour import ops
from vllm_contour.page_tables import CaptureWindows, StepRows

class ContourStep:
    """The batch of one step as the evicting group's builder saw it, and what it resolves to.
    ``resolve_with(step)``: the worker side's resolution (it fills ``rows``, ``capture``, ``windows``);
    ``layer_index``: the evicting layers, by name."""

    def __init__(self, resolve_with: Callable[["ContourStep"], None], layer_index: dict[str, int], cm):
        self._resolve_with, self._layer_index = resolve_with, layer_index
        self.query_start_loc = cm.query_start_loc
        self.seq_lens = cm.seq_lens
        self.block_table = cm.block_table_tensor
        self.num_reqs = cm.num_reqs
        self.num_tokens = int(cm.query_start_loc_cpu[cm.num_reqs])
        self.max_seq_len = int(cm.max_seq_len)
        self.predicted: torch.Tensor | None = None  # [B] bool: rows shortened for vLLM's kernel by prediction
        self.rows: StepRows | None = None
        self.capture: CaptureWindows | None = None
        self.windows: WindowPlan | None = None  # where the step's captured queries go
        self.staged: dict[int, torch.Tensor] = {}  # layer -> captured queries of the step [total, Hq, D]
        self.errors: dict[str, str] = {}  # requests whose output of this step is wrong
        self.resolved = False

    def layer(self, layer_name: str) -> int | None:
        """The layer's index among the evicting layers (None: not one of them)."""
        return self._layer_index.get(layer_name)

    def resolve(self) -> tuple[StepRows | None, CaptureWindows | None]:
        if not self.resolved:
            self.resolved = True
            self._resolve_with(self)
        return self.rows, self.capture

    def stock_seq_lens(self, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Lengths for vLLM's kernel: compacted rows get a context as long as their own query (their output
        is overwritten); None when no row changes."""
        b = self.num_reqs
        q_lens = self.query_start_loc[1: b + 1] - self.query_start_loc[:b]
        if self.resolved:
            if self.rows is None:
                return None
            mine = self.rows.row_req >= 0
        elif self.predicted is not None:
            mine = self.predicted
        else:
            return None
        return torch.where(mine, q_lens.to(seq_lens.dtype), seq_lens[:b])

    def mispredicted(self) -> torch.Tensor | None:
        """``[B]`` bool: rows shortened by prediction that the step's message does not make compacted (their
        vLLM output is wrong); None when nothing was predicted."""
        if self.predicted is None:
            return None
        if self.rows is None:
            return self.predicted
        return self.predicted & (self.rows.row_req < 0)

    def stage(self, layer_idx: int, q3: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """The layer's queries of the tokens that fall in an observation window (``capture``): written into
        their request's window pages at once; a hidden reconstruction request's kept until after the forward."""
        cap = self.capture
        n = cap.dst.numel()
        buf = q3.new_zeros((cap.total + 1, *q3.shape[1:]))
        buf.index_copy_(0, cap.dst, q3[:n])
        staged = buf[: cap.total]
        plan = self.windows
        if plan is None:
            return
        if plan.paged is not None:
            rows, pages, elems = plan.paged
            it = {4: torch.int32, 2: torch.int16, 1: torch.int8}[key_cache.element_size()]
            ops.write_page_elems(key_cache, value_cache, pages, elems, staged[rows].contiguous().view(it).reshape(-1))
        for win, rows, first in plan.held:
            held = win.held.get(layer_idx)
            if held is None:
                held = win.held[layer_idx] = q3.new_zeros((win.round_at - win.start, *q3.shape[1:]))
            held[first: first + rows.numel()] = staged[rows]
        if plan.keep_staged:
            self.staged[layer_idx] = staged

    def fail(self, req_ids, why: str) -> None:
        for req_id in req_ids:
            self.errors[req_id] = why


@dataclass
class WindowPlan:
    """Where one step's captured queries go, made when the step is resolved."""

    # window pages: (rows of the staged captures, head-page of each raw element, its element in the page)
    paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    held: list = field(default_factory=list)  # (window with no pages, staged rows, first window row)
    keep_staged: bool = False  # hidden reconstruction requests' captures: folded after the forward


@dataclass
class StepField:
    """Mixed into a vLLM attention metadata class: the step the builder made (None: no eviction here)."""

    contour: ContourStep | None = field(default=None, kw_only=True)


def with_step(cls, md, step: ContourStep | None):
    """``md`` (vLLM's metadata, as its builder made it) as ``cls`` (its subclass with ``StepField``)."""
    out = cls.__new__(cls)
    out.__dict__.update(md.__dict__)
    out.contour = step
    return out


def window_plan(cap: CaptureWindows, requests: dict, hidden: set[str], caches, device) -> WindowPlan:
    """Where a step's captured queries go: into their request's window pages (each raw element's head-page
    and element in it), or kept for this step's round (a window with no pages); and whether a hidden
    reconstruction request's (``hidden``) captures are staged for after the forward. ``requests``: the
    worker's request states (their ``window``); ``caches``: the worker's caches (``caches.py``)."""
    _, h, bs, d = caches.dims
    hq, _, qdt = caches.query_shape
    per_row = hq * d * qdt.itemsize // caches.shape.elem_size  # raw cache elements per query row
    per_page = 2 * bs * d
    plan = WindowPlan()
    rows, pages, elems = [], [], []
    off = 0
    for req_id, pos0, n in cap.owners:
        rs = requests.get(req_id)
        win = rs.window if rs is not None else None
        if req_id in hidden:
            plan.keep_staged = plan.keep_staged or n > 0
        elif win is not None and n > 0 and not win.pages:
            plan.held.append((win, torch.arange(off, off + n, device=device), pos0 - win.start))
            win.mark(pos0, n)
        elif win is not None and n > 0:
            ids = torch.tensor(win.pages, dtype=torch.int64).repeat_interleave(h) * h + torch.arange(h).repeat(
                len(win.pages))
            e = torch.arange((pos0 - win.start) * per_row, (pos0 - win.start + n) * per_row)
            pages.append(ids[e // per_page])
            elems.append(e % per_page)
            rows.append(torch.arange(off, off + n))
            win.mark(pos0, n)
        off += n
    if rows:
        plan.paged = (torch.cat(rows).to(device), torch.cat(pages).to(device), torch.cat(elems).to(device))
    return plan


def mispredicted(step: ContourStep, row_keys: dict[str, int], block_size: int) -> list[tuple[int, str | None]]:
    """``(row, request)`` of the rows the builder shortened by prediction that the step's message does not make
    compacted (their vLLM output is wrong), the request found by its row key (None: not found)."""
    bad = step.mispredicted()
    if bad is None or not bool(bad.any()):
        return []
    b = step.num_reqs
    qsl = step.query_start_loc[: b + 1].to(torch.int64)
    first = step.seq_lens[:b].to(torch.int64) - (qsl[1:] - qsl[:-1])
    col = (first // block_size).clamp(0, step.block_table.shape[1] - 1)
    key = step.block_table[:b].gather(1, col.view(-1, 1)).squeeze(1)
    by_key = {k: r for r, k in row_keys.items()}
    return [(row, by_key.get(int(key[row]))) for row in bad.nonzero().squeeze(1).tolist()]
