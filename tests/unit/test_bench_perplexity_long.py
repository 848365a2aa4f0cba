"""Fast checks of benchmarks/perplexity.py --long (decode-time rounds on a simulated paged cache): a 2-layer
random Llama built here, no download, no real text."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.perplexity import (STATE, capture_context, held_stats, held_tokens_per_step, match_prefill_only,
                                   simulate_long, use_hook)
from vllm_contour.round_clock import ClockState, next_round

PAGE = 16
KW = dict(page=PAGE, window=8, sink_tokens=4, recent_window=8)  # floor: 1 page per head


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)  # peaky attention, so that eviction shows in the logits
    use_hook(model)
    return model


def _passage(model, c, total, seed=1):
    ids = torch.randint(0, 128, (total,), generator=torch.Generator().manual_seed(seed))
    full, prefix, queries = capture_context(model, ids, c, window=KW["window"])
    return ids, full, prefix, queries, STATE.scales[0]


def _run(model, passage, c, **kw):
    ids, _, prefix, queries, scale = passage
    chunks = {}
    sim = simulate_long(model, ids, c, prefix, queries, scale, **{**KW, **kw},
                        on_chunk=lambda a, b, lg: chunks.__setitem__(a, lg.clone()))
    logits = torch.cat([chunks[a] for a in sorted(chunks)])
    return sim, logits


def test_held_accounting_is_whole_blocks_hand_example():
    # dense before any round: ceil((p + 1) / 32) blocks of 32
    assert held_tokens_per_step([], 30, 34, 32) == [32, 32, 64, 64]
    # round once 256 tokens had KV, keeping 4 blocks, region ends at block 8: from step 256 on the request
    # holds 4 blocks + the tail [256, p] in whole blocks
    s = held_tokens_per_step([(256, 4, 8)], 250, 260, 32)
    assert s == [256] * 6 + [160] * 4
    assert held_stats(s) == ((6 * 256 + 4 * 160) / 10, 256)
    # a round at 200 tokens (region ends at block 6, 8 tokens in the partial block stay dense), then at 256
    s = held_tokens_per_step([(200, 3, 6), (256, 3, 8)], 199, 258, 32)
    assert s[0] == 7 * 32  # 200 tokens: 7 blocks
    assert s[1] == (3 + 1) * 32  # token 200: tail [192, 201) = 9 tokens -> 1 block
    assert s[224 - 199] == (3 + 2) * 32  # token 224: tail [192, 225) = 33 tokens -> 2 blocks
    assert s[255 - 199] == (3 + 2) * 32  # 256 tokens: tail 64 tokens = 2 blocks (the peak before the round)
    assert s[256 - 199] == (3 + 1) * 32  # after the round: tail [256, 257) -> 1 block
    assert max(s) == 7 * 32


def _clock_schedule(sim, c, budget, interval) -> tuple[list[int], int | None]:
    """Where the plugin's round clock puts each round, given the outcome (``E``) of the ones before, and
    where it would put the one after the last (the hand-made cases are in test_round_clock.py)."""
    s = ClockState(prefill_end=c, budget=budget, interval=interval, block_size=PAGE)
    due = []
    for _, _, e in sim["rounds"]:
        due.append(next_round(s))
        s = replace(s, tried=True, compacted=True, region_blocks=e)
    return due, next_round(s)


@pytest.mark.parametrize("policy,budget,interval", [("snapkv", 32, 16), ("h2o", 48, 32), ("streaming", 32, 48),
                                                    ("knorm", 16, 16), ("contour", 32, 32)])
def test_rounds_keep_the_cache_within_budget_plus_interval_at_every_chunk(tiny_model, policy, budget, interval):
    c, total = 40, 240
    passage = _passage(tiny_model, c, total)
    sim, logits = _run(tiny_model, passage, c, policy_name=policy, budget=budget, interval=interval, max_chunk=64)
    bound = budget // PAGE + interval // PAGE
    assert sim["bound_blocks"] == bound
    rounds = sim["rounds"]
    assert rounds, "no round ran"
    # the plugin's schedule: every round where its clock puts it, none left out before the end
    due, after = _clock_schedule(sim, c, budget, interval)
    assert [r for r, _, _ in rounds] == due and after >= total
    assert all(k <= budget // PAGE for _, k, _ in rounds)
    assert len(rounds) >= (total - rounds[0][0]) // interval - 1
    for a, b, held in sim["chunks"]:  # blocks really held in the paged cache at each chunk's end
        assert held <= bound, (a, b, held)
    assert len(sim["held"]) == total - c and max(sim["held"]) <= bound * PAGE
    # eviction really changed the continuation
    assert float((logits - passage[1]).abs().max()) > 1e-3


def test_prefill_only_evicts_once_and_the_tail_grows(tiny_model):
    c, total = 40, 240
    passage = _passage(tiny_model, c, total)
    sim, _ = _run(tiny_model, passage, c, policy_name="snapkv", budget=16, interval=0, max_chunk=64)
    assert sim["rounds"] == [(c, 1, c // PAGE)]
    assert _clock_schedule(sim, c, 16, 0) == ([c], None)
    assert sim["held"][-1] == (1 + -(-(total - (c // PAGE) * PAGE) // PAGE)) * PAGE


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "knorm"])
def test_no_round_when_the_budget_covers_everything_gives_the_full_logits(tiny_model, policy):
    c, total = 40, 200
    passage = _passage(tiny_model, c, total, seed=3)
    full = passage[1]
    for interval in (0, 16):  # prefill_only with budget >= context: the round plans nothing
        sim, logits = _run(tiny_model, passage, c, policy_name=policy, budget=256, interval=interval, max_chunk=37)
        assert sim["rounds"] == []
        assert len(sim["chunks"]) > 1  # chunked anyway
        assert logits.shape == full.shape
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
        assert sim["held"] == held_tokens_per_step([], c, total, PAGE)


def test_chunk_size_does_not_change_a_run_with_rounds(tiny_model):
    c, total = 40, 200
    passage = _passage(tiny_model, c, total, seed=4)
    a_sim, a = _run(tiny_model, passage, c, policy_name="snapkv", budget=32, interval=32, max_chunk=512)
    b_sim, b = _run(tiny_model, passage, c, policy_name="snapkv", budget=32, interval=32, max_chunk=7)
    assert a_sim["rounds"] == b_sim["rounds"] and len(b_sim["chunks"]) > len(a_sim["chunks"])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_matched_mean_cache_notes():
    rows = [{"policy": "p", "method": "prefill_only", "budget": 128, "mean_held": 900.0, "ppl_ratio": 1.1,
             "kl_mean": 0.1},
            {"policy": "p", "method": "prefill_only", "budget": 256, "mean_held": 1000.0, "ppl_ratio": 1.05,
             "kl_mean": 0.05},
            {"policy": "p", "method": "decode", "budget": 128, "mean_held": 180.0},
            {"policy": "p", "method": "decode", "budget": 896, "mean_held": 950.0}]
    match_prefill_only(rows, floor_budget=64, floor_mean=840.0)
    assert rows[2]["matched_prefill_only"]["budget"] == 128
    assert rows[2]["note"].startswith("no prefill_only run within 10%") and "floor budget 64" in rows[2]["note"]
    assert rows[3]["matched_prefill_only"]["budget"] in (128, 256) and rows[3]["note"].startswith("matched")


def test_a_bf16_model_runs_on_a_bf16_paged_cache(tiny_model):
    """--dtype bfloat16: the context's K/V, the paged cache and every chunk's K/V are the model's bf16; the
    rounds' bit-for-bit check against the keep masks (simulate_long's verify) passes in that dtype."""
    import copy

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    c, total = 40, 200
    passage = _passage(model, c, total, seed=5)
    assert passage[2][0][0].dtype == torch.bfloat16
    sim, logits = _run(model, passage, c, policy_name="snapkv", budget=32, interval=32, max_chunk=64)
    assert sim["cache_dtype"] == "torch.bfloat16"
    assert sim["rounds"] and all(k <= 32 // PAGE for _, k, _ in sim["rounds"])
    assert logits.dtype == torch.float32 and float((logits - passage[1]).abs().max()) > 1e-3
