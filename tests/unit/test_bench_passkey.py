"""Passkey benchmark helpers: prompts hold their answer, configurations and the table are what is asked for."""

import argparse

import pytest

from benchmarks import passkey as pk


class _Tok:  # whitespace tokenizer: enough for the prompt arithmetic
    def encode(self, text, add_special_tokens=False):
        return text.split(" ")


def test_prompt_contains_key_before_the_context_boundary():
    ids, ctx = pk.make_prompt(_Tok(), 300, 0.5, 12345)
    assert "12345." in ids[:ctx] and "12345." not in ids[ctx:]
    assert ids[ctx:] == "\nWhat is the pass key? The pass key is".split(" ")


def test_configs_cover_policies_budgets_modes_and_reject_unknown_mode():
    a = argparse.Namespace(budgets="128,512", fractions="0.2", modes="aware,agnostic", policies="knorm,snapkv")
    cfg = pk.config_list(a, 1000)
    assert cfg[0] == ("full", "none", None, "aware")
    assert len(cfg) == 1 + 2 * 2 * 3
    assert ("snapkv@20%/agn", "snapkv", 200, "agnostic") in cfg
    so = pk.config_list(argparse.Namespace(budgets="128", fractions="", modes="agnostic,score_only",
                                           policies="knorm"), 1000)
    assert so[1:] == [("knorm@128/agn", "knorm", 128, "agnostic"), ("knorm@128/so", "knorm", 128, "score_only")]
    with pytest.raises(SystemExit, match="modes"):
        pk.config_list(argparse.Namespace(budgets="1", fractions="", modes="blind", policies="knorm"), 10)


def test_table_places_each_result_in_its_cell():
    res = {"trials": 10, "results": {
        "full": {"policy": "none", "budget": None, "correct": 9, "trials": 10},
        "knorm@128": {"policy": "knorm", "budget": 128, "correct": 3, "trials": 10},
        "knorm@128/agn": {"policy": "knorm", "budget": 128, "correct": 4, "trials": 10}}}
    lines = pk.table(res).splitlines()
    assert lines[0].split() == ["policy", "128", "128/agn"]
    assert lines[1].split()[:3] == ["full", "cache", "9/10"]
    assert lines[2].split() == ["knorm", "3/10", "4/10"]
