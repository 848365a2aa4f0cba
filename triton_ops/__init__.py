"""Triton kernels of vllm-contour's ops (GPU). Launchers take the same arguments as
``vllm_contour.ops`` (caches ``[num_blocks, H, bs, D]`` with arbitrary strides, head-page id
``block * H + lane``); ``vllm_contour.ops`` registers them for CUDA tensors.

On a CPU machine they run under the interpreter (``TRITON_INTERPRET=1`` set before this package is
imported) on CPU tensors; ``triton_ops.aot`` compiles them ahead of time for a GPU target.
"""

from __future__ import annotations

import torch
import triton

from . import kernels

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _p2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


def _int_views(key_cache, value_cache):
    it = _INT_VIEW[key_cache.element_size()]
    return key_cache.view(it), value_cache.view(it), it  # move bits: no float arithmetic


def _row_grid(m: int, d: int):
    block_d = _p2(d)
    block_m = max(1, min(64, 4096 // block_d))
    return (triton.cdiv(m, block_m),), dict(BLOCK_M=block_m, BLOCK_D=block_d)


def _idx(x, dev):
    return x.reshape(-1).to(dev, torch.int64).contiguous()


def gather_rows(key_cache, value_cache, page, off) -> torch.Tensor:
    """Token rows ``(page, off)`` of K and V as raw bits: ``[2, M, D]`` (same-width integers)."""
    nb, h, bs, d = key_cache.shape
    kc, vc, it = _int_views(key_cache, value_cache)
    dev = key_cache.device
    m = page.numel()
    tmp = torch.empty((2, m, d), dtype=it, device=dev)
    if m:
        grid, ce = _row_grid(m, d)
        kernels.compact_gather_kernel[grid](kc, vc, tmp, _idx(page, dev), _idx(off, dev), m, h, d,
                                            *kc.stride(), *vc.stride(), **ce)
    return tmp


def scatter_rows(key_cache, value_cache, page, off, rows: torch.Tensor) -> None:
    """Write ``rows [2, M, D]`` (raw bits, as ``gather_rows`` returns) to token rows ``(page, off)``."""
    nb, h, bs, d = key_cache.shape
    kc, vc, it = _int_views(key_cache, value_cache)
    dev = key_cache.device
    m = page.numel()
    if m:
        grid, ce = _row_grid(m, d)
        kernels.compact_scatter_kernel[grid](kc, vc, rows.to(dev).view(it).contiguous(), _idx(page, dev),
                                             _idx(off, dev), m, h, d, *kc.stride(), *vc.stride(), **ce)


def compact(key_cache, value_cache, src_page, src_off, dst_page, dst_off):
    """Move tokens ``(src_page, src_off) -> (dst_page, dst_off)`` of K and V in place. Sources and
    destinations may overlap: one launch gathers every source into a temporary, a second scatters."""
    if src_page.numel() == 0:
        return
    scatter_rows(key_cache, value_cache, dst_page, dst_off, gather_rows(key_cache, value_cache, src_page, src_off))


def page_rows(key_cache, value_cache, page_ids) -> torch.Tensor:
    """Whole head-pages ``page_ids [M]`` as raw bits ``[M, 2, bs, D]`` (keys of a page, then its values, in
    logical order: what ``ops.reference`` stores moments as)."""
    nb, h, bs, d = key_cache.shape
    dev = key_cache.device
    p = _idx(page_ids, dev)
    page = p.repeat_interleave(bs)
    off = torch.arange(bs, device=dev).repeat(p.numel())
    return gather_rows(key_cache, value_cache, page, off).view(2, p.numel(), bs, d).transpose(0, 1)


def set_page_rows(key_cache, value_cache, page_ids, rows: torch.Tensor) -> None:
    """Inverse of ``page_rows``: write ``rows [M, 2, bs, D]`` (raw bits) into head-pages ``page_ids``."""
    nb, h, bs, d = key_cache.shape
    dev = key_cache.device
    p = _idx(page_ids, dev)
    page = p.repeat_interleave(bs)
    off = torch.arange(bs, device=dev).repeat(p.numel())
    scatter_rows(key_cache, value_cache, page, off, rows.transpose(0, 1).reshape(2, -1, d))


def _f32_contig(t: torch.Tensor) -> torch.Tensor:
    return t if (t.dtype == torch.float32 and t.is_contiguous()) else t.to(torch.float32).contiguous()


def accumulate_moments(key_cache, value_cache, page_ids, offsets, head_of_token, moments: dict,
                       block_n: int = 32, block_r: int | None = None):
    """Add tokens to fp32 moments ``n [H]``, ``sum_k [H, D]``, ``sum_v [H, D]``, ``sum_vk [H, D, D]`` in
    place (fp32 atomics: the summation order is not deterministic)."""
    m = page_ids.numel()
    if m == 0:
        return moments
    nb, h, bs, d = key_cache.shape
    dev = key_cache.device
    hm = moments["n"].numel()
    heads = head_of_token.reshape(-1).to(dev, torch.int64)
    order = torch.argsort(heads, stable=True)
    seg = torch.zeros(hm + 1, dtype=torch.int64, device=dev)
    seg[1:] = torch.cumsum(torch.bincount(heads, minlength=hm), 0)
    mom = {k: _f32_contig(moments[k]) for k in ("n", "sum_k", "sum_v", "sum_vk")}
    block_d = _p2(d, 16)
    block_r = block_r or min(block_d, 64)
    grid = (hm, triton.cdiv(m, block_n), triton.cdiv(d, block_r))
    kernels.accumulate_moments_kernel[grid](
        key_cache, value_cache, page_ids.reshape(-1).to(dev, torch.int64).contiguous(),
        offsets.reshape(-1).to(dev, torch.int64).contiguous(), order, seg,
        mom["n"], mom["sum_k"], mom["sum_v"], mom["sum_vk"], h, d,
        *key_cache.stride(), *value_cache.stride(), BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_R=block_r)
    for k, v in mom.items():
        if v is not moments[k]:
            moments[k].copy_(v.view(moments[k].shape))
    return moments


_SMS: dict[str, int] = {}


def _num_sms(dev: torch.device) -> int:
    """Streaming multiprocessors of the device (4 under the CPU interpreter: small grids still split)."""
    key = str(dev)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    return _SMS[key]


def num_segments(rows: int, kv_heads: int, max_tokens: int, block_n: int, dev: torch.device) -> int:
    """How many segments each page list is split into: enough programs for two waves over the device's
    multiprocessors when rows x KV heads alone are fewer, never a segment shorter than two chunks, at most
    16 (vLLM's unified attention uses 16 for its 3-D decode)."""
    progs = rows * kv_heads
    sms = _num_sms(dev)
    if progs >= sms:
        return 1
    return max(1, min(16, triton.cdiv(2 * sms, progs), max_tokens // (2 * block_n)))


def _attention(query, key_cache, value_cache, table, lens, scale, moments, block_n, segments, out, native_dot,
               max_tokens: int, two_part=None):
    t, hq, d = query.shape
    nb, h, bs, _ = key_cache.shape
    g = hq // h
    dev = query.device
    if out is None:
        out = torch.empty((t, hq, d), dtype=query.dtype, device=dev)
    lse = torch.empty((t, hq), dtype=torch.float32, device=dev)
    if t == 0:
        return out, lse
    block_g, block_d = _p2(g, 16), _p2(d, 16)
    block_n = block_n or (bs if bs in (16, 32, 64, 128) else 16)
    block_e = max(1, min(block_d, 4096 // (block_g * block_d)))
    if moments is not None:
        mom = [_f32_contig(moments[k].to(dev)) for k in ("n", "sum_k", "sum_v", "sum_vk")]
    else:
        mom = [lse] * 4  # unused
    s = segments or num_segments(t, h, max_tokens, block_n, dev)
    native_dot = dev.type == "cuda" and key_cache.dtype in (torch.bfloat16, torch.float16) if native_dot is None \
        else native_dot
    split = s > 1
    seg_acc = torch.empty((t * hq * s, d), dtype=torch.float32, device=dev) if split else lse
    seg_ml = torch.empty((t * hq * s, 2), dtype=torch.float32, device=dev) if split else lse
    o_strides = (out.stride(0), out.stride(1))
    if two_part is None:
        tp_ptrs, tp_strides = [lens] * 6, (0, 0, 0, 0)
        sl_strides = lens.stride()
    else:
        slot, row, pos, count, region, bt = two_part
        tp_ptrs, tp_strides = [slot, row, pos, count, region, bt], (*count.stride(), *bt.stride())
        lens, sl_strides = slot, (0, 0)
    kernels.ragged_decode_kernel[(t * h, s)](
        query, key_cache, value_cache, table, lens, out, lse, *mom, seg_acc, seg_ml, *tp_ptrs,
        h, g, d, bs, float(scale), *query.stride(), *key_cache.stride(), *value_cache.stride(),
        *table.stride(), *sl_strides, *o_strides, *tp_strides,
        HAS_MOMENTS=moments is not None, SPLIT=split, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_E=block_e, DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32",
        NATIVE_DOT=native_dot, ONE_PAGE=block_n == bs, TWO_PART=two_part is not None)
    if split:
        kernels.ragged_reduce_kernel[(t * h,)](
            query, out, lse, *mom, seg_acc, seg_ml, tp_ptrs[0], h, g, d, s, float(scale), *query.stride(),
            *o_strides, HAS_MOMENTS=moments is not None, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_E=block_e,
            TWO_PART=two_part is not None)
    return out, lse


def ragged_decode_attention(query, key_cache, value_cache, page_table, seq_lens, scale, moments=None,
                            block_n: int | None = None, segments: int | None = None, out=None,
                            native_dot: bool | None = None, **_):
    """Decode attention over ragged per-head page lists; returns ``(out [T, Hq, D], lse [T, Hq] fp32)``
    (``out``: written in place when given, any float dtype; else a new tensor in the query dtype). See
    ``vllm_contour.ops.reference.ragged_decode_attention_ref``. ``segments`` (default: ``num_segments``
    from the table's width, a host-side bound, so nothing waits for the device) splits each list."""
    dev = query.device
    pt = page_table.to(dev)
    pt = pt if pt.dtype in (torch.int32, torch.int64) else pt.to(torch.int64)
    return _attention(query, key_cache, value_cache, pt, seq_lens.to(dev), scale, moments, block_n, segments, out,
                      native_dot, pt.shape[2] * key_cache.shape[2])


def compacted_attention(query, key_cache, value_cache, token_slot, token_row, token_pos, run_pages, run_count,
                        region, block_table, scale, max_tokens: int, moments=None, out=None,
                        block_n: int | None = None, segments: int | None = None, native_dot: bool | None = None):
    """Attention of every token of a step whose request is compacted (``token_slot[t] >= 0``; the other
    tokens' output rows are left as they are): token t reads its slot's kept run (``run_pages [S, H, P]``,
    ``run_count [S, H]`` pages) and then its request's blocks from ``region[slot]`` on in vLLM's block table
    (``block_table [B, W]``, its row ``token_row[t]``), up to its own position ``token_pos[t]``. Moments are
    per slot (``[S, H, ...]``). Returns ``(out [T, Hq, D], lse [T, Hq])``; ``max_tokens``: a host bound of
    any list's length (splits short batches)."""
    return _attention(query, key_cache, value_cache, run_pages, None, scale, moments, block_n, segments, out,
                      native_dot, max_tokens,
                      two_part=(token_slot, token_row, token_pos, run_count, region, block_table))


__all__ = ["compact", "gather_rows", "scatter_rows", "page_rows", "set_page_rows", "accumulate_moments",
           "ragged_decode_attention", "compacted_attention", "num_segments", "kernels"]
