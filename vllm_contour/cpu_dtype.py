"""Which dtype to serve in on this CPU, by measurement: ``python -m vllm_contour.cpu_dtype [--json]``.

vLLM's CPU backend runs its linear layers through oneDNN, whose bf16 path is fast only where the CPU has
bf16 instructions (AMX tiles, AVX-512-bf16); on AVX2 bf16 is emulated and several times slower than fp32.
The choice is bf16 when the CPU has such instructions *and* a prefill-shaped bf16 matmul (the default
model's MLP over a 512-token chunk) is measured clearly faster than fp32 here, else fp32. The set-up
script stores the answer next to the virtual environment, the quickstart reads it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# bf16 must beat fp32 by this much: a tie is not worth bf16's rounding (fp32 is exact w.r.t. the model).
MARGIN = 0.8


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _time_matmul(dtype: torch.dtype, tokens: int = 512, hidden: int = 576, inner: int = 1536,
                 repeats: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = torch.randn(hidden, inner, generator=g).to(dtype)
    w2 = torch.randn(inner, hidden, generator=g).to(dtype)
    for _ in range(2):
        (x @ w1) @ w2
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(4):
            (x @ w1) @ w2
        best = min(best, time.perf_counter() - t0)
    return best


def choose(flags: set[str] | None = None, measure=_time_matmul) -> dict:
    """``{"dtype": "bfloat16" | "float32", "why": ..., "flags": [...], "fp32_s", "bf16_s"}``."""
    flags = cpu_flags() if flags is None else flags
    have = [f for f in BF16_FLAGS if f in flags]
    out: dict = {"flags": have or [f for f in ("avx512f", "avx2") if f in flags]}
    if not have:
        out.update(dtype="float32", why="no bf16 instructions (AMX / AVX-512-bf16): bf16 would be emulated")
        return out
    fp32, bf16 = measure(torch.float32), measure(torch.bfloat16)
    out.update(fp32_s=round(fp32, 5), bf16_s=round(bf16, 5), bf16_over_fp32=round(bf16 / fp32, 3))
    if bf16 <= MARGIN * fp32:
        out.update(dtype="bfloat16", why=f"{'/'.join(have)}: a prefill-shaped bf16 matmul takes "
                                         f"{bf16 / fp32:.2f}x the fp32 time here")
    else:
        out.update(dtype="float32", why=f"{'/'.join(have)} present, but bf16 took {bf16 / fp32:.2f}x the fp32 "
                                        f"time here (more than {MARGIN})")
    return out


def cached_choice(path: str | Path | None) -> dict:
    """``choose()``, measured once: read from ``path`` when it holds an earlier answer, else written there."""
    if path is not None and Path(path).exists():
        try:
            res = json.loads(Path(path).read_text())
            if res.get("dtype") in ("float32", "bfloat16"):
                return res
        except (OSError, ValueError):
            pass
    res = choose()
    if path is not None:
        Path(path).write_text(json.dumps(res) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_contour.cpu_dtype", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the measurement as JSON, not just the dtype")
    p.add_argument("--cache", default=None, help="JSON file keeping the answer (measured only when missing)")
    a = p.parse_args(argv)
    res = cached_choice(a.cache)
    print(json.dumps(res) if a.json else res["dtype"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
