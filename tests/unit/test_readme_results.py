"""README's "## Results" table, figure by figure, against the committed JSON each row cites.

Every row's "where" cell links the JSON its figures come from (``docs/results/<name>.json``). The files' names
pick a checker (serving, audit, gpu_kernels, builder, perplexity_long, passkey, protocol): a list of labelled
patterns (``peak A vs B``, ``TPOT p50 X×``, ``X blocks (Y MiB)``, ...) read from the row's cells, each of whose
figures is computed again from the JSON at the precision the README prints (a range ``a–b`` is the lowest and
highest over the cited runs) and compared as text. Every figure in the row's "what" and "figure" cells must
be read by some pattern: a number that no pattern reads fails as unchecked. The machine a row names is checked
against what the JSON records, or, where it records none, against docs/results.md's list of the commits that
name it.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

NUM = r"[+\-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?K?"
# a figure: not part of a word (fp32, p50, H200, T0, AVX-512), a range a–b or a fraction a/b as one figure
FIGURE = re.compile(rf"(?<![\w.])(?<!\w-){NUM}(?:[–/]{NUM})?(?!\w)")
N = r"(?:\d{1,3}(?:,\d{3})+|\d+)"  # an integer as printed
P = rf"[+\-−]?{N}(?:\.\d+)?"  # a figure as printed
X = rf"{P}(?:–{P})?"  # a figure or a range of figures
MACHINES = ("AMX Xeon", "AVX-512 Xeon", "EPYC", "H200")
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    what: str
    figure: str
    where: str
    line: int

    @property
    def files(self) -> list[str]:
        return re.findall(r"\((docs/results/[\w.\-/]+\.json)\)", self.where)  # a run's folder may hold it

    @property
    def label(self) -> str:
        return f"README line {self.line}: {self.what[:70]}"


def results_rows(text: str | None = None) -> list[Row]:
    text = (ROOT / "README.md").read_text() if text is None else text
    lines = text.splitlines()
    start = lines.index("## Results")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    rows = []
    for i in range(start, end):
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")] if lines[i].startswith("|") else []
        if len(cells) == 3 and cells[0] != "what" and not set(cells[0]) <= set("-"):
            rows.append(Row(cells[0], cells[1], cells[2], i + 1))
    return rows


def figures(s: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), m.group()) for m in FIGURE.finditer(s)]


def _num(s: str) -> float:
    return float(s.replace(",", "").replace("−", "-").rstrip("K"))


def as_printed(values, like: str) -> str:
    """``values`` (one or several: a range over runs) printed as ``like`` is: its decimals, thousands commas
    and sign; one value where lowest and highest print the same."""
    values = [values] if isinstance(values, (int, float)) else list(values)
    first = like.replace("−", "-").split("–")[0]
    d = len(first.split(".")[1]) if "." in first else 0
    spec = ("+" if first.startswith("+") else "") + ("," if "," in like else "") + f".{d}f"
    lo, hi = format(min(values), spec), format(max(values), spec)
    return lo if lo == hi else f"{lo}–{hi}"


# ---------------------------------------------------------------------------------------------------
# One row's check: patterns read, figures compared, the rest of the row's figures unchecked
# ---------------------------------------------------------------------------------------------------


@dataclass
class Check:
    row: Row
    jsons: list[dict]
    errors: list[str] = field(default_factory=list)
    read: dict = field(default_factory=lambda: {"what": [], "figure": []})

    def find(self, cell: str, pattern: str, required: bool = True) -> list[re.Match]:
        ms = list(re.finditer(pattern, getattr(self.row, cell)))
        if not ms and required:
            self.errors.append(f"{cell} quotes nothing like /{pattern}/")
        for m in ms:
            self.read[cell] += [m.span(g) for g in range(1, (m.lastindex or 0) + 1) if m.group(g) is not None]
        return ms

    def same(self, what: str, printed: str, values) -> None:
        """The README's ``printed`` against ``values`` from the JSON (a number, a list: a range, or a str)."""
        printed = printed.replace("−", "-")
        want = values if isinstance(values, str) else as_printed(values, printed)
        if printed != want:
            self.errors.append(f"{what}: README {printed}, JSON {want}")

    def unchecked(self) -> None:
        for cell in ("what", "figure"):
            for a, b, s in figures(getattr(self.row, cell)):
                if not any(lo <= a and b <= hi for lo, hi in self.read[cell]):
                    self.errors.append(f"{cell}: the figure {s!r} is read from no JSON (at ...{getattr(self.row, cell)[max(0, a - 30):b + 10]}...)")


def _dtype_word(c: Check, dtypes: set[str]) -> None:
    words = {DTYPES[d] for d in dtypes}
    for w in words:
        if w not in c.row.what and w not in c.row.figure:
            c.errors.append(f"the JSON's dtype is {w}; the row does not say so")
    for w in set(DTYPES.values()) - words:
        if re.search(rf"\b{w}\b", c.row.what):
            c.errors.append(f"the row says {w}; the JSON ran {', '.join(sorted(words))}")


def recorded_machine(res: dict) -> str | None:
    """What a JSON says of its machine (lowercase text), or None where it says nothing that names one."""
    host = res.get("host") or {}
    if host.get("cpu_model"):
        return " ".join([host["cpu_model"]] + [f for f, on in (host.get("flags") or {}).items() if on]).lower()
    for m in (res.get("machine"), (res.get("long") or {}).get("machine")):
        if isinstance(m, str) and m not in ("vm", ""):
            return m.lower()
    if (res.get("env") or {}).get("name"):
        return str(res["env"]["name"]).lower()
    return None


def machine_list() -> dict[str, tuple[str, str]]:
    """docs/results.md's list: {json file name: (commit, machine as the commit names it)}."""
    text = (ROOT / "docs" / "results.md").read_text()
    sec = text.split("### Where the JSON does not record the machine", 1)[1].split("\n#", 1)[0]
    out = {}
    for line in sec.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] != "JSON":
            for name in cells[0].split(","):
                out[name.strip()] = (cells[1], cells[2])
    return out


def check_machine(c: Check) -> None:
    named = [m for m in MACHINES if m in c.row.what or m in c.row.figure]
    if len(named) != 1:
        c.errors.append(f"the row names {len(named)} machines of {MACHINES}: {named}")
        return
    phrase = named[0]
    listed = machine_list()
    for f, res in zip(c.row.files, c.jsons):
        rec = recorded_machine(res)
        if rec is None:
            name = Path(f).name
            if name not in listed:
                c.errors.append(f"{name} records no machine and docs/results.md does not list it")
            elif not re.fullmatch(r"[0-9a-f]{7,40}", listed[name][0]) or not listed[name][1].startswith(phrase):
                c.errors.append(f"{name}: docs/results.md lists {listed[name]}, the row says {phrase}")
            continue
        ok = {"AMX Xeon": "xeon" in rec and "amx" in rec,
              "AVX-512 Xeon": "xeon" in rec and "avx512" in rec and "amx" not in rec,
              "EPYC": "epyc" in rec, "H200": "h200" in rec}[phrase]
        if not ok:
            c.errors.append(f"{Path(f).name} records {rec!r}, the row says {phrase}")


# ---------------------------------------------------------------------------------------------------
# Checkers, by the kind of JSON a row cites
# ---------------------------------------------------------------------------------------------------


def check_serving(c: Check) -> None:
    runs = []
    for f, res in zip(c.row.files, c.jsons):
        assert len(res["ratios"]) == 1, f"{f}: one point a run is what a row can quote"
        q = res["ratios"][0]
        stock = next(r for r in res["runs"] if r["config"] == "stock")
        ev = next(r for r in res["runs"] if r["config"] == q["config"])
        over = next((o for o in res.get("overhead") or [] if o["config"] == q["config"]), {})
        runs.append({"q": q, "stock": stock, "ev": ev, "over": over, "args": res["args"]})
    # what
    for m in c.find("what", rf"({N}) × ({N}) in / ({N}(?:–{N})?) out"):
        c.same("prompts", m.group(1), [r["args"]["num_prompts"] for r in runs])
        c.same("input tokens", m.group(2), [r["args"]["input_len"] for r in runs])
        outs = set()
        for r in runs:
            (L,), rr = r["args"]["output_lens"], r["args"].get("range_ratio") or 0.0
            lo, hi = max(1, math.floor(L * (1 - rr))), math.ceil(L * (1 + rr))  # vLLM bench's random dataset
            outs.add(f"{L:,}" if rr == 0 else f"{lo:,}–{hi:,}")
        c.same("output tokens", m.group(3), " or ".join(sorted(outs)))
    for m in c.find("what", rf"({N})-block pool"):
        c.same("pool", m.group(1), [p for r in runs for p in r["args"]["pools"]])
    n_runs = c.find("what", rf"\b({N}) runs\b", required=False)
    for m in n_runs:
        c.same("runs", m.group(1), len(runs))
    if not n_runs and len(runs) != 1:
        c.errors.append(f"{len(runs)} runs cited; the row does not say how many")
    _dtype_word(c, {r["args"]["dtype"] for r in runs})
    # figure
    for m in c.find("figure", rf"({X})× stock's output tok/s"):
        c.same("output tok/s ratio", m.group(1), [r["q"]["output_throughput"] for r in runs])
    running = [c.find("figure", rf"{k} ({X}) vs ({X})", required=False) for k in ("peak", "mean")]
    for kind, ms in zip(("peak", "mean"), running):
        for m in ms:
            c.same(f"{kind} running, eviction", m.group(1), [r["ev"][f"{kind}_running"] for r in runs])
            c.same(f"{kind} running, stock", m.group(2), [r["stock"][f"{kind}_running"] for r in runs])
    if "running" in c.row.figure and not any(running):
        c.errors.append("the row quotes running requests without saying peak or mean")
    for m in c.find("figure", rf"stock preempted ({X}) times", required=False):
        c.same("stock preemptions", m.group(1), [r["stock"]["preemptions"] for r in runs])
    if "eviction never" in c.row.figure and any(r["ev"]["preemptions"] for r in runs):
        c.errors.append(f"eviction preempted: {[r['ev']['preemptions'] for r in runs]}")
    for m in c.find("figure", rf"TPOT p50 ({X})×", required=False):
        c.same("TPOT p50 ratio", m.group(1), [r["q"]["tpot_p50_ms"] for r in runs])
    for m in c.find("figure", rf"TTFT p50 ({X})×(?: \(≤ ({X})× in ({N}) of ({N})\))?", required=False):
        ttft = [r["q"]["ttft_p50_ms"] for r in runs]
        c.same("TTFT p50 ratio", m.group(1), ttft)
        if m.group(2):
            at_most = _num(m.group(2))
            c.same(f"runs with TTFT p50 <= {m.group(2)}x", m.group(3), sum(t <= at_most for t in ttft))
            c.same("runs", m.group(4), len(runs))
    for m in c.find("figure", rf"decode-time rounds ({X}) % of the wall", required=False):
        c.same("decode-time rounds, % of the wall", m.group(1), [r["over"]["later_round_pct_of_wall"] for r in runs])


def check_audit(c: Check) -> None:
    (res,) = c.jsons
    bb = res["engine"]["block_bytes"]
    table = {(r["method"], str(r["budget"])): r for r in res["table"]}
    for m in c.find("what", rf"at ({N}) tokens \(a ({N})-token context"):
        c.same("RULER length", m.group(1), [s["length"] for s in res["samples"]])
        c.same("context tokens", m.group(2), [s["context_len"] for s in res["samples"]])
    (pm,) = c.find("what", rf"`(\w+)` at ({N}) tokens per head") or [None]
    for m in c.find("what", rf"block ({N})"):
        c.same("block size", m.group(1), res["engine"]["block_size"])
    _dtype_word(c, {res["dtype"]})
    if pm is None:
        return
    ours = table.get((pm.group(1), pm.group(2).replace(",", "")))
    if ours is None:
        c.errors.append(f"no {pm.group(1)} at {pm.group(2)} in the JSON")
        return
    full = table[("none", "full")]
    for m in c.find("figure", rf"({N}) blocks \(({X}) MiB\) instead of ({N}) \(({X}) MiB\)"):
        for g, r, what in ((1, ours, pm.group(1)), (3, full, "full cache")):
            c.same(f"{what}: blocks held", m.group(g), r["held_mib"] * 2 ** 20 / bb)
            c.same(f"{what}: MiB held", m.group(g + 1), r["held_mib"])


def timed_kernels() -> set[str]:
    """The triton_ops kernels that benchmarks.gpu_kernels.decode times (read from its source, not imported)."""
    tree = ast.parse((ROOT / "benchmarks" / "gpu_kernels.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "decode")
    return {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "triton_ops" and n.attr.endswith("attention")}


def check_gpu_kernels(c: Check) -> None:
    (res,) = c.jsons
    rows = res["decode"]["rows"]
    same_ms = c.find("figure", rf"({X})× vLLM's own kernel over the same tokens", required=False)
    for m in same_ms:
        c.same("ours / vLLM same tokens", m.group(1), [r["ours_over_vllm_same"] for r in rows])
    for m in c.find("figure", rf"({X})× faster than the full (({NUM})–({NUM})) context at batch ≥ ({N})",
                    required=False):
        lo, hi, b = _num(m.group(3)) * 1024, _num(m.group(4)) * 1024, _num(m.group(5))
        sel = [r for r in rows if lo <= r["context"] <= hi and r["batch"] >= b]
        if {r["context"] for r in sel} >= {lo, hi}:
            c.same("full / ours", m.group(1), [r["full_over_ours"] for r in sel])
        else:
            c.errors.append(f"contexts {m.group(2)} at batch >= {m.group(5)}: not in the JSON")
    for m in c.find("figure", rf"({X}) of a `copy_`", required=False):
        c.same("copy_ time / compaction time", m.group(1),
               [r["compact_over_copy_speed"] for r in res["compaction"]["rows"]])
    if same_ms:  # the row says which kernel it timed
        for k in timed_kernels():
            if f"`{k}`" not in c.row.figure:
                c.errors.append(f"benchmarks.gpu_kernels.decode times `{k}`; the row does not say so")
    if not c.read["figure"]:
        c.errors.append("the row quotes none of the GPU figures the checker reads")
    _dtype_word(c, {res["decode"]["shape"]["dtype"]})


def check_builder(c: Check) -> None:
    (res,) = c.jsons
    for m in c.find("what", rf"({N}) compacted requests"):
        row = next((r for r in res["rows"] if r["compacted_requests"] == int(_num(m.group(1)))), None)
        if row is None:
            c.errors.append(f"no row of {m.group(1)} compacted requests")
            continue
        for mm in c.find("figure", rf"({X}) ms per step"):
            c.same("ms per step, tables kept", mm.group(1), row["incremental_ms"])
        for mm in c.find("figure", rf"({X})× less than rebuilding"):
            c.same("rebuilt / kept", mm.group(1), row["speedup"])


def check_perplexity_long(c: Check) -> None:
    from benchmarks.perplexity import long_rows

    longs = [res["long"] for res in c.jsons]
    for m in c.find("what", rf"({N}) teacher-forced tokens"):
        c.same("continuation tokens", m.group(1), [lg["continuation_tokens"] for lg in longs])
    by = [{(r["policy"], r["budget"], r["method"], r["interval"]): r["ppl_ratio"] for r in long_rows(lg)}
          for lg in longs]
    common = set(by[0]).intersection(*by[1:])
    for m in c.find("figure", rf"within ({X})"):
        c.same("largest difference in perplexity ratio", m.group(1),
               max(max(b[k] for b in by) - min(b[k] for b in by) for k in common))
    for m in c.find("figure", rf"at ({N}) and ({N}) tokens per head"):
        c.same("budgets", f"{m.group(1)}, {m.group(2)}",
               ", ".join(str(b) for b in sorted({k[1] for k in common if k[1] is not None})))
    pols, named = sorted({k[0] for k in common if k[0]}), sorted(re.findall(r"`(\w+)`", c.row.figure))
    if named != pols:
        c.errors.append(f"policies: README {named}, JSON {pols}")
    _dtype_word(c, {lg["dtype"] for lg in longs})


def _pages_of(res: dict) -> str:
    """The KV pages a passkey JSON ran on: ``fp8`` (``--kv-cache-dtype fp8*``) or the engine's dtype word."""
    kv = str(res.get("kv_cache_dtype", "auto"))
    return "fp8" if kv.startswith("fp8") else DTYPES.get(res.get("dtype", "float32"), kv)


def check_passkey(c: Check) -> None:
    bm = c.find("what", rf"(?:at )?((?:{N}, )*{N}(?: and {N})?) tokens per head")
    budgets = [int(_num(b)) for b in re.findall(N, bm[0].group(1))] if bm else []
    default = "agnostic" if "question hidden" in c.row.what else "aware"
    pos = 0
    for seg in c.row.figure.split(";"):
        # a segment may name the pages its figures ran on ("fp8 pages, visible: ..."): only those JSONs count
        pm = re.match(r"\s*(\w+) pages, ", seg)
        pages = pm.group(1) if pm else None
        head = seg[pm.end():] if pm else seg
        mode = {"visible:": "aware", "hidden:": "agnostic"}.get(head.strip().split(" ")[0], default)
        results = [(r, res) for res in c.jsons if pages is None or _pages_of(res) == pages
                   for r in res["results"].values()]
        if pages is not None and not results:
            c.errors.append(f"no JSON of the row ran on {pages} pages")
        for m in re.finditer(rf"`([\w:@]+)`\)? ((?:{N}, )*{N})(?!\d|, \d)", seg):
            c.read["figure"].append((pos + m.start(2), pos + m.end(2)))
            got = [x.strip() for x in m.group(2).split(",")]
            if len(got) != len(budgets):
                c.errors.append(f"{m.group(1)}: {len(got)} figures for {len(budgets)} budgets")
                continue
            for b, g in zip(budgets, got):
                hit = [r for r, _ in results if r["policy"] == m.group(1) and r["budget"] == b and r["mode"] == mode]
                if len(hit) != 1:
                    c.errors.append(f"{m.group(1)} at {b} ({mode}): {len(hit)} results in the JSON")
                else:
                    c.same(f"{m.group(1)} at {b} ({mode}), correct", g, hit[0]["correct"])
        pos += len(seg) + 1
    for m in c.find("figure", rf"\(of ({N})\)"):
        c.same("trials", m.group(1), [r["trials"] for res in c.jsons for r in res["results"].values()])
    _dtype_word(c, {res.get("dtype", "float32") for res in c.jsons})


def check_protocol(c: Check) -> None:
    (res,) = c.jsons
    if f"`{res['versus']}`" not in c.row.what:
        c.errors.append(f"the JSON confirms `{res['versus']}`; the row does not name it")
    for m in c.find("figure", r"against `([^`]+)`: ([^;]+)"):
        other, pos = m.group(1), m.start(2)
        if other not in res["confirm"]:
            c.errors.append(f"the JSON confirms nothing against {other}")
            continue
        for v in re.finditer(rf"(loss|tie|win) at ({N}) \(Δ ({X})\)", m.group(2)):
            c.read["figure"] += [(pos + v.start(g), pos + v.end(g)) for g in (2, 3)]
            b = int(_num(v.group(2)))
            t = next((t for t, mb in res["matched"].items() if mb.get(res["versus"]) == b and mb.get(other) == b),
                     None)
            if t is None:
                c.errors.append(f"no matched cell at budget {b} against {other}")
                continue
            got = res["confirm"][other][t]
            c.same(f"verdict against {other} at {b}", v.group(1), got["verdict"])
            c.same(f"Δ coverage against {other} at {b}", v.group(3), got["point"])
    _dtype_word(c, {res["dtype"]})


CHECKERS = {"serving": check_serving, "audit": check_audit, "gpu_kernels": check_gpu_kernels,
            "builder": check_builder, "perplexity_long": check_perplexity_long, "passkey": check_passkey,
            "protocol": check_protocol}


def kind_of(files: list[str]) -> str | None:
    kinds = {next((k for k in CHECKERS if Path(f).stem == k or Path(f).stem.startswith(k + "_")), None)
             for f in files}
    return kinds.pop() if len(kinds) == 1 else None


def check_row(row: Row, root: Path = ROOT) -> list[str]:
    """Every disagreement between ``row`` and the JSON it cites (empty: the row is true to its JSON)."""
    if not row.files:
        return ["the row cites no docs/results/*.json"]
    missing = [f for f in row.files if not (root / f).is_file()]
    if missing:
        return [f"cited JSON not committed: {missing}"]
    kind = kind_of(row.files)
    if kind is None:
        return [f"no checker for {row.files} (one kind of JSON a row: {', '.join(CHECKERS)})"]
    c = Check(row, [json.loads((root / f).read_text()) for f in row.files])
    CHECKERS[kind](c)
    check_machine(c)
    c.unchecked()
    return c.errors


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------

ROWS = results_rows()


def test_the_table_is_there_and_every_row_cites_json_and_a_docs_anchor():
    assert len(ROWS) >= 10
    heads = [re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+ (.+)$", (ROOT / "docs" / "results.md").read_text(), re.M)]
    for row in ROWS:
        assert row.files, row.label
        for anchor in re.findall(r"\(docs/results\.md#([\w\-]+)\)", row.where):
            assert anchor in heads, f"{row.label}: docs/results.md has no heading #{anchor}"


@pytest.mark.parametrize("row", ROWS, ids=[f"line{r.line}" for r in ROWS])
def test_row_is_true_to_its_json(row):
    errors = check_row(row)
    assert not errors, f"{row.label}\n  " + "\n  ".join(errors)


def test_figures_are_the_numbers_of_the_text_not_of_names():
    got = [s for _, _, s in figures("fp32 AVX-512 Xeon, TPOT p50 1.57×, `knorm@T0` 1,024–2,048 out, Δ -0.050, "
                                    "16K–32K, 10/10, H200 a 2,048-token prompt, 942b2fb")]
    assert got == ["1.57", "1,024–2,048", "-0.050", "16K–32K", "10/10", "2,048"]


def test_as_printed_follows_the_readmes_precision():
    assert as_printed([3.008, 2.961, 2.787], "2.79–3.01") == "2.79–3.01"
    assert as_printed(3.0417, "3") == "3" and as_printed(15.45, "15.5") in ("15.4", "15.5")
    assert as_printed([1024.0], "1,024") == "1,024" and as_printed(0.1078, "+0.108") == "+0.108"
    assert as_printed([16.0, 16.0], "16") == "16"


def _row(what_fragment: str) -> Row:
    return next(r for r in ROWS if what_fragment in r.what)


def test_a_changed_figure_an_unread_figure_and_a_wrong_machine_fail():
    row = _row("16 × 2,000 in / 512 out, 160-block pool, bf16")
    assert check_row(row) == []
    wrong = Row(row.what, row.figure.replace("4.23×", "4.32×"), row.where, row.line)
    assert any("README 4.32, JSON 4.23" in e for e in check_row(wrong))
    mean = Row(row.what, row.figure.replace("mean 13.5 vs 1.9", "mean 16 vs 2"), row.where, row.line)
    assert any("mean running, eviction: README 16, JSON 14" in e for e in check_row(mean))
    extra = Row(row.what, row.figure + "; 9 % faster", row.where, row.line)
    assert any("'9' is read from no JSON" in e for e in check_row(extra))
    machine = Row(row.what.replace("AMX Xeon", "AVX-512 Xeon"), row.figure, row.where, row.line)
    assert any("the row says AVX-512 Xeon" in e for e in check_row(machine))
    dtype = Row(row.what.replace("bf16", "fp32"), row.figure, row.where, row.line)
    assert any("dtype is bf16" in e for e in check_row(dtype))


def test_a_row_without_json_or_with_two_kinds_fails():
    row = _row("16 × 2,000 in / 512 out, 160-block pool, bf16")
    assert check_row(Row(row.what, row.figure, "[serving](docs/results.md#serving)", row.line)) == [
        "the row cites no docs/results/*.json"]
    two = Row(row.what, row.figure, row.where + " · [b](docs/results/builder.json)", row.line)
    assert check_row(two)[0].startswith("no checker for")


def test_the_h200_decode_row_names_the_kernel_it_timed():
    row = _row("compacted decode on an H200")
    assert timed_kernels() == {"ragged_decode_attention"}
    bare = Row(row.what, row.figure.split(". Timed:")[0], row.where, row.line)
    assert any("times `ragged_decode_attention`" in e for e in check_row(bare))


def test_passkey_and_protocol_rows_read_each_cell_from_the_json():
    row = _row("retrieval (passkey)")
    flipped = Row(row.what, row.figure.replace("hidden: `knorm` 1", "hidden: `knorm` 8"), row.where, row.line)
    assert any("knorm at 512 (agnostic), correct: README 8, JSON 1" in e for e in check_row(flipped))
    row = _row("a surrogate of KVzip's scores")  # a JSON in a run's folder (docs/results/kvzap/)
    assert row.files == ["docs/results/kvzap/passkey.json"] and check_row(row) == []
    flipped = Row(row.what, row.figure.replace("`kvzap` 0", "`kvzap` 9"), row.where, row.line)
    assert any("kvzap at 512 (agnostic), correct: README 9, JSON 0" in e for e in check_row(flipped))
    row = _row("under the evaluation protocol")
    won = Row(row.what, row.figure.replace("tie at 384", "win at 384"), row.where, row.line)
    assert any("verdict against kvzip at 384: README win, JSON tie" in e for e in check_row(won))


def test_the_fp8_passkey_row_reads_each_figure_from_its_pages_json():
    """The fp8 row cites two runs with the same configurations; each segment's figures are read from the JSON of
    the pages it names (fp8: ``kv_cache_dtype`` fp8; bf16: the bf16 engine's own pages)."""
    row = _row("on fp8 KV pages")
    assert check_row(row) == []
    bf16 = re.search(r"bf16 pages, visible: `snapkv` (\d+)", row.figure).group(1)
    fp8 = re.search(r"fp8 pages, visible: `snapkv` (\d+)", row.figure).group(1)
    swapped = Row(row.what, row.figure.replace(f"bf16 pages, visible: `snapkv` {bf16}",
                                               f"bf16 pages, visible: `snapkv` {fp8}"), row.where, row.line)
    if bf16 != fp8:
        assert any(f"snapkv at 512 (aware), correct: README {fp8}, JSON {bf16}" in e for e in check_row(swapped))
    alone = Row(row.what, row.figure, row.where.split(" · [passkey_fp8_bf16pages")[0], row.line)
    assert any("no JSON of the row ran on bf16 pages" in e for e in check_row(alone))
