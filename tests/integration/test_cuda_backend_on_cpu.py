"""The plugin's CUDA backend end to end, short of a GPU: vLLM's CPU platform runs the plugin's Triton backend
class (vLLM's ``TritonAttentionBackend`` / impl / builder with the plugin's row logic) under Triton's
interpreter (``tests/integration/triton_on_cpu.py``), with every op of the rounds and the compacted rows on
the Triton kernels (``VLLM_CONTOUR_OPS_IMPL=triton``). Compared with the CPU backend on the same tiny model:
eviction off gives stock tokens (the first few: the interpreter is slow), a budget above the prompt gives them
too, and at budgets that compact (decode rounds every 32 tokens, and MomentKV with its correction) the tokens
and the blocks each request holds in vLLM's pool after every step equal the C++ path's."""

from __future__ import annotations

import pytest

from .conftest import run_engine

pytestmark = pytest.mark.slow

BASE = dict(dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=False, max_model_len=512,
            num_gpu_blocks_override=64, max_num_seqs=8, seed=0, skip_tokenizer_init=True)
EVICT = {"kv_eviction": {"policy": "snapkv", "budget": 64, "decode_interval": 32}}
CASES = [{"kv_budget": 100000}, None, {"kv_policy": "moment", "kv_budget": 128}]
SPEC = dict(compare_lengths=[50, 200], compare_max_tokens=40)
OFF_TOKENS = 12  # eviction off, or on with nothing to evict: the first tokens of the stock run (the interpreter
CASE_TOKENS = [OFF_TOKENS, 40, 40]  # is slow); compacting cases: 40 tokens (a decode-time round at 32)
TRITON = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}


@pytest.fixture(scope="module")
def cpu_stock(tiny_model_dir):
    return run_engine("tiny_cpu_stock", dict(BASE, model=tiny_model_dir), ["compare"], compare_cases=[None],
                      env={"VLLM_PLUGINS": "none-allowed"}, **SPEC)


@pytest.fixture(scope="module")
def triton_off(tiny_model_dir):
    return run_engine("tiny_triton_off", dict(BASE, model=tiny_model_dir,
                                              additional_config={"kv_eviction": {"policy": "none"}}),
                      ["compare"], compare_cases=[None], triton_on_cpu=True, env=TRITON,
                      **dict(SPEC, compare_max_tokens=OFF_TOKENS))


@pytest.fixture(scope="module")
def triton_evict(tiny_model_dir):
    return run_engine("tiny_triton_evict", dict(BASE, model=tiny_model_dir, additional_config=EVICT), ["compare"],
                      compare_cases=CASES, triton_on_cpu=True, env=dict(TRITON, VLLM_CONTOUR_OPS_IMPL="triton"),
                      compare_case_tokens=CASE_TOKENS, **SPEC)


@pytest.fixture(scope="module")
def cpp_evict(tiny_model_dir):
    return run_engine("tiny_cpp_evict", dict(BASE, model=tiny_model_dir, additional_config=EVICT), ["compare"],
                      compare_cases=CASES, compare_case_tokens=CASE_TOKENS, **SPEC)


def test_triton_backend_runs_with_eviction_off_and_gives_stock_tokens(cpu_stock, triton_off):
    assert triton_off["attn_impl"] == "TritonOnCPUBackend"
    assert triton_off["compare"][0]["tokens"] == [t[:OFF_TOKENS] for t in cpu_stock["compare"][0]["tokens"]]


def test_triton_backend_with_budget_above_the_prompt_gives_stock_tokens(cpu_stock, triton_evict):
    assert triton_evict["compare"][0]["tokens"] == [t[:OFF_TOKENS] for t in cpu_stock["compare"][0]["tokens"]]


@pytest.mark.parametrize("case", [1, 2], ids=["snapkv64_decode_rounds", "moment128_corrected"])
def test_triton_backend_compacts_like_the_cpp_path(cpu_stock, triton_evict, cpp_evict, case):
    got, want = triton_evict["compare"][case], cpp_evict["compare"][case]
    assert got["tokens"] == want["tokens"]
    assert got["held"] == want["held"]  # blocks each request holds in vLLM's pool, step by step
    # it did compact: at the end the long prompt holds fewer blocks than dense
    dense = [(n + 40 + 31) // 32 for n in SPEC["compare_lengths"]]
    peak_late = max(step.get("c%d_1" % case, 0) for step in got["held"][-5:])
    assert peak_late < dense[1]
    calls = triton_evict["ops_calls"]
    for op in ("compacted_attention:triton", "compact:triton"):
        assert calls.get(op, 0) > 0, calls
    if case == 2:
        assert all(calls.get(op, 0) > 0 for op in ("accumulate_moments:triton", "store_moments:triton",
                                                   "load_moments:triton")), calls
