"""Random inputs for the op tests (shared by test_ops.py and test_triton_ops.py).

Cache layouts, all ``[num_blocks, H, bs, D]`` views of one storage tensor:
* ``cpu_rows``   vLLM's CPU cache ``[B, H, bs, 2D]``, K rows then V rows in each head-page,
* ``cpu_keyT``   the same with the key page transposed (``[D, bs]``, what vLLM's CPU vec kernels write),
* ``interleaved`` a GPU-like token-interleaved ``[2, B, bs, H, D + pad]`` (heads interleaved per token,
  padded rows: nothing is contiguous beyond D),
* ``cpu_amx``    vLLM's CPU cache with the AMX bf16 packing (keys in 16-token groups with dims in pairs,
  values in 16-dim column groups with tokens in pairs): two-level ``[B, H, bs/tg, tg, D/dg, dg]`` views
  from ``PageLayout.amx_bf16`` (``test_ops.py::test_probed_layouts`` checks it against vLLM's own write).
"""

from __future__ import annotations

import random

import torch

from vllm_contour.layout import (compaction_indices, decode_page_table, kept_blocks_for, plan_layout,
                                 region_source_table)
from vllm_contour.moments import accumulate
from vllm_contour.ops.cpu_layout import KEY_ROWS, KEY_TRANSPOSED, PageLayout, cpu_kv_views

LAYOUTS = ["cpu_rows", "cpu_keyT", "interleaved", "cpu_amx"]
GPU_LAYOUTS = ["cpu_rows", "cpu_keyT", "interleaved"]  # the Triton kernels take [B, H, bs, D] strided caches
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


_CPU = {"cpu_rows": lambda bs, d: KEY_ROWS, "cpu_keyT": lambda bs, d: KEY_TRANSPOSED,
        "cpu_amx": PageLayout.amx_bf16}


def make_cache(layout: str, nb: int, h: int, bs: int, d: int, dtype=torch.float32, seed: int = 0):
    """Returns ``(storage, key_cache, value_cache)``."""
    g = torch.Generator().manual_seed(seed)
    if layout in _CPU:
        kv = torch.randn(nb, h, bs, 2 * d, generator=g).to(dtype)
        k, v = cpu_kv_views(kv, _CPU[layout](bs, d))
        return kv, k, v
    if layout == "interleaved":
        kv = torch.randn(2, nb, bs, h, d + 3, generator=g).to(dtype)
        return kv, kv[0].permute(0, 2, 1, 3)[..., :d], kv[1].permute(0, 2, 1, 3)[..., :d]
    raise ValueError(layout)


def views_of(layout: str, storage: torch.Tensor, d: int):
    """Key/value views of (a clone of) a storage tensor made by ``make_cache``."""
    if layout in _CPU:
        return cpu_kv_views(storage, _CPU[layout](storage.shape[2], d))
    return storage[0].permute(0, 2, 1, 3)[..., :d], storage[1].permute(0, 2, 1, 3)[..., :d]


def decode_case(seed: int, nb: int, h: int, bs: int, t_rows: int = 3, long_tail: bool = False):
    """Page tables like the backend builds them: per row a random ragged layout (lane borrowing, heads
    with empty runs), a dense tail (partial last page), padded to a common width. Returns
    ``(page_table [T, H, P] int32, seq_lens [T, H] int32)``."""
    rnd = random.Random(seed)
    tables, lens = [], []
    for r in range(t_rows):
        e = rnd.randint(1, 4)
        tail_tokens = rnd.randint(4 * bs, 6 * bs - 1) if (long_tail and r == 0) else rnd.randint(1, 2 * bs)
        n_tail = (tail_tokens + bs - 1) // bs
        blocks = rnd.sample(range(nb), e + n_tail)
        pages = torch.tensor([[rnd.randint(0, e) for _ in range(h)]])
        pages[0, rnd.randrange(h)] = 0  # an empty run: this head reads only the tail
        while kept_blocks_for(pages, h) > e:
            pages[0, rnd.randrange(h)] = max(0, int(pages[0].max()) - 1)
        lay = plan_layout(pages, blocks[:e], bs, h, e)
        tab, sl = decode_page_table(lay, blocks[e:], tail_tokens)
        tables.append(tab[0])
        lens.append(sl[0])
    width = max(t.shape[1] for t in tables)
    page_table = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=int(t[0, 0]))
                              for t in tables])
    return page_table.to(torch.int32), torch.stack(lens).to(torch.int32)


def random_moments(seed: int, t: int, h: int, d: int, max_n: int = 40) -> dict:
    """Moments of random evicted sets, ``n`` in {0, ..., max_n} (some heads with nothing evicted)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(t * h, max_n, d, generator=g)
    vals = torch.randn(t * h, max_n, d, generator=g)
    counts = torch.randint(0, max_n + 1, (t * h,), generator=g)
    counts[0] = 0
    mask = torch.arange(max_n).view(1, -1) < counts.view(-1, 1)
    m = accumulate(keys, vals, mask)
    return {"n": m.n.view(t, h), "sum_k": m.sum_k.view(t, h, d), "sum_v": m.sum_v.view(t, h, d),
            "sum_vk": m.sum_vk.view(t, h, d, d)}


def compaction_moves(seed: int, nb: int, h: int, bs: int, blocks: int = 5):
    """One layer's moves of a real eviction (kept tokens of every head packed into the first of ``blocks``
    blocks, heads borrowing lanes): sources and destinations overlap."""
    rnd = random.Random(seed)
    e = min(nb, blocks)
    block_ids = rnd.sample(range(nb), e)
    kept = []
    pages = []
    for _ in range(h):
        p = rnd.randint(0, e)
        pages.append(p)
        kept.append(torch.tensor(sorted(rnd.sample(range(e * bs), p * bs)), dtype=torch.int64))
    pages_t = torch.tensor([pages])  # at most e pages per head: fits in the region's e blocks
    lay = plan_layout(pages_t, block_ids, bs, h, e)
    return compaction_indices(kept, lay.page_ids[0], region_source_table(block_ids, h), bs)


def permutation_moves(seed: int, nb: int, h: int, bs: int, m: int):
    """``m`` distinct slots moved onto a permutation of themselves (cycles: every source is clobbered)
    plus ``m // 4`` moves to fresh slots."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(nb * h * bs, generator=g)[: m + m // 4]
    src = slots[:m]
    dst = src[torch.randperm(m, generator=g)]
    src = torch.cat([src, src[: m // 4]])
    dst = torch.cat([dst, slots[m:]])
    return src // bs, src % bs, dst // bs, dst % bs


def token_list(seed: int, nb: int, h: int, bs: int, m: int, hm: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, nb * h, (m,), generator=g), torch.randint(0, bs, (m,), generator=g),
            torch.randint(0, hm, (m,), generator=g))


def zero_moments(hm: int, d: int, seed: int | None = None) -> dict:
    if seed is None:
        z = torch.zeros
        return {"n": z(hm), "sum_k": z(hm, d), "sum_v": z(hm, d), "sum_vk": z(hm, d, d)}
    g = torch.Generator().manual_seed(seed)
    return {"n": torch.randint(0, 5, (hm,), generator=g).float(), "sum_k": torch.randn(hm, d, generator=g),
            "sum_v": torch.randn(hm, d, generator=g), "sum_vk": torch.randn(hm, d, d, generator=g)}


def tol(dtype):
    """Output tolerance (the output is rounded to the query dtype)."""
    return {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]
