"""KVzip's reconstruction when it cannot complete (issue 46's branches): the owner leaves while its hidden
requests run, a hidden request ends before its repeat tokens were computed, the component's step raises.
Each time the hidden requests still running are aborted (vLLM's scheduler finishes them next step), the owner
is served without eviction when it is still there, and the failure is counted once under ``reconstruction``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_contour.integration.reconstruction.prompt import RepeatPrompt

RP = RepeatPrompt(prefix=(1, 2, 3), first=(90, 91), later=(80, 81), suffix=(70,))
BS = 32


def _side():
    from vllm_contour.budget import CacheShape
    from vllm_contour.config import EvictionConfig
    from vllm_contour.integration.scheduler.side import SchedulerSide

    return SchedulerSide(EvictionConfig(policy="kvzip", budget=128), BS,
                         CacheShape(block_size=BS, num_kv_heads=3, head_dim=64, elem_size=4),
                         repeat_prompt=lambda: RP, max_model_len=1500)


def _started(side, rid="owner"):
    """An owner whose context [0, 1,200) is being reconstructed by its hidden requests (several chunks)."""
    req = SimpleNamespace(request_id=rid, all_token_ids=list(range(1000, 2300)), num_tokens=1300,
                          num_computed_tokens=0, sampling_params=None, client_index=0, lora_request=None,
                          cache_salt=None, priority=0, _block_hasher=None)
    t = side.track(req)
    assert t.params is not None and t.reconstructs
    side.context_rounds.round_due(t, 1200, [], lambda *a: pytest.fail("no round before the scores"))
    hidden = side.recon.take_new()
    assert len(hidden) >= 2 and side.recon.holding(rid)
    for h in hidden:  # vLLM admits them: the scheduler side sees them as requests that do not evict
        assert side.track(h).params is None
    return t, req, [h.request_id for h in hidden]


def test_the_owner_leaving_aborts_its_hidden_requests():
    side = _side()
    t, req, hidden = _started(side)
    side.finished(req)  # aborted by its client (or finished, or preempted) while its hidden requests run
    assert sorted(side.recon.take_aborts()) == sorted(hidden)
    assert not side.recon.waiting and not side.recon.companions
    assert side.totals.failures == {}  # nothing failed: the owner is gone


def test_a_hidden_request_ending_early_serves_its_owner_densely():
    side = _side()
    t, req, hidden = _started(side)
    side.finished(SimpleNamespace(request_id=hidden[0]))  # ended before its repeat tokens were computed
    assert t.params is None  # the owner goes on without eviction
    assert side.totals.failures == {"reconstruction": 1}
    assert sorted(side.recon.take_aborts()) == sorted(hidden[1:])
    assert not side.recon.holding("owner")
    side.finished(SimpleNamespace(request_id=hidden[1]))  # the aborted ones leave: nothing counted twice
    assert side.totals.failures == {"reconstruction": 1}


def test_an_exception_in_the_reconstruction_step_serves_its_owners_densely(monkeypatch):
    side = _side()
    t, req, hidden = _started(side)
    t2, req2, hidden2 = _started(side, "other")

    def boom(*a, **k):
        raise RuntimeError("step broke")

    monkeypatch.setattr(side.recon, "step", boom)
    out = side.context_rounds.step(SimpleNamespace(num_scheduled_tokens={h: 16 for h in hidden + hidden2}),
                                   side.tracked, {}, [], [], lambda *a: pytest.fail("no round"))
    assert out == []
    assert t.params is None and t2.params is None
    assert side.totals.failures == {"reconstruction": 2}
    assert sorted(side.recon.take_aborts()) == sorted(hidden + hidden2)
    assert not side.recon.waiting
