"""The Triton kernels on a GPU: checked against the CPU references, one eviction round against the same round
on CPU, and timed against vLLM's own Triton attention kernel. Needs torch + Triton only (no vLLM).

    python -m benchmarks.gpu_kernels --vendor .cache/vllm_kernels        # once, where vLLM is installed
    python -m benchmarks.gpu_kernels --vllm-kernel .cache/vllm_kernels --out DIR      # on the GPU machine
    TRITON_INTERPRET=1 python -m benchmarks.gpu_kernels --dry-run --vllm-kernel .cache/vllm_kernels --out DIR
    python -m benchmarks.gpu_kernels --plot DIR/gpu_kernels.json                     # the PNG, anywhere

``--vendor`` copies vLLM's ``triton_unified_attention.py`` and its helpers into a folder with their vLLM
imports rewritten to a small shim, so the baseline runs where vLLM cannot be installed; the folder is a
build product (``.cache/`` is ignored), never committed. ``--dry-run`` runs every section at toy sizes on
CPU tensors under Triton's interpreter (the test suite does, so the script cannot rot between GPU loans).

Sections (each records its error instead of stopping the run):
* ``env``: torch / Triton / device, first-call (compile) seconds of each kernel variant.
* ``checks``: compaction, head-page moves (moment storage, block copies), moment accumulation and ragged
  attention (decode and multi-token rows, moments, split lists) on the device against the torch
  reference on CPU copies, in vLLM's Triton cache layout (``[blocks, bs, H, 2D]`` physical, the logical
  ``[blocks, H, bs, 2D]`` view); vLLM's kernel against a dense reference (the baseline is called right).
* ``rounds``: two rounds of one request (snapkv with window queries; moment with correction) on the
  device with the Triton ops and on CPU: kept positions, kept token bytes and moments compared.
* ``decode``: one layer's decode step (Hq 32, H 8, D 128, block 32, bf16) over contexts x batches x kept
  tokens per head: our ragged kernel over each head's kept pages, vLLM's kernel over the full context and
  over the same number of tokens (the same bytes), GB/s of K+V read. L2 flushed before every repetition.
* ``compaction``: one layer's compaction vs ``copy_`` of the same bytes; moment accumulation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks import stamp

HQ, H, D, BS = 32, 8, 128, 32
CONTEXTS, BATCHES, KEPT = (4096, 16384, 32768), (1, 8, 64), (128, 512, 1024)
DRY = dict(hq=4, h=2, d=32, bs=16, contexts=(128,), batches=(1, 3), kept=(32,), reps=1)

# ----------------------------------------------------------------------------------------------- vLLM kernel
_SHIM = '''"""Stand-ins for the few vLLM symbols vLLM's Triton attention kernel imports (generated, not committed)."""
import enum
import logging

import torch


class _Envs:
    VLLM_BATCH_INVARIANT = False


envs = _Envs()


def init_logger(name):
    return logging.getLogger(name)


class _Platform:
    def fp8_dtype(self):
        return torch.float8_e4m3fn

    def is_device_capability_family(self, family):
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability()[0] * 10 == family


current_platform = _Platform()


class KVQuantMode(enum.IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
'''
_REWRITES = [
    (r"^import vllm\.envs as envs$", "from _vllm_shim import envs"),
    (r"^from vllm\.logger import init_logger$", "from _vllm_shim import init_logger"),
    (r"^from vllm\.platforms import current_platform$", "from _vllm_shim import current_platform"),
    (r"^from vllm\.triton_utils import tl, triton$", "import triton\nimport triton.language as tl"),
    (r"^from vllm\.v1\.attention\.ops\.triton_attention_helpers import", "from vllm_attention_helpers import"),
    (r"^from vllm\.v1\.kv_cache_interface import KVQuantMode$", "from _vllm_shim import KVQuantMode"),
]


def vendor(dst: Path) -> dict:
    """Copy vLLM's unified attention kernel and helpers into ``dst`` with their imports shimmed."""
    import vllm
    from vllm.v1.attention.ops import triton_attention_helpers, triton_unified_attention

    dst.mkdir(parents=True, exist_ok=True)
    (dst / "_vllm_shim.py").write_text(_SHIM)
    for mod, name in ((triton_unified_attention, "vllm_unified_attention.py"),
                      (triton_attention_helpers, "vllm_attention_helpers.py")):
        text = Path(mod.__file__).read_text()
        for pat, rep in _REWRITES:
            text = re.sub(pat, rep, text, flags=re.M)
        left = [ln for ln in text.splitlines() if re.match(r"^(from|import) vllm[. ]", ln)]
        if left:
            raise RuntimeError(f"{mod.__name__}: vLLM imports the shim does not cover: {left}")
        (dst / name).write_text(f"# copied from vLLM {vllm.__version__} ({mod.__name__}), imports shimmed\n" + text)
    info = {"vllm": vllm.__version__}
    (dst / "VERSION.json").write_text(json.dumps(info))
    return info


def load_vllm_kernel(folder: str | None):
    if not folder:
        return None, "no --vllm-kernel folder"
    sys.path.insert(0, str(Path(folder).resolve()))
    import vllm_unified_attention as vua

    return vua.unified_attention, json.loads((Path(folder) / "VERSION.json").read_text())["vllm"]


def vllm_decode(unified_attention, q, kv_logical, block_table, seq_lens, scale, max_seq):
    """One decode token per row with vLLM's kernel, called as ``TritonAttentionImpl.forward`` does."""
    t, hq, d = q.shape
    h = kv_logical.shape[1]
    kv = kv_logical.transpose(1, 2)
    k, v = kv.split(d, dim=-1)
    dev = q.device
    out = torch.empty_like(q)
    seg = 16
    ones = torch.ones((t, h), dtype=torch.float32, device=dev)
    unified_attention(
        q=q, k=k, v=v, out=out, cu_seqlens_q=torch.arange(t + 1, dtype=torch.int32, device=dev), max_seqlen_q=1,
        seqused_k=seq_lens, max_seqlen_k=max_seq, softmax_scale=scale, causal=True, window_size=(-1, -1),
        block_table=block_table, softcap=0, q_descale=None, k_descale=ones, v_descale=ones,
        seq_threshold_3D=128 // h, num_par_softmax_segments=seg,
        softmax_segm_output=torch.empty((t, hq, seg, d), dtype=torch.float32, device=dev),
        softmax_segm_max=torch.empty((t, hq, seg), dtype=torch.float32, device=dev),
        softmax_segm_expsum=torch.empty((t, hq, seg), dtype=torch.float32, device=dev))
    return out


# ----------------------------------------------------------------------------------------------- helpers
def vllm_cache(nb: int, h: int, bs: int, d: int, dtype, dev, seed: int = 0):
    """vLLM's Triton cache for one layer: physical ``[blocks, bs, H, 2D]``, returned as the logical
    ``[blocks, H, bs, 2D]`` view and its ``[B, H, bs, D]`` key / value views."""
    g = torch.Generator(device=dev).manual_seed(seed)
    store = torch.randn(nb, bs, h, 2 * d, generator=g, device=dev).to(dtype)
    logical = store.permute(0, 2, 1, 3)
    return logical, logical[..., :d], logical[..., d:]


def timer(dev):
    """``run(fn, reps)`` -> median milliseconds. On CUDA the call is captured in a CUDA graph (so the time
    is the kernels', not Python's launch overhead; eager when a call cannot be captured, e.g. it waits
    for the device) and replayed between events, the L2 flushed before each replay. ``run.modes`` records
    which way each call was timed."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None

    def run(fn, reps: int = 20, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        call, mode = fn, "wall"
        if flush is not None:
            mode = "graph"
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                call = graph.replay
            except Exception:
                torch.cuda.synchronize()
                call, mode = fn, "eager"
        run.modes.append(mode)
        times = []
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    run.modes = []
    return run


def _section(res: dict, name: str, fn, *a, **kw):
    t0 = time.perf_counter()
    try:
        res[name] = fn(*a, **kw)
    except Exception as e:  # one failing section must not lose the others' figures
        res[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(f"[gpu_kernels] {name}: {time.perf_counter() - t0:.1f} s"
          + (f"  ERROR {res[name]['error']}" if isinstance(res[name], dict) and "error" in res[name] else ""),
          flush=True)


def _ragged_rows(nb_req: int, rows: int, h: int, bs: int, kept: int, tail: int, seed: int = 0):
    """Page tables of ``rows`` compacted requests, each owning ``nb_req`` consecutive blocks: every head
    keeps ``kept`` tokens packed with lane borrowing (``plan_layout``) in the request's first blocks, then
    a dense tail of ``tail`` tokens."""
    from vllm_contour.layout import decode_page_table, plan_layout

    tables, lens = [], []
    for r in range(rows):
        base = r * nb_req
        kp = kept // bs
        lay = plan_layout(torch.full((1, h), kp), list(range(base, base + max(1, kp))), bs, h, max(1, kp))
        n_tail = -(-tail // bs)
        t, s = decode_page_table(lay, list(range(base + kp, base + kp + n_tail)), tail)
        tables.append(t[0])
        lens.append(s[0])
    return torch.stack(tables), torch.stack(lens)


# ----------------------------------------------------------------------------------------------- sections
def env(dev) -> dict:
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "device": str(dev), "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out.update(name=p.name, sms=p.multi_processor_count, capability=list(torch.cuda.get_device_capability(dev)),
                   memory_gib=round(p.total_memory / 2 ** 30, 1))
    return out


def checks(dev, dtype, s: dict, vllm_kernel) -> dict:
    """Every op on the device against the torch reference on CPU copies."""
    import triton_ops
    from vllm_contour import ops
    from vllm_contour.ops.reference import (accumulate_moments_ref, compact_ref, ragged_decode_attention_ref)

    h, d, bs, hq = s["h"], s["d"], s["bs"], s["hq"]
    nb = 24
    out, first = {}, {}
    logical, k, v = vllm_cache(nb, h, bs, d, dtype, dev, seed=1)
    c_logical = logical.cpu()
    ck, cv = c_logical[..., :d], c_logical[..., d:]
    g = torch.Generator().manual_seed(2)
    # compaction: a permutation of token slots (every source clobbered) plus moves to fresh slots
    m = 3 * bs
    slots = torch.randperm(nb * h * bs, generator=g)[: m + m // 4]
    src, dst = torch.cat([slots[:m], slots[: m // 4]]), torch.cat([slots[:m][torch.randperm(m, generator=g)], slots[m:]])
    moves = (src // bs, src % bs, dst // bs, dst % bs)
    t0 = time.perf_counter()
    triton_ops.compact(k, v, *[x.to(dev) for x in moves])
    _sync(dev)
    first["compact"] = time.perf_counter() - t0
    compact_ref(ck, cv, *moves)
    out["compact_bit_exact"] = bool(torch.equal(logical.cpu().view(torch.uint8), c_logical.view(torch.uint8)))
    # head-page moves: moments stored and loaded, pages cleared, blocks copied (bit exact)
    from vllm_contour.moments import Moments, pack

    mom = Moments(torch.rand(h) * 9, torch.randn(h, d, generator=g), torch.randn(h, d, generator=g),
                  torch.randn(h, d, d, generator=g))
    ids = torch.arange(3, 3 + 2 * (1 + (h * (1 + 2 * d + d * d) * 4) // (2 * bs * d * logical.element_size())))
    ids = ids[: max(1, -(-h * (1 + 2 * d + d * d) * 4 // (2 * bs * d * logical.element_size())))]
    ops.store_moments(k, v, ids.to(dev), pack(mom), impl="triton")
    ops.store_moments(ck, cv, ids, pack(mom), impl="torch")
    got = ops.load_moments(k, v, ids.to(dev).view(1, -1), h, d, impl="triton")
    out["moments_store_load_bit_exact"] = bool(
        torch.equal(logical.cpu().view(torch.uint8), c_logical.view(torch.uint8))
        and all(torch.equal(got[key][0].cpu(), getattr(mom, key)) for key in ("n", "sum_k", "sum_v", "sum_vk")))
    ops.clear_pages(k, v, ids[:1].to(dev), impl="triton")
    ops.copy_blocks([(k, v)], [(1, 20), (5, 21)], impl="triton")
    ops.clear_pages(ck, cv, ids[:1], impl="torch")
    ops.copy_blocks([(ck, cv)], [(1, 20), (5, 21)], impl="torch")
    out["clear_and_copy_bit_exact"] = bool(torch.equal(logical.cpu().view(torch.uint8), c_logical.view(torch.uint8)))
    # moment accumulation (fp32 atomics: order differs, so a tolerance)
    pg = torch.randint(0, nb * h, (200,), generator=g)
    of = torch.randint(0, bs, (200,), generator=g)
    hd = torch.randint(0, h, (200,), generator=g)
    z = lambda device: {"n": torch.zeros(h, device=device), "sum_k": torch.zeros(h, d, device=device),  # noqa: E731
                        "sum_v": torch.zeros(h, d, device=device), "sum_vk": torch.zeros(h, d, d, device=device)}
    gm, wm = z(dev), z("cpu")
    t0 = time.perf_counter()
    triton_ops.accumulate_moments(k, v, pg.to(dev), of.to(dev), hd.to(dev), gm)
    _sync(dev)
    first["accumulate_moments"] = time.perf_counter() - t0
    accumulate_moments_ref(ck, cv, pg, of, hd, wm)
    out["accumulate_max_rel_err"] = max(float(((gm[x].cpu() - wm[x]).abs().max() / wm[x].abs().max().clamp_min(1e-6)))
                                        for x in wm)
    # ragged attention (on a fresh cache: moment pages hold raw fp32 bits): decode rows, moments, split lists
    logical, k, v = vllm_cache(nb, h, bs, d, dtype, dev, seed=3)
    c_logical = logical.cpu()
    ck, cv = c_logical[..., :d], c_logical[..., d:]
    pt, sl = _ragged_rows(6, 3, h, bs, 2 * bs, bs + 5)
    sl[1, 0] = 0  # an empty list
    q = torch.randn(pt.shape[0], hq, d, generator=g).to(dtype)
    rmom = {"n": torch.randint(0, 20, (pt.shape[0], h), generator=g).float(), "sum_k": torch.randn(pt.shape[0], h, d, generator=g),
            "sum_v": torch.randn(pt.shape[0], h, d, generator=g),
            "sum_vk": torch.randn(pt.shape[0], h, d, d, generator=g) * 0.1}
    errs = {}
    for with_m in (False, True):
        mm = rmom if with_m else None
        want_o, want_l = ragged_decode_attention_ref(q, ck, cv, pt, sl, d ** -0.5, moments=mm)
        for segs in (1, 4, None):
            t0 = time.perf_counter()
            o, lse = triton_ops.ragged_decode_attention(
                q.to(dev), k, v, pt.to(dev), sl.to(dev), d ** -0.5, segments=segs,
                moments=None if mm is None else {x: y.to(dev) for x, y in mm.items()})
            _sync(dev)
            first.setdefault(f"ragged[moments={with_m},segments={segs}]", time.perf_counter() - t0)
            fin = torch.isfinite(want_l)
            errs[f"moments={with_m},segments={segs}"] = {
                "out_max_abs": float((o.cpu().float() - want_o.float()).abs().max()),
                "lse_max_abs": float((lse.cpu()[fin] - want_l[fin]).abs().max()),
                "lse_inf_match": bool(torch.equal(torch.isinf(lse.cpu()), torch.isinf(want_l)))}
    out["ragged"] = errs
    interp_bf16 = os.environ.get("TRITON_INTERPRET") == "1" and dtype != torch.float32  # no bf16 math there
    if vllm_kernel is not None and not interp_bf16:  # the baseline, called right: vs a dense reference
        from vllm_contour.ops.reference import ragged_decode_attention_ref as ref

        rows = 2
        bt = torch.arange(rows * 4, dtype=torch.int32).view(rows, 4)
        lens = torch.tensor([4 * bs - 3, 2 * bs + 1], dtype=torch.int32)
        qv = torch.randn(rows, hq, d, generator=g).to(dtype)
        o = vllm_decode(vllm_kernel, qv.to(dev), logical, bt.to(dev), lens.to(dev), d ** -0.5, 4 * bs)
        # as ragged lists: head h reads lane h of the row's blocks
        pages = bt.to(torch.int64).unsqueeze(1) * h + torch.arange(h).view(1, -1, 1)
        want, _ = ref(qv, logical.cpu()[..., :d], logical.cpu()[..., d:], pages,
                      lens.view(-1, 1).expand(-1, h), d ** -0.5)
        out["vllm_kernel_max_abs"] = float((o.cpu().float() - want.float()).abs().max())
    out["first_call_seconds"] = first
    # 16-bit caches: the GPU kernel rounds the query to the cache dtype for its dots, as vLLM's does
    tol, tol_lse = (2e-2, 1e-2) if dtype != torch.float32 else (5e-4, 1e-3)
    out["ok"] = bool(out["compact_bit_exact"] and out["moments_store_load_bit_exact"] and out["clear_and_copy_bit_exact"]
                     and out["accumulate_max_rel_err"] < 1e-4
                     and all(e["out_max_abs"] < tol and e["lse_max_abs"] < tol_lse and e["lse_inf_match"]
                             for e in errs.values())
                     and out.get("vllm_kernel_max_abs", 0.0) < max(tol, 5e-3))  # vLLM's own kernel: tf32 dots
    return out


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def one_request_rounds(dev, dtype, s: dict, policy: str, force_triton: bool) -> dict:
    """Two rounds of one request (the context, then a decode tail) on ``dev``; returns the layouts and the
    caches on CPU. ``force_triton`` picks the Triton ops on CPU tensors (interpreter)."""
    from vllm_contour.budget import page_budget
    from vllm_contour.config import EvictionConfig, resolve_request
    from vllm_contour.evictor import apply_round, plan_round

    layers, h, d, bs, hq = s["layers"], s["h"], s["d"], s["bs"], s["hq"]
    n_tok, budget, tail = s["tokens"], s["budget"], s["tail"]
    nb = (n_tok + tail) // bs + 4
    g = torch.Generator().manual_seed(7)
    stores = [torch.randn(nb, bs, h, 2 * d, generator=g).to(dtype) for _ in range(layers)]
    # a few loud keys per head so that the policy's choice is not decided by rounding
    for st in stores:
        st[torch.randint(0, n_tok // bs, (8,), generator=g), :, :, :d] *= 4
    caches = []
    for st in stores:
        lg = st.to(dev).permute(0, 2, 1, 3)
        caches.append((lg[..., :d], lg[..., d:]))
    params = resolve_request(EvictionConfig(policy=policy, budget=budget, recent_window=bs, sink_tokens=4), None)
    pb = page_budget(params.budget, num_kv_heads=h, block_size=bs, head_dim=d, elem_size=stores[0].element_size(),
                     sink_tokens=params.sink_tokens, recent_window=params.recent_window,
                     moments=params.moment_correction)
    w = params.window
    queries = {layer: torch.randn(hq, w, d, generator=g).to(dev) for layer in range(layers)}
    block_ids = list(range(nb))
    saved = os.environ.get("VLLM_CONTOUR_OPS_IMPL")
    if force_triton:
        os.environ["VLLM_CONTOUR_OPS_IMPL"] = "triton"
    try:
        lays = []
        prev = None
        for n in (n_tok, n_tok + tail):
            qpos = torch.arange(n - w, n).to(dev)
            plan = plan_round(caches, block_ids, n, params, pb, d ** -0.5, prev=prev, queries=queries,
                              query_positions=qpos)
            prev = apply_round(caches, plan)
            lays.append(prev)
        _sync(dev)
    finally:
        if force_triton:
            if saved is None:
                os.environ.pop("VLLM_CONTOUR_OPS_IMPL", None)
            else:
                os.environ["VLLM_CONTOUR_OPS_IMPL"] = saved
    return {"layouts": lays, "caches": [(kc.cpu(), vc.cpu()) for kc, vc in caches], "moments": params.moment_correction,
            "d": d, "h": h}


def rounds(dev, dtype, s: dict) -> dict:
    """The same two rounds on the device (Triton ops) and on CPU (C++ or torch ops): kept positions equal,
    kept tokens bit-equal, moments close."""
    from vllm_contour import ops
    from vllm_contour.ops.paged import pages as page_rows

    res = {}
    for policy in ("snapkv", "moment"):
        a = one_request_rounds(dev, dtype, s, policy, force_triton=dev.type == "cpu")
        b = one_request_rounds(torch.device("cpu"), dtype, s, policy, force_triton=False)
        la, lb = a["layouts"][-1], b["layouts"][-1]
        same_pos = bool(torch.equal(la.positions.cpu(), lb.positions.cpu()) and torch.equal(la.pages.cpu(), lb.pages.cpu()))
        diff_pos = int((la.positions.cpu() != lb.positions.cpu()).sum()) if la.positions.shape == lb.positions.shape else -1
        kept_equal = True
        mom_err = 0.0
        for layer, ((ka, va), (kb, vb)) in enumerate(zip(a["caches"], b["caches"])):
            for hh in range(a["h"]):
                npg = int(la.pages[layer, hh])
                ida, idb = la.page_ids[layer, hh, :npg].cpu().long(), lb.page_ids[layer, hh, :npg].cpu().long()
                for c1, c2 in ((ka, kb), (va, vb)):
                    x = page_rows(c1, ida // a["h"], ida % a["h"])
                    y = page_rows(c2, idb // a["h"], idb % a["h"])
                    kept_equal &= bool(torch.equal(x.view(torch.uint8) if x.dtype != torch.uint8 else x,
                                                   y.view(torch.uint8) if y.dtype != torch.uint8 else y))
            if la.moment_page_ids is not None:
                ma = ops.load_moments(ka, va, la.moment_page_ids[layer].cpu().long(), a["h"], a["d"], impl="torch")
                mb = ops.load_moments(kb, vb, lb.moment_page_ids[layer].cpu().long(), a["h"], a["d"], impl="torch")
                mom_err = max(mom_err, max(float((ma[x] - mb[x]).abs().max() / mb[x].abs().max().clamp_min(1e-6))
                                           for x in mb))
        res[policy] = {"same_kept_positions": same_pos, "positions_differing": diff_pos,
                       "kept_tokens_bit_equal": kept_equal, "moments_max_rel_err": mom_err,
                       "kept_blocks": la.kept_blocks, "rounds": la.rounds}
    res["ok"] = all(r["same_kept_positions"] and r["kept_tokens_bit_equal"] and r["moments_max_rel_err"] < 1e-3
                    for r in res.values() if isinstance(r, dict))
    return res


def decode(dev, dtype, s: dict, vllm_kernel, reps: int) -> dict:
    """Per-layer decode time: ours over kept pages vs vLLM over the full context / the same tokens."""
    import triton_ops

    h, d, bs, hq = s["h"], s["d"], s["bs"], s["hq"]
    run = timer(dev)
    rows = []
    el = torch.empty((), dtype=dtype).element_size()
    for ctx in s["contexts"]:
        for batch in s["batches"]:
            nb_req = ctx // bs
            logical, k, v = vllm_cache(batch * nb_req, h, bs, d, dtype, dev, seed=ctx + batch)
            q = torch.randn(batch, hq, d, device=dev).to(dtype)
            bt = torch.arange(batch * nb_req, dtype=torch.int32, device=dev).view(batch, nb_req)
            full_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            t_full = (run(lambda: vllm_decode(vllm_kernel, q, logical, bt, full_lens, d ** -0.5, ctx), reps)
                      if vllm_kernel else None)
            for kept in s["kept"]:
                pt, sl = _ragged_rows(nb_req, batch, h, bs, kept, 0)
                pt, sl = pt.to(dev), sl.to(dev)
                lens = torch.full((batch,), kept, dtype=torch.int32, device=dev)
                mom = {"n": torch.full((batch, h), float(ctx - kept), device=dev),
                       "sum_k": torch.randn(batch, h, d, device=dev), "sum_v": torch.randn(batch, h, d, device=dev),
                       "sum_vk": torch.randn(batch, h, d, d, device=dev)}
                t_ours = run(lambda: triton_ops.ragged_decode_attention(q, k, v, pt, sl, d ** -0.5), reps)
                t_bn32 = run(lambda: triton_ops.ragged_decode_attention(q, k, v, pt, sl, d ** -0.5, block_n=64,
                                                                        native_dot=False), reps)
                t_one = run(lambda: triton_ops.ragged_decode_attention(q, k, v, pt, sl, d ** -0.5, segments=1), reps)
                t_same = (run(lambda: vllm_decode(vllm_kernel, q, logical, bt, lens, d ** -0.5, kept), reps)
                          if vllm_kernel else None)
                read_kept = batch * h * kept * d * 2 * el
                read_full = batch * h * ctx * d * 2 * el
                row = {"context": ctx, "batch": batch, "kept": kept, "ours_ms": t_ours, "vllm_same_ms": t_same,
                       "ours_block_n64_fp32_dots_ms": t_bn32, "ours_unsplit_ms": t_one,
                       "ours_two_segments_ms": run(lambda: triton_ops.ragged_decode_attention(
                           q, k, v, pt, sl, d ** -0.5, segments=2), reps),
                       "ours_with_moments_ms": run(lambda: triton_ops.ragged_decode_attention(
                           q, k, v, pt, sl, d ** -0.5, moments=mom), reps),
                       "vllm_full_ms": t_full, "segments": triton_ops.num_segments(batch, h, pt.shape[2] * bs, 64, dev),
                       "ours_gbps": read_kept / t_ours / 1e6,
                       "vllm_same_gbps": read_kept / t_same / 1e6 if t_same else None,
                       "vllm_full_gbps": read_full / t_full / 1e6 if t_full else None,
                       "ours_over_vllm_same": t_ours / t_same if t_same else None,
                       "full_over_ours": t_full / t_ours if t_full else None}
                rows.append(row)
                print(f"[decode] ctx {ctx:6d} batch {batch:3d} kept {kept:5d}: ours {t_ours:.4f} ms, vLLM same "
                      f"{t_same if t_same is None else round(t_same, 4)} ms, vLLM full "
                      f"{t_full if t_full is None else round(t_full, 4)} ms", flush=True)
            del logical, k, v
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return {"shape": {"hq": hq, "h": h, "d": d, "block_size": bs, "dtype": str(dtype).replace("torch.", "")},
            "rows": rows, "timing_modes": sorted(set(run.modes))}


def compaction(dev, dtype, s: dict, reps: int) -> dict:
    """One layer's compaction (each head keeps ``kept`` of ``ctx`` tokens, packed with lane borrowing) vs
    ``copy_`` of the same bytes, and moment accumulation of the evicted tokens."""
    import triton_ops
    from vllm_contour.layout import compaction_indices, plan_layout, region_source_table

    h, d, bs = s["h"], s["d"], s["bs"]
    run = timer(dev)
    out = []
    for ctx, kept, batch in s["compaction"]:
        nb_req = ctx // bs
        logical, k, v = vllm_cache(batch * nb_req, h, bs, d, dtype, dev, seed=3)
        g = torch.Generator().manual_seed(4)
        moves, evicted = [], []
        for r in range(batch):
            blocks = list(range(r * nb_req, (r + 1) * nb_req))
            keep = [torch.sort(torch.randperm(ctx, generator=g)[:kept]).values for _ in range(h)]
            lay = plan_layout(torch.full((1, h), kept // bs), blocks, bs, h, nb_req)
            moves.append(compaction_indices(keep, lay.page_ids[0], region_source_table(blocks, h), bs))
            src = region_source_table(blocks, h)
            for hh, kk in enumerate(keep):
                mask = torch.ones(ctx, dtype=torch.bool)
                mask[kk] = False
                j = mask.nonzero().squeeze(1)
                evicted.append((src[hh, j // bs], j % bs, torch.full_like(j, hh)))
        mv = [torch.cat([m[i] for m in moves]).to(dev) for i in range(4)]
        ev = [torch.cat([e[i] for e in evicted]).to(dev) for i in range(3)]
        n = mv[0].numel()
        a = torch.empty((2, n, d), dtype=dtype, device=dev)
        b = torch.empty_like(a)
        t_compact = run(lambda: triton_ops.compact(k, v, *mv), reps)
        t_copy = run(lambda: b.copy_(a), reps)
        mom = {"n": torch.zeros(h, device=dev), "sum_k": torch.zeros(h, d, device=dev),
               "sum_v": torch.zeros(h, d, device=dev), "sum_vk": torch.zeros(h, d, d, device=dev)}
        t_mom = run(lambda: triton_ops.accumulate_moments(k, v, *ev, mom), reps)
        el = a.element_size()
        out.append({"context": ctx, "kept": kept, "batch": batch, "tokens_moved": n, "compact_ms": t_compact,
                    "copy_ms": t_copy, "compact_over_copy_speed": t_copy / t_compact,
                    "moments_tokens": int(ev[0].numel()), "moments_ms": t_mom,
                    "moments_gbps": ev[0].numel() * d * 2 * el / t_mom / 1e6})
        print(f"[compaction] {out[-1]}", flush=True)
        del logical, k, v
    return {"rows": out, "timing_modes": run.modes}


def step_rows(dev, dtype, s: dict, reps: int) -> dict:
    """The builder's per-step work on the device (``PageTables.set_keys`` + ``step``) for a batch of
    compacted and ordinary requests: no device synchronisation (``torch.cuda.set_sync_debug_mode``), its host
    time, and the two-part kernel it feeds against the reference over the same step's per-token tables."""
    import random

    import triton_ops
    from benchmarks.page_table_cases import batch_tensors, key_of, make_request
    from vllm_contour.ops.reference import ragged_decode_attention_ref
    from vllm_contour.page_tables import PageTables

    layers, h, d, bs, hq = s["layers"], s["h"], s["d"], s["bs"], s["hq"]
    out = {}
    for n in s["step_requests"]:
        rnd = random.Random(n)
        nb = 64 * n + 64
        free = list(range(1, nb))
        rnd.shuffle(free)
        reqs = [make_request(rnd, f"r{i}", free, layers, h, bs, compacted=i % 2 == 0) for i in range(2 * n)]
        pt = PageTables(layers, h, bs, nb, device=dev)
        for r in reqs:
            if r.layout is not None:
                pt.put(r.req_id, r.layout)
        qsl, seq, bt = batch_tensors(reqs, width=16)
        keys = {r.req_id: key_of(r, bs) for r in reqs}
        qsl_d, seq_d, bt_d = qsl.to(dev), seq.to(dev), bt.to(dev)
        total, max_len = int(qsl[-1]), int(seq.max())

        def step():
            reqs_step = pt.set_keys(keys, [])
            rows, _ = pt.step(reqs_step, qsl_d, seq_d, bt_d, len(reqs), total, max_len)
            rows.stock_seq_lens(seq_d)
            return rows

        rows = step()
        synced = None
        if dev.type == "cuda":  # every synchronising call, by the line of ours that made it
            import warnings

            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            synced = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in caught
                             if "synchroniz" in str(w.message)}) or False
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        host_ms = (time.perf_counter() - t0) / reps * 1e3
        # the kernel these rows feed, against the reference over the same step's per-token tables (on CPU)
        cpu_rows = pt.step(pt.set_keys(keys, []), qsl, seq, bt, len(reqs), total, max_len)[0] if dev.type == "cpu" \
            else _rows_to_cpu(rows)
        tok, idx, table, lens = cpu_rows.tables_for_cpu()
        logical, k, v = vllm_cache(nb, h, bs, d, dtype, dev, seed=n)
        q = torch.randn(total, hq, d, device=dev).to(dtype)
        o = torch.zeros_like(q)
        err = 0.0
        for layer in range(layers):
            triton_ops.compacted_attention(q, k, v, rows.token_req, rows.token_row, rows.token_pos,
                                           rows.run_pages[:, layer], rows.run_count[:, layer], rows.region,
                                           rows.block_table, d ** -0.5, max_len, out=o)
            want, _ = ragged_decode_attention_ref(q.cpu()[tok], logical.cpu()[..., :d], logical.cpu()[..., d:],
                                                  table[layer], lens[layer], d ** -0.5)
            err = max(err, float((o.cpu()[tok].float() - want.float()).abs().max()))
        run = timer(dev)
        kernel_ms = run(lambda: triton_ops.compacted_attention(
            q, k, v, rows.token_req, rows.token_row, rows.token_pos, rows.run_pages[:, 0], rows.run_count[:, 0],
            rows.region, rows.block_table, d ** -0.5, max_len, out=o), 1 if dev.type == "cpu" else 25)
        out[str(n)] = {"compacted_requests": n, "batch_rows": 2 * n, "tokens": total, "synchronised": synced,
                       "host_ms_per_step": host_ms, "kernel_max_abs_err": err, "kernel_ms_per_layer": kernel_ms}
        print(f"[step_rows] {out[str(n)]}", flush=True)
    tol = 2e-2 if dtype != torch.float32 else 5e-4
    out["ok"] = all(r["synchronised"] in (False, None) and r["kernel_max_abs_err"] < tol for r in out.values())
    return out


def _rows_to_cpu(rows):
    from dataclasses import fields, replace

    return replace(rows, **{f.name: getattr(rows, f.name).cpu() for f in fields(rows)
                            if isinstance(getattr(rows, f.name), torch.Tensor)}, _expanded=None)


# ----------------------------------------------------------------------------------------------- main / plot
def plot(json_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(json_path.read_text())
    rows = res["decode"]["rows"]
    ctxs = sorted({r["context"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for ctx, mk in zip(ctxs, "osd^v"):
            sel = sorted((r for r in rows if r["batch"] == batch and r["context"] == ctx), key=lambda r: r["kept"])
            xs = [r["kept"] for r in sel]
            ax.plot(xs, [r["full_over_ours"] for r in sel], marker=mk, label=f"vLLM full {ctx // 1024}K / ours")
        sel = sorted((r for r in rows if r["batch"] == batch and r["context"] == ctxs[0]), key=lambda r: r["kept"])
        ax.plot([r["kept"] for r in sel], [1 / r["ours_over_vllm_same"] for r in sel], "k--", marker="x",
                label="vLLM same tokens / ours")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("kept tokens per KV head")
    axes[0][0].set_ylabel("speed-up of our compacted step (x)")
    axes[0][-1].legend(fontsize=7)
    e = res.get("env", {})
    fig.suptitle(f"decode, one layer (Hq {res['decode']['shape']['hq']}, H {res['decode']['shape']['h']}, "
                 f"D {res['decode']['shape']['d']}, {res['decode']['shape']['dtype']}) on {e.get('name', e.get('device'))}",
                 fontsize=9)
    fig.tight_layout()
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    return png


def table(res: dict) -> str:
    """Markdown of a run: the checks, decode (ours vs vLLM's kernel), compaction, the builder's step."""
    from benchmarks import md_table

    e = res["env"]
    out = [f"{e.get('name', e['device'])} (sm {'.'.join(map(str, e.get('capability', [])))}), torch {e['torch']}, "
           f"Triton {e['triton']}; vLLM's kernel from vLLM {res.get('vllm_kernel')}.", ""]
    ok = {k: res[k].get("ok") for k in ("checks", "checks_fp32", "rounds", "step_rows") if k in res}
    out.append("Checks against the CPU references: " + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in ok.items())
               + ". Two rounds (snapkv; moment with correction) on the GPU keep "
               + ("the same positions and bit-identical kept tokens as on CPU." if ok.get("rounds") else "OTHER positions."))
    sh = res["decode"]["shape"]
    rows = [[r["context"], r["batch"], r["kept"], r["ours_ms"] * 1e3, r["vllm_same_ms"] * 1e3,
             r["vllm_full_ms"] * 1e3, r["ours_over_vllm_same"], r["full_over_ours"], r["ours_gbps"],
             r.get("ours_with_moments_ms", float("nan")) * 1e3]
            for r in res["decode"]["rows"]]
    out += ["", f"Decode, one layer (Hq {sh['hq']}, H {sh['h']}, D {sh['d']}, block {sh['block_size']}, {sh['dtype']}); "
            "µs per step, CUDA graphs, L2 flushed:", "",
            md_table(["context", "batch", "kept/head", "ours µs", "vLLM same tokens µs", "vLLM full µs",
                      "ours / vLLM same", "full / ours", "ours GB/s", "ours + moments µs"], rows, nd=2)]
    comp = [[r["context"], r["kept"], r["batch"], r["compact_ms"] * 1e3, r["copy_ms"] * 1e3,
             r["compact_over_copy_speed"], r["moments_gbps"]] for r in res["compaction"]["rows"]]
    out += ["", "Compaction of one layer vs `copy_` of the same bytes; moment accumulation of the evicted tokens:", "",
            md_table(["context", "kept/head", "batch", "compact µs", "copy_ µs", "copy_ time / compact time",
                      "moments GB/s"], comp, nd=2)]
    if "step_rows" in res:
        st = [[r["compacted_requests"], r["batch_rows"], r["tokens"], "no" if r["synchronised"] is False else "YES",
               r["host_ms_per_step"], r["kernel_ms_per_layer"] * 1e3]
              for k, r in res["step_rows"].items() if k != "ok"]
        out += ["", "The builder's per-step row matching on the device (`PageTables.step`) and the kernel it feeds:",
                "", md_table(["compacted requests", "batch rows", "tokens", "waits for the GPU", "host ms / step",
                              "kernel µs / layer"], st, nd=3)]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu_kernels")
    ap.add_argument("--vendor", metavar="DIR", help="copy vLLM's Triton attention kernel into DIR and exit")
    ap.add_argument("--vllm-kernel", metavar="DIR", default=None, help="a folder made by --vendor")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU tensors (TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    a = ap.parse_args(argv)
    if a.vendor:
        print(vendor(Path(a.vendor)))
        return
    if a.plot:
        print(plot(Path(a.plot)))
        return
    if a.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1 set before Python starts")
        dev = torch.device("cpu")
        s = dict(DRY, compaction=((128, 32, 2),), layers=2, tokens=192, budget=96, tail=32, step_requests=(3,))
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device (use --dry-run on CPU)")
        dev = torch.device("cuda")
        s = dict(hq=HQ, h=H, d=D, bs=BS, contexts=CONTEXTS, batches=BATCHES, kept=KEPT,
                 compaction=((4096, 512, 8), (16384, 1024, 8)), layers=4, tokens=2048, budget=256, tail=64,
                 step_requests=(16, 64))
    reps = 1 if a.dry_run else a.reps
    skip = set(filter(None, a.skip.split(",")))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": "gpu_kernels", "dry_run": a.dry_run}
    kern, kver = (None, None)
    try:
        kern, kver = load_vllm_kernel(a.vllm_kernel)
    except Exception as e:
        kver = f"not loaded: {type(e).__name__}: {e}"
    res["vllm_kernel"] = kver
    _section(res, "env", env, dev)
    dtype = torch.bfloat16
    for name, fn, args in (("checks", checks, (dev, dtype, s, kern)),
                           ("checks_fp32", checks, (dev, torch.float32, s, kern)),
                           ("rounds", rounds, (dev, dtype, s)),
                           ("step_rows", step_rows, (dev, dtype, s, 1 if a.dry_run else 200)),
                           ("decode", decode, (dev, dtype, s, kern, reps)),
                           ("compaction", compaction, (dev, dtype, s, reps))):
        if name not in skip:
            _section(res, name, fn, *args)
        (out / "gpu_kernels.json").write_text(json.dumps(stamp(res, argv), indent=1))
    print(json.dumps({k: (v.get("ok") if isinstance(v, dict) else v) for k, v in res.items()
                      if k in ("checks", "checks_fp32", "rounds", "step_rows")}))
    print(f"[gpu_kernels] wrote {out / 'gpu_kernels.json'}")


if __name__ == "__main__":
    main()
