"""docs/grafana/vllm-contour.json queries only metrics that exist: the plugin's as metrics.py declares and
exports them (a ``ContourPromMetrics`` over a private Prometheus registry, named as vLLM's exporter names
them), vLLM's own as its metrics logger declares them; and it shows what the plugin measures."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest

from tests import grafana_dashboard as gd


def exported_contour_names() -> set[str]:
    """Sample names the plugin's metrics put on /metrics, from metrics.py itself: every declared metric is
    registered in a private registry, labelled ones given a sample, and the exposition read back."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from benchmarks.serving import parse_prometheus
    from vllm_contour.integration.metrics import LABELLED, ContourPromMetrics, ContourStats

    reg = CollectorRegistry()

    def bound(cls):
        return lambda *a, **kw: cls(*a, registry=reg, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    prom = ContourPromMetrics(SimpleNamespace(kv_transfer_config=None),
                              {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
                              ["model_name", "engine"], {0: ["m", "0"]})
    stats = ContourStats()
    for name in LABELLED:
        stats.add(name, 1, label="plan")
    stats.info("ops", {"compact": "cpp"})
    prom.observe(stats.data, 0)
    return {n for n, _, _ in parse_prometheus(generate_latest(reg).decode())}


def vllm_declared_names() -> set[str]:
    """Metric names vLLM's Prometheus logger declares (``name="vllm:..."``), as they are exported."""
    from vllm.v1.metrics import loggers

    src = inspect.getsource(loggers)
    base = set(re.findall(r'name="(vllm:[a-z0-9_]+)"', src))
    return base | {b + s for b in base for s in ("_total", "_bucket", "_sum", "_count")}


def test_every_queried_metric_exists():
    names = gd.queried_metrics()
    contour = {n for n in names if n.startswith("vllm:contour_")}
    assert contour and names - contour, names
    assert not contour - exported_contour_names(), sorted(contour - exported_contour_names())
    assert not (names - contour) - vllm_declared_names(), sorted((names - contour) - vllm_declared_names())


@pytest.mark.parametrize("needed", [
    "vllm:contour_freed_blocks_total", "vllm:contour_request_mean_kv_tokens_sum",
    "vllm:contour_request_peak_kv_tokens_bucket", "vllm:contour_rounds_total", "vllm:contour_round_seconds_bucket",
    "vllm:contour_eviction_failures_total", "vllm:contour_shared_context_hits_total",
    "vllm:contour_shared_context_entries", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:generation_tokens_total"])
def test_the_dashboard_shows(needed):
    assert needed in gd.queried_metrics()


def test_failures_are_split_by_reason_and_latency_by_quantile():
    exprs = gd.queries()
    assert any("vllm:contour_eviction_failures_total" in q and "by (reason)" in q for q in exprs)
    assert any(q.startswith("histogram_quantile(0.99") and "round_seconds_bucket" in q for q in exprs)


def test_panels_are_well_formed():
    dash = gd.load()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
