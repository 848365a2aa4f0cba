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


# ---- branches no caller reached before (issue 46, item 2): chunks spanning pages in the two-part lists,
# head dims whose masks are partial, the 16-bit dot path. Each case records the constexprs the decode kernel
# was launched with, so a case that stops reaching its branch fails instead of passing on another one.

class _LaunchSpy:
    """Stands in for ``kernels.ragged_decode_kernel``: records each launch's constexprs, then launches."""

    KEYS = ("ONE_PAGE", "TWO_PART", "NATIVE_DOT", "SPLIT", "HAS_MOMENTS", "BLOCK_N", "BLOCK_D")

    def __init__(self, fn):
        self.fn, self.seen = fn, []

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kw):
            self.seen.append({k: kw[k] for k in self.KEYS})
            return launch(*args, **kw)

        return run


@pytest.fixture
def spy(monkeypatch):
    s = _LaunchSpy(triton_ops.kernels.ragged_decode_kernel)
    monkeypatch.setattr(triton_ops.kernels, "ragged_decode_kernel", s)
    return s


def _padded(shape, fill, dtype=torch.float32):
    """A tensor of ``shape`` that is the front of a buffer one leading row longer, and that buffer: whatever a
    kernel writes past the tensor's last element lands in the spare row (in bounds) and shows there."""
    buf = torch.full((shape[0] + 1, *shape[1:]), fill, dtype=dtype)
    return buf[: shape[0]], buf


def _two_part_case(bs: int, d: int, seed: int, dtype=torch.float32, n_req: int = 5):
    """One layer of a step mixing compacted and ordinary requests (``PageTables.step`` as the backend builds
    it): the two-part lists' tensors and the per-token tables they expand to (the reference's input)."""
    import random

    from vllm_contour.page_tables import PageTables

    from benchmarks.page_table_cases import batch_tensors, key_of, make_request

    rnd = random.Random(seed)
    nb = 60
    free = list(range(1, nb))
    rnd.shuffle(free)
    reqs = [make_request(rnd, f"r{i}", free, 1, H, bs, compacted=i % 3 != 1) for i in range(n_req)]
    pt = PageTables(1, H, bs, nb)
    for r in reqs:
        if r.layout is not None:
            pt.put(r.req_id, r.layout)
    qsl, seq, bt = batch_tensors(reqs, width=12)
    rows, _ = pt.step(pt.set_keys({r.req_id: key_of(r, bs) for r in reqs}, []), qsl, seq, bt, len(reqs),
                      int(qsl[-1]), int(seq.max()))
    tok, idx, table, lens = rows.tables_for_cpu()
    _, k, v = make_cache("cpu_rows", nb, H, bs, d, dtype, seed=seed)
    n = int(qsl[-1])
    q = torch.randn(n, H * G, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return dict(rows=rows, bt=bt, max_tokens=int(seq.max()), tok=tok, idx=idx, table=table[0], lens=lens[0], k=k,
                v=v, q=q, n=n)


def _check_two_part(c, segments, moments=None, block_n=None, native_dot=None, out_tol=None, lse_tol=1e-5):
    rows, dtype = c["rows"], c["q"].dtype
    out, buf = _padded((c["n"], H * G, c["q"].shape[2]), 5.0, dtype)
    _, lse = triton_ops.compacted_attention(c["q"], c["k"], c["v"], rows.token_req, rows.token_row, rows.token_pos,
                                            rows.run_pages[:, 0], rows.run_count[:, 0], rows.region, c["bt"], 0.2,
                                            max_tokens=c["max_tokens"], moments=moments, out=out, block_n=block_n,
                                            segments=segments, native_dot=native_dot)
    tm = None if moments is None else {x: y[c["idx"]] for x, y in moments.items()}
    tok = c["tok"]
    want, want_l = ragged_decode_attention_ref(c["q"][tok], c["k"], c["v"], c["table"], c["lens"], 0.2, moments=tm)
    torch.testing.assert_close(out[tok].float(), want.float(), **(out_tol or tol(dtype)))
    torch.testing.assert_close(lse[tok], want_l, rtol=lse_tol, atol=lse_tol)
    others = torch.ones(c["n"], dtype=torch.bool)
    others[tok] = False
    assert bool(others.any()) and bool((out[others] == 5.0).all()) and bool((buf[-1] == 5.0).all())


@interp
@pytest.mark.parametrize("bs,block_n,one_page", [(8, None, False), (48, None, False), (16, 32, False),
                                                 (64, None, True)])
def test_compacted_attention_with_chunks_spanning_pages(spy, bs, block_n, one_page):
    """Block sizes other than 16 / 32: with 8 (a chunk of 16 tokens is two pages, the kept run's last page and
    the tail's first one in the same chunk where a run has an odd page count) and 48 (three chunks per page)
    every token of a chunk looks up its page (``ONE_PAGE`` false); 16 with chunks of 32 likewise; 64 takes
    chunks of one page of 64. Split and unsplit lists, moments in one case, against the reference."""
    c = _two_part_case(bs, D, seed=40 + bs)
    runs = c["rows"].run_count[:, 0]
    if bs * 2 == (block_n or 16):  # a run ending mid-chunk: the chunk holds run and tail pages
        assert bool((runs % 2 == 1).any()), runs
    for segments in (1, 3):
        _check_two_part(c, segments, block_n=block_n)
    _check_two_part(c, 2, moments=random_moments(41, len(c["rows"].req_ids), H, D), block_n=block_n)
    assert {(x["ONE_PAGE"], x["TWO_PART"]) for x in spy.seen} == {(one_page, True)}
    assert {x["SPLIT"] for x in spy.seen} == {False, True}


@interp
@pytest.mark.parametrize("d", [80, 96, 112])
def test_head_dims_with_partial_masks(spy, d):
    """Head dims that are not a power of two (``BLOCK_D`` 128, masks ``< D`` partial) in every kernel that
    takes one: compaction (gather / scatter; K and V share each row of vLLM's CPU layout, so a column past
    D is the value row), moment accumulation (row tiles of 64: the second partial), decode and its reduce
    (per-row tables, moments with key-dim tiles past D), and the two-part lists. Caches, moments and outputs
    are the front of longer buffers: nothing may be written past them."""
    from vllm_contour.ops.cpu_layout import KEY_ROWS, cpu_kv_views

    big = torch.randn(NB + 1, H, BS, 2 * d, generator=torch.Generator().manual_seed(50 + d))
    k, v = cpu_kv_views(big[:NB], KEY_ROWS)
    for idx in (compaction_moves(51, NB, H, BS), permutation_moves(52, NB, H, BS, m=40)):
        want, got = big.clone(), big.clone()
        compact_ref(*cpu_kv_views(want[:NB], KEY_ROWS), *idx)
        triton_ops.compact(*cpu_kv_views(got[:NB], KEY_ROWS), *idx)
        assert torch.equal(got, want)
    pg, of, hd = token_list(53, NB, H, BS, 50, hm=H)
    want_m = zero_moments(H, d, 1)
    got_m, bufs = {}, {}
    for key, val in want_m.items():
        got_m[key], bufs[key] = _padded(val.shape, -3.0)
        got_m[key].copy_(val)
    accumulate_moments_ref(k, v, pg, of, hd, want_m)
    triton_ops.accumulate_moments(k, v, pg, of, hd, got_m)  # the launcher's row tiles (64)
    for key in want_m:
        torch.testing.assert_close(got_m[key], want_m[key], rtol=1e-5, atol=1e-4, msg=key)
        assert bool((bufs[key][H] == -3.0).all()), key
    pt, sl = decode_case(54, NB, H, BS, t_rows=2, long_tail=True)
    q = torch.randn(2, H * G, d, generator=torch.Generator().manual_seed(55))
    mom = random_moments(56, 2, H, d)
    want_o, want_l = ragged_decode_attention_ref(q, k, v, pt, sl, 0.2, moments=mom)
    for segments in (1, 3):
        out, buf = _padded((2, H * G, d), 7.0)
        got_o, got_l = triton_ops.ragged_decode_attention(q, k, v, pt, sl, 0.2, moments=mom, segments=segments,
                                                          out=out)
        torch.testing.assert_close(out, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)
        assert bool((buf[2] == 7.0).all())
    _check_two_part(_two_part_case(BS, d, seed=57 + d, n_req=4), 2)
    assert {x["BLOCK_D"] for x in spy.seen} == {128} and {x["SPLIT"] for x in spy.seen} == {False, True}


@interp
@pytest.mark.parametrize("d", [32, 80])
def test_native_16_bit_dots_with_fp16_caches(spy, d):
    """``NATIVE_DOT`` (what a GPU runs for bf16 / fp16 caches: query and probabilities in the cache dtype, fp32
    accumulation) under the interpreter with fp16 caches (the interpreter's bf16 arithmetic is wrong, so bf16
    is compiled only: ``test_aot_native_dot_and_spanning_chunks_for_sm90``): per-row tables split and not,
    moments, and the two-part lists with chunks spanning pages, against the fp32 reference."""
    _, k, v = make_cache("interleaved", NB, H, BS, d, torch.float16, seed=60 + d)
    pt, sl = decode_case(61, NB, H, BS, t_rows=2, long_tail=True)
    q = torch.randn(2, H * G, d, generator=torch.Generator().manual_seed(62)).to(torch.float16)
    out_tol = dict(rtol=3e-3, atol=3e-3)  # q and p rounded to fp16 before their dots
    for mom in (None, random_moments(63, 2, H, d)):
        want_o, want_l = ragged_decode_attention_ref(q, k, v, pt, sl, 0.2, moments=mom)
        for segments in (1, 3):
            got_o, got_l = triton_ops.ragged_decode_attention(q, k, v, pt, sl, 0.2, moments=mom, segments=segments,
                                                              native_dot=True)
            assert got_o.dtype == torch.float16
            torch.testing.assert_close(got_o.float(), want_o.float(), **out_tol)
            torch.testing.assert_close(got_l, want_l, rtol=2e-3, atol=2e-3)
    _check_two_part(_two_part_case(8, d, seed=64 + d, dtype=torch.float16), 2, native_dot=True, out_tol=out_tol,
                    lse_tol=2e-3)
    assert {x["NATIVE_DOT"] for x in spy.seen} == {True}
    assert {(x["ONE_PAGE"], x["TWO_PART"]) for x in spy.seen} == {(True, False), (False, True)}


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


@pytest.mark.skipif(INTERPRET, reason="runs in the parent session")
def test_aot_native_dot_and_spanning_chunks_for_sm90():
    """What the interpreter cannot run, compiled for GPUTarget("cuda", 90, 32) at head_dim 80 (partial masks):
    the decode kernel over two-part lists with chunks spanning pages (``ONE_PAGE`` false), split, with
    moments, and its reduce, compaction's gather and moment accumulation, for bf16 caches. With
    ``NATIVE_DOT`` every ``tl.dot`` is a tensor-core MMA on the cache dtype (bf16, or fp16 for fp16 caches)
    with fp32 accumulation, and nothing in tf32; without it (the fp32-operand path) every MMA is tf32."""
    import json

    code = ("import json, re\n"
            "from triton.backends.compiler import GPUTarget\n"
            "from triton.compiler import ASTSource, compile as tc\n"
            "from triton_ops.aot import kernel_specs\n"
            "def mmas(dt, name, **ce):\n"
            "    (fn, sig, c), = [(f, s, c) for n, f, s, c in kernel_specs(dt, head_dim=80, group=3) if n == name]\n"
            "    k = tc(ASTSource(fn, sig, constexprs=dict(c, **ce)), target=GPUTarget('cuda', 90, 32))\n"
            "    assert k.asm['ptx'] and k.asm['cubin']\n"
            "    return sorted(set(re.findall(r'mma[.\\w]*', k.asm['ptx'])))\n"
            "dec = 'ragged_decode_kernel[two_part=True,moments=True,split=True]'\n"
            "out = {'bf16': mmas('bf16', dec, ONE_PAGE=False, NATIVE_DOT=True),\n"
            "       'fp16': mmas('fp16', dec, ONE_PAGE=False, NATIVE_DOT=True),\n"
            "       'bf16_fp32_operands': mmas('bf16', dec, ONE_PAGE=False, NATIVE_DOT=False),\n"
            "       'reduce': mmas('bf16', 'ragged_reduce_kernel[two_part=True,moments=True]'),\n"
            "       'gather': mmas('bf16', 'compact_gather_kernel'),\n"
            "       'moments': mmas('bf16', 'accumulate_moments_kernel')}\n"
            "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["bf16"] == ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"], got
    assert got["fp16"] == ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"], got
    assert got["bf16_fp32_operands"] == ["mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"], got
    assert got["gather"] == got["reduce"] == got["moments"] == [], got  # compiled (a cubin); no 16-bit dot there


if not INTERPRET:  # the parent session only launches the child: keep its report free of placeholder skips
    del test_compact, test_accumulate_moments, test_ragged_decode, test_ragged_decode_empty_list_and_int64_tables, \
        test_ragged_prefill_rows, test_ragged_decode_writes_into_strided_output, test_page_rows_round_trip, \
        test_moment_storage_and_block_copies, test_compacted_attention_reads_the_two_part_lists, \
        test_compacted_attention_with_chunks_spanning_pages, test_head_dims_with_partial_masks, \
        test_native_16_bit_dots_with_fp16_caches, spy
