"""One scheduled request's part of the step's metadata: the KV it holds (sampled for the metrics), the window
queries to capture for its next round, and, when that round is due, the round for the workers with the
private blocks it packs into when some of its blocks are shared (prefix caching) and the shared compressed
context it publishes; a policy that scores with the context's reconstruction (KVzip) hands its due round
to that component (``reconstruction/scheduler.py``: ``ContextRounds``), which dispatches it back here.
The clock itself is ``round_clock.py``; the record it changes ``records.py``."""

from __future__ import annotations

from vllm_contour import round_clock
from vllm_contour.integration.scheduler.contexts import ContextPublisher
from vllm_contour.integration.reconstruction.scheduler import ContextRounds
from vllm_contour.integration.scheduler.blocks import RequestBlocks
from vllm_contour.integration.scheduler.events import SchedulerEvents
from vllm_contour.integration.scheduler.records import Tracked
from vllm_contour.integration.messages import CaptureItem, RoundItem, ScoresRef


class RoundDispatch:
    def __init__(self, blocks: RequestBlocks, contexts: ContextPublisher, events: SchedulerEvents,
                 context_rounds: ContextRounds, query_blocks):
        self.blocks = blocks
        self.contexts = contexts
        self.events = events
        self.context_rounds = context_rounds  # the extension for rounds scored by a reconstruction (KVzip)
        self.query_blocks = query_blocks  # window (tokens) -> blocks of vLLM's pool its queries take

    def step(self, t: Tracked, n_sched: int, rounds: list[RoundItem], captures: list[CaptureItem]) -> None:
        req = t.request
        bs = self.blocks.block_size
        blocks = self.blocks.of(req.request_id)
        start, done = req.num_computed_tokens, req.num_computed_tokens + n_sched
        # with speculative decoding the step also computes draft tokens past the request's tokens, which the
        # sampler may reject: a round and the window it scores only ever cover verified tokens
        done = min(done, req.num_tokens)
        clock = t.clock(bs)
        r = round_clock.next_round(clock)
        w = t.params.window
        span = round_clock.capture_span(r, w, start, done) \
            if t.needs_queries and r is not None and t.budget is not None else None
        captured = span is None or self._capture(t, r, w, span, captures)
        self.blocks.sample(t, blocks)  # with the blocks its window queries take this step
        if r is None or t.budget is None or not captured:
            return
        if not round_clock.round_due(clock, done, req.num_tokens) or t.pending is not None:
            return
        if t.reconstructs:  # scored by the context's reconstruction (KVzip): its component takes the round
            self.context_rounds.round_due(t, done, rounds, self.dispatch)
            return
        self.dispatch(t, done, rounds)

    def _capture(self, t: Tracked, r: int, w: int, span: tuple[int, int], captures: list[CaptureItem]) -> bool:
        """The step's part of the window ``[r - w, r)``, written into the blocks that hold the round's window
        queries (taken from vLLM's pool at the window's first step). A window computed whole in one step (the
        end of a prefill) needs none: that step's round reads the queries as the forward left them. With no
        room for the blocks the round is put off by a window (decode-time rounds; other rounds go on and find
        no queries); False then."""
        start = max(0, r - w)
        if span == (start, r):  # the whole window in this step, whose round reads it: no blocks needed
            captures.append(CaptureItem(t.request.request_id, span[0], span[1], w, window_start=start, round_at=r,
                                        pages=[]))
            return True
        q = self.blocks.query_pages(t, r, start, self.query_blocks(w))
        if q is None:
            self.events.stats.add("deferred_captures", 1)
            if t.interval and round_clock.context_boundary(t.clock(self.blocks.block_size)) is None:
                t.defer_to = round_clock.defer_point(r, w, self.blocks.block_size)
                return False
            return True
        captures.append(CaptureItem(t.request.request_id, span[0], span[1], w, window_start=start, round_at=r,
                                    pages=[b.block_id for b in q.blocks]))
        return True

    def dispatch(self, t: Tracked, done: int, rounds: list[RoundItem], scores: ScoresRef | None = None) -> bool:
        """The request's round over its first ``done`` tokens, with private blocks when some of its blocks
        are shared (and, for kvzip, the context scores it keeps or takes); False when the pool has no room
        for them now (tried again at a later step)."""
        req = t.request
        blocks = self.blocks.of(req.request_id)
        clock = t.clock(self.blocks.block_size)
        fresh = None
        if self.blocks.shared(blocks, done):
            fresh = self.blocks.take_private(max(1, t.budget.kept_blocks))
            if fresh is None:  # no room for private blocks now: try at a later step
                self.events.stats.add("deferred_rounds", 1)
                return False
        t.seq += 1
        t.pending = t.seq
        t.round_tokens = done
        if fresh is not None:
            self.blocks.keep_private(t, t.seq, fresh)
        boundary = round_clock.context_boundary(clock)
        publish = None
        if fresh is not None and boundary is not None and done == boundary and not t.compacted:
            publish = self._plan_publish(t, blocks, boundary)
        if not t.compacted:
            t.prefill_tried = True
        rounds.append(RoundItem(req_id=req.request_id, block_ids=[b.block_id for b in blocks], num_tokens=done,
                                params=t.params, budget=t.budget, seq=t.seq,
                                fresh_ids=None if fresh is None else [b.block_id for b in fresh], publish=publish,
                                scores=scores))
        return True

    def _plan_publish(self, t: Tracked, blocks, c: int):
        try:
            return self.contexts.plan(t, blocks, c)
        except Exception as e:
            self.events.fail(t.request.request_id, "share", e)
            return None
