"""Op benchmark: compaction vs a plain memcpy, ragged decode attention vs vLLM's own CPU kernel.

    OMP_NUM_THREADS=1 python -m benchmarks.ops [--quick] [--out DIR] [--dtype bf16|fp32] [--layout machine|amx]

Model shape like SmolLM2-135M: 30 layers x 3 KV heads x 9 query heads, head_dim 64, block size 32; one
decode token (batch 1). Caches are vLLM's CPU layout ``[B, H, bs, 2D]`` with the key layout vLLM's own
cache-write op produces on this machine (``cpu_layout.probe_layout``), one cache per layer; ``--layout amx``
puts our caches in vLLM's AMX bf16 packing instead (probed from vLLM's write op, which runs without AMX
tiles; vLLM's own kernel then still reads its caches in this machine's layout, and the ``vllm_cpu``
implementation, which would read our pages with this machine's kernel, is left out).

* compaction: one eviction per layer (each head keeps a random share of ``keep x tokens``, packed with
  lane borrowing), timed against ``torch.Tensor.copy_`` of the same number of kept bytes (K and V), in the
  same run: ``fraction = memcpy time / compaction time`` (1.0 = as fast as a memcpy).
* decode: every head reads exactly ``tokens`` tokens; our implementations read a ragged page list (random
  head-pages: heads borrow lanes), vLLM's ``cpu_attention_with_kv_cache`` reads the same number of tokens of
  an uncompacted cache with a normal block table. Times are per decode step over all layers.

Times are CPU time of the calling thread (``time.thread_time``; with one OpenMP thread all work runs
there), medians over repetitions interleaved across implementations: on a shared machine wall time mostly
measures the neighbours. Wall medians are recorded too. Writes ``ops.json`` and ``ops.png`` to ``--out``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from vllm_contour import ops  # noqa: E402
from vllm_contour.layout import compaction_indices, plan_layout, region_source_table  # noqa: E402
from vllm_contour.cpu_dtype import cpu_flags  # noqa: E402
from vllm_contour.ops.cpu_layout import cpu_kv_views  # noqa: E402

from benchmarks import stamp

LAYERS, H, G, D, BS = 30, 3, 3, 64, 32
# compaction's yardsticks: a memcpy of the kept bytes (K and V), and of the cache lines the moves must read
REFERENCES = ("memcpy", "memcpy_read")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _vllm():
    """vLLM's CPU ops and the ISA its backend would pick, or None."""
    try:
        from vllm import _custom_ops as vops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
            return None
        return vops, _get_attn_isa
    except Exception:
        return None


def bench(fns: dict, reps: int, warmup: int = 1) -> dict:
    """Median CPU and wall milliseconds of each callable, repetitions interleaved."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    cpu = {k: [] for k in fns}
    wall = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            c0, w0 = time.thread_time(), time.perf_counter()
            f()
            cpu[k].append((time.thread_time() - c0) * 1e3)
            wall[k].append((time.perf_counter() - w0) * 1e3)
    return {k: {"cpu_ms": statistics.median(cpu[k]), "wall_ms": statistics.median(wall[k]),
                "cpu_ms_min": min(cpu[k])} for k in fns}


def init_amx() -> bool | None:
    """Ask the kernel for AMX tile state, as vLLM's CPU worker does at start-up: a process that calls vLLM's
    AMX kernel without it dies with SIGILL. True when granted, False when refused, None when this CPU has
    no AMX tiles."""
    if "amx_tile" not in cpu_flags():
        return None
    return bool(torch.cpu._init_amx())


def _cpp_decode_path(layout: str) -> str | None:
    """How the C++ decode reads pages of ``layout`` here: ``amx`` (vLLM's AMX packing: ``amx``,
    ``avx512_bf16``, ...) or ``vec`` (vLLM's vec layouts: ``avx512`` or ``generic``)."""
    try:
        return str(torch.ops.vllm_contour.decode_path(layout))
    except (AttributeError, RuntimeError):
        return None


def make_layers(tokens: int, dtype, key_layout, seed: int = 0, spare_blocks: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb = tokens // BS + spare_blocks
    kvs = [torch.randn(nb, H, BS, 2 * D, generator=g).to(dtype) for _ in range(LAYERS)]
    return kvs, [cpu_kv_views(kv, key_layout) for kv in kvs]


# ------------------------------------------------------------------------------------------- compaction
def eviction_moves(tokens: int, keep: float, rnd: random.Random):
    """One layer: every head keeps a random number of whole pages (mean ``keep``), random tokens."""
    e = tokens // BS
    total = max(1, round(keep * e * H))
    w = [rnd.random() + 0.2 for _ in range(H)]
    pages = [min(e, int(total * x / sum(w))) for x in w]
    kept = [torch.tensor(sorted(rnd.sample(range(e * BS), p * BS)), dtype=torch.int64) for p in pages]
    block_ids = list(range(e))
    lay = plan_layout(torch.tensor([pages]), block_ids, BS, H, e)
    return compaction_indices(kept, lay.page_ids[0], region_source_table(block_ids, H), BS)


def read_lines(kv: torch.Tensor, key_layout, page: torch.Tensor, off: torch.Tensor) -> int:
    """Bytes of the 64-byte cache lines that hold a key or value element of the tokens ``(page, off)``
    (head-pages of ``kv``): what moving them must read, whatever the layout packs beside them."""
    h, bs = kv.shape[1], kv.shape[2]
    idx = torch.arange(kv.numel(), dtype=torch.int64).view(kv.shape)
    lines = []
    for v in cpu_kv_views(idx, key_layout):
        b, hh = page // h, page % h
        el = v[b, hh, off] if v.dim() == 4 else v[b, hh, off // v.shape[3], off % v.shape[3]]
        lines.append(el.reshape(-1) * kv.element_size() // 64)
    return int(torch.unique(torch.cat(lines)).numel()) * 64


def bench_compaction(tokens: int, keep: float, dtype, key_layout: str, reps: int, impls: list[str]):
    rnd = random.Random(tokens)
    kvs, views = make_layers(tokens, dtype, key_layout)
    moves = [eviction_moves(tokens, keep, rnd) for _ in range(LAYERS)]
    m_total = sum(int(mv[0].numel()) for mv in moves)
    esize = torch.empty(0, dtype=dtype).element_size()
    kept_bytes = [2 * int(mv[0].numel()) * D * esize for mv in moves]
    read_bytes = [read_lines(kv, key_layout, mv[0], mv[1]) for kv, mv in zip(kvs, moves)]
    src = [torch.empty(b, dtype=torch.uint8).random_() for b in kept_bytes]
    dst = [torch.empty(b, dtype=torch.uint8) for b in kept_bytes]
    src_r = [torch.empty(b, dtype=torch.uint8).random_() for b in read_bytes]
    dst_r = [torch.empty(b, dtype=torch.uint8) for b in read_bytes]

    def copies(pairs):
        def f():
            for s, d in pairs:
                d.copy_(s)
        return f

    def run(impl):
        def f():
            for (k, v), mv in zip(views, moves):
                ops.compact(k, v, *mv, impl=impl)
        return f

    fns = {"memcpy": copies(list(zip(src, dst))), "memcpy_read": copies(list(zip(src_r, dst_r))),
           **{impl: run(impl) for impl in impls}}
    res = bench(fns, reps)
    nbytes = sum(kept_bytes)
    out = {"tokens": tokens, "keep": keep, "moves": m_total, "kept_bytes": nbytes, "read_bytes": sum(read_bytes),
           "times": res}
    for k in fns:
        out.setdefault("gbps", {})[k] = nbytes / (res[k]["cpu_ms"] * 1e-3) / 1e9
        out.setdefault("fraction_of_memcpy", {})[k] = res["memcpy"]["cpu_ms"] / res[k]["cpu_ms"]
        out.setdefault("fraction_of_read_memcpy", {})[k] = res["memcpy_read"]["cpu_ms"] / res[k]["cpu_ms"]
    return out


def compaction_impls(row: dict) -> list[str]:
    """The implementations of a compaction row (not its memcpy yardsticks)."""
    return [k for k in row["times"] if k not in REFERENCES]


def vllm_native_decode(vllm, kvs, n_tokens: int, q, dtype, scale: float):
    """``(step, out)``: ``step()`` runs vLLM's ``cpu_attention_with_kv_cache`` for one decode token of one
    request over the first ``n_tokens`` of every layer cache in ``kvs`` (normal block table), writing
    ``out``."""
    vops, get_isa = vllm
    nb = -(-n_tokens // BS)
    isa = get_isa(dtype, BS, D)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    sl = torch.tensor([n_tokens], dtype=torch.int32)
    bt = torch.arange(nb, dtype=torch.int32).view(1, -1)
    md = vops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=H * G, num_kv_heads=H, head_dim=D, seq_lens=sl, dtype=dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    out = torch.empty(1, H * G, D, dtype=dtype)
    halves = [kv.view(kv.shape[0], H, 2 * BS, D) for kv in kvs]

    def step():
        for kv2 in halves:
            vops.cpu_attention_with_kv_cache(
                query=q, key_cache=kv2[:, :, :BS], value_cache=kv2[:, :, BS:], output=out,
                query_start_loc=qsl, seq_lens=sl, scale=scale, causal=True, alibi_slopes=None,
                sliding_window=-1, block_table=bt, softcap=0.0, scheduler_metadata=md, s_aux=None)
    return step, out


# ----------------------------------------------------------------------------------------------- decode
def bench_decode(tokens: int, dtype, key_layout, reps: int, impls: list[str], vllm, same_layout: bool = True):
    g = torch.Generator().manual_seed(tokens)
    nb = tokens // BS
    kvs, views = make_layers(tokens, dtype, key_layout, seed=tokens)
    q = torch.randn(1, H * G, D, generator=g).to(dtype)
    # ragged: a random permutation of all head-pages dealt to the heads (lane borrowing everywhere)
    perm = torch.randperm(nb * H, generator=g).view(H, nb)
    page_table = perm.unsqueeze(0).to(torch.int32)  # [1, H, nb]
    seq_lens = torch.full((1, H), tokens, dtype=torch.int32)
    scale = D ** -0.5
    mom = {"n": torch.full((1, H), 100.0), "sum_k": torch.randn(1, H, D, generator=g),
           "sum_v": torch.randn(1, H, D, generator=g), "sum_vk": torch.randn(1, H, D, D, generator=g)}

    def run(impl, moments=None):
        def f():
            for k, v in views:
                ops.ragged_decode_attention(q, k, v, page_table, seq_lens, scale, moments=moments, impl=impl,
                                            native=True)
        return f

    fns = {impl: run(impl) for impl in impls}
    if "cpp" in impls:
        fns["cpp+moments"] = run("cpp", mom)
    check = None
    if vllm is not None:
        native, out = vllm_native_decode(vllm, kvs, tokens, q, dtype, scale)
        fns["vllm_native"] = native
        if "cpp" in impls and same_layout:  # same tokens, dense page table: our kernel must agree with vLLM's
            dense = (torch.arange(nb).view(1, 1, -1) * H + torch.arange(H).view(1, H, 1)).to(torch.int32)
            native()
            o, _ = ops.ragged_decode_attention(q, *views[-1], dense, seq_lens, scale, impl="cpp")
            check = float((o.float() - out.float()).abs().max())
    res = bench(fns, reps)
    return {"tokens": tokens, "times": res, "max_abs_diff_cpp_vs_vllm_native": check}


# ------------------------------------------------------------------------------ compacted vs uncompacted
def bench_compacted_vs_full(context: int, budget: int, tail: int, dtype, key_layout: str, reps: int,
                            impls: list[str], vllm):
    """One decode step of a request with ``context`` logical tokens: uncompacted (vLLM's kernel over all
    ``context + tail`` tokens of a normal block table) vs compacted to ``budget`` tokens per KV head on
    average (heads hold different whole-page counts, lanes borrowed) plus the same dense ``tail`` of
    decoded tokens, read through the ragged decode op (``default`` = what the backend dispatches to for a
    row without moment correction)."""
    g = torch.Generator().manual_seed(context + 7)
    q = torch.randn(1, H * G, D, generator=g).to(dtype)
    scale = D ** -0.5
    total_pages = min(H * (context // BS), H * max(1, budget // BS))
    w = torch.rand(H, generator=g) + 0.3
    pages = (w / w.sum() * total_pages).floor().to(torch.int64).clamp(min=1)
    pages[0] += total_pages - int(pages.sum())
    k_blocks = -(-total_pages // H)
    nb_c = k_blocks + 1  # + one dense tail block
    kvs_c, views_c = make_layers(nb_c * BS, dtype, key_layout, seed=context)
    perm = torch.randperm(k_blocks * H, generator=g)[:total_pages].tolist()
    p_max = int(pages.max()) + 1
    page_table = torch.zeros(1, H, p_max, dtype=torch.int32)
    seq_lens = torch.zeros(1, H, dtype=torch.int32)
    at = 0
    for h in range(H):
        n = int(pages[h])
        page_table[0, h, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        page_table[0, h, n] = k_blocks * H + h  # the tail: this head's lane of the dense block
        seq_lens[0, h] = n * BS + tail
        at += n

    def run(impl):
        def f():
            for k, v in views_c:
                ops.ragged_decode_attention(q, k, v, page_table, seq_lens, scale, impl=impl, native=True)
        return f

    fns = {f"compacted:{i}": run(None if i == "default" else i) for i in impls}
    if vllm is not None:
        n_full = context + tail
        kvs, _ = make_layers(-(-n_full // BS) * BS, dtype, key_layout, seed=context + 1)
        full, _ = vllm_native_decode(vllm, kvs, n_full, q, dtype, scale)
        fns["uncompacted:vllm_native"] = full
    res = bench(fns, reps)
    out_ = {"context": context, "budget": budget, "tail": tail, "pages_per_head": pages.tolist(),
            "blocks_held": {"compacted": nb_c, "uncompacted": -(-(context + tail) // BS)}, "times": res}
    if "uncompacted:vllm_native" in res:
        out_["ratio_to_uncompacted"] = {k: res[k]["cpu_ms"] / res["uncompacted:vllm_native"]["cpu_ms"]
                                        for k in res if k.startswith("compacted")}
    return out_


# ------------------------------------------------------------------------------------------------ report
def plot(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cvf = result.get("compacted_vs_full") or []
    fig, ax = plt.subplots(1, 3 if cvf else 2, figsize=(18 if cvf else 12, 4.5))
    for keep in sorted({r["keep"] for r in result["compaction"]}):
        rows = [r for r in result["compaction"] if r["keep"] == keep]
        for impl in compaction_impls(rows[0]):
            ax[0].plot([r["tokens"] for r in rows], [r["fraction_of_memcpy"][impl] for r in rows], "o-",
                       label=f"{impl}, keep {keep:g}")
            if "fraction_of_read_memcpy" in rows[0]:
                ax[0].plot([r["tokens"] for r in rows], [r["fraction_of_read_memcpy"][impl] for r in rows],
                           "x--", label=f"{impl}, keep {keep:g}, vs the lines read")
    ax[0].axhline(1.0, color="gray", ls=":", label="memcpy")
    ax[0].set(xscale="log", xlabel="prompt tokens per head", ylabel="throughput / memcpy throughput",
              title=f"compaction ({LAYERS} layers, {result['config']['dtype']})")
    ax[0].legend(fontsize=8)
    rows = result["decode"]
    for impl in rows[0]["times"]:
        ax[1].plot([r["tokens"] for r in rows], [r["times"][impl]["cpu_ms"] for r in rows], "o-", label=impl)
    ax[1].set(xscale="log", yscale="log", xlabel="tokens read per KV head", ylabel="ms per decode step",
              title=f"decode, {LAYERS} layers x {H} KV x {H * G} q heads, D={D}")
    ax[1].legend(fontsize=8)
    for a, rows_ in ((ax[0], result["compaction"]), (ax[1], result["decode"])):
        ticks = sorted({r["tokens"] for r in rows_})
        a.set_xticks(ticks, [str(x) for x in ticks])
        a.minorticks_off()
    if cvf:
        for k in cvf[0]["times"]:
            ax[2].plot([r["context"] for r in cvf], [r["times"][k]["cpu_ms"] for r in cvf], "o-", label=k)
        ticks = [r["context"] for r in cvf]
        ax[2].set(xscale="log", yscale="log", xlabel="logical context (tokens)", ylabel="ms per decode step",
                  title=f"one request: compacted to {cvf[0]['budget']}/head vs uncompacted")
        ax[2].set_xticks(ticks, [str(x) for x in ticks])
        ax[2].minorticks_off()
        ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    lines = [f"compaction, {LAYERS} layers, {result['config']['dtype']}, key layout "
             f"{result['config']['key_layout']} (CPU ms, median; fraction = memcpy time / op time; "
             f"'read': a memcpy of the bytes of every cache line holding a kept token)"]
    comp = result["compaction"]
    impls = compaction_impls(comp[0])
    read = "read_bytes" in comp[0]
    lines.append(f"{'tokens':>7} {'keep':>5} {'MB kept':>8} {'memcpy':>8} " +
                 (f"{'MB read':>8} {'memcpy':>8} " if read else "") +
                 " ".join(f"{i:>8} {'frac':>5}" + (f" {'read':>5}" if read else "") for i in impls))
    for r in comp:
        t = r["times"]
        lines.append(f"{r['tokens']:>7} {r['keep']:>5.2f} {r['kept_bytes'] / 1e6:>8.2f} "
                     f"{t['memcpy']['cpu_ms']:>8.2f} " +
                     (f"{r['read_bytes'] / 1e6:>8.2f} {t['memcpy_read']['cpu_ms']:>8.2f} " if read else "") +
                     " ".join(f"{t[i]['cpu_ms']:>8.2f} {r['fraction_of_memcpy'][i]:>5.2f}" +
                              (f" {r['fraction_of_read_memcpy'][i]:>5.2f}" if read else "") for i in impls))
    dec = result["decode"]
    impls = list(dec[0]["times"])
    lines.append("")
    lines.append(f"decode step, {LAYERS} layers x {H} KV heads x {H * G} q heads, D={D}, bs={BS}, "
                 f"{result['config']['dtype']} (CPU ms, median); ratio = impl / vllm_native")
    lines.append(f"{'tokens':>7} " + " ".join(f"{i:>12}" for i in impls) +
                 ("  " + " ".join(f"{i + '/nat':>14}" for i in impls if i != "vllm_native")
                  if "vllm_native" in impls else ""))
    for r in dec:
        t = r["times"]
        s = f"{r['tokens']:>7} " + " ".join(f"{t[i]['cpu_ms']:>12.2f}" for i in impls)
        if "vllm_native" in t:
            s += "  " + " ".join(f"{t[i]['cpu_ms'] / t['vllm_native']['cpu_ms']:>14.2f}"
                                 for i in impls if i != "vllm_native")
        lines.append(s)
    cvf = result.get("compacted_vs_full") or []
    if cvf:
        keys = list(cvf[0]["times"])
        lines.append("")
        lines.append(f"decode step of one request, compacted to {cvf[0]['budget']} tokens/head (+{cvf[0]['tail']} "
                     f"tail) vs uncompacted at the same logical context (CPU ms, median; ratio = compacted / "
                     f"uncompacted)")
        lines.append(f"{'context':>7} {'blocks':>9} " + " ".join(f"{k:>24}" for k in keys) + "  " +
                     " ".join(f"{k.split(':')[1] + ' ratio':>16}" for k in keys if k.startswith("compacted")))
        for r in cvf:
            b = r["blocks_held"]
            s = f"{r['context']:>7} {str(b['compacted']) + '/' + str(b['uncompacted']):>9} " + \
                " ".join(f"{r['times'][k]['cpu_ms']:>24.2f}" for k in keys)
            if "ratio_to_uncompacted" in r:
                s += "  " + " ".join(f"{r['ratio_to_uncompacted'][k]:>16.3f}" for k in keys if k.startswith("compacted"))
            lines.append(s)
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (~1 min)")
    ap.add_argument("--out", default="results/bench_ops")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--layout", default="machine", choices=["machine", "amx"],
                    help="our caches' page layout: what vLLM writes on this machine, or the AMX bf16 packing")
    ap.add_argument("--budget", type=int, default=128, help="tokens per KV head of the compacted request")
    ap.add_argument("--tail", type=int, default=16, help="decoded tokens after the compacted run")
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    amx_state = init_amx()
    dtype = DTYPES[a.dtype]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    vllm = _vllm()
    from vllm_contour.ops.cpu_layout import PageLayout, probe_layout

    key_layout = PageLayout.key_transposed(BS, D)
    if a.layout == "amx":
        try:
            key_layout = probe_layout("amx", dtype, BS, D)
        except Exception:
            key_layout = PageLayout.amx_bf16(BS, D)
    elif vllm is not None:
        key_layout = probe_layout(vllm[1](dtype, BS, D), dtype, BS, D)
    cpp_layout = "amx" if a.layout == "amx" or "amx" in key_layout.source else "vec"
    if a.quick:
        comp_sizes, keeps, dec_sizes, reps = [256, 1024, 4096], [0.5], [256, 1024, 4096], 5
    else:
        comp_sizes, keeps, dec_sizes, reps = [256, 512, 1024, 2048, 4096], [0.25, 0.5], \
            [256, 512, 1024, 2048, 4096], 11
    comp_impls = [i for i in ("cpp", "torch") if i in ops.available("compact", "cpu")]
    dec_impls = [i for i in ("cpp", "vllm_cpu", "torch") if a.layout == "machine" or i != "vllm_cpu"
                 if i in ops.available("ragged_decode_attention", "cpu", native=True,
                                       key_cache=cpu_kv_views(torch.zeros(1, H, BS, 2 * D, dtype=dtype),
                                                              key_layout)[0])]
    jobs = [("compaction", n, k) for n in comp_sizes for k in keeps] + [("decode", n, None) for n in dec_sizes] \
        + [("compacted_vs_full", n, None) for n in dec_sizes]
    result = {"config": {"layers": LAYERS, "kv_heads": H, "q_heads": H * G, "head_dim": D, "block_size": BS,
                         "dtype": a.dtype, "layout": a.layout,
                         "key_layout": f"{key_layout.source}: key {key_layout.key}, value {key_layout.value}",
                         "threads": torch.get_num_threads(),
                         "reps": reps, "quick": a.quick, "torch": torch.__version__,
                         "cpu": platform.processor() or platform.machine(),
                         "vllm_isa": vllm[1](dtype, BS, D) if vllm else None, "amx_tiles": amx_state,
                         "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512", "avx2"))),
                         "cpp_decode_layout": cpp_layout, "cpp_decode_path": _cpp_decode_path(cpp_layout)},
              "compaction": [], "decode": [], "compacted_vs_full": []}
    for kind, n, keep in tqdm(jobs, desc="benchmarks.ops"):
        if kind == "compaction":
            result["compaction"].append(bench_compaction(n, keep, dtype, key_layout, reps, comp_impls))
        elif kind == "decode":
            result["decode"].append(bench_decode(n, dtype, key_layout, max(3, reps // 2), dec_impls, vllm,
                                                 same_layout=a.layout == "machine"))
        else:
            cvf_impls = ["default"] + [i for i in ("cpp", "torch") if i in dec_impls]
            result["compacted_vs_full"].append(bench_compacted_vs_full(n, a.budget, a.tail, dtype, key_layout,
                                                                       reps, cvf_impls, vllm))
    (out / "ops.json").write_text(json.dumps(stamp(result, argv), indent=1))
    plot(result, out / "ops.png")
    txt = table(result)
    (out / "ops.txt").write_text(txt + "\n")
    print(txt)
    print(f"\nwrote {out / 'ops.json'}, {out / 'ops.png'}")


if __name__ == "__main__":
    main()
