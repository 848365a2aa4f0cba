"""Plain top-k selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import LayerInputs, Selector


@dataclass
class TopKSelector(Selector):
    """Plain top-k per head (ties to the lower token index): ``common.topk_indices`` of every row, as one sort
    of all rows."""

    rowwise: ClassVar[bool] = True

    def select(self, scores: torch.Tensor, pages: torch.Tensor, inp: LayerInputs) -> list[torch.Tensor]:
        k = pages.to(torch.int64).view(-1, 1) * inp.page_size
        n = scores.shape[1]
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(n).expand_as(order))
        keep = rank < k  # the first k of each row's stable descending order
        return list(torch.split(keep.nonzero()[:, 1], keep.sum(dim=1).tolist()))
