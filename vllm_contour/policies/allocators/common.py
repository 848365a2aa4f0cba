"""Shared allocator helpers: clip a layer budget, split pages in proportion to weights.

Every allocator returns ``[H]`` int64 pages with ``floor <= pages[h] <= region_pages`` and
``sum(pages) == min(total, H * region_pages)`` (never below ``H * floor``).
"""

from __future__ import annotations

import torch

from ..base import LayerBudget


def clamp_total(budget: LayerBudget, num_heads: int, region_pages: int) -> tuple[int, int]:
    """(total, floor) after clipping to what the region can hold."""
    floor = max(0, min(budget.floor_pages, region_pages))
    total = max(budget.total_pages, floor * num_heads)
    total = min(total, region_pages * num_heads)
    return total, floor


def distribute_pages(weights: torch.Tensor, total: int, floor: int, cap: int) -> torch.Tensor:
    """Largest-remainder split of ``total`` pages in proportion to ``weights`` ([H], >= 0), with every
    head in [floor, cap]: every head starts at ``floor``; the rest is shared in proportion to the
    weights; heads whose share would pass ``cap`` are set to ``cap`` and the others re-share what is
    left; finally the integer parts are handed out and the leftover pages go to the largest fractional
    parts. Deterministic: ties go to the lower head index. All-zero weights share equally."""
    h = weights.numel()
    total = max(min(total, cap * h), floor * h)
    pages = torch.full((h,), floor, dtype=torch.int64)
    remaining = total - floor * h
    w = torch.nan_to_num(weights.detach().to(torch.float64).cpu(), nan=0.0, posinf=0.0).clamp_min(0)
    open_ = pages < cap
    while remaining > 0 and bool(open_.any()):
        ww = torch.where(open_, w, torch.zeros_like(w))
        if float(ww.sum()) <= 0:
            ww = open_.to(torch.float64)
        share = ww / ww.sum() * remaining
        room = (cap - pages).to(torch.float64)
        over = open_ & (share >= room)
        if bool(over.any()):
            remaining -= int((cap - pages)[over].sum())
            pages[over] = cap
            open_ &= ~over
            continue
        base = share.floor().to(torch.int64)
        pages += base
        left = remaining - int(base.sum())
        frac = torch.where(open_, share - base.to(torch.float64), torch.full_like(share, -1.0))
        order = torch.sort(frac, descending=True, stable=True).indices[:left]
        pages[order] += 1
        remaining = 0
    return pages
