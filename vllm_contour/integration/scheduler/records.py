"""What the scheduler side keeps: one record per request that may evict (its settings, where its round clock
stands, the round in flight, the blocks it held) and the process's totals. Plain data; the scheduler side
(``side.py``) and the shared-context bookkeeping (``contexts.py``) change it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_contour.budget import PageBudget
from vllm_contour.config import RequestEviction
from vllm_contour.round_clock import ClockState

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class PrivateBlocks:
    """Blocks from vLLM's pool a round packs kept pages into instead of blocks others may hit."""

    seq: int  # the round they were taken for
    blocks: list  # vLLM's KVCacheBlock objects


@dataclass
class QueryPages:
    """Blocks from vLLM's pool that hold a round's window queries, taken when the window's first token is
    computed, given back when the round ran (or the request left or started over)."""

    round_at: int  # R: the window is [start, R)
    start: int
    blocks: list  # vLLM's KVCacheBlock objects


@dataclass
class Publishing:
    """A context round whose result becomes a shared compressed context when it succeeds."""

    seq: int  # the round
    entry_id: int
    key: bytes
    snapshot: Any | None  # private copy of the block holding [E * bs, C); None when C is block-aligned


@dataclass
class HeldKV:
    """KV tokens per head a request held in vLLM's pool, sampled at every step it was scheduled: over all
    layers and in the evicting (full-attention) layers only (they differ on a hybrid model)."""

    total: float = 0.0
    steps: int = 0
    peak: float = 0.0
    evicting_total: float = 0.0
    evicting_peak: float = 0.0
    last_blocks: int = 0  # blocks in vLLM's block list (null blocks left out) at its last step

    def sample(self, tokens: float, evicting_tokens: float, blocks: int) -> None:
        self.total += tokens
        self.steps += 1
        self.peak = max(self.peak, tokens)
        self.evicting_total += evicting_tokens
        self.evicting_peak = max(self.evicting_peak, evicting_tokens)
        self.last_blocks = blocks

    def mean(self) -> tuple[float, float]:
        """(all layers, evicting layers) mean tokens per head."""
        return self.total / self.steps, self.evicting_total / self.steps


@dataclass
class Tracked:
    request: "Request"
    params: RequestEviction | None  # None: this request does not evict (or stopped after a failed round)
    asked: RequestEviction | None = None  # the settings it asked for
    budget: PageBudget | None = None
    interval: int = 0  # T
    needs_queries: bool = False
    reconstructs: bool = False  # its policy scores with the context's reconstruction (KVzip)
    # the round clock
    prefill_end: int = 0  # tokens the current (re)prefill computes
    compacted: bool = False
    region_blocks: int = 0  # E
    retry_at: int = 0  # a first round that found nothing to evict is retried from here (T > 0)
    defer_to: int = 0  # a decode-time round put off to here (no room for its window queries)
    prefill_tried: bool = False
    chunk_end: int = 0  # a streaming-input session's latest chunk end (taken with its blocks kept)
    epoch: int = 0  # bumped whenever the request starts over; the worker drops its old state then
    # the round in flight
    seq: int = 0
    pending: int | None = None  # seq of the round in flight
    round_tokens: int = 0  # tokens with KV of the round in flight
    fresh: PrivateBlocks | None = None
    queries: QueryPages | None = None
    publishing: Publishing | None = None
    adopted: int | None = None  # the shared entry this request adopted (until it leaves or starts over)
    # what eviction did to it
    rounds: int = 0  # rounds that succeeded
    first_round_at: int | None = None  # tokens with KV when its first round ran
    last_round: tuple[int, int] | None = None  # (K, E) of its last round
    held: HeldKV = field(default_factory=HeldKV)

    def clock(self, block_size: int) -> ClockState:
        """Where an evicting request stands, for the round clock (``round_clock.py``)."""
        p, b, c = self.params, self.budget, self.params.context_len
        fits = bool(c) and b is not None and not b.evicts(b.num_kv_heads * (c // block_size))
        return ClockState(prefill_end=self.prefill_end, budget=p.budget, interval=self.interval,
                          block_size=block_size, context_len=c, prefill_at_context=p.agnostic_mode == "prefill",
                          context_fits=fits, tried=self.prefill_tried, compacted=self.compacted,
                          region_blocks=self.region_blocks, retry_at=self.retry_at, chunk_end=self.chunk_end,
                          defer_to=self.defer_to)

    def summary(self) -> dict:
        """The per-request eviction report the client gets (vLLM's ``kv_transfer_params`` of the response,
        under ``"contour"``): the settings the request ran with, its rounds (the first at how many tokens),
        the kept (K) and compacted (E) blocks of its last round, its moment pages per layer, the blocks it
        held in its last step and the peak KV tokens per head it held in vLLM's pool; ``failed``: a round
        failed and it went on without eviction."""
        p, b = self.asked, self.budget
        return {"policy": p.policy, "budget": p.budget, "decode_interval": self.interval,
                "moment_correction": bool(p.moment_correction), "context_len": p.context_len,
                "sink_tokens": p.sink_tokens, "recent_window": p.recent_window, "window": p.window,
                "policy_args": p.policy_args, "last_held_blocks": self.held.last_blocks,
                "rounds": self.rounds, "first_round_at": self.first_round_at,
                "kept_blocks": self.last_round[0] if self.last_round else None,
                "region_blocks": self.last_round[1] if self.last_round else None,
                "moment_pages": b.moment_pages if b is not None and self.rounds else 0,
                "peak_kv_tokens": self.held.peak, "failed": self.params is None}


@dataclass
class SchedulerTotals:
    """Cumulative counts of this process's scheduler side (for tests and logs); the same events go out as
    per-step deltas of ``ContourStats``."""

    evicted_requests: int = 0
    rounds: int = 0
    freed_blocks: int = 0
    private_blocks: int = 0  # blocks a round packed into instead of the request's own (prefix caching)
    shared_hits: int = 0  # requests that adopted a shared compressed context
    reconstructions: int = 0  # contexts reconstructed (KVzip), each by one or more hidden requests
    reconstruction_tokens: int = 0  # tokens those hidden requests computed
    reconstructions_reused: int = 0  # rounds scored with an earlier request's reconstruction of the same context
    stale_reports: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    last: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # req -> (K, E, freed) of its last round
    kv_held: dict[str, tuple[float, int]] = field(default_factory=dict)  # finished req -> (mean, peak) tokens/head
    # the same in the evicting (full-attention) layers only: what methods differ in on a hybrid model, whose
    # sliding-window layers hold the same for every method (equal to kv_held on other models)
    kv_held_evicting: dict[str, tuple[float, int]] = field(default_factory=dict)

    KEEP = 4096  # finished requests remembered

    def finished(self, req_id: str, held: HeldKV) -> None:
        mean, evicting_mean = held.mean()
        self.kv_held[req_id] = (mean, held.peak)
        self.kv_held_evicting[req_id] = (evicting_mean, held.evicting_peak)
        for d in (self.kv_held, self.kv_held_evicting):
            if len(d) > self.KEEP:
                d.pop(next(iter(d)))

    def round_done(self, req_id: str, kept: int, region: int, freed: int) -> None:
        self.last[req_id] = (kept, region, freed)
        if len(self.last) > self.KEEP:
            self.last.pop(next(iter(self.last)))
