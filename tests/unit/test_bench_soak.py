"""Fast checks of benchmarks/soak.py's pure parts (the plan, the /metrics summary, the tally); no server."""

from __future__ import annotations

import json
import math

from benchmarks.soak import (BAD_OVERRIDES, BUDGETS, MOMENT_BUDGETS, POLICIES, _tally, abort_after, make_plan,
                             stock_plan, summarise_metrics)

VALID_VALUES = {"kv_policy": set(POLICIES), "kv_budget": set(BUDGETS), "kv_decode_interval": {0, 32, 64, 128},
                "kv_recent_window": {16, 32}, "kv_sink_tokens": {2, 4}, "kv_observation_window": {16, 32},
                "kv_moment_correction": {True, False}, "foo": {1}}


def test_plan_is_deterministic_and_seed_dependent():
    assert make_plan(200, 3) == make_plan(200, 3)
    assert make_plan(200, 3) != make_plan(200, 4)
    assert json.loads(json.dumps(make_plan(50, 0))) == make_plan(50, 0)  # plain JSON


def test_plan_shares_and_lengths():
    n = 500
    plan = make_plan(n, 0, invalid_share=0.1, cancel_share=0.15, abort_share=0.2, min_len=5, max_len=2000,
                     max_tokens=(8, 48))
    assert [s["i"] for s in plan] == list(range(n))
    share = {k: sum(s["kind"] == k for s in plan) / n for k in ("invalid", "stream_cancel", "abort", "valid")}
    for k, want in (("invalid", 0.1), ("stream_cancel", 0.15), ("abort", 0.2), ("valid", 0.55)):
        assert abs(share[k] - want) <= 0.06, (k, share)
    lens = [s["prompt_len"] for s in plan]
    assert min(lens) >= 5 and max(lens) <= 2000
    assert sorted(lens)[n // 2] < 300 and max(lens) > 1000  # log-uniform: mostly short, some long
    assert all(8 <= s["max_tokens"] <= 48 for s in plan)
    assert all(s["stream"] == (s["kind"] == "stream_cancel") for s in plan)
    assert all(0.3 <= abort_after(s) <= 1.0 for s in plan if s["kind"] == "abort")


def test_valid_requests_only_carry_valid_overrides():
    for moments in ("random", True, False):
        plan = make_plan(500, 1, moments=moments)
        seen_moments = set()
        for s in plan:
            if s["kind"] == "invalid":
                continue
            x = s["xargs"]
            assert s["expect_field"] is None and "kv_transfer_params" not in x
            for k, v in x.items():
                if k == "kv_context_len":
                    assert v in {1, max(1, s["prompt_len"] // 2), s["prompt_len"]}
                else:
                    assert v in VALID_VALUES[k], (k, v)
                    assert type(v) is type(next(iter(VALID_VALUES[k]))) or k == "kv_moment_correction"
            mc = x.get("kv_moment_correction")
            assert mc is None or isinstance(mc, bool)
            seen_moments.add(mc)
            if mc is True:
                assert x["kv_budget"] in MOMENT_BUDGETS and x["kv_budget"] >= 128
            elif mc is None and x.get("kv_policy") == "moment":  # the preset turns moments on itself
                assert x.get("kv_budget", 128) >= 128, x
            elif "kv_budget" in x:
                assert x["kv_budget"] >= 64
        if moments is True:
            assert seen_moments == {True}
        elif moments is False:
            assert seen_moments == {None}
        else:
            assert seen_moments == {None, True, False}


def test_invalid_requests_carry_one_bad_override():
    bad = [(o, f) for o, f in BAD_OVERRIDES]
    plan = make_plan(500, 2, invalid_share=0.3)
    invalid = [s for s in plan if s["kind"] == "invalid"]
    assert invalid
    for s in invalid:
        assert (s["xargs"], s["expect_field"]) in bad
        assert s["expect_field"] in s["xargs"]
    assert len({json.dumps(s["xargs"], sort_keys=True) for s in invalid}) == len(BAD_OVERRIDES)


def test_stock_plan_drops_xargs_and_invalid_kind():
    plan = make_plan(100, 0, invalid_share=0.2, abort_share=0.1)
    sp = stock_plan(plan)
    assert all(s["xargs"] == {} and s["kind"] != "invalid" and s["expect_field"] is None for s in sp)
    assert [s["prompt_len"] for s in sp] == [s["prompt_len"] for s in plan]
    assert sum(s["kind"] == "abort" for s in sp) == sum(s["kind"] == "abort" for s in plan)


METRICS = '''# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0125
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 3.0
vllm:num_preemptions_created{engine="0",model_name="smollm2"} 1.76e+09
vllm:contour_freed_blocks_total{engine="0",model_name="smollm2"} 412.0
vllm:contour_freed_blocks_created{engine="0",model_name="smollm2"} 1.76e+09
vllm:contour_eviction_failures_total{engine="0",model_name="smollm2",reason="plan"} 4.0
vllm:contour_eviction_failures_total{engine="0",model_name="smollm2",reason="apply"} 2.0
vllm:contour_round_seconds_bucket{engine="0",le="0.01",model_name="smollm2"} 5.0
vllm:contour_round_seconds_bucket{engine="0",le="+Inf",model_name="smollm2"} 9.0
vllm:contour_round_seconds_count{engine="0",model_name="smollm2"} 9.0
vllm:contour_round_seconds_sum{engine="0",model_name="smollm2"} 0.25
vllm:contour_ops_info{engine="0",impl="cpp",model_name="smollm2",op="compact"} 1.0
'''


def test_summarise_metrics():
    m = summarise_metrics(METRICS)
    assert m["running"] == 0 and m["waiting"] == 0 and m["kv_usage"] == 0.0125 and m["preemptions"] == 3
    assert m["failures_by_reason"] == {"plan": 4.0, "apply": 2.0}
    assert m["contour"] == {"vllm:contour_freed_blocks_total": 412.0, "vllm:contour_eviction_failures_total": 6.0,
                            "vllm:contour_round_seconds_count": 9.0, "vllm:contour_round_seconds_sum": 0.25,
                            "vllm:contour_ops_info": 1.0}
    empty = summarise_metrics("")
    assert math.isnan(empty["running"]) and empty["contour"] == {} and empty["failures_by_reason"] == {}


def test_idle_needs_vllms_free_queue_empty_of_request_blocks():
    """kv_usage reads the plugin's patched free count (blocks only shared compressed contexts hold count as
    free); the idle check also needs the plugin's gauge of vLLM's own free queue at 0 (NaN: no plugin)."""
    from benchmarks.soak import _idle

    idle = METRICS.replace("0.0125", "0.0")
    gauge = 'vllm:contour_pool_request_blocks{engine="0",model_name="smollm2"} %s\n'
    assert math.isnan(summarise_metrics(idle)["request_blocks"]) and _idle(summarise_metrics(idle))
    assert summarise_metrics(idle + gauge % "0.0")["request_blocks"] == 0 and _idle(summarise_metrics(idle + gauge % "0.0"))
    leaked = summarise_metrics(idle + gauge % "3.0")
    assert leaked["kv_usage"] == 0 and leaked["request_blocks"] == 3 and not _idle(leaked)


def test_tally_classifies_outcomes():
    plan = [{"i": 0, "kind": "valid", "max_tokens": 4, "expect_field": None, "xargs": {}},
            {"i": 1, "kind": "valid", "max_tokens": 4, "expect_field": None, "xargs": {}},
            {"i": 2, "kind": "invalid", "max_tokens": 4, "expect_field": "kv_budget", "xargs": {"kv_budget": 0}},
            {"i": 3, "kind": "invalid", "max_tokens": 4, "expect_field": "kv_policy", "xargs": {"kv_policy": "x"}},
            {"i": 4, "kind": "stream_cancel", "max_tokens": 4, "expect_field": None, "xargs": {}},
            {"i": 5, "kind": "abort", "max_tokens": 4, "expect_field": None, "xargs": {}}]
    body = lambda n, fr: json.dumps({"usage": {"completion_tokens": n}, "choices": [{"finish_reason": fr}]})  # noqa
    out = {0: {"code": 200, "text": body(4, "length"), "chunks": 0, "timed_out": False, "seconds": 1.5},
           1: {"code": 200, "text": body(3, "stop"), "chunks": 0, "timed_out": False, "seconds": 1.0},
           2: {"code": 400, "text": '{"error": "kv_budget must be >= 1"}', "chunks": 0, "timed_out": False},
           3: {"code": 200, "text": body(4, "length"), "chunks": 0, "timed_out": False},
           4: {"code": 200, "text": "data: {}", "chunks": 2, "timed_out": False},
           5: {"code": None, "text": "", "chunks": 0, "timed_out": True}}
    r = _tally(plan, out, 2.0)
    assert r["ok"] == 1 and r["latencies"] == [1.5] and r["p50_s"] == 1.5
    assert [v[0] for v in r["valid_failed"]] == [1] and [v[0] for v in r["invalid_wrong"]] == [3]
    assert r["invalid_ok"] == 1 and r["http_400"] == {"invalid": 1}
    assert r["stream_cancelled"] == 1 and r["aborted"] == 1 and len(r["errors"]) == 2
