"""Round planning branches no other test reached (issue 46, item 2.5 and 2.7).

* KVzip's first round keeps, per layer and head, exactly what an oracle written from KVzip's rule says (the
  oracle below never calls the plugin's allocator or selector): one score threshold over the layer's raw
  ``[H * C]`` reconstruction scores decides how many of the budget's tokens each head gets (a page floor
  per head first, the rest of the layer's pages in proportion to each head's count above the threshold,
  rounded to whole pages by largest remainder), and each head keeps its sinks, its recent window and then
  its highest scores.
* Decode-time rounds of several requests in one step (``WorkerRounds.plan_all``) are planned together only
  when their eviction settings are equal: requests with other sinks or other policy knobs
  (``selector.lam``, ``scorer.kernel_size``) each get exactly the plan their round gets alone
  (``evictor.plan_round``).
"""

from __future__ import annotations

import math

import torch

from vllm_contour.budget import page_budget
from vllm_contour.config import EvictionConfig, resolve_request
from vllm_contour.evictor import RoundRequest, plan_round, plan_rounds

from .ops_cases import make_cache


def _budget(params, h, bs, d):
    return page_budget(params.budget, num_kv_heads=h, block_size=bs, head_dim=d, elem_size=4,
                       sink_tokens=params.sink_tokens, recent_window=params.recent_window,
                       moments=params.moment_correction)


# ----------------------------------------------------------------------------------------- KVzip's first round

def kvzip_oracle(scores: torch.Tensor, layer_pages: int, bs: int, sinks: int, recent: int) -> list[list[set]]:
    """KVzip's first-round selection of a prompt of ``C`` tokens (a whole number of pages, all candidates)
    from its scores ``[L, H, C]``: per layer, every head first gets the pages its sinks and recent window
    need; the layer's other ``(layer_pages - H * floor) * bs`` tokens go to the highest raw scores of the
    layer (one threshold across its heads, no per-head normalisation), each head's count of them becoming
    its extra pages (largest remainder, ties to the lower head); a head keeps its sinks, its recent window,
    then its highest-scored tokens up to its pages. -> kept positions per (layer, head)."""
    n_layers, h, c = scores.shape
    forced = set(range(min(sinks, c))) | set(range(max(0, c - recent), c))
    floor = max(1, math.ceil(len(forced) / bs))
    extra_pages = layer_pages - h * floor
    out = []
    for layer in range(n_layers):
        s = scores[layer].tolist()
        flat = sorted(((s[hh][j], hh, j) for hh in range(h) for j in range(c)), reverse=True)
        above = [0] * h
        for _, hh, _ in flat[: extra_pages * bs]:  # the layer's threshold: its extra tokens' worth of scores
            above[hh] += 1
        share = [extra_pages * a / sum(above) for a in above]
        pages = [math.floor(x) for x in share]
        for hh in sorted(range(h), key=lambda i: (-(share[i] - pages[i]), i))[: extra_pages - sum(pages)]:
            pages[hh] += 1
        kept_layer = []
        for hh in range(h):
            n_keep = (floor + pages[hh]) * bs
            assert n_keep <= c, "the oracle assumes no head reaches its cap (the whole prompt)"
            rest = sorted((j for j in range(c) if j not in forced), key=lambda j: -s[hh][j])
            kept_layer.append(forced | set(rest[: n_keep - len(forced)]))
        out.append(kept_layer)
    return out


def _kvzip_scores(seed: int, layers: int, h: int, c: int) -> torch.Tensor:
    """Random reconstruction scores with a different scale per (layer, head): KVzip's raw threshold then
    gives the heads very different shares (a per-head normalisation would not)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.stack([torch.randperm(h, generator=g).float() + 1.0 for _ in range(layers)])  # 1..H
    return torch.rand(layers, h, c, generator=g) * scales.unsqueeze(-1) ** 2


def test_kvzip_first_round_keeps_the_top_scored_tokens_of_an_independent_oracle():
    layers, h, bs, d, blocks = 2, 4, 8, 8, 16
    c = blocks * bs  # the prompt: whole pages, every token a candidate
    params = resolve_request(EvictionConfig(policy="kvzip", budget=6 * bs, sink_tokens=3, recent_window=6), None)
    assert not params.moment_correction
    pb = _budget(params, h, bs, d)
    assert pb.token_pages == 24 and pb.floor_pages == 2  # 3 sinks + 6 recent: two pages of 8 per head
    caches = [make_cache("cpu_rows", 2 * blocks + 2, h, bs, d, seed=s)[1:] for s in range(layers)]
    reqs = [RoundRequest(list(range(1, blocks + 1)), c, reconstruction=_kvzip_scores(1, layers, h, c)),
            RoundRequest(list(range(blocks + 1, 2 * blocks + 1)), c, reconstruction=_kvzip_scores(2, layers, h, c))]
    joint = plan_rounds(caches, reqs, params, pb, d ** -0.5)
    alone = plan_round(caches, reqs[1].block_ids, c, params, pb, d ** -0.5, reconstruction=reqs[1].reconstruction)
    assert torch.equal(alone.layout.positions, joint[1].layout.positions)
    for req, plan in zip(reqs, joint):
        want = kvzip_oracle(req.reconstruction, pb.token_pages, bs, params.sink_tokens, params.recent_window)
        lay = plan.layout
        for layer in range(layers):
            counts = [len(want[layer][hh]) for hh in range(h)]
            assert len(set(counts)) > 1, counts  # heads keep different numbers of tokens (not uniform)
            for hh in range(h):
                got = lay.kept_positions(layer, hh).tolist()
                assert len(got) == len(set(got)) and set(got) == want[layer][hh], (layer, hh)
        assert plan.evicted_tokens == layers * (h * c - pb.token_pages * bs)


# --------------------------------------------------------------------- decode-time rounds of several requests

H, BS, D, LAYERS, PER_REQ, WINDOW = 2, 16, 8, 2, 10, 8
BASE = dict(policy="contour_diverse", budget=48, recent_window=4, sink_tokens=2)
# requests of one step: a and b alike, c other sinks, d and e another selector.lam, f another scorer.kernel_size
SETTINGS = {"a": {}, "b": {}, "c": {"sink_tokens": 10}, "d": {"policy_args": {"selector.lam": 0.0}},
            "e": {"policy_args": {"selector.lam": 0.0}}, "f": {"policy_args": {"scorer.kernel_size": 3}}}


def _params(name: str):
    return resolve_request(EvictionConfig.from_dict({**BASE, **SETTINGS[name]}), None)


def _window(n_tokens: int, seed: int):
    """A request's captured observation window: queries ``{layer: [Hq, W, D]}`` of its last ``WINDOW``
    positions."""
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(2 * H, WINDOW, D, generator=g) for layer in range(LAYERS)}, \
        torch.arange(n_tokens - WINDOW, n_tokens)


def test_decode_rounds_with_other_settings_get_their_own_plan_and_equal_ones_are_planned_together(monkeypatch):
    from vllm.config import VllmConfig

    from vllm_contour.integration.messages import Round, RoundItem
    from vllm_contour.integration.metrics import ContourStats
    from vllm_contour.integration.worker import rounds as rounds_mod
    from vllm_contour.integration.worker.side import WorkerSide

    ws = WorkerSide(VllmConfig(), EvictionConfig(**BASE))
    st = ws.requests
    captured = {}  # req_id -> its window queries (how the worker captures them is not what is tested here)
    real_request = rounds_mod.WorkerRounds._request

    def with_window(self, item, *args):
        req = real_request(self, item, *args)
        req.queries, req.query_positions = captured[item.req_id]
        return req

    monkeypatch.setattr(rounds_mod.WorkerRounds, "_request", with_window)
    names = list(SETTINGS)
    views = [make_cache("cpu_rows", len(names) * PER_REQ + 1, H, BS, D, seed=s)[1:] for s in range(LAYERS)]
    scale = D ** -0.5
    params = {r: _params(r) for r in names}
    budgets = {r: _budget(params[r], H, BS, D) for r in names}
    assert len(set(budgets.values())) == 1  # the same page budget: only the settings tell the groups apart
    assert len({repr(p) for p in params.values()}) == 4
    ids = {r: list(range(1 + i * PER_REQ, 1 + (i + 1) * PER_REQ)) for i, r in enumerate(names)}
    first_n = {r: 5 * BS - 3 for r in names}
    for i, r in enumerate(names):
        st.state_for(r)
        captured[r] = _window(first_n[r], seed=10 + i)
    first = [RoundItem(req_id=r, block_ids=ids[r], num_tokens=first_n[r], params=params[r], budget=budgets[r], seq=1)
             for r in names]
    rep = {}
    ws.rounds.run(first, views, scale, None, rep, ContourStats())
    assert all(isinstance(rep[r], Round) for r in names), rep
    later_n = {r: (8 + i % 3) * BS - (i % 2) for i, r in enumerate(names)}
    for i, r in enumerate(names):
        captured[r] = _window(later_n[r], seed=20 + i)
    prev = {r: st.requests[r].layout for r in names}

    def alone(r, p):
        q, qpos = captured[r]
        return plan_round(views, ids[r], later_n[r], p, budgets[r], scale, prev=prev[r], queries=q,
                          query_positions=qpos)

    want = {r: alone(r, params[r]) for r in names}
    for r in "cdf":  # each setting changes the plan: planned with a's settings it would keep other tokens
        assert not torch.equal(alone(r, params["a"]).layout.positions, want[r].layout.positions), r

    calls = []
    real = rounds_mod.plan_rounds

    def spy(views_, reqs, p, budget, *args, **kw):
        calls.append((sorted(r for r in names for q in reqs if q.block_ids == ids[r]), p))
        return real(views_, reqs, p, budget, *args, **kw)

    monkeypatch.setattr(rounds_mod, "plan_rounds", spy)
    later = [RoundItem(req_id=r, block_ids=ids[r], num_tokens=later_n[r], params=params[r], budget=budgets[r], seq=2)
             for r in names]
    rep, stats = {}, ContourStats()
    ws.rounds.run(later, views, scale, None, rep, stats)
    assert all(isinstance(rep[r], Round) for r in names), rep
    for r in names:
        got = st.requests[r].layout
        assert torch.equal(got.pages, want[r].layout.pages) and torch.equal(got.positions, want[r].layout.positions), r
    groups = sorted(members for members, _ in calls)
    assert groups == [["a", "b"], ["c"], ["d", "e"], ["f"]], groups
    assert all(p == params[members[0]] for members, p in calls)
    assert stats.data.get("c:rounds_planned_together") == 4, stats.data
