"""AdaKV head-adaptive allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import Allocator, LayerBudget, LayerInputs
from .common import clamp_total, distribute_pages


@dataclass
class AdaKVAllocator(Allocator):
    """Head-adaptive allocation within a layer (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by
    Adaptive Budget Allocation for Efficient LLM Inference", 2024).

    Scores of each head are normalised to sum to one (an attention-like distribution); the layer's
    token budget is the top of the flattened ``[H * region]`` normalised scores; each head's share of
    those top tokens, rounded to whole pages (largest remainder), is its budget. ``floor_pages`` per
    head is reserved first (AdaKV's safeguard ``alpha``: here a page floor).
    """

    normalise: ClassVar[bool] = True  # each head's scores to a distribution before the layer's top-k

    def allocate(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        h, bs = inp.num_kv_heads, inp.page_size
        caps = inp.head_caps()
        total, floor = clamp_total(budget, caps)
        s = scores.to(torch.float32)
        s = torch.nan_to_num(s, nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0)
        s = torch.where(inp.candidate_mask(), s, torch.zeros_like(s))  # padding past a head's candidates: no mass
        norm = s / s.sum(dim=1, keepdim=True).clamp_min(1e-30) if self.normalise else s
        extra_tokens = (total - floor * h) * bs
        if extra_tokens <= 0:
            return distribute_pages(torch.ones(h), total, floor, caps)
        flat = norm.flatten()
        k = min(extra_tokens, flat.numel())
        top = torch.topk(flat, k, sorted=False).indices
        per_head = torch.bincount(top // norm.shape[1], minlength=h).to(torch.float64)
        return distribute_pages(per_head, total, floor, caps)
