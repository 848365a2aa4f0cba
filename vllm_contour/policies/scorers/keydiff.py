"""KeyDiff: keep keys that differ from the mean key direction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import LayerInputs, Scorer


@dataclass
class KeyDiffScorer(Scorer):
    """KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
    Inference in Resource-Constrained Environments", 2025). Query-agnostic: per KV head the anchor is
    the mean of the L2-normalised keys of the scoring context ``[0, context_end)`` (never the question),
    and a token's score is minus the cosine similarity of its key to the anchor, so keys that are
    dissimilar to the average direction are kept (as kvpress's KeyDiffPress)."""


    def score(self, inp: LayerInputs) -> torch.Tensor:
        ctx = inp.context_mask()
        if not bool(ctx.any()):
            ctx = inp.key_mask()
        ctx = ctx.unsqueeze(-1).to(torch.float32)
        unit = F.normalize(inp.keys.to(torch.float32), p=2, dim=-1)
        anchor = (unit * ctx).sum(dim=1, keepdim=True) / ctx.sum(dim=1, keepdim=True).clamp_min(1.0)
        cand = inp.keys[:, : inp.region_len].to(torch.float32)
        return -F.cosine_similarity(cand, anchor, dim=-1)
