"""Worker side: a layout's moment pages are zeroed exactly when nothing on the worker reads them any more."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_contour import ops
from vllm_contour.integration.worker.requests import RequestState
from vllm_contour.integration.worker.side import WorkerSide

from .ops_cases import make_cache

H, BS, D = 2, 16, 8


@pytest.fixture
def side():
    from vllm.config import VllmConfig

    from vllm_contour.config import EvictionConfig

    ws = WorkerSide(VllmConfig(), EvictionConfig(policy="snapkv"))  # no caches registered: views set below
    _, k, v = make_cache("cpu_rows", 6, H, BS, D, torch.bfloat16)
    ws.caches.views = [(k, v)]
    yield ws, ws.requests


def _moment_layout(ws):
    ids = torch.tensor([[4, 5]], dtype=torch.int32)  # [L, M]
    k, v = ws.caches.views[0]
    ops.store_moments(k, v, ids[0].to(torch.int64), torch.full((BS * D,), float("nan")))
    return SimpleNamespace(moment_page_ids=ids)


def _nonfinite(ws) -> int:
    k, v = ws.caches.views[0]
    return int((~torch.isfinite(k.float())).sum() + (~torch.isfinite(v.float())).sum())


def test_moment_pages_outlive_every_reader_then_clear(side):
    ws, st = side
    lay = _moment_layout(ws)
    st.shared[7] = lay  # a shared compressed context and two requests that adopted it
    st.requests["a"] = RequestState("a", layout=lay)
    st.requests["b"] = RequestState("b", layout=lay)
    assert _nonfinite(ws) > 0
    ws._release_layout("a")
    assert "a" not in st.requests and _nonfinite(ws) > 0  # b and the shared context still read it
    ws._clear_unread(st.shared.pop(7), "shared context 7")
    assert _nonfinite(ws) > 0  # b still reads it
    ws._release_layout("b")
    assert _nonfinite(ws) == 0


def test_release_without_moments_or_state_is_a_noop(side):
    ws, st = side
    st.requests["c"] = RequestState("c", layout=SimpleNamespace(moment_page_ids=None))
    before = ws.caches.views[0][0].clone()
    ws._release_layout("c")
    ws._release_layout("never-seen")
    ws._clear_unread(None, "nothing")
    assert "c" not in st.requests and torch.equal(ws.caches.views[0][0], before)


def test_fault_switch_names_failures_and_limits_the_random_ones():
    """TEST-ONLY switch: ``at`` names one failure of one request (a prefix with ``*``), which then gets no
    random ones; ``only`` keeps the random ones to ids with a prefix; forward / metadata failures (reported) and
    builder / impl / kernel ones (raised in the backend) fire in the N-th step a named request runs compacted;
    unknown keys are refused."""
    from vllm_contour.integration.faults import FaultSwitch

    fs = FaultSwitch("plan=1,apply=1,only=X,at=apply:FA*:1,at=plan:P0:2,at=forward:FF0:2,at=metadata:FM0:1")
    assert fs.on
    assert fs.hit("plan", "X3-0a1b2c3d", 1) and fs.hit("apply", "X3-0a1b2c3d", 5)  # random, rate 1
    assert not fs.hit("plan", "Y3-0a1b2c3d", 1) and not fs.hit("apply", "Y3-0a1b2c3d", 1)  # not X*
    assert fs.hit("apply", "FA7-0a1b2c3d", 1) and not fs.hit("apply", "FA7-0a1b2c3d", 2)
    assert not fs.hit("plan", "FA7-0a1b2c3d", 1)
    assert fs.hit("plan", "P0-0a1b2c3d", 2) and not fs.hit("plan", "P0-0a1b2c3d", 1)
    assert not fs.hit("plan", "P01-0a1b2c3d", 2)  # no '*': the exact id only
    st = SimpleNamespace(requests={"FF0-0a1b2c3d": SimpleNamespace(layout=object()),
                                   "FM0-0a1b2c3d": SimpleNamespace(layout=None), "X1-0a1b2c3d": SimpleNamespace(layout=object())})
    ids = ["FF0-0a1b2c3d", "FM0-0a1b2c3d", "X1-0a1b2c3d"]
    assert fs.step_errors(ids, st) == {}  # FF0's 1st compacted step; FM0 is not compacted yet
    st.requests["FM0-0a1b2c3d"].layout = object()
    assert fs.step_errors(ids, st) == {"FF0-0a1b2c3d": "ragged decode: fault switch",
                                       "FM0-0a1b2c3d": "metadata: fault switch"}
    assert fs.step_errors(ids, st) == {}  # once each
    assert FaultSwitch("").step_errors(ids, st) == {} and not FaultSwitch(None).on
    raised = FaultSwitch("at=builder:RB0:2,at=impl:RI*:1,at=kernel:RK0:1")  # counted per step made, compacted
    assert raised.backend_faults(["RB0-0a1b2c3d", "X1-0a1b2c3d"]) == set()
    assert raised.backend_faults(["RB0-0a1b2c3d", "RI7-0a1b2c3d", "RK0-0a1b2c3d"]) == {"builder", "impl", "kernel"}
    assert raised.backend_faults(["RB0-0a1b2c3d", "RI7-0a1b2c3d", "RK0-0a1b2c3d"]) == set()  # once each
    assert raised.step_errors(["RB0-0a1b2c3d"], st) == {}  # not written into the report
    with pytest.raises(ValueError, match="unknown key 'at'"):
        FaultSwitch("at=explode:X:1")


def test_rounds_due_together_move_together_and_a_failure_stays_with_its_request(side):
    """Three requests due in one step: their bytes move in one batch (one compaction per layer), each gets its
    own report; a request whose round fails while applying (fault switch) is moved on its own and is the
    only one recomputed."""
    from vllm_contour.budget import page_budget
    from vllm_contour.config import EvictionConfig, resolve_request
    from vllm_contour.integration import faults
    from vllm_contour.integration.messages import Recompute, Round, RoundItem
    from vllm_contour.integration.metrics import ContourStats

    ws, st = side
    layers, bs, d, per_req = 2, 16, 8, 8
    ws.caches.views = [make_cache("cpu_rows", 3 * per_req + 1, H, bs, d, torch.float32, seed=s)[1:] for s in range(layers)]
    rounds = ws.rounds
    params = resolve_request(EvictionConfig(policy="knorm", budget=32, recent_window=4, sink_tokens=2), None)
    pb = page_budget(params.budget, num_kv_heads=H, block_size=bs, head_dim=d, elem_size=4,
                     sink_tokens=params.sink_tokens, recent_window=params.recent_window, moments=False)
    items = [RoundItem(req_id=r, block_ids=list(range(1 + i * per_req, 1 + (i + 1) * per_req)),
                       num_tokens=per_req * bs - 5, params=params, budget=pb, seq=1) for i, r in enumerate("abc")]
    for it in items:
        st.state_for(it.req_id)
    rep, stats = {}, ContourStats()
    with faults.installed("at=apply:b:1"):
        rounds.run(items, ws.caches.views, d ** -0.5, None, rep, stats)
    assert isinstance(rep["a"], Round) and isinstance(rep["c"], Round) and isinstance(rep["b"], Recompute)
    assert st.requests["a"].layout is not None and st.requests["c"].layout is not None and "b" not in st.requests
    assert stats.data.get("c:batched_rounds") == 2, stats.data
    assert "c:later_round_seconds" not in stats.data  # first rounds only
    later = RoundItem(req_id="a", block_ids=items[0].block_ids, num_tokens=per_req * bs, params=params, budget=pb,
                      seq=2)
    rep2, stats2 = {}, ContourStats()
    rounds.run([later], ws.caches.views, d ** -0.5, None, rep2, stats2)
    assert isinstance(rep2["a"], Round)
    assert stats2.data["c:later_round_seconds"] == pytest.approx(stats2.data["c:policy_seconds"]
                                                                 + stats2.data["c:compact_seconds"])


def test_decode_time_rounds_due_together_are_planned_together_and_a_plan_failure_stays_alone(side):
    """Three compacted requests due in one step are planned in one policy pass (each keeps what its round
    alone keeps); a request whose round cannot be planned (too few blocks for its tokens) makes the joint
    plan fail, the step then plans them one by one: it alone fails, the others compact as before; a plan
    fault (fault switch) takes its request out of the joint plan."""
    from vllm_contour.budget import page_budget
    from vllm_contour.config import EvictionConfig, resolve_request
    from vllm_contour.evictor import plan_round
    from vllm_contour.integration import faults
    from vllm_contour.integration.messages import PlanFailed, Round, RoundItem
    from vllm_contour.integration.metrics import ContourStats

    ws, st = side
    layers, bs, d, per_req = 2, 16, 8, 10
    params = resolve_request(EvictionConfig(policy="knorm", budget=32, recent_window=4, sink_tokens=2), None)
    pb = page_budget(params.budget, num_kv_heads=H, block_size=bs, head_dim=d, elem_size=4,
                     sink_tokens=params.sink_tokens, recent_window=params.recent_window, moments=False)

    faults_mod = faults

    def step(spec, n_tokens, short=None):
        views = [make_cache("cpu_rows", 3 * per_req + 1, H, bs, d, torch.float32, seed=s)[1:] for s in range(layers)]
        st.requests.clear()
        ids = {r: list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i, r in enumerate("abc")}
        first = [RoundItem(req_id=r, block_ids=ids[r], num_tokens=5 * bs - 3, params=params, budget=pb, seq=1)
                 for r in "abc"]
        for it in first:
            st.state_for(it.req_id)
        rounds = ws.rounds
        rounds.run(first, views, d ** -0.5, None, {}, ContourStats())
        prevs = {r: st.requests[r].layout for r in "abc"}
        later = [RoundItem(req_id=r, block_ids=ids[r][:4] if r == short else ids[r], num_tokens=n_tokens[i],
                           params=params, budget=pb, seq=2) for i, r in enumerate("abc")]
        alone = {it.req_id: plan_round(views, it.block_ids, it.num_tokens, params, pb, d ** -0.5, prev=prevs[it.req_id])
                 for it in later if it.req_id != short}
        rep, stats = {}, ContourStats()
        with faults_mod.installed(spec):
            rounds.run(later, views, d ** -0.5, None, rep, stats)
        for r, plan in alone.items():
            if isinstance(rep[r], Round):
                assert torch.equal(st.requests[r].layout.positions, plan.layout.positions)
        return rep, stats

    rep, stats = step("", [8 * bs, 9 * bs - 2, 10 * bs])
    assert all(isinstance(rep[r], Round) for r in "abc") and stats.data.get("c:rounds_planned_together") == 3
    rep, stats = step("", [8 * bs, 9 * bs - 2, 10 * bs], short="b")
    assert isinstance(rep["b"], PlanFailed) and "blocks" in rep["b"].reason
    assert isinstance(rep["a"], Round) and isinstance(rep["c"], Round)
    assert "c:rounds_planned_together" not in stats.data
    rep, stats = step("at=plan:b:2", [8 * bs, 9 * bs - 2, 10 * bs])
    assert isinstance(rep["b"], PlanFailed) and isinstance(rep["a"], Round) and isinstance(rep["c"], Round)
    assert stats.data.get("c:rounds_planned_together") == 2


def test_kept_kvzip_scores_named_dropped_go_after_the_steps_rounds(side):
    """The scheduler names kept context scores to drop (least recently used, or a prefix-cache reset); the
    worker drops them after the step's rounds, which may still read them; the others stay."""
    from vllm_contour.integration.messages import ContourMetadata
    from vllm_contour.page_tables import PageTables

    ws, st = side
    ws.scores.kept = {"old": torch.zeros(1), "new": torch.ones(1)}
    st.tables = PageTables(1, H, BS, 6)
    ws.begin_step(ContourMetadata(scores_dropped=["old"]))
    assert "old" in ws.scores.kept  # named this step: still there while the step's rounds run
    ws.after_forward()
    assert set(ws.scores.kept) == {"new"} and ws.message is None
