"""What the two sides of the connector send each other every step, in one module both import.

Scheduler -> workers (``ContourMetadata``, vLLM's connector metadata): the rounds to run after this step's
forward (``RoundItem``), the query ranges to capture (``CaptureItem``), the repeat tokens of KVzip's hidden
reconstruction requests (``ReconItem``), the requests and shared contexts to forget, and each scheduled
request's row key (the block that receives its first new token this step) and epoch (a request that starts
over gets a new epoch and its old state goes). A block that receives new KV belongs to one request (prefix
caching shares only full, computed blocks), so the key is unique in the batch.

Workers -> scheduler (``ContourReport``, vLLM's connector worker metadata): the outcome of every round item
on every rank, and the requests whose output of this step is wrong. An outcome is typed: ``Round``
(``freed``: the ``(slot, block id)`` pairs that hold nothing now; ``replaced``: ``(slot, old id, new id)``,
the round packed into private blocks, which take those slots; ``published``: the worker kept the round's
layout and the partial block's snapshot as a shared compressed context), ``Noop`` (nothing to evict),
``PlanFailed`` (nothing moved) or ``Recompute`` (bytes moved, then it failed). Ranks and pipeline stages
merge (``merge``): a block is freed only when every rank freed it, a slot is replaced when any rank wrote
into its private block; ranks that disagree on the outcome or the region make the request recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_contour.budget import PageBudget
from vllm_contour.config import RequestEviction


@dataclass(frozen=True)
class ScoresRef:
    """A kvzip round's context scores by the context's key (``reconstruction.context_key``): ``store`` — the
    owner's own reconstruction made them, the workers keep a copy under the key; else the owner takes a copy
    of those kept from an earlier request with the same context (no reconstruction ran for it)."""

    key: str
    epoch: int  # the owner's
    store: bool


@dataclass
class RoundItem:
    """Scheduler -> worker: run an eviction round for this request after the current step's forward."""

    req_id: str
    block_ids: list[int]  # all blocks of the request, logical order (freed ones are vLLM's null block)
    num_tokens: int  # tokens with KV after this step
    params: RequestEviction
    budget: PageBudget  # the request's page budget, computed once by the scheduler side
    seq: int  # round number of the request (reports carry it back; stale ones are ignored)
    # private blocks to pack the kept pages into (some of the request's blocks are hashed for prefix caching
    # or shared with another request): the round reads the originals and writes only these; None: in place
    fresh_ids: list[int] | None = None
    # a context round whose result is shared: (entry id, partial block, its snapshot block); the worker
    # copies the partial block into the snapshot after the round and keeps the layout under the entry id
    publish: tuple[int, int | None, int | None] | None = None
    scores: ScoresRef | None = None  # a kvzip round's context scores, kept or taken by the context's key


@dataclass
class CaptureItem:
    """Scheduler -> worker: this step's tokens ``[start, end)`` (absolute positions) of the request fall in the
    observation window of its next round; every layer writes their queries into ``pages``, row
    ``position - window_start``."""

    req_id: str
    start: int
    end: int
    window: int
    window_start: int = 0  # the window is [window_start, round_at)
    round_at: int = 0
    # blocks its queries are written into; [] the whole window is in this step (kept for its round); None a
    # hidden reconstruction request's (folded into its owner's scores)
    pages: list[int] | None = None


@dataclass
class ReconItem:
    """Scheduler -> worker: this step computes repeat tokens of a hidden request reconstructing its owner's
    context (``integration/reconstruction/``): fold their KVzip attention over the context keys ``span``
    into the owner's scores (``[L, H, context_len]``)."""

    req_id: str  # the hidden request (its captured queries)
    owner: str
    epoch: int  # the owner's: scores of an earlier epoch are dropped
    span: tuple[int, int]
    repeat_start: int
    context_len: int
    block_ids: list[int]  # the hidden request's blocks up to its last token of the step


@dataclass
class ContourMetadata(KVConnectorMetadata):
    rounds: list[RoundItem] = field(default_factory=list)
    capture: list[CaptureItem] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)
    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # req -> (row key block, epoch)
    row_keys: dict[str, int] = field(default_factory=dict)  # every scheduled request -> its row key block
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
