"""How the bytes of an fp8 KV cache read as numbers: one 256-entry fp32 table per side of a layer.

vLLM 0.32's CPU backend keeps an fp8 cache (``--kv-cache-dtype fp8``/``fp8_e4m3``: e4m3 bytes; ``fp8_e5m2``:
e5m2) as uint8 pages in the element layout it uses for the model's dtype (``cpu_layout``), each element
written as ``x / scale`` with the layer's ``k_scale`` / ``v_scale``. Its kernels read a byte back as
``table[byte] * scale``, where the table is what its kernel makes of each byte. That table is measured,
not assumed (``probe_table``: vLLM's own attention over one-token pages holding every byte): the AMX path
flushes subnormal bytes to zero and reads NaN / inf patterns as finite numbers, the vec path reads e4m3's
``0x7f`` as 480. ``KVDequant`` is one layer's two scaled tables; every op that reads numbers from fp8 pages
(gather_pages for scoring, accumulate_moments, ragged_decode_attention) takes them, the reference indexing
them with the bytes and the C++ kernels looking each byte up, so both read the same fp32 values. Ops that
only move bytes (compaction, block copies, moment and query pages) treat the pages as raw bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# vLLM's --kv-cache-dtype names the CPU backend stores as fp8 bytes -> the byte encoding it writes
FP8_ENCODINGS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(kv_cache_dtype) -> bool:
    return str(kv_cache_dtype) in FP8_ENCODINGS


@dataclass(frozen=True)
class KVDequant:
    """One layer's reading of its fp8 bytes: ``k[byte]`` and ``v[byte]`` are the key / value numbers
    (``[256]`` fp32, the layer's scale included)."""

    k: torch.Tensor
    v: torch.Tensor

    @staticmethod
    def of(table: torch.Tensor, k_scale: float, v_scale: float) -> "KVDequant":
        t = table.to(torch.float32)
        return KVDequant((t * float(k_scale)).contiguous(), (t * float(v_scale)).contiguous())

    def to(self, device) -> "KVDequant":
        return KVDequant(self.k.to(device), self.v.to(device))


def dequantise(raw: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """fp8 bytes (uint8, any shape) -> their fp32 numbers through ``lut [256]``."""
    return lut.to(raw.device)[raw.to(torch.int64)]


def encoding_table(kv_cache_dtype: str) -> torch.Tensor:
    """The textbook reading of every byte of the encoding (torch's float8 types; NaN where it has NaN)."""
    return torch.arange(256, dtype=torch.int64).to(torch.uint8).view(FP8_ENCODINGS[kv_cache_dtype]).to(torch.float32)


@functools.lru_cache(maxsize=None)
def probe_table(isa: str, model_dtype: torch.dtype, kv_cache_dtype: str, block_size: int,
                head_dim: int) -> torch.Tensor:
    """What vLLM's CPU attention kernel reads each of the 256 bytes as (scale 1), measured: one-token
    pages whose value rows hold every byte, a zero query (so each output row is its token's values)."""
    from .cpu_layout import cpu_kv_views, probe_layout
    from .paged import set_rows
    from .vllm_cpu import vllm_op

    if isa == "amx":
        torch.cpu._init_amx()  # the tile data must be granted before vLLM's AMX kernel runs (its worker does it)
    bs, d = block_size, head_dim
    layout = probe_layout(isa, model_dtype, bs, d, kv_cache_dtype)
    n = -(-256 // d)
    kv = torch.zeros((n, 1, bs, 2 * d), dtype=torch.uint8)
    _, vc = cpu_kv_views(kv, layout)
    allb = torch.arange(n * d, dtype=torch.int64) % 256
    set_rows(vc, torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
             allb.to(torch.uint8).view(n, d))
    view = kv.view(n, 1, 2 * bs, d)
    q = torch.zeros((n, 1, d), dtype=model_dtype)
    out = torch.empty_like(q)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    sl = torch.ones(n, dtype=torch.int32)
    md = vllm_op("cpu_attn_get_scheduler_metadata")(
        num_reqs=n, num_heads=1, num_kv_heads=1, head_dim=d, seq_lens=sl, dtype=model_dtype, query_start_loc=qsl,
        causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False, kv_cache_dtype=kv_cache_dtype)
    vllm_op("cpu_attention_with_kv_cache")(
        query=q, key_cache=view[:, :, :bs], value_cache=view[:, :, bs:], output=out, query_start_loc=qsl,
        seq_lens=sl, scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.arange(n, dtype=torch.int32).view(n, 1), softcap=0.0, scheduler_metadata=md, s_aux=None,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    return out.reshape(-1)[:256].to(torch.float32).contiguous()


class KVViews(list):
    """Every layer's ``(key, value)`` views of one cache (a list, as the evictor and the ops take them), with
    how an fp8 cache's bytes read: ``dequant``, one ``KVDequant`` per layer (None: the elements are numbers)."""

    def __init__(self, views, dequant: list[KVDequant] | None = None):
        super().__init__(views)
        self.dequant = dequant
        # every layer's key and value table stacked, ``[L, 256]`` each: what ``gather_pages`` takes, made once
        self.luts = None if dequant is None else tuple(torch.stack([getattr(d, s) for d in dequant]) for s in "kv")


def dequant_of(views, layer: int) -> KVDequant | None:
    """Layer ``layer``'s tables of ``views`` (a ``KVViews``; None for plain lists and unquantised caches)."""
    deq = getattr(views, "dequant", None)
    return None if deq is None else deq[layer]


def luts_of(views, side: int) -> torch.Tensor | None:
    """Every layer's key (``side`` 0) or value (1) table, ``[L, 256]`` (``ops.gather_pages``'s ``luts``)."""
    luts = getattr(views, "luts", None)
    return None if luts is None else luts[side]
