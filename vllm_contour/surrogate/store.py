"""Surrogate files: saved and loaded (``torch.save`` of ``SurrogateNet.state``, read with ``weights_only``),
the ones shipped in the package (``weights/<model>-<fingerprint>.pt``), and the one a served model gets:
a surrogate whose fingerprint is not the model's is refused, naming both.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_contour.policies.base import ModelIdentity
from vllm_contour.policies.scorers.kvzap import SurrogateNet

SHIPPED = Path(__file__).resolve().parent / "weights"
TRAIN_HINT = "python -m vllm_contour.surrogate train --model MODEL_DIR"


def save(net: SurrogateNet, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state(), path)
    return path


def load(path: str | Path) -> SurrogateNet:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"surrogate file {str(p)!r} does not exist")
    return SurrogateNet.from_state(torch.load(p, map_location="cpu", weights_only=True), source=str(p))


def shipped_name(model: ModelIdentity) -> str:
    return f"{model.name}-{model.fingerprint}.pt"


def shipped() -> list[Path]:
    return sorted(SHIPPED.glob("*.pt"))


def for_model(model: ModelIdentity, path: str = "") -> SurrogateNet:
    """The surrogate the served ``model`` scores with: ``path`` when given, else the shipped one whose fingerprint
    is the model's. Raises ``ValueError`` naming the model and the surrogate when they do not belong together."""
    if not path:
        match = [p for p in shipped() if p.stem.endswith(f"-{model.fingerprint}")]
        if not match:
            have = ", ".join(p.stem for p in shipped()) or "none"
            raise ValueError(f"kvzap: no surrogate is shipped for model {model.name} (fingerprint "
                             f"{model.fingerprint}); shipped: {have}. Train one: {TRAIN_HINT}, then pass "
                             f"its file as KVzapScorer(surrogate=PATH)")
        path = str(match[0])
    net = load(path)
    if net.fingerprint != model.fingerprint:
        raise ValueError(f"kvzap: surrogate {path} was trained on model {net.model} (fingerprint {net.fingerprint}), "
                         f"not on the served model {model.name} (fingerprint {model.fingerprint})")
    return net
