"""A policy = scorer + allocator + selector + the tokens every head always keeps (sinks, recent window).

Optionally the allocator looks at different scores than the selector (``alloc_scorer``): e.g. ContourKV
with key-norm ranking splits the layer's pages by window-attention mass but picks tokens by key norm.

Two entry points, one pipeline. ``plan_layer`` sees one layer whose heads share their candidates (a
prompt: every head may keep any token of the region). ``plan_layer_ragged`` sees one layer whose heads
have different candidates (a decode-time round: head h looks at its own kept tokens plus the new tail):
each head is scored on its own (a scorer only ever sees one head's keys, with their original
positions), then the scores are padded into one ``[H, N]`` row set and allocated and selected together.
Scorers are per KV head, so both give the same result when the heads' candidates are the same.
``plan_rows`` (every layer of a request) and ``plan_requests`` (several requests) run the pipeline in
``planner``; the calls go one way, from here to there. A Policy's capabilities are its components', as their
interfaces declare them (``base``); it refuses a component that does not subclass its interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import planner
from .base import Allocator, Component, LayerInputs, ModelIdentity, Scorer, Selection, Selector


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

    def __post_init__(self):
        for role, part, kind in (("scorer", self.scorer, Scorer), ("allocator", self.allocator, Allocator),
                                 ("selector", self.selector, Selector), ("alloc_scorer", self.alloc_scorer, Scorer)):
            if not isinstance(part, kind) and not (role == "alloc_scorer" and part is None):
                raise TypeError(f"policy {self.name!r}: {role} {type(part).__name__} does not subclass "
                                f"vllm_contour.policies.base.{kind.__name__} (the interface that declares what a "
                                f"{kind.__name__.lower()} needs and can do)")

    @property
    def components(self) -> list[Component]:
        """Scorer, allocation scorer (when there is one), allocator, selector."""
        parts = (self.scorer, self.alloc_scorer, self.allocator, self.selector)
        return [p for p in parts if p is not None]

    @property
    def needs_queries(self) -> bool:
        """True when any component needs the captured window queries."""
        return any(p.needs_queries for p in self.components)

    @property
    def needs_values(self) -> bool:
        """True when any component reads ``LayerInputs.values`` (else the caller may hand an empty tensor)."""
        return any(p.needs_values for p in self.components)

    @property
    def needs_reconstruction(self) -> bool:
        """True when a scorer scores with the engine's context reconstruction (KVzip): the engine runs it
        at the context boundary and hands its scores in ``LayerInputs.reconstruction``."""
        return any(s.needs_reconstruction for s in (self.scorer, self.alloc_scorer) if s is not None)

    @property
    def binds_model(self) -> bool:
        """True when a scorer was learned for one model (KVzap): ``bind_model`` before the first round."""
        return any(s.binds_model for s in (self.scorer, self.alloc_scorer) if s is not None)

    def bind_model(self, model: ModelIdentity) -> None:
        """Hand the served model to the scorers that were learned for one (raises naming both on a mismatch)."""
        for s in (self.scorer, self.alloc_scorer):
            if s is not None and s.binds_model:
                s.bind_model(model)

    @property
    def accumulates(self) -> bool:
        """True when the ranking scorer carries its scores into the next round (H2O)."""
        return self.scorer.accumulates

    def forced_mask(self, inp: LayerInputs) -> torch.Tensor:
        """``[H, region_len]`` bool: the tokens every head keeps (``planner.forced_mask``)."""
        return planner.forced_mask(inp, self.sink_tokens, self.recent_window)

    def floor_pages(self, inp: LayerInputs) -> int:
        """Pages every head needs to hold its forced tokens (at least one)."""
        return planner.layer_floors(self.forced_mask(inp), inp, 1)[0]

    def layer_total_pages(self, base_total: int, inp: LayerInputs, floor: int | None = None) -> int:
        """The layer's page budget after the allocator's layer schedule (PyramidKV; the base without one),
        within the heads' floors (``floor`` pages each: ``floor_pages`` when None) and what they can hold."""
        floor = self.floor_pages(inp) if floor is None else floor
        return planner.layer_totals(self.allocator, [base_total], inp, inp.num_kv_heads, [floor])[0]

    def plan_layer(self, inp: LayerInputs, total_pages: int) -> Selection:
        """One layer whose heads share the candidates ``[0, region_len)``."""
        return self.plan_rows(inp, [total_pages], inp.num_kv_heads)[0]

    def plan_layer_ragged(self, heads: list[LayerInputs], total_pages: int) -> Selection:
        """One layer whose heads have their own candidates: ``heads[h]`` is a one-KV-head input (its keys
        with their positions, its GQA group's window queries, ``region_len`` = its candidates, a whole
        number of pages). Returns kept indices into each head's own candidates."""
        return self.plan_rows(fold_heads(heads), [total_pages], len(heads))[0]

    def plan_rows(self, inp: LayerInputs, totals: list[int], heads_per_layer: int) -> list[Selection]:
        """Several layers at once: rows ``[l * H, (l + 1) * H)`` of ``inp`` are layer ``inp.layer_idx + l``
        (``H = heads_per_layer``), which keeps ``totals[l]`` head-pages. One scorer call scores every row
        (scorers work per KV head); allocation and selection run per layer (``planner``)."""
        return self.plan_requests([inp], [totals], heads_per_layer)[0]

    def plan_requests(self, inputs: list[LayerInputs], totals: list[list[int]],
                      heads_per_layer: int) -> list[list[Selection]]:
        """``plan_rows`` of several requests at once (``planner.plan_requests``): each keeps what it keeps
        planned alone."""
        return planner.plan_requests(inputs, totals, heads_per_layer, scorer=self.scorer, allocator=self.allocator,
                                     selector=self.selector, alloc_scorer=self.alloc_scorer,
                                     sink_tokens=self.sink_tokens, recent_window=self.recent_window)


def fold_heads(heads: list[LayerInputs]) -> LayerInputs:
    """One-KV-head inputs (each with its own candidates, positions and GQA query group) as one padded
    input: row h holds head h's candidates in ``[0, caps[h] * page)``, padding up to the widest, then the
    context-only keys after the candidates (e.g. a partial last block), shared by every row."""
    h0 = heads[0]
    caps = torch.tensor([x.num_region_pages for x in heads], dtype=torch.int64)
    rmax = int(caps.max()) * h0.page_size
    extra = max(x.num_tokens - x.region_len for x in heads)
    t = rmax + extra
    n, d = len(heads), h0.head_dim
    keys = torch.zeros((n, t, d), dtype=h0.keys.dtype)
    values = torch.zeros((n, t, d), dtype=h0.values.dtype)
    pos = torch.zeros((n, t), dtype=torch.int64)
    valid = torch.zeros((n, t), dtype=torch.bool)
    prior = None if all(x.prior is None for x in heads) else torch.zeros((n, rmax))
    recon = None if any(x.reconstruction is None for x in heads) else torch.zeros((n, t))
    for i, x in enumerate(heads):
        r, e = x.region_len, x.num_tokens - x.region_len
        p = x.key_positions()[0]
        keys[i, :r], values[i, :r], pos[i, :r], valid[i, :r] = x.keys[0, :r], x.values[0, :r], p[:r], True
        keys[i, rmax:rmax + e], values[i, rmax:rmax + e] = x.keys[0, r:], x.values[0, r:]
        pos[i, rmax:rmax + e], valid[i, rmax:rmax + e] = p[r:], True
        if prior is not None and x.prior is not None:
            prior[i, :r] = x.prior[0, :r]
        if recon is not None:  # a head's scores follow its candidates, as its keys do
            recon[i, :r], recon[i, rmax:rmax + e] = x.reconstruction[0, :r], x.reconstruction[0, r:r + e]
    queries = None if h0.queries is None else torch.cat([x.queries for x in heads])
    return LayerInputs(keys=keys, values=values, region_len=rmax, page_size=h0.page_size, layer_idx=h0.layer_idx,
                       num_layers=h0.num_layers, scale=h0.scale, queries=queries,
                       query_positions=h0.query_positions, window_end=h0.window_end, positions=pos, prior=prior,
                       head_pages=caps, valid=valid, reconstruction=recon)
