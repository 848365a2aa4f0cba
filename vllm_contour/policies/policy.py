"""A policy = scorer + allocator + selector + the tokens every head always keeps (sinks, recent window).

Optionally the allocator looks at different scores than the selector (``alloc_scorer``): e.g. ContourKV
with key-norm ranking splits the layer's pages by window-attention mass but picks tokens by key norm.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch

from .base import Allocator, LayerBudget, LayerInputs, Scorer, Selection, Selector


@dataclass
class Policy:
    name: str
    scorer: Scorer
    allocator: Allocator
    selector: Selector
    sink_tokens: int = 4
    recent_window: int = 32
    description: str = ""
    # Scores the allocator sees (None: the scorer's). Lets allocation and ranking use different signals.
    alloc_scorer: Scorer | None = None

    @property
    def needs_queries(self) -> bool:
        """True when any component needs the captured window queries."""
        parts = (self.scorer, self.alloc_scorer, self.selector)
        return any(bool(getattr(p, "needs_queries", False)) for p in parts if p is not None)

    def forced_mask(self, inp: LayerInputs) -> torch.Tensor:
        """``[region_len]`` bool: sinks and the recency window (ending at the context end) that lie in
        the region. Every head keeps them."""
        r = inp.region_len
        mask = torch.zeros(r, dtype=torch.bool)
        mask[: min(self.sink_tokens, r)] = True
        end = min(inp.context_end, inp.num_tokens)
        start = max(0, end - self.recent_window)
        if start < r:
            mask[start : min(end, r)] = True
        return mask

    def floor_pages(self, inp: LayerInputs) -> int:
        """Pages every head needs to hold its forced tokens (at least one)."""
        forced = int(self.forced_mask(inp).sum())
        return min(inp.num_region_pages, max(1, math.ceil(forced / inp.page_size)))

    def layer_total_pages(self, base_total: int, inp: LayerInputs) -> int:
        """The layer's page budget; allocators with a layer schedule (PyramidKV) override it. A schedule
        that accepts ``min_total``/``max_total`` is told the heads' floors and the region's capacity
        (the same for every layer of a request) so it can keep its mean at the base."""
        fn = getattr(self.allocator, "layer_total_pages", None)
        if fn is None:
            return base_total
        params = inspect.signature(fn).parameters
        if "min_total" in params and "max_total" in params:
            h = inp.num_kv_heads
            return int(fn(base_total, inp, min_total=self.floor_pages(inp) * h,
                          max_total=inp.num_region_pages * h))
        return int(fn(base_total, inp))

    def plan_layer(self, inp: LayerInputs, total_pages: int) -> Selection:
        h, rp = inp.num_kv_heads, inp.num_region_pages
        if rp == 0:
            return Selection([torch.empty(0, dtype=torch.int64) for _ in range(h)])
        total_pages = self.layer_total_pages(total_pages, inp)
        inp = dataclasses.replace(inp, budget_pages=total_pages)
        scores = self._score(self.scorer, inp)
        alloc_scores = scores if self.alloc_scorer is None else self._score(self.alloc_scorer, inp)
        forced = self.forced_mask(inp)
        budget = LayerBudget(total_pages=total_pages, floor_pages=self.floor_pages(inp), forced=forced)
        pages = self.allocator.allocate(alloc_scores, inp, budget)
        ranked = scores.masked_fill(forced.unsqueeze(0), float("inf"))
        kept = self.selector.select(ranked, pages, inp)
        for hh, k in enumerate(kept):
            if k.numel() != int(pages[hh]) * inp.page_size:
                raise AssertionError(f"selector kept {k.numel()} tokens for head {hh}, "
                                     f"expected {int(pages[hh]) * inp.page_size}")
        return Selection(kept=kept)

    @staticmethod
    def _score(scorer: Scorer, inp: LayerInputs) -> torch.Tensor:
        scores = scorer.score(inp).to(torch.float32)
        if scores.shape != (inp.num_kv_heads, inp.region_len):
            raise ValueError(f"scorer {type(scorer).__name__} returned {tuple(scores.shape)}, "
                             f"expected {(inp.num_kv_heads, inp.region_len)}")
        return scores
