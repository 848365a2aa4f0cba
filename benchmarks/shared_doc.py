"""One document, many questions: prefix caching with eviction (issue 13's measurement).

A ~2,000-token document (a play passage with ``--facts`` four-digit room codes spread through it) and one
question per fact, sent to ``vllm-contour serve`` in three configurations on the same small pool:

- ``stock_pc``: stock vLLM with prefix caching (it shares the dense document between requests);
- ``evict_pc``: eviction (``--kv-eviction-policy P --kv-budget B``) with prefix caching on, each request
  marking the document as its context (``vllm_xargs: {"kv_context_len": len(document)}``): the first
  request compresses the document once and every later one adopts that shared compressed copy as its
  prefix-cache hit and prefills only its question over it (``--kv-share-contexts``, the default);
- ``evict_pc_noshare``: the same with ``--no-kv-share-contexts``: the dense document stays in vLLM's prefix
  cache while the pool has room, so a later request prefills only its question (and the observation window
  the policy scores with) from the boundary's block on, then compresses its own copy;
- ``evict_nopc``: the same eviction with ``--no-enable-prefix-caching``: every request prefills the whole
  document.

A configuration may name its own policy, ``evict_pc:kvzip`` (``--policy`` otherwise), so one run compares
policies against the same stock baseline. With ``kvzip`` / ``contour_kvzip`` the first request's TTFT
includes KVzip's reconstruction of the document (hidden requests, ``vllm:contour_reconstruction_tokens``).
``--filler passkey`` builds the document from the passkey benchmark's repeated sentences instead of a play
passage, and phrases each fact as a pass key: a haystack the default model reads, so accuracy can move.

Phase 1 sends the questions one at a time (greedy, ``--answer-tokens`` tokens, streamed): TTFT of each and
its answer, graded by the first four-digit number in it (exact match with the room's code), and the
``cached_tokens`` vLLM reports in its usage (``--enable-prompt-tokens-details``). Phase 2 sends
the same questions all at once with ``--output-len`` tokens each (``ignore_eos``): output tokens/s, peak
running requests (``/metrics`` polled), preemptions, and the plugin's counters. Writes
``shared_doc.json`` (every number, the load average) and prints the table.

    python -m benchmarks.shared_doc [--pool 128] [--output-len 256] [--policy snapkv] [--budget 128]
                                    [--decode-interval T]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks import md_table, stamp
from benchmarks.serving import (SERVED_NAME, MetricsPoller, Server, child_env, http_get, install_cleanup, machine,
                                metric, metric_totals)

REPO = Path(__file__).resolve().parents[1]
ROOMS = ["amber", "birch", "cedar", "delta", "ember", "fern", "garnet", "harbor", "iris", "juniper", "kestrel",
         "linden", "maple", "nickel", "onyx", "pearl", "quartz", "raven", "sable", "topaz"]
CODE = re.compile(r"(?<!\d)(\d{4})(?!\d)")


def build_document(passage_ids: list[int], fact_ids: list[list[int]], seed: int = 0) -> list[int]:
    """The passage's token ids with each fact's ids inserted at evenly spread positions (in order)."""
    n = len(fact_ids)
    step = len(passage_ids) // (n + 1)
    out: list[int] = []
    prev = 0
    for i, fact in enumerate(fact_ids):
        cut = (i + 1) * step
        out += passage_ids[prev:cut] + fact
        prev = cut
    return out + passage_ids[prev:]


def grade(answer: str, code: str) -> bool:
    """Right when the first four-digit number in the answer is the room's code."""
    m = CODE.search(answer)
    return m is not None and m.group(1) == code


def filler_ids(tokenizer, filler: str, n: int, seed: int) -> list[int]:
    """``n`` token ids of filler: a play passage, or the passkey benchmark's sentences repeated."""
    if filler == "passkey":
        from benchmarks.passkey import FILLER

        unit = tokenizer.encode(FILLER, add_special_tokens=False)
        return (unit * (n // len(unit) + 1))[:n]
    from benchmarks.text import token_passages

    return token_passages(tokenizer, 1, n, seed=seed)[0]


def workload(tokenizer, facts: int, doc_tokens: int, seed: int, filler: str = "play"):
    rnd = random.Random(seed)
    rooms = ROOMS[:facts]
    codes = [str(rnd.randrange(1000, 10000)) for _ in rooms]
    if filler == "passkey":
        fact_text = " The pass key of the {r} room is {c}. Remember it. {c} is the pass key of the {r} room. "
        question_text = "\nWhat is the pass key of the {r} room? The pass key of the {r} room is"
    else:
        fact_text = "\nNote: the code of the {r} room is {c}.\n"
        question_text = "\nQuestion: what is the code of the {r} room?\nAnswer: The code of the {r} room is"
    fact_ids = [tokenizer.encode(fact_text.format(r=r, c=c), add_special_tokens=False) for r, c in zip(rooms, codes)]
    passage = filler_ids(tokenizer, filler, doc_tokens - sum(len(f) for f in fact_ids), seed)
    doc = build_document(passage, fact_ids)
    questions = [tokenizer.encode(question_text.format(r=r), add_special_tokens=False) for r in rooms]
    return doc, questions, rooms, codes


def stream_completion(base_url: str, body: dict, timeout: float = 900.0) -> dict:
    """POST a streamed completion; -> {ttft, latency, text, tokens}."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, tokens, cached = None, [], None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            for ch in ev.get("choices") or []:
                if ch.get("text") and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(ch.get("text") or "")
            if ev.get("usage"):
                tokens = ev["usage"].get("completion_tokens")
                cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "text": "".join(text), "tokens": tokens,
            "cached_tokens": cached}


CONFIGS = {
    "stock_pc": dict(evict=False, prefix=True),
    "evict_pc": dict(evict=True, prefix=True),
    "evict_pc_noshare": dict(evict=True, prefix=True, share=False),
    "evict_nopc": dict(evict=True, prefix=False),
}


def config_of(name: str, opts) -> dict:
    """``NAME[:POLICY]`` -> the configuration (``CONFIGS[NAME]``) with its policy (``--policy`` by default)."""
    base, _, policy = name.partition(":")
    if base not in CONFIGS:
        raise SystemExit(f"--configs: unknown configuration {base!r} ({', '.join(CONFIGS)})")
    cfg = dict(CONFIGS[base])
    if cfg["evict"]:
        cfg["policy"] = policy or opts.policy
    return cfg


def server_flags(cfg: dict, opts, max_model_len: int) -> list[str]:
    flags = ["--dtype", "float32", "--enforce-eager", "--block-size", str(opts.block_size),
             "--num-gpu-blocks-override", str(opts.pool), "--max-model-len", str(max_model_len), "--seed", "0",
             "--enable-prefix-caching" if cfg["prefix"] else "--no-enable-prefix-caching",
             "--enable-prompt-tokens-details"]
    if cfg["evict"]:
        flags += ["--kv-eviction-policy", cfg.get("policy", opts.policy), "--kv-budget", str(opts.budget)]
        if getattr(opts, "decode_interval", None) is not None:
            flags += ["--kv-decode-interval", str(opts.decode_interval)]
        if not cfg.get("share", True):
            flags += ["--no-kv-share-contexts"]
    return flags


def run_config(name: str, cfg: dict, opts, doc, questions, codes, out: Path, env) -> dict:
    max_model_len = len(doc) + max(len(q) for q in questions) + opts.output_len + 64
    server = Server(name, opts.model, server_flags(cfg, opts, max_model_len), env, out / "logs" / f"{name}.log")
    server.start()
    try:
        ready = server.wait_ready()
        xargs = {"kv_context_len": len(doc)} if cfg["evict"] else None

        def body(q, max_tokens, ignore_eos=False):
            b = {"model": SERVED_NAME, "prompt": doc + q, "max_tokens": max_tokens, "temperature": 0,
                 "ignore_eos": ignore_eos}
            if xargs:
                b["vllm_xargs"] = xargs
            return b

        start = metric_totals(http_get(server.base_url + "/metrics"))
        seq = []
        for q, code in zip(questions, codes):
            r = stream_completion(server.base_url, body(q, opts.answer_tokens))
            r["right"] = grade(r["text"], code)
            seq.append(r)
        before = metric_totals(http_get(server.base_url + "/metrics"))
        poller = MetricsPoller(server.base_url, interval=0.5)
        poller.start()
        results: list[dict | None] = [None] * len(questions)

        def one(i):
            results[i] = stream_completion(server.base_url, body(questions[i], opts.output_len, True))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        samples = poller.stop()
        after = metric_totals(http_get(server.base_url + "/metrics"))
        server.check_alive()
    finally:
        server.stop()

    def delta(k, since=None):
        a, b = metric(after, k), metric(before if since is None else since, k)
        return None if a is None else a - (b or 0.0)

    out_tokens = sum(r["tokens"] or 0 for r in results)
    ttfts = [r["ttft"] for r in seq]
    return {
        "name": name, **cfg, "ready_s": ready, "flags": server.flags, "sequential": seq,
        "ttft_first_s": ttfts[0], "ttft_rest_mean_s": sum(ttfts[1:]) / max(1, len(ttfts) - 1),
        "ttft_rest_over_first": (sum(ttfts[1:]) / max(1, len(ttfts) - 1)) / ttfts[0],
        "accuracy": sum(r["right"] for r in seq) / len(seq), "right": sum(r["right"] for r in seq),
        "concurrent_wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
        "peak_running": max((s["running"] for s in samples), default=None),
        "mean_running": (sum(s["running"] for s in samples) / len(samples)) if samples else None,
        "preemptions": delta("vllm:num_preemptions"),
        "prefix_hits_tokens": delta("vllm:prefix_cache_hits"), "prefix_queries_tokens": delta("vllm:prefix_cache_queries"),
        "cached_tokens_rest_mean": sum(r["cached_tokens"] or 0 for r in seq[1:]) / max(1, len(seq) - 1),
        "shared_hits": delta("vllm:contour_shared_context_hits"),
        # over the whole run (both phases): KVzip's reconstructions of the document
        "reconstructions": delta("vllm:contour_reconstructions", start),
        "reconstruction_tokens": delta("vllm:contour_reconstruction_tokens", start),
        "freed_blocks": delta("vllm:contour_freed_blocks"), "private_blocks": delta("vllm:contour_private_blocks"),
        "mean_kv_tokens": (delta("vllm:contour_request_mean_kv_tokens_sum") or 0) /
                          max(1.0, delta("vllm:contour_request_mean_kv_tokens_count") or 0)
                          if cfg["evict"] else None,
        "loadavg": [s["load1"] for s in samples[:: max(1, len(samples) // 20)]],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "results" / "shared_doc"))
    p.add_argument("--model", default=None)
    p.add_argument("--pool", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--facts", type=int, default=16)
    p.add_argument("--answer-tokens", type=int, default=12)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--decode-interval", type=int, default=None, help="T of the evicting configs (default: the "
                   "plugin's, 64; 0 = no decode-time rounds, the shared context stays shared to the end)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filler", choices=["play", "passkey"], default="play",
                   help="the document's filler: a play passage, or the passkey benchmark's sentences")
    opts = p.parse_args(argv)
    install_cleanup()
    out = Path(opts.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model_name = opts.model or "smollm2"  # what the record names (the bundled model's cache path stays local)
    if opts.model is None:
        from vllm_contour.models import fetch_model

        opts.model = str(fetch_model("smollm2", quiet=True))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(opts.model)
    doc, questions, rooms, codes = workload(tok, opts.facts, opts.doc_tokens, opts.seed, opts.filler)
    env = child_env(1)
    record = stamp({"args": dict(vars(opts), model=model_name), "doc_tokens": len(doc), "rooms": rooms, "codes": codes,
                    "host": {**machine(), "loadavg_at_start": os.getloadavg()},
                    "dtype": server_flags({"prefix": False, "evict": False}, opts, 0)[1], "runs": []},
                   argv if argv is not None else sys.argv[1:])
    t0 = time.time()
    for name in opts.configs.split(","):
        record["runs"].append(run_config(name, config_of(name, opts), opts, doc, questions, codes, out, env))
        record["wall_seconds"] = time.time() - t0
        (out / "shared_doc.json").write_text(json.dumps(record, indent=1))
    print(table(record))
    return 0


def table(record: dict) -> str:
    """The markdown table of one run: per configuration, TTFT of the first question and the mean of the
    others (and their ratio), answers right, then the concurrent phase against ``stock_pc``."""
    base = next((r for r in record["runs"] if r["name"] == "stock_pc"), None)
    n = len(record["codes"])
    rows = []
    for r in record["runs"]:
        ratio = None if base is None else r["output_tok_s"] / base["output_tok_s"]
        rows.append([r["name"], record["args"]["pool"], r["ttft_first_s"], r["ttft_rest_mean_s"],
                     r["ttft_rest_over_first"], r.get("cached_tokens_rest_mean"), f"{r['right']}/{n}",
                     r["output_tok_s"], ratio,
                     r["peak_running"], r["mean_running"], r["preemptions"], r["mean_kv_tokens"],
                     r.get("reconstructions"), r.get("reconstruction_tokens")])
    return md_table(["config", "pool", "TTFT 1st s", f"TTFT 2-{n} s", "ratio", f"cached 2-{n}", "right",
                     "out tok/s",
                     "x stock_pc", "peak running", "mean running", "preemptions", "mean KV/head",
                     "reconstructions", "reconstructed tokens"], rows)


if __name__ == "__main__":
    sys.exit(main())
