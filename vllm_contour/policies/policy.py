"""A policy = scorer + allocator + selector + the tokens every head always keeps (sinks, recent window)."""

from __future__ import annotations

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

    @property
    def needs_queries(self) -> bool:
        return bool(getattr(self.scorer, "needs_queries", False))

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
        """The layer's page budget; allocators with a layer schedule (PyramidKV) override it."""
        fn = getattr(self.allocator, "layer_total_pages", None)
        return int(fn(base_total, inp)) if fn is not None else base_total

    def plan_layer(self, inp: LayerInputs, total_pages: int) -> Selection:
        h, rp = inp.num_kv_heads, inp.num_region_pages
        if rp == 0:
            return Selection([torch.empty(0, dtype=torch.int64) for _ in range(h)])
        total_pages = self.layer_total_pages(total_pages, inp)
        scores = self.scorer.score(inp).to(torch.float32)
        if scores.shape != (h, inp.region_len):
            raise ValueError(f"scorer {type(self.scorer).__name__} returned {tuple(scores.shape)}, "
                             f"expected {(h, inp.region_len)}")
        forced = self.forced_mask(inp)
        budget = LayerBudget(total_pages=total_pages, floor_pages=self.floor_pages(inp))
        pages = self.allocator.allocate(scores, inp, budget)
        ranked = scores.masked_fill(forced.unsqueeze(0), float("inf"))
        kept = self.selector.select(ranked, pages, inp)
        for hh, k in enumerate(kept):
            if k.numel() != int(pages[hh]) * inp.page_size:
                raise AssertionError(f"selector kept {k.numel()} tokens for head {hh}, "
                                     f"expected {int(pages[hh]) * inp.page_size}")
        return Selection(kept=kept)
