"""Unit tests of the MomentKV math (vllm_contour/moments.py): accumulation, closed-form correction."""

from __future__ import annotations

import math

import torch

from vllm_contour.moments import Moments, accumulate, evicted_estimate, merge_evicted, residual_norms


def _attend(q, k, v, scale):
    """Dense attention of q [G, D] over k, v [N, D]: (out [G, D], lse [G])."""
    logits = (q @ k.t()) * scale
    return torch.softmax(logits, dim=-1) @ v, torch.logsumexp(logits, dim=-1)


def test_accumulate_matches_bruteforce_loop():
    g = torch.Generator().manual_seed(0)
    h, n, d = 3, 17, 5
    k = torch.randn(h, n, d, generator=g)
    v = torch.randn(h, n, d, generator=g)
    mask = torch.rand(h, n, generator=g) > 0.4
    mom = accumulate(k, v, mask)
    for hh in range(h):
        n_ = 0.0
        sk, sv, svk = torch.zeros(d), torch.zeros(d), torch.zeros(d, d)
        for j in range(n):
            if mask[hh, j]:
                n_ += 1
                sk += k[hh, j]
                sv += v[hh, j]
                svk += torch.outer(v[hh, j], k[hh, j])
        assert float(mom.n[hh]) == n_
        torch.testing.assert_close(mom.sum_k[hh], sk)
        torch.testing.assert_close(mom.sum_v[hh], sv)
        torch.testing.assert_close(mom.sum_vk[hh], svk)
    # accumulating in two halves equals one pass
    m1 = mask.clone()
    m1[:, 9:] = False
    m2 = mask & ~m1
    both = accumulate(k, v, m2, into=accumulate(k, v, m1))
    for a, b in zip(both.as_dict().values(), mom.as_dict().values()):
        torch.testing.assert_close(a, b)
    assert Moments.bytes_per_head(d) == 4 * (1 + 2 * d + d * d)


def test_empty_evicted_set_returns_kept_output_exactly():
    g = torch.Generator().manual_seed(1)
    h, gq, d = 2, 3, 8
    out = torch.randn(h, gq, d, generator=g)
    lse = torch.randn(h, gq, generator=g)
    q = torch.randn(h, gq, d, generator=g)
    mom = Moments.zeros((h,), d)
    mixed, new_lse = merge_evicted(out, lse, q, mom, 0.3)
    assert torch.equal(mixed, out)
    assert torch.equal(new_lse, lse)
    _, log_z = evicted_estimate(q, mom, 0.3)
    assert torch.all(torch.isneginf(log_z))


def test_merge_is_exact_when_evicted_keys_are_identical():
    """Evicted tokens sharing one key: the closed form is exact (no spread), so kept + moments
    reproduce dense attention over all tokens."""
    g = torch.Generator().manual_seed(2)
    d, n, scale = 6, 20, 0.4
    k = torch.randn(n, d, generator=g)
    v = torch.randn(n, d, generator=g)
    k[8:] = k[8]
    q = torch.randn(2, d, generator=g)
    dense, dense_lse = _attend(q, k, v, scale)
    out_r, lse_r = _attend(q, k[:8], v[:8], scale)
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, 8:] = True
    mom = accumulate(k.unsqueeze(0), v.unsqueeze(0), mask)
    mixed, lse = merge_evicted(out_r.unsqueeze(0), lse_r.unsqueeze(0), q.unsqueeze(0), mom, scale)
    torch.testing.assert_close(mixed[0], dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0], dense_lse, rtol=1e-5, atol=1e-5)


def test_all_evicted_correction_is_first_order_in_key_spread():
    """Every token evicted into moments: the correction approximates dense attention, and the error
    shrinks (roughly quadratically) as the key spread around the mean shrinks."""
    g = torch.Generator().manual_seed(3)
    d, n, scale = 16, 64, 1 / math.sqrt(16)
    mu = torch.randn(d, generator=g)
    noise = torch.randn(n, d, generator=g)
    v = torch.randn(n, d, generator=g)
    q = torch.randn(4, d, generator=g)
    errors, naive = [], []
    for spread in (0.8, 0.4, 0.2):
        k = mu + spread * noise
        dense, _ = _attend(q, k, v, scale)
        mom = accumulate(k.unsqueeze(0), v.unsqueeze(0), torch.ones(1, n, dtype=torch.bool))
        out = torch.zeros(1, 4, d)
        lse = torch.full((1, 4), float("-inf"))
        mixed, new_lse = merge_evicted(out, lse, q.unsqueeze(0), mom, scale)
        assert torch.all(torch.isfinite(mixed)) and torch.all(torch.isfinite(new_lse))
        errors.append(float((mixed[0] - dense).norm()))
        naive.append(float((v.mean(0) - dense).norm()))  # zeroth order: the mean value
    assert errors[0] > errors[1] > errors[2]
    assert errors[1] < errors[0] / 2.5 and errors[2] < errors[1] / 2.5  # ~ quadratic
    assert all(e < z for e, z in zip(errors, naive))  # the first-order term helps


def test_merge_lse_is_jensen_lower_bound():
    g = torch.Generator().manual_seed(4)
    d, n, scale = 8, 30, 0.35
    k = torch.randn(n, d, generator=g)
    v = torch.randn(n, d, generator=g)
    q = torch.randn(3, d, generator=g)
    mom = accumulate(k.unsqueeze(0), v.unsqueeze(0), torch.ones(1, n, dtype=torch.bool))
    _, log_z = evicted_estimate(q.unsqueeze(0), mom, scale)
    true = torch.logsumexp((q @ k.t()) * scale, dim=-1)
    assert torch.all(log_z[0] <= true + 1e-5)
    torch.testing.assert_close(log_z[0], math.log(n) + (q @ k.mean(0)) * scale)


def test_residual_norms_match_definition():
    g = torch.Generator().manual_seed(5)
    h, n, d, scale = 2, 12, 4, 0.5
    k = torch.randn(h, n, d, generator=g)
    v = torch.randn(h, n, d, generator=g)
    mask = torch.rand(h, n, generator=g) > 0.3
    mom = accumulate(k, v, mask)
    got = residual_norms(k, v, mom, scale)
    for hh in range(h):
        ke, ve = k[hh][mask[hh]], v[hh][mask[hh]]
        m = ke.shape[0]
        mu, vbar = ke.mean(0), ve.mean(0)
        s_tilde = sum(torch.outer(ve[i], ke[i] - mu) for i in range(m))
        for j in range(n):
            r = v[hh, j] - vbar - scale * (s_tilde @ k[hh, j]) / m
            assert math.isclose(float(got[hh, j]), float(r.norm()), rel_tol=1e-4, abs_tol=1e-5)
