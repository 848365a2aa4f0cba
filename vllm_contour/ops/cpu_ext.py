"""The C++/OpenMP CPU kernels (``vllm_contour._C``, sources ``csrc/``) behind the dispatch.

``setup.py`` builds the module at install time; importing it registers ``torch.ops.vllm_contour.{compact,
accumulate_moments, ragged_decode_attention, gather_pages}`` (CPU dispatch key). When it is missing (e.g.
installed with ``VLLM_CONTOUR_NO_EXT=1``) nothing is registered and the ops fall back to the other
implementations; ``VLLM_CONTOUR_JIT_EXT=1`` (or :func:`load` with ``jit=True``, used by the tests) compiles it
from a source checkout with ``torch.utils.cpp_extension.load`` into a cached build directory instead.

The module is built for a portable baseline (x86-64-v2) with the kernels compiled once per ISA level
(``generic``, ``avx2``, ``avx512``, ``avx512_bf16``, ``amx``; ``csrc/contour.h``) whatever machine builds it;
the ops run the best level this CPU allows (:func:`isa`), at most ``VLLM_CONTOUR_CPU_ISA=<level>``
(``VLLM_CONTOUR_NO_AMX=1``: at most ``avx512_bf16``), or the level :func:`set_isa` / :func:`forced_isa` asks
for (the tests run every level the CPU has).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from . import register_impl
from .paged import dims

_REPO = Path(__file__).resolve().parents[2]
# the kernels (csrc/kernels.inc) compiled once per ISA level (csrc/contour.h) and the op front end (setup.py's)
SOURCES = [_REPO / "csrc" / f for f in ("isa_avx512.cpp", "isa_avx2.cpp", "isa_generic.cpp", "contour_ops.cpp",
                                         "isa_avx512_bf16.cpp")]
_mod = None
# Why the compiled kernels are not loaded (None when they are): logged by the engine at start-up.
LOAD_ERROR: str | None = None
# The shared library the kernels were loaded from (vllm_contour._C's file or the JIT build's), once loaded.
LIBRARY: str | None = None


def _cflags() -> list[str]:
    arch = os.environ.get("VLLM_CONTOUR_CPU_ARCH", "-march=x86-64-v2").split()
    return ["-O3", "-fopenmp", "-fno-math-errno", *arch]


def jit_build(build_dir: str | os.PathLike | None = None, verbose: bool = False) -> str:
    """Compile ``csrc/`` (:data:`SOURCES`) with ``torch.utils.cpp_extension.load`` and load it into
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
    global _mod, LOAD_ERROR, LIBRARY
    if _mod is not None:
        return _mod
    try:
        from vllm_contour import _C  # noqa: F401  (registers torch.ops.vllm_contour.*)
        LIBRARY = _C.__file__
    except ImportError as e:
        LOAD_ERROR = f"vllm_contour._C does not import: {e}"
    if not _have_ops() and (jit if jit is not None else os.environ.get("VLLM_CONTOUR_JIT_EXT") == "1"):
        LIBRARY = jit_build()
    if _have_ops():
        _register(torch.ops.vllm_contour)
        LOAD_ERROR = None
    return _mod


def _fp8_ops(mod) -> bool:
    """Does the loaded module read fp8 pages (its decode takes tables; a module built before them does not)?"""
    return hasattr(mod, "gather_pages_lut") and "k_lut" in str(mod.ragged_decode_attention.default._schema)


_FP8 = [False]  # the loaded module reads fp8 pages


def _cpu(dev: str, key_cache=None, dequant=None, luts=None, **kw) -> bool:
    if (dequant is not None or luts is not None) and not _FP8[0]:
        return False
    return dev == "cpu" and (key_cache is None or key_cache.dim() in (4, 6))


def _register(mod) -> None:
    global _mod
    _mod = mod
    # the OpOverloads themselves: calling them skips the overload resolution of the packet (~10 us)
    _compact = mod.compact.default
    _accumulate = mod.accumulate_moments.default
    _decode = mod.ragged_decode_attention.default
    _gather = mod.gather_pages.default
    _FP8[0] = _fp8_ops(mod)
    _gather_lut = mod.gather_pages_lut.default if _FP8[0] else None

    def compact(key_cache, value_cache, src_page, src_off, dst_page, dst_off):
        _compact(key_cache, value_cache, src_page, src_off, dst_page, dst_off)

    def accumulate_moments(key_cache, value_cache, page_ids, offsets, head_of_token, moments, dequant=None):
        if dequant is None:
            _accumulate(key_cache, value_cache, page_ids, offsets, head_of_token, moments["n"],
                        moments["sum_k"], moments["sum_v"], moments["sum_vk"])
        else:
            _accumulate(key_cache, value_cache, page_ids, offsets, head_of_token, moments["n"],
                        moments["sum_k"], moments["sum_v"], moments["sum_vk"], dequant.k, dequant.v)
        return moments

    def ragged_decode_attention(query, key_cache, value_cache, page_table, seq_lens, scale, moments=None,
                                dequant=None, **_):
        luts = () if dequant is None else (dequant.k, dequant.v)
        if moments is None:
            if luts:
                return _decode(query, key_cache, value_cache, page_table, seq_lens, float(scale), None, None, None,
                               None, *luts)
            out, lse = _decode(query, key_cache, value_cache, page_table, seq_lens, float(scale))
        else:
            out, lse = _decode(query, key_cache, value_cache, page_table, seq_lens, float(scale), moments["n"],
                               moments["sum_k"], moments["sum_v"], moments["sum_vk"], *luts)
        return out, lse

    def gather_pages(views, ids, luts=None):
        _, _, bs, d = dims(views[0])
        if luts is not None:
            out = torch.empty((len(views), ids.shape[-1], bs, d), dtype=torch.float32)
            _gather_lut(views, ids, luts.to(torch.float32).contiguous(), out)
            return out
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


# ---------------------------------------------------------------------------------------------- ISA levels
LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")  # lowest first


def _ops():
    if _mod is None:
        raise RuntimeError(f"the C++ kernels are not loaded ({LOAD_ERROR or 'call load() first'})")
    if not hasattr(_mod, "cpu_isa"):
        raise RuntimeError("vllm_contour._C predates csrc/ (no cpu_isa op): rebuild it (bash scripts/setup.sh, or "
                           "pip install --no-build-isolation -e .)")
    return _mod


def isa() -> str | None:
    """The ISA level the C++ ops run at now (None when they are not loaded)."""
    return str(_ops().cpu_isa()) if _mod is not None else None


def isas() -> list[str]:
    """Every level compiled into the loaded module (all of :data:`LEVELS`, whatever machine built it)."""
    return [str(x) for x in _ops().cpu_isas()]


def missing(level: str) -> str:
    """What this CPU lacks to run ``level`` (GCC's feature names, e.g. ``"amx-tile amx-bf16"``); "" if nothing."""
    return str(_ops().cpu_isa_missing(level))


def set_isa(level: str) -> str:
    """Run the ops at ``level`` from now on (``"auto"``: the default again); raises where the CPU lacks it.
    Returns the level it replaces."""
    return str(_ops().set_cpu_isa(level))


@contextmanager
def forced_isa(level: str):
    """The ops at ``level`` inside the block, the previous level after it."""
    before = set_isa(level)
    try:
        yield level
    finally:
        set_isa(before)


def describe() -> str:
    """One line: the level the ops run at and how decode reads vLLM's pages there, the levels this CPU runs
    and those compiled in (for logs and the test summary)."""
    o = _ops()
    runs = [lv for lv in isas() if not missing(lv)]
    return (f"ISA level {o.cpu_isa()} (decode path: AMX pages {o.decode_path('amx')}, vec pages "
            f"{o.decode_path('vec')}); this CPU runs {', '.join(runs)}; compiled: {', '.join(isas())} "
            f"(baseline {o.cpu_baseline()})")


__all__ = ["load", "jit_build", "SOURCES", "LIBRARY", "LEVELS", "isa", "isas", "missing", "set_isa", "forced_isa",
           "describe"]
