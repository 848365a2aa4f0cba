"""One scheduled request's part of the step's metadata: the KV it holds (sampled for the metrics), the window
queries to capture for its next round, and, when that round is due, the round for the workers with the
private blocks it packs into when some of its blocks are shared (prefix caching) and the shared compressed
context it publishes; for a policy that scores with the context's reconstruction (KVzip), the
reconstruction first (``reconstruction/scheduler.py``; the step's hidden requests, ``reconstruction_step``), the round
when it completes, or at once with the scores the workers keep from an earlier request with the same context.
The clock itself is ``round_clock.py``; the record it changes ``records.py``."""

from __future__ import annotations

from vllm_contour import round_clock
from vllm_contour.integration.scheduler.contexts import ContextPublisher
from vllm_contour.integration.reconstruction.scheduler import Reconstructions, context_key
from vllm_contour.integration.scheduler.blocks import RequestBlocks
from vllm_contour.integration.scheduler.events import SchedulerEvents
from vllm_contour.integration.scheduler.records import Tracked
from vllm_contour.integration.messages import CaptureItem, ReconItem, RoundItem, ScoresRef


class RoundDispatch:
    def __init__(self, blocks: RequestBlocks, contexts: ContextPublisher, events: SchedulerEvents,
                 recon: Reconstructions, query_blocks):
        self.blocks = blocks
        self.contexts = contexts
        self.events = events
        self.recon = recon
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
        if t.reconstructs:  # scored by the context's reconstruction: it runs first (for a compacted
            # streaming-input session, over the tokens appended since its last round), unless the workers keep
            # the scores of an earlier request's reconstruction of the same context
            key = None if t.compacted else context_key(req, done)
            if key is None or not self.recon.kept_scores(key):
                self._reconstruct(t, done, t.region_blocks * bs if t.compacted else 0, key)
            elif self.dispatch(t, done, rounds, ScoresRef(key, t.epoch, store=False)):
                self.events.event("reconstructions_reused")
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

    def _reconstruct(self, t: Tracked, c: int, start_at: int, key: str | None) -> None:
        try:
            self.recon.start(t, c, start_at, key)
            self.events.event("reconstructions")
        except Exception as e:  # never into vLLM: the request goes on without eviction
            self.stop_reconstruction(t, e)

    def reconstruction_step(self, scheduler_output, tracked: dict[str, Tracked], keys: dict,
                            captures: list[CaptureItem], rounds: list[RoundItem]) -> list[ReconItem]:
        """The step's hidden reconstruction requests (their repeat tokens captured), and the rounds of the
        owners whose reconstruction completes with this step (each keeping its context's scores)."""
        items: list[ReconItem] = []
        if not self.recon.waiting:
            return items
        try:
            sched = {r: n for r, n in scheduler_output.num_scheduled_tokens.items() if self.recon.is_companion(r)}
            n = self.recon.step(sched, self.blocks, keys, captures, items)
            if n:
                self.events.event("reconstruction_tokens", n)
        except Exception as e:  # never into vLLM: the owners go on without eviction
            for owner in list(self.recon.waiting):
                self._stop_owner(tracked.get(owner), owner, e)
            return []
        for owner in self.recon.ready():
            t = tracked.get(owner)
            try:
                w = self.recon.waiting[owner]
                if t is None or t.params is None:
                    self.recon.done(owner)
                    continue
                keep = ScoresRef(w.key, t.epoch, store=True) if w.key is not None else None
                if self.dispatch(t, w.context_len, rounds, keep):
                    if keep is not None:
                        self.recon.keep_scores(keep.key)
                    self.recon.done(owner)
            except Exception as e:
                self._stop_owner(t, owner, e)
        return items

    def _stop_owner(self, t: Tracked | None, owner: str, err) -> None:
        if t is None:
            self.recon.owner_gone(owner)
        else:
            self.stop_reconstruction(t, err)

    def stop_reconstruction(self, t: Tracked, err) -> None:
        """The request's reconstruction cannot complete: its hidden requests go, it is served densely."""
        self.recon.owner_gone(t.request.request_id)
        if t.params is not None:
            self.events.fail(t.request.request_id, "reconstruction", err)
            t.params = None

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
