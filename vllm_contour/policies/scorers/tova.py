"""TOVA: attention of the last query."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import LayerInputs, Scorer
from .common import gqa_mean, window_attention, window_queries


@dataclass
class TOVAScorer(Scorer):
    """TOVA (Oren et al., "Transformers are Multi-State RNNs", 2024): a token's score is the attention
    the LAST query pays to it (the query at the highest absolute position inside the scoring context;
    in query-agnostic mode that is the last context token, not a question token), averaged over the
    query heads of a GQA group (the paper scores per head; GQA shares one KV head between a group).
    TOVA's online variant re-scores at every decoding step; here it is applied once, at the end of the
    prompt. If no captured query lies inside the context, every score is 0 (only the forced tokens and
    the lowest indices survive, deterministically)."""

    needs_queries: ClassVar[bool] = True

    def score(self, inp: LayerInputs) -> torch.Tensor:
        attn = window_attention(inp)  # [Hq, W, T]
        if attn.shape[1] == 0:
            return torch.zeros(inp.num_kv_heads, inp.region_len)
        _, qpos = window_queries(inp)
        last = int(torch.argmax(qpos))
        return gqa_mean(attn[:, last], inp.num_kv_heads)[:, : inp.region_len]
