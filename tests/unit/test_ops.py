"""Every CPU implementation of the three ops equals the torch reference: random ragged layouts (lane
borrowing, empty runs, partial last pages, long tails), fp32 / fp16 / bf16, strided caches in vLLM's CPU
layout (key rows or transposed key pages) and in a token-interleaved layout, fused moments.

The C++ kernels come from the installed ``vllm_contour._C``, else they are JIT-compiled once into
``build/jit_ext`` (cached across sessions)."""

from __future__ import annotations

import subprocess
import sys

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

    from vllm_contour.ops.cpu_layout import cpu_kv_views, detect_key_layout

    bs, d = 32, 64
    for dtype in (torch.float32, torch.bfloat16):
        layout = detect_key_layout(_get_attn_isa(dtype, bs, d), dtype, bs, d)
        kv = torch.randn(NB, H, bs, 2 * d).to(dtype)
        k, v = cpu_kv_views(kv, layout)
        pt, sl = decode_case(6, NB, H, bs, t_rows=3, long_tail=True)
        q = torch.randn(3, H * G, d).to(dtype)
        want, _ = ragged_decode_attention_ref(q, k, v, pt, sl, d ** -0.5)
        for impl in ("vllm_cpu", "cpp"):
            got, _ = ops.ragged_decode_attention(q, k, v, pt, sl, d ** -0.5, impl=impl, native=True)
            torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


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
