"""The attention backend with eviction on vLLM's CPU platform: vLLM's CPU backend (``CPU_ATTN``; its kernel
serves every ordinary row) with the row logic of ``common.py``; compacted tokens go to the C++ kernels.
The cache's page layout is the one vLLM's CPU cache-write op uses for the cache's dtype, block size and head
dim (probed once per combination, ``ops/cpu_layout.py``). Registered over ``CPU_ATTN``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_contour.integration.backends.common import ContourBackend, ContourBuilder, ContourImpl, eviction_enabled
from vllm_contour.integration.worker.step import StepField
from vllm_contour.ops.cpu_layout import PageLayout, cpu_kv_views, probe_layout


def layer_layout(kv_cache: torch.Tensor) -> PageLayout:
    """The page layout vLLM's CPU attention writes into this cache (its ISA for the cache's dtype, block
    size and head dim), probed once per combination (``cpu_layout.probe_layout``)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, _, bs, two_d = kv_cache.shape
    d = two_d // 2
    return probe_layout(_get_attn_isa(kv_cache.dtype, bs, d), kv_cache.dtype, bs, d)


def layer_kv_views(kv_cache: torch.Tensor):
    """Logical key/value views of one layer's CPU cache (``[B, H, bs, D]``, or the two-level form of
    packed layouts, see ``ops.paged``)."""
    return cpu_kv_views(kv_cache, layer_layout(kv_cache))


@dataclass
class ContourCPUAttentionMetadata(CPUAttentionMetadata, StepField):
    pass


class ContourCPUMetadataBuilder(ContourBuilder, CPUAttentionMetadataBuilder):
    metadata_cls = ContourCPUAttentionMetadata


class ContourCPUAttentionImpl(ContourImpl, CPUAttentionBackendImpl):
    kv_views = staticmethod(layer_kv_views)

    @staticmethod
    def _compacted_only(rows, attn_metadata) -> bool:
        # vLLM's CPU forward of decoder attention is its kernel alone when the backend declares its KV writes
        # apart (do_kv_cache_update); the span is known on the host, from the tables the step expanded
        if CPUAttentionBackend.forward_includes_kv_cache_update:
            return False
        try:
            return rows.compacted_span() == (0, attn_metadata.num_actual_tokens)
        except Exception:  # never into vLLM: its kernel runs
            return False


class ContourCPUAttentionBackend(ContourBackend, CPUAttentionBackend):
    """Registered over ``CPU_ATTN``."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return ContourCPUAttentionImpl if eviction_enabled() else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return ContourCPUMetadataBuilder if eviction_enabled() else CPUAttentionMetadataBuilder
