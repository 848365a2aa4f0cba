"""``CacheShape`` is built in one place (``CacheShape.of``): vLLM's config at start-up and the KV cache group's
spec give the same shape for the same cache, elements sized by the cache dtype."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from vllm_contour.budget import CacheShape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_start_up_config_and_group_spec_give_the_same_shape(dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from vllm_contour.integration.connector import eviction_group
    from vllm_contour.integration.frontend.engine_args import cache_shape_of

    want = CacheShape(block_size=16, num_kv_heads=3, head_dim=64, elem_size=torch.empty((), dtype=dtype).element_size())
    assert CacheShape.of(block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype) == want
    vc = NS(model_config=NS(dtype=dtype, get_num_kv_heads=lambda pc: 3, get_head_size=lambda: 64),
            cache_config=NS(block_size=16, cache_dtype="auto"), parallel_config=None)
    assert cache_shape_of(vc) == want
    spec = FullAttentionSpec(16, num_kv_heads=3, head_size=64, dtype=dtype)
    assert eviction_group(NS(kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.attn"], spec)])).shape == want
