"""``register()``: the ``vllm.general_plugins`` entry point. Runs in every vLLM process (API server,
engine core, workers), possibly several times: idempotent."""

from __future__ import annotations

import multiprocessing
import os
import sys

_REGISTERED = False


def _validate_request_args(extra_args) -> dict | None:
    """Check a request's kv_* keys (errors name the key, HTTP 400); -> its effective settings resolved against
    this server's (``config.resolved_entry``) when the request overrides any, else None."""
    from vllm.exceptions import VLLMValidationError

    from vllm_contour.config import EvictionConfigError, request_overrides, resolved_entry
    from vllm_contour.integration import engine_args

    try:
        over = request_overrides(extra_args)
    except EvictionConfigError as e:
        raise VLLMValidationError(str(e), parameter="vllm_xargs") from None
    active = engine_args.ACTIVE_CONFIG
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
            if params.enabled and engine_args.ACTIVE_SHAPE is not None:
                request_budget(params, engine_args.ACTIVE_SHAPE, per_request=True)
            if params.enabled and params.window > active.window:
                raise EvictionConfigError(
                    f"kv_observation_window {params.window} is larger than the server's --kv-observation-window "
                    f"{active.window} (the window-query buffers are sized for it at start-up)")
        except EvictionConfigError as e:
            raise VLLMValidationError(str(e), parameter="vllm_xargs") from None
        return resolved_entry(active, params)
    return None


def _patch_sampling_params() -> None:
    from vllm_contour.integration import engine_args, vllm_hooks

    def make(orig):
        def _verify_extra_args(self) -> None:
            from vllm_contour.config import RESOLVED_KEY

            orig(self)
            entry = _validate_request_args(self.extra_args)
            if engine_args.ACTIVE_CONFIG is None:  # a process that does not know the server's settings
                return
            rest = {k: v for k, v in self.extra_args.items() if k != RESOLVED_KEY}  # only this hook writes it
            self.extra_args = {**rest, RESOLVED_KEY: entry} if entry is not None else rest

        return _verify_extra_args

    vllm_hooks.patch_class("vllm.sampling_params:SamplingParams._verify_extra_args", make)


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.logger import init_logger

    logger = init_logger("vllm.contour")
    from vllm_contour.integration import manager, platforms

    manager.register()  # the evicting group's block-table manager, by its spec type (inert with eviction off)
    platform = platforms.current()
    if platform is not None:  # inert with eviction off: it hands out vLLM's own builder and impl
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum[platform.backend], platform.backend_cls)
    from vllm_contour.integration.engine_args import patch_engine_args

    patch_engine_args()
    _patch_sampling_params()
    _REGISTERED = True
    msg = "vllm-contour plugin registered (pid %d, process %s)" % (os.getpid(),
                                                                     multiprocessing.current_process().name)
    import logging

    if logging.getLogger("vllm").handlers:
        logger.info(msg)
    else:  # vLLM configures its log handlers after plugins load in the API-server process
        sys.stderr.write(f"INFO [vllm_contour] {msg}\n")
