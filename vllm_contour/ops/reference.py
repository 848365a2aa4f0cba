"""Torch reference implementations of the ops. Always available; the others are checked against them.

Cache convention for every op: ``key_cache`` and ``value_cache`` are ``[num_blocks, H, block_size, D]``
views with arbitrary strides (vLLM's CPU layout ``[B, H, bs, 2D]`` gives K rows then V rows inside one
contiguous head-page; GPU layouts interleave heads per token), or the two-level
``[num_blocks, H, bs/tg, tg, D/dg, dg]`` form of packed layouts (vLLM's AMX pages, see ``cpu_layout``),
read and written through ``paged``. A head-page id is ``block * H + lane``. fp8 caches are uint8 views whose
ops that read numbers take ``dequant`` (``ops.fp8.KVDequant``: the layer's byte -> fp32 tables); ops that move
bytes treat them as any other dtype.
"""

from __future__ import annotations

import math

import torch

from .paged import dims, pages, rows, set_pages, set_rows


def _split(page_ids: torch.Tensor, num_heads: int):
    p = page_ids.to(torch.int64)
    return p // num_heads, p % num_heads


def compact_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, src_page: torch.Tensor,
                src_off: torch.Tensor, dst_page: torch.Tensor, dst_off: torch.Tensor) -> None:
    """Move token (src_page, src_off) -> (dst_page, dst_off) for K and V, in place. Sources and
    destinations may overlap (a token may be overwritten after it was read): everything is gathered
    out of place first, then scattered."""
    if src_page.numel() == 0:
        return
    h = key_cache.shape[1]
    sb, sl = _split(src_page, h)
    db, dl = _split(dst_page, h)
    so, do = src_off.to(torch.int64), dst_off.to(torch.int64)
    k = rows(key_cache, sb, sl, so).clone()
    v = rows(value_cache, sb, sl, so).clone()
    set_rows(key_cache, db, dl, do, k)
    set_rows(value_cache, db, dl, do, v)


def _numbers(x: torch.Tensor, lut: torch.Tensor | None) -> torch.Tensor:
    """Cache elements as fp32 numbers: floats widened, fp8 bytes through their table."""
    if x.dtype == torch.uint8:
        if lut is None:
            raise ValueError("an fp8 (uint8) cache is read only through its tables (dequant=KVDequant)")
        return lut.to(x.device)[x.to(torch.int64)]
    return x.to(torch.float32)


def ragged_decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                moments=None, dequant=None, **_):
    """Decode attention over per-head ragged page lists.

    query ``[T, Hq, D]`` (one token per row); ``page_table [T, H, P]`` head-page ids, ``seq_lens [T, H]``
    tokens of each list (all pages full but the last). Query head ``q`` reads KV head ``q // (Hq/H)``.
    Returns ``(out [T, Hq, D] in query dtype, lse [T, Hq] fp32)`` where lse is the natural-log
    log-sum-exp of the scaled logits over the kept tokens.

    ``moments`` (optional, see ``vllm_contour.moments``) mixes in the closed-form estimate of the evicted
    part: dict with ``n [T, H]``, ``sum_k [T, H, D]``, ``sum_v [T, H, D]``, ``sum_vk [T, H, D, D]`` fp32.
    ``dequant``: an fp8 cache's tables (``ops.fp8.KVDequant``).
    """
    t, hq, d = query.shape
    _, h, bs, _ = dims(key_cache)
    g = hq // h
    p = page_table.shape[2]
    blk, lane = _split(page_table, h)  # [T, H, P]
    k = _numbers(pages(key_cache, blk, lane), dequant and dequant.k).reshape(t, h, p * bs, d)
    v = _numbers(pages(value_cache, blk, lane), dequant and dequant.v).reshape(t, h, p * bs, d)
    q = query.to(torch.float32).reshape(t, h, g, d)
    logits = torch.einsum("thgd,thnd->thgn", q, k) * scale
    valid = torch.arange(p * bs, device=k.device).view(1, 1, -1) < seq_lens.to(k.device, torch.int64).unsqueeze(-1)  # [T, H, N]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [T, H, G]
    # an empty list (seq_len 0) gives out = 0, lse = -inf (not NaN)
    probs = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("thgn,thnd->thgd", probs, v)
    if moments is not None:
        from vllm_contour.moments import merge_evicted

        out, lse = merge_evicted(out, lse, q, moments, scale)
    return out.reshape(t, hq, d).to(query.dtype), lse.reshape(t, hq)


def accumulate_moments_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, page_ids: torch.Tensor,
                           offsets: torch.Tensor, head_of_token: torch.Tensor, moments: dict, dequant=None) -> dict:
    """Add tokens (head-page id, offset) to the fp32 moments of KV head ``head_of_token`` in place:
    ``n [H] += 1``, ``sum_k [H, D] += k``, ``sum_v [H, D] += v``, ``sum_vk [H, D, D] += v k^T`` (row: value
    dim). fp8 caches: of the numbers ``dequant`` reads. Returns ``moments``."""
    if page_ids.numel() == 0:
        return moments
    h = key_cache.shape[1]
    blk, lane = _split(page_ids.reshape(-1), h)
    off = offsets.reshape(-1).to(torch.int64)
    k = _numbers(rows(key_cache, blk, lane, off), dequant and dequant.k)  # [M, D]
    v = _numbers(rows(value_cache, blk, lane, off), dequant and dequant.v)
    hd = head_of_token.reshape(-1).to(torch.int64)
    hd = hd.to(moments["n"].device)
    moments["n"].index_add_(0, hd, torch.ones(hd.numel(), dtype=moments["n"].dtype, device=hd.device))
    moments["sum_k"].index_add_(0, hd, k.to(moments["sum_k"].dtype))
    moments["sum_v"].index_add_(0, hd, v.to(moments["sum_v"].dtype))
    for head in hd.unique().tolist():
        sel = hd == head
        moments["sum_vk"][head] += v[sel].T @ k[sel]
    return moments


def dense_attention_ref(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """Plain attention of one query row ``[Hq, D]`` over explicit ``keys/values [H, N, D]`` (test oracle)."""
    hq, d = query.shape
    h = keys.shape[0]
    q = query.to(torch.float32).reshape(h, hq // h, d)
    logits = torch.einsum("hgd,hnd->hgn", q, keys.to(torch.float32)) * scale
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("hgn,hnd->hgd", torch.softmax(logits, dim=-1), values.to(torch.float32))
    return out.reshape(hq, d), lse.reshape(hq)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


_INT_OF = {4: torch.int32, 2: torch.int16, 1: torch.int8}


def _page_elems(key_cache: torch.Tensor, value_cache: torch.Tensor, page_ids: torch.Tensor):
    """Integer views of the key and value elements of head-pages ``page_ids [..., M]`` -> ``[..., M, 2*bs*D]``
    (keys of a page in its logical ``[bs, D]`` order, then its values). Any layout the logical views
    express (token-major, transposed, strided) gives the same element order, so what ``store_moments``
    writes ``load_moments`` reads back bit for bit."""
    h = key_cache.shape[1]
    it = _INT_OF[key_cache.element_size()]
    blk, lane = _split(page_ids, h)
    k = pages(key_cache.view(it), blk, lane)  # [..., M, bs, D]
    v = pages(value_cache.view(it), blk, lane)
    return torch.cat([k.flatten(-2), v.flatten(-2)], dim=-1)


def read_page_elems_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """The raw elements (cache-width integers) of head-pages ``page_ids [..., M]`` as one sequence per leading
    index ``[..., M * 2*bs*D]``: each page's keys in logical ``[bs, D]`` order, then its values."""
    raw = _page_elems(key_cache, value_cache, page_ids.to(torch.int64))
    return raw.reshape(*raw.shape[:-2], -1)


def write_page_elems_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, page_ids: torch.Tensor,
                         elems: torch.Tensor, values: torch.Tensor) -> None:
    """Write raw elements ``values [n]`` (cache-width integers) at element ``elems [n]`` of head-page
    ``page_ids [n]`` (a page's elements in ``read_page_elems`` order: its keys ``[bs, D]``, then its values),
    leaving every other element as it was: one scatter per cache, no page read back (a decode step writes a
    few elements of many pages in every layer). Through the logical views: any layout they express."""
    if page_ids.numel() == 0:
        return
    _, h, bs, d = dims(key_cache)
    it = _INT_OF[key_cache.element_size()]
    e = elems.to(torch.int64)
    blk, lane = _split(page_ids, h)
    is_v = e >= bs * d
    rem = e - is_v.to(torch.int64) * (bs * d)
    t, c = rem // d, rem % d
    vals = values.to(it)
    for cache, m in ((key_cache, ~is_v), (value_cache, is_v)):
        cv = cache.view(it)
        if cv.dim() == 4:
            cv[blk[m], lane[m], t[m], c[m]] = vals[m]
        else:
            tg, dg = cv.shape[3], cv.shape[5]
            tm, cm = t[m], c[m]
            cv[blk[m], lane[m], tm // tg, tm % tg, cm // dg, cm % dg] = vals[m]


def moment_page_rows(packed: torch.Tensor, num_pages: int, block_size: int, head_dim: int,
                     elem_size: int) -> torch.Tensor:
    """One layer's packed fp32 moments as the raw page contents ``[M, 2, bs, D]`` (cache-width integers,
    zero-padded): page i's keys in logical ``[bs, D]`` order, then its values."""
    it = _INT_OF[elem_size]
    per_page = 2 * block_size * head_dim
    raw = packed.to(torch.float32).contiguous().view(torch.int32).view(it).reshape(-1)
    if raw.numel() > num_pages * per_page:
        raise ValueError(f"moments need {raw.numel()} elements, {num_pages} pages hold {num_pages * per_page}")
    buf = torch.zeros(num_pages * per_page, dtype=it, device=packed.device)
    buf[: raw.numel()] = raw
    return buf.view(num_pages, 2, block_size, head_dim)


def moments_of_page_rows(raw: torch.Tensor, num_heads: int, head_dim: int, elem_size: int) -> dict:
    """Inverse of ``moment_page_rows`` with leading dims: ``raw [..., M, 2, bs, D]`` -> moments ``[..., H]``."""
    from vllm_contour.moments import packed_len, unpack

    flat = raw.reshape(*raw.shape[:-4], -1).contiguous()
    n_el = packed_len(num_heads, head_dim) * 4 // elem_size
    vals = flat[..., :n_el].contiguous().view(torch.int32)
    return unpack(vals.view(torch.float32), num_heads, head_dim)


def store_moments_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, page_ids: torch.Tensor,
                      packed: torch.Tensor) -> None:
    """Write one layer's packed fp32 moments (``moments.pack``) into head-pages ``page_ids [M]``, as raw
    bits through the logical key/value views (layout-independent)."""
    _, h, bs, d = dims(key_cache)
    it = _INT_OF[key_cache.element_size()]
    buf = moment_page_rows(packed.to(key_cache.device), page_ids.numel(), bs, d, key_cache.element_size())
    blk, lane = _split(page_ids.reshape(-1), h)
    set_pages(key_cache.view(it), blk, lane, buf[:, 0])
    set_pages(value_cache.view(it), blk, lane, buf[:, 1])


def load_moments_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, page_ids: torch.Tensor,
                     num_heads: int, head_dim: int) -> dict:
    """Read what ``store_moments`` wrote: ``page_ids [..., M]`` -> dict of fp32 moments with leading dims
    ``[..., H]`` (``moments.unpack``)."""
    _, _, bs, d = dims(key_cache)
    raw = _page_elems(key_cache, value_cache, page_ids.to(torch.int64))  # [..., M, 2*bs*D]
    return moments_of_page_rows(raw.view(*raw.shape[:-1], 2, bs, d), num_heads, head_dim,
                                key_cache.element_size())
