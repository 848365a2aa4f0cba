"""MomentKV scorer: attention weight x how badly the moment closed form would represent the token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ...moments import accumulate, residual_norms
from ..base import LayerInputs, Scorer
from .h2o import H2OScorer


@dataclass
class MomentScorer(Scorer):
    """MomentKV scorer (this project; the decode-time correction is in ``vllm_contour/moments.py``).

    Evicted tokens are not lost entirely: their first two moments (n, sum k, sum v, sum v k^T) feed a
    closed-form first-order estimate of their attention output at decode time. A token is therefore
    worth keeping when (a) it gets attention and (b) the closed form would represent it badly:

        score_j = w_j * ||r_j||,   r_j = v_j - v_bar - scale * S~ k_j / n      (moments.residual_norms)

    with ``w_j`` the ``weight`` scorer (default: window-attention mass accumulated over the captured
    window, ``H2OScorer``; any non-negative attention-like scorer works, negative scores are clipped
    to 0) and the moments taken over "the evicted set".

    Estimating the evicted set: pass 1 uses the moments of all candidates of the scoring context
    (cheap first estimate). With ``iterate`` and a known layer budget (``LayerInputs.budget_pages``,
    filled in by ``Policy.plan_layer``), pass 2 takes the tokens a uniform top-k of the pass-1 scores
    would evict (``LayerInputs.head_budget_pages``: the layer's pages split evenly; forced tokens are not
    known to the scorer and are ignored here), recomputes their moments and the residuals, and returns the
    pass-2 scores.
    Where this differs from the paper's intent: the residual evaluates the closed form at ``k_j``, i.e. it puts
    the token's KEY where a future QUERY belongs (the closed form is a function of the query); it is a proxy
    for "how badly would the moments stand in for this token", not the exact error at future queries.

    Cost: two ``O(H * N * D^2)`` moment/residual passes per layer.
    """

    weight: Scorer = field(default_factory=H2OScorer)
    iterate: bool = True
    needs_values: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.weight, Scorer):
            raise TypeError(f"moment weight {type(self.weight).__name__} does not subclass policies.base.Scorer")

    @property
    def needs_queries(self) -> bool:
        return self.weight.needs_queries

    @property
    def needs_reconstruction(self) -> bool:
        return self.weight.needs_reconstruction

    def score(self, inp: LayerInputs) -> torch.Tensor:
        h, r = inp.num_kv_heads, inp.region_len
        w = self.weight.score(inp).to(torch.float32).nan_to_num(0.0, 0.0, 0.0).clamp_min(0.0)
        keys = inp.keys[:, :r]
        values = inp.values[:, :r]
        mask = inp.context_mask()[:, :r] & inp.candidate_mask()
        score = w * residual_norms(keys, values, accumulate(keys, values, mask), inp.scale)
        per_head = inp.head_budget_pages() if self.iterate else None
        if per_head is not None:
            keep = (per_head * inp.page_size).clamp(0, r)  # [H]
            if bool(((keep > 0) & (keep < mask.sum(dim=1))).any()):
                ranked = score.masked_fill(~mask, -float("inf"))
                order = torch.sort(ranked, dim=1, descending=True, stable=True).indices
                rank = torch.empty_like(order)
                rank.scatter_(1, order, torch.arange(r).expand(h, -1).contiguous())
                evicted = mask & (rank >= keep.view(-1, 1))
                if bool(evicted.any()):
                    mom = accumulate(keys, values, evicted)
                    score = w * residual_norms(keys, values, mom, inp.scale)
        return score
