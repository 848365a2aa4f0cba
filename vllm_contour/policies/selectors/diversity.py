"""Diversity-aware greedy selection (score minus redundancy with what is already kept)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import LayerInputs, Selector
from .common import topk_indices
from .topk import TopKSelector


SIM_LIMIT = 1 << 24  # elements of the precomputed [H, R, R] penalty matrix (64 MiB in fp32)


def normalise_scores(scores: torch.Tensor) -> torch.Tensor:
    """Per head min-max normalisation of the finite scores to [0, 1] (a head with one distinct finite
    value maps to 0). ``+inf`` (forced) stays ``+inf``; ``-inf``/NaN become -1 (below every finite
    score, still selectable when nothing else is left)."""
    s = scores.to(torch.float32)
    finite = torch.isfinite(s)
    hi = torch.where(finite, s, torch.full_like(s, -float("inf"))).max(dim=1, keepdim=True).values
    lo = torch.where(finite, s, torch.full_like(s, float("inf"))).min(dim=1, keepdim=True).values
    span = (hi - lo)
    ok = torch.isfinite(span) & (span > 0)
    norm = torch.where(ok, (s - lo) / torch.where(ok, span, torch.ones_like(span)), torch.zeros_like(s))
    norm = torch.where(finite, norm, torch.full_like(s, -1.0))
    return torch.where(torch.isposinf(s), s, norm)


@dataclass
class DiversitySelector(Selector):
    """Greedy diversity-aware selection (maximal marginal relevance, Carbonell & Goldstein, SIGIR 1998,
    applied to KV tokens; this project's ContourKV variant).

    Per head the forced tokens (score ``+inf``: sinks, recent window) are taken first; then, one token at
    a time, the next pick maximises ``score_norm_j - lam * max_{i kept} cos(sig_j, sig_i)`` where the
    signature of token j is the layer's values averaged over its KV heads (``values[:, j].mean(0)``),
    L2-normalised, so near-duplicate tokens are not kept twice. In a decode-time round the heads have
    different candidates (``inp.is_ragged``), so each head uses its own values as signatures. Scores live on different scales per head
    (attention mass, -||k||, ...), so they are min-max normalised to [0, 1] per head over the finite
    scores before the penalty is subtracted (``lam`` is then in units of "the head's full score range").
    With an empty kept set the penalty is 0. Ties go to the lower token index, like top-k.

    ``lam == 0`` short-circuits to ``TopKSelector`` (bit-identical indices, including ties; the greedy
    on normalised scores could merge nearly equal scores into ties). The greedy keeps each candidate's
    objective ``obj_j`` and, after a pick ``p``, lowers it to ``min(obj_j, score_norm_j - lam * cos(j, p))``
    (equal to recomputing ``score_norm_j - lam * max_i cos(j, i)`` for ``lam >= 0``), so a pick is an argmax,
    a row minimum and a mask: a few tensor ops for all heads at once, with the similarity rows taken
    from a precomputed ``[H, R, R]`` matrix while it fits ``SIM_LIMIT`` elements (computed per pick
    beyond). Cost: ``O(H * R^2 * D)`` once plus ``O(k * H * R)`` per layer, with a python step per pick.
    """

    lam: float = 0.5

    @property
    def needs_values(self) -> bool:
        return self.lam != 0

    def __post_init__(self):
        if not self.lam >= 0:  # a negative penalty would reward duplicates (and break the min update)
            raise ValueError(f"diversity lam must be >= 0, got {self.lam}")

    def select(self, scores: torch.Tensor, pages: torch.Tensor, inp: LayerInputs) -> list[torch.Tensor]:
        if self.lam == 0:
            return TopKSelector().select(scores, pages, inp)
        h, r = scores.shape
        bs = inp.page_size
        ks = [min(int(pages[i]) * bs, r) for i in range(h)]
        vals = inp.values[:, :r].to(torch.float32)
        if inp.is_ragged:  # [H, R, D]: head h's own candidates
            sig = F.normalize(vals, p=2, dim=-1)
        else:  # [R, D], shared by the heads
            sig = F.normalize(vals.mean(dim=0), p=2, dim=-1).unsqueeze(0).expand(h, -1, -1)
        valid = inp.candidate_mask()
        norm = normalise_scores(scores)
        forced = torch.isposinf(norm)
        kept = torch.zeros(h, r, dtype=torch.bool)
        need = [0] * h
        for i in range(h):
            nf = int(forced[i].sum())
            if ks[i] <= nf or ks[i] >= int(valid[i].sum()):
                kept[i, topk_indices(scores[i], ks[i])] = True
            else:
                kept[i] = forced[i]
                need[i] = ks[i] - nf
        steps = max(need)
        if steps == 0:
            return [torch.nonzero(kept[i]).squeeze(1).to(torch.int64) for i in range(h)]
        # penalised[h, i, j] = score_norm_j - lam * cos(sig_j, sig_i): j's objective once i is kept
        full = h * r * r <= SIM_LIMIT
        if full:
            penalised = norm.unsqueeze(1) - self.lam * torch.bmm(sig, sig.transpose(1, 2))
        obj = norm.clone()
        for i in range(h):
            if need[i] and bool(forced[i].any()):
                maxsim = (sig[i, forced[i]] @ sig[i].t()).max(dim=0).values
                obj[i] = norm[i] - self.lam * maxsim
        obj.masked_fill_(kept | ~valid, -float("inf"))
        offsets = torch.arange(h) * r  # flat row / element index of (head, token)
        flat_pen = penalised.reshape(h * r, r) if full else None
        flat_sig = sig.reshape(h * r, -1)
        flat_obj = obj.view(-1)
        picks = torch.empty(steps, h, dtype=torch.int64)
        for t in range(steps):  # heads that need fewer picks run on; their extra picks are dropped below
            pick = torch.argmax(obj, dim=1)  # first maximum -> lower index on ties
            picks[t] = pick
            at = pick + offsets
            if full:
                row = flat_pen.index_select(0, at)
            else:
                row = norm - self.lam * torch.bmm(sig, flat_sig.index_select(0, at).unsqueeze(2)).squeeze(2)
            torch.minimum(obj, row, out=obj)
            flat_obj.index_fill_(0, at, -float("inf"))
        picks = picks.t()
        for i in range(h):
            kept[i, picks[i, : need[i]]] = True
        return [torch.nonzero(kept[i]).squeeze(1).to(torch.int64) for i in range(h)]
