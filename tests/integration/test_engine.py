"""vLLM offline engine on the real default model (SmolLM2-135M-Instruct): stock vs plugin."""

import math

import pytest

from .conftest import run_engine


def _bound(budget: int, interval: int, moments: bool = False, elem: int = 4, query_elem: int = 4) -> int:
    """budget.py's bound on the blocks a SmolLM2 request (3 KV heads of 64 dims, 9 query heads, fp32, block 32)
    holds after every engine step once prefilled, for the snapkv engines' defaults and these overrides: with
    its window queries' blocks (SnapKV scores with a 32-query window). ``elem`` / ``query_elem``: bytes of a
    cache element and of a query element (fp8 pages under a bf16 model: 1 and 2)."""
    from vllm_contour.budget import CacheShape, query_blocks_for, request_budget
    from vllm_contour.config import EvictionConfig, resolve_request

    params = resolve_request(EvictionConfig(policy="snapkv", budget=128),
                             {"kv_budget": budget, "kv_decode_interval": interval, "kv_moment_correction": moments})
    pb = request_budget(params, CacheShape(block_size=32, num_kv_heads=3, head_dim=64, elem_size=elem),
                        per_request=True)
    return pb.held_blocks_bound(interval, query_blocks_for(params.window, 3, 32, query_elem, elem))


def _expected_rounds(prompt: int, generated: int, budget: int, interval: int, bs: int = 32) -> int:
    """The rounds the plugin's round clock (``round_clock.next_round``) implies for one request decoding one
    token a step; each round compacts up to the last full block (E = tokens with KV // bs). The last step
    computes prompt + generated - 1 tokens."""
    from vllm_contour.round_clock import ClockState, next_round

    s = ClockState(prefill_end=prompt, budget=budget, interval=interval, block_size=bs)
    last, n = prompt + generated - 1, 0
    due = next_round(s)
    while due is not None and due <= last:
        n += 1
        s = ClockState(prefill_end=prompt, budget=budget, interval=interval, block_size=bs, tried=True,
                       compacted=True, region_blocks=due // bs)
        due = next_round(s)
    return n


def test_plugin_off_is_stock(stock, plugin_off):
    # Same greedy tokens for 8 prompts of different lengths, same pool size, same free-block trajectory.
    assert plugin_off["greedy"] == stock["greedy"]
    assert plugin_off["num_gpu_blocks"] == stock["num_gpu_blocks"]
    assert plugin_off["greedy_free_trace"] == stock["greedy_free_trace"]
    assert plugin_off["connector"] is None
    assert "vllm-contour plugin registered" in plugin_off["log"]
    assert "vllm-contour plugin registered" not in stock["log"]


def test_a_snapkv_engine_leaves_vllms_request_as_vllm_defined_it(stock, evicting):
    assert evicting["request_init_intact"] and stock["request_init_intact"]


def test_budget_above_prompt_gives_stock_tokens(stock, evicting):
    assert evicting["connector"] == "ContourKVConnector"
    assert evicting["greedy"] == stock["greedy"]


def test_budget_exactly_the_prompt_gives_stock_tokens(stock, evicting):
    """Budget = each prompt's own length (seven of the eight; the 37-token prompt is below the floor of 64), one
    round at the prompt end (T = 0): the prompt fits, the round keeps everything (no request compacted, no block
    freed) and the tokens are stock's."""
    ex = evicting["greedy_exact"]
    assert ex["tokens"] == stock["greedy"]
    assert ex["rounds"] == ex["evicted_requests"] == ex["freed_blocks"] == 0 and ex["failures"] == {}, ex


def test_budget_plus_interval_above_the_generation_gives_stock_tokens(stock, evicting):
    """5 prompts x 160 generated tokens, budget 1024 + T 64 >= prompt + generated: no round may run and the
    greedy tokens are stock's, token for token."""
    assert evicting["greedy_long_rounds"] == 0
    assert all(len(t) == 160 for t in stock["greedy_long"])
    assert evicting["greedy_long"] == stock["greedy_long"]


def _held(case):
    """Blocks vLLM's pool handed to the request right after its prefill step."""
    return case["free_before"] - case["free_trace"][0]


def _check_free_blocks(cases, bs):
    for case in cases:
        lay = case["layout"]
        assert lay is not None, "request was not compacted"
        n = case["prompt_tokens"]
        assert lay["E"] == n // bs
        stock_held = math.ceil(n / bs)
        # vLLM's own pool: held blocks after the prefill step = stock - (E - K)
        assert _held(case) == stock_held - (lay["E"] - lay["K"])
        assert case["free_end"] == case["free_before"]  # all returned when the request ends


def test_free_blocks_rise_by_the_layout_prediction(stock, evicting):
    s = stock["free_blocks"][0]
    bs = s["block_size"]
    _check_free_blocks(evicting["free_blocks"], bs)
    assert _held(s) == math.ceil(2000 / bs)


def test_layout_is_ragged_and_sums_over_heads(evicting):
    case = evicting["free_blocks"][0]  # adakv (AdaKV allocation on SnapKV scores)
    pages = case["layout"]["pages"]
    h = len(pages[0])
    assert any(len(set(layer)) > 1 for layer in pages), "no layer gives its heads different budgets"
    k = max(math.ceil(sum(layer) / h) for layer in pages)
    assert case["layout"]["K"] == k
    # budget 128 tokens per head: per layer at most 3 heads x 128 tokens
    bs = case["block_size"]
    assert all(sum(layer) * bs <= 128 * h for layer in pages)
    streaming = evicting["free_blocks"][1]["layout"]["pages"]
    assert all(max(layer) - min(layer) <= 1 for layer in streaming)  # uniform allocation (remainder 1)
    bigger = evicting["free_blocks"][2]["layout"]
    assert sum(map(sum, bigger["pages"])) > sum(map(sum, pages))  # per-request kv_budget=256


def test_more_requests_run_at_once_with_eviction(stock, evicting):
    s, e = stock["concurrency"], evicting["concurrency"]
    assert s["num_blocks"] == e["num_blocks"]
    assert s["finished"] == s["requests"] and e["finished"] == e["requests"]
    assert e["max_running"] > s["max_running"]
    assert e["free_end"] == e["num_blocks"] - 1 and s["free_end"] == s["num_blocks"] - 1


def test_preemption_and_aborts_leave_nothing_behind(evicting):
    """Dense requests crowd the pool, so vLLM preempts, some of them evicting requests in the middle of their
    decode-time rounds; aborts on top. Nothing stays in the pool or on the worker, and an evicting request
    holds at most budget + T blocks after every step, before and after it was preempted."""
    _check_preempt_abort(evicting["preempt_abort"])


def _check_preempt_abort(pa):
    assert pa["preemptions"] > 0, "the scenario did not force a preemption"
    assert any(pa["preempted"].get(r, 0) > 0 for r in pa["evicting"]), "no evicting request was preempted"
    assert pa["failures"] == {}, pa["failures"]
    # this scenario's rounds: every evicting request that was not aborted ran some (500-token prompts)
    served = [r for r in pa["evicting"] if r not in pa["aborted"]]
    assert all(pa["request_rounds"][r] > 0 for r in served), pa["request_rounds"]
    assert pa["rounds"] >= sum(pa["request_rounds"][r] for r in served)
    assert pa["free_end"] == pa["num_blocks"] - 1  # only the null block is not free
    assert pa["requests_left"] == 0 and pa["manager_reqs_left"] == 0
    assert pa["worker_requests_left"] == [] and pa["worker_layouts_left"] == []
    # budget.py's bound (budget 128, T 32: N // bs + T // bs blocks, and the 2 blocks of SnapKV's window
    # queries); a 500-token prompt (and a re-prefill after preemption) is prefilled and compacted in one step, so
    # the bound holds after every step, and is reached. A round the pool had no room for its window queries is
    # put off by a window (W 32: one block), which the request holds on top while it waits
    bound = _bound(128, 32)
    assert bound == 128 // 32 + 32 // 32 + 2
    for rid, trace in pa["held"].items():
        put_off = pa["deferred"].get(rid, 0)
        assert trace and max(trace) <= bound + put_off, (rid, pa["preempted"].get(rid), put_off, trace)
    assert max(max(t) for r, t in pa["held"].items() if not pa["deferred"].get(r)) == bound


def test_every_preset_runs_query_aware_and_agnostic_and_with_moments(evicting):
    from vllm_contour.policies import policy_names

    presets = evicting["presets"]
    for name in policy_names():
        for label in (name, name + "/agnostic"):
            assert presets[label] is not None and len(presets[label]) == 6, label
    assert presets["snapkv/moments"] is not None and presets["knorm/moments"] is not None
    # this scenario's own counts: every preset request ran its round and gave blocks back to vLLM's pool
    for label in presets:
        assert evicting["presets_rounds"][label] >= 1 and evicting["presets_freed"][label] > 0, \
            (label, evicting["presets_rounds"][label], evicting["presets_freed"][label])
    d = evicting["presets_deltas"]
    assert d["failures"] == {} and d["evicted_requests"] == len(presets), d


def test_fast_ops_give_the_torch_reference_greedy_tokens(evicting, evicting_torch_ops):
    """Real eviction at 64 tokens per head (128 with moment correction), prompt-end and decode-time rounds:
    the default implementations (C++ compaction, moment accumulation, page gathers and ragged decode) produce
    exactly the greedy tokens of the torch reference ops."""
    assert evicting["greedy_evicted_rounds"] > 6  # more than one round per request
    fast, ref = evicting["greedy_evicted_calls"], evicting_torch_ops["greedy_evicted_calls"]
    assert fast.get("compact:cpp", 0) > 0 and fast.get("accumulate_moments:cpp", 0) > 0, fast
    assert fast.get("ragged_decode_attention:cpp", 0) > 0 and fast.get("gather_pages:cpp", 0) > 0, fast
    # moment storage and the window queries' copies into / out of pool pages are layout-generic torch by design
    # (index copies of a few pages); every other op is C++
    generic = ("store_moments", "load_moments", "write_page_elems", "read_page_elems")
    assert all(fast.get(f"{op}:torch", 0) > 0 for op in generic), fast
    assert not any(k.endswith(":torch") for k in fast if k.split(":")[0] not in generic), fast
    # compacted rows reach the decode op through per-token tables on CPU ("tables", the same with both)
    assert set(ref) == {"compact:torch", "accumulate_moments:torch", "ragged_decode_attention:torch",
                        "store_moments:torch", "load_moments:torch", "gather_pages:torch",
                        "write_page_elems:torch", "read_page_elems:torch", "compacted_attention:tables"}, ref
    assert fast.get("compacted_attention:tables", 0) == fast["ragged_decode_attention:cpp"], fast
    out = evicting["greedy_evicted"]
    assert all(v and len(v) == 80 for v in out.values()), out
    assert out == evicting_torch_ops["greedy_evicted"]


def test_blocks_held_stay_within_budget_plus_interval_at_every_step(evicting):
    """A 1,200-token prompt generating 400 tokens, an 80-token prompt generating 400 (both at 128 tokens per
    head) and an 80-token prompt generating 300 at 200 tokens per head (not a whole number of blocks), T = 64,
    together. After every engine step vLLM's own used-block count (its free queue) is exactly the blocks the
    three hold, and each holds at most budget.py's bound, which each reaches: N // bs + T // bs, and for budget
    200 ceil((N + T - 1) / bs), one block more while it is still dense. Each ran exactly the rounds the README's
    clock implies for its lengths. The long one ends at <= 0.2 x what stock holds (stock holds every token:
    ceil((P + G - 1) / bs) blocks at its last step, which test_free_blocks_rise_by_the_layout_prediction checks
    for stock's pool); the short one is compressed while it decodes."""
    ev = evicting["decode_bound"]
    bs = ev["block_size"]
    assert ev["failures"] == {}
    bounds, cases = {}, {}
    for i, case in enumerate(ev["cases"]):
        rid, budget = f"B{i}", (case[2] if len(case) > 2 else {}).get("kv_budget", 128)
        cases[rid] = (case[0], case[1], budget)
        bounds[rid] = _bound(budget, 64)
        assert max(ev["held"][rid]) == bounds[rid], (rid, bounds[rid], ev["held"][rid])
        assert ev["request_rounds"][rid] == _expected_rounds(case[0], case[1], budget, 64, bs), \
            (rid, ev["request_rounds"])
    # 200 // 32 + 64 // 32 = 8 < ceil(263 / 32) = 9; + 2 blocks of window queries (32 x 9 x 64 fp32 per layer)
    assert bounds == {"B0": 8, "B1": 8, "B2": 11}
    assert ev["rounds"] == sum(ev["request_rounds"].values())
    for used, held in ev["used"]:  # no prefix caching: no block is shared or cached, so the two must agree
        assert used == sum(held.values()), (used, held)
        assert all(n <= bounds[rid] for rid, n in held.items()), (held, bounds)
    long_ev, short_ev = ev["held"]["B0"], ev["held"]["B1"]
    (p0, g0, _), (p1, g1, _) = cases["B0"], cases["B1"]
    assert long_ev[-1] <= 0.2 * math.ceil((p0 + g0 - 1) / bs)
    # stock's short request outgrows the bound: rounds did the work
    assert math.ceil((p1 + g1 - 1) / bs) > bounds["B1"]
    # the 80-token prompt fits the budget: it starts dense and its first drop (blocks freed) is a decode round
    assert short_ev[0] == math.ceil(p1 / bs) and any(b < a for a, b in zip(short_ev, short_ev[1:]))
    assert ev["free_end"] == ev["num_blocks"] - 1


def test_mean_and_peak_kv_accounting_equals_vllms_pool(evicting):
    """The per-request mean / peak KV tokens per head that the plugin exports (histograms) equal what the test
    reads from vLLM's pool at the same moments (blocks held x block size, every step the request ran)."""
    ev = evicting["decode_bound"]
    bs = ev["block_size"]
    for rid, samples in ev["during"].items():
        mean, peak = ev["plugin_kv_held"][rid]
        gen = dict(zip(ev["held"], (c[1] for c in ev["cases"])))[rid]
        assert len(samples) >= gen  # every step the request ran: its prefill step, then one per token
        assert peak == max(samples) * bs
        assert abs(mean - sum(samples) * bs / len(samples)) < 1e-6


def test_budget_formula_matches_vllms_pool(evicting):
    """The README's formula, read from vLLM's pool right after the prefill step (T = 0): a prompt of P tokens
    whose full blocks E = P // bs exceed N // bs is cut to K = N // bs blocks (moment pages included) plus its
    partial last block; one that fits keeps all ceil(P / bs) blocks and no moment pages. The cases include
    E == N // bs with a partial block on top, budget == prompt, and one token less."""
    from tests.integration.conftest import FORMULA_CASES

    bs = 32
    formula = evicting["budget_formula"]
    assert len(formula) == len(FORMULA_CASES)
    assert any(r["prompt"] // bs == r["budget"] // bs and r["prompt"] % bs for r in formula)  # E == N // bs
    assert any(r["prompt"] == r["budget"] for r in formula) and any(r["prompt"] == r["budget"] + 1 for r in formula)
    for row in formula:
        p, n, moments = row["prompt"], row["budget"], row["moments"]
        e = p // bs
        partial = 1 if p % bs else 0
        if e > n // bs:
            assert row["K"] == n // bs, row
            assert row["held"] == n // bs + partial, row
            assert (row["moment_pages"] is not None) == moments, row
        else:
            assert row["K"] is None and row["held"] == -(-p // bs), row


def test_moment_correction_on_ordinary_short_prompts_serves_everything(evicting):
    sm = evicting["short_moments"]
    assert sm["tokens"] == {f"S{i}": 120 for i in range(len(sm["lengths"]))}
    assert set(sm["reasons"].values()) == {"length"}
    assert sm["failures"] == {}
    # the moment pages were zeroed before their blocks went back: no raw fp32 bits (NaN / inf patterns
    # in the cache dtype) poison later requests' attention (they did: stock requests decoded token 0)
    assert sm["nonfinite_cache_elements"] == 0


def test_fault_switch_failures_are_isolated_and_counted(faulty):
    """A quarter of the rounds fail while planning (the request stays as it was) and a quarter after the
    first layer moved (the request is recomputed without eviction): every request still finishes, the
    failures are counted by reason, and nothing leaks."""
    f = faulty["faults"]
    assert f["failures"].get("plan", 0) > 0 and f["failures"].get("apply", 0) > 0, f["failures"]
    served = [r for r in f["finished"] if r not in f["aborted"]]
    assert len(served) + len(f["aborted"]) == f["requests"]
    for rid in served:
        assert f["reasons"][rid] == "length", (rid, f["reasons"][rid])
    assert f["free_end"] == f["num_blocks"] - 1
    assert f["requests_left"] == 0 and f["worker_requests_left"] == []


def test_apply_failure_is_recomputed_densely_and_gives_stock_tokens(stock, faulty):
    """Compaction fails after the first layer moved (fault switch, named requests FA4..FA7, one round at the
    prompt end, no prefix caching): each request's cache matches no layout, so vLLM preempts it once and
    prefills it again densely (the recompute path); it finishes normally with the stock engine's greedy
    tokens. The failures are counted as apply, no round is."""
    fa = faulty["fault_paths"]["apply"]
    assert fa["failures"] == {"apply": 4} and fa["rounds"] == 0 and fa["evicted_requests"] == 0, fa
    for rid, i in fa["greedy_index"].items():
        assert fa["preempted"][rid] == 1, (rid, fa["preempted"])
        assert fa["reasons"][rid] == "length", (rid, fa["reasons"])
        assert fa["tokens"][rid] == stock["greedy"][i], rid


def test_forward_and_metadata_failures_finish_that_request_alone_with_an_error(faulty):
    """In its 3rd step as a compacted request, FF0's attention op fails and FM0's page table cannot be built
    (fault switch: what the backend reports): each is finished with an error (FINISHED_ERROR) after the 3
    tokens it had, those tokens are the ones the same request gives when nothing fails (GF0, GM0); FO1 and FO2
    in the same batch give the tokens they give without the failures (GO1, GO2). Counted as forward."""
    f = faulty["fault_paths"]
    st, t = f["step"], f["step"]["tokens"]
    assert st["reasons"]["FF0"] == st["reasons"]["FM0"] == "error", st["reasons"]
    assert all(st["reasons"][k] == "length" for k in ("FO1", "FO2", "GF0", "GM0", "GO1", "GO2")), st["reasons"]
    assert st["failures"] == {"forward": 2} and st["twins_failures"] == {"forward": 2}, st
    for a in ("FF0", "FM0"):
        assert len(t[a]) == 3 and t[a] == t["G" + a[1:]][:3], (a, t[a], t["G" + a[1:]])
    for a in ("FO1", "FO2"):
        assert len(t[a]) == 40 and t[a] == t["G" + a[1:]], a
    assert f["free_end"] == f["num_blocks"] - 1
    assert f["requests_left"] == 0 and f["worker_requests_left"] == []


def test_faults_raised_inside_the_backend_fail_the_steps_compacted_requests_alone(prefix_cached):
    """Raised inside the attention backend in RB0's / RI0's 3rd compacted step (fault switch), never into
    vLLM: the metadata builder (vLLM's kernel then runs every row as stock) or the compacted attention op and
    the torch reference after it. Every compacted request of that step (RB0 and RB1; RI0 and RI1) finishes with
    an error after the tokens it had, those of the same request when nothing fails; the dense request in the
    same step (NB0, NI0) gives its tokens. When only the best implementation raises (RK0), the torch reference
    serves the step: the three requests give their tokens and nothing fails. Counted as forward failures."""
    f = prefix_cached["fault_raise"]
    t, why = f["tokens"], f["reasons"]
    for k in "BI":
        assert why[f"R{k}0"] == why[f"R{k}1"] == "error" and why[f"N{k}0"] == "length", (k, why)
        assert f["failures"][k] == {"forward": 2}, (k, f["failures"])
        assert len(t[f"R{k}0"]) == 3 and t[f"R{k}0"] == t[f"GR{k}0"][:3], (k, t)
        assert 0 < len(t[f"R{k}1"]) < 8 and t[f"R{k}1"] == t[f"GR{k}1"][:len(t[f"R{k}1"])], (k, t)
        assert t[f"N{k}0"] == t[f"GN{k}0"], k
    assert all(why[r] == "length" for r in ("RK0", "RK1", "NK0")) and f["failures"]["K"] == {}, (why, f["failures"])
    assert all(t[r] == t["G" + r] for r in ("RK0", "RK1", "NK0")), t
    assert all(f["request_rounds"][r] == 1 for r in t if r.startswith(("R", "GR"))), f["request_rounds"]
    assert f["twins_failures"] == {} and set(why[r] for r in t if r.startswith("G")) == {"length"}, why
    assert f["free_end"] == f["num_blocks"] - 1
    assert f["requests_left"] == 0 and f["worker_requests_left"] == []


def test_apply_failure_with_prefix_caching(prefix_cached):
    """Prefix caching on (named requests on one prompt, 128 tokens per head, T 64): PB0's first round packs
    into private blocks (its own blocks are hashed) and fails there: nothing of the request moved, so it is
    counted as a plan failure, not recomputed, and served densely: the tokens of eviction off (QB0). PA0's
    first round succeeds and its second (in place: a compacted request's blocks are no longer hashed) fails
    after bytes moved: vLLM preempts it once and prefills it again densely. Its tokens are those of the same
    request without the fault (QA0) up to that round, then those of a dense request whose prompt is the
    prompt plus those tokens (QC0)."""
    fp = prefix_cached["fault_prefix"]
    t, g = fp["tokens"], fp["g"]
    assert fp["prefix_caching"] and g == 45
    assert fp["failures"] == {"plan": 1, "apply": 1}, fp["failures"]
    assert fp["preempted"] == {"PA0": 1, "PB0": 0, "QA0": 0, "QB0": 0}, fp["preempted"]
    assert fp["request_rounds"]["PA0"] == 1 and fp["request_rounds"]["PB0"] == 0 and \
        fp["request_rounds"]["QA0"] == _expected_rounds(500, 100, 128, 64), fp["request_rounds"]
    assert set(fp["reasons"].values()) == {"length"}, fp["reasons"]
    assert all(len(v) == 100 for k, v in t.items() if k != "QC0") and len(t["QC0"]) == 100 - g
    assert t["PA0"][:g] == t["QA0"][:g]
    assert t["PA0"][g:] == t["QC0"]
    assert t["PB0"] == t["QB0"]
    assert fp["free_end"] == fp["num_blocks"] - 1
    assert fp["requests_left"] == 0 and fp["worker_requests_left"] == []


def test_context_boundary_compresses_the_context_before_the_question(stock, evicting):
    """kv_context_len = C: with a budget >= the context nothing is evicted and the tokens are stock's; with a
    smaller budget one engine step ends with exactly C tokens computed and the request already compacted
    (vLLM's pool holds budget blocks + the partial one), and the question's P - C tokens are computed in later
    steps over the compressed cache; score_only prefills the whole prompt first (the earlier protocol)."""
    cb = evicting["context_boundary"]
    c, q = cb["context"], cb["question"]
    assert cb["tokens"]["Ckeep"] == stock["context_boundary"]["tokens"]["Ckeep"]
    # a context off a block boundary (900: its partial block stays dense) and one on it (896)
    assert c % 32 and cb["contexts"]["aligned"] % 32 == 0
    for name in ("evict", "aligned"):
        c = cb["contexts"][name]
        tr = cb["trace"]["C" + name]
        first_compacted = next(i for i, (_, _, e) in enumerate(tr) if e is not None)
        computed, held, e = tr[first_compacted]
        assert computed == c and e == c // 32, (name, tr[first_compacted])
        assert held == 128 // 32 + (1 if c % 32 else 0), (name, held)
        assert all(row[0] > c for row in tr[first_compacted + 1:])
        assert tr[-1][0] >= c + q
    c = cb["context"]
    so = cb["trace"]["Cscore_only"]
    first = next(i for i, (_, _, e) in enumerate(so) if e is not None)
    assert so[first][0] >= c + q  # compressed only once the whole prompt was computed
    assert all(v is not None and len(v) == 24 for v in cb["tokens"].values())
    assert cb["free_end"] == 99


def test_context_boundary_with_small_prefill_chunks(chunked):
    """128-token chunks shared by three requests: the context and the question each span several chunks,
    every chunk of the evicting request stops at C at the latest, and it is compacted right at C."""
    cb = chunked["context_boundary"]
    c = cb["context"]
    tr = cb["trace"]["Cevict"]
    computed = [row[0] for row in tr]
    assert c in computed  # a step ended exactly at the boundary
    i = computed.index(c)
    assert tr[i][2] == c // 32 and all(row[2] is None for row in tr[:i])
    assert sum(1 for x in computed if x < c) >= 3 and sum(1 for x in computed if c < x < c + cb["question"]) >= 1
    assert all(v is not None and len(v) == 8 for v in cb["tokens"].values())
    assert cb["free_end"] == 99


def test_query_agnostic_protocol_matches_the_pruned_cache_oracle(evicting, model_dir):
    """The oracle (HF transformers, fp32): prefill the context densely, keep exactly the positions the plugin
    kept in each (layer, KV head) (plus the context's partial last block), drop the rest, then teacher-force
    the question and vLLM's own answer over what is left. In the default mode vLLM's answer log-probabilities
    match it (the question was computed over the compressed cache); in score_only mode they deviate (the
    question saw the whole context: the leak)."""
    import torch

    from benchmarks.perplexity import capture_context, forward_masked, load_model

    pr = evicting["protocol"]
    ctx, question = pr["context"], pr["question"]
    c = len(ctx)
    model, _ = load_model(model_dir)
    ids = torch.tensor(ctx + question)
    _, prefix, _ = capture_context(model, ids, c, 32)
    diffs = {}
    for mode in ("prefill", "score_only"):
        run = pr[mode]
        assert run["kept"] is not None and run["region_blocks"] == c // 32, mode
        keep = {}
        for layer, heads in enumerate(run["kept"]):
            m = torch.zeros(len(heads), c, dtype=torch.bool)
            for h, pos in enumerate(heads):
                m[h, pos] = True
            m[:, run["region_blocks"] * 32:] = True  # the partial last block stays dense
            keep[layer] = m
        cont = torch.tensor(question + run["tokens"][:-1])
        logits = forward_masked(model, cont, prefix, keep)
        lp = torch.log_softmax(logits[len(question) - 1:].double(), dim=-1)
        oracle = lp.gather(1, torch.tensor(run["tokens"]).view(-1, 1)).squeeze(1)
        diffs[mode] = (oracle - torch.tensor(run["logprobs"], dtype=torch.float64)).abs().max().item()
    assert diffs["prefill"] < 2e-3, diffs
    assert diffs["score_only"] > 10 * diffs["prefill"] and diffs["score_only"] > 1e-2, diffs


def test_speculative_drafts_on_compacted_requests(evicting, ngram):
    """n-gram speculative decoding with eviction: a request compressed at its prompt end (T = 0) decodes
    with drafts verified over its ragged cache and gives the tokens the same request gives without drafts;
    with rounds every 64 tokens the blocks held stay within budget + T (+ the block vLLM reserves for the
    drafts) after every step; drafts were accepted (fewer steps than tokens); nothing failed or leaked."""
    drafts_on_compacted_requests(ngram["spec_decode"], evicting["spec_decode"])


def drafts_on_compacted_requests(sd: dict, ref: dict) -> None:
    """The speculative decoding scenario with drafts (``sd``) against the same requests without (``ref``)."""
    assert sd["failures"] == 0 and sd["free_end"] == 99, sd
    assert sd["tokens"]["SA"] == ref["tokens"]["SA"]
    assert len(sd["tokens"]["SB"]) == 400
    # drafts were accepted: fewer engine steps than without them
    assert sd["steps"]["SA"] < ref["steps"]["SA"] and sd["steps"]["SB"] < ref["steps"]["SB"], (sd, ref)
    assert sd["rounds"] == ref["rounds"] >= 5, (sd["rounds"], ref["rounds"])  # SA once, SB at 192, 256, ...
    assert max(sd["held"]["SB"]) <= _bound(128, 64) + 1, sd["held"]["SB"]  # + the drafts' lookahead block
    assert max(sd["held"]["SA"][1:]) <= 128 // 32 + 160 // 32 + 2


def test_streaming_input_sessions_keep_their_compressed_cache(stock, evicting):
    """vLLM's streaming-input sessions (a chunk of input appended to a running request, resumable requests):
    with a budget no round reaches, every turn's tokens are stock's; with eviction, the session's second
    chunk is prefilled over the compressed cache of the first chunk and the first turn (a multi-token step on
    a compacted request) and compressed again at its end, and the turn's tokens equal those of ONE ordinary
    request with the same tokens and the context boundary where the first chunk ended. The blocks held stay
    within budget.py's bound (budget + T) after every step (vLLM's pool)."""
    ev, st = evicting["streaming_input"], stock["streaming_input"]
    assert ev["keep"] == st["keep"] and [len(t) for t in ev["keep"]] == [20, 20, 20]
    assert st["keep"][1] == st["keep_oracle"]  # the oracle's bookkeeping, checked on stock itself
    assert ev["rounds"] >= 2  # at the first chunk's end and at the second's
    assert ev["evict"][1] == ev["oracle"], (ev["evict"][1], ev["oracle"])
    assert ev["held"] and max(ev["held"]) <= _bound(128, 64), ev["held"]
    assert ev["free_end"] == st["free_end"] == evicting["num_gpu_blocks"] - 1


def test_prefix_caching_on_gives_the_tokens_of_prefix_caching_off(evicting, prefix_cached):
    """An interleaved stream (two shared documents, unrelated prompts, requests arriving together over the
    same cached blocks, repeats of whole prompts, query-aware and query-agnostic, an abort) on the evicting engine with vLLM's prefix
    caching on and off: the same tokens for every request, prefix hits taken, no block left behind."""
    on, off = prefix_cached["prefix_stream"], evicting["prefix_stream"]
    assert on["prefix_caching"] and not off["prefix_caching"]
    assert on["failures"] == {} and off["failures"] == {}
    done = [r for r in on["tokens"] if r not in on["aborted"]]
    for rid in done:
        assert on["tokens"][rid] is not None and on["tokens"][rid] == off["tokens"][rid], rid
    hits = {k.split("-")[0]: v for k, v in on["hits"].items()}
    # a1/a2 (arriving together, prefilling their questions in the same step) reuse the cached document (21
    # full blocks of 32 of 700 tokens); later ones reuse what vLLM's LRU kept of it in the small pool
    assert hits["a1"] == hits["a2"] == 672, hits
    assert all(hits[r] > 0 for r in ("b1", "a3", "b2")), hits
    # a0r repeats a0 right after it: the whole prompt is cached, but the hit stops short of the observation
    # window (32 tokens) of its first round, whose queries SnapKV scores with: (770 - 32) // 32 blocks
    assert hits["a0r"] == (770 - 32) // 32 * 32, hits
    # k0r repeats k0 (key norm, context boundary 700) once k0's context is compressed: it adopts k0's shared
    # compressed context (hit = the boundary itself) and computes its question over it, as k0 did
    assert hits["k0r"] == 700, hits
    assert on["tokens"]["k0r"] == on["tokens"]["k0"]
    assert all(v == 0 for v in off["hits"].values())
    # every request compacted; rounds packed into private blocks where their blocks were hashed
    assert on["evicted_requests"] == off["evicted_requests"] == len(on["tokens"])
    assert on["private_blocks"] > 0 and off["private_blocks"] == 0
    # nothing left, read from vLLM's own free queue (cached-but-unreferenced blocks are in it): before
    # reset_prefix_cache only the blocks of shared compressed contexts still in the cache (k0's, unless the small
    # pool took them back) are missing from it, after it none
    assert off["entry_blocks"] == 0
    for res in (on, off):
        assert res["free_before_reset"] + res["entry_blocks"] == res["num_blocks"] - 1
        assert res["free_end"] == res["num_blocks"] - 1
        assert res["manager_reqs_left"] == 0 and res["worker_requests_left"] == []


def test_shared_compressed_context(evicting, prefix_cached):
    """Compress once, serve many (prefix caching on): a request whose first C tokens and eviction settings
    match a compressed context adopts it as its prefix-cache hit, prefills only its own tokens (the
    scheduler's counts) and gives the tokens of the same request on an engine that shares nothing; four at
    once hold one compressed document + their tails (vLLM's free queue); other settings never share; the
    shared pages count once in the requests' mean KV; ``reset_prefix_cache`` drops the contexts."""
    on, off = prefix_cached["shared_context"], evicting["shared_context"]
    assert on["prefix_caching"] and not off["prefix_caching"]
    assert on["failures"] == {} and off["failures"] == {}
    c = on["context"]
    assert c % 32, "the boundary is not block-aligned (the partial block is shared as a private copy)"
    for rid, toks in on["tokens"].items():
        assert toks is not None and toks == off["tokens"][rid], rid
    hits, first = on["hits"], on["first_sched"]
    for rid in ("B", "N0", "N1", "N2", "N3"):
        assert hits[rid] == c and first[rid] == 60, (rid, hits, first)  # only its 60 question tokens
    assert first["A"] == c  # the first request prefills up to the boundary, then compresses
    # other settings: the budget (and, for SnapKV, its window), the policy, the decode interval (P)
    for rid in ("P", "Bbudget", "Bknorm"):
        assert hits[rid] < c and hits[rid] % 32 == 0, (rid, hits)
    assert on["shared_hits"] == 5
    assert all(v == 0 for v in off["hits"].values()) and off["shared_hits"] == 0
    # B's decode round copied on write (private blocks), the shared context stayed as it was for the N
    assert on["private_after_b"] > 0
    # four at once: vLLM's used blocks <= the compressed contexts in the cache + each request's own tail past
    # the compressed region (the partial block's copy, question, generated) + one block of slack
    e_tokens = c // 32 * 32
    k = on["entry_blocks"]
    assert len(k) == 2 and all(x <= 128 // 32 + 1 + 1 for x in k), k  # kept pages (+moments) + partial copy
    peak_on = peak_off = 0
    for used, live, _ in on["trace"]:
        if len(live) == 4:
            tails = sum(-(-(n - e_tokens) // 32) for n in live.values())
            assert used <= sum(k) + tails + 1, (used, live, k)
            peak_on = max(peak_on, used)
    for used, live, _ in off["trace"]:
        if len(live) == 4:
            peak_off = max(peak_off, used)
    assert peak_on < peak_off, (peak_on, peak_off)
    # mean KV per request: a shared block counts 1/n to each of the n requests on it
    assert on["kv_held"]["N0"][0] < off["kv_held"]["N0"][0]
    # reset_prefix_cache drops compressed contexts: the repeat of A computes everything again
    assert on["reset_ok"] and on["entries_before_reset"] >= 4 and hits["Areset"] == 0
    assert on["entries_after_reset"] == 1 and on["reset_end"] and on["entries_end"] == 0
    assert on["free_end"] == off["free_end"] == on["num_blocks"] - 1


def test_unknown_cache_layout_stops_engine_start_up(tiny_model_dir):
    """A cache layout eviction cannot read stops the engine at start-up (the layout probe runs when the
    worker registers its caches), with a message naming ISA and dtype and the way out; it never reaches a
    request. Forced with the test-only fault switch: the probe sees vLLM's write through a scrambled page."""
    from .conftest import TINY_LLM

    res = run_engine("bad_layout", dict(TINY_LLM, model=tiny_model_dir), ["greedy"],
                     env={"VLLM_CONTOUR_FAULTS": "layout=scramble"}, expect_failure=True)
    assert res["rc"] != 0
    assert "unknown layout of vLLM's CPU cache for isa=vec dtype=float32 block_size=32" in res["log"], \
        res["log"][-3000:]
    assert "without --kv-eviction-policy" in res["log"]


def _kvzip_reference(model, ctx, parts, layers, heads):
    """KVzip's scores of ``ctx`` computed directly on the transformers model: each chunk's repeat ids after
    the whole (dense) context, every repeat query's softmax over the first 4 keys, the chunk's keys and the
    repeat keys up to it, the max over queries and the GQA group; ``[L, H, len(ctx)]``, sinks 1."""
    import torch

    from benchmarks.perplexity import forward_capture

    c = len(ctx)
    scale = 64 ** -0.5
    want = torch.zeros(layers, heads, c, dtype=torch.float64)
    want[:, :, :4] = 1.0
    for part in parts:
        s, e = part.span
        got_q, got_k = {}, {}

        def grab(layer, q, k, v):
            got_q[layer], got_k[layer] = q[:, c:].double(), k.double()

        forward_capture(model, torch.tensor(list(ctx) + list(part.repeat)), grab, logits_to_keep=1)
        for layer in range(layers):
            q, k = got_q[layer], got_k[layer]
            h, n = k.shape[0], q.shape[1]
            keys = torch.cat([k[:, :min(4, s)], k[:, s:e], k[:, c:]], dim=1)
            logits = torch.einsum("hnd,htd->hnt", q, keys.repeat_interleave(q.shape[0] // h, 0)) * scale
            logits[:, :, -n:] += torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), 1)
            w = torch.softmax(logits, -1)[:, :, min(4, s):min(4, s) + e - s]
            want[layer, :, s:e] = torch.maximum(want[layer, :, s:e], w.view(h, -1, n, e - s).amax(dim=(1, 2)))
    return want


def test_kvzip_reconstructs_the_context_inside_the_engine(prefix_cached, model_dir):
    """KVzip in vLLM (prefix caching on): the context's reconstruction runs as hidden requests while the
    owner waits at its boundary and another request goes on; the scores the round planned with equal a
    direct computation on the transformers model (the same reconstruction prompt, chunk and max over queries
    and the GQA group), layer by layer and head by head; the owner's answer log-probabilities equal the oracle
    that keeps exactly its kept positions; the hidden requests' blocks are back in vLLM's pool; a second
    request with the same context adopts the compressed context without a reconstruction."""
    import torch

    from benchmarks.perplexity import capture_context, forward_masked, load_model
    from vllm_contour.integration.reconstruction.prompt import RepeatPrompt, chunks

    kz = prefix_cached["kvzip"]
    ctx, q1 = kz["context"], kz["question"]
    c = len(ctx)
    # the owner computes nothing past C while its context is reconstructed, then goes on
    held = [s for s in kz["trace"] if s["hidden"]]
    assert held and all(s["ka"] == c for s in held), kz["trace"]
    assert max(s["ka"] or 0 for s in kz["trace"]) > c
    first = kz["trace"].index(held[0])  # while KA prefilled its context the step before, nothing was hidden
    assert kz["trace"][first - 1]["ka"] == c and not kz["trace"][first - 1]["hidden"]
    # the other request's tokens are those it gets alone
    assert kz["outs"]["KN"]["tokens"] == kz["alone"]
    # the hidden requests' blocks: back in vLLM's pool (reference count 0)
    assert kz["hidden_blocks"] and all(r == 0 for r in kz["hidden_refs"]), kz["hidden_refs"]
    # the same context again: the shared compressed context is adopted, nothing is reconstructed
    (b0, b1) = kz["counters_kb"]
    assert b1["reconstructions"] == b0["reconstructions"] and b1["shared_hits"] == b0["shared_hits"] + 1
    # its first step computed the whole prompt: the context was the hit, only the question was prefilled (without
    # the shared context the prefill would stop at the boundary C)
    assert kz["kb_first_computed"] == kz["kb_prompt"]

    rp = RepeatPrompt(tuple(kz["chunks_prefix"]), tuple(kz["repeat"]["first"]), tuple(kz["repeat"]["later"]),
                      tuple(kz["repeat"]["suffix"]))
    parts = chunks(ctx, c, rp)
    assert parts[0].span[0] == len(rp.prefix) > 0  # the chat template's prefix is not repeated
    assert kz["tokens_counted"] >= sum(len(p.repeat) for p in parts)
    model, _ = load_model(model_dir)
    want = _kvzip_reference(model, ctx, parts, len(kz["scores"][0]), len(kz["scores"][0][0]))
    got = torch.tensor(kz["scores"][0], dtype=torch.float64)
    assert len(kz["scores"]) == 1 and got.shape == want.shape
    for layer in range(want.shape[0]):
        torch.testing.assert_close(got[layer], want[layer], atol=2e-3, rtol=2e-2, msg=f"layer {layer}")
    # the answer over the compressed context equals the oracle that keeps exactly those positions
    region = c // 32
    keep = {}
    for layer, heads in enumerate(kz["kept"]):
        m = torch.zeros(len(heads), c, dtype=torch.bool)
        for hh, pos in enumerate(heads):
            m[hh, pos] = True
        m[:, region * 32:] = True
        keep[layer] = m
    _, prefix, _ = capture_context(model, torch.tensor(ctx + q1), c, 32)
    run = kz["outs"]["KA"]
    logits = forward_masked(model, torch.tensor(q1 + run["tokens"][:-1]), prefix, keep)
    lp = torch.log_softmax(logits[len(q1) - 1:].double(), dim=-1)
    oracle = lp.gather(1, torch.tensor(run["tokens"]).view(-1, 1)).squeeze(1)
    assert (oracle - torch.tensor(run["logprobs"], dtype=torch.float64)).abs().max().item() < 2e-3


def test_kvzip_reconstructs_a_streaming_sessions_next_chunk(prefix_cached, model_dir):
    """A streaming-input session with kvzip: its first chunk is reconstructed and compressed at its end; the
    chunk appended later is reconstructed on its own (its context the session's tokens so far), and the
    round then reads the kept tokens' earlier scores and the new tokens' scores, which equal the direct
    computation on the transformers model; no failure, both turns answered, the blocks held at the end
    within the budget's bound, the hidden requests' blocks back in vLLM's pool."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.perplexity import load_model
    from vllm_contour.integration.reconstruction.prompt import RepeatPrompt, chunks

    ks = prefix_cached["kvzip_stream"]
    (b0, b1) = ks["counters"]
    assert b1["reconstructions"] == b0["reconstructions"] + 2 and b1["failures"] == b0["failures"], ks["counters"]
    assert [len(t) for t in ks["turns"]] == [8, 8]
    first, second = ks["rounds"]
    c1, c2 = first["num_tokens"], second["num_tokens"]
    assert c1 == len(ks["chunks"][0]) and first["region_blocks"] is None and second["region_blocks"] == c1 // 32
    s1, s2 = torch.tensor(first["scores"]), torch.tensor(second["scores"])
    start = c1 // 32 * 32  # the first round's region ends there; its partial block is scored again
    assert s2.shape[2] == c2 and torch.equal(s2[:, :, :start], s1[:, :, :start])  # the kept tokens' first scores
    ids = second["tokens"][:c2]
    parts = chunks(ids, c2, RepeatPrompt.from_tokenizer(AutoTokenizer.from_pretrained(model_dir)), start_at=start)
    assert parts[0].span == (start, c2)
    want = _kvzip_reference(load_model(model_dir)[0], ids, parts, s2.shape[0], s2.shape[1])
    # the first chunk's partial block: the max over both reconstructions' repeat queries (KVzip's max)
    want[:, :, start:c1] = torch.maximum(want[:, :, start:c1], s1[:, :, start:c1].double())
    for layer in range(s2.shape[0]):
        torch.testing.assert_close(s2[layer, :, start:].double(), want[layer, :, start:], atol=2e-3, rtol=2e-2,
                                   msg=f"layer {layer}")
    last = [h for h in ks["held"] if h is not None][-1]
    assert last <= _bound(128, 32), ks["held"]
    assert ks["hidden_refs"] and all(r == 0 for r in ks["hidden_refs"])


def test_kvzip_scores_of_a_context_serve_a_later_request_without_a_reconstruction(evicting):
    """Prefix caching off, so no compressed context is shared: a second request with the same context is
    scored with the scores kept from the first request's reconstruction — no reconstruction runs for it
    (vLLM's requests: no hidden request is added), its round plans with exactly the first's scores, keeps
    exactly the first's positions and gives the same tokens; nothing fails and every block is back in the
    pool."""
    kr = evicting["kvzip_reuse"]
    c0, ca, cb = kr["counters"]
    assert ca["reconstructions"] == c0["reconstructions"] + 1 and ca["reused"] == c0["reused"]
    assert cb["reconstructions"] == ca["reconstructions"] and cb["reused"] == ca["reused"] + 1, kr["counters"]
    assert cb["failures"] == c0["failures"]
    assert len(kr["scores"]) == 2 and kr["scores"][1] == kr["scores"][0]
    assert kr["kept"]["KA"] == kr["kept"]["KB"]
    assert kr["tokens"]["KA"] == kr["tokens"]["KB"] and len(kr["tokens"]["KA"]) == 8
    assert kr["free_end"] == kr["num_blocks"] - 1
