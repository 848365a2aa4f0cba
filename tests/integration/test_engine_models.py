"""vLLM offline engines on the other bundled model and dtypes: Gemma 3 270M (a hybrid KV cache), SmolLM2 in
bf16 and over fp8 pages. Each engine here is its own (no other test file compares with it), so the test
command runs this file beside the engines of ``test_engine.py`` (see ``scripts/test.sh``)."""

import math

from .test_engine import _bound, _check_free_blocks, _check_preempt_abort, _expected_rounds


def test_hybrid_model_evicts_in_its_full_attention_layers(gemma):
    """Gemma 3 270M, the second bundled model (vLLM's hybrid KV cache manager: five sliding-window groups and
    one full-attention group, one KV head each): budget >= prompt gives the tokens of eviction off in the same
    engine; a 2,000-token prompt at 128 tokens per head holds 5 blocks in the full-attention group instead of
    63 while the sliding-window groups hold what vLLM's own manager holds without eviction (vLLM's managers);
    with decode-time rounds the full-attention group reaches exactly budget.py's bound (budget + T) after every step;
    every preset runs and evicts; nothing fails or leaks."""
    g = gemma["hybrid"]
    assert g["kinds"].count("EvictingAttentionSpec") == 1 and g["kinds"].count("SlidingWindowSpec") == 5, g["kinds"]
    assert g["failures"] == {}
    assert all(len(t) == 24 for t in gemma["greedy_none"]) and gemma["greedy"] == gemma["greedy_none"]
    full = g["kinds"].index("EvictingAttentionSpec")
    sw = [i for i, k in enumerate(g["kinds"]) if k == "SlidingWindowSpec"]
    ev, none = g["runs"]["H"], g["runs"]["Hnone"]
    bs = g["block_size"]
    assert max(t[full] for t in none["trace"]) == math.ceil(2000 / bs)
    assert ev["trace"][-1][full] == 128 // bs + 1  # kept pages + the partial tail block
    assert ev["tokens"] != none["tokens"] and len(ev["tokens"]) == 8
    for i in sw:  # vLLM's sliding-window manager: the same with and without eviction
        assert [t[i] for t in ev["trace"]][1:] == [t[i] for t in none["trace"]][1:], i
        assert max(t[i] for t in ev["trace"][1:]) <= 512 // bs + 2
    dec = g["runs"]["Hdecode"]
    assert len(dec["tokens"]) == 160
    from vllm_contour.budget import page_budget, query_blocks_for

    q = query_blocks_for(32, 4, bs, 4, 4)  # SnapKV's 32 window queries of Gemma's 4 query heads
    bound = page_budget(128, num_kv_heads=1, block_size=bs, head_dim=256, elem_size=4, sink_tokens=4,
                        recent_window=32, moments=False).held_blocks_bound(64, q)  # budget.py's, Gemma's cache
    assert max(t[full] for t in dec["trace"]) == bound == (128 + 64) // bs + q, dec["trace"]
    for run in g["runs"].values():
        assert run["free_end"] == run["free_before"]
    from vllm_contour.policies import policy_names

    for name in policy_names():
        for label in (name, name + "/agnostic"):
            assert gemma["presets"][label] is not None and len(gemma["presets"][label]) == 6, label
    assert gemma["presets"]["snapkv/moments"] is not None
    for label in gemma["presets"]:  # each preset request ran its round and gave blocks back
        assert gemma["presets_rounds"][label] >= 1 and gemma["presets_freed"][label] > 0, label
    assert gemma["presets_deltas"]["failures"] == {}


def test_hybrid_model_with_prefix_caching_evicts_as_without_it(gemma, gemma_prefix):
    """The hybrid model with vLLM's prefix caching on: the evicting request and the one with eviction off give
    the tokens they give with prefix caching off, the full-attention group holds the same blocks after every
    step (the compacted request's blocks are private: nothing of it is hashed), the decode-time rounds reach the
    same bound, nothing fails, and every block goes back to vLLM's pool."""
    on, off = gemma_prefix["hybrid"], gemma["hybrid"]
    assert on["kinds"] == off["kinds"] and on["failures"] == {}
    full = on["kinds"].index("EvictingAttentionSpec")
    for rid in ("H", "Hnone", "Hdecode"):
        assert on["runs"][rid]["tokens"] == off["runs"][rid]["tokens"], rid
        assert [t[full] for t in on["runs"][rid]["trace"]] == [t[full] for t in off["runs"][rid]["trace"]], rid
        assert on["runs"][rid]["free_end"] == on["runs"][rid]["free_before"], rid  # cached blocks count as free
    assert on["runs"]["H"]["trace"][-1][full] == 128 // on["block_size"] + 1


def test_bf16_budget_above_prompt_gives_the_tokens_without_eviction(evicting_bf16):
    """bf16 (the set-up's dtype on CPUs with bf16 instructions): budget >= prompt gives, token for token, the
    greedy tokens of the same prompts with eviction off in the same engine."""
    e = evicting_bf16
    assert e["connector"] == "ContourKVConnector"
    assert all(len(t) == 24 for t in e["greedy_none"])
    assert e["greedy"] == e["greedy_none"]


def test_bf16_frees_blocks_and_survives_preemption_and_aborts(evicting_bf16):
    _check_free_blocks(evicting_bf16["free_blocks"], evicting_bf16["free_blocks"][0]["block_size"])
    _check_preempt_abort(evicting_bf16["preempt_abort"])


def test_fp8_pages_budget_above_prompt_gives_stock_fp8_tokens(stock_fp8, evicting_fp8):
    """bf16 model, fp8 pages (``--kv-cache-dtype fp8``): the plugin's engine reads vLLM's fp8 page layout (AMX
    or vec packing, one byte per element) and, with a budget above every prompt, gives stock fp8's greedy tokens
    token for token, every logprob finite."""
    e, s = evicting_fp8, stock_fp8
    assert e["connector"] == "ContourKVConnector"
    assert "torch.uint8 on cpu" in e["log"]  # the worker's caches are vLLM's fp8 pages
    assert all(len(t) == 16 for t in s["greedy"])
    assert e["greedy"] == s["greedy"]
    assert all(e["greedy_finite"]) and all(s["greedy_finite"])


def test_fp8_pages_evict_within_the_bound_at_every_step(evicting_fp8):
    """fp8 pages with eviction: a 700-token prompt and an 80-token one generating 130 tokens each (budget 128
    per head) and a 300-token one generating 100 at 256 with moment correction (fp32 moments kept in the fp8
    pool's blocks), decoding together with a round every 64 tokens. After every engine step vLLM's
    used-block count is exactly what the three hold, each holds at most budget.py's bound for one-byte
    elements (window queries in bf16: 2 bytes each), which the first two reach; every round succeeded, every
    request finished with all its tokens, every sampled logprob is finite."""
    ev = evicting_fp8["decode_bound"]
    bs = ev["block_size"]
    assert ev["failures"] == {}
    bounds = {}
    for i, case in enumerate(ev["cases"]):
        extra = case[2] if len(case) > 2 else {}
        rid = f"B{i}"
        bounds[rid] = _bound(extra.get("kv_budget", 128), 64, extra.get("kv_moment_correction", False), 1, 2)
        assert max(ev["held"][rid]) <= bounds[rid], (rid, bounds[rid], ev["held"][rid])
        assert ev["request_rounds"][rid] == _expected_rounds(case[0], case[1], extra.get("kv_budget", 128), 64, bs), \
            (rid, ev["request_rounds"])
        assert ev["generated"][rid] == case[1]
    assert max(ev["held"]["B0"]) == bounds["B0"] and max(ev["held"]["B1"]) == bounds["B1"]
    assert ev["rounds"] == sum(ev["request_rounds"].values()) > 0
    for used, held in ev["used"]:
        assert used == sum(held.values()), (used, held)
        assert all(n <= bounds[rid] for rid, n in held.items()), (held, bounds)
    # the long one ends far below what stock holds (every token: ceil((P + G - 1) / bs) blocks)
    assert ev["held"]["B0"][-1] <= 0.4 * math.ceil((700 + 130 - 1) / bs)
    assert all(ev["finite"].values()) and len(ev["finite"]) == 3
    assert ev["free_end"] == ev["num_blocks"] - 1
