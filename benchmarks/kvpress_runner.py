"""Runs RULER-style samples through NVIDIA kvpress (HF transformers); executed by benchmarks.audit inside its
own virtualenv (kvpress pins transformers < 5.3; the project's venv has transformers 5.x).

    python benchmarks/kvpress_runner.py IN.json OUT.json

IN.json: {"model": dir, "samples": [{"content", "question", "answer_prefix", "max_new", "answers", ...}],
          "configs": [{"name", "press", "budget"}]}   (press: none|snapkv|streaming|expected_attention|
          adakv_snapkv|adakv_expected_attention|knorm|kvzip; budget: tokens per head, or "P%" of the context)
A sample may instead give token ids, ``{"context_ids", "question_ids", "max_new", ...}``: the context is
prefilled under the press as kvpress's pipeline does and the question answered greedily by the pipeline's
own ``generate_answer``, with no chat template (benchmarks.passkey's plain prompts, the same ids the engine
gets); KVzipPress is then told the context has no chat-template prefix.
OUT.json: one row per (config, sample) with the answer, the compression ratio used, and the bytes of the KV
cache tensors actually held after compression (every key/value tensor's numel × element size, masked
entries included), plus the unmasked part for per-head (AdaKV) presses.

The byte accounting (``cache_bytes``, ``masked_entries``) imports nothing but what it is given, so the unit
tests check it on synthetic caches without kvpress.
"""

from __future__ import annotations

import json
import sys
import time


def iter_kv(cache):
    """(keys, values) tensors per layer of a transformers Cache (``.layers[i].keys/.values``, transformers
    >= 4.54), a legacy DynamicCache (``key_cache``/``value_cache`` lists) or a tuple of (k, v) pairs."""
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if k is not None and v is not None:
                yield k, v
    elif hasattr(cache, "key_cache"):
        yield from zip(cache.key_cache, cache.value_cache)
    else:
        for k, v in cache:
            yield k, v


def cache_bytes(cache) -> int:
    """Bytes of every key and value tensor held by the cache (numel × element size)."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in iter_kv(cache))


def cache_tokens(cache) -> list[int]:
    """Sequence length held per layer (dim -2 of the keys: [batch, heads, seq, head_dim])."""
    return [int(k.shape[-2]) for k, _ in iter_kv(cache)]


def masked_entries(model) -> int:
    """Number of (batch, head, token) entries masked out by kvpress per-head presses (AdaKV stores
    ``masked_key_indices`` = (batch idx, head idx, seq idx) on each attention module; the entries stay in
    the cache)."""
    n = 0
    for m in model.modules():
        idx = getattr(m, "masked_key_indices", None)
        if idx is not None and len(idx) == 3:
            n += int(idx[-1].numel())
    return n


def entry_bytes(cache) -> int:
    """Bytes of one (head, token) entry: key + value of head_dim elements each."""
    for k, v in iter_kv(cache):
        return k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size()
    return 0


def resolve_ratio(budget, context_len: int) -> tuple[int, float]:
    """Nominal budget (tokens per head) and kvpress compression_ratio = 1 - budget / context_len."""
    if isinstance(budget, str) and budget.endswith("%"):
        b = max(32, int(float(budget[:-1]) / 100 * context_len))
    else:
        b = int(budget)
    return b, max(0.0, 1.0 - b / context_len)


def make_press(name: str, ratio: float):
    import kvpress as kp

    if name == "snapkv":
        return kp.SnapKVPress(compression_ratio=ratio)
    if name == "streaming":
        return kp.StreamingLLMPress(compression_ratio=ratio)
    if name == "expected_attention":
        return kp.ExpectedAttentionPress(compression_ratio=ratio)
    if name == "knorm":
        return kp.KnormPress(compression_ratio=ratio)
    if name == "kvzip":  # its default: one threshold across layers and heads (layerwise=False), masks
        return kp.KVzipPress(compression_ratio=ratio)
    if name == "adakv_snapkv":
        return kp.AdaKVPress(kp.SnapKVPress(compression_ratio=ratio))
    if name == "adakv_expected_attention":
        return kp.AdaKVPress(kp.ExpectedAttentionPress(compression_ratio=ratio))
    raise ValueError(f"unknown press {name!r}")


def main(inp: str, outp: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

    import kvpress  # noqa: F401  (registers the pipeline)

    torch.set_num_threads(2)
    spec = json.loads(open(inp).read())
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    rows = []
    t_all = time.time()
    for cfg in spec["configs"]:
        for s in spec["samples"]:
            t0 = time.time()
            if "context_ids" in s:
                rows.append(run_ids(model, pipe, cfg, s))
                print(f"  {cfg['name']:<32} {time.time() - t0:5.1f} s  {rows[-1]['pred'][:40]!r}", flush=True)
                continue
            pre = pipe.preprocess(s["content"], ["\n" + s["question"]], s["answer_prefix"].lstrip(), 10**9)
            ctx_len = int(pre["context_ids"].shape[1])
            q_len = int(pre["questions_ids"][0].shape[1])
            cache = DynamicCache()
            if cfg["press"] == "none":
                press, budget, ratio = None, None, 0.0
            else:
                budget, ratio = resolve_ratio(cfg["budget"], ctx_len)
                press = make_press(cfg["press"], ratio)
            for m in model.modules():  # masks of a previous AdaKV run must not leak into this one
                if hasattr(m, "masked_key_indices"):
                    m.masked_key_indices = None
            with torch.inference_mode():
                out = pipe(s["content"], question="\n" + s["question"], answer_prefix=s["answer_prefix"].lstrip(),
                           press=press, max_new_tokens=s["max_new"], cache=cache)
            held = cache_bytes(cache)  # the pipeline crops question + answer: compressed context only
            eb = entry_bytes(cache)
            n_heads_layers = sum(k.shape[0] * k.shape[1] for k, _ in iter_kv(cache))
            masked = masked_entries(model)
            rows.append({"config": cfg["name"], "press": cfg["press"], "budget": cfg["budget"],
                         "budget_tokens": budget, "compression_ratio": ratio, "task": s["task"],
                         "length": s["length"], "idx": s["idx"], "context_tokens": ctx_len,
                         "question_tokens": q_len, "pred": out["answer"], "answers": s["answers"],
                         "cache_tokens_per_layer": cache_tokens(cache)[:1],
                         "context_bytes": held, "masked_entries": masked,
                         "unmasked_context_bytes": held - masked * eb,
                         # question tokens are held dense after the compressed context while answering
                         "held_bytes": held + q_len * (n_heads_layers * eb),
                         "seconds": time.time() - t0})
            print(f"  {cfg['name']:<32} {s['task']:<18} {time.time() - t0:5.1f} s  {out['answer'][:40]!r}",
                  flush=True)
    json.dump({"rows": rows, "seconds": time.time() - t_all,
               "versions": {"kvpress": _version("kvpress"), "transformers": _version("transformers"),
                            "torch": torch.__version__}}, open(outp, "w"), indent=1)


def run_ids(model, pipe, cfg: dict, s: dict) -> dict:
    """One sample given as token ids (see the module docstring) -> its row."""
    import contextlib

    import torch
    from transformers import DynamicCache

    import kvpress as kp

    t0 = time.time()
    ctx = torch.tensor([s["context_ids"]])
    question = torch.tensor([s["question_ids"]])
    budget, ratio = (None, 0.0) if cfg["press"] == "none" else resolve_ratio(cfg["budget"], ctx.shape[1])
    press = None if cfg["press"] == "none" else make_press(cfg["press"], ratio)
    for m in model.modules():
        if hasattr(m, "masked_key_indices"):
            m.masked_key_indices = None
    cache = DynamicCache()
    with torch.inference_mode():
        with press(model) if press is not None else contextlib.nullcontext():
            if isinstance(press, kp.KVzipPress):
                press.prefix_length = 0  # plain text: no chat-template prefix to skip
            model.model(input_ids=ctx, past_key_values=cache)
        held, eb, masked = cache_bytes(cache), entry_bytes(cache), masked_entries(model)
        heads_layers = sum(k.shape[0] * k.shape[1] for k, _ in iter_kv(cache))
        pred = pipe.generate_answer(question_ids=question, cache=cache, context_length=ctx.shape[1],
                                    max_new_tokens=s["max_new"])
    return {"config": cfg["name"], "press": cfg["press"], "budget": cfg["budget"], "budget_tokens": budget,
            "compression_ratio": ratio, "idx": s.get("idx"), "context_tokens": int(ctx.shape[1]),
            "question_tokens": int(question.shape[1]), "pred": pred, "answers": s.get("answers"),
            "context_bytes": held, "masked_entries": masked, "unmasked_context_bytes": held - masked * eb,
            "entry_bytes": eb, "heads_layers": heads_layers, "seconds": time.time() - t0}


def _version(name: str) -> str:
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:
        return "?"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
