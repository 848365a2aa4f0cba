"""An equivalence run of the eviction core: for every preset, moments off and on, one request's first round
and two decode-time rounds on a random paged cache (the CPU ``vec`` layout, fp32), through the evictor as
the worker drives it (``evictor.plan_rounds`` then ``apply_rounds``). Records, after each round, every
layer's and head's kept positions, the moment pages and a SHA-256 of the whole cache's bytes, so two
checkouts of the project can be compared round for round (``--compare A.json B.json``).

    python -m benchmarks.equivalence --out equivalence.json
    python -m benchmarks.equivalence --compare before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

L, H, HQ, BS, D = 4, 2, 6, 16, 32  # layers, KV heads, query heads, block size, head dim
BLOCKS, PROMPT, BUDGET, INTERVAL, W = 64, 600, 128, 32, 16


def _views(seed: int):
    from vllm_contour.ops.cpu_layout import KEY_TRANSPOSED, cpu_kv_views

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(L):
        kv = torch.randn(BLOCKS, H, BS, 2 * D, generator=g)
        out.append(cpu_kv_views(kv, KEY_TRANSPOSED))
    return out


def _digest(views) -> str:
    h = hashlib.sha256()
    for k, v in views:
        h.update(k.contiguous().numpy().tobytes())
        h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def run_preset(name: str, moments: bool) -> list[dict]:
    from vllm_contour.budget import page_budget
    from vllm_contour.config import EvictionConfig, resolve_request
    from vllm_contour.evictor import RoundRequest, apply_rounds, plan_rounds
    from vllm_contour.policies import build_policy

    params = resolve_request(EvictionConfig(policy=name, budget=BUDGET, recent_window=16, sink_tokens=4,
                                            window=W, moment_correction=moments), None)
    budget = page_budget(BUDGET, num_kv_heads=H, block_size=BS, head_dim=D, elem_size=4, sink_tokens=4,
                         recent_window=16, moments=moments)
    pol = build_policy(name, params.policy_args, sink_tokens=4, recent_window=16)
    views = _views(1)
    g = torch.Generator().manual_seed(2)
    blocks = list(range(1, BLOCKS))
    layout, rows = None, []
    for n_tokens in (PROMPT, PROMPT // BS * BS + INTERVAL, PROMPT // BS * BS + 2 * INTERVAL):
        q = {layer: torch.randn(HQ, W, D, generator=g) for layer in range(L)}
        qpos = torch.arange(n_tokens - W, n_tokens)
        recon = torch.rand(L, H, n_tokens, generator=g) if pol.needs_reconstruction else None
        req = RoundRequest(blocks, n_tokens, layout, q if pol.needs_queries else None,
                           qpos if pol.needs_queries else None, None, recon)
        (plan,) = plan_rounds(views, [req], params, budget, D ** -0.5, pol, None)
        if plan is None:
            rows.append({"tokens": n_tokens, "plan": None, "cache": _digest(views)})
            continue
        apply_rounds(views, [plan])
        layout = plan.layout
        rows.append({"tokens": n_tokens, "positions": layout.positions.tolist(), "pages": layout.pages.tolist(),
                     "moment_pages": None if layout.moment_page_ids is None else layout.moment_page_ids.tolist(),
                     "freed": list(plan.freed_blocks), "cache": _digest(views)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args(argv)
    if a.compare:
        x, y = (json.load(open(p)) for p in a.compare)
        same, differ = [], []
        for key in sorted(set(x) | set(y)):
            (same if x.get(key) == y.get(key) else differ).append(key)
        print(f"{len(same)} equal, {len(differ)} differ: {', '.join(differ) or '-'}")
        return 1 if differ else 0
    from vllm_contour.policies import policy_names

    torch.set_num_threads(1)
    out = {f"{name}/moments={m}": run_preset(name, m) for name in policy_names() for m in (False, True)}
    json.dump(out, open(a.out, "w"))
    print(f"{len(out)} runs -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
