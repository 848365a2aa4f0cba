"""What one request may hold, computed in one place: budget -> head-pages per layer, moment pages, the
per-head floor, and the bound on the blocks it holds. Pure python (moments math only).

A vLLM block holds ``block_size`` tokens of every KV head of every layer, so a request's bytes are its
blocks. The budget ``N`` tokens per KV head is rounded DOWN to whole blocks: every layer may keep
``B = H * (N // bs)`` head-pages, which its ``H`` heads share raggedly (AdaKV/ContourKV give some heads
more pages than others) and which also hold the layer's MomentKV statistics when moment correction is
on (``M`` pages, fp32). So the kept part of a request fills at most ``N // bs`` blocks: what it holds is
never more than the budget, moments included.

Decode-time eviction adds a dense tail of at most ``T`` tokens (the decode interval, a multiple of the
block size): when the tail reaches ``T`` the policy runs again over the kept pages plus the tail and cuts
back to ``B``. Once compacted a request therefore holds at most ``N // bs + T // bs`` blocks after every
engine step (``held_blocks_bound``): the round runs in the step whose tokens fill the tail's ``T // bs``
blocks and frees the rest before the step ends. Before its first round a request shorter than ``N + T`` is
dense: after a step with ``n < N + T`` tokens computed it holds ``ceil(n / bs)`` blocks, at most
``ceil((N + T - 1) / bs)``, which is one block more than ``N // bs + T // bs`` when ``N % bs >= 2`` (a budget
that is not a whole number of blocks). The bound is the larger of the two; a prefill step holds the dense
prompt until the round at its end frees it, and a step with speculative drafts may hold the drafts' block on
top. ``T = 0`` evicts once, when the prompt ends; the tail then grows.

A query-aware policy scores with the queries of its round's observation window ``[R - W, R)``, captured
while those tokens are computed: they are kept in blocks of vLLM's pool (``query_blocks_for``), taken when
the window's first token is computed and given back when the round ran, so for those steps the request
holds that many blocks more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_contour import moments as mom_math
from vllm_contour.config import DEFAULT_DECODE_INTERVAL, EvictionConfigError, RequestEviction


class BudgetError(EvictionConfigError):
    """The budget cannot hold what every head must keep; the message names the floor and the flags."""


@dataclass(frozen=True)
class CacheShape:
    """What the budget arithmetic needs to know about the KV cache of one rank."""

    block_size: int
    num_kv_heads: int  # KV heads of this rank
    head_dim: int
    elem_size: int  # bytes per cache element

    @classmethod
    def of(cls, *, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> "CacheShape":
        """The one way a shape is built (vLLM's config at start-up, the KV cache group's spec, the workers'
        caches): ``dtype`` is the cache's torch dtype."""
        return cls(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, elem_size=dtype.itemsize)


def floor_pages_for(sink_tokens: int, recent_window: int, block_size: int) -> int:
    """Pages every head keeps whatever the policy: its sinks and its recent window, in whole pages."""
    return max(1, math.ceil((sink_tokens + recent_window) / block_size))


def moment_pages_for(num_kv_heads: int, head_dim: int, block_size: int, elem_size: int) -> int:
    """Head-pages one layer's moment statistics take (fp32, all the layer's KV heads of this rank)."""
    return mom_math.pages_needed(num_kv_heads, head_dim, 2 * block_size * head_dim * elem_size)


def query_blocks_for(window: int, queries_per_kv_head: int, block_size: int, query_elem_size: int,
                     elem_size: int) -> int:
    """Blocks one request's window queries take in vLLM's pool: per layer ``W x Hq x D`` query elements, and
    a block gives each layer ``H x 2 x bs x D`` cache elements (``Hq = G x H``: the ``H`` and ``D`` cancel)."""
    return math.ceil(window * queries_per_kv_head * query_elem_size / (2 * block_size * elem_size))


def layer_token_pages(budget: int, num_kv_heads: int, block_size: int, moment_pages: int = 0) -> int:
    """Head-pages one layer may give to tokens: ``H * (budget // bs)`` minus its moment pages."""
    return num_kv_heads * (budget // block_size) - moment_pages


@dataclass(frozen=True)
class PageBudget:
    budget: int  # tokens per KV head asked for
    block_size: int
    num_kv_heads: int  # KV heads of this rank
    floor_pages: int  # per head
    moment_pages: int  # per layer (0: no moment correction)

    @property
    def kept_blocks(self) -> int:
        """Blocks the kept part of a request may fill (``N // bs``)."""
        return self.budget // self.block_size

    @property
    def layer_pages(self) -> int:
        """``B``: head-pages one layer may hold, tokens and moments together."""
        return layer_token_pages(self.budget, self.num_kv_heads, self.block_size)

    @property
    def token_pages(self) -> int:
        """Head-pages one layer may give to tokens when it evicts (``B - M``)."""
        return layer_token_pages(self.budget, self.num_kv_heads, self.block_size, self.moment_pages)

    def held_blocks_bound(self, interval: int, query_blocks: int = 0) -> int:
        """Most blocks the request holds after any engine step once its prompt is prefilled (``T > 0``):
        ``max(N // bs + T // bs, ceil((N + T - 1) / bs))`` (see the module docstring; the two are equal when
        the budget is a whole number of blocks), plus the blocks a query-aware policy's window queries take
        (``query_blocks_for``: held in the steps that compute the window, which end with the fullest tail)."""
        bs = self.block_size
        return max(self.kept_blocks + interval // bs, -(-(self.budget + interval - 1) // bs)) + query_blocks

    def evicts(self, candidate_pages: int) -> bool:
        """Whether a layer with ``candidate_pages`` head-pages of tokens must evict: only when they do not
        fit in ``B`` (a layer that fits keeps everything and stores no moments)."""
        return candidate_pages > self.layer_pages


def min_budget(num_kv_heads: int, block_size: int, floor_pages: int, moment_pages: int) -> int:
    """Smallest budget (tokens per head) whose ``B - M`` holds every head's floor."""
    return block_size * math.ceil((floor_pages * num_kv_heads + moment_pages) / num_kv_heads)


def page_budget(budget: int, *, num_kv_heads: int, block_size: int, head_dim: int, elem_size: int,
                sink_tokens: int, recent_window: int, moments: bool, field: str = "--kv-budget") -> PageBudget:
    """The request's page budget; raises ``BudgetError`` (naming ``field``, the floor and the flags that set
    it) when the budget cannot hold every head's sinks and recent window (plus the moments)."""
    floor = floor_pages_for(sink_tokens, recent_window, block_size)
    m = moment_pages_for(num_kv_heads, head_dim, block_size, elem_size) if moments else 0
    pb = PageBudget(budget=budget, block_size=block_size, num_kv_heads=num_kv_heads, floor_pages=floor,
                    moment_pages=m)
    if pb.token_pages < floor * num_kv_heads:
        need = min_budget(num_kv_heads, block_size, floor, m)
        extra = (f" plus {m} head-pages of MomentKV statistics per layer ({m * block_size / num_kv_heads:.0f} "
                 "tokens per head, --kv-moment-correction)") if m else ""
        raise BudgetError(
            f"{field} {budget} is below the floor of {need} tokens per KV head: every head keeps "
            f"{sink_tokens} sink + {recent_window} recent tokens = {floor} page(s) of {block_size} "
            f"(--kv-sink-tokens, --kv-recent-window, --block-size; per request kv_sink_tokens, kv_recent_window)"
            f"{extra}; budgets are whole blocks of "
            f"{block_size} tokens. Use {field} {need} or more, or lower those settings")
    return pb


def decode_interval_for(params: RequestEviction, block_size: int) -> int:
    """The request's decode interval ``T`` in tokens (the default rounded up to whole blocks)."""
    if params.decode_interval is None:
        return block_size * math.ceil(DEFAULT_DECODE_INTERVAL / block_size)
    return params.decode_interval


def request_budget(params: RequestEviction, shape: CacheShape, per_request: bool = False) -> PageBudget:
    """Validate a request's (or the server's) settings against the cache and return its page budget.
    Errors name the per-request key (``kv_budget``) or the server flag (``--kv-budget``)."""
    f_budget = "kv_budget" if per_request else "--kv-budget"
    f_interval = "kv_decode_interval" if per_request else "--kv-decode-interval"
    if params.decode_interval is not None and params.decode_interval % shape.block_size:
        raise BudgetError(f"{f_interval} {params.decode_interval} must be a multiple of the block size "
                          f"{shape.block_size} (0 = evict only when the prompt ends)")
    return page_budget(params.budget, num_kv_heads=shape.num_kv_heads, block_size=shape.block_size,
                       head_dim=shape.head_dim, elem_size=shape.elem_size, sink_tokens=params.sink_tokens,
                       recent_window=params.recent_window, moments=params.moment_correction,
                       field=f_budget)
