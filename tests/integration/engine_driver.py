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

from benchmarks.text import filler_prompts

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _free(llm) -> int:
    """vLLM's own count of free blocks: its free queue (the plugin patches ``get_num_free_blocks`` to count the
    blocks only a shared compressed context holds as free; that count is never read here)."""
    return _core(llm).scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks


# Successful rounds per request (the caller's id), logged as the scheduler side applies each report: a
# scenario reads the counts of its own requests, never the engine-wide running total.
ROUNDS: dict[str, int] = {}
_COUNTS = ("rounds", "evicted_requests", "freed_blocks", "private_blocks", "shared_hits")


def _log_rounds(core) -> None:
    conn = core.scheduler.connector
    if conn is None:
        return
    side = conn.scheduler_side
    apply_one = side.outcomes._apply_one

    def logged(req_id, out):
        before = side.totals.rounds
        apply_one(req_id, out)
        if side.totals.rounds > before:
            key = req_id.split("-")[0]
            ROUNDS[key] = ROUNDS.get(key, 0) + 1

    side.outcomes._apply_one = logged


def _snapshot(llm) -> dict:
    """The plugin's scheduler counters now (see ``_deltas``)."""
    conn = _core(llm).scheduler.connector
    if conn is None:
        return {}
    return {**{k: getattr(conn.totals, k) for k in _COUNTS}, "failures": dict(conn.totals.failures)}


def _deltas(llm, snap: dict) -> dict:
    """What the plugin's scheduler counted since ``snap``: this scenario's rounds, requests compacted, blocks
    freed, private blocks, shared-context hits and failures by reason (reasons that did not move left out)."""
    now = _snapshot(llm)
    if not now:
        return {**dict.fromkeys(_COUNTS, 0), "failures": {}}
    f0 = snap["failures"]
    return {**{k: now[k] - snap[k] for k in _COUNTS},
            "failures": {k: v - f0.get(k, 0) for k, v in now["failures"].items() if v != f0.get(k, 0)}}


def _query_blocks(llm) -> dict[str, int]:
    """Blocks of vLLM's pool that hold each request's window queries right now (taken for its next round)."""
    conn = _core(llm).scheduler.connector
    if conn is None:
        return {}
    return {rid: len(t.queries.blocks) for rid, t in conn.scheduler_side.tracked.items() if t.queries is not None}


def _held(llm) -> dict[str, int]:
    """Blocks each live request holds in vLLM's pool right now: its block list minus null blocks, and the blocks
    holding its window queries."""
    mgr = _core(llm).scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    q = _query_blocks(llm)
    return {rid.split("-")[0]: sum(1 for b in blocks if not b.is_null) + q.get(rid, 0)
            for rid, blocks in mgr.req_to_blocks.items()}


def _worker():
    """The plugin's worker side in this (in-process) engine: what a test compares vLLM's own objects with."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group().worker_side if has_kv_transfer_group() else None


def _layout_of(rid: str):
    if _worker() is None:  # the plugin is not loaded (stock) or eviction is off
        return None
    return next((rs.layout for k, rs in _worker().requests.requests.items()
                 if k.split("-")[0] == rid and rs.layout is not None), None)


class LostRequest(AssertionError):
    """A request left vLLM's queues without finishing, or a scenario ran past its step budget."""


def _where(sched, rid: str) -> str:
    req = sched.requests.get(rid)
    places = [name for name, q in (("running", sched.running), ("waiting", sched.waiting),
                                   ("waiting with blocks", sched.kv_holding_waiting)) if req is not None and req in q]
    if req is not None and req.is_finished():
        places.append("finished")
    return ", ".join(places) or "neither running nor waiting"


class StepGuard:
    """After every engine step: each live request is in exactly one of vLLM's running / waiting / finished
    sets, and the steps since the engine was last idle stay within a budget from its requests' lengths (a
    prefill chunk per ``max_num_batched_tokens`` and a step per output token, three times over for
    preemptions and recomputes, plus 64). A lost request fails the scenario at once, naming it."""

    def __init__(self, llm):
        self.llm, self.steps, self.budget, self.seen = llm, 0, 64, set()
        sched = _core(llm).scheduler
        self.chunk = max(1, sched.scheduler_config.max_num_batched_tokens)

    def after_step(self) -> None:
        sched = _core(self.llm).scheduler
        lost = [rid for rid in sched.requests if _where(sched, rid) in ("neither running nor waiting", "")
                or "," in _where(sched, rid)]
        if lost:
            raise LostRequest("lost: " + "; ".join(f"{rid} is {_where(sched, rid)}" for rid in lost))
        for rid, req in sched.requests.items():
            if rid not in self.seen:
                self.seen.add(rid)
                n_out = req.sampling_params.max_tokens if req.sampling_params is not None else 1
                self.budget += 3 * (-(-req.num_prompt_tokens // self.chunk) + (n_out or 1))
        if not sched.requests:
            self.steps, self.budget, self.seen = 0, 64, set()
            return
        self.steps += 1
        if self.steps > self.budget:
            raise LostRequest(f"{self.steps} steps, past the budget of {self.budget} for the requests seen; "
                              "unfinished: " + "; ".join(f"{rid} is {_where(sched, rid)}" for rid in sched.requests))

    def install(self) -> None:
        engine = self.llm.llm_engine
        step = engine.step

        def guarded():
            out = step()
            self.after_step()
            return out

        engine.step = guarded


def _drain(llm, on_step=None, reasons: dict | None = None, finite: dict | None = None) -> dict[str, list[int]]:
    """Step the engine until no request is left; -> {request id: generated token ids} of those finished.
    ``on_step()`` runs after every step; ``reasons`` (if given) collects each request's finish reason;
    ``finite`` (requests sampled with ``logprobs=0``) whether every sampled token's logprob is finite."""
    import math

    engine = llm.llm_engine
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
                if reasons is not None:
                    reasons[o.request_id] = o.outputs[0].finish_reason
                if finite is not None:
                    lps = [d[t].logprob for d, t in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids)]
                    finite[o.request_id] = len(lps) == len(o.outputs[0].token_ids) and all(map(math.isfinite, lps))
        if on_step is not None:
            on_step()
    return outs


def _prompts(tokenizer_vocab: int, lengths, seed):
    rnd = random.Random(seed)
    return [[rnd.randrange(100, tokenizer_vocab - 100) for _ in range(n)] for n in lengths]


def run_greedy(llm, spec, res):
    from vllm import SamplingParams

    tok = llm.get_tokenizer() if not spec.get("skip_tokenizer_init") else None
    lengths = spec.get("greedy_lengths", [37, 90, 150, 260, 333, 480, 555, 700])
    prompts = filler_prompts(tok, lengths, 1) if tok is not None else _prompts(500, lengths, 1)
    extra = spec.get("greedy_extra_args")
    lp = 0 if spec.get("greedy_logprobs") else None  # the sampled token's logprob: NaN anywhere shows there
    sp = SamplingParams(max_tokens=spec.get("greedy_max_tokens", 24), temperature=0, ignore_eos=True,
                        extra_args=extra, logprobs=lp)
    free_trace = []
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, sp)
    finite = {} if lp is not None else None
    outs = _drain(llm, lambda: free_trace.append(_free(llm)), finite=finite)
    res["greedy"] = [outs[f"g{i}"] for i in range(len(prompts))]
    if finite is not None:
        res["greedy_finite"] = [finite[f"g{i}"] for i in range(len(prompts))]
    res["greedy_lengths"] = lengths
    res["greedy_free_trace"] = free_trace


def run_greedy_exact(llm, spec, res):
    """The greedy prompts with the budget exactly each prompt's length (the 37-token one: the floor, 64) and
    one round at the prompt end (``kv_decode_interval`` 0): the prompt fits its budget, so the round must keep
    everything."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    lengths = spec.get("greedy_lengths", [37, 90, 150, 260, 333, 480, 555, 700])
    prompts = filler_prompts(tok, lengths, 1)
    engine = llm.llm_engine
    snap = _snapshot(llm)
    for i, p in enumerate(prompts):
        engine.add_request(f"gx{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=spec.get("greedy_max_tokens", 24), temperature=0,
                                          ignore_eos=True, extra_args={"kv_budget": max(len(p), 64), "kv_decode_interval": 0}))
    outs = _drain(llm)
    res["greedy_exact"] = {"tokens": [outs.get(f"gx{i}") for i in range(len(prompts))], **_deltas(llm, snap)}


def run_greedy_none(llm, spec, res):
    """The greedy prompts again with eviction off for these requests (``kv_policy`` none): the stock tokens
    of this engine's dtype, to compare with the evicting requests of the same engine."""
    sub = {}
    run_greedy(llm, dict(spec, greedy_extra_args={"kv_policy": "none"}), sub)
    res["greedy_none"] = sub["greedy"]


def run_free_blocks(llm, spec, res):
    """One long prompt: vLLM's free-block count before and after its prefill step, and the worker layout."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    out = []
    for i, (n, extra) in enumerate(spec.get("free_cases", [[2000, None]])):
        prompt = filler_prompts(tok, [n], 10 + i)[0]
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
            lay = _layout_of(rid)  # vLLM appends a suffix to request ids internally
            if lay is not None and layout is None:
                layout = {"K": lay.kept_blocks, "E": lay.region_blocks, "pages": lay.pages.tolist(),
                          "counts": lay.counts.tolist()}
        bs = _core(llm).scheduler.kv_cache_manager.coordinator.single_type_managers[0].block_size
        out.append({"prompt_tokens": n, "free_before": f0, "free_trace": trace, "layout": layout,
                    "block_size": bs, "free_end": _free(llm)})
    res["free_blocks"] = out


def run_concurrency(llm, spec, res):
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    n_req = spec.get("conc_requests", 8)
    prompts = filler_prompts(tok, [spec.get("conc_prompt_tokens", 500)] * n_req, 3)
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
    """Overload the pool so the scheduler preempts (every other request does not evict and grows densely),
    abort a few requests midway, then check leaks. Evicting requests run decode-time rounds meanwhile; their
    blocks held after every step are recorded (vLLM's pool), with their preemption counts."""
    from vllm import SamplingParams


    tok = llm.get_tokenizer()
    n_req = spec.get("pa_requests", 14)
    prompts = filler_prompts(tok, [spec.get("pa_prompt_tokens", 500)] * n_req, 5)
    cycle = spec.get("pa_extra_cycle") or [None]
    engine = llm.llm_engine
    core = _core(llm)
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    evicting = set()
    for i, p in enumerate(prompts):
        extra = cycle[i % len(cycle)]
        if not extra or extra.get("kv_policy") != "none":
            evicting.add(f"p{i}")
        engine.add_request(f"p{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=spec.get("pa_max_tokens", 200), temperature=0, ignore_eos=True,
                                          extra_args=extra))
    snap = _snapshot(llm)
    rnd = random.Random(7)
    to_abort = set(rnd.sample([f"p{i}" for i in range(n_req)], spec.get("pa_aborts", 3)))
    step, finished = 0, set()
    held: dict[str, list[int]] = {}
    preempted: dict[str, int] = {}
    deferred: dict[str, set[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        step += 1
        for o in outs:
            if o.finished:
                finished.add(o.request_id)
        if step == spec.get("pa_abort_step", 25):
            engine.abort_request(sorted(to_abort - finished))
        for rid, n in _held(llm).items():
            if rid in evicting:
                held.setdefault(rid, []).append(n)
        # rounds put off because the pool had no room for their window queries (the points they went to)
        if sched.connector is not None:
            for rid, t in sched.connector.scheduler_side.tracked.items():
                if t.defer_to:
                    deferred.setdefault(rid.split("-")[0], set()).add(t.defer_to)
        # count every request's preemptions while it is alive
        for r in sched.requests.values():
            preempted[r.request_id.split("-")[0]] = r.num_preemptions
    # one more tiny request so the worker sees the last finished ids and drops their state
    engine.add_request("tail", {"prompt_token_ids": prompts[0][:40]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    st = _worker().requests
    res["preempt_abort"] = {
        "preemptions": sum(preempted.values()), "preempted": preempted, "evicting": sorted(evicting),
        "held": held, "aborted": sorted(to_abort), "finished": len(finished),
        "deferred": {r: len(v) for r, v in deferred.items()},
        "free_end": pool.free_block_queue.num_free_blocks, "num_blocks": pool.num_gpu_blocks,
        "requests_left": len(sched.requests),
        "worker_requests_left": sorted(st.requests), "worker_layouts_left": sorted(st.compacted()),
        "manager_reqs_left": len(sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks),
        **{k: _deltas(llm, snap)[k] for k in ("rounds", "failures")},
        "request_rounds": {r: ROUNDS.get(r, 0) for r in sorted(evicting)},
    }


def run_presets(llm, spec, res):
    """Every preset, one short request each, query-aware and query-agnostic, moments off and on."""
    from vllm import SamplingParams

    from vllm_contour.policies import policy_names

    tok = llm.get_tokenizer()
    question = tok.encode(" Question: what did the river pass? Answer:", add_special_tokens=False)
    ctx = filler_prompts(tok, [300], 21)[0]
    prompt = ctx + question
    engine = llm.llm_engine
    from vllm_contour.config import preset_moments

    variants = []
    for name in policy_names():
        # the moment presets' statistics raise the floor (128 on SmolLM2, 224 with Gemma 3's 256-dim head)
        budget = spec.get("moment_budget", 128) if preset_moments(name) else 96
        variants.append((name, {"kv_policy": name, "kv_budget": budget}))
        variants.append((name + "/agnostic", {"kv_policy": name, "kv_budget": budget, "kv_context_len": len(ctx)}))
    for name in spec.get("moment_presets", ["snapkv", "knorm"]):
        variants.append((name + "/moments", {"kv_policy": name, "kv_budget": 256, "kv_moment_correction": True}))
    for _, extra in variants:  # a prompt shorter than budget + the default T would reach its first round only
        if extra["kv_budget"] + 64 > len(prompt):  # after the 6 tokens: evict at the prompt end instead (T = 0)
            extra["kv_decode_interval"] = 0
    snap = _snapshot(llm)
    for i, (label, extra) in enumerate(variants):
        engine.add_request(f"preset{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args=extra))
    outs = _drain(llm)
    res["presets"] = {label: outs.get(f"preset{i}") for i, (label, _) in enumerate(variants)}
    conn = _core(llm).scheduler.connector
    last = {k.split("-")[0]: v for k, v in conn.totals.last.items()}
    # this scenario's own counts: each preset request's rounds and the blocks its last round freed
    res["presets_rounds"] = {label: ROUNDS.get(f"preset{i}", 0) for i, (label, _) in enumerate(variants)}
    res["presets_freed"] = {label: (last.get(f"preset{i}") or (0, 0, 0))[2] for i, (label, _) in enumerate(variants)}
    res["presets_deltas"] = _deltas(llm, snap)


def run_greedy_evicted(llm, spec, res):
    """Greedy decoding of real eviction at a small budget (snapkv, 64 tokens per head without moments, 128
    with them: the moment pages take 43 tokens per head on this model), prompt-end and decode-time rounds:
    the tokens depend on which op implementations ran (compaction, moments, ragged decode), which the result
    records from the ops dispatch."""
    from vllm import SamplingParams

    from vllm_contour import ops

    tok = llm.get_tokenizer()
    prompts = filler_prompts(tok, [300, 650, 1100], 5)
    engine = llm.llm_engine
    before = dict(ops.CALLS)
    labels = []
    for i, p in enumerate(prompts):
        for moments in (False, True):
            extra = {"kv_policy": "snapkv", "kv_budget": 128 if moments else 64, "kv_moment_correction": moments,
                     "kv_decode_interval": 32}
            labels.append(f"ge{i}{'m' if moments else ''}")
            engine.add_request(labels[-1], {"prompt_token_ids": p},
                               SamplingParams(max_tokens=80, temperature=0, ignore_eos=True, extra_args=extra))
    rounds0 = _core(llm).scheduler.connector.totals.rounds
    outs = _drain(llm)
    res["greedy_evicted"] = {k: outs.get(k) for k in labels}
    res["greedy_evicted_rounds"] = _core(llm).scheduler.connector.totals.rounds - rounds0
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
    f0, freed0, private0, rounds0 = _free(llm), conn.totals.freed_blocks, conn.totals.private_blocks, conn.totals.rounds
    labels = []
    variants = spec.get("par_variants") or [["evict", None], ["keep", {"kv_budget": 100000}]]
    for i, p in enumerate(prompts):
        for tag, extra in variants:
            labels.append(f"par{i}{tag}")
            engine.add_request(labels[-1], {"prompt_token_ids": p},
                               SamplingParams(max_tokens=spec.get("par_max_tokens", 16), temperature=0,
                                              ignore_eos=True, extra_args=extra))
    kept: dict[str, list] = {}  # one rank (in-process worker): each request's kept positions per layer and head

    def on_step():
        if getattr(_core(llm).model_executor, "driver_worker", None) is not None:
            for rid in labels:
                lay = _layout_of(rid)
                if lay is not None:
                    kept[rid] = [[lay.kept_positions(layer, h).tolist() for h in range(lay.num_kv_heads)]
                                 for layer in range(lay.num_layers)]

    outs = _drain(llm, on_step)
    last = {k.split("-")[0]: list(v) for k, v in conn.totals.last.items() if k.split("-")[0] in labels}
    res["parallel"] = {"tokens": {k: outs.get(k) for k in labels}, "lengths": lengths,
                       "freed_blocks": conn.totals.freed_blocks - freed0, "reports": last,
                       "private_blocks": conn.totals.private_blocks - private0,
                       "rounds": conn.totals.rounds - rounds0, "kept": kept,
                       "request_rounds": {k: ROUNDS.get(k, 0) for k in labels},
                       "free_before": f0, "free_end": _free(llm)}


def run_greedy_long(llm, spec, res):
    """5 prompts generating 256 tokens each (``long_max_tokens``), together (they fit the 100-block pool: no preemption); the
    eviction engine is given a budget with budget + T >= prompt + generated (no round may run): the tokens
    must be stock's."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    lengths = spec.get("long_lengths", [40, 120, 333, 555, 700])
    prompts = filler_prompts(tok, lengths, 2)
    sp = SamplingParams(max_tokens=spec.get("long_max_tokens", 256), temperature=0, ignore_eos=True,
                        extra_args=spec.get("long_extra_args"))
    engine = llm.llm_engine
    snap = _snapshot(llm)
    for i, p in enumerate(prompts):
        engine.add_request(f"L{i}", {"prompt_token_ids": p}, sp)
    outs = _drain(llm)
    res["greedy_long"] = [outs[f"L{i}"] for i in range(len(prompts))]
    conn = _core(llm).scheduler.connector
    res["greedy_long_rounds"] = _deltas(llm, snap)["rounds"] if conn else None


def run_decode_bound(llm, spec, res):
    """A long prompt with a long answer and short prompts with very long answers, together (the last with a
    budget that is not a whole number of blocks): the blocks each holds in vLLM's pool after every engine
    step, vLLM's own used-block count (its free queue) at the same moment, and the rounds each ran."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    cases = spec.get("bound_cases", [[1200, 700], [80, 700], [80, 300, {"kv_budget": 200}]])
    prompts = filler_prompts(tok, [c[0] for c in cases], 4)
    engine = llm.llm_engine
    extra = spec.get("bound_extra_args")
    lp = 0 if spec.get("bound_logprobs") else None  # the sampled token's logprob: NaN anywhere shows there
    snap = _snapshot(llm)
    for i, (p, case) in enumerate(zip(prompts, cases)):
        engine.add_request(f"B{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=case[1], temperature=0, ignore_eos=True, logprobs=lp,
                                          extra_args={**(extra or {}), **(case[2] if len(case) > 2 else {})}))
    traces: dict[str, list[int]] = {f"B{i}": [] for i in range(len(cases))}
    computed: dict[str, list[int]] = {f"B{i}": [] for i in range(len(cases))}
    used: list[list] = []  # after every step: [vLLM's used blocks (free queue), {request: blocks it holds}]
    sched = _core(llm).scheduler
    pool = sched.kv_cache_manager.block_pool
    # the test's own reading of vLLM's pool at the moment the plugin samples it (the scheduler has allocated
    # the step's blocks, the plugin has taken the blocks of the windows it starts capturing)
    during: dict[str, list[int]] = {f"B{i}": [] for i in range(len(cases))}
    conn = sched.connector
    if conn is not None:
        orig_meta = conn.build_connector_meta

        def build_connector_meta(scheduler_output):
            meta = orig_meta(scheduler_output)  # takes the blocks of the windows this step starts capturing
            held = _held(llm)
            for rid in scheduler_output.num_scheduled_tokens:
                key = rid.split("-")[0]
                if key in during:
                    during[key].append(held[key])
            return meta

        conn.build_connector_meta = build_connector_meta

    def on_step():
        held = _held(llm)
        for rid in traces:
            if rid in held:
                traces[rid].append(held[rid])
        for r in sched.requests.values():
            key = r.request_id.split("-")[0]
            if key in computed:
                computed[key].append(r.num_computed_tokens)
        used.append([pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks, held])

    finite = {} if lp is not None else None
    outs = _drain(llm, on_step, finite=finite)
    if conn is not None:
        conn.build_connector_meta = orig_meta
    kv_held = {k.split("-")[0]: v for k, v in conn.totals.kv_held.items()} if conn is not None else {}
    d = _deltas(llm, snap)
    res["decode_bound"] = {"cases": cases, "held": traces, "computed": computed, "during": during, "used": used,
                           "plugin_kv_held": {k: v for k, v in kv_held.items() if k in during},
                           "block_size": sched.kv_cache_manager.coordinator.single_type_managers[0].block_size,
                           "rounds": d["rounds"], "failures": d["failures"],
                           "request_rounds": {k: ROUNDS.get(k, 0) for k in traces}, "free_end": _free(llm),
                           "num_blocks": pool.num_gpu_blocks, "generated": {k: len(v) for k, v in outs.items()},
                           "finite": finite}


def run_budget_formula(llm, spec, res):
    """Several budgets (with and without moments) on prompts of several lengths, prefill-only rounds
    (T = 0): the blocks each request holds right after its prefill step, from vLLM's pool, and its layout."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    rows = []
    engine = llm.llm_engine
    cases = spec.get("formula_cases", [])
    for i, (n, budget, moments) in enumerate(cases):
        prompt = filler_prompts(tok, [n], 30 + i)[0]
        rid = f"F{i}"
        extra = {"kv_budget": budget, "kv_moment_correction": moments, "kv_decode_interval": 0}
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, extra_args=extra))
        held_after_prefill, lay = None, None
        while engine.has_unfinished_requests():
            engine.step()
            if held_after_prefill is None:
                held_after_prefill = _held(llm).get(rid)
                lay = _layout_of(rid)
        rows.append({"prompt": n, "budget": budget, "moments": moments, "held": held_after_prefill,
                     "K": None if lay is None else lay.kept_blocks,
                     "moment_pages": None if lay is None or lay.moment_page_ids is None
                     else int(lay.moment_page_ids.shape[1])})
    res["budget_formula"] = rows


def run_short_moments(llm, spec, res):
    """The reliability bug: moment correction on ordinary short prompts (20..300 tokens) at budget 128, in
    one batch, with decode-time rounds; every request must finish and the engine go on."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    lengths = spec.get("short_lengths", [20, 60, 100, 106, 150, 200, 300])
    prompts = filler_prompts(tok, lengths, 8)
    engine = llm.llm_engine
    extra = {"kv_budget": 128, "kv_moment_correction": True, "kv_decode_interval": 32}
    snap = _snapshot(llm)
    for i, p in enumerate(prompts):
        engine.add_request(f"S{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, extra_args=extra))
    reasons: dict = {}
    outs = _drain(llm, reasons=reasons)
    conn = _core(llm).scheduler.connector
    res["short_moments"] = {"lengths": lengths, "tokens": {k: len(v) for k, v in outs.items()},
                            "reasons": reasons, "failures": _deltas(llm, snap)["failures"], "free_end": _free(llm),
                            "request_rounds": {f"S{i}": ROUNDS.get(f"S{i}", 0) for i in range(len(prompts))},
                            "nonfinite_cache_elements": _nonfinite_cache_elements()}


def _nonfinite_cache_elements() -> int:
    """NaN / inf elements anywhere in the layers' KV caches (raw moment bits left in blocks back in vLLM's
    pool would show here: another request's attention reads such blocks past its own tokens)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    ws = get_kv_transfer_group().worker_side
    return int(sum(int((~torch.isfinite(kv)).sum()) for _, kv in ws.caches.named))


def run_faults(llm, spec, res):
    """The test-only fault switch is on (see the engine's env): a batch of ordinary evicting requests, some
    aborted midway. Every request must end (served, recomputed, or failed alone with an error), the
    failures be counted, and nothing be left in the pool or on the worker."""
    from vllm import SamplingParams


    tok = llm.get_tokenizer()
    rnd = random.Random(13)
    lengths = [rnd.choice([30, 90, 200, 400, 700, 1100]) for _ in range(spec.get("fault_requests", 12))]
    prompts = filler_prompts(tok, lengths, 9)
    engine = llm.llm_engine
    snap = _snapshot(llm)
    for i, p in enumerate(prompts):
        extra = {"kv_moment_correction": bool(i % 2), "kv_decode_interval": 32}
        engine.add_request(f"X{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=rnd.choice([40, 90, 150]), temperature=0, ignore_eos=True,
                                          extra_args=extra))
    aborted = ["X3", "X7"]
    reasons: dict = {}
    step = [0]

    def on_step():
        step[0] += 1
        if step[0] == 40:
            engine.abort_request([r for r in aborted if r not in reasons])

    outs = _drain(llm, on_step, reasons)
    engine.add_request("tail", {"prompt_token_ids": prompts[0][:40]}, SamplingParams(max_tokens=2))
    _drain(llm)
    engine.step()
    sched = _core(llm).scheduler
    st = _worker().requests
    res["faults"] = {"requests": len(prompts), "finished": sorted(outs), "reasons": reasons,
                     "lengths": {k: len(v) for k, v in outs.items()}, "aborted": aborted,
                     **{k: _deltas(llm, snap)[k] for k in ("failures", "rounds")},
                     "free_end": _free(llm), "num_blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
                     "requests_left": len(sched.requests), "worker_requests_left": sorted(st.requests)}


def _run_batch(llm, batch, watch=None) -> tuple[dict, dict, dict]:
    """Add ``(request id, prompt, max tokens, extra args)`` together and drain; -> tokens, finish reasons and
    each request's preemptions (vLLM's counter, read after every step; a recompute is a preemption)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sched = _core(llm).scheduler
    for rid, prompt, n, extra in batch:
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra))
    ids = {rid for rid, *_ in batch}
    preempted = dict.fromkeys(ids, 0)

    def on_step():
        for r in sched.requests.values():
            key = r.request_id.split("-")[0]
            if key in ids:
                preempted[key] = r.num_preemptions

    reasons: dict = {}
    outs = _drain(llm, on_step, reasons)
    return outs, {k.split("-")[0]: str(v) for k, v in reasons.items()}, preempted


def _leftovers(llm) -> dict:
    """After one more tiny request (so the worker sees the last finished ids): what is still held."""
    from vllm import SamplingParams


    engine = llm.llm_engine
    engine.add_request("tail", {"prompt_token_ids": list(range(200, 240))}, SamplingParams(max_tokens=2))
    _drain(llm)
    engine.step()
    sched = _core(llm).scheduler
    pool = sched.kv_cache_manager.block_pool
    return {"free_end": pool.free_block_queue.num_free_blocks, "num_blocks": pool.num_gpu_blocks,
            "requests_left": len(sched.requests), "worker_requests_left": sorted(_worker().requests.requests)}


def run_fault_paths(llm, spec, res):
    """Each failure path on purpose (the engine's fault switch names these requests; no prefix caching):
    - FA4..FA7, the greedy prompts of 333..700 tokens at budget 128 with one round at the prompt end (T = 0),
      whose compaction fails after the first layer moved: recomputed densely, so their tokens must be the
      stock engine's greedy tokens;
    - FF0 (its attention op fails in its 3rd step as a compacted request) and FM0 (its compacted rows' page
      table cannot be built in its 3rd such step) in a batch with FO1 and FO2, then the same four prompts
      again under ids the switch does not name (GF0, GM0, GO1, GO2)."""
    tok = llm.get_tokenizer()
    greedy = filler_prompts(tok, spec.get("greedy_lengths", [37, 90, 150, 260, 333, 480, 555, 700]), 1)
    snap = _snapshot(llm)
    apply_batch = [(f"FA{i}", greedy[i], 24, {"kv_budget": 128, "kv_decode_interval": 0}) for i in range(4, 8)]
    toks, reasons, preempted = _run_batch(llm, apply_batch)
    apply_d = _deltas(llm, snap)
    prompts = filler_prompts(tok, [500, 420, 380, 450], 91)
    extra = {"kv_budget": 128, "kv_decode_interval": 32}
    snap2 = _snapshot(llm)
    named = [(rid, p, 40, extra) for rid, p in zip(("FF0", "FM0", "FO1", "FO2"), prompts)]
    toks2, reasons2, _ = _run_batch(llm, named)
    step_d = _deltas(llm, snap2)
    twins = [("G" + rid[1:], p, n, x) for rid, p, n, x in named]
    toks3, reasons3, _ = _run_batch(llm, twins)
    res["fault_paths"] = {
        "apply": {"tokens": {k: toks.get(k) for k, *_ in apply_batch}, "reasons": reasons, "preempted": preempted,
                  "greedy_index": {f"FA{i}": i for i in range(4, 8)}, **apply_d,
                  "request_rounds": {k: ROUNDS.get(k, 0) for k, *_ in apply_batch}},
        "step": {"tokens": {**{k: toks2.get(k) for k, *_ in named}, **{k: toks3.get(k) for k, *_ in twins}},
                 "reasons": {**reasons2, **reasons3}, **step_d,
                 "twins_failures": _deltas(llm, snap2)["failures"]},
        **_leftovers(llm)}


def run_fault_raise(llm, spec, res):
    """Faults raised inside the attention backend (the engine's fault switch names RB0, RI0, RK0: each in its
    3rd step as a compacted request, 200-token prompts at budget 64, one round at the prompt end), each in a
    batch with another compacted request (RB1, RI1, RK1) and a dense one (NB0, NI0, NK0), then the nine
    prompts again, together, under ids the switch does not name (G + the id):
    - RB0: the metadata builder raises, so vLLM's kernel runs every row as stock;
    - RI0: the compacted attention op raises (its best implementation and the torch reference);
    - RK0: only its best implementation raises; the torch reference serves the step."""
    prompts = iter(filler_prompts(llm.get_tokenizer(), [200] * 9, 97))
    extra, dense = {"kv_budget": 64, "kv_decode_interval": 0}, {"kv_policy": "none"}
    toks, reasons, failures, named = {}, {}, {}, []
    for k in "BIK":
        batch = [(f"R{k}0", next(prompts), 8, extra), (f"R{k}1", next(prompts), 8, extra),
                 (f"N{k}0", next(prompts), 8, dense)]
        snap = _snapshot(llm)
        t, r, _ = _run_batch(llm, batch)
        failures[k] = _deltas(llm, snap)["failures"]
        toks.update({rid: t.get(rid) for rid, *_ in batch})
        reasons.update(r)
        named += batch
    snap = _snapshot(llm)
    t, r, _ = _run_batch(llm, [("G" + rid, p, n, x) for rid, p, n, x in named])
    toks.update({"G" + rid: t.get("G" + rid) for rid, *_ in named})
    reasons.update(r)
    res["fault_raise"] = {"tokens": toks, "reasons": reasons, "failures": failures,
                          "twins_failures": _deltas(llm, snap)["failures"],
                          "request_rounds": {k: ROUNDS.get(k, 0) for k in toks}, **_leftovers(llm)}


def run_fault_prefix(llm, spec, res):
    """Apply failures with prefix caching on (the engine's fault switch names PA0 round 2 and PB0 round 1),
    all on one 500-token prompt at budget 128, T = 64, 100 generated tokens, together with QA0 (the same
    request, not named) and QB0 (eviction off): PB0's first round packs into private blocks (its blocks are
    hashed), so its failure moved nothing of the request's own: served on as it is (counted as a plan
    failure). PA0's second round compacts in place (a compacted request's blocks are no longer hashed): it is
    recomputed densely. Then QC0: eviction off, prompt = the prompt + PA0's tokens up to its failed round,
    generating the rest -- what the recompute must have produced."""
    tok = llm.get_tokenizer()
    prompt = filler_prompts(tok, [500], 93)[0]
    n, bs, budget, interval = 100, 32, 128, 64
    extra = {"kv_budget": budget, "kv_decode_interval": interval}
    snap = _snapshot(llm)
    batch = [("PA0", prompt, n, extra), ("PB0", prompt, n, extra), ("QA0", prompt, n, extra),
             ("QB0", prompt, n, {"kv_policy": "none"})]
    toks, reasons, preempted = _run_batch(llm, batch)
    d = _deltas(llm, snap)
    # PA0's second round runs in the step that computes token (P // bs) * bs + T, i.e. with g tokens generated
    g = len(prompt) // bs * bs + interval - len(prompt) + 1
    pa = toks.get("PA0") or []
    cont, creasons, _ = _run_batch(llm, [("QC0", prompt + pa[:g], n - g, {"kv_policy": "none"})])
    res["fault_prefix"] = {"tokens": {**{k: toks.get(k) for k, *_ in batch}, "QC0": cont.get("QC0")},
                           "reasons": {**reasons, **creasons}, "preempted": preempted, "g": g, **d,
                           "request_rounds": {k: ROUNDS.get(k, 0) for k, *_ in batch},
                           "prefix_caching": bool(_core(llm).scheduler.kv_cache_manager.block_pool.enable_caching),
                           **_leftovers(llm)}


def run_context_boundary(llm, spec, res):
    """Query-agnostic prompts (context + question, ``kv_context_len`` = the context): per step, each request's
    computed tokens (the scheduler's request state) and blocks held (vLLM's pool), whether it is compacted
    (the worker's layout) and its greedy tokens. Cases: budget >= context (nothing to evict), budget <
    context in the default mode (the prefill stops at the boundary) and in ``score_only`` mode."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    ctx_len, q_len = spec.get("cb_context", 900), spec.get("cb_question", 100)
    ctxs = filler_prompts(tok, [ctx_len] * 3, 41)
    questions = filler_prompts(tok, [q_len] * 3, 42)
    engine = llm.llm_engine
    sched = _core(llm).scheduler
    cases = {"keep": {"kv_budget": 4096}, "evict": {"kv_budget": 128}, "score_only": {"kv_budget": 128,
                                                                                     "kv_agnostic_mode": "score_only"}}
    ctx_lens = {name: ctx_len for name in cases}
    if spec.get("cb_aligned"):  # the same as "evict" with a context a whole number of blocks long
        cases["aligned"] = {"kv_budget": 128}
        ctxs.append(filler_prompts(tok, [spec["cb_aligned"]], 43)[0])
        questions.append(questions[1])
        ctx_lens["aligned"] = spec["cb_aligned"]
    labels = []
    for i, (name, extra) in enumerate(cases.items()):
        rid = f"C{name}"
        labels.append(rid)
        prompt = ctxs[i] + questions[i]
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=spec.get("cb_max_tokens", 24), temperature=0, ignore_eos=True,
                                          extra_args={**extra, "kv_context_len": ctx_lens[name]}))
    trace: dict[str, list] = {rid: [] for rid in labels}

    def on_step():
        held = _held(llm)
        for r in sched.requests.values():
            key = r.request_id.split("-")[0]
            if key in trace:
                lay = _layout_of(key)
                trace[key].append([r.num_computed_tokens, held.get(key),
                                   None if lay is None else lay.region_blocks])

    outs = _drain(llm, on_step)
    res["context_boundary"] = {"context": ctx_len, "question": q_len, "trace": trace, "contexts": ctx_lens,
                               "tokens": {k: outs.get(k) for k in labels}, "free_end": _free(llm),
                               "prompts": {k: ctxs[i] + questions[i] for i, k in enumerate(labels)}}


def run_protocol(llm, spec, res):
    """Query-agnostic protocol check material: a context + a short question, kv_context_len = the context,
    in the default mode and in score_only mode (short enough that no round runs after the context's): the
    positions each head kept at the context round, and the greedy tokens with their log-probabilities."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    ctx = filler_prompts(tok, [spec.get("proto_context", 800)], 51)[0]
    question = tok.encode(" Question: what did the people keep records of? Answer:", add_special_tokens=False)
    prompt = ctx + question
    engine = llm.llm_engine
    out = {"context": ctx, "question": question}
    for mode in ("prefill", "score_only"):
        rid = f"proto{mode}"
        extra = {"kv_budget": 128, "kv_context_len": len(ctx), "kv_agnostic_mode": mode, "kv_decode_interval": 64}
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=spec.get("proto_max_tokens", 10), temperature=0,
                                          ignore_eos=True, logprobs=1, extra_args=extra))
        kept, region = None, None
        toks, lps = [], []
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    toks = list(o.outputs[0].token_ids)
                    lps = [float(d[t].logprob) for t, d in zip(toks, o.outputs[0].logprobs)]
            lay = _layout_of(rid)
            if lay is not None and kept is None:
                region = lay.region_blocks
                kept = [[lay.kept_positions(layer, h).tolist() for h in range(lay.num_kv_heads)]
                        for layer in range(lay.num_layers)]
        out[mode] = {"tokens": toks, "logprobs": lps, "kept": kept, "region_blocks": region}
    res["protocol"] = out


def run_spec_decode(llm, spec, res):
    """Draft tokens on compacted requests. In the ``ngram`` engine (n-gram speculative decoding) every decode
    step of a request computes its next token plus up to k drafts; the evicting engine without drafts runs
    the same requests for the reference tokens. SA: a repetitive 704-token prompt compressed once at its end
    (T = 0), 160 generated tokens, so every decode step is a multi-token step on a compacted request. SB: an
    80-token prompt generating 400 tokens with rounds every 64 tokens at budget 128, so rounds run between
    verified drafts. Recorded: the tokens, the blocks each holds after every step (vLLM's pool), the steps
    each ran, rounds and failures."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    base = filler_prompts(tok, [128], 61)[0]
    cases = {"SA": ((base * 6)[:704], 160, {"kv_budget": 128, "kv_decode_interval": 0}),
             "SB": ((base * 2)[:80], 400, {"kv_budget": 128, "kv_decode_interval": 64})}
    engine = llm.llm_engine
    conn = _core(llm).scheduler.connector
    rounds0, fail0 = conn.totals.rounds, sum(conn.totals.failures.values())
    for rid, (p, n, extra) in cases.items():
        engine.add_request(rid, {"prompt_token_ids": p},
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra))
    held: dict[str, list[int]] = {rid: [] for rid in cases}

    def on_step():
        h = _held(llm)
        for rid in cases:
            if rid in h:
                held[rid].append(h[rid])

    outs = _drain(llm, on_step)
    res["spec_decode"] = {"tokens": {rid: outs.get(rid) for rid in cases}, "held": held,
                          "steps": {rid: len(v) for rid, v in held.items()},
                          "rounds": conn.totals.rounds - rounds0,
                          "failures": sum(conn.totals.failures.values()) - fail0, "free_end": _free(llm)}


def _stream_session(llm, rid: str, chunks, max_tokens: int, extra, on_step=None) -> list[list[int]]:
    """One streaming-input session (vLLM 0.32's resumable requests, as AsyncLLM sends them) driven on the
    in-process engine core: each chunk is appended once the previous turn has stopped; -> each turn's
    generated tokens. A final non-resumable request with the same id closes the session."""
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    core = _core(llm)
    sched = core.scheduler

    def add(tokens, resumable):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra)
        # a copy: vLLM extends the session's prompt list in place with every later chunk
        ecr = engine.input_processor.process_inputs(rid, {"prompt_token_ids": list(tokens)}, sp,
                                                    supported_tasks=engine.get_supported_tasks(),
                                                    resumable=resumable)
        req, wave = core.preprocess_add_request(ecr)
        core.add_request(req, wave)

    turns: list[list[int]] = []
    for chunk in chunks:
        add(chunk, True)
        got: list[int] = []
        while True:
            outs, _ = core.step()
            for eco in outs.values():
                for o in eco.outputs:
                    if o.request_id == rid:
                        got.extend(o.new_token_ids)
            if on_step is not None:
                on_step()
            r = sched.requests.get(rid)
            if r is None or r.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                break
        turns.append(got)
    add([0], False)  # the end of the input stream
    while sched.has_requests():
        core.step()
    return turns


def run_streaming_input(llm, spec, res):
    """Streaming-input sessions: a 600-token chunk, then a 150-token and a 200-token chunk appended to the
    running request, 20 generated tokens per turn. ``stream_keep`` (a budget no round reaches, or stock): the
    tokens must be stock's; ``stream_evict`` (the engine's budget, default T): the blocks held after every
    step (vLLM's pool) and each turn's tokens, plus the oracle: ONE ordinary request whose prompt is the
    session's first chunk, the first turn's computed tokens and the second chunk, with ``kv_context_len`` =
    the first chunk (the context is compressed where the session's first chunk ended)."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    chunks = filler_prompts(tok, [600, 150, 200], 71)
    n = spec.get("stream_max_tokens", 20)
    sched = _core(llm).scheduler
    conn = sched.connector
    out = {"chunks": chunks, "keep": _stream_session(llm, "stream_keep", chunks, n, spec.get("stream_keep_args"))}
    engine = llm.llm_engine
    engine.add_request("keep_oracle", {"prompt_token_ids": chunks[0] + out["keep"][0][:-1] + chunks[1]},
                       SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                      extra_args=spec.get("stream_keep_args")))
    out["keep_oracle"] = _drain(llm).get("keep_oracle")
    if conn is not None:
        held: list[int] = []
        rounds0 = conn.totals.rounds
        evict_args = spec.get("stream_evict_args")

        def on_step():
            h = _held(llm).get("stream_evict")
            if h is not None:
                held.append(h)

        turns = _stream_session(llm, "stream_evict", chunks[:2], n, evict_args, on_step)
        out.update(evict=turns, held=held, rounds=conn.totals.rounds - rounds0)
        prompt = chunks[0] + turns[0][:-1] + chunks[1]  # the last sampled token of a turn is not kept
        engine.add_request("stream_oracle", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                          extra_args={**(evict_args or {}), "kv_context_len": len(chunks[0])}))
        out["oracle"] = _drain(llm).get("stream_oracle")
    out["free_end"] = _free(llm)
    res["streaming_input"] = out


def run_prefix_stream(llm, spec, res):
    """An interleaved stream: requests that share a document prefix (two documents), requests that share
    nothing, some arriving together (they prefill their own tails in the same step over the same cached
    blocks), one aborted midway. The same stream runs on an engine with prefix caching off and one with it
    on; the tests compare the tokens. Recorded from vLLM: each request's prefix-cache hit
    (``num_cached_tokens``), the pool at the end, the plugin's counters."""
    from vllm import SamplingParams


    tok = llm.get_tokenizer()
    docs = filler_prompts(tok, [spec.get("ps_doc", 700)] * 2, 61)
    qs = filler_prompts(tok, [spec.get("ps_question", 70)] * 8, 62)
    solo = filler_prompts(tok, [400, 650], 63)
    engine = llm.llm_engine
    sched = _core(llm).scheduler
    max_tokens = spec.get("ps_max_tokens", 100)
    extra = spec.get("ps_extra_args")
    # (arrival step, request id, prompt); requests of one step arrive together
    plan = [(0, "a0", docs[0] + qs[0]), (0, "s0", solo[0]),
            (3, "a1", docs[0] + qs[1]), (3, "a2", docs[0] + qs[2]), (3, "b0", docs[1] + qs[3]),
            (6, "b1", docs[1] + qs[4]), (6, "x0", docs[0] + qs[5]),
            (9, "a3", docs[0] + qs[6]), (9, "b2", docs[1] + qs[7]), (9, "s1", solo[1]),
            (1, "a0r", docs[0] + qs[0])]  # a0 again, right after it: its whole prompt is cached
    # query-agnostic with a context boundary (key norm needs no queries): the repeat must still compute its
    # question over the compressed context, so its hit stops at the boundary
    agnostic = {"kv_policy": "knorm", "kv_context_len": len(docs[1])}
    plan += [(1, "k0", docs[1] + qs[0]), (2, "k0r", docs[1] + qs[0])]
    abort = {"x0": 14}  # aborted at this step
    hits: dict[str, int] = {}  # each request's local prefix-cache hit, as the scheduler uses it
    lookup = sched._get_local_prefix_cache_hit

    def hit(request):
        out = lookup(request)
        hits[request.request_id] = out[1]
        return out

    sched._get_local_prefix_cache_hit = hit
    conn = sched.connector
    names = ("rounds", "freed_blocks", "evicted_requests", "private_blocks")
    t0 = {k: getattr(conn.totals, k) for k in names} if conn else {}
    f0 = dict(conn.totals.failures) if conn else {}
    reasons: dict[str, str] = {}
    outs: dict[str, list[int]] = {}
    step = 0
    pending = list(plan)
    while pending or engine.has_unfinished_requests():
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            engine.add_request(item[1], {"prompt_token_ids": item[2]},
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                              extra_args=agnostic if item[1].startswith("k") else extra))
        for rid, at in abort.items():
            if at == step:
                engine.abort_request([rid])
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
                reasons[o.request_id] = o.outputs[0].finish_reason
        step += 1
    engine.add_request("tail", {"prompt_token_ids": solo[0][:40]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    pool = sched.kv_cache_manager.block_pool
    # vLLM's own free queue: blocks that only shared compressed contexts still hold are not in it; they are
    # counted, then reset_prefix_cache drops the contexts and every block must be back in the queue
    free_before_reset = pool.free_block_queue.num_free_blocks
    shared = conn.scheduler_side.shared if conn else None
    entry_blocks = len({b.block_id for e in shared.entries.values() for b in e.blocks if not b.is_null}) \
        if shared else 0
    llm.reset_prefix_cache()
    engine.step()
    d = {k: getattr(conn.totals, k) - t0[k] for k in names} if conn else dict.fromkeys(names, 0)
    failures = {k: v - f0.get(k, 0) for k, v in conn.totals.failures.items() if v != f0.get(k, 0)} if conn else {}
    res["prefix_stream"] = {
        "tokens": {rid: outs.get(rid) for _, rid, _ in plan}, "reasons": reasons, "hits": hits,
        "prompt_lens": {rid: len(p) for _, rid, p in plan}, "aborted": sorted(abort),
        "free_end": pool.free_block_queue.num_free_blocks, "num_blocks": pool.num_gpu_blocks,
        "free_before_reset": free_before_reset, "entry_blocks": entry_blocks,
        "manager_reqs_left": len(sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks),
        "worker_requests_left": sorted(_worker().requests.requests),
        "rounds": d["rounds"], "freed": d["freed_blocks"], "evicted_requests": d["evicted_requests"],
        "private_blocks": d["private_blocks"], "failures": failures,
        "prefix_caching": bool(pool.enable_caching),
    }


def run_shared_context(llm, spec, res):
    """Compress once, serve many. One document D (its length C is the context boundary, not block-aligned)
    and questions, in phases: A = D+q0 alone, then B = D+q1 alone (default decode interval: B's rounds copy
    on write); with T = 0, P = D+q2 alone, then four at once (D+q3..q6); D+q1 with another budget and with
    another policy; ``reset_prefix_cache``, then D+q0 again. Recorded from vLLM: each request's hit (as the
    scheduler uses it), the tokens each request's first step schedules, vLLM's own free-queue count and each
    request's token count at every step of the four, the tokens, the plugin's counters."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    doc = filler_prompts(tok, [spec.get("sc_doc", 900)], 71)[0]
    qs = filler_prompts(tok, [60] * 8, 72)
    c = len(doc)
    engine = llm.llm_engine
    sched = _core(llm).scheduler
    pool = sched.kv_cache_manager.block_pool
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    conn = sched.connector
    base = {"kv_context_len": c}
    snap = _snapshot(llm)
    hits0 = conn.totals.shared_hits if conn else 0
    hits: dict[str, int] = {}
    first_sched: dict[str, int] = {}
    lookup, schedule = sched._get_local_prefix_cache_hit, sched.schedule

    def hit(request):
        out = lookup(request)
        hits[request.request_id] = out[1]
        return out

    def sched_wrap(*a, **kw):
        out = schedule(*a, **kw)
        for r in out.scheduled_new_reqs:
            first_sched.setdefault(r.req_id, out.num_scheduled_tokens[r.req_id])
        return out

    sched._get_local_prefix_cache_hit, sched.schedule = hit, sched_wrap
    tokens: dict[str, list[int]] = {}
    trace: list = []

    def run(batch, extra, on_step=None):
        for rid, q in batch:
            engine.add_request(rid, {"prompt_token_ids": doc + q},
                               SamplingParams(max_tokens=spec.get("sc_max_tokens", 40), temperature=0,
                                              ignore_eos=True, extra_args={**base, **extra}))
        tokens.update(_drain(llm, on_step))

    def used_blocks():  # vLLM's own count: blocks not in its free queue (the null block excluded)
        return pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks

    run([("A", qs[0])], {})
    run([("B", qs[1])], {})
    private_after_b = conn.totals.private_blocks if conn else 0
    run([("P", qs[2])], {"kv_decode_interval": 0})
    group = [(f"N{i}", qs[3 + i]) for i in range(4)]

    def on_step():
        live = {r.request_id.split("-")[0]: r.num_tokens for r in sched.requests.values()}
        private = {rid.split("-")[0]: sum(1 for b in blocks if not b.is_null and b.ref_cnt == 1)
                   for rid, blocks in mgr.req_to_blocks.items()}
        trace.append([used_blocks(), live, private])

    run(group, {"kv_decode_interval": 0}, on_step)
    shared = conn.scheduler_side.shared if conn else None
    entry_blocks = [len(e.blocks) for e in shared.entries.values()] if shared else []
    run([("Bbudget", qs[1])], {"kv_budget": 256})
    run([("Bknorm", qs[1])], {"kv_policy": "knorm"})
    entries_before_reset = len(shared.entries) if shared else 0
    reset_ok = llm.reset_prefix_cache()
    run([("Areset", qs[0])], {})
    entries_after = len(shared.entries) if shared else 0
    reset_end = llm.reset_prefix_cache()  # the last entry goes: every block back in vLLM's free queue
    engine.step()
    res["shared_context"] = {
        "context": c, "tokens": tokens, "hits": {k.split("-")[0]: v for k, v in hits.items()},
        "first_sched": {k.split("-")[0]: v for k, v in first_sched.items()},
        "prompt_lens": {"A": c + len(qs[0])}, "trace": trace, "entry_blocks": entry_blocks,
        "entries_before_reset": entries_before_reset, "reset_ok": reset_ok,
        "entries_after_reset": entries_after, "reset_end": reset_end,
        "entries_end": len(shared.entries) if shared else 0,
        "shared_hits": conn.totals.shared_hits - hits0 if conn else 0,
        "private_after_b": private_after_b,
        "failures": _deltas(llm, snap)["failures"],
        "free_end": pool.free_block_queue.num_free_blocks, "num_blocks": pool.num_gpu_blocks,
        "prefix_caching": bool(pool.enable_caching),
        "kv_held": {k.split("-")[0]: v for k, v in conn.totals.kv_held.items()} if conn else {},
    }
    sched._get_local_prefix_cache_hit, sched.schedule = lookup, schedule


def run_hybrid(llm, spec, res):
    """A hybrid model (sliding-window and full-attention KV cache groups): one long prompt evicting and the
    same with ``kv_policy`` none; per KV cache group (its spec kind), the blocks the request holds after each
    step (vLLM's managers), vLLM's free count and the tokens; then a decode-time-round request (128 prompt +
    160 generated, T 64) with every held-block sample."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    sched = _core(llm).scheduler
    mgrs = sched.kv_cache_manager.coordinator.single_type_managers
    kinds = [type(g.kv_cache_spec).__name__ for g in sched.kv_cache_config.kv_cache_groups]
    engine = llm.llm_engine
    prompt = filler_prompts(tok, [spec.get("hy_prompt", 2000)], 81)[0]
    snap = _snapshot(llm)
    out = {}
    for rid, extra, n_out in (("H", None, 8), ("Hnone", {"kv_policy": "none"}, 8),
                              ("Hdecode", {"kv_decode_interval": 64}, 160)):
        p = prompt if rid != "Hdecode" else prompt[:128]
        engine.add_request(rid, {"prompt_token_ids": p},
                           SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True, extra_args=extra))
        f0, trace, toks = _free(llm), [], None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    toks = list(o.outputs[0].token_ids)
            q = {r.split("-")[0]: n for r, n in _query_blocks(llm).items()}
            group = sched.connector.scheduler_side.blocks.group if sched.connector else -1
            held = [sum(1 for b in blocks if not b.is_null) + (q.get(rid, 0) if i == group else 0)
                    for i, m in enumerate(mgrs) for r, blocks in m.req_to_blocks.items() if r.split("-")[0] == rid]
            if held:
                trace.append(held)
        out[rid] = {"tokens": toks, "trace": trace, "free_before": f0, "free_end": _free(llm), "prompt": len(p)}
    conn = sched.connector
    res["hybrid"] = {"kinds": kinds, "runs": out, "block_size": mgrs[0].block_size,
                     "failures": _deltas(llm, snap)["failures"],
                     "kv_held": {k.split("-")[0]: v for k, v in conn.totals.kv_held.items()} if conn else {}}


def run_compare(llm, spec, res):
    """Token-id prompts, one case of per-request extra args at a time (``compare_cases``, each generating
    ``compare_case_tokens`` or ``compare_max_tokens``): each request's greedy tokens and the blocks it holds in vLLM's pool after every step (read from vLLM's manager)."""
    from vllm import SamplingParams

    lengths = spec.get("compare_lengths", [40, 130, 200])
    prompts = _prompts(500, lengths, 3)
    out = []
    cases = spec.get("compare_cases", [None])
    max_tokens = spec.get("compare_case_tokens") or [spec.get("compare_max_tokens", 48)] * len(cases)
    for extra, n in zip(cases, max_tokens):
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra)
        for i, p in enumerate(prompts):
            llm.llm_engine.add_request(f"c{len(out)}_{i}", {"prompt_token_ids": p}, sp)
        held: list[dict[str, int]] = []
        toks = _drain(llm, lambda: held.append(_held(llm)))
        out.append({"tokens": [toks[f"c{len(out)}_{i}"] for i in range(len(prompts))], "held": held})
    res["compare"] = out
    from vllm_contour import ops

    res["ops_calls"] = {f"{op}:{impl}": n for (op, impl), n in ops.CALLS.items()}


def run_kvzip(llm, spec, res):
    """KVzip inside the engine (prefix caching on): request KA (chat-template prefix + a context, then a
    question; ``kv_context_len`` = the context, ``kvzip`` at 128) beside KN (no eviction) in the same steps;
    then KN alone; then KB, the same context with another question. Per step: KA's computed tokens after the
    step (and, when the scheduler schedules hidden reconstruction requests, their ids and blocks then); the reconstruction scores the round planned with (the
    worker's ``plan_rounds`` call, watched); KA's kept positions, tokens and log-probabilities; the reference
    counts of the hidden requests' blocks at the end (vLLM's pool); the scheduler's counters around KB."""
    from vllm import SamplingParams

    from vllm_contour.integration.worker import rounds as worker_rounds
    from vllm_contour.integration.reconstruction.prompt import RepeatPrompt

    tok = llm.get_tokenizer()
    rp = RepeatPrompt.from_tokenizer(tok)
    ctx = list(rp.prefix) + filler_prompts(tok, [spec.get("kz_context", 700)], 61)[0]
    q1 = tok.encode(" Question: what did the people keep records of? Answer:", add_special_tokens=False)
    q2 = tok.encode(" Question: who wrote the numbers down? Answer:", add_special_tokens=False)
    other = filler_prompts(tok, [200], 62)[0]
    engine, core = llm.llm_engine, _core(llm)
    sched = core.scheduler
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    seen: list = []
    real = worker_rounds.plan_rounds

    def watched(*a, **kw):
        seen.extend(r.reconstruction.clone() for r in a[1] if r.reconstruction is not None)
        return real(*a, **kw)

    recon = sched.connector.scheduler_side.recon
    real_step = recon.step
    trace, hidden_blocks, kept = [], set(), None

    def watched_step(scheduled, *a):  # the scheduler's step of the hidden requests: what they hold then
        n = real_step(scheduled, *a)
        for r in scheduled:
            hidden_blocks.update(b.block_id for b in mgr.req_to_blocks.get(r, []) if not b.is_null)
        ka = next((r for k, r in sched.requests.items() if k.startswith("KA")), None)
        trace.append({"ka": None if ka is None else ka.num_computed_tokens, "hidden": sorted(scheduled)})
        return n

    kz = {"kv_policy": "kvzip", "kv_budget": 128, "kv_context_len": len(ctx)}
    sp = dict(temperature=0, ignore_eos=True, logprobs=1)
    worker_rounds.plan_rounds = watched
    recon.step = watched_step
    try:
        engine.add_request("KA", {"prompt_token_ids": ctx + q1}, SamplingParams(max_tokens=10, extra_args=kz, **sp))
        engine.add_request("KN", {"prompt_token_ids": other},
                           SamplingParams(max_tokens=30, extra_args={"kv_policy": "none"}, **sp))
        outs: dict = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    toks = list(o.outputs[0].token_ids)
                    outs[o.request_id] = {"tokens": toks, "logprobs": [float(d[t].logprob) for t, d in
                                                                       zip(toks, o.outputs[0].logprobs)]}
            ka = next((r for k, r in sched.requests.items() if k.startswith("KA")), None)
            trace.append({"ka": None if ka is None else ka.num_computed_tokens, "hidden": []})
            lay = _layout_of("KA")
            if lay is not None and kept is None:
                kept = [[lay.kept_positions(layer, h).tolist() for h in range(lay.num_kv_heads)]
                        for layer in range(lay.num_layers)]
        engine.add_request("KN2", {"prompt_token_ids": other},
                           SamplingParams(max_tokens=30, extra_args={"kv_policy": "none"}, **sp))
        alone = _drain(llm)
        side = sched.connector.scheduler_side
        before = {"reconstructions": side.totals.reconstructions, "shared_hits": side.totals.shared_hits}
        engine.add_request("KB", {"prompt_token_ids": ctx + q2}, SamplingParams(max_tokens=10, extra_args=kz, **sp))
        kb_first = []
        while engine.has_unfinished_requests():
            engine.step()
            kb = next((r for k, r in sched.requests.items() if k.startswith("KB")), None)
            if kb is not None and not kb_first:
                kb_first.append(kb.num_computed_tokens)
        after = {"reconstructions": side.totals.reconstructions, "shared_hits": side.totals.shared_hits}
    finally:
        worker_rounds.plan_rounds = real
        recon.step = real_step
    pool = sched.kv_cache_manager.block_pool
    res["kvzip"] = {
        "context": ctx, "question": q1, "chunks_prefix": list(rp.prefix),
        "repeat": {"first": list(rp.first), "later": list(rp.later), "suffix": list(rp.suffix)},
        "trace": trace, "kept": kept, "outs": outs, "alone": alone.get("KN2"),
        "scores": [s.tolist() for s in seen],
        "hidden_blocks": sorted(hidden_blocks),
        "hidden_refs": [pool.blocks[b].ref_cnt for b in sorted(hidden_blocks)],
        "counters_kb": [before, after], "kb_first_computed": kb_first[0] if kb_first else None, "kb_prompt": len(ctx + q2),
        "tokens_counted": side.totals.reconstruction_tokens}


def run_kvzip_reuse(llm, spec, res):
    """KVzip with prefix caching off (no compressed context is shared): a request KA reconstructs its context,
    then KB with the same prompt. The scores each round planned with, each request's kept positions and
    tokens, the scheduler's counters around each."""
    from vllm import SamplingParams

    from vllm_contour.integration.worker import rounds as worker_rounds
    from vllm_contour.integration.reconstruction.prompt import RepeatPrompt

    tok = llm.get_tokenizer()
    rp = RepeatPrompt.from_tokenizer(tok)
    ctx = list(rp.prefix) + filler_prompts(tok, [500], 64)[0]
    q = tok.encode(" Question: what did the people keep records of? Answer:", add_special_tokens=False)
    side = _core(llm).scheduler.connector.scheduler_side
    seen: dict = {}
    real = worker_rounds.plan_rounds
    kept: dict = {}

    def watched(*a, **kw):
        for r in a[1]:
            if r.reconstruction is not None:
                seen.setdefault(len(seen), r.reconstruction.clone().tolist())
        return real(*a, **kw)

    def counters():
        return {"reconstructions": side.totals.reconstructions, "reused": side.totals.reconstructions_reused,
                "failures": dict(side.totals.failures)}

    kz = {"kv_policy": "kvzip", "kv_budget": 128, "kv_context_len": len(ctx)}
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args=kz)
    steps, outs = [counters()], {}
    worker_rounds.plan_rounds = watched
    try:
        for rid in ("KA", "KB"):
            llm.llm_engine.add_request(rid, {"prompt_token_ids": ctx + q}, sp)

            def grab(rid=rid):
                lay = _layout_of(rid)
                if lay is not None and rid not in kept:
                    kept[rid] = [[lay.kept_positions(layer, h).tolist() for h in range(lay.num_kv_heads)]
                                 for layer in range(lay.num_layers)]

            outs.update(_drain(llm, on_step=grab))
            steps.append(counters())
    finally:
        worker_rounds.plan_rounds = real
    res["kvzip_reuse"] = {"counters": steps, "scores": [seen[i] for i in sorted(seen)], "kept": kept,
                          "tokens": outs, "free_end": _free(llm),
                          "num_blocks": _core(llm).scheduler.kv_cache_manager.block_pool.num_gpu_blocks}


def run_kvzip_stream(llm, spec, res):
    """KVzip over a streaming-input session (prefix caching on): a 500-token chunk, then a 200-token chunk
    appended, ``kvzip`` at 128, 8 tokens a turn. The reconstruction scores each round planned with (and the
    session's tokens then), the blocks the session holds after every step (vLLM's pool), the blocks of the
    hidden requests (their reference counts at the end), the scheduler's counters around the session."""
    from vllm_contour.integration.worker import rounds as worker_rounds

    tok = llm.get_tokenizer()
    chunks = filler_prompts(tok, [500, 200], 63)
    sched = _core(llm).scheduler
    side = sched.connector.scheduler_side
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    seen: list = []
    real = worker_rounds.plan_rounds

    def watched(*a, **kw):
        for r in a[1]:
            if r.reconstruction is not None:
                req = sched.requests.get("KS")
                seen.append({"scores": r.reconstruction.clone().tolist(), "num_tokens": r.num_tokens,
                             "tokens": list(req.all_token_ids) if req is not None else None,
                             "region_blocks": None if r.prev is None else r.prev.region_blocks})
        return real(*a, **kw)

    held, hidden = [], set()
    real_step = side.recon.step

    def watched_step(scheduled, *a):  # the scheduler's step of the hidden requests: what they hold then
        n = real_step(scheduled, *a)
        for r in scheduled:
            hidden.update(b.block_id for b in mgr.req_to_blocks.get(r, []) if not b.is_null)
        return n

    before = {"reconstructions": side.totals.reconstructions, "failures": dict(side.totals.failures)}
    worker_rounds.plan_rounds = watched
    side.recon.step = watched_step
    try:
        turns = _stream_session(llm, "KS", chunks, 8, {"kv_policy": "kvzip", "kv_budget": 128},
                                lambda: held.append(_held(llm).get("KS")))
    finally:
        worker_rounds.plan_rounds = real
        side.recon.step = real_step
    pool = sched.kv_cache_manager.block_pool
    res["kvzip_stream"] = {
        "chunks": chunks, "turns": turns, "rounds": seen, "held": held,
        "hidden_refs": [pool.blocks[b].ref_cnt for b in sorted(hidden)],
        "counters": [before, {"reconstructions": side.totals.reconstructions,
                              "failures": dict(side.totals.failures)}], "free_end": _free(llm)}


SCENARIOS = {"compare": run_compare, "fault_paths": run_fault_paths, "fault_prefix": run_fault_prefix, "fault_raise": run_fault_raise, "greedy_exact": run_greedy_exact,
             "hybrid": run_hybrid, "shared_context": run_shared_context, "greedy_none": run_greedy_none, "prefix_stream": run_prefix_stream, "streaming_input": run_streaming_input, "kvzip_stream": run_kvzip_stream, "spec_decode": run_spec_decode, "protocol": run_protocol, "context_boundary": run_context_boundary, "greedy_long": run_greedy_long, "decode_bound": run_decode_bound, "budget_formula": run_budget_formula,
             "short_moments": run_short_moments, "faults": run_faults,
             "parallel": run_parallel, "greedy_evicted": run_greedy_evicted, "presets": run_presets, "greedy": run_greedy, "free_blocks": run_free_blocks, "concurrency": run_concurrency,
             "preempt_abort": run_preempt_abort, "kvzip": run_kvzip, "kvzip_reuse": run_kvzip_reuse}


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    if spec.get("triton_on_cpu") or spec.get("mrv2"):  # Triton for vLLM on CPU (tests only): Model Runner V2's
        from tests.integration import triton_on_cpu  # kernels and the plugin's CUDA backend, interpreted

        triton_on_cpu.enable()
    from vllm import LLM

    if spec.get("triton_on_cpu"):
        triton_on_cpu.register()
    if spec.get("mrv2"):
        triton_on_cpu.fast_greedy_sampler()

    t0 = time.time()
    llm = LLM(**spec["llm"])
    res = {"startup_s": time.time() - t0}
    core = _core(llm)
    res["num_gpu_blocks"] = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    driver = getattr(core.model_executor, "driver_worker", None)  # None: workers in other processes (TP/PP)
    runner = driver.worker.model_runner if driver is not None else None
    res["attn_impl"] = runner.attn_groups[0][0].backend.__name__ \
        if runner is not None and hasattr(runner, "attn_groups") else None
    res["runner"] = None if runner is None else f"{type(runner).__module__}.{type(runner).__name__}"
    from vllm.v1.request import Request

    init = Request.__init__  # the plugin calls it (KVzip's hidden requests) and never replaces it
    res["request_init_intact"] = (init.__module__, init.__qualname__, hasattr(init, "__contour_original__")) == \
        ("vllm.v1.request", "Request.__init__", False)
    res["connector"] = type(core.scheduler.connector).__name__ if core.scheduler.connector else None
    _log_rounds(core)
    StepGuard(llm).install()
    for name in spec["scenarios"]:
        t = time.time()
        print(f"contour-test: scenario {name} starts", file=sys.stderr, flush=True)
        SCENARIOS[name](llm, spec, res)
        res[f"{name}_s"] = time.time() - t
        print(f"contour-test: scenario {name} took {res[f'{name}_s']:.1f} s", file=sys.stderr, flush=True)
    json.dump(res, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

