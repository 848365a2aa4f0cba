"""What the two sides of the connector send each other every step.

Scheduler -> workers (``ContourMetadata``): the rounds to run after this step's forward, the query ranges
to capture, the requests to forget. Workers -> scheduler (``ContourReport``): the outcome of every round
item on every rank, and the requests whose output of this step is wrong.

Every step the scheduler also sends each scheduled request's row key (the block of its first new token)
and epoch (``keys``, see ``state.py``).

An outcome is typed: ``Round`` (``freed``: the ``(slot, block id)`` pairs that hold nothing now; ``replaced``:
``(slot, old id, new id)``, the round packed into private blocks, which take those slots; ``published``: the
worker kept the round's layout and the partial block's snapshot as a shared compressed context), ``Noop``
(nothing to evict), ``PlanFailed`` (nothing moved) or ``Recompute`` (bytes moved, then it failed). Ranks and
pipeline stages merge (``merge``): a block is freed only when every rank freed it, a slot is replaced when any
rank wrote into its private block; ranks that disagree on the outcome or the region make the request
recompute (their caches no longer describe one request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_contour.integration.state import CaptureItem, ReconItem, RoundItem


@dataclass
class ContourMetadata(KVConnectorMetadata):
    rounds: list[RoundItem] = field(default_factory=list)
    capture: list[CaptureItem] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)
    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # req -> (row key block, epoch)
    adopt: dict[str, int] = field(default_factory=dict)  # req -> shared compressed context it starts with
    shared_dropped: list[int] = field(default_factory=list)  # shared contexts the workers forget
    recon: list[ReconItem] = field(default_factory=list)  # repeat tokens of hidden reconstruction requests
    scores_dropped: list[str] = field(default_factory=list)  # context keys whose kept KVzip scores go


@dataclass(frozen=True)
class Noop:
    seq: int


@dataclass(frozen=True)
class PlanFailed:
    seq: int
    reason: str


@dataclass(frozen=True)
class Recompute:
    seq: int
    reason: str


@dataclass(frozen=True)
class Round:
    seq: int
    region_blocks: int
    kept_blocks: int
    freed: tuple[tuple[int, int], ...] = ()  # (slot, block id)
    replaced: tuple[tuple[int, int, int], ...] = ()  # (slot, original id, private id)
    published: int | None = None


Outcome = Round | Noop | PlanFailed | Recompute


def merge(a: Outcome, b: Outcome) -> Outcome:
    """Two ranks' (or pipeline stages') outcomes of one request's round."""
    for x in (a, b):
        if isinstance(x, Recompute):
            return x
    if type(a) is not type(b) or a.seq != b.seq:
        return Recompute(a.seq, f"ranks disagree on the round ({type(a).__name__} vs {type(b).__name__})")
    if not isinstance(a, Round):
        return a
    if a.region_blocks != b.region_blocks:
        return Recompute(a.seq, "ranks disagree on the compacted region")
    mine = set(b.freed)
    replaced = {x[0]: x for x in a.replaced + b.replaced}
    return Round(a.seq, a.region_blocks, max(a.kept_blocks, b.kept_blocks),
                 freed=tuple(x for x in a.freed if x in mine and x[0] not in replaced),
                 replaced=tuple(sorted(replaced.values())),
                 published=a.published if a.published == b.published else None)


class ContourReport(KVConnectorWorkerMetadata):
    def __init__(self, entries: dict[str, Outcome] | None = None, forward_errors: dict[str, str] | None = None):
        self.entries = dict(entries or {})
        self.forward_errors = dict(forward_errors or {})

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, ContourReport)
        merged = dict(self.entries)
        for req_id, out in other.entries.items():
            merged[req_id] = merge(merged[req_id], out) if req_id in merged else out
        errors = dict(self.forward_errors)
        errors.update(other.forward_errors)
        return ContourReport(merged, errors)

    def __bool__(self) -> bool:
        return bool(self.entries) or bool(self.forward_errors)
