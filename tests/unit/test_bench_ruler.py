"""benchmarks.ruler / benchmarks.audit / benchmarks.kvpress_runner without an engine: generators, RULER
scorers, and the audit's byte accounting on synthetic caches of known size."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks import kvpress_runner as kr
from benchmarks import ruler


class WordTok:
    """Tiny stand-in tokenizer: one token per word or whitespace run, with offsets and a chat template."""

    def _spans(self, text):
        return [(m.start(), m.end()) for m in re.finditer(r"\S+|\s+", text)]

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        spans = self._spans(text)
        out = {"input_ids": [hash(text[s:e]) % 50_000 for s, e in spans]}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        assert not tokenize
        return "<|user|>\n" + messages[0]["content"] + "<|end|>\n<|assistant|>\n"


@pytest.fixture(scope="module")
def tok():
    return WordTok()


@pytest.mark.parametrize("task", ruler.TASKS)
def test_generators_deterministic_and_answers_in_prompt(tok, task):
    a = ruler.make_sample(tok, task, 1024, 0, seed=0)
    b = ruler.make_sample(tok, task, 1024, 0, seed=0)
    c = ruler.make_sample(tok, task, 1024, 1, seed=0)
    assert a["ids"] == b["ids"] and a["answers"] == b["answers"]
    assert a["ids"] != c["ids"]
    assert a["answers"] and all(ans in a["text"] for ans in a["answers"])
    # answers sit in the context part, before the question (query-agnostic mode never scores the question)
    q_char = a["text"].rindex("\n" + ruler._task_parts(task, ruler._rng(task, 1024, 0, 0), 0, 0)[0](1)[1])
    assert all(a["text"].index(ans) < q_char for ans in a["answers"])
    # prompt + generation fits the target length, and fills most of it
    assert len(a["ids"]) + a["max_new"] <= 1024
    assert len(a["ids"]) > 0.8 * (1024 - a["max_new"])
    assert 0 < a["context_len"] < len(a["ids"])


def test_answer_counts(tok):
    n = {t: len(ruler.make_sample(tok, t, 1024, 0)["answers"]) for t in ruler.TASKS}
    assert n == {"niah_single_noise": 1, "niah_single_text": 1, "niah_multikey": 1, "niah_multivalue": 4,
                 "niah_multiquery": 4, "vt": 5, "cwe": 10, "fwe": 3}


def test_cwe_and_fwe_answers_are_the_most_frequent(tok):
    s = ruler.make_sample(tok, "cwe", 1024, 0)
    words = re.findall(r"^\d+\. (\S+)$", s["text"], flags=re.M)
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts.values(), reverse=True)
    assert {counts[w] for w in s["answers"]} == {top[0]} and top[0] > top[10]
    f = ruler.make_sample(tok, "fwe", 1024, 0)
    body = f["text"].split("coded words. ", 1)[1].split("\nQuestion:")[0]
    words = [w for w in body.split() if w != "...."]
    counts = {w: words.count(w) for w in set(words)}
    ranked = sorted(counts, key=lambda w: -counts[w])
    assert set(f["answers"]) == set(ranked[:3]) and counts[ranked[2]] > counts[ranked[3]]


def test_vt_chain_present(tok):
    s = ruler.make_sample(tok, "vt", 1024, 0)
    names = s["answers"]
    assert re.search(rf"VAR {names[0]} = \d{{5}}\.", s["text"])
    for i in range(1, 5):
        assert f"VAR {names[i]} = VAR {names[i - 1]}." in s["text"]


def test_real_tokenizer_lengths():
    from transformers import AutoTokenizer

    from vllm_contour.models import fetch_model

    t = AutoTokenizer.from_pretrained(str(fetch_model("smollm2", quiet=True)))
    s = ruler.make_sample(t, "niah_single_noise", 1024, 0)
    assert len(s["ids"]) + s["max_new"] <= 1024
    assert t.decode(s["ids"][s["context_len"]:]).lstrip().startswith("What are all the special magic numbers")


# ---- RULER scoring (eval/synthetic/constants.py) -------------------------------------------------------------
def test_string_match_all():
    assert ruler.string_match_all(["The numbers are 123 and 456."], [["123", "456"]]) == 100.0
    assert ruler.string_match_all(["only 123"], [["123", "456"]]) == 50.0
    assert ruler.string_match_all(["ABC"], [["abc"]]) == 100.0  # case-insensitive
    assert ruler.string_match_all(["x", "123 456 789 000"], [["1"], ["123", "456", "789", "999"]]) == pytest.approx(
        (0 + 75) / 2)
    assert ruler.string_match_all([], []) == 0.0


def test_string_match_part():
    assert ruler.string_match_part(["only 123"], [["123", "456"]]) == 100.0
    assert ruler.string_match_part(["none"], [["123", "456"]]) == 0.0
    assert ruler.string_match_part(["a", "b 456"], [["x"], ["123", "456"]]) == 50.0


def test_postprocess_pred():
    assert ruler.postprocess_pred("  a\tb\x00c \n") == "a\nb\nc"


# ---- configs / budgets ----------------------------------------------------------------------------------
def test_configs_and_budgets():
    cfgs = ruler.make_configs(["snapkv", "knorm"], [128], [0.2], moments=(False, True))
    assert cfgs[0]["name"] == "full" and len(cfgs) == 1 + 2 * 2 * 2 * 2
    assert ruler.resolve_budget("20%", 1000) == 200 and ruler.resolve_budget("10%", 100) == 32
    s = {"context_len": 900}
    agn = next(c for c in cfgs if c["name"] == "snapkv@20%/agnostic/mom")
    assert ruler.extra_args(agn, s) == {"kv_policy": "snapkv", "kv_budget": 180, "kv_context_len": 900,
                                        "kv_moment_correction": True}
    aware = next(c for c in cfgs if c["name"] == "knorm@128/aware")
    assert ruler.extra_args(aware, s) == {"kv_policy": "knorm", "kv_budget": 128}
    assert ruler.extra_args(cfgs[0], s) == {"kv_policy": "none"}


def test_held_blocks():
    assert ruler.held_blocks(1000, 32, None) == 32  # ceil(1000 / 32)
    assert ruler.held_blocks(1000, 32, (5, 31, 26)) == 6
    assert ruler.held_blocks(1024, 32, (4, 32, 28)) == 4


# ---- audit byte accounting on synthetic caches --------------------------------------------------------------
class _Layer:
    def __init__(self, k, v):
        self.keys, self.values = k, v


class _LayersCache:  # transformers >= 4.54 DynamicCache shape
    def __init__(self, pairs):
        self.layers = [_Layer(k, v) for k, v in pairs]


class _LegacyCache:  # key_cache / value_cache lists
    def __init__(self, pairs):
        self.key_cache = [k for k, _ in pairs]
        self.value_cache = [v for _, v in pairs]


def _pairs(layers=30, heads=3, seq=128, dim=64, dtype=torch.float32):
    return [(torch.zeros(1, heads, seq, dim, dtype=dtype), torch.zeros(1, heads, seq, dim, dtype=dtype))
            for _ in range(layers)]


def test_cache_bytes_known_size():
    pairs = _pairs()
    expect = 128 * ruler.TOKEN_BYTES  # 128 tokens of SmolLM2 fp32 KV = 5.625 MiB (anchors.md)
    assert expect == 5.625 * 2**20
    for cache in (_LayersCache(pairs), _LegacyCache(pairs), pairs):
        assert kr.cache_bytes(cache) == expect
        assert kr.cache_tokens(cache)[0] == 128
    assert kr.entry_bytes(_LayersCache(pairs)) == 2 * 64 * 4
    half = _pairs(dtype=torch.bfloat16, seq=10, layers=2, heads=1, dim=8)
    assert kr.cache_bytes(_LayersCache(half)) == 2 * 10 * 8 * 2 * 2


def test_masked_entries_counted_not_subtracted_from_held():
    mod = torch.nn.Module()
    attn = torch.nn.Module()
    idx = torch.arange(100)
    attn.masked_key_indices = (torch.zeros_like(idx), idx % 3, idx)
    mod.add_module("attn", attn)
    assert kr.masked_entries(mod) == 100
    other = torch.nn.Module()
    other.masked_key_indices = None
    assert kr.masked_entries(other) == 0


def test_resolve_ratio():
    assert kr.resolve_ratio(128, 1024) == (128, 1 - 128 / 1024)
    assert kr.resolve_ratio("20%", 1000) == (200, 0.8)
    assert kr.resolve_ratio(2048, 1000) == (2048, 0.0)
