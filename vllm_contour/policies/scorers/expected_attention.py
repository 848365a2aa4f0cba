"""Expected Attention: closed-form expected attention of future queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LayerInputs, Scorer
from .common import gqa_groups, gqa_mean, window_queries


@dataclass
class ExpectedAttentionScorer(Scorer):
    """Expected Attention (Devoto et al., "Expected Attention: KV Cache Compression by Estimating
    Attention from Future Queries Distribution", 2025; kvpress ``ExpectedAttentionPress``).

    Estimator used here. Future queries of a query head are modelled as a Gaussian
    ``q ~ N(mu, Sigma)``; for a key k the expected un-normalised attention is the Gaussian moment
    generating function ``E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2)`` (s = softmax scale).
    Scores are these log-values soft-maxed over the candidates of the scoring context (an expected
    attention distribution), averaged over the query heads of a GQA group and, with ``use_vnorm``,
    multiplied by ``||v||`` (as kvpress: ``(p + epsilon) * ||v||``).

    Where ``mu`` and ``Sigma`` come from:
    - captured window queries inside the scoring context (post-RoPE, per query head): sample mean and
      unbiased sample covariance (zero covariance with a single query). The paper/kvpress instead take
      pre-RoPE hidden-state statistics and average the RoPE rotation over the next positions; the
      engine only captures post-RoPE queries of the last ``W`` tokens, which sit right before the
      future positions, so they are used as they are.
    - no queries (``queries=None``, or none inside the context): a crude query-free proxy from the
      keys of the scoring context of each KV head (mean and covariance of the keys), i.e. "future
      queries look like the keys". This makes the scorer usable query-agnostically
      (``needs_queries=False``); it is a heuristic, prefer captured queries when the engine has them.
    Only tokens before ``context_end`` enter the statistics and the normalisation.
    """

    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    @property
    def needs_values(self) -> bool:
        return bool(self.use_vnorm)

    def statistics(self, inp: LayerInputs) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(mu [S, D], Sigma [S, D, D], source)`` with S = query heads ("queries") or KV heads
        ("keys")."""
        if inp.queries is not None:
            q, _ = window_queries(inp)  # [Hq, W, D]
            if q.shape[1] > 0:
                return (*_mean_cov(q), "queries")
        ctx = inp.context_mask()
        if not bool(ctx.any()):
            ctx = inp.key_mask()
        return (*_mean_cov(inp.keys.to(torch.float32), ctx), "keys")

    def score(self, inp: LayerInputs) -> torch.Tensor:
        h, r = inp.num_kv_heads, inp.region_len
        mu, cov, _ = self.statistics(inp)
        g = gqa_groups(mu.shape[0], h)
        s = float(inp.scale)
        cand = inp.keys[:, :r].to(torch.float32).repeat_interleave(g, dim=0)  # [S, R, D]
        logit = torch.einsum("srd,sd->sr", cand, mu) * s
        if self.use_covariance:
            logit = logit + 0.5 * s * s * (torch.matmul(cand, cov) * cand).sum(-1)
        in_ctx = inp.context_mask()[:, :r] & inp.candidate_mask()
        if not bool(in_ctx.any()):
            in_ctx = torch.ones_like(in_ctx)
        in_ctx = in_ctx.repeat_interleave(g, dim=0)
        lse = torch.logsumexp(logit.masked_fill(~in_ctx, -float("inf")), dim=-1, keepdim=True)
        p = gqa_mean(torch.exp(logit - lse), h)  # [H, R]
        if self.use_vnorm:
            p = (p + self.epsilon) * inp.values[:, :r].to(torch.float32).norm(dim=-1)
        return p


def _mean_cov(x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per leading index: mean ``[S, D]`` and unbiased covariance ``[S, D, D]`` of ``x [S, N, D]`` over the
    entries where ``mask [S, N]`` is True (all when None); zero covariance with fewer than 2 entries."""
    m = torch.ones(x.shape[:2], dtype=x.dtype) if mask is None else mask.to(x.dtype)
    n = m.sum(dim=1)  # [S]
    mu = (x * m.unsqueeze(-1)).sum(dim=1) / n.clamp_min(1.0).unsqueeze(-1)
    xc = (x - mu.unsqueeze(1)) * m.unsqueeze(-1)
    cov = torch.matmul(xc.transpose(1, 2), xc) / (n - 1).clamp_min(1.0).view(-1, 1, 1)
    return mu, torch.where((n >= 2).view(-1, 1, 1), cov, torch.zeros_like(cov))
