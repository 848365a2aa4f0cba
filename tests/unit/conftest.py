"""Unit tests share one process: the server settings that ``prepare_engine_args`` / ``check_against_cache``
record for request validation (``engine_args.SERVER``) are restored after every test."""

import dataclasses

import pytest


@pytest.fixture(autouse=True)
def _restore_server_settings():
    from vllm_contour.integration.frontend import engine_args

    saved = dataclasses.replace(engine_args.SERVER)
    yield
    engine_args.SERVER.config, engine_args.SERVER.shape = saved.config, saved.shape
