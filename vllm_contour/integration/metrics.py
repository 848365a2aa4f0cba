"""Eviction telemetry through vLLM's KV-connector stats channel. One set of counters: each event is
counted once, where it happens (rounds and their cost on the worker, blocks freed and failures on the
scheduler), sent as per-step deltas, aggregated by vLLM across ranks and steps, logged with its "KV
Transfer metrics" line and exported on ``/metrics`` as ``vllm:contour_*``.

``ContourStats.data`` keys carry their kind: ``c:`` counters (added), ``h:`` histogram observations (lists,
concatenated), ``g:`` gauges (the largest of the ranks / the interval), ``i:`` info (a dict, e.g. which
implementation each op uses). A counter with a label is ``c:name|label``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = {
    "evicted_requests": "Requests compacted for the first time (prompt end or first decode round)",
    "rounds": "Eviction rounds run (prompt end and decode time)",
    "freed_blocks": "KV blocks returned to vLLM's pool by eviction (their reference count reached 0)",
    "private_blocks": "Private KV blocks rounds packed kept pages into, instead of blocks hashed for prefix "
                      "caching or shared with other requests",
    "shared_contexts": "Compressed contexts published for sharing (a context round's kept pages, layout and "
                       "moments)",
    "shared_context_hits": "Requests that started with a shared compressed context as their prefix-cache hit",
    "shared_context_hit_tokens": "Context tokens those requests did not prefill (counted in vLLM's cached "
                                 "tokens too)",
    "deferred_rounds": "Rounds put off a step because the pool had no room for their private blocks",
    "deferred_captures": "Observation windows not captured because the pool had no room for the blocks that hold "
                         "their queries (a decode-time round is put off by a window)",
    "stale_reports": "Eviction reports ignored (request finished or preempted meanwhile)",
    "policy_seconds": "Worker time spent planning rounds (scoring, allocation, layout)",
    "compact_seconds": "Worker time spent moving kept tokens and storing moments",
    "later_round_seconds": "The part of policy_seconds + compact_seconds spent in rounds of requests already "
                           "compacted (decode-time rounds after the first, a session's later chunks)",
    "batched_rounds": "Rounds whose bytes moved together with other requests' rounds due in the same step "
                      "(one compaction per layer)",
    "rounds_planned_together": "Decode-time rounds planned in one policy pass with other requests' rounds due "
                               "in the same step (same eviction parameters)",
    "reconstructions": "Contexts reconstructed for KVzip scores (kvzip, contour_kvzip), by hidden requests that "
                       "repeat them",
    "reconstruction_tokens": "Tokens the reconstructions computed (their repeat tokens, and the context where it "
                             "was not a prefix-cache hit)",
    "reconstructions_reused": "Rounds scored with the KVzip scores kept from an earlier request's reconstruction "
                              "of the same context (no reconstruction ran for them)",
    "tokens_evicted": "Tokens evicted (summed over layers and KV heads, divided by layers x heads)",
    "predicted_rows": "Batch rows given a short context for vLLM's kernel before the step's message reached the "
                      "worker (Model Runner V2 builds attention metadata first): compacted requests found by "
                      "their expected next position",
    "mispredicted_rows": "Of those, rows the step's message did not make compacted (their request fails alone; "
                         "never expected)",
}
LABELLED = {
    # name: (help, label name)
    "eviction_failures": ("Requests whose eviction failed and that were served without it (or recomputed, "
                          "or failed alone), by where it failed", "reason"),
}
HISTOGRAMS = {
    # name: (help, buckets)
    "request_mean_kv_tokens": ("Mean KV tokens per KV head a request held in vLLM's pool over its life "
                               "(blocks held x block size, sampled every step it ran)",
                               [32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192]),
    "request_peak_kv_tokens": ("Peak KV tokens per KV head a request held in vLLM's pool",
                               [32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192]),
    "round_seconds": ("Latency of one eviction round of one request on a worker (its plan + its share of the "
                      "step's apply)",
                      [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
}
GAUGES = {
    "query_buffer_bytes": "Bytes of KVzip scores held by the worker outside vLLM's pool (awaiting their round, or "
                          "kept for later requests with the same context); window queries live in the pool",
    "query_buffer_bound_bytes": "Most bytes captured queries take outside vLLM's pool, counted at start-up: 0 "
                                "for query-free policies; else windows computed whole in one step (a prompt's "
                                "end) and a reconstruction's repeat queries, kept for that step's rounds "
                                "(layers x the step's tokens x query heads x head dim)",
    "shared_context_entries": "Shared compressed contexts in the cache",
    "shared_context_blocks": "KV blocks of vLLM's pool the shared compressed contexts hold (paid once)",
    "shared_context_requests": "Running requests that hold a shared compressed context's pages",
    "pool_request_blocks": "KV blocks out of vLLM's own free queue other than those only shared compressed "
                           "contexts hold, after the step (0 on an idle server: nothing leaked)",
}


@dataclass
class ContourStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self):
        self.data = {}

    def add(self, key: str, value: float, label: str | None = None) -> None:
        k = f"c:{key}" if label is None else f"c:{key}|{label}"
        self.data[k] = self.data.get(k, 0) + value

    def observe(self, key: str, value: float) -> None:
        self.data.setdefault(f"h:{key}", []).append(float(value))

    def gauge(self, key: str, value: float) -> None:
        self.data[f"g:{key}"] = max(value, self.data.get(f"g:{key}", value))

    def info(self, key: str, value: dict) -> None:
        self.data[f"i:{key}"] = dict(value)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = ContourStats({k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                            for k, v in self.data.items()})
        for k, v in other.data.items():
            if k.startswith("h:"):
                out.data.setdefault(k, []).extend(v)
            elif k.startswith("g:"):
                out.data[k] = max(v, out.data.get(k, v))
            elif k.startswith("i:"):
                out.data[k] = dict(v)
            else:
                out.data[k] = out.data.get(k, 0) + v
        return out

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            name = k.split(":", 1)[1]
            if k.startswith("h:"):
                if v:
                    out[f"{name}_mean"] = round(sum(v) / len(v), 4)
            elif k.startswith("i:"):
                continue
            else:
                out[name] = round(v, 4) if isinstance(v, float) else v
        return out

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())

    def counter(self, key: str, label: str | None = None) -> float:
        return self.data.get(f"c:{key}" if label is None else f"c:{key}|{label}", 0)


class ContourPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._per_engine = per_engine_labelvalues
        self.counters = {}
        for name, help_text in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:contour_{name}", documentation=help_text,
                                        labelnames=labelnames)
            self.counters[name] = create_metric_per_engine(counter, per_engine_labelvalues)
        self.labelled = {}
        for name, (help_text, label) in LABELLED.items():
            self.labelled[name] = self._counter_cls(name=f"vllm:contour_{name}", documentation=help_text,
                                                    labelnames=list(labelnames) + [label])
        self.histograms = {}
        for name, (help_text, buckets) in HISTOGRAMS.items():
            hist = self._histogram_cls(name=f"vllm:contour_{name}", documentation=help_text,
                                       labelnames=labelnames, buckets=buckets)
            self.histograms[name] = create_metric_per_engine(hist, per_engine_labelvalues)
        self.gauges = {}
        for name, help_text in GAUGES.items():
            gauge = self._gauge_cls(name=f"vllm:contour_{name}", documentation=help_text,
                                    labelnames=labelnames, multiprocess_mode="mostrecent")
            self.gauges[name] = create_metric_per_engine(gauge, per_engine_labelvalues)
        self.ops_info = self._gauge_cls(name="vllm:contour_ops_info",
                                        documentation="1 for the implementation each eviction op uses",
                                        labelnames=list(labelnames) + ["op", "impl"],
                                        multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        engine_labels = list(self._per_engine[engine_idx])
        for k, v in transfer_stats_data.items():
            kind, _, name = k.partition(":")
            if kind == "c":
                base, _, label = name.partition("|")
                if label and base in self.labelled and v:
                    self.labelled[base].labels(*engine_labels, label).inc(v)
                elif base in self.counters and v:
                    self.counters[base][engine_idx].inc(v)
            elif kind == "h" and name in self.histograms:
                for x in v:
                    self.histograms[name][engine_idx].observe(x)
            elif kind == "g" and name in self.gauges:
                self.gauges[name][engine_idx].set(v)
            elif kind == "i" and name == "ops":
                for op, impl in v.items():
                    self.ops_info.labels(*engine_labels, op, impl).set(1)
