"""CLI flags and engine wiring, in-process (vLLM imported, no engine started)."""

import pytest

from vllm_contour.config import EvictionConfigError


@pytest.fixture(scope="module")
def parser():
    import vllm_contour

    vllm_contour.register()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def engine_args(parser, argv):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "dummy"] + argv))


def cli_error(parser, argv, capsys) -> str:
    """A command line the plugin refuses: the process ends with exit code 2 and one line on stderr (as
    vLLM's own argument errors), no traceback. -> that line."""
    with pytest.raises(SystemExit) as e:
        engine_args(parser, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def test_flags_fold_into_additional_config(parser):
    ea = engine_args(parser, ["--kv-eviction-policy", "snapkv", "--kv-budget", "64", "--kv-recent-window", "16"])
    ac = ea.additional_config["kv_eviction"]
    assert (ac["policy"], ac["budget"], ac["recent_window"]) == ("snapkv", 64, 16)


def test_moment_correction_flag(parser, capsys):
    from vllm_contour.config import EvictionConfig

    ea = engine_args(parser, ["--kv-eviction-policy", "knorm", "--kv-moment-correction"])
    assert EvictionConfig.from_additional_config(ea.additional_config).moment_correction is True
    ea = engine_args(parser, ["--kv-eviction-policy", "knorm", "--no-kv-moment-correction"])
    assert EvictionConfig.from_additional_config(ea.additional_config).moment_correction is False
    ea = engine_args(parser, ["--kv-eviction-policy", "knorm"])
    assert ea.additional_config["kv_eviction"].get("moment_correction") is None  # the preset decides
    ea = engine_args(parser, ["--additional-config", '{"kv_eviction": {"policy": "knorm", "moment_correction": true}}',
                              "--kv-moment-correction"])  # same value twice: fine
    assert EvictionConfig.from_additional_config(ea.additional_config).moment_correction is True
    assert "--kv-moment-correction False contradicts" in cli_error(
        parser, ["--additional-config", '{"kv_eviction": {"policy": "knorm", "moment_correction": true}}',
                 "--no-kv-moment-correction"], capsys)


def test_additional_config_json_and_dotted_forms(parser):
    ea = engine_args(parser, ["--additional-config", '{"kv_eviction": {"policy": "streaming", "budget": 32}}'])
    assert ea.additional_config["kv_eviction"]["policy"] == "streaming"
    ea = engine_args(parser, ["--additional-config.kv_eviction.policy", "knorm"])
    assert ea.additional_config["kv_eviction"]["policy"] == "knorm"


def test_flag_contradicting_additional_config_is_refused(parser, capsys):
    assert "--kv-budget 64 contradicts" in cli_error(
        parser, ["--additional-config", '{"kv_eviction": {"policy": "snapkv", "budget": 32}}', "--kv-budget", "64"],
        capsys)


@pytest.mark.parametrize("argv, words", [
    (["--kv-eviction-policy", "snapvk"], ["--kv-eviction-policy", "snapvk", "allowed", "streaming"]),
    (["--kv-eviction-policy", "snapkv", "--kv-budget", "0"], ["--kv-budget", ">= 1"]),
    (["--kv-eviction-policy", "snapkv", "--kv-budget", "1.5"], ["--kv-budget", "integer"]),
    (["--kv-eviction-policy", "snapkv", "--kv-sink-tokens", "-2"], ["--kv-sink-tokens"]),
    (["--kv-budget", "64"], ["budget", "none"]),
    (["--additional-config", '{"kv_eviction": {"policy": "snapkv", "bduget": 3}}'], ["bduget", "allowed"]),
    (["--kv-eviction-policy", "snapkv", "--kv-transfer-config",
      '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'], ["--kv-transfer-config", "LMCache"]),
    (["--kv-eviction-policy", "contour", "--kv-policy-args", '{"mix": 9}'], ["policy_args", "allocator.mix"]),
    (["--kv-eviction-policy", "snapkv", "--kv-policy-args", "not json"], ["policy_args", "JSON object"]),
    (["--kv-eviction-policy", "snapkv", "--scheduler-cls", "my.Scheduler"], ["--scheduler-cls", "my.Scheduler"]),
    (["--kv-eviction-policy", "snapkv", "--speculative-config", '{"method": "eagle", "model": "x"}'],
     ["--speculative-config", "'eagle'", "ngram"]),
    (["--kv-eviction-policy", "snapkv", "--kv-offloading-size", "1"], ["--kv-offloading-size 1"]),
])
def test_invalid_settings_end_the_command_with_one_line_naming_the_flag(parser, capsys, argv, words):
    line = cli_error(parser, argv, capsys)
    for w in words:
        assert w in line, line


def test_offline_engine_args_get_the_error_as_an_exception():
    """An offline engine (``LLM(...)``: no command line) gets an exception naming the setting, not an exit."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_contour.integration.frontend.engine_args import prepare_engine_args

    with pytest.raises(EvictionConfigError, match="--kv-offloading-size 2"):
        prepare_engine_args(EngineArgs(model="dummy", additional_config={"kv_eviction": {"policy": "snapkv"}},
                                       kv_offloading_size=2))


def test_eviction_wires_connector_prefix_caching_and_block_size(parser):
    from vllm_contour.integration.frontend.engine_args import CONNECTOR_NAME, SCHEDULER_CLS, prepare_engine_args

    ea = engine_args(parser, ["--kv-eviction-policy", "snapkv", "--kv-policy-args", '{"kernel_size": 5}',
                              "--kv-decode-interval", "96"])
    cfg = prepare_engine_args(ea)
    assert cfg.enabled and cfg.budget == 128 and cfg.policy_args == {"kernel_size": 5}
    assert cfg.decode_interval == 96
    assert ea.kv_transfer_config.kv_connector == CONNECTOR_NAME and ea.scheduler_cls == SCHEDULER_CLS
    # prefix caching is left to vLLM (on by default); an explicit flag is accepted
    assert ea.enable_prefix_caching is None and ea.block_size == 32
    pc = engine_args(parser, ["--kv-eviction-policy", "snapkv", "--enable-prefix-caching"])
    assert prepare_engine_args(pc).enabled and pc.enable_prefix_caching is True
    ng = engine_args(parser, ["--kv-eviction-policy", "snapkv", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'])
    assert prepare_engine_args(ng).enabled  # n-gram drafts are served as multi-token steps
    off = engine_args(parser, [])
    prepare_engine_args(off)
    assert off.kv_transfer_config is None and off.enable_prefix_caching is None and off.block_size is None


def test_per_request_keys_validated_in_sampling_params(parser):
    import vllm_contour
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_contour.config import EvictionConfig
    from vllm_contour.integration.frontend import engine_args as ea

    vllm_contour.register()
    ea.SERVER.config = EvictionConfig(policy="snapkv")
    SamplingParams(extra_args={"kv_budget": 64, "kv_policy": "streaming", "other": 1})
    for bad, word in [({"kv_budget": 0}, "kv_budget"), ({"kv_policy": "nope"}, "kv_policy"),
                      ({"kv_bugdet": 3}, "kv_bugdet")]:
        with pytest.raises(VLLMValidationError, match=word):
            SamplingParams(extra_args=bad)

    # window queries live in blocks of vLLM's pool taken per request: any window a request asks for
    SamplingParams(extra_args={"kv_observation_window": 16})
    SamplingParams(extra_args={"kv_observation_window": 64})

    SamplingParams(extra_args={"kv_policy": "contour_diverse", "kv_policy_args": '{"lam": 0.2}'})
    with pytest.raises(VLLMValidationError, match="no knob 'lam'"):
        SamplingParams(extra_args={"kv_policy_args": '{"lam": 0.2}'})  # snapkv has no diversity selector

    # A server (or offline LLM) with eviction off refuses per-request eviction keys, except kv_policy=none.
    ea.SERVER.config = EvictionConfig()
    with pytest.raises(VLLMValidationError, match="--kv-eviction-policy"):
        SamplingParams(extra_args={"kv_budget": 64})
    SamplingParams(extra_args={"kv_policy": "none"})


def test_budget_below_the_floor_or_a_bad_interval_stops_start_up():
    """Checked once vLLM has built its config (the model's KV heads, head size, dtype and block size are
    known): the server refuses to start, naming the floor and the flags that set it."""
    from types import SimpleNamespace as NS

    import torch

    from vllm_contour.config import EvictionConfig
    from vllm_contour.integration.frontend.engine_args import check_against_cache

    vc = NS(model_config=NS(dtype=torch.float32, get_num_kv_heads=lambda pc: 3, get_head_size=lambda: 64),
            cache_config=NS(block_size=32, cache_dtype="auto"), parallel_config=None)
    with pytest.raises(EvictionConfigError, match="--kv-budget 40 is below the floor of 64 tokens"):
        check_against_cache(EvictionConfig(policy="snapkv", budget=40), vc)
    with pytest.raises(EvictionConfigError, match="--kv-decode-interval 48 must be a multiple of the block size 32"):
        check_against_cache(EvictionConfig(policy="snapkv", decode_interval=48), vc)
    # the moment preset includes the corrected inference: its pages raise the floor to 128
    with pytest.raises(EvictionConfigError, match="floor of 128 tokens.*--kv-moment-correction"):
        check_against_cache(EvictionConfig(policy="moment", budget=96), vc)
    check_against_cache(EvictionConfig(policy="moment", budget=96, moment_correction=False), vc)
    check_against_cache(EvictionConfig(policy="snapkv", budget=64), vc)


def test_the_front_ends_parsed_settings_travel_with_the_request(monkeypatch):
    """The front end parses a request's kv_* keys once and stores the result in its extra_args; the scheduler
    uses it as it is (no second parse) when it was made against the scheduler's own server settings."""
    import msgspec
    import vllm_contour
    from vllm import SamplingParams

    from vllm_contour import config
    from vllm_contour.config import RESOLVED_KEY, EvictionConfig, request_settings, resolve_request
    from vllm_contour.integration.frontend import engine_args as ea

    vllm_contour.register()
    server = ea.SERVER.config = EvictionConfig(policy="snapkv")
    sp = SamplingParams(extra_args={"kv_budget": 64, "kv_policy": "knorm", "other": 1})
    assert sp.extra_args["other"] == 1 and sp.extra_args[RESOLVED_KEY]["settings"]["budget"] == 64
    # across the engine's transport (msgpack), then in a process that does not know the server's settings
    ea.SERVER.config = None
    sp = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    expected = resolve_request(server, sp.extra_args)
    calls = []
    monkeypatch.setattr(config, "resolve_request", lambda *a: calls.append(a) or expected)
    assert request_settings(server, sp.extra_args) == expected and calls == []  # not parsed again
    assert request_settings(EvictionConfig(policy="h2o"), sp.extra_args) == expected and len(calls) == 1
    ea.SERVER.config = server  # a client's own value under the key is never taken for the front end's
    forged = SamplingParams(extra_args={RESOLVED_KEY: ["x"], "other": 2})
    assert RESOLVED_KEY not in forged.extra_args
