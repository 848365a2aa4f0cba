"""Logical views of vLLM's CPU KV cache ``[num_blocks, H, bs, 2D]``, from one layout description.

Each (block, head) is one contiguous head-page: ``bs*D`` key elements, then ``bs*D`` value elements. Where
element (token t, dim c) sits inside the page depends on the attention ISA and dtype vLLM picks: the
``vec``/``vec16`` kernels store the key page transposed (``c*bs + t``) and values token-major; the ``amx``
kernel (bf16) packs both for its tiles (keys in 16-token groups with pairs of dims interleaved, values
with pairs of tokens interleaved in 16-dim column groups). Every layout vLLM writes is *separable with
two levels*: ``t = t1*tg + t2``, ``c = c1*dg + c2`` and offset ``t1*ts1 + t2*ts2 + c1*cs1 + c2*cs2``.
``PageLayout`` is that description, one ``Split`` for keys and one for values. ``probe_layout`` finds it
by writing known elements with vLLM's own ``cpu_attn_reshape_and_cache`` (once per ISA, dtype, bs, D and
cache dtype: an fp8 cache holds one byte per element in the layout of the model dtype's ISA) and fitting
the splits to where they land; a layout that fits no split is refused with a message.

``cpu_kv_views`` turns a description into strided views: ``[B, H, bs, D]`` when both levels collapse (one
token stride, one dim stride), else ``[B, H, bs/tg, tg, D/dg, dg]``. The torch reference, the C++ kernels
and the evictor read both forms (``ops.paged``); nothing is specific to an ISA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

KEY_ROWS = "rows"
KEY_TRANSPOSED = "transposed"


@dataclass(frozen=True)
class Split:
    """Offsets inside one page half: token t at ``(t // tg) * ts1 + (t % tg) * ts2``, dim c at
    ``(c // dg) * cs1 + (c % dg) * cs2``."""
    tg: int
    ts1: int
    ts2: int
    dg: int
    cs1: int
    cs2: int


@dataclass(frozen=True)
class PageLayout:
    block_size: int
    head_dim: int
    key: Split
    value: Split  # offsets relative to the value half (which starts bs*D elements into the page)
    source: str = "synthetic"  # "vLLM <isa> <dtype>" when probed from vLLM's own cache-write op

    @staticmethod
    def rows(bs: int, d: int, source: str = "synthetic") -> "PageLayout":
        s = Split(bs, 0, d, d, 0, 1)
        return PageLayout(bs, d, s, s, source)

    @staticmethod
    def key_transposed(bs: int, d: int, source: str = "synthetic") -> "PageLayout":
        return PageLayout(bs, d, Split(bs, 0, 1, d, 0, bs), Split(bs, 0, d, d, 0, 1), source)

    @staticmethod
    def amx_bf16(bs: int, d: int, source: str = "synthetic") -> "PageLayout":
        """The formula of vLLM 0.32's AMX bf16 packing (what ``probe_layout`` measured for it): keys in
        16-token groups, dims in interleaved pairs; values in 16-dim column groups, tokens in interleaved
        pairs. Used where the machine's vLLM cannot write that layout."""
        return PageLayout(bs, d, Split(16, 16 * d, 2, 2, 32, 1), Split(2, 32, 1, 16, 16 * bs, 2), source)

    @property
    def flat(self) -> bool:
        """Both halves are plain ``[bs, D]`` strided pages (4-D views)."""
        return all(s.tg == self.block_size and s.dg == self.head_dim for s in (self.key, self.value))


def _of(layout, bs: int, d: int) -> PageLayout:
    if isinstance(layout, PageLayout):
        return layout
    if layout == KEY_ROWS:
        return PageLayout.rows(bs, d)
    if layout == KEY_TRANSPOSED:
        return PageLayout.key_transposed(bs, d)
    raise ValueError(f"unknown key layout {layout!r}")


def cpu_kv_views(kv: torch.Tensor, layout):
    """Key and value views of one layer's cache ``[B, H, bs, 2D]`` (``layout``: a ``PageLayout`` or
    ``KEY_ROWS`` / ``KEY_TRANSPOSED``)."""
    nb, h, bs, two_d = kv.shape
    d = two_d // 2
    if kv.stride(3) != 1 or kv.stride(2) != two_d:
        raise ValueError("expected vLLM's CPU cache layout with contiguous head-pages")
    lay = _of(layout, bs, d)
    s0, s1 = kv.stride(0), kv.stride(1)
    off = kv.storage_offset()
    out = []
    for split, base in ((lay.key, 0), (lay.value, bs * d)):
        if lay.flat:
            out.append(kv.as_strided((nb, h, bs, d), (s0, s1, split.ts2, split.cs2), off + base))
        else:
            out.append(kv.as_strided((nb, h, bs // split.tg, split.tg, d // split.dg, split.dg),
                                     (s0, s1, split.ts1, split.ts2, split.cs1, split.cs2), off + base))
    return out[0], out[1]


def native_page_views(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """``[B*H, 1, bs, D]`` views of the same memory in the form vLLM's CPU kernel takes (it reads the
    page interior in its own layout and only uses the two outer strides)."""
    from .paged import dims

    nb, h, bs, d = dims(key_cache)
    out = []
    for c in (key_cache, value_cache):
        s1 = c.stride(1)
        out.append(c.as_strided((nb * h, 1, bs, d), (s1, s1, d, 1), c.storage_offset()))
    return out[0], out[1]


def _fit_axis(f: list[int], n: int):
    """``f[i] = (i // g) * s1 + (i % g) * s2`` for the largest group g dividing n: (g, s1, s2) or None."""
    for g in sorted((g for g in range(1, n + 1) if n % g == 0), reverse=True):
        s2 = f[1] if n > 1 and g > 1 else 0
        s1 = f[g] if g < n else 0
        if all(f[i] == (i // g) * s1 + (i % g) * s2 for i in range(n)):
            return g, s1, s2
    return None


def fit_split(offsets: torch.Tensor) -> Split | None:
    """The two-level split of a ``[bs, D]`` table of element offsets, or None when it has none."""
    bs, d = offsets.shape
    o = offsets.to(torch.int64)
    if int(o[0, 0]) != 0 or not torch.equal(o, o[:, :1] + o[:1, :]):
        return None
    tok = _fit_axis(o[:, 0].tolist(), bs)
    dim = _fit_axis(o[0, :].tolist(), d)
    if tok is None or dim is None:
        return None
    return Split(tok[0], tok[1], tok[2], dim[0], dim[1], dim[2])


def written_offsets(write, dtype: torch.dtype, block_size: int, head_dim: int, fp8: torch.dtype | None = None):
    """Where ``write(key, value, key_cache, value_cache, slot_mapping)`` puts every element: passes of small
    integers (exact in every float dtype: digits of base 128; of base 8 into an fp8 cache, ``fp8`` its byte
    encoding) encode each element's logical index ``t*D + c``. Returns ``([bs, D] key offsets, [bs, D] value
    offsets)`` inside one head-page (values from the page start), or None when the write does not place each
    element exactly once."""
    bs, d = block_size, head_dim
    n = bs * d
    ids = torch.arange(n)
    base = 8 if fp8 is not None else 128
    passes = 1
    while base ** passes < n:
        passes += 1
    logical = torch.zeros(2 * n, dtype=torch.int64)
    for i in range(passes):
        part = (ids // base ** i) % base
        if fp8 is not None:  # a byte no digit encodes (negative in both encodings) marks what was not written
            kv = torch.full((2, 1, bs, 2 * d), 0xF8, dtype=torch.uint8)
        else:
            kv = torch.full((2, 1, bs, 2 * d), -1.0, dtype=dtype)
        view = kv.view(2, 1, 2 * bs, d)
        x = part.to(torch.float32).view(bs, 1, d).to(dtype)
        write(x, x.clone(), view[:, :, :bs], view[:, :, bs:], torch.arange(bs, 2 * bs))
        got = kv[1, 0].reshape(-1)
        got = got.view(fp8).to(torch.float32) if fp8 is not None else got.to(torch.float32)
        if bool((got < 0).any()):
            return None
        logical += got.to(torch.int64) * base ** i
    out = []
    for half in (logical[:n], logical[n:]):
        if not torch.equal(torch.sort(half).values, ids):
            return None
        inv = torch.empty(n, dtype=torch.int64)
        inv[half] = torch.arange(n)
        out.append(inv.view(bs, d))
    return out[0], out[1] + n


@functools.lru_cache(maxsize=None)
def probe_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int,
                 kv_cache_dtype: str = "auto") -> PageLayout:
    """The layout vLLM's ``cpu_attn_reshape_and_cache`` writes for (isa, dtype, bs, D) into a cache of
    ``kv_cache_dtype`` ("auto": the model dtype; an fp8 name: one byte per element), measured."""
    from .fp8 import FP8_ENCODINGS
    from .vllm_cpu import vllm_op

    fp8 = FP8_ENCODINGS.get(kv_cache_dtype)

    def write(k, v, kc, vc, slots):
        vllm_op("cpu_attn_reshape_and_cache")(k, v, kc, vc, slots, isa, kv_cache_dtype=kv_cache_dtype)

    stored = f" kv_cache_dtype={kv_cache_dtype}" if fp8 is not None else ""
    what = f"isa={isa} dtype={str(dtype).replace('torch.', '')}{stored} block_size={block_size} head_dim={head_dim}"
    advice = _advice(dtype)
    try:
        offs = written_offsets(write, dtype, block_size, head_dim, fp8)
    except Exception as e:  # vLLM refuses the combination itself
        raise RuntimeError(f"kv_eviction: vLLM's CPU cache write fails for {what} ({e}). {advice}") from None
    layout = None
    if offs is not None:
        n = block_size * head_dim
        ks, vs = fit_split(offs[0]), fit_split(offs[1] - n)
        if ks is not None and vs is not None:
            layout = PageLayout(block_size, head_dim, ks, vs,
                                f"vLLM {isa} {str(dtype).replace('torch.', '')}{' ' + kv_cache_dtype if fp8 else ''}")
    if layout is None:
        raise RuntimeError(f"kv_eviction: unknown layout of vLLM's CPU cache for {what}; eviction cannot run "
                           f"on it. {advice}")
    return layout


def _advice(dtype: torch.dtype) -> str:
    other = "" if dtype == torch.float32 else "with --dtype float32 (vLLM's 'vec' layout) or "
    return f"Start the server {other}without --kv-eviction-policy"
