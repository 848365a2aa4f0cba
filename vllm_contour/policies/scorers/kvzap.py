"""KVzap: a learned surrogate of KVzip's scores, computed from each token's own key and value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..base import LayerInputs, ModelIdentity, Scorer

VERSION = 1  # of the surrogate's state (``SurrogateNet.state``); a file of another version is refused


def unrope(keys: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Post-RoPE keys ``[R, T, D]`` at ``positions [R, T]`` back to the projection's output (the rotation of
    vLLM's Llama-style ``neox`` RoPE, half-split pairs ``(i, i + D/2)``, undone)."""
    d = keys.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=keys.device) / d)  # [D/2]
    ang = positions.to(torch.float64).unsqueeze(-1) * inv  # [R, T, D/2]
    cos, sin = ang.cos().to(torch.float32), ang.sin().to(torch.float32)
    k = keys.to(torch.float32)
    k1, k2 = k[..., : d // 2], k[..., d // 2:]
    return torch.cat([k1 * cos + k2 * sin, k2 * cos - k1 * sin], dim=-1)


@dataclass
class SurrogateNet:
    """Per (layer, KV head) a small MLP (``hidden`` units; 0 = linear) from a token's features -- its key with
    RoPE undone and its value, ``2 * head_dim``, standardised -- to KVzip's log-score of that token. Tied to one
    model by its fingerprint (``vllm_contour.surrogate``)."""

    model: str
    fingerprint: str
    rope_theta: float
    mean: torch.Tensor  # [L, H, F]
    std: torch.Tensor  # [L, H, F]
    w1: torch.Tensor  # [L, H, F, M] (M = hidden), or [L, H, F, 1] when linear
    b1: torch.Tensor  # [L, H, M]
    w2: torch.Tensor  # [L, H, M] (unused when linear)
    b2: torch.Tensor  # [L, H]
    meta: dict = field(default_factory=dict)  # how it was trained and how well it does (free-form, recorded)

    @property
    def num_layers(self) -> int:
        return self.mean.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.mean.shape[1]

    @property
    def head_dim(self) -> int:
        return self.mean.shape[2] // 2

    @property
    def hidden(self) -> int:
        return 0 if self.w2.numel() == 0 else self.w1.shape[-1]

    def features(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[R, T, 2D]``: each token's key with RoPE undone, then its value (fp32, not standardised)."""
        return torch.cat([unrope(keys, positions, self.rope_theta), values.to(torch.float32)], dim=-1)

    def predict(self, feats: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Log-scores ``[R, T]`` of rows ``feats [R, T, F]``, row r of layer ``layers[r]``, KV head ``heads[r]``."""
        x = (feats - self.mean[layers, heads].unsqueeze(1)) / self.std[layers, heads].unsqueeze(1)
        w1, b1 = self.w1[layers, heads], self.b1[layers, heads]
        h = torch.bmm(x, w1) + b1.unsqueeze(1)  # [R, T, M]
        if self.hidden == 0:
            return h.squeeze(-1) + self.b2[layers, heads].unsqueeze(1)
        return torch.bmm(F.gelu(h), self.w2[layers, heads].unsqueeze(-1)).squeeze(-1) + self.b2[layers, heads].unsqueeze(1)

    def state(self) -> dict:
        return {"version": VERSION, "model": self.model, "fingerprint": self.fingerprint,
                "rope_theta": float(self.rope_theta), "mean": self.mean, "std": self.std, "w1": self.w1,
                "b1": self.b1, "w2": self.w2, "b2": self.b2, "meta": self.meta}

    @classmethod
    def from_state(cls, st: dict, source: str = "surrogate") -> "SurrogateNet":
        if st.get("version") != VERSION:
            raise ValueError(f"{source}: surrogate version {st.get('version')!r}, this build reads version {VERSION}")
        net = cls(st["model"], st["fingerprint"], float(st["rope_theta"]),
                  *(st[k].to(torch.float32) for k in ("mean", "std", "w1", "b1", "w2", "b2")), meta=st.get("meta", {}))
        lh = net.mean.shape[:2]
        for k in ("std", "w1", "b1", "b2"):
            if getattr(net, k).shape[:2] != lh:
                raise ValueError(f"{source}: {k} has shape {tuple(getattr(net, k).shape)}, expected [{lh[0]}, {lh[1]}, ...]")
        return net


@dataclass
class KVzapScorer(Scorer):
    """KVzap ("KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", arXiv 2601.07891; kvpress's ``KVzapPress``):
    a per-layer small model trained to predict KVzip's log-scores (``KVzipScorer``: the max attention a context
    token gets while the model repeats the context; the paper fits KVzip+, a normalised variant) from what the layer already has for each token, so every token -- prompt and generated alike --
    is scored in the forward, without a reconstruction and without queries. The paper reads the layer's
    hidden state; here the model reads what the round has for each token: its key (RoPE undone, so the score
    does not depend on where the token sits) and value, per KV head (``SurrogateNet``). Scores are
    ``exp(log-score)``, KVzip's scale, so KVzip's allocators apply unchanged.

    ``surrogate``: a surrogate file; empty = the one shipped for the served model. ``bind_model`` takes the
    served model; a surrogate trained on another model is refused naming both. No preset uses this scorer and
    the engine binds none: the surrogate trained here for SmolLM2 ranks KVzip's scores far better than key norm
    held out, yet loses the needle that KVzip and key norm keep on the hidden-question passkey
    (docs/results.md, "KVzap: a learned KVzip surrogate (not a preset)")."""

    surrogate: str = ""
    needs_values: ClassVar[bool] = True
    binds_model: ClassVar[bool] = True
    net: SurrogateNet | None = field(default=None, repr=False, compare=False)

    def bind_model(self, model: ModelIdentity) -> None:
        from vllm_contour.surrogate.store import for_model

        self.net = for_model(model, self.surrogate)

    def score(self, inp: LayerInputs) -> torch.Tensor:
        net = self.net
        if net is None:
            raise ValueError("kvzap scores with a surrogate bound to the served model, and none is bound "
                             "(the engine binds it; outside the engine pass net=SurrogateNet)")
        rows, h = inp.num_kv_heads, net.num_kv_heads
        if rows % h:
            raise ValueError(f"surrogate of {net.model} has {h} KV heads per layer; the round has {rows} rows "
                             f"(tensor parallel ranks hold a part of the heads: not supported)")
        layers = inp.layer_idx + torch.arange(rows, device=inp.keys.device) // h
        if int(layers.max()) >= net.num_layers or inp.head_dim != net.head_dim:
            raise ValueError(f"surrogate of {net.model} covers {net.num_layers} layers of head dim {net.head_dim}; "
                             f"the round has layer {int(layers.max())}, head dim {inp.head_dim}")
        heads = torch.arange(rows, device=inp.keys.device) % h
        r = inp.region_len
        pos = inp.key_positions()[:, :r].to(inp.keys.device)
        pos = torch.where(inp.key_mask()[:, :r].to(pos.device), pos, torch.zeros_like(pos))  # padding: any place
        feats = net.features(inp.keys[:, :r], inp.values[:, :r], pos)
        return net.predict(feats, layers, heads).exp()
