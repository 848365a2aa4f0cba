"""Allocators: split a layer's head-page budget between its KV heads.

Every allocator returns ``[H]`` int64 pages with ``floor <= pages[h] <= region_pages`` and
``sum(pages) == min(total, H * region_pages)`` (never below ``H * floor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerBudget, LayerInputs


def clamp_total(budget: LayerBudget, num_heads: int, region_pages: int) -> tuple[int, int]:
    """(total, floor) after clipping to what the region can hold."""
    floor = max(0, min(budget.floor_pages, region_pages))
    total = max(budget.total_pages, floor * num_heads)
    total = min(total, region_pages * num_heads)
    return total, floor


def distribute_pages(weights: torch.Tensor, total: int, floor: int, cap: int) -> torch.Tensor:
    """Largest-remainder split of ``total`` pages in proportion to ``weights`` ([H], >= 0), with every
    head in [floor, cap]. Deterministic: ties go to the lower head index."""
    h = weights.numel()
    total = max(min(total, cap * h), floor * h)
    pages = torch.full((h,), floor, dtype=torch.int64)
    remaining = total - floor * h
    w = weights.detach().to(torch.float64).clamp_min(0).cpu()
    # Water-filling: hand out the remaining pages proportionally, re-normalising among heads that
    # are not yet at the cap.
    while remaining > 0:
        room = cap - pages
        open_ = room > 0
        if not bool(open_.any()):
            break
        ww = torch.where(open_, w, torch.zeros_like(w))
        if float(ww.sum()) <= 0:
            ww = open_.to(torch.float64)
        share = ww / ww.sum() * remaining
        add = torch.minimum(share.floor().to(torch.int64), room)
        if int(add.sum()) == 0:
            # Hand single pages by largest fractional share (stable order on ties).
            frac = torch.where(open_, share - share.floor(), torch.full_like(share, -1.0))
            order = torch.sort(frac, descending=True, stable=True).indices
            for i in order.tolist():
                if remaining == 0:
                    break
                if pages[i] < cap:
                    pages[i] += 1
                    remaining -= 1
            continue
        pages += add
        remaining -= int(add.sum())
    return pages


@dataclass
class UniformAllocator:
    """Same number of pages for every head (remainder to the lowest head indices)."""

    def allocate(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        h, rp = inp.num_kv_heads, inp.num_region_pages
        total, floor = clamp_total(budget, h, rp)
        return distribute_pages(torch.ones(h), total, floor, rp)


@dataclass
class AdaKVAllocator:
    """Head-adaptive allocation within a layer (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by
    Adaptive Budget Allocation for Efficient LLM Inference", 2024).

    Scores of each head are normalised to sum to one (an attention-like distribution); the layer's
    token budget is the top of the flattened ``[H * region]`` normalised scores; each head's share of
    those top tokens, rounded to whole pages (largest remainder), is its budget. ``floor_pages`` per
    head is reserved first (AdaKV's safeguard ``alpha``: here a page floor).
    """

    def allocate(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        h, rp, bs = inp.num_kv_heads, inp.num_region_pages, inp.page_size
        total, floor = clamp_total(budget, h, rp)
        s = scores.to(torch.float32)
        s = torch.nan_to_num(s, nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0)
        norm = s / s.sum(dim=1, keepdim=True).clamp_min(1e-30)
        extra_tokens = (total - floor * h) * bs
        if extra_tokens <= 0:
            return distribute_pages(torch.ones(h), total, floor, rp)
        flat = norm.flatten()
        k = min(extra_tokens, flat.numel())
        top = torch.topk(flat, k, sorted=False).indices
        per_head = torch.bincount(top // norm.shape[1], minlength=h).to(torch.float64)
        return distribute_pages(per_head, total, floor, rp)
