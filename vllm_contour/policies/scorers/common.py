"""Helpers shared by the scorers: the observation window, window attention, GQA averaging, pooling.

Query-agnostic contract: everything here looks only at the scoring context ``[0, context_end)``.
Captured queries whose absolute position is at or after ``context_end`` (question tokens in
query-agnostic mode) are dropped, and a query at position ``p`` only sees keys ``0..p``, so keys and
values of the question can never change a score.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base import LayerInputs


def window_queries(inp: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The captured window queries that lie inside the scoring context, as fp32 ``[Hq, W', D]``, and
    their absolute positions ``[W']`` (int64). Without ``query_positions`` the ``W`` queries are taken
    to be the last ``W`` tokens before ``context_end``. Raises when no queries were captured."""
    if inp.queries is None:
        raise ValueError("this scorer needs the observation-window queries, but none were captured")
    q = inp.queries
    w = q.shape[1]
    ce = inp.context_end
    if inp.query_positions is not None:
        pos = inp.query_positions.to(q.device, torch.int64).reshape(-1)
        if pos.numel() != w:
            raise ValueError(f"query_positions has {pos.numel()} entries for {w} window queries")
    else:
        pos = torch.arange(ce - w, ce, dtype=torch.int64)
    keep = pos < ce
    if not bool(keep.all()):
        q = q[:, keep.to(q.device)]
        pos = pos[keep]
    return q.to(torch.float32), pos


def gqa_groups(num_q_heads: int, num_kv_heads: int) -> int:
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    return num_q_heads // num_kv_heads


def gqa_mean(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Average ``[Hq, ...]`` over the query heads of each GQA group -> ``[H, ...]``."""
    g = gqa_groups(x.shape[0], num_kv_heads)
    return x.reshape(num_kv_heads, g, *x.shape[1:]).mean(dim=1)


def window_attention(inp: LayerInputs) -> torch.Tensor:
    """Softmax attention ``[Hq, W', T]`` of the captured window queries (those before ``context_end``)
    over all keys, causal by absolute position (a query at position p sees keys at positions <= p), fp32.
    ``W'`` may be 0 when every captured query lies after the context end."""
    q, qpos = window_queries(inp)  # [Hq, W, D]
    hq, w, _ = q.shape
    h = inp.num_kv_heads
    g = gqa_groups(hq, h)
    k = inp.keys.to(torch.float32)  # [H, T, D]
    t = k.shape[1]
    if w == 0:
        return torch.zeros(hq, 0, t)
    logits = torch.matmul((q * inp.scale).reshape(h, g * w, -1), k.transpose(1, 2)).view(hq, w, t)  # [Hq, W, T]
    if inp.positions is None and inp.valid is None:  # keys 0..T-1: only those after the first query are masked
        s = max(0, min(t, int(qpos.min()) + 1)) if qpos.numel() else t
        logits[:, :, s:].masked_fill_(torch.arange(s, t).view(1, 1, -1) > qpos.view(1, w, 1), float("-inf"))
    else:  # one mask per KV head, shared by its GQA group; padding lies past every query
        kp = inp.key_positions()
        late = (kp > qpos.min()).any(dim=0).nonzero()  # columns before the first of these hide from no query
        if late.numel():
            s = int(late[0])
            future = kp[:, s:].unsqueeze(1) > qpos.view(1, w, 1)  # [H, W, T - s]
            logits.view(h, g, w, t)[..., s:].masked_fill_(future.unsqueeze(1), float("-inf"))
    return torch.softmax(logits, dim=-1)


_CHUNK_BYTES = 4 << 20  # window logits of a few MB at a time stay in cache (and in memory already mapped)


def window_mass(inp: LayerInputs) -> torch.Tensor:
    """Attention mass ``[H, region_len]`` the window queries pay to each candidate: summed over the
    window, averaged over the query heads of a GQA group. Zeros when the window is empty (and on padding).
    Rows are scored a few at a time (each row's mass depends on its own keys and queries only)."""
    h = inp.num_kv_heads
    w = 0 if inp.queries is None else inp.queries.shape[0] * inp.queries.shape[1]
    chunks = -(-w * inp.num_tokens * 4 // _CHUNK_BYTES)
    if chunks <= 1 or h <= 1:
        return _window_mass(inp)
    per = -(-h // min(chunks, h))
    ce = inp.context_end
    return torch.cat([_window_mass(inp.row_slice(a, min(h, a + per), ce)) for a in range(0, h, per)])


def _window_mass(inp: LayerInputs) -> torch.Tensor:
    attn = window_attention(inp)  # [Hq, W, T]
    mass = gqa_mean(attn.sum(dim=1), inp.num_kv_heads)  # [H, T]
    return mass[:, : inp.region_len]


def avg_pool(scores: torch.Tensor, kernel_size: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """1-D average pool along tokens (``[H, N]``), same length, padding excluded from the mean. ``mask``
    (``[H, N]`` bool) leaves out the entries that are not tokens, exactly as if each row ended there."""
    if kernel_size <= 1:
        return scores
    n = scores.shape[1]
    pad = kernel_size // 2

    def pool(x):
        return F.avg_pool1d(x.unsqueeze(1), kernel_size, stride=1, padding=pad,
                            count_include_pad=False).squeeze(1)[:, :n]

    if mask is None:
        return pool(scores)
    m = mask.to(scores.dtype)
    den = pool(m)
    return torch.where(den > 0, pool(scores * m) / den.clamp_min(1e-30), torch.zeros_like(scores))
