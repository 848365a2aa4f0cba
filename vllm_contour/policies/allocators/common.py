"""Shared allocator helpers: clip a layer budget, split pages in proportion to weights.

Every allocator returns ``[H]`` int64 pages with ``floor <= pages[h] <= cap[h]`` and
``sum(pages) == min(total, sum(cap))`` (never below ``H * floor``), where ``cap[h]`` is head h's
candidate pages (``LayerInputs.head_caps()``: the whole region, or its own kept pages plus the new tail
in a decode-time round).
"""

from __future__ import annotations

import math

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
    equally. (A handful of heads: plain python arithmetic, no tensor ops.)"""
    h = weights.numel()
    caps = [int(c) for c in torch.as_tensor(cap, dtype=torch.int64).expand(h).tolist()]
    floor = min(floor, min(caps))
    total = max(min(total, sum(caps)), floor * h)
    pages = [floor] * h
    remaining = total - floor * h
    w = [x if math.isfinite(x) and x > 0 else 0.0 for x in weights.detach().to(torch.float64).cpu().tolist()]
    open_ = [p < c for p, c in zip(pages, caps)]
    while remaining > 0 and any(open_):
        ww = [x if o else 0.0 for x, o in zip(w, open_)]
        tot = sum(ww)
        if tot <= 0:
            ww = [1.0 if o else 0.0 for o in open_]
            tot = sum(ww)
        share = [x / tot * remaining for x in ww]
        over = [o and sh >= c - p for o, sh, c, p in zip(open_, share, caps, pages)]
        if any(over):
            for i in range(h):
                if over[i]:
                    remaining -= caps[i] - pages[i]
                    pages[i] = caps[i]
                    open_[i] = False
            continue
        base = [math.floor(x) for x in share]
        for i in range(h):
            pages[i] += base[i]
        left = remaining - sum(base)
        frac = [(share[i] - base[i]) if open_[i] else -1.0 for i in range(h)]
        for i in sorted(range(h), key=lambda i: (-frac[i], i))[:left]:
            pages[i] += 1
        remaining = 0
    return torch.tensor(pages, dtype=torch.int64)
