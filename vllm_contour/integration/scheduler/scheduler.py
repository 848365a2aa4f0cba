"""The plugin's scheduler class (``SchedulerConfig.scheduler_cls``): vLLM's scheduler plus what a KV
connector cannot do alone.

- A request whose attention op failed in this step (its sampled token is wrong) is finished alone with
  ``FINISHED_ERROR`` before its output of the step is delivered; the client gets an error, the rest of the
  batch goes on.
- A request whose round failed after bytes moved (its cache no longer matches any layout) is preempted and
  recomputed from its tokens, without eviction; its output so far is kept (it was computed before the
  round ran).
- A prefix-cache hit is cut where a round needs the tokens computed (``_get_local_prefix_cache_hit``;
  ``SchedulerSide.limit_hit``): a query-aware request computes the observation window of its first round
  (the queries its policy scores with), a request with a context boundary still to compress prefills from
  that boundary (its question is computed over the compressed context).
- A new request whose first ``C`` tokens and settings match a shared compressed context takes it as its
  local prefix-cache hit (``SchedulerSide.shared_hit``; ``shared_contexts.py``); ``reset_prefix_cache``
  drops those contexts too.
- A prefill chunk of a request with a context boundary (``kv_context_len``, query-agnostic) stops at the
  boundary, so the context is compressed before the question is computed (``_reserve_prefill_lookahead``
  is the per-request chunk-size hook vLLM's scheduler calls for running and waiting requests alike); a
  request whose context is being reconstructed (KVzip) computes nothing until its round.
- Hidden requests that reconstruct a context (``reconstruction/scheduler.py``) are added and aborted between steps;
  their outputs never reach a client.
Everything else is vLLM's own ``Scheduler``.
"""

from __future__ import annotations

import time

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from vllm_contour.integration.messages import ContourReport

logger = init_logger("vllm.contour")


class ContourScheduler(Scheduler):
    def _contour_side(self):
        return getattr(self.connector, "scheduler_side", None)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        side = self._contour_side()
        return n if side is None else side.prefill.cap_chunk(request, num_computed_tokens, n)

    def schedule(self, *args, **kwargs):
        side = self._contour_side()
        if side is not None:
            self._hidden_requests(side)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            side = self._contour_side()
            if side is not None:
                side.end_schedule()

    def _hidden_requests(self, side) -> None:
        """Hidden requests that reconstruct a context (``reconstruction/scheduler.py``) come and go between steps."""
        recon = side.recon
        aborts = [r for r in recon.take_aborts() if r in self.requests]
        if aborts:
            self.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        for req in recon.take_new():
            self.add_request(req)

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        side = self._contour_side()
        if side is not None:
            side.reset_shared()
        return super().reset_prefix_cache(*args, **kwargs)

    def _get_local_prefix_cache_hit(self, request, *args, **kwargs):
        # vLLM >= 0.33 also passes max_cache_hit_length (the most a hit may cover), positionally
        blocks, n, boundary, diverged = super()._get_local_prefix_cache_hit(request, *args, **kwargs)
        side = self._contour_side()
        if side is None:
            return blocks, n, boundary, diverged
        cap = args[0] if args else kwargs.get("max_cache_hit_length")
        shared = side.prefill.shared_hit(request)
        if shared is not None and (cap is None or shared[1] <= cap):  # a shared compressed context: its blocks
            table, c = shared  # vLLM counts it in its prefix-cache hits and the request's cached tokens
            return self.kv_cache_manager.create_kv_cache_blocks((table,)), c, 0, False
        if n == 0:
            return blocks, n, boundary, diverged
        m = side.prefill.limit_hit(request, n)
        if m < n:  # limit_hit returns whole blocks
            blocks = self.kv_cache_manager.truncate_computed_blocks(blocks, m)
            n = m
        return blocks, n, boundary, diverged

    def update_from_output(self, scheduler_output, model_runner_output):
        side = self._contour_side()
        errors: list = []
        if side is not None:
            kvo = model_runner_output.kv_connector_output
            report = kvo.kv_connector_worker_meta if kvo is not None else None
            if isinstance(report, ContourReport) and report.forward_errors:
                ids = [r for r in report.forward_errors if r in self.requests]
                side.note_forward_errors({r: report.forward_errors[r] for r in ids})
                errors = self.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if side is None:
            return outputs
        if side.recon.companions:  # no client sees a hidden reconstruction request
            hidden = side.recon.is_companion
            for eco in outputs.values():
                eco.outputs = [o for o in eco.outputs if not hidden(o.request_id)]
                if eco.finished_requests:
                    eco.finished_requests = {r for r in eco.finished_requests if not hidden(r)}
        for req in errors:
            out = EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                   finish_reason=req.get_finished_reason(), events=req.take_events(),
                                   trace_headers=req.trace_headers)
            eco = outputs.get(req.client_index)
            if eco is None:
                outputs[req.client_index] = EngineCoreOutputs(outputs=[out])
            else:
                eco.outputs.append(out)
        recompute = side.take_recompute()
        if recompute:
            now = time.monotonic()
            for req_id, reason in recompute.items():
                req = self.requests.get(req_id)
                if req is None or req.status != RequestStatus.RUNNING or req not in self.running:
                    continue
                self.running.remove(req)
                self._preempt_request(req, now)
                # resumed in a later step as a fresh prefill (the runner must not reuse its cached state)
                self.prev_step_scheduled_req_ids.discard(req_id)
                logger.warning("kv_eviction: %s is recomputed without eviction (%s)", req_id, reason)
        return outputs
