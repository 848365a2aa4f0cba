"""PyramidKV layer schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch

from ..base import Allocator, LayerBudget, LayerInputs
from .common import distribute_pages
from .uniform import UniformAllocator


def pyramid_schedule(base_total: int, num_layers: int, beta: float, min_total: int = 0,
                     max_total: int | None = None) -> torch.Tensor:
    """``[L]`` int64 page totals: an arithmetic sequence decreasing with depth whose sum is exactly
    ``base_total * L`` (so the mean is the base). Relative to the base, the top layer gets ``1/beta``
    and the bottom layer ``2 - 1/beta`` (PyramidKV's ``min_num = k / beta``, ``max_num = 2k - min_num``).

    Layers are kept within ``[min_total, max_total]`` (the heads' recency floors and what the region can
    hold): a clipped layer's surplus/deficit is taken from/given to the unclipped layers in proportion
    to their schedule weights, so the sum stays ``base_total * L`` whenever that is feasible. Integer
    rounding by largest remainder, ties to the lower layer."""
    if beta < 1.0:
        raise ValueError(f"pyramid beta must be >= 1 (1 = flat), got {beta}")
    num_layers = max(1, int(num_layers))
    base_total = max(0, int(base_total))
    lo = max(0, int(min_total))
    total = base_total * num_layers
    hi = max(lo, total if max_total is None else int(max_total))
    lo_r, hi_r = 1.0 / beta, 2.0 - 1.0 / beta
    layer = torch.arange(num_layers, dtype=torch.float64)
    w = hi_r - (hi_r - lo_r) * layer / max(1, num_layers - 1) if num_layers > 1 else torch.ones(1, dtype=torch.float64)
    x = w * base_total
    for _ in range(num_layers + 1):
        x = x.clamp(lo, hi)
        diff = total - float(x.sum())
        if abs(diff) < 1e-9:
            break
        free = x < hi if diff > 0 else x > lo
        if not bool(free.any()):
            break
        x = torch.where(free, x + diff * w / float(w[free].sum()), x)
    if float(x.sum()) <= lo * num_layers or float(x.sum()) >= hi * num_layers:
        return x.round().to(torch.int64).clamp(lo, hi)
    return distribute_pages(x - lo, int(round(float(x.sum()))), lo, hi)


@dataclass
class PyramidAllocator(Allocator):
    """PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
    Funneling", 2024): lower layers attend broadly and get more cache, upper layers attend to few tokens
    and get less. Layer l's page total follows ``pyramid_schedule`` (arithmetic; ``beta`` >= 1 sets the
    slope: top layer = bottom / (2 beta - 1); beta = 1 is flat; PyramidKV's code uses 20). Implemented
    through ``layer_total_pages`` (``base.Allocator``'s layer schedule), which the planner calls before
    allocating; inside the layer the pages are split by ``inner`` (uniform by default, as in PyramidKV).

    Where this differs from the paper: the paper's schedule has the budget as its MEAN over layers. In
    vLLM's paged pool a block holds every layer, so the bytes a request holds are set by its LARGEST
    layer; with the paper's schedule a request would hold almost twice its budget. Here the largest
    (bottom) layer gets the layer's budget and the others less, so the bytes held are the budget and the
    layers keep ``(1 + 1/(2 beta - 1)) / 2`` of it on average (about half at beta = 20).
    """

    beta: float = 20.0
    inner: Allocator = field(default_factory=UniformAllocator)

    def __post_init__(self):
        if not isinstance(self.inner, Allocator):
            raise TypeError(f"pyramid inner {type(self.inner).__name__} does not subclass policies.base.Allocator")

    @property
    def needs_queries(self) -> bool:
        return self.inner.needs_queries

    @property
    def needs_values(self) -> bool:
        return self.inner.needs_values

    def layer_total_pages(self, base_total: int, layer_idx: int, num_layers: int, min_total: int,
                          max_total: int) -> int:
        if self.beta < 1.0:
            raise ValueError(f"pyramid beta must be >= 1 (1 = flat), got {self.beta}")
        cap = min(base_total, max_total)
        n = max(1, int(num_layers))
        layer = min(max(layer_idx, 0), n - 1)
        # the schedule's shape (PyramidKV's: arithmetic from 2 - 1/beta down to 1/beta), scaled so that
        # its largest layer is the base; layers below the heads' floors are lifted to them, layers above
        # what the candidates hold keep them all
        frac = 1.0 - (1.0 - 1.0 / (2.0 * self.beta - 1.0)) * layer / max(1, n - 1)
        return int(min(cap, max(min_total, math.floor(base_total * frac + 1e-9))))

    def allocate(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        return self.inner.allocate(scores, inp, budget)
