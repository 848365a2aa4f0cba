import pytest

from vllm_contour.config import EvictionConfig, EvictionConfigError, request_overrides, resolve_request


def test_defaults_off():
    assert not EvictionConfig().enabled
    assert not EvictionConfig.from_additional_config(None).enabled
    assert not EvictionConfig.from_additional_config({"other_plugin": 1}).enabled


def test_valid_dict_and_string_numbers():
    cfg = EvictionConfig.from_dict({"policy": "snapkv", "budget": "64", "recent_window": 16})
    assert cfg.enabled and cfg.budget == 64 and cfg.recent_window == 16


@pytest.mark.parametrize("raw, words", [
    ({"policy": "nope"}, ["policy", "allowed", "snapkv"]),
    ({"policy": "snapkv", "budget": 0}, ["budget", ">= 1"]),
    ({"policy": "snapkv", "budget": -3}, ["budget"]),
    ({"policy": "snapkv", "budget": 12.5}, ["budget", "integer"]),
    ({"policy": "snapkv", "budget": "lots"}, ["budget", "integer"]),
    ({"policy": "snapkv", "budget": True}, ["budget", "integer"]),
    ({"policy": "snapkv", "bugdet": 3}, ["bugdet", "allowed", "budget"]),
    ({"policy": "none", "budget": 64}, ["budget", "none"]),
    ({"budget": 64}, ["budget", "none"]),
    ({"policy": "snapkv", "recent_window": -1}, ["recent_window"]),
    ("snapkv", ["JSON object"]),
])
def test_invalid_config_names_the_field(raw, words):
    with pytest.raises(EvictionConfigError) as ei:
        EvictionConfig.from_dict(raw)
    for w in words:
        assert w in str(ei.value)


def test_request_overrides():
    server = EvictionConfig(policy="snapkv", budget=128)
    r = resolve_request(server, {"kv_budget": 32, "kv_policy": "streaming", "unrelated": 1})
    assert (r.policy, r.budget) == ("streaming", 32)
    assert not resolve_request(server, {"kv_policy": "none"}).enabled
    for bad, word in [({"kv_budget": 0}, "kv_budget"), ({"kv_policy": "x"}, "kv_policy"),
                      ({"kv_bugdet": 3}, "kv_bugdet")]:
        with pytest.raises(EvictionConfigError, match=word):
            request_overrides(bad)


def test_request_context_len_and_moments():
    server = EvictionConfig(policy="snapkv")
    r = resolve_request(server, {"kv_context_len": 1000, "kv_moment_correction": True})
    assert r.context_len == 1000 and r.moment_correction
    with pytest.raises(EvictionConfigError, match="kv_context_len"):
        request_overrides({"kv_context_len": 0})
    with pytest.raises(EvictionConfigError, match="kv_moment_correction"):
        request_overrides({"kv_moment_correction": "maybe"})
    assert EvictionConfig.from_dict({"policy": "knorm", "moment_correction": True}).moment_correction


def test_request_values_in_the_form_vllm_delivers_them():
    """vLLM hands JSON booleans of vllm_xargs over as 1 / 0; its own kv_transfer_params is not ours."""
    server = EvictionConfig(policy="snapkv")
    assert resolve_request(server, {"kv_moment_correction": 1}).moment_correction is True
    assert resolve_request(server, {"kv_moment_correction": 0}).moment_correction is False
    assert request_overrides({"kv_transfer_params": {"do_remote_prefill": False}}) == {}
    with pytest.raises(EvictionConfigError, match="kv_moment_correction"):
        request_overrides({"kv_moment_correction": 2})
    r = resolve_request(server, {"kv_decode_interval": 0, "kv_observation_window": 16})
    assert (r.decode_interval, r.window) == (0, 16)


def test_policy_args_server_and_per_request():
    cfg = EvictionConfig.from_dict({"policy": "contour", "policy_args": '{"mix": 0.5}'})
    assert cfg.policy_args == {"mix": 0.5}
    assert resolve_request(cfg, None).policy_args == {"mix": 0.5}
    # a request's own knobs replace the server's; another policy starts from none
    assert resolve_request(cfg, {"kv_policy_args": '{"power": 2}'}).policy_args == {"power": 2}
    assert resolve_request(cfg, {"kv_policy": "snapkv"}).policy_args == {}
    with pytest.raises(EvictionConfigError, match="policy_args.*no knob 'mixx'"):
        EvictionConfig.from_dict({"policy": "contour", "policy_args": {"mixx": 1}})
    with pytest.raises(EvictionConfigError, match="kv_policy_args.*allocator.mix"):
        resolve_request(cfg, {"kv_policy_args": '{"mix": 7}'})
    with pytest.raises(EvictionConfigError, match="kv_policy_args must be a JSON object"):
        resolve_request(cfg, {"kv_policy_args": "[1, 2]"})
    assert EvictionConfig.from_dict(EvictionConfig.from_dict({"policy": "snapkv"}).to_dict()).policy_args == {}
