"""The attention backend with eviction on vLLM's CUDA platform: vLLM's Triton backend (its unified attention
kernel serves every ordinary row, untouched) with the row logic of ``common.py``; compacted tokens go to
``ops.compacted_attention``, the Triton kernel that reads each token's kept run and then its tail from
vLLM's block table. Registered over ``TRITON_ATTN``.

The builder declares no CUDA-graph support of its own (compacted rows' lengths change what a step reads),
so vLLM runs attention between piecewise graphs. The cache is vLLM's logical ``[blocks, H, bs,
2*head_size]`` tensor (any physical order): keys are the first half of the last dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from vllm_contour.integration.backends.common import ContourBackend, ContourBuilder, ContourImpl, eviction_enabled
from vllm_contour.integration.worker.step import StepField


def layer_kv_views(kv_cache):
    """``[B, H, bs, D]`` key and value views of one layer's logical ``[B, H, bs, 2D]`` cache."""
    d = kv_cache.shape[-1] // 2
    return kv_cache[..., :d], kv_cache[..., d:]


@dataclass
class ContourTritonAttentionMetadata(TritonAttentionMetadata, StepField):
    pass


class ContourTritonMetadataBuilder(ContourBuilder, TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    supports_draft_decode_metadata_update = False
    metadata_cls = ContourTritonAttentionMetadata


class ContourTritonAttentionImpl(ContourImpl, TritonAttentionImpl):
    kv_views = staticmethod(layer_kv_views)


class ContourTritonAttentionBackend(ContourBackend, TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls():
        return ContourTritonAttentionImpl if eviction_enabled() else TritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ContourTritonMetadataBuilder if eviction_enabled() else TritonAttentionMetadataBuilder
