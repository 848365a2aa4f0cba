"""SnapKV observation-window scorer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import LayerInputs, Scorer
from .common import avg_pool, window_mass


@dataclass
class SnapKVScorer(Scorer):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024): the
    attention that the last ``W`` prompt queries (the observation window) pay to each key, summed over
    the window, averaged over the query heads of a GQA group, then smoothed with a 1-D average pool of
    width ``kernel_size`` so that neighbours of important tokens are kept too."""

    kernel_size: int = 7
    needs_queries: ClassVar[bool] = True

    def score(self, inp: LayerInputs) -> torch.Tensor:
        return avg_pool(window_mass(inp), self.kernel_size, inp.candidate_mask())
