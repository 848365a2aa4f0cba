"""Audit: the same RULER-style samples through NVIDIA kvpress and through this project, at the same nominal
budgets, reporting accuracy AND the KV bytes actually held after compression.

kvpress pins transformers < 5.3, so it runs in its own virtualenv (created on first use under
``results/.kvpress-venv``: ``torch==2.13.0+cpu`` first, from the local wheel, then ``kvpress`` and
``transformers<5.3``; pip is never allowed to swap torch) as a subprocess (benchmarks/kvpress_runner.py)
that loads the converted model dir with HF transformers. kvpress runs query-agnostic (its pipeline compresses
the context before the question), with compression_ratio = 1 - budget / context_len; this project runs the
matching presets query-agnostic (``kv_context_len``) at the same budgets.

Bytes held after the prompt:
- kvpress: numel × element size of every key/value tensor in its DynamicCache after compressing the context
  (masked entries included: AdaKV keeps the whole cache and masks it), plus the question tokens held dense.
- here: blocks the request holds in vLLM's pool right after the step that completed its prompt (the
  context's round applied, the question's blocks dense) × block bytes; later decode-time rounds not counted.

    python -m benchmarks.audit [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import stamp

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parents[1]
# kvpress press name -> this project's preset
PAIRS = {"snapkv": "snapkv", "streaming": "streaming", "expected_attention": "expected_attention",
         "adakv_snapkv": "adakv"}
# Quick: the task the default model solves with the full cache at 1K tokens (ruler --quick, 2026-11-30:
# niah_multikey 100 at 1K and 2K; niah_single_noise and vt 0 at 1K), so accuracy can move both ways.
QUICK_TASKS = "niah_multikey"


def ensure_venv(venv: Path, log) -> tuple[Path | None, str]:
    """-> (python of a venv with kvpress, '') or (None, why). Installs torch first so pip keeps it."""
    py = venv / "bin" / "python"
    check = [str(py), "-c", "import kvpress, transformers, torch; print(kvpress.__file__, transformers.__version__,"
             " torch.__version__)"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py, ""
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(py), "-m", "pip", "install", "torch==2.13.0+cpu"],
             [str(py), "-m", "pip", "install", "torch==2.13.0+cpu", "kvpress", "transformers<5.3"]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        log.write(f"$ {' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}\n")
        if r.returncode != 0:
            return None, f"{' '.join(cmd)} failed (rc {r.returncode}): {r.stderr.strip()[-1500:]}"
    r = subprocess.run(check, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"kvpress installed but does not import: {r.stderr.strip()[-1500:]}"
    if "+cpu" not in r.stdout:
        return None, f"pip replaced torch with a non-CPU build: {r.stdout.strip()}"
    return py, ""


def ruler_summary(rows: list[dict]) -> dict:
    from benchmarks.ruler import SCORERS, METRIC, postprocess_pred

    out: dict = {}
    for r in rows:
        c = out.setdefault(r["key"], {"system": r["system"], "method": r["method"], "budget": r["budget"],
                                      "scores": [], "bytes": [], "unmasked": []})
        c["scores"].append(SCORERS[METRIC[r["task"]]]([postprocess_pred(r["pred"])], [r["answers"]]))
        c["bytes"].append(r["held_bytes"])
        c["unmasked"].append(r.get("unmasked_bytes", r["held_bytes"]))
    table = []
    for key, c in out.items():
        n = len(c["scores"])
        table.append({"system": c["system"], "method": c["method"], "budget": c["budget"], "samples": n,
                      "accuracy": sum(c["scores"]) / n, "held_mib": sum(c["bytes"]) / n / 2**20,
                      "unmasked_mib": sum(c["unmasked"]) / n / 2**20})
    return table


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sysname, marker in (("kvpress", "o"), ("vllm-contour", "s")):
        pts = [r for r in table if r["system"] == sysname]
        ax.scatter([r["held_mib"] for r in pts], [r["accuracy"] for r in pts], marker=marker, label=sysname)
        for r in pts:
            ax.annotate(f"{r['method']}@{r['budget']}", (r["held_mib"], r["accuracy"]), fontsize=6)
    ax.set_xlabel("KV MiB held after the prompt (mean per request)")
    ax.set_ylabel("RULER score")
    ax.set_xscale("log")
    ax.legend()
    ax.set_title("accuracy vs bytes actually held")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="results/audit")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tasks", default=None)
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--budgets", default="64,128,256,10%,20%,40%")
    ap.add_argument("--venv", default=str(ROOT / "results" / ".kvpress-venv"))
    ap.add_argument("--skip-kvpress", action="store_true")
    args = ap.parse_args()
    from benchmarks.ruler import TASKS, make_samples, run_engine

    if args.quick:
        args.tasks = args.tasks or QUICK_TASKS
        args.lengths, args.samples, args.budgets = "1024", 3, "128,40%"
    tasks = (args.tasks or ",".join(TASKS)).split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [b if b.endswith("%") else int(b) for b in args.budgets.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from vllm_contour.models import fetch_model

    model = str(fetch_model(args.model, quiet=True))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    t_start = time.time()
    samples = make_samples(tok, tasks, lengths, args.samples)
    for s in samples:  # the pieces kvpress's pipeline needs (it applies the chat template itself)
        from benchmarks.ruler import _rng, _task_parts

        build, _, _ = _task_parts(s["task"], _rng(s["task"], s["length"], s["idx"], s["seed"]), s["idx"], s["seed"])
        s["content"], s["question"], s["answer_prefix"] = build(s["units"])
    rows: list[dict] = []
    timings = {}
    kv_status = "skipped (--skip-kvpress)"
    # ---- kvpress ------------------------------------------------------------------------------
    if not args.skip_kvpress:
        t0 = time.time()
        with open(out / "kvpress-install.log", "w") as log:
            py, why = ensure_venv(Path(args.venv), log)
        timings["kvpress_venv_s"] = time.time() - t0
        if py is None:
            kv_status = f"not run: {why}"
            print(f"kvpress: {kv_status}", flush=True)
        else:
            cfgs = [{"name": "full", "press": "none", "budget": None}]
            cfgs += [{"name": f"{p}@{b}", "press": p, "budget": b} for p in PAIRS for b in budgets]
            spec = {"model": model, "configs": cfgs,
                    "samples": [{k: s[k] for k in ("task", "length", "idx", "content", "question", "answer_prefix",
                                                   "max_new", "answers")} for s in samples]}
            (out / "kvpress_in.json").write_text(json.dumps(spec))
            t0 = time.time()
            r = subprocess.run([str(py), str(ROOT / "benchmarks" / "kvpress_runner.py"), str(out / "kvpress_in.json"),
                                str(out / "kvpress_out.json")], cwd=str(ROOT))
            timings["kvpress_run_s"] = time.time() - t0
            if r.returncode != 0:
                kv_status = f"runner failed (rc {r.returncode}); see its output above"
            else:
                kv = json.loads((out / "kvpress_out.json").read_text())
                kv_status = f"ok {kv['versions']}"
                for x in kv["rows"]:
                    rows.append({"system": "kvpress", "method": x["press"], "budget": x["budget"] or "full",
                                 "key": f"kvpress/{x['config']}", "task": x["task"], "pred": x["pred"],
                                 "answers": x["answers"], "held_bytes": x["held_bytes"],
                                 "unmasked_bytes": x["held_bytes"] - x["context_bytes"] + x["unmasked_context_bytes"],
                                 "context_bytes": x["context_bytes"], "compression_ratio": x["compression_ratio"]})
    # ---- this project -------------------------------------------------------------------------------
    from benchmarks.ruler import make_configs

    configs = make_configs(sorted(set(PAIRS.values()), key=list(PAIRS.values()).index),
                           [b for b in budgets if isinstance(b, int)],
                           [float(b[:-1]) / 100 for b in budgets if isinstance(b, str)], modes=("agnostic",))
    t0 = time.time()
    vrows, info = run_engine(model, samples, configs)
    timings["vllm_run_s"] = time.time() - t0
    for x in vrows:
        rows.append({"system": "vllm-contour", "method": x["policy"] if x["policy"] != "none" else "none",
                     "budget": x["budget"] or "full", "key": f"vllm/{x['config']}", "task": x["task"],
                     "pred": x["pred"], "answers": x["answers"], "held_bytes": x["held_bytes"],
                     "record": x["record"]})
    table = ruler_summary(rows)
    from benchmarks.serving import machine

    res = {"model": args.model, "args": vars(args), "kvpress": kv_status, "engine": info, "timings": timings,
           "host": machine(), "dtype": "float32",  # benchmarks.ruler.run_engine's engine
           "table": table, "rows": rows, "wall_seconds": time.time() - t_start, "date": time.strftime("%Y-%m-%d"),
           "samples": [{k: s[k] for k in ("task", "length", "idx", "context_len", "answers")} for s in samples]}
    (out / "audit.json").write_text(json.dumps(stamp(res), indent=1))
    plot(table, out / "audit.png")
    print(f"kvpress: {kv_status}")
    print(f"{'system':<14}{'press/policy':<20}{'budget':>8}{'MiB held':>10}{'unmasked':>10}{'accuracy':>10}")
    for r in table:
        print(f"{r['system']:<14}{r['method']:<20}{str(r['budget']):>8}{r['held_mib']:10.2f}{r['unmasked_mib']:10.2f}"
              f"{r['accuracy']:10.1f}")
    print(f"{len(samples)} samples; {res['wall_seconds']:.0f} s -> {out / 'audit.json'}")


if __name__ == "__main__":
    main()
