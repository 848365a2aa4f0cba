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
Model Runner V2 samples with a Triton kernel (Gumbel-max over the vocabulary, one program per token and
1,024-word block): interpreted it costs ~0.1 s per request per step, most of an MRv2 step here.
``fast_greedy_sampler()`` routes its greedy launches (temperature 0, nothing cached for drafting: the
kernel's plain block argmax) to torch through vLLM's own kernel-override registry; any other launch runs
the kernel.
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


def fast_greedy_sampler() -> None:
    import torch.nn.functional as F
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.worker.gpu.sample import gumbel

    kernel = gumbel._gumbel_sample_kernel

    def _gumbel_sample_kernel(local_argmax_ptr, local_argmax_stride, local_max_ptr, local_max_stride,
                              logits_cache_ptr, logits_cache_stride_0, logits_cache_stride_1, logits_cache_col_ptr,
                              logits_cache_source_ptr, logits_cache_source_stride, logits_ptr, logits_stride,
                              expanded_idx_mapping_ptr, seeds_ptr, pos_ptr, temp_ptr, vocab_size, BLOCK_SIZE,
                              IS_DRAFTING, APPLY_TEMPERATURE, USE_FP64, PER_TOKEN_COL):
        n, nb = local_argmax_ptr.shape
        req = expanded_idx_mapping_ptr[:n].to(torch.int64)
        temp = torch.where(req >= 0, temp_ptr[req.clamp_min(0)].float(), torch.zeros(n))
        if logits_cache_ptr is not None or bool((temp != 0).any()):
            args = dict(locals())
            return kernel[(n, nb)](**{k: args[k] for k in kernel.arg_names})
        x = F.pad(logits_ptr[:n, :vocab_size].float(), (0, nb * BLOCK_SIZE - vocab_size), value=float("-inf"))
        value, idx = x.view(n, nb, BLOCK_SIZE).max(dim=-1)
        local_max_ptr[:n].copy_(value.to(local_max_ptr.dtype))
        local_argmax_ptr[:n].copy_(idx + torch.arange(nb).view(1, -1) * BLOCK_SIZE)

    register_kernels({"vllm.v1.worker.gpu.sample.gumbel._gumbel_sample_kernel": _gumbel_sample_kernel})


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    import vllm_contour

    vllm_contour.register()  # the plugin's own registration first (idempotent), then the override
    register_backend(AttentionBackendEnum.CPU_ATTN, "tests.integration.triton_on_cpu.TritonOnCPUBackend")


def _backend():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_contour.integration.backends import triton as tb

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
