"""Every preset plans, bit for bit, what the recorded plans in ``data/policy_plans.json`` hold.

The fixture was written by this file (``python tests/unit/test_policy_equivalence.py --write``) from the
policy code before a refactor (issue 47: the components' capabilities declared on their interfaces), so a
refactor of ``vllm_contour/policies`` that is meant to change nothing is checked against what the code did.
Each case plans several requests together through ``Policy.plan_requests`` (first rounds, decode-time ragged
rounds, a one-layer ragged round through ``plan_layer_ragged``; first and decode-time rounds again with no
sinks and no recent window), and each plan records, per request, layer
and head, the kept positions, the pages and the scores an accumulating scorer carries (their float32 bits).
Rewrite the fixture only from a commit whose plans are known to be right.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

import pytest
import torch

from vllm_contour.policies import LayerInputs, Policy, build_policy, policy_names
from vllm_contour.policies.allocators import ContourAllocator, PyramidAllocator, UniformAllocator
from vllm_contour.policies.registry import PRESETS
from vllm_contour.policies.scorers import H2OScorer, KeyNormScorer, SnapKVScorer
from vllm_contour.policies.selectors import BalancingSelector, DiversitySelector

FIXTURE = pathlib.Path(__file__).parent / "data" / "policy_plans.json"
H, HQ, D, BS, L, W = 2, 4, 16, 4, 3, 6  # heads per layer, query heads, head dim, page, layers, window
SINKS, RECENT = 2, 6
MOMENT_PAGES = 2  # head-pages per layer that MomentKV's statistics take when moment correction is on

# knob settings beyond each preset's defaults: the branches the defaults do not take
VARIANTS = {"contour": [{"mix": 0.5, "power": 0.5}], "contour_diverse": [{"lam": 0.0}],
            "expected_attention": [{"use_vnorm": False, "use_covariance": False}], "moment": [{"iterate": False}],
            "pyramidkv": [{"beta": 2.0}], "snapkv": [{"kernel_size": 1}]}


def _extras() -> dict[str, Policy]:
    """Component combinations no preset has (a balancing selector, a schedule over a mass allocator)."""
    balancing = BalancingSelector(max_swaps=4, pool=4)
    pyramid = PyramidAllocator(3.0, ContourAllocator(0.7))
    return {"x_balancing": Policy("x_balancing", H2OScorer(), UniformAllocator(), balancing, sink_tokens=SINKS,
                                  recent_window=RECENT),
            "x_pyramid_contour": Policy("x_pyramid_contour", KeyNormScorer(), pyramid, DiversitySelector(0.3),
                                        sink_tokens=SINKS, recent_window=RECENT,
                                        alloc_scorer=SnapKVScorer(kernel_size=3))}


def _policies() -> dict[str, tuple[Policy, bool]]:
    """name -> (policy, whether it has moment correction: its cases run with and without moment pages)."""
    out = {}
    for name in policy_names():
        for i, args in enumerate([{}] + VARIANTS.get(name, [])):
            key = name if not args else f"{name}~{i}"
            out[key] = (build_policy(name, args, sink_tokens=SINKS, recent_window=RECENT),
                        PRESETS[name].moment_correction)
    out.update({k: (p, False) for k, p in _extras().items()})
    return out


def _first_round(g: torch.Generator, num_tokens: int, window_end: int | None, qpos_shift: int = 0) -> LayerInputs:
    """Every layer of a prompt (rows ``l * H + h``); ``window_end``: a question after the context."""
    ce = num_tokens if window_end is None else window_end
    region = ce // BS * BS
    return LayerInputs(keys=torch.randn(L * H, num_tokens, D, generator=g),
                       values=torch.randn(L * H, num_tokens, D, generator=g), region_len=region, page_size=BS,
                       layer_idx=1, num_layers=L + 2, scale=D ** -0.5,
                       queries=torch.randn(L * HQ, W, D, generator=g) * 2,
                       query_positions=torch.arange(ce - W, ce) + qpos_shift, window_end=window_end,
                       reconstruction=torch.rand(L * H, num_tokens, generator=g))


def _decode_round(g: torch.Generator, e_old: int, n_tail: int, n_part: int, prior: bool) -> LayerInputs:
    """Every layer of a later round, laid out as the evictor's ``_round_inputs``: row r's kept run (original
    positions) then the new full tail pages, padding up to the widest row, then the partial last page."""
    kept = torch.randint(1, e_old + 1, (L * H,), generator=g)
    width = int(kept.max()) + n_tail
    num_tokens = (e_old + n_tail) * BS + n_part
    pos = torch.zeros(L * H, width * BS + n_part, dtype=torch.int64)
    for r, p in enumerate(kept.tolist()):
        run = torch.sort(torch.randperm(e_old * BS, generator=g)[: p * BS]).values
        pos[r, : p * BS] = run
        pos[r, p * BS:(p + n_tail) * BS] = torch.arange(e_old * BS, (e_old + n_tail) * BS)
        pos[r, (p + n_tail) * BS:width * BS] = e_old * BS + torch.arange((width - p - n_tail) * BS)  # padding
    pos[:, width * BS:] = torch.arange((e_old + n_tail) * BS, num_tokens)
    cand = (kept + n_tail) * BS
    tok = torch.arange(width * BS + n_part).view(1, -1)
    valid = (tok < cand.view(-1, 1)) | (tok >= width * BS)
    recon = torch.rand(L * H, num_tokens, generator=g).gather(1, pos.clamp_max(num_tokens - 1))
    carry = torch.rand(L * H, width * BS, generator=g) * (tok[:, : width * BS] < (kept * BS).view(-1, 1))
    return LayerInputs(keys=torch.randn(L * H, pos.shape[1], D, generator=g),
                       values=torch.randn(L * H, pos.shape[1], D, generator=g), region_len=width * BS,
                       page_size=BS, layer_idx=0, num_layers=L, scale=D ** -0.5,
                       queries=torch.randn(L * HQ, W, D, generator=g) * 2,
                       query_positions=torch.arange(num_tokens - W, num_tokens), positions=pos,
                       prior=carry if prior else None, head_pages=kept + n_tail, valid=valid,
                       window_end=num_tokens, reconstruction=recon)


def _ragged_heads(g: torch.Generator, prior: bool) -> list[LayerInputs]:
    """One layer of a later round as one-KV-head inputs (``plan_layer_ragged``): own kept run, shared tail."""
    heads = []
    for p in (3, 6, 1):
        run = torch.sort(torch.cat([torch.arange(2), 2 + torch.randperm(70, generator=g)[: p * BS - 2]])).values
        pos = torch.cat([run, torch.arange(72, 82)])  # two tail pages and a partial page of two
        heads.append(LayerInputs(keys=torch.randn(1, pos.numel(), D, generator=g),
                                 values=torch.randn(1, pos.numel(), D, generator=g), region_len=(p + 2) * BS,
                                 page_size=BS, layer_idx=2, num_layers=L, scale=D ** -0.5,
                                 queries=torch.randn(HQ // H, W, D, generator=g), query_positions=torch.arange(76, 82),
                                 positions=pos, prior=torch.rand(1, (p + 2) * BS, generator=g) if prior else None,
                                 reconstruction=torch.rand(1, pos.numel(), generator=g)))
    return heads


def _cases(pol: Policy, moments: bool) -> dict[str, list[list]]:
    """case -> per request, per layer: the Selection as plain data."""
    m = MOMENT_PAGES if moments else 0
    g = torch.Generator().manual_seed(47)
    first = [_first_round(g, 86, None), _first_round(g, 90, 71, qpos_shift=2), _first_round(g, 3, None),
             _first_round(g, 64, None)]
    first_totals = [[12 - m, 9 - m, 16 - m], [4, 4, 4], [6, 6, 6], [40, 200, 10 - m]]
    decode = [_decode_round(g, 12, 2, 2, pol.accumulates), _decode_round(g, 9, 1, 0, pol.accumulates),
              _decode_round(g, 15, 3, 3, pol.accumulates)]
    decode_totals = [[10 - m] * L, [5, 7 - m, 30], [14 - m, 4, 8]]
    out = {"first": pol.plan_requests(first, first_totals, H),
           "decode": pol.plan_requests(decode, decode_totals, H),
           "ragged_layer": [[pol.plan_layer_ragged(_ragged_heads(g, pol.accumulates), 12 - m)]]}
    no_sinks = Policy(pol.name, pol.scorer, pol.allocator, pol.selector, sink_tokens=0, recent_window=0,
                      alloc_scorer=pol.alloc_scorer)
    out["first_no_sinks"] = no_sinks.plan_requests(first[:2], first_totals[:2], H)
    out["decode_no_sinks"] = no_sinks.plan_requests(decode, decode_totals, H)  # the last candidates not forced
    return {case: [[_selection(s, BS) for s in req] for req in reqs] for case, reqs in out.items()}


def _selection(sel, page: int) -> dict:
    return {"kept": [k.tolist() for k in sel.kept], "pages": [k.numel() // page for k in sel.kept],
            "scores": None if sel.scores is None else
            [s.to(torch.float32).contiguous().view(torch.int32).tolist() for s in sel.scores]}


def _plans() -> dict[str, list]:
    torch.set_num_threads(1)
    out = {}
    for key, (pol, has_moments) in _policies().items():
        for moments in ([False, True] if has_moments else [False]):
            for case, plan in _cases(pol, moments).items():
                out[f"{key}/{case}" + ("/moments" if moments else "")] = plan
    return out


@pytest.fixture(scope="module")
def plans():
    threads = torch.get_num_threads()
    try:
        yield _plans()
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def _recorded() -> dict[str, list]:
    """The recorded plans (none when the fixture is missing: then the first test fails)."""
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


def test_every_recorded_plan_is_planned_again(plans):
    """The same set of (preset or variant, case): none lost, none new without a recording."""
    assert sorted(plans) == sorted(_recorded())


@pytest.mark.parametrize("key", sorted(_recorded()))
def test_plan_equals_recording(plans, key):
    got, want = plans[key], _recorded()[key]
    for r, (gr, wr) in enumerate(zip(got, want)):
        for layer, (gs, ws) in enumerate(zip(gr, wr)):
            assert gs == ws, f"{key}: request {r}, layer {layer} differs"
    assert len(got) == len(want) and [len(x) for x in got] == [len(x) for x in want]


def test_the_recording_covers_every_preset_and_kind_of_round():
    keys = _recorded()
    for name in policy_names():
        for case in ("first", "decode", "ragged_layer", "first_no_sinks", "decode_no_sinks"):
            assert f"{name}/{case}" in keys
            assert (f"{name}/{case}/moments" in keys) == PRESETS[name].moment_correction
    kept = [k for plan in keys.values() for req in plan for sel in req for k in sel["kept"]]
    assert sum(map(len, kept)) > 0 and any(len(k) == 0 for k in kept)  # an empty region's request is in


@pytest.mark.parametrize("lam", [0.5, 10.0])
def test_a_decode_round_with_the_diversity_penalty_keeps_every_forced_token(lam):
    """Decode-time (ragged) rounds rank forced tokens (sinks, recent window) at +inf for every selector: the
    diversity penalty (which normalises scores and skips forced tokens) keeps them whatever its lambda, and
    its lambda changes what else it keeps. (Forced tokens were ranked at the largest finite float, so the
    penalty saw them as ordinary tokens, dropped some at a large lambda and flattened every other score.)"""
    g = torch.Generator().manual_seed(7)
    inp = _decode_round(g, e_old=6, n_tail=2, n_part=3, prior=False)
    totals = [H * 4] * L
    plans = {}
    for x in (lam, 0.0):
        pol = build_policy("contour_diverse", {"selector.lam": x}, sink_tokens=SINKS, recent_window=RECENT)
        forced = pol.forced_mask(inp)
        sel = pol.plan_rows(inp, totals, H)
        rows = [k for layer in sel for k in layer.kept]
        for r, kept in enumerate(rows):
            want = forced[r].nonzero().squeeze(1)
            assert bool(torch.isin(want, kept).all()), (x, r, want.tolist(), kept.tolist())
        plans[x] = [k.tolist() for k in rows]
    assert lam < 1 or plans[lam] != plans[0.0]  # a large penalty changes the selection


def _write() -> None:
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    plans = _plans()
    lines = [f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in sorted(plans.items())]
    FIXTURE.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {len(plans)} plans to {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/unit/test_policy_equivalence.py --write")
    _write()
