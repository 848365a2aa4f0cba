"""Uniform allocation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LayerBudget, LayerInputs
from .common import clamp_total, distribute_pages


@dataclass
class UniformAllocator:
    """Same number of pages for every head (remainder to the lowest head indices)."""

    def allocate(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        h, rp = inp.num_kv_heads, inp.num_region_pages
        total, floor = clamp_total(budget, h, rp)
        return distribute_pages(torch.ones(h), total, floor, rp)
