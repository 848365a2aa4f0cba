"""KVzip context-reconstruction scorer, and the reconstruction attention it is made of."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import LayerInputs, Scorer


@dataclass
class KVzipScorer(Scorer):
    """KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", NeurIPS
    2025): a context key's score is the largest attention the model pays it while repeating the context
    ("Repeat the previous context exactly." + the chat template's suffix + the context, in chunks), the max
    over the repeat queries and the query heads of its GQA group (``reconstruction_max``). The engine runs
    the reconstruction once per context, before any question (``integration/reconstruction/``), and hands
    the scores in ``LayerInputs.reconstruction``; nothing is computed at round time."""

    needs_reconstruction: ClassVar[bool] = True

    def score(self, inp: LayerInputs) -> torch.Tensor:
        if inp.reconstruction is None:
            raise ValueError("kvzip scores come from the context reconstruction, which did not run for this round")
        return inp.reconstruction[:, : inp.region_len].to(torch.float32)


def reconstruction_max(queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, span: tuple[int, int],
                       repeat_start: int, scale: float, sinks: int = 4, slice_size: int = 32) -> torch.Tensor:
    """KVzip's score of the context keys ``[s, e)`` from one reconstruction chunk, as kvpress's ``KVzipPress``
    computes it: every repeat query attends (softmax) to the first ``min(sinks, s)`` keys, the chunk's keys
    ``[s, e)`` and the repeat keys up to its own position; a key's score is the max of its weight over the
    queries and the query heads of its group.

    queries: ``[Hq, n, D]`` post-RoPE queries of repeat tokens at absolute ``query_positions [n]`` (all at or
    after ``repeat_start``); keys: ``[H, T, D]`` post-RoPE keys of positions ``0..T-1`` (T past the last
    query). Returns ``[H, e - s]`` float32. The max is taken over log-weights (logit - the query's
    log-sum-exp) and exponentiated once at the end, so no softmax is materialised; ``slice_size`` queries at
    a time keep a slice's logits in cache and bound the memory."""
    s, e = span
    h, _, d = keys.shape
    g = queries.shape[0] // h
    sink = min(sinks, s)
    n_ctx = sink + e - s
    last = int(query_positions.max()) + 1
    k = torch.cat([keys[:, :sink], keys[:, s:e], keys[:, repeat_start:last]], dim=1).to(torch.float32)
    rep_pos = torch.arange(repeat_start, last, device=keys.device)
    best = torch.full((h, e - s), float("-inf"), dtype=torch.float32, device=keys.device)
    q_all = (queries.to(torch.float32) * scale).view(h, g, -1, d)
    for a in range(0, q_all.shape[2], slice_size):
        q = q_all[:, :, a : a + slice_size]
        pos = query_positions[a : a + slice_size].to(keys.device)
        width = n_ctx + int(pos.max()) + 1 - repeat_start  # the slice's last query sees no key past itself
        logits = torch.matmul(q.reshape(h, -1, d), k[:, :width].transpose(1, 2)).view(h, g, q.shape[2], width)
        hidden = rep_pos[: width - n_ctx].view(1, -1) > pos.view(-1, 1)  # [n, repeat]: a repeat key after the query
        logits[..., n_ctx:].masked_fill_(hidden, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        torch.maximum(best, logits[..., sink:n_ctx].sub_(lse).amax(dim=(1, 2)), out=best)
    return best.exp_()
