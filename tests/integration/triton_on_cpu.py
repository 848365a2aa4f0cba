"""TEST ONLY: the plugin's CUDA backend (vLLM's Triton backend classes + the plugin's row logic) run by vLLM's
CPU platform under Triton's interpreter, the one end-to-end check of the CUDA path short of a GPU.

Three things make vLLM run its Triton backend on CPU tensors, none of them in product code:
- ``enable()`` (before vLLM is imported): vLLM's CPU build disables Triton unless a Triton backend named
  "cpu" is registered; the interpreter (``TRITON_INTERPRET=1``, set before Python starts) runs any backend's
  kernels on CPU tensors, so the NVIDIA backend is registered under that name;
- ``register()`` (after the plugin registered its own CPU backend): ``CPU_ATTN`` is pointed at
  ``TritonOnCPUBackend`` below;
- vLLM's Triton cache-write op asks ``torch.cuda.get_device_capability()`` for a tile size: the impls run
  with that function answering (9, 0).
"""

from __future__ import annotations

import contextlib

import torch


def enable() -> None:
    import triton.backends

    triton.backends.backends.setdefault("cpu", triton.backends.backends["nvidia"])


@contextlib.contextmanager
def _fake_capability():
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


def _on_cpu(impl_cls):
    class OnCPU(impl_cls):
        def do_kv_cache_update(self, *a, **kw):
            with _fake_capability():
                return super().do_kv_cache_update(*a, **kw)

        def forward(self, *a, **kw):
            with _fake_capability():
                return super().forward(*a, **kw)

    OnCPU.__name__ = f"{impl_cls.__name__}OnCPU"
    return OnCPU


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    import vllm_contour

    vllm_contour.register()  # the plugin's own registration first (idempotent), then the override
    register_backend(AttentionBackendEnum.CPU_ATTN, "tests.integration.triton_on_cpu.TritonOnCPUBackend")


def _backend():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_contour.integration import triton_backend as tb

    stock_impl, contour_impl = _on_cpu(TritonAttentionImpl), _on_cpu(tb.ContourTritonAttentionImpl)

    class TritonOnCPUBackend(tb.ContourTritonAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return contour_impl if tb.eviction_enabled() else stock_impl

    return TritonOnCPUBackend


def __getattr__(name):  # vLLM imports the class by path after the plugin loaded: build it lazily
    if name == "TritonOnCPUBackend":
        cls = _backend()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
