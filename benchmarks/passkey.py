"""Passkey retrieval in a filler haystack, through real vLLM with the plugin (offline ``LLM.generate``).

One engine serves every configuration: the server default is a policy, each request picks its own policy
and budget through ``SamplingParams.extra_args`` (``kv_policy="none"`` = full cache). Budgets are given in
tokens per KV head per layer and as fractions of the context. Writes ``passkey.json`` and ``passkey.png``.

    python -m benchmarks.passkey [--quick] [--out DIR] [--policies streaming,snapkv] [--budgets 128,512,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def make_prompt(tok, context_tokens: int, depth: float, key: int, chat: bool = False) -> tuple[list[int], int]:
    """Prompt whose haystack has ~context_tokens tokens, the needle at relative depth; plain completion
    text by default (a chat-formatted run on 2026-11-30 scored 1/10 even with the full cache: the model
    answered "The pass key is a magical key..."). Returns the token ids and the number of tokens before the
    question (the context boundary)."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    intro = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    filler_ids = tok.encode(FILLER, add_special_tokens=False)
    n_fill = max(1, (context_tokens - 80) // len(filler_ids))
    parts = [FILLER] * n_fill
    parts.insert(int(round(depth * n_fill)), needle)
    question = "What is the pass key? The pass key is"
    content = intro + "".join(parts)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": content + "\n" + question}],
                                       add_generation_prompt=True, tokenize=False)
    else:
        text = content + "\n" + question
    ids = tok.encode(text, add_special_tokens=False)
    q_ids = tok.encode("\n" + question, add_special_tokens=False)
    return list(ids), len(ids) - len(q_ids) - (8 if chat else 0)


def run(args) -> dict:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from vllm_contour.models import fetch_model

    model = str(fetch_model(args.model, quiet=True))
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0,
              additional_config={"kv_eviction": {"policy": "snapkv", "budget": 128}})
    tok = llm.get_tokenizer()
    rnd = random.Random(args.seed)
    trials = []
    for i in range(args.trials):
        depth = (i + 0.5) / args.trials
        key = rnd.randrange(10000, 99999)
        ids, ctx = make_prompt(tok, args.context, depth, key, chat=args.chat)
        trials.append({"depth": depth, "key": key, "ids": ids, "context_len": ctx})
    n_tokens = len(trials[0]["ids"])
    configs = [("full", "none", None)]
    budgets = [int(b) for b in args.budgets.split(",")]
    fracs = [float(f) for f in args.fractions.split(",")] if args.fractions else []
    for pol in args.policies.split(","):
        for b in budgets:
            configs.append((f"{pol}@{b}", pol, b))
        for f in fracs:
            configs.append((f"{pol}@{int(f * 100)}%", pol, max(32, int(f * n_tokens))))
    results = {}
    t0 = time.time()
    for name, pol, budget in tqdm(configs, desc="configs"):
        extra = {"kv_policy": pol} if budget is None else {"kv_policy": pol, "kv_budget": budget}
        sp = SamplingParams(max_tokens=12, temperature=0, extra_args=extra)
        outs = llm.generate([{"prompt_token_ids": t["ids"]} for t in trials], sp, use_tqdm=False)
        hits = [str(t["key"]) in o.outputs[0].text for t, o in zip(trials, outs)]
        results[name] = {"policy": pol, "budget": budget, "correct": sum(hits), "trials": len(hits),
                         "answers": [o.outputs[0].text for o in outs]}
    return {"model": args.model, "prompt_tokens": n_tokens, "trials": args.trials, "results": results,
            "seconds": time.time() - t0, "date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["results"])
    vals = [res["results"][n]["correct"] for n in names]
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.6), 3.5))
    ax.bar(range(len(names)), vals)
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right")
    ax.set_ylabel(f"correct / {res['trials']}")
    ax.set_title(f"passkey, {res['prompt_tokens']}-token prompt ({res['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 trials, budgets 128,512")
    ap.add_argument("--out", default="results")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--policies", default="streaming,snapkv")
    ap.add_argument("--budgets", default="128,512,1024")
    ap.add_argument("--fractions", default="")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    args = ap.parse_args()
    if args.quick:
        args.trials, args.budgets = 3, "128,512"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    (out / "passkey.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "passkey.png")
    print(f"{'config':<22}{'correct':>8}")
    for name, r in res["results"].items():
        print(f"{name:<22}{r['correct']:>5}/{r['trials']}")
    print(f"prompt tokens {res['prompt_tokens']}, {res['seconds']:.0f} s -> {out / 'passkey.json'}")


if __name__ == "__main__":
    main()
