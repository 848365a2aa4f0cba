"""Soak load: many mixed requests against one ``vllm-contour serve``, then check that nothing leaked.

What it measures. A deterministic plan (``make_plan``) of ``/v1/completions`` requests with random token-id
prompts of log-uniform length (5..2000 tokens: most short, some near 2000), greedy, ``ignore_eos``, mixing

- valid requests with random valid per-request overrides (``vllm_xargs``: ``kv_policy``, ``kv_budget``,
  ``kv_moment_correction``, ``kv_decode_interval``, ``kv_recent_window``, ``kv_sink_tokens``,
  ``kv_observation_window``, ``kv_context_len``, and now and then an unrelated key ``foo`` that must be
  ignored): each must return 200 with exactly ``max_tokens`` tokens and ``finish_reason == "length"``;
- invalid requests, each with ONE bad override: each must get HTTP 400 naming the bad field;
- streams the client closes after 2 chunks, and non-streaming requests the client abandons after
  0.3-1.0 s (the server aborts them when the connection drops).

``run_load`` sends the plan from a few client threads; ``settle`` then waits until the server is idle (no
running or waiting request, KV usage 0, i.e. no leaked block) and reads the plugin's ``vllm:contour_*``
counters, eviction failures by reason and preemptions. The command line does this on an eviction server
(optionally with the test-only fault switch ``VLLM_CONTOUR_FAULTS``, so that some eviction rounds fail and
must fall back cleanly), checks the server process survived, and repeats the same plan on a stock server
(plugin disabled) for a latency baseline.

    python -m benchmarks.soak [--requests 500] [--clients 4] [--faults plan=0.05,apply=0.05] [--no-stock]

Writes ``results/soak/soak.json`` (plus server logs) and prints a markdown summary. As a library (the
end-to-end test starts its own server)::

    from benchmarks.soak import make_plan, run_load, settle
    res = run_load(base_url, make_plan(60, seed=0), clients=4); idle = settle(base_url)
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import queue
import random
import shlex
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path

from benchmarks import md_table, stamp
from benchmarks.serving import (REPO, SERVED_NAME, Server, child_env, http_get, install_cleanup, metric,
                                machine, metric_totals, parse_prometheus, percentile, random_token_prompt,
                                serve_flags)

POLICIES = ("snapkv", "contour", "streaming", "knorm", "h2o", "moment")
BUDGETS = (64, 96, 128, 200, 256, 512)
MOMENT_BUDGETS = (128, 200, 256, 512)  # moment statistics raise the floor to 128 on the default model
# One bad override each, and the field the 400 must name (server defaults: block 32, 4 sinks, 32 recent).
BAD_OVERRIDES = (
    ({"kv_budget": 0}, "kv_budget"),
    ({"kv_budget": 32}, "kv_budget"),  # below the per-head floor of 64
    ({"kv_budget": 96, "kv_moment_correction": True}, "kv_budget"),  # below the floor of 128 with moments
    ({"kv_policy": "nope"}, "kv_policy"),
    ({"kv_decode_interval": 33}, "kv_decode_interval"),  # not a multiple of the block size
    ({"kv_moment_correction": "maybe"}, "kv_moment_correction"),
    ({"kv_bduget": 5}, "kv_bduget"),  # unknown key
    ({"kv_recent_window": -1}, "kv_recent_window"),
)
KINDS = ("valid", "invalid", "stream_cancel", "abort")
STREAM_CHUNKS = 2  # a cancelled stream is closed after this many data chunks


# ----------------------------------------------------------------------------------------------------
# The plan (pure)
# ----------------------------------------------------------------------------------------------------


def _preset_moments(policy: str | None) -> bool:
    """Whether a preset turns moment correction on by default (MomentKV's presets do: the floor is higher)."""
    from vllm_contour.policies.registry import PRESETS

    return policy is not None and PRESETS[policy].moment_correction


def _valid_xargs(rng: random.Random, prompt_len: int, policies, moments) -> dict:
    """A random subset of valid per-request overrides (each key with probability 1/2)."""
    x: dict = {}
    coin = lambda: rng.random() < 0.5  # noqa: E731
    if coin():
        x["kv_policy"] = rng.choice(list(policies))
    if moments is True or (moments == "random" and coin()):
        x["kv_moment_correction"] = True if moments is True else rng.choice([True, False])
    if x.get("kv_moment_correction") is True or (
            "kv_moment_correction" not in x and _preset_moments(x.get("kv_policy"))):
        x["kv_budget"] = rng.choice(MOMENT_BUDGETS)  # always explicit: the server's budget may be lower
    elif coin():
        x["kv_budget"] = rng.choice(BUDGETS)
    if coin():
        x["kv_decode_interval"] = rng.choice([0, 32, 64, 128])
    if coin():
        x["kv_recent_window"] = rng.choice([16, 32])
    if coin():
        x["kv_sink_tokens"] = rng.choice([2, 4])
    if coin():
        x["kv_observation_window"] = rng.choice([16, 32])
    if coin():
        x["kv_context_len"] = max(1, rng.choice([1, prompt_len // 2, prompt_len]))
    if rng.random() < 0.15:
        x["foo"] = 1  # not a kv_ key: the plugin must ignore it
    return x


def make_plan(n: int, seed: int, *, min_len: int = 5, max_len: int = 2000, max_tokens=(8, 48),
              invalid_share: float = 0.1, cancel_share: float = 0.1, abort_share: float = 0.0,
              policies=POLICIES, moments="random") -> list[dict]:
    """``n`` request specs, the same for the same arguments. Kinds come in exact shares (rounded), in
    random order; invalid requests carry only their one bad override (valid extras could make it valid:
    ``kv_recent_window 16`` lowers the floor under ``kv_budget 32``)."""
    if moments not in (True, False, "random"):
        raise ValueError(f"moments must be True, False or 'random', got {moments!r}")
    rng = random.Random(seed)
    counts = {"invalid": round(invalid_share * n), "stream_cancel": round(cancel_share * n),
              "abort": round(abort_share * n)}
    counts["valid"] = n - sum(counts.values())
    if counts["valid"] < 0:
        raise ValueError("invalid_share + cancel_share + abort_share > 1")
    kinds = [k for k in KINDS for _ in range(counts[k])]
    rng.shuffle(kinds)
    lo, hi = math.log(min_len), math.log(max_len)
    plan = []
    for i, kind in enumerate(kinds):
        prompt_len = min(max_len, max(min_len, round(math.exp(rng.uniform(lo, hi)))))
        spec = {"i": i, "kind": kind, "prompt_len": prompt_len, "max_tokens": rng.randint(*max_tokens),
                "xargs": {}, "expect_field": None, "stream": kind == "stream_cancel"}
        if kind == "invalid":
            bad, spec["expect_field"] = rng.choice(BAD_OVERRIDES)
            spec["xargs"] = dict(bad)
        else:
            spec["xargs"] = _valid_xargs(rng, prompt_len, policies, moments)
        plan.append(spec)
    return plan


def stock_plan(plan: list[dict]) -> list[dict]:
    """The same plan for a server without the plugin: no ``vllm_xargs``, invalid requests sent as valid."""
    return [{**s, "xargs": {}, "expect_field": None, "kind": "valid" if s["kind"] == "invalid" else s["kind"]}
            for s in plan]


def abort_after(spec: dict) -> float:
    """Seconds the client of an ``abort`` request waits before giving up (0.3-1.0, fixed per ``i``)."""
    return round(random.Random(f"abort/{spec['i']}").uniform(0.3, 1.0), 3)


# ----------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------


def _send(url: urllib.parse.SplitResult, spec: dict, model: str, vocab: int, timeout: float) -> dict:
    """One request; returns ``{code, text, chunks, timed_out, seconds}`` (``code`` None if no answer)."""
    body = {"model": model, "prompt": random_token_prompt(spec["prompt_len"], spec["i"], vocab),
            "max_tokens": spec["max_tokens"], "temperature": 0, "ignore_eos": True, "stream": spec["stream"]}
    if spec["xargs"]:
        body["vllm_xargs"] = spec["xargs"]
    out = {"code": None, "text": "", "chunks": 0, "timed_out": False}
    conn = http.client.HTTPConnection(url.hostname, url.port or 80,
                                      timeout=abort_after(spec) if spec["kind"] == "abort" else timeout)
    t0 = time.time()
    try:
        conn.request("POST", url.path.rstrip("/") + "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["code"] = resp.status
        if not spec["stream"] or resp.status != 200:
            out["text"] = resp.read().decode(errors="replace")
        else:  # read SSE lines until STREAM_CHUNKS data chunks, then hang up (finally: close)
            while out["chunks"] < STREAM_CHUNKS:
                line = resp.readline()
                if not line or line.strip() == b"data: [DONE]":
                    break
                if line.startswith(b"data:"):
                    out["chunks"] += 1
                    out["text"] = line.decode(errors="replace")
    except TimeoutError:  # socket.timeout: the client gives up, the server sees the connection drop
        out["timed_out"] = True
    finally:
        conn.close()
    out["seconds"] = time.time() - t0
    return out


def _tally(plan: list[dict], outcomes: dict[int, dict], wall_s: float) -> dict:
    res = {"requests": len(plan), "kinds": dict(Counter(s["kind"] for s in plan)), "ok": 0, "http_400": {},
           "errors": [], "invalid_ok": 0, "invalid_wrong": [], "valid_failed": [], "stream_cancelled": 0,
           "aborted": 0, "abort_completed": 0, "latencies": []}
    for s in plan:
        o, i, kind = outcomes.get(s["i"], {"exc": "not run"}), s["i"], s["kind"]
        code, text = o.get("code"), o.get("text", "")
        if code == 400:
            res["http_400"][kind] = res["http_400"].get(kind, 0) + 1
        if "exc" in o:
            res["errors"].append(f"{kind} i={i}: {o['exc']}"[:240])
            if kind == "valid":
                res["valid_failed"].append((i, None, o["exc"][:200]))
            elif kind == "invalid":
                res["invalid_wrong"].append((i, None, o["exc"][:200]))
        elif kind == "invalid":
            if code == 400 and s["expect_field"] in text:
                res["invalid_ok"] += 1
            else:
                res["invalid_wrong"].append((i, code, text[:200]))
                res["errors"].append(f"invalid i={i} {s['xargs']}: {code} {text[:160]}")
        elif kind == "stream_cancel":
            if code == 200 and o["chunks"] == STREAM_CHUNKS:
                res["stream_cancelled"] += 1
            else:
                res["errors"].append(f"stream_cancel i={i}: {code}, {o['chunks']} chunks {text[:160]}")
        elif kind == "abort" and o["timed_out"]:
            res["aborted"] += 1
        elif kind == "abort" and code == 200:
            res["abort_completed"] += 1  # finished before the client gave up
        elif kind == "abort":
            res["errors"].append(f"abort i={i}: {code} {text[:160]}")
        else:  # valid
            why = None
            try:
                out = json.loads(text) if code == 200 else None
                if out is None:
                    why = f"HTTP {code}"
                elif out["usage"]["completion_tokens"] != s["max_tokens"]:
                    why = f"{out['usage']['completion_tokens']} tokens, asked {s['max_tokens']}"
                elif out["choices"][0]["finish_reason"] != "length":
                    why = f"finish_reason {out['choices'][0]['finish_reason']!r}"
            except (ValueError, KeyError, IndexError, TypeError) as e:
                why = f"bad body: {type(e).__name__}"
            if why is None:
                res["ok"] += 1
                res["latencies"].append(round(o["seconds"], 4))
            else:
                res["valid_failed"].append((i, code, text[:200]))
                res["errors"].append(f"valid i={i} {s['xargs']}: {why}: {text[:120]}")
    res["p50_s"], res["p99_s"] = percentile(res["latencies"], 50), percentile(res["latencies"], 99)
    res["wall_s"] = round(wall_s, 3)
    return res


def run_load(base_url: str, plan: list[dict], clients: int = 4, model: str = SERVED_NAME, vocab: int = 49152,
             timeout: float = 600.0) -> dict:
    """Send ``plan`` from ``clients`` threads (one shared queue, one connection per request) and tally the
    outcomes (see the module docstring for what each kind must get)."""
    url = urllib.parse.urlsplit(base_url)
    todo: queue.Queue = queue.Queue()
    for s in plan:
        todo.put(s)
    outcomes: dict[int, dict] = {}

    def worker():
        while True:
            try:
                s = todo.get_nowait()
            except queue.Empty:
                return
            try:
                outcomes[s["i"]] = _send(url, s, model, vocab, timeout)
            except Exception as e:  # connection refused/reset, ...: unexpected for every kind
                outcomes[s["i"]] = {"exc": f"{type(e).__name__}: {e}"}

    t0 = time.time()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _tally(plan, outcomes, time.time() - t0)


# ----------------------------------------------------------------------------------------------------
# Settle
# ----------------------------------------------------------------------------------------------------


def summarise_metrics(text: str) -> dict:
    """The idle-check figures of a ``/metrics`` text: running, waiting, KV usage (fraction of the pool),
    preemptions, every ``vllm:contour_*`` series summed over label sets (histogram ``_bucket`` and
    ``*_created`` timestamps left out) and eviction failures by their ``reason`` label. NaN if absent."""
    totals = metric_totals(text)
    nan = float("nan")
    failures: dict[str, float] = {}
    for name, labels, value in parse_prometheus(text):
        if name == "vllm:contour_eviction_failures_total":
            r = labels.get("reason", "?")
            failures[r] = failures.get(r, 0.0) + value
    return {"running": metric(totals, "vllm:num_requests_running", nan),
            "waiting": metric(totals, "vllm:num_requests_waiting", nan),
            "kv_usage": metric(totals, "vllm:kv_cache_usage_perc", nan),
            # vLLM's own free queue, as the plugin reads it (kv_usage goes through the plugin's patched count
            # of free blocks, which counts blocks only shared compressed contexts hold as free); NaN: no plugin
            "request_blocks": metric(totals, "vllm:contour_pool_request_blocks", nan),
            "preemptions": metric(totals, "vllm:num_preemptions", nan),
            "contour": {n: v for n, v in sorted(totals.items()) if n.startswith("vllm:contour_")
                        and not n.endswith(("_bucket", "_created"))},
            "failures_by_reason": failures}


def _idle(m: dict) -> bool:
    rb = m.get("request_blocks", float("nan"))
    return m["running"] == 0 and m["waiting"] == 0 and m["kv_usage"] == 0 and (math.isnan(rb) or rb == 0)


def settle(base_url: str, timeout: float = 120.0, *, nudge_after: float | None = 10.0) -> dict:
    """Poll ``/metrics`` every 0.5 s until no request runs or waits and KV usage is 0 (or ``timeout``),
    then GET ``/health``. vLLM refreshes these gauges only when the engine steps, so if the last event was an
    abort they can stay stale on an idle server: after ``nudge_after`` s without settling, one 1-token
    request is sent (``nudged`` in the result; a block really leaked stays counted after it)."""
    t0, m, nudged = time.time(), None, False
    while True:
        try:
            m = summarise_metrics(http_get(base_url + "/metrics", timeout=5))
            if _idle(m):
                break
        except OSError:
            pass
        if nudge_after is not None and not nudged and time.time() - t0 > nudge_after:
            nudged = True
            try:
                _send(urllib.parse.urlsplit(base_url), {"i": -1, "kind": "valid", "prompt_len": 4,
                                                        "max_tokens": 1, "xargs": {}, "stream": False},
                      SERVED_NAME, 49152, 60.0)
            except OSError:
                pass
        if time.time() - t0 > timeout:
            break
        time.sleep(0.5)
    m = m or summarise_metrics("")
    try:
        http_get(base_url + "/health", timeout=10)
        healthy = True
    except OSError:
        healthy = False
    return {"settled": _idle(m), "seconds": round(time.time() - t0, 2), "nudged": nudged, "healthy": healthy,
            **m}


# ----------------------------------------------------------------------------------------------------
# Command line: eviction server, then stock server, same plan
# ----------------------------------------------------------------------------------------------------


class LoadSampler(threading.Thread):
    """``os.getloadavg()[0]`` every ``interval`` s while a run is in flight."""

    def __init__(self, interval: float = 5.0):
        super().__init__(daemon=True)
        self.interval, self.samples, self._stop_event = interval, [], threading.Event()

    def run(self):
        while True:
            self.samples.append(round(os.getloadavg()[0], 2))
            if self._stop_event.wait(self.interval):
                return

    def stop(self) -> dict:
        self._stop_event.set()
        self.join(10)
        s = self.samples
        return {"samples": s, "mean": sum(s) / len(s) if s else None, "max": max(s) if s else None}


def group_pids(pgid: int) -> list[int]:
    """Processes of the process group ``pgid`` (the server and its engine core)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(p.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(pids)


def host_info() -> dict:
    """``serving.machine()`` plus the ``isa`` map older soak records have."""
    info = machine()
    info["isa"] = {f: info["flags"].get(f, False) for f in ("avx2", "avx512f", "amx_bf16")}
    return info


def run_config(name: str, flags: list[str], env: dict, plan: list[dict], opts, out: Path, record: dict) -> dict:
    """Start one server, run the plan, settle, check the process survived, stop it. The entry is in
    ``record["runs"][name]`` from the start, so a failure keeps what was measured."""
    server = Server(name, opts.model, flags, env, out / "logs" / f"server_{name}.log")
    rec = record["runs"][name] = {
        "config": name, "argv": shlex.join(server.argv),
        "env": {k: env[k] for k in env if k.startswith(("VLLM_CPU", "VLLM_CONTOUR", "VLLM_PLUGINS"))}}
    server.start()
    try:
        rec["ready_s"] = round(server.wait_ready(), 1)
        rec["pid_before"], rec["group_before"] = server.proc.pid, group_pids(server.proc.pid)
        sampler = LoadSampler()
        sampler.start()
        try:
            rec["load"] = run_load(server.base_url, plan, clients=opts.clients)
            rec["settle"] = settle(server.base_url)
        finally:
            rec["loadavg"] = sampler.stop()
        rec["alive"] = server.proc.poll() is None
        rec["pid_after"], rec["group_after"] = server.proc.pid, group_pids(server.proc.pid)
        rec["restarts"] = len(set(rec["group_before"]) - set(rec["group_after"])) + (0 if rec["alive"] else 1)
        kv, rb = rec["settle"]["kv_usage"], rec["settle"].get("request_blocks", float("nan"))
        rec["leaked_blocks"] = round(rb) if not math.isnan(rb) else None if math.isnan(kv) else round(kv * (opts.pool - 1))
    finally:
        server.stop()
    return rec


def _row(rec: dict) -> list:
    ld, st = rec.get("load", {}), rec.get("settle", {})
    fails = ", ".join(f"{k} {v:g}" for k, v in sorted(st.get("failures_by_reason", {}).items())) or "0"
    inv = ld.get("kinds", {}).get("invalid")
    return [rec["config"], ld.get("requests"), ld.get("ok"), f"{ld.get('invalid_ok')}/{inv}" if inv else "-",
            ld.get("stream_cancelled"), ld.get("aborted"), len(ld.get("errors", [])),
            fails if rec["config"] != "stock" else "-", rec.get("leaked_blocks"), rec.get("restarts"),
            ld.get("p50_s"), ld.get("p99_s")]


def summary_markdown(record: dict) -> str:
    runs = record["runs"]
    text = md_table(["config", "requests", "served", "invalid→400", "cancelled", "aborted", "failed",
                     "failures counted (by reason)", "leaked blocks", "restarts", "p50 s", "p99 s"],
                    [_row(r) for r in runs.values()])
    if record.get("ratio"):
        r = record["ratio"]
        text += f"\n\nLatency eviction / stock: p50 {r['p50']:.2f}x, p99 {r['p99']:.2f}x"
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool", type=int, default=160, help="KV pool in blocks (--num-gpu-blocks-override)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2600)
    p.add_argument("--max-prompt-len", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--faults", default="plan=0.05,apply=0.05",
                   help="VLLM_CONTOUR_FAULTS for the eviction server (test-only fault switch); '' = off")
    p.add_argument("--abort-share", type=float, default=0.1)
    p.add_argument("--cancel-share", type=float, default=0.1)
    p.add_argument("--invalid-share", type=float, default=0.1)
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--no-stock", action="store_true", help="skip the stock (plugin disabled) baseline")
    p.add_argument("--model", default=None, help="model dir (default: the bundled smollm2)")
    p.add_argument("--out", default=str(REPO / "results" / "soak"))
    a = p.parse_args(argv)
    if a.max_prompt_len + a.max_tokens[1] > a.max_model_len:
        p.error(f"--max-prompt-len + max tokens > --max-model-len {a.max_model_len}")
    return a


def main(argv=None) -> int:
    opts = parse_args(argv)
    install_cleanup()
    out = Path(opts.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if opts.model is None:
        from vllm_contour.models import fetch_model

        opts.model = str(fetch_model("smollm2", quiet=True))
    plan = make_plan(opts.requests, opts.seed, max_len=opts.max_prompt_len, max_tokens=tuple(opts.max_tokens),
                     invalid_share=opts.invalid_share, cancel_share=opts.cancel_share,
                     abort_share=opts.abort_share)
    record = {"args": vars(opts), "host": {**host_info(), "loadavg_at_start": os.getloadavg()},
              "dtype": "float32",  # serve_flags' default, which both servers run with
              "plan_kinds": dict(Counter(s["kind"] for s in plan)), "runs": {}, "ratio": None,
              "notes": {"stock": "stock has no kv_ keys: every request's vllm_xargs removed and the invalid "
                                 "requests sent as valid ones, so its latencies cover more requests",
                        "leaked_blocks": "kv_cache_usage_perc x (pool - 1) after settle (vLLM's usage excludes "
                                         "the null block); must be 0",
                        "restarts": "processes of the server's group gone after the run (+1 if the API server "
                                    "died); must be 0",
                        "loadavg": "1-min load average sampled every 5 s during each run (shared host)"}}
    t0, status = time.time(), "ok"
    common = dict(pool=opts.pool, block_size=opts.block_size, max_model_len=opts.max_model_len)
    try:
        env = child_env(1)
        if opts.faults:
            env["VLLM_CONTOUR_FAULTS"] = opts.faults
        run_config("eviction", serve_flags(**common, policy=opts.policy, budget=opts.budget), env, plan, opts,
                   out, record)
        if not opts.no_stock:
            env = {k: v for k, v in child_env(1).items() if k != "VLLM_CONTOUR_FAULTS"}
            env["VLLM_PLUGINS"] = "none-allowed"
            run_config("stock", serve_flags(**common, policy=None, budget=opts.budget), env, stock_plan(plan),
                       opts, out, record)
            ev, st = record["runs"]["eviction"]["load"], record["runs"]["stock"]["load"]
            record["ratio"] = {q: ev[f"{q}_s"] / st[f"{q}_s"] if st[f"{q}_s"] else float("nan")
                               for q in ("p50", "p99")}
    except BaseException as e:
        status = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        record["status"], record["wall_s"] = status, round(time.time() - t0, 1)
        (out / "soak.json").write_text(json.dumps(stamp(record, argv), indent=1, default=str))
        if record["runs"]:
            print(summary_markdown(record))
        print(f"\n{status}; wall {record['wall_s']:.0f} s; results in {out / 'soak.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
