"""Which model a surrogate belongs to: a fingerprint of the model's architecture (its config's shape fields)
and of a few of its weight tensors (the first and last layers' key and value projections, as bf16 bytes, so
an fp32 and a bf16 copy of the same weights agree). Read from the model's folder (``config.json`` and
safetensors files) without loading the model; a hub id is looked up in the local Hugging Face cache only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from vllm_contour.policies.base import ModelIdentity

CONFIG_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "rope_theta", "rope_parameters")
TENSORS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")


def model_folder(model: str) -> Path:
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:
        raise ValueError(f"model {model!r}: no local folder with its config and weights ({e})") from None


def text_config(cfg: dict) -> dict:
    """The language model's part of a config (multimodal configs nest it)."""
    return cfg.get("text_config", cfg)


def rope_theta(cfg: dict) -> float:
    cfg = text_config(cfg)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError("the model's config names no rope_theta")
    return float(theta)


def identify(model: str) -> ModelIdentity:
    """The served model's identity: its folder's name and the fingerprint."""
    folder = model_folder(model)
    cfg = text_config(json.loads((folder / "config.json").read_text()))
    n = int(cfg["num_hidden_layers"])
    h = hashlib.sha256(json.dumps({k: cfg.get(k) for k in CONFIG_FIELDS}, sort_keys=True).encode())
    wanted = {f"model.layers.{i}.{t}" for i in (0, n - 1) for t in TENSORS}
    found = {}
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                short = name.removeprefix("language_model.").removeprefix("model.language_model.")
                short = short if short.startswith("model.") else f"model.{short}" if short.startswith("layers.") else short
                if short in wanted and short not in found:
                    found[short] = st.get_tensor(name)
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"model {model!r}: its safetensors have no {', '.join(missing)} (a Llama-style layout is "
                         f"needed to fingerprint it)")
    for name in sorted(found):
        h.update(name.encode())
        h.update(found[name].to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
    return ModelIdentity(name=folder.name, fingerprint=h.hexdigest()[:16])
