"""Which of vLLM's KV cache groups eviction works on: the one full-attention group; a hybrid model's
sliding-window groups are left to vLLM; anything else stops the engine at start-up with the groups named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.attn"], s)
                                            for i, s in enumerate(specs)])


def _full(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(32, num_kv_heads=kw.get("heads", 1), head_size=256, dtype=torch.float32,
                             sliding_window=kw.get("sliding_window"))


def _sw(block_size=32):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size, num_kv_heads=1, head_size=256, dtype=torch.float32, sliding_window=512)


def test_full_attention_group_of_a_hybrid_model():
    from vllm_contour.integration.connector import eviction_group

    g = eviction_group(_config(_sw(), _sw(), _full(heads=2)))
    assert (g.index, g.num_groups, g.layer_names) == (2, 3, ("model.layers.2.attn",))
    assert (g.shape.num_kv_heads, g.shape.head_dim, g.shape.block_size, g.shape.elem_size) == (2, 256, 32, 4)
    assert eviction_group(_config(_full())).index == 0


@pytest.mark.parametrize("specs", [lambda: (_full(), _full()),  # two full-attention groups
                                   lambda: (_sw(),),  # no full-attention group
                                   lambda: (_full(sliding_window=512),),
                                   lambda: (_full(), _sw(block_size=16))])
def test_other_group_mixes_are_refused_naming_the_groups(specs):
    from vllm_contour.integration.connector import eviction_group

    with pytest.raises(ValueError, match="kv_eviction: .*(groups|block sizes)"):
        eviction_group(_config(*specs()))
