"""``register()``: the ``vllm.general_plugins`` entry point. Runs in every vLLM process (API server, engine
core, workers), possibly several times, before vLLM's config is known: idempotent, and it never raises
(vLLM calls it unguarded, so an exception here would stop stock vLLM too).

It installs what eviction may need: the attention backend over vLLM's (public ``register_backend``; with
eviction off it hands out vLLM's own classes), the three EngineArgs hooks (flags, folding, wiring: all or
none) and request validation (``SamplingParams._verify_extra_args``). Each is checked against its rows in
``vllm_hooks`` first; one that fails is not installed, ``register`` logs one line naming it, and
``--kv-eviction-policy`` is refused at start-up naming it and the vLLM version (``vllm_hooks.require``). With
no policy vLLM then runs as without the plugin. The evicting group's manager registers itself when eviction
first needs it (``manager.py``).
"""

from __future__ import annotations

import multiprocessing
import os
import sys

_REGISTERED = False
_VERIFY = "vllm.sampling_params:SamplingParams._verify_extra_args"
_ENGINE_ARGS = ("vllm.engine.arg_utils:EngineArgs.add_cli_args", "vllm.engine.arg_utils:EngineArgs.from_cli_args",
                "vllm.engine.arg_utils:EngineArgs.create_engine_config")
_BACKEND = "vllm.v1.attention.backends.registry:register_backend"


def _validate_request_args(extra_args) -> dict | None:
    """Check a request's kv_* keys (errors name the key, HTTP 400); -> its effective settings resolved against
    this server's (``config.resolved_entry``) when the request overrides any, else None."""
    from vllm.exceptions import VLLMValidationError

    from vllm_contour.config import EvictionConfigError, request_overrides, resolved_entry
    from vllm_contour.integration.frontend import engine_args

    try:
        over = request_overrides(extra_args)
    except EvictionConfigError as e:
        raise VLLMValidationError(str(e), parameter="vllm_xargs") from None
    active = engine_args.SERVER.config
    if active is not None and not active.enabled and any(
            (k, v) != ("policy", "none") for k, v in over.items()):
        raise VLLMValidationError(
            "per-request kv_* keys need a server started with --kv-eviction-policy "
            "(eviction is off on this server)", parameter="vllm_xargs")
    if active is not None and active.enabled and over:
        from vllm_contour.budget import request_budget
        from vllm_contour.config import resolve_request

        try:
            params = resolve_request(active, extra_args)  # knobs checked against the request's policy
            if params.enabled and engine_args.SERVER.shape is not None:
                request_budget(params, engine_args.SERVER.shape, per_request=True)
        except EvictionConfigError as e:
            raise VLLMValidationError(str(e), parameter="vllm_xargs") from None
        return resolved_entry(active, params)
    return None


_WARNED: list[str] = []


def apply_request_args(params) -> None:
    """After vLLM's own check of ``params.extra_args``: the kv_* keys validated (``VLLMValidationError``, HTTP
    400) and the request's effective settings recorded under ``config.RESOLVED_KEY``. An error of the
    plugin's own is logged (once) and the request goes on as vLLM validated it."""
    from vllm.exceptions import VLLMValidationError

    from vllm_contour.config import RESOLVED_KEY
    from vllm_contour.integration.frontend import engine_args

    try:
        entry = _validate_request_args(params.extra_args)
        if engine_args.SERVER.config is None:  # a process that does not know the server's settings
            return
        rest = {k: v for k, v in params.extra_args.items() if k != RESOLVED_KEY}  # only this hook writes it
        params.extra_args = {**rest, RESOLVED_KEY: entry} if entry is not None else rest
    except VLLMValidationError:
        raise
    except Exception as e:  # never a request failed by the plugin's own error
        if not _WARNED:
            _WARNED.append(repr(e))
            from vllm.logger import init_logger

            init_logger("vllm.contour").warning("kv_eviction: per-request keys not applied (%s: %s); the request "
                                                "runs with the server's settings", type(e).__name__, e)


def _patch_sampling_params() -> bool:
    from vllm_contour.integration import vllm_hooks

    def make(orig):
        def _verify_extra_args(self, *args, **kwargs) -> None:
            orig(self, *args, **kwargs)
            apply_request_args(self)

        return _verify_extra_args

    return vllm_hooks.patch_class(_VERIFY, make)


def _patch_engine_args() -> bool:
    """The three EngineArgs hooks go in together or not at all (flags accepted but never folded or wired
    would be silently ignored)."""
    from vllm_contour.integration import vllm_hooks

    bad = next((p for p in map(vllm_hooks.installable, _ENGINE_ARGS) if p is not None), None)
    if bad is not None:
        for symbol in _ENGINE_ARGS:
            vllm_hooks.not_installed(symbol, f"not installed ({bad})")
        return False
    from vllm_contour.integration.frontend.engine_args import patch_engine_args

    patch_engine_args()
    return not any(s in vllm_hooks.NOT_INSTALLED for s in _ENGINE_ARGS)


def _register_backend() -> bool:
    """The platform's eviction backend over vLLM's, only when its module imports and its rows hold (vLLM
    imports a registered backend lazily, eviction or not: one that fails there would stop stock vLLM)."""
    import importlib

    from vllm_contour.integration.frontend import platforms
    from vllm_contour.integration import vllm_hooks

    platform = platforms.current()
    if platform is None:
        return True
    module = platform.backend_cls.rsplit(".", 1)[0]
    path = module.removeprefix("vllm_contour.").replace(".", "/") + ".py"
    rows = tuple(h for h in vllm_hooks.HOOKS if path in h.where or "integration/backends/common.py" in h.where)
    for h in rows:
        if vllm_hooks.installable(h.symbol) is not None:
            vllm_hooks.not_installed(_BACKEND, f"{platform.backend_cls} not registered ({h.symbol} changed)")
            return False
    try:
        importlib.import_module(module)
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum[platform.backend], platform.backend_cls)
        return True
    except Exception as e:
        vllm_hooks.not_installed(_BACKEND, f"{platform.backend_cls} not registered ({type(e).__name__}: {e})")
        return False


def _install() -> None:
    from vllm_contour.integration import vllm_hooks

    for what, step in (("attention backend", _register_backend), ("EngineArgs hooks", _patch_engine_args),
                       ("request validation", _patch_sampling_params)):
        try:
            step()
        except Exception as e:  # a step's own failure: remembered like a hook that could not be installed
            vllm_hooks.not_installed(what, f"{type(e).__name__}: {e}")


def _log(msg: str, warning: bool) -> None:
    import logging

    if logging.getLogger("vllm").handlers:
        from vllm.logger import init_logger

        logger = init_logger("vllm.contour")
        (logger.warning if warning else logger.info)(msg)
    else:  # vLLM configures its log handlers after plugins load in the API-server process
        sys.stderr.write(f"{'WARNING' if warning else 'INFO'} [vllm_contour] {msg}\n")


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    try:
        from vllm_contour.integration import vllm_hooks

        _install()
        from vllm_contour.integration import faults

        if faults.install(os.environ.get(faults.FAULTS_ENV)).on:  # TEST ONLY: tests set the variable
            _log(f"vllm-contour: TEST-ONLY fault switch {faults.FAULTS_ENV}={os.environ[faults.FAULTS_ENV]} is on",
                 warning=True)
        where = f"pid {os.getpid()}, process {multiprocessing.current_process().name}"
        if vllm_hooks.NOT_INSTALLED:
            _log(f"vllm-contour plugin registered ({where}) without: "
                 + "; ".join(f"{k} ({v})" for k, v in vllm_hooks.NOT_INSTALLED.items())
                 + f" — --kv-eviction-policy will be refused on this vLLM {vllm_hooks.installed_version()}; "
                 "with no policy vLLM runs as without the plugin", warning=True)
        else:
            _log(f"vllm-contour plugin registered ({where})", warning=False)
    except Exception as e:  # never into vLLM
        try:
            sys.stderr.write(f"WARNING [vllm_contour] plugin not registered ({type(e).__name__}: {e})\n")
        except Exception:
            pass
