"""Logical ``[num_blocks, H, bs, D]`` views of vLLM's CPU KV cache ``[num_blocks, H, bs, 2D]``.

Each (block, head) is one contiguous head-page: ``bs*D`` key elements, then ``bs*D`` value elements.
Values are stored as rows (token-major). Keys depend on the attention ISA: the ``vec``/``vec16`` kernels
store the key page transposed (``[D, bs]``: element (token t, dim c) at ``c*bs + t``), which a strided
view expresses exactly. ``detect_key_layout`` probes vLLM's own cache-write op once per
(ISA, dtype, bs, D) so the views follow whatever the installed build does.
"""

from __future__ import annotations

import functools

import torch

KEY_ROWS = "rows"
KEY_TRANSPOSED = "transposed"


def cpu_kv_views(kv: torch.Tensor, key_layout: str):
    nb, h, bs, two_d = kv.shape
    d = two_d // 2
    if kv.stride(3) != 1 or kv.stride(2) != two_d:
        raise ValueError("expected vLLM's CPU cache layout with contiguous head-pages")
    s0, s1 = kv.stride(0), kv.stride(1)
    off = kv.storage_offset()
    if key_layout == KEY_ROWS:
        key = kv.as_strided((nb, h, bs, d), (s0, s1, d, 1), off)
    elif key_layout == KEY_TRANSPOSED:
        key = kv.as_strided((nb, h, bs, d), (s0, s1, 1, bs), off)
    else:
        raise ValueError(f"unknown key layout {key_layout!r}")
    value = kv.as_strided((nb, h, bs, d), (s0, s1, d, 1), off + bs * d)
    return key, value


def native_page_views(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """``[B*H, 1, bs, D]`` views of the same memory in the form vLLM's CPU kernel takes (it reads the
    page interior in its own layout and only uses the two outer strides)."""
    nb, h, bs, d = key_cache.shape
    out = []
    for c in (key_cache, value_cache):
        s1 = c.stride(1)
        out.append(c.as_strided((nb * h, 1, bs, d), (s1, s1, d, 1), c.storage_offset()))
    return out[0], out[1]


@functools.lru_cache(maxsize=None)
def detect_key_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """Write known keys with vLLM's ``cpu_attn_reshape_and_cache`` and see where they land."""
    from vllm import _custom_ops as vops

    kv = torch.zeros(2, 1, block_size, 2 * head_dim, dtype=dtype)
    view = kv.view(2, 1, 2 * block_size, head_dim)
    kc, vc = view[:, :, :block_size], view[:, :, block_size:]
    key = (torch.arange(block_size * head_dim, dtype=torch.float32) % 251).view(block_size, 1, head_dim).to(dtype)
    val = torch.zeros(block_size, 1, head_dim, dtype=dtype)
    vops.cpu_attn_reshape_and_cache(key, val, kc, vc, torch.arange(block_size, 2 * block_size), isa)
    for layout in (KEY_ROWS, KEY_TRANSPOSED):
        k, _ = cpu_kv_views(kv, layout)
        if torch.equal(k[1, 0], key[:, 0]):
            return layout
    raise RuntimeError(f"kv_eviction: unknown key layout of vLLM's CPU cache for isa={isa} dtype={dtype} "
                       f"block_size={block_size} head_dim={head_dim}; eviction cannot run on it. Start the "
                       f"server with --dtype float32 (vLLM's 'vec' layout, supported), or without "
                       f"--kv-eviction-policy")


def raw_pages(key_cache: torch.Tensor) -> torch.Tensor:
    """``[B*H, page_elems]`` view of whole head-pages (keys + values) in vLLM's CPU layout, where every
    head-page is one contiguous run of ``2*bs*D`` elements starting at the key view's page base."""
    nb, h, bs, d = key_cache.shape
    s1 = key_cache.stride(1)
    if key_cache.stride(0) != h * s1 or s1 != 2 * bs * d:
        raise ValueError("head-pages are not contiguous in this cache layout")
    return key_cache.as_strided((nb * h, 2 * bs * d), (s1, 1), key_cache.storage_offset())
