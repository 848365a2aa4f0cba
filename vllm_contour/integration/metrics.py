"""Eviction telemetry through vLLM's KV-connector stats channel: worker timers and scheduler counters
are aggregated by vLLM, logged with its "KV Transfer metrics" line and exported on ``/metrics`` as
``vllm:contour_*`` counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

FIELDS = {
    # name: (help, source)
    "evicted_requests": "Requests whose prompt KV was compacted",
    "freed_blocks": "KV blocks returned to vLLM's pool by eviction",
    "stale_reports": "Eviction reports ignored (request finished or preempted meanwhile)",
    "policy_seconds": "Worker time spent scoring and allocating",
    "compact_seconds": "Worker time spent moving kept tokens",
    "prefill_tokens_evicted_from": "Prompt tokens of the compacted requests",
}


@dataclass
class ContourStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self):
        self.data = {}

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = ContourStats(dict(self.data))
        for k, v in other.data.items():
            out.add(k, v)
        return out

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class ContourPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self.counters = {}
        for name, help_text in FIELDS.items():
            counter = self._counter_cls(name=f"vllm:contour_{name}", documentation=help_text,
                                        labelnames=labelnames)
            self.counters[name] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
