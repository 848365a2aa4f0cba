"""Ahead-of-time compilation of every kernel for a GPU target, without a GPU (ptxas ships with Triton).

    python -m triton_ops.aot [--arch 90] [--dtypes bf16,fp16,fp32]

The interpreter accepts programs the GPU compiler rejects (e.g. ``tl.dot`` with K < 16, layouts too large
for registers), so the test suite compiles each kernel for sm_90 as well. Must run WITHOUT
``TRITON_INTERPRET`` (under the interpreter ``@triton.jit`` yields interpreted functions).
"""

from __future__ import annotations

import argparse
import time

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from . import kernels

_INT_OF = {"bf16": "i16", "fp16": "i16", "fp32": "i32"}


def _sig(fn, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name.endswith("_ptr"):
            raise KeyError(f"{fn.__name__}: no pointer type for {name}")
        else:
            sig[name] = "i32"  # sizes and strides (what the launcher passes for small values)
    return sig


def kernel_specs(dtype: str = "bf16", head_dim: int = 64, group: int = 3):
    """(name, jit function, signature, constexprs) of every kernel for one cache dtype."""
    it = "*" + _INT_OF[dtype]
    cache = "*" + dtype
    bd = max(16, 1 << (head_dim - 1).bit_length())
    bg = 1 << max(0, (group - 1).bit_length())
    specs = []
    for kern in (kernels.compact_gather_kernel, kernels.compact_scatter_kernel):
        ce = {"BLOCK_M": max(1, min(64, 4096 // bd)), "BLOCK_D": bd}
        specs.append((kern.__name__, kern, _sig(kern, {"k_ptr": it, "v_ptr": it, "tmp_ptr": it,
                                                        "page_ptr": "*i64", "off_ptr": "*i64"}, ce), ce))
    kern = kernels.accumulate_moments_kernel
    ce = {"BLOCK_N": 32, "BLOCK_D": bd, "BLOCK_R": min(bd, 64)}
    specs.append((kern.__name__, kern, _sig(kern, {"k_ptr": cache, "v_ptr": cache, "page_ptr": "*i64",
                                                    "off_ptr": "*i64", "order_ptr": "*i64", "seg_ptr": "*i64",
                                                    "n_ptr": "*fp32", "sk_ptr": "*fp32", "sv_ptr": "*fp32",
                                                    "svk_ptr": "*fp32"}, ce), ce))
    bg = max(16, bg)  # the query group is padded to 16 rows for tl.dot
    block_n = 32
    block_e = max(1, min(bd, 4096 // (bg * bd)))
    f32 = {k: "*fp32" for k in ("lse_ptr", "n_ptr", "sk_ptr", "sv_ptr", "svk_ptr", "seg_acc_ptr", "seg_ml_ptr")}
    kern = kernels.ragged_decode_kernel
    lists = {"tslot_ptr": "*i32", "trow_ptr": "*i64", "tpos_ptr": "*i32", "rc_ptr": "*i32", "reg_ptr": "*i32",
             "bt_ptr": "*i32"}
    for two_part in (False, True):
        for has in (False, True):
            for split in (False, True):
                ce = {"HAS_MOMENTS": has, "SPLIT": split, "BLOCK_G": bg, "BLOCK_N": block_n, "BLOCK_D": bd,
                      "BLOCK_E": block_e, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
                      "NATIVE_DOT": dtype != "fp32", "ONE_PAGE": True, "TWO_PART": two_part}
                types = {"q_ptr": cache, "k_ptr": cache, "v_ptr": cache, "pt_ptr": "*i32", "sl_ptr": "*i32",
                         "out_ptr": cache, "scale": "fp32", **f32, **lists}
                specs.append((f"{kern.__name__}[two_part={two_part},moments={has},split={split}]", kern,
                              _sig(kern, types, ce), ce))
    kern = kernels.ragged_reduce_kernel
    for two_part in (False, True):
        for has in (False, True):
            ce = {"HAS_MOMENTS": has, "BLOCK_G": bg, "BLOCK_D": bd, "BLOCK_E": block_e, "TWO_PART": two_part}
            types = {"q_ptr": cache, "out_ptr": cache, "scale": "fp32", "tslot_ptr": "*i32", **f32}
            specs.append((f"{kern.__name__}[two_part={two_part},moments={has}]", kern, _sig(kern, types, ce), ce))
    return specs


def compile_all(arch: int = 90, dtypes=("bf16",), head_dim: int = 64, group: int = 3, verbose: bool = False):
    """Compile every kernel for ``GPUTarget("cuda", arch, 32)``; returns {name: (seconds, ptx chars)}."""
    target = GPUTarget("cuda", arch, 32)
    done = {}
    for dt in dtypes:
        for name, fn, sig, ce in kernel_specs(dt, head_dim, group):
            t0 = time.perf_counter()
            ck = triton_compile(ASTSource(fn, sig, constexprs=ce), target=target)
            key = f"{name}:{dt}"
            done[key] = (time.perf_counter() - t0, len(ck.asm.get("ptx", "")))
            if verbose:
                print(f"{key:50s} {done[key][0]:6.2f} s  ptx {done[key][1]} chars  cubin "
                      f"{len(ck.asm.get('cubin', b''))} B")
    return done


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group", type=int, default=3)
    a = ap.parse_args(argv)
    compile_all(a.arch, a.dtypes.split(","), a.head_dim, a.group, verbose=True)


if __name__ == "__main__":
    main()
