"""The GPU engine bundle's logic (scripts/gpu_bundle.py) and benchmarks/gpu_engine.py's JSON, on small synthetic
inputs. The full proof, ``bash scripts/gpu_bundle.sh --check-on-cpu`` (a torch 2.11 venv and two dry runs under
Triton's interpreter, about 10 minutes on 2 cores), is too slow for the suite."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load_bundle():
    spec = importlib.util.spec_from_file_location("gpu_bundle", REPO / "scripts" / "gpu_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gb = _load_bundle()


def test_module_imports_top_level_lazy_relative_and_type_checking():
    src = """
import os
from . import sib
from .pkg import thing
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from vllm.heavy import Only
try:
    import vllm.optional
except ImportError:
    pass
class C:
    from vllm.in_class import x
def f():
    from vllm.lazy import y
    import vllm.lazy2
"""
    top, lazy = gb.module_imports(src, "vllm.a.b", is_package=False)
    assert {"os", "vllm.a", "vllm.a.sib", "vllm.a.pkg", "vllm.a.pkg.thing", "vllm.optional",
            "vllm.in_class", "vllm.in_class.x"} <= top
    assert not any(n.startswith("vllm.heavy") for n in top | lazy)
    assert {"vllm.lazy", "vllm.lazy.y", "vllm.lazy2"} <= lazy
    assert "vllm.lazy" not in top
    top, _ = gb.module_imports("from .x import z\n", "vllm.a", is_package=True)
    assert "vllm.a.x" in top


def test_plan_keeps_what_kept_modules_import_at_module_level():
    files = {
        "vllm/__init__.py": b"from vllm.core import run\n",
        "vllm/core.py": b"import vllm.models.llama\ndef f():\n    import vllm.models.other\n",
        "vllm/models/__init__.py": b"",
        "vllm/models/llama.py": b"from vllm.models.shared import util\n",
        "vllm/models/shared.py": b"",
        "vllm/models/other.py": b"import vllm.models.other_dep\n",
        "vllm/models/other_dep.py": b"",
        "vllm/models/tables/big.json": b"{}",
        "vllm/core.jpg": b"x",
    }
    p = gb.plan(files, prune={"vllm/models/*": "models", "*.jpg": "images"}, keep=("vllm/models/llama.py",))
    assert set(p["pruned"]) == {"vllm/models/other.py", "vllm/models/other_dep.py", "vllm/models/tables/big.json",
                                "vllm/core.jpg"}
    # a candidate a kept module imports (and the package above it) stays
    assert {"vllm/models/shared.py", "vllm/models/__init__.py"} <= set(p["kept"])
    assert set(p["rescued"]) == {"vllm/models/__init__.py", "vllm/models/shared.py"}
    assert p["lazy"] == ["vllm/core.py -> vllm.models.other"]
    assert set(p["kept"]) | set(p["pruned"]) == set(files)


def test_prune_patterns_spare_the_engine_path():
    must_keep = ["vllm/platforms/cuda.py", "vllm/platforms/cpu.py", "vllm/platforms/interface.py",
                 "vllm/v1/attention/backends/triton_attn.py", "vllm/v1/attention/ops/triton_unified_attention.py",
                 "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu_worker.py", "vllm/v1/worker/cpu_worker.py",
                 "vllm/compilation/cuda_graph.py", "vllm/entrypoints/llm.py", "vllm/model_executor/models/llama.py",
                 "vllm/model_executor/models/registry.py", "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
                 "vllm/model_executor/layers/activation.py", "vllm/triton_utils/importing.py"]
    import fnmatch

    for p in must_keep:
        hit = [pat for pat in gb.PRUNE if fnmatch.fnmatch(p, pat)]
        assert not hit or p in gb.KEEP, (p, hit)


def test_wheel_files_refuses_a_patched_install(tmp_path):
    sp = tmp_path / "site"
    (sp / "vllm").mkdir(parents=True)
    (sp / gb.VLLM_DIST).mkdir()
    good = b"print('hi')\n"
    (sp / "vllm" / "a.py").write_bytes(good)
    (sp / "vllm" / "_C.abi3.so").write_bytes(b"\0")
    h = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(good).digest()).rstrip(b"=").decode()
    (sp / gb.VLLM_DIST / "RECORD").write_text(f"vllm/a.py,{h},12\nvllm/_C.abi3.so,sha256=x,1\n"
                                              "vllm/__pycache__/a.pyc,,\n")
    assert gb.wheel_files(sp) == {"vllm/a.py": h}  # no compiled library, no bytecode
    (sp / "vllm" / "a.py").write_bytes(b"print('patched')\n")
    with pytest.raises(SystemExit, match="differ"):
        gb.wheel_files(sp)


def test_wheels_and_check_venv_are_pinned_and_the_check_venv_is_the_device_image():
    assert all(v and v[0].isdigit() for v in gb.WHEELS.values())
    names = {n.split("==")[0] for n in gb.CHECK_VENV}
    assert "torch==2.11.0" in gb.CHECK_VENV and "triton==3.6.0" in gb.CHECK_VENV
    assert names <= gb.DEVICE_IMAGE  # the check venv stands for the device: nothing from outside its image
    # what travels is what the image lacks, except typing-extensions (version unrecorded there)
    assert {n for n in gb.WHEELS if n in gb.DEVICE_IMAGE} == {"typing-extensions", "annotated-doc"}


def _engine(tokens, held_c=None, tp=None, modules=None, standins=(), plugin=False):
    g = {"s" if not plugin else "off": {"tokens": tokens}}
    if plugin:
        g["above"] = {"tokens": tokens}
        g["c"] = {"tokens": [[1, 2]], "held": held_c, "prompt_lengths": [200]}
    else:
        g["sc"] = {"tokens": [[1, 2]], "held": [{"sc0": 8}]}
    return {"greedy": g, "throughput": tp or {}, "modules": modules or {}, "compiled_op_standins": list(standins),
            "wall_s": 1.0, **({"ops_calls": {"compacted_attention:triton": 3}} if plugin else {})}


def _dry_result(site="/b/site", torch_v="2.11.0+cu130", held=None):
    from benchmarks.gpu_engine import DRY, summarise

    held = held or [{"c0": 7}, {"c0": 3}, {"c0": 4}]
    mods = {"vllm": f"{site}/vllm/__init__.py", "vllm_contour": f"{site}/vllm_contour/__init__.py"}
    res = {"env": {"torch": torch_v}, "kernel": {"ok": True},
           "stock": _engine([[5, 6]], tp={"output_tok_s": 10.0, "mean_running": 2.0, "tpot_ms_p50": 4.0},
                            modules=mods),
           "snapkv": _engine([[5, 6]], held_c=held, plugin=True, modules=mods,
                             tp={"output_tok_s": 25.0, "mean_running": 6.0, "tpot_ms_p50": 3.0})}
    summarise(res, dict(DRY))
    return res


def test_summarise_writes_the_documented_keys():
    res = _dry_result()
    assert res["tokens_equal_eviction_off"] is True and res["tokens_equal_budget_above_prompt"] is True
    assert res["throughput_ratio"] == pytest.approx(2.5) and res["running_ratio"] == pytest.approx(3.0)
    assert res["tpot_p50_ratio"] == pytest.approx(0.75)
    c = res["compacting"]
    assert c["bound_blocks"] == 4  # budget 64 + interval 32 at block 32, SnapKV's 32 window queries (fp32)
    assert c["peak_held_after_compaction"] == {"c0": 4} and c["held_within_bound"] is True
    assert res["compacted_attention_triton_calls"] == 3
    over = _dry_result(held=[{"c0": 7}, {"c0": 3}, {"c0": 5}])
    assert over["compacting"]["held_within_bound"] is False


def test_compare_and_check_dry_run_verdict(tmp_path):
    from benchmarks.gpu_engine import compare

    a, b = _dry_result(site="/p"), _dry_result()
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    cmp = compare(pa, pb)
    assert cmp["all_equal"] and cmp["snapkv.c.held"]
    v = gb.check_dry_run(a, b, "/b/site", cmp)
    assert v["ok"] and v["bundle_modules_from_bundle"]
    assert not gb.check_dry_run(a, b, "/elsewhere", cmp)["ok"]  # vLLM must come from the unpacked bundle
    assert not gb.check_dry_run(a, _dry_result(torch_v="2.13.0"), "/b/site", cmp)["ok"]
    b["snapkv"]["greedy"]["c"]["tokens"] = [[1, 3]]
    pb.write_text(json.dumps(b))
    cmp = compare(pa, pb)
    assert not cmp["all_equal"] and not cmp["snapkv.c"]
    assert not gb.check_dry_run(a, b, "/b/site", cmp)["ok"]


def test_weak_ref_standin_shares_memory_without_owning_it():
    from benchmarks.gpu_engine import weak_ref_tensor

    t = torch.arange(12.0).view(3, 4)[1:]
    w = weak_ref_tensor(t)
    assert w.data_ptr() == t.data_ptr() and w.shape == t.shape and w.stride() == t.stride()
    t[0, 1] = 42.0
    assert w[0, 1].item() == 42.0
    uses = torch._C._storage_Use_Count
    before = uses(t.untyped_storage()._cdata)
    alive = [weak_ref_tensor(t)]  # kept while counted
    assert uses(t.untyped_storage()._cdata) == before  # no new owner of t's storage
    alive.append(t.view(-1))  # a real view is one
    assert uses(t.untyped_storage()._cdata) == before + 1


def test_seeded_model_is_deterministic(tmp_path, monkeypatch):
    import benchmarks.gpu_engine as ge

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "source_config.json").write_text(json.dumps({"vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2}))
    (tok / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(ge, "tokenizer_dir", lambda: tok)
    monkeypatch.setitem(ge.SHAPES, "micro", dict(layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, inter=32,
                                                 std=0.02))
    a = ge.make_model(tmp_path / "a", "micro", dtype="float32")
    b = ge.make_model(tmp_path / "b", "micro", dtype="float32")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["vocab_size"] == 64 and cfg["num_key_value_heads"] == 1 and (a / "tokenizer.json").exists()


def test_every_module_the_plugin_hooks_into_is_kept():
    import fnmatch

    paths = gb.hook_paths()
    assert "vllm/entrypoints/cli/main.py" in paths  # the vllm-contour command's hook, under a pruned folder
    files = {p: b"" for p in paths}
    files.update({"vllm/__init__.py": b"", "vllm/entrypoints/__init__.py": b"", "vllm/entrypoints/cli/__init__.py": b""})
    kept = set(gb.plan(files, keep=gb.KEEP + paths)["kept"])
    assert all(p in kept for p in paths if any(fnmatch.fnmatch(p, pat) for pat in gb.PRUNE))


def test_module_level_op_refs_and_their_schemas():
    src = b"""
import torch
A = torch.ops._C.rotary_embedding.default
if hasattr(torch.ops._C, "maybe_op"):
    B = torch.ops._C.maybe_op.default
class K:
    C = torch.ops._C.in_class.default
def f():
    return torch.ops._C.only_when_called(1)
"""
    refs = gb.module_level_op_refs({"vllm/x.py": src, "vllm/y.json": b"{}"})
    assert refs == {"rotary_embedding": ["vllm/x.py"], "in_class": ["vllm/x.py"]}
    lib = (b"\x00junk\x00rotary_embedding(Tensor positions, Tensor! query,   Tensor!? key) -> ()\x00"
           b"fused_rotary_embedding(Tensor x) -> ()\x00in_class(Tensor a) -> Tensor\x00")
    assert gb.schemas_from_library(lib, ["rotary_embedding", "in_class", "absent"]) == {
        "rotary_embedding": "rotary_embedding(Tensor positions, Tensor! query,   Tensor!? key) -> ()",
        "in_class": "in_class(Tensor a) -> Tensor"}


def test_check_dry_run_needs_the_cuda_path_to_import():
    a, b = _dry_result(site="/p"), _dry_result()
    cmp = {"all_equal": True}
    audit = {"without_standins": {"mode": "without_standins", "vllm.platforms.cuda": "vllm/platforms/cuda.py:23: X"},
             "with_standins": {"mode": "with_standins", "vllm.platforms.cuda": "ok", "engine config (stock)": "ok"},
             "ok_with_standins": True}
    v = gb.check_dry_run(a, b, "/b/site", cmp, audit)
    assert v["ok"] and v["cuda_path"]["fails_without_standins"] == {"vllm.platforms.cuda": "vllm/platforms/cuda.py:23: X"}
    assert not gb.check_dry_run(a, b, "/b/site", cmp, dict(audit, ok_with_standins=False))["ok"]
