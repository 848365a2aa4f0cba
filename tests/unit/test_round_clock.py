"""The round clock (``round_clock.py``): when a round is due, where a prefill chunk stops, which queries a
round scores and how much of a prefix-cache hit may be used, at and around each boundary."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_contour.round_clock import (ClockState, cap_chunk, capture_span, context_boundary, next_round,
                                      retry_after_noop, round_due, usable_hit)

BS = 32
S = ClockState(prefill_end=100, budget=128, interval=64, block_size=BS)  # short prompt, N = 128, T = 64


@pytest.mark.parametrize("state, due", [
    (S, 192),  # prompt <= N + T: first compressed while it decodes, at N + T
    (replace(S, prefill_end=192), 192),  # prompt exactly N + T
    (replace(S, prefill_end=193), 193),  # one past: at the prompt end
    (replace(S, prefill_end=1000), 1000),
    (replace(S, retry_at=224, tried=True), 224),  # a first round that planned nothing: retried later
    (replace(S, retry_at=150, tried=True), 192),  # ... never before N + T
    (replace(S, interval=0), 100),  # T = 0: once, at the prompt end, whatever its length
    (replace(S, interval=0, tried=True), None),
    (replace(S, compacted=True, tried=True, region_blocks=10), 10 * BS + 64),  # the dense tail reached T
    (replace(S, compacted=True, tried=True, region_blocks=10, interval=0), None),
    # T = 0, a streaming-input session took its next chunk: a round at its end once it completes a block
    (replace(S, compacted=True, tried=True, region_blocks=10, interval=0, chunk_end=11 * BS + 5), 11 * BS + 5),
    (replace(S, compacted=True, tried=True, region_blocks=11, interval=0, chunk_end=11 * BS + 5), None),
    (replace(S, compacted=True, tried=True, region_blocks=10, interval=0, chunk_end=10 * BS + 7), None),
    (replace(S, prefill_end=1000, context_len=300), 300),  # the context boundary first
    (replace(S, prefill_end=1000, context_len=300, tried=True), 1000),  # then as without one
    (replace(S, prefill_end=1000, context_len=300, context_fits=True), 1000),  # C fits: once, at the prompt end
    (replace(S, prefill_end=1000, context_len=300, context_fits=True, tried=True), 1000),
    (replace(S, prefill_end=1000, context_len=300, prefill_at_context=False), 1000),  # score_only
])
def test_next_round(state, due):
    assert next_round(state) == due


@pytest.mark.parametrize("state, c", [
    (replace(S, prefill_end=1000, context_len=300), 300),
    (replace(S, prefill_end=301, context_len=300), 300),  # one token of question
    (replace(S, prefill_end=300, context_len=300), None),  # C at the prompt end: nothing after it
    (replace(S, prefill_end=200, context_len=300), None),  # C past the prompt end
    (replace(S, prefill_end=1000, context_len=300, context_fits=True), None),
    (replace(S, prefill_end=1000, context_len=300, prefill_at_context=False), None),
    (replace(S, prefill_end=1000, context_len=300, tried=True), None),
    (replace(S, prefill_end=1000, context_len=300, compacted=True), None),  # e.g. adopted a shared context
    (replace(S, prefill_end=1000), None),
])
def test_context_boundary(state, c):
    assert context_boundary(state) == c


@pytest.mark.parametrize("state, done, num_tokens, due", [
    (replace(S, prefill_end=1000), 1000, 1000, True),  # exactly at R, the prompt's last chunk
    (replace(S, prefill_end=1000), 999, 1000, False),  # one before
    (S, 192, 192, True),  # decode: the step that gives the 192nd token KV
    (S, 191, 191, False),
    (replace(S, prefill_end=1000), 1024, 1001, True),  # past R (a multi-token step): at its end
    (replace(S, prefill_end=1000, context_len=300), 300, 1000, True),  # a chunk ending at C
    (replace(S, prefill_end=1000, context_len=300), 299, 1000, False),
    (replace(S, prefill_end=1000, context_len=300, tried=True), 512, 1000, False),  # mid-prefill: never
    (replace(S, interval=0), 100, 100, True),
    (replace(S, interval=0, tried=True), 500, 500, False),
])
def test_round_due(state, done, num_tokens, due):
    assert round_due(state, done, num_tokens) is due


@pytest.mark.parametrize("r, w, start, done, span", [
    (1000, 32, 900, 1000, (968, 1000)),  # the chunk ending at R holds the whole window
    (1000, 32, 980, 1010, (980, 1000)),  # window split over two chunks: this one's part, not past R
    (1000, 32, 0, 968, None),  # ends where the window starts
    (1000, 32, 0, 969, (968, 969)),  # one token into the window
    (1000, 32, 1000, 1001, None),  # after R
    (20, 32, 0, 20, (0, 20)),  # window larger than what R leaves: from the start
])
def test_capture_span(r, w, start, done, span):
    assert capture_span(r, w, start, done) == span


@pytest.mark.parametrize("boundary, computed, new, n", [
    (100, 64, 64, 36),  # C off a block boundary: the chunk ends at C
    (96, 64, 64, 32),  # C on a block boundary
    (128, 64, 64, 64),  # the chunk ends exactly at C already
    (100, 100, 64, 64),  # C reached: the question goes on
    (100, 0, 512, 100),  # first chunk
    (None, 0, 512, 512),
])
def test_cap_chunk(boundary, computed, new, n):
    assert cap_chunk(boundary, computed, new) == n


@pytest.mark.parametrize("hit, boundary, window_start, used", [
    (256, None, None, 256),  # nothing to keep computable: the whole hit
    (256, 100, None, 96),  # C off a block boundary: whole blocks before C
    (256, 96, None, 96),  # C on a block boundary
    (256, 300, None, 256),  # C past the hit
    (256, None, 968, 256),  # the window starts past the hit
    (256, None, 200, 192),  # the window starts inside the hit: it is computed again
    (256, None, -12, 0),  # a window larger than R: nothing of the hit
    (256, 300, 200, 192),
    (0, 100, 50, 0),
])
def test_usable_hit(hit, boundary, window_start, used):
    assert usable_hit(hit, BS, boundary, window_start) == used


def test_retry_after_a_round_that_planned_nothing():
    assert retry_after_noop(0, 256, 64, BS) == 320
    assert retry_after_noop(320, 400, 64, BS) == 384  # from the last retry point, not from now
    assert retry_after_noop(0, 100, 16, BS) == 132  # at least one block


def test_a_decoding_request_rounds_every_interval():
    """Walking a request token by token with the clock: the first round at max(prompt, N + T), then every
    T tokens, each leaving the dense tail at the last block boundary; never more than N + T with KV."""
    s = replace(S, prefill_end=250)
    rounds = []
    for done in range(250, 700):
        if round_due(s, done, done):
            rounds.append(done)
            e = done // BS  # a round keeps N // bs blocks and the partial last block stays dense
            s = replace(s, tried=True, compacted=True, region_blocks=e)
    assert rounds[0] == 250
    assert [b - a for a, b in zip(rounds, rounds[1:])] == [64 - (a % BS) for a in rounds[:-1]]


# The scheduler side asks the clock with the request's own settings (vLLM imported, no engine).
def _request(num_tokens, **extra):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=f"r{len(extra)}-{num_tokens}", num_tokens=num_tokens, num_computed_tokens=0,
                           sampling_params=SimpleNamespace(extra_args=extra or None))


def _side(policy):
    from vllm_contour.budget import CacheShape
    from vllm_contour.config import EvictionConfig
    from vllm_contour.integration.scheduler.side import SchedulerSide

    shape = CacheShape(block_size=BS, num_kv_heads=2, head_dim=16, elem_size=4)
    return SchedulerSide(EvictionConfig(policy=policy, budget=128, window=32), BS, shape)


@pytest.mark.parametrize("policy, extra, hit, used", [
    ("snapkv", {}, 992, 960),  # query-aware: R = 1000, its window [968, 1000) is computed
    ("snapkv", {}, 960, 960),  # the window starts past the hit
    ("knorm", {}, 992, 992),  # query-agnostic scorer: the whole hit
    ("knorm", {"kv_context_len": 300}, 992, 288),  # a context boundary still to compress
    ("snapkv", {"kv_context_len": 300}, 992, 256),  # ... and the window before it, [268, 300)
    ("knorm", {"kv_context_len": 96}, 992, 992),  # the context fits the budget: no boundary
    ("snapkv", {"kv_observation_window": 64}, 992, 928),
])
def test_scheduler_side_cuts_a_prefix_hit_where_the_clock_says(policy, extra, hit, used):
    assert _side(policy).prefill.limit_hit(_request(1000, **extra), hit) == used


@pytest.mark.parametrize("extra, computed, new, n", [
    ({"kv_context_len": 300}, 0, 512, 300),
    ({"kv_context_len": 300}, 256, 512, 44),
    ({"kv_context_len": 300, "kv_agnostic_mode": "score_only"}, 256, 512, 512),
    ({}, 256, 512, 512),
])
def test_scheduler_side_ends_a_chunk_at_the_context_boundary(extra, computed, new, n):
    assert _side("knorm").prefill.cap_chunk(_request(1000, **extra), computed, new) == n
