"""One dispatch per op. Implementations, best first:

* ``cpp`` — the C++/OpenMP CPU kernels ``vllm_contour._C`` (built at install by setup.py; registered only
  when the compiled module imports, see ``cpu_ext``),
* ``triton`` — the Triton kernels of the top-level ``triton_ops`` package, for CUDA tensors (imported
  lazily the first time a CUDA tensor reaches an op),
* ``vllm_cpu`` — vLLM's own CPU attention kernel driven with one pseudo-request per (token, KV head);
  decode without moments or lse only,
* ``torch`` — the reference (always).

Moment storage (``store_moments`` / ``load_moments``: MomentKV statistics kept in the request's own
head-pages, so they are bytes of vLLM's pool), raw page elements (``read_page_elems`` /
``write_page_elems``: window queries kept in blocks of vLLM's pool until their round), ``clear_pages`` and
``copy_blocks`` go through the same dispatch; they are written through the logical key/value views, so they
work on every layout the views express.

fp8 caches (vLLM's uint8 pages, ``fp8.py``): the ops that read numbers take the layer's tables (``dequant``:
``fp8.KVDequant``; ``gather_pages``: ``luts [L, 256]``) and only implementations that read them are picked
(``cpp`` where the loaded module has them, ``torch``); the ops that move bytes take them as any dtype.

Choose explicitly with ``impl=...`` or, for debugging, ``VLLM_CONTOUR_OPS_IMPL=torch``.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from .paged import copy_blocks_ref, gather_pages_ref
from .reference import (accumulate_moments_ref, compact_ref, dense_attention_ref, load_moments_ref,
                        ragged_decode_attention_ref, read_page_elems_ref, store_moments_ref,
                        write_page_elems_ref)

# op -> list of (name, fn, supports(device_type, **kw) -> bool), in priority order (best first)
_IMPLS: dict[str, list[tuple[str, Callable, Callable[..., bool]]]] = {
    "compact": [],
    "accumulate_moments": [],
    "ragged_decode_attention": [],
    "store_moments": [],
    "load_moments": [],
    "read_page_elems": [],
    "write_page_elems": [],
    "copy_blocks": [],
    "gather_pages": [],
    "compacted_attention": [],
}


# (op, implementation) -> number of calls dispatched in this process (tests and benchmarks read it).
CALLS: dict[tuple[str, str], int] = {}


def register_impl(op: str, name: str, fn: Callable, supports: Callable[..., bool], first: bool = True):
    lst = _IMPLS[op]
    lst[:] = [e for e in lst if e[0] != name]
    entry = (name, fn, supports)
    lst.insert(0, entry) if first else lst.append(entry)


register_impl("compact", "torch", compact_ref, lambda dev, **kw: True)
register_impl("accumulate_moments", "torch", accumulate_moments_ref, lambda dev, **kw: True)
register_impl("ragged_decode_attention", "torch", ragged_decode_attention_ref, lambda dev, **kw: True)
register_impl("store_moments", "torch", store_moments_ref, lambda dev, **kw: True)
register_impl("load_moments", "torch", load_moments_ref, lambda dev, **kw: True)
register_impl("read_page_elems", "torch", read_page_elems_ref, lambda dev, **kw: True)
register_impl("write_page_elems", "torch", write_page_elems_ref, lambda dev, **kw: True)
register_impl("copy_blocks", "torch", copy_blocks_ref, lambda dev, **kw: True)
register_impl("gather_pages", "torch", gather_pages_ref, lambda dev, **kw: True)

_TRITON_TRIED = False


def _load_triton() -> None:
    """Register the Triton implementations the first time a CUDA tensor is seen (importing Triton is slow
    and useless on CPU)."""
    global _TRITON_TRIED
    if _TRITON_TRIED:
        return
    _TRITON_TRIED = True
    try:
        from . import triton_impl  # noqa: F401
    except ImportError:
        pass


def available(op: str, device_type: str = "cpu", **kw) -> list[str]:
    if device_type == "cuda" or os.environ.get("VLLM_CONTOUR_OPS_IMPL") == "triton":
        _load_triton()
    return [name for name, _, ok in _IMPLS[op] if ok(device_type, **kw)]


def _pick(op: str, impl: str | None, device_type: str, **kw) -> Callable:
    impl = impl or os.environ.get("VLLM_CONTOUR_OPS_IMPL") or None
    if device_type == "cuda" or impl == "triton":
        _load_triton()
    for name, fn, ok in _IMPLS[op]:
        if impl is not None and name != impl:
            continue
        if ok(device_type, **kw):
            CALLS[(op, name)] = CALLS.get((op, name), 0) + 1
            return fn
    if impl is not None:
        raise ValueError(f"op {op}: implementation {impl!r} is not available for device {device_type!r} "
                         f"with {kw}; available: {available(op, device_type, **kw)}")
    raise RuntimeError(f"op {op}: no implementation for {device_type}")


def compact(key_cache, value_cache, src_page, src_off, dst_page, dst_off, impl: str | None = None):
    """Move tokens ``(src_page, src_off) -> (dst_page, dst_off)`` of K and V in place (overlap-safe)."""
    fn = _pick("compact", impl, key_cache.device.type, key_cache=key_cache, value_cache=value_cache)
    return fn(key_cache, value_cache, src_page, src_off, dst_page, dst_off)


def accumulate_moments(key_cache, value_cache, page_ids, offsets, head_of_token, moments: dict,
                       impl: str | None = None, dequant=None):
    """Add the tokens ``(page_ids, offsets)`` to the fp32 moments (``n [H]``, ``sum_k [H, D]``,
    ``sum_v [H, D]``, ``sum_vk [H, D, D]``) of KV head ``head_of_token``, in place (an fp8 cache: of the
    numbers its ``dequant`` tables read). Returns ``moments``."""
    fn = _pick("accumulate_moments", impl, key_cache.device.type, key_cache=key_cache,
               value_cache=value_cache, dequant=dequant)
    if dequant is None:
        fn(key_cache, value_cache, page_ids, offsets, head_of_token, moments)
    else:
        fn(key_cache, value_cache, page_ids, offsets, head_of_token, moments, dequant=dequant)
    return moments


def store_moments(key_cache, value_cache, page_ids, packed, impl: str | None = None) -> None:
    """Write one layer's packed fp32 moments (``vllm_contour.moments.pack``) into head-pages ``page_ids``."""
    fn = _pick("store_moments", impl, key_cache.device.type, key_cache=key_cache)
    fn(key_cache, value_cache, page_ids, packed)


def clear_pages(key_cache, value_cache, page_ids, impl: str | None = None) -> None:
    """Zero head-pages ``page_ids`` (keys and values). Moment pages hold raw fp32 bits in the cache dtype
    (NaN and inf patterns among them): they are cleared before their blocks can go back to vLLM's pool,
    where another request's attention would read them as stale keys past its own tokens."""
    store_moments(key_cache, value_cache, page_ids, torch.zeros(0, dtype=torch.float32), impl=impl)


def load_moments(key_cache, value_cache, page_ids, num_heads: int, head_dim: int, impl: str | None = None):
    """Read moments written by ``store_moments``: ``page_ids [..., M]`` -> dict with leading dims ``[..., H]``."""
    fn = _pick("load_moments", impl, key_cache.device.type, key_cache=key_cache)
    return fn(key_cache, value_cache, page_ids, num_heads, head_dim)


def read_page_elems(key_cache, value_cache, page_ids, impl: str | None = None) -> torch.Tensor:
    """Raw elements of head-pages ``page_ids [..., M]`` -> ``[..., M * 2*bs*D]`` cache-width integers."""
    fn = _pick("read_page_elems", impl, key_cache.device.type, key_cache=key_cache)
    return fn(key_cache, value_cache, page_ids)


def write_page_elems(key_cache, value_cache, page_ids, elems, values, impl: str | None = None) -> None:
    """Write raw ``values [n]`` at element ``elems [n]`` of head-page ``page_ids [n]``, in place."""
    fn = _pick("write_page_elems", impl, key_cache.device.type, key_cache=key_cache)
    fn(key_cache, value_cache, page_ids, elems, values)


def copy_blocks(caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]],
                impl: str | None = None) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's key and value cache (every head's page)."""
    if not pairs:
        return
    fn = _pick("copy_blocks", impl, caches[0][0].device.type, key_cache=caches[0][0])
    fn(caches, pairs)


def gather_pages(views: list[torch.Tensor], ids: torch.Tensor, impl: str | None = None,
                 luts: torch.Tensor | None = None) -> torch.Tensor:
    """Head-pages ``ids`` (``block * H + lane``; ``[M]`` for every layer, or ``[L, M]``) of every layer's cache
    view (one layout) in logical order: a new ``[L, M, bs, D]`` tensor (what scoring reads). A plain copy;
    fp8 caches with ``luts [L, 256]`` (each layer's key or value table, ``fp8.KVDequant``): their numbers,
    fp32. ``VLLM_CONTOUR_OPS_IMPL`` picks the implementation only where it names one of this op's (on CUDA,
    torch's indexing)."""
    dev = views[0].device.type
    kw = {"luts": luts} if luts is not None else {}
    if impl is None:
        names = available("gather_pages", dev, key_cache=views[0], **kw)
        forced = os.environ.get("VLLM_CONTOUR_OPS_IMPL") or None
        impl = forced if forced in names else names[0]
    return _pick("gather_pages", impl, dev, key_cache=views[0], **kw)(views, ids, **kw)


def _compacted_by_tables(query, key_cache, value_cache, rows, layer: int, scale, moments=None, out=None,
                         inner: str | None = None, **extra):
    """The compacted rows through per-token page tables (expanded once per step) and
    ``ragged_decode_attention`` (``inner``: its implementation), results written into ``out``."""
    exp = rows.tables_for_cpu()
    if exp is None:
        return out
    tok, idx, table, lens = exp
    mom = None if moments is None else {k: v[idx] for k, v in moments.items()}
    span = rows.compacted_span()
    if span is not None and out is not None:  # the tokens side by side: slices, the result straight into out
        ragged_decode_attention(query[span[0]:span[1]], key_cache, value_cache, table[layer], lens[layer], scale,
                                moments=mom, impl=inner, out=out[span[0]:span[1]], **extra)
        return out
    o, _ = ragged_decode_attention(query[tok], key_cache, value_cache, table[layer], lens[layer], scale,
                                   moments=mom, impl=inner, **extra)
    out[tok] = o.to(out.dtype)
    return out


register_impl("compacted_attention", "tables", _compacted_by_tables, lambda dev, **kw: True)


def compacted_attention(query, key_cache, value_cache, rows, layer: int, scale, moments=None, out=None,
                        impl: str | None = None, **extra):
    """Attention of every token of a step whose request is compacted (``page_tables.StepRows``), written
    into ``out`` (``[T, Hq, D]``, e.g. the layer's output rows); other tokens' rows are left as they are.
    Token t reads its request's kept run (layer ``layer``) and then its dense tail up to its own position.
    ``moments`` are per request of the step (``[n, H, ...]``). Implementations: ``triton`` reads the
    two-part lists directly (CUDA); ``tables`` expands per-token tables and calls
    ``ragged_decode_attention`` (``impl`` other than these two names is passed on to it)."""
    forced = impl or os.environ.get("VLLM_CONTOUR_OPS_IMPL") or None
    own = forced if forced in ("triton", "tables") else None
    dev = query.device.type
    fp8 = {"dequant": extra["dequant"]} if extra.get("dequant") is not None else {}
    own = own or available("compacted_attention", dev, forced=forced, **fp8)[0]
    fn = _pick("compacted_attention", own, dev, forced=forced, **fp8)
    if fn is _compacted_by_tables:
        inner = None if forced in (None, "triton", "tables") else forced
        return fn(query, key_cache, value_cache, rows, layer, scale, moments=moments, out=out, inner=inner, **extra)
    return fn(query, key_cache, value_cache, rows, layer, scale, moments=moments, out=out)


def implementations(device_type: str = "cpu") -> dict[str, str]:
    """The implementation each op would use now (what the engine logs and exports at start-up)."""
    out = {}
    forced = os.environ.get("VLLM_CONTOUR_OPS_IMPL") or None
    if device_type == "cuda" or forced == "triton":
        _load_triton()
    for op, lst in _IMPLS.items():
        names = [n for n, _, ok in lst if ok(device_type)]
        out[op] = forced if forced in names else (names[0] if names else "none")
    return out


def ragged_decode_attention(query, key_cache, value_cache, page_table, seq_lens, scale, moments=None,
                            impl: str | None = None, need_lse: bool = False, out=None, **extra):
    """Returns ``(out, lse)``; implementations without a log-sum-exp return ``lse=None`` and are only
    picked when ``need_lse`` is False. ``extra`` keywords (e.g. ``native=True``: the caches are views of
    vLLM's own CPU cache, which its kernel may read) go to the ``supports`` checks and the implementation.
    ``moments`` (dict ``n [T, H]``, ``sum_k``/``sum_v [T, H, D]``, ``sum_vk [T, H, D, D]``) mixes in the
    evicted part as ``vllm_contour.moments.merge_evicted`` defines. ``out`` (``[T, Hq, D]``, e.g. a view of
    the attention layer's output rows): the result is written there (in place where the implementation
    can, else copied). ``dequant`` (an fp8 cache's ``fp8.KVDequant``) goes with ``extra``."""
    fn = _pick("ragged_decode_attention", impl, key_cache.device.type, moments=moments is not None,
               need_lse=need_lse, key_cache=key_cache, value_cache=value_cache, **extra)
    o, lse = fn(query, key_cache, value_cache, page_table, seq_lens, scale, moments=moments, out=out, **extra)
    if out is not None and o.data_ptr() != out.data_ptr():
        out.copy_(o)
        o = out
    return o, lse


# Optional implementations register themselves on import (the later registration ranks first).
try:  # vLLM's CPU kernel (only importable where vLLM's CPU build is installed)
    from . import vllm_cpu as _vllm_cpu  # noqa: F401
except ImportError:
    pass

from . import cpu_ext as _cpu_ext  # noqa: E402,F401  (registers "cpp" when vllm_contour._C imports)


# Ranking on CPU: "cpp" (registered last) before "vllm_cpu" before "torch" (their timings against vLLM's own
# kernel: benchmarks.ops, docs/results.md); vLLM's per-layer cache views in the engine do not meet
# "vllm_cpu"'s stride condition. VLLM_CONTOUR_OPS_IMPL forces one implementation.

__all__ = ["compact", "accumulate_moments", "ragged_decode_attention", "store_moments", "load_moments",
           "read_page_elems", "write_page_elems",
           "clear_pages", "implementations", "register_impl", "available", "copy_blocks", "gather_pages",
           "compact_ref", "accumulate_moments_ref", "ragged_decode_attention_ref", "dense_attention_ref"]
