"""The workers' half of KVzip's context reconstruction (the scheduler's half adds the hidden requests):
after the forward, a hidden request's captured repeat queries of the step and its keys (read from vLLM's
cache: every layer's KV of the step is written) give KVzip's max attention over its owner's context keys,
folded (max) into the owner's ``[L, H, C]`` scores, which the owner's rounds read (kept while the owner
runs: a streaming-input session's later round needs its kept tokens' scores too). A copy is kept under the
context's key for later requests with the same context, which are then scored without a reconstruction.
"""

from __future__ import annotations

import torch

from vllm_contour import ops
from vllm_contour.integration.messages import ReconItem, RoundItem
from vllm_contour.ops.fp8 import luts_of
from vllm_contour.ops.paged import dims, head_pages
from vllm_contour.policies.scorers.kvzip import reconstruction_max

SINKS = 4  # kvpress's KVzipPress scores its first 4 context tokens 1 (kept as attention sinks)


class ContextScores:
    """Per worker: the running owners' scores and the copies kept by context key (the scheduler bounds
    them and names those to drop)."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[int, torch.Tensor]] = {}  # owner -> (its epoch, [L, H, C] scores)
        self.kept: dict[str, torch.Tensor] = {}  # context key -> [L, H, C] scores

    def drop_owner(self, req_id: str) -> None:
        self.held.pop(req_id, None)

    def drop_kept(self, keys) -> None:
        for key in keys:
            self.kept.pop(key, None)

    @property
    def nbytes(self) -> int:
        held = sum(s.numel() * s.element_size() for _, s in self.held.values())
        return held + sum(s.numel() * s.element_size() for s in self.kept.values())

    def fold(self, item: ReconItem, positions: torch.Tensor, queries: torch.Tensor,
             views: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """``queries [L, n, Hq, D]`` of the hidden request at ``positions [n]`` (its repeat tokens of the
        step)."""
        _, h, bs, d = dims(views[0][0])
        num_layers = len(views)
        held = self.held.get(item.owner)
        if held is None or held[0] != item.epoch:
            scores = torch.zeros((num_layers, h, item.context_len), dtype=torch.float32, device=queries.device)
            scores[:, :, :SINKS] = 1.0
            held = self.held[item.owner] = (item.epoch, scores)
        elif held[1].shape[2] < item.context_len:  # a streaming-input session's next chunk: earlier scores kept
            more = held[1].new_zeros((num_layers, h, item.context_len - held[1].shape[2]))
            held = self.held[item.owner] = (item.epoch, torch.cat([held[1], more], dim=2))
        scores = held[1]
        ids = head_pages(item.block_ids, h).to(queries.device)
        last = int(positions.max()) + 1
        keys = ops.gather_pages([k for k, _ in views], ids, luts=luts_of(views, 0)).view(num_layers, h, -1, d)[:, :, :last]
        s, e = item.span
        for layer in range(num_layers):
            got = reconstruction_max(queries[layer].transpose(0, 1), positions, keys[layer], item.span,
                                     item.repeat_start, scale, sinks=SINKS)
            seg = scores[layer, :, s:e]
            torch.maximum(seg, got, out=seg)

    def for_round(self, item: RoundItem) -> torch.Tensor | None:
        """The ``[L, H, C]`` scores a kvzip round plans with: the owner's own (a copy kept under the context's
        key when the round says so), or a copy of those kept from an earlier request with the same context.
        Copies: a later streaming-input chunk folds into its owner's scores in place."""
        ref = item.scores
        held = self.held.get(item.req_id)
        if ref is not None and not ref.store and (held is None or held[0] != ref.epoch):
            kept = self.kept.get(ref.key)
            if kept is None:
                raise ValueError("the context's kept KVzip scores are not on this worker")
            held = self.held[item.req_id] = (ref.epoch, kept.clone())
        if held is None:
            return None
        if ref is not None and ref.store:
            self.kept[ref.key] = held[1].clone()
        return held[1]
