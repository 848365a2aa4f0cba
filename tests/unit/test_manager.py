"""The evicting group's block-table manager over vLLM's real BlockPool: a round's freed slots become the null
block and return to vLLM's free queue, private blocks take the slots of originals another request still
holds, stale reports change nothing; vLLM's registry hands the manager to the plugin's spec and to nothing
else."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def pool_and_manager():
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_contour.integration.scheduler.manager import EvictingAttentionManager, evicting_spec

    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=32)
    spec = evicting_spec(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32))
    mgr = EvictingAttentionManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                                   scheduler_block_size=32)
    return pool, mgr


def _free(pool) -> int:
    return pool.free_block_queue.num_free_blocks  # vLLM's own free queue


def test_a_round_nulls_and_frees_its_slots(pool_and_manager):
    pool, mgr = pool_and_manager
    blocks = pool.get_new_blocks(6)
    mgr.req_to_blocks["r"].extend(blocks)
    before = _free(pool)
    ids = [b.block_id for b in blocks]
    released = mgr.rewrite("r", ((2, ids[2]), (3, ids[3])), (), {})
    assert [b.block_id for b in released] == [ids[2], ids[3]] and all(b.ref_cnt == 0 for b in released)
    assert _free(pool) == before + 2
    table = mgr.blocks("r")
    assert table[2].is_null and table[3].is_null and [b.block_id for b in table[:2]] == ids[:2]


def test_private_blocks_take_the_slots_of_shared_originals(pool_and_manager):
    pool, mgr = pool_and_manager
    blocks = pool.get_new_blocks(4)
    pool.touch(blocks[:2])  # another request holds the first two too
    mgr.req_to_blocks["r"].extend(blocks)
    private = {b.block_id: b for b in pool.get_new_blocks(2)}
    p0, p1 = list(private)
    before = _free(pool)
    released = mgr.rewrite("r", ((2, blocks[2].block_id),),
                           ((0, blocks[0].block_id, p0), (1, blocks[1].block_id, p1)), private)
    assert [b.block_id for b in mgr.blocks("r")[:2]] == [p0, p1] and mgr.blocks("r")[2].is_null
    assert [b.ref_cnt for b in released] == [0, 1, 1]  # the originals stay with the other request
    assert _free(pool) == before + 1


def test_a_stale_report_changes_nothing(pool_and_manager):
    pool, mgr = pool_and_manager
    blocks = pool.get_new_blocks(3)
    mgr.req_to_blocks["r"].extend(blocks)
    before = _free(pool)
    assert mgr.rewrite("r", ((1, blocks[2].block_id),), (), {}) is None  # the slot holds another block
    assert mgr.rewrite("r", ((5, 99),), (), {}) is None  # no such slot
    assert mgr.rewrite("r", (), ((0, blocks[0].block_id, 77),), {}) is None  # no such private block
    assert mgr.blocks("r") == blocks and _free(pool) == before
    mgr.stop_hashing("r")
    assert mgr.not_hashed == {"r"}  # test_hooks_manager.py: its blocks are not hashed until it is freed


def test_a_report_whose_replaced_slot_now_holds_another_block_changes_nothing(pool_and_manager):
    """A round's report names, for each slot a private block takes, the block the slot held when the round
    was planned. When the slot holds another block by the time the report arrives (an earlier report already
    replaced it, or freed it to the null block) the whole report is refused: the table, the pool's free
    queue and every block's reference count stay as they were, the private block included."""
    pool, mgr = pool_and_manager
    blocks = pool.get_new_blocks(4)
    mgr.req_to_blocks["r"].extend(blocks)
    private = {b.block_id: b for b in pool.get_new_blocks(1)}
    (p0,) = private
    other = pool.get_new_blocks(1)[0]
    for now in (other, mgr._null_block):  # slot 1 held blocks[1] when the round was planned
        mgr.req_to_blocks["r"][1] = now
        table = list(mgr.blocks("r"))
        before, refs = _free(pool), [b.ref_cnt for b in table + [private[p0]]]
        report = ((2, blocks[2].block_id),), ((1, blocks[1].block_id, p0),)
        assert mgr.rewrite("r", *report, private) is None
        assert mgr.blocks("r") == table and mgr.blocks("r")[1] is now and mgr.blocks("r")[2] is blocks[2]
        assert _free(pool) == before and [b.ref_cnt for b in table + [private[p0]]] == refs
    mgr.req_to_blocks["r"][1] = blocks[1]
    assert mgr.rewrite("r", (), ((4, blocks[3].block_id, p0),), private) is None  # no such slot
    released = mgr.rewrite("r", ((2, blocks[2].block_id),), ((1, blocks[1].block_id, p0),), private)
    assert [b.block_id for b in released] == [blocks[2].block_id, blocks[1].block_id]  # the report, matching
    assert mgr.blocks("r")[1] is private[p0] and mgr.blocks("r")[2].is_null


def test_vllms_registry_picks_the_manager_for_the_plugins_spec_only():
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_contour.integration.scheduler import manager

    manager.register()
    manager.register()  # idempotent (every process loads the plugin, some twice)
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    ours = manager.evicting_spec(full)
    assert isinstance(ours, manager.EvictingAttentionSpec) and ours.page_size_bytes == full.page_size_bytes
    assert KVCacheSpecRegistry.get_manager_class(ours) is manager.EvictingAttentionManager
    assert KVCacheSpecRegistry.get_manager_class(full) is FullAttentionManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(ours) is FullAttentionSpec
    sliding = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=256, dtype=torch.float32, sliding_window=512)
    assert manager.evicting_spec(sliding) is sliding


@pytest.mark.parametrize("policy", ["snapkv", "none"])
def test_the_backend_gives_full_attention_layers_the_plugins_spec_with_eviction_on(policy):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_contour.integration.backends.cpu import ContourCPUAttentionBackend
    from vllm_contour.integration.scheduler.manager import EvictingAttentionSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    with set_current_vllm_config(VllmConfig(additional_config={"kv_eviction": {"policy": policy}})):
        spec = ContourCPUAttentionBackend.customize_spec(full)
    assert isinstance(spec, EvictingAttentionSpec) == (policy != "none")


@pytest.mark.parametrize("policy", ["snapkv", "none"])
def test_outside_vllms_config_the_spec_follows_what_the_models_impls_recorded(policy):
    """vLLM asks for the layers' KV cache specs after the model is built, with no config set: the backend
    then answers what the impls saw under the config when the model was built."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_contour.integration.backends import common
    from vllm_contour.integration.backends.cpu import ContourCPUAttentionBackend, ContourImpl
    from vllm_contour.integration.scheduler.manager import EvictingAttentionSpec

    class VllmImpl:
        def __init__(self, *args, **kwargs):
            pass

    class Impl(ContourImpl, VllmImpl):
        pass

    common._EVICTING[0] = policy == "none"  # the opposite, so that the impl's record is what counts
    with set_current_vllm_config(VllmConfig(additional_config={"kv_eviction": {"policy": policy}})):
        Impl(2, 64)
    assert get_current_vllm_config_or_none() is None
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    try:
        assert isinstance(ContourCPUAttentionBackend.customize_spec(full), EvictingAttentionSpec) == (policy != "none")
    finally:
        common._EVICTING[0] = False


def test_a_layers_cache_views_are_built_once_per_cache_tensor():
    """The impl keeps its layer's key / value views: the same cache tensor gives the same views (no layout
    probe per step), a new cache tensor (another allocation, shape or dtype) gives views of that one."""
    from vllm_contour.integration.backends.common import ContourImpl

    built = []

    class Impl(ContourImpl):
        def __init__(self):
            pass

        @staticmethod
        def kv_views(kv_cache):
            built.append(kv_cache)
            return kv_cache[..., :2], kv_cache[..., 2:]

    impl = Impl()
    a, b = torch.zeros(4, 2, 8, 4), torch.zeros(4, 2, 8, 4)
    first = impl._layer_views(a)
    assert impl._layer_views(a) is first and len(built) == 1
    kb, _ = impl._layer_views(b)
    assert kb.data_ptr() == b.data_ptr() and len(built) == 2
    assert impl._layer_views(a.view(4, 2, 4, 8))[0].shape == (4, 2, 4, 2) and len(built) == 3
    assert impl._layer_views(a.view(torch.int32))[0].dtype == torch.int32 and len(built) == 4
