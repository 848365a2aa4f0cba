"""Fast checks of the math in benchmarks/seed_claims.py and the masked-attention path of
benchmarks/perplexity.py (tiny random tensors and a 2-layer random Llama built here; no real model)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from benchmarks.perplexity import (attention_with_prefix, capture_context, forward_capture, forward_masked,
                                   keep_masks, token_metrics, use_hook, STATE)
from benchmarks.seed_claims import (exhaustive_best, forced_error, local_search, ranked_union, refit_error,
                                    roc_auc, single_key_errors, topmass_error)


def _rand_rows(n, c, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(n, c, generator=g, dtype=torch.float64) + 0.01
    v = torch.randn(n, c, d, generator=g, dtype=torch.float64)
    o = torch.randn(n, d, generator=g, dtype=torch.float64)
    return a, v, o


def _brute(a, v, o, s):
    best = []
    for r in range(a.shape[0]):
        errs = {cb: float(forced_error(a[r, list(cb)], v[r, list(cb)], o[r]))
                for cb in itertools.combinations(range(a.shape[1]), s)}
        cb = min(errs, key=errs.get)
        best.append((errs[cb], cb))
    return best


@pytest.mark.parametrize("c,s", [(7, 3), (7, 5), (8, 4), (6, 6), (6, 1)])
def test_exhaustive_finds_true_optimum(c, s):
    a, v, o = _rand_rows(12, c, 5, seed=c * 10 + s)
    err, keep = exhaustive_best(a, v, o, s, chunk_elems=64)  # small chunks: exercise the chunking
    for r, (e_ref, cb_ref) in enumerate(_brute(a, v, o, s)):
        assert math.isclose(float(err[r]), e_ref, rel_tol=1e-9, abs_tol=1e-12)
        assert tuple(keep[r].tolist()) == cb_ref


def test_forced_error_of_top_mass_hand_case():
    a = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)
    v = torch.tensor([[[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64)
    o = (a.unsqueeze(-1) * v).sum(1)  # dense output [0.7, 0.5]
    assert torch.allclose(o, torch.tensor([[0.7, 0.5]], dtype=torch.float64))
    # top-2 = keys 1, 2: (0.5 [1, 0] + 0.3 [0, 1]) / 0.8 = [0.625, 0.375]
    expected = math.hypot(0.7 - 0.625, 0.5 - 0.375)
    assert math.isclose(float(topmass_error(a, v, o, 2)), expected, rel_tol=1e-12)
    assert math.isclose(float(forced_error(a[:, 1:], v[:, 1:], o)), expected, rel_tol=1e-12)
    # all keys: the dense output itself
    assert float(topmass_error(a, v, o, 3)) < 1e-12
    # single-key error = error when only that key is dropped
    ske = single_key_errors(a[0], (v[0] - o[0]).norm(dim=-1))
    for j in range(3):
        rest = [i for i in range(3) if i != j]
        assert math.isclose(float(ske[j]), float(forced_error(a[:, rest], v[:, rest], o)), rel_tol=1e-12)


def test_refit_weights_never_worse_than_renormalised():
    a, v, o = _rand_rows(50, 6, 8, seed=3)
    forced = forced_error(a, v, o)
    free = refit_error(v, o)
    assert bool((free <= forced + 1e-12).all())
    # when o lies in the span of the subset, the refit is exact
    w = torch.randn(50, 6, dtype=torch.float64)
    o2 = (w.unsqueeze(-1) * v).sum(1)
    assert float(refit_error(v, o2).max()) < 1e-9


def test_local_search_improves_and_reaches_small_optimum():
    a, v, o = _rand_rows(20, 9, 4, seed=5)
    s = 3
    start = torch.zeros(20, 9, dtype=torch.bool)
    start[:, :s] = True
    e0 = forced_error(a[:, :s], v[:, :s], o)
    e_ls, x = local_search(a, v, o, start, max_iter=100)
    assert bool((e_ls <= e0 + 1e-12).all())
    assert bool((x.sum(1) == s).all())
    e_ex, _ = exhaustive_best(a, v, o, s)
    assert bool((e_ex <= e_ls + 1e-12).all())


def test_ranked_union_puts_top_mass_first():
    mass = torch.tensor([[0.1, 0.5, 0.2, 0.05, 0.15]])
    err = torch.tensor([[9.0, 0.0, 0.0, 5.0, 1.0]])
    idx = ranked_union(mass, err, 4, 2)
    assert idx[0, :2].tolist() == [1, 2]
    assert idx[0, 2:].tolist() == [0, 3]


def test_auc_hand_cases():
    assert roc_auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert roc_auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])) == 0.0
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert roc_auc(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0, 1, 1])) == 0.75  # tie counts half
    assert roc_auc(torch.ones(6), torch.tensor([0, 1, 0, 1, 1, 0])) == 0.5
    assert math.isnan(roc_auc(torch.rand(4), torch.zeros(4)))


def test_attention_mask_equals_removing_tokens():
    g = torch.Generator().manual_seed(0)
    hq, hkv, p, t, d = 4, 2, 10, 3, 8
    q = torch.randn(1, hq, t, d, generator=g)
    k = torch.randn(1, hkv, t, d, generator=g)
    v = torch.randn(1, hkv, t, d, generator=g)
    pk, pv = torch.randn(hkv, p, d, generator=g), torch.randn(hkv, p, d, generator=g)
    keep = torch.rand(hkv, p, generator=g) > 0.5
    keep[:, 0] = True
    out = attention_with_prefix(q, k, v, 0.3, (pk, pv), keep)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(t):
            kk = torch.cat([pk[kh, keep[kh]], k[0, kh, : i + 1]])
            vv = torch.cat([pv[kh, keep[kh]], v[0, kh, : i + 1]])
            ref = torch.softmax(kk @ q[0, h, i] * 0.3, dim=0) @ vv
            assert torch.allclose(out[0, h, i], ref, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)  # peaky attention, so that masking would show
    return model


def test_masked_perplexity_path_equals_full_cache_when_all_kept(tiny_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(1))
    c = 64
    with torch.no_grad():  # the stock eager implementation as the reference
        ref_model = LlamaForCausalLM(LlamaConfig(**{**tiny_model.config.to_dict(), "_attn_implementation": "eager"}))
        ref_model.load_state_dict(tiny_model.state_dict())
        ref_model.config._attn_implementation = "eager"
        ref = ref_model.eval()(input_ids=ids.unsqueeze(0)).logits[0]
    use_hook(tiny_model)
    full, prefix, queries = capture_context(tiny_model, ids, c, window=8)
    assert torch.allclose(full, ref[c:], atol=1e-4)
    assert queries[0].shape == (4, 8, 16) and prefix[1][0].shape == (2, c, 16)
    cont = ids[c:]
    none = forward_masked(tiny_model, cont, prefix, None)
    ones = {layer: torch.ones(2, c, dtype=torch.bool) for layer in prefix}
    batched = forward_masked(tiny_model, cont, prefix, [ones, ones])
    assert torch.allclose(none, ref[c:], atol=1e-4)
    assert torch.allclose(batched[0], ref[c:], atol=1e-4) and torch.allclose(batched[1], ref[c:], atol=1e-4)
    # a policy whose budget covers the whole context keeps everything: same logits, zero KL
    from vllm_contour.policies import build_policy

    masks, kept = keep_masks(build_policy("snapkv", recent_window=8), prefix, queries, STATE.scales, c, 16,
                             budget=c, window=8)
    assert kept == c and all(bool(m.all()) for m in masks.values())
    lg = forward_masked(tiny_model, cont, prefix, masks)
    nll_f, nll_c, kl = token_metrics(full[:-1], lg[:-1], ids[c + 1:])
    assert torch.allclose(nll_f, nll_c, atol=1e-4) and float(kl.abs().max()) < 1e-6
    # evicting changes the continuation, and masking = dropping the same tokens from the prefix
    masks, kept = keep_masks(build_policy("streaming", recent_window=8), prefix, queries, STATE.scales, c, 16,
                             budget=32, window=8)
    assert kept == 32
    lg = forward_masked(tiny_model, cont, prefix, masks)
    assert float((lg - full).abs().max()) > 1e-3
    assert all(torch.equal(m, masks[0]) and torch.equal(m[0], m[1]) for m in masks.values())
    kept_idx = masks[0][0].nonzero().squeeze(1)  # streaming: the same tokens in every layer and head
    dropped = {layer: (kv[0][:, kept_idx], kv[1][:, kept_idx]) for layer, kv in prefix.items()}
    STATE.on_qkv, STATE.prefix, STATE.keep = None, dropped, None
    try:
        pos = torch.arange(c, c + cont.numel()).unsqueeze(0)
        with torch.no_grad():
            phys = tiny_model(input_ids=cont.unsqueeze(0), position_ids=pos, use_cache=False).logits[0]
    finally:
        STATE.prefix = None
    assert torch.allclose(lg, phys, atol=1e-4)


def test_forward_capture_logits_to_keep(tiny_model):
    use_hook(tiny_model)
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2))
    seen = []
    last = forward_capture(tiny_model, ids, lambda layer, q, k, v: seen.append((layer, q.shape, k.shape)),
                           logits_to_keep=1)
    assert last.shape == (1, 128)
    assert seen == [(0, (4, 20, 16), (2, 20, 16)), (1, (4, 20, 16), (2, 20, 16))]
