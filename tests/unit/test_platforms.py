"""Start-up on vLLM's CUDA platform, mocked (no GPU here): ``--kv-eviction-policy`` wires vLLM's Triton
backend and turns async scheduling off (either model runner), and every setting that cannot run with eviction is refused naming its flag;
a platform without an entry is refused naming it; the CPU platform is wired as before."""

from __future__ import annotations

import os

import pytest

from vllm_contour.config import EvictionConfigError

EVICT = {"kv_eviction": {"policy": "snapkv", "budget": 128}}


@pytest.fixture
def on_cuda(monkeypatch):
    """vLLM's current platform reports the CUDA device type; the plugin's registration runs for it."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "cuda", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    yield
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)


def _args(**kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model="dummy", additional_config=dict(EVICT), **kw)


def _prepare(ea):
    from vllm_contour.integration.frontend.engine_args import prepare_engine_args

    return prepare_engine_args(ea)


def test_cuda_wires_the_triton_backend_sync_scheduling_the_connector_and_the_scheduler(on_cuda):
    from vllm_contour.integration.frontend.engine_args import CONNECTOR_NAME, SCHEDULER_CLS

    ea = _args()
    assert ea.async_scheduling is None  # vLLM would turn it on for CUDA
    _prepare(ea)
    assert str(getattr(ea.attention_backend, "name", ea.attention_backend)) == "TRITON_ATTN"
    assert ea.async_scheduling is False
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ  # vLLM picks the model runner: either runs eviction
    assert ea.kv_transfer_config.kv_connector == CONNECTOR_NAME
    assert ea.scheduler_cls == SCHEDULER_CLS and ea.block_size == 32
    for backend in ("TRITON_ATTN", "auto"):  # asking for it, or for vLLM's choice, is fine
        ea = _args(attention_backend=backend)
        _prepare(ea)
        assert str(getattr(ea.attention_backend, "name", ea.attention_backend)) == "TRITON_ATTN"
    ea = _args(async_scheduling=False)
    _prepare(ea)
    assert ea.async_scheduling is False


@pytest.mark.parametrize("runner", ["0", "1"])
def test_cuda_accepts_either_model_runner(on_cuda, monkeypatch, runner):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    _prepare(_args())
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == runner


@pytest.mark.parametrize("kw, env, flag", [
    (dict(attention_backend="FLASH_ATTN"), None, "--attention-backend FLASH_ATTN"),
    (dict(compilation_config={"cudagraph_mode": "FULL"}), None, "--compilation-config cudagraph_mode=FULL"),
    (dict(compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}), None, "cudagraph_mode=FULL_AND_PIECEWISE"),
    (dict(kv_cache_dtype="fp8"), None, "--kv-cache-dtype fp8"),
    (dict(async_scheduling=True), None, "--async-scheduling"),
])
def test_cuda_refusals_name_their_flag(on_cuda, monkeypatch, kw, env, flag):
    if env is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    with pytest.raises(EvictionConfigError) as e:
        _prepare(_args(**kw))
    assert flag in str(e.value) and "--kv-eviction-policy" in str(e.value)


def test_piecewise_graphs_and_eviction_off_are_accepted(on_cuda):
    _prepare(_args(compilation_config={"cudagraph_mode": "PIECEWISE"}))
    from vllm.engine.arg_utils import EngineArgs

    ea = EngineArgs(model="dummy", attention_backend="FLASH_ATTN")  # eviction off: nothing is checked or set
    _prepare(ea)
    assert str(getattr(ea.attention_backend, "name", ea.attention_backend)) == "FLASH_ATTN"


def test_a_platform_without_an_entry_is_refused_naming_it(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "tpu", raising=False)
    with pytest.raises(EvictionConfigError, match="the current platform is tpu"):
        _prepare(_args())


def test_the_cpu_platform_needs_nothing_more():
    ea = _args()
    _prepare(ea)
    assert ea.attention_backend is None and ea.block_size == 32


def test_each_platform_registers_its_backend_over_vllms():
    """The table's backend classes import (vLLM's Triton backend classes import on the CPU build) and
    subclass the vLLM backend they are registered over."""
    import importlib

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_contour.integration.frontend.platforms import PLATFORMS

    for p in PLATFORMS.values():
        mod, cls = p.backend_cls.rsplit(".", 1)
        ours = getattr(importlib.import_module(mod), cls)
        theirs = AttentionBackendEnum[p.backend]
        base_mod, base_cls = theirs.value.rsplit(".", 1) if hasattr(theirs, "value") else (None, None)
        base = getattr(importlib.import_module(base_mod), base_cls)
        assert issubclass(ours, base) and ours.get_name() == p.backend


def test_rocm_is_refused_naming_it(on_cuda, monkeypatch):
    """vLLM's ROCm platform reports CUDA's device type: eviction is refused there until it has run."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: True, raising=False)
    with pytest.raises(EvictionConfigError, match="ROCm"):
        _prepare(_args())


@pytest.mark.parametrize("kv_dtype, model_dtype, ok", [("auto", "bfloat16", True), ("bfloat16", "bfloat16", True),
                                                       ("float16", "bfloat16", False), ("fp8", "bfloat16", False)])
def test_a_cache_dtype_equal_to_the_models_is_accepted(on_cuda, kv_dtype, model_dtype, ok):
    import torch
    from types import SimpleNamespace

    from vllm_contour.integration.frontend.engine_args import cache_shape_of

    if kv_dtype == "fp8":
        with pytest.raises(EvictionConfigError, match="--kv-cache-dtype fp8"):
            _prepare(_args(kv_cache_dtype=kv_dtype))
        return
    _prepare(_args(kv_cache_dtype=kv_dtype))
    mc = SimpleNamespace(dtype=getattr(torch, model_dtype), get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 64)
    cfg = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype=kv_dtype, block_size=32),
                          parallel_config=None)
    if ok:
        assert cache_shape_of(cfg).elem_size == 2
    else:
        with pytest.raises(EvictionConfigError, match=f"--kv-cache-dtype {kv_dtype}.*model's dtype"):
            cache_shape_of(cfg)


def test_an_mla_model_is_refused_naming_it():
    from types import SimpleNamespace

    from vllm_contour.config import EvictionConfig
    from vllm_contour.integration.frontend.engine_args import check_against_cache

    cfg = SimpleNamespace(model_config=SimpleNamespace(use_mla=True, model="deepseek-ai/DeepSeek-V2-Lite"))
    with pytest.raises(EvictionConfigError, match="DeepSeek-V2-Lite.*multi-head latent attention"):
        check_against_cache(EvictionConfig(policy="snapkv"), cfg)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_cpu_accepts_fp8_caches_with_one_byte_elements(kv_dtype):
    """vLLM's CPU fp8 caches (uint8 pages, ``ops/fp8.py``): accepted with eviction on CPU; budgets count one
    byte per element (twice bf16's tokens in the same bytes)."""
    import torch
    from types import SimpleNamespace

    from vllm_contour.integration.frontend.engine_args import cache_shape_of

    _prepare(_args(kv_cache_dtype=kv_dtype))
    mc = SimpleNamespace(dtype=torch.bfloat16, get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 64)
    cfg = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype=kv_dtype, block_size=32),
                          parallel_config=None)
    assert cache_shape_of(cfg).elem_size == 1


@pytest.mark.parametrize("cuda", [False, True])
def test_turboquant_is_refused_naming_the_flag(monkeypatch, cuda):
    """TurboQuant's slots (rotated, 3-8 bit keys and values of every head in one slot per token) have no
    per-head pages to compact: refused on both platforms, naming ``--kv-cache-dtype``."""
    from vllm.platforms import current_platform

    if cuda:
        monkeypatch.setattr(type(current_platform), "device_type", "cuda", raising=False)
    from vllm_contour.integration.frontend.platforms import platform_of

    with pytest.raises(EvictionConfigError, match="--kv-cache-dtype turboquant_4bit_nc.*TurboQuant"):
        platform_of(current_platform.device_type).check_kv_cache_dtype("turboquant_4bit_nc")
