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


def compact(key_cache, value_cache, src_page, src_off, dst_page, dst_off):
    """Move tokens ``(src_page, src_off) -> (dst_page, dst_off)`` of K and V in place. Sources and
    destinations may overlap: one launch gathers every source into a temporary, a second scatters."""
    m = src_page.numel()
    if m == 0:
        return
    nb, h, bs, d = key_cache.shape
    it = _INT_VIEW[key_cache.element_size()]
    kc, vc = key_cache.view(it), value_cache.view(it)  # move bits: no float arithmetic
    dev = key_cache.device
    sp, so = src_page.to(dev, torch.int64).contiguous(), src_off.to(dev, torch.int64).contiguous()
    dp, do = dst_page.to(dev, torch.int64).contiguous(), dst_off.to(dev, torch.int64).contiguous()
    tmp = torch.empty((2, m, d), dtype=it, device=dev)
    block_d = _p2(d)
    block_m = max(1, min(64, 4096 // block_d))
    grid = (triton.cdiv(m, block_m),)
    args = (h, d, *kc.stride(), *vc.stride())
    kernels.compact_gather_kernel[grid](kc, vc, tmp, sp, so, m, *args, BLOCK_M=block_m, BLOCK_D=block_d)
    kernels.compact_scatter_kernel[grid](kc, vc, tmp, dp, do, m, *args, BLOCK_M=block_m, BLOCK_D=block_d)


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


def ragged_decode_attention(query, key_cache, value_cache, page_table, seq_lens, scale, moments=None,
                            block_n: int | None = None, **_):
    """Decode attention over ragged per-head page lists; returns ``(out [T, Hq, D] query dtype,
    lse [T, Hq] fp32)``. See ``vllm_contour.ops.reference.ragged_decode_attention_ref``."""
    t, hq, d = query.shape
    nb, h, bs, _ = key_cache.shape
    g = hq // h
    dev = query.device
    out = torch.empty((t, hq, d), dtype=torch.float32, device=dev)
    lse = torch.empty((t, hq), dtype=torch.float32, device=dev)
    if t == 0:
        return out.to(query.dtype), lse
    block_g, block_d = _p2(g), _p2(d)
    block_n = block_n or max(8, min(_p2(bs), 8192 // (block_g * block_d)))
    block_e = max(1, min(block_d, 4096 // (block_g * block_d)))
    if moments is not None:
        mom = [_f32_contig(moments[k]) for k in ("n", "sum_k", "sum_v", "sum_vk")]
    else:
        mom = [lse] * 4  # unused
    pt = page_table if page_table.dtype in (torch.int32, torch.int64) else page_table.to(torch.int64)
    kernels.ragged_decode_kernel[(t * h,)](
        query, key_cache, value_cache, pt, seq_lens, out, lse, *mom,
        h, g, d, bs, float(scale), *query.stride(), *key_cache.stride(), *value_cache.stride(),
        *pt.stride(), *seq_lens.stride(),
        HAS_MOMENTS=moments is not None, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_E=block_e)
    return out.to(query.dtype), lse


__all__ = ["compact", "accumulate_moments", "ragged_decode_attention", "kernels"]
