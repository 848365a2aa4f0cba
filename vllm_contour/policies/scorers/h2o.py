"""H2O heavy hitters: accumulated attention mass ("top-mass")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import LayerInputs, Scorer
from .common import window_mass


@dataclass
class H2OScorer(Scorer):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models", NeurIPS 2023): a token's score is the attention mass accumulated over the queries that have
    looked at it ("heavy hitters"). H2O accumulates over every query seen so far; the engine only
    captures the observation window, so here the mass is accumulated over the captured window queries
    that lie inside the scoring context (like SnapKV without the pooling), averaged over the query heads
    of a GQA group. During decoding (``accumulates``) a kept token carries its score into the next round
    (``LayerInputs.prior``), so its mass is accumulated over every round's window, as H2O accumulates
    over steps. This is also the "top-mass" signal of ContourKV: top-k of these scores keeps the most
    window-attention mass."""

    needs_queries: ClassVar[bool] = True
    accumulates: ClassVar[bool] = True

    def score(self, inp: LayerInputs) -> torch.Tensor:
        mass = window_mass(inp)
        return mass if inp.prior is None else mass + inp.prior.to(mass.dtype)

