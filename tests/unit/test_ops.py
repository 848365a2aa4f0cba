"""Every CPU implementation of the three ops equals the torch reference: random ragged layouts (lane
borrowing, empty runs, partial last pages, long tails), fp32 / fp16 / bf16, strided caches in vLLM's CPU
layout (key rows or transposed key pages) and in a token-interleaved layout, fused moments.

The C++ kernels come from the installed ``vllm_contour._C``, else they are JIT-compiled once into
``build/jit_ext`` (cached across sessions)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from vllm_contour import ops
from vllm_contour.ops import cpu_ext
from vllm_contour.ops.reference import (accumulate_moments_ref, compact_ref, dense_attention_ref,
                                        ragged_decode_attention_ref)

from .ops_cases import (DTYPES, LAYOUTS, compaction_moves, decode_case, make_cache, permutation_moves,
                        random_moments, token_list, tol, views_of, zero_moments)

NB, H, BS, D, G = 24, 3, 16, 32, 3


@pytest.fixture(scope="session")
def cpp():
    if cpu_ext.load(jit=True) is None:
        pytest.fail("the C++ extension neither imports nor builds")
    return "cpp"


# ------------------------------------------------------------------------------------------ compact
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("moves", ["eviction", "permutation"])
def test_compact_matches_reference(cpp, layout, dtype, moves):
    for seed in range(3):
        kv, _, _ = make_cache(layout, NB, H, BS, D, dtype, seed=seed)
        if moves == "eviction":
            idx = compaction_moves(seed, NB, H, BS)
        else:
            idx = permutation_moves(seed, NB, H, BS, m=200)
        want, got = kv.clone(), kv.clone()
        compact_ref(*views_of(layout, want, D), *idx)
        ops.compact(*views_of(layout, got, D), *idx, impl=cpp)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit-exact, untouched slots too


@pytest.mark.parametrize("layout", ["cpu_keyT", "cpu_amx"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs, blocks", [(32, 8), (64, 8), (64, 120)])
def test_compact_moves_key_columns_in_runs(cpp, layout, dtype, bs, blocks):
    """Pages whose keys are columns of 2- or 4-byte words (vec and AMX packing, pages of 32 and 64 tokens)
    move runs of consecutive destinations together from a window of their source page; one layer of
    120 blocks (over 13,000 moves) runs its moves in any order, on two threads."""
    nb, d = blocks + 2, 64
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(2):
            kv, _, _ = make_cache(layout, nb, H, bs, d, dtype, seed=seed)
            idx = compaction_moves(seed, nb, H, bs, blocks=blocks)
            want, got = kv.clone(), kv.clone()
            compact_ref(*views_of(layout, want, d), *idx)
            ops.compact(*views_of(layout, got, d), *idx, impl=cpp)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("layout", ["cpu_keyT", "cpu_amx"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compact_run_reads_a_source_an_earlier_move_wrote_from_before_the_moves(cpp, layout, dtype):
    """Moves 1 and 2 go to consecutive tokens from one window of one page (one run); move 2's source is what
    move 0 overwrites, so the run must read it as it was before any move (its window set aside)."""
    bs, d = 32, 64
    kv, _, _ = make_cache(layout, 4, H, bs, d, dtype, seed=5)
    src_page, src_off = torch.tensor([6, 3, 3, 3]), torch.tensor([0, 2, 3, 9])
    dst_page, dst_off = torch.tensor([3, 0, 0, 0]), torch.tensor([3, 0, 1, 2])
    want, got = kv.clone(), kv.clone()
    compact_ref(*views_of(layout, want, d), src_page, src_off, dst_page, dst_off)
    ops.compact(*views_of(layout, got, d), src_page, src_off, dst_page, dst_off, impl=cpp)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_compact_empty_and_self_moves(cpp):
    kv, k, v = make_cache("cpu_rows", NB, H, BS, D)
    before = kv.clone()
    e = torch.empty(0, dtype=torch.int64)
    ops.compact(k, v, e, e, e, e, impl=cpp)
    p, o = torch.tensor([5, 7]), torch.tensor([3, 0])
    ops.compact(k, v, p, o, p, o, impl=cpp)
    assert torch.equal(kv, before)


def test_compact_rejects_out_of_range(cpp):
    _, k, v = make_cache("cpu_rows", NB, H, BS, D)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.compact(k, v, torch.tensor([0]), torch.tensor([0]), torch.tensor([NB * H]), torch.tensor([0]),
                    impl=cpp)


# ------------------------------------------------------------------------------- accumulate_moments
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_moments_matches_reference(cpp, layout, dtype):
    _, k, v = make_cache(layout, NB, H, BS, D, dtype, seed=1)
    for seed, m in ((0, 1), (1, 37), (2, 300)):
        pg, of, hd = token_list(seed, NB, H, BS, m, hm=H)
        want, got = zero_moments(H, D, seed), zero_moments(H, D, seed)
        accumulate_moments_ref(k, v, pg, of, hd, want)
        ops.accumulate_moments(k, v, pg, of, hd, got, impl=cpp)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-4, msg=key)


def test_accumulate_moments_strided_stats_and_empty(cpp):
    _, k, v = make_cache("cpu_keyT", NB, H, BS, D, seed=2)
    pg, of, hd = token_list(3, NB, H, BS, 50, hm=H)
    want = zero_moments(H, D, 4)
    got = {key: t.clone() for key, t in want.items()}
    got["sum_vk"] = want["sum_vk"].transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous, same values
    accumulate_moments_ref(k, v, pg, of, hd, want)
    ops.accumulate_moments(k, v, pg, of, hd, got, impl=cpp)
    torch.testing.assert_close(got["sum_vk"], want["sum_vk"], rtol=1e-5, atol=1e-4)
    e = torch.empty(0, dtype=torch.int64)
    before = {key: t.clone() for key, t in got.items()}
    ops.accumulate_moments(k, v, e, e, e, got, impl=cpp)
    assert all(torch.equal(got[key], before[key]) for key in got)


def test_accumulate_moments_matches_moments_module(cpp):
    """The op adds exactly what ``moments.accumulate`` computes from explicit keys/values."""
    from vllm_contour.moments import accumulate

    _, k, v = make_cache("cpu_rows", NB, H, BS, D, seed=5)
    pg, of, hd = token_list(6, NB, H, BS, 120, hm=H)
    got = ops.accumulate_moments(k, v, pg, of, hd, zero_moments(H, D), impl=cpp)
    blk, lane = pg // H, pg % H
    keys, vals = k[blk, lane, of], v[blk, lane, of]  # [M, D]
    mask = hd.view(1, -1) == torch.arange(H).view(-1, 1)  # [H, M]
    ref = accumulate(keys.expand(H, -1, -1), vals.expand(H, -1, -1), mask)
    torch.testing.assert_close(got["sum_vk"], ref.sum_vk, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got["n"], ref.n)


# ------------------------------------------------------------------------------------- gather_pages
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_pages_matches_reference(cpp, layout, dtype):
    """Head-pages of every layer into ``[L, M, bs, D]`` rows in logical order, whatever the page layout
    (rows, key columns, AMX packing, interleaved heads): equal to the torch reference bit for bit, with one
    id list for every layer or one per layer (repeats and any order)."""
    layers = [make_cache(layout, NB, H, BS, D, dtype, seed=20 + i) for i in range(3)]
    g = torch.Generator().manual_seed(21)
    for ids in (torch.randint(0, NB * H, (7,), generator=g), torch.randint(0, NB * H, (3, 5), generator=g).int(),
                torch.tensor([4, 4, 0, NB * H - 1])):
        for side in (1, 2):  # keys, values
            views = [c[side] for c in layers]
            want = ops.gather_pages(views, ids, impl="torch")
            got = ops.gather_pages(views, ids, impl=cpp)
            assert got.shape == (3, ids.shape[-1], BS, D) and got.dtype == dtype
            assert torch.equal(got, want)
            blk, lane = divmod(int(ids.view(-1)[-1]), H)  # the last page by hand
            assert torch.equal(want[-1, -1].float(), views[-1][blk, lane].reshape(BS, D).float())


def test_gather_pages_follows_a_forced_implementation_only_where_it_has_it(cpp, monkeypatch):
    """``VLLM_CONTOUR_OPS_IMPL=torch`` runs torch's copy; ``triton`` (the CUDA ops, none for this copy) leaves
    the best one available (here the C++ one) instead of failing; an explicit ``impl`` it lacks fails."""
    views = [make_cache("cpu_keyT", NB, H, BS, D, seed=23)[1]]
    ids = torch.tensor([1, 2])
    for forced, used in (("torch", "torch"), ("triton", cpp)):
        monkeypatch.setenv("VLLM_CONTOUR_OPS_IMPL", forced)
        before = dict(ops.CALLS)
        ops.gather_pages(views, ids)
        assert {k: n - before.get(k, 0) for k, n in ops.CALLS.items() if n != before.get(k, 0)} == \
            {("gather_pages", used): 1}
    with pytest.raises(ValueError, match="gather_pages"):
        ops.gather_pages(views, ids, impl="triton")


def test_gather_pages_names_a_page_outside_the_cache(cpp):
    views = [make_cache("cpu_keyT", NB, H, BS, D, seed=22)[1]]
    with pytest.raises(RuntimeError, match=f"page id {NB * H}"):
        ops.gather_pages(views, torch.tensor([0, NB * H]), impl=cpp)


# -------------------------------------------------------------------------- ragged_decode_attention
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_moments", [False, True])
def test_decode_matches_reference(cpp, layout, dtype, with_moments):
    _, k, v = make_cache(layout, NB, H, BS, D, dtype, seed=7)
    for seed in range(2):
        pt, sl = decode_case(seed, NB, H, BS, t_rows=3, long_tail=seed == 1)
        q = torch.randn(pt.shape[0], H * G, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
        mom = random_moments(seed, pt.shape[0], H, D) if with_moments else None
        scale = D ** -0.5
        want_o, want_l = ragged_decode_attention_ref(q, k, v, pt, sl, scale, moments=mom)
        got_o, got_l = ops.ragged_decode_attention(q, k, v, pt, sl, scale, moments=mom, impl=cpp, need_lse=True)
        assert got_o.dtype == dtype and got_l.dtype == torch.float32
        torch.testing.assert_close(got_o.float(), want_o.float(), **tol(dtype))
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_longer_than_a_softmax_chunk(cpp, layout, dtype):
    """Rows of 1,000-2,100 tokens (the kernel's softmax runs over chunks of ~512 tokens and rescales what it
    has summed when a later chunk's logits are larger): keys grow along the row so that every chunk raises
    the maximum; one head's row ends one token into a chunk. Equals the reference, moments off and on."""
    bs, nb = 32, 80
    storage, k, v = make_cache(layout, nb, H, bs, D, dtype, seed=5)
    pages = torch.randperm(nb * H, generator=torch.Generator().manual_seed(6))[:3 * 66].view(1, H, 66)
    sl = torch.tensor([[2100, 1000, 16 * bs + 1]], dtype=torch.int32)
    for i in range(66):  # page i of head h: keys times 1 + i / 16 (later tokens get larger logits)
        for h in range(H):
            b, lane = divmod(int(pages[0, h, i]), H)
            k[b, lane] *= 1 + i / 16
    q = torch.randn(1, H * G, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    for mom in (None, random_moments(1, 1, H, D)):
        want_o, want_l = ragged_decode_attention_ref(q, k, v, pages.to(torch.int32), sl, D ** -0.5, moments=mom)
        got_o, got_l = ops.ragged_decode_attention(q, k, v, pages.to(torch.int32), sl, D ** -0.5, moments=mom,
                                                   impl=cpp, need_lse=True)
        torch.testing.assert_close(got_o.float(), want_o.float(), **tol(dtype))
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["cpu_rows", "cpu_keyT"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_reads_nothing_past_a_rows_length(cpp, layout, dtype):
    """vLLM's vec layouts (the kernel's masked loads): slots of a row's last page past its length hold NaN;
    the output is the reference's over the row's tokens."""
    bs, n = 32, 32 + 19
    storage, k, v = make_cache(layout, 4, H, bs, D, dtype, seed=9)
    pt = torch.stack([torch.arange(2) * H + h for h in range(H)]).unsqueeze(0).to(torch.int32)
    sl = torch.full((1, H), n, dtype=torch.int32)
    q = torch.randn(1, H * G, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    want_o, _ = ragged_decode_attention_ref(q, k, v, pt, sl, D ** -0.5)
    k[1, :, n - bs:] = float("nan")
    v[1, :, n - bs:] = float("nan")
    got_o, _ = ops.ragged_decode_attention(q, k, v, pt, sl, D ** -0.5, impl=cpp, need_lse=True)
    assert storage.isnan().any() and torch.isfinite(want_o).all()
    torch.testing.assert_close(got_o.float(), want_o.float(), **tol(dtype))


def test_decode_query_dtype_and_index_types(cpp):
    """fp32 query on a bf16 cache (output in the query dtype), int64 / non-contiguous tables."""
    _, k, v = make_cache("cpu_keyT", NB, H, BS, D, torch.bfloat16, seed=11)
    pt, sl = decode_case(12, NB, H, BS, t_rows=3)
    q = torch.randn(3, H * G, D)
    want_o, want_l = ragged_decode_attention_ref(q, k, v, pt, sl, 0.2)
    pt_nc = pt.long().transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    sl_nc = sl.t().contiguous().t()
    for table, lens, query in ((pt.long(), sl.long(), q), (pt_nc, sl_nc, q), (pt, sl, q.transpose(0, 1).contiguous()
                                                                               .transpose(0, 1))):
        got_o, got_l = ops.ragged_decode_attention(query, k, v, table, lens, 0.2, impl=cpp)
        assert got_o.dtype == torch.float32
        torch.testing.assert_close(got_o, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)
    got_o, _ = ops.ragged_decode_attention(q.half(), k, v, pt, sl, 0.2, impl=cpp)  # fp16 query, bf16 cache
    assert got_o.dtype == torch.float16
    torch.testing.assert_close(got_o.float(), want_o, rtol=2e-3, atol=2e-3)


def test_decode_equals_dense_attention_over_explicit_tokens(cpp):
    """Independent oracle: gather each list's tokens by hand and run plain attention."""
    _, k, v = make_cache("cpu_keyT", NB, H, 32, 64, seed=3)
    pt, sl = decode_case(4, NB, H, 32, t_rows=2, long_tail=True)
    q = torch.randn(2, H * G, 64)
    out, lse = ops.ragged_decode_attention(q, k, v, pt, sl, 0.125, impl=cpp)
    for r in range(2):
        for h in range(H):
            n = int(sl[r, h])
            idx = torch.arange(n)
            ids = pt[r, h, idx // 32].long()
            ks, vs = k[ids // H, ids % H, idx % 32], v[ids // H, ids % H, idx % 32]
            o_ref, l_ref = dense_attention_ref(q[r, h * G:(h + 1) * G], ks[None], vs[None], 0.125)
            torch.testing.assert_close(out[r, h * G:(h + 1) * G], o_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[r, h * G:(h + 1) * G], l_ref, rtol=1e-5, atol=1e-5)


def test_decode_empty_list_and_all_evicted(cpp):
    """seq_len 0: out 0, lse -inf; with moments the estimate of the evicted part alone."""
    _, k, v = make_cache("cpu_rows", NB, H, BS, D, seed=8)
    pt, sl = decode_case(5, NB, H, BS, t_rows=2)
    sl[0, 1] = 0
    q = torch.randn(2, H * G, D)
    for mom in (None, random_moments(9, 2, H, D)):
        if mom is not None:
            mom["n"][0, 1] = 7.0
        want_o, want_l = ragged_decode_attention_ref(q, k, v, pt, sl, 0.3, moments=mom)
        got_o, got_l = ops.ragged_decode_attention(q, k, v, pt, sl, 0.3, moments=mom, impl=cpp)
        assert torch.isfinite(got_o).all()
        torch.testing.assert_close(got_o, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)
        if mom is None:
            assert (got_o[0, G:2 * G] == 0).all() and torch.isneginf(got_l[0, G:2 * G]).all()


def test_decode_vllm_cpu_without_moments(cpp):
    if "vllm_cpu" not in ops.available("ragged_decode_attention", "cpu", native=True):
        pytest.skip("vLLM's CPU kernels are not importable")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_contour.ops.cpu_layout import cpu_kv_views, probe_layout

    bs, d = 32, 64
    for dtype in (torch.float32, torch.bfloat16):
        layout = probe_layout(_get_attn_isa(dtype, bs, d), dtype, bs, d)
        kv = torch.randn(NB, H, bs, 2 * d).to(dtype)
        k, v = cpu_kv_views(kv, layout)
        pt, sl = decode_case(6, NB, H, bs, t_rows=3, long_tail=True)
        q = torch.randn(3, H * G, d).to(dtype)
        want, _ = ragged_decode_attention_ref(q, k, v, pt, sl, d ** -0.5)
        for impl in ("vllm_cpu", "cpp"):
            got, _ = ops.ragged_decode_attention(q, k, v, pt, sl, d ** -0.5, impl=impl, native=True)
            torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


# ------------------------------------------------------------------------------------------ layouts
def _probe(isa: str) -> tuple[list[dict], str]:
    """The layouts vLLM's own cache write gives for ``isa`` on this machine (``layout_probe``, one process
    per ISA so that a kernel this CPU cannot run kills only the probe)."""
    r = subprocess.run([sys.executable, "-m", "tests.unit.layout_probe", isa], capture_output=True, text=True,
                       timeout=300, cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return rows, "" if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()[-300:]}"


def test_probed_layouts_are_what_vllm_writes():
    """Every (ISA, dtype, block size, head dim) vLLM's CPU attention may pick: the probe fits a two-level
    description, and the views of a cache written by vLLM's own ``cpu_attn_reshape_and_cache`` return the
    keys and values that were written. The ``vec``/``vec16`` layouts (what vLLM uses here) must probe; the
    AMX bf16 packing is probed where this machine's vLLM can write it (no AMX tiles are needed to write on
    an AVX-512-bf16 CPU; on one without, vLLM refuses the write: "Unsupported CPU attention configuration"),
    else it is covered by ``PageLayout.amx_bf16``, the formula the probe measured, in every op test
    (``cpu_amx``). The probe process must finish for every ISA with one row per case: a crash or a missing row
    fails, whatever the ISA; only vLLM's own refusal makes AMX rows synthetic. The test says which were probed
    for real."""
    from tests.unit.layout_probe import CASES

    probed, synthetic = [], []
    for isa in ("vec", "vec16", "amx"):
        rows, err = _probe(isa)
        assert not err, (isa, err)
        assert [(r["dtype"], r["bs"], r["d"]) for r in rows] == [tuple(c) for c in CASES[isa]], (isa, rows)
        refused = [r for r in rows if isa == "amx"  # vLLM refuses to write AMX on this CPU (any other error fails)
                   and "Unsupported CPU attention configuration" in r.get("error", "")]
        rows = [r for r in rows if r not in refused]
        for row in rows:
            assert "error" not in row, row
            assert row["views_match"], row
            if isa == "amx":
                assert row["equals_formula"] and not row["flat"], row
            else:
                assert row["flat"], row
            probed.append(f"{isa}/{row['dtype']}/bs{row['bs']}/d{row['d']}")
        if refused:
            synthetic.append(f"amx/bfloat16 x{len(refused)} (vLLM: {refused[0]['error'][:160]}; covered by "
                             "PageLayout.amx_bf16)")
    warnings.warn(f"cache layouts probed from vLLM's own write: {', '.join(probed)}; synthetic only: "
                  f"{', '.join(synthetic) or 'none'}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_agree_across_layouts(cpp, dtype):
    """The same logical cache in every CPU layout (key rows, transposed keys, AMX packing) gives the same
    compaction (logical pages equal, bit for bit), moments and decode outputs: the layout description is
    the only thing that differs."""
    from vllm_contour.ops.paged import pages, set_pages

    g = torch.Generator().manual_seed(11)
    lk = torch.randn(NB, H, BS, D, generator=g).to(dtype)
    lv = torch.randn(NB, H, BS, D, generator=g).to(dtype)
    allb = torch.arange(NB)
    results = {}
    for layout in ("cpu_rows", "cpu_keyT", "cpu_amx"):
        _, k, v = make_cache(layout, NB, H, BS, D, dtype)
        for c, x in ((k, lk), (v, lv)):
            for lane in range(H):
                set_pages(c, allb, torch.full((NB,), lane), x[:, lane])
        assert torch.equal(pages(k, allb), lk) and torch.equal(pages(v, allb), lv)
        pg, of, hd = token_list(3, NB, H, BS, 90, hm=H)
        mom = ops.accumulate_moments(k, v, pg, of, hd, zero_moments(H, D), impl=cpp)
        ops.compact(k, v, *compaction_moves(4, NB, H, BS), impl=cpp)
        pt, sl = decode_case(5, NB, H, BS, t_rows=3, long_tail=True)
        q = torch.randn(pt.shape[0], H * G, D, generator=torch.Generator().manual_seed(6)).to(dtype)
        o, lse = ops.ragged_decode_attention(q, k, v, pt, sl, D ** -0.5, impl=cpp, need_lse=True)
        results[layout] = (pages(k, allb), pages(v, allb), mom, o, lse)
    base = results["cpu_rows"]
    for layout, (k, v, mom, o, lse) in results.items():
        assert torch.equal(k, base[0]) and torch.equal(v, base[1]), layout
        for key in mom:
            torch.testing.assert_close(mom[key], base[2][key], rtol=1e-5, atol=1e-4, msg=f"{layout} {key}")
        torch.testing.assert_close(o.float(), base[3].float(), **tol(dtype))
        torch.testing.assert_close(lse, base[4], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d, g", [(64, 3), (64, 1), (128, 8), (64, 5)])
def test_decode_on_the_amx_packing_at_vllms_block_size(cpp, dtype, d, g):
    """vLLM's AMX packing at block 32, head dims 64 and 128 (16-token key groups inside a page, value token
    pairs; the kernel's bf16 pair path: AMX tiles or AVX-512 for the logits, query groups of 1 to 8, split
    into passes of up to 4), partial pages of odd lengths, moments on: equals the reference. This runs the
    default ISA level; test_cpu_paths.py runs every level this CPU has."""
    from vllm_contour.ops.cpu_layout import PageLayout, cpu_kv_views

    bs, G = 32, g
    kv = torch.randn(NB, H, bs, 2 * d, generator=torch.Generator().manual_seed(8)).to(dtype)
    k, v = cpu_kv_views(kv, PageLayout.amx_bf16(bs, d))
    assert k.dim() == 6 and v.dim() == 6
    for seed in range(3):
        pt, sl = decode_case(seed, NB, H, bs, t_rows=3, long_tail=seed == 0)
        sl = torch.where(sl % 2 == 0, (sl - 1).clamp(min=0), sl)  # odd lengths: a last value pair half used
        q = torch.randn(pt.shape[0], H * G, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
        mom = random_moments(seed, pt.shape[0], H, d) if seed else None
        want_o, want_l = ragged_decode_attention_ref(q, k, v, pt, sl, d ** -0.5, moments=mom)
        got_o, got_l = ops.ragged_decode_attention(q, k, v, pt, sl, d ** -0.5, moments=mom, impl=cpp, need_lse=True)
        torch.testing.assert_close(got_o.float(), want_o.float(), **tol(dtype))
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n", [21, 32 + 7, 64])
def test_decode_on_the_amx_packing_reads_nothing_past_a_rows_length(cpp, n):
    """The slots of a row's last page past its length may hold anything (NaN here, e.g. a freed block's old
    bits): the output is the reference's over the row's tokens, also when the last value pair is half used."""
    from vllm_contour.ops.cpu_layout import PageLayout, cpu_kv_views

    bs, d = 32, 64
    kv = torch.randn(4, H, bs, 2 * d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    layout = PageLayout.amx_bf16(bs, d)
    pages = (n + bs - 1) // bs  # head h reads pages (block i, lane h), i < pages
    pt = torch.stack([torch.arange(pages) * H + h for h in range(H)]).unsqueeze(0)
    sl = torch.full((1, H), n)
    q = torch.randn(1, H * G, d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want_o, _ = ragged_decode_attention_ref(q, *cpu_kv_views(kv.clone(), layout), pt, sl, d ** -0.5)
    k, v = cpu_kv_views(kv, layout)
    for t in range(n - (pages - 1) * bs, bs):  # the last block's slots past the length
        k[pages - 1, :, t // k.shape[3], t % k.shape[3]] = float("nan")
        v[pages - 1, :, t // v.shape[3], t % v.shape[3]] = float("nan")
    got_o, _ = ops.ragged_decode_attention(q, k, v, pt, sl, d ** -0.5, impl=cpp, need_lse=True)
    assert torch.isfinite(want_o).all() and kv.isnan().any() == (n % bs != 0)
    torch.testing.assert_close(got_o.float(), want_o.float(), **tol(torch.bfloat16))


def test_moments_storage_round_trips_on_every_layout():
    from vllm_contour.moments import Moments, pack

    for layout in ("cpu_rows", "cpu_keyT", "cpu_amx"):
        for dtype in DTYPES:
            _, k, v = make_cache(layout, NB, H, BS, D, dtype)
            m = random_moments(1, 1, H, D)
            packed = pack(Moments(m["n"][0], m["sum_k"][0], m["sum_v"][0], m["sum_vk"][0]))
            pages_needed = -(-packed.numel() * 4 // (2 * BS * D * k.element_size()))
            ids = torch.arange(5, 5 + pages_needed)
            ops.store_moments(k, v, ids, packed)
            back = ops.load_moments(k, v, ids, H, D)
            for key in m:
                assert torch.equal(back[key], m[key][0].to(back[key].dtype)), (layout, dtype, key)


def test_clear_pages_zeroes_those_pages_and_nothing_else():
    """Moment pages are zeroed before their blocks go back to vLLM's pool: exactly those head-pages (keys
    and values), on every layout, whatever (NaN-patterned) bits they held."""
    ids = torch.tensor([3, 4, 9])  # head-page p = block p // H, head p % H
    for layout in ("cpu_rows", "cpu_keyT", "cpu_amx"):
        for dtype in DTYPES:
            _, k, v = make_cache(layout, NB, H, BS, D, dtype)
            ops.store_moments(k, v, ids[:1], torch.full((BS * D,), float("nan")))
            before_k, before_v = k.clone(), v.clone()
            ops.clear_pages(k, v, ids)
            hit = torch.zeros(NB, H, dtype=torch.bool)
            hit[ids // H, ids % H] = True
            for got, was in ((k, before_k), (v, before_v)):
                assert torch.equal(got[hit], torch.zeros_like(got[hit])), (layout, dtype)
                assert torch.equal(got[~hit], was[~hit]), (layout, dtype)


# ---------------------------------------------------------------------------------------- dispatch
def test_dispatch_prefers_cpp_on_cpu(cpp):
    for op in ("compact", "accumulate_moments", "ragged_decode_attention"):
        assert ops.available(op, "cpu")[0] == "cpp"
        assert "torch" in ops.available(op, "cpu")
    assert ops.available("ragged_decode_attention", "cpu", moments=True, need_lse=True)[0] == "cpp"


def test_fallback_without_compiled_module():
    """With ``vllm_contour._C`` unimportable (and no JIT) the ops still work on the reference."""
    code = (
        "import sys; sys.modules['vllm_contour._C'] = None\n"
        "import torch; from vllm_contour import ops\n"
        "assert 'cpp' not in ops.available('compact'), ops.available('compact')\n"
        "k = torch.randn(2, 1, 4, 8); v = torch.randn(2, 1, 4, 8); i = torch.tensor([0])\n"
        "ops.compact(k, v, i, i, torch.tensor([1]), i)\n"
        "o, l = ops.ragged_decode_attention(torch.randn(1, 1, 8), k, v, torch.tensor([[[0]]]),\n"
        "                                   torch.tensor([[3]]), 0.3, need_lse=True)\n"
        "assert l is not None\n"
        "print('ok')\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "VLLM_CONTOUR_JIT_EXT"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
