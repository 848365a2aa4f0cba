"""ContourKV ("Trust the Mass") head allocation: greedy marginal-mass water-filling over pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Allocator, LayerBudget, LayerInputs
from .common import clamp_total, distribute_pages


def score_mass(scores: torch.Tensor, power: float = 1.0, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Turn any ``[H, N]`` scores into a per-head mass distribution (fp64, rows sum to 1).

    Non-finite entries count as the row's smallest finite score. A row with a negative entry (e.g.
    key-norm scores ``-||k||``) is shifted by its minimum, so that the worst token has mass 0 and the
    order is kept; attention-like (non-negative) rows are used as they are. ``power`` tempers the
    distribution (< 1 flattens, > 1 sharpens) before normalisation. An all-zero row becomes uniform.
    ``valid`` (``[H, N]`` bool) marks the candidates; the rest (padding) gets mass 0."""
    s = scores.detach().to(torch.float64)
    ok = torch.ones_like(s, dtype=torch.bool) if valid is None else valid.to(s.device, torch.bool)
    finite = torch.isfinite(s) & ok
    big = torch.finfo(torch.float64).max
    row_min = torch.where(finite, s, torch.full_like(s, big)).min(dim=1, keepdim=True).values
    row_min = torch.where(row_min == big, torch.zeros_like(row_min), row_min)
    s = torch.where(finite, s, row_min)
    s = torch.where(row_min < 0, s - row_min, s)
    if power != 1.0:
        s = s.pow(power)
    s = torch.where(ok, s, torch.zeros_like(s))
    tot = s.sum(dim=1, keepdim=True)
    n_ok = ok.sum(dim=1, keepdim=True).clamp_min(1).to(s.dtype)
    uniform = torch.where(ok, 1.0 / n_ok, torch.zeros_like(s))
    return torch.where(tot > 0, s / tot.clamp_min(1e-300), uniform)


def mass_curve(mass: torch.Tensor, forced: torch.Tensor | None, page_size: int,
               caps: torch.Tensor | None = None) -> torch.Tensor:
    """``[H, max_pages + 1]``: kept mass of each head with ``c`` pages (c = 0..) when the head keeps its
    forced tokens first and then its highest-mass tokens (what a top-k selector does). ``forced`` is
    ``[N]`` or ``[H, N]``; ``caps`` (``[H]``) the heads' candidate pages (default: all ``N``). Entry ``c``
    is only meaningful once ``c * page_size`` covers the forced tokens and ``c <= caps[h]``."""
    h, n = mass.shape
    f = torch.zeros(n, dtype=torch.bool, device=mass.device) if forced is None else forced.to(mass.device, torch.bool)
    f = f.expand(h, n) if f.dim() == 1 else f
    n_valid = (torch.full((h,), n, dtype=torch.int64) if caps is None
               else (caps.to(torch.int64) * page_size).clamp_max(n))
    nf = f.sum(dim=1)  # [H]
    m_forced = (mass * f).sum(dim=1, keepdim=True)  # [H, 1]
    rest = torch.sort(torch.where(f, torch.zeros_like(mass), mass), dim=1, descending=True).values
    cum = torch.cat([torch.zeros(h, 1, dtype=mass.dtype), rest.cumsum(dim=1)], dim=1)
    pages = torch.arange(n // page_size + 1).view(1, -1)
    idx = (pages * page_size - nf.view(-1, 1)).clamp_min(0)
    idx = torch.minimum(idx, (n_valid - nf).clamp_min(0).view(-1, 1))
    return m_forced + torch.gather(cum, 1, idx)


def dropped_mass(scores: torch.Tensor, pages: torch.Tensor, inp: LayerInputs,
                 forced: torch.Tensor | None = None, power: float = 1.0) -> torch.Tensor:
    """``[H]`` fraction of each head's (normalised) score mass that top-k selection with ``pages[h]``
    pages drops: ``1 - M_h(pages[h])``. At the uniform budget this is ContourKV's m̄_h."""
    curve = mass_curve(score_mass(scores, power, inp.candidate_mask()), forced, inp.page_size, inp.head_caps())
    p = pages.to(torch.int64).clamp(0, curve.shape[1] - 1).view(-1, 1)
    return 1.0 - curve.gather(1, p).squeeze(1)


@dataclass
class ContourAllocator(Allocator):
    """ContourKV ("Trust the Mass") head allocation. The paper's exact rule is not public; this is the
    rule implemented here, with the reasoning.

    Signal. For head h let ``p_h`` be its scores turned into a mass distribution over the region
    (``score_mass``: attention-like scores as they are, others shifted to be non-negative) and
    ``M_h(c)`` the mass that head keeps with ``c`` pages under top-k selection, counting the forced
    tokens (sinks + recent window, ``LayerBudget.forced``) first: they are in every head's floor, so
    their mass is not paid for again (AdaKV, by contrast, counts it). The dropped mass at the uniform
    budget b, ``m̄_h = 1 - M_h(b)``, is what top-mass selection would lose on that head: a flat head has
    a high m̄_h, a peaked head a low one.

    Rule (greedy marginal-gain water-filling). Every head starts at the floor; the remaining pages are
    handed out one at a time to the head whose NEXT page adds the most mass, ``M_h(c+1) - M_h(c)``.
    Because each head keeps its best tokens first, ``M_h`` is concave in c, so this greedy is exactly
    optimal: it minimises the total dropped mass ``sum_h (1 - M_h(c_h))`` at the layer's page total
    (it is the top-K of all heads' page gains). Relative to the uniform budget it moves pages from heads
    with low m̄_h (their extra pages add little) to heads with high m̄_h, and a peaked head still keeps
    the pages that cover its peak, which a rule of the form "weight ∝ m̄_h" would not guarantee. Equal
    gains (e.g. every head saturated) go round-robin by page, then to the lower head index.

    Knobs. ``mix`` in [0, 1] blends the greedy page counts with the uniform split (1 = trust the mass
    fully, 0 = uniform), as a hedge against window scores that are a noisy proxy of future attention;
    ``power`` tempers the mass distribution before the curves are built (< 1: flatter, spreads pages).
    Works with any scorer; with a non-attention scorer the "mass" is a rank-preserving proxy.
    """

    mix: float = 1.0
    power: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"contour mix must be in [0, 1], got {self.mix}")
        if self.power <= 0:
            raise ValueError(f"contour power must be > 0, got {self.power}")

    def greedy(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        h = inp.num_kv_heads
        caps = inp.head_caps()
        total, floor = clamp_total(budget, caps)
        pages = torch.full((h,), floor, dtype=torch.int64)
        extra = total - floor * h
        if extra <= 0:
            return pages
        curve = mass_curve(score_mass(scores, self.power, inp.candidate_mask()), budget.forced, inp.page_size, caps)
        gains = curve[:, floor + 1:] - curve[:, floor:-1]  # [H, rp - floor], non-increasing per row
        c = torch.arange(floor + 1, curve.shape[1]).view(1, -1)
        gains = gains.masked_fill(c > caps.view(-1, 1), -float("inf"))  # no page past a head's candidates
        flat = gains.t().reshape(-1)  # page-major: ties go round-robin over heads
        order = torch.sort(flat, descending=True, stable=True).indices[:extra]
        pages += torch.bincount(order % h, minlength=h)
        return pages

    def allocate(self, scores: torch.Tensor, inp: LayerInputs, budget: LayerBudget) -> torch.Tensor:
        h = inp.num_kv_heads
        caps = inp.head_caps()
        total, floor = clamp_total(budget, caps)
        uniform = distribute_pages(torch.ones(h), total, floor, caps)
        if self.mix <= 0.0 or total <= floor * h or total >= int(caps.sum()):
            return uniform
        greedy = self.greedy(scores, inp, budget)
        if self.mix >= 1.0:
            return greedy
        w = self.mix * (greedy - floor).to(torch.float64) + (1 - self.mix) * (uniform - floor).to(torch.float64)
        return distribute_pages(w, total, floor, caps)
