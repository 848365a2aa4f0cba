"""README result blocks: rendered from the benchmarks' JSON, only the text between markers changes."""

import json

import pytest

from benchmarks import report, stamp
from benchmarks.ruler import summarize
from benchmarks.serving import ratio_table


def _write(tmp_path, name, obj):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj))
    return name


def _passkey():
    return stamp({"prompt_tokens": 100, "trials": 4, "results": {
        "full": {"policy": "none", "budget": None, "mode": "aware", "correct": 4, "trials": 4},
        "knorm@512": {"policy": "knorm", "budget": 512, "mode": "aware", "correct": 2, "trials": 4},
        "knorm@128": {"policy": "knorm", "budget": 128, "mode": "aware", "correct": 1, "trials": 4},
        "knorm@128/agn": {"policy": "knorm", "budget": 128, "mode": "agnostic", "correct": 3, "trials": 4},
        "knorm@128/so": {"policy": "knorm", "budget": 128, "mode": "score_only", "correct": 2, "trials": 4}}},
        ["--budgets", "128,512"])


def test_block_is_rendered_and_prose_outside_is_kept(tmp_path):
    src = _write(tmp_path, "r/passkey.json", _passkey())
    text = f"intro\n<!-- results:passkey {src} -->\nold table\n<!-- /results:passkey -->\noutro\n"
    new, names = report.regenerate(text, tmp_path)
    assert names == ["passkey"]
    assert new.startswith("intro\n<!-- results:passkey r/passkey.json -->\n") and new.endswith(
        "<!-- /results:passkey -->\noutro\n")
    assert "old table" not in new
    assert "`python -m benchmarks.passkey --budgets 128,512`" in new
    rows = [line for line in new.splitlines() if line.startswith("| ")]
    assert rows[0] == "| policy | 128 | 512 | 128 agn | 128 so |"  # aware budgets ascending, then the modes
    assert rows[1] == "| full cache | 4 | 4 | 4 | 4 |"
    assert rows[2] == "| knorm | 1 | 2 | 3 | 2 |"
    again, _ = report.regenerate(new, tmp_path)
    assert again == new  # idempotent


def test_check_reports_stale_and_write_fixes_it(tmp_path, capsys):
    src = _write(tmp_path, "passkey.json", _passkey())
    readme = tmp_path / "README.md"
    readme.write_text(f"<!-- results:passkey {src} -->\n<!-- /results:passkey -->\n")
    args = ["--readme", str(readme), "--root", str(tmp_path)]
    assert report.main(args + ["--check"]) == 1
    assert report.main(args) == 0
    assert report.main(args + ["--check"]) == 0
    assert "| knorm | 1 | 2 | 3 | 2 |" in readme.read_text()


def test_missing_file_and_unknown_renderer_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="results:ruler.*r/none.json"):
        report.regenerate("<!-- results:ruler r/none.json -->\n<!-- /results:ruler -->", tmp_path)
    with pytest.raises(ValueError, match="results:bogus.*unknown renderer"):
        report.regenerate("<!-- results:bogus x.json -->\n<!-- /results:bogus -->", tmp_path)
    for bad in ("protocol/diversity-hi", "Protocol"):  # not a block name: an error, not a silent skip
        with pytest.raises(ValueError, match=f"results:{bad}' is not a block"):
            report.regenerate(f"<!-- results:{bad} x.json -->\n<!-- /results:{bad} -->", tmp_path)
    with pytest.raises(ValueError, match="results:passkey' is not a block"):  # never closed
        report.regenerate("<!-- results:passkey x.json -->\n", tmp_path)


def test_serving_ratio_rows_come_from_the_same_run():
    runs = [{"config": c, "pool": 160, "output_len": 512, "request_rate": "inf", "output_throughput": t,
             "peak_running": p, "tpot_p50_ms": 100.0, "ttft_p50_ms": 10.0, "request_throughput": 1.0,
             "ttft_p99_ms": 1.0, "tpot_p99_ms": 1.0, "mean_running": m, "preemptions": 0.0}
            for c, t, p, m in [("stock", 10.0, 2, 1.95), ("snapkv", 25.0, 12, 11.0)]]
    res = stamp({"runs": runs, "ratios": ratio_table(runs), "overhead": [], "offline": [], "host": {}}, [])
    md = report.render_serving([("s.json", res)])
    assert "| snapkv | 160 | 512 | closed | 10.00 | 25.00 | 2.50 | 2 / 12 | 1.9 / 11.0 | 0 / 0 | 1.00 | 1.00 |" in md
    assert "CPU not recorded in the JSON" in md  # a JSON from before the machine was recorded says so
    assert "Eviction rounds" not in md  # no counters, no sentence
    res["overhead"] = [{"overhead_pct_of_wall": 4.0, "ms_per_round": 40.0, "rounds_per_request": 5.0,
                        "later_rounds": 32.0, "later_round_ms": 15.0, "later_round_pct_of_wall": 1.5}]
    md = report.render_serving([("s.json", res)])
    assert "5.0 per request, 40 ms each, 4.0 % of the run's wall time" in md
    assert "already compacted (decode-time, after each request's first): 15 ms each, 1.5 % of the wall." in md


def test_ruler_table_uses_the_summary_means():
    rows = [{"config": "full", "policy": "none", "budget": None, "mode": "-", "moments": False, "task": t,
             "length": 1024, "score": s, "held_bytes": 2 ** 20} for t, s in [("a", 100.0), ("b", 50.0)]]
    res = stamp({"summary": summarize(rows), "args": {"tasks": "a,b", "samples": 1}}, [])
    md = report.render_ruler([("x.json", res)])
    assert "| config | a | b | mean | MiB held |" in md  # one length: a column per task
    assert "| full | 100.0 | 50.0 | 75.0 | 1.0 |" in md
    rows.append(dict(rows[0], length=2048, score=0.0))
    md = report.render_ruler([("x.json", stamp({"summary": summarize(rows), "args": {}}, []))])
    assert "| config | 1024 tok | 2048 tok | mean | MiB held |" in md
    assert "| full | 75.0 | 0.0 | 37.5 | 1.0 |" in md


def test_stamp_keeps_existing_keys():
    assert stamp({"date": "d", "argv": ["x"]}, ["y"]) == {"date": "d", "argv": ["x"]}


def test_tagged_blocks_of_one_kind_render_separately(tmp_path):
    """Two passkey blocks (``passkey`` and ``passkey/decode``): ``--only passkey/decode`` renders only the tagged
    one, ``--only passkey`` both; the untouched block keeps its text even if its file is missing."""
    src = _write(tmp_path, "r/passkey.json", _passkey())
    text = (f"<!-- results:passkey missing.json -->\nkept\n<!-- /results:passkey -->\n"
            f"<!-- results:passkey/decode {src} -->\nold\n<!-- /results:passkey/decode -->\n")
    new, names = report.regenerate(text, tmp_path, {"passkey/decode"})
    assert names == ["passkey/decode"] and "kept" in new and "old" not in new
    assert "| knorm | 1 | 2 | 3 | 2 |" in new
    with pytest.raises(FileNotFoundError, match="missing.json"):
        report.regenerate(text, tmp_path, {"passkey"})


def test_passkey_block_states_the_cost_of_computing_the_question_over_the_compressed_cache(tmp_path):
    res = _passkey()
    res["results"]["knorm@128/agn"]["seconds"] = 3.0
    res["results"]["knorm@128/so"]["seconds"] = 2.0
    res["results"]["snapkv@128/agn"] = {"policy": "snapkv", "budget": 128, "mode": "agnostic", "correct": 0,
                                        "trials": 4, "seconds": 1.0}
    res["results"]["snapkv@128/so"] = {"policy": "snapkv", "budget": 128, "mode": "score_only", "correct": 0,
                                       "trials": 4, "seconds": 2.0}
    src = _write(tmp_path, "passkey.json", res)
    new, _ = report.regenerate(f"<!-- results:passkey {src} -->\n<!-- /results:passkey -->\n", tmp_path)
    assert "agn / so: median 1.00× (0.50–1.50) over 2 (policy, budget) pairs" in new
    assert "agn / so" not in report.regenerate(
        f"<!-- results:passkey {_write(tmp_path, 'p2.json', _passkey())} -->\n<!-- /results:passkey -->\n",
        tmp_path)[0]


def test_shared_doc_block_states_the_ratios_against_stock_with_prefix_caching():
    from benchmarks.report import render_shared_doc

    def run(name, first, rest, tok_s, right, kv):
        return {"name": name, "ttft_first_s": first, "ttft_rest_mean_s": rest, "ttft_rest_over_first": rest / first,
                "right": right, "output_tok_s": tok_s, "peak_running": 16.0, "mean_running": 9.0, "preemptions": 0.0,
                "mean_kv_tokens": kv, "loadavg": [1.5, 2.5]}

    res = {"argv": ["--pool", "160"], "date": "2026-12-01", "doc_tokens": 2000, "codes": ["1234"] * 16,
           "args": {"pool": 160, "output_len": 256, "policy": "snapkv", "budget": 128},
           "runs": [run("stock_pc", 12.0, 0.4, 40.0, 1, None), run("evict_pc", 12.0, 1.2, 60.0, 0, 183.0)]}
    md = render_shared_doc([("x.json", res)])
    assert "python -m benchmarks.shared_doc --pool 160" in md and "host load 1.5–2.5" in md
    row = next(line for line in md.splitlines() if line.startswith("| evict_pc"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "160" and cells[4] == "0.10" and cells[5] == "-" and cells[6] == "0/16" and cells[8] == "1.50"


def test_protocol_block_quotes_the_command_and_the_versus_confirmation():
    row = {"id": "a", "cluster": "p", "coverage": 0.5, "prefix": 0.25, "mean_kv": 150.0}
    res = {"model": "smollm2", "dtype": "bfloat16", "baseline": "snapkv", "versus": "contour", "context": 512,
           "generated": 320, "splits": {"a": "dev", "b": "holdout"}, "argv": ["--versus", "contour"],
           "date": "2026-12-02", "seconds": 60.0,
           "dev": {"full": [row], "contour@128": [row], "snapkv@128": [row]},
           "holdout": {"full": [row], "contour@128": [row], "snapkv@128": [dict(row, coverage=0.25)]},
           "matched": {"150.0": {"contour": 128, "snapkv": 128}},
           "confirm": {"snapkv": {"150.0": {"point": 0.25, "lo": 0.1, "hi": 0.4, "alpha": 0.05, "verdict": "win"}}}}
    md = report.render_protocol([("x.json", res)])
    assert md.startswith("_`python -m benchmarks.protocol --versus contour` · 2026-12-02 · 60 s_ — smollm2, bfloat16")
    assert "| contour vs | mean KV target | budgets (contour / it) | Δ coverage (contour - it) |" in md
    assert "| snapkv | 150.0 | 128 / 128 | 0.250 | [0.100, 0.400] | 0.050 | win |" in md


def test_reasoning_block_says_which_task_qualifies():
    t = {"correct": 12, "rg_correct": 12, "stated": 30, "gen_median": 320.0, "gen_ge_300": 20}
    res = {"model": "smollm2", "n": 30, "max_tokens": 400, "argv": [], "date": "2026-12-02",
           "tasks": {"a": t, "b": dict(t, correct=3, rg_correct=3), "c": dict(t, gen_ge_300=2)}}
    md = report.render_reasoning([("x.json", res)])
    assert "| a | 12/30 | 12/30 | 30/30 | 320 | 20/30 | yes |" in md
    assert "| b | 3/30 | 3/30 | 30/30 | 320 | 20/30 | no |" in md and "| c | 12/30 | 12/30 | 30/30 | 320 | 2/30 | no |" in md


def test_committed_results_are_rendered_from_their_committed_json():
    """docs/results.md's blocks whose JSON is committed under docs/results/ are what the report renders
    from it (a stale table or a missing JSON fails)."""
    import re
    from pathlib import Path

    from benchmarks.report import main

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "results.md").read_text()
    committed = sorted({m.group(1) for m in re.finditer(r"<!-- results:([a-z_/0-9]+) docs/results/", text)})
    assert {"gpu_kernels", "builder", "rounds"} <= set(committed)
    assert main(["--readme", str(root / "docs" / "results.md"), "--check", "--only", *committed]) == 0


def test_passkey_block_tables_what_each_configuration_held_and_its_time_per_trial(tmp_path):
    """Engine rows: the mean KV tokens per head; kvpress rows: kept unmasked of held (masks keep the
    bytes); seconds per trial. A run without these has no second table."""
    res = _passkey()
    res["results"]["knorm@128/agn"].update(mean_kv_tokens=342.5, seconds=20.0)
    res["results"]["kvpress:kvzip@128/agn"] = {"policy": "kvpress:kvzip", "budget": 128, "mode": "agnostic",
                                               "correct": 4, "trials": 4, "seconds": 66.0,
                                               "kept_kv_tokens": 128.0, "held_kv_tokens": 1870.0}
    src = _write(tmp_path, "passkey.json", res)
    new, _ = report.regenerate(f"<!-- results:passkey {src} -->\n<!-- /results:passkey -->\n", tmp_path)
    held = new.split("KV tokens per head held")[1]
    assert "342 · 5.0 s" in held
    assert "128 of 1870 · 16.5 s" in held and "| kvpress:kvzip | - | - | 4 | - |" in new.split("KV tokens per head held")[0]
    plain = _write(tmp_path, "p0.json", _passkey())
    assert "KV tokens per head held" not in report.regenerate(
        f"<!-- results:passkey {plain} -->\n<!-- /results:passkey -->\n", tmp_path)[0]


def test_stamp_makes_this_machines_paths_portable():
    """Committed results name no path of the machine that made them: a bundled model's cache directory becomes
    its name, the repository root and the environment's bin/ go, the temporary directory becomes results/."""
    import sys
    import tempfile
    from pathlib import Path

    from vllm_contour.models import home_dir

    root = Path(__file__).resolve().parents[2]
    model = home_dir() / "models" / "smollm2"
    res = stamp({"args": {"model": str(model), "n": 3},
                 "commands": [{"argv": f"{Path(sys.prefix) / 'bin'}/vllm-contour serve {model} --x {root}/docs"}]},
                ["--out", f"{tempfile.gettempdir()}/m/run"])
    assert res["args"] == {"model": "smollm2", "n": 3}
    assert res["commands"][0]["argv"] == "vllm-contour serve smollm2 --x docs"
    assert res["argv"] == ["--out", "results/m/run"]


def test_serving_block_names_the_machine_the_json_records():
    host = {"cpu_model": "Intel(R) Xeon(R) Platinum", "cpus": 2, "loadavg_at_start": [0.5, 0, 0],
            "loadavg_at_end": [2.0, 0, 0], "flags": {"avx2": True, "avx512f": True, "avx512_bf16": False,
                                                      "amx_bf16": False, "amx_tile": False}}
    md = report.render_serving([("s.json", {"runs": [], "ratios": [], "host": host, "dtype": "float32"})])
    assert "(host load 0.5–2.0; Intel(R) Xeon(R) Platinum, 2 CPUs, avx2, avx512f; float32)" in md
    old = report.render_serving([("s.json", {"runs": [], "ratios": [], "host": {}, "args": {"dtype": "bfloat16"}})])
    assert "CPU not recorded in the JSON; bfloat16" in old


def test_audit_block_without_kvpress_tables_the_blocks_held(tmp_path):
    """``benchmarks.audit --skip-kvpress``: this project's rows alone, blocks = bytes / the block's bytes."""
    bb = 1474560
    table = [{"system": "vllm-contour", "method": m, "budget": b, "samples": 1, "accuracy": a,
              "held_mib": n * bb / 2 ** 20, "unmasked_mib": n * bb / 2 ** 20}
             for m, b, a, n in [("none", "full", 100.0, 64), ("snapkv", 128, 0.0, 5)]]
    res = stamp({"table": table, "engine": {"block_size": 32, "block_bytes": bb}, "kvpress": "skipped",
                 "samples": [{"task": "niah_multikey", "length": 2048, "idx": 0, "context_len": 1978}],
                 "host": {}, "dtype": "float32"}, ["--skip-kvpress"])
    md = report.render_audit([("a.json", res)])
    assert "1 sample(s) of niah_multikey at 2048 tokens (context 1978 tokens" in md
    assert "| full cache | full | 64.0 | 90.00 | 100.00 |" in md and "| snapkv | 128 | 5.0 | 7.03 | 0.00 |" in md


def test_plots_are_re_rendered_only_beside_their_json(tmp_path, monkeypatch):
    """``--plots``: a block's JSON with a committed figure of the same name is drawn again from that JSON;
    a JSON without one gets none; kinds without a plotter are left alone."""
    drawn = []
    monkeypatch.setattr(report, "_plotter", lambda kind: (lambda res, png: drawn.append((res["n"], png.name)))
                        if kind == "serving" else None)
    for name, n in (("a", 1), ("b", 2)):
        _write(tmp_path, f"docs/results/{name}.json", {"n": n})
    (tmp_path / "docs" / "results" / "a.png").write_bytes(b"old")
    _write(tmp_path, "docs/results/c.json", {"n": 3})
    (tmp_path / "docs" / "results" / "c.png").write_bytes(b"old")
    text = ("<!-- results:serving docs/results/a.json docs/results/b.json -->\n<!-- /results:serving -->\n"
            "<!-- results:builder docs/results/c.json -->\n<!-- /results:builder -->\n")
    assert report.replot(text, tmp_path) == ["docs/results/a.png"]
    assert drawn == [(1, "a.png")]
