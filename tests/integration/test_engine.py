"""vLLM offline engine on the real default model (SmolLM2-135M-Instruct): stock vs plugin."""

import math

import pytest


def test_plugin_off_is_stock(stock, plugin_off):
    # Same greedy tokens for 8 prompts of different lengths, same pool size, same free-block trajectory.
    assert plugin_off["greedy"] == stock["greedy"]
    assert plugin_off["num_gpu_blocks"] == stock["num_gpu_blocks"]
    assert plugin_off["greedy_free_trace"] == stock["greedy_free_trace"]
    assert plugin_off["connector"] is None
    assert "vllm-contour plugin registered" in plugin_off["log"]
    assert "vllm-contour plugin registered" not in stock["log"]


def test_budget_above_prompt_gives_stock_tokens(stock, evicting):
    assert evicting["connector"] == "ContourKVConnector"
    assert evicting["greedy"] == stock["greedy"]


def _held(case):
    """Blocks vLLM's pool handed to the request right after its prefill step."""
    return case["free_before"] - case["free_trace"][0]


def test_free_blocks_rise_by_the_layout_prediction(stock, evicting):
    s = stock["free_blocks"][0]
    bs = s["block_size"]
    for case in evicting["free_blocks"]:
        lay = case["layout"]
        assert lay is not None, "request was not compacted"
        n = case["prompt_tokens"]
        assert lay["E"] == n // bs
        stock_held = math.ceil(n / bs)
        # vLLM's own pool: held blocks after the prefill step = stock - (E - K)
        assert _held(case) == stock_held - (lay["E"] - lay["K"])
        assert case["free_end"] == case["free_before"]  # all returned when the request ends
    assert _held(s) == math.ceil(2000 / bs)


def test_layout_is_ragged_and_sums_over_heads(evicting):
    case = evicting["free_blocks"][0]  # snapkv (AdaKV allocation)
    pages = case["layout"]["pages"]
    h = len(pages[0])
    assert any(len(set(layer)) > 1 for layer in pages), "no layer gives its heads different budgets"
    k = max(math.ceil(sum(layer) / h) for layer in pages)
    assert case["layout"]["K"] == k
    # budget 128 tokens per head: per layer at most 3 heads x 128 tokens
    bs = case["block_size"]
    assert all(sum(layer) * bs <= 128 * h for layer in pages)
    streaming = evicting["free_blocks"][1]["layout"]["pages"]
    assert all(max(layer) - min(layer) <= 1 for layer in streaming)  # uniform allocation (remainder 1)
    bigger = evicting["free_blocks"][2]["layout"]
    assert sum(map(sum, bigger["pages"])) > sum(map(sum, pages))  # per-request kv_budget=256


def test_more_requests_run_at_once_with_eviction(stock, evicting):
    s, e = stock["concurrency"], evicting["concurrency"]
    assert s["num_blocks"] == e["num_blocks"]
    assert s["finished"] == s["requests"] and e["finished"] == e["requests"]
    assert e["max_running"] > s["max_running"]
    assert e["free_end"] == e["num_blocks"] - 1 and s["free_end"] == s["num_blocks"] - 1


def test_preemption_and_aborts_leave_nothing_behind(evicting):
    pa = evicting["preempt_abort"]
    assert pa["preemptions"] > 0, "the scenario did not force a preemption"
    assert pa["free_end"] == pa["num_blocks"] - 1  # only the null block is not free
    assert pa["requests_left"] == 0 and pa["manager_reqs_left"] == 0
    assert pa["worker_compacted_left"] == [] and pa["worker_captures_left"] == []


def test_every_preset_runs_query_aware_and_agnostic_and_with_moments(evicting):
    from vllm_contour.policies import policy_names

    presets = evicting["presets"]
    for name in policy_names():
        for label in (name, name + "/agnostic"):
            assert presets[label] is not None and len(presets[label]) == 6, label
    assert presets["snapkv/moments"] is not None and presets["knorm/moments"] is not None
    assert evicting["presets_evicted"] >= len(presets)


def test_fast_ops_give_the_torch_reference_greedy_tokens(evicting, evicting_torch_ops):
    """Real eviction at 64 tokens per head, moment correction off and on: the default implementations
    (C++ compaction, moment accumulation and ragged decode) produce exactly the greedy tokens of the torch
    reference ops."""
    fast, ref = evicting["greedy_evicted_calls"], evicting_torch_ops["greedy_evicted_calls"]
    assert fast.get("compact:cpp", 0) > 0 and fast.get("accumulate_moments:cpp", 0) > 0, fast
    assert fast.get("ragged_decode_attention:cpp", 0) > 0, fast
    assert not any(k.endswith(":torch") for k in fast), fast
    assert set(ref) == {"compact:torch", "accumulate_moments:torch", "ragged_decode_attention:torch"}, ref
    out = evicting["greedy_evicted"]
    assert all(v and len(v) == 24 for v in out.values()), out
    assert out == evicting_torch_ops["greedy_evicted"]
