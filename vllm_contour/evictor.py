"""Evict one request in place: policy per layer -> ragged layout -> compaction op. Pure torch.

The caller hands per-layer ``(key_cache, value_cache)`` views ``[num_blocks, H, bs, D]`` (any strides),
the request's block ids, how many tokens have KV, and the captured window queries (if any).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_contour import moments as mom_math
from vllm_contour import ops
from vllm_contour.config import RequestEviction
from vllm_contour.layout import RequestLayout, compaction_indices, plan_layout
from vllm_contour.ops.cpu_layout import raw_pages
from vllm_contour.policies import LayerInputs, build_policy


@dataclass
class EvictionResult:
    layout: RequestLayout
    seconds_policy: float
    seconds_compact: float


def region_blocks_for(num_tokens: int, block_size: int) -> int:
    """Full blocks of the prompt: the compactable region. The partial last block stays dense."""
    return num_tokens // block_size


def moment_pages_for(num_kv_heads: int, head_dim: int, block_size: int, elem_size: int) -> int:
    """Head-pages per layer that hold the layer's moment statistics (fp32, all heads)."""
    return mom_math.pages_needed(num_kv_heads, head_dim, 2 * block_size * head_dim * elem_size)


def write_moments(key_cache: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Store one layer's packed fp32 moments in its head-pages (raw bytes)."""
    pages = raw_pages(key_cache)
    page_bytes = pages.shape[1] * pages.element_size()
    data = packed.contiguous().view(torch.uint8)
    for j, pid in enumerate(page_ids.tolist()):
        chunk = data[j * page_bytes : (j + 1) * page_bytes]
        if chunk.numel() == 0:
            break
        pages[pid].view(torch.uint8)[: chunk.numel()] = chunk


def read_moments(key_cache: torch.Tensor, page_ids: torch.Tensor, num_heads: int, d: int) -> dict:
    """Gather moments stored by ``write_moments``: ``page_ids [..., M]`` -> dict with leading dims [..., H]."""
    pages = raw_pages(key_cache)
    lead = page_ids.shape[:-1]
    raw = pages[page_ids.reshape(-1).to(torch.int64)].reshape(*lead, -1).contiguous().view(torch.uint8)
    n_bytes = mom_math.packed_len(num_heads, d) * 4
    flat = raw[..., :n_bytes].contiguous().view(torch.float32)
    return mom_math.unpack(flat, num_heads, d)


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
    """Compact the request's first full blocks in every layer. Returns None when there is no full block
    to compact. With ``params.context_len`` (query-agnostic) only the context is compactable and the
    scoring window ends at it; the question stays dense."""
    key0 = caches[0][0]
    _, h, bs, d = key0.shape
    window_end = min(num_tokens, params.context_len) if params.context_len else num_tokens
    e = region_blocks_for(window_end, bs)
    if e == 0:
        return None
    n_blocks = (num_tokens + bs - 1) // bs
    if len(block_ids) < n_blocks:
        raise ValueError(f"request has {len(block_ids)} blocks, {n_blocks} needed for {num_tokens} tokens")
    policy = policy or build_policy(params.policy, sink_tokens=params.sink_tokens,
                                    recent_window=params.recent_window)
    tail = window_end - e * bs  # context tokens kept dense (the question, if any, is extra)
    base_total = base_layer_pages(params.budget, h, bs, tail)
    m_pages = moment_pages_for(h, d, bs, key0.element_size()) if params.moment_correction else 0
    if m_pages:
        # The statistics are bytes too: they take head-pages from the layer's budget.
        base_total = max(0, base_total - m_pages)
        if m_pages + h > e * h:
            m_pages = 0  # too short to evict anything worth summarising
    blocks = torch.tensor(block_ids[:n_blocks], dtype=torch.int64)
    num_layers = len(caches)

    t0 = time.perf_counter()
    kept_all: list[list[torch.Tensor]] = []
    packed_moments: list[torch.Tensor] = []
    pages = torch.zeros((num_layers, h), dtype=torch.int64)
    for layer, (kc, vc) in enumerate(caches):
        keys = kc[blocks].permute(1, 0, 2, 3).reshape(h, n_blocks * bs, d)[:, :num_tokens]
        values = vc[blocks].permute(1, 0, 2, 3).reshape(h, n_blocks * bs, d)[:, :num_tokens]
        q = None if queries is None else queries.get(layer)
        if policy.needs_queries and q is None:
            raise RuntimeError(f"policy {policy.name} needs window queries; none captured for layer {layer}")
        inp = LayerInputs(keys=keys, values=values, region_len=e * bs, page_size=bs, layer_idx=layer,
                          num_layers=num_layers, scale=scale, queries=q, query_positions=query_positions,
                          window_end=window_end)
        sel = policy.plan_layer(inp, base_total)
        kept_all.append(sel.kept)
        if m_pages:
            region = e * bs
            evicted = torch.ones((h, region), dtype=torch.bool)
            for hh, k in enumerate(sel.kept):
                evicted[hh, k] = False
            # statistics of the evicted tokens, read where they still sit (before this layer's compaction)
            hd, tok = evicted.nonzero(as_tuple=True)
            page_ids = blocks[tok // bs] * h + hd
            stats = {"n": torch.zeros(h), "sum_k": torch.zeros(h, d), "sum_v": torch.zeros(h, d),
                     "sum_vk": torch.zeros(h, d, d)}
            ops.accumulate_moments(kc, vc, page_ids, tok % bs, hd, stats)
            packed_moments.append(mom_math.pack(mom_math.Moments(stats["n"], stats["sum_k"], stats["sum_v"],
                                                                 stats["sum_vk"])))
        pages[layer] = torch.tensor([k.numel() // bs for k in sel.kept], dtype=torch.int64)
    t1 = time.perf_counter()

    layout = plan_layout(pages, block_ids[:e], bs, h, e, moment_pages=m_pages)
    for layer, (kc, vc) in enumerate(caches):
        sp, so, dp, do = compaction_indices(kept_all[layer], layout.page_ids[layer], block_ids[:e], bs, h)
        ops.compact(kc, vc, sp, so, dp, do)
        if m_pages:  # after the layer's compaction: moment pages may have held source tokens
            write_moments(kc, layout.moment_page_ids[layer], packed_moments[layer])
    t2 = time.perf_counter()
    return EvictionResult(layout=layout, seconds_policy=t1 - t0, seconds_compact=t2 - t1)
