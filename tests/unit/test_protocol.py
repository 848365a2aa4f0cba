"""The matched-mean-cache evaluation protocol: splits, cluster bootstrap, Bonferroni, budget matching, recall."""
import json

import numpy as np
import pytest

from benchmarks import protocol
from benchmarks.protocol import (assign_splits, bonferroni_alpha, budget_for_mean, cluster_bootstrap_ci,
                                 confirm, match_budgets, paired_diff_ci, predicted_mean_kv, recall_score,
                                 split_of)
from vllm_contour.config import check_policy_args

# ------------------------------------------------------------------------------------------------ splits


def test_splits_are_deterministic_disjoint_and_cover_the_ids():
    ids = [f"sample-{i}" for i in range(4000)]
    s = assign_splits(ids)
    assert s == assign_splits(ids + ids[:10])  # repeated ids count once
    assert set(s["dev"]) | set(s["holdout"]) == set(ids)
    assert not set(s["dev"]) & set(s["holdout"])
    assert s["dev"] == [i for i in ids if split_of(i) == "dev"]  # input order kept
    assert abs(len(s["holdout"]) / len(ids) - 0.5) < 0.03
    assert sorted(assign_splits(reversed(ids))["holdout"]) == sorted(s["holdout"])  # order-free


def test_split_share_follows_holdout_share():
    ids = [f"sample-{i}" for i in range(4000)]
    share = len(assign_splits(ids, holdout_share=0.2)["holdout"]) / len(ids)
    assert abs(share - 0.2) < 0.03
    assert all(split_of(i, 0.0) == "dev" for i in ids[:50])
    assert all(split_of(i, 1.0) == "holdout" for i in ids[:50])
    with pytest.raises(ValueError):
        split_of("x", 1.5)


def test_known_ids_map_to_fixed_splits():
    # md5 prefixes dc8408b2 (0.86: dev) and 6a1023e8 (0.41: holdout), computed once: a change of the bucketing
    # would silently move samples between dev and holdout.
    assert split_of("sample-0") == "dev"
    assert split_of("ruler/niah_single_1/0") == "holdout"


# --------------------------------------------------------------------------------------------- bootstrap


def _covers(ci, mu):
    return ci[1] <= mu <= ci[2]


def test_bootstrap_ci_covers_the_mean_at_about_the_nominal_rate():
    rng = np.random.default_rng(123)
    hits = [_covers(cluster_bootstrap_ci(rng.normal(0.3, 1, 60), alpha=0.1, n_boot=500, seed=r), 0.3)
            for r in range(300)]
    assert 0.83 <= np.mean(hits) <= 0.96


def test_cluster_bootstrap_covers_clustered_data_where_the_iid_one_undercovers():
    rng = np.random.default_rng(0)
    clusters = np.repeat(np.arange(20), 5)  # 20 source passages x 5 samples each
    clu, iid = [], []
    for r in range(300):
        x = 0.3 + np.repeat(rng.normal(0, 1, 20), 5) + rng.normal(0, 0.5, 100)
        clu.append(_covers(cluster_bootstrap_ci(x, clusters, alpha=0.1, n_boot=500, seed=r), 0.3))
        iid.append(_covers(cluster_bootstrap_ci(x, None, alpha=0.1, n_boot=500, seed=r), 0.3))
    assert 0.80 <= np.mean(clu) <= 0.96
    assert np.mean(iid) < np.mean(clu) - 0.15


def test_vectorised_mean_matches_the_generic_stat_path():
    rng = np.random.default_rng(1)
    x = rng.normal(size=50)
    clusters = rng.integers(0, 12, size=50)  # clusters of unequal size
    fast = cluster_bootstrap_ci(x, clusters, n_boot=300, seed=7)
    slow = cluster_bootstrap_ci(x, clusters, n_boot=300, seed=7, stat=lambda v: np.mean(v))
    assert np.allclose(fast, slow)
    assert fast[1] < fast[0] < fast[2]
    assert cluster_bootstrap_ci(x, clusters, n_boot=300, seed=7) == fast  # deterministic


def test_bootstrap_validates_its_inputs():
    with pytest.raises(ValueError):
        cluster_bootstrap_ci([], n_boot=10)
    with pytest.raises(ValueError):
        cluster_bootstrap_ci([1.0, 2.0], clusters=[0], n_boot=10)
    with pytest.raises(ValueError):
        cluster_bootstrap_ci([1.0, 2.0], alpha=0.0, n_boot=10)


def test_paired_diff_finds_a_real_difference_and_not_a_null_one():
    rng = np.random.default_rng(5)
    base = rng.normal(0.5, 0.2, 200)
    better = base + 0.05 + rng.normal(0, 0.05, 200)
    same = base + rng.normal(0, 0.05, 200)
    r = paired_diff_ci(better, base, n_boot=1000, seed=0)
    assert r["significant"] and r["lo"] > 0 and abs(r["point"] - 0.05) < 0.02
    n = paired_diff_ci(same, base, n_boot=1000, seed=0)
    assert not n["significant"] and n["lo"] < 0 < n["hi"]
    worse = paired_diff_ci(base, better, n_boot=1000, seed=0)
    assert worse["significant"] and worse["hi"] < 0
    with pytest.raises(ValueError):
        paired_diff_ci([1.0, 2.0], [1.0])


def test_bonferroni_divides_alpha_and_confirm_uses_it():
    assert bonferroni_alpha(0.05, 1) == 0.05
    assert bonferroni_alpha(0.05, 4) == pytest.approx(0.0125)
    with pytest.raises(ValueError):
        bonferroni_alpha(0.05, 0)
    rng = np.random.default_rng(9)
    base = rng.normal(0.5, 0.2, 200)
    cells = {"m/512": (base + 0.05 + rng.normal(0, 0.05, 200), base, None),
             "m/1024": (base + rng.normal(0, 0.05, 200), base, None),
             "m/2048": (base - 0.05 + rng.normal(0, 0.05, 200), base, np.arange(200) // 4)}
    out = confirm(cells, alpha=0.05, n_boot=1000)
    assert [out[c]["verdict"] for c in cells] == ["win", "tie", "loss"]
    assert all(r["alpha"] == pytest.approx(0.05 / 3) for r in out.values())
    # the corrected interval is the one paired_diff_ci gives at alpha / m, wider than at alpha
    a, b, _ = cells["m/512"]
    at_m = paired_diff_ci(a, b, alpha=0.05 / 3, n_boot=1000)
    at_1 = paired_diff_ci(a, b, alpha=0.05, n_boot=1000)
    assert (out["m/512"]["lo"], out["m/512"]["hi"]) == (at_m["lo"], at_m["hi"])
    assert at_m["hi"] - at_m["lo"] > at_1["hi"] - at_1["lo"]


# --------------------------------------------------------------------------------- mean-cache matching


def test_predicted_mean_kv_hand_cases():
    # interval 0: cut to K once the prompt ends, then the tail grows: 64, 65, 66, 67
    assert predicted_mean_kv(64, 0, prompt=100, generated=4, block=32) == pytest.approx(65.5)
    assert predicted_mean_kv(90, 0, prompt=100, generated=4, block=32) == pytest.approx(65.5)  # K = 64
    # a prompt under the budget is never cut: 40, 41, 42, 43
    assert predicted_mean_kv(64, 0, prompt=40, generated=4, block=32) == pytest.approx(41.5)
    # interval 64, K = 64: dense 100..127 until the context reaches K + T = 128, then 64 + 0..11
    assert predicted_mean_kv(64, 64, prompt=100, generated=40, block=32) == pytest.approx(
        (sum(range(100, 128)) + sum(64 + i for i in range(12))) / 40)
    # budget 100 rounds down to K = 96; a long prompt is cut at once, the tail cycles 0..63 twice
    assert predicted_mean_kv(100, 64, prompt=1000, generated=128, block=32) == pytest.approx(96 + 31.5)
    with pytest.raises(ValueError):
        predicted_mean_kv(64, 0, prompt=10, generated=0)


def _trajectory(interval, budgets, prompt=4000, generated=800):
    return [(b, predicted_mean_kv(b, interval, prompt, generated)) for b in budgets]


def test_matching_gives_different_budgets_with_equal_mean_cache():
    budgets = [256, 512, 1024, 2048]
    decode = _trajectory(64, budgets)  # mean_kv ~ budget + 32
    prompt_end = _trajectory(0, budgets)  # mean_kv ~ budget + 400
    assert all(abs(m - b - 31.5) < 1 for b, m in decode)
    assert all(abs(m - b - 399.5) < 1 for b, m in prompt_end)
    target = 1000.0
    got = match_budgets({"decode": decode, "prompt_end": prompt_end}, target, block=32)
    assert got["decode"] != got["prompt_end"]
    assert all(b % 32 == 0 and b >= 32 for b in got.values())
    held = {"decode": predicted_mean_kv(got["decode"], 64, 4000, 800),
            "prompt_end": predicted_mean_kv(got["prompt_end"], 0, 4000, 800)}
    assert abs(held["decode"] - held["prompt_end"]) <= 32
    assert all(abs(h - target) <= 16 for h in held.values())
    assert got == {"decode": 960, "prompt_end": 608}


def test_budget_for_mean_interpolates_and_extrapolates():
    pts = [(512, 600.0), (1024, 1100.0)]
    assert budget_for_mean(pts, 850.0) == 768  # between the points: 768 -> 850 exactly
    assert budget_for_mean(pts, 1600.0) == 1536  # extrapolated with the last two points
    assert budget_for_mean(pts, 10.0) == 32  # never below one block
    assert budget_for_mean(list(reversed(pts)), 850.0) == 768  # order of the points does not matter
    assert budget_for_mean([(512, 600.0)], 700.0) == 608  # one point: slope 1
    assert budget_for_mean(pts, 860.0, block=16) == 784  # nearest multiple of the block
    with pytest.raises(ValueError):
        budget_for_mean([(512, 1.0), (512, 2.0)], 1.0)
    with pytest.raises(ValueError):
        budget_for_mean([], 1.0)


# ------------------------------------------------------------------------------------------ recall task


def test_recall_score_hand_cases():
    ref = [5, 6, 7, 8]
    assert recall_score(ref, ref) == 1.0
    assert recall_score(ref, ref + [9, 9]) == 1.0  # running on past the passage is not penalised
    assert recall_score(ref, [5, 6, 0, 8]) == 0.5  # stops at the first divergence
    assert recall_score(ref, [0, 6, 7, 8]) == 0.0
    assert recall_score(ref, []) == 0.0
    assert recall_score(ref, [5]) == 0.25
    with pytest.raises(ValueError):
        recall_score([], [1])


def test_recall_coverage_counts_aligned_tokens_not_only_the_prefix():
    ref = list(range(10))
    assert protocol.recall_coverage(ref, ref) == 1.0
    assert protocol.recall_coverage(ref, []) == 0.0
    skipped = ref[:3] + [99] + ref[4:]  # one wrong token in the middle
    assert protocol.recall_score(ref, skipped) == 0.3 and protocol.recall_coverage(ref, skipped) == 0.9
    assert protocol.recall_coverage(ref, ref[5:]) == 0.5


class _WordTok:
    def encode(self, text, add_special_tokens=False):
        return text.split()


def test_recall_samples_ask_to_continue_the_passage_after_the_instruction():
    samples = protocol.recall_samples(_WordTok(), per_play=2, context=60, cue=5, generated=40, max_plays=3)
    assert len(samples) == 6 and len({s["id"] for s in samples}) == 6
    assert len({s["cluster"] for s in samples}) == 3
    for s in samples:
        passage = s["prompt"][: s["context_len"]]
        assert s["prompt"][-5:] == passage[:5] and s["reference"] == passage[5:45]
        assert s["prompt"][60:-5] == protocol.INSTRUCTION.split()


def test_method_specs_and_summary():
    assert protocol._method("snapkv") == ("snapkv", {"kv_policy": "snapkv"})
    assert protocol._method("snapkv@T0")[1] == {"kv_policy": "snapkv", "kv_decode_interval": 0}
    assert protocol._method("adakv+mc") == ("adakv+mc", {"kv_policy": "adakv", "kv_moment_correction": True})
    assert protocol._method("moment@T0-mc")[1] == {"kv_policy": "moment", "kv_decode_interval": 0,
                                                   "kv_moment_correction": False}
    with pytest.raises(SystemExit, match="methods"):
        protocol._method("snapkv@64")
    row = {"id": "a", "cluster": "p", "coverage": 0.5, "prefix": 0.25, "mean_kv": 200.0}
    res = {"context": 60, "generated": 40, "splits": {"a": "dev", "b": "holdout"}, "baseline": "snapkv",
           "dev": {"full": [dict(row, coverage=1.0)], "knorm@128": [row], "knorm@256": [dict(row, coverage=0.75)],
                   "contour:mix=0.5@128": [row]},
           "holdout": {"full": [dict(row, coverage=0.9)], "knorm@128": [row]},
           "tuned": {"contour:mix=0.5/2": {"chosen": "contour:mix=0.5",
                                           "dev_coverage": {"contour:mix=0.5": 0.5, "contour:mix=2": 0.25}}},
           "matched": {"224.0": {"knorm": 128, "snapkv": 160}},
           "confirm": {"knorm": {"224.0": {"point": -0.1, "lo": -0.2, "hi": 0.05, "alpha": 0.05, "verdict": "tie"}}}}
    md = protocol.summary_markdown(res)
    assert "| full cache | 1.000 | 1.000 |" in md
    assert "| knorm | 0.500 (200) | 0.750 (200) |" in md and "| contour:mix=0.5 | 0.500 (200) | - |" in md
    assert "| contour:mix=0.5/2 | contour:mix=0.5 | contour:mix=0.5 0.500, contour:mix=2 0.250 |" in md
    assert "| knorm | 128 | 200.000 | 0.500 | 0.250 | 1 |" in md
    assert "| knorm | 224.0 | 128 / 160 | -0.100 | [-0.200, 0.050] | 0.050 | tie |" in md


def test_method_knobs_candidates_and_dev_tuning():
    name, extra = protocol._method("contour_diverse@T32:lam=0.25:allocator.mix=0.5")
    assert extra["kv_policy"] == "contour_diverse" and extra["kv_decode_interval"] == 32
    assert json.loads(extra["kv_policy_args"]) == {"lam": 0.25, "allocator.mix": 0.5}
    # the knobs are what the engine's own validation accepts for that preset
    assert check_policy_args("kv_policy_args", extra["kv_policy_args"], "contour_diverse") == {
        "lam": 0.25, "allocator.mix": 0.5}
    with pytest.raises(SystemExit, match="lam"):
        protocol._method("contour_diverse:lam=0.25/0.5")  # candidates are expanded first, never run as one
    with pytest.raises(SystemExit, match="knob"):
        protocol._method("contour:mix")
    assert protocol.expand_spec("snapkv") == ["snapkv"]
    assert protocol.expand_spec("contour:mix=0.5/1:power=2") == ["contour:mix=0.5:power=2", "contour:mix=1:power=2"]
    assert len(protocol.expand_spec("contour:mix=0.5/1:power=1/2/3")) == 6
    assert protocol.expand_spec("contour/contour_knorm:mix=0.5/1") == [
        "contour:mix=0.5", "contour:mix=1", "contour_knorm:mix=0.5", "contour_knorm:mix=1"]
    with pytest.raises(SystemExit, match="mix"):
        protocol.expand_spec("contour:mix=0.5/")
    assert protocol.tune_on_dev({"a": 0.2, "b": 0.4, "c": 0.4}) == "b"  # best dev score, first on ties
    with pytest.raises(ValueError):
        protocol.tune_on_dev({})
    pts = [(64, 80.5), (128, 150.0)]
    assert protocol.resolve_targets("@64,@128,200", [64, 128], pts) == [80.5, 150.0, 200.0]
    # a method with the baseline's trajectory gets exactly the baseline's budget at an @B target
    assert protocol.match_budgets({"a": pts, "b": pts}, protocol.resolve_targets("@128", [64, 128], pts)[0]) == {
        "a": 128, "b": 128}
    with pytest.raises(SystemExit, match="targets"):
        protocol.resolve_targets("@96", [64, 128], pts)


def test_estimate_counts_the_configs_and_generations_of_a_run():
    est = protocol.estimate(["snapkv", "contour:mix=0.5/1"], budgets=3, targets=2, n_dev=10, n_hold=20, rate_s=1.0)
    assert est["dev_configs"] == 1 + 3 + 2 * 3 and est["holdout_configs"] == 1 + 2 + 2
    assert est["generations"] == 10 * 10 + 5 * 20
    assert est["hours"] == pytest.approx(est["generations"] / 3600)
    slow = protocol.estimate(["contour_diverse"], budgets=1, targets=1, n_dev=10, n_hold=10, rate_s=1.0)
    assert slow["hours"] * 3600 == pytest.approx(20 + protocol.SLOW_PRESETS["contour_diverse"] * 20)
    mc = protocol.estimate(["adakv+mc"], budgets=1, targets=1, n_dev=10, n_hold=10, rate_s=1.0)
    assert mc["hours"] * 3600 == pytest.approx(20 + protocol.SLOW_MOMENT_CORRECTION * 20)
    shared = protocol.estimate(["contour_diverse:lam=0.5", "contour_diverse:lam=0.25/0.5"], budgets=2, targets=1,
                               n_dev=10, n_hold=10, rate_s=1.0)
    assert shared["dev_configs"] == 1 + 2 * 2  # lam=0.5 is one candidate of both specs: measured once


def test_estimate_rate_follows_the_dtype_unless_given():
    assert protocol.rate_for("bfloat16") == protocol.RATE_S["bfloat16"]
    assert protocol.rate_for("float32") == protocol.RATE_S["float32"] > protocol.RATE_S["bfloat16"]
    assert protocol.rate_for("float32", 5.8) == 5.8
    with pytest.raises(SystemExit, match="--rate"):
        protocol.rate_for("float32", 0.0)


# ------------------------------------------------------------------------------------------------- run()

# A stand-in engine for run(): each method's measured mean KV per head is a line in its budget (plus a small
# per-sample wobble), coverage grows with the budget; the floors are the plugin's own (budget.py).
_MEAN = {"snapkv": (0.8, 20.0), "knorm": (0.5, 30.0), "keydiff": (0.6, 10.0), "knorm+mc": (0.9, 5.0)}


class _FakeConn:
    def __init__(self):
        from types import SimpleNamespace

        from vllm_contour.budget import CacheShape
        from vllm_contour.config import EvictionConfig

        self.config = EvictionConfig(policy="snapkv", budget=128)
        self.scheduler_side = SimpleNamespace(shape=CacheShape(block_size=32, num_kv_heads=3, head_dim=64,
                                                               elem_size=4))
        self.totals = SimpleNamespace(kv_held={}, kv_held_evicting={})


class _FakeLLM:
    def __init__(self, conn):
        self.conn, self.n = conn, 0

    def get_tokenizer(self):
        return None

    def generate(self, prompts, sps, use_tqdm=False):
        from types import SimpleNamespace

        outs = []
        for p, sp in zip(prompts, sps):
            self.n += 1
            x = sp.extra_args
            key = x["kv_policy"] + ("+mc" if x.get("kv_moment_correction") else "")
            wobble = (p["prompt_token_ids"][0] % 5 - 2) * 0.5
            if key == "none":
                mean, keep = 600.0, 40
            else:
                slope, off = _MEAN[key]
                mean, keep = slope * x["kv_budget"] + off + wobble, min(40, x["kv_budget"] // 8)
            rid = f"{self.n}-0a0b0c0d"
            self.conn.totals.kv_held[rid] = self.conn.totals.kv_held_evicting[rid] = (mean, int(mean) + 16)
            outs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=list(range(keep)))]))
        return outs


def _fake_samples(tok, per_play, context, cue, generated, max_plays=None):
    return [{"id": f"recall/play{p}/{2000 + k * 1012}", "cluster": f"play{p}", "prompt": [p * 7 + k] * 3,
             "context_len": context, "reference": list(range(40))}
            for p in range(12) for k in range(per_play)]


def _run_protocol(monkeypatch, methods, targets, budgets="64,128,256"):
    from types import SimpleNamespace

    monkeypatch.setattr(protocol, "recall_samples", _fake_samples)
    args = SimpleNamespace(per_play=3, context=512, cue=16, generated=40, max_plays=None, holdout_share=0.5,
                           methods=methods, baseline="snapkv", versus=None, budgets=budgets, targets=targets,
                           alpha=0.05, n_boot=200, seed=0, model="fake", dtype="float32", out="unused", resume=False)
    conn = _FakeConn()
    return protocol.run(args, engine=(_FakeLLM(conn), conn))


def _holdout_means(res, target):
    tuned = {spec: t["chosen"] for spec, t in res["tuned"].items()}
    return {spec: float(np.mean([r["mean_kv"] for r in res["holdout"][f"{tuned[spec]}@{b}"]]))
            for spec, b in res["matched"][target].items()}


def test_run_splits_by_play_matches_the_holdout_means_and_corrects_over_every_test(monkeypatch):
    """run() on a stand-in engine: every window of a play falls on one side; the methods' matched budgets
    differ (their mean cache grows differently with the budget) and their holdout means, read from the rows,
    lie within MATCH_TOLERANCE of each other at each target; every confirmation uses alpha / (method pairs x
    targets)."""
    res = _run_protocol(monkeypatch, "snapkv,knorm,keydiff", "150,200")
    clusters = {}
    for sid, side in res["splits"].items():
        clusters.setdefault(sid.split("/")[1], set()).add(side)
    assert all(len(sides) == 1 for sides in clusters.values()), clusters
    assert {next(iter(s)) for s in clusters.values()} == {"dev", "holdout"}
    assert "(MD5 split by play)" in protocol.summary_markdown(res)
    assert "(MD5 split)" in protocol.summary_markdown(dict(res, split_by=None))  # an earlier run's JSON
    assert set(res["matched"]) == {"150.0", "200.0"}
    for target, matched in res["matched"].items():
        assert len(set(matched.values())) == 3, matched  # the matching moved the budgets apart
        means = _holdout_means(res, target)
        assert max(means.values()) - min(means.values()) <= protocol.MATCH_TOLERANCE, (target, means)
        assert all(abs(m - float(target)) <= protocol.MATCH_TOLERANCE / 2 for m in means.values()), means
        assert res["match"][target]["ok"] and res["match"][target]["clamped"] == [], res["match"][target]
    assert res["tests"] == 2 * 2
    cells = [c for per in res["confirm"].values() for c in per.values()]
    assert len(cells) == 4 and all(c["alpha"] == pytest.approx(0.05 / 4) for c in cells)


def test_run_reports_a_match_the_floor_clamp_broke(monkeypatch):
    """At a 60-token target the moment-corrected method's matched budget (64) is below its floor (128 with the
    moment pages): the clamp raises it, its holdout mean is off the target, and run() reports the match at
    that target as broken, naming the method (the summary says so too)."""
    res = _run_protocol(monkeypatch, "snapkv,knorm+mc", "60")
    assert res["matched"]["60.0"] == {"snapkv": 64, "knorm+mc": 128}
    means = _holdout_means(res, "60.0")
    assert max(means.values()) - min(means.values()) > protocol.MATCH_TOLERANCE, means
    m = res["match"]["60.0"]
    assert not m["ok"] and m["clamped"] == ["knorm+mc"], m
    assert "match broken at mean KV 60.0" in protocol.summary_markdown(res)
