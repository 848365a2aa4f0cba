"""Key-norm scorer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LayerInputs, Scorer


@dataclass
class KeyNormScorer(Scorer):
    """Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP
    2024: keys with a LOW L2 norm attract attention; score = -||k||. Query-free."""


    def score(self, inp: LayerInputs) -> torch.Tensor:
        k = inp.keys[:, : inp.region_len].to(torch.float32)
        return -k.norm(dim=-1)
