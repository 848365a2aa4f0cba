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
from vllm_contour.integration.reports import (ContourMetadata, ContourReport, Noop, Outcome, PlanFailed,
                                              Recompute, Round)
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
        self._stage_layers: tuple[int, int] | None = None
        self._report: dict[str, Outcome] = {}
        self._stats = ContourStats()
        self._policies: dict[tuple, object] = {}
        self.faults = FaultSwitch(os.environ.get(FAULTS_ENV))
        if self.faults.on:
            logger.warning("kv_eviction: TEST-ONLY fault switch %s=%s is on", FAULTS_ENV, os.environ[FAULTS_ENV])

    # ------------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Every "can eviction run here" check happens here, at engine start: the cache views of the
        attention backend in use (on CPU a layout probe: an unknown layout stops the engine with a message
        naming dtype and ISA), one attention scale for all layers, the ops' implementations (missing C++
        kernels: a warning, the torch reference runs); the kernel-ready page tables are made on the
        caches' device."""
        from vllm.model_executor.models.utils import extract_layer_index

        from vllm_contour.ops.paged import dims
        from vllm_contour.page_tables import PageTables

        named = sorted(((n, kv) for n, kv in kv_caches.items() if self.layer_names is None or n in self.layer_names),
                       key=lambda kv: extract_layer_index(kv[0]))
        self._layer_caches = named
        st = worker_state()
        st.layer_index = {name: i for i, (name, _) in enumerate(named)}
        impls = self._layers()
        views = getattr(next(iter(impls.values())).impl, "kv_views", None)
        if views is None:
            raise ValueError("kv_eviction: the attention backend in use is not the plugin's (another "
                             "--attention-backend?); eviction cannot run")
        self._views = [views(kv, scramble=self.faults.scramble_layout) for _, kv in named]
        k0 = self._views[0][0]
        _, heads, bs, hd = dims(k0)
        self._shape = CacheShape.of(block_size=bs, num_kv_heads=heads, head_dim=hd, dtype=k0.dtype)
        self._layer_scale()  # layers with different attention scales cannot share one round: stop here
        # a pipeline stage's layers are a slice of the model's: depth-dependent policies see the whole model
        # (a hybrid model's evicting layers are a subset of every stage's: they count among themselves)
        total = getattr(self.vllm_config.model_config.hf_text_config, "num_hidden_layers", None) or len(named)
        first = extract_layer_index(named[0][0])
        self._stage_layers = (0, len(named)) if len(named) < len(kv_caches) else (first, max(total, first + len(named)))
        st.tables = PageTables(len(named), heads, bs, named[0][1].shape[0], device=k0.device)
        self._check_query_buffers(len(named), k0)
        dev = k0.device.type
        op_impls = ops.implementations(dev)
        self._stats.info("ops", op_impls)
        from vllm_contour.ops import cpu_ext

        if dev == "cpu" and (op_impls["ragged_decode_attention"] == "torch" or op_impls["compact"] == "torch"):
            logger.warning("kv_eviction: the C++ kernels (vllm_contour._C) are not loaded (%s); eviction falls "
                           "back to the torch reference ops: decoding compacted requests is ~4-7x slower than "
                           "vLLM's own kernel. Reinstall with `pip install --no-build-isolation -e .` to build "
                           "them.", cpu_ext.LOAD_ERROR or "VLLM_CONTOUR_OPS_IMPL forces torch")
        logger.info("kv_eviction: worker ready (pid %d): %d layers, %d KV heads, head dim %d, block %d, %s on %s, "
                    "key view strides %s, value %s; ops %s", os.getpid(), len(named), self._shape.num_kv_heads,
                    self._shape.head_dim, self._shape.block_size, k0.dtype, k0.device, tuple(k0.stride()),
                    tuple(self._views[0][1].stride()), op_impls)

    def _check_query_buffers(self, num_layers: int, k0: torch.Tensor) -> None:
        """The window-query buffers live outside vLLM's pool: at most one per running request, each
        ``layers x query heads x window x head dim``. Their bound is counted at start-up, and on a GPU
        checked against the memory vLLM left free (a request asking for a larger window is refused)."""
        layer = next(iter(self._layers().values()))
        per_req = num_layers * layer.impl.num_heads * self.config.window * self._shape.head_dim * k0.element_size()
        bound = per_req * self.vllm_config.scheduler_config.max_num_seqs
        self._stats.gauge("query_buffer_bound_bytes", bound)
        if k0.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(k0.device)
            if bound > free:
                raise ValueError(
                    f"kv_eviction: the window-query buffers of {self.vllm_config.scheduler_config.max_num_seqs} "
                    f"requests need up to {bound / 2**20:.0f} MiB outside vLLM's KV pool, {free / 2**20:.0f} MiB "
                    "are free: lower --gpu-memory-utilization, --max-num-seqs or --kv-observation-window")
        logger.info("kv_eviction: window-query buffers: %.1f MiB per request, at most %.0f MiB", per_req / 2**20,
                    bound / 2**20)

    def _layers(self):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        return get_layers_from_vllm_config(self.vllm_config, Attention, [n for n, _ in self._layer_caches])

    def _layer_scale(self) -> float:
        if self._scale is None:
            scales = {float(layer.impl.scale) for layer in self._layers().values()}
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
            for req_id, (key, epoch) in md.keys.items():
                st.state_for(req_id, epoch)  # a request that started over loses its old state here
            missing = {}
            for req_id, eid in md.adopt.items():  # it starts with a shared compressed context
                layout = st.shared.get(eid)
                if layout is None:
                    missing[req_id] = f"shared compressed context {eid} is not on this worker"
                else:
                    st.set_layout(req_id, layout)
            for eid in md.shared_dropped:  # after the adoptions: one may name an entry dropped in this step
                self._clear_unread(st.shared.pop(eid, None), f"shared context {eid}")
            st.rounds_now = {it.req_id: it for it in md.rounds}
            st.captures = {c.req_id: c for c in md.capture if c.req_id in md.keys}
            for c in st.captures.values():
                rs = st.state_for(c.req_id)
                if rs.ring is None or rs.ring.window != c.window:
                    rs.ring = QueryRing(c.window)
            st.staged, st.forward_errors = {}, missing
            st.forward_errors.update(self.faults.step_errors(md.keys, st))  # TEST ONLY (off: nothing)
            keys = {r: key for r, (key, _) in md.keys.items()}
            st.step_reqs = st.tables.set_keys(keys, [(c.req_id, keys[c.req_id], c.start, c.end)
                                                     for c in st.captures.values()])
        except Exception as e:  # never into vLLM: forget this step's work, keep serving
            logger.warning("kv_eviction: could not start the step (%s); no round this step", e)
            st.rounds_now, st.captures, st.step_reqs = {}, {}, []
            # compacted rows cannot reach their kernel this step: they fail alone
            st.forward_errors = {r: f"step start: {e}" for r in st.compacted() if r in md.keys}

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
        st.rounds_now, st.captures, st.step_reqs = {}, {}, []
        st.staged, st.step = {}, None
        self._stats.gauge("query_buffer_bytes", st.query_buffer_bytes())

    def _store_captures(self) -> None:
        st = worker_state()
        cap = st.step.capture if st.step is not None else None
        if cap is None or not st.staged:
            return
        stacked = torch.stack([st.staged[layer] for layer in sorted(st.staged)])  # [L, total, Hq, D]
        off = 0
        for req_id, pos0, n in cap.owners:
            rs = st.requests.get(req_id)
            if rs is not None and rs.ring is not None and n > 0:
                rs.ring.write(torch.arange(pos0, pos0 + n, device=stacked.device), stacked[:, off : off + n])
            off += n

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
                              policy=self._policy(item.params), fresh_ids=item.fresh_ids,
                              layers=self._stage_layers)
        except Exception as e:
            self._report[req_id] = PlanFailed(item.seq, f"{type(e).__name__}: {e}")
            return
        if plan is None:
            self._report[req_id] = Noop(item.seq)
            return
        t1 = time.perf_counter()
        try:
            fail_at = 0 if self.faults.hit("apply", req_id, item.seq) else None
            layout = apply_round(self._views, plan, fail_after_layer=fail_at)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            if plan.fresh:  # only the private blocks were written: the request's cache is as it was
                self._report[req_id] = PlanFailed(item.seq, f"apply: {reason}")
                return
            st.drop(req_id)  # its cache no longer matches any layout: the scheduler recomputes it
            for lay in (prev, plan.layout):
                self._clear_unread(lay, req_id)
            self._report[req_id] = Recompute(item.seq, reason)
            return
        t2 = time.perf_counter()
        st.set_layout(req_id, layout)
        self._report[req_id] = Round(item.seq, layout.region_blocks, layout.kept_blocks,
                                     freed=tuple(zip(plan.freed_slots, plan.freed_blocks)),
                                     replaced=tuple(map(tuple, plan.replaced)), published=self._publish(item, layout))
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
