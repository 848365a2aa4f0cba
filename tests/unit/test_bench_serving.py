"""Fast checks of the pure helpers of benchmarks/serving.py on hand-made inputs (no servers, no vLLM)."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.serving import (active_window, bench_argv, counter_deltas, eviction_overhead, kv_held_summary,
                                latency_summary, markdown_table, stock_kv_tokens_est,
                                max_model_len_for, metric, metric_totals, parse_prometheus, percentile,
                                ratio_table, request_latencies, serve_flags, timeline_summary,
                                kv_configs, fp8_ratios)

METRICS_TEXT = r'''# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.8125
# TYPE vllm:contour_freed_blocks counter
vllm:contour_freed_blocks_total{engine="0",model_name="smollm2"} 412.0
vllm:contour_freed_blocks_created{engine="0",model_name="smollm2"} 1.7645e+09
vllm:contour_policy_seconds_total{engine="0",model_name="smollm2"} 1.25
vllm:weird{engine="0",note="a, b} \"q\" c",model_name="smollm2"} 3
vllm:request_success_total{engine="0",finished_reason="stop",model_name="smollm2"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="smollm2"} 5.0
process_open_fds 12
python_info{implementation="CPython",major="3"} 1.0
vllm:nan_gauge NaN
vllm:ts_sample 4.5 1700000000000
'''


def test_parse_prometheus_labels_and_values():
    samples = parse_prometheus(METRICS_TEXT)
    by = {(n, tuple(sorted(l.items()))): v for n, l, v in samples}
    assert by[("vllm:num_requests_running", (("engine", "0"), ("model_name", "smollm2")))] == 7.0
    weird = [l for n, l, _ in samples if n == "vllm:weird"][0]
    assert weird["note"] == 'a, b} "q" c' and weird["model_name"] == "smollm2"
    assert [v for n, _, v in samples if n == "process_open_fds"] == [12.0]
    assert [v for n, _, v in samples if n == "vllm:ts_sample"] == [4.5]  # timestamp ignored
    assert math.isnan([v for n, _, v in samples if n == "vllm:nan_gauge"][0])
    assert not any(n.startswith("#") for n, _, _ in samples)


def test_metric_totals_sum_labels_and_total_suffix():
    t = metric_totals(METRICS_TEXT)
    assert t["vllm:request_success_total"] == 7.0
    assert metric(t, "vllm:request_success") == 7.0  # registered name, exported with _total
    assert metric(t, "vllm:contour_freed_blocks") == 412.0  # not the _created sample
    assert metric(t, "vllm:kv_cache_usage_perc") == 0.8125
    assert metric(t, "vllm:contour_compact_seconds") is None
    assert metric(t, "vllm:contour_compact_seconds", 0.0) == 0.0


def test_counter_deltas():
    before = metric_totals("vllm:contour_freed_blocks_total 10\nvllm:num_preemptions_total 1\n")
    after = metric_totals("vllm:contour_freed_blocks_total 52\nvllm:num_preemptions_total 1\n"
                          "vllm:contour_evicted_requests_total 4\n")
    d = counter_deltas(before, after, ["vllm:contour_freed_blocks", "vllm:num_preemptions",
                                       "vllm:contour_evicted_requests", "vllm:missing"])
    assert d == {"vllm:contour_freed_blocks": 42.0, "vllm:num_preemptions": 0.0,
                 "vllm:contour_evicted_requests": 4.0, "vllm:missing": 0.0}


def test_percentile_matches_linear_interpolation():
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile(range(101), 99) == pytest.approx(99.0)
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1, 2], 101)
    np = pytest.importorskip("numpy")
    rnd = random.Random(0)
    xs = [rnd.random() for _ in range(37)]
    for q in (1, 25, 50, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_request_latencies_and_summary_skip_failures():
    res = {"ttfts": [1.0, 2.0, 0.0, 3.0], "latencies": [11.0, 2.0, 0.0, 3.0 + 0.5 * 63],
           "output_lens": [11, 1, 0, 64], "errors": ["", "", "boom", ""]}
    lat = request_latencies(res)
    assert lat["ttft"] == [1.0, 2.0, 3.0]
    assert lat["tpot"] == pytest.approx([1.0, 0.5])  # the 1-token request has no TPOT
    s = latency_summary(res)
    assert s["ttft_p50_ms"] == pytest.approx(2000.0)
    assert s["tpot_p50_ms"] == pytest.approx(750.0)
    assert s["ttft_sum_s"] == pytest.approx(6.0)


def test_timeline_summary_time_weighted():
    samples = [{"t": 0.0, "running": 2, "kv_usage": 0.5}, {"t": 1.0, "running": 6, "kv_usage": 0.9},
               {"t": 4.0, "running": 0, "kv_usage": 0.0}]
    s = timeline_summary(samples)
    assert s["peak_running"] == 6 and s["peak_kv_usage"] == 0.9
    assert s["mean_running"] == pytest.approx((2 * 1 + 6 * 3) / 4)
    assert s["mean_kv_usage"] == pytest.approx((0.5 + 0.9 * 3) / 4)
    assert math.isnan(timeline_summary([])["peak_running"])
    assert timeline_summary([{"t": 3.0, "running": 4, "kv_usage": 0.2}])["mean_running"] == 4
    assert math.isnan(s["mean_loadavg"])
    loaded = [dict(x, load1=l) for x, l in zip(samples, (1.0, 2.0, 6.0))]
    assert timeline_summary(loaded)["mean_loadavg"] == pytest.approx(3.0)


def test_ratio_table_pairs_by_pool_and_length():
    rows = [
        {"config": "stock", "pool": 160, "output_len": 64, "output_throughput": 10.0, "peak_running": 2},
        {"config": "stock", "pool": 160, "output_len": 256, "output_throughput": 20.0, "peak_running": 2},
        {"config": "snapkv", "pool": 160, "output_len": 64, "output_throughput": 12.0, "peak_running": 8},
        {"config": "snapkv", "pool": 160, "output_len": 256, "output_throughput": 50.0, "peak_running": 0},
        {"config": "snapkv", "pool": 320, "output_len": 64, "output_throughput": 99.0, "peak_running": 9},
        {"config": "stock", "pool": 320, "output_len": 512, "output_throughput": 0.0, "peak_running": 0},
        {"config": "contour", "pool": 320, "output_len": 512, "output_throughput": 5.0, "peak_running": 3},
    ]
    t = ratio_table(rows, metrics=("output_throughput", "peak_running"))
    got = {(r["config"], r["pool"], r["output_len"]): r for r in t}
    assert set(got) == {("snapkv", 160, 64), ("snapkv", 160, 256), ("contour", 320, 512)}  # no stock for 320/64
    assert got[("snapkv", 160, 64)]["output_throughput"] == pytest.approx(1.2)
    assert got[("snapkv", 160, 64)]["peak_running"] == pytest.approx(4.0)
    assert got[("snapkv", 160, 256)]["output_throughput"] == pytest.approx(2.5)
    assert got[("contour", 320, 512)]["output_throughput"] is None  # baseline 0
    off = ratio_table([{"config": "stock", "pool": 160, "x": 4.0}, {"config": "snapkv", "pool": 160, "x": 6.0}],
                      metrics=("x", "missing"), keys=("pool",))
    assert off == [{"config": "snapkv", "pool": 160, "x": 1.5, "missing": None}]


def test_ratio_table_pairs_by_arrival_rate_and_rates_parse():
    from benchmarks.serving import parse_args

    inf = float("inf")
    rows = [{"config": c, "pool": 160, "output_len": 64, "request_rate": r, "x": x}
            for c, r, x in (("stock", inf, 2.0), ("stock", 0.05, 4.0), ("snapkv", inf, 3.0), ("snapkv", 0.05, 5.0))]
    got = {r["request_rate"]: r["x"] for r in ratio_table(rows, metrics=("x",))}
    assert got == {inf: pytest.approx(1.5), 0.05: pytest.approx(1.25)}
    assert parse_args(["--quick"]).request_rate == [inf]
    assert parse_args(["--quick", "--request-rate", "0.05", "inf"]).request_rate == [0.05, inf]


def test_eviction_overhead_and_kv_held():
    d = {"policy_seconds": 0.3, "compact_seconds": 0.1, "rounds": 8.0, "evicted_requests": 4.0,
         "later_round_seconds": 0.12, "request_mean_kv_tokens_sum": 600.0, "request_mean_kv_tokens_count": 4.0,
         "request_peak_kv_tokens_sum": 768.0, "request_peak_kv_tokens_count": 4.0}
    o = eviction_overhead(d, wall_s=20.0, ttft_sum_s=80.0)
    assert o["eviction_seconds"] == pytest.approx(0.4)
    assert o["ms_per_round"] == pytest.approx(50.0) and o["rounds_per_request"] == pytest.approx(2.0)
    assert o["overhead_pct_of_wall"] == pytest.approx(2.0)
    assert o["overhead_pct_of_ttft_sum"] == pytest.approx(0.5)
    assert o["policy_ms_per_request"] == pytest.approx(75.0)
    assert o["compact_ms_per_request"] == pytest.approx(25.0)
    assert o["later_rounds"] == 4.0 and o["later_round_ms"] == pytest.approx(30.0)  # 8 rounds, 4 of them first
    assert o["later_round_pct_of_wall"] == pytest.approx(0.6)
    empty = eviction_overhead({}, None, None)
    assert empty["overhead_pct_of_wall"] is None and empty["policy_ms_per_request"] is None
    assert kv_held_summary(d) == {"mean_kv_tokens": 150.0, "peak_kv_tokens": 192.0}
    assert kv_held_summary({}) == {"mean_kv_tokens": None, "peak_kv_tokens": None}
    est = stock_kv_tokens_est(64, 3, 32)  # 65, 66, 67 tokens -> 96 each
    assert est == {"mean_kv_tokens": 96.0, "peak_kv_tokens": 96.0}


def test_markdown_table_and_flags():
    md = markdown_table([{"a": 1.234, "b": None, "c": float("nan")}], [("a", "A"), ("b", "B"), ("c", "C")])
    assert md.splitlines() == ["| A | B | C |", "|---|---|---|", "| 1.23 | - | - |"]
    assert max_model_len_for(2000, [64, 512], 32) == 2592
    stock = serve_flags(pool=160, block_size=32, max_model_len=2592, policy=None, budget=128)
    assert "--kv-eviction-policy" not in stock and "--num-gpu-blocks-override" in stock
    ev = serve_flags(pool=160, block_size=32, max_model_len=2592, policy="snapkv", budget=128)
    assert ev[-4:] == ["--kv-eviction-policy", "snapkv", "--kv-budget", "128"]
    argv = bench_argv(base_url="http://h:1", model_dir="/m", input_len=2000, output_len=64, num_prompts=8,
                      max_concurrency=8, request_rate=float("inf"), seed=0, result_dir="/r",
                      result_filename="x.json", label="stock")
    assert argv[:2] == ["bench", "serve"] and "--ignore-eos" in argv
    assert argv[argv.index("--request-rate") + 1] == "inf"
    assert argv[argv.index("--max-concurrency") + 1] == "8"


def test_active_window_trims_idle_edges_and_rebases_time():
    idle = lambda t: {"t": t, "running": 0, "waiting": 0, "kv_usage": 0.0}
    busy = lambda t, r, w=0: {"t": t, "running": r, "waiting": w, "kv_usage": 0.5}
    samples = [idle(0.0), idle(0.5), busy(1.0, 0, 3), busy(1.5, 2), idle(2.0), busy(2.5, 1), idle(3.0), idle(3.5)]
    w = active_window(samples)
    assert [s["t"] for s in w] == [0.0, 0.5, 1.0, 1.5, 2.0]  # from the first waiting request to the first idle after
    assert w[0]["waiting"] == 3 and w[-1]["running"] == 0
    assert active_window([idle(0.0), idle(1.0)]) == []
    assert [s["t"] for s in active_window([busy(4.0, 1)])] == [0.0]


LSCPU = """Architecture:            x86_64
Model name:              Intel(R) Xeon(R) Processor
Flags:                   fpu sse2 avx2 avx512f avx512bw avx_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_parse_lscpu_names_the_cpu_and_the_flags_that_pick_kernels_and_dtype():
    from benchmarks.serving import MACHINE_FLAGS, machine, parse_lscpu

    got = parse_lscpu(LSCPU)
    assert got == {"cpu_model": "Intel(R) Xeon(R) Processor",
                   "flags": {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True}}
    epyc = parse_lscpu("model name\t: AMD EPYC 7B13\nflags\t\t: sse2 avx2 avx512_vnni\n")  # /proc/cpuinfo
    assert epyc["cpu_model"] == "AMD EPYC 7B13" and [f for f, on in epyc["flags"].items() if on] == ["avx2"]
    assert parse_lscpu("") == {"cpu_model": None, "flags": {f: False for f in MACHINE_FLAGS}}
    here = machine()
    assert set(here) == {"cpu_model", "flags", "cpus", "loadavg"} and len(here["loadavg"]) == 3


def _run(config, pool, L, out_tok, mean, t0=0.0):
    tl = [{"t": t0 + i, "running": r, "kv_usage": u} for i, (r, u) in enumerate([(1, 0.1), (mean, 0.5), (0, 0.0)])]
    return {"config": config, "pool": pool, "output_len": L, "request_rate": "inf", "output_throughput": out_tok,
            "peak_running": mean, "mean_running": mean, "timeline": tl}


def test_plot_panels_draw_a_sweep_only_where_the_run_has_several_points():
    from benchmarks.serving import plot_panels

    one = {"runs": [_run("stock", 160, 512, 10.0, 2), _run("snapkv", 160, 512, 40.0, 16)]}
    one["ratios"] = ratio_table(one["runs"], metrics=("output_throughput",))
    assert [k for k, _ in plot_panels(one)] == ["timeline", "timeline"]  # one point: no line through it
    assert plot_panels(one)[1][1] == "KV blocks held, pool 160, 512 out"
    pools = {"runs": one["runs"] + [_run("stock", 320, 512, 20.0, 4), _run("snapkv", 320, 512, 45.0, 16)]}
    kinds = [k for k, _ in plot_panels(pools)]
    assert kinds == ["sweep", "sweep"] + ["timeline"] * 4
    assert plot_panels(pools)[0][1] == "eviction / stock output tok/s against KV pool (blocks)"
    lengths = {"runs": one["runs"] + [_run("stock", 160, 64, 5.0, 2), _run("snapkv", 160, 64, 6.0, 8)]}
    assert plot_panels(lengths)[1][1] == "running requests against output tokens per request"
    assert plot_panels({"runs": [dict(r, timeline=[]) for r in one["runs"]]}) == []


def test_plot_record_writes_the_panels(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.serving import plot_panels, plot_record

    runs = [_run("stock", 160, 512, 10.0, 2), _run("snapkv", 160, 512, 40.0, 16),
            _run("stock", 320, 512, 20.0, 4), _run("snapkv", 320, 512, 45.0, 16)]
    rec = {"runs": runs, "ratios": ratio_table(runs, metrics=("output_throughput", "peak_running")),
           "offline": [{"config": "stock", "pool": 160, "timeline": runs[0]["timeline"]}]}
    png = tmp_path / "s.png"
    assert plot_record(rec, png) == plot_panels(rec) and png.stat().st_size > 0
    assert plot_panels(rec)[-1] == ("timeline", "KV blocks held, offline LLM.generate")


def test_fp8_configurations_get_the_same_bytes_and_pair_their_ratios():
    """--kv-cache-dtypes auto fp8 under bf16: four servers, the fp8 ones with twice the blocks (one byte per
    element) and --kv-cache-dtype fp8; the fp8 eviction run is compared with eviction on bf16 pages and with
    stock on fp8 pages at the same pool."""
    cfgs = kv_configs(["snapkv"], ["auto", "fp8"], "bfloat16")
    assert [(c["name"], c["policy"], c["kv_cache_dtype"], c["blocks_factor"]) for c in cfgs] == [
        ("stock", None, "auto", 1), ("snapkv", "snapkv", "auto", 1), ("stock_fp8", None, "fp8", 2),
        ("snapkv_fp8", "snapkv", "fp8", 2)]
    assert kv_configs(["snapkv"], ["fp8"], "float32")[0]["blocks_factor"] == 4
    flags = serve_flags(pool=320, block_size=32, max_model_len=2592, policy=None, budget=128, dtype="bfloat16",
                        kv_cache_dtype="fp8")
    assert flags[flags.index("--kv-cache-dtype") + 1] == "fp8" and flags[flags.index("--num-gpu-blocks-override") + 1] == "320"
    assert "--kv-cache-dtype" not in serve_flags(pool=160, block_size=32, max_model_len=2592, policy=None, budget=128)
    rows = [{"config": c, "policy": p, "pool": 160, "output_len": 512, "request_rate": float("inf"), "x": x}
            for c, p, x in (("stock", None, 1.0), ("snapkv", "snapkv", 3.0), ("stock_fp8", None, 2.0),
                            ("snapkv_fp8", "snapkv", 6.0))]
    got = {(r["config"], r["baseline"]): r["x"] for r in fp8_ratios(rows, metrics=("x",))}
    assert got == {("snapkv_fp8", "snapkv"): 2.0, ("snapkv_fp8", "stock_fp8"): 3.0}
    assert {r["config"]: r["x"] for r in ratio_table(rows, metrics=("x",))} == {"snapkv": 3.0, "stock_fp8": 2.0,
                                                                               "snapkv_fp8": 6.0}
