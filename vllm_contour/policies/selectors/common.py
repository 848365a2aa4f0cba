"""Shared selector helpers."""

from __future__ import annotations

import torch


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the ``k`` highest scores of a 1-D tensor; ties broken by lower index
    (a stable descending sort), so the result is deterministic."""
    if k >= scores.numel():
        return torch.arange(scores.numel(), dtype=torch.int64)
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values
