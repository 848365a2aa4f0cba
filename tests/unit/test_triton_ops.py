"""The Triton kernels (``triton_ops``) equal the torch reference under the CPU interpreter (small sizes),
and every kernel compiles ahead of time for sm_90.

The interpreter must be on before Triton itself is imported (``triton.language``'s own jitted helpers such
as ``tl.sum`` are decorated at import), and it must not leak into the rest of a pytest session (vLLM
checks whether Triton is usable). So in a normal run this module is one test that re-runs the file in a
child pytest with ``TRITON_INTERPRET=1``; run it directly with ``TRITON_INTERPRET=1 pytest
tests/unit/test_triton_ops.py`` to see every case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[2]

triton = pytest.importorskip("triton")
pytest.importorskip("numpy")

import torch  # noqa: E402

from vllm_contour.ops.reference import (accumulate_moments_ref, compact_ref,  # noqa: E402
                                        ragged_decode_attention_ref)

from .ops_cases import (DTYPES, GPU_LAYOUTS, compaction_moves, decode_case, make_cache,  # noqa: E402
                        permutation_moves, random_moments, token_list, tol, views_of, zero_moments)

if INTERPRET:
    import triton_ops  # noqa: E402
interp = pytest.mark.skipif(not INTERPRET, reason="runs in the child interpreter session")

NB, H, BS, D, G = 12, 2, 16, 32, 3
REPO = Path(__file__).resolve().parents[2]


@interp
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compact(layout, dtype):
    kv, _, _ = make_cache(layout, NB, H, BS, D, dtype, seed=1)
    for idx in (compaction_moves(1, NB, H, BS), permutation_moves(2, NB, H, BS, m=60)):
        want, got = kv.clone(), kv.clone()
        compact_ref(*views_of(layout, want, D), *idx)
        triton_ops.compact(*views_of(layout, got, D), *idx)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@interp
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_moments(layout, dtype):
    _, k, v = make_cache(layout, NB, H, BS, D, dtype, seed=2)
    pg, of, hd = token_list(3, NB, H, BS, 70, hm=H)
    want, got = zero_moments(H, D, 1), zero_moments(H, D, 1)
    accumulate_moments_ref(k, v, pg, of, hd, want)
    triton_ops.accumulate_moments(k, v, pg, of, hd, got, block_n=16, block_r=16)  # several row tiles
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-4, msg=key)


@interp
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
@pytest.mark.parametrize("dtype,with_moments", [(torch.float32, False), (torch.float16, False),
                                                (torch.bfloat16, False), (torch.float32, True),
                                                (torch.bfloat16, True)])
def test_ragged_decode(layout, dtype, with_moments):
    _, k, v = make_cache(layout, NB, H, BS, D, dtype, seed=3)
    pt, sl = decode_case(4, NB, H, BS, t_rows=2, long_tail=True)
    q = torch.randn(2, H * G, D, generator=torch.Generator().manual_seed(5)).to(dtype)
    mom = random_moments(6, 2, H, D) if with_moments else None
    want_o, want_l = ragged_decode_attention_ref(q, k, v, pt, sl, 0.2, moments=mom)
    # chunks of one page (block_n = bs) and of two pages (every token looks up its page); one segment,
    # then lists split in 3 and 5 (segments of unequal use, some empty) merged by the reduce kernel
    for block_n, segments in ((16, 1), (32, 1), (16, 3), (32, 5)):
        got_o, got_l = triton_ops.ragged_decode_attention(q, k, v, pt, sl, 0.2, moments=mom, block_n=block_n,
                                                          segments=segments)
        assert got_o.dtype == dtype
        torch.testing.assert_close(got_o.float(), want_o.float(), **tol(dtype), msg=f"segments={segments}")
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-4, msg=f"segments={segments}")


@interp
def test_ragged_decode_empty_list_and_int64_tables():
    _, k, v = make_cache("interleaved", NB, H, BS, D, seed=4)
    pt, sl = decode_case(7, NB, H, BS, t_rows=2)
    sl[1, 0] = 0
    q = torch.randn(2, H * G, D)
    mom = random_moments(8, 2, H, D)
    mom["n"][1, 0] = 3.0
    for m in (None, mom):
        want_o, want_l = ragged_decode_attention_ref(q, k, v, pt, sl, 0.2, moments=m)
        for segments in (1, 4):
            got_o, got_l = triton_ops.ragged_decode_attention(q, k, v, pt.long(), sl.long(), 0.2, moments=m,
                                                              segments=segments)
            torch.testing.assert_close(got_o, want_o, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)


@interp
def test_ragged_decode_writes_into_strided_output():
    """``out=`` a view of a wider output buffer (what the backend passes: vLLM's own output rows)."""
    _, k, v = make_cache("interleaved", NB, H, BS, D, seed=12)
    pt, sl = decode_case(13, NB, H, BS, t_rows=3)
    q = torch.randn(3, H * G, D, generator=torch.Generator().manual_seed(14))
    buf = torch.full((5, H * G, D), 7.0)
    want_o, _ = ragged_decode_attention_ref(q, k, v, pt, sl, 0.2)
    triton_ops.ragged_decode_attention(q, k, v, pt, sl, 0.2, out=buf[1:4], segments=2)
    torch.testing.assert_close(buf[1:4], want_o, rtol=1e-5, atol=1e-5)
    assert bool((buf[0] == 7.0).all()) and bool((buf[4] == 7.0).all())


@interp
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_page_rows_round_trip(layout, dtype):
    """Whole head-pages out as raw bits (keys, then values, logical order) and back: the moment store."""
    from vllm_contour.ops.paged import pages

    kv, k, v = make_cache(layout, NB, H, BS, D, dtype, seed=15)
    ids = torch.tensor([5, 0, 17, 9])
    got = triton_ops.page_rows(k, v, ids)
    it = {4: torch.int32, 2: torch.int16}[k.element_size()]
    want = torch.stack([pages(k.view(it), ids // H, ids % H), pages(v.view(it), ids // H, ids % H)], dim=1)
    assert torch.equal(got, want)
    before = kv.clone()
    triton_ops.set_page_rows(k, v, ids, torch.zeros_like(got))
    assert bool((pages(k, ids // H, ids % H) == 0).all()) and bool((pages(v, ids // H, ids % H) == 0).all())
    triton_ops.set_page_rows(k, v, ids, got)
    assert torch.equal(kv.view(torch.uint8), before.view(torch.uint8))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_prefill_rows(dtype):
    """Several query tokens of one compacted request: one row per token sharing the request's page table,
    each row's lengths ending at its own token (causal among the new tokens), as the backend builds them."""
    _, k, v = make_cache("cpu_keyT", NB, H, BS, D, dtype, seed=9)
    pt, sl = decode_case(10, NB, H, BS, t_rows=1, long_tail=True)
    q_len = 7
    rows_t = pt.expand(q_len, -1, -1).contiguous()
    rows_s = torch.stack([sl[0] - (q_len - 1 - i) for i in range(q_len)])
    q = torch.randn(q_len, H * G, D, generator=torch.Generator().manual_seed(11)).to(dtype)
    want_o, want_l = ragged_decode_attention_ref(q, k, v, rows_t, rows_s, 0.2)
    got_o, got_l = triton_ops.ragged_decode_attention(q, k, v, rows_t, rows_s, 0.2, block_n=16, segments=2)
    torch.testing.assert_close(got_o.float(), want_o.float(), **tol(dtype))
    torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-4)


@interp
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moment_storage_and_block_copies(layout, dtype):
    """The dispatch's Triton store / load moments, clear pages and copy blocks equal the reference bit for
    bit (chosen by name, as ``VLLM_CONTOUR_OPS_IMPL=triton`` does on CPU tensors under the interpreter)."""
    from vllm_contour import ops
    from vllm_contour.moments import Moments, pack

    mom = random_moments(16, 1, H, D)
    packed = pack(Moments(mom["n"][0], mom["sum_k"][0], mom["sum_v"][0], mom["sum_vk"][0]))
    kv, k, v = make_cache(layout, NB, H, BS, D, dtype, seed=17)
    want_kv = kv.clone()
    wk, wv = views_of(layout, want_kv, D)
    ids = torch.tensor([3, 8, 10, 21, 14, 0])  # bf16 pages hold half as many fp32 values: 5 needed
    ops.store_moments(k, v, ids, packed, impl="triton")
    ops.store_moments(wk, wv, ids, packed, impl="torch")
    assert torch.equal(kv.view(torch.uint8), want_kv.view(torch.uint8))
    table = torch.stack([ids, ids.flip(0)])  # [R, M]: leading dims, as the backend loads them per row
    got = ops.load_moments(k, v, table, H, D, impl="triton")
    want = ops.load_moments(wk, wv, table, H, D, impl="torch")
    for key in want:
        assert torch.equal(got[key], want[key]), key
    ops.clear_pages(k, v, ids[:2], impl="triton")
    ops.clear_pages(wk, wv, ids[:2], impl="torch")
    assert torch.equal(kv.view(torch.uint8), want_kv.view(torch.uint8))
    pairs = [(1, 4), (7, 2)]
    ops.copy_blocks([(k, v)], pairs, impl="triton")
    ops.copy_blocks([(wk, wv)], pairs, impl="torch")
    assert torch.equal(kv.view(torch.uint8), want_kv.view(torch.uint8))


@interp
@pytest.mark.parametrize("with_moments", [False, True])
@pytest.mark.parametrize("segments", [1, 3])
def test_compacted_attention_reads_the_two_part_lists(with_moments, segments):
    """The kernel reading each compacted token's kept run from its slot and its tail from vLLM's block
    table equals the reference over the per-token tables expanded from the same state; the batch's other
    tokens (ordinary rows) keep the output they had."""
    import random

    from vllm_contour.page_tables import PageTables

    from benchmarks.page_table_cases import batch_tensors, key_of, make_request

    rnd = random.Random(20 + segments)
    layers, nb = 2, 60
    free = list(range(1, nb))
    rnd.shuffle(free)
    reqs = [make_request(rnd, f"r{i}", free, layers, H, BS, compacted=i % 3 != 1) for i in range(6)]
    pt = PageTables(layers, H, BS, nb)
    for r in reqs:
        if r.layout is not None:
            pt.put(r.req_id, r.layout)
    qsl, seq, bt = batch_tensors(reqs, width=12)
    rows, _ = pt.step(pt.set_keys({r.req_id: key_of(r, BS) for r in reqs}, []), qsl, seq, bt, len(reqs),
                      int(qsl[-1]), int(seq.max()))
    tok, idx, table, lens = rows.tables_for_cpu()
    _, k, v = make_cache("interleaved", nb, H, BS, D, seed=21)
    n = int(qsl[-1])
    q = torch.randn(n, H * G, D, generator=torch.Generator().manual_seed(22))
    mom = random_moments(23, len(rows.req_ids), H, D) if with_moments else None
    for layer in range(layers):
        out = torch.full((n, H * G, D), 5.0)
        triton_ops.compacted_attention(q, k, v, rows.token_req, rows.token_row, rows.token_pos,
                                       rows.run_pages[:, layer], rows.run_count[:, layer], rows.region, bt, 0.2,
                                       max_tokens=int(seq.max()), moments=mom, out=out, segments=segments)
        tm = None if mom is None else {x: y[idx] for x, y in mom.items()}
        want, _ = ragged_decode_attention_ref(q[tok], k, v, table[layer], lens[layer], 0.2, moments=tm)
        torch.testing.assert_close(out[tok], want, rtol=1e-5, atol=1e-5)
        others = torch.ones(n, dtype=torch.bool)
        others[tok] = False
        assert bool(others.any()) and bool((out[others] == 5.0).all())


@pytest.mark.skipif(INTERPRET, reason="runs in the parent session")
def test_interpreter_cases():
    """Every interpreter case above, in a child pytest that starts with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                        str(Path(__file__).relative_to(REPO))], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=600)
    tail = r.stdout[-4000:]
    assert r.returncode == 0, tail + r.stderr[-2000:]
    assert " passed" in tail and " failed" not in tail, tail


@pytest.mark.skipif(INTERPRET, reason="runs in the parent session")
def test_gpu_benchmark_dry_run(tmp_path):
    """``benchmarks.gpu_kernels`` (what runs on a GPU when one is lent) at toy sizes on CPU tensors under the
    interpreter, with vLLM's own Triton attention kernel vendored from the installed vLLM: every check
    section passes (the ops against the reference, vLLM's kernel called right, two rounds with the Triton
    ops equal to the same rounds with the C++ ops) and the timing sections produce their rows."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kernels", "--vendor", str(tmp_path / "k")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kernels", "--dry-run", "--vllm-kernel",
                        str(tmp_path / "k"), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "gpu_kernels.json").read_text())
    for section in ("checks", "checks_fp32", "rounds", "step_rows"):
        assert res[section].get("ok") is True, (section, res[section])
    assert res["rounds"]["moment"]["kept_blocks"] > 0 and res["rounds"]["snapkv"]["rounds"] == 2
    rows = res["decode"]["rows"]
    assert rows and all(row["ours_ms"] > 0 and row["vllm_same_ms"] > 0 for row in rows)
    assert res["compaction"]["rows"][0]["tokens_moved"] > 0


@pytest.mark.skipif(INTERPRET, reason="runs in the parent session")
def test_aot_compile_for_sm90():
    """Every kernel and variant (per-row tables or two-part lists, moments, split lists, the reduce) compiles
    for GPUTarget("cuda", 90, 32) (bf16 and fp32 caches, head_dim 64 and 128): 15 per dtype."""
    code = ("from triton_ops.aot import compile_all\n"
            "done = compile_all(90, ('bf16',), head_dim=64, group=3)\n"
            "done.update(compile_all(90, ('fp32',), head_dim=128, group=8))\n"
            "assert all(n > 0 for _, n in done.values()), done\n"
            "print(len(done))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "30"


if not INTERPRET:  # the parent session only launches the child: keep its report free of placeholder skips
    del test_compact, test_accumulate_moments, test_ragged_decode, test_ragged_decode_empty_list_and_int64_tables, \
        test_ragged_prefill_rows, test_ragged_decode_writes_into_strided_output, test_page_rows_round_trip, \
        test_moment_storage_and_block_copies, test_compacted_attention_reads_the_two_part_lists
