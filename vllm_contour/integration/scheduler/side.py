"""Scheduler side of eviction: when a request's round runs, which blocks go back to vLLM's pool, what a
request holds over its life, and which requests must be recomputed or fail alone.

Every step (``build_meta``), for each scheduled request that evicts (the clock is ``round_clock.py``):
- its next round is due when the tokens with KV after the step reach ``R``: the prompt end (or the end of
  a re-prefill) when the prompt alone passes ``budget + T``; otherwise ``budget + T`` (a short prompt is
  first compressed while it decodes); once compacted, ``E * block_size + T`` (the dense tail reached
  ``T``). ``T = 0``: only at the prompt end, once.
- query-aware policies get the window ``[R - W, R)`` captured as those tokens are computed.
- the blocks it holds (vLLM's own block list minus the null blocks eviction put in) are sampled for the
  mean / peak KV metrics.

Prefix caching (on by default, as in vLLM): a round never writes into a block another request can hit. When
any of a round's blocks carries a prefix-cache hash or is shared (reference count > 1), the scheduler
allocates private blocks for it from vLLM's pool; the worker reads the originals and packs the kept pages
into the private blocks, which take the first slots; every original is released with its hash (a later
request can still hit the dense prompt while it stays in the pool) and "freed" counts only the blocks whose
reference count reaches 0. After its first round a request's blocks are no longer hashed (their KV was
computed over a compressed cache, so a hit on them would not reproduce a dense prefill). A prefix hit is
limited (``limit_hit``) so that a context boundary still to compress is reached by the prefill, and so
that query-aware policies compute the window ``[R - W, R)`` whose queries they score with, unless the
request adopts a shared compressed context (``shared_hit``, ``shared_contexts.py``): the context round
of the first request publishes it, later ones start compacted from their first step.

Reports (``apply``) come back in the same step (``outcomes.py``); the request's blocks in vLLM's pool
are read and written through ``blocks.py`` (the evicting group's manager owns the table). Nothing
here raises into vLLM: a request whose handling fails is served without eviction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm_contour import round_clock
from vllm_contour.budget import CacheShape, decode_interval_for, request_budget
from vllm_contour.config import EvictionConfig, RequestEviction, request_settings
from vllm_contour.integration.scheduler.contexts import ContextPublisher
from vllm_contour.integration.metrics import ContourStats
from vllm_contour.integration.reconstruction.scheduler import ContextRounds, Reconstructions
from vllm_contour.integration.messages import ContourMetadata, ContourReport
from vllm_contour.integration.scheduler.blocks import RequestBlocks
from vllm_contour.integration.scheduler.dispatch import RoundDispatch
from vllm_contour.integration.scheduler.prefill import PrefillLimits
from vllm_contour.integration.scheduler.outcomes import RoundOutcomes
from vllm_contour.integration.scheduler.events import SchedulerEvents
from vllm_contour.integration.scheduler.records import Tracked
from vllm_contour.integration.scheduler.shared_contexts import SharedContexts
from vllm_contour.integration.messages import CaptureItem, RoundItem
from vllm_contour.policies import build_policy

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

logger = init_logger("vllm.contour")


class SchedulerSide:
    def __init__(self, config: EvictionConfig, block_size: int, shape: CacheShape | None, model_id: str = "",
                 group: int = 0, num_groups: int = 1, repeat_prompt=None, max_model_len: int | None = None,
                 query_blocks=None):
        self.config = config
        self.block_size = block_size
        self.shape = shape
        self.manager: "KVCacheManager | None" = None
        self.tracked: dict[str, Tracked] = {}
        self.events = SchedulerEvents()
        self.totals = self.events.totals
        self._policy_needs: dict[str, tuple[bool, bool]] = {}  # policy -> (needs queries, reconstructs)
        self.blocks = RequestBlocks(block_size, group, num_groups)
        self.shared = SharedContexts(block_size, model_id)
        self.contexts = ContextPublisher(self.shared, block_size)
        self.outcomes = RoundOutcomes(self.tracked, self.blocks, self.contexts, self.events)
        # repeat_prompt: () -> RepeatPrompt, from the model's tokenizer when a context is first reconstructed
        self.recon = Reconstructions(block_size, repeat_prompt, max_model_len)
        # query_blocks: window (tokens) -> blocks its queries take in vLLM's pool (budget.query_blocks_for)
        self.context_rounds = ContextRounds(self.recon, self.blocks, self.events)  # KVzip's round work
        self.dispatch = RoundDispatch(self.blocks, self.contexts, self.events, self.context_rounds,
                                      query_blocks or (lambda window: 1))
        # how much of a prefix hit and of a chunk a request may compute
        self.prefill = PrefillLimits(self.track, self.recon, self.contexts, self.events, block_size,
                                     lambda: self.manager)

    def bind(self, kv_cache_manager: "KVCacheManager") -> None:
        self.blocks.bind(kv_cache_manager)
        self.manager = kv_cache_manager
        self.contexts.bind(kv_cache_manager.block_pool)
        if self.blocks.caching and self.config.share_contexts and self.blocks.num_groups == 1:
            self.shared.bind(kv_cache_manager)

    def end_schedule(self) -> None:
        self.shared.end_schedule()

    def reset_shared(self) -> None:
        """vLLM's ``reset_prefix_cache``: compressed contexts and kept KVzip scores go too."""
        self.shared.drop_all()
        self.recon.drop_all_scores()

    # ------------------------------------------------------------------ request life
    def on_alloc(self, request: "Request") -> None:
        """(Re)admitted from the waiting queue: a resumed request re-prefills and starts over. A streaming-input
        session (vLLM's resumable requests) taking its next chunk keeps its blocks, compacted or not: its new
        tokens are prefilled over the kept cache (a multi-token step) and its next round comes as usual."""
        try:
            t = self.tracked.get(request.request_id)
            if t is not None and request.num_computed_tokens > 0 and getattr(request, "resumable", False):
                t.request = request
                t.prefill_end = t.chunk_end = request.num_tokens
                return
            t = self.track(request)
            self._reset(t, request)
            e = self.shared.adopted(request)
            if e is not None:
                self._adopt_entry(t, e)
        except Exception as e:  # never into vLLM: this request is served without eviction
            self.events.fail(request.request_id, "metadata", e)
            self.tracked[request.request_id] = Tracked(request, None)

    def _adopt_entry(self, t: Tracked, e) -> None:
        self.contexts.adopt(t, e)
        self.blocks.stop_hashing(t.request.request_id)
        self.events.event("evicted_requests")
        self.events.event("shared_hits", stat="shared_context_hits")
        self.events.stats.add("shared_context_hit_tokens", e.context_len)

    def track(self, request: "Request") -> Tracked:
        t = self.tracked.get(request.request_id)
        if t is None:
            t = self.tracked[request.request_id] = Tracked(request, self._resolve(request))
            t.asked = t.params
            t.prefill_end = request.num_tokens
            if t.params is not None:
                self._prepare(t)
        return t

    def _reset(self, t: Tracked, request: "Request") -> None:
        """A (re)admitted request prefills from scratch: nothing compacted, nothing in flight."""
        self._let_go(t)
        t.epoch += 1
        t.request = request
        t.prefill_end = request.num_tokens
        t.compacted, t.region_blocks, t.retry_at, t.pending, t.chunk_end = False, 0, 0, None, 0
        t.defer_to = 0
        t.prefill_tried = False

    def _resolve(self, request: "Request") -> RequestEviction | None:
        if self.recon.is_companion(request.request_id):  # a hidden request reconstructing a context
            return None
        extra = request.sampling_params.extra_args if request.sampling_params else None
        params = request_settings(self.config, extra)  # as the front end resolved them, when it did
        if not params.enabled:
            return None
        return params

    def _prepare(self, t: Tracked) -> None:
        if t.budget is None and self.shape is not None:
            t.budget = request_budget(t.params, self.shape, per_request=True)
            t.interval = decode_interval_for(t.params, self.block_size)
        name = t.params.policy
        if name not in self._policy_needs:
            pol = build_policy(name)
            self._policy_needs[name] = (pol.needs_queries, pol.needs_reconstruction)
        t.needs_queries, t.reconstructs = self._policy_needs[name]
        if t.reconstructs:  # the context is scored once, by its reconstruction: one round, no decode-time rounds
            t.interval = 0

    def finished(self, request: "Request") -> dict | None:
        """Forget a request; -> what eviction did to it (``Tracked.summary``), None for a request that did not
        evict."""
        if self.recon.is_companion(request.request_id):
            self.tracked.pop(request.request_id, None)
            owner = self.recon.companion_finished(request.request_id)
            t = self.tracked.get(owner) if owner is not None else None
            if t is not None:  # it ended before its repeat tokens were computed
                self.context_rounds.stop_reconstruction(t, f"hidden request {request.request_id} ended early")
            return None
        t = self.tracked.pop(request.request_id, None)
        out = None
        try:
            out = t.summary() if t is not None and t.asked is not None else None
        except Exception:  # never into vLLM
            out = None
        self.contexts.forget(request.request_id)
        if t is not None:
            self._let_go(t)
        if t is not None and t.params is not None and t.held.steps:
            self.events.stats.observe("request_mean_kv_tokens", t.held.mean()[0])
            self.events.stats.observe("request_peak_kv_tokens", t.held.peak)
            self.totals.finished(request.request_id, t.held)
        self.outcomes.recompute.pop(request.request_id, None)
        return out

    def _let_go(self, t: Tracked) -> None:
        """What a request holds for a round or a shared context goes back (it finished or starts over); a
        reconstruction of its context still running is aborted."""
        self.recon.owner_gone(t.request.request_id)
        self.blocks.release_private(t)
        self.blocks.release_queries(t)
        self.contexts.release(t)
        self.contexts.leave(t)

    # ------------------------------------------------------------------ every step
    def build_meta(self, scheduler_output) -> ContourMetadata:
        dropped = set(scheduler_output.finished_req_ids or ())
        dropped |= set(scheduler_output.preempted_req_ids or ())
        for req_id in scheduler_output.preempted_req_ids or ():
            t = self.tracked.get(req_id)
            if t is not None:  # its blocks are gone; it re-prefills from scratch when it comes back
                self._reset(t, t.request)
        rounds: list[RoundItem] = []
        captures: list[CaptureItem] = []
        self.blocks.entry_ids = self.shared.entry_block_ids() if self.shared.entries else set()
        cached = scheduler_output.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        keys: dict[str, tuple[int, int]] = {}
        row_keys = self._row_keys(computed)
        for req_id in computed:
            t = self.tracked.get(req_id)
            if t is not None and t.params is None and t.queries is not None:  # it stopped evicting
                self.blocks.release_queries(t)
            if t is None or (t.params is None and not t.compacted):
                continue
            try:
                if req_id in row_keys:
                    keys[req_id] = (row_keys[req_id], t.epoch)
                if t.params is not None:
                    self._prepare(t)
                    self.dispatch.step(t, scheduler_output.num_scheduled_tokens.get(req_id, 0), rounds, captures)
            except Exception as e:
                self.events.fail(req_id, "metadata", e)
                t.params = None
        recon = self.context_rounds.step(scheduler_output, self.tracked, keys, captures, rounds,
                                         self.dispatch.dispatch)
        adopt = self.contexts.take_adoptions(keys, self.tracked)
        if self.blocks.caching:
            for name, value in self.shared.gauges().items():
                self.events.stats.gauge(name, value)
        return ContourMetadata(rounds=rounds, capture=captures, dropped=dropped, keys=keys, row_keys=row_keys,
                               adopt=adopt,
                               shared_dropped=self.shared.take_dropped(), recon=recon,
                               scores_dropped=self.recon.take_dropped_scores())

    def _row_keys(self, computed: dict[str, int]) -> dict[str, int]:
        """Each scheduled request's row key: the block receiving its first new token of this step."""
        out = {}
        for req_id, n in computed.items():
            try:
                blocks = self.blocks.of(req_id)
                i = n // self.block_size
                if i < len(blocks) and not blocks[i].is_null:
                    out[req_id] = blocks[i].block_id
            except Exception:  # never into vLLM: that row is not matched this step
                pass
        return out

    def apply(self, report: ContourReport) -> None:
        """The workers' outcomes of this step's rounds (``outcomes.py``)."""
        self.outcomes.apply(report)

    def take_recompute(self) -> dict[str, str]:
        return self.outcomes.take_recompute()

    def note_forward_errors(self, errors: dict[str, str]) -> None:
        """Requests the plugin's scheduler finishes with an error (their output of the step is wrong)."""
        for req_id, reason in errors.items():
            self.events.forward_failed(req_id, reason)

    def take_stats(self) -> ContourStats | None:
        """This step's stats (vLLM asks after the step's outputs were processed), with the blocks requests
        hold read from vLLM's own free queue (its ``get_num_free_blocks`` counts blocks only shared compressed
        contexts hold as free): sent every step, so an idle server's gauge is fresh."""
        try:
            if self.manager is not None:
                used = self.blocks.used()
                only_shared = self.shared.reclaimable() if self.shared.entries else 0
                self.events.stats.data["g:pool_request_blocks"] = used - only_shared
        except Exception:  # never into vLLM
            pass
        return self.events.take()
