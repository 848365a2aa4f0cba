"""What an eviction round costs per request when 1, 4 or 16 requests are due in the same step: rounds one
request after another (plan, apply) against the step's rounds together as the worker runs them
(first rounds planned one by one, decode-time rounds in one policy pass, ``evictor.plan_rounds``; then
``evictor.apply_rounds``: one compaction per layer for all of them).

    python -m benchmarks.rounds [--out DIR] [--requests 1,4,16] [--dtype bf16|fp32] [--reps 3]

Default model shape (SmolLM2-135M: 30 layers, 3 KV heads, 9 query heads, head dim 64, block 32), the
engine's cache layout for the dtype on this CPU (bf16 on AMX: vLLM's AMX packing), ``snapkv`` at budget 128
with the default window and T = 64. Two kinds of round: the first (a 2,000-token prompt compressed) and a
decode-time round (kept run + T new tokens). Synthetic keys and values; the caches are restored between
repetitions. Wall time of the calling process with the machine's threads, median over repetitions; the
machine's 1-minute load is recorded. Writes ``rounds.json`` (+ ``rounds.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks import md_table, stamp

LAYERS, H, HQ, D, BS = 30, 3, 9, 64, 32
PROMPT, T, BUDGET = 2000, 64, 128


def _caches(n_req: int, dtype, amx: bool):
    from vllm_contour.ops.cpu_layout import KEY_TRANSPOSED, PageLayout, cpu_kv_views

    per_req = (PROMPT + 4 * T) // BS + 2
    nb = n_req * per_req + 1
    g = torch.Generator().manual_seed(0)
    stores = [torch.randn(nb, H, BS, 2 * D, generator=g).to(dtype) for _ in range(LAYERS)]
    layout = PageLayout.amx_bf16(BS, D) if amx else KEY_TRANSPOSED
    views = [cpu_kv_views(s, layout) for s in stores]
    blocks = [list(range(1 + r * per_req, 1 + (r + 1) * per_req)) for r in range(n_req)]
    return stores, views, blocks


def _plans(views, blocks, n_tokens, prevs, params, pb, queries):
    from vllm_contour.evictor import plan_round

    out = []
    for r, ids in enumerate(blocks):
        qpos = torch.arange(n_tokens[r] - params.window, n_tokens[r])
        t0 = time.perf_counter()
        out.append(plan_round(views, ids, n_tokens[r], params, pb, D ** -0.5, prev=prevs[r], queries=queries,
                              query_positions=qpos))
        out[-1].seconds = time.perf_counter() - t0
    return out


def _plans_together(views, blocks, n_tokens, prevs, params, pb, queries):
    """The worker's way: first rounds one by one, decode-time rounds in one ``plan_rounds`` call."""
    from vllm_contour.evictor import RoundRequest, plan_rounds

    if any(p is None for p in prevs):
        return _plans(views, blocks, n_tokens, prevs, params, pb, queries)
    reqs = [RoundRequest(ids, n_tokens[r], prevs[r], queries, torch.arange(n_tokens[r] - params.window, n_tokens[r]))
            for r, ids in enumerate(blocks)]
    return plan_rounds(views, reqs, params, pb, D ** -0.5)


def _run(views, blocks, params, pb, queries, batched: bool) -> dict:
    """The first round of every request, then one decode-time round of every request; -> seconds."""
    from vllm_contour.evictor import apply_round, apply_rounds

    n = len(blocks)
    res = {}
    prevs = [None] * n
    tokens = [PROMPT] * n
    for kind in ("first", "decode"):
        t0 = time.perf_counter()
        if batched:
            plans = _plans_together(views, blocks, tokens, prevs, params, pb, queries)
            prevs = apply_rounds(views, plans)
        else:
            plans = []
            for r in range(n):
                (p,) = _plans(views, blocks[r:r + 1], tokens[r:r + 1], prevs[r:r + 1], params, pb, queries)
                prevs[r] = apply_round(views, p)
                plans.append(p)
        res[kind] = time.perf_counter() - t0
        res[kind + "_plan"] = sum(p.seconds for p in plans)
        tokens = [prevs[r].region_blocks * BS + T for r in range(n)]
    return res


def measure(n_req: int, dtype, amx: bool, reps: int) -> dict:
    from vllm_contour.budget import page_budget
    from vllm_contour.config import EvictionConfig, resolve_request

    stores, views, blocks = _caches(n_req, dtype, amx)
    pristine = [s.clone() for s in stores]
    params = resolve_request(EvictionConfig(policy="snapkv", budget=BUDGET), None)
    pb = page_budget(params.budget, num_kv_heads=H, block_size=BS, head_dim=D, elem_size=stores[0].element_size(),
                     sink_tokens=params.sink_tokens, recent_window=params.recent_window, moments=False)
    g = torch.Generator().manual_seed(1)
    queries = {layer: torch.randn(HQ, params.window, D, generator=g) for layer in range(LAYERS)}
    times = {True: [], False: []}
    for rep in range(reps + 1):  # the first repetition warms up
        for batched in (False, True):
            for s, p in zip(stores, pristine):
                s.copy_(p)
            r = _run(views, blocks, params, pb, queries, batched)
            if rep:
                times[batched].append(r)
    out = {"requests": n_req}
    for batched, name in ((False, "one_by_one"), (True, "together")):
        for kind in ("first", "decode", "first_plan", "decode_plan"):
            out[f"{name}_{kind}_ms"] = statistics.median(x[kind] for x in times[batched]) * 1e3 / n_req
    return out


def table(res: dict) -> str:
    rows = [[r["requests"], r["one_by_one_first_ms"], r["together_first_ms"], r["one_by_one_decode_ms"],
             r["together_decode_ms"], r["together_decode_plan_ms"]] for r in res["rows"]]
    return md_table(["requests due", "first round, one by one", "first round, together",
                     "decode round, one by one", "decode round, together", "of which planning"], rows, nd=1)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    n = [r["requests"] for r in res["rows"]]
    for ax, kind, title in ((axes[0], "first", "first round (2,000-token prompt)"),
                            (axes[1], "decode", "decode-time round (T = 64)")):
        ax.plot(n, [r[f"one_by_one_{kind}_ms"] for r in res["rows"]], "o-", label="one by one")
        ax.plot(n, [r[f"together_{kind}_ms"] for r in res["rows"]], "s-", label="together")
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("requests due in the step")
        ax.set_ylabel("ms per request")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"round cost per request ({res['dtype']}, {res['cache_layout']}, {res['threads']} threads)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/rounds")
    ap.add_argument("--requests", default="1,4,16")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    from vllm_contour import ops  # noqa: F401  (loads the C++ kernels)
    from vllm_contour.cpu_dtype import cpu_flags

    flags = cpu_flags()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    amx = a.dtype == "bf16" and "amx_bf16" in flags
    res = {"dtype": a.dtype, "cache_layout": "amx_bf16" if amx else "key_transposed", "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "cpu_flags": sorted(f for f in flags if f.startswith(("amx", "avx512", "avx2"))),
           "shape": {"layers": LAYERS, "kv_heads": H, "q_heads": HQ, "head_dim": D, "block": BS},
           "prompt": PROMPT, "interval": T, "budget": BUDGET, "policy": "snapkv", "rows": []}
    res["load_before"] = os.getloadavg()[0]
    for n in (int(x) for x in a.requests.split(",")):
        row = measure(n, dtype, amx, a.reps)
        res["rows"].append(row)
        print(f"[rounds] {n:2d} due: first {row['one_by_one_first_ms']:.1f} -> {row['together_first_ms']:.1f} ms, "
              f"decode {row['one_by_one_decode_ms']:.1f} -> {row['together_decode_ms']:.1f} ms per request "
              f"(one by one -> together; planning {row['together_decode_plan_ms']:.1f})", flush=True)
    res["load_after"] = os.getloadavg()[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rounds.json").write_text(json.dumps(stamp(res), indent=1))
    plot(res, out / "rounds.png")
    print(table(res))


if __name__ == "__main__":
    main()
