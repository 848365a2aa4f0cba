"""Probe every CPU cache layout vLLM can write and check the views against vLLM's own write of random data.

Run as ``python -m tests.unit.layout_probe ISA`` (one process per ISA: a kernel the CPU cannot run kills
only its own probe). Prints one JSON line per (dtype, block size, head dim): the fitted description, and
whether the logical views of a cache written by ``cpu_attn_reshape_and_cache`` equal the keys and values
that were written (every block, lane and token)."""

from __future__ import annotations

import json
import sys

import torch

CASES = {  # what vLLM's _get_attn_isa picks each ISA for (vec: bs % 32 == 0; vec16: otherwise or D % 32)
    "vec": [(dt, bs, d) for dt in ("float32", "bfloat16", "float16") for bs in (32, 128) for d in (64, 128)],
    "vec16": [(dt, bs, d) for dt in ("float32", "bfloat16", "float16") for bs, d in ((16, 64), (32, 80))],
    "amx": [("bfloat16", bs, d) for bs in (32, 128) for d in (64, 128)],
}


def check(isa: str, dtype: torch.dtype, bs: int, d: int) -> dict:
    from vllm import _custom_ops as vops

    from vllm_contour.ops.cpu_layout import PageLayout, cpu_kv_views, probe_layout
    from vllm_contour.ops.paged import pages

    out = {"isa": isa, "dtype": str(dtype).replace("torch.", ""), "bs": bs, "d": d}
    try:
        lay = probe_layout(isa, dtype, bs, d)
    except Exception as e:
        out["error"] = str(e)[:300]
        return out
    out.update(key=repr(lay.key), value=repr(lay.value), flat=lay.flat, source=lay.source)
    if isa == "amx":
        out["equals_formula"] = (lay.key, lay.value) == (PageLayout.amx_bf16(bs, d).key,
                                                        PageLayout.amx_bf16(bs, d).value)
    nb, h, n = 3, 2, 2 * bs + 5
    g = torch.Generator().manual_seed(bs + d)
    key = torch.randn(n, h, d, generator=g).to(dtype)
    val = torch.randn(n, h, d, generator=g).to(dtype)
    kv = torch.zeros(nb, h, bs, 2 * d, dtype=dtype)
    view = kv.view(nb, h, 2 * bs, d)
    slots = torch.tensor([bs * 1 + i for i in range(bs)] + [bs * 2 + i for i in range(bs)] + list(range(5)))
    vops.cpu_attn_reshape_and_cache(key, val, view[:, :, :bs], view[:, :, bs:], slots, isa)
    kc, vc = cpu_kv_views(kv, lay)
    order = torch.tensor([1, 2, 0])
    got_k = pages(kc, order).permute(0, 2, 1, 3).reshape(nb * bs, h, d)[:n]
    got_v = pages(vc, order).permute(0, 2, 1, 3).reshape(nb * bs, h, d)[:n]
    out["views_match"] = bool(torch.equal(got_k, key) and torch.equal(got_v, val))
    out["dims"] = kc.dim()
    return out


def main(isa: str) -> None:
    for dt, bs, d in CASES[isa]:
        print(json.dumps(check(isa, getattr(torch, dt), bs, d)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
