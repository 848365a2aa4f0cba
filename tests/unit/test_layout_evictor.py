"""Ragged layout, compaction and the decode op against explicit dense attention (pure torch)."""

import random

import pytest
import torch

from vllm_contour import ops
from vllm_contour.config import EvictionConfig, resolve_request
from vllm_contour.budget import BudgetError, page_budget
from vllm_contour.evictor import PlanError, apply_round, plan_round
from vllm_contour.layout import (compaction_indices, decode_page_table, kept_blocks_for, plan_layout,
                                 region_source_table)
from vllm_contour.ops.cpu_layout import KEY_TRANSPOSED, PageLayout, cpu_kv_views
from vllm_contour.ops.paged import rows, set_rows
from vllm_contour.ops.reference import dense_attention_ref
from vllm_contour.policies import PRESETS


def cpu_cache(num_blocks, h, bs, d, dtype=torch.float32, seed=0, key_layout=KEY_TRANSPOSED):
    """A cache in vLLM's CPU layout [B, H, bs, 2D] and its logical key/value views."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, h, bs, 2 * d, generator=g).to(dtype)
    k, v = cpu_kv_views(kv, key_layout)
    return kv, k, v


def test_kept_blocks_is_sum_over_heads_not_max():
    # 3 heads keep 5, 1, 0 pages: 6 head-pages -> 2 blocks (not 3 heads x 5 = 5 blocks)
    pages = torch.tensor([[5, 1, 0], [2, 2, 2]])
    assert kept_blocks_for(pages, 3) == 2
    lay = plan_layout(pages, list(range(10, 16)), 16, 3, region_blocks=6)
    assert lay.kept_blocks == 2 and lay.block_ids == [10, 11] and lay.block_slots == [0, 1]
    assert lay.total_head_pages == 12
    # head 0 of layer 0 borrows lanes 1 and 2 of block 10 and of block 11
    assert lay.page_ids[0, 0, :5].tolist() == [30, 31, 32, 33, 34]
    assert lay.page_ids[0, 1, :1].tolist() == [35]
    # every slot used at most once per layer
    for layer in range(2):
        ids = torch.cat([lay.page_ids[layer, h, : int(lay.pages[layer, h])] for h in range(3)])
        assert ids.unique().numel() == ids.numel()


def test_layout_refuses_more_pages_than_region():
    with pytest.raises(ValueError):
        plan_layout(torch.tensor([[4, 3]]), [1, 2, 3], 16, 2, region_blocks=3)  # 7 pages, 6 slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_moves_exactly_the_kept_tokens(dtype):
    h, bs, d, nb = 3, 8, 16, 40
    kv, kc, vc = cpu_cache(nb, h, bs, d, dtype)
    orig_k, orig_v = kc.clone(), vc.clone()
    block_ids = random.Random(0).sample(range(1, nb), 6)
    e = 6
    rng = torch.Generator().manual_seed(1)
    pages = torch.tensor([[4, 1, 2]])
    kept = [torch.sort(torch.randperm(e * bs, generator=rng)[: int(p) * bs]).values for p in pages[0]]
    lay = plan_layout(pages, block_ids, bs, h, e)
    sp, so, dp, do = compaction_indices(kept, lay.page_ids[0], region_source_table(block_ids, h), bs)
    ops.compact(kc, vc, sp, so, dp, do, impl="torch")
    for head in range(h):
        for j, t in enumerate(kept[head].tolist()):
            page = int(lay.page_ids[0, head, j // bs])
            b, lane = divmod(page, h)
            src_b = block_ids[t // bs]
            assert torch.equal(kc[b, lane, j % bs], orig_k[src_b, head, t % bs])
            assert torch.equal(vc[b, lane, j % bs], orig_v[src_b, head, t % bs])


def _explicit_kv(kc, vc, table_row, n, bs, h):
    """Keys/values of one head's page list, read page by page (oracle)."""
    ks, vs = [], []
    for j in range(n):
        b, lane = divmod(int(table_row[j // bs]), h)
        ks.append(rows(kc, b, lane, j % bs))
        vs.append(rows(vc, b, lane, j % bs))
    return torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("impl", ["torch", "vllm_cpu"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_decode_equals_dense_attention_over_kept_and_tail(impl, seed):
    if impl not in ops.available("ragged_decode_attention", "cpu", native=True):
        pytest.fail(f"{impl} implementation missing")
    rnd = random.Random(seed)
    h, g, bs, d, nb = 3, 3, 32, 64, 64
    kv, kc, vc = cpu_cache(nb, h, bs, d, seed=seed)
    t_rows = 4
    tables, lens = [], []
    for _ in range(t_rows):
        e = rnd.randint(1, 6)
        blocks = rnd.sample(range(1, nb), e + 3)
        pages = torch.tensor([[rnd.randint(0, e) for _ in range(h)]])
        while kept_blocks_for(pages, h) > e:
            pages[0, rnd.randrange(h)] = max(0, int(pages[0].max()) - 1)
        lay = plan_layout(pages, blocks[:e], bs, h, e)
        tail_tokens = rnd.randint(1, 3 * bs)
        n_tail = (tail_tokens + bs - 1) // bs
        tab, sl = decode_page_table(lay, blocks[e : e + n_tail], tail_tokens)
        tables.append(tab[0])
        lens.append(sl[0])
    width = max(t.shape[1] for t in tables)
    page_table = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=int(t[0, 0]))
                              for t in tables])
    seq_lens = torch.stack(lens)
    q = torch.randn(t_rows, h * g, d)
    scale = d ** -0.5
    out, lse = ops.ragged_decode_attention(q, kc, vc, page_table, seq_lens, scale, impl=impl, native=True)
    for r in range(t_rows):
        ks, vs = zip(*[_explicit_kv(kc, vc, page_table[r, hh], int(seq_lens[r, hh]), bs, h) for hh in range(h)])
        for hh in range(h):
            o_ref, lse_ref = dense_attention_ref(q[r, hh * g : (hh + 1) * g], ks[hh][None], vs[hh][None], scale)
            torch.testing.assert_close(out[r, hh * g : (hh + 1) * g], o_ref, rtol=1e-4, atol=1e-4)
            if lse is not None:
                torch.testing.assert_close(lse[r, hh * g : (hh + 1) * g], lse_ref, rtol=1e-4, atol=1e-4)


def _budget(params, h, bs, d, elem=4):
    return page_budget(params.budget, num_kv_heads=h, block_size=bs, head_dim=d, elem_size=elem,
                       sink_tokens=params.sink_tokens, recent_window=params.recent_window,
                       moments=params.moment_correction)


def _round(caches, block_ids, num_tokens, params, scale, prev=None, **kw):
    h, bs, d = caches[0][0].shape[1:]
    plan = plan_round(caches, block_ids, num_tokens, params, _budget(params, h, bs, d), scale, prev=prev, **kw)
    return None if plan is None else (apply_round(caches, plan), plan)


def test_first_round_keeps_the_budget_in_whole_blocks_and_packs_raggedly():
    h, bs, d, nb, layers = 3, 16, 32, 80, 4
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(layers)]
    num_tokens = 20 * bs + 5
    block_ids = list(range(50, 71))
    params = resolve_request(EvictionConfig(policy="knorm", budget=70, recent_window=8, sink_tokens=2), None)
    before = [(k.clone(), v.clone()) for k, v in caches]
    lay, plan = _round(caches, block_ids, num_tokens, params, scale=d ** -0.5)
    assert lay.region_blocks == 20
    # 70 tokens per head = 4 whole blocks of 16: every layer holds 3 heads x 4 head-pages
    assert (lay.pages.sum(dim=1) == 12).all()
    assert lay.kept_blocks == 4 and lay.block_ids == block_ids[:4] and lay.block_slots == [0, 1, 2, 3]
    assert plan.freed_slots == list(range(4, 20)) and plan.freed_blocks == block_ids[4:20]
    # partial tail block (index 20) untouched; kept positions are region positions, sorted, sinks first
    for (k0, v0), (k1, v1) in zip(before, caches):
        assert torch.equal(k0[70], k1[70]) and torch.equal(v0[70], v1[70])
    for layer in range(layers):
        for hh in range(h):
            pos = lay.kept_positions(layer, hh)
            assert pos[:2].tolist() == [0, 1] and bool((pos[1:] > pos[:-1]).all()) and int(pos.max()) < 20 * bs


def test_budget_at_least_the_prompt_plans_nothing():
    h, bs, d, nb = 2, 16, 32, 30
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(2)]
    block_ids = [3, 9, 4, 20, 11]
    for moments in (False, True):
        params = resolve_request(EvictionConfig(policy="streaming", budget=5 * bs + 3, moment_correction=moments),
                                 None)
        assert plan_round(caches, block_ids, 5 * bs, params, _budget(params, h, bs, d), 1.0) is None


def test_budget_exactly_the_prompt_or_its_whole_blocks_plans_nothing_one_block_less_evicts():
    """Boundaries of "evict only when the full blocks do not fit": budget = the prompt (a whole number of
    blocks), a prompt whose full blocks are exactly ``N // bs`` (``E == N // bs``, its partial block on top),
    and one token or one block less."""
    h, bs, d, nb = 2, 16, 32, 30
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(2)]
    block_ids = [3, 9, 4, 20, 11, 7]
    for moments in (False, True):
        def plan(budget, n):
            params = resolve_request(EvictionConfig(policy="streaming", budget=budget, moment_correction=moments,
                                                    sink_tokens=2, recent_window=8), None)
            return plan_round(caches, block_ids[: -(-n // bs)], n, params, _budget(params, h, bs, d), 1.0)

        assert plan(5 * bs, 5 * bs) is None  # budget == prompt
        assert plan(5 * bs, 5 * bs + 7) is None  # E == N // bs == 5, the partial block stays dense
        assert plan(5 * bs - 1, 5 * bs) is not None  # N // bs == 4 < E == 5
        assert plan(4 * bs, 5 * bs + 7) is not None  # E == N // bs + 1


@pytest.mark.parametrize("budget", [96, 104, 97])
def test_blocks_held_after_every_step_stay_within_the_documented_bound(budget):
    """A short prompt decoding with rounds on the scheduler's clock (the first when budget + T tokens have KV,
    then whenever the tail behind the region reaches T): the blocks held after every token equal the
    documented bound at their peak, ``held_blocks_bound`` = max(N // bs + T // bs, ceil((N + T - 1) / bs)).
    104 tokens (104 % 16 = 8) hold one block more while dense; 97 (97 % 16 = 1) does not."""
    h, bs, d, layers, interval = 3, 16, 32, 2, 32
    nb = 80
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(layers)]
    truth = _truth(layers, h, d, 600, seed=4)
    req = _Request(caches, truth, bs, list(range(nb - 1, 0, -1)))
    params = resolve_request(EvictionConfig(policy="knorm", budget=budget, recent_window=8, sink_tokens=2), None)
    pb = _budget(params, h, bs, d)
    bound = pb.held_blocks_bound(interval)
    assert bound == {96: 8, 104: 9, 97: 8}[budget]
    req.append(40)
    held, lay, due, rounds = [], None, budget + interval, 0
    while req.n < 400:
        req.append(1)
        if req.n == due:  # the round runs in this step, after the forward
            plan = plan_round(caches, req.block_ids, req.n, params, pb, d ** -0.5, prev=lay)
            assert plan is not None, req.n
            lay = apply_round(caches, plan)
            req.free(plan.freed_slots)
            rounds += 1
            due = lay.region_blocks * bs + interval
        held.append(sum(1 for b in req.block_ids if b >= 0))
    assert rounds >= 5
    assert max(held) == bound, held


def test_budget_below_the_floor_is_refused_naming_it():
    with pytest.raises(BudgetError, match=r"floor of 64 tokens.*--kv-sink-tokens, --kv-recent-window"):
        page_budget(40, num_kv_heads=3, block_size=32, head_dim=64, elem_size=4, sink_tokens=4,
                    recent_window=32, moments=False)
    # moments take 4 head-pages per layer of 3 heads (64 dims, fp32): the floor rises to 4 blocks
    with pytest.raises(BudgetError, match=r"floor of 128 tokens.*--kv-moment-correction"):
        page_budget(96, num_kv_heads=3, block_size=32, head_dim=64, elem_size=4, sink_tokens=4,
                    recent_window=32, moments=True)
    pb = page_budget(128, num_kv_heads=3, block_size=32, head_dim=64, elem_size=4, sink_tokens=4,
                     recent_window=32, moments=True)
    assert (pb.layer_pages, pb.moment_pages, pb.token_pages, pb.kept_blocks) == (12, 4, 8, 4)


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("moments", [False, True])
def test_held_blocks_never_exceed_the_budget_over_prompt_lengths(bs, moments):
    """The reliability bug (moment pages on short prompts): for every prompt length x budget, a round either
    plans nothing or holds at most budget // bs blocks, moment pages included."""
    h, d, layers = 3, 64, 2
    nb = 4096 // bs + 4
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(layers)]
    for budget in (64, 96, 128, 200, 256, 512):
        params = resolve_request(EvictionConfig(policy="knorm", budget=budget, moment_correction=moments), None)
        try:
            pb = _budget(params, h, bs, d)
        except BudgetError:
            assert moments and budget < 128 * (bs // 16 if bs == 32 else 1) or budget < 64
            continue
        for n in (20, 60, 100, 106, 150, 300, 700, 2000):
            block_ids = list(range(1, (n + bs - 1) // bs + 1))
            plan = plan_round(caches, block_ids, n, params, pb, d ** -0.5)
            if n <= budget:
                assert plan is None, (budget, n)
                continue
            if plan is None:
                assert h * (n // bs) <= pb.layer_pages
                continue
            lay = plan.layout
            assert lay.kept_blocks <= budget // bs, (budget, n, lay.kept_blocks)
            assert (lay.pages.sum(dim=1) + pb.moment_pages <= pb.layer_pages).all()
            assert (lay.moment_page_ids is not None) == moments


def _truth(layers, h, d, n_pos, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, h, n_pos, d, generator=g), torch.randn(layers, h, n_pos, d, generator=g)


class _Request:
    """A request's blocks in a cache: tokens are written densely as they are 'generated'; a round frees
    blocks (they are handed to nobody, and overwritten with garbage to catch stale reads)."""

    def __init__(self, caches, truth, bs, free_pool):
        self.caches, self.truth, self.bs, self.pool = caches, truth, bs, free_pool
        self.block_ids: list[int] = []
        self.n = 0

    def append(self, count):
        tk, tv = self.truth
        for _ in range(count):
            if self.n % self.bs == 0:
                self.block_ids.append(self.pool.pop())
            b, off = self.block_ids[self.n // self.bs], self.n % self.bs
            lanes = torch.arange(tk.shape[1])
            for layer, (kc, vc) in enumerate(self.caches):
                set_rows(kc, b, lanes, off, tk[layer, :, self.n])
                set_rows(vc, b, lanes, off, tv[layer, :, self.n])
            self.n += 1

    def free(self, slots):
        for s in slots:
            b = self.block_ids[s]
            for kc, vc in self.caches:
                kc[b].fill_(1e4)
                vc[b].fill_(-1e4)
            self.block_ids[s] = -1


@pytest.mark.parametrize("policy,moments,layout", [
    ("snapkv", False, "transposed"), ("snapkv", True, "transposed"), ("knorm", True, "transposed"),
    ("h2o", False, "transposed"), ("contour_diverse", False, "transposed"),
    ("snapkv", True, "amx"), ("h2o", False, "amx")])
def test_several_rounds_keep_original_tokens_and_decode_equals_dense_attention(policy, moments, layout):
    """Prompt, then rounds every T generated tokens: each head's kept tokens are exactly original tokens at
    the positions the layout records (lane borrowing across rounds), the blocks held stay within the
    budget, moment n equals the tokens evicted so far (and sum_k their keys), and the decode op over
    kept + tail equals dense attention over exactly those tokens (moments on: plus the closed form). Also
    on vLLM's AMX bf16 page packing (two-level views; fp32 bytes, the addressing is what is tested)."""
    from vllm_contour import moments as mm

    h, g, bs, d, layers = 3, 3, 16, 32, 2
    budget, interval = 96, 32
    nb = 200
    key_layout = KEY_TRANSPOSED if layout == "transposed" else PageLayout.amx_bf16(bs, d)
    caches = [cpu_cache(nb, h, bs, d, seed=s, key_layout=key_layout)[1:] for s in range(layers)]
    truth = _truth(layers, h, d, 1000, seed=3)
    req = _Request(caches, truth, bs, list(range(nb - 1, 0, -1)))
    params = resolve_request(EvictionConfig(policy=policy, budget=budget, recent_window=8, sink_tokens=2,
                                            moment_correction=moments), None)
    pb = _budget(params, h, bs, d)
    scale = d ** -0.5
    gq = torch.Generator().manual_seed(9)
    req.append(200)
    lay = None
    bound = pb.held_blocks_bound(interval)
    assert bound == budget // bs + interval // bs  # a whole number of blocks: no dense-phase block on top
    held_trace = []
    for _ in range(5):
        w = 8
        qpos = torch.arange(req.n - w, req.n)
        queries = {layer: torch.randn(h * g, w, d, generator=gq) for layer in range(layers)}
        plan = plan_round(caches, req.block_ids, req.n, params, pb, scale, prev=lay, queries=queries,
                          query_positions=qpos)
        assert plan is not None
        lay = apply_round(caches, plan)
        req.free(plan.freed_slots)
        held_trace.append(sum(1 for b in req.block_ids if b >= 0))
        assert lay.kept_blocks <= budget // bs
        # the scheduler's clock: the next round runs when the tail behind the region reaches T tokens; the
        # blocks held after every generated token (one engine step each) stay within the formula
        while req.n < lay.region_blocks * bs + interval:
            req.append(1)
            held_trace.append(sum(1 for b in req.block_ids if b >= 0))
    assert max(held_trace) == bound, held_trace  # reached in each round's step, before the round frees
    tk, tv = truth
    e = lay.region_blocks
    tail_tokens = req.n - e * bs
    tail_blocks = req.block_ids[e:]
    table, seq_lens = decode_page_table(lay, tail_blocks, tail_tokens)
    q = torch.randn(1, h * g, d, generator=gq)
    for layer, (kc, vc) in enumerate(caches):
        mom = None
        if moments:
            mom = ops.load_moments(kc, vc, lay.moment_page_ids[layer].to(torch.int64).view(1, -1), h, d)
        out, _ = ops.ragged_decode_attention(q, kc, vc, table[layer].unsqueeze(0), seq_lens[layer].unsqueeze(0),
                                             scale, moments=mom, impl="torch")
        for hh in range(h):
            pos = lay.kept_positions(layer, hh)
            ks, vs = _explicit_kv(kc, vc, table[layer, hh], int(seq_lens[layer, hh]), bs, h)
            want_pos = torch.cat([pos, torch.arange(e * bs, req.n)])
            assert torch.equal(ks, tk[layer, hh, want_pos]) and torch.equal(vs, tv[layer, hh, want_pos])
            o_ref, lse_ref = dense_attention_ref(q[0, hh * g:(hh + 1) * g], tk[layer, hh, want_pos][None],
                                                 tv[layer, hh, want_pos][None], scale)
            evicted = torch.ones(e * bs, dtype=torch.bool)
            evicted[pos] = False
            assert int(lay.evicted[layer, hh]) == int(evicted.sum())
            if moments:
                assert int(mom["n"][0, hh]) == int(evicted.sum())
                torch.testing.assert_close(mom["sum_k"][0, hh], tk[layer, hh, :e * bs][evicted].sum(0),
                                           rtol=1e-4, atol=1e-3)
                ev = mm.Moments(mom["n"][0, hh:hh + 1], mom["sum_k"][0, hh:hh + 1], mom["sum_v"][0, hh:hh + 1],
                                mom["sum_vk"][0, hh:hh + 1])
                qg = q[0, hh * g:(hh + 1) * g].view(1, g, d)
                o_ref, _ = mm.merge_evicted(o_ref.view(1, g, d), lse_ref.view(1, g), qg, ev, scale)
                o_ref = o_ref.view(g, d)
            torch.testing.assert_close(out[0, hh * g:(hh + 1) * g], o_ref, rtol=1e-4, atol=1e-4)
    assert lay.rounds == 5


def test_round_with_nothing_new_plans_nothing_and_plan_errors_write_nothing():
    h, bs, d, nb = 2, 16, 32, 64
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(2)]
    params = resolve_request(EvictionConfig(policy="knorm", budget=64), None)
    pb = _budget(params, h, bs, d)
    block_ids = list(range(1, 21))
    lay, _ = _round(caches, block_ids, 20 * bs, params, 1.0)
    assert plan_round(caches, block_ids + [25], 20 * bs + 3, params, pb, 1.0, prev=lay) is None
    snapshot = [(k.clone(), v.clone()) for k, v in caches]
    with pytest.raises(PlanError, match="needs window queries"):
        sp = resolve_request(EvictionConfig(policy="snapkv", budget=64), None)
        plan_round(caches, block_ids + [30, 31], 22 * bs, sp, pb, 1.0, prev=lay)
    with pytest.raises(PlanError, match="blocks"):
        plan_round(caches, block_ids[:3], 20 * bs, params, pb, 1.0)
    assert all(torch.equal(a, c) and torch.equal(b, e) for (a, b), (c, e) in zip(snapshot, caches))


def test_query_agnostic_keeps_question_dense_and_ignores_it():
    h, bs, d, nb = 2, 16, 32, 40
    num_tokens, ctx = 20 * bs + 7, 15 * bs + 3
    block_ids = list(range(1, 22))
    params = resolve_request(EvictionConfig(policy="keydiff", budget=64), {"kv_context_len": ctx})
    a = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(2)]
    b = [(k.clone(), v.clone()) for k, v in a]
    # change the question tokens' keys in copy b: the kept set must not change
    for k, v in b:
        for t in range(ctx, num_tokens):
            k[block_ids[t // bs], :, t % bs] += 5.0
    la, _ = _round(a, block_ids, num_tokens, params, scale=d ** -0.5)
    lb, _ = _round(b, block_ids, num_tokens, params, scale=d ** -0.5)
    assert la.region_blocks == ctx // bs == 15
    assert torch.equal(la.pages, lb.pages) and torch.equal(la.page_ids, lb.page_ids)
    for (ka, _), (kb, _) in zip(a, b):
        for blk in block_ids[:la.kept_blocks]:
            # packed runs hold the same context tokens (question keys differ only in the tail blocks)
            assert torch.equal(ka[blk], kb[blk])


@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_query_tokens_on_a_compacted_request_are_causal_ragged_rows(impl, dtype):
    """A multi-token step on a compacted request (the rest of a prompt after its context was compressed):
    one ragged row per query token, sharing the request's page table, each row ending at its own token,
    equals dense causal attention over exactly the kept set + the new tokens (lane borrowing, a partial
    last page, the new tokens spanning pages)."""
    if impl not in ops.available("ragged_decode_attention", "cpu"):
        from vllm_contour.ops import cpu_ext

        cpu_ext.load(jit=True)
    h, g, bs, d, nb = 3, 3, 16, 32, 80
    kv, kc, vc = cpu_cache(nb, h, bs, d, dtype=dtype, seed=4)
    pages = torch.tensor([[3, 1, 2]])
    kept_blocks = [40, 41]
    lay = plan_layout(pages, kept_blocks, bs, h, region_blocks=10)
    tail_blocks = [50, 51, 52]
    tail_tokens, q_len = 2 * bs + 5, 23  # the last 23 tail tokens are this step's new ones
    table, seq = decode_page_table(lay, tail_blocks, tail_tokens)
    rows_t = torch.stack([table[0]] * q_len)  # [R, H, P]
    rows_s = torch.stack([seq[0] - (q_len - 1 - i) for i in range(q_len)])
    q = torch.randn(q_len, h * g, d).to(dtype)
    scale = d ** -0.5
    out, _ = ops.ragged_decode_attention(q, kc, vc, rows_t, rows_s, scale, impl=impl)
    for i in range(q_len):
        for hh in range(h):
            n = int(seq[0, hh]) - (q_len - 1 - i)
            ks, vs = _explicit_kv(kc, vc, table[0, hh], n, bs, h)
            o_ref, _ = dense_attention_ref(q[i, hh * g:(hh + 1) * g], ks[None], vs[None], scale)
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out[i, hh * g:(hh + 1) * g].float(), o_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("moments", [False, True])
def test_a_round_into_private_blocks_reads_the_originals_and_writes_only_the_private_ones(moments):
    """Prefix caching: the request's blocks may be hashed or shared. With ``fresh_ids`` the round packs the
    same tokens (same layout, same bytes per page) into the private blocks, every original block is left
    as it was, and a failure while applying leaves nothing of the request's cache changed."""
    h, bs, d, nb, layers = 3, 16, 32, 80, 3
    seeds = range(layers)
    num_tokens = 20 * bs + 5
    block_ids = list(range(40, 61))
    params = resolve_request(EvictionConfig(policy="knorm", budget=70, recent_window=8, sink_tokens=2,
                                            moment_correction=moments), None)
    in_place = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in seeds]
    lay_a, plan_a = _round(in_place, block_ids, num_tokens, params, scale=d ** -0.5)
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in seeds]
    before = [(k.clone(), v.clone()) for k, v in caches]
    fresh = [5, 70, 12, 33, 8, 9, 2][: _budget(params, h, bs, d).kept_blocks]
    lay_b, plan_b = _round(caches, block_ids, num_tokens, params, scale=d ** -0.5, fresh_ids=fresh)
    k = lay_a.kept_blocks
    assert lay_b.kept_blocks == k and lay_b.block_ids == fresh[:k] and lay_b.block_slots == list(range(k))
    assert plan_b.fresh and plan_b.replaced == [(s, block_ids[s], fresh[s]) for s in range(k)]
    assert plan_b.freed_slots == plan_a.freed_slots and plan_b.freed_blocks == plan_a.freed_blocks
    assert torch.equal(lay_a.pages, lay_b.pages) and torch.equal(lay_a.positions, lay_b.positions)
    untouched = [b for b in range(nb) if b not in fresh[:k]]
    for layer in range(layers):
        (k0, v0), (k1, v1), (ka, va) = before[layer], caches[layer], in_place[layer]
        assert torch.equal(k0[untouched], k1[untouched]) and torch.equal(v0[untouched], v1[untouched])
        for i in range(k):  # private block i holds what the in-place round put in the request's slot i
            assert torch.equal(k1[fresh[i]], ka[block_ids[i]]) and torch.equal(v1[fresh[i]], va[block_ids[i]])
    # a failure while applying a private-block round leaves the request's own blocks as they were
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in seeds]
    plan = plan_round(caches, block_ids, num_tokens, params, _budget(params, h, bs, d), d ** -0.5,
                      fresh_ids=fresh)
    from vllm_contour.integration.faults import _compaction_fails_after_first_layer

    with pytest.raises(RuntimeError), _compaction_fails_after_first_layer():
        apply_round(caches, plan)
    for layer in range(layers):
        assert torch.equal(before[layer][0][untouched], caches[layer][0][untouched])
        assert torch.equal(before[layer][1][untouched], caches[layer][1][untouched])


def test_pipeline_stages_plan_their_layers_as_the_whole_model_does():
    """With pipeline parallelism each stage plans its own layers: given its place in the model (``layers``),
    the stages' plans equal the whole model's layer by layer (PyramidKV's budgets depend on depth; without
    the offset the second stage would plan a pyramid of its own)."""
    num_layers, h, bs, d, hq = 4, 2, 16, 32, 4
    _, k, v = cpu_cache(40, h, bs, d, seed=11)
    caches = [(k[i * 10:(i + 1) * 10], v[i * 10:(i + 1) * 10]) for i in range(num_layers)]
    params = resolve_request(EvictionConfig(policy="pyramidkv", budget=96, recent_window=8, sink_tokens=2), None)
    pb = _budget(params, h, bs, d)
    g = torch.Generator().manual_seed(12)
    queries = {layer: torch.randn(hq, params.window, d, generator=g) for layer in range(num_layers)}
    n = 10 * bs
    qpos = torch.arange(n - params.window, n)
    whole = plan_round(caches, list(range(10)), n, params, pb, d ** -0.5, queries=queries, query_positions=qpos)
    stage2 = plan_round(caches[2:], list(range(10)), n, params, pb, d ** -0.5, queries={0: queries[2], 1: queries[3]},
                        query_positions=qpos, layers=(2, num_layers))
    alone = plan_round(caches[2:], list(range(10)), n, params, pb, d ** -0.5, queries={0: queries[2], 1: queries[3]},
                       query_positions=qpos)
    assert torch.equal(stage2.layout.pages, whole.layout.pages[2:])
    for layer in range(2):
        for hh in range(h):
            assert torch.equal(stage2.layout.kept_positions(layer, hh), whole.layout.kept_positions(layer + 2, hh))
    assert not torch.equal(alone.layout.pages, whole.layout.pages[2:])


@pytest.mark.parametrize("policy,moments,layout,impl", [
    ("snapkv", True, "amx", None), ("adakv", False, "transposed", None), ("h2o", False, "amx", None),
    ("contour", True, "transposed", "torch")])
def test_rounds_due_in_the_same_step_applied_together_equal_one_after_another(policy, moments, layout, impl,
                                                                              monkeypatch):
    """Four requests (one whose blocks another holds too: its rounds read those and write private blocks),
    rounds on the same steps: applied together (``apply_rounds``, one compaction per layer) they keep the
    same positions and leave bit-identical caches as applied one request after another, over several
    rounds with moments and lanes borrowed across heads (an allocator that gives heads different pages)."""
    from vllm_contour.evictor import apply_rounds

    if impl is not None:
        monkeypatch.setenv("VLLM_CONTOUR_OPS_IMPL", impl)
    h, g, bs, d, layers, nb = 3, 3, 16, 32, 2, 240
    key_layout = KEY_TRANSPOSED if layout == "transposed" else PageLayout.amx_bf16(bs, d)
    runs = []
    for batched in (False, True):
        caches = [cpu_cache(nb, h, bs, d, seed=s, key_layout=key_layout)[1:] for s in range(layers)]
        pool = list(range(nb - 1, 0, -1))
        reqs = [_Request(caches, _truth(layers, h, d, 600, seed=10 + r), bs, pool) for r in range(4)]
        params = resolve_request(EvictionConfig(policy=policy, budget=96, recent_window=8, sink_tokens=2,
                                                moment_correction=moments), None)
        pb = _budget(params, h, bs, d)
        for r, req in enumerate(reqs):
            req.append(150 + 16 * r)
        reqs[3].block_ids[:4] = reqs[0].block_ids[:4]  # request 3 holds request 0's first blocks too
        lays = [None] * 4
        gq = torch.Generator().manual_seed(5)
        positions = []
        for _ in range(3):
            plans = []
            for r, req in enumerate(reqs):
                qpos = torch.arange(req.n - 8, req.n)
                queries = {layer: torch.randn(h * g, 8, d, generator=gq) for layer in range(layers)}
                shared = r in (0, 3) and lays[r] is None  # blocks two requests hold: written by neither
                fresh = [pool.pop() for _ in range(pb.kept_blocks)] if shared else None
                plans.append(plan_round(caches, req.block_ids, req.n, params, pb, d ** -0.5, prev=lays[r],
                                        queries=queries, query_positions=qpos, fresh_ids=fresh))
            if batched:
                lays = apply_rounds(caches, plans)
            else:
                lays = [apply_round(caches, p) for p in plans]
            for r, (req, plan) in enumerate(zip(reqs, plans)):
                for slot, _, new in plan.replaced:
                    req.block_ids[slot] = new
                for s in plan.freed_slots:
                    req.block_ids[s] = -1
                req.append(48)
            positions.append([lay.positions.clone() for lay in lays])
        if policy in ("adakv", "contour"):
            assert any(bool((lay.pages != lay.pages[:, :1]).any()) for lay in lays)  # heads keep different pages
        runs.append(([(kc.clone(), vc.clone()) for kc, vc in caches], positions))
    (seq_caches, seq_pos), (bat_caches, bat_pos) = runs
    for (k0, v0), (k1, v1) in zip(seq_caches, bat_caches):
        assert torch.equal(k0.view(torch.int32), k1.view(torch.int32)) and torch.equal(v0, v1)
    for a, b in zip(seq_pos, bat_pos):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("policy", list(PRESETS))
def test_decode_time_rounds_planned_together_equal_each_planned_alone(policy):
    """Four requests of different lengths (their kept runs and tails differ in width), three rounds each:
    the rounds of all of them planned as one (``plan_rounds``: one policy pass, allocation and selection
    over all their rows) give each request the plan it gets alone (``plan_round``): the same kept positions,
    pages, moves, evicted sets and carried scores, for every preset."""
    from vllm_contour.evictor import RoundRequest, plan_rounds

    h, g, bs, d, layers, nb = 3, 3, 16, 32, 3, 300
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(layers)]
    pool = list(range(nb - 1, 0, -1))
    reqs = [_Request(caches, _truth(layers, h, d, 700, seed=20 + r), bs, pool) for r in range(4)]
    params = resolve_request(EvictionConfig(policy=policy, budget=64, recent_window=8, sink_tokens=2,
                                            moment_correction=policy == "snapkv"), None)
    pb = _budget(params, h, bs, d)
    gq = torch.Generator().manual_seed(7)
    for r, req in enumerate(reqs):
        req.append(140 + 23 * r)
    lays = [None] * 4
    for step in range(3):
        asks = []
        for r, req in enumerate(reqs):
            queries = {layer: torch.randn(h * g, params.window, d, generator=gq) for layer in range(layers)}
            recon = torch.rand(layers, h, req.n + 64, generator=gq)
            asks.append(RoundRequest(list(req.block_ids), req.n, lays[r], queries,
                                     torch.arange(req.n - params.window, req.n), reconstruction=recon))
        together = plan_rounds(caches, asks, params, pb, d ** -0.5)
        alone = [plan_round(caches, a.block_ids, a.num_tokens, params, pb, d ** -0.5, prev=a.prev, queries=a.queries,
                            query_positions=a.query_positions, reconstruction=a.reconstruction) for a in asks]
        for x, y in zip(together, alone):
            assert torch.equal(x.layout.positions, y.layout.positions)
            assert torch.equal(x.layout.pages, y.layout.pages)
            assert (x.layout.carry is None) == (y.layout.carry is None)
            assert x.layout.carry is None or torch.equal(x.layout.carry, y.layout.carry)
            for lx, ly in zip(x.layers, y.layers):
                assert all(torch.equal(a, b) for a, b in zip(lx.moves, ly.moves))
                assert (lx.evicted is None) == (ly.evicted is None)
                assert lx.evicted is None or all(torch.equal(a, b) for a, b in zip(lx.evicted, ly.evicted))
        lays = [apply_round(caches, plan) for plan in alone]
        for r, (req, plan) in enumerate(zip(reqs, alone)):
            req.free(plan.freed_slots)
            req.append(40 + 8 * r)
    assert all(lay.rounds == 3 for lay in lays)


@pytest.mark.parametrize("policy", ["kvzip", "contour_kvzip"])
def test_a_later_kvzip_round_reads_its_rows_scores_by_original_position(policy):
    """A streaming-input session's next chunk: the round over the kept tokens and the new tail reads the
    reconstruction scores of each row's tokens by their original positions (the kept ones' from the first
    reconstruction, the tail's from the next): the tail block and the kept tokens scored high stay."""
    h, bs, d, nb, layers = 2, 16, 32, 80, 2
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(layers)]
    params = resolve_request(EvictionConfig(policy=policy, budget=64, recent_window=8, sink_tokens=2), None)
    g = torch.Generator().manual_seed(3)
    first = torch.rand(layers, h, 20 * bs, generator=g)
    block_ids = list(range(1, 21))
    lay, _ = _round(caches, block_ids, 20 * bs, params, d ** -0.5, reconstruction=first)
    scores = torch.cat([first, torch.zeros(layers, h, 6 * bs)], dim=2) * 0.01
    scores[:, :, 21 * bs:22 * bs] = 10.0  # a whole new block the next reconstruction scores high
    favoured = {}
    for layer in range(layers):
        for hh in range(h):
            pos = lay.kept_positions(layer, hh)[2:10]  # eight kept tokens past the sinks
            scores[layer, hh, pos] = 5.0
            favoured[layer, hh] = set(pos.tolist())
    with pytest.raises(PlanError, match="none ran"):
        plan_round(caches, block_ids + list(range(30, 36)), 26 * bs, params, _budget(params, h, bs, d), d ** -0.5,
                   prev=lay)
    lay2, _ = _round(caches, block_ids + list(range(30, 36)), 26 * bs, params, d ** -0.5, prev=lay,
                     reconstruction=scores)
    for layer in range(layers):
        for hh in range(h):
            kept = set(lay2.kept_positions(layer, hh).tolist())
            assert set(range(21 * bs, 22 * bs)) <= kept and favoured[layer, hh] <= kept, (layer, hh)
