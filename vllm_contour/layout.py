"""Ragged head-page packing of one request's kept tokens.

vLLM's block is ``block_size`` tokens x all KV heads of every layer. Inside a layer a block holds one
*head-page* per KV head ("lane"); head-page id ``block_id * H + lane`` names it. After eviction head
(l, h) keeps ``pages[l, h]`` full head-pages. Layer l packs its ``P_l = sum_h pages[l, h]`` pages (plus its
moment pages) into the slots of the first ``K = max_l ceil(P_l / H)`` *target* blocks, block-major (slot
s -> target s // H, lane s % H): a head may borrow other heads' lanes, so memory is the SUM over heads,
not H x max. The targets are the blocks that held the tokens the round looked at, in logical order (the
previous round's kept blocks, then the full tail blocks); those after the first ``K`` go back to vLLM's
pool. Logical blocks ``>= region_blocks`` (E) are the dense tail. Every kept token remembers its
original position (sinks, recency, causal order and the next round need it). Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestLayout:
    num_kv_heads: int
    block_size: int
    region_blocks: int  # E: logical blocks [0, E) were compacted; the dense tail starts at block E
    pages: torch.Tensor  # [L, H] int32 head-pages kept per head
    page_ids: torch.Tensor  # [L, H, max_pages] int32 physical head-page ids (padded with the first)
    block_ids: list[int]  # physical ids of the K blocks holding kept pages / moments, slot order
    block_slots: list[int]  # their logical indices in the request's block table
    positions: torch.Tensor  # [L, H, max_pages * bs] int64 original positions of kept tokens (-1 = none)
    moment_page_ids: torch.Tensor | None = None  # [L, M] int32 head-pages holding MomentKV statistics
    evicted: torch.Tensor | None = None  # [L, H] int64 tokens evicted so far (the moments' n)
    carry: torch.Tensor | None = None  # [L, H, max_pages * bs] fp32 scores an accumulating scorer carries
    rounds: int = 1

    @property
    def num_layers(self) -> int:
        return self.pages.shape[0]

    @property
    def kept_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def counts(self) -> torch.Tensor:
        """Kept tokens per (layer, head)."""
        return self.pages * self.block_size

    @property
    def total_head_pages(self) -> int:
        return int(self.pages.sum())

    def kept_positions(self, layer: int, head: int) -> torch.Tensor:
        return self.positions[layer, head, : int(self.pages[layer, head]) * self.block_size]


def kept_blocks_for(pages: torch.Tensor, num_kv_heads: int, moment_pages: int = 0) -> int:
    """K = max over layers of ceil((sum_h pages + moment pages) / H), at least 1."""
    per_layer = pages.to(torch.int64).sum(dim=1) + moment_pages
    return max(1, int(((per_layer + num_kv_heads - 1) // num_kv_heads).max()))


def plan_layout(pages: torch.Tensor, block_ids: list[int], block_size: int, num_kv_heads: int,
                region_blocks: int, moment_pages: int = 0, block_slots: list[int] | None = None,
                positions: torch.Tensor | None = None) -> RequestLayout:
    """Assign head-page slots for every (layer, head). ``block_ids`` are the physical ids of the target
    blocks in logical order (``block_slots`` their logical indices, default ``0..``). ``moment_pages``
    extra slots per layer (after the token pages) hold the layer's moment statistics. Raises when the
    targets cannot hold the pages."""
    pages = pages.to(torch.int64)
    num_layers, h = pages.shape
    if h != num_kv_heads:
        raise ValueError(f"pages has {h} heads, cache has {num_kv_heads}")
    slots_in = list(range(len(block_ids))) if block_slots is None else list(block_slots)
    if len(slots_in) != len(block_ids):
        raise ValueError("block_slots and block_ids differ in length")
    k = kept_blocks_for(pages, num_kv_heads, moment_pages)
    if k > len(block_ids):
        raise ValueError(f"layout needs {k} blocks but the region has only {len(block_ids)}")
    blocks = torch.tensor(block_ids[:k], dtype=torch.int64)
    max_pages = max(1, int(pages.max()))
    # slots of head h in layer l: [off[l, h], off[l, h] + pages[l, h]) (block-major: slot s -> target s // H,
    # lane s % H), the layer's moment slots right after its token pages
    off = torch.cumsum(pages, dim=1) - pages  # [L, H]
    j = torch.arange(max_pages).view(1, 1, -1)
    slot = (off.unsqueeze(-1) + j).clamp_max(k * num_kv_heads - 1)
    ids = blocks[slot // num_kv_heads] * num_kv_heads + slot % num_kv_heads  # [L, H, max_pages]
    first = torch.where(pages > 0, ids[:, :, 0], blocks[0] * num_kv_heads)
    page_ids = torch.where(j < pages.unsqueeze(-1), ids, first.unsqueeze(-1))
    moment_ids = torch.empty((num_layers, max(moment_pages, 0)), dtype=torch.int64)
    if moment_pages:
        mslot = pages.sum(dim=1, keepdim=True) + torch.arange(moment_pages).view(1, -1)  # [L, M]
        moment_ids = blocks[mslot // num_kv_heads] * num_kv_heads + mslot % num_kv_heads
    if positions is None:
        positions = torch.full((num_layers, h, max_pages * block_size), -1, dtype=torch.int64)
    return RequestLayout(num_kv_heads=num_kv_heads, block_size=block_size, region_blocks=region_blocks,
                         pages=pages.to(torch.int32), page_ids=page_ids.to(torch.int32),
                         block_ids=[int(b) for b in block_ids[:k]], block_slots=slots_in[:k],
                         positions=positions,
                         moment_page_ids=moment_ids.to(torch.int32) if moment_pages else None)


def region_source_table(block_ids: list[int], num_kv_heads: int) -> torch.Tensor:
    """``[H, E]`` head-page ids of every head's tokens in dense blocks ``block_ids`` (lane = head)."""
    blocks = torch.tensor(block_ids, dtype=torch.int64)
    return blocks.view(1, -1) * num_kv_heads + torch.arange(num_kv_heads).view(-1, 1)


def compaction_indices(kept: list[torch.Tensor], dst_page_ids: torch.Tensor, src_table: torch.Tensor,
                       block_size: int):
    """Token moves for one layer (or several: rows ``l * H + h``): (src_page, src_off, dst_page, dst_off), int64
    [M] each, row after row.

    ``kept[h]`` are the kept candidate indices of row h (sorted), ``src_table [H, P]`` the head-page id
    of each of row h's candidate pages (candidate j sits in page ``src_table[h, j // bs]`` at offset
    ``j % bs``), ``dst_page_ids [H, max_pages]`` the row's destination pages."""
    counts = torch.tensor([k.numel() for k in kept], dtype=torch.int64)
    if int(counts.sum()) == 0:
        e = torch.empty(0, dtype=torch.int64)
        return e, e, e, e
    idx = torch.cat([k.to(torch.int64) for k in kept])
    head = torch.repeat_interleave(torch.arange(len(kept)), counts)
    j = torch.arange(idx.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    table = src_table.to(torch.int64)
    dst = dst_page_ids.to(torch.int64)
    return table[head, idx // block_size], idx % block_size, dst[head, j // block_size], j % block_size


def decode_page_table(layout: RequestLayout, tail_block_ids: list[int], tail_tokens: int):
    """Per (layer, head) page list = packed run ++ dense tail pages, and token counts.

    Returns ``page_table [L, H, max_pages + n_tail]`` int32 and ``seq_lens [L, H]`` int32. All pages but
    the last of every list are full (runs are whole pages), which the decode op relies on."""
    h = layout.num_kv_heads
    n_tail = len(tail_block_ids)
    num_layers, _, max_pages = layout.page_ids.shape
    tail = torch.tensor(tail_block_ids, dtype=torch.int64) * h
    tail_ids = (tail.view(1, 1, n_tail) + torch.arange(h).view(1, h, 1)).expand(num_layers, h, n_tail)
    combined = torch.cat([layout.page_ids.to(torch.int64), tail_ids], dim=2)
    pages = layout.pages.to(torch.int64).unsqueeze(-1)
    j = torch.arange(max_pages + n_tail).view(1, 1, -1)
    idx = torch.where(j < pages, j, max_pages + (j - pages)).clamp_max(max_pages + n_tail - 1)
    table = torch.gather(combined, 2, idx.expand(num_layers, h, -1))
    seq_lens = layout.pages.to(torch.int64) * layout.block_size + tail_tokens
    return table.to(torch.int32), seq_lens.to(torch.int32)
