"""The table of places the plugin hooks into vLLM (``integration/vllm_hooks.py``) matches the installed
vLLM, and a hook whose symbol disappears or whose parameters change is reported by name (a server with
eviction on then refuses to start); every patch and instance wrap in the package goes through the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_contour.config import EvictionConfigError
from vllm_contour.integration import vllm_hooks
from vllm_contour.integration.vllm_hooks import HOOKS, Hook

PKG = Path(__file__).resolve().parents[2] / "vllm_contour"


def test_every_hook_matches_the_installed_vllm_before_and_after_the_plugin_patches():
    assert vllm_hooks.check() == []
    import vllm_contour

    vllm_contour.register()
    assert vllm_hooks.check() == []  # patched symbols are checked through the original they wrap
    vllm_hooks.require()


def test_a_changed_or_missing_hook_is_named(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    def changed(self, request, num_computed_tokens, num_new_tokens, extra):
        return num_new_tokens

    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", changed)
    problems = vllm_hooks.check()
    assert len(problems) == 1 and problems[0].startswith(
        "vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead: parameters")
    with pytest.raises(EvictionConfigError, match="_reserve_prefill_lookahead.*extra"):
        vllm_hooks.require()
    monkeypatch.delattr(Scheduler, "_reserve_prefill_lookahead")
    assert "AttributeError" in vllm_hooks.check()[0]
    gone = Hook("vllm.v1.core.block_pool:BlockPool.no_such_thing", None, "written", "-", "-")
    assert "no_such_thing" in vllm_hooks.check((gone,))[0]


def test_a_server_with_eviction_refuses_a_vllm_whose_hooks_changed(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_contour.integration.engine_args import prepare_engine_args

    monkeypatch.setattr(vllm_hooks, "check", lambda hooks=HOOKS: ["x:Y.z: parameters ('a',)"])
    with pytest.raises(EvictionConfigError, match="differs from 0.32.0.*x:Y.z"):
        prepare_engine_args(EngineArgs(model="dummy", additional_config={"kv_eviction": {"policy": "snapkv"}}))
    prepare_engine_args(EngineArgs(model="dummy"))  # eviction off: nothing checked


def test_no_patch_outside_the_table():
    """Assignments to vLLM classes or instances happen only through vllm_hooks.patch_class / wrap_instance."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "vllm_hooks.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"^\s*(SamplingParams|EngineArgs|Scheduler|BlockPool|KVCacheManager|pool|manager)"
                         r"\.[A-Za-z_]+\s*=[^=]", line):
                offenders.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert offenders == []
    declared = {h.symbol.split(":")[1] for h in HOOKS}
    assert {"SamplingParams._verify_extra_args", "EngineArgs.create_engine_config", "BlockPool.get_new_blocks",
            "KVCacheManager.allocate_slots"} <= declared
