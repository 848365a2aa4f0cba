"""The C++/OpenMP CPU kernels (``vllm_contour._C``, source ``csrc/contour_ops.cpp``) behind the dispatch.

``setup.py`` builds the module at install time; importing it registers ``torch.ops.vllm_contour.{compact,
accumulate_moments, ragged_decode_attention}`` (CPU dispatch key). When it is missing (e.g. installed with
``VLLM_CONTOUR_NO_EXT=1``) nothing is registered and the ops fall back to the other implementations;
``VLLM_CONTOUR_JIT_EXT=1`` (or :func:`load` with ``jit=True``, used by the tests) compiles it from a source
checkout with ``torch.utils.cpp_extension.load`` into a cached build directory instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import register_impl
from .paged import dims

_REPO = Path(__file__).resolve().parents[2]
SOURCES = [_REPO / "csrc" / "contour_ops.cpp"]
_mod = None
# Why the compiled kernels are not loaded (None when they are): logged by the engine at start-up.
LOAD_ERROR: str | None = None


def _cflags() -> list[str]:
    arch = os.environ.get("VLLM_CONTOUR_CPU_ARCH", "-march=native").split()
    return ["-O3", "-fopenmp", "-fno-math-errno", *arch]


def jit_build(build_dir: str | os.PathLike | None = None, verbose: bool = False) -> str:
    """Compile ``csrc/contour_ops.cpp`` with ``torch.utils.cpp_extension.load`` and load it into
    ``torch.ops.vllm_contour`` (cached: with unchanged sources a second call only loads the library).
    Returns the library path."""
    from torch.utils.cpp_extension import load as _load

    if not all(s.exists() for s in SOURCES):
        raise ImportError(f"no C++ sources at {SOURCES[0].parent} (not a source checkout)")
    build_dir = Path(build_dir or os.environ.get("VLLM_CONTOUR_EXT_BUILD_DIR") or _REPO / "build" / "jit_ext")
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "2")
    return _load(name="vllm_contour_C", sources=[str(s) for s in SOURCES], extra_cflags=_cflags(),
                 extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=verbose,
                 is_python_module=False)


def _have_ops() -> bool:
    try:
        return hasattr(torch.ops.vllm_contour, "ragged_decode_attention")
    except (AttributeError, RuntimeError):
        return False


def load(jit: bool | None = None):
    """``torch.ops.vllm_contour`` once the compiled kernels are loaded (registering them in the dispatch),
    else None. ``jit=None`` reads ``VLLM_CONTOUR_JIT_EXT``."""
    global _mod, LOAD_ERROR
    if _mod is not None:
        return _mod
    try:
        from vllm_contour import _C  # noqa: F401  (registers torch.ops.vllm_contour.*)
    except ImportError as e:
        LOAD_ERROR = f"vllm_contour._C does not import: {e}"
    if not _have_ops() and (jit if jit is not None else os.environ.get("VLLM_CONTOUR_JIT_EXT") == "1"):
        jit_build()
    if _have_ops():
        _register(torch.ops.vllm_contour)
        LOAD_ERROR = None
    return _mod


def _cpu(dev: str, key_cache=None, **kw) -> bool:
    return dev == "cpu" and (key_cache is None or key_cache.dim() in (4, 6))


def _register(mod) -> None:
    global _mod
    _mod = mod
    # the OpOverloads themselves: calling them skips the overload resolution of the packet (~10 us)
    _compact = mod.compact.default
    _accumulate = mod.accumulate_moments.default
    _decode = mod.ragged_decode_attention.default
    _gather = mod.gather_pages.default

    def compact(key_cache, value_cache, src_page, src_off, dst_page, dst_off):
        _compact(key_cache, value_cache, src_page, src_off, dst_page, dst_off)

    def accumulate_moments(key_cache, value_cache, page_ids, offsets, head_of_token, moments):
        _accumulate(key_cache, value_cache, page_ids, offsets, head_of_token, moments["n"],
                               moments["sum_k"], moments["sum_v"], moments["sum_vk"])
        return moments

    def ragged_decode_attention(query, key_cache, value_cache, page_table, seq_lens, scale, moments=None,
                                **_):
        if moments is None:
            out, lse = _decode(query, key_cache, value_cache, page_table, seq_lens, float(scale))
        else:
            out, lse = _decode(query, key_cache, value_cache, page_table, seq_lens, float(scale), moments["n"],
                               moments["sum_k"], moments["sum_v"], moments["sum_vk"])
        return out, lse

    def gather_pages(views, ids):
        _, _, bs, d = dims(views[0])
        out = torch.empty((len(views), ids.shape[-1], bs, d), dtype=views[0].dtype)
        _gather(views, ids, out)
        return out

    register_impl("compact", "cpp", compact, _cpu)
    register_impl("gather_pages", "cpp", gather_pages, _cpu)
    register_impl("accumulate_moments", "cpp", accumulate_moments, _cpu)
    register_impl("ragged_decode_attention", "cpp", ragged_decode_attention, _cpu)


try:
    load()
except Exception as _e:  # a broken build must not break the package: fall back to the other implementations
    _mod = None
    LOAD_ERROR = f"{type(_e).__name__}: {_e}"

__all__ = ["load", "jit_build", "SOURCES"]
