"""Output-balancing swaps on top of top-mass (ContourKV's analysis tool; slow)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import LayerInputs, Selector
from ..scorers.common import gqa_groups, window_attention
from .topk import TopKSelector


@dataclass
class BalancingSelector(Selector):
    """Top-mass + greedy output-balancing swaps (ContourKV's analysis tool: how far is top-mass from
    the kept set that best preserves the attention output on the observed queries?).

    Start from top-k of the given scores (use a window-mass scorer, e.g. ``H2OScorer``, for
    "top-mass"). For each KV head, with the captured window queries of its GQA group (those inside the
    scoring context) and their dense attention weights ``a`` over all prompt keys, the error of a kept
    set K is ``sum_q || o_q - sum_{j in K u tail} a_qj v_j / sum_{j in K u tail} a_qj ||`` (dense output
    vs. the output with the same weights restricted to the kept tokens and renormalised; tokens past the
    region are always kept). Then repeatedly apply the single swap (kept non-forced token out, dropped
    token in) that lowers the error the most, among the ``pool`` lowest-scored kept and the ``pool``
    highest-scored dropped tokens; stop when no swap improves or after ``max_swaps`` swaps.

    SLOW (python loop per head and swap, ``pool^2 * G * W * D`` work per swap) and needs the window
    queries: an analysis/oracle tool, not in any default preset. Without queries it returns top-k.
    """

    max_swaps: int = 64
    pool: int = 16
    needs_queries: ClassVar[bool] = True
    needs_values: ClassVar[bool] = True

    def select(self, scores: torch.Tensor, pages: torch.Tensor, inp: LayerInputs) -> list[torch.Tensor]:
        kept = TopKSelector().select(scores, pages, inp)
        if inp.queries is None or self.max_swaps <= 0:
            return kept
        attn = window_attention(inp)  # [Hq, W, T]
        if attn.shape[1] == 0:
            return kept
        h, r = scores.shape
        g = gqa_groups(attn.shape[0], h)
        t = attn.shape[2]
        values = inp.values.to(torch.float32)
        out = []
        for hh in range(h):
            a = attn[hh * g:(hh + 1) * g].reshape(-1, t)  # [Q, T]
            v = values[hh]  # [T, D]
            out.append(self._balance_head(a, v, scores[hh], kept[hh], r))
        return out

    def _balance_head(self, a: torch.Tensor, v: torch.Tensor, s: torch.Tensor, kept: torch.Tensor,
                      r: int) -> torch.Tensor:
        t = a.shape[1]
        dense = a @ v  # [Q, D]
        keep = torch.zeros(t, dtype=torch.bool)
        keep[r:] = True
        keep[kept] = True
        num = a[:, keep] @ v[keep]
        z = a[:, keep].sum(dim=1)

        def err(n, zz):
            return (dense - n / zz.clamp_min(1e-30).unsqueeze(-1)).norm(dim=-1).sum(dim=-1)

        cur = float(err(num, z))
        region_s = s.to(torch.float32)
        for _ in range(self.max_swaps):
            kmask = keep[:r] & ~torch.isposinf(region_s)
            dmask = ~keep[:r]
            if not bool(kmask.any()) or not bool(dmask.any()):
                break
            kidx = torch.nonzero(kmask).squeeze(1)
            didx = torch.nonzero(dmask).squeeze(1)
            kidx = kidx[torch.sort(region_s[kidx], stable=True).indices[: self.pool]]
            didx = didx[torch.sort(region_s[didx], descending=True, stable=True).indices[: self.pool]]
            ai, aj = a[:, kidx].t(), a[:, didx].t()  # [Po, Q], [Pi, Q]
            n_new = (num.unsqueeze(0).unsqueeze(0) - (ai.unsqueeze(-1) * v[kidx].unsqueeze(1)).unsqueeze(1)
                     + (aj.unsqueeze(-1) * v[didx].unsqueeze(1)).unsqueeze(0))  # [Po, Pi, Q, D]
            z_new = z.view(1, 1, -1) - ai.unsqueeze(1) + aj.unsqueeze(0)  # [Po, Pi, Q]
            e = err(n_new, z_new)  # [Po, Pi]
            best = int(torch.argmin(e))
            bi, bj = divmod(best, e.shape[1])
            if float(e[bi, bj]) >= cur * (1 - 1e-6):
                break
            i, j = int(kidx[bi]), int(didx[bj])
            keep[i], keep[j] = False, True
            num = n_new[bi, bj]
            z = z_new[bi, bj]
            cur = float(e[bi, bj])
        return torch.nonzero(keep[:r]).squeeze(1).to(torch.int64)
