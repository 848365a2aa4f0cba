"""Serving throughput with and without eviction, on a KV pool small enough that memory binds.

Starts ``vllm-contour serve`` on the default model once *stock* (no eviction flag) and once per eviction
policy (``--kv-eviction-policy snapkv --kv-budget 128``; also ``contour`` in the full run), all with the
same small pool (``--block-size 32 --num-gpu-blocks-override N``, ``--dtype`` fp32 by default, eager, prefix
caching off), and drives every server with the same workload through vLLM's own benchmark client (``vllm bench serve
--backend openai --dataset-name random --random-input-len 2000 --random-output-len L --ignore-eos
--max-concurrency C --num-prompts N``, same seed, so the same prompts). While a run is in flight a
background thread polls ``/metrics`` every 0.5 s (``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:num_requests_waiting``, ``vllm:num_preemptions``, the plugin's
``vllm:contour_*`` counters).

Physics. Prefill costs the same with or without eviction (the prompt is prefilled dense, then compacted).
With a pool that holds only ~2 full 2K-token requests, stock vLLM decodes 2 requests at a time; after
eviction a request holds ~5 blocks plus its decode tail, so many more decode together. Decode therefore
gets cheaper per token, prefill does not: the throughput ratio is bounded by the prefill share of the
work and grows with the output length (the sweep over L shows where eviction starts to pay).

Reported per configuration: requests/s, output tokens/s, TTFT and TPOT p50/p99 (computed here from
the client's per-request timings with the same definition as vLLM's client:
``tpot = (latency - ttft) / (output_tokens - 1)``; vLLM's own summary numbers are kept too), peak and mean
running requests and KV usage (from the poll), preemptions, and the ratio eviction / stock for each.

Eviction overhead = (``policy_seconds`` + ``compact_seconds``) as a percentage of the prefill time of the
compacted prompts. Primary estimate of that prefill time: ``prefill_tokens_evicted_from`` / the prefill
throughput of the same server, measured by a timed probe (one ``input_len``-token request with
``max_tokens=1`` after a warm-up request; on an eviction server the probe's own policy + compaction seconds,
read from the counters, are subtracted). Secondary (lower bound on the overhead): relative to the sum of
the requests' TTFTs, which also contains queueing.

Offline variant: ``LLM.generate`` on a batch of long prompts (random token ids, same pool, each engine in
its own subprocess, ``additional_config={"kv_eviction": {...}}`` for eviction), tokens/s ratio, with the
scheduler's running count and pool usage sampled from a thread.

Writes ``serving.json`` (every number, the commands, environment, load average), ``serving.md`` (the
tables), ``serving.png`` (``plot_record``), ``raw/`` (vLLM's result files) and ``logs/``.

    python -m benchmarks.serving [--quick] [--out DIR] [--output-lens 64 256 512] [--request-rate inf 0.05 0.1]

``--kv-cache-dtypes auto fp8`` (``--no-offline``) runs stock and every policy once per cache dtype at equal KV
bytes: ``--pools`` counts blocks of the model dtype's cache and an fp8 server (``--kv-cache-dtype fp8``, one
byte per element) gets as many bytes, so twice the blocks under bf16; its configurations are named
``<config>_fp8``. ``ratios`` are against stock on the model dtype's pages; ``fp8_ratios`` pair each fp8
eviction configuration with the same policy on the model dtype's pages and with ``stock_fp8``.

``--client cli`` runs ``vllm-contour bench serve ...`` as a subprocess for every run (what the JSON's
``commands`` list shows); the default ``inprocess`` parses exactly that argument list with vLLM's own
``bench serve`` parser and calls its ``main`` in this process, which saves the ~20-30 s ``import vllm``
of every client start on this 2-core machine.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from benchmarks import md_table, stamp

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SERVED_NAME = "smollm2"

QUICK = dict(output_lens=[64, 256], num_prompts=12, max_concurrency=12, pools=[160], policies=["snapkv"],
             offline_prompts=4, offline_output_len=128)
FULL = dict(output_lens=[64, 256, 512], num_prompts=24, max_concurrency=24, pools=[160, 320],
            policies=["snapkv", "contour"], offline_prompts=64, offline_output_len=256)

RUN_METRICS = ("request_throughput", "output_throughput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
               "tpot_p99_ms", "peak_running", "mean_running", "peak_kv_usage", "preemptions")
CONTOUR_COUNTERS = ("evicted_requests", "rounds", "freed_blocks", "stale_reports", "policy_seconds",
                    "compact_seconds", "later_round_seconds", "tokens_evicted", "request_mean_kv_tokens_sum", "request_mean_kv_tokens_count",
                    "request_peak_kv_tokens_sum", "request_peak_kv_tokens_count")
VLLM_COUNTERS = ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:request_success")


# ----------------------------------------------------------------------------------------------------
# Pure helpers (tested in tests/unit/test_bench_serving.py)
# ----------------------------------------------------------------------------------------------------


def _parse_labels(s: str) -> dict[str, str]:
    """``a="x",b="y, z"`` -> dict; handles escaped quotes/backslashes and commas inside values."""
    labels: dict[str, str] = {}
    i, n = 0, len(s)
    while i < n:
        while i < n and s[i] in " ,":
            i += 1
        if i >= n:
            break
        eq = s.index("=", i)
        key = s[i:eq].strip()
        if eq + 1 >= n or s[eq + 1] != '"':
            raise ValueError(f"bad label set: {s!r}")
        j, val = eq + 2, []
        while s[j] != '"':
            if s[j] == "\\" and j + 1 < n:
                val.append({"n": "\n", '"': '"', "\\": "\\"}.get(s[j + 1], s[j + 1]))
                j += 2
            else:
                val.append(s[j])
                j += 1
        labels[key] = "".join(val)
        i = j + 1
    return labels


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> ``[(name, labels, value)]`` (comments and blank lines skipped)."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line and line.index("{") < (line.index(" ") if " " in line else len(line)):
            name, rest = line.split("{", 1)
            # find the closing brace outside quoted values
            in_q, esc, k = False, False, 0
            for k, ch in enumerate(rest):
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_q = not in_q
                elif ch == "}" and not in_q:
                    break
            labels = _parse_labels(rest[:k])
            value_part = rest[k + 1:].split()
        else:
            parts = line.split()
            name, labels, value_part = parts[0], {}, parts[1:]
        if not value_part:
            continue
        try:
            value = float(value_part[0])
        except ValueError:
            continue
        out.append((name.strip(), labels, value))
    return out


def metric_totals(text: str) -> dict[str, float]:
    """Sum of every sample per metric name, over all label sets (one engine, one model here)."""
    totals: dict[str, float] = {}
    for name, _, value in parse_prometheus(text):
        totals[name] = totals.get(name, 0.0) + value
    return totals


def metric(totals: dict[str, float], name: str, default: float | None = None) -> float | None:
    """A counter or gauge by its registered name: prometheus_client exports counters as ``NAME_total``."""
    for n in (name, name + "_total"):
        if n in totals:
            return totals[n]
    return default


def counter_deltas(before: dict[str, float], after: dict[str, float], names: Iterable[str]) -> dict[str, float]:
    """``after - before`` for each named counter (missing counters count as 0)."""
    return {n: (metric(after, n, 0.0) or 0.0) - (metric(before, n, 0.0) or 0.0) for n in names}


def percentile(values: Iterable[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between order statistics (numpy's default).
    NaN for an empty input."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request_latencies(result: dict) -> dict[str, list[float]]:
    """Per-request TTFT and TPOT (seconds) of the successful requests in a ``--save-detailed`` result of
    ``vllm bench serve``; TPOT as vLLM defines it, only for requests with more than one output token."""
    ttfts, tpots = [], []
    errors = result.get("errors") or [""] * len(result.get("ttfts", []))
    for ttft, lat, n, err in zip(result.get("ttfts", []), result.get("latencies", []),
                                 result.get("output_lens", []), errors):
        if err or not n:
            continue
        ttfts.append(ttft)
        if n > 1:
            tpots.append((lat - ttft) / (n - 1))
    return {"ttft": ttfts, "tpot": tpots}


def latency_summary(result: dict) -> dict[str, float]:
    lat = request_latencies(result)
    return {"ttft_p50_ms": 1000 * percentile(lat["ttft"], 50), "ttft_p99_ms": 1000 * percentile(lat["ttft"], 99),
            "tpot_p50_ms": 1000 * percentile(lat["tpot"], 50), "tpot_p99_ms": 1000 * percentile(lat["tpot"], 99),
            "ttft_sum_s": float(sum(lat["ttft"]))}


def timeline_summary(samples: list[dict]) -> dict[str, float]:
    """Peak and time-weighted mean of running requests and KV usage over polled samples ``{t, running,
    kv_usage, ...}`` (each sample holds until the next one)."""
    if not samples:
        return {"peak_running": float("nan"), "mean_running": float("nan"), "peak_kv_usage": float("nan"),
                "mean_kv_usage": float("nan"), "peak_waiting": float("nan"), "mean_loadavg": float("nan")}
    loads = [s["load1"] for s in samples if "load1" in s]
    out = {"peak_running": max(s["running"] for s in samples),
           "mean_loadavg": sum(loads) / len(loads) if loads else float("nan"),
           "peak_kv_usage": max(s["kv_usage"] for s in samples),
           "peak_waiting": max(s.get("waiting", 0.0) for s in samples)}
    if len(samples) == 1:
        out["mean_running"], out["mean_kv_usage"] = samples[0]["running"], samples[0]["kv_usage"]
        return out
    span = samples[-1]["t"] - samples[0]["t"]
    for key, name in (("running", "mean_running"), ("kv_usage", "mean_kv_usage")):
        acc = sum(a[key] * (b["t"] - a["t"]) for a, b in zip(samples, samples[1:]))
        out[name] = acc / span if span > 0 else samples[0][key]
    return out


def active_window(samples: list[dict]) -> list[dict]:
    """The samples from the first one with a running or waiting request to the first idle one after the
    last busy sample, with ``t`` rebased to 0 at the first busy sample (drops client start-up and
    tear-down idle time). Empty if never busy."""
    busy = [i for i, s in enumerate(samples) if s.get("running", 0) > 0 or s.get("waiting", 0) > 0]
    if not busy:
        return []
    lo, hi = busy[0], min(busy[-1] + 1, len(samples) - 1)
    t0 = samples[lo]["t"]
    return [{**s, "t": round(s["t"] - t0, 3)} for s in samples[lo:hi + 1]]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    if math.isnan(a) or math.isnan(b) or b == 0:
        return None
    return a / b


def ratio_table(rows: list[dict], baseline: str = "stock", metrics: Iterable[str] = RUN_METRICS,
                keys: tuple[str, ...] = ("pool", "output_len", "request_rate")) -> list[dict]:
    """For every non-baseline row, ``metric / baseline metric`` for the baseline row with the same
    ``keys`` (rows: ``{"config": ..., "pool": ..., "output_len": ..., <metrics>}``). Rows without a matching
    baseline are skipped; a ratio is None where the baseline is 0 or missing."""
    base = {tuple(r.get(k) for k in keys): r for r in rows if r["config"] == baseline}
    out = []
    for r in rows:
        if r["config"] == baseline:
            continue
        b = base.get(tuple(r.get(k) for k in keys))
        if b is None:
            continue
        entry = {"config": r["config"], **{k: r.get(k) for k in keys}}
        for m in metrics:
            entry[m] = _ratio(r.get(m), b.get(m))
        out.append(entry)
    return out


def fp8_ratios(rows: list[dict], metrics: Iterable[str] = RUN_METRICS) -> list[dict]:
    """Each eviction configuration on fp8 pages against the same policy on the model dtype's pages and against
    stock on fp8 pages (same pool in bytes, output length and arrival rate): ``ratio_table`` rows with their
    ``baseline``."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows if r["config"].endswith("_fp8") and r.get("policy")):
        for base in (name.removesuffix("_fp8"), "stock_fp8"):
            pair = [r for r in rows if r["config"] in (name, base)]
            out += [{**e, "baseline": base} for e in ratio_table(pair, baseline=base, metrics=metrics)]
    return out


def eviction_overhead(deltas: dict[str, float], wall_s: float | None,
                      ttft_sum_s: float | None = None) -> dict[str, float | None]:
    """Eviction cost of a run from its ``contour_*`` counter deltas: the rounds (prompt end and decode time)
    stall the whole batch, so their worker time is compared with the run's wall time."""
    cost = deltas.get("policy_seconds", 0.0) + deltas.get("compact_seconds", 0.0)
    rounds, evicted = deltas.get("rounds") or 0.0, deltas.get("evicted_requests") or 0.0
    later, later_s = max(0.0, rounds - evicted), deltas.get("later_round_seconds", 0.0)  # after each first round
    return {"eviction_seconds": cost, "rounds": rounds,
            "rounds_per_request": rounds / evicted if evicted else None,
            "ms_per_round": 1000.0 * cost / rounds if rounds else None,
            "overhead_pct_of_wall": 100.0 * cost / wall_s if wall_s else None,
            "overhead_pct_of_ttft_sum": 100.0 * cost / ttft_sum_s if ttft_sum_s else None,
            "policy_ms_per_request": 1000.0 * deltas.get("policy_seconds", 0.0) / evicted if evicted else None,
            "compact_ms_per_request": 1000.0 * deltas.get("compact_seconds", 0.0) / evicted if evicted else None,
            "later_rounds": later,
            "later_round_ms": 1000.0 * later_s / later if later else None,
            "later_round_pct_of_wall": 100.0 * later_s / wall_s if wall_s else None}


def kv_held_summary(deltas: dict[str, float]) -> dict[str, float | None]:
    """Mean over the run's requests of each request's mean / peak KV tokens per head held in vLLM's pool (the
    plugin's histograms; deltas of their ``_sum`` and ``_count``)."""
    out = {}
    for kind in ("mean", "peak"):
        n = deltas.get(f"request_{kind}_kv_tokens_count") or 0.0
        out[f"{kind}_kv_tokens"] = deltas.get(f"request_{kind}_kv_tokens_sum", 0.0) / n if n else None
    return out


def stock_kv_tokens_est(input_len: int, output_len: int, block_size: int) -> dict[str, float]:
    """What stock vLLM holds per head for one request that is never preempted: every token, in whole blocks
    (mean over its decode steps, and at its end)."""
    steps = [-(-(input_len + i) // block_size) * block_size for i in range(1, max(1, output_len) + 1)]
    return {"mean_kv_tokens": sum(steps) / len(steps), "peak_kv_tokens": float(steps[-1])}


def markdown_table(rows: list[dict], columns: list[tuple[str, str]], nd: int = 2) -> str:
    """``columns``: ``[(key, header)]``."""
    return md_table([h for _, h in columns], [[r.get(k) for k, _ in columns] for r in rows], nd)


def max_model_len_for(input_len: int, output_lens: Iterable[int], block_size: int, margin: int = 64) -> int:
    n = input_len + max(output_lens) + margin
    return -(-n // block_size) * block_size


# ----------------------------------------------------------------------------------------------------
# Process management: every child is started in its own session and killed by process group
# ----------------------------------------------------------------------------------------------------

_CHILDREN: dict[int, str] = {}  # pid (= pgid) -> what
_CHILDREN_LOCK = threading.Lock()


def _register(pid: int, what: str) -> None:
    with _CHILDREN_LOCK:
        _CHILDREN[pid] = what


def _unregister(pid: int) -> None:
    with _CHILDREN_LOCK:
        _CHILDREN.pop(pid, None)


def kill_group(pid: int, grace: float = 20.0) -> None:
    """SIGTERM the process group ``pid`` (its leader was started with ``start_new_session``), wait up to
    ``grace`` seconds for the leader, then SIGKILL the group."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        _unregister(pid)
        return
    deadline = time.time() + grace
    while time.time() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done == pid:
            break
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)  # stragglers of the group (engine core, workers)
    except ProcessLookupError:
        pass
    _unregister(pid)


def stop_all_children() -> None:
    with _CHILDREN_LOCK:
        pids = list(_CHILDREN)
    for pid in pids:
        kill_group(pid)


def _on_signal(signum, frame):  # SIGTERM / SIGHUP: unwind through the finally blocks, then atexit
    raise SystemExit(128 + signum)


def install_cleanup() -> None:
    atexit.register(stop_all_children)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    # SIGINT keeps Python's default (KeyboardInterrupt), which also unwinds through finally + atexit.


MACHINE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def parse_lscpu(text: str) -> dict:
    """``lscpu``'s (or ``/proc/cpuinfo``'s) text -> ``{"cpu_model", "flags": {flag: bool}}`` for the flags that
    decide vLLM's CPU kernels and the dtype (``MACHINE_FLAGS``); ``cpu_model`` None when the text has none."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            fields.setdefault(k.strip().lower(), v.strip())
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name") or None, "flags": {f: f in flags for f in MACHINE_FLAGS}}


def machine() -> dict:
    """The machine a result ran on, for its JSON: ``lscpu``'s model name, the flags of ``MACHINE_FLAGS``, the
    CPU count and the 1/5/15-min load average now (``/proc/cpuinfo`` when ``lscpu`` is missing)."""
    text = ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        pass
    if "flags" not in text.lower():
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    return {**parse_lscpu(text), "cpus": os.cpu_count(), "loadavg": list(os.getloadavg())}


def child_env(kv_space_gib: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # vllm-contour's CLI answers importlib.metadata.version("vllm") with vllm-cpu's plain "0.32.0", so
    # vLLM's platform detection (which looks for "cpu" in that version) misses the CPU platform and
    # imports the AVX-512 kernels (SIGILL on AVX2). Naming the platform explicitly avoids the detection.
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def http_post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class ServerError(RuntimeError):
    pass


@dataclass
class Server:
    name: str
    model: str
    flags: list[str]
    env: dict[str, str]
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def argv(self) -> list[str]:
        return [str(BIN / "vllm-contour"), "serve", self.model, "--served-model-name", SERVED_NAME,
                "--host", "127.0.0.1", "--port", str(self.port), *self.flags]

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=REPO, start_new_session=True)
        _register(self.proc.pid, f"server {self.name}")
        self.started_at = time.time()

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 900.0) -> float:
        assert self.proc is not None
        while True:
            try:
                http_get(self.base_url + "/v1/models", timeout=2)
                self.ready_s = time.time() - self.started_at
                return self.ready_s
            except Exception:
                if self.proc.poll() is not None:
                    raise ServerError(f"server {self.name} exited with code {self.proc.returncode} before "
                                      f"answering; log tail ({self.log_path}):\n{self.log_tail()}")
                if time.time() - self.started_at > timeout:
                    raise ServerError(f"server {self.name} did not answer within {timeout:.0f} s; log tail:\n"
                                      f"{self.log_tail()}")
                time.sleep(1.0)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerError(f"server {self.name} died (exit code {self.proc.returncode}); log tail "
                              f"({self.log_path}):\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


class MetricsPoller(threading.Thread):
    """Polls ``/metrics`` every ``interval`` s; keeps ``{t, running, waiting, kv_usage, preemptions,
    <contour counters>}`` samples (t in seconds since ``t0``)."""

    def __init__(self, base_url: str, interval: float = 0.5, t0: float | None = None):
        super().__init__(daemon=True)
        self.url = base_url + "/metrics"
        self.interval = interval
        self.t0 = time.time() if t0 is None else t0
        self.samples: list[dict] = []
        self.errors = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            t_start = time.time()
            try:
                totals = metric_totals(http_get(self.url, timeout=5))
                s = {"t": round(t_start - self.t0, 3),
                     "running": metric(totals, "vllm:num_requests_running", 0.0),
                     "waiting": metric(totals, "vllm:num_requests_waiting", 0.0),
                     "kv_usage": metric(totals, "vllm:kv_cache_usage_perc", 0.0),
                     "preemptions": metric(totals, "vllm:num_preemptions", 0.0),
                     "load1": os.getloadavg()[0]}
                for c in ("evicted_requests", "freed_blocks"):
                    v = metric(totals, "vllm:contour_" + c)
                    if v is not None:
                        s[c] = v
                self.samples.append(s)
            except Exception:
                self.errors += 1
            self._stop_event.wait(max(0.0, self.interval - (time.time() - t_start)))

    def stop(self) -> list[dict]:
        self._stop_event.set()
        self.join(10)
        return self.samples


# ----------------------------------------------------------------------------------------------------
# Benchmark client (vLLM's own `bench serve`)
# ----------------------------------------------------------------------------------------------------


def bench_argv(*, base_url: str, model_dir: str, input_len: int, output_len: int, num_prompts: int,
               max_concurrency: int | None, request_rate: float, seed: int, result_dir: Path,
               result_filename: str, label: str, range_ratio: float = 0.0) -> list[str]:
    argv = ["bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--served-model-name", SERVED_NAME, "--tokenizer", model_dir,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--ignore-eos", "--temperature", "0", "--num-prompts", str(num_prompts),
            "--request-rate", "inf" if math.isinf(request_rate) else str(request_rate), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", result_filename, "--label", label, "--disable-tqdm"]
    if max_concurrency:
        argv += ["--max-concurrency", str(max_concurrency)]
    if range_ratio:
        argv += ["--random-range-ratio", str(range_ratio)]
    return argv


_BENCH_PARSER = None


def run_bench_client(argv: list[str], mode: str, env: dict[str, str], log_path: Path) -> None:
    """Run vLLM's ``bench serve`` with ``argv`` (starting with ``bench serve``)."""
    if mode == "cli":
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(BIN / "vllm-contour"), *argv], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=REPO, start_new_session=True)
            _register(proc.pid, "bench client")
            try:
                rc = proc.wait()
            finally:
                if proc.poll() is None:
                    kill_group(proc.pid)
                _unregister(proc.pid)
        if rc != 0:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vllm-contour bench serve failed (rc {rc}); log tail:\n{tail}")
        return
    global _BENCH_PARSER
    for k in ("VLLM_TARGET_DEVICE",):
        os.environ.setdefault(k, env[k])
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if _BENCH_PARSER is None:
        _BENCH_PARSER = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(_BENCH_PARSER)
    args = _BENCH_PARSER.parse_args(argv[2:])
    import contextlib

    with open(log_path, "w") as log, contextlib.redirect_stdout(log):
        bench_main(args)


# ----------------------------------------------------------------------------------------------------
# One server: start, warm up, probe prefill, run every output length
# ----------------------------------------------------------------------------------------------------


def random_token_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(100, vocab - 100) for _ in range(n)]


def probe_prefill(server: Server, input_len: int, seed: int) -> dict:
    """Warm-up request, then one timed ``input_len``-token request with ``max_tokens=1``."""
    url = server.base_url + "/v1/completions"
    http_post(url, {"model": SERVED_NAME, "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0})
    ids = random_token_prompt(input_len, seed + 12345)
    before = metric_totals(http_get(server.base_url + "/metrics"))
    t0 = time.time()
    out = http_post(url, {"model": SERVED_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0})
    dt = time.time() - t0
    time.sleep(1.0)  # connector stats reach /metrics with the next stats update
    after = metric_totals(http_get(server.base_url + "/metrics"))
    d = counter_deltas(before, after, ["vllm:contour_policy_seconds", "vllm:contour_compact_seconds"])
    evict_s = sum(d.values())
    n = out.get("usage", {}).get("prompt_tokens", len(ids))
    return {"prompt_tokens": n, "seconds": dt, "eviction_seconds": evict_s, "tok_per_s": n / dt,
            "prefill_tok_per_s": n / max(1e-9, dt - evict_s), "loadavg": os.getloadavg()}


def serve_flags(*, pool: int, block_size: int, max_model_len: int, policy: str | None, budget: int,
                decode_interval: int | None = None, dtype: str = "float32", kv_cache_dtype: str = "auto") -> list[str]:
    flags = ["--dtype", dtype, "--enforce-eager", "--block-size", str(block_size),
             "--num-gpu-blocks-override", str(pool), "--max-model-len", str(max_model_len),
             "--no-enable-prefix-caching", "--seed", "0"]
    if kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", kv_cache_dtype]
    if policy:
        flags += ["--kv-eviction-policy", policy, "--kv-budget", str(budget)]
        if decode_interval is not None:
            flags += ["--kv-decode-interval", str(decode_interval)]
    return flags


DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def kv_configs(policies: list[str], kv_cache_dtypes: list[str], dtype: str) -> list[dict]:
    """Every server configuration: stock and each policy, per ``--kv-cache-dtype``. ``pool`` is given in blocks
    of the model dtype's cache; an fp8 cache (one byte per element) gets the same bytes, ``blocks_factor`` times
    the blocks (2 under bf16). Names of fp8 configurations end in ``_fp8``."""
    out = []
    for kvd in kv_cache_dtypes:
        fp8 = kvd.startswith("fp8")
        sfx, factor = ("_fp8", DTYPE_BYTES[dtype]) if fp8 else ("", 1)
        out += [{"name": "stock" + sfx, "policy": None, "kv_cache_dtype": kvd, "blocks_factor": factor}]
        out += [{"name": p + sfx, "policy": p, "kv_cache_dtype": kvd, "blocks_factor": factor} for p in policies]
    return out


def run_server_config(cfg: dict, opts, out: Path, pbar, model_dir: str, env: dict, record: dict) -> list[dict]:
    name, policy, pool = cfg["name"], cfg["policy"], cfg["pool"]
    kvd, blocks = cfg.get("kv_cache_dtype", "auto"), pool * cfg.get("blocks_factor", 1)
    tag = f"{name}_pool{pool}"
    server = Server(tag, model_dir, serve_flags(pool=blocks, block_size=opts.block_size,
                                                max_model_len=opts.max_model_len, policy=policy,
                                                budget=opts.budget, decode_interval=opts.kv_decode_interval,
                                                dtype=opts.dtype, kv_cache_dtype=kvd),
                    env, out / "logs" / f"server_{tag}.log")
    record["commands"].append({"what": f"server {tag}", "env": {k: env[k] for k in (
        "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_TARGET_DEVICE")},
        "argv": shlex.join(server.argv)})
    rows = []
    pbar.set_description(f"start {tag}")
    server.start()
    try:
        ready = server.wait_ready()
        probe = probe_prefill(server, opts.input_len, opts.seed)
        meta = {"config": name, "pool": pool, "blocks": blocks, "kv_cache_dtype": kvd, "policy": policy,
                "ready_s": ready, "probe": probe, "loadavg_at_start": os.getloadavg()}
        record["servers"].append(meta)
        pbar.update(1)
        for rate, L in [(r, L) for r in opts.request_rate for L in opts.output_lens]:
            rtag = "" if math.isinf(rate) else f"_rate{rate:g}"
            pbar.set_description(f"{tag} L={L}{rtag}")
            fname = f"{tag}_out{L}{rtag}.json"
            argv = bench_argv(base_url=server.base_url, model_dir=model_dir, input_len=opts.input_len,
                              output_len=L, num_prompts=opts.num_prompts, max_concurrency=opts.max_concurrency,
                              request_rate=rate, seed=opts.seed, result_dir=out / "raw",
                              result_filename=fname, label=tag, range_ratio=opts.range_ratio)
            record["commands"].append({"what": f"client {tag} L={L}{rtag}",
                                       "argv": shlex.join(["vllm-contour", *argv])})
            before = metric_totals(http_get(server.base_url + "/metrics"))
            load0 = os.getloadavg()
            poller = MetricsPoller(server.base_url, interval=opts.poll_interval)
            t0 = time.time()
            poller.start()
            try:
                run_bench_client(argv, opts.client, env, out / "logs" / f"client_{tag}_out{L}{rtag}.log")
            finally:
                raw_samples = poller.stop()
            samples = active_window(raw_samples)
            wall = time.time() - t0
            server.check_alive()
            after = metric_totals(http_get(server.base_url + "/metrics"))
            res = json.loads((out / "raw" / fname).read_text())
            contour = counter_deltas(before, after, ["vllm:contour_" + c for c in CONTOUR_COUNTERS])
            contour = {k.removeprefix("vllm:contour_"): v for k, v in contour.items()}
            vllm_c = counter_deltas(before, after, VLLM_COUNTERS)
            lat = latency_summary(res)
            row = {"config": name, "policy": policy, "pool": pool, "blocks": blocks, "kv_cache_dtype": kvd,
                   "output_len": L, "request_rate": rate,
                   "input_len": opts.input_len, "num_prompts": opts.num_prompts,
                   "completed": res.get("completed"), "failed": res.get("failed"),
                   "duration_s": res.get("duration"), "wall_s": wall,
                   "request_throughput": res.get("request_throughput"),
                   "output_throughput": res.get("output_throughput"),
                   "total_token_throughput": res.get("total_token_throughput"),
                   **lat,
                   "vllm_client": {k: res.get(k) for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                           "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
                                                           "median_e2el_ms", "p99_e2el_ms",
                                                           "max_concurrent_requests")},
                   **timeline_summary(samples),
                   "preemptions": vllm_c["vllm:num_preemptions"],
                   "server_counters": vllm_c, "contour": contour if policy else None,
                   "loadavg": [load0, os.getloadavg()], "poll_errors": poller.errors,
                   "polls": len(raw_samples),
                   "timeline": samples}
            if policy:
                row["overhead"] = eviction_overhead(contour, res.get("duration"), lat["ttft_sum_s"])
                row.update(kv_held_summary(contour))
            else:
                row.update({k + "_est": v for k, v in stock_kv_tokens_est(opts.input_len, L, opts.block_size).items()})
            if res.get("failed"):
                errs = [e for e in res.get("errors", []) if e][:3]
                row["errors_sample"] = errs
            rows.append(row)
            record["runs"].append(row)
            _save(record, out)  # partial results survive a later failure or Ctrl-C
            pbar.update(1)
            tqdm_write(f"  {tag} L={L}{rtag}: {row['output_throughput']:.1f} out tok/s, {row['request_throughput']:.3f} "
                       f"req/s, peak running {row['peak_running']:.0f}, peak KV {row['peak_kv_usage']:.2f}, "
                       f"TPOT p50 {row['tpot_p50_ms']:.0f} ms, wall {wall:.0f} s")
    finally:
        server.stop()
    return rows


def tqdm_write(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg)


# ----------------------------------------------------------------------------------------------------
# Offline variant (one engine per subprocess)
# ----------------------------------------------------------------------------------------------------


def offline_worker(spec_path: str, out_path: str) -> None:
    """Subprocess body: one in-process engine, ``LLM.generate`` on the batch, sampled scheduler state."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**spec["llm"])
    start_s = time.time() - t0
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    prompts = [{"prompt_token_ids": random_token_prompt(spec["input_len"], spec["seed"] + i)}
               for i in range(spec["num_prompts"])]
    sp = SamplingParams(max_tokens=spec["output_len"], temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": random_token_prompt(16, 7)}], SamplingParams(max_tokens=2),
                 use_tqdm=False)  # warm-up
    samples: list[dict] = []
    stop = threading.Event()
    t_gen = time.time()

    def poll():
        while not stop.is_set():
            try:
                samples.append({"t": round(time.time() - t_gen, 3), "running": float(len(sched.running)),
                                "waiting": float(len(sched.waiting)),
                                "kv_usage": float(pool.get_usage()), "load1": os.getloadavg()[0]})
            except Exception:
                pass
            stop.wait(spec.get("poll_interval", 0.5))

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.time() - t_gen
    stop.set()
    th.join(5)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    res = {"start_s": start_s, "generate_s": gen_s, "prompt_tokens": n_in, "output_tokens": n_out,
           "output_tok_per_s": n_out / gen_s, "total_tok_per_s": (n_in + n_out) / gen_s,
           "requests_per_s": len(outs) / gen_s, "num_gpu_blocks": pool.num_gpu_blocks,
           **timeline_summary(active_window(samples)), "timeline": active_window(samples)}
    Path(out_path).write_text(json.dumps(res))


def run_offline(cfg: dict, opts, out: Path, model_dir: str, env: dict, record: dict) -> dict:
    name, policy, pool = cfg["name"], cfg["policy"], cfg["pool"]
    tag = f"offline_{name}_pool{pool}"
    llm_kwargs = dict(model=model_dir, dtype=opts.dtype, enforce_eager=True, block_size=opts.block_size,
                      enable_prefix_caching=False, max_model_len=opts.offline_max_model_len,
                      num_gpu_blocks_override=pool, seed=0)
    if policy:
        llm_kwargs["additional_config"] = {"kv_eviction": {"policy": policy, "budget": opts.budget}}
    spec = {"llm": llm_kwargs, "input_len": opts.input_len, "output_len": opts.offline_output_len,
            "num_prompts": opts.offline_prompts, "seed": opts.seed, "poll_interval": opts.poll_interval}
    spec_path, out_path = out / "logs" / f"{tag}.spec.json", out / "logs" / f"{tag}.out.json"
    log_path = out / "logs" / f"{tag}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    if out_path.exists():
        out_path.unlink()
    argv = [sys.executable, "-m", "benchmarks.serving", "--offline-worker", str(spec_path), str(out_path)]
    record["commands"].append({"what": tag, "argv": shlex.join(argv), "spec": spec})
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        _register(proc.pid, tag)
        try:
            rc = proc.wait(timeout=3600)
        finally:
            if proc.poll() is None:
                kill_group(proc.pid)
            _unregister(proc.pid)
    if rc != 0 or not out_path.exists():
        raise RuntimeError(f"{tag} failed (rc {rc}); log tail ({log_path}):\n"
                           f"{log_path.read_text(errors='replace')[-5000:]}")
    res = json.loads(out_path.read_text())
    return {"config": name, "policy": policy, "pool": pool, "num_prompts": opts.offline_prompts,
            "input_len": opts.input_len, "output_len": opts.offline_output_len, **res}


# ----------------------------------------------------------------------------------------------------
# Plots and report
# ----------------------------------------------------------------------------------------------------


POINT_KEYS = ("pool", "output_len", "request_rate")
POINT_NAMES = {"pool": "KV pool (blocks)", "output_len": "output tokens per request",
               "request_rate": "arrivals per second"}


def _key(r: dict) -> tuple:
    return tuple(str(r.get(k, "inf")) for k in POINT_KEYS)


def _closed(rate) -> bool:
    return rate is None or str(rate) in ("inf", "Infinity") or (isinstance(rate, float) and math.isinf(rate))


def plot_panels(record: dict) -> list[tuple[str, str]]:
    """What ``plot_record`` draws for a serving record: ``(kind, title)`` per panel. Where the run has several
    points (pools, output lengths or arrival rates) a ``sweep`` row: eviction / stock output tokens/s and the
    running requests (mean and peak) against the one that varies; then, for every point (and the offline
    batch) with a polled timeline, a ``timeline`` row: running requests and KV blocks held over time, stock
    against eviction. A run of one point has no sweep row: a single point on a line axis says nothing."""
    rows = record.get("runs") or []
    vary = [k for k in POINT_KEYS if len({str(r.get(k)) for r in rows}) > 1]
    panels = []
    if vary:
        x = vary[0]
        panels += [("sweep", f"eviction / stock output tok/s against {POINT_NAMES[x]}"),
                   ("sweep", f"running requests against {POINT_NAMES[x]}")]
    for key in dict.fromkeys(_key(r) for r in rows if r.get("timeline")):
        pool, L, rate = key
        where = f"pool {pool}, {L} out" + ("" if _closed(rate) else f", {rate} req/s")
        panels += [("timeline", f"running requests, {where}"), ("timeline", f"KV blocks held, {where}")]
    if any(o.get("timeline") for o in record.get("offline") or []):
        panels += [("timeline", "running requests, offline LLM.generate"),
                   ("timeline", "KV blocks held, offline LLM.generate")]
    return panels


def plot_record(record: dict, path: Path) -> list[tuple[str, str]]:
    """Draw ``plot_panels(record)`` into ``path`` (two panels a row); -> the panels drawn. KV blocks held =
    ``vllm:kv_cache_usage_perc`` x (pool - 1): vLLM's usage leaves out the null block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plot_panels(record)
    if not panels:
        return []
    rows = record.get("runs") or []
    ratios = record.get("ratios") or ratio_table(rows)
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(11, 3.1 * (len(panels) // 2)), squeeze=False)
    axes = [ax for pair in axes for ax in pair]
    i = 0
    vary = [k for k in POINT_KEYS if len({str(r.get(k)) for r in rows}) > 1]
    if vary:
        x, rest = vary[0], vary[1:]
        xs = sorted({str(r.get(x)) for r in rows}, key=lambda v: (float(v) if v not in ("inf", "None") else 1e18))
        numeric = all(v not in ("inf", "None") for v in xs)
        pos = {v: (float(v) if numeric else j) for j, v in enumerate(xs)}

        def series(rs):
            groups: dict = {}
            for r in rs:
                groups.setdefault(tuple(str(r.get(k)) for k in rest), []).append(r)
            for g, members in groups.items():
                members.sort(key=lambda r: pos[str(r.get(x))])
                tag = ", ".join(f"{k} {v}" for k, v in zip(rest, g))
                yield (f" ({tag})" if tag else ""), [pos[str(r.get(x))] for r in members], members

        ax_r, ax_n = axes[0], axes[1]
        for c in dict.fromkeys(q["config"] for q in ratios):
            for tag, px, members in series([q for q in ratios if q["config"] == c]):
                ax_r.plot(px, [q.get("output_throughput") for q in members], "o-", label=f"{c} / stock{tag}")
        ax_r.axhline(1.0, color="gray", lw=0.8)
        ax_r.set_ylabel("output tok/s, eviction / stock")
        for c in dict.fromkeys(r["config"] for r in rows):
            for tag, px, members in series([r for r in rows if r["config"] == c]):
                line = ax_n.plot(px, [r.get("mean_running") for r in members], "o-", label=f"{c} mean{tag}")
                ax_n.plot(px, [r.get("peak_running") for r in members], "s--", color=line[0].get_color(),
                          label=f"{c} peak{tag}")
        ax_n.set_ylabel("running requests")
        for ax, (_, title) in zip((ax_r, ax_n), panels[:2]):
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(POINT_NAMES[x])
            if not numeric:
                ax.set_xticks(list(pos.values()), [("closed" if v == "inf" else v) for v in xs])
            ax.legend(fontsize=7)
        i = 2

    def timeline(tl_series, k):
        ax_n, ax_b = axes[k], axes[k + 1]
        for label, tl, pool in tl_series:
            t = [s_["t"] for s_ in tl]
            ax_n.step(t, [s_["running"] for s_ in tl], where="post", label=label)
            ax_b.step(t, [s_["kv_usage"] * (pool - 1) for s_ in tl], where="post", label=label)
        ax_n.set_ylabel("running requests")
        ax_b.set_ylabel("KV blocks held")
        for pl in {p for _, _, p in tl_series}:  # the pool's usable blocks
            ax_b.axhline(pl - 1, color="gray", lw=0.8, ls=":")
        for ax, (_, title) in zip((ax_n, ax_b), panels[k:k + 2]):
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("seconds since the first request")
            ax.legend(fontsize=7)

    by_ratio = {(q["config"],) + _key(q): q for q in ratios}
    for key in dict.fromkeys(_key(r) for r in rows if r.get("timeline")):
        tl_series = []
        for r in rows:
            if _key(r) == key and r.get("timeline"):
                q = by_ratio.get((r["config"],) + key)
                extra = f": {q['output_throughput']:.2f}x stock's out tok/s" if q and q.get("output_throughput") else ""
                tl_series.append((f"{r['config']}{extra}", r["timeline"], int(r["pool"])))
        timeline(tl_series, i)
        i += 2
    off = [o for o in record.get("offline") or [] if o.get("timeline")]
    if off:
        timeline([(o["config"], o["timeline"], int(o["pool"])) for o in off], i)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return panels


def make_plots(record: dict, out: Path) -> list[str]:
    """``serving.png`` in ``out``: ``plot_record`` of the run."""
    return ["serving.png"] if plot_record(record, out / "serving.png") else []


ROW_COLS = [("config", "config"), ("pool", "pool"), ("output_len", "L"), ("request_rate", "arrivals/s"),
            ("request_throughput", "req/s"),
            ("output_throughput", "out tok/s"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
            ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"), ("peak_running", "peak running"),
            ("mean_running", "mean running"), ("peak_kv_usage", "peak KV"), ("preemptions", "preempt"),
            ("duration_s", "duration s"), ("mean_loadavg", "host load")]
RATIO_COLS = [("config", "config"), ("pool", "pool"), ("output_len", "L"), ("request_rate", "arrivals/s"),
              ("request_throughput", "req/s x"),
              ("output_throughput", "out tok/s x"), ("ttft_p50_ms", "TTFT p50 x"), ("ttft_p99_ms", "TTFT p99 x"),
              ("tpot_p50_ms", "TPOT p50 x"), ("tpot_p99_ms", "TPOT p99 x"), ("peak_running", "peak running x"),
              ("mean_running", "mean running x")]
OVERHEAD_COLS = [("config", "config"), ("pool", "pool"), ("output_len", "L"), ("request_rate", "arrivals/s"),
                 ("evicted_requests", "evicted"), ("rounds_per_request", "rounds/req"),
                 ("freed_blocks", "freed blocks"), ("ms_per_round", "ms/round"),
                 ("overhead_pct_of_wall", "% of wall"), ("later_round_ms", "ms/later round"),
                 ("later_round_pct_of_wall", "later rounds % of wall"), ("mean_kv_tokens", "mean KV/head"),
                 ("peak_kv_tokens", "peak KV/head")]
OFFLINE_COLS = [("config", "config"), ("pool", "pool"), ("num_prompts", "prompts"), ("output_len", "L"),
                ("generate_s", "generate s"), ("output_tok_per_s", "out tok/s"), ("total_tok_per_s", "total tok/s"),
                ("peak_running", "peak running"), ("mean_running", "mean running"), ("peak_kv_usage", "peak KV"),
                ("mean_loadavg", "host load")]


def finalize_overhead(rows: list[dict], servers: list[dict]) -> list[dict]:
    """The overhead table: one row per eviction run."""
    table = []
    for r in rows:
        if not r.get("policy") or r.get("contour") is None:
            continue
        r["overhead"] = eviction_overhead(r["contour"], r.get("duration_s"), r.get("ttft_sum_s"))
        table.append({"config": r["config"], "pool": r["pool"], "output_len": r["output_len"],
                      "request_rate": r.get("request_rate"), "evicted_requests": r["contour"].get("evicted_requests"),
                      "freed_blocks": r["contour"].get("freed_blocks"), "mean_kv_tokens": r.get("mean_kv_tokens"),
                      "peak_kv_tokens": r.get("peak_kv_tokens"), **r["overhead"]})
    return table


def write_report(record: dict, out: Path) -> str:
    rows, ratios, over, offline = record["runs"], record["ratios"], record["overhead"], record["offline"]
    parts = ["## Serving runs", markdown_table(rows, ROW_COLS), "",
             "## Ratio eviction / stock (same pool, same L, same arrivals)",
             markdown_table(ratios, RATIO_COLS), "", "## Eviction overhead", markdown_table(over, OVERHEAD_COLS), ""]
    if offline:
        parts += ["## Offline LLM.generate", markdown_table(offline, OFFLINE_COLS), ""]
        if record.get("offline_ratios"):
            parts += [markdown_table(record["offline_ratios"], [("config", "config"), ("pool", "pool"),
                                                                ("output_tok_per_s", "out tok/s x"),
                                                                ("peak_running", "peak running x")]), ""]
    text = "\n".join(parts)
    (out / "serving.md").write_text(text + "\n")
    return text


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"small run (~15 min on 2 cores): {QUICK}")
    p.add_argument("--out", default=str(REPO / "results" / "serving"))
    p.add_argument("--model", default=None, help="model dir (default: the bundled smollm2)")
    p.add_argument("--input-len", type=int, default=2000)
    p.add_argument("--output-lens", type=int, nargs="+")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="vLLM bench's --random-range-ratio: input and output lengths uniform in "
                        "[len * (1 - r), len * (1 + r)] (default 0: fixed lengths)")
    p.add_argument("--kv-decode-interval", type=int, default=None, help="eviction servers' --kv-decode-interval")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--max-concurrency", type=int, help="client-side concurrency cap (default: num prompts)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="one run per rate: Poisson arrivals at R req/s; inf = all at once, closed loop under "
                        "--max-concurrency (default)")
    p.add_argument("--pools", type=int, nargs="+", help="KV pool sizes in blocks (--num-gpu-blocks-override)")
    p.add_argument("--policies", nargs="+")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="every server's and engine's --dtype (python -m vllm_contour.cpu_dtype says which "
                        "is faster on this CPU)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="one set of servers (stock + --policies) per vLLM --kv-cache-dtype, at equal KV bytes: "
                        "--pools counts blocks of the model dtype's cache, an fp8 server gets as many bytes (twice "
                        "the blocks under bf16); their configurations are named <config>_fp8")
    p.add_argument("--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB) if unset")
    p.add_argument("--offline-prompts", type=int)
    p.add_argument("--offline-output-len", type=int)
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--no-serve", action="store_true")
    p.add_argument("--client", choices=["inprocess", "cli"], default="inprocess")
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    base = QUICK if a.quick else FULL
    if a.max_concurrency is None and a.num_prompts is not None:
        a.max_concurrency = a.num_prompts  # all requests in flight at once unless capped explicitly
    for k, v in base.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    r = 1.0 + a.range_ratio
    a.max_model_len = max_model_len_for(int(a.input_len * r) + 1, [int(L * r) + 1 for L in a.output_lens],
                                        a.block_size)
    a.offline_max_model_len = max_model_len_for(a.input_len, [a.offline_output_len], a.block_size)
    return a


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.offline_worker:
        offline_worker(*opts.offline_worker)
        return 0
    from tqdm import tqdm

    install_cleanup()
    t_start = time.time()
    out = Path(opts.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if opts.model is None:
        from vllm_contour.models import fetch_model

        opts.model = str(fetch_model("smollm2", quiet=True))
    for pool in opts.pools:
        if pool * opts.block_size < opts.max_model_len:
            raise SystemExit(f"pool {pool} x {opts.block_size} tokens < max model len {opts.max_model_len}")
    env = child_env(opts.kv_space)
    configs = kv_configs(opts.policies, opts.kv_cache_dtypes, opts.dtype)
    if opts.kv_cache_dtypes != ["auto"] and not opts.no_offline:
        raise SystemExit("--kv-cache-dtypes: the offline variant runs the model dtype's cache only (add --no-offline)")
    record: dict[str, Any] = {
        "args": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf") for k, v in vars(opts).items()},
        "host": {**machine(), "loadavg_at_start": os.getloadavg()}, "dtype": opts.dtype,
        "commands": [], "servers": [], "runs": [], "ratios": [], "overhead": [], "offline": [],
        "notes": {
            "tpot": "(latency - ttft) / (output_tokens - 1) per request, percentiles with linear interpolation",
            "overhead_pct_of_wall": "(policy_seconds + compact_seconds) / the run's duration: rounds (prompt end "
                                    "and decode time) run inside engine steps and stall the batch",
            "later_round_pct_of_wall": "later_round_seconds / the run's duration: the rounds of requests already "
                                       "compacted (decode-time rounds after each request's first round)",
            "mean_kv_tokens": "mean over the run's requests of each request's mean KV tokens per head held in "
                              "vLLM's pool over its life (the plugin's histograms); stock: *_est, every token "
                              "in whole blocks, no preemption",
            "loadavg": "1-min load average of the shared 2-core host, sampled with every poll: other jobs on "
                       "the host slow both configurations, and unequal load between them biases the ratios",
            "overhead_pct_of_ttft_sum": "(policy_seconds + compact_seconds) / sum of TTFTs (TTFT includes "
                                        "queueing: a lower bound on the overhead)",
            "kv_usage": "vllm:kv_cache_usage_perc (fraction of the pool) polled every poll_interval s",
            "pool": "KV pool in blocks of the model dtype's cache; blocks: what the server got (an fp8 cache: the "
                    "same bytes, one byte per element); ratios are against stock on the model dtype's cache",
            "peak_running": "max of vllm:num_requests_running over the polls",
            "host": "the machine: lscpu's model name, the flags that pick vLLM's CPU kernels and the dtype, the "
                    "CPU count and the load average when the run started (loadavg_at_end when it ended)",
            "client": opts.client,
            "VLLM_TARGET_DEVICE": "set to cpu for every child: vllm-contour's version patch hides '+cpu' from "
                                  "vLLM's platform detection (SIGILL in vllm._C on AVX2 otherwise)",
        },
    }
    n_serve = 0 if opts.no_serve else \
        len(opts.pools) * len(configs) * (1 + len(opts.output_lens) * len(opts.request_rate))
    n_off = 0 if opts.no_offline else len(configs) * len(opts.pools[:1])
    if opts.client == "inprocess" and not opts.no_serve:
        os.environ.setdefault("VLLM_TARGET_DEVICE", env["VLLM_TARGET_DEVICE"])
        import vllm.benchmarks.serve  # noqa: F401  (~20-30 s here; keeps it out of the timed runs)
    pbar = tqdm(total=n_serve + n_off, desc="serving bench", unit="step")
    status = "ok"
    try:
        if not opts.no_serve:
            for pool in opts.pools:
                for cfg in configs:
                    run_server_config({**cfg, "pool": pool}, opts, out, pbar, opts.model, env, record)
            record["ratios"] = ratio_table(record["runs"])
            record["fp8_ratios"] = fp8_ratios(record["runs"])
            record["overhead"] = finalize_overhead(record["runs"], record["servers"])
            _save(record, out)
        if not opts.no_offline:
            pool = opts.pools[0]
            for cfg in configs:
                pbar.set_description(f"offline {cfg['name']}")
                record["offline"].append(run_offline({**cfg, "pool": pool}, opts, out, opts.model, env, record))
                pbar.update(1)
                _save(record, out)
            record["offline_ratios"] = ratio_table(record["offline"], metrics=("output_tok_per_s",
                                                                                "total_tok_per_s", "peak_running",
                                                                                "mean_running"), keys=("pool",))
    except BaseException as e:
        status = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        pbar.close()
        stop_all_children()
        record["status"] = status
        record["wall_s"] = time.time() - t_start
        record["host"]["loadavg_at_end"] = os.getloadavg()
        if record["runs"] and not record["ratios"]:  # a failed run: tables of what was measured
            record["ratios"] = ratio_table(record["runs"])
            record["overhead"] = finalize_overhead(record["runs"], record["servers"])
        if record["runs"] or record["offline"]:
            try:
                record["plots"] = make_plots(record, out)
            except Exception as e:  # a plot failure must not hide the numbers
                record["plots_error"] = repr(e)
        _save(record, out)
        if record["runs"] or record["offline"]:
            print(write_report(record, out))
        print(f"\n{status}; wall {record['wall_s']:.0f} s; results in {out}")
    return 0


def _save(record: dict, out: Path) -> None:
    (out / "serving.json").write_text(json.dumps(stamp(record), indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
