"""What the two sides of the connector send each other every step.

Scheduler -> workers (``ContourMetadata``): the rounds to run after this step's forward, the query ranges
to capture, the requests to forget. Workers -> scheduler (``ContourReport``): the outcome of every round
item on every rank, and the requests whose output of this step is wrong.

Every step the scheduler also sends each scheduled request's row key (the block of its first new token)
and epoch (``keys``, see ``state.py``).

An outcome is a dict: ``{"kind": "round", "seq", "region_blocks", "kept_blocks", "freed": [(slot,
block_id), ...], "replaced": [(slot, old_id, new_id), ...], "published": entry id or None}``
(``replaced``: the round packed into private blocks, which take those slots; ``published``: the worker
kept the round's layout and the partial block's snapshot as a shared compressed context),
``{"kind": "noop", "seq"}`` (nothing to evict), ``{"kind": "plan_failed", "seq", "reason"}`` (nothing
moved) or ``{"kind": "recompute", "seq", "reason"}`` (bytes moved, then it failed).
Ranks merge (``aggregate``): a block is freed only when every rank freed it, a slot is replaced when any
rank wrote into its private block; ranks that disagree on the
outcome or the region make the request recompute (their caches no longer describe one request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_contour.integration.state import CaptureItem, RoundItem


@dataclass
class ContourMetadata(KVConnectorMetadata):
    rounds: list[RoundItem] = field(default_factory=list)
    capture: list[CaptureItem] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)
    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # req -> (row key block, epoch)
    adopt: dict[str, int] = field(default_factory=dict)  # req -> shared compressed context it starts with
    shared_dropped: list[int] = field(default_factory=list)  # shared contexts the workers forget


def merge_outcomes(a: dict, b: dict) -> dict:
    if a["kind"] == "recompute":
        return a
    if b["kind"] == "recompute":
        return b
    if a["kind"] != b["kind"] or a.get("seq") != b.get("seq"):
        return {"kind": "recompute", "seq": a.get("seq"),
                "reason": f"ranks disagree on the round ({a['kind']} vs {b['kind']})"}
    if a["kind"] != "round":
        return a
    if a["region_blocks"] != b["region_blocks"]:
        return {"kind": "recompute", "seq": a["seq"], "reason": "ranks disagree on the compacted region"}
    mine = {tuple(x) for x in b["freed"]}
    replaced = {x[0]: tuple(x) for x in list(a.get("replaced", ())) + list(b.get("replaced", ()))}
    published = a.get("published") if a.get("published") == b.get("published") else None
    return {"kind": "round", "seq": a["seq"], "region_blocks": a["region_blocks"], "published": published,
            "kept_blocks": max(a["kept_blocks"], b["kept_blocks"]),
            "freed": [tuple(x) for x in a["freed"] if tuple(x) in mine and x[0] not in replaced],
            "replaced": sorted(replaced.values())}


class ContourReport(KVConnectorWorkerMetadata):
    def __init__(self, entries: dict[str, dict] | None = None, forward_errors: dict[str, str] | None = None):
        self.entries = dict(entries or {})
        self.forward_errors = dict(forward_errors or {})

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, ContourReport)
        merged = dict(self.entries)
        for req_id, out in other.entries.items():
            merged[req_id] = merge_outcomes(merged[req_id], out) if req_id in merged else out
        errors = dict(self.forward_errors)
        errors.update(other.forward_errors)
        return ContourReport(merged, errors)

    def __bool__(self) -> bool:
        return bool(self.entries) or bool(self.forward_errors)
