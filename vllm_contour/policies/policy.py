"""A policy = scorer + allocator + selector + the tokens every head always keeps (sinks, recent window).

Optionally the allocator looks at different scores than the selector (``alloc_scorer``): e.g. ContourKV
with key-norm ranking splits the layer's pages by window-attention mass but picks tokens by key norm.

Two entry points, one pipeline. ``plan_layer`` sees one layer whose heads share their candidates (a
prompt: every head may keep any token of the region). ``plan_layer_ragged`` sees one layer whose heads
have different candidates (a decode-time round: head h looks at its own kept tokens plus the new tail):
each head is scored on its own (a scorer only ever sees one head's keys, with their original
positions), then the scores are padded into one ``[H, N]`` row set and allocated and selected together.
Scorers are per KV head, so both give the same result when the heads' candidates are the same.
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

    @property
    def accumulates(self) -> bool:
        """True when the ranking scorer carries its scores into the next round (H2O)."""
        return bool(getattr(self.scorer, "accumulates", False))

    def forced_mask(self, inp: LayerInputs) -> torch.Tensor:
        """``[region_len]`` bool: sinks (positions below ``sink_tokens``) and the recency window (the last
        ``recent_window`` positions before the context end) among the region's candidates. Every head
        keeps them."""
        r = inp.region_len
        all_pos = inp.token_positions
        pos = all_pos[:r]
        end = min(inp.context_end, int(all_pos[-1]) + 1) if all_pos.numel() else 0
        return (pos < self.sink_tokens) | ((pos >= end - self.recent_window) & (pos < end))

    def floor_pages(self, inp: LayerInputs) -> int:
        """Pages every head needs to hold its forced tokens (at least one)."""
        forced = int(self.forced_mask(inp).sum())
        return min(inp.num_region_pages, max(1, math.ceil(forced / inp.page_size)))

    def layer_total_pages(self, base_total: int, inp: LayerInputs, floor: int | None = None) -> int:
        """The layer's page budget; allocators with a layer schedule (PyramidKV) override it. A schedule
        that accepts ``min_total``/``max_total`` is told the heads' floors and the most the layer may
        hold (the base, or less when the candidates hold less)."""
        fn = getattr(self.allocator, "layer_total_pages", None)
        if fn is None:
            return base_total
        params = inspect.signature(fn).parameters
        if "min_total" in params and "max_total" in params:
            floor = self.floor_pages(inp) if floor is None else floor
            cap = min(base_total, int(inp.head_caps().sum()))
            return int(fn(base_total, inp, min_total=floor * inp.num_kv_heads, max_total=cap))
        return int(fn(base_total, inp))

    def plan_layer(self, inp: LayerInputs, total_pages: int) -> Selection:
        """One layer whose heads share the candidates ``[0, region_len)``."""
        h, rp = inp.num_kv_heads, inp.num_region_pages
        if rp == 0:
            return Selection([torch.empty(0, dtype=torch.int64) for _ in range(h)])
        forced = self.forced_mask(inp)
        floor = self.floor_pages(inp)
        total_pages = self.layer_total_pages(total_pages, inp, floor)
        inp = dataclasses.replace(inp, budget_pages=total_pages)
        scores = self._score(self.scorer, inp)
        alloc_scores = scores if self.alloc_scorer is None else self._score(self.alloc_scorer, inp)
        return self._allocate_select(inp, scores, alloc_scores, forced, floor, total_pages)

    def plan_layer_ragged(self, heads: list[LayerInputs], total_pages: int) -> Selection:
        """One layer whose heads have their own candidates: ``heads[h]`` is a one-KV-head input (its keys
        with their positions, its GQA group's window queries, ``region_len`` = its candidates, a whole
        number of pages). Returns kept indices into each head's own candidates."""
        h = len(heads)
        caps = torch.tensor([x.num_region_pages for x in heads], dtype=torch.int64)
        rmax = int(caps.max()) * heads[0].page_size
        if rmax == 0:
            return Selection([torch.empty(0, dtype=torch.int64) for _ in range(h)])
        forced_h = [self.forced_mask(x) for x in heads]
        floor = max(self.floor_pages(x) for x in heads)
        head0 = heads[0]
        d = head0.head_dim
        keys = torch.zeros((h, rmax, d), dtype=head0.keys.dtype)
        values = torch.zeros((h, rmax, d), dtype=head0.values.dtype)
        forced = torch.zeros((h, rmax), dtype=torch.bool)
        prior = None if all(x.prior is None for x in heads) else torch.zeros((h, rmax))
        for i, x in enumerate(heads):
            r = x.region_len
            keys[i, :r] = x.keys[0, :r]
            values[i, :r] = x.values[0, :r]
            forced[i, :r] = forced_h[i]
            if prior is not None and x.prior is not None:
                prior[i, :r] = x.prior[0, :r]
        layer = LayerInputs(keys=keys, values=values, region_len=rmax, page_size=head0.page_size,
                            layer_idx=head0.layer_idx, num_layers=head0.num_layers, scale=head0.scale,
                            prior=prior, head_pages=caps)
        total_pages = self.layer_total_pages(total_pages, layer, floor)
        layer = dataclasses.replace(layer, budget_pages=total_pages)
        heads = [dataclasses.replace(x, budget_pages=total_pages * x.num_region_pages // max(1, int(caps.sum())))
                 for x in heads]
        scores = self._score_heads(self.scorer, heads, rmax)
        alloc_scores = scores if self.alloc_scorer is None else self._score_heads(self.alloc_scorer, heads, rmax)
        return self._allocate_select(layer, scores, alloc_scores, forced, floor, total_pages)

    def _allocate_select(self, inp: LayerInputs, scores: torch.Tensor, alloc_scores: torch.Tensor,
                         forced: torch.Tensor, floor: int, total_pages: int) -> Selection:
        budget = LayerBudget(total_pages=total_pages, floor_pages=floor, forced=forced)
        pages = self.allocator.allocate(alloc_scores, inp, budget)
        caps = inp.head_caps()
        if bool((pages > caps).any()) or bool((pages < 0).any()):
            raise AssertionError(f"allocator gave pages {pages.tolist()} outside the heads' candidates "
                                 f"{caps.tolist()}")
        forced2 = forced if forced.dim() == 2 else forced.unsqueeze(0).expand_as(scores)
        ranked = scores.masked_fill(forced2, float("inf"))
        if inp.is_ragged:
            # padding never wins over a candidate, whatever the candidate scored
            valid = inp.candidate_mask()
            finite_min = torch.finfo(ranked.dtype).min
            ranked = torch.where(valid, ranked.nan_to_num(nan=finite_min, neginf=finite_min),
                                 torch.full_like(ranked, -float("inf")))
        kept = self.selector.select(ranked, pages, inp)
        for hh, k in enumerate(kept):
            if k.numel() != int(pages[hh]) * inp.page_size:
                raise AssertionError(f"selector kept {k.numel()} tokens for head {hh}, "
                                     f"expected {int(pages[hh]) * inp.page_size}")
            if k.numel() and int(k.max()) >= int(caps[hh]) * inp.page_size:
                raise AssertionError(f"selector kept a padding entry of head {hh}")
        return Selection(kept=kept, scores=[scores[hh, k] for hh, k in enumerate(kept)])

    @staticmethod
    def _score(scorer: Scorer, inp: LayerInputs) -> torch.Tensor:
        scores = scorer.score(inp).to(torch.float32)
        if scores.shape != (inp.num_kv_heads, inp.region_len):
            raise ValueError(f"scorer {type(scorer).__name__} returned {tuple(scores.shape)}, "
                             f"expected {(inp.num_kv_heads, inp.region_len)}")
        return scores

    @classmethod
    def _score_heads(cls, scorer: Scorer, heads: list[LayerInputs], width: int) -> torch.Tensor:
        out = torch.full((len(heads), width), -float("inf"))
        for i, x in enumerate(heads):
            if x.region_len:
                out[i, : x.region_len] = cls._score(scorer, x)[0]
        return out
