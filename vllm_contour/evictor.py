"""Evict one request in place: policy per layer -> ragged layout -> compaction op. Pure torch.

The caller hands per-layer ``(key_cache, value_cache)`` views ``[num_blocks, H, bs, D]`` (any strides),
the request's block ids, how many tokens have KV, and the captured window queries (if any).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_contour import ops
from vllm_contour.config import RequestEviction
from vllm_contour.layout import RequestLayout, compaction_indices, plan_layout
from vllm_contour.policies import LayerInputs, build_policy


@dataclass
class EvictionResult:
    layout: RequestLayout
    seconds_policy: float
    seconds_compact: float


def region_blocks_for(num_tokens: int, block_size: int) -> int:
    """Full blocks of the prompt: the compactable region. The partial last block stays dense."""
    return num_tokens // block_size


def base_layer_pages(budget: int, num_kv_heads: int, block_size: int, tail_tokens: int) -> int:
    """Head-pages a layer may keep so that the mean tokens kept per head (region + dense tail) does not
    exceed ``budget`` (rounded down to whole pages; the allocator enforces the per-head floor)."""
    return (num_kv_heads * max(budget - tail_tokens, 0)) // block_size


def evict_request(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_ids: list[int],
    num_tokens: int,
    params: RequestEviction,
    scale: float,
    queries: dict[int, torch.Tensor] | None = None,
    query_positions: torch.Tensor | None = None,
    policy=None,
) -> EvictionResult | None:
    """Compact the request's first ``num_tokens // bs`` blocks in every layer. Returns None when there is
    no full block to compact."""
    key0 = caches[0][0]
    _, h, bs, d = key0.shape
    e = region_blocks_for(num_tokens, bs)
    if e == 0:
        return None
    n_blocks = (num_tokens + bs - 1) // bs
    if len(block_ids) < n_blocks:
        raise ValueError(f"request has {len(block_ids)} blocks, {n_blocks} needed for {num_tokens} tokens")
    policy = policy or build_policy(params.policy, sink_tokens=params.sink_tokens,
                                    recent_window=params.recent_window)
    tail = num_tokens - e * bs
    base_total = base_layer_pages(params.budget, h, bs, tail)
    blocks = torch.tensor(block_ids[:n_blocks], dtype=torch.int64)
    num_layers = len(caches)

    t0 = time.perf_counter()
    kept_all: list[list[torch.Tensor]] = []
    pages = torch.zeros((num_layers, h), dtype=torch.int64)
    for layer, (kc, vc) in enumerate(caches):
        keys = kc[blocks].permute(1, 0, 2, 3).reshape(h, n_blocks * bs, d)[:, :num_tokens]
        values = vc[blocks].permute(1, 0, 2, 3).reshape(h, n_blocks * bs, d)[:, :num_tokens]
        q = None if queries is None else queries.get(layer)
        if policy.needs_queries and q is None:
            raise RuntimeError(f"policy {policy.name} needs window queries; none captured for layer {layer}")
        inp = LayerInputs(keys=keys, values=values, region_len=e * bs, page_size=bs, layer_idx=layer,
                          num_layers=num_layers, scale=scale, queries=q, query_positions=query_positions,
                          window_end=num_tokens)
        sel = policy.plan_layer(inp, base_total)
        kept_all.append(sel.kept)
        pages[layer] = torch.tensor([k.numel() // bs for k in sel.kept], dtype=torch.int64)
    t1 = time.perf_counter()

    layout = plan_layout(pages, block_ids[:e], bs, h, e)
    for layer, (kc, vc) in enumerate(caches):
        sp, so, dp, do = compaction_indices(kept_all[layer], layout.page_ids[layer], block_ids[:e], bs, h)
        ops.compact(kc, vc, sp, so, dp, do)
    t2 = time.perf_counter()
    return EvictionResult(layout=layout, seconds_policy=t1 - t0, seconds_compact=t2 - t1)
