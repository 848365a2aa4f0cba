"""The round clock: when a request's next eviction round is due, where a prefill chunk must stop (the
context boundary ``kv_context_len``), which queries a query-aware round scores, and how much of a
prefix-cache hit a request may use. Pure functions of where a request stands (:class:`ClockState`), no vLLM
import: the scheduler side (``integration/scheduler/side.py``) asks them every step and
``benchmarks/perplexity.py`` simulates decode-time rounds with the same ones.

With ``N`` the budget, ``T`` the decode interval, ``bs`` the block size and ``E`` the first block of the dense
tail after a round, the next round is due when the tokens with KV reach ``R``:
- before any round: the context boundary ``C`` (while that round is to come); else, with ``T = 0`` or a
  ``C`` that needs no round, the prompt end (once); else ``max(prompt end, N + T)`` (a short prompt is first
  compressed while it decodes), later than a retry point after a first round that planned nothing;
- once compacted: ``E * bs + T`` (the dense tail reached ``T``); with ``T = 0`` only at the end of a
  streaming-input session's next chunk (a prompt end too) when it completes a block past ``E``;
- with ``T > 0``, not before a point the round was put off to (``defer_to``: the pool had no room for its
  window's queries when the window began).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClockState:
    """What the clock needs of one request (its settings and where it stands)."""

    prefill_end: int  # tokens the current (re)prefill computes (the prompt end)
    budget: int  # N, tokens per KV head
    interval: int  # T, tokens (0: one round, at the prompt end)
    block_size: int
    context_len: int | None = None  # C (kv_context_len): the prefill stops there, the context is compressed
    prefill_at_context: bool = True  # agnostic_mode "prefill" (False: "score_only", no stop at C)
    context_fits: bool = False  # C's blocks fit the budget: nothing to compress at C, the prefill goes on
    tried: bool = False  # the first round ran or planned nothing
    compacted: bool = False
    region_blocks: int = 0  # E, after a round
    retry_at: int = 0  # a first round that planned nothing is tried again from here (T > 0)
    chunk_end: int = 0  # a streaming-input session's latest chunk end, once it took a chunk after compaction
    defer_to: int = 0  # a decode-time round put off to here (T > 0)


def context_boundary(s: ClockState) -> int | None:
    """``C`` while the round that compresses the context is still to come; None otherwise (no ``C``,
    ``score_only``, the round was tried, ``C`` at or past the prompt end, or the context fits the budget)."""
    if not s.context_len or not s.prefill_at_context or s.tried or s.compacted:
        return None
    if s.context_len >= s.prefill_end or s.context_fits:
        return None
    return s.context_len


def next_round(s: ClockState) -> int | None:
    """Tokens with KV at which the request's next round is due (``R``); None: no more rounds."""
    if s.compacted:
        if s.interval:
            return max(s.region_blocks * s.block_size + s.interval, s.defer_to)
        return s.chunk_end if s.chunk_end // s.block_size > s.region_blocks else None
    c = context_boundary(s)
    if c is not None:
        return c
    if s.interval == 0 or (s.context_len and not s.tried):
        return None if s.tried else s.prefill_end
    return max(s.prefill_end, s.budget + s.interval, s.retry_at, s.defer_to)


def defer_point(round_at: int, window: int, block_size: int) -> int:
    """Where a round whose window could not be captured from ``round_at - window`` on is put off to: whole
    blocks, with its new window starting at or after ``round_at`` (no token of it computed yet)."""
    return round_at + -(-window // block_size) * block_size


def round_due(s: ClockState, done: int, num_tokens: int) -> bool:
    """Does a step after which ``done`` tokens have KV (of the request's ``num_tokens``) run the round? Only
    at ``R`` or later and at the end of what is computed so far (the prompt, or the context boundary): a
    round never runs in the middle of a prefill."""
    r = next_round(s)
    if r is None or done < r:
        return False
    c = context_boundary(s)
    return done >= num_tokens or (c is not None and done == c)


def capture_span(round_at: int, window: int, start: int, done: int) -> tuple[int, int] | None:
    """The tokens ``[a, b)`` of a step computing ``[start, done)`` whose queries a query-aware round at
    ``round_at`` scores (its window ``[round_at - window, round_at)``); None when the step has none."""
    if start < round_at and done > round_at - window:
        return max(start, round_at - window), min(done, round_at)
    return None


def cap_chunk(boundary: int | None, num_computed: int, num_new: int) -> int:
    """Tokens of ``num_new`` a step may compute from ``num_computed``: a chunk stops at the context boundary."""
    if boundary is not None and num_computed < boundary < num_computed + num_new:
        return boundary - num_computed
    return num_new


def usable_hit(num_hit: int, block_size: int, boundary: int | None, window_start: int | None) -> int:
    """Tokens of a ``num_hit``-token prefix-cache hit a new request may use: not past its context boundary
    (its question is computed over the compressed context), not past the first token of the observation
    window its first round scores (``window_start``, query-aware policies: those queries must be computed);
    a cut hit is whole blocks."""
    limit = num_hit
    if boundary is not None:
        limit = min(limit, boundary)
    if window_start is not None:
        limit = min(limit, max(0, window_start))
    return limit // block_size * block_size if limit < num_hit else num_hit


def retry_after_noop(retry_at: int, num_computed: int, interval: int, block_size: int) -> int:
    """A first round that planned nothing (everything fit) is tried again ``max(T, bs)`` tokens later."""
    return (retry_at or num_computed) + max(interval, block_size)
