"""Uniform allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import Allocator, LayerBudget, LayerInputs
from .common import clamp_total, distribute_pages


@dataclass
class UniformAllocator(Allocator):
    """Same number of pages for every head (remainder to the lowest head indices)."""

    candidates_only: ClassVar[bool] = True

    def allocate(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        caps = inp.head_caps()
        total, floor = clamp_total(budget, caps)
        return distribute_pages(torch.ones(inp.num_kv_heads), total, floor, caps)

    def allocate_groups(self, caps: torch.Tensor, totals: torch.Tensor, floors: torch.Tensor) -> torch.Tensor:
        """``allocate`` of many layers at once: group g (``caps[g]``: its heads' candidate pages, ``[G, H]``)
        keeps ``totals[g]`` pages with ``floors[g]`` per head; -> ``[G, H]``, exactly ``allocate``'s split
        (``distribute_pages`` with equal weights, its float arithmetic included)."""
        caps = caps.to(torch.int64)
        h = caps.shape[1]
        floor = torch.minimum(floors.to(torch.int64).clamp_min(0), caps.amin(dim=1))
        total = torch.minimum(torch.maximum(totals.to(torch.int64), floor * h), caps.sum(dim=1))
        pages = floor.view(-1, 1).expand_as(caps).clone()
        remaining = total - floor * h
        open_ = pages < caps
        for _ in range(h + 1):  # each pass fills some heads to their caps, or shares out the rest
            n_open = open_.sum(dim=1)
            active = (remaining > 0) & (n_open > 0)
            if not bool(active.any()):
                break
            share = (1.0 / n_open.clamp_min(1).to(torch.float64)) * remaining.to(torch.float64)
            over = open_ & active.view(-1, 1) & (share.view(-1, 1) >= (caps - pages).to(torch.float64))
            filled = over.any(dim=1)
            remaining = remaining - torch.where(over, caps - pages, 0).sum(dim=1)
            pages = torch.where(over, caps, pages)
            open_ = open_ & ~over
            last = active & ~filled  # equal shares' integer parts, the leftovers to the lowest open heads
            base = torch.floor(share).to(torch.int64)
            rank = open_.to(torch.int64).cumsum(dim=1) - 1
            left = remaining - n_open * base
            add = torch.where(open_, base.view(-1, 1) + (rank < left.view(-1, 1)).to(torch.int64), 0)
            pages = torch.where(last.view(-1, 1), pages + add, pages)
            remaining = torch.where(last, 0, remaining)
        return pages
