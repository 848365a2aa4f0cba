"""Expected Attention: closed-form expected attention of future queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LayerInputs
from .common import gqa_groups, gqa_mean, window_queries


@dataclass
class ExpectedAttentionScorer:
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
    needs_queries: bool = False

    def statistics(self, inp: LayerInputs) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(mu [S, D], Sigma [S, D, D], source)`` with S = query heads ("queries") or KV heads
        ("keys")."""
        if inp.queries is not None:
            q, _ = window_queries(inp)  # [Hq, W, D]
            if q.shape[1] > 0:
                return (*_mean_cov(q), "queries")
        ctx = inp.context_len if inp.context_len > 0 else inp.region_len
        return (*_mean_cov(inp.keys[:, :ctx].to(torch.float32)), "keys")

    def score(self, inp: LayerInputs) -> torch.Tensor:
        h, r = inp.num_kv_heads, inp.region_len
        mu, cov, _ = self.statistics(inp)
        g = gqa_groups(mu.shape[0], h)
        s = float(inp.scale)
        cand = inp.keys[:, :r].to(torch.float32).repeat_interleave(g, dim=0)  # [S, R, D]
        logit = torch.einsum("srd,sd->sr", cand, mu) * s
        if self.use_covariance:
            logit = logit + 0.5 * s * s * (torch.matmul(cand, cov) * cand).sum(-1)
        c = min(r, inp.context_len) or r
        lse = torch.logsumexp(logit[:, :c], dim=-1, keepdim=True)
        p = gqa_mean(torch.exp(logit - lse), h)  # [H, R]
        if self.use_vnorm:
            p = (p + self.epsilon) * inp.values[:, :r].to(torch.float32).norm(dim=-1)
        return p


def _mean_cov(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per leading index: mean ``[S, D]`` and unbiased covariance ``[S, D, D]`` of ``x [S, N, D]``."""
    n = x.shape[1]
    mu = x.mean(dim=1)
    if n < 2:
        return mu, torch.zeros(x.shape[0], x.shape[2], x.shape[2])
    xc = x - mu.unsqueeze(1)
    return mu, torch.matmul(xc.transpose(1, 2), xc) / (n - 1)
