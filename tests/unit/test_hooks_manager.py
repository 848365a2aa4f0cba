"""The evicting group's manager at vLLM's boundary: a compacted request's blocks stop being hashed without a
sentinel in vLLM's bookkeeping (the manager's own ``cache_blocks``) until the request is freed; the spec is
registered through the registry's public entry point after vLLM's own specs, even into an empty registry;
where that or a hook the plugin needs is unavailable nothing is registered and eviction is refused at
start-up naming it and the vLLM version."""

from __future__ import annotations

import pytest
import torch

from vllm_contour.config import EvictionConfigError
from vllm_contour.integration.scheduler import manager
from vllm_contour.integration import vllm_hooks

BS = 16


def _full(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32, **kw)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(vllm_hooks, "NOT_INSTALLED", {})
    return vllm_hooks.NOT_INSTALLED


def _request(rid: str, n: int):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id=rid, prompt_token_ids=list(range(100, 100 + n)), sampling_params=SamplingParams(),
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))


def test_a_compacted_request_is_not_hashed_until_it_is_freed():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)
    mgr = manager.EvictingAttentionManager(manager.evicting_spec(_full()), block_pool=pool, enable_caching=True,
                                           kv_cache_group_id=0, scheduler_block_size=BS)
    a, b = _request("a", 4 * BS), _request("b", 4 * BS + 3)
    for r in (a, b):
        mgr.req_to_blocks[r.request_id].extend(pool.get_new_blocks(5))
    mgr.stop_hashing("a")
    for r in (a, b):
        mgr.cache_blocks(r, r.num_tokens, replay_boundaries=[])
    assert all(blk.block_hash is None for blk in mgr.blocks("a"))  # a round ran: its KV is not a prefix's
    assert [blk.block_hash is not None for blk in mgr.blocks("b")] == [True] * 4 + [False]  # vLLM's own path
    assert "a" not in mgr.num_cached_block  # nothing written into vLLM's bookkeeping
    mgr.free("a")  # finished or preempted (recomputed from its prompt): hashed again when it comes back
    assert mgr.not_hashed == set() and "a" not in mgr.req_to_blocks
    mgr.req_to_blocks["a"].extend(pool.get_new_blocks(4))
    mgr.cache_blocks(a, a.num_tokens, replay_boundaries=[])
    assert all(blk.block_hash is not None for blk in mgr.blocks("a"))


def test_the_spec_goes_in_after_vllms_own_even_into_an_empty_registry(monkeypatch, fresh):
    from vllm.v1 import kv_cache_spec_registry as reg
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    monkeypatch.setattr(reg, "_REGISTRY_KVCACHESPEC_LIST", {})  # as in a process that looked nothing up yet
    assert manager.register() and manager.register()  # idempotent
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=64)
    assert reg.KVCacheSpecRegistry.get_manager_class(_full()) is FullAttentionManager
    assert reg.KVCacheSpecRegistry.get_manager_class(sliding) is SlidingWindowManager
    ours = manager.evicting_spec(_full())
    assert reg.KVCacheSpecRegistry.get_manager_class(ours) is manager.EvictingAttentionManager
    assert reg.KVCacheSpecRegistry.get_uniform_type_base_spec(ours) is FullAttentionSpec and fresh == {}


def test_a_changed_registry_registers_nothing_and_eviction_is_refused_naming_it(monkeypatch, fresh):
    from vllm.v1 import kv_cache_spec_registry as reg

    def register_kv_cache_spec(manager_class):  # another signature
        raise AssertionError("not to be called")

    monkeypatch.setattr(reg, "register_kv_cache_spec", register_kv_cache_spec)
    assert manager.register() is False
    assert "register_kv_cache_spec: parameters ('manager_class',)" in fresh[manager._REGISTRY]
    with pytest.raises(EvictionConfigError, match=r"vLLM 0\.32\.0.*register_kv_cache_spec"):
        manager.evicting_spec(_full())
    sliding = _full(sliding_window=64)
    assert manager.evicting_spec(sliding) is sliding  # not a layer eviction would touch: nothing to refuse


def test_a_registry_without_vllms_own_full_attention_registers_nothing(monkeypatch, fresh):
    from vllm.v1 import kv_cache_spec_registry as reg

    calls = []

    def get_manager_class(cls, kvcache_spec, role=None):
        return None

    monkeypatch.setattr(reg.KVCacheSpecRegistry, "get_manager_class", classmethod(get_manager_class))
    monkeypatch.setattr(reg, "register_kv_cache_spec",
                        lambda manager_class=None, uniform_type_base_spec=None: calls.append(manager_class))
    assert manager.register() is False and calls == []
    assert "gives None for FullAttentionSpec" in fresh[manager._REGISTRY]
    with pytest.raises(EvictionConfigError, match="EvictingAttentionSpec not registered"):
        manager.evicting_spec(_full())
