"""StreamingLLM recency scorer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LayerInputs, Scorer


@dataclass
class RecencyScorer(Scorer):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024):
    keep the attention sinks and the most recent tokens. The sinks and the recent window are forced by
    the policy; beyond them, newer tokens score higher."""


    def score(self, inp: LayerInputs) -> torch.Tensor:
        return inp.key_positions()[:, : inp.region_len].to(torch.float32)
