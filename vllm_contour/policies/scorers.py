"""Scorers: per (head, token) importance of the compactable region. Higher = keep."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import LayerInputs


@dataclass
class RecencyScorer:
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024):
    keep the attention sinks and the most recent tokens. The sinks and the recent window are forced by
    the policy; beyond them, newer tokens score higher."""

    needs_queries: bool = False

    def score(self, inp: LayerInputs) -> torch.Tensor:
        pos = torch.arange(inp.region_len, dtype=torch.float32)
        return pos.unsqueeze(0).expand(inp.num_kv_heads, -1).clone()


@dataclass
class KeyNormScorer:
    """Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP
    2024: keys with a LOW L2 norm attract attention; score = -||k||."""

    needs_queries: bool = False

    def score(self, inp: LayerInputs) -> torch.Tensor:
        k = inp.keys[:, : inp.region_len].to(torch.float32)
        return -k.norm(dim=-1)


def window_attention(inp: LayerInputs) -> torch.Tensor:
    """Softmax attention ``[Hq, W, T]`` of the captured window queries over all prompt keys, causal by
    absolute position (a query at position p sees keys 0..p), computed in fp32."""
    if inp.queries is None:
        raise ValueError("this scorer needs the observation-window queries, but none were captured")
    q = inp.queries.to(torch.float32)  # [Hq, W, D]
    hq, w, d = q.shape
    h = inp.num_kv_heads
    g = hq // h
    k = inp.keys.to(torch.float32)  # [H, T, D]
    t = k.shape[1]
    k = k.repeat_interleave(g, dim=0)  # [Hq, T, D]
    logits = torch.matmul(q, k.transpose(1, 2)) * inp.scale  # [Hq, W, T]
    if inp.query_positions is not None:
        qpos = inp.query_positions.to(torch.int64).view(1, w, 1)
    else:
        qpos = torch.arange(inp.context_end - w, inp.context_end).view(1, w, 1)
    kpos = torch.arange(t).view(1, 1, t)
    logits = logits.masked_fill(kpos > qpos, float("-inf"))
    return torch.softmax(logits, dim=-1)


@dataclass
class SnapKVScorer:
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024): the
    attention that the last ``W`` prompt queries (the observation window) pay to each key, summed over
    the window, averaged over the query heads of a GQA group, then smoothed with a 1-D average pool of
    width ``kernel_size`` so that neighbours of important tokens are kept too."""

    kernel_size: int = 7
    needs_queries: bool = True

    def score(self, inp: LayerInputs) -> torch.Tensor:
        attn = window_attention(inp)  # [Hq, W, T]
        hq = attn.shape[0]
        h = inp.num_kv_heads
        mass = attn.sum(dim=1)  # [Hq, T]
        mass = mass.view(h, hq // h, -1).mean(dim=1)  # GQA average -> [H, T]
        mass = mass[:, : inp.region_len]
        if self.kernel_size > 1:
            pad = self.kernel_size // 2
            mass = F.avg_pool1d(mass.unsqueeze(1), self.kernel_size, stride=1, padding=pad,
                                count_include_pad=False).squeeze(1)[:, : inp.region_len]
        return mass
