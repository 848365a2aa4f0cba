"""The attention backend with eviction on vLLM's CPU platform: vLLM's CPU backend (``CPU_ATTN``; its kernel
serves every ordinary row) with the row logic of ``common.py``; compacted tokens go to the C++ kernels.
The cache's page layout is the one vLLM's CPU cache-write op uses for the ISA it picks (model dtype, block
size, head dim, cache dtype; probed once per combination, ``ops/cpu_layout.py``). An fp8 cache
(``--kv-cache-dtype fp8``) is uint8 pages in that layout, read through the table vLLM's kernel makes of each
byte (probed, ``ops/fp8.py``) times the layer's ``k_scale`` / ``v_scale``. Registered over ``CPU_ATTN``.
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
from vllm_contour.ops.fp8 import KVDequant, is_fp8, probe_table


def _isa(model_dtype: torch.dtype, kv_cache: torch.Tensor, kv_cache_dtype: str) -> tuple[str, int, int]:
    """The ISA vLLM's CPU attention picks for this cache (as its builder does: the model's dtype, the block
    size, the head size, the cache dtype), with the block size and head dim."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, _, bs, two_d = kv_cache.shape
    d = two_d // 2
    return _get_attn_isa(model_dtype, bs, d, kv_cache_dtype), bs, d


def layer_layout(kv_cache: torch.Tensor, model_dtype: torch.dtype | None = None,
                 kv_cache_dtype: str = "auto") -> PageLayout:
    """The page layout vLLM's CPU attention writes into this cache, probed once per combination
    (``cpu_layout.probe_layout``); ``model_dtype`` None: the cache's own (an unquantised cache)."""
    dtype = kv_cache.dtype if model_dtype is None else model_dtype
    isa, bs, d = _isa(dtype, kv_cache, kv_cache_dtype)
    return probe_layout(isa, dtype, bs, d, kv_cache_dtype if is_fp8(kv_cache_dtype) else "auto")


def layer_kv_views(kv_cache: torch.Tensor, model_dtype: torch.dtype | None = None, kv_cache_dtype: str = "auto"):
    """Logical key/value views of one layer's CPU cache (``[B, H, bs, D]``, or the two-level form of
    packed layouts, see ``ops.paged``; fp8 caches: uint8 views)."""
    return cpu_kv_views(kv_cache, layer_layout(kv_cache, model_dtype, kv_cache_dtype))


@dataclass
class ContourCPUAttentionMetadata(CPUAttentionMetadata, StepField):
    pass


class ContourCPUMetadataBuilder(ContourBuilder, CPUAttentionMetadataBuilder):
    metadata_cls = ContourCPUAttentionMetadata


class ContourCPUAttentionImpl(ContourImpl, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        from vllm.config import get_current_vllm_config

        super().__init__(*args, **kwargs)
        self._model_dtype = get_current_vllm_config().model_config.dtype
        self._dequant: tuple | None = None  # ((k_scale, v_scale), KVDequant) of the layer's last read

    def kv_views(self, kv_cache: torch.Tensor):
        if kv_cache.dtype != torch.uint8:
            return layer_kv_views(kv_cache)
        return layer_kv_views(kv_cache, self._model_dtype, self.kv_cache_dtype)

    def kv_dequant(self, layer, kv_cache: torch.Tensor) -> KVDequant | None:
        """An fp8 cache's reading: vLLM's table for its ISA and encoding times the layer's scales (None for
        an unquantised cache)."""
        if not is_fp8(self.kv_cache_dtype) or kv_cache.dtype != torch.uint8:
            return None
        scales = (float(layer._k_scale_float), float(layer._v_scale_float))
        if self._dequant is None or self._dequant[0] != scales:
            isa, bs, d = _isa(self._model_dtype, kv_cache, self.kv_cache_dtype)
            self._dequant = (scales, KVDequant.of(probe_table(isa, self._model_dtype, self.kv_cache_dtype, bs, d),
                                                  *scales))
        return self._dequant[1]

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
