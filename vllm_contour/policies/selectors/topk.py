"""Plain top-k selection."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LayerInputs
from .common import topk_indices


@dataclass
class TopKSelector:
    """Plain top-k per head (ties to the lower token index)."""

    def select(self, scores: torch.Tensor, pages: torch.Tensor, inp: LayerInputs) -> list[torch.Tensor]:
        bs = inp.page_size
        return [topk_indices(scores[h], int(pages[h]) * bs) for h in range(scores.shape[0])]
