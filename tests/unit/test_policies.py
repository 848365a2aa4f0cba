"""Unit tests of the policy library (pure torch, no vLLM): scorers, allocators, selectors, presets."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from vllm_contour.policies import (Allocator, LayerBudget, LayerInputs, Policy, Scorer, Selector, build_policy,
                                   policy_help, policy_names)
from vllm_contour.policies.allocators import (AdaKVAllocator, ContourAllocator, PyramidAllocator,
                                              UniformAllocator, clamp_total, dropped_mass, mass_curve,
                                              pyramid_schedule, score_mass)
from vllm_contour.policies.scorers import (ExpectedAttentionScorer, H2OScorer, KeyDiffScorer, KeyNormScorer,
                                           MomentScorer, RecencyScorer, SnapKVScorer, TOVAScorer,
                                           window_attention)
from vllm_contour.policies.selectors import (BalancingSelector, DiversitySelector, TopKSelector,
                                             normalise_scores, topk_indices)
from vllm_contour.policies.selectors import diversity
from vllm_contour.moments import accumulate, residual_norms

ALL = policy_names()
# Ragged rounds (decode-time, a streaming-input session's next chunk): every preset
RAGGED = ALL
QUERY_FREE = [n for n in ALL if not build_policy(n).needs_queries]


def make_inp(h=2, hq=4, t=100, d=8, bs=8, region_pages=None, window_end=None, w=6, seed=0, queries=True,
             layer_idx=0, num_layers=4, positions=True) -> LayerInputs:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(h, t, d, generator=g)
    values = torch.randn(h, t, d, generator=g)
    ce = t if window_end is None else window_end
    if region_pages is None:
        region_pages = ce // bs
    q = torch.randn(hq, w, d, generator=g) * 2 if queries else None
    qpos = torch.arange(ce - w, ce) if (queries and positions) else None
    # KVzip's scores of the context (what the engine's reconstruction hands kvzip and contour_kvzip)
    recon = torch.rand(h, ce, generator=g)
    return LayerInputs(keys=keys, values=values, region_len=region_pages * bs, page_size=bs,
                       layer_idx=layer_idx, num_layers=num_layers, scale=d ** -0.5, queries=q,
                       query_positions=qpos, window_end=window_end, reconstruction=recon)


class ConstScorer(Scorer):
    """Test helper: fixed scores."""

    def __init__(self, scores):
        self.scores = scores

    def score(self, inp):
        return self.scores.clone()


# ----------------------------------------------------------------------------------------- scorers
def test_window_attention_is_causal_and_drops_question_queries():
    inp = make_inp(t=40, w=6, window_end=30)
    # two of the captured queries lie in the question (positions >= window_end): they must be dropped
    inp.query_positions = torch.tensor([24, 26, 28, 29, 30, 35])
    attn = window_attention(inp)
    assert attn.shape == (4, 4, 40)
    for i, p in enumerate([24, 26, 28, 29]):
        assert torch.all(attn[:, i, p + 1:] == 0)
        torch.testing.assert_close(attn[:, i].sum(-1), torch.ones(4))


def test_h2o_is_window_mass_gqa_averaged():
    inp = make_inp(t=48, w=5)
    q, k = inp.queries, inp.keys
    want = torch.zeros(2, 48)
    for hq in range(4):
        kk = k[hq // 2]
        for i, p in enumerate(range(43, 48)):
            logits = (kk[: p + 1] @ q[hq, i]) * inp.scale
            want[hq // 2, : p + 1] += torch.softmax(logits, 0) / 2
    torch.testing.assert_close(H2OScorer().score(inp), want[:, : inp.region_len])


def test_tova_is_last_query_attention():
    inp = make_inp(t=48, w=5)
    inp.query_positions = torch.tensor([43, 44, 47, 45, 46])  # last query is the 3rd row
    want = torch.zeros(2, 48)
    for hq in range(4):
        want[hq // 2] += torch.softmax((inp.keys[hq // 2] @ inp.queries[hq, 2]) * inp.scale, 0) / 2
    torch.testing.assert_close(TOVAScorer().score(inp), want[:, : inp.region_len])


def test_snapkv_scores_unchanged():
    """The SnapKV scorer must keep its original behaviour (window mass, GQA mean, avg-pool 7)."""
    inp = make_inp(t=64, w=8)
    mass = H2OScorer().score(inp)
    want = F.avg_pool1d(mass.unsqueeze(1), 7, stride=1, padding=3, count_include_pad=False).squeeze(1)
    torch.testing.assert_close(SnapKVScorer().score(inp), want[:, : inp.region_len])


@pytest.mark.parametrize("ragged", [False, True])
def test_window_mass_a_few_rows_at_a_time_equals_all_rows_at_once(ragged, monkeypatch):
    """Window mass is computed a few rows at a time when the logits would be large: each chunk's rows with
    their own GQA queries, positions and the whole input's context end, so the result is the one-pass
    result exactly (a prompt's rows; a decode-time round's ragged rows with their own positions)."""
    from vllm_contour.policies.scorers import common

    inp = make_inp(h=6, hq=12, t=90, w=7, seed=4)
    if ragged:  # rows with their own positions (kept tokens then a tail), padding, a context past the region
        g = torch.Generator().manual_seed(5)
        pos = torch.sort(torch.randperm(200, generator=g)[:90].view(1, -1).expand(6, -1) + 0, dim=1).values.clone()
        pos[:, -20:] = torch.arange(200, 220)
        inp = dataclasses.replace(inp, positions=pos, valid=torch.rand(6, 90, generator=g) > 0.2,
                                  head_pages=torch.tensor([8, 6, 8, 7, 5, 8]), region_len=64,
                                  query_positions=torch.arange(213, 220))
    whole = common.window_mass(inp)
    monkeypatch.setattr(common, "_CHUNK_BYTES", 12 * 7 * 90 * 4 // 4)  # four chunks
    assert torch.equal(common.window_mass(inp), whole)


def test_uniform_allocation_of_many_layers_at_once_equals_each_layer_alone():
    """``UniformAllocator.allocate_groups`` (one call over every (request, layer) of a joint plan) gives each
    group exactly ``allocate``'s split: caps below the share, floors above the caps, totals past the caps,
    zero caps, one to eight heads."""
    from vllm_contour.policies.allocators.uniform import UniformAllocator

    g = torch.Generator().manual_seed(3)
    for h in (1, 2, 3, 5, 8):
        caps = torch.randint(0, 12, (400, h), generator=g)
        totals = torch.randint(0, 60, (400,), generator=g)
        floors = torch.randint(0, 5, (400,), generator=g)
        got = UniformAllocator().allocate_groups(caps, totals, floors)
        for i in range(400):
            inp = make_inp(h=h, hq=h, t=96, bs=8, region_pages=12)
            inp.head_pages = caps[i]
            want = UniformAllocator().allocate(torch.zeros(h, 96), inp, LayerBudget(int(totals[i]), int(floors[i])))
            assert torch.equal(got[i], want), (caps[i], totals[i], floors[i], got[i], want)


def test_window_scorers_without_context_queries_give_zeros():
    inp = make_inp(t=40, w=4, window_end=32)
    inp.query_positions = torch.tensor([33, 34, 35, 36])  # all in the question
    for s in (H2OScorer(), TOVAScorer(), SnapKVScorer()):
        assert torch.all(s.score(inp) == 0)


def test_keydiff_hand_case():
    keys = torch.tensor([[[2.0, 0.0], [1.0, 0.0], [0.0, 3.0], [0.0, 1.0]]])  # [1, 4, 2]
    inp = LayerInputs(keys=keys, values=torch.ones(1, 4, 2), region_len=2, page_size=1, layer_idx=0,
                      num_layers=1, scale=1.0, window_end=3)
    # anchor over the context [0, 3): mean of normalised keys = (2/3, 1/3); question key 3 ignored
    a = torch.tensor([2 / 3, 1 / 3])
    want = -torch.tensor([a[0] / a.norm(), a[0] / a.norm()])
    torch.testing.assert_close(KeyDiffScorer().score(inp), want.view(1, 2))
    inp.region_len = 3
    s = KeyDiffScorer().score(inp)
    assert s[0, 2] > s[0, 0]  # the key orthogonal-ish to the anchor is kept first
    keys[0, 3] = torch.tensor([5.0, -7.0])  # question key: no effect
    torch.testing.assert_close(KeyDiffScorer().score(inp), s)


def test_expected_attention_single_query_is_its_attention():
    """One captured query: zero covariance, so the score is that query's softmax over the candidates
    (GQA-averaged) times ||v||."""
    inp = make_inp(t=40, w=1, window_end=40, bs=8)
    inp.query_positions = torch.tensor([39])
    r = inp.region_len
    want = torch.zeros(2, r)
    for hq in range(4):
        want[hq // 2] += torch.softmax(inp.keys[hq // 2, :r] @ inp.queries[hq, 0] * inp.scale, 0) / 2
    got = ExpectedAttentionScorer(use_vnorm=False).score(inp)
    torch.testing.assert_close(got, want)
    got_v = ExpectedAttentionScorer().score(inp)
    torch.testing.assert_close(got_v, want * inp.values[:, :r].norm(dim=-1))


def test_expected_attention_is_gaussian_mgf():
    """With many Gaussian window queries the closed form matches the Monte-Carlo E[exp(s q.k)] ratios."""
    g = torch.Generator().manual_seed(3)
    d, w, t = 4, 20000, 16
    mu = torch.tensor([0.5, -0.3, 0.2, 0.0])
    a = torch.randn(d, d, generator=g) * 0.4
    q = mu + torch.randn(w, d, generator=g) @ a.t()
    keys = torch.randn(1, t, d, generator=g)
    inp = LayerInputs(keys=keys, values=torch.ones(1, t, d), region_len=t, page_size=1, layer_idx=0,
                      num_layers=1, scale=0.5, queries=q.unsqueeze(0), query_positions=torch.full((w,), t - 1))
    got = ExpectedAttentionScorer(use_vnorm=False).score(inp)[0]
    mc = torch.exp(0.5 * keys[0] @ q.t()).mean(dim=1)
    torch.testing.assert_close(got, mc / mc.sum(), rtol=0.03, atol=1e-4)


def test_expected_attention_runs_without_queries():
    inp = make_inp(queries=False)
    sc = ExpectedAttentionScorer()
    assert sc.statistics(inp)[2] == "keys"
    s = sc.score(inp)
    assert s.shape == (2, inp.region_len) and torch.all(torch.isfinite(s)) and torch.all(s >= 0)
    inp2 = make_inp()
    assert sc.statistics(inp2)[2] == "queries"


def test_moment_scorer_hand_case():
    """Identical tokens are represented exactly by the moments (residual 0); the outlier is kept."""
    h, t, d = 1, 16, 4
    keys = torch.ones(h, t, d)
    values = torch.ones(h, t, d)
    keys[0, 5] = torch.tensor([3.0, -1.0, 0.0, 2.0])
    values[0, 5] = torch.tensor([-2.0, 4.0, 1.0, 0.0])
    inp = LayerInputs(keys=keys, values=values, region_len=t, page_size=1, layer_idx=0, num_layers=1,
                      scale=0.5)
    sc = MomentScorer(weight=ConstScorer(torch.ones(h, t)), iterate=False)
    s = sc.score(inp)
    assert int(s.argmax()) == 5
    mom = accumulate(keys, values, torch.ones(h, t, dtype=torch.bool))
    torch.testing.assert_close(s, residual_norms(keys, values, mom, 0.5))


def test_moment_scorer_second_pass_uses_evicted_moments():
    inp = make_inp(h=2, hq=2, t=64, d=4, bs=8)
    w = torch.rand(2, inp.region_len, generator=torch.Generator().manual_seed(1))
    inp.budget_pages = 4  # 2 pages = 16 tokens kept per head
    s1 = MomentScorer(weight=ConstScorer(w), iterate=False).score(inp)
    s2 = MomentScorer(weight=ConstScorer(w), iterate=True).score(inp)
    evicted = torch.ones(2, inp.region_len, dtype=torch.bool)
    for hh in range(2):
        evicted[hh, topk_indices(s1[hh], 16)] = False
    k, v = inp.keys[:, : inp.region_len], inp.values[:, : inp.region_len]
    torch.testing.assert_close(s2, w * residual_norms(k, v, accumulate(k, v, evicted), inp.scale))
    assert MomentScorer().needs_queries and not MomentScorer(weight=KeyNormScorer()).needs_queries


# --------------------------------------------------------------------------------------- allocators
def _check_alloc(pages, total, floor, h, rp):
    assert pages.dtype == torch.int64 and pages.shape == (h,)
    assert int(pages.sum()) == min(max(total, floor * h), rp * h)
    assert int(pages.min()) >= min(floor, rp) and int(pages.max()) <= rp


@pytest.mark.parametrize("alloc", [UniformAllocator(), AdaKVAllocator(), ContourAllocator(),
                                   ContourAllocator(mix=0.5, power=0.5), PyramidAllocator()])
def test_allocators_sum_and_bounds(alloc):
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        h, rp, bs = 4, 10, 4
        inp = make_inp(h=h, hq=h, t=rp * bs + 3, bs=bs, seed=trial)
        scores = torch.rand(h, rp * bs, generator=g) ** 4
        if trial % 3 == 0:
            scores = -scores  # signed scores (key norm style)
        floor = trial % 3
        for total in (0, 5, 17, 23, 40, 55):
            forced = torch.zeros(rp * bs, dtype=torch.bool)
            forced[: floor * bs] = True
            pages = alloc.allocate(scores, inp, LayerBudget(total, floor, forced))
            _check_alloc(pages, total, floor, h, rp)


def test_pyramid_schedule_averages_to_base():
    for base, layers, beta in [(24, 30, 20.0), (7, 5, 2.0), (100, 32, 5.0), (3, 12, 20.0), (16, 1, 20.0)]:
        s = pyramid_schedule(base, layers, beta)
        assert int(s.sum()) == base * layers
        assert torch.all(s[:-1] >= s[1:])  # lower layers get more
    assert torch.all(pyramid_schedule(24, 8, 1.0) == 24)
    s = pyramid_schedule(100, 11, 4.0)
    assert int(s[0]) == 175 and int(s[-1]) == 25  # 2 - 1/beta and 1/beta of the base
    # bounded by the heads' floors and the region's capacity, the mean stays at the base
    for base, layers, lo, hi in [(12, 6, 4, 50), (12, 6, 4, 14), (30, 10, 8, 40), (5, 7, 5, 9)]:
        s = pyramid_schedule(base, layers, 20.0, lo, hi)
        assert int(s.sum()) == base * layers and int(s.min()) >= lo and int(s.max()) <= hi
        assert torch.all(s[:-1] >= s[1:])
    assert pyramid_schedule(3, 6, 20.0, 4, 50).tolist() == [4] * 6  # infeasible: the floor wins


def test_pyramid_policy_layer_totals():
    pol = build_policy("pyramidkv", sink_tokens=4, recent_window=8)
    base, layers = 12, 6
    totals = []
    for layer in range(layers):
        inp = make_inp(h=2, hq=4, t=200, bs=8, layer_idx=layer, num_layers=layers, seed=layer)
        sel = pol.plan_layer(inp, base)
        totals.append(sum(sel.counts()) // 8)
        assert totals[-1] == pol.layer_total_pages(base, inp)
    # the largest (bottom) layer gets the layer budget (a block holds every layer, so the bytes held are
    # set by the largest layer); the others less, the top ones lifted to the heads' floors
    assert totals[0] == base
    assert totals[0] > totals[-1] and all(a >= b for a, b in zip(totals, totals[1:]))
    assert min(totals) == pol.floor_pages(inp) * 2


def test_contour_gives_flat_head_more_pages_than_peaked_head():
    h, rp, bs = 2, 16, 4
    inp = make_inp(h=h, hq=h, t=rp * bs, bs=bs)
    peaked = torch.full((rp * bs,), 1e-4)
    peaked[[3, 10, 20, 30, 41, 50]] = 1.0
    flat = torch.ones(rp * bs)
    scores = torch.stack([peaked, flat])
    pages = ContourAllocator().allocate(scores, inp, LayerBudget(16, 1))
    assert int(pages[1]) > int(pages[0])
    assert int(pages[0]) >= 2  # the peaked head still keeps the 2 pages that hold its 6 peaks
    assert float(dropped_mass(scores, pages, inp)[0]) < 0.01
    # and the same from the dropped-mass point of view: at the uniform budget the flat head drops more
    m = dropped_mass(scores, torch.tensor([8, 8]), inp)
    assert m[1] > m[0]
    # the whole policy on window scores: flat vs peaked attention
    assert dropped_mass(scores, pages, inp).sum() < m.sum()


def test_contour_greedy_is_optimal_bruteforce():
    g = torch.Generator().manual_seed(7)
    h, rp, bs, floor = 3, 6, 2, 1
    inp = make_inp(h=h, hq=h, t=rp * bs, bs=bs)
    forced = torch.zeros(rp * bs, dtype=torch.bool)
    forced[0] = True
    for trial in range(10):
        scores = torch.rand(h, rp * bs, generator=g) ** 3
        mass = score_mass(scores)
        curve = mass_curve(mass, forced, bs)
        for total in (4, 8, 12):
            pages = ContourAllocator().allocate(scores, inp, LayerBudget(total, floor, forced))
            got = float(sum(curve[i, int(pages[i])] for i in range(h)))
            best = max(float(sum(curve[i, c[i]] for i in range(h)))
                       for c in itertools.product(range(floor, rp + 1), repeat=h) if sum(c) == total)
            assert got == pytest.approx(best, abs=1e-12)


def test_contour_ignores_mass_held_by_forced_tokens():
    """A head whose mass sits in the forced tokens needs no pages beyond the floor."""
    h, rp, bs = 2, 8, 4
    inp = make_inp(h=h, hq=h, t=rp * bs, bs=bs)
    s = torch.full((h, rp * bs), 1e-6)
    s[0, :4] = 1.0  # head 0: all mass in the sinks
    s[1] = torch.rand(rp * bs, generator=torch.Generator().manual_seed(0))
    forced = torch.zeros(rp * bs, dtype=torch.bool)
    forced[:4] = True
    pages = ContourAllocator().allocate(s, inp, LayerBudget(8, 1, forced))
    assert pages.tolist() == [1, 7]
    # AdaKV counts the sink mass and keeps giving head 0 pages
    assert int(AdaKVAllocator().allocate(s, inp, LayerBudget(8, 1, forced))[0]) > 1


def test_contour_mix():
    h, rp, bs = 4, 12, 4
    inp = make_inp(h=h, hq=h, t=rp * bs, bs=bs)
    s = torch.rand(h, rp * bs, generator=torch.Generator().manual_seed(2)) ** torch.tensor([[1.0], [4.0], [8.0], [16.0]])
    b = LayerBudget(20, 1)
    uni = UniformAllocator().allocate(s, inp, b)
    full = ContourAllocator().allocate(s, inp, b)
    half = ContourAllocator(mix=0.5).allocate(s, inp, b)
    assert torch.equal(ContourAllocator(mix=0.0).allocate(s, inp, b), uni)
    assert not torch.equal(full, uni)
    assert torch.all((half - uni).abs() <= (full - uni).abs() + 1)
    with pytest.raises(ValueError):
        ContourAllocator(mix=1.5)


def test_score_mass_handles_signed_and_degenerate_scores():
    m = score_mass(torch.tensor([[-3.0, -1.0, -2.0], [0.0, 0.0, 0.0], [1.0, float("nan"), 3.0]]))
    torch.testing.assert_close(m.sum(1), torch.ones(3, dtype=torch.float64))
    assert m[0].tolist() == [0.0, pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert m[1].tolist() == [pytest.approx(1 / 3)] * 3
    assert m[2].tolist() == [pytest.approx(0.2), pytest.approx(0.2), pytest.approx(0.6)]


# ---------------------------------------------------------------------------------------- selectors
def test_topk_ties_go_to_lower_index():
    s = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert topk_indices(s, 2).tolist() == [1, 2]
    assert topk_indices(s, 9).tolist() == [0, 1, 2, 3, 4]


def test_diversity_lambda_zero_is_topk_bit_identical():
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        inp = make_inp(h=3, hq=3, t=64, bs=4, seed=trial)
        scores = torch.randint(0, 4, (3, 64), generator=g).to(torch.float32)  # many ties
        scores[:, :3] = float("inf")
        scores[1, 10] = float("-inf")
        pages = torch.tensor([2, 5, 16])
        a = DiversitySelector(lam=0.0).select(scores, pages, inp)
        b = TopKSelector().select(scores, pages, inp)
        for x, y in zip(a, b):
            assert torch.equal(x, y) and x.dtype == y.dtype
    # and through whole policies
    for seed in range(3):
        inp = make_inp(h=2, hq=4, t=120, bs=8, seed=seed)
        p0 = build_policy("contour")
        p1 = build_policy("contour_diverse")
        p1.selector = DiversitySelector(lam=0.0)
        for x, y in zip(p0.plan_layer(inp, 6).kept, p1.plan_layer(inp, 6).kept):
            assert torch.equal(x, y)


def test_diversity_skips_duplicates():
    # token 0 and 1 have identical values (signature), token 2 is orthogonal with a slightly lower score
    values = torch.zeros(2, 4, 2)
    values[:, 0] = torch.tensor([1.0, 0.0])
    values[:, 1] = torch.tensor([1.0, 0.0])
    values[:, 2] = torch.tensor([0.0, 1.0])
    values[:, 3] = torch.tensor([-1.0, 0.2])
    inp = LayerInputs(keys=torch.randn(2, 4, 2), values=values, region_len=4, page_size=1, layer_idx=0,
                      num_layers=1, scale=1.0)
    scores = torch.tensor([[1.0, 0.95, 0.9, 0.0], [5.0, 4.5, 4.0, 0.0]])  # scale-free: same picks per head
    pages = torch.tensor([2, 2])
    assert [k.tolist() for k in TopKSelector().select(scores, pages, inp)] == [[0, 1], [0, 1]]
    assert [k.tolist() for k in DiversitySelector(lam=0.5).select(scores, pages, inp)] == [[0, 2], [0, 2]]
    # forced tokens come first, whatever their similarity
    forced = scores.clone()
    forced[:, 1] = float("inf")
    got = DiversitySelector(lam=0.5).select(forced, torch.tensor([1, 3]), inp)
    assert got[0].tolist() == [1] and got[1].tolist() == [0, 1, 2]


def _mmr_reference(scores, k, sig, lam):
    """The greedy by its definition, one head: forced first, then argmax of norm - lam * max cos."""
    norm = normalise_scores(scores.unsqueeze(0))[0]
    forced = torch.isposinf(norm)
    if k <= int(forced.sum()) or k >= scores.numel():
        return topk_indices(scores, k).tolist()
    kept = torch.nonzero(forced).squeeze(1).tolist()
    while len(kept) < k:
        best, best_j = None, None
        for j in range(scores.numel()):
            if j in kept:
                continue
            pen = max((float(sig[j] @ sig[i]) for i in kept), default=0.0)
            o = float(norm[j]) - lam * pen
            if best is None or o > best + 1e-6:  # strictly better beyond rounding: ties keep the lower index
                best, best_j = o, j
        kept.append(best_j)
    return sorted(kept)


def test_diversity_greedy_matches_its_definition(monkeypatch):
    """The vectorised greedy (objective lowered by a row minimum per pick, similarities precomputed or per
    pick) keeps exactly the tokens the definition picks, with ties, duplicate values, -inf scores and heads
    that need no greedy step."""
    g = torch.Generator().manual_seed(3)
    for trial in range(12):
        h, bs, p, d = 3, 2, 6, 4
        r = p * bs
        values = torch.randint(-1, 2, (h, r, d), generator=g).float()  # duplicate signatures
        scores = torch.randint(0, 4, (h, r), generator=g).float() if trial % 2 else torch.randn(h, r, generator=g)
        scores[:, 0] = float("inf")
        scores[1, 5] = float("-inf")
        inp = LayerInputs(keys=torch.randn(h, r, d, generator=g), values=values, region_len=r, page_size=bs,
                          layer_idx=0, num_layers=1, scale=1.0)
        pages = torch.tensor([0, 3, trial % p + 1])
        sig = F.normalize(values.mean(0), dim=-1)
        for lam in (0.5, 1.0):
            want = [_mmr_reference(scores[i], int(pages[i]) * bs, sig, lam) for i in range(h)]
            for limit in (diversity.SIM_LIMIT, 0):
                monkeypatch.setattr(diversity, "SIM_LIMIT", limit)
                got = DiversitySelector(lam=lam).select(scores, pages, inp)
                assert [x.tolist() for x in got] == want, (trial, lam, limit)


def test_normalise_scores():
    n = normalise_scores(torch.tensor([[-4.0, -2.0, float("inf"), float("-inf")], [1.0, 1.0, 1.0, 1.0]]))
    assert n[0].tolist() == [0.0, 1.0, float("inf"), -1.0]
    assert n[1].tolist() == [0.0] * 4


def _output_error(inp, kept, r):
    attn = window_attention(inp)
    err = 0.0
    for h in range(inp.num_kv_heads):
        a = attn[2 * h:2 * h + 2].reshape(-1, attn.shape[-1])
        v = inp.values[h]
        keep = torch.zeros(a.shape[1], dtype=torch.bool)
        keep[r:] = True
        keep[kept[h]] = True
        o = a @ v
        ok = (a[:, keep] @ v[keep]) / a[:, keep].sum(1, keepdim=True)
        err += float((o - ok).norm(dim=-1).sum())
    return err


def test_balancing_reduces_output_error_and_keeps_forced():
    inp = make_inp(h=2, hq=4, t=72, bs=4, w=8, seed=5)
    pol = Policy("bal", H2OScorer(), UniformAllocator(), BalancingSelector(max_swaps=20, pool=8),
                 sink_tokens=2, recent_window=4)
    base = Policy("top", H2OScorer(), UniformAllocator(), TopKSelector(), sink_tokens=2, recent_window=4)
    assert pol.needs_queries
    sb = pol.plan_layer(inp, 8)
    st = base.plan_layer(inp, 8)
    r = inp.region_len
    assert _output_error(inp, sb.kept, r) <= _output_error(inp, st.kept, r) + 1e-5
    forced = pol.forced_mask(inp)[0]  # every head has the same candidates here
    for k in sb.kept:
        assert set(torch.nonzero(forced).squeeze(1).tolist()) <= set(k.tolist())
    # without queries it is top-k
    inp.queries = None
    scores = torch.rand(2, r)
    assert all(torch.equal(a, b) for a, b in zip(BalancingSelector().select(scores, torch.tensor([2, 3]), inp),
                                                 TopKSelector().select(scores, torch.tensor([2, 3]), inp)))


# ------------------------------------------------------------------------------------------ presets
def test_presets_have_one_line_help():
    helps = policy_help()
    for name in ["snapkv", "pyramidkv", "adakv", "h2o", "tova", "streaming", "knorm", "keydiff",
                 "expected_attention", "contour", "contour_knorm", "contour_diverse", "moment"]:
        assert name in helps and helps[name] and "\n" not in helps[name]
    with pytest.raises(ValueError, match="unknown eviction policy"):
        build_policy("nope")
    assert set(QUERY_FREE) >= {"streaming", "knorm", "keydiff", "expected_attention"}


def _check_selection(pol, inp, sel, total):
    bs, rp = inp.page_size, inp.num_region_pages
    forced = torch.nonzero(pol.forced_mask(inp)[0]).squeeze(1)
    floor = pol.floor_pages(inp)
    counts = sel.counts()
    assert len(counts) == inp.num_kv_heads
    for k in sel.kept:
        assert k.dtype == torch.int64
        assert k.numel() % bs == 0 and k.numel() // bs >= floor
        assert torch.all(k[1:] > k[:-1]) and (k.numel() == 0 or (int(k[0]) >= 0 and int(k[-1]) < inp.region_len))
        assert torch.isin(forced, k).all()
    want = min(max(pol.layer_total_pages(total, inp), floor * inp.num_kv_heads), rp * inp.num_kv_heads)
    assert sum(counts) == want * bs


@pytest.mark.parametrize("name", ALL)
def test_preset_invariants(name):
    pol = build_policy(name, sink_tokens=4, recent_window=12)
    for seed, (t, bs, total, window_end) in enumerate([(150, 8, 10, None), (97, 4, 30, None),
                                                        (130, 8, 7, 112), (64, 16, 2, None)]):
        inp = make_inp(h=2, hq=4, t=t, bs=bs, window_end=window_end, seed=seed, layer_idx=seed % 4)
        sel = pol.plan_layer(inp, total)
        _check_selection(pol, inp, sel, total)
        # a budget at least the region keeps everything
        sel = pol.plan_layer(inp, 1000)
        for k in sel.kept:
            assert torch.equal(k, torch.arange(inp.region_len))


@pytest.mark.parametrize("name", ALL)
def test_preset_queries_required_or_optional(name):
    pol = build_policy(name, sink_tokens=4, recent_window=12)
    inp = make_inp(h=2, hq=4, t=150, bs=8, queries=False)
    if pol.needs_queries:
        with pytest.raises(ValueError, match="queries"):
            pol.plan_layer(inp, 10)
    else:
        _check_selection(pol, inp, pol.plan_layer(inp, 10), 10)
    # without explicit query positions the window is the last W context tokens
    inp = make_inp(h=2, hq=4, t=150, bs=8, positions=False)
    _check_selection(pol, inp, pol.plan_layer(inp, 10), 10)


@pytest.mark.parametrize("name", ALL)
def test_preset_ignores_question_tokens(name):
    """Query-agnostic mode: keys, values and queries of the question (positions >= window_end) must not
    change the kept set."""
    pol = build_policy(name, sink_tokens=4, recent_window=12)
    t, we = 160, 120
    base = make_inp(h=2, hq=4, t=t, bs=8, window_end=we, w=6, seed=11)
    sel = pol.plan_layer(base, 9)
    g = torch.Generator().manual_seed(99)
    k2, v2 = base.keys.clone(), base.values.clone()
    k2[:, we:] = torch.randn(2, t - we, 8, generator=g) * 5
    v2[:, we:] = torch.randn(2, t - we, 8, generator=g) * 5
    q_question = torch.randn(4, 5, 8, generator=g) * 3
    alt = LayerInputs(keys=k2, values=v2, region_len=base.region_len, page_size=8, layer_idx=0, num_layers=4,
                      scale=base.scale, queries=torch.cat([base.queries, q_question], dim=1),
                      query_positions=torch.cat([base.query_positions, torch.arange(we, we + 5)]),
                      window_end=we, reconstruction=base.reconstruction)
    sel2 = pol.plan_layer(alt, 9)
    for a, b in zip(sel.kept, sel2.kept):
        assert torch.equal(a, b)
    if not pol.needs_queries:  # query-free: the same holds without any captured queries
        plain = [dataclasses.replace(x, queries=None, query_positions=None) for x in (base, alt)]
        a, b = pol.plan_layer(plain[0], 9), pol.plan_layer(plain[1], 9)
        assert all(torch.equal(x, y) for x, y in zip(a.kept, b.kept))


def test_snapkv_is_uniform_and_adakv_is_adaptive_on_the_same_scores():
    """snapkv = SnapKV window scores with the same budget in every head (kvpress's SnapKVPress); adakv = the
    same scores with AdaKV head budgets: the heads' pages follow where the flattened normalised scores
    are highest (here the peaked head's peaks win pages)."""
    inp = make_inp(h=2, hq=2, t=200, bs=8, w=8, seed=1)
    # head 0: window queries point at 3 tokens (peaked); head 1: tiny queries (flat attention)
    inp.queries[0] = inp.keys[0, [20, 60, 100]].repeat(3, 1)[:8] * 6
    inp.queries[1] *= 0.01
    a = build_policy("snapkv").plan_layer(inp, 12)
    b = build_policy("adakv").plan_layer(inp, 12)
    assert a.counts() == [48, 48]
    assert b.counts()[0] > b.counts()[1] and sum(b.counts()) == 96
    assert build_policy("snapkv").name == "snapkv" and build_policy("adakv").name == "adakv"


def test_knobs_reach_the_components_and_bad_ones_name_the_knob():
    from vllm_contour.policies import policy_knobs

    pol = build_policy("contour_diverse", {"lam": 0.25, "allocator.mix": 0.5, "kernel_size": 3})
    assert pol.selector.lam == 0.25 and pol.allocator.mix == 0.5 and pol.scorer.kernel_size == 3
    assert set(policy_knobs("contour_diverse")) == {"scorer.kernel_size", "allocator.mix", "allocator.power",
                                                    "selector.lam"}
    assert build_policy("contour_knorm", {"alloc_scorer.kernel_size": 5}).alloc_scorer.kernel_size == 5
    assert build_policy("pyramidkv", {"beta": 4}).allocator.beta == 4.0
    with pytest.raises(ValueError, match="has no knob 'lamda'.*selector.lam"):
        build_policy("contour_diverse", {"lamda": 0.3})
    with pytest.raises(ValueError, match="allocator.mix"):
        build_policy("contour", {"mix": 1.5})
    with pytest.raises(ValueError, match="selector.lam: diversity lam must be >= 0"):
        build_policy("contour_diverse", {"lam": -0.5})
    with pytest.raises(ValueError, match="scorer.kernel_size: expected int"):
        build_policy("snapkv", {"kernel_size": "wide"})
    with pytest.raises(ValueError, match="has no knob 'lam'"):
        build_policy("snapkv", {"lam": 0.5})  # snapkv has no diversity selector


def _readme_policy_rows() -> dict[str, dict[str, str]]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text.split("<!-- policies -->")[1].split("<!-- /policies -->")[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = {"paper": cells[1], "scorer": cells[2], "allocator": cells[3],
                                     "selector": cells[4], "moments": cells[5], "cost": cells[6]}
    return rows


def test_readme_policy_table_names_each_presets_components():
    """Table-driven: every preset's scorer / allocator / selector (and ranking vs allocation scorer, and
    whether moment correction is part of the method) are what its README row says."""
    from vllm_contour.policies import PRESETS

    rows = _readme_policy_rows()
    assert set(rows) == set(PRESETS)
    for name, p in PRESETS.items():
        row = rows[name]
        scorer = p.scorer.__name__ if p.alloc_scorer is None else f"{p.scorer.__name__} (alloc: {p.alloc_scorer.__name__})"
        assert row["scorer"] == scorer, name
        assert row["allocator"] == p.allocator.__name__ and row["selector"] == p.selector.__name__, name
        assert row["moments"] == ("on" if p.moment_correction else "off"), name
        pol = build_policy(name)
        assert type(pol.scorer) is p.scorer and type(pol.allocator) is p.allocator
        assert type(pol.selector) is p.selector


def test_moment_preset_defaults_to_the_corrected_inference():
    from vllm_contour.config import EvictionConfig, resolve_request

    cfg = EvictionConfig.from_dict({"policy": "moment"})
    assert resolve_request(cfg, None).moment_correction is True
    assert resolve_request(cfg, {"kv_moment_correction": False}).moment_correction is False
    assert resolve_request(cfg, {"kv_policy": "snapkv"}).moment_correction is False
    assert resolve_request(EvictionConfig.from_dict({"policy": "snapkv"}), {"kv_policy": "moment"}).moment_correction
    assert resolve_request(EvictionConfig.from_dict({"policy": "snapkv", "moment_correction": True}),
                           None).moment_correction


def test_contour_policy_flat_vs_peaked_heads():
    inp = make_inp(h=2, hq=2, t=200, bs=8, w=8, seed=1)
    inp.queries[0] = inp.keys[0, [20, 60, 100]].repeat(3, 1)[:8] * 20
    inp.queries[1] *= 0.01
    c = build_policy("contour", sink_tokens=4, recent_window=8).plan_layer(inp, 12).counts()
    assert c[1] > c[0]


def test_streaming_keeps_sinks_and_most_recent():
    pol = build_policy("streaming", sink_tokens=4, recent_window=8)
    inp = make_inp(h=2, hq=2, t=100, bs=4, queries=False)
    sel = pol.plan_layer(inp, 6)  # 3 pages per head = 12 tokens: 4 sinks + recent region tokens
    r = inp.region_len
    assert sel.kept[0].tolist() == [0, 1, 2, 3] + list(range(r - 8, r))


def test_knorm_scorer_and_recency_unchanged():
    inp = make_inp(t=40, bs=8)
    torch.testing.assert_close(KeyNormScorer().score(inp), -inp.keys[:, :40].norm(dim=-1))
    assert RecencyScorer().score(inp)[1].tolist() == list(range(40))


def test_layer_with_no_full_page():
    pol = build_policy("contour")
    inp = make_inp(t=5, bs=8, w=3)
    assert inp.region_len == 0
    assert pol.plan_layer(inp, 4).counts() == [0, 0]


def test_gqa_mismatch_is_reported():
    inp = make_inp(h=2, hq=3)
    with pytest.raises(ValueError, match="grouped"):
        H2OScorer().score(inp)


def test_budget_hint_passed_to_scorer():
    seen = {}

    class Spy(Scorer):
        def score(self, inp):
            seen["budget"] = inp.head_budget_pages()
            return torch.zeros(inp.num_kv_heads, inp.region_len)

    pol = Policy("spy", Spy(), PyramidAllocator(beta=3.0), TopKSelector(), sink_tokens=0, recent_window=0)
    inp = make_inp(h=2, hq=2, t=160, bs=8, layer_idx=0, num_layers=4, queries=False)
    pol.plan_layer(inp, 10)
    # layer 0 is the largest: it gets the whole layer budget, 10 pages = 5 per head
    assert seen["budget"].tolist() == [5, 5]
    assert math.isclose(float(pyramid_schedule(10, 4, 3.0).float().mean()), 10.0)


# ----------------------------------------------------------------------------------------- interfaces
class _Duck:
    """Has every method a component has, and subclasses no interface."""

    needs_queries = needs_values = False

    def score(self, inp):
        return torch.zeros(inp.num_kv_heads, inp.region_len)

    def allocate(self, scores, inp, budget):
        return UniformAllocator().allocate(scores, inp, budget)

    def select(self, scores, pages, inp):
        return TopKSelector().select(scores, pages, inp)


@pytest.mark.parametrize("role", ["scorer", "allocator", "selector", "alloc_scorer"])
def test_a_component_that_does_not_subclass_its_interface_is_refused_when_the_policy_is_built(role):
    """Capabilities are declared on the interfaces (``base.Scorer`` / ``Allocator`` / ``Selector``), never
    probed: a component that only looks like one (the right methods, no interface) is refused by name."""
    parts = {"scorer": SnapKVScorer(), "allocator": UniformAllocator(), "selector": TopKSelector(),
             "alloc_scorer": None}
    Policy("ok", parts["scorer"], parts["allocator"], parts["selector"], alloc_scorer=parts["alloc_scorer"])
    parts[role] = _Duck()
    kind = {"alloc_scorer": "Scorer"}.get(role, role.capitalize())
    with pytest.raises(TypeError, match=rf"policy 'duck': {role} _Duck does not subclass .*base\.{kind}\b"):
        Policy("duck", parts["scorer"], parts["allocator"], parts["selector"], alloc_scorer=parts["alloc_scorer"])


def test_components_inside_components_are_refused_too():
    with pytest.raises(TypeError, match="moment weight _Duck"):
        MomentScorer(weight=_Duck())
    with pytest.raises(TypeError, match="pyramid inner _Duck"):
        PyramidAllocator(inner=_Duck())


def test_every_preset_component_subclasses_its_interface():
    for name in policy_names():
        pol = build_policy(name)
        assert isinstance(pol.scorer, Scorer) and isinstance(pol.allocator, Allocator)
        assert isinstance(pol.selector, Selector)
        assert pol.alloc_scorer is None or isinstance(pol.alloc_scorer, Scorer)


def test_a_policy_reads_the_capabilities_its_components_declare():
    """Each capability comes from the components' declarations: the interface's default, a subclass's class
    attribute, or a property that follows a knob or a component held inside."""

    class Recon(Scorer):
        needs_reconstruction = True

        def score(self, inp):
            return torch.zeros(inp.num_kv_heads, inp.region_len)

    class Asks(UniformAllocator):
        needs_queries = True
        needs_values = True

    plain = Policy("p", KeyNormScorer(), UniformAllocator(), TopKSelector())
    assert (plain.needs_queries, plain.needs_values, plain.needs_reconstruction, plain.accumulates) == (False,) * 4
    assert Policy("a", KeyNormScorer(), Asks(), TopKSelector()).needs_queries
    assert Policy("a", KeyNormScorer(), PyramidAllocator(inner=Asks()), TopKSelector()).needs_values
    assert Policy("r", KeyNormScorer(), UniformAllocator(), TopKSelector(), alloc_scorer=Recon()).needs_reconstruction
    assert Policy("m", MomentScorer(weight=Recon()), UniformAllocator(), TopKSelector()).needs_reconstruction
    assert Policy("h", H2OScorer(), UniformAllocator(), TopKSelector()).accumulates
    assert not Policy("h", KeyNormScorer(), UniformAllocator(), TopKSelector(), alloc_scorer=H2OScorer()).accumulates
    assert not Policy("d", KeyNormScorer(), UniformAllocator(), DiversitySelector(lam=0.0)).needs_values


def test_every_layer_schedule_is_told_its_floor_and_cap():
    """One signature for every schedule: the planner passes each layer's index, the heads' floors and the most
    the layer may hold, always; an allocator without a schedule keeps the base."""
    seen = []

    class Schedule(UniformAllocator):
        def layer_total_pages(self, base_total, layer_idx, num_layers, min_total, max_total):
            seen.append((base_total, layer_idx, num_layers, min_total, max_total))
            return max(min_total, base_total - layer_idx)

    inp = make_inp(h=2, hq=4, t=48, bs=8, layer_idx=1, num_layers=4)  # 6 candidate pages per head
    rows = dataclasses.replace(inp, keys=inp.keys.repeat(2, 1, 1), values=inp.values.repeat(2, 1, 1),
                               queries=inp.queries.repeat(2, 1, 1), reconstruction=None)
    pol = Policy("s", KeyNormScorer(), Schedule(), TopKSelector(), sink_tokens=2, recent_window=6)
    sel = pol.plan_rows(rows, [9, 20], 2)
    assert seen == [(9, 1, 4, 2, 9), (20, 2, 4, 2, 12)]
    assert [sum(s.counts()) // 8 for s in sel] == [8, 12]
    assert Allocator.layer_total_pages(UniformAllocator(), 9, 1, 4, 2, 9) == 9


def test_candidates_only_needs_its_group_split():
    with pytest.raises(TypeError, match="Lazy declares candidates_only but defines no allocate_groups"):
        class Lazy(Allocator):
            candidates_only = True

            def allocate(self, scores, inp, budget):
                return torch.zeros(inp.num_kv_heads, dtype=torch.int64)


# ----------------------------------------------------------------------------------------- decode-time rounds
def _split_heads(inp: LayerInputs) -> list[LayerInputs]:
    """The same layer as one-KV-head inputs (what a decode-time round hands ``plan_layer_ragged``)."""
    h = inp.num_kv_heads
    g = inp.queries.shape[0] // h if inp.queries is not None else 0
    return [dataclasses.replace(inp, keys=inp.keys[i:i + 1], values=inp.values[i:i + 1],
                                queries=None if inp.queries is None else inp.queries[i * g:(i + 1) * g],
                                positions=torch.arange(inp.num_tokens),
                                reconstruction=None if inp.reconstruction is None else inp.reconstruction[i:i + 1])
            for i in range(h)]


@pytest.mark.parametrize("name", RAGGED)
def test_ragged_planning_equals_aligned_when_heads_share_candidates(name):
    """Scorers work per KV head, so scoring each head on its own (a round's path) and padding the rows
    gives exactly the kept sets of the whole-layer path when every head has the same candidates."""
    pol = build_policy(name, sink_tokens=4, recent_window=8)
    for seed, total in ((0, 9), (1, 14), (2, 5)):
        inp = make_inp(h=3, hq=6, t=100, bs=8, seed=seed, layer_idx=1)
        a = pol.plan_layer(inp, total)
        b = pol.plan_layer_ragged(_split_heads(inp), total)
        if name == "contour_diverse":  # per-head value signatures in a round (mean over heads otherwise)
            assert b.counts() == a.counts()
            continue
        assert [k.tolist() for k in a.kept] == [k.tolist() for k in b.kept], (name, seed)


@pytest.mark.parametrize("name", RAGGED)
def test_ragged_rounds_respect_caps_forced_tokens_and_positions(name):
    """Heads with different candidates (own kept run + a shared tail, original positions): pages never pass
    a head's candidates, padding is never kept, the sinks and the most recent positions always are, and
    the layer keeps exactly its budget."""
    pol = build_policy(name, sink_tokens=2, recent_window=8)
    g = torch.Generator().manual_seed(5)
    bs, d, tail = 8, 8, 16
    runs = [3, 5, 1]  # kept pages per head from the previous round
    heads = []
    for hh, p in enumerate(runs):
        kept = torch.sort(torch.cat([torch.arange(2), 2 + torch.randperm(198, generator=g)[: p * bs - 2]])).values
        pos = torch.cat([kept, torch.arange(200, 200 + tail)])
        heads.append(LayerInputs(keys=torch.randn(1, pos.numel(), d, generator=g),
                                 values=torch.randn(1, pos.numel(), d, generator=g), region_len=pos.numel(),
                                 page_size=bs, layer_idx=0, num_layers=2, scale=d ** -0.5,
                                 queries=torch.randn(2, 4, d, generator=g),
                                 query_positions=torch.arange(212, 216), positions=pos,
                                 reconstruction=torch.rand(1, pos.numel())))
    total = 9
    sel = pol.plan_layer_ragged(heads, total)
    assert sum(sel.counts()) == total * bs
    for x, k in zip(heads, sel.kept):
        assert k.numel() <= x.region_len and int(k.max()) < x.region_len
        kept_pos = x.positions[k]
        assert {0, 1} <= set(kept_pos.tolist())
        assert set(range(208, 216)) <= set(kept_pos.tolist())


@pytest.mark.parametrize("name", policy_names())
def test_a_policy_that_declares_no_use_of_values_selects_the_same_without_them(name):
    """The evictor gathers values only for policies with a component that declares ``needs_values``: every
    other preset keeps the same tokens from an input whose values are empty; those that declare it fail."""
    g = torch.Generator().manual_seed(0)
    h, layers, n, d, bs = 2, 2, 160, 16, 16
    inp = LayerInputs(keys=torch.randn(layers * h, n, d, generator=g), values=torch.randn(layers * h, n, d, generator=g),
                      region_len=n - n % bs, page_size=bs, layer_idx=0, num_layers=layers, scale=d ** -0.5,
                      queries=torch.randn(layers * 2 * h, 8, d, generator=g), query_positions=torch.arange(n - 8, n),
                      reconstruction=torch.rand(layers * h, n, generator=g))
    pol = build_policy(name, sink_tokens=2, recent_window=8)
    full = pol.plan_rows(inp, [4 * h] * layers, h)
    blind = dataclasses.replace(inp, values=inp.values[:, :0])
    if pol.needs_values:
        with pytest.raises(Exception):
            pol.plan_rows(blind, [4 * h] * layers, h)
        return
    assert [k.tolist() for s in pol.plan_rows(blind, [4 * h] * layers, h) for k in s.kept] == \
        [k.tolist() for s in full for k in s.kept]


@pytest.mark.parametrize("name", ["adakv", "contour", "snapkv", "pyramidkv"])
def test_several_layers_at_once_equal_each_layer_alone(name):
    """``plan_rows`` takes every layer's floor, allocation and selection at once; each layer gives what it gives
    planned alone. The layers differ in their heads' candidates (a decode-time round's kept runs), so their
    floors differ (layer 0's heads hold one page, below the two the others' sinks and recent window need)."""
    g = torch.Generator().manual_seed(3)
    h, layers, bs, d, hq, w = 2, 3, 8, 8, 4, 6
    caps = torch.tensor([1, 1, 6, 2, 4, 5])  # candidate pages per row l * H + h
    width = int(caps.max()) * bs
    pos = torch.zeros(layers * h, width, dtype=torch.int64)
    for r, c in enumerate(caps.tolist()):  # the sinks, kept tokens, then up to 14 of the 16 recent ones
        n = c * bs
        recent = torch.arange(64 - min(14, n - 2), 64)
        mid = torch.sort(2 + torch.randperm(46, generator=g)[: n - 2 - recent.numel()]).values
        pos[r, :n] = torch.cat([torch.tensor([0, 1]), mid, recent])
    valid = torch.arange(width).view(1, -1) < (caps * bs).view(-1, 1)
    inp = LayerInputs(keys=torch.randn(layers * h, width, d, generator=g),
                      values=torch.randn(layers * h, width, d, generator=g), region_len=width, page_size=bs,
                      layer_idx=0, num_layers=layers, scale=d ** -0.5,
                      queries=torch.randn(layers * hq, w, d, generator=g), query_positions=torch.arange(58, 64),
                      positions=pos, head_pages=caps, valid=valid)
    pol = build_policy(name, sink_tokens=2, recent_window=12)  # 14 forced tokens: two pages where they fit
    totals = [2, 4, 4]
    together = [k.tolist() for s in pol.plan_rows(inp, totals, h) for k in s.kept]
    alone = []
    for layer in range(layers):
        rows = slice(layer * h, (layer + 1) * h)
        one = dataclasses.replace(inp, keys=inp.keys[rows], values=inp.values[rows], positions=pos[rows],
                                  head_pages=caps[rows], valid=valid[rows], layer_idx=layer,
                                  queries=inp.queries[layer * hq:(layer + 1) * hq])
        alone += [k.tolist() for k in pol.plan_rows(one, [totals[layer]], h)[0].kept]
    assert together == alone
