"""How much a request may compute, asked while vLLM schedules: the part of a prefix-cache hit it may use
(a context boundary still to compress and a query-aware round's window must be computed, not taken from the
cache), a shared compressed context it may start with, and where a prefill chunk stops (the context
boundary). The round clock's pure functions (``round_clock.py``) over the scheduler side's records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_contour import round_clock

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_contour.integration.scheduler.records import Tracked


class PrefillLimits:
    """``track(request)``: the scheduler side's record of a request (made on first sight); ``manager()``:
    vLLM's KV cache manager once bound."""

    def __init__(self, track, recon, contexts, events, block_size: int, manager):
        self.track, self.recon, self.contexts, self.events = track, recon, contexts, events
        self.block_size, self.manager = block_size, manager

    def limit_hit(self, request: "Request", num_hit_tokens: int) -> int:
        """How many of a new request's prefix-cache hit tokens it may use (whole blocks). A request with a
        context boundary ``C`` still to compress computes from ``C`` on at the latest (its question must be
        computed over the compressed context, as on an engine without prefix caching); a query-aware policy
        whose first round is due at ``R`` (the prompt end or ``C``) also computes its window ``[R - W, R)``,
        whose queries it scores with. Other requests use the whole hit."""
        try:
            if self.recon.is_companion(request.request_id):
                return self.recon.limit_hit(request.request_id, num_hit_tokens)
            t = self.track(request)
            if t.params is None or num_hit_tokens == 0:
                return num_hit_tokens
            s = t.clock(self.block_size)
            r = round_clock.next_round(s)
            window_start = r - t.params.window if t.needs_queries and r is not None else None
            return round_clock.usable_hit(num_hit_tokens, self.block_size, round_clock.context_boundary(s),
                                          window_start)
        except Exception:
            return num_hit_tokens

    def shared_hit(self, request: "Request"):
        """``(block table, C)`` when a new request can adopt a shared compressed context as its prefix-cache
        hit (same first C tokens and settings as an entry, context still to compress), else None."""
        try:
            t = self.track(request)
            if t.params is None or request.num_computed_tokens or self._boundary(t) is None or \
                    not self.manager().prefix_cache_lookup_enabled(request):  # e.g. prompt logprobs
                return None
            return self.contexts.hit(request, t)
        except Exception as e:
            self.events.fail(request.request_id, "metadata", e)
            return None

    def _boundary(self, t: "Tracked") -> int | None:
        """The context boundary C where the prefill stops to compress the context, while that round is
        still to come; None otherwise (``round_clock.context_boundary``)."""
        return None if t.params is None else round_clock.context_boundary(t.clock(self.block_size))

    def cap_chunk(self, request: "Request", num_computed: int, num_new: int) -> int:
        """How many of ``num_new`` tokens the request may compute this step: a prefill chunk never runs past
        its context boundary (the context is compressed before the question is computed)."""
        try:
            # called while vLLM schedules, before the request's blocks (and update_state_after_alloc)
            if self.recon.holding(request.request_id):  # its context's reconstruction runs: it waits
                return 0
            t = self.track(request)
            if t.params is None:
                return num_new
            if request.num_computed_tokens == 0 and num_computed == 0:
                t.prefill_end = request.num_tokens
            c = self._boundary(t)
        except Exception:
            return num_new
        return round_clock.cap_chunk(c, num_computed, num_new)

