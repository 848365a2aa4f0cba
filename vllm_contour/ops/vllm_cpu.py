"""``ragged_decode_attention`` on vLLM's own CPU attention kernel (no LSE, no moment correction).

vLLM's CPU cache is ``[B, H, bs, 2D]``: every (block, head) is one contiguous head-page, so the cache can
be viewed as ``B*H`` single-head blocks. Each (token, KV head) pair becomes one pseudo-request with one
query row per query head of its GQA group, its own page table (the head's packed run, then its dense
tail) and its own length; the kernel needs every page but the last to be full, which runs of whole pages
guarantee. Registered only where vLLM's CPU kernels are importable.
"""

from __future__ import annotations

import importlib.util

import torch

from . import register_impl


def vllm_op(name: str):
    """vLLM's CPU op ``name`` (``cpu_attn_reshape_and_cache``, ``cpu_attn_get_scheduler_metadata``,
    ``cpu_attention_with_kv_cache``), taken through the hooks table: the row for the installed vLLM
    (``vllm._custom_ops`` before 0.34, ``vllm._cpu_ops`` from it). ops/ never imports vLLM itself."""
    from vllm_contour.integration.vllm_hooks import resolve

    return resolve(f"vllm._custom_ops:{name}")


def attn_isa(dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's CPU attention picks for a cache (its private ``_get_attn_isa``, a hooks-table row)."""
    from vllm_contour.integration.vllm_hooks import resolve

    return resolve("vllm.v1.attention.backends.cpu_attn:_get_attn_isa")(dtype, block_size, head_dim, kv_cache_dtype)


def _have_kernel() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        vllm_op("cpu_attention_with_kv_cache")
        vllm_op("cpu_attn_get_scheduler_metadata")
    except Exception:
        return False
    return True


_HAVE = None


def _supports(device_type: str, moments: bool = False, need_lse: bool = False, key_cache=None,
              value_cache=None, native: bool = False, dequant=None, **kw) -> bool:
    """Only for caches in vLLM's native CPU layout (the caller says so with ``native=True``: the kernel
    reads page interiors in its own format), one head-page per (block, head) at a fixed stride; not fp8
    pages (``dequant``: the plugin's tables are not passed to vLLM's kernel)."""
    global _HAVE
    if device_type != "cpu" or moments or need_lse or not native or dequant is not None:
        return False
    from .paged import dims

    for c in (key_cache, value_cache):
        if c is None:
            continue
        b, h, bs, d = dims(c)
        if c.stride(0) != h * c.stride(1) or bs % 32 or \
                c.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    if _HAVE is None:
        _HAVE = _have_kernel()
    return _HAVE


def ragged_decode_attention_vllm(query, key_cache, value_cache, page_table, seq_lens, scale,
                                 moments=None, **_):
    from .cpu_layout import native_page_views

    if moments is not None:
        raise ValueError("the vllm_cpu implementation has no moment correction")
    from .paged import dims

    t, hq, d = query.shape
    _, h, bs, _ = dims(key_cache)
    g = hq // h
    n = t * h
    q = query.reshape(n, g, d).contiguous()
    out = torch.empty_like(q)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    sl = seq_lens.reshape(n).to(torch.int32).contiguous()
    bt = page_table.reshape(n, -1).to(torch.int32).contiguous()
    isa = attn_isa(query.dtype, bs, d)
    kpages, vpages = native_page_views(key_cache, value_cache)
    md = vllm_op("cpu_attn_get_scheduler_metadata")(
        num_reqs=n, num_heads=g, num_kv_heads=1, head_dim=d, seq_lens=sl, dtype=query.dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    vllm_op("cpu_attention_with_kv_cache")(
        query=q, key_cache=kpages, value_cache=vpages, output=out,
        query_start_loc=qsl, seq_lens=sl, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=bt, softcap=0.0, scheduler_metadata=md, s_aux=None)
    return out.view(t, hq, d), None


register_impl("ragged_decode_attention", "vllm_cpu", ragged_decode_attention_vllm, _supports)
