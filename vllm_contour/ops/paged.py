"""Reading and writing logical ``(block, lane, token, dim)`` elements of a cache view, in either form
``cpu_layout.cpu_kv_views`` gives: ``[B, H, bs, D]`` (any strides) or the two-level
``[B, H, bs/tg, tg, D/dg, dg]`` (token ``t = t1*tg + t2``, dim ``c = c1*dg + c2``). Pure torch; the
reference ops and the evictor index caches only through these."""

from __future__ import annotations

import torch


def dims(c: torch.Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, H, bs, D)`` of a cache view."""
    if c.dim() == 4:
        return tuple(c.shape)
    nb, h, t1, t2, d1, d2 = c.shape
    return nb, h, t1 * t2, d1 * d2


def head_pages(block_ids, num_heads: int) -> torch.Tensor:
    """Head-page ids (``block * H + lane``) of ``block_ids`` in every lane, head-major: ``[H * n]``, lane 0's
    pages in block order first (a request's pages as ``gather_pages(...).view(L, H, -1, D)`` reads them)."""
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)
    return (blocks.view(1, -1) * num_heads + torch.arange(num_heads, device=blocks.device).view(-1, 1)).reshape(-1)


def rows(c: torch.Tensor, blk, lane, off) -> torch.Tensor:
    """Token rows ``[..., D]`` (a copy) of (block, lane, offset) index tensors."""
    if c.dim() == 4:
        return c[blk, lane, off]
    tg = c.shape[3]
    r = c[blk, lane, off // tg, off % tg]
    return r.reshape(*r.shape[:-2], -1)


def set_rows(c: torch.Tensor, blk, lane, off, x: torch.Tensor) -> None:
    if c.dim() == 4:
        c[blk, lane, off] = x
        return
    tg, d1, d2 = c.shape[3], c.shape[4], c.shape[5]
    c[blk, lane, off // tg, off % tg] = x.reshape(*x.shape[:-1], d1, d2)


def pages(c: torch.Tensor, blk, lane=None) -> torch.Tensor:
    """Whole head-pages ``[..., bs, D]`` in logical order (a copy); ``lane=None``: every lane of the
    blocks, ``[..., H, bs, D]``."""
    p = c[blk] if lane is None else c[blk, lane]
    if c.dim() == 4:
        return p
    _, _, bs, d = dims(c)
    return p.reshape(*p.shape[:-4], bs, d)


def gather_pages_ref(views: list[torch.Tensor], ids: torch.Tensor, luts: torch.Tensor | None = None) -> torch.Tensor:
    """Head-pages ``ids`` (``block * H + lane``; ``[M]`` for every layer, or ``[L, M]``) of every layer's cache
    view in logical order, one new tensor ``[L, M, bs, D]``: one copy per layer (an ``index_select`` straight
    into the result where a view's blocks and lanes merge into one axis, as in vLLM's caches). fp8 caches
    (uint8) with ``luts [L, 256]`` (each layer's table, ``ops.fp8``): their numbers, fp32."""
    if luts is not None:
        raw = gather_pages_ref(views, ids)
        return torch.stack([luts[layer].to(raw.device)[raw[layer].to(torch.int64)] for layer in range(len(views))])
    _, h, bs, d = dims(views[0])
    m = ids.shape[-1]
    out = torch.empty((len(views), m, bs, d), dtype=views[0].dtype, device=views[0].device)
    for layer, c in enumerate(views):
        idx = (ids if ids.dim() == 1 else ids[layer]).to(torch.int64)
        dst = out[layer] if c.dim() == 4 else out[layer].view(m, *c.shape[2:])
        if c.stride(0) == c.shape[1] * c.stride(1):
            torch.index_select(c.flatten(0, 1), 0, idx, out=dst)
        else:
            dst.copy_(c[idx // h, idx % h])
    return out


def set_pages(c: torch.Tensor, blk, lane, x: torch.Tensor) -> None:
    if c.dim() == 4:
        c[blk, lane] = x
        return
    c[blk, lane] = x.reshape(*x.shape[:-2], *c.shape[2:])


def copy_blocks_ref(caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's key and value cache (any page layout: dim 0 is the
    block, which holds every head's page)."""
    if not pairs:
        return
    dev = caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=dev)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dev)
    for k, v in caches:
        k[dst] = k[src]
        v[dst] = v[src]
