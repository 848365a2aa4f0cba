"""Selectors: given per-token scores and per-head page counts, choose the kept tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerInputs


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the ``k`` highest scores of a 1-D tensor; ties broken by lower index
    (a stable descending sort), so the result is deterministic."""
    if k >= scores.numel():
        return torch.arange(scores.numel(), dtype=torch.int64)
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


@dataclass
class TopKSelector:
    """Plain top-k per head."""

    def select(self, scores: torch.Tensor, pages: torch.Tensor, inp: LayerInputs) -> list[torch.Tensor]:
        bs = inp.page_size
        return [topk_indices(scores[h], int(pages[h]) * bs) for h in range(scores.shape[0])]
