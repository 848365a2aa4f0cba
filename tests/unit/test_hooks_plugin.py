"""``register()`` at vLLM's boundary: a hook whose check fails is not installed (vLLM keeps its own code),
``register`` never raises and logs one line naming what it left out, and eviction is then refused at start-up
naming it and the vLLM version; the three EngineArgs hooks go in together or not at all; the attention
backend is registered only when its module imports and its rows hold; the request-validation wrapper passes
vLLM's arguments through and never fails a request with an error of its own."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from vllm_contour.config import EvictionConfigError
from vllm_contour.integration.frontend import plugin
from vllm_contour.integration import vllm_hooks


@pytest.fixture
def fresh(monkeypatch):
    """A process where the plugin has not registered yet (this one's state is restored after the test); the
    lines register() logs are collected."""
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setattr(vllm_hooks, "NOT_INSTALLED", {})
    logged = []
    monkeypatch.setattr(plugin, "_log", lambda msg, warning: logged.append((warning, msg)))
    return logged


def _stock(monkeypatch, cls, name):
    """Put vLLM's own attribute back (an earlier test may have installed the hook) for this test."""
    raw = inspect.getattr_static(cls, name)
    fn = getattr(raw, "__func__", raw)
    orig = getattr(fn, "__contour_original__", fn)
    monkeypatch.setattr(cls, name, type(raw)(orig) if isinstance(raw, (classmethod, staticmethod)) else orig)
    return inspect.getattr_static(cls, name)


def _installed(cls, name) -> bool:
    raw = inspect.getattr_static(cls, name)
    return getattr(getattr(raw, "__func__", raw), "__contour_original__", None) is not None


def test_a_changed_request_validation_is_left_to_vllm_and_eviction_is_refused(monkeypatch, fresh):
    from vllm.sampling_params import SamplingParams

    stock = _stock(monkeypatch, SamplingParams, "_verify_extra_args")
    seen = []

    def _verify_extra_args(self, limit):  # a vLLM whose check takes an argument
        seen.append(limit)
        stock(self)

    monkeypatch.setattr(SamplingParams, "_verify_extra_args", _verify_extra_args)
    plugin.register()
    assert SamplingParams._verify_extra_args is _verify_extra_args  # not installed: vLLM's own runs
    p = SamplingParams(max_tokens=1)
    p.extra_args = {"kv_budget": 64, "other": 1}
    p._verify_extra_args(2 ** 64)
    assert seen == [2 ** 64]
    symbol = "vllm.sampling_params:SamplingParams._verify_extra_args"
    assert "parameters ('self', 'limit')" in vllm_hooks.NOT_INSTALLED[symbol]
    assert len(fresh) == 1 and fresh[0][0] and symbol in fresh[0][1] and "vLLM 0.32.0" in fresh[0][1]
    with pytest.raises(EvictionConfigError, match=r"vLLM 0\.32\.0.*SamplingParams\._verify_extra_args"):
        vllm_hooks.require()


def test_the_engine_args_hooks_go_in_together_or_not_at_all(monkeypatch, fresh):
    from vllm.engine.arg_utils import EngineArgs

    for name in ("add_cli_args", "create_engine_config"):
        _stock(monkeypatch, EngineArgs, name)
    stock_from = _stock(monkeypatch, EngineArgs, "from_cli_args")

    def from_cli_args(cls, args, extra):  # another signature
        return stock_from.__func__(cls, args)

    monkeypatch.setattr(EngineArgs, "from_cli_args", classmethod(from_cli_args))
    plugin.register()
    assert not any(_installed(EngineArgs, n) for n in ("add_cli_args", "from_cli_args", "create_engine_config"))
    assert set(plugin._ENGINE_ARGS) <= set(vllm_hooks.NOT_INSTALLED)
    assert "from_cli_args" in vllm_hooks.NOT_INSTALLED["vllm.engine.arg_utils:EngineArgs.add_cli_args"]
    # and when they hold, all three go in
    monkeypatch.setattr(EngineArgs, "from_cli_args", stock_from)
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setattr(vllm_hooks, "NOT_INSTALLED", {})
    plugin.register()
    assert all(_installed(EngineArgs, n) for n in ("add_cli_args", "from_cli_args", "create_engine_config"))
    assert fresh[-1] == (False, fresh[-1][1]) and "registered" in fresh[-1][1]


def test_register_never_raises(monkeypatch, fresh):
    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin, "_register_backend", boom)
    plugin.register()  # a step that raises is remembered; the others still run
    assert vllm_hooks.NOT_INSTALLED["attention backend"] == "RuntimeError: boom"
    assert fresh and "attention backend (RuntimeError: boom)" in fresh[-1][1]
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setattr(plugin, "_install", boom)
    plugin.register()  # even when everything fails
    assert plugin._REGISTERED


def test_the_backend_is_registered_only_when_its_module_and_rows_hold(monkeypatch, fresh):
    import vllm.distributed.kv_transfer as kvt
    from vllm.v1.attention.backends import registry

    from vllm_contour.integration.frontend import platforms

    calls = []
    monkeypatch.setattr(registry, "register_backend", lambda enum, path: calls.append((enum.name, path)))
    assert plugin._register_backend() and calls == [("CPU_ATTN", platforms.PLATFORMS["cpu"].backend_cls)]
    broken = platforms.Platform("cpu", "CPU_ATTN", "vllm_contour.integration.backends.no_such.Backend", None)
    monkeypatch.setattr(platforms, "current", lambda: broken)
    assert plugin._register_backend() is False and len(calls) == 1
    assert "ModuleNotFoundError" in vllm_hooks.NOT_INSTALLED[plugin._BACKEND]
    monkeypatch.setattr(vllm_hooks, "NOT_INSTALLED", {})
    monkeypatch.setattr(platforms, "current", lambda: platforms.PLATFORMS["cpu"])
    monkeypatch.setattr(kvt, "has_kv_transfer_group", lambda rank: True)  # another signature
    assert plugin._register_backend() is False and len(calls) == 1
    assert "has_kv_transfer_group changed" in vllm_hooks.NOT_INSTALLED[plugin._BACKEND]


def test_the_request_wrapper_passes_vllms_arguments_and_never_fails_a_request_itself(monkeypatch):
    from vllm.exceptions import VLLMValidationError

    from vllm_contour.config import EvictionConfig
    from vllm_contour.integration.frontend import engine_args

    calls = []
    wrapper = None

    def patch_class(symbol, make):
        nonlocal wrapper
        wrapper = make(lambda self, *a, **kw: calls.append((a, kw)))
        return True

    monkeypatch.setattr(vllm_hooks, "patch_class", patch_class)
    assert plugin._patch_sampling_params()
    monkeypatch.setattr(engine_args.SERVER, "config", EvictionConfig(policy="snapkv"))
    req = SimpleNamespace(extra_args={"kv_budget": 256, "other": 1})
    wrapper(req, 7, strict=True)
    assert calls == [((7,), {"strict": True})] and req.extra_args["other"] == 1
    with pytest.raises(VLLMValidationError, match="kv_bugdet"):  # the request's error: HTTP 400
        wrapper(SimpleNamespace(extra_args={"kv_bugdet": 1}))

    def broken(extra_args):
        raise KeyError("plugin bug")

    monkeypatch.setattr(plugin, "_validate_request_args", broken)
    monkeypatch.setattr(plugin, "_WARNED", [])
    untouched = {"kv_budget": 256}
    req = SimpleNamespace(extra_args=untouched)
    wrapper(req)  # the plugin's own error: logged, the request goes on as vLLM validated it
    assert req.extra_args is untouched and plugin._WARNED
