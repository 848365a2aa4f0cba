"""The KV connector vLLM loads: a thin adapter over the two rooms of eviction.

Scheduler role -> ``scheduler.side.SchedulerSide`` (when a request's round runs, which blocks go back to the
pool, what each request holds); worker role -> ``worker.side.WorkerSide`` (one per worker process: the
step's rows for the attention backend, the rounds after the forward, reports). The channel between them is
vLLM's connector metadata (scheduler -> workers) and worker metadata (workers -> scheduler, merged across
TP/PP ranks); ``messages.py`` holds both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

from vllm_contour.budget import CacheShape
from vllm_contour.config import EvictionConfig
from vllm_contour.integration.metrics import ContourPromMetrics, ContourStats
from vllm_contour.integration.messages import ContourMetadata, ContourReport
from vllm_contour.integration.scheduler.side import SchedulerSide
from vllm_contour.integration.worker.side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.contour")


@dataclass(frozen=True)
class EvictionGroup:
    """The KV cache group eviction works on and what the others are."""

    index: int  # its index among vLLM's KV cache groups
    num_groups: int
    layer_names: tuple[str, ...]
    shape: CacheShape


def eviction_group(kv_cache_config: "KVCacheConfig") -> EvictionGroup:
    """The one full-attention KV cache group. Hybrid models (e.g. Gemma 3: sliding-window layers and a few
    full-attention layers, in separate groups under vLLM's hybrid KV cache manager) evict in the
    full-attention group only; their sliding-window groups stay with vLLM's own manager, which frees the
    blocks that leave the window. Any other kind of group (Mamba, chunked local, ...) is refused at start-up."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    full = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)
            and not getattr(g.kv_cache_spec, "sliding_window", None)]
    others_ok = all(i in full or isinstance(g.kv_cache_spec, SlidingWindowSpec) for i, g in enumerate(groups))
    if len(full) != 1 or not others_ok:
        raise ValueError(
            "kv_eviction: supported are models whose layers use full attention, or full attention and sliding "
            f"windows (one full-attention KV cache group, the rest sliding-window); this model has groups {kinds}")
    g = groups[full[0]]
    spec = g.kv_cache_spec
    if any(o.kv_cache_spec.block_size != spec.block_size for o in groups):
        raise ValueError(f"kv_eviction: the KV cache groups use different block sizes "
                         f"{[o.kv_cache_spec.block_size for o in groups]}")
    shape = CacheShape.of(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                          dtype=spec.dtype)
    return EvictionGroup(full[0], len(groups), tuple(g.layer_names), shape)


def cache_shape(kv_cache_config: "KVCacheConfig") -> CacheShape:
    """The full-attention KV cache group's shape."""
    return eviction_group(kv_cache_config).shape


def _repeat_prompt(model_config):
    """KVzip's reconstruction prompt in the model's tokenizer (made when a context is first reconstructed)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    from vllm_contour.integration.reconstruction.prompt import RepeatPrompt

    return RepeatPrompt.from_tokenizer(cached_tokenizer_from_config(model_config))


def _query_blocks(vllm_config, group: EvictionGroup | None):
    """window -> blocks of vLLM's pool one request's window queries take (``budget.query_blocks_for``)."""
    from vllm_contour.budget import query_blocks_for

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    per_kv = max(1, mc.get_num_attention_heads(pc) // max(1, mc.get_num_kv_heads(pc)))
    bs = vllm_config.cache_config.block_size
    elem = group.shape.elem_size if group is not None else mc.dtype.itemsize
    return lambda window: query_blocks_for(window, per_kv, bs, mc.dtype.itemsize, elem)


class ContourKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = EvictionConfig.from_additional_config(vllm_config.additional_config)
        group = eviction_group(kv_cache_config) if kv_cache_config is not None else None
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            mc = vllm_config.model_config
            self.scheduler_side = SchedulerSide(self.config, vllm_config.cache_config.block_size,
                                                None if group is None else group.shape,
                                                model_id=f"{mc.model}@{mc.revision}",
                                                group=0 if group is None else group.index,
                                                num_groups=1 if group is None else group.num_groups,
                                                repeat_prompt=lambda: _repeat_prompt(mc),
                                                max_model_len=mc.max_model_len,
                                                query_blocks=_query_blocks(vllm_config, group))
        else:
            self.worker_side = WorkerSide(vllm_config, self.config,
                                          layer_names=None if group is None else group.layer_names)
        logger.info("kv_eviction: %s-side connector ready (pid %d): %s", role.name.lower(), os.getpid(),
                    self.config.to_dict())

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ------------------------------------------------------------------ scheduler role
    @property
    def totals(self):
        return self.scheduler_side.totals

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self.scheduler_side.on_alloc(request)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler_side.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, ContourReport):
            self.scheduler_side.apply(report)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once; an evicting request's report goes back to the client in the output's
        ``kv_transfer_params`` (``{"contour": ...}``, ``SchedulerSide.summary``)."""
        summary = self.scheduler_side.finished(request)
        return False, None if summary is None else {"contour": summary}

    def request_finished_all_groups(self, request: "Request", block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        if isinstance(kv_connector_metadata, ContourMetadata):
            self.worker_side.begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        self.worker_side.after_forward()

    def build_connector_worker_meta(self):
        return self.worker_side.take_report()

    def get_finished(self, finished_req_ids: set[str]):
        return None, None

    # ------------------------------------------------------------------ telemetry
    def get_kv_connector_stats(self):
        side = self.scheduler_side or self.worker_side
        return side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return ContourStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return ContourPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
