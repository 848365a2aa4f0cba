"""What the workers' reports of a step's rounds do to each request, in the scheduler: a round's freed blocks
go back to vLLM's pool through the evicting group's manager (null-replaced, exactly as vLLM's sliding-window
managers free blocks mid-request) and a context round may become a shared compressed context; a report for
a request that finished, was preempted or moved on meanwhile is stale and ignored. A round that failed
before any byte moved leaves the request as it is and stops evicting it; one that failed after (or
disagreed between ranks) asks the plugin's scheduler to recompute the request densely."""

from __future__ import annotations

from vllm.logger import init_logger

from vllm_contour import round_clock
from vllm_contour.integration.scheduler.contexts import ContextPublisher
from vllm_contour.integration.messages import ContourReport, Noop, Outcome, PlanFailed, Recompute, Round
from vllm_contour.integration.scheduler.blocks import RequestBlocks
from vllm_contour.integration.scheduler.events import SchedulerEvents
from vllm_contour.integration.scheduler.records import Tracked

logger = init_logger("vllm.contour")


class RoundOutcomes:
    def __init__(self, tracked: dict[str, Tracked], blocks: RequestBlocks, contexts: ContextPublisher,
                 events: SchedulerEvents):
        self.tracked = tracked
        self.blocks = blocks
        self.contexts = contexts
        self.events = events
        self.recompute: dict[str, str] = {}  # request -> why, for the plugin's scheduler

    def apply(self, report: ContourReport) -> None:
        for req_id, out in report.entries.items():
            try:
                self._apply_one(req_id, out)
            except Exception as e:  # never into vLLM: the request goes on without eviction
                self.events.fail(req_id, "metadata", e)
                t = self.tracked.get(req_id)
                if t is not None:
                    t.params = None

    def take_recompute(self) -> dict[str, str]:
        out, self.recompute = self.recompute, {}
        return out

    def _apply_one(self, req_id: str, out: Outcome) -> None:
        t = self.tracked.get(req_id)
        req = t.request if t is not None else None
        if t is None or req is None or req.is_finished() or t.pending != out.seq:
            self.events.event("stale_reports")
            return
        t.pending = None
        self.blocks.release_queries(t)  # the round read its window's queries
        if not isinstance(out, Round):
            self._give_back(t)
            self._failed_or_noop(req_id, t, out)
            return
        fresh = self.blocks.private_of(t, out.seq)
        released = self.blocks.evicting.rewrite(req_id, out.freed, out.replaced, {b.block_id: b for b in fresh})
        if released is None:  # the request's table no longer matches the report
            self._give_back(t)
            self.events.event("stale_reports")
            return
        self.blocks.release_private(t, keep={new for _, _, new in out.replaced})
        # freed: blocks whose last reference this was (a shared or cached-prefix block stays with others)
        freed = [b for b in released if b.ref_cnt == 0]
        if out.replaced:
            self.events.event("private_blocks", len(out.replaced))
            self.contexts.leave(t)  # copy on write: it holds its own copy of the kept pages now
        if t.publishing is not None and self.contexts.publish(t, out, self.blocks.of(req_id)):
            self.events.stats.add("shared_contexts", 1)
        if self.blocks.caching:  # its blocks now hold KV computed over a compressed cache: never hash them
            self.blocks.stop_hashing(req_id)
        if not t.compacted:
            self.events.event("evicted_requests")
        t.compacted = True
        t.region_blocks = out.region_blocks
        self.events.event("rounds")
        self.events.event("freed_blocks", len(freed))
        self.events.totals.round_done(req_id, out.kept_blocks, out.region_blocks, len(freed))
        t.rounds += 1
        t.last_round = (out.kept_blocks, out.region_blocks)
        if t.first_round_at is None:
            t.first_round_at = t.round_tokens
        logger.debug("kv_eviction: %s round %d keeps %d blocks, region ends at %d, freed %d", req_id,
                     out.seq, out.kept_blocks, out.region_blocks, len(freed))

    def _give_back(self, t: Tracked) -> None:
        self.blocks.release_private(t)
        self.contexts.release(t)

    def _failed_or_noop(self, req_id: str, t: Tracked, out: Outcome) -> None:
        if isinstance(out, Noop):
            if not t.compacted:
                t.retry_at = round_clock.retry_after_noop(t.retry_at, t.request.num_computed_tokens, t.interval,
                                                          self.blocks.block_size)
            return
        t.params = None  # no more rounds: served as it is, or recomputed densely
        if isinstance(out, PlanFailed):  # nothing moved
            self.events.fail(req_id, "plan", out.reason)
        elif isinstance(out, Recompute):
            self.events.fail(req_id, "apply", out.reason)
            self.recompute[req_id] = out.reason
