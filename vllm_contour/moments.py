"""MomentKV: moment statistics of evicted tokens and the closed-form decode correction (math only).

For one (layer, KV head) the evicted set E is summarised by fp32 moments
``n = |E|``, ``sum_k = sum_j k_j`` [D], ``sum_v = sum_j v_j`` [D], ``sum_vk = sum_j v_j k_j^T`` [D, D].

Decode (query q, scale s, usually 1/sqrt(d)): expanding exp(s q.k_j) to first order around the mean key
``mu = sum_k / n`` gives the evicted part's output

    f_E ~= v_bar + s * S~ q / n,   v_bar = sum_v / n,   S~ = sum_vk - n v_bar mu^T = sum_j v_j (k_j - mu)^T

and Jensen (mean of exp >= exp of mean) gives a lower bound on its partition function
``log Z_E >= log n + s q.mu``. With the kept part's output f_R and log-sum-exp lse_R:

    w_R = Z_R / (Z_R + Z_E_lb) = sigmoid(lse_R - log n - s q.mu)
    f  ~= w_R f_R + (1 - w_R) f_E,       lse = logaddexp(lse_R, log n + s q.mu)

An empty evicted set (n = 0) leaves the kept output unchanged. The eviction score of MomentKV is
attention x ||r_j|| with the moment residual ``r_j = v_j - v_bar - S~ k_j / (n sqrt(d))`` (how badly the
closed form would represent token j if it were evicted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Moments:
    """Batched moments: leading dims ``[...]`` (e.g. [H] or [T, H])."""

    n: torch.Tensor  # [...]
    sum_k: torch.Tensor  # [..., D]
    sum_v: torch.Tensor  # [..., D]
    sum_vk: torch.Tensor  # [..., D, D]  (row index: value dim, column: key dim)

    @classmethod
    def zeros(cls, lead: tuple[int, ...], d: int) -> "Moments":
        z = torch.zeros
        return cls(z(lead), z(lead + (d,)), z(lead + (d,)), z(lead + (d, d)))

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"n": self.n, "sum_k": self.sum_k, "sum_v": self.sum_v, "sum_vk": self.sum_vk}

    @staticmethod
    def bytes_per_head(d: int) -> int:
        return 4 * (1 + 2 * d + d * d)


def accumulate(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, into: Moments | None = None) -> Moments:
    """Add the tokens where ``mask`` is True to the moments. keys/values ``[H, N, D]``, mask ``[H, N]``."""
    k = keys.to(torch.float32)
    v = values.to(torch.float32)
    m = mask.to(torch.float32).unsqueeze(-1)
    km, vm = k * m, v * m
    n = mask.to(torch.float32).sum(dim=1)
    sk = km.sum(dim=1)
    sv = vm.sum(dim=1)
    svk = torch.einsum("hnd,hne->hde", vm, k)
    if into is None:
        return Moments(n, sk, sv, svk)
    return Moments(into.n + n, into.sum_k + sk, into.sum_v + sv, into.sum_vk + svk)


def evicted_estimate(q: torch.Tensor, mom: dict | Moments, scale: float):
    """Closed-form evicted output and Jensen log-partition lower bound.

    q ``[..., G, D]`` (query heads of one KV head's group), moments with leading dims ``[...]``.
    Returns ``(f_E [..., G, D], log_z_lb [..., G])``; entries with n = 0 give log_z_lb = -inf."""
    if isinstance(mom, Moments):
        mom = mom.as_dict()
    n = mom["n"].to(torch.float32)
    nn = n.clamp_min(1.0).unsqueeze(-1)
    mu = mom["sum_k"].to(torch.float32) / nn  # [..., D]
    vbar = mom["sum_v"].to(torch.float32) / nn
    s_tilde = mom["sum_vk"].to(torch.float32) - n.unsqueeze(-1).unsqueeze(-1) * vbar.unsqueeze(-1) * mu.unsqueeze(-2)
    qf = q.to(torch.float32)
    corr = torch.einsum("...de,...ge->...gd", s_tilde, qf) * (scale / nn.unsqueeze(-2))
    f_e = vbar.unsqueeze(-2) + corr
    qmu = torch.einsum("...gd,...d->...g", qf, mu) * scale
    log_n = torch.where(n > 0, torch.log(n.clamp_min(1.0)), torch.full_like(n, float("-inf")))
    return f_e, log_n.unsqueeze(-1) + qmu


def merge_evicted(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, mom: dict | Moments, scale: float):
    """Mix the kept output ``out [..., G, D]`` (log-sum-exp ``lse [..., G]``) with the evicted estimate."""
    f_e, log_ze = evicted_estimate(q, mom, scale)
    w_r = torch.sigmoid(lse - log_ze)  # = 1 where n == 0 (log_ze = -inf)
    w_r = torch.where(torch.isneginf(log_ze), torch.ones_like(w_r), w_r)
    mixed = w_r.unsqueeze(-1) * out.to(torch.float32) + (1 - w_r.unsqueeze(-1)) * f_e
    new_lse = torch.logaddexp(lse, log_ze)
    return mixed, new_lse


def residual_norms(keys: torch.Tensor, values: torch.Tensor, mom: Moments, scale: float) -> torch.Tensor:
    """``||r_j||`` with ``r_j = v_j - v_bar - scale * S~ k_j / n`` for every token: keys/values [H, N, D],
    moments with leading dim [H]. Returns [H, N]."""
    n = mom.n.clamp_min(1.0)
    mu = mom.sum_k / n.unsqueeze(-1)
    vbar = mom.sum_v / n.unsqueeze(-1)
    s_tilde = mom.sum_vk - mom.n.view(-1, 1, 1) * vbar.unsqueeze(-1) * mu.unsqueeze(-2)
    pred = vbar.unsqueeze(1) + torch.einsum("hde,hne->hnd", s_tilde, keys.to(torch.float32)) * (
        scale / n.view(-1, 1, 1))
    return (values.to(torch.float32) - pred).norm(dim=-1)


def packed_len(num_heads: int, d: int) -> int:
    """fp32 elements of one layer's packed moments (all its KV heads)."""
    return num_heads * (1 + 2 * d + d * d)


def pack(mom: Moments) -> torch.Tensor:
    """Moments with leading dim [H] -> one flat fp32 vector ``[n | sum_k | sum_v | sum_vk]``."""
    return torch.cat([mom.n.reshape(-1), mom.sum_k.reshape(-1), mom.sum_v.reshape(-1),
                      mom.sum_vk.reshape(-1)]).to(torch.float32)


def unpack(flat: torch.Tensor, num_heads: int, d: int) -> dict[str, torch.Tensor]:
    """Inverse of ``pack`` with extra leading dims: ``flat [..., packed_len]`` -> dict of ``[..., H, ...]``."""
    lead = flat.shape[:-1]
    h = num_heads
    o = 0
    n = flat[..., o : o + h].reshape(*lead, h)
    o += h
    sk = flat[..., o : o + h * d].reshape(*lead, h, d)
    o += h * d
    sv = flat[..., o : o + h * d].reshape(*lead, h, d)
    o += h * d
    svk = flat[..., o : o + h * d * d].reshape(*lead, h, d, d)
    return {"n": n, "sum_k": sk, "sum_v": sv, "sum_vk": svk}


def pages_needed(num_heads: int, d: int, page_bytes: int) -> int:
    """Head-pages one layer's moments occupy."""
    return -(-packed_len(num_heads, d) * 4 // page_bytes)
