"""Registers the Triton kernels of the top-level ``triton_ops`` package for CUDA tensors (imported lazily
by the dispatch the first time a CUDA tensor reaches an op; ImportError when Triton is missing). Moment
storage, page clearing and block copies are head-page moves of raw bits: the same gather / scatter
kernels as compaction, around the reference's packing of the statistics."""

from __future__ import annotations

import os

import torch
import triton_ops

from . import register_impl
from .reference import moment_page_rows, moments_of_page_rows


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _cuda(dev: str, dequant=None, luts=None, **kw) -> bool:
    """CUDA tensors; under Triton's interpreter (tests) CPU tensors too, when asked for by name. The Triton
    kernels read no fp8 pages (``dequant`` / ``luts``): their ops go elsewhere."""
    return dequant is None and luts is None and (dev == "cuda" or (_INTERPRET and dev == "cpu"))


def store_moments(key_cache, value_cache, page_ids, packed) -> None:
    _, _, bs, d = key_cache.shape
    rows = moment_page_rows(packed.to(key_cache.device), page_ids.numel(), bs, d, key_cache.element_size())
    triton_ops.set_page_rows(key_cache, value_cache, page_ids, rows)


def load_moments(key_cache, value_cache, page_ids, num_heads: int, head_dim: int) -> dict:
    lead = page_ids.shape[:-1]
    raw = triton_ops.page_rows(key_cache, value_cache, page_ids.reshape(-1))  # [N*M, 2, bs, D]
    raw = raw.reshape(*lead, page_ids.shape[-1], *raw.shape[1:])
    return moments_of_page_rows(raw, num_heads, head_dim, key_cache.element_size())


def read_page_elems(key_cache, value_cache, page_ids) -> torch.Tensor:
    raw = triton_ops.page_rows(key_cache, value_cache, page_ids.reshape(-1).to(torch.int64))  # [N, 2, bs, D]
    return raw.reshape(*page_ids.shape[:-1], -1)


def write_page_elems(key_cache, value_cache, page_ids, elems, values) -> None:
    """Read the touched pages, set the elements, write the pages back (the same page-row kernels)."""
    if page_ids.numel() == 0:
        return
    uniq, inv = torch.unique(page_ids.to(torch.int64), return_inverse=True)
    rows = triton_ops.page_rows(key_cache, value_cache, uniq)  # [U, 2, bs, D] cache-width integers
    flat = rows.reshape(uniq.numel(), -1)
    flat[inv, elems.to(torch.int64)] = values.to(flat.dtype)
    triton_ops.set_page_rows(key_cache, value_cache, uniq, flat.view_as(rows))


def copy_blocks(caches, pairs) -> None:
    """Every lane and token of block ``src`` -> block ``dst``, in every layer: one compaction per layer."""
    k0 = caches[0][0]
    _, h, bs, _ = k0.shape
    dev = k0.device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=dev)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dev)
    lanes = torch.arange(h, device=dev)
    sp = (src.view(-1, 1) * h + lanes).reshape(-1).repeat_interleave(bs)
    dp = (dst.view(-1, 1) * h + lanes).reshape(-1).repeat_interleave(bs)
    off = torch.arange(bs, device=dev).repeat(src.numel() * h)
    for kc, vc in caches:
        triton_ops.compact(kc, vc, sp, off, dp, off)


def compacted_attention(query, key_cache, value_cache, rows, layer: int, scale, moments=None, out=None):
    o, _ = triton_ops.compacted_attention(
        query, key_cache, value_cache, rows.token_req, rows.token_row, rows.token_pos, rows.run_pages[:, layer],
        rows.run_count[:, layer], rows.region, rows.block_table, scale, rows.max_seq_len, moments=moments, out=out)
    return o


def _two_part(dev: str, forced: str | None = None, dequant=None, **kw) -> bool:
    """CUDA; CPU tensors under the interpreter only when asked for by name (on CPU the C++ kernels, through
    per-token tables, are the default). No fp8 pages (``dequant``)."""
    return dequant is None and (dev == "cuda" or (_INTERPRET and dev == "cpu" and forced == "triton"))


register_impl("compact", "triton", triton_ops.compact, _cuda)
register_impl("compacted_attention", "triton", compacted_attention, _two_part)
register_impl("accumulate_moments", "triton", triton_ops.accumulate_moments, _cuda)
register_impl("ragged_decode_attention", "triton", triton_ops.ragged_decode_attention, _cuda)
register_impl("store_moments", "triton", store_moments, _cuda)
register_impl("load_moments", "triton", load_moments, _cuda)
register_impl("copy_blocks", "triton", copy_blocks, _cuda)
register_impl("read_page_elems", "triton", read_page_elems, _cuda)
register_impl("write_page_elems", "triton", write_page_elems, _cuda)
