"""Regenerate the README's result tables from the benchmarks' JSON outputs.

The README holds one block per benchmark run set::

    <!-- results:serving results/serving-quick/serving.json results/serving-512/serving.json -->
    ...generated markdown...
    <!-- /results:serving -->

The opening marker names the renderer and the JSON files it reads (paths relative to the repository
root). ``python -m benchmarks.report`` re-renders every block from those files and rewrites only the
text between the markers; prose outside the blocks is left alone. ``--check`` exits 1 when the README
is stale instead of writing it. A missing JSON is an error that names the block and the file.

    python -m benchmarks.report [--readme README.md] [--check] [--plots]

``--plots`` also re-renders the committed figures from their JSON (``docs/results/X.png`` beside a block's
``docs/results/X.json``, for the kinds that have a plotter: serving).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path
from typing import Callable

from benchmarks import fmt_cell as _f, md_table

ROOT = Path(__file__).resolve().parents[1]

BLOCK = re.compile(r"<!-- results:(?P<name>[a-z_]+(?:/[a-z0-9_]+)?)(?P<srcs>(?: [^ >]+)*) -->\n(?P<body>.*?)<!-- /results:(?P=name) -->",
                   re.S)
OPENER = re.compile(r"<!-- results:([A-Za-z0-9][^ >]*)")


def provenance(res: dict, name: str, src: str) -> str:
    """One italic line: the command that produced ``res`` (when recorded), its date and wall time."""
    argv = res.get("argv")
    cmd = f"`python -m benchmarks.{name}{' ' + shlex.join(argv) if argv else ''}`" if argv is not None else None
    bits = [cmd or f"`{src}`", res.get("date")]
    wall = res.get("wall_seconds", res.get("wall_s", res.get("seconds")))
    if isinstance(wall, (int, float)):
        bits.append(f"{wall:.0f} s")
    return "_" + " · ".join(b for b in bits if b) + "_"


# ---------------------------------------------------------------------------------------------------
# Renderers: (list of (source path, parsed JSON)) -> markdown
# ---------------------------------------------------------------------------------------------------

# passkey / RULER mode -> column suffix
MODE_COLS = {"aware": "", "agnostic": " agn", "score_only": " so"}


def render_passkey(runs: list[tuple[str, dict]]) -> str:
    out = []
    for src, res in runs:
        cols: list[str] = []
        rows: dict[str, dict[str, str]] = {}
        for name, r in res["results"].items():
            if r["budget"] is None:
                rows.setdefault("full cache", {})["*"] = r["correct"]
                continue
            col = f"{r['budget']}{MODE_COLS.get(r['mode'], '')}"
            if col not in cols:
                cols.append(col)
            rows.setdefault(r["policy"], {})[col] = r["correct"]
        order = list(MODE_COLS.values())
        cols.sort(key=lambda c: (order.index(c[len(c.split()[0]):]), int(c.split()[0])))
        body = [[p] + [cells.get(c, cells.get("*", "-")) for c in cols] for p, cells in rows.items()]
        out += ([""] if out else []) + [provenance(res, "passkey", src) + f" — {res['prompt_tokens']} prompt tokens, correct out of "
                f"{res['trials']}; columns are tokens per KV head, `agn` = query-agnostic (the context "
                f"compressed before the question is computed), `so` = score_only (the question is only kept out of "
                f"the scoring)" + _passkey_cost(res), "",
                md_table(["policy"] + cols, body)] + _passkey_held(res, cols)
    return "\n".join(out)


def _passkey_held(res: dict, cols: list[str]) -> list[str]:
    """A second table when the run recorded what each configuration held: KV tokens per head (the engine:
    the mean over a request's life read from vLLM's pool; kvpress: kept unmasked / held in its cache after
    compressing the context) and the wall seconds per trial."""
    rows: dict[str, dict[str, str]] = {}
    for r in res["results"].values():
        if r["budget"] is None:
            continue
        col = f"{r['budget']}{MODE_COLS.get(r['mode'], '')}"
        per = f" · {r['seconds'] / r['trials']:.1f} s" if r.get("seconds") else ""
        if r.get("kept_kv_tokens") is not None:
            rows.setdefault(r["policy"], {})[col] = f"{r['kept_kv_tokens']:.0f} of {r['held_kv_tokens']:.0f}{per}"
        elif r.get("mean_kv_tokens") is not None:
            rows.setdefault(r["policy"], {})[col] = f"{r['mean_kv_tokens']:.0f}{per}"
    if not rows:
        return []
    return ["", "KV tokens per head held (vLLM's pool: mean over a request's life, prefill included; kvpress: "
            "kept unmasked of held in its cache after compressing the context) · wall seconds per trial:", "",
            md_table(["policy"] + cols, [[p] + [cells.get(c, "-") for c in cols] for p, cells in rows.items()])]


def _passkey_cost(res: dict) -> str:
    """The wall time of computing the question over the compressed cache (agnostic) relative to computing it
    densely (score_only), same prompts, same (policy, budget), same run: median and range of the ratios."""
    by = {(r["policy"], r["budget"], r["mode"]): r.get("seconds") for r in res["results"].values()}
    ratios = sorted(by[(p, b, "agnostic")] / s for (p, b, m), s in by.items()
                    if m == "score_only" and s and by.get((p, b, "agnostic")))
    if not ratios:
        return ""
    return (f"; wall time of a configuration, agn / so: median {statistics.median(ratios):.2f}× "
            f"({ratios[0]:.2f}–{ratios[-1]:.2f}) over "
            f"{len(ratios)} (policy, budget) pairs")


def _span(vals: list[float], nd: int) -> str:
    """'a–b' over the values, or one value when they agree at ``nd`` decimals."""
    lo, hi = f"{min(vals):.{nd}f}", f"{max(vals):.{nd}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def machine_of(res: dict) -> str:
    """The machine a run recorded (``serving.machine()``): lscpu's model name and the flags it has of those
    that pick vLLM's CPU kernels and the dtype, with the dtype; or that the JSON does not record it."""
    host = res.get("host") or {}
    dtype = res.get("dtype") or (res.get("args") or {}).get("dtype")
    if not host.get("cpu_model") and not host.get("flags"):
        return "CPU not recorded in the JSON" + (f"; {dtype}" if dtype else "")
    flags = [f for f, on in (host.get("flags") or {}).items() if on]
    return (f"{host.get('cpu_model') or 'CPU model not recorded'}, {host.get('cpus', '?')} CPUs, "
            f"{', '.join(flags) or 'none of avx2 / avx512f / avx512_bf16 / amx_bf16 / amx_tile'}"
            + (f"; {dtype}" if dtype else ""))


def render_serving(runs: list[tuple[str, dict]]) -> str:
    ratio_rows, over_rows, off_rows = [], [], []
    cmds = []
    for src, res in runs:
        cmds.append(provenance(res, "serving", src) + f" (host load "
                    f"{_f(res.get('host', {}).get('loadavg_at_start', [None])[0], 1)}–"
                    f"{_f(res.get('host', {}).get('loadavg_at_end', [None])[0], 1)}; {machine_of(res)})")
        by = {(r["config"], r["pool"], r["output_len"], r.get("request_rate")): r for r in res["runs"]}
        for q in res["ratios"]:
            stock = by.get(("stock", q["pool"], q["output_len"], q.get("request_rate")), {})
            ev = by.get((q["config"], q["pool"], q["output_len"], q.get("request_rate")), {})
            rate = q.get("request_rate")
            closed = rate is None or str(rate) in ("inf", "Infinity")
            ratio_rows.append([q["config"], q["pool"], q["output_len"], "closed" if closed else rate,
                               stock.get("output_throughput"), ev.get("output_throughput"), q["output_throughput"],
                               f"{_f(stock.get('peak_running'), 0)} / {_f(ev.get('peak_running'), 0)}",
                               f"{_f(stock.get('mean_running'), 1)} / {_f(ev.get('mean_running'), 1)}",
                               f"{_f(stock.get('preemptions'), 0)} / {_f(ev.get('preemptions'), 0)}",
                               q["tpot_p50_ms"], q["ttft_p50_ms"]])
        for o in res.get("overhead") or []:
            over_rows.append(o)
        off = {r["config"]: r for r in res.get("offline") or []}
        for q in res.get("offline_ratios") or []:
            s, e = off.get("stock", {}), off.get(q["config"], {})
            off_rows.append([q["config"], q["pool"], e.get("num_prompts"), e.get("output_len"),
                             s.get("output_tok_per_s"), e.get("output_tok_per_s"), q["output_tok_per_s"],
                             f"{_f(s.get('peak_running'), 0)} / {_f(e.get('peak_running'), 0)}"])
    out = cmds + [""]
    if ratio_rows:
        out += [md_table(["policy", "pool", "L", "arrivals/s", "stock out tok/s", "evict out tok/s", "out tok/s x",
                          "peak running stock / evict", "mean running stock / evict", "preemptions stock / evict",
                          "TPOT p50 x", "TTFT p50 x"],
                         ratio_rows), ""]
    wall = [o for o in over_rows if o.get("overhead_pct_of_wall") is not None]
    if wall:
        pct = [o["overhead_pct_of_wall"] for o in wall]
        ms = [o["ms_per_round"] for o in wall if o.get("ms_per_round") is not None]
        rpr = [o["rounds_per_request"] for o in wall if o.get("rounds_per_request") is not None]
        kv = [o["mean_kv_tokens"] for o in wall if o.get("mean_kv_tokens") is not None]
        held = (f" A request held {_span(kv, 0)} KV tokens per head on average over its life (vLLM's pool)."
                if kv else "")
        later = [o for o in wall if o.get("later_round_pct_of_wall") is not None and o.get("later_rounds")]
        later_s = (f" Of them, the rounds of requests already compacted (decode-time, after each request's first): "
                   f"{_span([o['later_round_ms'] for o in later], 0)} ms each, "
                   f"{_span([o['later_round_pct_of_wall'] for o in later], 1)} % of the wall." if later else "")
        out += [f"Eviction rounds: {_span(rpr, 1)} per request, {_span(ms, 0)} ms each, {_span(pct, 1)} % of the "
                f"run's wall time (from the plugin's own counters).{later_s}{held}", ""]
    elif over_rows:
        pct = [o["overhead_pct_of_prefill"] for o in over_rows if o.get("overhead_pct_of_prefill") is not None]
        pol = [o["policy_ms_per_request"] for o in over_rows if o.get("policy_ms_per_request") is not None]
        cmp_ = [o["compact_ms_per_request"] for o in over_rows if o.get("compact_ms_per_request") is not None]
        if pct:
            out += [f"Eviction overhead: {min(pct):.1f}–{max(pct):.1f} % of prefill time (scoring "
                    f"{min(pol):.0f}–{max(pol):.0f} ms + compaction {min(cmp_):.0f}–{max(cmp_):.0f} ms per "
                    f"request, from the plugin's own counters).", ""]
    if off_rows:
        out += [md_table(["offline policy", "pool", "prompts", "L", "stock out tok/s", "evict out tok/s",
                          "out tok/s x", "peak running stock / evict"], off_rows), ""]
    return "\n".join(out).rstrip("\n")


def render_audit(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.audit import PAIRS

    out = []
    for src, res in runs:
        if not any(r["system"] == "kvpress" for r in res["table"]):  # --skip-kvpress: this project's rows
            bb = res["engine"]["block_bytes"]
            rows = [[r["method"] if r["method"] != "none" else "full cache", r["budget"],
                     _f(r["held_mib"] * 2 ** 20 / bb, 1), r["held_mib"], r["accuracy"]] for r in res["table"]]
            ctx = sorted({s["context_len"] for s in res.get("samples", [])})
            out += ([""] if out else []) + [
                provenance(res, "audit", src) + f" — {len(res.get('samples', []))} sample(s) of "
                f"{', '.join(sorted({s['task'] for s in res.get('samples', [])}))} at "
                f"{', '.join(str(x) for x in sorted({s['length'] for s in res.get('samples', [])}))} tokens "
                f"(context {', '.join(str(c) for c in ctx)} tokens, compressed before the question), block "
                f"{res['engine']['block_size']}; {machine_of(res)}; kvpress {res.get('kvpress')}", "",
                md_table(["policy", "budget", "blocks held after the prompt", "MiB held", "RULER score"], rows, nd=2)]
            continue
        t = {(r["system"], r["method"], str(r["budget"])): r for r in res["table"]}
        keys = []
        for r in res["table"]:
            k = (r["method"], str(r["budget"]))
            if k not in keys and r["system"] == "kvpress":
                keys.append(k)
        rows = []
        for press, budget in keys:
            kv = t.get(("kvpress", press, budget), {})
            ours = t.get(("vllm-contour", PAIRS.get(press, press), budget), {})
            held = _f(kv.get("held_mib"))
            if kv.get("unmasked_mib") is not None and abs(kv["unmasked_mib"] - kv["held_mib"]) > 0.01:
                held = f"**{held}** ({_f(kv['unmasked_mib'])} unmasked)"
            rows.append([press if press != "none" else "full cache", budget, held, kv.get("accuracy"),
                         ours.get("held_mib"), ours.get("accuracy")])
        n = len(res.get("samples", []))
        out += ([""] if out else []) + [provenance(res, "audit", src) + f" — {n} samples, kvpress {res.get('kvpress')}", "",
                md_table(["kvpress press", "budget", "kvpress MiB held", "kvpress accuracy",
                          "vllm-contour MiB held", "vllm-contour accuracy"], rows, nd=2)]
    return "\n".join(out)


def render_ruler(runs: list[tuple[str, dict]]) -> str:
    out = []
    for src, res in runs:
        lengths = sorted({int(L) for c in res["summary"].values() for L in c["by_length"]})
        a = res.get("args", {})
        rows = []
        if len(lengths) == 1:  # one length: a column per task
            first = next(iter(next(iter(res["summary"].values()))["by_length"].values()))
            tasks = [t for t in first if t != "mean"]
            head = ["config"] + tasks
            for name, c in res["summary"].items():
                d = next(iter(c["by_length"].values()))
                rows.append([name] + [d.get(t) for t in tasks] + [c["mean"], c["mean_held_bytes"] / 2 ** 20])
            what = f"{lengths[0]}-token prompts"
        else:
            head = ["config"] + [f"{L} tok" for L in lengths]
            for name, c in res["summary"].items():
                bl = {int(k): v for k, v in c["by_length"].items()}
                rows.append([name] + [bl.get(L, {}).get("mean") for L in lengths] + [c["mean"],
                                                                                  c["mean_held_bytes"] / 2 ** 20])
            what = f"tasks {a.get('tasks')}"
        out += ([""] if out else []) + [provenance(res, "ruler", src) + f" — {what}, {a.get('samples')} sample(s) per task and length; "
                f"RULER score ×100", "", md_table(head + ["mean", "MiB held"], rows, nd=1)]
    return "\n".join(out)


def render_seed_claims(runs: list[tuple[str, dict]]) -> str:
    out = []
    for src, res in runs:
        rows = []
        for s, c in res["ceiling"].items():
            rows.append(["(i) median fraction of the top-mass gap the best subset closes", s,
                         f"{c['median_fraction_closed']:.3f}", "0.02–0.05"])
        for s, a in res["auc"].items():
            rows.append(["(ii) ROC AUC, dropped mass → top-quartile error rows", s, f"{a['pooled']:.3f}",
                         "0.76–0.89"])
        paper_pi = {"4": "1.07", "32": "1.79"}
        for s, p in res["pi"].items():
            rows.append(["(iii) π(s) = forced / refit error", s, f"{p['median_pi_best']:.3f}",
                         paper_pi.get(str(s), "")])
        for m in res["moment"]:
            rows.append(["(iv) moment-corrected / renormalised error; median cos(kept, evicted)",
                         f"{m['policy']}@{m['budget']}",
                         f"{m['mean_err_ratio_moment_over_renorm']:.3f}; {m['median_cos_kept_evicted']:.3f}",
                         "< 1; ≈ 0"])
        agree = ", ".join(f"{k} {'yes' if v.get('agrees', v.get('agrees_pooled')) else 'no'}"
                          for k, v in res.get("agreement", {}).items())
        out += ([""] if out else []) + [provenance(res, "seed_claims", src) + f" — {res['passages']} passages × {res['tokens']} tokens",
                "", md_table(["claim", "s", "ours", "paper"], rows), "", f"Agreement (criteria in the JSON): {agree}."]
    return "\n".join(out)


def render_perplexity(runs: list[tuple[str, dict]]) -> str:
    out = []
    for src, res in runs:
        from benchmarks.perplexity import result_grid

        budgets, names, by, pols = result_grid(res)
        rows = [[p] + [by[(p, b)]["ppl_ratio"] if (p, b) in by else None for b in budgets] for p in pols]
        out += ([""] if out else []) + [provenance(res, "perplexity", src) + f" — full-cache perplexity {res['ppl_full']:.2f} over "
                f"{res['passages']} × {res['scored_tokens_per_passage']} tokens after a {res['context_tokens']}-token "
                f"context; perplexity ratio to full cache", "",
                md_table(["policy"] + names, rows, nd=2)]
    return "\n".join(out)


def render_ops(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.ops import compaction_impls

    out = []
    for src, res in runs:
        comp = res["compaction"]
        impls = compaction_impls(comp[0])
        frac = ", ".join(f"{i} {min(r['fraction_of_memcpy'][i] for r in comp):.2f}–"
                         f"{max(r['fraction_of_memcpy'][i] for r in comp):.2f}" for i in impls)
        rows = []
        for r in res["decode"]:
            t = r["times"]
            nat = t.get("vllm_native", {}).get("cpu_ms")
            rows.append([r["tokens"]] + [t[i]["cpu_ms"] / nat if nat else None for i in t if i != "vllm_native"])
        dec_impls = [i for i in res["decode"][0]["times"] if i != "vllm_native"]
        cfg = res["config"]
        machine = ""
        if cfg.get("vllm_isa"):
            ours = cfg.get("cpp_decode_path")
            if "cpp_decode_layout" not in cfg:  # older records: the path of the AMX packing only
                ours = ours if str(cfg.get("key_layout", "")).startswith("vLLM amx") else "generic"
            machine = (f"; CPU flags {', '.join(cfg.get('cpu_flags') or []) or 'not recorded'}; vLLM's kernel "
                       f"`{cfg['vllm_isa']}`, the C++ decode's path `{ours or 'not recorded'}`")
        out += ([""] if out else []) + [provenance(res, "ops", src) + f" — {cfg['dtype']}, {cfg['threads']} thread(s)"
                                        + machine,
                "", f"Compaction throughput as a fraction of a plain memcpy of the kept bytes: {frac}.", ""]
        if "read_bytes" in comp[0]:  # per point, also against a memcpy of the cache lines the moves read
            crow = [[r["tokens"], r["keep"], r["kept_bytes"] / 1e6, r["read_bytes"] / 1e6] +
                    [r[f][i] for i in impls for f in ("fraction_of_memcpy", "fraction_of_read_memcpy")] for r in comp]
            out += [md_table(["tokens", "keep", "MB kept", "MB of lines read"] +
                             [f"{i} / memcpy of {w}" for i in impls for w in ("kept", "lines read")], crow), ""]
        out += [md_table(["decode tokens"] + [f"{i} / vLLM native" for i in dec_impls], rows)]
        cvf = res.get("compacted_vs_full") or []
        if cvf:
            keys = [k for k in cvf[0]["ratio_to_uncompacted"]]
            rows = [[r["context"], f"{r['blocks_held']['compacted']} / {r['blocks_held']['uncompacted']}"] +
                    [r["ratio_to_uncompacted"][k] for k in keys] for r in cvf]
            out += ["", md_table(["context", "blocks held compacted / full"] +
                                 [f"{k} time / uncompacted" for k in keys], rows, nd=3)]
    return "\n".join(out)


def render_decode_rounds(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.decode_rounds import table

    out = []
    for src, res in runs:
        a = res["args"]
        out += [provenance(res, "decode_rounds", src) + f" — {a['requests']} requests × {a['prompt_len']} prompt + "
                f"{a['gen_len']} generated tokens, {a['policy']} at {a['budget']} tokens per head, pool with room "
                "for all (no preemption)", "", table(res["summary"]), ""]
    return "\n".join(out).rstrip("\n")


def render_perplexity_long(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.perplexity import long_rows

    out = []
    for src, res in runs:
        lg = res["long"]
        body = [[r["policy"] or "-", r["budget"] or "-", r["method"], "-" if r["interval"] is None else r["interval"],
                 r["ppl_ratio"], r["kl_mean"], round(r["mean_held"]), r["peak_held"]] for r in long_rows(lg)]
        out += [provenance(lg, "perplexity", src) + f" — {lg['passages']} passage(s) × {lg['context_tokens']} context + "
                f"{lg['continuation_tokens']} continuation tokens, teacher-forced, full-cache perplexity "
                f"{lg['ppl_full']:.2f}; held = KV tokens per head in whole blocks (mean / peak over the continuation)",
                "", md_table(["policy", "budget", "method", "T", "ppl ratio", "KL", "mean held", "peak held"], body,
                             nd=3), ""]
    return "\n".join(out).rstrip("\n")


def render_soak(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.soak import summary_markdown

    return "\n\n".join(provenance(res, "soak", src) + "\n\n" + summary_markdown(res) for src, res in runs)


def render_protocol(runs: list[tuple[str, dict]]) -> str:
    """The matched-mean-cache protocol (``benchmarks.protocol``): dev grid, knobs chosen on dev, holdout at
    the matched budgets, confirmation with Bonferroni-corrected cluster-bootstrap intervals."""
    from benchmarks.protocol import summary_markdown

    out = []
    for src, res in runs:
        out += ([""] if out else []) + [provenance(res, "protocol", src) + f" — {res['model']}, "
                f"{res.get('dtype', 'float32')}, baseline {res.get('baseline', '?')}", "", summary_markdown(res)]
    return "\n".join(out)


def render_reasoning(runs: list[tuple[str, dict]]) -> str:
    """The full-cache calibration of reasoning tasks (``benchmarks.reasoning``)."""
    from benchmarks.reasoning import summary_markdown

    out = []
    for src, res in runs:
        out += ([""] if out else []) + [provenance(res, "reasoning", src) + f" — {res['model']}, {res['n']} problems "
                f"a task, greedy, up to {res['max_tokens']} tokens; qualifies = >= 30 % right and >= half the "
                f"generations >= 300 tokens", "", summary_markdown(res)]
    return "\n".join(out)


def render_shared_doc(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.shared_doc import table

    out = []
    for src, res in runs:
        a = res["args"]
        load = [x for r in res["runs"] for x in r.get("loadavg", [])]
        out += [provenance(res, "shared_doc", src) + f" — a {res['doc_tokens']}-token document, {len(res['codes'])} "
                f"questions; concurrent phase: all at once, {a['output_len']} tokens each; "
                f"{', '.join(dict.fromkeys(r.get('policy', a['policy']) for r in res['runs'] if r.get('evict', r['name'] != 'stock_pc')))} at "
                f"{a['budget']} tokens per head, T {64 if a.get('decode_interval') is None else a['decode_interval']}"
                + (f" (host load {min(load):.1f}–{max(load):.1f})" if load else ""), "", table(res), ""]
    return "\n".join(out).rstrip("\n")


def render_gpu_kernels(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.gpu_kernels import table

    return "\n\n".join(f"{provenance(res, 'gpu_kernels', src)}\n\n{table(res)}" for src, res in runs)


def render_builder(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.builder import table

    return "\n\n".join(f"{provenance(res, 'builder', src)}\n\n{table(res)}" for src, res in runs)


def render_rounds(runs: list[tuple[str, dict]]) -> str:
    from benchmarks.rounds import table

    return "\n\n".join(f"{provenance(res, 'rounds', src)}\n\n{table(res)}" for src, res in runs)


RENDERERS: dict[str, Callable[[list[tuple[str, dict]]], str]] = {
    "gpu_kernels": render_gpu_kernels, "builder": render_builder, "rounds": render_rounds,
    "passkey": render_passkey, "serving": render_serving, "audit": render_audit, "ruler": render_ruler,
    "seed_claims": render_seed_claims, "perplexity": render_perplexity, "ops": render_ops,
    "decode_rounds": render_decode_rounds, "perplexity_long": render_perplexity_long, "soak": render_soak,
    "shared_doc": render_shared_doc, "protocol": render_protocol,
    "reasoning": render_reasoning,
}


def render_block(name: str, srcs: list[str], root: Path) -> str:
    """``name`` is a renderer, optionally with a ``/tag`` (two blocks of one kind, e.g. ``serving/decode``)."""
    kind = name.split("/")[0]
    if kind not in RENDERERS:
        raise ValueError(f"README block 'results:{name}': unknown renderer (known: {', '.join(RENDERERS)})")
    if not srcs:
        raise ValueError(f"README block 'results:{name}' names no JSON file")
    runs = []
    for s in srcs:
        p = root / s
        if not p.is_file():
            raise FileNotFoundError(f"README block 'results:{name}': {s} not found (run its benchmark first)")
        runs.append((s, json.loads(p.read_text())))
    return RENDERERS[kind](runs)


def regenerate(text: str, root: Path, only: set[str] | None = None) -> tuple[str, list[str]]:
    """Return (new text, names of the blocks rendered); with ``only``, the other blocks stay as they are."""
    names: list[str] = []

    def sub(m: re.Match) -> str:
        if only is not None and m.group("name") not in only and m.group("name").split("/")[0] not in only:
            return m.group(0)
        srcs = m.group("srcs").split()
        body = render_block(m.group("name"), srcs, root)
        names.append(m.group("name"))
        head = f"<!-- results:{m.group('name')}{m.group('srcs')} -->"
        return f"{head}\n{body}\n<!-- /results:{m.group('name')} -->"

    blocks = {m.group("name") for m in BLOCK.finditer(text)}
    for m in OPENER.finditer(text):  # a marker that is not a block would otherwise be skipped in silence
        if m.group(1) not in blocks:
            raise ValueError(f"README marker 'results:{m.group(1)}' is not a block: a name is [a-z_]+ with an "
                             f"optional /[a-z0-9_]+ tag, closed by <!-- /results:{m.group(1)} -->")
    return BLOCK.sub(sub, text), names


def _plotter(kind: str) -> Callable[[dict, Path], object] | None:
    """The function that draws a block kind's figure from its JSON, where the kind has one."""
    if kind == "serving":
        from benchmarks.serving import plot_record

        return plot_record
    return None


def replot(text: str, root: Path) -> list[str]:
    """Re-render, from its JSON, every committed figure a block's JSON has beside it (``docs/results/X.png``
    for ``docs/results/X.json``) where the block's kind has a plotter (``serving``: ``plot_record``);
    -> the figures written."""
    done = []
    for m in BLOCK.finditer(text):
        plot = _plotter(m.group("name").split("/")[0])
        if plot is None:
            continue
        for src in m.group("srcs").split():
            png = (root / src).with_suffix(".png")
            if png.is_file():
                plot(json.loads((root / src).read_text()), png)
                done.append(str(png.relative_to(root)))
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--root", default=str(ROOT), help="paths in the markers are relative to this")
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is not up to date")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="render only these blocks (e.g. when the other "
                                                             "blocks' JSON files are not on this machine); "
                                                             "a kind (serving) or one tagged block (serving/decode)")
    ap.add_argument("--plots", action="store_true", help="also re-render the committed figures beside the blocks' "
                                                           "JSON (docs/results/X.png for X.json) from that JSON")
    args = ap.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text()
    if args.plots and not args.check:
        for png in replot(text, Path(args.root)):
            print(f"re-rendered {png}")
    new, names = regenerate(text, Path(args.root), set(args.only) if args.only else None)
    if not names:
        print(f"{path}: no <!-- results:NAME FILE... --> blocks", file=sys.stderr)
        return 1
    if args.check:
        stale = new != text
        print(f"{path}: {len(names)} blocks, {'stale' if stale else 'up to date'}")
        return 1 if stale else 0
    path.write_text(new)
    print(f"{path}: regenerated {len(names)} blocks ({', '.join(names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
