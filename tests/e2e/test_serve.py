"""`vllm-contour serve` end to end over HTTP.

Three servers for the module (and a short-lived ``knorm`` one): ``server`` (snapkv, 128 tokens per head, decode-time rounds, and the TEST-ONLY
fault switch making some rounds fail while planning or after the first layer moved) carries the functional
tests and a soak; ``plain_server`` (the same without the fault switch) the per-request keys and what each did;
``moment_server`` (server-wide ``--kv-moment-correction``) carries a second soak."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _post(url, body, timeout=300):
    """POST a JSON body; a request with no answer within ``timeout`` fails the test naming the request and
    what the server says it holds (vLLM's running / waiting gauges), not after the suite's own limit."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (TimeoutError, urllib.error.URLError) as e:
        what = {k: body[k] for k in ("max_tokens", "vllm_xargs") if k in body}
        raise AssertionError(f"no answer within {timeout} s to {url} {what} ({e}); server: "
                             f"{_server_state(url.split('/v1/')[0])}") from None


def _server_state(base: str) -> str:
    try:
        text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    except Exception as e:
        return f"/metrics unreachable ({e})"
    keep = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:contour_eviction_failures_total")
    return "; ".join(line for line in text.splitlines() if line.startswith(keep))


def _start(tmp_path_factory, name: str, flags: list[str], extra_env: dict | None = None):
    from vllm_contour.models import fetch_model

    model = str(fetch_model("smollm2", quiet=True))
    port = _port()
    log = tmp_path_factory.mktemp(name) / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0", **(extra_env or {}))
    cmd = [str(BIN / "vllm-contour"), "serve", model, "--served-model-name", "smollm2", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", *flags]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        try:
            urllib.request.urlopen(base + "/v1/models", timeout=2).read()
            return base, log, proc
        except Exception:
            if proc.poll() is not None or time.time() - t0 > 900:
                os.killpg(proc.pid, 9)
                raise RuntimeError("server did not start:\n" + log.read_text()[-5000:])
            time.sleep(1)


def _stop(proc):
    os.killpg(proc.pid, 15)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)


FAULTS = "plan=0.15,apply=0.15,seed=1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base, log, proc = _start(tmp_path_factory, "serve", ["--kv-eviction-policy", "snapkv", "--kv-budget", "128"],
                             {"VLLM_CONTOUR_FAULTS": FAULTS})
    try:
        yield base, log, proc.pid
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    base, log, proc = _start(tmp_path_factory, "serve_plain", ["--kv-eviction-policy", "snapkv", "--kv-budget", "128",
                                                              "--max-num-seqs", "1024"])
    try:
        yield base, log, proc.pid
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def moment_server(tmp_path_factory):
    base, log, proc = _start(tmp_path_factory, "serve_moments",
                             ["--kv-eviction-policy", "snapkv", "--kv-budget", "128", "--kv-moment-correction",
                              "--enable-prompt-tokens-details", "--max-num-seqs", "256"])
    try:
        yield base, log, proc
    finally:
        _stop(proc)


def _metrics(base) -> str:
    return urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()


def _gauge(base, name: str) -> float:
    from benchmarks.serving import parse_prometheus

    return next(v for n, _, v in parse_prometheus(_metrics(base)) if n == name)


def test_query_bytes_outside_the_pool_do_not_grow_with_max_num_seqs(plain_server, moment_server):
    """A query-aware policy keeps prompt-end windows outside vLLM's pool for one step only, bounded by the step's
    tokens, not by ``--max-num-seqs``: snapkv at 1,024 (vLLM's GPU default) and at 256 both start and report the
    same bound (the query-free policies' 0: ``tests/unit/test_query_pages.py``)."""
    for other in (plain_server[0], moment_server[0]):  # a worker's gauges reach /metrics with its first step
        code, _ = _post(other + "/v1/completions", {"model": "smollm2", "prompt": "Hello", "max_tokens": 2,
                                                     "temperature": 0})
        assert code == 200
    at_1024 = _gauge(plain_server[0], "vllm:contour_query_buffer_bound_bytes")
    at_256 = _gauge(moment_server[0], "vllm:contour_query_buffer_bound_bytes")
    # SmolLM2: 30 layers x 2,048 batched tokens (vLLM's CPU server default) x 9 query heads x 64 x fp32
    assert at_1024 == at_256 == 30 * 2048 * 9 * 64 * 4


def _story(n):
    return " ".join(f"Entry {i}: the keeper wrote that the lamp burned {i % 5} hours." for i in range(n))


def test_completion_and_chat_with_eviction(server):
    base, log, _ = server
    code, out = _post(base + "/v1/completions", {"model": "smollm2", "prompt": _story(80) + "\nSummary:",
                                                 "max_tokens": 16, "temperature": 0})
    assert code == 200 and out["usage"]["prompt_tokens"] > 500
    assert out["choices"][0]["text"].strip()
    code, out = _post(base + "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": _story(60) + "\nWhat does the keeper do?"}]})
    assert code == 200 and out["choices"][0]["message"]["content"].strip()
    from benchmarks.soak import summarise_metrics

    # This server's fault switch fails ~28 % of the rounds (by a hash of vLLM's random request id), so both
    # requests may have been served uncompressed; a few more long prompts make "no round ever freed a
    # block" a real failure (chance it happens by the faults alone: 0.28 ** 10, about 3e-6).
    for i in range(8):
        contour = summarise_metrics(_metrics(base))["contour"]
        if contour.get("vllm:contour_freed_blocks_total", 0) > 0:
            break
        code, _ = _post(base + "/v1/completions", {"model": "smollm2", "prompt": _story(70 + i), "max_tokens": 4})
        assert code == 200
    contour = summarise_metrics(_metrics(base))["contour"]
    assert contour.get("vllm:contour_freed_blocks_total", 0) > 0, contour
    assert contour.get("vllm:contour_evicted_requests_total", 0) > 0, contour
    assert "TEST-ONLY fault switch" in log.read_text()


def test_streaming_chat_and_completion(server):
    from openai import OpenAI

    base, _, _ = server
    client = OpenAI(base_url=base + "/v1", api_key="x")
    chunks = list(client.chat.completions.create(
        model="smollm2", stream=True, max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": _story(50) + "\nAnswer briefly: what burned?"}]))
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 2
    chunks = list(client.completions.create(model="smollm2", prompt=_story(50), stream=True, max_tokens=8,
                                            temperature=0, extra_body={"vllm_xargs": {"kv_budget": 64}}))
    assert sum(bool(c.choices and c.choices[0].text) for c in chunks) >= 2


@pytest.mark.parametrize("xargs, word", [({"kv_budget": 0}, "kv_budget"), ({"kv_policy": "nope"}, "kv_policy"),
                                         ({"kv_buget": 5}, "kv_buget"),
                                         ({"kv_budget": 32}, "floor of 64 tokens"),
                                         ({"kv_budget": 96, "kv_moment_correction": True}, "floor of 128 tokens"),
                                         ({"kv_decode_interval": 40}, "kv_decode_interval"),
                                         ({"kv_moment_correction": "maybe"}, "kv_moment_correction"),
                                         ({"kv_policy_args": '{"lamda": 1}'}, "lamda"),
                                         ({"kv_policy": "contour", "kv_policy_args": '{"mix": 3}'}, "allocator.mix")])
def test_bad_request_args_get_400_and_server_survives(server, xargs, word):
    base, _, _ = server
    code, out = _post(base + "/v1/chat/completions", {"model": "smollm2", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}],
                                                      "vllm_xargs": xargs})
    assert code == 400 and word in json.dumps(out)
    code, _ = _post(base + "/v1/completions", {"model": "smollm2", "prompt": "Hello", "max_tokens": 2})
    assert code == 200


def test_plugin_loaded_in_api_server_engine_core_and_worker(server):
    """register() ran in the API server and the engine core (each logs it); the worker either registers
    itself (spawn) or inherits the registration (fork): its connector and backend run there either way. With
    vLLM's single-process executor the worker lives inside the engine-core process (same pid as the
    scheduler-side connector); with a multiprocess executor it is its own process. Never the API server."""
    _, log, api_pid = server
    text = log.read_text().splitlines()
    reg = [l for l in text if "vllm-contour plugin registered" in l]
    assert any("MainProcess" in l or "APIServer" in l for l in reg), reg
    assert any("EngineCore" in l for l in reg), reg
    sched = [l for l in text if "scheduler-side connector ready" in l]
    worker = [l for l in text if "worker-side connector ready" in l]
    assert sched and worker, (sched, worker)
    pid = lambda line: line.split("(pid ")[1].split(")")[0].split(",")[0]  # noqa: E731
    assert str(api_pid) not in {pid(l) for l in worker} | {pid(l) for l in sched}
    eng = {pid(l) for l in reg if "EngineCore" in l}
    assert {pid(l) for l in sched} <= eng  # the scheduler side runs in the engine core


def test_help_lists_flags_and_policies():
    out = subprocess.run([str(BIN / "vllm-contour"), "serve", "--help=KVEviction"],
                         capture_output=True, text=True, timeout=180)
    text = out.stdout + out.stderr
    for word in ("--kv-eviction-policy", "--kv-budget", "--kv-recent-window", "--kv-sink-tokens",
                 "--kv-moment-correction", "--kv-decode-interval", "--kv-observation-window", "snapkv",
                 "streaming"):
        assert word in text, text[-2000:]


# Every documented per-request key, in the JSON form a client sends (booleans as JSON booleans, which vLLM
# hands over as 1 / 0), through real HTTP; vLLM's own kv_transfer_params must not be mistaken for one.
DOCUMENTED = [{"kv_policy": "streaming"}, {"kv_budget": 64}, {"kv_recent_window": 16}, {"kv_sink_tokens": 2},
              {"kv_moment_correction": True, "kv_budget": 128}, {"kv_moment_correction": False},
              {"kv_decode_interval": 32}, {"kv_decode_interval": 0}, {"kv_observation_window": 16},
              {"kv_context_len": 300}, {"kv_policy": "none"},
              {"kv_policy": "contour_diverse", "kv_policy_args": '{"lam": 0.3, "allocator.mix": 0.5}'},
              {"kv_policy": "moment"}]


@pytest.fixture(scope="module")
def documented_replies(plain_server):
    """One request per documented key, all in flight together (the server batches them), on the server without
    the fault switch."""
    from concurrent.futures import ThreadPoolExecutor

    base, log, _ = plain_server
    assert "TEST-ONLY fault switch" not in log.read_text()

    def send(xargs):
        return _post(base + "/v1/completions", {"model": "smollm2", "prompt": _story(60), "max_tokens": 16,
                                                "temperature": 0, "ignore_eos": True, "vllm_xargs": xargs},
                     timeout=900)  # 13 prefills share the cores: generous on a loaded machine

    with ThreadPoolExecutor(len(DOCUMENTED)) as pool:
        return list(pool.map(send, DOCUMENTED))


@pytest.mark.parametrize("i", range(len(DOCUMENTED)),
                         ids=[",".join(f"{k}={v}" for k, v in x.items()) for x in DOCUMENTED])
def test_every_documented_key_over_http(documented_replies, i):
    """Each key had its effect, read from the request's eviction report in the response (``kv_transfer_params``
    ``contour``, the plugin's scheduler): the policy that ran, the blocks it kept (budget // 32) and held in its
    last step (within budget.py's bound), the decode interval, the moment pages (moment correction), the
    context boundary where its first round ran, and the other settings it ran with."""
    from vllm_contour.budget import CacheShape, request_budget
    from vllm_contour.config import EvictionConfig, resolve_request

    xargs = DOCUMENTED[i]
    code, out = documented_replies[i]
    assert code == 200, (xargs, out)
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"
    rep = (out.get("kv_transfer_params") or {}).get("contour")
    if xargs.get("kv_policy") == "none":
        assert rep is None, out  # eviction off: no report
        return
    params = resolve_request(EvictionConfig(policy="snapkv", budget=128), xargs)
    pb = request_budget(params, CacheShape(block_size=32, num_kv_heads=3, head_dim=64, elem_size=4), per_request=True)
    prompt = out["usage"]["prompt_tokens"]
    assert rep["policy"] == xargs.get("kv_policy", "snapkv") and rep["budget"] == xargs.get("kv_budget", 128), rep
    assert not rep["failed"] and rep["rounds"] >= 1, rep
    assert rep["kept_blocks"] == pb.kept_blocks == rep["budget"] // 32, rep  # budget -> blocks kept
    from vllm_contour.budget import query_blocks_for
    from vllm_contour.policies import build_policy

    q = query_blocks_for(params.window, 3, 32, 4, 4) if build_policy(params.policy).needs_queries else 0
    assert rep["last_held_blocks"] <= (pb.held_blocks_bound(rep["decode_interval"], q) if rep["decode_interval"]
                                       else pb.kept_blocks + -(-(prompt + 15 - rep["region_blocks"] * 32) // 32)), rep
    assert rep["decode_interval"] == xargs.get("kv_decode_interval", 64), rep
    assert rep["moment_correction"] == bool(params.moment_correction), rep
    assert (rep["moment_pages"] > 0) == bool(params.moment_correction) and rep["moment_pages"] == pb.moment_pages, rep
    if "kv_context_len" in xargs:  # the boundary: the context is compressed when exactly C tokens have KV
        assert rep["context_len"] == xargs["kv_context_len"] == rep["first_round_at"], rep
    else:
        assert not rep["context_len"] and rep["first_round_at"] == prompt, rep  # at the prompt end
    for key, field in (("kv_recent_window", "recent_window"), ("kv_sink_tokens", "sink_tokens"),
                       ("kv_observation_window", "window")):
        if key in xargs:
            assert rep[field] == xargs[key], (key, rep)
    if "kv_policy_args" in xargs:
        assert rep["policy_args"] == json.loads(xargs["kv_policy_args"]), rep


def test_vllms_own_kv_transfer_params_pass(server):
    base, _, _ = server
    code, out = _post(base + "/v1/completions", {"model": "smollm2", "prompt": "Hello there", "max_tokens": 4,
                                                 "kv_transfer_params": {"note": "not the plugin's"}})
    assert code == 200, out


def _soak(base, seed, moments, n=62):
    from benchmarks.soak import make_plan, run_load, settle

    plan = make_plan(n, seed=seed, max_tokens=(4, 32), invalid_share=0.15, cancel_share=0.1, abort_share=0.05,
                     moments=moments)
    t0 = time.time()
    res = run_load(base, plan, clients=4, timeout=300)
    idle = settle(base, timeout=120)
    return plan, res, idle, time.time() - t0


def _check_soak(plan, res, idle, wall):
    kinds = {k: sum(1 for p in plan if p["kind"] == k) for k in ("valid", "invalid", "stream_cancel", "abort")}
    assert res["valid_failed"] == [] and res["invalid_wrong"] == [], (res["valid_failed"], res["invalid_wrong"])
    assert res["invalid_ok"] == kinds["invalid"]
    assert res["ok"] >= kinds["valid"], res
    assert idle["settled"] and idle["healthy"], idle
    assert idle["running"] == 0 and idle["waiting"] == 0 and idle["kv_usage"] == 0, idle
    # no block leaked, read from vLLM's own free queue (kv_usage counts blocks only shared compressed contexts
    # hold as free): the plugin's gauge of the blocks requests still hold
    assert "vllm:contour_pool_request_blocks" in idle["contour"] and idle["request_blocks"] == 0, idle


def test_soak_mixed_load_with_the_fault_switch(server):
    """>= 60 requests from 4 clients: random prompt lengths (5-2,000 tokens), random per-request policy /
    budget / moments / decode interval / context length, streams cancelled mid-stream, abandoned requests,
    invalid overrides; a share of the rounds fail (fault switch). Every valid request completes, every
    invalid one gets HTTP 400 naming the field, the server is healthy and idle with no block held, and the
    failures are counted by reason."""
    base, log, _ = server
    plan, res, idle, wall = _soak(base, seed=1, moments="random")
    _check_soak(plan, res, idle, wall)
    failures = idle["failures_by_reason"]
    assert failures.get("plan", 0) + failures.get("apply", 0) > 0, failures
    contour = idle["contour"]
    assert contour.get("vllm:contour_rounds_total", 0) > 0, contour
    # every metric the Grafana dashboard (docs/grafana/vllm-contour.json) queries is on this server's /metrics
    from benchmarks.serving import parse_prometheus
    from tests.grafana_dashboard import queried_metrics

    exported = {n for n, _, _ in parse_prometheus(_metrics(base))}
    assert not queried_metrics() - exported, sorted(queried_metrics() - exported)
    assert "Traceback" not in log.read_text()


def test_soak_with_server_wide_moment_correction(moment_server):
    base, log, _ = moment_server
    plan, res, idle, wall = _soak(base, seed=2, moments=True, n=30)
    _check_soak(plan, res, idle, wall)
    assert idle["failures_by_reason"] == {} or sum(idle["failures_by_reason"].values()) == 0, idle
    assert "Traceback" not in log.read_text()


def test_accounting_metrics_in_metrics_endpoint(moment_server):
    """The per-request KV accounting (mean and peak tokens per KV head held in vLLM's pool over the request's
    life) and the round latency are Prometheus histograms on /metrics; which implementation each op uses is
    an info gauge. A request on its own (budget 128 with moments, T 64, 100 prompt + 300 generated tokens)
    ends with a peak within budget + T tokens per head. (This server has no fault switch.)"""
    from benchmarks.serving import parse_prometheus

    base, _, _ = moment_server
    before = {(n, tuple(sorted(lb.items()))): v for n, lb, v in parse_prometheus(_metrics(base))}
    code, _ = _post(base + "/v1/completions", {"model": "smollm2", "prompt": [500 + i for i in range(100)],
                                               "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                                               "vllm_xargs": {"kv_policy": "knorm"}})
    assert code == 200
    samples = parse_prometheus(_metrics(base))
    names = {n for n, _, _ in samples}
    for name in ("vllm:contour_request_mean_kv_tokens_count", "vllm:contour_request_peak_kv_tokens_sum",
                 "vllm:contour_round_seconds_count", "vllm:contour_ops_info", "vllm:contour_query_buffer_bytes"):
        assert name in names, name
    ops = {lb["op"]: lb["impl"] for n, lb, v in samples if n == "vllm:contour_ops_info" and v == 1}
    assert ops.get("compact") == "cpp" and ops.get("ragged_decode_attention") == "cpp", ops

    def delta(name):
        now = sum(v for n, lb, v in samples if n == name)
        was = sum(v for (n, _), v in before.items() if n == name)
        return now - was

    assert delta("vllm:contour_request_peak_kv_tokens_count") == 1
    peak = delta("vllm:contour_request_peak_kv_tokens_sum")
    assert 128 < peak <= 128 + 64 + 32, peak  # it grew past the budget, then rounds held it within


def test_shared_compressed_context_counts_as_cached_tokens(moment_server):
    """Prefix caching is on (vLLM's default): two requests on one 700-token context with kv_context_len (the
    second with another question) -- the second adopts the first's compressed context (moments included),
    and vLLM's usage reports its 700 cached tokens; the plugin's and vLLM's counters count the hit."""
    from benchmarks.serving import parse_prometheus

    base, _, _ = moment_server

    def total(samples, name):
        return sum(v for n, _, v in samples if n == name)

    before = parse_prometheus(_metrics(base))
    doc = [700 + (i * 37) % 5000 for i in range(700)]
    usage = []
    for q in ([11, 12, 13, 14], [21, 22, 23, 24, 25]):
        code, out = _post(base + "/v1/completions", {"model": "smollm2", "prompt": doc + q, "max_tokens": 8,
                                                     "temperature": 0, "vllm_xargs": {"kv_context_len": 700}})
        assert code == 200, out
        usage.append(out["usage"])
    after = parse_prometheus(_metrics(base))
    assert (usage[1].get("prompt_tokens_details") or {}).get("cached_tokens") == 700, usage
    assert total(after, "vllm:contour_shared_context_hits_total") - \
        total(before, "vllm:contour_shared_context_hits_total") == 1
    assert total(after, "vllm:contour_shared_contexts_total") - total(before, "vllm:contour_shared_contexts_total") == 1
    assert total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total") >= 700
    assert total(after, "vllm:contour_shared_context_entries") >= 1
