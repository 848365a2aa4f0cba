"""Registers the Triton kernels of the top-level ``triton_ops`` package for CUDA tensors (imported lazily
by the dispatch the first time a CUDA tensor reaches an op; ImportError when Triton is missing)."""

from __future__ import annotations

import triton_ops

from . import register_impl


def _cuda(dev: str, **kw) -> bool:
    return dev == "cuda"


register_impl("compact", "triton", triton_ops.compact, _cuda)
register_impl("accumulate_moments", "triton", triton_ops.accumulate_moments, _cuda)
register_impl("ragged_decode_attention", "triton", triton_ops.ragged_decode_attention, _cuda)
