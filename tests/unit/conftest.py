"""Unit tests share one process: the server config and cache shape that ``prepare_engine_args`` /
``check_against_cache`` record for request validation are restored after every test."""

import pytest


@pytest.fixture(autouse=True)
def _restore_active_server_config():
    from vllm_contour.integration.frontend import engine_args

    saved = engine_args.ACTIVE_CONFIG, engine_args.ACTIVE_SHAPE
    yield
    engine_args.ACTIVE_CONFIG, engine_args.ACTIVE_SHAPE = saved
