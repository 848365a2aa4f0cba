"""The C++ kernels at every ISA level (``csrc/contour.h``): ``generic`` (x86-64-v2), ``avx2``, ``avx512``,
``avx512_bf16`` and ``amx``.

Every level is compiled into the module whatever machine built it: the module's baseline is portable and each
level's instructions live in its own functions (read back from the module's disassembly). Every level this CPU
runs is forced in this process (``cpu_ext.forced_isa``, i.e. ``torch.ops.vllm_contour.set_cpu_isa``) and gives
the torch reference's results, and its own bits (its own kernels ran); a level the CPU lacks is skipped with the
instructions it lacks. Without a forced level the ops run the best level the CPU has, at most
``VLLM_CONTOUR_CPU_ISA`` (``VLLM_CONTOUR_NO_AMX=1``: at most avx512_bf16)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from vllm_contour import ops
from vllm_contour.ops import cpu_ext
from vllm_contour.ops.paged import gather_pages_ref
from vllm_contour.ops.reference import accumulate_moments_ref, compact_ref, ragged_decode_attention_ref

from .ops_cases import (DTYPES, LAYOUTS, compaction_moves, decode_case, make_cache, permutation_moves,
                        random_moments, token_list, tol, views_of, zero_moments)

LEVELS = list(cpu_ext.LEVELS)
NB, H, BS, D, G = 24, 3, 16, 32, 3


@pytest.fixture(scope="session")
def cpp():
    if cpu_ext.load(jit=True) is None:
        pytest.fail("the C++ extension neither imports nor builds")
    assert hasattr(torch.ops.vllm_contour, "cpu_isa"), \
        "vllm_contour._C predates csrc/ (no cpu_isa op): rebuild it (bash scripts/setup.sh)"
    return "cpp"


def _at(level: str, record_property):
    """Force ``level`` (skipped, naming what the CPU lacks, where it cannot run)."""
    lacks = cpu_ext.missing(level)
    if lacks:
        pytest.skip(f"this CPU lacks {lacks} (ISA level {level})")
    record_property("cpu_isa", level)
    return cpu_ext.forced_isa(level)


# -------------------------------------------------------------------------------------- compiled levels
def test_module_exposes_every_level_on_a_portable_baseline(cpp):
    assert cpu_ext.isas() == LEVELS
    assert cpu_ext.LIBRARY, "the kernels' library path is unknown"
    # -march=native (or any v3/v4 flags) would let the compiler put AVX anywhere: the module would not load
    # on an older machine, and the levels below the build machine's would not be what they say
    assert torch.ops.vllm_contour.cpu_baseline() in ("x86-64", "x86-64-v2"), \
        f"{cpu_ext.LIBRARY} was built for {torch.ops.vllm_contour.cpu_baseline()} (VLLM_CONTOUR_CPU_ARCH?)"


def _instructions_by_level(lib: str) -> dict[str, list[str]]:
    """The module's disassembly, instruction lines grouped by the level of the function that holds them
    (``contour::isa_<level>::``; "front" for the op front end, ``contour::`` outside the levels)."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, which built the module) is needed to read the module's instructions"
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", lib], capture_output=True, text=True,
                          check=True, timeout=120).stdout
    by, cur = defaultdict(list), None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            m = re.search(r"\bcontour::isa_(avx512_bf16|avx512|avx2|generic)::", head.group(1))
            cur = m.group(1) if m else ("front" if "contour::" in head.group(1) else None)
            by[cur].append(head.group(1))  # function names first, then instructions (tab-separated)
        elif cur and "\t" in line:
            by[cur].append(line)
    return by


def test_every_level_is_compiled_into_the_module(cpp):
    """The instructions of each level are in the module whatever machine built it: the generic kernels and
    the front end use no 256/512-bit registers (baseline code), the avx2 kernels 256-bit FMAs and F16C
    conversions and no 512-bit registers, the avx512 kernels 512-bit registers and no bf16 / AMX
    instructions, the avx512_bf16 kernels VDPBF16PS and the amx level's tile instructions; every level has
    the four ops' entry points."""
    by = _instructions_by_level(cpu_ext.LIBRARY)
    text = {k: "\n".join(v) for k, v in by.items()}
    for level in ("generic", "avx2", "avx512"):
        for entry in ("compact(", "gather(", "accumulate(", "decode("):
            assert f"contour::isa_{level}::(anonymous namespace)::{entry}" in text.get(level, ""), (level, entry)
    assert "contour::isa_avx512_bf16::(anonymous namespace)::decode(" in text.get("avx512_bf16", "")
    for level in ("front", "generic"):
        assert by[level] and not re.search(r"%[yz]mm", text[level]), level
    assert "%ymm" in text["avx2"] and "vfmadd" in text["avx2"] and "vcvtph2ps" in text["avx2"]
    assert "%zmm" not in text["avx2"]
    assert "%zmm" in text["avx512"] and not re.search(r"vdpbf16ps|tdpbf16ps|ldtilecfg", text["avx512"])
    for ins in ("vdpbf16ps", "ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"):
        assert ins in text["avx512_bf16"], ins


# ------------------------------------------------------------------------------------ levels that run
# what each level needs, as GCC's __builtin_cpu_supports (csrc/contour_ops.cpp) and Linux's /proc/cpuinfo name it
_NEEDS = {"avx2": {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm",
                   "movbe": "movbe"},
          "avx512": {f"avx512{x}": f"avx512{x}" for x in ("f", "bw", "vl", "dq", "cd")},
          "avx512_bf16": {"avx512bf16": "avx512_bf16"},
          "amx": {"amx-tile": "amx_tile", "amx-bf16": "amx_bf16"}}


def test_levels_follow_the_cpu_flags_linux_reports(cpp):
    """What the module finds missing for each level is what /proc/cpuinfo's flags lack (an oracle of its own:
    Linux lists only what the CPU has and the kernel enabled); with AMX's flags present only Linux's refusal
    of the tile data (arch_prctl) may keep the amx level off."""
    flags = next(ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
    want = []
    for level in LEVELS:
        want += [gcc for gcc, linux in _NEEDS.get(level, {}).items() if linux not in flags]
        got = cpu_ext.missing(level)
        if level == "amx" and not want and got:
            assert got.startswith("amx-tile data (Linux refused arch_prctl"), got
        else:
            assert got.split() == want, (level, got, want)


def test_default_level_is_the_best_the_cpu_runs_within_the_env_caps(cpp, monkeypatch):
    """``set_cpu_isa("auto")`` (like the first op) reads the caps: none, a level, ``VLLM_CONTOUR_NO_AMX=1``;
    an unknown level name fails, and so does forcing a level the CPU lacks."""
    runs = [lv for lv in LEVELS if not cpu_ext.missing(lv)]
    assert runs[0] == "generic" and runs == LEVELS[:len(runs)]  # each level needs the one below it
    before = cpu_ext.isa()
    try:
        for env, cap in (({}, "amx"), ({"VLLM_CONTOUR_CPU_ISA": "avx2"}, "avx2"),
                         ({"VLLM_CONTOUR_CPU_ISA": "auto"}, "amx"), ({"VLLM_CONTOUR_NO_AMX": "1"}, "avx512_bf16"),
                         ({"VLLM_CONTOUR_CPU_ISA": "avx512", "VLLM_CONTOUR_NO_AMX": "1"}, "avx512")):
            monkeypatch.delenv("VLLM_CONTOUR_CPU_ISA", raising=False)
            monkeypatch.delenv("VLLM_CONTOUR_NO_AMX", raising=False)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            cpu_ext.set_isa("auto")
            want = [lv for lv in runs if LEVELS.index(lv) <= LEVELS.index(cap)][-1]
            assert cpu_ext.isa() == want, env
        monkeypatch.setenv("VLLM_CONTOUR_CPU_ISA", "avx3")
        with pytest.raises(RuntimeError, match="unknown CPU ISA level 'avx3'"):
            cpu_ext.set_isa("auto")
        with pytest.raises(RuntimeError, match="unknown CPU ISA level 'sse'"):
            cpu_ext.set_isa("sse")
        for lv in LEVELS[len(runs):]:
            with pytest.raises(RuntimeError, match="needs what this CPU lacks"):
                cpu_ext.set_isa(lv)
    finally:
        cpu_ext.set_isa(before)


@functools.lru_cache(maxsize=None)
def _decode_cases() -> list:
    """Every layout and dtype (query in the cache's dtype and fp32), moments off and on, with the reference's
    output (computed once for every level)."""
    cases = []
    for layout in LAYOUTS:
        for dtype in DTYPES:
            _, k, v = make_cache(layout, NB, H, 32, D, dtype, seed=7)
            pt, sl = decode_case(1, NB, H, 32, t_rows=3, long_tail=True)
            for qdt in dict.fromkeys((dtype, torch.float32)):
                q = torch.randn(pt.shape[0], H * G, D, generator=torch.Generator().manual_seed(1)).to(qdt)
                for mom in (None, random_moments(1, pt.shape[0], H, D)):
                    want = ragged_decode_attention_ref(q, k, v, pt, sl, D ** -0.5, moments=mom)
                    cases.append(((layout, dtype, qdt, mom is None), (q, k, v, pt, sl, D ** -0.5, mom), want,
                                  tol(dtype)))
    return cases


def _amx_packing(bs: int, d: int, seed: int = 8):
    from vllm_contour.ops.cpu_layout import PageLayout, cpu_kv_views

    kv = torch.randn(NB, H, bs, 2 * d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return kv, PageLayout.amx_bf16(bs, d), cpu_kv_views


@functools.lru_cache(maxsize=None)
def _amx_packing_cases() -> list:
    """vLLM's AMX bf16 packing at block 32, head dims 64 and 128, query groups of 1 to 8, bf16 and fp32
    queries, odd lengths, moments on and off, with the reference's output; then a row whose last page holds
    NaN past its 7 tokens (a half-used value pair), with the output of the same row without the NaN."""
    cases = []
    for d, g in ((64, 1), (64, 3), (128, 8), (64, 5)):
        kv, layout, views = _amx_packing(32, d)
        k, v = views(kv, layout)
        for seed in range(2):
            pt, sl = decode_case(seed, NB, H, 32, t_rows=3, long_tail=seed == 0)
            sl = torch.where(sl % 2 == 0, (sl - 1).clamp(min=0), sl)
            for qdt in (torch.bfloat16, torch.float32):
                q = torch.randn(pt.shape[0], H * g, d, generator=torch.Generator().manual_seed(seed)).to(qdt)
                mom = random_moments(seed, pt.shape[0], H, d) if seed else None
                want = ragged_decode_attention_ref(q, k, v, pt, sl, d ** -0.5, moments=mom)
                cases.append(((d, g, seed, qdt), (q, k, v, pt, sl, d ** -0.5, mom), want, tol(torch.bfloat16)))
    n, d = 32 + 7, 64
    kv, layout, views = _amx_packing(32, d, seed=3)
    pt = torch.stack([torch.arange(2) * H + h for h in range(H)]).unsqueeze(0)
    sl = torch.full((1, H), n)
    q = torch.randn(1, H * G, d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = ragged_decode_attention_ref(q, *views(kv.clone(), layout), pt, sl, d ** -0.5)
    k, v = views(kv, layout)
    for t in range(n - 32, 32):
        k[1, :, t // k.shape[3], t % k.shape[3]] = float("nan")
        v[1, :, t // v.shape[3], t % v.shape[3]] = float("nan")
    assert kv.isnan().any() and torch.isfinite(want[0]).all()
    cases.append((("nan past the length",), (q, k, v, pt, sl, d ** -0.5, None), (want[0], None),
                  tol(torch.bfloat16)))
    return cases


def _check(cases, cpp):
    for name, (q, k, v, pt, sl, scale, mom), (want_o, want_l), t in cases:
        got_o, got_l = ops.ragged_decode_attention(q, k, v, pt, sl, scale, moments=mom, impl=cpp, need_lse=True)
        assert got_o.dtype == q.dtype, name
        torch.testing.assert_close(got_o.float(), want_o.float(), **t, msg=lambda m: f"{name}: {m}")
        if want_l is not None:
            torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("level", LEVELS)
def test_decode_at_each_level(cpp, level, record_property):
    """Every layout and dtype: the reference; the decode path names the level (vLLM's vec pages: avx512 at
    and above it)."""
    cases = _decode_cases()
    with _at(level, record_property):
        o = torch.ops.vllm_contour
        assert cpu_ext.isa() == level and o.decode_path("amx") == level
        assert o.decode_path("vec") == LEVELS[min(LEVELS.index(level), LEVELS.index("avx512"))]
        _check(cases, cpp)


@pytest.mark.parametrize("level", LEVELS)
def test_amx_packing_decode_at_each_level(cpp, level, record_property):
    """vLLM's AMX packing (the pair paths: AMX tiles, VDPBF16PS or fp32 FMAs from registers at avx512 and
    above; unpacked pages below): the reference, and NaN past a row's length is never read."""
    cases = _amx_packing_cases()
    with _at(level, record_property):
        _check(cases, cpp)


@functools.lru_cache(maxsize=None)
def _page_op_cases() -> tuple[list, list, list]:
    """Compactions (eviction and permutation moves on every layout and dtype; runs of moves in one column
    window on pages of 64 tokens), gathers and moments, with the reference's results (computed once)."""
    compactions, gathers, moments = [], [], []
    for layout in LAYOUTS:
        for dtype in DTYPES:
            kv, k, v = make_cache(layout, NB, H, BS, D, dtype, seed=2)
            for idx in (compaction_moves(2, NB, H, BS), permutation_moves(2, NB, H, BS, m=200)):
                want = kv.clone()
                compact_ref(*views_of(layout, want, D), *idx)
                compactions.append(((layout, dtype), kv, D, idx, want))
            ids = torch.tensor([[4, 0, NB * H - 1], [1, 1, 7]])
            gathers.append(((layout, dtype), [k, v], ids, gather_pages_ref([k, v], ids)))
            tokens = token_list(3, NB, H, BS, 90, hm=H)
            moments.append(((layout, dtype), k, v, tokens,
                            accumulate_moments_ref(k, v, *tokens, zero_moments(H, D, 1))))
    for layout in ("cpu_keyT", "cpu_amx"):
        kv, _, _ = make_cache(layout, 10, H, 64, 64, torch.bfloat16, seed=5)
        idx = compaction_moves(5, 10, H, 64, blocks=8)
        want = kv.clone()
        compact_ref(*views_of(layout, want, 64), *idx)
        compactions.append(((layout, "bs64"), kv, 64, idx, want))
    return compactions, gathers, moments


@pytest.mark.parametrize("level", LEVELS)
def test_compact_gather_and_moments_at_each_level(cpp, level, record_property):
    """Compaction and gathers equal the reference bit for bit, moments within fp32 rounding."""
    compactions, gathers, moments = _page_op_cases()
    with _at(level, record_property):
        for name, kv, d, idx, want in compactions:
            got = kv.clone()
            ops.compact(*views_of(name[0], got, d), *idx, impl=cpp)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        for name, views, ids, want in gathers:
            assert torch.equal(ops.gather_pages(views, ids, impl=cpp), want), name
        for name, k, v, tokens, want in moments:
            got = ops.accumulate_moments(k, v, *tokens, zero_moments(H, D, 1), impl=cpp)
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_forced_levels_run_their_own_kernels(cpp):
    """A forced level is not a label: on the same AMX-packed bf16 decode (bf16 queries, head dim 128, groups
    of 8) every level this CPU runs gives other fp32 log-sum-exps than every other level (AMX tile sums,
    VDPBF16PS pair sums, fp32 FMAs in 16 lanes, 8 lanes, no FMA: each rounds its own way)."""
    runs = [lv for lv in LEVELS if not cpu_ext.missing(lv)]
    if len(runs) < 2:
        pytest.skip(f"this CPU runs only {runs[0]}: it lacks {cpu_ext.missing('avx2')} (ISA level avx2)")
    kv, layout, views = _amx_packing(32, 128)
    k, v = views(kv, layout)
    cases = []
    for seed in range(2):
        pt, sl = decode_case(seed, NB, H, 32, t_rows=3, long_tail=True)
        q = torch.randn(pt.shape[0], H * 8, 128, generator=torch.Generator().manual_seed(seed)).bfloat16()
        cases.append((q, pt, sl))
    lse, before = {}, cpu_ext.isa()
    for level in reversed(runs):  # the default (best) level first: the block must give it back at the end
        with cpu_ext.forced_isa(level):
            lse[level] = [ops.ragged_decode_attention(q, k, v, pt, sl, 128 ** -0.5, impl=cpp, need_lse=True)[1]
                          for q, pt, sl in cases]
    assert cpu_ext.isa() == before  # forced_isa gives the level back
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            assert any(not torch.equal(x, y) for x, y in zip(lse[a], lse[b])), (a, b)


# ------------------------------------------------------------------------------------------ the summary
def test_summary_names_the_kernels_level_and_every_skip(cpp, tmp_path):
    """tests/conftest.py's summary (a child pytest with it as a plugin): the level and decode path the run's
    ops ran at, and each skipped test on a line of its own with its reason (``-rs`` folds the two
    parametrised skips of one place into one line)."""
    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "test_summary_probe.py").write_text(
        "import pytest\n"
        "from vllm_contour.ops import cpu_ext\n"
        "def test_loads():\n"
        "    assert cpu_ext.load(jit=True) is not None\n"
        "def test_skips():\n"
        "    pytest.skip('this CPU lacks amx-tile')\n"
        "@pytest.mark.skipif(True, reason='marked off')\n"
        "def test_marked():\n"
        "    pass\n"
        "@pytest.mark.parametrize('i', [1, 2])\n"
        "def test_twice(i):\n"
        "    pytest.skip('one place')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "tests.conftest",
                        str(tmp_path / "test_summary_probe.py")], capture_output=True, text=True, cwd=repo,
                       timeout=300)
    out = r.stdout
    assert r.returncode == 0 and "1 passed, 4 skipped" in out, out[-3000:] + r.stderr[-2000:]
    assert f"main run at ISA level {cpu_ext.isa()} (decode path: AMX pages " in out, out[-3000:]
    assert "skipped: 4" in out, out[-3000:]
    probe = "test_summary_probe.py::"
    for line in (f"{probe}test_skips: this CPU lacks amx-tile", f"{probe}test_marked: marked off",
                 f"{probe}test_twice[1]: one place", f"{probe}test_twice[2]: one place"):
        assert any(ln.startswith("SKIPPED ") and ln.endswith(line) for ln in out.splitlines()), (line, out[-3000:])
