"""Fitting a KVzap surrogate to recorded KVzip scores, and measuring it on held-out contexts (pure torch).

A recorded context (``integration/reconstruction/record.py``) holds every layer's and KV head's post-RoPE keys
and values ``[L, H, C, D]`` and KVzip's scores ``[L, H, C]``; the first ``SINKS`` tokens (scored 1 by KVzip,
kept by every policy) are left out. Every (layer, head) gets its own model (``SurrogateNet``), all trained
together (one batched matmul), by mean squared error on the log-score, Adam, seeded minibatches. Held out:
Spearman's rank correlation of the prediction with KVzip's scores per (context, layer, head), averaged per
layer, beside key norm's (``-||k||``, the query-free baseline), and the share of KVzip's top quarter that the
prediction's top quarter holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_contour.policies.scorers.kvzap import SurrogateNet, unrope

SINKS = 4
LOG_FLOOR = 1e-9  # KVzip's scores are softmax weights, never 0 in the recorded data; log of this at worst


@dataclass
class Recorded:
    keys: torch.Tensor  # [L, H, C, D] fp16
    values: torch.Tensor  # [L, H, C, D] fp16
    scores: torch.Tensor  # [L, H, C] fp32
    tokens: torch.Tensor | None = None  # [C]

    @classmethod
    def load(cls, path: Path) -> "Recorded":
        r = torch.load(path, map_location="cpu", weights_only=True)
        for k in ("keys", "values", "scores"):
            if k not in r:
                raise ValueError(f"{path}: a recorded context needs {k!r}")
        return cls(r["keys"], r["values"], r["scores"], r.get("tokens"))


def rope_check(recs: list[Recorded], theta: float) -> float | None:
    """The median relative difference of layer 0's keys, RoPE undone, between two places of the same token id
    (layer 0's key is a function of the token alone, so this is ~0 when ``theta`` and the RoPE style are the
    model's). None when no context repeats a token or none has token ids."""
    diffs = []
    for r in recs:
        if r.tokens is None:
            continue
        k = r.keys[0].to(torch.float32)
        pre = unrope(k, torch.arange(k.shape[1]).expand(k.shape[0], -1), theta)
        first: dict[int, int] = {}
        for i, t in enumerate(r.tokens.tolist()):
            if t in first:
                a = pre[:, first[t]]
                diffs.append(float((pre[:, i] - a).norm() / a.norm().clamp_min(1e-6)))
            else:
                first[t] = i
    return float(torch.tensor(diffs).median()) if diffs else None


def features(recs: list[Recorded], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``X [L, H, N, 2D]`` (fp16: key with RoPE undone, value) and ``y [L, H, N]`` (log-score) of every
    recorded token past the sinks."""
    xs, ys = [], []
    for r in recs:
        c = r.keys.shape[2]
        pos = torch.arange(SINKS, c)
        k = r.keys[:, :, SINKS:].to(torch.float32)
        l, h = k.shape[:2]
        pre = unrope(k.reshape(l * h, c - SINKS, -1), pos.expand(l * h, -1), theta).view(l, h, c - SINKS, -1)
        xs.append(torch.cat([pre, r.values[:, :, SINKS:].to(torch.float32)], dim=-1).to(torch.float16))
        ys.append(r.scores[:, :, SINKS:].clamp_min(LOG_FLOOR).log())
    return torch.cat(xs, dim=2), torch.cat(ys, dim=2)


def fit(x: torch.Tensor, y: torch.Tensor, hidden: int, epochs: int, seed: int, lr: float = 3e-3,
        batch: int = 4096, weight_decay: float = 1e-4, progress=None) -> dict[str, torch.Tensor]:
    """Every (layer, head)'s model on its tokens (``x [L, H, N, F]``, ``y [L, H, N]``) -> the
    ``SurrogateNet`` tensors. ``progress(epoch, loss)`` after each epoch."""
    g = torch.Generator().manual_seed(seed)
    l, h, n, f = x.shape
    xf = x.to(torch.float32)
    mean = xf.mean(dim=2)
    std = xf.std(dim=2).clamp_min(1e-4)
    del xf
    m = max(hidden, 1)
    w1 = (torch.randn(l * h, f, m, generator=g) / math.sqrt(f)).requires_grad_()
    b1 = torch.zeros(l * h, 1, m, requires_grad=True)
    w2 = (torch.randn(l * h, m, 1, generator=g) / math.sqrt(m) if hidden else torch.zeros(l * h, 0, 1)).requires_grad_()
    b2 = y.mean(dim=2).reshape(l * h, 1, 1).clone().requires_grad_()
    params = [w1, b1, b2] + ([w2] if hidden else [])
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    steps = epochs * max(1, n // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    mu, sd = mean.reshape(l * h, 1, f), std.reshape(l * h, 1, f)
    xs, ys = x.reshape(l * h, n, f), y.reshape(l * h, n)

    def forward(xb):
        z = torch.baddbmm(b1, (xb - mu) / sd, w1)
        return (z if not hidden else torch.bmm(torch.nn.functional.gelu(z), w2)).squeeze(-1) + b2.squeeze(-1)

    for ep in range(epochs):
        order = torch.randperm(n, generator=g)
        total = 0.0
        for a in range(0, n - batch + 1 if n >= batch else 1, batch):
            idx = order[a:a + batch]
            loss = torch.nn.functional.mse_loss(forward(xs[:, idx].to(torch.float32)), ys[:, idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched.last_epoch + 1 < steps:
                sched.step()
            total += float(loss.detach()) * idx.numel()
        if progress is not None:
            progress(ep, total / n)
    with torch.no_grad():
        return {"mean": mean, "std": std, "w1": w1.detach().view(l, h, f, m),
                "b1": b1.detach().view(l, h, m), "w2": w2.detach().view(l, h, -1), "b2": b2.detach().view(l, h)}


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rank correlation along the last dimension (no tie correction: the values are continuous)."""
    ra = a.argsort(dim=-1).argsort(dim=-1).to(torch.float64)
    rb = b.argsort(dim=-1).argsort(dim=-1).to(torch.float64)
    ra = ra - ra.mean(dim=-1, keepdim=True)
    rb = rb - rb.mean(dim=-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1)).clamp_min(1e-12)


def top_overlap(pred: torch.Tensor, true: torch.Tensor, frac: float = 0.25) -> torch.Tensor:
    """Share of ``true``'s top ``frac`` (last dimension) that ``pred``'s top ``frac`` holds."""
    k = max(1, int(pred.shape[-1] * frac))
    hit = torch.zeros_like(pred, dtype=torch.bool).scatter_(-1, pred.topk(k, dim=-1).indices, True)
    return hit.gather(-1, true.topk(k, dim=-1).indices).to(torch.float64).mean(dim=-1)


def evaluate(net: SurrogateNet, recs: list[Recorded]) -> dict:
    """Per layer (mean over held-out contexts and KV heads): Spearman of the surrogate and of key norm with
    KVzip's scores, and the surrogate's top-quarter overlap."""
    sur, kn, top = [], [], []
    for r in recs:
        l, h, c, d = r.keys.shape
        keys = r.keys[:, :, SINKS:].reshape(l * h, c - SINKS, d)
        vals = r.values[:, :, SINKS:].reshape(l * h, c - SINKS, d)
        pos = torch.arange(SINKS, c).expand(l * h, -1)
        layers = torch.arange(l).repeat_interleave(h)
        heads = torch.arange(h).repeat(l)
        with torch.no_grad():
            pred = net.predict(net.features(keys, vals, pos), layers, heads).view(l, h, -1)
        true = r.scores[:, :, SINKS:]
        sur.append(spearman(pred, true))
        kn.append(spearman(-keys.to(torch.float32).norm(dim=-1).view(l, h, -1), true))
        top.append(top_overlap(pred, true))
    per = {name: torch.stack(v).mean(dim=(0, 2)) for name, v in (("surrogate", sur), ("knorm", kn), ("top", top))}
    return {"spearman_per_layer": [round(float(v), 4) for v in per["surrogate"]],
            "knorm_spearman_per_layer": [round(float(v), 4) for v in per["knorm"]],
            "top_quarter_overlap_per_layer": [round(float(v), 4) for v in per["top"]],
            "spearman_mean": round(float(per["surrogate"].mean()), 4),
            "knorm_spearman_mean": round(float(per["knorm"].mean()), 4),
            "top_quarter_overlap_mean": round(float(per["top"].mean()), 4)}
