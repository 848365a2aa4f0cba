"""The ops on fp8 KV pages (vLLM's CPU ``--kv-cache-dtype fp8`` / ``fp8_e5m2``: uint8 pages in the model
dtype's layout, each byte read through the layer's table times its scale, ``ops/fp8.py``).

Every byte pattern appears in the caches (NaN / inf patterns included): compaction must move them bit-exactly
(untouched slots too); the ops that read numbers (gather for scoring, moments, ragged decode) must read the
same fp32 values as the torch reference indexing the tables with the bytes. Against vLLM itself: its cache
write lands where the probed fp8 layout says, its kernel reads each byte as ``probe_table`` measured, and the
ragged decode over pages vLLM wrote with scales gives vLLM's own attention output."""

from __future__ import annotations

import pytest
import torch

from vllm_contour import ops
from vllm_contour.ops import cpu_ext
from vllm_contour.ops.cpu_layout import KEY_ROWS, KEY_TRANSPOSED, PageLayout, cpu_kv_views
from vllm_contour.ops.fp8 import FP8_ENCODINGS, KVDequant, KVViews, dequant_of, encoding_table, luts_of
from vllm_contour.ops.paged import gather_pages_ref
from vllm_contour.ops.reference import accumulate_moments_ref, compact_ref, ragged_decode_attention_ref

from .ops_cases import compaction_moves, decode_case, permutation_moves, random_moments, token_list, zero_moments

NB, H, BS, D, G = 24, 3, 32, 64, 3
LAYOUTS = {"cpu_rows": lambda bs, d: KEY_ROWS, "cpu_keyT": lambda bs, d: KEY_TRANSPOSED,
           "cpu_amx": PageLayout.amx_bf16}


@pytest.fixture(scope="module")
def cpp():
    mod = cpu_ext.load(jit=True)
    if mod is None:
        pytest.fail("the C++ extension neither imports nor builds")
    assert cpu_ext._FP8[0], "the loaded C++ module reads no fp8 pages (built before them?)"
    return "cpp"


def _bytes_cache(layout: str, seed: int, every_byte: bool = True):
    """uint8 storage ``[NB, H, BS, 2D]`` and its key / value views: random bytes (every pattern, NaN / inf
    included) or the e4m3 bytes of random numbers (finite, what a cache write of a model's KV gives)."""
    g = torch.Generator().manual_seed(seed)
    if every_byte:
        kv = torch.randint(0, 256, (NB, H, BS, 2 * D), generator=g, dtype=torch.int64).to(torch.uint8)
    else:
        kv = (torch.randn(NB, H, BS, 2 * D, generator=g) * 3).to(torch.float8_e4m3fn).view(torch.uint8)
    return kv, *cpu_kv_views(kv, LAYOUTS[layout](BS, D))


def _dequant(enc: str, k_scale=0.7, v_scale=1.3) -> KVDequant:
    """A layer's tables: the textbook reading of the encoding, NaN / inf read as finite (as vLLM's kernels
    read them, ``probe_table``), times the scales."""
    return KVDequant.of(encoding_table(enc).nan_to_num(0.0, 448.0, -448.0), k_scale, v_scale)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("moves", ["eviction", "permutation"])
def test_compact_moves_fp8_bytes_bit_exactly(cpp, layout, moves):
    for seed in range(3):
        kv, _, _ = _bytes_cache(layout, seed)
        idx = compaction_moves(seed, NB, H, BS) if moves == "eviction" else permutation_moves(seed, NB, H, BS, m=300)
        want, got = kv.clone(), kv.clone()
        compact_ref(*cpu_kv_views(want, LAYOUTS[layout](BS, D)), *idx)
        ops.compact(*cpu_kv_views(got, LAYOUTS[layout](BS, D)), *idx, impl=cpp)
        assert torch.equal(got, want)
        assert not torch.equal(got, kv)  # the moves moved something


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("enc", ["fp8", "fp8_e5m2"])
def test_gather_pages_reads_fp8_numbers_as_the_reference(cpp, layout, enc):
    """Two layers with different tables, ``ids [M]`` and ``[L, M]``: the same fp32 numbers, bit for bit."""
    kv0, k0, v0 = _bytes_cache(layout, 0)
    kv1, k1, v1 = _bytes_cache(layout, 1)
    d0, d1 = _dequant(enc, 0.7, 1.3), _dequant(enc, 2.5, 0.05)
    caches = KVViews([(k0, v0), (k1, v1)], [d0, d1])
    ids = torch.tensor([0, 5, 7, 9, 70, NB * H - 1])
    for side in (0, 1):
        luts = luts_of(caches, side)
        assert torch.equal(luts, torch.stack([(d0, d1)[i].k if side == 0 else (d0, d1)[i].v for i in range(2)]))
        views = [c[side] for c in caches]
        for i in (ids, torch.stack([ids, ids.flip(0)])):
            got = ops.gather_pages(views, i, impl=cpp, luts=luts)
            want = gather_pages_ref(views, i, luts=luts)
            assert got.dtype == torch.float32 and torch.equal(got, want)
    assert dequant_of(caches, 1) is d1 and dequant_of([(k0, v0)], 0) is None


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("enc", ["fp8", "fp8_e5m2"])
def test_accumulate_moments_over_fp8_pages(cpp, layout, enc):
    _, k, v = _bytes_cache(layout, 3)
    dq = _dequant(enc)
    for seed in range(2):
        pg, of, hd = token_list(seed, NB, H, BS, 90, hm=H)
        got = ops.accumulate_moments(k, v, pg, of, hd, zero_moments(H, D, seed=seed), impl=cpp, dequant=dq)
        want = accumulate_moments_ref(k, v, pg, of, hd, zero_moments(H, D, seed=seed), dequant=dq)
        for name in want:
            # sums of products up to e5m2's 57344^2: fp32's summation order, relative to the largest
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5 * float(want[name].abs().max()))
    with pytest.raises(ValueError, match="tables"):  # fp8 bytes are never read as numbers without tables
        accumulate_moments_ref(k, v, pg, of, hd, zero_moments(H, D))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("enc", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_moments", [False, True])
def test_ragged_decode_reads_fp8_pages(cpp, layout, enc, qdtype, with_moments):
    """Decode over ragged page lists of fp8 pages (the e4m3 bytes of real numbers), the query and output in
    the model's dtype, with the moments of evicted tokens or without: the reference's output and lse."""
    _, k, v = _bytes_cache(layout, 4, every_byte=False)
    dq = _dequant(enc, 0.9, 1.1)
    g = torch.Generator().manual_seed(5)
    for seed in range(2):
        pt, sl = decode_case(seed, NB, H, BS, t_rows=4, long_tail=True)
        q = torch.randn(pt.shape[0], H * G, D, generator=g).to(qdtype)
        mom = random_moments(seed, pt.shape[0], H, D) if with_moments else None
        got, lse = ops.ragged_decode_attention(q, k, v, pt, sl, D ** -0.5, impl=cpp, need_lse=True, dequant=dq,
                                               moments=mom)
        want, want_lse = ragged_decode_attention_ref(q, k, v, pt, sl, D ** -0.5, dequant=dq, moments=mom)
        assert got.dtype == qdtype and torch.isfinite(got.float()).all()
        tol = dict(rtol=2e-2, atol=2e-2) if qdtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_fp8_tables_are_required_and_checked(cpp):
    """A uint8 cache without tables, tables on a float cache, a table of the wrong size: errors naming them."""
    _, k, v = _bytes_cache("cpu_rows", 0)
    pt, sl = decode_case(0, NB, H, BS)
    q = torch.randn(pt.shape[0], H * G, D)
    mod = cpu_ext.load()
    with pytest.raises(RuntimeError, match="k_lut"):
        mod.ragged_decode_attention(q, k, v, pt, sl, 0.125)
    fk, fv = k.to(torch.float32), v.to(torch.float32)
    dq = _dequant("fp8")
    with pytest.raises(RuntimeError, match="only for fp8"):
        mod.ragged_decode_attention(q, fk, fv, pt, sl, 0.125, None, None, None, None, dq.k, dq.v)
    with pytest.raises(RuntimeError, match="256"):
        mod.ragged_decode_attention(q, k, v, pt, sl, 0.125, None, None, None, None, dq.k[:128], dq.v)


# ------------------------------------------------------------------------------ against vLLM itself
def _vllm_isa() -> str:
    """The ISA vLLM's CPU attention picks for a bf16 model with an fp8 cache at block 32, head dim 64."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.bfloat16, 32, 64, "fp8")


@pytest.mark.parametrize("enc", ["fp8", "fp8_e5m2"])
def test_vllms_fp8_write_lands_where_the_probed_layout_says(enc):
    """vLLM's own cache write (``kv_cache_dtype`` fp8, with scales) of bf16 keys / values: read through the
    probed layout's views and the measured table times the scales, they are the written numbers to fp8's
    precision, every block, lane and token."""
    from vllm import _custom_ops as vops

    from vllm_contour.ops.cpu_layout import probe_layout
    from vllm_contour.ops.fp8 import probe_table
    from vllm_contour.ops.paged import pages

    isa, bs, d, h, nb = _vllm_isa(), 32, 64, 2, 3
    lay = probe_layout(isa, torch.bfloat16, bs, d, enc)
    assert enc in lay.source
    table = probe_table(isa, torch.bfloat16, enc, bs, d)
    textbook = encoding_table(enc)
    normal = textbook.isfinite() & (textbook.abs() >= 2.0 ** -6) & (textbook.abs() <= 57344.0)
    assert torch.equal(table[normal], textbook[normal])  # the bytes of normal numbers read as their numbers
    n = 2 * bs + 5
    g = torch.Generator().manual_seed(7)
    key = torch.randn(n, h, d, generator=g).to(torch.bfloat16)
    val = (torch.randn(n, h, d, generator=g) * 4).to(torch.bfloat16)
    kv = torch.zeros(nb, h, bs, 2 * d, dtype=torch.uint8)
    view = kv.view(nb, h, 2 * bs, d)
    slots = torch.tensor([bs + i for i in range(bs)] + [2 * bs + i for i in range(bs)] + list(range(5)))
    ks, vs = 0.05, 0.2
    vops.cpu_attn_reshape_and_cache(key, val, view[:, :, :bs], view[:, :, bs:], slots, isa, k_scale=ks, v_scale=vs,
                                    kv_cache_dtype=enc)
    kc, vc = cpu_kv_views(kv, lay)
    dq = KVDequant.of(table, ks, vs)
    order = torch.tensor([1, 2, 0])
    got_k = dq.k[pages(kc, order).to(torch.int64)].permute(0, 2, 1, 3).reshape(nb * bs, h, d)[:n]
    got_v = dq.v[pages(vc, order).to(torch.int64)].permute(0, 2, 1, 3).reshape(nb * bs, h, d)[:n]
    # vLLM writes x / scale rounded toward zero (not to nearest): within one step of fp8's grid, never above;
    # its AMX kernel reads subnormal bytes as 0 (probe_table), so below the smallest normal it may read 0
    mant, sub = (3, 2.0 ** -6) if enc == "fp8" else (2, 2.0 ** -14)  # mantissa bits, the smallest normal
    for got, x, s in ((got_k, key.float(), ks), (got_v, val.float(), vs)):
        step = torch.maximum(x.abs() * 2.0 ** -mant, torch.full_like(x, sub * s))
        assert bool(((got - x).abs() <= step).all()), (got - x).abs().max()
        assert bool((got.abs() <= x.abs() * (1 + 1e-6)).all())
    f8 = FP8_ENCODINGS[enc]
    nearest = (val.float() / vs).to(f8).float() * vs  # torch's rounding: at most one step away
    assert ((got_v - nearest).abs() <= torch.maximum(val.float().abs() * 2.0 ** -mant,
                                                      torch.full_like(nearest, sub * vs))).all()


@pytest.mark.parametrize("enc", ["fp8", "fp8_e5m2"])
def test_ragged_decode_equals_vllms_attention_over_the_pages_vllm_wrote(cpp, enc):
    """Pages vLLM wrote (fp8, with scales): the plugin's ragged decode (each request's pages as one dense
    list per head, the layer's tables) gives vLLM's own ``cpu_attention_with_kv_cache`` output."""
    from vllm import _custom_ops as vops

    from vllm_contour.ops.cpu_layout import probe_layout
    from vllm_contour.ops.fp8 import probe_table

    isa, bs, d, h, g = _vllm_isa(), 32, 64, 3, 3
    lay = probe_layout(isa, torch.bfloat16, bs, d, enc)
    lens = [70, 33, 96]
    nb = sum(-(-n // bs) for n in lens) + 1
    gen = torch.Generator().manual_seed(11)
    kv = torch.zeros(nb, h, bs, 2 * d, dtype=torch.uint8)
    view = kv.view(nb, h, 2 * bs, d)
    ks, vs = 0.08, 0.3
    tables, nxt = [], 1
    for n in lens:
        blocks = list(range(nxt, nxt + -(-n // bs)))
        nxt += len(blocks)
        tables.append(blocks)
        key = torch.randn(n, h, d, generator=gen).to(torch.bfloat16)
        val = torch.randn(n, h, d, generator=gen).to(torch.bfloat16)
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(n)])
        vops.cpu_attn_reshape_and_cache(key, val, view[:, :, :bs], view[:, :, bs:], slots, isa, k_scale=ks,
                                        v_scale=vs, kv_cache_dtype=enc)
    r = len(lens)
    q = torch.randn(r, h * g, d, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.arange(r + 1, dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    md = vops.cpu_attn_get_scheduler_metadata(
        num_reqs=r, num_heads=h * g, num_kv_heads=h, head_dim=d, seq_lens=sl, dtype=torch.bfloat16,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        kv_cache_dtype=enc)
    if isa == "amx":
        torch.cpu._init_amx()
    vops.cpu_attention_with_kv_cache(
        query=q, key_cache=view[:, :, :bs], value_cache=view[:, :, bs:], output=out, query_start_loc=qsl,
        seq_lens=sl, scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt,
        softcap=0.0, scheduler_metadata=md, s_aux=None, k_scale=ks, v_scale=vs, kv_cache_dtype=enc)
    kc, vc = cpu_kv_views(kv, lay)
    dq = KVDequant.of(probe_table(isa, torch.bfloat16, enc, bs, d), ks, vs)
    pt = (bt.to(torch.int64).view(r, 1, width) * h + torch.arange(h).view(1, h, 1)).to(torch.int32)
    got, _ = ops.ragged_decode_attention(q, kc, vc, pt, sl.view(r, 1).expand(r, h).contiguous(), d ** -0.5,
                                         impl=cpp, dequant=dq)
    ref, _ = ragged_decode_attention_ref(q, kc, vc, pt, sl.view(r, 1).expand(r, h), d ** -0.5, dequant=dq)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(got.float(), out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ref.float(), out.float(), rtol=2e-2, atol=2e-2)
