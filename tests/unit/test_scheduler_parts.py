"""The scheduler side's parts on their own: a request's shared-context bookkeeping over vLLM's real BlockPool
(a context round's snapshot block comes from the pool and goes back when nothing is published; a published
entry holds its own reference on the compacted region), and the per-request record's KV accounting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

BS = 32


@pytest.fixture
def publisher():
    from vllm.v1.core.block_pool import BlockPool

    from vllm_contour.integration.context_publisher import ContextPublisher
    from vllm_contour.integration.shared_contexts import SharedContexts

    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)
    shared = SharedContexts(BS)
    shared.bind(SimpleNamespace(block_pool=pool, allocate_slots=lambda *a, **k: None))
    pub = ContextPublisher(shared, BS)
    pub.bind(pool)
    return pool, shared, pub


def _tracked(context_len: int):
    from vllm_contour.config import EvictionConfig, resolve_request
    from vllm_contour.integration.scheduler_records import Tracked

    request = SimpleNamespace(request_id="r", block_hashes=[b"h0", b"h1", b"h2", b"h3"],
                              prompt_token_ids=list(range(200)), num_prompt_tokens=200, num_tokens=200)
    params = resolve_request(EvictionConfig(policy="knorm", budget=64), {"kv_context_len": context_len})
    return Tracked(request, params, asked=params)


def _free(pool) -> int:
    return pool.free_block_queue.num_free_blocks  # vLLM's own free queue


def test_a_context_round_that_publishes_nothing_gives_its_snapshot_block_back(publisher):
    from vllm_contour.integration.reports import Round

    pool, shared, pub = publisher
    blocks = pool.get_new_blocks(4)
    t = _tracked(100)  # C = 100: E = 3 whole blocks and a partial one
    before = _free(pool)
    eid, src, snap = pub.plan(t, blocks, 100)
    assert src == blocks[3].block_id and snap not in {b.block_id for b in blocks} and _free(pool) == before - 1
    assert not pub.publish(t, Round(seq=t.seq + 1, region_blocks=3, kept_blocks=2, published=eid), blocks)
    assert _free(pool) == before and t.publishing is None and not shared.entries
    assert shared.take_dropped() == [eid]  # the workers forget the layout they kept for it


def test_a_published_context_holds_its_region_and_snapshot_until_dropped(publisher):
    from vllm_contour.integration.reports import Round

    pool, shared, pub = publisher
    blocks = pool.get_new_blocks(4)
    t = _tracked(100)
    eid, _, snap = pub.plan(t, blocks, 100)
    assert pub.publish(t, Round(seq=t.seq, region_blocks=3, kept_blocks=2, published=eid), blocks)
    (entry,) = shared.entries.values()
    assert [b.block_id for b in entry.table] == [b.block_id for b in blocks[:3]] + [snap]
    assert [b.ref_cnt for b in blocks] == [2, 2, 2, 1]  # the entry's own reference on the region
    pool.free_blocks(blocks)  # the request finishes
    before = _free(pool)
    shared.drop_all()
    assert _free(pool) == before + 4 and all(b.ref_cnt == 0 for b in blocks)


def test_an_aligned_context_takes_no_snapshot(publisher):
    pool, shared, pub = publisher
    blocks = pool.get_new_blocks(4)
    before = _free(pool)
    eid, src, snap = pub.plan(_tracked(96), blocks, 96)
    assert src is None and snap is None and _free(pool) == before


def test_the_record_keeps_mean_and_peak_of_what_a_request_held():
    t = _tracked(100)
    for tokens, evicting, blocks in [(64.0, 96.0, 3), (160.0, 160.0, 5), (96.0, 128.0, 4)]:
        t.held.sample(tokens, evicting, blocks)
    assert t.held.mean() == (320.0 / 3, 384.0 / 3) and (t.held.peak, t.held.evicting_peak) == (160.0, 160.0)
    s = t.summary()
    assert (s["peak_kv_tokens"], s["last_held_blocks"], s["context_len"], s["failed"]) == (160.0, 4, 100, False)
