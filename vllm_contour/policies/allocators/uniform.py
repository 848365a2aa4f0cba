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
        caps = inp.head_caps()
        total, floor = clamp_total(budget, caps)
        return distribute_pages(torch.ones(inp.num_kv_heads), total, floor, caps)
