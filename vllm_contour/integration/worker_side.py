"""Worker side of eviction: after the step's forward (all layers' KV written), run the step's rounds and
report their outcomes; keep the captured window queries; check at start-up that eviction can run here.

A round is planned completely first (policy, allocation, layout, moment pages, bounds; nothing written);
a plan that fails leaves the request exactly as it was and is reported ``plan_failed``. Then the bytes
move (moments, compaction, moment storage, only through ``ops``); a failure from there on is reported
``recompute`` and the request's state is dropped, so the scheduler recomputes it densely. Nothing here
raises into vLLM's engine loop.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from vllm_contour import ops
from vllm_contour.budget import CacheShape, request_budget
from vllm_contour.config import EvictionConfig
from vllm_contour.evictor import FaultInjected, apply_round, clear_moment_pages, plan_round
from vllm_contour.integration.metrics import ContourStats
from vllm_contour.integration.reports import ContourMetadata, ContourReport
from vllm_contour.integration.state import QueryRing, RoundItem, worker_state
from vllm_contour.policies import build_policy

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.contour")

FAULTS_ENV = "VLLM_CONTOUR_FAULTS"


class FaultSwitch:
    """TEST ONLY. ``VLLM_CONTOUR_FAULTS="plan=0.2,apply=0.1,seed=0"`` makes that share of rounds fail while
    planning (nothing written) or raise in the middle of compaction (after the first layer moved). Off by
    default; chosen per (request, round) by a hash, so a run is reproducible. ``only=PREFIX`` limits those
    random failures to requests whose id starts with PREFIX. ``at=KIND:ID:N`` (repeatable; ID may end with
    ``*``, a prefix) names one failure of one request, which then gets no random ones: KIND ``plan`` or
    ``apply`` fails its round N; ``forward`` reports its attention op failed, ``metadata`` its compacted rows'
    page table unbuildable, in the N-th step it runs compacted. ``layout=scramble`` makes the start-up layout
    probe see vLLM's cache write through a scrambled page (an unknown layout)."""

    def __init__(self, spec: str | None):
        self.rates: dict[str, float] = {}
        self.seed = "0"
        self.only = ""
        self.at: list[tuple[str, str, int]] = []
        self._steps: dict[tuple[str, str], int] = {}
        self.scramble_layout = False
        for part in (spec or "").split(","):
            if not part.strip():
                continue
            key, _, value = part.partition("=")
            key = key.strip()
            if key == "seed":
                self.seed = value.strip()
            elif key in ("plan", "apply"):
                self.rates[key] = float(value)
            elif key == "only":
                self.only = value.strip()
            elif key == "at" and value.count(":") == 2 and \
                    value.split(":")[0].strip() in ("plan", "apply", "forward", "metadata"):
                kind, rid, n = (x.strip() for x in value.split(":"))
                self.at.append((kind, rid, int(n)))
            elif key == "layout" and value.strip() == "scramble":
                self.scramble_layout = True
            else:
                raise ValueError(f"{FAULTS_ENV}: unknown key {key!r} (plan, apply, seed, only, "
                                 "at=plan|apply|forward|metadata:ID:N, layout=scramble)")

    @property
    def on(self) -> bool:
        return bool(self.rates) or self.scramble_layout or bool(self.at)

    def _named(self, stable: str) -> list[tuple[str, int]]:
        return [(k, n) for k, rid, n in self.at if rid == stable or (rid.endswith("*") and stable.startswith(rid[:-1]))]

    def hit(self, kind: str, req_id: str, seq: int) -> bool:
        stable = re.sub(r"-[0-9a-f]{8}$", "", req_id)  # vLLM appends a random suffix to the caller's id
        named = self._named(stable) if self.at else []
        if named:
            return (kind, seq) in named
        rate = self.rates.get(kind, 0.0)
        if rate <= 0 or not stable.startswith(self.only):
            return False
        h = hashlib.sha256(f"{self.seed}/{kind}/{stable}/{seq}".encode()).digest()
        return int.from_bytes(h[:8], "little") / 2 ** 64 < rate

    def step_errors(self, req_ids, st) -> dict[str, str]:
        """``forward`` / ``metadata`` failures of this step (what the attention backend reports when a compacted
        row's ragged op or page table fails), for the named requests among ``req_ids`` that run compacted."""
        out: dict[str, str] = {}
        for req_id in req_ids if self.at else ():
            rs = st.requests.get(req_id)
            if rs is None or rs.layout is None:
                continue
            stable = re.sub(r"-[0-9a-f]{8}$", "", req_id)
            for kind, n in self._named(stable):
                if kind in ("forward", "metadata"):
                    c = self._steps[(kind, stable)] = self._steps.get((kind, stable), 0) + 1
                    if c == n:
                        out[req_id] = ("ragged decode" if kind == "forward" else "metadata") + ": fault switch"
        return out


class WorkerSide:
    def __init__(self, vllm_config: "VllmConfig", config: EvictionConfig,
                 layer_names: tuple[str, ...] | None = None):
        self.vllm_config = vllm_config
        self.layer_names = layer_names  # the full-attention layers (a hybrid model's others are vLLM's)
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self._layer_caches: list[tuple[str, torch.Tensor]] = []
        self._views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._shape: CacheShape | None = None
        self._scale: float | None = None
        self._report: dict[str, dict] = {}
        self._stats = ContourStats()
        self._policies: dict[tuple, object] = {}
        self.faults = FaultSwitch(os.environ.get(FAULTS_ENV))
        if self.faults.on:
            logger.warning("kv_eviction: TEST-ONLY fault switch %s=%s is on", FAULTS_ENV, os.environ[FAULTS_ENV])

    # ------------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Every "can eviction run here" check happens here, at engine start: the cache layout probe (an
        unknown layout stops the engine with a message naming dtype and ISA), one attention scale for all
        layers, the ops' implementations (missing C++ kernels: a warning, the torch reference runs)."""
        from vllm.model_executor.models.utils import extract_layer_index

        from vllm_contour.integration.backend import layer_kv_views, layer_layout
        from vllm_contour.ops.paged import dims

        named = sorted(((n, kv) for n, kv in kv_caches.items() if self.layer_names is None or n in self.layer_names),
                       key=lambda kv: extract_layer_index(kv[0]))
        self._layer_caches = named
        st = worker_state()
        st.layer_index = {name: i for i, (name, _) in enumerate(named)}
        self._views = [layer_kv_views(kv, scramble=self.faults.scramble_layout) for _, kv in named]
        k0 = self._views[0][0]
        _, heads, bs, hd = dims(k0)
        self._shape = CacheShape(block_size=bs, num_kv_heads=heads, head_dim=hd, elem_size=k0.element_size())
        self._layer_scale()  # layers with different attention scales cannot share one round: stop here
        impls = ops.implementations("cpu")
        self._stats.info("ops", impls)
        from vllm_contour.ops import cpu_ext

        if impls["ragged_decode_attention"] == "torch" or impls["compact"] == "torch":
            logger.warning("kv_eviction: the C++ kernels (vllm_contour._C) are not loaded (%s); eviction falls "
                           "back to the torch reference ops: decoding compacted requests is ~4-7x slower than "
                           "vLLM's own kernel. Reinstall with `pip install --no-build-isolation -e .` to build "
                           "them.", cpu_ext.LOAD_ERROR or "VLLM_CONTOUR_OPS_IMPL forces torch")
        lay = layer_layout(named[0][1], scramble=self.faults.scramble_layout)
        logger.info("kv_eviction: worker ready (pid %d): %d layers, %d KV heads, head dim %d, block %d, %s, "
                    "cache layout %s (key %s, value %s); ops %s", os.getpid(), len(named),
                    self._shape.num_kv_heads, self._shape.head_dim, self._shape.block_size, k0.dtype, lay.source,
                    lay.key, lay.value, impls)

    def _layer_scale(self) -> float:
        if self._scale is None:
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention import Attention

            layers = get_layers_from_vllm_config(self.vllm_config, Attention, [n for n, _ in self._layer_caches])
            scales = {float(layer.impl.scale) for layer in layers.values()}
            if len(scales) != 1:
                raise ValueError(f"kv_eviction: layers use different attention scales {scales}")
            self._scale = scales.pop()
        return self._scale

    def _policy(self, params):
        import json

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

    # ------------------------------------------------------------------ every step
    def begin_step(self, md: ContourMetadata) -> None:
        st = worker_state()
        try:
            for req_id in md.dropped:
                self._release_layout(req_id)
            st.step_keys = {}
            for req_id, (key, epoch) in md.keys.items():
                st.state_for(req_id, epoch)  # a request that started over loses its old state here
                st.step_keys[key] = req_id
            missing = {}
            for req_id, eid in md.adopt.items():  # it starts with a shared compressed context
                layout = st.shared.get(eid)
                if layout is None:
                    missing[req_id] = f"shared compressed context {eid} is not on this worker"
                else:
                    st.state_for(req_id).layout = layout
            for eid in md.shared_dropped:  # after the adoptions: one may name an entry dropped in this step
                self._clear_unread(st.shared.pop(eid, None), f"shared context {eid}")
            st.rounds_now = {it.req_id: it for it in md.rounds}
            st.captures = {c.req_id: c for c in md.capture}
            for c in md.capture:
                rs = st.state_for(c.req_id)
                if rs.ring is None or rs.ring.window != c.window:
                    rs.ring = QueryRing(c.window)
            st.staged, st.staged_rows, st.forward_errors = {}, None, missing
            st.forward_errors.update(self.faults.step_errors(md.keys, st))  # TEST ONLY (off: nothing)
        except Exception as e:  # never into vLLM: forget this step's work, keep serving
            logger.warning("kv_eviction: could not start the step (%s); no round this step", e)
            st.rounds_now, st.captures = {}, {}
            # compacted rows must still reach the ragged op; if even their keys cannot be read, they fail alone
            try:
                st.step_keys = {key: req_id for req_id, (key, _) in md.keys.items()}
            except Exception:
                st.forward_errors = {r: f"step start: {e}" for r in st.compacted()}

    def _release_layout(self, req_id: str) -> None:
        """Forget a request (finished, preempted, recomputed) and zero its moment pages unless a shared
        compressed context or another request still reads them: its blocks go back to vLLM's pool."""
        st = worker_state()
        rs = st.requests.get(req_id)
        st.drop(req_id)
        self._clear_unread(rs.layout if rs is not None else None, req_id)

    def _clear_unread(self, layout, owner: str) -> None:
        """Zero a layout's moment pages (raw fp32 bits, NaN patterns in bf16 slots) once nothing reads them:
        no shared compressed context and no request on this worker holds the layout any more."""
        if layout is None or layout.moment_page_ids is None:
            return
        st = worker_state()
        if any(x is layout for x in st.shared.values()) or any(o.layout is layout for o in st.requests.values()):
            return
        try:
            clear_moment_pages(self._views, layout)
        except Exception as e:  # never into vLLM
            logger.warning("kv_eviction: %s: could not clear its moment pages (%s)", owner, e)

    def after_forward(self) -> None:
        st = worker_state()
        try:
            self._store_captures()
        except Exception as e:
            logger.warning("kv_eviction: could not store captured queries (%s)", e)
        for req_id, item in list(st.rounds_now.items()):
            self._run_round(item)
        st.rounds_now = {}
        st.captures = {}
        st.step_keys = {}
        st.staged, st.staged_rows = {}, None
        self._stats.gauge("query_buffer_bytes", st.query_buffer_bytes())

    def _store_captures(self) -> None:
        st = worker_state()
        rows = st.staged_rows
        if rows is None or not st.staged:
            return
        layers = sorted(st.staged)
        stacked = torch.stack([st.staged[layer] for layer in layers])  # [L, n, Hq, D]
        for req_id, off, n, pos0 in rows.owners:
            rs = st.requests.get(req_id)
            if rs is None or rs.ring is None:
                continue
            rs.ring.write(torch.arange(pos0, pos0 + n), stacked[:, off : off + n])

    def _run_round(self, item: RoundItem) -> None:
        st = worker_state()
        req_id = item.req_id
        rs = st.state_for(req_id)
        prev = rs.layout
        t0 = time.perf_counter()
        try:
            if self.faults.hit("plan", req_id, item.seq):
                raise FaultInjected("fault switch: plan failed")
            budget = request_budget(item.params, self._shape, per_request=True)
            queries, qpos = rs.ring.layer_queries() if rs.ring is not None else (None, None)
            plan = plan_round(self._views, item.block_ids, item.num_tokens, item.params, budget,
                              self._layer_scale(), prev=prev, queries=queries, query_positions=qpos,
                              policy=self._policy(item.params), fresh_ids=item.fresh_ids)
        except Exception as e:
            self._report[req_id] = {"kind": "plan_failed", "seq": item.seq, "reason": f"{type(e).__name__}: {e}"}
            return
        if plan is None:
            self._report[req_id] = {"kind": "noop", "seq": item.seq}
            return
        t1 = time.perf_counter()
        try:
            fail_at = 0 if self.faults.hit("apply", req_id, item.seq) else None
            layout = apply_round(self._views, plan, fail_after_layer=fail_at)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            if plan.fresh:  # only the private blocks were written: the request's cache is as it was
                self._report[req_id] = {"kind": "plan_failed", "seq": item.seq, "reason": f"apply: {reason}"}
                return
            st.drop(req_id)  # its cache no longer matches any layout: the scheduler recomputes it
            for lay in (prev, plan.layout):
                self._clear_unread(lay, req_id)
            self._report[req_id] = {"kind": "recompute", "seq": item.seq, "reason": reason}
            return
        t2 = time.perf_counter()
        rs.layout = layout
        self._report[req_id] = {"kind": "round", "seq": item.seq, "region_blocks": layout.region_blocks,
                                "kept_blocks": layout.kept_blocks,
                                "freed": list(zip(plan.freed_slots, plan.freed_blocks)),
                                "replaced": plan.replaced, "published": self._publish(item, layout)}
        self._stats.add("policy_seconds", t1 - t0)
        self._stats.add("compact_seconds", t2 - t1)
        self._stats.add("tokens_evicted", plan.evicted_tokens / max(1, layout.num_layers * layout.num_kv_heads))
        self._stats.observe("round_seconds", t2 - t0)

    def _publish(self, item: RoundItem, layout) -> int | None:
        """Keep a context round's layout (and a snapshot of its partial block, copied before any question
        token is written into it) as a shared compressed context; None when there is none or it failed."""
        if item.publish is None:
            return None
        eid, src, dst = item.publish
        try:
            if src is not None:
                ops.copy_blocks(self._views, [(src, dst)])
            worker_state().shared[eid] = layout
            return eid
        except Exception as e:
            logger.warning("kv_eviction: %s: the compressed context is not shared (%s)", item.req_id, e)
            return None

    def take_report(self) -> ContourReport | None:
        st = worker_state()
        if not self._report and not st.forward_errors:
            return None
        report = ContourReport(self._report, st.forward_errors)
        self._report, st.forward_errors = {}, {}
        return report

    def take_stats(self) -> ContourStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, ContourStats()
        return out
