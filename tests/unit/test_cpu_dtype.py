"""The serving dtype by machine: fp32 without bf16 instructions (never measured), bf16 only where it is
measured clearly faster, the answer cached once per environment."""

import json

import torch

from vllm_contour import cpu_dtype


def _measure(times):
    calls = []

    def m(dtype):
        calls.append(dtype)
        return times[dtype]
    return m, calls


def test_avx2_only_is_fp32_without_measuring():
    m, calls = _measure({})
    res = cpu_dtype.choose({"avx2", "fma"}, measure=m)
    assert res["dtype"] == "float32" and "no bf16 instructions" in res["why"] and calls == []


def test_bf16_instructions_pick_bf16_only_when_measured_faster():
    m, _ = _measure({torch.float32: 1.0, torch.bfloat16: 0.3})
    res = cpu_dtype.choose({"avx512f", "avx512_bf16"}, measure=m)
    assert res["dtype"] == "bfloat16" and res["bf16_over_fp32"] == 0.3
    m, _ = _measure({torch.float32: 1.0, torch.bfloat16: 0.95})
    res = cpu_dtype.choose({"amx_bf16", "avx512_bf16"}, measure=m)
    assert res["dtype"] == "float32" and "0.95x" in res["why"]


def test_flags_come_from_cpuinfo(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16 amx_tile\n")
    assert {"avx2", "avx512_bf16", "amx_tile"} <= cpu_dtype.cpu_flags(str(p))
    assert cpu_dtype.cpu_flags(str(tmp_path / "missing")) == set()


def test_answer_is_cached(tmp_path, monkeypatch):
    path = tmp_path / "dtype.json"
    path.write_text(json.dumps({"dtype": "bfloat16", "why": "earlier"}))
    monkeypatch.setattr(cpu_dtype, "choose", lambda: (_ for _ in ()).throw(AssertionError("measured again")))
    assert cpu_dtype.cached_choice(path)["why"] == "earlier"
    path.write_text("not json")
    monkeypatch.setattr(cpu_dtype, "choose", lambda: {"dtype": "float32", "why": "fresh"})
    assert cpu_dtype.cached_choice(path)["dtype"] == "float32"
    assert json.loads(path.read_text())["why"] == "fresh"
