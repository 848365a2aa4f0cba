"""Window queries kept in blocks of vLLM's pool: the raw page ops, the worker writing a window over several
steps and its round reading it back, and the scheduler taking the blocks at the window's first step and
giving them back with the round (or putting a decode-time round off when the pool has no room)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_contour import ops

from .ops_cases import make_cache

H, BS, D = 2, 16, 32


@pytest.mark.parametrize("layout, dtype", [("cpu_rows", torch.float32), ("cpu_keyT", torch.bfloat16),
                                           ("cpu_amx", torch.bfloat16), ("interleaved", torch.float32)])
def test_raw_page_elements_round_trip_and_touch_nothing_else(layout, dtype):
    storage, k, v = make_cache(layout, 6, H, BS, D, dtype, seed=3)
    before = storage.clone()
    it = {4: torch.int32, 2: torch.int16}[k.element_size()]
    pages = torch.tensor([5, 2, 9])  # head-pages (block * H + lane)
    per_page = 2 * BS * D
    elems = torch.tensor([0, per_page - 1, 7, BS * D, 3 * per_page // 4])
    page_of = pages[torch.tensor([0, 0, 1, 2, 2])]
    values = torch.randint(-30000, 30000, (5,), dtype=it)
    ops.write_page_elems(k, v, page_of, elems, values)
    got = ops.read_page_elems(k, v, pages)
    assert got.shape == (3 * per_page,) and got.dtype == it
    flat_idx = torch.tensor([0, 0, 1, 2, 2]) * per_page + elems
    assert torch.equal(got[flat_idx], values)
    # every other element, of those pages and of the rest of the cache, is as it was
    ops.write_page_elems(k, v, page_of, elems, ops.read_page_elems(*make_cache(layout, 6, H, BS, D, dtype, seed=3)[1:],
                                                                   pages)[flat_idx])
    assert torch.equal(storage.view(it), before.view(it))


@pytest.mark.parametrize("cache_dtype, q_dtype", [(torch.float32, torch.float32), (torch.uint8, torch.bfloat16)])
def test_a_window_written_over_several_steps_is_what_its_round_reads(cache_dtype, q_dtype):
    """SnapKV's window [R - W, R) computed over three steps (a prefill chunk's tail, then two more):
    each layer's queries land in the request's window pages, and the round reads every captured position's
    queries in position order, bit for bit; positions not computed are left out. Also bf16 queries in an fp8
    cache's one-byte pages (two page elements a query element)."""
    from vllm.config import VllmConfig

    from vllm_contour.config import EvictionConfig
    from vllm_contour.integration.worker.requests import QueryWindow
    from vllm_contour.integration.worker.side import WorkerSide
    from vllm_contour.integration.worker.step import ContourStep, window_plan
    from vllm_contour.page_tables import CaptureWindows

    layers, hq, w, r = 3, 4, 10, 100
    ws = WorkerSide(VllmConfig(), EvictionConfig(policy="snapkv"))
    ws.caches.views = [make_cache("cpu_keyT", 8, H, BS, D, cache_dtype, seed=s)[1:] for s in range(layers)]
    ws.caches.dims = (8, H, BS, D)
    ws.caches.shape = SimpleNamespace(elem_size=cache_dtype.itemsize)
    ws.rounds.query_shape = ws.caches.query_shape = (hq, D, q_dtype)
    blocks = [3, 6]  # 10 x 4 x 32 fp32 = 1,280 elements a layer; a block holds 2 x 2 x 16 x 32 = 2,048
    ws.requests.state_for("a").window = QueryWindow(r - w, r, blocks)
    ws.message = SimpleNamespace(recon=[])
    want = torch.randn(layers, w, hq, D).to(q_dtype)
    for pos0, n in ((r - w, 6), (r - 3, 1), (r - 2, 2)):  # r - 4 is never computed
        cap = CaptureWindows([("a", pos0, n)], n, torch.arange(n))
        step = ContourStep.__new__(ContourStep)
        step.capture, step.staged = cap, {}
        step.windows = window_plan(cap, ws.requests.requests, set(), ws.caches, torch.device("cpu"))
        assert not step.windows.keep_staged and not step.windows.held
        for layer, (k, v) in enumerate(ws.caches.views):
            rows = want[layer, pos0 - (r - w): pos0 - (r - w) + n]
            step.stage(layer, rows, k, v)
    queries, positions = ws.rounds._window_queries(ws.requests.requests["a"].window, ws.caches.views)
    kept = [i for i in range(w) if i != w - 4]
    assert positions.tolist() == [r - w + i for i in kept]
    for layer in range(layers):
        assert torch.equal(queries[layer], want[layer, kept].permute(1, 0, 2))
    # the same window computed whole in one step (a prompt's end) has no pages: the step keeps it for its round
    win = ws.requests.state_for("b").window = QueryWindow(r - w, r, [])
    cap = CaptureWindows([("c", 0, 3), ("b", r - w, w)], 3 + w, torch.arange(3 + w))  # c: no window here
    step = ContourStep.__new__(ContourStep)
    step.capture, step.staged = cap, {}
    step.windows = window_plan(cap, ws.requests.requests, set(), ws.caches, torch.device("cpu"))
    assert step.windows.paged is None and len(step.windows.held) == 1
    for layer, (k, v) in enumerate(ws.caches.views):
        step.stage(layer, torch.cat([torch.zeros(3, hq, D, dtype=q_dtype), want[layer]]), k, v)
    queries, positions = ws.rounds._window_queries(win, ws.caches.views)
    assert positions.tolist() == list(range(r - w, r))
    for layer in range(layers):
        assert torch.equal(queries[layer], want[layer].permute(1, 0, 2))


def _side(free: int):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_contour.budget import CacheShape
    from vllm_contour.config import EvictionConfig
    from vllm_contour.integration.scheduler.side import SchedulerSide

    side = SchedulerSide(EvictionConfig(policy="snapkv", budget=64, window=32), BS,
                         CacheShape(block_size=BS, num_kv_heads=H, head_dim=D, elem_size=4),
                         query_blocks=lambda window: 3)
    pool = BlockPool(free + 1, enable_caching=False, hash_block_size=BS)
    side.blocks.manager = SimpleNamespace(block_pool=pool)
    return side, pool


def test_a_window_computed_whole_in_one_step_takes_no_blocks():
    from vllm_contour.integration.scheduler.records import Tracked

    side, pool = _side(10)
    t = Tracked(SimpleNamespace(request_id="a", num_computed_tokens=0, num_tokens=200), None)
    t.params = side._resolve(SimpleNamespace(request_id="a", sampling_params=None))
    side._prepare(t)
    caps = []
    assert side.dispatch._capture(t, 200, 32, (168, 200), caps)
    assert caps[0].pages == [] and t.queries is None and pool.get_num_free_blocks() == 10


def test_the_scheduler_takes_the_window_blocks_once_and_gives_them_back_with_the_round():
    from vllm_contour.integration.messages import ContourReport, Noop
    from vllm_contour.integration.scheduler.records import Tracked

    side, pool = _side(10)
    t = Tracked(SimpleNamespace(request_id="a", num_computed_tokens=0, num_tokens=200, is_finished=lambda: False),
                side._resolve(SimpleNamespace(request_id="a", sampling_params=None)))
    side._prepare(t)
    caps = []
    assert side.dispatch._capture(t, 160, 32, (128, 150), caps)
    assert side.dispatch._capture(t, 160, 32, (150, 151), caps)  # the same round: the same blocks
    assert pool.get_num_free_blocks() == 7 and len(caps) == 2 and caps[0].pages == caps[1].pages
    assert (caps[0].window_start, caps[0].round_at, len(caps[0].pages)) == (128, 160, 3)
    side.tracked["a"] = t
    t.pending = t.seq = 1
    side.apply(ContourReport({"a": Noop(1)}))
    assert t.queries is None and pool.get_num_free_blocks() == 10


def test_with_no_room_for_the_window_a_decode_time_round_is_put_off_by_a_window():
    from vllm_contour.integration.scheduler.records import Tracked

    side, pool = _side(2)  # the window needs 3
    t = Tracked(SimpleNamespace(request_id="a", num_computed_tokens=0, num_tokens=200), None)
    t.params = side._resolve(SimpleNamespace(request_id="a", sampling_params=None))
    side._prepare(t)
    t.compacted, t.region_blocks = True, 6
    caps = []
    assert not side.dispatch._capture(t, 160, 32, (128, 129), caps)
    assert caps == [] and t.queries is None and pool.get_num_free_blocks() == 2
    assert t.defer_to == 192  # its new window [160, 192) starts past every token computed so far
    from vllm_contour.round_clock import next_round

    assert next_round(t.clock(BS)) == 192


@pytest.mark.parametrize("policy, needs_queries", [("knorm", False), ("streaming", False), ("keydiff", False),
                                                   ("snapkv", True), ("kvzip", True)])
@pytest.mark.parametrize("max_num_seqs", [256, 1024])
def test_query_bytes_outside_the_pool_are_bounded_by_the_steps_tokens(policy, needs_queries, max_num_seqs):
    """What the worker reports at start-up (``vllm:contour_query_buffer_bound_bytes``): a query-free policy keeps
    no query outside vLLM's pool; one that reads queries keeps at most one step's tokens of them, every layer,
    whatever ``--max-num-seqs`` is (8B-like shape: 32 layers, 32 query heads of 128, bf16, 8,192 tokens)."""
    from vllm.config import SchedulerConfig, VllmConfig

    from vllm_contour.integration.worker.caches import WorkerCaches
    from vllm_contour.policies import build_policy

    sched = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max_num_seqs, max_model_len=8192,
                            is_encoder_decoder=False)
    c = WorkerCaches(VllmConfig(scheduler_config=sched))
    c.named = [(f"model.layers.{i}.self_attn.attn", None) for i in range(32)]
    c.query_shape = (32, 128, torch.bfloat16)
    want = 32 * 8192 * 32 * 128 * 2 if needs_queries else 0  # 2 GiB at 8,192 batched tokens
    assert c.outside_pool_bound(build_policy(policy)) == want
