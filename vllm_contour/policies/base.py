"""The policy interface: score -> allocate -> select, per layer, pure torch.

A policy sees one layer of one request at a time (``LayerInputs``) and returns, for every KV head, the
sorted indices of the tokens it keeps inside the *compactable region* ``[0, region_len)`` of the prompt.
``region_len`` is a whole number of pages (``num_region_pages * page_size``); prompt tokens past it (the
"tail", fewer than one page, plus the question in query-agnostic mode) stay dense and are never evicted.

Budgets are handed out in whole head-pages: every head keeps ``pages[h] * page_size`` tokens. The caller
decides the layer's total number of pages (``LayerBudget``); the allocator splits it between heads, the
selector picks the tokens. Nothing here imports vLLM.

Every component subclasses its interface (``Scorer``, ``Allocator``, ``Selector``), which declares, with a
default, each capability the planner reads: what inputs it needs, whether its scores carry over, a layer
schedule, whether it splits or selects many layers at once. ``Policy`` refuses a component that does not.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class LayerInputs:
    """What a policy may look at for one (request, layer).

    keys / values: ``[H, T, D]`` post-RoPE keys and values of every prompt token that has KV
    (``T = num_prompt_tokens``), in the cache dtype; values may be empty (``[H, 0, D]``) for a policy none of
    whose components declares ``needs_values``. Tokens ``[0, region_len)`` are the candidates.
    queries: ``[Hq, W, D]`` post-RoPE queries of the observation window (the last ``W`` tokens before
    ``window_end``), or None when the engine did not capture any (query-free policies).
    query_positions: ``[W]`` absolute positions of those queries.
    """

    keys: torch.Tensor
    values: torch.Tensor
    region_len: int
    page_size: int
    layer_idx: int
    num_layers: int
    scale: float
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    # Token index where the scoring context ends (query-agnostic mode: the context boundary;
    # otherwise the prompt length). Windows (recent, observation) end here. Tokens at or after it
    # (the question) are kept dense and must not influence any score.
    window_end: int | None = None
    # The head-pages the layer keeps (after any layer schedule), filled in by ``Policy`` for scorers that
    # want to know roughly how much will be evicted (MomentKV's second pass): the layer's total, or
    # ``[H]`` pages per head when several layers are scored at once. Optional.
    budget_pages: int | torch.Tensor | None = None
    # Absolute positions of the keys, ``[T]`` or per head ``[H, T]`` (sorted along T). None: the keys are
    # tokens ``0..T-1`` (a prompt). Decode-time rounds hand each head its kept tokens (original
    # positions) followed by the new tail.
    positions: torch.Tensor | None = None
    # ``[H, region_len]`` scores carried from earlier rounds for each candidate (0 for tokens that are
    # new this round), for scorers that accumulate across rounds (H2O). None: first round.
    prior: torch.Tensor | None = None
    # ``[H]`` candidate pages of each head when heads have different candidates (a decode-time round:
    # head h's candidates are ``[0, head_pages[h] * page_size)``; the rest of the region is padding).
    # None: every head has the whole region.
    head_pages: torch.Tensor | None = None
    # ``[H, T]`` bool: False where a row holds padding, not a token (its key is meaningless). Scorers
    # must leave padding out of every statistic; their scores there are ignored. None: all tokens.
    valid: torch.Tensor | None = None
    # ``[H, T]`` KVzip scores of each row's tokens (by their original positions: the context ``[0, C)`` in a
    # first round) from the engine's context reconstruction (its chunks' max attention,
    # ``scorers/kvzip.py``), for scorers that ``needs_reconstruction``. None: none ran.
    reconstruction: torch.Tensor | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[2]

    @property
    def num_region_pages(self) -> int:
        return self.region_len // self.page_size

    def key_mask(self) -> torch.Tensor:
        """``[H, T]`` bool: True where a row holds a token."""
        if self.valid is None:
            return torch.ones((self.num_kv_heads, self.num_tokens), dtype=torch.bool)
        return self.valid

    def key_positions(self) -> torch.Tensor:
        """``[H, T]`` int64 absolute position of every key; padding gets a position past every query, so a
        causal mask hides it."""
        if self.positions is None:
            pos = torch.arange(self.num_tokens, dtype=torch.int64).expand(self.num_kv_heads, -1)
        else:
            pos = self.positions.to(torch.int64)
            pos = pos.expand(self.num_kv_heads, -1) if pos.dim() == 1 else pos
        if self.valid is not None:
            pos = torch.where(self.valid, pos, torch.full_like(pos, _PAST))
        return pos

    @property
    def context_end(self) -> int:
        """Absolute position where the scoring context ends (exclusive)."""
        if self.window_end is not None:
            return self.window_end
        if self.positions is None:
            return self.num_tokens
        pos = self.key_positions()
        pos = pos[pos < _PAST]
        return int(pos.max()) + 1 if pos.numel() else 0

    def context_mask(self) -> torch.Tensor:
        """``[H, T]`` bool: the keys of the scoring context (tokens before ``context_end``, no padding)."""
        return self.key_positions() < self.context_end

    def row_slice(self, a: int, b: int, context_end: int | None = None) -> LayerInputs:
        """Rows ``[a, b)`` (KV heads; their GQA groups' queries) as an input of their own, with the same context
        end as the whole (``context_end``: the whole's, when the caller has it already)."""
        g = 0 if self.queries is None else self.queries.shape[0] // self.num_kv_heads

        def rows(x):
            return x if x is None or x.dim() == 0 or (x.dim() == 1 and x.shape[0] != self.num_kv_heads) else x[a:b]

        pos = self.positions if self.positions is None or self.positions.dim() == 1 else self.positions[a:b]
        budget = self.budget_pages[a:b] if isinstance(self.budget_pages, torch.Tensor) else self.budget_pages
        return dataclasses.replace(
            self, keys=self.keys[a:b], values=self.values[a:b], positions=pos, valid=rows(self.valid),
            queries=None if self.queries is None else self.queries[a * g:b * g], head_pages=rows(self.head_pages),
            prior=rows(self.prior), reconstruction=rows(self.reconstruction), budget_pages=budget,
            window_end=self.context_end if context_end is None else context_end)

    @property
    def is_ragged(self) -> bool:
        return self.head_pages is not None

    def head_caps(self) -> torch.Tensor:
        """``[H]`` int64 candidate pages of each head."""
        if self.head_pages is None:
            return torch.full((self.num_kv_heads,), self.num_region_pages, dtype=torch.int64)
        return self.head_pages.to(torch.int64)

    def candidate_mask(self) -> torch.Tensor:
        """``[H, region_len]`` bool: True where a head has a candidate (False = padding)."""
        j = torch.arange(self.region_len).view(1, -1)
        return j < (self.head_caps() * self.page_size).view(-1, 1)

    def head_budget_pages(self) -> torch.Tensor | None:
        """``[H]`` pages each head would keep under a uniform split of ``budget_pages`` (None: unknown)."""
        if self.budget_pages is None:
            return None
        if isinstance(self.budget_pages, torch.Tensor):
            return self.budget_pages.to(torch.int64)
        return torch.full((self.num_kv_heads,), int(self.budget_pages) // self.num_kv_heads, dtype=torch.int64)


_PAST = 2 ** 62  # position of padding keys: after every query


@dataclass
class LayerBudget:
    """Total head-pages the layer may keep, and the per-head minimum (recency floor + sinks).

    ``forced`` (optional, ``[region_len]`` or per head ``[H, region_len]`` bool) marks the tokens every head
    keeps anyway (sinks and recent window); mass-aware allocators (ContourKV) use it so that they do not
    pay twice for mass that the floor already holds."""

    total_pages: int
    floor_pages: int = 1
    forced: torch.Tensor | None = None


@dataclass
class Selection:
    """Result for one layer: ``kept[h]`` is a sorted int64 tensor of token indices in [0, region_len),
    its length a multiple of page_size (a head may keep the whole region).

    ``scores`` (optional) are the kept tokens' scores per head, in ``kept`` order: what an accumulating
    scorer (H2O) carries into the next round.
    """

    kept: list[torch.Tensor]
    scores: list[torch.Tensor] | None = None

    def counts(self) -> list[int]:
        return [int(k.numel()) for k in self.kept]


class Component(abc.ABC):
    """What every component declares about the inputs it reads. Class-level defaults; a component whose answer
    depends on its knobs (or on a component it holds) overrides one with a property."""

    needs_queries: ClassVar[bool] = False  # reads the captured window queries (``LayerInputs.queries``)
    needs_values: ClassVar[bool] = False  # reads ``LayerInputs.values`` (else the caller may hand an empty tensor)


@dataclass(frozen=True)
class ModelIdentity:
    """The served model as a learned scorer checks it: a name for messages and a fingerprint of its config and
    weights (``vllm_contour.surrogate.fingerprint``)."""

    name: str
    fingerprint: str


class Scorer(Component):
    needs_reconstruction: ClassVar[bool] = False  # scores with the engine's context reconstruction (KVzip)
    # learned for one model: ``bind_model`` with the served model before any round (KVzap; no preset uses
    # such a scorer, so the engine binds none)
    binds_model: ClassVar[bool] = False
    # carries its kept tokens' scores into the next round (``Selection.scores`` -> ``LayerInputs.prior``; H2O)
    accumulates: ClassVar[bool] = False

    @abc.abstractmethod
    def score(self, inp: LayerInputs) -> torch.Tensor:
        """``[H, region_len]`` float scores; higher = more worth keeping."""

    def bind_model(self, model: ModelIdentity) -> None:
        """For a scorer that ``binds_model``: take the served model; raises ``ValueError`` naming both when the
        scorer was not made for it."""


class Allocator(Component):
    # the split depends on the heads' candidate pages, the layer total and the floor alone (not on scores or
    # keys): ``allocate_groups`` then splits many (request, layer) groups in one call
    candidates_only: ClassVar[bool] = False

    @abc.abstractmethod
    def allocate(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        """``[H]`` int64 pages per head: each in [floor, region_pages], summing to the layer total
        (clipped to what the region can hold)."""

    def layer_total_pages(self, base_total: int, layer_idx: int, num_layers: int, min_total: int,
                          max_total: int) -> int:
        """The layer schedule: head-pages layer ``layer_idx`` (of ``num_layers``) keeps when the caller gave it
        ``base_total``, within ``[min_total, max_total]`` (its heads' floors; the base, or less when its
        candidates hold less). Default: no schedule, the base."""
        return base_total

    def allocate_groups(self, caps: torch.Tensor, totals: torch.Tensor, floors: torch.Tensor) -> torch.Tensor:
        """``allocate`` of many groups at once, for an allocator that is ``candidates_only``: group g (``caps[g]``,
        ``[G, H]``: its heads' candidate pages) keeps ``totals[g]`` pages with ``floors[g]`` per head -> ``[G, H]``."""
        raise NotImplementedError(f"{type(self).__name__} is not candidates_only")

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.candidates_only is True and cls.allocate_groups is Allocator.allocate_groups:
            raise TypeError(f"{cls.__name__} declares candidates_only but defines no allocate_groups")


class Selector(Component):
    # each row is selected on its own, whatever the others: the rows of several layers and requests may be
    # selected in one call (padded with -inf past a row's region)
    rowwise: ClassVar[bool] = False

    @abc.abstractmethod
    def select(self, scores: torch.Tensor, pages: torch.Tensor, inp: LayerInputs) -> list[torch.Tensor]:
        """Per head sorted kept indices, ``pages[h] * page_size`` of them. ``scores`` are the scorer's
        scores with the forced tokens (sinks, recent window) set to ``+inf``."""
