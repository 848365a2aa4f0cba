"""The policy pipeline over the rows of one or several requests: score -> allocate -> select.

Rows ``[l * H, (l + 1) * H)`` of a request's input are its layer ``layer_idx + l``. Each request's rows
are scored on their own (one scorer call per request: scorers work per KV head, and a request's window
queries and context end are its own). Allocation runs per (request, layer), in one call over all of them
when the allocator splits pages by the heads' candidates alone (``Allocator.candidates_only``); a rowwise
selector sees every request's rows in one call (padding past a request's region ranks last). So several
requests planned together keep exactly what each keeps planned alone, with the per-layer Python paid once.
It takes the components and the forced tokens (sinks, recent window) as they are, reads only what their
interfaces declare (``base``), and calls nothing of ``Policy``, which calls it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .base import Allocator, LayerBudget, LayerInputs, Scorer, Selection, Selector


@dataclass
class _Rows:
    """One request's rows after scoring."""

    inp: LayerInputs
    h: int
    floors: list[int]
    totals: list[int]  # head-pages of each layer (after any layer schedule)
    forced: torch.Tensor  # [L * H, region_len]
    scores: torch.Tensor
    alloc_scores: torch.Tensor
    views: dict[int, LayerInputs] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.totals)

    def view(self, layer: int) -> LayerInputs:
        """What an allocator or a selector sees of one layer (built when one asks)."""
        if layer not in self.views:
            self.views[layer] = dataclasses.replace(layer_view(self.inp, layer, self.h),
                                                    budget_pages=self.totals[layer])
        return self.views[layer]


def plan_requests(inputs: list[LayerInputs], totals: list[list[int]], heads_per_layer: int, *, scorer: Scorer,
                  allocator: Allocator, selector: Selector, alloc_scorer: Scorer | None, sink_tokens: int,
                  recent_window: int) -> list[list[Selection]]:
    """Request r (``inputs[r]``, rows of ``len(totals[r])`` layers) keeps ``totals[r][l]`` head-pages in
    its layer l (before any layer schedule); every head keeps its first ``sink_tokens`` positions and the last
    ``recent_window`` before the context end (``forced_mask``). -> each request's selections, layer by layer."""
    h = heads_per_layer
    live = []
    for inp, t in zip(inputs, totals):
        if inp.num_kv_heads != h * len(t):
            raise ValueError(f"{inp.num_kv_heads} rows for {len(t)} layers of {h} heads")
        if inp.region_len:
            forced = forced_mask(inp, sink_tokens, recent_window)
            floors = layer_floors(forced, inp, len(t))
            live.append(_score(inp, h, forced, floors, layer_totals(allocator, t, inp, h, floors), scorer,
                               alloc_scorer))
    pages = _allocate(allocator, live)
    kept = _select(selector, live, pages)
    out, it = [], iter(zip(live, pages, kept))
    for inp, t in zip(inputs, totals):
        if inp.region_len == 0:
            out.append([Selection([torch.empty(0, dtype=torch.int64) for _ in range(h)]) for _ in t])
            continue
        r, p, k = next(it)
        _check(p, k, inp)
        out.append([Selection(kept=k[layer * h:(layer + 1) * h],
                              scores=[r.scores[i, k[i]] for i in range(layer * h, (layer + 1) * h)]
                              if scorer.accumulates else None)
                    for layer in range(r.n_layers)])
    return out


def forced_mask(inp: LayerInputs, sink_tokens: int, recent_window: int) -> torch.Tensor:
    """``[H, region_len]`` bool: sinks (positions below ``sink_tokens``) and the recency window (the last
    ``recent_window`` positions before the context end) among the region's candidates. Every head keeps them."""
    pos = inp.key_positions()
    real = pos[inp.key_mask()]
    end = min(inp.context_end, int(real.max()) + 1) if real.numel() else 0
    pos = pos[:, :inp.region_len]
    return ((pos < sink_tokens) | ((pos >= end - recent_window) & (pos < end))) & inp.candidate_mask()


def layer_totals(allocator: Allocator, totals: list[int], inp: LayerInputs, h: int, floors: list[int]) -> list[int]:
    """Each layer's head-pages after the allocator's layer schedule (``Allocator.layer_total_pages``): layer l
    (rows ``[l * H, (l + 1) * H)``) is told its heads' floors and the most it may hold (its base, or less when
    its candidates hold less)."""
    caps = inp.head_caps().view(len(totals), h).sum(dim=1).tolist()
    return [int(allocator.layer_total_pages(t, inp.layer_idx + layer, inp.num_layers, f * h, min(t, c)))
            for layer, (t, f, c) in enumerate(zip(totals, floors, caps))]


def _score(inp: LayerInputs, h: int, forced: torch.Tensor, floors: list[int], totals: list[int], scorer: Scorer,
           alloc_scorer: Scorer | None) -> _Rows:
    share = torch.tensor([t // h for t in totals], dtype=torch.int64).repeat_interleave(h)
    scored = dataclasses.replace(inp, budget_pages=share)
    scores = _run_scorer(scorer, scored)
    alloc = scores if alloc_scorer is None else _run_scorer(alloc_scorer, scored)
    return _Rows(inp, h, floors, totals, forced, scores, alloc)


def _allocate(allocator: Allocator, rows: list[_Rows]) -> list[torch.Tensor]:
    """``[L * H]`` pages of each request."""
    if allocator.candidates_only and rows:  # one call over every (request, layer)
        h = rows[0].h
        caps = torch.cat([r.inp.head_caps() for r in rows]).view(-1, h)
        totals = torch.tensor([t for r in rows for t in r.totals], dtype=torch.int64)
        floors = torch.tensor([f for r in rows for f in r.floors], dtype=torch.int64)
        pages = allocator.allocate_groups(caps, totals, floors)
        return list(torch.split(pages.reshape(-1), [r.inp.num_kv_heads for r in rows]))
    out = []
    for r in rows:
        per_layer = []
        for layer in range(r.n_layers):
            sl = slice(layer * r.h, (layer + 1) * r.h)
            budget = LayerBudget(total_pages=r.totals[layer], floor_pages=r.floors[layer], forced=r.forced[sl])
            per_layer.append(allocator.allocate(r.alloc_scores[sl], r.view(layer), budget))
        out.append(torch.cat(per_layer))
    return out


def _select(selector: Selector, rows: list[_Rows], pages: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each request's kept indices, row by row."""
    ranked = [_ranked(r.scores, r.forced, r.inp) for r in rows]
    if selector.rowwise and rows:  # every request's rows in one call
        width = max(x.shape[1] for x in ranked)
        padded = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-float("inf")) for x in ranked])
        kept = selector.select(padded, torch.cat(pages), rows[0].inp)
        out, a = [], 0
        for r in rows:
            out.append(kept[a:a + r.inp.num_kv_heads])
            a += r.inp.num_kv_heads
        return out
    return [[k for layer in range(r.n_layers)
             for k in selector.select(x[layer * r.h:(layer + 1) * r.h], p[layer * r.h:(layer + 1) * r.h],
                                      r.view(layer))]
            for r, x, p in zip(rows, ranked, pages)]


def layer_floors(forced: torch.Tensor, inp: LayerInputs, n_layers: int) -> list[int]:
    """Each layer's floor (rows ``[l * H, (l + 1) * H)``): the pages its most-forced head needs, at least
    one, at most its widest head's candidates."""
    if not inp.num_kv_heads:
        return [0] * n_layers
    h = inp.num_kv_heads // n_layers
    need = forced.sum(dim=1).view(n_layers, h).amax(dim=1).tolist() if forced.numel() else [0] * n_layers
    caps = inp.head_caps().view(n_layers, h).amax(dim=1).tolist()
    return [min(c, max(1, math.ceil(n / inp.page_size))) for n, c in zip(need, caps)]


def _run_scorer(scorer: Scorer, inp: LayerInputs) -> torch.Tensor:
    scores = scorer.score(inp).to(torch.float32)
    if scores.shape != (inp.num_kv_heads, inp.region_len):
        raise ValueError(f"scorer {type(scorer).__name__} returned {tuple(scores.shape)}, "
                         f"expected {(inp.num_kv_heads, inp.region_len)}")
    return scores


def _ranked(scores: torch.Tensor, forced: torch.Tensor, inp: LayerInputs) -> torch.Tensor:
    """What the selector ranks: forced tokens first; in a ragged input padding last, whatever a candidate
    scored."""
    ranked = scores.masked_fill(forced, float("inf"))
    if inp.is_ragged:
        finite_min = torch.finfo(ranked.dtype).min
        ranked = torch.where(inp.candidate_mask(), ranked.nan_to_num(nan=finite_min, posinf=float("inf"), neginf=finite_min),
                             torch.full_like(ranked, -float("inf")))
    return ranked


def _check(pages: torch.Tensor, kept: list[torch.Tensor], inp: LayerInputs) -> None:
    """Every row's pages within its candidates, and the selector kept exactly that many of them."""
    caps = inp.head_caps()
    if bool((pages > caps).any()) or bool((pages < 0).any()):
        raise AssertionError(f"allocator gave pages {pages.tolist()} outside the heads' candidates "
                             f"{caps.tolist()}")
    counts = torch.tensor([k.numel() for k in kept], dtype=torch.int64)
    if not torch.equal(counts, pages.to(torch.int64) * inp.page_size):
        raise AssertionError(f"selector kept {counts.tolist()} tokens per row, expected "
                             f"{(pages * inp.page_size).tolist()}")
    if counts.sum() and bool((torch.cat(kept) >= (caps * inp.page_size).repeat_interleave(counts)).any()):
        raise AssertionError("selector kept a padding entry")


def layer_view(inp: LayerInputs, layer: int, h: int) -> LayerInputs:
    """Rows of one layer of a multi-layer input (what allocators and selectors see)."""
    rows = slice(layer * h, (layer + 1) * h)

    def sl(x):
        return None if x is None else (x[rows] if x.dim() >= 2 or x.shape[0] == inp.num_kv_heads else x)

    pos = inp.positions
    if pos is not None and pos.dim() == 2:
        pos = pos[rows]
    return dataclasses.replace(inp, keys=inp.keys[rows], values=inp.values[rows], positions=pos,
                               prior=sl(inp.prior), reconstruction=sl(inp.reconstruction),
                               head_pages=None if inp.head_pages is None else inp.head_pages[rows],
                               valid=None if inp.valid is None else inp.valid[rows], queries=None,
                               query_positions=None, budget_pages=None, layer_idx=inp.layer_idx + layer)
