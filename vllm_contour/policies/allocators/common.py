"""Shared allocator helpers: clip a layer budget, split pages in proportion to weights.

Every allocator returns ``[H]`` int64 pages with ``floor <= pages[h] <= cap[h]`` and
``sum(pages) == min(total, sum(cap))`` (never below ``H * floor``), where ``cap[h]`` is head h's
candidate pages (``LayerInputs.head_caps()``: the whole region, or its own kept pages plus the new tail
in a decode-time round).
"""

from __future__ import annotations

import torch

from ..base import LayerBudget


def clamp_total(budget: LayerBudget, caps: torch.Tensor) -> tuple[int, int]:
    """(total, floor) after clipping to what the heads' candidates can hold."""
    caps = caps.to(torch.int64)
    floor = max(0, min(budget.floor_pages, int(caps.min())))
    total = max(budget.total_pages, floor * caps.numel())
    total = min(total, int(caps.sum()))
    return total, floor


def distribute_pages(weights: torch.Tensor, total: int, floor: int, cap: int | torch.Tensor) -> torch.Tensor:
    """Largest-remainder split of ``total`` pages in proportion to ``weights`` ([H], >= 0), with every
    head in [floor, cap] (``cap`` an int or ``[H]``): every head starts at ``floor``; the rest is shared
    in proportion to the weights; heads whose share would pass their cap are set to it and the others
    re-share what is left; finally the integer parts are handed out and the leftover pages go to the
    largest fractional parts. Deterministic: ties go to the lower head index. All-zero weights share
    equally."""
    h = weights.numel()
    caps = torch.as_tensor(cap, dtype=torch.int64).expand(h).clone()
    floor = min(floor, int(caps.min()))
    total = max(min(total, int(caps.sum())), floor * h)
    pages = torch.full((h,), floor, dtype=torch.int64)
    remaining = total - floor * h
    w = torch.nan_to_num(weights.detach().to(torch.float64).cpu(), nan=0.0, posinf=0.0).clamp_min(0)
    open_ = pages < caps
    while remaining > 0 and bool(open_.any()):
        ww = torch.where(open_, w, torch.zeros_like(w))
        if float(ww.sum()) <= 0:
            ww = open_.to(torch.float64)
        share = ww / ww.sum() * remaining
        room = (caps - pages).to(torch.float64)
        over = open_ & (share >= room)
        if bool(over.any()):
            remaining -= int((caps - pages)[over].sum())
            pages[over] = caps[over]
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
