"""Ragged layout, compaction and the decode op against explicit dense attention (pure torch)."""

import random

import pytest
import torch

from vllm_contour import ops
from vllm_contour.config import EvictionConfig, resolve_request
from vllm_contour.evictor import base_layer_pages, evict_request
from vllm_contour.layout import compaction_indices, decode_page_table, kept_blocks_for, plan_layout
from vllm_contour.ops.cpu_layout import KEY_TRANSPOSED, cpu_kv_views
from vllm_contour.ops.reference import dense_attention_ref


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
    lay = plan_layout(pages, list(range(10, 20)), 16, 3, region_blocks=6)
    assert lay.kept_blocks == 2 and lay.freed_blocks == 4
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
        plan_layout(torch.tensor([[4, 0]]), [1, 2, 3], 16, 2, region_blocks=3)


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
    sp, so, dp, do = compaction_indices(kept, lay.page_ids[0], block_ids, bs, h)
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
        ks.append(kc[b, lane, j % bs])
        vs.append(vc[b, lane, j % bs])
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


def test_evict_request_keeps_budget_and_packs_raggedly():
    h, bs, d, nb, layers = 3, 16, 32, 80, 4
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(layers)]
    num_tokens = 20 * bs + 5
    block_ids = list(range(50, 71))
    params = resolve_request(EvictionConfig(policy="knorm", budget=64, recent_window=8, sink_tokens=2), None)
    before = [(k.clone(), v.clone()) for k, v in caches]
    res = evict_request(caches, block_ids, num_tokens, params, scale=d ** -0.5)
    lay = res.layout
    assert lay.region_blocks == 20
    expected = base_layer_pages(64, h, bs, 5)
    assert (lay.pages.sum(dim=1) == expected).all()
    assert lay.kept_blocks == -(-expected // h)
    # tail block (index 20) untouched
    for (k0, v0), (k1, v1) in zip(before, caches):
        assert torch.equal(k0[70], k1[70]) and torch.equal(v0[70], v1[70])


def test_evict_request_budget_above_prompt_is_a_permutation():
    h, bs, d, nb = 2, 16, 32, 30
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(2)]
    num_tokens = 5 * bs
    block_ids = [3, 9, 4, 20, 11]
    before = [(k.clone(), v.clone()) for k, v in caches]
    params = resolve_request(EvictionConfig(policy="streaming", budget=10_000), None)
    lay = evict_request(caches, block_ids, num_tokens, params, scale=1.0).layout
    assert lay.kept_blocks == lay.region_blocks == 5
    for layer, ((k0, _), (k1, _)) in enumerate(zip(before, caches)):
        for head in range(h):
            tab, sl = decode_page_table(lay, [], 0)
            ks, _ = _explicit_kv(k1, k1, tab[layer, head], int(sl[layer, head]), bs, h)
            orig = k0[block_ids].permute(1, 0, 2, 3).reshape(h, -1, d)[head]
            assert torch.equal(ks, orig)


def test_moment_pages_are_counted_and_round_trip():
    from vllm_contour import moments as mm
    from vllm_contour.evictor import moment_pages_for, read_moments

    h, bs, d, nb, layers = 3, 32, 64, 60, 2
    caches = [cpu_cache(nb, h, bs, d, seed=s)[1:] for s in range(layers)]
    num_tokens = 24 * bs
    block_ids = list(range(10, 34))
    keys0 = [k[block_ids].permute(1, 0, 2, 3).reshape(h, -1, d).clone() for k, _ in caches]
    vals0 = [v[block_ids].permute(1, 0, 2, 3).reshape(h, -1, d).clone() for _, v in caches]
    base = EvictionConfig(policy="knorm", budget=256, recent_window=8, sink_tokens=2)
    plain = evict_request([(k.clone(), v.clone()) for k, v in caches], block_ids, num_tokens,
                          resolve_request(base, None), scale=d ** -0.5).layout
    params = resolve_request(base, {"kv_moment_correction": True})
    lay = evict_request(caches, block_ids, num_tokens, params, scale=d ** -0.5).layout
    m = moment_pages_for(h, d, bs, 4)
    assert m == 4 and lay.moment_page_ids.shape == (layers, m)
    # the statistics take pages from the same budget: token pages + moment pages = plain token pages
    assert (lay.pages.sum(dim=1) + m == plain.pages.sum(dim=1)).all()
    for layer, (kc, vc) in enumerate(caches):
        got = read_moments(kc, lay.moment_page_ids[layer], h, d)
        evicted = torch.ones(h, num_tokens, dtype=torch.bool)
        tab, sl = decode_page_table(lay, [], 0)
        for hh in range(h):
            ks, _ = _explicit_kv(kc, vc, tab[layer, hh], int(sl[layer, hh]), bs, h)
            # kept keys are exactly original tokens; mark them
            for row in ks:
                j = int(((keys0[layer][hh] - row).abs().sum(-1) == 0).nonzero()[0])
                evicted[hh, j] = False
        want = mm.accumulate(keys0[layer], vals0[layer], evicted)
        torch.testing.assert_close(got["n"], want.n)
        # fp32 sums over ~600 tokens in another order (the C++ op accumulates per token)
        for key, w in (("sum_k", want.sum_k), ("sum_v", want.sum_v), ("sum_vk", want.sum_vk)):
            torch.testing.assert_close(got[key], w, rtol=1e-4, atol=1e-4)


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
    la = evict_request(a, block_ids, num_tokens, params, scale=d ** -0.5).layout
    lb = evict_request(b, block_ids, num_tokens, params, scale=d ** -0.5).layout
    assert la.region_blocks == ctx // bs == 15
    assert torch.equal(la.pages, lb.pages) and torch.equal(la.page_ids, lb.page_ids)
    for (ka, _), (kb, _) in zip(a, b):
        for blk in block_ids[:la.kept_blocks]:
            # packed runs hold the same context tokens (question keys differ only in the tail blocks)
            assert torch.equal(ka[blk], kb[blk])
