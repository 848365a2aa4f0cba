"""KVzap inside the engine (server policy ``kvzap`` at 128 tokens per head, prefix caching on): decode-time
rounds over generated tokens hold budget.py's bound after every step with no reconstruction; compressed
contexts are shared; a model the shipped surrogate was not trained on is refused at start-up, naming both."""

from __future__ import annotations

import math

import pytest

from .conftest import BASE_LLM, TINY_LLM, run_engine
from .test_engine import _expected_rounds

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kvzap(model_dir):
    return run_engine("kvzap128_prefix", dict(BASE_LLM, model=model_dir, enable_prefix_caching=True,
                                              additional_config={"kv_eviction": {"policy": "kvzap", "budget": 128}}),
                      ["decode_bound", "shared_context", "shared_salted"])


def _bound(budget: int, interval: int) -> int:
    """budget.py's bound for a SmolLM2 request (fp32, block 32) of a query-free policy: no window query blocks."""
    from vllm_contour.budget import CacheShape, request_budget
    from vllm_contour.config import EvictionConfig, resolve_request

    params = resolve_request(EvictionConfig(policy="kvzap", budget=128),
                             {"kv_budget": budget, "kv_decode_interval": interval})
    pb = request_budget(params, CacheShape(block_size=32, num_kv_heads=3, head_dim=64, elem_size=4), per_request=True)
    return pb.held_blocks_bound(interval)


def test_kvzap_holds_the_bound_through_long_answers_without_a_reconstruction(kvzap):
    """A 1,200-token prompt and two 80-token prompts generating 700 / 700 / 300 tokens together (T = 64): after
    every step each holds at most the bound and reaches it, runs the rounds the round clock implies (the short
    ones' rounds score generated tokens only, beyond sinks and window), the long one ends at <= 0.2x what
    stock holds; the engine ran no reconstruction at all."""
    ev = kvzap["decode_bound"]
    assert ev["failures"] == {}
    bs = ev["block_size"]
    for i, case in enumerate(ev["cases"]):
        rid, budget = f"B{i}", (case[2] if len(case) > 2 else {}).get("kv_budget", 128)
        bound = _bound(budget, 64)
        assert max(ev["held"][rid]) == bound, (rid, bound, ev["held"][rid])
        assert all(n <= bound for n in ev["held"][rid]), (rid, ev["held"][rid])
        assert ev["request_rounds"][rid] == _expected_rounds(case[0], case[1], budget, 64, bs) > 0, ev["request_rounds"]
    p0, g0 = ev["cases"][0][:2]
    assert ev["held"]["B0"][-1] <= 0.2 * math.ceil((p0 + g0 - 1) / bs)
    assert ev["held"]["B1"][0] == math.ceil(80 / bs)  # dense until its answer outgrows the budget
    salted = kvzap["shared_salted"]
    assert salted["reconstructions"] == 0 and salted["failures"] == {}


def test_kvzap_compressed_contexts_are_shared(kvzap):
    """One document compressed by kvzap at its boundary and adopted by the next five requests with the same
    settings (they prefill only their 60 question tokens); other settings never share; the same request with a
    cache salt compresses the document itself and gives the tokens of the one that adopted it."""
    on = kvzap["shared_context"]
    assert on["failures"] == {} and on["prefix_caching"]
    c, hits, first = on["context"], on["hits"], on["first_sched"]
    for rid in ("B", "N0", "N1", "N2", "N3"):
        assert hits[rid] == c and first[rid] == 60, (rid, hits, first)
    for rid in ("P", "Bbudget", "Bknorm"):
        assert hits[rid] < c, (rid, hits)
    assert on["shared_hits"] == 5 and on["private_after_b"] > 0
    assert on["tokens"]["Areset"] == on["tokens"]["A"]
    salted = kvzap["shared_salted"]
    assert salted["rounds"] >= 2  # its own context round, then decode-time rounds
    assert salted["tokens"] == on["tokens"]["B"]
    assert on["free_end"] == on["num_blocks"] - 1


def test_kvzap_refuses_a_model_its_surrogate_was_not_trained_on(tiny_model_dir):
    """The tiny Llama (random weights) has no shipped surrogate: the engine stops at start-up naming the model
    and its fingerprint, and the command that trains one."""
    from vllm_contour.surrogate.fingerprint import identify

    tiny = identify(tiny_model_dir)
    res = run_engine("kvzap_other_model", dict(TINY_LLM, model=tiny_model_dir,
                                               additional_config={"kv_eviction": {"policy": "kvzap", "budget": 64}}),
                     ["greedy"], expect_failure=True)
    assert res["rc"] != 0
    assert f"no surrogate is shipped for model {tiny.name} (fingerprint {tiny.fingerprint})" in res["log"], \
        res["log"][-3000:]
    assert "python -m vllm_contour.surrogate train" in res["log"]
