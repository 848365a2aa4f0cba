"""Recording KVzip's scores with the keys and values they score: the training data of a learned surrogate
(KVzap, ``python -m vllm_contour.surrogate train``). With ``VLLM_CONTOUR_RECORD_KVZIP=DIR`` in the engine's
environment, each first round of a reconstruction policy writes, before it plans, its context's post-RoPE
keys and values (every layer and KV head, as the round reads them from vLLM's cache) and the scores the
reconstruction gave them, one file per request. ``collect`` runs an offline engine with ``kvzip`` over
given contexts and returns those files in order: the scores are the engine's own, not a re-implementation.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vllm_contour import ops
from vllm_contour.ops.fp8 import luts_of
from vllm_contour.ops.paged import dims, head_pages

ENV = "VLLM_CONTOUR_RECORD_KVZIP"


def record_dir() -> Path | None:
    d = os.environ.get(ENV)
    return Path(d) if d else None


def record_round(out: Path, req_id: str, block_ids: list[int], views: list[tuple[torch.Tensor, torch.Tensor]],
                 scores: torch.Tensor) -> Path:
    """Write ``{"keys", "values": [L, H, C, D] fp16, "scores": [L, H, C] fp32}`` of the context ``[0, C)``
    (``C = scores.shape[2]``) to ``out/<req_id>.pt``."""
    _, h, bs, d = dims(views[0][0])
    c = scores.shape[2]
    ids = head_pages(block_ids[: (c + bs - 1) // bs], h).to(views[0][0].device)
    n = len(views)
    keys, values = (ops.gather_pages([kv[side] for kv in views], ids, luts=luts_of(views, side)).view(n, h, -1, d)[:, :, :c]
                    for side in (0, 1))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{req_id}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"keys": keys.to("cpu", torch.float16), "values": values.to("cpu", torch.float16),
                "scores": scores.detach().to("cpu", torch.float32).clone()}, tmp)
    tmp.replace(path)
    return path


def collect(model_dir: str, contexts: list[list[int]], question: list[int], out: Path, dtype: str = "float32",
            budget: int = 128, batch: int = 4) -> list[Path]:
    """KVzip's in-engine scores of every context (token ids; the round runs at the context's end, before
    ``question``), through an offline engine with the plugin: one recorded file per context, in order
    (``out/ctx<i>.pt``, each with its ``tokens`` added). Contexts already recorded there are skipped."""
    os.environ[ENV] = str(out / "raw")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    longest = max(len(c) for c in contexts) + len(question)
    llm = LLM(model_dir, dtype=dtype, enforce_eager=True, seed=0, max_model_len=2 * longest + 256,
              enable_prefix_caching=True,  # the hidden requests then prefill only their repeat tokens
              additional_config={"kv_eviction": {"policy": "kvzip", "budget": budget}})
    paths = [out / f"ctx{i}.pt" for i in range(len(contexts))]
    todo = [i for i, p in enumerate(paths) if not p.exists()]
    for a in tqdm(range(0, len(todo), batch), desc="kvzip scores", unit="batch"):
        part = todo[a:a + batch]
        sps = [SamplingParams(max_tokens=1, temperature=0,
                              extra_args={"kv_policy": "kvzip", "kv_budget": budget, "kv_context_len": len(contexts[i])})
               for i in part]
        outs = llm.generate([{"prompt_token_ids": contexts[i] + question} for i in part], sps, use_tqdm=False)
        for i, o in zip(part, outs):
            key = o.request_id.split("-")[0]  # the engine's id may carry a suffix
            raw = next((f for f in (out / "raw").glob("*.pt") if f.stem.split("-")[0] == key), None)
            if raw is None:
                raise RuntimeError(f"context {i}: the engine recorded no KVzip round for request {o.request_id} "
                                   f"(its round did not run: see the engine log)")
            rec = torch.load(raw)
            rec["tokens"] = torch.tensor(contexts[i], dtype=torch.int64)
            torch.save(rec, paths[i])
            raw.unlink()
    return paths
