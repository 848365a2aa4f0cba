"""KV connector that carries eviction between vLLM's scheduler and its workers.

Scheduler role: decides which requests finish their prompt this step (the evict-now list), and applies
the workers' reports: blocks ``[K, E)`` of the request are replaced by vLLM's null block and returned to
the block pool, exactly as vLLM's own sliding-window managers free blocks mid-request.
Worker role: after the step's forward (``wait_for_save``) runs the policy and compaction for every
evict-now request and reports ``(K, E, key block)``; reports of all TP/PP ranks are merged with max K.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger

from vllm_contour.config import EvictionConfig, resolve_request
from vllm_contour.evictor import evict_request
from vllm_contour.integration.metrics import ContourPromMetrics, ContourStats
from vllm_contour.integration.state import CaptureItem, Compacted, EvictItem, worker_state
from vllm_contour.policies import build_policy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.contour")


@dataclass
class ContourMetadata(KVConnectorMetadata):
    evict: list[EvictItem] = field(default_factory=list)
    capture: list[CaptureItem] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)


class ContourReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: req_id -> (K, E, key block). Ranks agree on E and the key block; the
    scheduler frees from the largest K."""

    def __init__(self, entries: dict[str, tuple[int, int, int]] | None = None):
        self.entries = dict(entries or {})

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, ContourReport)
        merged = dict(self.entries)
        for req_id, (k, e, key) in other.entries.items():
            if req_id in merged:
                k0, e0, key0 = merged[req_id]
                if (e0, key0) != (e, key):
                    raise RuntimeError(f"ranks disagree on the compacted region of {req_id}")
                merged[req_id] = (max(k0, k), e, key)
            else:
                merged[req_id] = (k, e, key)
        return ContourReport(merged)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class EvictionStats:
    """Scheduler-side counters (what vLLM's pool actually got back)."""

    evicted_requests: int = 0
    freed_blocks: int = 0
    stale_reports: int = 0
    last: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # req -> (K, E, freed)


class ContourKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = EvictionConfig.from_additional_config(vllm_config.additional_config)
        self.block_size = vllm_config.cache_config.block_size
        if kv_cache_config is not None:
            groups = kv_cache_config.kv_cache_groups
            from vllm.v1.kv_cache_interface import FullAttentionSpec

            if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec) or \
                    getattr(groups[0].kv_cache_spec, "sliding_window", None):
                raise ValueError(
                    "kv_eviction: only models whose layers all use full attention (one KV cache group) "
                    f"are supported; this model has groups {[type(g.kv_cache_spec).__name__ for g in groups]}")
        # scheduler side
        self._requests: dict[str, "Request"] = {}
        self._handled: set[str] = set()
        self._params: dict[str, Any] = {}
        self._needs_queries: dict[str, bool] = {}
        self.stats = EvictionStats()
        # worker side
        self._layer_caches: list[tuple[str, torch.Tensor]] = []
        self._report: dict[str, tuple[int, int, int]] = {}
        self._scale: float | None = None
        self.timers = {"policy_s": 0.0, "compact_s": 0.0, "evictions": 0}
        self._stats = ContourStats()
        import os

        logger.info("kv_eviction: %s-side connector ready (pid %d): %s", role.name.lower(), os.getpid(),
                    self.config.to_dict())

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._requests[request.request_id] = request
        # (Re)admitted from the waiting queue: a resumed request re-prefills and is evicted again.
        self._handled.discard(request.request_id)

    def _request_params(self, req: "Request"):
        p = self._params.get(req.request_id)
        if p is None:
            p = resolve_request(self.config, req.sampling_params.extra_args if req.sampling_params else None)
            self._params[req.request_id] = p
        return p

    def _policy_needs_queries(self, name: str) -> bool:
        if name not in self._needs_queries:
            self._needs_queries[name] = build_policy(name).needs_queries
        return self._needs_queries[name]

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        dropped = set(scheduler_output.finished_req_ids or ())
        dropped |= set(scheduler_output.preempted_req_ids or ())
        for req_id in dropped:
            self._handled.discard(req_id)
            if req_id in scheduler_output.finished_req_ids:
                self._requests.pop(req_id, None)
                self._params.pop(req_id, None)
        items: list[EvictItem] = []
        captures: list[CaptureItem] = []
        scheduled = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        scheduled += list(scheduler_output.scheduled_cached_reqs.req_ids)
        for req_id in scheduled:
            if req_id in self._handled:
                continue
            req = self._requests.get(req_id)
            if req is None:
                continue
            n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            start, done = req.num_computed_tokens, req.num_computed_tokens + n_sched
            params = self._request_params(req)
            if not params.enabled:
                if start < req.num_tokens <= done:
                    self._handled.add(req_id)
                continue
            block_ids = None
            window_end = min(req.num_tokens, params.context_len or req.num_tokens)
            w_start = max(0, window_end - params.window)
            if self._policy_needs_queries(params.policy) and start < window_end and done > w_start:
                block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
                captures.append(CaptureItem(req_id, block_ids[0], w_start, window_end))
            if start < req.num_tokens <= done:
                # This step writes the KV of the last prompt (catch-up) token.
                self._handled.add(req_id)
                if block_ids is None:
                    block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
                items.append(EvictItem(req_id=req_id, block_ids=block_ids, num_tokens=req.num_tokens,
                                       params=params))
        return ContourMetadata(evict=items, capture=captures, dropped=dropped)

    def update_connector_output(self, connector_output) -> None:
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, ContourReport):
            return
        manager = self._kv_cache_manager.coordinator.single_type_managers[0]
        pool = self._kv_cache_manager.block_pool
        for req_id, (k, e, key) in report.entries.items():
            blocks = manager.req_to_blocks.get(req_id)
            req = self._requests.get(req_id)
            if (blocks is None or req is None or req.is_finished() or len(blocks) < e
                    or blocks[0].block_id != key):
                self.stats.stale_reports += 1
                self._stats.add("stale_reports", 1)
                continue
            freed = [b for b in blocks[k:e] if not b.is_null]
            for i in range(k, e):
                blocks[i] = pool.null_block
            pool.free_blocks(freed)
            self.stats.evicted_requests += 1
            self.stats.freed_blocks += len(freed)
            self._stats.add("evicted_requests", 1)
            self._stats.add("freed_blocks", len(freed))
            self.stats.last[req_id] = (k, e, len(freed))
            if len(self.stats.last) > 4096:
                self.stats.last.pop(next(iter(self.stats.last)))
            logger.info("kv_eviction: %s keeps blocks [0,%d) of %d, freed %d", req_id, k, e, len(freed))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._params.pop(request.request_id, None)
        self._handled.discard(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.utils import extract_layer_index

        named = sorted(kv_caches.items(), key=lambda kv: extract_layer_index(kv[0]))
        self._layer_caches = named
        st = worker_state()
        st.layer_index = {name: i for i, (name, _) in enumerate(named)}
        st.window = self.config.window

    def _cache_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from vllm_contour.integration.backend import layer_kv_views

        return [layer_kv_views(kv) for _, kv in self._layer_caches]

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        assert isinstance(kv_connector_metadata, ContourMetadata)
        md = kv_connector_metadata
        worker_state().begin_step(md.evict, md.capture, md.dropped)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None

    def _layer_scale(self) -> float:
        if self._scale is None:
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention import Attention

            layers = get_layers_from_vllm_config(self._vllm_config, Attention,
                                                 [n for n, _ in self._layer_caches])
            scales = {float(layer.impl.scale) for layer in layers.values()}
            if len(scales) != 1:
                raise ValueError(f"kv_eviction: layers use different attention scales {scales}")
            self._scale = scales.pop()
        return self._scale

    def wait_for_save(self):
        st = worker_state()
        if not st.evict_now:
            return
        views = self._cache_views()
        for req_id, item in list(st.evict_now.items()):
            cap = st.captures.get(req_id)
            res = evict_request(views, item.block_ids, item.num_tokens, item.params, self._layer_scale(),
                                queries=cap.layer_queries() if cap else None,
                                query_positions=cap.all_positions() if cap else None)
            st.captures.pop(req_id, None)
            if res is None:
                continue
            st.add_compacted(Compacted(req_id=req_id, key_block=item.block_ids[0], layout=res.layout,
                                       region_blocks=res.layout.region_blocks))
            self._report[req_id] = (res.layout.kept_blocks, res.layout.region_blocks, item.block_ids[0])
            self.timers["policy_s"] += res.seconds_policy
            self.timers["compact_s"] += res.seconds_compact
            self.timers["evictions"] += 1
            self._stats.add("policy_seconds", res.seconds_policy)
            self._stats.add("compact_seconds", res.seconds_compact)
            self._stats.add("prefill_tokens_evicted_from", item.num_tokens)
        st.evict_now = {}
        st.key_to_capture = {}

    def build_connector_worker_meta(self):
        if not self._report:
            return None
        report, self._report = ContourReport(self._report), {}
        return report

    def get_finished(self, finished_req_ids: set[str]):
        return None, None

    # ------------------------------------------------------------------ telemetry
    def get_kv_connector_stats(self):
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, ContourStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return ContourStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return ContourPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
