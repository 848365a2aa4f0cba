"""The step's eviction rounds on a worker, after the forward (all layers' KV written). Every round is planned
first (policy, allocation, layout, moment pages, bounds; nothing written; decode-time rounds with the same
eviction parameters in one policy pass, each plan the one its request gets alone): a plan that fails leaves
its request exactly as it was and is reported ``plan_failed``. Then the bytes of all planned rounds move
together (``evictor.apply_rounds``: one compaction per layer for every request due in the step); a failure
from there on is reported ``recompute`` for the rounds that moved bytes in place and their state is dropped,
so the scheduler recomputes them densely. Nothing here raises into vLLM's engine loop.
"""

from __future__ import annotations

import json
import time

import torch
from vllm.logger import init_logger

from vllm_contour import ops
from vllm_contour.evictor import RoundPlan, RoundRequest, apply_rounds, clear_moment_pages, plan_rounds
from vllm_contour.integration.messages import Noop, Outcome, PlanFailed, Recompute, Round, RoundItem
from vllm_contour.integration.metrics import ContourStats
from vllm_contour.integration.reconstruction.record import record_dir, record_round
from vllm_contour.integration.reconstruction.worker import ContextScores
from vllm_contour.integration.worker.requests import WorkerRequests
from vllm_contour.ops.paged import dims
from vllm_contour.policies import build_policy

logger = init_logger("vllm.contour")

Views = list[tuple[torch.Tensor, torch.Tensor]]
Planned = tuple[RoundItem, RoundPlan, float]  # (item, plan, its planning seconds)


def clear_unread(views: Views, requests: WorkerRequests, layout, owner: str) -> None:
    """Zero a layout's moment pages (raw fp32 bits, NaN patterns in bf16 slots) once nothing reads them:
    no shared compressed context and no request on this worker holds the layout any more."""
    if layout is None or layout.moment_page_ids is None or requests.reads(layout):
        return
    try:
        clear_moment_pages(views, layout)
    except Exception as e:  # never into vLLM
        logger.warning("kv_eviction: %s: could not clear its moment pages (%s)", owner, e)


class WorkerRounds:
    def __init__(self, requests: WorkerRequests, scores: ContextScores):
        self.requests = requests
        self.scores = scores
        self.query_shape: tuple[int, int, torch.dtype] | None = None  # (query heads, head dim, dtype)
        self._policies: dict[tuple, object] = {}

    def run(self, items: list[RoundItem], views: Views, scale: float, layers: tuple[int, int] | None,
            report: dict[str, Outcome], stats: ContourStats) -> None:
        """Plan every round, move the planned ones together, put each request's outcome into ``report``."""
        planned = self.plan_all(items, views, scale, layers, report, stats)
        self.apply_all(planned, views, report, stats)

    def apply_all(self, planned: list[Planned], views: Views, report: dict[str, Outcome],
                  stats: ContourStats) -> None:
        """Move the bytes of the planned rounds together (one compaction per layer)."""
        if not planned:
            return
        t0 = time.perf_counter()
        try:
            apply_rounds(views, [plan for _, plan, _ in planned])
        except Exception as e:
            for item, plan, _ in planned:
                report[item.req_id] = self._apply_failed(item, plan, f"{type(e).__name__}: {e}", views)
            return
        share = (time.perf_counter() - t0) / len(planned)
        for item, plan, plan_seconds in planned:
            try:
                report[item.req_id] = self._applied(item, plan, views, stats, plan_seconds, share)
            except Exception as e:  # its bytes moved, its state did not follow: recomputed densely
                report[item.req_id] = self._apply_failed(item, plan, f"{type(e).__name__}: {e}", views)
        if len(planned) > 1:
            stats.add("batched_rounds", len(planned))

    def _policy(self, params):
        key = (params.policy, params.sink_tokens, params.recent_window,
               json.dumps(params.policy_args, sort_keys=True))
        pol = self._policies.get(key)
        if pol is None:
            if len(self._policies) > 256:
                self._policies.clear()
            pol = self._policies[key] = build_policy(params.policy, params.policy_args,
                                                     sink_tokens=params.sink_tokens,
                                                     recent_window=params.recent_window)
        return pol

    def plan_all(self, items: list[RoundItem], views: Views, scale: float, layers, report: dict,
                 stats: ContourStats) -> list[Planned]:
        """Plan every round: decode-time rounds with the same eviction parameters as one (``plan_rounds``: each
        request's input, its kept tokens and tail, is alive until the joint selection), first rounds and the
        rounds of a group whose joint plan fails one by one (so a failure stays with its request)."""
        groups: dict[tuple, list[RoundItem]] = {}
        alone = []
        for item in items:
            if self.requests.layout_of(item.req_id) is None:  # a first round reads the whole prompt
                alone.append(item)
            else:  # decode-time rounds (inputs of the budget's size) with equal parameters
                groups.setdefault((repr(item.params), item.budget), []).append(item)
        planned = []
        for group in groups.values():
            if len(group) == 1:
                alone += group
                continue
            try:
                plans = plan_rounds(views, [self._request(item, views) for item in group], group[0].params,
                                    group[0].budget, scale, self._policy(group[0].params), layers)
            except Exception:
                alone += group
                continue
            stats.add("rounds_planned_together", len(group))
            for item, plan in zip(group, plans):
                if plan is None:
                    report[item.req_id] = Noop(item.seq)
                else:
                    planned.append((item, plan, plan.seconds))
        return planned + [p for p in (self.plan_one(item, views, scale, layers, report) for item in alone)
                          if p is not None]

    def _request(self, item: RoundItem, views: Views) -> RoundRequest:
        rs = self.requests.state_for(item.req_id)
        queries, qpos = self._window_queries(rs.window, views) if rs.window is not None else (None, None)
        recon = self.scores.for_round(item) if self._policy(item.params).needs_reconstruction else None
        rec = record_dir()
        if rec is not None and recon is not None and rs.layout is None:  # a surrogate's training data
            record_round(rec, item.req_id, item.block_ids, views, recon)
        return RoundRequest(item.block_ids, item.num_tokens, rs.layout, queries, qpos, item.fresh_ids, recon)

    def _window_queries(self, win, views: Views):
        """``({layer: [Hq, w, D]}, positions [w])`` of the window positions captured, read from its pages."""
        pos = win.positions()
        if not pos:
            return None, None
        hq, d, qdt = self.query_shape
        _, h, _, _ = dims(views[0][0])
        dev = views[0][0].device
        ids = (torch.tensor(win.pages, dtype=torch.int64).view(-1, 1) * h + torch.arange(h)).reshape(-1).to(dev)
        n = win.round_at - win.start
        rows = torch.tensor([p - win.start for p in pos], dtype=torch.int64, device=dev)
        out = {}
        for layer, (kc, vc) in enumerate(views):
            if not win.pages:  # the whole window was in the step that runs the round
                q = win.held[layer].to(dev)
            else:
                raw = ops.read_page_elems(kc, vc, ids)
                q = raw.view(torch.uint8)[: n * hq * d * qdt.itemsize].view(qdt).view(n, hq, d)
            out[layer] = q[rows].permute(1, 0, 2).contiguous()
        return out, torch.tensor(pos, dtype=torch.int64, device=dev)

    def plan_one(self, item: RoundItem, views: Views, scale: float, layers, report: dict) -> Planned | None:
        """-> ``(item, plan, seconds)``, or None with the outcome reported (nothing to evict, or failed)."""
        t0 = time.perf_counter()
        try:
            (plan,) = plan_rounds(views, [self._request(item, views)], item.params, item.budget, scale,
                                  self._policy(item.params), layers)
        except Exception as e:
            report[item.req_id] = PlanFailed(item.seq, f"{type(e).__name__}: {e}")
            return None
        if plan is None:
            report[item.req_id] = Noop(item.seq)
            return None
        return item, plan, time.perf_counter() - t0

    def _apply_failed(self, item: RoundItem, plan: RoundPlan, reason: str, views: Views) -> Outcome:
        if plan.fresh:  # only the private blocks were written: the request's cache is as it was
            return PlanFailed(item.seq, f"apply: {reason}")
        self.requests.drop(item.req_id)  # its cache no longer matches any layout: the scheduler recomputes it
        for lay in (plan.prev, plan.layout):
            clear_unread(views, self.requests, lay, item.req_id)
        return Recompute(item.seq, reason)

    def _applied(self, item: RoundItem, plan: RoundPlan, views: Views, stats: ContourStats, plan_seconds: float,
                 apply_seconds: float) -> Outcome:
        layout = plan.layout
        bs = dims(views[0][0])[2]
        last = item.block_ids[(item.num_tokens - 1) // bs] if item.num_tokens > 0 else None
        self.requests.set_layout(item.req_id, layout, item.num_tokens, last)
        stats.add("policy_seconds", plan_seconds)
        stats.add("compact_seconds", apply_seconds)
        if plan.prev is not None:
            stats.add("later_round_seconds", plan_seconds + apply_seconds)
        stats.add("tokens_evicted", plan.evicted_tokens / max(1, layout.num_layers * layout.num_kv_heads))
        stats.observe("round_seconds", plan_seconds + apply_seconds)
        return Round(item.seq, layout.region_blocks, layout.kept_blocks,
                     freed=tuple(zip(plan.freed_slots, plan.freed_blocks)), replaced=tuple(map(tuple, plan.replaced)),
                     published=self._publish(item, layout, views))

    def _publish(self, item: RoundItem, layout, views: Views) -> int | None:
        """Keep a context round's layout (and a snapshot of its partial block, copied before any question
        token is written into it) as a shared compressed context; None when there is none or it failed."""
        if item.publish is None:
            return None
        eid, src, dst = item.publish
        try:
            if src is not None:
                ops.copy_blocks(views, [(src, dst)])
            self.requests.shared[eid] = layout
            return eid
        except Exception as e:
            logger.warning("kv_eviction: %s: the compressed context is not shared (%s)", item.req_id, e)
            return None
