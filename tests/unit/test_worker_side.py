"""Worker side: a layout's moment pages are zeroed exactly when nothing on the worker reads them any more."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_contour import ops
from vllm_contour.integration.state import RequestState, worker_state
from vllm_contour.integration.worker_side import WorkerSide

from .ops_cases import make_cache

H, BS, D = 2, 16, 8


@pytest.fixture
def side():
    st = worker_state()
    saved = st.requests, st.shared
    st.requests, st.shared = {}, {}
    ws = WorkerSide.__new__(WorkerSide)  # only the cache views matter here
    _, k, v = make_cache("cpu_rows", 6, H, BS, D, torch.bfloat16)
    ws._views = [(k, v)]
    yield ws, st
    st.requests, st.shared = saved


def _moment_layout(ws):
    ids = torch.tensor([[4, 5]], dtype=torch.int32)  # [L, M]
    k, v = ws._views[0]
    ops.store_moments(k, v, ids[0].to(torch.int64), torch.full((BS * D,), float("nan")))
    return SimpleNamespace(moment_page_ids=ids)


def _nonfinite(ws) -> int:
    k, v = ws._views[0]
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
    before = ws._views[0][0].clone()
    ws._release_layout("c")
    ws._release_layout("never-seen")
    ws._clear_unread(None, "nothing")
    assert "c" not in st.requests and torch.equal(ws._views[0][0], before)
