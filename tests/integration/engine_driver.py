"""Runs one in-process vLLM engine and a list of scenarios against it; writes JSON results.

vLLM cannot host two engines one after another in one process, so every engine configuration the
tests need runs in its own subprocess (``python -m tests.integration.engine_driver SPEC.json``) and the
pytest session shares the results (see conftest.py). Everything is read from vLLM's own objects: the
scheduler's block pool and running queue; the plugin's worker state only where a test compares the two.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _free(llm) -> int:
    return _core(llm).scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _drain(llm, on_step=None) -> dict[str, list[int]]:
    """Step the engine until no request is left; -> {request id: generated token ids} of those finished.
    ``on_step()`` runs after every step."""
    engine = llm.llm_engine
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        if on_step is not None:
            on_step()
    return outs


def _prompts(tokenizer_vocab: int, lengths, seed):
    rnd = random.Random(seed)
    return [[rnd.randrange(100, tokenizer_vocab - 100) for _ in range(n)] for n in lengths]


def _text_prompts(tok, lengths, seed):
    """Real text of roughly the given token lengths (public-domain style filler with numbers)."""
    rnd = random.Random(seed)
    words = ("the river ran past old mills and quiet farms where people kept records of harvest and weather "
             "for many years before the railway came through the valley").split()
    out = []
    for n in lengths:
        toks: list[int] = []
        while len(toks) < n:
            sent = " ".join(rnd.choice(words) for _ in range(12)) + f" number {rnd.randrange(1000)}. "
            toks += tok.encode(sent, add_special_tokens=False)
        out.append(toks[:n])
    return out


def run_greedy(llm, spec, res):
    from vllm import SamplingParams

    tok = llm.get_tokenizer() if not spec.get("skip_tokenizer_init") else None
    lengths = spec.get("greedy_lengths", [37, 90, 150, 260, 333, 480, 555, 700])
    prompts = _text_prompts(tok, lengths, 1) if tok is not None else _prompts(500, lengths, 1)
    extra = spec.get("greedy_extra_args")
    sp = SamplingParams(max_tokens=spec.get("greedy_max_tokens", 24), temperature=0, ignore_eos=True,
                        extra_args=extra)
    free_trace = []
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, sp)
    outs = _drain(llm, lambda: free_trace.append(_free(llm)))
    res["greedy"] = [outs[f"g{i}"] for i in range(len(prompts))]
    res["greedy_lengths"] = lengths
    res["greedy_free_trace"] = free_trace


def run_free_blocks(llm, spec, res):
    """One long prompt: vLLM's free-block count before and after its prefill step, and the worker layout."""
    from vllm import SamplingParams

    from vllm_contour.integration.state import worker_state

    tok = llm.get_tokenizer()
    out = []
    for i, (n, extra) in enumerate(spec.get("free_cases", [[2000, None]])):
        prompt = _text_prompts(tok, [n], 10 + i)[0]
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args=extra)
        engine = llm.llm_engine
        f0 = _free(llm)
        rid = f"free{i}"
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        trace = []
        layout = None
        while engine.has_unfinished_requests():
            engine.step()
            trace.append(_free(llm))
            # vLLM appends a suffix to request ids internally
            c = next((v for k, v in worker_state().compacted.items() if k.split("-")[0] == rid), None)
            if c is not None and layout is None:
                layout = {"K": c.layout.kept_blocks, "E": c.layout.region_blocks,
                          "pages": c.layout.pages.tolist(), "counts": c.layout.counts.tolist()}
        bs = _core(llm).scheduler.kv_cache_manager.coordinator.single_type_managers[0].block_size
        out.append({"prompt_tokens": n, "free_before": f0, "free_trace": trace, "layout": layout,
                    "block_size": bs, "free_end": _free(llm)})
    res["free_blocks"] = out


def run_concurrency(llm, spec, res):
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    n_req = spec.get("conc_requests", 12)
    prompts = _text_prompts(tok, [spec.get("conc_prompt_tokens", 600)] * n_req, 3)
    sp = SamplingParams(max_tokens=spec.get("conc_max_tokens", 16), temperature=0, ignore_eos=True)
    engine = llm.llm_engine
    sched = _core(llm).scheduler
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", {"prompt_token_ids": p}, sp)
    max_running, finished, steps = 0, 0, 0
    t0 = time.time()
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished += int(o.finished)
        max_running = max(max_running, len(sched.running))
        steps += 1
    res["concurrency"] = {"max_running": max_running, "finished": finished, "requests": n_req,
                          "steps": steps, "seconds": time.time() - t0, "free_end": _free(llm),
                          "num_blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks}


def run_preempt_abort(llm, spec, res):
    """Overload the pool so the scheduler preempts, abort a few requests midway, then check leaks."""
    from vllm import SamplingParams

    from vllm_contour.integration.state import worker_state

    tok = llm.get_tokenizer()
    n_req = spec.get("pa_requests", 14)
    prompts = _text_prompts(tok, [spec.get("pa_prompt_tokens", 500)] * n_req, 5)
    sp = SamplingParams(max_tokens=spec.get("pa_max_tokens", 200), temperature=0, ignore_eos=True)
    engine = llm.llm_engine
    core = _core(llm)
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": p}, sp)
    rnd = random.Random(7)
    to_abort = set(rnd.sample([f"p{i}" for i in range(n_req)], spec.get("pa_aborts", 3)))
    step, finished = 0, set()
    while engine.has_unfinished_requests():
        outs = engine.step()
        step += 1
        for o in outs:
            if o.finished:
                finished.add(o.request_id)
        if step == spec.get("pa_abort_step", 25):
            engine.abort_request(sorted(to_abort - finished))
        # count every request's preemptions while it is alive
        for r in sched.requests.values():
            res.setdefault("_preempted", {})[r.request_id] = r.num_preemptions
    # one more tiny request so the worker sees the last finished ids and drops their state
    engine.add_request("tail", {"prompt_token_ids": prompts[0][:40]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    st = worker_state()
    res["preempt_abort"] = {
        "preemptions": sum(res.pop("_preempted", {}).values()),
        "aborted": sorted(to_abort), "finished": len(finished),
        "free_end": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks,
        "requests_left": len(sched.requests),
        "worker_compacted_left": sorted(st.compacted), "worker_captures_left": sorted(st.captures),
        "manager_reqs_left": len(sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks),
    }


def run_presets(llm, spec, res):
    """Every preset, one short request each, query-aware and query-agnostic, moments off and on."""
    from vllm import SamplingParams

    from vllm_contour.policies import policy_names

    tok = llm.get_tokenizer()
    question = tok.encode(" Question: what did the river pass? Answer:", add_special_tokens=False)
    ctx = _text_prompts(tok, [420], 21)[0]
    prompt = ctx + question
    engine = llm.llm_engine
    variants = []
    for name in policy_names():
        variants.append((name, {"kv_policy": name, "kv_budget": 96}))
        variants.append((name + "/agnostic", {"kv_policy": name, "kv_budget": 96, "kv_context_len": len(ctx)}))
    for name in spec.get("moment_presets", ["snapkv", "knorm"]):
        variants.append((name + "/moments", {"kv_policy": name, "kv_budget": 256, "kv_moment_correction": True}))
    for i, (label, extra) in enumerate(variants):
        engine.add_request(f"preset{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args=extra))
    outs = _drain(llm)
    res["presets"] = {label: outs.get(f"preset{i}") for i, (label, _) in enumerate(variants)}
    conn = _core(llm).scheduler.connector
    res["presets_evicted"] = conn.stats.evicted_requests


def run_greedy_evicted(llm, spec, res):
    """Greedy decoding of real eviction at a small budget (snapkv 64 per head), moments off and on: the
    tokens depend on which op implementations ran (compaction, moments, ragged decode), which the result
    records from the ops dispatch."""
    from vllm import SamplingParams

    from vllm_contour import ops

    tok = llm.get_tokenizer()
    prompts = _text_prompts(tok, [300, 650, 1100], 5)
    engine = llm.llm_engine
    before = dict(ops.CALLS)
    labels = []
    for i, p in enumerate(prompts):
        for moments in (False, True):
            extra = {"kv_policy": "snapkv", "kv_budget": 64, "kv_moment_correction": moments}
            labels.append(f"ge{i}{'m' if moments else ''}")
            engine.add_request(labels[-1], {"prompt_token_ids": p},
                               SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, extra_args=extra))
    outs = _drain(llm)
    res["greedy_evicted"] = {k: outs.get(k) for k in labels}
    res["greedy_evicted_calls"] = {f"{op}:{name}": n - before.get((op, name), 0)
                                   for (op, name), n in ops.CALLS.items() if n - before.get((op, name), 0)}


def run_parallel(llm, spec, res):
    """Token-id prompts on the tiny model (no tokenizer): the server's policy (evicting) and a per-request
    budget above the prompt (nothing evicted). Records greedy tokens and what the scheduler freed, which is
    all a tensor-parallel engine exposes in-process (its workers are other processes)."""
    from vllm import SamplingParams

    lengths = spec["par_lengths"]  # whole pages: see PAR_LENGTHS in conftest.py
    prompts = _prompts(spec.get("par_vocab", 512), lengths, 11)
    engine = llm.llm_engine
    conn = _core(llm).scheduler.connector
    f0, freed0 = _free(llm), conn.stats.freed_blocks
    labels = []
    for i, p in enumerate(prompts):
        for tag, extra in (("evict", None), ("keep", {"kv_budget": 100000})):
            labels.append(f"par{i}{tag}")
            engine.add_request(labels[-1], {"prompt_token_ids": p},
                               SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, extra_args=extra))
    outs = _drain(llm)
    last = {k.split("-")[0]: list(v) for k, v in conn.stats.last.items() if k.split("-")[0] in labels}
    res["parallel"] = {"tokens": {k: outs.get(k) for k in labels}, "lengths": lengths,
                       "freed_blocks": conn.stats.freed_blocks - freed0, "reports": last,
                       "free_before": f0, "free_end": _free(llm)}


SCENARIOS = {"parallel": run_parallel, "greedy_evicted": run_greedy_evicted, "presets": run_presets, "greedy": run_greedy, "free_blocks": run_free_blocks, "concurrency": run_concurrency,
             "preempt_abort": run_preempt_abort}


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    from vllm import LLM

    t0 = time.time()
    llm = LLM(**spec["llm"])
    res = {"startup_s": time.time() - t0}
    core = _core(llm)
    res["num_gpu_blocks"] = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    driver = getattr(core.model_executor, "driver_worker", None)  # None: workers in other processes (TP/PP)
    runner = driver.worker.model_runner if driver is not None else None
    res["attn_impl"] = type(runner.attn_groups[0][0].backend).__name__ \
        if runner is not None and hasattr(runner, "attn_groups") else None
    res["connector"] = type(core.scheduler.connector).__name__ if core.scheduler.connector else None
    for name in spec["scenarios"]:
        t = time.time()
        SCENARIOS[name](llm, spec, res)
        res[f"{name}_s"] = time.time() - t
    json.dump(res, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
