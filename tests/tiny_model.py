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
