"""What a decode-time round costs, and what the interval T buys: the sweep behind the default T.

For each interval T (and prefill-only, T = 0, and stock vLLM for reference), one offline engine (its own
subprocess: vLLM hosts one engine per process) runs the same batch: ``--requests`` prompts of
``--prompt-len`` random tokens, each generating ``--gen-len`` tokens (``ignore_eos``), greedy, eviction
at ``--budget`` tokens per head with ``--policy``, a pool large enough that nothing is preempted (so every
configuration runs the same batch and the time difference is the rounds' cost, plus the faster decode of
compacted rows). Measured per configuration:

- wall time of the whole batch and output tokens/s (ratio to stock, same run);
- round cost: the worker's time inside eviction rounds (plan + apply; timed around the worker side's round
  function in this process), per round per request (ms), and as a share of the run's wall time (the rounds
  stall the batch: every other request waits while they run);
- the mean and peak KV tokens per head each request held in vLLM's pool over its life (the plugin's own
  accounting, tested against vLLM's pool in tests/integration).

The machine's 1-minute load average is recorded before and after each run. Writes ``decode_rounds.json``.

    python -m benchmarks.decode_rounds [--intervals 32 64 128 256] [--requests 8] [--gen-len 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import md_table, stamp
from benchmarks.serving import machine

DTYPE = "float32"  # every engine of the run

REPO = Path(__file__).resolve().parents[1]


def worker(spec_path: str, out_path: str) -> None:
    """One engine, one batch (runs in its own process)."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import random

    from vllm import LLM, SamplingParams

    kw = dict(dtype=DTYPE, enforce_eager=True, block_size=32, enable_prefix_caching=False,
              max_model_len=spec["prompt_len"] + spec["gen_len"] + 64, num_gpu_blocks_override=spec["pool"],
              max_num_seqs=spec["requests"], seed=0)
    if spec["policy"]:
        kw["additional_config"] = {"kv_eviction": {"policy": spec["policy"], "budget": spec["budget"],
                                                   "decode_interval": spec["interval"]}}
    llm = LLM(spec["model"], **kw)
    core = llm.llm_engine.engine_core.engine_core
    round_s = [0.0, 0]
    if spec["policy"]:
        from vllm_contour.integration import worker_rounds

        orig = worker_rounds.WorkerRounds.run

        def timed(self, items, *args):
            t0 = time.perf_counter()
            orig(self, items, *args)
            round_s[0] += time.perf_counter() - t0
            round_s[1] += len(items)

        worker_rounds.WorkerRounds.run = timed
    rnd = random.Random(1)
    prompts = [{"prompt_token_ids": [rnd.randrange(100, 49000) for _ in range(spec["prompt_len"])]}
               for _ in range(spec["requests"])]
    sp = SamplingParams(max_tokens=spec["gen_len"], temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    round_s[:] = [0.0, 0]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    conn = core.scheduler.connector
    held = list(conn.totals.kv_held.values())[-spec["requests"]:] if conn is not None else []
    res = {"spec": spec, "wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
           "round_seconds": round_s[0], "rounds": round_s[1], "preemptions": None,
           "mean_kv_tokens": sum(m for m, _ in held) / len(held) if held else None,
           "peak_kv_tokens": max((p for _, p in held), default=None),
           "load1_before": load0, "load1_after": os.getloadavg()[0]}
    Path(out_path).write_text(json.dumps(res))


def run_config(name: str, spec: dict, out: Path) -> dict:
    spec_path, res_path = out / f"{name}.spec.json", out / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if not spec["policy"]:
        env["VLLM_PLUGINS"] = "none-allowed"
    with open(out / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "benchmarks.decode_rounds", "--worker", str(spec_path),
                        str(res_path)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    res = json.loads(res_path.read_text())
    res["name"] = name
    return res


def summarise(rows: list[dict]) -> list[dict]:
    stock = next((r for r in rows if r["name"] == "stock"), None)
    out = []
    for r in rows:
        req = r["spec"]["requests"]
        out.append({"config": r["name"], "T": r["spec"].get("interval"), "wall_s": r["wall_s"],
                    "out_tok_s": r["output_tokens"] / r["wall_s"],
                    "x_stock": (stock["wall_s"] / r["wall_s"]) if stock else None,
                    "rounds_per_request": r["rounds"] / req if r["rounds"] else 0,
                    "ms_per_round": 1e3 * r["round_seconds"] / r["rounds"] if r["rounds"] else None,
                    "round_pct_of_wall": 100 * r["round_seconds"] / r["wall_s"],
                    "mean_kv": r["mean_kv_tokens"], "peak_kv": r["peak_kv_tokens"],
                    "load": f"{r['load1_before']:.1f}-{r['load1_after']:.1f}"})
    return out


def table(summary: list[dict]) -> str:
    cols = [("config", "config"), ("T", "T"), ("wall_s", "wall s"), ("out_tok_s", "out tok/s"),
            ("x_stock", "x stock"), ("rounds_per_request", "rounds/request"), ("ms_per_round", "ms/round"),
            ("round_pct_of_wall", "round % of wall"), ("mean_kv", "mean KV/head"), ("peak_kv", "peak KV/head"),
            ("load", "load")]
    return md_table([c[1] for c in cols], [[s.get(k) for k, _ in cols] for s in summary], nd=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--intervals", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=512)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--no-stock", action="store_true")
    p.add_argument("--no-prefill-only", action="store_true")
    p.add_argument("--out", default=str(REPO / "results" / "decode_rounds"))
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return 0
    from vllm_contour.models import fetch_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = dict(model=str(fetch_model("smollm2", quiet=True)), requests=a.requests, prompt_len=a.prompt_len,
                gen_len=a.gen_len, budget=a.budget,
                pool=a.requests * ((a.prompt_len + a.gen_len) // 32 + 2) + 8)
    configs = [] if a.no_stock else [("stock", dict(base, policy=None, interval=None))]
    if not a.no_prefill_only:
        configs.append(("T=0", dict(base, policy=a.policy, interval=0)))
    configs += [(f"T={t}", dict(base, policy=a.policy, interval=t)) for t in a.intervals]
    t0 = time.time()
    rows = []
    for name, spec in configs:
        rows.append(run_config(name, spec, out))
        print(f"{name}: {rows[-1]['wall_s']:.1f} s", flush=True)
    summary = summarise(rows)
    record = stamp({"args": vars(a), "rows": rows, "summary": summary, "wall_s": time.time() - t0,
                    "host": machine(), "dtype": DTYPE})
    (out / "decode_rounds.json").write_text(json.dumps(record, indent=1))
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
