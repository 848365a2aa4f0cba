"""A tiny random Llama checkpoint for fast engine tests (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def make_tiny_llama(path: str | os.PathLike, *, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    head_dim: int = 64, vocab: int = 512, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Larger weights than the init default make attention peaky and outputs input-dependent.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)
    return path


def make_smollm2_two_kv_heads(path: str | os.PathLike, source: str | os.PathLike, *, layers: int = 4,
                              vocab: int = 4096) -> Path:
    """A small NON-random Llama derived from SmolLM2-135M's own weights (3 KV heads of 64 dims, 9 query heads,
    576 hidden), for tensor parallelism with one KV head per rank: its first ``layers`` layers, KV heads 0 and 1
    with their 6 query heads (q/k/v rows and the matching o_proj columns), MLPs and norms unchanged, the first
    ``vocab`` rows of the (tied) embedding. Deterministic: the same source gives the same checkpoint.
    Attention scores are the trained model's, so which tokens a content-dependent policy keeps depends on the
    content and differs between heads (no tokenizer: prompts are token ids below ``vocab``)."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    if (path / "config.json").exists():
        return path
    source = Path(source)
    cfg = json.loads((source / "config.json").read_text())
    w = load_file(str(source / "model.safetensors"))
    d, q_per_kv, kv = cfg["head_dim"], cfg["num_attention_heads"] // cfg["num_key_value_heads"], 2
    q_rows, kv_rows = kv * q_per_kv * d, kv * d
    out = {"model.embed_tokens.weight": w["model.embed_tokens.weight"][:vocab].clone(),
           "model.norm.weight": w["model.norm.weight"].clone()}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, t in w.items():
            if not name.startswith(p):
                continue
            if name.endswith("self_attn.q_proj.weight"):
                t = t[:q_rows]
            elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                t = t[:kv_rows]
            elif name.endswith("self_attn.o_proj.weight"):
                t = t[:, :q_rows]
            out[name] = t.clone().contiguous()
    cfg.update(num_hidden_layers=layers, num_attention_heads=kv * q_per_kv, num_key_value_heads=kv,
               vocab_size=vocab, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    cfg.pop("_model_name_or_path", None)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, path)
    return path
