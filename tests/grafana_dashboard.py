"""The metric names docs/grafana/vllm-contour.json queries (read from its PromQL), for the unit test against
metrics.py and the end-to-end test against a running server's /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "vllm-contour.json"
_NAME = re.compile(r"vllm:[A-Za-z0-9_:]+")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict | None = None) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its template variables' queries."""
    dash = dash or load()
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        q = v.get("query")
        if isinstance(q, dict):
            out.append(q["query"])
    return out


def queried_metrics(dash: dict | None = None) -> set[str]:
    """The sample names (as /metrics shows them: counters with ``_total``, histograms ``_bucket`` / ``_sum`` /
    ``_count``) the dashboard's queries read."""
    return {m for q in queries(dash) for m in _NAME.findall(q)}
