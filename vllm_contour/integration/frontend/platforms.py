"""Where eviction runs, as data: vLLM platform -> the attention backend the plugin puts over vLLM's and what
the engine's settings must be for it. How a layer's cache is viewed as ``[B, H, bs, D]`` keys and values
is the backend impl's own ``kv_views``; the ops pick their kernels by the tensors' device.

- ``cpu``: vLLM's CPU backend (``CPU_ATTN``) with the row logic mixed in; C++ ops; page layouts probed from
  vLLM's own cache-write op (``ops/cpu_layout.py``); unquantised or fp8 caches (``ops/fp8.py``).
- ``cuda``: vLLM's Triton backend (``TRITON_ATTN``: its kernel serves every ordinary row) with the same row
  logic; Triton ops; vLLM 0.32's logical ``[blocks, H, bs, 2*head_size]`` cache, keys then values;
  unquantised caches only (the Triton kernels read no fp8 pages).
A platform missing here refuses ``--kv-eviction-policy`` at start-up, naming the platform; a
``--kv-cache-dtype`` whose pages the platform's ops do not read is refused naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vllm_contour.config import EvictionConfigError


def _prepare_cpu(engine_args) -> None:
    return None


_FULL_GRAPHS = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
UNQUANTISED = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
               "float": "float32"}  # --kv-cache-dtype names of unquantised caches -> torch dtype names
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's CPU fp8 caches: e4m3 / e5m2 bytes with per-layer scales


def _prepare_cuda(engine_args) -> None:
    """vLLM's Triton backend, piecewise CUDA graphs, no async scheduling (the cache dtype: ``check_kv_cache_dtype``);
    either model runner (Model Runner V2 where vLLM picks it, its default for Llama/Qwen-family models)."""
    chosen = getattr(engine_args, "attention_backend", None)
    ac = getattr(engine_args, "attention_config", None)
    chosen = chosen or (ac.get("backend") if isinstance(ac, dict) else getattr(ac, "backend", None))
    name = getattr(chosen, "name", chosen)
    if name is not None and str(name).lower() == "auto":
        name = None
    if name is not None and str(name).upper() != "TRITON_ATTN":
        raise EvictionConfigError(
            f"--attention-backend {name} cannot be combined with --kv-eviction-policy on CUDA: eviction runs "
            "on vLLM's Triton backend (TRITON_ATTN, set by the plugin); drop --attention-backend")
    if name is None:
        engine_args.attention_backend = "TRITON_ATTN"
    cc = getattr(engine_args, "compilation_config", None)
    mode = cc.get("cudagraph_mode") if isinstance(cc, dict) else getattr(cc, "cudagraph_mode", None)
    mode = getattr(mode, "name", mode)
    if mode is not None and str(mode).upper() in _FULL_GRAPHS:
        raise EvictionConfigError(
            f"--compilation-config cudagraph_mode={mode} cannot be combined with --kv-eviction-policy: compacted "
            "rows change their page tables between steps, so attention runs outside CUDA graphs; use "
            "cudagraph_mode PIECEWISE (the plugin's default) or NONE")
    if getattr(engine_args, "async_scheduling", None):
        raise EvictionConfigError(
            "--async-scheduling cannot be combined with --kv-eviction-policy: a round's freed blocks and its "
            "outcome must reach the scheduler before it schedules the next step; drop --async-scheduling")
    engine_args.async_scheduling = False  # vLLM turns it on by default on CUDA


@dataclass(frozen=True)
class Platform:
    device_type: str  # vLLM's ``current_platform.device_type``
    backend: str  # the AttentionBackendEnum member the plugin's backend is registered over
    backend_cls: str  # "module.Class" of the plugin's backend
    prepare: Callable  # engine_args -> None: wire or refuse (naming the flag) what the backend needs
    kernels: str = "the plugin's kernels"  # what reads its compacted pages (named when a cache dtype is refused)
    quantised: tuple[str, ...] = ()  # --kv-cache-dtype names of quantised caches whose pages its ops read

    def check_kv_cache_dtype(self, kv_dtype) -> None:
        """Refuse (naming ``--kv-cache-dtype``) a cache whose pages this platform's ops cannot read; one equal to
        the model's dtype is checked at start-up (``engine_args.cache_shape_of``)."""
        if kv_dtype in (None, "auto", *UNQUANTISED, *self.quantised):
            return
        why = f": {self.kernels} read no {kv_dtype} pages"
        if str(kv_dtype).startswith("turboquant_"):
            why = (": TurboQuant packs each head's keys and values, rotated and quantised to 3-8 bits, into one slot "
                   "per token that only vLLM's TURBOQUANT backend reads; there are no per-head pages to pack")
        raise EvictionConfigError(f"--kv-cache-dtype {kv_dtype} cannot be combined with --kv-eviction-policy on "
                                  f"{self.device_type}{why}; use {' or '.join(('auto', *self.quantised))}")


PLATFORMS = {
    "cpu": Platform("cpu", "CPU_ATTN", "vllm_contour.integration.backends.cpu.ContourCPUAttentionBackend", _prepare_cpu,
                    kernels="the C++ kernels", quantised=FP8),
    "cuda": Platform("cuda", "TRITON_ATTN", "vllm_contour.integration.backends.triton.ContourTritonAttentionBackend",
                     _prepare_cuda, kernels="the Triton kernels"),
}


def platform_of(device_type: str) -> Platform:
    from vllm.platforms import current_platform

    if device_type == "cuda" and current_platform.is_rocm():  # vLLM's ROCm platform reports CUDA's device type
        raise EvictionConfigError("--kv-eviction-policy: vllm-contour has not run on ROCm; it evicts on vLLM's "
                                  "CUDA and CPU platforms")
    p = PLATFORMS.get(device_type)
    if p is None:
        raise EvictionConfigError(
            f"--kv-eviction-policy: vllm-contour evicts on vLLM's {' and '.join(PLATFORMS)} platforms; the current "
            f"platform is {device_type}")
    return p


def current() -> Platform | None:
    """The current vLLM platform's entry (None where eviction does not run)."""
    from vllm.platforms import current_platform

    return PLATFORMS.get(current_platform.device_type)
