"""One dispatch per op. Implementations: ``torch`` (reference, always), ``vllm_cpu`` (vLLM's own CPU
attention kernel driven with one pseudo-request per (token, KV head); decode without moments only),
and those registered by the C++ / Triton modules when they are available.

Choose explicitly with ``impl=...`` or, for debugging, ``VLLM_CONTOUR_OPS_IMPL=torch``.
"""

from __future__ import annotations

import os
from typing import Callable

from .reference import compact_ref, dense_attention_ref, ragged_decode_attention_ref

# op -> list of (name, fn, supports(device_type, **kw) -> bool), in priority order (best first)
_IMPLS: dict[str, list[tuple[str, Callable, Callable[..., bool]]]] = {
    "compact": [],
    "ragged_decode_attention": [],
}


def register_impl(op: str, name: str, fn: Callable, supports: Callable[..., bool], first: bool = True):
    lst = _IMPLS[op]
    lst[:] = [e for e in lst if e[0] != name]
    entry = (name, fn, supports)
    lst.insert(0, entry) if first else lst.append(entry)


register_impl("compact", "torch", compact_ref, lambda dev, **kw: True)
register_impl("ragged_decode_attention", "torch", ragged_decode_attention_ref, lambda dev, **kw: True)


def available(op: str, device_type: str = "cpu", **kw) -> list[str]:
    return [name for name, _, ok in _IMPLS[op] if ok(device_type, **kw)]


def _pick(op: str, impl: str | None, device_type: str, **kw) -> Callable:
    impl = impl or os.environ.get("VLLM_CONTOUR_OPS_IMPL") or None
    for name, fn, ok in _IMPLS[op]:
        if impl is not None and name != impl:
            continue
        if ok(device_type, **kw):
            return fn
    if impl is not None:
        raise ValueError(f"op {op}: implementation {impl!r} is not available for device {device_type!r} "
                         f"with {kw}; available: {available(op, device_type, **kw)}")
    raise RuntimeError(f"op {op}: no implementation for {device_type}")


def compact(key_cache, value_cache, src_page, src_off, dst_page, dst_off, impl: str | None = None):
    fn = _pick("compact", impl, key_cache.device.type)
    return fn(key_cache, value_cache, src_page, src_off, dst_page, dst_off)


def ragged_decode_attention(query, key_cache, value_cache, page_table, seq_lens, scale, moments=None,
                            impl: str | None = None, need_lse: bool = False, native: bool = False, **extra):
    """Returns ``(out, lse)``; implementations without a log-sum-exp return ``lse=None`` and are only
    picked when ``need_lse`` is False. ``native=True`` says the caches are vLLM's own CPU layout (views
    from ``cpu_layout.cpu_kv_views``), which vLLM's kernel can read directly."""
    fn = _pick("ragged_decode_attention", impl, key_cache.device.type, moments=moments is not None,
               need_lse=need_lse, key_cache=key_cache, value_cache=value_cache, native=native)
    return fn(query, key_cache, value_cache, page_table, seq_lens, scale, moments=moments, **extra)


# Optional implementations register themselves on import.
try:  # vLLM's CPU kernel (only importable where vLLM's CPU build is installed)
    from . import vllm_cpu as _vllm_cpu  # noqa: F401
except ImportError:
    pass

__all__ = ["compact", "ragged_decode_attention", "register_impl", "available", "compact_ref",
           "ragged_decode_attention_ref", "dense_attention_ref"]
