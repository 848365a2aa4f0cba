"""The knobs' outward behaviour (CLI flags, ``additional_config`` keys, per-request keys, defaults and the
validation errors, messages naming the field) against a snapshot taken from the code before the knob table
existed (``knobs_before.json``, written by ``observe()`` at the commit that added this test). The table may
change how they are produced, never what they are."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from vllm_contour.config import EvictionConfig, EvictionConfigError, request_overrides, resolve_request

SNAPSHOT = Path(__file__).parent / "data" / "knobs_before.json"
# values every knob is tried with, as JSON / vllm_xargs / a CLI flag deliver them
VALUES = [-1, 0, 1, 2, 3.0, 1.5, True, None, {}, "3", "x", "maybe", "[1]", "{\"lam\": 0.3}", "true", "score_only"]


def _policies_out(msg: str) -> str:
    """The list of policies in an error message varies with the registry: replaced by ``{policies}``."""
    from vllm_contour.policies import policy_names

    return msg.replace(", ".join(policy_names()), "{policies}")


def _outcome(fn, *a) -> str:
    try:
        return "ok " + repr(fn(*a))
    except EvictionConfigError as e:
        return "error " + _policies_out(str(e))


def _kv_actions() -> list[argparse.Action]:
    from vllm_contour.integration.frontend.engine_args import add_eviction_args

    parser = add_eviction_args(argparse.ArgumentParser())
    return [a for a in parser._actions if a.dest.startswith("kv_")]


def observe() -> dict:
    """What a user sees of the knobs, through the public entry points only."""
    from vllm_contour.integration.frontend.engine_args import fold_cli_args

    out: dict = {"flags": {}, "server": {}, "request": {}, "cli": {}}
    for a in sorted(_kv_actions(), key=lambda a: a.dest):
        bool_flag = isinstance(a, argparse.BooleanOptionalAction)
        argv = [a.option_strings[0]] + ([] if bool_flag else ["3"])
        folded = fold_cli_args(argparse.Namespace(**{a.dest: True if bool_flag else "3"}), None)["kv_eviction"]
        out["flags"][a.dest] = {"options": list(a.option_strings), "boolean": bool_flag,
                                "type": getattr(a.type, "__name__", None), "default": a.default,
                                "metavar": a.metavar, "additional_config_key": list(folded), "argv": argv}
    out["server_defaults"] = {k: repr(v) for k, v in EvictionConfig().to_dict().items()}
    out["request_defaults"] = {k: repr(v) for k, v in
                               dataclasses.asdict(resolve_request(EvictionConfig(policy="snapkv"), None)).items()}
    out["server_unknown"] = _outcome(EvictionConfig.from_dict, {"policy": "snapkv", "bugdet": 3})
    out["request_unknown"] = _outcome(request_overrides, {"kv_bugdet": 3})
    out["policy_off"] = _outcome(EvictionConfig.from_dict, {"budget": 64, "window": 8, "share_contexts": False})
    server_fields = EvictionConfig.fields()
    request_keys = out["request_unknown"].split("allowed: ")[1].split(", ")
    for v in VALUES:
        for f in server_fields:
            raw = {"policy": v} if f == "policy" else {"policy": "snapkv", f: v}
            out["server"][f"{f} {v!r}"] = _outcome(EvictionConfig.from_dict, raw)
        for k in request_keys:
            out["request"][f"{k} {v!r}"] = _outcome(request_overrides, {k: v})
    for a in _kv_actions():  # a flag's string as the command line delivers it, validated as the server does
        if isinstance(a, argparse.BooleanOptionalAction):
            continue
        for v in ("0", "1", "3", "x", "{\"lam\": 0.3}"):
            ns = argparse.Namespace(**{"kv_eviction_policy": "snapkv", a.dest: v})
            ac = fold_cli_args(ns, None)
            out["cli"][f"{a.option_strings[0]} {v}"] = _outcome(EvictionConfig.from_additional_config, ac)
    return json.loads(json.dumps(out))


BEFORE = json.loads(SNAPSHOT.read_text())


@pytest.fixture(scope="module")
def now() -> dict:
    return observe()


@pytest.mark.parametrize("section", ["flags", "server", "request", "cli"])
def test_each_row_of_the_snapshot_is_unchanged(now, section):
    """Table-driven: every flag, and every (knob, value) of the server config, the per-request keys and the
    CLI, gives the same result or the same error message as before."""
    assert sorted(now[section]) == sorted(BEFORE[section])
    changed = {k: (BEFORE[section][k], now[section][k]) for k in BEFORE[section]
               if now[section][k] != BEFORE[section][k]}
    assert not changed


@pytest.mark.parametrize("what", ["server_defaults", "request_defaults", "server_unknown", "request_unknown",
                                  "policy_off"])
def test_defaults_and_whole_config_errors_are_unchanged(now, what):
    assert now[what] == BEFORE[what]


def test_the_snapshot_covers_every_knob_and_names_the_field_in_each_error():
    """The snapshot is not vacuous: every flag and key was tried, each refused value's message names it."""
    assert len(BEFORE["flags"]) == 9 and len(BEFORE["request"]) == 10 * len(VALUES)
    errors = [(k, v) for s in ("server", "request") for k, v in BEFORE[s].items() if v.startswith("error")]
    assert len(errors) > 100
    for key, msg in errors:
        assert key.split()[0] in msg, (key, msg)


def test_readme_configuration_table_is_the_generated_one():
    from vllm_contour.knobs import readme_table

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert text.count("<!-- knobs -->") == 1 and text.count("<!-- /knobs -->") == 1
    block = text.split("<!-- knobs -->")[1].split("<!-- /knobs -->")[0]
    assert block.strip() == readme_table(), "regenerate: python -c 'from vllm_contour.knobs import readme_table; " \
                                            "print(readme_table())'"


def test_everything_is_generated_from_the_one_table():
    """Each knob of the table reaches the dataclasses, the flags, the request keys and the help, with its
    default and minimum; nothing outside the table adds one."""
    from vllm_contour.config import REQUEST_KEYS, RequestEviction
    from vllm_contour.knobs import KNOBS, help_text

    server = {k.field: k for k in KNOBS if k.server}
    request = {k.request_key: k for k in KNOBS if k.request_key}
    assert EvictionConfig.fields() == list(server)
    assert [f.name for f in dataclasses.fields(RequestEviction)] == [k.field for k in request.values()]
    assert REQUEST_KEYS == {key: k.field for key, k in request.items()}
    for f in dataclasses.fields(EvictionConfig):
        assert getattr(EvictionConfig(), f.name) == server[f.name].default
    actions = {a.dest: a for a in _kv_actions()}
    assert set(actions) == {k.dest for k in server.values()}
    for k in server.values():
        assert actions[k.dest].option_strings[0] == k.flag and help_text(k) in actions[k.dest].help
    for key, k in request.items():
        if k.kind == "int":
            assert "ok" in _outcome(request_overrides, {key: k.minimum})
            assert f"{key} must be an integer >= {k.minimum}" in _outcome(request_overrides, {key: k.minimum - 1})

