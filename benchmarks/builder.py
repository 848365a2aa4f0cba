"""Per-step cost of the metadata builder's compacted rows: page tables kept as state (``PageTables``: the
step's row matching and, for the CPU kernels, the per-token tables expanded with tensor ops) against
rebuilding every compacted row's table from its layout each step (``layout.decode_page_table`` per request
and a Python loop per token, what the builder did before).

    python -m benchmarks.builder [--out DIR] [--requests 1,4,16,64] [--reps 200]

Default model shape (SmolLM2-135M: 30 layers, 3 KV heads, block 32), budget 128 + a tail of up to 64 tokens
per request, one decode token per request and as many ordinary rows. Times are the calling thread's CPU
time (``time.thread_time``), medians over repetitions interleaved between the two ways. Writes
``builder.json`` (+ ``builder.png``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks import stamp

LAYERS, H, BS = 30, 3, 32


def scenario(n: int, seed: int = 0):
    from benchmarks.page_table_cases import Req, batch_tensors, key_of, random_layout

    rnd = random.Random(seed)
    free = list(range(1, 20000))
    rnd.shuffle(free)
    reqs = []
    for i in range(n):
        region = 4 + rnd.randint(0, 2)
        tail = rnd.randint(0, 63)
        blocks = [free.pop() for _ in range(region + 3)]
        lay = random_layout(rnd, LAYERS, H, BS, blocks[:4], region)  # budget 128: 4 blocks
        table = lay.block_ids + [0] * (region - lay.kept_blocks) + blocks[region:]
        reqs.append(Req(f"c{i}", table, region * BS + tail, 1, lay))
        n_ord = rnd.randint(100, 900)
        reqs.append(Req(f"o{i}", [free.pop() for _ in range((n_ord + BS) // BS)], n_ord, 1))
    rnd.shuffle(reqs)
    qsl, seq, bt = batch_tensors(reqs, width=32)
    return reqs, qsl, seq, bt, {r.req_id: key_of(r, BS) for r in reqs}


def incremental(reqs, qsl, seq, bt, keys):
    from vllm_contour.page_tables import PageTables

    pt = PageTables(LAYERS, H, BS, 20000)
    for r in reqs:
        if r.layout is not None:
            pt.put(r.req_id, r.layout)

    def step():
        step_reqs = pt.set_keys(keys, [])
        rows, _ = pt.step(step_reqs, qsl, seq, bt, len(reqs), int(qsl[-1]), int(seq.max()))
        rows.stock_seq_lens(seq)
        return rows.tables_for_cpu()

    return step


def rebuilt(reqs, qsl, seq, bt, keys):
    """The previous builder: a Python pass over the batch, a fresh table per compacted request, one padded
    row per token."""
    from vllm_contour.layout import decode_page_table

    by_key = {keys[r.req_id]: r for r in reqs if r.layout is not None}

    def step():
        q = qsl.tolist()
        s = seq.tolist()
        first = [s[i] - (q[i + 1] - q[i]) for i in range(len(s))]
        cols = torch.tensor([min(p // BS, bt.shape[1] - 1) for p in first])
        row_keys = bt[torch.arange(len(s)), cols].tolist()
        tables, lens = [], []
        for i, key in enumerate(row_keys):
            r = by_key.get(key)
            if r is None:
                continue
            e = r.layout.region_blocks
            tail = s[i] - e * BS
            n_tail = (tail + BS - 1) // BS
            t, ln = decode_page_table(r.layout, bt[i, e: e + n_tail].tolist(), tail)
            for j in range(q[i + 1] - q[i]):
                tables.append(t)
                lens.append(ln - (q[i + 1] - q[i] - 1 - j))
        width = max(t.shape[2] for t in tables)
        out = torch.zeros((LAYERS, len(tables), H, width), dtype=torch.int32)
        for i, t in enumerate(tables):
            out[:, i, :, : t.shape[2]] = t
        return out, torch.stack(lens, dim=1)

    return step


def bench(fns: dict, reps: int) -> dict:
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.thread_time()
            f()
            times[k].append((time.thread_time() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def table(res: dict) -> str:
    from benchmarks import md_table

    rows = [[r["compacted_requests"], r["batch_rows"], r["incremental_ms"], r["rebuilt_ms"], r["speedup"]]
            for r in res["rows"]]
    return md_table(["compacted requests", "batch rows", "tables kept as state, ms", "rebuilt every step, ms",
                     "rebuilt / kept"], rows, nd=3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/builder")
    ap.add_argument("--requests", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for n in (int(x) for x in a.requests.split(",")):
        sc = scenario(n)
        ms = bench({"incremental": incremental(*sc), "rebuilt": rebuilt(*sc)}, a.reps)
        rows.append({"compacted_requests": n, "batch_rows": 2 * n, "incremental_ms": ms["incremental"],
                     "rebuilt_ms": ms["rebuilt"], "speedup": ms["rebuilt"] / ms["incremental"]})
        print(f"[builder] {n:3d} compacted + {n} ordinary rows: incremental {ms['incremental']:.3f} ms, "
              f"rebuilt {ms['rebuilt']:.3f} ms ({ms['rebuilt'] / ms['incremental']:.1f}x)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = stamp({"benchmark": "builder", "cpu": platform.processor() or platform.machine(),
                 "shape": {"layers": LAYERS, "kv_heads": H, "block_size": BS}, "rows": rows,
                 "load": list(__import__("os").getloadavg())}, argv)
    (out / "builder.json").write_text(json.dumps(res, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        xs = [r["compacted_requests"] for r in rows]
        ax.plot(xs, [r["incremental_ms"] for r in rows], "o-", label="tables kept as state")
        ax.plot(xs, [r["rebuilt_ms"] for r in rows], "s--", label="rebuilt every step")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("compacted requests in the step")
        ax.set_ylabel("builder CPU ms per step")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "builder.png", dpi=110)
    except ImportError:
        pass
    print(f"[builder] wrote {out / 'builder.json'}")


if __name__ == "__main__":
    main()
