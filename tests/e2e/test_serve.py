"""`vllm-contour serve` end to end over HTTP (one server for the whole module)."""

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


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_contour.models import fetch_model

    model = str(fetch_model("smollm2", quiet=True))
    port = _port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    cmd = [str(BIN / "vllm-contour"), "serve", model, "--served-model-name", "smollm2", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
           "--kv-eviction-policy", "snapkv", "--kv-budget", "128"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=2).read()
                break
            except Exception:
                if proc.poll() is not None or time.time() - t0 > 900:
                    raise RuntimeError("server did not start:\n" + log.read_text()[-5000:])
                time.sleep(1)
        yield base, log, proc.pid
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


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
    text = log.read_text()
    assert "kv_eviction:" in text and "freed" in text


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
                                         ({"kv_buget": 5}, "kv_buget")])
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
                 "--kv-moment-correction", "snapkv",
                 "streaming"):
        assert word in text, text[-2000:]
