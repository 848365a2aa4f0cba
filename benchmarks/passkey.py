"""Passkey retrieval in a filler haystack, through real vLLM with the plugin (offline ``LLM.generate``).

One engine serves every configuration: the server default is a policy, each request picks its own policy
and budget through ``SamplingParams.extra_args`` (``kv_policy="none"`` = full cache). Budgets are given in
tokens per KV head per layer and as fractions of the context. Writes ``passkey.json`` and ``passkey.png``.

    python -m benchmarks.passkey [--quick] [--out DIR] [--policies streaming,snapkv] [--budgets 128,512,1024]
                                 [--modes aware,agnostic,score_only] [--dtype float32|bfloat16] [--runner v1|v2]
                                 [--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2]

Modes: ``aware`` = the policy scores the whole prompt, question included (common practice); ``agnostic`` =
``kv_context_len`` marks where the question starts: the prefill stops there, the context is compressed
without seeing the question, and the question is computed over the compressed cache (kvpress's protocol);
``score_only`` = the same boundary, but the whole prompt is prefilled over the full context and only the
scoring ignores the question (``kv_agnostic_mode="score_only"``, the plugin's protocol before 2026-12-01:
the question's keys, values and the first answer token saw the evicted tokens). Each configuration records
its wall time (``seconds``: the same prompts in every configuration, so agnostic / score_only is the cost of
computing the question over the compressed cache instead of densely). The JSON is rewritten after every configuration, and ``--resume`` skips configurations already in it
(same prompts: same seed, trials, context and model).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from benchmarks import serving, stamp

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
# in-process engine: the plugin's per-request KV accounting is read from the scheduler
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def make_prompt(tok, context_tokens: int, depth: float, key: int, chat: bool = False) -> tuple[list[int], int]:
    """Prompt whose haystack has ~context_tokens tokens, the needle at relative depth; plain completion
    text by default (a chat-formatted run on 2026-11-30 scored 1/10 even with the full cache: the model
    answered "The pass key is a magical key..."). Returns the token ids and the number of tokens before the
    question (the context boundary)."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    intro = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    filler_ids = tok.encode(FILLER, add_special_tokens=False)
    n_fill = max(1, (context_tokens - 80) // len(filler_ids))
    parts = [FILLER] * n_fill
    parts.insert(int(round(depth * n_fill)), needle)
    question = "What is the pass key? The pass key is"
    content = intro + "".join(parts)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": content + "\n" + question}],
                                       add_generation_prompt=True, tokenize=False)
    else:
        text = content + "\n" + question
    ids = tok.encode(text, add_special_tokens=False)
    q_ids = tok.encode("\n" + question, add_special_tokens=False)
    return list(ids), len(ids) - len(q_ids) - (8 if chat else 0)


def make_trials(tok, args) -> list[dict]:
    """The trials' prompts: the needle at evenly spread depths, keys drawn from ``args.seed``."""
    rnd = random.Random(args.seed)
    trials = []
    for i in range(args.trials):
        depth = (i + 0.5) / args.trials
        key = rnd.randrange(10000, 99999)
        ids, ctx = make_prompt(tok, args.context, depth, key, chat=args.chat)
        trials.append({"depth": depth, "key": key, "ids": ids, "context_len": ctx})
    return trials


def run(args) -> dict:
    from tqdm import tqdm

    if args.runner == "v2":  # vllm-cpu 0.32's Model Runner V2 needs Triton: the tests' interpreter set-up
        os.environ.update(VLLM_USE_V2_MODEL_RUNNER="1", TRITON_INTERPRET="1")
        from tests.integration import triton_on_cpu

        triton_on_cpu.enable()
    from vllm import LLM, SamplingParams

    if args.runner == "v2":
        triton_on_cpu.fast_greedy_sampler()  # greedy sampling in torch, not the interpreted Gumbel kernel

    from vllm_contour.models import fetch_model

    model = str(fetch_model(args.model, quiet=True))
    llm = LLM(model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True, max_model_len=4096,
              seed=0,
              enable_prefix_caching=False,  # every configuration prefills the same prompts
              additional_config={"kv_eviction": {"policy": "snapkv", "budget": 128}})
    tok = llm.get_tokenizer()
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    trials = make_trials(tok, args)
    n_tokens = len(trials[0]["ids"])
    configs = config_list(args, n_tokens)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    res = {"model": args.model, "prompt_tokens": n_tokens, "trials": args.trials, "seed": args.seed,
           "context": args.context, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "results": {},
           "seconds": 0.0, "runner": f"{type(runner).__module__}.{type(runner).__name__}",
           "date": time.strftime("%Y-%m-%d"),
           "machine": os.uname().nodename, "host": serving.machine()}
    out_json = Path(args.out) / "passkey.json"
    if args.resume and out_json.exists():
        old = json.loads(out_json.read_text())
        if all(old.get(k) == res[k] for k in ("model", "prompt_tokens", "trials", "seed", "context", "dtype",
                                               "runner", "kv_cache_dtype")):
            res["results"], res["seconds"] = old["results"], old.get("seconds", 0.0)
    t0 = time.time() - res["seconds"]
    for name, pol, budget, mode in tqdm(configs, desc="configs"):
        if name in res["results"]:
            continue
        extra = {"kv_policy": pol} if budget is None else {"kv_policy": pol, "kv_budget": budget}
        sps = []
        for t in trials:
            e = extra
            if mode != "aware" and budget:
                e = dict(extra, kv_context_len=t["context_len"])
                if mode == "score_only":
                    e["kv_agnostic_mode"] = "score_only"
            sps.append(SamplingParams(max_tokens=10, temperature=0, extra_args=e))
        t_cfg = time.time()
        outs = llm.generate([{"prompt_token_ids": t["ids"]} for t in trials], sps, use_tqdm=False)
        t_cfg = time.time() - t_cfg
        hits = [str(t["key"]) in o.outputs[0].text for t, o in zip(trials, outs)]
        by_id = {k.split("-")[0]: v for k, v in conn.totals.kv_held.items()} if conn is not None else {}
        held = [by_id.get(o.request_id.split("-")[0]) for o in outs]
        held = [h for h in held if h is not None]
        res["results"][name] = {"policy": pol, "budget": budget, "mode": mode, "correct": sum(hits),
                                "trials": len(hits), "answers": [o.outputs[0].text for o in outs],
                                "seconds": t_cfg,
                                # mean / peak KV tokens per head held in vLLM's pool over each request's life
                                # (prefill step included), averaged over the trials
                                "mean_kv_tokens": sum(m for m, _ in held) / len(held) if held else None,
                                "peak_kv_tokens": sum(p for _, p in held) / len(held) if held else None}
        res["seconds"] = time.time() - t0
        out_json.write_text(json.dumps(stamp(res, getattr(args, "argv", None)), indent=1))
    return res


def kvpress_spec(args, model: str, trials: list[dict]) -> dict:
    """The runner's input: every trial's context and question as the engine's token ids, each press at each
    budget (tokens per head; kvpress's compression ratio = 1 - budget / context), plus kvpress's full cache."""
    samples = [{"idx": i, "context_ids": t["ids"][: t["context_len"]], "question_ids": t["ids"][t["context_len"]:],
                "max_new": 10, "answers": [str(t["key"])]} for i, t in enumerate(trials)]
    configs = [{"name": "kvpress:none", "press": "none", "budget": None}]
    configs += [{"name": f"kvpress:{p}@{b}/agn", "press": p, "budget": int(b)}
                for p in args.kvpress.split(",") for b in args.budgets.split(",") if b]
    return {"model": model, "samples": samples, "configs": configs}


def kvpress_results(rows: list[dict]) -> dict:
    """Runner rows -> result entries like the engine's: correct / trials and the KV tokens per head that
    kvpress keeps unmasked after compressing the context (``kept_kv_tokens``) and that its cache still holds
    (``held_kv_tokens``: masked entries stay), each averaged over the trials."""
    out: dict[str, dict] = {}
    for r in rows:
        e = out.setdefault(r["config"], {"policy": f"kvpress:{r['press']}", "budget": r["budget"],
                                         "mode": "agnostic", "correct": 0, "trials": 0, "answers": [],
                                         "seconds": 0.0, "kept": [], "held": []})
        e["correct"] += any(a in r["pred"] for a in r["answers"])
        e["trials"] += 1
        e["answers"].append(r["pred"])
        e["seconds"] += r["seconds"]
        per_token = r["entry_bytes"] * r["heads_layers"]
        e["kept"].append(r["unmasked_context_bytes"] / per_token)
        e["held"].append(r["context_bytes"] / per_token)
    for e in out.values():
        kept, held = e.pop("kept"), e.pop("held")
        e["kept_kv_tokens"], e["held_kv_tokens"] = sum(kept) / len(kept), sum(held) / len(held)
    return out


def run_kvpress(args, res: dict, out: Path) -> None:
    """kvpress on the trials the engine answered (the same token ids), in its own venv; adds its entries."""
    import subprocess

    from benchmarks.audit import ensure_venv
    from vllm_contour.models import fetch_model

    with open(out / "kvpress-install.log", "w") as log:
        py, why = ensure_venv(Path(args.kvpress_venv), log)
    if py is None:
        res["kvpress"] = f"not run: {why}"
        return
    from transformers import AutoTokenizer

    model = str(fetch_model(args.model, quiet=True))
    spec = kvpress_spec(args, model, make_trials(AutoTokenizer.from_pretrained(model), args))
    (out / "kvpress_in.json").write_text(json.dumps(spec))
    runner = Path(__file__).resolve().parent / "kvpress_runner.py"
    r = subprocess.run([str(py), str(runner), str(out / "kvpress_in.json"), str(out / "kvpress_out.json")])
    if r.returncode != 0:
        res["kvpress"] = f"runner failed (rc {r.returncode})"
        return
    got = json.loads((out / "kvpress_out.json").read_text())
    res["kvpress"] = got["versions"]
    res["results"].update(kvpress_results(got["rows"]))


# mode -> suffix of the configuration names
MODES = {"aware": "", "agnostic": "/agn", "score_only": "/so"}


def config_list(args, n_tokens: int) -> list[tuple[str, str, int | None, str]]:
    """(name, policy, budget per head or None for the full cache, mode) for every configuration."""
    configs = [("full", "none", None, "aware")]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    fracs = [float(f) for f in args.fractions.split(",")] if args.fractions else []
    modes = [m.strip() for m in args.modes.split(",")]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r} ({', '.join(MODES)})")
    for pol in args.policies.split(","):
        for mode in modes:
            suffix = MODES[mode]
            for b in budgets:
                configs.append((f"{pol}@{b}{suffix}", pol, b, mode))
            for f in fracs:
                configs.append((f"{pol}@{int(f * 100)}%{suffix}", pol, max(32, int(f * n_tokens)), mode))
    return configs


def table(res: dict) -> str:
    """Policy x budget grid of correct/trials, one column per (budget, mode)."""
    rows: dict[str, dict[str, str]] = {}
    cols: list[str] = []
    for name, r in res["results"].items():
        if r["budget"] is None:
            rows.setdefault("full cache", {})["all"] = f"{r['correct']}/{r['trials']}"
            continue
        col = name.split("@", 1)[1]
        if col not in cols:
            cols.append(col)
        rows.setdefault(r["policy"], {})[col] = f"{r['correct']}/{r['trials']}"
    cols = cols or ["all"]
    head = f"{'policy':<20}" + "".join(f"{c:>11}" for c in cols)
    lines = [head]
    for pol, cells in rows.items():
        if pol == "full cache":
            lines.append(f"{pol:<20}" + f"{cells['all']:>11}" + " (every column)")
        else:
            lines.append(f"{pol:<20}" + "".join(f"{cells.get(c, '-'):>11}" for c in cols))
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Heat map: one row per policy (full cache on top), one column per budget/mode, cells = correct."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols, cols, cell = [], [], {}
    for name, r in res["results"].items():
        pol = "full cache" if r["budget"] is None else r["policy"]
        col = "all" if r["budget"] is None else name.split("@", 1)[1]
        if pol not in pols:
            pols.append(pol)
        if col != "all" and col not in cols:
            cols.append(col)
        cell[(pol, col)] = r["correct"]
    cols = cols or ["all"]
    grid = [[cell.get((p, c), cell.get((p, "all"), float("nan"))) for c in cols] for p in pols]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.0 + 0.8 * len(cols)), 1.6 + 0.35 * len(pols)))  # one column: room for the titles
    im = ax.imshow(grid, vmin=0, vmax=res["trials"], cmap="viridis", aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", color="w" if v < res["trials"] / 2 else "k")
    ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right")
    ax.set_yticks(range(len(pols)), pols)
    fig.colorbar(im, ax=ax, label=f"correct / {res['trials']}")
    ax.set_xlabel("budget (tokens per head); /agn = query-agnostic")
    pages = res.get("kv_cache_dtype", "auto")
    pages = "" if pages == "auto" else f", {pages} pages"
    ax.set_title(f"passkey, {res['prompt_tokens']}-token prompt ({res['model']}, {res.get('dtype', 'float32')}{pages})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 trials, budgets 128,512")
    ap.add_argument("--out", default="results")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--policies", default="streaming,snapkv")
    ap.add_argument("--budgets", default="128,512,1024")
    ap.add_argument("--fractions", default="")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    ap.add_argument("--modes", default="aware", help="aware,agnostic,score_only (see above)")
    ap.add_argument("--resume", action="store_true", help="keep configurations already in the JSON")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the engine's dtype")
    ap.add_argument("--runner", choices=["v1", "v2"], default="v1",
                    help="vLLM's model runner: v2 = Model Runner V2 (on vllm-cpu 0.32 under Triton's interpreter, "
                         "as the tests run it)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], default="auto",
                    help="vLLM's --kv-cache-dtype: auto (the engine's dtype) or fp8 pages (CPU: e4m3 / e5m2 bytes)")
    ap.add_argument("--kvpress", default="", help="kvpress presses (kvzip,knorm,snapkv,...) run on the same "
                    "samples query-agnostic at --budgets, in kvpress's own venv (benchmarks.audit), fp32")
    ap.add_argument("--kvpress-venv", default=str(Path(__file__).resolve().parents[1] / "results" / ".kvpress-venv"))
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.trials, args.budgets = 3, "128,512"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    if args.kvpress:
        run_kvpress(args, res, out)
    (out / "passkey.json").write_text(json.dumps(stamp(res, args.argv), indent=1))
    plot(res, out / "passkey.png")
    print(table(res))
    print(f"prompt tokens {res['prompt_tokens']}, {res['seconds']:.0f} s -> {out / 'passkey.json'}")


if __name__ == "__main__":
    main()
