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

    from vllm_contour.integration.scheduler.contexts import ContextPublisher
    from vllm_contour.integration.scheduler.shared_contexts import SharedContexts

    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)
    shared = SharedContexts(BS)
    shared.bind(SimpleNamespace(block_pool=pool, allocate_slots=lambda *a, **k: None))
    pub = ContextPublisher(shared, BS)
    pub.bind(pool)
    return pool, shared, pub


def _tracked(context_len: int):
    from vllm_contour.config import EvictionConfig, resolve_request
    from vllm_contour.integration.scheduler.records import Tracked

    request = SimpleNamespace(request_id="r", block_hashes=[b"h0", b"h1", b"h2", b"h3"],
                              prompt_token_ids=list(range(200)), num_prompt_tokens=200, num_tokens=200)
    params = resolve_request(EvictionConfig(policy="knorm", budget=64), {"kv_context_len": context_len})
    return Tracked(request, params, asked=params)


def _free(pool) -> int:
    return pool.free_block_queue.num_free_blocks  # vLLM's own free queue


def test_a_context_round_that_publishes_nothing_gives_its_snapshot_block_back(publisher):
    from vllm_contour.integration.messages import Round

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
    from vllm_contour.integration.messages import Round

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


@pytest.fixture
def outcomes():
    """The reports' application over vLLM's real BlockPool and the plugin's manager of the evicting group."""
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_contour.integration.scheduler.contexts import ContextPublisher
    from vllm_contour.integration.scheduler.manager import EvictingAttentionManager, evicting_spec
    from vllm_contour.integration.scheduler.blocks import RequestBlocks
    from vllm_contour.integration.scheduler.outcomes import RoundOutcomes
    from vllm_contour.integration.scheduler.events import SchedulerEvents
    from vllm_contour.integration.scheduler.shared_contexts import SharedContexts

    pool = BlockPool(num_gpu_blocks=16, enable_caching=False, hash_block_size=BS)
    spec = evicting_spec(FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32))
    mgr = EvictingAttentionManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                                   scheduler_block_size=BS)
    blocks = RequestBlocks(BS)
    blocks.bind(SimpleNamespace(block_pool=pool, coordinator=SimpleNamespace(single_type_managers=[mgr])))
    tracked = {}
    out = RoundOutcomes(tracked, blocks, ContextPublisher(SharedContexts(BS), BS), SchedulerEvents())
    return pool, mgr, tracked, out


def _running(tracked, mgr, pool, n_blocks=6):
    t = _tracked(1000)
    t.request.is_finished = lambda: False
    t.request.num_computed_tokens = n_blocks * BS
    mgr.req_to_blocks["r"].extend(pool.get_new_blocks(n_blocks))
    t.seq = t.pending = 1
    tracked["r"] = t
    return t, [b.block_id for b in mgr.blocks("r")]


def test_a_round_report_frees_its_blocks_into_vllms_pool_once(outcomes):
    from vllm_contour.integration.messages import ContourReport, Round

    pool, mgr, tracked, out = outcomes
    t, ids = _running(tracked, mgr, pool)
    before = _free(pool)
    report = ContourReport({"r": Round(seq=1, region_blocks=6, kept_blocks=2, freed=((2, ids[2]), (5, ids[5])))}, {})
    out.apply(ContourReport({"r": Round(seq=0, region_blocks=6, kept_blocks=2, freed=((3, ids[3]),))}, {}))
    assert _free(pool) == before and out.events.totals.stale_reports == 1  # not the round in flight
    out.apply(report)
    assert _free(pool) == before + 2 and mgr.blocks("r")[2].is_null and mgr.blocks("r")[5].is_null
    assert (t.compacted, t.region_blocks, t.rounds, t.pending) == (True, 6, 1, None)
    assert (out.events.totals.rounds, out.events.totals.freed_blocks, out.events.totals.evicted_requests) == (1, 2, 1)
    out.apply(report)  # the same report again: stale, nothing freed twice
    assert _free(pool) == before + 2 and out.events.totals.stale_reports == 2 and t.rounds == 1


def test_failed_rounds_stop_eviction_and_only_a_moved_cache_is_recomputed(outcomes):
    from vllm_contour.integration.messages import ContourReport, PlanFailed, Recompute

    pool, mgr, tracked, out = outcomes
    t, _ = _running(tracked, mgr, pool)
    before = _free(pool)
    out.apply(ContourReport({"r": PlanFailed(seq=1, reason="x")}, {}))
    assert t.params is None and out.take_recompute() == {} and _free(pool) == before
    t2, _ = _running(tracked, mgr, pool)
    mgr.req_to_blocks["s"] = mgr.req_to_blocks.pop("r")
    tracked["s"] = tracked.pop("r")
    out.apply(ContourReport({"s": Recompute(seq=1, reason="y")}, {}))
    assert t2.params is None and out.take_recompute() == {"s": "y"} and out.take_recompute() == {}
    assert out.events.totals.failures == {"plan": 1, "apply": 1}
