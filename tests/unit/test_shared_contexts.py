"""The cache of shared compressed contexts over vLLM's real block pool: keys separate settings and tenants,
blocks only an entry holds count as free and go back least recently used first, hits are pinned while they
are handed out, reset drops everything."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_contour.config import EvictionConfig, resolve_request
from vllm_contour.integration.scheduler.shared_contexts import SharedContexts

BS = 4


def _pool(n=12):
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=BS)


def _cache(n=12):
    pool = _pool(n)
    calls = []
    mgr = SimpleNamespace(block_pool=pool, allocate_slots=lambda request, *a, **kw: calls.append(kw) or kw)
    sc = SharedContexts(BS, "model@main")
    sc.bind(mgr)
    return sc, pool, mgr, calls


def _request(rid="r", tokens=None, salt=None, hashes=None):
    tokens = list(range(40)) if tokens is None else tokens
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                           block_hashes=hashes or [bytes([i]) * 8 for i in range(len(tokens) // BS)],
                           lora_request=None, cache_salt=salt)


def _params(**kw):
    extra = {"kv_context_len": 10, **kw}
    return resolve_request(EvictionConfig.from_additional_config({"kv_eviction": {"policy": "snapkv",
                                                                                   "budget": 8}}), extra)


def _entry(sc, pool, key, n_blocks, c=10):
    blocks = pool.get_new_blocks(n_blocks)  # one reference each: the entry's
    return sc.add(sc.new_id(), key, c, blocks + [pool.null_block])


def test_keys_separate_settings_tokens_and_tenants():
    sc, *_ = _cache()
    k = sc.key(_request(), _params())
    assert k is not None and k == sc.key(_request("other"), _params())
    different = [sc.key(_request(), _params(kv_budget=16)), sc.key(_request(), _params(kv_policy="knorm")),
                 sc.key(_request(), _params(kv_decode_interval=0)), sc.key(_request(), _params(kv_context_len=11)),
                 sc.key(_request(salt="tenant-b"), _params()),
                 sc.key(_request(tokens=list(range(9)) + [99] + list(range(10, 40))), _params()),  # partial block
                 sc.key(_request(hashes=[bytes([7]) * 8] * 10), _params())]  # vLLM's chain of the first blocks
    assert len({k, *different}) == len(different) + 1
    assert sc.key(_request(tokens=list(range(10))), _params()) is None  # the prompt is all context


def test_blocks_only_entries_hold_count_as_free_and_go_back_lru():
    sc, pool, _, _ = _cache(12)  # 11 usable blocks (one is vLLM's null block)
    a = _entry(sc, pool, b"a", 3)
    b = _entry(sc, pool, b"b", 3)
    assert sc.pool_free_blocks() == 5 and pool.get_num_free_blocks() == 11
    pool.touch(b.blocks[:1])  # a request holds one of b's blocks
    assert pool.get_num_free_blocks() == 10
    got = pool.get_new_blocks(7)  # 5 free + 2 of the oldest entry (a), which goes whole
    assert len(got) == 7 and b"a" not in sc.entries and b"b" in sc.entries
    assert a.entry_id in sc.take_dropped()
    pool.free_blocks(got)
    req = _request("hit")
    assert sc.hit(req, b"b") is b  # pinned while handed out: not reclaimable
    assert pool.get_num_free_blocks() == sc.pool_free_blocks()
    with pytest.raises(ValueError):
        pool.get_new_blocks(sc.pool_free_blocks() + 1)
    sc.end_schedule()
    sc.drop_all()
    assert sc.entries == {} and sc.pool_free_blocks() == 10  # the block the request holds is still out
    pool.free_blocks(b.table or [])


def test_adopting_request_is_never_hashed_and_unpinned():
    sc, pool, mgr, calls = _cache()
    e = _entry(sc, pool, b"k", 2)
    req = _request("x")
    assert sc.hit(req, b"k") is e and e.pins == 1
    mgr.allocate_slots(req, 3)
    assert calls[-1] == {"delay_cache_blocks": True}
    assert sc.adopted(req) is e and e.pins == 0 and e.users == {"x"} and "x" not in sc.pending
    mgr.allocate_slots(_request("y"), 3)
    assert calls[-1] == {}
    sc.release_user("x")
    assert e.users == set()
